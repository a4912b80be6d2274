//! Printing to standard output that never stops a program. A reader that goes away
//! (`pipewright train ... | head -1`) closes the pipe, and the next `println!` panics on
//! "Broken pipe": a rank thread died and the run ended without its checkpoint or summary.
//! What a run prints is a view of what it writes to its run directory, so lines that cannot be
//! printed are dropped and the run goes on. [`say!`](crate::say) is `println!` that does so.

use std::io::Write;

/// Writes `args` and a newline to standard output; a write that fails (a closed pipe, a full
/// disk behind a redirect) is dropped.
pub fn say_fmt(args: std::fmt::Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_fmt(args).and_then(|()| out.write_all(b"\n"));
}

/// Writes `text` as it is (no newline added), dropping a write that fails.
pub fn say_text(text: &str) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(text.as_bytes()).and_then(|()| out.flush());
}

/// `println!` that never panics: a line standard output cannot take is dropped
/// ([`console`](crate::runtime::console)).
#[macro_export]
macro_rules! say {
    () => {
        $crate::runtime::console::say_fmt(format_args!(""))
    };
    ($($t:tt)*) => {
        $crate::runtime::console::say_fmt(format_args!($($t)*))
    };
}
