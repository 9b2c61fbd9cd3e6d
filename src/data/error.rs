//! Errors of the data layer; each names the file or value at fault.

use std::path::PathBuf;

/// Everything that can go wrong while loading, writing or sampling data.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("data path {path}: no such file or directory")]
    Missing { path: PathBuf },

    /// The I/O error is in the message, not a `source` (`{:#}` would print it twice).
    #[error("data path {path}: {action} failed: {err}")]
    Io { path: PathBuf, action: &'static str, err: std::io::Error },

    #[error("data path {path}: contains no tokens")]
    Empty { path: PathBuf },

    #[error("data directory {path}: holds no .bin shards and no text files")]
    EmptyDir { path: PathBuf },

    #[error("token shard {path}: bad {field}: expected {expected}, found {found}")]
    BadHeader { path: PathBuf, field: &'static str, expected: String, found: String },

    #[error(
        "token shard {path}: wrong size: expected {expected_bytes} bytes \
         (1024-byte header + {tokens} tokens x {token_bytes} bytes), found {found_bytes} bytes"
    )]
    BadSize { path: PathBuf, tokens: u64, token_bytes: usize, expected_bytes: u64, found_bytes: u64 },

    #[error("token shard {path}: token {token} at index {index} does not fit a version-1 shard (u16 tokens, must be < 65536)")]
    TokenTooWide { path: PathBuf, index: usize, token: u32 },

    #[error("token shard {path}: {count} tokens exceed the header's limit of {max}")]
    TooManyTokens { path: PathBuf, count: usize, max: u64 },

    #[error("tokenizer {path}: no such file (expected a Hugging Face tokenizer.json)")]
    TokenizerMissing { path: PathBuf },

    #[error("tokenizer {path}: failed to load: {message}")]
    Tokenizer { path: PathBuf, message: String },

    #[error("tokenizer: failed to encode {what}: {message}")]
    Encode { what: String, message: String },

    #[error("text file {path}: not valid UTF-8 at byte {offset} (a tokenizer needs UTF-8 text)")]
    NotUtf8 { path: PathBuf, offset: usize },

    #[error("{source_desc}: token {token} at index {index} is >= the vocabulary size {vocab_size}")]
    TokenOutOfRange { source_desc: String, index: usize, token: u32, vocab_size: usize },

    #[error("{what}: {found} tokens are too few for seq_len {seq_len}: need at least {needed}")]
    TooShort { what: String, found: usize, needed: usize, seq_len: usize },

    #[error("{what} must be {expected}, found {found}")]
    BadArgument { what: &'static str, expected: &'static str, found: String },

    #[error("sampler state: key `{key}`: {problem}")]
    BadState { key: &'static str, problem: String },
}

impl DataError {
    pub(crate) fn io(path: &std::path::Path, action: &'static str, source: std::io::Error) -> Self {
        if source.kind() == std::io::ErrorKind::NotFound {
            return DataError::Missing { path: path.to_path_buf() };
        }
        DataError::Io { path: path.to_path_buf(), action, err: source }
    }
}
