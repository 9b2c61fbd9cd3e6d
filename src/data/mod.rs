//! Data layer: token sources (text, JSON lines, Parquet, llm.c `.bin` shards, folders of
//! them; byte-level or a Hugging Face `tokenizer.json`), the token cache every rank maps, the
//! train/validation split, the shipped corpus, and the deterministic, resumable,
//! world-size-independent batch sampler.
//!
//! The entry point is [`load_with`], which turns a file or directory into a [`Dataset`]
//! (through the token cache when given a cache folder); [`Sampler`] then serves training
//! windows from `Dataset::train` and [`val_batches`] the fixed validation set from
//! `Dataset::val`.

mod atomic;
mod build;
mod cache;
mod codec;
mod docs;
mod error;
mod load;
mod parquet;
mod sampler;
mod shard;
mod source;
mod tokens;

#[cfg(test)]
mod cache_tests;
#[cfg(test)]
mod format_tests;
#[cfg(test)]
mod tests;

use std::path::PathBuf;

pub use cache::CacheUse;
pub use codec::{decode_bytes, describe_record, tokenizer_record, Codec, BYTE_END_OF_TEXT, BYTE_VOCAB_SIZE, END_OF_TEXT_NAMES};
pub use error::DataError;
pub use load::{load, load_with, LoadOptions, DEFAULT_TEXT_FIELD};
pub use sampler::{val_batches, Sampler, SamplerState, TokenBatch, ValBatches, VAL_BATCHES_MAX};
pub use shard::{read_bin_shard, write_bin_shard, ShardFormat, SHARD_HEADER_INTS};
pub use source::ACCEPTED_FORMATS;
pub use tokens::Tokens;

/// File name of the shipped corpus inside `data/corpus/`.
pub const DEFAULT_CORPUS_FILE: &str = "austen.txt";

/// Default share of the token stream held out for validation.
pub const DEFAULT_VAL_FRACTION: f64 = 0.05;

/// Token streams ready for training.
#[derive(Debug, Clone)]
pub struct Dataset {
    /// Training tokens, in stream order.
    pub train: Tokens,
    /// Validation tokens, in stream order.
    pub val: Tokens,
    /// Every token is `< vocab_size`.
    pub vocab_size: usize,
    /// Human-readable description of where the tokens came from.
    pub source: String,
    /// Whether the tokens came from the token cache.
    pub cache: CacheUse,
    /// blake3 of the training then validation tokens (u32 little-endian).
    blake3: blake3::Hash,
}

impl Dataset {
    /// A dataset of tokens already in memory.
    pub fn from_tokens(train: Vec<u32>, val: Vec<u32>, vocab_size: usize, source: String) -> Dataset {
        let mut h = blake3::Hasher::new();
        build::hash_tokens(&mut h, &train);
        build::hash_tokens(&mut h, &val);
        Dataset { train: train.into(), val: val.into(), vocab_size, source, cache: CacheUse::Off, blake3: h.finalize() }
    }

    /// blake3 of the training then validation tokens (u32 little-endian), computed once when
    /// the tokens were built (and checked against the cache file when they came from it).
    pub fn tokens_blake3(&self) -> blake3::Hash {
        self.blake3
    }

    /// What a checkpoint records of the data it was trained on: where the tokens came from,
    /// how many there are, and their blake3 (training then validation tokens, u32 little-endian),
    /// so that a resume on other data is noticed.
    pub fn record(&self) -> serde_json::Value {
        serde_json::json!({
            "source": self.source,
            "tokens": self.train.len() + self.val.len(),
            "blake3": self.blake3.to_hex().to_string(),
        })
    }
}

/// Tessera's cache folder: `$XDG_CACHE_HOME/tessera`, else `~/.cache/tessera`, else one in
/// the temporary folder.
pub fn default_cache_dir() -> PathBuf {
    std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("tessera")
}

/// Default folder of the token cache: `tokens/` in [`default_cache_dir`].
pub fn default_token_cache_dir() -> PathBuf {
    default_cache_dir().join("tokens")
}

/// The shipped corpus, compiled in, so a binary run away from the source tree it was built
/// from (`cargo install`, a copy on another machine) still has its default data.
static EMBEDDED_CORPUS: &[u8] = include_bytes!("../../data/corpus/austen.txt");

/// Path of the shipped English corpus (Jane Austen's six novels, public domain): the source
/// tree's `data/corpus/austen.txt` when it is there, else the compiled-in copy written once to
/// the user's cache folder ([`embedded_corpus_in`]). Same bytes either way, so the same tokens.
pub fn default_corpus_path() -> PathBuf {
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data").join("corpus").join(DEFAULT_CORPUS_FILE);
    if built.is_file() {
        return built;
    }
    let cache = default_cache_dir();
    match embedded_corpus_in(&cache) {
        Ok(path) => path,
        Err(e) => {
            // Loading the source-tree path then names the missing file; this says why the
            // compiled-in copy is not there instead.
            eprintln!(
                "warning: {} is missing and the compiled-in corpus could not be written to {}: {e}",
                built.display(),
                cache.display()
            );
            built
        }
    }
}

/// Writes the compiled-in corpus to `dir` unless a file with its exact bytes is there: whole
/// to a temporary file of its own (created new, so concurrent writers never share one), then
/// renamed into place, so a reader never sees half of it; a file of other bytes is replaced.
pub fn embedded_corpus_in(dir: &std::path::Path) -> std::io::Result<PathBuf> {
    use std::io::Write;
    let hash = blake3::hash(EMBEDDED_CORPUS);
    let path = dir.join(format!("austen-{}.txt", &hash.to_hex()[..16]));
    if std::fs::read(&path).is_ok_and(|b| blake3::hash(&b) == hash) {
        return Ok(path);
    }
    std::fs::create_dir_all(dir)?;
    let mut tmp = atomic::TempFile::create(dir, "austen")?;
    tmp.file().write_all(EMBEDDED_CORPUS)?;
    tmp.commit(&path)?;
    Ok(path)
}
