//! Fused kernels: each operation one pass over its rows forward and one pass backward, one
//! candle custom op per operation whose backward is itself one fused op.
//!
//! candle composes GELU, LayerNorm, softmax and cross-entropy from a dozen element-wise ops
//! each, forward and backward, every one allocating and walking a whole tensor, and every
//! graph node costs its backward a zero-filled gradient and an addition; on the benchmark GPT
//! that was more of a training step than the matrix products. Here GELU, LayerNorm, softmax,
//! causal attention, cross-entropy, the linear layer, the bias add, the embedding lookup and
//! dropout (and the Llama's RMSNorm, SwiGLU gate and rotary embedding) are fused ops; AdamW,
//! casts and gradient norms take many tensors in one pass.
//!
//! Where each runs:
//! - **CPU** (`cpu_fwd`): parallel over rows on candle's CPU pool (the pool its element-wise
//!   ops use), for f32 (and f64, for the finite-difference tests), and for f16 and bf16 by
//!   widening to f32 and rounding each result once ([`Real`], `exp.rs`'s vectorised `exp`).
//! - **CUDA** (`cuda_fwd`, the `cuda` feature): the same op launches its kernel from `cuda/`
//!   (one `.cu` file per op family, the folder the one list `build.rs` compiles and `gpu.rs`
//!   embeds); attention through cuBLAS (`attention_blas.rs`) or the flash kernel; the
//!   many-tensor launches through `gpu_table.rs`. The CPU op is each GPU kernel's oracle
//!   (`gpu_tests.rs`, run on a GPU machine).
//! - **Other devices** take the composed candle ops, which compute the same function (and are
//!   the oracle of `tests/kernels.rs`).

pub(crate) mod adamw;
pub(crate) mod attention;
#[cfg(feature = "cuda")]
pub(crate) mod attention_blas;
pub(crate) mod bias;
pub(crate) mod cast;
pub(crate) mod cross_entropy;
pub(crate) mod dropout;
pub(crate) mod embedding;
pub(crate) mod exp;
pub(crate) mod gelu;
#[cfg(feature = "cuda")]
pub(crate) mod gpu;
#[cfg(feature = "cuda")]
pub(crate) mod gpu_table;
#[cfg(all(test, feature = "cuda"))]
pub(crate) mod gpu_tests;
#[cfg(all(test, feature = "cuda"))]
mod gpu_tests_step;
pub(crate) mod layer_norm;
pub(crate) mod linear;
pub(crate) mod reduce;
pub(crate) mod rms_norm;
pub(crate) mod rotary;
pub(crate) mod softmax;
pub(crate) mod swiglu;

pub use cross_entropy::IGNORE_INDEX;

use std::borrow::Cow;
use std::ops::Range;

use half::slice::HalfFloatSliceExt;
use half::vec::HalfFloatVecExt;

use candle_core::{CpuStorage, DType, Layout, Tensor, WithDType};

/// The element types the kernels are written for.
pub(crate) trait Real:
    num_traits::Float
    + WithDType
    + Send
    + Sync
    + std::iter::Sum
    + std::ops::AddAssign
    + std::ops::SubAssign
    + std::ops::MulAssign
    + exp::ExpSlice
{
}
impl Real for f32 {}
impl Real for f64 {}

/// Row blocks a normalisation's backward sums its weight gradients over: fixed, so the sums
/// are the same whatever the number of threads.
const GRAD_BLOCKS: usize = 32;

/// The backward of a row-wise op with per-column weights (LayerNorm, RMSNorm): rows in
/// [`GRAD_BLOCKS`] blocks on the pool, `row(i, acc, dx)` writing row `i`'s input gradient
/// into `dx` (`cols` elements) and adding its weight-gradient terms into its block's `acc`
/// (`width` elements). Returns `[dx (rows x cols) | the blocks' acc summed in block order]`.
pub(crate) fn row_grads<T: Real>(
    rows: usize,
    cols: usize,
    width: usize,
    row: impl Fn(usize, &mut [T], &mut [T]) + Sync,
) -> Vec<T> {
    let blocks = GRAD_BLOCKS.min(rows.max(1));
    let per = rows.div_ceil(blocks);
    let n = rows * cols;
    let total = n + width;
    let mut out = Out::new(total);
    let dx = out.rows();
    let mut partial = vec![T::zero(); blocks * width];
    let pr = partial.as_mut_ptr() as usize;
    par(blocks, n, |bs| {
        for blk in bs {
            // SAFETY: block blk's part of `partial` is this call's alone.
            let acc =
                unsafe { std::slice::from_raw_parts_mut((pr as *mut T).add(blk * width), width) };
            for i in blk * per..((blk + 1) * per).min(rows) {
                // SAFETY: row i is this call's alone.
                row(i, acc, unsafe { dx.get(i * cols..(i + 1) * cols) });
            }
        }
    });
    // SAFETY: the tail after dx is written here, by this thread alone.
    let into = unsafe { dx.get(n..total) };
    into.copy_from_slice(&partial[..width]);
    for part in partial.chunks(width).skip(1) {
        for (t, &p) in into.iter_mut().zip(part) {
            *t += p;
        }
    }
    // SAFETY: every row of dx and the tail were written.
    unsafe { out.into_vec(total) }
}

