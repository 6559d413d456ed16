//! Durable, atomic file writes, and reads that treat every file as untrusted input.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::error::{CheckpointError, Result};
use super::manifest::FileEntry;

/// Size and CRC-32 (IEEE, as zlib and PNG use) of a file's bytes.
pub(crate) fn fingerprint(bytes: &[u8]) -> (u64, u32) {
    (bytes.len() as u64, crc32fast::hash(bytes))
}

/// Writes `bytes` to `dir/name` atomically and durably: a temporary file in the same directory,
/// written and fsynced, renamed over `name`, then the directory fsynced so the rename survives
/// a power loss. A reader sees the old file or the whole new one, never a part.
pub(crate) fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    write_atomic_or_fail(dir, name, bytes, None)
}

/// [`write_atomic`], failing with `fault` (an injected disk error) after half of the bytes, as
/// a disk that fills up or breaks during the write would.
pub(crate) fn write_atomic_or_fail(
    dir: &Path,
    name: &str,
    bytes: &[u8],
    fault: Option<io::Error>,
) -> Result<()> {
    let path = dir.join(name);
    write_atomic_with(dir, name, |tmp| {
        (|| {
            let mut file = File::create(tmp)?;
            if let Some(fault) = fault {
                file.write_all(&bytes[..bytes.len() / 2])?;
                return Err(fault);
            }
            file.write_all(bytes)?;
            file.sync_all()
        })()
        .map_err(|source| CheckpointError::Io { path, source })
    })
}

/// The atomic, durable replacement of `dir/name` for any writer: `write` creates, fills and
/// fsyncs the temporary file it is given (removed if `write` fails), which is then renamed
/// over `name` and the directory fsynced. A streaming writer (the export) uses it directly.
pub(crate) fn write_atomic_with(
    dir: &Path,
    name: &str,
    write: impl FnOnce(&Path) -> Result<()>,
) -> Result<()> {
    let path = dir.join(name);
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    if let Err(error) = write(&tmp) {
        let _ = fs::remove_file(&tmp);
        return Err(error);
    }
    fs::rename(&tmp, &path).map_err(CheckpointError::io(&path))?;
    sync_dir(dir)
}

/// The directory (`.` for a bare file name) and the file name of an output path `out`.
pub(crate) fn dir_and_name(out: &Path) -> Result<(PathBuf, &str)> {
    let dir = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = out
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| CheckpointError::corrupt(out, "not a file name"))?;
    Ok((dir, name))
}

/// Makes the directory's entries (creations, renames, removals) durable.
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(CheckpointError::io(dir))
}

/// The size a file read by [`read_untrusted`] must have.
pub(crate) enum Size {
    /// Exactly this many bytes (the manifest lists it).
    Exactly(u64),
    /// At most this many bytes (the manifest, whose size nothing lists).
    AtMost(u64),
}

