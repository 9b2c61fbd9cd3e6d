//! Model folders made by transformers itself (`scripts/gen_fixtures.py hf`): Tessera's loss,
//! logits and every gradient against transformers' (float64) within f32 tolerance; import →
//! export gives the very bytes of every weight; bad folders are refused by name.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::SafeTensors;
use tessera_kernels::gradcheck::rel_err;
use tessera_kernels::model::{FlatAccess, MicroBatch, Model, Workspace};

use super::*;
use crate::checkpoint::TensorDtype;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf").join(name)
}

struct Reference {
    f32s: HashMap<String, Vec<f32>>,
    ints: HashMap<String, Vec<u32>>,
    b: usize,
    t: usize,
}

fn reference(name: &str) -> Reference {
    let bytes = std::fs::read(fixture(&format!("{name}.reference.safetensors"))).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    let meta = meta.metadata().clone().unwrap_or_default();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (mut f32s, mut ints) = (HashMap::new(), HashMap::new());
    for (n, v) in st.tensors() {
        let words = v.data().chunks_exact(4).map(|b| [b[0], b[1], b[2], b[3]]);
        match v.dtype() {
            safetensors::Dtype::F32 => drop(f32s.insert(n, words.map(f32::from_le_bytes).collect())),
            _ => drop(ints.insert(n, words.map(|w| i32::from_le_bytes(w) as u32).collect())),
        }
    }
    Reference { f32s, ints, b: meta["batch"].parse().unwrap(), t: meta["seq_len"].parse().unwrap() }
}

