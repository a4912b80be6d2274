//! How pipeline ranks share processors while a schedule is replayed ([`Sharing`]): several
//! ranks on one CPU slow each other down, and a rank that waits inside its actions leaves the
//! cores to the others.

/// How pipeline ranks share processors in a simulation: `slots` ranks compute at full speed
/// at once (infinity: every rank has its own device); while `b` busy ranks outnumber them,
/// each progresses at `slots / b` times `crowded`, the efficiency the processors keep when
/// they switch between more threads than they have (on this machine: context switches and
/// wake-ups; measured by `pipewright profile --concurrent`, 1 where not measured), and while
/// more than one is busy, times `across` over the share of its time the action computes
/// (never above full speed: [`Sharing::rate`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sharing {
    /// Ranks computing at full speed at once.
    pub slots: f64,
    /// The efficiency of processors crowded by more busy ranks than slots, in (0, 1].
    pub crowded: f64,
    /// The further factor while ranks of several stages are busy at once, divided by each
    /// action's busy share: ranks of different stages run out of step, so what one waits
    /// inside its actions (a tensor-parallel group's collectives) another computes in, and an
    /// action that computes a share `s` of its time needs the cores for only that share. The
    /// ranks of one stage run in step and wait together, so one busy rank (a stage and its
    /// replicas) gains nothing. 1 where ranks compute throughout their actions.
    pub across: f64,
}

impl Sharing {
    /// Every rank on its own processor.
    pub const ALONE: Sharing = Sharing {
        slots: f64::INFINITY,
        crowded: 1.0,
        across: 1.0,
    };

    /// The speed, as a share of full speed, of one of `busy` running actions that computes
    /// `share` of its time (in (0, 1]; 1 where it computes throughout).
    pub fn rate(&self, busy: usize, share: f64) -> f64 {
        let b = busy as f64;
        if b <= self.slots {
            return 1.0;
        }
        let across = if busy > 1 {
            self.across / share.max(f64::MIN_POSITIVE)
        } else {
            1.0
        };
        (self.slots / b * self.crowded * across).min(1.0)
    }

    /// When each rank of a group that starts together ends, rank `r` with `works[r]` seconds
    /// of work at full speed, computing throughout and sharing the processors as
    /// [`Sharing::rate`] says: while `n` are unfinished each progresses at `rate(n, 1)`, so a
    /// rank with little work ends early and leaves its share to the others. Ranks with equal
    /// work end together, at their work over `rate(ranks, 1)`.
    pub fn finish_times(&self, works: &[f64]) -> Vec<f64> {
        let mut order: Vec<usize> = (0..works.len()).collect();
        order.sort_by(|&a, &b| works[a].total_cmp(&works[b]));
        let (mut ends, mut now, mut done) = (vec![0.0; works.len()], 0.0, 0.0);
        for (i, &r) in order.iter().enumerate() {
            let left = works[r] - done;
            if left > 0.0 {
                now += left / self.rate(works.len() - i, 1.0);
                done = works[r];
            }
            ends[r] = now;
        }
        ends
    }
}
