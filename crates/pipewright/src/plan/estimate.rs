//! Predicting one layout's training step from a [`Profile`] and a [`Hardware`](super::Hardware) description:
//! the layers balanced over the model stages by time, the schedule's action lists replayed by
//! the simulator with every stage's own durations and the links' delays, then the
//! data-parallel gradient all-reduce and the optimizer; and each pipeline rank's peak memory
//! (parameters with their gradients and optimizer state, the activations and stage inputs of
//! the micro-batches in flight under the recompute mode, and one backward's gradients).

use std::rc::Rc;

use serde::Serialize;

use super::bound::{Bound, Breakdown, Explanation};
use super::cluster::Cluster;
use super::memo::{Memo, ReplayKey, Replayed, Staged, StagesKey};
use super::profile::Profile;
use super::stage_cost::balanced_stages;
use crate::distributed::topology::Layout;
use crate::parallel::pipeline::schedule::{Action, Schedule};
use crate::parallel::pipeline::timeline::Simulation;
use crate::parallel::pipeline::Sharing;
use crate::Result;

use super::after_schedule::{busiest_parts, After, RankUpdate, StageCost};
pub use super::candidate::Candidate;
pub use super::rank_memory::{
    state_bytes_per_param, BACKWARD_EXTRA_SHARE, FIRST_BACKWARD_BYTES_PER_PARAM, RANK_BYTES,
    STATE_BYTES_PER_PARAM, ZERO3_LAYER_COPIES,
};
use super::step_parts::StepParts;

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
    /// Where the step goes, part by part (`plan --explain`).
    pub explained: Explanation,
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
    let mut memo = Memo::default();
    let (e, replayed) = estimate_with(profile, cluster, cand, &mut memo)?;
    drop(memo);
    let sim = Rc::try_unwrap(replayed).map_or_else(|r| r.sim.clone(), |r| r.sim);
    Ok((e, sim))
}

/// A floor under `cand`'s predicted step, from its stages alone (no replay), the larger of
/// two: the pipeline ranks' actions over all micro-batches spread evenly over the ranks (no
/// rank computes less than the average), and for each stage, after the first micro-batch's
/// forwards through the stages before it, its own actions, or its forwards and input passes
/// and then the last micro-batch's input passes back through the stages before it (chains no
/// schedule shortens; a split backward's weight passes may run beside that tail). Actions take
/// at least their costs, so the step is at least this; a search skips the replay of a
/// candidate whose floor is above its slowest kept.
pub(super) fn step_floor(
    profile: &Profile,
    cluster: &Cluster,
    cand: &Candidate,
    memo: &mut Memo,
) -> Result<f64> {
    let pp = cand.parallel.layout.pp;
    let v = cand.schedule.stages_per_rank();
    let m = cand.micro_batches;
    let staged = staged(profile, cluster, cand, pp * v, memo)?;
    let again = (0..m)
        .filter(|&mb| !cand.schedule.recompute.keeps(mb, m))
        .count() as f64;
    let (mut total, mut chain, mut forwards, mut inputs) = (0.0, 0.0_f64, 0.0, 0.0);
    let m = m as f64;
    for c in &staged.costs {
        // The input gradients' pass, whole or split (zero-bubble: the weights' can wait).
        let input = c.backward.min(c.backward_input);
        let own = m * (c.forward + c.backward.min(c.backward_input + c.backward_weight));
        total += own + again * c.forward;
        let through = m * (c.forward + input) + again * c.forward + inputs;
        chain = chain.max(forwards + (own + again * c.forward).max(through));
        forwards += c.forward;
        inputs += input;
    }
    Ok((total / pp as f64).max(chain))
}

/// `cand`'s units balanced over `stages` model stages with each stage's costs, kept in `memo`.
fn staged(
    profile: &Profile,
    cluster: &Cluster,
    cand: &Candidate,
    stages: usize,
    memo: &mut Memo,
) -> Result<Rc<Staged>> {
    memo.staged(StagesKey::of(cand, stages), || {
        let rows = cand.micro_batch;
        let (balance, costs) = balanced_stages(profile, cluster, cand, rows, stages)?;
        Ok(Staged { balance, costs })
    })
}

