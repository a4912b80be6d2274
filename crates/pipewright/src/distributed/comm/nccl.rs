//! NCCL backend (cargo feature `nccl`): collectives on NVIDIA GPUs through cudarc, which loads
//! libcuda and libnccl at run time, so this builds on machines without CUDA (in a `cuda` build
//! they are linked instead).
//!
//! A [`NcclComm`] is made from a CPU communicator (local threads or MPI) of the same ranks:
//! rank 0 makes the NCCL unique id and broadcasts it over the CPU communicator, and shape and
//! dtype headers travel there too, so mismatches are reported exactly as the other backends
//! report them. Tensors on the GPU (a `cuda` build) go straight through NCCL (`nccl/gpu.rs`); CPU
//! tensors are copied to the rank's GPU, and results back. Reductions gather through NCCL and
//! add in rank order ([`super::ordered`]), so they give the bits of every other backend.
//! all_to_all is one NCCL group of sends and receives (`nccl/exchange.rs`).
//!
//! cudarc panics on its first call when libcuda is missing; [`probe`] checks first, and
//! [`NcclComm::new`] returns an error instead.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Tensor};
#[cfg(not(feature = "cuda"))]
use cudarc::driver::CudaContext;
use cudarc::driver::{CudaStream, DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::safe::{Comm, Id, NcclType};

use super::wire::{header_tensor, parse_header_tensor, reduce_plan, tensor_from_bytes, with_bytes};
use super::{check_agree, check_same_dtype, ordered, Communicator, Pending, ReduceOp, MAX_TAG};
use crate::{Error, Result};

mod exchange;
#[cfg(feature = "cuda")]
mod gpu;

/// Checks that the CUDA driver and NCCL libraries can be loaded. A `cuda` build links them
/// (as candle links its CUDA libraries): the program's loader found them before it ran.
#[cfg(feature = "cuda")]
pub fn probe() -> Result<()> {
    Ok(())
}

/// Checks that the CUDA driver and NCCL libraries can be loaded.
#[cfg(not(feature = "cuda"))]
pub fn probe() -> Result<()> {
    // SAFETY: both only try to dlopen the library and drop it.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(Error::Comm(
            "NCCL backend: the CUDA driver library (libcuda.so) cannot be loaded on this machine: \
             run on a machine with an NVIDIA GPU and its driver, or use the local or mpi backend"
                .into(),
        ));
    }
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(Error::Comm(
            "NCCL backend: libnccl.so cannot be loaded: install NCCL or put the directory that \
             holds libnccl.so on LD_LIBRARY_PATH"
                .into(),
        ));
    }
    Ok(())
}

fn gpu<E: std::fmt::Debug>(what: &str) -> impl FnOnce(E) -> Error + '_ {
    move |e| Error::Comm(format!("NCCL backend: {what}: {e:?}"))
}

struct Gpu {
    comm: Comm,
    /// candle's stream for this GPU in a `cuda` build (NCCL is ordered with its kernels).
    stream: Arc<CudaStream>,
    #[cfg(feature = "cuda")]
    candle: candle_core::CudaDevice,
}

// SAFETY: the NCCL communicator and stream are only used under `Inner::gpu`'s mutex, one
// thread at a time, which NCCL and CUDA allow.
unsafe impl Send for Gpu {}

/// One rank of an NCCL communicator.
pub struct NcclComm(Arc<Inner>);

struct Inner {
    cpu: Box<dyn Communicator>,
    gpu: Mutex<Gpu>,
    device: usize,
    /// Messages a rank sends to itself (NCCL would wait for its own receive).
    to_self: Mutex<HashMap<u64, VecDeque<Tensor>>>,
}

