//! Schedules as data: for each pipeline rank an ordered list of actions. The same lists drive
//! the executor, the simulator and validator ([`super::simulate`]), the planner and the
//! timeline picture; this file only makes, prints and parses them.
//!
//! Conventions, stated once:
//! - A *rank* is a member of the pipeline communicator; a *stage* is a model stage, a
//!   contiguous range of layers. A schedule has `ranks` lists and `stages` stages; every action
//!   names the stage it runs, and the rank whose list names a stage holds it. Stage k's forward
//!   needs stage k - 1's forward of the same micro-batch, its backward stage k + 1's backward:
//!   sends and receives are implied by neighbours.
//! - The built-in schedules place stages in a loop: with `v` stages per rank (Megatron's
//!   interleaving), rank r holds stages r, r + p, ..., r + (v - 1) p. A schedule written by hand
//!   or loaded from a file may place them in any way (a V: rank r holds r and 2p - 1 - r).
//! - An action prints as torch.distributed.pipelining's `_Action` does: stage, letter,
//!   micro-batch (`1F3`: stage 1's forward of micro-batch 3). Letters: `F` forward, `B` full
//!   backward, `I` input gradient, `W` weight gradient (a zero-bubble split backward).
//! - A schedule file is PyTorch's CSV form: one line per rank, its actions separated by commas.

pub use super::action::Action;
use super::schedule_v::{dual_pipe_v, zero_bubble_v};
use crate::{invalid, Result};

/// The schedules pipewright builds (serialized as they parse: `gpipe`, `1f1b`, ...).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScheduleKind {
    /// Fill then drain (GPipe, torchgpipe): every forward, then every backward.
    GPipe,
    /// One forward one backward, PipeDream-flush (Varuna): stage s keeps at most p - s
    /// micro-batches in flight.
    OneFOneB,
    /// 1F1B over v model stages per rank (Megatron-LM).
    Interleaved,
    /// ZB-H1 (Qi et al. 2023): 1F1B with the backward split into input and weight gradients
    /// (see [`zero_bubble_h1`]).
    ZeroBubbleH1,
    /// ZB-V (Qi et al. 2023): two stages per rank in a V, the split backward placed so that
    /// nothing waits when forward, input and weight gradients take equal time (see
    /// [`super::schedule_v`]).
    ZeroBubbleV,
    /// DualPipeV (DeepSeek-V3's DualPipe on p ranks, PyTorch's `ScheduleDualPipeV`): the V
    /// placement with a forward and a whole backward paired in the steady state; at least
    /// 2 x pp micro-batches.
    DualPipeV,
}

impl ScheduleKind {
    /// Every built schedule, in the order they are listed.
    pub const ALL: [ScheduleKind; 6] = [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved,
        ScheduleKind::ZeroBubbleH1,
        ScheduleKind::ZeroBubbleV,
        ScheduleKind::DualPipeV,
    ];

    /// Whether it places two stages per rank in a V (rank r: stages r and 2p - 1 - r).
    pub fn is_v(self) -> bool {
        matches!(self, ScheduleKind::ZeroBubbleV | ScheduleKind::DualPipeV)
    }

    /// Model stages each rank holds when `virtual_stages` is asked for: two in a V, the
    /// virtual stages under the interleaved schedule, else one.
    pub fn stages_per_rank(self, virtual_stages: usize) -> usize {
        match self {
            _ if self.is_v() => 2,
            ScheduleKind::Interleaved => virtual_stages,
            _ => 1,
        }
    }
}

crate::runtime::words::word_enum!(ScheduleKind, "schedule", {
    GPipe => "gpipe",
    OneFOneB => "1f1b",
    Interleaved => "interleaved",
    ZeroBubbleH1 => "zb1" | "zbh1",
    ZeroBubbleV => "zbv",
    DualPipeV => "dualpipev",
});

/// The most ranks a built-in schedule is made for (its simulation and timeline grow with the
/// square of the ranks).
pub const MAX_RANKS: usize = 1024;
/// The most actions a built-in schedule is made with.
pub const MAX_ACTIONS: usize = 1 << 22;

/// Action lists of every rank. Which rank holds a stage is read off the lists (see
/// [`Schedule::rank_of`]); [`super::simulate`] checks that they are complete and
/// deadlock-free.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    /// Pipeline ranks p (the number of lists).
    pub ranks: usize,
    /// Model stages (p times the stages per rank).
    pub stages: usize,
    /// Micro-batches per replica's batch.
    pub micro_batches: usize,
    /// Each rank's actions, in the order it runs them.
    pub actions: Vec<Vec<Action>>,
}

fn fwd(stage: usize) -> impl Fn(usize) -> Action {
    move |mb| Action::Forward { mb, stage }
}

