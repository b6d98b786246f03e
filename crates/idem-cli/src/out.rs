//! Standard output that ends quietly when its reader has gone.
//!
//! `println!` panics when stdout is a pipe whose reader exited (`idem outbox list | head
//! -1`), printing a panic message on stderr and exiting 101. Every line `idem` prints goes
//! through [`say!`] instead: a write refused because the reader has gone ends the process
//! at once with [`READER_GONE`], as a Unix tool killed by SIGPIPE ends (with nothing on
//! stderr, which may be a terminal still). Restoring SIGPIPE's default action would do the
//! same for stdout, but also for a database or broker socket the driver writes without
//! `MSG_NOSIGNAL`, which must fail as a lost connection instead; and it needs `unsafe`.
//!
//! Ending at once is what a kill would do: every write path of idem is safe against it
//! (a command killed mid-way leaves what a crash leaves, and a retry resolves it).

use std::fmt;
use std::io::{self, Write};

/// The exit code when stdout's reader has gone: 128 + SIGPIPE (13), what a shell reports
/// for a process SIGPIPE killed.
pub(crate) const READER_GONE: i32 = 141;

/// Prints a line on stdout, as `println!` does, through [`write`].
macro_rules! say {
    () => {
        $crate::out::write(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::out::write(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// Writes to stdout and flushes. A reader that has gone ends the process with
/// [`READER_GONE`]; any other failure to write (a full disk behind a redirection) ends it
/// with 1 and one line on stderr, instead of `println!`'s panic.
pub(crate) fn write(args: fmt::Arguments<'_>) {
    let mut out = io::stdout().lock();
    if let Err(e) = out.write_fmt(args).and_then(|()| out.flush()) {
        drop(out);
        if e.kind() == io::ErrorKind::BrokenPipe {
            std::process::exit(READER_GONE);
        }
        eprintln!("error: cannot write to stdout: {e}");
        std::process::exit(1);
    }
}
