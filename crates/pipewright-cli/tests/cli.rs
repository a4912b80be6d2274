//! `pipewright train` end to end: the run directory, determinism, and clear errors.

mod common;

use std::path::Path;
use std::process::Output;

use common::{text, tmp, train, TINY};

use pipewright::experiment::tfevents::read_records;

fn tiny_run(out: &Path, extra: &[&str]) -> Output {
    let mut a: Vec<&str> = TINY.to_vec();
    a.extend_from_slice(&[
        "--steps",
        "6",
        "--dropout",
        "0.1",
        "--out",
        out.to_str().unwrap(),
    ]);
    a.extend_from_slice(extra);
    train(&a)
}

#[test]
fn run_directory_holds_params_scalars_events_and_summary() {
    let out = tmp("rundir");
    let o = tiny_run(&out, &["--chunks", "2"]);
    assert!(o.status.success(), "{}", text(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    for s in [
        "summary",
        "final loss",
        "accuracy",
        "tokens/s",
        "peak memory",
    ] {
        assert!(stdout.contains(s), "summary lacks `{s}`:\n{stdout}");
    }

    let params: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("params.json")).unwrap()).unwrap();
    for (k, v) in [
        ("steps", 6),
        ("batch_size", 8),
        ("chunks", 2),
        ("n_layer", 1),
        ("n_embd", 16),
    ] {
        assert_eq!(params[k], v, "params.json `{k}`");
    }
    assert_eq!(params["model"], "gpt");
    assert_eq!(params["task"], "adder");
    assert!(params["num_params"].as_u64().unwrap() > 0);
    // The run as the library describes it: what `RunSpec` reads back.
    let spec = &params["spec"];
    assert_eq!(spec["global_batch"], 8);
    assert_eq!(spec["micro_batch"], 4);
    assert_eq!(spec["cadence"]["steps"], 6);
    assert_eq!(spec["model"]["gpt"]["gpt"]["n_layer"], 1);
    let spec: pipewright_models::RunSpec = serde_json::from_value(spec.clone()).unwrap();
    assert_eq!(spec.task, pipewright_models::TaskSpec::Adder { digits: 2 });

    let csv = std::fs::read_to_string(out.join("scalars.csv")).unwrap();
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines[0], "step,loss,lr,metric");
    assert_eq!(lines.len(), 7, "one row per step:\n{csv}");
    let metric_rows = lines[1..].iter().filter(|l| !l.ends_with(',')).count();
    assert_eq!(metric_rows, 2, "metric at steps 3 and 6:\n{csv}");

    let ev = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("events.out.tfevents.")
        })
        .expect("an event file");
    let records = read_records(&std::fs::read(ev).unwrap()).unwrap();
    // File version, the flags as hparams, one event per step (the log's scalars), a loss
    // curve per evaluation, and per logged step its seconds and throughput (tags).
    assert_eq!(records.len(), 1 + 1 + 6 + 2 + 6 * 2);
    assert!(records[0].windows(13).any(|w| w == b"brain.Event:2"));
    assert!(records[1]
        .windows(28)
        .any(|w| w == b"_hparams_/session_start_info"));
    let with_loss = records
        .iter()
        .filter(|r| r.windows(10).any(|w| w == b"train/loss"))
        .filter(|r| !r.windows(10).any(|w| w == b"loss_curve"))
        .count();
    assert_eq!(with_loss, 6);
    // The loss curve at each evaluation (steps 3 and 6): a 640 x 400 PNG (its IHDR) of that
    // many points, also in the events.
    let curves: Vec<Vec<u8>> = [3, 6]
        .iter()
        .map(|s| std::fs::read(out.join(format!("images/train_loss_curve-{s}.png"))).unwrap())
        .collect();
    for png in &curves {
        assert_eq!(&png[1..4], b"PNG");
        assert_eq!(
            (&png[16..20], &png[20..24]),
            (&640u32.to_be_bytes()[..], &400u32.to_be_bytes()[..])
        );
        assert!(records
            .iter()
            .any(|r| r.windows(png.len()).any(|w| w == &png[..])));
    }
    assert_ne!(curves[0], curves[1], "the later curve has more points");
    let _ = std::fs::remove_dir_all(out);
}

