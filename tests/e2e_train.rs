//! Training runs through the CLI: the shipped config, resume bit-exactness, generate, export.

use crate::common::*;

fn train_args<'a>(config: &'a str, out: &'a str, steps: &'a str) -> Vec<&'a str> {
    let mut a = vec!["train", "--config", config, "--output", out, "--steps", steps, "--no-progress"];
    a.extend_from_slice(FAST);
    a
}

#[test]
fn shipped_config_trains_and_writes_summary_and_monitors() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = repo().join("configs/gpt-tiny.json");
    let out = tmp.path().join("run");
    let text = ok(&train_args(cfg.to_str().unwrap(), out.to_str().unwrap(), "8"), tmp.path());
    assert!(text.contains("summary"), "{text}");
    let s = summary(&out);
    for key in ["final_loss", "val_loss", "tokens_per_s", "wall_s", "peak_rss_bytes"] {
        assert!(s[key].as_f64().is_some_and(|v| v.is_finite() && v > 0.0), "summary.json's {key} is not a positive number: {s}");
    }
    assert_eq!(s["params_blake3"].as_str().map(str::len), Some(64), "{s}");
    assert_eq!(s["steps"], 8);
    assert!(s["val_loss"].as_f64().unwrap() < s["initial_val_loss"].as_f64().unwrap(), "validation loss did not fall: {s}");
    assert!(out.join("loss.svg").exists());
    assert!(out.join("metrics.jsonl").exists());
    assert!(out.join("csv").read_dir().unwrap().count() > 0, "csv monitor wrote nothing");
    let tb = out.join("tensorboard").read_dir().unwrap().count();
    assert!(tb > 0, "tensorboard monitor wrote nothing");
}

#[test]
fn resume_is_bit_exact_across_world_sizes_and_stages() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = repo().join("configs/gpt-tiny.json");
    let (straight, split) = (tmp.path().join("straight"), tmp.path().join("split"));
    // 12 steps with the config's 4 workers under ZeRO-3 …
    ok(&train_args(cfg.to_str().unwrap(), straight.to_str().unwrap(), "12"), tmp.path());
    // … equal 6 steps with 2 workers under ZeRO-1, then 6 more resumed by 1 worker under ZeRO-0.
    let mut first = train_args(cfg.to_str().unwrap(), split.to_str().unwrap(), "6");
    first.extend_from_slice(&["--world", "2", "--set", "zero_optimization.stage=1"]);
    ok(&first, tmp.path());
    let ckpt = split.join("checkpoints");
    let mut second = train_args(cfg.to_str().unwrap(), split.to_str().unwrap(), "12");
    second.extend_from_slice(&["--resume", ckpt.to_str().unwrap(), "--world", "1", "--set", "zero_optimization.stage=0"]);
    ok(&second, tmp.path());
    let (s1, s2) = (summary(&straight), summary(&split));
    assert_eq!(s2["tokens"].as_u64().unwrap() * 2, s1["tokens"].as_u64().unwrap(), "the resumed run should have run only the last 6 steps");
    assert!(s2["initial_val_loss"].is_null(), "a resumed run starts from the checkpoint, not from initialisation");
    assert_eq!(s1["params_blake3"], s2["params_blake3"], "12 straight steps differ from 6 + resume + 6");
    assert_eq!(s1["final_loss"], s2["final_loss"]);
}

