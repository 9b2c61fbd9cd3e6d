//! The worker side of the fleet (every process run: `train --nprocs N`, agents; the driver's side
//! and the whole design are in [`tessera_fleet::driver`]). With `tessera.elastic.enabled` off it keeps
//! no replicas and takes no drain signals (recovery is off), and serves the rest as below.
//!
//! Besides the requests every worker answers (prepare, commit, abandon, export), an elastic
//! worker:
//! - keeps a **side connection** to the driver: a thread sends a heartbeat every
//!   `heartbeat_ms` (a SIGSTOPped or wedged process stops sending and is declared dead), tells
//!   the driver `Draining` once the process got SIGTERM or SIGUSR1 (a scheduler's preemption or
//!   time-limit warning; exits on its own when no step boundary came within `drain_grace_ms`), and another thread reads `Abort { epoch }`, which
//!   aborts the current QUIC group so that a collective waiting on a lost peer returns at once;
//! - keeps replicas of its `replicas` ring predecessors' shards (fp32 masters and optimizer
//!   buffers): a full copy when an epoch forms (`Replicate`), then kept in step by each
//!   predecessor's reduced gradient and step record, which its `ZeroWorker` receives at the end
//!   of prepare and turns into updates at commit ([`super::replica`]); the optimizer step on the
//!   replicas runs on a low-priority background thread while the next steps compute. A lost
//!   rank's committed state is then still in memory on a survivor (`ExportReplica`). A replica
//!   whose update fails or whose digest differs from the owner's is dropped and reported in the
//!   next snapshot (`replica_stale`), and so are replicas that fell too far behind
//!   (`replica_behind`); the driver then sends new full copies;
//! - answers `Status` (the committed steps its state holds, or none after a commit that failed
//!   half-way, and which replicas it holds) and moves to a new plan epoch on `Epoch`: it leaves
//!   the old group, binds a fresh QUIC socket, receives the addresses and node names of the new
//!   members and its cut of the state, and joins the new mesh.
//!
//! A worker that joins a running job (`tessera worker --join`, or `tessera agent` once the run
//! goes) says `Join`, gets its id, the config and a certificate for its own key (`Admit`, see
//! [`tessera_fleet::join`]), says `Hello` once its data is loaded and then waits for the `Epoch`
//! that makes it a member.
//!
//! Both connections to the driver are QUIC control connections ([`ControlConn`], TLS 1.3 with
//! this worker's `node-<id>` certificate, except the control connection of a joiner that came
//! with a join token, which is server-authenticated and proven by the token).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, SyncSender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tessera_actors::compute::{StepOrder, WorkerCompute};
use tessera_actors::faults::Faults;
use tessera_fleet::worker::{
    install_signal_handlers, serve, start_side, AbortSlot, DataNet, EpochOrder, Rank, SharedComm, SideDial, SideLink,
};
use tessera_transport::collective::Collective;
use tessera_transport::quic::{ClusterSpec, ControlConn, NodeTls, QuicComm};

use super::plan::Plan;
use super::ranks::{export, recv_start, snapshot};
use super::replica::{FeedConfig, Replica, Update};
use super::zero::{RankState, ZeroWorker};
use crate::bridge;
use crate::config::{Config, ElasticRun};
use crate::data::{Dataset, Sampler};
use tessera_fleet::wire::{self, Snapshot, StateCounters, ToParent, ToWorker, Wait, WireComputeError, WireError, WirePrepared};

/// Bound on building the QUIC mesh of a new epoch (ms): a member lost meanwhile costs this.
const EPOCH_MESH_TIMEOUT_MS: u64 = 10_000;
/// Tag space of the full replica copies (the step is added).
const REPLICA_TAG: u64 = 0x5250_0000_0000_0000;
/// Bound on waiting for the background replica steps (ms); past it the replicas are dropped.
const REPLICA_APPLY_TIMEOUT_MS: u64 = 600_000;

/// One line on standard error in a single write (workers share their parent's stderr).
fn say(line: String) {
    let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), format!("{line}\n").as_bytes());
}

