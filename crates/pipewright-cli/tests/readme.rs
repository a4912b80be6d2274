//! Every command the README shows runs: each `pipewright ...` line of its `sh` blocks (and the
//! main job) runs here with 2 steps and its outputs are checked; every other line (mpirun,
//! cargo builds, examples) must be one `.ci/run` runs.

mod common;

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The command lines of the README's `sh` blocks, comments stripped.
fn readme_commands() -> Vec<String> {
    let text = std::fs::read_to_string(root().join("README.md")).unwrap();
    let mut out = Vec::new();
    let mut inside = false;
    for line in text.lines() {
        if line.starts_with("```") {
            inside = line == "```sh";
            continue;
        }
        let cmd = line.split(" #").next().unwrap().trim();
        if inside && !cmd.is_empty() && !cmd.starts_with('#') {
            out.push(cmd.to_string());
        }
    }
    out
}

/// The main job's `cargo run ... -- ARGS` as `pipewright ARGS`.
const MAIN_JOB: &str = "cargo run --release -p pipewright-cli -- ";

/// Where a README path goes in the test's directory `dir`: `runs/NAME/rest` becomes
/// `dir/runs_NAME/rest`, anything else `dir/<path with / as _>`.
fn place(path: &str, dir: &Path) -> String {
    let p = match path.strip_prefix("runs/").map(|r| r.split_once('/')) {
        Some(Some((first, rest))) => dir.join(format!("runs_{first}")).join(rest),
        Some(None) => dir.join(format!("runs_{}", &path[5..])),
        None => dir.join(path.replace('/', "_")),
    };
    p.display().to_string()
}

