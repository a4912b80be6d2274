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
//! multiplied parameter and token (not the embedding's table, nor the experts a token's router
//! leaves), plus attention's 12 x layers x width x sequence per token, as PaLM's MFU counts
//! them), which `PW_BENCH_PEAK_TFLOPS` turns into MFU. On a GPU it also prints the
//! peak GPU memory of the timed steps (the CUDA memory pool's high-water mark, as
//! `torch.cuda.max_memory_allocated` reads PyTorch's), and `PW_CUDA_PROFILE=1` brackets the
//! timed steps with `cuProfilerStart`/`Stop` for `ncu --profile-from-start off`
//! (`tools/gpu-checks.sh` sums its kernel times by kind with `tools/gpu_kernels.py`).

use std::time::Instant;

use candle_core::{Device, Tensor};
use pipewright::distributed::comm::local;
use pipewright::distributed::topology::Layout;
use pipewright::engine::spec::TrainSpec;
use pipewright::engine::varuna::{Varuna, VarunaOptions};
use pipewright::model::nn::optim::{AdamW, AdamWConfig, LrSchedule, Optimizer};
use pipewright::model::precision::Precision;
use pipewright::model::Sequential;
use pipewright::Batch;
use pipewright_models::moe::{MoeConfig, MoeNames};
use pipewright_models::{gpt, llama, GptConfig, LlamaConfig, TIED};
use rand::{Rng, SeedableRng};

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// The benched model: its layers, tied pairs, vocabulary and sequence, and what the model
/// FLOPs of a step count (PaLM's: 6 per multiplied parameter and token, plus attention's 12 x
/// layers x width x sequence per token).
struct Bench {
    model: Sequential,
    tied: Vec<(String, String)>,
    vocab: usize,
    seq: usize,
    layers: usize,
    /// Attention's width: heads x head dimension.
    width: usize,
    /// Parameters a token does not multiply: the embedding's second copy (a tied head) or its
    /// table (an untied one), and the experts a token's router does not choose.
    idle: usize,
}

/// The model `PW_BENCH_SIZE` names (the module's header), with `PW_BENCH_VOCAB` replacing its
/// vocabulary: 50304 (a multiple of 64) against GPT-2's odd 50257 asks whether the head's
/// products leave cuBLAS's fast kernels for want of 16-byte-aligned rows.
fn bench_model() -> pipewright::Result<Bench> {
    let gpt_of = |n_layer, n_head, n_embd, vocab: usize, seq| -> pipewright::Result<Bench> {
        let vocab = env_or("PW_BENCH_VOCAB", vocab);
        let cfg = GptConfig {
            vocab_size: vocab,
            block_size: seq,
            n_layer,
            n_head,
            n_embd,
            dropout: 0.0,
        };
        Ok(Bench {
            model: gpt(cfg)?,
            tied: vec![(TIED.0.into(), TIED.1.into())],
            vocab,
            seq,
            layers: n_layer,
            width: cfg.n_embd,
            idle: vocab * cfg.n_embd,
        })
    };
    let llama_of = |mut cfg: LlamaConfig| -> pipewright::Result<Bench> {
        cfg.vocab_size = env_or("PW_BENCH_VOCAB", cfg.vocab_size);
        let head = cfg.head_dim.unwrap_or(cfg.dim / cfg.n_head);
        let unchosen = cfg.moe.map_or(0, |m| {
            cfg.n_layer * (m.n_experts - m.top_k) * 3 * cfg.dim * m.moe_hidden
        });
        Ok(Bench {
            model: llama(cfg)?,
            tied: vec![],
            vocab: cfg.vocab_size,
            seq: cfg.block_size,
            layers: cfg.n_layer,
            width: cfg.n_head * head,
            idle: cfg.vocab_size * cfg.dim + unchosen,
        })
    };
    match std::env::var("PW_BENCH_SIZE").as_deref() {
        Ok("gpt2") => gpt_of(12, 12, 768, 50257, 1024),
        Ok("gpt-1.3b") => gpt_of(24, 16, 2048, 50257, 1024),
        // A Llama 3.2 1B-class shape with grouped-query attention (its head untied).
        Ok("llama-1b") => llama_of(LlamaConfig {
            n_kv_head: 8,
            hidden: 8192,
            rope_theta: 500_000.0,
            ..LlamaConfig::new(128_256, 2048, 16, 32, 2048)
        }),
        // A small Mixtral: 8 experts, 2 a token, in every block; no load-balancing term (as
        // transformers' loss without router logits).
        Ok("moe-small") => llama_of(LlamaConfig {
            n_kv_head: 4,
            moe: Some(MoeConfig {
                n_experts: 8,
                top_k: 2,
                moe_hidden: 3584,
                shared_experts: 0,
                norm_topk: true,
                aux_loss_coef: 0.0,
                names: MoeNames::Mixtral,
                moe_every: 1,
            }),
            ..LlamaConfig::new(32_000, 1024, 8, 16, 1024)
        }),
        _ => gpt_of(4, 8, 512, 4096, 256),
    }
}

fn main() -> pipewright::Result<()> {
    let Bench {
        model,
        tied,
        vocab,
        seq,
        layers,
        width,
        idle,
    } = bench_model()?;
    let batch = env_or("PW_BENCH_BATCH", 8usize);
    let steps: usize = env_or("PW_BENCH_STEPS", 5);
    let device = pipewright::runtime::device::device(
        &std::env::var("PW_BENCH_DEVICE").unwrap_or_else(|_| "cpu".into()),
        0,
    )?;
    let precision: Precision = std::env::var("PW_BENCH_PRECISION")
        .unwrap_or_else(|_| "f32".into())
        .parse()?;
    let opts = VarunaOptions {
        shared_weights: tied,
        device,
        ..VarunaOptions::of(TrainSpec {
            precision,
            optim: pipewright::model::nn::optim::OptimSpec {
                lr: LrSchedule::Constant { lr: 1e-4 },
                ..Default::default()
            },
            ..TrainSpec::new(Layout::new(1, 1, 1)?, batch, batch, 1)
        })
    };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    let ids: Vec<u32> = (0..batch * (seq + 1))
        .map(|_| rng.random_range(0..vocab as u32))
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
    let tokens = (batch * seq) as f64;
    let flops = tokens * (6.0 * (n_params - idle) as f64 + 12.0 * (layers * width * seq) as f64);
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
