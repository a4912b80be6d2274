//! Pipeline parity through the one production step: a GPT and a CNN split over pp ranks
//! (threads, pp-only layouts of [`Varuna`]) and trained with each schedule and recompute mode
//! give the serial run's losses, gradients and parameters.

use std::sync::{Arc, Mutex};

use candle_core::Tensor;
use pipewright::comm::local;
use pipewright::loss::CrossEntropy;
use pipewright::nn::max_rel_diff;
use pipewright::nn::optim::{AdamW, AdamWConfig, LrSchedule, Optimizer};
use pipewright::pipeline::schedule::Kind;
use pipewright::pipeline::Recompute;
use pipewright::serial::{SerialTrainer, TrainOptions};
use pipewright::topology::Layout;
use pipewright::varuna::{Varuna, VarunaOptions};
use pipewright::{Batch, Build, Sequential};
use pipewright_models::tasks::Adder;
use pipewright_models::{gpt, GptConfig, Task, TIED};
use std::collections::HashMap;

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

fn adamw(params: Vec<(String, candle_core::Var)>) -> pipewright::Result<Box<dyn Optimizer>> {
    Ok(Box::new(AdamW::new(params, AdamWConfig::default())?))
}

fn tied() -> Vec<(String, String)> {
    vec![(TIED.0.into(), TIED.1.into())]
}

/// (losses of 3 AdamW steps, then the sum of the evaluation output; step-0 gradients;
/// final parameters and buffers).
type Run = (Vec<f64>, HashMap<String, Tensor>, HashMap<String, Tensor>);

/// One training run both sides make.
#[derive(Clone)]
struct Case {
    model: Sequential,
    batch: fn(u64) -> Batch,
    tied: Vec<(String, String)>,
    clip: Option<f64>,
    chunks: usize,
    deferred: bool,
}

fn adder_batch(s: u64) -> Batch {
    let (x, y) = Adder::new(2, 0).unwrap().batch(s, BATCH).unwrap();
    Batch::pair(x, y)
}

fn gpt_case(chunks: usize) -> Case {
    Case {
        model: gpt(cfg()).unwrap(),
        batch: adder_batch,
        tied: tied(),
        clip: Some(0.5),
        chunks,
        deferred: false,
    }
}

fn serial(c: &Case) -> Run {
    let trainer = || {
        let stage = c.model.build(&Build::cpu(SEED)).unwrap();
        let opt = adamw(stage.params()).unwrap();
        SerialTrainer::new(
            stage,
            opt,
            TrainOptions {
                seed: SEED,
                chunks: c.chunks,
                clip: c.clip,
                schedule: LrSchedule::Constant { lr: 1e-2 },
                tied: c.tied.clone(),
                deferred_batch_norm: c.deferred,
                loss: Arc::new(CrossEntropy::default()),
            },
        )
        .unwrap()
    };
    // A fresh trainer's gradients are the first step's (a second forward would move BatchNorm
    // statistics once more than the parallel side does).
    let (_, g, _) = trainer().loss_and_grads(&(c.batch)(0)).unwrap();
    let grads = g.iter().map(|(n, g)| (n.clone(), g.clone())).collect();
    let mut t = trainer();
    let mut losses: Vec<f64> = (0..3)
        .map(|s| t.step(&(c.batch)(s)).unwrap().loss)
        .collect();
    let out = t.predict(&(c.batch)(0)).unwrap();
    losses.push(out.sum_all().unwrap().to_scalar::<f32>().unwrap() as f64);
    let m = t.model();
    let state = m
        .params()
        .into_iter()
        .chain(m.buffers())
        .map(|(n, v)| (n, v.as_tensor().copy().unwrap()))
        .collect();
    (losses, grads, state)
}

/// The Varuna options of `c` at `pp` pipeline ranks.
fn options(c: &Case, pp: usize, kind: Kind, v: usize, recompute: Recompute) -> VarunaOptions {
    VarunaOptions {
        seed: SEED,
        schedule: kind,
        virtual_stages: v,
        recompute,
        shared_weights: c.tied.clone(),
        clip: c.clip,
        lr: LrSchedule::Constant { lr: 1e-2 },
        deferred_batch_norm: c.deferred,
        ..VarunaOptions::new(Layout::new(pp, 1, 1).unwrap(), BATCH, BATCH / c.chunks)
    }
}

fn pipelined(c: &Case, pp: usize, kind: Kind, v: usize, recompute: Recompute) -> Run {
    let opts = options(c, pp, kind, v, recompute);
    let per_rank = local::run(pp, |comm| {
        let mut p = Varuna::new(&c.model, Box::new(comm), opts.clone())?;
        p.set_optimizer(adamw)?;
        let first: Arc<Mutex<Vec<(String, Tensor)>>> = Arc::default();
        let keep = first.clone();
        p.set_grad_hook(move |g| {
            let mut k = keep.lock().unwrap();
            if k.is_empty() {
                k.extend(g.iter().map(|(n, g)| (n.clone(), g.clone())));
            }
        });
        let mut losses = Vec::new();
        for s in 0..3 {
            losses.push(p.step(&(c.batch)(s))?.loss);
        }
        let out = p.predict(&(c.batch)(0))?;
        losses.push(out.sum_all()?.to_scalar::<f32>()? as f64);
        let state: Vec<(String, Tensor)> = p
            .pipeline()
            .params()
            .iter()
            .cloned()
            .chain(p.pipeline().buffers())
            .map(|(n, v)| (n, v.as_tensor().copy().unwrap()))
            .collect();
        let grads = first.lock().unwrap().clone();
        Ok((losses, grads, state))
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
                "parameter or buffer after 3 AdamW steps"
            };
            assert!(e < 1e-5, "{what}: {kind} `{n}` differs by {e:e}");
        }
    }
}

