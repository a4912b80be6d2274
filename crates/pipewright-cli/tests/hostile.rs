//! Hostile input, round three: what was silently accepted, silently wrong or aborted now
//! gives a clear error (or the right result, said), and nothing is written before an error.

mod common;

use common::{refused, run, text, tmp, train, TINY};

/// `pipewright train` of the tiny GPT with `more` flags into a new directory of `dir`.
fn tiny(dir: &std::path::Path, name: &str, more: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = ["train"]
        .iter()
        .chain(TINY)
        .map(|s| s.to_string())
        .collect();
    a.extend(more.iter().map(|s| s.to_string()));
    a.extend(["--out".into(), dir.join(name).to_str().unwrap().to_string()]);
    a
}

fn check(args: Vec<String>, says: &str) {
    refused(&args.iter().map(String::as_str).collect::<Vec<_>>(), says);
}

#[test]
fn flags_that_would_be_dropped_unsaid_are_said_or_refused() {
    let dir = tmp("hostile-flags");
    // A flag given twice: the last value is taken, and that is said.
    let twice = tiny(&dir, "twice", &["--steps", "3", "--steps", "5"]);
    let o = run(&twice.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("--steps is given 2 times: its last value is taken"),
        "{}",
        text(&o)
    );
    assert_eq!(common::losses(&dir.join("twice")).len(), 5);
    // A schedule and a schedule file: the file would have run under the schedule's name.
    let sched = dir.join("s.csv");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(&sched, "0F0,0B0\n").unwrap();
    check(
        tiny(
            &dir,
            "both",
            &[
                "--pp",
                "2",
                "--schedule",
                "zb1",
                "--schedule-file",
                sched.to_str().unwrap(),
            ],
        ),
        "cannot be used with",
    );
    // Mixtures every 5th block of a 1-block model: a dense model.
    check(
        tiny(
            &dir,
            "dense",
            &["--model", "llama", "--n-experts", "4", "--moe-every", "5"],
        ),
        "makes no block a mixture of experts",
    );
    assert!(!dir.join("both").exists() && !dir.join("dense").exists());
}

#[test]
fn a_run_that_checkpoints_saves_its_last_step() {
    let dir = tmp("hostile-last");
    let out = dir.join("run");
    let mut a: Vec<&str> = TINY.to_vec();
    let o_str = out.to_str().unwrap();
    a.extend_from_slice(&["--steps", "5", "--checkpoint-every", "2", "--out", o_str]);
    let o = train(&a);
    assert!(o.status.success(), "{}", text(&o));
    let ck = out.join("checkpoints");
    assert!(ck.join("step-00000004/manifest.json").exists());
    assert!(ck.join("step-00000005/manifest.json").exists());
    assert_eq!(
        std::fs::read_to_string(ck.join("latest")).unwrap().trim(),
        "step-00000005"
    );
}

#[test]
fn sweeps_listings_and_launches_of_absurd_sizes_are_refused() {
    let dir = tmp("hostile-sizes");
    let sweep = |params: &[&str]| -> Vec<String> {
        let mut a = vec!["sweep".to_string()];
        for p in params {
            a.extend(["--param".into(), p.to_string()]);
        }
        a.extend(["--out".into(), dir.join("sweep").to_str().unwrap().into()]);
        a.extend(["--".into(), "pipewright".into(), "train".into()]);
        a
    };
    check(sweep(&["lr=1e-3,1e-3"]), "value `1e-3` twice");
    check(sweep(&["steps=1,2", "steps=3"]), "`steps` twice");
    assert!(!dir.join("sweep").exists(), "nothing written");
    check(
        vec![
            "data".into(),
            "windows".into(),
            "--data".into(),
            dir.join("none").to_str().unwrap().into(),
            "--block-size".into(),
            "8".into(),
            "--batch-size".into(),
            "100000000".into(),
            "--steps".into(),
            "1000000000".into(),
            "--out".into(),
            dir.join("w.csv").to_str().unwrap().into(),
        ],
        "more than the 16777216 one listing holds",
    );
    let o = run(&[
        "launch",
        "--hosts",
        "a:100000,b:100000",
        "--",
        "pipewright",
        "train",
    ]);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("at most 1024 a host"), "{}", text(&o));
}