/// A folder's model and its parameters, as `tessera.model = DIR` builds them.
fn open(dir: &Path) -> (HfModel, Model, Vec<f32>) {
    let hf = HfModel::open(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let model = Model::new(hf.config.model.clone()).unwrap();
    let params = read_params(hf.weights.as_ref().expect("weights"), hf.config.family, &model).unwrap();
    (hf, model, params)
}

/// Loss, every gradient (by Hugging Face name) and the logits of each sequence's positions
/// against transformers'.
fn matches_transformers(name: &str) {
    let (hf, model, params) = open(&fixture(name));
    let r = reference(name);
    let (tokens, targets) = (&r.ints["tokens"], &r.ints["targets"]);
    let mut grads = vec![0.0; params.len()];
    let mut ws = Workspace::default();
    let mut acc = FlatAccess { params: &params, grads: &mut grads, units: model.units() };
    let loss = model.forward_backward(&mut acc, MicroBatch { tokens, targets, b: r.b, t: r.t, noise_key: 0 }, 1.0, &mut ws);
    let want = r.f32s["loss"][0];
    assert!(((loss - want) / want).abs() < 1e-5, "{name}: loss {loss}, transformers {want}");
    // MoE models: transformers' load-balancing loss of the same routing (the gradients are of
    // cross-entropy + its weight times it).
    if let Some(want) = r.f32s.get("aux_loss") {
        let aux = ws.moe_stats().aux_loss;
        assert!(((aux - want[0]) / want[0]).abs() < 1e-5, "{name}: aux loss {aux}, transformers {}", want[0]);
    }
    let mut compared = 0;
    for spec in model.layout().specs() {
        for piece in pieces(hf.config.family, &model.cfg, spec).unwrap() {
            let got = extract(&grads[spec.range()], matrix(spec), &piece);
            let want = &reference_grad(&r, &piece.name, model.cfg.moe.as_ref().map_or(0, |m| m.d_expert))
                .unwrap_or_else(|| panic!("{name}: the reference has no gradient for {}", piece.name));
            let e = rel_err(&got, want);
            assert!(e < 1e-4, "{name}: gradient of {} differs from transformers': rel err {e:e}", piece.name);
            compared += 1;
        }
    }
    // transformers 5 keeps each MoE block's experts fused in memory (two tensors for all of
    // them, which the reference's gradients are of) and writes them one by one.
    let hf_params: usize = r
        .f32s
        .keys()
        .filter(|k| k.starts_with("grad."))
        .map(|k| {
            if k.ends_with("experts.gate_up_proj") {
                2 * model.cfg.moe.as_ref().unwrap().num_experts
            } else if k.ends_with("experts.down_proj") {
                model.cfg.moe.as_ref().unwrap().num_experts
            } else {
                1
            }
        })
        .sum();
    assert_eq!(compared, hf_params, "{name}: every parameter transformers trains has a gradient here");
    let v = model.cfg.vocab_size;
    for s in 0..r.b {
        for pos in [0, r.t / 2, r.t - 1] {
            let got = model.next_token_logits(&params, &tokens[s * r.t..s * r.t + pos + 1], &mut ws);
            let row = (s * r.t + pos) * v;
            let e = rel_err(&got, &r.f32s["logits"][row..row + v]);
            assert!(e < 1e-5, "{name}: logits of sequence {s} position {pos}: rel err {e:e}");
        }
    }
}

/// The reference gradient of the tensor a folder names `name`: the tensor's own, or for an
/// expert's projection its part of the fused in-memory `experts.gate_up_proj` `[E, 2f, c]` (gate
/// rows first) or `experts.down_proj` `[E, c, f]`; Mixtral's `block_sparse_moe.` is `mlp.` in memory.
fn reference_grad(r: &Reference, name: &str, f: usize) -> Option<Vec<f32>> {
    if let Some(g) = r.f32s.get(&format!("grad.{name}")) {
        return Some(g.clone());
    }
    let name = name.replace(".block_sparse_moe.", ".mlp.");
    if let Some(g) = r.f32s.get(&format!("grad.{name}")) {
        return Some(g.clone());
    }
    let (head, tail) = name.split_once(".mlp.experts.")?;
    let (e, proj) = tail.split_once('.')?;
    let e: usize = e.parse().ok()?;
    let (fused, rows) = match proj {
        "w1.weight" | "gate_proj.weight" => ("gate_up_proj", 0..f),
        "w3.weight" | "up_proj.weight" => ("gate_up_proj", f..2 * f),
        "w2.weight" | "down_proj.weight" => ("down_proj", 0..0),
        _ => return None,
    };
    let all = r.f32s.get(&format!("grad.{head}.mlp.experts.{fused}"))?;
    // c from the block's norm, the expert count from the router's gradient `[E, c]`.
    let c = r.f32s.get(&format!("grad.{head}.input_layernorm.weight"))?.len();
    let experts = r.f32s.get(&format!("grad.{head}.mlp.gate.weight"))?.len() / c;
    let block = all.len() / experts;
    let one = &all[e * block..(e + 1) * block];
    Some(if fused == "gate_up_proj" { one[rows.start * c..rows.end * c].to_vec() } else { one.to_vec() })
}

#[test]
fn gpt2_matches_transformers() {
    matches_transformers("gpt2");
}

#[test]
fn llama3_with_grouped_queries_scaled_rope_and_untied_head_matches_transformers() {
    let (hf, ..) = open(&fixture("llama"));
    let m = &hf.config.model;
    assert!(m.n_kv_head < m.n_head && !m.tied_head && m.rope_scaling.is_some(), "{m:?}");
    matches_transformers("llama");
}

#[test]
fn sharded_tied_llama_matches_transformers() {
    let (hf, ..) = open(&fixture("llama-sharded"));
    assert!(hf.weights.as_ref().unwrap().files.len() > 1 && hf.config.model.tied_head);
    matches_transformers("llama-sharded");
}

#[test]
fn mistral_matches_transformers() {
    matches_transformers("mistral");
}

#[test]
fn qwen2_with_qkv_biases_matches_transformers() {
    let (hf, ..) = open(&fixture("qwen2"));
    assert!(hf.config.model.qkv_bias);
    matches_transformers("qwen2");
}

#[test]
fn mixtral_with_its_load_balancing_loss_matches_transformers() {
    let (hf, ..) = open(&fixture("mixtral"));
    assert!(hf.config.model.moe.as_ref().is_some_and(|m| m.aux_loss_coef == 0.02), "output_router_logits: the aux loss is trained");
    matches_transformers("mixtral");
}

#[test]
fn qwen2_moe_with_a_dense_block_and_a_shared_expert_matches_transformers() {
    let (hf, ..) = open(&fixture("qwen2-moe"));
    let m = hf.config.model.moe.as_ref().unwrap();
    assert!(m.shared_expert.is_some() && m.dense_layers == [0] && !m.norm_topk && hf.config.model.qkv_bias);
    matches_transformers("qwen2-moe");
}

/// Every tensor of every `.safetensors` file of `dir`: name → (dtype, shape, bytes).
fn weights_of(dir: &Path) -> HashMap<String, (String, Vec<usize>, Vec<u8>)> {
    let mut out = HashMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let path = e.unwrap().path();
        if path.extension().is_some_and(|x| x == "safetensors") {
            let bytes = std::fs::read(&path).unwrap();
            for (n, v) in SafeTensors::deserialize(&bytes).unwrap().tensors() {
                out.insert(n, (format!("{:?}", v.dtype()), v.shape().to_vec(), v.data().to_vec()));
            }
        }
    }
    out
}

