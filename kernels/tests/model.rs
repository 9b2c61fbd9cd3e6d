//! Whole-model checks: loss and every parameter gradient against PyTorch fixtures
//! (`scripts/gen_fixtures.py`), finite differences through the full stack, and activation
//! recomputation giving bit-identical gradients.

use std::collections::HashMap;

use safetensors::SafeTensors;
use tessera_kernels::gradcheck::{check_grad, rel_err};
use tessera_kernels::model::{Arch, FlatAccess, MicroBatch, Model, ModelConfig, Workspace};

struct Fixture {
    tensors: HashMap<String, Vec<f32>>,
    ints: HashMap<String, Vec<u32>>,
    meta: HashMap<String, String>,
}

fn load_fixture(name: &str) -> Fixture {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
    let (_, meta) = SafeTensors::read_metadata(&bytes).expect("fixture header");
    let st = SafeTensors::deserialize(&bytes).expect("fixture");
    let mut tensors = HashMap::new();
    let mut ints = HashMap::new();
    for (name, view) in st.tensors() {
        let data = view.data();
        match view.dtype() {
            safetensors::Dtype::F32 => {
                tensors.insert(name, data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect());
            }
            safetensors::Dtype::I32 => {
                ints.insert(name, data.chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as u32).collect());
            }
            other => panic!("unexpected dtype {other:?} in fixture"),
        }
    }
    let meta = meta.metadata().clone().unwrap_or_default();
    Fixture { tensors, ints, meta }
}

fn cfg_from(meta: &HashMap<String, String>) -> ModelConfig {
    let n = |k: &str| meta[k].parse::<usize>().expect("fixture metadata");
    let arch = if meta["arch"] == "gpt" { Arch::Gpt } else { Arch::Llama };
    ModelConfig {
        arch,
        vocab_size: n("vocab_size"),
        max_seq_len: n("max_seq_len"),
        n_layer: n("n_layer"),
        n_head: n("n_head"),
        d_model: n("d_model"),
        d_ff: n("d_ff"),
        rope_theta: 10000.0,
        norm_eps: 1e-5,
        n_kv_head: n("n_head"),
        tied_head: true,
        qkv_bias: false,
        rope_scaling: None,
        moe: None,
    }
}

fn flat_params(model: &Model, fx: &Fixture) -> Vec<f32> {
    let mut flat = vec![0.0; model.num_params()];
    for spec in model.layout().specs() {
        let src = fx.tensors.get(&spec.name).unwrap_or_else(|| panic!("fixture lacks {}", spec.name));
        assert_eq!(src.len(), spec.numel(), "{}", spec.name);
        flat[spec.range()].copy_from_slice(src);
    }
    flat
}

fn run(model: &Model, params: &[f32], tokens: &[u32], targets: &[u32], b: usize, t: usize) -> (f32, Vec<f32>) {
    let mut grads = vec![0.0; params.len()];
    let mut ws = Workspace::default();
    let mut acc = FlatAccess { params, grads: &mut grads, units: model.units() };
    let loss = model.forward_backward(&mut acc, MicroBatch { tokens, targets, b, t }, 1.0, &mut ws);
    (loss, grads)
}

fn check_against_pytorch(file: &str) {
    let fx = load_fixture(file);
    let cfg = cfg_from(&fx.meta);
    let model = Model::new(cfg).expect("model");
    let params = flat_params(&model, &fx);
    let (b, t) = (fx.meta["batch"].parse().unwrap(), fx.meta["seq_len"].parse().unwrap());
    let (loss, grads) = run(&model, &params, &fx.ints["tokens"], &fx.ints["targets"], b, t);
    let want = fx.tensors["loss"][0];
    let loss_rel = ((loss - want) / want).abs();
    assert!(loss_rel < 1e-5, "{file}: loss {loss} vs PyTorch {want} (rel {loss_rel:e})");
    let mut worst = (0.0f64, String::new());
    for spec in model.layout().specs() {
        let want = &fx.tensors[&format!("grad.{}", spec.name)];
        let e = rel_err(&grads[spec.range()], want);
        assert!(e < 1e-5, "{file}: gradient of {} differs from PyTorch: rel err {e:e}", spec.name);
        if e > worst.0 {
            worst = (e, spec.name.clone());
        }
    }
    eprintln!("{file}: loss rel err {loss_rel:e}; worst gradient rel err {:e} ({})", worst.0, worst.1);
}

