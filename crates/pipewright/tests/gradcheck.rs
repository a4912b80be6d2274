//! Every layer's gradients against central finite differences, in f64.
//!
//! The loss is `sum(layer(x) * R)` for a fixed random `R`, so every output element matters.
//! For each input and parameter, up to 24 entries are perturbed by +-h and the numeric slope is
//! compared with the gradient from candle's backward.

use candle_core::{DType, Device, Tensor, Var};
use pipewright::model::nn::{
    cross_entropy, gelu, relu, residual, softmax_last_dim, BatchNorm2d, Conv2d, Dropout, Embedding,
    Init, LayerNorm, Linear, Module,
};
use pipewright::model::{Cx, Mode};
use pipewright::parallel::tensor_parallel::{CausalSelfAttention, Group};
use pipewright::runtime::seed::{normal_vec, rng_for};
use pipewright::Result;
use rand::Rng;

fn init() -> Init {
    Init::new(Device::Cpu, DType::F64, 7)
}

fn randn(key: &str, shape: &[usize]) -> Tensor {
    let n = shape.iter().product();
    let v = normal_vec(&mut rng_for(1, key), n, 0.0, 1.0);
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn var(key: &str, shape: &[usize]) -> Var {
    Var::from_tensor(&randn(key, shape)).unwrap()
}

/// Checks d(sum(f() * R))/d(v) for every `v` in `vars` against finite differences.
fn check(what: &str, vars: &[(String, Var)], f: impl Fn() -> Result<Tensor>) {
    let out = f().unwrap();
    let r = randn(&format!("{what}/R"), out.dims());
    let loss = |o: Tensor| (o * &r).unwrap().sum_all().unwrap();
    let grads = loss(out).backward().unwrap();
    let h = 1e-5;
    for (name, v) in vars {
        let g = grads
            .get(v.as_tensor())
            .unwrap_or_else(|| panic!("{what}: no gradient reached `{name}`"))
            .flatten_all()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap();
        let base = v
            .as_tensor()
            .flatten_all()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap();
        let mut rng = rng_for(3, name);
        let picks: Vec<usize> = if base.len() <= 24 {
            (0..base.len()).collect()
        } else {
            (0..24).map(|_| rng.random_range(0..base.len())).collect()
        };
        let scale = g.iter().fold(1e-3f64, |m, x| m.max(x.abs()));
        for i in picks {
            let at = |d: f64| {
                let mut p = base.clone();
                p[i] += d;
                v.set(&Tensor::from_vec(p, v.dims(), &Device::Cpu).unwrap())
                    .unwrap();
                loss(f().unwrap()).to_scalar::<f64>().unwrap()
            };
            let numeric = (at(h) - at(-h)) / (2.0 * h);
            v.set(&Tensor::from_vec(base.clone(), v.dims(), &Device::Cpu).unwrap())
                .unwrap();
            let err = (numeric - g[i]).abs() / scale;
            assert!(
                err < 1e-6,
                "{what}: d/d{name}[{i}] analytic {} numeric {numeric} (relative error {err:e})",
                g[i]
            );
        }
    }
}

fn with_input(x: &Var, params: Vec<(String, Var)>) -> Vec<(String, Var)> {
    let mut v = vec![("input".to_string(), x.clone())];
    v.extend(params);
    v
}

#[test]
fn linear_both_layouts() {
    let x = var("x", &[2, 3, 5]);
    let l = Linear::new(&init(), "fc", 5, 4, true).unwrap();
    check("linear", &with_input(&x, l.params()), || l.forward(&x));
    let c = Linear::conv1d(&init(), "c_fc", 5, 6, 0.5).unwrap();
    check("conv1d linear", &with_input(&x, c.params()), || {
        c.forward(&x)
    });
    let g = Linear::conv1d(&init(), "mlp.c_proj", 5, 6, 0.5)
        .unwrap()
        .gelu_input();
    check("linear of gelu", &with_input(&x, g.params()), || {
        g.forward(&x)
    });
    let n = Linear::new(&init(), "head", 5, 4, false).unwrap();
    check("linear without bias", &with_input(&x, n.params()), || {
        n.forward(&x)
    });
}

#[test]
fn embedding() {
    let e = Embedding::new(&init(), "wte", 7, 4, 1.0).unwrap();
    let ids = Tensor::new(&[[1u32, 3, 3], [6, 0, 1]], &Device::Cpu).unwrap();
    check("embedding", &e.params(), || e.forward(&ids));
    assert!(e
        .forward(&Tensor::new(&[7u32], &Device::Cpu).unwrap())
        .is_err());
}

#[test]
fn layer_norm() {
    let x = var("x", &[3, 4, 6]);
    let ln = LayerNorm::new(&init(), "ln", 6, 1e-5).unwrap();
    // Non-trivial gain and bias.
    for (_, p) in ln.params() {
        p.set(&randn("lnp", p.dims())).unwrap();
    }
    check("layer_norm", &with_input(&x, ln.params()), || {
        ln.forward(&x)
    });
}

#[test]
fn rms_norm() {
    let x = var("x", &[3, 4, 6]);
    let norm = pipewright::model::nn::RmsNorm::new(&init(), "norm", 6, 1e-5).unwrap();
    for (_, p) in norm.params() {
        p.set(&randn("rmsp", p.dims())).unwrap();
    }
    check("rms_norm", &with_input(&x, norm.params()), || {
        norm.forward(&x)
    });
}

#[test]
fn swiglu_and_rotary() {
    let (g, u) = (var("g", &[3, 5, 8]), var("u", &[3, 5, 8]));
    let both = vec![("g".to_string(), g.clone()), ("u".to_string(), u.clone())];
    check("swiglu", &both, || pipewright::model::nn::swiglu(&g, &u));
    // (batch, heads, time, head_dim), positions from 3 as after a cache of 3 tokens.
    let x = var("x", &[2, 3, 5, 8]);
    check("rope", &with_input(&x, vec![]), || {
        pipewright::model::nn::rope(&x, 3, 10000.0)
    });
}

#[test]
fn activations_and_softmax() {
    let x = var("x", &[4, 7]);
    check("gelu", &with_input(&x, vec![]), || gelu(&x));
    check("softmax", &with_input(&x, vec![]), || softmax_last_dim(&x));
    // relu is not differentiable at 0; random inputs avoid it.
    check("relu", &with_input(&x, vec![]), || relu(&x));
    let w = var("w", &[7, 7]);
    check(
        "residual",
        &with_input(&x, vec![("w".into(), w.clone())]),
        || residual(&x, |x| Ok(x.matmul(&w)?.tanh()?)),
    );
}

#[test]
fn gelu_is_gpt2_tanh_form() {
    let x = Tensor::new(&[-3.0f64, -1.0, -0.1, 0.0, 0.5, 2.0], &Device::Cpu).unwrap();
    let got = gelu(&x).unwrap().to_vec1::<f64>().unwrap();
    for (xi, g) in x.to_vec1::<f64>().unwrap().iter().zip(got) {
        let want = 0.5
            * xi
            * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (xi + 0.044715 * xi.powi(3))).tanh());
        assert!((g - want).abs() < 1e-12, "gelu({xi}) = {g}, want {want}");
    }
}

