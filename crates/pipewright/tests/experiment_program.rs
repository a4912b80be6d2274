//! Experiments as programs, on the example's experiment (`examples/experiment.rs`, included so
//! that the tests run what the example documents): parameter precedence and `--help`,
//! `parameters.json` rerunning a run, the data loader's shards and order, and a context saved
//! and restored in fresh processes going on bit for bit (serial and pp=2 x dp=2).

#[allow(dead_code)]
#[path = "../examples/experiment.rs"]
mod example;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use candle_core::Device;
use example::{experiment, Points};
use pipewright::experiment::{Dataset, SmartDataLoader};
use pipewright::Error;

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pw-exp-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn args(extra: &[&str]) -> Vec<String> {
    std::iter::once("experiment")
        .chain(extra.iter().copied())
        .map(String::from)
        .collect()
}

#[test]
fn parameters_come_from_defaults_then_the_file_then_the_command_line() {
    let e = experiment();
    let p = e.parse(args(&[])).unwrap();
    assert_eq!((p.float("lr").unwrap(), p.int("epochs").unwrap()), (0.5, 4));
    assert_eq!(p.string("checkpoint").unwrap(), None);
    assert!(!p.flag("debug").unwrap());

    let dir = tmp("params");
    let json = dir.join("p.json");
    std::fs::write(&json, r#"{"lr": 0.25, "epochs": 7, "debug": true}"#).unwrap();
    let toml = dir.join("p.toml");
    std::fs::write(
        &toml,
        "lr = 0.125\nsamples = 64\noutput_dir = \"elsewhere\"\n",
    )
    .unwrap();
    let from_file = e
        .parse(args(&["--params-file", json.to_str().unwrap()]))
        .unwrap();
    assert_eq!(from_file.float("lr").unwrap(), 0.25);
    assert_eq!(from_file.int("epochs").unwrap(), 7);
    assert!(from_file.flag("debug").unwrap());
    assert_eq!(
        from_file.int("samples").unwrap(),
        256,
        "not in the file: the default"
    );
    // The command line wins over the file.
    let both = e
        .parse(args(&[
            "--params-file",
            json.to_str().unwrap(),
            "--lr",
            "0.75",
            "--debug",
            "false",
        ]))
        .unwrap();
    assert_eq!(
        (both.float("lr").unwrap(), both.int("epochs").unwrap()),
        (0.75, 7)
    );
    assert!(!both.flag("debug").unwrap());
    let t = e
        .parse(args(&["--params-file", toml.to_str().unwrap()]))
        .unwrap();
    assert_eq!(
        (t.float("lr").unwrap(), t.int("samples").unwrap()),
        (0.125, 64)
    );
    assert_eq!(
        t.string("output_dir").unwrap().as_deref(),
        Some("elsewhere")
    );

    // Bad input names the parameter.
    std::fs::write(&json, r#"{"learning_rate": 1}"#).unwrap();
    let err = e
        .parse(args(&["--params-file", json.to_str().unwrap()]))
        .unwrap_err();
    assert!(
        err.to_string().contains("no parameter `learning_rate`"),
        "{err}"
    );
    std::fs::write(&json, r#"{"epochs": "many"}"#).unwrap();
    let err = e
        .parse(args(&["--params-file", json.to_str().unwrap()]))
        .unwrap_err();
    assert!(
        err.to_string().contains("parameter epochs takes Int"),
        "{err}"
    );
    let err = e.parse(args(&["--lr", "fast"])).unwrap_err();
    assert!(
        err.to_string().contains("parameter lr takes Float"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn help_lists_every_parameter_with_its_default() {
    let e = experiment();
    let Err(Error::Help(text)) = e.parse(args(&["--help"])) else {
        panic!("--help is not help");
    };
    for p in e.all_params().unwrap() {
        assert!(
            text.contains(&format!("--{}", p.name.replace('_', "-"))),
            "{}: {text}",
            p.name
        );
    }
    for default in [
        "[default: 0.5]",
        "[default: ./output]",
        "[default: 29500]",
        "[default: none]",
    ] {
        assert!(text.contains(default), "{default}: {text}");
    }
}

/// The `train/loss` rows of a run's `tags.csv`: (count, value).
fn recorded(run: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(run.join("tags.csv"))
        .unwrap()
        .lines()
        .skip(1)
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            (f[0].parse().unwrap(), f[2].parse().unwrap())
        })
        .collect()
}

fn losses(run: &Path) -> (Vec<f64>, f64) {
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("result.json")).unwrap()).unwrap();
    let l = r["losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    (l, r["held_out_loss"].as_f64().unwrap())
}

#[test]
fn parameters_json_reruns_a_run_exactly() {
    let dir = tmp("rerun");
    let e = experiment();
    let out = dir.to_str().unwrap();
    let first = e
        .run(
            &e.parse(args(&[
                "--output-dir",
                out,
                "--lr",
                "0.3",
                "--epochs",
                "2",
                "--random-seed",
                "5",
            ]))
            .unwrap(),
        )
        .unwrap();
    let file = first.join("parameters.json");
    let again = e
        .run(
            &e.parse(args(&["--params-file", file.to_str().unwrap()]))
                .unwrap(),
        )
        .unwrap();
    assert_ne!(first, again, "every run has its own directory");
    assert!(again.starts_with(dir.join("points")));
    assert_eq!(
        std::fs::read_to_string(&file).unwrap(),
        std::fs::read_to_string(again.join("parameters.json")).unwrap()
    );
    let (a, b) = (losses(&first), losses(&again));
    assert_eq!(a.0.len(), 2 * 256 / 16);
    assert_eq!(a, b);
    // Another seed is another run.
    let other = e
        .run(
            &e.parse(args(&["--output-dir", out, "--lr", "0.3", "--epochs", "2"]))
                .unwrap(),
        )
        .unwrap();
    assert_ne!(losses(&other).0, a.0);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_loader_gives_every_sample_once_an_epoch_in_disjoint_shards() {
    let (n, replicas, batch) = (30, 3, 4);
    let mut loaders: Vec<_> = (0..replicas)
        .map(|r| {
            SmartDataLoader::new(
                Points::new(n, 9),
                batch,
                true,
                11,
                (r, replicas),
                Device::Cpu,
            )
            .unwrap()
        })
        .collect();
    let mut orders = Vec::new();
    for epoch in 0..3 {
        let mut seen = Vec::new();
        for l in &mut loaders {
            assert_eq!(l.epoch(), epoch);
            let mut shard = Vec::new();
            while let Some(i) = l.next_indices() {
                assert!(i.len() <= batch);
                shard.extend(i);
            }
            assert_eq!(shard.len(), n / replicas);
            seen.push(shard);
        }
        let all: BTreeSet<usize> = seen.iter().flatten().copied().collect();
        assert_eq!(
            all.len(),
            n,
            "epoch {epoch}: every sample once over the replicas"
        );
        assert_eq!(all, (0..n).collect());
        orders.push(seen);
    }
    assert_ne!(orders[0], orders[1], "each epoch is shuffled anew");

    // A loader restored mid-epoch goes on in the same order; a batch holds its samples.
    let replica_1 = || {
        SmartDataLoader::new(
            Points::new(n, 9),
            batch,
            true,
            11,
            (1, replicas),
            Device::Cpu,
        )
        .unwrap()
    };
    let mut a = replica_1();
    a.next_indices();
    a.next_indices();
    let state = a.state_dict();
    let rest_a: Vec<_> = std::iter::from_fn(|| a.next_indices()).collect();
    let mut b = replica_1();
    b.load_state_dict(&state).unwrap();
    let rest_b: Vec<_> = std::iter::from_fn(|| b.next_indices()).collect();
    assert_eq!(rest_a, rest_b);
    let got = b.collate(&[3, 7]).unwrap();
    let want = Points::new(n, 9).get(7).unwrap();
    let row = got
        .get("x")
        .unwrap()
        .narrow(0, 1, 1)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    assert_eq!(row, want.get("x").unwrap().to_vec2::<f32>().unwrap());
    // Shards that cannot be equal are refused.
    assert!(SmartDataLoader::new(Points::new(31, 9), 4, true, 0, (0, 3), Device::Cpu).is_err());
}

/// Set in a re-executed test process: the experiment's arguments, as JSON.
const FRESH: &str = "PW_EXPERIMENT_ARGS";
const RESUME_TEST: &str = "context_resumes_in_fresh_processes_bit_for_bit";

/// Runs the example's experiment with `args` in a fresh process (this test binary again,
/// running only the resume test, which in that process runs just the experiment); its run
/// directory.
fn run_fresh(args: &[String]) -> PathBuf {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", RESUME_TEST, "--nocapture", "--test-threads", "1"])
        .env(FRESH, serde_json::to_string(args).unwrap())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("RUN DIR "))
        .expect("a run directory");
    PathBuf::from(line)
}

#[test]
fn context_resumes_in_fresh_processes_bit_for_bit() {
    if let Ok(json) = std::env::var(FRESH) {
        // The fresh process of `run_fresh`: one run of the experiment.
        let extra: Vec<String> = serde_json::from_str(&json).unwrap();
        let e = experiment();
        let p = e.parse(std::iter::once("experiment".to_string()).chain(extra));
        println!("RUN DIR {}", e.run(&p.unwrap()).unwrap().display());
        return;
    }
    for layout in [
        &[][..],
        &[
            "--distributed",
            "--nproc-per-node",
            "4",
            "--pp",
            "2",
            "--chunks",
            "2",
        ][..],
    ] {
        let dir = tmp("resume");
        let out = dir.to_str().unwrap();
        let run = |more: &[&str]| {
            let fixed = ["--output-dir", out, "--batch-size", "8", "--samples", "64"];
            let seed = ["--random-seed", "3"];
            let args: Vec<String> = fixed
                .iter()
                .chain(layout)
                .chain(more)
                .chain(&seed)
                .map(|s| s.to_string())
                .collect();
            run_fresh(&args)
        };
        let whole = run(&["--epochs", "4"]);
        let first = run(&["--epochs", "2", "--checkpoint-every", "2"]);
        let ckpt = first.join("checkpoints");
        let second = run(&["--epochs", "4", "--checkpoint", ckpt.to_str().unwrap()]);
        let (w, a, b) = (losses(&whole), losses(&first), losses(&second));
        assert_eq!(
            w.0.len(),
            4 * 64 / 8 / if layout.is_empty() { 1 } else { 2 }
        );
        let resumed: Vec<f64> = a.0.iter().chain(&b.0).copied().collect();
        assert_eq!(
            resumed, w.0,
            "{layout:?}: the resumed run's losses, bit for bit"
        );
        assert_eq!(b.1, w.1, "{layout:?}: the held-out loss after training");
        // The recorder's count was restored: the resumed run files its losses under the
        // uninterrupted run's counts.
        let (rw, rb) = (recorded(&whole), recorded(&second));
        assert_eq!(
            rw.iter().map(|r| r.0).collect::<Vec<_>>(),
            (0..w.0.len() as u64).collect::<Vec<_>>()
        );
        assert_eq!(
            rb,
            rw[a.0.len()..],
            "{layout:?}: recorder count and values after resume"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// An item that remembers where it was moved.
struct Placed(Option<String>);

impl pipewright::experiment::Stateful for Placed {
    fn state_dict(&self) -> pipewright::Result<serde_json::Value> {
        Ok(serde_json::Value::Null)
    }

    fn load_state_dict(&mut self, _: &serde_json::Value) -> pipewright::Result<()> {
        Ok(())
    }

    fn to_device(&mut self, device: &Device) -> pipewright::Result<()> {
        self.0 = Some(format!("{device:?}"));
        Ok(())
    }
}

#[test]
fn the_context_moves_what_is_registered_and_answers_for_its_rank() {
    let dir = tmp("context");
    let params = experiment().parse(args(&[])).unwrap();
    let comm = Box::new(pipewright::distributed::comm::local::LocalComm::single());
    let mut cx = pipewright::experiment::Context::new(params, &dir, comm).unwrap();
    cx.register("placed", Placed(None)).unwrap();
    cx.cpu().unwrap();
    assert_eq!(
        cx.get::<Placed>("placed").unwrap().0.as_deref(),
        Some("Cpu")
    );
    assert!(
        cx.get::<pipewright::experiment::Counter>("placed").is_err(),
        "another type"
    );
    assert!(cx.is_master() && !cx.is_distributed());
    assert_eq!((cx.get_rank(), cx.get_num_processes()), (0, 1));
    // This build has no CUDA: cuda() is an error, and nothing moved.
    assert!(cx.cuda().is_err());
    assert_eq!(
        cx.get::<Placed>("placed").unwrap().0.as_deref(),
        Some("Cpu")
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn debug_names_where_the_first_nan_or_inf_appears() {
    let dir = tmp("debug");
    let out = dir.to_str().unwrap();
    let e = experiment();
    // A learning rate that diverges at once: with --debug the step names the parameters and
    // the micro-batch whose gradients went bad; without, the generic overflow error.
    let run = |debug: &str| {
        let p = e
            .parse(args(&[
                "--output-dir",
                out,
                "--lr",
                "1e30",
                "--debug",
                debug,
            ]))
            .unwrap();
        e.run(&p).unwrap_err().to_string()
    };
    let with = run("true");
    assert!(
        with.contains("anomaly: the backward of micro-batch 0 of step 2"),
        "{with}"
    );
    assert!(with.contains("hidden.weight"), "{with}");
    // The rank's log says so too.
    let runs: Vec<PathBuf> = std::fs::read_dir(dir.join("points"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    let log = std::fs::read_to_string(runs[0].join("rank-0.log")).unwrap();
    assert!(
        log.contains("rank 0 of 1 starts") && log.contains("fails: "),
        "{log}"
    );
    let without = run("false");
    assert!(
        !without.contains("anomaly") && without.contains("inf or NaN"),
        "{without}"
    );

    // A forward that makes a NaN is named by its layer.
    use pipewright::model::{Activation, Cx, Mode};
    let stage = example::model().build(&pipewright::Build::cpu(0)).unwrap();
    // Four steps taken: the message names the fifth (steps count from 1 where users read).
    let mut cx = Cx::new(Mode::Train, 0, 4, 2);
    cx.detect_anomaly = true;
    let x = candle_core::Tensor::new(&[[1f32, f32::NAN]], &Device::Cpu).unwrap();
    let err = stage
        .forward(Activation::from(x.clone()), &mut cx)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("layer `hidden` produced NaN or inf values in micro-batch 2 of step 5"),
        "{err}"
    );
    cx.detect_anomaly = false;
    assert!(
        stage.forward(Activation::from(x), &mut cx).is_ok(),
        "off: no check"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
