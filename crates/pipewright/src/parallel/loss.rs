//! The training objective, given by the user: a [`Loss`] reads the last stage's output and the
//! batch tensors it names, and returns a *sum* and the count it averages over, so that
//! micro-batches and data-parallel replicas add up to exactly the mean of one whole batch.
//!
//! Built in: [`CrossEntropy`] (with ignore index; vocabulary-parallel when the output is marked
//! split over the tensor-parallel group) and [`Mse`] (PyTorch's `MSELoss`, mean over
//! elements). Nothing in the pipeline or the Varuna step names a particular loss.

use std::sync::Arc;

use candle_core::{DType, Tensor};

use crate::distributed::comm::Group;
use crate::model::batch::Batch;
use crate::model::nn::{count_targets, cross_entropy_sum};
use crate::model::{Activation, Cx};
use crate::parallel::tensor_parallel::vocab_parallel_cross_entropy_sum;
use crate::{invalid, Result};

/// A loss over the model output and targets of the batch.
///
/// `sum` and `count` must agree: the mean loss of a batch is `sum / count`, and splitting a
/// batch into micro-batches splits both. A step divides every micro-batch's sum by the count of
/// the whole global batch, which it learns from `count` before the first backward.
pub trait Loss: Send + Sync {
    /// The batch tensors the loss reads (checked on every rank before a step runs).
    fn targets(&self) -> Vec<String>;
    /// How many terms the loss of `batch` averages over (counted tokens, elements, ...).
    fn count(&self, batch: &Batch) -> Result<usize>;
    /// The summed loss of `batch`'s rows given the model output `out` (whose forward context
    /// `cx` says whether it is split over `tp`), and the count it averages over.
    fn sum(&self, out: &Activation, batch: &Batch, cx: &Cx, tp: &Group) -> Result<(Tensor, usize)>;
    /// The model output as [`Loss::sum`] takes it in training: by default in f32
    /// ([`output_in_f32`]), so that a loss computes in f32 whatever the model computes in; a
    /// loss that reads f16 and bf16 outputs in f32 itself takes them as they are (no f32 copy).
    fn input(&self, out: Activation, cx: &mut Cx) -> Result<Activation> {
        output_in_f32(out, cx)
    }
}

/// A loss shared by every rank of a job.
pub type SharedLoss = Arc<dyn Loss>;

/// The batch tensor a built-in loss compares the output with: [`Batch::TARGETS`] by default.
#[derive(Clone, Debug)]
struct TargetName(String);

impl Default for TargetName {
    fn default() -> Self {
        Self(Batch::TARGETS.into())
    }
}

impl TargetName {
    fn name(&self) -> &str {
        &self.0
    }

    /// What [`Loss::targets`] returns.
    fn targets(&self) -> Vec<String> {
        vec![self.0.clone()]
    }
}

/// Cross-entropy over the classes on the output's last dim, targets class ids or
/// [`crate::model::nn::IGNORE_INDEX`] (PyTorch's `F.cross_entropy`). An output marked split on its
/// last dim over the tensor-parallel group (a vocabulary-parallel head) takes Megatron's
/// vocabulary-parallel path, which never forms the whole vocabulary. The default compares with
/// [`Batch::TARGETS`].
#[derive(Clone, Debug, Default)]
pub struct CrossEntropy(TargetName);

impl CrossEntropy {
    /// Cross-entropy against the batch tensor `target`.
    pub fn new(target: impl Into<String>) -> Self {
        Self(TargetName(target.into()))
    }
}

impl Loss for CrossEntropy {
    fn targets(&self) -> Vec<String> {
        self.0.targets()
    }

    fn count(&self, batch: &Batch) -> Result<usize> {
        count_targets(batch.require_host_first(self.0.name(), "the cross-entropy loss")?)
    }

    /// The targets are read on the host (their classes and count; the kernel takes them from
    /// there): from the batch's host copy when it has one, so no read waits for the device.
    fn sum(&self, out: &Activation, batch: &Batch, cx: &Cx, tp: &Group) -> Result<(Tensor, usize)> {
        let y = batch.require_host_first(self.0.name(), "the cross-entropy loss")?;
        let logits = single(out, "cross-entropy")?;
        match cx.parallel_dim(logits) {
            Some(d) if tp.size() > 1 && (d == -1 || d == logits.rank() as i64 - 1) => {
                vocab_parallel_cross_entropy_sum(logits, y, tp)
            }
            Some(d) if tp.size() > 1 => Err(invalid!(
                "the model output is split on dim {d}; cross-entropy needs it whole or split on \
                 its last dim"
            )),
            _ => cross_entropy_sum(logits, y),
        }
    }

    /// The logits as they are: both cross-entropy paths compute in f32 from f16 and bf16
    /// logits (the fused kernel reads them in place, widened, and rounds their gradient once),
    /// value for value what casting them first computed.
    fn input(&self, out: Activation, _cx: &mut Cx) -> Result<Activation> {
        Ok(out)
    }
}

/// Mean squared error over every element (PyTorch's `MSELoss()`): the sum of squared
/// differences, averaged over the target's element count. The default compares with
/// [`Batch::TARGETS`].
#[derive(Clone, Debug, Default)]
pub struct Mse(TargetName);

impl Mse {
    /// Squared error against the batch tensor `target` (same shape as the output).
    pub fn new(target: impl Into<String>) -> Self {
        Self(TargetName(target.into()))
    }
}

impl Loss for Mse {
    fn targets(&self) -> Vec<String> {
        self.0.targets()
    }

    fn count(&self, batch: &Batch) -> Result<usize> {
        Ok(batch.require(self.0.name(), "the MSE loss")?.elem_count())
    }

    fn sum(&self, out: &Activation, batch: &Batch, cx: &Cx, tp: &Group) -> Result<(Tensor, usize)> {
        let y = batch.require(self.0.name(), "the MSE loss")?;
        let pred = single(out, "MSE")?;
        if tp.size() > 1 && cx.parallel_dim(pred).is_some() {
            return Err(invalid!(
                "the MSE loss needs the whole model output; gather it in the last layer"
            ));
        }
        if pred.dims() != y.dims() {
            return Err(invalid!(
                "the MSE loss: output {:?} and target `{}` {:?} differ in shape",
                pred.dims(),
                self.0.name(),
                y.dims()
            ));
        }
        let d = (pred - y.to_dtype(pred.dtype())?)?;
        Ok((d.sqr()?.sum_all()?, y.elem_count()))
    }
}

fn single<'a>(out: &'a Activation, loss: &str) -> Result<&'a Tensor> {
    match out {
        Activation::Tensor(t) => Ok(t),
        Activation::Tuple(ts) => Err(invalid!(
            "the {loss} loss needs one output tensor, the model gave a tuple of {}",
            ts.len()
        )),
    }
}

/// The output in f32 whatever the model computes in, so every loss is computed in f32 (a
/// cast keeps the tensor's split mark in `cx`). Integer tensors stay as they are.
pub fn output_in_f32(out: Activation, cx: &mut Cx) -> Result<Activation> {
    let tuple = out.is_tuple();
    let ts = out
        .into_tensors()
        .into_iter()
        .map(|t| {
            if !t.dtype().is_float() || t.dtype() == DType::F32 {
                return Ok(t);
            }
            let o = t.to_dtype(DType::F32)?;
            cx.set_parallel_dim(&o, cx.parallel_dim(&t));
            Ok(o)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Activation::from_tensors(ts, tuple))
}
