//! The fused CPU kernels against the composed candle ops they replace, in f32: GELU, LayerNorm,
//! softmax and cross-entropy forward and backward within f32 rounding, and AdamW bit for bit
//! over several steps (their f64 gradients meet finite differences in `gradcheck.rs`).

use candle_core::{DType, Device, Tensor, Var, D};
use pipewright::model::nn::optim::{AdamW, AdamWConfig, Optimizer};
use pipewright::model::nn::{causal_mask, cross_entropy_sum, gelu, scaled_softmax};
use pipewright::model::{grads::Grads, init::Init, nn::LayerNorm, nn::Module};
use pipewright::runtime::seed::{normal_vec, rng_for};

fn randn(key: &str, shape: &[usize], std: f64) -> Tensor {
    let n = shape.iter().product();
    let v: Vec<f32> = normal_vec(&mut rng_for(5, key), n, 0.0, std)
        .into_iter()
        .map(|x| x as f32)
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// Largest |a - b| over the largest |b|.
fn rel(a: &Tensor, b: &Tensor) -> f64 {
    pipewright::model::nn::max_rel_diff(a, b).unwrap()
}

/// Output and input gradient of `f` at `x` for the loss `sum(f(x) * r)`.
fn run(x: &Tensor, r: &Tensor, f: impl Fn(&Tensor) -> Tensor) -> (Tensor, Tensor) {
    let v = Var::from_tensor(x).unwrap();
    let y = f(v.as_tensor());
    let g = (&y * r).unwrap().sum_all().unwrap().backward().unwrap();
    (y, g.get(v.as_tensor()).unwrap().clone())
}

fn composed_softmax(x: &Tensor) -> Tensor {
    let m = x.max_keepdim(D::Minus1).unwrap().detach();
    let e = x.broadcast_sub(&m).unwrap().exp().unwrap();
    e.broadcast_div(&e.sum_keepdim(D::Minus1).unwrap()).unwrap()
}

#[test]
fn gelu_matches_the_tanh_formula() {
    // Inputs from -6 to 6: both tails and the bend.
    let x = (randn("gelu", &[64, 96], 2.5)).clamp(-6f32, 6f32).unwrap();
    let r = randn("gelu/r", &[64, 96], 1.0);
    let (y, g) = run(&x, &r, |x| gelu(x).unwrap());
    let (wy, wg) = run(&x, &r, |x| x.gelu().unwrap());
    assert!(rel(&y, &wy) < 1e-6, "gelu forward off by {}", rel(&y, &wy));
    assert!(rel(&g, &wg) < 1e-5, "gelu backward off by {}", rel(&g, &wg));
}

#[test]
fn linear_matches_matmul_and_bias_in_both_layouts_with_and_without_gelu() {
    use pipewright::model::nn::Linear;
    let init = Init::new(Device::Cpu, DType::F32, 4);
    // 300 rows: big enough for the products to be split in bands over the pool's threads,
    // the last band partial.
    let x = randn("lin/x", &[3, 100, 96], 1.5);
    let r = randn("lin/r", &[3, 100, 40], 1.0);
    let layers = [
        Linear::new(&init, "a", 96, 40, true).unwrap(),
        Linear::conv1d(&init, "b", 96, 40, 0.3).unwrap(),
        Linear::conv1d(&init, "c", 96, 40, 0.3)
            .unwrap()
            .gelu_input(),
        Linear::new(&init, "d", 96, 40, false).unwrap(),
    ];
    for (k, l) in layers.iter().enumerate() {
        let params = l.params();
        let composed = |x: &Tensor| {
            let x = if k == 2 { x.gelu().unwrap() } else { x.clone() };
            let w = params[0].1.as_tensor();
            let w = if k == 1 || k == 2 {
                w.clone()
            } else {
                w.t().unwrap()
            };
            let y = x.broadcast_matmul(&w).unwrap();
            match params.get(1) {
                Some((_, b)) => y.broadcast_add(b.as_tensor()).unwrap(),
                None => y,
            }
        };
        let grads = |f: &dyn Fn(&Tensor) -> Tensor| {
            let v = Var::from_tensor(&x).unwrap();
            let y = f(v.as_tensor());
            let g = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
            let mut all = vec![y, g.get(v.as_tensor()).unwrap().clone()];
            all.extend(
                params
                    .iter()
                    .map(|(_, p)| g.get(p.as_tensor()).unwrap().clone()),
            );
            all
        };
        let got = grads(&|x| l.forward(x).unwrap());
        let want = grads(&composed);
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                rel(g, w) < 1e-5,
                "layer {k}, output/gradient {i} off by {}",
                rel(g, w)
            );
        }
    }
}

