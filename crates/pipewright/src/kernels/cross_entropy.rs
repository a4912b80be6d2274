//! Cross-entropy fused with its log-softmax: the loss of each row from one read of its logits
//! (max, log-sum-exp, the target's logit), no log-probabilities stored; the backward writes
//! `softmax - one_hot` scaled by the row's gradient in one more pass.
//!
//! Logits in f16 or bf16 are read where they are, widened to f32: the losses are f32 (f64 for
//! f64 logits) whatever the logits' type, and the gradient, computed in f32, is rounded once to
//! the logits' type. That is what casting the logits to f32 first and the cast's backward
//! computed, bit for bit, without the f32 copy of the logits and of their gradient (at GPT-2's
//! vocabulary, 8 x 1024 tokens: 1.65 GB each).

use std::sync::Arc;

use candle_core::{CpuStorage, Layout, Shape, Tensor};

use super::{custom_op, dispatch, input, par, row_max, storage, sum_exp, Out, Real};

/// Targets equal to this are ignored (PyTorch's default `ignore_index`).
pub const IGNORE_INDEX: i64 = -100;

const NAME: &str = "pipewright-cross-entropy";

/// Each row's negative log-likelihood of its target (zero where the target is
/// [`IGNORE_INDEX`]), in f32 (f64 for f64 logits), for `logits` `(..., classes)`, the leading
/// dimensions taken as rows;
/// `targets` are checked to lie in `0..classes` or be ignored. Rows at one stride are read
/// where they are (the logits of a padded head's product, [`super::strided_rows`]); other
/// layouts are made contiguous first. The gradient is contiguous.
pub(crate) fn nll_rows(logits: &Tensor, targets: Vec<i64>) -> candle_core::Result<Tensor> {
    let op = CrossEntropy {
        targets: Arc::new(targets),
    };
    match super::strided_rows(logits.layout()) {
        Some(_) => logits.apply_op1(op),
        None => logits.contiguous()?.apply_op1(op),
    }
}

/// `(rows, classes, stride)` of `l` ([`super::strided_rows`]), checked against the targets.
fn geometry(l: &Layout, targets: usize) -> candle_core::Result<(usize, usize, usize)> {
    let Some((rows, classes, stride)) = super::strided_rows(l) else {
        candle_core::bail!("{NAME}: logits {:?} are not rows at one stride", l.dims());
    };
    if targets != rows {
        candle_core::bail!("{NAME}: {rows} rows of logits but {targets} targets");
    }
    Ok((rows, classes, stride))
}

/// The logits' elements `l` covers, row `i` from `i * stride`.
fn rows_of<'a, T: candle_core::WithDType>(
    s: &'a CpuStorage,
    l: &Layout,
) -> candle_core::Result<std::borrow::Cow<'a, [T]>> {
    match super::strided_span(l) {
        Some(r) => super::input_range(s, r),
        None => candle_core::bail!("{NAME}: logits {:?} are not rows at one stride", l.dims()),
    }
}

#[derive(Clone)]
struct CrossEntropy {
    targets: Arc<Vec<i64>>,
}

/// The row's log-sum-exp.
fn lse<T: Real>(row: &[T]) -> T {
    let m = row_max(row);
    m + sum_exp(row, m).ln()
}

fn forward<T: Real>(x: &[T], t: &[i64], classes: usize, stride: usize) -> Vec<T> {
    let rows = t.len();
    let mut out = Out::new(rows);
    let o = out.rows();
    par(rows, x.len(), |r| {
        // SAFETY: these rows' losses are this call's alone.
        let nll = unsafe { o.get(r.clone()) };
        for (k, i) in r.enumerate() {
            nll[k] = if t[i] == IGNORE_INDEX {
                T::zero()
            } else {
                let row = &x[i * stride..i * stride + classes];
                lse(row) - row[t[i] as usize]
            };
        }
    });
    // SAFETY: every row's loss was written.
    unsafe { out.into_vec(rows) }
}

fn backward<T: Real>(x: &[T], g: &[T], t: &[i64], classes: usize, stride: usize) -> Vec<T> {
    let total = t.len() * classes;
    let mut out = Out::new(total);
    let o = out.rows();
    par(t.len(), total, |r| {
        for i in r {
            // SAFETY: row i is this call's alone.
            let d = unsafe { o.get(i * classes..(i + 1) * classes) };
            if t[i] == IGNORE_INDEX {
                d.fill(T::zero());
                continue;
            }
            let row = &x[i * stride..i * stride + classes];
            let m = row_max(row);
            for (dv, &v) in d.iter_mut().zip(row) {
                *dv = v - m;
            }
            T::exp_slice(d);
            let sum = d.iter().copied().sum::<T>();
            let scale = g[i] / sum;
            for v in d.iter_mut() {
                *v *= scale;
            }
            let k = t[i] as usize;
            d[k] -= g[i];
        }
    });
    // SAFETY: every row was written.
    unsafe { out.into_vec(total) }
}

