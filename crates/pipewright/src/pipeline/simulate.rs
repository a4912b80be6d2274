//! Simulating a schedule: every action placed in time under given costs, which checks that
//! the lists are complete and deadlock-free, and gives the makespan, the bubble, the
//! activations each stage holds and the timeline picture (text or SVG).

use std::collections::HashMap;

use super::schedule::{Action, Schedule};
use crate::{invalid, Result};

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

    pub(super) fn of(&self, a: &Action) -> f64 {
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
pub(super) fn validate_complete(s: &Schedule) -> Result<()> {
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
/// it needs is done, plus `transfer(from, to)` seconds when what it needs was made on another
/// model stage (an activation or gradient crossing a cut). `cost(k, a)` is the duration of `a`
/// on model stage `k`. Fails, naming what each stuck stage waits for, if no stage can move.
pub(super) fn run(
    s: &Schedule,
    cost: &dyn Fn(usize, &Action) -> f64,
    transfer: &dyn Fn(usize, usize) -> f64,
) -> Result<Simulation> {
    let (p, m) = (s.stages, s.micro_batches);
    let last = p * s.chunks_per_stage - 1;
    // Finish time of the forward / of the input gradient of (model stage k, mb) at k * m + mb.
    let mut fwd: Vec<Option<f64>> = vec![None; (last + 1) * m];
    let mut grad: Vec<Option<f64>> = vec![None; (last + 1) * m];
    let mut ptr = vec![0usize; p];
    let mut free = vec![0f64; p];
    let mut spans: Vec<Vec<Span>> = vec![Vec::new(); p];
    // What an action on model stage k needs: (is forward table, model stage, micro-batch).
    let needs = |a: &Action, k: usize| -> ([(bool, usize); 2], usize) {
        match a {
            Action::Forward { .. } if k > 0 => ([(true, k - 1), (true, k - 1)], 1),
            Action::Forward { .. } => ([(true, k); 2], 0),
            Action::Backward { .. } | Action::BackwardInput { .. } if k < last => {
                ([(true, k), (false, k + 1)], 2)
            }
            Action::Backward { .. } | Action::BackwardInput { .. } => ([(true, k); 2], 1),
            Action::BackwardWeight { .. } => ([(false, k); 2], 1),
        }
    };
    loop {
        let mut moved = false;
        for r in 0..p {
            'list: while let Some(a) = s.actions[r].get(ptr[r]) {
                let k = s.model_stage(r, a.chunk());
                let (deps, n) = needs(a, k);
                let mut start = free[r];
                for &(is_f, ks) in &deps[..n] {
                    let table = if is_f { &fwd } else { &grad };
                    let Some(t) = table[ks * m + a.mb()] else {
                        break 'list;
                    };
                    let hop = if ks == k { 0.0 } else { transfer(ks, k) };
                    start = start.max(t + hop);
                }
                let end = start + cost(k, a);
                match a {
                    Action::Forward { .. } => fwd[k * m + a.mb()] = Some(end),
                    Action::Backward { .. } | Action::BackwardInput { .. } => {
                        grad[k * m + a.mb()] = Some(end)
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
                        let (deps, n) = needs(a, k);
                        let waits: Vec<String> = deps[..n]
                            .iter()
                            .filter(|(is_f, ks)| {
                                let table = if *is_f { &fwd } else { &grad };
                                table[ks * m + a.mb()].is_none()
                            })
                            .map(|(is_f, ks)| {
                                format!(
                                    "{} of micro-batch {} on model stage {ks}",
                                    if *is_f { "forward" } else { "gradient" },
                                    a.mb()
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
