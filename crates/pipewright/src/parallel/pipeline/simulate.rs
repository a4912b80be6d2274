//! Simulating a schedule: the lists are checked to be complete (`validate_complete`) and
//! replayed in time, which finds any deadlock and gives the makespan, the bubble and the
//! activations each rank holds ([`Schedule::simulate`]).
//!
//! Replaying: each pipeline rank runs its list in order, an
//! action starting when its rank is free and what it needs has arrived (the forward of the
//! model stage before, the gradient of the one after, plus the hop between them). Ranks that
//! share processors (several ranks on one CPU) slow each other down: with `slots` ranks able
//! to compute at full speed at once, `b` busy ranks each progress at `min(1, slots / b)`, and
//! at a further `crowded` efficiency while they outnumber the slots ([`Sharing`]); an action
//! whose rank waits inside it for part of its time (a tensor-parallel group's collectives)
//! needs the processors for only that share of its time, and progresses the faster for it.
//!
//! Running actions that compute the same share of their time progress at the same rate, so
//! each such class keeps its running actions in a heap by the amount of its work done (at
//! full speed) at which they end; rates change only at events.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::schedule::{Action, Schedule};
use super::sharing::Sharing;
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

/// Running actions that compute the same share of their time, progressing at one rate.
struct Class {
    share: f64,
    /// Seconds of work (at full speed) each of its actions has done since the start, as if it
    /// had run throughout.
    work: f64,
    running: BinaryHeap<Reverse<(Time, usize)>>,
}

impl Class {
    fn new(share: f64) -> Class {
        Class {
            share,
            work: 0.0,
            running: BinaryHeap::new(),
        }
    }

    /// The class of `classes` whose actions compute `share` of their time, added if new.
    fn of(classes: &mut Vec<Class>, share: f64) -> &mut Class {
        let i = match classes.iter().position(|c| c.share == share) {
            Some(i) => i,
            None => {
                classes.push(Class::new(share));
                classes.len() - 1
            }
        };
        &mut classes[i]
    }
}

/// The running action that ends first (the lowest rank among equals) with `b` actions
/// running at `now`: when, its rank, and its class.
fn first_end(
    classes: &[Class],
    now: f64,
    sharing: Sharing,
    b: usize,
) -> Option<(f64, usize, usize)> {
    classes
        .iter()
        .enumerate()
        .filter_map(|(i, c)| {
            let Reverse((w, r)) = *c.running.peek()?;
            Some((now + (w.0 - c.work) / sharing.rate(b, c.share), r, i))
        })
        .min_by(|x, y| x.0.total_cmp(&y.0).then(x.1.cmp(&y.1)))
}

/// When action `a` can start, at `now` or later: once what it needs has ended (`fwd` and
/// `grad` by model stage and micro-batch, `m` of them) and crossed from another rank
/// (`transfer`; stages on one rank, a V's turn, pass their tensors without a hop); `None`
/// while something it needs has not ended.
fn starts_at(
    a: &Action,
    now: f64,
    placement: &[usize],
    (fwd, grad, m): (&[Option<f64>], &[Option<f64>], usize),
    transfer: &dyn Fn(usize, usize) -> f64,
) -> Option<f64> {
    let k = a.stage();
    let (deps, n) = needs(a, k, placement.len() - 1);
    let mut at = now;
    for &(is_f, ks) in &deps[..n] {
        let t = (if is_f { fwd } else { grad })[ks * m + a.mb()]?;
        let hop = placement[ks] != placement[k];
        at = at.max(t + if hop { transfer(ks, k) } else { 0.0 });
    }
    Some(at)
}

