//! A step's time part by part: the parts `Varuna::step` times hold the time spent in them (a
//! gradient hook and an optimizer that sleep a known time land in their parts, the waits on the
//! replicas' gradient sums are counted as exposed communication and the hook's are not), and the
//! estimate's parts of rank 0 sum to its step and follow its simulation.

mod common;
#[allow(dead_code)]
#[path = "../examples/custom_model.rs"]
mod custom_model;

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{Device, Var};
use custom_model::{batch, model, CHUNK_SIZE, GLOBAL_BATCH};
use pipewright::distributed::comm::local;
use pipewright::distributed::topology::Layout;
use pipewright::engine::spec::TrainSpec;
use pipewright::engine::varuna::{Varuna, VarunaOptions};
use pipewright::model::nn::optim::{LrSchedule, Optimizer, Sgd, SgdConfig, StateDict};
use pipewright::model::nn::Grads;
use pipewright::parallel::data_parallel::{ReplicaBatches, DEFAULT_BUCKET_BYTES};
use pipewright::parallel::loss::Mse;
use pipewright::parallel::pipeline::schedule::ScheduleKind;
use pipewright::parallel::pipeline::Recompute;
use pipewright::parallel::zero::Zero;
use pipewright::plan::{estimate, Cluster, Hardware, Runtime, StepParts};
use pipewright::Result;

const HOOK: Duration = Duration::from_millis(25);
const UPDATE: Duration = Duration::from_millis(15);

/// SGD that sleeps [`UPDATE`] in each step: a known time inside the update.
struct Sleepy(Sgd);

impl Optimizer for Sleepy {
    fn step(&mut self, grads: &Grads, lr: f64) -> Result<()> {
        std::thread::sleep(UPDATE);
        self.0.step(grads, lr)
    }
    fn state_dict(&self) -> Result<StateDict> {
        self.0.state_dict()
    }
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        self.0.load_state_dict(state)
    }
    fn params(&self) -> &[(String, Var)] {
        self.0.params()
    }
}

#[test]
fn a_known_delay_lands_in_its_part_of_the_step() {
    let steps = 3;
    let runs = local::run(4, |comm| {
        let opts = VarunaOptions {
            loss: Arc::new(Mse::new("y")),
            device: Device::Cpu,
            ..VarunaOptions::of(TrainSpec {
                optim: pipewright::model::nn::optim::OptimSpec {
                    lr: LrSchedule::Constant { lr: 0.1 },
                    ..Default::default()
                },
                ..TrainSpec::new(Layout::new(2, 1, 2)?, GLOBAL_BATCH, CHUNK_SIZE, 1)
            })
        };
        let mut v = Varuna::new(&model(), Box::new(comm), opts)?;
        v.set_optimizer(|p| Ok(Box::new(Sleepy(Sgd::new(p, SgdConfig::default())?))))?;
        v.set_grad_hook(|_| std::thread::sleep(HOOK));
        let (replica, device) = (v.coords().dp_rank, v.device().clone());
        let loader = ReplicaBatches::new(batch, GLOBAL_BATCH, replica, 2, device)?;
        let mut outside = Vec::new();
        for s in 0..steps {
            let b = loader.batch(s as u64)?;
            let t = Instant::now();
            v.step(&b)?;
            outside.push(t.elapsed().as_secs_f64());
        }
        Ok((v.step_parts().to_vec(), outside))
    })
    .unwrap();
    for (rank, (parts, outside)) in runs.iter().enumerate() {
        assert_eq!(parts.len(), steps, "rank {rank}: one record per step");
        for (s, (p, whole)) in parts.iter().zip(outside).enumerate() {
            let at = format!("rank {rank}, step {s}: {p:?}");
            // The hook runs between the produced gradients and their sum, the sleep inside
            // the optimizer's step: each part holds at least its delay.
            assert!(p.gradients_s >= HOOK.as_secs_f64(), "{at}");
            assert!(p.update_s >= UPDATE.as_secs_f64(), "{at}");
            assert!(p.pipeline_s > 0.0 && p.scalars_s > 0.0, "{at}");
            // With a hook the replicas' sums run after it, in the gradients part: the time
            // waited on them lies there, the hook's sleep not counted.
            let sums = p.gradients_s - HOOK.as_secs_f64();
            assert!(p.exposed_comm_s > 0.0 && p.exposed_comm_s <= sums, "{at}");
            // The parts are laps of one clock inside the call: never more than the call.
            assert!(p.total() <= *whole, "{at}: the call took {whole}");
        }
    }
    // The median step of a rank, part by part, is one of its steps' values in each part.
    let (parts, _) = &runs[0];
    let m = StepParts::median_of(parts);
    assert!(parts.iter().any(|p| p.update_s == m.update_s));
    assert_eq!(StepParts::median_of(&[]), StepParts::default());
}