/// Commits whose replica updates may wait for the background thread; with more the replicas
/// are "behind" and the driver sends full copies instead (each queued commit holds the
/// predecessors' gradients: Ψ/N × 4 bytes per predecessor).
const REPLICA_QUEUE_STEPS: usize = 8;
/// The nice value of the replica thread: it takes the CPU the rank's compute leaves idle (the
/// step's waits on its peers) and yields to it otherwise. Where no CPU is idle it falls behind,
/// and a full copy (a transfer, far cheaper than the optimizer steps) catches it up.
const REPLICA_THREAD_NICE: libc::c_int = 19;

/// What the replica thread and the worker share.
#[derive(Default)]
struct ReplicaShared {
    /// The replicas (the thread holds the lock while it applies one commit's updates).
    held: Mutex<Vec<Replica>>,
    /// Commits queued or being applied, and what failed since the last look.
    pending: Mutex<(usize, Vec<String>)>,
    idle: Condvar,
    /// Jobs queued before the replicas were last replaced are skipped, not applied.
    generation: AtomicU64,
}

/// One commit's updates for the thread.
struct ReplicaJob {
    generation: u64,
    faults: Faults,
    plan: Arc<Plan>,
    updates: Vec<Update>,
}

/// The replicas this worker holds and the thread that applies the owners' steps to them
/// while the next steps compute (see [`REPLICA_QUEUE_STEPS`]).
struct Replicas {
    shared: Arc<ReplicaShared>,
    /// Updates to the thread; `None` when it could not be started (updates apply inline).
    tx: Option<SyncSender<ReplicaJob>>,
    /// A replica was dropped since the last full copy (an update failed or its digest differed
    /// from the owner's): the driver is told in the snapshot and sends a full copy.
    stale: bool,
    /// More than [`REPLICA_QUEUE_STEPS`] commits wait to be applied: the driver sends a full
    /// copy rather than have them applied.
    behind: bool,
    /// The process's fault hooks, handed to each job.
    faults: Faults,
}

fn relock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Applies `updates` to `held`; an update that fails drops its replica and is reported.
/// The first update of a commit passes the fault hooks (`after_replica_update`).
fn apply_updates(held: &mut Vec<Replica>, plan: &Plan, updates: Vec<Update>, faults: &Faults, problems: &mut Vec<String>) {
    for (k, u) in updates.into_iter().enumerate() {
        let step = u.record.step;
        match held.iter().position(|r| r.owner == u.owner) {
            Some(i) => {
                if let Err(e) = held[i].apply(plan, u) {
                    problems.push(e);
                    held.remove(i);
                } else if k == 0 {
                    let owner = held[i].owner;
                    if let Some(what) = faults.after_replica_update(owner, step, &mut held[i].master) {
                        say(format!("elastic worker: {what}"));
                    }
                }
            }
            None => problems.push(format!("an update for rank {} but no replica of it here", u.owner)),
        }
    }
}

impl ReplicaShared {
    /// Runs (or, when the replicas were replaced since it was queued, skips) one job.
    fn run(&self, job: ReplicaJob) {
        let mut problems = Vec::new();
        {
            let mut held = relock(&self.held);
            if job.generation == self.generation.load(Ordering::SeqCst) {
                let t0 = Instant::now();
                apply_updates(&mut held, &job.plan, job.updates, &job.faults, &mut problems);
                if tessera_fleet::driver::tracing() {
                    say(format!("[replica] applied in {:.2} ms", t0.elapsed().as_secs_f64() * 1e3));
                }
            }
        }
        let mut p = relock(&self.pending);
        p.0 = p.0.saturating_sub(1);
        p.1.extend(problems);
        self.idle.notify_all();
    }
}

