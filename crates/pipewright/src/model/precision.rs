//! Mixed precision (Varuna's `fp16`, apex's O2): the model computes in a low type (bf16 or
//! f16) while the optimizer keeps f32 master weights and its state in f32. After every step the
//! masters are cast into the model.
//!
//! f16 has a narrow range, so its gradients are computed of the loss times a scale
//! ([`LossScaler`]): starting at 2^16, halved (and the step skipped) when any rank finds an
//! inf or NaN, doubled after `growth_interval` clean steps. bf16 has f32's range and needs no
//! scaling.

use candle_core::{DType, Var};

use crate::kernels::cast::{assign_all, cast_all};
use crate::model::grads::Grads;
use crate::{invalid, Result};

/// The type the model computes in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// Everything in f32.
    F32,
    /// bfloat16 compute, f32 master weights.
    Bf16,
    /// float16 compute, f32 master weights and dynamic loss scaling.
    F16,
}

crate::runtime::words::word_enum!(Precision, "precision", {
    F32 => "f32" | "fp32",
    Bf16 => "bf16",
    F16 => "f16" | "fp16",
});

impl Precision {
    /// The element type the model computes in.
    pub fn dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::Bf16 => DType::BF16,
            Precision::F16 => DType::F16,
        }
    }

    /// Whether gradients need a loss scale (f16 only).
    pub fn scales_loss(self) -> bool {
        self == Precision::F16
    }
}

/// Dynamic loss scaling (apex's `DynamicLossScaler`, PyTorch's `GradScaler`); saved in
/// checkpoints.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LossScaler {
    scale: f64,
    growth_interval: u64,
    clean: u64,
    /// Overflows in a row (the steps skipped since the last clean one).
    #[serde(default)]
    skipped: u64,
}

/// Overflows in a row after which training is stopped as diverged (the scale has halved this
/// many times; from PyTorch's 2^16 it reaches its minimum of 1 after 16).
pub const MAX_SKIPPED_IN_A_ROW: u64 = 20;

impl LossScaler {
    /// PyTorch's defaults: scale 2^16, doubled after 2000 clean steps.
    pub fn new() -> Self {
        Self::with(65536.0, 2000)
    }

    /// A scaler starting at `scale` that doubles it after `growth_interval` steps without overflow.
    pub fn with(scale: f64, growth_interval: u64) -> Self {
        Self {
            scale,
            growth_interval: growth_interval.max(1),
            clean: 0,
            skipped: 0,
        }
    }

    /// The scale now.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// After a step: an overflow halves the scale (the step is skipped), `growth_interval`
    /// clean steps in a row double it.
    pub fn update(&mut self, overflow: bool) {
        if overflow {
            self.scale = (self.scale / 2.0).max(1.0);
            self.clean = 0;
            self.skipped += 1;
        } else {
            self.skipped = 0;
            self.clean += 1;
            if self.clean == self.growth_interval {
                self.scale *= 2.0;
                self.clean = 0;
            }
        }
    }
}

impl LossScaler {
    /// Why training should stop as diverged, if it should: an overflow at the minimum scale
    /// (DeepSpeed stops there too), or [`MAX_SKIPPED_IN_A_ROW`] skipped steps in a row. Without
    /// it a diverging f16 run would skip every step to the end and exit as if it had trained.
    pub fn diverged(&self) -> Option<String> {
        let at_min = self.scale <= 1.0 && self.skipped > 0;
        (at_min || self.skipped >= MAX_SKIPPED_IN_A_ROW).then(|| {
            format!(
                "the last {} steps overflowed and were skipped{}: the run diverged; lower the \
                 learning rate, enable clipping (--clip) or train in bf16",
                self.skipped,
                if at_min {
                    " and the loss scale reached its minimum of 1"
                } else {
                    ""
                }
            )
        })
    }
}

impl Default for LossScaler {
    fn default() -> Self {
        Self::new()
    }
}

/// Whether any gradient holds an inf or a NaN: [`crate::model::grads::finite_each`] over them, which
/// on the CPU and a GPU is one pass over each gradient in its own type (no f32 copy, no
/// absolute values), the GPU's read back at once.
pub fn has_overflow(grads: &Grads) -> Result<bool> {
    let ts: Vec<&candle_core::Tensor> = grads.iter().map(|(_, g)| g).collect();
    Ok(crate::model::grads::finite_each(&ts)?.iter().any(|f| !f))
}

/// Gradients in f32, multiplied by `factor` (the inverse loss scale); on a GPU one launch
/// (`kernels/cast.rs`).
pub fn to_master_grads(grads: &Grads, factor: f64) -> Result<Grads> {
    let ts: Vec<&candle_core::Tensor> = grads.iter().map(|(_, g)| g).collect();
    let cast = cast_all(&ts, Some(DType::F32), (factor != 1.0).then_some(factor))?;
    let mut out = Grads::new();
    for ((n, _), g) in grads.iter().zip(cast) {
        out.insert(n.clone(), g);
    }
    Ok(out)
}

/// The model's parameters (in the compute type) and their f32 masters, by global name.
pub struct MasterWeights {
    model: Vec<(String, Var)>,
    master: Vec<(String, Var)>,
}

impl MasterWeights {
    /// `model`: the parameters the model computes with; `master`: f32 parameters of the same
    /// names and shapes (the model's own when it computes in f32).
    pub fn new(model: Vec<(String, Var)>, master: Vec<(String, Var)>) -> Result<Self> {
        if model.len() != master.len() {
            return Err(invalid!(
                "{} model parameters but {} masters",
                model.len(),
                master.len()
            ));
        }
        for ((a, m), (b, w)) in model.iter().zip(&master) {
            if a != b || m.dims() != w.dims() || w.dtype() != DType::F32 {
                return Err(invalid!(
                    "master weight `{b}` {:?} {:?} does not match model parameter `{a}` {:?}",
                    w.dims(),
                    w.dtype(),
                    m.dims()
                ));
            }
        }
        Ok(Self { model, master })
    }

    /// The f32 parameters the optimizer updates.
    pub fn master(&self) -> &[(String, Var)] {
        &self.master
    }

    /// Casts every master into its model parameter (nothing to do when they are the same); on
    /// a GPU one launch.
    pub fn sync(&self) -> Result<()> {
        let pairs: Vec<(&candle_core::Tensor, &Var)> = (self.model.iter().zip(&self.master))
            .filter(|((_, m), (_, w))| m.as_tensor().id() != w.as_tensor().id())
            .map(|((_, m), (_, w))| (w.as_tensor(), m))
            .collect();
        Ok(assign_all(&pairs)?)
    }
}
