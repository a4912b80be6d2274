//! Rotary position embedding (RoPE, Hugging Face's `rotate_half` layout), fused: each row of
//! a head's width rotated in one pass, pairs `(i, i + hd/2)` by the angle of the row's
//! position. The rotation is orthogonal, so the backward is the same pass by the opposite
//! angles.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};

use super::{dispatch, input, par, storage, Out, Real};

const NAME: &str = "pipewright-rope";

/// `x` `(batch, heads, t, hd)` rotated by `cos`/`sin` `(t, hd/2)` (row-major f32 tables of
/// the positions' angles); `sign` -1 rotates back.
#[derive(Clone)]
pub(crate) struct Rope {
    pub(crate) cos: Arc<Vec<f32>>,
    pub(crate) sin: Arc<Vec<f32>>,
    pub(crate) sign: f32,
}

/// [`Rope`] of a CPU tensor, with its fused backward.
pub(crate) fn rope(
    x: &Tensor,
    cos: Arc<Vec<f32>>,
    sin: Arc<Vec<f32>>,
) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op1(Rope {
        cos,
        sin,
        sign: 1.0,
    })
}

fn rotate<T: Real>(x: &[T], hd: usize, t: usize, cos: &[f32], sin: &[f32], sign: f32) -> Vec<T> {
    let (n, half) = (x.len(), hd / 2);
    let rows_total = n / hd;
    let mut out = Out::new(n);
    let rows = out.rows();
    par(rows_total, n, |r| {
        // SAFETY: the row ranges are disjoint and within `n`.
        let o = unsafe { rows.get(r.start * hd..r.end * hd) };
        for (k, row) in r.clone().enumerate() {
            let p = row % t;
            let (c, s) = (
                &cos[p * half..(p + 1) * half],
                &sin[p * half..(p + 1) * half],
            );
            let xi = &x[row * hd..(row + 1) * hd];
            let oi = &mut o[k * hd..(k + 1) * hd];
            for i in 0..half {
                let (cv, sv) = (T::from(c[i]).unwrap(), T::from(sign * s[i]).unwrap());
                let (a, b) = (xi[i], xi[i + half]);
                oi[i] = a * cv - b * sv;
                oi[i + half] = b * cv + a * sv;
            }
        }
    });
    // SAFETY: the rows cover `0..n`.
    unsafe { out.into_vec(n) }
}

impl CustomOp1 for Rope {
    fn name(&self) -> &'static str {
        NAME
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let dims = l.shape().dims();
        let (t, hd) = match dims {
            [.., t, hd] if hd % 2 == 0 && *t * hd / 2 == self.cos.len() => (*t, *hd),
            _ => candle_core::bail!(
                "{NAME}: expects (..., t, head_dim) with an even head_dim matching a table of \
                 {} angles, got {dims:?}",
                self.cos.len()
            ),
        };
        dispatch!(NAME, s, |s: T| Ok((
            storage(rotate::<T>(
                &input(s, l, NAME)?,
                hd,
                t,
                &self.cos,
                &self.sin,
                self.sign
            )),
            l.shape().clone()
        )))
    }

    fn bwd(&self, _x: &Tensor, _y: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let back = Rope {
            sign: -self.sign,
            ..self.clone()
        };
        Ok(Some(g.contiguous()?.apply_op1_no_bwd(&back)?))
    }
}
