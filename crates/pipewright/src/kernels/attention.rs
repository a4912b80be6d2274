//! Causal self-attention over a packed `(batch, time, 3 * width)` q | k | v tensor in one op,
//! flash-style: each (batch, head) pair computes its `(time x time)` scores, softmax and
//! output in scratch memory that never becomes a tensor, and the backward recomputes them.
//! The separate path builds a dozen graph nodes per layer (three narrows whose gradients are
//! padded to the whole packed tensor, head transposes and copies, the stored scores and
//! probabilities); this one is one node whose gradient is the packed tensor's, written once.

use candle_core::{CpuStorage, Layout, Shape, Tensor};
use gemm::{gemm, Parallelism};

use super::{custom_op, dispatch, input, par, row_max, storage, Out, Real};

const NAME: &str = "pipewright-attention";

/// `softmax(q k^T * scale, causal) v` for every head of `qkv`
/// `(batch, time, 3 * heads * head_dim)` (q, k, v in thirds, heads contiguous within each),
/// giving `(batch, time, heads * head_dim)`: CPU f32/f64 (f16/bf16 through f32), or a CUDA
/// tensor whose head dimension is at most [`GPU_HEAD_DIM`].
pub(crate) fn causal_attention(
    qkv: &Tensor,
    heads: usize,
    scale: f64,
) -> candle_core::Result<Tensor> {
    qkv.contiguous()?.apply_op1(Attention { heads, scale })
}

/// The largest head dimension the CUDA kernels take (a lane's registers hold 16 of a row's
/// columns, at most 8 lanes a row).
pub(crate) const GPU_HEAD_DIM: usize = 128;

/// Whether [`causal_attention`] takes `qkv` with `heads` heads.
pub(crate) fn takes(qkv: &Tensor, heads: usize) -> bool {
    let width = qkv.dims().last().copied().unwrap_or(0);
    super::fused(qkv)
        || (super::fused_or_gpu(qkv) && heads > 0 && width / (3 * heads) <= GPU_HEAD_DIM)
}

#[derive(Clone, Copy)]
struct Attention {
    heads: usize,
    scale: f64,
}

/// Where one (batch, head) pair's q, k and v start, and the strides of the packed tensor.
#[derive(Clone, Copy)]
struct Geometry {
    t: usize,
    hd: usize,
    /// Width of one third (q, k or v): heads * head_dim.
    lc: usize,
}

impl Geometry {
    fn of(l: &Layout, heads: usize) -> candle_core::Result<Self> {
        let (_, t, c3) = l.shape().dims3()?;
        if heads == 0 || c3 % (3 * heads) != 0 {
            candle_core::bail!("{NAME}: {c3} packed columns do not hold 3 x {heads} heads");
        }
        Ok(Self {
            t,
            hd: c3 / (3 * heads),
            lc: c3 / 3,
        })
    }

    /// Offset in the packed tensor of part `which` (0 q, 1 k, 2 v) of `unit` = b * heads + h.
    fn part(&self, unit: usize, heads: usize, which: usize) -> usize {
        let (b, h) = (unit / heads, unit % heads);
        b * self.t * 3 * self.lc + which * self.lc + h * self.hd
    }
}

/// `dst (m x n) = lhs (m x k) * rhs (k x n)`, strides as (row, column), on this thread.
#[allow(clippy::too_many_arguments)]
unsafe fn mm<T: Real>(
    (m, n, k): (usize, usize, usize),
    dst: *mut T,
    (drs, dcs): (usize, usize),
    lhs: *const T,
    (lrs, lcs): (usize, usize),
    rhs: *const T,
    (rrs, rcs): (usize, usize),
) {
    gemm(
        m,
        n,
        k,
        dst,
        dcs as isize,
        drs as isize,
        false,
        lhs,
        lcs as isize,
        lrs as isize,
        rhs,
        rcs as isize,
        rrs as isize,
        T::zero(),
        T::one(),
        false,
        false,
        false,
        Parallelism::None,
    );
}

/// Query (and key) blocks: query block `qb` only needs keys `0..(qb + 1) * BLOCK`, so the
/// products skip the masked upper triangle block by block (10 of 16 blocks at 256 positions).
const BLOCK: usize = 64;

