//! Predicting one layout's training step from a [`Profile`] and a [`Hardware`](super::Hardware) description:
//! the layers balanced over the model stages by time, the schedule's action lists replayed by
//! the simulator with every stage's own durations and the links' delays, then the
//! data-parallel gradient all-reduce and the optimizer; and each pipeline rank's peak memory
//! (parameters with their gradients and optimizer state, the activations and stage inputs of
//! the micro-batches in flight under the recompute mode, and one backward's gradients).

use std::fmt;

use serde::Serialize;

use super::balance::{balance_cost, even_blocks};
use super::balance_ranks::balance_v;
use super::bound::{Bound, Breakdown};
use super::cluster::Cluster;
use super::context_parallel as cp_cost;
use super::profile::{Fit, Profile};
use super::shapes::ShapeCost;
use crate::dist::topology::Layout;
use crate::parallel::pipeline::schedule::{Action, Schedule, ScheduleKind};
use crate::parallel::pipeline::timeline::Simulation;
use crate::parallel::pipeline::{Recompute, Sharing};
use crate::parallel::zero::Zero;
use crate::Result;

use super::after_schedule::{busiest_parts, After, RankUpdate, StageCost};
use super::rank_memory::StageBytes;
pub use super::rank_memory::{
    state_bytes_per_param, BACKWARD_EXTRA_SHARE, FIRST_BACKWARD_BYTES_PER_PARAM, RANK_BYTES,
    STATE_BYTES_PER_PARAM, ZERO3_LAYER_COPIES,
};
use super::step_parts::StepParts;

/// One point of the search: a layout and how its batch is cut and scheduled.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Candidate {
    /// The pp x tp x dp layout.
    pub layout: Layout,
    /// Rows of one micro-batch.
    pub micro_batch: usize,
    /// Micro-batches per data-parallel replica (`chunks`).
    pub micro_batches: usize,
    /// The pipeline schedule.
    #[serde(serialize_with = "display")]
    pub schedule: ScheduleKind,
    /// Model stages per pipeline rank (interleaved).
    pub virtual_stages: usize,
    /// The recompute mode.
    #[serde(serialize_with = "display")]
    pub recompute: Recompute,
    /// What the data-parallel replicas shard.
    #[serde(serialize_with = "display")]
    pub zero: Zero,
    /// Megatron's sequence parallelism (with tp > 1).
    pub sequence_parallel: bool,
}

fn display<T: fmt::Display, S: serde::Serializer>(
    v: &T,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    s.collect_str(v)
}

/// A predicted step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Estimate {
    /// What was estimated.
    pub candidate: Candidate,
    /// Units (layers or segments) of each model stage.
    pub balance: Vec<usize>,
    /// Seconds of one training step.
    pub step_s: f64,
    /// Idle share of the pipeline ranks' time in the schedule.
    pub bubble: f64,
    /// Peak bytes of each pipeline rank.
    pub peak_bytes: Vec<f64>,
    /// Where the slowest pipeline rank's step goes.
    pub breakdown: Breakdown,
    /// The step's parts as [`crate::engine::varuna::Varuna::step`] times them on rank 0 (they sum to
    /// `step_s`; another stage's longer update is waited for in rank 0's next schedule).
    pub parts: StepParts,
    /// Model FLOPs utilisation: the model's forward and backward FLOPs (no recomputation) per
    /// step over the step time and every rank's peak, when the profile knows its FLOPs (a
    /// model planned from its shapes).
    pub mfu: Option<f64>,
}

impl Estimate {
    /// The largest peak of any rank.
    pub fn max_peak_bytes(&self) -> f64 {
        self.peak_bytes.iter().copied().fold(0.0, f64::max)
    }

    /// What bounds the step: the largest part of its breakdown.
    pub fn bound(&self) -> Bound {
        self.breakdown.bound()
    }
}

/// Each layer's cost by shape for a micro-batch of `rows` under `cand` (`None` for a measured
/// layer), costed once per distinct layer: a model's blocks are alike.
fn shape_costs(p: &Profile, c: &Cluster, cand: &Candidate, rows: usize) -> Vec<Option<ShapeCost>> {
    let Layout { tp, cp, .. } = cand.layout;
    let sp = cand.sequence_parallel && tp > 1;
    let curve = c.hardware.gemm(p.dtype_bytes == 2);
    let mut out: Vec<Option<ShapeCost>> = Vec::with_capacity(p.layers.len());
    for (i, l) in p.layers.iter().enumerate() {
        let alike = i > 0 && {
            let prev = &p.layers[i - 1];
            prev.shapes == l.shapes && prev.attention == l.attention && prev.tp_split == l.tp_split
        };
        let k = if alike {
            out[i - 1]
        } else {
            l.shapes.as_ref().map(|shapes| {
                shapes.cost(
                    l.attention.as_ref(),
                    &curve,
                    c.hardware.memory_bandwidth_bytes_per_s,
                    rows,
                    if l.tp_split { tp } else { 1 },
                    cp,
                    sp,
                )
            })
        };
        out.push(k);
    }
    out
}

