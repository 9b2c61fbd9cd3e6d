//! The worker side of a multi-process run: one rank's `ZeroWorker` over a `QuicComm` with mutual
//! TLS, driven by the driver through its control connection (see [`super::remote`] for the whole
//! design and [`super::wire`] for the protocol). Two ways in:
//!
//! - `tessera worker` (hidden, [`run_worker`]): spawned by `tessera train --nprocs N` on the same
//!   machine. It reads the resolved config and its keys from the run's `procs` directory, binds
//!   its QUIC socket on 127.0.0.1, and exits when the control connection closes, on `Shutdown`,
//!   or when its parent process is gone (the parent id changes), so it never outlives its run.
//! - `tessera agent` ([`run_agent`]): started by hand, by `tessera launch` (ssh) or by a cluster
//!   scheduler on any host; it dials the coordinator (retrying until it answers, bounded), says
//!   `Join`, and receives its rank, the resolved config and its TLS identity over the control
//!   connection (no shared filesystem needed; or `--certs DIR` for a pre-distributed cluster
//!   dir). Its QUIC socket binds the local address it used to reach the coordinator (or listens
//!   on every interface and advertises `--advertise IP`). It leaves on `Shutdown` (status 0);
//!   a control connection that closes without it (the coordinator died or gave up) or a
//!   coordinator silent for [`AGENT_IDLE_TIMEOUT_MS`] (it pings idle agents much more often)
//!   ends it with an error.
//!
//! Either way the worker rebuilds the plan from the resolved config (and proves it by the config
//! hash), receives its start state from the driver, and then answers requests one at a time.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, ToSocketAddrs, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tessera_actors::compute::{StepOrder, WorkerCompute};
use tessera_transport::quic::{ClusterSpec, NodeTls, QuicComm};

use super::plan::Plan;
use super::ranks::{master_window, rank_state, StartCut};
use super::remote::{node_name, STARTUP_TIMEOUT_MS};
use super::wire::{self, Snapshot, StateCounters, ToParent, ToWorker, Wait, WireError, WirePrepared};
use super::zero::{RankState, ZeroWorker};
use crate::bridge;
use crate::config::{self, Config, ResolveContext};
use crate::data::{self, Dataset, Sampler};

/// Bound on building the QUIC mesh (ms).
const MESH_TIMEOUT_MS: u64 = 60_000;
/// An agent gives up when the coordinator sends nothing (not even a ping) for this long (ms).
pub const AGENT_IDLE_TIMEOUT_MS: u64 = 60_000;
/// Default bound on an agent's attempts to reach the coordinator (ms).
pub const AGENT_CONNECT_TIMEOUT_MS: u64 = 120_000;
/// Pause between an agent's attempts to reach the coordinator (ms).
const CONNECT_RETRY_MS: u64 = 250;

/// Arguments of `tessera worker`.
#[derive(Debug, Clone)]
pub struct WorkerArgs {
    pub rank: usize,
    pub world: usize,
    /// The parent's control address.
    pub control: SocketAddr,
    /// The run's `procs` directory: `config.json` and `pki/`.
    pub dir: PathBuf,
}

/// Arguments of `tessera agent` (see [`crate::launch::agent_args`] for the torchrun/Slurm
/// variables that can fill them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentArgs {
    /// The coordinator's control address, `HOST:PORT` (resolved by DNS when a name).
    pub join: String,
    /// This agent's name in the coordinator's messages.
    pub name: String,
    /// The rank to take; `None` = any free rank (given in join order).
    pub rank: Option<usize>,
    /// The world size this agent was started for, checked against the coordinator's.
    pub world: Option<usize>,
    /// The IP address the other ranks reach this agent's QUIC socket at; `None` = the local
    /// address of the connection to the coordinator.
    pub advertise: Option<IpAddr>,
    /// The QUIC UDP port (0 = any free port).
    pub quic_port: u16,
    /// A cluster directory made by `cluster_init` holding `ca.pem` and `node-<rank>.{pem,key}`;
    /// needed when the coordinator runs with its own `--certs` and so sends no keys.
    pub certs: Option<PathBuf>,
    /// How long to keep trying to reach the coordinator (ms).
    pub connect_timeout_ms: u64,
}

