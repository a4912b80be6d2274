//! What a search's candidates share, costed once. A candidate's stages (the units balanced
//! over them and each stage's costs) depend on its tp, cp, ep, sequence parallelism,
//! micro-batch rows and stage count, not on its ZeRO stage, recomputation or micro-batch
//! count; its replayed schedule depends on those and the schedule, not on its ZeRO stage
//! (but for the gradient pieces a measured accumulation times). The search enumerates the
//! candidates of one layout and micro-batch together, ZeRO innermost
//! ([`super::search::candidates`]), so [`Memo`] keeps the stages of the current layout and
//! micro-batch only and the last replay only: bounded memory, and the same numbers as costing
//! each candidate afresh (the keys hold everything the costs read).

use std::rc::Rc;

use super::after_schedule::StageCost;
use super::candidate::Candidate;
use crate::parallel::pipeline::schedule::{Schedule, ScheduleKind};
use crate::parallel::pipeline::timeline::{self, Held, Simulation};
use crate::parallel::pipeline::Recompute;
use crate::Result;

/// What a candidate's stages depend on, beyond the profile and cluster of the search.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct StagesKey {
    tp: usize,
    cp: usize,
    ep: usize,
    sequence_parallel: bool,
    rows: usize,
    stages: usize,
    /// A V schedule balances by its ranks' summed time.
    v_shape: bool,
}

impl StagesKey {
    /// `cand`'s key at `stages` model stages.
    pub fn of(cand: &Candidate, stages: usize) -> Self {
        Self {
            tp: cand.parallel.layout.tp,
            cp: cand.parallel.layout.cp,
            ep: cand.parallel.layout.ep,
            sequence_parallel: cand.parallel.splits_sequence(),
            rows: cand.micro_batch,
            stages,
            v_shape: cand.schedule.kind.is_v(),
        }
    }

    /// Whether `other` is of the same layout and micro-batch (stages and schedule aside).
    fn same_group(&self, other: &Self) -> bool {
        (self.tp, self.cp, self.ep, self.sequence_parallel, self.rows)
            == (
                other.tp,
                other.cp,
                other.ep,
                other.sequence_parallel,
                other.rows,
            )
    }
}

/// What a candidate's replayed schedule depends on, beyond its stages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct ReplayKey {
    pub stages: StagesKey,
    pub pp: usize,
    /// The replicas (their span sets the pipeline's link).
    pub replicas: usize,
    pub schedule: ScheduleKind,
    pub micro_batches: usize,
    pub virtual_stages: usize,
    pub recompute: Recompute,
    /// The pieces each backward adds its gradients into (ZeRO-2/3: the replicas').
    pub pieces: usize,
}

/// The units of each model stage and each stage's costs for one micro-batch.
pub(super) struct Staged {
    pub balance: Vec<usize>,
    pub costs: Vec<StageCost>,
}

/// A schedule's replay, each rank's model stages and where each rank's memory can peak.
pub(super) struct Replayed {
    pub sim: Simulation,
    /// Each rank's model stages ([`Schedule::stages_of`]).
    pub stages: Vec<Vec<usize>>,
    /// Of what each rank holds as each of its actions starts
    /// ([`crate::parallel::pipeline::timeline::held`]), the holdings no other exceeds in both
    /// counts ([`peaks`]).
    pub held: Vec<Vec<Held>>,
    /// Whether the schedule splits its backwards ([`Schedule::splits_backward`]).
    pub splits_backward: bool,
}

impl Replayed {
    /// `schedule`'s replay `sim`, with what a candidate reads of the schedule.
    pub fn new(schedule: &Schedule, sim: Simulation) -> Self {
        let stages = (0..schedule.ranks).map(|r| schedule.stages_of(r)).collect();
        let held = (timeline::held(schedule).iter())
            .map(|h| peaks(h))
            .collect();
        Self {
            splits_backward: schedule.splits_backward(),
            sim,
            stages,
            held,
        }
    }
}

/// Of `list`, the holdings no other exceeds in both counts (activations and queues): every
/// charge on a rank's memory grows with each count, so its peak is at one of these, and a
/// search charges a few instead of one per action.
pub(super) fn peaks(list: &[Held]) -> Vec<Held> {
    let mut sorted = list.to_vec();
    sorted.sort_by_key(|h| std::cmp::Reverse((h.graphs, h.queues)));
    let mut out: Vec<Held> = Vec::new();
    for h in sorted {
        if out.last().is_none_or(|p| h.queues > p.queues) {
            out.push(h);
        }
    }
    out
}

/// The stages and the replay a search's consecutive candidates share (see the module's
/// header); `Memo::default()` for each search (one profile and cluster).
#[derive(Default)]
pub struct Memo {
    staged: Vec<(StagesKey, Rc<Staged>)>,
    replayed: Option<(ReplayKey, Rc<Replayed>)>,
}

impl Memo {
    /// The stages of `key`: kept, or made by `make` (forgetting another group's).
    pub(super) fn staged(
        &mut self,
        key: StagesKey,
        make: impl FnOnce() -> Result<Staged>,
    ) -> Result<Rc<Staged>> {
        if let Some((_, s)) = self.staged.iter().find(|(k, _)| *k == key) {
            return Ok(s.clone());
        }
        if !self.staged.first().is_some_and(|(k, _)| k.same_group(&key)) {
            self.staged.clear();
        }
        let s = Rc::new(make()?);
        self.staged.push((key, s.clone()));
        Ok(s)
    }

    /// The replay of `key`: the last one, or made by `make`.
    pub(super) fn replayed(
        &mut self,
        key: ReplayKey,
        make: impl FnOnce() -> Result<Replayed>,
    ) -> Result<Rc<Replayed>> {
        match &self.replayed {
            Some((k, r)) if *k == key => Ok(r.clone()),
            _ => {
                let r = Rc::new(make()?);
                self.replayed = Some((key, r.clone()));
                Ok(r)
            }
        }
    }
}
