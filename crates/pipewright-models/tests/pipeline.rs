//! Pipeline parity: a GPT split over pp ranks (threads) and trained with each schedule gives
//! the serial run's losses, gradients and parameters.

use pipewright::nn::max_rel_diff;
use std::collections::HashMap;

use candle_core::Tensor;
use pipewright::comm::local;
use pipewright::nn::optim::{AdamW, AdamWConfig, LrSchedule, Optimizer};
use pipewright::nn::Init;
use pipewright::pipeline::executor::{Pipeline, PipelineOptions, Recompute};
use pipewright::pipeline::schedule::Kind;
use pipewright::serial::{SerialTrainer, TrainOptions};
use pipewright_models::tasks::Adder;
use pipewright_models::{gpt, GptConfig, Task, TIED};

const SEED: u64 = 3;
const BATCH: usize = 12;

fn cfg() -> GptConfig {
    GptConfig {
        vocab_size: 10,
        block_size: 6,
        n_layer: 4,
        n_head: 2,
        n_embd: 16,
        dropout: 0.1,
    }
}

/// The options the tests share; each test sets what it varies.
fn options(chunks: usize, schedule: Kind) -> PipelineOptions {
    PipelineOptions {
        chunks,
        schedule,
        virtual_stages: 1,
        balance: None,
        seed: SEED,
        tied: vec![],
        clip: None,
        lr: LrSchedule::Constant { lr: 1e-3 },
        recompute: Recompute::Never,
        deferred_batch_norm: false,
    }
}

fn adamw(params: Vec<(String, candle_core::Var)>) -> pipewright::Result<Box<dyn Optimizer>> {
    Ok(Box::new(AdamW::new(params, AdamWConfig::default())?))
}

fn tied() -> Vec<(String, String)> {
    vec![(TIED.0.into(), TIED.1.into())]
}

type Run = (Vec<f64>, HashMap<String, Tensor>, HashMap<String, Tensor>);

/// Serial: step-0 gradients, then losses of 3 AdamW steps and the final parameters.
fn serial(chunks: usize) -> Run {
    let task = Adder::new(2, 0).unwrap();
    let model = gpt(cfg()).unwrap();
    let stage = model.build(&Init::cpu(SEED)).unwrap();
    let opt = adamw(stage.params()).unwrap();
    let mut t = SerialTrainer::new(
        stage,
        opt,
        TrainOptions {
            seed: SEED,
            chunks,
            clip: Some(0.5),
            schedule: LrSchedule::Constant { lr: 1e-2 },
            tied: tied(),
            deferred_batch_norm: false,
        },
    )
    .unwrap();
    let (x, y) = task.batch(0, BATCH).unwrap();
    let (_, g, _) = t.loss_and_grads(&x, &y).unwrap();
    let grads = g.iter().map(|(n, g)| (n.clone(), g.clone())).collect();
    let losses = (0..3)
        .map(|s| {
            let (x, y) = task.batch(s, BATCH).unwrap();
            t.step(&x, &y).unwrap().loss
        })
        .collect();
    let params = t
        .model()
        .params()
        .into_iter()
        .map(|(n, v)| (n, v.as_tensor().copy().unwrap()))
        .collect();
    (losses, grads, params)
}

fn pipelined(pp: usize, chunks: usize, kind: Kind, v: usize, recompute: Recompute) -> Run {
    let task = Adder::new(2, 0).unwrap();
    let model = gpt(cfg()).unwrap();
    let per_rank = local::run(pp, |comm| {
        let opts = PipelineOptions {
            virtual_stages: v,
            tied: tied(),
            clip: Some(0.5),
            lr: LrSchedule::Constant { lr: 1e-2 },
            recompute,
            ..options(chunks, kind)
        };
        let mut p = Pipeline::new(&model, &Init::cpu(SEED), Box::new(comm), opts, adamw)?;
        let (x, y) = task.batch(0, BATCH)?;
        let (_, g) = p.loss_and_grads(&x, &y)?;
        let grads: Vec<(String, Tensor)> = g.iter().map(|(n, g)| (n.clone(), g.clone())).collect();
        let mut losses = Vec::new();
        for s in 0..3 {
            let (x, y) = task.batch(s, BATCH)?;
            losses.push(p.step(&x, &y)?.loss);
        }
        let params: Vec<(String, Tensor)> = p
            .params()
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().copy().unwrap()))
            .collect();
        Ok((losses, grads, params))
    })
    .unwrap();
    let losses = per_rank[0].0.clone();
    for (r, (l, _, _)) in per_rank.iter().enumerate() {
        assert_eq!(l, &losses, "rank {r} reports other losses");
    }
    let grads = per_rank.iter().flat_map(|r| r.1.clone()).collect();
    let params = per_rank.iter().flat_map(|r| r.2.clone()).collect();
    (losses, grads, params)
}

