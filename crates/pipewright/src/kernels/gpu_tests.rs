//! The CUDA kernels against their CPU twins (the same ops' `cpu_fwd`), forward and backward,
//! in f32, bf16 and f16, odd sizes included, and empty ones in f32. Run on a GPU machine: the `cuda` build's
//! library tests, `kernels::gpu_tests` (tools/gpu-checks.sh `kernels`); on a machine without a
//! GPU they fail, unless `PIPEWRIGHT_SKIP_GPU_TESTS=1` says to skip them (CI only lints the
//! `cuda` build).
//!
//! Tolerances, largest difference over the largest reference value: f32 1e-5 (the kernels add
//! in other orders than the CPU's); bf16 and f16 four of the type's rounding steps (both sides
//! compute in f32 and round once, so a value near a rounding boundary may go either way, and
//! the backward reads the rounded forward).

use std::sync::atomic::Ordering;

use candle_core::{DType, Device, Tensor, Var};
use rand::{Rng, SeedableRng};

use super::{attention, bias, cross_entropy, dropout, gelu, layer_norm, IGNORE_INDEX};

pub(crate) type Op<'a> = &'a dyn Fn(&[Tensor]) -> candle_core::Result<Tensor>;

/// The GPU (without one a test fails, unless told to skip).
pub(super) use crate::runtime::device::test_gpu as gpu;

pub(crate) fn rand(seed: u64, shape: &[usize], scale: f32) -> Tensor {
    let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let n = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| (r.random::<f32>() * 2.0 - 1.0) * scale)
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// `op`'s output and its inputs' gradients (of `sum(y * r)`, `r` fixed), as f32 on the CPU.
/// An empty input is the first zero rows of a one-row variable (candle cannot copy an empty
/// tensor to a GPU; a view of none of its rows is how one arises there), whose gradient is
/// then that row's: zeros.
fn run(dev: &Device, dtype: DType, inputs: &[Tensor], op: Op) -> Vec<Tensor> {
    let vars: Vec<Var> = inputs
        .iter()
        .map(|t| {
            let mut dims = t.dims().to_vec();
            let t = if t.elem_count() == 0 {
                dims[0] = 1;
                Tensor::zeros(dims, DType::F32, &Device::Cpu).unwrap()
            } else {
                t.clone()
            };
            Var::from_tensor(&t.to_device(dev).unwrap().to_dtype(dtype).unwrap()).unwrap()
        })
        .collect();
    let ts: Vec<Tensor> = vars
        .iter()
        .zip(inputs)
        .map(|(v, t)| v.as_tensor().narrow(0, 0, t.dims()[0]).unwrap())
        .collect();
    let y = op(&ts).unwrap();
    let r = rand(99, y.dims(), 1.0)
        .to_dtype(dtype)
        .unwrap()
        .to_device(dev)
        .unwrap();
    let loss = (y.to_dtype(DType::F32).unwrap() * r.to_dtype(DType::F32).unwrap())
        .unwrap()
        .sum_all()
        .unwrap();
    let grads = loss.backward().unwrap();
    let mut out = vec![y];
    for v in &vars {
        let g = grads.get(v).cloned();
        out.push(g.unwrap_or_else(|| v.as_tensor().zeros_like().unwrap()));
    }
    out.iter()
        .map(|t| {
            t.to_dtype(DType::F32)
                .unwrap()
                .to_device(&Device::Cpu)
                .unwrap()
        })
        .collect()
}

fn tolerance(dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => 4.0 * 2f32.powi(-8),
        DType::F16 => 4.0 * 2f32.powi(-11),
        _ => 1e-5,
    }
}

/// Runs `op` on the CPU and the GPU in every type and compares every output. Empty inputs
/// in f32 alone: candle's own casts cannot run on an empty GPU tensor (a launch of no blocks
/// is an error), and the harness would cast.
pub(crate) fn compare(what: &str, inputs: &[Tensor], op: Op) {
    let Some(dev) = gpu() else { return };
    let empty = inputs.iter().any(|t| t.elem_count() == 0);
    let dtypes: &[DType] = if empty {
        &[DType::F32]
    } else {
        &[DType::F32, DType::BF16, DType::F16]
    };
    for &dtype in dtypes {
        let want = run(&Device::Cpu, dtype, inputs, op);
        let got = run(&dev, dtype, inputs, op);
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            let part = if k == 0 {
                "output".to_string()
            } else {
                format!("gradient {k}")
            };
            assert_eq!(g.dims(), w.dims(), "{what} {part} in {dtype:?}: shape");
            if w.elem_count() == 0 {
                continue;
            }
            let diff = (g - w)
                .unwrap()
                .abs()
                .unwrap()
                .flatten_all()
                .unwrap()
                .max(0)
                .unwrap();
            let top = w.abs().unwrap().flatten_all().unwrap().max(0).unwrap();
            let (diff, top) = (
                diff.to_scalar::<f32>().unwrap(),
                top.to_scalar::<f32>().unwrap(),
            );
            let off = diff / top.max(1e-6);
            assert!(
                off <= tolerance(dtype),
                "{what} {part} in {dtype:?}: off by {off:e} (largest difference {diff:e})"
            );
            eprintln!("{what} {part} {dtype:?}: {off:.1e}");
        }
    }
}

