//! The paged-cache forward against the model's own recomputation of the window
//! (`Model::next_token_logits`) for every block family: prefill, chunked prefill, decode, mixed
//! batches and prefix blocks shared between sequences; int8 weights against f32; bad steps.

use tessera_kernels::gradcheck::rel_err;
use tessera_kernels::model::paged::{ParamsAt, QuantScope};
use tessera_kernels::model::{Arch, Gating, Model, ModelConfig, MoeConfig, Workspace};
use tessera_kernels::tensor::Rng;

use super::*;

/// f32 agreement between two summation orders of the same forward.
const TOL: f64 = 2e-5;

pub(crate) fn dense(arch: Arch) -> ModelConfig {
    ModelConfig {
        arch,
        vocab_size: 37,
        max_seq_len: 40,
        n_layer: 2,
        n_head: 4,
        d_model: 32,
        d_ff: 48,
        rope_theta: 10000.0,
        norm_eps: 1e-5,
        n_kv_head: 4,
        tied_head: true,
        qkv_bias: false,
        rope_scaling: None,
        moe: None,
    }
}

/// One model of each family the CPU serves, two blocks each (the pipeline ranks' tests take
/// them with three).
pub(crate) fn families() -> Vec<(&'static str, ModelConfig)> {
    let llama = dense(Arch::Llama);
    let scaling = tessera_kernels::ops::rope::RopeScaling {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 16.0,
    };
    let mixtral = MoeConfig::mixtral(4, 2, 24, 0.02);
    let qwen_moe = MoeConfig { norm_topk: false, shared_expert: Some(20), dense_layers: vec![0], ..MoeConfig::mixtral(4, 2, 16, 0.0) };
    let gpt_moe = MoeConfig { sparse_step: 2, gating: Gating::TopKThenSoftmax, residual: true, ..MoeConfig::mixtral(4, 1, 24, 0.0) };
    vec![
        ("gpt2", dense(Arch::Gpt)),
        ("llama-gqa-untied", ModelConfig { n_kv_head: 2, tied_head: false, rope_scaling: Some(scaling), ..llama.clone() }),
        ("qwen2-mqa-bias", ModelConfig { n_kv_head: 1, qkv_bias: true, ..llama.clone() }),
        ("mixtral", ModelConfig { n_kv_head: 2, moe: Some(mixtral), ..llama.clone() }),
        ("qwen2-moe", ModelConfig { n_kv_head: 2, moe: Some(qwen_moe), ..llama }),
        ("gpt-moe-residual", ModelConfig { moe: Some(gpt_moe), ..dense(Arch::Gpt) }),
    ]
}

/// Weights of order 0.2 (sharper attention and routing than the 0.02 init), seeded.
fn params(model: &Model, seed: u64) -> Vec<f32> {
    let mut p = vec![0.0; model.num_params()];
    Rng::new(seed).fill_normal(&mut p, 0.2);
    p
}

fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| rng.gen_range(vocab as u64) as u32).collect()
}

/// A backend over a cache of 32 blocks of 4 positions.
fn backend(cfg: &ModelConfig, weights: LinearFormat) -> (CpuBackend, Model, Vec<f32>) {
    let (model, oracle) = (Model::new(cfg.clone()).unwrap(), Model::new(cfg.clone()).unwrap());
    let p = params(&model, 7);
    let b = CpuBackend::new(model, p.clone(), CpuOptions { block_size: 4, num_blocks: 32, weights }).unwrap();
    (b, oracle, p)
}

fn recompute(model: &Model, p: &[f32], window: &[u32]) -> Vec<f32> {
    model.next_token_logits(p, window, &mut Workspace::default())
}

fn step<'a>(tokens: &'a [u32], start: usize, block_table: &'a [u32], want_logits: bool) -> SeqStep<'a> {
    SeqStep { tokens, start, block_table, want_logits }
}

fn close(name: &str, what: &str, got: &[f32], want: &[f32]) {
    let e = rel_err(got, want);
    assert!(e < TOL, "{name}: {what}: rel err {e:e} against the recomputed window");
}

