//! [`Chunks`]: the positions of each sequence a context-parallel rank holds.
//!
//! Load balancing for causal attention: the sequence is cut into `2 * cp` equal chunks, and
//! rank `r` of `cp` holds chunk `r` (early tokens, little to attend to) and chunk
//! `2 cp - 1 - r` (late tokens, much to attend to), joined in that order. With `cp = 2` and
//! 8 tokens: rank 0 holds positions 0, 1, 6, 7 and rank 1 holds 2, 3, 4, 5.

use std::ops::Range;

use candle_core::Tensor;

use crate::distributed::comm::Group;
use crate::{invalid, Result};

/// Rank `rank` of a context-parallel ring of `size` ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunks {
    /// This rank's place in the ring.
    pub rank: usize,
    /// Ranks in the ring (1: the whole sequence on every rank).
    pub size: usize,
}

impl Chunks {
    /// The chunks of `group`'s rank.
    pub fn of(group: &Group) -> Self {
        Self {
            rank: group.rank(),
            size: group.size(),
        }
    }

    /// Whether sequences are split at all.
    pub fn is_split(&self) -> bool {
        self.size > 1
    }

    /// Checks that a sequence of `len` tokens splits into `2 * size` equal chunks; the error
    /// names the lengths that would.
    pub fn check_len(&self, len: usize) -> Result<()> {
        let n = 2 * self.size;
        if self.size > 1 && (len == 0 || !len.is_multiple_of(n)) {
            return Err(invalid!(
                "a sequence of {len} tokens does not split into 2 x cp = {n} equal chunks for \
                 context parallelism over {} ranks: make the sequence length a multiple of {n} \
                 (e.g. {}) or choose a cp that divides half of it",
                self.size,
                len.div_ceil(n).max(1) * n
            ));
        }
        Ok(())
    }

    /// Global chunk indices this rank holds, in the order it holds them (of `2 * size`).
    pub fn indices(&self) -> [usize; 2] {
        [self.rank, 2 * self.size - 1 - self.rank]
    }

    /// Global positions of this rank's two halves when it holds `local` tokens (the whole
    /// sequence `0..local` when not split).
    pub fn positions(&self, local: usize) -> [Range<usize>; 2] {
        if !self.is_split() {
            return [0..local, local..local];
        }
        let c = local / 2;
        self.indices().map(|i| i * c..(i + 1) * c)
    }

    /// This rank's part of `t` (the whole sequence along `dim`).
    pub fn take(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        if !self.is_split() {
            return Ok(t.clone());
        }
        let len = t.dim(dim)?;
        self.check_len(len)?;
        let c = len / (2 * self.size);
        let parts = self
            .indices()
            .map(|i| t.narrow(dim, i * c, c))
            .into_iter()
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Tensor::cat(&parts, dim)?)
    }

    /// The whole sequence along `dim` from every rank's part (`parts[r]` is rank r's, as
    /// [`Chunks::take`] cut it).
    pub fn join(parts: &[Tensor], dim: usize) -> Result<Tensor> {
        let size = parts.len();
        if size <= 1 {
            return parts
                .first()
                .cloned()
                .ok_or_else(|| invalid!("nothing to join"));
        }
        let c = parts[0].dim(dim)? / 2;
        let mut chunks: Vec<Option<Tensor>> = vec![None; 2 * size];
        for (r, p) in parts.iter().enumerate() {
            let at = Self { rank: r, size }.indices();
            chunks[at[0]] = Some(p.narrow(dim, 0, c)?);
            chunks[at[1]] = Some(p.narrow(dim, c, c)?);
        }
        let chunks: Vec<Tensor> = chunks.into_iter().flatten().collect();
        Ok(Tensor::cat(&chunks, dim)?)
    }
}
