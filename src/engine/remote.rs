//! Ranks as worker processes: the driver keeps the ClusterSupervisor; each worker process runs
//! its own NodeSupervisor and DeviceWorker (`tessera_actors::remote::NodeHost`), and the
//! supervisor's commands (prepare, commit, abandon, memory, shards) and the workers' reports
//! cross between them as actor messages over a QUIC control connection ([`ControlConn`]: mutual
//! TLS, rkyv messages validated on receipt, see [`super::wire`]). The workers run real
//! `ZeroWorker`s whose collectives are a `QuicComm` with mutual TLS: ranks exchange tensors
//! directly, never through the driver. The ranks come from one of two places:
//!
//! - `tessera train --nprocs N`: the parent spawns N `tessera worker` processes on this machine
//!   (QUIC on 127.0.0.1, keys in the run's `procs` directory).
//! - `tessera coordinator` / `tessera launch`: N agents (`tessera agent`, any host) join the
//!   coordinator's control endpoint ([`Rendezvous`], handed to the run in
//!   `TrainOptions::rendezvous`); see "Agents" below.
//!
//! # Start-up ([`launch`])
//! 1. The parent writes the resolved config and a fresh cluster PKI (`cluster_init`: CA,
//!    certificates `node-0..N` and its own, [`COORDINATOR_NAME`]) into `<output>/procs/`,
//!    serves its control endpoint on `127.0.0.1:0` (UDP) and spawns the N workers (each in its
//!    own process group, so a terminal's Ctrl-C reaches only the parent, which stops between
//!    steps, checkpoints and then ends the workers).
//! 2. Each worker dials it with its `node-<rank>` certificate (the parent's is checked by name),
//!    binds its data-plane QUIC socket on `127.0.0.1:0` and says `Hello {rank, pid, address,
//!    config hash}`; the parent checks the certificate's name against the rank, the hash, and
//!    broadcasts every address (no port races).
//! 3. The parent sends each worker its cut of the start state (bulk, on its own stream) — fresh
//!    or resumed, the parent decides; the worker builds its `RankState`, connects the QUIC mesh,
//!    starts its actors and says `Ready`.
//! 4. The actor tree starts with one remote node per rank ([`RemoteNodeSpec`]): the driver's
//!    stand-ins write commands onto each connection's actor lane; a thread per rank (`pump`)
//!    reads the reports back into the ClusterSupervisor, with the rank's figures ([`Snapshot`]).
//!
//! # Agents
//! The coordinator waits (bounded by the rendezvous' join timeout; the error names who joined)
//! until N agents said `Join` and proved they belong ([`AgentAuth`]): with a join token (the
//! secret of the token the coordinator printed, sent over TLS the agent verified against the CA
//! the token pins) plus a public key the agent generated, or with a certificate of a
//! pre-distributed cluster directory (`--certs DIR`, mutual TLS; its name fixes the rank). A
//! connection that proves neither is refused and logged; the run goes on. Ranks are given in join
//! order, except that an agent started with a rank (`--rank`, torchrun's `RANK`, Slurm's
//! `SLURM_PROCID`, or its certificate) gets that one. Each agent then receives `Assign`: its
//! rank, the resolved config and, for a token agent, a `node-<rank>` certificate over its own key
//! with the run's CA. No private key ever travels. From `Hello` on, an agent is served exactly as
//! a spawned worker, plus two checks: the BLAKE3 of its training and validation tokens must equal
//! the coordinator's (hosts may hold different files at the same path), and its QUIC address is
//! the local address on its route to the coordinator (or the one it advertises), so the mesh
//! forms over the network the agents reached the coordinator by.
//!
//! # Between steps
//! Evaluation, checkpoints and the final hash need full buffers: `Export` (request lane) asks an
//! owner rank for its masters and optimizer buffers, which come back as raw f32 bulk on their own
//! stream after a header. Per-step figures (bytes sent, applied steps, loss scale, memory) ride
//! on every actor report as a small [`Snapshot`].
//!
//! # Failure
//! Every wait is bounded. A monitor thread watches the ranks: spawned workers by their exit
//! status, agents by their control connection (closed, or silent past the QUIC idle timeout, =
//! gone; agents are pinged every [`PING_MS`] on the request lane — answered even during a step,
//! since the compute runs on the DeviceWorker's thread — and must answer within
//! [`PONG_TIMEOUT_MS`]) and, under `tessera launch`, the processes it started. On the first loss
//! it records which rank and how, and ends the others at once (kills spawned workers; closes every
//! control connection), so every link reports its rank lost to the ClusterSupervisor and the step
//! fails with an error naming the dead rank. Dropping [`Procs`] kills and reaps every spawned or
//! launched process; workers also exit when their control connection closes or the parent
//! process disappears, agents when the coordinator is silent for `AGENT_IDLE_TIMEOUT_MS` or its
//! connection times out. `<output>/procs` (config, CA and node keys) lives only as long as the
//! ranks.
//!
//! With `tessera.elastic` on, both kinds of runs are driven by `super::elastic` instead, over
//! the same control endpoint and messages (plus a side connection per worker): spawned workers
//! start through [`accept_workers`], agents through [`rendezvous_agents`], and a worker lost is
//! recovered from instead of ending the run.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tessera_actors::liveness::Exit;
use tessera_actors::remote::{ActorCall, Downlink, RemoteNodeSpec, UpSink};
use tessera_actors::DEFAULT_STEP_TIMEOUT_MS;
use tessera_transport::quic::pki::check_cert_names_node;
use tessera_transport::quic::{ClientAuth, ClusterCa, ControlConn, ControlEndpoint, JoinToken, NodeTls, RefusalLog, ALPN_CONTROL};

use super::plan::Plan;
use super::ranks::{master_window, OptimBuffers, RankCounters, Start};
use super::wire::{self, AssignedIdentity, ControlIo, Snapshot, StateCounters, ToParent, ToWorker, Wait, WireError};
use crate::config::Config;
use crate::signals::{self, Cleanup, CleanupGuard};

