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

impl Dataset {
    /// What a checkpoint records of the data it was trained on: where the tokens came from,
    /// how many there are, and their blake3 (training then validation tokens, u32 little-endian),
    /// so that a resume on other data is noticed.
    pub fn record(&self) -> serde_json::Value {
        let mut h = blake3::Hasher::new();
        let mut buf = Vec::with_capacity(1 << 18);
        for piece in self.train.chunks(1 << 16).chain(self.val.chunks(1 << 16)) {
            buf.clear();
            buf.extend(piece.iter().flat_map(|t| t.to_le_bytes()));
            h.update(&buf);
        }
        serde_json::json!({
            "source": self.source,
            "tokens": self.train.len() + self.val.len(),
            "blake3": h.finalize().to_hex().to_string(),
        })
    }
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
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("tessera");
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
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    std::fs::create_dir_all(dir)?;
    // pid, this process's count and the clock: no two writers (threads, or processes of other
    // pid namespaces sharing the folder) pick the same name, and `create_new` refuses if one did.
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let tmp = dir.join(format!(".austen.{}.{n}.{nanos}.tmp", std::process::id()));
    let written = std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp).and_then(|mut f| {
        f.write_all(EMBEDDED_CORPUS)?;
        f.sync_all()
    });
    if let Err(e) = written.and_then(|()| std::fs::rename(&tmp, &path)) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(path)
}
