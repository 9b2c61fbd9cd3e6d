//! The worker side of an elastic run (`train --nprocs N` with `tessera.elastic.enabled`; the
//! driver's side and the whole design are in [`super::elastic`]).
//!
//! Besides the requests every worker answers (prepare, commit, abandon, export), an elastic
//! worker:
//! - keeps a **side connection** to the driver: a thread sends a heartbeat every
//!   `heartbeat_ms` (a SIGSTOPped or wedged process stops sending and is declared dead), tells
//!   the driver `Draining` once the process got SIGTERM (and exits on its own when no step
//!   boundary came within `drain_grace_ms`), and another thread reads `Abort { epoch }`, which
//!   aborts the current QUIC group so that a collective waiting on a lost peer returns at once;
//! - after every committed step, on `Replicate`, sends its shard (fp32 masters and optimizer
//!   buffers) to its `replicas` ring successors and keeps the shards of its predecessors: a lost
//!   rank's committed state is then still in memory on a survivor (`ExportReplica`);
//! - answers `Status` (the committed steps its state holds, or none after a commit that failed
//!   half-way, and which replicas it holds) and moves to a new plan epoch on `Epoch`: it leaves
//!   the old group, binds a fresh QUIC socket, receives the addresses and node names of the new
//!   members and its cut of the state, and joins the new mesh.
//!
//! A worker that joins a running job (`tessera worker --join`) says `Enlist`, gets its id
//! (`Admit`; its node certificate was made at the start for that id) and then waits for the
//! `Epoch` that makes it a member.

use std::net::{SocketAddr, TcpStream};
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tessera_actors::compute::{StepOrder, WorkerCompute};
use tessera_transport::collective::{AbortHandle, Collective, CollectiveError, CommStats};
use tessera_transport::quic::{ClusterSpec, NodeTls, QuicComm};

use super::child::{export, recv_start, snapshot};
use super::plan::Plan;
use super::remote::{node_name, STARTUP_TIMEOUT_MS};
use super::wire::{self, StateCounters, ToParent, ToWorker, Wait, WireError, WirePrepared};
use super::zero::{RankState, ZeroWorker};
use crate::bridge;
use crate::config::{Config, ElasticRun};
use crate::data::{Dataset, Sampler};

/// Bound on building the QUIC mesh of a new epoch (ms): a member lost meanwhile costs this.
const EPOCH_MESH_TIMEOUT_MS: u64 = 10_000;
/// Exit status of a worker the driver declared lost (fenced) or that lost its driver.
const EXIT_FENCED: i32 = 4;
/// Tag space of the replica transfers (the step is added).
const REPLICA_TAG: u64 = 0x5250_0000_0000_0000;

/// One collective group shared by the rank's `ZeroWorker` and the replication, used by one
/// thread at a time (the worker serves one request at a time).
#[derive(Clone)]
pub(super) struct SharedComm(Arc<Mutex<Box<dyn Collective>>>);

impl SharedComm {
    pub(super) fn new(inner: Box<dyn Collective>) -> Self {
        SharedComm(Arc::new(Mutex::new(inner)))
    }

    fn inner(&self) -> MutexGuard<'_, Box<dyn Collective>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Collective for SharedComm {
    fn rank(&self) -> usize {
        self.inner().rank()
    }
    fn world(&self) -> usize {
        self.inner().world()
    }
    fn timeout_ms(&self) -> u64 {
        self.inner().timeout_ms()
    }
    fn set_timeout_ms(&mut self, timeout_ms: u64) {
        self.inner().set_timeout_ms(timeout_ms)
    }
    fn stats(&self) -> CommStats {
        self.inner().stats()
    }
    fn abort_handle(&self) -> AbortHandle {
        self.inner().abort_handle()
    }
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        self.inner().all_reduce_sum(buf)
    }
    fn all_reduce_sum_f64(&mut self, buf: &mut [f64]) -> Result<(), CollectiveError> {
        self.inner().all_reduce_sum_f64(buf)
    }
    fn reduce_scatter_sum(&mut self, input: &[f32], ranges: &[Range<usize>], out: &mut [f32]) -> Result<(), CollectiveError> {
        self.inner().reduce_scatter_sum(input, ranges, out)
    }
    fn all_gather(&mut self, shard: &[f32], ranges: &[Range<usize>], out: &mut [f32]) -> Result<(), CollectiveError> {
        self.inner().all_gather(shard, ranges, out)
    }
    fn gather_slices_with(
        &mut self,
        input: &[f32],
        ranges: &[Range<usize>],
        visit: &mut dyn FnMut(usize, &[f32]),
    ) -> Result<(), CollectiveError> {
        self.inner().gather_slices_with(input, ranges, visit)
    }
    fn gather_slices(&mut self, input: &[f32], ranges: &[Range<usize>], out: &mut [Vec<f32>]) -> Result<(), CollectiveError> {
        self.inner().gather_slices(input, ranges, out)
    }
    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CollectiveError> {
        self.inner().broadcast(buf, root)
    }
    fn all_to_all(&mut self, send: &[&[f32]]) -> Result<Vec<Vec<f32>>, CollectiveError> {
        self.inner().all_to_all(send)
    }
    fn send(&mut self, to: usize, tag: u64, data: &[f32]) -> Result<(), CollectiveError> {
        self.inner().send(to, tag, data)
    }
    fn recv(&mut self, from: usize, tag: u64) -> Result<Vec<f32>, CollectiveError> {
        self.inner().recv(from, tag)
    }
    fn barrier(&mut self) -> Result<(), CollectiveError> {
        self.inner().barrier()
    }
}

