//! A Hugging Face `config.json` read into a [`ModelConfig`]: the architecture picks the family,
//! every key either maps to the model's shape, is checked to hold the one value Tessera
//! computes, is known to change nothing Tessera computes (generation ids, metadata), or is
//! refused by name. Dropout probabilities are the one exception: Tessera trains without
//! dropout, and says so (`HfConfig::notes`).

use serde_json::{Map, Value};
use tessera_kernels::model::{Arch, ModelConfig, MoeConfig};
use tessera_kernels::ops::layernorm::LAYERNORM_EPS;
use tessera_kernels::ops::rope::RopeScaling;

use super::HfError;

/// The model families Tessera reads and writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Gpt2,
    Llama,
    Mistral,
    Qwen2,
    /// Mistral blocks whose MLP is a dropless top-k mixture of SwiGLU experts.
    Mixtral,
    /// Qwen2 blocks whose MLP is a mixture of SwiGLU experts plus a gated shared expert, some
    /// blocks dense (`decoder_sparse_step`, `mlp_only_layers`).
    Qwen2Moe,
}

impl Family {
    /// The `architectures` entry transformers writes for the family.
    pub fn architecture(self) -> &'static str {
        match self {
            Family::Gpt2 => "GPT2LMHeadModel",
            Family::Llama => "LlamaForCausalLM",
            Family::Mistral => "MistralForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Mixtral => "MixtralForCausalLM",
            Family::Qwen2Moe => "Qwen2MoeForCausalLM",
        }
    }

    /// The `config.json` keys that bound the family's context (`ModelConfig::max_seq_len`),
    /// for messages.
    pub fn context_keys(self) -> &'static str {
        match self {
            Family::Gpt2 => "`n_positions`",
            Family::Mistral | Family::Mixtral => "`max_position_embeddings`, and `sliding_window` when set",
            Family::Llama | Family::Qwen2 | Family::Qwen2Moe => "`max_position_embeddings`",
        }
    }

    /// The `model_type` transformers writes for the family.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Gpt2 => "gpt2",
            Family::Llama => "llama",
            Family::Mistral => "mistral",
            Family::Qwen2 => "qwen2",
            Family::Mixtral => "mixtral",
            Family::Qwen2Moe => "qwen2_moe",
        }
    }

    /// Whether the family's MLPs are mixtures of experts.
    pub fn is_moe(self) -> bool {
        matches!(self, Family::Mixtral | Family::Qwen2Moe)
    }

    /// Every family, for lookups and messages.
    pub const ALL: [Family; 6] = [Family::Gpt2, Family::Llama, Family::Mistral, Family::Qwen2, Family::Mixtral, Family::Qwen2Moe];
}

/// A parsed `config.json`: the family, the shape Tessera builds, and the document itself (what
/// a checkpoint records and an export writes back).
#[derive(Clone, Debug, PartialEq)]
pub struct HfConfig {
    pub family: Family,
    pub model: ModelConfig,
    pub doc: Value,
    /// What Tessera does differently from the config and goes on with (nonzero dropout).
    pub notes: Vec<String>,
}

/// Keys of any transformers config that change nothing Tessera computes: metadata, generation
/// and tokenizer ids, inference switches, heads Tessera does not build (sequence summary).
const INERT_KEYS: &[&str] = &[
    "_name_or_path",
    "architectures",
    "model_type",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "use_cache",
    "initializer_range",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "is_decoder",
    "task_specific_params",
    "summary_type",
    "summary_use_proj",
    "summary_activation",
    "summary_proj_to_labels",
    "summary_first_dropout",
    "n_ctx",
];

/// Dropout probabilities: Tessera has no dropout; a nonzero one is noted, not applied.
const DROPOUT_KEYS: &[&str] = &["resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout"];

/// Reads `doc` (the text of `file`, for messages) as a model of a supported family whose shape
/// Tessera builds ([`ModelConfig::validate`]).
pub fn parse(file: &str, doc: &Value) -> Result<HfConfig, HfError> {
    let hf = read(file, doc)?;
    hf.model.validate().map_err(|e| HfError::Config { file: file.to_string(), reason: e })?;
    Ok(hf)
}

