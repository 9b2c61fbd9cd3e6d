//! The fleet: every run of worker processes (`train --nprocs N`, `tessera coordinator`,
//! `tessera launch`, `tessera train` under torchrun or srun). With `tessera.elastic.enabled` (or
//! DeepSpeed's `elasticity.enabled`) workers may die, hang, leave (SIGTERM) or join while the job
//! keeps running, and the result is the bits of the fault-free run. Without it the same fleet
//! runs with recovery off (`config::elastic_run`: no replicas, no joins, no rebalancing): the
//! same failure detector declares the first loss, and the driver (`run.rs`) ends the run with it
//! ([`Fleet::first_loss`]). The worker side is [`super::elastic_worker`], who may connect is
//! [`super::elastic_join`], how the first workers arrive is [`super::rendezvous`].
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
//!    and step record ([`super::replica`]), so a lost rank's shard at `t` is normally held by a
//!    survivor. A member that dropped a replica (an update failed or its digest differed from
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
//!    joins) and at most `max_workers`. The plan for the new world is the ordinary
//!    [`Plan`] (balanced `partition`, blocks over the same M micro-batches): the state moves
//!    through the driver as a start state anyway, so minimal-movement re-planning
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

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use serde_json::json;
use tessera_actors::compute::{ComputeError, MemoryReport, Prepared, StepOrder, WorkerCompute};
use tessera_actors::faults::Faults;
use tessera_actors::formation::{FormMembers, Formation};
use tessera_actors::liveness::{self, Exit, Liveness};
use tessera_actors::recovery::{self, Holdings, Layout, Survivor};
use tessera_actors::replan::{Rebalancer, Speeds};
use tessera_actors::WorkerStopper;
use tessera_chaos::link::WorkerNet;
use tessera_transport::quic::{ClientAuth, ClusterCa, ControlConn, ControlEndpoint, JoinToken};

use super::elastic_join::{self, Admission, Pidfd};
use super::elastic_worker::EXIT_DRAIN_GRACE;
use super::plan::Plan;
use super::ranks::{OptimBuffers, RankCounters, Start};
use super::rendezvous::{self, node_name, send_start, spawn_worker, AgentAuth, Launched, Rendezvous, COORDINATOR_NAME, EXIT_TIMEOUT_MS};
use super::wire::{self, Snapshot, ToParent, ToWorker, Wait, WireError};
use crate::config::{Config, ElasticRun};
use crate::data::Dataset;

/// The driver's event log, under the output directory.
pub const EVENTS_FILE: &str = "elastic_events.jsonl";
/// The run's join token in `<output>/procs` (mode 0600), for `tessera worker --join`.
pub const JOIN_TOKEN_FILE: &str = "join_token";
/// How often the monitor looks at the workers (ms).
const MONITOR_POLL_MS: u64 = 10;
/// Steps a member is measured under the current blocks before they may change again; its
/// speed is their median (`tessera_actors::replan::Speeds`).
const SPEED_WINDOW_STEPS: usize = 5;
/// The quiet period after a re-assignment whose promised gain did not come, and its bound
/// (it doubles with each such miss in a row; [`Rebalancer`]).
const REBALANCE_QUIET_STEPS: u64 = 20;
const REBALANCE_QUIET_MAX_STEPS: u64 = 640;

pub(super) fn relock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Wall-clock milliseconds since the Unix epoch (the event log's clock).
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// A worker's signs of life, fed by its side connection (and, for a process of this host that
/// is not our child, its pidfd).
pub(super) struct Beat {
    pid: AtomicU32,
    /// A joiner or agent on this host: watched and killed through its pidfd.
    pub local: Mutex<Option<Pidfd>>,
    pub last: Mutex<Instant>,
    pub closed: AtomicBool,
    pub draining: AtomicBool,
}

impl Beat {
    pub fn new(pid: u32) -> Arc<Beat> {
        Arc::new(Beat {
            pid: AtomicU32::new(pid),
            local: Mutex::new(None),
            last: Mutex::new(Instant::now()),
            closed: AtomicBool::new(false),
            draining: AtomicBool::new(false),
        })
    }

    pub fn pid(&self) -> u32 {
        self.pid.load(Ordering::SeqCst)
    }

    pub fn set_pid(&self, pid: u32) {
        self.pid.store(pid, Ordering::SeqCst);
    }
}

/// A loss not yet recovered from.
#[derive(Debug, Clone)]
struct Loss {
    id: u64,
    why: String,
    /// How its process had ended when it was declared (a child or a launched agent of this
    /// process), if it had.
    exit: Option<Exit>,
}

/// A worker that joined and waits for the next epoch.
pub(super) struct Joiner {
    pub id: u64,
    pub pid: u32,
    pub conn: ControlConn,
}

/// What the driver's threads share.
pub(super) struct Shared {
    pub er: ElasticRun,
    pub cfg_hash: String,
    /// Ids a worker may have: `0..ids` (the first epoch's, then `max_joins` more).
    pub ids: u64,
    next_id: AtomicU64,
    /// Ids given out (never given again).
    pub known: Mutex<BTreeSet<u64>>,
    pub closing: AtomicBool,
    /// The monitor's clock starts here (before any heartbeat).
    clock: Instant,
    epoch: AtomicU64,
    children: Mutex<Vec<(u64, Child)>>,
    /// Processes `tessera launch` started for the agents (reaped by it after the run).
    launched: Arc<Mutex<Vec<Launched>>>,
    /// Who each first-epoch worker is in messages ("worker process of rank 1 (pid 42)", "agent
    /// of rank 1 (a1 at 10.0.0.2, pid 42)").
    names: Mutex<BTreeMap<u64, String>>,
    pub beats: Mutex<BTreeMap<u64, Arc<Beat>>>,
    pub sides: Mutex<BTreeMap<u64, ControlConn>>,
    /// Every worker's control connection, closed when it is lost.
    pub controls: Mutex<BTreeMap<u64, ControlConn>>,
    /// The current epoch's member ids.
    members: Mutex<Vec<u64>>,
    losses: Mutex<Vec<Loss>>,
    fenced: Mutex<BTreeSet<u64>>,
    /// Ids told to leave (their exit is not a loss).
    leaving: Mutex<BTreeSet<u64>>,
    pub joiners: Mutex<Vec<Joiner>>,
    events: Mutex<File>,
    pub admission: Admission,
    /// Stops a rank's DeviceWorker actor of the current epoch's tree (the `stop_actor` fault).
    stopper: Mutex<Option<WorkerStopper>>,
    /// The driver's fault hooks (`stop_actor`; no-op unless a test asked for them).
    faults: Faults,
}

impl Shared {
    pub fn event(&self, mut v: serde_json::Value) {
        v["t_ms"] = json!(now_ms());
        let mut f = relock(&self.events);
        let _ = writeln!(f, "{v}");
        let _ = f.flush();
    }

    pub fn is_fenced(&self, id: u64) -> bool {
        relock(&self.fenced).contains(&id)
    }

    fn pid_of(&self, id: u64) -> Option<u32> {
        relock(&self.beats).get(&id).map(|b| b.pid())
    }

    /// The next free id for a joiner, if `tessera.elastic.max_joins` leaves one.
    pub fn take_id(&self) -> Option<u64> {
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        (id < self.ids).then(|| {
            relock(&self.known).insert(id);
            id
        })
    }

    /// Drops a joiner that failed its admission: its id is never used again.
    pub fn forget(&self, id: u64) {
        relock(&self.fenced).insert(id);
        relock(&self.beats).remove(&id);
        if let Some(s) = relock(&self.sides).remove(&id) {
            s.abort("not admitted");
        }
    }

    /// Records that worker `id` is lost (once), kills it when it can (our child, or a process
    /// of this host through its pidfd), closes its connections and aborts the current epoch's
    /// group.
    fn loss(&self, id: u64, why: &str) {
        if !relock(&self.fenced).insert(id) {
            return;
        }
        let pid = self.pid_of(id);
        tracing::info!("elastic: lost {why}");
        let exit = self.exit_of(id, pid);
        relock(&self.losses).push(Loss { id, why: why.to_string(), exit });
        self.event(json!({"event": "lost", "id": id, "pid": pid, "why": why}));
        let mut killed = false;
        for (_, c) in relock(&self.children).iter_mut().filter(|(cid, _)| *cid == id) {
            killed = true;
            let _ = c.kill();
            let _ = c.wait();
        }
        let beat = relock(&self.beats).remove(&id);
        if let (false, Some(b)) = (killed, &beat) {
            // A joiner is not our child: a stopped one must not come back.
            if let Some(fd) = relock(&b.local).as_ref() {
                fd.kill();
            }
        }
        // Elsewhere, a worker whose side connection closes leaves on its own.
        let reason = "declared lost (fenced)";
        if let Some(s) = relock(&self.sides).remove(&id) {
            s.abort(reason);
        }
        if let Some(c) = relock(&self.controls).remove(&id) {
            c.abort(reason);
        }
        relock(&self.joiners).retain(|j| j.id != id);
        self.abort_epoch();
    }

    /// How worker `id`'s process (`pid`) had ended, if it had and the driver can tell: its
    /// child, or an agent `tessera launch` started here.
    fn exit_of(&self, id: u64, pid: Option<u32>) -> Option<Exit> {
        let mut children = relock(&self.children);
        match children.iter_mut().find(|(cid, _)| *cid == id) {
            Some((_, c)) => c.try_wait().ok().flatten().map(Exit::of),
            None => pid.and_then(|p| rendezvous::launched_exit_of(&self.launched, p)),
        }
    }

    /// Aborts the current epoch's collectives on every member.
    fn abort_epoch(&self) {
        let epoch = self.epoch.load(Ordering::SeqCst);
        let members = relock(&self.members).clone();
        let sides: Vec<ControlConn> = {
            let sides = relock(&self.sides);
            members.iter().filter_map(|id| sides.get(id).cloned()).collect()
        };
        for mut s in sides {
            let _ = wire::send(&mut s, &ToWorker::Abort { epoch });
        }
    }

    fn draining(&self, id: u64) -> bool {
        relock(&self.beats).get(&id).is_some_and(|b| b.draining.load(Ordering::SeqCst))
    }
}

/// Watches exits and heartbeats (see the module doc): each poll feeds the failure detector
/// ([`Liveness`]) what it sees and declares lost whom it answers.
fn monitor(shared: Arc<Shared>) {
    use liveness::{Action, Input};
    let mut detector = Liveness::new(shared.er.heartbeat_timeout_ms);
    let clock = shared.clock;
    let ms = |t: Instant| t.saturating_duration_since(clock).as_millis() as u64;
    while !shared.closing.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(MONITOR_POLL_MS));
        let leaving = relock(&shared.leaving).clone();
        let fenced = relock(&shared.fenced).clone();
        let now = ms(Instant::now());
        for &id in &leaving {
            detector.on(now, Input::Leaving { id });
        }
        for &id in &fenced {
            detector.on(now, Input::Fenced { id });
        }
        // Registered workers first: a child's exit counts only for a watched worker.
        let beats: Vec<(u64, Arc<Beat>)> = relock(&shared.beats).iter().map(|(id, b)| (*id, Arc::clone(b))).collect();
        for (id, b) in beats {
            let last = ms(*relock(&b.last));
            detector.on(last, Input::Watch { id, pid: b.pid() });
            detector.on(last, Input::Heartbeat { id });
            if relock(&b.local).as_ref().is_some_and(Pidfd::exited) {
                detector.on(now, Input::Exited { id, pid: b.pid(), how: Exit::Ended });
            }
            if b.closed.load(Ordering::SeqCst) {
                detector.on(now, Input::Closed { id });
            }
        }
        for (id, c) in relock(&shared.children).iter_mut().filter(|(id, _)| !leaving.contains(id) && !fenced.contains(id)) {
            if let Some(status) = c.try_wait().ok().flatten() {
                let how = worker_exit(status, shared.draining(*id), shared.er.drain_grace_ms);
                detector.on(now, Input::Exited { id: *id, pid: c.id(), how });
            }
        }
        for Action::Lost { id, why } in detector.on(ms(Instant::now()), Input::Tick) {
            if !shared.closing.load(Ordering::SeqCst) {
                shared.loss(id, &why);
            }
        }
        if let Some(rank) = shared.faults.take_stop_actor() {
            let id = relock(&shared.members).get(rank).copied();
            let stopped = relock(&shared.stopper).as_ref().is_some_and(|s| s.stop(rank, "stopped by the chaos fault stop_actor"));
            tracing::info!("elastic: stop_actor: rank {rank}'s actor {}", if stopped { "asked to stop" } else { "not found" });
            shared.event(json!({"event": "actor_stop", "rank": rank, "id": id, "stopped": stopped}));
        }
    }
}

