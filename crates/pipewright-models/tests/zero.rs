//! ZeRO-1, 2 and 3 ([`pipewright::parallel::zero`]) against serial training: every stage at dp 2 with
//! pipeline and tensor parallelism, under 1F1B, zero-bubble and interleaved schedules and
//! recomputation, gives the serial run's losses, gradient norms (clipping acts) and final
//! parameters within 1e-5, with tied weights and weight decay; an overflow on one rank skips
//! the step everywhere; each replica holds 1/dp of the optimizer state (and under ZeRO-3 none
//! of the model's weights between uses); a ZeRO run resumes bit for bit at its layout, and its
//! checkpoint resumes under any other stage and dp (and a plain run's under ZeRO) within 1e-5.

use pipewright::distributed::comm::local;
use pipewright::distributed::topology::Layout;
use pipewright::engine::varuna::{Varuna, VarunaOptions};
use pipewright::model::nn::optim::{AdamW, AdamWConfig};
use pipewright::model::precision::Precision;
use pipewright::parallel::data_parallel::ReplicaBatches;
use pipewright::parallel::pipeline::{Recompute, ScheduleKind};
use pipewright::parallel::zero::Zero;
use pipewright::Batch;
use pipewright_models::parity::{worst_difference, ParityRun, RankResult};
use pipewright_models::tasks::Adder;
use pipewright_models::{gpt, Task};

mod resume;
use resume::{SAVE_AT, STEPS};

fn parallel(run: &ParityRun, opts: VarunaOptions) -> Vec<RankResult> {
    let world = opts.topology().unwrap().layout().world();
    local::run(world, |comm| run.rank(Box::new(comm), opts.clone())).unwrap()
}

#[test]
fn every_zero_stage_trains_as_serial() {
    let run = ParityRun::default();
    let want = run.serial().unwrap();
    for zero in [Zero::OptimizerState, Zero::Gradients, Zero::Parameters] {
        for (pp, tp, dp) in [(1, 1, 2), (2, 1, 2), (1, 2, 2), (1, 1, 4), (2, 2, 2)] {
            let layout = Layout::new(pp, tp, dp).unwrap();
            let opts = run.options(layout).with_spec(|s| {
                s.parallel.zero = zero;
                s.overlap.bucket_bytes = 4096;
            });
            for (rank, got) in parallel(&run, opts).iter().enumerate() {
                let worst = worst_difference(got, &want).unwrap();
                assert!(
                    worst < 1e-5,
                    "ZeRO-{zero} {layout} rank {rank}: off by {worst:e}"
                );
            }
        }
    }
}

#[test]
fn zero_two_and_three_keep_working_under_every_schedule_and_recomputation() {
    let run = ParityRun {
        steps: 3,
        ..ParityRun::default()
    };
    let want = run.serial().unwrap();
    let layout = Layout::new(2, 1, 2).unwrap();
    for (zero, schedule, virtual_stages, recompute) in [
        (
            Zero::Gradients,
            ScheduleKind::ZeroBubbleH1,
            1,
            Recompute::Never,
        ),
        (Zero::Gradients, ScheduleKind::GPipe, 1, Recompute::Always),
        (
            Zero::Gradients,
            ScheduleKind::Interleaved,
            2,
            Recompute::ExceptLast,
        ),
        (
            Zero::Parameters,
            ScheduleKind::ZeroBubbleH1,
            1,
            Recompute::Never,
        ),
        (Zero::Parameters, ScheduleKind::GPipe, 1, Recompute::Always),
        (
            Zero::Parameters,
            ScheduleKind::Interleaved,
            2,
            Recompute::ExceptLast,
        ),
    ] {
        let opts = run.options(layout).with_spec(|s| {
            s.parallel.zero = zero;
            s.pipeline.schedule.kind = schedule;
            s.pipeline.schedule.virtual_stages = virtual_stages;
            s.pipeline.schedule.recompute = recompute;
            s.overlap.bucket_bytes = 4096;
        });
        for (rank, got) in parallel(&run, opts).iter().enumerate() {
            let worst = worst_difference(got, &want).unwrap();
            assert!(
                worst < 1e-5,
                "ZeRO-{zero} {schedule:?} {recompute} rank {rank}: off by {worst:e}"
            );
        }
    }
}

#[test]
fn zero_stages_parse_and_one_replica_runs_without() {
    assert_eq!("2".parse::<Zero>().unwrap(), Zero::Gradients);
    assert_eq!("3".parse::<Zero>().unwrap(), Zero::Parameters);
    for bad in ["4", "x"] {
        let e = bad.parse::<Zero>().unwrap_err().to_string();
        assert!(e.contains("use 0, 1, 2 or 3"), "{e}");
    }
    let run = ParityRun::default();
    let opts = run
        .options(Layout::new(2, 1, 1).unwrap())
        .with_spec(|s| s.parallel.zero = Zero::Parameters);
    let zero = local::run(2, |comm| {
        Ok(Varuna::new(&gpt(run.gpt)?, Box::new(comm), opts.clone())?.zero())
    })
    .unwrap();
    assert_eq!(zero, [Zero::Off, Zero::Off]);
}

