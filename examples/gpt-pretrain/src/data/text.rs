//! Any UTF-8 text file as a corpus, tokenized with GPT-2's BPE (tiktoken's `r50k_base`, the
//! encoding of GPT-2; its vocabulary ships inside the `tiktoken-rs` crate, so no download) or
//! as raw bytes (256 tokens: no tokenizer at all, handy for small files and tiny models).

use std::path::Path;

use clap::ValueEnum;

/// How text becomes tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Tokenizer {
    /// GPT-2's byte-pair encoding (50257 tokens).
    Gpt2,
    /// One token per byte (256 tokens).
    Bytes,
}

impl Tokenizer {
    pub fn vocab_size(self) -> usize {
        match self {
            Tokenizer::Gpt2 => 50257,
            Tokenizer::Bytes => 256,
        }
    }

    pub fn encode(self, text: &str) -> Result<Vec<u16>, String> {
        match self {
            Tokenizer::Bytes => Ok(text.bytes().map(u16::from).collect()),
            Tokenizer::Gpt2 => {
                let bpe = tiktoken_rs::r50k_base()
                    .map_err(|e| format!("loading GPT-2's BPE tables: {e}"))?;
                // Every GPT-2 token id is below 50257, so it fits in u16.
                Ok(bpe
                    .encode_ordinary(text)
                    .into_iter()
                    .map(|t| t as u16)
                    .collect())
            }
        }
    }
}

/// The tokens of the UTF-8 text file at `path`.
pub fn read_text(path: &Path, tokenizer: Tokenizer) -> Result<Vec<u16>, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("--text {}: {e}", path.display()))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        format!(
            "--text {}: not UTF-8 (invalid byte at offset {})",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })?;
    tokenizer.encode(&text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_bpe_gives_gpt2_ids() {
        // "Hello world" is [15496, 995] in GPT-2's vocabulary.
        assert_eq!(
            Tokenizer::Gpt2.encode("Hello world").unwrap(),
            vec![15496, 995]
        );
        assert_eq!(Tokenizer::Bytes.encode("Hé").unwrap(), vec![72, 0xC3, 0xA9]);
    }

    #[test]
    fn invalid_utf8_is_reported_with_the_file_and_offset() {
        let path = std::env::temp_dir().join(format!("gpt-text-{}.txt", std::process::id()));
        std::fs::write(&path, b"abc\xffdef").unwrap();
        let error = read_text(&path, Tokenizer::Bytes).unwrap_err();
        assert!(
            error.contains("not UTF-8") && error.contains("offset 3"),
            "{error}"
        );
        std::fs::remove_file(&path).unwrap();
    }
}
