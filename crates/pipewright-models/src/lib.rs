//! Reference models written as pipewright [`Sequential`](pipewright::Sequential)s, and tasks
//! generated in process (no downloads).

#![warn(missing_docs)]

pub mod cnn;
pub mod gpt;
pub mod parity;
pub mod tasks;

pub use cnn::{cnn, CnnConfig};
pub use gpt::{gpt, GptConfig, TIED};
pub use tasks::{Task, TaskShape};