/// OneCycle with DeepSpeed's default `cycle_momentum` cycles the optimizer's betas: the
/// parameters differ from a run with the flag off, the replaced betas are announced, and a run
/// resumed mid-cycle under another world size and stage has the bits of a straight one.
#[test]
fn one_cycle_momentum_is_applied_and_resumes_bit_exactly_mid_cycle() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = repo().join("configs/gpt-tiny.json");
    let one_cycle =
        r#"scheduler={"type": "OneCycle", "params": {"cycle_min_lr": 0.0005, "cycle_max_lr": 0.003, "cycle_first_step_size": 3}}"#;
    let train = |name: &str, steps: &str, extra: &[&str]| {
        let out = tmp.path().join(name);
        let mut a = train_args(cfg.to_str().unwrap(), out.to_str().unwrap(), steps);
        a.extend_from_slice(&["--set", one_cycle]);
        a.extend_from_slice(extra);
        (ok(&a, tmp.path()), out)
    };
    let (text, straight) = train("straight", "6", &["--world", "2", "--set", "zero_optimization.stage=2", "--set", "steps_per_print=1"]);
    assert!(text.contains("`optimizer.params.betas` is replaced by OneCycle's momentum cycle"), "{text}");
    // The step log shows each update's beta1 (DeepSpeed's `mom`): cycle_min_mom (0.8) first,
    // then up the triangle (3 + 3 iterations) towards cycle_max_mom (0.9): 0.9 − 0.1·(1/3).
    assert!(text.contains("step      1 | loss") && text.contains("| beta1 0.8000 |"), "{text}");
    assert!(text.contains("| beta1 0.8667 |"), "{text}");
    let (fixed_text, fixed) =
        train("fixed", "6", &["--world", "2", "--set", "scheduler.params.cycle_momentum=false", "--set", "steps_per_print=1"]);
    assert!(fixed_text.contains("step      1 | loss") && !fixed_text.contains("beta1"), "{fixed_text}");
    let (_, split) = train("split", "3", &["--world", "2", "--set", "zero_optimization.stage=1"]);
    let ckpt = split.join("checkpoints");
    train("split", "6", &["--resume", ckpt.to_str().unwrap(), "--world", "1", "--set", "zero_optimization.stage=0"]);
    let (s1, s2, s0) = (summary(&straight), summary(&split), summary(&fixed));
    assert_eq!(s1["params_blake3"], s2["params_blake3"], "6 straight steps differ from 3 + resume + 3 under OneCycle momentum");
    assert_ne!(s1["params_blake3"], s0["params_blake3"], "cycle_momentum changed no parameter");
}

#[test]
fn a_fresh_run_refuses_to_overwrite_checkpoints_and_resume_checks_the_seed() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = repo().join("configs/gpt-tiny.json");
    let out = tmp.path().join("run");
    ok(&train_args(cfg.to_str().unwrap(), out.to_str().unwrap(), "2"), tmp.path());
    let text = fails(&train_args(cfg.to_str().unwrap(), out.to_str().unwrap(), "2"), tmp.path());
    assert!(text.contains("already holds checkpoints") && text.contains("--resume"), "{text}");
    let ckpt = out.join("checkpoints");
    let mut a = train_args(cfg.to_str().unwrap(), out.to_str().unwrap(), "4");
    a.extend_from_slice(&["--resume", ckpt.to_str().unwrap(), "--seed", "99"]);
    let text = fails(&a, tmp.path());
    assert!(text.contains("seed"), "{text}");
}

#[test]
fn precisions_train_and_differ() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = repo().join("configs/gpt-tiny.json");
    let mut hashes = Vec::new();
    for (name, set) in [("f32", None), ("bf16", Some("bf16.enabled=true")), ("fp16", Some("fp16.enabled=true"))] {
        let out = tmp.path().join(name);
        let mut a = train_args(cfg.to_str().unwrap(), out.to_str().unwrap(), "4");
        if let Some(s) = set {
            a.extend_from_slice(&["--set", s]);
        }
        ok(&a, tmp.path());
        let s = summary(&out);
        assert!(s["final_loss"].as_f64().unwrap().is_finite());
        assert_eq!(s["precision"], name);
        hashes.push(s["params_blake3"].clone());
    }
    assert_ne!(hashes[0], hashes[1], "bf16 storage must change the numbers");
    assert_ne!(hashes[0], hashes[2], "fp16 storage must change the numbers");
}

#[test]
fn generate_and_export_from_a_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = repo().join("configs/gpt-tiny.json");
    let out = tmp.path().join("run");
    ok(&train_args(cfg.to_str().unwrap(), out.to_str().unwrap(), "2"), tmp.path());
    let ckpt = out.join("checkpoints");
    let text = ok(&["generate", "--checkpoint", ckpt.to_str().unwrap(), "--prompt", "Emma", "--tokens", "20"], tmp.path());
    assert!(text.starts_with("Emma"), "{text}");
    let export = tmp.path().join("hf");
    ok(&["export", "--checkpoint", ckpt.to_str().unwrap(), "--out", export.to_str().unwrap()], tmp.path());
    for f in ["model.safetensors", "config.json", "reference.json"] {
        assert!(export.join(f).exists(), "export lacks {f}");
    }
}

