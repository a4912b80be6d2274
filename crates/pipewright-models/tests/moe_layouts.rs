//! A Llama whose blocks are mixtures of experts (Mixtral's form, with its load-balancing loss
//! in the objective) trains to the serial run's losses, gradient norms and parameters on
//! pipeline and data-parallel layouts: the auxiliary loss's gradient is given where each
//! router sits, weighted by the global batch's micro-batches, whatever the layout.

use pipewright::model::nn::optim::OptimSpec;
use pipewright::parallel::dims::ParallelSpec;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use candle_core::{Device, Var};
use pipewright::distributed::comm::{local, Communicator};
use pipewright::distributed::topology::Layout;
use pipewright::engine::checkpoint::CheckpointOptions;
use pipewright::engine::serial::{SerialTrainer, TrainOptions};
use pipewright::engine::spec::TrainSpec;
use pipewright::engine::varuna::{Varuna, VarunaOptions};
use pipewright::model::expert_load::ExpertLoad;
use pipewright::model::nn::optim::{AdamW, AdamWConfig, LrSchedule, Optimizer};
use pipewright::parallel::data_parallel::ReplicaBatches;
use pipewright::parallel::loss::CrossEntropy;
use pipewright::parallel::zero::Zero;
use pipewright::{Batch, Build, Result};
use pipewright_models::moe::{MoeConfig, MoeNames};
use pipewright_models::parity::{
    watch, worst_difference, RankResult, SerialResult, CONTEXT_PARALLEL_TOLERANCE,
};
use pipewright_models::tasks::Adder;
use pipewright_models::{llama, LlamaConfig, Task, TaskShape};

const STEPS: u64 = 20;
const GLOBAL: usize = 8;
const MICRO: usize = 2;
const SEED: u64 = 3;
const LR: f64 = 1e-2;
const CLIP: f64 = 0.05;

fn config(task: &Adder) -> LlamaConfig {
    let TaskShape::Tokens { vocab, seq_len } = task.shape() else {
        panic!("the adder reads tokens")
    };
    LlamaConfig {
        moe: Some(MoeConfig {
            n_experts: 4,
            top_k: 2,
            moe_hidden: 12,
            shared_experts: 1,
            norm_topk: true,
            aux_loss_coef: 0.5,
            names: MoeNames::Mixtral,
            moe_every: 1,
        }),
        ..LlamaConfig::new(vocab, seq_len, 2, 4, 16)
    }
}

fn adamw(params: Vec<(String, Var)>) -> Result<Box<dyn Optimizer>> {
    Ok(Box::new(AdamW::new(params, AdamWConfig::default())?))
}

/// The serial oracle of the Llama `cfg`, before any step.
fn serial_trainer(cfg: LlamaConfig) -> Result<SerialTrainer> {
    let stage = llama(cfg)?.build(&Build::cpu(SEED))?;
    let opt = adamw(stage.params())?;
    let opts = TrainOptions {
        spec: TrainSpec {
            seed: SEED,
            optim: OptimSpec {
                clip: Some(CLIP),
                lr: LrSchedule::Constant { lr: LR },
                ..Default::default()
            },
            ..TrainSpec::serial()
        },
        micro_batches: GLOBAL / MICRO,
        tied: Vec::new(),
        loss: Arc::new(CrossEntropy::default()),
    };
    SerialTrainer::new(stage, opt, opts)
}

/// Each step's expert loads.
type Loads = Vec<Vec<ExpertLoad>>;

fn serial(task: &Adder) -> Result<SerialResult> {
    serial_with_loads(task).map(|(r, _)| r)
}

fn serial_with_loads(task: &Adder) -> Result<(SerialResult, Loads)> {
    let mut t = serial_trainer(config(task))?;
    let (mut steps, mut grads, mut loads) = (Vec::new(), Vec::new(), Vec::new());
    for s in 0..STEPS {
        let (x, y) = task.batch(s, GLOBAL)?;
        let batch = Batch::pair(x, y);
        let (_, g, _) = t.loss_and_grads(&batch)?;
        grads.push(g.iter().map(|(n, g)| (n.clone(), g.clone())).collect());
        let r = t.step(&batch)?;
        steps.push((r.loss, r.grad_norm));
        loads.push(t.expert_loads());
    }
    let params = t
        .model()
        .params()
        .into_iter()
        .map(|(n, v)| Ok((n, v.as_tensor().copy()?)))
        .collect::<Result<_>>()?;
    Ok((
        SerialResult {
            steps,
            grads,
            params,
        },
        loads,
    ))
}

