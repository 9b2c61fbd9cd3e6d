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
        (&["--model", "llama-tiny"], "tessera.model = \"llama-tiny\" is a LLaMA-style model"),
        (&["--model", "gpt-tiny"], "has head dimension 32"),
        (&["--set", "bf16.enabled=false", "--set", "fp16.enabled=true"], "fp16.enabled = true"),
        (&["--set", "optimizer.type=\"Lamb\""], "optimizer.type = \"Lamb\""),
        (&["--set", "optimizer.type=\"Adam\"", "--set", "optimizer.params.adam_w_mode=false"], "optimizer.params.adam_w_mode = false"),
        (&["--set", "optimizer.params.bias_correction=false"], "optimizer.params.bias_correction = false"),
        (&["--set", "zero_optimization.offload_optimizer={\"device\": \"cpu\"}"], "zero_optimization.offload_optimizer.device = \"cpu\""),
        (&["--abandon-step", "3"], "--abandon-step 3"),
    ];
    for (extra, want) in cases {
        let text = exits_1(&cuda_args(&cfg, &out, extra), tmp.path());
        assert!(text.contains(want), "{extra:?}: expected the error to say `{want}`:\n{text}");
        assert!(text.contains("--device cpu"), "{extra:?}: the error should point to --device cpu:\n{text}");
    }
}

#[test]
fn gpu_training_learns_resumes_and_matches_across_gpu_counts() {
    let n = match gpu_count() {
        Ok(n) if n >= 1 => n,
        Ok(_) => {
            println!("skipped: no CUDA device on this machine");
            return;
        }
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    };
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
    // Two GPUs (one micro-batch each) give the bits of one GPU running both, at stages 2 and 3.
    for stage in ["2", "3"] {
        let two = dir(&format!("two-{stage}"));
        let set = format!("zero_optimization.stage={stage}");
        ok(&cuda_args(cfg, &two, &["--nprocs", "2", "--set", &set]), tmp.path());
        let s = summary(Path::new(&two));
        assert_eq!(s["world_size"], 2);
        assert_eq!(s1["params_blake3"], s["params_blake3"], "1 GPU and 2 GPUs (ZeRO-{stage}) differ");
    }
}