#[test]
fn layer_norm_matches_the_composed_formula() {
    let init = Init::new(Device::Cpu, DType::F32, 3);
    let ln = LayerNorm::new(&init, "ln", 80, 1e-5).unwrap();
    // Non-trivial gain and bias, and rows with an offset (where one-pass variance would fail).
    for (_, p) in ln.params() {
        p.set(&(randn("ln/p", p.dims(), 1.0) + 1.0).unwrap())
            .unwrap();
    }
    let x = (randn("ln/x", &[3, 40, 80], 2.0) + 5.0).unwrap();
    let r = randn("ln/r", &[3, 40, 80], 1.0);
    let (w, b) = (ln.params()[0].1.clone(), ln.params()[1].1.clone());
    let composed = |x: &Tensor| {
        let mean = x.mean_keepdim(D::Minus1).unwrap();
        let xc = x.broadcast_sub(&mean).unwrap();
        let var = xc.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
        let xn = xc
            .broadcast_div(&(var + 1e-5).unwrap().sqrt().unwrap())
            .unwrap();
        xn.broadcast_mul(w.as_tensor())
            .unwrap()
            .broadcast_add(b.as_tensor())
            .unwrap()
    };
    let grads = |f: &dyn Fn(&Tensor) -> Tensor| {
        let v = Var::from_tensor(&x).unwrap();
        let y = f(v.as_tensor());
        let g = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
        let get = |t: &Tensor| g.get(t).unwrap().clone();
        (
            y,
            get(v.as_tensor()),
            get(w.as_tensor()),
            get(b.as_tensor()),
        )
    };
    let got = grads(&|x| ln.forward(x).unwrap());
    let want = grads(&composed);
    for (what, a, b, tol) in [
        ("output", &got.0, &want.0, 1e-5),
        ("input gradient", &got.1, &want.1, 1e-4),
        ("weight gradient", &got.2, &want.2, 1e-5),
        ("bias gradient", &got.3, &want.3, 1e-5),
    ] {
        assert!(rel(a, b) < tol, "layer norm {what} off by {}", rel(a, b));
    }
}

#[test]
fn causal_softmax_matches_scale_mask_and_softmax() {
    // 2 x 3 heads of 5 queries over 7 keys: query i sees keys 0..=i+2.
    let x = randn("sm/x", &[2, 3, 5, 7], 3.0);
    let r = randn("sm/r", &[2, 3, 5, 7], 1.0);
    let scale = 0.125;
    let (y, g) = run(&x, &r, |x| scaled_softmax(x, scale, true).unwrap());
    let mask = causal_mask(5, 7, DType::F32, &Device::Cpu).unwrap();
    let (wy, wg) = run(&x, &r, |x| {
        composed_softmax(&(x * scale).unwrap().broadcast_add(&mask).unwrap())
    });
    assert!(
        rel(&y, &wy) < 1e-6,
        "softmax forward off by {}",
        rel(&y, &wy)
    );
    assert!(
        rel(&g, &wg) < 1e-5,
        "softmax backward off by {}",
        rel(&g, &wg)
    );
    // Masked probabilities are exact zeros; every row sums to one.
    let v: Vec<f32> = y.flatten_all().unwrap().to_vec1().unwrap();
    for (row, p) in v.chunks(7).enumerate() {
        let seen = row % 5 + 3;
        assert!(p[seen..].iter().all(|&q| q == 0.0), "row {row}: {p:?}");
        assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }
    // A causal softmax needs keys >= queries; a scale must be positive.
    assert!(scaled_softmax(&randn("sm/bad", &[4, 3], 1.0), 1.0, true).is_err());
    assert!(scaled_softmax(&x, 0.0, false).is_err());
}