impl Replicas {
    fn new(faults: Faults) -> Self {
        let shared = Arc::new(ReplicaShared::default());
        let (tx, rx) = mpsc::sync_channel::<ReplicaJob>(2 * REPLICA_QUEUE_STEPS + 1);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .thread_name(|_| "tessera-replica".into())
            .start_handler(|_| {
                // SAFETY: setpriority(2) on this thread's own id (Linux: per-thread nice); it
                // touches no memory. Failing leaves the default priority, which is only slower.
                unsafe {
                    libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, REPLICA_THREAD_NICE);
                }
            })
            .build();
        let tx = pool.ok().map(|pool| {
            let sh = Arc::clone(&shared);
            // One long job on the pool's only thread: the optimizer's parallel loops inside it
            // run on that thread too, not on the compute's pool.
            pool.spawn(move || {
                while let Ok(job) = rx.recv() {
                    sh.run(job);
                }
            });
            tx
        });
        Replicas { shared, tx, stale: false, behind: false, faults }
    }

    /// Waits (bounded) until at most `most` commits are queued; takes the failures reported.
    fn wait_below(&mut self, most: usize, report: bool) -> bool {
        let deadline = Instant::now() + Duration::from_millis(REPLICA_APPLY_TIMEOUT_MS);
        let mut p = relock(&self.shared.pending);
        while p.0 > most {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            p = self.shared.idle.wait_timeout(p, left).map(|(g, _)| g).unwrap_or_else(|e| e.into_inner().0);
        }
        for e in std::mem::take(&mut p.1) {
            self.stale = true;
            if report {
                say(format!("elastic worker (pid {}): replica dropped: {e}", std::process::id()));
            }
        }
        true
    }

    /// Waits (bounded) for every queued step; the replicas are then current.
    fn settle(&mut self) -> MutexGuard<'_, Vec<Replica>> {
        if !self.wait_below(0, true) {
            // The thread may still hold the lock: take none of its replicas.
            say(format!("elastic worker: the replicas' steps took over {REPLICA_APPLY_TIMEOUT_MS} ms; dropping them"));
            // A new thread and empty replicas; the old thread ends once its queue is closed.
            *self = Replicas::new(self.faults.clone());
            self.stale = true;
        }
        self.behind = false;
        relock(&self.shared.held)
    }

    /// Replaces the replicas (a new epoch, or full copies): what is queued is skipped.
    fn replace(&mut self, copies: Vec<Replica>) {
        self.shared.generation.fetch_add(1, Ordering::SeqCst);
        if !self.wait_below(0, false) {
            *self = Replicas::new(self.faults.clone());
        }
        *relock(&self.shared.held) = copies;
        (self.stale, self.behind) = (false, false);
    }

    fn clear(&mut self) {
        self.replace(Vec::new());
    }

    /// Queues a commit's updates for the background thread; past [`REPLICA_QUEUE_STEPS`]
    /// waiting, the replicas are `behind`.
    fn queue(&mut self, plan: &Arc<Plan>, updates: Result<Vec<Update>, String>) {
        let updates = match updates {
            Ok(u) => u,
            Err(e) => {
                if !relock(&self.shared.held).is_empty() || relock(&self.shared.pending).0 > 0 {
                    say(format!("elastic worker (pid {}): dropping the replicas (their updates did not arrive: {e})", std::process::id()));
                    self.clear();
                    self.stale = true;
                }
                return;
            }
        };
        if relock(&self.shared.pending).0 >= 2 * REPLICA_QUEUE_STEPS {
            // No full copy came to catch up: apply what waits rather than queue without end.
            drop(self.settle());
            self.behind = true;
        }
        self.wait_below(usize::MAX, true);
        let generation = self.shared.generation.load(Ordering::SeqCst);
        let job = ReplicaJob { generation, faults: self.faults.clone(), plan: Arc::clone(plan), updates };
        let queued = {
            let mut p = relock(&self.shared.pending);
            p.0 += 1;
            p.0
        };
        self.behind |= queued > REPLICA_QUEUE_STEPS;
        match &self.tx {
            Some(tx) => {
                if let Err(mpsc::SendError(job)) = tx.send(job) {
                    self.tx = None;
                    self.shared.run(job);
                }
            }
            None => self.shared.run(job),
        }
    }
}

/// The member's current epoch: its rank, plan, state and compute.
struct Member {
    epoch: u64,
    rank: usize,
    plan: Arc<Plan>,
    state: Arc<Mutex<RankState>>,
    worker: ZeroWorker,
    comm: SharedComm,
}