fn compare(what: &str, got: &Run, want: &Run) {
    for (a, b) in got.0.iter().zip(&want.0) {
        assert!(
            ((a - b) / b).abs() < 1e-5,
            "{what}: losses {:?} vs serial {:?}",
            got.0,
            want.0
        );
    }
    for (i, (g, w)) in [(&got.1, &want.1), (&got.2, &want.2)]
        .into_iter()
        .enumerate()
    {
        assert_eq!(
            g.len(),
            w.len(),
            "{what}: every parameter is on exactly one rank"
        );
        for (n, t) in w {
            let e = rel_diff(
                g.get(n).unwrap_or_else(|| panic!("{what}: `{n}` missing")),
                t,
            );
            let kind = if i == 0 {
                "gradient"
            } else {
                "parameter after 3 AdamW steps"
            };
            assert!(e < 1e-5, "{what}: {kind} `{n}` differs by {e:e}");
        }
    }
}

const RECOMPUTE: [Recompute; 3] = [Recompute::Never, Recompute::ExceptLast, Recompute::Always];

#[test]
fn gpipe_and_1f1b_match_serial_training_in_every_recompute_mode() {
    for chunks in [1, 3, 4] {
        let want = serial(chunks);
        for pp in [1, 2, 4] {
            for kind in [Kind::GPipe, Kind::OneFOneB, Kind::ZeroBubbleH1] {
                for recompute in RECOMPUTE {
                    let what = format!("{kind} pp={pp} chunks={chunks} recompute {recompute:?}");
                    compare(&what, &pipelined(pp, chunks, kind, 1, recompute), &want);
                }
            }
        }
    }
}

#[test]
fn interleaved_matches_serial_training() {
    for (pp, chunks) in [(2, 4), (2, 2), (1, 3)] {
        let want = serial(chunks);
        for recompute in RECOMPUTE {
            compare(
                &format!("interleaved pp={pp} chunks={chunks} v=2 recompute {recompute:?}"),
                &pipelined(pp, chunks, Kind::Interleaved, 2, recompute),
                &want,
            );
        }
    }
}

#[test]
fn the_executor_holds_the_activations_its_schedule_promises() {
    let task = Adder::new(2, 0).unwrap();
    let model = gpt(cfg()).unwrap();
    let (pp, m) = (4, 6);
    for kind in [Kind::GPipe, Kind::OneFOneB, Kind::ZeroBubbleH1] {
        let peaks = local::run(pp, |comm| {
            let opts = PipelineOptions {
                tied: tied(),
                ..options(m, kind)
            };
            let mut p = Pipeline::new(&model, &Init::cpu(SEED), Box::new(comm), opts, adamw)?;
            let (x, y) = task.batch(0, BATCH)?;
            p.step(&x, &y)?;
            Ok(p.peak_activations())
        })
        .unwrap();
        let want: Vec<usize> = match kind {
            Kind::GPipe => vec![m; pp],
            _ => (0..pp).map(|s| (pp - s).min(m)).collect(),
        };
        assert_eq!(peaks, want, "{kind}");
    }
}

#[test]
fn bad_pipeline_configurations_are_errors() {
    let model = gpt(cfg()).unwrap();
    let err = |kind: Kind, chunks: usize, balance: Option<Vec<usize>>| {
        local::run(2, |comm| {
            let opts = PipelineOptions {
                balance: balance.clone(),
                seed: 0,
                tied: tied(),
                ..options(chunks, kind)
            };
            Pipeline::new(&model, &Init::cpu(0), Box::new(comm), opts, adamw).map(|_| ())
        })
        .unwrap_err()
        .to_string()
    };
    assert!(
        err(Kind::GPipe, 2, Some(vec![4, 3])).contains("sums to 7 but the model has 6 segments")
    );
    assert!(err(Kind::GPipe, 0, None).contains("at least one"));
}

