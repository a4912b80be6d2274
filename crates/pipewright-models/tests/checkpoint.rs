//! Checkpoints that outlive layouts: 20 steps with a checkpoint at step 10 and a fresh job
//! resuming from it give the uninterrupted run's losses, parameters and optimizer state bit
//! for bit at the same layout (dropout on, f16's loss scaler too), and within 1e-5 at another
//! layout; damaged, foreign and unwritable checkpoints are clear errors.

use std::path::{Path, PathBuf};

use pipewright::distributed::comm::local;
use pipewright::distributed::topology::Layout;
use pipewright::engine::checkpoint::{self, CheckpointOptions};
use pipewright::engine::varuna::Varuna;
use pipewright::model::precision::Precision;
use pipewright::Batch;
use pipewright_models::parity::ParityRun;
use pipewright_models::tasks::Adder;
use pipewright_models::{gpt, GptConfig, Task};

mod resume;
use resume::*;

#[test]
fn resuming_at_the_same_layout_is_bit_identical() {
    for (i, (l, precision)) in [
        ((1, 1, 1), Precision::F32),
        ((2, 2, 1), Precision::F32),
        ((2, 1, 2), Precision::F32),
        ((2, 2, 2), Precision::F32),
        ((2, 1, 1), Precision::F16),
    ]
    .into_iter()
    .enumerate()
    {
        let opts = options(Layout::new(l.0, l.1, l.2).unwrap(), precision);
        let root = tmp(&format!("same-{i}"));
        let whole = run(cfg(0.1), opts.clone(), 0, STEPS, None, Some(&root));
        let resumed = run(cfg(0.1), opts, SAVE_AT, STEPS, Some(&root), None);
        assert_eq!(
            resumed.losses,
            whole.losses[SAVE_AT as usize..],
            "{l:?} {precision}: losses of steps 11-20"
        );
        assert_eq!(resumed.state, whole.state, "{l:?} {precision}: final state");
        assert_eq!(resumed.scale, whole.scale, "{l:?} {precision}: loss scale");
        let _ = std::fs::remove_dir_all(root);
    }
}

fn within(what: &str, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (a, b) in got.iter().zip(want) {
        assert!(((a - b) / b).abs() < 1e-5, "{what}: {got:?} vs {want:?}");
    }
}

#[test]
fn resuming_at_another_layout_continues_the_run() {
    let f32 = Precision::F32;
    let layout = |p, t, d| Layout::new(p, t, d).unwrap();
    let root = tmp("other");
    let whole = run(
        cfg(0.0),
        options(layout(2, 2, 1), f32),
        0,
        STEPS,
        None,
        Some(&root),
    );
    let tail = &whole.losses[SAVE_AT as usize..];
    for (p, t, d) in [(1, 1, 1), (4, 1, 1), (1, 2, 2), (1, 1, 4)] {
        let got = run(
            cfg(0.0),
            options(layout(p, t, d), f32),
            SAVE_AT,
            STEPS,
            Some(&root),
            None,
        );
        within(&format!("(2,2,1) -> ({p},{t},{d})"), &got.losses, tail);
    }
    let root2 = tmp("other2");
    let whole = run(
        cfg(0.0),
        options(layout(1, 1, 1), f32),
        0,
        STEPS,
        None,
        Some(&root2),
    );
    let got = run(
        cfg(0.0),
        options(layout(2, 2, 2), f32),
        SAVE_AT,
        STEPS,
        Some(&root2),
        None,
    );
    within(
        "(1,1,1) -> (2,2,2)",
        &got.losses,
        &whole.losses[SAVE_AT as usize..],
    );
    for r in [root, root2] {
        let _ = std::fs::remove_dir_all(r);
    }
}

/// One saved checkpoint of the tiny GPT at (2,1,1); its directory.
fn saved(name: &str) -> PathBuf {
    let root = tmp(name);
    run(
        cfg(0.0),
        options(Layout::new(2, 1, 1).unwrap(), Precision::F32),
        0,
        SAVE_AT,
        None,
        Some(&root),
    );
    root
}

fn load_error(c: GptConfig, path: &Path) -> String {
    local::run(2, |comm| {
        let opts = options(Layout::new(2, 1, 1)?, Precision::F32);
        let mut v = Varuna::new(&gpt(c)?, Box::new(comm), opts)?;
        v.set_optimizer(adamw)?;
        v.load_checkpoint(path).map(|_| ())
    })
    .unwrap_err()
    .to_string()
}

