//! `pipewright sweep` end to end: four runs two at a time, one made to fail.

mod common;

#[test]
fn a_sweep_runs_every_value_keeps_going_past_a_failure_and_says_so() {
    let out = std::env::temp_dir().join(format!("pw-sweep-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let o = common::pipewright()
        .args([
            "sweep",
            "--param",
            "steps=2,3,0,4",
            "--max-parallel",
            "2",
            "--out",
        ])
        .arg(&out)
        .args([
            "--",
            "pipewright",
            "train",
            "--n-layer",
            "1",
            "--n-embd",
            "16",
            "--n-head",
            "2",
        ])
        .args(["--batch-size", "8", "--eval-every", "1"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout).to_string();
    let stderr = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(
        !o.status.success(),
        "a failed run fails the sweep: {stdout}"
    );
    assert!(stderr.contains("1 of 4 runs failed"), "{stderr}");
    let failed: Vec<&str> = stdout.lines().filter(|l| l.contains("FAILED")).collect();
    assert!(
        failed.len() == 1 && failed[0].trim_start().starts_with('0'),
        "{stdout}"
    );

    let csv = std::fs::read_to_string(out.join("sweep.csv")).unwrap();
    let rows: Vec<Vec<&str>> = csv
        .lines()
        .skip(1)
        .map(|l| l.split(',').collect())
        .collect();
    assert_eq!(rows.len(), 4);
    let mut spans = Vec::new();
    for r in &rows {
        let steps: u64 = r[0].parse().unwrap();
        let ok = r[5] == "ok";
        assert_eq!(ok, steps > 0, "{csv}");
        if ok {
            // The run got its value and its own directory.
            let dir = out.join(format!("steps={steps}"));
            let s: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap())
                    .unwrap();
            assert_eq!(s["steps"], steps);
            assert_eq!(
                r[1].parse::<f64>().unwrap(),
                s["final_loss"].as_f64().unwrap()
            );
        }
        let (start, secs): (f64, f64) = (r[4].parse().unwrap(), r[3].parse().unwrap());
        spans.push((start, start + secs));
    }
    // Never three at once: at each start, fewer than two others are running (to the
    // microsecond the CSV keeps).
    for &(s, _) in &spans {
        let running = spans
            .iter()
            .filter(|&&(a, b)| a < s && s + 2e-6 < b)
            .count();
        assert!(running < 2, "{csv}");
    }
    // ... and two did run at once.
    let overlap = spans.iter().any(|&(s, e)| {
        spans
            .iter()
            .any(|&(a, b)| (a, b) != (s, e) && a < e && s < b)
    });
    assert!(overlap, "{csv}");
    std::fs::remove_dir_all(&out).unwrap();
}
