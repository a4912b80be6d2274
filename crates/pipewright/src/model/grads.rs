//! Gradients by parameter name, taken from candle's `GradStore` and filtered to parameters.

use std::collections::BTreeMap;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use crate::Result;

/// Gradients keyed by global parameter name.
#[derive(Clone, Debug, Default)]
pub struct Grads(BTreeMap<String, Tensor>);

impl Grads {
    /// No gradients.
    pub fn new() -> Self {
        Self::default()
    }

    /// Keeps only the gradients of `params` (activations' gradients are dropped).
    /// A parameter that took no part in the loss (an expert no token was routed to) gets a
    /// zero gradient, as one grouped tensor of experts does in torchtitan: every replica then
    /// sums the same set, and the optimizer moves it by its momentum as PyTorch's would. Gradients are detached: a
    /// gradient computed from a parameter would otherwise keep that step's whole graph alive
    /// in whatever accumulates it (optimizer moments), step after step.
    pub fn from_store(store: &GradStore, params: &[(String, Var)]) -> Result<Self> {
        params
            .iter()
            .map(|(n, v)| {
                let g = match store.get(v.as_tensor()) {
                    Some(g) => g.detach(),
                    None => v.as_tensor().zeros_like()?,
                };
                Ok((n.clone(), g))
            })
            .collect::<Result<_>>()
            .map(Self)
    }

    /// The gradient of parameter `name`.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.0.get(name)
    }

    /// Sets the gradient of `name`.
    pub fn insert(&mut self, name: impl Into<String>, g: Tensor) {
        self.0.insert(name.into(), g.detach());
    }

    /// Takes the gradient of `name` out.
    pub fn remove(&mut self, name: &str) -> Option<Tensor> {
        self.0.remove(name)
    }

    /// Every (name, gradient), in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &Tensor)> {
        self.0.iter()
    }

    /// The number of gradients.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Adds `other` into `self` (gradient accumulation over micro-batches), f16 and bf16
    /// gradients in f32, as PyTorch's f32 parameters accumulate theirs under autocast: summed in
    /// the low type, every micro-batch's partial sum was rounded to 8 bits of mantissa.
    /// On a GPU the casts are one launch and the additions another
    /// (`kernels/cast.rs`), not two launches per parameter per micro-batch.
    pub fn accumulate(&mut self, other: Grads) -> Result<()> {
        use crate::kernels::cast::{add_all, cast_all};
        let low = |g: &Tensor| matches!(g.dtype(), DType::F16 | DType::BF16);
        let (mut sums, mut first, mut widen) = (Vec::new(), Vec::new(), Vec::new());
        for (n, g) in other.0 {
            match self.0.remove(&n) {
                Some(acc) => sums.push((n, acc, g)),
                None if low(&g) => widen.push((n, g)),
                None => first.push((n, g)),
            }
        }
        let accs: Vec<&Tensor> = sums.iter().map(|(_, a, _)| a).collect();
        let adds: Vec<&Tensor> = sums.iter().map(|(_, _, g)| g).collect();
        let added = add_all(&accs, &adds)?;
        let lows: Vec<&Tensor> = widen.iter().map(|(_, g)| g).collect();
        let widened = cast_all(&lows, Some(DType::F32), None)?;
        let names = sums
            .into_iter()
            .map(|(n, ..)| n)
            .chain(widen.into_iter().map(|(n, _)| n));
        self.0.extend(names.zip(added.into_iter().chain(widened)));
        self.0.extend(first);
        Ok(())
    }

    /// Multiplies every gradient by `s` (on a GPU, f32 gradients in one launch).
    pub fn scale(&mut self, s: f64) -> Result<()> {
        let ts: Vec<&Tensor> = self.0.values().collect();
        let scaled = crate::kernels::cast::cast_all(&ts, None, Some(s))?;
        for (g, t) in self.0.values_mut().zip(scaled) {
            *g = t;
        }
        Ok(())
    }

    /// Sum of squares of every gradient (f64).
    pub fn sum_sq(&self) -> Result<f64> {
        Ok(sums_sq(&self.0.values().collect::<Vec<_>>())?.iter().sum())
    }

    /// The global L2 norm.
    pub fn norm(&self) -> Result<f64> {
        Ok(self.sum_sq()?.sqrt())
    }
}

/// Whether every element of `t` is finite ([`finite_each`] of one tensor).
pub fn all_finite(t: &Tensor) -> Result<bool> {
    Ok(finite_each(&[t])?[0])
}

/// Whether every element of each of `ts` is finite: where the one-pass sum of squares takes a
/// tensor (in f64, which no square of an f32, f16 or bf16 value overflows), whether that sum
/// is, the GPU's tensors read back at once; elsewhere `0 * x`, which is 0 for a finite value
/// and NaN for the others, summed.
pub fn finite_each(ts: &[&Tensor]) -> Result<Vec<bool>> {
    let sums = crate::kernels::reduce::sum_sq_each(ts)?;
    ts.iter()
        .zip(sums)
        .map(
            |(t, s)| match s.filter(|_| t.dtype() != candle_core::DType::F64) {
                Some(s) => Ok(s.is_finite()),
                None => Ok((*t * 0.0)?
                    .to_dtype(candle_core::DType::F32)?
                    .sum_all()?
                    .to_scalar::<f32>()?
                    == 0.0),
            },
        )
        .collect()
}

/// Largest absolute difference between `a` and `b` over the largest magnitude in `b`: the
/// relative error the parity tests hold to 1e-5.
pub fn max_rel_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    let a = a.to_dtype(candle_core::DType::F64)?;
    let b = b.to_dtype(candle_core::DType::F64)?;
    let d = (&a - &b)?.abs()?.max_all()?.to_scalar::<f64>()?;
    let m = b.abs()?.max_all()?.to_scalar::<f64>()?;
    Ok(d / m.max(1e-30))
}

/// This rank's share of the squared gradient norm of a model split over a tensor-parallel
/// group, so that the sum over the group is the norm of the whole model: sharded parameters
/// count on every rank (each holds its part), whole ones on rank 0 only, and the second member
/// of each tied pair nowhere (a tied pair is one parameter in PyTorch).
pub fn sum_sq_share(
    grads: &Grads,
    tied: &[(String, String)],
    sharded: &[String],
    tp_rank: usize,
) -> Result<f64> {
    let counted: Vec<&Tensor> = grads
        .iter()
        .filter(|(name, _)| {
            let second = tied.iter().any(|(_, b)| b == *name);
            !(second || (tp_rank != 0 && !sharded.contains(*name)))
        })
        .map(|(_, g)| g)
        .collect();
    Ok(sums_sq(&counted)?.iter().sum())
}

/// The sum of squares of each of `ts`, in f64: one pass each where a kernel takes the tensor
/// (the GPU's read back at once), else composed.
fn sums_sq(ts: &[&Tensor]) -> Result<Vec<f64>> {
    let fast = crate::kernels::reduce::sum_sq_each(ts)?;
    fast.into_iter()
        .zip(ts)
        .map(|(s, t)| match s {
            Some(s) => Ok(s),
            None => Ok(t
                .to_dtype(candle_core::DType::F64)?
                .sqr()?
                .sum_all()?
                .to_scalar::<f64>()?),
        })
        .collect()
}