/// Bound on the workers' start-up: connecting, loading data, building the QUIC mesh (ms).
pub const STARTUP_TIMEOUT_MS: u64 = 120_000;
/// Bound on a worker's reply to one request (a whole prepare or commit included) (ms).
pub const REPLY_TIMEOUT_MS: u64 = DEFAULT_STEP_TIMEOUT_MS;
/// Bound on the workers' exit after `Shutdown` (ms).
pub const EXIT_TIMEOUT_MS: u64 = 15_000;
/// Default bound on the wait for every agent to join (ms).
pub const JOIN_TIMEOUT_MS: u64 = 120_000;
/// Bound on a new connection's first message (`Join`) (ms).
const JOIN_MESSAGE_TIMEOUT_MS: u64 = 10_000;
/// How often the coordinator pings an idle agent (ms).
pub const PING_MS: u64 = 5_000;
/// Bound on an agent's answer to a ping (ms).
pub const PONG_TIMEOUT_MS: u64 = 10_000;
/// How often the monitor polls the workers (ms).
const MONITOR_POLL_MS: u64 = 50;
/// How long the monitor waits for a launched agent's exit status after its connection closed (ms).
const EXIT_GRACE_MS: u64 = 500;
/// How long a link whose connection failed waits for the monitor to say which rank was lost (ms).
const VERDICT_WAIT_MS: u64 = 1_000;
/// The node name of the driver's own certificate (its control endpoint's identity).
pub const COORDINATOR_NAME: &str = "coordinator";

/// The node name of rank `r` in the cluster PKI.
pub fn node_name(r: usize) -> String {
    format!("node-{r}")
}

/// A process `tessera launch` started for the run (a local agent, or the ssh client that runs a
/// remote one): watched while the run lasts, killed if it outlives it.
pub struct Launched {
    /// E.g. "agent host1-0 (ssh host1)".
    pub label: String,
    pub child: Child,
}

/// How agents prove they belong to the run.
pub enum AgentAuth {
    /// Agents without a certificate present the token's secret over TLS that they verified
    /// against the CA the token pins, and send their own public key; the coordinator's
    /// in-memory CA certifies it for the rank they get.
    Token { ca: Box<ClusterCa>, token: JoinToken },
    /// A pre-distributed cluster directory: every agent presents its `node-<rank>` certificate
    /// (mutual TLS); nothing is issued.
    Certs { dir: PathBuf },
}

/// Where a coordinator's ranks come from: `nodes` agents joining at `endpoint`.
pub struct Rendezvous {
    /// The coordinator's control endpoint (QUIC), already serving with its identity.
    pub endpoint: ControlEndpoint,
    pub auth: AgentAuth,
    pub nodes: usize,
    pub join_timeout_ms: u64,
    /// Processes started for the agents (empty for a bare coordinator); shared with the caller,
    /// which reaps what is left after the run.
    pub launched: Arc<Mutex<Vec<Launched>>>,
}

/// A run's rendezvous, as `TrainOptions::rendezvous` carries it: set by `tessera coordinator`
/// and `tessera launch` (and rank 0 under torchrun or srun), it makes the multi-process run
/// wait for agents there instead of spawning `tessera worker` processes. The endpoint is used
/// once: the run takes it ([`RendezvousSlot::take`]); clones of the options share the slot.
#[derive(Clone, Default)]
pub struct RendezvousSlot(Option<Arc<Mutex<Option<Rendezvous>>>>);

impl RendezvousSlot {
    pub fn new(r: Rendezvous) -> Self {
        RendezvousSlot(Some(Arc::new(Mutex::new(Some(r)))))
    }

    /// Whether a rendezvous was handed in (the ranks are agents, on hosts of their own).
    pub fn is_set(&self) -> bool {
        self.0.is_some()
    }

    /// The rendezvous, if one was set and no run took it yet.
    pub fn take(&self) -> Option<Rendezvous> {
        self.0.as_ref().and_then(|m| m.lock().unwrap_or_else(|p| p.into_inner()).take())
    }
}

impl std::fmt::Debug for RendezvousSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "RendezvousSlot(set)" } else { "RendezvousSlot(none)" })
    }
}

/// The TLS server config of a driver's control endpoint: its identity, and whether clients
/// without a certificate (token agents) may connect.
pub fn control_server_config(identity: &NodeTls, auth: ClientAuth) -> Result<tessera_transport::quic::rustls::ServerConfig> {
    identity.server_config_for(ALPN_CONTROL, auth).context("the control endpoint's TLS config")
}

/// A joined agent after the start: its rank's description and its control connection.
struct Agent {
    rank: usize,
    /// "agent of rank 1 (a1 at 10.0.0.2, pid 42)".
    who: String,
    pid: u32,
    conn: ControlConn,
}

/// What the ranks share with the driver: their processes or connections and the first loss.
struct Shared {
    children: Mutex<Vec<(usize, Child)>>,
    agents: Mutex<Vec<Agent>>,
    /// Every rank's control connection, in rank order (once started).
    conns: Mutex<Vec<ControlConn>>,
    launched: Arc<Mutex<Vec<Launched>>>,
    /// Set by the parent before it ends the workers itself: exits are then expected.
    closing: AtomicBool,
    /// The first unexpected loss: the rank and e.g. "worker process of rank 1 (pid 42) was
    /// killed by signal 9".
    died: Mutex<Option<(usize, String)>>,
}

fn relock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    fn new(launched: Arc<Mutex<Vec<Launched>>>) -> Self {
        Shared {
            children: Mutex::new(Vec::new()),
            agents: Mutex::new(Vec::new()),
            conns: Mutex::new(Vec::new()),
            launched,
            closing: AtomicBool::new(false),
            died: Mutex::new(None),
        }
    }

    fn died(&self) -> Option<(usize, String)> {
        relock(&self.died).clone()
    }

    fn why(&self) -> Option<String> {
        self.died().map(|(_, why)| why)
    }

    fn children(&self) -> MutexGuard<'_, Vec<(usize, Child)>> {
        relock(&self.children)
    }

    /// Kills and reaps every spawned or launched process still running; closes every control
    /// connection (an agent leaves after its current request).
    fn kill_all(&self) {
        for (_, c) in self.children().iter_mut() {
            if let Ok(None) = c.try_wait() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        for c in relock(&self.conns).iter() {
            c.abort("the run is stopping");
        }
        for a in relock(&self.agents).iter() {
            a.conn.abort("the run is stopping");
        }
        for l in relock(&self.launched).iter_mut() {
            if let Ok(None) = l.child.try_wait() {
                let _ = l.child.kill();
                let _ = l.child.wait();
            }
        }
    }

    /// Records the first loss (later ones are consequences) and ends the other ranks.
    fn lost(&self, rank: usize, why: String) {
        {
            let mut died = relock(&self.died);
            if died.is_some() {
                return;
            }
            tracing::error!("{why}; stopping the other ranks");
            *died = Some((rank, why));
        }
        self.kill_all();
    }

    /// A launched process that ended unexpectedly, described by the rank whose agent it ran
    /// when known (a local agent is its own process).
    fn launched_exit(&self) -> Option<(usize, String)> {
        let agents = relock(&self.agents);
        relock(&self.launched).iter_mut().find_map(|l| {
            let status = l.child.try_wait().ok().flatten()?;
            let pid = l.child.id();
            Some(match agents.iter().find(|a| a.pid == pid) {
                Some(a) => (a.rank, format!("{} {}", a.who, Exit::of(status))),
                None => (usize::MAX, format!("{} (pid {pid}) {}", l.label, Exit::of(status))),
            })
        })
    }

    /// Why rank `rank`'s link failed with `e`: the loss the monitor saw (waited for briefly), or
    /// `e` itself.
    fn cause(&self, rank: usize, e: &str) -> String {
        let deadline = Instant::now() + Duration::from_millis(VERDICT_WAIT_MS);
        while self.died().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(MONITOR_POLL_MS / 5));
        }
        match self.died() {
            Some((r, why)) if r == rank => why,
            Some((_, why)) => format!("rank {rank} stopped after {why}"),
            None => format!("rank {rank}: {e}"),
        }
    }
}