#[test]
fn same_seed_same_bits_and_log_every_thins() {
    let (a, b, c) = (tmp("det-a"), tmp("det-b"), tmp("det-c"));
    assert!(tiny_run(&a, &[]).status.success());
    assert!(tiny_run(&b, &[]).status.success());
    let losses = |d: &Path| -> Vec<String> {
        std::fs::read_to_string(d.join("scalars.csv"))
            .unwrap()
            .lines()
            .skip(1)
            .map(|l| l.split(',').nth(1).unwrap().to_string())
            .collect()
    };
    assert_eq!(losses(&a), losses(&b));
    let o = tiny_run(&c, &["--seed", "1", "--log-every", "2"]);
    assert!(o.status.success());
    let lc = losses(&c);
    assert_eq!(
        lc.len(),
        4,
        "rows at steps 0, 2, 4 and the evaluation at step 5"
    );
    assert_ne!(lc[0], losses(&a)[0], "another seed, another run");
    for d in [a, b, c] {
        let _ = std::fs::remove_dir_all(d);
    }
}

fn fails_with(args: &[&str], needle: &str) {
    let out = tmp("fail");
    let mut a = args.to_vec();
    if !args.contains(&"--out") {
        a.extend_from_slice(&["--out", out.to_str().unwrap()]);
    }
    let o = train(&a);
    let t = text(&o);
    assert!(!o.status.success(), "{args:?} succeeded:\n{t}");
    assert!(!t.contains("panicked"), "{args:?} panicked:\n{t}");
    assert!(
        t.contains(needle),
        "{args:?}: message lacks `{needle}`:\n{t}"
    );
    assert!(
        !out.join("params.json").exists() && !out.join("parameters.json").exists(),
        "{args:?} left a half-made run"
    );
    let _ = std::fs::remove_dir_all(out);
}

#[test]
fn bad_input_is_a_clear_error() {
    fails_with(&["--model", "rnn"], "invalid value 'rnn'");
    fails_with(&["--task", "chess"], "invalid value 'chess'");
    fails_with(
        &["--steps", "0"],
        "--steps <STEPS>': must be a positive integer, got 0",
    );
    fails_with(
        &["--batch-size", "0"],
        "--batch-size <BATCH_SIZE>': must be a positive integer",
    );
    fails_with(
        &["--chunks", "0"],
        "--chunks <CHUNKS>': must be a positive integer",
    );
    fails_with(
        &["--n-embd", "-4"],
        "--n-embd <N_EMBD>': must be a positive integer, got -4",
    );
    fails_with(
        &["--n-layer", "0"],
        "--n-layer <N_LAYER>': must be a positive integer",
    );
    fails_with(
        &["--n-head", "two"],
        "must be a positive integer, got `two`",
    );
    fails_with(
        &["--n-embd", "30", "--n-head", "4"],
        "n_embd 30 is not divisible by n_head 4",
    );
    fails_with(&["--lr", "-1"], "learning rate must be a positive number");
    fails_with(
        &["--model", "cnn", "--task", "adder"],
        "--model cnn needs an image task",
    );
    fails_with(&["--task", "text"], "--task text needs --data FILE");
    fails_with(
        &["--backend", "nccl"],
        if cfg!(feature = "cuda") {
            "--backend nccl moves GPU tensors: use it with --device cuda"
        } else {
            "--backend nccl needs a build with the `cuda` feature"
        },
    );
    fails_with(
        &["--task", "text", "--data", "/nonexistent/input.txt"],
        "/nonexistent/input.txt",
    );
    let empty = std::env::temp_dir().join(format!("pw-empty-{}.txt", std::process::id()));
    std::fs::write(&empty, b"").unwrap();
    fails_with(
        &["--task", "text", "--data", empty.to_str().unwrap()],
        "is empty",
    );
    std::fs::write(&empty, b"short text").unwrap();
    fails_with(
        &["--task", "text", "--data", empty.to_str().unwrap()],
        "too few",
    );
    // --out under a regular file cannot be created.
    let sub = format!("{}/run", empty.display());
    fails_with(
        &["--steps", "1", "--out", &sub],
        "cannot create run directory",
    );
    let _ = std::fs::remove_file(empty);
}

