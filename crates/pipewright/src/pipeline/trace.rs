//! Tracing executed pipeline actions: what each rank ran, when, how long, and how much of it
//! was spent waiting for a neighbour; written as a Chrome trace (Perfetto) with one track per
//! stage.

use super::schedule::Action;

/// One executed action, for a Chrome trace.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceEvent {
    pub step: u64,
    pub action: Action,
    /// Microseconds since the pipeline was made.
    pub start_us: f64,
    pub dur_us: f64,
    /// True when the action recomputed its forward first (traced as R plus the backward).
    pub recomputed: bool,
    /// Microseconds of the action spent waiting for a neighbour's tensor (the rest computed).
    pub wait_us: f64,
}

/// A Chrome trace (Perfetto, chrome://tracing): one track per pipeline stage, one event per
/// action named F, B (or R+B when recomputed), I or W with the micro-batch.
pub fn chrome_trace(per_stage: &[Vec<TraceEvent>]) -> String {
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
                "args": {"step": e.step, "micro_batch": e.action.mb(), "chunk": e.action.chunk()}
            }));
        }
    }
    serde_json::json!({"traceEvents": events, "displayTimeUnit": "ms"}).to_string()
}
