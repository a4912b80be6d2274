//! The mixture of experts against a token-by-token oracle built from plain products (no
//! gathers, no index additions, no fused kernels) and against Hugging Face's Mixtral and
//! Qwen3-MoE blocks (fixtures by tools/make_moe_fixtures.py): outputs, the load-balancing loss
//! and every gradient (router included); ties routed to the lower expert; sizes no mixture can
//! have refused.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var};
use pipewright::model::nn::max_rel_diff;
use pipewright::model::Cx;
use pipewright::runtime::seed::{normal_vec, rng_for};
use pipewright::Build;
use pipewright_models::moe::{top_k, MoeConfig, MoeMlp, MoeNames};

const DIM: usize = 8;

fn cfg(shared: usize, norm_topk: bool, names: MoeNames) -> MoeConfig {
    MoeConfig {
        n_experts: 4,
        top_k: 2,
        moe_hidden: 6,
        shared_experts: shared,
        norm_topk,
        aux_loss_coef: 0.01,
        names,
        moe_every: 1,
    }
}

fn input(rows: usize) -> Tensor {
    let v: Vec<f32> = normal_vec(&mut rng_for(3, "x"), rows * DIM, 0.0, 1.0)
        .into_iter()
        .map(|x| x as f32)
        .collect();
    Tensor::from_vec(v, (1, rows, DIM), &Device::Cpu).unwrap()
}

/// `x W^T` for a weight stored `(out, in)`.
fn lin(x: &Tensor, w: &Tensor) -> Tensor {
    x.matmul(&w.t().unwrap()).unwrap()
}

/// An expert written out: `down(x W1^T * sigmoid(..) * x W3^T)`.
fn expert(x: &Tensor, p: &HashMap<String, Var>, names: [&str; 3]) -> Tensor {
    let g = lin(x, p[names[0]].as_tensor());
    let u = lin(x, p[names[1]].as_tensor());
    let silu = (&g
        * (g.neg().unwrap().exp().unwrap() + 1.0)
            .unwrap()
            .recip()
            .unwrap())
    .unwrap();
    lin(&(silu * u).unwrap(), p[names[2]].as_tensor())
}

/// The mixture token by token: (output rows, the load-balancing loss).
fn oracle(x: &Tensor, c: &MoeConfig, p: &HashMap<String, Var>, block: &str) -> (Tensor, Tensor) {
    let xs = x.reshape(((), DIM)).unwrap();
    let n = xs.dim(0).unwrap();
    let e = c.n_experts;
    let (router, w) = match c.names {
        MoeNames::Mixtral => (
            format!("{block}.block_sparse_moe.gate.weight"),
            ["w1", "w3", "w2"],
        ),
        MoeNames::Qwen3Moe => (
            format!("{block}.mlp.gate.weight"),
            ["gate_proj", "up_proj", "down_proj"],
        ),
    };
    let expert_names = |i: usize| -> [String; 3] {
        let at = match c.names {
            MoeNames::Mixtral => format!("{block}.block_sparse_moe.experts.{i}"),
            MoeNames::Qwen3Moe => format!("{block}.mlp.experts.{i}"),
        };
        w.map(|s| format!("{at}.{s}.weight"))
    };
    let (mut rows, mut probs, mut load) = (Vec::new(), Vec::new(), vec![0f32; e]);
    for i in 0..n {
        let xi = xs.narrow(0, i, 1).unwrap();
        let ex = lin(&xi, p[&router].as_tensor()).exp().unwrap();
        let pi = ex.broadcast_div(&ex.sum_keepdim(1).unwrap()).unwrap();
        let host = pi.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        // The k largest, ties to the lower index.
        let mut order: Vec<usize> = (0..e).collect();
        order.sort_by(|a, b| host[*b].partial_cmp(&host[*a]).unwrap().then(a.cmp(b)));
        let chosen = &order[..c.top_k];
        let total = chosen
            .iter()
            .map(|j| pi.narrow(1, *j, 1).unwrap())
            .reduce(|a, b| (a + b).unwrap())
            .unwrap();
        let mut y = xi.zeros_like().unwrap();
        for j in chosen {
            load[*j] += 1.0;
            let mut wj = pi.narrow(1, *j, 1).unwrap();
            if c.norm_topk {
                wj = (wj / &total).unwrap();
            }
            let names = expert_names(*j);
            let out = expert(&xi, p, [&names[0], &names[1], &names[2]]);
            y = (y + out.broadcast_mul(&wj).unwrap()).unwrap();
        }
        if c.shared_experts > 0 {
            let at = |s: &str| format!("{block}.mlp.shared_experts.{s}.weight");
            let names = [at("gate_proj"), at("up_proj"), at("down_proj")];
            y = (y + expert(&xi, p, [&names[0], &names[1], &names[2]])).unwrap();
        }
        rows.push(y);
        probs.push(pi);
    }
    let probs = Tensor::cat(&probs, 0).unwrap();
    let f = Tensor::from_vec(load, e, &Device::Cpu).unwrap();
    let aux = (probs.sum(0).unwrap() * f)
        .unwrap()
        .sum_all()
        .unwrap()
        .affine(e as f64 / (n * n) as f64, 0.0)
        .unwrap();
    (Tensor::cat(&rows, 0).unwrap(), aux)
}

