//! Where each Hugging Face tensor lives in Tessera's flat layout.
//!
//! A Tessera parameter is viewed as a matrix `[rows, cols]` (a vector is one row); each
//! Hugging Face tensor it is made of fills a block of its columns, either as it is (`[rows, w]`,
//! or `[w]` for a vector) or transposed (`[w, rows]`): transformers' `nn.Linear` keeps weights
//! as `[out, in]`, Tessera's linear layers (like GPT-2's `Conv1D`) as `[in, out]`. LLaMA's
//! separate q, k and v projections are the column blocks of Tessera's fused `wqkv`; GPT-2's
//! tensors are Tessera's own, under `transformer.`.
//!
//! Mixture-of-experts blocks: the router `h.{l}.moe.router.weight` `[c, E]` is the transposed
//! `gate.weight` `[E, c]`, expert `e`'s SwiGLU is the transposed per-expert projections
//! (Mixtral `block_sparse_moe.experts.{e}.w1` (gate), `.w3` (up), `.w2` (down); Qwen2-MoE
//! `mlp.experts.{e}.gate_proj`, `.up_proj`, `.down_proj`), Qwen2-MoE's shared expert is
//! `mlp.shared_expert.*` with its sigmoid gate `mlp.shared_expert_gate.weight` `[1, c]`. That
//! per-expert layout is what transformers 5 `save_pretrained` writes (it fuses the experts in
//! memory and splits them again on save) and what it loads.

use tessera_kernels::layer::ParamSpec;
use tessera_kernels::model::ModelConfig;

use super::config::Family;

/// One Hugging Face tensor and the block of a Tessera parameter it fills.
#[derive(Clone, Debug, PartialEq)]
pub struct Piece {
    pub name: String,
    /// Its shape in the Hugging Face file.
    pub shape: Vec<usize>,
    /// First column of the block.
    pub col: usize,
    pub transpose: bool,
}

/// `[rows, cols]` of a Tessera parameter (a vector is one row).
pub fn matrix(spec: &ParamSpec) -> (usize, usize) {
    match spec.shape.as_slice() {
        [n] => (1, *n),
        [r, c] => (*r, *c),
        other => (other.iter().take(other.len() - 1).product(), other.last().copied().unwrap_or(1)),
    }
}

fn whole(name: String, spec: &ParamSpec) -> Vec<Piece> {
    vec![Piece { name, shape: spec.shape.clone(), col: 0, transpose: false }]
}

fn transposed(name: String, spec: &ParamSpec) -> Vec<Piece> {
    let (rows, cols) = matrix(spec);
    vec![Piece { name, shape: vec![cols, rows], col: 0, transpose: true }]
}

/// The Hugging Face tensors of Tessera parameter `spec` in a model of `family` shaped `cfg`;
/// `None` for a name the family does not have.
pub fn pieces(family: Family, cfg: &ModelConfig, spec: &ParamSpec) -> Option<Vec<Piece>> {
    if spec.name == "lm_head.weight" {
        return Some(whole(spec.name.clone(), spec));
    }
    if family == Family::Gpt2 {
        return Some(whole(format!("transformer.{}", spec.name), spec));
    }
    let name = spec.name.as_str();
    match name {
        "wte.weight" => return Some(whole("model.embed_tokens.weight".into(), spec)),
        "norm_f.weight" => return Some(whole("model.norm.weight".into(), spec)),
        _ => {}
    }
    let rest = name.strip_prefix("h.")?;
    let (layer, param) = rest.split_once('.')?;
    let p = |s: &str| format!("model.layers.{layer}.{s}");
    let (c, kv) = (cfg.d_model, cfg.n_kv_head * cfg.head_dim());
    if let Some(moe) = param.strip_prefix("moe.") {
        return moe_pieces(family, &p, moe, spec);
    }
    let out = match param {
        "attn_norm.weight" => whole(p("input_layernorm.weight"), spec),
        "mlp_norm.weight" => whole(p("post_attention_layernorm.weight"), spec),
        "attn.wo.weight" => transposed(p("self_attn.o_proj.weight"), spec),
        "mlp.w_gate.weight" => transposed(p("mlp.gate_proj.weight"), spec),
        "mlp.w_up.weight" => transposed(p("mlp.up_proj.weight"), spec),
        "mlp.w_down.weight" => transposed(p("mlp.down_proj.weight"), spec),
        "attn.wqkv.weight" => [("q", 0, c), ("k", c, kv), ("v", c + kv, kv)]
            .into_iter()
            .map(|(x, col, w)| Piece { name: p(&format!("self_attn.{x}_proj.weight")), shape: vec![w, c], col, transpose: true })
            .collect(),
        "attn.wqkv.bias" => [("q", 0, c), ("k", c, kv), ("v", c + kv, kv)]
            .into_iter()
            .map(|(x, col, w)| Piece { name: p(&format!("self_attn.{x}_proj.bias")), shape: vec![w], col, transpose: false })
            .collect(),
        _ => return None,
    };
    Some(out)
}

/// The Hugging Face tensors of parameter `param` (after `h.{l}.moe.`) of an MoE block; `p`
/// prefixes `model.layers.{l}.`.
fn moe_pieces(family: Family, p: &dyn Fn(&str) -> String, param: &str, spec: &ParamSpec) -> Option<Vec<Piece>> {
    let (block, [gate, up, down]) = match family {
        Family::Mixtral => ("block_sparse_moe", ["w1", "w3", "w2"]),
        Family::Qwen2Moe => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
        _ => return None,
    };
    let swiglu = |prefix: &str, w: &str| -> Option<String> {
        let hf = match w {
            "w_gate.weight" => gate,
            "w_up.weight" => up,
            "w_down.weight" => down,
            _ => return None,
        };
        Some(p(&format!("{block}.{prefix}{hf}.weight")))
    };
    let name = match param {
        "router.weight" => p(&format!("{block}.gate.weight")),
        _ if param.starts_with("experts.") => {
            let (e, w) = param.strip_prefix("experts.")?.split_once('.')?;
            e.parse::<usize>().ok()?;
            swiglu(&format!("experts.{e}."), w)?
        }
        "shared_gate.weight" if family == Family::Qwen2Moe => p("mlp.shared_expert_gate.weight"),
        _ if family == Family::Qwen2Moe && param.starts_with("shared.") => swiglu("shared_expert.", param.strip_prefix("shared.")?)?,
        _ => return None,
    };
    Some(transposed(name, spec))
}

/// Copies Hugging Face tensor `src` (row-major, `piece.shape`) into its block of `dst` (the
/// parameter's view of the flat buffer, `[rows, cols]`).
pub fn place(dst: &mut [f32], (rows, cols): (usize, usize), piece: &Piece, src: &[f32]) {
    let w = src.len() / rows.max(1);
    for r in 0..rows {
        for j in 0..w {
            let s = if piece.transpose { src[j * rows + r] } else { src[r * w + j] };
            dst[r * cols + piece.col + j] = s;
        }
    }
}

/// The inverse of [`place`]: Hugging Face tensor `piece` read out of `src`.
pub fn extract(src: &[f32], (rows, cols): (usize, usize), piece: &Piece) -> Vec<f32> {
    let numel: usize = piece.shape.iter().product();
    let w = numel / rows.max(1);
    let mut out = vec![0.0; numel];
    for r in 0..rows {
        for j in 0..w {
            let v = src[r * cols + piece.col + j];
            if piece.transpose {
                out[j * rows + r] = v;
            } else {
                out[r * w + j] = v;
            }
        }
    }
    out
}
