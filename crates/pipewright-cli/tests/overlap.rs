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
