//! Stopping a run from outside, as schedulers and shells do: SIGTERM (Slurm, Kubernetes),
//! SIGHUP, a second signal, and standard output closing under the run (`| head -1`). Each
//! leaves a checkpoint that resumes to the uninterrupted run's bits and a summary.json that
//! says how the run ended; where the lines go (`> log` while the bar is on a terminal).

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;

/// `tessera train`'s status when a signal stopped it after a checkpoint (README, "Exit statuses").
const EXIT_INTERRUPTED: i32 = 75;

/// gpt-tiny in a few milliseconds a step, printing and checkpointing every step.
fn train_args(out: &Path, steps: u64, ranks: &[&str]) -> Vec<String> {
    let cfg = repo().join("configs/gpt-tiny.json");
    let mut a: Vec<String> =
        ["train", "--config", cfg.to_str().unwrap(), "--output", out.to_str().unwrap()].iter().map(|s| s.to_string()).collect();
    a.extend(["--steps".to_string(), steps.to_string()]);
    a.extend(ranks.iter().map(|s| s.to_string()));
    a.extend(FAST.iter().map(|s| s.to_string()));
    for set in ["tessera.checkpoint_interval=1", "steps_per_print=1", "tessera.keep_last=3"] {
        a.extend(["--set".to_string(), set.to_string()]);
    }
    a
}

/// Starts a long run (stdout and stderr into files of `dir`, so nothing blocks on a pipe).
fn start(dir: &Path, name: &str, ranks: &[&str]) -> (Child, PathBuf) {
    let out = dir.join(name);
    let log = |ext: &str| File::create(dir.join(format!("{name}.{ext}"))).unwrap();
    let child = Command::new(bin())
        .args(train_args(&out, 100_000, ranks))
        .arg("--no-progress")
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(log("out"))
        .stderr(log("err"))
        .spawn()
        .expect("spawning tessera");
    (child, out)
}

/// Waits (bounded) until the run wrote its first checkpoint: it is past start-up, in its steps.
fn wait_for_checkpoint(child: &mut Child, out: &Path) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !out.join("checkpoints/latest").exists() {
        assert!(child.try_wait().unwrap().is_none(), "the run ended before its first checkpoint");
        assert!(Instant::now() < deadline, "no checkpoint within 120 s");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn signal(child: &Child, sig: i32) {
    // SAFETY: kill(2) on a process this test started.
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, sig) }, 0, "kill({}, {sig})", child.id());
}

fn logs(dir: &Path, name: &str) -> String {
    let read = |ext: &str| std::fs::read_to_string(dir.join(format!("{name}.{ext}"))).unwrap_or_default();
    format!("--- stdout\n{}--- stderr\n{}", read("out"), read("err"))
}

/// The temporary names a save leaves while it runs (`.tmp-step_*`) under `out/checkpoints`.
fn save_temps(out: &Path) -> Vec<String> {
    std::fs::read_dir(out.join("checkpoints"))
        .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| n.starts_with(".tmp-")).collect())
        .unwrap_or_default()
}

/// Checks an interrupted run's outputs, resumes it for two more steps and compares with an
/// uninterrupted run of as many steps; returns the interrupted summary.
fn interrupted_then_resumed(dir: &Path, name: &str, status: ExitStatus, by: &str, ranks: &[&str]) -> serde_json::Value {
    let out = dir.join(name);
    let text = logs(dir, name);
    assert_eq!(status.code(), Some(EXIT_INTERRUPTED), "{by}: {status}\n{text}");
    assert!(!text.contains("panicked"), "{text}");
    let s = summary(&out);
    assert_eq!(s["status"], "interrupted", "{s:#}");
    assert_eq!(s["stopped_by"], by, "{s:#}");
    let steps = s["steps"].as_u64().unwrap();
    let last = s["last_checkpoint"].as_str().unwrap().to_string();
    assert!(last.ends_with(&format!("step_{steps:08}")), "the stop saved step {steps}: {last}");
    assert!(text.contains(&format!("interrupted ({by}): stopped after step {steps}")), "{text}");
    assert!(save_temps(&out).is_empty(), "{:?}", save_temps(&out));
    // Resume to two steps past the stop, and run as far without a stop: the same bits.
    let end = (steps + 2).to_string();
    let mut resume = train_args(&out, steps + 2, ranks);
    resume.extend(["--resume".to_string(), out.join("checkpoints").display().to_string(), "--no-progress".to_string()]);
    ok(&resume.iter().map(String::as_str).collect::<Vec<_>>(), dir);
    let resumed = summary(&out);
    assert_eq!(resumed["status"], "completed");
    let plain = dir.join(format!("{name}-plain"));
    let mut a = train_args(&plain, steps + 2, ranks);
    a.push("--no-progress".into());
    ok(&a.iter().map(String::as_str).collect::<Vec<_>>(), dir);
    assert_eq!(resumed["params_blake3"], summary(&plain)["params_blake3"], "stopped at {steps}, resumed to {end}");
    s
}

