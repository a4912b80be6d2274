//! The time a rank's thread waits on communication that could travel behind its computation:
//! the data-parallel gradient sums and ZeRO's reduce-scatters and gathers, their starts (which
//! complete before they return on an engine without background progress) and their waits.
//! [`waiting`] times one; [`take`] reads the thread's total and starts it again (once a step:
//! [`crate::plan::StepParts::exposed_comm_s`], the communication the step exposes). Kept per
//! thread: a rank is a thread (the local backend) or its process's main thread (Open MPI,
//! NCCL), and these waits run on it. For a trace, each piece's span (from its start to the
//! return of the wait that completed it) is kept too ([`keep_spans`], [`finish`]).

use std::cell::{Cell, RefCell};
use std::time::Instant;

use super::Pending;
use crate::Result;

thread_local! {
    static WAITED: Cell<f64> = const { Cell::new(0.0) };
    static SPANS: RefCell<Option<Vec<Span>>> = const { RefCell::new(None) };
}

/// One piece of data-parallel communication as traced.
#[derive(Clone, Debug)]
pub struct Span {
    /// What it moved (`all-reduce 4096.0 KiB`, `reduce-scatter bucket 3`, `gather layer 2`).
    pub what: String,
    /// When it started.
    pub start: Instant,
    /// When the wait that completed it returned.
    pub end: Instant,
    /// Seconds of that wait: the part of the span the thread did not compute.
    pub waited: f64,
}

/// Keeps this thread's spans from now on (for a trace), or (`false`) drops them and keeps none.
pub fn keep_spans(on: bool) {
    SPANS.with(|s| {
        let mut s = s.borrow_mut();
        match on {
            true => drop(s.get_or_insert_with(Vec::new)),
            false => *s = None,
        }
    });
}

/// The spans kept since the previous call.
pub fn take_spans() -> Vec<Span> {
    SPANS.with(|s| {
        s.borrow_mut()
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    })
}

/// Waits for `p`, a piece started at `start`: the wait counted as [`waiting`] counts it, and
/// the piece's span kept when this thread keeps spans (`what` names it).
pub fn finish<T: Send + 'static>(
    p: Pending<T>,
    start: Instant,
    what: impl FnOnce() -> String,
) -> Result<T> {
    let t0 = Instant::now();
    let r = p.wait();
    let end = Instant::now();
    let waited = (end - t0).as_secs_f64();
    count(waited);
    SPANS.with(|s| {
        if let Some(spans) = s.borrow_mut().as_mut() {
            let what = what();
            spans.push(Span {
                what,
                start,
                end,
                waited,
            });
        }
    });
    r
}

/// Runs `f` (a start or a wait of such communication) and counts its time to this thread.
pub fn waiting<T>(f: impl FnOnce() -> T) -> T {
    let t0 = Instant::now();
    let r = f();
    count(t0.elapsed().as_secs_f64());
    r
}

fn count(seconds: f64) {
    WAITED.with(|w| w.set(w.get() + seconds));
}

/// Seconds this thread waited since the previous call (or its start).
pub fn take() -> f64 {
    WAITED.with(|w| w.replace(0.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_add_up_per_thread_until_taken() {
        take();
        waiting(|| std::thread::sleep(std::time::Duration::from_millis(20)));
        waiting(|| std::thread::sleep(std::time::Duration::from_millis(10)));
        let other = std::thread::spawn(take).join().unwrap();
        assert_eq!(other, 0.0, "another thread waited for nothing");
        let t = take();
        assert!((0.03..1.0).contains(&t), "{t}");
        assert_eq!(take(), 0.0);
    }

    #[test]
    fn spans_are_kept_only_when_asked() {
        let done = || finish(Pending::ready(Ok(1)), Instant::now(), || "a".into());
        done().unwrap();
        assert!(take_spans().is_empty());
        keep_spans(true);
        let start = Instant::now();
        std::thread::sleep(std::time::Duration::from_millis(5));
        finish(Pending::ready(Ok(())), start, || "b".into()).unwrap();
        let spans = take_spans();
        assert_eq!(spans.len(), 1);
        assert_eq!(spans[0].what, "b");
        assert!((spans[0].end - spans[0].start).as_secs_f64() >= 0.005);
        assert!(spans[0].waited < 0.005, "the wait itself was at once");
        keep_spans(false);
        done().unwrap();
        assert!(take_spans().is_empty());
    }
}
