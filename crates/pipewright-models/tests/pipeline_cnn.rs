//! Pipeline parity of the CNN (BatchNorm, deferred batch norm, a skip connection across
//! stages) through `Varuna` against serial training.

mod common;

use std::sync::Arc;

use common::*;
use pipewright::engine::serial::{SerialTrainer, TrainOptions};
use pipewright::model::nn::optim::LrSchedule;
use pipewright::model::nn::optim::OptimSpec;
use pipewright::parallel::loss::CrossEntropy;
use pipewright::parallel::pipeline::schedule::ScheduleKind;
use pipewright::parallel::pipeline::PipelineSpec;
use pipewright::parallel::pipeline::Recompute;
use pipewright::trainer::TrainSpec;
use pipewright::{Batch, Build, Sequential};
use pipewright_models::tasks::Shapes;
use pipewright_models::{cnn, CnnConfig, Task};

fn with_skip(long_skip: bool) -> Sequential {
    cnn(CnnConfig {
        in_channels: 1,
        classes: 4,
        width: 4,
        blocks: 3,
        blocks_per_stage: 1,
        long_skip,
    })
    .unwrap()
}

fn shapes_batch(s: u64) -> Batch {
    let (x, y) = Shapes::new(8, 0).unwrap().batch(s, BATCH).unwrap();
    Batch::pair(x, y)
}

fn case(chunks: usize, deferred: bool) -> Case {
    Case {
        model: with_skip(false),
        batch: shapes_batch,
        tied: vec![],
        clip: None,
        chunks,
        deferred,
    }
}

#[test]
fn cnn_with_batch_norm_matches_serial_training() {
    for chunks in [1, 3, 4] {
        let c = case(chunks, false);
        let want = serial(&c);
        for pp in [1, 2, 4] {
            for kind in [
                ScheduleKind::GPipe,
                ScheduleKind::OneFOneB,
                ScheduleKind::ZeroBubbleH1,
            ] {
                for recompute in RECOMPUTE {
                    compare(
                        &format!("cnn {kind} pp={pp} chunks={chunks} recompute {recompute:?}"),
                        &pipelined(&c, pp, kind, 1, recompute),
                        &want,
                    );
                }
            }
        }
    }
    // Interleaved, v = 2 on 2 ranks: 4 model stages of the CNN's 5 layers.
    for chunks in [2, 4] {
        let c = case(chunks, false);
        let want = serial(&c);
        for recompute in RECOMPUTE {
            compare(
                &format!("cnn interleaved v=2 chunks={chunks} {recompute:?}"),
                &pipelined(&c, 2, ScheduleKind::Interleaved, 2, recompute),
                &want,
            );
        }
    }
}

#[test]
fn deferred_batch_norm_commits_whole_batch_statistics() {
    let stats = |chunks: usize, deferred: bool| {
        let c = case(chunks, deferred);
        let stage = c.model.build(&Build::cpu(SEED)).unwrap();
        let opt = adamw(stage.params()).unwrap();
        let t = SerialTrainer::new(
            stage,
            opt,
            TrainOptions {
                spec: TrainSpec {
                    seed: SEED,
                    optim: OptimSpec {
                        lr: LrSchedule::Constant { lr: 1e-2 },
                        ..Default::default()
                    },
                    pipeline: PipelineSpec {
                        deferred_batch_norm: deferred,
                        ..Default::default()
                    },
                    ..TrainSpec::serial()
                },
                micro_batches: chunks,
                tied: vec![],
                loss: Arc::new(CrossEntropy::default()),
            },
        )
        .unwrap();
        t.loss_and_grads(&shapes_batch(0)).unwrap();
        t.model()
            .buffers()
            .into_iter()
            .map(|(n, v)| (n, v.as_tensor().copy().unwrap()))
            .collect::<Vec<_>>()
    };
    let whole = stats(1, false);
    let deferred = stats(4, true);
    let per_micro_batch = stats(4, false);
    let mut moved_apart = false;
    for ((n, w), ((_, d), (_, p))) in whole.iter().zip(deferred.iter().zip(&per_micro_batch)) {
        // The first stem statistics see the same input either way; deeper ones see
        // activations normalised per micro-batch, so equality is for the stem only.
        if n.starts_with("stem.") {
            let e = rel_diff(d, w);
            assert!(
                e < 1e-5,
                "`{n}`: deferred {e:e} from whole-batch statistics"
            );
        }
        moved_apart |= rel_diff(p, w) > 1e-4;
    }
    assert!(
        moved_apart,
        "without deferral, statistics are per micro-batch and differ"
    );
    // The pipeline commits the same statistics as the serial trainer.
    let c = case(4, true);
    compare(
        "cnn deferred batch norm pp=2",
        &pipelined(&c, 2, ScheduleKind::GPipe, 1, Recompute::Never),
        &serial(&c),
    );
}

