//! An auxiliary loss trained where it is computed: [`with_aux_loss`] passes a layer's output on
//! unchanged and, in the backward, gives the auxiliary loss (an MoE router's load balance) the
//! gradient it has in the training objective, whatever reaches the output (Megatron's
//! `MoEAuxLossAutoScaler`). So the loss trains its layer on whichever pipeline stage the layer
//! sits, without travelling to the last stage.
//!
//! The weight is what the trainer's backward gives one micro-batch's loss: the loss scale over
//! the number of micro-batches of the global batch ([`crate::model::Cx::aux_weight`]), times the
//! auxiliary loss's own coefficient.

use candle_core::Tensor;

use crate::Result;

/// `x`, whose backward also gives `aux` (a scalar) the gradient `weight`: as if
/// `weight * aux` were added to what is differentiated.
pub fn with_aux_loss(x: &Tensor, aux: &Tensor, weight: f64) -> Result<Tensor> {
    if weight == 0.0 {
        return Ok(x.clone());
    }
    let value = x.detach();
    crate::distributed::comm::precomputed2([x, aux], value, "aux_loss", move |args, _, grad| {
        Ok(vec![
            grad.clone(),
            args[1].ones_like()?.affine(weight, 0.0)?,
        ])
    })
}
