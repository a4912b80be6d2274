//! GELU, tanh approximation (GPT-2's `gelu_new`), fused: one pass forward, one pass backward.

use candle_core::{CpuStorage, Tensor};

use super::{custom_op, dispatch, input, par_elems, storage, Out, Real};

const NAME: &str = "pipewright-gelu";
/// sqrt(2 / pi)
const K: f64 = 0.797_884_560_802_865_4;
const C: f64 = 0.044_715;

/// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))` of a CPU f32/f64 tensor, with a fused
/// backward.
pub(crate) fn gelu(x: &Tensor) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op1(Gelu)
}

/// `g` times GELU's slope at `x` (what GELU's backward gives its input for the output's
/// gradient `g`; a deferred weight gradient's linear takes GELU of its input inside).
pub(crate) fn input_grad(x: &Tensor, g: &Tensor) -> candle_core::Result<Tensor> {
    x.contiguous()?
        .apply_op2_no_bwd(&g.contiguous()?, &GeluGrad)
}

struct Gelu;
struct GeluGrad;

fn map<T: Real>(n: usize, f: impl Fn(usize, &mut [T]) + Sync) -> Vec<T> {
    let mut out = Out::new(n);
    let rows = out.rows();
    par_elems(n, |r| {
        // SAFETY: the ranges are disjoint and within `n`.
        f(r.start, unsafe { rows.get(r) });
    });
    // SAFETY: the blocks cover `0..n`.
    unsafe { out.into_vec(n) }
}

/// `0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u))`: written so, GELU has no cancellation where
/// `tanh(u)` is near -1 (negative inputs), so small outputs keep their relative precision
/// instead of being multiples of the rounding error of `1 + tanh(u)`. Writes `exp(-2u)` of
/// each `x` into `out`.
#[inline]
fn e2u<T: Real>(x: &[T], out: &mut [T]) {
    let (k, c) = (T::from(K).unwrap(), T::from(C).unwrap());
    for (o, &v) in out.iter_mut().zip(x) {
        *o = -(k + k) * (v + c * v * v * v);
    }
    T::exp_slice_exact(out);
}

/// GELU of every element of `x`.
pub(crate) fn forward<T: Real>(x: &[T]) -> Vec<T> {
    map(x.len(), |start, out| {
        let x = &x[start..start + out.len()];
        e2u(x, out);
        for (o, &v) in out.iter_mut().zip(x) {
            *o = v / (T::one() + *o);
        }
    })
}

/// GELU's derivative at `v` from `e = exp(-2u)`: `s + x s (1 - s) 2u'` with
/// `s = 1 / (1 + e)`, `u' = sqrt(2/pi) (1 + 3 0.044715 x^2)`.
#[inline]
fn slope<T: Real>(v: T, e: T) -> T {
    let one = T::one();
    let (k2, c3) = (T::from(2.0 * K).unwrap(), T::from(3.0 * C).unwrap());
    let s = one / (one + e);
    // 1 - s = e s; where e overflows, s is 0 and so is the derivative.
    let s1 = if e.is_finite() { e * s } else { one };
    s + v * s * s1 * k2 * (one + c3 * v * v)
}

fn backward<T: Real>(x: &[T], g: &[T]) -> Vec<T> {
    map(x.len(), |start, out| {
        let (x, g) = (&x[start..start + out.len()], &g[start..start + out.len()]);
        e2u(x, out);
        for ((o, &v), &gv) in out.iter_mut().zip(x).zip(g) {
            *o = gv * slope(v, *o);
        }
    })
}

/// GELU of every element of `x` and its derivative there, from one exponential each.
pub(crate) fn values_and_slopes<T: Real>(x: &[T]) -> (Vec<T>, Vec<T>) {
    let n = x.len();
    let (mut a, mut d) = (Out::new(n), Out::new(n));
    let (ar, dr) = (a.rows(), d.rows());
    par_elems(n, |r| {
        // SAFETY: the ranges are disjoint and within `n`, in both buffers.
        let (av, dv) = unsafe { (ar.get(r.clone()), dr.get(r.clone())) };
        let x = &x[r];
        e2u(x, dv);
        for ((a, d), &v) in av.iter_mut().zip(dv.iter_mut()).zip(x) {
            let e = *d;
            // As `forward` computes it, so the backward's GELU is the forward's, bit for bit.
            *a = v / (T::one() + e);
            *d = slope(v, e);
        }
    });
    // SAFETY: the blocks covered `0..n` of both.
    unsafe { (a.into_vec(n), d.into_vec(n)) }
}

custom_op! {
    CustomOp1 for Gelu, NAME, (s: l),
    cpu |_| {
        dispatch!(NAME, s, |s: T| Ok((
            storage(forward::<T>(&input(s, l, NAME)?)),
            l.shape().clone()
        )))
    },
    cuda |_| cuda::forward(s, l),
    fn bwd(&self, x: &Tensor, _y: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(input_grad(x, g)?))
    }
}

custom_op! {
    CustomOp2 for GeluGrad, "pipewright-gelu-grad", (s1: l1, s2: l2),
    cpu |_| {
        dispatch!(NAME, s1, |s1: T| Ok((
            storage(backward::<T>(&input(s1, l1, NAME)?, &input(s2, l2, NAME)?)),
            l1.shape().clone()
        )))
    },
    cuda |_| cuda::backward(s1, l1, s2, l2)
}

/// The same on a CUDA device (kernels/cuda/gelu.cu).
#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::{CudaStorage, Layout, Result, Shape};

    use super::NAME;
    use crate::kernels::gpu::{self, typed, PushKernelArg};

    pub(super) fn forward(s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let (dev, n) = (s.device(), l.shape().elem_count());
        typed!(NAME, s.dtype(), |T| {
            let x = gpu::view::<T>(s, l, NAME)?;
            let mut y = gpu::alloc::<T>(dev, n)?;
            let f = gpu::func(dev, &gpu::GELU, "gelu_fwd", s.dtype())?;
            gpu::launch(&f, gpu::elementwise(n), n, |b| {
                b.arg(&x).arg(&mut y).arg(&n);
            })?;
            Ok((
                CudaStorage::wrap_cuda_slice(y, dev.clone()),
                l.shape().clone(),
            ))
        })
    }

    pub(super) fn backward(
        s: &CudaStorage,
        l: &Layout,
        sg: &CudaStorage,
        lg: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (dev, n) = (s.device(), l.shape().elem_count());
        typed!(NAME, s.dtype(), |T| {
            let (x, g) = (gpu::view::<T>(s, l, NAME)?, gpu::view::<T>(sg, lg, NAME)?);
            let mut dx = gpu::alloc::<T>(dev, n)?;
            let f = gpu::func(dev, &gpu::GELU, "gelu_bwd", s.dtype())?;
            gpu::launch(&f, gpu::elementwise(n), n, |b| {
                b.arg(&x).arg(&g).arg(&mut dx).arg(&n);
            })?;
            Ok((
                CudaStorage::wrap_cuda_slice(dx, dev.clone()),
                l.shape().clone(),
            ))
        })
    }
}
