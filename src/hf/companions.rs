//! The files of a model folder that Tessera does not interpret beyond a few keys but must not
//! lose: the tokenizer's settings (`tokenizer_config.json` — special tokens, `add_bos_token`,
//! the chat template —, `special_tokens_map.json`, transformers' separate `chat_template.jinja`
//! / `chat_template.json`) and `generation_config.json`.
//!
//! They are read once, when the folder is opened, recorded in every checkpoint of the run
//! (`extra.model_files`: name → text) and written back byte for byte by `tessera export`, so a
//! model fine-tuned from a folder exports with the folder's chat template and special tokens
//! rather than Tessera's generated tokenizer settings (those are written only for files the
//! folder did not have). The tokenizer's files are recorded only when the run tokenizes with
//! the folder's own `tokenizer.json`: settings of another tokenizer would describe the wrong ids.

use std::collections::BTreeMap;
use std::path::Path;

use super::HfError;

/// A model folder's tokenizer settings, carried when the run uses the folder's tokenizer.
pub const TOKENIZER_COMPANIONS: &[&str] =
    &["tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json"];

/// A model folder's generation settings, always carried.
pub const MODEL_COMPANIONS: &[&str] = &["generation_config.json"];

/// Largest companion file read, in bytes (they are recorded in every checkpoint's manifest;
/// the largest published `tokenizer_config.json` files, with hundreds of added tokens, are
/// well under 1 MB).
pub const COMPANION_BYTES_MAX: u64 = 4 << 20;

/// `name` as a companion file's name, or `None` (an export writes no other name a manifest holds).
pub fn known(name: &str) -> Option<&'static str> {
    TOKENIZER_COMPANIONS.iter().chain(MODEL_COMPANIONS).find(|n| **n == name).copied()
}

/// The companion files of `dir` that exist, as name → text. A file that is too large, not
/// UTF-8, or (for `.json`) not JSON is refused by name.
pub fn read(dir: &Path) -> Result<BTreeMap<String, String>, HfError> {
    let mut out = BTreeMap::new();
    for name in TOKENIZER_COMPANIONS.iter().chain(MODEL_COMPANIONS) {
        let path = dir.join(name);
        if !path.is_file() {
            continue;
        }
        let file = path.display().to_string();
        let bytes = std::fs::metadata(&path).map_err(|e| HfError::io("read the size of", &path, e))?.len();
        if bytes > COMPANION_BYTES_MAX {
            return Err(HfError::Config { file, reason: format!("{bytes} bytes (at most {COMPANION_BYTES_MAX})") });
        }
        let raw = std::fs::read(&path).map_err(|e| HfError::io("read", &path, e))?;
        let text = String::from_utf8(raw).map_err(|e| HfError::Config { file: file.clone(), reason: format!("not UTF-8 text: {e}") })?;
        if name.ends_with(".json") {
            serde_json::from_str::<serde_json::Value>(&text).map_err(|e| HfError::Config { file, reason: format!("not JSON: {e}") })?;
        }
        out.insert(name.to_string(), text);
    }
    Ok(out)
}

/// What a checkpoint records of `companions` (name → text, a JSON object): the generation
/// settings always, the tokenizer's only when `uses_folder_tokenizer`.
pub fn record(companions: &BTreeMap<String, String>, uses_folder_tokenizer: bool) -> serde_json::Value {
    let carried = companions.iter().filter(|(name, _)| MODEL_COMPANIONS.contains(&name.as_str()) || uses_folder_tokenizer);
    serde_json::Value::Object(carried.map(|(name, text)| (name.clone(), text.clone().into())).collect())
}
