//! Checkpoints: atomic, hash-verified save/load of training state (safetensors + JSON manifest),
//! resume resolution, the bit-exact parameter fingerprint, and the pieces of a Hugging Face export.
//!
//! On-disk layout under a checkpoint root:
//! ```text
//! root/
//!   latest                  # text file: name of the newest saved step dir, e.g. "step_00000100"
//!   step_00000100/
//!     params.safetensors    # f32 model parameters, names as in the model (HF GPT-2 names)
//!     optim.safetensors     # f32 optimizer state ("exp_avg/<param>", flat buffers, ...)
//!     manifest.json         # format version, step, config hash, cursors, file sizes + blake3,
//!                           # and last its own blake3 (`manifest_blake3`, from version 2)
//! ```
//! A save goes to `root/.tmp-step_XXXXXXXX-<pid>/`, is fsynced, then renamed into place, so a
//! crash never leaves a half-written directory under a final `step_*` name. Every step of a
//! save acts through one open handle on `root` (`dir.rs`), so a save that fails removes its
//! temporary names from the folder it wrote in even when `root`'s path no longer leads there.

mod dir;
mod export;
mod fsio;
mod hf_tokenizer;
mod load;
mod lock;
mod manifest;
mod save;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_export;

use std::io;
use std::path::PathBuf;

pub use export::{reference_json, ExportDir, ExportReference, Gpt2ExportConfig, TokenizerSample};
pub use fsio::TensorDtype;
pub use hf_tokenizer::{byte_level_tokenizer_json, tokenizer_files, SPECIAL_TOKENS_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE};
pub use load::{
    list_checkpoints, list_restorable, load, load_latest_valid, resolve_resume, LatestValid, ResolvedResume, SkippedCheckpoint,
};
pub use lock::{LockError, OutputLock, LOCK_FILE};
pub use save::save;
pub(crate) use save::TMP_PREFIX;

#[cfg(test)]
pub(crate) use fsio::{FAULT_HOOK, WRITE_HOOK};
#[cfg(test)]
pub(crate) use save::old_dir_step_name;

/// Version of the manifest/file layout written by [`save`]; [`load`] reads it and version 1
/// (the same without the manifest's own digest) and rejects other versions.
pub const FORMAT_VERSION: u32 = 2;
/// The `format` string stored in every manifest.
pub const FORMAT_NAME: &str = "tessera-checkpoint";
/// File names inside a step directory.
pub const PARAMS_FILE: &str = "params.safetensors";
pub const OPTIM_FILE: &str = "optim.safetensors";
pub const MANIFEST_FILE: &str = "manifest.json";
/// Name of the pointer file in the checkpoint root.
pub const LATEST_FILE: &str = "latest";

/// One named f32 tensor (row-major `shape`, `data.len() == shape.iter().product()`).
#[derive(Debug, Clone, PartialEq)]
pub struct NamedTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

/// Everything needed to resume training bit-for-bit.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointState {
    pub step: u64,
    pub config_hash: String,
    /// Model preset name (e.g. "gpt2-124m").
    pub model: String,
    pub data_cursor: serde_json::Value,
    pub rng: serde_json::Value,
    /// Loss scaler, LR schedule state, etc.
    pub extra: serde_json::Value,
    pub params: Vec<NamedTensor>,
    /// Optimizer tensors, e.g. "exp_avg/h.0.ln_1.weight" or flat buffers.
    pub optim: Vec<NamedTensor>,
}

/// Errors of checkpoint save/load/export; every variant names the file or tensor involved.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The I/O error is in the message, not a `source` (`{:#}` would print it twice).
    #[error("{op} `{path}`: {err}")]
    Io { op: &'static str, path: PathBuf, err: io::Error },
    #[error("`{path}`: size mismatch: manifest says {expected_bytes} bytes, found {found_bytes} bytes (truncated or overwritten?)")]
    SizeMismatch { path: PathBuf, expected_bytes: u64, found_bytes: u64 },
    #[error("`{path}`: blake3 mismatch: manifest says {expected}, found {found} (file corrupted)")]
    HashMismatch { path: PathBuf, expected: String, found: String },
    #[error("`{path}`: invalid manifest: {reason}")]
    Manifest { path: PathBuf, reason: String },
    #[error("`{path}`: unsupported checkpoint format version {found} (this build reads versions 1 to {expected})")]
    FormatVersion { path: PathBuf, found: u32, expected: u32 },
    #[error("`{path}`: invalid safetensors file: {reason}")]
    Safetensors { path: PathBuf, reason: String },
    #[error("`{path}`: tensor `{name}`: {reason}")]
    Tensor { path: PathBuf, name: String, reason: String },
    #[error("invalid checkpoint state: {0}")]
    InvalidState(String),
    #[error("`{path}`: no valid checkpoint found{details}")]
    NotFound { path: PathBuf, details: String },
    #[error("export: {0}")]
    Export(String),
}

impl CheckpointError {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        CheckpointError::Io { op, path: path.into(), err: source }
    }
}

/// Floats converted to little-endian bytes per chunk when hashing/writing (bounded scratch).
pub(crate) const F32_CHUNK: usize = 1 << 16;

/// Call `sink` with the little-endian bytes of `data`, in chunks of at most [`F32_CHUNK`] floats.
pub(crate) fn for_each_le_chunk<E>(data: &[f32], mut sink: impl FnMut(&[u8]) -> Result<(), E>) -> Result<(), E> {
    let mut buf = Vec::with_capacity(F32_CHUNK.min(data.len()) * 4);
    for chunk in data.chunks(F32_CHUNK) {
        buf.clear();
        for x in chunk {
            buf.extend_from_slice(&x.to_le_bytes());
        }
        sink(&buf)?;
    }
    Ok(())
}

/// The project's bit-for-bit parameter fingerprint: blake3 over, for each `(name, data)` in the
/// order given, the UTF-8 bytes of `name` followed by the little-endian bytes of every f32 in
/// `data` (shapes are not hashed). Returns lowercase hex.
pub fn params_blake3(names_in_canonical_order: &[(&str, &[f32])]) -> String {
    let mut hasher = blake3::Hasher::new();
    for (name, data) in names_in_canonical_order {
        hasher.update(name.as_bytes());
        let done: Result<(), std::convert::Infallible> = for_each_le_chunk(data, |b| {
            hasher.update(b);
            Ok(())
        });
        let Ok(()) = done;
    }
    hasher.finalize().to_hex().to_string()
}

/// [`params_blake3`] over a slice of [`NamedTensor`] in slice order.
pub fn named_params_blake3(params: &[NamedTensor]) -> String {
    let views: Vec<(&str, &[f32])> = params.iter().map(|t| (t.name.as_str(), t.data.as_slice())).collect();
    params_blake3(&views)
}

/// Step directory name for `step`: `step_{step:08}`.
pub fn step_dir_name(step: u64) -> String {
    format!("step_{step:08}")
}

/// Parse `step_NNNNNNNN` back into the step number.
pub fn parse_step_dir_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step_")?;
    if digits.len() < 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}