/// Fails unless `got` routed each step's tokens as `want` did, with its auxiliary losses.
fn same_loads(got: &Loads, want: &Loads, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (s, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.len(), w.len(), "{what}, step {s}: layers");
        assert!(!g.is_empty(), "{what}: no loads");
        for (a, b) in g.iter().zip(w) {
            assert_eq!(
                (&a.layer, &a.tokens, a.passes),
                (&b.layer, &b.tokens, b.passes),
                "{what}, step {s}"
            );
            let d = (a.aux - b.aux).abs() / b.aux.abs().max(1e-12);
            assert!(d < 1e-5, "{what}, step {s}, {}: aux off by {d:e}", a.layer);
        }
    }
}

fn rank(task: &Adder, world: Box<dyn Communicator>, layout: Layout) -> Result<RankResult> {
    resumed(task, world, (layout, Zero::Off), 0..STEPS, None, None).map(|(r, _)| r)
}

/// Steps `steps` at `layout`, after loading the checkpoint `resume` if given, saving one into
/// `save` at the end if given.
fn resumed(
    task: &Adder,
    world: Box<dyn Communicator>,
    (layout, zero): (Layout, Zero),
    steps: Range<u64>,
    resume: Option<&Path>,
    save: Option<&Path>,
) -> Result<(RankResult, Loads)> {
    let opts = VarunaOptions::of(TrainSpec {
        seed: SEED,
        parallel: ParallelSpec {
            zero,
            ..ParallelSpec::new(layout)
        },
        optim: OptimSpec {
            clip: Some(CLIP),
            lr: LrSchedule::Constant { lr: LR },
            ..Default::default()
        },
        ..TrainSpec::new(layout, GLOBAL, MICRO, STEPS)
    });
    let mut v = Varuna::new(&llama(config(task))?, world, opts)?;
    assert_eq!(v.zero(), if layout.dp > 1 { zero } else { Zero::Off });
    v.set_optimizer(adamw)?;
    let log = watch(&mut v, None);
    let first_step = steps.start as usize;
    if let Some(p) = resume {
        assert_eq!(v.load_checkpoint(p)?.step, steps.start);
    }
    let loader = ReplicaBatches::new(
        |s, n| task.batch(s, n).map(|(x, y)| Batch::pair(x, y)),
        GLOBAL,
        v.coords().dp_rank,
        layout.dp,
        Device::Cpu,
    )?;
    let mut out = Vec::new();
    let mut loads = Vec::new();
    for s in steps {
        let o = v.step(&loader.batch(s)?)?;
        out.push((o.loss, o.grad_norm, o.overflow));
        loads.push(v.expert_loads().to_vec());
    }
    if let Some(p) = save {
        v.checkpoint(p, &CheckpointOptions::default())?;
    }
    let mut params = v.parameters()?;
    if layout.tp > 1 {
        // Another rank's experts come as its tensor-parallel parts, whose splits this rank does
        // not hold: compare this rank's own.
        let own: Vec<&String> = v.pipeline().params().iter().map(|(n, _)| n).collect();
        params.retain(|(n, _)| own.contains(&n));
    }
    let r = RankResult::of(&v, out, params, &log, first_step)?;
    Ok((r, loads))
}

#[test]
fn a_mixture_of_experts_llama_trains_as_serial_on_pipeline_and_data_parallel_layouts() {
    let task = Adder::new(2, 0).unwrap();
    let want = serial(&task).unwrap();
    for (pp, dp) in [(1, 1), (2, 1), (1, 2), (2, 2)] {
        let layout = Layout::new(pp, 1, dp).unwrap();
        let got = local::run(layout.world(), |c| rank(&task, Box::new(c), layout)).unwrap();
        for (r, g) in got.iter().enumerate() {
            let worst = worst_difference(g, &want).unwrap();
            assert!(worst < 1e-5, "pp {pp} dp {dp}, rank {r}: off by {worst:e}");
        }
    }
}