/// [`estimate`], with what consecutive candidates of a search share kept in `memo`
/// ([`super::memo`]).
pub(super) fn estimate_with(
    profile: &Profile,
    cluster: &Cluster,
    cand: &Candidate,
    memo: &mut Memo,
) -> Result<(Estimate, Rc<Replayed>)> {
    let Layout { pp, tp, .. } = cand.parallel.layout;
    // The ranks that sum gradients and share ZeRO's pieces: a replica's ring and the replicas.
    let replicas = cand.parallel.layout.replicas();
    let v = cand.schedule.stages_per_rank();
    let (m, rows) = (cand.micro_batches, cand.micro_batch);
    let stages = pp * v;
    let staged = staged(profile, cluster, cand, stages, memo)?;
    let (balance, costs) = (&staged.balance, &staged.costs);
    let recomputes = |mb: usize| !cand.schedule.recompute.keeps(mb, m);
    // Each backward after a stage's first micro-batch adds its weight gradients into the
    // step's running sum (ZeRO-2/3: into this replica's pieces).
    let pieces = if cand.parallel.zero.shards_grads() {
        replicas
    } else {
        1
    };
    let (crowded, _) = sharing(profile, cluster, pp, tp, rows);
    let key = ReplayKey {
        stages: StagesKey::of(cand, stages),
        pp,
        replicas,
        schedule: cand.schedule.kind,
        micro_batches: m,
        virtual_stages: v,
        recompute: cand.schedule.recompute,
        // Only a measured accumulation times the pieces.
        pieces: if profile.accumulate.is_some() {
            pieces
        } else {
            1
        },
    };
    let replayed = memo.replayed(key, || replay(profile, cluster, cand, costs, pieces))?;
    let pp_link = cluster.link(pp * tp * replicas);
    let sim = &replayed.sim;
    let hw = cluster.hardware;
    let dp_link = cluster.link(tp * replicas);
    let ranks = RankUpdate {
        cluster,
        profile,
        splits_backward: replayed.splits_backward,
        rank_stages: &replayed.stages,
        held: &replayed.held,
        costs,
        zero: cand.parallel.zero,
        recompute: cand.schedule.recompute,
        micro_batches: m,
        virtual_stages: v,
        replicas,
        dp_link: &dp_link,
        balance,
        rows,
    };
    let a: After = ranks.after(crowded)?;
    let (after, after_comm, first) = (a.after, a.after_comm, a.first);
    let parts = busiest_parts(&replayed.stages, costs, m, &recomputes);
    // The step's scalar all-reduces: the counted targets and the loss over the replicas, the
    // batch's loss (only the last stage computed it) and the norm's squares over the pipeline,
    // the overflow flag over the world, the norm's over the tensor-parallel group (and over the
    // replicas' pieces under ZeRO-2/3). Latency, one after another.
    let world = cand.parallel.layout.world();
    let scalars = (2 + usize::from(pieces > 1)) as f64 * dp_link.scalar_all_reduce(replicas)
        + cluster.link(world).scalar_all_reduce(world)
        + pp_link.scalar_all_reduce(pp);
    // The norm's, timed as part of the update.
    let norm = pp_link.scalar_all_reduce(pp) + cluster.link(tp).scalar_all_reduce(tp);
    let step_s = sim.makespan + after + scalars + norm;
    let step_parts =
        StepParts::of_rank_zero(step_s, first.0, first.1 + norm, scalars, a.slowest_grads);
    let (after, after_comm) = (after + scalars + norm, after_comm + scalars + norm);
    let explained = Explanation::of(
        parts,
        (sim.makespan, sim.bubble),
        (a.first_whole, first.0),
        scalars,
        first.1 + norm,
    );
    let breakdown = Breakdown::of(&explained, after, after_comm);
    let samples = (rows * m * cand.parallel.layout.dp) as f64;
    let peak = hw.peak_flops(profile.dtype_bytes == 2) * cand.parallel.layout.world() as f64;
    let mfu = profile
        .flops_per_sample()
        .map(|f| 3.0 * f * samples / step_s / peak);
    Ok((
        Estimate {
            candidate: *cand,
            balance: balance.clone(),
            step_s,
            bubble: sim.bubble,
            peak_bytes: a.peak_bytes,
            breakdown,
            parts: step_parts,
            explained,
            mfu,
        },
        replayed.clone(),
    ))
}

/// `cand`'s schedule replayed with its stages' `costs` (each backward after a stage's first
/// micro-batch adding its gradients into `pieces` pieces, timed by a measured profile), and
/// what each rank holds as each action starts.
fn replay(
    profile: &Profile,
    cluster: &Cluster,
    cand: &Candidate,
    costs: &[StageCost],
    pieces: usize,
) -> Result<Replayed> {
    let Layout { pp, tp, .. } = cand.parallel.layout;
    let replicas = cand.parallel.layout.replicas();
    let v = cand.schedule.stages_per_rank();
    let (m, rows) = (cand.micro_batches, cand.micro_batch);
    let recomputes = |mb: usize| !cand.schedule.recompute.keeps(mb, m);
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
    let (_, sharing) = sharing(profile, cluster, pp, tp, rows);
    // Each action computes its stage's measured share of its pass's time.
    let busy = |k: usize, a: &Action| match a {
        Action::Forward { .. } => costs[k].busy[0],
        _ => costs[k].busy[1],
    };
    let schedule = Schedule::new(cand.schedule.kind, pp, m, v)?;
    let sim = schedule.simulate_with(&cost, &transfer, sharing, &busy)?;
    Ok(Replayed::new(&schedule, sim))
}
