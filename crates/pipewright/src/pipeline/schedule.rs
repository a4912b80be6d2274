//! Schedules as data: for (stages p, micro-batches m, stage s) an ordered list of actions.
//! The same lists drive the executor, the simulator, the validator and the timeline picture.
//!
//! Stage `s` of a schedule is a pipeline *rank*. With interleaving (Megatron), rank `r` holds
//! `v` model chunks, chunk `c` being model stage `c * p + r`; every action names its chunk
//! (0 without interleaving). Sends and receives are implied by neighbours: a forward of model
//! stage k needs the forward of k - 1 for the same micro-batch, a backward needs the backward
//! of k + 1.

use std::fmt;

use super::replay::run;
use super::simulate::validate_complete;
pub use super::simulate::{Costs, Simulation, Span};
use crate::{invalid, Error, Result};

/// One step of a stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Forward {
        mb: usize,
        chunk: usize,
    },
    /// Input and weight gradients together.
    Backward {
        mb: usize,
        chunk: usize,
    },
    /// Zero-bubble split: the input gradient only (sent upstream at once) ...
    BackwardInput {
        mb: usize,
        chunk: usize,
    },
    /// ... and the weight gradient, later, to fill a bubble.
    BackwardWeight {
        mb: usize,
        chunk: usize,
    },
}

impl Action {
    pub fn mb(&self) -> usize {
        match *self {
            Action::Forward { mb, .. }
            | Action::Backward { mb, .. }
            | Action::BackwardInput { mb, .. }
            | Action::BackwardWeight { mb, .. } => mb,
        }
    }

    pub fn chunk(&self) -> usize {
        match *self {
            Action::Forward { chunk, .. }
            | Action::Backward { chunk, .. }
            | Action::BackwardInput { chunk, .. }
            | Action::BackwardWeight { chunk, .. } => chunk,
        }
    }

    /// Trace letter: F, B, I (input gradient), W (weight gradient).
    pub fn letter(&self) -> char {
        match self {
            Action::Forward { .. } => 'F',
            Action::Backward { .. } => 'B',
            Action::BackwardInput { .. } => 'I',
            Action::BackwardWeight { .. } => 'W',
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.letter(), self.mb())?;
        if self.chunk() > 0 {
            write!(f, ".{}", self.chunk())?;
        }
        Ok(())
    }
}

/// The schedules pipewright knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Fill then drain (GPipe, torchgpipe): every forward, then every backward.
    GPipe,
    /// One forward one backward, PipeDream-flush (Varuna): stage s keeps at most p - s
    /// micro-batches in flight.
    OneFOneB,
    /// 1F1B over v model chunks per rank (Megatron-LM).
    Interleaved,
    /// ZB-H1 (Qi et al. 2023): 1F1B with the backward split into input and weight gradients
    /// (see [`zero_bubble_h1`]).
    ZeroBubbleH1,
}

impl std::str::FromStr for Kind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "gpipe" => Kind::GPipe,
            "1f1b" => Kind::OneFOneB,
            "interleaved" => Kind::Interleaved,
            "zb1" | "zbh1" => Kind::ZeroBubbleH1,
            _ => {
                return Err(invalid!(
                    "unknown schedule `{s}`: use gpipe, 1f1b, interleaved or zb1"
                ))
            }
        })
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::GPipe => "gpipe",
            Kind::OneFOneB => "1f1b",
            Kind::Interleaved => "interleaved",
            Kind::ZeroBubbleH1 => "zb1",
        })
    }
}

/// Action lists of every stage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    pub kind: Kind,
    /// Pipeline ranks p.
    pub stages: usize,
    pub micro_batches: usize,
    /// Model chunks per rank v (1 unless interleaved).
    pub chunks_per_stage: usize,
    pub actions: Vec<Vec<Action>>,
}

fn f(mb: usize) -> Action {
    Action::Forward { mb, chunk: 0 }
}

fn b(mb: usize) -> Action {
    Action::Backward { mb, chunk: 0 }
}

/// GPipe's list for one stage: all forwards, then all backwards. The backwards run in
/// micro-batch order (torchgpipe's autograd runs them last-first; any order is valid) so that
/// gradients accumulate in the order serial training adds them, bit for bit.
pub fn gpipe(m: usize) -> Vec<Action> {
    (0..m).map(f).chain((0..m).map(b)).collect()
}

/// 1F1B's list for stage `s` of `p`.
pub fn one_f_one_b(p: usize, m: usize, s: usize) -> Vec<Action> {
    let warm = (p - s - 1).min(m);
    let mut a: Vec<Action> = (0..warm).map(f).collect();
    for i in 0..m - warm {
        a.push(f(warm + i));
        a.push(b(i));
    }
    a.extend((m - warm..m).map(b));
    a
}

