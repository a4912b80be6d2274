//! The CPU time the calling thread has run, beside the wall clock: how much of a piece of work
//! the OS gave its thread. Ranks that outnumber the cores (threads, or processes under
//! `mpirun`) are descheduled in turn, and an action's wall time then exceeds what it computed;
//! `pipewright train --trace` writes both for each action (`cpu_us` beside `dur_us`).

/// Seconds of CPU this thread has run since it started (Linux's `CLOCK_THREAD_CPUTIME_ID`), or
/// `None` where it cannot be read.
pub fn thread_cpu_seconds() -> Option<f64> {
    #[cfg(all(target_os = "linux", target_pointer_width = "64"))]
    {
        #[repr(C)]
        struct Timespec {
            sec: i64,
            nsec: i64,
        }
        extern "C" {
            fn clock_gettime(clock: std::os::raw::c_int, tp: *mut Timespec) -> std::os::raw::c_int;
        }
        const CLOCK_THREAD_CPUTIME_ID: std::os::raw::c_int = 3;
        let mut t = Timespec { sec: 0, nsec: 0 };
        // SAFETY: `t` is a valid, writable timespec (two 64-bit fields on 64-bit Linux) and the
        // clock id is Linux's; clock_gettime writes only `t`.
        let rc = unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut t) };
        (rc == 0).then_some(t.sec as f64 + t.nsec as f64 * 1e-9)
    }
    #[cfg(not(all(target_os = "linux", target_pointer_width = "64")))]
    None
}

#[cfg(test)]
mod tests {
    use super::thread_cpu_seconds;
    use std::time::{Duration, Instant};

    #[test]
    fn a_sleeping_thread_runs_no_cpu_and_a_spinning_one_does() {
        let Some(t0) = thread_cpu_seconds() else {
            return;
        };
        std::thread::sleep(Duration::from_millis(50));
        let slept = thread_cpu_seconds().unwrap() - t0;
        assert!(slept < 0.02, "sleeping 50 ms ran {slept} s of CPU");
        // Spin until the clock says 20 ms ran (however busy the machine, the thread gets
        // them in the end): it counts what this thread ran, never more than the wall time.
        let (start, t1) = (Instant::now(), thread_cpu_seconds().unwrap());
        let mut x = 0u64;
        let mut spun = 0.0;
        while spun < 0.02 && start.elapsed() < Duration::from_secs(60) {
            for _ in 0..10_000 {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(1));
            }
            spun = thread_cpu_seconds().unwrap() - t1;
        }
        let wall = start.elapsed().as_secs_f64();
        assert!(
            spun >= 0.02 && spun <= wall + 1e-3,
            "spun {spun} s in {wall} s"
        );
    }
}