/// What the elastic loop starts from.
pub(super) struct Setup {
    pub id: u64,
    pub side: SideDial,
    pub data: DataNet,
    pub cfg: Config,
    pub er: ElasticRun,
    pub dataset: Dataset,
    pub sampler: Arc<Sampler>,
    pub tls: NodeTls,
    /// The process's fault hooks (no-op unless a test or the chaos harness asked for them).
    pub faults: Faults,
}

/// What a worker held of the last installed epoch (its own shard and its replicas, all at the
/// same committed step), kept while a newer epoch forms: until every member of the new epoch
/// holds its first full replica copy, the new epoch's ranges are not protected, and a loss
/// then is restored from these (the rule of the sans-IO coordinator, `docs/ELASTIC.md`).
struct Kept {
    epoch: u64,
    /// The run's counters at that step (the optimizer's step count is each shard's).
    counters: StateCounters,
    shards: Vec<Replica>,
}

/// An elastic worker.
struct Worker {
    s: Setup,
    member: Option<Member>,
    /// Committed steps of the state (`None`: no state, or a commit failed before the optimizer
    /// step finished, which may leave the shard half-stepped).
    at: Option<u64>,
    replicas: Replicas,
    kept: Option<Kept>,
    /// The newest epoch the driver said is installed (its first full replica copy done).
    installed: Option<u64>,
    slot: AbortSlot,
    /// Dropped last (fields drop in order): the side connection outlives the group.
    _side: SideLink,
}

fn lock(st: &Mutex<RankState>) -> MutexGuard<'_, RankState> {
    st.lock().unwrap_or_else(|p| p.into_inner())
}

impl Worker {
    fn new(s: Setup) -> Result<Self> {
        install_signal_handlers(&s.faults, s.er.enabled);
        let slot: AbortSlot = Arc::new(Mutex::new(None));
        let side = start_side(&s.side, s.id, &s.er, Arc::clone(&slot))?;
        let replicas = Replicas::new(s.faults.clone());
        Ok(Worker { s, member: None, at: None, replicas, kept: None, installed: None, slot, _side: side })
    }

    /// What this worker holds of the epoch it is leaving (its shard at `at` and its replicas),
    /// as the shards kept while the next epoch forms.
    fn keep(&mut self, m: &Member, at: u64) -> Result<Kept> {
        let st = lock(&m.state);
        let bufs: Vec<(&str, Vec<f32>)> = st.optim.state_buffers().into_iter().map(|(n, b)| (n, b.to_vec())).collect();
        let range = m.plan.optim_range(m.rank);
        let own = Replica::from_copy(m.rank, range, at, m.plan.optimizer, st.master.to_vec(), st.optim.step_count(), &bufs)
            .map_err(anyhow::Error::msg)?;
        let counters = StateCounters {
            optimizer_steps: None,
            applied: st.applied,
            skipped: st.skipped,
            scaler: st.scaler.as_ref().map(bridge::scaler_to_json),
        };
        drop(st);
        let mut shards = vec![own];
        shards.extend(std::mem::take(&mut *self.replicas.settle()).into_iter().filter(|r| r.at == at));
        Ok(Kept { epoch: m.epoch, counters, shards })
    }

    /// Makes `comm` the group of `epoch` (the side reader may abort it from now on).
    fn install(&mut self, epoch: u64, rank: usize, plan: Arc<Plan>, state: RankState, comm: Box<dyn Collective>, at: u64) {
        let comm = SharedComm::new(comm);
        *self.slot.lock().unwrap_or_else(|p| p.into_inner()) = Some((epoch, comm.abort_handle()));
        let state = Arc::new(Mutex::new(state));
        let feed = FeedConfig { successors: self.s.er.replicas, check_every: self.s.er.replica_check_interval };
        let worker = ZeroWorker::new(rank, Arc::clone(&plan), Arc::clone(&self.s.sampler), Box::new(comm.clone()), Arc::clone(&state))
            .with_replica_feed(feed);
        self.member = Some(Member { epoch, rank, plan, state, worker, comm });
        self.at = Some(at);
        self.replicas.clear();
    }

    fn member(&mut self) -> Result<&mut Member> {
        self.member.as_mut().context("this worker is not a member of any epoch yet")
    }