#[test]
fn import_then_export_gives_the_same_bytes_for_every_family() {
    for name in ["gpt2", "llama", "llama-sharded", "mistral", "qwen2", "mixtral", "qwen2-moe"] {
        let dir = fixture(name);
        let (hf, model, params) = open(&dir);
        let out = tempfile::tempdir().unwrap();
        // Shards of at most 100 kB where the fixture was saved so.
        let sharded = hf.weights.as_ref().unwrap().files.len() > 1;
        let shard_bytes = if sharded { 100_000 } else { SHARD_BYTES_MAX };
        let dtype = recorded_dtype(Some(&hf.config.doc));
        let doc = config_doc(hf.config.family, &model.cfg, Some(&hf.config.doc), dtype);
        let format = WeightFormat { dtype, shard_bytes_max: shard_bytes };
        let exported = export(out.path(), hf.config.family, (&model, &params), &doc, &[], format).unwrap();
        assert_eq!(weights_of(out.path()), weights_of(&dir), "{name}: exported weights differ from the folder's");
        assert_eq!(exported.files.len() > 2, sharded, "{name}: {:?}", exported.files);
        if sharded {
            // The index: transformers' metadata, and a shard for every tensor the folder's names.
            let index = |d: &Path| -> serde_json::Value {
                serde_json::from_slice(&std::fs::read(d.join("model.safetensors.index.json")).unwrap()).unwrap()
            };
            let (ours, theirs) = (index(out.path()), index(&dir));
            assert_eq!(ours["metadata"], theirs["metadata"], "{name}");
            let keys = |v: &serde_json::Value| v["weight_map"].as_object().unwrap().keys().cloned().collect::<Vec<_>>();
            assert_eq!(keys(&ours), keys(&theirs), "{name}");
        }
        // The export reads back as the same model.
        let (again, model2, params2) = open(out.path());
        assert_eq!((again.config.model, params2), (model2.cfg.clone(), params), "{name}");
    }
}

/// A bf16 folder (most published models are) exports as bf16 again, byte for byte, with its
/// config saying so; the f32 values it was written from are rounded to nearest even.
#[test]
fn a_bf16_folder_exports_as_bf16_with_the_same_bytes() {
    let (hf, model, params) = open(&fixture("llama"));
    let family = hf.config.family;
    let mut doc = config_doc(family, &model.cfg, Some(&hf.config.doc), TensorDtype::Bf16);
    doc["torch_dtype"] = "bfloat16".into();
    let bf16 = WeightFormat { dtype: TensorDtype::Bf16, shard_bytes_max: SHARD_BYTES_MAX };
    let first = tempfile::tempdir().unwrap();
    export(first.path(), family, (&model, &params), &doc, &[], bf16).unwrap();
    let (hf1, model1, read) = open(first.path());
    assert_eq!(read, params.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect::<Vec<_>>());
    assert!(params.iter().zip(&read).any(|(a, b)| a != b), "the fixture's f32 values were all bf16 already");
    let dtype = recorded_dtype(Some(&hf1.config.doc));
    assert_eq!(dtype, TensorDtype::Bf16);
    let again = tempfile::tempdir().unwrap();
    let doc1 = config_doc(family, &model1.cfg, Some(&hf1.config.doc), dtype);
    export(again.path(), family, (&model1, &read), &doc1, &[], WeightFormat { dtype, shard_bytes_max: SHARD_BYTES_MAX }).unwrap();
    let (w1, w2) = (weights_of(first.path()), weights_of(again.path()));
    assert_eq!(w1, w2, "bf16 import → export changed bytes");
    assert!(w1.values().all(|(dt, ..)| dt == "BF16"), "{:?}", w1.values().map(|v| &v.0).collect::<Vec<_>>());
    let written: serde_json::Value = serde_json::from_slice(&std::fs::read(again.path().join(CONFIG_FILE)).unwrap()).unwrap();
    assert_eq!(written["torch_dtype"], "bfloat16");
}

/// A copy of fixture `name` whose config.json has `edit` applied.
fn edited(name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, tmp.path().join(p.file_name().unwrap())).unwrap();
    }
    let path = tmp.path().join(CONFIG_FILE);
    let mut doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut doc);
    std::fs::write(&path, serde_json::to_vec(&doc).unwrap()).unwrap();
    tmp
}