#[test]
fn cross_entropy_matches_log_softmax_and_gather() {
    let logits = randn("ce/x", &[24, 50], 4.0);
    let mut t: Vec<i64> = (0..24).map(|i| (i * 7 % 50) as i64).collect();
    t[3] = -100;
    t[10] = -100;
    let targets = Tensor::from_vec(t.clone(), 24, &Device::Cpu).unwrap();
    let one = Tensor::ones((), DType::F32, &Device::Cpu).unwrap();
    let (loss, g) = run(&logits, &one, |x| cross_entropy_sum(x, &targets).unwrap().0);
    let (wloss, wg) = run(&logits, &one, |x| {
        let m = x.max_keepdim(1).unwrap().detach();
        let s = x.broadcast_sub(&m).unwrap();
        let lse = s.exp().unwrap().sum_keepdim(1).unwrap().log().unwrap();
        let logp = s.broadcast_sub(&lse).unwrap();
        let (idx, keep): (Vec<u32>, Vec<f32>) = t
            .iter()
            .map(|&v| if v < 0 { (0, 0.0) } else { (v as u32, 1.0) })
            .unzip();
        let idx = Tensor::from_vec(idx, (24, 1), &Device::Cpu).unwrap();
        let keep = Tensor::from_vec(keep, 24, &Device::Cpu).unwrap();
        let picked = logp.gather(&idx, 1).unwrap().squeeze(1).unwrap();
        (picked * keep).unwrap().sum_all().unwrap().neg().unwrap()
    });
    assert!(
        rel(&loss, &wloss) < 1e-6,
        "loss off by {}",
        rel(&loss, &wloss)
    );
    assert!(rel(&g, &wg) < 1e-5, "gradient off by {}", rel(&g, &wg));
    // Ignored rows get no gradient.
    let rows: Vec<Vec<f32>> = g.to_vec2().unwrap();
    assert!(rows[3].iter().chain(&rows[10]).all(|&v| v == 0.0));
}

/// The composed AdamW update (the code the kernel replaced), one tensor op per line.
#[allow(clippy::too_many_arguments)]
fn composed_adamw(
    p: &Tensor,
    g: &Tensor,
    m: Option<&Tensor>,
    v: Option<&Tensor>,
    lr: f64,
    step: i32,
    decay: bool,
    cfg: AdamWConfig,
) -> (Tensor, Tensor, Tensor) {
    let bc1 = 1.0 - cfg.beta1.powi(step);
    let bc2_sqrt = (1.0 - cfg.beta2.powi(step)).sqrt();
    let mut p = p.clone();
    if decay {
        p = (p * (1.0 - lr * cfg.weight_decay)).unwrap();
    }
    let m = match m {
        Some(m) => ((m * cfg.beta1).unwrap() + (g * (1.0 - cfg.beta1)).unwrap()).unwrap(),
        None => (g * (1.0 - cfg.beta1)).unwrap(),
    };
    let g2 = g.sqr().unwrap();
    let v = match v {
        Some(v) => ((v * cfg.beta2).unwrap() + (g2 * (1.0 - cfg.beta2)).unwrap()).unwrap(),
        None => (g2 * (1.0 - cfg.beta2)).unwrap(),
    };
    let denom = ((v.sqrt().unwrap() / bc2_sqrt).unwrap() + cfg.eps).unwrap();
    let p = (p - ((&m / denom).unwrap() * (lr / bc1)).unwrap()).unwrap();
    (p, m, v)
}