/// How a spawned worker's process ended, for the reason of its loss: a worker that asked to
/// drain and exited with [`EXIT_DRAIN_GRACE`] left because no step boundary came within its
/// drain grace, which the reason then says (its own line on stderr says it too).
fn worker_exit(status: std::process::ExitStatus, draining: bool, grace_ms: u64) -> Exit {
    match (draining, Exit::of(status)) {
        (true, Exit::Code(EXIT_DRAIN_GRACE)) => Exit::DrainGrace { code: EXIT_DRAIN_GRACE, grace_ms },
        (_, exit) => exit,
    }
}

impl Shared {
    /// The driver's shared state at the start of a run: `world` first-epoch workers (ids
    /// `0..world`; `er.max_joins` more ids for joiners), nothing else known yet.
    fn new(er: ElasticRun, world: u64, cfg_hash: String, admission: Admission, events: File) -> Shared {
        Shared {
            ids: world + er.max_joins as u64,
            er,
            cfg_hash,
            next_id: AtomicU64::new(world),
            known: Mutex::new((0..world).collect()),
            closing: AtomicBool::new(false),
            clock: Instant::now(),
            epoch: AtomicU64::new(0),
            children: Mutex::new(Vec::new()),
            launched: Arc::new(Mutex::new(Vec::new())),
            names: Mutex::new(BTreeMap::new()),
            beats: Mutex::new(BTreeMap::new()),
            sides: Mutex::new(BTreeMap::new()),
            controls: Mutex::new(BTreeMap::new()),
            members: Mutex::new(Vec::new()),
            losses: Mutex::new(Vec::new()),
            fenced: Mutex::new(BTreeSet::new()),
            leaving: Mutex::new(BTreeSet::new()),
            joiners: Mutex::new(Vec::new()),
            events: Mutex::new(events),
            admission,
            stopper: Mutex::new(None),
            faults: Faults::default(),
        }
    }
}

#[cfg(test)]
impl Shared {
    /// The driver's shared state with `world` first-epoch workers (ids `0..world`, `max_joins`
    /// more) and no fleet behind it: for tests of the acceptor ([`super::elastic_join`]).
    pub fn for_tests(er: ElasticRun, world: u64, admission: Admission, events: File) -> Shared {
        Shared::new(er, world, "test".into(), admission, events)
    }

    /// Fences `id` as a loss would (without a fleet to abort).
    pub fn fence_for_tests(&self, id: u64) {
        relock(&self.fenced).insert(id);
    }
}

/// A member's control connection and its latest snapshot.
struct Link {
    stream: ControlConn,
    snapshot: Snapshot,
}

/// A member of the current epoch.
struct Member {
    id: u64,
    pid: u32,
    link: Mutex<Link>,
}

/// Why a request to a member failed.
enum Failure {
    /// The member is lost (already recorded): recovery starts again.
    Lost,
    /// The member answered with an error.
    Refused(String),
}

