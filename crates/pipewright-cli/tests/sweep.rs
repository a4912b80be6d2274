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

#[test]
fn an_interrupted_sweep_stops_its_runs_and_says_which_ran_their_course() {
    let out = std::env::temp_dir().join(format!("pw-sweep-int-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let child = common::pipewright()
        .args(["sweep", "--param", "seed=1,2", "--out"])
        .arg(&out)
        .args([
            "--",
            "pipewright",
            "train",
            "--n-layer",
            "1",
            "--n-embd",
            "16",
        ])
        .args(["--n-head", "2", "--batch-size", "8", "--steps", "100000"])
        .args(["--eval-every", "100000", "--checkpoint-every", "1000"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Once the first run has trained a few steps, Ctrl-C to the sweep's process alone.
    let scalars = out.join("seed=1/scalars.csv");
    let t = std::time::Instant::now();
    while std::fs::read_to_string(&scalars).map_or(0, |s| s.lines().count()) < 4 {
        assert!(t.elapsed().as_secs() < 60, "the first run made no steps");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // SAFETY: signalling the child this test started.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let o = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        !o.status.success(),
        "an interrupted sweep succeeded: {stdout}"
    );
    assert_eq!(
        o.status.code(),
        Some(1),
        "it ends by itself, not by the signal"
    );
    let csv = std::fs::read_to_string(out.join("sweep.csv")).unwrap();
    let rows: Vec<&str> = csv.lines().skip(1).collect();
    assert!(rows[0].contains("interrupted"), "{csv}");
    assert!(rows[1].contains("not started"), "{csv}");
    // The run saved where it stopped, and no run is left behind.
    assert!(out.join("seed=1/checkpoints/latest").exists(), "{csv}");
    assert!(
        !out.join("seed=1/.lock").exists(),
        "the run still holds its directory"
    );
    assert!(!out.join("seed=2").exists());
    let _ = std::fs::remove_dir_all(&out);
}