fn refusal(name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> String {
    let tmp = edited(name, edit);
    HfModel::open(tmp.path()).map(|_| ()).expect_err("should be refused").to_string()
}

#[test]
fn unsupported_architectures_keys_and_values_are_refused_by_name() {
    let e = refusal("llama", |d| d["architectures"] = serde_json::json!(["FalconForCausalLM"]));
    assert!(e.contains("config.json: key `architectures` = \"FalconForCausalLM\": expected one of GPT2LMHeadModel"), "{e}");
    let e = refusal("llama", |d| d["hidden_act"] = "gelu".into());
    assert!(e.contains("key `hidden_act` = \"gelu\": expected \"silu\""), "{e}");
    let e = refusal("llama", |d| d["some_new_switch"] = true.into());
    assert!(e.contains("key `some_new_switch` = true: expected no such key in a LlamaForCausalLM config"), "{e}");
    let e = refusal("llama", |d| d["rope_parameters"]["rope_type"] = "yarn".into());
    assert!(e.contains("key `rope_parameters.rope_type` = \"yarn\": expected \"default\" or \"llama3\""), "{e}");
    let e = refusal("gpt2", |d| d["layer_norm_epsilon"] = 1e-6.into());
    assert!(e.contains("key `layer_norm_epsilon` = 1e-6: expected 1e-5"), "{e}");
    let e = refusal("qwen2", |d| d["use_sliding_window"] = true.into());
    assert!(e.contains("key `use_sliding_window` = true"), "{e}");
    let e = refusal("llama", |d| d["num_key_value_heads"] = 3.into());
    assert!(e.contains("n_kv_head 3 does not divide n_head 4"), "{e}");
}

#[test]
fn weights_that_do_not_fit_the_config_are_refused_by_tensor() {
    // One layer more than the file holds: its tensors are missing.
    let e = refusal("llama", |d| d["num_hidden_layers"] = 3.into());
    assert!(e.contains("tensor `model.layers.2.") && e.contains("missing"), "{e}");
    // A wider MLP: the shapes differ.
    let e = refusal("mistral", |d| d["intermediate_size"] = 200.into());
    assert!(e.contains("mlp.down_proj.weight`: shape [64, 176], the config implies [64, 200]"), "{e}");
    // Tied, but the file's lm_head.weight is not the embedding.
    let tmp = edited("llama", |d| d["tie_word_embeddings"] = true.into());
    let hf = HfModel::open(tmp.path()).unwrap();
    let model = Model::new(hf.config.model.clone()).unwrap();
    let e = read_params(hf.weights.as_ref().unwrap(), hf.config.family, &model).unwrap_err().to_string();
    assert!(e.contains("tensor `lm_head.weight`: differs from the embedding, but the config ties them"), "{e}");
}

#[test]
fn a_folder_without_weights_is_a_shape_to_initialise() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(fixture("llama").join(CONFIG_FILE), tmp.path().join(CONFIG_FILE)).unwrap();
    let hf = HfModel::open(tmp.path()).unwrap();
    assert!(hf.weights.is_none());
    std::fs::write(tmp.path().join("pytorch_model.bin"), b"pickle").unwrap();
    let e = HfModel::open(tmp.path()).unwrap_err().to_string();
    assert!(e.contains("pytorch_model.bin") && e.contains("convert them to safetensors"), "{e}");
}

/// A preset exports as its family (GPT-2 for gpt-tiny): transformers' names, the tied head left
/// out, its own config; exporting again replaces the files and leaves no temporary ones; the
/// folder reads back as the same model.
#[test]
fn a_preset_exports_as_gpt2_and_reads_back() {
    let mut cfg = crate::zoo::preset("gpt-tiny").unwrap();
    cfg.vocab_size = 11;
    let model = Model::new(cfg).unwrap();
    let params = model.init_params(3);
    let family = default_family(&model.cfg);
    let doc = config_doc(family, &model.cfg, None, TensorDtype::F32);
    let tmp = tempfile::tempdir().unwrap();
    let f32s = WeightFormat { dtype: TensorDtype::F32, shard_bytes_max: SHARD_BYTES_MAX };
    let written = export(tmp.path(), family, (&model, &params), &doc, &[("tokenizer.json", b"{}".to_vec())], f32s).unwrap();
    assert_eq!(written.files, ["model.safetensors", "config.json", "tokenizer.json"]);
    let weights = weights_of(tmp.path());
    assert!(weights.contains_key("transformer.h.3.attn.c_attn.weight") && !weights.contains_key("lm_head.weight"));
    assert_eq!(weights["transformer.h.0.mlp.c_proj.weight"].1, [512, 128]);
    export(tmp.path(), family, (&model, &params), &doc, &[], f32s).unwrap();
    assert!(std::fs::read_dir(tmp.path()).unwrap().all(|e| !e.unwrap().file_name().to_string_lossy().contains(".tmp")));
    let (hf, again, read) = open(tmp.path());
    assert_eq!((hf.config.family, &again.cfg, read), (Family::Gpt2, &model.cfg, params));
}

