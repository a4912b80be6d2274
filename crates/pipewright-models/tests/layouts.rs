//! The Varuna step over pp x tp x dp layouts (ranks as threads) against serial training
//! ([`pipewright_models::parity`]): the losses and gradient norms of 5 clipped AdamW steps and
//! the final parameters agree within 1e-5; bf16 and f16 follow f32; an overflow on one rank
//! makes every rank skip the step (with and without ZeRO).

use candle_core::Var;
use pipewright::distributed::comm::{local, Communicator};
use pipewright::distributed::topology::Layout;
use pipewright::engine::spec::Balance;
use pipewright::engine::varuna::{Varuna, VarunaOptions};
use pipewright::model::nn::optim::{AdamW, AdamWConfig, LrSchedule, Optimizer};
use pipewright::model::precision::{LossScaler, Precision};
use pipewright::parallel::data_parallel::ReplicaBatches;
use pipewright::parallel::zero::Zero;
use pipewright::{Batch, Build};
use pipewright_models::parity::{worst_difference, ParityRun, RankResult};
use pipewright_models::tasks::Adder;
use pipewright_models::{gpt, GptConfig, Task};

const GLOBAL: usize = 16;

fn cfg() -> GptConfig {
    ParityRun::default().gpt
}

fn adamw(params: Vec<(String, Var)>) -> pipewright::Result<Box<dyn Optimizer>> {
    Ok(Box::new(AdamW::new(params, AdamWConfig::default())?))
}

fn options(layout: Layout) -> VarunaOptions {
    ParityRun::default().options(layout)
}

/// Every rank's result of `run` with `opts` on local threads.
fn parallel(run: &ParityRun, world: usize, opts: VarunaOptions) -> Vec<RankResult> {
    local::run(world, |comm| run.rank(Box::new(comm), opts.clone())).unwrap()
}

#[test]
fn every_layout_trains_as_serial() {
    let run = ParityRun::default();
    let want = run.serial().unwrap();
    for (pp, tp, dp) in [
        (1, 1, 1),
        (2, 1, 2),
        (2, 2, 1),
        (1, 2, 2),
        (2, 2, 2),
        (4, 1, 2),
    ] {
        let layout = Layout::new(pp, tp, dp).unwrap();
        let ranks = parallel(&run, layout.world(), run.options(layout));
        let mut held = 0;
        for (rank, got) in ranks.iter().enumerate() {
            let worst = worst_difference(got, &want).unwrap();
            assert!(worst < 1e-5, "{layout} rank {rank}: off by {worst:e}");
            assert!(
                got.steps
                    .iter()
                    .zip(&want.steps)
                    .all(|(g, w)| w.1 > run.clip && g.1 > run.clip),
                "clipping must act"
            );
            held += got.params.len();
        }
        // Every parameter is held by tp * dp ranks (one stage's shard each).
        assert_eq!(
            held,
            want.params.len() * tp * dp,
            "{layout}: parameters held"
        );
    }
}

#[test]
fn a_stage_to_rank_map_places_stages_anywhere() {
    // Varuna's launcher format: stage 0 on ranks 2 and 3, stage 1 on ranks 0 and 1 (dp 2).
    let run = ParityRun {
        steps: 2,
        ..ParityRun::default()
    };
    let want = run.serial().unwrap();
    let opts = VarunaOptions {
        stage_to_rank_map: Some("2,3;0,1;".into()),
        ..run.options(Layout::new(2, 1, 2).unwrap())
    };
    for (rank, got) in parallel(&run, 4, opts.clone()).iter().enumerate() {
        let worst = worst_difference(got, &want).unwrap();
        assert!(worst < 1e-5, "rank {rank}: off by {worst:e}");
    }
    let stages = local::run(4, |comm| {
        Ok(Varuna::new(&gpt(cfg())?, Box::new(comm), opts.clone())?
            .coords()
            .stage)
    })
    .unwrap();
    assert_eq!(stages, [1, 1, 0, 0]);
}

/// The step's placement and balance come from the spec it holds: a stage-to-rank map of
/// another layout, or a balance still to be measured, is refused before anything is built.
#[test]
fn a_map_or_balance_the_spec_does_not_describe_is_refused() {
    let opts = VarunaOptions {
        stage_to_rank_map: Some("0,1;2,3;".into()),
        ..options(Layout::new(4, 1, 1).unwrap())
    };
    let e = opts
        .validate(&gpt(cfg()).unwrap(), 4)
        .expect_err("a map of pp 2 x dp 2 does not place pp 4");
    assert!(
        e.to_string().contains("stage-to-rank map `0,1;2,3;`"),
        "{e}"
    );
    let opts = options(Layout::new(2, 1, 1).unwrap())
        .with_spec(|s| s.pipeline.balance = Some(Balance::Time));
    let e = opts.validate(&gpt(cfg()).unwrap(), 2).unwrap_err();
    assert!(
        e.to_string().contains("resolve it into layers per stage"),
        "{e}"
    );
}