    /// A full copy: sends this rank's shard to its ring successors and replaces the replicas
    /// with its predecessors' (when an epoch forms, or after a replica was dropped).
    fn replicate(&mut self, step: u64) -> Result<()> {
        let k = self.s.er.replicas;
        let m = self.member.as_ref().context("this worker is not a member of any epoch yet")?;
        let world = m.plan.world;
        let k = if m.plan.stage == 0 { 0 } else { k.min(world - 1) };
        if k == 0 {
            self.replicas.clear();
            return Ok(());
        }
        if m.epoch > 0 && self.installed != Some(m.epoch) {
            self.s.faults.before_first_copy(self.s.id, m.epoch);
        }
        let (names, mine, optimizer_steps) = {
            let st = lock(&m.state);
            let mut names = vec!["master".to_string()];
            let mut mine: Vec<f32> = st.master.to_vec();
            for (n, b) in st.optim.state_buffers() {
                names.push(n.to_string());
                mine.extend_from_slice(b);
            }
            (names, mine, st.optim.step_count())
        };
        let tag = REPLICA_TAG + step;
        let mut comm = m.comm.clone();
        for j in 1..=k {
            comm.send((m.rank + j) % world, tag, &mine).map_err(|e| anyhow::anyhow!("sending the replica of step {step}: {e}"))?;
        }
        drop(mine);
        let mut got = Vec::with_capacity(k);
        for j in 1..=k {
            let owner = (m.rank + world - j) % world;
            let data = comm.recv(owner, tag).map_err(|e| anyhow::anyhow!("receiving the replica of rank {owner}: {e}"))?;
            let range = m.plan.optim_range(owner);
            let len = range.len();
            if data.len() != len * names.len() {
                bail!("the replica of rank {owner} has {} values, expected {} × {len}", data.len(), names.len());
            }
            let mut parts = data.chunks(len.max(1)).map(<[f32]>::to_vec);
            let master = parts.next().unwrap_or_default();
            let bufs: Vec<(&str, Vec<f32>)> = names[1..].iter().map(String::as_str).zip(parts).collect();
            let r = Replica::from_copy(owner, range, step, m.plan.optimizer, master, optimizer_steps, &bufs).map_err(anyhow::Error::msg)?;
            got.push(r);
        }
        self.replicas.replace(got);
        Ok(())
    }

    /// Sends what this worker holds of rank `owner`'s shard in plan epoch `epoch` as `Export`
    /// would send the owner's own state: a shard kept from that (installed) epoch, or a replica
    /// of the current one.
    fn export_replica(&mut self, stream: &mut ControlConn, owner: usize, epoch: u64) -> Result<()> {
        if let Some(k) = self.kept.as_ref().filter(|k| k.epoch == epoch) {
            let Some(r) = k.shards.iter().find(|r| r.owner == owner) else {
                let error = WireComputeError::failed(format!("no shard of rank {owner} of epoch {epoch} kept here"));
                wire::send(stream, &ToParent::Failed { error })?;
                return Ok(());
            };
            let counters = StateCounters { optimizer_steps: Some(r.optim.step_count()), ..k.counters.clone() };
            let mut bufs: Vec<(&str, &[f32])> = vec![("master", &r.master)];
            bufs.extend(r.optim.state_buffers());
            wire::send(stream, &ToParent::Exported { counters, buffers: wire::describe(&bufs) })?;
            wire::send_bulk(stream, &bufs.iter().map(|(_, b)| *b).collect::<Vec<_>>())?;
            return Ok(());
        }
        if self.member.as_ref().map(|m| m.epoch) != Some(epoch) {
            let error = WireComputeError::failed(format!("this worker holds nothing of epoch {epoch}"));
            wire::send(stream, &ToParent::Failed { error })?;
            return Ok(());
        }
        let held = self.replicas.settle();
        let Some(r) = held.iter().find(|r| r.owner == owner) else {
            wire::send(stream, &ToParent::Failed { error: WireComputeError::failed(format!("no replica of rank {owner} here")) })?;
            return Ok(());
        };
        let m = self.member.as_ref().context("no member state")?;
        let st = lock(&m.state);
        let counters = StateCounters {
            optimizer_steps: Some(r.optim.step_count()),
            applied: st.applied,
            skipped: st.skipped,
            scaler: st.scaler.as_ref().map(bridge::scaler_to_json),
        };
        let mut bufs: Vec<(&str, &[f32])> = vec![("master", &r.master)];
        bufs.extend(r.optim.state_buffers());
        wire::send(stream, &ToParent::Exported { counters, buffers: wire::describe(&bufs) })?;
        wire::send_bulk(stream, &bufs.iter().map(|(_, b)| *b).collect::<Vec<_>>())?;
        Ok(())
    }

