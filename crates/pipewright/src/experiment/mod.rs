//! The experiment around a run (pystematic's context): the run directory with its parameters,
//! the [`Recorder`] for scalars (TensorBoard events and CSV) and resource readings.

pub mod recorder;
pub mod run_dir;
pub mod tfevents;

pub use recorder::Recorder;
pub use run_dir::RunDir;

/// Peak resident memory of this process in bytes (Linux `VmHWM`), if known.
pub fn peak_memory_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