#[test]
fn causal_self_attention() {
    let x = var("x", &[2, 5, 8]);
    let a = CausalSelfAttention::new(&init(), &Group::single(), "attn", 8, 2, 0.0, 0.3).unwrap();
    check("attention", &with_input(&x, a.params()), || {
        a.forward(&x, &mut Cx::new(Mode::Train, 0, 0, 0))
    });
}

#[test]
fn attention_is_causal() {
    // Changing a later token must not change earlier outputs.
    let a = CausalSelfAttention::new(&init(), &Group::single(), "attn", 8, 2, 0.0, 0.3).unwrap();
    let mut cx = Cx::eval();
    let x = randn("x", &[1, 5, 8]);
    let y1 = a.forward(&x, &mut cx).unwrap();
    let x2 = Tensor::cat(&[x.narrow(1, 0, 4).unwrap(), randn("other", &[1, 1, 8])], 1).unwrap();
    let y2 = a.forward(&x2, &mut cx).unwrap();
    let d = (y1.narrow(1, 0, 4).unwrap() - y2.narrow(1, 0, 4).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    assert_eq!(d, 0.0);
}

#[test]
fn dropout_seeded_and_differentiable() {
    let x = var("x", &[4, 50]);
    let d = Dropout::new("drop", 0.3);
    let cx = Cx::new(Mode::Train, 9, 2, 1);
    check("dropout", &with_input(&x, vec![]), || d.forward(&x, &cx));
    let a = d.forward(&x, &cx).unwrap().to_vec2::<f64>().unwrap();
    let b = d.forward(&x, &cx).unwrap().to_vec2::<f64>().unwrap();
    assert_eq!(
        a, b,
        "same (seed, step, micro-batch, site) must give the same mask"
    );
    let c = d
        .forward(&x, &Cx::new(Mode::Train, 9, 3, 1))
        .unwrap()
        .to_vec2::<f64>()
        .unwrap();
    assert_ne!(a, c, "another step draws another mask");
    let zeros = a.iter().flatten().filter(|v| **v == 0.0).count();
    assert!(
        (30..=90).contains(&zeros),
        "about 30 % of 200 dropped, got {zeros}"
    );
    let e = d
        .forward(&x, &Cx::eval())
        .unwrap()
        .to_vec2::<f64>()
        .unwrap();
    assert_eq!(
        e,
        x.as_tensor().to_vec2::<f64>().unwrap(),
        "eval mode is the identity"
    );
}

#[test]
fn cross_entropy_with_ignore_index() {
    let logits = var("logits", &[2, 3, 5]);
    let targets = Tensor::new(&[[1i64, -100, 4], [0, 2, -100]], &Device::Cpu).unwrap();
    check("cross_entropy", &with_input(&logits, vec![]), || {
        cross_entropy(&logits, &targets)
    });
    // Analytic value: mean over the four counted positions of -log softmax.
    let l = logits.as_tensor().to_vec3::<f64>().unwrap();
    let t = [[1, -100, 4], [0, 2, -100]];
    let mut sum = 0.0;
    for b in 0..2 {
        for i in 0..3 {
            if t[b][i] < 0 {
                continue;
            }
            let row = &l[b][i];
            let lse = row.iter().map(|v| v.exp()).sum::<f64>().ln();
            sum += lse - row[t[b][i] as usize];
        }
    }
    let got = cross_entropy(&logits, &targets)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    assert!((got - sum / 4.0).abs() < 1e-12);
    let bad = Tensor::new(&[[5i64, 0, 0], [0, 0, 0]], &Device::Cpu).unwrap();
    assert!(cross_entropy(&logits, &bad).is_err());
}

#[test]
fn conv2d() {
    let x = var("x", &[2, 3, 6, 6]);
    for (k, s, p) in [(3, 1, 1), (3, 2, 1), (1, 2, 0)] {
        let c = Conv2d::new(&init(), "conv", 3, 4, k, s, p, true).unwrap();
        check(
            &format!("conv2d k{k} s{s} p{p}"),
            &with_input(&x, c.params()),
            || c.forward(&x),
        );
    }
}

#[test]
fn batch_norm_train_and_running_stats() {
    let x = var("x", &[3, 2, 4, 4]);
    let bn = BatchNorm2d::new(&init(), "bn", 2).unwrap();
    for (_, p) in bn.params() {
        p.set(&randn("bnp", p.dims())).unwrap();
    }
    let cx = Cx::new(Mode::Train, 0, 0, 0);
    check("batch_norm", &with_input(&x, bn.params()), || {
        bn.forward(&x, &cx)
    });

    // Running statistics after one more training forward, against PyTorch's formulas.
    let bn = BatchNorm2d::new(&init(), "bn", 2).unwrap();
    bn.forward(x.as_tensor(), &cx).unwrap();
    let v: Vec<f64> = x
        .as_tensor()
        .transpose(0, 1)
        .unwrap()
        .flatten_from(1)
        .unwrap()
        .to_vec2::<f64>()
        .unwrap()
        .concat();
    let per = v.len() / 2;
    let bufs = bn.buffers();
    let rm = bufs[0].1.as_tensor().to_vec1::<f64>().unwrap();
    let rv = bufs[1].1.as_tensor().to_vec1::<f64>().unwrap();
    for c in 0..2 {
        let ch = &v[c * per..(c + 1) * per];
        let mean = ch.iter().sum::<f64>() / per as f64;
        let unbiased = ch.iter().map(|a| (a - mean).powi(2)).sum::<f64>() / (per as f64 - 1.0);
        assert!((rm[c] - 0.1 * mean).abs() < 1e-12);
        assert!((rv[c] - (0.9 + 0.1 * unbiased)).abs() < 1e-12);
    }
    // A recomputed forward leaves them alone; eval mode uses them.
    let mut rcx = Cx::new(Mode::Train, 0, 0, 0);
    rcx.set_recomputing(true);
    bn.forward(x.as_tensor(), &rcx).unwrap();
    assert_eq!(bufs[0].1.as_tensor().to_vec1::<f64>().unwrap(), rm);
    let y = bn.forward(x.as_tensor(), &Cx::eval()).unwrap();
    let want = x
        .as_tensor()
        .broadcast_sub(
            &Tensor::new(rm.as_slice(), &Device::Cpu)
                .unwrap()
                .reshape((1, 2, 1, 1))
                .unwrap(),
        )
        .unwrap()
        .broadcast_div(
            &(Tensor::new(rv.as_slice(), &Device::Cpu)
                .unwrap()
                .reshape((1, 2, 1, 1))
                .unwrap()
                + 1e-5)
                .unwrap()
                .sqrt()
                .unwrap(),
        )
        .unwrap();
    let d = (y - want)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    assert!(d < 1e-12);
}
