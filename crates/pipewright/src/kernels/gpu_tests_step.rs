//! The kernels of a step's optimizer phase, each one launch over many tensors, against the
//! CPU's per-tensor ops: AdamW and the casts bit for bit, the sums of squares of several
//! element types at once as each alone. Run on a GPU machine with `kernels::gpu_tests` (the
//! `cuda` build's library tests, tools/gpu-checks.sh `kernels`); without a GPU they say so and
//! pass.

use candle_core::{DType, Device, Tensor, Var};
use rand::{Rng, SeedableRng};

use super::adamw::{self, AdamWStep, Param};
use super::cast::{add_all, assign_all, cast_all};
use super::gpu_tests::gpu;
use super::reduce::sum_sq_each;

fn rand(seed: u64, n: usize, scale: f32) -> Tensor {
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let v: Vec<f32> = (0..n)
        .map(|_| (r.random::<f32>() * 2.0 - 1.0) * scale)
        .collect();
    Tensor::from_vec(v, n, &Device::Cpu).unwrap()
}

/// How many of `a`'s and `b`'s values (any type, as f32 bits) differ. Each is read on the
/// host first: candle's cast of an empty GPU tensor launches an empty grid, an error.
fn differ(a: &Tensor, b: &Tensor) -> usize {
    let bits = |t: &Tensor| -> Vec<u32> {
        let host = t.to_device(&Device::Cpu).unwrap();
        let v: Vec<f32> = (host.to_dtype(DType::F32).unwrap())
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        v.iter().map(|x| x.to_bits()).collect()
    };
    assert_eq!(a.dims(), b.dims());
    bits(a)
        .iter()
        .zip(bits(b))
        .filter(|(x, y)| **x != *y)
        .count()
}

/// AdamW over several parameters in one launch (odd sizes, one empty, with and without decay)
/// is the CPU's per-parameter update bit for bit, three steps, the first from no moments.
#[test]
fn adamw_of_many_parameters_matches_the_cpu_bit_for_bit() {
    let Some(dev) = gpu() else { return };
    let sizes = [100_003usize, 1, 0, 4097];
    let decays = [Some(1.0 - 1e-3 * 0.1), None, Some(0.5), None];
    let start: Vec<Tensor> = (0..4)
        .map(|i| rand(200 + i, sizes[i as usize], 1.0))
        .collect();
    let cpu: Vec<Var> = start.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
    let on_gpu: Vec<Var> = (start.iter())
        .map(|t| Var::from_tensor(&t.to_device(&dev).unwrap()).unwrap())
        .collect();
    type Moments = Vec<Option<(Tensor, Tensor)>>;
    let (mut mc, mut mg): (Moments, Moments) = (vec![None; 4], vec![None; 4]);
    for step in 1..=3u64 {
        let c = AdamWStep {
            beta1: 0.9,
            beta2: 0.999,
            inv_bc2_sqrt: 1.0 / (1.0 - 0.999f64.powi(step as i32)).sqrt(),
            eps: 1e-8,
            step_size: 1e-3 / (1.0 - 0.9f64.powi(step as i32)),
        };
        let grads: Vec<Tensor> = (0..4)
            .map(|i| rand(300 + 10 * step + i, sizes[i as usize], 0.5))
            .collect();
        let grads_gpu: Vec<Tensor> = grads.iter().map(|g| g.to_device(&dev).unwrap()).collect();
        for (vars, gs, ms) in [(&cpu, &grads, &mut mc), (&on_gpu, &grads_gpu, &mut mg)] {
            let params: Vec<Param> = (0..4)
                .map(|i| Param {
                    p: vars[i].as_tensor(),
                    g: &gs[i],
                    m: ms[i].as_ref().map(|m| &m.0),
                    v: ms[i].as_ref().map(|m| &m.1),
                    decay: decays[i],
                })
                .collect();
            let new = adamw::update_all(&params, c).unwrap();
            drop(params);
            for (m, n) in ms.iter_mut().zip(new) {
                *m = Some(n);
            }
        }
        for i in 0..4 {
            let (a, b) = (mc[i].as_ref().unwrap(), mg[i].as_ref().unwrap());
            for (what, x, y) in [
                ("parameter", cpu[i].as_tensor(), on_gpu[i].as_tensor()),
                ("exp_avg", &a.0, &b.0),
                ("exp_avg_sq", &a.1, &b.1),
            ] {
                let d = differ(x, y);
                assert_eq!(
                    d, 0,
                    "AdamW {what} of parameter {i} at step {step}: {d} differ"
                );
            }
        }
    }
}

