//! Schedules: complete and deadlock-free for every size, with the bubbles and activation
//! counts their papers give; hand-broken lists are rejected.

use pipewright::model::{LayerSpec, Sequential};
use pipewright::parallel::pipeline::partition::{partition, uniform_balance};
use pipewright::parallel::pipeline::schedule::{Action, Schedule, ScheduleKind};
use pipewright::parallel::pipeline::timeline::held;

#[test]
fn every_schedule_is_complete_and_deadlock_free() {
    for p in 1..=8 {
        for m in 1..=16 {
            for kind in [
                ScheduleKind::GPipe,
                ScheduleKind::OneFOneB,
                ScheduleKind::ZeroBubbleH1,
            ] {
                let s = Schedule::new(kind, p, m, 1).unwrap();
                s.validate()
                    .unwrap_or_else(|e| panic!("{kind} p={p} m={m}: {e}"));
            }
            for v in 1..=3 {
                match Schedule::new(ScheduleKind::Interleaved, p, m, v) {
                    Ok(s) => {
                        s.validate()
                            .unwrap_or_else(|e| panic!("interleaved p={p} m={m} v={v}: {e}"));
                    }
                    Err(e) => {
                        assert!(v > 1 && m % p != 0, "p={p} m={m} v={v}: {e}");
                        assert!(e.to_string().contains("must be a multiple of pp"), "{e}");
                    }
                }
            }
        }
    }
}

#[test]
fn bubbles_match_the_closed_forms() {
    for p in 1..=8 {
        for m in 1..=16 {
            // F = 1, B = 2: every stage is busy 3m of (m + p - 1) * 3.
            let want = (p - 1) as f64 / (m + p - 1) as f64;
            for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
                let sim = Schedule::new(kind, p, m, 1).unwrap().validate().unwrap();
                assert!(
                    (sim.bubble - want).abs() < 1e-12,
                    "{kind} p={p} m={m}: {} vs {want}",
                    sim.bubble
                );
            }
            if p > 1 && m >= p {
                let one = Schedule::new(ScheduleKind::OneFOneB, p, m, 1)
                    .unwrap()
                    .validate()
                    .unwrap();
                let zb = Schedule::new(ScheduleKind::ZeroBubbleH1, p, m, 1)
                    .unwrap()
                    .validate()
                    .unwrap();
                assert!(
                    zb.bubble < one.bubble,
                    "zb1 p={p} m={m}: {} vs 1f1b {}",
                    zb.bubble,
                    one.bubble
                );
                if m % p == 0 {
                    let il = Schedule::new(ScheduleKind::Interleaved, p, m, 2)
                        .unwrap()
                        .validate()
                        .unwrap();
                    assert!(
                        il.bubble < one.bubble,
                        "interleaved p={p} m={m}: {} vs {}",
                        il.bubble,
                        one.bubble
                    );
                }
            }
        }
    }
}

#[test]
fn activations_in_flight() {
    for p in 1..=8 {
        for m in 1..=16 {
            let g = Schedule::new(ScheduleKind::GPipe, p, m, 1)
                .unwrap()
                .validate()
                .unwrap();
            assert!(
                g.peak_in_flight.iter().all(|&n| n == m),
                "gpipe holds all m"
            );
            let o = Schedule::new(ScheduleKind::OneFOneB, p, m, 1)
                .unwrap()
                .validate()
                .unwrap();
            for (s, &n) in o.peak_in_flight.iter().enumerate() {
                assert_eq!(n, (p - s).min(m), "1f1b p={p} m={m} stage {s}");
            }
            // ZB-H1 holds activations until the weight gradient, and still no more than 1F1B.
            let z = Schedule::new(ScheduleKind::ZeroBubbleH1, p, m, 1)
                .unwrap()
                .validate()
                .unwrap();
            assert_eq!(z.peak_in_flight, o.peak_in_flight, "zb1 p={p} m={m}");
            // A whole backward frees its micro-batch at once: nothing waits for a weight pass.
            let one = Schedule::new(ScheduleKind::OneFOneB, p, m, 1).unwrap();
            assert!(held(&one).iter().flatten().all(|h| h.queues == 0));
        }
    }
}

#[test]
fn what_a_split_backward_holds_as_each_action_starts() {
    // pipewright schedule --pp 2 --chunks 4 --schedule zb1, rank 0:
    // 0F0 0F1 0I0 0W0 0F2 0I1 0W1 0F3 0I2 0W2 0I3 0W3, counted by hand.
    let s = Schedule::new(ScheduleKind::ZeroBubbleH1, 2, 4, 1).unwrap();
    let rank0: Vec<(usize, usize)> = held(&s)[0].iter().map(|h| (h.graphs, h.queues)).collect();
    assert_eq!(
        rank0,
        [
            (0, 0),
            (1, 0),
            (2, 0),
            (1, 1),
            (1, 0),
            (2, 0),
            (1, 1),
            (1, 0),
            (2, 0),
            (1, 1),
            (1, 0),
            (0, 1)
        ]
    );
    // Every input pass finds its graph, every weight pass its queue.
    for p in 1..=6 {
        for m in 1..=12 {
            let s = Schedule::new(ScheduleKind::ZeroBubbleH1, p, m, 1).unwrap();
            for (list, h) in s.actions.iter().zip(held(&s)) {
                for (a, h) in list.iter().zip(h) {
                    match a {
                        Action::BackwardInput { .. } => assert!(h.graphs >= 1, "p={p} m={m} {a}"),
                        Action::BackwardWeight { .. } => assert!(h.queues >= 1, "p={p} m={m} {a}"),
                        _ => {}
                    }
                }
            }
        }
    }
}

