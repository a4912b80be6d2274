//! Optimizers against PyTorch trajectories (tools/make_fixtures.py), state round trips, and the
//! learning-rate schedule and clipping against their formulas.

use pipewright::model::nn::max_rel_diff;
use std::collections::HashMap;

use candle_core::{Device, Tensor, Var};
use pipewright::model::nn::optim::{
    clip_grad_norm, AdamW, AdamWConfig, LrSchedule, Optimizer, Sgd, SgdConfig,
};
use pipewright::model::nn::Grads;

const NAMES: [&str; 3] = ["a.weight", "a.bias", "b.weight"];
const LRS: [f64; 3] = [0.01, 0.02, 0.005];

fn fixture() -> HashMap<String, Tensor> {
    let p = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/optim.safetensors"
    );
    candle_core::safetensors::load(p, &Device::Cpu).unwrap()
}

fn params(f: &HashMap<String, Tensor>) -> Vec<(String, Var)> {
    NAMES
        .iter()
        .map(|n| {
            (
                n.to_string(),
                Var::from_tensor(&f[&format!("init.{n}")]).unwrap(),
            )
        })
        .collect()
}

fn grads(f: &HashMap<String, Tensor>, k: usize) -> Grads {
    let mut g = Grads::new();
    for n in NAMES {
        g.insert(n, f[&format!("grad{k}.{n}")].clone());
    }
    g
}

fn follow(tag: &str, mut make: impl FnMut(Vec<(String, Var)>) -> Box<dyn Optimizer>) {
    let f = fixture();
    let ps = params(&f);
    let mut opt = make(ps.clone());
    for (k, lr) in LRS.iter().enumerate() {
        opt.step(&grads(&f, k), *lr).unwrap();
        for (n, v) in &ps {
            let want = &f[&format!("{tag}.step{k}.{n}")];
            let e = rel_diff(v.as_tensor(), want);
            assert!(e < 1e-6, "{tag} step {k} `{n}`: relative error {e:e}");
        }
    }
}

#[test]
fn adamw_matches_pytorch() {
    follow("adamw", |ps| {
        Box::new(
            AdamW::new(
                ps,
                AdamWConfig {
                    beta1: 0.9,
                    beta2: 0.99,
                    eps: 1e-6,
                    weight_decay: 0.1,
                    decay_embeddings: true,
                },
            )
            .unwrap(),
        )
    });
}

#[test]
fn sgd_matches_pytorch() {
    follow("sgd_plain", |ps| {
        Box::new(Sgd::new(ps, SgdConfig::default()).unwrap())
    });
    follow("sgd_momentum", |ps| {
        Box::new(
            Sgd::new(
                ps,
                SgdConfig {
                    momentum: 0.9,
                    dampening: 0.1,
                    weight_decay: 0.01,
                    nesterov: false,
                },
            )
            .unwrap(),
        )
    });
    follow("sgd_nesterov", |ps| {
        Box::new(
            Sgd::new(
                ps,
                SgdConfig {
                    momentum: 0.9,
                    dampening: 0.0,
                    weight_decay: 0.01,
                    nesterov: true,
                },
            )
            .unwrap(),
        )
    });
}

