//! A device measured for the planner (`pipewright profile --gemm`): [`GemmSweep::run`] times
//! a grid of matrix products (and the fused attention where the device has it), fits the
//! curve into a hardware description, and prints as the table of each product's measured and
//! fitted time beside the curve it fitted.

use std::fmt;

use candle_core::{DType, Device};

use super::attention_rate::time_fused_attention;
use super::gemm::{gemm_grid, gemm_grid_peak_bytes, time_gemms, GemmTiming};
use super::hardware::Hardware;
use crate::Result;

/// The products timed and the hardware description fitted to them.
#[derive(Clone, Debug)]
pub struct GemmSweep {
    /// Each product's median seconds.
    pub timings: Vec<GemmTiming>,
    /// The base description with the measured curve in place of its own.
    pub hardware: Hardware,
    /// The products' type (a half type's curve is the half one).
    pub dtype: DType,
}

impl GemmSweep {
    /// Times the grid of `scale` ([`gemm_grid`]) on `device` in `dtype` (five runs each, the
    /// median), and the fused attention where it runs, after checking the largest product's
    /// memory fits; `base` with the fitted curve, `source` (where it was measured) added to
    /// its name.
    pub fn run(
        base: &Hardware,
        device: &Device,
        dtype: DType,
        scale: usize,
        source: &str,
    ) -> Result<Self> {
        let q = dtype.size_in_bytes();
        crate::runtime::memory::check_fits(
            gemm_grid_peak_bytes(scale, q),
            &format!("timing products of --gemm-scale {scale}"),
            "give a smaller --gemm-scale",
        )?;
        let timings = time_gemms(&gemm_grid(scale), dtype, device, 5)?;
        let attention = time_fused_attention(device, dtype, 3)?;
        let hardware = base.with_measured_gemm(&timings, attention.as_deref(), q, source)?;
        Ok(Self {
            timings,
            hardware,
            dtype,
        })
    }
}

impl fmt::Display for GemmSweep {
    /// Each product measured and fitted, the curve's ceiling, bandwidth and overhead, and the
    /// fused attention's rates.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let half = self.dtype.size_in_bytes() == 2;
        let curve = self.hardware.gemm(half);
        let head = ["m", "n", "k", "batch", "measured", "fitted", "GFLOP/s"];
        let [m, n, k, b, t, c, r] = head;
        writeln!(f, "{m:>6} {n:>6} {k:>6} {b:>5} {t:>12} {c:>12} {r:>8}")?;
        for t in &self.timings {
            let g = &t.gemm;
            writeln!(
                f,
                "{:>6} {:>6} {:>6} {:>5} {:>10.1}us {:>10.1}us {:>8.1}",
                g.m,
                g.n,
                g.k,
                g.batch,
                t.seconds * 1e6,
                curve.seconds(g) * 1e6,
                g.flops() / t.seconds / 1e9
            )?;
        }
        write!(
            f,
            "curve ({}): ceiling {:.1} GFLOP/s ({:.0} % of the file's peak), bandwidth {:.2} \
             GB/s, overhead {:.1} us per product",
            self.dtype.as_str(),
            curve.ceiling_flops_per_s / 1e9,
            curve.ceiling_flops_per_s / self.hardware.peak_flops(half) * 100.0,
            curve.bandwidth_bytes_per_s / 1e9,
            curve.overhead_s * 1e6
        )?;
        let Some(rate) = &curve.attention else {
            return Ok(());
        };
        let mut widths: Vec<usize> = rate.measured.iter().map(|t| t.head_dim).collect();
        widths.sort_unstable();
        widths.dedup();
        for w in widths {
            write!(
                f,
                "\nfused attention, heads of {w}: {:.1} GFLOP/s of causal work forward at 512 \
                 tokens, {:.1} at 8192",
                rate.flops_per_s(512, w) / 1e9,
                rate.flops_per_s(8192, w) / 1e9
            )?;
        }
        write!(
            f,
            "\nfused attention: backward {:.2}x the forward over all timings",
            rate.backward_ratio
        )
    }
}
