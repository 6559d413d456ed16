//! The guide's first page is a program a Burn user can paste: this crate's `src/main.rs` is
//! that page's code, to the byte, so building this crate builds the page; and it trains, on
//! one rank without a launcher and on two through `burn-dist-run`.

use std::process::{Command, Stdio};
use std::time::Duration;

use burn_dist_models::processes::{launcher, watch};

/// A debug build on 2 loaded cores trains the 200 steps in seconds.
const TIMEOUT: Duration = Duration::from_secs(120);

/// The first ```rust block of `markdown`.
fn first_rust_block(markdown: &str) -> String {
    let start = markdown
        .find("```rust\n")
        .expect("the page has a ```rust block")
        + "```rust\n".len();
    let len = markdown[start..]
        .find("\n```")
        .expect("the block is closed");
    markdown[start..start + len + 1].to_string()
}

#[test]
fn the_guides_first_program_is_this_crates_main() {
    let root = std::path::PathBuf::from(
        std::env::var_os("CARGO_MANIFEST_DIR")
            .expect("cargo sets CARGO_MANIFEST_DIR when it runs a test"),
    );
    let guide = std::fs::read_to_string(root.join("../../docs/guide.md")).expect("docs/guide.md");
    let main = std::fs::read_to_string(root.join("src/main.rs")).expect("src/main.rs");
    assert!(
        first_rust_block(&guide) == main,
        "docs/guide.md's first program and examples/quickstart/src/main.rs differ: copy one \
         onto the other"
    );
}

/// Rank 0's `step N: loss L` lines, as (N, L).
fn losses(transcript: &[String], prefix: &str) -> Vec<(u32, f32)> {
    transcript
        .iter()
        .filter_map(|line| {
            let rest = line.strip_prefix(prefix)?.strip_prefix("step ")?;
            let (step, loss) = rest.split_once(": loss ")?;
            Some((step.parse().ok()?, loss.parse().ok()?))
        })
        .collect()
}

fn assert_learns(losses: &[(u32, f32)], what: &str, transcript: &[String]) {
    let steps: Vec<u32> = losses.iter().map(|(s, _)| *s).collect();
    assert_eq!(steps, [50, 100, 150, 200], "{what}: {transcript:#?}");
    assert!(
        losses[3].1 < 0.5 * losses[0].1,
        "{what}: the loss did not fall: {losses:?}"
    );
}

#[test]
fn the_page_trains_alone_and_on_two_ranks() {
    // Alone: no launcher variables, a job of one rank.
    let mut alone = Command::new(env!("CARGO_BIN_EXE_quickstart"))
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting quickstart");
    let (status, transcript) = watch(&mut alone, TIMEOUT, |_| {});
    assert!(status.success(), "alone: {status}\n{transcript:#?}");
    assert_learns(&losses(&transcript, ""), "alone", &transcript);

    let mut job = Command::new(launcher())
        .args(["--nproc-per-node", "2", "--master-port", "0", "--"])
        .arg(env!("CARGO_BIN_EXE_quickstart"))
        .env("BURN_DIST_TIMEOUT_SECS", "60")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting burn-dist-run");
    let (status, transcript) = watch(&mut job, TIMEOUT, |_| {});
    assert!(status.success(), "2 ranks: {status}\n{transcript:#?}");
    assert_learns(
        &losses(&transcript, "[rank 0] "),
        "rank 0 of 2",
        &transcript,
    );
    assert!(
        losses(&transcript, "[rank 1] ").is_empty(),
        "rank 1 printed: only the main rank should"
    );
}