/// The ranks of a multi-process run (rank order); dropping it ends them.
pub struct Procs {
    /// The driver's control endpoint: every connection runs on it.
    endpoint: Option<ControlEndpoint>,
    /// Each rank's control connection, for requests between steps (`Export`, `Shutdown`).
    links: Vec<Arc<Mutex<ControlConn>>>,
    /// Each rank's latest figures (from `Ready` and every actor event).
    snapshots: Vec<Arc<Mutex<Snapshot>>>,
    shared: Arc<Shared>,
    monitor: Option<JoinHandle<()>>,
    /// The threads that read each rank's actor lane.
    pumps: Arc<Mutex<Vec<JoinHandle<()>>>>,
    /// `<output>/procs`: the resolved config and the run's keys, removed when the ranks end.
    dir: Option<PathBuf>,
    /// Removes `dir` at a forced exit too (a second signal, `crate::signals`).
    _forced_exit: Option<CleanupGuard>,
}

/// Pings the agent of `conn` and waits for its `Pong`.
fn ping(conn: &mut ControlConn) -> Result<(), WireError> {
    let wait =
        Wait { what: "an answer to a ping", deadline: Some(Instant::now() + Duration::from_millis(PONG_TIMEOUT_MS)), alive: &|| Ok(()) };
    wire::send(conn, &ToWorker::Ping)?;
    match wire::recv(conn, "Pong", &wait)? {
        ToParent::Pong => Ok(()),
        other => Err(WireError::Malformed { expected: "Pong", detail: format!("{other:?}") }),
    }
}

/// Watches the ranks; on the first unexpected loss records it and ends the rest.
fn monitor(shared: Arc<Shared>, links: Vec<Arc<Mutex<ControlConn>>>) {
    let mut last_ping = Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(MONITOR_POLL_MS));
        if shared.closing.load(Ordering::SeqCst) {
            return;
        }
        let dead = shared.children().iter_mut().find_map(|(r, c)| match c.try_wait() {
            Ok(Some(status)) => Some((*r, format!("worker process of rank {r} (pid {}) {}", c.id(), Exit::of(status)))),
            _ => None,
        });
        let dead = dead.or_else(|| shared.launched_exit()).or_else(|| {
            let gone = relock(&shared.agents).iter().find_map(|a| {
                let why = a.conn.closed_reason()?;
                Some((a.rank, format!("{} closed its control connection ({why})", a.who)))
            });
            // A process closes its sockets just before it can be reaped: when `tessera launch`
            // started the agent, wait briefly for its exit status, which says more.
            gone.map(|g| {
                let deadline = Instant::now() + Duration::from_millis(EXIT_GRACE_MS);
                loop {
                    match shared.launched_exit() {
                        Some(exit) => break exit,
                        None if Instant::now() < deadline && !relock(&shared.launched).is_empty() => {
                            std::thread::sleep(Duration::from_millis(MONITOR_POLL_MS / 5))
                        }
                        None => break g,
                    }
                }
            })
        });
        let dead = dead.or_else(|| {
            if links.is_empty() || last_ping.elapsed() < Duration::from_millis(PING_MS) {
                return None;
            }
            last_ping = Instant::now();
            let agents = relock(&shared.agents);
            links.iter().zip(agents.iter()).find_map(|(l, a)| {
                // A link in use is answering a request: that is its sign of life.
                let mut link = l.try_lock().ok()?;
                ping(&mut link).err().map(|e| (a.rank, format!("{} did not answer a ping: {e}", a.who)))
            })
        });
        if let Some((rank, why)) = dead {
            if !shared.closing.load(Ordering::SeqCst) {
                shared.lost(rank, why);
            }
            return;
        }
    }
}