/// The gradients cast to f32 and unscaled, clipping's scaling and the masters written into
/// bf16 and f16 parameters, each one launch over several tensors, are the CPU's per-tensor
/// `to_dtype` and `affine` bit for bit.
#[test]
fn casts_of_many_tensors_match_the_cpu_bit_for_bit() {
    let Some(dev) = gpu() else { return };
    let sizes = [70_001usize, 0, 3, 1 << 20];
    let xs: Vec<Tensor> = (0..4)
        .map(|i| rand(400 + i, sizes[i as usize], 3.0))
        .collect();
    for from in [DType::BF16, DType::F16, DType::F32] {
        let cpu: Vec<Tensor> = xs.iter().map(|x| x.to_dtype(from).unwrap()).collect();
        let gpu: Vec<Tensor> = cpu.iter().map(|x| x.to_device(&dev).unwrap()).collect();
        for (to, factor) in [
            (DType::F32, Some(1.0 / 65536.0)),
            (DType::F32, Some(0.3)),
            (DType::F32, None),
        ] {
            let want = cast_all(&cpu.iter().collect::<Vec<_>>(), Some(to), factor).unwrap();
            let got = cast_all(&gpu.iter().collect::<Vec<_>>(), Some(to), factor).unwrap();
            for (i, (w, g)) in want.iter().zip(&got).enumerate() {
                let d = differ(w, g);
                assert_eq!(
                    d, 0,
                    "{from:?} -> {to:?} x {factor:?}, tensor {i}: {d} differ"
                );
            }
        }
    }
    for to in [DType::BF16, DType::F16] {
        let masters: Vec<Tensor> = xs.iter().map(|x| x.to_device(&dev).unwrap()).collect();
        let vars: Vec<Var> = (masters.iter())
            .map(|m| Var::zeros(m.elem_count(), to, &dev).unwrap())
            .collect();
        let pairs: Vec<(&Tensor, &Var)> = masters.iter().zip(&vars).collect();
        assign_all(&pairs).unwrap();
        for (i, (x, v)) in xs.iter().zip(&vars).enumerate() {
            let d = differ(&x.to_dtype(to).unwrap(), v.as_tensor());
            assert_eq!(d, 0, "master {i} into {to:?}: {d} differ");
        }
    }
}

/// Gradient accumulation: f32 sums plus bf16, f16 and f32 gradients, one launch each, are
/// the CPU's `acc + g.to_dtype(F32)` bit for bit.
#[test]
fn sums_of_many_gradients_match_the_cpu_bit_for_bit() {
    let Some(dev) = gpu() else { return };
    let sizes = [70_001usize, 0, 3, 5000];
    let accs: Vec<Tensor> = (0..4)
        .map(|i| rand(600 + i, sizes[i as usize], 4.0))
        .collect();
    for low in [DType::BF16, DType::F16, DType::F32] {
        let gs: Vec<Tensor> = (0..4)
            .map(|i| rand(610 + i, sizes[i as usize], 2.0).to_dtype(low).unwrap())
            .collect();
        let on = |ts: &[Tensor]| -> Vec<Tensor> {
            ts.iter().map(|t| t.to_device(&dev).unwrap()).collect()
        };
        let (accs_gpu, gs_gpu) = (on(&accs), on(&gs));
        let want = add_all(
            &accs.iter().collect::<Vec<_>>(),
            &gs.iter().collect::<Vec<_>>(),
        )
        .unwrap();
        let got = add_all(
            &accs_gpu.iter().collect::<Vec<_>>(),
            &gs_gpu.iter().collect::<Vec<_>>(),
        )
        .unwrap();
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            assert_eq!(g.dtype(), DType::F32);
            let d = differ(w, g);
            assert_eq!(d, 0, "f32 + {low:?}, tensor {i}: {d} differ");
        }
    }
}

/// Tensors of three element types in one call: one launch per type, each sum as alone.
#[test]
fn sums_of_squares_of_mixed_types_are_each_as_alone() {
    let Some(dev) = gpu() else { return };
    let ts: Vec<Tensor> = [
        (DType::BF16, 5000usize),
        (DType::F32, 70_001),
        (DType::F16, 1),
        (DType::BF16, 3),
    ]
    .iter()
    .enumerate()
    .map(|(i, (d, n))| {
        rand(500 + i as u64, *n, 2.0)
            .to_dtype(*d)
            .unwrap()
            .to_device(&dev)
            .unwrap()
    })
    .collect();
    let all = sum_sq_each(&ts.iter().collect::<Vec<_>>()).unwrap();
    for (i, t) in ts.iter().enumerate() {
        assert_eq!(all[i], sum_sq_each(&[t]).unwrap()[0], "tensor {i}");
    }
}