#[test]
fn the_predicted_parts_sum_to_the_step_and_follow_the_schedule() {
    let hw = Hardware::load("cpu-2core").unwrap();
    // Four layers; the last holds ten times the parameters, so stage 1's gradient sum is the
    // longer one under pp 2.
    let mut p = common::profile(4, 1e-4, 2e-4, 100_000, 100.0);
    p.layers[3].params = 1_000_000;
    for (pp, dp, zero) in [
        (1, 1, Zero::Off),
        (1, 2, Zero::Off),
        (2, 1, Zero::Off),
        (2, 2, Zero::Off),
        (2, 2, Zero::OptimizerState),
    ] {
        let cluster = Cluster::new(&hw, pp * dp, Some(1)).unwrap();
        let mut cand = common::candidate(pp, 4, 8, ScheduleKind::OneFOneB, Recompute::Never);
        cand.parallel.layout = Layout::new(pp, 1, dp).unwrap();
        cand.parallel.zero = zero;
        let (e, sim) = estimate(&p, &cluster, &cand).unwrap();
        let at = format!("pp {pp} dp {dp} {zero:?}: {:?}", e.parts);
        assert!(
            (e.parts.total() - e.step_s).abs() <= 1e-12 * e.step_s,
            "{at}"
        );
        // Rank 0's schedule ends with the simulation's (its last backward is the step's
        // last action), and it waits there for any longer update elsewhere: never shorter.
        assert!(e.parts.pipeline_s >= sim.makespan * (1.0 - 1e-12), "{at}");
        assert!(e.parts.update_s > 0.0, "{at}");
        // Scalars to sum only over more than one rank.
        assert_eq!(e.parts.scalars_s > 0.0, pp * dp > 1, "{at}");
        assert_eq!(e.parts.gradients_s == 0.0, dp == 1, "{at}");
        if pp == 1 {
            // One pipeline rank: nobody to wait for.
            assert!((e.parts.pipeline_s - sim.makespan).abs() <= 1e-12, "{at}");
        }
    }
    // pp 2 x dp 2: stage 1 sums ten times the gradients; rank 0 waits for it in the
    // scalars' all-reduce, so its scalars part outgrows pp 1's by more than the latencies.
    let parts = |pp: usize, p: &pipewright::plan::Profile| {
        let cluster = Cluster::new(&hw, pp * 2, Some(1)).unwrap();
        let mut cand = common::candidate(pp, 4, 8, ScheduleKind::OneFOneB, Recompute::Never);
        cand.parallel.layout = Layout::new(pp, 1, 2).unwrap();
        estimate(p, &cluster, &cand).unwrap().0.parts
    };
    let even = common::profile(4, 1e-4, 2e-4, 100_000, 100.0);
    let waits = parts(2, &p).scalars_s - parts(2, &even).scalars_s;
    assert!(waits > 0.0, "{waits}");
    assert!(
        parts(2, &p).gradients_s < parts(2, &p).scalars_s,
        "{:?}",
        parts(2, &p)
    );
}

/// pipewright's runtime costs its sums overlapped with the last backward only when the run
/// overlaps over an engine that moves them in the background (Open MPI's thread): then what
/// is exposed is at most the sums after the schedule, less the backward they hide behind,
/// and the step shrinks by what was hidden; ZeRO-2's reduce-scatters hide behind every
/// micro-batch's backward.
#[test]
fn the_sums_are_costed_overlapped_when_they_travel_during_the_backward() {
    let hw = Hardware::load("cpu-2core").unwrap();
    // A long backward (10 ms a row a layer) and 40 MB of gradients a layer (several buckets)
    // over two nodes.
    let p = common::profile(4, 5e-3, 1e-2, 10_000_000, 100.0);
    let mut cand = common::candidate(1, 4, 8, ScheduleKind::OneFOneB, Recompute::Never);
    cand.parallel.layout = Layout::new(1, 1, 2).unwrap();
    let costed = |runtime: Runtime, cand: &pipewright::plan::Candidate| {
        let mut cluster = Cluster::new(&hw, 2, Some(2)).unwrap();
        cluster.runtime = runtime;
        estimate(&p, &cluster, cand).unwrap().0
    };
    let after = costed(Runtime::default(), &cand);
    for (overlap, background) in [(false, true), (true, false)] {
        let e = costed(
            Runtime::pipewright(overlap, background, DEFAULT_BUCKET_BYTES),
            &cand,
        );
        assert_eq!(e.step_s, after.step_s, "{overlap} {background}");
    }
    let during = costed(Runtime::pipewright(true, true, DEFAULT_BUCKET_BYTES), &cand);
    let hidden = after.parts.gradients_s - during.parts.gradients_s;
    assert!(hidden > 0.0, "{:?} against {:?}", during.parts, after.parts);
    // At most the last micro-batch's backward (8 rows through 4 layers) hides the sums.
    assert!(hidden <= 8.0 * 4.0 * 1e-2 * (1.0 + 1e-9), "{hidden}");
    assert!((after.step_s - during.step_s - hidden).abs() < 1e-9 * after.step_s);
    assert_eq!(during.parts.exposed_comm_s, during.parts.gradients_s);
    // ZeRO-2: the 4 micro-batches' reduce-scatters hide behind their backwards, the weights'
    // all-gather after the update does not.
    cand.parallel.zero = Zero::Gradients;
    let after = costed(Runtime::default(), &cand);
    let during = costed(Runtime::pipewright(true, true, DEFAULT_BUCKET_BYTES), &cand);
    let hidden = after.parts.gradients_s - during.parts.gradients_s;
    assert!(hidden > 0.0, "{:?} against {:?}", during.parts, after.parts);
    assert!(hidden <= 4.0 * 8.0 * 4.0 * 1e-2 * (1.0 + 1e-9), "{hidden}");
    assert!((after.step_s - during.step_s - hidden).abs() < 1e-9 * after.step_s);
}