#[test]
fn adamw_is_bit_for_bit_the_composed_update() {
    let cfg = AdamWConfig::default();
    let w = Var::from_tensor(&randn("adam/w", &[70, 33], 0.02)).unwrap();
    let b = Var::from_tensor(&randn("adam/b", &[33], 0.02)).unwrap();
    let mut opt = AdamW::new(vec![("w".into(), w.clone()), ("b".into(), b.clone())], cfg).unwrap();
    let mut want: Vec<(Tensor, Option<Tensor>, Option<Tensor>)> = [&w, &b]
        .iter()
        .map(|v| (v.as_tensor().copy().unwrap(), None, None))
        .collect();
    for step in 1..=4 {
        let lr = 1e-3 * step as f64;
        let mut grads = Grads::new();
        for (k, (name, var)) in [("w", &w), ("b", &b)].into_iter().enumerate() {
            // Gradients over many magnitudes, tiny ones included (where eps matters).
            let g = (randn(&format!("adam/g{step}{name}"), var.dims(), 1.0)
                * 10f64.powi(-(step + 2 * k as i32)))
            .unwrap();
            let (p, m, v) = &want[k];
            let next = composed_adamw(p, &g, m.as_ref(), v.as_ref(), lr, step, k == 0, cfg);
            want[k] = (next.0, Some(next.1), Some(next.2));
            grads.insert(name, g);
        }
        opt.step(&grads, lr).unwrap();
        for (k, var) in [&w, &b].into_iter().enumerate() {
            let got: Vec<u32> = var
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect();
            let exp: Vec<u32> = want[k]
                .0
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect();
            assert_eq!(got, exp, "step {step}: parameter {k} differs");
        }
    }
    // The saved moments are the composed ones too.
    let state = opt.state_dict().unwrap();
    for (name, k) in [("w", 0), ("b", 1)] {
        for (key, t) in [("exp_avg", &want[k].1), ("exp_avg_sq", &want[k].2)] {
            let got = &state[&format!("{name}.{key}")];
            assert_eq!(rel(got, t.as_ref().unwrap()), 0.0, "{name}.{key}");
        }
    }
}

#[test]
fn fused_attention_matches_heads_scores_and_softmax() {
    // One block of positions, and several with a partial last one (blocks of 64).
    for t in [9, 150] {
        attention_against_composed(t);
    }
}

fn attention_against_composed(t: usize) {
    use pipewright::model::{Cx, Mode};
    use pipewright::parallel::tensor_parallel::{CausalSelfAttention, Group};
    let (b, d, heads) = (2, 24, 3);
    let init = Init::new(Device::Cpu, DType::F32, 11);
    let a = CausalSelfAttention::new(&init, &Group::single(), "attn", d, heads, 0.0, 0.3).unwrap();
    let params = a.params();
    let p = |name: &str| {
        params
            .iter()
            .find(|(n, _)| n == name)
            .unwrap()
            .1
            .as_tensor()
            .clone()
    };
    let x = randn("attn/x", &[b, t, d], 1.0);
    let r = randn("attn/r", &[b, t, d], 1.0);
    // Each head's attention written out with candle's ops.
    let composed = |x: &Tensor| {
        let qkv = x
            .broadcast_matmul(&p("attn.c_attn.weight"))
            .unwrap()
            .broadcast_add(&p("attn.c_attn.bias"))
            .unwrap();
        let hd = d / heads;
        let head = |i: usize| {
            qkv.narrow(2, i * d, d)
                .unwrap()
                .reshape((b, t, heads, hd))
                .unwrap()
                .transpose(1, 2)
                .unwrap()
                .contiguous()
                .unwrap()
        };
        let (q, k, v) = (head(0), head(1), head(2));
        let s = (q.matmul(&k.t().unwrap()).unwrap() / (hd as f64).sqrt()).unwrap();
        let s = s
            .broadcast_add(&causal_mask(t, t, DType::F32, &Device::Cpu).unwrap())
            .unwrap();
        let y = composed_softmax(&s).matmul(&v).unwrap();
        let y = y.transpose(1, 2).unwrap().reshape((b, t, d)).unwrap();
        y.broadcast_matmul(&p("attn.c_proj.weight"))
            .unwrap()
            .broadcast_add(&p("attn.c_proj.bias"))
            .unwrap()
    };
    let grads = |f: &dyn Fn(&Tensor) -> Tensor| {
        let v = Var::from_tensor(&x).unwrap();
        let y = f(v.as_tensor());
        let g = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
        let mut all = vec![y, g.get(v.as_tensor()).unwrap().clone()];
        for (_, p) in &params {
            all.push(g.get(p.as_tensor()).unwrap().clone());
        }
        all
    };
    let got = grads(&|x| a.forward(x, &mut Cx::new(Mode::Train, 0, 0, 0)).unwrap());
    let want = grads(&composed);
    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
        // The key bias has an exact zero gradient (softmax ignores shifts): compare absolutely.
        let tol = if k == 0 { 1e-5 } else { 1e-4 };
        let d = (g - w)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        let m = w
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(
            d <= tol * m.max(1e-3),
            "output/gradient {k} off by {d} (scale {m})"
        );
    }
}