#[test]
fn sigterm_stops_thread_ranks_with_a_checkpoint_that_resumes_to_the_same_bits() {
    let tmp = tempfile::tempdir().unwrap();
    let ranks = ["--world", "2"];
    let (mut child, out) = start(tmp.path(), "term", &ranks);
    wait_for_checkpoint(&mut child, &out);
    signal(&child, libc::SIGTERM);
    let status = child.wait().unwrap();
    let s = interrupted_then_resumed(tmp.path(), "term", status, "SIGTERM", &ranks);
    // What every summary now records about the run itself.
    assert_eq!(s["version"], env!("CARGO_PKG_VERSION"));
    let head = Command::new("git").args(["rev-parse", "HEAD"]).current_dir(repo()).output().ok().filter(|o| o.status.success());
    let want = head.map_or("unknown".to_string(), |o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    assert_eq!(s["commit"], want.as_str());
    assert_eq!(s["seed"], 1234, "{s:#}");
    let (began, ended) = (s["started_at"].as_str().unwrap(), s["ended_at"].as_str().unwrap());
    for t in [began, ended] {
        assert!(t.len() == 24 && t.ends_with('Z') && t.as_bytes()[10] == b'T', "not RFC 3339 UTC: {t}");
    }
    assert!(began <= ended, "{began} .. {ended}");
    assert!(s.get("peak_rss_bytes_per_rank").is_none(), "thread ranks share the driver's process: {s:#}");
}

#[test]
fn sighup_stops_worker_processes_with_a_checkpoint_and_removes_the_keys() {
    let tmp = tempfile::tempdir().unwrap();
    let ranks = ["--nprocs", "2"];
    let (mut child, out) = start(tmp.path(), "hup", &ranks);
    wait_for_checkpoint(&mut child, &out);
    assert!(out.join("procs/pki").exists(), "the run keeps its keys in procs/pki while it runs");
    signal(&child, libc::SIGHUP);
    let status = child.wait().unwrap();
    assert!(!out.join("procs").exists(), "procs/ (the CA key) left behind\n{}", logs(tmp.path(), "hup"));
    assert!(workers_of(&out).is_empty(), "workers left behind");
    let s = interrupted_then_resumed(tmp.path(), "hup", status, "SIGHUP", &ranks);
    let rss = s["peak_rss_bytes_per_rank"].as_array().unwrap_or_else(|| panic!("no per-rank peak RSS: {s:#}"));
    assert_eq!(rss.len(), 2, "{s:#}");
    assert!(rss.iter().all(|b| b.as_u64().unwrap() > 1 << 20), "each worker process reports its own peak RSS: {rss:?}");
}

#[test]
fn sigusr1_stops_an_elastic_run_with_a_checkpoint_that_resumes_to_the_same_bits() {
    let tmp = tempfile::tempdir().unwrap();
    let ranks = ["--nprocs", "2", "--set", "tessera.elastic.enabled=true"];
    let (mut child, out) = start(tmp.path(), "usr1", &ranks);
    wait_for_checkpoint(&mut child, &out);
    signal(&child, libc::SIGUSR1);
    let status = child.wait().unwrap();
    assert!(!out.join("procs").exists(), "procs/ left behind\n{}", logs(tmp.path(), "usr1"));
    let s = interrupted_then_resumed(tmp.path(), "usr1", status, "SIGUSR1", &ranks);
    assert_eq!(s["elastic"]["workers_lost"], 0, "the workers did not take the driver's signal: {s:#}");
}

/// A run that fails after it started (here its checkpoint folder is a file, refused at the
/// first save) says so in summary.json, with the error, and exits 1.
#[test]
fn a_run_that_fails_says_so_in_its_summary() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("failed");
    std::fs::create_dir_all(&out).unwrap();
    write(&out, "checkpoints", "not a folder");
    let mut a = train_args(&out, 3, &["--world", "2"]);
    a.push("--no-progress".into());
    let output = run(&a.iter().map(String::as_str).collect::<Vec<_>>(), tmp.path());
    let text = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{text}");
    let s = summary(&out);
    assert_eq!(s["status"], "failed", "{s:#}");
    let error = s["error"].as_str().unwrap_or_default();
    assert!(error.contains("not a directory") && text.contains(error.lines().next().unwrap()), "{error}\n{text}");
    assert_eq!(s["steps"], 1, "it failed saving step 1: {s:#}");
}

