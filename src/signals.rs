//! How a run is asked to stop: SIGTERM (Slurm and Kubernetes preemption), SIGINT (Ctrl-C),
//! SIGHUP (the terminal went away) and SIGUSR1 (Slurm's `--signal`), and standard output
//! closing under the run (`tessera train … | head -1`).
//!
//! The first of them only records why ([`requested`]); the driver polls it between steps,
//! finishes or abandons the step it is in, saves a checkpoint, writes `summary.json` with
//! `"status": "interrupted"` and exits with [`EXIT_INTERRUPTED`]. A second signal while that
//! runs exits at once with `128 + signal` (the status a shell reports for a process the signal
//! killed): it says so on standard error, removes what this process registered
//! ([`on_forced_exit`]: its in-progress checkpoint's temporary folder, `procs/` with the run's
//! keys). A checkpoint is renamed into place only complete, so the forced exit never leaves a half one under a `step_*` name.
//!
//! Signals are received on one thread of their own through `signal-hook`'s self-pipe (the
//! handler itself only writes to the pipe), so everything the thread does may allocate, lock
//! and print.
//!
//! Exit statuses: 0 completed, 1 failed, [`EXIT_INTERRUPTED`] stopped early with a checkpoint
//! (resume with `--resume`), `128 + N` a second signal N (nothing more saved). Elastic worker
//! processes take SIGTERM and SIGUSR1 as their own stop request: a drain at the next step
//! boundary (`engine::elastic_worker`; only a test's fault hooks, `TESSERA_TEST_FAULTS`, make
//! SIGUSR1 arm `kill_in_commit` instead); spawned workers run in their own process groups, so a
//! terminal's Ctrl-C reaches the driver only.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use anyhow::{Context, Result};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM, SIGUSR1};
use signal_hook::iterator::Signals;
pub use tessera_fleet::worker::signal_name;

/// Exit status of a run stopped early whose last checkpoint holds its state: "try again later"
/// (sysexits' `EX_TEMPFAIL`), non-zero so that Slurm and Kubernetes restart it, distinct from a
/// failure (1) and from a second signal's `128 + N`.
pub const EXIT_INTERRUPTED: u8 = 75;

/// The signals that ask a run to stop.
pub const STOP_SIGNALS: [i32; 4] = [SIGTERM, SIGINT, SIGHUP, SIGUSR1];

/// `requested`'s value for standard output closed (not a signal number).
const STDOUT_CLOSED: i32 = -1;

/// Why a run stops early.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    Signal(i32),
    /// Writing a line to standard output failed: the reader went away (`| head`).
    StdoutClosed,
}

impl std::fmt::Display for StopReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StopReason::Signal(s) => f.write_str(signal_name(*s)),
            StopReason::StdoutClosed => f.write_str("standard output closed"),
        }
    }
}

/// What a forced exit undoes.
#[derive(Clone, Debug)]
pub enum Cleanup {
    /// Remove this folder and everything in it (`procs/`: the run's config, CA and keys).
    Dir(PathBuf),
    /// Remove this process's in-progress save folders (`.tmp-step_*-<pid>`) in a checkpoint
    /// root.
    SaveTemps(PathBuf),
}

/// Unregisters its [`Cleanup`] when dropped (the thing it undoes is gone, or was handed on).
#[must_use = "dropping the guard unregisters the clean-up at once"]
pub struct CleanupGuard(u64);

impl Drop for CleanupGuard {
    fn drop(&mut self) {
        registry().retain(|(id, _)| *id != self.0);
    }
}

/// 0: no stop asked; else a signal number, or [`STDOUT_CLOSED`].
static REQUESTED: AtomicI32 = AtomicI32::new(0);
static NEXT_ID: AtomicU64 = AtomicU64::new(0);
static CLEANUPS: Mutex<Vec<(u64, Cleanup)>> = Mutex::new(Vec::new());
static INSTALLED: OnceLock<Result<(), String>> = OnceLock::new();

fn registry() -> std::sync::MutexGuard<'static, Vec<(u64, Cleanup)>> {
    CLEANUPS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Registers `c` until the guard is dropped.
pub fn on_forced_exit(c: Cleanup) -> CleanupGuard {
    let id = NEXT_ID.fetch_add(1, Ordering::SeqCst);
    registry().push((id, c));
    CleanupGuard(id)
}