    /// Takes new micro-batch blocks for the current epoch (the state partition stays).
    fn rebalance(&mut self, blocks: Vec<Vec<(u64, u32)>>) -> Result<()> {
        let world = self.member.as_ref().context("this worker is not a member of any epoch yet")?.plan.world;
        let blocks = blocks
            .into_iter()
            .map(|b| b.into_iter().map(|(f, l)| usize::try_from(f).map(|f| (f, l)).context("a block's first micro-batch")).collect())
            .collect::<Result<Vec<Vec<(usize, u32)>>>>()?;
        let (cfg, _) = super::fleet::config_for_world(&self.s.cfg, world);
        let plan = Plan::new(&cfg, &self.s.dataset).with_context(|| format!("the plan of {world} ranks"))?;
        let plan = Arc::new(plan.with_blocks(blocks).map_err(anyhow::Error::msg)?);
        let m = self.member()?;
        m.worker.set_plan(Arc::clone(&plan)).map_err(anyhow::Error::msg)?;
        m.plan = plan;
        Ok(())
    }

    /// Leaves the current group and joins the group of `epoch` as `rank` of `world`.
    fn new_epoch(&mut self, stream: &mut ControlConn, epoch: u64, rank: usize, world: usize, wait: &Wait<'_>) -> Result<()> {
        *self.slot.lock().unwrap_or_else(|p| p.into_inner()) = None;
        // Keep what this worker holds of the installed epoch until a newer one is installed:
        // the epoch it leaves when that is the installed one, else what it kept before.
        let old = self.member.take();
        let kept = self.kept.take().filter(|k| Some(k.epoch) == self.installed);
        self.kept = match (&old, self.at) {
            (Some(m), Some(at)) if Some(m.epoch) == self.installed => match self.keep(m, at) {
                Ok(k) => Some(k),
                Err(e) => {
                    say(format!("elastic worker {}: keeping the shards of epoch {}: {e:#}", self.s.id, m.epoch));
                    None
                }
            },
            _ => kept,
        };
        if let Some(old) = old {
            // Leaving a group waits (bounded) for every peer's goodbye, and a lost peer never
            // sends one: let the old group go in the background.
            let _ = std::thread::Builder::new().name("tessera-leave".into()).spawn(move || drop(old));
        }
        self.at = None;
        self.replicas.clear();
        let (cfg, _) = super::fleet::config_for_world(&self.s.cfg, world);
        let plan = Arc::new(Plan::new(&cfg, &self.s.dataset).with_context(|| format!("the plan of epoch {epoch} ({world} ranks)"))?);
        // On the route to the driver (the worker's namespace when it has one), or as advertised.
        let (socket, quic_addr) = self.s.data.bind()?;
        wire::send(stream, &ToParent::EpochAddr { quic_addr: quic_addr.to_string() })?;
        let (addrs, names) = match wire::recv(stream, "Mesh", wait)? {
            ToWorker::Mesh { addrs, names } => (addrs, names),
            other => bail!("epoch {epoch}: expected the addresses, got {other:?}"),
        };
        let addrs = addrs.iter().map(|s| s.parse::<SocketAddr>().with_context(|| format!("address {s:?}"))).collect::<Result<Vec<_>>>()?;
        let addrs = self.s.data.sockets.peer_addrs(addrs, rank)?;
        let (state, at) =
            recv_start(stream, &cfg, &plan, rank, &self.s.faults, wait).with_context(|| format!("epoch {epoch}: start state"))?;
        let spec = ClusterSpec { addrs, names };
        let comm = QuicComm::connect_socket(socket, rank, &spec, &self.s.tls, EPOCH_MESH_TIMEOUT_MS)
            .with_context(|| format!("epoch {epoch}: QUIC mesh"))?;
        self.install(epoch, rank, plan, state, Box::new(comm), at);
        Ok(())
    }

