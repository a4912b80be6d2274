//! SwiGLU's gate, `silu(g) * u` (Llama's MLP), fused: one pass forward, and one pass backward
//! that writes both gradients from one exponential per element.

use candle_core::{CpuStorage, IndexOp, Layout, Shape, Tensor};

use super::{custom_op, dispatch, input, par_elems, storage, Out, Real};

const NAME: &str = "pipewright-swiglu";

/// `g * sigmoid(g) * u` of two CPU tensors of one shape and float type, with a fused backward.
pub(crate) fn swiglu(g: &Tensor, u: &Tensor) -> candle_core::Result<Tensor> {
    g.contiguous()?.apply_op2(&u.contiguous()?, SwiGlu)
}

struct SwiGlu;
struct SwiGluGrad;

/// `sigmoid(v)` for each `v` of `g`, into `out` (`1 / (1 + exp(-v))`, vectorised exponentials).
#[inline]
fn sigmoid<T: Real>(g: &[T], out: &mut [T]) {
    for (o, &v) in out.iter_mut().zip(g) {
        *o = -v;
    }
    T::exp_slice_exact(out);
    for o in out.iter_mut() {
        *o = T::one() / (T::one() + *o);
    }
}

fn forward<T: Real>(g: &[T], u: &[T]) -> Vec<T> {
    let n = g.len();
    let mut out = Out::new(n);
    let rows = out.rows();
    par_elems(n, |r| {
        // SAFETY: the ranges are disjoint and within `n`.
        let o = unsafe { rows.get(r.clone()) };
        let (g, u) = (&g[r.clone()], &u[r]);
        sigmoid(g, o);
        for ((o, &gv), &uv) in o.iter_mut().zip(g).zip(u) {
            *o = gv * *o * uv;
        }
    });
    // SAFETY: the blocks cover `0..n`.
    unsafe { out.into_vec(n) }
}

/// `[dg; du]`, `2n` elements: `dg = d u s (1 + g (1 - s))`, `du = d g s` with `s = sigmoid(g)`.
fn backward<T: Real>(g: &[T], u: &[T], d: &[T]) -> Vec<T> {
    let n = g.len();
    let mut out = Out::new(2 * n);
    let rows = out.rows();
    par_elems(n, |r| {
        // SAFETY: the ranges are disjoint, within `n`, and `n + range` within `2n`.
        let (dg, du) = unsafe { (rows.get(r.clone()), rows.get(n + r.start..n + r.end)) };
        let (g, u, d) = (&g[r.clone()], &u[r.clone()], &d[r]);
        sigmoid(g, du);
        for (((dg, du), &gv), (&uv, &dv)) in
            dg.iter_mut().zip(du.iter_mut()).zip(g).zip(u.iter().zip(d))
        {
            let s = *du;
            *dg = dv * uv * s * (T::one() + gv * (T::one() - s));
            *du = dv * gv * s;
        }
    });
    // SAFETY: both halves covered.
    unsafe { out.into_vec(2 * n) }
}

fn same(l1: &Layout, l2: &Layout) -> candle_core::Result<()> {
    if l1.shape() != l2.shape() {
        candle_core::bail!(
            "{NAME}: gate {:?} and up {:?} differ in shape",
            l1.shape(),
            l2.shape()
        );
    }
    Ok(())
}

custom_op! {
    CustomOp2 for SwiGlu, NAME, (s1: l1, s2: l2),
    cpu |_| {
        same(l1, l2)?;
        dispatch!(NAME, s1, |s1: T| Ok((
            storage(forward::<T>(&input(s1, l1, NAME)?, &input(s2, l2, NAME)?)),
            l1.shape().clone()
        )))
    },
    cuda |_| {
        same(l1, l2)?;
        cuda::run("swiglu_fwd", &[(s1, l1), (s2, l2)], l1.shape().clone())
    },
    fn bwd(
        &self,
        g: &Tensor,
        u: &Tensor,
        _y: &Tensor,
        d: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let both = g.apply_op3_no_bwd(u, &d.contiguous()?, &SwiGluGrad)?;
        Ok((Some(both.i(0)?), Some(both.i(1)?)))
    }
}

custom_op! {
    CustomOp3 for SwiGluGrad, "pipewright-swiglu-grad", (s1: l1, s2: l2, s3: l3),
    cpu |_| {
        same(l1, l2)?;
        same(l1, l3)?;
        let mut dims = vec![2];
        dims.extend(l1.shape().dims());
        dispatch!(NAME, s1, |s1: T| Ok((
            storage(backward::<T>(
                &input(s1, l1, NAME)?,
                &input(s2, l2, NAME)?,
                &input(s3, l3, NAME)?
            )),
            Shape::from(dims.clone())
        )))
    },
    cuda |_| {
        same(l1, l2)?;
        same(l1, l3)?;
        let mut dims = vec![2];
        dims.extend(l1.shape().dims());
        cuda::run(
            "swiglu_bwd",
            &[(s1, l1), (s2, l2), (s3, l3)],
            Shape::from(dims),
        )
    }
}

/// The same on a CUDA device (kernels/cuda/swiglu.cu).
#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::{CudaStorage, Layout, Result, Shape};

    use super::NAME;
    use crate::kernels::gpu::{self, typed, PushKernelArg};

    /// Kernel `name` over the `n` elements of each input, into `shape` (`n` or `2n` elements).
    pub(super) fn run(
        name: &str,
        inputs: &[(&CudaStorage, &Layout)],
        shape: Shape,
    ) -> Result<(CudaStorage, Shape)> {
        let (s, l) = inputs[0];
        let (dev, n) = (s.device(), l.shape().elem_count());
        typed!(NAME, s.dtype(), |T| {
            let views = inputs
                .iter()
                .map(|(s, l)| gpu::view::<T>(s, l, NAME))
                .collect::<Result<Vec<_>>>()?;
            let mut out = gpu::alloc::<T>(dev, shape.elem_count())?;
            let f = gpu::func(dev, &gpu::SWIGLU, name, s.dtype())?;
            gpu::launch(&f, gpu::elementwise(n), n, |b| {
                for v in &views {
                    b.arg(v);
                }
                b.arg(&mut out).arg(&n);
            })?;
            Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), shape))
        })
    }
}