fn bwd(stage: usize) -> impl Fn(usize) -> Action {
    move |mb| Action::Backward { mb, stage }
}

/// GPipe's list for rank `r` (stage r): all forwards, then all backwards. The backwards run in
/// micro-batch order (torchgpipe's autograd runs them last-first; any order is valid) so that
/// gradients accumulate in the order serial training adds them, bit for bit.
pub fn gpipe(m: usize, r: usize) -> Vec<Action> {
    (0..m).map(fwd(r)).chain((0..m).map(bwd(r))).collect()
}

/// 1F1B's list for rank `r` of `p` (stage r).
pub fn one_f_one_b(p: usize, m: usize, r: usize) -> Vec<Action> {
    let warm = (p - r - 1).min(m);
    let mut a: Vec<Action> = (0..warm).map(fwd(r)).collect();
    for i in 0..m - warm {
        a.push(fwd(r)(warm + i));
        a.push(bwd(r)(i));
    }
    a.extend((m - warm..m).map(bwd(r)));
    a
}

/// ZB-H1's list for rank `r` of `p` (stage r): 1F1B's order with every backward split into its
/// input gradient, which goes upstream at once, and its weight gradient, done next while the
/// stage would otherwise wait. Activations are held until the weight gradient, so no stage holds
/// more than under 1F1B. Under unit costs (forward, input and weight gradient 1 each) this takes
/// the bubble from 27.3 % to 20.0 % at pp=4, chunks=8; the paper's hand-tuned placement of the
/// weight gradients reaches about 11 % there, which later work on this function can aim for (the
/// validator and the simulator will check it).
pub fn zero_bubble_h1(p: usize, m: usize, r: usize) -> Vec<Action> {
    let warm = (p - r - 1).min(m);
    let mut a: Vec<Action> = (0..warm).map(fwd(r)).collect();
    let bi = |mb| Action::BackwardInput { mb, stage: r };
    let w = |mb| Action::BackwardWeight { mb, stage: r };
    for i in 0..m - warm {
        a.push(fwd(r)(warm + i));
        a.push(bi(i));
        a.push(w(i));
    }
    for i in m - warm..m {
        a.push(bi(i));
        a.push(w(i));
    }
    a
}

/// Megatron's interleaved 1F1B for rank `r` of `p` with `v` stages per rank (m a multiple of
/// p): rank r holds stages r, r + p, ..., r + (v - 1) p.
pub fn interleaved(p: usize, m: usize, v: usize, r: usize) -> Vec<Action> {
    let total = m * v;
    let group = p * v;
    let at = |k: usize, forward: bool| {
        let c = (k % group) / p;
        let c = if forward { c } else { v - 1 - c };
        let mb = (k / group) * p + k % p;
        (mb, c * p + r)
    };
    let warm = ((p - r - 1) * 2 + (v - 1) * p).min(total);
    let f = |k: usize| {
        let (mb, stage) = at(k, true);
        Action::Forward { mb, stage }
    };
    let b = |k: usize| {
        let (mb, stage) = at(k, false);
        Action::Backward { mb, stage }
    };
    let mut a: Vec<Action> = (0..warm).map(f).collect();
    for i in 0..total - warm {
        a.push(f(warm + i));
        a.push(b(i));
    }
    a.extend((total - warm..total).map(b));
    a
}

