//! Shared by this package's real-process tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// `burn-dist-run`, built by the same `cargo test --workspace` next to this test's binary.
pub fn launcher() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target dir");
    let launcher = dir.join("burn-dist-run");
    assert!(
        launcher.exists(),
        "{} is missing: build it first (`cargo xtask test` and `cargo xtask integration` do)",
        launcher.display()
    );
    launcher
}

/// The little-endian f32 values of a parameter file written with `--out`.
pub fn read_f32s(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// A fresh, empty directory for one test.
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("burn-dist-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
