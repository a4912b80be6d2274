use serde::{Deserialize, Serialize};

use crate::{invalid, Result};

/// Learning rate as a function of the (0-based) step.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LrSchedule {
    /// The same rate every step.
    Constant {
        /// The rate.
        lr: f64,
    },
    /// Linear warm-up from lr/warmup to `lr` over `warmup` steps, then a cosine decay to
    /// `min_lr` at step `total`, constant after.
    WarmupCosine {
        /// The peak rate.
        lr: f64,
        /// Steps of linear warm-up from 0.
        warmup: u64,
        /// Steps of the whole run.
        total: u64,
        /// The rate the cosine ends at.
        min_lr: f64,
    },
}

impl LrSchedule {
    /// Fails on a schedule that cannot run (a negative rate, warm-up beyond the end).
    pub fn validate(&self) -> Result<()> {
        let (lr, min) = match *self {
            LrSchedule::Constant { lr } => (lr, 0.0),
            LrSchedule::WarmupCosine { lr, min_lr, .. } => (lr, min_lr),
        };
        if !(lr > 0.0 && lr.is_finite()) || min < 0.0 || min > lr {
            return Err(invalid!(
                "learning rate must be a positive number (got {lr}) and min_lr within [0, lr] (got {min})"
            ));
        }
        Ok(())
    }

    /// The learning rate at `step` (counted from 0).
    pub fn lr_at(&self, step: u64) -> f64 {
        match *self {
            LrSchedule::Constant { lr } => lr,
            LrSchedule::WarmupCosine {
                lr,
                warmup,
                total,
                min_lr,
            } => {
                if step < warmup {
                    lr * (step + 1) as f64 / warmup as f64
                } else if step >= total || total <= warmup {
                    min_lr
                } else {
                    let t = (step - warmup) as f64 / (total - warmup) as f64;
                    min_lr + 0.5 * (lr - min_lr) * (1.0 + (std::f64::consts::PI * t).cos())
                }
            }
        }
    }
}
