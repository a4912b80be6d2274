//! The one error type of pipewright. Every message says what went wrong and what to do.

use std::path::PathBuf;

/// Errors of every fallible public call.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A tensor operation failed inside candle.
    #[error("tensor operation failed: {0}")]
    Candle(#[from] candle_core::Error),

    /// A configuration or argument is invalid; the message says which and how to fix it.
    #[error("{0}")]
    Invalid(String),

    /// A layer rejected its input (wrong shape, wrong arity, ...).
    #[error("layer `{layer}`: {msg}")]
    Layer {
        /// The layer's name.
        layer: String,
        /// What is wrong and what to do.
        msg: String,
    },

    /// Reading or writing a file failed.
    #[error("{action} `{path}`: {source}")]
    Io {
        /// What was being done (`cannot read`, `cannot write`, ...).
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// The loss stopped being a finite number.
    #[error("loss is {loss} at step {step}: lower the learning rate, enable gradient clipping or check the data")]
    NonFiniteLoss {
        /// The step.
        step: u64,
        /// The loss it gave (NaN or infinite).
        loss: f64,
    },

    /// A communication between ranks failed; the message names the ranks involved.
    #[error("communication failed: {0}")]
    Comm(String),

    /// A saved state does not fit the object it is loaded into.
    #[error("cannot load state: {0}")]
    State(String),

    /// The command line asked for help (or the version): the text to print, not a failure.
    #[error("{0}")]
    Help(String),
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// Shorthand for an [`Error::Invalid`] with a formatted message.
#[macro_export]
macro_rules! invalid {
    ($($arg:tt)*) => { $crate::Error::Invalid(format!($($arg)*)) };
}

impl Error {
    /// Fails on the first of `sizes` that is zero, as `{whose} {name} must be positive` (a
    /// model's sizes: `GPT n_layer must be positive`).
    pub fn require_positive(whose: &str, sizes: &[(&str, usize)]) -> Result<()> {
        match sizes.iter().find(|(_, v)| *v == 0) {
            Some((name, _)) => Err(invalid!("{whose} {name} must be positive")),
            None => Ok(()),
        }
    }

    /// Fails unless `value` is a multiple of `of`, as `{whose} n_embd 30 is not divisible by
    /// n_head 4: choose n_embd a multiple of n_head` (a width its heads must split evenly).
    pub fn require_multiple(whose: &str, value: (&str, usize), of: (&str, usize)) -> Result<()> {
        match of.1 != 0 && value.1.is_multiple_of(of.1) {
            true => Ok(()),
            false => Err(invalid!(
                "{whose} {} {} is not divisible by {} {}: choose {} a multiple of {}",
                value.0,
                value.1,
                of.0,
                of.1,
                value.0,
                of.0
            )),
        }
    }

    /// Wraps an I/O error with the path and the action that failed.
    pub fn io(action: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            action,
            path: path.into(),
            source,
        }
    }
}