/// The folder's `eos_token_id` names the token put between documents, through its tokenizer.
#[test]
fn the_folders_end_of_sequence_token_separates_documents() {
    let dir = fixture("llama");
    assert_eq!(folder_end_of_text(dir.to_str().unwrap()).as_deref(), Some("<|endoftext|>"));
    let tmp = edited("llama", |d| d["eos_token_id"] = serde_json::json!([7, 319]));
    let path = tmp.path().join(TOKENIZER_FILE);
    let mut tok: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    tok["added_tokens"].as_array_mut().unwrap().push(serde_json::json!({"id": 7, "content": "</s>", "special": true}));
    std::fs::write(&path, serde_json::to_vec(&tok).unwrap()).unwrap();
    assert_eq!(folder_end_of_text(tmp.path().to_str().unwrap()).as_deref(), Some("</s>"));
    assert_eq!(folder_end_of_text("gpt-tiny"), None, "a preset has none");
}

/// A copy of fixture `name` with `edit` applied to the copied folder.
fn copy_with(name: &str, edit: impl FnOnce(&Path)) -> tempfile::TempDir {
    let tmp = edited(name, |_| {});
    edit(tmp.path());
    tmp
}

#[test]
fn a_folder_without_its_config_json_is_refused_naming_the_file() {
    let tmp = copy_with("llama", |d| std::fs::remove_file(d.join(CONFIG_FILE)).unwrap());
    let e = HfModel::open(tmp.path()).unwrap_err().to_string();
    let file = tmp.path().join(CONFIG_FILE).display().to_string();
    assert!(e.starts_with(&format!("{file}: missing:")) && e.contains("is no Hugging Face model folder"), "{e}");
    let e = crate::zoo::resolve(tmp.path().to_str().unwrap()).unwrap_err();
    assert!(e.contains(&file), "{e}");
}

#[test]
fn a_missing_shard_is_refused_naming_the_index_key_and_the_file() {
    let shard = "model-00003-of-00006.safetensors";
    let tmp = copy_with("llama-sharded", |d| std::fs::remove_file(d.join(shard)).unwrap());
    let e = HfModel::open(tmp.path()).unwrap_err().to_string();
    assert!(e.contains("model.safetensors.index.json: key `weight_map.model.layers."), "{e}");
    assert!(e.contains(&format!("= \"{shard}\": expected a shard in this folder, but")) && e.contains("is missing"), "{e}");
}

#[test]
fn a_truncated_safetensors_file_is_refused_naming_the_file_and_tensor() {
    for (name, file) in [("llama", "model.safetensors"), ("llama-sharded", "model-00002-of-00006.safetensors")] {
        let bytes = std::fs::read(fixture(name).join(file)).unwrap();
        // Cut in the data: the last tensor of the file lacks its end.
        let tmp = copy_with(name, |d| std::fs::write(d.join(file), &bytes[..bytes.len() - 100]).unwrap());
        let e = HfModel::open(tmp.path()).unwrap_err().to_string();
        let path = tmp.path().join(file).display().to_string();
        assert!(e.starts_with(&format!("{path}: tensor `")) && e.contains("the file is truncated"), "{name}: {e}");
        // Cut in the header, and before the header's length.
        for keep in [20, 5] {
            let tmp = copy_with(name, |d| std::fs::write(d.join(file), &bytes[..keep]).unwrap());
            let e = HfModel::open(tmp.path()).unwrap_err().to_string();
            assert!(e.starts_with(&format!("{}: truncated: {keep} bytes", tmp.path().join(file).display())), "{name}: {e}");
        }
    }
}

/// Writes `file` of folder `dir` as `doc`.
fn put(dir: &Path, file: &str, doc: serde_json::Value) {
    std::fs::write(dir.join(file), serde_json::to_vec_pretty(&doc).unwrap()).unwrap();
}

