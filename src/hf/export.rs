//! A trained model written as a Hugging Face folder of its family: the weights under the
//! family's names (f32 or bf16, sorted by name as transformers writes them; one `model.safetensors`,
//! or shards of at most [`SHARD_BYTES_MAX`] and `model.safetensors.index.json`), `config.json`
//! and the caller's other files (the tokenizer's). Every file is replaced atomically.

use std::path::Path;

use serde_json::{json, Value};
use tessera_kernels::model::{Arch, Model, ModelConfig, MoeConfig};

use super::config::Family;
use super::names::{extract, matrix, pieces};
use super::weights::{INDEX_FILE, SINGLE_FILE};
use super::HfError;
use crate::checkpoint::{self, NamedTensor, TensorDtype};

/// Largest shard written, in bytes (transformers' default `max_shard_size`, "5GB").
pub const SHARD_BYTES_MAX: u64 = 5_000_000_000;

/// What [`export`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct Exported {
    /// File names, weights first.
    pub files: Vec<String>,
}

/// The dtype an export writes unless told: the model folder's own (`torch_dtype`, or
/// transformers 5's `dtype`) when it is bfloat16, else f32 (a preset, an f32 folder, and f16,
/// which Tessera does not write).
pub fn recorded_dtype(recorded: Option<&Value>) -> TensorDtype {
    let named = recorded.and_then(|d| d.get("torch_dtype").or_else(|| d.get("dtype"))).and_then(Value::as_str);
    match named {
        Some("bfloat16") => TensorDtype::Bf16,
        _ => TensorDtype::F32,
    }
}

/// The `config.json` of an export whose weights are `dtype`: the model folder's own document
/// when the model came from one (its dtype says what was written), else one built from the shape.
pub fn config_doc(family: Family, cfg: &ModelConfig, recorded: Option<&Value>, dtype: TensorDtype) -> Value {
    if let Some(doc) = recorded {
        let mut doc = doc.clone();
        for key in ["torch_dtype", "dtype"] {
            if doc.get(key).is_some() {
                doc[key] = dtype.torch().into();
            }
        }
        return doc;
    }
    let eot = cfg.vocab_size.saturating_sub(1).min(50256);
    match family {
        Family::Gpt2 => {
            let mut doc =
                checkpoint::Gpt2ExportConfig::new(cfg.vocab_size, cfg.max_seq_len, cfg.d_model, cfg.n_layer, cfg.n_head).to_hf_json();
            doc["n_inner"] = cfg.d_ff.into();
            doc["tie_word_embeddings"] = cfg.tied_head.into();
            doc["torch_dtype"] = dtype.torch().into();
            doc
        }
        _ => {
            let mut doc = llama_doc(family, cfg, eot, dtype);
            if let Some(m) = &cfg.moe {
                moe_doc(&mut doc, family, cfg, m);
            }
            doc
        }
    }
}

/// The `config.json` of a LLaMA-family model built from the shape.
fn llama_doc(family: Family, cfg: &ModelConfig, eot: usize, dtype: TensorDtype) -> Value {
    json!({
            "architectures": [family.architecture()],
            "model_type": family.model_type(),
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "intermediate_size": cfg.d_ff,
            "num_hidden_layers": cfg.n_layer,
            "num_attention_heads": cfg.n_head,
            "num_key_value_heads": cfg.n_kv_head,
            "hidden_act": "silu",
            "max_position_embeddings": cfg.max_seq_len,
            "rms_norm_eps": cfg.norm_eps,
            "rope_theta": cfg.rope_theta,
            "tie_word_embeddings": cfg.tied_head,
            "bos_token_id": eot,
            "eos_token_id": eot,
            "torch_dtype": dtype.torch(),
    })
}

/// The mixture-of-experts keys of a Mixtral or Qwen2-MoE `config.json` built from the shape
/// (what `hf::config` reads back to the same [`MoeConfig`]; the aux-loss weight is written as
/// `router_aux_loss_coef` with `output_router_logits`, transformers' switch for adding it).
fn moe_doc(doc: &mut Value, family: Family, cfg: &ModelConfig, m: &MoeConfig) {
    doc["num_experts_per_tok"] = m.top_k.into();
    // The f32's shortest decimal (0.02, not 0.019999999552965164), which reads back to it.
    doc["router_aux_loss_coef"] = m.aux_loss_coef.to_string().parse::<f64>().unwrap_or(f64::from(m.aux_loss_coef)).into();
    doc["output_router_logits"] = (m.aux_loss_coef > 0.0).into();
    if family == Family::Mixtral {
        doc["num_local_experts"] = m.num_experts.into();
        doc["intermediate_size"] = m.d_expert.into();
        doc["router_jitter_noise"] = 0.0.into();
    } else {
        doc["num_experts"] = m.num_experts.into();
        doc["moe_intermediate_size"] = m.d_expert.into();
        doc["shared_expert_intermediate_size"] = m.shared_expert.unwrap_or(0).into();
        doc["norm_topk_prob"] = m.norm_topk.into();
        doc["decoder_sparse_step"] = m.sparse_step.into();
        doc["mlp_only_layers"] = m.dense_layers.clone().into();
        doc["qkv_bias"] = cfg.qkv_bias.into();
    }
}

