//! [`Build`]: what a layer builder gets (the initialiser and the tensor-parallel group).

use crate::comm::TpGroup;
use crate::init::Init;

/// What a layer builder gets: where and how to create parameters ([`Init`], also reachable
/// through `Deref`, so `Linear::new(b, ..)` works with `b: &Build`) and the tensor-parallel
/// group the layer splits over (a group of one unless the layout has tp > 1). Layers of
/// [`crate::nn`] need only the initialiser; the parallel layers of [`crate::shard`] take the
/// group too.
#[derive(Clone, Debug)]
pub struct Build {
    /// Where, in what type and from which seed parameters are made.
    pub init: Init,
    /// The tensor-parallel group the layer splits over (a group of one: not split).
    pub tp: TpGroup,
}

impl Build {
    /// Builds with `init`, unsplit.
    pub fn new(init: Init) -> Self {
        Self {
            init,
            tp: TpGroup::single(),
        }
    }

    /// f32 on the CPU, unsplit.
    pub fn cpu(seed: u64) -> Self {
        Self::new(Init::cpu(seed))
    }

    /// The same build for one rank of a tensor-parallel group: parallel layers keep this rank's
    /// shard of the values a serial run draws.
    pub fn with_tp(mut self, tp: TpGroup) -> Self {
        self.tp = tp;
        self
    }
}

impl From<Init> for Build {
    fn from(init: Init) -> Self {
        Self::new(init)
    }
}

impl std::ops::Deref for Build {
    type Target = Init;
    fn deref(&self) -> &Init {
        &self.init
    }
}
