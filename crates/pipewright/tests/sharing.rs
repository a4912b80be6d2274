//! Ranks that share a machine's cores, as the planner simulates them: turns on the cores,
//! the efficiency crowded cores keep, and tensor-parallel stages that compute while another
//! stage's ranks wait in their collectives.

use pipewright::distributed::topology::Layout;
use pipewright::parallel::pipeline::schedule::{Action, Schedule, ScheduleKind};
use pipewright::parallel::pipeline::{Recompute, Sharing};
use pipewright::plan::{estimate, Cluster, Fit, Hardware, Profile, SplitCost};

mod common;
use common::{candidate, profile};

#[test]
fn ranks_sharing_one_processor_take_turns() {
    // GPipe, 2 stages, 2 micro-batches, forward f and backward b. Alone: (m + 1)(f + b).
    // On one processor (1 slot) the two stages' overlapping actions run at half speed, and
    // nothing overlaps with idle time, so the step is all the work in a row: 2 m (f + b).
    let (f, b) = (1.0, 3.0);
    let s = Schedule::new(ScheduleKind::GPipe, 2, 2, 1).unwrap();
    let cost = |_: usize, a: &Action| match a {
        Action::Forward { .. } => f,
        _ => b,
    };
    let none = |_: usize, _: usize| 0.0;
    let full = |_: usize, _: &Action| 1.0;
    let at = |slots, crowded| Sharing {
        slots,
        crowded,
        across: 1.0,
    };
    let alone = s
        .simulate_with(&cost, &none, Sharing::ALONE, &full)
        .unwrap();
    assert_eq!(alone.makespan, 3.0 * (f + b));
    assert_eq!(
        s.simulate_with(&cost, &none, at(2.0, 0.5), &full).unwrap(),
        alone
    );
    let shared = s.simulate_with(&cost, &none, at(1.0, 1.0), &full).unwrap();
    assert_eq!(shared.makespan, 4.0 * (f + b));
    // Stage 0's second forward ran beside stage 1's first: both took 2 f.
    let second = shared.spans[0][1];
    assert_eq!((second.start, second.end), (f, 3.0 * f));
    // Crowded processors keep half their speed while both ranks are busy: those two forwards
    // take 4 f, what ran alone (the first forward) is as it was.
    let crowded = s.simulate_with(&cost, &none, at(1.0, 0.5), &full).unwrap();
    let (first, second) = (crowded.spans[0][0], crowded.spans[0][1]);
    assert_eq!(
        [first.start, first.end, second.start, second.end],
        [0.0, f, f, 5.0 * f]
    );
    assert_eq!(crowded.spans[1][0].end, 5.0 * f);
    // One pipeline rank standing for four ranks on two cores (half a slot), crowded at 0.8:
    // every action at 0.4 of full speed, so the step takes 2.5 times as long alone.
    let one = Schedule::new(ScheduleKind::OneFOneB, 1, 2, 1).unwrap();
    let alone = one
        .simulate_with(&cost, &none, Sharing::ALONE, &full)
        .unwrap();
    let dp4 = one
        .simulate_with(&cost, &none, at(0.5, 0.8), &full)
        .unwrap();
    assert!(
        (dp4.makespan - 2.5 * alone.makespan).abs() <= 1e-12,
        "{dp4:?}"
    );
}

#[test]
fn crowded_tensor_parallel_ranks_keep_fluid_sharing() {
    // A profile's crowded efficiency slows one-thread ranks crowding the cores (tests/plan.rs)
    // but not tensor-parallel ones, whose collectives' waits crowding ranks fill: tp 2 x dp 2
    // on the two cores schedules the same with an efficiency of 0.5 as with none.
    let hw = Hardware::load("cpu-2core").unwrap();
    let cluster = Cluster::new(&hw, 4, Some(1)).unwrap();
    let plain = profile(4, 1e-3, 2e-3, 1000, 100.0);
    let crowded = Profile {
        crowded_efficiency: Some(0.5),
        ..plain.clone()
    };
    let mut cand = candidate(1, 2, 4, ScheduleKind::OneFOneB, Recompute::Never);
    cand.parallel.layout = Layout::new(1, 2, 2).unwrap();
    let schedule = |p: &Profile| estimate(p, &cluster, &cand).unwrap().1.makespan;
    assert_eq!(schedule(&crowded), schedule(&plain));
}

#[test]
fn several_busy_stages_fill_each_others_waits_one_does_not() {
    let s = Sharing {
        slots: 1.0,
        crowded: 0.8,
        across: 1.5,
    };
    // Within the slots, full speed; two busy ranks on one slot: half, crowded, times across.
    assert_eq!(s.rate(1, 1.0), 1.0);
    assert!((s.rate(2, 1.0) - 0.5 * 0.8 * 1.5).abs() < 1e-12);
    // An action computing 0.6 of its time needs the cores for that share only.
    assert!((s.rate(2, 0.6) - 0.5 * 0.8 * 1.5 / 0.6).abs() < 1e-12);
    // One busy pipeline rank standing for a stage's in-step replicas gains nothing.
    let half = Sharing { slots: 0.5, ..s };
    assert!((half.rate(1, 0.5) - 0.5 * 0.8).abs() < 1e-12);
    // Never above full speed.
    let lots = Sharing { across: 4.0, ..s };
    assert_eq!(lots.rate(2, 1.0), 1.0);
}

