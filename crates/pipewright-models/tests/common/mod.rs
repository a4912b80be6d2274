//! Shared by the pipeline parity tests: one training run made serially (the oracle) and
//! through `Varuna` with pp-only layouts, and their comparison.
#![allow(dead_code)]

use std::sync::{Arc, Mutex};

use candle_core::Tensor;
use pipewright::distributed::comm::local;
use pipewright::distributed::topology::Layout;
use pipewright::engine::serial::{SerialTrainer, TrainOptions};
use pipewright::engine::spec::TrainSpec;
use pipewright::engine::varuna::{Varuna, VarunaOptions};
use pipewright::model::nn::max_rel_diff;
use pipewright::model::nn::optim::OptimSpec;
use pipewright::model::nn::optim::{AdamW, AdamWConfig, LrSchedule, Optimizer};
use pipewright::parallel::loss::CrossEntropy;
use pipewright::parallel::pipeline::schedule::ScheduleKind;
use pipewright::parallel::pipeline::PipelineSpec;
use pipewright::parallel::pipeline::Recompute;
use pipewright::{Batch, Build, Sequential};
use pipewright_models::tasks::Adder;
use pipewright_models::{gpt, GptConfig, Task, TIED};
use std::collections::HashMap;

pub const SEED: u64 = 3;
pub const BATCH: usize = 12;

pub fn cfg() -> GptConfig {
    GptConfig {
        vocab_size: 10,
        block_size: 6,
        n_layer: 4,
        n_head: 2,
        n_embd: 16,
        dropout: 0.1,
    }
}

pub fn adamw(params: Vec<(String, candle_core::Var)>) -> pipewright::Result<Box<dyn Optimizer>> {
    Ok(Box::new(AdamW::new(params, AdamWConfig::default())?))
}

pub fn tied() -> Vec<(String, String)> {
    vec![(TIED.0.into(), TIED.1.into())]
}

/// (losses of 3 AdamW steps, then the sum of the evaluation output; step-0 gradients;
/// final parameters and buffers).
pub type Run = (Vec<f64>, HashMap<String, Tensor>, HashMap<String, Tensor>);

/// One training run both sides make.
#[derive(Clone)]
pub struct Case {
    pub model: Sequential,
    pub batch: fn(u64) -> Batch,
    pub tied: Vec<(String, String)>,
    pub clip: Option<f64>,
    pub chunks: usize,
    pub deferred: bool,
}

pub fn adder_batch(s: u64) -> Batch {
    let (x, y) = Adder::new(2, 0).unwrap().batch(s, BATCH).unwrap();
    Batch::pair(x, y)
}

pub fn gpt_case(chunks: usize) -> Case {
    Case {
        model: gpt(cfg()).unwrap(),
        batch: adder_batch,
        tied: tied(),
        clip: Some(0.5),
        chunks,
        deferred: false,
    }
}

pub fn serial(c: &Case) -> Run {
    let trainer = || {
        let stage = c.model.build(&Build::cpu(SEED)).unwrap();
        let opt = adamw(stage.params()).unwrap();
        SerialTrainer::new(
            stage,
            opt,
            TrainOptions {
                spec: TrainSpec {
                    seed: SEED,
                    optim: OptimSpec {
                        clip: c.clip,
                        lr: LrSchedule::Constant { lr: 1e-2 },
                        ..Default::default()
                    },
                    pipeline: PipelineSpec {
                        deferred_batch_norm: c.deferred,
                        ..Default::default()
                    },
                    ..TrainSpec::serial()
                },
                micro_batches: c.chunks,
                tied: c.tied.clone(),
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
pub fn options(
    c: &Case,
    pp: usize,
    kind: ScheduleKind,
    v: usize,
    recompute: Recompute,
) -> VarunaOptions {
    VarunaOptions {
        shared_weights: c.tied.clone(),
        ..VarunaOptions::of(TrainSpec {
            seed: SEED,
            pipeline: pipewright::parallel::pipeline::PipelineSpec {
                schedule: pipewright::parallel::pipeline::ScheduleChoice {
                    kind,
                    virtual_stages: v,
                    recompute,
                },
                deferred_batch_norm: c.deferred,
                ..Default::default()
            },
            optim: pipewright::model::nn::optim::OptimSpec {
                clip: c.clip,
                lr: LrSchedule::Constant { lr: 1e-2 },
                ..Default::default()
            },
            ..TrainSpec::new(Layout::new(pp, 1, 1).unwrap(), BATCH, BATCH / c.chunks, 1)
        })
    }
}

pub fn pipelined(c: &Case, pp: usize, kind: ScheduleKind, v: usize, recompute: Recompute) -> Run {
    pipelined_with(c, pp, options(c, pp, kind, v, recompute))
}

/// Trains `c` for three steps over `pp` pipeline ranks with `opts`.
pub fn pipelined_with(c: &Case, pp: usize, opts: VarunaOptions) -> Run {
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

pub fn compare(what: &str, got: &Run, want: &Run) {
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

pub const RECOMPUTE: [Recompute; 3] = [Recompute::Never, Recompute::ExceptLast, Recompute::Always];

/// Relative difference (see [`max_rel_diff`]) as f32, for assertions.
pub fn rel_diff(a: &Tensor, b: &Tensor) -> f32 {
    max_rel_diff(a, b).unwrap() as f32
}
