//! The Llama against Hugging Face's LlamaForCausalLM (fixture from `tools/make_fixtures.py
//! llama`: grouped-query attention, rotary, SwiGLU, RMSNorm, untied head): the same parameter
//! names and shapes, the same logits and loss, the same gradient for every parameter; and
//! every pp x tp x cp x dp layout trains as the separate serial trainer does (losses, norms,
//! every gradient of every step, the parameters). The comparison with Hugging Face computes on
//! `PW_TEST_DEVICE` (`cpu` unless set; `cuda` in `tools/gpu-checks.sh`).

use pipewright::model::nn::optim::OptimSpec;
use pipewright::parallel::dims::ParallelSpec;
use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use pipewright::distributed::comm::local;
use pipewright::distributed::topology::Layout;
use pipewright::engine::serial::{SerialTrainer, TrainOptions};
use pipewright::engine::spec::TrainSpec;
use pipewright::engine::varuna::{Varuna, VarunaOptions};
use pipewright::model::nn::max_rel_diff;
use pipewright::model::nn::optim::{LrSchedule, Sgd, SgdConfig};
use pipewright::parallel::data_parallel::ReplicaBatches;
use pipewright::parallel::loss::CrossEntropy;
use pipewright::{Batch, Build};
use pipewright_models::parity::{
    watch, worst_difference, worst_gradient, RankResult, SerialResult, Update,
    CONTEXT_PARALLEL_TOLERANCE,
};
use pipewright_models::{llama, LlamaConfig};

fn fixture() -> HashMap<String, Tensor> {
    let dir = std::env::var("CARGO_MANIFEST_DIR").unwrap_or(env!("CARGO_MANIFEST_DIR").into());
    let p = format!("{dir}/tests/fixtures/llama_parity.safetensors");
    candle_core::safetensors::load(p, &Device::Cpu).unwrap()
}

fn config(f: &HashMap<String, Tensor>) -> LlamaConfig {
    let c = f["config"].to_vec1::<i64>().unwrap();
    let g = f["config_f"].to_vec1::<f64>().unwrap();
    LlamaConfig {
        vocab_size: c[0] as usize,
        block_size: c[1] as usize,
        n_layer: c[2] as usize,
        n_head: c[3] as usize,
        n_kv_head: c[4] as usize,
        dim: c[5] as usize,
        hidden: c[6] as usize,
        norm_eps: g[0],
        rope_theta: g[1],
        moe: None,
        head_dim: None,
        qk_norm: false,
    }
}

fn rel_diff(a: &Tensor, b: &Tensor) -> f64 {
    max_rel_diff(&a.to_device(&Device::Cpu).unwrap(), b).unwrap()
}

fn batch(f: &HashMap<String, Tensor>) -> Batch {
    let ids = f["input_ids"].to_dtype(DType::U32).unwrap();
    Batch::pair(ids, f["targets"].clone())
}