pub(super) fn snapshot(st: &RankState, rank: usize) -> Snapshot {
    Snapshot {
        memory: wire::WireMemory::from_report(&st.memory(rank)),
        applied: st.applied,
        skipped: st.skipped,
        scale_bits: st.scaler.as_ref().map(|s| s.scale().to_bits()),
        bytes_sent_total: st.bytes_sent_total,
        replica_stale: false,
        replica_behind: false,
    }
}

/// Fails once the process that started this worker is gone.
fn parent_alive(parent: u32) -> Result<(), WireError> {
    match std::os::unix::process::parent_id() == parent {
        true => Ok(()),
        false => Err(WireError::Closed),
    }
}

/// Loads the training data the config names (the shipped corpus by default).
pub(super) fn load_dataset(cfg: &Config) -> Result<Dataset> {
    let data_path = cfg.tessera.data.as_ref().map_or_else(data::default_corpus_path, PathBuf::from);
    data::load(&data_path, cfg.tessera.tokenizer.as_deref().map(Path::new), data::DEFAULT_VAL_FRACTION)
        .with_context(|| format!("loading data from {}", data_path.display()))
}

/// BLAKE3 of the training and validation tokens (u32 little-endian, lengths first): agents on
/// other hosts must train on the very tokens the coordinator evaluates with.
pub(super) fn data_blake3(ds: &Dataset) -> String {
    let mut h = blake3::Hasher::new();
    for part in [&ds.train, &ds.val] {
        h.update(&(part.len() as u64).to_le_bytes());
        for t in part.iter() {
            h.update(&t.to_le_bytes());
        }
    }
    h.finalize().to_hex().to_string()
}

/// The plan and sampler of a resolved config, for `world` ranks; also the loaded data.
fn plan_of(cfg: &Config, world: usize) -> Result<(Arc<Plan>, Arc<Sampler>, Dataset)> {
    let dataset = load_dataset(cfg)?;
    let plan = Arc::new(Plan::new(cfg, &dataset)?);
    if plan.world != world {
        bail!("the config resolves to world {}, the driver asked for {world}", plan.world);
    }
    let sampler = Arc::new(Sampler::new(dataset.train.clone(), plan.seq_len, cfg.tessera.seed).context("training data")?);
    Ok((plan, sampler, dataset))
}

/// Loads the config and plan the parent resolved into `<dir>/config.json`.
fn load_plan(a: &WorkerArgs) -> Result<(Config, Arc<Plan>, Arc<Sampler>, Dataset)> {
    let path = a.dir.join("config.json");
    let ctx = ResolveContext { world_size: Some(a.world), ..Default::default() };
    let cfg = config::load(&path, &[], &ctx).with_context(|| format!("loading {}", path.display()))?;
    let (plan, sampler, dataset) = plan_of(&cfg, a.world)?;
    Ok((cfg, plan, sampler, dataset))
}

/// Receives the start state and builds this rank's state from it; also the committed steps
/// the state holds.
pub(super) fn recv_start(stream: &mut TcpStream, cfg: &Config, plan: &Plan, rank: usize, wait: &Wait<'_>) -> Result<(RankState, u64)> {
    let (master_start, counters, descs, step) = match wire::recv(stream, "Start", wait)? {
        ToWorker::Start { master_start, counters, buffers, step } => (master_start, counters, buffers, step),
        other => bail!("expected the start state, got {other:?}"),
    };
    let window = master_window(plan, rank);
    if master_start != window.start as u64 || descs.first().is_none_or(|d| d.len != window.len() as u64) {
        bail!("start state: masters at {master_start} of {:?} values, this rank needs {window:?}", descs.first().map(|d| d.len));
    }
    let mut bufs = wire::recv_bulk(stream, &descs, window.len(), wait)?;
    // Transient: the full-length buffer `RankState::new` indexes; only the window is read.
    let mut master = vec![0.0f32; plan.total()];
    master[window].copy_from_slice(&bufs.remove(0));
    let optim = counters.optimizer_steps.map(|steps| (steps, descs[1..].iter().map(|d| d.name.clone()).zip(bufs).collect()));
    let cut = StartCut { optim, applied: counters.applied, skipped: counters.skipped, scaler: counters.scaler };
    Ok((rank_state(cfg, plan, rank, &master, &cut)?, step))
}

