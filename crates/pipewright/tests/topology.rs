//! Layout arithmetic and Varuna's stage_to_rank_map.

use pipewright::distributed::topology::{Axis, Coords, Layout, Topology};

#[test]
fn tensor_rank_varies_fastest_then_data_then_pipeline() {
    let l = Layout::new(2, 2, 2).unwrap();
    let want = [
        (0, 0, 0),
        (0, 1, 0),
        (0, 0, 1),
        (0, 1, 1),
        (1, 0, 0),
        (1, 1, 0),
        (1, 0, 1),
        (1, 1, 1),
    ];
    for (r, &(stage, tp_rank, dp_rank)) in want.iter().enumerate() {
        let c = Coords {
            stage,
            tp_rank,
            dp_rank,
            cp_rank: 0,
        };
        assert_eq!(l.coords(r).unwrap(), c, "rank {r}");
        assert_eq!(l.index(c).unwrap(), r);
    }
    assert!(l.coords(8).is_err());
}

#[test]
fn axis_groups_of_2x2x2() {
    let l = Layout::new(2, 2, 2).unwrap();
    assert_eq!(
        l.groups(Axis::Tensor),
        vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]
    );
    assert_eq!(
        l.groups(Axis::Data),
        vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]
    );
    assert_eq!(
        l.groups(Axis::Pipeline),
        vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
    );
    assert_eq!(l.group(6, Axis::Data).unwrap(), vec![4, 6]);
}

