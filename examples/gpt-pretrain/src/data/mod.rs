//! Where the tokens come from, how they are cut into training windows, and which windows each
//! rank reads at each step.
//!
//! A corpus is one stream of tokens per split. Window `i` of a split is
//! `tokens[i·T .. i·T + T + 1]` (T = the context): its first T tokens are the inputs, its last
//! T the targets, so windows do not overlap except for one token.

mod loader;
pub mod shards;
pub mod synthetic;
pub mod text;
mod validation;

use std::path::PathBuf;

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

pub use loader::Loader;
use synthetic::MarkovChain;
use text::Tokenizer;
pub use validation::{EvalPlan, EvalWindows};

/// Where the corpus comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum Source {
    /// The seeded Markov chain of [`synthetic`].
    Synthetic {
        vocab: usize,
        successors: usize,
        tokens: usize,
        seed: u64,
    },
    /// A UTF-8 text file.
    Text { path: PathBuf, tokenizer: Tokenizer },
    /// llm.c/nanoGPT `.bin` shards (see [`shards`]).
    Shards { pattern: String },
}

/// The tokens of both splits.
pub struct Corpus {
    pub train: Vec<u16>,
    pub val: Vec<u16>,
    /// Tokens are below this.
    pub vocab_size: usize,
    /// One line for the log.
    pub description: String,
    /// The chain that generated a synthetic corpus (its entropy rate is the loss floor).
    pub chain: Option<MarkovChain>,
}

impl Corpus {
    /// Loads `source`; the last `val_fraction` of the tokens is held out for validation, unless
    /// shards name their own validation split.
    pub fn load(source: &Source, val_fraction: f64) -> Result<Corpus, String> {
        if !(0.0..1.0).contains(&val_fraction) || val_fraction == 0.0 {
            return Err(format!("--val-fraction {val_fraction}: must be in (0, 1)"));
        }
        let split = |mut tokens: Vec<u16>| {
            let val_len = ((tokens.len() as f64) * val_fraction).round() as usize;
            let val = tokens.split_off(tokens.len() - val_len);
            (tokens, val)
        };
        match source {
            Source::Synthetic {
                vocab,
                successors,
                tokens,
                seed,
            } => {
                let chain = MarkovChain::seeded(*vocab, *successors, *seed)?;
                let (train, val) = split(chain.sample(*tokens, *seed));
                Ok(Corpus {
                    description: format!(
                        "synthetic Markov chain: {vocab} tokens, {successors} successors each, seed {seed}, {} train + {} validation tokens",
                        train.len(),
                        val.len()
                    ),
                    train,
                    val,
                    vocab_size: *vocab,
                    chain: Some(chain),
                })
            }
            Source::Text { path, tokenizer } => {
                let (train, val) = split(text::read_text(path, *tokenizer)?);
                Ok(Corpus {
                    description: format!(
                        "{} ({tokenizer:?} tokens): {} train + {} validation tokens",
                        path.display(),
                        train.len(),
                        val.len()
                    ),
                    train,
                    val,
                    vocab_size: tokenizer.vocab_size(),
                    chain: None,
                })
            }
            Source::Shards { pattern } => {
                let files = shards::resolve(pattern)?;
                let (mut train, mut val) = (Vec::new(), Vec::new());
                for file in &files {
                    let tokens = shards::read_shard(file)?;
                    if let Some(&bad) = tokens
                        .iter()
                        .find(|&&t| usize::from(t) >= Tokenizer::Gpt2.vocab_size())
                    {
                        return Err(format!(
                            "{}: token {bad} is outside GPT-2's vocabulary of {}",
                            file.display(),
                            Tokenizer::Gpt2.vocab_size()
                        ));
                    }
                    if shards::is_validation(file) {
                        &mut val
                    } else {
                        &mut train
                    }
                    .extend(tokens);
                }
                if val.is_empty() {
                    (train, val) = split(train);
                }
                Ok(Corpus {
                    description: format!(
                        "{} shard(s) {pattern}: {} train + {} validation tokens",
                        files.len(),
                        train.len(),
                        val.len()
                    ),
                    train,
                    val,
                    vocab_size: Tokenizer::Gpt2.vocab_size(),
                    chain: None,
                })
            }
        }
    }

    /// The best loss any model can reach, in nats per token, when it is known exactly.
    pub fn floor(&self) -> Option<f64> {
        self.chain.as_ref().map(MarkovChain::entropy_rate)
    }
}

/// Windows of `seq + 1` tokens in a split of `len` tokens.
pub fn window_count(len: usize, seq: usize) -> usize {
    len.saturating_sub(1) / seq
}

/// The tokens of windows `indices` of `tokens`: inputs and targets, `[indices.len(), seq]`.
pub fn batch<B: Backend>(
    tokens: &[u16],
    seq: usize,
    indices: &[usize],
    device: &B::Device,
) -> (Tensor<B, 2, Int>, Tensor<B, 2, Int>) {
    let mut inputs = Vec::with_capacity(indices.len() * seq);
    let mut targets = Vec::with_capacity(indices.len() * seq);
    for &i in indices {
        let window = &tokens[i * seq..i * seq + seq + 1];
        inputs.extend(window[..seq].iter().map(|&t| i64::from(t)));
        targets.extend(window[1..].iter().map(|&t| i64::from(t)));
    }
    let shape = [indices.len(), seq];
    (
        Tensor::from_data(TensorData::new(inputs, shape), device),
        Tensor::from_data(TensorData::new(targets, shape), device),
    )
}
