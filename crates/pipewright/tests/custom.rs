//! Bring-your-own-model checks on the example's model (`examples/custom_model.rs`, included
//! here so that the test runs exactly what the example documents): pp=2 x dp=2 against serial
//! training, a tuple of f32 and u8 crossing a cut forward and backward, an explicit device, and
//! clear errors for what a user can get wrong.

#[allow(dead_code)]
#[path = "../examples/custom_model.rs"]
mod custom_model;

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Tensor, Var};
use custom_model::{
    batch, model, restart_and_morph, serial_trainer, spec, train_parallel, train_serial,
    CHUNK_SIZE, GLOBAL_BATCH,
};
use pipewright::distributed::comm::local;
use pipewright::distributed::topology::Layout;
use pipewright::engine::spec::{Balance, TrainSpec};
use pipewright::engine::varuna::{Varuna, VarunaOptions};
use pipewright::model::nn::optim::{LrSchedule, Optimizer, Sgd, SgdConfig};
use pipewright::model::nn::{max_rel_diff, Grads};
use pipewright::model::{Activation, Cx, Layer, LayerSpec, Sequential};
use pipewright::parallel::loss::Mse;
use pipewright::trainer::{Run, Trainer};
use pipewright::{Batch, Result};

fn sgd(params: Vec<(String, Var)>) -> Result<Box<dyn Optimizer>> {
    Ok(Box::new(Sgd::new(params, SgdConfig::default())?))
}

fn options(layout: Layout) -> VarunaOptions {
    VarunaOptions {
        loss: Arc::new(Mse::new("y")),
        device: Device::Cpu,
        ..VarunaOptions::of(TrainSpec {
            optim: pipewright::model::nn::optim::OptimSpec {
                lr: LrSchedule::Constant { lr: 0.1 },
                ..Default::default()
            },
            ..TrainSpec::new(layout, GLOBAL_BATCH, CHUNK_SIZE, 1)
        })
    }
}

#[test]
fn the_example_trains_pp2_dp2_to_the_serial_losses() {
    let serial = train_serial(8).unwrap();
    let parallel = train_parallel(Layout::new(2, 1, 2).unwrap(), 8).unwrap();
    for (s, (a, b)) in serial.iter().zip(&parallel).enumerate() {
        assert!(
            ((a - b) / a).abs() < 1e-5,
            "step {s}: {serial:?} vs {parallel:?}"
        );
    }
    // The run learned something the oracle also learned: the loss moved.
    assert_ne!(serial[0], serial[7]);
}