/// A copy of the fixture model directory `name` as `dir/to`, its config.json edited by `edit`.
fn model_copy(
    dir: &std::path::Path,
    (name, to): (&str, &str),
    edit: impl Fn(&mut serde_json::Value),
) -> std::path::PathBuf {
    let from = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../pipewright-models/tests/fixtures")
        .join(name);
    let to = dir.join(to);
    std::fs::create_dir_all(&to).unwrap();
    for e in std::fs::read_dir(&from).unwrap().flatten() {
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
    let cfg = to.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&cfg, serde_json::to_string(&v).unwrap()).unwrap();
    to
}

#[test]
fn pretrained_weights_are_taken_whole_with_the_flags_that_apply() {
    let dir = tmp("hostile-pretrained");
    let base = |model: &str, from: &std::path::Path, more: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = ["train", "--model", model, "--init-from"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        a.push(from.to_str().unwrap().into());
        a.extend(["--steps", "2", "--batch-size", "4"].map(String::from));
        a.extend(more.iter().map(|s| s.to_string()));
        a
    };
    // A config.json of fewer layers than the weights would train a truncated model.
    let short = model_copy(&dir, ("hf-llama", "short-llama"), |v| {
        v["num_hidden_layers"] = 1.into()
    });
    let out = dir.join("short").to_str().unwrap().to_string();
    check(
        base("llama", &short, &["--out", &out]),
        "holds weights of 2 blocks but its config.json says 1",
    );
    // The rotary base is the weights': refused, not ignored.
    let llama = model_copy(&dir, ("hf-llama", "llama"), |_| {});
    let out = dir.join("theta").to_str().unwrap().to_string();
    check(
        base("llama", &llama, &["--rope-theta", "5000", "--out", &out]),
        "drop --rope-theta",
    );
    // Dropout is the fine-tuning's: taken, and recorded as run.
    let out = dir.join("dropout");
    let gpt = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../pipewright-models/tests/fixtures/hf-gpt2");
    let a = base(
        "gpt",
        &gpt,
        &["--dropout", "0.5", "--out", out.to_str().unwrap()],
    );
    let o = run(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(o.status.success(), "{}", text(&o));
    let params: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("params.json")).unwrap()).unwrap();
    let text = params.to_string();
    assert!(text.contains("\"dropout\":0.5"), "{text}");
}

#[test]
fn runs_that_cannot_train_say_so() {
    let dir = tmp("hostile-train");
    // An f16 run whose last step's loss is NaN (its earlier steps skipped) ends in an error.
    let f16 = tiny(
        &dir,
        "f16",
        &[
            "--precision",
            "f16",
            "--lr",
            "1000",
            "--clip",
            "0",
            "--steps",
            "10",
        ],
    );
    check(f16, "loss is NaN at step 10");
    // The CNN computes in f32 only: said before anything is built.
    let cnn = vec![
        "train",
        "--model",
        "cnn",
        "--task",
        "shapes",
        "--precision",
        "bf16",
        "--out",
    ];
    let mut cnn: Vec<String> = cnn.into_iter().map(String::from).collect();
    cnn.push(dir.join("cnn").to_str().unwrap().into());
    check(cnn, "--model cnn trains in f32 only");
    // profile times layers, not a layout: --ep is refused by name (it asked for a divisor of
    // --dp, which profile does not take).
    let out = dir.join("p.json").to_str().unwrap().to_string();
    let profile = [
        "profile",
        "--model",
        "llama",
        "--n-experts",
        "4",
        "--ep",
        "2",
        "--out",
    ];
    let mut profile: Vec<String> = profile.into_iter().map(String::from).collect();
    profile.push(out);
    check(profile, "drop --ep");
}

#[test]
fn a_mixture_no_hugging_face_format_holds_is_advised_safetensors() {
    let dir = tmp("hostile-export");
    let out = dir.join("moe");
    let a = tiny(
        &dir,
        "moe",
        &[
            "--model",
            "llama",
            "--n-experts",
            "4",
            "--shared-experts",
            "1",
            "--steps",
            "2",
            "--checkpoint-every",
            "2",
        ],
    );
    let o = run(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(o.status.success(), "{}", text(&o));
    let ck = out.join("checkpoints");
    for format in ["hf-qwen3-moe", "hf-mixtral"] {
        let to = dir.join(format);
        let args = [
            "ckpt",
            "export",
            ck.to_str().unwrap(),
            "--format",
            format,
            "--out",
        ];
        let mut args: Vec<String> = args.into_iter().map(String::from).collect();
        args.push(to.to_str().unwrap().into());
        check(args, "safetensors");
    }
}
