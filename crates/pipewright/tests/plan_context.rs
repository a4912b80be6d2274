//! The planner with context and sequence parallelism, against values worked out by hand: the
//! ring's messages and attention's working memory from their shapes, activations per rank
//! falling as 1/cp, sequence parallelism splitting the activations tensor parallelism leaves
//! whole, the search turning to a ring when long sequences do not fit (and not searching rings
//! of short chunks), and candidates it must refuse.

use pipewright::parallel::zero::Zero;
use pipewright::plan::context_parallel::{ring_seconds, working_bytes};
use pipewright::plan::estimate::{state_bytes_per_param, RANK_BYTES};
use pipewright::plan::{
    estimate, parse_candidate, rank, search, AttentionShape, Cluster, Estimate, Hardware, Link,
    Profile, Request, Transformer,
};

/// A device of 80 GiB whose links move `bandwidth` bytes a second (`hardware()`: 1e9).
fn hardware_with(bandwidth: f64) -> Hardware {
    let link = Link {
        latency_s: 1e-5,
        bandwidth_bytes_per_s: bandwidth,
        all_reduce: None,
    };
    Hardware {
        name: "test".into(),
        devices_per_node: 8,
        cores_per_device: 1,
        one_thread_share: None,
        memory: "80GiB".into(),
        peak_flops_f32: 1e13,
        peak_flops_half: 1e13,
        efficiency: 0.5,
        gemm_f32: None,
        gemm_half: None,
        memory_bandwidth_bytes_per_s: 1e11,
        runtime_memory: "1MiB".into(),
        intra_node: link,
        inter_node: link,
    }
}

fn hardware() -> Hardware {
    hardware_with(1e9)
}

/// A 4-layer GPT of width 256 over `seq` tokens, f32.
fn gpt(seq: usize, hw: &Hardware) -> Profile {
    Transformer {
        n_layer: 4,
        d_model: 256,
        n_head: 4,
        vocab: 256,
        seq,
        attention: Default::default(),
    }
    .profile(hw, 4)
    .unwrap()
}

fn predict(p: &Profile, hw: &Hardware, spec: &str) -> Estimate {
    let c = parse_candidate(spec, 2).unwrap();
    let cluster = Cluster::new(hw, c.parallel.layout.world(), None).unwrap();
    estimate(p, &cluster, &c).unwrap().0
}

#[test]
fn ring_messages_and_working_memory_follow_the_shapes() {
    let a = AttentionShape {
        heads: 8,
        kv_heads: 2,
        head_dim: 64,
        seq: 4096,
    };
    let link = hardware().intra_node;
    // cp 4, tp 1, 2 rows: a block is keys and values of 1024 tokens, 2 heads, f32.
    let block = 2.0 * 2.0 * 1024.0 * 2.0 * 64.0 * 4.0;
    let (f, b) = ring_seconds(&a, 2, 1, 4, link);
    assert!((f - 3.0 * (1e-5 + block / 1e9)).abs() < 1e-12, "{f}");
    // The backward: three blocks with their gradients, then the gradients home.
    let want = 3.0 * (1e-5 + 2.0 * block / 1e9) + 1e-5 + block / 1e9;
    assert!((b - want).abs() < 1e-12, "{b}");
    assert_eq!(ring_seconds(&a, 2, 1, 1, link), (0.0, 0.0));
    // cp 1: the fused kernel's two 4096 x 4096 f32 buffers; cp 4 at tp 2: five (2, 4, 512,
    // 512) f32 tensors.
    assert_eq!(working_bytes(&a, 2, 1, 1, 4), 2.0 * 4096.0 * 4096.0 * 4.0);
    assert_eq!(
        working_bytes(&a, 2, 2, 4, 2),
        5.0 * 2.0 * 4.0 * 512.0 * 512.0 * 4.0
    );
}