#[test]
fn prefill_then_decode_matches_recomputation() {
    for (name, cfg) in families() {
        let (mut b, oracle, p) = backend(&cfg, LinearFormat::F32);
        let seq = tokens(23, cfg.vocab_size, 1);
        // Scattered blocks, not in order.
        let table = [9, 2, 30, 4, 17, 0];
        let out = b.step(&[step(&seq[..10], 0, &table, true)]).unwrap();
        close(name, "prefill of 10", &out[0], &recompute(&oracle, &p, &seq[..10]));
        for t in 10..seq.len() {
            let out = b.step(&[step(&seq[t..t + 1], t, &table, true)]).unwrap();
            close(name, &format!("decode at position {t}"), &out[0], &recompute(&oracle, &p, &seq[..=t]));
        }
    }
}

#[test]
fn chunked_prefill_matches_one_chunk() {
    for (name, cfg) in families() {
        let (mut b, oracle, p) = backend(&cfg, LinearFormat::F32);
        let seq = tokens(17, cfg.vocab_size, 2);
        let table = [3, 8, 1, 12, 5];
        // Chunks of 3 (not a multiple of the block size), logits only at the end.
        for (k, chunk) in seq.chunks(3).enumerate() {
            let last = (k + 1) * 3 >= seq.len();
            let out = b.step(&[step(chunk, 3 * k, &table, last)]).unwrap();
            assert_eq!(out.len(), usize::from(last), "{name}: logits only where wanted");
            if last {
                close(name, "chunked prefill", &out[0], &recompute(&oracle, &p, &seq));
            }
        }
    }
}

#[test]
fn mixed_batches_match_each_sequence_alone() {
    for (name, cfg) in families() {
        let (mut b, oracle, p) = backend(&cfg, LinearFormat::F32);
        let (a, c) = (tokens(14, cfg.vocab_size, 3), tokens(9, cfg.vocab_size, 4));
        let (ta, tc) = ([0, 1, 2, 3], [10, 11, 12]);
        b.step(&[step(&a[..12], 0, &ta, false)]).unwrap();
        // One step: `a` decodes position 12 while `c` prefills 0..6; then `a` 13 and `c` 6..9.
        let out = b.step(&[step(&a[12..13], 12, &ta, true), step(&c[..6], 0, &tc, true)]).unwrap();
        close(name, "decoding beside a prefill", &out[0], &recompute(&oracle, &p, &a[..13]));
        close(name, "prefill beside a decode", &out[1], &recompute(&oracle, &p, &c[..6]));
        let out = b.step(&[step(&c[6..9], 6, &tc, true), step(&a[13..14], 13, &ta, true)]).unwrap();
        close(name, "second chunk", &out[0], &recompute(&oracle, &p, &c));
        close(name, "second decode", &out[1], &recompute(&oracle, &p, &a));
    }
}

#[test]
fn shared_prefix_blocks_are_read_not_recomputed() {
    for (name, cfg) in families() {
        let (mut b, oracle, p) = backend(&cfg, LinearFormat::F32);
        // Two prompts with the same first 9 tokens: the second reuses the first's two full
        // blocks (positions 0..8) and runs only from position 8.
        let first = tokens(13, cfg.vocab_size, 5);
        let mut second = first[..9].to_vec();
        second.extend(tokens(4, cfg.vocab_size, 6));
        b.step(&[step(&first, 0, &[20, 21, 22, 23], true)]).unwrap();
        let out = b.step(&[step(&second[8..], 8, &[20, 21, 25, 26], true)]).unwrap();
        close(name, "after shared blocks", &out[0], &recompute(&oracle, &p, &second));
        // The first sequence still decodes from its own blocks.
        let next = tokens(1, cfg.vocab_size, 7);
        let out = b.step(&[step(&next, 13, &[20, 21, 22, 23], true)]).unwrap();
        let mut whole = first.clone();
        whole.extend(&next);
        close(name, "owner after sharing", &out[0], &recompute(&oracle, &p, &whole));
    }
}

#[test]
fn a_sequence_gives_the_same_bits_alone_or_batched() {
    let cfg = families().remove(1).1;
    let (mut alone, _, _) = backend(&cfg, LinearFormat::F32);
    let (mut batched, _, _) = backend(&cfg, LinearFormat::F32);
    let (a, c) = (tokens(11, cfg.vocab_size, 8), tokens(7, cfg.vocab_size, 9));
    let x = alone.step(&[step(&a, 0, &[0, 1, 2], true)]).unwrap();
    let y = batched.step(&[step(&c, 0, &[5, 6], true), step(&a, 0, &[0, 1, 2], true)]).unwrap();
    assert_eq!(x[0], y[1]);
}