/// The elastic ranks of a run.
pub struct Fleet {
    cfg: Config,
    shared: Arc<Shared>,
    members: Vec<Arc<Member>>,
    epoch: u64,
    plan: Arc<Plan>,
    /// Joined workers taken for an epoch that did not form yet (kept for the next attempt).
    admitted: Vec<Arc<Member>>,
    /// Workers that asked to drain and are no members any more: they leave once the epoch
    /// without them is installed (until then they hold shards of the installed one).
    leavers: Vec<Arc<Member>>,
    /// The newest installed epoch (`None` until the first one is).
    installed: Option<Installed>,
    threads: Vec<JoinHandle<()>>,
    /// The control endpoint every connection runs on (kept until the threads have stopped).
    endpoint: Option<Arc<ControlEndpoint>>,
    /// `<output>/procs` of a `--nprocs` run, removed when the workers end.
    dir: Option<PathBuf>,
    /// Removes `dir` at a forced exit too (a second signal, `crate::signals`).
    forced_exit: Option<crate::signals::CleanupGuard>,
    /// Each member's measured speed (micro-batches per second of its own compute).
    speeds: Speeds<u64>,
    /// Proposes re-assignments by those speeds and backs off when their promised gain does not
    /// come (workers sharing too few cores, whose speeds follow the blocks).
    rebalancer: Rebalancer,
}

/// Writes `<output>/procs` for spawned workers (emptied first): the resolved config, the run
/// CA's certificate and one identity per first-epoch worker (`node-<r>`; the CA's key stays
/// in memory), and the join token (mode 0600) with which `tessera worker --join` joins.
fn prepare_procs(cfg: &Config, world: usize, dir: &Path, ca: &ClusterCa, token: &JoinToken) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("clearing {}", dir.display()))?;
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let text = serde_json::to_string_pretty(&cfg.resolved).context("serialising the resolved config")?;
    std::fs::write(dir.join("config.json"), text).with_context(|| format!("writing {}/config.json", dir.display()))?;
    for r in 0..world {
        ca.issue_to_dir(&dir.join("pki"), &node_name(r)).with_context(|| format!("the identity of worker {r}"))?;
    }
    let path = dir.join(JOIN_TOKEN_FILE);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("creating {}", path.display()))?;
    writeln!(f, "{}", token.text()).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// Micro-batch blocks re-assigned by measured speed at a step boundary.
pub struct Rebalanced {
    pub plan: Arc<Plan>,
    /// Micro-batches per rank, before and after.
    pub before: Vec<usize>,
    pub after: Vec<usize>,
    /// Predicted compute of the slowest rank per step (ms), before and after.
    pub before_ms: f64,
    pub after_ms: f64,
}

/// A new epoch, ready to run steps from `step`.
pub struct Reconfigured {
    pub plan: Arc<Plan>,
    pub computes: Vec<Box<dyn WorkerCompute>>,
    /// The committed steps of the state the epoch starts from (below the driver's count when it
    /// came from a checkpoint: the driver replays the steps in between).
    pub step: u64,
    /// Where the state came from, for people.
    pub source: String,
    /// Whether it came from the members' memory (else from a checkpoint or the seeded start).
    pub from_memory: bool,
    /// Losses recovered from.
    pub losses: usize,
    /// Workers that drained and joined.
    pub drained: usize,
    pub joined: usize,
    /// Seconds the formation of the epoch waited for its members (joins below `min_workers`):
    /// not training time.
    pub join_wait_s: f64,
}

/// The newest epoch whose every member got its first full replica copy: a loss is restored
/// from what its members hold (their shards and replicas, kept until a newer epoch is
/// installed) until then.
#[derive(Clone)]
struct Installed {
    epoch: u64,
    plan: Arc<Plan>,
    /// The members' ids in rank order.
    ids: Vec<u64>,
}

impl Installed {
    /// The layout the state is read in at a recovery ([`recovery::choose_source`]).
    fn layout(&self) -> Layout<'_, u64> {
        Layout { epoch: self.epoch, members: &self.ids, world: self.plan.world, sharded: self.plan.stage != 0 }
    }
}

/// Loads the state at or before a step from checkpoints (the driver's restore path).
pub type Restore<'a> = dyn Fn(u64) -> Result<(Start, String)> + 'a;

/// Where the first epoch's workers come from.
pub enum Origin<'a> {
    /// `train --nprocs N`: spawned here, each in its network namespace with `--worker-net`.
    Spawn { net: Option<&'a WorkerNet> },
    /// `tessera coordinator` / `tessera launch`: agents that join the rendezvous.
    Agents(Box<Rendezvous>),
}

/// A first-epoch worker after its `Hello`: (connection, QUIC address, pid, pidfd when it is a
/// process of this host but not our child, who it is in messages).
type First = (ControlConn, String, u32, Option<Pidfd>, String);

impl Fleet {
    /// Starts the first epoch's `plan.world` workers (ids `0..world`) from `start`: spawned
    /// (see [`super::worker_net`] for `--worker-net`) or agents joining a rendezvous; the
    /// driver's side of the fault hooks (`stop_actor`) is installed first.
    #[allow(clippy::too_many_arguments)]
    pub fn launch(
        cfg: &Config,
        er: &ElasticRun,
        plan: &Arc<Plan>,
        start: &Start,
        out_dir: &Path,
        dataset: &Dataset,
        origin: Origin<'_>,
        faults: &Faults,
    ) -> Result<(Fleet, Vec<Box<dyn WorkerCompute>>)> {
        faults.install_driver_signals();
        let world = plan.world;
        let admission = |auth: AgentAuth| -> Result<Admission> {
            let config = serde_json::to_string(&cfg.resolved).context("serialising the resolved config")?;
            Ok(Admission { auth, config, data_blake3: super::child::data_blake3(dataset), host: elastic_join::host_id() })
        };
        match origin {
            Origin::Spawn { net } => {
                let dir = out_dir.join("procs");
                let ca = ClusterCa::generate()?;
                let token = JoinToken::generate(ca.ca_sha256())?;
                prepare_procs(cfg, world, &dir, &ca, &token)?;
                let identity = ca.issue(COORDINATOR_NAME)?;
                let server = rendezvous::control_server_config(&identity, ClientAuth::Optional)?;
                let auth = AgentAuth::Token { ca: Box::new(ca), token };
                let mut fleet = Fleet::new(cfg, er, plan, out_dir, admission(auth)?, faults, Arc::default())?;
                fleet.dir = Some(dir.clone());
                fleet.forced_exit = Some(crate::signals::on_forced_exit(crate::signals::Cleanup::Dir(dir.clone())));
                let control_ip = net.map_or(IpAddr::V4(Ipv4Addr::LOCALHOST), |n| n.control_ip);
                let endpoint = ControlEndpoint::bind(SocketAddr::new(control_ip, 0), Some(server))
                    .with_context(|| format!("binding the control endpoint on {control_ip}"))?;
                let control = endpoint.local_addr()?.to_string();
                std::fs::write(dir.join("control"), &control).with_context(|| format!("writing {}/control", dir.display()))?;
                if let Some(net) = net {
                    super::worker_net::publish(net, &dir)?;
                }
                let exe = std::env::current_exe().context("finding the tessera executable")?;
                for r in 0..world {
                    let child = spawn_worker(&exe, r, world, &control, &dir, net)?;
                    relock(&fleet.shared.children).push((r as u64, child));
                }
                let shared = Arc::clone(&fleet.shared);
                let exited = || {
                    relock(&shared.children)
                        .iter_mut()
                        .find_map(|(id, c)| c.try_wait().ok().flatten().map(|s| format!("worker {id} {}", Exit::of(s))))
                };
                let mut early = Vec::new();
                let hellos = rendezvous::accept_workers(&endpoint, cfg, &exited, world, Some(&mut early))?;
                let firsts = hellos
                    .into_iter()
                    .enumerate()
                    .map(|(r, h)| (h.conn, h.quic_addr, h.pid, None, format!("worker process of rank {r} (pid {})", h.pid)))
                    .collect();
                fleet.start(Arc::new(endpoint), firsts, early, start)
            }
            Origin::Agents(rdv) => {
                let rdv = *rdv;
                let launched = Arc::clone(&rdv.launched);
                let started = rendezvous::rendezvous_agents(cfg, plan, &rdv, &|| rendezvous::launched_exited(&launched))?;
                let Rendezvous { endpoint, auth, .. } = rdv;
                let fleet = Fleet::new(cfg, er, plan, out_dir, admission(auth)?, faults, launched)?;
                let host = fleet.shared.admission.host.clone();
                let firsts = started
                    .into_iter()
                    .map(|a| {
                        let local = (!a.host.is_empty() && a.host == host).then(|| Pidfd::open(a.pid)).flatten();
                        (a.conn, a.quic_addr, a.pid, local, a.who)
                    })
                    .collect();
                fleet.start(Arc::new(endpoint), firsts, Vec::new(), start)
            }
        }
    }

