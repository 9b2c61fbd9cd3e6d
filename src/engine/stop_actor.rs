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

extern "C" fn on_usr2(_: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo_t to an SA_SIGINFO handler; reading it and one
    // atomic store are async-signal-safe.
    unsafe {
        if info.is_null() || (*info).si_code != libc::SI_QUEUE {
            return;
        }
        let rank = (*info).si_value().sival_ptr as usize as u64;
        PENDING.store(rank.saturating_add(1), Ordering::SeqCst);
    }
}

/// Installs the SIGUSR2 handler (an elastic run's driver, at start; idempotent).
pub(super) fn install() {
    // SAFETY: a zeroed sigaction with an SA_SIGINFO handler whose body is async-signal-safe.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_usr2 as *const () as libc::sighandler_t;
        sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGUSR2, &sa, std::ptr::null_mut());
    }
}

/// The rank whose actor a `stop_actor` signal asked to stop since the last call, if any.
pub(super) fn take() -> Option<usize> {
    match PENDING.swap(0, Ordering::SeqCst) {
        0 => None,
        r => usize::try_from(r - 1).ok(),
    }
}