/// The largest element of `row` (minus infinity when empty).
pub(crate) fn row_max<T: Real>(row: &[T]) -> T {
    row.iter()
        .fold(T::neg_infinity(), |a, &b| num_traits::Float::max(a, b))
}

/// `sum_j exp(row_j - m)`, the exponentials vectorised a block at a time.
pub(crate) fn sum_exp<T: Real>(row: &[T], m: T) -> T {
    let mut buf = [T::zero(); 256];
    let mut s = T::zero();
    for c in row.chunks(buf.len()) {
        let b = &mut buf[..c.len()];
        for (d, &v) in b.iter_mut().zip(c) {
            *d = v - m;
        }
        T::exp_slice(b);
        s += b.iter().copied().sum::<T>();
    }
    s
}

/// Whether `t` takes the fused kernels: a float tensor on the CPU. f16 and bf16 tensors are
/// computed in f32 and rounded once at the end (as PyTorch's CPU kernels accumulate low
/// types in float), instead of rounding after each of a dozen composed ops.
pub(crate) fn fused(t: &Tensor) -> bool {
    t.device().is_cpu()
        && matches!(
            t.dtype(),
            DType::F32 | DType::F64 | DType::F16 | DType::BF16
        )
}

/// Whether `t` takes the fused kernels that also run on a CUDA device (GELU, the bias add,
/// LayerNorm, cross-entropy, causal attention): [`fused`] on the CPU, and in the `cuda` build
/// an f32, bf16 or f16 tensor on a GPU (`kernels/cuda/`).
pub(crate) fn fused_or_gpu(t: &Tensor) -> bool {
    #[cfg(feature = "cuda")]
    if gpu::takes(t) {
        return true;
    }
    fused(t)
}

/// The elements of a contiguous `layout` of `storage` as `T`: borrowed when the storage
/// holds `T`, converted when it holds f16 or bf16 and `T` is f32 (the kernels' inputs).
pub(crate) fn input<'a, T: WithDType>(
    storage: &'a CpuStorage,
    layout: &Layout,
    op: &str,
) -> candle_core::Result<Cow<'a, [T]>> {
    match layout.contiguous_offsets() {
        Some((a, b)) => input_range(storage, a..b),
        None => candle_core::bail!("{op}: expects a contiguous input"),
    }
}

/// [`input`] for the elements `range` of `storage`, whatever layout they belong to.
pub(crate) fn input_range<T: WithDType>(
    storage: &CpuStorage,
    range: Range<usize>,
) -> candle_core::Result<Cow<'_, [T]>> {
    let wide = |v: Vec<f32>| T::cpu_storage_data(CpuStorage::F32(v)).map(Cow::Owned);
    match storage {
        CpuStorage::F16(_) if T::DTYPE == DType::F32 => {
            wide(half::f16::cpu_storage_as_slice(storage)?[range].to_f32_vec())
        }
        CpuStorage::BF16(_) if T::DTYPE == DType::F32 => {
            wide(half::bf16::cpu_storage_as_slice(storage)?[range].to_f32_vec())
        }
        _ => Ok(Cow::Borrowed(&T::cpu_storage_as_slice(storage)?[range])),
    }
}

/// Rows of contiguous elements at one stride: `(rows, columns, stride)`, the leading
/// dimensions taken as rows, or `None`. A contiguous layout is one (its stride its columns),
/// and so is the view of the first columns of a wider tensor: the logits of a head whose
/// product was padded for alignment (`nn::linear`), which the cross-entropy reads in place.
pub(crate) fn strided_rows(layout: &Layout) -> Option<(usize, usize, usize)> {
    let (dims, strides) = (layout.dims(), layout.stride());
    let (&cols, lead) = dims.split_last()?;
    if cols > 1 && strides[lead.len()] != 1 {
        return None;
    }
    let rows: usize = lead.iter().product();
    // The stride between rows: the innermost leading dimension of more than one element's.
    let mut stride = cols;
    let mut expect = None;
    for (&d, &s) in lead.iter().zip(strides).rev().filter(|(&d, _)| d > 1) {
        match expect {
            None => stride = s,
            Some(e) if e != s => return None,
            Some(_) => {}
        }
        expect = Some(s * d);
    }
    (stride >= cols || rows <= 1).then_some((rows, cols, stride.max(cols)))
}

/// The elements `strided_rows(layout)` covers, from the layout's first: row `i` starts at
/// `i * stride`.
pub(crate) fn strided_span(layout: &Layout) -> Option<Range<usize>> {
    let (rows, cols, stride) = strided_rows(layout)?;
    let start = layout.start_offset();
    let len = if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * stride + cols
    };
    Some(start..start + len)
}

/// A kernel's f32 output `s` in the low type `dtype` of its inputs (unchanged for f32/f64).
pub(crate) fn narrow_to(s: CpuStorage, dtype: DType) -> CpuStorage {
    match (s, dtype) {
        (CpuStorage::F32(v), DType::F16) => CpuStorage::F16(Vec::from_f32_slice(&v)),
        (CpuStorage::F32(v), DType::BF16) => CpuStorage::BF16(Vec::from_f32_slice(&v)),
        (s, _) => s,
    }
}

