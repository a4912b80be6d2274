//! The GPT against Hugging Face's GPT2LMHeadModel (fixture from tools/make_fixtures.py): same
//! parameter names and shapes, same loss, same gradient for every parameter. It computes on
//! `PW_TEST_DEVICE` (`cpu` unless set): on a GPU machine a `cuda` build runs the same comparison
//! there (`tools/gpu-checks.sh`).

use pipewright::model::nn::max_rel_diff;
use std::collections::HashMap;

use candle_core::{Device, Tensor};
use pipewright::engine::serial::{SerialTrainer, TrainOptions};
use pipewright::model::nn::optim::OptimSpec;
use pipewright::model::nn::optim::{LrSchedule, Sgd, SgdConfig};
use pipewright::trainer::TrainSpec;
use pipewright::{Batch, Build};
use pipewright_models::{gpt, GptConfig, TIED};

fn fixture() -> HashMap<String, Tensor> {
    // Where cargo runs it, or (a test binary carried to a GPU machine) where the runner says.
    let dir = std::env::var("CARGO_MANIFEST_DIR").unwrap_or(env!("CARGO_MANIFEST_DIR").into());
    let p = format!("{dir}/tests/fixtures/gpt2_parity.safetensors");
    candle_core::safetensors::load(p, &Device::Cpu).unwrap()
}

fn trainer(f: &HashMap<String, Tensor>, chunks: usize) -> SerialTrainer {
    let c = f["config"].to_vec1::<i64>().unwrap();
    let cfg = GptConfig {
        vocab_size: c[0] as usize,
        block_size: c[1] as usize,
        n_layer: c[2] as usize,
        n_head: c[3] as usize,
        n_embd: c[4] as usize,
        dropout: 0.0,
    };
    let dev = device();
    let init = pipewright::model::nn::Init::new(dev.clone(), candle_core::DType::F32, 0);
    let stage = gpt(cfg).unwrap().build(&Build::new(init)).unwrap();
    let params = stage.params();
    // Every parameter of ours is in the fixture with the same shape, and nothing is left over.
    let fixture_names: Vec<&String> = f.keys().filter(|k| k.starts_with("param.")).collect();
    assert_eq!(
        params.len(),
        fixture_names.len(),
        "parameter count differs from HF GPT-2"
    );
    for (n, v) in &params {
        let want = f
            .get(&format!("param.{n}"))
            .unwrap_or_else(|| panic!("HF GPT-2 has no `{n}`"));
        assert_eq!(v.dims(), want.dims(), "`{n}` shape");
        v.set(&want.to_device(&dev).unwrap()).unwrap();
    }
    let opt = Box::new(Sgd::new(params, SgdConfig::default()).unwrap());
    SerialTrainer::new(
        stage,
        opt,
        TrainOptions {
            spec: TrainSpec {
                optim: OptimSpec {
                    lr: LrSchedule::Constant { lr: 0.1 },
                    ..Default::default()
                },
                ..TrainSpec::serial()
            },
            micro_batches: chunks,
            tied: vec![(TIED.0.into(), TIED.1.into())],
            loss: std::sync::Arc::new(pipewright::parallel::loss::CrossEntropy::default()),
        },
    )
    .unwrap()
}

#[test]
fn logits_loss_and_every_gradient_match_hf_gpt2() {
    let f = fixture();
    for chunks in [1, 2, 3] {
        let t = trainer(&f, chunks);
        let ids = f["input_ids"].to_dtype(candle_core::DType::U32).unwrap();
        let batch = Batch::pair(ids, f["targets"].clone())
            .to_device(&device())
            .unwrap();
        let logits = t.predict(&batch).unwrap();
        assert!(rel_diff(&logits, &f["logits"]) < 1e-5, "logits");
        let (loss, grads, _) = t.loss_and_grads(&batch).unwrap();
        let want = f["loss"].to_vec1::<f32>().unwrap()[0] as f64;
        assert!(
            ((loss - want) / want).abs() < 1e-5,
            "chunks {chunks}: loss {loss} vs HF {want}"
        );
        for (n, _) in t.model().params() {
            let g = grads
                .get(&n)
                .unwrap_or_else(|| panic!("no gradient for `{n}`"));
            let e = rel_diff(g, &f[&format!("grad.{n}")]);
            assert!(
                e < 1e-4,
                "chunks {chunks}: gradient of `{n}` relative error {e:e}"
            );
        }
    }
}

/// Relative difference (see [`max_rel_diff`]) as f32, for assertions; `a` is brought to the
/// fixture's CPU.
fn rel_diff(a: &Tensor, b: &Tensor) -> f32 {
    max_rel_diff(&a.to_device(&Device::Cpu).unwrap(), b).unwrap() as f32
}

/// The device the test computes on.
fn device() -> Device {
    pipewright::runtime::device::test_device().unwrap()
}
