use std::collections::HashMap;

use candle_core::{DType, Tensor, Var};

use super::{decays, only_entries, read_step, state_entry, step_tensor, Optimizer, StateDict};
use crate::kernels::adamw::{self, AdamWStep};
use crate::model::grads::Grads;
use crate::{invalid, Result};

/// AdamW hyper-parameters (PyTorch defaults).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AdamWConfig {
    /// Decay of the first moment (0.9).
    pub beta1: f64,
    /// Decay of the second moment (0.999).
    pub beta2: f64,
    /// Added to the root of the second moment (1e-8).
    pub eps: f64,
    /// Decoupled weight decay (0.01).
    pub weight_decay: f64,
    /// Whether embedding tables decay too (minGPT's and nanoGPT's rule, the default), or only
    /// the other matrices (see [`AdamWConfig::decays`]). Runs recorded before it decayed them.
    #[serde(default = "yes")]
    pub decay_embeddings: bool,
}

fn yes() -> bool {
    true
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            decay_embeddings: true,
        }
    }
}

impl AdamWConfig {
    /// Whether the parameter `name` decays: a matrix or an embedding ([`decays`]), unless
    /// embeddings are kept out, and then neither an embedding table ([`is_embedding`]) nor a
    /// parameter `tied` to one (GPT-2's head is its token embedding: one parameter in PyTorch).
    pub fn decays(&self, name: &str, var: &Var, tied: &[(String, String)]) -> bool {
        let embedding = || {
            is_embedding(name)
                || tied
                    .iter()
                    .any(|(a, b)| (a == name && is_embedding(b)) || (b == name && is_embedding(a)))
        };
        decays(name, var) && (self.decay_embeddings || !embedding())
    }
}

/// Whether `name` is an embedding table's: GPT-2's token and position embeddings
/// (`wte`, `wpe`) and the Llama's `embed_tokens`, as Hugging Face names them.
pub fn is_embedding(name: &str) -> bool {
    ["wte.weight", "wpe.weight", "embed_tokens.weight"]
        .iter()
        .any(|e| name == *e || name.ends_with(&format!(".{e}")))
}

/// Parameter elements whose moments one fused update writes at once (256 MiB of each moment
/// in f32): on a GPU a launch each, and the most new moments held beside the old.
const MOMENTS_AT_ONCE: usize = 1 << 26;

/// Consecutive ranges of `sizes`, each summing to at most `cap` (a larger size alone).
fn groups(sizes: &[usize], cap: usize) -> Vec<std::ops::Range<usize>> {
    let mut out: Vec<std::ops::Range<usize>> = Vec::new();
    let mut held = 0;
    for (i, &n) in sizes.iter().enumerate() {
        match out.last_mut() {
            Some(r) if held + n <= cap => r.end = i + 1,
            _ => {
                out.push(i..i + 1);
                held = 0;
            }
        }
        held += n;
    }
    out
}

/// AdamW exactly as `torch.optim.AdamW`: decoupled decay `p *= 1 - lr*wd`, bias-corrected
/// moments, `eps` added after the square root of the corrected second moment. Moments are
/// kept in f32 whatever the parameter's type. An f32 parameter on the CPU is updated in place
/// in one pass (the same f32 operations, fused); others by tensor ops.
pub struct AdamW {
    params: Vec<(String, Var)>,
    decay: Vec<bool>,
    cfg: AdamWConfig,
    step: u64,
    m: HashMap<String, Tensor>,
    v: HashMap<String, Tensor>,
}

impl AdamW {
    /// Decay applies where [`decays`] says so; use [`AdamW::with_decay`] to choose.
    pub fn new(params: Vec<(String, Var)>, cfg: AdamWConfig) -> Result<Self> {
        Self::with_decay(params, cfg, decays)
    }

    /// AdamW over `params`, with weight decay only on the parameters `decay` accepts (by name).
    pub fn with_decay(
        params: Vec<(String, Var)>,
        cfg: AdamWConfig,
        decay_if: impl Fn(&str, &Var) -> bool,
    ) -> Result<Self> {
        if !(0.0..1.0).contains(&cfg.beta1) || !(0.0..1.0).contains(&cfg.beta2) {
            return Err(invalid!(
                "AdamW betas must lie in [0, 1), got {} and {}",
                cfg.beta1,
                cfg.beta2
            ));
        }
        if cfg.eps <= 0.0 || cfg.weight_decay < 0.0 {
            return Err(invalid!("AdamW needs eps > 0 and weight_decay >= 0"));
        }
        let decay = params.iter().map(|(n, v)| decay_if(n, v)).collect();
        Ok(Self {
            params,
            decay,
            cfg,
            step: 0,
            m: HashMap::new(),
            v: HashMap::new(),
        })
    }