impl Procs {
    fn alive_check(&self) -> impl Fn() -> Result<(), WireError> + '_ {
        move || match self.shared.why() {
            Some(why) => Err(WireError::Io(std::io::Error::other(why))),
            None => Ok(()),
        }
    }

    /// The latest snapshot of every rank.
    pub fn snapshots(&self) -> Vec<Snapshot> {
        self.snapshots.iter().map(|s| *relock(s)).collect()
    }

    /// Rank `r`'s masters, its optimizer buffers when `with_optim` (else none), and counters.
    pub fn export(&self, r: usize, plan: &Plan, with_optim: bool) -> Result<(Vec<f32>, OptimBuffers, RankCounters)> {
        let alive = self.alive_check();
        let wait = Wait { what: "exported state", deadline: Some(Instant::now() + Duration::from_millis(REPLY_TIMEOUT_MS)), alive: &alive };
        let mut link = relock(&self.links[r]);
        let ctx = || format!("exporting the state of rank {r}");
        wire::send(&mut *link, &ToWorker::Export { optim: with_optim }).with_context(ctx)?;
        let (counters, descs) = match wire::recv(&mut *link, "Exported", &wait).with_context(ctx)? {
            ToParent::Exported { counters, buffers } => (counters, buffers),
            ToParent::Failed { error } => bail!("rank {r} could not export its state: {error}"),
            other => bail!("rank {r} answered Export with {other:?}"),
        };
        let want = plan.optim_range(r).len();
        if descs.first().is_none_or(|d| d.len != want as u64) {
            bail!("rank {r} exported {:?} master values, its range holds {want}", descs.first().map(|d| d.len));
        }
        let bufs = wire::recv_bulk(&mut *link, &descs, want, &wait).with_context(ctx)?;
        Ok(exported(&descs, bufs, counters))
    }

    /// Asks every rank to leave and waits (bounded) for each to end cleanly: a spawned worker
    /// exits with status 0; an agent closes its control connection (and, when `tessera launch`
    /// started it, its process exits with status 0).
    pub fn close(mut self) -> Result<()> {
        self.shared.closing.store(true, Ordering::SeqCst);
        if let Some(m) = self.monitor.take() {
            let _ = m.join();
        }
        if let Some(why) = self.shared.why() {
            bail!("{why}");
        }
        for l in &self.links {
            let _ = wire::send(&mut *relock(l), &ToWorker::Shutdown);
        }
        let deadline = Instant::now() + Duration::from_millis(EXIT_TIMEOUT_MS);
        let mut failures = Vec::new();
        for (r, c) in self.shared.children().iter_mut() {
            let status = loop {
                match c.try_wait() {
                    Ok(Some(s)) => break Some(s),
                    Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(MONITOR_POLL_MS)),
                    _ => break None,
                }
            };
            match status {
                Some(s) if s.success() => {}
                Some(s) => failures.push(format!("rank {r} {}", Exit::of(s))),
                None => failures.push(format!("rank {r} {}", Exit::Overdue { bound_ms: EXIT_TIMEOUT_MS, killed: true })),
            }
        }
        let agents: Vec<(usize, String)> = relock(&self.shared.agents).iter().map(|a| (a.rank, a.who.clone())).collect();
        for (r, who) in agents {
            let wait = Wait { what: "the end of the control connection", deadline: Some(deadline), alive: &|| Ok(()) };
            match wire::recv::<ToParent>(&mut *relock(&self.links[r]), "nothing more", &wait) {
                Err(WireError::Closed) => {}
                Err(e) => failures.push(format!("{who} did not leave: {e}")),
                Ok(m) => failures.push(format!("{who} answered Shutdown with {m:?}")),
            }
        }
        for l in relock(&self.shared.launched).iter_mut() {
            let status = loop {
                match l.child.try_wait() {
                    Ok(Some(s)) => break Some(s),
                    Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(MONITOR_POLL_MS)),
                    _ => break None,
                }
            };
            match status {
                Some(s) if s.success() => {}
                Some(s) => failures.push(format!("{} {}", l.label, Exit::of(s))),
                None => failures.push(format!("{} {}", l.label, Exit::Overdue { bound_ms: EXIT_TIMEOUT_MS, killed: true })),
            }
        }
        if !failures.is_empty() {
            bail!("the ranks did not leave cleanly: {}", failures.join("; "));
        }
        Ok(())
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        self.shared.closing.store(true, Ordering::SeqCst);
        self.shared.kill_all();
        if let Some(m) = self.monitor.take() {
            let _ = m.join();
        }
        for p in std::mem::take(&mut *relock(&self.pumps)) {
            let _ = p.join();
        }
        drop(self.endpoint.take());
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// The ClusterSupervisor's commands to a rank, onto its connection's actor lane.
struct ConnDownlink(ControlConn);

impl Downlink for ConnDownlink {
    fn send(&self, call: ActorCall) -> Result<(), String> {
        wire::send_actor(&self.0, &ToWorker::Actor { call }).map_err(|e| e.to_string())
    }
}

/// Reads rank `rank`'s actor lane into `sink` until the connection ends or the run closes; a
/// link that fails (the process died, the connection was lost or a message did not validate)
/// makes every rank of that node lost, with the cause the monitor found.
fn pump(rank: usize, conn: ControlConn, sink: UpSink, snapshot: Arc<Mutex<Snapshot>>, shared: Arc<Shared>) {
    let failed = loop {
        if shared.closing.load(Ordering::SeqCst) {
            return;
        }
        if let Some(why) = shared.why() {
            break why;
        }
        match wire::recv_actor::<ToParent>(&conn, "an actor event") {
            Ok(None) => continue,
            Ok(Some(ToParent::Actor { event, snapshot: s })) => {
                // The figures first: the step's result reaches the driver only after them.
                *relock(&snapshot) = s;
                match sink.deliver(event) {
                    Ok(true) => {}
                    Ok(false) => return, // the actor tree is gone: the run is over
                    Err(violation) => {
                        conn.abort(&violation);
                        break violation;
                    }
                }
            }
            Ok(Some(other)) => {
                let why = format!("rank {rank} sent {other:?} on its actor lane");
                conn.abort(&why);
                break why;
            }
            Err(e) => break e.to_string(),
        }
    };
    if !shared.closing.load(Ordering::SeqCst) {
        sink.lost(&shared.cause(rank, &failed));
    }
}

/// The ranks and, for the actor tree, one remote node per rank.
pub type Started = (Procs, Vec<RemoteNodeSpec>);

/// Writes the resolved config (when `with_config`) and the PKI (node names `node-0..ids` and
/// [`COORDINATOR_NAME`], the driver's own identity on its control endpoint) into `dir` (emptied
/// first).
pub(super) fn prepare_dir(cfg: &Config, ids: usize, dir: &Path, with_config: bool) -> Result<()> {
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("clearing {}", dir.display()))?;
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    if with_config {
        let text = serde_json::to_string_pretty(&cfg.resolved).context("serialising the resolved config")?;
        std::fs::write(dir.join("config.json"), text).with_context(|| format!("writing {}/config.json", dir.display()))?;
    }
    let names: Vec<String> = (0..ids).map(node_name).chain([COORDINATOR_NAME.to_string()]).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    tessera_transport::quic::cluster_init(&dir.join("pki"), &refs)
        .with_context(|| format!("creating certificates in {}", dir.display()))?;
    Ok(())
}

/// Starts the worker process of rank `r` (in its network namespace when `net` gives one).
pub(super) fn spawn_worker(
    exe: &Path,
    r: usize,
    world: usize,
    control: &str,
    dir: &Path,
    net: Option<&tessera_chaos::link::WorkerNet>,
) -> Result<Child> {
    use std::os::unix::process::CommandExt;
    super::worker_net::command(exe, net, r)?
        .args(["worker", "--rank", &r.to_string(), "--world", &world.to_string(), "--control", control])
        .arg("--dir")
        .arg(dir)
        .stdin(Stdio::null())
        .process_group(0)
        .spawn()
        .with_context(|| format!("starting the worker process of rank {r} ({})", exe.display()))
}

