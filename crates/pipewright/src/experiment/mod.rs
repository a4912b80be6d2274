//! Experiments as programs (pystematic-torch): an [`Experiment`] with declared [`Param`]s and a
//! body run by every rank with its [`Context`] (registered [`Stateful`] items and the trainer,
//! saved and restored together), the [`SmartDataLoader`] over a user's [`Dataset`], the run
//! directory with its parameters, and the [`Recorder`] for scalars (TensorBoard events and
//! CSV) and resource readings. The run as data and the one training loop are the trainer's
//! ([`crate::trainer`]).

pub mod context;
pub mod image;
pub mod loader;
pub mod lock;
pub mod owner;
pub mod params;
pub mod recorder;
pub mod report;
pub mod run_dir;
pub mod runner;
pub mod summary;
pub mod sweep;
pub mod tfevents;

pub use context::{Context, Counter, Stateful};
pub use image::{LinePlot, RgbImage};
pub use loader::{Dataset, SmartDataLoader};
pub use lock::RunLock;
pub use params::{Param, ParamType, Params};
pub use recorder::Recorder;
pub use report::{write_report, RunRecord};
pub use run_dir::RunDir;
pub use runner::Experiment;
pub use summary::Summary;
pub use sweep::{run_parameter_sweep, Sweep, SweepRun};

/// Peak resident memory of this process in bytes (Linux `VmHWM`), if known.
pub fn peak_memory_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
