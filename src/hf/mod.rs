//! Hugging Face model folders in and out: `config.json` of a supported family read into a
//! [`ModelConfig`] (`config.rs`), the family's tensor names mapped onto Tessera's flat layout
//! (`names.rs`), weights read from `model.safetensors` or a sharded index (`weights.rs`), and
//! a trained model written back in the same layout (`export.rs`).
//!
//! `tessera.model` names a preset or such a folder ([`crate::zoo::resolve`]); a folder without
//! weight files is a shape to pre-train from scratch, initialised from the seed.

pub mod companions;
mod config;
mod export;
mod names;
mod special;
mod weights;

#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};

pub use config::{parse, Family, HfConfig};
pub use export::{config_doc, default_family, export, recorded_dtype, Exported, WeightFormat, SHARD_BYTES_MAX};
pub use names::{extract, matrix, pieces, place, Piece};
pub use special::{folder_begin_of_text, folder_end_of_text, folder_tokenizer};
pub use weights::{read_params, read_params_in, WeightFiles, HEADER_BYTES_MAX};

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
    /// The folder's tokenizer and generation settings, name → text ([`companions`]).
    pub companions: std::collections::BTreeMap<String, String>,
}

/// Whether `model` (a `tessera.model` value) names a folder rather than a preset: a path (preset
/// names hold no `/`), or a folder here that holds a `config.json`.
pub fn is_folder(model: &str) -> bool {
    model.contains('/') || model.contains(std::path::MAIN_SEPARATOR) || Path::new(model).join(CONFIG_FILE).is_file()
}

impl HfModel {
    /// What a checkpoint of a run from this folder records of its companion files
    /// (`extra.model_files`; see [`companions`]): `tokenizer` is the run's `tessera.tokenizer`.
    pub fn recorded_files(&self, tokenizer: Option<&str>) -> serde_json::Value {
        let own = self.dir.join(TOKENIZER_FILE);
        let same = |t: &str| match (std::fs::canonicalize(t), std::fs::canonicalize(&own)) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        };
        companions::record(&self.companions, tokenizer.is_some_and(same))
    }

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
        let companions = companions::read(dir)?;
        let hf = HfModel { dir: dir.to_path_buf(), config, weights, companions };
        if let Some(w) = &hf.weights {
            let model = Model::new(hf.config.model.clone()).map_err(|reason| HfError::Config { file, reason })?;
            w.check(hf.config.family, &model)?;
        }
        Ok(hf)
    }
}
