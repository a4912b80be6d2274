//! Differentiable building blocks that candle lacks for training (never `candle_nn`'s fused
//! layer norm, softmax or sdpa, whose gradients silently stop), and optimizers whose state can
//! be saved. On the CPU GELU, LayerNorm, softmax, cross-entropy and AdamW run as fused kernels
//! with their own backward; elsewhere as ops whose backward candle implements.

pub mod activation;
pub mod aux_loss;
pub mod batch_norm;
pub mod conv;
pub mod dropout;
pub mod embedding;
#[cfg(all(test, feature = "cuda"))]
mod gpu_tests;
pub mod layer_norm;
pub mod linear;
pub mod loss;
pub mod optim;
pub mod rms_norm;
pub mod rotary;

pub use crate::kernels::IGNORE_INDEX;
pub use crate::model::deferred;
pub use crate::model::grads::{max_rel_diff, sum_sq_share, Grads};
pub use crate::model::init::Init;
pub use crate::model::WeightLayout;
pub use activation::{
    causal_mask, fused_causal_attention, gelu, relu, residual, scaled_softmax, softmax_last_dim,
    swiglu,
};
pub use aux_loss::with_aux_loss;
pub use batch_norm::BatchNorm2d;
pub use conv::Conv2d;
pub use dropout::Dropout;
pub use embedding::Embedding;
pub use layer_norm::LayerNorm;
pub use linear::Linear;
pub use loss::{count_targets, cross_entropy, cross_entropy_sum};
pub use rms_norm::{rms_norm, RmsNorm};
pub use rotary::rope;

use candle_core::Var;

/// Anything that owns named parameters.
pub trait Module {
    /// Every parameter with its global name.
    fn params(&self) -> Vec<(String, Var)>;
}

/// Joins a prefix and a name with a dot (`"h.3"`, `"attn"` -> `"h.3.attn"`).
pub fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}
