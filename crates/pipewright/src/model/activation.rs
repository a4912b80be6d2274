//! [`Activation`]: what flows between layers and across cut points.

use candle_core::Tensor;

use crate::model::batch::Batch;
use crate::{invalid, Error, Result};

/// What flows between layers: one tensor or a tuple of tensors, batch on dim 0.
#[derive(Clone, Debug)]
pub enum Activation {
    /// One tensor.
    Tensor(Tensor),
    /// A tuple of tensors, each with the batch on dim 0 (any dtypes).
    Tuple(Vec<Tensor>),
}

impl From<Tensor> for Activation {
    fn from(t: Tensor) -> Self {
        Activation::Tensor(t)
    }
}

impl Activation {
    /// The tensors of `names` taken from `batch`: one tensor for one name, a tuple for several
    /// (`who` names the asker in the error when the batch lacks one).
    pub fn from_batch(batch: &Batch, names: &[String], who: &str) -> Result<Self> {
        let ts = names
            .iter()
            .map(|n| batch.require(n, who).cloned())
            .collect::<Result<Vec<_>>>()?;
        Ok(match <[Tensor; 1]>::try_from(ts) {
            Ok([t]) => Activation::Tensor(t),
            Err(ts) => Activation::Tuple(ts),
        })
    }

    /// The single tensor, or an error naming `layer` if this is a tuple.
    pub fn into_tensor(self, layer: &str) -> Result<Tensor> {
        match self {
            Activation::Tensor(t) => Ok(t),
            Activation::Tuple(ts) => Err(Error::Layer {
                layer: layer.to_string(),
                msg: format!("expects one tensor, got a tuple of {}", ts.len()),
            }),
        }
    }

    /// Every tensor of the activation, in order.
    pub fn tensors(&self) -> Vec<&Tensor> {
        match self {
            Activation::Tensor(t) => vec![t],
            Activation::Tuple(ts) => ts.iter().collect(),
        }
    }

    /// The tensors, owned, in order.
    pub fn into_tensors(self) -> Vec<Tensor> {
        match self {
            Activation::Tensor(t) => vec![t],
            Activation::Tuple(ts) => ts,
        }
    }

    /// A single tensor for one, a tuple for several (the inverse of
    /// [`Activation::into_tensors`] when `tuple` says which it was).
    pub fn from_tensors(mut ts: Vec<Tensor>, tuple: bool) -> Self {
        if !tuple && ts.len() == 1 {
            Activation::Tensor(ts.remove(0))
        } else {
            Activation::Tuple(ts)
        }
    }

    /// Number of tensors (1 for a single tensor).
    pub fn arity(&self) -> usize {
        match self {
            Activation::Tensor(_) => 1,
            Activation::Tuple(ts) => ts.len(),
        }
    }

    /// Whether this is a tuple (even of one tensor).
    pub fn is_tuple(&self) -> bool {
        matches!(self, Activation::Tuple(_))
    }

    /// The batch size (dim 0 of the first tensor).
    pub fn batch_size(&self) -> Result<usize> {
        let t = self
            .tensors()
            .first()
            .copied()
            .ok_or_else(|| invalid!("an empty tuple has no batch dimension"))?
            .clone();
        Ok(t.dims().first().copied().unwrap_or(0))
    }
}
