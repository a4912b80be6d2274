//! Learning, not just running: a tiny GPT learns 2-digit addition (held-out exact match) in
//! well under a minute on two cores. Alone in its binary so no other test competes for cores.

use pipewright::engine::serial::{SerialTrainer, TrainOptions};

use pipewright::trainer::TrainSpec;

use pipewright::model::nn::optim::OptimSpec;
use pipewright::model::nn::optim::{AdamW, AdamWConfig, LrSchedule};
use pipewright::{Batch, Build};
use pipewright_models::tasks::Adder;
use pipewright_models::{gpt, GptConfig, Task, TIED};

#[test]
fn tiny_gpt_learns_two_digit_addition() {
    let task = Adder::new(2, 0).unwrap();
    let cfg = GptConfig {
        vocab_size: 10,
        block_size: 6,
        n_layer: 2,
        n_head: 4,
        n_embd: 128,
        dropout: 0.0,
    };
    let stage = gpt(cfg).unwrap().build(&Build::cpu(0)).unwrap();
    let opt = Box::new(
        AdamW::new(
            stage.params(),
            AdamWConfig {
                weight_decay: 0.1,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let steps = 300;
    let mut t = SerialTrainer::new(
        stage,
        opt,
        TrainOptions {
            spec: TrainSpec {
                optim: OptimSpec {
                    clip: Some(1.0),
                    lr: LrSchedule::WarmupCosine {
                        lr: 1e-3,
                        warmup: 100,
                        total: steps,
                        min_lr: 1e-4,
                    },
                    ..Default::default()
                },
                ..TrainSpec::serial()
            },
            micro_batches: 1,
            tied: vec![(TIED.0.into(), TIED.1.into())],
            loss: std::sync::Arc::new(pipewright::parallel::loss::CrossEntropy::default()),
        },
    )
    .unwrap();
    let start = std::time::Instant::now();
    let before = task
        .evaluate(&mut |x| t.predict(&Batch::input(x.clone())))
        .unwrap();
    for s in 0..steps {
        let (x, y) = task.batch(s, 64).unwrap();
        t.step(&Batch::pair(x.clone(), y.clone())).unwrap();
    }
    let acc = task
        .evaluate(&mut |x| t.predict(&Batch::input(x.clone())))
        .unwrap();
    eprintln!(
        "adder accuracy {before} -> {acc} in {:.1} s",
        start.elapsed().as_secs_f64()
    );
    assert!(
        before < 0.05,
        "an untrained model should not add ({before})"
    );
    assert!(
        acc >= 0.8,
        "held-out exact-match accuracy {acc} after {steps} steps, want >= 0.8"
    );
}
