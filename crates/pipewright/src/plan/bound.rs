//! What bounds a predicted step: where the slowest pipeline rank's time goes, and the largest
//! part of it named.

use std::fmt;

use serde::Serialize;

/// Seconds of a predicted step by what they wait on (they add up to the step).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Breakdown {
    /// Matrix products running at the device's ceiling.
    pub compute_s: f64,
    /// Work bound by memory bandwidth: thin products, element-wise passes, the optimizer.
    pub memory_s: f64,
    /// Collectives and sends on the critical path: tensor-parallel all-reduces, the ring's
    /// blocks, the data-parallel gradient sums.
    pub communication_s: f64,
    /// Pipeline ranks idle in the schedule (waiting for a neighbour).
    pub bubble_s: f64,
}

/// The resource a step is bound by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Bound {
    /// Matrix products at the ceiling: faster only with fewer FLOPs or a faster device.
    Compute,
    /// Memory bandwidth: larger products (less tensor parallelism, larger micro-batches) or
    /// fused kernels help.
    Memory,
    /// Communication: smaller tp/cp groups, groups inside a node, or overlap help.
    Communication,
    /// The pipeline's bubble: more micro-batches, interleaving or fewer stages help.
    Bubble,
}

impl fmt::Display for Bound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Bound::Compute => "compute",
            Bound::Memory => "memory",
            Bound::Communication => "comm",
            Bound::Bubble => "bubble",
        })
    }
}

impl Breakdown {
    /// The step of a schedule replayed in `makespan` seconds with an idle share `bubble`, its
    /// busiest rank's work split as `parts` (compute, memory, communication, in any unit),
    /// then `after_s` seconds after the schedule, `after_comm_s` of them communicating (the
    /// gradient sums) and the rest the optimizer's memory-bound step.
    pub fn of(
        parts: [f64; 3],
        makespan: f64,
        bubble: f64,
        after_s: f64,
        after_comm_s: f64,
    ) -> Self {
        let busy = makespan * (1.0 - bubble) / parts.iter().sum::<f64>().max(f64::MIN_POSITIVE);
        Self {
            compute_s: parts[0] * busy,
            memory_s: parts[1] * busy + (after_s - after_comm_s),
            communication_s: parts[2] * busy + after_comm_s,
            bubble_s: makespan * bubble,
        }
    }

    /// The largest part (compute on a tie).
    pub fn bound(&self) -> Bound {
        [
            (Bound::Compute, self.compute_s),
            (Bound::Memory, self.memory_s),
            (Bound::Communication, self.communication_s),
            (Bound::Bubble, self.bubble_s),
        ]
        .into_iter()
        .fold(
            (Bound::Compute, f64::MIN),
            |a, b| if b.1 > a.1 { b } else { a },
        )
        .0
    }
}
