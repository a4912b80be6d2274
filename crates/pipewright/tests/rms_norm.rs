//! The fused RMSNorm kernel against the composed candle ops it replaces, in f32: output, input
//! gradient and weight gradient within f32 rounding (its f64 gradients meet finite differences
//! in `gradcheck.rs`).

use candle_core::{DType, Device, Tensor, Var, D};
use pipewright::model::init::Init;
use pipewright::model::nn::Module;
use pipewright::runtime::seed::{normal_vec, rng_for};

fn randn(key: &str, shape: &[usize], std: f64) -> Tensor {
    let n = shape.iter().product();
    let v: Vec<f32> = normal_vec(&mut rng_for(5, key), n, 0.0, std)
        .into_iter()
        .map(|x| x as f32)
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

fn rel(a: &Tensor, b: &Tensor) -> f64 {
    pipewright::model::nn::max_rel_diff(a, b).unwrap()
}

#[test]
fn rms_norm_matches_the_composed_formula() {
    let init = Init::new(Device::Cpu, DType::F32, 3);
    let norm = pipewright::model::nn::RmsNorm::new(&init, "norm", 80, 1e-5).unwrap();
    let w = norm.params()[0].1.clone();
    w.set(&(randn("rms/w", &[80], 0.5) + 1.0).unwrap()).unwrap();
    let x = (randn("rms/x", &[3, 40, 80], 2.0) + 0.5).unwrap();
    let r = randn("rms/r", &[3, 40, 80], 1.0);
    let composed = |x: &Tensor| {
        let rms = (x.sqr().unwrap().mean_keepdim(D::Minus1).unwrap() + 1e-5)
            .unwrap()
            .sqrt()
            .unwrap();
        x.broadcast_div(&rms)
            .unwrap()
            .broadcast_mul(w.as_tensor())
            .unwrap()
    };
    let grads = |f: &dyn Fn(&Tensor) -> Tensor| {
        let v = Var::from_tensor(&x).unwrap();
        let y = f(v.as_tensor());
        let g = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
        (
            y,
            g.get(v.as_tensor()).unwrap().clone(),
            g.get(w.as_tensor()).unwrap().clone(),
        )
    };
    let got = grads(&|x| norm.forward(x).unwrap());
    let want = grads(&composed);
    for (what, a, b, tol) in [
        ("output", &got.0, &want.0, 1e-5),
        ("input gradient", &got.1, &want.1, 1e-4),
        ("weight gradient", &got.2, &want.2, 1e-5),
    ] {
        assert!(rel(a, b) < tol, "rms norm {what} off by {}", rel(a, b));
    }
}
