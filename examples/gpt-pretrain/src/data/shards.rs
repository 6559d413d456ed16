//! Pre-tokenized shards in the format of llm.c and nanoGPT's FineWeb scripts: a header of 256
//! little-endian i32 (`[0]` = magic 20240520, `[1]` = version 1, `[2]` = token count, the rest
//! zero), then the tokens as little-endian u16.
//!
//! `--shards` takes a directory (every `*.bin` in it) or a path whose file name has `*`/`?`
//! wildcards (`data/fineweb_train_*.bin`). Files whose name contains `val` form the validation
//! split, as in llm.c's naming (`fineweb_val_000000.bin`).

use std::path::{Path, PathBuf};

pub const MAGIC: i32 = 20240520;
pub const VERSION: i32 = 1;
pub const HEADER_BYTES: usize = 256 * 4;

/// Reads the header of a shard and returns its token count; `path` only names the file in
/// errors.
pub fn parse_header(path: &Path, bytes: &[u8]) -> Result<usize, String> {
    let name = path.display();
    if bytes.len() < HEADER_BYTES {
        return Err(format!(
            "{name}: {} bytes, shorter than the {HEADER_BYTES}-byte header of a token shard",
            bytes.len()
        ));
    }
    let word = |i: usize| i32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().expect("4 bytes"));
    if word(0) != MAGIC {
        return Err(format!(
            "{name}: bad magic number {} (a token shard starts with {MAGIC}); is it an llm.c/nanoGPT .bin shard?",
            word(0)
        ));
    }
    if word(1) != VERSION {
        return Err(format!(
            "{name}: version {} is not supported (only version {VERSION}: u16 tokens)",
            word(1)
        ));
    }
    let count = usize::try_from(word(2))
        .map_err(|_| format!("{name}: negative token count {} in the header", word(2)))?;
    let expected = HEADER_BYTES + 2 * count;
    if bytes.len() != expected {
        return Err(format!(
            "{name}: the header announces {count} tokens ({expected} bytes in all) but the file has {} bytes{}",
            bytes.len(),
            if bytes.len() < expected {
                " (truncated?)"
            } else {
                ""
            }
        ));
    }
    Ok(count)
}

/// The tokens of the shard at `path`.
pub fn read_shard(path: &Path) -> Result<Vec<u16>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let count = parse_header(path, &bytes)?;
    Ok(bytes[HEADER_BYTES..HEADER_BYTES + 2 * count]
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect())
}

/// The shard files that `pattern` names, sorted: every `*.bin` of a directory, or the files
/// matching a file-name pattern with `*` and `?`.
pub fn resolve(pattern: &str) -> Result<Vec<PathBuf>, String> {
    let path = Path::new(pattern);
    let (dir, name_pattern) = if path.is_dir() {
        (path.to_path_buf(), "*.bin".to_string())
    } else {
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| format!("--shards {pattern}: not a directory or a file pattern"))?;
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        (dir, name.to_string())
    };
    let entries = std::fs::read_dir(&dir)
        .map_err(|e| format!("--shards {pattern}: cannot list {}: {e}", dir.display()))?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .filter(|e| e.path().is_file())
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| matches(&name_pattern, n))
        })
        .map(|e| e.path())
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(format!("--shards {pattern}: no file matches"));
    }
    Ok(files)
}

/// Whether `name` matches `pattern`, where `*` is any run of characters and `?` any one.
pub fn matches(pattern: &str, name: &str) -> bool {
    fn go(p: &[char], n: &[char]) -> bool {
        match p.split_first() {
            None => n.is_empty(),
            Some(('*', rest)) => (0..=n.len()).any(|k| go(rest, &n[k..])),
            Some(('?', rest)) => !n.is_empty() && go(rest, &n[1..]),
            Some((c, rest)) => n.first() == Some(c) && go(rest, &n[1..]),
        }
    }
    let p: Vec<char> = pattern.chars().collect();
    let n: Vec<char> = name.chars().collect();
    go(&p, &n)
}

/// Whether a shard belongs to the validation split (llm.c names them `*_val_*`).
pub fn is_validation(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.contains("val"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(tokens: &[u16], header_count: i32, magic: i32, version: i32) -> Vec<u8> {
        let mut header = [0i32; 256];
        header[..3].copy_from_slice(&[magic, version, header_count]);
        let mut bytes: Vec<u8> = header.iter().flat_map(|w| w.to_le_bytes()).collect();
        bytes.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
        bytes
    }

    #[test]
    fn a_good_shard_is_read_and_bad_ones_are_named() {
        let dir = std::env::temp_dir().join(format!("gpt-shards-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("train_000.bin");
        std::fs::write(&good, shard(&[5, 50256, 0], 3, MAGIC, VERSION)).unwrap();
        assert_eq!(read_shard(&good).unwrap(), vec![5, 50256, 0]);

        let cases = [
            (
                "magic.bin",
                shard(&[1], 1, 1234, VERSION),
                "bad magic number 1234",
            ),
            (
                "version.bin",
                shard(&[1], 1, MAGIC, 2),
                "version 2 is not supported",
            ),
            (
                "short.bin",
                shard(&[1, 2], 3, MAGIC, VERSION),
                "announces 3 tokens",
            ),
            (
                "long.bin",
                shard(&[1, 2], 1, MAGIC, VERSION),
                "announces 1 tokens",
            ),
            (
                "negative.bin",
                shard(&[], -1, MAGIC, VERSION),
                "negative token count",
            ),
            (
                "tiny.bin",
                vec![0; 100],
                "shorter than the 1024-byte header",
            ),
        ];
        for (name, bytes, message) in cases {
            let path = dir.join(name);
            std::fs::write(&path, bytes).unwrap();
            let error = read_shard(&path).unwrap_err();
            assert!(error.contains(name) && error.contains(message), "{error}");
        }
        assert!(
            read_shard(&short_truncated(&dir))
                .unwrap_err()
                .contains("truncated")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn short_truncated(dir: &Path) -> PathBuf {
        let path = dir.join("cut.bin");
        let bytes = shard(&[1, 2, 3, 4], 4, MAGIC, VERSION);
        std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
        path
    }

    #[test]
    fn patterns_select_shards_and_name_the_validation_split() {
        assert!(matches("fineweb_train_*.bin", "fineweb_train_000001.bin"));
        assert!(!matches("fineweb_train_*.bin", "fineweb_val_000000.bin"));
        assert!(matches("shard_??.bin", "shard_07.bin"));
        assert!(!matches("shard_??.bin", "shard_7.bin"));
        assert!(matches("*", ""));
        assert!(is_validation(Path::new("d/fineweb_val_000000.bin")));
        assert!(!is_validation(Path::new("d/fineweb_train_000001.bin")));
        let missing = resolve("/nonexistent-dir/x_*.bin").unwrap_err();
        assert!(missing.contains("/nonexistent-dir"), "{missing}");
    }
}
