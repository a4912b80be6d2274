//! Causal attention on a GPU through cuBLAS: the products on tensor cores, the causal softmax
//! and its gradient as row kernels (kernels/cuda/causal_softmax.cu), and no (time x time)
//! tensor kept past the op: the scores live in scratch buffers for a few heads at a time and
//! are recomputed by the backward. Per (batch, head) the forward is `S = scale q k^T` (f32),
//! `P = softmax(S, causal)`, `y = P v`; the backward recomputes S and P and takes
//! `dP = dy v^T`, `dS = scale P (dP - rowsum(P dP))`, `dv = P^T dy`, `dq = dS k`, `dk = dS^T q`.
//! The scores are f32; P and dS are rounded to the element type for their products (as flash
//! attention rounds them), every product accumulates in f32.
//!
//! cuBLAS is column-major: a row-major `rows x cols` matrix with leading dimension `ld` is the
//! column-major `cols x rows` one, so each product below is written transposed (`C^T = B^T
//! A^T`). The heads of one batch row are one strided batch (head h starts `h * head_dim`
//! elements after head 0 in q, k, v, y and their gradients).

use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::cuda_backend::cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasGemmStridedBatchedEx, cublasOperation_t,
    cudaDataType,
};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Result};

use super::gpu::{self, addr, PushKernelArg};

/// Scratch bytes the scores of one chunk of heads may take; longer sequences take the flash
/// kernels (kernels/cuda/attention.cu), whose memory does not grow with the square. A
/// variable so that the tests can send every size down the flash path too.
pub(crate) static SCRATCH_BYTES: AtomicUsize = AtomicUsize::new(256 << 20);

/// The shapes of one attention: batch, time, heads, head dimension, width of one third
/// (heads x head dimension), the softmax scale.
#[derive(Clone, Copy)]
pub(crate) struct Dims {
    pub batch: usize,
    pub t: usize,
    pub heads: usize,
    pub hd: usize,
    pub c: usize,
    pub scale: f32,
}

impl Dims {
    /// Heads per chunk, so the backward's scratch (S, dP in f32; P, dS in the element type)
    /// stays within [`SCRATCH_BYTES`]; 0 when one head's is over it.
    fn chunk(&self, dtype: DType) -> usize {
        let per_head = self.t * self.t * (8 + 2 * dtype.size_in_bytes()) + 4 * self.t;
        (SCRATCH_BYTES.load(Ordering::Relaxed) / per_head.max(1)).min(self.heads)
    }

    /// Whether this path takes the attention (cuBLAS's sizes are 32-bit too).
    pub(crate) fn fits(&self, dtype: DType) -> bool {
        self.chunk(dtype) > 0
            && 3 * self.c <= i32::MAX as usize
            && self.t * self.t <= i32::MAX as usize
    }
}

/// One operand: its address, leading dimension, stride between heads, and whether the
/// product takes it transposed.
#[derive(Clone, Copy)]
struct Operand {
    ptr: u64,
    ld: usize,
    stride: usize,
    trans: bool,
}

fn op(ptr: u64, ld: usize, stride: usize, trans: bool) -> Operand {
    Operand {
        ptr,
        ld,
        stride,
        trans,
    }
}

fn data_type(dtype: DType) -> Result<cudaDataType> {
    Ok(match dtype {
        DType::F32 => cudaDataType::CUDA_R_32F,
        DType::BF16 => cudaDataType::CUDA_R_16BF,
        DType::F16 => cudaDataType::CUDA_R_16F,
        other => candle_core::bail!("attention: no cuBLAS path for {other:?}"),
    })
}