/// Reads `path` (`what` it is, for messages) as untrusted input. Refuses anything but a regular
/// file, and a size other than `size`, before reading a byte: the file is opened without
/// following a symbolic link and without blocking (so a FIFO cannot hang the open), then checked
/// on the open descriptor (so it cannot be swapped between the check and the read), and at
/// most the allowed size is read even if it grows meanwhile.
pub(crate) fn read_untrusted(path: &Path, what: &str, size: Size) -> Result<Vec<u8>> {
    let mut opened = open_untrusted(path, what, size)?;
    let mut bytes = Vec::with_capacity(opened.found as usize);
    (&mut opened.file)
        .take(opened.limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(CheckpointError::io(path))?;
    // The file changed size between the check and the read.
    if bytes.len() as u64 != opened.found {
        return Err(opened.wrong_size(bytes.len() as u64));
    }
    Ok(bytes)
}

/// A file that passed [`open_untrusted`]'s checks.
struct Opened {
    file: File,
    /// Its size when checked, and the most bytes to read from it.
    found: u64,
    limit: u64,
    path: std::path::PathBuf,
    what: String,
    /// What its size should have been, for the message.
    expected: String,
}

impl Opened {
    fn wrong_size(&self, found: u64) -> CheckpointError {
        CheckpointError::WrongSize {
            path: self.path.clone(),
            what: self.what.clone(),
            found,
            expected: self.expected.clone(),
        }
    }
}

/// The checks of [`read_untrusted`], up to the read.
fn open_untrusted(path: &Path, what: &str, size: Size) -> Result<Opened> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            // What O_NOFOLLOW answers for a symbolic link.
            Some(libc::ELOOP) => CheckpointError::NotRegularFile {
                path: path.to_path_buf(),
                kind: "symbolic link",
            },
            _ => CheckpointError::io(path)(e),
        })?;
    let metadata = file.metadata().map_err(CheckpointError::io(path))?;
    let kind = metadata.file_type();
    let irregular = [
        (kind.is_dir(), "directory"),
        (kind.is_fifo(), "FIFO"),
        (kind.is_char_device(), "character device"),
        (kind.is_block_device(), "block device"),
        (kind.is_socket(), "socket"),
        (!kind.is_file(), "special file"),
    ];
    if let Some((_, kind)) = irregular.into_iter().find(|(is, _)| *is) {
        return Err(CheckpointError::NotRegularFile {
            path: path.to_path_buf(),
            kind,
        });
    }
    let found = metadata.len();
    let (limit, fits, expected) = match size {
        Size::Exactly(n) => (
            n,
            found == n,
            format!("the manifest says {n} (truncated or overwritten)"),
        ),
        Size::AtMost(n) => (n, found <= n, format!("more than the {n} it may have")),
    };
    let opened = Opened {
        file,
        found,
        limit,
        path: path.to_path_buf(),
        what: what.to_string(),
        expected,
    };
    if !fits {
        return Err(opened.wrong_size(found));
    }
    Ok(opened)
}

/// Checks the size and checksum of `dir/<the entry's defined name>` against the manifest's
/// entry, as [`read_verified`] does, reading it in pieces: for files too large to hold (a
/// shard, during an export that reads only a part of it).
pub(crate) fn verify_streaming(dir: &Path, entry: &FileEntry) -> Result<()> {
    let path = dir.join(entry.defined_name());
    let mut opened = open_untrusted(&path, &entry.what(), Size::Exactly(entry.bytes))?;
    let mut hasher = crc32fast::Hasher::new();
    let mut read = 0u64;
    let mut buffer = vec![0u8; 1 << 20];
    let mut file = (&mut opened.file).take(opened.limit.saturating_add(1));
    loop {
        let n = file.read(&mut buffer).map_err(CheckpointError::io(&path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buffer[..n]);
        read += n as u64;
    }
    if read != opened.found {
        return Err(opened.wrong_size(read));
    }
    check_crc(&path, entry, hasher.finalize())
}

fn check_crc(path: &Path, entry: &FileEntry, crc: u32) -> Result<()> {
    if crc == entry.crc32 {
        return Ok(());
    }
    Err(CheckpointError::corrupt(
        path,
        format!(
            "{}: checksum mismatch (crc32 {crc:08x}, the manifest says {:08x})",
            entry.what(),
            entry.crc32
        ),
    ))
}

/// Reads `dir/<the entry's defined name>` and checks its size and checksum against the
/// manifest's entry. The name is the one the format defines for the entry, never a name
/// taken from the manifest, so no manifest can make this read outside `dir`.
pub(crate) fn read_verified(dir: &Path, entry: &FileEntry) -> Result<Vec<u8>> {
    let path = dir.join(entry.defined_name());
    let bytes = read_untrusted(&path, &entry.what(), Size::Exactly(entry.bytes))?;
    check_crc(&path, entry, fingerprint(&bytes).1)?;
    Ok(bytes)
}
