//! Morphing (Varuna): a run restarted in a world of another size takes a layout of that world
//! that keeps what its training depends on (the global batch, the micro-batch size, the
//! schedule and the recompute mode) and fits the model (tp dividing its heads and vocabulary,
//! enough layers or cut points for pp). With a profile the planner's fastest of those is
//! taken; without one, the layout nearest the old one (the same tp, then the same pp, then the
//! nearest sizes). Any [`Sequential`] morphs: a user's model as well as the GPT.

use super::candidate::Candidate;
use super::cluster::Cluster;
use super::profile::Profile;
use super::ranking::{rank, Request};
use super::search::layouts;
use crate::distributed::topology::Layout;
use crate::model::Sequential;
use crate::parallel::dims::{BatchSpec, ParallelSpec};
use crate::parallel::pipeline::partition::partition;
use crate::parallel::pipeline::schedule::Schedule;
use crate::parallel::pipeline::ScheduleChoice;
use crate::{invalid, Result};

/// What a run keeps across a morph, and the world it morphs into.
#[derive(Clone, Debug)]
pub struct MorphRequest {
    /// Ranks of the new world.
    pub world: usize,
    /// The layout, ZeRO stage and sequence parallelism the run had.
    pub from: ParallelSpec,
    /// The run's global batch and micro-batch rows.
    pub batch: BatchSpec,
    /// The run's schedule, its stages per rank and its recompute mode.
    pub schedule: ScheduleChoice,
    /// Sizes a tensor-parallel size must divide (GPT: heads and vocabulary; `[1]` for a model
    /// that does not split).
    pub tp_divides: Vec<usize>,
}

/// The planner's view of the new world, when the run has a profile of its model.
pub struct MorphPlanner<'a> {
    /// The model's costs (measured, or from a transformer's shapes).
    pub profile: &'a Profile,
    /// The machines of the new world.
    pub cluster: Cluster<'a>,
    /// Memory each rank may use, in bytes.
    pub memory_bytes: f64,
}

/// The layout a run takes in its new world, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct Morph {
    /// The new layout.
    pub layout: Layout,
    /// The predicted step time, when the planner chose.
    pub step_s: Option<f64>,
    /// One line for the log: how the layout was chosen.
    pub why: String,
}

impl Morph {
    /// The log's line for a morph from `from` (the planner's reasons name the machines of
    /// `hardware` when it chose): `morphing from pp=2 tp=2 dp=1 to ... for a world of 2 (...)`.
    pub fn describe(&self, from: Layout, hardware: &str) -> String {
        let why = match self.step_s {
            Some(_) => format!("{} on {hardware}", self.why),
            None => self.why.clone(),
        };
        format!(
            "morphing from {from} to {} for a world of {} ({why})",
            self.layout,
            self.layout.world()
        )
    }
}

/// Every layout of `req.world` that `model` and the run's batch, micro-batch and schedule
/// fit, nearest to `req.from` first.
pub fn morph_layouts(req: &MorphRequest, model: &Sequential) -> Vec<Layout> {
    let (kind, v) = (req.schedule.kind, req.schedule.virtual_stages);
    let per_rank = req.schedule.stages_per_rank();
    let mut out: Vec<Layout> = layouts(
        req.world,
        usize::MAX,
        &req.tp_divides,
        req.batch.global_batch,
    )
    .into_iter()
    .filter(|l| {
        req.batch
            .micro_batches(l)
            .is_ok_and(|m| Schedule::new(kind, l.pp, m, v).is_ok())
            && partition(model, l.pp * per_rank, None).is_ok()
    })
    .collect();
    let from = req.from.layout;
    out.sort_by_key(|l| {
        (
            l.tp != from.tp,
            l.pp != from.pp,
            l.tp.abs_diff(from.tp),
            l.pp.abs_diff(from.pp),
        )
    });
    out
}

/// The layout for `req`'s new world (see the module's text): the planner's fastest when
/// `planner` is given, the nearest otherwise. Fails when no layout fits, saying why.
pub fn morph(
    req: &MorphRequest,
    model: &Sequential,
    planner: Option<MorphPlanner<'_>>,
) -> Result<Morph> {
    let fits = morph_layouts(req, model);
    let Some(&nearest) = fits.first() else {
        return Err(invalid!(
            "no layout of {} ranks fits the model and a batch of {} in micro-batches of {}: \
             change the world size, the batch size or the micro-batch size",
            req.world,
            req.batch.global_batch,
            req.batch.micro_batch
        ));
    };
    let Some(p) = planner else {
        return Ok(Morph {
            layout: nearest,
            step_s: None,
            why: "the nearest to the old layout".into(),
        });
    };
    let candidates = fits
        .iter()
        .map(|&layout| Candidate {
            // Morphing keeps to cp 1 layouts, without sequence parallelism.
            parallel: ParallelSpec {
                layout,
                zero: req.from.zero,
                sequence_parallel: false,
            },
            micro_batch: req.batch.micro_batch,
            // Every layout that fits splits the batch (`morph_layouts`).
            micro_batches: req.batch.micro_batches(&layout).unwrap_or(1),
            schedule: req.schedule,
        })
        .collect();
    let request = Request {
        world: req.world,
        memory_bytes: p.memory_bytes,
        global_batch: req.batch.global_batch,
        top: 1,
    };
    let best = rank(p.profile, &p.cluster, &request, candidates)?.swap_remove(0);
    Ok(Morph {
        layout: best.candidate.parallel.layout,
        step_s: Some(best.step_s),
        why: format!(
            "the planner's fastest: {:.1} ms a step predicted",
            best.step_s * 1e3
        ),
    })
}