/// The overlapped sums leave bucket by bucket as the last backward finishes the layers, last
/// first, the link carrying one bucket at a time: with one layer a bucket, a link slower than
/// a layer's backward leaves exposed the four sums less the backward after the first layer's
/// (`4 s - 3 b`); a faster one only the first layer's sum, which leaves as the backward ends;
/// a bucket larger than the model leaves the step's small first bucket early, the rest at
/// the end.
#[test]
fn the_overlapped_sums_leave_bucket_by_bucket() {
    let hw = Hardware::load("cpu-2core").unwrap();
    let mut cand = common::candidate(1, 1, 8, ScheduleKind::OneFOneB, Recompute::Never);
    cand.parallel.layout = Layout::new(1, 1, 2).unwrap();
    // 4 layers of 10 M parameters (40 MB of gradients each): buckets of one layer.
    for (per_row, bucket) in [(1e-3, 40_000_000), (1e-1, 40_000_000), (1e-1, 1 << 30)] {
        let p = common::profile(4, 1e-3, per_row, 10_000_000, 100.0);
        let mut cluster = Cluster::new(&hw, 2, Some(2)).unwrap();
        cluster.runtime = Runtime::pipewright(true, true, bucket);
        let (e, sim) = estimate(&p, &cluster, &cand).unwrap();
        let last = sim.spans[0].last().unwrap();
        let layer = (last.end - last.start) / 4.0;
        let s = |bytes: f64| hw.inter_node.all_reduce(2, bytes);
        let want = match bucket {
            // The step's first bucket (1 MiB at most: the last layer's 40 MB fill it) leaves
            // at once, the other three layers' at the end.
            b if b > 160_000_000 => (s(40e6) - 3.0 * layer).max(0.0) + s(120e6),
            _ if s(40e6) > layer => 4.0 * s(40e6) - 3.0 * layer,
            _ => s(40e6),
        };
        let got = e.parts.gradients_s;
        assert!(
            (got - want).abs() < 1e-9,
            "{per_row} {bucket}: {got} against {want}"
        );
    }
}

/// `plan --explain`'s parts: the schedule's (compute, memory-bound, collectives by kind,
/// bubble) add up to the replayed schedule, and with one pipeline rank the schedule, the
/// exposed sums, the scalars and the update add up to the step; what hides behind the
/// backward is the sums costed whole less the exposed.
#[test]
fn the_explained_parts_add_up_to_the_step() {
    let hw = Hardware::load("cpu-2core").unwrap();
    let p = common::profile(4, 5e-3, 1e-2, 10_000_000, 100.0);
    let mut cand = common::candidate(1, 1, 8, ScheduleKind::OneFOneB, Recompute::Never);
    cand.parallel.layout = Layout::new(1, 1, 2).unwrap();
    for overlap in [false, true] {
        let mut cluster = Cluster::new(&hw, 2, Some(2)).unwrap();
        cluster.runtime = Runtime::pipewright(overlap, true, 40_000_000);
        let (e, sim) = estimate(&p, &cluster, &cand).unwrap();
        let x = e.explained;
        let schedule =
            x.compute_s + x.memory_s + x.tp_comm_s + x.ring_comm_s + x.all_to_all_s + x.bubble_s;
        assert!((schedule - sim.makespan).abs() < 1e-12, "{x:?}");
        let step = schedule + x.dp_exposed_s + x.scalars_s + x.update_s;
        assert!(
            (step - e.step_s).abs() < 1e-12 * e.step_s,
            "{x:?} {}",
            e.step_s
        );
        assert_eq!(x.dp_exposed_s, e.parts.gradients_s);
        let hidden = x.dp_comm_s - x.dp_exposed_s;
        assert_eq!(hidden > 0.0, overlap, "{x:?}");
    }
}
