//! [`ShardedGrads`]: ZeRO-2's gradients. Each micro-batch's gradients of a model stage are
//! reduce-scattered over the data-parallel group as soon as the schedule completes them, and
//! each member keeps only the running sum of its shards; tied weights, whose gradients are
//! summed between their stages when the batch ends, are reduce-scattered then. Under ZeRO-3
//! the plan's groups are layers, and each layer's gradients are reduce-scattered as soon as
//! its own backward gives them.
//!
//! In flight (overlap on, the default): a bucket's reduce-scatter starts once each of its
//! layers has given its gradients for the micro-batch (the whole stage's at once, or one
//! layer's at a time when the backward runs layer by layer: ZeRO-3, and the last micro-batch
//! when the sums overlap the backward), and its shard is added to the bucket's running sum when
//! the sink needs the room or the step ends. At most [`IN_FLIGHT`] buckets travel at once, the
//! oldest waited for first, so a replica holds no more than that many whole buckets beside its
//! shards (DeepSpeed's `overlap_comm` buffers, likewise bounded). The sums are added in
//! micro-batch order either way: the same bits as waiting for each at once (overlap off).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::ops::Range;
use std::time::Instant;

use candle_core::Tensor;

use super::plan::ShardPlan;
use crate::distributed::comm::{waited, Communicator, Pending};
use crate::model::grads::Grads;
use crate::model::precision::to_master_grads;
use crate::parallel::pipeline::GradSink;
use crate::Result;

/// The group tag of the parameters reduced after the pipeline (tied weights).
pub const AFTER_PIPELINE: usize = usize::MAX;

/// How many buckets' reduce-scatters a [`ShardedGrads`] keeps in flight at most.
pub const IN_FLIGHT: usize = 2;

/// One step's running shard sums (f32, unscaled), as a [`GradSink`] for the pipeline.
pub struct ShardedGrads<'a> {
    plan: &'a ShardPlan,
    comm: &'a dyn Communicator,
    /// The inverse loss scale.
    factor: f64,
    sums: Vec<Option<Tensor>>,
    /// Parameters that had a gradient (the others get none, as without ZeRO).
    present: BTreeSet<String>,
    /// Whether the plan's groups are layers (ZeRO-3), not model stages.
    by_layer: bool,
    /// Whether reduce-scatters stay in flight while the pipeline goes on.
    overlap: bool,
    /// Each bucket's gradients (f32, unscaled) of the micro-batch being given, and the layers
    /// that gave them.
    filling: BTreeMap<usize, (Grads, BTreeSet<usize>)>,
    /// Reduce-scatters in flight, oldest first: (bucket, this member's shard of the sum).
    flights: VecDeque<(usize, Pending<Tensor>, Instant)>,
}

impl<'a> ShardedGrads<'a> {
    /// Empty sums for one step whose gradients come times `loss_scale`; `by_layer` when the
    /// plan's groups are layers (ZeRO-3), else model stages; `overlap` to keep the
    /// reduce-scatters in flight.
    pub fn new(
        plan: &'a ShardPlan,
        comm: &'a dyn Communicator,
        loss_scale: f64,
        (by_layer, overlap): (bool, bool),
    ) -> Self {
        Self {
            plan,
            comm,
            factor: 1.0 / loss_scale,
            sums: vec![None; plan.bucket_count()],
            present: BTreeSet::new(),
            by_layer,
            overlap,
            filling: BTreeMap::new(),
            flights: VecDeque::new(),
        }
    }

    /// Takes the gradients `grads` of `layers` for `buckets`; starts each bucket whose
    /// layers have all given theirs.
    fn add(&mut self, buckets: &[usize], layers: Range<usize>, grads: &Grads) -> Result<()> {
        let grads = to_master_grads(grads, self.factor)?;
        self.present.extend(grads.iter().map(|(n, _)| n.clone()));
        for &b in buckets {
            if !layers
                .clone()
                .any(|l| self.plan.bucket_layers(b).contains(&l))
            {
                continue;
            }
            // A layer giving again starts the next micro-batch: what the bucket holds goes first.
            let again =
                (self.filling.get(&b)).is_some_and(|(_, l)| layers.clone().any(|x| l.contains(&x)));
            if again {
                self.start(b)?;
            }
            let (held, given) = self.filling.entry(b).or_default();
            for (n, g) in grads.iter().filter(|(n, _)| self.plan.bucket_holds(b, n)) {
                held.insert(n.clone(), g.clone());
            }
            given.extend(layers.clone());
            if self.plan.bucket_layers(b).is_subset(given) {
                self.start(b)?;
            }
        }
        Ok(())
    }

