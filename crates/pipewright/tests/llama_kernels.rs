//! The fused SwiGLU and rotary kernels against the composed candle ops they replace, in f32:
//! outputs and input gradients within f32 rounding (their f64 gradients meet finite
//! differences in `gradcheck.rs`); the rotary angles at a start position (decoding after a
//! cache) equal those of the same positions in a longer sequence.

use candle_core::{Device, Tensor, Var, D};
use pipewright::model::nn::{max_rel_diff, rope, swiglu};
use pipewright::runtime::seed::{normal_vec, rng_for};

fn randn(key: &str, shape: &[usize]) -> Tensor {
    let n = shape.iter().product();
    let v: Vec<f32> = normal_vec(&mut rng_for(9, key), n, 0.0, 2.0)
        .into_iter()
        .map(|x| x as f32)
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// Output and the gradient of `sum(f(x) * r)` for each input.
fn grads(xs: &[Tensor], f: &dyn Fn(&[Tensor]) -> Tensor) -> (Tensor, Vec<Tensor>) {
    let vars: Vec<Var> = xs.iter().map(|x| Var::from_tensor(x).unwrap()).collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&ts);
    let r = randn("r", y.dims());
    let g = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
    let gs = ts.iter().map(|t| g.get(t).unwrap().clone()).collect();
    (y, gs)
}

fn close(what: &str, a: &Tensor, b: &Tensor, tol: f64) {
    let e = max_rel_diff(a, b).unwrap();
    assert!(e < tol, "{what} off by {e:e}");
}

#[test]
fn swiglu_matches_silu_times_up() {
    let xs = [randn("g", &[4, 33, 100]), randn("u", &[4, 33, 100])];
    let (y, g) = grads(&xs, &|t| swiglu(&t[0], &t[1]).unwrap());
    let (y0, g0) = grads(&xs, &|t| (t[0].silu().unwrap() * &t[1]).unwrap());
    close("swiglu output", &y, &y0, 1e-6);
    close("swiglu gate gradient", &g[0], &g0[0], 1e-5);
    close("swiglu up gradient", &g[1], &g0[1], 1e-6);
}

/// Hugging Face's `apply_rotary_pos_emb` for positions `start..start + t`, composed.
fn composed(x: &Tensor, start: usize) -> Tensor {
    let (t, hd) = (x.dim(D::Minus2).unwrap(), x.dim(D::Minus1).unwrap());
    let mut ang = Vec::new();
    for p in start..start + t {
        for k in 0..hd {
            let f = (1.0 / 10000f64.powf(2.0 * (k % (hd / 2)) as f64 / hd as f64)) as f32;
            ang.push(p as f32 * f);
        }
    }
    let ang = Tensor::from_vec(ang, (t, hd), x.device()).unwrap();
    let (cos, sin) = (ang.cos().unwrap(), ang.sin().unwrap());
    let (x1, x2) = (
        x.narrow(D::Minus1, 0, hd / 2).unwrap(),
        x.narrow(D::Minus1, hd / 2, hd / 2).unwrap(),
    );
    let rotated = Tensor::cat(&[&x2.neg().unwrap(), &x1], D::Minus1).unwrap();
    (x.broadcast_mul(&cos).unwrap() + rotated.broadcast_mul(&sin).unwrap()).unwrap()
}

#[test]
fn rope_matches_rotate_half() {
    for start in [0, 37] {
        let xs = [randn("x", &[2, 4, 50, 64])];
        let (y, g) = grads(&xs, &|t| rope(&t[0], start, 10000.0).unwrap());
        let (y0, g0) = grads(&xs, &|t| composed(&t[0], start));
        close("rope output", &y, &y0, 1e-5);
        close("rope gradient", &g[0], &g0[0], 1e-5);
    }
    // Positions 10.. of one sequence are those of a shorter one starting at 10.
    let x = randn("x2", &[1, 2, 16, 8]);
    let whole = rope(&x, 0, 500.0).unwrap().narrow(2, 10, 6).unwrap();
    let tail = rope(&x.narrow(2, 10, 6).unwrap(), 10, 500.0).unwrap();
    close("rope offset", &tail, &whole, 1e-7);
    assert!(rope(&randn("odd", &[1, 1, 2, 5]), 0, 1e4).is_err());
}