/// The checks of every rank's `Hello`: the config hash and a free rank.
fn check_hello(cfg: &Config, world: usize, rank: usize, hash: &str, taken: bool) -> Result<()> {
    if hash != cfg.hash {
        bail!("worker of rank {rank} resolved the config to hash {hash}, the parent has {}", cfg.hash);
    }
    if rank >= world || taken {
        bail!("a worker said it is rank {rank}: not a free rank of {world}");
    }
    Ok(())
}

/// A spawned worker's control connection after its `Hello`: its QUIC address and pid.
pub(super) struct Hello {
    pub conn: ControlConn,
    pub quic_addr: String,
    pub pid: u32,
}

/// Accepts one QUIC control connection per spawned worker and reads its Hello, within the
/// start-up timeout: each must present the certificate of the rank it claims. Returns them in
/// rank order; fails at once when `exited` names a worker process that died. A connection that
/// opens with `Join` (a worker joining an elastic run early) is set aside in `early` (`None`:
/// refused), with its first message.
pub(super) fn accept_workers(
    endpoint: &ControlEndpoint,
    cfg: &Config,
    exited: &dyn Fn() -> Option<String>,
    world: usize,
    mut early: Option<&mut Vec<(ControlConn, ToParent)>>,
) -> Result<Vec<Hello>> {
    let deadline = Instant::now() + Duration::from_millis(STARTUP_TIMEOUT_MS);
    let mut got: Vec<Option<Hello>> = (0..world).map(|_| None).collect();
    let mut refusals = RefusalLog::new("warning: refused a control connection");
    while got.iter().any(Option::is_none) {
        if let Some(who) = exited() {
            bail!("{who} during start-up");
        }
        if Instant::now() >= deadline {
            bail!("workers did not connect within {STARTUP_TIMEOUT_MS} ms");
        }
        let mut conn = match endpoint.accept(MONITOR_POLL_MS) {
            Ok(Some(c)) => c,
            Ok(None) => continue,
            Err(why) => {
                refusals.refused(&why);
                continue;
            }
        };
        let wait = Wait { what: "Hello", deadline: Some(deadline), alive: &|| Ok(()) };
        let (rank, quic_addr, hash, pid) = match wire::recv(&mut conn, "Hello", &wait).context("reading a worker's Hello")? {
            ToParent::Hello { rank, quic_addr, config_hash, pid, .. } => (rank as usize, quic_addr, config_hash, pid),
            join @ ToParent::Join { .. } => match early.as_mut() {
                Some(e) => {
                    e.push((conn, join));
                    continue;
                }
                None => bail!("a process tried to join this run, which is not elastic"),
            },
            other => bail!("a worker opened with {other:?} instead of Hello"),
        };
        check_hello(cfg, world, rank, &hash, got.get(rank).is_some_and(Option::is_some))?;
        let cert = conn.peer_certificate().context("a worker connected without a certificate")?;
        check_cert_names_node(&cert, &node_name(rank)).map_err(|e| anyhow::anyhow!("a worker claiming rank {rank}: {e}"))?;
        got[rank] = Some(Hello { conn, quic_addr, pid });
    }
    Ok(got.into_iter().flatten().collect())
}

/// An `Exported` answer as (masters, named optimizer buffers, counters): the bulk buffers
/// arrive in the order `descs` names them, masters first.
pub(super) fn exported(
    descs: &[wire::BulkDesc],
    mut bufs: Vec<Vec<f32>>,
    counters: StateCounters,
) -> (Vec<f32>, OptimBuffers, RankCounters) {
    let master = bufs.remove(0);
    let optim = descs[1..].iter().map(|d| d.name.clone()).zip(bufs).collect();
    let c = RankCounters {
        optimizer_steps: counters.optimizer_steps.unwrap_or(0),
        applied: counters.applied,
        skipped: counters.skipped,
        scaler: counters.scaler,
    };
    (master, optim, c)
}

/// Sends rank `r` its cut of the start state (header + bulk).
pub(super) fn send_start(stream: &mut (impl ControlIo + ?Sized), plan: &Plan, start: &Start, r: usize) -> Result<()> {
    let window = master_window(plan, r);
    let cut = start.cut(plan, r);
    let mut bufs: Vec<(&str, &[f32])> = vec![("master", &start.master[window.clone()])];
    if let Some((_, optim)) = &cut.optim {
        bufs.extend(optim.iter().map(|(n, b)| (n.as_str(), b.as_slice())));
    }
    let counters = StateCounters {
        optimizer_steps: cut.optim.as_ref().map(|o| o.0),
        applied: cut.applied,
        skipped: cut.skipped,
        scaler: cut.scaler.clone(),
    };
    let msg = ToWorker::Start { master_start: window.start as u64, counters, buffers: wire::describe(&bufs), step: start.step };
    wire::send(stream, &msg)?;
    wire::send_bulk(stream, &bufs.iter().map(|(_, b)| *b).collect::<Vec<_>>())?;
    Ok(())
}

/// Starts `plan.world` ranks for `cfg` from `start` (see the module doc): agents joining
/// `rendezvous`, if given, else spawned `tessera worker` processes.
pub fn launch(cfg: &Config, plan: &Plan, start: &Start, out_dir: &Path, rendezvous: Option<Rendezvous>) -> Result<Started> {
    match rendezvous {
        Some(rdv) => launch_agents(cfg, plan, start, out_dir, rdv),
        None => launch_workers(cfg, plan, start, out_dir),
    }
}

fn new_procs(shared: &Arc<Shared>, dir: Option<PathBuf>) -> Procs {
    Procs {
        endpoint: None,
        links: Vec::new(),
        snapshots: Vec::new(),
        shared: Arc::clone(shared),
        monitor: None,
        pumps: Arc::new(Mutex::new(Vec::new())),
        _forced_exit: dir.clone().map(|d| signals::on_forced_exit(Cleanup::Dir(d))),
        dir,
    }
}