/// [`parse`] without the final check that the kernels build the shape: every key read,
/// checked, known inert or refused by name.
pub(super) fn read(file: &str, doc: &Value) -> Result<HfConfig, HfError> {
    let obj = doc.as_object().ok_or_else(|| HfError::config(file, "", doc, "a JSON object"))?;
    let archs = obj.get("architectures").and_then(Value::as_array);
    let arch = match archs.map(Vec::as_slice) {
        Some([Value::String(a)]) => a.as_str(),
        _ => {
            let v = obj.get("architectures").unwrap_or(&Value::Null);
            return Err(HfError::config(file, "architectures", v, "a list of one architecture"));
        }
    };
    let Some(family) = Family::ALL.into_iter().find(|f| f.architecture() == arch) else {
        let names: Vec<&str> = Family::ALL.iter().map(|f| f.architecture()).collect();
        return Err(HfError::config(file, "architectures", &Value::from(arch), &format!("one of {}", names.join(", "))));
    };
    let mut r = Reader { file, obj, used: Vec::new(), notes: Vec::new() };
    let model = match family {
        Family::Gpt2 => r.gpt2()?,
        _ => r.llama(family)?,
    };
    for (key, value) in obj {
        if DROPOUT_KEYS.contains(&key.as_str()) {
            if value.as_f64().is_some_and(|p| p != 0.0) {
                r.notes.push(format!("{file}: `{key}` = {value}: Tessera trains without dropout"));
            }
        } else if !INERT_KEYS.contains(&key.as_str()) && !r.used.contains(&key.as_str()) {
            return Err(HfError::config(file, key, value, &format!("no such key in a {arch} config that Tessera supports")));
        }
    }
    Ok(HfConfig { family, model, doc: doc.clone(), notes: r.notes })
}

/// Reads keys of one config object, remembering which it read.
struct Reader<'a> {
    file: &'a str,
    obj: &'a Map<String, Value>,
    used: Vec<&'a str>,
    notes: Vec<String>,
}