impl Schedule {
    /// The lists of every rank for `kind` with `p` ranks, `m` micro-batches and `v` stages per
    /// rank (interleaved only; the V schedules hold 2, whether `v` says 1 or 2; the others 1).
    pub fn new(kind: ScheduleKind, p: usize, m: usize, v: usize) -> Result<Self> {
        if p == 0 || m == 0 || v == 0 {
            return Err(invalid!("a schedule needs at least one stage, micro-batch and chunk (got pp={p}, micro-batches={m}, virtual_stages={v})"));
        }
        if v > 1 && kind != ScheduleKind::Interleaved && !(kind.is_v() && v == 2) {
            return Err(invalid!(
                "virtual_stages {v} needs the interleaved schedule, not {kind}{}",
                if kind.is_v() {
                    " (it holds two stages per rank by its V)"
                } else {
                    ""
                }
            ));
        }
        if kind == ScheduleKind::DualPipeV && m < 2 * p {
            return Err(invalid!(
                "dualpipev needs at least 2 x pp = {} micro-batches per replica (chunks), got \
                 {m}: more chunks, or zbv",
                2 * p
            ));
        }
        let v = kind.stages_per_rank(v);
        if kind == ScheduleKind::Interleaved && v > 1 && !m.is_multiple_of(p) {
            return Err(invalid!(
                "the interleaved schedule sends micro-batches round in groups of pp: {m} micro-batches per replica must be a multiple of pp {p}"
            ));
        }
        // Every rank holds 2 or 3 actions per micro-batch and stage; simulating and drawing
        // a timeline take time and memory in ranks x (ranks + micro-batches): 30,000 ranks
        // took 3 minutes and 21 GB.
        let count = [p, m, v, 3]
            .iter()
            .try_fold(1usize, |n, k| n.checked_mul(*k));
        if p > MAX_RANKS || count.is_none_or(|n| n > MAX_ACTIONS) {
            return Err(invalid!(
                "a schedule of {p} ranks, {m} micro-batches and {v} stages per rank is more than \
                 is simulated here (at most {MAX_RANKS} ranks and {MAX_ACTIONS} actions): fewer \
                 ranks or micro-batches"
            ));
        }
        let actions = (0..p)
            .map(|r| match kind {
                ScheduleKind::GPipe => gpipe(m, r),
                ScheduleKind::OneFOneB => one_f_one_b(p, m, r),
                ScheduleKind::Interleaved if v == 1 => one_f_one_b(p, m, r),
                ScheduleKind::Interleaved => interleaved(p, m, v, r),
                ScheduleKind::ZeroBubbleH1 => zero_bubble_h1(p, m, r),
                ScheduleKind::ZeroBubbleV => zero_bubble_v(p, m, r),
                ScheduleKind::DualPipeV => dual_pipe_v(p, m, r),
            })
            .collect();
        Self::from_actions(actions)
    }

    /// A schedule from each rank's list, as written by hand or loaded: the stage count and the
    /// micro-batch count are read off the actions (stages 0..S and micro-batches 0..M must
    /// each appear). Completeness and freedom from deadlock are checked by
    /// [`Schedule::validate`].
    pub fn from_actions(actions: Vec<Vec<Action>>) -> Result<Self> {
        let all = || actions.iter().flatten();
        let (Some(stages), Some(micro_batches)) = (
            all().map(|a| a.stage() + 1).max(),
            all().map(|a| a.mb() + 1).max(),
        ) else {
            return Err(invalid!("a schedule needs at least one action"));
        };
        let s = Self {
            ranks: actions.len(),
            stages,
            micro_batches,
            actions,
        };
        s.placement()?;
        Ok(s)
    }

    /// The rank that holds each stage: the one whose list names it. Fails when a stage is named
    /// by two ranks or by none.
    pub fn placement(&self) -> Result<Vec<usize>> {
        let mut rank = vec![None; self.stages];
        for (r, list) in self.actions.iter().enumerate() {
            for a in list {
                match rank[a.stage()] {
                    Some(o) if o != r => {
                        return Err(invalid!(
                            "stage {} appears on rank {o} and on rank {r} (`{a}`): a stage runs \
                             on one rank",
                            a.stage()
                        ))
                    }
                    _ => rank[a.stage()] = Some(r),
                }
            }
        }
        rank.iter()
            .enumerate()
            .map(|(k, r)| r.ok_or_else(|| invalid!("stage {k} has no action on any rank")))
            .collect()
    }

    /// The rank that holds stage `k` (see [`Schedule::placement`]).
    pub fn rank_of(&self, k: usize) -> usize {
        self.actions
            .iter()
            .position(|l| l.iter().any(|a| a.stage() == k))
            .unwrap_or(k % self.ranks.max(1))
    }

    /// The stages rank `r` holds, in increasing order.
    pub fn stages_of(&self, r: usize) -> Vec<usize> {
        let mut s: Vec<usize> = self.actions[r].iter().map(|a| a.stage()).collect();
        s.sort_unstable();
        s.dedup();
        s
    }

    /// Whether any action is a split backward (the executor then queues weight gradients).
    pub fn splits_backward(&self) -> bool {
        self.actions
            .iter()
            .flatten()
            .any(|a| matches!(a, Action::BackwardWeight { .. }))
    }

    /// The schedule a pipeline of `p` ranks and `m` micro-batches per replica runs: `given`
    /// when there is one (it must have `p` lists and `m` micro-batches), else the built `kind`
    /// with `v` stages per rank.
    pub fn for_pipeline(
        given: Option<&Schedule>,
        kind: ScheduleKind,
        v: usize,
        p: usize,
        m: usize,
    ) -> Result<Self> {
        let Some(s) = given else {
            return Self::new(kind, p, m, v);
        };
        if s.ranks != p || s.micro_batches != m {
            return Err(invalid!(
                "the given schedule has {} ranks and {} micro-batches, the pipeline {p} ranks (pp) and {m} micro-batches per replica (chunks): write or load one for this pipeline",
                s.ranks,
                s.micro_batches
            ));
        }
        Ok(s.clone())
    }
}
