use std::collections::HashMap;

use candle_core::{DType, Tensor, Var};

use super::{only_entries, read_step, state_entry, step_tensor, Optimizer, StateDict};
use crate::model::grads::Grads;
use crate::{invalid, Result};

/// SGD hyper-parameters (PyTorch's names and defaults).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SgdConfig {
    /// Momentum factor (0: none).
    pub momentum: f64,
    /// Dampening of the momentum.
    pub dampening: f64,
    /// L2 weight decay added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
}

/// SGD exactly as `torch.optim.SGD`: L2 weight decay added to the gradient, a momentum buffer
/// that starts as the first gradient, optional dampening and Nesterov momentum.
pub struct Sgd {
    params: Vec<(String, Var)>,
    cfg: SgdConfig,
    step: u64,
    buf: HashMap<String, Tensor>,
}

impl Sgd {
    /// SGD over `params` with `cfg`.
    pub fn new(params: Vec<(String, Var)>, cfg: SgdConfig) -> Result<Self> {
        if cfg.momentum < 0.0 || cfg.weight_decay < 0.0 {
            return Err(invalid!("SGD needs momentum >= 0 and weight_decay >= 0"));
        }
        if cfg.nesterov && (cfg.momentum <= 0.0 || cfg.dampening != 0.0) {
            return Err(invalid!(
                "Nesterov momentum requires momentum > 0 and zero dampening"
            ));
        }
        Ok(Self {
            params,
            cfg,
            step: 0,
            buf: HashMap::new(),
        })
    }
}

impl Optimizer for Sgd {
    fn step(&mut self, grads: &Grads, lr: f64) -> Result<()> {
        self.step += 1;
        let c = self.cfg;
        for (name, var) in &self.params {
            let Some(g) = grads.get(name) else { continue };
            let p = var.as_tensor().detach().to_dtype(DType::F32)?;
            let mut g = g.detach().to_dtype(DType::F32)?;
            if c.weight_decay != 0.0 {
                g = (g + (&p * c.weight_decay)?)?;
            }
            if c.momentum != 0.0 {
                let b = match self.buf.get(name) {
                    Some(b) => ((b * c.momentum)? + (&g * (1.0 - c.dampening))?)?,
                    None => g.clone(),
                };
                g = if c.nesterov {
                    (g + (&b * c.momentum)?)?
                } else {
                    b.clone()
                };
                self.buf.insert(name.clone(), b);
            }
            let p = (p - (g * lr)?)?;
            var.set(&p.to_dtype(var.dtype())?)?;
        }
        Ok(())
    }

    fn state_dict(&self) -> Result<StateDict> {
        let mut s = StateDict::new();
        s.insert("step".into(), step_tensor(self.step)?);
        for (name, _) in &self.params {
            if let Some(b) = self.buf.get(name) {
                s.insert(format!("{name}.momentum_buffer"), b.clone());
            }
        }
        Ok(s)
    }

    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        only_entries(state, &["momentum_buffer"], "SGD")?;
        let step = read_step(state)?;
        let mut buf = HashMap::new();
        for (name, var) in &self.params {
            let key = format!("{name}.momentum_buffer");
            if state.contains_key(&key) {
                buf.insert(name.clone(), state_entry(state, &key, var)?);
            }
        }
        self.step = step;
        self.buf = buf;
        Ok(())
    }

    fn params(&self) -> &[(String, Var)] {
        &self.params
    }
}
