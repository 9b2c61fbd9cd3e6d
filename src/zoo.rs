//! The model zoo: named presets of the built-in GPT-2, LLaMA-style and Mixtral-style stacks, and
//! [`resolve`], which reads `tessera.model` as a preset name or a Hugging Face model folder.

use std::path::Path;

use tessera_kernels::model::{Arch, ModelConfig};

use crate::hf::HfModel;

/// A named model shape. The vocabulary is the preset's default; the trainer replaces it with
/// the data's vocabulary (256 for byte-level text, the tokenizer's size otherwise).
pub struct Preset {
    pub name: &'static str,
    /// What the shape alone does not say (`tessera models` prints it after the shape).
    pub note: &'static str,
    pub cfg: ModelConfig,
}

/// The presets, smallest first: each a Hugging Face `config.json` shipped under
/// `configs/models/<name>/` (so `--model configs/models/<name>` is the same shape as a folder,
/// with its own vocabulary, and a copy of the folder is where a changed shape starts) and a note.
const PRESETS: [(&str, &str, &str); 9] = [
    ("gpt-tiny", include_str!("../configs/models/gpt-tiny/config.json"), "CI-sized"),
    ("gpt-mini-gpu", include_str!("../configs/models/gpt-mini-gpu/config.json"), "the smallest shape `--device cuda` runs"),
    ("gpt-10m", include_str!("../configs/models/gpt-10m/config.json"), ""),
    ("gpt2-small", include_str!("../configs/models/gpt2-small/config.json"), "GPT-2 124M"),
    ("gpt2-1.3b", include_str!("../configs/models/gpt2-1.3b/config.json"), "GPT-3 XL's width and depth"),
    ("llama-tiny", include_str!("../configs/models/llama-tiny/config.json"), "RoPE, RMSNorm, SwiGLU"),
    ("mixtral-tiny", include_str!("../configs/models/mixtral-tiny/config.json"), "CI-sized mixture of experts"),
    ("llama-0.85b", include_str!("../configs/models/llama-0.85b/config.json"), "8 KV heads, untied head"),
    ("llama-1.1b", include_str!("../configs/models/llama-1.1b/config.json"), "TinyLlama's shape: 4 KV heads, untied head"),
];

/// Every preset, smallest first.
pub fn presets() -> Vec<Preset> {
    PRESETS
        .iter()
        .map(|&(name, text, note)| {
            let file = format!("configs/models/{name}/config.json");
            // Compiled in and parsed by a test (`shipped_preset_configs_are_the_presets`): a
            // failure here is a build of a broken file, not an input.
            let doc: serde_json::Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{file}: {e}"));
            let cfg = crate::hf::parse(&file, &doc).unwrap_or_else(|e| panic!("{e}")).model;
            Preset { name, note, cfg }
        })
        .collect()
}

impl Preset {
    /// The preset's line in `tessera models`: its family, shape, size and note.
    pub fn about(&self) -> String {
        describe(&self.cfg, self.note)
    }
}

fn describe(cfg: &ModelConfig, note: &str) -> String {
    let style = match cfg.arch {
        Arch::Gpt => "GPT-2 style",
        Arch::Llama => "LLaMA style",
    };
    let params = tessera_kernels::model::Model::new(cfg.clone()).map_or(0, |m| m.num_params());
    let size = match params {
        p if p >= 1_000_000_000 => format!("~{:.1}B", p as f64 / 1e9),
        p => format!("~{:.1}M", p as f64 / 1e6),
    };
    let note = if note.is_empty() { String::new() } else { format!("; {note}") };
    let experts = cfg.moe.as_ref().map_or(String::new(), |m| {
        let sparse = (0..cfg.n_layer).filter(|&l| tessera_kernels::moe_ffn::is_sparse(m, l)).count();
        format!(", {} experts of {} (top {}) in {sparse} of the blocks", m.num_experts, m.d_expert, m.top_k)
    });
    format!(
        "{style}, {} layers, d={}, {} heads of {}, ctx {}, vocab {}{experts} ({size} params{note})",
        cfg.n_layer,
        cfg.d_model,
        cfg.n_head,
        cfg.d_model / cfg.n_head.max(1),
        cfg.max_seq_len,
        cfg.vocab_size
    )
}

/// What `tessera.model` names: a preset (its vocabulary is the data's), or a model folder (its
/// own vocabulary, and its weights when it has any).
#[derive(Clone, Debug)]
pub enum ModelSource {
    Preset(Box<ModelConfig>),
    Folder(Box<HfModel>),
}

impl ModelSource {
    pub fn config(&self) -> &ModelConfig {
        match self {
            ModelSource::Preset(c) => c,
            ModelSource::Folder(f) => &f.config.model,
        }
    }

    pub fn folder(&self) -> Option<&HfModel> {
        match self {
            ModelSource::Preset(_) => None,
            ModelSource::Folder(f) => Some(f),
        }
    }
}

/// `model` as a preset name, or (when it names a folder: it holds a `/`, has a `config.json`, or
/// is a directory and no preset's name) a Hugging Face model folder, opened and checked
/// ([`HfModel::open`]: a directory without `config.json` is an error naming it).
pub fn resolve(model: &str) -> Result<ModelSource, String> {
    let folder = || HfModel::open(Path::new(model)).map(|f| ModelSource::Folder(Box::new(f))).map_err(|e| e.to_string());
    if crate::hf::is_folder(model) {
        return folder();
    }
    match preset(model) {
        Err(_) if Path::new(model).is_dir() => folder(),
        p => p.map(|c| ModelSource::Preset(Box::new(c))),
    }
}