/// Set by the SIGTERM handler (async-signal-safe: one atomic store).
static TERM: AtomicBool = AtomicBool::new(false);

extern "C" fn on_term(_: libc::c_int) {
    TERM.store(true, Ordering::SeqCst);
}

/// Turns SIGTERM into a drain request instead of the default exit.
fn install_term_handler() {
    // SAFETY: `on_term` only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGTERM, on_term as *const () as libc::sighandler_t);
    }
}

/// The current group's epoch and abort handle, for the side connection's reader.
type AbortSlot = Arc<Mutex<Option<(u64, AbortHandle)>>>;

/// Opens the side connection and starts its two threads (heartbeats and drain; aborts).
fn start_side(control: SocketAddr, id: u64, er: &ElasticRun, slot: AbortSlot) -> Result<()> {
    let mut stream = TcpStream::connect_timeout(&control, Duration::from_millis(STARTUP_TIMEOUT_MS))
        .with_context(|| format!("worker {id}: opening the side connection to {control}"))?;
    let _ = stream.set_nodelay(true);
    wire::send(&mut stream, &ToParent::Side { id }).with_context(|| format!("worker {id}: side connection"))?;
    let mut reader = stream.try_clone().context("side connection")?;
    let (beat, grace) = (Duration::from_millis(er.heartbeat_ms), Duration::from_millis(er.drain_grace_ms));
    std::thread::Builder::new()
        .name("tessera-heartbeat".into())
        .spawn(move || {
            let mut draining: Option<Instant> = None;
            loop {
                if draining.is_none() && TERM.load(Ordering::SeqCst) {
                    draining = Some(Instant::now());
                    eprintln!("worker {id}: SIGTERM: handing my shard over at the next step boundary");
                    if wire::send(&mut stream, &ToParent::Draining).is_err() {
                        return;
                    }
                }
                if draining.is_some_and(|t| t.elapsed() > grace) {
                    eprintln!("worker {id}: no step boundary within the drain grace period of {} ms; leaving", grace.as_millis());
                    std::process::exit(3);
                }
                if wire::send(&mut stream, &ToParent::Heartbeat).is_err() {
                    return;
                }
                std::thread::sleep(beat);
            }
        })
        .context("starting the heartbeat thread")?;
    std::thread::Builder::new()
        .name("tessera-side".into())
        .spawn(move || loop {
            let wait = Wait { what: "the driver's side messages", deadline: None, alive: &|| Ok(()) };
            match wire::recv::<ToWorker>(&mut reader, "Abort", &wait) {
                Ok(ToWorker::Abort { epoch }) => {
                    if let Some((e, handle)) = slot.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
                        if *e == epoch {
                            handle.abort(&format!("the driver aborted epoch {epoch}: a member was lost"));
                        }
                    }
                }
                Ok(ToWorker::Refused { error }) => {
                    eprintln!("worker {id}: the driver refused this worker: {error}; leaving");
                    std::process::exit(EXIT_FENCED);
                }
                Ok(_) => {}
                // The driver keeps the side connection open for as long as it counts on this
                // worker; it closes it when it declares the worker lost (a partition that
                // healed, a hang that ended) or when it is gone. Either way this worker must
                // not go on: it leaves at once, even from inside a collective.
                Err(e) => {
                    eprintln!(
                        "worker {id}: the driver closed the side connection ({e}): declared lost (fenced), or the driver is gone; leaving"
                    );
                    std::process::exit(EXIT_FENCED);
                }
            }
        })
        .context("starting the side reader")?;
    Ok(())
}

