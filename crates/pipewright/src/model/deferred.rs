//! A split backward for zero-bubble schedules: weight-bearing ops (linear, embedding,
//! convolution) compute their forward with no graph (a detached input and weight) and pass their
//! output through a *tap* whose backward gives the input its gradient, as candle's own backward
//! of the op would, and queues (input, output gradient) for the stage. So a backward pass gives
//! input gradients (and the small bias and norm gradients) only: candle's matmul and
//! convolution backwards compute the weight's gradient whenever they run, even for a detached
//! weight, which cost the input pass a weight gradient it threw away (a GPT block's input pass
//! took 1.25 times its whole backward) and three weight-sized buffers. [`WeightGradQueue::weight_grads`]
//! later turns a micro-batch's queue into weight gradients, with the same operations candle's
//! own backward would run, so the numbers are those of an unsplit backward.

use std::sync::{Arc, Mutex};

use candle_core::Tensor;

use super::WeightLayout;
use crate::model::grads::Grads;
use crate::runtime::custom_op::custom_op;
use crate::{Error, Result};

/// The weight-bearing op a tap stands after (its input, which the weight gradient needs too, is
/// the tap's own).
#[derive(Clone, Debug)]
pub enum Work {
    /// `y = a W^T` (`OutIn`) or `y = a W` (`InOut`), `x` of shape `(rows, in)` and `a` the
    /// input itself or (`gelu`) its GELU, which is computed again for the weight gradient
    /// rather than kept.
    Matmul {
        /// How the weight stores its features.
        layout: WeightLayout,
        /// The product takes GELU of the input (the fused linear's `gelu` input).
        gelu: bool,
    },
    /// `y = W[ids]` with `W` of shape `(rows, dim)`, the ids flat.
    Embedding {
        /// Rows of the table.
        rows: usize,
        /// Width of a row.
        dim: usize,
    },
    /// `y = conv2d(x, W)`.
    Conv2d {
        /// Zero padding on each side.
        padding: usize,
        /// The stride.
        stride: usize,
        /// The kernel's height and width.
        kernel: (usize, usize),
    },
}

#[derive(Debug)]
struct Entry {
    mb: usize,
    param: String,
    work: Work,
    /// The op's input (`x`, or the ids).
    input: Tensor,
    grad: Tensor,
}

/// A stage's queue of deferred weight gradients.
#[derive(Clone, Default)]
pub struct WeightGradQueue(Arc<Mutex<Vec<Entry>>>);

impl std::fmt::Debug for WeightGradQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WeightGradQueue({} pending)", self.pending())
    }
}

struct Tap {
    queue: WeightGradQueue,
    mb: usize,
    param: String,
    work: Work,
    /// The weight, when the tap's third input is the layer's bias (which the tap then gives
    /// its gradient, the column sums of the output's); else the third input is the weight.
    weight: Option<Tensor>,
}

impl Work {
    /// The gradient of the op's input for the output gradient `grad`, as candle's backward of
    /// the op computes it (`None` for an embedding's ids); `weight` is the layer's weight and
    /// `input` the op's input.
    fn input_grad(
        &self,
        input: &Tensor,
        weight: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(match self {
            // As candle's matmul backward: lhs_grad = grad rhs^T, rhs the weight as multiplied
            // (then through GELU's slope at the input, as the fused linear's backward).
            Work::Matmul { layout, gelu } => {
                let rhs = match layout {
                    WeightLayout::OutIn => weight.t()?,
                    WeightLayout::InOut => weight.clone(),
                };
                let g = grad.matmul(&rhs.t()?)?;
                Some(match gelu {
                    true => crate::kernels::gelu::input_grad(input, &g)?,
                    false => g,
                })
            }
            Work::Embedding { .. } => None,
            // As candle's conv2d backward for its input (dilation 1).
            Work::Conv2d {
                padding, stride, ..
            } => {
                let k_h = weight.dim(2)?;
                let out_size = (grad.dim(2)? - 1) * stride + k_h - 2 * padding;
                let out_padding = input.dim(2)? - out_size;
                Some(grad.conv_transpose2d(weight, *padding, out_padding, *stride, 1)?)
            }
        })
    }
}