/// A blend's `W:runs/...` parts placed in `dir` as [`place`] places a run's path.
fn place_blend(blend: &str, dir: &Path) -> String {
    blend
        .split(',')
        .map(|part| match part.split_once(':') {
            Some((w, p)) => format!("{w}:{}", place(p, dir)),
            None => part.to_string(),
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// `args` with `--steps` set to 2 (3 when resuming, so that one more step runs), a checkpoint
/// every step, `--out`, `--trace`, `--svg` and `runs/...` arguments in `dir`, and `--data`
/// relative to the repository.
fn shrink(args: &[&str], dir: &Path) -> Vec<String> {
    let steps = if args.contains(&"--resume") { "3" } else { "2" };
    let mut out: Vec<String> = Vec::new();
    let mut it = args.iter().peekable();
    while let Some(a) = it.next() {
        let next = it.peek().map(|v| v.to_string()).unwrap_or_default();
        let value = match *a {
            "--steps" => Some(steps.to_string()),
            "--checkpoint-every" => Some("1".to_string()),
            "--out" | "--trace" | "--svg" => Some(place(&next, dir)),
            "--data" if next.contains(":runs/") => Some(place_blend(&next, dir)),
            "--data" if next.starts_with("runs/") => Some(place(&next, dir)),
            "--data" => Some(root().join(&next).display().to_string()),
            _ => None,
        };
        match value {
            Some(v) => {
                out.push(a.to_string());
                out.push(v);
                it.next();
            }
            None if a.starts_with("runs/") => out.push(place(a, dir)),
            None => out.push(a.to_string()),
        }
    }
    if args[0] == "train" && !args.contains(&"--help") && !args.contains(&"--steps") {
        out.extend(["--steps".to_string(), steps.to_string()]);
    }
    out
}

fn value_of<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    let i = args.iter().position(|a| a == flag)?;
    args.get(i + 1).map(String::as_str)
}

/// Checks what a command wrote.
fn check_outputs(args: &[String], stdout: &str) {
    if args[0] == "train" && args.iter().any(|a| a == "--help") {
        assert!(
            stdout.contains("--chunk-size") && stdout.contains("--device"),
            "{stdout}"
        );
        return;
    }
    if args[0] == "train" {
        let out = Path::new(value_of(args, "--out").unwrap());
        let csv = std::fs::read_to_string(out.join("scalars.csv")).unwrap();
        let rows: Vec<&str> = csv.lines().skip(1).collect();
        let steps: usize = value_of(args, "--steps").unwrap().parse().unwrap();
        assert_eq!(rows.len(), steps, "{args:?}: {csv}");
        for r in rows {
            let loss: f64 = r.split(',').nth(1).unwrap().parse().unwrap();
            assert!(loss.is_finite() && loss > 0.0, "{args:?}: {r}");
        }
        let summary: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap())
                .unwrap();
        let pp: usize = value_of(args, "--pp").map_or(1, |v| v.parse().unwrap());
        assert_eq!(summary["bubble_per_stage"].as_array().unwrap().len(), pp);
        // Rank 0's step part by part: each part's median, the pipeline's among them (how
        // they add up to a step is timing, which benchmarks judge, not this test).
        let parts: pipewright::plan::StepParts =
            serde_json::from_value(summary["median_step_parts"].clone()).unwrap();
        let step = summary["median_step_seconds"].as_f64().unwrap();
        assert!(
            parts.pipeline_s > 0.0 && parts.total().is_finite() && step > 0.0,
            "{args:?}: {summary}"
        );
    }
    if let Some(svg) = value_of(args, "--svg") {
        let pp: usize = value_of(args, "--pp").unwrap().parse().unwrap();
        let chunks: usize = value_of(args, "--chunks").unwrap().parse().unwrap();
        // A prediction with a measured trace beneath it: two panels of pp rows each.
        let panels = 1 + usize::from(value_of(args, "--trace").is_some());
        // zb1: F, I and W of every micro-batch; otherwise F and B.
        let per_mb = if value_of(args, "--schedule") == Some("zb1") {
            3
        } else {
            2
        };
        check_svg(Path::new(svg), pp * panels, per_mb * chunks);
    }
    if let (Some(trace), "train") = (value_of(args, "--trace"), args[0].as_str()) {
        let pp: usize = value_of(args, "--pp").unwrap().parse().unwrap();
        let chunks: usize = value_of(args, "--chunks").unwrap().parse().unwrap();
        let schedule = value_of(args, "--schedule").unwrap_or("1f1b");
        check_trace(Path::new(trace), pp, chunks, schedule);
    }
    if args[..2] == ["bench", "comm"] {
        assert!(
            stdout.contains("all_reduce") && stdout.contains("send/recv"),
            "{stdout}"
        );
    }
    if args[..2] == ["bench", "ckpt"] {
        assert!(
            stdout.contains("plain sequential write") && stdout.contains("async save"),
            "{stdout}"
        );
    }
    if args[..2] == ["data", "prepare"] {
        let out = Path::new(value_of(args, "--out").unwrap());
        let index: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("index.json")).unwrap())
                .unwrap();
        assert!(!index["train"].as_array().unwrap().is_empty(), "{index}");
    }
    if args[0] == "profile" && args.iter().any(|a| a == "--gemm") {
        // A hardware file whose f32 curve was fitted to the grid's timings.
        let path = value_of(args, "--out").unwrap();
        let hw = pipewright::plan::Hardware::load(path).unwrap();
        let curve = hw.gemm_f32.expect("a measured f32 curve");
        assert_eq!(curve.measured.len(), pipewright::plan::gemm_grid(1).len());
        assert!(curve.ceiling_flops_per_s > 1e9, "{curve:?}");
    } else if args[0] == "profile" {
        let path = value_of(args, "--out").unwrap();
        let p: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        // The default GPT: embed, h.0, h.1, ln_f, lm_head; cuts after embed and each block.
        let layers = p["layers"].as_array().unwrap();
        assert_eq!(layers.len(), 5, "{p}");
        assert_eq!(p["bounds"], serde_json::json!([0, 1, 2, 3, 5]), "{p}");
        let num = |i: usize, k: &str| layers[i][k].as_f64().unwrap();
        assert_eq!(num(1, "params"), num(2, "params"), "the blocks are alike");
        assert!(
            num(1, "params") > 50.0 * num(0, "params"),
            "a block outweighs the embedding"
        );
        // d 128, 4 heads: a block's output is 128 f32 per token; it keeps more than that for
        // its backward (q|k|v, the MLP's hidden layer, the norms).
        let tokens = num(1, "output_bytes_per_sample") / (128.0 * 4.0);
        assert!(tokens >= 1.0 && tokens.fract() == 0.0, "{tokens}");
        assert!(num(1, "kept_bytes_per_sample") > 8.0 * num(1, "output_bytes_per_sample"));
        assert!(layers
            .iter()
            .all(|l| l["forward"]["per_sample_s"].as_f64().unwrap() >= 0.0));
    }
    if args[0] == "report" || (args[0] == "train" && args.iter().any(|a| a == "--report")) {
        let page = match value_of(args, "--out") {
            Some(o) if args[0] == "report" => PathBuf::from(o),
            Some(o) => Path::new(o).join("report.html"),
            None => unreachable!("the README names where its runs go"),
        };
        let html = std::fs::read_to_string(&page).unwrap();
        for id in [
            "summary",
            "curves",
            "throughput",
            "timeline",
            "memory",
            "parameters",
        ] {
            assert!(
                html.contains(&format!("id=\"{id}\"")),
                "{page:?} lacks {id}"
            );
        }
        // A mixture of experts' run has the Experts section.
        if args.iter().any(|a| a == "--n-experts") {
            assert!(html.contains("id=\"experts\""), "{page:?} lacks experts");
        }
    }
    if args[0] == "sweep" {
        // 2 x 2 combinations, each trained and tabulated.
        let ok = stdout.lines().filter(|l| l.ends_with(" ok")).count();
        assert_eq!(ok, 4, "{stdout}");
        let csv =
            std::fs::read_to_string(Path::new(value_of(args, "--out").unwrap()).join("sweep.csv"));
        assert_eq!(csv.unwrap().lines().count(), 5);
    }
    if args[0] == "plan" {
        check_plan(args, stdout);
    }
    if args[0] == "balance" {
        // 3,1,4,1,5,9,2,6 over 3: no split has a slowest stage under 14 (9 | 5,9 | 8 ties
        // with 14 | 9 | 8; earlier stages take more).
        assert!(
            stdout.starts_with("balance 5,1,2") && stdout.contains("time 14"),
            "{stdout}"
        );
    }
    if args[0] == "ckpt" {
        check_ckpt(args, stdout);
    }
}