/// A ring predecessor's shard, as of `at` committed steps: master first, then optimizer buffers.
struct Replica {
    owner: usize,
    at: u64,
    bufs: Vec<(String, Vec<f32>)>,
}

/// The member's current epoch: its rank, plan, state and compute.
struct Member {
    rank: usize,
    plan: Arc<Plan>,
    state: Arc<Mutex<RankState>>,
    worker: ZeroWorker,
    comm: SharedComm,
}

/// What the elastic loop starts from.
pub(super) struct Setup {
    pub id: u64,
    pub control: SocketAddr,
    pub cfg: Config,
    pub er: ElasticRun,
    pub dataset: Dataset,
    pub sampler: Arc<Sampler>,
    pub tls: NodeTls,
}

/// An elastic worker.
struct Worker {
    s: Setup,
    member: Option<Member>,
    /// Committed steps of the state (`None`: no state, or a commit failed half-way).
    at: Option<u64>,
    replicas: Vec<Replica>,
    slot: AbortSlot,
}

fn lock(st: &Mutex<RankState>) -> MutexGuard<'_, RankState> {
    st.lock().unwrap_or_else(|p| p.into_inner())
}

impl Worker {
    fn new(s: Setup) -> Result<Self> {
        install_term_handler();
        let slot: AbortSlot = Arc::new(Mutex::new(None));
        start_side(s.control, s.id, &s.er, Arc::clone(&slot))?;
        Ok(Worker { s, member: None, at: None, replicas: Vec::new(), slot })
    }

    /// Makes `comm` the group of `epoch` (the side reader may abort it from now on).
    fn install(&mut self, epoch: u64, rank: usize, plan: Arc<Plan>, state: RankState, comm: Box<dyn Collective>, at: u64) {
        let comm = SharedComm::new(comm);
        *self.slot.lock().unwrap_or_else(|p| p.into_inner()) = Some((epoch, comm.abort_handle()));
        let state = Arc::new(Mutex::new(state));
        let worker = ZeroWorker::new(rank, Arc::clone(&plan), Arc::clone(&self.s.sampler), Box::new(comm.clone()), Arc::clone(&state));
        self.member = Some(Member { rank, plan, state, worker, comm });
        self.at = Some(at);
        self.replicas.clear();
    }

    fn member(&mut self) -> Result<&mut Member> {
        self.member.as_mut().context("this worker is not a member of any epoch yet")
    }

    /// Sends this rank's shard to its ring successors and keeps its predecessors'.
    fn replicate(&mut self, step: u64) -> Result<()> {
        let k = self.s.er.replicas;
        let m = self.member()?;
        let world = m.plan.world;
        let k = if m.plan.stage == 0 { 0 } else { k.min(world - 1) };
        let (names, mine) = {
            let st = lock(&m.state);
            let mut names = vec!["master".to_string()];
            let mut mine: Vec<f32> = st.master.to_vec();
            for (n, b) in st.optim.state_buffers() {
                names.push(n.to_string());
                mine.extend_from_slice(b);
            }
            (names, mine)
        };
        let tag = REPLICA_TAG + step;
        for j in 1..=k {
            m.comm.send((m.rank + j) % world, tag, &mine).map_err(|e| anyhow::anyhow!("sending the replica of step {step}: {e}"))?;
        }
        drop(mine);
        let mut got = Vec::with_capacity(k);
        for j in 1..=k {
            let owner = (m.rank + world - j) % world;
            let data = m.comm.recv(owner, tag).map_err(|e| anyhow::anyhow!("receiving the replica of rank {owner}: {e}"))?;
            let len = m.plan.optim_range(owner).len();
            if data.len() != len * names.len() {
                bail!("the replica of rank {owner} has {} values, expected {} × {len}", data.len(), names.len());
            }
            let bufs = names.iter().zip(data.chunks(len.max(1))).map(|(n, c)| (n.clone(), c.to_vec())).collect();
            got.push(Replica { owner, at: step, bufs });
        }
        self.replicas = got;
        Ok(())
    }

    /// Sends the replica of `owner` as `Export` would send the owner's own state.
    fn export_replica(&mut self, stream: &mut TcpStream, owner: usize) -> Result<()> {
        let Some(r) = self.replicas.iter().find(|r| r.owner == owner) else {
            wire::send(stream, &ToParent::Failed { error: format!("no replica of rank {owner} here") })?;
            return Ok(());
        };
        let m = self.member.as_ref().context("no member state")?;
        let st = lock(&m.state);
        let counters = StateCounters {
            optimizer_steps: Some(st.optim.step_count()),
            applied: st.applied,
            skipped: st.skipped,
            scaler: st.scaler.as_ref().map(bridge::scaler_to_json),
        };
        let bufs: Vec<(&str, &[f32])> = r.bufs.iter().map(|(n, b)| (n.as_str(), b.as_slice())).collect();
        wire::send(stream, &ToParent::Exported { counters, buffers: wire::describe(&bufs) })?;
        wire::send_bulk(stream, &bufs.iter().map(|(_, b)| *b).collect::<Vec<_>>())?;
        Ok(())
    }