#[test]
fn groups_partition_the_world_for_many_layouts() {
    for pp in 1..=4 {
        for tp in 1..=3 {
            for dp in 1..=3 {
                let l = Layout::new(pp, tp, dp).unwrap();
                for (axis, n) in [(Axis::Pipeline, pp), (Axis::Tensor, tp), (Axis::Data, dp)] {
                    let gs = l.groups(axis);
                    assert_eq!(gs.len() * n, l.world());
                    let mut all: Vec<usize> = gs.iter().flatten().copied().collect();
                    all.sort();
                    assert_eq!(all, (0..l.world()).collect::<Vec<_>>(), "{l} {axis:?}");
                    for g in &gs {
                        for &r in g {
                            assert_eq!(&l.group(r, axis).unwrap(), g);
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn layouts_must_fill_the_world() {
    assert_eq!(
        Layout::for_world(8, 2, 2).unwrap(),
        Layout::new(2, 2, 2).unwrap()
    );
    let e = Layout::for_world(6, 2, 2).unwrap_err().to_string();
    assert!(e.contains("multiple of pp*tp"), "{e}");
    assert!(Layout::new(0, 1, 1).is_err());
    let e = Layout::new(2, 1, 2)
        .unwrap()
        .check_world(8)
        .unwrap_err()
        .to_string();
    assert!(e.contains("needs 4 ranks but the world has 8"), "{e}");
}

#[test]
fn stage_to_rank_map_round_trips() {
    // Stage 0 on ranks 0 and 2, stage 1 on ranks 1 and 3.
    let t = Topology::from_stage_to_rank_map("0,2;1,3;", 1).unwrap();
    assert_eq!(t.layout(), Layout::new(2, 1, 2).unwrap());
    assert_eq!(
        t.coords(2).unwrap(),
        Coords {
            stage: 0,
            tp_rank: 0,
            dp_rank: 1,
            ..Coords::default()
        }
    );
    assert_eq!(
        t.coords(1).unwrap(),
        Coords {
            stage: 1,
            tp_rank: 0,
            dp_rank: 0,
            ..Coords::default()
        }
    );
    assert_eq!(
        t.rank(Coords {
            stage: 1,
            tp_rank: 0,
            dp_rank: 1,
            ..Coords::default()
        })
        .unwrap(),
        3
    );
    assert_eq!(t.stage_to_rank_map(), "0,2;1,3;");
    assert_eq!(t.group(3, Axis::Pipeline).unwrap(), vec![2, 3]);
    assert_eq!(t.group(3, Axis::Data).unwrap(), vec![1, 3]);
    assert_eq!(t.groups(Axis::Data), vec![vec![0, 2], vec![1, 3]]);
    // Without the trailing separator, with spaces, and with tensor parallelism.
    let t = Topology::from_stage_to_rank_map(" 3, 2 ; 1,0", 2).unwrap();
    assert_eq!(t.layout(), Layout::new(2, 2, 1).unwrap());
    assert_eq!(t.stage_to_rank_map(), "3,2;1,0;");
    assert_eq!(t.group(3, Axis::Tensor).unwrap(), vec![3, 2]);
    assert_eq!(
        Topology::new(Layout::new(2, 1, 2).unwrap()).stage_to_rank_map(),
        "0,1;2,3;"
    );
}

#[test]
fn bad_stage_to_rank_maps_are_explained() {
    for (map, tp, needle) in [
        ("", 1, "names no stage"),
        ("0,1;2", 1, "stage 1 has 1 ranks but stage 0 has 2"),
        ("0,0;1,2", 1, "rank 0 appears twice"),
        ("0,1;2,5", 1, "rank 5 is outside a world of 4"),
        // Two stages of two replicas are a world of 4: ranks 4 and 5 do not exist.
        ("0,4;1,5;", 1, "rank 4 is outside a world of 4"),
        ("0,x;1,2", 1, "`x` is not a rank number"),
        ("0,1,2;3,4,5", 2, "do not split into tp=2"),
        ("0;;1", 1, "stage 1 has no ranks"),
    ] {
        let e = Topology::from_stage_to_rank_map(map, tp)
            .unwrap_err()
            .to_string();
        assert!(e.contains(needle), "`{map}`: {e}");
    }
}

#[test]
fn context_parallel_ranks_sit_between_tensor_and_data() {
    // pp 2 x tp 2 x cp 2 x dp 2: tp fastest, then cp, then dp, then the stage.
    let l = Layout::new(2, 2, 2).unwrap().with_cp(2).unwrap();
    assert_eq!(l.world(), 16);
    assert_eq!(l.to_string(), "pp=2 tp=2 cp=2 dp=2");
    let c = l.coords(6).unwrap();
    assert_eq!((c.stage, c.dp_rank, c.cp_rank, c.tp_rank), (0, 1, 1, 0));
    for i in 0..16 {
        assert_eq!(l.index(l.coords(i).unwrap()).unwrap(), i);
    }
    assert_eq!(l.group(5, Axis::Tensor).unwrap(), vec![4, 5]);
    assert_eq!(l.group(5, Axis::Context).unwrap(), vec![5, 7]);
    assert_eq!(l.group(5, Axis::Data).unwrap(), vec![1, 5]);
    assert_eq!(l.group(5, Axis::Pipeline).unwrap(), vec![5, 13]);
    // The ranks holding the same weights: every cp and dp rank of a stage and shard.
    assert_eq!(l.group(5, Axis::Replica).unwrap(), vec![1, 3, 5, 7]);
    for axis in [Axis::Context, Axis::Replica] {
        let mut all: Vec<usize> = l.groups(axis).into_iter().flatten().collect();
        all.sort();
        assert_eq!(all, (0..16).collect::<Vec<_>>(), "{axis:?}");
    }
    // Files written before cp existed read as cp 1.
    let old: Layout = serde_json::from_str(r#"{"pp":2,"tp":1,"dp":2}"#).unwrap();
    assert_eq!(old, Layout::new(2, 1, 2).unwrap());
    assert!(Layout::new(1, 1, 1).unwrap().with_cp(0).is_err());
}

#[test]
fn expert_groups_are_neighbouring_replicas_and_their_strided_twins() {
    // pp 1 x tp 1 x cp 2 x dp 4 with ep 2: replicas {0,1} and {2,3} split the experts; replicas
    // 0 and 2 (with their cp ranks) hold the same ones.
    let l = Layout::new(1, 1, 4)
        .unwrap()
        .with_cp(2)
        .unwrap()
        .with_ep(2)
        .unwrap();
    assert_eq!(l.world(), 8);
    assert_eq!(l.to_string(), "pp=1 tp=1 cp=2 dp=4 ep=2");
    // Index = dp_rank * 2 + cp_rank.
    assert_eq!(l.group(3, Axis::Expert).unwrap(), vec![1, 3]);
    assert_eq!(l.group(4, Axis::Expert).unwrap(), vec![4, 6]);
    assert_eq!(l.group(3, Axis::ExpertReplica).unwrap(), vec![2, 3, 6, 7]);
    assert_eq!(l.ep_rank(l.coords(6).unwrap()), 1);
    for (axis, n) in [(Axis::Expert, 2), (Axis::ExpertReplica, 4)] {
        let gs = l.groups(axis);
        assert_eq!(gs.len() * n, 8, "{axis:?}");
        let mut all: Vec<usize> = gs.into_iter().flatten().collect();
        all.sort();
        assert_eq!(all, (0..8).collect::<Vec<_>>(), "{axis:?}");
    }
    // ep 1: an expert group is one rank and the expert replicas are the replicas.
    let one = Layout::new(2, 2, 2).unwrap();
    assert_eq!(one.group(5, Axis::Expert).unwrap(), vec![5]);
    assert_eq!(
        one.group(5, Axis::ExpertReplica).unwrap(),
        one.group(5, Axis::Replica).unwrap()
    );
    // ep must divide dp.
    let e = Layout::new(1, 1, 4).unwrap().with_ep(3).unwrap_err();
    assert!(e.to_string().contains("divide"), "{e}");
    assert!(Layout::new(1, 1, 4).unwrap().with_ep(0).is_err());
    let old: Layout = serde_json::from_str(r#"{"pp":1,"tp":1,"dp":4,"cp":1}"#).unwrap();
    assert_eq!(old.ep, 1);
}