#[test]
fn the_validator_rejects_hand_broken_schedules() {
    let good = Schedule::new(ScheduleKind::OneFOneB, 2, 2, 1).unwrap();
    let f = |stage, mb| Action::Forward { mb, stage };
    let b = |stage, mb| Action::Backward { mb, stage };
    // Rank 1 waits for micro-batch 1 first while rank 0 waits for the gradient of 0.
    let mut s = good.clone();
    s.actions[0] = vec![f(0, 0), b(0, 0), f(0, 1), b(0, 1)];
    s.actions[1] = vec![f(1, 1), f(1, 0), b(1, 0), b(1, 1)];
    let e = s.validate().unwrap_err().to_string();
    assert!(
        e.contains("deadlocks") && e.contains("rank 1 at 1F1 waits for forward of micro-batch 1"),
        "{e}"
    );
    // A backward before its own forward.
    let mut s = good.clone();
    s.actions[1] = vec![b(1, 0), f(1, 0), f(1, 1), b(1, 1)];
    assert!(s.validate().unwrap_err().to_string().contains("deadlocks"));
    // Missing and duplicated actions.
    let mut s = good.clone();
    s.actions[0].pop();
    assert!(s
        .validate()
        .unwrap_err()
        .to_string()
        .contains("micro-batch 1 on stage 0 needs one backward (0B1)"));
    let mut s = good.clone();
    s.actions[0].push(f(0, 0));
    assert!(s
        .validate()
        .unwrap_err()
        .to_string()
        .contains("appears 2 times"));
    let mut s = good.clone();
    s.actions[1].push(f(1, 7));
    assert!(s.validate().unwrap_err().to_string().contains("outside"));
    // A stage on two ranks.
    let mut s = good;
    s.actions[1].push(f(0, 1));
    let e = s.validate().unwrap_err().to_string();
    assert!(e.contains("stage 0 appears on rank 0 and on rank 1"), "{e}");
}

#[test]
fn actions_print_and_parse_back_as_pytorch_writes_them() {
    for kind in [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved,
        ScheduleKind::ZeroBubbleH1,
    ] {
        let v = if kind == ScheduleKind::Interleaved {
            2
        } else {
            1
        };
        let s = Schedule::new(kind, 4, 8, v).unwrap();
        assert_eq!(Schedule::from_csv(&s.to_csv()).unwrap(), s, "{kind}");
    }
    // torch.distributed.pipelining's `_Action.__repr__`: stage, letter, micro-batch.
    let a: Action = "12W3".parse().unwrap();
    assert_eq!(a, Action::BackwardWeight { mb: 3, stage: 12 });
    assert_eq!(a.to_string(), "12W3");
    for bad in ["F3", "1X3", "1F", "", "1F3x"] {
        let e = bad.parse::<Action>().unwrap_err().to_string();
        assert!(e.contains("action"), "{bad}: {e}");
    }
}

#[test]
fn a_v_shaped_placement_is_expressible_and_validated() {
    // Two ranks, four stages in a V (ZB-V's placement): rank 0 holds stages 0 and 3, rank 1
    // holds 1 and 2. GPipe order on each rank, stage by stage.
    let m = 2;
    let row = |first: usize, second: usize| -> Vec<Action> {
        let f = |stage| (0..m).map(move |mb| Action::Forward { mb, stage });
        let b = |stage| (0..m).map(move |mb| Action::Backward { mb, stage });
        f(first)
            .chain(f(second))
            .chain(b(second))
            .chain(b(first))
            .collect()
    };
    let s = Schedule::from_actions(vec![row(0, 3), row(1, 2)]).unwrap();
    assert_eq!((s.ranks, s.stages, s.micro_batches), (2, 4, 2));
    assert_eq!(s.placement().unwrap(), vec![0, 1, 1, 0]);
    assert_eq!(s.stages_of(0), vec![0, 3]);
    let sim = s.validate().unwrap();
    assert_eq!(sim.peak_in_flight, vec![4, 4]);
}

#[test]
fn timeline_shows_every_action() {
    let sim = Schedule::new(ScheduleKind::OneFOneB, 2, 3, 1)
        .unwrap()
        .validate()
        .unwrap();
    let t = sim.timeline();
    assert_eq!(t.lines().count(), 2);
    assert!(
        t.starts_with("rank  0 |0F0 0F1   .   . 0B0 0B0 0F2 0B1 0B1"),
        "{t}"
    );
    assert!(sim.svg("1f1b").contains("<rect"));
}

