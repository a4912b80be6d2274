//! The Varuna step over pp x tp x dp layouts (ranks as threads) against serial training: the
//! losses and gradient norms of 5 clipped AdamW steps and the final parameters agree within
//! 1e-5; bf16 and f16 follow f32; an overflow on one rank makes every rank skip the step.

use std::collections::HashMap;

use candle_core::{Tensor, Var};
use pipewright::comm::{local, Communicator};
use pipewright::data_parallel::DistributedLoader;
use pipewright::nn::optim::{AdamW, AdamWConfig, LrSchedule, Optimizer};
use pipewright::nn::{max_rel_diff, Init};
use pipewright::precision::{LossScaler, Precision};
use pipewright::serial::{SerialTrainer, TrainOptions};
use pipewright::shard::{part, Shard};
use pipewright::topology::Layout;
use pipewright::varuna::{Placement, Varuna, VarunaOptions};
use pipewright_models::tasks::Adder;
use pipewright_models::{gpt, GptConfig, Task, TIED};

const SEED: u64 = 9;
const GLOBAL: usize = 16;
const CHUNK: usize = 2;
const STEPS: u64 = 5;

fn cfg() -> GptConfig {
    GptConfig {
        vocab_size: 16,
        block_size: 6,
        n_layer: 3,
        n_head: 4,
        n_embd: 16,
        dropout: 0.1,
    }
}

fn tied() -> Vec<(String, String)> {
    vec![(TIED.0.into(), TIED.1.into())]
}

fn adamw(params: Vec<(String, Var)>) -> pipewright::Result<Box<dyn Optimizer>> {
    Ok(Box::new(AdamW::new(params, AdamWConfig::default())?))
}

// At 1e-3 AdamW's per-element division keeps the last-bit differences of another summation
// order (tensor- and data-parallel sums) well inside 1e-5 (see tests/tensor_parallel.rs).
const LR: f64 = 1e-3;
const CLIP: f64 = 0.05;

/// Losses, gradient norms and final parameters of the serial run.
fn serial() -> (Vec<(f64, f64)>, HashMap<String, Tensor>) {
    let task = Adder::new(2, 0).unwrap();
    let stage = gpt(cfg()).unwrap().build(&Init::cpu(SEED)).unwrap();
    let opt = adamw(stage.params()).unwrap();
    let mut t = SerialTrainer::new(
        stage,
        opt,
        TrainOptions {
            seed: SEED,
            chunks: GLOBAL / CHUNK,
            clip: Some(CLIP),
            schedule: LrSchedule::Constant { lr: LR },
            tied: tied(),
            deferred_batch_norm: false,
        },
    )
    .unwrap();
    let steps = (0..STEPS)
        .map(|s| {
            let (x, y) = task.batch(s, GLOBAL).unwrap();
            let r = t.step(&x, &y).unwrap();
            (r.loss, r.grad_norm)
        })
        .collect();
    let params = t
        .model()
        .params()
        .into_iter()
        .map(|(n, v)| (n, v.as_tensor().copy().unwrap()))
        .collect();
    (steps, params)
}

fn options(layout: Layout) -> VarunaOptions {
    VarunaOptions {
        shared_weights: tied(),
        seed: SEED,
        clip: Some(CLIP),
        lr: LrSchedule::Constant { lr: LR },
        ..VarunaOptions::new(layout, GLOBAL, CHUNK)
    }
}

type RankRun = (
    Vec<(f64, f64, bool)>,
    Vec<(String, Tensor)>,
    HashMap<String, Shard>,
);

/// Every rank's (loss, norm, overflow) per step, final parameters and shards.
fn parallel(layout: Layout, opts: VarunaOptions, steps: u64) -> Vec<RankRun> {
    let task = Adder::new(2, 0).unwrap();
    local::run(layout.world(), |comm| {
        let mut v = Varuna::new(&gpt(cfg())?, Box::new(comm), opts.clone())?;
        v.set_optimizer(adamw)?;
        let c = v.coords();
        let loader = DistributedLoader::new(
            |s, n| task.batch(s, n),
            GLOBAL,
            c.dp_rank,
            layout.dp,
            candle_core::Device::Cpu,
        )?;
        let mut out = Vec::new();
        for s in 0..steps {
            let (x, y) = loader.batch(s)?;
            let o = v.step(&x, &y)?;
            out.push((o.loss, o.grad_norm, o.overflow));
        }
        let params = v
            .pipeline()
            .params()
            .iter()
            .map(|(n, p)| (n.clone(), p.as_tensor().copy().unwrap()))
            .collect();
        let shards = v.pipeline().shards().into_iter().collect();
        Ok((out, params, shards))
    })
    .unwrap()
}

