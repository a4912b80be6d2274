//! Dropout whose mask is drawn per element: element `e` of the whole tensor (row-major) is
//! dropped when the `e`-th `f64` of a ChaCha8 stream (`rand_chacha`'s `ChaCha8Rng`, keyed by
//! the run's seed, the site, the step and the micro-batch) is below `p`. That draw is words
//! `2e` and `2e + 1` of the stream, in ChaCha8 block `e / 8`, so any element's draw is computed
//! on its own: the mask is made where the tensor is (a GPU thread per element,
//! kernels/cuda/dropout.cu, the same integers), a part of a split tensor draws the whole
//! tensor's mask for its part, and the backward draws the mask again instead of keeping it
//! (`g` times the same mask: the op is linear). The masks are those the sequential stream drew
//! before this kernel (the test checks against `rand_chacha`).

use candle_core::{CpuStorage, Tensor};
use rand_chacha::rand_core::SeedableRng;

use super::{custom_op, dispatch, input, par_elems, storage, Out, Real};

const NAME: &str = "pipewright-dropout";

/// ChaCha's constants ("expand 32-byte k").
const SIGMA: [u32; 4] = [0x6170_7865, 0x3320_646e, 0x7962_2d32, 0x6b20_6574];

/// ChaCha8 block `counter` of the stream keyed `key` (stream id 0, as `ChaCha8Rng`).
fn block(key: &[u32; 8], counter: u64) -> [u32; 16] {
    let mut s = [0u32; 16];
    s[..4].copy_from_slice(&SIGMA);
    s[4..12].copy_from_slice(key);
    s[12] = counter as u32;
    s[13] = (counter >> 32) as u32;
    let init = s;
    let qr = |s: &mut [u32; 16], a: usize, b: usize, c: usize, d: usize| {
        s[a] = s[a].wrapping_add(s[b]);
        s[d] = (s[d] ^ s[a]).rotate_left(16);
        s[c] = s[c].wrapping_add(s[d]);
        s[b] = (s[b] ^ s[c]).rotate_left(12);
        s[a] = s[a].wrapping_add(s[b]);
        s[d] = (s[d] ^ s[a]).rotate_left(8);
        s[c] = s[c].wrapping_add(s[d]);
        s[b] = (s[b] ^ s[c]).rotate_left(7);
    };
    for _ in 0..4 {
        qr(&mut s, 0, 4, 8, 12);
        qr(&mut s, 1, 5, 9, 13);
        qr(&mut s, 2, 6, 10, 14);
        qr(&mut s, 3, 7, 11, 15);
        qr(&mut s, 0, 5, 10, 15);
        qr(&mut s, 1, 6, 11, 12);
        qr(&mut s, 2, 7, 8, 13);
        qr(&mut s, 3, 4, 9, 14);
    }
    for (v, i) in s.iter_mut().zip(init) {
        *v = v.wrapping_add(i);
    }
    s
}

/// The 64-bit draw `j` (0..8) of a block.
#[inline]
fn draw(b: &[u32; 16], j: usize) -> u64 {
    b[2 * j] as u64 | (b[2 * j + 1] as u64) << 32
}

/// Where a part lies in the whole tensor the mask is drawn for: the part's elements are
/// `outer x along x inner` (row-major), the whole's `outer x whole x inner`, the part's slab
/// starting at `offset` along the split axis.
#[derive(Clone, Copy, Debug)]
struct Placement {
    along: u64,
    whole: u64,
    offset: u64,
    inner: u64,
}

impl Placement {
    /// The whole tensor's index of the part's element `i`.
    #[inline]
    fn whole_index(&self, i: u64) -> u64 {
        let (slab, r) = (i / self.inner, i % self.inner);
        let (o, a) = (slab / self.along, slab % self.along);
        (o * self.whole + self.offset + a) * self.inner + r
    }
}

/// The mask's parameters: one op forward and backward.
#[derive(Clone, Copy, Debug)]
struct Dropout {
    key: [u32; 8],
    /// Dropped where the draw's top 53 bits are below this (`ceil(p 2^53)`: the stream's
    /// `f64` is those bits times `2^-53`, compared with `p`).
    threshold: u64,
    /// `1 / (1 - p)` rounded to f32 (0 when p is 1: nothing is kept).
    scale: f32,
    at: Placement,
}