#[test]
fn gradient_norms_match_an_f64_sum_of_squares() {
    let mut grads = Grads::new();
    // Large enough for several blocks on several threads, plus a small one and an f64 one.
    grads.insert("a", randn("norm/a", &[300, 1000], 0.1));
    grads.insert("b", randn("norm/b", &[7], 3.0));
    grads.insert(
        "c",
        randn("norm/c", &[50, 50], 1.0)
            .to_dtype(DType::F64)
            .unwrap(),
    );
    let want: f64 = grads
        .iter()
        .map(|(_, g)| {
            let v: Vec<f64> = g
                .flatten_all()
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
                .to_vec1()
                .unwrap();
            v.iter().map(|x| x * x).sum::<f64>()
        })
        .sum();
    let got = grads.sum_sq().unwrap();
    assert!((got - want).abs() <= 1e-12 * want, "{got} against {want}");
}

/// In f16 and bf16 the kernels compute in f32 and round once: each output and gradient is
/// exactly the f32 kernel's, on the same (widened) inputs, rounded to the low type (softmax's
/// gradient, computed from its rounded output, within a few rounding steps).
#[test]
fn low_precision_kernels_are_the_f32_kernels_rounded_once() {
    use pipewright::model::nn::Linear;
    for low in [DType::F16, DType::BF16] {
        let x = randn("lp/x", &[3, 20, 48], 1.5).to_dtype(low).unwrap();
        let r = randn("lp/r", &[3, 20, 48], 1.0).to_dtype(low).unwrap();
        let rounded = |t: &Tensor| -> Vec<f32> {
            let t = t.to_dtype(low).unwrap().to_dtype(DType::F32).unwrap();
            t.flatten_all().unwrap().to_vec1().unwrap()
        };
        let check = |what: &str, got: &Tensor, want: &Tensor| {
            assert_eq!(got.dtype(), low, "{what} in {low:?}");
            assert!(
                rounded(got) == rounded(want),
                "{what} in {low:?}: not the f32 result rounded once"
            );
        };
        let widened = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
        type Op = Box<dyn Fn(&Tensor) -> Tensor>;
        let ops: [(&str, Op); 2] = [
            ("gelu", Box::new(|x| gelu(x).unwrap())),
            (
                "causal softmax",
                Box::new(|x| {
                    // 4 heads of 5 queries over 48 keys.
                    let x = x.reshape((3, 4, 5, 48)).unwrap();
                    let y = scaled_softmax(&x, 0.7, true).unwrap();
                    y.reshape((3, 20, 48)).unwrap()
                }),
            ),
        ];
        for (what, f) in &ops {
            let (y, g) = run(&x, &r, f);
            let (wy, wg) = run(&widened(&x), &widened(&r), f);
            check(what, &y, &wy);
            if *what == "gelu" {
                check("gelu gradient", &g, &wg);
            } else {
                // Softmax's backward reads its saved output, which is in the low type (as
                // PyTorch's does): within a few of the low type's rounding steps.
                let step = if low == DType::F16 {
                    2f64.powi(-10)
                } else {
                    2f64.powi(-7)
                };
                let off = rel(&widened(&g), &wg);
                assert!(off < 4.0 * step, "{what} gradient in {low:?} off by {off}");
            }
        }
        // A layer: its low-type parameters, and the same values in an f32 twin.
        let l = Linear::conv1d(&Init::new(Device::Cpu, low, 4), "c", 48, 24, 0.3)
            .unwrap()
            .gelu_input();
        let twin = Linear::conv1d(&Init::new(Device::Cpu, DType::F32, 4), "c", 48, 24, 0.3)
            .unwrap()
            .gelu_input();
        for ((_, p), (_, q)) in l.params().iter().zip(twin.params()) {
            q.set(&widened(p.as_tensor())).unwrap();
        }
        let r = randn("lp/r2", &[3, 20, 24], 1.0).to_dtype(low).unwrap();
        let (y, g) = run(&x, &r, |x| l.forward(x).unwrap());
        let (wy, wg) = run(&widened(&x), &widened(&r), |x| twin.forward(x).unwrap());
        check("linear", &y, &wy);
        check("linear input gradient", &g, &wg);
    }
}