#[test]
fn every_layout_trains_as_serial() {
    let (want, want_params) = serial();
    for (pp, tp, dp) in [
        (1, 1, 1),
        (2, 1, 2),
        (2, 2, 1),
        (1, 2, 2),
        (2, 2, 2),
        (4, 1, 2),
    ] {
        let layout = Layout::new(pp, tp, dp).unwrap();
        let runs = parallel(layout, options(layout), STEPS);
        let mut seen = 0;
        for (rank, (steps, params, shards)) in runs.iter().enumerate() {
            let at = format!("{layout} rank {rank}");
            for (i, ((l, n, o), (wl, wn))) in steps.iter().zip(&want).enumerate() {
                assert!(!o, "{at}: step {i} overflowed");
                assert!(
                    ((l - wl) / wl).abs() < 1e-5,
                    "{at}: step {i} loss {l} vs serial {wl}"
                );
                assert!(
                    ((n - wn) / wn).abs() < 1e-5,
                    "{at}: step {i} norm {n} vs serial {wn}"
                );
                assert!(
                    *wn > CLIP,
                    "clipping must be active for the comparison to mean anything"
                );
            }
            for (name, p) in params {
                let w = &want_params[name];
                let w = match shards.get(name) {
                    Some(s) => part(w, s.axis, s.stride, s.index, s.count).unwrap(),
                    None => w.clone(),
                };
                let d = max_rel_diff(p, &w).unwrap();
                assert!(d < 1e-5, "{at}: {name} differs by {d:e}");
                seen += 1;
            }
        }
        // Every parameter is held by tp * dp ranks (one stage's shard each).
        assert_eq!(
            seen,
            want_params.len() * tp * dp,
            "{layout}: parameters held"
        );
    }
}

#[test]
fn a_stage_to_rank_map_places_stages_anywhere() {
    // Varuna's launcher format: stage 0 on ranks 2 and 3, stage 1 on ranks 0 and 1 (dp 2).
    let (want, _) = serial();
    let opts = VarunaOptions {
        placement: Placement::StageToRankMap {
            map: "2,3;0,1;".into(),
            tp: 1,
        },
        ..options(Layout::new(2, 1, 2).unwrap())
    };
    let runs = parallel(Layout::new(2, 1, 2).unwrap(), opts, 2);
    for (rank, (steps, _, _)) in runs.iter().enumerate() {
        for (i, ((l, _, _), (wl, _))) in steps.iter().zip(&want).enumerate() {
            assert!(
                ((l - wl) / wl).abs() < 1e-5,
                "rank {rank}: step {i} loss {l} vs serial {wl}"
            );
        }
    }
    let stages = local::run(4, |comm| {
        let v = Varuna::new(
            &gpt(cfg())?,
            Box::new(comm),
            VarunaOptions {
                placement: Placement::StageToRankMap {
                    map: "2,3;0,1;".into(),
                    tp: 1,
                },
                ..options(Layout::new(2, 1, 2).unwrap())
            },
        )?;
        Ok(v.coords().stage)
    })
    .unwrap();
    assert_eq!(stages, [1, 1, 0, 0]);
}

#[test]
fn low_precision_follows_f32() {
    let layout = Layout::new(2, 1, 1).unwrap();
    let mut base = options(layout);
    base.lr = LrSchedule::Constant { lr: 3e-3 };
    base.clip = Some(1.0);
    // (losses, steps that overflowed) of 50 steps.
    let curve = |opts: VarunaOptions| -> (Vec<f64>, Vec<u64>) {
        let runs = parallel(layout, opts, 50);
        let losses = runs[0].0.iter().map(|s| s.0).collect();
        let skipped = (0..50).filter(|&i| runs[0].0[i as usize].2).collect();
        (losses, skipped)
    };
    let within = |what: &str, low: &[f64], f32: &[f64], from: usize| {
        // Mean loss of every 10 steps within 2 %.
        for w in from / 10..5 {
            let m = |c: &[f64]| c[w * 10..w * 10 + 10].iter().sum::<f64>() / 10.0;
            let (a, b) = (m(low), m(f32));
            assert!(
                ((a - b) / b).abs() < 0.02,
                "{what}: steps {}..{} mean loss {a} vs f32 {b}",
                w * 10,
                w * 10 + 10
            );
        }
    };
    let (f32, none) = curve(base.clone());
    assert!(none.is_empty());
    assert!(
        f32[49] < 0.8 * f32[0],
        "f32 must learn: {} -> {}",
        f32[0],
        f32[49]
    );
    let (bf16, none) = curve(VarunaOptions {
        precision: Precision::Bf16,
        ..base.clone()
    });
    assert!(none.is_empty(), "bf16 needs no loss scale");
    within("bf16", &bf16, &f32, 0);
    // f16 from a scale its gradients fit: no step skipped, the same curve.
    let (f16, none) = curve(VarunaOptions {
        precision: Precision::F16,
        loss_scaler: LossScaler::with(1024.0, 2000),
        ..base.clone()
    });
    assert!(none.is_empty());
    within("f16", &f16, &f32, 0);
    // From the default 2^16 the first steps overflow (the lm_head's gradient sums past f16's
    // 65504) and are skipped while the scale halves; then it trains as f32 does.
    let (f16, skipped) = curve(VarunaOptions {
        precision: Precision::F16,
        ..base.clone()
    });
    assert!(!skipped.is_empty() && skipped.len() <= 8, "{skipped:?}");
    assert_eq!(
        skipped,
        (0..skipped.len() as u64).collect::<Vec<_>>(),
        "overflows only at the start"
    );
    within("f16 from 2^16", &f16, &f32, 40);
}

