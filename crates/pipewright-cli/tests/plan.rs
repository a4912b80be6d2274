//! `pipewright plan` end to end: a model too big for one rank is planned onto pipeline
//! stages, and the plan trains.

mod common;

use std::process::Output;

use pipewright::plan::StepParts;

fn plan(args: &[&str]) -> Output {
    common::pipewright()
        .arg("plan")
        .args(args)
        .output()
        .expect("runs the binary")
}

/// Three heads (no tp=2) and four blocks of d 192: 1.8 M parameters, 20 bytes each with
/// their gradients and AdamW's state, on one rank or half of them on each of two stages.
const MODEL: &[&str] = &[
    "--world",
    "2",
    "--nodes",
    "1",
    "--n-layer",
    "4",
    "--n-head",
    "3",
    "--n-embd",
    "192",
    "--batch-size",
    "8",
];

#[test]
fn a_model_over_the_cap_at_one_stage_is_planned_onto_two_and_trains() {
    // Far too little memory: the error names the smallest cap that works.
    let mut args = MODEL.to_vec();
    args.extend(["--memory", "1MiB"]);
    let o = plan(&args);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(
        !o.status.success() && err.contains("the smallest cap that works is"),
        "{err}"
    );
    // "... the smallest cap that works is 27.2 MiB (28478590 bytes: pp=2 ...)".
    let bytes = err
        .split(" bytes:")
        .next()
        .unwrap()
        .rsplit('(')
        .next()
        .unwrap()
        .to_string();
    assert!(err.contains("pp=2"), "{err}");

    // At that cap only two-stage layouts fit, and the best of them trains here.
    let out = std::env::temp_dir().join(format!("pw-plan-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let mut args = MODEL.to_vec();
    let out_s = out.to_str().unwrap();
    args.extend(["--memory", &bytes, "--top", "50", "--steps", "2"]);
    let o = plan(&args);
    let stdout = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let rows: Vec<&str> = stdout.lines().filter(|l| l.contains(" pp=")).collect();
    assert!(
        !rows.is_empty() && rows.iter().all(|r| r.contains("pp=2 tp=1 dp=1")),
        "{stdout}"
    );

    args.extend(["--measure", "--out", out_s]);
    let top1 = args.iter().position(|a| *a == "50").unwrap();
    args[top1] = "1";
    let o = plan(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("candidate-1/summary.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(summary["steps"], 2, "{summary}");
    assert!(
        summary["layout"].as_str().unwrap().contains("pp=2"),
        "{summary}"
    );
    assert!(summary["final_loss"].as_f64().unwrap().is_finite());
    // Rank 0's step part by part, as the run measured it, printed under the prediction's.
    let parts: StepParts = serde_json::from_value(summary["median_step_parts"].clone()).unwrap();
    assert!(parts.pipeline_s > 0.0 && parts.update_s > 0.0, "{summary}");
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains(&format!("measured  {parts}")), "{stdout}");
    assert!(stdout.contains("1    predicted pipeline "), "{stdout}");

    // `--measured` sets the plan beside those runs again, training nothing: the same rows.
    let rows = |o: &Output| -> Vec<String> {
        let text = String::from_utf8_lossy(&o.stdout).to_string();
        text.lines()
            .skip_while(|l| !l.contains("meas. peak"))
            .map(String::from)
            .collect()
    };
    let summary_path = out.join("candidate-1/summary.json");
    let written = std::fs::metadata(&summary_path)
        .unwrap()
        .modified()
        .unwrap();
    let mut again = args.clone();
    again.push("--measured");
    let o2 = plan(&again);
    assert!(
        o2.status.success(),
        "{}",
        String::from_utf8_lossy(&o2.stderr)
    );
    assert!(
        rows(&o).len() >= 4 && rows(&o2) == rows(&o),
        "{:?}",
        rows(&o2)
    );
    let now = std::fs::metadata(&summary_path)
        .unwrap()
        .modified()
        .unwrap();
    assert_eq!(now, written, "--measured trained again");
    // A run of other flags, or none, is refused by name.
    let steps = again.iter().position(|a| *a == "--steps").unwrap();
    again[steps + 1] = "3";
    let err = String::from_utf8_lossy(&plan(&again).stderr).to_string();
    assert!(
        err.contains("trained with") && err.contains("measure it afresh"),
        "{err}"
    );
    let empty = out.join("empty");
    let at = again.iter().position(|a| *a == "--out").unwrap();
    let empty_s = empty.to_str().unwrap().to_string();
    again[at + 1] = &empty_s;
    again[steps + 1] = "2";
    let err = String::from_utf8_lossy(&plan(&again).stderr).to_string();
    assert!(err.contains("--measured: no run in"), "{err}");
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn plan_refuses_bad_input_clearly() {
    for (args, needle) in [
        (vec!["--world", "4", "--memory", "lots"], "is not a size"),
        (
            vec!["--world", "4", "--hardware", "nowhere.json"],
            "no hardware file",
        ),
        (
            vec!["--world", "3", "--nodes", "2"],
            "does not spread evenly",
        ),
        (
            vec![
                "--world",
                "2",
                "--model",
                "cnn",
                "--task",
                "shapes",
                "--candidate",
                "tp=2",
            ],
            "[1]: it does not split",
        ),
    ] {
        let o = plan(&args);
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(
            !o.status.success() && err.contains(needle),
            "{args:?}: {err}"
        );
    }
}

/// `plan --explain` says where the first layout's step goes, part by part; at dp 2 over two
/// nodes the sums are costed after the schedule (`plan` assumes no overlap), so none hides.
#[test]
fn explain_says_where_the_step_goes() {
    let o = plan(&["--world", "2", "--candidate", "dp=2", "--explain"]);
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        out.contains("where the step of pp=1 tp=1 dp=2 (rank 1, "),
        "{out}"
    );
    for part in [
        "matrix products at the device's ceiling",
        "bubble (waiting for a neighbour or its sends)",
        "data-parallel communication, exposed",
        "norm, clipping and the optimizer",
    ] {
        assert!(out.contains(part), "{part}: {out}");
    }
    let hidden = out
        .lines()
        .find(|l| l.contains("hidden behind the backward"))
        .expect("the hidden line");
    assert!(hidden.contains(" 0.000 ms"), "{hidden}");
}

/// The bytes a profile measured, layer by layer: kept and deferred per sample.
fn profile_bytes(extra: &[&str], out: &std::path::Path) -> Vec<(f64, f64)> {
    let o = common::pipewright()
        .args(["profile", "--sizes", "2,4", "--out"])
        .arg(out)
        .args(extra)
        .output()
        .expect("runs the binary");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let p: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out).unwrap()).unwrap();
    p["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            let f = |k: &str| l[k].as_f64().unwrap();
            (f("kept_bytes_per_sample"), f("deferred_bytes_per_sample"))
        })
        .collect()
}

