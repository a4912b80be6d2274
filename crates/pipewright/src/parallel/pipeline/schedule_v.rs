//! The V-shaped schedules: every rank holds two model stages, rank r the stage r on the way
//! down and the stage 2p - 1 - r on the way back ([`v_stages`]), so rank 0 holds the first
//! stage and the last (the embedding and a tied head together) and the turn at rank p - 1
//! crosses no link. A micro-batch's activations are half a 1F1B stage's, and every rank holds
//! about as many of them as 1F1B's first: the memory is even over the ranks.
//!
//! - [`zero_bubble_v`]: ZB-V (Qi et al. 2023, section 6): forwards, input gradients (I) and
//!   weight gradients (W) in the order that leaves no bubble when the three take equal time.
//! - [`dual_pipe_v`]: DeepSeek-V3's DualPipe folded onto p ranks (PyTorch's
//!   `ScheduleDualPipeV`): in its steady state each forward of one stage is paired with a
//!   whole backward of the other, which a GPU overlaps (one hides the other's communication);
//!   here the pair is the two actions one after the other, forward first, an ordering. Its
//!   last micro-batches split their backward to fill the drain.
//!
//! Both are written as phases over counters: each `f`, `i`, `b` or `w` call appends the next
//! micro-batch of that kind on chunk 0 (the down stage) or chunk 1 (the up stage).

use std::collections::VecDeque;

use super::action::Action;

/// The two model stages rank `r` of `p` holds in a V: `[r, 2p - 1 - r]`.
pub fn v_stages(p: usize, r: usize) -> [usize; 2] {
    [r, 2 * p - 1 - r]
}

/// One rank's list as it is written, with a counter per chunk and kind of action.
struct Lists {
    stages: [usize; 2],
    /// Per chunk: the next forward's, input pass's (whole backward or I) and weight pass's
    /// micro-batch.
    next: [[usize; 3]; 2],
    /// Input passes whose weight pass is still to come, oldest first (DualPipeV).
    pending: VecDeque<(usize, usize)>,
    out: Vec<Action>,
}

impl Lists {
    fn new(p: usize, r: usize) -> Self {
        Self {
            stages: v_stages(p, r),
            next: [[0; 3]; 2],
            pending: VecDeque::new(),
            out: Vec::new(),
        }
    }

    /// Appends the next action of `letter` on chunk `c`: counter 0 for F, 1 for B and I
    /// (a micro-batch's backward is one or the other), 2 for W.
    fn push(&mut self, c: usize, letter: char) {
        let slot = match letter {
            'F' => 0,
            'B' | 'I' => 1,
            _ => 2,
        };
        let (mb, stage) = (self.next[c][slot], self.stages[c]);
        self.next[c][slot] += 1;
        if letter == 'I' {
            self.pending.push_back((stage, mb));
        }
        self.out.push(match letter {
            'F' => Action::Forward { mb, stage },
            'B' => Action::Backward { mb, stage },
            'I' => Action::BackwardInput { mb, stage },
            _ => Action::BackwardWeight { mb, stage },
        });
    }

    fn f(&mut self, c: usize) {
        self.push(c, 'F');
    }

    fn b(&mut self, c: usize) {
        self.push(c, 'B');
    }

    fn i(&mut self, c: usize) {
        self.push(c, 'I');
    }

    /// The weight pass of chunk `c`'s next micro-batch (ZB-V keeps them in order per chunk).
    fn w(&mut self, c: usize) {
        self.push(c, 'W');
    }

    /// The weight pass of the oldest input pass still waiting for one, if any (DualPipeV).
    fn w_oldest(&mut self) {
        if let Some((stage, mb)) = self.pending.pop_front() {
            self.out.push(Action::BackwardWeight { mb, stage });
        }
    }

    fn forwards(&self, c: usize) -> usize {
        self.next[c][0]
    }

    fn inputs(&self, c: usize) -> usize {
        self.next[c][1]
    }

    fn weights(&self, c: usize) -> usize {
        self.next[c][2]
    }
}

/// ZB-V's list for rank `r` of `p` with `m` micro-batches. The pattern is written for at least
/// 2p - 1 micro-batches (the ones that fill the V); with fewer, the actions of the micro-batches
/// that do not exist are left out, as PyTorch's `ScheduleZBVZeroBubble` does.
pub fn zero_bubble_v(p: usize, m: usize, r: usize) -> Vec<Action> {
    let n = m.max(2 * p - 1);
    let mut l = Lists::new(p, r);
    // Warm-up: the down stage runs ahead, then the up stage starts, then its first backwards.
    for _ in 0..2 * (p - r) - 1 {
        l.f(0);
    }
    for _ in 0..r {
        l.f(1);
        l.f(0);
    }
    for _ in 0..p - r {
        l.f(1);
        l.i(1);
        l.w(1);
    }
    // Steady state: a forward, input and weight pass on each chunk in turn.
    while l.forwards(1) < l.forwards(0) || l.forwards(0) < n {
        if l.forwards(0) < n {
            l.f(0);
        }
        l.i(0);
        l.w(0);
        l.f(1);
        l.i(1);
        l.w(1);
    }
    // Cool-down: input passes first (they go upstream), the weight passes fill the drain.
    for _ in 0..r {
        l.i(0);
        l.i(1);
    }
    for _ in 0..p - r {
        l.i(0);
        l.w(0);
    }
    while l.weights(1) < l.inputs(1) {
        l.w(1);
    }
    while l.weights(0) < l.inputs(0) {
        l.w(0);
    }
    l.out.retain(|a| a.mb() < m);
    l.out
}

/// DualPipeV's list for rank `r` of `p` with `m` >= 2p micro-batches (checked by
/// `Schedule::new`).
pub fn dual_pipe_v(p: usize, m: usize, r: usize) -> Vec<Action> {
    let mut l = Lists::new(p, r);
    // Warm-up: forwards down the V, then both chunks, then the up stage's first backwards with
    // their weight passes filling the wait.
    for _ in 0..2 * (p - r - 1) {
        l.f(0);
    }
    for _ in 0..=r {
        l.f(0);
        l.f(1);
    }
    for _ in 0..p - r - 1 {
        l.i(1);
        l.w_oldest();
        l.f(1);
    }
    // Steady state: each forward paired with the other chunk's whole backward.
    for _ in 0..m + r + 1 - 2 * p {
        l.f(0);
        l.b(1);
        l.f(1);
        l.b(0);
    }
    for _ in 0..p - r - 1 {
        l.b(1);
        l.f(1);
        l.b(0);
    }
    // Drain: the last backwards split from halfway (odd ranks one action earlier), their
    // weight passes filling the wait for the gradients still coming down.
    let half = r.div_ceil(2);
    let mut split = false;
    let input = |l: &mut Lists, c: usize, split: bool| {
        if split {
            l.i(c)
        } else {
            l.b(c)
        }
    };
    for i in 0..=r {
        split |= i == half && !r.is_multiple_of(2);
        input(&mut l, 1, split);
        split |= i == half && r.is_multiple_of(2);
        input(&mut l, 0, split);
    }
    for _ in 0..p - r - 1 {
        l.w_oldest();
        input(&mut l, 0, split);
    }
    while !l.pending.is_empty() {
        l.w_oldest();
    }
    l.out
}