#[test]
fn logits_loss_and_every_gradient_match_hf_llama() {
    let f = fixture();
    let cfg = config(&f);
    for chunks in [1, 3] {
        let dev = pipewright::runtime::device::test_device().unwrap();
        let init = pipewright::model::nn::Init::new(dev.clone(), DType::F32, 0);
        let stage = llama(cfg).unwrap().build(&Build::new(init)).unwrap();
        let params = stage.params();
        let theirs = f.keys().filter(|k| k.starts_with("param.")).count();
        assert_eq!(
            params.len(),
            theirs,
            "parameter count differs from HF Llama"
        );
        for (n, v) in &params {
            let want = f
                .get(&format!("param.{n}"))
                .unwrap_or_else(|| panic!("HF Llama has no `{n}`"));
            assert_eq!(v.dims(), want.dims(), "`{n}` shape");
            v.set(&want.to_device(&dev).unwrap()).unwrap();
        }
        let opt = Box::new(Sgd::new(params, SgdConfig::default()).unwrap());
        let t = SerialTrainer::new(
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
                tied: vec![],
                loss: std::sync::Arc::new(CrossEntropy::default()),
            },
        )
        .unwrap();
        let b = batch(&f).to_device(&dev).unwrap();
        let logits = t.predict(&b).unwrap();
        let e = rel_diff(&logits, &f["logits"]);
        assert!(e < 1e-5, "logits relative error {e:e}");
        let (loss, grads, _) = t.loss_and_grads(&b).unwrap();
        let want = f["loss"].to_vec1::<f32>().unwrap()[0] as f64;
        assert!(
            ((loss - want) / want).abs() < 1e-5,
            "loss {loss} vs HF {want}"
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

const STEPS: u64 = 3;
const GLOBAL: usize = 8;
const MICRO: usize = 2;
const CLIP: f64 = 1.0;
const LR: f64 = 0.1;

/// The global batch of `step`: `rows` sequences of 12 ids below 48.
fn make(step: u64, rows: usize) -> pipewright::Result<Batch> {
    let n = (rows * 13) as u32;
    let all: Vec<u32> = (0..n)
        .map(|i| (i * 7 + step as u32 * 5 + i / 3) % 48)
        .collect();
    let x: Vec<u32> = all.chunks(13).flat_map(|c| c[..12].to_vec()).collect();
    let y: Vec<i64> = all
        .chunks(13)
        .flat_map(|c| c[1..].iter().map(|&v| v as i64).collect::<Vec<_>>())
        .collect();
    Ok(Batch::pair(
        Tensor::from_vec(x, (rows, 12), &Device::Cpu)?,
        Tensor::from_vec(y, (rows, 12), &Device::Cpu)?,
    ))
}

/// The fixture's Llama trained 3 clipped steps of plain SGD by the separate serial trainer:
/// the oracle every layout is held to. (AdamW's first steps move an element by the learning
/// rate whatever its gradient's size, so an element whose gradient is rounding noise moves by
/// 1e-3 either way: parameters after AdamW differ by 1e-4 where every gradient agrees within
/// 5e-7. SGD moves each by its gradient, so parameters and gradients both hold to 1e-5.)
fn serial() -> SerialResult {
    let stage = llama(config(&fixture()))
        .unwrap()
        .build(&Build::cpu(3))
        .unwrap();
    let opt = Update::Sgd.make(stage.params()).unwrap();
    let mut t = SerialTrainer::new(
        stage,
        opt,
        TrainOptions {
            spec: TrainSpec {
                seed: 3,
                optim: OptimSpec {
                    clip: Some(CLIP),
                    lr: LrSchedule::Constant { lr: LR },
                    ..Default::default()
                },
                ..TrainSpec::serial()
            },
            micro_batches: GLOBAL / MICRO,
            tied: vec![],
            loss: std::sync::Arc::new(CrossEntropy::default()),
        },
    )
    .unwrap();
    let (mut steps, mut grads) = (Vec::new(), Vec::new());
    for s in 0..STEPS {
        let b = make(s, GLOBAL).unwrap();
        let (_, g, _) = t.loss_and_grads(&b).unwrap();
        grads.push(g.iter().map(|(n, g)| (n.clone(), g.clone())).collect());
        let r = t.step(&b).unwrap();
        steps.push((r.loss, r.grad_norm));
    }
    let params = t
        .model()
        .params()
        .into_iter()
        .map(|(n, v)| (n, v.as_tensor().copy().unwrap()))
        .collect();
    SerialResult {
        steps,
        grads,
        params,
    }
}

/// Every rank's 3 SGD steps of the fixture's Llama on `layout` (ranks as threads), micro-batches
/// of 2, with sequence parallelism when `sp`: losses, norms, each step's gradients, the
/// parameters.
fn parallel(layout: Layout, sp: bool) -> Vec<RankResult> {
    perturbed(layout, sp, None)
}

/// [`parallel`] with the deliberate error `perturb` (see `ParityRun::perturb`).
fn perturbed(layout: Layout, sp: bool, perturb: Option<(String, f64)>) -> Vec<RankResult> {
    let model = llama(config(&fixture())).unwrap();
    let opts = VarunaOptions::of(TrainSpec {
        seed: 3,
        parallel: ParallelSpec {
            sequence_parallel: sp,
            ..ParallelSpec::new(layout)
        },
        optim: OptimSpec {
            clip: Some(CLIP),
            lr: LrSchedule::Constant { lr: LR },
            ..Default::default()
        },
        ..TrainSpec::new(layout, GLOBAL, MICRO, 1)
    });
    local::run(layout.world(), |comm| {
        let mut v = Varuna::new(&model, Box::new(comm), opts.clone())?;
        v.set_optimizer(|p| Update::Sgd.make(p))?;
        let log = watch(&mut v, perturb.clone());
        let loader = ReplicaBatches::new(make, GLOBAL, v.coords().dp_rank, layout.dp, Device::Cpu)?;
        let steps = (0..STEPS)
            .map(|s| {
                let o = v.step(&loader.batch(s)?)?;
                Ok((o.loss, o.grad_norm, o.overflow))
            })
            .collect::<pipewright::Result<Vec<_>>>()?;
        let params = v.parameters()?;
        RankResult::of(&v, steps, params, &log, 0)
    })
    .unwrap()
}

#[test]
fn every_layout_trains_as_the_serial_trainer() {
    let want = serial();
    assert!(
        want.steps[2].0 < want.steps[0].0,
        "it learns: {:?}",
        want.steps
    );
    // (pp, tp, cp, dp, sequence parallelism): context parallelism rotates each of a rank's two
    // chunks by its own positions and attends over the ring with grouped key/value heads.
    for (pp, tp, cp, dp, sp) in [
        (1, 1, 1, 1, false),
        (2, 1, 1, 1, false),
        (1, 2, 1, 1, false),
        (1, 1, 1, 2, false),
        (2, 2, 1, 1, false),
        (2, 1, 1, 2, false),
        (1, 1, 2, 1, false),
        (2, 2, 2, 1, false),
        (1, 2, 1, 1, true),
        (1, 2, 2, 1, true),
    ] {
        let layout = Layout::new(pp, tp, dp).unwrap().with_cp(cp).unwrap();
        let tol = if cp > 1 {
            CONTEXT_PARALLEL_TOLERANCE
        } else {
            1e-5
        };
        for (rank, got) in parallel(layout, sp).iter().enumerate() {
            let worst = worst_difference(got, &want).unwrap();
            let (g, at) = worst_gradient(got, &want).unwrap();
            assert!(
                worst < tol,
                "{layout} sequence parallel {sp}, rank {rank}: off by {worst:e} (gradients \
                 {g:e} at {at})"
            );
        }
    }
}

#[test]
fn a_one_percent_error_in_the_final_norms_gradient_is_caught_on_every_family() {
    let want = serial();
    for (pp, tp, cp, dp) in [(2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2)] {
        let layout = Layout::new(pp, tp, dp).unwrap().with_cp(cp).unwrap();
        let error = Some(("model.norm.weight".to_string(), 1.01));
        let caught: Vec<(f64, String)> = perturbed(layout, false, error)
            .iter()
            .map(|got| worst_gradient(got, &want).unwrap())
            .filter(|(d, at)| *d > 1e-3 && at.contains("model.norm.weight"))
            .collect();
        assert!(!caught.is_empty(), "{layout}: the error went unseen");
    }
}
