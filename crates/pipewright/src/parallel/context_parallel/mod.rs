//! Context parallelism: the sequences of one replica split over a ring of `cp` ranks, so that
//! activations per rank fall by `cp` at long contexts (Megatron-LM's and torchtitan's context
//! parallelism).
//!
//! - [`chunks`]: which positions a rank holds. A sequence of `T` tokens is cut into `2 * cp`
//!   chunks and rank `r` takes chunk `r` and chunk `2 cp - 1 - r` (one from the front, one from
//!   the back), so that under a causal mask every rank has the same attention work.
//! - [`ring`]: moving a tensor one step around the ring.
//! - [`attention`]: causal attention over the ring as one autograd op: each rank keeps its
//!   queries and passes key and value blocks around, merging each block into an online softmax
//!   and keeping no scores; its backward passes the blocks around again with their gradients.
//!
//! Everything outside attention is per token, so a layer other than attention and the
//! embeddings (which need positions) runs unchanged on its rank's slice. The ranks of a ring
//! hold the same weights: they sum their gradients with the data-parallel ranks
//! ([`crate::distributed::topology::Axis::Replica`]).

pub mod attention;
pub mod chunks;
pub mod ring;

pub use attention::ring_attention;
pub use chunks::Chunks;
