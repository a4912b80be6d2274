//! One training step (forward, backward, AdamW) through the production step ([`Varuna`] at
//! pp = tp = dp = 1) of a GPT with d 512, 4 layers, 8 heads,
//! vocabulary 4096, sequence 256, batch 8, f32 on the CPU. Prints the median of the timed
//! steps; `tools/bench_gpt_vs_torch.sh` runs it beside `tools/bench_torch.py` and prints the
//! ratio. `PW_BENCH_STEPS` sets the number of timed steps (default 5). Under
//! `tools/profile_gpt_step.sh`, `PW_PERF_CTL` names `perf record`'s control FIFO: the timed
//! steps alone are sampled (not the model's construction or the warm-up).
//!
//! For a GPU (a build with the `cuda` feature), the same step at other sizes, read from the
//! environment as `tools/bench_torch.py` reads them: `PW_BENCH_SIZE=gpt2` (GPT-2 124M:
//! vocabulary 50257, d 768, 12 layers, 12 heads, sequence 1024) or `gpt-1.3b` (GPT-3 XL's
//! shapes: d 2048, 24 layers, 16 heads of 128), `PW_BENCH_BATCH`, `PW_BENCH_VOCAB`,
//! `PW_BENCH_DEVICE` (`cpu`, `cuda`, `cuda:N`) and `PW_BENCH_PRECISION` (`f32`, `bf16`,
//! `f16`). Besides the median it prints tokens/s and the model FLOPs of a step (6 per
//! parameter and token, plus attention's 12 x layers x d x sequence per token, as PaLM's MFU
//! counts them), which `PW_BENCH_PEAK_TFLOPS` turns into MFU. On a GPU it also prints the
//! peak GPU memory of the timed steps (the CUDA memory pool's high-water mark, as
//! `torch.cuda.max_memory_allocated` reads PyTorch's), and `PW_CUDA_PROFILE=1` brackets the
//! timed steps with `cuProfilerStart`/`Stop` for `ncu --profile-from-start off`
//! (`tools/gpu-checks.sh` sums its kernel times by kind with `tools/gpu_kernels.py`).

use std::time::Instant;