    /// Steps taken (the bias correction's count).
    pub fn steps_taken(&self) -> u64 {
        self.step
    }
}

impl Optimizer for AdamW {
    fn step(&mut self, grads: &Grads, lr: f64) -> Result<()> {
        self.step += 1;
        let AdamWConfig {
            beta1,
            beta2,
            eps,
            weight_decay,
            ..
        } = self.cfg;
        let bc1 = 1.0 - beta1.powi(self.step as i32);
        let bc2_sqrt = (1.0 - beta2.powi(self.step as i32)).sqrt();
        let step_size = lr / bc1;
        let decay_of =
            |decays: bool| (decays && weight_decay != 0.0).then_some(1.0 - lr * weight_decay);
        // The parameters the fused update takes, all at once (on a GPU, one launch).
        let mut fused = Vec::new();
        let mut composed = Vec::new();
        for ((name, var), &decay) in self.params.iter().zip(&self.decay) {
            let Some(g) = grads.get(name) else { continue };
            let g = g.detach().to_dtype(DType::F32)?;
            match adamw::applies(var.as_tensor()) {
                true => fused.push((name, var, g, decay)),
                false => composed.push((name, var, g, decay)),
            }
        }
        let c = AdamWStep {
            beta1,
            beta2,
            inv_bc2_sqrt: 1.0 / bc2_sqrt,
            eps,
            step_size,
        };
        // In groups of about MOMENTS_AT_ONCE elements, each group's old moments freed as its
        // new ones replace them: all at once, the old and new moments of the whole model
        // were held together.
        let sizes: Vec<usize> = fused.iter().map(|(_, var, ..)| var.elem_count()).collect();
        for range in groups(&sizes, MOMENTS_AT_ONCE) {
            let group = &fused[range];
            let params: Vec<adamw::Param> = group
                .iter()
                .map(|(name, var, g, decay)| adamw::Param {
                    p: var.as_tensor(),
                    g,
                    m: self.m.get(*name),
                    v: self.v.get(*name),
                    decay: decay_of(*decay),
                })
                .collect();
            let moments = adamw::update_all(&params, c)?;
            drop(params);
            for ((name, ..), (m, v)) in group.iter().zip(moments) {
                self.m.insert((*name).clone(), m);
                self.v.insert((*name).clone(), v);
            }
        }
        for (name, var, g, decay) in composed {
            let mut p = var.as_tensor().detach().to_dtype(DType::F32)?;
            if let Some(d) = decay_of(decay) {
                p = (p * d)?;
            }
            let m = match self.m.get(name) {
                Some(m) => ((m * beta1)? + (&g * (1.0 - beta1))?)?,
                None => (&g * (1.0 - beta1))?,
            };
            let g2 = g.sqr()?;
            let v = match self.v.get(name) {
                Some(v) => ((v * beta2)? + (g2 * (1.0 - beta2))?)?,
                None => (g2 * (1.0 - beta2))?,
            };
            let denom = ((v.sqrt()? / bc2_sqrt)? + eps)?;
            let p = (p - ((&m / denom)? * step_size)?)?;
            var.set(&p.to_dtype(var.dtype())?)?;
            self.m.insert(name.clone(), m);
            self.v.insert(name.clone(), v);
        }
        Ok(())
    }

    fn state_dict(&self) -> Result<StateDict> {
        let mut s = StateDict::new();
        s.insert("step".into(), step_tensor(self.step)?);
        for (name, _) in &self.params {
            if let (Some(m), Some(v)) = (self.m.get(name), self.v.get(name)) {
                s.insert(format!("{name}.exp_avg"), m.clone());
                s.insert(format!("{name}.exp_avg_sq"), v.clone());
            }
        }
        Ok(s)
    }

    fn load_state_dict(&mut self, state: &StateDict) -> Result<()> {
        only_entries(state, &["exp_avg", "exp_avg_sq"], "AdamW")?;
        let step = read_step(state)?;
        let mut m = HashMap::new();
        let mut v = HashMap::new();
        for (name, var) in &self.params {
            let key = format!("{name}.exp_avg");
            if state.contains_key(&key) || step > 0 {
                m.insert(name.clone(), state_entry(state, &key, var)?);
                v.insert(
                    name.clone(),
                    state_entry(state, &format!("{name}.exp_avg_sq"), var)?,
                );
            }
        }
        self.step = step;
        self.m = m;
        self.v = v;
        Ok(())
    }

    fn params(&self) -> &[(String, Var)] {
        &self.params
    }
}
