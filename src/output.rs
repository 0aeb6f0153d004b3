//! Standard output that a reader who left cannot crash: `pdkv sweep --json | head -1` closes the
//! pipe after one line, and `println!` would panic at the next one, skipping the shutdown of the
//! processes a command launched. Lines written after the reader left (or after any write error)
//! are dropped; long commands ask [`closed`] and stop early, then shut down as usual.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

static CLOSED: AtomicBool = AtomicBool::new(false);

/// Writes one line to standard output; after a failed write, does nothing.
pub fn write_line(args: std::fmt::Arguments<'_>) {
    if CLOSED.load(Ordering::Relaxed) {
        return;
    }
    let mut out = std::io::stdout().lock();
    let written = out
        .write_fmt(args)
        .and_then(|()| out.write_all(b"\n"))
        .and_then(|()| out.flush());
    if written.is_err() {
        CLOSED.store(true, Ordering::Relaxed);
    }
}

/// Whether standard output failed (its reader left): nobody sees further output.
pub fn closed() -> bool {
    CLOSED.load(Ordering::Relaxed)
}

/// `println!` through [`write_line`].
#[macro_export]
macro_rules! outln {
    () => {
        $crate::output::write_line(format_args!(""))
    };
    ($($arg:tt)*) => {
        $crate::output::write_line(format_args!($($arg)*))
    };
}
