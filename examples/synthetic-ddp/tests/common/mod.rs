//! What the launched restart and elastic tests share: how they start `synthetic-zero`.

use std::path::Path;
use std::process::{Command, Stdio};

/// Appends `-- synthetic-zero --steps STEPS` (a checkpoint every 2 steps under `dir`, the
/// final parameters to `out`, then `extra`) to a `burn-dist-run` command, with both streams
/// piped and no restart count inherited from the test's own environment.
pub fn synthetic_zero<'c>(
    command: &'c mut Command,
    steps: &str,
    dir: &Path,
    out: &Path,
    extra: &[&str],
) -> &'c mut Command {
    command
        .arg("--")
        .arg(env!("CARGO_BIN_EXE_synthetic-zero"))
        .args([
            "--steps",
            steps,
            "--checkpoint-every",
            "2",
            "--checkpoint-dir",
        ])
        .arg(dir)
        .arg("--out")
        .arg(out)
        .args(extra)
        .env("BURN_DIST_TIMEOUT_SECS", "60")
        .env_remove("BURN_DIST_RESTART_COUNT")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
}