    /// This worker's snapshot of member `m`, with the replicas' state.
    fn snapshot(&self, m: &Member) -> Snapshot {
        Snapshot { replica_stale: self.replicas.stale, replica_behind: self.replicas.behind, ..snapshot(&lock(&m.state), m.rank) }
    }
}

/// The serve loop (`tessera_fleet::worker::serve`) runs this worker's rank.
impl Rank for Worker {
    fn id(&self) -> u64 {
        self.s.id
    }

    fn prepare(&mut self, order: &StepOrder) -> Result<ToParent> {
        let m = self.member.as_mut().context("this worker is not a member of any epoch yet")?;
        Ok(match m.worker.prepare(order) {
            Ok(p) => {
                let m = self.member.as_ref().context("no member state")?;
                ToParent::Prepared { prepared: WirePrepared::new(&p), snapshot: self.snapshot(m) }
            }
            Err(error) => ToParent::Failed { error: error.into() },
        })
    }

    fn commit(&mut self, step: u64) -> Result<ToParent> {
        self.s.faults.before_commit(self.s.id, step);
        let m = self.member.as_mut().context("this worker is not a member of any epoch yet")?;
        let res = m.worker.commit(step);
        // What the shard reached is the commit's error's to say: `step + 1` (its masters and
        // optimizer state took the step) also when the commit failed later, sharing the
        // parameters with a lost peer (torn with the step), and then the replicas' updates,
        // which arrived in prepare, are applied either way (LAMB's replay this rank's own norm
        // reduction); `step` after an error that is not torn (LAMB's norm all-reduce with a lost
        // peer, before the shard changed: its replicas stay too, no update was made); nothing
        // usable when torn part-way.
        self.at = match &res {
            Ok(()) => Some(step + 1),
            Err(e) => e.state_after_commit(step, self.at),
        };
        if self.at == Some(step + 1) {
            if let Some(updates) = m.worker.take_replica_updates() {
                self.replicas.queue(&m.plan, updates);
            }
        }
        Ok(match res {
            Ok(()) => {
                let m = self.member.as_ref().context("no member state")?;
                ToParent::Committed { snapshot: self.snapshot(m) }
            }
            Err(error) => ToParent::Failed { error: error.into() },
        })
    }

    fn abandon(&mut self, step: u64) {
        if let Some(m) = self.member.as_mut() {
            m.worker.abandon(step);
        }
    }

    fn export(&mut self, stream: &mut ControlConn, optim: bool) -> Result<()> {
        let m = self.member()?;
        export(stream, &lock(&m.state), optim)?;
        Ok(())
    }

    fn export_replica(&mut self, stream: &mut ControlConn, owner: usize, epoch: u64) -> Result<()> {
        Worker::export_replica(self, stream, owner, epoch)
    }

    fn installed(&mut self, epoch: u64) {
        self.installed = Some(self.installed.map_or(epoch, |i| i.max(epoch)));
        if self.kept.as_ref().is_some_and(|k| k.epoch < epoch) {
            self.kept = None;
        }
    }

    fn replicate(&mut self, step: u64) -> Result<()> {
        Worker::replicate(self, step)
    }

    fn status(&mut self) -> ToParent {
        let replicas = self.replicas.settle().iter().map(|r| (r.owner as u64, r.at)).collect();
        let kept = self.kept.as_ref().map_or_else(Vec::new, |k| k.shards.iter().map(|r| (r.owner as u64, r.at)).collect());
        ToParent::Status {
            epoch: self.member.as_ref().map(|m| m.epoch),
            at: self.at.filter(|_| self.member.is_some()),
            replicas,
            kept_epoch: self.kept.as_ref().map(|k| k.epoch),
            kept,
        }
    }

