//! Pipeline parallelism through the CLI: 4 stages × 2 data-parallel replicas over 8 worker
//! processes (QUIC with mutual TLS) at ZeRO-2 give the plain run's bits for each schedule
//! (GPipe, 1F1B, interleaved 1F1B with 2 chunks a stage, ZB-H1), with the pipeline's figures in
//! the summary and its picture beside the loss curve; what a pipeline cannot take is refused by
//! key before anything is written.

use std::path::{Path, PathBuf};

use crate::common::*;

fn args<'a>(cfg: &'a str, out: &'a str) -> Vec<&'a str> {
    let mut a = vec!["train", "--config", cfg, "--output", out, "--steps", "4", "--no-progress"];
    for s in
        ["train_batch_size=16", "train_micro_batch_size_per_gpu=2", "tessera.seq_len=32", "tessera.eval_interval=0", "tessera.eval_iters=1"]
    {
        a.extend(["--set", s]);
    }
    a
}

fn bits(out: &Path) -> String {
    summary(out)["params_blake3"].as_str().expect("params_blake3").to_string()
}

/// gpt-tiny with 8 blocks: a model folder for 4 stages of 2 chunks each.
fn eight_blocks(dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(repo().join("configs/models/gpt-tiny/config.json")).expect("gpt-tiny's config");
    let mut cfg: serde_json::Value = serde_json::from_str(&text).expect("json");
    cfg["n_layer"] = 8.into();
    let folder = dir.join("gpt-tiny-8");
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::write(folder.join("config.json"), cfg.to_string()).unwrap();
    folder
}

#[test]
fn four_stages_by_two_replicas_at_zero_2_give_the_plain_bits_for_each_schedule() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = repo().join("configs/gpt-tiny.json");
    let cfg = cfg.to_str().unwrap();
    let model = eight_blocks(tmp.path());
    let model = model.to_str().unwrap();
    let plain = tmp.path().join("plain");
    let mut a = args(cfg, plain.to_str().unwrap());
    a.extend(["--model", model, "--world", "1"]);
    ok(&a, tmp.path());
    // Per schedule: the bubble in unit time for 4 stages and 4 micro-batches a replica, the
    // most micro-batch chunks in flight per stage, and the instructions of a stage.
    for (schedule, theory, want_peak, per_stage) in [
        ("gpipe", 3.0 / 7.0, [4, 4, 4, 4], 8),
        ("1f1b", 3.0 / 7.0, [4, 3, 2, 1], 8),
        ("interleaved", 3.0 / 11.0, [8, 8, 7, 5], 16),
        ("zb-h1", 3.0 / 15.0, [4, 3, 2, 1], 12),
    ] {
        let out = tmp.path().join(schedule);
        let sched = format!("tessera.pipeline.schedule={schedule}");
        let mut a = args(cfg, out.to_str().unwrap());
        a.extend(["--model", model, "--nprocs", "8", "--set", "pipeline.stages=4", "--set", "zero_optimization.stage=2", "--set", &sched]);
        let text = ok(&a, tmp.path());
        assert!(text.contains(&format!("pipeline: 4 stages × 2 replicas, schedule {schedule}")), "{text}");
        assert_eq!(bits(&out), bits(&plain), "{schedule}: 4 stages × 2 replicas at ZeRO-2 is not the plain run");
        let p = &summary(&out)["pipeline"];
        assert_eq!((p["stages"].as_u64(), p["replicas"].as_u64(), p["schedule"].as_str()), (Some(4), Some(2), Some(schedule)), "{p}");
        assert_eq!(p["micro_batches_per_replica"], 4, "{p}");
        assert_eq!(p["chunks_per_stage"], if schedule == "interleaved" { 2 } else { 1 }, "{p}");
        assert!((p["bubble_theory"].as_f64().unwrap() - theory).abs() < 1e-12, "{p}");
        let measured = p["bubble_measured"].as_f64().unwrap();
        assert!(measured > 0.0 && measured < 1.0, "{p}");
        let peak: Vec<u64> = p["peak_in_flight_per_stage"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).collect();
        assert_eq!(peak, want_peak, "{p}");
        let svg = std::fs::read_to_string(out.join("pipeline.svg")).expect("pipeline.svg");
        // Replica 0's four stages' instructions, and the last stage's 4 embeddings backwards.
        assert_eq!(svg.matches("<rect x=").count(), 4 * per_stage + 4, "{schedule}: {svg}");
    }
}

#[test]
fn what_a_pipeline_cannot_take_is_refused_by_key() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = repo().join("configs/gpt-tiny.json");
    let out = tmp.path().join("out");
    for (more, want) in [
        (vec!["--world", "4", "--set", "pipeline.stages=3"], "pipeline.stages"),
        (vec!["--world", "8", "--set", "pipeline.stages=8"], "8 stages for a model of 4 blocks"),
        (vec!["--world", "2", "--set", "pipeline.stages=2", "--set", "tessera.pipeline.schedule=zb-v"], "tessera.pipeline.schedule"),
        (
            vec!["--world", "2", "--set", "pipeline.stages=2", "--set", "tessera.pipeline.virtual_stages=2"],
            "tessera.pipeline.virtual_stages",
        ),
        (
            vec!["--world", "4", "--set", "pipeline.stages=4", "--set", "tessera.pipeline.schedule=interleaved"],
            "4 stages × 2 chunks for a model of 4 blocks",
        ),
        (vec!["--world", "2", "--set", "pipeline.stages=2", "--set", "pipeline.partition=measured"], "pipeline.partition"),
        (
            vec!["--world", "2", "--set", "pipeline.stages=2", "--set", "pipeline.activation_checkpoint_interval=2"],
            "activation_checkpoint_interval",
        ),
    ] {
        let mut a = vec!["train", "--config", cfg.to_str().unwrap(), "--output", out.to_str().unwrap()];
        a.extend(more.iter().copied());
        let text = fails(&a, tmp.path());
        assert!(text.contains(want), "{more:?}: {text}");
        assert!(!out.exists(), "a refused run left {}", out.display());
    }
}