/// The folder's tokenizer says whether a document opens with a beginning-of-sequence token:
/// `add_bos_token` with its `bos_token` (or config.json's `bos_token_id`), else the
/// tokenizer.json template's first special token; never the end-of-sequence token itself.
#[test]
fn the_folders_beginning_of_sequence_token_opens_documents_when_its_tokenizer_adds_one() {
    let dir = fixture("llama");
    assert_eq!(folder_begin_of_text(dir.to_str().unwrap()), None, "the fixture's tokenizer adds none");
    let tmp = edited("llama", |d| d["bos_token_id"] = 7.into());
    let folder = tmp.path().to_str().unwrap();
    let path = tmp.path().join(TOKENIZER_FILE);
    let mut tok: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    tok["added_tokens"].as_array_mut().unwrap().push(serde_json::json!({"id": 7, "content": "<s>", "special": true}));
    put(tmp.path(), TOKENIZER_FILE, tok.clone());
    put(tmp.path(), "tokenizer_config.json", serde_json::json!({"add_bos_token": true, "bos_token": {"content": "<|begin|>"}}));
    assert_eq!(folder_begin_of_text(folder).as_deref(), Some("<|begin|>"), "tokenizer_config.json's bos_token");
    put(tmp.path(), "tokenizer_config.json", serde_json::json!({"add_bos_token": true}));
    assert_eq!(folder_begin_of_text(folder).as_deref(), Some("<s>"), "config.json's bos_token_id");
    put(tmp.path(), "tokenizer_config.json", serde_json::json!({"add_bos_token": true, "bos_token": "<|endoftext|>"}));
    assert_eq!(folder_begin_of_text(folder), None, "the end-of-sequence token is not put twice");
    // LLaMA 3: no flag, the post-processor's template adds it.
    tok["post_processor"] = serde_json::json!({"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
         "pair": [], "special_tokens": {}}]});
    put(tmp.path(), TOKENIZER_FILE, tok);
    put(tmp.path(), "tokenizer_config.json", serde_json::json!({"chat_template": "{{ messages }}"}));
    assert_eq!(folder_begin_of_text(folder).as_deref(), Some("<s>"), "the template's first token");
    put(tmp.path(), "tokenizer_config.json", serde_json::json!({"add_bos_token": false}));
    assert_eq!(folder_begin_of_text(folder), None, "add_bos_token false wins over the template");
    assert_eq!(folder_begin_of_text("gpt-tiny"), None, "a preset has none");
}

/// The folder's tokenizer and generation settings are read when it is opened; a checkpoint
/// records the tokenizer's only when the run uses the folder's own tokenizer.json.
#[test]
fn the_folders_tokenizer_and_generation_settings_are_recorded_as_they_are() {
    let tmp = edited("llama", |_| {});
    let settings = "{\n  \"add_bos_token\": false,\n  \"chat_template\": \"{% for m in messages %}{{ m['content'] }}{% endfor %}\"\n}\n";
    std::fs::write(tmp.path().join("tokenizer_config.json"), settings).unwrap();
    std::fs::write(tmp.path().join("chat_template.jinja"), "{{ bos_token }}\n").unwrap();
    let hf = HfModel::open(tmp.path()).unwrap();
    let generation = std::fs::read_to_string(tmp.path().join("generation_config.json")).unwrap();
    let own = tmp.path().join(TOKENIZER_FILE);
    let recorded = hf.recorded_files(own.to_str());
    let want = serde_json::json!({
        "chat_template.jinja": "{{ bos_token }}\n",
        "generation_config.json": generation,
        "tokenizer_config.json": settings,
    });
    assert_eq!(recorded, want);
    let other = tempfile::tempdir().unwrap();
    let copy = other.path().join(TOKENIZER_FILE);
    std::fs::copy(&own, &copy).unwrap();
    assert_eq!(hf.recorded_files(copy.to_str()), serde_json::json!({ "generation_config.json": generation }), "another tokenizer");
    assert_eq!(hf.recorded_files(None), serde_json::json!({ "generation_config.json": generation }), "byte-level");
    std::fs::write(tmp.path().join("special_tokens_map.json"), b"{\"bos_token\": ").unwrap();
    let e = HfModel::open(tmp.path()).unwrap_err().to_string();
    assert!(e.starts_with(&format!("{}: not JSON", tmp.path().join("special_tokens_map.json").display())), "{e}");
}