/// What `plan` must have printed: a ranked table, each layout's ranks making the world, and
/// (with --measure) the measured rows.
fn check_plan(args: &[String], stdout: &str) {
    let world: usize = value_of(args, "--world").unwrap().parse().unwrap();
    let top: usize = value_of(args, "--top").map_or(5, |t| t.parse().unwrap());
    let rows: Vec<&str> = stdout
        .lines()
        .filter(|l| {
            l.split_whitespace()
                .nth(1)
                .is_some_and(|w| w.starts_with("pp="))
        })
        .collect();
    assert!(!rows.is_empty() && rows.len() <= top, "{stdout}");
    for row in &rows {
        let axes: usize = row
            .split_whitespace()
            .skip(1)
            .take_while(|w| w.contains('='))
            .map(|a| a.split('=').nth(1).unwrap().parse::<usize>().unwrap())
            .product();
        assert_eq!(axes, world, "{row}");
    }
    if args.iter().any(|a| a == "--explain") {
        assert!(
            stdout.contains("where the step of ") && stdout.contains("hidden behind the backward"),
            "{stdout}"
        );
    }
    if args.iter().any(|a| a == "--measure") {
        let measured = stdout
            .lines()
            .filter(|l| l.contains('%') && l.matches("ms").count() == 2);
        assert_eq!(measured.count(), rows.len(), "{stdout}");
    }
}

/// What each `ckpt` command must have said or written.
fn check_ckpt(args: &[String], stdout: &str) {
    match args[1].as_str() {
        "inspect" => assert!(
            stdout.contains(" saved at pp=") && stdout.contains("wte.weight"),
            "{stdout}"
        ),
        "verify" => assert!(stdout.starts_with("ok:"), "{stdout}"),
        "reshard" => {
            let out = Path::new(value_of(args, "--out").unwrap());
            let latest = std::fs::read_to_string(out.join("latest")).unwrap();
            let m = std::fs::read_to_string(out.join(latest.trim()).join("manifest.json")).unwrap();
            assert!(m.contains("\"tp\": 2") && m.contains("\"pp\": 2"), "{m}");
        }
        "export" => {
            let out = Path::new(value_of(args, "--out").unwrap());
            let format = value_of(args, "--format");
            let file = if format.is_some_and(|f| f.starts_with("hf-")) {
                assert!(out.join("config.json").exists());
                out.join("model.safetensors")
            } else {
                out.to_path_buf()
            };
            let bytes = std::fs::read(file).unwrap();
            let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            let header = String::from_utf8_lossy(&bytes[8..8 + n]).to_string();
            let embedding = if matches!(format, Some("hf-llama" | "hf-mixtral")) {
                "model.embed_tokens.weight"
            } else {
                "wte.weight"
            };
            assert!(header.contains(embedding), "{header}");
        }
        other => panic!("the README shows `ckpt {other}`, which this test does not check"),
    }
}

/// A zero-bubble timeline: one labelled row per stage, and on each row one box per F, I and W
/// of every micro-batch.
fn check_svg(path: &Path, rows_wanted: usize, per_row: usize) {
    let text = std::fs::read_to_string(path).unwrap();
    let doc = roxmltree::Document::parse(&text).expect("the SVG parses as XML");
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    let labels: Vec<f64> = doc
        .descendants()
        .filter(|n| n.has_tag_name("text") && n.text().is_some_and(|t| t.starts_with("stage ")))
        .map(|n| n.attribute("y").unwrap().parse().unwrap())
        .collect();
    assert_eq!(labels.len(), rows_wanted, "one row per stage");
    let mut rows: Vec<f64> = doc
        .descendants()
        .filter(|n| n.has_tag_name("rect") && n.attribute("x").is_some())
        .map(|n| n.attribute("y").unwrap().parse().unwrap())
        .collect();
    rows.sort_by(f64::total_cmp);
    rows.dedup();
    assert_eq!(
        rows.len(),
        rows_wanted,
        "action boxes on {} rows",
        rows.len()
    );
    for y in rows {
        let n = doc
            .descendants()
            .filter(|n| n.has_tag_name("rect") && n.attribute("y") == Some(&y.to_string()))
            .count();
        assert_eq!(
            n, per_row,
            "row at y={y}: every action of every micro-batch"
        );
    }
}