#[test]
fn a_flipped_byte_is_found_by_verify_and_by_load() {
    let root = saved("flip");
    let dir = checkpoint::resolve(&root).unwrap();
    assert!(checkpoint::verify(&root).is_ok());
    let m = checkpoint::Manifest::read(&dir).unwrap();
    let (name, e) = m
        .tensors
        .iter()
        .find(|(n, _)| n.as_str() == "h.1.mlp.c_fc.weight")
        .unwrap();
    let part = &e.parts[0];
    let file = dir.join(&part.file);
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[(part.begin + 5) as usize] ^= 0x10;
    std::fs::write(&file, &bytes).unwrap();
    let e = checkpoint::verify(&root).unwrap_err().to_string();
    assert!(e.contains(&part.file) && e.contains(name), "{e}");
    let e = load_error(cfg(0.0), &root);
    assert!(e.contains(&part.file) && e.contains(name), "{e}");
    // state.json too.
    let state = dir.join("state.json");
    let mut s = std::fs::read(&state).unwrap();
    s[3] ^= 0x01;
    std::fs::write(&state, s).unwrap();
    let e = checkpoint::verify(&root).unwrap_err().to_string();
    assert!(e.contains("state.json") && e.contains("checksum"), "{e}");
    let _ = std::fs::remove_dir_all(root);
}

#[test]
fn a_checkpoint_of_another_model_names_the_tensors() {
    let root = saved("foreign");
    let bigger = GptConfig {
        n_layer: 4,
        n_embd: 24,
        ..cfg(0.0)
    };
    let e = load_error(bigger, &root);
    assert!(e.contains("checkpoint of another model"), "{e}");
    assert!(
        e.contains("`h.3.ln_1.weight` [24] is in the model but not in the checkpoint"),
        "{e}"
    );
    assert!(
        e.contains("`wte.weight` is [16, 16] in the checkpoint but [16, 24] in the model"),
        "{e}"
    );
    let fewer = GptConfig {
        n_layer: 2,
        ..cfg(0.0)
    };
    let e = load_error(fewer, &root);
    assert!(
        e.contains("`h.2.attn.c_attn.weight` [16, 48] is in the checkpoint but not in the model"),
        "{e}"
    );
    let e = load_error(cfg(0.0), &root.join("nothing-here"));
    assert!(e.contains("no checkpoint at"), "{e}");
    let _ = std::fs::remove_dir_all(root);
}

