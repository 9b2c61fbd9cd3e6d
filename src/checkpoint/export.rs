//! Export of GPT-2 parameters to a Hugging Face `transformers` directory (`model.safetensors`,
//! `config.json`, the tokenizer's files, optional `reference.json` for `scripts/check_export.py`).

use std::collections::HashMap;
use std::path::Path;

use super::dir::Dir;
use super::fsio::{safetensors_fill, validate_tensors, write_atomic_in, write_file_atomic_in};
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

/// Every tensor a GPT-2 export must contain, in canonical order, with its HF shape
/// (linear weights as `[in, out]` like HF `Conv1D`). The tied `lm_head.weight` is not listed.
pub fn gpt2_expected_tensors(cfg: &Gpt2ExportConfig) -> Vec<(String, Vec<usize>)> {
    let c = cfg.n_embd;
    let mut out = vec![("wte.weight".to_string(), vec![cfg.vocab_size, c]), ("wpe.weight".to_string(), vec![cfg.n_positions, c])];
    for i in 0..cfg.n_layer {
        let layer: [(&str, Vec<usize>); 12] = [
            ("ln_1.weight", vec![c]),
            ("ln_1.bias", vec![c]),
            ("attn.c_attn.weight", vec![c, 3 * c]),
            ("attn.c_attn.bias", vec![3 * c]),
            ("attn.c_proj.weight", vec![c, c]),
            ("attn.c_proj.bias", vec![c]),
            ("ln_2.weight", vec![c]),
            ("ln_2.bias", vec![c]),
            ("mlp.c_fc.weight", vec![c, 4 * c]),
            ("mlp.c_fc.bias", vec![4 * c]),
            ("mlp.c_proj.weight", vec![4 * c, c]),
            ("mlp.c_proj.bias", vec![c]),
        ];
        out.extend(layer.into_iter().map(|(n, s)| (format!("h.{i}.{n}"), s)));
    }
    out.push(("ln_f.weight".to_string(), vec![c]));
    out.push(("ln_f.bias".to_string(), vec![c]));
    out
}

fn export_err(msg: String) -> CheckpointError {
    CheckpointError::Export(msg)
}

/// Check `params` against the expected GPT-2 tensors and return them in canonical order.
fn select_gpt2_tensors<'a>(params: &'a [NamedTensor], cfg: &Gpt2ExportConfig) -> Result<Vec<&'a NamedTensor>, CheckpointError> {
    validate_tensors("param", params)?;
    if cfg.n_head == 0 || cfg.n_embd % cfg.n_head != 0 {
        return Err(export_err(format!("n_embd {} is not divisible by n_head {}", cfg.n_embd, cfg.n_head)));
    }
    let by_name: HashMap<&str, &NamedTensor> = params.iter().map(|t| (t.name.as_str(), t)).collect();
    let expected = gpt2_expected_tensors(cfg);
    let mut out = Vec::with_capacity(expected.len());
    for (name, shape) in &expected {
        let t = by_name.get(name.as_str()).ok_or_else(|| export_err(format!("missing tensor `{name}` (expected shape {shape:?})")))?;
        if &t.shape != shape {
            return Err(export_err(format!("tensor `{name}`: shape {:?}, expected {shape:?}", t.shape)));
        }
        out.push(*t);
    }
    for t in params {
        if t.name == "lm_head.weight" {
            let wte = out[0];
            if t.shape != wte.shape || t.data != wte.data {
                return Err(export_err("`lm_head.weight` differs from `wte.weight` but GPT-2 ties them".into()));
            }
        } else if !expected.iter().any(|(n, _)| *n == t.name) {
            return Err(export_err(format!("unexpected tensor `{}`", t.name)));
        }
    }
    Ok(out)
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

/// Write a Hugging Face GPT-2 directory to `out_dir` (created if missing): `model.safetensors`
/// (canonical names, f32, tied `lm_head` omitted, metadata `{"format": "pt"}`), `config.json`,
/// with a `reference` its `reference.json`, and each of `files` (name, bytes: the tokenizer's,
/// [`super::tokenizer_files`]). Each file is replaced atomically; nothing else in `out_dir` is
/// touched.
pub fn export_hf_gpt2(
    out_dir: &Path,
    params: &[NamedTensor],
    cfg: &Gpt2ExportConfig,
    reference: Option<&ExportReference>,
    files: &[(&str, Vec<u8>)],
) -> Result<(), CheckpointError> {
    let tensors = select_gpt2_tensors(params, cfg)?;
    let reference = reference.map(|r| reference_json(r, cfg.vocab_size)).transpose()?;
    std::fs::create_dir_all(out_dir).map_err(|e| CheckpointError::io("create export dir", out_dir, e))?;
    let dir = Dir::open(out_dir).map_err(|e| CheckpointError::io("open export dir", out_dir, e))?;
    let model = "model.safetensors";
    write_atomic_in(&dir, model, safetensors_fill(&dir.join(model), &tensors, &[("format", "pt")])?)?;
    let config = serde_json::to_vec_pretty(&cfg.to_hf_json()).map_err(|e| export_err(format!("cannot encode config.json: {e}")))?;
    write_file_atomic_in(&dir, "config.json", &config)?;
    if let Some(reference) = reference {
        write_file_atomic_in(&dir, "reference.json", &reference)?;
    }
    for (name, bytes) in files {
        write_file_atomic_in(&dir, name, bytes)?;
    }
    Ok(())
}

/// An export folder, written through one open handle: each file replaced atomically (a
/// temporary name, fsynced, renamed), as [`export_hf_gpt2`] writes its files.
pub struct ExportDir(Dir);

impl ExportDir {
    pub fn open(path: &Path) -> std::io::Result<ExportDir> {
        Dir::open(path).map(ExportDir)
    }

    /// Replaces `name` with an f32 safetensors file of `tensors` (in that order).
    pub fn write_safetensors(&self, name: &str, tensors: &[&NamedTensor], metadata: &[(&str, &str)]) -> Result<(), CheckpointError> {
        write_atomic_in(&self.0, name, safetensors_fill(&self.0.join(name), tensors, metadata)?).map(drop)
    }

    /// Replaces `name` with `bytes`.
    pub fn write_file(&self, name: &str, bytes: &[u8]) -> Result<(), CheckpointError> {
        write_file_atomic_in(&self.0, name, bytes)
    }
}
