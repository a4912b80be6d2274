//! The process and its machine, below everything else: devices by name, memory counted by the
//! allocator, tensor storage copies for custom ops, files a command may write, sizes in bytes,
//! printing that survives a closed pipe, a thread's CPU time, content digests, seeds hashed
//! from names and the random streams they start, and round-number chart axes. Nothing here knows about ranks, models or training.

pub mod axis;
pub mod bytes;
pub mod console;
pub mod cpu_time;
pub mod device;
pub mod digest;
pub mod files;
pub mod memory;
pub mod seed;
pub(crate) mod storage;
