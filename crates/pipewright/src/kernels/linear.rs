//! A fully connected layer as one op: `x W (+ b)` over the last dimension of `x` (any leading
//! dimensions), the bias written first and the product accumulated onto it, and a backward
//! that writes the input, weight and bias gradients with two matrix products and one column
//! sum. The separate path is four graph nodes (two reshapes, the product, the bias) whose
//! gradients each cost candle a zero-filled tensor and an addition.

use candle_core::{CpuStorage, Layout, Shape, Tensor};
use gemm::{gemm, Parallelism};

use super::bias::column_sums;
use super::{custom_op, dispatch, gelu, input, par_elems, storage, Out, Real, Rows};

const NAME: &str = "pipewright-linear";

/// `x W^T + b` (`out_in`: `W` is `(out, in)`, as `torch.nn.Linear`) or `x W + b` (`W` is
/// `(in, out)`, as GPT-2's `Conv1D`) for CPU f32/f64 tensors, with a fused backward.
/// `gelu`: the product takes `gelu(x)`, computed on the fly and never stored (the backward
/// computes it again, with its slope, from one exponential per element).
pub(crate) fn linear(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    out_in: bool,
    gelu: bool,
) -> candle_core::Result<Tensor> {
    let op = Linear {
        out_in,
        bias: b.is_some(),
        gelu,
    };
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    match b {
        Some(b) => x.apply_op3(&w, &b.contiguous()?, op),
        None => x.apply_op2(&w, op),
    }
}

#[derive(Clone, Copy)]
struct Linear {
    out_in: bool,
    bias: bool,
    gelu: bool,
}

/// The sizes `(rows, in, out)` of `x` and `w`, checked.
fn sizes(lx: &Layout, lw: &Layout, out_in: bool) -> candle_core::Result<(usize, usize, usize)> {
    let inp = *lx.dims().last().unwrap_or(&0);
    let (a, b) = lw.shape().dims2()?;
    let (wi, wo) = if out_in { (b, a) } else { (a, b) };
    if wi != inp || inp == 0 {
        candle_core::bail!(
            "{NAME}: input {:?} against weight {:?}",
            lx.dims(),
            lw.dims()
        );
    }
    Ok((lx.shape().elem_count() / inp, inp, wo))
}

/// `dst (m x n) (+)= lhs (m x k) rhs (k x n)`, strides as (row, column).
#[allow(clippy::too_many_arguments)]
fn mm<T: Real>(
    (m, n, k): (usize, usize, usize),
    dst: &mut [T],
    accumulate: bool,
    lhs: &[T],
    (lrs, lcs): (usize, usize),
    rhs: &[T],
    (rrs, rcs): (usize, usize),
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            dst[..m * n].fill(T::zero());
        }
        return;
    }
    assert!(dst.len() >= m * n && lhs.len() > (m - 1) * lrs + (k - 1) * lcs);
    assert!(rhs.len() > (k - 1) * rrs + (n - 1) * rcs);
    let alpha = if accumulate { T::one() } else { T::zero() };
    let out = Rows(dst.as_mut_ptr());
    let run = |rows: std::ops::Range<usize>, par: Parallelism| {
        // SAFETY: the assertions bound every element the strides reach; each call writes only
        // its own rows of dst.
        unsafe {
            gemm(
                rows.len(),
                n,
                k,
                out.ptr().add(rows.start * n),
                1,
                n as isize,
                accumulate,
                lhs.as_ptr().add(rows.start * lrs),
                lcs as isize,
                lrs as isize,
                rhs.as_ptr(),
                rcs as isize,
                rrs as isize,
                alpha,
                T::one(),
                false,
                false,
                false,
                par,
            )
        }
    };
    // One band of rows per thread of candle's pool, each a single-threaded product: the
    // kernels and the products then share one pool (gemm's own threads are rayon's, whose
    // workers spun against the pool's on the same cores; measured 6-10 % of a GPT step).
    let threads = candle_core::utils::get_num_threads();
    if threads > 1 && m * n * k >= 64 * 64 * 64 {
        let band = m.div_ceil(threads).next_multiple_of(16);
        super::par(m.div_ceil(band), usize::MAX, |bs| {
            run(bs.start * band..(bs.end * band).min(m), Parallelism::None)
        });
    } else {
        run(0..m, Parallelism::None)
    }
}

impl Linear {
    /// The strides (row, column) of the `(in, out)` matrix the product uses.
    fn w_strides(&self, inp: usize, out: usize) -> (usize, usize) {
        if self.out_in {
            (1, inp)
        } else {
            (out, 1)
        }
    }

    fn forward<T: Real>(&self, x: &[T], w: &[T], b: Option<&[T]>, out: usize) -> Vec<T> {
        let activated;
        let x = if self.gelu {
            activated = gelu::forward(x);
            &activated[..]
        } else {
            x
        };
        let inp = w.len() / out;
        let rows = x.len() / inp;
        let mut y = match b {
            Some(b) => {
                let mut y = Vec::with_capacity(rows * out);
                for _ in 0..rows {
                    y.extend_from_slice(b);
                }
                y
            }
            // SAFETY: the product below writes every element (it does not read them).
            None => unsafe { Out::new(rows * out).into_vec(rows * out) },
        };
        mm(
            (rows, out, inp),
            &mut y,
            b.is_some(),
            x,
            (inp, 1),
            w,
            self.w_strides(inp, out),
        );
        y
    }