/// Sends this rank's masters, its optimizer buffers when asked, and counters.
pub(super) fn export(stream: &mut TcpStream, st: &RankState, optim: bool) -> Result<(), WireError> {
    let mut bufs: Vec<(&str, &[f32])> = vec![("master", &st.master)];
    if optim {
        bufs.extend(st.optim.state_buffers());
    }
    let counters = StateCounters {
        optimizer_steps: Some(st.optim.step_count()),
        applied: st.applied,
        skipped: st.skipped,
        scaler: st.scaler.as_ref().map(bridge::scaler_to_json),
    };
    wire::send(stream, &ToParent::Exported { counters, buffers: wire::describe(&bufs) })?;
    wire::send_bulk(stream, &bufs.iter().map(|(_, b)| *b).collect::<Vec<_>>())
}

/// Answers one request; returns false on `Shutdown`.
fn serve_one(msg: ToWorker, stream: &mut TcpStream, worker: &mut ZeroWorker, state: &Mutex<RankState>, rank: usize) -> Result<bool> {
    let snap = || snapshot(&state.lock().unwrap_or_else(|p| p.into_inner()), rank);
    let reply = match msg {
        ToWorker::Prepare { step, epoch, attempt } => match worker.prepare(&StepOrder { step, epoch, attempt }) {
            Ok(p) => ToParent::Prepared { prepared: WirePrepared::new(&p), snapshot: snap() },
            Err(error) => ToParent::Failed { error },
        },
        ToWorker::Commit { step } => match worker.commit(step) {
            Ok(()) => ToParent::Committed { snapshot: snap() },
            Err(error) => ToParent::Failed { error },
        },
        ToWorker::Abandon { step } => {
            worker.abandon(step);
            ToParent::Abandoned
        }
        ToWorker::Export { optim } => {
            export(stream, &state.lock().unwrap_or_else(|p| p.into_inner()), optim)?;
            return Ok(true);
        }
        ToWorker::Ping => ToParent::Pong,
        ToWorker::Shutdown => return Ok(false),
        other => bail!("unexpected request {other:?}"),
    };
    wire::send(stream, &reply)?;
    Ok(true)
}

/// One rank, ready to say Hello: its config, plan, identity and bound QUIC socket.
struct Member {
    rank: usize,
    world: usize,
    cfg: Config,
    plan: Arc<Plan>,
    sampler: Arc<Sampler>,
    tls: NodeTls,
    socket: UdpSocket,
    /// The address the other ranks dial (the socket's, unless advertised otherwise).
    quic_addr: SocketAddr,
    data_blake3: Option<String>,
    dataset: Dataset,
    /// The parent's control address (spawned workers): an elastic run's side connection.
    control: Option<SocketAddr>,
}

/// How a rank waits for its driver's next request.
struct Idle<'a> {
    alive: &'a dyn Fn() -> Result<(), WireError>,
    /// Bound on the wait for one request (`None`: the liveness check is the bound).
    bound_ms: Option<u64>,
    /// Whether a control connection that closes without `Shutdown` is an error (agents: the
    /// coordinator went away mid-run) or the normal end (spawned workers).
    close_is_error: bool,
}