#[test]
fn int8_weights_stay_close_to_f32() {
    for (name, cfg) in families() {
        let (mut f, _, _) = backend(&cfg, LinearFormat::F32);
        let (mut q, _, _) = backend(&cfg, LinearFormat::Int8);
        let stats = q.int8().unwrap();
        assert!(stats.numel() > 0 && stats.bytes() < 4 * stats.numel() / 3, "{name}: int8 holds {} bytes", stats.bytes());
        // MoE blocks' experts are int8 too: more than the dense-only scope holds, by exactly
        // their MLPs' matrices.
        let moe = int8_experts(&q);
        assert_eq!(moe > 0, cfg.moe.is_some(), "{name}: the MoE blocks' MLPs are quantized");
        let seq = tokens(12, cfg.vocab_size, 10);
        // A prompt chunk whose logits nobody wants runs no head (int8 with no rows was a panic).
        assert!(q.step(&[step(&seq[..5], 0, &[0, 1, 2], false)]).unwrap().is_empty(), "{name}");
        let want = f.step(&[step(&seq, 0, &[0, 1, 2], true)]).unwrap();
        let got = q.step(&[step(&seq, 0, &[0, 1, 2], true)]).unwrap();
        let e = rel_err(&got[0], &want[0]);
        // Int8 per-channel rounding of every projection: close, and really not f32.
        assert!(e < 0.05 && e > 1e-6, "{name}: int8 logits rel err {e:e} against f32");
    }
}

#[test]
fn bad_steps_are_refused_by_name() {
    let cfg = dense(Arch::Gpt);
    let (mut b, _, _) = backend(&cfg, LinearFormat::F32);
    let err = |b: &mut CpuBackend, steps: &[SeqStep]| b.step(steps).unwrap_err().to_string();
    assert!(err(&mut b, &[step(&[], 0, &[0], true)]).contains("no tokens"));
    assert!(err(&mut b, &[step(&[1], 40, &(0..11).collect::<Vec<_>>(), true)]).contains("exceed the model's context of 40"));
    assert!(err(&mut b, &[step(&[37], 0, &[0], true)]).contains("token 37 is outside the vocabulary of 37"));
    assert!(err(&mut b, &[step(&[1; 5], 0, &[0], true)]).contains("5 positions need 2 blocks, its table has 1"));
    assert!(err(&mut b, &[step(&[1], 0, &[32], true)]).contains("block 32 is past the cache's 32 blocks"));
    let msg = err(&mut b, &[step(&[1], 0, &[3], true), step(&[2], 0, &[3], true)]);
    assert!(msg.contains("sequences 0 and 1 of the step both write block 3"), "{msg}");
    // Reading another's block is fine: only the blocks a sequence writes are exclusive.
    b.step(&[step(&[1, 2, 3, 4], 0, &[3], false)]).unwrap();
    b.step(&[step(&[5], 4, &[3, 4], true), step(&[6], 4, &[3, 5], true)]).unwrap();
}

#[test]
fn models_the_cache_cannot_serve_are_refused() {
    let mut cfg = families().remove(3).1;
    let cap = tessera_kernels::model::Capacity { train_factor: 1.0, eval_factor: 1.5, min_capacity: 1, drop_tokens: true };
    cfg.moe.as_mut().unwrap().capacity = Some(cap);
    let model = Model::new(cfg).unwrap();
    let p = params(&model, 1);
    let opts = CpuOptions { block_size: 4, num_blocks: 4, weights: LinearFormat::F32 };
    let msg = CpuBackend::new(model, p.clone(), opts).err().unwrap().to_string();
    assert!(msg.contains("drop_tokens") && msg.contains("eval_capacity_factor 1.5"), "{msg}");
    let model = Model::new(dense(Arch::Gpt)).unwrap();
    let msg = CpuBackend::new(model, p, opts).err().unwrap().to_string();
    assert!(msg.contains("the checkpoint does not match"), "{msg}");
    let model = Model::new(dense(Arch::Gpt)).unwrap();
    let p = params(&model, 1);
    let msg = CpuBackend::new(model, p, CpuOptions { num_blocks: 0, ..opts }).err().unwrap().to_string();
    assert!(msg.contains("0 blocks of 4 positions"), "{msg}");
    assert!("fp4".parse::<LinearFormat>().unwrap_err().to_string().contains("expected `f32` or `int8`"));
}

