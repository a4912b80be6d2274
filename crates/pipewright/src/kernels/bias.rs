//! Adding a bias to every row, with a backward that sums the gradient's columns in one pass
//! over contiguous rows (candle reduces a broadcast's gradient over the strided row dimension,
//! several times slower) and passes the gradient through to the input without a copy.

use candle_core::{CpuStorage, Shape, Tensor};

use super::{custom_op, dispatch, input, par, storage, Out, Real};

const NAME: &str = "pipewright-bias-add";

/// Row blocks the bias gradient is summed over: fixed, so the sum does not depend on the
/// number of threads.
const BLOCKS: usize = 32;

/// `y + b` for CPU f32/f64 `y` `(rows, n)` and `b` `(n)`, with a fused backward.
pub(crate) fn bias_add(y: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    y.contiguous()?.apply_op2(&b.contiguous()?, BiasAdd)
}

/// The column sums of `g` `(rows, n)` as an `(n)` tensor (a bias's gradient), in one pass
/// over contiguous rows.
pub(crate) fn column_sum(g: &Tensor) -> candle_core::Result<Tensor> {
    g.contiguous()?.apply_op1_no_bwd(&ColumnSums)
}

struct BiasAdd;

fn forward<T: Real>(y: &[T], b: &[T]) -> Vec<T> {
    let n = b.len();
    let mut out = Out::new(y.len());
    let o = out.rows();
    par(y.len() / n, y.len(), |r| {
        // SAFETY: these rows are this call's alone.
        let dst = unsafe { o.get(r.start * n..r.end * n) };
        for (d, s) in dst.chunks_mut(n).zip(y[r.start * n..r.end * n].chunks(n)) {
            for ((dv, &sv), &bv) in d.iter_mut().zip(s).zip(b) {
                *dv = sv + bv;
            }
        }
    });
    // SAFETY: every row was written.
    unsafe { out.into_vec(y.len()) }
}

/// The column sums of `g` `(rows, n)`: each block of rows summed, then the blocks in order.
pub(crate) fn column_sums<T: Real>(g: &[T], n: usize) -> Vec<T> {
    let rows = g.len() / n;
    let blocks = BLOCKS.min(rows.max(1));
    let per = rows.div_ceil(blocks);
    let mut partial = Out::new(blocks * n);
    let p = partial.rows();
    par(blocks, g.len(), |bs| {
        for blk in bs {
            // SAFETY: block blk's sums are this call's alone.
            let acc = unsafe { p.get(blk * n..(blk + 1) * n) };
            acc.fill(T::zero());
            for row in g[(blk * per).min(rows) * n..((blk + 1) * per).min(rows) * n].chunks(n) {
                for (a, &v) in acc.iter_mut().zip(row) {
                    *a += v;
                }
            }
        }
    });
    // SAFETY: every block's sums were written.
    let partial = unsafe { partial.into_vec(blocks * n) };
    let mut sums = partial[..n].to_vec();
    for part in partial[n..].chunks(n) {
        for (s, &v) in sums.iter_mut().zip(part) {
            *s += v;
        }
    }
    sums
}

custom_op! {
    CustomOp2 for BiasAdd, NAME, (sy: ly, sb: lb),
    cpu |_| {
        let n = lb.shape().elem_count();
        if ly.dims().last() != Some(&n) || lb.dims().len() != 1 {
            candle_core::bail!(
                "{NAME}: a bias of {:?} for rows of {:?}",
                lb.dims(),
                ly.dims()
            );
        }
        dispatch!(NAME, sy, |sy: T| Ok((
            storage(forward::<T>(&input(sy, ly, NAME)?, &input(sb, lb, NAME)?)),
            ly.shape().clone()
        )))
    },
    cuda |_| cuda::bias_add(sy, ly, sb, lb),
    fn bwd(
        &self,
        _y: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let db = column_sum(g)?;
        Ok((Some(g.clone()), Some(db.reshape(b.shape())?)))
    }
}

struct ColumnSums;

custom_op! {
    CustomOp1 for ColumnSums, "pipewright-column-sums", (s: l),
    cpu |_| {
        let n = *l.dims().last().unwrap_or(&1);
        dispatch!(NAME, s, |s: T| Ok((
            storage(column_sums::<T>(&input(s, l, NAME)?, n)),
            Shape::from(n)
        )))
    },
    cuda |_| cuda::column_sums(s, l)
}

/// The same on a CUDA device (kernels/cuda/bias.cu).
#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::{CudaStorage, Layout, Result, Shape};

    use super::NAME;
    use crate::kernels::gpu::{self, typed, PushKernelArg};

    pub(super) fn bias_add(
        sy: &CudaStorage,
        ly: &Layout,
        sb: &CudaStorage,
        lb: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (dev, n, cols) = (
            sy.device(),
            ly.shape().elem_count(),
            lb.shape().elem_count(),
        );
        if ly.dims().last() != Some(&cols) || lb.dims().len() != 1 {
            candle_core::bail!(
                "{NAME}: a bias of {:?} for rows of {:?}",
                lb.dims(),
                ly.dims()
            );
        }
        typed!(NAME, sy.dtype(), |T| {
            let (y, b) = (gpu::view::<T>(sy, ly, NAME)?, gpu::view::<T>(sb, lb, NAME)?);
            let mut out = gpu::alloc::<T>(dev, n)?;
            let f = gpu::func(dev, &gpu::BIAS, "bias_add", sy.dtype())?;
            gpu::launch(&f, gpu::elementwise(n), n * cols, |a| {
                a.arg(&y).arg(&b).arg(&mut out).arg(&n).arg(&cols);
            })?;
            Ok((
                CudaStorage::wrap_cuda_slice(out, dev.clone()),
                ly.shape().clone(),
            ))
        })
    }

    /// Column sums of `(rows, cols)`: row blocks summed apart in f32, then in block order.
    pub(super) fn column_sums(s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let dev = s.device();
        let cols = *l.dims().last().unwrap_or(&1);
        let rows = l.shape().elem_count() / cols.max(1);
        let (cfg, blocks, per) = gpu::column_blocks(rows, cols);
        typed!(NAME, s.dtype(), |T| {
            let g = gpu::view::<T>(s, l, NAME)?;
            let mut partial = gpu::zeros::<f32>(dev, blocks * cols)?;
            let f = gpu::func(dev, &gpu::BIAS, "column_partials", s.dtype())?;
            gpu::launch(&f, cfg, rows * cols, |a| {
                a.arg(&g).arg(&mut partial).arg(&rows).arg(&cols).arg(&per);
            })?;
            let mut out = gpu::alloc::<T>(dev, cols)?;
            gpu::finish_sums(
                dev,
                s.dtype(),
                &partial,
                &mut out.slice_mut(..),
                cols,
                blocks,
            )?;
            Ok((
                CudaStorage::wrap_cuda_slice(out, dev.clone()),
                Shape::from(cols),
            ))
        })
    }
}
