//! Simulating a schedule: the lists are checked to be complete (`validate_complete`) and
//! replayed in time, which finds any deadlock and gives the makespan, the bubble and the
//! activations each rank holds ([`Schedule::simulate`]).
//!
//! Replaying: each pipeline rank runs its list in order, an
//! action starting when its rank is free and what it needs has arrived (the forward of the
//! model stage before, the gradient of the one after, plus the hop between them). Ranks that
//! share processors (several ranks on one CPU) slow each other down: with `slots` ranks able
//! to compute at full speed at once, `b` busy ranks each progress at `min(1, slots / b)`, and
//! at a further `crowded` efficiency while they outnumber the slots ([`Sharing`]).
//!
//! Every running action progresses at the same rate, so they are kept in a heap by the
//! amount of work done (at full speed) at which they end; rates change only at events.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::schedule::{Action, Schedule};
use super::timeline::{Costs, Simulation, Span};
use crate::{invalid, Result};

/// An f64 that orders (never NaN here: costs and times are finite).
#[derive(Clone, Copy)]
struct Time(f64);

impl PartialEq for Time {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other).is_eq()
    }
}

impl Eq for Time {}

impl PartialOrd for Time {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Time {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// What an action on model stage `k` needs: (is a forward, model stage), `n` of them.
fn needs(a: &Action, k: usize, last: usize) -> ([(bool, usize); 2], usize) {
    match a {
        Action::Forward { .. } if k > 0 => ([(true, k - 1); 2], 1),
        Action::Forward { .. } => ([(true, k); 2], 0),
        Action::Backward { .. } | Action::BackwardInput { .. } if k < last => {
            ([(true, k), (false, k + 1)], 2)
        }
        Action::Backward { .. } | Action::BackwardInput { .. } => ([(true, k); 2], 1),
        Action::BackwardWeight { .. } => ([(false, k); 2], 1),
    }
}

/// How pipeline ranks share processors in a simulation: `slots` ranks compute at full speed
/// at once (infinity: every rank has its own device); while `b` busy ranks outnumber them,
/// each progresses at `slots / b` times `crowded`, the efficiency the processors keep when
/// they switch between more threads than they have (on this machine: context switches and
/// wake-ups; measured by `pipewright profile --concurrent`, 1 where not measured), and while
/// more than one is busy, times `across` too (never above full speed).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sharing {
    /// Ranks computing at full speed at once.
    pub slots: f64,
    /// The efficiency of processors crowded by more busy ranks than slots, in (0, 1].
    pub crowded: f64,
    /// The further factor while ranks of several stages are busy at once: ranks of different
    /// stages run out of step, so what one waits inside its actions (a tensor-parallel
    /// group's collectives) another computes in. The ranks of one stage run in step and wait
    /// together, so one busy rank (a stage and its replicas) gains nothing. 1 where ranks
    /// compute throughout their actions.
    pub across: f64,
}

impl Sharing {
    /// Every rank on its own processor.
    pub const ALONE: Sharing = Sharing {
        slots: f64::INFINITY,
        crowded: 1.0,
        across: 1.0,
    };

