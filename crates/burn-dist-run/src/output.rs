//! Copies a child's output to the launcher's, one `[rank R] ` prefixed line per write, or to
//! the rank's log file when `--local-ranks-filter` hides it; remembers its last error line of
//! stderr.

use std::fs::File;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::sync::{Arc, Mutex};

/// A line longer than this is cut into pieces, so a child that writes megabytes without a newline
/// cannot make the launcher buffer all of it.
const MAX_LINE: u64 = 64 * 1024;

/// Where a rank's stream goes.
#[derive(Debug, Clone)]
pub enum Sink {
    Stdout,
    Stderr,
    /// The rank's log file, shared by its two streams; lines go in without a prefix.
    File(Arc<Mutex<File>>),
}

/// The last error line a rank wrote on its stderr ([`ErrorLines`]), quoted by the launcher's
/// restart and summary lines and kept to tell whether a restarted job failed the same way again.
pub type LastLine = Arc<Mutex<Option<String>>>;

/// Tells a rank's own error lines from what Rust's panic hook writes after a panic's message:
/// its notes (`note: run with `RUST_BACKTRACE=1` …`, `note: Some details are omitted …`) and a
/// backtrace (`stack backtrace:` and its numbered frames with their `at` lines). Those end
/// every panic alike, so quoting them says nothing of the failure, and two unrelated panics of
/// a rank would look like the same failure repeated.
#[derive(Default)]
struct ErrorLines {
    in_backtrace: bool,
}

impl ErrorLines {
    /// Whether `line`, the next line of the stream, is one of the rank's own.
    fn is_own(&mut self, line: &str) -> bool {
        if self.in_backtrace && is_backtrace_frame(line) {
            return false;
        }
        self.in_backtrace = line == "stack backtrace:";
        let note = line.starts_with("note: run with `RUST_BACKTRACE=")
            || line.starts_with("note: Some details are omitted, run with `RUST_BACKTRACE=full`");
        !self.in_backtrace && !note
    }
}

/// A frame of a backtrace: `  12: name` (`  12:     0x55d0c1b6a3d2 - name` in full), or its
/// indented `at file:line:column`.
fn is_backtrace_frame(line: &str) -> bool {
    let trimmed = line.trim_start();
    if trimmed.len() == line.len() {
        return false;
    }
    let digits = trimmed.bytes().take_while(u8::is_ascii_digit).count();
    (digits > 0 && trimmed[digits..].starts_with(':')) || trimmed.starts_with("at ")
}

/// Copies `source` to `sink` until end of file. Each line is written with one call while holding
/// the sink's lock, so lines of different ranks never interleave mid-line. A last line without a
/// newline is still written (with one added). Every line of the rank's own ([`ErrorLines`]) is
/// also left in `last`, if given.
pub fn copy_prefixed(source: impl Read, rank: u64, sink: Sink, last: Option<LastLine>) {
    let prefix = match sink {
        Sink::File(_) => String::new(),
        _ => format!("[rank {rank}] "),
    };
    let mut own = ErrorLines::default();
    copy_lines(source, &prefix, |line| {
        if let Some(last) = &last {
            let text = String::from_utf8_lossy(&line[prefix.len()..]);
            let text = text.trim_end();
            if own.is_own(text) {
                *last.lock().unwrap_or_else(|e| e.into_inner()) = Some(text.to_owned());
            }
        }
        // If the launcher's own output is gone (closed pipe) or the log file cannot be written,
        // keep reading anyway: a child blocked on a full pipe would never exit.
        let _ = match &sink {
            Sink::Stdout => io::stdout().lock().write_all(line),
            Sink::Stderr => io::stderr().lock().write_all(line),
            Sink::File(file) => file
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .write_all(line),
        };
    });
}

fn copy_lines(source: impl Read, prefix: &str, mut emit: impl FnMut(&[u8])) {
    let mut reader = BufReader::new(source);
    let mut raw = Vec::new();
    let mut out = Vec::new();
    loop {
        raw.clear();
        match reader.by_ref().take(MAX_LINE).read_until(b'\n', &mut raw) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let text = raw.strip_suffix(b"\n").unwrap_or(&raw);
        out.clear();
        out.extend_from_slice(prefix.as_bytes());
        out.extend_from_slice(String::from_utf8_lossy(text).as_bytes());
        out.push(b'\n');
        emit(&out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines_of(input: &[u8]) -> Vec<String> {
        let mut lines = Vec::new();
        copy_lines(input, "[rank 7] ", |l| {
            lines.push(String::from_utf8(l.to_vec()).unwrap())
        });
        lines
    }

    #[test]
    fn every_line_is_prefixed_and_a_partial_last_line_is_kept() {
        assert_eq!(
            lines_of(b"a\n\nb\xffc\npartial"),
            [
                "[rank 7] a\n",
                "[rank 7] \n",
                "[rank 7] b\u{fffd}c\n",
                "[rank 7] partial\n"
            ]
        );
    }

    /// What the panic hook writes with `RUST_BACKTRACE=1` (short) and `=full`, and without.
    const PANICS: [&str; 3] = [
        "thread 'main' (4242) panicked at src/main.rs:3:5:\n\
         rank 1: the real error\n\
         stack backtrace:\n   \
         0: __rustc::rust_begin_unwind\n             \
         at /rustc/59807616/library/std/src/panicking.rs:697:5\n  \
         12: main\n\
         note: Some details are omitted, run with `RUST_BACKTRACE=full` for a verbose backtrace.",
        "thread 'main' panicked at src/main.rs:3:5:\n\
         rank 1: the real error\n\
         stack backtrace:\n   \
         0:     0x55d0c1b6a3d2 - std::backtrace_rs::backtrace::libunwind::trace::h8a3b\n                               \
         at /rustc/59807616/library/std/src/../../backtrace/src/backtrace/libunwind.rs:116:5",
        "thread 'main' panicked at src/main.rs:3:5:\n\
         rank 1: the real error\n\
         note: run with `RUST_BACKTRACE=1` environment variable to display a backtrace",
    ];

    #[test]
    fn the_error_line_kept_is_a_panics_message_not_its_backtrace_or_notes() {
        for panic in PANICS {
            let mut own = ErrorLines::default();
            let last = panic.lines().filter(|l| own.is_own(l)).last();
            assert_eq!(last, Some("rank 1: the real error"), "{panic}");
        }
        // After the backtrace, an indented line is the rank's own again.
        let text = format!("{}\n  3: an indented line of the rank's own", PANICS[0]);
        let mut own = ErrorLines::default();
        let kept: Vec<&str> = text.lines().filter(|l| own.is_own(l)).collect();
        assert_eq!(
            kept,
            [
                "thread 'main' (4242) panicked at src/main.rs:3:5:",
                "rank 1: the real error",
                "  3: an indented line of the rank's own"
            ]
        );
    }

    #[test]
    fn overlong_lines_are_cut() {
        let input = vec![b'x'; MAX_LINE as usize + 10];
        let lines = lines_of(&input);
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[1], format!("[rank 7] {}\n", "x".repeat(10)));
    }
}
