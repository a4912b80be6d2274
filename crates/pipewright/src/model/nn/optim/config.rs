//! An optimizer as data: which one and its hyper-parameters, so a run description can record
//! it and any program can build it again over its parameters.

use candle_core::Var;
use serde::{Deserialize, Serialize};

use super::{AdamW, AdamWConfig, LrSchedule, Optimizer, Sgd, SgdConfig};
use crate::Result;

/// Which optimizer a run uses, with its hyper-parameters (serialized as
/// `{"adamw": {...}}` or `{"sgd": {...}}`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerConfig {
    /// [`AdamW`] (PyTorch's `torch.optim.AdamW`).
    AdamW(AdamWConfig),
    /// [`Sgd`] (PyTorch's `torch.optim.SGD`).
    Sgd(SgdConfig),
}

impl Default for OptimizerConfig {
    /// AdamW with PyTorch's defaults.
    fn default() -> Self {
        Self::AdamW(AdamWConfig::default())
    }
}

impl OptimizerConfig {
    /// The optimizer over `params` (what [`crate::engine::varuna::Varuna::set_optimizer`] takes);
    /// `tied`: the model's tied pairs (a tied pair decays as its embedding does).
    pub fn build(
        &self,
        params: Vec<(String, Var)>,
        tied: &[(String, String)],
    ) -> Result<Box<dyn Optimizer>> {
        Ok(match *self {
            Self::AdamW(c) => Box::new(AdamW::with_decay(params, c, |n, v| c.decays(n, v, tied))?),
            Self::Sgd(c) => Box::new(Sgd::new(params, c)?),
        })
    }
}

/// The optimizer section of a run: the optimizer, its learning rate by step and the gradient
/// clipping (serialized flat into its run's spec).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptimSpec {
    /// The optimizer and its hyper-parameters.
    pub optimizer: OptimizerConfig,
    /// The learning rate by step.
    pub lr: LrSchedule,
    /// Clip the global gradient norm to this.
    pub clip: Option<f64>,
}

impl Default for OptimSpec {
    /// AdamW with PyTorch's defaults at a constant 1e-3, no clipping.
    fn default() -> Self {
        Self {
            optimizer: OptimizerConfig::default(),
            lr: LrSchedule::Constant { lr: 1e-3 },
            clip: None,
        }
    }
}

impl OptimSpec {
    /// Fails on a clip that is not a positive finite norm.
    pub fn validate(&self) -> Result<()> {
        if let Some(c) = self.clip {
            if c <= 0.0 || !c.is_finite() {
                return Err(crate::invalid!(
                    "clip must be a positive norm (or none), got {c}"
                ));
            }
        }
        Ok(())
    }
}
