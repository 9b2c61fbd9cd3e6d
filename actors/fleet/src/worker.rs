//! The plumbing of a worker process (spawned worker, agent or joiner) that the front crate's
//! serve loop (`engine::elastic_worker`) runs on: its side connection to the driver (heartbeats,
//! `Draining` after a drain signal, the driver's `Abort` and `Refused`), the drain signals
//! themselves, the collective group its compute and its replication share, where each epoch's
//! data-plane QUIC socket binds ([`DataNet`], through [`Sockets`]), and the serve loop
//! ([`serve`]): the driver's requests, one at a time, each answered by the rank it runs
//! ([`Rank`], the front crate's compute and replicas).

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tessera_actors::compute::StepOrder;
use tessera_actors::faults::Faults;
use tessera_actors::formation::DrainTimer;
use tessera_transport::collective::{AbortHandle, Collective, CollectiveError, CommStats};
use tessera_transport::quic::{rustls, ControlConn, ControlEndpoint};

use crate::rendezvous::{COORDINATOR_NAME, STARTUP_TIMEOUT_MS};
use crate::spec::ElasticRun;
use crate::wire::{self, Snapshot, ToParent, ToWorker, Wait, WireComputeError, WireError, EXIT_DRAIN_GRACE};

/// Bound on waiting for a fixed data-plane port (`tessera agent --quic-port`) that the previous
/// epoch's group still holds while it leaves (ms).
const EPOCH_BIND_TIMEOUT_MS: u64 = 10_000;
/// Pause between attempts to bind a fixed data-plane port (ms).
const EPOCH_BIND_RETRY_MS: u64 = 50;
/// Exit status of a worker the driver declared lost (fenced) or that lost its driver.
pub const EXIT_FENCED: i32 = 4;

/// A signal's name, as `kill -l` spells it with the `SIG` prefix.
pub fn signal_name(sig: i32) -> &'static str {
    signal_hook::low_level::signal_name(sig).unwrap_or("a signal")
}

/// How a worker process's data-plane QUIC sockets meet the network: bound plainly ([`Plain`]),
/// or behind a fault link (the chaos harness's, injected by the front crate).
pub trait Sockets: Send + Sync {
    /// Binds one epoch's QUIC socket for a worker whose control connection leaves from
    /// `local_ip`; returns the socket and the address the other members dial.
    fn bind_epoch(&self, local_ip: IpAddr) -> Result<(UdpSocket, SocketAddr)>;
    /// The members' addresses as this worker (rank `own`) dials them.
    fn peer_addrs(&self, addrs: Vec<SocketAddr>, own: usize) -> Result<Vec<SocketAddr>>;
}

/// Sockets bound on the control connection's local address, peers dialled as they are.
pub struct Plain;

impl Sockets for Plain {
    fn bind_epoch(&self, local_ip: IpAddr) -> Result<(UdpSocket, SocketAddr)> {
        let socket = UdpSocket::bind((local_ip, 0)).with_context(|| format!("binding the QUIC socket on {local_ip}"))?;
        let addr = socket.local_addr().context("QUIC socket address")?;
        Ok((socket, addr))
    }

    fn peer_addrs(&self, addrs: Vec<SocketAddr>, _own: usize) -> Result<Vec<SocketAddr>> {
        Ok(addrs)
    }
}

/// One collective group shared by the rank's compute and the replication, used by one thread
/// at a time (the worker serves one request at a time).
#[derive(Clone)]
pub struct SharedComm(Arc<Mutex<Box<dyn Collective>>>);