#[test]
fn always_recompute_holds_only_stage_inputs() {
    let task = Adder::new(2, 0).unwrap();
    let model = gpt(cfg()).unwrap();
    let (pp, m) = (2, 4);
    for (recompute, graphs) in [
        (Recompute::Always, vec![0, 0]),
        (Recompute::ExceptLast, vec![1, 1]),
        (Recompute::Never, vec![4, 4]),
    ] {
        let got = local::run(pp, |comm| {
            let opts = PipelineOptions {
                tied: tied(),
                recompute,
                ..options(m, Kind::GPipe)
            };
            let mut p = Pipeline::new(&model, &Init::cpu(SEED), Box::new(comm), opts, adamw)?;
            let (x, y) = task.batch(0, BATCH)?;
            p.step(&x, &y)?;
            Ok((p.peak_activations(), p.peak_inputs()))
        })
        .unwrap();
        let (a, i): (Vec<usize>, Vec<usize>) = got.into_iter().unzip();
        assert_eq!(a, graphs, "{recompute:?}: forward graphs held");
        assert_eq!(
            i,
            vec![m, m],
            "{recompute:?}: GPipe holds every stage input"
        );
    }
}

mod cnn_pipeline {
    use super::*;
    use pipewright::nn::optim::{AdamW, AdamWConfig};
    use pipewright_models::tasks::Shapes;
    use pipewright_models::{cnn, CnnConfig};

    fn model() -> pipewright::Sequential {
        with_skip(false)
    }

