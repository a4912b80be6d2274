//! Tensor-parallel GPT (Megatron): split over tp ranks (threads), every logit, loss, gradient
//! and parameter after AdamW steps equals the serial model's, shard by shard.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::Tensor;
use pipewright::distributed::comm::{local, Communicator, Pending, ReduceOp};
use pipewright::engine::serial::{SerialTrainer, TrainOptions};
use pipewright::model::nn::max_rel_diff;
use pipewright::model::nn::optim::OptimSpec;
use pipewright::model::nn::optim::{AdamW, AdamWConfig, LrSchedule, Optimizer};
use pipewright::parallel::tensor_parallel::{
    collect_state_dict, load_state_dict, part, relocate_state_dict, state_dict, Group, Shard,
};
use pipewright::trainer::TrainSpec;
use pipewright::Error;
use pipewright::{Batch, Build};
use pipewright_models::tasks::Adder;
use pipewright_models::{gpt, GptConfig, Task, TIED};

const SEED: u64 = 5;
const BATCH: usize = 8;

fn cfg() -> GptConfig {
    GptConfig {
        vocab_size: 64,
        block_size: 6,
        n_layer: 2,
        n_head: 4,
        n_embd: 16,
        dropout: 0.1,
    }
}

fn trainer(init: &Build, cfg: GptConfig) -> pipewright::Result<SerialTrainer> {
    let stage = gpt(cfg)?.build(init)?;
    let opt: Box<dyn Optimizer> = Box::new(AdamW::new(stage.params(), AdamWConfig::default())?);
    SerialTrainer::new(
        stage,
        opt,
        TrainOptions {
            // AdamW divides each element's step by the root of its own squared gradient, so on
            // elements with tiny gradients it magnifies the last-bit differences of summing in
            // another order (a row-parallel matmul sums partial products, then all-reduces).
            // At 1e-3 the worst parameter after 3 steps is 3.7e-6 off (relative); at 1e-2, 2e-5.
            spec: TrainSpec {
                seed: SEED,
                optim: OptimSpec {
                    clip: Some(0.5),
                    lr: LrSchedule::Constant { lr: 1e-3 },
                    ..Default::default()
                },
                ..TrainSpec::serial()
            },
            micro_batches: 2,
            tied: vec![(TIED.0.into(), TIED.1.into())],
            loss: std::sync::Arc::new(pipewright::parallel::loss::CrossEntropy::default()),
        },
    )
}

/// Logits, step-0 loss and gradients, then 3 steps' (loss, grad norm), final parameters and
/// how each parameter is split.
struct Run {
    logits: Tensor,
    loss: f64,
    grads: HashMap<String, Tensor>,
    steps: Vec<(f64, f64)>,
    params: HashMap<String, Tensor>,
    shards: HashMap<String, Shard>,
}

fn run(t: &mut SerialTrainer) -> pipewright::Result<Run> {
    let task = Adder::new(2, 0)?;
    let (x, y) = task.batch(0, BATCH)?;
    let logits = t.predict(&Batch::input(x.clone()))?;
    let (loss, g, _) = t.loss_and_grads(&Batch::pair(x.clone(), y.clone()))?;
    let grads = g.iter().map(|(n, g)| (n.clone(), g.clone())).collect();
    let mut steps = Vec::new();
    for s in 0..3 {
        let (x, y) = task.batch(s, BATCH)?;
        let r = t.step(&Batch::pair(x.clone(), y.clone()))?;
        steps.push((r.loss, r.grad_norm));
    }
    let params = t
        .model()
        .params()
        .into_iter()
        .map(|(n, v)| Ok((n, v.as_tensor().copy()?)))
        .collect::<pipewright::Result<_>>()?;
    Ok(Run {
        logits,
        loss,
        grads,
        steps,
        params,
        shards: t.model().shards().into_iter().collect(),
    })
}

fn close(what: &str, a: f64, b: f64) {
    assert!(((a - b) / b).abs() < 1e-5, "{what}: {a} vs serial {b}");
}

/// `whole`'s part that `shard` describes (the whole itself for a whole parameter).
fn part_of(whole: &Tensor, shard: Option<&Shard>) -> Tensor {
    match shard {
        None => whole.clone(),
        Some(s) => part(whole, s.axis, s.stride, s.index, s.count).unwrap(),
    }
}

fn compare(tp: usize, rank: usize, got: &Run, want: &Run) {
    let at = format!("tp={tp} rank {rank}");
    assert!(
        max_rel_diff(&got.logits, &want.logits).unwrap() < 1e-5,
        "{at}: logits"
    );
    close(&format!("{at}: loss"), got.loss, want.loss);
    for (i, ((l, n), (wl, wn))) in got.steps.iter().zip(&want.steps).enumerate() {
        close(&format!("{at}: step {i} loss"), *l, *wl);
        close(&format!("{at}: step {i} grad norm"), *n, *wn);
    }
    assert_eq!(got.grads.len(), want.grads.len(), "{at}: gradient count");
    for (what, got_map, want_map) in [
        ("gradient", &got.grads, &want.grads),
        ("parameter", &got.params, &want.params),
    ] {
        for (name, w) in want_map {
            let g = got_map
                .get(name)
                .unwrap_or_else(|| panic!("{at}: no {what} of {name}"));
            let w = part_of(w, got.shards.get(name));
            let d = max_rel_diff(g, &w).unwrap();
            assert!(d < 1e-5, "{at}: {what} of {name} differs by {d:e}");
        }
    }
}

