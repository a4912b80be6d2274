//! What crosses a cut point, and under which tag: activations (one tensor, or a tuple of
//! tensors of any dtypes, as torchgpipe's `Tuple[Tensor]`) going forward, their gradients going
//! back, and skip connections.
//!
//! Every message of one step has its own tag, so sends can be non-blocking and complete in any
//! order. A forward activation is a header (arity, tuple or not) and then one message per
//! tensor; its gradient is one message per floating-point tensor (integer tensors, such as a
//! mask, carry no gradient), and the receiving side knows which those are from its own output.

use candle_core::{Device, Tensor, Var};

use crate::distributed::comm::{Communicator, Pending, MAX_TAG};
use crate::model::Activation;
use crate::{invalid, Result};

/// Tags per activation message: a header and at most `SLOTS - 1` tensors.
const SLOTS: u64 = 16;

/// The tag layout of one pipeline: forward and backward messages of every (micro-batch, model
/// stage), then those of every skip route. Tags at the top of the range are left to tied
/// weights (see [`super::tied`]).
#[derive(Clone, Copy, Debug)]
pub struct Tags {
    stages: usize,
    micro_batches: usize,
    routes: usize,
}

impl Tags {
    /// The layout for `stages` model stages, `micro_batches` per step and `routes` skip routes
    /// whose ends sit on different stages; an error if a communicator has too few tags.
    pub fn new(
        stages: usize,
        micro_batches: usize,
        routes: usize,
        reserved: usize,
    ) -> Result<Self> {
        let t = Self {
            stages,
            micro_batches,
            routes,
        };
        let needed = (2 * micro_batches * (stages + routes)) as u64 * SLOTS;
        if needed + reserved as u64 >= MAX_TAG {
            return Err(invalid!(
                "{micro_batches} micro-batches over {stages} model stages need more message tags \
                 than a communicator has: use fewer micro-batches (chunks) or stages"
            ));
        }
        Ok(t)
    }

    /// The message of model stage `k`'s output (forward) or its gradient (backward).
    pub fn activation(&self, mb: usize, k: usize, backward: bool) -> u64 {
        ((mb * self.stages + k) * 2 + usize::from(backward)) as u64
    }

    /// The message of skip route `i`.
    pub fn skip(&self, mb: usize, i: usize, backward: bool) -> u64 {
        let base = 2 * self.stages * self.micro_batches;
        (base + (mb * self.routes + i) * 2 + usize::from(backward)) as u64
    }

    /// The communicator tag of a message that is one tensor (a skip connection).
    pub fn tensor(msg: u64) -> u64 {
        msg * SLOTS
    }
}

/// Sends `act` to `dst` as message `msg` (non-blocking; wait on every returned handle).
pub fn send_activation(
    comm: &dyn Communicator,
    act: &Activation,
    dst: usize,
    msg: u64,
) -> Result<Vec<Pending<()>>> {
    let ts = act.tensors();
    if ts.len() as u64 >= SLOTS {
        return Err(invalid!(
            "a tuple of {} tensors crosses a cut point; at most {} can",
            ts.len(),
            SLOTS - 1
        ));
    }
    let header = Tensor::new(&[ts.len() as u32, u32::from(act.is_tuple())], &Device::Cpu)?;
    let mut out = vec![comm.isend(&header, dst, msg * SLOTS)?];
    for (e, t) in ts.into_iter().enumerate() {
        out.push(comm.isend(t, dst, msg * SLOTS + 1 + e as u64)?);
    }
    Ok(out)
}

/// Receives message `msg` from `src` (sent by [`send_activation`]) onto `device`.
pub fn recv_activation(
    recv: &dyn Fn(usize, u64) -> Result<Tensor>,
    src: usize,
    msg: u64,
    device: &Device,
) -> Result<Activation> {
    let h = recv(src, msg * SLOTS)?.to_vec1::<u32>()?;
    let ts = (0..h[0] as u64)
        .map(|e| Ok(recv(src, msg * SLOTS + 1 + e)?.to_device(device)?))
        .collect::<Result<Vec<_>>>()?;
    Ok(Activation::from_tensors(ts, h[1] == 1))
}

/// A received activation made differentiable: each floating-point tensor becomes a variable
/// whose gradient goes back to the sender; integer tensors stay as they are.
pub struct Received {
    /// The activation the stage computes with.
    pub activation: Activation,
    /// Its floating-point tensors as variables (`None` for integer ones).
    pub vars: Vec<Option<Var>>,
}

impl Received {
    /// Wraps `act`'s floating-point tensors as variables.
    pub fn new(act: Activation) -> Result<Self> {
        let tuple = act.is_tuple();
        let mut vars = Vec::new();
        let mut ts = Vec::new();
        for t in act.into_tensors() {
            if t.dtype().is_float() {
                let v = Var::from_tensor(&t)?;
                ts.push(v.as_tensor().clone());
                vars.push(Some(v));
            } else {
                ts.push(t);
                vars.push(None);
            }
        }
        Ok(Self {
            activation: Activation::from_tensors(ts, tuple),
            vars,
        })
    }
}

/// Sends the gradient of every floating-point tensor of a received activation back to `dst`
/// (zeros where the backward left none).
pub fn send_gradients(
    comm: &dyn Communicator,
    vars: &[Option<Var>],
    store: &candle_core::backprop::GradStore,
    dst: usize,
    msg: u64,
) -> Result<Vec<Pending<()>>> {
    let mut out = Vec::new();
    for (e, v) in vars.iter().enumerate() {
        if let Some(v) = v {
            let g = match store.get(v.as_tensor()) {
                Some(g) => g.clone(),
                None => v.as_tensor().zeros_like()?,
            };
            out.push(comm.isend(&g, dst, msg * SLOTS + 1 + e as u64)?);
        }
    }
    Ok(out)
}

/// The objective whose backward carries the gradients of `msg` (sent by [`send_gradients`])
/// into the graph behind `out`: the sum of (tensor x its gradient) over its floating-point
/// tensors.
pub fn inject_gradients(
    recv: &dyn Fn(usize, u64) -> Result<Tensor>,
    out: &Activation,
    src: usize,
    msg: u64,
) -> Result<Option<Tensor>> {
    let mut objective: Option<Tensor> = None;
    for (e, t) in out.tensors().into_iter().enumerate() {
        if !t.dtype().is_float() {
            continue;
        }
        let g = recv(src, msg * SLOTS + 1 + e as u64)?.to_device(t.device())?;
        let term = (t * g.detach())?.sum_all()?;
        objective = Some(match objective {
            Some(o) => (o + term)?,
            None => term,
        });
    }
    Ok(objective)
}
