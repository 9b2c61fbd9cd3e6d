//! The fleet: every run of worker processes (`train --nprocs N`, `tessera coordinator`,
//! `tessera launch`, `tessera train` under torchrun or srun). With `tessera.elastic.enabled` (or
//! DeepSpeed's `elasticity.enabled`) workers may die, hang, leave (SIGTERM) or join while the job
//! keeps running, and the result is the bits of the fault-free run. Without it the same fleet
//! runs with recovery off ([`crate::spec::ElasticRun::recovery_off`]: no replicas, no joins, no
//! rebalancing): the same failure detector declares the first loss, and the driver (the front
//! crate's `run.rs`) ends the run with it ([`Fleet::first_loss`]). The worker side is the front
//! crate's `engine::elastic_worker`, who may connect is [`crate::join`], how the first workers
//! arrive is [`crate::rendezvous`]. What the fleet runs with is a [`crate::spec::FleetSpec`]; the
//! plan is the front crate's, seen through [`crate::state::FleetPlan`] and re-made through
//! [`crate::state::Planner`].
//!
//! # Membership
//! Each worker process has an id (`node-<id>` in the run's PKI; the first N are the initial
//! ranks, at most `tessera.elastic.max_joins` more are given to processes that join later, each
//! with a certificate for its own key). A plan **epoch** fixes the members in rank order; a new
//! epoch is formed only at a step boundary. Every worker talks to the driver over a QUIC control
//! connection (mutual TLS) and keeps a second one, its side connection: heartbeats every
//! `heartbeat_ms`, `Draining` after SIGTERM, and the driver's `Abort`.
//!
//! # Detection (the monitor thread, every [`MONITOR_POLL_MS`])
//! A worker is lost when its process exits (spawned workers, and processes of this host watched
//! through a pidfd), its side connection closes, it sends no heartbeat for `heartbeat_timeout_ms` (a SIGSTOPped or wedged process), or
//! it does not answer a request within `step_timeout_ms`. The monitor's rules (all but the
//! request timeouts, which the requesting thread measures) are the sans-IO machine
//! [`tessera_actors::liveness`], checked by its seeded simulation (`liveness_sim`): each poll
//! feeds it what the children, pidfds and side connections show and declares lost whom it
//! answers. A lost worker is fenced (its id is
//! never readmitted), killed (SIGKILL: a stopped process cannot come back as a zombie member),
//! and every other member's QUIC group of the current epoch is aborted, so collectives waiting
//! on it fail at once and the step is abandoned.
//!
//! # Recovery ([`Fleet::reconfigure`], at the step boundary `t` = steps committed)
//! The decisions below (which step, which holder of each shard, which members) are the pure
//! functions of [`tessera_actors::recovery`] (`candidate_steps`, `choose_source`,
//! `next_members`), checked by its seeded simulation; this driver gathers what they need and
//! carries out their answers. The loop around them in `run.rs` (which step runs next, the
//! candidate steps of a recovery, the replay of committed steps after a restore from an older
//! state, a failure in the middle of a replay, when a step whose commit failed counts as
//! committed, and the counts `commits_completed`, `steps_rerun`, `steps_replayed`) is the
//! sans-IO state machine [`tessera_actors::stepper`], checked by its own seeded simulation
//! (`stepper_sim`); `Run::elastic_run_step` and `Run::recover` carry out its actions.
//! 1. Every surviving member reports its `Status`: the committed steps its state holds and the
//!    replicas it keeps (after applying every update it received). Each rank's shard (fp32
//!    masters and optimizer buffers of its range) is held by its `replicas` ring successors: a
//!    full copy when the epoch formed (`Replicate`), then kept in step by the owner's gradient
//!    and step record (the front crate's `engine::replica`), so a lost rank's shard at `t` is
//!    normally held by a survivor. A member that dropped a replica (an update failed or its digest differed from
//!    the owner's) says so in its snapshot and the driver sends full copies after that commit.
//! 2. The state is read in the layout of the **installed** epoch (the newest one whose every
//!    member got its first full replica copy): if every one of its ranges is held at `t` by a
//!    survivor — the owner itself, a replica, or a copy a worker kept of the installed epoch
//!    while a newer one formed — the full state at `t` is gathered from them (no step is
//!    recomputed). After a commit that failed on a lost member (every rank had prepared),
//!    `t + 1` is tried first: the survivors that took the step and the lost owners' replicas
//!    (their updates arrived before `Prepared`) hold it, and the step then counts as
//!    committed. A LAMB commit fails in its norm all-reduce before the shard changes, so the
//!    state at `t` is normally whole and step `t` runs again. Otherwise (adjacent ranks lost together, a
//!    member lost in the middle of LAMB's norm all-reduce, `replicas = 0`)
//!    the newest valid checkpoint at or before `t` is loaded (damaged ones are skipped; step 0
//!    is the seeded start) and the driver replays the steps after it: determinism makes them
//!    reproduce the committed bits, so no committed step is lost.
//! 3. The members of the new epoch are the survivors (minus workers that asked to drain) in their
//!    old order, then admitted joiners, at least `min_workers` (waiting up to `join_wait_ms` for
//!    joins) and at most `max_workers`. The plan for the new world is the ordinary plan
//!    ([`crate::state::Planner::plan`]: balanced `partition`, blocks over the same M
//!    micro-batches): the state moves through the driver as a start state anyway, so
//!    minimal-movement re-planning
//!    (`tessera_actors::replan`) would save nothing on this path.
//! 4. Each member gets `Epoch` (it leaves the old group and binds a fresh QUIC socket), the new
//!    addresses and node names, and its cut of the state; it joins the new mesh and says
//!    `Ready`. The new epoch's replicas get a full copy at once, which installs it (so it is
//!    protected before its first step); the workers then drop what they kept of the epoch
//!    before (`Installed`), and draining workers are told to leave (they exit with status 0).
//!
//! A loss during any of this starts the recovery again from the installed epoch. Events
//! (losses, drains, joins, epochs, committed steps) go to `<output>/elastic_events.jsonl`, with
//! wall-clock milliseconds, for `tessera chaos` and for people.
//!
//! # Files
//! - `shared.rs`: what the driver's threads share ([`Shared`]: ids, membership, losses and
//!   fencing, the event log), a worker's signs of life ([`Beat`]), joiners ([`Joiner`]).
//! - `monitor.rs`: detection, the monitor thread, how a spawned worker's exit reads, losses the
//!   actor tree reports, the first loss of a run without recovery.
//! - `launch.rs`: the first epoch ([`Fleet::launch`], [`Origin`]): `<output>/procs`, spawned
//!   workers or the agents' rendezvous, their start state, the acceptor and monitor threads.
//! - `proxy.rs`: requests to members (one bounded reply each; a failure is a loss), exported
//!   state, and `ElasticCompute`, the driver's proxy of a member's compute.
//! - `rebalance.rs`: micro-batch blocks re-assigned by measured speed ([`Fleet::rebalance`]).
//! - `replicate.rs`: full copies of the replicas and the members that need one.
//! - `recover.rs`: recovery ([`Fleet::pending`], [`Fleet::reconfigure`]): survivors, the state,
//!   the new members.
//! - `epoch.rs`: forming an epoch (ranks, addresses, state, the mesh) and installing it.
//! - `events.rs`: the fleet's entries in the event log.
//! - `close.rs`: how the fleet ends ([`Fleet::close`], and its `Drop`).

