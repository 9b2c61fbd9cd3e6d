//! Hugging Face model folders through the CLI: `--model DIR` trains (one and two workers give
//! the same bits, a resume continues them), its checkpoint alone rebuilds the model for
//! `generate` and `export` once the folder is gone, and the export reads back as those
//! parameters; a folder without weights pre-trains from the seed; a bad config is refused.

use std::path::{Path, PathBuf};

use crate::common::*;

/// A copy of fixture folder `name` (only the files `keep` accepts) under `dir`.
fn copy_fixture(name: &str, dir: &Path, keep: impl Fn(&str) -> bool) -> PathBuf {
    let to = dir.join(name);
    std::fs::create_dir_all(&to).unwrap();
    for e in std::fs::read_dir(repo().join("tests/fixtures/hf").join(name)).unwrap() {
        let p = e.unwrap().path();
        let file = p.file_name().unwrap().to_str().unwrap().to_string();
        if keep(&file) {
            std::fs::copy(&p, to.join(&file)).unwrap();
        }
    }
    to
}

fn text(dir: &Path) -> PathBuf {
    let line = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife.\n";
    write(dir, "austen.txt", &line.repeat(60))
}

fn train(model: &Path, data: &Path, out: &Path, steps: &str, more: &[&str]) -> String {
    let cfg = repo().join("configs/gpt-tiny.json");
    let mut a = vec!["train", "--config", cfg.to_str().unwrap(), "--model", model.to_str().unwrap(), "--data", data.to_str().unwrap()];
    a.extend_from_slice(&["--output", out.to_str().unwrap(), "--steps", steps, "--no-progress"]);
    a.extend_from_slice(FAST);
    a.extend_from_slice(more);
    ok(&a, out.parent().unwrap())
}

#[test]
fn a_llama_folder_trains_resumes_generates_and_exports_from_its_checkpoint_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let model = copy_fixture("llama", tmp.path(), |_| true);
    // The folder's own tokenizer settings (a chat template) travel to the export byte for byte.
    let settings = "{\n  \"add_bos_token\": false,\n  \"chat_template\": \"{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}\",\n  \"eos_token\": \"<|endoftext|>\",\n  \"model_max_length\": 64,\n  \"tokenizer_class\": \"PreTrainedTokenizerFast\"\n}\n";
    write(&model, "tokenizer_config.json", settings);
    write(&model, "special_tokens_map.json", "{\"eos_token\": \"<|endoftext|>\"}");
    let carried: Vec<(&str, Vec<u8>)> = ["tokenizer_config.json", "special_tokens_map.json", "generation_config.json"]
        .map(|f| (f, std::fs::read(model.join(f)).unwrap()))
        .into();
    let data = text(tmp.path());
    let (one, two, split) = (tmp.path().join("one"), tmp.path().join("two"), tmp.path().join("split"));
    let stage = |s: &'static str| ["--set", s];
    train(&model, &data, &one, "4", &["--world", "1"]);
    train(&model, &data, &two, "4", &[&["--world", "2"][..], &stage("zero_optimization.stage=3")].concat());
    train(&model, &data, &split, "2", &[&["--world", "2"][..], &stage("zero_optimization.stage=1")].concat());
    let ckpt = split.join("checkpoints");
    train(&model, &data, &split, "4", &["--world", "1", "--resume", ckpt.to_str().unwrap()]);
    // With a learning rate of 0 a step changes nothing: the run starts from the folder's weights.
    let frozen = tmp.path().join("frozen");
    train(&model, &data, &frozen, "1", &["--world", "1", "--set", "optimizer.params.lr=0"]);
    let hf = tessera::hf::HfModel::open(&model).unwrap();
    let m = tessera_kernels::model::Model::new(hf.config.model.clone()).unwrap();
    let weights = tessera::hf::read_params(hf.weights.as_ref().unwrap(), hf.config.family, &m).unwrap();
    let views: Vec<(&str, &[f32])> = m.layout().specs().iter().map(|s| (s.name.as_str(), &weights[s.range()])).collect();
    assert_eq!(summary(&frozen)["params_blake3"].as_str(), Some(tessera::checkpoint::params_blake3(&views).as_str()));
    let bits = summary(&one)["params_blake3"].clone();
    assert_eq!(bits.as_str().map(str::len), Some(64), "{}", summary(&one));
    assert_eq!(summary(&two)["params_blake3"], bits, "two workers under ZeRO-3 differ from one");
    assert_eq!(summary(&split)["params_blake3"], bits, "2 steps + resume + 2 differ from 4 straight");

    // A resume is refused when the folder's config changed since.
    let config = model.join("config.json");
    let doc = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, doc.replacen("\"rope_theta\": 500000.0", "\"rope_theta\": 10000.0", 1)).unwrap();
    let cfg = repo().join("configs/gpt-tiny.json");
    let resume = ["train", "--config", cfg.to_str().unwrap(), "--model", model.to_str().unwrap(), "--data", data.to_str().unwrap()];
    let said = fails(
        &[&resume[..], &["--output", split.to_str().unwrap(), "--steps", "6", "--resume", ckpt.to_str().unwrap()]].concat(),
        tmp.path(),
    );
    assert!(said.contains("was trained with another") && said.contains("config.json than the one there now"), "{said}");

    // The folder is gone: the checkpoint's recorded config rebuilds the model.
    let tokenizer = tmp.path().join("tokenizer.json");
    std::fs::copy(model.join("tokenizer.json"), &tokenizer).unwrap();
    std::fs::remove_dir_all(&model).unwrap();
    let ckpt = one.join("checkpoints");
    let (c, t) = (ckpt.to_str().unwrap(), tokenizer.to_str().unwrap());
    let said = ok(&["generate", "--checkpoint", c, "--tokenizer", t, "--prompt", "It is a truth", "--tokens", "8"], tmp.path());
    assert!(said.starts_with("It is a truth"), "{said}");
    let export = tmp.path().join("export");
    let said = ok(&["export", "--checkpoint", c, "--tokenizer", t, "--out", export.to_str().unwrap()], tmp.path());
    assert!(said.contains("LlamaForCausalLM"), "{said}");
    let hf = tessera::hf::HfModel::open(&export).unwrap();
    let ck = tessera::checkpoint::resolve_resume(&ckpt).unwrap().state;
    let (m, trained) = tessera::cli::model_from_checkpoint(&ck).unwrap();
    let exported = tessera::hf::read_params(hf.weights.as_ref().unwrap(), hf.config.family, &m).unwrap();
    assert!(exported == trained, "the export does not hold the trained parameters");
    assert_eq!(hf.config.model, m.cfg);
    assert!(export.join("tokenizer.json").is_file() && export.join("reference.json").is_file());
    for (file, bytes) in &carried {
        assert!(std::fs::read(export.join(file)).unwrap() == *bytes, "{file}: the export's differs from the model folder's");
    }
}

