//! One action of a schedule: what a rank computes, for which micro-batch, on which model
//! stage; printed and parsed as torch.distributed.pipelining's `_Action` (`1F3`: stage 1's
//! forward of micro-batch 3; `F` forward, `B` whole backward, `I` input gradient, `W` weight
//! gradient).

use std::fmt;

use crate::{invalid, Error, Result};

/// One step of a rank: what it computes, for which micro-batch, on which model stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// The stage's forward of a micro-batch.
    Forward {
        /// Micro-batch index within the replica's batch.
        mb: usize,
        /// Model stage.
        stage: usize,
    },
    /// Input and weight gradients together.
    Backward {
        /// Micro-batch index within the replica's batch.
        mb: usize,
        /// Model stage.
        stage: usize,
    },
    /// Zero-bubble split: the input gradient only (sent upstream at once) ...
    BackwardInput {
        /// Micro-batch index within the replica's batch.
        mb: usize,
        /// Model stage.
        stage: usize,
    },
    /// ... and the weight gradient, later, to fill a bubble.
    BackwardWeight {
        /// Micro-batch index within the replica's batch.
        mb: usize,
        /// Model stage.
        stage: usize,
    },
}

impl Action {
    /// The micro-batch the action computes.
    pub fn mb(&self) -> usize {
        match *self {
            Action::Forward { mb, .. }
            | Action::Backward { mb, .. }
            | Action::BackwardInput { mb, .. }
            | Action::BackwardWeight { mb, .. } => mb,
        }
    }

    /// The model stage the action runs on.
    pub fn stage(&self) -> usize {
        match *self {
            Action::Forward { stage, .. }
            | Action::Backward { stage, .. }
            | Action::BackwardInput { stage, .. }
            | Action::BackwardWeight { stage, .. } => stage,
        }
    }

    /// The letter of what it computes: F, B, I (input gradient), W (weight gradient).
    pub fn letter(&self) -> char {
        match self {
            Action::Forward { .. } => 'F',
            Action::Backward { .. } => 'B',
            Action::BackwardInput { .. } => 'I',
            Action::BackwardWeight { .. } => 'W',
        }
    }

    /// The action of `letter` (F, B, I, W) on `stage` for micro-batch `mb`.
    pub fn new(letter: char, stage: usize, mb: usize) -> Result<Self> {
        Ok(match letter {
            'F' => Action::Forward { mb, stage },
            'B' => Action::Backward { mb, stage },
            'I' => Action::BackwardInput { mb, stage },
            'W' => Action::BackwardWeight { mb, stage },
            _ => {
                return Err(invalid!(
                    "unknown action letter `{letter}`: use F (forward), B (backward), I (input \
                     gradient) or W (weight gradient)"
                ))
            }
        })
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}{}", self.stage(), self.letter(), self.mb())
    }
}

impl std::str::FromStr for Action {
    type Err = Error;

    /// Parses the printed form, `1F3` (stage, letter, micro-batch).
    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim();
        let bad = || {
            invalid!(
                "`{}` is not an action: write stage, letter, micro-batch, as `1F3` or `0W2`",
                crate::runtime::console::excerpt(s)
            )
        };
        let at = s.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
        let (stage, rest) = s.split_at(at);
        let mut chars = rest.chars();
        let letter = chars.next().ok_or_else(bad)?;
        let mb = chars.as_str();
        if stage.is_empty() || mb.is_empty() || !mb.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let number = |t: &str| t.parse::<usize>().map_err(|_| bad());
        Action::new(letter, number(stage)?, number(mb)?)
    }
}
