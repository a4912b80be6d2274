//! Nothing a user does loses data: Ctrl-C saves and stops like SIGTERM and leaves whole rows;
//! commands that write refuse to overwrite what they did not make; a run directory belongs to
//! one run at a time.

mod common;

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{pipewright, run, text, tmp, train, TINY};

/// Rows of `scalars.csv` after its header; each must be whole (every column, a newline).
fn whole_rows(out: &Path) -> Vec<String> {
    let csv = std::fs::read_to_string(out.join("scalars.csv")).unwrap_or_default();
    assert!(
        csv.is_empty() || csv.ends_with('\n'),
        "a torn last row:\n{csv}"
    );
    let rows: Vec<String> = csv.lines().skip(1).map(String::from).collect();
    for r in &rows {
        let cols: Vec<&str> = r.split(',').collect();
        assert_eq!(cols.len(), 4, "a torn row `{r}`");
        assert!(cols[..3].iter().all(|c| c.parse::<f64>().is_ok()), "{r}");
    }
    rows
}

/// Starts a long run into `out`, waits for `rows` steps, sends `signals` (each after the
/// previous), and returns its output.
fn interrupted(out: &Path, signals: &[i32], rows: usize) -> std::process::Output {
    let mut a: Vec<&str> = TINY.to_vec();
    a.extend_from_slice(&["--steps", "100000", "--eval-every", "100000", "--out"]);
    let child = pipewright()
        .arg("train")
        .args(&a)
        .arg(out)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while whole_rows(out).len() < rows {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the run made no steps"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    for s in signals {
        // SAFETY: signalling the child this test started.
        unsafe { libc::kill(child.id() as i32, *s) };
    }
    child.wait_with_output().unwrap()
}

