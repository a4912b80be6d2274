//! Tracing executed pipeline actions: what each rank ran, when, how long, and how much of it
//! was spent waiting for a neighbour; written as a Chrome trace (Perfetto) with one track per
//! stage.

use super::schedule::Action;
use super::timeline::{Simulation, Span};
use crate::{invalid, Result};

/// One executed action, for a Chrome trace.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceEvent {
    /// The optimizer step it belongs to.
    pub step: u64,
    /// What it was.
    pub action: Action,
    /// Microseconds since the pipeline was made.
    pub start_us: f64,
    /// How long it took, in microseconds.
    pub dur_us: f64,
    /// True when the action recomputed its forward first (traced as R plus the backward).
    pub recomputed: bool,
    /// Microseconds of the action spent waiting for a neighbour's tensor (the rest computed).
    pub wait_us: f64,
    /// Microseconds of CPU the rank's thread ran ([`crate::runtime::cpu_time`]; `None` where unknown;
    /// candle's pool threads beside it not counted): less than the time not spent waiting
    /// when the OS ran other ranks on its core meanwhile.
    pub cpu_us: Option<f64>,
}

/// One piece of data-parallel communication a rank ran beside its actions (a gradient bucket's
/// sum, a ZeRO reduce-scatter or gather), for a Chrome trace: from its start to the return of
/// the wait that completed it ([`crate::distributed::comm::waited::Span`]).
#[derive(Clone, Debug, PartialEq)]
pub struct CommEvent {
    /// The optimizer step it belongs to.
    pub step: u64,
    /// What it moved.
    pub what: String,
    /// Microseconds since the pipeline was made.
    pub start_us: f64,
    /// Microseconds from its start to the end of its wait.
    pub dur_us: f64,
    /// Microseconds of it the rank waited (the rest it computed, or did other work).
    pub wait_us: f64,
}

/// The track of stage `stage`'s communication, beside its actions' track `stage`.
const COMM_TRACK: usize = 1000;

/// A Chrome trace (Perfetto, chrome://tracing): one track per pipeline stage, one event per
/// action named as it prints (`1F3`: stage, letter, micro-batch), `R+` before it when recomputed,
/// with its step, micro-batch, stage, the microseconds of it spent waiting (`wait_us`) and the
/// CPU its thread ran (`cpu_us`); under each stage's track (`stage 0 comm`) its
/// data-parallel communication (`comm`, by stage, may be empty), so that the sums show beside
/// the backward that they overlap.
pub fn chrome_trace(per_stage: &[Vec<TraceEvent>], comm: &[Vec<CommEvent>]) -> String {
    let mut events = Vec::new();
    for (stage, evs) in per_stage.iter().enumerate() {
        events.push(serde_json::json!({
            "name": "thread_name", "ph": "M", "pid": 0, "tid": stage,
            "args": {"name": format!("stage {stage}")}
        }));
        for e in evs {
            let name = if e.recomputed {
                format!("R+{}", e.action)
            } else {
                e.action.to_string()
            };
            events.push(serde_json::json!({
                "name": name, "cat": e.action.letter().to_string(), "ph": "X", "pid": 0, "tid": stage,
                "ts": e.start_us, "dur": e.dur_us,
                "args": {"step": e.step, "micro_batch": e.action.mb(), "stage": e.action.stage(),
                         "wait_us": e.wait_us, "cpu_us": e.cpu_us}
            }));
        }
    }
    for (stage, evs) in comm.iter().enumerate().filter(|(_, e)| !e.is_empty()) {
        let tid = COMM_TRACK + stage;
        events.push(serde_json::json!({
            "name": "thread_name", "ph": "M", "pid": 0, "tid": tid,
            "args": {"name": format!("stage {stage} comm")}
        }));
        for e in evs {
            events.push(serde_json::json!({
                "name": e.what, "cat": "comm", "ph": "X", "pid": 0, "tid": tid,
                "ts": e.start_us, "dur": e.dur_us,
                "args": {"step": e.step, "stage": stage, "wait_us": e.wait_us}
            }));
        }
    }
    serde_json::json!({"traceEvents": events, "displayTimeUnit": "ms"}).to_string()
}

/// [`chrome_trace`] of each traced rank's actions and communication (`ranks`, one pair per
/// stage, in stage order) written to `path`.
pub fn write_chrome_trace(
    path: &std::path::Path,
    ranks: &[(Vec<TraceEvent>, Vec<CommEvent>)],
) -> Result<()> {
    let (actions, comm): (Vec<_>, Vec<_>) = ranks.iter().cloned().unzip();
    std::fs::write(path, chrome_trace(&actions, &comm))
        .map_err(|e| crate::Error::io("cannot write trace", path, e))
}