impl NcclComm {
    /// Joins the ranks of `cpu` into an NCCL communicator on GPU `device` of this rank.
    /// Every rank of `cpu` calls it.
    pub fn new(cpu: Box<dyn Communicator>, device: usize) -> Result<Self> {
        // All ranks agree on whether NCCL is usable before any waits on another.
        let ok = probe();
        let flag = Tensor::new(&[u8::from(ok.is_err())], &Device::Cpu)?;
        let failed = cpu.all_reduce(&flag, ReduceOp::Max)?.to_vec1::<u8>()?[0];
        ok?;
        if failed != 0 {
            return Err(Error::Comm(
                "NCCL backend: another rank cannot load CUDA or NCCL".into(),
            ));
        }
        #[cfg(feature = "cuda")]
        let candle = crate::runtime::device::device(&format!("cuda:{device}"), 0)?
            .as_cuda_device()?
            .clone();
        #[cfg(feature = "cuda")]
        let stream = candle.cuda_stream();
        #[cfg(not(feature = "cuda"))]
        let stream = CudaContext::new(device)
            .map_err(gpu("opening the GPU"))?
            .default_stream();
        let id = if cpu.rank() == 0 {
            Id::new().map_err(gpu("making the NCCL unique id"))?
        } else {
            Id::uninit([0; 128])
        };
        let bytes: Vec<u8> = id.internal().iter().map(|c| *c as u8).collect();
        let shared = cpu.broadcast(&Tensor::from_vec(bytes, 128, &Device::Cpu)?, 0)?;
        let mut internal = [0 as std::ffi::c_char; 128];
        for (d, s) in internal.iter_mut().zip(shared.to_vec1::<u8>()?) {
            *d = s as std::ffi::c_char;
        }
        let comm = Comm::from_rank(stream.clone(), cpu.rank(), cpu.size(), Id::uninit(internal))
            .map_err(gpu("joining the NCCL communicator"))?;
        Ok(Self(Arc::new(Inner {
            cpu,
            gpu: Mutex::new(Gpu {
                comm,
                stream,
                #[cfg(feature = "cuda")]
                candle,
            }),
            device,
            to_self: Mutex::new(HashMap::new()),
        })))
    }
}

impl Inner {
    fn rank(&self) -> usize {
        self.cpu.rank()
    }

