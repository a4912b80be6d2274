//! How fast a device's fused causal attention kernel runs, measured: the planner's matrix
//! product curve says how candle's products run, but pipewright's CPU attention is a kernel
//! of its own (`kernels/attention.rs`: scores in scratch memory, the backward recomputing
//! them), whose rate no product timing predicts. `pipewright profile --gemm` times it at a
//! few shapes ([`time_fused_attention`]) and the planner costs a fused attention layer at
//! that rate.
//!
//! Work is counted as the kernel does it: the two products over the causal half, `2 seq^2
//! head_dim` FLOPs per (row, head). Its rate depends on the sequence: once a pair's `seq x
//! seq` scratch outgrows the caches it streams through memory (measured here: 75 GFLOP/s at
//! 512 tokens, 32 from 4096 on), and on a GPU flash attention's rate rises with the length
//! and the head's width (an H200: 137 TFLOP/s at 512 tokens in heads of 64, 546 at 8192 in
//! heads of 128), and its backward's multiple of the forward falls with the length (4.7 at 512
//! tokens, 3.1 at 8192). So the planner reads a layer's forward and backward rates off the
//! timings at the timed head width nearest its own (by ratio), by its sequence: log-log
//! between timed lengths, flat beyond the longest and shortest.

use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use serde::{Deserialize, Serialize};

use crate::{invalid, Result};

/// One shape of fused attention timed.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttentionTiming {
    /// Rows times heads.
    pub pairs: usize,
    /// Tokens per row.
    pub seq: usize,
    /// Width of a head.
    pub head_dim: usize,
    /// Median seconds of the forward.
    pub forward_s: f64,
    /// Median seconds of the backward.
    pub backward_s: f64,
}

impl AttentionTiming {
    /// FLOPs of the forward's causal half.
    pub fn work(&self) -> f64 {
        causal_work(self.pairs, self.seq, self.head_dim)
    }
}

/// FLOPs of the two products over the causal half for `pairs` (row, head) pairs.
pub fn causal_work(pairs: usize, seq: usize, head_dim: usize) -> f64 {
    2.0 * pairs as f64 * (seq as f64).powi(2) * head_dim as f64
}

/// A fused causal attention kernel's measured rates.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttentionRate {
    /// Backward seconds over forward seconds of all timings together (the long ones count
    /// most): the summary `profile --gemm` prints; the planner reads each shape's own
    /// backward ([`AttentionRate::backward_seconds`]).
    pub backward_ratio: f64,
    /// The timings the rates are read from.
    pub measured: Vec<AttentionTiming>,
}

impl AttentionRate {
    /// The rates of `timings` (2 or more, of positive seconds).
    pub fn fit(timings: &[AttentionTiming]) -> Result<Self> {
        let r = Self {
            backward_ratio: timings.iter().map(|t| t.backward_s).sum::<f64>()
                / timings.iter().map(|t| t.forward_s).sum::<f64>(),
            measured: timings.to_vec(),
        };
        r.check("the attention timings")?;
        Ok(r)
    }

    /// FLOP/s of the forward's causal work over `seq` tokens in heads `head_dim` wide, read off
    /// the timings at the nearest timed width by length (the module's rule).
    pub fn flops_per_s(&self, seq: usize, head_dim: usize) -> f64 {
        self.rate(seq, head_dim, |t| t.forward_s)
    }

    /// Forward seconds of `pairs` (row, head) pairs over `seq` tokens, heads `head_dim` wide.
    pub fn forward_seconds(&self, pairs: usize, seq: usize, head_dim: usize) -> f64 {
        causal_work(pairs, seq, head_dim) / self.flops_per_s(seq, head_dim)
    }

    /// Backward seconds of the same, at the backward's own rate read off the timings.
    pub fn backward_seconds(&self, pairs: usize, seq: usize, head_dim: usize) -> f64 {
        causal_work(pairs, seq, head_dim) / self.rate(seq, head_dim, |t| t.backward_s)
    }

