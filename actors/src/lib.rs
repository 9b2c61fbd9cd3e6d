//! tessera-actors: the supervisor tree and its actors; planners are pure code.
//!
//! ```text
//! ClusterSupervisor        membership, plan epoch, step transactions (prepare → commit | abandon)
//! └─ NodeSupervisor        one per host/process; reports worker deaths as membership events
//!    └─ DeviceWorker       one per rank; runs its WorkerCompute on a dedicated OS thread
//!       ├─ ParamShard      ZeRO-3 parameter shard metadata (range, bytes, last commit)
//!       └─ OptimShard      optimizer-state shard metadata
//! ```
//! Control plane: actor messages carrying handles and small values; a rank in a worker process
//! is a DeviceWorker here whose [`WorkerCompute`] the engine implements over its control
//! connection. Data plane: the compute's buffers and collectives (`tessera_transport`).
//! [`Cluster`] is the synchronous driver.
//!
//! Elastic training (docs/ELASTIC.md): [`replan`] is the re-planning after membership changes.
//! [`recovery`] holds the process driver's recovery decisions (the step and sources of a new
//! epoch's state, its members) as pure functions, simulated by `recovery_sim`; [`stepper`] is its
//! step/commit/recover loop as a sans-IO state machine, simulated by `stepper_sim`. [`txn`] is the
//! ClusterSupervisor's step transaction (prepare → commit | abandon) as a sans-IO state machine,
//! simulated by `txn_sim`; `loop_sim` simulates the two machines together. [`liveness`] is the
//! driver's failure detection (process exits, closed side connections, heartbeat timeouts,
//! leaving and fenced workers) as a sans-IO state machine, simulated by `liveness_sim`.
//! `worker_cmd` is the DeviceWorker's handling of commands as a sans-IO machine, simulated
//! under a real step transaction by `worker_sim`.
//! [`faults`] is the test-only fault injection the runtime calls (a no-op by default).
//! [`formation`] is the timing of joins and drains (the driver's wait for a new epoch's members,
//! a worker's drain timer) as sans-IO machines, simulated by `formation_sim`.
//! `membership` (tests only) is a sans-IO coordinator of the whole elastic protocol (plan
//! epochs, step commits, checkpoints, joins, drains) that no driver runs, simulated by `sim`:
//! the process driver runs the machines above instead; the two are kept as a model of the
//! protocol the driver's pieces are converging on, outside the library's build.

pub mod cluster;
pub mod compute;
pub mod driver;
pub mod error;
pub mod faults;
pub mod formation;
pub mod liveness;
pub mod node;
pub mod plan;
pub mod recovery;
pub mod replan;
pub mod shard;
pub mod stepper;
pub mod txn;
pub mod worker;
pub(crate) mod worker_cmd;

#[cfg(test)]
mod formation_sim;
#[cfg(test)]
mod liveness_sim;
#[cfg(test)]
mod loop_sim;
#[cfg(test)]
mod membership;
#[cfg(test)]
mod recovery_sim;
#[cfg(test)]
mod sim;
/// The seeded simulations' shared test scaffolding (many seeds, replay, determinism); also
/// used by the `tessera` crate's `restore_sim`.
#[doc(hidden)]
pub mod sim_support;
#[cfg(test)]
mod stepper_sim;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod txn_sim;
#[cfg(test)]
mod worker_sim;

pub use compute::{
    ComputeError, MemoryReport, MoeBlockTally, MoeTally, PhaseTimes, Prepared, ShardInfo, ShardSpec, StepOrder, StepResult, WorkerCompute,
};
pub use driver::{Cluster, ClusterOptions, WorkerStopper, DEFAULT_SHUTDOWN_TIMEOUT_MS, DEFAULT_STEP_TIMEOUT_MS};
pub use error::{ActorError, FailureCause, RankFailure};
pub use plan::{assign_blocks, partition};
pub use replan::{
    blocks_for_speeds, check_blocks, leaf_counts_for_speeds, leaf_counts_with_floor, propose_rebalance, replan_partition, OldShard,
    Rebalance, Replanned, Speeds, Transfer,
};
pub use shard::{ShardKind, ShardStatus};
