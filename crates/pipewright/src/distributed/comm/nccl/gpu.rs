//! The NCCL backend's path for tensors on the GPU (a `cuda` build). NCCL reads and writes
//! candle's device memory in place, on the stream candle runs its kernels on (the one stream
//! [`crate::runtime::device`] keeps per GPU), so a collective runs after the kernels that made its input
//! and before those that read its result, with no copy through the host and no wait for it.
//! Point-to-point messages travel as bytes, as the host-staged path sends them; gathers are
//! typed.

use candle_core::cuda::CudaDType;
use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, DType, Device, Storage, Tensor};
use cudarc::driver::{CudaSlice, CudaView, DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::safe::NcclType;

use super::{gpu, Gpu, Inner};
use crate::{Error, Result};

/// `$body` with the type `$T` standing for the element type of the dtype `$dt`.
macro_rules! typed {
    ($dt:expr, $T:ident => $body:expr) => {
        typed!(@ $dt, $T, $body, U8 u8, U32 u32, I64 i64, F16 half::f16, BF16 half::bf16,
            F32 f32, F64 f64)
    };
    (@ $dt:expr, $T:ident, $body:expr, $($variant:ident $ty:ty),*) => {
        match $dt {
            $(DType::$variant => {
                type $T = $ty;
                $body
            })*
            other => Err(Error::Comm(format!(
                "the NCCL backend does not carry {other:?} tensors"
            ))),
        }
    };
}

/// An element type NCCL and candle's CUDA storage both know.
trait Elem: CudaDType + DeviceRepr + ValidAsZeroBits + NcclType {}
impl<T: CudaDType + DeviceRepr + ValidAsZeroBits + NcclType> Elem for T {}

/// Runs `f` on the elements of `t` (on a GPU) as a view of its device memory.
fn with_view<T: Elem, R>(t: &Tensor, f: impl FnOnce(&CudaView<'_, T>) -> Result<R>) -> Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(s) = &*storage else {
        return Err(Error::Comm(format!(
            "NCCL backend: a tensor on {:?} took the GPU path",
            t.device().location()
        )));
    };
    let (a, b) = layout
        .contiguous_offsets()
        .ok_or_else(|| Error::Comm("tensor is not contiguous".into()))?;
    f(&s.as_cuda_slice::<T>()?.slice(a..b))
}

/// Sends the bytes of `t` (nothing when it is empty: the receiver expects none).
fn send<T: Elem>(g: &Gpu, t: &Tensor, dst: usize) -> Result<()> {
    if t.elem_count() == 0 {
        return Ok(());
    }
    with_view::<T, _>(t, |v| {
        // SAFETY: the bytes of the view's elements, read as bytes.
        let bytes = unsafe { v.transmute::<u8>(v.len() * std::mem::size_of::<T>()) }
            .expect("a view of the same bytes");
        g.comm.send(&bytes, dst as i32).map_err(gpu("sending"))
    })
}

/// A new tensor of `dims` on this GPU, its memory written by `fill` (not called when the
/// tensor is empty: CUDA allocates no zero-byte buffers, so it gets one unused element).
fn output<T: Elem>(
    g: &Gpu,
    dims: &[usize],
    fill: impl FnOnce(&mut CudaSlice<T>) -> Result<()>,
) -> Result<Tensor> {
    let n: usize = dims.iter().product();
    let mut buf = g
        .stream
        .alloc_zeros::<T>(n.max(1))
        .map_err(gpu("allocating on the GPU"))?;
    if n > 0 {
        fill(&mut buf)?;
    }
    let storage = CudaStorage::wrap_cuda_slice(buf, g.candle.clone());
    Ok(Tensor::from_storage(
        Storage::Cuda(storage),
        dims,
        BackpropOp::none(),
        false,
    ))
}

/// Receives a tensor of `dims` as bytes.
fn recv<T: Elem>(g: &Gpu, dims: &[usize], src: usize) -> Result<Tensor> {
    output::<T>(g, dims, |buf| {
        let n = buf.len() * std::mem::size_of::<T>();
        // SAFETY: any bytes NCCL writes make valid numbers of these plain types.
        let mut bytes = unsafe { buf.transmute_mut::<u8>(n) }.expect("a view of the same bytes");
        g.comm
            .recv(&mut bytes, src as i32)
            .map(|_| ())
            .map_err(gpu("receiving"))
    })
}

/// Gathers every rank's `part` (all of one length) into one flat tensor, in rank order.
fn gather<T: Elem>(g: &Gpu, part: &Tensor, ranks: usize) -> Result<Tensor> {
    output::<T>(g, &[part.elem_count() * ranks], |recv| {
        with_view::<T, _>(part, |send| {
            g.comm
                .all_gather(send, recv)
                .map(|_| ())
                .map_err(gpu("gathering"))
        })
    })
}

fn broadcast<T: Elem>(g: &Gpu, t: &Tensor, root: usize, me: usize) -> Result<Tensor> {
    output::<T>(g, t.dims(), |recv| {
        if me == root {
            with_view::<T, _>(t, |send| {
                g.comm
                    .broadcast(Some(send), recv, root as i32)
                    .map(|_| ())
                    .map_err(gpu("broadcasting"))
            })
        } else {
            g.comm
                .broadcast(None::<&CudaSlice<T>>, recv, root as i32)
                .map(|_| ())
                .map_err(gpu("broadcasting"))
        }
    })
}

impl Inner {
    /// This communicator's GPU as a candle device.
    fn gpu_device(&self) -> Device {
        Device::Cuda(self.lock().candle.clone())
    }

    /// `t`, a GPU tensor, on this communicator's GPU (where it already is, normally).
    fn here(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.to_device(&self.gpu_device())?)
    }

    pub(super) fn gpu_send(&self, t: &Tensor, dst: usize) -> Result<()> {
        let t = self.here(t)?;
        typed!(t.dtype(), T => send::<T>(&self.lock(), &t, dst))
    }

    /// Receives into this GPU's memory: the sender's tensor may have been on the host.
    pub(super) fn gpu_recv(&self, dims: &[usize], dt: DType, src: usize) -> Result<Tensor> {
        typed!(dt, T => recv::<T>(&self.lock(), dims, src))
    }

    /// Every member's tensor (`parts` holds their shapes; dtypes agree), on `t`'s device.
    /// NCCL gathers equal parts, so each is padded to the longest and cut back after.
    pub(super) fn gpu_all_gather(
        &self,
        t: &Tensor,
        parts: &[(Vec<usize>, DType)],
    ) -> Result<Vec<Tensor>> {
        let mine = self.here(t)?.flatten_all()?;
        let lens: Vec<usize> = parts.iter().map(|(d, _)| d.iter().product()).collect();
        let max = lens.iter().copied().max().unwrap_or(0);
        let n = mine.elem_count();
        let padded = if n == max {
            mine
        } else {
            let pad = Tensor::zeros(max - n, t.dtype(), mine.device())?;
            if n == 0 {
                pad
            } else {
                Tensor::cat(&[mine, pad], 0)?
            }
        };
        let all = typed!(t.dtype(), T => gather::<T>(&self.lock(), &padded, parts.len()))?;
        parts
            .iter()
            .zip(&lens)
            .enumerate()
            .map(|(r, ((dims, _), &len))| {
                Ok(all
                    .narrow(0, r * max, len)?
                    .reshape(dims.as_slice())?
                    .to_device(t.device())?)
            })
            .collect()
    }

    pub(super) fn gpu_broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        let here = self.here(t)?;
        let out = typed!(t.dtype(), T => broadcast::<T>(&self.lock(), &here, root, self.rank()))?;
        Ok(out.to_device(t.device())?)
    }
}