impl SharedComm {
    pub fn new(inner: Box<dyn Collective>) -> Self {
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

/// The first drain signal that arrived (0: none), set by its action (async-signal-safe: one
/// atomic store).
static TERM: AtomicI32 = AtomicI32::new(0);

/// The signals that ask an elastic worker to drain: SIGTERM (preemption) and SIGUSR1 (Slurm's
/// `--signal=USR1@T` time-limit warning, sent to every process of the step).
const DRAIN_SIGNALS: [i32; 2] = [libc::SIGTERM, libc::SIGUSR1];

/// Turns the drain signals into a drain request instead of the default exit (through
/// `signal-hook`'s registry, which keeps any other action of the signal), except those the
/// fault hooks take (`kill_in_commit` takes SIGUSR1 when a test asks for it). Called as an
/// elastic worker process starts (before its first message), so no drain signal takes its
/// default action (exit) later; idempotent (the first call's hooks hold). Without `drain` (a
/// run whose recovery is off, which cannot hand a shard over) only the fault hooks are
/// installed: SIGTERM ends the worker, and the run with it, naming the signal.
pub fn install_signal_handlers(faults: &Faults, drain: bool) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let taken = faults.install_worker_signals();
        for sig in DRAIN_SIGNALS.into_iter().filter(|s| drain && !taken.contains(s)) {
            // SAFETY: the action only does one atomic compare-exchange, which is
            // async-signal-safe.
            let installed = unsafe {
                signal_hook_registry::register(sig, move || {
                    let _ = TERM.compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst);
                })
            };
            if let Err(e) = installed {
                let name = signal_name(sig);
                tracing::warn!("{name} keeps its default action (exit): its handler could not be installed: {e}");
            }
        }
    });
}

/// The current group's epoch and abort handle, for the side connection's reader.
pub type AbortSlot = Arc<Mutex<Option<(u64, AbortHandle)>>>;

/// How a worker dials its side connection: its control endpoint, the driver's address and
/// this worker's TLS client config (with its `node-<id>` certificate).
pub struct SideDial {
    pub endpoint: Arc<ControlEndpoint>,
    pub driver: SocketAddr,
    pub client: rustls::ClientConfig,
    /// Who this process is in its error when the driver goes away ("worker 1", "agent a1").
    pub who: String,
}

/// Where each epoch's data-plane QUIC socket binds (`bind`, port `port`, 0 = any) and the
/// address the other members dial (`advertise`, with the socket's port); `sockets` binds it on
/// any port (plainly, or behind the worker's fault link).
pub struct DataNet {
    pub bind: IpAddr,
    pub advertise: IpAddr,
    pub port: u16,
    pub sockets: &'static dyn Sockets,
}

impl DataNet {
    /// Binds one epoch's QUIC socket: behind the worker's fault link when it has one, on a
    /// fixed port once the previous epoch's group let it go (bounded), else on any port.
    pub fn bind(&self) -> Result<(UdpSocket, SocketAddr)> {
        if self.port == 0 && self.bind == self.advertise {
            return self.sockets.bind_epoch(self.bind);
        }
        let deadline = Instant::now() + Duration::from_millis(EPOCH_BIND_TIMEOUT_MS);
        loop {
            match UdpSocket::bind((self.bind, self.port)) {
                Ok(socket) => {
                    let port = socket.local_addr().context("QUIC socket address")?.port();
                    return Ok((socket, SocketAddr::new(self.advertise, port)));
                }
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(EPOCH_BIND_RETRY_MS));
                }
                Err(e) => return Err(e).with_context(|| format!("binding the QUIC socket on {} port {}", self.bind, self.port)),
            }
        }
    }
}

