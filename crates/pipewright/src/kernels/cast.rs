//! Many tensors cast to another element type, and scaled, at once: a model's gradients into
//! f32 (unscaled under loss scaling), clipping's scaling of them, the f32 masters into the
//! model's parameters, and the micro-batches' gradients added up in f32. On a GPU the tensors of one device and element type are one launch
//! (kernels/cuda/cast.cu through a table, kernels/gpu_table.rs) where a cast and a product per
//! parameter were two; elsewhere (and for what that launch does not take) they are cast one by
//! one, which is also the GPU kernel's oracle.

use candle_core::{DType, Tensor, Var};

/// Each of `ts` as `to` (its own type when None), times `factor` when given: value for value
/// `t.to_dtype(to)` then `* factor`. On a GPU, tensors of one device and one element type,
/// with a factor only into f32 (whose product the kernel rounds as candle's), are one launch
/// into one new buffer, each result a view of its part.
pub(crate) fn cast_all(
    ts: &[&Tensor],
    to: Option<DType>,
    factor: Option<f64>,
) -> candle_core::Result<Vec<Tensor>> {
    #[cfg(feature = "cuda")]
    if let Some(to) = gpu::takes(ts, to, factor) {
        return gpu::cast(ts, to, factor);
    }
    ts.iter()
        .map(|t| {
            let c = t.to_dtype(to.unwrap_or(t.dtype()))?;
            match factor {
                Some(f) => c * f,
                None => Ok(c),
            }
        })
        .collect()
}

/// Each `accs[i] + addends[i]` in f32, the addend widened when it is f16 or bf16 (gradient
/// accumulation over micro-batches: the f32 sum so far plus the next gradient), value for value
/// `acc + addend.to_dtype(F32)`. On a GPU, f32 sums and addends of one type on one device are one
/// launch into one new buffer, each result a view of its part.
pub(crate) fn add_all(accs: &[&Tensor], addends: &[&Tensor]) -> candle_core::Result<Vec<Tensor>> {
    #[cfg(feature = "cuda")]
    if gpu::takes_sums(accs, addends) {
        return gpu::add(accs, addends);
    }
    accs.iter()
        .zip(addends)
        .map(|(a, g)| match g.dtype() {
            DType::F16 | DType::BF16 => *a + g.to_dtype(DType::F32)?,
            _ => *a + *g,
        })
        .collect()
}

/// Each source cast to its variable's type and written into it (`Var::set` of `to_dtype`):
/// on a GPU, sources of one device and type into variables of one type, one launch.
pub(crate) fn assign_all(pairs: &[(&Tensor, &Var)]) -> candle_core::Result<()> {
    #[cfg(feature = "cuda")]
    if gpu::takes_pairs(pairs) {
        return gpu::assign(pairs);
    }
    for (src, var) in pairs {
        var.set(&src.to_dtype(var.dtype())?)?;
    }
    Ok(())
}

#[cfg(feature = "cuda")]
mod gpu {
    use candle_core::{DType, Device, Shape, Tensor, Var};

    use crate::kernels::gpu::{self, tensor_addr, PushKernelArg};
    use crate::kernels::gpu_table::{parts, Table};

    const NAME: &str = "pipewright-cast";

    /// Whether `ts` are one launch's ([`super::cast_all`]'s conditions), and its output type.
    pub(super) fn takes(ts: &[&Tensor], to: Option<DType>, factor: Option<f64>) -> Option<DType> {
        let first = ts.first()?;
        let to = to.unwrap_or(first.dtype());
        let one = ts.iter().all(|t| {
            gpu::takes(t) && t.dtype() == first.dtype() && t.device().same_device(first.device())
        });
        (one && (factor.is_none() || to == DType::F32)).then_some(to)
    }

    /// Whether `pairs` are one launch's ([`super::assign_all`]'s conditions).
    pub(super) fn takes_pairs(pairs: &[(&Tensor, &Var)]) -> bool {
        let Some((src, var)) = pairs.first() else {
            return false;
        };
        pairs.iter().all(|(s, v)| {
            gpu::takes(s)
                && gpu::takes(v.as_tensor())
                && s.dtype() == src.dtype()
                && v.dtype() == var.dtype()
                && v.is_contiguous()
                && s.elem_count() == v.elem_count()
                && s.device().same_device(src.device())
                && v.device().same_device(src.device())
        })
    }

    /// Whether `accs` and `addends` are one launch's ([`super::add_all`]'s conditions).
    pub(super) fn takes_sums(accs: &[&Tensor], addends: &[&Tensor]) -> bool {
        let (Some(a0), Some(g0)) = (accs.first(), addends.first()) else {
            return false;
        };
        accs.len() == addends.len()
            && accs.iter().zip(addends).all(|(a, g)| {
                gpu::takes(g)
                    && a.dtype() == DType::F32
                    && g.dtype() == g0.dtype()
                    && a.elem_count() == g.elem_count()
                    && a.device().same_device(a0.device())
                    && g.device().same_device(a0.device())
            })
            && a0.device().is_cuda()
    }

