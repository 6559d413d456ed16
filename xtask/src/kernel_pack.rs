//! The kernel pack of the device check: cubecl's compiled kernels, its autotune results and
//! the driver's own cache, which `run.sh` packs on the GPU machine (in parts of at most 15 MiB
//! under `$OUT/kernel-pack/`) and a later call unpacks before its first check, so that it
//! does not compile and tune cold again (docs/gpu.md, "The kernel pack").
//!
//! cubecl keys a compiled kernel by its type's name and launch settings, not by its source:
//! a pack carried across a commit that edits a kernel would load the old PTX. So the pack is
//! tagged with what it was built from, and `run.sh` drops what no longer matches:
//! - `kernels=`: a SHA-256 of the sources of every crate of this workspace that defines
//!   CubeCL kernels ([`KERNEL_CRATES`]);
//! - `lock=`: a SHA-256 of Cargo.lock (the versions of Burn's and cubecl's own kernels);
//! - `cc=`: the GPU's compute capability, which only the GPU machine knows.
//!
//! `cargo xtask gpu-check` writes the first two into `target-gpu/build-tag` beside the binary
//! and says whether the committed pack ([`COMMITTED`]) matches; `cargo xtask gpu-check
//! --import-pack DIR` checks a returned pack and puts it there, to be committed.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// The crates whose sources hold CubeCL kernels (`#[cube`): a change to any of their files
/// changes the `kernels=` tag. A test keeps this list complete.
pub const KERNEL_CRATES: [&str; 2] = ["crates/burn-dist-kernels", "crates/burn-dist-device"];
/// Where the pack is committed; `run.sh` finds it there in the checkout that travels with every
/// device call.
pub const COMMITTED: &str = "crates/burn-dist-gpu-check/kernel-pack";
/// The largest part the device tool returns is 16 MiB; run.sh writes parts of 15.
const PART_BYTES: u64 = 15 << 20;

/// `kernels=<hash>\nlock=<hash>\n` for the tree at `root`.
pub fn build_tag(root: &Path) -> Result<String, String> {
    let lock = std::fs::read(root.join("Cargo.lock"))
        .map_err(|e| format!("cannot read {}: {e}", root.join("Cargo.lock").display()))?;
    Ok(format!(
        "kernels={}\nlock={}\n",
        kernels_hash(root)?,
        hex(&Sha256::digest(&lock))
    ))
}

/// The SHA-256 of the kernel crates' `src/` trees: every file's path (relative to `root`) and
/// contents, in path order.
fn kernels_hash(root: &Path) -> Result<String, String> {
    let mut files = Vec::new();
    for krate in KERNEL_CRATES {
        collect_files(&root.join(krate).join("src"), &mut files)?;
    }
    files.sort();
    let mut hash = Sha256::new();
    for file in &files {
        let relative = file.strip_prefix(root).unwrap_or(file);
        let bytes =
            std::fs::read(file).map_err(|e| format!("cannot read {}: {e}", file.display()))?;
        hash.update(relative.to_string_lossy().as_bytes());
        hash.update([0]);
        hash.update((bytes.len() as u64).to_le_bytes());
        hash.update(&bytes);
    }
    Ok(hex(&hash.finalize()))
}