    /// A fleet with no workers yet (dropping it ends whatever it started); `launched` are the
    /// processes `tessera launch` started for its agents.
    fn new(
        cfg: &Config,
        er: &ElasticRun,
        plan: &Arc<Plan>,
        out_dir: &Path,
        admission: Admission,
        faults: &Faults,
        launched: Arc<Mutex<Vec<Launched>>>,
    ) -> Result<Fleet> {
        let world = plan.world;
        let path = out_dir.join(EVENTS_FILE);
        let events = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        let shared =
            Shared { faults: faults.clone(), launched, ..Shared::new(er.clone(), world as u64, cfg.hash.clone(), admission, events) };
        let shared = Arc::new(shared);
        Ok(Fleet {
            cfg: cfg.clone(),
            shared,
            members: Vec::new(),
            epoch: 0,
            plan: Arc::clone(plan),
            admitted: Vec::new(),
            leavers: Vec::new(),
            installed: None,
            threads: Vec::new(),
            endpoint: None,
            dir: None,
            forced_exit: None,
            speeds: Speeds::new(SPEED_WINDOW_STEPS),
            rebalancer: Rebalancer::new(REBALANCE_QUIET_STEPS, REBALANCE_QUIET_MAX_STEPS),
        })
    }

    /// Sends the first epoch's workers the addresses and their start state, waits for each to
    /// be ready, starts the acceptor (side connections, joins; `early` are joins that came
    /// during the start) and the monitor, and gives the replicas their first full copy.
    fn start(
        mut self,
        endpoint: Arc<ControlEndpoint>,
        firsts: Vec<First>,
        early: Vec<(ControlConn, ToParent)>,
        start: &Start,
    ) -> Result<(Fleet, Vec<Box<dyn WorkerCompute>>)> {
        let shared = Arc::clone(&self.shared);
        let plan = Arc::clone(&self.plan);
        self.endpoint = Some(Arc::clone(&endpoint));
        let addrs: Vec<String> = firsts.iter().map(|f| f.1.clone()).collect();
        let mut members = Vec::with_capacity(firsts.len());
        let mut who = Vec::with_capacity(firsts.len());
        for (r, (mut conn, _, pid, local, name)) in firsts.into_iter().enumerate() {
            wire::send(&mut conn, &ToWorker::Mesh { addrs: addrs.clone(), names: Vec::new() })
                .with_context(|| format!("sending {name} the addresses"))?;
            send_start(&mut conn, &plan, start, r).with_context(|| format!("sending {name} its start state"))?;
            relock(&shared.controls).insert(r as u64, conn.clone());
            let beat = Beat::new(pid);
            *relock(&beat.local) = local;
            relock(&shared.beats).insert(r as u64, beat);
            members.push(Arc::new(Member { id: r as u64, pid, link: Mutex::new(Link { stream: conn, snapshot: Snapshot::default() }) }));
            relock(&shared.names).insert(r as u64, name.clone());
            who.push(name);
        }
        let deadline = Instant::now() + Duration::from_millis(super::rendezvous::STARTUP_TIMEOUT_MS);
        for (r, m) in members.iter().enumerate() {
            let mut link = relock(&m.link);
            let wait = Wait { what: "Ready", deadline: Some(deadline), alive: &|| Ok(()) };
            link.snapshot =
                match wire::recv(&mut link.stream, "Ready", &wait).with_context(|| format!("waiting for {} to start", who[r]))? {
                    ToParent::Ready { snapshot } => snapshot,
                    ToParent::Failed { error } => bail!("{} failed to start: {error}", who[r]),
                    other => bail!("{} answered its start state with {other:?}", who[r]),
                };
            // Heartbeats are due from now on.
            if let Some(b) = relock(&shared.beats).get(&m.id) {
                *relock(&b.last) = Instant::now();
            }
        }
        *relock(&shared.members) = members.iter().map(|m| m.id).collect();
        self.members = members;
        let s = Arc::clone(&shared);
        self.threads
            .push(std::thread::Builder::new().name("tessera-accept".into()).spawn(move || elastic_join::acceptor(s, endpoint, early))?);
        let s = Arc::clone(&shared);
        self.threads.push(std::thread::Builder::new().name("tessera-monitor".into()).spawn(move || monitor(s))?);
        self.log_epoch(start.step, "start");
        match self.replicate(start.step) {
            Ok(()) => {
                self.install();
            }
            // A loss is recovered from at the first step boundary (from the start state: no
            // epoch was installed yet).
            Err(_) if !relock(&shared.losses).is_empty() => {}
            Err(e) => return Err(e.context("the first full copy of the replicas")),
        }
        let computes = self.computes();
        Ok((self, computes))
    }

    fn log_epoch(&self, step: u64, source: &str) {
        let members: Vec<_> = self.members.iter().enumerate().map(|(r, m)| json!({"rank": r, "id": m.id, "pid": m.pid})).collect();
        self.shared.event(
            json!({"event": "epoch", "epoch": self.epoch, "step": step, "world": self.members.len(), "members": members, "source": source}),
        );
    }

    fn computes(&self) -> Vec<Box<dyn WorkerCompute>> {
        self.members
            .iter()
            .enumerate()
            .map(|(rank, m)| {
                Box::new(ElasticCompute { rank, member: Arc::clone(m), shared: Arc::clone(&self.shared) }) as Box<dyn WorkerCompute>
            })
            .collect()
    }

