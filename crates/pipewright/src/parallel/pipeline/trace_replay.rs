//! A traced step held against its schedule: how much of the step each rank sat idle as
//! measured (the time between its actions and the time its actions waited inside for a
//! neighbour's tensor), and the same schedule run by the simulator with the costs the trace
//! measured, each model stage's own forward, backward, input and weight pass (the median of its
//! micro-batches' computing time, the waits left out), the ranks sharing processors as the
//! caller says. Where
//! the two idle shares agree, the schedule's dependencies explain the measured bubble; where
//! the measured one is larger, something outside the schedule (a slow link, ranks crowding the
//! cores) cost the rest.

use std::collections::HashMap;

use super::schedule::{Action, Schedule};
use super::sharing::Sharing;
use super::timeline::Simulation;
use super::trace::step_events;
use crate::Result;

/// One step of a trace against the simulation of the schedule it ran.
#[derive(Clone, Debug)]
pub struct TraceReplay {
    /// The schedule the step ran: each rank's actions in the order it started them.
    pub schedule: Schedule,
    /// The share of the ranks' time in the step not spent computing: between actions, and
    /// inside them waiting for a neighbour.
    pub measured_idle: f64,
    /// The step's length, in seconds.
    pub measured_makespan: f64,
    /// The schedule simulated with each stage's measured median costs.
    pub simulated: Simulation,
}

/// The median of `v` (not empty).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Step `step` (default: the last) of a trace written by `pipewright train --trace`, measured
/// and simulated (see the module's text) with the ranks sharing processors as `sharing` says
/// (ranks as threads on a CPU of fewer cores than ranks take turns: [`Sharing`]'s slots).
pub fn replay_chrome_trace(text: &str, step: Option<u64>, sharing: Sharing) -> Result<TraceReplay> {
    let events = step_events(text, step)?;
    let ranks = events.iter().map(|e| e.rank + 1).max().unwrap_or(0);
    let mut lists: Vec<Vec<(f64, Action)>> = vec![Vec::new(); ranks];
    let mut costs: HashMap<(usize, char), Vec<f64>> = HashMap::new();
    let (mut computing, mut makespan) = (0.0, 0.0f64);
    for e in &events {
        lists[e.rank].push((e.start, e.action));
        let compute = (e.dur - e.wait).max(0.0);
        computing += compute;
        makespan = makespan.max(e.start + e.dur);
        costs
            .entry((e.action.stage(), e.action.letter()))
            .or_default()
            .push(compute);
    }
    let actions = lists
        .into_iter()
        .map(|mut l| {
            l.sort_by(|a, b| a.0.total_cmp(&b.0));
            l.into_iter().map(|(_, a)| a).collect()
        })
        .collect();
    let schedule = Schedule::from_actions(actions)?;
    let cost: HashMap<(usize, char), f64> =
        costs.into_iter().map(|(k, v)| (k, median(v))).collect();
    let simulated = schedule.simulate_with(
        &|k, a| cost.get(&(k, a.letter())).copied().unwrap_or(0.0),
        &|_, _| 0.0,
        sharing,
        &|_, _| 1.0,
    )?;
    let measured_idle = super::timeline::idle_share(computing, ranks, makespan);
    Ok(TraceReplay {
        schedule,
        measured_idle,
        measured_makespan: makespan,
        simulated,
    })
}
