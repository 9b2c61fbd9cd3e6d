//! Helpers: run the real `tessera` binary in a temporary directory.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_tessera"))
}

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn run(args: &[&str], cwd: &Path) -> Output {
    let out = Command::new(bin()).args(args).current_dir(cwd).output().expect("spawning tessera");
    out
}

pub fn ok(args: &[&str], cwd: &Path) -> String {
    let out = run(args, cwd);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "tessera {args:?} failed:\n{text}");
    text
}

pub fn fails(args: &[&str], cwd: &Path) -> String {
    let out = run(args, cwd);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!out.status.success(), "tessera {args:?} should have failed:\n{text}");
    text
}

pub fn summary(dir: &Path) -> serde_json::Value {
    let p = dir.join("summary.json");
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()));
    serde_json::from_str(&text).expect("summary.json is JSON")
}

/// Flags for a seconds-long run of gpt-tiny: short sequences, a small batch.
pub const FAST: &[&str] = &[
    "--set",
    "train_batch_size=8",
    "--set",
    "train_micro_batch_size_per_gpu=2",
    "--set",
    "tessera.seq_len=32",
    "--set",
    "tessera.eval_iters=2",
    "--set",
    "tessera.eval_interval=0",
];

/// `args` as the `&str`s [`run`], [`ok`] and [`fails`] take.
/// The values of `tag` in a run's metrics.jsonl, in step order.
pub fn metric(out: &Path, tag: &str) -> Vec<f64> {
    let log = std::fs::read_to_string(out.join("metrics.jsonl")).expect("metrics.jsonl");
    log.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["tag"] == tag)
        .map(|v| v["value"].as_f64().unwrap_or(f64::NAN))
        .collect()
}

pub fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

pub fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).expect("writing test file");
    p
}

/// Pids of live `tessera worker` processes started for output directory `out`.
pub fn workers_of(out: &Path) -> Vec<u32> {
    let needle = out.join("procs").display().to_string();
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(|e| {
            let pid: u32 = e.ok()?.file_name().to_str()?.parse().ok()?;
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let args: Vec<&[u8]> = cmd.split(|b| *b == 0).collect();
            let is_worker = args.get(1) == Some(&&b"worker"[..]) && args.contains(&needle.as_bytes());
            (is_worker && !zombie(pid)).then_some(pid)
        })
        .collect()
}

/// Whether process `pid` has exited but not been reaped (state Z, after the `)` of its
/// `/proc/PID/stat`; a zombie's cmdline is empty, a reaped process is gone).
pub fn zombie(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
}
