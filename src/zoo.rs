//! The model zoo: named presets of the built-in GPT-2 and LLaMA-style stacks, and
//! [`resolve`], which reads `tessera.model` as a preset name or a Hugging Face model folder.

use std::path::Path;

use tessera_kernels::model::{Arch, ModelConfig};

use crate::hf::HfModel;

/// A named model shape. The vocabulary is the preset's default; the trainer replaces it with
/// the data's vocabulary (256 for byte-level text, the tokenizer's size otherwise).
pub struct Preset {
    pub name: &'static str,
    pub about: &'static str,
    pub cfg: ModelConfig,
}

const fn gpt(vocab_size: usize, max_seq_len: usize, n_layer: usize, n_head: usize, d_model: usize) -> ModelConfig {
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
    }
}

/// Every preset, smallest first.
pub fn presets() -> Vec<Preset> {
    vec![
        Preset { name: "gpt-tiny", about: "GPT-2 style, 4 layers, d=128, ctx 128 (~0.8M params; CI-sized)", cfg: gpt(256, 128, 4, 4, 128) },
        Preset {
            name: "gpt-mini-gpu",
            about: "GPT-2 style, 2 layers, d=128, 2 heads of 64, ctx 128 (~0.4M params; the smallest shape `--device cuda` runs)",
            cfg: gpt(256, 128, 2, 2, 128),
        },
        Preset { name: "gpt-10m", about: "GPT-2 style, 6 layers, d=384, ctx 256 (~10.7M params)", cfg: gpt(256, 256, 6, 6, 384) },
        Preset {
            name: "gpt2-small",
            about: "GPT-2 124M: 12 layers, d=768, 12 heads, ctx 1024, vocab 50257",
            cfg: gpt(50257, 1024, 12, 12, 768),
        },
        Preset {
            name: "gpt2-1.3b",
            about: "GPT-2 style ~1.3B: 24 layers, d=2048, 32 heads of 64, ctx 1024, vocab 50257 (GPT-3 XL's width and depth)",
            cfg: gpt(50257, 1024, 24, 32, 2048),
        },
        Preset {
            name: "llama-tiny",
            about: "LLaMA style (RoPE, RMSNorm, SwiGLU), 4 layers, d=128, ctx 128",
            cfg: ModelConfig {
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
            },
        },
    ]
}

/// What `tessera.model` names: a preset (its vocabulary is the data's), or a model folder (its
/// own vocabulary, and its weights when it has any).
#[derive(Clone, Debug)]
pub enum ModelSource {
    Preset(ModelConfig),
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

/// `model` as a preset name, or (when it names a folder: it holds a `/` or is a directory) a
/// Hugging Face model folder, opened and checked ([`HfModel::open`]).
pub fn resolve(model: &str) -> Result<ModelSource, String> {
    if crate::hf::is_folder(model) {
        return HfModel::open(Path::new(model)).map(|f| ModelSource::Folder(Box::new(f))).map_err(|e| e.to_string());
    }
    preset(model).map(ModelSource::Preset)
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
