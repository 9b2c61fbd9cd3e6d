//! The `manifest.json` schema of a checkpoint step directory, and its own digest.
//!
//! The files' sizes and blake3 in the manifest guard the tensors; the manifest guards itself
//! (format version 2): its last line is `"manifest_blake3": "<hex>"`, the blake3 of every byte
//! before that line's leading `,`. Without it a flipped digit in a cursor, a counter or the loss
//! scaler loaded as a different, silently wrong state.

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
    // The manifest's own digest, `manifest_blake3`, is no field: [`encode`] appends it and
    // [`check_digest`] checks it on the file's bytes (version 1 manifests have none).
}

/// What comes between the manifest's body and its digest.
const DIGEST_KEY: &[u8] = b",\n  \"manifest_blake3\": \"";
/// What follows the digest: the end of the file.
const DIGEST_END: &[u8] = b"\"\n}";

/// The bytes of `manifest.json` for `m` (a [`Manifest`], or in tests its JSON): pretty JSON
/// whose last key is its own digest.
pub(crate) fn encode(m: &impl Serialize) -> serde_json::Result<Vec<u8>> {
    let mut bytes = serde_json::to_vec_pretty(m)?;
    let Some(body_len) = bytes.strip_suffix(b"\n}").map(<[u8]>::len) else {
        return Err(serde::ser::Error::custom("a manifest does not end with `\\n}`"));
    };
    bytes.truncate(body_len);
    let digest = blake3::hash(&bytes).to_hex();
    bytes.extend_from_slice(DIGEST_KEY);
    bytes.extend_from_slice(digest.as_bytes());
    bytes.extend_from_slice(DIGEST_END);
    Ok(bytes)
}

/// Checks the digest [`encode`] ends `bytes` with against the bytes before it.
pub(crate) fn check_digest(bytes: &[u8]) -> Result<(), String> {
    let missing = || "key `manifest_blake3`: missing, or not the file's last line (manifest cut or edited)".to_string();
    let rest = bytes.strip_suffix(DIGEST_END).ok_or_else(missing)?;
    let split = rest.len().checked_sub(64).ok_or_else(missing)?;
    let (head, hex) = rest.split_at(split);
    let body = head.strip_suffix(DIGEST_KEY).ok_or_else(missing)?;
    let found = blake3::hash(body).to_hex();
    if found.as_bytes() != hex {
        return Err(format!(
            "key `manifest_blake3`: {} but the manifest hashes to {found} (manifest corrupted)",
            String::from_utf8_lossy(hex)
        ));
    }
    Ok(())
}
