//! One training step (forward, backward, AdamW) of a mixture-of-experts Llama (Mixtral's
//! blocks) through the production step: d 256, 4 layers, 8 query heads over 4 key/value
//! heads, 8 experts of width 512 with 2 per token in every block, vocabulary 4096, sequence
//! 256, batch 8, f32 on the CPU. `PW_EP` (default 1) splits the experts over that many ranks
//! (threads, dp = ep, the batch split between them). Prints the median of `PW_BENCH_STEPS`
//! timed steps (default 5) after one warm-up and the share of the ranks' time spent in the
//! experts' all-to-all exchanges; `tools/bench_torch_moe.py` times transformers'
//! `MixtralForCausalLM` at the same sizes (BENCHMARKS.md has both, side by side).

use std::time::Instant;

use candle_core::{Device, Tensor};
use pipewright::distributed::comm::{local, size_thread_pools};
use pipewright::distributed::topology::Layout;
use pipewright::engine::spec::TrainSpec;
use pipewright::engine::varuna::{Varuna, VarunaOptions};
use pipewright::model::nn::optim::{LrSchedule, OptimizerConfig};
use pipewright::parallel::data_parallel::shard_batch;
use pipewright::parallel::expert_parallel::exchange_seconds;
use pipewright::Batch;
use pipewright_models::moe::{MoeConfig, MoeNames};
use pipewright_models::{llama, LlamaConfig};
use rand::{Rng, SeedableRng};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn main() -> pipewright::Result<()> {
    // As the `pipewright` binary does: freed tensors' pages are reused, not faulted in anew.
    pipewright::runtime::memory::keep_freed_memory();
    let cfg = LlamaConfig {
        moe: Some(MoeConfig {
            n_experts: 8,
            top_k: 2,
            moe_hidden: 512,
            shared_experts: 0,
            norm_topk: true,
            aux_loss_coef: 0.02,
            names: MoeNames::Mixtral,
            moe_every: 1,
        }),
        ..LlamaConfig::new(4096, 256, 4, 8, 256)
    };
    let cfg = LlamaConfig {
        n_kv_head: 4,
        ..cfg
    };
    let (batch, seq) = (8usize, cfg.block_size);
    let (steps, ep) = (env("PW_BENCH_STEPS", 5), env("PW_EP", 1));
    size_thread_pools(ep);
    let opts = VarunaOptions::of(TrainSpec {
        optim: pipewright::model::nn::optim::OptimSpec {
            lr: LrSchedule::Constant { lr: 1e-4 },
            ..Default::default()
        },
        ..TrainSpec::new(Layout::new(1, 1, ep)?.with_ep(ep)?, batch, batch / ep, 1)
    });
    let model = llama(cfg)?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    let ids: Vec<u32> = (0..batch * (seq + 1))
        .map(|_| rng.random_range(0..cfg.vocab_size as u32))
        .collect();
    let all = Tensor::from_vec(ids, (batch, seq + 1), &Device::Cpu)?;
    let x = all.narrow(1, 0, seq)?.contiguous()?;
    let y = all
        .narrow(1, 1, seq)?
        .to_dtype(candle_core::DType::I64)?
        .contiguous()?;
    let b = Batch::pair(x, y);
    let mut runs = local::run(ep, |comm| {
        let mut t = Varuna::new(&model, Box::new(comm), opts.clone())?;
        t.set_optimizer(|ps| OptimizerConfig::default().build(ps, &[]))?;
        let mine = shard_batch(&b, t.coords().dp_rank, ep)?;
        let n = t.pipeline().total_params()?;
        t.step(&mine)?;
        // Every rank's exchanges since (the ranks step together: rank 0's window holds them).
        let before = exchange_seconds();
        let mut times = Vec::new();
        for _ in 0..steps {
            let s = Instant::now();
            t.step(&mine)?;
            times.push(s.elapsed().as_secs_f64() * 1e3);
        }
        Ok((n, times, exchange_seconds() - before))
    })?;
    let (n, mut times, spent) = runs.remove(0);
    let share = spent / ep as f64 / (times.iter().sum::<f64>() / 1e3);
    times.sort_by(|a, b| a.total_cmp(b));
    println!(
        "moe_step ep={ep} params={n} batch={batch} seq={seq} steps={steps} times_ms={times:.1?}"
    );
    println!("pipewright_median_ms {:.1}", times[times.len() / 2]);
    println!("all_to_all_share {:.3}", share);
    Ok(())
}
