//! Softmax over the last dimension, fused with the scale of attention scores and, for
//! attention, the causal mask: the masked scores are never read, their probabilities written
//! as zeros, and no (T x T) mask tensor is built or added.

use candle_core::{CpuStorage, Layout, Tensor};

use super::{custom_op, dispatch, input, par, row_max, storage, Out, Real};

const NAME: &str = "pipewright-softmax";

/// `softmax(scale * x)` over the last dimension of a CPU f32/f64 tensor, with a fused
/// backward. `causal`: `x` is `(..., queries, keys)` with `keys >= queries`, and query `i`
/// sees keys `0..=i + keys - queries` (the last `queries` keys are the queries' own positions).
pub(crate) fn softmax(x: &Tensor, scale: f64, causal: bool) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op1(Softmax { scale, causal })
}

#[derive(Clone, Copy)]
struct Softmax {
    scale: f64,
    causal: bool,
}

impl Softmax {
    /// Row length, queries per matrix, and how many keys row `i` of a matrix sees.
    fn geometry(&self, l: &Layout) -> candle_core::Result<(usize, usize, usize)> {
        let dims = l.dims();
        let keys = *dims.last().unwrap_or(&1);
        let queries = if dims.len() >= 2 {
            dims[dims.len() - 2]
        } else {
            1
        };
        if self.causal && keys < queries {
            candle_core::bail!(
                "{NAME}: a causal softmax needs keys ({keys}) >= queries ({queries})"
            );
        }
        Ok((keys.max(1), queries.max(1), keys.saturating_sub(queries)))
    }

    /// Keys row `r` sees.
    fn seen(&self, r: usize, keys: usize, queries: usize, offset: usize) -> usize {
        if self.causal {
            r % queries + offset + 1
        } else {
            keys
        }
    }

    fn forward<T: Real>(&self, x: &[T], keys: usize, queries: usize, offset: usize) -> Vec<T> {
        let scale = T::from(self.scale).unwrap();
        let mut out = Out::new(x.len());
        let o = out.rows();
        par(x.len() / keys, x.len(), |r| {
            for i in r {
                let row = &x[i * keys..(i + 1) * keys];
                let n = self.seen(i, keys, queries, offset);
                // SAFETY: row i is this call's alone.
                let y = unsafe { o.get(i * keys..(i + 1) * keys) };
                let m = row_max(&row[..n]);
                for j in 0..n {
                    y[j] = (row[j] - m) * scale;
                }
                T::exp_slice(&mut y[..n]);
                let sum = y[..n].iter().copied().sum::<T>();
                let inv = sum.recip();
                for v in &mut y[..n] {
                    *v *= inv;
                }
                for v in &mut y[n..] {
                    *v = T::zero();
                }
            }
        });
        // SAFETY: every row was written.
        unsafe { out.into_vec(x.len()) }
    }

    /// `scale * y * (g - sum(g * y))` row by row.
    fn backward<T: Real>(
        &self,
        y: &[T],
        g: &[T],
        keys: usize,
        queries: usize,
        offset: usize,
    ) -> Vec<T> {
        let scale = T::from(self.scale).unwrap();
        let mut out = Out::new(y.len());
        let o = out.rows();
        par(y.len() / keys, y.len(), |r| {
            for i in r {
                let (yr, gr) = (&y[i * keys..(i + 1) * keys], &g[i * keys..(i + 1) * keys]);
                let n = self.seen(i, keys, queries, offset);
                // SAFETY: row i is this call's alone.
                let d = unsafe { o.get(i * keys..(i + 1) * keys) };
                let dot = (0..n).map(|j| yr[j] * gr[j]).sum::<T>();
                for j in 0..n {
                    d[j] = scale * yr[j] * (gr[j] - dot);
                }
                for v in &mut d[n..] {
                    *v = T::zero();
                }
            }
        });
        // SAFETY: every row was written.
        unsafe { out.into_vec(y.len()) }
    }
}

custom_op! {
    CustomOp1 for Softmax, NAME, (s: l),
    cpu |this| {
        let (keys, queries, offset) = this.geometry(l)?;
        dispatch!(NAME, s, |s: T| Ok((
            storage(this.forward::<T>(&input(s, l, NAME)?, keys, queries, offset)),
            l.shape().clone()
        )))
    },
    fn bwd(&self, _x: &Tensor, y: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(
            y.apply_op2_no_bwd(&g.contiguous()?, &SoftmaxGrad(*self))?,
        ))
    }
}

/// `scale * y * (g - sum(g * y))` row by row.
struct SoftmaxGrad(Softmax);

custom_op! {
    CustomOp2 for SoftmaxGrad, "pipewright-softmax-grad", (sy: ly, sg: lg),
    cpu |this| {
        let (keys, queries, offset) = this.0.geometry(ly)?;
        dispatch!(NAME, sy, |sy: T| Ok((
            storage(this.0.backward::<T>(
                &input(sy, ly, NAME)?,
                &input(sg, lg, NAME)?,
                keys,
                queries,
                offset
            )),
            ly.shape().clone()
        )))
    }
}
