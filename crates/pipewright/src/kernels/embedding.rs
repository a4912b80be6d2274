//! Embedding lookup with a deterministic backward that adds in token order: the table's
//! gradient row `v` is the sum, in f32 and in the order of the tokens, of the output gradient
//! rows of the tokens whose id is `v`, rounded once. candle's backward (zeros, then
//! `index_add`) runs on a GPU as one thread per column looping over every token: 768 threads
//! for GPT-2, 4.9 ms of a 108 ms H200 step. The GPU kernels (kernels/cuda/embedding.cu) count
//! each id's tokens, place the tokens in id order (keeping their order), and sum each row's
//! tokens with a block per row: the CPU twin's sums, in the same order.

use candle_core::{CpuStorage, Layout, Shape, Tensor, WithDType};

use super::{custom_op, dispatch, input, storage, Real};

const NAME: &str = "pipewright-embedding";

/// Rows `ids` (u32, one dimension) of `weight` `(rows, dim)`: `(ids, dim)`, with the
/// backward above. Every id must be below `rows` (the caller checks; the op fails otherwise).
pub(crate) fn lookup(weight: &Tensor, ids: &Tensor) -> candle_core::Result<Tensor> {
    weight.contiguous()?.apply_op2(&ids.contiguous()?, Lookup)
}

struct Lookup;

/// The table's gradient from the output's: `(rows, dim)`.
struct LookupGrad {
    rows: usize,
}

/// The ids of a contiguous u32 layout.
fn ids<'a>(s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [u32]> {
    let all = u32::cpu_storage_as_slice(s)?;
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&all[a..b]),
        None => candle_core::bail!("{NAME}: expects contiguous ids"),
    }
}

/// `(rows, dim)` of the table, checked against the ids.
fn table(lw: &Layout, ids: &[u32]) -> candle_core::Result<(usize, usize)> {
    let (rows, dim) = lw.shape().dims2()?;
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= rows) {
        candle_core::bail!("{NAME}: id {bad} is outside the table of {rows} entries");
    }
    Ok((rows, dim))
}

fn gather<T: WithDType>(w: &[T], ids: &[u32], dim: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(ids.len() * dim);
    for &i in ids {
        let i = i as usize;
        out.extend_from_slice(&w[i * dim..(i + 1) * dim]);
    }
    out
}

/// Row `ids[j]` of the result gets `g` row `j` added, `j` in order, in `T`.
fn backward<T: Real>(g: &[T], ids: &[u32], rows: usize, dim: usize) -> Vec<T> {
    let mut out = vec![T::zero(); rows * dim];
    for (j, &i) in ids.iter().enumerate() {
        let i = i as usize;
        for (o, &v) in out[i * dim..(i + 1) * dim].iter_mut().zip(&g[j * dim..]) {
            *o += v;
        }
    }
    out
}

custom_op! {
    CustomOp2 for Lookup, NAME, (sw: lw, si: li),
    cpu |_| {
        let ids = ids(si, li)?;
        let (_, dim) = table(lw, ids)?;
        let (a, b) = lw.contiguous_offsets().ok_or_else(|| {
            candle_core::Error::Msg(format!("{NAME}: expects a contiguous table"))
        })?;
        let out = match sw {
            CpuStorage::F32(w) => storage(gather(&w[a..b], ids, dim)),
            CpuStorage::F64(w) => storage(gather(&w[a..b], ids, dim)),
            CpuStorage::BF16(w) => storage(gather(&w[a..b], ids, dim)),
            CpuStorage::F16(w) => storage(gather(&w[a..b], ids, dim)),
            other => candle_core::bail!(
                "{NAME}: no kernel for {:?}",
                candle_core::backend::BackendStorage::dtype(other)
            ),
        };
        Ok((out, Shape::from((ids.len(), dim))))
    },
    cuda |_| cuda::forward(sw, lw, si, li),
    fn bwd(
        &self,
        w: &Tensor,
        ids: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let rows = w.dim(0)?;
        let dw = ids.apply_op2_no_bwd(&g.contiguous()?, &LookupGrad { rows })?;
        Ok((Some(dw), None))
    }
}

