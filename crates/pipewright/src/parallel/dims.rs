//! [`ParallelSpec`]: how a run's ranks split the model and the data, the one place a layout's
//! axes, its ZeRO stage and sequence parallelism are held together (torchtitan's
//! `ParallelDims`). The layout's degrees are validated when the [`Layout`] is made; this adds
//! what depends on them together. [`BatchSpec`]: the rows a step and a micro-batch take, which
//! a layout splits ([`BatchSpec::micro_batches`]).

use serde::{Deserialize, Serialize};

use crate::distributed::topology::Layout;
use crate::parallel::zero::Zero;
use crate::Result;

/// The parallel section of a run: the pp x tp x cp x dp x ep layout, what the data-parallel
/// replicas shard and whether the tensor-parallel ranks split the sequence too. Serialized
/// flat into its run's spec (`"layout"`, `"zero"`, `"sequence_parallel"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParallelSpec {
    /// Pipeline stages, tensor-parallel shards, context-parallel ranks, data-parallel
    /// replicas and expert-parallel groups.
    pub layout: Layout,
    /// What the data-parallel replicas shard (ZeRO); runs recorded before it had none.
    #[serde(default)]
    pub zero: Zero,
    /// Megatron's sequence parallelism over the tensor-parallel ranks (see
    /// [`crate::parallel::tensor_parallel`]); runs recorded before it had none.
    #[serde(default)]
    pub sequence_parallel: bool,
}

impl ParallelSpec {
    /// `layout` with nothing sharded and no sequence parallelism.
    pub fn new(layout: Layout) -> Self {
        Self {
            layout,
            zero: Zero::Off,
            sequence_parallel: false,
        }
    }

    /// Ranks the layout needs.
    pub fn world(&self) -> usize {
        self.layout.world()
    }

    /// Whether sequence parallelism takes effect: asked for, over more than one
    /// tensor-parallel rank.
    pub fn splits_sequence(&self) -> bool {
        self.sequence_parallel && self.layout.tp > 1
    }
}

/// The batch section of a run: the rows of every step over all replicas and the rows of one
/// micro-batch (Varuna's `chunk_size`). Serialized flat into its run's spec
/// (`"global_batch"`, `"micro_batch"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchSpec {
    /// Rows of every step over all replicas.
    pub global_batch: usize,
    /// Rows of one micro-batch.
    pub micro_batch: usize,
}

impl BatchSpec {
    /// Micro-batches each data-parallel replica of `layout` splits the batch into
    /// ([`Layout::micro_batches`]: an error that says what to choose when it does not split).
    pub fn micro_batches(&self, layout: &Layout) -> Result<usize> {
        layout.micro_batches(self.global_batch, self.micro_batch)
    }
}