#[test]
fn gpt_tensor_parallel_matches_serial() {
    let want = run(&mut trainer(&Build::cpu(SEED), cfg()).unwrap()).unwrap();
    for tp in [1, 2, 4] {
        let runs = local::run(tp, |comm| {
            let init = Build::cpu(SEED).with_tp(Group::new(Box::new(comm)));
            run(&mut trainer(&init, cfg())?)
        })
        .unwrap();
        for (rank, got) in runs.iter().enumerate() {
            compare(tp, rank, got, &want);
            if tp > 1 {
                // Megatron's split: the vocabulary, heads and MLP are sharded; norms and wpe whole.
                for name in [
                    "wte.weight",
                    "lm_head.weight",
                    "h.0.attn.c_attn.weight",
                    "h.0.attn.c_attn.bias",
                    "h.1.attn.c_proj.weight",
                    "h.0.mlp.c_fc.weight",
                    "h.0.mlp.c_fc.bias",
                    "h.1.mlp.c_proj.weight",
                ] {
                    assert!(got.shards.contains_key(name), "{name} is not sharded");
                }
                for name in [
                    "wpe.weight",
                    "h.0.ln_1.weight",
                    "h.0.attn.c_proj.bias",
                    "h.0.mlp.c_proj.bias",
                    "ln_f.bias",
                ] {
                    assert!(!got.shards.contains_key(name), "{name} is sharded");
                }
            }
        }
    }
}

/// A communicator that records the largest tensor any collective carries.
struct Recording {
    inner: Box<dyn Communicator>,
    largest: Arc<AtomicUsize>,
}

impl Recording {
    fn see(&self, t: &Tensor) {
        self.largest.fetch_max(t.elem_count(), Ordering::SeqCst);
    }
}

impl Communicator for Recording {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn backend(&self) -> &'static str {
        "recording"
    }
    fn send(&self, t: &Tensor, dst: usize, tag: u64) -> pipewright::Result<()> {
        self.see(t);
        self.inner.send(t, dst, tag)
    }
    fn recv(&self, src: usize, tag: u64) -> pipewright::Result<Tensor> {
        self.inner.recv(src, tag)
    }
    fn isend(&self, t: &Tensor, dst: usize, tag: u64) -> pipewright::Result<Pending<()>> {
        self.see(t);
        self.inner.isend(t, dst, tag)
    }
    fn irecv(&self, src: usize, tag: u64) -> pipewright::Result<Pending<Tensor>> {
        self.inner.irecv(src, tag)
    }
    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> pipewright::Result<Tensor> {
        self.see(t);
        self.inner.all_reduce(t, op)
    }
    fn all_gather(&self, t: &Tensor) -> pipewright::Result<Vec<Tensor>> {
        self.see(t);
        let parts = self.inner.all_gather(t)?;
        self.largest
            .fetch_max(parts.iter().map(|p| p.elem_count()).sum(), Ordering::SeqCst);
        Ok(parts)
    }
    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> pipewright::Result<Tensor> {
        self.see(t);
        self.inner.reduce_scatter(t, op)
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> pipewright::Result<Tensor> {
        self.see(t);
        self.inner.broadcast(t, root)
    }
    fn barrier(&self) -> pipewright::Result<()> {
        self.inner.barrier()
    }
    fn split(&self, members: &[usize]) -> pipewright::Result<Box<dyn Communicator>> {
        Ok(Box::new(Recording {
            inner: self.inner.split(members)?,
            largest: self.largest.clone(),
        }))
    }
}

#[test]
fn the_loss_never_gathers_the_vocabulary() {
    // Logits of a batch are (8, 6, 64): the whole vocabulary of one batch is 3072 numbers, a
    // rank's part 1536; activations are (8, 6, 16) = 768, MLP parts (8, 6, 32) = 1536.
    let task = Adder::new(2, 0).unwrap();
    let (x, y) = task.batch(0, BATCH).unwrap();
    let largest = local::run(2, |comm| {
        let largest = Arc::new(AtomicUsize::new(0));
        let rec = Recording {
            inner: Box::new(comm),
            largest: largest.clone(),
        };
        let init = Build::cpu(SEED).with_tp(Group::new(Box::new(rec)));
        let t = trainer(&init, cfg())?;
        t.loss_and_grads(&Batch::pair(x.clone(), y.clone()))?;
        Ok(largest.load(Ordering::SeqCst))
    })
    .unwrap();
    let vocab_of_batch = BATCH * 6 * cfg().vocab_size;
    for (r, l) in largest.iter().enumerate() {
        assert!(*l > 0, "rank {r} ran no collective");
        assert!(
            *l <= BATCH * 6 * cfg().n_embd,
            "rank {r} carried a tensor of {l} numbers (the batch's vocabulary is {vocab_of_batch})"
        );
    }
}

