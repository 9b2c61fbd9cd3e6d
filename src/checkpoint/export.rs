//! The pieces of a Hugging Face export that are not the model's own layout (that is
//! `crate::hf::export`): GPT-2's `config.json` for a preset, `reference.json` for
//! `scripts/check_export.py`, and [`ExportDir`], the folder its files are replaced in atomically.

use std::path::Path;

use super::dir::Dir;
use super::fsio::{safetensors_fill, write_atomic_in, write_file_atomic_in, TensorDtype};
use super::{CheckpointError, NamedTensor};

/// The GPT-2 hyper-parameters written into `config.json` (transformers' `GPT2Config`).
#[derive(Debug, Clone, PartialEq)]
pub struct Gpt2ExportConfig {
    pub vocab_size: usize,
    pub n_positions: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub layer_norm_epsilon: f64,
    pub bos_token_id: u32,
    pub eos_token_id: u32,
}

impl Gpt2ExportConfig {
    /// Config with GPT-2 defaults: eps 1e-5, bos = eos = 50256 (`<|endoftext|>`), or
    /// `vocab_size - 1` for vocabularies smaller than GPT-2's.
    pub fn new(vocab_size: usize, n_positions: usize, n_embd: usize, n_layer: usize, n_head: usize) -> Self {
        let eot = u32::try_from(vocab_size.saturating_sub(1).min(50256)).unwrap_or(50256);
        Gpt2ExportConfig {
            vocab_size,
            n_positions,
            n_embd,
            n_layer,
            n_head,
            layer_norm_epsilon: 1e-5,
            bos_token_id: eot,
            eos_token_id: eot,
        }
    }

    /// The `config.json` document transformers' `GPT2Config` expects.
    pub fn to_hf_json(&self) -> serde_json::Value {
        serde_json::json!({
            "model_type": "gpt2",
            "architectures": ["GPT2LMHeadModel"],
            "vocab_size": self.vocab_size,
            "n_positions": self.n_positions,
            "n_ctx": self.n_positions,
            "n_embd": self.n_embd,
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "n_inner": null,
            "activation_function": "gelu_new",
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "initializer_range": 0.02,
            "scale_attn_weights": true,
            "scale_attn_by_inverse_layer_idx": false,
            "reorder_and_upcast_attn": false,
            "summary_type": "cls_index",
            "summary_use_proj": true,
            "summary_activation": null,
            "summary_proj_to_labels": true,
            "summary_first_dropout": 0.1,
            "use_cache": true,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "tie_word_embeddings": true,
            "torch_dtype": "float32"
        })
    }
}

fn export_err(msg: String) -> CheckpointError {
    CheckpointError::Export(msg)
}

/// What `reference.json` holds for `scripts/check_export.py`: a token sequence and Tessera's
/// mean next-token loss on it (`loss` must be the mean cross-entropy of predicting
/// `tokens[t+1]` from `tokens[..=t]` for all t, what `GPT2LMHeadModel(input_ids,
/// labels=input_ids)` computes), and a sample text with the ids Tessera's tokenizer gives it
/// and the text they decode back to (what the exported tokenizer must give too).
#[derive(Debug, Clone, Copy)]
pub struct ExportReference<'a> {
    pub tokens: &'a [u32],
    pub loss: f32,
    pub text: Option<TokenizerSample<'a>>,
}

/// A text, the ids Tessera's tokenizer encodes it to, and the text those ids decode to (the
/// text itself unless the tokenizer drops or changes characters).
#[derive(Debug, Clone, Copy)]
pub struct TokenizerSample<'a> {
    pub text: &'a str,
    pub ids: &'a [u32],
    pub decoded: &'a str,
}

/// `reference.json` content (see [`ExportReference`]).
pub fn reference_json(r: &ExportReference, vocab_size: usize) -> Result<Vec<u8>, CheckpointError> {
    let (tokens, loss) = (r.tokens, r.loss);
    if tokens.len() < 2 {
        return Err(export_err(format!("reference needs at least 2 tokens, got {}", tokens.len())));
    }
    if let Some(t) = tokens.iter().find(|&&t| t as usize >= vocab_size) {
        return Err(export_err(format!("reference token {t} is outside vocab_size {vocab_size}")));
    }
    if !loss.is_finite() {
        return Err(export_err(format!("reference loss {loss} is not finite")));
    }
    let mut doc = serde_json::json!({ "tokens": tokens, "loss": loss });
    if let Some(t) = r.text {
        doc["text"] = t.text.into();
        doc["text_ids"] = t.ids.into();
        doc["text_decoded"] = t.decoded.into();
    }
    serde_json::to_vec_pretty(&doc).map_err(|e| export_err(format!("cannot encode reference.json: {e}")))
}

/// An export folder, written through one open handle: each file replaced atomically (a
/// temporary name, fsynced, renamed); `crate::hf::export` writes through it.
pub struct ExportDir(Dir);

impl ExportDir {
    pub fn open(path: &Path) -> std::io::Result<ExportDir> {
        Dir::open(path).map(ExportDir)
    }

    /// Replaces `name` with an f32 safetensors file of `tensors` (in that order).
    pub fn write_safetensors(
        &self,
        name: &str,
        tensors: &[&NamedTensor],
        metadata: &[(&str, &str)],
        dtype: TensorDtype,
    ) -> Result<(), CheckpointError> {
        write_atomic_in(&self.0, name, safetensors_fill(&self.0.join(name), tensors, metadata, dtype)?).map(drop)
    }

    /// Replaces `name` with `bytes`.
    pub fn write_file(&self, name: &str, bytes: &[u8]) -> Result<(), CheckpointError> {
        write_file_atomic_in(&self.0, name, bytes)
    }
}
