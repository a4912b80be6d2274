//! Activation recomputation (torchgpipe's `checkpoint`): which micro-batches keep their forward
//! graph until the backward, and which keep only their stage input and re-run the forward
//! (with the same dropout masks; layers see [`crate::model::Cx::is_recomputing`]).

/// Activation recomputation (torchgpipe's `checkpoint`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recompute {
    /// Every micro-batch keeps only its stage input; the backward re-runs the forward.
    Always,
    /// Every micro-batch but the last of the batch (whose backward comes first in GPipe).
    ExceptLast,
    /// Keep every activation.
    Never,
}

crate::runtime::words::word_enum!(Recompute, "recompute mode", {
    Always => "always",
    ExceptLast => "except_last" | "except-last",
    Never => "never",
});

impl Recompute {
    /// Whether micro-batch `mb` of `micro_batches` keeps its forward graph for the backward.
    pub fn keeps(self, mb: usize, micro_batches: usize) -> bool {
        match self {
            Recompute::Never => true,
            Recompute::ExceptLast => mb + 1 == micro_batches,
            Recompute::Always => false,
        }
    }
}
