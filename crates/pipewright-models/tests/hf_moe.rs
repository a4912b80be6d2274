//! A Mixtral and a Qwen3-MoE from Hugging Face (`tools/make_moe_fixtures.py hf`:
//! `MixtralForCausalLM` and `Qwen3MoeForCausalLM` saved sharded, a batch, its logits, loss and
//! every gradient; the Qwen3 with wider heads, per-head query/key norms and a dense first
//! block) load into layouts with their experts
//! split over ranks (and over tensor-parallel ranks), each rank reading its own experts, and
//! computes transformers' logits and loss within 1e-5 and every gradient (routers included)
//! within 1e-4; exported back it holds
//! the same tensors, bit for bit, and the same config. The layouts compute on `PW_TEST_DEVICE`
//! (`cpu` unless set; `cuda` in `tools/gpu-checks.sh`, ranks as threads sharing the GPU).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use pipewright::distributed::comm::local;
use pipewright::distributed::topology::Layout;
use pipewright::engine::checkpoint::{HfWeights, Reader, TensorPart};
use pipewright::engine::varuna::{Varuna, VarunaOptions};
use pipewright::model::nn::max_rel_diff;
use pipewright::model::nn::optim::{LrSchedule, Optimizer, Sgd, SgdConfig};
use pipewright::model::Shard;
use pipewright::parallel::data_parallel::shard_batch;
use pipewright::parallel::tensor_parallel::part;
use pipewright::{Batch, ModelSpec};
use pipewright_models::{hf, ModelConfig};

/// The learning rate of the one SGD step whose update gives the gradient back: large, so that
/// the update dwarfs the parameter and the gradient reads back to f32's precision.
const LR: f64 = 1000.0;

fn fixtures() -> PathBuf {
    // Where cargo runs it, or (a test binary carried to a GPU machine) where the runner says.
    let dir = std::env::var("CARGO_MANIFEST_DIR").unwrap_or(env!("CARGO_MANIFEST_DIR").into());
    Path::new(&dir).join("tests/fixtures")
}

fn sgd(params: Vec<(String, candle_core::Var)>) -> pipewright::Result<Box<dyn Optimizer>> {
    let cfg = SgdConfig {
        momentum: 0.0,
        weight_decay: 0.0,
        ..Default::default()
    };
    Ok(Box::new(Sgd::new(params, cfg)?))
}

/// What one rank computed from the Mixtral loaded at a layout: the evaluation's logits and
/// loss, the training step's loss, and the gradient of each parameter it holds.
struct Computed {
    logits: Option<Tensor>,
    loss: f64,
    step_loss: f64,
    grads: BTreeMap<String, Tensor>,
    /// How this rank's tensor-parallel parts are split.
    shards: HashMap<String, Shard>,
}

fn compute(dir: &Path, layout: Layout, f: &HashMap<String, Tensor>, ckpt: &Path) -> Vec<Computed> {
    let ModelConfig::Llama { mut llama, vocab } = hf::config_from_dir(dir).unwrap() else {
        panic!("a Mixtral reads as a Llama with mixtures")
    };
    // transformers' loss here has no auxiliary term.
    llama.moe = llama.moe.map(|m| pipewright_models::moe::MoeConfig {
        aux_loss_coef: 0.0,
        ..m
    });
    let model = ModelConfig::Llama { llama, vocab };
    let seq = model.build().unwrap();
    let ids = f["input_ids"].to_dtype(DType::U32).unwrap();
    let batch = Batch::pair(ids, f["targets"].clone());
    let rows = batch.rows().unwrap();
    let mut opts = VarunaOptions::new(layout, rows, rows / layout.dp)
        .with_spec(|s| s.optim.lr = LrSchedule::Constant { lr: LR });
    opts.device = pipewright::runtime::device::test_device().unwrap();
    local::run(layout.world(), |comm| {
        let mut v = Varuna::new(&seq, Box::new(comm), opts.clone())?;
        v.set_optimizer(sgd)?;
        v.load_pretrained(dir, &|n| model.hf_names(n))?;
        v.checkpoint(ckpt, &Default::default())?;
        let e = v.evaluate(&batch, true)?;
        let before: BTreeMap<String, Tensor> = v.parameters()?.into_iter().collect();
        let mine = shard_batch(&batch, v.coords().dp_rank, layout.dp)?;
        let step_loss = v.step(&mine)?.loss;
        let mut grads = BTreeMap::new();
        // Another expert-parallel rank's experts come as its tensor-parallel parts: this
        // rank's own parameters are compared.
        let own: Vec<String> = v
            .pipeline()
            .params()
            .iter()
            .map(|(n, _)| n.clone())
            .collect();
        for (n, after) in v.parameters()? {
            if layout.tp == 1 || own.contains(&n) {
                let g = ((&before[&n] - after)? / LR)?;
                grads.insert(n.clone(), g.to_device(&Device::Cpu)?);
            }
        }
        Ok(Computed {
            logits: e.output.map(|o| o.to_device(&Device::Cpu)).transpose()?,
            loss: e.loss,
            step_loss,
            grads,
            shards: v.pipeline().shards().into_iter().collect(),
        })
    })
    .unwrap()
}

