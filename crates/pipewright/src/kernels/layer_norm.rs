//! LayerNorm over the last dimension, fused: each row's mean and reciprocal standard deviation
//! computed once, the output written in the same pass; the backward recomputes both from the
//! row (one extra read of the row, no saved tensors) and writes the input's gradient and
//! each row block's share of the weight and bias gradients in one pass.

use candle_core::{CpuStorage, Shape, Tensor};

use super::{custom_op, dispatch, input, par, row_grads, storage, Out, Real};

const NAME: &str = "pipewright-layer-norm";

/// `(x - mean) / sqrt(var + eps) * weight + bias` of a CPU f32/f64 tensor (biased variance,
/// as `torch.nn.LayerNorm`), with a fused backward for `x`, `weight` and `bias`.
pub(crate) fn layer_norm(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
) -> candle_core::Result<Tensor> {
    // Any leading dimensions: the op sees rows of the last one (no reshape nodes, whose
    // gradients would cost a pass each).
    x.contiguous()?.apply_op3(
        &weight.contiguous()?,
        &bias.contiguous()?,
        LayerNorm { eps },
    )
}

struct LayerNorm {
    eps: f64,
}

struct LayerNormGrad {
    eps: f64,
}

/// A norm's backward on the CPU over `(x, weight, dy)`, packed as `[dx | dw (| db)]`: what
/// the LayerNorm's and the RMSNorm's gradient ops share.
pub(super) trait NormGrad {
    /// The op's name, for errors.
    const NAME: &'static str;
    /// Weight-sized gradients after the input's (2 with a bias, 1 without).
    const PARAMS: usize;
    /// The packed gradient of rows of `w.len()`.
    fn backward<T: Real>(&self, x: &[T], w: &[T], g: &[T]) -> Vec<T>;
}

/// [`NormGrad::backward`] over the storages of `(x, weight, dy)`, in their type.
pub(super) fn norm_grad_cpu<N: NormGrad>(
    op: &N,
    [(sx, lx), (sw, lw), (sg, lg)]: [(&CpuStorage, &candle_core::Layout); 3],
) -> candle_core::Result<(CpuStorage, Shape)> {
    let n = lx.shape().elem_count() + N::PARAMS * lw.shape().elem_count();
    dispatch!(N::NAME, sx, |sx: T| Ok((
        storage(op.backward::<T>(
            &input(sx, lx, N::NAME)?,
            &input(sw, lw, N::NAME)?,
            &input(sg, lg, N::NAME)?
        )),
        Shape::from(n)
    )))
}

impl NormGrad for LayerNormGrad {
    const NAME: &'static str = NAME;
    const PARAMS: usize = 2;
    fn backward<T: Real>(&self, x: &[T], w: &[T], g: &[T]) -> Vec<T> {
        backward(x, w, g, self.eps)
    }
}

/// Partial sums kept apart: one running sum is a chain of dependent additions, eight are one
/// vector register's worth the compiler can keep in flight.
const LANES: usize = 8;

/// The `K` sums `sum_j f(a_j, b_j, c_j)` over three rows of equal length, each in [`LANES`]
/// interleaved partial sums added in a fixed order (the same for every row and thread).
pub(crate) fn sums<const K: usize, T: Real>(
    a: &[T],
    b: &[T],
    c: &[T],
    f: impl Fn(T, T, T) -> [T; K],
) -> [T; K] {
    let mut acc = [[T::zero(); LANES]; K];
    let (ca, cb, cc) = (
        a.chunks_exact(LANES),
        b.chunks_exact(LANES),
        c.chunks_exact(LANES),
    );
    let (ra, rb, rc) = (ca.remainder(), cb.remainder(), cc.remainder());
    for ((x, y), z) in ca.zip(cb).zip(cc) {
        for k in 0..LANES {
            for (s, v) in acc.iter_mut().zip(f(x[k], y[k], z[k])) {
                s[k] += v;
            }
        }
    }
    for k in 0..ra.len() {
        for (s, v) in acc.iter_mut().zip(f(ra[k], rb[k], rc[k])) {
            s[k] += v;
        }
    }
    acc.map(|p| ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7])))
}

/// The mean and 1 / sqrt(var + eps) of `row` (two passes: the variance of the centred row).
fn stats<T: Real>(row: &[T], eps: T) -> (T, T) {
    let n = T::from(row.len()).unwrap();
    let [mean] = sums(row, row, row, |v, _, _| [v]).map(|t| t / n);
    let [var] = sums(row, row, row, |v, _, _| [(v - mean) * (v - mean)]).map(|t| t / n);
    (mean, (var + eps).sqrt().recip())
}