/// The costs of model stage layers `layers` for one micro-batch of `rows` under `cand`'s tp,
/// cp and sequence parallelism (see [`super::context_parallel`]); `shaped` holds each layer's cost by
/// shape ([`shape_costs`]).
fn stage_cost(
    p: &Profile,
    c: &Cluster,
    cand: &Candidate,
    rows: usize,
    units: std::ops::Range<usize>,
    shaped: &[Option<ShapeCost>],
) -> StageCost {
    let Layout { tp, cp, ep, .. } = cand.layout;
    let sp = cand.sequence_parallel && tp > 1;
    let layers = p.unit_layers(units);
    let tp_link = c.link(tp);
    let ring_link = c.link(tp * cp);
    // An expert group: ep neighbouring replicas, tp * cp ranks apart.
    let ep_link = c.link(tp * cp * ep);
    // This rank's share of every token-wise cost, and of what crosses a cut.
    let share = cp_cost::share(cp);
    let cut = share / if sp { tp as f64 } else { 1.0 };
    let threads = c.thread_ratio(p.threads);
    let slow = threads * share;
    let mut s = StageCost {
        compute: 0.0,
        memory: 0.0,
        comm: 0.0,
        forward: 0.0,
        backward: 0.0,
        backward_input: 0.0,
        backward_weight: 0.0,
        params: 0.0,
        bytes: StageBytes::new(if layers.start == 0 {
            0.0
        } else {
            p.layers[layers.start - 1].output_bytes_per_sample * rows as f64 * cut
        }),
        output: p.layers[layers.end - 1].output_bytes_per_sample * rows as f64 * cut,
        busy: match tp {
            1 => [1.0; 2],
            _ => p.busy_share(tp, rows, layers.clone()).unwrap_or([1.0; 2]),
        },
    };
    for (l, shape) in p.layers[layers.clone()].iter().zip(&shaped[layers]) {
        let r = rows as f64;
        let t = if l.tp_split { tp as f64 } else { 1.0 };
        let before = s.params;
        // Sequence parallelism's reduce-scatter and all-gather move an all-reduce's bytes.
        let comm = if l.tp_split && tp > 1 {
            tp_link.all_reduce(tp, l.tp_all_reduce_bytes_per_sample * r * share)
        } else {
            0.0
        };
        // A shard measured at this tp size (a measured profile's), else the layer's own costs.
        let measured = l
            .split
            .iter()
            .find(|m| m.tp == tp)
            .filter(|_| shape.is_none());
        if let Some(m) = measured {
            // Measured at this tp size: the shard's own times, its collectives included.
            s.forward += m.forward.at(rows) * slow;
            s.backward += m.backward.at(rows) * slow;
            s.backward_input += m.backward_input.at(rows) * slow;
            s.backward_weight += m.backward_weight.at(rows) * slow;
            s.params += m.params as f64;
            s.compute += (m.forward.at(rows) + m.backward.at(rows)) * slow;
        } else {
            // Forward, full backward, its input and weight parts, and of forward and backward
            // the seconds at the ceiling and bound by memory: from the shapes (costed at this
            // tp, cp and micro-batch on the device's curve) or the fitted times.
            let (f, b, i, w, compute, memory) = match shape {
                Some(k) => {
                    let (i, w) = (k.backward_input * threads, k.backward_weight * threads);
                    let f = k.forward * threads;
                    (f, i + w, i, w, k.compute * threads, k.memory * threads)
                }
                None => {
                    let b = l.backward.at(rows);
                    let part = |f: Option<Fit>| f.map_or(b / 2.0, |f| f.at(rows)) / t * slow;
                    let (f, b) = (l.forward.at(rows) / t * slow, b / t * slow);
                    let (i, w) = (part(l.backward_input), part(l.backward_weight));
                    (f, b, i, w, f + b, 0.0)
                }
            };
            s.forward += f + comm;
            s.backward += b + comm;
            s.backward_input += i + comm;
            s.backward_weight += w;
            s.compute += compute;
            s.memory += memory;
            s.comm += 2.0 * comm;
            s.params += l.params as f64 / t;
        }
        if let Some(x) = &l.experts {
            // This rank holds 1/ep of the experts, and exchanges its tokens' rows with the
            // group's ranks in the forward and again in the backward.
            s.params -= x.params / t * (1.0 - 1.0 / ep as f64);
            let a2a = 2.0 * ep_link.all_to_all(ep, x.all_to_all * r * share / 2.0);
            s.forward += a2a;
            s.backward += a2a;
            s.backward_input += a2a;
            s.comm += 2.0 * a2a;
        }
        s.bytes.largest = s.bytes.largest.max(s.params - before);
        if let Some(a) = &l.attention {
            let (f, b) = cp_cost::ring_seconds(a, rows, tp, cp, ring_link);
            s.forward += f;
            s.backward += b;
            s.backward_input += b;
            s.comm += f + b;
            s.bytes.working =
                s.bytes
                    .working
                    .max(cp_cost::working_bytes(a, rows, tp, cp, p.dtype_bytes));
        }
        let measured = l.split.iter().find(|m| m.tp == tp);
        s.bytes.add(l, measured, tp, sp, r * share);
    }
    s
}

