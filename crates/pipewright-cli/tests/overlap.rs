//! `--no-overlap`: the data-parallel gradient sums after the schedule instead of during the
//! backward give the same losses, to the last digit written, and the run's record says which;
//! so do buckets of 10 KiB (`--bucket-mb`), and a bucket of no bytes is refused. Under ZeRO-3,
//! layers gathered ahead (`--zero-live-layers`, default 2) and gathered when needed (1) give the
//! same losses too, and no live layer is refused. summary.json has each rank's exposed
//! communication.

mod common;

use common::{losses, text, tmp, train, TINY};

#[test]
fn no_overlap_trains_to_the_same_losses_and_is_recorded() {
    let mut runs = Vec::new();
    let runs_of: [(&str, &[&str]); 5] = [
        ("on", &[]),
        ("off", &["--no-overlap"]),
        ("small-buckets", &["--bucket-mb", "0.01"]),
        ("zero3", &["--zero", "3"]),
        (
            "zero3-one-live",
            &["--zero", "3", "--zero-live-layers", "1"],
        ),
    ];
    for (name, flags) in runs_of {
        let out = tmp(&format!("overlap-{name}"));
        let mut a = vec![
            "--task",
            "adder",
            "--steps",
            "6",
            "--dp",
            "2",
            "--pp",
            "2",
            "--chunks",
            "2",
            "--log-every",
            "1",
            "--out",
        ];
        a.push(out.to_str().unwrap());
        a.extend_from_slice(TINY);
        a.extend_from_slice(flags);
        let o = train(&a);
        assert!(o.status.success(), "{}", text(&o));
        let params = std::fs::read_to_string(out.join("params.json")).unwrap();
        assert_eq!(
            params.contains("\"overlap\": false"),
            name == "off",
            "{params}"
        );
        // Each of the 4 ranks' exposed communication, the replicas' sums waited on.
        let summary = std::fs::read_to_string(out.join("summary.json")).unwrap();
        let summary: serde_json::Value = serde_json::from_str(&summary).unwrap();
        let exposed = summary["exposed_comm_per_rank"].as_array().unwrap();
        assert_eq!(exposed.len(), 4, "{summary}");
        assert!(
            exposed.iter().all(|e| e.as_f64().unwrap() > 0.0),
            "{summary}"
        );
        let one_live = params.contains("\"zero_live_layers\": 1");
        assert_eq!(one_live, name == "zero3-one-live", "{params}");
        runs.push(losses(&out));
    }
    assert_eq!(runs[0].len(), 6);
    assert_eq!(runs[0], runs[1], "losses with and without overlap");
    assert_eq!(runs[0], runs[2], "losses with 10 KiB buckets");
    assert_eq!(
        runs[3], runs[4],
        "ZeRO-3's losses with and without gathers ahead"
    );
    common::refused(&["train", "--bucket-mb", "0"], "--bucket-mb");
    common::refused(&["train", "--zero-live-layers", "0"], "--zero-live-layers");
}

/// The trace shows the sums beside the backward: with overlap each stage's first sum of a
/// step starts before its last pipeline action ends, on the stage's communication track; with
/// `--no-overlap` every sum starts after it.
#[test]
fn the_trace_shows_the_sums_beside_the_backward() {
    for (name, off) in [("trace-on", false), ("trace-off", true)] {
        let out = tmp(name);
        let trace = out.join("trace.json");
        std::fs::create_dir_all(&out).unwrap();
        let mut a = vec!["--task", "adder", "--steps", "2", "--out"];
        a.push(out.to_str().unwrap());
        a.extend_from_slice(TINY);
        // Two blocks, one a stage, and 1 KiB buckets: a block's sums start before the backward
        // through the stage's other layers ends.
        let flags = [
            "--pp",
            "2",
            "--dp",
            "2",
            "--n-layer",
            "2",
            "--bucket-mb",
            "0.001",
        ];
        a.extend_from_slice(&flags);
        a.extend_from_slice(&["--trace", trace.to_str().unwrap()]);
        if off {
            a.push("--no-overlap");
        }
        let o = train(&a);
        assert!(o.status.success(), "{}", text(&o));
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
        let events: Vec<&serde_json::Value> = (doc["traceEvents"].as_array().unwrap().iter())
            .filter(|e| e["ph"] == "X" && e["args"]["step"] == 1)
            .collect();
        for stage in 0..2u64 {
            let on = |tid: u64| events.iter().filter(move |e| e["tid"] == tid);
            let at = |e: &&&serde_json::Value, dur: f64| {
                e["ts"].as_f64().unwrap() + dur * e["dur"].as_f64().unwrap()
            };
            let last_action = on(stage).map(|e| at(&e, 1.0)).fold(f64::MIN, f64::max);
            let sums: Vec<f64> = on(1000 + stage).map(|e| at(&e, 0.0)).collect();
            assert!(
                !sums.is_empty(),
                "{name}: stage {stage} has sums: {events:?}"
            );
            let first_sum = sums.iter().copied().fold(f64::MAX, f64::min);
            let beside = first_sum < last_action;
            assert_eq!(beside, !off, "{name}, stage {stage}: {events:?}");
        }
    }
}
