//! [`ExpertLoad`]: what a mixture of experts routed during a step, so that a run shows how
//! evenly its experts are used (tokens per expert, their max over mean) and its load-balancing
//! loss beside the loss. A mixture adds one to the forward's context ([`crate::Cx`]) each
//! training pass; the trainer sums them over micro-batches, replicas and stages.

use serde::{Deserialize, Serialize};

/// One mixture's routing, summed over the passes it covers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExpertLoad {
    /// The layer's name (`model.layers.3`).
    pub layer: String,
    /// Token slots each expert took (a token counts once for each of its top-k experts).
    pub tokens: Vec<f64>,
    /// The load-balancing loss, before its coefficient, summed over the passes (NaN in a step
    /// that diverged: JSON writes it as null, which reads back as NaN).
    #[serde(deserialize_with = "nan_if_null")]
    pub aux: f64,
    /// Passes (micro-batches) summed.
    pub passes: f64,
}

/// An f64 that JSON wrote as null (serde_json writes NaN and infinities so) read as NaN: the
/// loads of a diverged step reach every rank, whose own check then says the loss is NaN.
fn nan_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

impl ExpertLoad {
    /// One pass of layer `layer` whose experts took `tokens` slots, with auxiliary loss `aux`.
    pub fn pass(layer: &str, tokens: &[usize], aux: f64) -> Self {
        Self {
            layer: layer.to_string(),
            tokens: tokens.iter().map(|t| *t as f64).collect(),
            aux,
            passes: 1.0,
        }
    }

    /// The most tokens an expert took over the mean (1: even; 1 also with no tokens).
    pub fn max_over_mean(&self) -> f64 {
        let total: f64 = self.tokens.iter().sum();
        if total <= 0.0 {
            return 1.0;
        }
        let max = self.tokens.iter().copied().fold(0.0, f64::max);
        max * self.tokens.len() as f64 / total
    }

    /// The mean auxiliary loss of a pass (what the objective weighs by its coefficient).
    pub fn mean_aux(&self) -> f64 {
        self.aux / self.passes.max(1.0)
    }

    /// The values as one flat list (`tokens`, `aux`, `passes`), for a sum over ranks.
    pub fn flat(&self) -> Vec<f64> {
        let mut v = self.tokens.clone();
        v.extend([self.aux, self.passes]);
        v
    }

    /// Takes the values back from a list [`ExpertLoad::flat`] made (of the same sizes).
    pub fn set_flat(&mut self, v: &[f64]) {
        let e = self.tokens.len();
        self.tokens.copy_from_slice(&v[..e]);
        (self.aux, self.passes) = (v[e], v[e + 1]);
    }
}

/// Adds `more` into `into` layer by layer (a layer not yet there is added at the end).
pub fn merge(into: &mut Vec<ExpertLoad>, more: Vec<ExpertLoad>) {
    for m in more {
        match into.iter_mut().find(|l| l.layer == m.layer) {
            Some(l) if l.tokens.len() == m.tokens.len() => {
                l.tokens
                    .iter_mut()
                    .zip(&m.tokens)
                    .for_each(|(a, b)| *a += b);
                l.aux += m.aux;
                l.passes += m.passes;
            }
            _ => into.push(m),
        }
    }
}

/// Sorts loads by layer in model order: names compared with their numbers as numbers
/// (`layers.2` before `layers.10`).
pub fn sort_by_layer(loads: &mut [ExpertLoad]) {
    loads.sort_by_key(|l| natural_key(&l.layer));
}

/// `name` cut into text and numbers, numbers compared by value.
fn natural_key(name: &str) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    let mut text = String::new();
    let mut digits = String::new();
    for c in name.chars() {
        if c.is_ascii_digit() {
            digits.push(c);
        } else {
            if !digits.is_empty() {
                out.push((
                    std::mem::take(&mut text),
                    digits.parse().unwrap_or(u64::MAX),
                ));
                digits.clear();
            }
            text.push(c);
        }
    }
    out.push((text, digits.parse().unwrap_or(0)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loads_merge_by_layer_and_sort_in_model_order() {
        let mut all = vec![ExpertLoad::pass("model.layers.10", &[1, 3], 0.5)];
        merge(
            &mut all,
            vec![
                ExpertLoad::pass("model.layers.2", &[2, 2], 1.0),
                ExpertLoad::pass("model.layers.10", &[3, 1], 1.5),
            ],
        );
        sort_by_layer(&mut all);
        assert_eq!(all[0].layer, "model.layers.2");
        assert_eq!(all[1].tokens, vec![4.0, 4.0]);
        assert_eq!(
            (all[1].aux, all[1].passes, all[1].mean_aux()),
            (2.0, 2.0, 1.0)
        );
        assert_eq!(all[0].max_over_mean(), 1.0);
        assert_eq!(ExpertLoad::pass("x", &[3, 1], 0.0).max_over_mean(), 1.5);
        let mut l = all[0].clone();
        l.set_flat(&[1.0, 7.0, 0.25, 3.0]);
        assert_eq!(l.flat(), vec![1.0, 7.0, 0.25, 3.0]);
    }

    #[test]
    fn a_diverged_steps_loads_cross_json() {
        let l = super::ExpertLoad::pass("model.layers.0", &[3, 1], f64::NAN);
        let text = serde_json::to_string(&l).unwrap();
        let back: super::ExpertLoad = serde_json::from_str(&text).unwrap();
        assert!(back.aux.is_nan() && back.tokens == l.tokens);
    }
}