#[test]
fn low_precision_computes_in_the_low_type() {
    let layout = Layout::new(1, 2, 1).unwrap();
    for p in [Precision::Bf16, Precision::F16] {
        let dtypes = local::run(2, |comm| {
            let v = Varuna::new(
                &gpt(cfg())?,
                Box::new(comm),
                VarunaOptions {
                    precision: p,
                    ..options(layout)
                },
            )?;
            let x = Adder::new(2, 0)?.batch(0, 2)?.0;
            Ok((
                v.pipeline()
                    .params()
                    .iter()
                    .map(|(_, p)| p.dtype())
                    .collect::<Vec<_>>(),
                v.pipeline().predict(&x)?.dtype(),
            ))
        })
        .unwrap();
        for (params, out) in dtypes {
            assert!(params.iter().all(|d| *d == p.dtype()), "{p}: {params:?}");
            assert_eq!(out, p.dtype());
        }
    }
}

#[test]
fn an_overflow_on_one_rank_skips_the_step_everywhere() {
    let layout = Layout::new(2, 1, 2).unwrap();
    let opts = VarunaOptions {
        precision: Precision::F16,
        loss_scaler: LossScaler::with(1024.0, 1000),
        ..options(layout)
    };
    let task = Adder::new(2, 0).unwrap();
    let runs = local::run(layout.world(), |comm| {
        let rank = comm.rank();
        let mut v = Varuna::new(&gpt(cfg())?, Box::new(comm), opts.clone())?;
        v.set_optimizer(adamw)?;
        let mut step = 0u64;
        v.set_grad_hook(move |g| {
            // Rank 3 alone finds an inf in one gradient at step 1.
            if rank == 3 && step == 1 {
                let (n, t) = g
                    .iter()
                    .next()
                    .map(|(n, t)| (n.clone(), t.clone()))
                    .unwrap();
                g.insert(n, t.affine(0.0, f64::INFINITY).unwrap());
            }
            step += 1;
        });
        let c = v.coords();
        let loader = DistributedLoader::new(
            |s, n| task.batch(s, n),
            GLOBAL,
            c.dp_rank,
            2,
            candle_core::Device::Cpu,
        )?;
        let snapshot = |v: &Varuna| -> Vec<Vec<f32>> {
            v.pipeline()
                .params()
                .iter()
                .map(|(_, p)| {
                    p.as_tensor()
                        .to_dtype(candle_core::DType::F32)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1()
                        .unwrap()
                })
                .collect()
        };
        let mut out = Vec::new();
        for s in 0..3 {
            let before = snapshot(&v);
            let (x, y) = loader.batch(s)?;
            let o = v.step(&x, &y)?;
            out.push((o.overflow, o.loss_scale, before == snapshot(&v)));
        }
        Ok((out, v.loss_scale()))
    })
    .unwrap();
    for (rank, (steps, scale)) in runs.iter().enumerate() {
        assert_eq!(
            steps[0],
            (false, 1024.0, false),
            "rank {rank}: step 0 steps"
        );
        assert_eq!(
            steps[1],
            (true, 1024.0, true),
            "rank {rank}: step 1 is skipped, parameters untouched"
        );
        assert_eq!(
            steps[2],
            (false, 512.0, false),
            "rank {rank}: step 2 runs at half the scale"
        );
        assert_eq!(*scale, 512.0);
    }
}

#[test]
fn bad_layouts_batches_and_ties_are_clear_errors() {
    let err = |world: usize, opts: VarunaOptions| -> String {
        local::run(world, |comm| {
            Ok(Varuna::new(&gpt(cfg())?, Box::new(comm), opts.clone())
                .err()
                .map(|e| e.to_string()))
        })
        .unwrap()
        .swap_remove(0)
        .expect("must fail")
    };
    let l = Layout::new(2, 1, 1).unwrap();
    let e = err(4, options(l));
    assert!(e.contains("needs 2 ranks but the world has 4"), "{e}");
    let e = err(
        2,
        VarunaOptions {
            global_batch_size: 7,
            ..options(l)
        },
    );
    assert!(
        e.contains("global batch size 7 is not divisible by dp 1 x chunk size 2"),
        "{e}"
    );
    let l2 = Layout::new(1, 1, 2).unwrap();
    let e = err(
        2,
        VarunaOptions {
            global_batch_size: 6,
            ..options(l2)
        },
    );
    assert!(e.contains("not divisible by dp 2 x chunk size 2"), "{e}");
    let e = err(
        2,
        VarunaOptions {
            shared_weights: vec![("wte.weight".into(), "lm_head.wieght".into())],
            ..options(l)
        },
    );
    assert!(e.contains("unknown tied parameter `lm_head.wieght`"), "{e}");
    let e = err(
        2,
        VarunaOptions {
            shared_weights: vec![("wte.weight".into(), "wpe.weight".into())],
            ..options(l)
        },
    );
    assert!(
        e.contains("`wte.weight` [16, 16] and `wpe.weight` [6, 16] differ in shape"),
        "{e}"
    );
}