/// The elements of a contiguous `layout` of `storage` (the wrappers make inputs contiguous).
pub(crate) fn slice<'a, T: WithDType>(
    storage: &'a CpuStorage,
    layout: &Layout,
    op: &str,
) -> candle_core::Result<&'a [T]> {
    let data = T::cpu_storage_as_slice(storage)?;
    match layout.contiguous_offsets() {
        Some((a, b)) => Ok(&data[a..b]),
        None => candle_core::bail!("{op}: expects a contiguous input"),
    }
}

/// An output buffer that disjoint ranges of rows fill from the pool's threads.
pub(crate) struct Out<T> {
    buf: Vec<T>,
}

/// The base pointer of an [`Out`], shareable across the pool's threads.
#[derive(Clone, Copy)]
pub(crate) struct Rows<T>(*mut T);
// SAFETY: every user writes only its own disjoint range of rows (see `Rows::get`).
unsafe impl<T> Send for Rows<T> {}
unsafe impl<T> Sync for Rows<T> {}

impl<T: Copy> Out<T> {
    /// Room for `n` elements, not initialised: every element is written before `into_vec`.
    pub(crate) fn new(n: usize) -> Self {
        Self {
            buf: Vec::with_capacity(n),
        }
    }

    pub(crate) fn rows(&mut self) -> Rows<T> {
        Rows(self.buf.as_mut_ptr())
    }

    /// The buffer, once the caller has written all `n` elements.
    ///
    /// # Safety
    /// Every one of the `n` elements of [`Out::new`] must have been written.
    pub(crate) unsafe fn into_vec(mut self, n: usize) -> Vec<T> {
        self.buf.set_len(n);
        self.buf
    }
}

impl<T> Rows<T> {
    /// The buffer's start, for writers (such as a strided matrix product) whose parts are
    /// disjoint but not ranges.
    pub(crate) fn ptr(&self) -> *mut T {
        self.0
    }

    /// Elements `range` of the buffer.
    ///
    /// # Safety
    /// `range` lies within the buffer and no other thread touches it meanwhile.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn get(&self, range: Range<usize>) -> &mut [T] {
        std::slice::from_raw_parts_mut(self.0.add(range.start), range.len())
    }
}

/// Runs `f` over ranges covering `0..n` (rows or blocks of elements), on candle's CPU pool
/// when the op touches at least [`PAR_MIN`] elements (`elems`), else on this thread.
pub(crate) fn par(n: usize, elems: usize, f: impl Fn(Range<usize>) + Sync) {
    if elems < PAR_MIN || n <= 1 {
        f(0..n)
    } else {
        candle_core::utils::barrier_pool().execute_chunked(n, f)
    }
}

/// Runs `f` over disjoint ranges of elements covering `0..n`, [`BLOCK`] elements at a time (the
/// element-wise kernels' [`par`]).
pub(crate) fn par_elems(n: usize, f: impl Fn(Range<usize>) + Sync) {
    par(n.div_ceil(BLOCK), n, |blocks| {
        f(blocks.start * BLOCK..(blocks.end * BLOCK).min(n))
    })
}

/// Ops over fewer elements run on the calling thread (candle's own threshold for its
/// element-wise ops): waking the pool costs more than the work, and ranks running as threads
/// of one process would queue for the pool, which serves one caller at a time.
pub(crate) const PAR_MIN: usize = 64 * 1024;

/// Elements per parallel unit of the element-wise kernels.
pub(crate) const BLOCK: usize = 16 * 1024;

/// `f(storage as T)` for the f32 and f64 storages, and for f16 and bf16 ones with `T` = f32
/// (inputs read through [`input`], the output narrowed back); an error naming `op` for the
/// others.
macro_rules! dispatch {
    ($op:expr, $s:expr, |$v:ident : T| $body:expr) => {
        match $s {
            candle_core::CpuStorage::F16(_) | candle_core::CpuStorage::BF16(_) => {
                type T = f32;
                let $v: &CpuStorage = $s;
                let low = candle_core::backend::BackendStorage::dtype($s);
                let r: candle_core::Result<(CpuStorage, candle_core::Shape)> = $body;
                r.map(|(s, shape)| ($crate::kernels::narrow_to(s, low), shape))
            }
            candle_core::CpuStorage::F32(_) => {
                type T = f32;
                let $v: &CpuStorage = $s;
                $body
            }
            candle_core::CpuStorage::F64(_) => {
                type T = f64;
                let $v: &CpuStorage = $s;
                $body
            }
            other => candle_core::bail!(
                "{}: no kernel for {:?}",
                $op,
                candle_core::backend::BackendStorage::dtype(other)
            ),
        }
    };
}
pub(crate) use dispatch;

pub(crate) use crate::runtime::custom_op::custom_op;

/// A tensor of `shape` (`T`'s dtype) from `data`.
pub(crate) fn storage<T: WithDType>(data: Vec<T>) -> CpuStorage {
    T::to_cpu_storage_owned(data)
}