#[test]
fn state_dicts_collect_and_relocate_exactly() {
    let serial = gpt(cfg()).unwrap().build(&Build::cpu(SEED)).unwrap();
    // Not the initial values: a state that only a real round trip reproduces.
    let whole: Vec<(String, Tensor)> = state_dict(&serial)
        .into_iter()
        .map(|(n, t)| (n, t.randn_like(0.0, 1.0).unwrap()))
        .collect();
    for tp in [1, 2, 4] {
        let back = local::run(tp, |comm| {
            let init = Build::cpu(SEED).with_tp(Group::new(Box::new(comm)));
            let model = gpt(cfg())?.build(&init)?;
            // The initial shards are the serial initial values cut.
            let mine = relocate_state_dict(&model, &state_dict(&serial))?;
            for ((n, a), (_, b)) in mine.iter().zip(state_dict(&model)) {
                assert_eq!(max_rel_diff(a, &b)?, 0.0, "tp={tp}: initial {n}");
            }
            let local = relocate_state_dict(&model, &whole)?;
            load_state_dict(&model, &local)?;
            collect_state_dict(&model, &state_dict(&model))
        })
        .unwrap();
        for (r, got) in back.iter().enumerate() {
            assert_eq!(got.len(), whole.len());
            for ((n, a), (m, b)) in got.iter().zip(&whole) {
                assert_eq!(n, m);
                assert_eq!(a.dims(), b.dims(), "tp={tp} rank {r}: {n}");
                let same = a.flatten_all().unwrap().to_vec1::<f32>().unwrap()
                    == b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert!(
                    same,
                    "tp={tp} rank {r}: {n} is not bit-equal after the round trip"
                );
            }
        }
    }
    // Collected at tp=4, relocated into tp=2: the model at tp=2 holds the same whole state.
    let at4 = local::run(4, |comm| {
        let init = Build::cpu(SEED).with_tp(Group::new(Box::new(comm)));
        let model = gpt(cfg())?.build(&init)?;
        load_state_dict(&model, &relocate_state_dict(&model, &whole)?)?;
        collect_state_dict(&model, &state_dict(&model))
    })
    .unwrap()
    .swap_remove(0);
    let at2 = local::run(2, |comm| {
        let init = Build::cpu(SEED + 1).with_tp(Group::new(Box::new(comm)));
        let model = gpt(cfg())?.build(&init)?;
        load_state_dict(&model, &relocate_state_dict(&model, &at4)?)?;
        collect_state_dict(&model, &state_dict(&model))
    })
    .unwrap();
    for got in at2 {
        for ((n, a), (_, b)) in got.iter().zip(&whole) {
            assert_eq!(max_rel_diff(a, b).unwrap(), 0.0, "tp 4 -> 2: {n}");
        }
    }
}

#[test]
fn bad_splits_and_shapes_are_clear_errors() {
    // 4 heads over 8 ranks? n_embd 16 has 4 heads; vocabulary 10 over 4 ranks.
    let errs = local::run(4, |comm| {
        let init = Build::cpu(SEED).with_tp(Group::new(Box::new(comm)));
        let heads = gpt(GptConfig {
            n_head: 2,
            n_embd: 16,
            ..cfg()
        })?
        .build(&init)
        .err()
        .map(|e| e.to_string());
        let vocab = gpt(GptConfig {
            vocab_size: 10,
            ..cfg()
        })?
        .build(&init)
        .err()
        .map(|e| e.to_string());
        // A whole state loaded without relocating: shard shapes do not fit.
        let model = gpt(cfg())?.build(&init)?;
        let whole = gpt(cfg())?.build(&Build::cpu(SEED))?;
        let load = load_state_dict(&model, &state_dict(&whole)).err();
        let relocate_shard = relocate_state_dict(&model, &state_dict(&model)).err();
        Ok((heads, vocab, load, relocate_shard))
    })
    .unwrap();
    for (heads, vocab, load, relocate_shard) in errs {
        let heads = heads.expect("2 heads split over 4 ranks must fail");
        assert!(heads.contains("2 heads cannot be split over 4"), "{heads}");
        let vocab = vocab.expect("a vocabulary of 10 over 4 ranks must fail");
        assert!(
            vocab.contains("vocabulary of 10 rows") && vocab.contains("pad"),
            "{vocab}"
        );
        match load {
            Some(Error::State(m)) => assert!(m.contains("relocate_state_dict first"), "{m}"),
            e => panic!("loading a whole state into shards: {e:?}"),
        }
        match relocate_shard {
            Some(Error::State(m)) => assert!(m.contains("whole parameter"), "{m}"),
            e => panic!("relocating a shard: {e:?}"),
        }
    }
}
