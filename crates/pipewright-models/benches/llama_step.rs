//! One training step (forward, backward, AdamW) of a Llama through the production step
//! ([`Varuna`] at pp = tp = dp = 1): d 512, 4 layers, 8 query heads over 4 key/value heads, an
//! MLP of 1376, vocabulary 4096, sequence 256, batch 8, f32 on the CPU. Prints the median of
//! `PW_BENCH_STEPS` timed steps (default 5) after one warm-up; `tools/bench_torch_llama.py`
//! times transformers' `LlamaForCausalLM` at the same sizes (BENCHMARKS.md has both, side by
//! side).

use std::time::Instant;

use candle_core::{Device, Tensor};
use pipewright::distributed::comm::local;
use pipewright::distributed::topology::Layout;
use pipewright::engine::spec::TrainSpec;
use pipewright::engine::varuna::{Varuna, VarunaOptions};
use pipewright::model::nn::optim::{LrSchedule, OptimizerConfig};
use pipewright::Batch;
use pipewright_models::{llama, LlamaConfig};
use rand::{Rng, SeedableRng};

fn main() -> pipewright::Result<()> {
    // As the `pipewright` binary does: freed tensors' pages are reused, not faulted in anew.
    pipewright::runtime::memory::keep_freed_memory();
    let cfg = LlamaConfig {
        vocab_size: 4096,
        block_size: 256,
        n_layer: 4,
        n_head: 8,
        n_kv_head: 4,
        dim: 512,
        hidden: 1376,
        norm_eps: 1e-5,
        rope_theta: 10000.0,
        moe: None,
        head_dim: None,
        qk_norm: false,
    };
    let (batch, seq) = (8usize, cfg.block_size);
    let steps: usize = std::env::var("PW_BENCH_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let opts = VarunaOptions::of(TrainSpec {
        optim: pipewright::model::nn::optim::OptimSpec {
            lr: LrSchedule::Constant { lr: 1e-4 },
            ..Default::default()
        },
        ..TrainSpec::new(Layout::new(1, 1, 1)?, batch, batch, 1)
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
    let mut runs = local::run(1, |comm| {
        let mut t = Varuna::new(&model, Box::new(comm), opts.clone())?;
        t.set_optimizer(|ps| OptimizerConfig::default().build(ps, &[]))?;
        let n = t.pipeline().total_params()?;
        t.step(&b)?;
        let mut times = Vec::new();
        for _ in 0..steps {
            let s = Instant::now();
            t.step(&b)?;
            times.push(s.elapsed().as_secs_f64() * 1e3);
        }
        Ok((n, times))
    })?;
    let (n, mut times) = runs.remove(0);
    times.sort_by(|a, b| a.total_cmp(b));
    println!("llama_step params={n} batch={batch} seq={seq} steps={steps} times_ms={times:.1?}");
    println!("pipewright_median_ms {:.1}", times[times.len() / 2]);
    Ok(())
}