    fn with_skip(long_skip: bool) -> pipewright::Sequential {
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

    /// (losses, step-0 gradients, parameters and BatchNorm statistics after 3 steps).
    fn serial(chunks: usize, deferred: bool) -> Run {
        serial_of(&model(), chunks, deferred)
    }

    fn serial_of(model: &pipewright::Sequential, chunks: usize, deferred: bool) -> Run {
        let task = Shapes::new(8, 0).unwrap();
        let stage = model.build(&Init::cpu(SEED)).unwrap();
        let opt = Box::new(AdamW::new(stage.params(), AdamWConfig::default()).unwrap());
        let mut t = SerialTrainer::new(
            stage,
            opt,
            TrainOptions {
                seed: SEED,
                chunks,
                clip: None,
                schedule: LrSchedule::Constant { lr: 1e-2 },
                tied: vec![],
                deferred_batch_norm: deferred,
            },
        )
        .unwrap();
        // This training forward moves BatchNorm statistics, as the pipeline side's does.
        let (x, y) = task.batch(0, BATCH).unwrap();
        let (_, g, _) = t.loss_and_grads(&x, &y).unwrap();
        let grads = g.iter().map(|(n, g)| (n.clone(), g.clone())).collect();
        let mut losses: Vec<f64> = (0..3)
            .map(|s| {
                let (x, y) = task.batch(s, BATCH).unwrap();
                t.step(&x, &y).unwrap().loss
            })
            .collect();
        losses.push(
            t.predict(&x)
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap() as f64,
        );
        let m = t.model();
        let state = m
            .params()
            .into_iter()
            .chain(m.buffers())
            .map(|(n, v)| (n, v.as_tensor().copy().unwrap()))
            .collect();
        (losses, grads, state)
    }

    fn piped(pp: usize, chunks: usize, kind: Kind, recompute: Recompute, deferred: bool) -> Run {
        piped_of(&model(), pp, chunks, kind, recompute, deferred, 1)
    }

    fn piped_of(
        model: &pipewright::Sequential,
        pp: usize,
        chunks: usize,
        kind: Kind,
        recompute: Recompute,
        deferred: bool,
        v: usize,
    ) -> Run {
        let task = Shapes::new(8, 0).unwrap();
        let per_rank = local::run(pp, |comm| {
            let opts = PipelineOptions {
                virtual_stages: v,
                lr: LrSchedule::Constant { lr: 1e-2 },
                recompute,
                deferred_batch_norm: deferred,
                ..options(chunks, kind)
            };
            let mut p = Pipeline::new(model, &Init::cpu(SEED), Box::new(comm), opts, adamw)?;
            let (x, y) = task.batch(0, BATCH)?;
            let (_, g) = p.loss_and_grads(&x, &y)?;
            let grads: Vec<(String, Tensor)> =
                g.iter().map(|(n, g)| (n.clone(), g.clone())).collect();
            let mut losses = Vec::new();
            for s in 0..3 {
                let (x, y) = task.batch(s, BATCH)?;
                losses.push(p.step(&x, &y)?.loss);
            }
            let state: Vec<(String, Tensor)> = p
                .params()
                .iter()
                .cloned()
                .chain(p.buffers())
                .map(|(n, v)| (n, v.as_tensor().copy().unwrap()))
                .collect();
            Ok((losses, grads, state))
        })
        .unwrap();
        let losses = per_rank[0].0.clone();
        (
            losses,
            per_rank.iter().flat_map(|r| r.1.clone()).collect(),
            per_rank.iter().flat_map(|r| r.2.clone()).collect(),
        )
    }

    #[test]
    fn cnn_with_batch_norm_matches_serial_training() {
        for chunks in [1, 3, 4] {
            let want = serial(chunks, false);
            for pp in [1, 2, 4] {
                for kind in [Kind::GPipe, Kind::OneFOneB, Kind::ZeroBubbleH1] {
                    for recompute in RECOMPUTE {
                        compare(
                            &format!("cnn {kind} pp={pp} chunks={chunks} recompute {recompute:?}"),
                            &piped(pp, chunks, kind, recompute, false),
                            &want,
                        );
                    }
                }
            }
        }
        // Interleaved, v = 2 on 2 ranks: 4 model stages of the CNN's 5 layers.
        for chunks in [2, 4] {
            let want = serial(chunks, false);
            for recompute in RECOMPUTE {
                let got = piped_of(&model(), 2, chunks, Kind::Interleaved, recompute, false, 2);
                compare(
                    &format!("cnn interleaved v=2 chunks={chunks} {recompute:?}"),
                    &got,
                    &want,
                );
            }
        }
    }

    #[test]
    fn deferred_batch_norm_commits_whole_batch_statistics() {
        let task = Shapes::new(8, 0).unwrap();
        let stats = |chunks: usize, deferred: bool| {
            let stage = model().build(&Init::cpu(SEED)).unwrap();
            let opt = Box::new(AdamW::new(stage.params(), AdamWConfig::default()).unwrap());
            let t = SerialTrainer::new(
                stage,
                opt,
                TrainOptions {
                    seed: SEED,
                    chunks,
                    clip: None,
                    schedule: LrSchedule::Constant { lr: 1e-2 },
                    tied: vec![],
                    deferred_batch_norm: deferred,
                },
            )
            .unwrap();
            let (x, y) = task.batch(0, BATCH).unwrap();
            t.loss_and_grads(&x, &y).unwrap();
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
        let want = serial(4, true);
        compare(
            "cnn deferred batch norm pp=2",
            &piped(2, 4, Kind::GPipe, Recompute::Never, true),
            &want,
        );
    }

    #[test]
    fn a_skip_connection_jumps_over_whole_stages() {
        let model = with_skip(true);
        let skips = model.skips().unwrap();
        assert_eq!(skips.len(), 1);
        // 5 layers on 4 stages: [stem, blocks.0], [blocks.1], [blocks.2], [head]: the skip
        // leaves stage 0 and lands on stage 3, past two whole stages.
        let want = serial_of(&model, 3, false);
        for (kind, recompute) in [
            (Kind::GPipe, Recompute::Never),
            (Kind::OneFOneB, Recompute::Never),
            (Kind::OneFOneB, Recompute::Always),
        ] {
            let got = piped_of(&model, 4, 3, kind, recompute, false, 1);
            compare(&format!("cnn long skip {kind} {recompute:?}"), &got, &want);
        }
        assert!(want.2.contains_key("head.skip.weight"));
    }
}

mod skip_misuse {
    use super::*;
    use pipewright::model::{Activation, Cx, Layer, LayerSpec, Sequential};

    /// A layer that stashes or pops a name (or does nothing), passing its input on.
    struct Probe {
        stash: Option<&'static str>,
        pop: Option<&'static str>,
    }

    impl Layer for Probe {
        fn name(&self) -> &str {
            "probe"
        }
        fn forward(&self, x: Activation, cx: &mut Cx) -> pipewright::Result<Activation> {
            let t = x.into_tensor("probe")?;
            if let Some(n) = self.stash {
                cx.stash("probe", n, t.clone())?;
            }
            if let Some(n) = self.pop {
                return Ok((t + cx.pop("probe", n)?)?.into());
            }
            Ok(t.into())
        }
        fn params(&self) -> Vec<(String, candle_core::Var)> {
            Vec::new()
        }
    }

    fn spec(i: usize, stash: Option<&'static str>, pop: Option<&'static str>) -> LayerSpec {
        LayerSpec::new(format!("l{i}"), move |_| {
            Ok(Box::new(Probe { stash, pop }) as Box<dyn Layer>)
        })
    }

    #[test]
    fn misused_skips_are_clear_errors() {
        let mut pop_first = Sequential::new();
        pop_first
            .push(spec(0, None, Some("s")).pops(&["s"]))
            .push(spec(1, Some("s"), None).stashes(&["s"]));
        assert!(pop_first
            .skips()
            .unwrap_err()
            .to_string()
            .contains("which no earlier layer stashes"));
        let mut twice = Sequential::new();
        twice
            .push(spec(0, Some("s"), None).stashes(&["s"]))
            .push(spec(1, Some("s"), None).stashes(&["s"]));
        assert!(twice
            .skips()
            .unwrap_err()
            .to_string()
            .contains("stashed by two layers"));
        let mut never = Sequential::new();
        never
            .push(spec(0, Some("s"), None).stashes(&["s"]))
            .push(spec(1, None, None));
        assert!(never
            .skips()
            .unwrap_err()
            .to_string()
            .contains("no later layer pops it"));
        // At run time: popping what was never stashed, and stashing without declaring it.
        let x = Tensor::zeros((2, 3), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
        let mut cx = Cx::eval();
        let e = Probe {
            stash: None,
            pop: Some("ghost"),
        }
        .forward(x.clone().into(), &mut cx)
        .err()
        .unwrap()
        .to_string();
        assert!(
            e.contains("pops `ghost` but no earlier layer stashed it"),
            "{e}"
        );
        let mut undeclared = Sequential::new();
        undeclared
            .push(spec(0, Some("hidden"), None))
            .cut()
            .push(spec(1, None, None));
        let e = local::run(2, |comm| {
            let opts = PipelineOptions {
                seed: 0,
                ..options(1, Kind::GPipe)
            };
            let p = Pipeline::new(&undeclared, &Init::cpu(0), Box::new(comm), opts, adamw)?;
            p.predict(&x).map(|_| ())
        })
        .unwrap_err()
        .to_string();
        assert!(
            e.contains(
                "model stage 0: skip connections [\"hidden\"] were stashed but nothing pops them"
            ),
            "{e}"
        );
    }
}

#[test]
fn an_activation_without_the_batch_on_dim_0_is_refused_at_the_cut() {
    use pipewright::model::{Activation, Cx, Layer, LayerSpec, Sequential};
    struct Transpose;
    impl Layer for Transpose {
        fn name(&self) -> &str {
            "transpose"
        }
        fn forward(&self, x: Activation, _cx: &mut Cx) -> pipewright::Result<Activation> {
            Ok(x.into_tensor("transpose")?.t()?.into())
        }
        fn params(&self) -> Vec<(String, candle_core::Var)> {
            Vec::new()
        }
    }
    let mut m = Sequential::new();
    m.push(LayerSpec::new("t0", |_| {
        Ok(Box::new(Transpose) as Box<dyn Layer>)
    }))
    .cut();
    m.push(LayerSpec::new("t1", |_| {
        Ok(Box::new(Transpose) as Box<dyn Layer>)
    }));
    let x = Tensor::zeros((4, 3), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
    let e = local::run(2, |comm| {
        let opts = PipelineOptions {
            seed: 0,
            ..options(1, Kind::GPipe)
        };
        Pipeline::new(&m, &Init::cpu(0), Box::new(comm), opts, adamw)?
            .evaluate(&x)
            .map(|_| ())
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains(
            "layer 0 ends model stage 0 with an output of shape [3, 4] for a micro-batch of 4 rows"
        ),
        "{e}"
    );
}

/// Relative difference (see [`max_rel_diff`]) as f32, for assertions.
fn rel_diff(a: &Tensor, b: &Tensor) -> f32 {
    max_rel_diff(a, b).unwrap() as f32
}
