//! Schedules as data: for (stages p, micro-batches m, stage s) an ordered list of actions.
//! The same lists drive the executor, the simulator, the validator and the timeline picture.
//!
//! Stage `s` of a schedule is a pipeline *rank*. With interleaving (Megatron), rank `r` holds
//! `v` model chunks, chunk `c` being model stage `c * p + r`; every action names its chunk
//! (0 without interleaving). Sends and receives are implied by neighbours: a forward of model
//! stage k needs the forward of k - 1 for the same micro-batch, a backward needs the backward
//! of k + 1.

use std::collections::HashMap;
use std::fmt;

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
        validate_complete(self)?;
        run(self, costs)
    }

    /// [`Schedule::simulate`] under [`Costs::unit`].
    pub fn validate(&self) -> Result<Simulation> {
        self.simulate(Costs::unit())
    }
}

/// Durations of the actions.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Costs {
    pub forward: f64,
    pub backward: f64,
    pub backward_input: f64,
    pub backward_weight: f64,
}

impl Costs {
    /// Forward 1, full backward 2 (its input and weight halves 1 each).
    pub fn unit() -> Self {
        Self {
            forward: 1.0,
            backward: 2.0,
            backward_input: 1.0,
            backward_weight: 1.0,
        }
    }

    fn of(&self, a: &Action) -> f64 {
        match a {
            Action::Forward { .. } => self.forward,
            Action::Backward { .. } => self.backward,
            Action::BackwardInput { .. } => self.backward_input,
            Action::BackwardWeight { .. } => self.backward_weight,
        }
    }
}

/// An action placed in time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Span {
    pub start: f64,
    pub end: f64,
    pub action: Action,
}

/// A simulated run of a schedule.
#[derive(Clone, Debug, PartialEq)]
pub struct Simulation {
    /// Per stage, its actions in time.
    pub spans: Vec<Vec<Span>>,
    pub makespan: f64,
    /// Idle share of stage-time: 1 - busy / (stages * makespan).
    pub bubble: f64,
    /// Per stage, the most micro-batches whose activations it holds at once.
    pub peak_in_flight: Vec<usize>,
}