/// `x` with each element zeroed with probability `p` and the rest scaled by `1 / (1 - p)`
/// (rounded to f32; in f32 for f16 and bf16, rounded once), the mask drawn for a whole tensor
/// of which `x` is part `index` of `count` along `axis` (`count` 1: all of it). `seed` keys the
/// stream (`ChaCha8Rng::seed_from_u64`; the caller hashes the run's seed, the site, the step
/// and the micro-batch into it).
pub(crate) fn dropout(
    x: &Tensor,
    p: f64,
    seed: u64,
    (axis, index, count): (usize, usize, usize),
) -> candle_core::Result<Tensor> {
    let dims = x.dims();
    if axis >= dims.len().max(1) || index >= count {
        candle_core::bail!("{NAME}: part {index} of {count} along axis {axis} of {dims:?}");
    }
    let along = dims.get(axis).copied().unwrap_or(1) as u64;
    let inner = dims.iter().skip(axis + 1).product::<usize>() as u64;
    let bytes = rand_chacha::ChaCha8Rng::seed_from_u64(seed).get_seed();
    let op = Dropout {
        key: std::array::from_fn(|i| {
            u32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap())
        }),
        threshold: (p.clamp(0.0, 1.0) * (1u64 << 53) as f64).ceil() as u64,
        scale: if p >= 1.0 {
            0.0
        } else {
            (1.0 / (1.0 - p)) as f32
        },
        at: Placement {
            along: along.max(1),
            whole: along * count as u64,
            offset: along * index as u64,
            inner: inner.max(1),
        },
    };
    x.contiguous()?.apply_op1(op)
}

fn forward<T: Real>(op: &Dropout, x: &[T]) -> Vec<T> {
    let n = x.len();
    let scale = T::from(op.scale).unwrap();
    let mut out = Out::new(n);
    let rows = out.rows();
    par_elems(n, |r| {
        // SAFETY: the ranges are disjoint and within `n`.
        let y = unsafe { rows.get(r.clone()) };
        // A part's elements run through the whole tensor in slabs: each block serves the
        // (up to) eight consecutive draws it holds.
        let mut held = (u64::MAX, [0u32; 16]);
        for (k, (o, &v)) in y.iter_mut().zip(&x[r.clone()]).enumerate() {
            let e = op.at.whole_index((r.start + k) as u64);
            if held.0 != e / 8 {
                held = (e / 8, block(&op.key, e / 8));
            }
            let kept = draw(&held.1, (e % 8) as usize) >> 11 >= op.threshold;
            *o = if kept { v * scale } else { T::zero() };
        }
    });
    // SAFETY: the blocks cover `0..n`.
    unsafe { out.into_vec(n) }
}

custom_op! {
    CustomOp1 for Dropout, NAME, (s: l),
    cpu |this| {
        dispatch!(NAME, s, |s: T| Ok((
            storage(forward::<T>(this, &input(s, l, NAME)?)),
            l.shape().clone()
        )))
    },
    cuda |this| cuda::forward(this, s, l),
    /// The same mask times the output's gradient.
    fn bwd(&self, _x: &Tensor, _y: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        Ok(Some(g.contiguous()?.apply_op1(*self)?))
    }
}

