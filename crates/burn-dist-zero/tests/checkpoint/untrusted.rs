//! A checkpoint is untrusted input: a manifest naming files outside its directory, files that
//! are not regular files or not of the listed size, a manifest in another step's directory and
//! a manifest whose values were changed are each refused with a typed error naming the file.

use std::path::Path;

use burn_dist_zero::checkpoint::{self, CheckpointError, MANIFEST, Manifest};

use super::{copy_checkpoint, good_checkpoint, load_errors};

const SHARD_1: &str = "optim-rank-00001.bin";

/// What `checkpoint::verify` (every file read and checked, no communicator) says of `dir`.
fn verify_error(dir: &Path) -> CheckpointError {
    checkpoint::verify(dir).expect_err("a damaged checkpoint must be refused")
}

/// The manifest of `dir` edited by `edit` and written back with a valid checksum, as someone
/// crafting a checkpoint would.
fn resign(dir: &Path, edit: impl FnOnce(&mut Manifest)) {
    let mut manifest = Manifest::read(dir).unwrap();
    edit(&mut manifest);
    manifest.write(dir).unwrap();
}

/// `text` with the first digit after the first `key` changed (9 → 0, else + 1).
fn flip_digit_after(text: &str, key: &str) -> String {
    let start = text
        .find(key)
        .unwrap_or_else(|| panic!("no {key} in {text}"))
        + key.len();
    let at = start + text[start..].find(|c: char| c.is_ascii_digit()).unwrap();
    let digit = text.as_bytes()[at] - b'0';
    let flipped = char::from(b'0' + (digit + 1) % 10);
    format!("{}{flipped}{}", &text[..at], &text[at + 1..])
}

#[test]
fn file_names_outside_the_format_are_refused() {
    let (_root, good) = good_checkpoint();
    assert!(checkpoint::verify(&good).is_ok());
    let outside = good.parent().unwrap().join("elsewhere.bin");
    std::fs::copy(good.join(SHARD_1), &outside).unwrap();
    let names = [
        outside.to_str().unwrap().to_string(),
        format!("../{}", outside.file_name().unwrap().to_str().unwrap()),
        format!(
            "../{}/{SHARD_1}",
            good.file_name().unwrap().to_str().unwrap()
        ),
        "optim-rank-00000.bin".to_string(),
    ];
    for name in names {
        let (_keep, dir) = copy_checkpoint(&good);
        resign(&dir, |m| {
            let entry = m.files.iter_mut().find(|f| f.rank == Some(1)).unwrap();
            entry.name = name.clone();
        });
        match verify_error(&dir) {
            CheckpointError::UndefinedFileName {
                manifest,
                name: listed,
                defined,
                ..
            } => {
                assert_eq!(manifest, dir.join(MANIFEST));
                assert_eq!(
                    (listed.as_str(), defined.as_str()),
                    (name.as_str(), SHARD_1)
                );
            }
            other => panic!("{name}: {other}"),
        }
        let errors = load_errors(&dir);
        super::assert_refused(
            &errors,
            &["manifest.json", &name, "must be `optim-rank-00001.bin`"],
        );
    }
}

/// Replaces `dir/name` with what `make` creates at that path.
fn replace_with(dir: &Path, name: &str, make: impl FnOnce(&Path)) {
    let path = dir.join(name);
    std::fs::remove_file(&path).unwrap();
    make(&path);
}

fn assert_not_regular(error: CheckpointError, path: &Path, expected_kind: &str) {
    match error {
        CheckpointError::NotRegularFile { path: p, kind } => {
            assert_eq!((p.as_path(), kind), (path, expected_kind));
        }
        other => panic!("{}: {other}", path.display()),
    }
}