    /// The speed of each of `busy` running actions, as a share of full speed.
    pub fn rate(&self, busy: usize) -> f64 {
        let b = busy as f64;
        if b <= self.slots {
            return 1.0;
        }
        let across = if busy > 1 { self.across } else { 1.0 };
        (self.slots / b * self.crowded * across).min(1.0)
    }
}

/// Runs the lists of `s`: `cost(k, a)` seconds of `a` on model stage `k` at full speed,
/// `transfer(from, to)` seconds for what crosses between model stages, the ranks sharing
/// processors as `sharing` says. Fails, naming what each stuck rank waits for, when no rank
/// can move.
fn run(
    s: &Schedule,
    cost: &dyn Fn(usize, &Action) -> f64,
    transfer: &dyn Fn(usize, usize) -> f64,
    sharing: Sharing,
) -> Result<Simulation> {
    let (p, m) = (s.ranks, s.micro_batches);
    let last = s.stages - 1;
    // When the forward / the input gradient of (model stage k, mb) ended, at k * m + mb.
    let mut fwd: Vec<Option<f64>> = vec![None; (last + 1) * m];
    let mut grad: Vec<Option<f64>> = vec![None; (last + 1) * m];
    let mut ptr = vec![0usize; p];
    let mut spans: Vec<Vec<Span>> = vec![Vec::new(); p];
    let mut started = vec![0f64; p];
    // Queued or running: not to be queued again until its action ends.
    let mut active = vec![false; p];
    // Ranks whose next action can start, by when; running actions, by the work at which
    // they end.
    let mut ready: BinaryHeap<Reverse<(Time, usize)>> = BinaryHeap::new();
    let mut running: BinaryHeap<Reverse<(Time, usize)>> = BinaryHeap::new();
    let (mut now, mut work) = (0f64, 0f64);
    // Queues rank r's next action if what it needs is known.
    let check = |r: usize,
                 now: f64,
                 ptr: &[usize],
                 fwd: &[Option<f64>],
                 grad: &[Option<f64>],
                 active: &mut [bool],
                 ready: &mut BinaryHeap<Reverse<(Time, usize)>>| {
        if active[r] {
            return;
        }
        let Some(a) = s.actions[r].get(ptr[r]) else {
            return;
        };
        let k = a.stage();
        let (deps, n) = needs(a, k, last);
        let mut at = now;
        for &(is_f, ks) in &deps[..n] {
            let table = if is_f { fwd } else { grad };
            let Some(t) = table[ks * m + a.mb()] else {
                return;
            };
            at = at.max(t + if ks == k { 0.0 } else { transfer(ks, k) });
        }
        active[r] = true;
        ready.push(Reverse((Time(at), r)));
    };
    for r in 0..p {
        check(r, 0.0, &ptr, &fwd, &grad, &mut active, &mut ready);
    }
    loop {
        let rate = sharing.rate(running.len());
        let next_end = running
            .peek()
            .map(|Reverse((w, _))| now + (w.0 - work) / rate);
        let next_start = ready.peek().map(|Reverse((t, _))| t.0.max(now));
        match (next_start, next_end) {
            (Some(t), end) if end.is_none_or(|e| t <= e) => {
                let Reverse((_, r)) = ready.pop().expect("peeked");
                work += (t - now) * rate;
                now = t;
                let a = s.actions[r][ptr[r]];
                started[r] = now;
                let w = cost(a.stage(), &a).max(0.0);
                running.push(Reverse((Time(work + w), r)));
            }
            (_, Some(end)) => {
                let Reverse((w, r)) = running.pop().expect("peeked");
                work = w.0;
                now = end;
                let a = s.actions[r][ptr[r]];
                let k = a.stage();
                match a {
                    Action::Forward { .. } => fwd[k * m + a.mb()] = Some(now),
                    Action::Backward { .. } | Action::BackwardInput { .. } => {
                        grad[k * m + a.mb()] = Some(now)
                    }
                    Action::BackwardWeight { .. } => {}
                }
                spans[r].push(Span {
                    start: started[r],
                    end: now,
                    action: a,
                });
                ptr[r] += 1;
                active[r] = false;
                // Who may move now: this rank, and the ranks of the neighbouring stages.
                let neighbours = [Some(k), k.checked_sub(1), (k < last).then_some(k + 1)];
                for ks in neighbours.into_iter().flatten() {
                    check(ks % p, now, &ptr, &fwd, &grad, &mut active, &mut ready);
                }
            }
            _ => break,
        }
    }
    if (0..p).any(|r| ptr[r] < s.actions[r].len()) {
        return Err(deadlock(s, &ptr, &fwd, &grad));
    }
    let makespan = spans.iter().flatten().map(|s| s.end).fold(0.0, f64::max);
    Ok(Simulation::from_spans(s, spans, makespan))
}

/// The error of a schedule where no rank can move: what each stuck rank waits for.
fn deadlock(
    s: &Schedule,
    ptr: &[usize],
    fwd: &[Option<f64>],
    grad: &[Option<f64>],
) -> crate::Error {
    let (m, last) = (s.micro_batches, s.stages - 1);
    let stuck: Vec<String> = (0..s.ranks)
        .filter_map(|r| {
            s.actions[r].get(ptr[r]).map(|a| {
                let k = a.stage();
                let (deps, n) = needs(a, k, last);
                let waits: Vec<String> = deps[..n]
                    .iter()
                    .filter(|(is_f, ks)| {
                        let table = if *is_f { fwd } else { grad };
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
                format!("rank {r} at {a} waits for {}", waits.join(", "))
            })
        })
        .collect();
    invalid!("schedule deadlocks: {}", stuck.join("; "))
}

/// Every stage has, on the rank that holds it, one forward and one backward (or one input and
/// one weight gradient) of every micro-batch, and nothing else.
fn validate_complete(s: &Schedule) -> Result<()> {
    let (m, stages) = (s.micro_batches, s.stages);
    if s.actions.len() != s.ranks {
        return Err(invalid!(
            "schedule has lists for {} ranks, expected {}",
            s.actions.len(),
            s.ranks
        ));
    }
    let placement = s.placement()?;
    // Per rank, how often each action appears, in a dense table (the planner validates
    // thousands of schedules; hashing each action was half of its time).
    let idx = |a: &Action| {
        let kind = match a {
            Action::Forward { .. } => 0,
            Action::Backward { .. } => 1,
            Action::BackwardInput { .. } => 2,
            Action::BackwardWeight { .. } => 3,
        };
        (kind * stages + a.stage()) * m + a.mb()
    };
    let mut seen = vec![0usize; 4 * stages * m];
    for (r, list) in s.actions.iter().enumerate() {
        seen.fill(0);
        for a in list {
            if a.mb() >= m || a.stage() >= stages {
                return Err(invalid!(
                    "rank {r}: {a} names a micro-batch or stage outside {m} x {stages}"
                ));
            }
            let count = &mut seen[idx(a)];
            *count += 1;
            if *count > 1 {
                let n = list.iter().filter(|b| *b == a).count();
                return Err(invalid!("rank {r}: {a} appears {n} times"));
            }
        }
        for stage in (0..stages).filter(|k| placement[*k] == r) {
            for mb in 0..m {
                let has = |a: Action| seen[idx(&a)] > 0;
                if !has(Action::Forward { mb, stage }) {
                    return Err(invalid!(
                        "rank {r}: the forward of micro-batch {mb} on stage {stage} ({stage}F{mb}) is missing"
                    ));
                }
                let full = has(Action::Backward { mb, stage });
                let (i, w) = (
                    has(Action::BackwardInput { mb, stage }),
                    has(Action::BackwardWeight { mb, stage }),
                );
                if full == (i || w) || i != w {
                    return Err(invalid!(
                        "rank {r}: micro-batch {mb} on stage {stage} needs one backward ({stage}B{mb}), or one input and one weight gradient ({stage}I{mb}, {stage}W{mb})"
                    ));
                }
            }
        }
    }
    Ok(())
}

impl Schedule {
    /// Checks the lists and simulates them under `costs`.
    pub fn simulate(&self, costs: Costs) -> Result<Simulation> {
        self.simulate_with(&|_, a| costs.of(a), &|_, _| 0.0, Sharing::ALONE)
    }

    /// Checks the lists and simulates them with `cost(model stage, action)` seconds per
    /// action and `transfer(from, to)` seconds for what crosses from one model stage to
    /// another (the planner's costs: every stage its own durations, the links their delays),
    /// the ranks sharing processors as `sharing` says (ranks sharing a CPU slow each other
    /// down; [`Sharing::ALONE`] when every rank has its own device).
    pub fn simulate_with(
        &self,
        cost: &dyn Fn(usize, &Action) -> f64,
        transfer: &dyn Fn(usize, usize) -> f64,
        sharing: Sharing,
    ) -> Result<Simulation> {
        validate_complete(self)?;
        run(self, cost, transfer, sharing)
    }

    /// [`Schedule::simulate`] under [`Costs::unit`]: complete and deadlock-free, or an error
    /// that names what each stuck rank waits for.
    pub fn validate(&self) -> Result<Simulation> {
        self.simulate(Costs::unit())
    }
}