/// ZB-H1's list for stage `s` of `p`: 1F1B's order with every backward split into its input
/// gradient, which goes upstream at once, and its weight gradient, done next while the stage
/// would otherwise wait. Activations are held until the weight gradient, so no stage holds more
/// than under 1F1B. Under unit costs (forward, input and weight gradient 1 each) this takes the
/// bubble from 27.3 % to 20.0 % at pp=4, chunks=8; the paper's hand-tuned placement of the weight
/// gradients reaches about 11 % there, which later work on this function can aim for (the
/// validator and the simulator will check it).
pub fn zero_bubble_h1(p: usize, m: usize, s: usize) -> Vec<Action> {
    let warm = (p - s - 1).min(m);
    let mut a: Vec<Action> = (0..warm).map(f).collect();
    let bi = |mb| Action::BackwardInput { mb, chunk: 0 };
    let w = |mb| Action::BackwardWeight { mb, chunk: 0 };
    for i in 0..m - warm {
        a.push(f(warm + i));
        a.push(bi(i));
        a.push(w(i));
    }
    for i in m - warm..m {
        a.push(bi(i));
        a.push(w(i));
    }
    a
}

/// Megatron's interleaved 1F1B for rank `r` of `p` with `v` chunks (m a multiple of p).
pub fn interleaved(p: usize, m: usize, v: usize, r: usize) -> Vec<Action> {
    let total = m * v;
    let group = p * v;
    let at = |k: usize, forward: bool| {
        let c = (k % group) / p;
        let chunk = if forward { c } else { v - 1 - c };
        let mb = (k / group) * p + k % p;
        (mb, chunk)
    };
    let warm = ((p - r - 1) * 2 + (v - 1) * p).min(total);
    let fwd = |k: usize| {
        let (mb, chunk) = at(k, true);
        Action::Forward { mb, chunk }
    };
    let bwd = |k: usize| {
        let (mb, chunk) = at(k, false);
        Action::Backward { mb, chunk }
    };
    let mut a: Vec<Action> = (0..warm).map(fwd).collect();
    for i in 0..total - warm {
        a.push(fwd(warm + i));
        a.push(bwd(i));
    }
    a.extend((total - warm..total).map(bwd));
    a
}

impl Schedule {
    /// The lists of every stage for `kind` with `p` stages, `m` micro-batches and `v` chunks
    /// per stage (interleaved only; otherwise 1).
    pub fn new(kind: Kind, p: usize, m: usize, v: usize) -> Result<Self> {
        if p == 0 || m == 0 || v == 0 {
            return Err(invalid!("a schedule needs at least one stage, micro-batch and chunk (got pp={p}, micro-batches={m}, virtual_stages={v})"));
        }
        if v > 1 && kind != Kind::Interleaved {
            return Err(invalid!(
                "virtual_stages {v} needs the interleaved schedule, not {kind}"
            ));
        }
        if kind == Kind::Interleaved && v > 1 && !m.is_multiple_of(p) {
            return Err(invalid!(
                "the interleaved schedule sends micro-batches round in groups of pp: {m} micro-batches per replica must be a multiple of pp {p}"
            ));
        }
        let actions = (0..p)
            .map(|s| match kind {
                Kind::GPipe => gpipe(m),
                Kind::OneFOneB => one_f_one_b(p, m, s),
                Kind::Interleaved if v == 1 => one_f_one_b(p, m, s),
                Kind::Interleaved => interleaved(p, m, v, s),
                Kind::ZeroBubbleH1 => zero_bubble_h1(p, m, s),
            })
            .collect();
        Ok(Self {
            kind,
            stages: p,
            micro_batches: m,
            chunks_per_stage: v,
            actions,
        })
    }

    /// Model stage of `chunk` on rank `rank`.
    pub fn model_stage(&self, rank: usize, chunk: usize) -> usize {
        chunk * self.stages + rank
    }

    /// Checks the lists and simulates them under `costs`.
    pub fn simulate(&self, costs: Costs) -> Result<Simulation> {
        self.simulate_with(&|_, a| costs.of(a), &|_, _| 0.0, f64::INFINITY)
    }

    /// Checks the lists and simulates them with `cost(model stage, action)` seconds per
    /// action and `transfer(from, to)` seconds for what crosses from one model stage to
    /// another (the planner's costs: every stage its own durations, the links their delays),
    /// with `slots` ranks computing at full speed at once (ranks sharing a CPU slow each other
    /// down; infinity when every rank has its own device).
    pub fn simulate_with(
        &self,
        cost: &dyn Fn(usize, &Action) -> f64,
        transfer: &dyn Fn(usize, usize) -> f64,
        slots: f64,
    ) -> Result<Simulation> {
        validate_complete(self)?;
        run(self, cost, transfer, slots)
    }

    /// [`Schedule::simulate`] under [`Costs::unit`].
    pub fn validate(&self) -> Result<Simulation> {
        self.simulate(Costs::unit())
    }
}