#[test]
fn files_that_are_not_regular_are_refused_without_reading_them() {
    let (_root, good) = good_checkpoint();
    // A FIFO nobody writes to: opening or reading it blocking would hang the load.
    let (_keep, dir) = copy_checkpoint(&good);
    replace_with(&dir, SHARD_1, |path| {
        let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: mkfifo(3) with a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
    });
    // Bounded: a blocking open would wait for a writer forever.
    let (sender, receiver) = std::sync::mpsc::channel();
    let fifo_dir = dir.clone();
    std::thread::spawn(move || sender.send(verify_error(&fifo_dir)));
    let error = receiver
        .recv_timeout(std::time::Duration::from_secs(30))
        .expect("reading a checkpoint whose shard is a FIFO hung");
    assert_not_regular(error, &dir.join(SHARD_1), "FIFO");
    super::assert_refused(
        &load_errors(&dir),
        &[SHARD_1, "is a FIFO, not a regular file"],
    );

    // A symbolic link to /dev/zero (endless) or to a good file elsewhere.
    for target in [Path::new("/dev/zero"), &good.join(SHARD_1)] {
        let (_keep, dir) = copy_checkpoint(&good);
        replace_with(&dir, SHARD_1, |path| {
            std::os::unix::fs::symlink(target, path).unwrap()
        });
        assert_not_regular(verify_error(&dir), &dir.join(SHARD_1), "symbolic link");
    }

    // A directory, and a manifest that is a symbolic link to a good manifest.
    let (_keep, dir) = copy_checkpoint(&good);
    replace_with(&dir, SHARD_1, |path| std::fs::create_dir(path).unwrap());
    assert_not_regular(verify_error(&dir), &dir.join(SHARD_1), "directory");
    let (_keep, dir) = copy_checkpoint(&good);
    replace_with(&dir, MANIFEST, |path| {
        std::os::unix::fs::symlink(good.join(MANIFEST), path).unwrap()
    });
    assert_not_regular(verify_error(&dir), &dir.join(MANIFEST), "symbolic link");
}

#[test]
fn files_of_another_size_than_listed_are_refused() {
    let (_root, good) = good_checkpoint();
    let size = std::fs::metadata(good.join(SHARD_1)).unwrap().len();
    for new_size in [size - 1, size + 1, size + (1 << 20)] {
        let (_keep, dir) = copy_checkpoint(&good);
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join(SHARD_1))
            .unwrap();
        file.set_len(new_size).unwrap();
        match verify_error(&dir) {
            CheckpointError::WrongSize {
                path, found, what, ..
            } => {
                assert_eq!((path, found), (dir.join(SHARD_1), new_size));
                assert_eq!(what, "rank 1's optimizer shard");
            }
            other => panic!("{new_size} bytes: {other}"),
        }
        super::assert_refused(
            &load_errors(&dir),
            &[SHARD_1, &format!("is {new_size} bytes")],
        );
    }
    // A manifest too large to be one is not read.
    let (_keep, dir) = copy_checkpoint(&good);
    let file = std::fs::OpenOptions::new()
        .append(true)
        .open(dir.join(MANIFEST))
        .unwrap();
    file.set_len(checkpoint::manifest::MAX_MANIFEST_BYTES + 1)
        .unwrap();
    assert!(matches!(
        verify_error(&dir),
        CheckpointError::WrongSize { path, .. } if path == dir.join(MANIFEST)
    ));
}

#[test]
fn a_manifest_in_another_steps_directory_is_refused() {
    let (_root, good) = good_checkpoint();
    let (_keep, copied) = copy_checkpoint(&good);
    let moved = copied.with_file_name("step-0000000007");
    std::fs::rename(&copied, &moved).unwrap();
    match verify_error(&moved) {
        CheckpointError::StepMismatch {
            path,
            manifest_step,
            dir_step,
        } => assert_eq!(
            (path, manifest_step, dir_step),
            (moved.join(MANIFEST), 1, 7)
        ),
        other => panic!("{other}"),
    }
    // Through the root too: it is the newest "complete" directory there.
    let errors = load_errors(moved.parent().unwrap());
    super::assert_refused(&errors, &["manifest.json", "holds step 1", "step 7"]);
    // A directory not named like a step (a copy the user named) is read.
    let named = moved.with_file_name("best");
    std::fs::rename(&moved, &named).unwrap();
    assert_eq!(checkpoint::verify(&named).unwrap().step, 1);
}

