//! The time a rank's thread waits on communication that could travel behind its computation:
//! the data-parallel gradient sums and ZeRO's reduce-scatters and gathers, their starts (which
//! complete before they return on an engine without background progress) and their waits.
//! [`waiting`] times one; [`take`] reads the thread's total and starts it again (once a step:
//! [`crate::plan::StepParts::exposed_comm_s`], the communication the step exposes). Kept per
//! thread: a rank is a thread (the local backend) or its process's main thread (Open MPI,
//! NCCL), and these waits run on it.

use std::cell::Cell;
use std::time::Instant;

thread_local! {
    static WAITED: Cell<f64> = const { Cell::new(0.0) };
}

/// Runs `f` (a start or a wait of such communication) and counts its time to this thread.
pub fn waiting<T>(f: impl FnOnce() -> T) -> T {
    let t0 = Instant::now();
    let r = f();
    WAITED.with(|w| w.set(w.get() + t0.elapsed().as_secs_f64()));
    r
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
}