    /// Leaves the current group and joins the group of `epoch` as `rank` of `world`.
    fn new_epoch(&mut self, stream: &mut TcpStream, epoch: u64, rank: usize, world: usize, wait: &Wait<'_>) -> Result<()> {
        *self.slot.lock().unwrap_or_else(|p| p.into_inner()) = None;
        if let Some(old) = self.member.take() {
            // Leaving a group waits (bounded) for every peer's goodbye, and a lost peer never
            // sends one: let the old group go in the background.
            let _ = std::thread::Builder::new().name("tessera-leave".into()).spawn(move || drop(old));
        }
        self.at = None;
        self.replicas.clear();
        let mut cfg = self.s.cfg.clone();
        cfg.world_size = world;
        let plan = Arc::new(Plan::new(&cfg, &self.s.dataset).with_context(|| format!("the plan of epoch {epoch} ({world} ranks)"))?);
        // On the control connection's local address: the worker's namespace when it has one.
        let local_ip = stream.local_addr().context("the control connection's local address")?.ip();
        let (socket, quic_addr) = super::worker_net::bind_quic(local_ip)?;
        wire::send(stream, &ToParent::EpochAddr { quic_addr: quic_addr.to_string() })?;
        let (addrs, names) = match wire::recv(stream, "Mesh", wait)? {
            ToWorker::Mesh { addrs, names } => (addrs, names),
            other => bail!("epoch {epoch}: expected the addresses, got {other:?}"),
        };
        let addrs = addrs.iter().map(|s| s.parse::<SocketAddr>().with_context(|| format!("address {s:?}"))).collect::<Result<Vec<_>>>()?;
        let addrs = super::worker_net::peer_addrs(addrs, rank)?;
        let (state, at) = recv_start(stream, &cfg, &plan, rank, wait).with_context(|| format!("epoch {epoch}: start state"))?;
        let spec = ClusterSpec { addrs, names };
        let comm = QuicComm::connect_socket(socket, rank, &spec, &self.s.tls, EPOCH_MESH_TIMEOUT_MS)
            .with_context(|| format!("epoch {epoch}: QUIC mesh"))?;
        self.install(epoch, rank, plan, state, Box::new(comm), at);
        Ok(())
    }

    /// Answers one request; returns false on `Shutdown`.
    fn serve_one(&mut self, msg: ToWorker, stream: &mut TcpStream, alive: &dyn Fn() -> Result<(), WireError>) -> Result<bool> {
        let snap = |m: &Member| snapshot(&lock(&m.state), m.rank);
        let reply = match msg {
            ToWorker::Prepare { step, epoch, attempt } => {
                let m = self.member()?;
                match m.worker.prepare(&StepOrder { step, epoch, attempt }) {
                    Ok(p) => ToParent::Prepared { prepared: WirePrepared::new(&p), snapshot: snap(m) },
                    Err(error) => ToParent::Failed { error },
                }
            }
            ToWorker::Commit { step } => {
                let m = self.member()?;
                match m.worker.commit(step) {
                    Ok(()) => {
                        let s = snap(m);
                        self.at = Some(step + 1);
                        ToParent::Committed { snapshot: s }
                    }
                    Err(error) => {
                        // The optimizer may have stepped part of the shard: not a usable state.
                        self.at = None;
                        ToParent::Failed { error }
                    }
                }
            }
            ToWorker::Abandon { step } => {
                if let Some(m) = self.member.as_mut() {
                    m.worker.abandon(step);
                }
                ToParent::Abandoned
            }
            ToWorker::Export { optim } => {
                let m = self.member()?;
                export(stream, &lock(&m.state), optim)?;
                return Ok(true);
            }
            ToWorker::ExportReplica { owner } => {
                self.export_replica(stream, owner as usize)?;
                return Ok(true);
            }
            ToWorker::Replicate { step } => match self.replicate(step) {
                Ok(()) => ToParent::Replicated,
                Err(e) => ToParent::Failed { error: format!("{e:#}") },
            },
            ToWorker::Status => ToParent::Status {
                at: self.at.filter(|_| self.member.is_some()),
                replicas: self.replicas.iter().map(|r| (r.owner as u64, r.at)).collect(),
            },
            ToWorker::Epoch { epoch, rank, world } => {
                let deadline = Some(Instant::now() + Duration::from_millis(STARTUP_TIMEOUT_MS));
                let wait = Wait { what: "the new epoch's messages", deadline, alive };
                match self.new_epoch(stream, epoch, rank as usize, world as usize, &wait) {
                    Ok(()) => {
                        let m = self.member()?;
                        ToParent::Ready { snapshot: snap(m) }
                    }
                    Err(e) => ToParent::Failed { error: format!("worker {}: {e:#}", self.s.id) },
                }
            }
            ToWorker::Ping => ToParent::Pong,
            ToWorker::Shutdown => return Ok(false),
            other => bail!("unexpected request {other:?}"),
        };
        wire::send(stream, &reply)?;
        Ok(true)
    }