/// The model's units balanced over `stages` model stages by their time (a V's by its ranks'
/// summed time; or in even blocks, as the runtime asks), with each stage's costs for a
/// micro-batch of `rows`.
fn balanced_stages(
    profile: &Profile,
    cluster: &Cluster,
    cand: &Candidate,
    rows: usize,
    stages: usize,
) -> Result<(Vec<usize>, Vec<StageCost>)> {
    let units = profile.units();
    let shaped = shape_costs(profile, cluster, cand, rows);
    let unit_time: Vec<f64> = (0..units)
        .map(|u| {
            let s = stage_cost(profile, cluster, cand, rows, u..u + 1, &shaped);
            s.forward + s.backward
        })
        .collect();
    let balance = if cluster.runtime.even_blocks {
        even_blocks(units, stages)?
    } else if cand.schedule.is_v() {
        balance_v(&unit_time, stages / 2)?
    } else {
        balance_cost(&unit_time, stages)?
    };
    let mut start = 0;
    let costs: Vec<StageCost> = balance
        .iter()
        .map(|&n| {
            let c = stage_cost(profile, cluster, cand, rows, start..start + n, &shaped);
            start += n;
            c
        })
        .collect();
    Ok((balance, costs))
}

/// How the ranks sharing the cores progress: the crowded sharing of `pp` stages, and what the
/// schedule's simulation uses (with tp > 1, by the measured busy share).
fn sharing(
    profile: &Profile,
    cluster: &Cluster,
    pp: usize,
    tp: usize,
    rows: usize,
) -> (Sharing, Sharing) {
    // Tensor-parallel ranks crowding the cores lose no speed in their layers while one stage is
    // busy: what switching costs, the waits in their collectives give back (measured here: tp 2 x
    // dp 2 took 1.86-2.05 times tp 2 alone, as fluid sharing says: 2). While stages run at once,
    // out of step, one's waits are another's time to compute: each progresses at its share of the
    // cores over the share of its time it computes, as measured, at the crowded efficiency (traced
    // here, pp 2 x tp 2: two stages' forwards of 216 us of CPU on each of four ranks ran side by
    // side in 460 us on two cores). The share is each stage's in each pass: a stage holding the
    // vocabulary-parallel head (busy 0.26 of its time against 0.87 for a block) runs its actions
    // the faster (traced, pp 2 x tp 2: each stage's forward took its CPU time over half a core, 264
    // and 303 us in 531 and 613, where the stages' work at full speed was 349 and 419 us).
    let crowded = cluster.sharing(pp, profile.crowded_efficiency);
    let measured = profile
        .busy_share(tp, rows, 0..profile.layers.len())
        .is_some();
    let sharing = match (tp, measured) {
        (1, _) => crowded,
        (_, measured) => Sharing {
            crowded: 1.0,
            across: if measured { crowded.crowded } else { 1.0 },
            ..crowded
        },
    };
    (crowded, sharing)
}