/// Looks a preset up by name; the error lists the valid names.
pub fn preset(name: &str) -> Result<ModelConfig, String> {
    let all = presets();
    match all.iter().find(|p| p.name == name) {
        Some(p) => Ok(p.cfg.clone()),
        None => {
            let names: Vec<&str> = all.iter().map(|p| p.name).collect();
            Err(format!("unknown model `{name}`; expected one of: {}", names.join(", ")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_kernels::model::Model;

    fn gpt(vocab_size: usize, max_seq_len: usize, n_layer: usize, n_head: usize, d_model: usize) -> ModelConfig {
        ModelConfig {
            arch: Arch::Gpt,
            vocab_size,
            max_seq_len,
            n_layer,
            n_head,
            d_model,
            d_ff: 4 * d_model,
            rope_theta: 10000.0,
            norm_eps: 1e-5,
            n_kv_head: n_head,
            tied_head: true,
            qkv_bias: false,
            rope_scaling: None,
            moe: None,
        }
    }

    /// The shipped `configs/models/*/config.json` read as the shapes the presets always had
    /// (the bits of every run of a preset depend on them).
    #[test]
    fn shipped_preset_configs_are_the_presets() {
        let big_llama = |n_layer, n_kv_head| ModelConfig {
            arch: Arch::Llama,
            vocab_size: 32000,
            max_seq_len: 4096,
            n_layer,
            n_head: 32,
            d_model: 2048,
            d_ff: 5632,
            rope_theta: 10000.0,
            norm_eps: 1e-5,
            n_kv_head,
            tied_head: false,
            qkv_bias: false,
            rope_scaling: None,
            moe: None,
        };
        let llama = ModelConfig {
            arch: Arch::Llama,
            vocab_size: 256,
            max_seq_len: 128,
            n_layer: 4,
            n_head: 4,
            d_model: 128,
            d_ff: 344,
            rope_theta: 10000.0,
            norm_eps: 1e-5,
            n_kv_head: 4,
            tied_head: true,
            qkv_bias: false,
            rope_scaling: None,
            moe: None,
        };
        let want = [
            ("gpt-tiny", gpt(256, 128, 4, 4, 128)),
            ("gpt-mini-gpu", gpt(256, 128, 2, 2, 128)),
            ("gpt-10m", gpt(256, 256, 6, 6, 384)),
            ("gpt2-small", gpt(50257, 1024, 12, 12, 768)),
            ("gpt2-1.3b", gpt(50257, 1024, 24, 32, 2048)),
            ("llama-tiny", llama.clone()),
            ("mixtral-tiny", mixtral_tiny()),
            ("llama-0.85b", big_llama(16, 8)),
            ("llama-1.1b", big_llama(22, 4)),
        ];
        let got = presets();
        assert_eq!(got.len(), want.len());
        for (p, (name, cfg)) in got.iter().zip(want) {
            assert_eq!((p.name, &p.cfg), (name, &cfg));
        }
        assert!(
            got[3].about().contains("12 layers, d=768, 12 heads of 64, ctx 1024, vocab 50257 (~124.4M params; GPT-2 124M)"),
            "{}",
            got[3].about()
        );
        // The folder is the same shape (its own vocabulary): `--model configs/models/<name>`.
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/models/gpt-tiny");
        let folder = resolve(dir.to_str().unwrap()).unwrap();
        assert_eq!(folder.config(), &got[0].cfg);
    }

    fn mixtral_tiny() -> ModelConfig {
        let moe = tessera_kernels::model::MoeConfig::mixtral(4, 2, 256, 0.02);
        ModelConfig {
            arch: Arch::Llama,
            vocab_size: 256,
            max_seq_len: 128,
            n_layer: 4,
            n_head: 4,
            d_model: 128,
            d_ff: 256,
            rope_theta: 1e6,
            norm_eps: 1e-5,
            n_kv_head: 2,
            tied_head: false,
            qkv_bias: false,
            rope_scaling: None,
            moe: Some(moe),
        }
    }

    #[test]
    fn presets_build_with_expected_sizes() {
        let count = |n: &str| Model::new(preset(n).unwrap()).unwrap().num_params();
        assert!((700_000..1_000_000).contains(&count("gpt-tiny")));
        assert!((10_000_000..11_500_000).contains(&count("gpt-10m")));
        let mini = preset("gpt-mini-gpu").unwrap();
        assert_eq!(mini.d_model / mini.n_head, 64, "the GPU attention kernel needs head dimension 64");
        assert!((300_000..600_000).contains(&count("gpt-mini-gpu")));
        // GPT-2 124M: 124,439,808 parameters with the tied head.
        assert_eq!(count("gpt2-small"), 124_439_808);
        let xl = preset("gpt2-1.3b").unwrap();
        assert_eq!(xl.d_model / xl.n_head, 64, "the GPU attention kernel needs head dimension 64");
        assert!((1_300_000_000..1_350_000_000).contains(&count("gpt2-1.3b")), "{}", count("gpt2-1.3b"));
        assert!(preset("gpt-huge").unwrap_err().contains("gpt-tiny"));
    }
}