#[test]
fn concurrent_profile_copies_count_the_same_bytes_as_one() {
    // Each copy's allocations are charged to its own thread's rank: the bytes a layer keeps
    // and defers do not depend on another copy running beside it.
    let dir = std::env::temp_dir().join(format!("pw-concurrent-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let one = profile_bytes(&[], &dir.join("one.json"));
    let two = profile_bytes(&["--concurrent", "2"], &dir.join("two.json"));
    // (Within 2 %: a thread's first use of a kernel may allocate its own scratch.)
    assert_eq!(one.len(), two.len());
    for (a, b) in one.iter().zip(&two) {
        let near = |x: f64, y: f64| (x - y).abs() <= 0.02 * x.max(y);
        assert!(near(a.0, b.0) && near(a.1, b.1), "{one:?} vs {two:?}");
    }
    // The blocks' split backward holds more than the graph's queued gradients alone.
    assert!(one[1].1 > 0.0, "{one:?}");
    // Copies computing at once also measure what twice as many lose (an efficiency, which
    // the profiler clamps into (0, 1]) and what a two-stage pipeline's actions cost beyond
    // their layers (clamped at 0); one copy alone measures neither. Their values are timings
    // of this machine: benchmarks judge them, not this test.
    let field = |name: &str, path: &[&str]| -> serde_json::Value {
        let text = std::fs::read_to_string(dir.join(name)).unwrap();
        let v = serde_json::from_str::<serde_json::Value>(&text).unwrap();
        path.iter().fold(v, |v, k| v[*k].clone())
    };
    for path in [
        &["crowded_efficiency"][..],
        &["action_overhead", "forward_s"],
        &["action_overhead", "backward_s"],
    ] {
        assert!(field("one.json", path).is_null(), "{path:?}");
        let v = field("two.json", path);
        assert!(
            v.as_f64().is_some_and(f64::is_finite),
            "{path:?} not measured with --concurrent 2: {v}"
        );
    }
    let o = common::pipewright()
        .args(["profile", "--concurrent", "0", "--out"])
        .arg(dir.join("zero.json"))
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&o.stderr).contains("--concurrent must be positive"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_tensor_parallel_profile_times_the_split_loss_and_plans_from_it() {
    // The last layer's split costs include the vocabulary-parallel loss after it: its
    // output must stay marked split over the tp ranks in the profile (the whole-vocabulary
    // loss on one shard's 5 classes failed "target 8 is outside 0..5").
    let dir = std::env::temp_dir().join(format!("pw-tp-profile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("tp.json");
    let o = common::pipewright()
        .args(["profile", "--sizes", "2,4", "--tp-sizes", "1,2", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let p: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let head = p["layers"].as_array().unwrap().last().unwrap();
    assert_eq!(head["split"][0]["tp"], 2, "{head}");
    // Each split layer's share of its time computing (the rest its collectives wait).
    for l in p["layers"].as_array().unwrap() {
        let busy = l["split"][0]["busy_share"].as_f64().unwrap();
        assert!(busy > 0.0 && busy <= 1.0, "{l}");
    }
    assert!(p["accumulate"]["per_sample_s"].as_f64().unwrap() > 0.0);
    let o = common::pipewright()
        .args([
            "plan",
            "--world",
            "2",
            "--nodes",
            "1",
            "--candidate",
            "tp=2",
            "--profile",
        ])
        .arg(&out)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success() && text.contains("tp=2"), "{text}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Seconds of the first ranked row's step (`... 12.3 ms  4.0%  20.1 MiB`).
fn first_step_seconds(stdout: &str) -> f64 {
    let row = stdout
        .lines()
        .find(|l| l.starts_with("1 "))
        .unwrap_or_else(|| panic!("{stdout}"));
    let w: Vec<&str> = row.split_whitespace().collect();
    let v: f64 = w[w.len() - 5].parse().unwrap();
    match w[w.len() - 4] {
        "ms" => v / 1e3,
        "s" => v,
        u => panic!("unit {u} in {row}"),
    }
}

#[test]
fn profile_gemm_writes_a_curve_that_plan_reads() {
    let dir = std::env::temp_dir().join(format!("pw-gemm-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let hw = dir.join("hw.json");
    let o = common::pipewright()
        .args(["profile", "--gemm", "--out", hw.to_str().unwrap()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        o.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(stdout.contains("curve (f32): ceiling"), "{stdout}");
    let file: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&hw).unwrap()).unwrap();
    let curve = &file["gemm_f32"];
    assert_eq!(
        curve["measured"].as_array().unwrap().len(),
        pipewright::plan::gemm_grid(1).len()
    );
    assert!(
        curve["ceiling_flops_per_s"].as_f64().unwrap() > 1e9,
        "{curve}"
    );

    // plan costs the GPT's products on the file's curve: a ceiling a hundred times lower makes
    // the predicted step slower by far.
    let step = |path: &std::path::Path| {
        let mut args = MODEL.to_vec();
        args.extend([
            "--hardware",
            path.to_str().unwrap(),
            "--candidate",
            "pp=2,mbs=4",
        ]);
        let o = plan(&args);
        let stdout = String::from_utf8_lossy(&o.stdout).to_string();
        assert!(
            o.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(stdout.contains("products measured"), "{stdout}");
        first_step_seconds(&stdout)
    };
    let measured = step(&hw);
    let mut slow = file.clone();
    let ceiling = slow["gemm_f32"]["ceiling_flops_per_s"].as_f64().unwrap();
    slow["gemm_f32"]["ceiling_flops_per_s"] = (ceiling / 100.0).into();
    let slow_path = dir.join("slow.json");
    std::fs::write(&slow_path, serde_json::to_string(&slow).unwrap()).unwrap();
    let slower = step(&slow_path);
    assert!(slower > 5.0 * measured, "{measured} -> {slower}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The peak-memory errors (measured against predicted, in %) of the rows `plan --measure`
/// prints (`1  2.7 ms  1.6 ms  +67.7%  19.2 MiB  21.5 MiB  -11.0%  ...`).
fn peak_errors(stdout: &str) -> Vec<f64> {
    let table = stdout
        .split("rank   predicted")
        .nth(1)
        .unwrap_or_else(|| panic!("{stdout}"));
    table
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .filter(|w| w.len() == 16 && w[7] == "MiB")
        .map(|w| w[10].trim_end_matches('%').parse().unwrap())
        .collect()
}

#[test]
fn the_llama_and_the_cnn_are_planned_from_their_shapes_and_train_as_planned() {
    let dir = std::env::temp_dir().join(format!("pw-plan-models-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let common = [
        "--world",
        "2",
        "--nodes",
        "1",
        "--batch-size",
        "8",
        "--top",
        "1",
    ];
    let llama = [
        "--model",
        "llama",
        "--n-layer",
        "4",
        "--n-head",
        "4",
        "--n-kv-head",
        "2",
        "--n-embd",
        "64",
    ];
    let cnn = ["--model", "cnn", "--task", "shapes"];
    for (name, model) in [("llama", &llama[..]), ("cnn", &cnn[..])] {
        let out = dir.join(name);
        let mut args = common.to_vec();
        args.extend(model);
        args.extend(["--measure", "--steps", "2", "--out", out.to_str().unwrap()]);
        let o = plan(&args);
        let text = String::from_utf8_lossy(&o.stdout).to_string();
        assert!(
            o.status.success(),
            "{name}: {text}{}",
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(text.contains("profile: shapes on"), "{name}: {text}");
        // Ranked with an MFU and a peak per rank ...
        let rows: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("1 "))
            .filter(|l| l.contains("% ") && l.ends_with("MiB"))
            .collect();
        assert_eq!(rows.len(), 1, "{name}: {text}");
        // ... and the peak the planner sized from the shapes is what training holds (the
        // allocator's count; 10-16 % apart on an idle machine, more when other tests crowd
        // its cores).
        let errors = peak_errors(&text);
        assert_eq!(errors.len(), 1, "{name}: {text}");
        assert!(errors.iter().all(|e| e.abs() < 40.0), "{name}: {text}");
    }
    // The CNN does not split over tensor-parallel ranks.
    let mut args = common.to_vec();
    args.extend(cnn);
    args.extend(["--candidate", "tp=2"]);
    let o = plan(&args);
    assert!(
        !o.status.success(),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