/// Says Hello, builds the rank from the start state, joins the QUIC mesh and serves requests
/// until `Shutdown` or the control connection closes.
fn serve(stream: &mut TcpStream, m: Member, idle: &Idle<'_>) -> Result<()> {
    let alive = idle.alive;
    let rank = m.rank;
    let hello = ToParent::Hello {
        rank: rank as u64,
        pid: std::process::id(),
        quic_addr: m.quic_addr.to_string(),
        config_hash: m.cfg.hash.clone(),
        data_blake3: m.data_blake3.clone(),
    };
    wire::send(stream, &hello)?;
    let deadline = Some(Instant::now() + Duration::from_millis(STARTUP_TIMEOUT_MS));
    let wait = Wait { what: "the start-up messages", deadline, alive };
    let addrs = match wire::recv(stream, "Mesh", &wait)? {
        ToWorker::Mesh { addrs, .. } => addrs,
        other => bail!("rank {rank}: expected the addresses, got {other:?}"),
    };
    let addrs = addrs.iter().map(|s| s.parse::<SocketAddr>().with_context(|| format!("address {s:?}"))).collect::<Result<Vec<_>>>()?;
    let (state, at) = recv_start(stream, &m.cfg, &m.plan, rank, &wait).with_context(|| format!("rank {rank}: start state"))?;
    let spec = ClusterSpec { addrs, names: (0..m.world).map(node_name).collect() };
    let comm =
        QuicComm::connect_socket(m.socket, rank, &spec, &m.tls, MESH_TIMEOUT_MS).with_context(|| format!("rank {rank}: QUIC mesh"))?;
    let er = config::elastic_run(&m.cfg)?;
    if let Some(control) = m.control.filter(|_| er.enabled) {
        let ready = snapshot(&state, rank);
        let setup =
            super::elastic_worker::Setup { id: rank as u64, control, cfg: m.cfg, er, dataset: m.dataset, sampler: m.sampler, tls: m.tls };
        wire::send(stream, &ToParent::Ready { snapshot: ready })?;
        return super::elastic_worker::serve_started(stream, setup, rank, m.plan, state, Box::new(comm), at, alive);
    }
    let state = Arc::new(Mutex::new(state));
    let mut worker = ZeroWorker::new(rank, Arc::clone(&m.plan), m.sampler, Box::new(comm), Arc::clone(&state));
    let ready = snapshot(&state.lock().unwrap_or_else(|p| p.into_inner()), rank);
    wire::send(stream, &ToParent::Ready { snapshot: ready })?;
    loop {
        let wait = Wait { what: "a request", deadline: idle.bound_ms.map(|ms| Instant::now() + Duration::from_millis(ms)), alive };
        let msg = match wire::recv(stream, "a request", &wait) {
            Ok(m) => m,
            Err(WireError::Closed) if idle.close_is_error => {
                bail!("the coordinator closed the control connection without Shutdown (it died or gave up)")
            }
            Err(WireError::Closed) => return Ok(()),
            Err(e) => return Err(e).context(format!("rank {rank}: control connection")),
        };
        if !serve_one(msg, stream, &mut worker, &state, rank)? {
            return Ok(());
        }
    }
}

/// `tessera worker`: runs one rank until the parent says stop or goes away.
pub fn run_worker(a: &WorkerArgs) -> Result<()> {
    let parent = std::os::unix::process::parent_id();
    let alive = move || parent_alive(parent);
    let rank = a.rank;
    let mut stream = TcpStream::connect_timeout(&a.control, Duration::from_millis(STARTUP_TIMEOUT_MS))
        .with_context(|| format!("rank {rank}: connecting to the parent at {}", a.control))?;
    let _ = stream.set_nodelay(true);
    let (cfg, plan, sampler, dataset) = load_plan(a).with_context(|| format!("rank {rank}"))?;
    let socket = UdpSocket::bind("127.0.0.1:0").context("binding the QUIC socket")?;
    let quic_addr = socket.local_addr().context("QUIC socket address")?;
    let tls = NodeTls::load(&a.dir.join("pki"), &node_name(rank))?;
    let m =
        Member { rank, world: a.world, cfg, plan, sampler, tls, socket, quic_addr, data_blake3: None, dataset, control: Some(a.control) };
    serve(&mut stream, m, &Idle { alive: &alive, bound_ms: None, close_is_error: false })
}

/// Dials `join` until it answers or `timeout_ms` passes.
fn connect_coordinator(join: &str, timeout_ms: u64) -> Result<TcpStream> {
    let deadline = Instant::now() + Duration::from_millis(timeout_ms);
    let mut last = String::from("no attempt made");
    loop {
        match join.to_socket_addrs() {
            Ok(addrs) => {
                for addr in addrs {
                    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
                    match TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(5))) {
                        Ok(s) => return Ok(s),
                        Err(e) => last = format!("{addr}: {e}"),
                    }
                }
            }
            Err(e) => last = format!("resolving {join:?}: {e}"),
        }
        if Instant::now() >= deadline {
            bail!("could not reach the coordinator at {join} within {timeout_ms} ms (last error: {last})");
        }
        std::thread::sleep(Duration::from_millis(CONNECT_RETRY_MS));
    }
}