#[test]
fn expert_parallel_layouts_train_as_serial() {
    let task = Adder::new(2, 0).unwrap();
    let (want, want_loads) = serial_with_loads(&task).unwrap();
    let z = |n: u8| Zero::try_from(n).unwrap();
    // (pp, tp, dp, ep, ZeRO)
    let layouts = [
        (1, 1, 2, 2, z(0)),
        (1, 1, 4, 4, z(0)),
        (1, 1, 4, 2, z(0)),
        (2, 1, 2, 2, z(0)),
        // Each expert split over the tensor-parallel ranks as an MLP is.
        (1, 2, 1, 1, z(0)),
        (1, 2, 2, 2, z(0)),
        // ZeRO shards the experts over the ranks holding them (alone at dp 2, in pairs at
        // dp 4), the rest over every replica.
        (1, 1, 2, 2, z(1)),
        (1, 1, 2, 2, z(2)),
        (1, 1, 2, 2, z(3)),
        (1, 1, 4, 2, z(1)),
        (1, 1, 4, 2, z(2)),
        (1, 1, 4, 2, z(3)),
        (2, 1, 2, 2, z(2)),
    ];
    for (pp, tp, dp, ep, zero) in layouts {
        let layout = Layout::new(pp, tp, dp).unwrap().with_ep(ep).unwrap();
        let got = local::run(layout.world(), |c| {
            resumed(&task, Box::new(c), (layout, zero), 0..STEPS, None, None)
        })
        .unwrap();
        for (r, (g, loads)) in got.iter().enumerate() {
            // Every rank knows every layer's loads over the global batch.
            same_loads(
                loads,
                &want_loads,
                &format!("{layout} ZeRO {zero}, rank {r}"),
            );
            let worst = worst_difference(g, &want).unwrap();
            assert!(
                worst < 1e-5,
                "{layout} ZeRO {zero}, rank {r}: off by {worst:e}"
            );
            if pp == 1 && tp == 1 {
                // Every expert, whichever rank of the group holds it.
                assert_eq!(g.params.len(), want.params.len(), "{layout}, rank {r}");
            }
        }
    }
}