/// Runs the lists of `s`: `cost(k, a)` seconds of `a` on model stage `k` at full speed,
/// `transfer(from, to)` seconds for what crosses between model stages of two ranks, the ranks
/// sharing processors as `sharing` says, `busy(k, a)` the share of `a`'s time it computes.
/// Fails, naming what each stuck rank waits for, when no rank can move. `placement`: the rank
/// of each stage ([`validate_complete`] has worked it out).
fn run(
    s: &Schedule,
    placement: &[usize],
    cost: &dyn Fn(usize, &Action) -> f64,
    transfer: &dyn Fn(usize, usize) -> f64,
    sharing: Sharing,
    busy: &dyn Fn(usize, &Action) -> f64,
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
    // Ranks whose next action can start, by when; running actions by the share of their
    // time they compute (one class where ranks have their own processors, the share then
    // changing nothing): the class's work done so far, and its actions by the work at which
    // they end.
    let mut ready: BinaryHeap<Reverse<(Time, usize)>> = BinaryHeap::new();
    let mut classes: Vec<Class> = Vec::new();
    let (mut now, mut b) = (0f64, 0usize);
    // Queues rank r's next action if what it needs is known.
    let check = |r: usize,
                 now: f64,
                 ptr: &[usize],
                 fwd: &[Option<f64>],
                 grad: &[Option<f64>],
                 active: &mut [bool],
                 ready: &mut BinaryHeap<Reverse<(Time, usize)>>| {
        let next = s.actions[r].get(ptr[r]).filter(|_| !active[r]);
        let Some(at) = next.and_then(|a| starts_at(a, now, placement, (fwd, grad, m), transfer))
        else {
            return;
        };
        active[r] = true;
        ready.push(Reverse((Time(at), r)));
    };
    for r in 0..p {
        check(r, 0.0, &ptr, &fwd, &grad, &mut active, &mut ready);
    }
    loop {
        let next_end = first_end(&classes, now, sharing, b);
        let next_start = ready.peek().map(|Reverse((t, _))| t.0.max(now));
        // Every class progresses at its rate until `t`.
        let advance = |classes: &mut [Class], t: f64| {
            for c in classes.iter_mut() {
                c.work += (t - now) * sharing.rate(b, c.share);
            }
        };
        match (next_start, next_end) {
            (Some(t), end) if end.is_none_or(|e| t <= e.0) => {
                let Reverse((_, r)) = ready.pop().expect("peeked");
                advance(&mut classes, t);
                now = t;
                let a = s.actions[r][ptr[r]];
                started[r] = now;
                let w = cost(a.stage(), &a).max(0.0);
                let share = if sharing.slots.is_finite() {
                    busy(a.stage(), &a)
                } else {
                    1.0
                };
                let c = Class::of(&mut classes, share);
                c.running.push(Reverse((Time(c.work + w), r)));
                b += 1;
            }
            (_, Some((end, r, i))) => {
                advance(&mut classes, end);
                let Reverse((w, _)) = classes[i].running.pop().expect("peeked");
                classes[i].work = w.0;
                (now, b) = (end, b - 1);
                let a = s.actions[r][ptr[r]];
                let k = a.stage();
                let table = match a {
                    Action::Forward { .. } => Some(&mut fwd),
                    Action::Backward { .. } | Action::BackwardInput { .. } => Some(&mut grad),
                    Action::BackwardWeight { .. } => None,
                };
                if let Some(t) = table {
                    t[k * m + a.mb()] = Some(now);
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
                    check(
                        placement[ks],
                        now,
                        &ptr,
                        &fwd,
                        &grad,
                        &mut active,
                        &mut ready,
                    );
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
/// one weight gradient) of every micro-batch, and nothing else; the rank of each stage.
fn validate_complete(s: &Schedule) -> Result<Vec<usize>> {
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
    Ok(placement)
}

impl Schedule {
    /// Checks the lists and simulates them under `costs`.
    pub fn simulate(&self, costs: Costs) -> Result<Simulation> {
        let throughout = |_: usize, _: &Action| 1.0;
        self.simulate_with(
            &|_, a| costs.of(a),
            &|_, _| 0.0,
            Sharing::ALONE,
            &throughout,
        )
    }

    /// Checks the lists and simulates them with `cost(model stage, action)` seconds per
    /// action and `transfer(from, to)` seconds for what crosses from one model stage to
    /// another held by another rank (the planner's costs: every stage its own durations, the
    /// links their delays),
    /// the ranks sharing processors as `sharing` says (ranks sharing a CPU slow each other
    /// down; [`Sharing::ALONE`] when every rank has its own device), and `busy(model stage,
    /// action)` the share of the action's time its rank computes rather than waits inside it
    /// (1 where ranks compute throughout; it matters only where ranks share processors).
    pub fn simulate_with(
        &self,
        cost: &dyn Fn(usize, &Action) -> f64,
        transfer: &dyn Fn(usize, usize) -> f64,
        sharing: Sharing,
        busy: &dyn Fn(usize, &Action) -> f64,
    ) -> Result<Simulation> {
        let placement = validate_complete(self)?;
        run(self, &placement, cost, transfer, sharing, busy)
    }

    /// [`Schedule::simulate`] under [`Costs::unit`]: complete and deadlock-free, or an error
    /// that names what each stuck rank waits for.
    pub fn validate(&self) -> Result<Simulation> {
        self.simulate(Costs::unit())
    }
}
