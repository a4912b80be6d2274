//! A run as data: a `RunSpec` reads back from its JSON, trains through the front door, and
//! morphs into a smaller world that trains to the same losses.

use std::sync::Arc;

use pipewright::distributed::topology::Layout;
use pipewright::model::nn::optim::{LrSchedule, OptimizerConfig, SgdConfig};
use pipewright::plan::Hardware;
use pipewright::trainer::{Balance, TrainSpec};
use pipewright::trainer::{Data, Run, Trainer};
use pipewright::Batch;
use pipewright_models::{CnnConfig, GptConfig, LlamaConfig, ModelConfig, RunSpec, Task, TaskSpec};

fn gpt_spec(layout: Layout) -> RunSpec {
    let mut train = TrainSpec::new(layout, 8, 2, 3);
    train.seed = 5;
    train.optim.clip = Some(1.0);
    train.optim.lr = LrSchedule::WarmupCosine {
        lr: 3e-3,
        warmup: 1,
        total: 3,
        min_lr: 3e-4,
    };
    RunSpec {
        model: ModelConfig::Gpt {
            gpt: GptConfig {
                vocab_size: 10,
                block_size: 6,
                n_layer: 4,
                n_head: 2,
                n_embd: 16,
                dropout: 0.0,
            },
            vocab: 10,
        },
        task: TaskSpec::Adder { digits: 2 },
        train,
    }
}

/// The losses of the spec's steps, trained by ranks as threads through the front door.
fn losses(spec: &RunSpec) -> Vec<f64> {
    let task: Arc<dyn Task> = spec.build_task().unwrap().into();
    let data: Data = Arc::new(move |s, n| task.batch(s, n).map(|(x, y)| Batch::pair(x, y)));
    let run = Run::new(spec.train.clone(), Arc::new(spec.model.clone()), data);
    let trainer = Trainer::new(run, None).unwrap();
    // A run directory of its own (rank 0 records the run there), removed after.
    static RUNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("pw-run-spec-{}-{n}", std::process::id()));
    let losses = trainer.losses(&dir, None).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    losses
}

#[test]
fn a_spec_reads_back_from_its_json() {
    let mut spec = gpt_spec(Layout::new(2, 1, 2).unwrap());
    spec.train.pipeline.balance = Some("2,1,1,2".parse().unwrap());
    spec.train.optim.optimizer = OptimizerConfig::Sgd(SgdConfig {
        momentum: 0.8,
        ..Default::default()
    });
    let json = serde_json::to_value(&spec).unwrap();
    assert_eq!(
        json["layout"],
        serde_json::json!({"pp": 2, "tp": 1, "dp": 2, "cp": 1, "ep": 1})
    );
    assert_eq!(json["schedule"], "1f1b");
    assert_eq!(json["precision"], "f32");
    assert_eq!(json["balance"], "2,1,1,2");
    assert_eq!(json["optimizer"]["sgd"]["momentum"], 0.8);
    assert_eq!(json["task"], serde_json::json!({"adder": {"digits": 2}}));
    let back: RunSpec = serde_json::from_value(json).unwrap();
    assert_eq!(back, spec);
    // And through a checkpoint's meta.
    assert_eq!(RunSpec::from_meta(&spec.to_meta().unwrap()).unwrap(), spec);
    let err = RunSpec::from_meta(&serde_json::json!({"other": 1}))
        .unwrap_err()
        .to_string();
    assert!(err.contains("not saved by `pipewright train`"), "{err}");
    assert!("2,x".parse::<Balance>().is_err());
    // A spec written when the balance was recorded as `{"layers": [...]}` reads as before.
    let mut old = serde_json::to_value(&spec).unwrap();
    old["balance"] = serde_json::json!({"layers": [2, 1, 1, 2]});
    let back: RunSpec = serde_json::from_value(old).unwrap();
    assert_eq!(back.train.pipeline.balance, spec.train.pipeline.balance);
}

#[test]
fn a_morphed_spec_trains_to_the_same_losses() {
    let spec = gpt_spec(Layout::new(2, 1, 2).unwrap());
    // Without the machines the layout nearest the old one: the same pp and tp, half the
    // replicas, the same micro-batches (so the same mathematics).
    let (small, m) = spec.morph(2, None).unwrap();
    assert_eq!(small.train.parallel.layout, Layout::new(2, 1, 1).unwrap());
    assert_eq!(m.step_s, None);
    assert_eq!(small.train.batch.micro_batch, spec.train.batch.micro_batch);
    assert_eq!(
        small.train.batch.global_batch,
        spec.train.batch.global_batch
    );
    let (a, b) = (losses(&spec), losses(&small));
    assert_eq!(a.len(), 3);
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= 1e-5 * x.abs(), "{a:?} vs {b:?}");
    }
    assert!(a[2] < a[0], "the run learns: {a:?}");
}

