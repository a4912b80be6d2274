//! The two halves of [`Varuna::step`] that stand apart: this replica's gradients of the
//! batch (the pipeline's, unscaled to f32, summed over the replicas or sharded by ZeRO-2/3),
//! and what a step that overflowed does (skip it under loss scaling, else fail saying why).

use candle_core::{Device, Tensor};

use super::zero_groups::Replicas;
use super::{StepOutcome, Varuna};
use crate::distributed::comm::ReduceOp;
use crate::model::expert_load::{sort_by_layer, ExpertLoad};
use crate::model::nn::Grads;
use crate::model::precision::to_master_grads;
use crate::parallel::data_parallel::all_reduce_grads;
use crate::parallel::overlap::OverlappedSums;
use crate::parallel::pipeline::GradSink;
use crate::plan::{Part, PartClock};
use crate::{invalid, Batch, Error, Result};

impl Varuna {
    /// The loss of this rank's micro-batches and this replica's f32 gradients of `batch`
    /// over the global batch's `total` counted targets, computed at loss scale `scale`;
    /// `clock` laps the pipeline and the gradients' parts.
    pub(super) fn replica_grads(
        &mut self,
        batch: &Batch,
        total: usize,
        scale: f64,
        clock: &mut PartClock,
    ) -> Result<(f64, Grads)> {
        // ZeRO-2 and 3 reduce each micro-batch's gradients as the pipeline completes them.
        let experts = self.pipeline.experts().to_vec();
        let in_flight = self.opts.spec.overlap.overlap;
        let mut sharded = (self.zero().shards_grads())
            .then(|| self.weights.sharded())
            .flatten()
            .map(|z| {
                let c = Replicas::of(self.dp.as_ref(), self.expert_dp.as_deref());
                z.sink(c, (scale, in_flight), &experts)
            });
        // Without ZeRO's sharding, the sums over the replicas start during the backward
        // (unless a hook must see the gradients before they are summed).
        let micro_batches = self.pipeline.schedule().micro_batches;
        // (ZeRO-2/3, whose sink reduce-scatters, never overlap: `overlaps_grad_sums` says so.)
        let overlap = self.opts.spec.overlaps_grad_sums() && self.grad_hook.is_none();
        let mut overlapped = overlap.then(|| {
            let experts = self.expert_dp.as_deref().map(|c| (c, experts.as_slice()));
            let sizes = (scale, micro_batches, self.opts.spec.overlap.bucket_bytes);
            OverlappedSums::new(self.dp.as_ref(), experts, &self.opts.shared_weights, sizes)
        });
        let sink = match (sharded.as_mut(), overlapped.as_mut()) {
            (Some(s), _) => Some(s as &mut dyn GradSink),
            (None, Some(o)) => Some(o as &mut dyn GradSink),
            (None, None) => None,
        };
        let (loss, produced) = self
            .pipeline
            .loss_and_grads_into(batch, total, scale, sink)?;
        self.wall += clock.lap(Part::Pipeline);
        let events = self.pipeline.take_trace();
        self.busy += events
            .iter()
            .map(|e| (e.dur_us - e.wait_us).max(0.0) * 1e-6)
            .sum::<f64>();
        if let Some(t) = self.trace.as_mut() {
            t.extend(events);
        }
        let summed = sharded.is_some() || overlapped.is_some();
        let mut grads = match (sharded, overlapped) {
            (Some(s), _) => s.finish(&produced)?,
            (None, Some(o)) => o.finish(&produced)?,
            // f32 and unscaled in one pass (the scale is a power of two: exact).
            (None, None) => to_master_grads(&produced, 1.0 / scale)?,
        };
        // Freed as the sum replaces them, bucket by bucket, not held through the step.
        drop(produced);
        if let Some(hook) = self.grad_hook.as_mut() {
            hook(&mut grads);
        }
        if !summed {
            self.sum_over_replicas(&mut grads)?;
        }
        clock.lap(Part::Gradients);
        Ok((loss, grads))
    }

    /// Sums `grads` over the replicas: the experts' over the ranks holding the same experts
    /// (under expert parallelism), everything else over every replica.
    fn sum_over_replicas(&self, grads: &mut Grads) -> Result<()> {
        let bucket = self.opts.spec.overlap.bucket_bytes;
        let Some(expert_dp) = self.expert_dp.as_deref() else {
            return all_reduce_grads(grads, self.dp.as_ref(), bucket).map(drop);
        };
        let mut experts = Grads::new();
        for n in self.pipeline.experts() {
            if let Some(g) = grads.remove(n) {
                experts.insert(n.clone(), g);
            }
        }
        all_reduce_grads(grads, self.dp.as_ref(), bucket)?;
        all_reduce_grads(&mut experts, expert_dp, bucket)?;
        for (n, g) in experts.iter() {
            grads.insert(n.clone(), g.clone());
        }
        Ok(())
    }

    /// What every mixture of experts of the model routed in this step's forwards, summed over
    /// the replicas, layer by layer in model order, on every rank (collective over the world:
    /// one rank of each stage tells the others).
    pub(super) fn gather_expert_loads(&self) -> Result<Vec<ExpertLoad>> {
        let mut mine = self.pipeline.take_expert_loads();
        sort_by_layer(&mut mine);
        let flat: Vec<f64> = mine.iter().flat_map(ExpertLoad::flat).collect();
        if self.dp.size() > 1 && !flat.is_empty() {
            let t = Tensor::new(flat.as_slice(), &Device::Cpu)?;
            let sum = self.dp.all_reduce(&t, ReduceOp::Sum)?.to_vec1::<f64>()?;
            let mut at = 0;
            for l in &mut mine {
                let n = l.tokens.len() + 2;
                l.set_flat(&sum[at..at + n]);
                at += n;
            }
        }
        let c = self.coords;
        let speaks = c.dp_rank == 0 && c.cp_rank == 0 && c.tp_rank == 0;
        let said = if speaks {
            serde_json::to_vec(&mine).map_err(|e| invalid!("expert loads: {e}"))?
        } else {
            b"[]".to_vec()
        };
        let said = Tensor::new(said.as_slice(), &Device::Cpu)?;
        let heard = self.world.all_to_all(&vec![said; self.world.size()])?;
        let mut all = Vec::new();
        for h in heard {
            let loads: Vec<ExpertLoad> = serde_json::from_slice(&h.to_vec1::<u8>()?)
                .map_err(|e| invalid!("expert loads from another rank: {e}"))?;
            all.extend(loads);
        }
        sort_by_layer(&mut all);
        Ok(all)
    }

    /// A step whose gradients (or loss) overflowed: skipped with the loss scale lowered, or,
    /// without loss scaling or once the scaler says the run diverged, an error.
    pub(super) fn after_overflow(&mut self, outcome: StepOutcome) -> Result<StepOutcome> {
        let (step, loss) = (outcome.step, outcome.loss);
        match self.scaler.as_mut() {
            Some(s) => {
                s.update(true);
                match s.diverged() {
                    Some(why) => Err(invalid!("f16 training stopped at step {}: {why}", step + 1)),
                    None => Ok(outcome),
                }
            }
            // Steps count from 1 (`step` is how many were taken before this one).
            None if !loss.is_finite() => Err(Error::NonFiniteLoss {
                step: step + 1,
                loss,
            }),
            None => Err(invalid!(
                "a gradient is inf or NaN at step {} ({} has no loss scaling to skip it): lower \
                 the learning rate or enable clipping",
                step + 1,
                self.opts.spec.precision
            )),
        }
    }
}
