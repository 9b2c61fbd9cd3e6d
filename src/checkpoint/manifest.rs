//! The `manifest.json` schema of a checkpoint step directory.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Size and content hash of one file of the step directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct FileEntry {
    pub bytes: u64,
    pub blake3: String,
}

/// Name and shape of one stored tensor, in canonical (save) order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct TensorEntry {
    pub name: String,
    pub shape: Vec<usize>,
}

/// Everything in `manifest.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Manifest {
    pub format: String,
    pub format_version: u32,
    pub step: u64,
    pub config_hash: String,
    pub model: String,
    pub data_cursor: serde_json::Value,
    pub rng: serde_json::Value,
    pub extra: serde_json::Value,
    /// `params_blake3` fingerprint of the parameters in canonical order.
    pub params_blake3: String,
    pub files: BTreeMap<String, FileEntry>,
    pub params: Vec<TensorEntry>,
    pub optim: Vec<TensorEntry>,
}
