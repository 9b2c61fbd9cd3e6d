//! What the fleet runs with, built by the front crate from its config: the elastic runtime's
//! knobs ([`ElasticRun`]), the run's identity (the resolved config and its hash, the data's
//! hash), where its files go ([`FleetSpec`]), and what it asks of its host process ([`Host`])
//! and of the network its workers live on ([`Placement`]).

use std::any::Any;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The elastic runtime (`tessera.elastic`, or DeepSpeed's `elasticity.enabled`): what a
/// multi-process run (`train --nprocs N`) does when workers die, hang, leave or join
/// ([`crate::driver`]). Off by default: the first worker lost then ends the run.
#[derive(Debug, Clone, PartialEq)]
pub struct ElasticRun {
    pub enabled: bool,
    /// How often a worker sends a heartbeat on its side connection (ms).
    pub heartbeat_ms: u64,
    /// A worker silent this long is dead (a SIGSTOPped or wedged process) (ms).
    pub heartbeat_timeout_ms: u64,
    /// Bound on one worker reply (a whole prepare or commit) (ms).
    pub step_timeout_ms: u64,
    /// Below this many live workers the run waits (up to `join_wait_ms`) for joins.
    pub min_workers: usize,
    /// Joins beyond this many members wait.
    pub max_workers: usize,
    /// Ring successors that hold an in-memory copy of each rank's committed shard (0 = restore
    /// lost shards from the newest checkpoint and replay the steps since).
    pub replicas: usize,
    /// Worker ids kept ready for processes that join after the start (one certificate each).
    pub max_joins: usize,
    /// A SIGTERMed worker hands its shard over at the next step boundary; if none comes within
    /// this bound it exits and is treated as lost (ms).
    pub drain_grace_ms: u64,
    /// How long a run below `min_workers` waits for joins before it fails (ms).
    pub join_wait_ms: u64,
    /// Every this many committed steps each replica's blake3 is compared with its owner's
    /// shard (0 = never); a mismatch drops the replica and the driver sends a full copy.
    pub replica_check_interval: u64,
    /// Re-assign the micro-batch blocks by measured speed at a step boundary when that
    /// shortens the predicted step by more than this fraction (0 = never).
    pub rebalance_threshold: f64,
}

/// `tessera.elastic.rebalance_threshold` when absent (or `true`): a 20 % shorter step.
pub const DEFAULT_REBALANCE_THRESHOLD: f64 = 0.2;

impl Default for ElasticRun {
    fn default() -> Self {
        ElasticRun {
            enabled: false,
            heartbeat_ms: 100,
            heartbeat_timeout_ms: 2_000,
            step_timeout_ms: 600_000,
            min_workers: 1,
            max_workers: 64,
            replicas: 1,
            max_joins: 8,
            drain_grace_ms: 30_000,
            join_wait_ms: 60_000,
            replica_check_interval: 50,
            rebalance_threshold: DEFAULT_REBALANCE_THRESHOLD,
        }
    }
}

impl ElasticRun {
    /// A process run without `tessera.elastic.enabled`: the same fleet, heartbeats and
    /// timeouts, with recovery off — no replicas (no memory or bandwidth spent on them), no
    /// joins, no rebalancing, no replica checks. The first loss ends the run.
    pub fn recovery_off(self) -> ElasticRun {
        ElasticRun { replicas: 0, max_joins: 0, rebalance_threshold: 0.0, replica_check_interval: 0, ..self }
    }
}

/// A fleet's run: what it checks joiners against, sends them, and where it writes.
#[derive(Debug, Clone)]
pub struct FleetSpec {
    pub run: ElasticRun,
    /// The resolved config (sent to agents and joiners, written to `<output>/procs/config.json`).
    pub config: serde_json::Value,
    /// Its hash: every worker must have resolved the same config.
    pub config_hash: String,
    /// BLAKE3 of the driver's training and validation tokens: an agent or joiner whose data
    /// differs is refused.
    pub data_blake3: String,
    /// The run's output folder (the event log; `procs/` for spawned workers).
    pub out_dir: PathBuf,
}

/// What the driver asks of the process it runs in.
pub trait Host: Send + Sync {
    /// Why the run was asked to stop (a signal), if it was: the wait for agents ends with it.
    fn stop_requested(&self) -> Option<String>;
    /// Removes `dir` should the process be forced out (a second signal) while the returned
    /// guard lives.
    fn remove_at_forced_exit(&self, dir: &Path) -> Box<dyn Any + Send + Sync>;
}

/// Where spawned workers live on the network (by default next to the driver, on loopback).
pub trait Placement: Send + Sync {
    /// The address the driver's control endpoint binds.
    fn control_ip(&self) -> IpAddr;
    /// Writes what the workers need to find their place into the run's `procs` folder.
    fn publish(&self, procs: &Path) -> anyhow::Result<()>;
    /// The command that starts `exe` as spawned worker `id` (in its place).
    fn command(&self, exe: &Path, id: usize) -> anyhow::Result<Command>;
}