#[test]
fn the_mixture_matches_the_token_by_token_oracle_with_every_gradient() {
    for (shared, norm, names) in [
        (0, true, MoeNames::Mixtral),
        (1, false, MoeNames::Qwen3Moe),
        (2, true, MoeNames::Qwen3Moe),
    ] {
        let c = cfg(shared, norm, names);
        let moe = MoeMlp::new(&Build::cpu(7), "model.layers.0", DIM, c).unwrap();
        let params: HashMap<String, Var> = moe.params().into_iter().collect();
        let x = input(10);
        let r = input(10).affine(0.5, 0.1).unwrap();
        let got = moe.forward(&x, &mut Cx::eval()).unwrap();
        let (want, want_aux) = oracle(&x, &c, &params, "model.layers.0");
        let out = got.out.reshape(((), DIM)).unwrap();
        let d = max_rel_diff(&out, &want).unwrap();
        assert!(d < 1e-5, "{names:?} shared {shared}: output off by {d:e}");
        let a = (
            got.aux.to_scalar::<f32>().unwrap(),
            want_aux.to_scalar::<f32>().unwrap(),
        );
        assert!(((a.0 - a.1) / a.1).abs() < 1e-5, "aux {a:?}");
        assert_eq!(got.load.iter().sum::<usize>(), 10 * c.top_k);
        // The loss a trainer adds: the outputs against r, and the auxiliary loss.
        let loss = |out: &Tensor, aux: &Tensor| {
            ((out * &r.reshape(((), DIM)).unwrap())
                .unwrap()
                .sum_all()
                .unwrap()
                + aux.affine(c.aux_loss_coef, 0.0).unwrap())
            .unwrap()
        };
        let g1 = loss(&out, &got.aux).backward().unwrap();
        let g2 = loss(&want, &want_aux).backward().unwrap();
        for (name, v) in &params {
            let (a, b) = (
                g1.get(v.as_tensor()).unwrap(),
                g2.get(v.as_tensor()).unwrap(),
            );
            let d = max_rel_diff(a, b).unwrap();
            assert!(
                d < 1e-5,
                "{names:?} shared {shared}: {name}'s gradient off by {d:e}"
            );
        }
    }
}

