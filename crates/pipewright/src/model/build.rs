//! [`Build`]: what a layer builder gets (the initialiser, the tensor-parallel group, the
//! context-parallel ring, the expert-parallel group and whether sequence parallelism is on).

use crate::distributed::comm::Group;
use crate::model::init::Init;

/// What a layer builder gets: where and how to create parameters ([`Init`], also reachable
/// through `Deref`, so `Linear::new(b, ..)` works with `b: &Build`) and the tensor-parallel
/// group the layer splits over (a group of one unless the layout has tp > 1). Layers of
/// [`crate::model::nn`] need only the initialiser; the parallel layers of [`crate::parallel::tensor_parallel`] take the
/// group too.
#[derive(Clone, Debug)]
pub struct Build {
    /// Where, in what type and from which seed parameters are made.
    pub init: Init,
    /// The tensor-parallel group the layer splits over (a group of one: not split).
    pub tp: Group,
    /// The context-parallel ring the sequences are split over (a group of one: whole
    /// sequences). Attention and position embeddings read it (see
    /// [`crate::parallel::context_parallel`]).
    pub cp: Group,
    /// The expert-parallel group a mixture of experts splits its experts over (a group of
    /// one: every expert here); see [`crate::parallel::expert_parallel`].
    pub ep: Group,
    /// Megatron's sequence parallelism: between tensor-parallel regions activations are split
    /// along the sequence over `tp` (all-gathered before a column-parallel layer,
    /// reduce-scattered after a row-parallel one) instead of whole on every rank.
    pub sequence_parallel: bool,
}

impl Build {
    /// Builds with `init`, unsplit.
    pub fn new(init: Init) -> Self {
        Self {
            init,
            tp: Group::single(),
            cp: Group::single(),
            ep: Group::single(),
            sequence_parallel: false,
        }
    }

    /// f32 on the CPU, unsplit.
    pub fn cpu(seed: u64) -> Self {
        Self::new(Init::cpu(seed))
    }

    /// The same build for one rank of a tensor-parallel group: parallel layers keep this rank's
    /// shard of the values a serial run draws.
    pub fn with_tp(mut self, tp: Group) -> Self {
        self.tp = tp;
        self
    }

    /// The same build for one rank of a context-parallel ring (each rank holds a slice of every
    /// sequence).
    pub fn with_cp(mut self, cp: Group) -> Self {
        self.cp = cp;
        self
    }

    /// The same build for one rank of an expert-parallel group (it holds `1/size` of each
    /// mixture's experts).
    pub fn with_ep(mut self, ep: Group) -> Self {
        self.ep = ep;
        self
    }

    /// Turns sequence parallelism on or off (it changes nothing unless `tp` has more than one
    /// rank).
    pub fn with_sequence_parallel(mut self, on: bool) -> Self {
        self.sequence_parallel = on;
        self
    }

    /// Whether activations between tensor-parallel regions are split along the sequence.
    pub fn splits_sequence(&self) -> bool {
        self.sequence_parallel && self.tp.size() > 1
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