    fn epoch(&mut self, stream: &mut ControlConn, to: EpochOrder, wait: &Wait<'_>) -> Result<Snapshot> {
        if let Some(i) = to.installed {
            self.installed = Some(self.installed.map_or(i, |x| x.max(i)));
        }
        // `Ready` reports the replicas' state as the request found it (the new epoch's
        // replicas are empty until its first full copy).
        let (replica_stale, replica_behind) = (self.replicas.stale, self.replicas.behind);
        self.new_epoch(stream, to.epoch, to.rank, to.world, wait)?;
        let m = self.member.as_ref().context("no member state")?;
        Ok(Snapshot { replica_stale, replica_behind, ..snapshot(&lock(&m.state), m.rank) })
    }

    fn rebalance(&mut self, blocks: Vec<Vec<(u64, u32)>>) -> Result<()> {
        Worker::rebalance(self, blocks)
    }
}

/// An elastic worker that started with the run: epoch 0 is built (`state` from the start
/// state, `comm` its group) and `Ready` was sent.
#[allow(clippy::too_many_arguments)]
pub(super) fn serve_started(
    stream: &mut ControlConn,
    s: Setup,
    rank: usize,
    plan: Arc<Plan>,
    state: RankState,
    comm: Box<dyn Collective>,
    at: u64,
    alive: &dyn Fn() -> Result<(), WireError>,
) -> Result<()> {
    let mut w = Worker::new(s)?;
    w.install(0, rank, plan, state, comm, at);
    serve(stream, &mut w, alive)
}

/// A worker that joined a running job (it said `Hello`): serves until `Shutdown` or the
/// control connection closes (a joiner is not the driver's child: it leaves then).
pub(super) fn serve_joined(conn: &mut ControlConn, s: Setup) -> Result<()> {
    let id = s.id;
    let mut w = Worker::new(s)?;
    tracing::info!("worker {id}: joined the run; waiting for the next step boundary");
    serve(conn, &mut w, &|| Ok(()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{from_str_named, ResolveContext};
    use crate::engine::replica::StepRecord;

    fn plan() -> Arc<Plan> {
        let text = r#"{"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "tessera": {"model": "gpt-tiny", "seq_len": 16}}"#;
        let cfg = from_str_named(text, "test.json", &[], &ResolveContext::with_world(2)).expect("config");
        let tokens: Vec<u32> = (0..2048u32).map(|i| i % 256).collect();
        let data = Dataset::from_tokens(tokens.clone(), tokens, 256, "synthetic".into());
        Arc::new(Plan::new(&cfg, &data).expect("plan"))
    }

    /// Past the queue bound the replicas are `behind`; a full copy then replaces them and the
    /// queued updates are skipped, not applied.
    #[test]
    fn replicas_that_fall_behind_are_replaced_without_applying_the_queue() {
        let plan = plan();
        let mut r = Replicas::new(Faults::default());
        let bogus = || {
            let record = StepRecord { step: 0, applied: false, lr: 0.0, optimizer_steps: 0, digest: None };
            Ok(vec![Update { owner: 99, grad: vec![], record, reductions: vec![] }])
        };
        {
            // The thread blocks on the replicas while this holds them.
            let shared = Arc::clone(&r.shared);
            let _held = relock(&shared.held);
            for _ in 0..=REPLICA_QUEUE_STEPS {
                r.queue(&plan, bogus());
            }
            assert!(r.behind, "more than {REPLICA_QUEUE_STEPS} commits waiting");
            r.shared.generation.fetch_add(1, Ordering::SeqCst);
        }
        let copy = Replica::from_copy(0, 0..0, 5, plan.optimizer, vec![], 3, &[("exp_avg", vec![]), ("exp_avg_sq", vec![])]).expect("copy");
        r.replace(vec![copy]);
        assert!(!r.behind && !r.stale, "behind {} stale {}", r.behind, r.stale);
        assert_eq!(r.settle().iter().map(|x| (x.owner, x.at)).collect::<Vec<_>>(), [(0, 5)]);
        // An update with no replica to apply to is reported (so a skipped one above was not run).
        r.queue(&plan, bogus());
        drop(r.settle());
        assert!(r.stale);
    }
}
