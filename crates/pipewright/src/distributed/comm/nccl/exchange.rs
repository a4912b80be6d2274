//! NCCL's all_to_all (expert parallelism's dispatch and combine): the members agree on the
//! plan over the CPU communicator, as every backend does ([`all_to_all::agree`]), then each
//! member sends each other member its part and receives theirs in one NCCL group (NCCL's own
//! all-to-all is such a group), keeping its own part. Each member moves only its own rows,
//! where the all_gather default moves every member's. Parts travel through the GPU staged
//! from the host and come back on the device they left.

use candle_core::{Device, Tensor};
use cudarc::driver::CudaSlice;
use cudarc::nccl::safe::{group_end, group_start};

use super::{gpu, Inner, NcclComm};
use crate::distributed::comm::all_to_all;
use crate::distributed::comm::wire::{tensor_from_bytes, with_bytes};
use crate::Result;

impl NcclComm {
    /// Member `r` gets part `r` of every member's `parts` (see
    /// [`crate::distributed::comm::Communicator::all_to_all`]).
    pub(super) fn exchange(&self, parts: &[Tensor]) -> Result<Vec<Tensor>> {
        let inner: &Inner = &self.0;
        let plan = all_to_all::agree(inner.cpu.as_ref(), parts)?;
        let me = inner.rank();
        let here = parts[me].device().clone();
        let row_bytes = plan.row.iter().product::<usize>() * plan.dtype.size_in_bytes();
        let got = plan.received(me);
        let host = parts
            .iter()
            .map(|p| with_bytes(&p.to_device(&Device::Cpu)?, |b| b.to_vec()))
            .collect::<Result<Vec<Vec<u8>>>>()?;
        let mut bytes = swap(inner, &host, &got, row_bytes, me)?;
        (0..parts.len())
            .map(|peer| match peer == me {
                true => Ok(parts[me].copy()?),
                false => {
                    let b = std::mem::take(&mut bytes[peer]);
                    let t = tensor_from_bytes(plan.dtype, &plan.dims(got[peer]), &b)?;
                    Ok(t.to_device(&here)?)
                }
            })
            .collect()
    }
}

/// Sends `host[peer]` to each other member and receives `got[peer]` rows of `row_bytes` from
/// it, in one NCCL group; the received bytes by member (none from `me`).
fn swap(
    inner: &Inner,
    host: &[Vec<u8>],
    got: &[usize],
    row_bytes: usize,
    me: usize,
) -> Result<Vec<Vec<u8>>> {
    let g = inner.lock();
    let mut sends: Vec<Option<CudaSlice<u8>>> = Vec::with_capacity(host.len());
    let mut recvs: Vec<Option<CudaSlice<u8>>> = Vec::with_capacity(host.len());
    for (peer, bytes) in host.iter().enumerate() {
        let other = peer != me;
        let send = (other && !bytes.is_empty())
            .then(|| g.stream.clone_htod(bytes))
            .transpose()
            .map_err(gpu("copying to the GPU"))?;
        let n = got[peer] * row_bytes;
        let recv = (other && n > 0)
            .then(|| g.stream.alloc_zeros::<u8>(n))
            .transpose()
            .map_err(gpu("allocating on the GPU"))?;
        sends.push(send);
        recvs.push(recv);
    }
    group_start().map_err(gpu("starting an NCCL group"))?;
    // Every call queued before the group ends, whatever one of them returned.
    let queued = (|| -> Result<()> {
        for (peer, (send, recv)) in sends.iter().zip(recvs.iter_mut()).enumerate() {
            if let Some(s) = send {
                g.comm.send(s, peer as i32).map_err(gpu("sending"))?;
            }
            if let Some(r) = recv {
                g.comm.recv(r, peer as i32).map_err(gpu("receiving"))?;
            }
        }
        Ok(())
    })();
    let ended = group_end().map_err(gpu("ending an NCCL group"));
    queued?;
    ended?;
    g.stream.synchronize().map_err(gpu("exchanging"))?;
    recvs
        .iter()
        .map(|r| match r {
            Some(r) => g.stream.clone_dtoh(r).map_err(gpu("copying from the GPU")),
            None => Ok(Vec::new()),
        })
        .collect()
}