    /// Starts the reduce-scatter of what bucket `b` holds (a parameter it lacks reads as
    /// zeros), making room first.
    fn start(&mut self, b: usize) -> Result<()> {
        let (held, _) = self.filling.remove(&b).unwrap_or_default();
        while self.flights.len() >= IN_FLIGHT {
            self.settle_oldest()?;
        }
        let get = |n: &str| held.get(n).cloned();
        let started = Instant::now();
        let shard = waited::waiting(|| self.plan.reduce_scatter(b, self.comm, get))?;
        self.flights.push_back((b, shard, started));
        if !self.overlap {
            self.settle_oldest()?;
        }
        Ok(())
    }

    /// Waits for the oldest reduce-scatter and adds its shard to its bucket's sum.
    fn settle_oldest(&mut self) -> Result<()> {
        let Some((b, shard, started)) = self.flights.pop_front() else {
            return Ok(());
        };
        let shard = waited::finish(shard, started, || format!("reduce-scatter bucket {b}"))?;
        self.sums[b] = Some(match self.sums[b].take() {
            Some(s) => (s + shard)?,
            None => shard,
        });
        Ok(())
    }

    /// Reduces `after` (the gradients the pipeline gave back: tied weights, summed between
    /// their stages, in the compute type and scaled) and returns this member's pieces of
    /// every gradient of the step.
    pub fn finish(mut self, after: &Grads) -> Result<Grads> {
        // A bucket some layer never gave to (none in a well-formed step) goes as it stands.
        let left: Vec<usize> = self.filling.keys().copied().collect();
        for b in left {
            self.start(b)?;
        }
        // Tied weights: final now, each bucket complete at once.
        for b in self.plan.buckets_of(AFTER_PIPELINE) {
            let layers = self.plan.bucket_layers(b);
            let (first, last) = (layers.first(), layers.last());
            let all = first.copied().unwrap_or(0)..last.map_or(0, |l| l + 1);
            self.add(&[b], all, after)?;
        }
        while !self.flights.is_empty() {
            self.settle_oldest()?;
        }
        let mut out = Grads::new();
        for (b, sum) in self.sums.iter().enumerate() {
            if let Some(sum) = sum {
                for (n, t) in self.plan.split_shard(b, sum)? {
                    if self.present.contains(&n) {
                        out.insert(n, t);
                    }
                }
            }
        }
        Ok(out)
    }
}

impl GradSink for ShardedGrads<'_> {
    fn take(&mut self, k: usize, layers: Range<usize>, grads: Grads) -> Result<Grads> {
        let (mut now, mut later) = (Grads::new(), Grads::new());
        for (n, g) in grads.iter() {
            if self.plan.in_group(n, AFTER_PIPELINE) {
                later.insert(n.clone(), g.clone());
            } else {
                now.insert(n.clone(), g.clone());
            }
        }
        let buckets: Vec<usize> = if self.by_layer {
            layers
                .clone()
                .flat_map(|l| self.plan.buckets_of(l))
                .collect()
        } else {
            self.plan.buckets_of(k)
        };
        self.add(&buckets, layers, &now)?;
        Ok(later)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    use super::*;
    use crate::distributed::comm::local;
    use crate::parallel::zero::ParamSpec;

    fn spec(name: &str, len: usize, layer: usize) -> ParamSpec {
        let (dims, group) = (vec![len], 0);
        let name = name.to_string();
        ParamSpec {
            name,
            dims,
            group,
            layer,
        }
    }

    /// One model stage of two layers, a bucket each: the last layer's bucket starts when its
    /// backward gives it, before the first layer's; at most [`IN_FLIGHT`] travel; the result
    /// is each member's shard of the sum over micro-batches and replicas, unscaled.
    #[test]
    fn a_bucket_starts_when_its_layers_have_given_their_gradients() {
        local::run(2, |c| {
            let params = [spec("a", 4, 0), spec("b", 6, 1)];
            let plan = ShardPlan::new(&params, 8, c.rank(), 2, Device::Cpu)?;
            assert_eq!(plan.bucket_count(), 2);
            let mut s = ShardedGrads::new(&plan, &c, 2.0, (false, true));
            let mut g = Grads::new();
            for micro_batch in 0..2 {
                for (n, len, layer) in [("b", 6, 1), ("a", 4, 0)] {
                    g.insert(
                        n,
                        Tensor::full(1f32 + micro_batch as f32, len, &Device::Cpu)?,
                    );
                    let mut one = Grads::new();
                    one.insert(n, g.get(n).unwrap().clone());
                    s.take(0, layer..layer + 1, one)?;
                    assert!(s.filling.is_empty(), "{n}'s bucket started at once");
                    assert!(s.flights.len() <= IN_FLIGHT);
                }
            }
            assert_eq!(s.flights.len(), IN_FLIGHT);
            let out = s.finish(&Grads::new())?;
            // (1 + 2) / 2 on each of 2 replicas.
            for (n, t) in out.iter() {
                let v: Vec<f32> = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
                assert!(v.iter().all(|x| *x == 3.0), "{n}: {v:?}");
            }
            assert_eq!(out.len(), 2, "each member holds a piece of a and of b");
            Ok(())
        })
        .unwrap();
    }
}
