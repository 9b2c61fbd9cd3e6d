//! The chaos harness's `stop_actor` fault, driver side: `sigqueue(driver, SIGUSR2, rank)` (the
//! rank as the signal's pointer value; `tessera_chaos::runner` sends it) asks
//! an elastic run's driver to stop rank `rank`'s DeviceWorker actor (an actor of the driver's
//! supervision tree, not a process). The signal handler only stores the rank; the driver's
//! monitor thread takes it ([`take`]) and stops the actor through the tree
//! ([`tessera_actors::WorkerStopper`]). The tree then reports the rank as died, and the driver
//! treats a member whose actor died like one whose process died: it fences and kills the
//! worker and recovers (`run.rs`, `Fleet::lose_ranks`).
//!
//! A plain `kill -USR2` (no value attached) names no rank and is ignored.

use std::sync::atomic::{AtomicU64, Ordering};

/// The rank asked for, plus one (0: none pending).
static PENDING: AtomicU64 = AtomicU64::new(0);

/// Installs the SIGUSR2 action (an elastic run's driver, at start; idempotent).
pub(super) fn install() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: the action reads the siginfo_t the kernel passed and does one atomic store,
        // both async-signal-safe.
        let installed = unsafe {
            signal_hook_registry::register_sigaction(libc::SIGUSR2, |info: &libc::siginfo_t| {
                if info.si_code != libc::SI_QUEUE {
                    return;
                }
                let rank = info.si_value().sival_ptr as usize as u64;
                PENDING.store(rank.saturating_add(1), Ordering::SeqCst);
            })
        };
        if let Err(e) = installed {
            tracing::warn!("the chaos fault stop_actor (SIGUSR2) is unavailable: its handler could not be installed: {e}");
        }
    });
}

/// The rank whose actor a `stop_actor` signal asked to stop since the last call, if any.
pub(super) fn take() -> Option<usize> {
    match PENDING.swap(0, Ordering::SeqCst) {
        0 => None,
        r => usize::try_from(r - 1).ok(),
    }
}
