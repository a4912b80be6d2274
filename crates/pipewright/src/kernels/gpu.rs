//! pipewright's CUDA kernels (`kernels/cuda/*.cu`, compiled to PTX by `build.rs` in the `cuda`
//! build) and what the ops need to launch them on candle's CUDA device: the modules, a kernel
//! by name and element type, contiguous views of the inputs, outputs, launch shapes.
//!
//! Each fused op of `kernels/` that has a kernel here implements candle's `cuda_fwd` beside
//! its `cpu_fwd`, so one op and one backward wiring serve both devices, and the CPU kernel is
//! the GPU kernel's oracle. The kernels run on the device's one stream, in order with
//! candle's own. Every kernel but AdamW's (which updates the f32 masters) takes f32, bf16
//! and f16 (computing in f32 and rounding each output once, as the CPU twins do) under the
//! names `NAME_f32`, `NAME_bf16`, `NAME_f16`.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
pub(crate) use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DeviceRepr, LaunchArgs,
    LaunchConfig,
};
use candle_core::cuda_backend::{CudaDType, CudaDevice, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Result, Tensor};

/// One compiled `.cu` file: the name candle caches it under and its PTX.
pub(crate) struct Module {
    name: &'static str,
    ptx: &'static str,
}

// One `Module` per `kernels/cuda/*.cu` file (`ADAMW`, `FLASH`, ...), written by `build.rs`
// from the folder: adding a kernel is adding its file.
include!(concat!(env!("OUT_DIR"), "/modules.rs"));

/// Rows and columns of a row kernel's input `lx`, checked against its per-column weight `lw`
/// (a norm's scale): an error naming `op` when they disagree or the rows are empty.
pub(crate) fn rows_cols(op: &str, lx: &Layout, lw: &Layout) -> Result<(usize, usize)> {
    let cols = *lx.dims().last().unwrap_or(&0);
    if lw.dims() != [cols] || cols == 0 {
        candle_core::bail!("{op}: weight {:?} for rows of {cols}", lw.dims());
    }
    Ok((lx.shape().elem_count() / cols, cols))
}

/// Whether `t` takes the CUDA kernels: an f32, bf16 or f16 tensor on a CUDA device.
pub(crate) fn takes(t: &Tensor) -> bool {
    t.device().is_cuda() && matches!(t.dtype(), DType::F32 | DType::BF16 | DType::F16)
}

/// A loaded kernel and the device's stream it runs on.
pub(crate) struct Kernel {
    f: CudaFunction,
    stream: Arc<CudaStream>,
}

/// Kernel `name` of `module` for elements of `dtype`, loaded on `dev` once.
pub(crate) fn func(dev: &CudaDevice, module: &Module, name: &str, dtype: DType) -> Result<Kernel> {
    let suffix = suffix(name, dtype)?;
    let f = dev.get_or_load_custom_func(&format!("{name}_{suffix}"), module.name, module.ptx)?;
    Ok(Kernel {
        f: f.into_cuda_function(),
        stream: dev.cuda_stream(),
    })
}

/// The suffix of a kernel's name for elements of `dtype` (an error naming `op` for the types
/// no kernel takes).
pub(crate) fn suffix(op: &str, dtype: DType) -> Result<&'static str> {
    Ok(match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::U32 => "u32",
        other => candle_core::bail!("{op}: no CUDA kernel for {other:?}"),
    })
}

/// `$body` with `$t` the Rust element type of `$dtype` (f32, bf16 or f16); an error naming
/// `$op` for the others.
macro_rules! typed {
    ($op:expr, $dtype:expr, |$t:ident| $body:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $t = f32;
                $body
            }
            candle_core::DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            candle_core::DType::F16 => {
                type $t = half::f16;
                $body
            }
            other => candle_core::bail!("{}: no CUDA kernel for {other:?}", $op),
        }
    };
}
pub(crate) use typed;

/// The elements of a contiguous `layout` of `storage`.
pub(crate) fn view<'a, T: CudaDType>(
    storage: &'a CudaStorage,
    layout: &Layout,
    op: &str,
) -> Result<CudaView<'a, T>> {
    match layout.contiguous_offsets() {
        Some((a, b)) => Ok(storage.as_cuda_slice::<T>()?.slice(a..b)),
        None => candle_core::bail!("{op}: expects a contiguous input"),
    }
}