    /// `[dx | dW (stored as W) | db]`.
    fn backward<T: Real>(&self, x: &[T], w: &[T], g: &[T], out: usize) -> Vec<T> {
        let (activated, slopes);
        let x = if self.gelu {
            (activated, slopes) = gelu::values_and_slopes(x);
            &activated[..]
        } else {
            slopes = Vec::new();
            x
        };
        let inp = w.len() / out;
        let rows = x.len() / inp;
        let n = x.len() + w.len() + if self.bias { out } else { 0 };
        // SAFETY: the products write dx and dW whole, the column sums db.
        let mut all = unsafe { Out::<T>::new(n).into_vec(n) };
        let (dx, rest) = all.split_at_mut(x.len());
        let (dw, db) = rest.split_at_mut(w.len());
        // dx = g W_eff^T: W_eff^T (out x in) has strides swapped from W_eff's.
        let (wr, wc) = self.w_strides(inp, out);
        mm((rows, inp, out), dx, false, g, (out, 1), w, (wc, wr));
        if self.out_in {
            // dW (out x in) = g^T x
            mm((out, inp, rows), dw, false, g, (1, out), x, (inp, 1));
        } else {
            // dW (in x out) = x^T g
            mm((inp, out, rows), dw, false, x, (1, inp), g, (out, 1));
        }
        if self.gelu {
            // Through GELU: dx = (g W^T) * gelu'(x).
            let (d, n) = (Rows(dx.as_mut_ptr()), dx.len());
            par_elems(n, |r| {
                // SAFETY: blocks are disjoint and within dx.
                let d = unsafe { d.get(r.clone()) };
                d.iter_mut().zip(&slopes[r]).for_each(|(v, &s)| *v *= s);
            });
        }
        if self.bias {
            db.copy_from_slice(&column_sums(g, out));
        }
        all
    }

    fn out(&self, lw: &Layout) -> usize {
        let d = lw.dims();
        if self.out_in {
            d[0]
        } else {
            d[1]
        }
    }

    /// The gradients of `x`, `w` and (with a bias) `b` from the packed backward.
    fn grads(&self, x: &Tensor, w: &Tensor, g: &Tensor) -> candle_core::Result<Vec<Tensor>> {
        let packed = x.apply_op3_no_bwd(w, &g.contiguous()?, &LinearGrad(*self))?;
        let (nx, nw) = (x.elem_count(), w.elem_count());
        let mut v = vec![
            packed.narrow(0, 0, nx)?.reshape(x.shape())?,
            packed.narrow(0, nx, nw)?.reshape(w.shape())?,
        ];
        if self.bias {
            let out = packed.elem_count() - nx - nw;
            v.push(packed.narrow(0, nx + nw, out)?);
        }
        Ok(v)
    }

    /// The forward of either arity: the sizes checked, the product by element type.
    fn cpu(
        &self,
        (sx, lx): (&CpuStorage, &Layout),
        (sw, lw): (&CpuStorage, &Layout),
        bias: Option<(&CpuStorage, &Layout)>,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (_, _, out) = sizes(lx, lw, self.out_in)?;
        if let Some((_, lb)) = bias.filter(|(_, lb)| lb.dims() != [out]) {
            candle_core::bail!("{NAME}: bias {:?} for {out} outputs", lb.dims());
        }
        dispatch!(NAME, sx, |sx: T| {
            let b = bias.map(|(sb, lb)| input(sb, lb, NAME)).transpose()?;
            Ok((
                storage(self.forward::<T>(
                    &input(sx, lx, NAME)?,
                    &input(sw, lw, NAME)?,
                    b.as_deref(),
                    out,
                )),
                Self::out_shape(lx, out),
            ))
        })
    }

    fn out_shape(lx: &Layout, out: usize) -> Shape {
        let mut d = lx.dims().to_vec();
        *d.last_mut().unwrap() = out;
        Shape::from(d)
    }
}

custom_op! {
    CustomOp2 for Linear, NAME, (sx: lx, sw: lw),
    cpu |this| {
        this.cpu((sx, lx), (sw, lw), None)
    },
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let mut v = self.grads(x, w, g)?.into_iter();
        Ok((v.next(), v.next()))
    }
}

custom_op! {
    CustomOp3 for Linear, NAME, (sx: lx, sw: lw, sb: lb),
    cpu |this| {
        this.cpu((sx, lx), (sw, lw), Some((sb, lb)))
    },
    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let mut v = self.grads(x, w, g)?.into_iter();
        Ok((v.next(), v.next(), v.next()))
    }
}

/// The packed backward: `(x, w, g)` to `[dx | dW | db]`.
struct LinearGrad(Linear);

custom_op! {
    CustomOp3 for LinearGrad, "pipewright-linear-grad", (sx: lx, sw: lw, sg: lg),
    cpu |this| {
        let out = this.0.out(lw);
        dispatch!(NAME, sx, |sx: T| {
            let v = this.0.backward::<T>(
                &input(sx, lx, NAME)?,
                &input(sw, lw, NAME)?,
                &input(sg, lg, NAME)?,
                out,
            );
            let n = v.len();
            Ok((storage(v), Shape::from(n)))
        })
    }
}