fn forward<T: Real>(x: &[T], w: &[T], b: &[T], eps: f64) -> Vec<T> {
    let cols = w.len();
    let rows = x.len() / cols;
    let eps = T::from(eps).unwrap();
    let mut out = Out::new(x.len());
    let o = out.rows();
    par(rows, x.len(), |r| {
        for i in r {
            let row = &x[i * cols..(i + 1) * cols];
            let (mean, rstd) = stats(row, eps);
            // SAFETY: row i is this call's alone.
            let y = unsafe { o.get(i * cols..(i + 1) * cols) };
            for j in 0..cols {
                y[j] = (row[j] - mean) * rstd * w[j] + b[j];
            }
        }
    });
    // SAFETY: every row was written.
    unsafe { out.into_vec(x.len()) }
}

/// `[dx (rows x cols) | dw (cols) | db (cols)]` in one buffer.
fn backward<T: Real>(x: &[T], w: &[T], g: &[T], eps: f64) -> Vec<T> {
    let cols = w.len();
    let eps = T::from(eps).unwrap();
    let n = T::from(cols).unwrap();
    // Each block's weight and bias gradient sums side by side.
    row_grads(x.len() / cols, cols, 2 * cols, |i, part, d| {
        let (dw, db) = part.split_at_mut(cols);
        let row = &x[i * cols..(i + 1) * cols];
        let gr = &g[i * cols..(i + 1) * cols];
        let (mean, rstd) = stats(row, eps);
        for j in 0..cols {
            let xh = (row[j] - mean) * rstd;
            dw[j] += gr[j] * xh;
            db[j] += gr[j];
        }
        let [s1, s2] = sums(row, gr, w, |v, g, wj| {
            let gw = g * wj;
            [gw, gw * ((v - mean) * rstd)]
        });
        let (m1, m2) = (s1 / n, s2 / n);
        for j in 0..cols {
            let xh = (row[j] - mean) * rstd;
            d[j] = rstd * (gr[j] * w[j] - m1 - xh * m2);
        }
    })
}

custom_op! {
    CustomOp3 for LayerNorm, NAME, (sx: lx, sw: lw, sb: lb),
    cpu |this| {
        let cols = *lx.dims().last().unwrap_or(&0);
        if lw.dims() != [cols] || lb.dims() != [cols] {
            candle_core::bail!(
                "{NAME}: weight {:?} and bias {:?} must have the {cols} elements of a row",
                lw.dims(),
                lb.dims()
            );
        }
        dispatch!(NAME, sx, |sx: T| Ok((
            storage(forward::<T>(
                &input(sx, lx, NAME)?,
                &input(sw, lw, NAME)?,
                &input(sb, lb, NAME)?,
                this.eps
            )),
            lx.shape().clone()
        )))
    },
    cuda |this| cuda::forward([(sx, lx), (sw, lw), (sb, lb)], this.eps),
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let n = x.elem_count();
        let cols = w.elem_count();
        let packed = x.apply_op3_no_bwd(w, &g.contiguous()?, &LayerNormGrad { eps: self.eps })?;
        let dx = packed.narrow(0, 0, n)?.reshape(x.shape())?;
        let dw = packed.narrow(0, n, cols)?;
        let db = packed.narrow(0, n + cols, cols)?;
        Ok((Some(dx), Some(dw), Some(db)))
    }
}

custom_op! {
    CustomOp3 for LayerNormGrad, "pipewright-layer-norm-grad", (sx: lx, sw: lw, sg: lg),
    cpu |this| norm_grad_cpu(this, [(sx, lx), (sw, lw), (sg, lg)]),
    cuda |this| cuda::backward([(sx, lx), (sw, lw), (sg, lg)], this.eps)
}

/// The same on a CUDA device (kernels/cuda/layer_norm.cu).
#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::{CudaStorage, Layout, Result, Shape};

    use super::NAME;
    use crate::kernels::gpu;

    type Input<'a> = (&'a CudaStorage, &'a Layout);

    pub(super) fn forward(
        [(sx, lx), (sw, lw), (sb, lb)]: [Input; 3],
        eps: f64,
    ) -> Result<(CudaStorage, Shape)> {
        let (rows, cols) = gpu::rows_cols(NAME, lx, lw)?;
        if lb.dims() != [cols] {
            candle_core::bail!("{NAME}: bias {:?} for rows of {cols}", lb.dims());
        }
        let weights = [(sw, lw), (sb, lb)];
        let kernel = (&gpu::LAYER_NORM, "ln_fwd", NAME);
        gpu::norm_forward(kernel, (sx, lx), &weights, (rows, cols, eps))
    }

    /// `[dx | dw | db]`, as the CPU twin packs them.
    pub(super) fn backward(inputs: [Input; 3], eps: f64) -> Result<(CudaStorage, Shape)> {
        gpu::norm_backward((&gpu::LAYER_NORM, "ln", NAME), inputs, eps, (2, 2))
    }
}