#[test]
fn a_stage_that_waits_more_runs_faster_beside_one_that_computes() {
    // GPipe over 2 stages on one slot, forward 1 and backward 3; stage 0's second forward
    // runs beside stage 1's first. Both computing throughout: both at half speed, both end at
    // 3 (above). Stage 1 computing half its time: it needs half the slot, so it runs at full
    // speed (0.5 / 0.5) and ends at 2; stage 0 runs at half speed until then and alone after,
    // its forward's last half ending at 2.5. Swapped, the ends swap.
    let s = Schedule::new(ScheduleKind::GPipe, 2, 2, 1).unwrap();
    let cost = |_: usize, a: &Action| match a {
        Action::Forward { .. } => 1.0,
        _ => 3.0,
    };
    let none = |_: usize, _: usize| 0.0;
    let one_slot = Sharing {
        slots: 1.0,
        crowded: 1.0,
        across: 1.0,
    };
    for (waits, (end0, end1)) in [(1, (2.5, 2.0)), (0, (2.0, 2.5))] {
        let busy = |k: usize, _: &Action| if k == waits { 0.5 } else { 1.0 };
        let sim = s.simulate_with(&cost, &none, one_slot, &busy).unwrap();
        let (mine, theirs) = (sim.spans[0][1], sim.spans[1][0]);
        assert_eq!((mine.start, mine.end), (1.0, end0), "{waits}");
        assert_eq!((theirs.start, theirs.end), (1.0, end1), "{waits}");
    }
}

/// `p` with a measured tensor-parallel split at tp 2 on every layer: half its time and
/// parameters, computing `busy` of its time.
fn split_at_2(p: &Profile, busy: Option<f64>) -> Profile {
    let mut p = p.clone();
    for l in &mut p.layers {
        let half = |f: Fit| Fit {
            fixed_s: f.fixed_s / 2.0,
            per_sample_s: f.per_sample_s / 2.0,
        };
        l.split = vec![SplitCost {
            tp: 2,
            params: l.params / 2,
            forward: half(l.forward),
            backward: half(l.backward),
            backward_input: half(l.backward),
            backward_weight: half(l.backward),
            kept_bytes_per_sample: None,
            deferred_bytes_per_sample: None,
            split_kept_bytes_per_sample: None,
            transient: None,
            busy_share: busy,
        }];
    }
    p
}

#[test]
fn tensor_parallel_stages_out_of_step_compute_in_each_others_waits() {
    // pp 2 x tp 2 on the two cores: four ranks, one slot for the two stages. Ranks computing
    // half their time (the rest waiting in their collectives) fill each other's waits while
    // both stages are busy: the schedule runs as if every rank had its own core (across
    // 1 / 0.5 = 2, so two busy stages keep full speed). Measured as computing throughout,
    // or unmeasured, both stages busy share the cores: slower.
    let hw = Hardware::load("cpu-2core").unwrap();
    let roomy = Hardware {
        cores_per_device: 4,
        ..hw.clone()
    };
    let plain = profile(4, 1e-3, 2e-3, 1000, 100.0);
    let mut cand = candidate(2, 4, 4, ScheduleKind::OneFOneB, Recompute::Never);
    cand.parallel.layout = Layout::new(2, 2, 1).unwrap();
    let schedule = |p: &Profile, hw: &Hardware, cand: &pipewright::plan::Candidate| {
        let cluster = Cluster::new(hw, 4, Some(1)).unwrap();
        estimate(p, &cluster, cand).unwrap().1.makespan
    };
    let half_busy = split_at_2(&plain, Some(0.5));
    let alone = schedule(&half_busy, &roomy, &cand);
    assert!((schedule(&half_busy, &hw, &cand) - alone).abs() <= 1e-12 * alone);
    for busy in [Some(1.0), None] {
        assert!(schedule(&split_at_2(&plain, busy), &hw, &cand) > 1.2 * alone);
    }
    // tp 2 x dp 2: one stage, its replicas in step, wait together: no gain.
    cand.parallel.layout = Layout::new(1, 2, 2).unwrap();
    let full = split_at_2(&plain, Some(1.0));
    assert_eq!(
        schedule(&half_busy, &hw, &cand),
        schedule(&full, &hw, &cand)
    );
}

#[test]
fn a_profiles_busy_share_weighs_its_layers_by_time() {
    // Two layers at tp 2, the second three times as long in both passes: busy 0.2 and 0.8
    // give 0.65 in each. At tp 4, nothing measured.
    let mut p = split_at_2(&profile(2, 1e-3, 2e-3, 1000, 100.0), Some(0.2));
    let slow = &mut p.layers[1].split[0];
    slow.busy_share = Some(0.8);
    slow.forward.per_sample_s *= 3.0;
    slow.backward.per_sample_s *= 3.0;
    for share in p.busy_share(2, 8, 0..2).unwrap() {
        assert!((share - 0.65).abs() < 1e-12);
    }
    // One layer alone: its own share, in either pass.
    assert_eq!(p.busy_share(2, 8, 1..2), Some([0.8, 0.8]));
    assert_eq!(p.busy_share(4, 8, 0..2), None);
}

