//! Ranks as worker processes (`train --nprocs N`, QUIC with mTLS between them): the same bits
//! as one in-process worker for ZeRO-1 and ZeRO-3, resume across process counts, and a worker
//! killed mid-run ends the run with an error naming its rank, in bounded time, leaving no
//! worker process behind; workers of a killed parent exit on their own.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;

/// gpt-tiny, 12 micro-batches of one 32-token sequence per step; `ranks` is `--world N` or
/// `--nprocs N`.
fn args(out: &Path, ranks: &[&str], stage: u8, steps: u64) -> Vec<String> {
    let cfg = repo().join("configs/gpt-tiny.json");
    let mut a: Vec<String> = ["train", "--config", cfg.to_str().unwrap(), "--output", out.to_str().unwrap(), "--no-progress"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    a.extend(["--steps".to_string(), steps.to_string()]);
    a.extend(ranks.iter().map(|s| s.to_string()));
    for set in [
        format!("zero_optimization.stage={stage}"),
        "train_batch_size=12".into(),
        "train_micro_batch_size_per_gpu=1".into(),
        "tessera.seq_len=32".into(),
        "tessera.eval_iters=1".into(),
        "tessera.eval_interval=0".into(),
        "scheduler.params.warmup_min_ratio=0.5".into(),
    ] {
        a.extend(["--set".to_string(), set]);
    }
    a
}

fn train(dir: &Path, name: &str, ranks: &[&str], stage: u8, steps: u64, extra: &[&str]) -> serde_json::Value {
    let out = dir.join(name);
    let mut a = args(&out, ranks, stage, steps);
    a.extend(extra.iter().map(|s| s.to_string()));
    let refs: Vec<&str> = a.iter().map(String::as_str).collect();
    ok(&refs, dir);
    summary(&out)
}

/// Pids of live `tessera worker` processes started for output directory `out`.
fn workers_of(out: &Path) -> Vec<u32> {
    let needle = out.join("procs").display().to_string();
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(|e| {
            let pid: u32 = e.ok()?.file_name().to_str()?.parse().ok()?;
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // A zombie (state Z, after the ')') has an empty cmdline; a reaped one is gone.
            let zombie = stat.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with('Z'));
            let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
            let is_worker = args.get(1) == Some(&&b"worker"[..]) && args.contains(&needle.as_bytes());
            (is_worker && !zombie).then_some(pid)
        })
        .collect()
}

#[test]
fn worker_processes_give_the_bits_of_one_worker_for_zero_1_and_3() {
    let tmp = tempfile::tempdir().unwrap();
    let one = train(tmp.path(), "w1", &["--world", "1"], 0, 3, &[]);
    for stage in [1u8, 3] {
        let s = train(tmp.path(), &format!("p3s{stage}"), &["--nprocs", "3"], stage, 3, &[]);
        assert_eq!(s["world_size"], 3);
        assert_eq!(s["zero_stage"], stage);
        assert_eq!(s["params_blake3"], one["params_blake3"], "3 processes, ZeRO-{stage} differ from one worker");
        assert_eq!(s["val_loss"], one["val_loss"], "ZeRO-{stage}: evaluation reads the exported masters");
        let ranks = s["model_state_bytes_per_rank"].as_array().unwrap();
        assert_eq!(ranks.len(), 3, "every worker reports its memory");
        assert!(s["bytes_sent_per_rank_per_step"].as_u64().unwrap() > 0, "ranks exchanged tensors");
        let out = tmp.path().join(format!("p3s{stage}"));
        assert!(workers_of(&out).is_empty(), "workers left behind");
        assert!(!out.join("procs").exists(), "the run's keys outlived the workers");
    }
}

#[test]
fn a_process_run_resumes_under_another_process_count() {
    let tmp = tempfile::tempdir().unwrap();
    let whole = train(tmp.path(), "whole", &["--world", "1"], 2, 3, &[]);
    train(tmp.path(), "split", &["--nprocs", "2"], 2, 2, &[]);
    let ckpts = tmp.path().join("split/checkpoints");
    let resumed = train(tmp.path(), "split", &["--nprocs", "3"], 2, 3, &["--resume", ckpts.to_str().unwrap()]);
    assert_eq!(resumed["steps"], 3);
    assert_eq!(resumed["params_blake3"], whole["params_blake3"], "resume across process counts changed the bits");
}

#[test]
fn nprocs_and_world_together_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let a = args(&tmp.path().join("x"), &["--nprocs", "2", "--world", "2"], 0, 1);
    let refs: Vec<&str> = a.iter().map(String::as_str).collect();
    let text = fails(&refs, tmp.path());
    assert!(text.contains("--world") && text.contains("--nprocs"), "{text}");
}

/// Starts a long 3-process ZeRO-3 run that checkpoints every step.
fn spawn_long_run(dir: &Path, out: &Path) -> std::process::Child {
    Command::new(bin())
        .args(args(out, &["--nprocs", "3"], 3, 100_000))
        .args(["--set", "tessera.checkpoint_interval=1"])
        .current_dir(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning tessera")
}

/// Waits for the run's first checkpoint and its 3 workers; returns the workers' pids.
fn wait_for_workers(parent: &mut std::process::Child, out: &Path) -> Vec<u32> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let pids = workers_of(out);
        if pids.len() == 3 && out.join("checkpoints/latest").exists() {
            return pids;
        }
        if Instant::now() >= deadline {
            let _ = parent.kill();
            let _ = parent.wait();
            panic!("no checkpoint and 3 workers within 60 s (found {pids:?})");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Polls until `f` holds or `bound` passes; returns whether it held.
fn within(bound: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < bound {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    f()
}

#[test]
fn a_killed_worker_ends_the_run_naming_its_rank_and_leaves_no_orphans() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let mut parent = spawn_long_run(tmp.path(), &out);
    let pids = wait_for_workers(&mut parent, &out);
    let victim = pids[1];
    let cmd = std::fs::read(format!("/proc/{victim}/cmdline")).unwrap();
    let args: Vec<String> = cmd.split(|b| *b == 0).map(|s| String::from_utf8_lossy(s).into_owned()).collect();
    let rank = args.iter().position(|s| s == "--rank").map(|i| args[i + 1].clone()).unwrap();
    assert!(Command::new("kill").args(["-KILL", &victim.to_string()]).status().unwrap().success());
    if !within(Duration::from_secs(60), || parent.try_wait().unwrap().is_some()) {
        let _ = parent.kill();
        panic!("the parent did not exit within 60 s of a worker's death");
    }
    let output = parent.wait_with_output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(!output.status.success(), "the run should fail:\n{text}");
    assert!(text.contains(&format!("rank {rank} (pid {victim}) was killed by signal 9")), "error should name rank {rank}:\n{text}");
    assert!(workers_of(&out).is_empty(), "orphan workers: {:?}", workers_of(&out));
}

#[test]
fn workers_exit_when_their_parent_is_killed() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let mut parent = spawn_long_run(tmp.path(), &out);
    wait_for_workers(&mut parent, &out);
    parent.kill().unwrap();
    parent.wait().unwrap();
    assert!(within(Duration::from_secs(30), || workers_of(&out).is_empty()), "orphan workers: {:?}", workers_of(&out));
}