#[test]
fn a_changed_value_in_the_manifest_is_refused_not_applied() {
    let (_root, good) = good_checkpoint();
    let text = std::fs::read_to_string(good.join(MANIFEST)).unwrap();
    assert!(
        text.contains("\"scale\""),
        "the test saves a loss scaler: {text}"
    );
    for key in [
        "\"samples_consumed\"",
        "\"seed\"",
        "\"random\"",
        "\"scale\"",
        "\"growth_tracker\"",
    ] {
        let (_keep, dir) = copy_checkpoint(&good);
        // `"random"`: the first digit after it is the random stream's seed or step.
        let key = if key == "\"random\"" {
            "\"random\": {\n    \"seed\": 0,\n    \"step\""
        } else {
            key
        };
        let changed = flip_digit_after(&text, key);
        std::fs::write(dir.join(MANIFEST), &changed).unwrap();
        match verify_error(&dir) {
            CheckpointError::ManifestChecksum {
                path,
                found,
                expected,
            } => {
                assert_eq!(path, dir.join(MANIFEST));
                assert_ne!(found, expected);
            }
            other => panic!("{key}: {other}"),
        }
        super::assert_refused(&load_errors(&dir), &["manifest.json", "checksum mismatch"]);
    }
    // The layout of the file is not part of the checksum: compact JSON of the same values loads.
    let (_keep, dir) = copy_checkpoint(&good);
    let value: serde_json::Value = serde_json::from_str(&text).unwrap();
    std::fs::write(dir.join(MANIFEST), serde_json::to_vec(&value).unwrap()).unwrap();
    assert_eq!(load_errors(&dir), ["loaded", "loaded"]);
    // A version-1 manifest (no checksum) is refused by its version.
    let (_keep, dir) = copy_checkpoint(&good);
    let old = text.replace("\"format_version\": 2", "\"format_version\": 1");
    std::fs::write(dir.join(MANIFEST), old).unwrap();
    assert!(matches!(
        verify_error(&dir),
        CheckpointError::OlderFormat {
            found: 1,
            supported: 2,
            ..
        }
    ));
}

#[test]
fn a_missing_manifest_means_incomplete_and_an_unreadable_one_an_io_error() {
    let root = tempfile::tempdir().unwrap();
    // A step directory whose save never reached the manifest.
    let dir = checkpoint::step_dir(root.path(), 3);
    std::fs::create_dir_all(&dir).unwrap();
    assert!(matches!(
        Manifest::read(&dir),
        Err(CheckpointError::Incomplete { dir: d }) if d == dir
    ));
    // A "directory" that is a file: the manifest cannot be opened, which is not the same as
    // an unfinished save, and must not be reported as one.
    let file = root.path().join("not-a-directory");
    std::fs::write(&file, b"x").unwrap();
    match Manifest::read(&file) {
        Err(CheckpointError::Io { path, source, .. }) => {
            assert_eq!(path, file.join(MANIFEST));
            assert_ne!(source.kind(), std::io::ErrorKind::NotFound);
        }
        other => panic!("expected an I/O error, got {other:?}"),
    }
}

/// A layout whose sizes do not add up to its total, or whose shards do not cover it, is
/// refused naming the manifest: each inconsistency alone.
#[test]
fn a_layout_that_does_not_add_up_is_refused() {
    let (_root, good) = good_checkpoint();
    type Edit = fn(&mut Manifest);
    let edits: [(&str, Edit); 2] = [
        ("sizes that do not add up to the total", |m| {
            m.layout.total -= 1
        }),
        ("shards that do not cover the total", |m| {
            m.layout.shard_len -= 1
        }),
    ];
    for (what, edit) in edits {
        let (_keep, dir) = copy_checkpoint(&good);
        resign(&dir, edit);
        match verify_error(&dir) {
            CheckpointError::Corrupt { path, reason } => {
                assert_eq!(path, dir.join(MANIFEST), "{what}");
                assert!(reason.contains("inconsistent layout"), "{what}: {reason}");
            }
            other => panic!("{what}: {other}"),
        }
    }
}

/// The manifest's files are found by what they are, not by where they are listed.
#[test]
fn the_files_may_be_listed_in_any_order() {
    let (_root, good) = good_checkpoint();
    let (_keep, dir) = copy_checkpoint(&good);
    resign(&dir, |m| m.files.reverse());
    assert_eq!(load_errors(&dir), ["loaded", "loaded"]);
}

/// A manifest written by format version 2 (ZeroAdam's shards, two ranks, a loss scaler; saved
/// from this suite's good checkpoint on 2026-12-02) still reads, checksum included: the
/// checksum covers the manifest's canonical serialization, so a change of that serialization
/// (a renamed field, a new field written by default, such as the `optimizer` kind that only
/// Burn optimizers' records carry) would refuse every checkpoint saved before it. Such a change
/// needs a new format version, and this file stays as the old version's witness.
#[test]
fn a_format_2_manifest_saved_earlier_still_reads() {
    let root = tempfile::tempdir().unwrap();
    let dir = checkpoint::step_dir(root.path(), 1);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join(MANIFEST),
        include_str!("fixtures/format-2-zero-adam-manifest.json"),
    )
    .unwrap();
    let manifest = Manifest::read(&dir).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((manifest.step, manifest.world_size), (1, 2));
    assert_eq!(manifest.optimizer, checkpoint::OptimizerState::Shards);
}
