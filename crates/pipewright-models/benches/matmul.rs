//! The matrix products of one step of the benchmark GPT (`gpt_step.rs`: 2048 rows of width
//! 512, vocabulary 4096), forward and backward layouts, through candle's matmul (the `gemm`
//! crate the fused linear layer calls too). Prints each product's GFLOP/s and the
//! flop-weighted total as `candle_gflops`; `tools/bench_matmul.sh` runs it beside PyTorch
//! (MKL) and NumPy (OpenBLAS) on the same shapes. `RAYON_NUM_THREADS` sets the threads.

use std::time::Instant;

use candle_core::{Device, Tensor};

/// `(name, m, k, n, lhs transposed, rhs transposed)`: `(m x k) (k x n)`.
pub const SHAPES: [(&str, usize, usize, usize, bool, bool); 8] = [
    ("c_attn x W", 2048, 512, 1536, false, false),
    ("c_fc x W", 2048, 512, 2048, false, false),
    ("mlp.c_proj x W", 2048, 2048, 512, false, false),
    ("lm_head x W^T", 2048, 512, 4096, false, true),
    ("c_fc dx = g W^T", 2048, 2048, 512, false, true),
    ("c_fc dW = x^T g", 512, 2048, 2048, true, false),
    ("lm_head dx = g W", 2048, 4096, 512, false, false),
    ("lm_head dW = g^T x", 4096, 2048, 512, true, false),
];

fn operand(rows: usize, cols: usize, transposed: bool) -> candle_core::Result<Tensor> {
    let dev = Device::Cpu;
    if transposed {
        Tensor::randn(0f32, 1.0, (cols, rows), &dev)?.t()
    } else {
        Tensor::randn(0f32, 1.0, (rows, cols), &dev)
    }
}

fn main() -> candle_core::Result<()> {
    let reps = 5;
    let (mut flops, mut secs) = (0.0, 0.0);
    for (name, m, k, n, ta, tb) in SHAPES {
        let (a, b) = (operand(m, k, ta)?, operand(k, n, tb)?);
        a.matmul(&b)?; // warm-up
        let mut times = Vec::new();
        for _ in 0..reps {
            let s = Instant::now();
            let c = a.matmul(&b)?;
            times.push(s.elapsed().as_secs_f64());
            drop(c);
        }
        times.sort_by(|x, y| x.partial_cmp(y).unwrap());
        let t = times[reps / 2];
        let f = 2.0 * (m * k * n) as f64;
        println!("{name:<20} {m}x{k}x{n}  {:.0} GFLOP/s", f / t / 1e9);
        flops += f;
        secs += t;
    }
    println!("candle_gflops {:.0}", flops / secs / 1e9);
    Ok(())
}
