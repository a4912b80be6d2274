//! Matrix products by shape: what one product costs on a device, as a roofline.
//!
//! A product of an `m x k` matrix by a `k x n` one (`batch` times, as attention's heads) does
//! `2 m n k` FLOPs and moves at least both operands and its result through memory. A device
//! runs it in `overhead_s + max(flops / ceiling, bytes / bandwidth)` ([`GemmCurve`]): a thin
//! product (a small dimension: few FLOPs per byte) is bound by memory, a large one runs near
//! the ceiling, and a small one pays the fixed cost of a kernel launch or a thread pool's wake-up,
//! so a product's share of the peak rises with its size towards `ceiling / peak`.
//!
//! The three numbers come from measurement: [`time_gemms`] times candle's products of
//! [`gemm_grid`]'s shapes on a device (`pipewright profile --gemm`) and [`GemmCurve::fit`]
//! fits them (least squares on the logarithms, every shape weighed by its time).
//! A hardware file without a curve uses `peak x efficiency` and its memory bandwidth with no
//! overhead ([`super::Hardware::gemm`]).

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

use super::attention_rate::AttentionRate;
use crate::{invalid, Result};

/// One matrix product: `batch` products of an `m x k` matrix by a `k x n` one.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Gemm {
    /// Rows of the left operand and of the result.
    pub m: usize,
    /// Columns of the right operand and of the result.
    pub n: usize,
    /// The inner dimension.
    pub k: usize,
    /// Independent products of this shape (1 for a linear layer, heads for attention).
    #[serde(default = "one")]
    pub batch: usize,
}

fn one() -> usize {
    1
}

impl Gemm {
    /// A single product.
    pub fn new(m: usize, n: usize, k: usize) -> Self {
        Self { m, n, k, batch: 1 }
    }

    /// Floating-point operations: a multiply and an add per term.
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64 * self.batch as f64
    }

    /// Bytes it reads and writes at least: both operands and the result, `dtype_bytes` each.
    pub fn bytes(&self, dtype_bytes: usize) -> f64 {
        let (m, n, k) = (self.m as f64, self.n as f64, self.k as f64);
        (m * k + k * n + m * n) * self.batch as f64 * dtype_bytes as f64
    }
}

/// One product timed on a device.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GemmTiming {
    /// Its shape.
    pub gemm: Gemm,
    /// Median seconds of one run.
    pub seconds: f64,
}

/// A device's matrix products as a roofline: `overhead_s + max(flops / ceiling, bytes /
/// bandwidth)` seconds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GemmCurve {
    /// FLOP/s a large product reaches.
    pub ceiling_flops_per_s: f64,
    /// Bytes per second a thin (memory-bound) product streams.
    pub bandwidth_bytes_per_s: f64,
    /// Seconds every product pays besides its work (a kernel launch, waking a thread pool).
    pub overhead_s: f64,
    /// Bytes of one element the curve was measured with (2: bf16/f16; 4: f32).
    pub dtype_bytes: usize,
    /// The timings it was fitted to (`pipewright profile --gemm`), kept to be read again.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub measured: Vec<GemmTiming>,
    /// The device's fused causal attention kernel, where it has one and it was timed (a
    /// fused attention layer is costed at this rate instead of the products' ceiling).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention: Option<AttentionRate>,
}

impl GemmCurve {
    /// A curve with no measurements.
    pub fn new(ceiling: f64, bandwidth: f64, overhead_s: f64, dtype_bytes: usize) -> Self {
        Self {
            ceiling_flops_per_s: ceiling,
            bandwidth_bytes_per_s: bandwidth,
            overhead_s,
            dtype_bytes,
            measured: Vec::new(),
            attention: None,
        }
    }

    /// Seconds of `g` (its elements the curve's width).
    pub fn seconds(&self, g: &Gemm) -> f64 {
        self.roofline(g.flops(), g.bytes(self.dtype_bytes)).0
    }