#[test]
fn a_skip_connection_jumps_over_whole_stages() {
    let c = Case {
        model: with_skip(true),
        ..case(3, false)
    };
    assert_eq!(c.model.skips().unwrap().len(), 1);
    // 5 layers on 4 stages: [stem, blocks.0], [blocks.1], [blocks.2], [head]: the skip
    // leaves stage 0 and lands on stage 3, past two whole stages.
    let want = serial(&c);
    for (kind, recompute) in [
        (ScheduleKind::GPipe, Recompute::Never),
        (ScheduleKind::OneFOneB, Recompute::Never),
        (ScheduleKind::OneFOneB, Recompute::Always),
    ] {
        let got = pipelined(&c, 4, kind, 1, recompute);
        compare(&format!("cnn long skip {kind} {recompute:?}"), &got, &want);
    }
    assert!(want.2.contains_key("head.skip.weight"));
}

#[test]
fn zero_three_cuts_the_graph_at_every_layer_and_keeps_skips_and_batch_norm() {
    use pipewright::distributed::comm::local;
    use pipewright::distributed::topology::Layout;
    use pipewright::engine::varuna::Varuna;
    use pipewright::parallel::data_parallel::ReplicaBatches;
    use pipewright::parallel::zero::Zero;
    // The long skip leaves the stem and lands on the head: inside one stage at pp 1 (popped
    // four cuts later), from stage 0 to stage 1 at pp 2 (sent on from a cut).
    let c = Case {
        model: with_skip(true),
        ..case(6, false)
    };
    let want = serial(&c);
    for (pp, recompute) in [(1, Recompute::Never), (2, Recompute::Always)] {
        let opts = options(&c, pp, ScheduleKind::OneFOneB, 1, recompute).with_spec(|s| {
            s.parallel.zero = Zero::Parameters;
            s.overlap.bucket_bytes = 1024;
        });
        let opts = opts.with_spec(|s| s.parallel.layout = Layout::new(pp, 1, 2).unwrap());
        let per_rank = local::run(pp * 2, |comm| {
            let mut v = Varuna::new(&c.model, Box::new(comm), opts.clone())?;
            assert_eq!(v.zero(), Zero::Parameters);
            v.set_optimizer(adamw)?;
            let dp_rank = v.coords().dp_rank;
            let loader = ReplicaBatches::new(
                |s, _| Ok(shapes_batch(s)),
                BATCH,
                dp_rank,
                2,
                candle_core::Device::Cpu,
            )?;
            let mut losses = Vec::new();
            for s in 0..3 {
                losses.push(v.step(&loader.batch(s)?)?.loss);
            }
            Ok((losses, v.parameters()?))
        })
        .unwrap();
        for (r, (losses, params)) in per_rank.iter().enumerate() {
            let what = format!("ZeRO-3 cnn long skip pp {pp} {recompute:?} rank {r}");
            for (a, b) in losses.iter().zip(&want.0) {
                assert!(
                    ((a - b) / b).abs() < 1e-5,
                    "{what}: {losses:?} vs {:?}",
                    want.0
                );
            }
            for (n, p) in params {
                let d = rel_diff(p, &want.2[n]);
                assert!(d < 1e-5, "{what}: {n} off by {d:e}");
            }
        }
    }
}