#[test]
fn a_checkpoint_saved_at_ep_2_under_zero_1_resumes_at_ep_1_and_at_ep_4_under_zero_3() {
    let task = Adder::new(2, 0).unwrap();
    let want = serial(&task).unwrap();
    let half = STEPS / 2;
    let dir = std::env::temp_dir().join(format!("pw-moe-ep-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let at = |ep: usize| Layout::new(1, 1, 4).unwrap().with_ep(ep).unwrap();
    let first = local::run(4, |c| {
        resumed(
            &task,
            Box::new(c),
            (at(2), Zero::OptimizerState),
            0..half,
            None,
            Some(&dir),
        )
    })
    .unwrap();
    for (ep, zero) in [(1, Zero::Off), (4, Zero::Parameters)] {
        let second = local::run(4, |c| {
            resumed(
                &task,
                Box::new(c),
                (at(ep), zero),
                half..STEPS,
                Some(&dir),
                None,
            )
        })
        .unwrap();
        for (r, ((a, _), (b, _))) in first.iter().zip(&second).enumerate() {
            // The resumed half's gradients (its pieces are of its own ZeRO stage).
            let whole = RankResult {
                steps: a.steps.iter().chain(&b.steps).copied().collect(),
                ..b.clone()
            };
            let worst = worst_difference(&whole, &want).unwrap();
            assert!(worst < 1e-5, "ep 2 -> {ep}, rank {r}: off by {worst:e}");
            assert_eq!(whole.params.len(), want.params.len(), "ep {ep}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_load_balancing_loss_trains_the_routers() {
    // Without the auxiliary loss's gradient a router learns from the language loss alone:
    // the same run with the coefficient at 0 ends with other router weights.
    let task = Adder::new(2, 0).unwrap();
    let with = serial(&task).unwrap();
    let cfg = config(&task);
    let without_cfg = LlamaConfig {
        moe: cfg.moe.map(|m| MoeConfig {
            aux_loss_coef: 0.0,
            ..m
        }),
        ..cfg
    };
    let mut t = serial_trainer(without_cfg).unwrap();
    for s in 0..STEPS {
        let (x, y) = task.batch(s, GLOBAL).unwrap();
        t.step(&Batch::pair(x, y)).unwrap();
    }
    let router = "model.layers.0.block_sparse_moe.gate.weight";
    let a = &with.params[router];
    let b = t
        .model()
        .params()
        .into_iter()
        .find(|(n, _)| n == router)
        .unwrap()
        .1;
    let d = pipewright::model::nn::max_rel_diff(b.as_tensor(), a).unwrap();
    assert!(d > 1e-4, "the auxiliary loss changed nothing: {d:e}");
}

#[test]
fn context_parallel_rings_sum_the_routing_statistics() {
    // Sequences of 12 tokens split over a ring of 2 (four chunks of 3): each rank routes its
    // tokens, and the auxiliary loss counts the ring's.
    let task = Adder::new(4, 0).unwrap();
    let (want, want_loads) = serial_with_loads(&task).unwrap();
    for (cp, dp, ep) in [(2, 1, 1), (2, 2, 2)] {
        let layout = Layout::new(1, 1, dp)
            .unwrap()
            .with_cp(cp)
            .unwrap()
            .with_ep(ep)
            .unwrap();
        let got = local::run(layout.world(), |c| {
            resumed(
                &task,
                Box::new(c),
                (layout, Zero::Off),
                0..STEPS,
                None,
                None,
            )
        })
        .unwrap();
        for (r, (g, loads)) in got.iter().enumerate() {
            same_loads(loads, &want_loads, &format!("{layout}, rank {r}"));
            let worst = worst_difference(g, &want).unwrap();
            assert!(
                worst < CONTEXT_PARALLEL_TOLERANCE,
                "{layout}, rank {r}: off by {worst:e}"
            );
        }
    }
}

#[test]
fn a_mixture_under_sequence_parallelism_is_refused_for_now() {
    let task = Adder::new(2, 0).unwrap();
    let layout = Layout::new(1, 2, 1).unwrap();
    let e = local::run(2, |c| {
        let opts = VarunaOptions::of(TrainSpec {
            parallel: ParallelSpec {
                sequence_parallel: true,
                ..ParallelSpec::new(layout)
            },
            ..TrainSpec::new(layout, GLOBAL, MICRO, STEPS)
        });
        Varuna::new(&llama(config(&task))?, Box::new(c), opts).map(|_| ())
    })
    .expect_err("sequence parallelism splits no mixture yet");
    assert!(e.to_string().contains("--sequence-parallel"), "{e}");
}

/// The planner and the memory check size a mixture-of-experts Llama from its shapes: their
/// parameters are the built model's, with mixtures in every block or every other one.
#[test]
fn the_shapes_count_every_expert() {
    use pipewright::ModelSpec;
    let task = Adder::new(2, 0).unwrap();
    for every in [1, 2] {
        let mut cfg = config(&task);
        cfg.moe = cfg.moe.map(|m| MoeConfig {
            moe_every: every,
            ..m
        });
        let built: usize = llama(cfg)
            .unwrap()
            .build(&Build::cpu(0))
            .unwrap()
            .params()
            .iter()
            .map(|(_, v)| v.as_tensor().elem_count())
            .sum();
        let shapes = cfg.shapes(&[]).unwrap().unwrap();
        let counted: f64 = shapes
            .layers
            .iter()
            .map(|l| l.params * l.count as f64)
            .sum();
        assert_eq!(counted as usize, built, "every {every}");
        assert_eq!(cfg.param_count() as usize, built, "every {every}");
    }
}

/// The planner searches expert parallelism for a mixture (ep dividing both dp and the
/// experts) and none for a dense model; at ep 4 a rank's predicted peak holds a quarter of the
/// experts, and the dispatch and combine add to the step's communication.
#[test]
fn the_planner_searches_ep_and_costs_its_exchange() {
    use pipewright::plan::search::candidates;
    use pipewright::plan::{estimate, Cluster, Hardware, Request};
    use pipewright::ModelSpec;
    let task = Adder::new(2, 0).unwrap();
    let cfg = config(&task);
    let hw = Hardware::load("cpu-2core").unwrap();
    let profile = |c: &LlamaConfig| c.shapes(&[]).unwrap().unwrap().profile(&hw, 4).unwrap();
    let req = Request {
        world: 4,
        memory_bytes: 1e12,
        global_batch: GLOBAL,
        top: 1,
    };
    let moe = profile(&cfg);
    let eps: std::collections::BTreeSet<usize> = candidates(&req, &moe)
        .iter()
        .map(|c| c.parallel.layout.ep)
        .collect();
    assert_eq!(eps.into_iter().collect::<Vec<_>>(), vec![1, 2, 4]);
    let dense = profile(&LlamaConfig { moe: None, ..cfg });
    assert!(candidates(&req, &dense)
        .iter()
        .all(|c| c.parallel.layout.ep == 1));

    let cluster = Cluster::new(&hw, 4, None).unwrap();
    let at = |ep: usize| {
        let c = candidates(&req, &moe)
            .into_iter()
            .find(|c| {
                c.parallel.layout.dp == 4
                    && c.parallel.layout.ep == ep
                    && c.parallel.zero == Zero::Off
                    && c.micro_batch == 2
            })
            .unwrap();
        estimate(&moe, &cluster, &c).unwrap().0
    };
    let (one, four) = (at(1), at(4));
    let experts = (cfg.n_layer * 4 * 3 * cfg.dim * 12) as f64;
    // Parameters, gradients and AdamW's state of three quarters of the experts fewer.
    let saved = one.max_peak_bytes() - four.max_peak_bytes();
    assert!(
        saved >= 0.75 * experts * 16.0 * 0.99,
        "ep 4 saves {saved} bytes of {} expected",
        0.75 * experts * 16.0
    );
    assert!(
        four.breakdown.communication_s > one.breakdown.communication_s,
        "the exchange costs nothing: {:?} against {:?}",
        four.breakdown,
        one.breakdown
    );
}