    /// Whether `g` is bound by memory rather than by the ceiling.
    pub fn memory_bound(&self, g: &Gemm) -> bool {
        self.roofline(g.flops(), g.bytes(self.dtype_bytes)).1
    }

    /// Seconds of a kernel doing `flops` over `bytes` of memory traffic, and whether memory
    /// bounds it (a fused kernel that is no single product goes through here too).
    pub fn roofline(&self, flops: f64, bytes: f64) -> (f64, bool) {
        let compute = flops / self.ceiling_flops_per_s;
        let memory = bytes / self.bandwidth_bytes_per_s;
        (self.overhead_s + compute.max(memory), memory > compute)
    }

    /// `g`'s share of `peak` FLOP/s.
    pub fn efficiency(&self, g: &Gemm, peak: f64) -> f64 {
        g.flops() / self.seconds(g) / peak
    }

    /// The curve through `timings` of `dtype_bytes`-byte products. The overhead is the
    /// fastest product's time (a product of a few thousand FLOPs is all overhead); the ceiling
    /// and the bandwidth minimise the squared error of the logarithms of the times, each shape
    /// weighed by its measured time (a step's time is mostly its large products: they should
    /// be right, a product of microseconds need only be near), found by a coordinate search
    /// from the fastest rates seen.
    pub fn fit(timings: &[GemmTiming], dtype_bytes: usize) -> Result<Self> {
        if timings.len() < 3 {
            return Err(invalid!(
                "a GEMM curve needs 3 timings or more, got {}",
                timings.len()
            ));
        }
        if timings
            .iter()
            .any(|t| !(t.seconds.is_finite() && t.seconds > 0.0) || t.gemm.flops() <= 0.0)
        {
            return Err(invalid!(
                "GEMM timings must be positive seconds of non-empty products"
            ));
        }
        let best = |f: &dyn Fn(&GemmTiming) -> f64| timings.iter().map(f).fold(0.0, f64::max);
        let overhead = timings.iter().map(|t| t.seconds).fold(f64::MAX, f64::min);
        // ln of ceiling and bandwidth.
        let mut x = [
            best(&|t| t.gemm.flops() / t.seconds).ln(),
            best(&|t| t.gemm.bytes(dtype_bytes) / t.seconds).ln(),
        ];
        let error = |x: &[f64; 2]| -> f64 {
            let c = GemmCurve::new(x[0].exp(), x[1].exp(), overhead, dtype_bytes);
            timings
                .iter()
                .map(|t| t.seconds * (c.seconds(&t.gemm) / t.seconds).ln().powi(2))
                .sum()
        };
        let mut e = error(&x);
        let mut step = 2f64.ln();
        while step > 1e-5 {
            let mut moved = false;
            for i in 0..2 {
                for dir in [1.0, -1.0] {
                    let mut y = x;
                    y[i] += dir * step;
                    let ey = error(&y);
                    if ey < e {
                        (x, e, moved) = (y, ey, true);
                    }
                }
            }
            if !moved {
                step /= 2.0;
            }
        }
        Ok(Self {
            measured: timings.to_vec(),
            ..Self::new(x[0].exp(), x[1].exp(), overhead, dtype_bytes)
        })
    }

    /// Checks the curve; `what` names it in errors.
    pub fn check(&self, what: &str) -> Result<()> {
        for (field, v) in [
            ("ceiling_flops_per_s", self.ceiling_flops_per_s),
            ("bandwidth_bytes_per_s", self.bandwidth_bytes_per_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(invalid!("{what}: {field} must be positive"));
            }
        }
        if !(self.overhead_s.is_finite() && self.overhead_s >= 0.0) {
            return Err(invalid!("{what}: overhead_s must be zero or more seconds"));
        }
        if self.dtype_bytes != 2 && self.dtype_bytes != 4 {
            return Err(invalid!(
                "{what}: dtype_bytes is 2 (bf16, f16) or 4 (f32), not {}",
                self.dtype_bytes
            ));
        }
        if let Some(a) = &self.attention {
            a.check(what)?;
        }
        Ok(())
    }
}