#[test]
fn an_unwritable_place_is_an_error_that_keeps_earlier_checkpoints() {
    let root = saved("unwritable");
    let before = checkpoint::resolve(&root).unwrap();
    // A file where the next checkpoint's temporary directory must go.
    std::fs::write(root.join(".step-00000020.tmp"), b"in the way").unwrap();
    let opts = options(Layout::new(2, 1, 1).unwrap(), Precision::F32);
    let e = local::run(2, |comm| {
        let mut v = Varuna::new(&gpt(cfg(0.0))?, Box::new(comm), opts.clone())?;
        v.set_optimizer(adamw)?;
        v.load_checkpoint(&root)?;
        let task = Adder::new(2, 0)?;
        for s in SAVE_AT..20 {
            let (x, y) = task.batch(s, 16)?;
            v.step(&Batch::pair(x, y))?;
        }
        v.checkpoint(&root, &CheckpointOptions::default())
            .map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains(".step-00000020.tmp"), "{e}");
    assert_eq!(
        checkpoint::resolve(&root).unwrap(),
        before,
        "latest is unchanged"
    );
    assert!(checkpoint::verify(&root).is_ok());
    // Under a regular file nothing can be created at all.
    let under_file = root.join("latest").join("sub");
    let e = local::run(1, |comm| {
        let opts = options(Layout::new(1, 1, 1)?, Precision::F32);
        let mut v = Varuna::new(&gpt(cfg(0.0))?, Box::new(comm), opts)?;
        v.set_optimizer(adamw)?;
        v.checkpoint(&under_file, &CheckpointOptions::default())
            .map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("cannot create checkpoint directory"), "{e}");
    let _ = std::fs::remove_dir_all(root);
}

#[test]
fn keep_removes_the_oldest_and_async_saves_equal_sync_ones() {
    let (sync_root, async_root) = (tmp("keep-sync"), tmp("keep-async"));
    let opts = options(Layout::new(2, 1, 1).unwrap(), Precision::F32);
    let task = Adder::new(2, 0).unwrap();
    let losses = |root: &Path, background: bool| {
        local::run(2, |comm| {
            let mut v = Varuna::new(&gpt(cfg(0.1))?, Box::new(comm), opts.clone())?;
            v.set_optimizer(adamw)?;
            let keep = CheckpointOptions {
                keep: Some(2),
                ..Default::default()
            };
            let mut out = Vec::new();
            for s in 0..8 {
                let (x, y) = task.batch(s, 16)?;
                out.push(v.step(&Batch::pair(x, y))?.loss);
                if background {
                    v.checkpoint_async(root, &keep)?;
                } else {
                    v.checkpoint(root, &keep)?;
                }
            }
            v.finish_checkpoint()?;
            Ok(out)
        })
        .unwrap()
        .remove(0)
    };
    assert_eq!(losses(&sync_root, false), losses(&async_root, true));
    for root in [&sync_root, &async_root] {
        let mut steps = checkpoint::list(root).unwrap();
        steps.sort();
        assert_eq!(steps, vec![7, 8], "{}", root.display());
        assert!(checkpoint::resolve(root)
            .unwrap()
            .ends_with("step-00000008"));
    }
    // Both hold the same bytes.
    let a = checkpoint::Manifest::read(&checkpoint::resolve(&sync_root).unwrap()).unwrap();
    let b = checkpoint::Manifest::read(&checkpoint::resolve(&async_root).unwrap()).unwrap();
    assert_eq!(a.files, b.files);
    for r in [sync_root, async_root] {
        let _ = std::fs::remove_dir_all(r);
    }
}

#[test]
fn the_serial_trainer_and_varuna_share_one_format_across_precisions() {
    use pipewright::engine::serial::{SerialTrainer, TrainOptions};
    use pipewright::model::nn::optim::LrSchedule;
    use pipewright::model::nn::optim::OptimSpec;
    use pipewright::parallel::loss::CrossEntropy;
    use pipewright::trainer::TrainSpec;
    use pipewright::Build;
    let task = Adder::new(2, 0).unwrap();
    let batch = |s: u64| {
        let (x, y) = task.batch(s, 16).unwrap();
        Batch::pair(x, y)
    };
    let trainer = || {
        let run = ParityRun::default();
        let stage = gpt(cfg(0.0)).unwrap().build(&Build::cpu(run.seed)).unwrap();
        let opt = adamw(stage.params()).unwrap();
        SerialTrainer::new(
            stage,
            opt,
            TrainOptions {
                spec: TrainSpec {
                    seed: run.seed,
                    optim: OptimSpec {
                        clip: Some(run.clip),
                        lr: LrSchedule::Constant { lr: run.lr },
                        ..Default::default()
                    },
                    ..TrainSpec::serial()
                },
                micro_batches: 8,
                tied: vec![("wte.weight".into(), "lm_head.weight".into())],
                loss: std::sync::Arc::new(CrossEntropy::default()),
            },
        )
        .unwrap()
    };
    // Serial saves at step 10; the f32 Varuna at (2,2,1) and a bf16 one at (2,1,1) resume.
    let root = tmp("serial");
    let mut t = trainer();
    for s in 0..SAVE_AT {
        t.step(&batch(s)).unwrap();
    }
    t.checkpoint(&root, &CheckpointOptions::default()).unwrap();
    let serial_tail: Vec<f64> = (SAVE_AT..STEPS)
        .map(|s| t.step(&batch(s)).unwrap().loss)
        .collect();
    let f32_opts = options(Layout::new(2, 2, 1).unwrap(), Precision::F32);
    let got = run(cfg(0.0), f32_opts, SAVE_AT, STEPS, Some(&root), None);
    within("serial -> (2,2,1)", &got.losses, &serial_tail);
    let bf16_opts = options(Layout::new(2, 1, 1).unwrap(), Precision::Bf16);
    let got = run(cfg(0.0), bf16_opts, SAVE_AT, STEPS, Some(&root), None);
    for (a, b) in got.losses.iter().zip(&serial_tail) {
        assert!(
            ((a - b) / b).abs() < 2e-2,
            "serial f32 -> bf16: {:?} vs {serial_tail:?}",
            got.losses
        );
    }
    // And back: Varuna at (2,2,1) saves, the serial trainer resumes.
    let root2 = tmp("to-serial");
    let whole = run(
        cfg(0.0),
        options(Layout::new(2, 2, 1).unwrap(), Precision::F32),
        0,
        STEPS,
        None,
        Some(&root2),
    );
    let mut t = trainer();
    assert_eq!(t.load_checkpoint(&root2).unwrap(), SAVE_AT);
    let tail: Vec<f64> = (SAVE_AT..STEPS)
        .map(|s| t.step(&batch(s)).unwrap().loss)
        .collect();
    within(
        "(2,2,1) -> serial",
        &tail,
        &whole.losses[SAVE_AT as usize..],
    );
    for r in [root, root2] {
        let _ = std::fs::remove_dir_all(r);
    }
}