custom_op! {
    CustomOp2 for LookupGrad, "pipewright-embedding-grad", (si: li, sg: lg),
    cpu |this| {
        let ids = ids(si, li)?;
        let (n, dim) = lg.shape().dims2()?;
        // (The ids were checked against the table by the forward that made this op.)
        if n != ids.len() {
            candle_core::bail!(
                "{NAME}: {} ids for {n} gradient rows of a {}-row table",
                ids.len(),
                this.rows
            );
        }
        dispatch!(NAME, sg, |sg: T| Ok((
            storage(backward::<T>(&input(sg, lg, NAME)?, ids, this.rows, dim)),
            Shape::from((this.rows, dim))
        )))
    },
    cuda |this| cuda::backward(si, li, sg, lg, this.rows)
}

/// The same on a CUDA device (kernels/cuda/embedding.cu).
#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaSlice, CudaView, DeviceRepr, LaunchConfig,
    };
    use candle_core::cuda_backend::CudaDevice;
    use candle_core::{CudaStorage, DType, Layout, Result, Shape};

    use super::NAME;
    use crate::kernels::gpu::{self, typed, PushKernelArg};

    pub(super) fn forward(
        sw: &CudaStorage,
        lw: &Layout,
        si: &CudaStorage,
        li: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let dev = sw.device();
        let (rows, dim) = lw.shape().dims2()?;
        let n = li.shape().elem_count();
        let ids = gpu::view::<u32>(si, li, NAME)?;
        let total = n * dim;
        typed!(NAME, sw.dtype(), |T| {
            let w = gpu::view::<T>(sw, lw, NAME)?;
            let mut y = gpu::alloc::<T>(dev, total)?;
            let f = gpu::func(dev, &gpu::EMBEDDING, "emb_gather", sw.dtype())?;
            gpu::launch(&f, gpu::elementwise(total), total, |b| {
                b.arg(&w)
                    .arg(&ids)
                    .arg(&mut y)
                    .arg(&total)
                    .arg(&dim)
                    .arg(&rows);
            })?;
            Ok((
                CudaStorage::wrap_cuda_slice(y, dev.clone()),
                Shape::from((n, dim)),
            ))
        })
    }

    /// The most tokens the placing kernel takes at once: each token counts the earlier tokens
    /// of its id, `n^2 / 2` comparisons (134 M at this size, well under a millisecond); more
    /// come in chunks of it.
    const PLACED_MAX: usize = 16_384;

    /// Count, place and sum (the module's header). Past [`PLACED_MAX`] tokens the chunks, in
    /// token order, each add their tokens to the f32 sums of the chunks before, rounded once at
    /// the end: the same sums in the same order (candle's `index_add`, used before, added in
    /// the gradient's own type, 2.8e-2 off in bf16 at 17000 tokens).
    pub(super) fn backward(
        si: &CudaStorage,
        li: &Layout,
        sg: &CudaStorage,
        lg: &Layout,
        rows: usize,
    ) -> Result<(CudaStorage, Shape)> {
        let dev = sg.device();
        let (n, dim) = lg.shape().dims2()?;
        let ids = gpu::view::<u32>(si, li, NAME)?;
        let dtype = sg.dtype();
        let shape = Shape::from((rows, dim));
        typed!(NAME, dtype, |T| {
            let g = gpu::view::<T>(sg, lg, NAME)?;
            let mut dw = gpu::alloc::<T>(dev, rows * dim)?;
            if n <= PLACED_MAX {
                let placed = place(dev, &ids, rows)?;
                sum(dev, "emb_sum", dtype, &g, &placed, &mut dw, (rows, dim))?;
            } else {
                let mut acc = gpu::zeros::<f32>(dev, rows * dim)?;
                for a in (0..n).step_by(PLACED_MAX) {
                    let b = (a + PLACED_MAX).min(n);
                    let placed = place(dev, &ids.slice(a..b), rows)?;
                    let part = g.slice(a * dim..b * dim);
                    sum(
                        dev,
                        "emb_sum_on",
                        dtype,
                        &part,
                        &placed,
                        &mut acc,
                        (rows, dim),
                    )?;
                }
                let round = gpu::func(dev, &gpu::EMBEDDING, "emb_round", dtype)?;
                let total = rows * dim;
                gpu::launch(&round, gpu::elementwise(total), total, |b| {
                    b.arg(&acc).arg(&mut dw).arg(&total);
                })?;
            }
            Ok((CudaStorage::wrap_cuda_slice(dw, dev.clone()), shape))
        })
    }

    /// Where each id's tokens lie in id order: `(count, start, order)` of the module's header.
    struct Placed {
        count: CudaSlice<u32>,
        start: CudaSlice<u32>,
        order: CudaSlice<u32>,
    }

    /// Counts each of `rows` ids' tokens among `ids`, scans the counts into first places, and
    /// places the tokens in id order, keeping their order.
    fn place(dev: &CudaDevice, ids: &CudaView<u32>, rows: usize) -> Result<Placed> {
        let n = ids.len();
        let mut count = gpu::zeros::<u32>(dev, rows)?;
        let mut start = gpu::alloc::<u32>(dev, rows)?;
        let mut order = gpu::alloc::<u32>(dev, n)?;
        let count_k = gpu::func(dev, &gpu::EMBEDDING, "emb_count", DType::U32)?;
        gpu::launch(&count_k, gpu::elementwise(n), n, |b| {
            b.arg(ids).arg(&mut count).arg(&n);
        })?;
        let scan = gpu::func(dev, &gpu::EMBEDDING, "emb_scan", DType::U32)?;
        let one = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        };
        gpu::launch(&scan, one, rows, |b| {
            b.arg(&count).arg(&mut start).arg(&rows);
        })?;
        let place = gpu::func(dev, &gpu::EMBEDDING, "emb_place", DType::U32)?;
        let tiles = LaunchConfig {
            grid_dim: (n.div_ceil(256).max(1) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        gpu::launch(&place, tiles, n, |b| {
            b.arg(ids).arg(&start).arg(&mut order).arg(&n);
        })?;
        Ok(Placed {
            count,
            start,
            order,
        })
    }

    /// Kernel `name` (`emb_sum` into the gradient, `emb_sum_on` into f32 sums) over the placed
    /// tokens' output gradients `g`: a block per table row of `(rows, dim)`.
    fn sum<T: DeviceRepr, O: DeviceRepr>(
        dev: &CudaDevice,
        name: &str,
        dtype: DType,
        g: &CudaView<T>,
        placed: &Placed,
        out: &mut CudaSlice<O>,
        (rows, dim): (usize, usize),
    ) -> Result<()> {
        let k = gpu::func(dev, &gpu::EMBEDDING, name, dtype)?;
        let cfg = LaunchConfig {
            grid_dim: (rows.clamp(1, 1 << 16) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        gpu::launch(&k, cfg, rows * dim, |b| {
            b.arg(g).arg(&placed.start).arg(&placed.count);
            b.arg(&placed.order).arg(out).arg(&rows).arg(&dim);
        })
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor, Var};

    use super::lookup;

    /// The lookup and the table's gradient are candle's `index_select` and its backward
    /// (zeros, then `index_add` in token order), bit for bit in f32 and f64.
    #[test]
    fn looks_up_and_adds_back_as_index_select() {
        for dtype in [DType::F32, DType::F64] {
            let (rows, dim, n) = (11, 6, 40);
            let w: Vec<f32> = (0..rows * dim).map(|i| (i as f32 * 0.37).sin()).collect();
            let w = Tensor::from_vec(w, (rows, dim), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let ids: Vec<u32> = (0..n).map(|j| ((j * j + 3) % (rows - 2)) as u32).collect();
            let ids = Tensor::from_vec(ids, n, &Device::Cpu).unwrap();
            let r: Vec<f32> = (0..n * dim).map(|i| (i as f32 * 1.3).cos()).collect();
            let r = Tensor::from_vec(r, (n, dim), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let (a, b) = (Var::from_tensor(&w).unwrap(), Var::from_tensor(&w).unwrap());
            let ya = lookup(&a, &ids).unwrap();
            let yb = b.index_select(&ids, 0).unwrap();
            let flat = |t: &Tensor| -> Vec<f64> {
                t.to_dtype(DType::F64)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap()
            };
            assert_eq!(flat(&ya), flat(&yb));
            let ga = (ya * &r).unwrap().sum_all().unwrap().backward().unwrap();
            let gb = (yb * &r).unwrap().sum_all().unwrap().backward().unwrap();
            assert_eq!(flat(ga.get(&a).unwrap()), flat(gb.get(&b).unwrap()));
        }
        let w = Tensor::zeros((3, 2), DType::F32, &Device::Cpu).unwrap();
        let bad = Tensor::new(&[0u32, 3], &Device::Cpu).unwrap();
        let e = lookup(&w, &bad).unwrap_err().to_string();
        assert!(e.contains("id 3 is outside the table of 3 entries"), "{e}");
    }
}
