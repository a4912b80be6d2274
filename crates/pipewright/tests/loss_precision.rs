//! Cross-entropy of f16 and bf16 logits: the loss in f32 and the logits' gradient rounded once
//! to their type, bit for bit what casting the logits to f32 first (and the cast's backward)
//! gave, including logits read in place from a wider, padded product, and an ignored target.

use candle_core::{DType, Device, Tensor, Var};
use pipewright::model::nn::{cross_entropy_sum, IGNORE_INDEX};
use pipewright::runtime::seed::{normal_vec, rng_for};

/// The summed loss and the gradient of `logits` (a view of `wide`'s first `classes` columns
/// when `wide` is wider), with the logits cast to f32 first or not.
fn loss_and_grad(wide: &Tensor, classes: usize, targets: &Tensor, cast: bool) -> (Tensor, Tensor) {
    let v = Var::from_tensor(wide).unwrap();
    let logits = v.as_tensor().narrow(1, 0, classes).unwrap();
    let logits = match cast {
        true => logits.to_dtype(DType::F32).unwrap(),
        false => logits,
    };
    let (sum, _) = cross_entropy_sum(&logits, targets).unwrap();
    let g = sum.backward().unwrap();
    (sum, g.get(v.as_tensor()).unwrap().clone())
}

fn bits(t: &Tensor) -> Vec<u32> {
    let v: Vec<f32> = (t.to_dtype(DType::F32).unwrap().flatten_all().unwrap())
        .to_vec1()
        .unwrap();
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn low_precision_logits_give_the_losses_and_gradients_of_f32_copies_bit_for_bit() {
    let (rows, classes) = (7, 67);
    let targets = Tensor::new(&[3i64, 0, IGNORE_INDEX, 66, 12, 5, 40], &Device::Cpu).unwrap();
    for low in [DType::BF16, DType::F16] {
        for wide in [classes, 70] {
            let v: Vec<f32> = normal_vec(&mut rng_for(9, "ce-low"), rows * wide, 0.0, 4.0)
                .into_iter()
                .map(|x| x as f32)
                .collect();
            let x = Tensor::from_vec(v, (rows, wide), &Device::Cpu)
                .unwrap()
                .to_dtype(low)
                .unwrap();
            let (sum, g) = loss_and_grad(&x, classes, &targets, false);
            let (want, wg) = loss_and_grad(&x, classes, &targets, true);
            assert_eq!(sum.dtype(), DType::F32, "{low:?}: the loss is f32");
            assert_eq!(g.dtype(), low, "{low:?}: the gradient is the logits' type");
            assert_eq!(bits(&sum), bits(&want), "{low:?} x {wide}: loss");
            assert_eq!(bits(&g), bits(&wg), "{low:?} x {wide}: gradient");
        }
    }
}
