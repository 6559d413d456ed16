//! Logs on stderr for burn-dist's binaries and programs (feature `logging`): tracing's
//! formatter, filtered by `RUST_LOG` (default: the level given), with colour codes only where a
//! person reads them.
//!
//! tracing-subscriber keeps its colours on whatever stderr is, so a launcher's rank prefixes,
//! a redirected log file and a CI log filled with escape sequences. Colour is on only when
//! stderr is a terminal and `NO_COLOR` is not set to a non-empty value (no-color.org's rule).

use std::ffi::OsString;
use std::io::IsTerminal;

/// Installs the global subscriber: stderr, `RUST_LOG` or else `default_level` (e.g. `"warn"`),
/// colour per [`colour_on_stderr`]. Does nothing if a subscriber is installed already.
pub fn init_stderr(default_level: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| default_level.into());
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(colour_on_stderr())
        .with_env_filter(filter)
        .try_init();
}

/// Whether logs on stderr may carry colour codes: stderr is a terminal and `NO_COLOR` is unset
/// or empty.
pub fn colour_on_stderr() -> bool {
    colour(
        std::io::stderr().is_terminal(),
        std::env::var_os("NO_COLOR"),
    )
}

fn colour(is_terminal: bool, no_color: Option<OsString>) -> bool {
    is_terminal && no_color.is_none_or(|v| v.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colour_needs_a_terminal_and_no_no_color() {
        assert!(colour(true, None));
        assert!(colour(true, Some("".into())), "an empty NO_COLOR is unset");
        assert!(!colour(true, Some("1".into())));
        assert!(!colour(false, None), "a file or a pipe");
    }
}