#[test]
fn gelu_matches_the_cpu() {
    for (i, shape) in [&[3usize, 1001][..], &[70_000], &[0, 4]].iter().enumerate() {
        compare(
            &format!("gelu {shape:?}"),
            &[rand(i as u64, shape, 4.0)],
            &|x| gelu::gelu(&x[0]),
        );
    }
}

#[test]
fn bias_add_matches_the_cpu() {
    for (i, (rows, cols)) in [(37, 50), (1000, 768), (0, 8)].into_iter().enumerate() {
        let (y, b) = (
            rand(10 + i as u64, &[rows, cols], 1.0),
            rand(20 + i as u64, &[cols], 1.0),
        );
        compare(&format!("bias add {rows}x{cols}"), &[y, b], &|t| {
            bias::bias_add(&t[0], &t[1])
        });
    }
}

#[test]
fn layer_norm_matches_the_cpu() {
    for (i, (rows, cols)) in [(33, 768), (9, 5), (4, 2500), (0, 8)]
        .into_iter()
        .enumerate()
    {
        let s = 30 + 3 * i as u64;
        let x = (rand(s, &[rows, cols], 2.0) + 0.5).unwrap();
        let (w, b) = (rand(s + 1, &[cols], 1.0), rand(s + 2, &[cols], 1.0));
        compare(&format!("layer norm {rows}x{cols}"), &[x, w, b], &|t| {
            layer_norm::layer_norm(&t[0], &t[1], &t[2], 1e-5)
        });
    }
}

#[test]
fn cross_entropy_matches_the_cpu() {
    for (i, (rows, classes)) in [(5, 7), (3, 50_257), (0, 9)].into_iter().enumerate() {
        let logits = rand(50 + i as u64, &[rows, classes], 6.0);
        let targets: Vec<i64> = (0..rows)
            .map(|r| {
                if r == 1 {
                    IGNORE_INDEX
                } else {
                    ((r * 7919) % classes) as i64
                }
            })
            .collect();
        compare(
            &format!("cross-entropy {rows}x{classes}"),
            &[logits],
            &|t| cross_entropy::nll_rows(&t[0], targets.clone()),
        );
        // The same rows read in place from wider ones (a padded head's logits), as (2, rows/2,
        // classes) where they split evenly.
        let wide = rand(60 + i as u64, &[rows, classes + 47], 6.0);
        compare(
            &format!("cross-entropy {rows}x{classes} of {}", classes + 47),
            &[wide],
            &|t| {
                let v = t[0].narrow(1, 0, classes)?;
                let v = if rows % 2 == 0 && rows > 0 {
                    t[0].reshape((2, rows / 2, classes + 47))?
                        .narrow(2, 0, classes)?
                } else {
                    v
                };
                cross_entropy::nll_rows(&v, targets.clone())
            },
        );
    }
}

#[test]
fn rms_norm_matches_the_cpu() {
    for (i, (rows, cols)) in [(7, 33), (5, 2048), (0, 16)].into_iter().enumerate() {
        let x = rand(80 + i as u64, &[rows, cols], 3.0);
        let w = rand(90 + i as u64, &[cols], 1.0);
        compare(&format!("rms norm {rows}x{cols}"), &[x, w], &|t| {
            super::rms_norm::rms_norm(&t[0], &t[1], 1e-6)
        });
    }
}

#[test]
fn swiglu_matches_the_cpu() {
    for (i, n) in [1usize, 1001, 70_000].into_iter().enumerate() {
        let (g, u) = (
            rand(100 + i as u64, &[n], 6.0),
            rand(110 + i as u64, &[n], 2.0),
        );
        compare(&format!("swiglu {n}"), &[g, u], &|t| {
            super::swiglu::swiglu(&t[0], &t[1])
        });
    }
}

#[test]
fn embedding_matches_the_cpu() {
    // Repeated ids (the backward adds each id's tokens in order), one id never used, and more
    // tokens than the placing kernel takes (candle's index_add then).
    for (i, (rows, dim, tokens)) in [(50, 7, 300), (1000, 96, 4099), (64, 5, 17_000)]
        .into_iter()
        .enumerate()
    {
        let table = rand(130 + i as u64, &[rows, dim], 1.0);
        let ids: Vec<u32> = (0..tokens)
            .map(|j| ((j * 7 + j / 3) % (rows - 1)) as u32)
            .collect();
        compare(
            &format!("embedding {rows}x{dim}, {tokens} tokens"),
            &[table],
            &|t| {
                let ids = Tensor::from_slice(&ids, tokens, t[0].device())?;
                super::embedding::lookup(&t[0], &ids)
            },
        );
    }
}