#[test]
fn each_stage_runs_at_its_own_busy_share() {
    // pp 2 x tp 2 on the two cores, the stages alike in work (a forward: 2 layers x 4 rows x
    // 0.5 ms at tp 2 = 4 ms): the first computing throughout its actions, the second half of
    // its time. Beside each other (one slot for two busy stages) the second needs half its
    // half and runs at full speed, every forward in 4 ms; the first at half speed while they
    // overlap. With one share for all (0.75 on every layer, the two's mean) the second's
    // forwards run beside the first's at 0.5 / 0.75 of full speed: 6 ms (a little less: part
    // of one runs alone).
    let hw = Hardware::load("cpu-2core").unwrap();
    let cluster = Cluster::new(&hw, 4, Some(1)).unwrap();
    let mut cand = candidate(2, 4, 4, ScheduleKind::OneFOneB, Recompute::Never);
    cand.parallel.layout = Layout::new(2, 2, 1).unwrap();
    let mut mixed = split_at_2(&profile(4, 1e-3, 2e-3, 1000, 100.0), Some(1.0));
    for l in &mut mixed.layers[2..] {
        l.split[0].busy_share = Some(0.5);
    }
    let forwards = |p: &Profile| {
        let (e, sim) = estimate(p, &cluster, &cand).unwrap();
        assert_eq!(e.balance, vec![2, 2]);
        let mean = |r: usize| {
            let f: Vec<f64> = sim.spans[r]
                .iter()
                .filter(|s| matches!(s.action, Action::Forward { .. }))
                .map(|s| s.end - s.start)
                .collect();
            f.iter().sum::<f64>() / f.len() as f64
        };
        (mean(0), mean(1))
    };
    let (first, second) = forwards(&mixed);
    assert!((second - 4e-3).abs() <= 1e-12, "{second}");
    assert!(first > 1.2 * second, "{first} {second}");
    let uniform = split_at_2(&profile(4, 1e-3, 2e-3, 1000, 100.0), Some(0.75));
    let (_, second) = forwards(&uniform);
    assert!(second < 6e-3 && second > 0.99 * 6e-3, "{second}");
}

#[test]
fn ranks_updating_together_share_the_cores_until_the_small_ones_end() {
    // Two slots, crowded at 0.8. Four ranks of works 1, 3, 3, 1 start together: all four at
    // 2 / 4 * 0.8 = 0.4 until the small ones end at 1 / 0.4 = 2.5; the other two, then on a
    // slot each, do their last 2 at full speed and end at 4.5. Equal works end together at
    // their work over 0.4; ranks that fit the slots end at their work.
    let s = Sharing {
        slots: 2.0,
        crowded: 0.8,
        across: 1.0,
    };
    assert_eq!(s.finish_times(&[1.0, 3.0, 3.0, 1.0]), [2.5, 4.5, 4.5, 2.5]);
    assert_eq!(s.finish_times(&[2.0; 4]), [5.0; 4]);
    assert_eq!(s.finish_times(&[2.0, 1.0]), [2.0, 1.0]);
    assert_eq!(s.finish_times(&[0.0, 0.0, 2.0]), [0.0, 0.0, 2.0]);
}

#[test]
fn a_pipeline_whose_end_stages_hold_few_weights_updates_two_ranks_on_two_cores() {
    // pp 4 on the two cores (two slots), crowded at 0.8; the optimizer takes 1 ns a parameter.
    // The step's update is the slowest rank's. Every stage holding 1e6 parameters: all four
    // update at once at 0.4 of full speed, 1 ms / 0.4 = 2.5 ms. The end stages holding 10
    // (pp 4's embedding and head stages): they end at once and the two others update on a
    // core each, 1 ms plus what the four shared at first (1.5 x the small work).
    let hw = Hardware::load("cpu-2core").unwrap();
    let cluster = Cluster::new(&hw, 4, Some(1)).unwrap();
    let cand = candidate(4, 4, 4, ScheduleKind::OneFOneB, Recompute::Never);
    let with = |params: [u64; 4], per_param: f64| {
        let mut p = profile(4, 1e-3, 2e-3, 0, 100.0);
        for (l, n) in p.layers.iter_mut().zip(params) {
            l.params = n;
        }
        p.threads = 1;
        p.crowded_efficiency = Some(0.8);
        p.optimizer = Some(Fit {
            fixed_s: 0.0,
            per_sample_s: per_param,
        });
        estimate(&p, &cluster, &cand).unwrap().0.step_s
    };
    let update = |params| with(params, 1e-9) - with(params, 0.0);
    let even = update([1_000_000; 4]);
    assert!((even - 2.5e-3).abs() < 1e-12, "{even}");
    let ends = update([10, 1_000_000, 1_000_000, 10]);
    let expected = 1e-3 + 1.5 * 10e-9;
    assert!((ends - expected).abs() < 1e-12, "{ends} against {expected}");
}