/// transformers' logits (float64, `scripts/gen_fixtures.py hf`/`hf-moe`) of every position of two
/// sequences, against the paged forward run the way a server runs it: both prompts' first ten
/// tokens prefilled in one step, then the rest decoded a token a step, both sequences in every
/// step.
fn matches_transformers_decoding(name: &str) {
    use safetensors::SafeTensors;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf");
    let mut b = folder_backend(name);
    let bytes = std::fs::read(dir.join(format!("{name}.reference.safetensors"))).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let words = |n: &str| st.tensor(n).unwrap().data().chunks_exact(4).map(|b| [b[0], b[1], b[2], b[3]]).collect::<Vec<_>>();
    let tokens: Vec<u32> = words("tokens").into_iter().map(|w| i32::from_le_bytes(w) as u32).collect();
    let logits: Vec<f32> = words("logits").into_iter().map(f32::from_le_bytes).collect();
    let (v, t) = (b.vocab_size(), tokens.len() / 2);
    let tables: [&[u32]; 2] = [&[6, 1, 3], &[0, 7, 2]];
    let seq = |s: usize| &tokens[s * t..(s + 1) * t];
    let check = |out: &[Vec<f32>], pos: usize| {
        for s in 0..2 {
            let want = &logits[(s * t + pos) * v..][..v];
            let e = rel_err(&out[s], want);
            assert!(e < 1e-5, "{name}: sequence {s} position {pos}: rel err {e:e} against transformers");
        }
    };
    let out = b.step(&[step(&seq(0)[..10], 0, tables[0], true), step(&seq(1)[..10], 0, tables[1], true)]).unwrap();
    check(&out, 9);
    for pos in 10..t {
        let out = b.step(&[step(&seq(0)[pos..=pos], pos, tables[0], true), step(&seq(1)[pos..=pos], pos, tables[1], true)]).unwrap();
        check(&out, pos);
    }
}

#[test]
fn decoding_matches_transformers_for_every_family() {
    for name in ["gpt2", "llama", "llama-sharded", "mistral", "qwen2", "mixtral", "qwen2-moe"] {
        matches_transformers_decoding(name);
    }
}

/// A folder's model behind a backend of 8 blocks of 8 positions.
fn folder_backend(name: &str) -> CpuBackend {
    folder_backend_as(name, LinearFormat::F32)
}

/// [`folder_backend`] with `weights`.
fn folder_backend_as(name: &str, weights: LinearFormat) -> CpuBackend {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf").join(name);
    let hf = crate::hf::HfModel::open(&dir).unwrap();
    let model = Model::new(hf.config.model.clone()).unwrap();
    let params = crate::hf::read_params(hf.weights.as_ref().unwrap(), hf.config.family, &model).unwrap();
    CpuBackend::new(model, params, CpuOptions { block_size: 8, num_blocks: 8, weights }).unwrap()
}

/// transformers' greedy `generate` (float64, `scripts/gen_fixtures.py hf-generate`: prompts whose
/// every step's two best logits are at least 1e-3 apart) and the backend's greedy decoding
/// choose the same tokens.
#[test]
fn greedy_decoding_matches_transformers_generate() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/generate.json");
    let fixture: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let ids = |v: &serde_json::Value| v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect::<Vec<_>>();
    for name in ["gpt2", "llama", "mistral", "qwen2", "mixtral", "qwen2-moe"] {
        let (prompt, want) = (ids(&fixture[name]["prompt"]), ids(&fixture[name]["generated"]));
        let mut b = folder_backend(name);
        let table: Vec<u32> = (0..8).rev().collect();
        let argmax = |x: &[f32]| x.iter().enumerate().fold((0, f32::NEG_INFINITY), |m, (i, &v)| if v > m.1 { (i, v) } else { m }).0 as u32;
        let mut got = vec![argmax(&b.step(&[step(&prompt, 0, &table, true)]).unwrap()[0])];
        while got.len() < want.len() {
            let pos = prompt.len() + got.len() - 1;
            got.push(argmax(&b.step(&[step(&got[got.len() - 1..], pos, &table, true)]).unwrap()[0]));
        }
        assert_eq!(got, want, "{name}: greedy tokens against transformers' generate");
    }
}