fn dummy(n: usize, cuts: &[usize]) -> Sequential {
    let mut s = Sequential::new();
    for i in 0..n {
        s.push(LayerSpec::new(format!("l{i}"), |_| {
            unreachable!("not built here")
        }));
        if cuts.contains(&(i + 1)) {
            s.cut();
        }
    }
    s
}

#[test]
fn partitions_by_layers_or_by_cut_points() {
    assert_eq!(uniform_balance(10, 4).unwrap(), vec![3, 3, 2, 2]);
    let m = dummy(10, &[]);
    assert_eq!(partition(&m, 3, None).unwrap(), vec![0..4, 4..7, 7..10]);
    assert_eq!(partition(&m, 2, Some(&[7, 3])).unwrap(), vec![0..7, 7..10]);
    // Cut points after layers 2, 5 and 8: four segments; a balance counts segments.
    let c = dummy(10, &[2, 5, 8]);
    assert_eq!(partition(&c, 2, None).unwrap(), vec![0..5, 5..10]);
    assert_eq!(partition(&c, 2, Some(&[3, 1])).unwrap(), vec![0..8, 8..10]);
    assert_eq!(
        partition(&c, 4, None).unwrap(),
        vec![0..2, 2..5, 5..8, 8..10]
    );
    for (model, p, bal, needle) in [
        (
            &m,
            2,
            Some(vec![5, 4]),
            "sums to 9 but the model has 10 layers",
        ),
        (&m, 2, Some(vec![10, 0]), "leaves stage 1 empty"),
        (&m, 11, None, "11 stages cannot each get one of 10"),
        (&c, 5, None, "segments between cut points"),
        (&c, 2, Some(vec![1, 1, 2]), "has 3 entries for 2 stages"),
    ] {
        let e = partition(model, p, bal.as_deref()).unwrap_err().to_string();
        assert!(e.contains(needle), "{e}");
    }
}

#[test]
fn the_v_schedules_are_complete_deadlock_free_and_placed_in_a_v() {
    for p in 1..=8 {
        for m in 1..=20 {
            let zbv = Schedule::new(ScheduleKind::ZeroBubbleV, p, m, 1).unwrap();
            let sim = zbv
                .validate()
                .unwrap_or_else(|e| panic!("zbv p={p} m={m}: {e}"));
            let v: Vec<usize> = (0..2 * p).map(|k| k.min(2 * p - 1 - k)).collect();
            assert_eq!(zbv.placement().unwrap(), v, "zbv p={p}");
            assert!(sim.bubble >= 0.0);
            match Schedule::new(ScheduleKind::DualPipeV, p, m, 1) {
                Ok(s) => {
                    s.validate()
                        .unwrap_or_else(|e| panic!("dualpipev p={p} m={m}: {e}"));
                    assert_eq!(s.placement().unwrap(), v, "dualpipev p={p}");
                }
                Err(e) => {
                    assert!(m < 2 * p, "p={p} m={m}: {e}");
                    assert!(e.to_string().contains("at least 2 x pp"), "{e}");
                }
            }
        }
    }
}

#[test]
fn zbv_leaves_less_bubble_than_zb1_and_1f1b_and_holds_what_1f1b_holds_at_most() {
    let sim = |kind, p, m| Schedule::new(kind, p, m, 1).unwrap().validate().unwrap();
    for p in 2..=8 {
        for m in 2 * p..=3 * p {
            let zbv = sim(ScheduleKind::ZeroBubbleV, p, m);
            let zb1 = sim(ScheduleKind::ZeroBubbleH1, p, m);
            let one = sim(ScheduleKind::OneFOneB, p, m);
            assert!(
                zbv.bubble < zb1.bubble && zb1.bubble < one.bubble,
                "p={p} m={m}: zbv {} zb1 {} 1f1b {}",
                zbv.bubble,
                zb1.bubble,
                one.bubble
            );
            // A V stage is half a 1F1B stage: 2p of them are 1F1B's first rank's p, on every
            // rank alike.
            assert!(
                zbv.peak_in_flight.iter().all(|&n| n <= 2 * p),
                "p={p} m={m}: {:?}",
                zbv.peak_in_flight
            );
        }
    }
    // The figures: pp 4, 8 micro-batches, unit costs. A V stage costs a unit as a
    // 1F1B stage does, though it holds half the layers: ZB-V's 51 units are 25.5 of the
    // others', against ZB-H1's 30 and 1F1B's 33 (bubbles 5.9 %, 20.0 %, 27.3 %).
    let (zbv, zb1, one) = (
        sim(ScheduleKind::ZeroBubbleV, 4, 8),
        sim(ScheduleKind::ZeroBubbleH1, 4, 8),
        sim(ScheduleKind::OneFOneB, 4, 8),
    );
    assert_eq!(
        [zbv.makespan, zb1.makespan, one.makespan],
        [51.0, 30.0, 33.0]
    );
    assert!((zbv.bubble - 3.0 / 51.0).abs() < 1e-12, "{}", zbv.bubble);
}
