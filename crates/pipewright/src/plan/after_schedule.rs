//! What each pipeline rank does once its schedule has run (the gradient sums over the
//! replicas, ZeRO's gathers, the optimizer) and what it holds at its peak; and how the
//! busiest rank's work splits between compute, memory and communication. Part of
//! [`super::estimate()`], which replays the schedule first.

use super::cluster::Cluster;
use super::hardware::Link;
use super::profile::Profile;
use super::rank_memory::{rank_live_bytes, state_bytes_per_param, StageBytes};
use crate::parallel::data_parallel::DEFAULT_BUCKET_BYTES;
use crate::parallel::overlap::FIRST_BUCKET_BYTES;
use crate::parallel::pipeline::timeline::Held;
use crate::parallel::pipeline::{Recompute, Sharing};
use crate::parallel::zero::Zero;
use crate::Result;

/// One model stage's costs for one micro-batch.
pub(super) struct StageCost {
    pub forward: f64,
    pub backward: f64,
    /// The split backward's input and weight parts (zero-bubble schedules).
    pub backward_input: f64,
    pub backward_weight: f64,
    pub params: f64,
    /// What it holds in memory.
    pub bytes: StageBytes,
    pub output: f64,
    /// Of forward and backward: seconds bound by the device's ceiling, by memory, and
    /// communicating (tp collectives, the ring).
    pub compute: f64,
    pub memory: f64,
    /// The communication (see [`StageCost::comm`]) by kind: tensor-parallel collectives (sequence parallelism's
    /// included), context parallelism's ring, expert parallelism's all-to-alls.
    pub comm_by: [f64; 3],
    /// The share of its forward's and of its backward's time it computes, as measured at its
    /// tp size (1 where unmeasured: computing throughout).
    pub busy: [f64; 2],
}

impl StageCost {
    /// Seconds communicating in its forward and backward (tp collectives, the ring, the
    /// all-to-alls).
    pub fn comm(&self) -> f64 {
        self.comm_by.iter().sum()
    }
}

/// The pipeline ranks of a candidate after the schedule.
pub(super) struct RankUpdate<'a> {
    pub cluster: &'a Cluster<'a>,
    pub profile: &'a Profile,
    /// Whether the schedule splits its backwards (zero-bubble: the weight passes queue).
    pub splits_backward: bool,
    /// Each rank's model stages ...
    pub rank_stages: &'a [Vec<usize>],
    /// ... and what it holds as its actions start, where its memory can peak (of
    /// [`crate::parallel::pipeline::timeline::held`], those no other exceeds).
    pub held: &'a [Vec<Held>],
    pub costs: &'a [StageCost],
    pub zero: Zero,
    pub recompute: Recompute,
    pub micro_batches: usize,
    pub virtual_stages: usize,
    /// The ranks that sum gradients and share ZeRO's pieces (the ring's too).
    pub replicas: usize,
    pub dp_link: &'a Link,
    /// Units of the profile each stage holds, in stage order ...
    pub balance: &'a [usize],
    /// ... and the rows of a micro-batch.
    pub rows: usize,
}

/// What [`RankUpdate::after`] finds.
pub(super) struct After {
    /// The longest gradient sum and update of any rank ...
    pub after: f64,
    /// ... and its communication.
    pub after_comm: f64,
    /// Pipeline rank 0's gradient sum and update ...
    pub first: (f64, f64),
    /// ... and its data-parallel communication costed whole (before what hides).
    pub first_whole: f64,
    /// The longest gradient sum of any rank.
    pub slowest_grads: f64,
    /// Each pipeline rank's peak bytes.
    pub peak_bytes: Vec<f64>,
}