mod close;
mod epoch;
mod events;
mod launch;
mod monitor;
mod proxy;
mod rebalance;
mod recover;
mod replicate;
mod shared;

use std::any::Any;
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{SystemTime, UNIX_EPOCH};

use tessera_actors::replan::{Rebalancer, Speeds};
use tessera_transport::quic::ControlEndpoint;

use crate::relock;
use crate::spec::FleetSpec;
use crate::state::FleetPlan;
use epoch::Installed;
pub use launch::Origin;
use proxy::Member;
pub use rebalance::Rebalanced;
pub use recover::{Reconfigured, Restore};
pub(super) use shared::{Beat, Joiner, Shared};

/// The driver's event log, under the output directory.
pub const EVENTS_FILE: &str = "elastic_events.jsonl";
/// The run's join token in `<output>/procs` (mode 0600), for `tessera worker --join`.
pub const JOIN_TOKEN_FILE: &str = "join_token";
/// How often the monitor looks at the workers (ms).
const MONITOR_POLL_MS: u64 = 10;

/// Wall-clock milliseconds since the Unix epoch (the event log's clock).
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Whether `TESSERA_ELASTIC_TRACE` asks for a trace of the driver's requests on stderr.
pub fn tracing() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("TESSERA_ELASTIC_TRACE").is_some())
}

/// The elastic ranks of a run.
pub struct Fleet<P: FleetPlan> {
    spec: FleetSpec,
    shared: Arc<Shared>,
    members: Vec<Arc<Member>>,
    epoch: u64,
    plan: Arc<P>,
    /// Joined workers taken for an epoch that did not form yet (kept for the next attempt).
    admitted: Vec<Arc<Member>>,
    /// Workers that asked to drain and are no members any more: they leave once the epoch
    /// without them is installed (until then they hold shards of the installed one).
    leavers: Vec<Arc<Member>>,
    /// The newest installed epoch (`None` until the first one is).
    installed: Option<Installed<P>>,
    threads: Vec<JoinHandle<()>>,
    /// The control endpoint every connection runs on (kept until the threads have stopped).
    endpoint: Option<Arc<ControlEndpoint>>,
    /// `<output>/procs` of a `--nprocs` run, removed when the workers end.
    dir: Option<PathBuf>,
    /// Removes `dir` at a forced exit too (a second signal; [`crate::spec::Host`]).
    forced_exit: Option<Box<dyn Any + Send + Sync>>,
    /// Each member's measured speed (micro-batches per second of its own compute).
    speeds: Speeds<u64>,
    /// Proposes re-assignments by those speeds and backs off when their promised gain does not
    /// come (workers sharing too few cores, whose speeds follow the blocks).
    rebalancer: Rebalancer,
}
