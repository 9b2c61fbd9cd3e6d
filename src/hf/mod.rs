//! Hugging Face model folders in and out: `config.json` of a supported family read into a
//! [`ModelConfig`] (`config.rs`), the family's tensor names mapped onto Tessera's flat layout
//! (`names.rs`), weights read from `model.safetensors` or a sharded index (`weights.rs`), and
//! a trained model written back in the same layout (`export.rs`).
//!
//! `tessera.model` names a preset or such a folder ([`crate::zoo::resolve`]); a folder without
//! weight files is a shape to pre-train from scratch, initialised from the seed.

mod config;
mod export;
mod names;
mod weights;

#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};

pub use config::{parse, Family, HfConfig};
pub use export::{config_doc, default_family, export, recorded_dtype, Exported, WeightFormat, SHARD_BYTES_MAX};
pub use names::{extract, matrix, pieces, place, Piece};
pub use weights::{read_params, WeightFiles, HEADER_BYTES_MAX};

use tessera_kernels::model::Model;

/// The file that makes a folder a model folder.
pub const CONFIG_FILE: &str = "config.json";
/// A model folder's tokenizer.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// Errors reading or writing a model folder; each names the file, and the key or tensor.
#[derive(Debug, thiserror::Error)]
pub enum HfError {
    #[error("{file}: key `{key}` = {value}: expected {expected}")]
    Key { file: String, key: String, value: String, expected: String },
    #[error("{file}: {reason}")]
    Config { file: String, reason: String },
    #[error("{file}: tensor `{name}`: {reason}")]
    Tensor { file: String, name: String, reason: String },
    #[error("{op} `{path}`: {err}")]
    Io { op: &'static str, path: PathBuf, err: std::io::Error },
}

impl HfError {
    pub(crate) fn config(file: &str, key: &str, value: &serde_json::Value, expected: &str) -> Self {
        let mut value = value.to_string();
        if value.len() > 200 {
            value = format!("{}…", &value[..value.char_indices().nth(200).map_or(value.len(), |(i, _)| i)]);
        }
        HfError::Key { file: file.to_string(), key: key.to_string(), value, expected: expected.to_string() }
    }

    pub(crate) fn tensor(file: impl std::fmt::Display, name: &str, reason: impl Into<String>) -> Self {
        HfError::Tensor { file: file.to_string(), name: name.to_string(), reason: reason.into() }
    }

    pub(crate) fn io(op: &'static str, path: &Path, err: std::io::Error) -> Self {
        HfError::Io { op, path: path.to_path_buf(), err }
    }
}

/// A model folder: its parsed config and its weight files (none: initialise from the seed).
#[derive(Clone, Debug)]
pub struct HfModel {
    pub dir: PathBuf,
    pub config: HfConfig,
    pub weights: Option<WeightFiles>,
}

/// Whether `model` (a `tessera.model` value) names a folder rather than a preset: a path (preset
/// names hold no `/`), or a folder here that holds a `config.json`.
pub fn is_folder(model: &str) -> bool {
    model.contains('/') || model.contains(std::path::MAIN_SEPARATOR) || Path::new(model).join(CONFIG_FILE).is_file()
}

/// The end-of-sequence token of model folder `model`, by name: the added token of its
/// `tokenizer.json` whose id is `config.json`'s `eos_token_id` (the first, when it is a list);
/// `None` when `model` is no folder or either file lacks it (what `tessera.data_eot` defaults
/// to, so that the folder's own token separates documents).
pub fn folder_end_of_text(model: &str) -> Option<String> {
    if !is_folder(model) {
        return None;
    }
    let read = |f: &str| std::fs::read(Path::new(model).join(f)).ok().and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok());
    let config = read(CONFIG_FILE)?;
    let eos = match &config["eos_token_id"] {
        serde_json::Value::Array(ids) => ids.first()?.as_u64()?,
        id => id.as_u64()?,
    };
    let tokenizer = read(TOKENIZER_FILE)?;
    let added = tokenizer["added_tokens"].as_array()?;
    added.iter().find(|t| t["id"].as_u64() == Some(eos)).and_then(|t| t["content"].as_str()).map(str::to_string)
}

/// The tokenizer of model folder `model`: its `tokenizer.json`, when `model` is a folder that
/// has one (what `tessera.tokenizer` defaults to).
pub fn folder_tokenizer(model: &str) -> Option<String> {
    let path = Path::new(model).join(TOKENIZER_FILE);
    (is_folder(model) && path.is_file()).then(|| path.display().to_string())
}

impl HfModel {
    /// Opens `dir`: parses `config.json` and lists its weight files, checking every tensor's
    /// name, dtype and shape against the model the config describes (no tensor data is read).
    pub fn open(dir: &Path) -> Result<HfModel, HfError> {
        let path = dir.join(CONFIG_FILE);
        let file = path.display().to_string();
        let bytes = std::fs::read(&path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound if dir.is_dir() => HfError::Config {
                file: file.clone(),
                reason: format!(
                    "missing: {} is no Hugging Face model folder (it needs its {CONFIG_FILE}; the weights and {TOKENIZER_FILE} are optional)",
                    dir.display()
                ),
            },
            _ => HfError::io("read", &path, e),
        })?;
        let doc: serde_json::Value =
            serde_json::from_slice(&bytes).map_err(|e| HfError::Config { file: file.clone(), reason: format!("not JSON: {e}") })?;
        let config = parse(&file, &doc)?;
        let weights = WeightFiles::find(dir)?;
        let hf = HfModel { dir: dir.to_path_buf(), config, weights };
        if let Some(w) = &hf.weights {
            let model = Model::new(hf.config.model.clone()).map_err(|reason| HfError::Config { file, reason })?;
            w.check(hf.config.family, &model)?;
        }
        Ok(hf)
    }
}
