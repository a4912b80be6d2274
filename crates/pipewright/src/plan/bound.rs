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
    /// The step whose schedule `explained` splits, then `after_s` seconds after the schedule,
    /// `after_comm_s` of them communicating (the gradient sums) and the rest the optimizer's
    /// memory-bound step.
    pub fn of(explained: &Explanation, after_s: f64, after_comm_s: f64) -> Self {
        let x = explained;
        Self {
            compute_s: x.compute_s,
            memory_s: x.memory_s + (after_s - after_comm_s),
            communication_s: x.tp_comm_s + x.ring_comm_s + x.all_to_all_s + after_comm_s,
            bubble_s: x.bubble_s,
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

/// Where a predicted step goes, part by part (`plan --explain`): the busiest pipeline rank's
/// schedule by what its actions do and the bubble, then what follows the schedule on
/// pipeline rank 0, its data-parallel communication whole and as exposed. The parts add up
/// to the step, less what hides.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Explanation {
    /// In the schedule: matrix products at the device's ceiling ...
    pub compute_s: f64,
    /// ... work bound by memory bandwidth ...
    pub memory_s: f64,
    /// ... tensor-parallel collectives (sequence parallelism's included) ...
    pub tp_comm_s: f64,
    /// ... context parallelism's ring ...
    pub ring_comm_s: f64,
    /// ... expert parallelism's all-to-alls ...
    pub all_to_all_s: f64,
    /// ... and ranks waiting for a neighbour (pipeline sends included).
    pub bubble_s: f64,
    /// After the schedule: the data-parallel communication (gradient sums, ZeRO's
    /// reduce-scatters and gathers) costed whole ...
    pub dp_comm_s: f64,
    /// ... and what of it the step waits for (the rest hides behind the backward).
    pub dp_exposed_s: f64,
    /// The step's scalar all-reduces (loss, norm, overflow).
    pub scalars_s: f64,
    /// Norm, clipping and the optimizer.
    pub update_s: f64,
}

impl Explanation {
    /// The step of a schedule replayed in `makespan` seconds with an idle share `bubble`, its
    /// busiest rank's work split as `parts` (compute, memory, tp, ring, all-to-all, in any
    /// unit), then `dp` (communication whole, exposed), `scalars` and `update` seconds.
    pub fn of(
        parts: [f64; 5],
        (makespan, bubble): (f64, f64),
        dp: (f64, f64),
        scalars: f64,
        update: f64,
    ) -> Self {
        let busy = makespan * (1.0 - bubble) / parts.iter().sum::<f64>().max(f64::MIN_POSITIVE);
        Self {
            compute_s: parts[0] * busy,
            memory_s: parts[1] * busy,
            tp_comm_s: parts[2] * busy,
            ring_comm_s: parts[3] * busy,
            all_to_all_s: parts[4] * busy,
            bubble_s: makespan * bubble,
            dp_comm_s: dp.0,
            dp_exposed_s: dp.1,
            scalars_s: scalars,
            update_s: update,
        }
    }
}

impl fmt::Display for Explanation {
    /// One line a part, seconds and share of the parts' total (what hides counted once, in
    /// the backward it hides behind).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let total = self.compute_s
            + self.memory_s
            + self.tp_comm_s
            + self.ring_comm_s
            + self.all_to_all_s
            + self.bubble_s
            + self.dp_exposed_s
            + self.scalars_s
            + self.update_s;
        let line = |f: &mut fmt::Formatter<'_>, what: &str, s: f64| {
            let share = 100.0 * s / total.max(f64::MIN_POSITIVE);
            writeln!(f, "  {what:<52} {:>10.3} ms {share:>5.1} %", s * 1e3)
        };
        writeln!(f, "in the schedule (the busiest pipeline rank):")?;
        line(f, "matrix products at the device's ceiling", self.compute_s)?;
        line(
            f,
            "memory-bound work (thin products, element-wise)",
            self.memory_s,
        )?;
        line(f, "tensor-parallel collectives", self.tp_comm_s)?;
        line(f, "context parallelism's ring", self.ring_comm_s)?;
        line(f, "expert parallelism's all-to-alls", self.all_to_all_s)?;
        line(
            f,
            "bubble (waiting for a neighbour or its sends)",
            self.bubble_s,
        )?;
        writeln!(f, "after the schedule (pipeline rank 0):")?;
        let hidden = self.dp_comm_s - self.dp_exposed_s;
        line(f, "data-parallel communication, exposed", self.dp_exposed_s)?;
        writeln!(
            f,
            "  {:<52} {:>10.3} ms (of {:.3} ms costed whole)",
            "  hidden behind the backward",
            hidden * 1e3,
            self.dp_comm_s * 1e3
        )?;
        line(
            f,
            "scalar all-reduces (loss, norm, overflow)",
            self.scalars_s,
        )?;
        line(f, "norm, clipping and the optimizer", self.update_s)
    }
}