#[test]
fn low_precision_follows_f32() {
    let layout = Layout::new(2, 1, 1).unwrap();
    let mut base = options(layout);
    base.spec.optim.lr = LrSchedule::Constant { lr: 3e-3 };
    base.spec.optim.clip = Some(1.0);
    let run = ParityRun {
        steps: 50,
        ..ParityRun::default()
    };
    // (losses, steps that overflowed) of 50 steps.
    let curve = |opts: VarunaOptions| -> (Vec<f64>, Vec<u64>) {
        let ranks = parallel(&run, layout.world(), opts);
        let losses = ranks[0].steps.iter().map(|s| s.0).collect();
        let skipped = (0..50).filter(|&i| ranks[0].steps[i as usize].2).collect();
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
    let (bf16, none) = curve(base.clone().with_spec(|s| s.precision = Precision::Bf16));
    assert!(none.is_empty(), "bf16 needs no loss scale");
    within("bf16", &bf16, &f32, 0);
    // f16 from a scale its gradients fit: no step skipped, the same curve.
    let (f16, none) = curve(VarunaOptions {
        loss_scaler: LossScaler::with(1024.0, 2000),
        ..base.clone().with_spec(|s| s.precision = Precision::F16)
    });
    assert!(none.is_empty());
    within("f16", &f16, &f32, 0);
    // From 2^20 the first step overflows (the lm_head's gradient past f16's 65504) and is
    // skipped while the scale halves, as are the few later ones whose gradients outgrow the
    // scale (the micro-batches' sum is f32, as PyTorch's f32 parameters hold it, so only a
    // micro-batch's own gradient overflows); then it trains as f32 does. (From the default
    // 2^16 nothing overflows: the fused kernels sum in f32 and round once, as PyTorch's do.)
    let (f16, skipped) = curve(VarunaOptions {
        loss_scaler: LossScaler::with(1048576.0, 2000),
        ..base.clone().with_spec(|s| s.precision = Precision::F16)
    });
    assert!(!skipped.is_empty() && skipped.len() <= 8, "{skipped:?}");
    assert_eq!(skipped[0], 0, "the start overflows: {skipped:?}");
    assert!(
        skipped.iter().all(|&s| s < 40),
        "overflows early only: {skipped:?}"
    );
    within("f16 from 2^20", &f16, &f32, 40);
}

#[test]
fn low_precision_computes_in_the_low_type() {
    let layout = Layout::new(1, 2, 1).unwrap();
    for p in [Precision::Bf16, Precision::F16] {
        let dtypes = local::run(2, |comm| {
            let v = Varuna::new(
                &gpt(cfg())?,
                Box::new(comm),
                options(layout).with_spec(|s| s.precision = p),
            )?;
            let x = Adder::new(2, 0)?.batch(0, 2)?.0;
            // The stage a rank builds computes in the low type; what predict hands back is f32.
            let init = pipewright::model::nn::Init::new(candle_core::Device::Cpu, p.dtype(), 0);
            let stage = gpt(cfg())?.build(&Build::new(init))?;
            let out = stage
                .forward(x.clone().into(), &mut pipewright::Cx::eval())?
                .into_tensor("out")?;
            assert_eq!(
                v.predict(&Batch::input(x))?.dtype(),
                candle_core::DType::F32
            );
            Ok((
                v.pipeline()
                    .params()
                    .iter()
                    .map(|(_, p)| p.dtype())
                    .collect::<Vec<_>>(),
                out.dtype(),
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
    // Under ZeRO-2 and 3 rank 3 finds it in its piece of the summed gradients.
    for zero in [
        Zero::Off,
        Zero::OptimizerState,
        Zero::Gradients,
        Zero::Parameters,
    ] {
        overflow_skips_everywhere(zero);
    }
}

fn overflow_skips_everywhere(zero: Zero) {
    let layout = Layout::new(2, 1, 2).unwrap();
    let opts = VarunaOptions {
        loss_scaler: LossScaler::with(1024.0, 1000),
        ..options(layout).with_spec(|s| {
            s.parallel.zero = zero;
            s.precision = Precision::F16;
        })
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
        let loader = ReplicaBatches::new(
            |s, n| task.batch(s, n).map(|(x, y)| Batch::pair(x, y)),
            GLOBAL,
            c.dp_rank,
            2,
            candle_core::Device::Cpu,
        )?;
        let snapshot = |v: &Varuna| -> Vec<Vec<f32>> {
            v.parameters()
                .unwrap()
                .iter()
                .map(|(_, p)| {
                    p.to_dtype(candle_core::DType::F32)
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
            let o = v.step(&loader.batch(s)?)?;
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
            "ZeRO-{zero} rank {rank}: step 1 is skipped, parameters untouched"
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
    let e = err(2, options(l).with_spec(|s| s.batch.global_batch = 7));
    assert!(
        e.contains("a global batch of 7 rows does not split into 1 data-parallel replicas of micro-batches of 2 rows"),
        "{e}"
    );
    let l2 = Layout::new(1, 1, 2).unwrap();
    let e = err(2, options(l2).with_spec(|s| s.batch.global_batch = 6));
    assert!(e.contains("does not split into 2 data-parallel replicas of micro-batches of 2 rows: choose a batch that is a positive multiple of 4"), "{e}");
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