/// Starts the signal thread once per process (later calls do nothing). From then on the stop
/// signals no longer end the process by themselves.
pub fn install() -> Result<()> {
    INSTALLED
        .get_or_init(|| {
            let signals = Signals::new(STOP_SIGNALS).map_err(|e| e.to_string())?;
            std::thread::Builder::new().name("tessera-signals".into()).spawn(move || watch(signals)).map(drop).map_err(|e| e.to_string())
        })
        .clone()
        .map_err(anyhow::Error::msg)
        .context("installing the handlers of SIGTERM, SIGINT, SIGHUP and SIGUSR1")
}

/// Whether [`install`] succeeded in this process (a run that can stop on request).
pub fn installed() -> bool {
    matches!(INSTALLED.get(), Some(Ok(())))
}

/// Why the run was asked to stop, if it was.
pub fn requested() -> Option<StopReason> {
    match REQUESTED.load(Ordering::SeqCst) {
        0 => None,
        STDOUT_CLOSED => Some(StopReason::StdoutClosed),
        s => Some(StopReason::Signal(s)),
    }
}

/// Asks the run to stop (the first reason is kept); returns whether this was the first.
pub fn request(reason: StopReason) -> bool {
    let code = match reason {
        StopReason::Signal(s) => s,
        StopReason::StdoutClosed => STDOUT_CLOSED,
    };
    REQUESTED.compare_exchange(0, code, Ordering::SeqCst, Ordering::SeqCst).is_ok()
}

/// The signal thread: the first signal asks to stop, a second one exits.
fn watch(mut signals: Signals) {
    for sig in signals.forever() {
        let first = request(StopReason::Signal(sig));
        if first {
            tracing::warn!(
                "{}: stopping after the current step and saving a checkpoint (a second signal exits at once without saving)",
                signal_name(sig)
            );
            continue;
        }
        forced_exit(sig);
    }
}

/// A second signal: undoes what was registered and exits with `128 + sig`, at once.
fn forced_exit(sig: i32) -> ! {
    let what = match requested() {
        Some(StopReason::Signal(s)) => format!(" (after {})", signal_name(s)),
        Some(StopReason::StdoutClosed) => " (after standard output closed)".to_string(),
        None => String::new(),
    };
    let msg = format!(
        "error: {}{what}: a second stop request; exiting at once and abandoning the checkpoint in progress (the last complete \
         one stays; exit status {})\n",
        signal_name(sig),
        128 + sig
    );
    // Straight to the descriptor: not through a lock another thread may hold.
    // SAFETY: write(2) of a valid buffer to fd 2.
    unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
    let cleanups: Vec<Cleanup> = registry().iter().map(|(_, c)| c.clone()).collect();
    for c in &cleanups {
        match c {
            Cleanup::Dir(d) => {
                let _ = std::fs::remove_dir_all(d);
            }
            Cleanup::SaveTemps(root) => remove_save_temps(root),
        }
    }
    // SAFETY: _exit(2) ends the process without running destructors or atexit handlers, which
    // may wait on the threads this exit abandons.
    unsafe { libc::_exit(128 + sig) }
}

/// Removes this process's in-progress save folders under `root` (best effort: a save that
/// races it is renamed into place complete, or removed by the next save).
fn remove_save_temps(root: &Path) {
    let suffix = format!("-{}", std::process::id());
    let Ok(entries) = std::fs::read_dir(root) else { return };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let ours = name.ends_with(&suffix) || name.ends_with(&format!("{suffix}-pruned"));
        if name.starts_with(crate::checkpoint::TMP_PREFIX) && ours {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_read_as_kill_spells_them() {
        assert_eq!(signal_name(SIGTERM), "SIGTERM");
        assert_eq!(StopReason::Signal(SIGHUP).to_string(), "SIGHUP");
        assert_eq!(StopReason::StdoutClosed.to_string(), "standard output closed");
    }

    #[test]
    fn a_dropped_guard_unregisters_its_clean_up() {
        let guard = on_forced_exit(Cleanup::Dir(PathBuf::from("/nonexistent/tessera-test")));
        let has = || registry().iter().any(|(_, c)| matches!(c, Cleanup::Dir(d) if d.ends_with("tessera-test")));
        assert!(has());
        drop(guard);
        assert!(!has());
    }
}