    /// Records a committed step in the event log.
    /// Writes one event (`{"event": …}` plus the time) to `<output>/elastic_events.jsonl`;
    /// the sink outlives borrows of the fleet (a recovery's checkpoint loader logs through it).
    pub fn event_sink(&self) -> impl Fn(serde_json::Value) + 'static {
        let shared = Arc::clone(&self.shared);
        move |v| shared.event(v)
    }

    pub fn committed(&self, step: u64) {
        self.shared.event(json!({"event": "step", "step": step, "epoch": self.epoch, "world": self.members.len()}));
    }

    /// Records a checkpoint written (`Ok(path)`) or not (`Err(why)`) at `step` committed steps.
    pub fn checkpointed(&self, step: u64, saved: Result<&Path, String>) {
        self.shared.event(match saved {
            Ok(path) => json!({"event": "checkpoint", "step": step, "path": path.display().to_string()}),
            Err(error) => json!({"event": "checkpoint_failed", "step": step, "error": error}),
        });
    }

    /// Logs that training runs again after a recovery that began at `began_ms`.
    pub fn resumed(&self, began_ms: u64, step: u64) {
        self.shared.event(json!({"event": "resumed", "step": step, "epoch": self.epoch, "began_ms": began_ms}));
    }

    /// Gives the monitor thread the current epoch's actor tree, for the `stop_actor` fault.
    pub fn set_stopper(&self, stopper: Option<WorkerStopper>) {
        *relock(&self.shared.stopper) = stopper;
    }

    /// Members whose DeviceWorker actor died (`(rank, cause)`, as the actor tree reported them)
    /// are lost like members whose process died: fenced, killed and recovered from.
    pub fn lose_ranks(&self, ranks: &[(usize, String)]) {
        for (rank, cause) in ranks {
            if let Some(m) = self.members.get(*rank) {
                self.shared.loss(m.id, &format!("worker {} (rank {rank}): its actor died: {cause}", m.id));
            }
        }
    }

    /// The first loss, as a run without recovery ends on it: who the worker is (as the start
    /// named it: "worker process of rank 1 (pid 42)", "agent of rank 1 (…)") and how its process
    /// ended when it had, else why the failure detector declared it lost.
    pub fn first_loss(&self) -> Option<String> {
        let loss = relock(&self.shared.losses).first().cloned()?;
        let who = relock(&self.shared.names).get(&loss.id).cloned().unwrap_or_else(|| format!("worker {}", loss.id));
        Some(match loss.exit {
            Some(how) => format!("{who} {how}"),
            None => format!("{who} was lost: {}", loss.why),
        })
    }

    /// Whether the next step boundary must form a new epoch: a loss, a drain request, or a
    /// join with room for it. Waits up to `settle_ms` for a loss to be noticed (after a step
    /// failed, the monitor may still be looking).
    pub fn pending(&self, settle_ms: u64) -> bool {
        let deadline = Instant::now() + Duration::from_millis(settle_ms);
        loop {
            let lost = !relock(&self.shared.losses).is_empty();
            let draining = self.members.iter().any(|m| self.shared.draining(m.id));
            let waiting = !relock(&self.shared.joiners).is_empty() || !self.admitted.is_empty();
            let joins = waiting && self.members.len() < self.shared.er.max_workers;
            if lost || draining || joins || Instant::now() >= deadline {
                return lost || draining || joins;
            }
            std::thread::sleep(Duration::from_millis(MONITOR_POLL_MS));
        }
    }

    /// Sends `msg` to `m` and waits (bounded by the step timeout) for its reply.
    fn request(&self, m: &Member, link: &mut Link, msg: &ToWorker, expected: &'static str) -> Result<ToParent, Failure> {
        request(&self.shared, m, link, msg, expected)
    }

    /// Masters, optimizer buffers and counters of one range (`Export` or `ExportReplica`).
    fn export_from(&self, m: &Member, msg: &ToWorker, want: usize) -> Result<(Vec<f32>, OptimBuffers, RankCounters), Failure> {
        let mut link = relock(&m.link);
        let (counters, descs) = match self.request(m, &mut link, msg, "Exported")? {
            ToParent::Exported { counters, buffers } => (counters, buffers),
            ToParent::Failed { error } => return Err(Failure::Refused(error.to_string())),
            other => return Err(Failure::Refused(format!("answered {msg:?} with {other:?}"))),
        };
        if descs.first().is_none_or(|d| d.len != want as u64) {
            return Err(Failure::Refused(format!("exported {:?} master values, the range holds {want}", descs.first().map(|d| d.len))));
        }
        let wait = Wait {
            what: "exported state",
            deadline: Some(Instant::now() + Duration::from_millis(self.shared.er.step_timeout_ms)),
            alive: &|| Ok(()),
        };
        match wire::recv_bulk(&mut link.stream, &descs, want, &wait) {
            Ok(bufs) => Ok(rendezvous::exported(&descs, bufs, counters)),
            Err(e) => {
                self.shared.loss(m.id, &format!("worker {} (pid {}): exporting its state: {e}", m.id, m.pid));
                Err(Failure::Lost)
            }
        }
    }

    /// Rank `r`'s masters, its optimizer buffers when `with_optim`, and counters.
    pub fn export(&self, r: usize, plan: &Plan, with_optim: bool) -> Result<(Vec<f32>, OptimBuffers, RankCounters)> {
        let m = self.members.get(r).with_context(|| format!("no rank {r} in epoch {}", self.epoch))?;
        match self.export_from(m, &ToWorker::Export { optim: with_optim }, plan.optim_range(r).len()) {
            Ok(x) => Ok(x),
            Err(Failure::Lost) => bail!("exporting the state of rank {r}: worker {} was lost", m.id),
            Err(Failure::Refused(e)) => bail!("exporting the state of rank {r} (worker {}): {e}", m.id),
        }
    }

    /// Every member's latest snapshot, in rank order.
    pub fn snapshots(&self) -> Vec<Snapshot> {
        self.members.iter().map(|m| relock(&m.link).snapshot).collect()
    }

    /// A committed step's reports: each member's measured micro-batches and compute seconds.
    pub fn observe(&mut self, per_rank: &[Prepared]) {
        for (m, p) in self.members.iter().zip(per_rank) {
            if tracing() {
                eprintln!(
                    "[speed] worker {}: {} of {} micro-batches in {:.1} ms busy, prepare {:.1} ms",
                    m.id,
                    p.busy_micro_batches,
                    p.micro_batches,
                    p.busy_s * 1e3,
                    p.compute_s * 1e3
                );
            }
            self.speeds.observe(m.id, p.busy_micro_batches, p.busy_s);
        }
    }

    /// At a step boundary (`step` committed steps): when re-assigning the micro-batch blocks by
    /// the members' measured speeds shortens the predicted step by more than
    /// `tessera.elastic.rebalance_threshold`, every member takes the new blocks (the state
    /// partition stays; the bits do not change) — unless the last re-assignment's promised gain
    /// did not come, which starts a quiet period ([`Rebalancer`]). A member that cannot is lost
    /// (recovery forms an epoch with consistent plans); the error says so.
    pub fn rebalance(&mut self, step: u64, dataset: &Dataset) -> Result<Option<Rebalanced>> {
        let ids: Vec<u64> = self.members.iter().map(|m| m.id).collect();
        let Some(speeds) = self.speeds.of(&ids) else { return Ok(None) };
        let before = self.plan.counts();
        let threshold = self.shared.er.rebalance_threshold;
        let Some(rb) = self.rebalancer.propose(step, self.plan.micro_batches, &before, &speeds, threshold) else { return Ok(None) };
        let mut cfg = self.cfg.clone();
        cfg.world_size = self.plan.world;
        let plan = Plan::new(&cfg, dataset).with_context(|| format!("planning {} ranks", self.plan.world))?;
        let plan = Arc::new(plan.with_blocks(rb.blocks.clone()).map_err(anyhow::Error::msg)?);
        let blocks: Vec<Vec<(u64, u32)>> = rb.blocks.iter().map(|b| b.iter().map(|&(f, l)| (f as u64, l)).collect()).collect();
        let mut links: Vec<MutexGuard<'_, Link>> = self.members.iter().map(|m| relock(&m.link)).collect();
        for (m, link) in self.members.iter().zip(links.iter_mut()) {
            if let Err(e) = wire::send(&mut link.stream, &ToWorker::Blocks { blocks: blocks.clone() }) {
                self.shared.loss(m.id, &format!("worker {} (pid {}): sending new blocks: {e}", m.id, m.pid));
            }
        }
        let mut errors = Vec::new();
        for (m, link) in self.members.iter().zip(links.iter_mut()) {
            if self.shared.is_fenced(m.id) {
                errors.push(format!("worker {} lost", m.id));
                continue;
            }
            match recv_reply(&self.shared, m, link, "Rebalanced") {
                Ok(ToParent::Rebalanced) => {}
                Ok(other) => {
                    let why = format!("worker {} (pid {}) answered new blocks with {other:?}", m.id, m.pid);
                    self.shared.loss(m.id, &why);
                    errors.push(why);
                }
                Err(_) => errors.push(format!("worker {} lost", m.id)),
            }
        }
        drop(links);
        if !errors.is_empty() {
            bail!("re-assigning the micro-batch blocks at step {step}: {}", errors.join("; "));
        }
        self.plan = Arc::clone(&plan);
        self.speeds.restart();
        let r = Rebalanced { plan, before, after: rb.counts, before_ms: rb.before_s * 1e3, after_ms: rb.after_s * 1e3 };
        self.shared.event(json!({
            "event": "rebalance", "step": step, "epoch": self.epoch, "ids": ids,
            "micro_batches_before": r.before, "micro_batches": r.after,
            "speeds": speeds.iter().map(|s| (s * 100.0).round() / 100.0).collect::<Vec<_>>(),
            "predicted_ms_before": (r.before_ms * 10.0).round() / 10.0, "predicted_ms": (r.after_ms * 10.0).round() / 10.0,
        }));
        Ok(Some(r))
    }

    /// Ids of the members whose latest snapshot says they dropped a replica (first), and of
    /// those whose replicas wait for more updates than they apply (second).
    pub fn stale_replicas(&self) -> (Vec<u64>, Vec<u64>) {
        let snaps: Vec<(u64, Snapshot)> = self.members.iter().map(|m| (m.id, relock(&m.link).snapshot)).collect();
        let ids = |f: fn(&Snapshot) -> bool| snaps.iter().filter(|(_, s)| f(s)).map(|(id, _)| *id).collect();
        (ids(|s| s.replica_stale), ids(|s| s.replica_behind && !s.replica_stale))
    }

    /// Logs that full copies follow at `step`: members `dropped` dropped a replica, members
    /// `behind` had not applied the recent updates.
    pub fn replicas_recopied(&self, step: u64, dropped: &[u64], behind: &[u64]) {
        if !dropped.is_empty() {
            tracing::info!("elastic: worker(s) {dropped:?} dropped a replica (see their log); full copies at step {step}");
        }
        self.shared.event(json!({"event": "replicas_recopied", "step": step, "epoch": self.epoch, "dropped": dropped, "behind": behind}));
    }

    /// A full copy of the replicas at `step` committed steps (when an epoch forms, or after a
    /// member dropped a replica): every rank sends its shard to its ring successors. Between
    /// full copies the replicas follow the owners' gradients. Fails when a member is lost or
    /// refuses.
    pub fn replicate(&self, step: u64) -> Result<()> {
        let mut links: Vec<MutexGuard<'_, Link>> = self.members.iter().map(|m| relock(&m.link)).collect();
        for (m, link) in self.members.iter().zip(links.iter_mut()) {
            if let Err(e) = wire::send(&mut link.stream, &ToWorker::Replicate { step }) {
                self.shared.loss(m.id, &format!("worker {} (pid {}): sending Replicate: {e}", m.id, m.pid));
                bail!("replicating step {step}: worker {} lost", m.id);
            }
        }
        let mut errors = Vec::new();
        for (m, link) in self.members.iter().zip(links.iter_mut()) {
            match recv_reply(&self.shared, m, link, "Replicated") {
                Ok(ToParent::Replicated) => {}
                Ok(ToParent::Failed { error }) => {
                    self.shared.abort_epoch();
                    errors.push(format!("worker {}: {error}", m.id));
                }
                Ok(other) => errors.push(format!("worker {} answered Replicate with {other:?}", m.id)),
                Err(_) => errors.push(format!("worker {} lost", m.id)),
            }
        }
        match errors.is_empty() {
            true => Ok(()),
            false => bail!("replicating the shards of step {step}: {}", errors.join("; ")),
        }
    }

    /// Forms a new epoch at the boundary of the first of `at` (committed steps, best first)
    /// whose state is whole in memory, else from a checkpoint (see the module doc).
    pub fn reconfigure(&mut self, at: &[u64], dataset: &Dataset, restore: &Restore<'_>) -> Result<Reconfigured> {
        let attempts = self.shared.ids as usize + 2;
        let mut losses = 0;
        // (drained, joined) over every epoch formed meanwhile, also ones lost again at once.
        let mut moved = (0, 0);
        // Seconds every attempt's formation waited for its members.
        let mut join_wait_s = 0.0;
        for _ in 0..attempts {
            losses += std::mem::take(&mut *relock(&self.shared.losses)).len();
            if let Some(mut r) = self.try_reconfigure(at, dataset, restore, &mut moved, &mut join_wait_s)? {
                losses += std::mem::take(&mut *relock(&self.shared.losses)).len();
                (r.losses, r.drained, r.joined, r.join_wait_s) = (losses, moved.0, moved.1, join_wait_s);
                return Ok(r);
            }
        }
        bail!("gave up forming a new epoch after {attempts} attempts: workers kept failing")
    }

    /// One attempt; `moved` counts the workers that drained and joined once the epoch formed
    /// (before its replicas are copied, which a loss can still make fail). `at` lists the
    /// committed steps whose state may be taken, best first: the first one that every shard
    /// reaches in memory, else a checkpoint at or before the last one.
    fn try_reconfigure(
        &mut self,
        at: &[u64],
        dataset: &Dataset,
        restore: &Restore<'_>,
        moved: &mut (usize, usize),
        join_wait_s: &mut f64,
    ) -> Result<Option<Reconfigured>> {
        let shared = Arc::clone(&self.shared);
        // 1. Who is left and what they hold (members, and drainers not yet let go).
        let mut alive: Vec<Arc<Member>> = Vec::new();
        let mut holdings: Vec<Holdings<u64>> = Vec::new();
        let polled: Vec<Arc<Member>> = self.members.iter().chain(&self.leavers).filter(|m| !shared.is_fenced(m.id)).cloned().collect();
        for m in polled {
            let mut link = relock(&m.link);
            match self.request(&m, &mut link, &ToWorker::Status, "Status") {
                Ok(ToParent::Status { epoch, at, replicas, kept_epoch, kept }) => {
                    drop(link);
                    holdings.push(Holdings { id: m.id, epoch, at, replicas, kept_epoch, kept });
                    alive.push(m);
                }
                Ok(other) => bail!("worker {} answered Status with {other:?}", m.id),
                Err(_) => return Ok(None),
            }
        }
        // 2. Where the state comes from: the installed epoch's shards in memory (owners,
        // replicas, or shards kept while a later epoch formed), else a checkpoint.
        let installed = self.installed.clone();
        let chosen = recovery::choose_source(installed.as_ref().map(Installed::layout), &holdings, at).context("no step to recover at")?;
        let from_memory = matches!(chosen, recovery::Restore::Memory { .. });
        let (start, source) = match chosen {
            recovery::Restore::Memory { step: t, sources } => {
                let inst = installed.as_ref().context("a restore from memory without an installed epoch")?;
                let old = &inst.plan;
                let mut master = Vec::with_capacity(old.total());
                let mut bufs: OptimBuffers = Vec::new();
                let mut counters: Option<RankCounters> = None;
                let mut from_replicas = Vec::new();
                for (o, src) in sources {
                    let (msg, replica) = match src {
                        recovery::Source::Own { .. } => (ToWorker::Export { optim: true }, false),
                        recovery::Source::Replica { .. } => (ToWorker::ExportReplica { owner: o as u64, epoch: inst.epoch }, true),
                        recovery::Source::Kept { owner, replica, .. } => (ToWorker::ExportReplica { owner, epoch: inst.epoch }, replica),
                    };
                    let holder = *src.holder();
                    let m = alive
                        .iter()
                        .find(|m| m.id == holder)
                        .with_context(|| format!("worker {holder} holds rank {o}'s shard but did not answer Status"))?;
                    let want = old.optim_range(o).len();
                    let (mm, ob, c) = match self.export_from(m, &msg, want) {
                        Ok(x) => x,
                        Err(Failure::Lost) => return Ok(None),
                        Err(Failure::Refused(e)) => bail!("worker {} could not hand over the shard of rank {o}: {e}", m.id),
                    };
                    if replica {
                        from_replicas.push(format!("rank {o} from worker {}", m.id));
                    }
                    master.extend_from_slice(&mm);
                    for (i, (name, b)) in ob.into_iter().enumerate() {
                        match bufs.get_mut(i) {
                            Some((_, v)) => v.extend_from_slice(&b),
                            None => bufs.push((name, b)),
                        }
                    }
                    counters.get_or_insert(c);
                }
                let c = counters.context("no shard was exported")?;
                let of = match inst.epoch == self.epoch {
                    true => String::new(),
                    false => format!(" of epoch {} (kept while epoch {} formed)", inst.epoch, self.epoch),
                };
                let source = match from_replicas.is_empty() {
                    true => format!("memory: the members' shards{of} at step {t}"),
                    false => format!("memory: replicas ({}){of} at step {t}", from_replicas.join(", ")),
                };
                let start = Start {
                    step: t,
                    master,
                    optim: Some((c.optimizer_steps, bufs)),
                    applied: c.applied,
                    skipped: c.skipped,
                    scaler: c.scaler,
                };
                (start, source)
            }
            recovery::Restore::Checkpoint { at_most } => restore(at_most)?,
        };
        // 3. The members of the new epoch: survivors minus drainers in their old order, then
        // admitted joiners (`recovery::next_members`); below `min_workers` wait for joins.
        let survivors: Vec<Survivor<Arc<Member>>> =
            alive.iter().map(|m| Survivor { id: Arc::clone(m), draining: shared.draining(m.id) }).collect();
        // The wait for joins is `formation::FormMembers`, fed the ms since it started.
        let began = Instant::now();
        let ms = || began.elapsed().as_millis() as u64;
        let (er, admitted) = (&shared.er, std::mem::take(&mut self.admitted));
        let mut form = FormMembers::new(survivors, admitted, er.min_workers, er.max_workers, er.join_wait_ms, 0);
        let (next, draining) = loop {
            for j in relock(&shared.joiners).drain(..) {
                let link = Mutex::new(Link { stream: j.conn, snapshot: Snapshot::default() });
                form.join(Arc::new(Member { id: j.id, pid: j.pid, link }));
            }
            match form.poll(ms(), |m| shared.is_fenced(m.id)) {
                Formation::Formed { members, draining } => break (members, draining),
                Formation::Wait { say } => {
                    if let Some(line) = say {
                        tracing::info!("{line}");
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
                Formation::Fail(e) => {
                    self.admitted = form.into_admitted();
                    bail!("{e}");
                }
            }
        };
        self.admitted = form.into_admitted();
        *join_wait_s += began.elapsed().as_secs_f64();
        if next.iter().any(|m| shared.is_fenced(m.id)) {
            return Ok(None);
        }
        let joined = next.iter().filter(|m| !self.members.iter().any(|o| o.id == m.id)).count();
        // 4. The new plan and epoch.
        let world = next.len();
        let mut cfg = self.cfg.clone();
        cfg.world_size = world;
        let plan = Arc::new(Plan::new(&cfg, dataset).with_context(|| format!("planning {world} ranks"))?);
        let epoch = self.epoch + 1;
        shared.epoch.store(epoch, Ordering::SeqCst);
        *relock(&shared.members) = next.iter().map(|m| m.id).collect();
        let mut addrs = Vec::with_capacity(world);
        // Members that answered `Epoch` owe a final `Ready`/`Failed`; if the formation stops
        // half-way those answers are settled before anything else is asked of them.
        let mut owing: Vec<(Arc<Member>, bool)> = Vec::with_capacity(world);
        for (r, m) in next.iter().enumerate() {
            let mut link = relock(&m.link);
            let installed = self.installed.as_ref().map(|i| i.epoch);
            let msg = ToWorker::Epoch { epoch, rank: r as u64, world: world as u64, installed };
            let failed = match self.request(m, &mut link, &msg, "EpochAddr") {
                Ok(ToParent::EpochAddr { quic_addr }) => {
                    addrs.push(quic_addr);
                    owing.push((Arc::clone(m), false));
                    continue;
                }
                Ok(ToParent::Failed { error }) => {
                    shared.loss(m.id, &format!("worker {} could not start epoch {epoch}: {error}", m.id));
                    None
                }
                Ok(other) => Some(format!("worker {} answered Epoch with {other:?}", m.id)),
                Err(_) => None,
            };
            drop(link);
            self.settle_epoch(&owing);
            return match failed {
                Some(e) => Err(anyhow::anyhow!(e)),
                None => Ok(None),
            };
        }
        let names: Vec<String> = next.iter().map(|m| node_name(m.id as usize)).collect();
        for (r, m) in next.iter().enumerate() {
            let mut link = relock(&m.link);
            let sent = wire::send(&mut link.stream, &ToWorker::Mesh { addrs: addrs.clone(), names: names.clone() })
                .map_err(anyhow::Error::from)
                .and_then(|()| send_start(&mut link.stream, &plan, &start, r));
            owing[r].1 = true;
            if let Err(e) = sent {
                shared.loss(m.id, &format!("worker {} (pid {}): sending its state: {e:#}", m.id, m.pid));
                drop(link);
                self.settle_epoch(&owing);
                return Ok(None);
            }
        }
        for (k, m) in next.iter().enumerate() {
            let mut link = relock(&m.link);
            let failed = match recv_reply(&shared, m, &mut link, "Ready") {
                Ok(ToParent::Ready { snapshot }) => {
                    link.snapshot = snapshot;
                    continue;
                }
                Ok(ToParent::Failed { error }) => {
                    shared.loss(m.id, &format!("worker {} could not join epoch {epoch}: {error}", m.id));
                    None
                }
                Ok(other) => Some(format!("worker {} answered its epoch state with {other:?}", m.id)),
                Err(_) => None,
            };
            drop(link);
            self.settle_epoch(&owing[k + 1..]);
            return match failed {
                Some(e) => Err(anyhow::anyhow!(e)),
                None => Ok(None),
            };
        }
        // 5. The new epoch takes over; its replicas get their first full copy, which installs
        // it. Until then the workers keep what they hold of the installed epoch and draining
        // workers stay (they hold some of it): a loss meanwhile is restored from memory.
        self.admitted.retain(|a| !next.iter().any(|m| m.id == a.id));
        self.leavers = draining;
        // The new epoch runs the plan's even blocks: its members are measured again.
        self.speeds.retain(|id| next.iter().any(|m| m.id == *id));
        self.speeds.restart();
        self.rebalancer.clear();
        self.members = next;
        self.epoch = epoch;
        self.plan = Arc::clone(&plan);
        self.log_epoch(start.step, &source);
        tracing::info!("elastic: epoch {epoch}: {world} worker(s), state from {source}");
        moved.1 += joined;
        if self.replicate(start.step).is_err() {
            return Ok(None);
        }
        moved.0 += self.install();
        let computes = self.computes();
        let (drained, joined) = *moved;
        Ok(Some(Reconfigured { plan, computes, step: start.step, source, from_memory, losses: 0, drained, joined, join_wait_s: 0.0 }))
    }

    /// Marks the current epoch installed (every member holds its first full replica copy):
    /// members drop what they kept of the epoch before, and draining workers leave (exit
    /// status 0). Returns how many left. A member lost meanwhile is recovered from at the next
    /// step boundary, from this epoch.
    fn install(&mut self) -> usize {
        let ids = self.members.iter().map(|m| m.id).collect();
        self.installed = Some(Installed { epoch: self.epoch, plan: Arc::clone(&self.plan), ids });
        self.shared.event(json!({"event": "installed", "epoch": self.epoch}));
        for m in &self.members {
            let mut link = relock(&m.link);
            match self.request(m, &mut link, &ToWorker::Installed { epoch: self.epoch }, "Installed") {
                Ok(ToParent::Installed) | Err(_) => {}
                Ok(other) => self.shared.loss(m.id, &format!("worker {} answered Installed with {other:?}", m.id)),
            }
        }
        let leavers = std::mem::take(&mut self.leavers);
        for d in &leavers {
            if self.shared.is_fenced(d.id) {
                continue;
            }
            let conn = relock(&d.link).stream.clone();
            let status = shutdown_and_wait(&self.shared, d.id, conn);
            tracing::info!("elastic: worker {} drained and left ({status})", d.id);
            self.shared.event(json!({"event": "drained", "id": d.id, "pid": d.pid, "exit": status.to_string()}));
        }
        leavers.iter().filter(|d| !self.shared.is_fenced(d.id)).count()
    }

    /// After an epoch formation that stopped half-way: each member in `owing` answered `Epoch`
    /// and still owes its final `Ready` or `Failed`. One not yet sent the addresses (`false`)
    /// is woken with a `Ping`, which ends its wait for them (it answers `Failed`); one that got
    /// them answers once its mesh forms or times out. Those answers are read and dropped, so
    /// the next request's reply is its own; a member that does not answer is lost.
    fn settle_epoch(&self, owing: &[(Arc<Member>, bool)]) {
        for (m, mesh_sent) in owing {
            if self.shared.is_fenced(m.id) {
                continue;
            }
            let mut link = relock(&m.link);
            if !mesh_sent {
                if let Err(e) = wire::send(&mut link.stream, &ToWorker::Ping) {
                    self.shared.loss(m.id, &format!("worker {} (pid {}): control connection: {e}", m.id, m.pid));
                    continue;
                }
            }
            // A lost member is recorded by `recv_reply`; any answer is stale.
            let _ = recv_reply(&self.shared, m, &mut link, "the abandoned epoch's answer");
        }
    }

    /// Asks every member (and waiting joiner) to leave and waits (bounded) for each to end
    /// cleanly.
    pub fn close(mut self) -> Result<()> {
        self.shared.closing.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        let mut failures = Vec::new();
        let joiners: Vec<Joiner> = std::mem::take(&mut *relock(&self.shared.joiners));
        for mut j in joiners {
            let _ = wire::send(&mut j.conn, &ToWorker::Shutdown);
        }
        for m in self.admitted.iter().chain(&self.leavers) {
            let _ = wire::send(&mut relock(&m.link).stream, &ToWorker::Shutdown);
        }
        let members: Vec<(u64, ControlConn)> = self.members.iter().map(|m| (m.id, relock(&m.link).stream.clone())).collect();
        for (id, conn) in &members {
            relock(&self.shared.leaving).insert(*id);
            let _ = wire::send(&mut conn.clone(), &ToWorker::Shutdown);
        }
        for (id, conn) in members {
            let exit = wait_exit(&self.shared, id, &conn);
            if !exit.is_clean() {
                failures.push(format!("worker {id}: {exit}"));
            }
        }
        if !failures.is_empty() {
            bail!("the workers did not leave cleanly: {}", failures.join("; "));
        }
        Ok(())
    }
}

/// Tells worker `id` to leave (its exit is then not a loss) and waits for it (see [`wait_exit`]).
fn shutdown_and_wait(shared: &Shared, id: u64, mut conn: ControlConn) -> Exit {
    relock(&shared.leaving).insert(id);
    relock(&shared.beats).remove(&id);
    let _ = wire::send(&mut conn, &ToWorker::Shutdown);
    wait_exit(shared, id, &conn)
}

/// Waits (bounded) for worker `id` to end: its exit status when spawned, else its control
/// connection `conn` closing ([`Exit::Left`]).
fn wait_exit(shared: &Shared, id: u64, conn: &ControlConn) -> Exit {
    let deadline = Instant::now() + Duration::from_millis(EXIT_TIMEOUT_MS);
    let mut children = relock(&shared.children);
    let Some((_, c)) = children.iter_mut().find(|(cid, _)| *cid == id) else {
        drop(children);
        while !conn.is_closed() {
            if Instant::now() >= deadline {
                conn.abort("did not leave in time");
                return Exit::Overdue { bound_ms: EXIT_TIMEOUT_MS, killed: false };
            }
            std::thread::sleep(Duration::from_millis(MONITOR_POLL_MS));
        }
        return Exit::Left;
    };
    loop {
        match c.try_wait() {
            Ok(Some(s)) => return Exit::of(s),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(MONITOR_POLL_MS)),
            _ => {
                let _ = c.kill();
                let _ = c.wait();
                return Exit::Overdue { bound_ms: EXIT_TIMEOUT_MS, killed: true };
            }
        }
    }
}