/// The family a model of shape `cfg` is exported as when it came from no folder: LLaMA-family
/// MoE models as Mixtral, or Qwen2-MoE when they have a shared expert.
pub fn default_family(cfg: &ModelConfig) -> Family {
    match (cfg.arch, &cfg.moe) {
        (Arch::Gpt, _) => Family::Gpt2,
        (Arch::Llama, None) => Family::Llama,
        (Arch::Llama, Some(m)) if m.shared_expert.is_some() => Family::Qwen2Moe,
        (Arch::Llama, Some(_)) => Family::Mixtral,
    }
}

/// The model's parameters as the family's tensors, sorted by name.
fn hf_tensors(family: Family, model: &Model, params: &[f32]) -> Result<Vec<NamedTensor>, HfError> {
    let mut out = Vec::new();
    for spec in model.layout().specs() {
        let ps = pieces(family, &model.cfg, spec)
            .ok_or_else(|| HfError::tensor("the model", &spec.name, format!("has no {} name", family.architecture())))?;
        for p in ps {
            let data = extract(&params[spec.range()], matrix(spec), &p);
            out.push(NamedTensor { name: p.name, shape: p.shape, data });
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// How [`export`] writes the weights.
#[derive(Clone, Copy, Debug)]
pub struct WeightFormat {
    pub dtype: TensorDtype,
    /// Largest shard, in bytes ([`SHARD_BYTES_MAX`] for transformers' default).
    pub shard_bytes_max: u64,
}

/// Writes `model` with `params` to `dir` (created if missing) as a folder of `family`:
/// weights as `format` says, `config.json` = `doc`, and each of `files` (name, bytes).
pub fn export(
    dir: &Path,
    family: Family,
    (model, params): (&Model, &[f32]),
    doc: &Value,
    files: &[(&str, Vec<u8>)],
    format: WeightFormat,
) -> Result<Exported, HfError> {
    let WeightFormat { dtype, shard_bytes_max } = format;
    let tensors = hf_tensors(family, model, params)?;
    let mut shards: Vec<Vec<&NamedTensor>> = vec![Vec::new()];
    let mut bytes = 0u64;
    for t in &tensors {
        let size = (t.data.len() * dtype.bytes()) as u64;
        let last = shards.len() - 1;
        if !shards[last].is_empty() && bytes + size > shard_bytes_max {
            shards.push(Vec::new());
            bytes = 0;
        }
        let last = shards.len() - 1;
        shards[last].push(t);
        bytes += size;
    }
    let n = shards.len();
    let names: Vec<String> = match n {
        1 => vec![SINGLE_FILE.to_string()],
        _ => (1..=n).map(|i| format!("model-{i:05}-of-{n:05}.safetensors")).collect(),
    };
    let w = |e: checkpoint::CheckpointError| HfError::Config { file: dir.display().to_string(), reason: e.to_string() };
    std::fs::create_dir_all(dir).map_err(|e| HfError::io("create", dir, e))?;
    let d = checkpoint::ExportDir::open(dir).map_err(|e| HfError::io("open", dir, e))?;
    for (name, shard) in names.iter().zip(&shards) {
        d.write_safetensors(name, shard, &[("format", "pt")], dtype).map_err(w)?;
    }
    let mut written = names.clone();
    if n > 1 {
        let map: serde_json::Map<String, Value> =
            names.iter().zip(&shards).flat_map(|(f, s)| s.iter().map(move |t| (t.name.clone(), Value::from(f.as_str())))).collect();
        let total: u64 = tensors.iter().map(|t| (t.data.len() * dtype.bytes()) as u64).sum();
        // transformers 5 also records the parameter count.
        let parameters: u64 = tensors.iter().map(|t| t.data.len() as u64).sum();
        let index = json!({ "metadata": { "total_parameters": parameters, "total_size": total }, "weight_map": map });
        d.write_file(INDEX_FILE, &to_pretty(&index)).map_err(w)?;
        written.push(INDEX_FILE.to_string());
    }
    d.write_file(super::CONFIG_FILE, &to_pretty(doc)).map_err(w)?;
    written.push(super::CONFIG_FILE.to_string());
    for (name, bytes) in files {
        d.write_file(name, bytes).map_err(w)?;
        written.push(name.to_string());
    }
    Ok(Exported { files: written })
}

fn to_pretty(v: &Value) -> Vec<u8> {
    let mut out = serde_json::to_vec_pretty(v).unwrap_or_default();
    out.push(b'\n');
    out
}