/// A worker's side connection and its reader thread. Dropping it (the worker leaves: `Shutdown`,
/// or an error it reports itself) closes the connection first and waits for the reader, so
/// neither thread mistakes the worker's own leaving for the driver fencing it, and neither is
/// inside the control endpoint's runtime when that stops.
pub struct SideLink {
    conn: ControlConn,
    leaving: Arc<AtomicBool>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Drop for SideLink {
    fn drop(&mut self) {
        self.leaving.store(true, Ordering::SeqCst);
        self.conn.close("leaving");
        if let Some(r) = self.reader.take() {
            // It notices `leaving` within one poll of the connection (`wire::POLL_MS`).
            let _ = r.join();
        }
    }
}

/// Opens the side connection and starts its two threads (heartbeats and drain; aborts).
pub fn start_side(side: &SideDial, id: u64, er: &ElasticRun, slot: AbortSlot) -> Result<SideLink> {
    let mut conn = side
        .endpoint
        .connect(side.driver, COORDINATOR_NAME, side.client.clone(), STARTUP_TIMEOUT_MS)
        .with_context(|| format!("worker {id}: opening the side connection to {}", side.driver))?;
    wire::send(&mut conn, &ToParent::Side { id }).with_context(|| format!("worker {id}: side connection"))?;
    let link_conn = conn.clone();
    let mut reader = conn.clone();
    let leaving = Arc::new(AtomicBool::new(false));
    let (beat, grace_ms) = (Duration::from_millis(er.heartbeat_ms), er.drain_grace_ms);
    let heartbeat_leaving = Arc::clone(&leaving);
    std::thread::Builder::new()
        .name("tessera-heartbeat".into())
        .spawn(move || {
            // The drain rule is `formation::DrainTimer`, fed the ms since this thread started.
            let began = Instant::now();
            let mut timer = DrainTimer::new(grace_ms);
            while !heartbeat_leaving.load(Ordering::SeqCst) {
                let term = TERM.load(Ordering::SeqCst);
                let tick = timer.tick(began.elapsed().as_millis() as u64, term != 0);
                if tick.draining {
                    let name = signal_name(term);
                    tracing::info!("worker {id}: {name}: handing my shard over at the next step boundary");
                    if wire::send(&mut conn, &ToParent::Draining).is_err() {
                        return;
                    }
                }
                if tick.leave {
                    tracing::info!("worker {id}: no step boundary within the drain grace period of {grace_ms} ms; leaving");
                    std::process::exit(EXIT_DRAIN_GRACE);
                }
                if wire::send(&mut conn, &ToParent::Heartbeat).is_err() {
                    return;
                }
                std::thread::sleep(beat);
            }
        })
        .context("starting the heartbeat thread")?;
    let reader_leaving = Arc::clone(&leaving);
    let who = side.who.clone();
    let reader = std::thread::Builder::new()
        .name("tessera-side".into())
        .spawn(move || loop {
            let left = || match reader_leaving.load(Ordering::SeqCst) {
                true => Err(WireError::Io(std::io::Error::other("leaving"))),
                false => Ok(()),
            };
            let wait = Wait { what: "the driver's side messages", deadline: None, alive: &left };
            let got = wire::recv::<ToWorker>(&mut reader, "Abort", &wait);
            if reader_leaving.load(Ordering::SeqCst) {
                return;
            }
            match got {
                Ok(ToWorker::Abort { epoch }) => {
                    if let Some((e, handle)) = slot.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
                        if *e == epoch {
                            handle.abort(&format!("the driver aborted epoch {epoch}: a member was lost"));
                        }
                    }
                }
                Ok(ToWorker::Refused { error }) => {
                    tracing::info!("worker {id}: the driver refused this worker: {error}; leaving");
                    std::process::exit(EXIT_FENCED);
                }
                Ok(_) => {}
                // The driver keeps the side connection open for as long as it counts on this
                // worker; it closes it when it declares the worker lost (a partition that
                // healed, a hang that ended) or when it is gone. Either way this worker must
                // not go on: it leaves at once, even from inside a collective.
                Err(e) => {
                    tracing::error!(
                        "{who}: the driver closed the side connection ({e}): declared lost (fenced), or the driver is gone; leaving"
                    );
                    std::process::exit(EXIT_FENCED);
                }
            }
        })
        .context("starting the side reader")?;
    Ok(SideLink { conn: link_conn, leaving, reader: Some(reader) })
}

