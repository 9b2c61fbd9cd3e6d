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

    #[error("data directory {path}: holds no data files; Tessera reads {}", super::source::ACCEPTED_FORMATS)]
    EmptyDir { path: PathBuf },

    /// A file or folder Tessera cannot read as what it is named.
    #[error("data path {path}: {problem}; Tessera reads {}", super::source::ACCEPTED_FORMATS)]
    Format { path: PathBuf, problem: String },

    /// One document of a JSON-lines or Parquet file.
    #[error("data file {path}, {at}: {problem}")]
    Document { path: PathBuf, at: super::docs::At, problem: String },

    #[error("Parquet file {path}: {problem}")]
    Parquet { path: PathBuf, problem: String },

    /// A token that frames documents (`tessera.data_eot`, `tessera.data_bos`) that the tokenizer
    /// lacks, or that byte-level data cannot have.
    #[error("tokenizer {path}: {problem}")]
    FramingToken { path: PathBuf, problem: String },

    /// Token shards whose ids are not bytes, loaded without a tokenizer to say the vocabulary.
    #[error(
        "token shards {path}: token {token} at index {index} is not a byte (>= 256) and no tokenizer was given, so the \
         vocabulary is unknown: the {format} shard format suggests {natural_vocab} tokens, but Tessera does not guess; \
         pass --tokenizer (tessera.tokenizer) with the tokenizer.json the shards were made with"
    )]
    ShardsNeedTokenizer { path: PathBuf, index: usize, token: u32, format: &'static str, natural_vocab: usize },

    /// The token cache could not be written (the load then goes on in memory).
    #[error("token cache {path}: {action} failed: {err}")]
    CacheIo { path: PathBuf, action: &'static str, err: std::io::Error },

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

    #[error(
        "tessera.eval_iters = {found} is over the limit of {max} validation batches per evaluation \
         (each is a forward pass; the limit is VAL_BATCHES_MAX)"
    )]
    TooManyValBatches { found: u64, max: u64 },

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
