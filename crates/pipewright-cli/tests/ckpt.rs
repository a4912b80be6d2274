//! Checkpoints from the command line: a run resumed in a fresh process writes the
//! uninterrupted run's losses bit for bit; a process killed while saving leaves `latest` on a
//! complete checkpoint; `ckpt verify`, `inspect`, `reshard` and `export` do what they say.

mod common;

use std::path::Path;
use std::process::{Output, Stdio};

fn pipewright(args: &[&str]) -> Output {
    let o = common::pipewright()
        .args(args)
        .output()
        .expect("runs the binary");
    assert!(
        o.status.success(),
        "{args:?} failed:\n{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

const SMALL: &[&str] = &[
    "train",
    "--n-layer",
    "2",
    "--n-head",
    "2",
    "--n-embd",
    "16",
    "--batch-size",
    "8",
    "--chunks",
    "2",
    "--dropout",
    "0.1",
    "--lr-schedule",
    "constant",
    "--eval-every",
    "1000",
];

fn train(out: &Path, extra: &[&str]) -> String {
    let mut a: Vec<&str> = SMALL.to_vec();
    a.extend_from_slice(&["--out", out.to_str().unwrap()]);
    a.extend_from_slice(extra);
    pipewright(&a);
    std::fs::read_to_string(out.join("scalars.csv")).unwrap()
}

#[test]
fn a_resumed_run_writes_the_uninterrupted_runs_losses() {
    let (whole, parts) = (common::tmp("whole"), common::tmp("parts"));
    for layout in [&["--pp", "2", "--tp", "2"][..], &["--dp", "2"][..]] {
        let _ = std::fs::remove_dir_all(&whole);
        let _ = std::fs::remove_dir_all(&parts);
        let mut a = layout.to_vec();
        a.extend_from_slice(&["--steps", "12", "--checkpoint-every", "6"]);
        let want = train(&whole, &a);
        let mut first = layout.to_vec();
        first.extend_from_slice(&["--steps", "6", "--checkpoint-every", "6"]);
        train(&parts, &first);
        let mut second = layout.to_vec();
        second.extend_from_slice(&["--steps", "12", "--resume", "latest"]);
        let got = train(&parts, &second);
        // step, loss and lr of every row (the first part also evaluated at its last step).
        let cols = |s: &str| {
            s.lines()
                .map(|l| l.splitn(4, ',').take(3).collect::<Vec<_>>().join(","))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            cols(&got),
            cols(&want),
            "{layout:?}: scalars.csv of the resumed run"
        );
        assert_eq!(got.lines().count(), 13, "one row per step, none twice");
    }
    for d in [whole, parts] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn a_process_killed_while_saving_leaves_latest_complete() {
    let out = common::tmp("killed");
    let args: Vec<String> = [
        "train",
        "--n-layer",
        "4",
        "--n-embd",
        "128",
        "--batch-size",
        "4",
        "--steps",
        "1000",
        "--checkpoint-every",
        "1",
        "--keep",
        "2",
        "--out",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([out.display().to_string()])
    .collect();
    let ckpts = out.join("checkpoints");
    // Every step saves, so a kill a few milliseconds after the first save lands in a later
    // save at a different point each time: writing tensors, the manifest, `latest` or removing
    // the oldest.
    for delay_ms in [0, 5, 13, 29] {
        let _ = std::fs::remove_dir_all(&out);
        let mut child = common::pipewright()
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let start = std::time::Instant::now();
        while !ckpts.join("latest").exists() {
            assert!(
                start.elapsed().as_secs() < 60,
                "no checkpoint within a minute"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        std::thread::sleep(std::time::Duration::from_millis(delay_ms));
        child.kill().unwrap();
        child.wait().unwrap();
        let v = pipewright(&["ckpt", "verify", ckpts.to_str().unwrap()]);
        assert!(String::from_utf8_lossy(&v.stdout).starts_with("ok:"));
        // The run goes on from it, one more step.
        let latest = std::fs::read_to_string(ckpts.join("latest")).unwrap();
        let step: u64 = latest.trim().trim_start_matches("step-").parse().unwrap();
        let next = (step + 1).to_string();
        let mut resume: Vec<&str> = args[..args.len() - 8].iter().map(String::as_str).collect();
        resume.extend_from_slice(&["--steps", &next, "--resume", "latest", "--out"]);
        resume.push(out.to_str().unwrap());
        pipewright(&resume);
    }
    let _ = std::fs::remove_dir_all(out);
}

/// The names and shapes in a safetensors file's header.
fn safetensors_shapes(path: &Path) -> Vec<(String, Vec<usize>)> {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let h: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut out: Vec<(String, Vec<usize>)> = h
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(k, v)| {
            let s = v["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize);
            (k.clone(), s.collect())
        })
        .collect();
    out.sort();
    out
}

#[test]
fn export_reshard_inspect_and_verify() {
    let run = common::tmp("export");
    // A vocabulary padded from the adder's 10 to 12 ids, split over tp=2.
    train(
        &run,
        &[
            "--tp",
            "2",
            "--vocab-size",
            "12",
            "--steps",
            "3",
            "--checkpoint-every",
            "3",
        ],
    );
    let ck = run.join("checkpoints");
    let hf = run.join("hf");
    pipewright(&[
        "ckpt",
        "export",
        ck.to_str().unwrap(),
        "--format",
        "hf-gpt2",
        "--out",
        hf.to_str().unwrap(),
    ]);
    // GPT2LMHeadModel's state dict for n_layer 2, n_embd 16, vocabulary 10, 64 positions
    // (the adder's sequences are 6 tokens; the default block size is the task's).
    let (d, v, p) = (16, 10, 6);
    let mut want: Vec<(String, Vec<usize>)> = vec![
        ("transformer.wte.weight".into(), vec![v, d]),
        ("transformer.wpe.weight".into(), vec![p, d]),
        ("transformer.ln_f.weight".into(), vec![d]),
        ("transformer.ln_f.bias".into(), vec![d]),
        ("lm_head.weight".into(), vec![v, d]),
    ];
    for i in 0..2 {
        let h = |s: &str| format!("transformer.h.{i}.{s}");
        want.extend([
            (h("ln_1.weight"), vec![d]),
            (h("ln_1.bias"), vec![d]),
            (h("attn.c_attn.weight"), vec![d, 3 * d]),
            (h("attn.c_attn.bias"), vec![3 * d]),
            (h("attn.c_proj.weight"), vec![d, d]),
            (h("attn.c_proj.bias"), vec![d]),
            (h("ln_2.weight"), vec![d]),
            (h("ln_2.bias"), vec![d]),
            (h("mlp.c_fc.weight"), vec![d, 4 * d]),
            (h("mlp.c_fc.bias"), vec![4 * d]),
            (h("mlp.c_proj.weight"), vec![4 * d, d]),
            (h("mlp.c_proj.bias"), vec![d]),
        ]);
    }
    want.sort();
    assert_eq!(safetensors_shapes(&hf.join("model.safetensors")), want);
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(hf.join("config.json")).unwrap()).unwrap();
    assert_eq!(
        (cfg["vocab_size"].as_u64(), cfg["n_layer"].as_u64()),
        (Some(10), Some(2))
    );
    // Whole tensors by global name.
    let whole = run.join("whole.safetensors");
    pipewright(&[
        "ckpt",
        "export",
        ck.to_str().unwrap(),
        "--format",
        "safetensors",
        "--out",
        whole.to_str().unwrap(),
    ]);
    let names = safetensors_shapes(&whole);
    assert!(
        names.contains(&("wte.weight".into(), vec![12, d])),
        "{names:?}"
    );
    // Resharded from tp=2 to pp=2 x dp=2 it holds the same values, whole.
    let re = run.join("re");
    pipewright(&[
        "ckpt",
        "reshard",
        ck.to_str().unwrap(),
        "--pp",
        "2",
        "--dp",
        "2",
        "--out",
        re.to_str().unwrap(),
    ]);
    let i = pipewright(&["ckpt", "inspect", re.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&i.stdout).to_string();
    assert!(
        text.contains("saved at pp=2 tp=1 dp=2 f32 by 4 ranks"),
        "{text}"
    );
    let wte = text.lines().find(|l| l.starts_with("wte.weight ")).unwrap();
    assert_eq!(wte.split_whitespace().nth(5), Some("1"), "{wte}");
    let v = pipewright(&["ckpt", "verify", re.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&v.stdout).starts_with("ok:"));
    let again = run.join("whole-again.safetensors");
    pipewright(&[
        "ckpt",
        "export",
        re.to_str().unwrap(),
        "--format",
        "safetensors",
        "--out",
        again.to_str().unwrap(),
    ]);
    let tensors = |p: &Path| std::fs::read(p).unwrap();
    assert_eq!(tensors(&whole), tensors(&again), "the same whole tensors");
    let _ = std::fs::remove_dir_all(run);
}

/// A checkpoint saved before runs were recorded as a `RunSpec` stored the flags (`args`) and
/// the model config (`model`) in its meta: it exports the same model, and still reshards.
#[test]
fn a_checkpoint_with_the_old_meta_exports_the_same_model() {
    let run = common::tmp("old-meta");
    train(&run, &["--steps", "2", "--checkpoint-every", "2"]);
    let step = run.join("checkpoints").join("step-00000002");
    let export = |out: &Path| {
        pipewright(&[
            "ckpt",
            "export",
            step.to_str().unwrap(),
            "--format",
            "hf-gpt2",
            "--out",
            out.to_str().unwrap(),
        ]);
        std::fs::read(out.join("model.safetensors")).unwrap()
    };
    let new = export(&run.join("hf-new"));
    // The meta as it was: the flags of params.json and the model config.
    let mp = step.join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&mp).unwrap()).unwrap();
    let mut args: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("params.json")).unwrap()).unwrap();
    let model = args["spec"]["model"].clone();
    for k in [
        "pipewright_version",
        "task_shape",
        "num_params",
        "layers",
        "cut_points",
    ] {
        args.as_object_mut().unwrap().remove(k);
    }
    for k in ["tied", "spec"] {
        args.as_object_mut().unwrap().remove(k);
    }
    m["meta"] = serde_json::json!({"args": args, "model": model});
    std::fs::write(&mp, serde_json::to_string(&m).unwrap()).unwrap();
    assert_eq!(export(&run.join("hf-old")), new);
    let re = run.join("re");
    pipewright(&[
        "ckpt",
        "reshard",
        step.to_str().unwrap(),
        "--tp",
        "2",
        "--out",
        re.to_str().unwrap(),
    ]);
}
