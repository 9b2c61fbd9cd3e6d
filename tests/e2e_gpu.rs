//! `tessera train --device cuda`: clear refusals on any machine (no GPU, unsupported options);
//! with GPUs, training, resume, the CPU reading GPU checkpoints, and 1 vs 2 GPUs giving the same
//! parameters (skipped, with the reason printed, where the GPUs are missing).

use std::path::Path;

use crate::common::*;

/// A small run the GPU path supports: gpt-mini-gpu (head dimension 64), M = 2 micro-batches
/// per step (gradient accumulation 2 on one GPU, 1 on two), bf16, AdamW, cosine schedule,
/// clipping, ZeRO-2, a checkpoint and an evaluation every 10 steps.
const CONFIG: &str = r#"{
  "train_batch_size": 8,
  "train_micro_batch_size_per_gpu": 4,
  "optimizer": { "type": "AdamW", "params": { "lr": 2e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1 } },
  "scheduler": { "type": "WarmupCosineLR", "params": { "total_num_steps": 20, "warmup_num_steps": 4 } },
  "gradient_clipping": 1.0,
  "bf16": { "enabled": true },
  "zero_optimization": { "stage": 2 },
  "csv_monitor": { "enabled": true, "output_path": "", "job_name": "csv" },
  "steps_per_print": 5,
  "tessera": {
    "model": "gpt-mini-gpu",
    "seq_len": 64,
    "steps": 20,
    "eval_interval": 10,
    "eval_iters": 2,
    "checkpoint_interval": 10,
    "keep_last": 3
  }
}"#;

fn gpu_count() -> Result<usize, String> {
    tessera_kernels::cuda::device_count().map_err(|e| e.to_string())
}

/// The number of GPUs, or `None` after printing why the test is skipped.
fn gpus_or_skip() -> Option<usize> {
    match gpu_count() {
        Ok(n) if n >= 1 => Some(n),
        Ok(_) => {
            println!("skipped: no CUDA device on this machine");
            None
        }
        Err(e) => {
            println!("skipped: {e}");
            None
        }
    }
}

fn cuda_args<'a>(config: &'a str, out: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec!["train", "--config", config, "--device", "cuda", "--output", out, "--no-progress"];
    a.extend_from_slice(extra);
    a
}

/// Runs and expects exit status 1 (an error, not a panic); returns stdout + stderr.
fn exits_1(args: &[&str], cwd: &Path) -> String {
    let out = run(args, cwd);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "tessera {args:?} should exit with 1:\n{text}");
    assert!(!text.contains("panicked"), "tessera {args:?} panicked:\n{text}");
    text
}

