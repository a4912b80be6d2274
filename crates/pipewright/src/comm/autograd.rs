//! [`precomputed`]: a value computed with a collective, handed to candle as the output of an
//! autograd op whose backward is another collective (the tensor-parallel mappings of
//! [`crate::shard::ops`] and the context-parallel ring shift).

use std::sync::Mutex;

use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};

use crate::Result;

type Backward = Box<dyn Fn(&Tensor) -> Result<Tensor> + Send + Sync>;

/// An op whose forward value was computed (with its collective) before the op was applied: the
/// op hands that value to candle and keeps the backward (a collective too).
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
}

impl CustomOp1 for Precomputed {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(&self, _s: &CpuStorage, _l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        crate::storage::copy_of(&self.take()?, self.name, crate::storage::cpu)
    }

    fn cuda_fwd(
        &self,
        _s: &candle_core::CudaStorage,
        _l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::storage::copy_of(&self.take()?, self.name, crate::storage::cuda)
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        Ok(Some((self.backward)(grad).map_err(to_candle)?))
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
    let op = Precomputed {
        name,
        value: Mutex::new(Some(value)),
        backward: Box::new(backward),
    };
    Ok(x.apply_op1(op)?)
}
