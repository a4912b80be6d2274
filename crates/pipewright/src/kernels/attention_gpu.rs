//! The same on a CUDA device. bf16 and f16 heads of up to 128 dimensions take the
//! tensor-core flash kernels (kernels/cuda/flash.cu: mma.sync tiles, online softmax, no
//! (time x time) tensor at any length); f32 (and every type when `PIPEWRIGHT_GPU_ATTENTION` is
//! `cublas`) takes cuBLAS's products while a chunk of heads' scores fits a scratch buffer
//! (kernels/attention_blas.rs), else the SIMT flash kernels (kernels/cuda/attention.cu). The
//! flash backwards keep the row statistics (log-sum-exp, `dy . y`) in two f32 vectors. None
//! keeps anything past the op.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig};
use candle_core::{CudaStorage, Layout, Result, Shape};

use super::{Attention, Geometry, GPU_HEAD_DIM, NAME};
use crate::kernels::attention_blas as blas;
use crate::kernels::gpu::{self, addr, typed, PushKernelArg};

/// attention.cu's `Geo`.
#[repr(C)]
#[derive(Clone, Copy)]
struct Geo {
    t: i32,
    h: i32,
    hd: i32,
    c: i32,
    scale: f32,
}
// SAFETY: plain old data laid out as the kernel's struct.
unsafe impl DeviceRepr for Geo {}

/// Rows of queries (or keys) per block, as attention.cu's `R` and flash.cu's `ROWS`.
const ROWS: usize = 64;

/// Whether bf16 and f16 attention takes the tensor-core flash kernels: yes unless the
/// environment's `PIPEWRIGHT_GPU_ATTENTION` says `cublas` (read once; the way back to the
/// cuBLAS path of before without a rebuild). A variable so that the tests take both paths.
pub(crate) static TENSOR_CORE_FLASH: std::sync::LazyLock<std::sync::atomic::AtomicBool> =
    std::sync::LazyLock::new(|| {
        let v = std::env::var("PIPEWRIGHT_GPU_ATTENTION").unwrap_or_default();
        std::sync::atomic::AtomicBool::new(v != "cublas")
    });

/// The tensor-core kernels' head-dimension bucket (64 or 128) for heads of `geo`, if they
/// take them.
fn tensor_cores(geo: &Geo, dtype: candle_core::DType) -> Option<usize> {
    let on = TENSOR_CORE_FLASH.load(std::sync::atomic::Ordering::Relaxed);
    let low = matches!(dtype, candle_core::DType::BF16 | candle_core::DType::F16);
    let hd = geo.hd as usize;
    (on && low && hd <= GPU_HEAD_DIM).then_some(if hd <= 64 { 64 } else { 128 })
}

/// Threads of a tensor-core flash block (flash.cu's 4 warps of 16 rows each).
const TC_THREADS: u32 = 128;