/// Every tensor of the Hugging Face directory `dir`, whole, by name.
fn tensors(dir: &Path) -> Vec<(String, Vec<f32>)> {
    let w = HfWeights::open(dir).unwrap();
    w.shapes()
        .keys()
        .map(|n| {
            let t = w.read(n, TensorPart::WHOLE).unwrap();
            (
                n.clone(),
                t.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            )
        })
        .collect()
}

#[test]
fn mixtral_and_qwen3_moe_load_at_expert_parallel_layouts_with_transformers_numbers() {
    for name in ["mixtral", "qwen3moe"] {
        parity(name);
    }
}

/// The fixture model `name` at every layout: logits, losses and gradients, and the export back.
fn parity(name: &str) {
    let file = fixtures().join(format!("{name}_parity.safetensors"));
    let f = candle_core::safetensors::load(file, &Device::Cpu).unwrap();
    let dir = fixtures().join(format!("hf-{name}"));
    let want_loss = f["loss"].to_vec1::<f32>().unwrap()[0] as f64;
    let l = |pp, dp, ep| Layout::new(pp, 1, dp).unwrap().with_ep(ep).unwrap();
    let tp2 = Layout::new(1, 2, 2).unwrap().with_ep(2).unwrap();
    for (i, layout) in [l(1, 1, 1), l(1, 2, 2), l(2, 2, 2), tp2]
        .into_iter()
        .enumerate()
    {
        let tmp = std::env::temp_dir().join(format!("pw-hf-{name}-{}-{i}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        let ranks = compute(&dir, layout, &f, &tmp.join("ckpt"));
        let mut seen = 0;
        for (r, c) in ranks.iter().enumerate() {
            let logits = c.logits.as_ref().expect("every rank has the output");
            let e = max_rel_diff(logits, &f["logits"]).unwrap();
            assert!(e < 1e-5, "{layout}, rank {r}: logits off by {e:e}");
            for loss in [c.loss, c.step_loss] {
                let d = (loss - want_loss).abs() / want_loss;
                assert!(
                    d < 1e-5,
                    "{layout}, rank {r}: loss {loss} against {want_loss}"
                );
            }
            for (n, g) in &c.grads {
                let want = f
                    .get(&format!("grad.{n}"))
                    .unwrap_or_else(|| panic!("no gradient of {n} in the fixture"));
                let want = match c.shards.get(n) {
                    Some(s) => part(want, s.axis, s.stride, s.index, s.count).unwrap(),
                    None => want.clone(),
                };
                let e = max_rel_diff(g, &want).unwrap();
                assert!(e < 1e-4, "{layout}, rank {r}: gradient of {n} off by {e:e}");
                seen += 1;
            }
        }
        let theirs = f.keys().filter(|k| k.starts_with("grad.")).count();
        assert!(
            seen >= theirs,
            "{layout}: {seen} gradients checked of {theirs}"
        );

        // Exported back from the checkpoint saved at this layout: the same tensors, bit for
        // bit, and the same config.
        let model = hf::config_from_dir(&dir).unwrap();
        let out = tmp.join("hf");
        hf::export(&Reader::open(&tmp.join("ckpt")).unwrap(), &model, &out).unwrap();
        let (theirs, ours) = (tensors(&dir), tensors(&out));
        assert_eq!(theirs.len(), ours.len(), "{layout}: tensor count");
        for ((a, x), (b, y)) in theirs.iter().zip(&ours) {
            assert_eq!(a, b);
            assert!(x == y, "{layout}: `{a}` differs after the round trip");
        }
        assert_eq!(hf::config_from_dir(&out).unwrap(), model, "config.json");
        let _ = std::fs::remove_dir_all(&tmp);
    }
}
