//! Token embedding lookup.

use candle_core::{DType, Tensor, Var};

use super::{join, Module};
use crate::model::deferred::{WeightGradQueue, Work};
use crate::model::init::Init;
use crate::model::Cx;
use crate::{model::kernels, Error, Result};

/// A `(num, dim)` table indexed by integer ids of any shape.
#[derive(Clone, Debug)]
pub struct Embedding {
    name: String,
    weight: Var,
}

impl Embedding {
    /// Normal(0, std) table.
    pub fn new(init: &Init, name: &str, num: usize, dim: usize, std: f64) -> Result<Self> {
        let weight = init.normal(&join(name, "weight"), &[num, dim], std)?;
        Ok(Self {
            name: name.to_string(),
            weight,
        })
    }

    /// An embedding `name` over an existing table `weight` (rows, dim).
    pub fn from_var(name: &str, weight: Var) -> Self {
        Self {
            name: name.to_string(),
            weight,
        }
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The table.
    pub fn weight(&self) -> &Var {
        &self.weight
    }

    /// [`Embedding::forward`], or with its weight gradient deferred to `cx`'s queue.
    pub fn forward_cx(&self, ids: &Tensor, cx: &Cx) -> Result<Tensor> {
        match &cx.weight_grads {
            None => self.forward(ids),
            Some(q) => self.run(ids, Some((q, cx.micro_batch))),
        }
    }

    /// Looks ids up; out-of-range ids are an error naming the layer.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.run(ids, None)
    }

    fn run(&self, ids: &Tensor, defer: Option<(&WeightGradQueue, usize)>) -> Result<Tensor> {
        let (num, dim) = self.weight.dims2()?;
        let flat = ids.flatten_all()?.to_dtype(DType::U32)?;
        let max = flat.max(0).ok().map(|m| m.to_scalar::<u32>()).transpose()?;
        if let Some(max) = max {
            if max as usize >= num {
                return Err(Error::Layer {
                    layer: self.name.clone(),
                    msg: format!("id {max} is outside the table of {num} entries"),
                });
            }
        }
        let mut dims = ids.dims().to_vec();
        dims.push(dim);
        let y = match defer {
            None if kernels::fused_or_gpu(self.weight.as_tensor()) => {
                kernels::embedding::lookup(self.weight.as_tensor(), &flat)?
            }
            None => self.weight.index_select(&flat, 0)?,
            Some((q, mb)) => {
                let y = self.weight.as_tensor().detach().index_select(&flat, 0)?;
                let work = Work::Embedding { rows: num, dim };
                q.tap(
                    y,
                    &flat,
                    self.weight.as_tensor(),
                    None,
                    mb,
                    &join(&self.name, "weight"),
                    work,
                )?
            }
        };
        Ok(y.reshape(dims)?)
    }
}

impl Module for Embedding {
    fn params(&self) -> Vec<(String, Var)> {
        vec![(join(&self.name, "weight"), self.weight.clone())]
    }
}
