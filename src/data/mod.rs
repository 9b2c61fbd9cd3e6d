//! Data layer: token sources (byte-level text, Hugging Face `tokenizer.json`,
//! llm.c `.bin` shards), the train/validation split, the shipped corpus, and
//! the deterministic, resumable, world-size-independent batch sampler.
//!
//! The entry point is [`load`], which turns a file or directory into a
//! [`Dataset`]; [`Sampler`] then serves training windows from `Dataset::train`
//! and [`val_batches`] builds a fixed validation set from `Dataset::val`.

mod codec;
mod error;
mod load;
mod sampler;
mod shard;

#[cfg(test)]
mod tests;

use std::path::PathBuf;

pub use codec::{decode_bytes, describe_record, tokenizer_record, Codec, BYTE_VOCAB_SIZE};
pub use error::DataError;
pub use load::load;
pub use sampler::{val_batches, Sampler, SamplerState, TokenBatch};
pub use shard::{read_bin_shard, write_bin_shard, ShardFormat, SHARD_HEADER_INTS};

/// File name of the shipped corpus inside `data/corpus/`.
pub const DEFAULT_CORPUS_FILE: &str = "austen.txt";

/// Default share of the token stream held out for validation.
pub const DEFAULT_VAL_FRACTION: f64 = 0.05;

/// Token streams ready for training.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dataset {
    /// Training tokens, in stream order.
    pub train: Vec<u32>,
    /// Validation tokens, in stream order.
    pub val: Vec<u32>,
    /// Every token is `< vocab_size`.
    pub vocab_size: usize,
    /// Human-readable description of where the tokens came from.
    pub source: String,
}

/// Path of the shipped English corpus (Jane Austen's six novels, public domain).
pub fn default_corpus_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data").join("corpus").join(DEFAULT_CORPUS_FILE)
}