/// Waits for the coordinator's `Assign`, answering its pings meanwhile.
fn recv_assign(stream: &mut TcpStream, name: &str) -> Result<(usize, usize, String, Option<wire::WireTls>)> {
    loop {
        let wait = Wait {
            what: "the coordinator's rank assignment (or a ping)",
            deadline: Some(Instant::now() + Duration::from_millis(AGENT_IDLE_TIMEOUT_MS)),
            alive: &|| Ok(()),
        };
        match wire::recv(stream, "Assign", &wait).with_context(|| format!("agent {name}: waiting for the other agents to join"))? {
            ToWorker::Ping => wire::send(stream, &ToParent::Pong)?,
            ToWorker::Assign { rank, world, config, tls } => return Ok((rank as usize, world as usize, config, tls)),
            ToWorker::Shutdown => bail!("agent {name}: the coordinator sent it away before the run started"),
            other => bail!("agent {name}: expected a rank assignment, got {other:?}"),
        }
    }
}

/// Everything an agent does between `Assign` and `Hello` (errors are reported to the
/// coordinator as `Failed`).
fn agent_member(a: &AgentArgs, local_ip: IpAddr, rank: usize, world: usize, config: &str, tls: Option<wire::WireTls>) -> Result<Member> {
    let ctx = ResolveContext { world_size: Some(world), ..Default::default() };
    let cfg = config::from_str_named(config, "the coordinator's resolved config", &[], &ctx)?;
    let (plan, sampler, dataset) = plan_of(&cfg, world)?;
    let tls = match (tls, &a.certs) {
        (Some(t), _) => NodeTls::from_pem(&t.ca_pem, &t.cert_pem, &t.key_pem).context("the TLS identity the coordinator sent")?,
        (None, Some(dir)) => NodeTls::load(dir, &node_name(rank)).with_context(|| format!("loading {} from {}", node_name(rank), dir.display()))?,
        (None, None) => bail!("the coordinator sends no keys (it runs with --certs); start the agent with --certs DIR holding the cluster's ca.pem and node-<rank> files"),
    };
    let (bind, advertised) = match a.advertise {
        Some(ip) if ip.is_ipv4() => (IpAddr::V4(Ipv4Addr::UNSPECIFIED), ip),
        Some(ip) => (IpAddr::V6(Ipv6Addr::UNSPECIFIED), ip),
        None => (local_ip, local_ip),
    };
    let socket = UdpSocket::bind((bind, a.quic_port)).with_context(|| format!("binding the QUIC socket on {bind} port {}", a.quic_port))?;
    let port = socket.local_addr().context("QUIC socket address")?.port();
    let data_blake3 = Some(data_blake3(&dataset));
    Ok(Member {
        rank,
        world,
        cfg,
        plan,
        sampler,
        tls,
        socket,
        quic_addr: SocketAddr::new(advertised, port),
        data_blake3,
        dataset,
        control: None,
    })
}

/// `tessera agent`: joins the coordinator, runs the rank it is given, and returns when the
/// coordinator says stop (or fails when it goes away).
pub fn run_agent(a: &AgentArgs) -> Result<()> {
    let name = &a.name;
    let mut stream = connect_coordinator(&a.join, a.connect_timeout_ms).with_context(|| format!("agent {name}"))?;
    let _ = stream.set_nodelay(true);
    let local_ip = stream.local_addr().context("the control connection's local address")?.ip();
    let join = ToParent::Join {
        name: name.clone(),
        pid: std::process::id(),
        rank: a.rank.map(|r| r as u64),
        world: a.world.map(|w| w as u64),
        version: env!("CARGO_PKG_VERSION").to_string(),
    };
    wire::send(&mut stream, &join).with_context(|| format!("agent {name}: joining {}", a.join))?;
    let (rank, world, config, tls) = recv_assign(&mut stream, name)?;
    // One write (shorter than PIPE_BUF), so agents sharing a terminal or pipe never interleave.
    let line = format!("agent {name}: rank {rank} of {world} (coordinator {})\n", a.join);
    let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
    let m = match agent_member(a, local_ip, rank, world, &config, tls) {
        Ok(m) => m,
        Err(e) => {
            let error = format!("{e:#}");
            let _ = wire::send(&mut stream, &ToParent::Failed { error: error.clone() });
            bail!("agent {name} (rank {rank}): {error}");
        }
    };
    let served = serve(&mut stream, m, &Idle { alive: &|| Ok(()), bound_ms: Some(AGENT_IDLE_TIMEOUT_MS), close_is_error: true });
    if let Err(e) = &served {
        // The coordinator may be waiting for this rank: tell it why (best effort).
        let _ = wire::send(&mut stream, &ToParent::Failed { error: format!("{e:#}") });
    }
    served.with_context(|| format!("agent {name} (rank {rank})"))
}