use candle_core::{Device, Tensor};
use pipewright::dist::comm::local;
use pipewright::dist::topology::Layout;
use pipewright::engine::spec::TrainSpec;
use pipewright::engine::varuna::{Varuna, VarunaOptions};
use pipewright::model::nn::optim::{AdamW, AdamWConfig, LrSchedule, Optimizer};
use pipewright::model::precision::Precision;
use pipewright::Batch;
use pipewright_models::{gpt, GptConfig, TIED};
use rand::{Rng, SeedableRng};

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn main() -> pipewright::Result<()> {
    let wide = |n_layer, n_head, n_embd| GptConfig {
        vocab_size: 50257,
        block_size: 1024,
        n_layer,
        n_head,
        n_embd,
        dropout: 0.0,
    };
    let cfg = match std::env::var("PW_BENCH_SIZE").as_deref() {
        Ok("gpt2") => wide(12, 12, 768),
        Ok("gpt-1.3b") => wide(24, 16, 2048),
        _ => GptConfig {
            vocab_size: 4096,
            block_size: 256,
            n_layer: 4,
            n_head: 8,
            n_embd: 512,
            dropout: 0.0,
        },
    };
    // `PW_BENCH_VOCAB` replaces the vocabulary size: 50304 (a multiple of 64) against GPT-2's
    // odd 50257 asks whether the head's products leave cuBLAS's fast kernels for want of
    // 16-byte-aligned rows (tools/gpu-checks.sh speed).
    let cfg = GptConfig {
        vocab_size: env_or("PW_BENCH_VOCAB", cfg.vocab_size),
        ..cfg
    };
    let (batch, seq) = (env_or("PW_BENCH_BATCH", 8usize), cfg.block_size);
    let steps: usize = env_or("PW_BENCH_STEPS", 5);
    let device = pipewright::runtime::device::device(
        &std::env::var("PW_BENCH_DEVICE").unwrap_or_else(|_| "cpu".into()),
        0,
    )?;
    let precision: Precision = std::env::var("PW_BENCH_PRECISION")
        .unwrap_or_else(|_| "f32".into())
        .parse()?;
    let opts = VarunaOptions {
        shared_weights: vec![(TIED.0.into(), TIED.1.into())],
        device,
        ..VarunaOptions::of(TrainSpec {
            lr: LrSchedule::Constant { lr: 1e-4 },
            precision,
            ..TrainSpec::new(Layout::new(1, 1, 1)?, batch, batch, 1)
        })
    };
    let model = gpt(cfg)?;
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
    let batch_of = Batch::pair(x, y);
    let mut runs = local::run(1, |comm| {
        let mut t = Varuna::new(&model, Box::new(comm), opts.clone())?;
        t.set_optimizer(|ps| {
            Ok(Box::new(AdamW::new(ps, AdamWConfig::default())?) as Box<dyn Optimizer>)
        })?;
        let n_params = t.pipeline().total_params()?;
        t.step(&batch_of)?; // warm-up
        let mut times = Vec::new();
        pipewright::runtime::memory::reset_gpu_peak(t.device());
        profile(true);
        for _ in 0..steps {
            let s = Instant::now();
            t.step(&batch_of)?;
            times.push(s.elapsed().as_secs_f64() * 1e3);
        }
        profile(false);
        Ok((
            n_params,
            times,
            pipewright::runtime::memory::gpu_peak_bytes(t.device()),
        ))
    })?;
    let (n_params, mut times, gpu_peak) = runs.remove(0);
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let median = times[times.len() / 2];
    println!(
        "gpt_step params={n_params} batch={batch} seq={seq} steps={steps} times_ms={times:.1?}"
    );
    println!("pipewright_median_ms {median:.1}");
    if let Some(b) = gpu_peak {
        println!("pipewright_peak_memory_bytes {b}");
    }
    // The head is tied to the embedding: one matrix, counted once (as PyTorch's parameters()
    // counts it), while the step holds a copy per end.
    let counted = (n_params - cfg.vocab_size * cfg.n_embd) as f64;
    let tokens = (batch * seq) as f64;
    let flops = tokens * (6.0 * counted + 12.0 * (cfg.n_layer * cfg.n_embd * seq) as f64);
    let per_s = tokens / (median / 1e3);
    print!(
        "pipewright_tokens_per_s {per_s:.0} model_tflop_per_step {:.3}",
        flops / 1e12
    );
    match std::env::var("PW_BENCH_PEAK_TFLOPS")
        .ok()
        .and_then(|p| p.parse::<f64>().ok())
    {
        Some(peak) => println!(" mfu {:.3}", flops / (median / 1e3) / (peak * 1e12)),
        None => println!(),
    }
    Ok(())
}

/// Starts (`on`) or stops sampling: writes to `perf record`'s control FIFO when
/// `PW_PERF_CTL` names one, and calls the CUDA profiler API when `PW_CUDA_PROFILE` is set.
fn profile(on: bool) {
    if let Ok(path) = std::env::var("PW_PERF_CTL") {
        use std::io::Write;
        if let Ok(mut f) = std::fs::OpenOptions::new().write(true).open(path) {
            let _ = writeln!(f, "{}", if on { "enable" } else { "disable" });
        }
    }
    #[cfg(feature = "cuda")]
    if std::env::var_os("PW_CUDA_PROFILE").is_some() {
        use candle_core::cuda::cudarc::driver::sys;
        // SAFETY: plain driver calls with no arguments; the step has made the context current.
        let r = unsafe {
            if on {
                sys::cuProfilerStart()
            } else {
                sys::cuProfilerStop()
            }
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            eprintln!("cuProfiler{}: {r:?}", if on { "Start" } else { "Stop" });
        }
    }
}
