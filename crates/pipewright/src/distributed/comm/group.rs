//! [`Group`]: the ranks a layer splits its work over, as the layers see them: a
//! tensor-parallel group (its weights split) or a context-parallel ring (its sequences split).

use std::sync::Arc;

use candle_core::Tensor;

use super::{Communicator, ReduceOp};
use crate::Result;

/// The ranks a layer splits its work over (the tensor-parallel group, or the context-parallel
/// ring). `Group::single()` (the default) is a group of one: parallel layers then are the
/// plain layers and run no collective.
#[derive(Clone, Default)]
pub struct Group(Option<Arc<dyn Communicator>>);

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Group(rank {} of {})", self.rank(), self.size())
    }
}

impl Group {
    /// A group of one rank (nothing split).
    pub fn single() -> Self {
        Self(None)
    }

    /// The group of `comm`'s members (a communicator of one member gives a group of one).
    pub fn new(comm: Box<dyn Communicator>) -> Self {
        if comm.size() <= 1 {
            Self(None)
        } else {
            Self(Some(Arc::from(comm)))
        }
    }

    /// This rank's index in the group (0 in a group of one).
    pub fn rank(&self) -> usize {
        self.0.as_ref().map_or(0, |c| c.rank())
    }

    /// The number of ranks in the group (1 when not split).
    pub fn size(&self) -> usize {
        self.0.as_ref().map_or(1, |c| c.size())
    }

    /// The communicator, `None` for a group of one.
    pub fn comm(&self) -> Option<&dyn Communicator> {
        self.0.as_deref()
    }

    /// Every member's `t` in rank order (just `t` in a group of one).
    pub fn all_gather(&self, t: &Tensor) -> Result<Vec<Tensor>> {
        match self.comm() {
            None => Ok(vec![t.clone()]),
            Some(c) => c.all_gather(t),
        }
    }

    /// The sum over the group (`t` in a group of one).
    pub fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        match self.comm() {
            None => Ok(t.clone()),
            Some(c) => c.all_reduce(t, op),
        }
    }
}