/// The kernels' geometry, their head-dimension bucket (32, 64 or 128) and launch shape.
fn launch_of(a: &Attention, l: &Layout) -> Result<(Geo, usize, LaunchConfig, usize)> {
    let g = Geometry::of(l, a.heads)?;
    let batch = l.dims()[0];
    let bucket = match g.hd {
        0..=32 => 32,
        33..=64 => 64,
        65..=128 => 128,
        hd => candle_core::bail!("{NAME}: head dimension {hd} is over {GPU_HEAD_DIM} on a GPU"),
    };
    let (units, blocks) = (batch * a.heads, g.t.div_ceil(ROWS));
    if 3 * g.lc > i32::MAX as usize || units > i32::MAX as usize || blocks > 65_535 {
        candle_core::bail!(
            "{NAME}: {batch} x {} rows of {} columns is over one launch",
            g.t,
            3 * g.lc
        );
    }
    let geo = Geo {
        t: g.t as i32,
        h: a.heads as i32,
        hd: g.hd as i32,
        c: g.lc as i32,
        scale: a.scale as f32,
    };
    let cfg = LaunchConfig {
        grid_dim: (units as u32, blocks as u32, 1),
        block_dim: (4 * bucket as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    Ok((geo, bucket, cfg, units * g.t))
}

/// The shapes for the cuBLAS path (kernels/attention_blas.rs), if it takes them: it does
/// while a chunk of heads' scores fits its scratch, the flash kernels beyond.
fn blas_dims(a: &Attention, l: &Layout, dtype: candle_core::DType) -> Result<Option<blas::Dims>> {
    let g = Geometry::of(l, a.heads)?;
    let d = blas::Dims {
        batch: l.dims()[0],
        t: g.t,
        heads: a.heads,
        hd: g.hd,
        c: g.lc,
        scale: a.scale as f32,
    };
    Ok((d.fits(dtype) && d.batch * d.t * d.hd > 0).then_some(d))
}

pub(super) fn forward(a: &Attention, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
    let dev = s.device();
    let (geo, d, mut cfg, work) = launch_of(a, l)?;
    let (batch, t) = (l.dims()[0], geo.t as usize);
    let c = geo.c as usize;
    let blas_dims = blas_dims(a, l, s.dtype())?;
    let tc = tensor_cores(&geo, s.dtype());
    typed!(NAME, s.dtype(), |T| {
        let x = gpu::view::<T>(s, l, NAME)?;
        let mut y = gpu::alloc::<T>(dev, batch * t * c)?;
        if let Some(d) = tc {
            cfg.block_dim.0 = TC_THREADS;
            let f = gpu::func(dev, &gpu::FLASH, &format!("fa_fwd_{d}"), s.dtype())?;
            gpu::launch(&f, cfg, work, |b| {
                b.arg(&x).arg(&mut y).arg(&geo);
            })?;
            return Ok((
                CudaStorage::wrap_cuda_slice(y, dev.clone()),
                Shape::from((batch, t, c)),
            ));
        }
        if let Some(bd) = &blas_dims {
            blas::forward::<T>(dev, bd, s.dtype(), addr(dev, &x), addr(dev, &y))?;
            return Ok((
                CudaStorage::wrap_cuda_slice(y, dev.clone()),
                Shape::from((batch, t, c)),
            ));
        }
        let f = gpu::func(dev, &gpu::ATTENTION, &format!("attn_fwd_{d}"), s.dtype())?;
        gpu::launch(&f, cfg, work, |b| {
            b.arg(&x).arg(&mut y).arg(&geo);
        })?;
        Ok((
            CudaStorage::wrap_cuda_slice(y, dev.clone()),
            Shape::from((batch, t, c)),
        ))
    })
}

type Input<'a> = (&'a CudaStorage, &'a Layout);

pub(super) fn backward(
    a: &Attention,
    [(sx, lx), (sy, ly), (sg, lg)]: [Input; 3],
) -> Result<(CudaStorage, Shape)> {
    let dev = sx.device();
    let (geo, d, mut cfg, work) = launch_of(a, lx)?;
    let n = lx.shape().elem_count();
    let blas_dims = blas_dims(a, lx, sx.dtype())?;
    let tc = tensor_cores(&geo, sx.dtype());
    let (prefix, module, d) = match tc {
        Some(d) => {
            cfg.block_dim.0 = TC_THREADS;
            ("fa", &gpu::FLASH, d)
        }
        None => ("attn", &gpu::ATTENTION, d),
    };
    typed!(NAME, sx.dtype(), |T| {
        let x = gpu::view::<T>(sx, lx, NAME)?;
        let (y, dy) = (gpu::view::<T>(sy, ly, NAME)?, gpu::view::<T>(sg, lg, NAME)?);
        let mut dx = gpu::alloc::<T>(dev, n)?;
        if let Some(bd) = blas_dims.as_ref().filter(|_| tc.is_none()) {
            let (xa, dya, dxa) = (addr(dev, &x), addr(dev, &dy), addr(dev, &dx));
            blas::backward::<T>(dev, bd, sx.dtype(), xa, dya, dxa)?;
            return Ok((
                CudaStorage::wrap_cuda_slice(dx, dev.clone()),
                lx.shape().clone(),
            ));
        }
        let (mut lse, mut dvec) = (gpu::alloc::<f32>(dev, work)?, gpu::alloc::<f32>(dev, work)?);
        let q = gpu::func(dev, module, &format!("{prefix}_bwd_q_{d}"), sx.dtype())?;
        gpu::launch(&q, cfg, work, |b| {
            b.arg(&x)
                .arg(&y)
                .arg(&dy)
                .arg(&mut dx)
                .arg(&mut lse)
                .arg(&mut dvec);
            b.arg(&geo);
        })?;
        let kv = gpu::func(dev, module, &format!("{prefix}_bwd_kv_{d}"), sx.dtype())?;
        gpu::launch(&kv, cfg, work, |b| {
            b.arg(&x)
                .arg(&dy)
                .arg(&mut dx)
                .arg(&lse)
                .arg(&dvec)
                .arg(&geo);
        })?;
        Ok((
            CudaStorage::wrap_cuda_slice(dx, dev.clone()),
            lx.shape().clone(),
        ))
    })
}