/// A trace: every pipeline rank's track has F and B events (a zero-bubble one's F, I and W),
/// one per micro-batch, step and model stage it holds (two in a V).
fn check_trace(path: &Path, pp: usize, chunks: usize, schedule: &str) {
    let letters: &[&str] = match schedule {
        "zb1" | "zbv" => &["F", "I", "W"],
        _ => &["F", "B"],
    };
    let stages = if schedule == "zbv" { 2 } else { 1 };
    let t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let events = t["traceEvents"].as_array().unwrap();
    for rank in 0..pp {
        for &letter in letters {
            let n = events
                .iter()
                .filter(|e| e["ph"] == "X" && e["tid"] == rank && e["cat"] == letter)
                .count();
            assert_eq!(
                n,
                2 * chunks * stages,
                "rank {rank}: {letter} events of 2 steps"
            );
        }
    }
}

/// The run directories a command names (`runs/NAME...` gives `NAME`): commands naming one
/// another's runs depend on each other's outputs.
fn runs_named(words: &[&str]) -> Vec<String> {
    // A blend names several: `0.7:runs/a,0.3:runs/b`.
    words
        .iter()
        .flat_map(|w| w.split(','))
        .map(|w| w.split_once(':').map_or(w, |(_, p)| p))
        .filter_map(|w| w.strip_prefix("runs/"))
        .map(|r| r.split('/').next().unwrap().to_string())
        .collect()
}

/// A README line and the arguments it runs with.
type Cmd = (String, Vec<String>);

/// The commands in chains: two commands naming a common run directory (directly or through
/// others) share a chain and keep the README's order in it; chains are independent.
fn chains(cmds: Vec<(String, Vec<String>, Vec<String>)>) -> Vec<Vec<Cmd>> {
    // Each chain: the run directories its commands name, and the commands.
    let mut chains: Vec<(Vec<String>, Vec<Cmd>)> = Vec::new();
    for (cmd, args, runs) in cmds {
        let (mut names, mut members) = (runs, vec![(cmd, args)]);
        // Every chain sharing a name joins this one, earlier commands first.
        let mut i = chains.len();
        while i > 0 {
            i -= 1;
            if chains[i].0.iter().any(|n| names.contains(n)) {
                let (n, mut m) = chains.remove(i);
                names.extend(n);
                m.append(&mut members);
                members = m;
            }
        }
        chains.push((names, members));
    }
    chains.into_iter().map(|(_, m)| m).collect()
}

/// Runs one README command and checks its outputs; an error says which and why.
fn run_and_check(cmd: &str, args: &[String]) {
    let o = common::pipewright()
        .args(args)
        .current_dir(root())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        o.status.success(),
        "`{cmd}` failed:\n{stdout}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    check_outputs(args, &stdout);
}

#[test]
fn every_readme_command_runs() {
    let dir = std::env::temp_dir().join(format!("pw-readme-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let ci = std::fs::read_to_string(root().join(".ci/run")).unwrap();
    let mut cmds = Vec::new();
    for cmd in readme_commands() {
        let line = cmd
            .strip_prefix(MAIN_JOB)
            .map(|r| format!("pipewright {r}"));
        let Some(rest) = line.as_deref().unwrap_or(&cmd).strip_prefix("pipewright ") else {
            assert!(
                ci.lines().any(|l| l.trim() == cmd),
                "the README shows `{cmd}` but .ci/run does not run it"
            );
            continue;
        };
        let words: Vec<&str> = rest.split_whitespace().collect();
        let args = shrink(&words, &dir);
        cmds.push((cmd.clone(), args, runs_named(&words)));
    }
    let ran = cmds.len();
    assert!(ran >= 15, "ran {ran} commands");
    // Independent chains run side by side, one per core: most commands are a process that
    // builds a small model and trains 2 steps on one core.
    let queue = std::sync::Mutex::new(chains(cmds));
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| loop {
                let Some(chain) = queue.lock().unwrap().pop() else {
                    break;
                };
                for (cmd, args) in chain {
                    run_and_check(&cmd, &args);
                }
            });
        }
    });
    let _ = std::fs::remove_dir_all(dir);
}