/// The founding config (stage 3 with CPU offload of optimizer states and parameters) trains, and
/// every key it uses is honoured: no "not honoured" warning, and the offloaded bytes are reported.
#[test]
fn founding_config_trains_with_cpu_offload_and_no_warning() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = repo().join("configs/founding.json");
    let out = tmp.path().join("run");
    let args = [
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--steps",
        "1",
        "--no-progress",
        "--set",
        "tessera.seq_len=16",
    ];
    let text = ok(&args, tmp.path());
    assert!(!text.contains("warning:"), "the founding config should raise no warning:\n{text}");
    let offloaded = &summary(&out)["offloaded_bytes_per_rank"];
    let ranks = offloaded.as_array().unwrap_or_else(|| panic!("summary lacks offloaded_bytes_per_rank: {offloaded}"));
    assert!(!ranks.is_empty(), "{offloaded}");
    // The founding config offloads the optimizer (and the stage-3 parameter shard) to the host.
    for r in ranks {
        assert!(r["host"].as_u64().is_some_and(|b| b > 0), "a rank offloaded nothing to the host: {offloaded}");
    }
}

#[test]
fn fp16_overflow_skips_steps_and_lowers_the_scale() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = repo().join("configs/gpt-tiny.json");
    let out = tmp.path().join("run");
    let mut a = train_args(cfg.to_str().unwrap(), out.to_str().unwrap(), "6");
    // 2^19 times the loss overflows fp16 gradients until the dynamic scaler has halved it enough.
    a.extend_from_slice(&["--set", "fp16.enabled=true", "--set", "fp16.initial_scale_power=19", "--set", "fp16.hysteresis=1"]);
    ok(&a, tmp.path());
    let s = summary(&out);
    let skipped = s["skipped_steps"].as_u64().unwrap();
    assert!((1..6).contains(&skipped), "expected some overflow-skipped steps, got {skipped}: {s}");
    let log = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let scales: Vec<f64> = log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["tag"] == "Train/Samples/loss_scale")
        .filter_map(|v| v["value"].as_f64())
        .collect();
    assert!(scales.len() == 6 && scales[5] < scales[0], "the loss scale should fall: {scales:?}");
}

/// A tiny byte-level BPE: "hello" is one token, " wo" merges, the rest are single letters
/// (shared with the data module's tests).
const TINY_BPE: &str = include_str!("fixtures/tiny_bpe.json");

#[test]
fn the_training_tokenizer_is_recorded_and_enforced() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = repo().join("configs/gpt-tiny.json");
    let tok = write(tmp.path(), "tokenizer.json", TINY_BPE);
    let data = write(tmp.path(), "hello.txt", &"hello world\nhello hello world\n".repeat(400));
    let out = tmp.path().join("run");
    let mut a = train_args(cfg.to_str().unwrap(), out.to_str().unwrap(), "2");
    a.extend_from_slice(&["--data", data.to_str().unwrap(), "--tokenizer", tok.to_str().unwrap()]);
    ok(&a, tmp.path());
    let ckpt = out.join("checkpoints");
    // Without --tokenizer, generate decodes with the recorded one: only the tokenizer's letters.
    let text = ok(&["generate", "--checkpoint", ckpt.to_str().unwrap(), "--prompt", "hello", "--tokens", "12"], tmp.path());
    let first = text.lines().next().unwrap_or_default();
    assert!(first.starts_with("hello") && first.chars().all(|c| "helowrd \n".contains(c)), "{text}");
    // Another tokenizer (same vocabulary size, two ids swapped) is refused by generate and resume.
    let other = write(tmp.path(), "other.json", &TINY_BPE.replace(r#""r": 6, "d": 7"#, r#""r": 7, "d": 6"#));
    let text = fails(&["generate", "--checkpoint", ckpt.to_str().unwrap(), "--tokenizer", other.to_str().unwrap()], tmp.path());
    assert!(text.contains("not what the checkpoint was trained with"), "{text}");
    let mut r = train_args(cfg.to_str().unwrap(), out.to_str().unwrap(), "4");
    r.extend_from_slice(&["--data", data.to_str().unwrap(), "--tokenizer", other.to_str().unwrap(), "--resume", ckpt.to_str().unwrap()]);
    let text = fails(&r, tmp.path());
    assert!(text.contains("was trained on tokenizer"), "{text}");
}

/// Documents for the data-format runs: 60 short texts with quotes, escapes and non-ASCII, so
/// that training on the JSON's raw bytes instead of the strings would change the count.
fn documents() -> Vec<String> {
    (0..60).map(|i| format!("Document {i}: \"Mr. Darcy\" said {}\\n café — the end.", "no ".repeat(i % 7))).collect()
}

/// Byte-level tokens of `docs` joined by one end-of-text token each.
fn byte_tokens(docs: &[String]) -> u64 {
    docs.iter().map(|d| d.len() as u64).sum::<u64>() + docs.len() as u64 - 1
}

/// The data record of a run's last checkpoint (`extra.data`: source, tokens, blake3).
fn data_record(out: &std::path::Path) -> serde_json::Value {
    let ckpts = out.join("checkpoints");
    let step = std::fs::read_dir(&ckpts).unwrap().flatten().map(|e| e.path()).filter(|p| p.join("manifest.json").exists()).max().unwrap();
    let manifest: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(step.join("manifest.json")).unwrap()).unwrap();
    manifest["extra"]["data"].clone()
}

