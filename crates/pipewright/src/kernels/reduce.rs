//! The sum of squares of a tensor (gradient norms, clipping) in one pass, in f64, without the
//! f64 copy and the squared copy the composed `to_dtype(F64).sqr().sum_all()` allocates (for
//! a model's gradients, twice the model's size in f64, every step).

use candle_core::{DType, Storage, Tensor};

use super::{par, slice, Out, Real, BLOCK};

/// `sum(t^2)` accumulated in f64 for each of `ts` that is a CPU f32/f64 tensor or (in the
/// `cuda` build) a GPU f32/bf16/f16 one (None for the others). Blocks of elements are summed
/// separately and then in order, so a result does not depend on the number of threads. The
/// GPU tensors of one device and type are summed by one launch into one buffer, read back
/// once (a read per tensor stalled the GPU's queue once per parameter, twice a step; a launch
/// per tensor cost the host more than the GPU's work).
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
    use candle_core::{DType, Tensor};

    use crate::kernels::gpu::{self, tensor_addr, PushKernelArg};
    use crate::kernels::gpu_table::Table;

    /// Blocks a tensor is given (at most): enough to fill the GPU, few enough to add on the
    /// host.
    const BLOCKS: usize = 1024;

    /// The sums of squares of `ts` (GPU tensors of one device, f32/bf16/f16): one launch per
    /// element type, each tensor's blocks writing their f64 partials into its stretch of one
    /// buffer; one read back.
    pub(super) fn sum_sq_each(ts: &[&Tensor]) -> candle_core::Result<Vec<f64>> {
        let ts: Vec<Tensor> = ts
            .iter()
            .map(|t| t.contiguous())
            .collect::<Result<_, _>>()?;
        let dev = match ts.first().map(|t| t.device()) {
            Some(candle_core::Device::Cuda(d)) => d.clone(),
            _ => candle_core::bail!("sum_sq: expects GPU tensors"),
        };
        let mut tables: Vec<(DType, Table)> = Vec::new();
        let mut spans = Vec::with_capacity(ts.len());
        for t in &ts {
            let at = match tables.iter().position(|(d, _)| *d == t.dtype()) {
                Some(at) => at,
                None => {
                    tables.push((t.dtype(), Table::new(BLOCKS)));
                    tables.len() - 1
                }
            };
            let blocks = tables[at].1.push(
                [tensor_addr(t, "sum_sq")?, 0, 0, 0, 0, 0],
                t.elem_count(),
                0.0,
                false,
            );
            spans.push((at, blocks));
        }
        let total: usize = tables.iter().map(|(_, t)| t.blocks()).sum();
        if total == 0 {
            return Ok(vec![0.0; ts.len()]);
        }
        let mut partial = gpu::alloc::<f64>(&dev, total)?;
        let mut starts = Vec::with_capacity(tables.len());
        let mut at = 0;
        for (dtype, table) in &tables {
            starts.push(at);
            let Some((items, count, cfg)) = table.upload(&dev, "sum_sq")? else {
                continue;
            };
            let f = gpu::func(&dev, &gpu::REDUCE, "sum_sq", *dtype)?;
            let mut out = partial.slice_mut(at..at + table.blocks());
            gpu::launch(&f, cfg, table.blocks(), |b| {
                b.arg(&items).arg(&count).arg(&mut out);
            })?;
            at += table.blocks();
        }
        let host = dev.clone_dtoh(&partial)?;
        Ok(spans
            .into_iter()
            .map(|(t, r)| host[starts[t] + r.start..starts[t] + r.end].iter().sum())
            .collect())
    }
}