fn collect_files(dir: &Path, files: &mut Vec<PathBuf>) -> Result<(), String> {
    let entries =
        std::fs::read_dir(dir).map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
    for entry in entries {
        let path = entry
            .map_err(|e| format!("cannot list {}: {e}", dir.display()))?
            .path();
        if path.is_dir() {
            collect_files(&path, files)?;
        } else {
            files.push(path);
        }
    }
    Ok(())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A pack's TAG, as its `key=value` lines.
#[derive(Debug)]
pub struct Tag(Vec<(String, String)>);

impl Tag {
    pub fn read(pack: &Path) -> Result<Tag, String> {
        let path = pack.join("TAG");
        let text = std::fs::read_to_string(&path)
            .map_err(|e| format!("{}: {e} (is this a kernel pack?)", path.display()))?;
        Ok(Tag(text
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()))
    }

    pub fn get(&self, key: &str) -> &str {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map_or("unknown", |(_, v)| v.as_str())
    }
}

/// What `run.sh` will take from the pack at `pack` for a binary of `build_tag` (the compute
/// capability aside, which only the GPU knows): one line for the developer.
pub fn status(pack: &Path, build_tag: &str) -> String {
    let tag = match Tag::read(pack) {
        Ok(tag) => tag,
        Err(_) => {
            return format!(
                "no kernel pack committed in {COMMITTED}: the first call compiles and tunes cold"
            );
        }
    };
    let built = |key: &str| {
        build_tag
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{key}=")))
            .unwrap_or("unknown")
            .to_string()
    };
    let what = format!(
        "made {} on {} (cc {}), {}",
        tag.get("made"),
        tag.get("gpu"),
        tag.get("cc"),
        tag.get("contents")
    );
    if tag.get("lock") != built("lock") {
        format!(
            "kernel pack in {COMMITTED} ({what}) was made with another Cargo.lock: run.sh will use \
             only its driver cache"
        )
    } else if tag.get("kernels") != built("kernels") {
        format!(
            "kernel pack in {COMMITTED} ({what}) was made from other kernel sources: run.sh will \
             drop its compiled kernels and use its autotune results and driver cache"
        )
    } else {
        format!(
            "kernel pack in {COMMITTED} ({what}) matches this build: run.sh will use all of it on \
             a GPU of compute capability {}",
            tag.get("cc")
        )
    }
}

/// Checks the pack a device call returned in `from` (its TAG and parts: their count, sizes and
/// SHA-256) and copies it into `to`, replacing what was there. Returns a line saying what it
/// holds.
pub fn import(from: &Path, to: &Path) -> Result<String, String> {
    let tag = Tag::read(from)?;
    let mut parts: Vec<PathBuf> = std::fs::read_dir(from)
        .map_err(|e| format!("cannot list {}: {e}", from.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("part-"))
        })
        .collect();
    parts.sort();
    if parts.len().to_string() != tag.get("parts") {
        return Err(format!(
            "{}: {} parts, its TAG says {}: the pack is incomplete (a file left out on the way back?)",
            from.display(),
            parts.len(),
            tag.get("parts")
        ));
    }
    let mut hash = Sha256::new();
    for part in &parts {
        let bytes =
            std::fs::read(part).map_err(|e| format!("cannot read {}: {e}", part.display()))?;
        if bytes.len() as u64 > PART_BYTES {
            return Err(format!(
                "{}: {} bytes, more than the {} MiB a part may hold",
                part.display(),
                bytes.len(),
                PART_BYTES >> 20
            ));
        }
        hash.update(&bytes);
    }
    let sha = hex(&hash.finalize());
    if sha != tag.get("sha256") {
        return Err(format!(
            "{}: the parts' SHA-256 is {sha}, its TAG says {}: the pack is damaged",
            from.display(),
            tag.get("sha256")
        ));
    }
    if to.exists() {
        std::fs::remove_dir_all(to).map_err(|e| format!("cannot clear {}: {e}", to.display()))?;
    }
    std::fs::create_dir_all(to).map_err(|e| format!("cannot create {}: {e}", to.display()))?;
    for file in parts.iter().chain([&from.join("TAG")]) {
        let name = file.file_name().expect("a file name");
        std::fs::copy(file, to.join(name))
            .map_err(|e| format!("cannot copy {} into {}: {e}", file.display(), to.display()))?;
    }
    Ok(format!(
        "{} parts, {} (made {} on {}, cc {})",
        parts.len(),
        tag.get("contents"),
        tag.get("made"),
        tag.get("gpu"),
        tag.get("cc")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every workspace crate whose sources hold `#[cube` is in [`KERNEL_CRATES`], so that a new
    /// kernel elsewhere cannot be left out of the tag.
    #[test]
    fn every_crate_with_cube_kernels_is_tagged() {
        let root = crate::workspace_root();
        let mut with_kernels = Vec::new();
        for group in ["crates", "examples"] {
            for entry in std::fs::read_dir(root.join(group)).unwrap() {
                let krate = entry.unwrap().path();
                let mut files = Vec::new();
                if collect_files(&krate.join("src"), &mut files).is_err() {
                    continue;
                }
                let kernels = files.iter().any(|f| {
                    f.extension().is_some_and(|e| e == "rs")
                        && std::fs::read_to_string(f).is_ok_and(|t| t.contains("#[cube"))
                });
                if kernels {
                    let relative = krate.strip_prefix(&root).unwrap().display().to_string();
                    with_kernels.push(relative);
                }
            }
        }
        with_kernels.sort();
        let mut tagged: Vec<String> = KERNEL_CRATES.iter().map(|s| s.to_string()).collect();
        tagged.sort();
        assert_eq!(with_kernels, tagged);
    }

    /// A tree with the kernel crates and a Cargo.lock.
    fn tree() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for krate in KERNEL_CRATES {
            write(dir.path(), &format!("{krate}/src/lib.rs"), "// kernels");
        }
        write(dir.path(), "Cargo.lock", "version = 4");
        dir
    }

    /// The tag changes with any kernel source and with Cargo.lock, and with nothing else.
    #[test]
    fn the_build_tag_follows_the_kernel_sources_and_the_lock() {
        let dir = tree();
        let first = build_tag(dir.path()).unwrap();
        write(dir.path(), "crates/burn-dist/src/lib.rs", "// not kernels");
        assert_eq!(build_tag(dir.path()).unwrap(), first);
        write(
            dir.path(),
            "crates/burn-dist-device/src/copy.rs",
            "// a kernel",
        );
        let edited = build_tag(dir.path()).unwrap();
        assert_ne!(edited, first);
        assert_eq!(
            edited.lines().nth(1),
            first.lines().nth(1),
            "the lock is the same"
        );
        write(dir.path(), "Cargo.lock", "version = 4\n# bumped");
        let bumped = build_tag(dir.path()).unwrap();
        assert_eq!(bumped.lines().next(), edited.lines().next());
        assert_ne!(bumped.lines().nth(1), edited.lines().nth(1));
    }

    /// A returned pack is imported only whole: its parts' count and hash as its TAG says.
    #[test]
    fn a_pack_is_imported_only_when_its_parts_match_its_tag() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "from/part-00", "abc");
        write(dir.path(), "from/part-01", "def");
        let sha = hex(&Sha256::digest(b"abcdef"));
        let tag = format!("kernels=k\nlock=l\ncc=9.0\ncontents=autotune\nparts=2\nsha256={sha}\n");
        write(dir.path(), "from/TAG", &tag);
        let (from, to) = (dir.path().join("from"), dir.path().join("to"));
        write(dir.path(), "to/part-07", "stale");
        let said = import(&from, &to).unwrap();
        assert!(said.starts_with("2 parts, autotune"), "{said}");
        let mut names: Vec<String> = std::fs::read_dir(&to)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, ["TAG", "part-00", "part-01"]);
        write(dir.path(), "from/part-01", "xyz");
        let damaged = import(&from, &to).unwrap_err();
        assert!(damaged.contains("damaged"), "{damaged}");
        std::fs::remove_file(from.join("part-01")).unwrap();
        let incomplete = import(&from, &to).unwrap_err();
        assert!(
            incomplete.contains("1 parts, its TAG says 2"),
            "{incomplete}"
        );
    }

    fn write(dir: &Path, relative: &str, text: &str) {
        let path = dir.join(relative);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }
}
