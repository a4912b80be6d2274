//! Pretrained weights in and out: Hugging Face directories of GPT-2 and of Llama (sharded over
//! two files with an index; `tools/make_fixtures.py hf`) load into tensor- and pipeline-
//! parallel layouts, each rank reading its own slices, and compute the logits transformers
//! computed; exported back they hold the same tensors, bit for bit. A directory of another
//! architecture, or one lacking a tensor, is a clear error.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use pipewright::distributed::comm::local;
use pipewright::distributed::topology::Layout;
use pipewright::engine::checkpoint::{HfWeights, Reader, TensorPart};
use pipewright::engine::varuna::{Varuna, VarunaOptions};
use pipewright::model::nn::max_rel_diff;
use pipewright::model::nn::optim::OptimizerConfig;
use pipewright::Batch;
use pipewright::ModelSpec;
use pipewright_models::{hf, ModelConfig};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn parity(file: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(fixtures().join(file), &Device::Cpu).unwrap()
}

/// Logits of the parity batch from `model` loaded from `dir` on `layout`, and the checkpoint
/// it then saves into `ckpt`.
fn load(dir: &Path, layout: Layout, f: &HashMap<String, Tensor>, ckpt: &Path) -> Tensor {
    let model = hf::config_from_dir(dir).unwrap();
    let (seq, tied) = (model.build().unwrap(), model.tied());
    let ids = f["input_ids"].to_dtype(DType::U32).unwrap();
    let batch = Batch::pair(ids, f["targets"].clone());
    let opts = VarunaOptions {
        shared_weights: tied,
        ..VarunaOptions::new(layout, 3, 3 / layout.dp)
    };
    let outs = local::run(layout.world(), |comm| {
        let mut v = Varuna::new(&seq, Box::new(comm), opts.clone())?;
        v.set_optimizer(|ps| OptimizerConfig::default().build(ps, &[]))?;
        v.load_pretrained(dir, &|n| model.hf_names(n))?;
        let out = v.evaluate(&batch, true)?.output;
        v.checkpoint(ckpt, &Default::default())?;
        Ok(out)
    })
    .unwrap();
    outs.into_iter().flatten().next().unwrap()
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

fn round_trip(name: &str, parity_file: &str, layouts: &[Layout]) {
    let f = parity(parity_file);
    let dir = fixtures().join(name);
    let model = hf::config_from_dir(&dir).unwrap();
    for (i, &layout) in layouts.iter().enumerate() {
        let tmp = std::env::temp_dir().join(format!("pw-pre-{}-{name}-{i}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        let logits = load(&dir, layout, &f, &tmp.join("ckpt"));
        let e = max_rel_diff(&logits, &f["logits"]).unwrap();
        assert!(e < 1e-5, "{name} at {layout}: logits relative error {e:e}");
        // Exported back: the same tensors, bit for bit.
        let r = Reader::open(&tmp.join("ckpt")).unwrap();
        let out = tmp.join("hf");
        hf::export(&r, &model, &out).unwrap();
        let (mut theirs, ours) = (tensors(&dir), tensors(&out));
        if matches!(model, ModelConfig::Gpt { .. }) {
            // GPT-2's file leaves out the head tied to the embedding; the export writes both.
            let wte = theirs
                .iter()
                .find(|(n, _)| n == "transformer.wte.weight")
                .unwrap()
                .1
                .clone();
            theirs.push(("lm_head.weight".into(), wte));
            theirs.sort_by(|a, b| a.0.cmp(&b.0));
        }
        assert_eq!(theirs.len(), ours.len(), "{name}: tensor count");
        for ((a, x), (b, y)) in theirs.iter().zip(&ours) {
            assert_eq!(a, b);
            assert!(
                x == y,
                "{name} at {layout}: `{a}` differs after the round trip"
            );
        }
        let back = hf::config_from_dir(&out).unwrap();
        assert_eq!(back, model, "{name}: config.json round trip");
    }
}

#[test]
fn gpt2_loads_into_any_layout_and_exports_the_same_tensors() {
    let l = |pp, tp, dp| Layout::new(pp, tp, dp).unwrap();
    round_trip(
        "hf-gpt2",
        "gpt2_parity.safetensors",
        &[l(1, 1, 1), l(1, 2, 1), l(2, 2, 1)],
    );
}

#[test]
fn a_sharded_llama_loads_into_any_layout_and_exports_the_same_tensors() {
    let l = |pp, tp, dp| Layout::new(pp, tp, dp).unwrap();
    round_trip(
        "hf-llama",
        "llama_parity.safetensors",
        &[l(1, 1, 1), l(1, 2, 1), l(2, 2, 1)],
    );
}

#[test]
fn other_architectures_and_missing_tensors_are_clear_errors() {
    let tmp = std::env::temp_dir().join(format!("pw-pre-bad-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::write(
        tmp.join("config.json"),
        r#"{"model_type": "bert", "vocab_size": 10}"#,
    )
    .unwrap();
    let e = hf::config_from_dir(&tmp).unwrap_err().to_string();
    assert!(e.contains("describes a bert model"), "{e}");
    // The Llama without one of its shards' tensors.
    let src = fixtures().join("hf-llama");
    for e in std::fs::read_dir(&src).unwrap().flatten() {
        std::fs::copy(e.path(), tmp.join(e.file_name())).unwrap();
    }
    let ip = tmp.join("model.safetensors.index.json");
    let mut index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&ip).unwrap()).unwrap();
    let second = index["weight_map"]["lm_head.weight"]
        .as_str()
        .unwrap()
        .to_string();
    let keep = index["weight_map"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(_, f)| f.as_str() != Some(&second))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect::<serde_json::Map<_, _>>();
    index["weight_map"] = keep.into();
    std::fs::write(&ip, index.to_string()).unwrap();
    std::fs::remove_file(tmp.join(&second)).unwrap();
    let model = hf::config_from_dir(&tmp).unwrap();
    let seq = model.build().unwrap();
    let err = local::run(2, |comm| {
        let mut v = Varuna::new(
            &seq,
            Box::new(comm),
            VarunaOptions::new(Layout::new(1, 2, 1)?, 3, 3),
        )?;
        v.set_optimizer(|ps| OptimizerConfig::default().build(ps, &[]))?;
        v.load_pretrained(&tmp, &|n| model.hf_names(n))
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("has no tensor for parameter `"), "{err}");
}
