//! Devices by name (Varuna's `device=local_rank`, torchgpipe's `devices`): `cpu`, or `cuda`
//! with the ordinal of the rank on its machine.
//!
//! Every rank of a process that names the same GPU gets the same candle device, with one
//! stream, as PyTorch has one default stream per GPU: ranks that run as threads and share a
//! GPU (pipeline stages on one card) hand tensors to each other in program order, and the
//! stream keeps that order on the GPU with no events and no host waits. The NCCL backend
//! enqueues its collectives on the same stream.

use candle_core::Device;

use crate::{invalid, Result};

/// Whether the tensors of the device called `name` live in the host's memory (the cpu
/// device), where [`crate::runtime::memory`]'s counting allocator sees them; a GPU's do not (see
/// [`gpu_peak_bytes`]).
pub fn in_host_memory(name: &str) -> bool {
    name == "cpu"
}

/// The most bytes `device`'s GPU has held at once for this process in CUDA's stream-ordered
/// memory pool, where candle's CUDA buffers come from: the pool's high-water mark since the
/// process began (what PyTorch's `max_memory_allocated` reports; cuBLAS's workspace is not in
/// it). `None` on the CPU, and on a GPU without memory pools (candle then allocates outside
/// one).
pub fn gpu_peak_bytes(device: &Device) -> Result<Option<u64>> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        use cudarc::driver::sys;
        let Some(pool) = memory_pool(d)? else {
            return Ok(None);
        };
        let mut high: u64 = 0;
        // SAFETY: `memory_pool` made the context current on this thread; `high` is the u64
        // the attribute is and outlives the call.
        unsafe {
            sys::cuMemPoolGetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                (&mut high as *mut u64).cast(),
            )
            .result()
            .map_err(pool_error)?;
        }
        return Ok(Some(high));
    }
    let _ = device;
    Ok(None)
}

#[cfg(feature = "cuda")]
fn pool_error(e: cudarc::driver::DriverError) -> crate::Error {
    invalid!("the GPU's memory pool: {e:?}")
}

/// The stream-ordered memory pool candle allocates `d`'s buffers from, its context made
/// current on this thread; `None` on a GPU without memory pools.
#[cfg(feature = "cuda")]
fn memory_pool(d: &candle_core::CudaDevice) -> Result<Option<cudarc::driver::sys::CUmemoryPool>> {
    use cudarc::driver::sys;
    let ctx = d.cuda_stream().context().clone();
    if !ctx.has_async_alloc() {
        return Ok(None);
    }
    ctx.bind_to_thread().map_err(pool_error)?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: the context is current on this thread and `pool` outlives the call.
    unsafe {
        sys::cuDeviceGetMemPool(&mut pool, ctx.cu_device())
            .result()
            .map_err(pool_error)?;
    }
    Ok(Some(pool))
}

/// Makes `d`'s memory pool keep what is freed for the next allocation instead of returning it
/// to the driver at every synchronisation (the pool's default release threshold is 0): a
/// training step frees and takes the same sizes again each step, as PyTorch's caching
/// allocator keeps them.
#[cfg(feature = "cuda")]
fn keep_freed_memory(d: &candle_core::CudaDevice) -> Result<()> {
    use cudarc::driver::sys;
    let Some(pool) = memory_pool(d)? else {
        return Ok(());
    };
    let mut keep = u64::MAX;
    // SAFETY: the context is current (memory_pool); the attribute is the u64 `keep`.
    unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut keep as *mut u64).cast(),
        )
        .result()
        .map_err(pool_error)?;
    }
    Ok(())
}

/// The device called `name` (`cpu`, `cuda`, or `cuda:N`), with `ordinal` for a bare `cuda`
/// (a rank's local rank; ranks beyond the machine's GPUs share them round robin, so a
/// pipeline of 4 threads trains on one GPU). Asking for CUDA from a build without it, or a
/// GPU that is not there, is an error that names the device and says what to do.
pub fn device(name: &str, ordinal: usize) -> Result<Device> {
    let (kind, index) = match name.split_once(':') {
        Some((k, i)) => {
            let i = i.parse::<usize>().map_err(|_| {
                invalid!("device `{name}`: `{i}` is not a device ordinal (use cuda:0, cuda:1, ...)")
            })?;
            (k, Some(i))
        }
        None => (name, None),
    };
    match kind {
        "cpu" => Ok(Device::Cpu),
        "cuda" => gpu(name, index, ordinal),
        _ => Err(invalid!("unknown device `{name}`: use cpu, cuda or cuda:N")),
    }
}