/// Bytes the largest product of [`gemm_grid`]`(scale)` holds (its two inputs and its output,
/// m = n = 4096 x scale, k = 256 x scale), in f64 so that an absurd scale is a number to refuse
/// before the grid's sizes overflow.
pub fn gemm_grid_peak_bytes(scale: usize, dtype_bytes: usize) -> f64 {
    let s = scale as f64;
    let (m, n, k) = (4096.0 * s, 4096.0 * s, 256.0 * s);
    (m * k + k * n + m * n) * dtype_bytes as f64
}

/// The shapes `pipewright profile --gemm` times: every `m` by every `n = k` from thin to
/// large (linear layers of narrow and wide models, tensor-parallel shards), and attention's
/// batched products (heads of width 32 to 128 over 256 to 1024 tokens). `scale` multiplies
/// every size: 1 is what a 2-core CPU times in seconds; a GPU wants 4 or 8 to reach its
/// ceiling.
pub fn gemm_grid(scale: usize) -> Vec<Gemm> {
    let mut out = Vec::new();
    for m in [16, 64, 256, 1024, 4096] {
        for nk in [32, 128, 512, 1024] {
            out.push(Gemm::new(m * scale, nk * scale, nk * scale));
        }
        out.push(Gemm::new(m * scale, 4096 * scale, 256 * scale));
        out.push(Gemm::new(m * scale, 256 * scale, 4096 * scale));
    }
    for (seq, d) in [(256, 32), (1024, 32), (512, 64), (1024, 128)] {
        let (seq, d) = (seq * scale, d * scale);
        out.push(Gemm {
            m: seq,
            n: seq,
            k: d,
            batch: 8,
        });
        out.push(Gemm {
            m: seq,
            n: d,
            k: seq,
            batch: 8,
        });
    }
    out
}

/// Products a timed run queues on a GPU before it waits (see [`time_gemms`]).
const GPU_QUEUED: usize = 10;

/// Output bytes a timed run may queue on a GPU: fewer copies of a large product's output.
const GPU_QUEUED_BYTES: usize = 1 << 30;

/// Times each of `shapes` on `device` in `dtype`: a warm-up, then the median of `repeats`
/// runs. On a GPU a run queues up to 10 copies of the product (within 1 GiB of outputs),
/// waits once and counts a share: a step queues its kernels behind each other, so what a
/// product costs it is its launch and its kernel, not the host's wait for the device (an
/// H200's fitted overhead: 16.6 us a product when each run waited, 9.2 queued).
pub fn time_gemms(
    shapes: &[Gemm],
    dtype: DType,
    device: &Device,
    repeats: usize,
) -> Result<Vec<GemmTiming>> {
    let repeats = repeats.max(1);
    let mut out = Vec::with_capacity(shapes.len());
    for g in shapes {
        let a = Tensor::randn(0f32, 1.0, (g.batch, g.m, g.k), device)?.to_dtype(dtype)?;
        let b = Tensor::randn(0f32, 1.0, (g.batch, g.k, g.n), device)?.to_dtype(dtype)?;
        let queued = if device.is_cpu() {
            1
        } else {
            let out_bytes = g.batch * g.m * g.n * dtype.size_in_bytes();
            (GPU_QUEUED_BYTES / out_bytes.max(1)).clamp(1, GPU_QUEUED)
        };
        let run = || -> Result<f64> {
            let start = Instant::now();
            // The outputs are dropped after the wait: freeing device memory may wait too.
            let outputs = (0..queued)
                .map(|_| a.matmul(&b))
                .collect::<candle_core::Result<Vec<_>>>()?;
            device.synchronize()?;
            let seconds = start.elapsed().as_secs_f64() / queued as f64;
            drop(outputs);
            Ok(seconds)
        };
        run()?;
        let mut times = (0..repeats).map(|_| run()).collect::<Result<Vec<_>>>()?;
        times.sort_by(f64::total_cmp);
        out.push(GemmTiming {
            gemm: *g,
            seconds: times[times.len() / 2],
        });
    }
    Ok(out)
}
