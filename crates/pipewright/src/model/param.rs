//! What a layer says of its parameters beyond their values: how a weight matrix stores its
//! features ([`WeightLayout`]) and how a parameter is split over a tensor-parallel group
//! ([`Shard`]). Both are part of the [`crate::Layer`] contract, so they live here, below the
//! layers of `nn/` and `shard/` that report them.

/// How the weight matrix is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightLayout {
    /// `(out, in)`, as `torch.nn.Linear`.
    OutIn,
    /// `(in, out)`, as GPT-2's `Conv1D` (Hugging Face checkpoints store it so).
    InOut,
}

/// How one parameter is split: the layout-free record behind every sharded parameter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shard {
    /// TorchShard's parallel dim: `-1` (output features split) or `0` (input features split).
    pub parallel_dim: i64,
    /// TorchShard's order type.
    pub order: WeightLayout,
    /// The tensor axis that is split.
    pub axis: usize,
    /// Blocks of the axis split separately (3 for GPT's fused q|k|v), see [`crate::parallel::tensor_parallel::part`].
    pub stride: usize,
    /// This rank's part and the number of parts.
    pub index: usize,
    /// The number of parts.
    pub count: usize,
    /// Shape of the whole parameter.
    pub whole: Vec<usize>,
}

impl Shard {
    /// Shape of this rank's part.
    pub fn shape(&self) -> Vec<usize> {
        let mut s = self.whole.clone();
        s[self.axis] /= self.count;
        s
    }
}
