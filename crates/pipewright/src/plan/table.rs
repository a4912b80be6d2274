//! What `pipewright plan` prints for its ranking, as data with a `Display`: the table of the
//! kept layouts, best first, each with its micro-batches, schedule, recomputation, ZeRO stage,
//! balance, MFU, bound, predicted step, bubble and peak per rank ([`Ranking`]), the refused
//! candidates after it, and the explanation of the first ([`Ranking::explain`]). A program
//! that plans prints the same table as the command line.

use std::fmt;

use super::estimate::{Candidate, Estimate};
use super::ranking::Refused;

/// A planner's ranking as the table `pipewright plan` prints.
pub struct Ranking<'a> {
    /// The kept layouts, best first.
    pub best: &'a [Estimate],
    /// The candidates asked for that cannot run, and why.
    pub refused: &'a [Refused],
}

/// A duration in seconds, in seconds from one up and in milliseconds below.
pub fn format_seconds(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.2} s")
    } else {
        format!("{:.1} ms", s * 1e3)
    }
}

/// FLOP/s in T (tera) from 10^12 up, in G below.
pub fn format_flops(f: f64) -> String {
    if f >= 1e12 {
        format!("{:.0} T", f / 1e12)
    } else {
        format!("{:.0} G", f / 1e9)
    }
}

/// A candidate's layout, `sp` after it with sequence parallelism.
fn layout_text(c: &Candidate) -> String {
    if c.parallel.sequence_parallel {
        format!("{} sp", c.parallel.layout)
    } else {
        c.parallel.layout.to_string()
    }
}

/// Layers per stage, or the number of stages where the list would not fit its column.
fn balance_text(b: &[usize]) -> String {
    let s = b.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
    if s.len() > 12 {
        format!("{} stages", b.len())
    } else {
        s
    }
}

impl Ranking<'_> {
    /// Where the first layout's step goes ([`super::Explanation`]), under a line naming it;
    /// none without a kept layout.
    pub fn explain(&self) -> Option<String> {
        let e = self.best.first()?;
        Some(format!(
            "where the step of {} (rank 1, {}) goes:\n{}",
            layout_text(&e.candidate),
            format_seconds(e.step_s),
            e.explained
        ))
    }
}

impl fmt::Display for Ranking<'_> {
    /// The header, a row per kept layout, then a line per refused candidate (the last line
    /// without a newline).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:<4} {:<23} {:>5} {:>6} {:<12} {:<7} {:>4} {:<12} {:>6} {:<7} {:>11} {:>7} {:>11}",
            "rank",
            "layout",
            "mbs",
            "chunks",
            "schedule",
            "recomp",
            "zero",
            "balance",
            "mfu",
            "bound",
            "step",
            "bubble",
            "peak/rank"
        )?;
        for (i, e) in self.best.iter().enumerate() {
            let c = &e.candidate;
            let schedule = if c.schedule.virtual_stages > 1 {
                c.schedule.to_string()
            } else {
                c.schedule.kind.to_string()
            };
            write!(
                f,
                "\n{:<4} {:<23} {:>5} {:>6} {:<12} {:<7} {:>4} {:<12} {:>6} {:<7} {:>11} {:>6.1}% {:>11}",
                i + 1,
                layout_text(c),
                c.micro_batch,
                c.micro_batches,
                schedule,
                c.schedule.recompute.to_string(),
                c.parallel.zero.to_string(),
                balance_text(&e.balance),
                e.mfu.map_or("-".into(), |m| format!("{:.1}%", m * 100.0)),
                e.bound().to_string(),
                format_seconds(e.step_s),
                e.bubble * 100.0,
                // MiB, not the nearest tenth of a GiB: a prediction to set beside a measurement.
                format!("{:.1} MiB", e.max_peak_bytes() / (1u64 << 20) as f64)
            )?;
        }
        for r in self.refused {
            write!(f, "\nrefused {}: {}", r.what, r.why)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_flops_and_balances_read_in_their_columns() {
        assert_eq!(format_seconds(2.345), "2.35 s");
        assert_eq!(format_seconds(0.0123), "12.3 ms");
        assert_eq!(format_flops(989e12), "989 T");
        assert_eq!(format_flops(183.5e9), "184 G");
        assert_eq!(balance_text(&[3, 3, 2]), "3,3,2");
        assert_eq!(balance_text(&[10; 8]), "8 stages");
    }

    #[test]
    fn an_empty_ranking_is_its_header_and_its_refusals() {
        let refused = [Refused {
            what: "pp=3".into(),
            why: "3 does not divide 4".into(),
        }];
        let r = Ranking {
            best: &[],
            refused: &refused,
        };
        let text = r.to_string();
        assert!(text.starts_with("rank "), "{text}");
        assert!(
            text.ends_with("\nrefused pp=3: 3 does not divide 4"),
            "{text}"
        );
        assert!(r.explain().is_none());
    }
}
