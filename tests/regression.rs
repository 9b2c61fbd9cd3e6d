//! Bad input gives a clear error naming the problem and a non-zero exit; nothing is lost.

use crate::common::*;

#[test]
fn misspelt_key_is_rejected_with_a_suggestion() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write(tmp.path(), "bad.json", r#"{"train_batch_size": 8, "zero_optimization": {"stage": 1, "reduce_bucket_sise": 5e8}}"#);
    let text = fails(&["config", "check", cfg.to_str().unwrap()], tmp.path());
    assert!(text.contains("zero_optimization.reduce_bucket_sise"), "{text}");
    assert!(text.contains("reduce_bucket_size"), "{text}");
}

#[test]
fn inconsistent_batch_shows_the_three_numbers() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg =
        write(tmp.path(), "bad.json", r#"{"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}"#);
    let text = fails(&["config", "check", cfg.to_str().unwrap()], tmp.path());
    for n in ["10", "4", "2"] {
        assert!(text.contains(n), "{text}");
    }
}

#[test]
fn missing_data_path_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = repo().join("configs/gpt-tiny.json");
    let out = tmp.path().join("run");
    let text = fails(
        &[
            "train",
            "--config",
            cfg.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
            "--data",
            "/nonexistent/corpus.txt",
            "--no-progress",
        ],
        tmp.path(),
    );
    assert!(text.contains("/nonexistent/corpus.txt"), "{text}");
}

#[test]
fn corrupted_checkpoint_is_reported_and_the_previous_one_still_loads() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = repo().join("configs/gpt-tiny.json");
    let out = tmp.path().join("run");
    let mut a = vec![
        "train",
        "--config",
        cfg.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--steps",
        "4",
        "--no-progress",
        "--set",
        "tessera.checkpoint_interval=2",
    ];
    a.extend_from_slice(FAST);
    ok(&a, tmp.path());
    let ckpts = out.join("checkpoints");
    let newest = ckpts.join("step_00000004");
    let params = newest.join("params.safetensors");
    let bytes = std::fs::read(&params).unwrap();
    std::fs::write(&params, &bytes[..bytes.len() / 2]).unwrap();
    // Loading that step directly names the file.
    let text = fails(&["generate", "--checkpoint", newest.to_str().unwrap(), "--tokens", "2"], tmp.path());
    assert!(text.contains("params.safetensors"), "{text}");
    // The root falls back to step 2, with a warning about step 4.
    let text = ok(&["generate", "--checkpoint", ckpts.to_str().unwrap(), "--tokens", "2"], tmp.path());
    assert!(text.contains("step_00000004"), "{text}");
}