impl RankUpdate<'_> {
    /// What of a rank's data-parallel communication `grads` (seconds, as costed after the
    /// schedule) is exposed when the runtime overlaps it
    /// ([`super::cluster::Runtime::overlap_grad_reduce`]), the rank's `stages` taking
    /// `backward` seconds a micro-batch over `bytes` of gradients: the sums as the buckets
    /// leave during the last backward ([`RankUpdate::sums_exposed`]); ZeRO-2's reduce-scatters
    /// behind every micro-batch's backward, the last bucket's still exposed (the weights'
    /// all-gather after the update stays whole). ZeRO-1's gather and ZeRO-3's gathers are not
    /// overlapped.
    fn exposed(&self, grads: f64, stages: &[usize], backward: f64, bytes: f64) -> f64 {
        let (dp, link) = (self.replicas, self.dp_link);
        let bucket = bytes.min(DEFAULT_BUCKET_BYTES as f64);
        match self.zero {
            _ if !self.cluster.runtime.overlap_grad_reduce || dp <= 1 => grads,
            Zero::Off => self.sums_exposed(stages),
            Zero::Gradients => {
                let gather = link.all_gather(dp, bytes);
                let scatters = grads - gather;
                let hidden = self.micro_batches as f64 * backward;
                let last = bucket.min(bytes / self.virtual_stages as f64);
                (scatters - hidden).max(link.all_gather(dp, last)) + gather
            }
            _ => grads,
        }
    }

    /// The sums' time past the end of the last micro-batch's backward over the rank's
    /// `stages`, as the runtime sends them (`parallel::overlap`): the backward finishes the
    /// layers last first, each taking its share of its stage's backward (by the profile's
    /// layer times) with its share of the stage's gradient bytes (by its parameters); a
    /// bucket leaves once it holds the runtime's bucket bytes (the step's first at most
    /// [`FIRST_BUCKET_BYTES`]), the link carrying one at a time; what is left leaves when the
    /// backward ends (the first layer's gradients, the tied embedding's among them).
    fn sums_exposed(&self, stages: &[usize]) -> f64 {
        let (dp, link) = (self.replicas, self.dp_link);
        let full = self.cluster.runtime.bucket_bytes;
        let (mut now, mut free, mut filled, mut first) = (0.0, 0.0_f64, 0.0, true);
        for &k in stages.iter().rev() {
            let start: usize = self.balance[..k].iter().sum();
            let layers = self.profile.unit_layers(start..start + self.balance[k]);
            let layer = |i: usize| &self.profile.layers[i];
            let time: f64 = layers
                .clone()
                .map(|i| layer(i).backward.at(self.rows))
                .sum();
            let params: f64 = layers.clone().map(|i| layer(i).params as f64).sum();
            let c = &self.costs[k];
            let bytes = c.params * self.cluster.runtime.grad_reduce_bytes;
            for i in layers.rev() {
                now += c.backward * layer(i).backward.at(self.rows) / time.max(f64::MIN_POSITIVE);
                filled += bytes * layer(i).params as f64 / params.max(1.0);
                let cap = if first {
                    full.min(FIRST_BUCKET_BYTES as f64)
                } else {
                    full
                };
                if filled >= cap {
                    free = free.max(now) + link.all_reduce(dp, filled);
                    (filled, first) = (0.0, false);
                }
            }
        }
        if filled > 0.0 {
            free = free.max(now) + link.all_reduce(dp, filled);
        }
        (free - now).max(0.0)
    }

    /// Every rank updates at once, after the step's scalar all-reduces: ranks that share cores
    /// share them while they update (`crowded`), and one with little to update (pp 4's
    /// embedding stage) leaves its share to the others (measured, pp 4: the two blocks'
    /// stages updated in 0.39-0.58 ms, where all four ranks crowding the cores had been
    /// charged 0.77).
    pub fn after(&self, crowded: Sharing) -> Result<After> {
        let (m, v, dp) = (self.micro_batches, self.virtual_stages, self.replicas);
        let pp = self.rank_stages.len();
        let dp_link = self.dp_link;
        let shards = if self.zero == Zero::Off { 1 } else { dp };
        let rank_params: Vec<f64> = (0..pp)
            .map(|r| {
                let stages = &self.rank_stages[r];
                stages.iter().map(|k| self.costs[*k].params).sum()
            })
            .collect();
        let alone: Vec<f64> = rank_params
            .iter()
            .map(|p| self.cluster.update_seconds(self.profile, p / shards as f64))
            .collect();
        let updates = crowded.finish_times(&alone);
        let mut a = After {
            after: 0.0,
            after_comm: 0.0,
            first: (0.0, 0.0),
            first_whole: 0.0,
            slowest_grads: 0.0,
            peak_bytes: Vec::with_capacity(pp),
        };
        for (r, held) in self.held.iter().enumerate() {
            let stages = &self.rank_stages[r];
            let mine: Vec<&StageCost> = stages.iter().map(|k| &self.costs[*k]).collect();
            let params = rank_params[r];
            let bytes = params * self.cluster.runtime.grad_reduce_bytes;
            // ZeRO-1 all-gathers the updated weights after the sum; ZeRO-2 reduce-scatters
            // every micro-batch's gradients instead of one sum (in the schedule, not
            // overlapped).
            let grads = match self.zero {
                _ if dp <= 1 => 0.0,
                Zero::Off => dp_link.all_reduce(dp, bytes),
                Zero::OptimizerState => {
                    dp_link.all_reduce(dp, bytes) + dp_link.all_gather(dp, bytes)
                }
                Zero::Gradients => {
                    (m * v) as f64 * dp_link.all_gather(dp, bytes / v as f64)
                        + dp_link.all_gather(dp, bytes)
                }
                // ZeRO-3: every micro-batch gathers the weights for its forward and again for
                // its backward, and reduce-scatters its gradients (in the schedule, not
                // overlapped).
                Zero::Parameters => 3.0 * (m * v) as f64 * dp_link.all_gather(dp, bytes / v as f64),
            };
            let optimizer = updates[r];
            let backward = mine.iter().map(|c| c.backward).sum::<f64>();
            let whole = grads;
            let grads = self.exposed(grads, stages, backward, bytes);
            if grads + optimizer > a.after {
                a.after = grads + optimizer;
                a.after_comm = grads;
            }
            if r == 0 {
                (a.first, a.first_whole) = ((grads, optimizer), whole);
            }
            a.slowest_grads = a.slowest_grads.max(grads);
            let bytes: Vec<&StageBytes> = mine.iter().map(|c| &c.bytes).collect();
            let state = state_bytes_per_param(self.zero, dp, m * v == 1);
            let zero3 = self.zero == Zero::Parameters && dp > 1;
            let split = self.splits_backward;
            let live = rank_live_bytes(&bytes, params, state, held, self.recompute, split, zero3);
            a.peak_bytes
                .push(self.cluster.hardware.runtime_bytes() as f64 + live);
        }
        Ok(a)
    }
}

/// The busiest pipeline rank's work over the schedule (each rank's model stages
/// `rank_stages`), split as its stages' costs are (compute, memory, then communication by
/// kind: tensor-parallel, ring, all-to-all; recomputed forwards counted as forwards).
pub(super) fn busiest_parts(
    rank_stages: &[Vec<usize>],
    costs: &[StageCost],
    m: usize,
    recomputes: &dyn Fn(usize) -> bool,
) -> [f64; 5] {
    let again = (0..m).filter(|&mb| recomputes(mb)).count() as f64;
    (rank_stages.iter())
        .map(|stages| {
            let mut p = [0.0; 5];
            for &k in stages {
                let c = &costs[k];
                let again = again * c.forward;
                let scale = (m as f64 * (c.forward + c.backward) + again)
                    / (c.compute + c.memory + c.comm()).max(f64::MIN_POSITIVE);
                p[0] += c.compute * scale;
                p[1] += c.memory * scale;
                for (i, kind) in c.comm_by.iter().enumerate() {
                    p[2 + i] += kind * scale;
                }
            }
            p
        })
        .fold([0.0; 5], |a, p| {
            if p.iter().sum::<f64>() > a.iter().sum() {
                p
            } else {
                a
            }
        })
}
