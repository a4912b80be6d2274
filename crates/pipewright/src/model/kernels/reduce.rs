//! The sum of squares of a tensor (gradient norms, clipping) in one pass, in f64, without the
//! f64 copy and the squared copy the composed `to_dtype(F64).sqr().sum_all()` allocates (for
//! a model's gradients, twice the model's size in f64, every step).

use candle_core::{DType, Storage, Tensor};

use super::{par, slice, Out, Real, BLOCK};

/// `sum(t^2)` accumulated in f64 for each of `ts` that is a CPU f32/f64 tensor or (in the
/// `cuda` build) a GPU f32/bf16/f16 one (None for the others). Blocks of elements are summed
/// separately and then in order, so a result does not depend on the number of threads. The
/// GPU tensors of one device are summed by one launch each into one buffer, read back once
/// (a read per tensor stalled the GPU's queue once per parameter, twice a step).
pub(crate) fn sum_sq_each(ts: &[&Tensor]) -> candle_core::Result<Vec<Option<f64>>> {
    let mut out: Vec<Option<f64>> = vec![None; ts.len()];
    #[cfg(feature = "cuda")]
    {
        let mut rest: Vec<usize> = (0..ts.len())
            .filter(|&i| super::gpu::takes(ts[i]))
            .collect();
        while let Some(&first) = rest.first() {
            // One device's tensors at a time.
            let (here, later): (Vec<usize>, Vec<usize>) = rest
                .iter()
                .partition(|&&i| ts[i].device().same_device(ts[first].device()));
            let sums = cuda::sum_sq_each(&here.iter().map(|&i| ts[i]).collect::<Vec<_>>())?;
            for (i, s) in here.into_iter().zip(sums) {
                out[i] = Some(s);
            }
            rest = later;
        }
    }
    for (o, t) in out.iter_mut().zip(ts) {
        if o.is_none() {
            *o = sum_sq_cpu(t)?;
        }
    }
    Ok(out)
}

fn sum_sq_cpu(t: &Tensor) -> candle_core::Result<Option<f64>> {
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

    use crate::model::kernels::gpu::{self, typed, PushKernelArg};

    /// Blocks of the grid (at most): enough to fill the GPU, few enough to add on the host.
    const BLOCKS: usize = 1024;

    /// The sums of squares of `ts` (GPU tensors of one device, f32/bf16/f16): each tensor's
    /// blocks write their f64 partials into its stretch of one buffer; one read back.
    pub(super) fn sum_sq_each(ts: &[&Tensor]) -> candle_core::Result<Vec<f64>> {
        let ts: Vec<Tensor> = ts
            .iter()
            .map(|t| t.contiguous())
            .collect::<Result<_, _>>()?;
        let blocks: Vec<usize> = ts
            .iter()
            .map(|t| match t.elem_count() {
                0 => 0,
                n => n.div_ceil(gpu::THREADS as usize * 8).clamp(1, BLOCKS),
            })
            .collect();
        let total: usize = blocks.iter().sum();
        if total == 0 {
            return Ok(vec![0.0; ts.len()]);
        }
        let dev = match ts.iter().find(|t| t.elem_count() > 0).map(|t| t.device()) {
            Some(candle_core::Device::Cuda(d)) => d.clone(),
            _ => candle_core::bail!("sum_sq: expects GPU tensors"),
        };
        let mut partial = gpu::alloc::<f64>(&dev, total)?;
        let mut at = 0;
        for (t, &nb) in ts.iter().zip(&blocks) {
            if nb > 0 {
                launch(t, &dev, &mut partial.slice_mut(at..at + nb))?;
            }
            at += nb;
        }
        let host = dev.clone_dtoh(&partial)?;
        let mut at = 0;
        Ok(blocks
            .iter()
            .map(|&nb| {
                at += nb;
                host[at - nb..at].iter().sum()
            })
            .collect())
    }

    /// `t`'s partial sums of squares into `partial` (one per block of the launch).
    fn launch(
        t: &Tensor,
        dev: &candle_core::cuda_backend::CudaDevice,
        partial: &mut candle_core::cuda_backend::cudarc::driver::CudaViewMut<'_, f64>,
    ) -> candle_core::Result<()> {
        let n = t.elem_count();
        let (s, l) = t.storage_and_layout();
        let Storage::Cuda(s) = &*s else {
            candle_core::bail!("sum_sq: expects a GPU tensor");
        };
        let mut cfg = gpu::elementwise(n);
        cfg.grid_dim.0 = partial.len() as u32;
        typed!("sum_sq", t.dtype(), |T| {
            let x = gpu::view::<T>(s, l, "sum_sq")?;
            let f = gpu::func(dev, &gpu::REDUCE, "sum_sq", t.dtype())?;
            gpu::launch(&f, cfg, n, |b| {
                b.arg(&x).arg(&n).arg(partial);
            })
        })
    }
}
