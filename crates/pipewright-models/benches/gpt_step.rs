//! One training step (forward, backward, AdamW) of a GPT with d 512, 4 layers, 8 heads,
//! vocabulary 4096, sequence 256, batch 8, f32 on the CPU. Prints the median of the timed
//! steps; `tools/bench_gpt_vs_torch.sh` runs it beside `tools/bench_torch.py` and prints the
//! ratio. `PW_BENCH_STEPS` sets the number of timed steps (default 5).

use std::time::Instant;

use candle_core::{Device, Tensor};
use pipewright::nn::optim::{AdamW, AdamWConfig, LrSchedule};
use pipewright::nn::Init;
use pipewright::serial::{SerialTrainer, TrainOptions};
use pipewright_models::{gpt, GptConfig, TIED};
use rand::{Rng, SeedableRng};

fn main() -> pipewright::Result<()> {
    let cfg = GptConfig {
        vocab_size: 4096,
        block_size: 256,
        n_layer: 4,
        n_head: 8,
        n_embd: 512,
        dropout: 0.0,
    };
    let (batch, seq) = (8, 256);
    let steps: usize = std::env::var("PW_BENCH_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    let stage = gpt(cfg)?.build(&Init::cpu(0))?;
    let n_params = stage.num_params();
    let opt = Box::new(AdamW::new(stage.params(), AdamWConfig::default())?);
    let mut t = SerialTrainer::new(
        stage,
        opt,
        TrainOptions {
            seed: 0,
            chunks: 1,
            clip: None,
            schedule: LrSchedule::Constant { lr: 1e-4 },
            tied: vec![(TIED.0.into(), TIED.1.into())],
            deferred_batch_norm: false,
        },
    )?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    let ids: Vec<u32> = (0..batch * (seq + 1))
        .map(|_| rng.random_range(0..4096))
        .collect();
    let all = Tensor::from_vec(ids, (batch, seq + 1), &Device::Cpu)?;
    let x = all.narrow(1, 0, seq)?.contiguous()?;
    let y = all
        .narrow(1, 1, seq)?
        .to_dtype(candle_core::DType::I64)?
        .contiguous()?;
    t.step(&x, &y)?; // warm-up
    let mut times = Vec::new();
    for _ in 0..steps {
        let s = Instant::now();
        t.step(&x, &y)?;
        times.push(s.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let median = times[times.len() / 2];
    println!(
        "gpt_step params={n_params} batch={batch} seq={seq} steps={steps} times_ms={times:.1?}"
    );
    println!("pipewright_median_ms {median:.1}");
    Ok(())
}