#[test]
fn device_cuda_without_a_gpu_fails_with_a_clear_message() {
    if let Ok(n) = gpu_count() {
        if n > 0 {
            println!("skipped: this machine has {n} GPU(s); the no-GPU message cannot be observed here");
            return;
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write(tmp.path(), "gpu.json", CONFIG);
    let out = tmp.path().join("run");
    let text = exits_1(&cuda_args(cfg.to_str().unwrap(), out.to_str().unwrap(), &[]), tmp.path());
    let no_driver = text.contains("no CUDA driver could be loaded") && text.contains("use `--device cpu`");
    let no_device = text.contains("reports no GPU on this machine") && text.contains("use `--device cpu`");
    assert!(no_driver || no_device, "unclear message:\n{text}");
    assert!(!out.join("summary.json").exists(), "a failed GPU run wrote a summary");
}

#[test]
fn device_cuda_refuses_unsupported_options_naming_the_key() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write(tmp.path(), "gpu.json", CONFIG);
    let (cfg, out) = (cfg.to_str().unwrap().to_string(), tmp.path().join("run").to_str().unwrap().to_string());
    let cases: [(&[&str], &str); 8] = [
        (&["--model", "llama-tiny"], "kernels run head dimensions 64 and 128"),
        (&["--model", "gpt-tiny"], "has head dimension 32"),
        (&["--nprocs", "2", "--set", "optimizer.type=\"Lamb\""], "optimizer.type = \"Lamb\" with zero_optimization.stage = 2 on 2 GPUs"),
        (
            &[
                "--set",
                "optimizer={\"type\": \"Lamb\", \"params\": {\"lr\": 0.01}}",
                "--set",
                "zero_optimization.stage=3",
                "--set",
                "zero_optimization.offload_optimizer={\"device\": \"cpu\", \"ratio\": 0.5}",
            ],
            "(ratio 0.5) with optimizer.type = \"Lamb\"",
        ),
        (
            &[
                "--set",
                "zero_optimization.stage=3",
                "--set",
                "zero_optimization.offload_optimizer={\"device\": \"nvme\", \"nvme_path\": \"/tmp\", \"ratio\": 0.5}",
            ],
            "with device = \"nvme\"",
        ),
        (
            &["--set", "zero_optimization.stage=0", "--set", "zero_optimization.offload_optimizer={\"device\": \"cpu\"}"],
            "needs ZeRO stage 1, 2 or 3",
        ),
        (
            &[
                "--set",
                "zero_optimization.stage=3",
                "--set",
                "zero_optimization.offload_param={\"device\": \"nvme\", \"nvme_path\": \"/tmp\"}",
                "--set",
                "zero_optimization.offload_optimizer={\"device\": \"cpu\", \"ratio\": 0.5}",
            ],
            "with zero_optimization.offload_optimizer.ratio = 0.5",
        ),
        (
            &["--abandon-step", "3", "--set", "zero_optimization.offload_optimizer={\"device\": \"cpu\"}"],
            "--abandon-step with zero_optimization.offload_optimizer",
        ),
    ];
    for (extra, want) in cases {
        let text = exits_1(&cuda_args(&cfg, &out, extra), tmp.path());
        assert!(text.contains(want), "{extra:?}: expected the error to say `{want}`:\n{text}");
        assert!(text.contains("--device cpu"), "{extra:?}: the error should point to --device cpu:\n{text}");
    }
    // Parameter offload needs the stage with parameter shards.
    let text = exits_1(&cuda_args(&cfg, &out, &["--set", "zero_optimization.offload_param={\"device\": \"cpu\"}"]), tmp.path());
    assert!(text.contains("offload_param needs ZeRO stage 3"), "{text}");
    // Elastic runs: the NCCL trainer is not elastic; the error points to the engine's GPU ranks.
    let text = exits_1(&cuda_args(&cfg, &out, &["--nprocs", "2", "--set", "tessera.elastic.enabled=true"]), tmp.path());
    assert!(text.contains("tessera.gpu.collective = \"quic\""), "{text}");
    // The engine's GPU ranks refuse models the GPU kernels do not run, by name, before any GPU
    // is touched.
    let quic = ["--set", "tessera.gpu.collective=quic"];
    let text = exits_1(&cuda_args(&cfg, &out, &[&quic[..], &["--model", "gpt-tiny"]].concat()), tmp.path());
    assert!(text.contains("tessera.device = \"cuda\"") && text.contains("head dimension 64"), "{text}");
}

/// Without a GPU, the engine's GPU ranks on this host are refused at start, not at their first step.
#[test]
fn engine_gpu_ranks_without_a_gpu_are_refused_at_start() {
    if let Ok(n) = gpu_count() {
        if n > 0 {
            println!("skipped: this machine has {n} GPU(s); the no-GPU refusal cannot be observed here");
            return;
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write(tmp.path(), "gpu.json", CONFIG);
    let out = tmp.path().join("run");
    let args = cuda_args(cfg.to_str().unwrap(), out.to_str().unwrap(), &["--nprocs", "2", "--set", "tessera.gpu.collective=quic"]);
    let text = exits_1(&args, tmp.path());
    let no_driver = text.contains("no CUDA driver could be loaded");
    let no_device = text.contains("reports no GPU on this machine") && text.contains("use --device cpu");
    assert!(no_driver || no_device, "{text}");
    assert!(!text.contains("step"), "refused after training began:\n{text}");
}

/// `tessera.device_memory_bytes_max` applies to the GPU trainer, checked before any GPU is
/// touched: states over the budget are refused with the needed and available bytes and the
/// offload hint; with the optimizer offloaded the same budget passes (the run then needs a GPU).
#[test]
fn device_cuda_checks_the_device_budget_at_start() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write(tmp.path(), "gpu.json", CONFIG);
    let (cfg, out) = (cfg.to_str().unwrap().to_string(), tmp.path().join("run").to_str().unwrap().to_string());
    // gpt-mini-gpu at ZeRO-2 on one GPU with 2 micro-batches holds about 9 MB of model states
    // on the device, about 4 MB of them without the optimizer.
    let budget = ["--set", "tessera.device_memory_bytes_max=6000000"];
    let text = exits_1(&cuda_args(&cfg, &out, &budget), tmp.path());
    for want in
        ["each GPU rank needs", "bytes of device memory for its model states", "tessera.device_memory_bytes_max = 6000000", "bytes over"]
    {
        assert!(text.contains(want), "expected `{want}` in:\n{text}");
    }
    assert!(text.contains("offload_optimizer.device = \"cpu\" moves the"), "no offload hint:\n{text}");
    let offload = ["--set", "zero_optimization.offload_optimizer={\"device\": \"cpu\"}"];
    let args: Vec<&str> = budget.iter().chain(&offload).copied().collect();
    if gpu_count().is_ok_and(|n| n > 0) {
        println!("the offloaded run under the budget is trained by gpu_optimizer_offload_gives_the_same_bits");
        return;
    }
    let text = exits_1(&cuda_args(&cfg, &out, &args), tmp.path());
    assert!(!text.contains("device_memory_bytes_max"), "the offloaded run should fit the budget:\n{text}");
    assert!(text.contains("--device cpu"), "expected the no-GPU message:\n{text}");
    // A budget nothing fits names the offload that is already on.
    let tiny = ["--set", "tessera.device_memory_bytes_max=1000", "--set", "zero_optimization.offload_optimizer={\"device\": \"cpu\"}"];
    let text = exits_1(&cuda_args(&cfg, &out, &tiny), tmp.path());
    assert!(text.contains("the optimizer is already offloaded"), "{text}");
}

/// Optimizer offload on the GPU (the masters and moments in host memory, AdamW on CPU threads)
/// gives the parameters of the GPU optimizer bit for bit: all of the optimizer (ZeRO-1, 2, 3)
/// or part of it (`ratio`, ZeRO-3), resumed from an offloaded checkpoint, on 2 GPUs; and it trains
/// under a device budget the run without offload exceeds.
#[test]
fn gpu_optimizer_offload_gives_the_same_bits() {
    let Some(n) = gpus_or_skip() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write(tmp.path(), "gpu.json", CONFIG);
    let cfg = cfg.to_str().unwrap();
    let dir = |name: &str| tmp.path().join(name).to_str().unwrap().to_string();
    let base = dir("base");
    ok(&cuda_args(cfg, &base, &[]), tmp.path());
    let b = summary(Path::new(&base));
    assert!(b["offload"].is_null(), "{b}");
    let offload = |ratio: &str| format!("zero_optimization.offload_optimizer={{\"device\": \"cpu\", \"ratio\": {ratio}}}");
    // (A ratio below 1 is DeepSpeed's partial offload, a ZeRO-3 feature.)
    for (name, ratio, stage) in [("off-1", "1.0", "2"), ("off-z1", "1.0", "1"), ("off-z3", "1.0", "3"), ("off-half", "0.5", "3")] {
        let out = dir(name);
        let stage = format!("zero_optimization.stage={stage}");
        let text = ok(&cuda_args(cfg, &out, &["--set", &offload(ratio), "--set", &stage]), tmp.path());
        assert!(text.contains("optimizer offloaded to host memory"), "{text}");
        let s = summary(Path::new(&out));
        assert_eq!(b["params_blake3"], s["params_blake3"], "{name}: offload changed the parameters");
        assert!(s["offloaded_bytes_per_rank"][0]["host"].as_u64().unwrap() > 0, "{s}");
        assert!(s["offload"]["cpu_step_ms"].as_f64().unwrap() > 0.0, "{s}");
        let dev = |x: &serde_json::Value| x["model_state_bytes_per_rank"][0]["optimizer_states"].as_u64().unwrap();
        assert!(dev(&s) < dev(&b), "{name}: the GPU still holds the whole optimizer: {s}");
    }
    // 10 offloaded steps, then resumed (moments restored into host memory) for 10 more.
    let split = dir("off-split");
    let o = offload("1.0");
    ok(&cuda_args(cfg, &split, &["--set", &o, "--steps", "10"]), tmp.path());
    let ck = format!("{split}/checkpoints");
    ok(&cuda_args(cfg, &split, &["--set", &o, "--resume", &ck]), tmp.path());
    assert_eq!(b["params_blake3"], summary(Path::new(&split))["params_blake3"], "offloaded 10 + resume + 10 differ");
    // NVMe: the masters and moments in swap files (ZeRO-2 and 3), the same bits; resumed from
    // a checkpoint (moments written into the swap files).
    let swap = tmp.path().join("swap");
    std::fs::create_dir_all(&swap).unwrap();
    let nvme = format!("zero_optimization.offload_optimizer={{\"device\": \"nvme\", \"nvme_path\": \"{}\"}}", swap.display());
    for stage in ["2", "3"] {
        let out = dir(&format!("nvme-{stage}"));
        let set = format!("zero_optimization.stage={stage}");
        let text = ok(&cuda_args(cfg, &out, &["--set", &nvme, "--set", &set]), tmp.path());
        assert!(text.contains("optimizer offloaded to NVMe swap files"), "{text}");
        assert_eq!(b["params_blake3"], summary(Path::new(&out))["params_blake3"], "NVMe offload (ZeRO-{stage}) changed the parameters");
    }
    let nsplit = dir("nvme-split");
    ok(&cuda_args(cfg, &nsplit, &["--set", &nvme, "--steps", "10"]), tmp.path());
    let ck = format!("{nsplit}/checkpoints");
    ok(&cuda_args(cfg, &nsplit, &["--set", &nvme, "--resume", &ck]), tmp.path());
    assert_eq!(b["params_blake3"], summary(Path::new(&nsplit))["params_blake3"], "NVMe 10 + resume + 10 differ");
    assert_eq!(std::fs::read_dir(&swap).unwrap().count(), 0, "the swap files outlived the runs");
    // The budget counts everything on the device. Model states over it: refused at start,
    // before any GPU is touched. Model states within it but not the activations and scratch:
    // refused once the rank is built, naming them. Everything within it: trains.
    let states = |s: &serde_json::Value| s["model_state_bytes_per_rank"][0]["total"].as_u64().unwrap();
    let off_states = states(&summary(Path::new(&dir("off-1"))));
    let set = |max: u64| format!("tessera.device_memory_bytes_max={max}");
    let over = set(states(&b) - 1);
    let text = exits_1(&cuda_args(cfg, &dir("over"), &["--set", &over]), tmp.path());
    assert!(text.contains(&format!("tessera.device_memory_bytes_max = {}", states(&b) - 1)) && text.contains("model states"), "{text}");
    let text = exits_1(&cuda_args(cfg, &dir("over-act"), &["--set", &set(off_states), "--set", &o]), tmp.path());
    assert!(text.contains("activations and scratch"), "{text}");
    let under = dir("under");
    let all = b["device_bytes_per_rank"][0].as_u64().unwrap();
    ok(&cuda_args(cfg, &under, &["--set", &set(all), "--set", &o]), tmp.path());
    assert_eq!(b["params_blake3"], summary(Path::new(&under))["params_blake3"]);
    if n < 2 {
        println!("skipped the 2-GPU offload runs: this machine has {n} GPU");
        return;
    }
    for stage in ["1", "2", "3"] {
        let two = dir(&format!("off-two-{stage}"));
        let set = format!("zero_optimization.stage={stage}");
        let ratio = if stage == "3" { "0.75" } else { "1.0" };
        ok(&cuda_args(cfg, &two, &["--nprocs", "2", "--set", &set, "--set", &offload(ratio)]), tmp.path());
        let s = summary(Path::new(&two));
        assert_eq!(s["world_size"], 2);
        assert_eq!(b["params_blake3"], s["params_blake3"], "2 GPUs with offload (ZeRO-{stage}) differ from 1 GPU without");
    }
}

/// Parameter offload at ZeRO-3 (`offload_param`: the bf16 shard in page-locked host memory, or
/// in a swap file read ahead of each gather) gives the parameters of the run without it, bit for
/// bit: with the GPU optimizer, with the optimizer in host memory and on NVMe, resumed from a
/// checkpoint, and on 2 GPUs; the device then holds less than with the optimizer offload alone.
#[test]
fn gpu_parameter_offload_gives_the_same_bits() {
    let Some(n) = gpus_or_skip() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write(tmp.path(), "gpu.json", CONFIG);
    let cfg = cfg.to_str().unwrap();
    let dir = |name: &str| tmp.path().join(name).to_str().unwrap().to_string();
    let swap = tmp.path().join("swap");
    std::fs::create_dir_all(&swap).unwrap();
    let (base, z3) = (dir("base"), "zero_optimization.stage=3");
    ok(&cuda_args(cfg, &base, &["--set", z3]), tmp.path());
    let b = summary(Path::new(&base));
    let p_cpu = r#"zero_optimization.offload_param={"device": "cpu", "pin_memory": true}"#.to_string();
    // max_in_cpu 0: every piece in the swap file; two read buffers.
    let p_nvme = format!(
        r#"zero_optimization.offload_param={{"device": "nvme", "nvme_path": "{}", "max_in_cpu": 0, "buffer_count": 2}}"#,
        swap.display()
    );
    let o_cpu = r#"zero_optimization.offload_optimizer={"device": "cpu"}"#.to_string();
    let o_nvme = format!(r#"zero_optimization.offload_optimizer={{"device": "nvme", "nvme_path": "{}"}}"#, swap.display());
    let cases: [(&str, Vec<&str>); 5] = [
        ("param-cpu", vec![&p_cpu]),
        ("param-cpu-opt-cpu", vec![&p_cpu, &o_cpu]),
        ("param-nvme", vec![&p_nvme]),
        ("param-nvme-opt-nvme", vec![&p_nvme, &o_nvme]),
        ("opt-cpu", vec![&o_cpu]),
    ];
    for (name, sets) in &cases {
        let mut extra = vec!["--set", z3];
        sets.iter().for_each(|s| extra.extend(["--set", s]));
        let text = ok(&cuda_args(cfg, &dir(name), &extra), tmp.path());
        if name.starts_with("param-cpu") {
            assert!(text.contains("pin_memory` has no effect"), "{name}: no note on pin_memory:\n{text}");
        }
        assert_eq!(b["params_blake3"], summary(Path::new(&dir(name)))["params_blake3"], "{name}: parameter offload changed the parameters");
    }
    let params = |name: &str| summary(Path::new(&dir(name)))["model_state_bytes_per_rank"][0]["params"].as_u64().unwrap();
    assert!(params("param-cpu-opt-cpu") < params("opt-cpu"), "the bf16 shard is still counted on the device");
    let dev = |name: &str| summary(Path::new(&dir(name)))["device_bytes_per_rank"][0].as_u64().unwrap();
    assert!(dev("param-cpu-opt-cpu") < dev("opt-cpu"), "parameter offload did not shrink the device memory");
    // 10 steps, then resumed for 10 more: the shard is rebuilt from the checkpoint's masters.
    let split = dir("param-split");
    for more in [&["--steps", "10"][..], &["--resume", &format!("{split}/checkpoints")][..]] {
        let extra: Vec<&str> = ["--set", z3, "--set", &p_nvme, "--set", &o_cpu].into_iter().chain(more.iter().copied()).collect();
        ok(&cuda_args(cfg, &split, &extra), tmp.path());
    }
    assert_eq!(b["params_blake3"], summary(Path::new(&split))["params_blake3"], "parameter offload 10 + resume + 10 differ");
    assert_eq!(std::fs::read_dir(&swap).unwrap().count(), 0, "the swap files outlived the runs");
    if n < 2 {
        println!("skipped the 2-GPU parameter offload runs: this machine has {n} GPU");
        return;
    }
    for (name, p) in [("two-cpu", &p_cpu), ("two-nvme", &p_nvme)] {
        ok(&cuda_args(cfg, &dir(name), &["--nprocs", "2", "--set", z3, "--set", p]), tmp.path());
        assert_eq!(b["params_blake3"], summary(Path::new(&dir(name)))["params_blake3"], "{name}: 2 GPUs with parameter offload differ");
    }
}

#[test]
fn gpu_training_learns_resumes_and_matches_across_gpu_counts() {
    let Some(n) = gpus_or_skip() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write(tmp.path(), "gpu.json", CONFIG);
    let cfg = cfg.to_str().unwrap();
    let dir = |name: &str| tmp.path().join(name).to_str().unwrap().to_string();

    // 20 steps on one GPU: the loss falls, every output is there.
    let one = dir("one");
    let text = ok(&cuda_args(cfg, &one, &[]), tmp.path());
    assert!(text.contains("summary"), "{text}");
    let s1 = summary(Path::new(&one));
    assert_eq!(s1["steps"], 20, "{s1}");
    assert_eq!(s1["device"], "cuda");
    let (v0, v) = (s1["initial_val_loss"].as_f64().unwrap(), s1["val_loss"].as_f64().unwrap());
    assert!(v < v0 - 0.3, "validation loss did not fall enough: {v0} → {v}");
    assert!(s1["final_loss"].as_f64().unwrap() < v0, "training loss did not fall: {s1}");
    assert!(s1["device_bytes_per_rank"][0].as_u64().unwrap() > 0, "{s1}");
    for f in ["loss.svg", "metrics.jsonl"] {
        assert!(Path::new(&one).join(f).exists(), "{f} missing");
    }
    assert!(Path::new(&one).join("csv").read_dir().unwrap().count() > 0, "csv monitor wrote nothing");

    // The same config on the CPU (same data, schedule, clipping; f32 compute on bf16 storage)
    // lands close to the GPU run (bf16 activations).
    let cpu_ref = dir("cpu-ref");
    ok(&["train", "--config", cfg, "--output", &cpu_ref, "--no-progress"], tmp.path());
    let c = summary(Path::new(&cpu_ref));
    let (c0, c1) = (c["initial_val_loss"].as_f64().unwrap(), c["val_loss"].as_f64().unwrap());
    assert!((c0 - v0).abs() < 0.05, "initial validation loss: CPU {c0}, GPU {v0}");
    assert!((c1 - v).abs() < 0.15, "validation loss after 20 steps: CPU {c1}, GPU {v}");

    // 10 steps, then resumed for 10 more on the GPU: the same bits as 20 straight.
    let split = dir("split");
    ok(&cuda_args(cfg, &split, &["--steps", "10"]), tmp.path());
    let ck = format!("{split}/checkpoints");
    ok(&cuda_args(cfg, &split, &["--resume", &ck]), tmp.path());
    let s2 = summary(Path::new(&split));
    assert_eq!(s1["params_blake3"], s2["params_blake3"], "20 straight GPU steps differ from 10 + resume + 10");

    // A step is a transaction of the engine's actor tree on the GPU too: steps 3 and 7 prepared,
    // abandoned and run again give the same bits.
    let abandoned = dir("abandoned");
    ok(&cuda_args(cfg, &abandoned, &["--abandon-step", "3", "--abandon-step", "7"]), tmp.path());
    let sb = summary(Path::new(&abandoned));
    assert_eq!(s1["params_blake3"], sb["params_blake3"], "abandoned and rerun GPU steps changed the parameters");
    assert_eq!(sb["abandoned_attempts"], 2, "{sb}");

    // Activation checkpointing (blocks keep their inputs, the backward recomputes the rest):
    // the same bits, in less device memory.
    let ac = dir("recompute");
    ok(&cuda_args(cfg, &ac, &["--set", "tessera.activation_checkpointing=true"]), tmp.path());
    let sa = summary(Path::new(&ac));
    assert_eq!(s1["params_blake3"], sa["params_blake3"], "activation checkpointing changed the parameters");
    let bytes = |s: &serde_json::Value| s["device_bytes_per_rank"][0].as_u64().unwrap();
    assert!(bytes(&sa) < bytes(&s1), "recomputation should hold less: {} vs {} bytes", bytes(&sa), bytes(&s1));

    // The CPU reads the GPU checkpoint: generate, and resume for 2 more steps.
    let ck = format!("{one}/checkpoints");
    ok(&["generate", "--checkpoint", &ck, "--tokens", "8", "--prompt", "It is"], tmp.path());
    let cpu = dir("cpu");
    let cpu_args = ["train", "--config", cfg, "--output", &cpu, "--no-progress", "--resume", &ck, "--steps", "22", "--world", "1"];
    ok(&cpu_args, tmp.path());
    assert_eq!(summary(Path::new(&cpu))["steps"], 22);

    if n < 2 {
        println!("skipped the 1 vs 2 GPU comparison: this machine has {n} GPU");
        return;
    }
    // Two GPUs (one micro-batch each) give the bits of one GPU running both, at stages 2 and 3
    // (and stage 3 with its gathered units recomputing activations).
    for (stage, recompute) in [("2", false), ("3", false), ("3", true)] {
        let two = dir(&format!("two-{stage}-{recompute}"));
        let set = format!("zero_optimization.stage={stage}");
        let ac = format!("tessera.activation_checkpointing={recompute}");
        ok(&cuda_args(cfg, &two, &["--nprocs", "2", "--set", &set, "--set", &ac]), tmp.path());
        let s = summary(Path::new(&two));
        assert_eq!(s["world_size"], 2);
        assert_eq!(s1["params_blake3"], s["params_blake3"], "1 GPU and 2 GPUs (ZeRO-{stage}, recompute {recompute}) differ");
    }
}

/// OneCycle with DeepSpeed's default `cycle_momentum` on the GPU: the AdamW kernel steps with
/// the cycled beta1 (printed per step as on the CPU), the flag changes the parameters, a run
/// resumed mid-cycle has the bits of a straight one, the host AdamW of optimizer offload cycles
/// the same betas (same bits), and the GPU run lands close to the CPU run of the same config.
#[test]
fn gpu_one_cycle_momentum_cycles_the_betas_and_resumes_bit_exactly() {
    let Some(_) = gpus_or_skip() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write(tmp.path(), "gpu.json", CONFIG);
    let cfg = cfg.to_str().unwrap();
    let dir = |name: &str| tmp.path().join(name).to_str().unwrap().to_string();
    let one_cycle =
        r#"scheduler={"type": "OneCycle", "params": {"cycle_min_lr": 0.0005, "cycle_max_lr": 0.003, "cycle_first_step_size": 3}}"#;
    let train = |out: &str, extra: &[&str]| {
        let mut a = vec!["--set", one_cycle, "--set", "steps_per_print=1"];
        a.extend_from_slice(extra);
        ok(&cuda_args(cfg, out, &a), tmp.path())
    };
    let straight = dir("straight");
    let text = train(&straight, &["--steps", "6"]);
    assert!(text.contains("`optimizer.params.betas` is replaced by OneCycle's momentum cycle"), "{text}");
    // cycle_min_mom (0.8) first, then up the triangle (3 + 3 iterations) towards 0.9.
    assert!(text.contains("| beta1 0.8000 |") && text.contains("| beta1 0.8667 |"), "{text}");
    let fixed = dir("fixed");
    let fixed_text = train(&fixed, &["--steps", "6", "--set", "scheduler.params.cycle_momentum=false"]);
    assert!(!fixed_text.contains("beta1"), "{fixed_text}");
    let split = dir("split");
    train(&split, &["--steps", "3"]);
    let ck = format!("{split}/checkpoints");
    train(&split, &["--steps", "6", "--resume", &ck]);
    let offload = dir("offload");
    train(&offload, &["--steps", "6", "--set", r#"zero_optimization.offload_optimizer={"device": "cpu"}"#]);
    let (s, f, r, o) =
        (summary(Path::new(&straight)), summary(Path::new(&fixed)), summary(Path::new(&split)), summary(Path::new(&offload)));
    assert_ne!(s["params_blake3"], f["params_blake3"], "cycle_momentum changed no parameter on the GPU");
    assert_eq!(s["params_blake3"], r["params_blake3"], "6 straight GPU steps differ from 3 + resume + 3 under OneCycle momentum");
    assert_eq!(s["params_blake3"], o["params_blake3"], "the offloaded host AdamW did not cycle the betas as the GPU kernel does");
    // The CPU run of the same config (f32 compute) lands close to the GPU's (bf16 activations).
    let cpu = dir("cpu");
    let mut a = vec!["train", "--config", cfg, "--output", &cpu, "--no-progress", "--steps", "6", "--set", one_cycle];
    a.extend_from_slice(&["--set", "steps_per_print=1"]);
    let cpu_text = ok(&a, tmp.path());
    assert!(cpu_text.contains("| beta1 0.8000 |") && cpu_text.contains("| beta1 0.8667 |"), "{cpu_text}");
    let c = summary(Path::new(&cpu));
    let (cv, gv) = (c["val_loss"].as_f64().unwrap(), s["val_loss"].as_f64().unwrap());
    assert!((cv - gv).abs() < 0.15, "validation loss after 6 OneCycle steps: CPU {cv}, GPU {gv}");
}

/// GPU ranks of the one engine (`tessera.gpu.collective = "quic"`): forward and backward on the
/// GPU, gradients staged to the host and reduced by the engine's fixed tree. One rank, two rank
/// threads at ZeRO-1, and two worker processes at ZeRO-3 (the GPU shared) give the same
/// parameters; the loss falls and the summary says where the ranks computed. fp16 from an
/// overflowing scale: one rank and two processes skip the same steps and end on the same bits.
/// Every optimizer the CPU engine runs (LAMB on one GPU; SGD, Lion and Adagrad also with optimizer
/// offload), and fp16 under the dynamic loss scaler (also with the optimizer offloaded: the same
/// skipped steps and bits as on the GPU), on the GPU ranks: each run's validation loss falls and lands close to the CPU run of the same config;
/// SGD's momentum buffer and Adagrad's `sum` resume bit-exactly; fp16 from an overflowing scale (2^20 and 2^19
/// overflow by a clear margin, 2^18 fits) skips the same steps as the CPU. (With a short growth
/// window the scale returns to the threshold again and again, where the GPU's bf16 gradient and
/// the CPU's f32 one may decide a step differently: `gpu check` compares the decisions at each
/// scale away from the threshold.)
#[test]
fn gpu_optimizers_and_fp16_train_like_the_cpu() {
    let Some(_) = gpus_or_skip() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write(tmp.path(), "gpu.json", CONFIG);
    let cfg = cfg.to_str().unwrap();
    let dir = |name: &str| tmp.path().join(name).to_str().unwrap().to_string();
    let offload = "zero_optimization.offload_optimizer={\"device\": \"cpu\"}";
    let adagrad = "optimizer={\"type\": \"Adagrad\", \"params\": {\"lr\": 1e-2, \"lr_decay\": 0.01, \"weight_decay\": 0.01, \"initial_accumulator_value\": 0.1}}";
    let sgd = "optimizer={\"type\": \"SGD\", \"params\": {\"lr\": 0.1, \"momentum\": 0.9, \"nesterov\": true, \"weight_decay\": 0.01}}";
    let lion = "optimizer={\"type\": \"Lion\", \"params\": {\"lr\": 5e-4, \"betas\": [0.9, 0.99], \"weight_decay\": 0.1}}";
    let lamb = "optimizer={\"type\": \"Lamb\", \"params\": {\"lr\": 1e-2, \"weight_decay\": 0.01}}";
    let cases: [(&str, &[&str]); 10] = [
        (
            "adam-l2",
            &[
                "--set",
                "optimizer.type=\"Adam\"",
                "--set",
                "optimizer.params.adam_w_mode=false",
                "--set",
                "optimizer.params.bias_correction=false",
            ],
        ),
        ("sgd", &["--set", sgd]),
        ("lion", &["--set", lion]),
        // (On the CPU here, 2026-12-04: val loss 5.540 → 3.194 (SGD), 4.133 (Lion), 4.617 (Adagrad),
        // the same bits with optimizer offload to host memory or NVMe.)
        ("adagrad", &["--set", adagrad]),
        // Optimizer offload: the host step runs the CPU engine's kernels (ZeRO-2, every piece on the host).
        ("sgd-offload", &["--set", sgd, "--set", offload]),
        ("lion-offload", &["--set", lion, "--set", offload]),
        ("adagrad-offload", &["--set", adagrad, "--set", offload]),
        // (On the CPU here: val loss 5.540 → 4.827 after 20 steps.)
        ("lamb", &["--set", lamb]),
        // LAMB with the optimizer in host memory: its two-phase host step (gpu/lamb_host.rs).
        ("lamb-offload", &["--set", lamb, "--set", offload]),
        (
            "fp16",
            &[
                "--set",
                "bf16.enabled=false",
                "--set",
                "fp16={\"enabled\": true, \"initial_scale_power\": 20, \"loss_scale_window\": 1000, \"hysteresis\": 1}",
            ],
        ),
    ];
    for (name, extra) in cases {
        let (gpu, cpu) = (dir(&format!("{name}-gpu")), dir(&format!("{name}-cpu")));
        ok(&cuda_args(cfg, &gpu, extra), tmp.path());
        let mut cpu_args = vec!["train", "--config", cfg, "--output", &cpu, "--no-progress"];
        cpu_args.extend_from_slice(extra);
        ok(&cpu_args, tmp.path());
        let (g, c) = (summary(Path::new(&gpu)), summary(Path::new(&cpu)));
        let loss = |s: &serde_json::Value, k: &str| s[k].as_f64().unwrap();
        let (g0, g1, c1) = (loss(&g, "initial_val_loss"), loss(&g, "val_loss"), loss(&c, "val_loss"));
        println!("{name}: GPU val loss {g0:.4} → {g1:.4}, CPU → {c1:.4}; skipped GPU {} CPU {}", g["skipped_steps"], c["skipped_steps"]);
        assert!(g1 < g0 - 0.2, "{name}: the GPU validation loss did not fall enough: {g0} → {g1}");
        assert!((g1 - c1).abs() < 0.15, "{name}: validation loss after 20 steps: GPU {g1}, CPU {c1}");
        if name == "fp16" {
            // Both start at 2^20 and must overflow and halve before they train. The counts are
            // not compared: the GPU's gradients come from bf16 activations, so near a threshold
            // its decisions can differ from the CPU's (the H200 run of 2026-12-04 18:47 UTC
            // skipped 7 steps against the CPU's 4); the same gradient gives the same decision
            // (`tessera gpu check`'s fp16 rows, at every scale from 2^0 to 2^40).
            for (who, s) in [("GPU", &g), ("CPU", &c)] {
                let skipped = s["skipped_steps"].as_u64().unwrap();
                assert!(skipped > 0, "fp16 from 2^20 should overflow at first on the {who}: {s}");
            }
            // The optimizer offloaded to host memory: the host step waits for the scaler's verdict
            // and hands overflowing steps back unstepped; the same skips, the same bits.
            let off = dir("fp16-offload");
            ok(&cuda_args(cfg, &off, &[extra, &["--set", offload]].concat()), tmp.path());
            let o = summary(Path::new(&off));
            assert_eq!(o["skipped_steps"], g["skipped_steps"], "fp16 with optimizer offload skipped other steps: {o}");
            assert_eq!(o["params_blake3"], g["params_blake3"], "fp16 with optimizer offload ended on other parameters");
        }
        if name == "sgd" || name == "adagrad" {
            // 10 steps, then resumed for 10 more: the momentum buffer (Adagrad: `sum`) round-trips
            // the checkpoint.
            let split = dir(&format!("{name}-split"));
            let mut a = cuda_args(cfg, &split, extra);
            a.extend_from_slice(&["--steps", "10"]);
            ok(&a, tmp.path());
            let ck = format!("{split}/checkpoints");
            let mut a = cuda_args(cfg, &split, extra);
            a.extend_from_slice(&["--resume", &ck]);
            ok(&a, tmp.path());
            assert_eq!(
                g["params_blake3"],
                summary(Path::new(&split))["params_blake3"],
                "{name}: 20 straight steps differ from 10 + resume + 10"
            );
        }
    }
}

#[test]
fn gpu_ranks_of_the_one_engine_give_the_same_bits_for_every_world_and_stage() {
    let Some(_) = gpus_or_skip() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let cfg = write(tmp.path(), "gpu.json", CONFIG);
    let cfg = cfg.to_str().unwrap();
    let dir = |name: &str| tmp.path().join(name).to_str().unwrap().to_string();
    let quic = ["--set", "tessera.gpu.collective=quic"];
    let one = dir("one");
    ok(&cuda_args(cfg, &one, &[&quic[..], &["--world", "1", "--set", "zero_optimization.stage=0"]].concat()), tmp.path());
    let s1 = summary(Path::new(&one));
    assert_eq!(s1["device"], "cuda", "{s1}");
    assert_eq!(s1["steps"], 20, "{s1}");
    let (v0, v) = (s1["initial_val_loss"].as_f64().unwrap(), s1["val_loss"].as_f64().unwrap());
    assert!(v < v0 - 0.3, "validation loss did not fall enough: {v0} → {v}");
    // The threads also abandon step 3 once and run it again (the step transaction).
    let threads = ["--world", "2", "--set", "zero_optimization.stage=1", "--abandon-step", "3"];
    let procs = ["--nprocs", "2", "--set", "zero_optimization.stage=3", "--set", "tessera.keep_last=1"];
    for (name, extra) in [("threads", threads), ("procs", procs)] {
        let out = dir(name);
        ok(&cuda_args(cfg, &out, &[&quic[..], &extra[..]].concat()), tmp.path());
        let s = summary(Path::new(&out));
        assert_eq!(s["world_size"], 2, "{s}");
        assert_eq!(s1["params_blake3"], s["params_blake3"], "{name}: two GPU ranks differ from one");
        if name == "threads" {
            assert_eq!(s["abandoned_attempts"], 1, "{s}");
        }
    }
    // fp16 from an overflowing 2^20: the gradients come back and are stored in fp16 under the
    // engine's loss scaler; one rank and two processes at ZeRO-3 skip the same steps and end on
    // the same bits, and the loss falls.
    let fp16 = ["--set", "bf16.enabled=false", "--set", "fp16={\"enabled\": true, \"initial_scale_power\": 20, \"hysteresis\": 1}"];
    let runs = [("fp16-one", &["--world", "1", "--set", "zero_optimization.stage=0"][..]), ("fp16-procs", &procs[..])];
    let fp: Vec<serde_json::Value> = runs
        .iter()
        .map(|(name, extra)| {
            let out = dir(name);
            ok(&cuda_args(cfg, &out, &[&quic[..], &fp16[..], extra].concat()), tmp.path());
            summary(Path::new(&out))
        })
        .collect();
    println!(
        "fp16 on the engine's GPU ranks: skipped {} / {}, val loss {} → {}",
        fp[0]["skipped_steps"], fp[1]["skipped_steps"], fp[0]["initial_val_loss"], fp[0]["val_loss"]
    );
    assert!(fp[0]["skipped_steps"].as_u64().unwrap() > 0, "fp16 from 2^20 should overflow at first: {}", fp[0]);
    assert_eq!(fp[0]["skipped_steps"], fp[1]["skipped_steps"], "{} / {}", fp[0], fp[1]);
    assert_eq!(fp[0]["params_blake3"], fp[1]["params_blake3"], "fp16: two GPU rank processes differ from one");
    let (v0, v) = (fp[0]["initial_val_loss"].as_f64().unwrap(), fp[0]["val_loss"].as_f64().unwrap());
    assert!(v < v0 - 0.2, "fp16: validation loss did not fall enough: {v0} → {v}");
}

/// `chaos/scenarios/gpt-mini-gpu-elastic.json`: three GPU worker processes on this machine's GPU,
/// two killed, one hung (SIGSTOP past the heartbeat timeout), two joining; the run ends on the
/// fault-free run's bits, every fault detected and recovered from.
#[test]
fn an_elastic_gpu_run_survives_kills_a_hang_and_joins() {
    let Some(_) = gpus_or_skip() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let scenario = Path::new(env!("CARGO_MANIFEST_DIR")).join("chaos/scenarios/gpt-mini-gpu-elastic.json");
    let out = tmp.path().join("chaos");
    let args =
        ["chaos", "run", "--scenario", scenario.to_str().unwrap(), "--seed", "1", "--output", out.to_str().unwrap(), "--no-progress"];
    let text = ok(&args, tmp.path());
    assert!(text.contains("result: EQUAL"), "{text}");
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["faulted"]["params_blake3"], report["clean"]["params_blake3"], "{text}");
    assert_eq!(summary(&out.join("faulted"))["device"], "cuda", "{text}");
    let el = &report["faulted"]["elastic"];
    assert_eq!(el["workers_lost"], 3, "{report:#}");
    assert_eq!(el["workers_joined"], 2, "{report:#}");
    for f in report["faults"].as_array().unwrap() {
        assert!(f["recovery_ms"].is_u64() || f["kind"] == "join", "no recovery after: {f}");
    }
}

/// A LLaMA folder made by transformers (tests/fixtures/hf/llama-gpu: grouped-query attention,
/// head dimension 64, an untied head; `scripts/gen_fixtures.py hf-gpu`) fine-tunes on the GPU
/// with `--model DIR --device cuda`: its training loss falls, and step 1's loss (the folder's own
/// weights, before any update) is the CPU run's within bf16 accuracy. Both GPU trainers run it:
/// the NCCL trainer and the engine's GPU ranks.
#[test]
fn a_transformers_llama_folder_fine_tunes_on_the_gpu() {
    let Some(_) = gpus_or_skip() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let folder = crate::common::repo().join("tests/fixtures/hf/llama-gpu");
    let line = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife.\n";
    let data = write(tmp.path(), "austen.txt", &line.repeat(80));
    let cfg = write(
        tmp.path(),
        "ft.json",
        r#"{ "train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
             "optimizer": { "type": "AdamW", "params": { "lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0 } },
             "bf16": { "enabled": true }, "zero_optimization": { "stage": 1 }, "steps_per_print": 1,
             "tessera": { "seq_len": 64, "steps": 12, "eval_interval": 100, "eval_iters": 1 } }"#,
    );
    let (cfg, model, data) = (cfg.to_str().unwrap(), folder.to_str().unwrap(), data.to_str().unwrap());
    let run = |name: &str, extra: &[&str]| -> Vec<f64> {
        let out = tmp.path().join(name);
        let mut a = vec!["train", "--config", cfg, "--model", model, "--data", data, "--output", out.to_str().unwrap(), "--no-progress"];
        a.extend_from_slice(extra);
        ok(&a, tmp.path());
        let losses = metric(&out, "Train/Samples/train_loss");
        assert_eq!(losses.len(), 12, "{name}: one training loss a step: {losses:?}");
        losses
    };
    let cpu = run("cpu", &["--world", "1"]);
    for (name, extra) in
        [("nccl", &["--device", "cuda"][..]), ("engine", &["--device", "cuda", "--set", "tessera.gpu.collective=quic"][..])]
    {
        let gpu = run(name, extra);
        println!("{name}: GPU losses {gpu:?}\nCPU losses {cpu:?}");
        assert!((gpu[0] - cpu[0]).abs() < 1e-2 * cpu[0], "{name}: step 1 loss on the GPU {} vs the CPU {}", gpu[0], cpu[0]);
        let (first, last) = (gpu[..3].iter().sum::<f64>() / 3.0, gpu[9..].iter().sum::<f64>() / 3.0);
        assert!(last < first - 0.1, "{name}: the GPU training loss did not fall: {gpu:?}");
    }
}