/// Spawns `plan.world` local worker processes.
fn launch_workers(cfg: &Config, plan: &Plan, start: &Start, out_dir: &Path) -> Result<Started> {
    let world = plan.world;
    let dir = out_dir.join("procs");
    let shared = Arc::new(Shared::new(Arc::new(Mutex::new(Vec::new()))));
    // From here on, dropping `procs` kills whatever was started and removes `dir`.
    let mut procs = new_procs(&shared, Some(dir.clone()));
    prepare_dir(cfg, world, &dir, true)?;
    let identity = NodeTls::load(&dir.join("pki"), COORDINATOR_NAME)?;
    let local: SocketAddr = ([127, 0, 0, 1], 0).into();
    let endpoint = ControlEndpoint::bind(local, Some(control_server_config(&identity, ClientAuth::Required)?))?;
    let control = endpoint.local_addr()?.to_string();
    let exe: PathBuf = std::env::current_exe().context("finding the tessera executable")?;
    for r in 0..world {
        let child = spawn_worker(&exe, r, world, &control, &dir, None)?;
        shared.children().push((r, child));
    }
    let exited = || {
        shared
            .children()
            .iter_mut()
            .find_map(|(r, c)| c.try_wait().ok().flatten().map(|s| format!("worker process of rank {r} {}", Exit::of(s))))
    };
    let conns: Vec<(ControlConn, String)> =
        accept_workers(&endpoint, cfg, &exited, world, None)?.into_iter().map(|h| (h.conn, h.quic_addr)).collect();
    procs.endpoint = Some(endpoint);
    let who: Vec<String> = (0..world).map(|r| format!("worker process of rank {r}")).collect();
    start_ranks(&mut procs, conns, plan, start, &who)?;
    finish(procs, Vec::new())
}

/// Sends every rank the addresses and its start state, waits for each to be `Ready`, and fills
/// `procs.links` (rank order). `who[r]` names rank `r` in errors.
fn start_ranks(procs: &mut Procs, mut conns: Vec<(ControlConn, String)>, plan: &Plan, start: &Start, who: &[String]) -> Result<()> {
    let addrs: Vec<String> = conns.iter().map(|(_, a)| a.clone()).collect();
    *relock(&procs.shared.conns) = conns.iter().map(|(c, _)| c.clone()).collect();
    for (r, (c, _)) in conns.iter_mut().enumerate() {
        wire::send(c, &ToWorker::Mesh { addrs: addrs.clone(), names: Vec::new() })
            .with_context(|| format!("sending {} the addresses", who[r]))?;
        send_start(c, plan, start, r).with_context(|| format!("sending {} its start state", who[r]))?;
    }
    let deadline = Instant::now() + Duration::from_millis(STARTUP_TIMEOUT_MS);
    let shared = Arc::clone(&procs.shared);
    let alive = move || match shared.launched_exit() {
        Some((_, why)) => Err(WireError::Io(std::io::Error::other(why))),
        None => Ok(()),
    };
    for (r, (mut conn, _)) in conns.into_iter().enumerate() {
        let wait = Wait { what: "Ready", deadline: Some(deadline), alive: &alive };
        let snapshot = match wire::recv(&mut conn, "Ready", &wait).with_context(|| format!("waiting for {} to start", who[r]))? {
            ToParent::Ready { snapshot } => snapshot,
            ToParent::Failed { error } => bail!("{} failed to start: {error}", who[r]),
            other => bail!("{} answered its start state with {other:?}", who[r]),
        };
        procs.links.push(Arc::new(Mutex::new(conn)));
        procs.snapshots.push(Arc::new(Mutex::new(snapshot)));
    }
    Ok(())
}

/// Starts the monitor (pinging `ping_links`, when given) and makes one remote node per rank,
/// whose actor lane a pump thread reads once the actor tree has started it.
fn finish(mut procs: Procs, ping_links: Vec<Arc<Mutex<ControlConn>>>) -> Result<Started> {
    let shared = Arc::clone(&procs.shared);
    let m = Arc::clone(&shared);
    procs.monitor = Some(
        std::thread::Builder::new().name("tessera-procs".into()).spawn(move || monitor(m, ping_links)).context("starting the monitor")?,
    );
    let conns = relock(&shared.conns).clone();
    let nodes = conns
        .into_iter()
        .enumerate()
        .map(|(rank, conn)| {
            let (shared, snapshot, pumps) = (Arc::clone(&shared), Arc::clone(&procs.snapshots[rank]), Arc::clone(&procs.pumps));
            let downlink = Arc::new(ConnDownlink(conn.clone()));
            let on_start = Box::new(move |sink: UpSink| {
                let spawned = std::thread::Builder::new()
                    .name(format!("tessera-link-{rank}"))
                    .spawn(move || pump(rank, conn, sink, snapshot, shared));
                match spawned {
                    Ok(h) => relock(&pumps).push(h),
                    Err(e) => tracing::error!("rank {rank}: cannot start the thread reading its actor lane: {e}"),
                }
            });
            RemoteNodeSpec { ranks: vec![rank], downlink, on_start }
        })
        .collect();
    Ok((procs, nodes))
}

/// An agent that said `Join` and proved it belongs to the run.
struct Joined {
    conn: ControlConn,
    name: String,
    pid: u32,
    peer: SocketAddr,
    rank: Option<usize>,
    /// The agent's own public key, to certify (token agents).
    public_key: Option<Vec<u8>>,
    /// Its machine and pid namespace (`elastic_join::host_id`).
    host: String,
}

impl Joined {
    fn who(&self) -> String {
        format!("agent {} at {} (pid {})", self.name, self.peer.ip(), self.pid)
    }
}

/// Ranks for agents that asked for `requested[i]` (or any): asked-for ranks first, the others
/// fill the free ranks in join order. `names[i]` names agent `i` in errors.
pub fn assign_ranks(requested: &[Option<usize>], names: &[String], world: usize) -> Result<Vec<usize>> {
    if requested.len() != world {
        bail!("{} agents for {world} ranks", requested.len());
    }
    let mut owner: Vec<Option<usize>> = vec![None; world];
    for (i, r) in requested.iter().enumerate() {
        let Some(r) = *r else { continue };
        match owner.get(r) {
            None => bail!("agent {} asked for rank {r}, but the world has {world} ranks (0..{})", names[i], world.saturating_sub(1)),
            Some(Some(j)) => bail!("agents {} and {} both asked for rank {r}", names[*j], names[i]),
            Some(None) => owner[r] = Some(i),
        }
    }
    let mut free = (0..world).filter(|r| owner[*r].is_none());
    let mut ranks = vec![0; world];
    for (i, r) in requested.iter().enumerate() {
        ranks[i] = match r {
            Some(r) => *r,
            None => free.next().context("no free rank left")?,
        };
    }
    Ok(ranks)
}