#[cfg(not(feature = "cuda"))]
fn gpu(name: &str, _index: Option<usize>, _ordinal: usize) -> Result<Device> {
    Err(invalid!(
        "device `{name}`: this build of pipewright has no CUDA support: rebuild with the \
         `cuda` feature (tools/build-cuda.sh), or use the cpu device"
    ))
}

/// GPU `index`, or for a bare `cuda` GPU `ordinal` modulo the GPUs there are: the one candle
/// device this process keeps for it.
#[cfg(feature = "cuda")]
fn gpu(name: &str, index: Option<usize>, ordinal: usize) -> Result<Device> {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};

    static GPUS: OnceLock<Mutex<HashMap<usize, Device>>> = OnceLock::new();
    let index = match index {
        Some(i) => i,
        None => {
            let count = cudarc::driver::CudaContext::device_count().map_err(|e| {
                invalid!("device `{name}`: the CUDA driver cannot count the GPUs: {e:?}")
            })?;
            if count < 1 {
                return Err(invalid!(
                    "device `{name}`: this machine has no GPU the CUDA driver can see: use the \
                     cpu device, or check CUDA_VISIBLE_DEVICES"
                ));
            }
            ordinal % count as usize
        }
    };
    let mut gpus = GPUS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(d) = gpus.get(&index) {
        return Ok(d.clone());
    }
    let d = Device::new_cuda_with_stream(index)
        .map_err(|e| invalid!("device `{name}`: CUDA device {index} cannot be opened: {e}"))?;
    // One stream for the GPU: cudarc's cross-stream tracking (an event recorded and waited on
    // for every tensor of every kernel) has nothing to order.
    // SAFETY: every tensor of this device is made and used on its one stream, and the NCCL
    // backend enqueues on that stream too.
    unsafe { d.as_cuda_device()?.disable_event_tracking() };
    keep_freed_memory(d.as_cuda_device()?)?;
    gpus.insert(index, d.clone());
    Ok(d)
}

/// The device an integration test computes on: `PW_TEST_DEVICE` (`cpu` unless set; `cuda` on a
/// GPU machine, where `tools/gpu-checks.sh` runs the HF parities on the GPU with a `cuda`
/// build). A name this build cannot open is an error that says what to do.
pub fn test_device() -> Result<Device> {
    let name = std::env::var("PW_TEST_DEVICE").unwrap_or_else(|_| "cpu".into());
    device(&name, 0)
}

/// The GPU the `cuda` build's tests run on. A GPU test that finds none fails (it used to
/// pass having compared nothing), unless `PIPEWRIGHT_SKIP_GPU_TESTS=1` says to skip it: then
/// it says so and the test returns.
#[cfg(all(test, feature = "cuda"))]
pub(crate) fn test_gpu() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(d) => Some(d),
        Err(e) if std::env::var("PIPEWRIGHT_SKIP_GPU_TESTS").is_ok_and(|v| v == "1") => {
            eprintln!("no GPU here ({e}): skipped (PIPEWRIGHT_SKIP_GPU_TESTS=1)");
            None
        }
        Err(e) => panic!(
            "no GPU here ({e}): a GPU test cannot pass without one; run it on a GPU machine \
             (tools/gpu-checks.sh kernels), or set PIPEWRIGHT_SKIP_GPU_TESTS=1 to skip it"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::{device, gpu_peak_bytes, in_host_memory};

    #[test]
    fn names_resolve_or_say_what_is_wrong() {
        assert!(device("cpu", 3).unwrap().is_cpu());
        let e = device("tpu", 0).unwrap_err().to_string();
        assert!(e.contains("unknown device `tpu`"), "{e}");
        let e = device("cuda:x", 0).unwrap_err().to_string();
        assert!(e.contains("not a device ordinal"), "{e}");
        if !cfg!(feature = "cuda") {
            let e = device("cuda", 0).unwrap_err().to_string();
            assert!(e.contains("no CUDA support"), "{e}");
        }
    }

    #[test]
    fn only_the_cpu_devices_tensors_are_in_host_memory() {
        assert!(in_host_memory("cpu") && device("cpu", 0).unwrap().is_cpu());
        for gpu in ["cuda", "cuda:0", "cuda:3"] {
            assert!(!in_host_memory(gpu), "{gpu}");
        }
        assert_eq!(gpu_peak_bytes(&device("cpu", 0).unwrap()).unwrap(), None);
    }
}
