//! How the process's allocator treats the large, short-lived buffers of training.
//!
//! A training step allocates and frees tensors of many megabytes (activations, gradients, the
//! logits). By default glibc maps every block over its mmap threshold (dynamic, 128 KiB to
//! 32 MiB) afresh and returns freed memory at the top of the heap to the kernel, so each new
//! tensor of that size pays page faults and the kernel's zeroing of every page: on the
//! benchmark GPT that was 15-18 % of a CPU step, and at 64 MiB messages it cost MPI more than
//! the transfer. Keeping large blocks in the heap makes the next step reuse memory already
//! mapped, as PyTorch's caching allocator does.

use std::sync::Once;

/// Serves large allocations from glibc's heap and keeps freed memory there (mmap and trim
/// thresholds at 1 GiB), in one arena for all threads: a thread's own arena is a series of
/// 64 MiB heaps that glibc unmaps and maps again as tensors come and go, paying the page
/// faults these settings are meant to avoid (10 % of the benchmark step). Allocations that big
/// are few per operation, so sharing one arena's lock costs nothing measurable.
///
/// Process-wide and idempotent. Best called before the process starts threads (threads that
/// have allocated keep the arena they have): `local::run` calls it before spawning ranks, MPI's
/// initialisation and `Varuna::new` call it too, so a user never needs to. A no-op outside
/// Linux with glibc.
pub fn keep_freed_memory() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        {
            extern "C" {
                fn mallopt(
                    param: std::os::raw::c_int,
                    value: std::os::raw::c_int,
                ) -> std::os::raw::c_int;
            }
            const M_TRIM_THRESHOLD: std::os::raw::c_int = -1;
            const M_MMAP_THRESHOLD: std::os::raw::c_int = -3;
            const M_ARENA_MAX: std::os::raw::c_int = -8;
            // SAFETY: mallopt only tunes glibc's allocator; every value is within its limits.
            unsafe {
                mallopt(M_MMAP_THRESHOLD, 1 << 30);
                mallopt(M_TRIM_THRESHOLD, 1 << 30);
                mallopt(M_ARENA_MAX, 1);
            }
        }
    });
}