custom_op! {
    CustomOp1 for CrossEntropy, NAME, (s: l),
    cpu |this| {
        let t = &this.targets;
        let (rows, classes, stride) = geometry(l, t.len())?;
        // Not `dispatch!`: the losses of f16 and bf16 logits stay f32.
        let nll = match s {
            CpuStorage::F64(_) => storage(forward::<f64>(&rows_of(s, l)?, t, classes, stride)),
            CpuStorage::F32(_) | CpuStorage::F16(_) | CpuStorage::BF16(_) => {
                storage(forward::<f32>(&rows_of(s, l)?, t, classes, stride))
            }
            other => candle_core::bail!(
                "{NAME}: no kernel for {:?}",
                candle_core::backend::BackendStorage::dtype(other)
            ),
        };
        Ok((nll, Shape::from(rows)))
    },
    cuda |this| cuda::forward(s, l, &this.targets),
    fn bwd(&self, x: &Tensor, _y: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(x.apply_op2_no_bwd(
            &g.contiguous()?,
            &CrossEntropyGrad(self.clone()),
        )?))
    }
}

/// `g_i (softmax(x_i) - one_hot(t_i))` row by row, zero for ignored rows; `g` f32 (f64 for
/// f64 logits), the result in the logits' type.
struct CrossEntropyGrad(CrossEntropy);

custom_op! {
    CustomOp2 for CrossEntropyGrad, "pipewright-cross-entropy-grad", (sx: lx, sg: lg),
    cpu |this| {
        let (_, classes, stride) = geometry(lx, this.0.targets.len())?;
        dispatch!(NAME, sx, |sx: T| Ok((
            storage(backward::<T>(
                &rows_of(sx, lx)?,
                &input(sg, lg, NAME)?,
                &this.0.targets,
                classes,
                stride
            )),
            lx.shape().clone()
        )))
    },
    cuda |this| cuda::backward(sx, lx, sg, lg, &this.0.targets)
}

/// The same on a CUDA device (kernels/cuda/cross_entropy.cu); the targets go up with each call
/// (8 bytes a row, beside the row's classes).
#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::{CudaStorage, Layout, Result, Shape};

    use super::NAME;
    use crate::kernels::gpu::{self, typed, PushKernelArg};

    /// The targets on the GPU (one unread element when there are none: no empty buffers).
    fn upload(
        s: &CudaStorage,
        targets: &[i64],
    ) -> Result<candle_core::cuda_backend::cudarc::driver::CudaSlice<i64>> {
        let none: &[i64] = &[0];
        s.device()
            .clone_htod(if targets.is_empty() { none } else { targets })
    }

    pub(super) fn forward(
        s: &CudaStorage,
        l: &Layout,
        targets: &[i64],
    ) -> Result<(CudaStorage, Shape)> {
        let dev = s.device();
        let (rows, classes, stride) = super::geometry(l, targets.len())?;
        typed!(NAME, s.dtype(), |T| {
            if classes == 0 {
                // No classes: every target is ignored (validated by the caller), every loss 0.
                let nll = gpu::zeros::<f32>(dev, rows)?;
                return Ok((
                    CudaStorage::wrap_cuda_slice(nll, dev.clone()),
                    Shape::from(rows),
                ));
            }
            let t = upload(s, targets)?;
            let x = gpu::rows_view::<T>(s, l, NAME)?;
            let mut nll = gpu::alloc::<f32>(dev, rows)?;
            let f = gpu::func(dev, &gpu::CROSS_ENTROPY, "ce_fwd", s.dtype())?;
            gpu::launch(&f, gpu::per_row(rows, classes)?, rows, |a| {
                a.arg(&x).arg(&t).arg(&mut nll).arg(&classes).arg(&stride);
            })?;
            Ok((
                CudaStorage::wrap_cuda_slice(nll, dev.clone()),
                Shape::from(rows),
            ))
        })
    }

    pub(super) fn backward(
        sx: &CudaStorage,
        lx: &Layout,
        sg: &CudaStorage,
        lg: &Layout,
        targets: &[i64],
    ) -> Result<(CudaStorage, Shape)> {
        let dev = sx.device();
        let (rows, classes, stride) = super::geometry(lx, targets.len())?;
        let t = upload(sx, targets)?;
        typed!(NAME, sx.dtype(), |T| {
            if sg.dtype() != candle_core::DType::F32 {
                candle_core::bail!("{NAME}: the losses' gradient is {:?}, not f32", sg.dtype());
            }
            let (x, g) = (
                gpu::rows_view::<T>(sx, lx, NAME)?,
                gpu::view::<f32>(sg, lg, NAME)?,
            );
            let mut dx = gpu::alloc::<T>(dev, rows * classes)?;
            let f = gpu::func(dev, &gpu::CROSS_ENTROPY, "ce_bwd", sx.dtype())?;
            gpu::launch(&f, gpu::per_row(rows, classes)?, rows * classes, |a| {
                a.arg(&x)
                    .arg(&g)
                    .arg(&t)
                    .arg(&mut dx)
                    .arg(&classes)
                    .arg(&stride);
            })?;
            Ok((
                CudaStorage::wrap_cuda_slice(dx, dev.clone()),
                lx.shape().clone(),
            ))
        })
    }
}

