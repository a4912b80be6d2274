//! Gradient sums during the backward (PyTorch DDP's default, Megatron-LM's
//! `--overlap-grad-reduce`): [`OverlappedSums`] takes each micro-batch's gradients from the
//! pipeline as they are produced ([`GradSink`]), keeps their running sums, and once a
//! parameter's gradient is final (every micro-batch of the step has given it) puts it in the
//! current bucket; a bucket of `bucket_bytes` starts its sum over the replicas at once
//! ([`Communicator::iall_reduce`]), while the backward goes on. The step's first bucket is
//! [`FIRST_BUCKET_BYTES`] at most (DDP's `_DEFAULT_FIRST_BUCKET_BYTES`), so the sums start
//! with the last layer's gradients instead of waiting for a full bucket of layers. The last micro-batch's forward is
//! cut into one graph per layer ([`PipelineOptions::cut_last`]), so its backward gives the
//! layers' gradients one layer at a time, last layer first: the buckets fill in the order the
//! backward finishes them. [`OverlappedSums::finish`] starts what is left, sums the tied
//! weights (summed between their stages after the pipeline, so final only then) and waits.
//!
//! The same bits as summing after the step ([`all_reduce_grads`]): each gradient is made f32
//! and unscaled by the same operation, and each element is summed over the replicas in rank
//! order whatever bucket it travels in.
//!
//! [`PipelineOptions::cut_last`]: crate::parallel::pipeline::PipelineOptions::cut_last

use std::collections::HashMap;
use std::ops::Range;

use candle_core::Tensor;

use crate::distributed::comm::Communicator;
use crate::model::grads::Grads;
use crate::model::precision::to_master_grads;
use crate::parallel::data_parallel::{all_reduce_grads, BucketSum};
use crate::parallel::pipeline::GradSink;
use crate::Result;

/// The most bytes of the step's first bucket: PyTorch DDP's 1 MiB.
pub const FIRST_BUCKET_BYTES: usize = 1 << 20;

/// Final gradients waiting for their bucket to fill, over one group of replicas.
struct Filling<'a> {
    comm: &'a dyn Communicator,
    grads: Grads,
    bytes: usize,
    /// Whether a bucket of the step has started (the first is smaller).
    started: bool,
}

/// The gradient sums of one step, started as the gradients become final.
pub struct OverlappedSums<'a> {
    dense: Filling<'a>,
    /// The experts' gradients, summed over the ranks holding the same experts.
    experts: Option<(Filling<'a>, &'a [String])>,
    tied: &'a [(String, String)],
    scale: f64,
    micro_batches: usize,
    bucket_bytes: usize,
    /// Running sums of the gradients not yet final, and how many micro-batches gave each.
    sums: Grads,
    given: HashMap<String, usize>,
    in_flight: Vec<BucketSum>,
}

impl<'a> OverlappedSums<'a> {
    /// The sums over `dense` (and the experts', named by `experts`, over theirs) of a step of
    /// `micro_batches` micro-batches computed at loss scale `scale`; `tied` pairs are left to
    /// the pipeline.
    pub fn new(
        dense: &'a dyn Communicator,
        experts: Option<(&'a dyn Communicator, &'a [String])>,
        tied: &'a [(String, String)],
        (scale, micro_batches, bucket_bytes): (f64, usize, usize),
    ) -> Self {
        let filling = |comm| Filling {
            comm,
            grads: Grads::new(),
            bytes: 0,
            started: false,
        };
        Self {
            dense: filling(dense),
            experts: experts.map(|(c, names)| (filling(c), names)),
            tied,
            scale,
            micro_batches,
            bucket_bytes,
            sums: Grads::new(),
            given: HashMap::new(),
            in_flight: Vec::new(),
        }
    }

    /// Puts the final gradient of `name` in its group's bucket; starts the bucket once full.
    fn ready(&mut self, name: String, g: Tensor) -> Result<()> {
        let bytes = g.elem_count() * 4;
        let fill = match self.experts.as_mut() {
            Some((f, names)) if names.contains(&name) => f,
            _ => &mut self.dense,
        };
        fill.grads.insert(name, g);
        fill.bytes += bytes;
        let full = match fill.started {
            true => self.bucket_bytes,
            false => self.bucket_bytes.min(FIRST_BUCKET_BYTES),
        };
        if fill.bytes >= full {
            let started = start(fill, self.scale)?;
            self.in_flight.extend(started);
        }
        Ok(())
    }

