//! Durable, atomic file writes and verified reads.

use std::fs::{self, File};
use std::io::Write;
use std::path::Path;

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
    let path = dir.join(name);
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let written = (|| {
        let mut file = File::create(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()
    })();
    if let Err(source) = written {
        let _ = fs::remove_file(&tmp);
        return Err(CheckpointError::Io { path, source });
    }
    fs::rename(&tmp, &path).map_err(CheckpointError::io(&path))?;
    sync_dir(dir)
}

/// Makes the directory's entries (creations, renames, removals) durable.
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(CheckpointError::io(dir))
}

/// Reads `dir/entry.name` and checks its size and checksum against the manifest's entry.
pub(crate) fn read_verified(dir: &Path, entry: &FileEntry) -> Result<Vec<u8>> {
    let path = dir.join(&entry.name);
    let bytes = fs::read(&path).map_err(CheckpointError::io(&path))?;
    let (size, crc) = fingerprint(&bytes);
    if size != entry.bytes {
        return Err(CheckpointError::corrupt(
            &path,
            format!(
                "{} is {size} bytes, the manifest says {} (truncated or overwritten)",
                entry.what(),
                entry.bytes
            ),
        ));
    }
    if crc != entry.crc32 {
        return Err(CheckpointError::corrupt(
            &path,
            format!(
                "{}: checksum mismatch (crc32 {crc:08x}, the manifest says {:08x})",
                entry.what(),
                entry.crc32
            ),
        ));
    }
    Ok(bytes)
}
