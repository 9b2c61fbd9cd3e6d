//! ZeRO across in-process workers: every stage and world size reproduces the one-worker
//! parameters bit for bit; model states per rank follow the ZeRO formulas; reduce buckets,
//! persistent units and a bound on live parameters change traffic and memory but no bit; an
//! abandoned step changes nothing; Ctrl-C stops cleanly and leaves the last checkpoint loadable.

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

/// 28 micro-batches of one sequence a step (set after `zero_run`'s 12): 7 a rank at world 4, cut
/// into the aligned blocks 4+2+1, 1+4+2, 2+4+1 and 1+2+4, 14 a rank at world 2 (8+4+2 and
/// 2+8+4), and 16+8+4 for the whole batch — three partial sums wait at the tree's root, where
/// 12 (8+4) leaves two. The ranks' blocks end at different micro-batch slots.
pub const SEVEN_A_RANK_AT_4: &[&str] = &["--set", "train_batch_size=28"];

/// Tokens a `zero_run` of [`SEVEN_A_RANK_AT_4`] trains on: 3 steps of 28 sequences of 32 tokens.
pub const SEVEN_A_RANK_TOKENS: u64 = 3 * 28 * 32;

#[test]
fn seven_micro_batches_a_rank_give_the_bits_of_one_worker_at_every_stage() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = zero_run(tmp.path(), "w1", 1, 0, SEVEN_A_RANK_AT_4);
    assert_eq!(reference["tokens"], SEVEN_A_RANK_TOKENS, "the batch of 28 did not take: {reference}");
    for (world, stage) in [(2, 0), (2, 3), (4, 0), (4, 1), (4, 2), (4, 3)] {
        let s = zero_run(tmp.path(), &format!("w{world}s{stage}"), world, stage, SEVEN_A_RANK_AT_4);
        assert_eq!((s["world_size"].as_u64(), s["tokens"].as_u64()), (Some(world as u64), Some(SEVEN_A_RANK_TOKENS)));
        assert_eq!(s["params_blake3"], reference["params_blake3"], "28 micro-batches: world {world}, stage {stage} differ from one worker");
    }
    // 16-bit gradients round every inner node of the tree: the same bits at the root too.
    let bf16 = |name: &str, world: usize, stage: u8| {
        let extra: Vec<&str> = SEVEN_A_RANK_AT_4.iter().copied().chain(["--set", "bf16.enabled=true"]).collect();
        zero_run(tmp.path(), name, world, stage, &extra)["params_blake3"].clone()
    };
    assert_eq!(bf16("bf16-w4s2", 4, 2), bf16("bf16-w1", 1, 0), "28 micro-batches in bf16: world 4, stage 2 differ from one worker");
}