/// Two signals at once (pending while the run is stopped, delivered together on SIGCONT): the
/// second exits at once with 128 + its number and says so, leaving no save in progress and no
/// keys behind; the checkpoints that were complete still load.
#[test]
fn a_second_signal_exits_at_once_with_its_own_status() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut child, out) = start(tmp.path(), "twice", &["--nprocs", "2"]);
    wait_for_checkpoint(&mut child, &out);
    signal(&child, libc::SIGSTOP);
    signal(&child, libc::SIGINT);
    signal(&child, libc::SIGTERM);
    signal(&child, libc::SIGCONT);
    let status = child.wait().unwrap();
    let text = logs(tmp.path(), "twice");
    // SIGINT (2) is delivered before SIGTERM (15): the second is SIGTERM.
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{status}\n{text}");
    assert!(text.contains("SIGTERM (after SIGINT): a second stop request; exiting at once"), "{text}");
    assert!(!out.join("procs").exists(), "procs/ (the CA key) left behind");
    assert!(save_temps(&out).is_empty(), "{:?}", save_temps(&out));
    let deadline = Instant::now() + Duration::from_secs(30);
    while !workers_of(&out).is_empty() {
        assert!(Instant::now() < deadline, "workers outlived their driver: {:?}", workers_of(&out));
        std::thread::sleep(Duration::from_millis(50));
    }
    let text = ok(&["generate", "--checkpoint", out.join("checkpoints").to_str().unwrap(), "--tokens", "2"], tmp.path());
    assert!(!text.contains("skipped checkpoint"), "{text}");
}

/// `tessera train … | head -1`: the reader goes away after the first line; the run stops after
/// its step with a checkpoint instead of panicking on the closed pipe.
#[test]
fn a_closed_stdout_stops_the_run_with_a_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("head");
    let mut child = Command::new(bin())
        .args(train_args(&out, 100_000, &["--world", "2"]))
        .arg("--no-progress")
        .current_dir(tmp.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut first).unwrap();
    assert!(first.starts_with("training gpt-tiny"), "{first}");
    // The reader is dropped: the pipe is closed.
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(EXIT_INTERRUPTED), "{status}\n{err}");
    assert!(!err.contains("panicked"), "{err}");
    let s = summary(&out);
    assert_eq!((s["status"].as_str(), s["stopped_by"].as_str()), (Some("interrupted"), Some("standard output closed")), "{s:#}");
    let steps = s["steps"].as_u64().unwrap();
    assert!(out.join(format!("checkpoints/step_{steps:08}/manifest.json")).exists(), "{s:#}");
}

/// `tessera config check … | head`: the reader is gone before the first line; no panic, status 0.
#[test]
fn config_check_into_a_closed_pipe_exits_cleanly() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = repo().join("configs/gpt-tiny.json");
    let mut child = Command::new(bin())
        .args(["config", "check", cfg.to_str().unwrap()])
        .current_dir(tmp.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}\n{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// A pseudo-terminal's two ends: a file for the child's stderr and the reader of what it drew.
fn pty() -> (File, File) {
    use std::os::fd::FromRawFd;
    // SAFETY: posix_openpt/grantpt/unlockpt/ptsname on a descriptor this function owns; the
    // name is copied before any other call.
    unsafe {
        let master = libc::posix_openpt(libc::O_RDWR | libc::O_NOCTTY);
        assert!(master >= 0 && libc::grantpt(master) == 0 && libc::unlockpt(master) == 0, "no pseudo-terminal");
        let name = std::ffi::CStr::from_ptr(libc::ptsname(master)).to_owned();
        let slave = libc::open(name.as_ptr(), libc::O_RDWR | libc::O_NOCTTY);
        assert!(slave >= 0, "opening {name:?}");
        (File::from_raw_fd(slave), File::from_raw_fd(master))
    }
}

/// `tessera train > log` from a terminal: the progress bar is drawn on the terminal (stderr),
/// and the header, the loss lines and the summary go to the file.
#[test]
fn step_lines_reach_a_redirected_stdout_while_the_bar_is_on_a_terminal() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("log");
    let (slave, mut master) = pty();
    // Drain the terminal so the bar never blocks on it (ends with EIO once the child is gone).
    let drawn = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = master.read_to_end(&mut buf);
        buf
    });
    let log = tmp.path().join("stdout.log");
    let status = Command::new(bin())
        .args(train_args(&out, 3, &["--world", "2"]))
        .current_dir(tmp.path())
        .stdin(Stdio::null())
        .stdout(File::create(&log).unwrap())
        .stderr(slave)
        .status()
        .unwrap();
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(status.success(), "{status}\n{text}");
    for want in ["training gpt-tiny", "step      1 | loss", "step      3 | loss", "params_blake3"] {
        assert!(text.contains(want), "{want:?} missing from the redirected stdout:\n{text}");
    }
    // The terminal got the bar (so the run saw one), and only the bar.
    let drawn = String::from_utf8_lossy(&drawn.join().unwrap()).into_owned();
    assert!(drawn.contains("step ") && drawn.contains("/3"), "no progress bar on the terminal: {drawn:?}");
    assert!(!drawn.contains("| loss"), "a step line went to the terminal: {drawn:?}");
}
