//! Serial training behaviour: split builds start from the same weights, tied weights stay
//! equal, the same seed gives bit-identical losses, accumulation over micro-batches is the
//! same mathematics, BatchNorm statistics move.

use candle_core::{DType, Tensor};
use pipewright::engine::serial::{SerialTrainer, TrainOptions};
use pipewright::model::nn::max_rel_diff;
use pipewright::model::nn::optim::OptimSpec;
use pipewright::model::nn::optim::{AdamW, AdamWConfig, LrSchedule};
use pipewright::trainer::TrainSpec;
use pipewright::{Batch, Build};
use pipewright_models::tasks::{Adder, Shapes};
use pipewright_models::{cnn, gpt, CnnConfig, GptConfig, Task, TIED};

fn cfg(dropout: f64) -> GptConfig {
    GptConfig {
        vocab_size: 10,
        block_size: 6,
        n_layer: 3,
        n_head: 2,
        n_embd: 16,
        dropout,
    }
}

fn trainer(c: GptConfig, seed: u64, chunks: usize) -> SerialTrainer {
    let stage = gpt(c).unwrap().build(&Build::cpu(seed)).unwrap();
    let opt = Box::new(AdamW::new(stage.params(), AdamWConfig::default()).unwrap());
    SerialTrainer::new(
        stage,
        opt,
        TrainOptions {
            spec: TrainSpec {
                seed,
                optim: OptimSpec {
                    clip: Some(1.0),
                    lr: LrSchedule::Constant { lr: 3e-3 },
                    ..Default::default()
                },
                ..TrainSpec::serial()
            },
            micro_batches: chunks,
            tied: vec![(TIED.0.into(), TIED.1.into())],
            loss: std::sync::Arc::new(pipewright::parallel::loss::CrossEntropy::default()),
        },
    )
    .unwrap()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

#[test]
fn any_layer_range_builds_the_weights_of_the_whole_model() {
    let model = gpt(cfg(0.0)).unwrap();
    assert_eq!(model.len(), 6);
    assert_eq!(model.cut_points(), &[1, 2, 3, 4]);
    let whole = model.build(&Build::cpu(5)).unwrap();
    let part = model.build_range(2..5, &Build::cpu(5)).unwrap();
    let names: Vec<String> = part.params().into_iter().map(|(n, _)| n).collect();
    assert!(names
        .iter()
        .all(|n| n.starts_with("h.1.") || n.starts_with("h.2.") || n.starts_with("ln_f.")));
    for (n, v) in part.params() {
        assert_eq!(
            bits(v.as_tensor()),
            bits(whole.param(&n).unwrap().as_tensor()),
            "`{n}`"
        );
    }
    assert!(model.build_range(3..3, &Build::cpu(5)).is_err());
    assert!(model.build_range(4..9, &Build::cpu(5)).is_err());
}

#[test]
fn tied_weights_start_and_stay_equal() {
    let task = Adder::new(1, 0).unwrap();
    let mut t = trainer(cfg(0.0), 1, 1);
    let m = t.model();
    assert_eq!(
        bits(m.param(TIED.0).unwrap().as_tensor()),
        bits(m.param(TIED.1).unwrap().as_tensor())
    );
    let before = bits(t.model().param(TIED.0).unwrap().as_tensor());
    for step in 0..5 {
        let (x, y) = task.batch(step, 16).unwrap();
        t.step(&Batch::pair(x.clone(), y.clone())).unwrap();
    }
    let m = t.model();
    let a = bits(m.param(TIED.0).unwrap().as_tensor());
    assert_eq!(
        a,
        bits(m.param(TIED.1).unwrap().as_tensor()),
        "tied pair drifted apart"
    );
    assert_ne!(a, before, "the tied weight did not train");
}

#[test]
fn same_seed_gives_bit_identical_losses() {
    let task = Adder::new(2, 3).unwrap();
    let run = |seed: u64| -> Vec<u64> {
        let mut t = trainer(cfg(0.1), seed, 2);
        (0..4)
            .map(|s| {
                let (x, y) = task.batch(s, 8).unwrap();
                t.step(&Batch::pair(x.clone(), y.clone()))
                    .unwrap()
                    .loss
                    .to_bits()
            })
            .collect()
    };
    assert_eq!(run(11), run(11));
    assert_ne!(run(11), run(12));
}

#[test]
fn accumulation_over_chunks_is_one_batch() {
    // Gradients: equal for every parameter (13 rows: chunks of 4, 4, 4, 1).
    let task = Adder::new(2, 3).unwrap();
    let (x, y) = task.batch(0, 13).unwrap();
    let (l1, g1, _) = trainer(cfg(0.0), 4, 1)
        .loss_and_grads(&Batch::pair(x.clone(), y.clone()))
        .unwrap();
    let (l4, g4, _) = trainer(cfg(0.0), 4, 4)
        .loss_and_grads(&Batch::pair(x.clone(), y.clone()))
        .unwrap();
    assert!(((l1 - l4) / l1).abs() < 1e-6, "loss {l1} vs {l4}");
    assert_eq!(g1.len(), g4.len());
    for (n, g) in g1.iter() {
        let e = rel_diff(g4.get(n).unwrap(), g);
        assert!(e < 1e-5, "gradient of `{n}` differs by {e:e}");
    }
    // Parameters after 3 steps of SGD with momentum, which is linear in the gradient. (AdamW
    // would amplify float noise in gradients that are zero in exact arithmetic, such as the
    // key bias of attention, to full-size steps.)
    let sgd = |chunks: usize| {
        let stage = gpt(cfg(0.0)).unwrap().build(&Build::cpu(4)).unwrap();
        let opt = pipewright::model::nn::optim::Sgd::new(
            stage.params(),
            pipewright::model::nn::optim::SgdConfig {
                momentum: 0.9,
                ..Default::default()
            },
        )
        .unwrap();
        let mut t = SerialTrainer::new(
            stage,
            Box::new(opt),
            TrainOptions {
                spec: TrainSpec {
                    seed: 4,
                    optim: OptimSpec {
                        lr: LrSchedule::Constant { lr: 0.1 },
                        ..Default::default()
                    },
                    ..TrainSpec::serial()
                },
                micro_batches: chunks,
                tied: vec![(TIED.0.into(), TIED.1.into())],
                loss: std::sync::Arc::new(pipewright::parallel::loss::CrossEntropy::default()),
            },
        )
        .unwrap();
        for s in 0..3 {
            let (x, y) = task.batch(s, 13).unwrap();
            t.step(&Batch::pair(x.clone(), y.clone())).unwrap();
        }
        t
    };
    let (one, four) = (sgd(1), sgd(4));
    for (n, v) in one.model().params() {
        let e = rel_diff(four.model().param(&n).unwrap().as_tensor(), v.as_tensor());
        assert!(e < 1e-5, "`{n}` differs by {e:e} after 3 steps");
    }
}

#[test]
fn cnn_trains_and_moves_batch_norm_statistics() {
    let task = Shapes::new(12, 0).unwrap();
    let c = CnnConfig {
        in_channels: 1,
        classes: 4,
        width: 4,
        blocks: 2,
        blocks_per_stage: 1,
        long_skip: false,
    };
    let model = cnn(c).unwrap();
    let stage = model.build(&Build::cpu(0)).unwrap();
    assert!(stage
        .buffers()
        .iter()
        .any(|(n, _)| n == "blocks.1.shortcut.bn.running_mean"));
    let rm = stage.buffers()[0].1.as_tensor().copy().unwrap();
    let opt = Box::new(AdamW::new(stage.params(), AdamWConfig::default()).unwrap());
    let mut t = SerialTrainer::new(
        stage,
        opt,
        TrainOptions {
            spec: TrainSpec {
                optim: OptimSpec {
                    lr: LrSchedule::Constant { lr: 1e-2 },
                    ..Default::default()
                },
                ..TrainSpec::serial()
            },
            micro_batches: 1,
            tied: vec![],
            loss: std::sync::Arc::new(pipewright::parallel::loss::CrossEntropy::default()),
        },
    )
    .unwrap();
    let (x, y) = task.batch(0, 16).unwrap();
    let first = t.step(&Batch::pair(x.clone(), y.clone())).unwrap().loss;
    let mut last = first;
    for s in 0..15 {
        last = t.step(&Batch::pair(x.clone(), y.clone())).unwrap().loss;
        assert!(last.is_finite(), "step {s}");
    }
    assert!(
        last < first * 0.5,
        "loss on a fixed batch fell only from {first} to {last}"
    );
    let moved = (t.model().buffers()[0].1.as_tensor() - rm)
        .unwrap()
        .abs()
        .unwrap()
        .sum_all()
        .unwrap();
    assert!(moved.to_scalar::<f32>().unwrap() > 0.0);
    assert_eq!(
        t.predict(&Batch::input(x.clone())).unwrap().dims(),
        &[16, 4]
    );
}

#[test]
fn bad_configurations_are_errors() {
    let mut c = cfg(0.0);
    c.n_head = 3;
    let e = gpt(c).unwrap_err().to_string();
    assert!(e.contains("not divisible by n_head"), "{e}");
    c = cfg(0.0);
    c.n_layer = 0;
    assert!(gpt(c).is_err());
    let stage = gpt(cfg(0.0)).unwrap().build(&Build::cpu(0)).unwrap();
    let opt = Box::new(AdamW::new(stage.params(), AdamWConfig::default()).unwrap());
    let e = SerialTrainer::new(
        stage,
        opt,
        TrainOptions {
            spec: TrainSpec {
                optim: OptimSpec {
                    lr: LrSchedule::Constant { lr: 1e-3 },
                    ..Default::default()
                },
                ..TrainSpec::serial()
            },
            micro_batches: 1,
            tied: vec![("wte.weight".into(), "nope.weight".into())],
            loss: std::sync::Arc::new(pipewright::parallel::loss::CrossEntropy::default()),
        },
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("nope.weight"), "{e}");
    // A sequence longer than block_size names the layer and the flag.
    let t = trainer(cfg(0.0), 0, 1);
    let long = Tensor::zeros((1, 7), DType::U32, &candle_core::Device::Cpu).unwrap();
    let e = t
        .predict(&Batch::input(long.clone()))
        .unwrap_err()
        .to_string();
    assert!(e.contains("embed") && e.contains("--block-size"), "{e}");
}

#[test]
fn gradient_norm_counts_a_tied_pair_once() {
    let task = Adder::new(2, 0).unwrap();
    let t = trainer(cfg(0.0), 2, 1);
    let (x, y) = task.batch(0, 8).unwrap();
    let (_, mut g, _) = t
        .loss_and_grads(&Batch::pair(x.clone(), y.clone()))
        .unwrap();
    let want: f64 = g
        .iter()
        .filter(|(n, _)| n.as_str() != TIED.1)
        .map(|(_, t)| {
            t.sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap() as f64
        })
        .sum::<f64>()
        .sqrt();
    let tied = vec![(TIED.0.to_string(), TIED.1.to_string())];
    let norm = pipewright::engine::serial::clip_tied(&mut g, &tied, None).unwrap();
    assert!((norm - want).abs() / want < 1e-6, "{norm} vs {want}");
    assert!(
        norm < g.norm().unwrap(),
        "counting the tie twice would give more"
    );
}

/// Relative difference (see [`max_rel_diff`]) as f32, for assertions.
fn rel_diff(a: &Tensor, b: &Tensor) -> f32 {
    max_rel_diff(a, b).unwrap() as f32
}