/// The same on a CUDA device (kernels/cuda/dropout.cu).
#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::{CudaStorage, Layout, Result, Shape};

    use super::{Dropout, NAME};
    use crate::kernels::gpu::{self, typed, PushKernelArg};

    pub(super) fn forward(
        op: &Dropout,
        s: &CudaStorage,
        l: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (dev, n) = (s.device(), l.shape().elem_count());
        let (scale, threshold) = (op.scale, op.threshold);
        let k = op.key;
        let (along, whole, offset, inner) = (op.at.along, op.at.whole, op.at.offset, op.at.inner);
        typed!(NAME, s.dtype(), |T| {
            let x = gpu::view::<T>(s, l, NAME)?;
            let mut y = gpu::alloc::<T>(dev, n)?;
            let f = gpu::func(dev, &gpu::DROPOUT, "dropout", s.dtype())?;
            gpu::launch(&f, gpu::elementwise(n), n, |b| {
                b.arg(&x).arg(&mut y).arg(&n).arg(&threshold).arg(&scale);
                b.arg(&along).arg(&whole).arg(&offset).arg(&inner);
                for w in &k {
                    b.arg(w);
                }
            })?;
            Ok((
                CudaStorage::wrap_cuda_slice(y, dev.clone()),
                l.shape().clone(),
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use super::dropout;

    fn ones(dims: &[usize]) -> Tensor {
        Tensor::ones(dims, DType::F32, &Device::Cpu).unwrap()
    }

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1().unwrap()
    }

    /// The share dropped is p within four standard deviations, the kept are scaled, and
    /// another key draws another mask.
    #[test]
    fn drops_a_share_p_and_scales_the_rest() {
        let n = 200_000usize;
        for p in [0.1, 0.5] {
            let y = values(&dropout(&ones(&[n]), p, 7, (0, 0, 1)).unwrap());
            let dropped = y.iter().filter(|&&v| v == 0.0).count() as f64;
            let sd = (n as f64 * p * (1.0 - p)).sqrt();
            assert!(
                (dropped - n as f64 * p).abs() < 4.0 * sd,
                "p {p}: {dropped}"
            );
            let scale = (1.0 / (1.0 - p)) as f32;
            assert!(y.iter().all(|&v| v == 0.0 || v == scale));
            let other = values(&dropout(&ones(&[n]), p, 8, (0, 0, 1)).unwrap());
            let same = y.iter().zip(&other).filter(|(a, b)| a == b).count() as f64;
            // Two independent masks agree on p^2 + (1-p)^2 of the elements.
            let agree = p * p + (1.0 - p) * (1.0 - p);
            assert!((same / n as f64 - agree).abs() < 0.01, "p {p}: {same}");
        }
        assert!(values(&dropout(&ones(&[9]), 0.0, 1, (0, 0, 1)).unwrap())
            .iter()
            .all(|&v| v == 1.0));
        assert!(values(&dropout(&ones(&[9]), 1.0, 1, (0, 0, 1)).unwrap())
            .iter()
            .all(|&v| v == 0.0));
    }

    /// The mask is the one the sequential stream draws: element `e` dropped when the `e`-th
    /// `f64` of `ChaCha8Rng::seed_from_u64(seed)` is below `p` (the masks before this kernel).
    #[test]
    fn the_mask_is_the_sequential_streams() {
        use rand::{Rng, SeedableRng};
        let (n, p, seed) = (1003usize, 0.3, 0x5eed_u64);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let want: Vec<f32> = (0..n)
            .map(|_| {
                if rng.random::<f64>() < p {
                    0.0
                } else {
                    (1.0 / (1.0 - p)) as f32
                }
            })
            .collect();
        assert_eq!(
            values(&dropout(&ones(&[n]), p, seed, (0, 0, 1)).unwrap()),
            want
        );
    }

    /// Each part of a split tensor draws the whole tensor's mask for its part, on any axis.
    #[test]
    fn parts_draw_the_whole_masks_parts() {
        let dims = [2, 6, 5];
        let x = Tensor::arange(1f32, 61., &Device::Cpu)
            .unwrap()
            .reshape(&dims[..])
            .unwrap();
        let whole = dropout(&x, 0.4, 3, (0, 0, 1)).unwrap();
        for (axis, count) in [(0, 2), (1, 3), (2, 5), (1, 1)] {
            let size = dims[axis] / count;
            for index in 0..count {
                let part = x.narrow(axis, index * size, size).unwrap();
                let got = dropout(&part, 0.4, 3, (axis, index, count)).unwrap();
                let want = whole.narrow(axis, index * size, size).unwrap();
                assert_eq!(values(&got), values(&want), "axis {axis}, part {index}");
            }
        }
    }
}
