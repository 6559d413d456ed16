//! Copies a child's output to the launcher's, one `[rank R] ` prefixed line per write, or to
//! the rank's log file when `--local-ranks-filter` hides it; remembers its last line of stderr.

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

/// The last line a rank wrote on its stderr, kept to tell whether a restarted job failed the
/// same way again.
pub type LastLine = Arc<Mutex<Option<String>>>;

/// Copies `source` to `sink` until end of file. Each line is written with one call while holding
/// the sink's lock, so lines of different ranks never interleave mid-line. A last line without a
/// newline is still written (with one added). Every line is also left in `last`, if given.
pub fn copy_prefixed(source: impl Read, rank: u64, sink: Sink, last: Option<LastLine>) {
    let prefix = match sink {
        Sink::File(_) => String::new(),
        _ => format!("[rank {rank}] "),
    };
    copy_lines(source, &prefix, |line| {
        if let Some(last) = &last {
            let text = String::from_utf8_lossy(&line[prefix.len()..]);
            *last.lock().unwrap_or_else(|e| e.into_inner()) = Some(text.trim_end().to_owned());
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

    #[test]
    fn overlong_lines_are_cut() {
        let input = vec![b'x'; MAX_LINE as usize + 10];
        let lines = lines_of(&input);
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[1], format!("[rank 7] {}\n", "x".repeat(10)));
    }
}