/// Reads one reply of `m` (bounded by the step timeout; a fenced member fails at once). A
/// transport failure is a loss.
fn recv_reply(shared: &Arc<Shared>, m: &Member, link: &mut Link, expected: &'static str) -> Result<ToParent, Failure> {
    let id = m.id;
    let s = Arc::clone(shared);
    let alive = move || match s.is_fenced(id) {
        true => Err(WireError::Io(std::io::Error::other("lost"))),
        false => Ok(()),
    };
    let ms = shared.er.step_timeout_ms;
    let wait = Wait { what: expected, deadline: Some(Instant::now() + Duration::from_millis(ms)), alive: &alive };
    match wire::recv(&mut link.stream, expected, &wait) {
        Ok(r) => Ok(r),
        Err(e) => {
            let why = match e {
                WireError::Timeout { .. } => format!("worker {id} (pid {}): no {expected} within {ms} ms", m.pid),
                e => format!("worker {id} (pid {}): control connection: {e}", m.pid),
            };
            shared.loss(id, &why);
            Err(Failure::Lost)
        }
    }
}

/// Whether `TESSERA_ELASTIC_TRACE` asks for a trace of the driver's requests on stderr.
pub(super) fn tracing() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("TESSERA_ELASTIC_TRACE").is_some())
}