/// A JSON-lines corpus trains end to end on its strings, an end-of-text token between
/// documents; a second run hits the token cache and ends on the same bits, as does a run
/// without the cache.
#[test]
fn jsonl_corpus_trains_through_the_token_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let docs = documents();
    let lines: Vec<String> = docs.iter().map(|d| serde_json::json!({ "id": 1, "text": d }).to_string()).collect();
    let data = write(tmp.path(), "corpus.jsonl", &lines.join("\n"));
    let cache = tmp.path().join("cache");
    let cfg = repo().join("configs/gpt-tiny.json");
    let train = |name: &str, cache_setting: &str| {
        let out = tmp.path().join(name);
        let mut a = train_args(cfg.to_str().unwrap(), out.to_str().unwrap(), "2");
        let cache_set = format!("tessera.data_cache={cache_setting}");
        a.extend_from_slice(&["--world", "1", "--data", data.to_str().unwrap(), "--set", &cache_set]);
        (ok(&a, tmp.path()), out)
    };
    let (first, out1) = train("first", cache.to_str().unwrap());
    assert!(first.contains("on jsonl ") && first.contains("60 documents") && first.contains("tokenized into cache"), "{first}");
    let record = data_record(&out1);
    assert_eq!(record["tokens"].as_u64(), Some(byte_tokens(&docs)), "the strings' bytes plus 59 end-of-text tokens: {record}");
    let (second, out2) = train("second", cache.to_str().unwrap());
    assert!(second.contains("token cache hit"), "{second}");
    let (third, out3) = train("uncached", "off");
    assert!(third.contains("no token cache"), "{third}");
    let bits = summary(&out1)["params_blake3"].clone();
    assert_eq!(summary(&out2)["params_blake3"], bits, "a cache hit trains on the same tokens");
    assert_eq!(summary(&out3)["params_blake3"], bits, "no cache, the same tokens");
    assert_eq!(data_record(&out3)["blake3"], record["blake3"]);
}

/// A Hugging Face snapshot (`data/train-0000N-of-00002.parquet`, Snappy) trains end to end.
#[test]
fn parquet_snapshot_trains_with_the_right_token_count() {
    use parquet::data_type::{ByteArray, ByteArrayType};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use std::sync::Arc;

    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("snapshot");
    std::fs::create_dir_all(root.join("data")).unwrap();
    std::fs::write(root.join("README.md"), "---\nlicense: mit\n---\n").unwrap();
    let docs = documents();
    let schema = Arc::new(parquet::schema::parser::parse_message_type("message m { OPTIONAL BYTE_ARRAY text (UTF8); }").unwrap());
    for (n, part) in docs.chunks(30).enumerate() {
        let file = std::fs::File::create(root.join(format!("data/train-{n:05}-of-00002.parquet"))).unwrap();
        let props = Arc::new(WriterProperties::builder().set_compression(parquet::basic::Compression::SNAPPY).build());
        let mut w = SerializedFileWriter::new(file, Arc::clone(&schema), props).unwrap();
        let mut rg = w.next_row_group().unwrap();
        let mut col = rg.next_column().unwrap().unwrap();
        let values: Vec<ByteArray> = part.iter().map(|d| ByteArray::from(d.as_str())).collect();
        col.typed::<ByteArrayType>().write_batch(&values, Some(&vec![1; part.len()]), None).unwrap();
        col.close().unwrap();
        rg.close().unwrap();
        w.close().unwrap();
    }
    let cfg = repo().join("configs/gpt-tiny.json");
    let out = tmp.path().join("run");
    let mut a = train_args(cfg.to_str().unwrap(), out.to_str().unwrap(), "2");
    let cache = format!("tessera.data_cache={}", tmp.path().join("cache").display());
    a.extend_from_slice(&["--world", "1", "--data", root.to_str().unwrap(), "--set", &cache]);
    let text = ok(&a, tmp.path());
    assert!(text.contains("on parquet ") && text.contains("2 files") && text.contains("60 documents"), "{text}");
    assert_eq!(data_record(&out)["tokens"].as_u64(), Some(byte_tokens(&docs)));
}