/// Predicts `cand`'s step for `profile` on `cluster`; also returns the simulated schedule
/// (its spans in seconds, for drawing).
pub fn estimate(
    profile: &Profile,
    cluster: &Cluster,
    cand: &Candidate,
) -> Result<(Estimate, Simulation)> {
    let Layout { pp, tp, .. } = cand.layout;
    // The ranks that sum gradients and share ZeRO's pieces: a replica's ring and the replicas.
    let replicas = cand.layout.replicas();
    let v = cand.schedule.stages_per_rank(cand.virtual_stages);
    let (m, rows) = (cand.micro_batches, cand.micro_batch);
    let stages = pp * v;
    let (balance, costs) = balanced_stages(profile, cluster, cand, rows, stages)?;
    let recomputes = |mb: usize| !cand.recompute.keeps(mb, m);
    // Each backward after a stage's first micro-batch adds its weight gradients into the
    // step's running sum (ZeRO-2/3: into this replica's pieces), timed by a measured profile.
    let pieces = if cand.zero.shards_grads() {
        replicas
    } else {
        1
    };
    let sums: Vec<f64> = costs
        .iter()
        .map(|c| {
            profile.accumulate.map_or(0.0, |f| {
                f.at((c.params / pieces as f64) as usize) * cluster.thread_ratio(profile.threads)
            })
        })
        .collect();
    let sum_grads = |k: usize, a: &Action| if a.mb() > 0 { sums[k] } else { 0.0 };
    // Each forward and backward also pays the executor's bookkeeping beyond its layers, as a
    // measured profile timed it (`plan::action_cost`), one stage or many.
    let (f_over, b_over) = profile
        .action_overhead
        .map_or((0.0, 0.0), |o| (o.forward_s, o.backward_s));
    let cost = |k: usize, a: &Action| {
        let c = &costs[k];
        let again = if recomputes(a.mb()) { c.forward } else { 0.0 };
        match a {
            Action::Forward { .. } => c.forward + f_over,
            Action::Backward { .. } => c.backward + again + sum_grads(k, a) + b_over,
            Action::BackwardInput { .. } => c.backward_input + again + b_over,
            Action::BackwardWeight { .. } => c.backward_weight + sum_grads(k, a),
        }
    };
    let pp_link = cluster.link(pp * tp * replicas);
    // Scatter/gather: each tp rank sends 1/tp of the output, the receivers all-gather it.
    let transfer = |from: usize, to: usize| {
        let out = costs[from.min(to)].output;
        if cluster.runtime.scatter_gather && tp > 1 {
            pp_link.p2p(out / tp as f64) + cluster.link(tp).all_gather(tp, out)
        } else {
            pp_link.p2p(out)
        }
    };
    let (crowded, sharing) = sharing(profile, cluster, pp, tp, rows);
    // Each action computes its stage's measured share of its pass's time.
    let busy = |k: usize, a: &Action| match a {
        Action::Forward { .. } => costs[k].busy[0],
        _ => costs[k].busy[1],
    };
    let schedule = Schedule::new(cand.schedule, pp, m, v)?;
    let sim = schedule.simulate_with(&cost, &transfer, sharing, &busy)?;
    let hw = cluster.hardware;
    let dp_link = cluster.link(tp * replicas);
    let ranks = RankUpdate {
        cluster,
        profile,
        schedule: &schedule,
        costs: &costs,
        zero: cand.zero,
        recompute: cand.recompute,
        micro_batches: m,
        virtual_stages: v,
        replicas,
        dp_link: &dp_link,
        balance: &balance,
        rows,
    };
    let a: After = ranks.after(crowded)?;
    let (after, after_comm, first) = (a.after, a.after_comm, a.first);
    let parts = busiest_parts(&schedule, &costs, m, &recomputes);
    // The step's scalar all-reduces: the counted targets and the loss over the replicas, the
    // batch's loss (only the last stage computed it) and the norm's squares over the pipeline,
    // the overflow flag over the world, the norm's over the tensor-parallel group (and over the
    // replicas' pieces under ZeRO-2/3). Latency, one after another.
    let world = cand.layout.world();
    let scalars = (2 + usize::from(pieces > 1)) as f64 * dp_link.scalar_all_reduce(replicas)
        + cluster.link(world).scalar_all_reduce(world)
        + pp_link.scalar_all_reduce(pp);
    // The norm's, timed as part of the update.
    let norm = pp_link.scalar_all_reduce(pp) + cluster.link(tp).scalar_all_reduce(tp);
    let step_s = sim.makespan + after + scalars + norm;
    let step_parts =
        StepParts::of_rank_zero(step_s, first.0, first.1 + norm, scalars, a.slowest_grads);
    let (after, after_comm) = (after + scalars + norm, after_comm + scalars + norm);
    let breakdown = Breakdown::of(parts, sim.makespan, sim.bubble, after, after_comm);
    let samples = (rows * m * cand.layout.dp) as f64;
    let peak = hw.peak_flops(profile.dtype_bytes == 2) * cand.layout.world() as f64;
    let mfu = profile
        .flops_per_sample()
        .map(|f| 3.0 * f * samples / step_s / peak);
    Ok((
        Estimate {
            candidate: *cand,
            balance,
            step_s,
            bubble: sim.bubble,
            peak_bytes: a.peak_bytes,
            breakdown,
            parts: step_parts,
            mfu,
        },
        sim,
    ))
}
