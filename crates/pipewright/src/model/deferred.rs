//! A split backward for zero-bubble schedules: weight-bearing ops (linear, embedding,
//! convolution) compute their forward with a detached weight and pass their output through a
//! *tap*, an identity op whose backward passes the gradient on and queues (input, output
//! gradient) for the stage. So a backward pass gives input gradients (and the small bias and
//! norm gradients) only; [`WeightGradQueue::weight_grads`] later turns a micro-batch's queue
//! into weight gradients, with the same operations candle's own backward would run, so the
//! numbers are those of an unsplit backward.

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};

use super::WeightLayout;
use crate::grads::Grads;
use crate::{Error, Result};

/// What a queued weight gradient needs.
#[derive(Clone, Debug)]
pub enum Work {
    /// `y = x W^T` (`OutIn`) or `y = x W` (`InOut`), `x` of shape `(rows, in)`.
    Matmul {
        /// The layer's input.
        x: Tensor,
        /// How the weight stores its features.
        layout: WeightLayout,
    },
    /// `y = W[ids]` with `W` of shape `(rows, dim)`.
    Embedding {
        /// The ids looked up.
        ids: Tensor,
        /// Rows of the table.
        rows: usize,
        /// Width of a row.
        dim: usize,
    },
    /// `y = conv2d(x, W)`.
    Conv2d {
        /// The convolution's input.
        x: Tensor,
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
}

/// The tap's second input is the weight itself: that makes the op part of the graph even when
/// nothing upstream needs a gradient (a first layer fed with ids or images), and its backward
/// gives the weight no gradient, so the weight's only gradient is the deferred one.
impl CustomOp2 for Tap {
    fn name(&self) -> &'static str {
        "weight-grad-tap"
    }

    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        l: &Layout,
        _w: &CpuStorage,
        _wl: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        crate::storage::copy(s, l)
    }

    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
        _w: &candle_core::CudaStorage,
        _wl: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::storage::copy(s, l)
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _weight: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let mut q = self.queue.0.lock().unwrap_or_else(|e| e.into_inner());
        q.push(Entry {
            mb: self.mb,
            param: self.param.clone(),
            work: self.work.clone(),
            grad: grad.detach(),
        });
        Ok((Some(grad.clone()), None))
    }
}

impl WeightGradQueue {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }

    /// `y` unchanged; its gradient, when it comes, is queued with `work` for parameter `param`
    /// (`weight`) of micro-batch `mb`.
    pub fn tap(
        &self,
        y: &Tensor,
        weight: &Tensor,
        mb: usize,
        param: &str,
        work: Work,
    ) -> Result<Tensor> {
        Ok(y.contiguous()?.apply_op2(
            weight,
            Tap {
                queue: self.clone(),
                mb,
                param: param.to_string(),
                work,
            },
        )?)
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
                Work::Matmul { x, layout } => {
                    let gw = x.t()?.matmul(&e.grad)?;
                    match layout {
                        WeightLayout::InOut => gw,
                        WeightLayout::OutIn => gw.t()?,
                    }
                }
                // As index_select's backward.
                Work::Embedding { ids, rows, dim } => Tensor::zeros(
                    (*rows, *dim),
                    e.grad.dtype(),
                    e.grad.device(),
                )?
                .index_add(&ids.contiguous()?, &e.grad, 0)?,
                // As candle's conv2d backward for the kernel (dilation 1).
                Work::Conv2d {
                    x,
                    padding,
                    stride,
                    kernel,
                } => {
                    let gk = x
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