/// Why a connection is not an agent of this run (it is refused, the run goes on).
struct NotAdmitted(String);

/// Reads a new connection's `Join`, authenticates it (`auth`) and checks it against the run.
/// `Ok(Err(_))`: a stranger, refused; `Err(_)`: an authenticated agent that cannot take part,
/// which fails the run with the reason.
fn read_join(mut conn: ControlConn, nodes: usize, auth: &AgentAuth) -> Result<std::result::Result<Joined, NotAdmitted>> {
    let peer = conn.remote_address();
    let wait = Wait { what: "Join", deadline: Some(Instant::now() + Duration::from_millis(JOIN_MESSAGE_TIMEOUT_MS)), alive: &|| Ok(()) };
    let join = match wire::recv(&mut conn, "Join", &wait) {
        Ok(ToParent::Join { name, pid, rank, world, version, token, public_key, host }) => {
            (name, pid, rank, world, version, token, public_key, host)
        }
        Ok(other) => return Ok(Err(NotAdmitted(format!("{peer} opened with {other:?} instead of Join")))),
        Err(e) => return Ok(Err(NotAdmitted(format!("{peer}: reading its Join: {e}")))),
    };
    let (name, pid, rank, world, version, token, public_key, host) = join;
    let mut rank = rank.map(|r| r as usize);
    match auth {
        AgentAuth::Token { token: t, .. } => {
            if !token.as_deref().is_some_and(|s| t.admits(s)) {
                conn.abort("wrong join token");
                return Ok(Err(NotAdmitted(format!("{peer} (calling itself {name:?}) did not present this run's join token"))));
            }
            if public_key.is_none() {
                bail!("agent {name} at {peer} sent no public key to certify");
            }
        }
        AgentAuth::Certs { .. } => {
            // The TLS handshake verified the certificate against the cluster CA; its name is
            // the agent's rank.
            let cert = conn.peer_certificate().context("an agent without a certificate passed the handshake")?;
            let named = (0..nodes).find(|&r| check_cert_names_node(&cert, &node_name(r)).is_ok());
            match (named, rank) {
                (None, _) => bail!("agent {name} at {peer} presents a certificate for none of node-0..node-{}", nodes.saturating_sub(1)),
                (Some(r), Some(asked)) if r != asked => {
                    bail!("agent {name} at {peer} asks for rank {asked} with the certificate of {}", node_name(r))
                }
                (Some(r), _) => rank = Some(r),
            }
        }
    }
    // The agent hears why in the close frame (its own error names it), not only that the
    // connection closed.
    let refuse = |why: String| {
        conn.abort(&why);
        anyhow::anyhow!("agent {name} at {peer}: {why}")
    };
    let mine = env!("CARGO_PKG_VERSION");
    if version != mine {
        return Err(refuse(format!("the agent runs tessera {version}, the coordinator {mine}")));
    }
    if let Some(w) = world.filter(|w| *w != nodes as u64) {
        return Err(refuse(format!("the agent was started for a world of {w} ranks, the coordinator waits for {nodes}")));
    }
    if let Some(r) = rank.filter(|r| *r >= nodes) {
        return Err(refuse(format!("it asked for rank {r}, but the world has {nodes} rank(s) (0..{})", nodes - 1)));
    }
    Ok(Ok(Joined { conn, name, pid, peer, rank, public_key, host }))
}

/// Waits (bounded by the rendezvous' timeout) for `rdv.nodes` agents to join; pings those that
/// wait meanwhile and fails at once when one leaves or a launched process ends. Connections
/// that are not agents of this run (no token, a foreign certificate) are refused and logged.
fn gather_agents(rdv: &Rendezvous, launched_exit: &dyn Fn() -> Option<String>) -> Result<Vec<Joined>> {
    let at = rdv.endpoint.local_addr().map(|a| a.to_string()).unwrap_or_else(|_| "the control endpoint".into());
    let started = Instant::now();
    let deadline = started + Duration::from_millis(rdv.join_timeout_ms);
    let mut joined: Vec<Joined> = Vec::new();
    let mut refusals = RefusalLog::new("coordinator: refused a connection");
    let mut last_ping = Instant::now();
    let list = |j: &[Joined]| match j.is_empty() {
        true => "none".to_string(),
        false => j.iter().map(Joined::who).collect::<Vec<_>>().join(", "),
    };
    while joined.len() < rdv.nodes {
        if let Some(why) = launched_exit() {
            bail!("{why} before every agent joined ({} of {} joined: {})", joined.len(), rdv.nodes, list(&joined));
        }
        if let Some(why) = signals::requested() {
            bail!(
                "{why} before every agent joined ({} of {} joined: {}); no step ran, nothing to save",
                joined.len(),
                rdv.nodes,
                list(&joined)
            );
        }
        if Instant::now() >= deadline {
            bail!(
                "only {} of {} agents joined {at} within {} ms (joined: {})",
                joined.len(),
                rdv.nodes,
                rdv.join_timeout_ms,
                list(&joined)
            );
        }
        if last_ping.elapsed() >= Duration::from_millis(PING_MS) {
            last_ping = Instant::now();
            for j in joined.iter_mut() {
                let who = j.who();
                ping(&mut j.conn).with_context(|| format!("{who} left before every agent joined"))?;
            }
        }
        match rdv.endpoint.accept(MONITOR_POLL_MS) {
            Ok(Some(conn)) => match read_join(conn, rdv.nodes, &rdv.auth)? {
                Ok(j) => {
                    tracing::info!("coordinator: {} joined ({} of {})", j.who(), joined.len() + 1, rdv.nodes);
                    joined.push(j);
                }
                Err(NotAdmitted(why)) => refusals.refused(&why),
            },
            Ok(None) => {}
            Err(why) => refusals.refused(&why),
        }
    }
    Ok(joined)
}

/// An agent after the rendezvous: its connection, QUIC address and pid, who it is in
/// messages, and its machine (`elastic_join::host_id`).
pub(super) struct AgentStart {
    pub conn: ControlConn,
    pub quic_addr: String,
    pub pid: u32,
    /// "agent of rank 1 (a1 at 10.0.0.2, pid 42)".
    pub who: String,
    pub host: String,
}