    pub(super) fn add(accs: &[&Tensor], addends: &[&Tensor]) -> candle_core::Result<Vec<Tensor>> {
        let contiguous = |ts: &[&Tensor]| -> candle_core::Result<Vec<Tensor>> {
            ts.iter().map(|t| t.contiguous()).collect()
        };
        let (accs, addends) = (contiguous(accs)?, contiguous(addends)?);
        let dev = device(&accs[0])?;
        let shapes: Vec<&Shape> = accs.iter().map(Tensor::shape).collect();
        let sums = parts(&accs[0], DType::F32, &shapes, false, NAME)?;
        let mut table = Table::new(usize::MAX);
        for ((a, g), (sum, _)) in accs.iter().zip(&addends).zip(&sums) {
            let p = [tensor_addr(a, NAME)?, tensor_addr(g, NAME)?, *sum, 0, 0, 0];
            table.push(p, a.elem_count(), 0.0, false);
        }
        if let Some((items, count, cfg)) = table.upload(&dev, NAME)? {
            let f = gpu::func(&dev, &gpu::CAST, "add_f32", addends[0].dtype())?;
            gpu::launch(&f, cfg, table.blocks(), |b| {
                b.arg(&items).arg(&count);
            })?;
        }
        Ok(sums.into_iter().map(|(_, v)| v).collect())
    }

    fn device(t: &Tensor) -> candle_core::Result<candle_core::CudaDevice> {
        match t.device() {
            Device::Cuda(d) => Ok(d.clone()),
            other => candle_core::bail!("{NAME}: expects GPU tensors, got one on {other:?}"),
        }
    }

    /// Launches cast.cu's `cast_{from}_{to}` over `table`.
    fn launch(
        dev: &candle_core::CudaDevice,
        table: &Table,
        (from, to): (DType, DType),
        factor: Option<f64>,
    ) -> candle_core::Result<()> {
        let Some((items, count, cfg)) = table.upload(dev, NAME)? else {
            return Ok(());
        };
        let name = format!("cast_{}", gpu::suffix(NAME, from)?);
        let f = gpu::func(dev, &gpu::CAST, &name, to)?;
        let (k, scaled) = (factor.unwrap_or(1.0) as f32, i32::from(factor.is_some()));
        gpu::launch(&f, cfg, table.blocks(), |b| {
            b.arg(&items).arg(&count).arg(&k).arg(&scaled);
        })
    }

    pub(super) fn cast(
        ts: &[&Tensor],
        to: DType,
        factor: Option<f64>,
    ) -> candle_core::Result<Vec<Tensor>> {
        let from = ts[0].dtype();
        if from == to && factor.is_none() {
            return Ok(ts.iter().map(|t| (*t).clone()).collect());
        }
        let ts: Vec<Tensor> = ts
            .iter()
            .map(|t| t.contiguous())
            .collect::<Result<_, _>>()?;
        let dev = device(&ts[0])?;
        let shapes: Vec<&Shape> = ts.iter().map(Tensor::shape).collect();
        let out = parts(&ts[0], to, &shapes, false, NAME)?;
        let mut table = Table::new(usize::MAX);
        for (t, (dst, _)) in ts.iter().zip(&out) {
            table.push(
                [tensor_addr(t, NAME)?, *dst, 0, 0, 0, 0],
                t.elem_count(),
                0.0,
                false,
            );
        }
        launch(&dev, &table, (from, to), factor)?;
        Ok(out.into_iter().map(|(_, v)| v).collect())
    }

    pub(super) fn assign(pairs: &[(&Tensor, &Var)]) -> candle_core::Result<()> {
        let srcs: Vec<Tensor> = pairs
            .iter()
            .map(|(s, _)| s.contiguous())
            .collect::<Result<_, _>>()?;
        let dev = device(&srcs[0])?;
        let mut table = Table::new(usize::MAX);
        for (s, (_, var)) in srcs.iter().zip(pairs) {
            let dst = tensor_addr(var.as_tensor(), NAME)?;
            table.push(
                [tensor_addr(s, NAME)?, dst, 0, 0, 0, 0],
                s.elem_count(),
                0.0,
                false,
            );
        }
        launch(&dev, &table, (srcs[0].dtype(), pairs[0].1.dtype()), None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn cast_all_is_each_cast_then_scaled_and_assign_all_sets_each_variable() {
        let dev = Device::Cpu;
        let a = Tensor::new(&[1.5f32, -2.25, 3.0], &dev).unwrap();
        let b = Tensor::new(&[[0.1f32, 0.2], [0.3, 0.4]], &dev).unwrap();
        let out = cast_all(&[&a, &b], Some(DType::BF16), None).unwrap();
        assert_eq!(out[1].dims(), [2, 2]);
        assert_eq!(out[1].dtype(), DType::BF16);
        let back = out[1].to_dtype(DType::F32).unwrap().flatten_all().unwrap();
        // 0.1f32 is 0x3dcc_cccd; to nearest bf16, 0x3dcd.
        assert_eq!(back.to_vec1::<f32>().unwrap()[0].to_bits(), 0x3dcd_0000);
        let scaled = cast_all(&[&a], None, Some(0.5)).unwrap();
        assert_eq!(scaled[0].to_vec1::<f32>().unwrap(), [0.75, -1.125, 1.5]);
        let v = Var::zeros(3, DType::BF16, &dev).unwrap();
        assign_all(&[(&a, &v)]).unwrap();
        let got = v.as_tensor().to_dtype(DType::F32).unwrap();
        assert_eq!(got.to_vec1::<f32>().unwrap(), [1.5, -2.25, 3.0]);
    }
}
