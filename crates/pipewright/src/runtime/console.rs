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

/// `text` as an error message quotes it: whole when short, else its first 40 characters and
/// how long it was, so that a huge input (a 3 GB token of a schedule file) never becomes a
/// huge message.
pub fn excerpt(text: &str) -> std::borrow::Cow<'_, str> {
    const KEEP: usize = 40;
    match text.char_indices().nth(KEEP) {
        None => text.into(),
        Some((end, _)) => format!("{}... ({} bytes)", &text[..end], text.len()).into(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_excerpt_keeps_short_text_and_cuts_long_text() {
        assert_eq!(super::excerpt("1F3"), "1F3");
        let long = "é".repeat(1000);
        let e = super::excerpt(&long);
        assert_eq!(e, format!("{}... (2000 bytes)", "é".repeat(40)));
    }
}
