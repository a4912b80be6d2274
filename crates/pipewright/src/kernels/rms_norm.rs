//! RMSNorm over the last dimension, fused (Llama's): each row's reciprocal root mean square
//! computed once and the output written in the same pass; the backward recomputes it from the
//! row and writes the input's gradient and each row block's share of the weight's gradient in
//! one pass.

use candle_core::{CpuStorage, Tensor};

use super::layer_norm::{norm_grad_cpu, sums, NormGrad};
use super::{custom_op, dispatch, input, par, row_grads, storage, Out, Real};

const NAME: &str = "pipewright-rms-norm";

/// `x / sqrt(mean(x^2) + eps) * weight` of a CPU float tensor, with a fused backward for `x`
/// and `weight`.
pub(crate) fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    x.contiguous()?
        .apply_op2(&weight.contiguous()?, RmsNorm { eps })
}

struct RmsNorm {
    eps: f64,
}

struct RmsNormGrad {
    eps: f64,
}

impl NormGrad for RmsNormGrad {
    const NAME: &'static str = NAME;
    const PARAMS: usize = 1;
    fn backward<T: Real>(&self, x: &[T], w: &[T], g: &[T]) -> Vec<T> {
        backward(x, w, g, self.eps)
    }
}

/// 1 / sqrt(mean(row^2) + eps).
fn rstd<T: Real>(row: &[T], eps: T) -> T {
    let n = T::from(row.len()).unwrap();
    let [ss] = sums(row, row, row, |v, _, _| [v * v]);
    (ss / n + eps).sqrt().recip()
}

fn forward<T: Real>(x: &[T], w: &[T], eps: f64) -> Vec<T> {
    let cols = w.len();
    let rows = x.len() / cols.max(1);
    let eps = T::from(eps).unwrap();
    let mut out = Out::new(x.len());
    let o = out.rows();
    par(rows, x.len(), |r| {
        for i in r {
            let row = &x[i * cols..(i + 1) * cols];
            let s = rstd(row, eps);
            // SAFETY: row i is this call's alone.
            let y = unsafe { o.get(i * cols..(i + 1) * cols) };
            for j in 0..cols {
                y[j] = row[j] * s * w[j];
            }
        }
    });
    // SAFETY: every row was written.
    unsafe { out.into_vec(x.len()) }
}

/// `[dx (rows x cols) | dw (cols)]` in one buffer.
fn backward<T: Real>(x: &[T], w: &[T], g: &[T], eps: f64) -> Vec<T> {
    let cols = w.len();
    let eps = T::from(eps).unwrap();
    let n = T::from(cols).unwrap();
    row_grads(x.len() / cols.max(1), cols, cols, |i, dw, d| {
        let row = &x[i * cols..(i + 1) * cols];
        let gr = &g[i * cols..(i + 1) * cols];
        let s = rstd(row, eps);
        for j in 0..cols {
            dw[j] += gr[j] * row[j] * s;
        }
        // d/dx of x*s*w: s*(g*w) - x * s^3 * mean(g*w*x).
        let [gwx] = sums(row, gr, w, |v, g, wj| [g * wj * v]);
        let m = gwx / n * s * s * s;
        for j in 0..cols {
            d[j] = s * gr[j] * w[j] - row[j] * m;
        }
    })
}

custom_op! {
    CustomOp2 for RmsNorm, NAME, (sx: lx, sw: lw),
    cpu |this| {
        let cols = *lx.dims().last().unwrap_or(&0);
        if lw.dims() != [cols] || cols == 0 {
            candle_core::bail!(
                "{NAME}: weight {:?} must have the {cols} elements of a row",
                lw.dims()
            );
        }
        dispatch!(NAME, sx, |sx: T| Ok((
            storage(forward::<T>(
                &input(sx, lx, NAME)?,
                &input(sw, lw, NAME)?,
                this.eps
            )),
            lx.shape().clone()
        )))
    },
    cuda |this| cuda::forward([(sx, lx), (sw, lw)], this.eps),
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let n = x.elem_count();
        let cols = w.elem_count();
        let packed = x.apply_op3_no_bwd(w, &g.contiguous()?, &RmsNormGrad { eps: self.eps })?;
        let dx = packed.narrow(0, 0, n)?.reshape(x.shape())?;
        let dw = packed.narrow(0, n, cols)?;
        Ok((Some(dx), Some(dw)))
    }
}

custom_op! {
    CustomOp3 for RmsNormGrad, "pipewright-rms-norm-grad", (sx: lx, sw: lw, sg: lg),
    cpu |this| norm_grad_cpu(this, [(sx, lx), (sw, lw), (sg, lg)]),
    cuda |this| cuda::backward([(sx, lx), (sw, lw), (sg, lg)], this.eps)
}

/// The same on a CUDA device (kernels/cuda/rms_norm.cu).
#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::{CudaStorage, Layout, Result, Shape};

    use super::NAME;
    use crate::kernels::gpu;

    type Input<'a> = (&'a CudaStorage, &'a Layout);

    pub(super) fn forward(
        [(sx, lx), (sw, lw)]: [Input; 2],
        eps: f64,
    ) -> Result<(CudaStorage, Shape)> {
        let (rows, cols) = gpu::rows_cols(NAME, lx, lw)?;
        let kernel = (&gpu::RMS_NORM, "rms_fwd", NAME);
        gpu::norm_forward(kernel, (sx, lx), &[(sw, lw)], (rows, cols, eps))
    }

    /// `[dx | dw]`, as the CPU twin packs them.
    pub(super) fn backward(inputs: [Input; 3], eps: f64) -> Result<(CudaStorage, Shape)> {
        gpu::norm_backward((&gpu::RMS_NORM, "rms", NAME), inputs, eps, (1, 1))
    }
}