/// The elements of `layout` when it is rows at one stride (`super::strided_rows`): row `i`
/// from `i * stride`.
pub(crate) fn rows_view<'a, T: CudaDType>(
    storage: &'a CudaStorage,
    layout: &Layout,
    op: &str,
) -> Result<CudaView<'a, T>> {
    match super::strided_span(layout) {
        Some(r) => Ok(storage.as_cuda_slice::<T>()?.slice(r)),
        None => candle_core::bail!("{op}: expects rows at one stride"),
    }
}

/// The device address of `s`'s first element, for libraries that take raw pointers (cuBLAS).
/// The device runs one stream and tracks no events (`device.rs`), so the address needs no
/// synchronisation guard.
pub(crate) fn addr<T>(dev: &CudaDevice, s: &impl DevicePtr<T>) -> u64 {
    let stream = dev.cuda_stream();
    let (p, _sync) = s.device_ptr(&stream);
    p
}

/// The device address of the first element of `t`, a contiguous f32, bf16 or f16 tensor on a
/// GPU (for the kernels that take many tensors through a table, kernels/gpu_table.rs). The
/// caller keeps `t` alive until the kernel is queued; the device frees memory in stream order.
pub(crate) fn tensor_addr(t: &Tensor, op: &str) -> Result<u64> {
    let (s, l) = t.storage_and_layout();
    let candle_core::Storage::Cuda(s) = &*s else {
        candle_core::bail!("{op}: expects a GPU tensor, got one on {:?}", t.device());
    };
    typed!(op, t.dtype(), |T| Ok(addr(
        s.device(),
        &view::<T>(s, l, op)?
    )))
}

/// Room for `n` elements, written by a kernel before it is read (one element when `n` is 0:
/// the driver allocates no empty buffers, and the tensor's layout says it holds none).
pub(crate) fn alloc<T: DeviceRepr>(dev: &CudaDevice, n: usize) -> Result<CudaSlice<T>> {
    // SAFETY: every caller's kernel writes all `n` elements before anything reads them.
    unsafe { dev.alloc::<T>(n.max(1)) }
}

/// `n` zeros.
pub(crate) fn zeros<T: DeviceRepr + candle_core::cuda_backend::cudarc::driver::ValidAsZeroBits>(
    dev: &CudaDevice,
    n: usize,
) -> Result<CudaSlice<T>> {
    dev.alloc_zeros::<T>(n.max(1))
}

/// Threads per block of the element-wise and per-row kernels.
pub(crate) const THREADS: u32 = 256;