    /// FLOP/s of causal work over `seq` tokens done in the seconds `secs` picks from each
    /// timing, read off the timings at the timed head width nearest `head_dim` (by ratio; of
    /// two as near, the narrower): averaged where several share a length, interpolated in
    /// log-log between lengths, flat beyond.
    fn rate(&self, seq: usize, head_dim: usize, secs: fn(&AttentionTiming) -> f64) -> f64 {
        let apart = |w: usize| (w.max(1) as f64 / head_dim.max(1) as f64).ln().abs();
        let width = self
            .measured
            .iter()
            .map(|t| t.head_dim)
            .min_by(|a, b| apart(*a).total_cmp(&apart(*b)).then(a.cmp(b)))
            .expect("checked: timings exist");
        let mut rates: Vec<(usize, f64)> = self
            .measured
            .iter()
            .filter(|t| t.head_dim == width)
            .map(|t| (t.seq, t.work() / secs(t)))
            .collect();
        rates.sort_by_key(|r| r.0);
        let points: Vec<(f64, f64)> = rates
            .chunk_by(|a, b| a.0 == b.0)
            .map(|g| {
                let rate = g.iter().map(|r| r.1).sum::<f64>() / g.len() as f64;
                ((g[0].0 as f64).ln(), rate.ln())
            })
            .collect();
        let x = (seq.max(1) as f64).ln();
        let (first, last) = (points[0], points[points.len() - 1]);
        if x <= first.0 {
            return first.1.exp();
        }
        if x >= last.0 {
            return last.1.exp();
        }
        let i = points.iter().position(|p| p.0 >= x).expect("inside");
        let (a, b) = (points[i - 1], points[i]);
        (a.1 + (b.1 - a.1) * (x - a.0) / (b.0 - a.0)).exp()
    }

    /// Checks the rates; `what` names them in errors.
    pub fn check(&self, what: &str) -> Result<()> {
        let positive = |v: f64| v.is_finite() && v > 0.0;
        if self.measured.is_empty()
            || !positive(self.backward_ratio)
            || self
                .measured
                .iter()
                .any(|t| !positive(t.forward_s) || !positive(t.backward_s) || t.work() <= 0.0)
        {
            return Err(invalid!(
                "{what}: attention needs timings of positive seconds and sizes, and a positive \
                 backward_ratio"
            ));
        }
        Ok(())
    }
}

/// Times pipewright's fused causal attention on `device` in `dtype` at a few shapes (2 heads
/// of width 32 over 512 to 8192 tokens, 4 of width 64 over 1024): a warm-up, then the median
/// of `repeats` forwards and backwards. `None` where the kernel does not run (it is the CPU's,
/// in f32 or f64; elsewhere attention is products the curve already costs).
pub fn time_fused_attention(
    device: &Device,
    dtype: DType,
    repeats: usize,
) -> Result<Option<Vec<AttentionTiming>>> {
    if !device.is_cpu() || !matches!(dtype, DType::F32 | DType::F64) {
        return Ok(None);
    }
    let mut out = Vec::new();
    for (heads, head_dim, seq) in [
        (2, 32, 512),
        (2, 32, 2048),
        (2, 32, 4096),
        (2, 32, 8192),
        (4, 64, 1024),
    ] {
        let qkv = Var::from_tensor(
            &Tensor::randn(0f32, 1.0, (1, seq, 3 * heads * head_dim), device)?.to_dtype(dtype)?,
        )?;
        let scale = 1.0 / (head_dim as f64).sqrt();
        let run = || -> Result<(f64, f64)> {
            let start = Instant::now();
            let y = crate::kernels::attention::causal_attention(qkv.as_tensor(), heads, scale)?;
            let forward = start.elapsed().as_secs_f64();
            let loss = y.sum_all()?;
            let start = Instant::now();
            let grads = loss.backward()?;
            let backward = start.elapsed().as_secs_f64();
            drop(grads);
            Ok((forward, backward))
        };
        run()?;
        let mut runs = (0..repeats.max(1))
            .map(|_| run())
            .collect::<Result<Vec<_>>>()?;
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (mut f, mut b): (Vec<f64>, Vec<f64>) = runs.drain(..).unzip();
        out.push(AttentionTiming {
            pairs: heads,
            seq,
            head_dim,
            forward_s: median(&mut f),
            backward_s: median(&mut b),
        });
    }
    Ok(Some(out))
}