#[test]
fn an_existing_run_is_never_overwritten() {
    let out = tmp("exists");
    assert!(tiny_run(&out, &[]).status.success());
    let before = std::fs::read(out.join("scalars.csv")).unwrap();
    let o = tiny_run(&out, &[]);
    assert!(!o.status.success());
    assert!(text(&o).contains("already holds a run"), "{}", text(&o));
    assert_eq!(std::fs::read(out.join("scalars.csv")).unwrap(), before);
    let _ = std::fs::remove_dir_all(out);
}

#[test]
fn text_task_trains_on_a_user_file() {
    let data = std::env::temp_dir().join(format!("pw-text-{}.txt", std::process::id()));
    let body: String = (0..300)
        .map(|i| format!("line {i}: the quick brown fox. "))
        .collect();
    std::fs::write(&data, body).unwrap();
    let out = tmp("text");
    let o = train(&[
        "--task",
        "text",
        "--data",
        data.to_str().unwrap(),
        "--block-size",
        "32",
        "--steps",
        "3",
        "--n-layer",
        "1",
        "--n-head",
        "2",
        "--n-embd",
        "16",
        "--batch-size",
        "4",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let bpb: f64 = std::fs::read_to_string(out.join("scalars.csv"))
        .unwrap()
        .lines()
        .last()
        .unwrap()
        .split(',')
        .nth(3)
        .unwrap()
        .parse()
        .unwrap();
    // An untrained byte model is near uniform: about 8 bits per byte.
    assert!(bpb > 5.0 && bpb < 10.0, "bits per byte {bpb}");
    let _ = std::fs::remove_dir_all(out);
    let _ = std::fs::remove_file(data);
}

#[test]
fn a_pipelined_run_writes_the_serial_runs_losses() {
    let (serial, piped) = (tmp("pp-serial"), tmp("pp-two"));
    let common = [
        "--n-layer",
        "2",
        "--n-head",
        "2",
        "--n-embd",
        "16",
        "--batch-size",
        "8",
        "--steps",
        "4",
        "--chunks",
        "4",
    ];
    let run = |out: &Path, extra: &[&str]| {
        let mut a: Vec<&str> = common.to_vec();
        a.extend_from_slice(&["--out", out.to_str().unwrap()]);
        a.extend_from_slice(extra);
        let o = train(&a);
        assert!(o.status.success(), "{}", text(&o));
        std::fs::read_to_string(out.join("scalars.csv")).unwrap()
    };
    let a = run(&serial, &[]);
    // The one-rank run is the engine under test: the separate serial trainer is the oracle.
    let oracle = common::serial_losses(&serial);
    for (got, want) in a.lines().skip(1).zip(&oracle) {
        let got: f64 = got.split(',').nth(1).unwrap().parse().unwrap();
        assert!(((got - want) / want).abs() < 1e-6, "{got} vs {want}");
    }
    for extra in [
        &["--schedule", "gpipe"][..],
        &["--schedule", "1f1b"],
        &["--balance", "size"],
        &["--balance", "time"],
    ] {
        let _ = std::fs::remove_dir_all(&piped);
        let mut args = vec!["--pp", "2"];
        args.extend_from_slice(extra);
        let b = run(&piped, &args);
        let losses = |s: &str| {
            s.lines()
                .map(|l| l.split(',').nth(1).unwrap().to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(losses(&a), losses(&b), "{extra:?}");
    }
    fails_with(
        &["--pp", "9", "--n-layer", "2"],
        "9 stages cannot each get one of 4",
    );
    fails_with(
        &["--pp", "2", "--schedule", "zigzag"],
        "unknown schedule `zigzag`",
    );
    fails_with(
        &["--pp", "2", "--balance", "1,1"],
        "sums to 2 but the model has 4",
    );
    for d in [serial, piped] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn every_layout_writes_the_serial_runs_losses() {
    let common = [
        "--n-layer",
        "2",
        "--n-head",
        "4",
        "--n-embd",
        "16",
        "--batch-size",
        "8",
        "--steps",
        "4",
        "--chunk-size",
        "4",
        "--dropout",
        "0.1",
    ];
    let run = |name: &str, extra: &[&str]| {
        let out = tmp(name);
        let mut a: Vec<&str> = common.to_vec();
        a.extend_from_slice(&["--out", out.to_str().unwrap()]);
        a.extend_from_slice(extra);
        let o = train(&a);
        assert!(o.status.success(), "{}", text(&o));
        let csv = std::fs::read_to_string(out.join("scalars.csv")).unwrap();
        let summary: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap())
                .unwrap();
        let losses = csv
            .lines()
            .skip(1)
            .map(|l| l.split(',').nth(1).unwrap().parse::<f64>().unwrap())
            .collect::<Vec<_>>();
        // The oracle of an f32 run: the separate serial trainer on the run the directory
        // records (low precision is held to f32 below, as a run in it can be).
        if !extra.contains(&"--precision") {
            let oracle = common::serial_losses(&out);
            assert_eq!(losses.len(), oracle.len(), "{extra:?}");
            for (a, b) in losses.iter().zip(&oracle) {
                assert!(
                    ((a - b) / b).abs() < 1e-5,
                    "{extra:?}: {losses:?} vs the serial trainer's {oracle:?}"
                );
            }
        }
        let _ = std::fs::remove_dir_all(out);
        (losses, summary)
    };
    let (serial, _) = run("tp-serial", &[]);
    let layouts: [&[&str]; 4] = [
        &["--tp", "2"],
        &["--tp", "2", "--pp", "2"],
        &["--dp", "2"],
        &["--tp", "2", "--dp", "2"],
    ];
    for extra in layouts {
        let (got, summary) = run("tp-split", extra);
        let world = summary["ranks"].as_array().unwrap().len();
        assert_eq!(
            world,
            extra[1].parse::<usize>().unwrap() * extra.get(3).map_or(1, |v| v.parse().unwrap())
        );
        assert!(summary["layout"].as_str().unwrap().ends_with(" f32"));
        assert_eq!(got.len(), serial.len());
        for (a, b) in got.iter().zip(&serial) {
            assert!(
                ((a - b) / b).abs() < 1e-5,
                "{extra:?}: {got:?} vs serial {serial:?}"
            );
        }
    }
    // ZeRO shards the replicas' state and trains to the same losses.
    for extra in [
        &["--dp", "2", "--zero", "2"][..],
        &["--tp", "2", "--dp", "2", "--zero", "1"],
        &["--zero", "2"],
        &["--pp", "2", "--dp", "2", "--zero", "3"],
    ] {
        let (got, _) = run("zero", extra);
        for (a, b) in got.iter().zip(&serial) {
            assert!(
                ((a - b) / b).abs() < 1e-5,
                "{extra:?}: {got:?} vs {serial:?}"
            );
        }
    }
    fails_with(
        &["--zero", "4", "--dp", "2"],
        "unknown ZeRO stage 4: use 0, 1, 2 or 3",
    );
    fails_with(&["--zero", "x"], "unknown ZeRO stage `x`: use 0, 1, 2 or 3");
    fails_with(&["--tp", "4", "--n-head", "4"], "pass --vocab-size 12");
    fails_with(
        &["--tp", "4", "--n-head", "2", "--vocab-size", "12"],
        "--n-head 2 cannot be split over --tp 4",
    );
    fails_with(
        &["--vocab-size", "8"],
        "--vocab-size 8 is smaller than the task's vocabulary of 10",
    );
    fails_with(
        &["--model", "cnn", "--task", "shapes", "--tp", "2"],
        "the CNN has no tensor-parallel layers",
    );
    fails_with(
        &["--batch-size", "6", "--chunks", "4"],
        "--batch-size 6 does not split into --dp 1 replicas of --chunks 4",
    );
    fails_with(
        &["--batch-size", "6", "--chunks", "2", "--dp", "2"],
        "--batch-size 6 does not split into --dp 2 replicas of --chunks 2",
    );
    fails_with(
        &["--precision", "f8"],
        "unknown precision `f8`: use f32, bf16 or f16",
    );
    fails_with(
        &["--virtual", "2"],
        "virtual_stages 2 needs the interleaved schedule",
    );
    // Low precision runs end to end and reports it.
    let (losses, summary) = run("bf16", &["--precision", "bf16", "--dp", "2"]);
    assert_eq!(summary["layout"], "pp=1 tp=1 dp=2 bf16");
    assert!(losses.iter().all(|l| l.is_finite()));
}

#[test]
fn zero_with_one_replica_is_said_once_and_trains() {
    let out = tmp("zero-dp1");
    let o = tiny_run(&out, &["--zero", "3", "--pp", "2"]);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert_eq!(t.matches("nothing to shard").count(), 1, "{t}");
    let _ = std::fs::remove_dir_all(out);
}