// The tap's inputs: the op's output computed with no graph, the op's input (its gradient
// comes from the tap) and the weight itself. The weight makes the op part of the graph even
// when nothing upstream needs a gradient (a first layer fed with ids or images); the tap's
// backward gives it no gradient, so the weight's only gradient is the deferred one.
custom_op! {
    CustomOp3 for Tap, "weight-grad-tap", (s: l, _x: _xl, _w: _wl),
    cpu |_| crate::runtime::storage::copy(s, l),
    cuda |_| crate::runtime::storage::copy(s, l),
    fn bwd(
        &self,
        _out: &Tensor,
        input: &Tensor,
        third: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let weight = self.weight.as_ref().unwrap_or(third);
        // Nothing upstream needs it when the input is no part of a graph (ids, images).
        let input_grad = match input.track_op() {
            true => self.work.input_grad(input, weight, grad)?,
            false => None,
        };
        let bias_grad = match self.weight {
            Some(_) => Some(crate::kernels::bias::column_sum(grad)?.reshape(third.shape())?),
            None => None,
        };
        let mut q = self.queue.0.lock().unwrap_or_else(|e| e.into_inner());
        q.push(Entry {
            mb: self.mb,
            param: self.param.clone(),
            work: self.work.clone(),
            input: input.detach(),
            grad: grad.detach(),
        });
        Ok((None, input_grad, bias_grad))
    }
}

impl WeightGradQueue {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }

    /// `y`, the output of `work`'s op on `input` computed from a detached input and weight (no
    /// graph), as a tensor whose gradient, when it comes, gives `input` its gradient and is
    /// queued with `work` for parameter `param` (`weight`) of micro-batch `mb`; with `bias`,
    /// `y` has the bias added too (a matrix product's `(rows, out)` output), and the bias gets
    /// its gradient at once. `y` must be a new tensor nothing else reads: its memory is given
    /// back (the result is its copy; the graph keeps `y` as the tap's input but never reads
    /// it), so an activation is kept once.
    #[allow(clippy::too_many_arguments)]
    pub fn tap(
        &self,
        y: Tensor,
        input: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
        mb: usize,
        param: &str,
        work: Work,
    ) -> Result<Tensor> {
        let y = y.contiguous()?;
        let tap = Tap {
            queue: self.clone(),
            mb,
            param: param.to_string(),
            work,
            weight: bias.map(|_| weight.detach()),
        };
        let out = y.apply_op3(input, bias.unwrap_or(weight), tap)?;
        crate::runtime::storage::release(&y)?;
        Ok(out)
    }

    /// Entries waiting for their weight gradient.
    pub fn pending(&self) -> usize {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Bytes of the output gradients waiting in the queue (what a split backward holds beyond
    /// the forward's activations until the weight gradients run).
    pub fn pending_bytes(&self) -> usize {
        let q = self.0.lock().unwrap_or_else(|e| e.into_inner());
        q.iter()
            .map(|e| e.grad.elem_count() * e.grad.dtype().size_in_bytes())
            .sum()
    }

    /// The weight gradients of micro-batch `mb`, computed now (and removed from the queue).
    pub fn weight_grads(&self, mb: usize) -> Result<Grads> {
        let mine: Vec<Entry> = {
            let mut q = self.0.lock().unwrap_or_else(|e| e.into_inner());
            let (mine, rest) = q.drain(..).partition(|e| e.mb == mb);
            *q = rest;
            mine
        };
        let mut grads = Grads::new();
        for e in mine {
            let g = match &e.work {
                // As candle's matmul backward: rhs_grad = lhs^T grad (then the transpose's).
                Work::Matmul { layout, gelu } => {
                    let lhs = match gelu {
                        true => crate::kernels::gelu::gelu(&e.input)?,
                        false => e.input.clone(),
                    };
                    let gw = lhs.t()?.matmul(&e.grad)?;
                    match layout {
                        WeightLayout::InOut => gw,
                        WeightLayout::OutIn => gw.t()?,
                    }
                }
                // As index_select's backward.
                Work::Embedding { rows, dim } => Tensor::zeros(
                    (*rows, *dim),
                    e.grad.dtype(),
                    e.grad.device(),
                )?
                .index_add(&e.input.contiguous()?, &e.grad, 0)?,
                // As candle's conv2d backward for the kernel (dilation 1).
                Work::Conv2d {
                    padding,
                    stride,
                    kernel,
                } => {
                    let gk = e
                        .input
                        .transpose(0, 1)?
                        .conv2d(&e.grad.transpose(0, 1)?, *padding, 1, *stride, 1)?
                        .transpose(0, 1)?;
                    let (_, _, g0, g1) = gk.dims4()?;
                    if g0 != kernel.0 || g1 != kernel.1 {
                        gk.narrow(2, 0, kernel.0)?.narrow(3, 0, kernel.1)?
                    } else {
                        gk
                    }
                }
            };
            let mut one = Grads::new();
            one.insert(e.param, g);
            grads.accumulate(one)?;
        }
        Ok(grads)
    }
}

/// Error for a weight-gradient queue left with work at the end of a step.
pub fn leftover(n: usize) -> Error {
    Error::Invalid(format!(
        "{n} weight gradients were queued but never computed: the schedule lacks W actions"
    ))
}
