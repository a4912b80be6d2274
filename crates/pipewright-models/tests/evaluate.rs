//! `Varuna::evaluate` against serial evaluation: the loss and the output of the GPT in
//! evaluation mode at pp 1/2/4 and tp 1/2, in f32 (relative 1e-5) and in bf16 and f16 (within
//! their rounding).

use std::sync::Arc;

use pipewright::distributed::comm::local;
use pipewright::distributed::topology::Layout;
use pipewright::engine::serial::{SerialTrainer, TrainOptions};
use pipewright::engine::varuna::Varuna;
use pipewright::model::nn::max_rel_diff;
use pipewright::model::nn::optim::OptimSpec;
use pipewright::model::nn::optim::{AdamW, AdamWConfig, LrSchedule};
use pipewright::model::precision::Precision;
use pipewright::parallel::loss::CrossEntropy;
use pipewright::trainer::TrainSpec;
use pipewright::{Batch, Build};
use pipewright_models::parity::ParityRun;
use pipewright_models::tasks::Adder;
use pipewright_models::{gpt, Task};

fn batch() -> Batch {
    let (x, y) = Adder::new(2, 0).unwrap().batch(7, 16).unwrap();
    Batch::pair(x, y)
}

/// Serial evaluation: (loss, output).
fn serial() -> (f64, candle_core::Tensor) {
    let run = ParityRun::default();
    let stage = gpt(run.gpt).unwrap().build(&Build::cpu(run.seed)).unwrap();
    let opt = Box::new(AdamW::new(stage.params(), AdamWConfig::default()).unwrap());
    let t = SerialTrainer::new(
        stage,
        opt,
        TrainOptions {
            spec: TrainSpec {
                seed: run.seed,
                optim: OptimSpec {
                    lr: LrSchedule::Constant { lr: 1e-3 },
                    ..Default::default()
                },
                ..TrainSpec::serial()
            },
            micro_batches: 1,
            tied: vec![],
            loss: Arc::new(CrossEntropy::default()),
        },
    )
    .unwrap();
    t.evaluate(&batch()).unwrap()
}

#[test]
fn evaluation_equals_serial_at_every_layout_and_precision() {
    let (want_loss, want_out) = serial();
    for (pp, tp) in [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)] {
        // (precision, loss tolerance, output tolerance): bf16 keeps 8 bits of mantissa, f16 11.
        for (precision, tol, out_tol) in [
            (Precision::F32, 1e-5, 1e-5),
            (Precision::Bf16, 1e-3, 3e-2),
            (Precision::F16, 2e-4, 3e-3),
        ] {
            let layout = Layout::new(pp, tp, 1).unwrap();
            let opts = ParityRun::default()
                .options(layout)
                .with_spec(|s| s.precision = precision);
            let got = local::run(layout.world(), |comm| {
                let v = Varuna::new(
                    &gpt(ParityRun::default().gpt)?,
                    Box::new(comm),
                    opts.clone(),
                )?;
                let e = v.evaluate(&batch(), true)?;
                let without = v.evaluate(&batch(), false)?;
                assert!(without.output.is_none());
                assert_eq!(without.loss.to_bits(), e.loss.to_bits());
                Ok((e.loss, e.count, e.output.unwrap()))
            })
            .unwrap();
            let what = format!("pp={pp} tp={tp} {precision}");
            for (rank, (loss, count, out)) in got.iter().enumerate() {
                assert_eq!(*count, 16 * 3, "{what}: every answer digit counts");
                let e = ((loss - want_loss) / want_loss).abs();
                assert!(
                    e < tol,
                    "{what} rank {rank}: loss {loss} vs serial {want_loss} ({e:e})"
                );
                let e = max_rel_diff(out, &want_out).unwrap();
                assert!(e < out_tol, "{what} rank {rank}: output differs by {e:e}");
                assert_eq!(out.dims(), want_out.dims(), "{what}: the whole vocabulary");
            }
        }
    }
}