/// The coordinator's side of the agents' start-up up to their `Hello` (see the module doc):
/// waits for `rdv.nodes` agents, gives each its rank, the resolved config and (token agents) a
/// certificate, and checks what each says back. Returns them in rank order. `launched_exit`
/// names a launched process that ended (the start then fails with it).
pub(super) fn rendezvous_agents(
    cfg: &Config,
    plan: &Plan,
    rdv: &Rendezvous,
    launched_exit: &dyn Fn() -> Option<String>,
) -> Result<Vec<AgentStart>> {
    let world = plan.world;
    if rdv.nodes != world {
        bail!("the coordinator waits for {} agents, but the config resolves to world {world}", rdv.nodes);
    }
    let data_blake3 = super::child::data_blake3(&super::child::load_dataset(cfg)?);
    let config = serde_json::to_string(&cfg.resolved).context("serialising the resolved config")?;
    let joined = gather_agents(rdv, launched_exit)?;
    let names: Vec<String> = joined.iter().map(|j| j.name.clone()).collect();
    let ranks = assign_ranks(&joined.iter().map(|j| j.rank).collect::<Vec<_>>(), &names, world)?;
    let mut slots: Vec<Option<(Joined, String)>> = (0..world).map(|_| None).collect();
    for (j, r) in joined.into_iter().zip(ranks) {
        let who = format!("agent of rank {r} ({} at {}, pid {})", j.name, j.peer.ip(), j.pid);
        slots[r] = Some((j, who));
    }
    let mut members: Vec<(Joined, String)> = slots.into_iter().map(|s| s.context("a rank without an agent")).collect::<Result<_>>()?;
    for (r, (j, who)) in members.iter_mut().enumerate() {
        let identity = match (&rdv.auth, &j.public_key) {
            (AgentAuth::Token { ca, .. }, Some(key)) => {
                let cert_pem = ca.sign_node_key(&node_name(r), key).with_context(|| format!("certifying the key of {who}"))?;
                Some(AssignedIdentity { ca_pem: ca.ca_pem(), cert_pem })
            }
            _ => None,
        };
        let msg = ToWorker::Assign { rank: r as u64, world: world as u64, config: config.clone(), identity };
        wire::send(&mut j.conn, &msg).with_context(|| format!("sending {who} its rank"))?;
    }
    let deadline = Instant::now() + Duration::from_millis(STARTUP_TIMEOUT_MS);
    let alive = || match launched_exit() {
        Some(why) => Err(WireError::Io(std::io::Error::other(why))),
        None => Ok(()),
    };
    let mut started = Vec::with_capacity(world);
    for (r, (mut j, who)) in members.into_iter().enumerate() {
        let wait = Wait { what: "Hello", deadline: Some(deadline), alive: &alive };
        let (rank, quic_addr, hash, data) = match wire::recv(&mut j.conn, "Hello", &wait).with_context(|| format!("waiting for {who}"))? {
            ToParent::Hello { rank, quic_addr, config_hash, data_blake3, .. } => (rank as usize, quic_addr, config_hash, data_blake3),
            ToParent::Failed { error } => bail!("{who} could not start: {error}"),
            other => bail!("{who} answered its assignment with {other:?}"),
        };
        if rank != r {
            bail!("{who} says it is rank {rank}");
        }
        if hash != cfg.hash {
            bail!("{who} resolved the config to hash {hash}, the coordinator has {}", cfg.hash);
        }
        if data.as_deref() != Some(data_blake3.as_str()) {
            bail!(
                "{who} loaded different training data (tokens BLAKE3 {}, the coordinator's {data_blake3}): every host needs the same data at the path the config names",
                data.as_deref().unwrap_or("none")
            );
        }
        started.push(AgentStart { conn: j.conn, quic_addr, pid: j.pid, who, host: j.host });
    }
    let mesh: Vec<String> = started.iter().enumerate().map(|(r, a)| format!("rank {r} at {}", a.quic_addr)).collect();
    tracing::info!("coordinator: QUIC mesh: {}", mesh.join(", "));
    Ok(started)
}

/// The first launched process (`tessera launch`) that ended, described.
pub(super) fn launched_exited(launched: &Mutex<Vec<Launched>>) -> Option<String> {
    relock(launched).iter_mut().find_map(|l| {
        let status = l.child.try_wait().ok().flatten()?;
        Some(format!("{} (pid {}) {}", l.label, l.child.id(), Exit::of(status)))
    })
}

/// Runs the coordinator's side of the agents' start-up (see the module doc).
fn launch_agents(cfg: &Config, plan: &Plan, start: &Start, _out_dir: &Path, rdv: Rendezvous) -> Result<Started> {
    let shared = Arc::new(Shared::new(Arc::clone(&rdv.launched)));
    // From here on, dropping `procs` ends whatever joined.
    let mut procs = new_procs(&shared, None);
    let started = {
        let s = Arc::clone(&shared);
        rendezvous_agents(cfg, plan, &rdv, &move || s.launched_exit().map(|(_, why)| why))?
    };
    let who: Vec<String> = started.iter().map(|a| a.who.clone()).collect();
    {
        let mut agents = relock(&shared.agents);
        for (r, a) in started.iter().enumerate() {
            agents.push(Agent { rank: r, who: a.who.clone(), pid: a.pid, conn: a.conn.clone() });
        }
    }
    let conns: Vec<(ControlConn, String)> = started.into_iter().map(|a| (a.conn, a.quic_addr)).collect();
    procs.endpoint = Some(rdv.endpoint);
    start_ranks(&mut procs, conns, plan, start, &who)?;
    let ping_links = procs.links.clone();
    finish(procs, ping_links)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("a{i}")).collect()
    }

    #[test]
    fn ranks_follow_requests_then_join_order() {
        assert_eq!(assign_ranks(&[None, None, None], &names(3), 3).unwrap(), vec![0, 1, 2]);
        assert_eq!(assign_ranks(&[None, Some(0), None], &names(3), 3).unwrap(), vec![1, 0, 2]);
        assert_eq!(assign_ranks(&[Some(2), Some(1), Some(0)], &names(3), 3).unwrap(), vec![2, 1, 0]);
    }

    #[test]
    fn bad_rank_requests_are_named() {
        let e = assign_ranks(&[Some(1), None, Some(1)], &names(3), 3).unwrap_err().to_string();
        assert!(e.contains("a0") && e.contains("a2") && e.contains("rank 1"), "{e}");
        let e = assign_ranks(&[Some(3), None, None], &names(3), 3).unwrap_err().to_string();
        assert!(e.contains("a0") && e.contains("rank 3") && e.contains("3 ranks"), "{e}");
    }
}