/// The library alone, through its front door: a user's model trained on pp 2 x dp 2 with a
/// checkpoint half way, then restarted in a world of 2 ranks, where the planner (from the
/// model's own shapes) morphs it and the run goes on from the checkpoint; every step's loss is
/// serial training's.
#[test]
fn the_front_door_trains_a_user_model_restarts_it_and_morphs_it_by_the_planner() {
    let dir = std::env::temp_dir().join(format!("pw-front-door-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let planned = spec(Layout::new(2, 1, 2).unwrap(), 8);
    let (losses, m) = restart_and_morph(&planned, &dir).unwrap();
    assert_eq!(m.layout.world(), 2, "{m:?}");
    assert!(m.step_s.is_some(), "planned, not the nearest layout: {m:?}");
    let serial = train_serial(8).unwrap();
    assert_eq!(
        losses.len(),
        8,
        "4 steps, then 4 more after the restart: {losses:?}"
    );
    for (s, (a, b)) in serial.iter().zip(&losses).enumerate() {
        assert!(
            ((a - b) / a).abs() < 1e-5,
            "step {s}: {serial:?} vs {losses:?}"
        );
    }
    // The front door kept the run's record: every step once (the restarted attempt dropped
    // nothing and repeated nothing), with the loss the hooks saw.
    let csv = std::fs::read_to_string(dir.join("scalars.csv")).unwrap();
    let rows: Vec<(u64, f64)> = csv
        .lines()
        .skip(1)
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            (f[0].parse().unwrap(), f[1].parse().unwrap())
        })
        .collect();
    let want: Vec<(u64, f64)> = (1..).zip(losses.iter().copied()).collect();
    assert_eq!(rows, want, "{csv}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A run whose hooks give the batches has no data of its own: what needs it (a profiled
/// balance, the simplest hooks) says so and how to give it, before any rank trains.
#[test]
fn a_run_without_data_says_what_needs_it() {
    let mut spec = spec(Layout::new(2, 1, 1).unwrap(), 2);
    let without = |spec: TrainSpec| Run {
        data: None,
        ..custom_model::run(spec)
    };
    spec.pipeline.balance = Some(Balance::Time);
    let e = Trainer::new(without(spec.clone()), None).err().unwrap();
    assert!(
        e.to_string()
            .contains("a balance by time or size needs the run's data"),
        "{e}"
    );
    spec.pipeline.balance = None;
    let dir = std::env::temp_dir().join(format!("pw-no-data-{}", std::process::id()));
    let e = Trainer::new(without(spec), None)
        .unwrap()
        .losses(&dir, None)
        .unwrap_err();
    assert!(
        e.to_string().contains("Losses reads only the run's data"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The front door returns the spec it runs: a balance by size resolved into the layers per
/// stage the spec's own resolution gives on the run's first micro-batch.
#[test]
fn the_trainer_gives_the_spec_it_runs() {
    let mut spec = spec(Layout::new(2, 1, 1).unwrap(), 2);
    spec.pipeline.balance = Some(Balance::Size);
    let trainer = Trainer::new(custom_model::run(spec.clone()), None).unwrap();
    let sample = batch(0, spec.batch.micro_batch).unwrap();
    let resolved = spec.resolve_balance(&model(), &sample).unwrap();
    let Some(Balance::Layers(layers)) = &trainer.spec().pipeline.balance else {
        panic!("not resolved: {:?}", trainer.spec().pipeline.balance);
    };
    assert_eq!(layers.len(), 2);
    assert_eq!(layers.iter().sum::<usize>(), model().len());
    assert_eq!(trainer.spec(), &resolved);
}

/// Serial: the first batch's loss, gradients and evaluation output, and the parameters after
/// two SGD steps.
fn serial_reference() -> (f64, Grads, Tensor, Vec<(String, Tensor)>) {
    let mut t = serial_trainer(sgd, 0.1).unwrap();
    let b0 = batch(0, GLOBAL_BATCH).unwrap();
    let (loss, grads, _) = t.loss_and_grads(&b0).unwrap();
    let out = t.predict(&b0).unwrap();
    t.step(&b0).unwrap();
    t.step(&batch(1, GLOBAL_BATCH).unwrap()).unwrap();
    let params = t
        .model()
        .params()
        .into_iter()
        .map(|(n, v)| (n, v.as_tensor().copy().unwrap()))
        .collect();
    (loss, grads, out, params)
}

#[test]
fn a_tuple_of_f32_and_u8_crosses_the_cut_forward_and_backward_exactly() {
    let (loss, grads, out, params) = serial_reference();
    let runs = local::run(2, |comm| {
        let mut v = Varuna::new(&model(), Box::new(comm), options(Layout::new(2, 1, 1)?))?;
        v.set_optimizer(sgd)?;
        let first: Arc<Mutex<Option<Grads>>> = Arc::default();
        let keep = first.clone();
        v.set_grad_hook(move |g| {
            keep.lock().unwrap().get_or_insert_with(|| g.clone());
        });
        let b0 = batch(0, GLOBAL_BATCH)?;
        let got_out = v.predict(&b0)?;
        let got_loss = v.step(&b0)?.loss;
        v.step(&batch(1, GLOBAL_BATCH)?)?;
        // Every parameter lives on the device the options named.
        assert!(v
            .pipeline()
            .params()
            .iter()
            .all(|(_, p)| p.device().is_cpu()));
        let ps: Vec<(String, Tensor)> = v
            .pipeline()
            .params()
            .iter()
            .map(|(n, p)| (n.clone(), p.as_tensor().copy().unwrap()))
            .collect();
        let g = first.lock().unwrap().clone().unwrap();
        Ok((got_loss, got_out, g, ps))
    })
    .unwrap();
    for (rank, (l, o, g, ps)) in runs.iter().enumerate() {
        assert!(
            ((l - loss) / loss).abs() < 1e-6,
            "rank {rank}: loss {l} vs {loss}"
        );
        assert!(max_rel_diff(o, &out).unwrap() < 1e-6, "rank {rank}: output");
        assert!(!g.is_empty());
        for (n, t) in g.iter() {
            let e = max_rel_diff(t, grads.get(n).unwrap()).unwrap();
            assert!(e < 1e-6, "rank {rank}: gradient of `{n}` differs by {e:e}");
        }
        for (n, p) in ps {
            let w = &params.iter().find(|(m, _)| m == n).unwrap().1;
            let e = max_rel_diff(p, w).unwrap();
            assert!(
                e < 1e-6,
                "rank {rank}: `{n}` after 2 steps differs by {e:e}"
            );
        }
    }
    // Stage 0 holds the encoder, stage 1 the head: the gradient of the encoder came back
    // through the f32 half of the tuple.
    assert!(runs[0].2.get("encoder.weight").is_some());
    assert!(runs[1].2.get("head.weight").is_some());
}

/// The error every rank of a pp=2 run of `m` reports for `b`.
fn step_error(m: &Sequential, b: Batch) -> String {
    local::run(2, |comm| {
        let mut v = Varuna::new(m, Box::new(comm), options(Layout::new(2, 1, 1)?))?;
        v.set_optimizer(sgd)?;
        v.step(&b).map(|_| ())
    })
    .unwrap_err()
    .to_string()
}

fn without(name: &str) -> Batch {
    let full = batch(0, GLOBAL_BATCH).unwrap();
    let mut b = Batch::new();
    for (n, t) in full.iter().filter(|(n, _)| *n != name) {
        b.insert(n, t.clone());
    }
    b
}

#[test]
fn what_a_user_gets_wrong_is_a_clear_error() {
    let e = step_error(&model(), without("y"));
    assert!(
        e.contains("the loss asks for the batch tensor `y` but the batch holds only [\"features\", \"mask\"]"),
        "{e}"
    );
    let e = step_error(&model(), without("mask"));
    assert!(
        e.contains("the model's first stage asks for the batch tensor `mask`"),
        "{e}"
    );
    // A stage whose output is a tuple for one micro-batch and a tensor for the next.
    struct Fickle;
    impl Layer for Fickle {
        fn name(&self) -> &str {
            "fickle"
        }
        fn forward(&self, x: Activation, cx: &mut Cx) -> Result<Activation> {
            let t = x.into_tensors().remove(0);
            Ok(if cx.micro_batch == 0 {
                Activation::Tuple(vec![t.clone(), t])
            } else {
                t.into()
            })
        }
        fn params(&self) -> Vec<(String, Var)> {
            Vec::new()
        }
    }
    struct First;
    impl Layer for First {
        fn name(&self) -> &str {
            "first"
        }
        fn forward(&self, x: Activation, _cx: &mut Cx) -> Result<Activation> {
            // The target's shape: the next stage's only error is the first stage's.
            Ok(x.into_tensors().remove(0).narrow(1, 0, 1)?.into())
        }
        fn params(&self) -> Vec<(String, Var)> {
            Vec::new()
        }
    }
    let mut m = Sequential::new();
    m.inputs(&["features"]);
    m.push(LayerSpec::new("fickle", |_| {
        Ok(Box::new(Fickle) as Box<dyn Layer>)
    }))
    .cut();
    m.push(LayerSpec::new("first", |_| {
        Ok(Box::new(First) as Box<dyn Layer>)
    }));
    let b = batch(0, GLOBAL_BATCH).unwrap();
    let e = step_error(&m, b.clone());
    assert!(
        e.contains(
            "model stage 0 passes one tensor for micro-batch 1 but a tuple of 2 tensors for \
             micro-batch 0: what crosses a cut point must keep its arity"
        ),
        "{e}"
    );
    // Rows that disagree between batch tensors.
    let short = b.clone().with(
        "y",
        Tensor::zeros((3, 1), DType::F32, &Device::Cpu).unwrap(),
    );
    let e = step_error(&model(), short);
    assert!(
        e.contains("batch tensor `y` has 3 rows but `features` has 16"),
        "{e}"
    );
    // Devices by name.
    let e = pipewright::runtime::device::device("tpu", 0)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("unknown device `tpu`: use cpu, cuda or cuda:N"),
        "{e}"
    );
    if !candle_core::utils::cuda_is_available() {
        let e = pipewright::runtime::device::device("cuda", 1)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("this build of pipewright has no CUDA support"),
            "{e}"
        );
    }
}

/// `VarunaOptions::batch_fn` (Varuna's `get_batch_fn`): given the run's batch function, the
/// wrapper runs step 0's first micro-batch through the model when it is made, so a batch the
/// model cannot take is an error before any step; a right one makes the wrapper as before.
#[test]
fn a_sample_batch_is_checked_when_the_wrapper_is_made() {
    let make = |data: pipewright::trainer::Data| {
        local::run(1, move |comm| {
            let opts = VarunaOptions {
                batch_fn: Some(data.clone()),
                ..options(Layout::new(1, 1, 1)?)
            };
            Varuna::new(&model(), Box::new(comm), opts).map(|_| ())
        })
    };
    make(Arc::new(batch)).unwrap();
    let e = make(Arc::new(|_, _| Ok(without("mask"))))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!(
            "a sample batch of {CHUNK_SIZE} rows does not run through the model"
        )),
        "{e}"
    );
}