/// A grid-stride launch over `n` elements (at most 64 Ki blocks; the kernels loop).
pub(crate) fn elementwise(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(THREADS as usize).clamp(1, 1 << 16) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A block per row, `THREADS` threads (fewer, a multiple of 32, for short rows).
pub(crate) fn per_row(rows: usize, cols: usize) -> Result<LaunchConfig> {
    if rows > i32::MAX as usize {
        candle_core::bail!("{rows} rows are more than one CUDA launch takes");
    }
    let threads = (cols.div_ceil(32) * 32).clamp(32, THREADS as usize) as u32;
    Ok(LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// Launches `f` with the arguments `args` pushes, unless `work` is 0 (an empty tensor: a
/// launch with an empty grid is an error).
pub(crate) fn launch<'a>(
    k: &'a Kernel,
    cfg: LaunchConfig,
    work: usize,
    args: impl FnOnce(&mut LaunchArgs<'a>),
) -> Result<()> {
    if work == 0 {
        return Ok(());
    }
    let mut b = k.stream.launch_builder(&k.f);
    args(&mut b);
    // SAFETY: each caller pushes the arguments its kernel's signature declares, in order, with
    // buffers of the sizes the kernel reads and writes for this launch shape.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// Row blocks the column sums (bias, LayerNorm weights) add up separately, then in order.
pub(crate) const SUM_BLOCKS: usize = 256;

/// The launch of `column_partials` / `ln_partials` over `rows x cols`: `(config, row blocks,
/// rows per block)`.
pub(crate) fn column_blocks(rows: usize, cols: usize) -> (LaunchConfig, usize, usize) {
    let blocks = SUM_BLOCKS.min(rows.max(1));
    let per = rows.div_ceil(blocks).max(1);
    let cfg = LaunchConfig {
        grid_dim: (cols.div_ceil(32).max(1) as u32, blocks as u32, 1),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    };
    (cfg, blocks, per)
}

/// `out[c] = sum_k partial[k cols + c]` over `blocks` partial sums (bias.cu's `finish_sums`).
pub(crate) fn finish_sums<T: DeviceRepr>(
    dev: &CudaDevice,
    dtype: DType,
    partial: &CudaSlice<f32>,
    out: &mut CudaViewMut<'_, T>,
    cols: usize,
    blocks: usize,
) -> Result<()> {
    let f = func(dev, &BIAS, "finish_sums", dtype)?;
    let cfg = LaunchConfig {
        grid_dim: (cols.div_ceil(32).max(1) as u32, 1, 1),
        block_dim: (32, 8, 1),
        shared_mem_bytes: 0,
    };
    launch(&f, cfg, cols, |b| {
        b.arg(partial).arg(out).arg(&cols).arg(&blocks);
    })
}

/// A norm's forward over rows of `cols` (`rows_cols` checked by the caller): the kernel
/// `fname` of `module` taking the input, the weight-sized vectors `weights` (weight, then a
/// bias), the output, `cols` and `eps`.
pub(crate) fn norm_forward(
    (module, fname, op): (&Module, &str, &str),
    (sx, lx): (&CudaStorage, &Layout),
    weights: &[(&CudaStorage, &Layout)],
    (rows, cols, eps): (usize, usize, f64),
) -> Result<(CudaStorage, candle_core::Shape)> {
    let dev = sx.device();
    let eps = eps as f32;
    typed!(op, sx.dtype(), |T| {
        let x = view::<T>(sx, lx, op)?;
        let ws = (weights.iter())
            .map(|(s, l)| view::<T>(s, l, op))
            .collect::<Result<Vec<_>>>()?;
        let mut y = alloc::<T>(dev, rows * cols)?;
        let f = func(dev, module, fname, sx.dtype())?;
        launch(&f, per_row(rows, cols)?, rows * cols, |a| {
            a.arg(&x);
            for w in &ws {
                a.arg(w);
            }
            a.arg(&mut y).arg(&cols).arg(&eps);
        })?;
        Ok((
            CudaStorage::wrap_cuda_slice(y, dev.clone()),
            lx.shape().clone(),
        ))
    })
}

/// A norm's backward (LayerNorm's and RMSNorm's) of `x` `(rows, cols)`, its weight `w` and the
/// output's gradient `g`: kernel `{prefix}_bwd_dx` writes dx into the result's first
/// `rows * cols` elements and `stats` f32 statistics of each row, then `{prefix}_partials`
/// sums `sums` kinds of column partial sums (the weight's gradient, and the bias's) over row
/// blocks, which [`finish_sums`] adds into the result's last `sums * cols` elements: the CPU
/// twins' packing. Both kernels take their arguments in this order.
pub(crate) fn norm_backward(
    (module, prefix, op): (&Module, &str, &str),
    [(sx, lx), (sw, lw), (sg, lg)]: [(&CudaStorage, &Layout); 3],
    eps: f64,
    (stats, sums): (usize, usize),
) -> Result<(CudaStorage, candle_core::Shape)> {
    let (rows, cols) = rows_cols(op, lx, lw)?;
    let dev = sx.device();
    let (n, eps) = (rows * cols, eps as f32);
    let (cfg, blocks, per) = column_blocks(rows, cols);
    typed!(op, sx.dtype(), |T| {
        let (x, w, g) = (
            view::<T>(sx, lx, op)?,
            view::<T>(sw, lw, op)?,
            view::<T>(sg, lg, op)?,
        );
        let mut out = alloc::<T>(dev, n + sums * cols)?;
        let mut row_stats = alloc::<f32>(dev, stats * rows)?;
        let mut partial = zeros::<f32>(dev, blocks * sums * cols)?;
        let dx = func(dev, module, &format!("{prefix}_bwd_dx"), sx.dtype())?;
        launch(&dx, per_row(rows, cols)?, n, |a| {
            a.arg(&x).arg(&w).arg(&g).arg(&mut out).arg(&mut row_stats);
            a.arg(&cols).arg(&eps);
        })?;
        let partials = func(dev, module, &format!("{prefix}_partials"), sx.dtype())?;
        launch(&partials, cfg, n, |a| {
            a.arg(&x).arg(&g).arg(&row_stats).arg(&mut partial);
            a.arg(&rows).arg(&cols).arg(&per);
        })?;
        let mut tail = out.slice_mut(n..n + sums * cols);
        finish_sums(dev, sx.dtype(), &partial, &mut tail, sums * cols, blocks)?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            candle_core::Shape::from(n + sums * cols),
        ))
    })
}