/// One worker's 3 steps over [`SEVEN_A_RANK_AT_4`]'s 28 micro-batches end on pinned bits. Every
/// world size leaves the same three partial sums at the tree's root, so the comparisons above
/// cannot see how the root adds them (left + (middle + right)); this can (adding them left to
/// right instead changes these bits, and none of a 12-micro-batch run's). A change here is a
/// change of the math behind every run's `params_blake3`. The value does not depend on the
/// machine's caches or thread count: every matmul of gpt-tiny sums over at most 512 terms, which
/// the gemm crate never splits (its k-blocks are at least 512), and the same bits came with 1 and
/// 7 threads on one core.
#[test]
fn one_worker_over_28_micro_batches_ends_on_the_pinned_bits() {
    let tmp = tempfile::tempdir().unwrap();
    let s = zero_run(tmp.path(), "w1", 1, 0, SEVEN_A_RANK_AT_4);
    assert_eq!(s["tokens"], SEVEN_A_RANK_TOKENS);
    assert_eq!(s["params_blake3"], "12fc90728c54f4254b729c05e77e89e6e9becf220ad0dbc1b7e34bd9e5470d6e");
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
        // gpt-tiny's unit 0 (49,408 parameters) is below DeepSpeed's default persistence threshold
        // (1e5), so stage 3 would keep it whole on every rank; threshold 0 partitions every unit,
        // which is what the 16Ψ/N formula assumes (persistent copies are checked separately).
        let no_persist = "zero_optimization.stage3_param_persistence_threshold=0";
        let s = zero_run(tmp.path(), &format!("mem{stage}"), 4, stage, &["--set", "bf16.enabled=true", "--set", no_persist]);
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

/// gpt-tiny over bytes: unit 0 (embeddings, final norm, tied head) has 49,408 parameters and
/// each of the 4 blocks 198,272.
const UNIT0: u64 = 49_408;
const BLOCK: u64 = 198_272;

fn bytes_per_step(s: &serde_json::Value) -> u64 {
    s["bytes_sent_per_rank_per_step"].as_u64().unwrap()
}

fn param_bytes(s: &serde_json::Value) -> Vec<u64> {
    s["model_state_bytes_per_rank"].as_array().unwrap().iter().map(|r| r["params"].as_u64().unwrap()).collect()
}

#[test]
fn reduce_buckets_change_no_bit_and_no_byte() {
    let tmp = tempfile::tempdir().unwrap();
    let whole = zero_run(tmp.path(), "whole", 3, 2, &[]);
    let bucketed = zero_run(tmp.path(), "bucketed", 3, 2, &["--set", "zero_optimization.reduce_bucket_size=20000"]);
    assert_eq!(whole["params_blake3"], bucketed["params_blake3"]);
    // The same values move, only in more messages (the lib test counts the all-to-alls).
    assert_eq!(bytes_per_step(&whole), bytes_per_step(&bucketed));
}

#[test]
fn persistent_units_are_held_whole_and_not_gathered() {
    let tmp = tempfile::tempdir().unwrap();
    let want = zero_run(tmp.path(), "one", 1, 0, &[])["params_blake3"].clone();
    let set = |t: &'static str| ["--set", t];
    let none = zero_run(tmp.path(), "none", 4, 3, &set("zero_optimization.stage3_param_persistence_threshold=0"));
    let unit0 = zero_run(tmp.path(), "unit0", 4, 3, &[]);
    let all = zero_run(tmp.path(), "all", 4, 3, &set("zero_optimization.stage3_param_persistence_threshold=1000000"));
    for s in [&none, &unit0, &all] {
        assert_eq!(s["params_blake3"], want);
    }
    // The default threshold keeps unit 0 on every rank: rank 0 owns it anyway, the others hold
    // one more copy (f32: 4 bytes a parameter). With every unit persistent, each rank holds Ψ.
    let (p_none, p_unit0) = (param_bytes(&none), param_bytes(&unit0));
    assert_eq!(p_unit0[0], p_none[0]);
    for r in 1..4 {
        assert_eq!(p_unit0[r] - p_none[r], 4 * UNIT0, "rank {r}");
    }
    let psi = none["num_params"].as_u64().unwrap();
    assert_eq!(psi, UNIT0 + 4 * BLOCK);
    assert!(param_bytes(&all).iter().all(|&b| b == 4 * psi), "{:?}", param_bytes(&all));
    // Unit 0 was gathered once a step; now its new values are all-gathered once at commit: the
    // same traffic. Persistent blocks are no longer gathered at every use: far less traffic
    // (what remains is mostly the gradients, sent at every micro-batch at stage 3).
    assert_eq!(bytes_per_step(&unit0), bytes_per_step(&none));
    assert!(bytes_per_step(&all) * 5 < bytes_per_step(&none) * 3, "{} vs {}", bytes_per_step(&all), bytes_per_step(&none));
}

#[test]
fn bounded_live_parameters_regather_unit_0_with_the_same_bits() {
    let tmp = tempfile::tempdir().unwrap();
    let no_persist = "zero_optimization.stage3_param_persistence_threshold=0";
    let base = zero_run(tmp.path(), "base", 4, 3, &["--set", no_persist]);
    // 200,000 holds one block (198,272) but not unit 0 beside it (247,680): unit 0 is released
    // whenever a block is gathered. A short reuse distance forces the same decision.
    let live = zero_run(tmp.path(), "live", 4, 3, &["--set", no_persist, "--set", "zero_optimization.stage3_max_live_parameters=200000"]);
    let reuse = zero_run(tmp.path(), "reuse", 4, 3, &["--set", no_persist, "--set", "zero_optimization.stage3_max_reuse_distance=1000"]);
    assert_eq!(live["params_blake3"], base["params_blake3"]);
    assert_eq!(reuse["params_blake3"], base["params_blake3"]);
    assert!(bytes_per_step(&live) > bytes_per_step(&base), "{} vs {}", bytes_per_step(&live), bytes_per_step(&base));
    assert_eq!(bytes_per_step(&reuse), bytes_per_step(&live));
    // A bound below a unit's size cannot be met: refused before training, naming the unit.
    let cfg = repo().join("configs/gpt-tiny.json");
    let out = tmp.path().join("refused");
    let text = fails(
        &["train", "--config", cfg.to_str().unwrap(), "--output", out.to_str().unwrap(), "--steps", "1", "--world", "2"]
            .into_iter()
            .chain(["--set", no_persist, "--set", "zero_optimization.stage3_max_live_parameters=100000", "--no-progress"])
            .collect::<Vec<_>>(),
        tmp.path(),
    );
    assert!(
        text.contains("stage3_max_live_parameters = 100000") && text.contains("unit 1 (transformer block 0), which has 198272"),
        "{text}"
    );
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
    assert_eq!(status.code(), Some(75), "Ctrl-C should stop the run with status 75 (interrupted, checkpoint saved)");
    let text = ok(&["generate", "--checkpoint", ckpts.to_str().unwrap(), "--tokens", "4"], tmp.path());
    assert!(!text.contains("skipped checkpoint"), "a checkpoint was left damaged:\n{text}");
}