/// The query rows of each block and how many keys they see: `(first row, rows, keys)`.
fn blocks(t: usize) -> impl Iterator<Item = (usize, usize, usize)> {
    (0..t.div_ceil(BLOCK)).map(move |b| {
        let r0 = b * BLOCK;
        let rows = BLOCK.min(t - r0);
        (r0, rows, r0 + rows)
    })
}

impl Attention {
    /// The probabilities of one unit into `p` (t x t, row i valid in `0..` the end of its
    /// block, zero after i), scores computed there first.
    fn probabilities<T: Real>(&self, x: &[T], g: Geometry, unit: usize, p: &mut [T]) {
        let (t, hd, rs) = (g.t, g.hd, 3 * g.lc);
        let (q, k) = (g.part(unit, self.heads, 0), g.part(unit, self.heads, 1));
        let xp = x.as_ptr();
        for (r0, rows, keys) in blocks(t) {
            // SAFETY: q's rows r0.. and k's rows ..keys lie within `x`; p holds t * t.
            unsafe {
                let (dst, lhs) = (p.as_mut_ptr().add(r0 * t), xp.add(q + r0 * rs));
                mm(
                    (rows, keys, hd),
                    dst,
                    (t, 1),
                    lhs,
                    (rs, 1),
                    xp.add(k),
                    (1, rs),
                );
            }
        }
        let scale = T::from(self.scale).unwrap();
        for (i, row) in p.chunks_mut(t).enumerate() {
            let m = row_max(&row[..=i]);
            for v in &mut row[..=i] {
                *v = (*v - m) * scale;
            }
            T::exp_slice(&mut row[..=i]);
            let sum = row[..=i].iter().copied().sum::<T>();
            let inv = sum.recip();
            row[..=i].iter_mut().for_each(|v| *v *= inv);
            row[i + 1..].fill(T::zero());
        }
    }

    fn forward<T: Real>(&self, x: &[T], g: Geometry, batch: usize) -> Vec<T> {
        let (t, lc, hd) = (g.t, g.lc, g.hd);
        let n = batch * t * lc;
        let mut out = Out::<T>::new(n);
        let o = out.rows();
        par(batch * self.heads, batch * self.heads * t * t, |units| {
            let mut p = vec![T::zero(); t * t];
            for u in units {
                self.probabilities(x, g, u, &mut p);
                let (b, h) = (u / self.heads, u % self.heads);
                let v = g.part(u, self.heads, 2);
                for (r0, rows, keys) in blocks(t) {
                    // SAFETY: unit u alone writes its head's columns of batch b's rows; the
                    // reads lie within `p` and `x`.
                    unsafe {
                        let dst = o.ptr().add(b * t * lc + r0 * lc + h * hd);
                        let (pp, vp) = (p.as_ptr().add(r0 * t), x.as_ptr().add(v));
                        mm((rows, hd, keys), dst, (lc, 1), pp, (t, 1), vp, (3 * lc, 1));
                    }
                }
            }
        });
        // SAFETY: every unit wrote its columns of every row.
        unsafe { out.into_vec(n) }
    }