#[test]
fn activations_per_rank_fall_as_one_over_cp() {
    let hw = hardware();
    let p = gpt(8192, &hw);
    let a = p.layers[1].attention.unwrap();
    let params: f64 = p.layers.iter().map(|l| l.params as f64).sum();
    let (state, _) = state_bytes_per_param(Zero::Off, 1, true);
    // What is not activations: the runtime, the rank's own bytes and the model's state.
    let fixed = hw.runtime_bytes() as f64 + RANK_BYTES + params * state;
    let activations = |cp: usize| {
        let e = predict(&p, &hw, &format!("cp={cp}"));
        e.max_peak_bytes() - fixed - working_bytes(&a, 2, 1, cp, 4)
    };
    let whole = activations(1);
    // Two rows, every layer's kept bytes, plus the backward's extra share of them.
    let kept: f64 = p
        .layers
        .iter()
        .map(|l| l.kept_bytes_per_sample)
        .sum::<f64>()
        * 2.0;
    assert!(
        (whole - 1.3 * kept).abs() < 1e-6 * whole,
        "{whole} vs {kept}"
    );
    for cp in [2, 4, 8] {
        let part = activations(cp);
        assert!(
            (part * cp as f64 - whole).abs() < 1e-6 * whole,
            "cp {cp}: {part} x {cp} against {whole}"
        );
    }
    // Time: cp 2 computes half of cp 1's token-wise work, its attention as 5 chunk pairs whose
    // scores go through memory (more than half the fused kernel's causal work), and adds its
    // messages, which at 1 GB/s (16.8 MB blocks) cost more than the half it saves. With
    // 100 GB/s links and memory that streams the chunk scores fast (10 TB/s), it does not.
    let step = |hw: &Hardware, spec: &str| predict(&p, hw, spec).step_s;
    let (one, two) = (step(&hw, "cp=1"), step(&hw, "cp=2"));
    assert!(two > one, "{one} {two}");
    let mut fast = hardware_with(1e11);
    fast.memory_bandwidth_bytes_per_s = 1e13;
    let (one, two) = (step(&fast, "cp=1"), step(&fast, "cp=2"));
    assert!(two > one / 2.0 && two < 0.7 * one, "{one} {two}");
    // On the slower memory (100 GB/s) the ring's materialised chunk scores make cp 2 slower per
    // rank than the fused kernel than on the fast one.
    let slow = hardware_with(1e11);
    let ratio = step(&slow, "cp=2") / step(&slow, "cp=1");
    assert!(ratio > two / one, "{ratio} vs {}", two / one);
}

#[test]
fn sequence_parallelism_splits_what_tensor_parallelism_leaves_whole() {
    let hw = hardware();
    let p = gpt(2048, &hw);
    let plain = predict(&p, &hw, "tp=2");
    let sp = predict(&p, &hw, "tp=2,sp=1");
    // The whole part of each layer's kept bytes halves (2 rows, with the backward's share).
    let whole: f64 = p
        .layers
        .iter()
        .map(|l| l.kept_whole_bytes_per_sample)
        .sum::<f64>()
        * 2.0;
    let saved = plain.max_peak_bytes() - sp.max_peak_bytes();
    assert!(
        (saved - 1.3 * whole / 2.0).abs() < 1e-6 * saved,
        "{saved} vs {whole}"
    );
    // Its reduce-scatters and all-gathers move an all-reduce's bytes; the element-wise passes
    // over the whole part (norms, residual sums: forward once, backward twice) are split over
    // tp, so the step saves half of their streaming (2 rows of 2048 tokens, one micro-batch).
    let streamed: f64 = p
        .layers
        .iter()
        .map(|l| l.shapes.as_ref().unwrap().elementwise_whole_bytes)
        .sum::<f64>()
        * 2.0
        * 2048.0;
    let expected = 3.0 * streamed / 2.0 / hw.memory_bandwidth_bytes_per_s;
    let faster = plain.step_s - sp.step_s;
    assert!(
        (faster - expected).abs() < 1e-9 * plain.step_s,
        "{faster} vs {expected}"
    );
}