    /// Starts what is left, sums `after` (the tied weights' gradients the pipeline summed
    /// between stages) and waits for every sum: the step's gradients, f32, unscaled, summed
    /// over the replicas.
    pub fn finish(mut self, after: &Grads) -> Result<Grads> {
        // Any gradient not given by every micro-batch (none in a well-formed step) is summed
        // as it stands, as the sums after the step would.
        let left: Vec<(String, Tensor)> = (self.sums.iter())
            .map(|(n, g)| (n.clone(), g.clone()))
            .collect();
        for (n, g) in left {
            self.ready(n, g)?;
        }
        let mut flights = start(&mut self.dense, self.scale)?
            .into_iter()
            .collect::<Vec<_>>();
        if let Some((f, _)) = self.experts.as_mut() {
            flights.extend(start(f, self.scale)?);
        }
        self.in_flight.extend(flights);
        let mut out = to_master_grads(after, 1.0 / self.scale)?;
        all_reduce_grads(&mut out, self.dense.comm, self.bucket_bytes)?;
        for f in self.in_flight {
            f.finish_into(&mut out)?;
        }
        Ok(out)
    }
}

/// Starts the sum of the bucket `fill` holds (made f32 and unscaled by `1 / scale`), if any.
fn start(fill: &mut Filling, scale: f64) -> Result<Option<BucketSum>> {
    let grads = std::mem::take(&mut fill.grads);
    fill.bytes = 0;
    fill.started = true;
    if grads.is_empty() {
        return Ok(None);
    }
    let master = to_master_grads(&grads, 1.0 / scale)?;
    let parts: Vec<(String, Tensor)> = (master.iter())
        .map(|(n, g)| (n.clone(), g.clone()))
        .collect();
    BucketSum::start(&parts, fill.comm).map(Some)
}

impl GradSink for OverlappedSums<'_> {
    fn take(&mut self, _k: usize, _layers: Range<usize>, grads: Grads) -> Result<Grads> {
        let is_tied = |n: &str| self.tied.iter().any(|(a, b)| a == n || b == n);
        let (mut mine, mut later) = (Grads::new(), Grads::new());
        for (n, g) in grads.iter() {
            match is_tied(n) {
                true => later.insert(n.clone(), g.clone()),
                false => mine.insert(n.clone(), g.clone()),
            }
        }
        let names: Vec<String> = mine.iter().map(|(n, _)| n.clone()).collect();
        // The same running sums as the pipeline keeps without a sink.
        self.sums.accumulate(mine)?;
        for n in names {
            let given = self.given.entry(n.clone()).or_default();
            *given += 1;
            if *given == self.micro_batches {
                let g = self.sums.remove(&n).expect("accumulated just above");
                self.ready(n, g)?;
            }
        }
        Ok(later)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use super::*;
    use crate::distributed::comm::local;

    fn grads(v: f32) -> Grads {
        let mut g = Grads::new();
        for (n, len) in [("a", 3), ("b", 5000), ("t", 2)] {
            g.insert(n, Tensor::full(v, len, &Device::Cpu).unwrap());
        }
        g
    }

    /// A gradient's sum starts when its last micro-batch gives it, before the step ends; the
    /// tied one waits for the pipeline; the result is the sum over micro-batches and replicas,
    /// unscaled.
    #[test]
    fn sums_start_when_the_last_micro_batch_gives_the_gradients() {
        let per_rank = local::run(2, |c| {
            let tied = [("t".to_string(), "u".to_string())];
            let mut s = OverlappedSums::new(&c, None, &tied, (4.0, 2, 64));
            let later = s.take(0, 0..1, grads(1.0))?;
            assert!(s.in_flight.is_empty(), "nothing is final after one of two");
            assert_eq!(
                later.len(),
                1,
                "the tied gradient goes back to the pipeline"
            );
            s.take(0, 0..1, grads(3.0))?;
            // `a` and `b` (20012 bytes) filled a bucket, whose sum is in flight.
            assert_eq!(s.in_flight.len(), 1);
            let mut after = Grads::new();
            after.insert("t", Tensor::full(8f32, 2, &Device::Cpu)?);
            let out = s.finish(&after)?;
            let read = |n: &str| -> Vec<f32> {
                let t = out.get(n).unwrap().to_dtype(DType::F32).unwrap();
                t.to_vec1().unwrap()
            };
            // (1 + 3) / 4 on each of 2 replicas; the tied 8 / 4 on each.
            assert_eq!(read("a"), vec![2.0; 3]);
            assert!(read("b").iter().all(|x| *x == 2.0));
            assert_eq!(read("t"), vec![4.0; 2]);
            Ok(())
        });
        per_rank.unwrap();
    }

    /// The step's first bucket starts once it holds [`FIRST_BUCKET_BYTES`], the next ones at
    /// `bucket_bytes` (DDP's rule); each sum is the replicas' whatever its bucket.
    #[test]
    fn the_first_bucket_is_small() {
        local::run(2, |c| {
            let mut s = OverlappedSums::new(&c, None, &[], (1.0, 1, 8 << 20));
            let one = |n: &str, v: f32| {
                let mut g = Grads::new();
                g.insert(n, Tensor::full(v, 300_000, &Device::Cpu).unwrap());
                g
            };
            s.take(0, 2..3, one("c", 1.0))?;
            assert_eq!(s.in_flight.len(), 1, "1.2 MB fills the first bucket");
            s.take(0, 1..2, one("b", 2.0))?;
            s.take(0, 0..1, one("a", 3.0))?;
            assert_eq!(s.in_flight.len(), 1, "2.4 MB do not fill an 8 MiB one");
            let out = s.finish(&Grads::new())?;
            for (n, want) in [("a", 6.0), ("b", 4.0), ("c", 2.0)] {
                let v: Vec<f32> = out.get(n).unwrap().to_vec1()?;
                assert!(v.iter().all(|x| *x == want), "{n}");
            }
            Ok(())
        })
        .unwrap();
    }
}