/// `C = alpha op(A) op(B)` (column-major `m x n`, inner `k`) for `heads` heads; A and B in
/// `ab`, C in `out` (f32 or the element type), accumulated in f32.
#[allow(clippy::too_many_arguments)]
fn gemm(
    dev: &CudaDevice,
    (m, n, k): (usize, usize, usize),
    alpha: f32,
    (a, b): (Operand, Operand),
    ab: DType,
    (c, ldc, stride_c): (u64, usize, usize),
    out: DType,
    heads: usize,
) -> Result<()> {
    let t = |x: bool| {
        if x {
            cublasOperation_t::CUBLAS_OP_T
        } else {
            cublasOperation_t::CUBLAS_OP_N
        }
    };
    let beta = 0f32;
    let blas = dev.cublas_handle();
    // SAFETY: every address and leading dimension describes a buffer of the caller's that holds
    // `heads` such matrices, `stride` elements apart, on the device's stream (cuBLAS's).
    let status = unsafe {
        cublasGemmStridedBatchedEx(
            *blas.handle(),
            t(a.trans),
            t(b.trans),
            m as i32,
            n as i32,
            k as i32,
            (&alpha as *const f32).cast(),
            a.ptr as *const _,
            data_type(ab)?,
            a.ld as i32,
            a.stride as i64,
            b.ptr as *const _,
            data_type(ab)?,
            b.ld as i32,
            b.stride as i64,
            (&beta as *const f32).cast(),
            c as *mut _,
            data_type(out)?,
            ldc as i32,
            stride_c as i64,
            heads as i32,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    };
    status
        .result()
        .map_err(|e| candle_core::Error::Msg(format!("attention: cuBLAS: {e:?}")))
}

/// Scratch for one chunk of heads.
struct Scratch<T> {
    s: CudaSlice<f32>,
    p: CudaSlice<T>,
    lse: CudaSlice<f32>,
}

impl<T: DeviceRepr> Scratch<T> {
    fn new(dev: &CudaDevice, d: &Dims, hc: usize) -> Result<Self> {
        Ok(Self {
            s: gpu::alloc(dev, hc * d.t * d.t)?,
            p: gpu::alloc(dev, hc * d.t * d.t)?,
            lse: gpu::alloc(dev, hc * d.t)?,
        })
    }

    /// `S = scale q k^T` and `P = softmax(S)` for `nh` heads from q at `q` (k, v after it).
    fn scores(
        &mut self,
        dev: &CudaDevice,
        d: &Dims,
        dtype: DType,
        q: u64,
        nh: usize,
    ) -> Result<()> {
        let (t, es, rs) = (d.t, dtype.size_in_bytes() as u64, 3 * d.c);
        let k = q + d.c as u64 * es;
        gemm(
            dev,
            (t, t, d.hd),
            d.scale,
            (op(k, rs, d.hd, true), op(q, rs, d.hd, false)),
            dtype,
            (addr(dev, &self.s), t, t * t),
            DType::F32,
            nh,
        )?;
        let f = gpu::func(dev, &gpu::CAUSAL_SOFTMAX, "causal_softmax", dtype)?;
        let ti = t as i32;
        gpu::launch(&f, gpu::per_row(nh * t, t)?, nh * t, |b| {
            b.arg(&self.s).arg(&mut self.p).arg(&mut self.lse).arg(&ti);
        })
    }
}

/// The forward into `y` (`batch x t x c`) from `x` (`batch x t x 3c`), both addresses.
pub(crate) fn forward<T: DeviceRepr>(
    dev: &CudaDevice,
    d: &Dims,
    dtype: DType,
    x: u64,
    y: u64,
) -> Result<()> {
    let (t, es) = (d.t, dtype.size_in_bytes() as u64);
    let hc = d.chunk(dtype);
    let mut sc = Scratch::<T>::new(dev, d, hc)?;
    for b in 0..d.batch {
        for h0 in (0..d.heads).step_by(hc.max(1)) {
            let nh = hc.min(d.heads - h0);
            let q = x + ((b * t * 3 * d.c + h0 * d.hd) as u64) * es;
            sc.scores(dev, d, dtype, q, nh)?;
            let v = q + 2 * d.c as u64 * es;
            let yo = y + ((b * t * d.c + h0 * d.hd) as u64) * es;
            // y^T = v^T P^T
            gemm(
                dev,
                (d.hd, t, t),
                1.0,
                (
                    op(v, 3 * d.c, d.hd, false),
                    op(addr(dev, &sc.p), t, t * t, false),
                ),
                dtype,
                (yo, d.c, d.hd),
                dtype,
                nh,
            )?;
        }
    }
    Ok(())
}

/// The packed gradient into `dx` (`batch x t x 3c`) from `x` and the output's gradient `dy`.
pub(crate) fn backward<T: DeviceRepr>(
    dev: &CudaDevice,
    d: &Dims,
    dtype: DType,
    x: u64,
    dy: u64,
    dx: u64,
) -> Result<()> {
    let (t, es, c) = (d.t, dtype.size_in_bytes() as u64, d.c);
    let hc = d.chunk(dtype);
    let mut sc = Scratch::<T>::new(dev, d, hc)?;
    let dp = gpu::alloc::<f32>(dev, hc * t * t)?;
    let mut ds = gpu::alloc::<T>(dev, hc * t * t)?;
    let grad = gpu::func(dev, &gpu::CAUSAL_SOFTMAX, "causal_softmax_grad", dtype)?;
    let (ti, scale) = (t as i32, d.scale);
    for b in 0..d.batch {
        for h0 in (0..d.heads).step_by(hc.max(1)) {
            let nh = hc.min(d.heads - h0);
            let at = ((b * t * 3 * c + h0 * d.hd) as u64) * es;
            let (q, k, v) = (x + at, x + at + c as u64 * es, x + at + 2 * c as u64 * es);
            let (dq, dk, dv) = (
                dx + at,
                dx + at + c as u64 * es,
                dx + at + 2 * c as u64 * es,
            );
            let o = dy + ((b * t * c + h0 * d.hd) as u64) * es;
            sc.scores(dev, d, dtype, q, nh)?;
            // dP^T = v dy^T
            let dpa = addr(dev, &dp);
            let rs = 3 * c;
            gemm(
                dev,
                (t, t, d.hd),
                1.0,
                (op(v, rs, d.hd, true), op(o, c, d.hd, false)),
                dtype,
                (dpa, t, t * t),
                DType::F32,
                nh,
            )?;
            gpu::launch(&grad, gpu::per_row(nh * t, t)?, nh * t, |a| {
                a.arg(&sc.s)
                    .arg(&sc.lse)
                    .arg(&dp)
                    .arg(&mut ds)
                    .arg(&ti)
                    .arg(&scale);
            })?;
            let (p, dsa) = (addr(dev, &sc.p), addr(dev, &ds));
            let tt = t * t;
            // dv^T = dy^T P, dq^T = k^T dS^T, dk^T = q^T dS
            for (a, b, out) in [
                (op(o, c, d.hd, false), op(p, t, tt, true), dv),
                (op(k, rs, d.hd, false), op(dsa, t, tt, false), dq),
                (op(q, rs, d.hd, false), op(dsa, t, tt, true), dk),
            ] {
                gemm(
                    dev,
                    (d.hd, t, t),
                    1.0,
                    (a, b),
                    dtype,
                    (out, rs, d.hd),
                    dtype,
                    nh,
                )?;
            }
        }
    }
    Ok(())
}