/// A folder whose tokenizer starts every sequence with a token (`add_bos_token`) has it put
/// before every document of a collection, after the end-of-text token between them (the
/// checkpoint's data record says so); `tessera.data_bos = ""` leaves it out.
#[test]
fn a_folders_beginning_of_sequence_token_opens_every_document() {
    let tmp = tempfile::tempdir().unwrap();
    let model = copy_fixture("llama", tmp.path(), |f| !f.ends_with(".safetensors"));
    write(&model, "tokenizer_config.json", "{\"add_bos_token\": true, \"bos_token\": \"!\"}");
    let line = |t: &str| format!("{{\"text\": \"{t}\"}}\n");
    let docs: String =
        ["It is a truth universally acknowledged", "that a single man", "in possession of a good fortune"].map(line).concat();
    let data = write(tmp.path(), "docs.jsonl", &docs.repeat(20));
    let data_of = |out: &Path| {
        let step = out.join("checkpoints").join(std::fs::read_to_string(out.join("checkpoints/latest")).unwrap().trim());
        let manifest: serde_json::Value = serde_json::from_slice(&std::fs::read(step.join("manifest.json")).unwrap()).unwrap();
        manifest["extra"]["data"].clone()
    };
    let record = |out: &Path| data_of(out)["source"].as_str().unwrap().to_string();
    let (framed, plain) = (tmp.path().join("framed"), tmp.path().join("plain"));
    train(&model, &data, &framed, "1", &["--world", "1"]);
    train(&model, &data, &plain, "1", &["--world", "1", "--set", "tessera.data_bos="]);
    // `!` is id 0 of the fixture's byte-level BPE, `<|endoftext|>` id 319.
    assert!(
        record(&framed).contains("begin-of-text 0, end-of-text 319") && record(&framed).contains("60 documents"),
        "{}",
        record(&framed)
    );
    assert!(!record(&plain).contains("begin-of-text") && record(&plain).contains("end-of-text 319"), "{}", record(&plain));
    let tokens = |out: &Path| data_of(out)["tokens"].as_u64().unwrap();
    assert_eq!(tokens(&framed), tokens(&plain) + 60, "one begin-of-text token a document");
    // generate opens the prompt with it too, and shows the prompt without it.
    let ckpt = framed.join("checkpoints");
    let said = ok(&["generate", "--checkpoint", ckpt.to_str().unwrap(), "--prompt", "It is a truth", "--tokens", "4"], tmp.path());
    assert!(said.starts_with("It is a truth"), "{said}");
}

