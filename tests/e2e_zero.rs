//! ZeRO across in-process workers: every stage and world size reproduces the one-worker
//! parameters bit for bit; model states per rank follow the ZeRO formulas; an abandoned step
//! changes nothing; Ctrl-C stops cleanly and leaves the last checkpoint loadable.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::*;

/// A short gpt-tiny run with 12 micro-batches of 1 sequence of 32 tokens per step (12 divides
/// evenly for worlds 1–4, as DeepSpeed's batch rule requires).
fn zero_run(dir: &Path, name: &str, world: usize, stage: u8, extra: &[&str]) -> serde_json::Value {
    let cfg = repo().join("configs/gpt-tiny.json");
    let out = dir.join(name);
    let (w, s) = (world.to_string(), format!("zero_optimization.stage={stage}"));
    let mut a =
        vec!["train", "--config", cfg.to_str().unwrap(), "--output", out.to_str().unwrap(), "--steps", "3", "--no-progress", "--world", &w];
    a.extend_from_slice(&["--set", &s, "--set", "train_batch_size=12", "--set", "train_micro_batch_size_per_gpu=1"]);
    a.extend_from_slice(&["--set", "tessera.seq_len=32", "--set", "tessera.eval_iters=1", "--set", "tessera.eval_interval=0"]);
    // Start the warm-up at half the rate, so that every step moves the parameters.
    a.extend_from_slice(&["--set", "scheduler.params.warmup_min_ratio=0.5"]);
    a.extend_from_slice(extra);
    ok(&a, dir);
    summary(&out)
}

#[test]
fn every_stage_and_world_size_gives_the_same_bits() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = zero_run(tmp.path(), "w1s0", 1, 0, &[]);
    let want = reference["params_blake3"].as_str().unwrap().to_string();
    for world in 1..=4 {
        for stage in 0..=3u8 {
            if world == 1 && stage == 0 {
                continue;
            }
            let s = zero_run(tmp.path(), &format!("w{world}s{stage}"), world, stage, &[]);
            assert_eq!(s["world_size"], world);
            assert_eq!(s["zero_stage"], stage);
            assert_eq!(s["params_blake3"], want, "world {world}, stage {stage} differs from one worker");
        }
    }
}

#[test]
fn sixteen_bit_and_lamb_runs_are_world_size_independent() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, extra) in [
        ("bf16", vec!["--set", "bf16.enabled=true"]),
        ("fp16", vec!["--set", "fp16.enabled=true"]),
        ("lamb", vec!["--set", "optimizer={\"type\": \"Lamb\", \"params\": {\"lr\": 0.002, \"weight_decay\": 0.01}}"]),
    ] {
        let one = zero_run(tmp.path(), &format!("{name}-1"), 1, 0, &extra);
        let three = zero_run(tmp.path(), &format!("{name}-3"), 3, 3, &extra);
        let four = zero_run(tmp.path(), &format!("{name}-4"), 4, 2, &extra);
        assert_eq!(one["skipped_steps"], 0, "{name}: a skipped step would hide differences");
        assert_eq!(one["params_blake3"], three["params_blake3"], "{name}: world 3 stage 3 differs");
        assert_eq!(one["params_blake3"], four["params_blake3"], "{name}: world 4 stage 2 differs");
    }
}

#[test]
fn model_states_per_rank_follow_the_zero_formulas() {
    let tmp = tempfile::tempdir().unwrap();
    let n = 4.0;
    for stage in 0..=3u8 {
        let s = zero_run(tmp.path(), &format!("mem{stage}"), 4, stage, &["--set", "bf16.enabled=true"]);
        let psi = s["num_params"].as_f64().unwrap();
        // Mixed-precision Adam, in bytes: 2Ψ params, 2Ψ grads, 12Ψ fp32 master + two moments.
        let (p, g, o) = match stage {
            0 => (2.0 * psi, 2.0 * psi, 12.0 * psi),
            1 => (2.0 * psi, 2.0 * psi, 12.0 * psi / n),
            2 => (2.0 * psi, 2.0 * psi / n, 12.0 * psi / n),
            _ => (2.0 * psi / n, 2.0 * psi / n, 12.0 * psi / n),
        };
        // Partitions are aligned to 16384-element blocks: a rank may hold one block more or less.
        let pad = 16384.0 * 16.0;
        let ranks = s["model_state_bytes_per_rank"].as_array().unwrap();
        assert_eq!(ranks.len(), 4);
        for r in ranks {
            for (key, want) in [("params", p), ("grads", g), ("optimizer_states", o)] {
                let got = r[key].as_f64().unwrap();
                assert!((got - want).abs() <= pad, "stage {stage} rank {}: {key} = {got}, formula {want}", r["rank"]);
            }
        }
        let total: f64 = ranks.iter().map(|r| r["total"].as_f64().unwrap()).sum();
        let want_total = 4.0 * (p + g + o);
        assert!((total - want_total).abs() <= 4.0 * pad, "stage {stage}: total {total} vs {want_total}");
    }
}

#[test]
fn an_abandoned_step_is_rerun_with_the_same_result() {
    let tmp = tempfile::tempdir().unwrap();
    let plain = zero_run(tmp.path(), "plain", 2, 2, &[]);
    let abandoned = zero_run(tmp.path(), "abandoned", 2, 2, &["--abandon-step", "1"]);
    assert_eq!(abandoned["abandoned_attempts"], 1);
    assert_eq!(plain["params_blake3"], abandoned["params_blake3"]);
}

#[test]
fn ctrl_c_stops_cleanly_and_the_last_checkpoint_loads() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = repo().join("configs/gpt-tiny.json");
    let out = tmp.path().join("run");
    let mut child = Command::new(bin())
        .args([
            "train",
            "--config",
            cfg.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
            "--steps",
            "100000",
            "--no-progress",
            "--world",
            "2",
        ])
        .args([
            "--set",
            "tessera.checkpoint_interval=1",
            "--set",
            "tessera.seq_len=32",
            "--set",
            "train_batch_size=4",
            "--set",
            "train_micro_batch_size_per_gpu=2",
        ])
        .args(["--set", "tessera.eval_interval=0", "--set", "tessera.eval_iters=1"])
        .current_dir(tmp.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawning tessera");
    let ckpts = out.join("checkpoints");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !ckpts.join("latest").exists() {
        assert!(Instant::now() < deadline, "no checkpoint within 60 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    let pid = child.id().to_string();
    assert!(Command::new("kill").args(["-INT", &pid]).status().unwrap().success());
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130), "Ctrl-C should stop the run with status 130");
    let text = ok(&["generate", "--checkpoint", ckpts.to_str().unwrap(), "--tokens", "4"], tmp.path());
    assert!(!text.contains("skipped checkpoint"), "a checkpoint was left damaged:\n{text}");
}