/// Greedy decoding of `prompt` to `len` tokens: each step's logits and the tokens.
fn greedy(b: &mut CpuBackend, prompt: &[u32], len: usize) -> (Vec<Vec<f32>>, Vec<u32>) {
    let table: Vec<u32> = (0..8).rev().collect();
    let argmax = |x: &[f32]| x.iter().enumerate().fold((0, f32::NEG_INFINITY), |m, (i, &v)| if v > m.1 { (i, v) } else { m }).0 as u32;
    let mut logits = b.step(&[step(prompt, 0, &table, true)]).unwrap();
    let mut got = vec![argmax(&logits[0])];
    while got.len() < len {
        let pos = prompt.len() + got.len() - 1;
        let out = b.step(&[step(&got[got.len() - 1..], pos, &table, true)]).unwrap();
        got.push(argmax(&out[0]));
        logits.extend(out);
    }
    (logits, got)
}

/// Int8 experts (every linear int8, routers f32) on the transformers-made MoE folders: every
/// greedy step's logits within [`INT8_TOL`] of the f32 backend's, the same greedy tokens as
/// transformers' `generate`, and the same bits on a second run.
#[test]
fn int8_experts_stay_close_to_f32_on_the_moe_folders() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/generate.json");
    let fixture: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let ids = |v: &serde_json::Value| v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect::<Vec<_>>();
    for name in ["mixtral", "qwen2-moe"] {
        let (prompt, want) = (ids(&fixture[name]["prompt"]), ids(&fixture[name]["generated"]));
        let mut q = folder_backend_as(name, LinearFormat::Int8);
        assert!(int8_experts(&q) > 0, "{name}: the experts are int8");
        let (f_logits, f_tokens) = greedy(&mut folder_backend(name), &prompt, want.len());
        let (q_logits, q_tokens) = greedy(&mut q, &prompt, want.len());
        assert_eq!(f_tokens, want, "{name}: f32 greedy tokens against transformers' generate");
        assert_eq!(q_tokens, want, "{name}: int8 greedy tokens against transformers' generate");
        for (k, (got, f)) in q_logits.iter().zip(&f_logits).enumerate() {
            let e = rel_err(got, f);
            assert!(e < INT8_TOL && e > 1e-7, "{name}: step {k}: int8 logits rel err {e:e} against f32");
        }
        let (again, _) = greedy(&mut folder_backend_as(name, LinearFormat::Int8), &prompt, want.len());
        assert_eq!(again, q_logits, "{name}: int8 decoding is deterministic");
    }
}

/// Int8 logits against f32 (relative error, `rel_err`) on the MoE folders.
const INT8_TOL: f64 = 5e-2;

/// The weights of `b`'s MoE MLPs (experts, shared expert, residual MLP) it holds as int8:
/// checks its int8 weights are the dense-only scope's plus exactly those.
fn int8_experts(b: &CpuBackend) -> usize {
    let model = b.model();
    let dense = model.quantize_int8_scope(&ParamsAt::whole(&b.params, None), 0..model.units().len(), QuantScope::Dense);
    let moe: usize = (0..model.cfg.n_layer).flat_map(|l| model.block_linears(l)).filter(|l| l.moe).map(|l| l.ic * l.oc).sum();
    assert_eq!(b.int8().unwrap().numel(), dense.numel() + moe);
    moe
}

/// Under int8 the f32 pages only the replaced matrices held go back to the system: a model of
/// wider matrices (each many pages) holds well under its f32 bytes, and decodes as the int8
/// copies say (what it reads of the given-back pages is nothing: its logits stay close to f32).
#[test]
fn int8_gives_the_replaced_f32_pages_back() {
    let wide = |cfg: ModelConfig| ModelConfig { d_model: 256, d_ff: 512, vocab_size: 300, ..cfg };
    for (name, cfg) in
        [("gpt2 tied", wide(dense(Arch::Gpt))), ("llama untied", ModelConfig { tied_head: false, ..wide(dense(Arch::Llama)) })]
    {
        let (mut f, _, _) = backend(&cfg, LinearFormat::F32);
        let (mut q, _, _) = backend(&cfg, LinearFormat::Int8);
        let (fb, qb) = (f.weight_bytes(), q.weight_bytes());
        assert!(q.released > 0 && qb < fb / 2, "{name}: int8 holds {qb} bytes ({} given back), f32 {fb}", q.released);
        let seq = tokens(12, cfg.vocab_size, 10);
        let want = f.step(&[step(&seq, 0, &[0, 1, 2], true)]).unwrap();
        let got = q.step(&[step(&seq, 0, &[0, 1, 2], true)]).unwrap();
        let e = rel_err(&got[0], &want[0]);
        assert!(e < 0.05 && e > 1e-6, "{name}: int8 logits rel err {e:e} against f32");
    }
}
