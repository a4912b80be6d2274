//! [`ShardedGrads`]: ZeRO-2's gradients. Each micro-batch's gradients of a model stage are
//! reduce-scattered over the data-parallel group as soon as the schedule completes them, and
//! each member keeps only the running sum of its shards; tied weights, whose gradients are
//! summed between their stages when the batch ends, are reduce-scattered then. Under ZeRO-3
//! the plan's groups are layers, and each layer's gradients are reduce-scattered as soon as
//! its own backward gives them.

use std::collections::BTreeSet;
use std::ops::Range;

use candle_core::Tensor;

use super::plan::ShardPlan;
use crate::dist::comm::Communicator;
use crate::model::grads::Grads;
use crate::model::precision::to_master_grads;
use crate::parallel::pipeline::GradSink;
use crate::Result;

/// The group tag of the parameters reduced after the pipeline (tied weights).
pub const AFTER_PIPELINE: usize = usize::MAX;

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
}

impl<'a> ShardedGrads<'a> {
    /// Empty sums for one step whose gradients come times `loss_scale`; `by_layer` when the
    /// plan's groups are layers (ZeRO-3), else model stages.
    pub fn new(
        plan: &'a ShardPlan,
        comm: &'a dyn Communicator,
        loss_scale: f64,
        by_layer: bool,
    ) -> Self {
        Self {
            plan,
            comm,
            factor: 1.0 / loss_scale,
            sums: Vec::new(),
            present: BTreeSet::new(),
            by_layer,
        }
    }

    fn add(&mut self, buckets: &[usize], grads: &Grads) -> Result<()> {
        let grads = to_master_grads(grads, self.factor)?;
        self.present.extend(grads.iter().map(|(n, _)| n.clone()));
        if self.sums.is_empty() {
            self.sums = vec![None; self.plan.bucket_count()];
        }
        for &b in buckets {
            let shard = self
                .plan
                .reduce_scatter(b, self.comm, |n| grads.get(n).cloned())?;
            self.sums[b] = Some(match self.sums[b].take() {
                Some(s) => (s + shard)?,
                None => shard,
            });
        }
        Ok(())
    }

    /// Reduces `after` (the gradients the pipeline gave back: tied weights, summed between
    /// their stages, in the compute type and scaled) and returns this member's pieces of
    /// every gradient of the step.
    pub fn finish(mut self, after: &Grads) -> Result<Grads> {
        let tied = self.plan.buckets_of(AFTER_PIPELINE);
        self.add(&tied, after)?;
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
        let buckets = if self.by_layer {
            layers.flat_map(|l| self.plan.buckets_of(l)).collect()
        } else {
            self.plan.buckets_of(k)
        };
        self.add(&buckets, &now)?;
        Ok(later)
    }
}
