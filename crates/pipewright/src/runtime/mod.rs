//! The process and its machine, below everything else: devices by name, memory counted by the
//! allocator, tensor storage copies for custom ops and the custom ops' one skeleton
//! (`custom_op!`), files a command may write, sizes in bytes, printing that survives a closed
//! pipe, a thread's CPU time, content digests, seeds hashed from names and the random streams
//! they start, flag values with a check, choices spelled as words (`word_enum!`), and round-number chart axes. Nothing
//! here knows about ranks, models or training.

pub mod axis;
pub mod bytes;
pub mod console;
pub mod cpu_time;
pub(crate) mod custom_op;
pub mod device;
pub mod digest;
pub mod files;
pub mod flag_values;
pub mod memory;
pub mod seed;
pub(crate) mod storage;
pub mod words;

/// This machine's name (the kernel's, else `/etc/hostname`, else `localhost`): what a run
/// directory's lock, a TensorBoard event file and a measured hardware file name it by.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "localhost".into())
}
