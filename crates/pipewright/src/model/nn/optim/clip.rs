use crate::model::grads::Grads;
use crate::{invalid, Result};

/// Scales every gradient so that their global L2 norm is at most `max_norm`, as
/// `torch.nn.utils.clip_grad_norm_` (coefficient `max_norm / (norm + 1e-6)`, applied only when
/// below one). Returns the norm before clipping.
pub fn clip_grad_norm(grads: &mut Grads, max_norm: f64) -> Result<f64> {
    let norm = grads.norm()?;
    scale_to_norm(grads, norm, max_norm)?;
    Ok(norm)
}

/// The scaling of [`clip_grad_norm`] for a global norm computed elsewhere (over several
/// ranks, or with tied parameters counted once).
pub fn scale_to_norm(grads: &mut Grads, norm: f64, max_norm: f64) -> Result<()> {
    if max_norm.is_nan() || max_norm <= 0.0 {
        return Err(invalid!(
            "max gradient norm must be positive, got {max_norm}"
        ));
    }
    let coef = max_norm / (norm + 1e-6);
    if coef < 1.0 {
        grads.scale(coef)?;
    }
    Ok(())
}