/// Every (chunk, micro-batch) of every stage has one forward and one backward (or one input
/// and one weight gradient), and nothing else.
fn validate_complete(s: &Schedule) -> Result<()> {
    let (m, v) = (s.micro_batches, s.chunks_per_stage);
    if s.actions.len() != s.stages {
        return Err(invalid!(
            "schedule has lists for {} stages, expected {}",
            s.actions.len(),
            s.stages
        ));
    }
    for (r, list) in s.actions.iter().enumerate() {
        let mut seen: HashMap<Action, usize> = HashMap::new();
        for a in list {
            if a.mb() >= m || a.chunk() >= v {
                return Err(invalid!(
                    "stage {r}: {a} names a micro-batch or chunk outside {m} x {v}"
                ));
            }
            *seen.entry(*a).or_default() += 1;
        }
        if let Some((a, n)) = seen.iter().find(|(_, n)| **n > 1) {
            return Err(invalid!("stage {r}: {a} appears {n} times"));
        }
        for chunk in 0..v {
            for mb in 0..m {
                let has = |a: Action| seen.contains_key(&a);
                if !has(Action::Forward { mb, chunk }) {
                    return Err(invalid!(
                        "stage {r}: the forward of micro-batch {mb} (chunk {chunk}) is missing"
                    ));
                }
                let full = has(Action::Backward { mb, chunk });
                let (i, w) = (
                    has(Action::BackwardInput { mb, chunk }),
                    has(Action::BackwardWeight { mb, chunk }),
                );
                if full == (i || w) || i != w {
                    return Err(invalid!(
                        "stage {r}: micro-batch {mb} (chunk {chunk}) needs one backward, or one input and one weight gradient"
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Runs the lists in order on every stage; an action starts when its stage is free and what
/// it needs is done. Fails, naming what each stuck stage waits for, if no stage can move.
fn run(s: &Schedule, costs: Costs) -> Result<Simulation> {
    let p = s.stages;
    let last = p * s.chunks_per_stage - 1;
    // (model stage, mb) -> finish time of its forward / of its input gradient.
    let mut fwd: HashMap<(usize, usize), f64> = HashMap::new();
    let mut grad: HashMap<(usize, usize), f64> = HashMap::new();
    let mut ptr = vec![0usize; p];
    let mut free = vec![0f64; p];
    let mut spans: Vec<Vec<Span>> = vec![Vec::new(); p];
    let needs = |a: &Action, k: usize| -> Vec<(bool, (usize, usize))> {
        // (is forward table, key)
        let mb = a.mb();
        match a {
            Action::Forward { .. } if k > 0 => vec![(true, (k - 1, mb))],
            Action::Forward { .. } => vec![],
            Action::Backward { .. } | Action::BackwardInput { .. } if k < last => {
                vec![(true, (k, mb)), (false, (k + 1, mb))]
            }
            Action::Backward { .. } | Action::BackwardInput { .. } => vec![(true, (k, mb))],
            Action::BackwardWeight { .. } => vec![(false, (k, mb))],
        }
    };
    loop {
        let mut moved = false;
        for r in 0..p {
            while let Some(a) = s.actions[r].get(ptr[r]) {
                let k = s.model_stage(r, a.chunk());
                let deps = needs(a, k);
                let times: Option<Vec<f64>> = deps
                    .iter()
                    .map(|(is_f, key)| if *is_f { fwd.get(key) } else { grad.get(key) }.copied())
                    .collect();
                let Some(times) = times else { break };
                let start = times.into_iter().fold(free[r], f64::max);
                let end = start + costs.of(a);
                match a {
                    Action::Forward { .. } => {
                        fwd.insert((k, a.mb()), end);
                    }
                    Action::Backward { .. } | Action::BackwardInput { .. } => {
                        grad.insert((k, a.mb()), end);
                    }
                    Action::BackwardWeight { .. } => {}
                }
                spans[r].push(Span {
                    start,
                    end,
                    action: *a,
                });
                free[r] = end;
                ptr[r] += 1;
                moved = true;
            }
        }
        if (0..p).all(|r| ptr[r] == s.actions[r].len()) {
            break;
        }
        if !moved {
            let stuck: Vec<String> = (0..p)
                .filter_map(|r| {
                    s.actions[r].get(ptr[r]).map(|a| {
                        let k = s.model_stage(r, a.chunk());
                        let waits: Vec<String> = needs(a, k)
                            .iter()
                            .filter(|(is_f, key)| {
                                !(if *is_f {
                                    fwd.contains_key(key)
                                } else {
                                    grad.contains_key(key)
                                })
                            })
                            .map(|(is_f, (ks, mb))| {
                                format!(
                                    "{} of micro-batch {mb} on model stage {ks}",
                                    if *is_f { "forward" } else { "gradient" }
                                )
                            })
                            .collect();
                        format!("stage {r} at {a} waits for {}", waits.join(", "))
                    })
                })
                .collect();
            return Err(invalid!("schedule deadlocks: {}", stuck.join("; ")));
        }
    }
    let makespan = free.iter().copied().fold(0.0, f64::max);
    let busy: f64 = spans.iter().flatten().map(|s| s.end - s.start).sum();
    let bubble = if makespan > 0.0 {
        1.0 - busy / (p as f64 * makespan)
    } else {
        0.0
    };
    let peak_in_flight = s
        .actions
        .iter()
        .map(|list| {
            let (mut now, mut peak) = (0i64, 0i64);
            for a in list {
                match a {
                    Action::Forward { .. } => now += 1,
                    Action::Backward { .. } | Action::BackwardWeight { .. } => now -= 1,
                    Action::BackwardInput { .. } => {}
                }
                peak = peak.max(now);
            }
            peak as usize
        })
        .collect();
    Ok(Simulation {
        spans,
        makespan,
        bubble,
        peak_in_flight,
    })
}

impl Simulation {
    /// One row per stage, one cell per time unit (costs must be whole numbers).
    pub fn timeline(&self) -> String {
        let width = self
            .spans
            .iter()
            .flatten()
            .map(|s| s.action.to_string().len())
            .max()
            .unwrap_or(2)
            .max(2);
        let cells = self.makespan.ceil() as usize;
        let mut out = String::new();
        for (r, row) in self.spans.iter().enumerate() {
            let mut line = vec![format!("{:>w$}", ".", w = width); cells];
            for s in row {
                let label = format!("{:>w$}", s.action.to_string(), w = width);
                for cell in &mut line[s.start as usize..s.end.ceil() as usize] {
                    cell.clone_from(&label);
                }
            }
            out.push_str(&format!("stage {r:>2} |{}\n", line.join(" ")));
        }
        out
    }

    /// The timeline as an SVG picture.
    pub fn svg(&self, title: &str) -> String {
        let (unit, row, top, left) = (28.0, 30.0, 34.0, 70.0);
        let w = left + self.makespan * unit + 10.0;
        let h = top + self.spans.len() as f64 * row + 10.0;
        let mut s = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"monospace\" font-size=\"11\">\n\
             <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
             <text x=\"8\" y=\"20\" font-size=\"13\">{title} — bubble {:.1} %</text>\n",
            self.bubble * 100.0
        );
        for (r, spans) in self.spans.iter().enumerate() {
            let y = top + r as f64 * row;
            s.push_str(&format!(
                "<text x=\"8\" y=\"{}\">stage {r}</text>\n",
                y + row * 0.6
            ));
            for sp in spans {
                let color = match sp.action {
                    Action::Forward { .. } => "#4e79a7",
                    Action::Backward { .. } => "#e15759",
                    Action::BackwardInput { .. } => "#f28e2b",
                    Action::BackwardWeight { .. } => "#59a14f",
                };
                let x = left + sp.start * unit;
                let wd = (sp.end - sp.start) * unit;
                s.push_str(&format!(
                    "<rect x=\"{x}\" y=\"{y}\" width=\"{}\" height=\"{}\" fill=\"{color}\" stroke=\"white\"/>\
                     <text x=\"{}\" y=\"{}\" fill=\"white\" text-anchor=\"middle\">{}</text>\n",
                    wd - 1.0,
                    row - 4.0,
                    x + wd / 2.0,
                    y + row * 0.6,
                    sp.action
                ));
            }
        }
        s.push_str("</svg>\n");
        s
    }
}