#[test]
fn the_search_turns_to_a_ring_when_long_sequences_do_not_fit() {
    let hw = hardware();
    let p = gpt(32768, &hw);
    let world = 4;
    let cluster = Cluster::new(&hw, world, None).unwrap();
    let at = |spec: &str| predict(&p, &hw, spec).max_peak_bytes();
    // A cap between the best ring's peak and every cp 1 layout's.
    let cap = at("cp=4,mbs=1") * 1.05;
    assert!(at("dp=2,mbs=1,zero=3") > cap && at("tp=2,sp=1,dp=2,mbs=1") > cap);
    let req = Request {
        world,
        memory_bytes: cap,
        global_batch: 2,
        top: 3,
    };
    let best = search(&p, &cluster, &req).unwrap();
    for e in &best {
        assert!(e.candidate.parallel.layout.cp > 1, "{:?}", e.candidate);
        assert!(e.max_peak_bytes() <= cap);
    }
    // With room for everything, cp is one choice among the rest.
    let roomy = Request {
        memory_bytes: 1e15,
        top: 1000,
        ..req
    };
    let all = search(&p, &cluster, &roomy).unwrap();
    assert!(all.iter().any(|e| e.candidate.parallel.layout.cp == 1));
    assert!(all.iter().any(|e| e.candidate.parallel.layout.cp == 4));
    // Sequence parallelism is searched with every tp > 1 (the same step, less memory).
    assert!(all
        .iter()
        .all(|e| e.candidate.parallel.sequence_parallel == (e.candidate.parallel.layout.tp > 1)));
    // Rings of chunks shorter than 512 tokens are not searched: at 2048 tokens, cp 2 at most.
    let short = gpt(2048, &hw);
    let all = search(&short, &cluster, &roomy).unwrap();
    assert!(all.iter().all(|e| e.candidate.parallel.layout.cp <= 2));
    assert!(all.iter().any(|e| e.candidate.parallel.layout.cp == 2));
}

#[test]
fn candidates_the_model_cannot_take_are_refused() {
    let hw = hardware();
    let p = gpt(96, &hw);
    let c = parse_candidate("tp=2,cp=2,sp=1", 2).unwrap();
    assert_eq!(
        (
            c.parallel.layout.tp,
            c.parallel.layout.cp,
            c.parallel.sequence_parallel
        ),
        (2, 2, true)
    );
    let refuse = |spec: &str, world: usize| {
        let cluster = Cluster::new(&hw, world, None).unwrap();
        let req = Request {
            world,
            memory_bytes: 1e15,
            global_batch: 2,
            top: 1,
        };
        let c = parse_candidate(spec, 2).unwrap();
        rank(&p, &cluster, &req, vec![c]).unwrap_err().to_string()
    };
    // 96 tokens split into 2 x 5 = 10 chunks? No.
    let e = refuse("cp=5", 5);
    assert!(e.contains("multiple of 2 x cp = 10"), "{e}");
    let e = refuse("sp=1", 1);
    assert!(e.contains("needs tp > 1"), "{e}");
    let e = parse_candidate("sp=maybe", 2).unwrap_err().to_string();
    assert!(e.contains("sp in candidate"), "{e}");
    // A layout as the plan's table prints it (spaces, expert parallelism) is taken back.
    let c = parse_candidate("pp=2 tp=1 dp=4 ep=2", 8).unwrap();
    assert_eq!(
        (
            c.parallel.layout.pp,
            c.parallel.layout.dp,
            c.parallel.layout.ep
        ),
        (2, 4, 2)
    );
    let e = parse_candidate("dp=4,ep=3", 8).unwrap_err().to_string();
    assert!(e.contains("--ep 3 must divide"), "{e}");
}