/// The communication section of a run: whether communication travels behind computation,
/// and in what pieces (serialized flat into its run's spec).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct OverlapSpec {
    /// Data-parallel gradient sums start during the backward, as each layer's gradients are
    /// final (PyTorch DDP's default), and ZeRO-2/3's reduce-scatters travel while the pipeline
    /// goes on; `false` (`--no-overlap`) sums after the schedule ends and waits for each
    /// reduce-scatter at once, for comparison and debugging. The same bits either way. Runs
    /// recorded before it overlapped nothing.
    #[serde(default)]
    pub overlap: bool,
    /// Bytes per bucket of the gradient sums over the replicas and of ZeRO's shards (PyTorch
    /// DDP's `bucket_cap_mb`, 25 MiB; `train --bucket-mb`): smaller buckets start their sums
    /// sooner in the backward, larger ones make fewer collectives. The same bits at any size.
    #[serde(default = "default_bucket_bytes")]
    pub bucket_bytes: usize,
    /// ZeRO-3's gathered layers at most at a time, the one computing included (`train
    /// --zero-live-layers`, DeepSpeed's `stage3_max_live_parameters` by layer): above 1, the
    /// next layers' gathers start while one computes (FSDP's prefetch); 1 gathers each layer
    /// when it is needed, as does overlap off. The same bits at any bound.
    #[serde(default = "default_live_layers")]
    pub zero_live_layers: usize,
}

impl Default for OverlapSpec {
    /// Overlap on, DDP's 25 MiB buckets, two gathered layers.
    fn default() -> Self {
        Self {
            overlap: true,
            bucket_bytes: default_bucket_bytes(),
            zero_live_layers: default_live_layers(),
        }
    }
}

impl OverlapSpec {
    /// ZeRO-3's gathered layers at most at a time: [`OverlapSpec::zero_live_layers`], or 1
    /// (each layer gathered when it is needed) with overlap off.
    pub fn live_layers(&self) -> usize {
        if self.overlap {
            self.zero_live_layers
        } else {
            1
        }
    }
}

/// DDP's 25 MiB, for runs recorded before the bucket was theirs to set.
fn default_bucket_bytes() -> usize {
    crate::parallel::data_parallel::DEFAULT_BUCKET_BYTES
}

/// Two gathered layers: the one computing and the next (runs recorded before prefetch held one).
fn default_live_layers() -> usize {
    2
}