#[test]
fn ties_go_to_the_lower_expert() {
    // Equal probabilities everywhere: every token takes experts 0 and 1.
    let chosen = |p: Vec<f32>, rows: usize| {
        let t = Tensor::from_vec(p, (rows, 4), &Device::Cpu).unwrap();
        top_k(&t, 2).unwrap().to_vec2::<u32>().unwrap()
    };
    assert_eq!(chosen(vec![0.25f32; 3 * 4], 3), vec![vec![0, 1]; 3]);
    // 2 and 3 tie above the rest: 2 first; the highest first.
    assert_eq!(chosen(vec![0.1, 0.2, 0.35, 0.35], 1), vec![vec![2, 3]]);
    assert_eq!(chosen(vec![0.1, 0.5, 0.15, 0.25], 1), vec![vec![1, 3]]);
    // Through the layer: a router of zeros routes every token to experts 0 and 1.
    let c = cfg(0, true, MoeNames::Mixtral);
    let moe = MoeMlp::new(&Build::cpu(7), "b", DIM, c).unwrap();
    for (name, v) in moe.params() {
        if name.ends_with("gate.weight") {
            v.set(&v.as_tensor().zeros_like().unwrap()).unwrap();
        }
    }
    let got = moe.forward(&input(5), &mut Cx::eval()).unwrap();
    assert_eq!(got.load, vec![5, 5, 0, 0]);
    // Uniform probabilities (1/4) and every token's two slots on experts 0 and 1 (f = 1, 1):
    // E * (1 * 1/4 + 1 * 1/4) = 2, the top k (Hugging Face's form counts slots, not tokens).
    let aux = got
        .aux
        .to_dtype(DType::F64)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    assert!((aux - 2.0).abs() < 1e-6, "{aux}");
}

#[test]
fn sizes_no_mixture_can_have_are_refused() {
    let mut c = cfg(0, true, MoeNames::Mixtral);
    c.top_k = 5;
    let e = MoeMlp::new(&Build::cpu(0), "b", DIM, c).err().unwrap();
    assert!(e.to_string().contains("--top-k 5 of --n-experts 4"), "{e}");
    c.top_k = 2;
    c.moe_hidden = 0;
    assert!(MoeMlp::new(&Build::cpu(0), "b", DIM, c).is_err());
}

/// Hugging Face's block (tools/make_moe_fixtures.py): its weights loaded by the Hub's names,
/// the same output, load-balancing loss and gradients (router included).
#[test]
fn the_mixture_matches_hugging_face_mixtral_and_qwen3_moe_blocks() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    for (file, names, norm_topk) in [
        ("moe-mixtral.safetensors", MoeNames::Mixtral, true),
        ("moe-qwen3moe.safetensors", MoeNames::Qwen3Moe, false),
    ] {
        let f = candle_core::safetensors::load(dir.join(file), &Device::Cpu).unwrap();
        let coef = f["coef"].to_scalar::<f32>().unwrap() as f64;
        let c = MoeConfig {
            n_experts: 4,
            top_k: 2,
            moe_hidden: 12,
            shared_experts: 0,
            norm_topk,
            aux_loss_coef: coef,
            names,
            moe_every: 1,
        };
        let moe = MoeMlp::new(&Build::cpu(0), "model.layers.0", 16, c).unwrap();
        let params = moe.params();
        for (name, v) in &params {
            v.set(&f[name.as_str()]).unwrap();
        }
        let got = moe.forward(&f["x"], &mut Cx::eval()).unwrap();
        let d = max_rel_diff(&got.out, &f["y"]).unwrap();
        assert!(d < 1e-5, "{file}: output off by {d:e}");
        let a = (
            got.aux.to_scalar::<f32>().unwrap(),
            f["aux"].to_scalar::<f32>().unwrap(),
        );
        assert!(((a.0 - a.1) / a.1).abs() < 1e-5, "{file}: aux {a:?}");
        let loss = ((&got.out * &f["r"]).unwrap().sum_all().unwrap()
            + got.aux.affine(coef, 0.0).unwrap())
        .unwrap();
        let g = loss.backward().unwrap();
        for (name, v) in &params {
            let want = &f[format!("grad.{name}").as_str()];
            let d = max_rel_diff(g.get(v.as_tensor()).unwrap(), want).unwrap();
            assert!(d < 1e-4, "{file}: {name}'s gradient off by {d:e}");
        }
    }
}