    /// Serves requests until `Shutdown` or the control connection closes.
    fn run(&mut self, stream: &mut TcpStream, alive: &dyn Fn() -> Result<(), WireError>) -> Result<()> {
        loop {
            let wait = Wait { what: "a request", deadline: None, alive };
            let msg = match wire::recv(stream, "a request", &wait) {
                Ok(m) => m,
                // The driver ends a worker it still counts on with `Shutdown`.
                Err(WireError::Closed) => {
                    bail!("worker {}: the driver closed the control connection without Shutdown: declared lost (fenced), or the driver is gone", self.s.id)
                }
                Err(e) => return Err(e).context(format!("worker {}: control connection", self.s.id)),
            };
            if super::elastic::tracing() {
                eprintln!("[{}] worker {}: {msg:?}", super::elastic::now_ms() % 100_000, self.s.id);
            }
            if !self.serve_one(msg, stream, alive)? {
                return Ok(());
            }
        }
    }
}

/// An elastic worker that started with the run: epoch 0 is built (`state` from the start
/// state, `comm` its group) and `Ready` was sent.
#[allow(clippy::too_many_arguments)]
pub(super) fn serve_started(
    stream: &mut TcpStream,
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
    w.run(stream, alive)
}

/// `tessera worker --join --dir DIR`: joins the running job whose `procs` directory is `dir`.
pub fn run_joiner(dir: &Path) -> Result<()> {
    let control_file = dir.join("control");
    let text = std::fs::read_to_string(&control_file).with_context(|| format!("reading {}", control_file.display()))?;
    let control: SocketAddr =
        text.trim().parse().with_context(|| format!("{}: {:?} is not an address", control_file.display(), text.trim()))?;
    let path = dir.join("config.json");
    let cfg = crate::config::load(&path, &[], &Default::default()).with_context(|| format!("loading {}", path.display()))?;
    let er = crate::config::elastic_run(&cfg)?;
    if !er.enabled {
        bail!("{}: the run is not elastic (tessera.elastic.enabled is false): it takes no joins", path.display());
    }
    let dataset = super::child::load_dataset(&cfg)?;
    let sampler =
        Arc::new(Sampler::new(dataset.train.clone(), Plan::new(&cfg, &dataset)?.seq_len, cfg.tessera.seed).context("training data")?);
    let mut stream = TcpStream::connect_timeout(&control, Duration::from_millis(STARTUP_TIMEOUT_MS))
        .with_context(|| format!("joining the run at {control}"))?;
    let _ = stream.set_nodelay(true);
    wire::send(&mut stream, &ToParent::Enlist { pid: std::process::id(), config_hash: cfg.hash.clone() })?;
    let wait = Wait { what: "Admit", deadline: Some(Instant::now() + Duration::from_millis(STARTUP_TIMEOUT_MS)), alive: &|| Ok(()) };
    let id = match wire::recv(&mut stream, "Admit", &wait).context("waiting to be admitted")? {
        ToWorker::Admit { id } => id,
        ToWorker::Shutdown => bail!("the driver is finishing and takes no more workers"),
        ToWorker::Refused { error } => bail!("the driver refused the join: {error}"),
        other => bail!("expected Admit, got {other:?}"),
    };
    let tls = NodeTls::load(&dir.join("pki"), &node_name(id as usize))?;
    super::worker_net::init_worker(dir, id)?;
    eprintln!("worker {id}: joined the run at {control}; waiting for the next step boundary");
    let s = Setup { id, control, cfg, er, dataset, sampler, tls };
    let mut w = Worker::new(s)?;
    // A joiner is not the driver's child: it leaves when the control connection closes.
    w.run(&mut stream, &|| Ok(()))
}