/// The config.json of fixture `name` with `edit` applied, read (not yet checked against the
/// kernels) into a shape, or the refusal.
fn read_edited(name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> Result<HfConfig, String> {
    let mut doc: serde_json::Value = serde_json::from_slice(&std::fs::read(fixture(name).join(CONFIG_FILE)).unwrap()).unwrap();
    edit(&mut doc);
    config::read("config.json", &doc).map_err(|e| e.to_string())
}

#[test]
fn mixtral_and_qwen2_moe_configs_read_into_their_mixtures() {
    use tessera_kernels::model::{AuxLoss, Gating, NoisyGate};
    let hf = read_edited("mixtral", |_| {}).unwrap();
    assert_eq!(hf.family, Family::Mixtral);
    let (c, m) = (&hf.model, hf.model.moe.as_ref().unwrap());
    assert_eq!((c.d_model, c.n_layer, c.n_head, c.n_kv_head, c.tied_head, c.qkv_bias), (32, 2, 4, 2, false, false));
    assert_eq!((m.num_experts, m.top_k, m.d_expert, m.sparse_step, m.dense_layers.as_slice()), (4, 2, 32, 1, &[][..]));
    assert_eq!((m.gating, m.norm_topk, m.capacity, m.noisy_gate), (Gating::SoftmaxThenTopK, true, None, NoisyGate::None));
    assert_eq!((m.aux_loss, m.aux_loss_coef, m.z_loss_coef, m.shared_expert), (AuxLoss::AcrossLayers, 0.02, 0.0, None));
    // transformers adds the aux loss to its `loss` only with output_router_logits.
    let off = read_edited("mixtral", |d| d["output_router_logits"] = false.into()).unwrap();
    assert_eq!(off.model.moe.unwrap().aux_loss_coef, 0.0);
    let hf = read_edited("qwen2-moe", |_| {}).unwrap();
    assert_eq!(hf.family, Family::Qwen2Moe);
    let (c, m) = (&hf.model, hf.model.moe.as_ref().unwrap());
    assert_eq!((c.d_ff, c.qkv_bias), (48, true));
    assert_eq!((m.num_experts, m.top_k, m.d_expert, m.shared_expert), (4, 2, 24, Some(40)));
    assert_eq!((m.norm_topk, m.sparse_step, m.dense_layers.as_slice(), m.aux_loss_coef), (false, 1, &[0][..], 0.0));
    let no_bias = read_edited("qwen2-moe", |d| d["qkv_bias"] = false.into()).unwrap();
    assert!(!no_bias.model.qkv_bias);
    // Mixtral's sliding window bounds the context, as Mistral's.
    let w = read_edited("mixtral", |d| d["sliding_window"] = 16.into()).unwrap();
    assert_eq!(w.model.max_seq_len, 16);
}

#[test]
fn moe_keys_tessera_cannot_honour_are_refused_by_name() {
    let e = read_edited("mixtral", |d| d["router_jitter_noise"] = 0.01.into()).unwrap_err();
    assert!(e.contains("config.json: key `router_jitter_noise` = 0.01: expected 0"), "{e}");
    let e = read_edited("mixtral", |d| d["num_experts_per_tok"] = 5.into()).unwrap_err();
    assert!(e.contains("key `num_experts_per_tok` = 5: expected at most num_local_experts = 4"), "{e}");
    let e = read_edited("qwen2-moe", |d| d["num_experts_per_tok"] = 9.into()).unwrap_err();
    assert!(e.contains("key `num_experts_per_tok` = 9: expected at most num_experts = 4"), "{e}");
    let e = read_edited("qwen2-moe", |d| d["mlp_only_layers"] = serde_json::json!([2])).unwrap_err();
    assert!(e.contains("key `mlp_only_layers` = [2]: expected a list of layer indices below num_hidden_layers = 2"), "{e}");
    let e = read_edited("qwen2-moe", |d| d["router_aux_loss_coef"] = (-1.0).into()).unwrap_err();
    assert!(e.contains("key `router_aux_loss_coef` = -1.0: expected a number >= 0"), "{e}");
    let e = read_edited("mixtral", |d| d["num_experts"] = 4.into()).unwrap_err();
    assert!(e.contains("key `num_experts` = 4: expected no such key in a MixtralForCausalLM config"), "{e}");
    let e = read_edited("qwen2-moe", |d| d["use_sliding_window"] = true.into()).unwrap_err();
    assert!(e.contains("key `use_sliding_window` = true"), "{e}");
}

/// A copy of fixture `name` whose `model.safetensors` holds what `edit` leaves of its tensors.
fn with_tensors(name: &str, edit: impl FnOnce(&mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>)) -> tempfile::TempDir {
    let bytes = std::fs::read(fixture(name).join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<_> = st.tensors().into_iter().map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec())).collect();
    edit(&mut tensors);
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, dt, shape, data)| (n.clone(), safetensors::tensor::TensorView::new(*dt, shape.clone(), data).unwrap()))
        .collect();
    let out = safetensors::serialize(views, None).unwrap();
    copy_with(name, |d| std::fs::write(d.join("model.safetensors"), out).unwrap())
}