    fn size(&self) -> usize {
        self.cpu.size()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Gpu> {
        self.gpu.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn check(&self, r: usize, what: &str, tag: Option<u64>) -> Result<()> {
        if r >= self.size() {
            return Err(Error::Comm(format!(
                "rank {}: {what} names rank {r}, outside this group of {} ranks",
                self.rank(),
                self.size()
            )));
        }
        if tag.is_some_and(|t| t >= MAX_TAG) {
            return Err(Error::Comm(format!(
                "tag {} is too large: use tags below {MAX_TAG}",
                tag.unwrap()
            )));
        }
        Ok(())
    }

    /// Every member's (shape, dtype), over the CPU communicator.
    fn headers(&self, t: &Tensor) -> Result<Vec<(Vec<usize>, DType)>> {
        let parts = self.cpu.all_gather(&header_tensor(t)?)?;
        parts.iter().map(parse_header_tensor).collect()
    }

    fn agree(&self, op: &str, t: &Tensor, reference: usize) -> Result<()> {
        check_agree(op, &self.headers(t)?, reference).map_err(Error::Comm)
    }

    /// Copies `host` to the GPU, runs `f(send, recv)` on buffers of `out` elements and copies
    /// the result back.
    fn staged<T: NcclType + DeviceRepr + ValidAsZeroBits + Copy>(
        &self,
        host: &[T],
        out: usize,
        f: impl FnOnce(
            &Comm,
            &cudarc::driver::CudaSlice<T>,
            &mut cudarc::driver::CudaSlice<T>,
        ) -> Result<()>,
    ) -> Result<Vec<T>> {
        if host.is_empty() && out == 0 {
            return Ok(Vec::new());
        }
        let g = self.lock();
        let send = g
            .stream
            .clone_htod(host)
            .map_err(gpu("copying to the GPU"))?;
        let mut recv = g
            .stream
            .alloc_zeros::<T>(out.max(1))
            .map_err(gpu("allocating on the GPU"))?;
        f(&g.comm, &send, &mut recv)?;
        let mut v = g
            .stream
            .clone_dtoh(&recv)
            .map_err(gpu("copying from the GPU"))?;
        v.truncate(out);
        Ok(v)
    }

    fn send(&self, t: &Tensor, dst: usize, tag: u64) -> Result<()> {
        self.check(dst, "send", Some(tag))?;
        if dst == self.rank() {
            let mut boxes = self.to_self.lock().unwrap_or_else(|e| e.into_inner());
            boxes.entry(tag).or_default().push_back(t.copy()?.detach());
            return Ok(());
        }
        self.cpu.send(&header_tensor(t)?, dst, tag)?;
        #[cfg(feature = "cuda")]
        if t.device().is_cuda() {
            return self.gpu_send(t, dst);
        }
        let bytes = Self::bytes(t)?;
        if bytes.is_empty() {
            return Ok(());
        }
        let g = self.lock();
        let dev = g
            .stream
            .clone_htod(&bytes)
            .map_err(gpu("copying to the GPU"))?;
        g.comm.send(&dev, dst as i32).map_err(gpu("sending"))?;
        g.stream.synchronize().map_err(gpu("sending"))
    }

    fn recv(&self, src: usize, tag: u64) -> Result<Tensor> {
        self.check(src, "recv", Some(tag))?;
        if src == self.rank() {
            let mut boxes = self.to_self.lock().unwrap_or_else(|e| e.into_inner());
            return boxes
                .get_mut(&tag)
                .and_then(|q| q.pop_front())
                .ok_or_else(|| {
                    Error::Comm(format!(
                        "rank {src}: recv from itself with tag {tag}, but nothing was sent"
                    ))
                });
        }
        let (dims, dt) = parse_header_tensor(&self.cpu.recv(src, tag)?)?;
        #[cfg(feature = "cuda")]
        let got = self.gpu_recv(&dims, dt, src);
        #[cfg(not(feature = "cuda"))]
        let got = self.staged_recv(&dims, dt, src);
        got
    }

    /// Receives into GPU memory and copies the bytes to the host (a build without `cuda`,
    /// where every tensor is a CPU tensor).
    #[cfg(not(feature = "cuda"))]
    fn staged_recv(&self, dims: &[usize], dt: DType, src: usize) -> Result<Tensor> {
        let n = dims.iter().product::<usize>() * dt.size_in_bytes();
        if n == 0 {
            return tensor_from_bytes(dt, dims, &[]);
        }
        let g = self.lock();
        let mut dev = g
            .stream
            .alloc_zeros::<u8>(n)
            .map_err(gpu("allocating on the GPU"))?;
        g.comm
            .recv(&mut dev, src as i32)
            .map_err(gpu("receiving"))?;
        let bytes = g
            .stream
            .clone_dtoh(&dev)
            .map_err(gpu("copying from the GPU"))?;
        tensor_from_bytes(dt, dims, &bytes)
    }

    fn bytes(t: &Tensor) -> Result<Vec<u8>> {
        with_bytes(t, |b| b.to_vec())
    }
}

impl NcclComm {
    /// all_reduce (or reduce_scatter) in rank order ([`ordered`]): NCCL gathers every member's
    /// tensor (moving bytes, adding nothing) and each member adds, in rank order, what it
    /// keeps. Each member receives `size - 1` whole tensors, where NCCL's own ring would
    /// receive `2 (size - 1) / size` of one: the price of bits that match every other backend.
    fn reduce(&self, t: &Tensor, op: ReduceOp, scatter: bool) -> Result<Tensor> {
        let name = if scatter {
            "reduce_scatter"
        } else {
            "all_reduce"
        };
        // One exchange of headers serves the check and the gather.
        let headers = self.0.headers(t)?;
        check_agree(name, &headers, 0).map_err(Error::Comm)?;
        let dims = reduce_plan(t, op, self.size(), scatter)?;
        if t.elem_count() == 0 {
            // Nothing to reduce (every member agreed on the shape), and candle's CUDA kernels
            // cannot run on an empty tensor: an empty result of the output's shape, on the
            // input's device.
            return Ok(Tensor::zeros(dims, t.dtype(), &Device::Cpu)?.to_device(t.device())?);
        }
        let mut parts = self.gather(t, &headers)?;
        if scatter {
            for p in &mut parts {
                *p = p.narrow(0, self.rank() * dims[0], dims[0])?;
            }
        }
        Ok(ordered::combine(&parts, op)?.reshape(dims)?)
    }

    /// Every member's tensor (`parts` holds their shapes and dtypes, agreed): NCCL's gather,
    /// moving bytes and adding nothing.
    fn gather(&self, t: &Tensor, parts: &[(Vec<usize>, DType)]) -> Result<Vec<Tensor>> {
        #[cfg(feature = "cuda")]
        if t.device().is_cuda() {
            return self.0.gpu_all_gather(t, parts);
        }
        // NCCL gathers equal parts: pad every rank's bytes to the largest.
        let esize = t.dtype().size_in_bytes();
        let lens: Vec<usize> = parts
            .iter()
            .map(|(d, _)| d.iter().product::<usize>() * esize)
            .collect();
        let max = lens.iter().copied().max().unwrap_or(0);
        let mut mine = Inner::bytes(t)?;
        mine.resize(max, 0);
        let n = self.0.size();
        let all = if max == 0 {
            Vec::new()
        } else {
            self.0.staged(&mine, max * n, |c, s, r| {
                c.all_gather(s, r).map(|_| ()).map_err(gpu("gathering"))
            })?
        };
        parts
            .iter()
            .enumerate()
            .map(|(r, (dims, dt))| {
                tensor_from_bytes(
                    *dt,
                    dims,
                    all.get(r * max..r * max + lens[r]).unwrap_or(&[]),
                )
            })
            .collect()
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.0.rank()
    }

    fn size(&self) -> usize {
        self.0.size()
    }

    fn backend(&self) -> &'static str {
        "nccl"
    }

    fn send(&self, t: &Tensor, dst: usize, tag: u64) -> Result<()> {
        self.0.send(t, dst, tag)
    }

    fn recv(&self, src: usize, tag: u64) -> Result<Tensor> {
        self.0.recv(src, tag)
    }

    fn isend(&self, t: &Tensor, dst: usize, tag: u64) -> Result<Pending<()>> {
        self.0.send(t, dst, tag)?;
        Ok(Pending::new(|| Ok(())))
    }

    /// The receive happens when the handle is waited on (one NCCL stream per rank).
    fn irecv(&self, src: usize, tag: u64) -> Result<Pending<Tensor>> {
        self.0.check(src, "irecv", Some(tag))?;
        let inner = self.0.clone();
        Ok(Pending::new(move || inner.recv(src, tag)))
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.reduce(t, op, false)
    }

    fn all_to_all(&self, parts: &[Tensor]) -> Result<Vec<Tensor>> {
        self.exchange(parts)
    }

    fn all_gather(&self, t: &Tensor) -> Result<Vec<Tensor>> {
        let parts = self.0.headers(t)?;
        check_same_dtype(&parts).map_err(Error::Comm)?;
        self.gather(t, &parts)
    }

    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.reduce(t, op, true)
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        self.0.check(root, "broadcast", None)?;
        self.0.agree("broadcast", t, root)?;
        #[cfg(feature = "cuda")]
        if t.device().is_cuda() {
            return self.0.gpu_broadcast(t, root);
        }
        let bytes = Inner::bytes(t)?;
        if bytes.is_empty() {
            return Ok(t.clone());
        }
        let g = self.0.lock();
        let mut dev = g
            .stream
            .clone_htod(&bytes)
            .map_err(gpu("copying to the GPU"))?;
        g.comm
            .broadcast_in_place(&mut dev, root as i32)
            .map_err(gpu("broadcasting"))?;
        let out = g
            .stream
            .clone_dtoh(&dev)
            .map_err(gpu("copying from the GPU"))?;
        tensor_from_bytes(t.dtype(), t.dims(), &out)
    }

    fn barrier(&self) -> Result<()> {
        self.all_reduce(&Tensor::new(&[0f32], &Device::Cpu)?, ReduceOp::Sum)?;
        self.0.cpu.barrier()
    }

    fn split(&self, members: &[usize]) -> Result<Box<dyn Communicator>> {
        let cpu = self.0.cpu.split(members)?;
        Ok(Box::new(NcclComm::new(cpu, self.0.device)?))
    }
}
