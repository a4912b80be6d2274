//! What the planner's tests share: hand-made hardware, profiles and candidates whose step
//! times can be derived by hand.
// Each test binary uses some of it.
#![allow(dead_code)]

use pipewright::distributed::topology::Layout;
use pipewright::parallel::pipeline::schedule::ScheduleKind;
use pipewright::parallel::pipeline::Recompute;
use pipewright::plan::{Candidate, Fit, Hardware, LayerProfile, Link, Profile};

/// A hardware file with links of `latency_s` and no bandwidth limit worth the name.
pub fn hardware(latency_s: f64) -> Hardware {
    let link = Link {
        latency_s,
        bandwidth_bytes_per_s: 1e30,
        all_reduce: None,
    };
    Hardware {
        name: "test".into(),
        devices_per_node: 8,
        cores_per_device: 1,
        one_thread_share: None,
        memory: "1GiB".into(),
        peak_flops_f32: 1e12,
        peak_flops_half: 1e12,
        efficiency: 1.0,
        gemm_f32: None,
        gemm_half: None,
        memory_bandwidth_bytes_per_s: 1e9,
        runtime_memory: "1MiB".into(),
        intra_node: link,
        inter_node: link,
    }
}

/// `n` alike layers: forward `f` and backward `b` seconds per sample, `params` parameters,
/// `kept` bytes kept per sample, 100 output bytes per sample.
pub fn profile(n: usize, f: f64, b: f64, params: u64, kept: f64) -> Profile {
    let layer = |i: usize| LayerProfile {
        name: format!("l{i}"),
        params,
        tp_split: true,
        forward: Fit {
            fixed_s: 0.0,
            per_sample_s: f,
        },
        backward: Fit {
            fixed_s: 0.0,
            per_sample_s: b,
        },
        backward_input: None,
        backward_weight: None,
        output_bytes_per_sample: 100.0,
        kept_bytes_per_sample: kept,
        kept_whole_bytes_per_sample: 0.0,
        transient: None,
        split_kept_bytes_per_sample: None,
        deferred_bytes_per_sample: 0.0,
        tp_all_reduce_bytes_per_sample: 0.0,
        experts: None,
        split: Vec::new(),
        measured: Vec::new(),
        attention: None,
        shapes: None,
    };
    Profile {
        source: "test".into(),
        dtype_bytes: 4,
        layers: (0..n).map(layer).collect(),
        bounds: (0..=n).collect(),
        tp_divides: vec![4],
        threads: 1,
        optimizer: None,
        accumulate: None,
        crowded_efficiency: None,
        action_overhead: None,
    }
}

pub fn candidate(
    pp: usize,
    m: usize,
    rows: usize,
    schedule: ScheduleKind,
    recompute: Recompute,
) -> Candidate {
    Candidate {
        parallel: pipewright::parallel::dims::ParallelSpec::new(Layout::new(pp, 1, 1).unwrap()),
        micro_batch: rows,
        micro_batches: m,
        schedule: pipewright::parallel::pipeline::ScheduleChoice {
            kind: schedule,
            virtual_stages: 1,
            recompute,
        },
    }
}