/// Stepping once, saving, loading into a fresh optimizer over fresh copies and stepping on must
/// give exactly what stepping on without the break gives.
fn resume_is_exact(make: impl Fn(Vec<(String, Var)>) -> Box<dyn Optimizer>) {
    let f = fixture();
    let a = params(&f);
    let mut oa = make(a.clone());
    oa.step(&grads(&f, 0), LRS[0]).unwrap();
    let state = oa.state_dict().unwrap();
    // Through safetensors on disk, as a checkpoint would.
    let dir = std::env::temp_dir().join(format!("pw-optim-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("state.safetensors");
    let map: HashMap<String, Tensor> = state.into_iter().collect();
    candle_core::safetensors::save(&map, &path).unwrap();
    let state: std::collections::BTreeMap<String, Tensor> =
        candle_core::safetensors::load(&path, &Device::Cpu)
            .unwrap()
            .into_iter()
            .collect();
    let b: Vec<(String, Var)> = a
        .iter()
        .map(|(n, v)| {
            (
                n.clone(),
                Var::from_tensor(&v.as_tensor().copy().unwrap()).unwrap(),
            )
        })
        .collect();
    let mut ob = make(b.clone());
    ob.load_state_dict(&state).unwrap();
    for (k, lr) in LRS.iter().enumerate().skip(1) {
        oa.step(&grads(&f, k), *lr).unwrap();
        ob.step(&grads(&f, k), *lr).unwrap();
    }
    for ((n, va), (_, vb)) in a.iter().zip(&b) {
        let d = (va.as_tensor() - vb.as_tensor())
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap();
        assert_eq!(
            d.to_scalar::<f32>().unwrap(),
            0.0,
            "`{n}` differs after resuming"
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn optimizer_state_round_trips() {
    resume_is_exact(|ps| Box::new(AdamW::new(ps, AdamWConfig::default()).unwrap()));
    resume_is_exact(|ps| {
        Box::new(
            Sgd::new(
                ps,
                SgdConfig {
                    momentum: 0.9,
                    nesterov: true,
                    ..Default::default()
                },
            )
            .unwrap(),
        )
    });
}

#[test]
fn state_of_other_shapes_is_refused() {
    let f = fixture();
    let mut o = AdamW::new(params(&f), AdamWConfig::default()).unwrap();
    o.step(&grads(&f, 0), 0.1).unwrap();
    let mut state = o.state_dict().unwrap();
    state.insert(
        "a.weight.exp_avg".into(),
        Tensor::zeros((2, 2), candle_core::DType::F32, &Device::Cpu).unwrap(),
    );
    let err = o.load_state_dict(&state).unwrap_err().to_string();
    assert!(err.contains("a.weight.exp_avg"), "{err}");
    state.remove("step");
    assert!(o.load_state_dict(&state).is_err());
}

#[test]
fn clipping_matches_pytorch() {
    let f = fixture();
    let mut g = grads(&f, 0);
    let norm = clip_grad_norm(&mut g, 0.5).unwrap();
    let want = f["clip.norm"].to_vec1::<f32>().unwrap()[0] as f64;
    assert!((norm - want).abs() / want < 1e-6, "norm {norm} vs {want}");
    for n in NAMES {
        let e = rel_diff(g.get(n).unwrap(), &f[&format!("clip.{n}")]);
        assert!(e < 1e-6, "clipped `{n}`: {e:e}");
    }
    assert!(clip_grad_norm(&mut g, 0.0).is_err());
}

#[test]
fn warmup_cosine_schedule() {
    let s = LrSchedule::WarmupCosine {
        lr: 1.0,
        warmup: 10,
        total: 110,
        min_lr: 0.1,
    };
    s.validate().unwrap();
    assert!((s.lr_at(0) - 0.1).abs() < 1e-12);
    assert!((s.lr_at(9) - 1.0).abs() < 1e-12);
    assert!((s.lr_at(10) - 1.0).abs() < 1e-12);
    // Halfway through the decay: min + (max - min) / 2.
    assert!((s.lr_at(60) - 0.55).abs() < 1e-12);
    assert!((s.lr_at(110) - 0.1).abs() < 1e-12);
    assert!((s.lr_at(1000) - 0.1).abs() < 1e-12);
    assert_eq!(LrSchedule::Constant { lr: 0.3 }.lr_at(77), 0.3);
    assert!(LrSchedule::Constant { lr: -1.0 }.validate().is_err());
    assert!(LrSchedule::Constant { lr: f64::NAN }.validate().is_err());
}

/// Relative difference (see [`max_rel_diff`]) as f32, for assertions.
fn rel_diff(a: &Tensor, b: &Tensor) -> f32 {
    max_rel_diff(a, b).unwrap() as f32
}