/// Whether `text` is a trace [`chrome_trace`] wrote (which `train --trace` may replace): a
/// Chrome trace whose events are pipeline stages'.
pub fn is_chrome_trace(text: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(text).is_ok_and(|d| {
        d["traceEvents"].as_array().is_some_and(|e| {
            e.is_empty()
                || e[0]["args"]["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("stage "))
        })
    })
}

/// Parses an action as traced: its printed form (`1F3`), `R+` before it when recomputed.
fn parse_action(name: &str) -> Option<Action> {
    name.strip_prefix("R+").unwrap_or(name).parse().ok()
}

/// One traced action of a step: the rank that ran it, what, and when, in seconds from the
/// step's first start (its duration, and the part of it spent waiting for a neighbour).
pub(super) struct StepEvent {
    pub rank: usize,
    pub action: Action,
    pub start: f64,
    pub dur: f64,
    pub wait: f64,
}

/// The actions of step `step` (default: the last) of a trace [`chrome_trace`] wrote.
pub(super) fn step_events(text: &str, step: Option<u64>) -> Result<Vec<StepEvent>> {
    let doc: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| invalid!("not a Chrome trace of `pipewright train --trace`: {e}"))?;
    let events = doc["traceEvents"]
        .as_array()
        .ok_or_else(|| invalid!("the trace has no traceEvents"))?;
    let actions: Vec<(u64, StepEvent)> = events
        .iter()
        .filter(|e| e["ph"] == "X")
        .filter_map(|e| {
            let us = |v: &serde_json::Value| v.as_f64().map(|t| t * 1e-6);
            Some((
                e["args"]["step"].as_u64()?,
                StepEvent {
                    rank: e["tid"].as_u64()? as usize,
                    action: parse_action(e["name"].as_str()?)?,
                    start: us(&e["ts"])?,
                    dur: us(&e["dur"])?,
                    wait: us(&e["args"]["wait_us"]).unwrap_or(0.0),
                },
            ))
        })
        .collect();
    let last = actions.iter().map(|a| a.0).max();
    let want = step
        .or(last)
        .ok_or_else(|| invalid!("the trace holds no pipeline actions"))?;
    let mut mine: Vec<StepEvent> = actions
        .into_iter()
        .filter(|a| a.0 == want)
        .map(|a| a.1)
        .collect();
    let Some(t0) = mine.iter().map(|a| a.start).min_by(f64::total_cmp) else {
        return Err(invalid!("the trace has no step {want}"));
    };
    for e in &mut mine {
        e.start -= t0;
    }
    Ok(mine)
}

/// One step of a trace written by [`chrome_trace`] (`pipewright train --trace`) as a
/// [`Simulation`]: each stage's actions in seconds from the step's first start, so that a
/// measured timeline can be drawn beside a predicted one. `step`: which (default: the last).
pub fn read_chrome_trace(text: &str, step: Option<u64>) -> Result<Simulation> {
    let mine = step_events(text, step)?;
    let stages = mine.iter().map(|a| a.rank + 1).max().unwrap_or(0);
    let mut spans: Vec<Vec<Span>> = vec![Vec::new(); stages];
    for e in mine {
        spans[e.rank].push(Span {
            start: e.start,
            end: e.start + e.dur,
            action: e.action,
        });
    }
    for row in &mut spans {
        row.sort_by(|a, b| a.start.total_cmp(&b.start));
    }
    let makespan = spans.iter().flatten().map(|s| s.end).fold(0.0, f64::max);
    let busy: f64 = spans.iter().flatten().map(|s| s.end - s.start).sum();
    let bubble = super::timeline::idle_share(busy, stages, makespan);
    Ok(Simulation {
        spans,
        makespan,
        bubble,
        peak_in_flight: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_trace_reads_back_as_its_last_step() {
        let ev = |step, action, start_us, dur_us, recomputed| TraceEvent {
            step,
            action,
            start_us,
            dur_us,
            recomputed,
            wait_us: 0.0,
            cpu_us: Some(1.5),
        };
        let f = Action::Forward { mb: 1, stage: 1 };
        let b = Action::Backward { mb: 1, stage: 1 };
        let w = Action::BackwardWeight { mb: 0, stage: 0 };
        let sum = CommEvent {
            step: 1,
            what: "all-reduce 1024.0 KiB".into(),
            start_us: 130.0,
            dur_us: 40.0,
            wait_us: 10.0,
        };
        let trace = chrome_trace(
            &[
                vec![ev(0, f, 0.0, 5.0, false), ev(1, f, 100.0, 10.0, false)],
                vec![ev(1, b, 120.0, 30.0, true), ev(1, w, 150.0, 5.0, false)],
            ],
            &[vec![], vec![sum]],
        );
        let sim = read_chrome_trace(&trace, None).unwrap();
        let got: Vec<Vec<(Action, f64, f64)>> = sim
            .spans
            .iter()
            .map(|r| {
                r.iter()
                    .map(|s| (s.action, s.start * 1e6, s.end * 1e6))
                    .collect()
            })
            .collect();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-6;
        assert_eq!(got.len(), 2);
        assert!(got[0].len() == 1 && got[0][0].0 == f && close(got[0][0].2, 10.0));
        assert_eq!(got[1].iter().map(|s| s.0).collect::<Vec<_>>(), vec![b, w]);
        assert!(close(got[1][0].1, 20.0) && close(got[1][1].2, 55.0));
        assert!((sim.makespan - 55e-6).abs() < 1e-12);
        // Step 0 holds the first forward alone; a step it lacks is an error.
        assert_eq!(
            read_chrome_trace(&trace, Some(0)).unwrap().spans[0].len(),
            1
        );
        assert!(read_chrome_trace(&trace, Some(7)).is_err());
        assert!(read_chrome_trace("{}", None).is_err());
        // Each event carries what it waited and what CPU its thread ran.
        let doc: serde_json::Value = serde_json::from_str(&trace).unwrap();
        let args: Vec<_> = doc["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["ph"] == "X" && e["cat"] != "comm")
            .map(|e| (e["args"]["wait_us"].as_f64(), e["args"]["cpu_us"].as_f64()))
            .collect();
        assert_eq!(args, vec![(Some(0.0), Some(1.5)); 4]);
        // The sum is on stage 1's communication track, read back as no action.
        let comm: Vec<_> = (doc["traceEvents"].as_array().unwrap().iter())
            .filter(|e| e["cat"] == "comm")
            .map(|e| {
                (
                    e["tid"].as_u64(),
                    e["ts"].as_f64(),
                    e["args"]["wait_us"].as_f64(),
                )
            })
            .collect();
        assert_eq!(comm, vec![(Some(1001), Some(130.0), Some(10.0))]);
    }
}