#[test]
fn ctrl_c_saves_the_step_and_a_resumed_run_goes_on() {
    let out = tmp("sigint");
    let o = interrupted(&out, &[libc::SIGINT], 3);
    assert!(
        o.status.success(),
        "Ctrl-C ends the run with 0:\n{}",
        text(&o)
    );
    let t = text(&o);
    assert!(t.contains("preempted: saved step"), "{t}");
    let saved: u64 = t
        .split("preempted: saved step ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap();
    let rows = whole_rows(&out);
    assert_eq!(rows.len() as u64, saved, "one whole row per step taken");
    assert!(out.join("checkpoints/latest").exists());
    // It goes on from there.
    let mut a: Vec<&str> = TINY.to_vec();
    let steps = (saved + 2).to_string();
    a.extend_from_slice(&["--steps", &steps, "--resume", "latest", "--out"]);
    a.push(out.to_str().unwrap());
    let o = train(&a);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(whole_rows(&out).len() as u64, saved + 2);
}

#[test]
fn a_second_ctrl_c_ends_the_run_and_leaves_whole_rows() {
    let out = tmp("sigint2");
    let o = interrupted(&out, &[libc::SIGINT, libc::SIGINT], 3);
    // Whether the save finished first or not, nothing is torn.
    let rows = whole_rows(&out);
    assert!(rows.len() >= 3, "{}", text(&o));
    // A second Ctrl-C and a SIGKILL leave whole rows that a resumed run keeps.
    let out = tmp("sigkill");
    let _ = interrupted(&out, &[libc::SIGKILL], 5);
    let n = whole_rows(&out).len();
    assert!(n >= 5);
}

/// A small run with a checkpoint after `steps` steps, into `out`.
fn saved_run(out: &Path, steps: &str) {
    let mut a: Vec<&str> = TINY.to_vec();
    a.extend_from_slice(&["--steps", steps, "--checkpoint-every", steps, "--out"]);
    a.push(out.to_str().unwrap());
    let o = train(&a);
    assert!(o.status.success(), "{}", text(&o));
}

#[test]
fn commands_that_write_never_overwrite() {
    let out = tmp("overwrite");
    saved_run(&out, "2");
    let ck = out.join("checkpoints");
    let (cks, outs) = (ck.to_str().unwrap(), out.to_str().unwrap());
    // ckpt export over an existing file (a part of the live checkpoint) or a directory.
    let part = std::fs::read_dir(ck.join("step-00000002"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .unwrap();
    let before = std::fs::read(&part).unwrap();
    for (format, target) in [("safetensors", &part), ("hf-gpt2", &out)] {
        let o = pipewright()
            .args(["ckpt", "export", cks, "--format", format, "--out"])
            .arg(target)
            .output()
            .unwrap();
        assert!(!o.status.success(), "export over {target:?}");
        assert!(text(&o).contains("already exists"), "{}", text(&o));
    }
    assert_eq!(std::fs::read(&part).unwrap(), before);
    // ckpt reshard into another run's checkpoints would move its `latest` back.
    let other = tmp("overwrite-other");
    saved_run(&other, "4");
    let latest = other.join("checkpoints/latest");
    let o = pipewright()
        .args(["ckpt", "reshard", cks, "--tp", "2", "--out"])
        .arg(other.join("checkpoints"))
        .output()
        .unwrap();
    assert!(
        !o.status.success() && text(&o).contains("already exists"),
        "{}",
        text(&o)
    );
    assert_eq!(
        std::fs::read_to_string(latest).unwrap().trim(),
        "step-00000004"
    );
    // A second sweep into one directory.
    let sweep = tmp("overwrite-sweep");
    let s = sweep.to_str().unwrap();
    let args = [
        "sweep",
        "--param",
        "lr=1e-3",
        "--out",
        s,
        "--",
        "pipewright",
        "train",
        "--steps",
        "1",
        "--n-layer",
        "1",
        "--n-embd",
        "16",
        "--batch-size",
        "8",
    ];
    let first = run(&args);
    assert!(first.status.success(), "{}", text(&first));
    let table = std::fs::read(sweep.join("sweep.csv")).unwrap();
    let o = run(&args);
    assert!(
        !o.status.success() && text(&o).contains("already exists"),
        "{}",
        text(&o)
    );
    assert_eq!(std::fs::read(sweep.join("sweep.csv")).unwrap(), table);
    // bench ckpt --dir keeps what the directory held.
    let keep = out.join("keep.txt");
    std::fs::write(&keep, "mine").unwrap();
    let o = run(&["bench", "ckpt", "--n-layer", "1", "--dir", outs]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(std::fs::read_to_string(&keep).unwrap(), "mine");
    assert!(out.join("params.json").exists());
}

#[test]
fn commands_that_write_one_file_replace_only_their_own_kind() {
    let out = tmp("replace");
    saved_run(&out, "2");
    let scalars = out.join("scalars.csv");
    let (sc, outs) = (scalars.to_str().unwrap(), out.to_str().unwrap());
    let before = std::fs::read(&scalars).unwrap();
    let fresh = tmp("replace-fresh");
    let small = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2"];
    let mut traced: Vec<&str> = vec!["train", "--pp", "2", "--steps", "1"];
    traced.extend_from_slice(&small);
    let cases: Vec<Vec<&str>> = vec![
        vec!["report", outs, "--out", sc],
        [
            &traced[..],
            &["--out", fresh.to_str().unwrap(), "--trace", sc],
        ]
        .concat(),
        vec!["schedule", "--pp", "2", "--chunks", "4", "--svg", sc],
        [&["profile"][..], &small, &["--out", sc]].concat(),
        vec!["profile", "--gemm", "--out", sc],
        vec!["bench", "comm", "--out", sc],
    ];
    for args in &cases {
        let o = run(args);
        assert!(!o.status.success(), "{args:?} wrote over scalars.csv");
        assert!(
            text(&o).contains("already exists and is not"),
            "{args:?}: {}",
            text(&o)
        );
        assert_eq!(std::fs::read(&scalars).unwrap(), before, "{args:?}");
    }
    // A rerun replaces what the command wrote before.
    let page = out.join("page.html");
    let svg = out.join("s.svg");
    let trace = out.join("t.json");
    let again: Vec<Vec<&str>> = vec![
        vec!["report", outs, "--out", page.to_str().unwrap()],
        vec![
            "schedule",
            "--pp",
            "2",
            "--chunks",
            "4",
            "--svg",
            svg.to_str().unwrap(),
        ],
    ];
    for args in &again {
        for _ in 0..2 {
            let o = run(args);
            assert!(o.status.success(), "{args:?}: {}", text(&o));
        }
    }
    // Two runs, one trace file: the second replaces the first's trace.
    for name in ["replace-t1", "replace-t2"] {
        let dir = tmp(name);
        let t = trace.to_str().unwrap();
        let args = [&traced[..], &["--trace", t, "--out", dir.to_str().unwrap()]].concat();
        let o = run(&args);
        assert!(o.status.success(), "{args:?}: {}", text(&o));
    }
}

#[test]
fn a_closed_stdout_never_stops_training() {
    use std::io::BufRead;
    let out = tmp("pipe");
    let mut a: Vec<&str> = TINY.to_vec();
    a.extend_from_slice(&[
        "--steps",
        "300",
        "--eval-every",
        "10",
        "--checkpoint-every",
        "100",
    ]);
    let mut child = pipewright()
        .arg("train")
        .args(&a)
        .arg("--out")
        .arg(&out)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // `| head -1`: one line read, then the reading end closed.
    let mut line = String::new();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    stdout.read_line(&mut line).unwrap();
    drop(stdout);
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let summary = std::fs::read_to_string(out.join("summary.json")).unwrap();
    assert!(summary.contains("\"final_loss\""), "{summary}");
    assert_eq!(whole_rows(&out).len(), 300);
    assert!(out.join("checkpoints/step-00000300").exists());
}

#[test]
fn a_run_directory_belongs_to_one_run() {
    let out = tmp("lock");
    let o_str = out.to_str().unwrap();
    let mut a: Vec<&str> = TINY.to_vec();
    a.extend_from_slice(&[
        "--steps",
        "100000",
        "--checkpoint-every",
        "1",
        "--out",
        o_str,
    ]);
    let first = pipewright()
        .arg("train")
        .args(&a)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !out.join("checkpoints/latest").exists() {
        assert!(t.elapsed() < Duration::from_secs(60), "no checkpoint");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut b: Vec<&str> = TINY.to_vec();
    b.extend_from_slice(&["--steps", "100000", "--resume", "latest", "--out", o_str]);
    let second = train(&b);
    assert!(!second.status.success());
    assert!(
        text(&second).contains("in use by another run"),
        "{}",
        text(&second)
    );
    // SAFETY: signalling the child this test started.
    unsafe { libc::kill(first.id() as i32, libc::SIGINT) };
    let o = first.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(!out.join(".lock").exists(), "the lock goes with its run");
    whole_rows(&out);
}

#[test]
fn a_checkpoint_never_reads_outside_its_directory() {
    let out = tmp("outside");
    saved_run(&out, "2");
    let ck = out.join("checkpoints");
    let step = ck.join("step-00000002");
    let verify = |p: &Path| {
        pipewright()
            .args(["ckpt", "verify"])
            .arg(p)
            .output()
            .unwrap()
    };
    assert!(verify(&ck).status.success());
    // A part naming a file outside (relative or absolute) is refused.
    let mp = step.join("manifest.json");
    let good = std::fs::read_to_string(&mp).unwrap();
    for evil in ["../../../../../../etc/passwd", "/etc/passwd"] {
        let mut m: serde_json::Value = serde_json::from_str(&good).unwrap();
        let files = m["files"].as_object_mut().unwrap();
        let (name, sum) = files
            .iter()
            .next()
            .map(|(k, v)| (k.clone(), v.clone()))
            .unwrap();
        files.remove(&name);
        files.insert(evil.into(), sum);
        for (_, e) in m["tensors"].as_object_mut().unwrap() {
            for p in e["parts"].as_array_mut().unwrap() {
                if p["file"] == name.as_str() {
                    p["file"] = evil.into();
                }
            }
        }
        std::fs::write(&mp, m.to_string()).unwrap();
        let o = verify(&ck);
        assert!(!o.status.success(), "{evil}");
        assert!(text(&o).contains("not a plain name"), "{}", text(&o));
    }
    std::fs::write(&mp, &good).unwrap();
    // A `latest` naming another run's checkpoint, or a step linked to one outside.
    let other = tmp("outside-other");
    saved_run(&other, "2");
    let latest = ck.join("latest");
    let theirs = other.join("checkpoints/step-00000002");
    std::fs::write(&latest, format!("../../{}", theirs.display())).unwrap();
    let o = verify(&ck);
    assert!(
        !o.status.success() && text(&o).contains("not a file of that directory"),
        "{}",
        text(&o)
    );
    std::os::unix::fs::symlink(&theirs, ck.join("step-00000009")).unwrap();
    std::fs::write(&latest, "step-00000009").unwrap();
    let o = verify(&ck);
    assert!(
        !o.status.success() && text(&o).contains("leads outside"),
        "{}",
        text(&o)
    );
    // A resumed run refuses it too.
    let mut a: Vec<&str> = TINY.to_vec();
    a.extend_from_slice(&[
        "--steps",
        "4",
        "--resume",
        "latest",
        "--out",
        out.to_str().unwrap(),
    ]);
    let o = train(&a);
    assert!(
        !o.status.success() && text(&o).contains("leads outside"),
        "{}",
        text(&o)
    );
}

#[test]
fn a_save_clears_what_a_killed_save_left() {
    let out = tmp("stale");
    saved_run(&out, "2");
    let stale = out.join("checkpoints/.step-00000001.tmp");
    std::fs::create_dir_all(&stale).unwrap();
    std::fs::write(stale.join("rank-0.safetensors"), "half").unwrap();
    let mut a: Vec<&str> = TINY.to_vec();
    a.extend_from_slice(&[
        "--steps",
        "4",
        "--checkpoint-every",
        "2",
        "--resume",
        "latest",
    ]);
    a.extend_from_slice(&["--out", out.to_str().unwrap()]);
    let o = train(&a);
    assert!(o.status.success(), "{}", text(&o));
    assert!(!stale.exists(), "the stale temporary directory is removed");
    assert!(out.join("checkpoints/step-00000004").exists());
}
