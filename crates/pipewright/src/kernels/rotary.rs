//! Rotary position embedding (RoPE, Hugging Face's `rotate_half` layout), fused: each row of
//! a head's width rotated in one pass, pairs `(i, i + hd/2)` by the angle of the row's
//! position. The rotation is orthogonal, so the backward is the same pass by the opposite
//! angles.

use std::sync::{Arc, OnceLock};

use candle_core::{CpuStorage, Layout, Tensor};

use super::{custom_op, dispatch, input, par, storage, Out, Real};

const NAME: &str = "pipewright-rope";

/// The angles of positions `start..start + t`: frequency `i` is `inv[i]` and the angle of
/// position `p` is `p * inv[i]` in f32. A GPU thread computes its pair's angle from `start`
/// and `inv`; the CPU reads `cos`/`sin` tables `(t, hd/2)`, made on its first use and kept for
/// the backward ([`Angles::tables`]).
pub(crate) struct Angles {
    start: usize,
    t: usize,
    inv: Vec<f32>,
    tables: OnceLock<(Vec<f32>, Vec<f32>)>,
}

impl Angles {
    /// Positions `start..start + t` of heads `hd` wide, frequencies `theta^(-2i/hd)` (in f64,
    /// rounded to f32, as transformers computes them).
    pub(crate) fn new(start: usize, t: usize, hd: usize, theta: f64) -> Self {
        let inv = (0..hd / 2)
            .map(|i| (1.0 / theta.powf(2.0 * i as f64 / hd as f64)) as f32)
            .collect();
        Self {
            start,
            t,
            inv,
            tables: OnceLock::new(),
        }
    }

    /// `cos` and `sin` of every position's angles, row-major `(t, hd/2)`.
    pub(crate) fn tables(&self) -> (&[f32], &[f32]) {
        let (cos, sin) = self.tables.get_or_init(|| {
            let n = self.t * self.inv.len();
            let (mut cos, mut sin) = (Vec::with_capacity(n), Vec::with_capacity(n));
            for p in self.start..self.start + self.t {
                for &f in &self.inv {
                    let a = p as f32 * f;
                    cos.push(a.cos());
                    sin.push(a.sin());
                }
            }
            (cos, sin)
        });
        (cos, sin)
    }
}

/// `x` `(batch, heads, t, hd)` rotated by its positions' [`Angles`]; `sign` -1 rotates back.
#[derive(Clone)]
pub(crate) struct Rope {
    pub(crate) angles: Arc<Angles>,
    pub(crate) sign: f32,
}

/// [`Rope`] of a tensor, with its fused backward.
pub(crate) fn rope(x: &Tensor, angles: Angles) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op1(Rope {
        angles: Arc::new(angles),
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

impl Rope {
    /// `(t, head_dim)` of `l`, checked against the angles.
    fn geometry(&self, l: &Layout) -> candle_core::Result<(usize, usize)> {
        let dims = l.shape().dims();
        let a = &self.angles;
        match dims {
            [.., t, hd] if hd % 2 == 0 && *t == a.t && hd / 2 == a.inv.len() => Ok((*t, *hd)),
            _ => candle_core::bail!(
                "{NAME}: expects (..., {}, {}) for the angles of {} positions, got {dims:?}",
                a.t,
                2 * a.inv.len(),
                a.t
            ),
        }
    }
}

custom_op! {
    CustomOp1 for Rope, NAME, (s: l),
    cpu |this| {
        let (t, hd) = this.geometry(l)?;
        let (cos, sin) = this.angles.tables();
        dispatch!(NAME, s, |s: T| Ok((
            storage(rotate::<T>(&input(s, l, NAME)?, hd, t, cos, sin, this.sign)),
            l.shape().clone()
        )))
    },
    cuda |this| {
        let (t, hd) = this.geometry(l)?;
        cuda::forward(this, s, l, (t, hd))
    },
    fn bwd(&self, _x: &Tensor, _y: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let back = Rope {
            sign: -self.sign,
            ..self.clone()
        };
        Ok(Some(g.contiguous()?.apply_op1_no_bwd(&back)?))
    }
}

/// The same on a CUDA device (kernels/cuda/rotary.cu); the frequencies go up with each call
/// (`head_dim / 2` floats).
#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::{CudaStorage, Layout, Result, Shape};

    use super::{Rope, NAME};
    use crate::kernels::gpu::{self, typed, PushKernelArg};

    pub(super) fn forward(
        op: &Rope,
        s: &CudaStorage,
        l: &Layout,
        (t, hd): (usize, usize),
    ) -> Result<(CudaStorage, Shape)> {
        let (dev, n) = (s.device(), l.shape().elem_count());
        let (half, pairs) = (hd / 2, n / 2);
        let (start, sign) = (op.angles.start, op.sign);
        let none: &[f32] = &[0.0];
        let inv = dev.clone_htod(if op.angles.inv.is_empty() {
            none
        } else {
            &op.angles.inv
        })?;
        typed!(NAME, s.dtype(), |T| {
            let x = gpu::view::<T>(s, l, NAME)?;
            let mut y = gpu::alloc::<T>(dev, n)?;
            let f = gpu::func(dev, &gpu::ROTARY, "rope", s.dtype())?;
            gpu::launch(&f, gpu::elementwise(pairs), pairs, |b| {
                b.arg(&x).arg(&mut y).arg(&inv).arg(&pairs).arg(&half);
                b.arg(&t).arg(&start).arg(&sign);
            })?;
            Ok((
                CudaStorage::wrap_cuda_slice(y, dev.clone()),
                l.shape().clone(),
            ))
        })
    }
}
