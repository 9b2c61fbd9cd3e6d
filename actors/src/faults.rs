//! The test-only faults the runtime lets a harness inject, as one trait the runtime calls at
//! fixed points ([`FaultHooks`]) and a handle to it ([`Faults`]).
//!
//! The runtime never decides on its own to fail: every fault a test or the chaos harness needs
//! inside a process (die inside a commit, flip a bit of a replica, hold a replica copy open,
//! fail a swap-file write, stop a rank's actor) is a call on the hooks it was given. The
//! default hooks ([`NoFaults`]) do nothing, so a run started by a person behaves the same
//! whatever signals or variables reach it; `tessera_chaos::hooks` supplies the real ones, which
//! `tessera`'s `main` builds only when `TESSERA_TEST_FAULTS` asks for them (docs/ENV.md).
//!
//! # Architecture invariant
//! Hooks only add faults: with [`NoFaults`] every call is a no-op, and no hook changes a
//! result the run would otherwise commit (a fault is a loss, a failed write or a corrupted
//! replica, which the runtime must then detect and recover from like a real one).

use std::fmt::Debug;
use std::sync::Arc;

/// Where the runtime lets a harness inject a fault. Every method has a no-op default.
pub trait FaultHooks: Send + Sync + Debug {
    /// An elastic worker process starts (before its first message): hooks that arm on a
    /// signal install its action here. Returns the signals they took; the worker gives the
    /// others their normal meaning (SIGTERM and SIGUSR1: drain at the next step boundary).
    fn install_worker_signals(&self) -> Vec<i32> {
        Vec::new()
    }

    /// Elastic worker `worker` got the driver's `Commit` of `step`, before its optimizer step
    /// (every rank has prepared the step): a hook may end the process here.
    fn before_commit(&self, _worker: u64, _step: u64) {}

    /// An elastic worker applied step `step`'s update to its replica of rank `owner`'s shard
    /// (the first replica a commit updates): a hook may change `master`. Returns what it did,
    /// for the worker's log.
    fn after_replica_update(&self, _owner: usize, _step: u64, _master: &mut [f32]) -> Option<String> {
        None
    }

    /// Elastic worker `worker` is about to send epoch `epoch`'s first full replica copy (an
    /// epoch after the first, before it is installed): a hook may hold it here.
    fn before_first_copy(&self, _worker: u64, _epoch: u64) {}

    /// Whether the write-back of optimizer step `step` (1-based) to the swap files fails as a
    /// disk error would.
    fn offload_write_fails(&self, _step: u64) -> bool {
        false
    }

    /// An elastic run's driver starts: hooks that take a signal install its action here.
    fn install_driver_signals(&self) {}

    /// The rank whose DeviceWorker actor the harness asked the driver to stop since the last
    /// call, if any (polled by the driver's monitor thread).
    fn take_stop_actor(&self) -> Option<usize> {
        None
    }
}

/// The hooks of a run that injects nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoFaults;

impl FaultHooks for NoFaults {}

/// A shared handle to a process's hooks, handed to the code that calls them ([`NoFaults`] by
/// default).
#[derive(Clone, Debug)]
pub struct Faults(Arc<dyn FaultHooks>);

impl Faults {
    pub fn new(hooks: Arc<dyn FaultHooks>) -> Self {
        Faults(hooks)
    }
}

impl Default for Faults {
    fn default() -> Self {
        Faults(Arc::new(NoFaults))
    }
}

impl std::ops::Deref for Faults {
    type Target = dyn FaultHooks;
    fn deref(&self) -> &Self::Target {
        &*self.0
    }
}