#[test]
fn each_replica_keeps_its_share_of_the_optimizer_state() {
    let run = ParityRun::default();
    let task = Adder::new(2, 0).unwrap();
    for (zero, dp) in [
        (Zero::Off, 2),
        (Zero::OptimizerState, 2),
        (Zero::Gradients, 4),
        (Zero::Parameters, 2),
    ] {
        let opts = run
            .options(Layout::new(1, 1, dp).unwrap())
            .with_spec(|s| s.parallel.zero = zero);
        // (optimizer-state elements, parameter elements, weight elements the model's own
        // variables hold) of each rank after one step.
        let held = local::run(dp, |comm| {
            let mut v = Varuna::new(&gpt(run.gpt)?, Box::new(comm), opts.clone())?;
            v.set_optimizer(|p| Ok(Box::new(AdamW::new(p, AdamWConfig::default())?)))?;
            let loader = ReplicaBatches::new(
                |s, n| task.batch(s, n).map(|(x, y)| Batch::pair(x, y)),
                run.global_batch,
                v.coords().dp_rank,
                dp,
                candle_core::Device::Cpu,
            )?;
            v.step(&loader.batch(0)?)?;
            let state = v.optimizer().unwrap().state_dict()?;
            let moments: usize = state
                .iter()
                .filter(|(k, _)| k.ends_with(".exp_avg"))
                .map(|(_, t)| t.elem_count())
                .sum();
            let params: usize = v
                .pipeline()
                .params()
                .iter()
                .map(|(_, p)| p.elem_count())
                .sum();
            let held: usize = v.pipeline().params().iter().map(|(_, p)| held(p)).sum();
            Ok((moments, params, held))
        })
        .unwrap();
        for h in &held {
            let want = if zero == Zero::Parameters { 0 } else { h.1 };
            assert_eq!(h.2, want, "ZeRO-{zero}: weight elements held between steps");
        }
        let params = held[0].1;
        let total: usize = held.iter().map(|h| h.0).sum();
        if zero == Zero::Off {
            assert!(held.iter().all(|h| h.0 == params), "{held:?}");
        } else {
            // Every element once over the replicas, 1/dp on each (up to one element of padding
            // per bucket).
            assert_eq!(total, params, "ZeRO-{zero} dp {dp}: {held:?}");
            for h in &held {
                assert!(
                    h.0.abs_diff(params / dp) <= 1,
                    "ZeRO-{zero} dp {dp}: {held:?}"
                );
            }
        }
    }
}

/// The elements `v`'s storage holds now (ZeRO-3 empties a layer's between its uses).
fn held(v: &candle_core::Var) -> usize {
    match &*v.storage_and_layout().0 {
        candle_core::Storage::Cpu(candle_core::CpuStorage::F32(s)) => s.len(),
        _ => unreachable!("the parity GPT is f32 on the CPU"),
    }
}

fn zero_options(l: (usize, usize, usize), zero: Zero, precision: Precision) -> VarunaOptions {
    resume::options(Layout::new(l.0, l.1, l.2).unwrap(), precision).with_spec(|s| {
        s.parallel.zero = zero;
        s.overlap.bucket_bytes = 4096;
    })
}

#[test]
fn a_zero_run_resumes_bit_for_bit_at_its_layout() {
    for (i, (l, zero, precision)) in [
        ((1, 1, 2), Zero::Gradients, Precision::F32),
        ((2, 1, 2), Zero::OptimizerState, Precision::F16),
        ((1, 2, 2), Zero::Gradients, Precision::Bf16),
        ((2, 1, 2), Zero::Parameters, Precision::Bf16),
    ]
    .into_iter()
    .enumerate()
    {
        let opts = zero_options(l, zero, precision);
        let root = resume::tmp(&format!("zero-same-{i}"));
        let whole = resume::run(resume::cfg(0.1), opts.clone(), 0, STEPS, None, Some(&root));
        let resumed = resume::run(resume::cfg(0.1), opts, SAVE_AT, STEPS, Some(&root), None);
        let what = format!("{l:?} ZeRO-{zero} {precision}");
        assert_eq!(resumed.losses, whole.losses[SAVE_AT as usize..], "{what}");
        assert_eq!(resumed.state, whole.state, "{what}: final state");
        assert_eq!(resumed.scale, whole.scale, "{what}: loss scale");
        let _ = std::fs::remove_dir_all(root);
    }
}

#[test]
fn zero_checkpoints_resume_under_any_stage_and_dp() {
    let within = |what: &str, got: &[f64], want: &[f64]| {
        assert_eq!(got.len(), want.len(), "{what}");
        for (a, b) in got.iter().zip(want) {
            assert!(((a - b) / b).abs() < 1e-5, "{what}: {got:?} vs {want:?}");
        }
    };
    let f32 = Precision::F32;
    // Saved sharded over 4 replicas, resumed over 2 with ZeRO-1 and whole; and the reverse.
    for (from, to) in [
        (
            ((1, 1, 4), Zero::Parameters),
            vec![
                ((1, 1, 2), Zero::OptimizerState),
                ((2, 1, 1), Zero::Off),
                ((1, 1, 2), Zero::Gradients),
            ],
        ),
        (
            ((2, 1, 1), Zero::Off),
            vec![
                ((1, 1, 4), Zero::Parameters),
                ((1, 2, 2), Zero::OptimizerState),
            ],
        ),
    ] {
        let root = resume::tmp(&format!("zero-cross-{}", from.1));
        let whole = resume::run(
            resume::cfg(0.0),
            zero_options(from.0, from.1, f32),
            0,
            STEPS,
            None,
            Some(&root),
        );
        for (l, zero) in to {
            let got = resume::run(
                resume::cfg(0.0),
                zero_options(l, zero, f32),
                SAVE_AT,
                STEPS,
                Some(&root),
                None,
            );
            let what = format!("{:?} ZeRO-{} -> {l:?} ZeRO-{zero}", from.0, from.1);
            within(&what, &got.losses, &whole.losses[SAVE_AT as usize..]);
        }
        let _ = std::fs::remove_dir_all(root);
    }
}