/// What a worker's serve loop ([`serve`]) asks of the rank it runs: the front crate's compute
/// (its `ZeroWorker`, its state and the replicas it keeps). An `Err` ends the worker; a failure
/// the driver should hear of is a `ToParent::Failed` answer.
pub trait Rank {
    /// This worker's id (its node name is `node-<id>`), for its errors and the trace.
    fn id(&self) -> u64;
    /// `Prepare`: answers `Prepared` or `Failed`.
    fn prepare(&mut self, order: &StepOrder) -> Result<ToParent>;
    /// `Commit`: answers `Committed` or `Failed`.
    fn commit(&mut self, step: u64) -> Result<ToParent>;
    /// `Abandon` (answered `Abandoned`).
    fn abandon(&mut self, step: u64);
    /// `Export`: sends its own state on `stream` (`Exported`, then the bulk buffers).
    fn export(&mut self, stream: &mut ControlConn, optim: bool) -> Result<()>;
    /// `ExportReplica`: sends what it holds of rank `owner`'s shard in plan epoch `epoch` as
    /// `export` would send the owner's own state, or `Failed`.
    fn export_replica(&mut self, stream: &mut ControlConn, owner: usize, epoch: u64) -> Result<()>;
    /// `Installed` (answered `Installed`): `epoch` holds its first full replica copies.
    fn installed(&mut self, epoch: u64);
    /// `Replicate`: a full copy of the replicas at `step` committed steps.
    fn replicate(&mut self, step: u64) -> Result<()>;
    /// `Status`: answers `Status`.
    fn status(&mut self) -> ToParent;
    /// `Epoch`: leaves the current group and joins `epoch`'s as `rank` of `world` (its address,
    /// the mesh and its state cross `stream` within `wait`); `installed` is the newest epoch
    /// the driver installed. Returns the snapshot its `Ready` carries.
    fn epoch(&mut self, stream: &mut ControlConn, to: EpochOrder, wait: &Wait<'_>) -> Result<Snapshot>;
    /// `Blocks`: runs the next steps with these micro-batch blocks per rank.
    fn rebalance(&mut self, blocks: Vec<Vec<(u64, u32)>>) -> Result<()>;
}

/// An `Epoch` request: become `rank` of `world` in `epoch`; `installed` is the newest epoch the
/// driver installed.
#[derive(Debug, Clone, Copy)]
pub struct EpochOrder {
    pub epoch: u64,
    pub rank: usize,
    pub world: usize,
    pub installed: Option<u64>,
}

/// Serves the driver's requests on `stream` with `rank` until `Shutdown` (`Ok`) or the control
/// connection closes (an error: the driver fenced this worker or is gone). `alive` bounds every
/// wait (a spawned worker's parent must still be there).
pub fn serve(stream: &mut ControlConn, rank: &mut dyn Rank, alive: &dyn Fn() -> Result<(), WireError>) -> Result<()> {
    loop {
        let wait = Wait { what: "a request", deadline: None, alive };
        let msg = match wire::recv(stream, "a request", &wait) {
            Ok(m) => m,
            // The driver ends a worker it still counts on with `Shutdown`.
            Err(WireError::Closed) => {
                bail!(
                    "worker {}: the driver closed the control connection without Shutdown: declared lost (fenced), or the driver is gone",
                    rank.id()
                )
            }
            Err(e) => return Err(e).context(format!("worker {}: control connection", rank.id())),
        };
        if crate::driver::tracing() {
            eprintln!("[{}] worker {}: {msg:?}", crate::driver::now_ms() % 100_000, rank.id());
        }
        if !serve_one(rank, msg, stream, alive)? {
            return Ok(());
        }
    }
}

/// Answers one request; returns false on `Shutdown`.
fn serve_one(rank: &mut dyn Rank, msg: ToWorker, stream: &mut ControlConn, alive: &dyn Fn() -> Result<(), WireError>) -> Result<bool> {
    let failed = |why: String| ToParent::Failed { error: WireComputeError::failed(why) };
    let reply = match msg {
        ToWorker::Prepare { step, epoch, attempt } => rank.prepare(&StepOrder { step, epoch, attempt })?,
        ToWorker::Commit { step } => rank.commit(step)?,
        ToWorker::Abandon { step } => {
            rank.abandon(step);
            ToParent::Abandoned
        }
        ToWorker::Export { optim } => {
            rank.export(stream, optim)?;
            return Ok(true);
        }
        ToWorker::ExportReplica { owner, epoch } => {
            rank.export_replica(stream, owner as usize, epoch)?;
            return Ok(true);
        }
        ToWorker::Installed { epoch } => {
            rank.installed(epoch);
            ToParent::Installed
        }
        ToWorker::Replicate { step } => match rank.replicate(step) {
            Ok(()) => ToParent::Replicated,
            Err(e) => failed(format!("{e:#}")),
        },
        ToWorker::Status => rank.status(),
        ToWorker::Epoch { epoch, rank: r, world, installed } => {
            let deadline = Some(Instant::now() + Duration::from_millis(STARTUP_TIMEOUT_MS));
            let wait = Wait { what: "the new epoch's messages", deadline, alive };
            let to = EpochOrder { epoch, rank: r as usize, world: world as usize, installed };
            match rank.epoch(stream, to, &wait) {
                Ok(snapshot) => ToParent::Ready { snapshot },
                Err(e) => failed(format!("worker {}: {e:#}", rank.id())),
            }
        }
        ToWorker::Blocks { blocks } => match rank.rebalance(blocks) {
            Ok(()) => ToParent::Rebalanced,
            Err(e) => failed(format!("worker {}: new micro-batch blocks: {e:#}", rank.id())),
        },
        ToWorker::Ping => ToParent::Pong,
        ToWorker::Shutdown => return Ok(false),
        other => bail!("unexpected request {other:?}"),
    };
    wire::send(stream, &reply)?;
    Ok(true)
}
