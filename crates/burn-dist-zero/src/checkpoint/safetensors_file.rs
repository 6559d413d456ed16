//! safetensors files written the same byte for byte each time: the same tensors and metadata
//! give the same file in any process.
//!
//! The `safetensors` crate writes the header's `__metadata__` in the iteration order of a
//! `HashMap`, whose hasher is seeded anew in each process: two processes writing the same
//! checkpoint (the library and `burn-dist-ckpt`, a run and its rerun) wrote headers that
//! differed in the order of `producer` and `step`, and so files whose checksums differed. Each
//! file is serialized by the crate and its header then rewritten with every key in sorted order.
//! The rewritten header holds the same keys and values, so it has the same length and the data
//! offsets stay as they are; readers (this crate's, Python's) look tensors up by name.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Display;
use std::fs::OpenOptions;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

use safetensors::tensor::View;

/// The bytes of a safetensors file holding `tensors` and `metadata`, its header canonical.
pub(crate) fn serialize<S: AsRef<str> + Ord + Display, V: View>(
    tensors: impl IntoIterator<Item = (S, V)>,
    metadata: HashMap<String, String>,
) -> Result<Vec<u8>, String> {
    let mut bytes = safetensors::serialize(tensors, Some(metadata)).map_err(|e| e.to_string())?;
    let header = header_range(&bytes)?;
    canonicalize(&mut bytes[header])?;
    Ok(bytes)
}

/// Writes the safetensors file `path` holding `tensors` and `metadata`, streaming the tensors
/// from their views, then makes its header canonical in place.
pub(crate) fn serialize_to_file<S: AsRef<str> + Ord + Display, V: View>(
    tensors: impl IntoIterator<Item = (S, V)>,
    metadata: HashMap<String, String>,
    path: &Path,
) -> Result<(), String> {
    safetensors::serialize_to_file(tensors, Some(metadata), path).map_err(|e| e.to_string())?;
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| e.to_string())?;
    let mut length = [0u8; 8];
    file.read_exact(&mut length).map_err(|e| e.to_string())?;
    let mut header = vec![0u8; header_length(length)?];
    file.read_exact(&mut header).map_err(|e| e.to_string())?;
    canonicalize(&mut header)?;
    file.seek(SeekFrom::Start(8)).map_err(|e| e.to_string())?;
    file.write_all(&header).map_err(|e| e.to_string())
}

/// Where the header lies in a safetensors file's `bytes`.
fn header_range(bytes: &[u8]) -> Result<std::ops::Range<usize>, String> {
    let length = bytes
        .first_chunk::<8>()
        .ok_or("a safetensors file shorter than its header's length")?;
    let end = 8 + header_length(*length)?;
    if end > bytes.len() {
        return Err("a safetensors header longer than its file".into());
    }
    Ok(8..end)
}

fn header_length(length: [u8; 8]) -> Result<usize, String> {
    usize::try_from(u64::from_le_bytes(length)).map_err(|e| e.to_string())
}

/// A header's JSON with its keys in sorted order: the metadata's explicitly (it is the map
/// whose order varies), each tensor's entry as `safetensors` wrote it.
#[derive(serde::Serialize, serde::Deserialize)]
struct Header {
    #[serde(
        rename = "__metadata__",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    metadata: Option<BTreeMap<String, String>>,
    #[serde(flatten)]
    tensors: BTreeMap<String, serde_json::Value>,
}

/// Rewrites `header` (JSON padded with spaces) with its keys sorted, padded to the same length.
fn canonicalize(header: &mut [u8]) -> Result<(), String> {
    let parsed: Header = serde_json::from_slice(header).map_err(|e| e.to_string())?;
    let mut canonical = serde_json::to_vec(&parsed).map_err(|e| e.to_string())?;
    if canonical.len() > header.len() {
        return Err(format!(
            "the canonical header ({} bytes) is longer than the one written ({} bytes)",
            canonical.len(),
            header.len()
        ));
    }
    canonical.resize(header.len(), b' ');
    header.copy_from_slice(&canonical);
    Ok(())
}

#[cfg(test)]
mod tests {
    use safetensors::SafeTensors;
    use safetensors::tensor::{Dtype, TensorView};

    use super::*;

    fn file(metadata: &[(&str, &str)]) -> Vec<u8> {
        let (a, b) = ([1f32, 2.0], [3f32]);
        let views = [
            (
                "b",
                TensorView::new(Dtype::F32, vec![1], bytemuck::cast_slice(&b)).unwrap(),
            ),
            (
                "a",
                TensorView::new(Dtype::F32, vec![2], bytemuck::cast_slice(&a)).unwrap(),
            ),
        ];
        let metadata = metadata
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        serialize(views, metadata).unwrap()
    }

    #[test]
    fn the_metadata_is_written_in_sorted_order_whatever_the_maps_order() {
        let pairs = [
            ("step", "12"),
            ("producer", "burn-dist"),
            ("adam_steps", "[1]"),
        ];
        // Maps built in several orders, each with a hasher seeded apart: one file.
        let first = file(&pairs);
        for rotation in 1..pairs.len() {
            let mut rotated = pairs;
            rotated.rotate_left(rotation);
            assert_eq!(file(&rotated), first);
        }
        let header = std::str::from_utf8(&first[header_range(&first).unwrap()]).unwrap();
        let (adam, producer, step) = (
            header.find("adam_steps").unwrap(),
            header.find("producer").unwrap(),
            header.find("\"step\"").unwrap(),
        );
        assert!(adam < producer && producer < step, "{header}");
    }

    #[test]
    fn a_header_is_rewritten_sorted_at_its_length() {
        let written = r#"{"__metadata__":{"step":"1","producer":"p"},"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
        let mut header = format!("{written}   ").into_bytes();
        canonicalize(&mut header).unwrap();
        let header = String::from_utf8(header).unwrap();
        assert_eq!(header.len(), written.len() + 3);
        assert!(
            header.starts_with(r#"{"__metadata__":{"producer":"p","step":"1"},"b":"#),
            "{header}"
        );
    }

    #[test]
    fn the_canonical_file_reads_back_the_same_tensors_and_metadata() {
        let bytes = file(&[("step", "3"), ("producer", "burn-dist")]);
        let (_, metadata) = SafeTensors::read_metadata(&bytes).unwrap();
        let metadata = metadata.metadata().clone().unwrap();
        assert_eq!(metadata["step"], "3");
        assert_eq!(metadata["producer"], "burn-dist");
        let tensors = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(
            tensors.tensor("a").unwrap().data(),
            bytemuck::cast_slice::<f32, u8>(&[1f32, 2.0])
        );
        assert_eq!(
            tensors.tensor("b").unwrap().data(),
            bytemuck::cast_slice::<f32, u8>(&[3f32])
        );
    }

    #[test]
    fn the_file_written_in_place_equals_the_bytes_in_memory() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.safetensors");
        let a = [1f32, 2.0];
        let views = [(
            "a",
            TensorView::new(Dtype::F32, vec![2], bytemuck::cast_slice(&a)).unwrap(),
        )];
        let metadata: HashMap<_, _> = [("step", "1"), ("producer", "p"), ("z", "last")]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        serialize_to_file(views.clone(), metadata.clone(), &path).unwrap();
        assert_eq!(
            std::fs::read(&path).unwrap(),
            serialize(views, metadata).unwrap()
        );
    }
}
