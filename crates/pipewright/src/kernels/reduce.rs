//! The sum of squares of a tensor (gradient norms, clipping) in one pass, in f64, without the
//! f64 copy and the squared copy the composed `to_dtype(F64).sqr().sum_all()` allocates (for
//! a model's gradients, twice the model's size in f64, every step).

use candle_core::{DType, Storage, Tensor};

use super::{par, slice, Out, Real, BLOCK};

/// `sum(t^2)` accumulated in f64, for a CPU f32/f64 tensor and (in the `cuda` build) a GPU
/// f32/bf16/f16 one (None for other tensors). Blocks of elements are summed separately and
/// then in order, so the result does not depend on the number of threads.
pub(crate) fn sum_sq(t: &Tensor) -> candle_core::Result<Option<f64>> {
    #[cfg(feature = "cuda")]
    if super::gpu::takes(t) {
        return cuda::sum_sq(t).map(Some);
    }
    if !(super::fused(t) && matches!(t.dtype(), DType::F32 | DType::F64)) {
        return Ok(None);
    }
    let t = t.contiguous()?;
    let (s, l) = t.storage_and_layout();
    let Storage::Cpu(s) = &*s else {
        return Ok(None);
    };
    Ok(Some(match t.dtype() {
        DType::F32 => blocks::<f32>(slice(s, l, "sum_sq")?),
        _ => blocks::<f64>(slice(s, l, "sum_sq")?),
    }))
}

fn blocks<T: Real>(x: &[T]) -> f64 {
    let n = x.len();
    let nb = n.div_ceil(BLOCK);
    let mut partial = Out::<f64>::new(nb);
    let p = partial.rows();
    par(nb, n, |bs| {
        for b in bs {
            let v = &x[b * BLOCK..((b + 1) * BLOCK).min(n)];
            let sq = v
                .iter()
                .map(|&e| candle_core::WithDType::to_f64(e).powi(2))
                .sum();
            // SAFETY: block b's sum is this call's alone.
            unsafe { p.get(b..b + 1)[0] = sq };
        }
    });
    // SAFETY: every block's sum was written.
    unsafe { partial.into_vec(nb) }.iter().sum()
}

/// The same on a CUDA device (kernels/cuda/reduce.cu): one f64 partial per block, read back
/// and added here in block order.
#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::{Storage, Tensor};

    use crate::kernels::gpu::{self, typed, PushKernelArg};

    /// Blocks of the grid (at most): enough to fill the GPU, few enough to add on the host.
    const BLOCKS: usize = 1024;

    pub(super) fn sum_sq(t: &Tensor) -> candle_core::Result<f64> {
        let t = t.contiguous()?;
        let n = t.elem_count();
        if n == 0 {
            return Ok(0.0);
        }
        let (s, l) = t.storage_and_layout();
        let Storage::Cuda(s) = &*s else {
            candle_core::bail!("sum_sq: expects a GPU tensor");
        };
        let dev = &s.device;
        let blocks = n.div_ceil(gpu::THREADS as usize * 8).clamp(1, BLOCKS);
        let mut cfg = gpu::elementwise(n);
        cfg.grid_dim.0 = blocks as u32;
        typed!("sum_sq", t.dtype(), |T| {
            let x = gpu::view::<T>(s, l, "sum_sq")?;
            let mut partial = gpu::alloc::<f64>(dev, blocks)?;
            let f = gpu::func(dev, &gpu::REDUCE, "sum_sq", t.dtype())?;
            gpu::launch(&f, cfg, n, |b| {
                b.arg(&x).arg(&n).arg(&mut partial);
            })?;
            Ok(dev.clone_dtoh(&partial)?[..blocks].iter().sum())
        })
    }
}