/// A world of 2 for `spec` planned on an H100 node: planned (a predicted step), `tp_ok` of the
/// layout's tp, and a list balance made for the old stages dropped.
fn planned_morph(spec: &RunSpec, tp_ok: impl Fn(usize) -> bool) -> RunSpec {
    let hw = Hardware::load("h100-node").unwrap();
    let (planned, m) = spec.morph(2, Some((&hw, 8))).unwrap();
    let l = planned.train.parallel.layout;
    assert_eq!(l.world(), 2);
    assert!(m.step_s.is_some_and(|s| s > 0.0), "{m:?}");
    assert!(!m.why.contains("nearest"), "{m:?}");
    assert!(tp_ok(l.tp), "{l}");
    planned
}

#[test]
fn every_model_morphs_through_the_planner() {
    // The GPT's tp divides its heads and vocabulary.
    let gpt = gpt_spec(Layout::new(2, 2, 1).unwrap());
    planned_morph(&gpt, |tp| 2 % tp == 0 && 10 % tp == 0);

    let llama = RunSpec {
        model: ModelConfig::Llama {
            llama: LlamaConfig {
                vocab_size: 32,
                block_size: 16,
                n_layer: 4,
                n_head: 4,
                n_kv_head: 2,
                dim: 32,
                hidden: 64,
                norm_eps: 1e-5,
                rope_theta: 10000.0,
                moe: None,
                head_dim: None,
                qk_norm: false,
            },
            vocab: 32,
        },
        task: TaskSpec::Sort {
            len: 8,
            symbols: 16,
        },
        train: TrainSpec::new(Layout::new(2, 2, 1).unwrap(), 8, 2, 1),
    };
    planned_morph(&llama, |tp| 2 % tp == 0);

    let mut cnn = RunSpec {
        model: ModelConfig::Cnn {
            cnn: CnnConfig {
                in_channels: 3,
                classes: 4,
                width: 4,
                blocks: 4,
                blocks_per_stage: 2,
                long_skip: false,
            },
        },
        task: TaskSpec::Shapes { image_size: 8 },
        train: TrainSpec::new(Layout::new(4, 1, 1).unwrap(), 8, 2, 1),
    };
    cnn.train.pipeline.balance = Some(Balance::Layers(vec![1, 1, 1, 1]));
    // The CNN does not split over tp ranks.
    let small = planned_morph(&cnn, |tp| tp == 1);
    assert_eq!(
        small.train.pipeline.balance, None,
        "a list made for 4 stages is dropped"
    );
    // Without the machines: the layout nearest the old one.
    let (near, m) = cnn.morph(2, None).unwrap();
    assert_eq!(near.train.parallel.layout, Layout::new(2, 1, 1).unwrap());
    assert_eq!(m.step_s, None);
}

/// A mixture's fields carry their flags' names (`--moe-hidden`, `--shared-experts`,
/// `--aux-loss-coef`, `--moe-every`); a `params.json` or checkpoint meta written before the
/// rename (`hidden`, `shared`, `aux_coef`, `every`) still reads back to the same run.
#[test]
fn a_mixture_written_with_the_old_field_names_still_loads() {
    use pipewright_models::moe::{MoeConfig, MoeNames};
    let mut spec = gpt_spec(Layout::new(1, 1, 1).unwrap());
    spec.model = ModelConfig::Llama {
        llama: LlamaConfig {
            moe: Some(MoeConfig {
                n_experts: 4,
                top_k: 2,
                moe_hidden: 12,
                shared_experts: 1,
                norm_topk: true,
                aux_loss_coef: 0.25,
                names: MoeNames::Mixtral,
                moe_every: 2,
            }),
            ..LlamaConfig::new(10, 6, 2, 4, 16)
        },
        vocab: 10,
    };
    let new = serde_json::to_string(&spec).unwrap();
    for key in ["moe_hidden", "shared_experts", "aux_loss_coef", "moe_every"] {
        assert!(new.contains(&format!("\"{key}\":")), "{key} in {new}");
    }
    let old = new
        .replace("\"moe_hidden\":", "\"hidden\":")
        .replace("\"shared_experts\":", "\"shared\":")
        .replace("\"aux_loss_coef\":", "\"aux_coef\":")
        .replace("\"moe_every\":", "\"every\":");
    assert!(!old.contains("moe_every"), "{old}");
    let back: RunSpec = serde_json::from_str(&old).unwrap();
    assert_eq!(back, spec);
}
