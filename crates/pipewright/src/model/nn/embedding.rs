//! Token embedding lookup.

use candle_core::{DType, Tensor, Var};

use super::{join, Module};
use crate::model::deferred::{WeightGradQueue, Work};
use crate::model::init::Init;
use crate::model::Cx;
use crate::{kernels, Error, Result};

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
    /// The ids are checked on their host copy when `cx` has one ([`Cx::host_copy`]).
    pub fn forward_cx(&self, ids: &Tensor, cx: &Cx) -> Result<Tensor> {
        self.run_cx(ids, cx.host_copy(ids), cx)
    }

    /// [`Embedding::forward_cx`] of `ids` whose values `host` holds on the host (made there
    /// and uploaded: positions, a shard's local ids), checked there: reading the device's copy
    /// would wait for all the work queued before it.
    pub fn forward_with_host(&self, ids: &Tensor, host: &Tensor, cx: &Cx) -> Result<Tensor> {
        self.run_cx(ids, Some(host), cx)
    }

    /// Looks `ids` up in `cx`, its weight gradient deferred to `cx`'s queue if it has one.
    fn run_cx(&self, ids: &Tensor, host: Option<&Tensor>, cx: &Cx) -> Result<Tensor> {
        let defer = cx.weight_grads.as_ref().map(|q| (q, cx.micro_batch));
        self.run(ids, defer, host)
    }

    /// Looks ids up; out-of-range ids are an error naming the layer.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        self.run(ids, None, None)
    }

    fn run(
        &self,
        ids: &Tensor,
        defer: Option<(&WeightGradQueue, usize)>,
        host: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (num, dim) = self.weight.dims2()?;
        let flat = ids.flatten_all()?.to_dtype(DType::U32)?;
        // The largest id, read where no read waits for the device if there is such a copy.
        let checked = match host {
            Some(h) => h.flatten_all()?.to_dtype(DType::U32)?,
            None => flat.clone(),
        };
        let max = checked
            .max(0)
            .ok()
            .map(|m| m.to_scalar::<u32>())
            .transpose()?;
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

/// The ids' check on their host copy, on a GPU (the `cuda` build's library tests; without a GPU
/// they fail unless told to skip).
#[cfg(all(test, feature = "cuda"))]
mod gpu_tests {
    use super::*;
    use crate::model::Mode;
    use candle_core::Device;

    #[test]
    fn ids_are_checked_on_their_host_copy() {
        let Some(gpu) = crate::runtime::device::test_gpu() else {
            return;
        };
        let table = Tensor::arange(0f32, 10.0, &gpu)
            .unwrap()
            .reshape((5, 2))
            .unwrap();
        let e = Embedding::from_var("emb", Var::from_tensor(&table).unwrap());
        let host = Tensor::new(&[4u32, 0, 2], &Device::Cpu).unwrap();
        let ids = host.to_device(&gpu).unwrap();
        let mut cx = Cx::new(Mode::Train, 0, 0, 0);
        cx.set_host_copy(&ids, host.clone());
        let y = e
            .forward_cx(&ids, &cx)
            .unwrap()
            .to_device(&Device::Cpu)
            .unwrap();
        let rows: Vec<Vec<f32>> = y.to_vec2().unwrap();
        assert_eq!(rows, [[8.0, 9.0], [0.0, 1.0], [4.0, 5.0]]);
        // A copy that says an id is out of range is believed: it is the batch the ids came from.
        let bad = Tensor::new(&[4u32, 9, 2], &Device::Cpu).unwrap();
        let err = e
            .forward_with_host(&ids, &bad, &cx)
            .unwrap_err()
            .to_string();
        assert!(err.contains("id 9 is outside the table of 5"), "{err}");
    }
}
