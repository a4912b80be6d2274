//! The model's own GPU paths against their CPU twins, with the kernels' harness
//! (`kernels::gpu_tests`: the same tolerances, f32, bf16 and f16): rotary embedding from any
//! position and the padded head product. Run on a GPU machine with the `cuda` build's library
//! tests named `gpu_tests` (tools/gpu-checks.sh `kernels`).

use crate::kernels::gpu_tests::{compare, rand};
use crate::model::WeightLayout;

#[test]
fn rotary_matches_the_cpu() {
    // (batch, heads, time, head dim) from position `start` (decoding after cached tokens).
    for (i, (dims, start)) in [
        ([2, 3, 17, 64], 0),
        ([1, 2, 5, 128], 1000),
        ([0, 2, 3, 8], 0),
    ]
    .into_iter()
    .enumerate()
    {
        let x = rand(120 + i as u64, &dims, 2.0);
        compare(&format!("rotary {dims:?} from {start}"), &[x], &|t| {
            super::rope(&t[0], start, 10_000.0).map_err(|e| candle_core::Error::Msg(e.to_string()))
        });
    }
}

#[test]
fn padded_product_matches_the_cpu() {
    // A head of 1029 outputs (rows of 2058 bf16 bytes, not 16-byte multiples): padded to 1088
    // on the GPU, its view of the first 1029 columns, and the gradients through it.
    for layout in [WeightLayout::OutIn, WeightLayout::InOut] {
        let (rows, inp, out) = (37, 64, 1029);
        let dims = match layout {
            WeightLayout::OutIn => [out, inp],
            WeightLayout::InOut => [inp, out],
        };
        let (x, w) = (rand(140, &[rows, inp], 1.0), rand(141, &dims, 0.2));
        compare(&format!("padded product {layout:?}"), &[x, w], &|t| {
            let y = super::linear::padded_product(&t[0], &t[1], layout)
                .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
            y.narrow(1, 0, out)
        });
    }
}
