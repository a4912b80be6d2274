//! What context parallelism (a ring of `cp` ranks, each holding `1/cp` of every sequence) and
//! sequence parallelism change in a layer's predicted costs, and attention's working memory.
//!
//! - Time: every layer's work is per token or, for causal attention, balanced over the ring
//!   by the front-and-back chunks, so a rank computes `1/cp` of it; an attention layer adds
//!   the ring's messages, which [`crate::parallel::context_parallel::ring_attention`] sends between its
//!   block products, not beside them: `cp - 1` key/value blocks in the forward, and in the
//!   backward `cp - 1` blocks with their gradients plus one last pass of the gradients home
//!   (f32 blocks: half precision is widened before the ring).
//! - Kept bytes: a rank keeps its own tokens' activations (`1/cp`; the ring keeps no
//!   scores); with sequence parallelism the part tensor parallelism leaves whole is split over
//!   tp too. What crosses a pipeline cut is split the same way.
//! - Working memory: transient bytes while one attention layer computes. At cp 1 the CPU's
//!   fused kernel holds one (batch, head) pair's probabilities and their gradient, `seq x
//!   seq` each ([`FUSED_ATTENTION_TENSORS`]); on a ring, each (query chunk, key chunk) pair's
//!   scores and their derivatives, `(seq / 2cp)^2` per row and head ([`RING_PAIR_TENSORS`]).

use super::hardware::Link;
use super::profile::AttentionShape;

/// `seq x seq` buffers the fused CPU attention kernel holds at once: a pair's probabilities
/// and their gradient in its backward (measured with [`crate::runtime::memory`]: a 2-head GPT at 8192
/// tokens peaked 512 MiB above its activations with 1 and with 2 threads).
pub const FUSED_ATTENTION_TENSORS: f64 = 2.0;

/// `(batch, heads, c, c)` tensors (`c = seq / 2cp`) ring attention's backward holds at once
/// for one chunk pair: the scores, the probabilities, their gradient, its shifted copy and the
/// score gradient (counted in `context_parallel/attention.rs`; the forward holds three).
pub const RING_PAIR_TENSORS: f64 = 5.0;

/// Bytes of the ring's blocks' elements (f32: the ring works in f32 or wider).
const RING_ELEMENT_BYTES: f64 = 4.0;

/// One rank's share of a layer's work or kept bytes on a ring of `cp`.
pub fn share(cp: usize) -> f64 {
    1.0 / cp.max(1) as f64
}

/// Seconds of the ring's messages for one micro-batch of `rows` through attention `a` at tp
/// size `tp` on a ring of `cp` over `link`: `(forward, backward)`.
pub fn ring_seconds(
    a: &AttentionShape,
    rows: usize,
    tp: usize,
    cp: usize,
    link: Link,
) -> (f64, f64) {
    if cp <= 1 {
        return (0.0, 0.0);
    }
    // Keys and values of this rank's tokens and heads.
    let block = 2.0
        * rows as f64
        * (a.seq / cp) as f64
        * (a.kv_heads as f64 / tp as f64).max(1.0)
        * a.head_dim as f64
        * RING_ELEMENT_BYTES;
    let steps = (cp - 1) as f64;
    (
        steps * link.p2p(block),
        steps * link.p2p(2.0 * block) + link.p2p(block),
    )
}

/// Transient bytes while attention `a` computes a micro-batch of `rows` at tp size `tp` on a
/// ring of `cp` (`dtype_bytes` per element of the fused kernel's buffers).
pub fn working_bytes(
    a: &AttentionShape,
    rows: usize,
    tp: usize,
    cp: usize,
    dtype_bytes: usize,
) -> f64 {
    let seq = a.seq as f64;
    if cp <= 1 {
        // The kernel computes in f32 (f64 for f64) whatever the model's width.
        return FUSED_ATTENTION_TENSORS * seq * seq * dtype_bytes.max(4) as f64;
    }
    let c = seq / (2 * cp) as f64;
    let heads = (a.heads as f64 / tp as f64).max(1.0);
    RING_PAIR_TENSORS * rows as f64 * heads * c * c * RING_ELEMENT_BYTES
}