#[test]
fn gpt_two_layers_matches_pytorch() {
    check_against_pytorch("gpt2l.safetensors");
}

#[test]
fn llama_two_layers_matches_pytorch() {
    check_against_pytorch("llama2l.safetensors");
}

fn tiny(arch: Arch) -> ModelConfig {
    ModelConfig {
        arch,
        vocab_size: 11,
        max_seq_len: 6,
        n_layer: 2,
        n_head: 2,
        d_model: 8,
        d_ff: 16,
        rope_theta: 10000.0,
        norm_eps: 1e-5,
        n_kv_head: 2,
        tied_head: true,
        qkv_bias: false,
        rope_scaling: None,
        moe: None,
    }
}

/// Finite differences through the whole stack (embeddings, blocks, tied head, loss). The loss is
/// evaluated in f32, so the step is large and the tolerance loose; the PyTorch fixtures above are
/// the tight check.
#[test]
fn whole_model_gradients_match_finite_differences() {
    // (The third: a LLaMA MLP narrower than the model, whose backward reuses its buffers.)
    for cfg in [tiny(Arch::Gpt), tiny(Arch::Llama), ModelConfig { d_ff: 4, ..tiny(Arch::Llama) }] {
        let (arch, d_ff) = (cfg.arch, cfg.d_ff);
        let model = Model::new(cfg).unwrap();
        // Weights of order one (not the GPT-2 init's 0.02) so that a finite step of 1e-2 is
        // small against every activation it moves, norms included.
        let mut params = tessera_kernels::gradcheck::randn(7, model.num_params(), 0.5);
        params.iter_mut().zip(model.layout().specs().iter().flat_map(|s| std::iter::repeat_n(s.init, s.numel()))).for_each(|(p, init)| {
            if init == tessera_kernels::layer::Init::Ones {
                *p += 1.0;
            }
        });
        let (b, t) = (2, 5);
        let tokens: Vec<u32> = (0..b * t).map(|i| (i * 5 % 11) as u32).collect();
        let targets: Vec<u32> = (0..b * t).map(|i| (i * 3 % 11) as u32).collect();
        let (_, grads) = run(&model, &params, &tokens, &targets, b, t);
        let f = |p: &[f32]| {
            let mut ws = Workspace::default();
            let mut unused = vec![0.0; p.len()];
            let mut acc = FlatAccess { params: p, grads: &mut unused, units: model.units() };
            model.loss(&mut acc, &tokens, &targets, b, t, &mut ws) as f64
        };
        check_grad(f, &params, &grads, 1e-2, 5e-2).unwrap_or_else(|e| panic!("{arch:?}, d_ff {d_ff}: {e}"));
    }
}

#[test]
fn activation_recomputation_gives_identical_gradients() {
    for arch in [Arch::Gpt, Arch::Llama] {
        let mut model = Model::new(tiny(arch)).unwrap();
        let params = model.init_params(3);
        let tokens: Vec<u32> = (0..12).map(|i| (i * 7 % 11) as u32).collect();
        let targets: Vec<u32> = (0..12).map(|i| (i * 2 % 11) as u32).collect();
        let (l1, g1) = run(&model, &params, &tokens, &targets, 2, 6);
        model.checkpoint_activations = true;
        let (l2, g2) = run(&model, &params, &tokens, &targets, 2, 6);
        assert_eq!(l1.to_bits(), l2.to_bits());
        assert!(g1.iter().zip(&g2).all(|(a, b)| a.to_bits() == b.to_bits()), "{arch:?}: recomputation changed gradients");
    }
}