impl<'a> Reader<'a> {
    fn get(&mut self, key: &'a str) -> Option<&'a Value> {
        self.used.push(key);
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn err(&self, key: &str, value: &Value, expected: &str) -> HfError {
        HfError::config(self.file, key, value, expected)
    }

    /// A positive integer (required when `default` is `None`).
    fn size(&mut self, key: &'a str, default: Option<usize>) -> Result<usize, HfError> {
        match (self.get(key), default) {
            (Some(v), _) => v.as_u64().filter(|&n| n > 0).map(|n| n as usize).ok_or_else(|| self.err(key, v, "a positive integer")),
            (None, Some(d)) => Ok(d),
            (None, None) => Err(self.err(key, &Value::Null, "a positive integer (the key is required)")),
        }
    }

    fn number(&mut self, key: &'a str, default: f64) -> Result<f64, HfError> {
        match self.get(key) {
            Some(v) => v.as_f64().filter(|x| x.is_finite() && *x > 0.0).ok_or_else(|| self.err(key, v, "a positive number")),
            None => Ok(default),
        }
    }

    fn flag(&mut self, key: &'a str, default: bool) -> Result<bool, HfError> {
        match self.get(key) {
            Some(v) => v.as_bool().ok_or_else(|| self.err(key, v, "true or false")),
            None => Ok(default),
        }
    }

    /// A key that must hold `want` (or be absent) because that is what Tessera computes.
    fn only(&mut self, key: &'a str, want: &Value, expected: &str) -> Result<(), HfError> {
        match self.get(key) {
            Some(v) if v != want => Err(self.err(key, v, expected)),
            _ => Ok(()),
        }
    }

    fn gpt2(&mut self) -> Result<ModelConfig, HfError> {
        let d_model = self.size("n_embd", None)?;
        let n_head = self.size("n_head", None)?;
        let d_ff = self.size("n_inner", Some(4 * d_model))?;
        let act = self.get("activation_function").cloned().unwrap_or(Value::from("gelu_new"));
        if !matches!(act.as_str(), Some("gelu_new" | "gelu_pytorch_tanh")) {
            return Err(self.err("activation_function", &act, "\"gelu_new\" or \"gelu_pytorch_tanh\" (GELU, tanh approximation)"));
        }
        let eps = self.number("layer_norm_epsilon", 1e-5)?;
        if eps as f32 != LAYERNORM_EPS {
            return Err(self.err("layer_norm_epsilon", &Value::from(eps), "1e-5 (Tessera's LayerNorm epsilon)"));
        }
        self.only("scale_attn_weights", &Value::Bool(true), "true (attention scores scaled by 1/sqrt(head size))")?;
        self.only("scale_attn_by_inverse_layer_idx", &Value::Bool(false), "false")?;
        self.only("add_cross_attention", &Value::Bool(false), "false (a decoder-only model)")?;
        // Only the order of the attention's float32 upcast; the same math.
        self.get("reorder_and_upcast_attn");
        Ok(ModelConfig {
            arch: Arch::Gpt,
            vocab_size: self.size("vocab_size", None)?,
            max_seq_len: self.size("n_positions", None)?,
            n_layer: self.size("n_layer", None)?,
            n_head,
            d_model,
            d_ff,
            rope_theta: 10000.0,
            norm_eps: LAYERNORM_EPS,
            n_kv_head: n_head,
            tied_head: self.flag("tie_word_embeddings", true)?,
            qkv_bias: false,
            rope_scaling: None,
            moe: None,
        })
    }

    fn llama(&mut self, family: Family) -> Result<ModelConfig, HfError> {
        let d_model = self.size("hidden_size", None)?;
        let n_head = self.size("num_attention_heads", None)?;
        let head_dim = self.size("head_dim", Some(d_model / n_head))?;
        if head_dim * n_head != d_model {
            return Err(self.err("head_dim", &Value::from(head_dim), &format!("hidden_size / num_attention_heads = {}", d_model / n_head)));
        }
        self.only("hidden_act", &Value::from("silu"), "\"silu\" (the SwiGLU MLP)")?;
        self.only("mlp_bias", &Value::Bool(false), "false")?;
        self.only("pretraining_tp", &Value::from(1), "1")?;
        // Qwen2's q/k/v biases; transformers 5 writes Qwen2-MoE's as `qkv_bias`.
        let qkv_bias = match family {
            Family::Qwen2 => true,
            Family::Qwen2Moe => self.flag("qkv_bias", true)?,
            _ => false,
        };
        if family == Family::Llama {
            self.only(
                "attention_bias",
                &Value::Bool(false),
                "false (q/k/v biases are Qwen2's; LLaMA's bias on o_proj too is not supported)",
            )?;
        }
        let mut max_seq_len = self.size("max_position_embeddings", None)?;
        if matches!(family, Family::Mistral | Family::Mixtral) {
            // Attention limited to a window is full causal attention for sequences within it.
            if let Some(w) = self.get("sliding_window").cloned() {
                max_seq_len =
                    max_seq_len
                        .min(w.as_u64().filter(|&w| w > 0).ok_or_else(|| self.err("sliding_window", &w, "null or a positive integer"))?
                            as usize);
            }
        }
        if matches!(family, Family::Qwen2 | Family::Qwen2Moe) {
            self.only("use_sliding_window", &Value::Bool(false), "false (sliding-window attention is not supported)")?;
            self.get("sliding_window");
            self.get("max_window_layers");
        }
        if let Some(types) = self.get("layer_types").cloned() {
            let full = types.as_array().is_some_and(|a| a.iter().all(|t| t == "full_attention"));
            if !full {
                return Err(self.err("layer_types", &types, "\"full_attention\" for every layer"));
            }
        }
        let (rope_theta, rope_scaling) = self.rope()?;
        let n_layer = self.size("num_hidden_layers", None)?;
        let moe = match family {
            Family::Mixtral => Some(self.mixtral()?),
            Family::Qwen2Moe => Some(self.qwen2_moe(n_layer)?),
            _ => None,
        };
        Ok(ModelConfig {
            arch: Arch::Llama,
            vocab_size: self.size("vocab_size", None)?,
            max_seq_len,
            n_layer,
            n_head,
            d_model,
            d_ff: self.size("intermediate_size", None)?,
            rope_theta,
            norm_eps: self.number("rms_norm_eps", 1e-6)? as f32,
            n_kv_head: self.size("num_key_value_heads", Some(n_head))?,
            tied_head: self.flag("tie_word_embeddings", false)?,
            qkv_bias,
            rope_scaling,
            moe,
        })
    }

    /// Mixtral's mixture: every block, `num_local_experts` SwiGLU experts of width
    /// `intermediate_size`, softmax over every expert then the top `num_experts_per_tok`
    /// renormalised, dropless.
    fn mixtral(&mut self) -> Result<MoeConfig, HfError> {
        // transformers multiplies the block's input by uniform noise in training (the router's
        // and the experts' input); Tessera's `Jitter` (DeepSpeed's) perturbs the router's only.
        let jitter = self.get("router_jitter_noise").cloned().unwrap_or(Value::from(0.0));
        if jitter.as_f64() != Some(0.0) {
            return Err(self.err(
                "router_jitter_noise",
                &jitter,
                "0 (transformers' jitter multiplies the experts' input too; Tessera's noisy gates perturb the router only)",
            ));
        }
        let d_expert = self.size("intermediate_size", None)?;
        self.moe_common("num_local_experts", 8, 2, d_expert, true)
    }

    /// Qwen2-MoE's mixture: blocks `l` with `(l + 1) % decoder_sparse_step == 0` not in
    /// `mlp_only_layers`, `num_experts` SwiGLU experts of width `moe_intermediate_size` plus a
    /// shared expert of width `shared_expert_intermediate_size` gated by a sigmoid, the top-k
    /// weights renormalised when `norm_topk_prob`; the dense blocks' MLP has width
    /// `intermediate_size`.
    fn qwen2_moe(&mut self, n_layer: usize) -> Result<MoeConfig, HfError> {
        let d_expert = self.size("moe_intermediate_size", Some(1408))?;
        let norm_topk = self.flag("norm_topk_prob", false)?;
        let shared = self.size("shared_expert_intermediate_size", Some(5632))?;
        let mut m = self.moe_common("num_experts", 60, 4, d_expert, norm_topk)?;
        m.shared_expert = Some(shared);
        m.sparse_step = self.size("decoder_sparse_step", Some(1))?;
        let dense = self.get("mlp_only_layers").cloned().unwrap_or(Value::Array(Vec::new()));
        let layers: Option<Vec<usize>> =
            dense.as_array().and_then(|a| a.iter().map(|v| v.as_u64().map(|l| l as usize).filter(|&l| l < n_layer)).collect());
        m.dense_layers = layers
            .ok_or_else(|| self.err("mlp_only_layers", &dense, &format!("a list of layer indices below num_hidden_layers = {n_layer}")))?;
        Ok(m)
    }

    /// The keys Mixtral and Qwen2-MoE share: the expert count (under `experts_key`), top-k, and
    /// the load-balancing loss, which transformers adds to `loss` (weighted by
    /// `router_aux_loss_coef`) only when `output_router_logits` is true, so Tessera's weight is
    /// the coefficient then and 0 otherwise.
    fn moe_common(
        &mut self,
        experts_key: &'a str,
        experts_default: usize,
        top_k_default: usize,
        d_expert: usize,
        norm_topk: bool,
    ) -> Result<MoeConfig, HfError> {
        let num_experts = self.size(experts_key, Some(experts_default))?;
        let top_k = self.size("num_experts_per_tok", Some(top_k_default))?;
        if top_k > num_experts {
            return Err(self.err("num_experts_per_tok", &Value::from(top_k), &format!("at most {experts_key} = {num_experts}")));
        }
        let coef = match self.get("router_aux_loss_coef") {
            Some(v) => {
                v.as_f64().filter(|x| x.is_finite() && *x >= 0.0).ok_or_else(|| self.err("router_aux_loss_coef", v, "a number >= 0"))?
            }
            None => 0.001,
        };
        let with_aux = self.flag("output_router_logits", false)?;
        let aux = if with_aux { coef as f32 } else { 0.0 };
        Ok(MoeConfig { norm_topk, ..MoeConfig::mixtral(num_experts, top_k, d_expert, aux) })
    }

    /// θ and the scaling, from `rope_theta` + `rope_scaling` (transformers 4) or
    /// `rope_parameters` (transformers 5).
    fn rope(&mut self) -> Result<(f32, Option<RopeScaling>), HfError> {
        let theta = self.number("rope_theta", 10000.0)?;
        let (key, params) = match (self.get("rope_parameters").cloned(), self.get("rope_scaling").cloned()) {
            (Some(p), None) => ("rope_parameters", p),
            (None, Some(s)) => ("rope_scaling", s),
            (None, None) => return Ok((theta as f32, None)),
            (Some(p), Some(_)) => return Err(self.err("rope_parameters", &p, "either rope_parameters or rope_scaling, not both")),
        };
        let obj = params.as_object().ok_or_else(|| self.err(key, &params, "an object"))?;
        let theta = match obj.get("rope_theta") {
            Some(t) => t.as_f64().filter(|t| *t > 0.0).ok_or_else(|| self.err(&format!("{key}.rope_theta"), t, "a positive number"))?,
            None => theta,
        };
        let kind = obj.get("rope_type").or_else(|| obj.get("type")).and_then(Value::as_str).unwrap_or("default");
        let file = self.file;
        let num = |k: &str| {
            let v = obj.get(k).unwrap_or(&Value::Null);
            v.as_f64()
                .filter(|x| x.is_finite() && *x > 0.0)
                .ok_or_else(|| HfError::config(file, &format!("{key}.{k}"), v, "a positive number"))
        };
        let allowed: &[&str] = match kind {
            "default" => &["rope_type", "type", "rope_theta"],
            "llama3" => {
                &["rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
            }
            other => {
                return Err(self.err(&format!("{key}.rope_type"), &Value::from(other), "\"default\" or \"llama3\""));
            }
        };
        if let Some((k, v)) = obj.iter().find(|(k, _)| !allowed.contains(&k.as_str())) {
            return Err(self.err(&format!("{key}.{k}"), v, &format!("no such key for rope_type \"{kind}\"")));
        }
        let scaling = match kind {
            "llama3" => Some(RopeScaling {
                factor: num("factor")?,
                low_freq_factor: num("low_freq_factor")?,
                high_freq_factor: num("high_freq_factor")?,
                original_max_position_embeddings: num("original_max_position_embeddings")?,
            }),
            _ => None,
        };
        Ok((theta as f32, scaling))
    }
}
