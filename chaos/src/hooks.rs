//! The real fault hooks ([`ChaosHooks`], `tessera_actors::faults::FaultHooks`) and the one
//! test-only variable that turns them on, `TESSERA_TEST_FAULTS` ([`FaultSpec`]).
//!
//! A process gets these hooks only when its `main` read a `TESSERA_TEST_FAULTS` that names
//! faults; otherwise it runs with the runtime's no-op hooks, and SIGUSR1 and SIGUSR2 keep their
//! ordinary meanings. The harness ([`crate::runner`]) sets the variable on the processes it
//! starts, for the faults its scenario uses; a test may set it for a knob the scenario format
//! has no fault for (a replica corrupted, a copy held open, a swap write failed).
//!
//! The value is a comma list of:
//! - `kill_in_commit`: an elastic worker's SIGUSR1 arms it to SIGKILL itself when the driver's
//!   next `Commit` arrives (after every rank answered `Prepared`, before its own optimizer
//!   step: a loss inside the commit window, which a signal from outside cannot aim at);
//! - `stop_actor`: the driver's SIGUSR2 sent with `sigqueue` and a rank as its value stops that
//!   rank's DeviceWorker actor in the driver's supervision tree (the process lives on);
//! - `corrupt_replica_at_step=N`: a worker flips one bit of the first replica it updates with
//!   step N (the digest check must catch it);
//! - `replicate_delay_ms=MS`: a worker waits MS before an epoch's first full replica copy
//!   (epochs after the first), so a test can kill a member while the copy is under way;
//! - `offload_fail_write_at_step=N`: the write-back of optimizer step N's (1-based) second
//!   sub-group (the first when there is one) to the swap files fails as a disk error would.

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tessera_actors::faults::{FaultHooks, Faults};

/// The variable that turns the hooks on (the only one the harness's faults read).
pub const FAULTS_ENV: &str = "TESSERA_TEST_FAULTS";

/// Which faults a process's hooks inject (parsed from [`FAULTS_ENV`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FaultSpec {
    pub kill_in_commit: bool,
    pub stop_actor: bool,
    pub corrupt_replica_at_step: Option<u64>,
    pub replicate_delay_ms: Option<u64>,
    pub offload_fail_write_at_step: Option<u64>,
}

/// What [`FaultSpec::parse`] accepts, for its error.
const EXPECTED: &str = "a comma list of kill_in_commit, stop_actor, corrupt_replica_at_step=N, replicate_delay_ms=MS, \
                        offload_fail_write_at_step=N";

impl FaultSpec {
    /// Parses a value of [`FAULTS_ENV`]; the error says what was expected.
    pub fn parse(text: &str) -> Result<FaultSpec, String> {
        let mut s = FaultSpec::default();
        for item in text.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (name, value) = match item.split_once('=') {
                Some((n, v)) => (n.trim(), Some(v.trim())),
                None => (item, None),
            };
            let number = |what: &str| -> Result<Option<u64>, String> {
                match value.map(str::parse::<u64>) {
                    Some(Ok(n)) => Ok(Some(n)),
                    _ => Err(format!("`{item}`: {name} takes {what} (`{name}=N`)")),
                }
            };
            match (name, value) {
                ("kill_in_commit", None) => s.kill_in_commit = true,
                ("stop_actor", None) => s.stop_actor = true,
                ("corrupt_replica_at_step", _) => s.corrupt_replica_at_step = number("a step")?,
                ("replicate_delay_ms", _) => s.replicate_delay_ms = number("milliseconds")?,
                ("offload_fail_write_at_step", _) => s.offload_fail_write_at_step = number("a step")?,
                _ => return Err(format!("unknown fault `{item}` (expected {EXPECTED})")),
            }
        }
        Ok(s)
    }

    /// Whether it names no fault (the process then runs with the no-op hooks).
    pub fn is_empty(&self) -> bool {
        *self == FaultSpec::default()
    }

    /// The hooks a process runs with: [`ChaosHooks`] when this names a fault, else the
    /// runtime's no-op ones.
    pub fn hooks(&self) -> Faults {
        match self.is_empty() {
            true => Faults::default(),
            false => Faults::new(Arc::new(ChaosHooks::new(self.clone()))),
        }
    }
}

/// The canonical value of [`FAULTS_ENV`] ([`FaultSpec::parse`] reads it back).
impl fmt::Display for FaultSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut items: Vec<String> = Vec::new();
        if self.kill_in_commit {
            items.push("kill_in_commit".into());
        }
        if self.stop_actor {
            items.push("stop_actor".into());
        }
        let numbers = [
            ("corrupt_replica_at_step", self.corrupt_replica_at_step),
            ("replicate_delay_ms", self.replicate_delay_ms),
            ("offload_fail_write_at_step", self.offload_fail_write_at_step),
        ];
        items.extend(numbers.iter().filter_map(|(n, v)| v.map(|v| format!("{n}={v}"))));
        f.write_str(&items.join(","))
    }
}

/// Set by the SIGUSR1 action of a worker whose hooks inject `kill_in_commit`.
static KILL_IN_COMMIT: AtomicBool = AtomicBool::new(false);
/// The rank a `stop_actor` SIGUSR2 named, plus one (0: none pending).
static STOP_ACTOR: AtomicU64 = AtomicU64::new(0);

/// The hooks that inject what a [`FaultSpec`] names.
#[derive(Debug)]
pub struct ChaosHooks {
    spec: FaultSpec,
}

