//! A mixture-of-experts run records its balance: trained through the front door with its
//! experts split over two ranks, its record holds the load-balancing loss and each mixture's
//! tokens per expert (those of the serial oracle's first step), and the report page shows
//! them.

use std::collections::BTreeMap;
use std::sync::Arc;

use pipewright::distributed::topology::Layout;
use pipewright::engine::serial::{SerialTrainer, TrainOptions};
use pipewright::experiment::report::experts::AUX_LOSS_TAG;
use pipewright::experiment::report::{render, RunRecord};
use pipewright::model::nn::optim::OptimSpec;
use pipewright::model::nn::optim::{AdamW, AdamWConfig};
use pipewright::parallel::loss::CrossEntropy;
use pipewright::trainer::{Data, Run, TrainSpec, Trainer};
use pipewright::{Batch, Build, ModelSpec};
use pipewright_models::moe::{MoeConfig, MoeNames};
use pipewright_models::tasks::Adder;
use pipewright_models::{llama, LlamaConfig, Task};

const GLOBAL: usize = 8;
const MICRO: usize = 2;

fn config() -> LlamaConfig {
    LlamaConfig {
        moe: Some(MoeConfig {
            n_experts: 4,
            top_k: 2,
            moe_hidden: 12,
            shared_experts: 0,
            norm_topk: true,
            aux_loss_coef: 0.01,
            names: MoeNames::Mixtral,
            moe_every: 1,
        }),
        ..LlamaConfig::new(10, 6, 2, 4, 16)
    }
}

/// Every tag of `tags.csv` at step `count`.
fn tags_at(dir: &std::path::Path, count: u64) -> BTreeMap<String, f64> {
    let text = std::fs::read_to_string(dir.join("tags.csv")).unwrap();
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let mut f = l.split(',');
            let c: u64 = f.next()?.parse().ok()?;
            let (tag, v) = (f.next()?, f.next()?.parse().ok()?);
            (c == count).then(|| (tag.to_string(), v))
        })
        .collect()
}

#[test]
fn a_mixture_records_its_auxiliary_loss_and_tokens_per_expert_and_the_report_shows_them() {
    let task = Arc::new(Adder::new(2, 0).unwrap());
    let layout = Layout::new(1, 1, 2).unwrap().with_ep(2).unwrap();
    let mut train = TrainSpec::new(layout, GLOBAL, MICRO, 3);
    train.seed = 7;
    let t = task.clone();
    let data: Data = Arc::new(move |s, n| t.batch(s, n).map(|(x, y)| Batch::pair(x, y)));
    let spec: Arc<dyn ModelSpec + Send + Sync> = Arc::new(config());
    let dir = std::env::temp_dir().join(format!("pw-moe-record-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    Trainer::new(Run::new(train.clone(), spec, data), None)
        .unwrap()
        .losses(&dir, None)
        .unwrap();

    // The serial oracle's first step routes the same tokens.
    let stage = llama(config()).unwrap().build(&Build::cpu(7)).unwrap();
    let opt = Box::new(AdamW::new(stage.params(), AdamWConfig::default()).unwrap());
    let opts = TrainOptions {
        spec: TrainSpec {
            seed: 7,
            optim: OptimSpec {
                lr: train.optim.lr,
                ..Default::default()
            },
            ..TrainSpec::serial()
        },
        micro_batches: GLOBAL / MICRO,
        tied: Vec::new(),
        loss: Arc::new(CrossEntropy::default()),
    };
    let mut serial = SerialTrainer::new(stage, opt, opts).unwrap();
    let (x, y) = task.batch(0, GLOBAL).unwrap();
    serial.step(&Batch::pair(x, y)).unwrap();
    let want = serial.expert_loads();
    assert_eq!(want.len(), 2, "two mixtures");

    let got = tags_at(&dir, 1);
    let aux: f64 = want.iter().map(|l| l.mean_aux()).sum();
    let d = (got[AUX_LOSS_TAG] - aux).abs() / aux;
    assert!(d < 1e-5, "aux loss {} against {aux}", got[AUX_LOSS_TAG]);
    for l in &want {
        for (e, t) in l.tokens.iter().enumerate() {
            let tag = format!("moe/{}/expert_{e}", l.layer);
            assert_eq!(got[&tag], *t, "{tag}");
        }
        let tag = format!("moe/{}/max_over_mean", l.layer);
        assert!((got[&tag] - l.max_over_mean()).abs() < 1e-9, "{tag}");
    }

    let page = render(&[RunRecord::read(&dir).unwrap()]);
    assert!(page.contains("<h2>Experts</h2>"), "no experts section");
    // The last logged step's tokens per expert, in expert order.
    let last = (1..=3)
        .rev()
        .find(|c| !tags_at(&dir, *c).is_empty())
        .unwrap();
    let at = tags_at(&dir, last);
    let layer = &want[1].layer;
    let tokens: Vec<String> = (0..4)
        .map(|e| format!("{:.0}", at[&format!("moe/{layer}/expert_{e}")]))
        .collect();
    let row = format!("<td>{layer}</td><td>{}</td>", tokens.join(" "));
    assert!(page.contains(&row), "no row {row}");
    let _ = std::fs::remove_dir_all(&dir);
}