#[test]
fn moe_folders_whose_tensors_do_not_fit_are_refused_by_file_and_tensor() {
    // One expert fewer in the config than in the file: the router's shape differs.
    let e = refusal("mixtral", |d| d["num_local_experts"] = 3.into());
    assert!(e.contains("block_sparse_moe.gate.weight`: shape [4, 32], the config implies [3, 32]"), "{e}");
    let e = refusal("qwen2-moe", |d| d["num_experts"] = 3.into());
    assert!(e.contains("mlp.gate.weight`: shape [4, 32], the config implies [3, 32]"), "{e}");
    // An expert's tensor missing from the file.
    let gone = "model.layers.1.block_sparse_moe.experts.3.w2.weight";
    let tmp = with_tensors("mixtral", |t| t.retain(|(n, ..)| n != gone));
    let e = HfModel::open(tmp.path()).unwrap_err().to_string();
    assert!(e.contains(&format!("tensor `{gone}`")) && e.contains("missing"), "{e}");
    assert!(e.contains(&tmp.path().join("model.safetensors").display().to_string()) || e.contains("model.safetensors"), "{e}");
    // An expert of the wrong width.
    let e = refusal("qwen2-moe", |d| d["moe_intermediate_size"] = 16.into());
    assert!(e.contains("mlp.experts.0.") && e.contains("the config implies"), "{e}");
    // More experts per token than there are.
    let e = refusal("mixtral", |d| d["num_experts_per_tok"] = 6.into());
    assert!(e.contains("config.json: key `num_experts_per_tok` = 6: expected at most num_local_experts = 4"), "{e}");
}

/// `mixtral-tiny` exports as a Mixtral folder whose config.json reads back as the same shape
/// (experts, top-k, the trained aux-loss weight).
#[test]
fn the_mixtral_preset_exports_as_mixtral_and_reads_back() {
    let model = Model::new(crate::zoo::preset("mixtral-tiny").unwrap()).unwrap();
    let params = model.init_params(5);
    let family = default_family(&model.cfg);
    assert_eq!(family, Family::Mixtral);
    let doc = config_doc(family, &model.cfg, None, TensorDtype::F32);
    assert_eq!((doc["router_aux_loss_coef"].as_f64(), doc["output_router_logits"].as_bool()), (Some(0.02), Some(true)));
    let tmp = tempfile::tempdir().unwrap();
    let f32s = WeightFormat { dtype: TensorDtype::F32, shard_bytes_max: SHARD_BYTES_MAX };
    export(tmp.path(), family, (&model, &params), &doc, &[], f32s).unwrap();
    assert!(weights_of(tmp.path()).contains_key("model.layers.3.block_sparse_moe.experts.3.w2.weight"));
    let (hf, again, read) = open(tmp.path());
    assert_eq!((hf.config.family, &again.cfg, read), (Family::Mixtral, &model.cfg, params));
}

/// An MoE model a family cannot express is refused at export, saying what it lacks, before any
/// file is written.
#[test]
fn an_moe_model_its_family_cannot_express_is_not_exported() {
    let (hf, model, params) = open(&fixture("qwen2-moe"));
    let f32s = WeightFormat { dtype: TensorDtype::F32, shard_bytes_max: SHARD_BYTES_MAX };
    let tmp = tempfile::tempdir().unwrap();
    let doc = config_doc(Family::Mixtral, &model.cfg, None, TensorDtype::F32);
    let e = export(tmp.path(), Family::Mixtral, (&model, &params), &doc, &[], f32s).unwrap_err().to_string();
    assert!(e.contains("dense blocks, which a MixtralForCausalLM folder cannot express"), "{e}");
    let e = export(tmp.path(), Family::Qwen2, (&model, &params), &hf.config.doc, &[], f32s).unwrap_err().to_string();
    assert!(e.contains("experts, which a Qwen2ForCausalLM folder cannot express"), "{e}");
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0, "nothing written");
}
