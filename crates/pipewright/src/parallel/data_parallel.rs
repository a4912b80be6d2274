//! Data parallelism: replicas of the same stage and shard each take their own rows of the
//! global batch, and their gradients are summed (PyTorch's DDP), in a few large flat buckets
//! rather than one collective per parameter.
//!
//! Each replica divides its loss by the count of targets of the *global* batch, so the sum
//! over replicas is exactly the gradient of the global batch's mean loss: a serial run's.
//! Tied pairs are summed between their stages inside each replica first; being equal, they
//! stay equal through the sum over replicas.

use candle_core::{DType, Device, Tensor};

use crate::distributed::comm::{waited, Communicator, Pending, ReduceOp};
use crate::model::batch::Batch;
use crate::model::grads::Grads;
use crate::{invalid, Result};

/// PyTorch DDP's default bucket: 25 MiB.
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// Sums `grads` over the replicas of `comm` in place, in buckets of about `bucket_bytes`
/// (gradients in name order, flattened into one f32 buffer per bucket). Every member must hold
/// gradients of the same names and shapes. Returns the number of collectives run.
pub fn all_reduce_grads(
    grads: &mut Grads,
    comm: &dyn Communicator,
    bucket_bytes: usize,
) -> Result<usize> {
    if comm.size() == 1 {
        return Ok(0);
    }
    let names: Vec<(String, Vec<usize>)> = grads
        .iter()
        .map(|(n, g)| (n.clone(), g.dims().to_vec()))
        .collect();
    let sizes: Vec<usize> = names.iter().map(|(_, d)| d.iter().product()).collect();
    let buckets: Vec<&[(String, Vec<usize>)]> = buckets(&sizes, bucket_bytes)
        .into_iter()
        .map(|r| &names[r])
        .collect();
    for bucket in &buckets {
        let parts = bucket
            .iter()
            .map(|(n, _)| (n.clone(), grads.get(n).expect("listed").clone()))
            .collect::<Vec<_>>();
        BucketSum::start(&parts, comm)?.finish_into(grads)?;
    }
    Ok(buckets.len())
}

/// One bucket's sum over the replicas in flight: its gradients flattened into one f32 buffer
/// in order, the sum started ([`Communicator::iall_reduce`]); [`BucketSum::finish_into`] waits
/// and puts each sum back, in its gradient's type and shape. The one bucket of the sums after
/// the step ([`all_reduce_grads`]) and during the backward ([`super::overlap`]).
pub(crate) struct BucketSum {
    /// Each gradient's name, shape and type, in the order flattened.
    parts: Vec<(String, Vec<usize>, DType)>,
    sum: Pending<Tensor>,
    started: std::time::Instant,
}

impl BucketSum {
    /// Starts the sum of `grads` over `comm`.
    pub(crate) fn start(grads: &[(String, Tensor)], comm: &dyn Communicator) -> Result<Self> {
        let parts = (grads.iter())
            .map(|(n, g)| (n.clone(), g.dims().to_vec(), g.dtype()))
            .collect();
        let flat = (grads.iter())
            .map(|(_, g)| Ok(g.to_dtype(DType::F32)?.flatten_all()?))
            .collect::<Result<Vec<_>>>()?;
        let flat = Tensor::cat(&flat, 0)?;
        let started = std::time::Instant::now();
        let sum = waited::waiting(|| comm.iall_reduce(&flat, ReduceOp::Sum))?;
        Ok(Self {
            parts,
            sum,
            started,
        })
    }

    /// Waits for the sum and puts each gradient's part of it into `out`.
    pub(crate) fn finish_into(self, out: &mut Grads) -> Result<()> {
        let sum = waited::finish(self.sum, self.started, || {
            let bytes: usize = (self.parts.iter())
                .map(|(_, d, _)| d.iter().product::<usize>() * 4)
                .sum();
            format!("all-reduce {:.1} KiB", bytes as f64 / 1024.0)
        })?;
        let mut at = 0;
        for (n, dims, dt) in self.parts {
            let len: usize = dims.iter().product();
            let g = sum.narrow(0, at, len)?.reshape(dims.as_slice())?;
            out.insert(n, g.to_dtype(dt)?);
            at += len;
        }
        Ok(())
    }
}

/// Consecutive runs of tensors of `sizes` elements (in order) filling buckets of about
/// `bucket_bytes` of f32: a bucket takes tensors until it holds `bucket_bytes` or more, so one
/// larger tensor has a bucket of its own. The one bucketing of gradient sums and of ZeRO's
/// shards ([`crate::parallel::zero`]).
pub fn buckets(sizes: &[usize], bucket_bytes: usize) -> Vec<std::ops::Range<usize>> {
    let mut out: Vec<std::ops::Range<usize>> = Vec::new();
    let mut bytes = usize::MAX;
    for (i, n) in sizes.iter().enumerate() {
        if bytes >= bucket_bytes {
            out.push(i..i);
            bytes = 0;
        }
        bytes += n * 4;
        out.last_mut().expect("a bucket was pushed").end = i + 1;
    }
    out
}

/// Rows `rank * n/size ..` of every tensor of `batch`: replica `rank`'s part of a global
/// batch. The rows must divide evenly.
pub fn shard_batch(batch: &Batch, rank: usize, size: usize) -> Result<Batch> {
    let rows = batch.rows()?;
    if size == 0 || !rows.is_multiple_of(size) {
        return Err(invalid!(
            "a global batch of {rows} rows does not split evenly over {size} data-parallel replicas"
        ));
    }
    let per = rows / size;
    batch.narrow(rank * per, per)
}

/// A data-parallel replica's rows of every step's global batch, on its device, from a batch
/// function of the step (stateless: the step alone says which rows, so a resumed or morphed
/// run asks again; `experiment::SmartDataLoader` is the stateful loader that walks a dataset
/// by epochs). `batch_fn(step, rows)` must be deterministic (a task seeded once): every
/// replica asks for the same global batch and keeps its part. (Was `DistributedLoader`.)
pub struct ReplicaBatches<F> {
    batch_fn: F,
    global_batch: usize,
    rank: usize,
    size: usize,
    device: Device,
}

impl<F> ReplicaBatches<F>
where
    F: Fn(u64, usize) -> Result<Batch>,
{
    /// A loader of global batches of `global_batch` rows for replica `rank` of `size`.
    pub fn new(
        batch_fn: F,
        global_batch: usize,
        rank: usize,
        size: usize,
        device: Device,
    ) -> Result<Self> {
        if size == 0 || rank >= size || !global_batch.is_multiple_of(size) {
            return Err(invalid!(
                "a global batch of {global_batch} does not split evenly over {size} data-parallel replicas"
            ));
        }
        Ok(Self {
            batch_fn,
            global_batch,
            rank,
            size,
            device,
        })
    }

    /// This replica's rows of global batch `step`, on the loader's device.
    pub fn batch(&self, step: u64) -> Result<Batch> {
        let b = (self.batch_fn)(step, self.global_batch)?;
        shard_batch(&b, self.rank, self.size)?.to_device(&self.device)
    }
}
