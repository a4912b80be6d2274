//! `pipewright plan` end to end: a model too big for one rank is planned onto pipeline
//! stages, and the plan trains.

use std::process::{Command, Output};

fn plan(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pipewright"))
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
    args.extend([
        "--memory", &bytes, "--top", "50", "--steps", "2", "--out", out_s,
    ]);
    let o = plan(&args);
    let stdout = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let rows: Vec<&str> = stdout.lines().filter(|l| l.contains(" pp=")).collect();
    assert!(
        !rows.is_empty() && rows.iter().all(|r| r.contains("pp=2 tp=1 dp=1")),
        "{stdout}"
    );

    args.extend(["--measure"]);
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
            vec!["--world", "2", "--model", "cnn", "--task", "shapes"],
            "pipewright profile",
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