/// For logits holding part of the classes (vocabulary parallelism): each row's
/// `[sum_j exp(x_j - m_i), x_t - m_i]` (the second zero where the target `t` is not in this
/// part or ignored), `m` the all-reduced row maximum, as one `(rows, 2)` tensor whose backward
/// is one pass too. `local[i]`: the target's index in this part, if it is here.
pub(crate) fn partial_sums(
    logits: &Tensor,
    max: &Tensor,
    local: Vec<Option<usize>>,
) -> candle_core::Result<Tensor> {
    logits.contiguous()?.apply_op2(
        &max.contiguous()?,
        Partial {
            local: Arc::new(local),
        },
    )
}

#[derive(Clone)]
struct Partial {
    local: Arc<Vec<Option<usize>>>,
}

fn partial_forward<T: Real>(x: &[T], m: &[T], local: &[Option<usize>], classes: usize) -> Vec<T> {
    let rows = local.len();
    let mut out = Out::new(2 * rows);
    let o = out.rows();
    par(rows, x.len(), |r| {
        // SAFETY: these rows' pairs are this call's alone.
        let pairs = unsafe { o.get(2 * r.start..2 * r.end) };
        for (k, i) in r.enumerate() {
            let row = &x[i * classes..(i + 1) * classes];
            pairs[2 * k] = sum_exp(row, m[i]);
            pairs[2 * k + 1] = local[i].map_or(T::zero(), |j| row[j] - m[i]);
        }
    });
    // SAFETY: every pair was written.
    unsafe { out.into_vec(2 * rows) }
}

/// `g_i0 exp(x_ij - m_i) + g_i1 [j == t_i]`.
fn partial_backward<T: Real>(
    x: &[T],
    m: &[T],
    g: &[T],
    local: &[Option<usize>],
    classes: usize,
) -> Vec<T> {
    let mut out = Out::new(x.len());
    let o = out.rows();
    par(local.len(), x.len(), |r| {
        for i in r {
            let row = &x[i * classes..(i + 1) * classes];
            // SAFETY: row i is this call's alone.
            let d = unsafe { o.get(i * classes..(i + 1) * classes) };
            for (dv, &v) in d.iter_mut().zip(row) {
                *dv = v - m[i];
            }
            T::exp_slice(d);
            for dv in d.iter_mut() {
                *dv *= g[2 * i];
            }
            if let Some(j) = local[i] {
                d[j] += g[2 * i + 1];
            }
        }
    });
    // SAFETY: every row was written.
    unsafe { out.into_vec(x.len()) }
}

custom_op! {
    CustomOp2 for Partial, "pipewright-vocab-parallel-partial", (sx: lx, sm: lm),
    cpu |this| {
        let (rows, classes) = lx.shape().dims2()?;
        if this.local.len() != rows || lm.shape().elem_count() != rows {
            candle_core::bail!("{NAME}: {rows} rows of logits, one maximum and target each");
        }
        dispatch!(NAME, sx, |sx: T| Ok((
            storage(partial_forward::<T>(
                &input(sx, lx, NAME)?,
                &input(sm, lm, NAME)?,
                &this.local,
                classes
            )),
            Shape::from((rows, 2))
        )))
    },
    fn bwd(
        &self,
        x: &Tensor,
        m: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let dx = x.apply_op3_no_bwd(m, &g.contiguous()?, &PartialGrad(self.clone()))?;
        Ok((Some(dx), None))
    }
}

struct PartialGrad(Partial);

custom_op! {
    CustomOp3 for PartialGrad, "pipewright-vocab-parallel-partial-grad", (sx: lx, sm: lm, sg: lg),
    cpu |this| {
        let (_, classes) = lx.shape().dims2()?;
        dispatch!(NAME, sx, |sx: T| Ok((
            storage(partial_backward::<T>(
                &input(sx, lx, NAME)?,
                &input(sm, lm, NAME)?,
                &input(sg, lg, NAME)?,
                &this.0.local,
                classes
            )),
            lx.shape().clone()
        )))
    }
}