fn request(shared: &Arc<Shared>, m: &Member, link: &mut Link, msg: &ToWorker, expected: &'static str) -> Result<ToParent, Failure> {
    if tracing() {
        eprintln!("[{}] driver -> worker {}: {msg:?}", now_ms() % 100_000, m.id);
    }
    if shared.is_fenced(m.id) {
        return Err(Failure::Lost);
    }
    if let Err(e) = wire::send(&mut link.stream, msg) {
        shared.loss(m.id, &format!("worker {} (pid {}): control connection: {e}", m.id, m.pid));
        return Err(Failure::Lost);
    }
    recv_reply(shared, m, link, expected)
}

impl Drop for Fleet {
    fn drop(&mut self) {
        self.shared.closing.store(true, Ordering::SeqCst);
        for (_, c) in relock(&self.shared.children).iter_mut() {
            if let Ok(None) = c.try_wait() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        // Agents and joiners whose connections close leave on their own.
        for c in relock(&self.shared.controls).values().chain(relock(&self.shared.sides).values()) {
            c.abort("the run is stopping");
        }
        drop(self.endpoint.take());
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// The driver's proxy of one member's compute in the current epoch.
struct ElasticCompute {
    rank: usize,
    member: Arc<Member>,
    shared: Arc<Shared>,
}

impl ElasticCompute {
    /// The member's reply to `msg`; its error keeps the kind the worker gave it, and a member
    /// that is lost (declared here or by the monitor) is [`ComputeError::Lost`] with its rank.
    fn call(&self, msg: &ToWorker, expected: &'static str) -> Result<(ToParent, MutexGuard<'_, Link>), ComputeError> {
        let mut link = relock(&self.member.link);
        match request(&self.shared, &self.member, &mut link, msg, expected) {
            Ok(ToParent::Failed { error }) => {
                // Peers may wait on this rank inside a collective: let them go.
                self.shared.abort_epoch();
                Err(ComputeError::from(error).context(format_args!("rank {} (worker {})", self.rank, self.member.id)))
            }
            Ok(reply) => Ok((reply, link)),
            Err(_) => {
                let why = relock(&self.shared.losses).iter().rev().find(|l| l.id == self.member.id).map(|l| l.why.clone());
                let why = why.unwrap_or_else(|| format!("rank {} (worker {}) was lost", self.rank, self.member.id));
                Err(ComputeError::Lost { rank: Some(self.rank), why })
            }
        }
    }
}

impl WorkerCompute for ElasticCompute {
    fn prepare(&mut self, order: &StepOrder) -> Result<Prepared, ComputeError> {
        match self.call(&ToWorker::prepare(order), "Prepared")? {
            (ToParent::Prepared { prepared, snapshot }, mut link) => {
                link.snapshot = snapshot;
                Ok(prepared.prepared())
            }
            (other, _) => Err(ComputeError::failed(format!("rank {} answered Prepare with {other:?}", self.rank))),
        }
    }

    fn commit(&mut self, step: u64) -> Result<(), ComputeError> {
        match self.call(&ToWorker::Commit { step }, "Committed")? {
            (ToParent::Committed { snapshot }, mut link) => {
                link.snapshot = snapshot;
                Ok(())
            }
            (other, _) => Err(ComputeError::failed(format!("rank {} answered Commit with {other:?}", self.rank))),
        }
    }

    fn abandon(&mut self, step: u64) {
        if !self.shared.is_fenced(self.member.id) {
            let _ = self.call(&ToWorker::Abandon { step }, "Abandoned");
        }
    }

    fn memory(&self) -> MemoryReport {
        relock(&self.member.link).snapshot.memory.report(self.rank)
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;
    use std::process::ExitStatus;

    use super::*;

    /// Status 3 names the drain grace only for a worker that asked to drain; any other exit of
    /// a drainer, and status 3 of a worker that never asked, read as before.
    #[test]
    fn a_drainers_exit_with_status_3_names_the_drain_grace() {
        let exited = |code: i32| ExitStatus::from_raw(code << 8);
        assert_eq!(
            worker_exit(exited(EXIT_DRAIN_GRACE), true, 300).to_string(),
            "exited with status 3: it was asked to drain (SIGTERM or SIGUSR1) and no step boundary came within its drain grace \
             (tessera.elastic.drain_grace_ms = 300)"
        );
        assert_eq!(worker_exit(exited(EXIT_DRAIN_GRACE), false, 300), Exit::Code(3));
        assert_eq!(worker_exit(exited(4), true, 300).to_string(), "exited with status 4");
        assert_eq!(worker_exit(ExitStatus::from_raw(libc::SIGKILL), true, 300).to_string(), "was killed by signal 9");
    }
}