#[test]
fn dropout_matches_the_cpu() {
    // The same integers draw the same mask; a part of a split tensor, and no elements at all.
    for (i, (dims, part)) in [
        (vec![1001], (0, 0, 1)),
        (vec![4, 6, 9], (1, 2, 3)),
        (vec![0, 5], (0, 0, 1)),
    ]
    .into_iter()
    .enumerate()
    {
        let x = rand(70 + i as u64, &dims, 2.0);
        compare(&format!("dropout {dims:?} part {part:?}"), &[x], &|t| {
            dropout::dropout(&t[0], 0.3, 11 + i as u64, part)
        });
    }
}

#[test]
fn causal_attention_matches_the_cpu() {
    // (batch, time, heads, head dim): each head-dimension bucket, odd lengths, one past a
    // block of 64 rows, and no batch at all.
    for (i, (b, t, h, hd)) in [
        (2, 67, 3, 24),
        (1, 130, 2, 64),
        (1, 65, 1, 128),
        (2, 1, 2, 40),
        (0, 5, 2, 16),
    ]
    .into_iter()
    .enumerate()
    {
        let qkv = rand(70 + i as u64, &[b, t, 3 * h * hd], 1.5);
        let scale = 1.0 / (hd as f64).sqrt();
        // bf16 and f16 through the tensor-core flash kernels (f32 then takes cuBLAS), then
        // every type through cuBLAS (the scores fit the scratch), then the SIMT flash kernels.
        for (path, scratch, tensor_cores) in [
            ("tensor-core flash", 256 << 20, true),
            ("cuBLAS", 256 << 20, false),
            ("cuBLAS by head", 300_000, false),
            ("flash", 0, false),
        ] {
            super::attention::cuda::TENSOR_CORE_FLASH.store(tensor_cores, Ordering::Relaxed);
            super::attention_blas::SCRATCH_BYTES.store(scratch, Ordering::Relaxed);
            compare(
                &format!("{path} attention {b}x{t}, {h} heads of {hd}"),
                std::slice::from_ref(&qkv),
                &|x| attention::causal_attention(&x[0], h, scale),
            );
        }
        super::attention_blas::SCRATCH_BYTES.store(256 << 20, Ordering::Relaxed);
        super::attention::cuda::TENSOR_CORE_FLASH.store(true, Ordering::Relaxed);
    }
}

#[test]
fn sum_of_squares_matches_the_cpu() {
    let Some(dev) = gpu() else { return };
    for (i, n) in [1usize, 1_000_003, 0].into_iter().enumerate() {
        let x = rand(90 + i as u64, &[n], 3.0);
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            // The CPU's f32 sum of the values the GPU holds (rounded to `dtype`).
            let held = x.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap();
            let want = super::reduce::sum_sq_each(&[&held]).unwrap()[0].unwrap();
            let on_gpu = x.to_dtype(dtype).unwrap().to_device(&dev).unwrap();
            let got = super::reduce::sum_sq_each(&[&on_gpu]).unwrap()[0].expect("the GPU sums");
            let off = (got - want).abs() / want.max(1e-300);
            assert!(
                off <= 1e-12,
                "sum of squares of {n} {dtype:?}: {got} against {want}"
            );
        }
    }
    // Several tensors (one empty, one on the CPU) in one call: each its own sum, as alone.
    let (a, b) = (rand(95, &[70_001], 2.0), rand(96, &[3, 5], 1.0));
    let (ga, gb) = (a.to_device(&dev).unwrap(), b.to_device(&dev).unwrap());
    let empty = ga.narrow(0, 0, 0).unwrap();
    let each = super::reduce::sum_sq_each(&[&ga, &empty, &b, &gb]).unwrap();
    let alone = |t: &Tensor| super::reduce::sum_sq_each(&[t]).unwrap()[0].unwrap();
    assert_eq!(
        each,
        [
            Some(alone(&ga)),
            Some(0.0),
            Some(alone(&b)),
            Some(alone(&gb))
        ]
    );
    // The overflow check (`grads::finite_each`) reads whether these sums are finite.
    let sum = |v: &[f32]| {
        let t = Tensor::new(v, &dev).unwrap();
        super::reduce::sum_sq_each(&[&t]).unwrap()[0].expect("the GPU sums squares")
    };
    assert!(
        !sum(&[1.0, f32::INFINITY, 2.0]).is_finite(),
        "an infinity is not finite"
    );
    assert!(!sum(&[f32::NAN, 1.0]).is_finite(), "a NaN is not finite");
    assert!(
        sum(&[f32::MAX, -f32::MAX]).is_finite(),
        "f32::MAX is finite"
    );
}