    /// The packed gradient `(batch, time, 3 lc)` from the output's gradient `dy`.
    fn backward<T: Real>(&self, x: &[T], dy: &[T], g: Geometry, batch: usize) -> Vec<T> {
        let (t, hd, lc) = (g.t, g.hd, g.lc);
        let rs = 3 * lc;
        let n = x.len();
        let scale = T::from(self.scale).unwrap();
        let mut out = Out::<T>::new(n);
        let o = out.rows();
        par(batch * self.heads, batch * self.heads * t * t, |units| {
            let (mut p, mut dp) = (vec![T::zero(); t * t], vec![T::zero(); t * t]);
            for u in units {
                self.probabilities(x, g, u, &mut p);
                let (b, h) = (u / self.heads, u % self.heads);
                let (q, k, v) = (
                    g.part(u, self.heads, 0),
                    g.part(u, self.heads, 1),
                    g.part(u, self.heads, 2),
                );
                let dyu = b * t * lc + h * hd;
                let (xp, gp, dst) = (x.as_ptr(), dy.as_ptr(), o.ptr());
                // SAFETY (every block below): unit u alone writes its head's q, k and v columns
                // of batch b's rows; every read lies within `x`, `dy`, `p` and `dp`.
                for (r0, rows, keys) in blocks(t) {
                    // dP = dY V^T, this block's rows over the keys they see.
                    unsafe {
                        let (d, l) = (dp.as_mut_ptr().add(r0 * t), gp.add(dyu + r0 * lc));
                        mm((rows, keys, hd), d, (t, 1), l, (lc, 1), xp.add(v), (1, rs));
                    }
                    // dS = scale * P * (dP - sum(dP * P)), in dp (zero after the diagonal).
                    for i in r0..r0 + rows {
                        let (pr, dr) = (&p[i * t..i * t + keys], &mut dp[i * t..i * t + keys]);
                        let dot = (0..=i).map(|j| pr[j] * dr[j]).sum::<T>();
                        for j in 0..=i {
                            dr[j] = scale * pr[j] * (dr[j] - dot);
                        }
                        dr[i + 1..].fill(T::zero());
                    }
                    // dQ = dS K
                    unsafe {
                        let (d, l) = (dst.add(q + r0 * rs), dp.as_ptr().add(r0 * t));
                        mm((rows, hd, keys), d, (rs, 1), l, (t, 1), xp.add(k), (rs, 1));
                    }
                }
                for (c0, cols, _) in blocks(t) {
                    // Key block c0..: only queries c0.. see it. dV = P^T dY, dK = dS^T Q.
                    let m = t - c0;
                    unsafe {
                        let (d, l) = (dst.add(v + c0 * rs), p.as_ptr().add(c0 * t + c0));
                        mm(
                            (cols, hd, m),
                            d,
                            (rs, 1),
                            l,
                            (1, t),
                            gp.add(dyu + c0 * lc),
                            (lc, 1),
                        );
                        let (d, l) = (dst.add(k + c0 * rs), dp.as_ptr().add(c0 * t + c0));
                        mm(
                            (cols, hd, m),
                            d,
                            (rs, 1),
                            l,
                            (1, t),
                            xp.add(q + c0 * rs),
                            (rs, 1),
                        );
                    }
                }
            }
        });
        // SAFETY: every unit wrote its q, k and v columns of every row.
        unsafe { out.into_vec(n) }
    }
}

custom_op! {
    CustomOp1 for Attention, NAME, (s: l),
    cpu |this| {
        let g = Geometry::of(l, this.heads)?;
        let batch = l.dims()[0];
        dispatch!(NAME, s, |s: T| Ok((
            storage(this.forward::<T>(&input(s, l, NAME)?, g, batch)),
            Shape::from((batch, g.t, g.lc))
        )))
    },
    cuda |this| cuda::forward(this, s, l),
    fn bwd(&self, x: &Tensor, y: &Tensor, dy: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(x.apply_op3_no_bwd(
            y,
            &dy.contiguous()?,
            &AttentionGrad(*self),
        )?))
    }
}

/// The packed gradient from `(qkv, y, dy)` (the CPU recomputes without `y`; the GPU's
/// backward takes each row's `dy . y` from it).
struct AttentionGrad(Attention);

custom_op! {
    CustomOp3 for AttentionGrad, "pipewright-attention-grad", (sx: lx, sy: ly, sg: lg),
    cpu |this| {
        let _ = (sy, ly); // The CPU recomputes the output.
        let g = Geometry::of(lx, this.0.heads)?;
        let batch = lx.dims()[0];
        dispatch!(NAME, sx, |sx: T| Ok((
            storage(
                this.0
                    .backward::<T>(&input(sx, lx, NAME)?, &input(sg, lg, NAME)?, g, batch)
            ),
            lx.shape().clone()
        )))
    },
    cuda |this| cuda::backward(&this.0, [(sx, lx), (sy, ly), (sg, lg)])
}

/// The same on a CUDA device: bf16 and f16 through the tensor-core flash kernels
/// (kernels/cuda/flash.cu), f32 through cuBLAS's products while a chunk of heads' scores fits a
/// scratch buffer (kernels/attention_blas.rs), else the SIMT flash kernels
/// (kernels/cuda/attention.cu). None keeps anything past the op.
#[cfg(feature = "cuda")]
#[path = "attention_gpu.rs"]
pub(crate) mod cuda;