impl ChaosHooks {
    pub fn new(spec: FaultSpec) -> Self {
        ChaosHooks { spec }
    }
}

/// One line on standard error in a single write (workers share their parent's stderr).
fn say(line: String) {
    let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), format!("{line}\n").as_bytes());
}

impl FaultHooks for ChaosHooks {
    fn install_worker_signals(&self) -> Vec<i32> {
        if !self.spec.kill_in_commit {
            return Vec::new();
        }
        // SAFETY: the action only stores to an atomic, which is async-signal-safe.
        match unsafe { signal_hook_registry::register(libc::SIGUSR1, || KILL_IN_COMMIT.store(true, Ordering::SeqCst)) } {
            Ok(_) => vec![libc::SIGUSR1],
            Err(e) => {
                say(format!("{FAULTS_ENV}: kill_in_commit is unavailable: the SIGUSR1 handler could not be installed: {e}"));
                Vec::new()
            }
        }
    }

    fn before_commit(&self, worker: u64, step: u64) {
        if KILL_IN_COMMIT.load(Ordering::SeqCst) {
            say(format!("elastic worker {worker}: armed by SIGUSR1 (kill_in_commit): SIGKILL on the commit of step {step}"));
            // SAFETY: raise(3) with SIGKILL on this process: the fault itself.
            unsafe {
                libc::raise(libc::SIGKILL);
            }
        }
    }

    fn after_replica_update(&self, owner: usize, step: u64, master: &mut [f32]) -> Option<String> {
        if self.spec.corrupt_replica_at_step != Some(step) {
            return None;
        }
        let x = master.first_mut()?;
        *x = f32::from_bits(x.to_bits() ^ 1);
        Some(format!("corrupt_replica_at_step: flipped a bit of rank {owner}'s replica after step {step}"))
    }

    fn before_first_copy(&self, worker: u64, epoch: u64) {
        if let Some(ms) = self.spec.replicate_delay_ms {
            say(format!("elastic worker {worker}: replicate_delay_ms: waiting {ms} ms before epoch {epoch}'s first full copy"));
            std::thread::sleep(Duration::from_millis(ms));
        }
    }

    fn offload_write_fails(&self, step: u64) -> bool {
        self.spec.offload_fail_write_at_step == Some(step)
    }

    fn install_driver_signals(&self) {
        if !self.spec.stop_actor {
            return;
        }
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            // SAFETY: the action reads the siginfo_t the kernel passed and does one atomic
            // store, both async-signal-safe. A plain `kill -USR2` (no value) names no rank.
            let installed = unsafe {
                signal_hook_registry::register_sigaction(libc::SIGUSR2, |info: &libc::siginfo_t| {
                    if info.si_code != libc::SI_QUEUE {
                        return;
                    }
                    let rank = info.si_value().sival_ptr as usize as u64;
                    STOP_ACTOR.store(rank.saturating_add(1), Ordering::SeqCst);
                })
            };
            if let Err(e) = installed {
                say(format!("{FAULTS_ENV}: stop_actor is unavailable: the SIGUSR2 handler could not be installed: {e}"));
            }
        });
    }

    fn take_stop_actor(&self) -> Option<usize> {
        match STOP_ACTOR.swap(0, Ordering::SeqCst) {
            0 => None,
            r => usize::try_from(r - 1).ok(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spec_reads_back_from_its_canonical_value() {
        let s = FaultSpec::parse(" stop_actor, kill_in_commit,corrupt_replica_at_step=2 ,replicate_delay_ms=1500").unwrap();
        assert!(s.kill_in_commit && s.stop_actor);
        assert_eq!((s.corrupt_replica_at_step, s.replicate_delay_ms, s.offload_fail_write_at_step), (Some(2), Some(1500), None));
        assert_eq!(s.to_string(), "kill_in_commit,stop_actor,corrupt_replica_at_step=2,replicate_delay_ms=1500");
        assert_eq!(FaultSpec::parse(&s.to_string()).unwrap(), s);
        assert!(FaultSpec::parse("").unwrap().is_empty());
    }

    #[test]
    fn a_bad_spec_is_refused_naming_the_item() {
        let e = FaultSpec::parse("kill_in_comit").unwrap_err();
        assert!(e.contains("unknown fault `kill_in_comit`") && e.contains("stop_actor"), "{e}");
        let e = FaultSpec::parse("replicate_delay_ms=soon").unwrap_err();
        assert_eq!(e, "`replicate_delay_ms=soon`: replicate_delay_ms takes milliseconds (`replicate_delay_ms=N`)");
        assert!(FaultSpec::parse("offload_fail_write_at_step").unwrap_err().contains("takes a step"));
        assert!(FaultSpec::parse("stop_actor=1").unwrap_err().contains("unknown fault"));
    }

    #[test]
    fn hooks_fire_only_at_what_the_spec_names() {
        let h = ChaosHooks::new(FaultSpec::parse("corrupt_replica_at_step=3,offload_fail_write_at_step=2").unwrap());
        let mut m = [1.0f32, 2.0];
        assert!(h.after_replica_update(1, 2, &mut m).is_none());
        assert_eq!(m, [1.0, 2.0]);
        assert!(h.after_replica_update(1, 3, &mut m).is_some());
        assert_ne!(m[0], 1.0);
        assert!(!h.offload_write_fails(1) && h.offload_write_fails(2));
        assert!(h.install_worker_signals().is_empty(), "no kill_in_commit: SIGUSR1 is not taken");
    }
}