#[test]
fn a_folder_without_weights_pretrains_from_the_seed_and_a_bad_config_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let model = copy_fixture("gpt2", tmp.path(), |f| !f.ends_with(".safetensors"));
    let data = text(tmp.path());
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    train(&model, &data, &a, "2", &["--world", "1"]);
    train(&model, &data, &b, "2", &["--world", "1", "--seed", "5"]);
    assert_ne!(summary(&a)["params_blake3"], summary(&b)["params_blake3"], "the seed initialises a folder without weights");

    let config = model.join("config.json");
    let doc = std::fs::read_to_string(&config).unwrap().replacen("\"n_head\": 4", "\"n_head\": 4, \"rotary_dim\": 16", 1);
    std::fs::write(&config, doc).unwrap();
    let cfg = repo().join("configs/gpt-tiny.json");
    let out = tmp.path().join("c");
    let args = [
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--model",
        model.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ];
    let said = fails(&args, tmp.path());
    assert!(said.contains("config.json: key `rotary_dim` = 16: expected no such key in a GPT2LMHeadModel config"), "{said}");
    assert!(!out.join("checkpoints").exists(), "a refused run wrote checkpoints");
}

/// `train` with `model` that must fail before any step; returns what it said.
fn refused(model: &Path, data: &Path, out: &Path, more: &[&str]) -> String {
    let cfg = repo().join("configs/gpt-tiny.json");
    let mut a = vec!["train", "--config", cfg.to_str().unwrap(), "--model", model.to_str().unwrap(), "--data", data.to_str().unwrap()];
    a.extend_from_slice(&["--output", out.to_str().unwrap(), "--steps", "1", "--no-progress"]);
    a.extend_from_slice(FAST);
    a.extend_from_slice(more);
    let said = fails(&a, out.parent().unwrap());
    assert!(!out.join("checkpoints").exists(), "a refused run wrote checkpoints");
    said
}

#[test]
fn a_folder_without_config_a_tokenizer_larger_than_the_model_and_a_longer_sequence_are_refused_by_file_and_key() {
    let tmp = tempfile::tempdir().unwrap();
    let data = text(tmp.path());
    let bare = copy_fixture("gpt2", &tmp.path().join("bare"), |f| f != "config.json");
    let said = refused(&bare, &data, &tmp.path().join("bare-out"), &[]);
    assert!(said.contains(&format!("{}: missing: ", bare.join("config.json").display())), "{said}");
    // The same folder named bare, from its parent (no `/`): a folder, not an unknown preset.
    let cfg = repo().join("configs/gpt-tiny.json");
    let a = ["train", "--config", cfg.to_str().unwrap(), "--model", "bare", "--data", data.to_str().unwrap(), "--output", "bare-out2"];
    let said = fails(&a, tmp.path());
    assert!(said.contains("bare/config.json: missing: ") && !said.contains("unknown model"), "{said}");

    // The folder's tokenizer has 320 ids; its config (without weights) only 300.
    let model = copy_fixture("llama", tmp.path(), |f| !f.ends_with(".safetensors"));
    let config = model.join("config.json");
    let doc = std::fs::read_to_string(&config).unwrap().replacen("\"vocab_size\": 320", "\"vocab_size\": 300", 1);
    std::fs::write(&config, doc).unwrap();
    let said = refused(&model, &data, &tmp.path().join("vocab"), &[]);
    let want = format!(
        "{}: key `vocab_size` = 300, but the data's tokens need 320 (tokenizer {}",
        config.display(),
        model.join("tokenizer.json").display()
    );
    assert!(said.contains(&want), "{said}");

    // The llama fixture takes 64 positions (max_position_embeddings).
    let llama = copy_fixture("llama", &tmp.path().join("full"), |_| true);
    let said = refused(&llama, &data, &tmp.path().join("long"), &["--set", "tessera.seq_len=65"]);
    let want = format!(
        "tessera.seq_len = 65 is out of range: the model `{}` takes 1..=64 ({}: `max_position_embeddings`)",
        llama.display(),
        llama.join("config.json").display()
    );
    assert!(said.contains(&want), "{said}");
}