const RECOMPUTE: [Recompute; 3] = [Recompute::Never, Recompute::ExceptLast, Recompute::Always];

#[test]
fn gpipe_1f1b_and_zero_bubble_match_serial_training_in_every_recompute_mode() {
    for chunks in [1, 3, 4] {
        let case = gpt_case(chunks);
        let want = serial(&case);
        for pp in [1, 2, 4] {
            for kind in [Kind::GPipe, Kind::OneFOneB, Kind::ZeroBubbleH1] {
                for recompute in RECOMPUTE {
                    let what = format!("{kind} pp={pp} chunks={chunks} recompute {recompute:?}");
                    compare(&what, &pipelined(&case, pp, kind, 1, recompute), &want);
                }
            }
        }
    }
}

#[test]
fn interleaved_matches_serial_training() {
    for (pp, chunks) in [(2, 4), (2, 2), (1, 3)] {
        let case = gpt_case(chunks);
        let want = serial(&case);
        for recompute in RECOMPUTE {
            compare(
                &format!("interleaved pp={pp} chunks={chunks} v=2 recompute {recompute:?}"),
                &pipelined(&case, pp, Kind::Interleaved, 2, recompute),
                &want,
            );
        }
    }
}

/// Per rank: (most forward graphs, most stage inputs) held during one step.
fn peaks(c: &Case, pp: usize, kind: Kind, recompute: Recompute) -> Vec<(usize, usize)> {
    let opts = options(c, pp, kind, 1, recompute);
    local::run(pp, |comm| {
        let mut p = Varuna::new(&c.model, Box::new(comm), opts.clone())?;
        p.set_optimizer(adamw)?;
        p.step(&(c.batch)(0))?;
        Ok((p.pipeline().peak_activations(), p.pipeline().peak_inputs()))
    })
    .unwrap()
}

#[test]
fn the_executor_holds_the_activations_its_schedule_promises() {
    let (pp, m) = (4, 6);
    for kind in [Kind::GPipe, Kind::OneFOneB, Kind::ZeroBubbleH1] {
        let got: Vec<usize> = peaks(&gpt_case(m), pp, kind, Recompute::Never)
            .into_iter()
            .map(|p| p.0)
            .collect();
        let want: Vec<usize> = match kind {
            Kind::GPipe => vec![m; pp],
            _ => (0..pp).map(|s| (pp - s).min(m)).collect(),
        };
        assert_eq!(got, want, "{kind}");
    }
}

#[test]
fn bad_pipeline_configurations_are_errors() {
    let case = gpt_case(2);
    let err = |opts: VarunaOptions| {
        local::run(2, |comm| {
            Varuna::new(&case.model, Box::new(comm), opts.clone()).map(|_| ())
        })
        .unwrap_err()
        .to_string()
    };
    let base = options(&case, 2, Kind::GPipe, 1, Recompute::Never);
    let e = err(VarunaOptions {
        balance: Some(vec![4, 3]),
        ..base.clone()
    });
    assert!(e.contains("sums to 7 but the model has 6 segments"), "{e}");
    let e = err(VarunaOptions {
        chunk_size: 5,
        ..base.clone()
    });
    assert!(
        e.contains("global_batch_size 12 is not divisible by dp 1 x chunk_size 5"),
        "{e}"
    );
    let e = err(VarunaOptions {
        schedule: Kind::Interleaved,
        virtual_stages: 2,
        chunk_size: 12,
        ..base
    });
    assert!(e.contains("micro-batches"), "{e}");
}

#[test]
fn always_recompute_holds_only_stage_inputs() {
    let (pp, m) = (2, 4);
    for (recompute, graphs) in [
        (Recompute::Always, vec![0, 0]),
        (Recompute::ExceptLast, vec![1, 1]),
        (Recompute::Never, vec![4, 4]),
    ] {
        let (a, i): (Vec<usize>, Vec<usize>) = peaks(&gpt_case(m), pp, Kind::GPipe, recompute)
            .into_iter()
            .unzip();
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
    use pipewright_models::tasks::Shapes;
    use pipewright_models::{cnn, CnnConfig};

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
                for kind in [Kind::GPipe, Kind::OneFOneB, Kind::ZeroBubbleH1] {
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
                    &pipelined(&c, 2, Kind::Interleaved, 2, recompute),
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
                    seed: SEED,
                    chunks,
                    clip: None,
                    schedule: LrSchedule::Constant { lr: 1e-2 },
                    tied: vec![],
                    deferred_batch_norm: deferred,
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
            &pipelined(&c, 2, Kind::GPipe, 1, Recompute::Never),
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
            (Kind::GPipe, Recompute::Never),
            (Kind::OneFOneB, Recompute::Never),
            (Kind::OneFOneB, Recompute::Always),
        ] {
            let got = pipelined(&c, 4, kind, 1, recompute);
            compare(&format!("cnn long skip {kind} {recompute:?}"), &got, &want);
        }
        assert!(want.2.contains_key("head.skip.weight"));
    }
}

mod skip_misuse {
    use super::*;
    use pipewright::model::{Activation, Cx, Layer, LayerSpec};

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
            let opts = VarunaOptions::new(Layout::new(2, 1, 1)?, 2, 2);
            let p = Varuna::new(&undeclared, Box::new(comm), opts)?;
            p.predict(&Batch::input(x.clone())).map(|_| ())
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
    use pipewright::model::{Activation, Cx, Layer, LayerSpec};
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
        let opts = VarunaOptions::new(Layout::new(2, 1, 1)?, 4, 4);
        Varuna::new(&m, Box::new(comm), opts)?
            .predict(&Batch::input(x.clone()))
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
