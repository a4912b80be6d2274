//! [`precomputed`], [`precomputed2`] and [`precomputed3`]: a value computed with collectives (or
//! already in hand), handed to candle as the output of an autograd op whose backward is
//! computed apart (the tensor-parallel mappings of [`crate::parallel::tensor_parallel::ops`],
//! context-parallel ring attention, an auxiliary loss's gradient,
//! [`crate::model::nn::with_aux_loss`]).

use std::sync::Mutex;

use candle_core::{CpuStorage, Shape, Tensor};

use crate::runtime::custom_op::custom_op;

use crate::Result;

/// The gradients of the op's inputs from the inputs, the op's output and its gradient.
type Backward = Box<dyn Fn(&[&Tensor], &Tensor, &Tensor) -> Result<Vec<Tensor>> + Send + Sync>;

/// An op whose forward value was computed (with its collectives) before the op was applied:
/// the op hands that value to candle and keeps the backward.
struct Precomputed {
    name: &'static str,
    value: Mutex<Option<Tensor>>,
    backward: Backward,
}

fn to_candle(e: crate::Error) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

impl Precomputed {
    /// The forward value, taken so that the graph does not keep a second copy of it alive.
    fn take(&self) -> candle_core::Result<Tensor> {
        self.value
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| candle_core::Error::Msg(format!("{}: run twice", self.name)))
    }

    fn cpu(&self) -> candle_core::Result<(CpuStorage, Shape)> {
        crate::runtime::storage::copy_of(&self.take()?, self.name, crate::runtime::storage::cpu)
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::runtime::storage::copy_of(&self.take()?, self.name, crate::runtime::storage::cuda)
    }

    /// The input gradients, detached inputs and output in hand (the backward builds no graph).
    fn grads(
        &self,
        args: &[&Tensor],
        res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Vec<Tensor>> {
        let args: Vec<Tensor> = args.iter().map(|a| a.detach()).collect();
        let args: Vec<&Tensor> = args.iter().collect();
        let g = (self.backward)(&args, &res.detach(), grad).map_err(to_candle)?;
        if g.len() != args.len() {
            candle_core::bail!(
                "{}: {} gradients for {} inputs",
                self.name,
                g.len(),
                args.len()
            );
        }
        Ok(g)
    }
}

custom_op! {
    CustomOp1 for Precomputed, this.name, (_s: _l),
    cpu |this| this.cpu(),
    cuda |this| this.cuda(),
    fn bwd(
        &self,
        arg: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(self.grads(&[arg], res, grad)?.pop())
    }
}

custom_op! {
    CustomOp2 for Precomputed, this.name, (_s1: _l1, _s2: _l2),
    cpu |this| this.cpu(),
    cuda |this| this.cuda(),
    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let mut g = self.grads(&[a, b], res, grad)?.into_iter().map(Some);
        Ok((g.next().flatten(), g.next().flatten()))
    }
}

custom_op! {
    CustomOp3 for Precomputed, this.name, (_s1: _l1, _s2: _l2, _s3: _l3),
    cpu |this| this.cpu(),
    cuda |this| this.cuda(),
    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let mut g = self.grads(&[a, b, c], res, grad)?.into_iter().map(Some);
        Ok((g.next().flatten(), g.next().flatten(), g.next().flatten()))
    }
}

fn op(name: &'static str, value: Tensor, backward: Backward) -> Precomputed {
    Precomputed {
        name,
        value: Mutex::new(Some(value)),
        backward,
    }
}

/// `value` (computed from `x` by the caller, collective included) as the output of an op on
/// `x` whose backward is `backward` of the output's gradient.
pub(crate) fn precomputed(
    x: &Tensor,
    value: Tensor,
    name: &'static str,
    backward: impl Fn(&Tensor) -> Result<Tensor> + Send + Sync + 'static,
) -> Result<Tensor> {
    let backward: Backward = Box::new(move |_, _, grad| Ok(vec![backward(grad)?]));
    Ok(x.apply_op1(op(name, value, backward))?)
}

/// `value` (computed from `a` and `b` by the caller) as the output of an op on the two whose
/// backward is `backward(inputs, output, output's gradient)`, giving both inputs' gradients.
pub(crate) fn precomputed2(
    [a, b]: [&Tensor; 2],
    value: Tensor,
    name: &'static str,
    backward: impl Fn(&[&Tensor], &Tensor, &Tensor) -> Result<Vec<Tensor>> + Send + Sync + 'static,
) -> Result<Tensor> {
    Ok(a.apply_op2(b, op(name, value, Box::new(backward)))?)
}

/// `value` (computed from `a`, `b` and `c` by the caller) as the output of an op on the three
/// whose backward is `backward(inputs, output, output's gradient)`, giving the three inputs'
/// gradients (detached inputs and output: what the backward computes builds no graph).
pub(crate) fn precomputed3(
    [a, b, c]: [&Tensor; 3],
    value: Tensor,
    name: &'static str,
    backward: impl Fn(&[&Tensor], &Tensor, &Tensor) -> Result<Vec<Tensor>> + Send + Sync + 'static,
) -> Result<Tensor> {
    Ok(a.apply_op3(b, c, op(name, value, Box::new(backward)))?)
}
