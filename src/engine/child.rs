//! How a process becomes a worker of the fleet (every process run; the driver's side and the
//! whole design are in [`super::elastic`], the worker loop in [`super::elastic_worker`], the
//! protocol in [`super::wire`]): one rank's `ZeroWorker` over a `QuicComm` with mutual TLS,
//! whose prepare, commit and abandon the driver requests over the QUIC control connection.
//! Three ways in:
//!
//! - `tessera worker` (hidden, [`run_worker`]): spawned by `tessera train --nprocs N` on the same
//!   machine. It reads the resolved config and its keys from the run's `procs` directory, dials
//!   the parent's control endpoint with its certificate, binds its QUIC socket on 127.0.0.1 (or
//!   in its network namespace, `--worker-net`), and exits on `Shutdown`, when its driver is gone
//!   (its side connection closes) or when its parent process is gone (the parent id changes),
//!   so it never outlives its run.
//! - `tessera agent` ([`run_agent`]): started by hand, by `tessera launch` (ssh) or by a cluster
//!   scheduler on any host; it dials the coordinator (retrying until it answers, bounded) with a
//!   join token (it pins the coordinator's CA, sends the token's secret and a public key it
//!   generated, and receives a certificate for that key) or with its own certificate
//!   (`--certs DIR`), says `Join`, and receives its rank and the resolved config (no shared
//!   filesystem needed; a coordinator silent for [`AGENT_IDLE_TIMEOUT_MS`] meanwhile ends it).
//!   Its QUIC socket binds the local address on its route to the coordinator (or listens on
//!   every interface and advertises `--advertise IP`; or, given the hidden `--worker-net FILE` by
//!   `tessera chaos run`, sits behind its fault link as a spawned worker's does,
//!   [`super::worker_net`]). It leaves on `Shutdown` (status 0); a driver that goes away ends it
//!   with an error. One that arrives after an elastic run started is answered `Admit` instead of
//!   `Assign` and becomes a member at the next step boundary.
//! - `tessera worker --join --dir <output>/procs` ([`run_joiner`]): joins an elastic
//!   `train --nprocs` run on this machine as such a late agent, with the join token and the
//!   address the driver wrote into its `procs` directory.
//!
//! Either way the worker rebuilds the plan from the resolved config (and proves it by the config
//! hash), receives its start state from the driver, and then serves its requests.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tessera_actors::faults::Faults;
use tessera_transport::quic::{ClusterSpec, ControlConn, ControlEndpoint, JoinToken, NodeKey, NodeTls, QuicComm, ALPN_CONTROL};

use super::elastic_worker::{DataNet, Setup, SideDial};
use super::plan::Plan;
use super::ranks::{master_window, rank_state, StartCut};
use super::rendezvous::{node_name, COORDINATOR_NAME, STARTUP_TIMEOUT_MS};
use super::wire::{self, AssignedIdentity, ControlIo, Snapshot, StateCounters, ToParent, ToWorker, Wait, WireComputeError, WireError};
use super::zero::RankState;
use crate::bridge;
use crate::config::{self, Config, ResolveContext};
use crate::data::{self, DataError, Dataset, Sampler};

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
    /// The process's fault hooks (no-op unless a test or the chaos harness asked for them).
    pub faults: Faults,
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
    /// How it proves it belongs to the run: a join token, or a certificate of the cluster.
    pub credentials: AgentCredentials,
    /// How long to keep trying to reach the coordinator (ms).
    pub connect_timeout_ms: u64,
    /// A worker-net file (`tessera chaos run`, hidden `--worker-net`; format
    /// `tessera_chaos::link::WorkerNet`): when it names a fault-link folder, every QUIC socket
    /// of this agent goes behind its fault link, set up once the driver gave it its id. Not
    /// with `advertise` or `quic_port`.
    pub worker_net: Option<PathBuf>,
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
        peak_rss_bytes: super::summary::peak_rss_bytes(),
    }
}

/// Fails once the process that started this worker is gone.
fn parent_alive(parent: u32) -> Result<(), WireError> {
    match std::os::unix::process::parent_id() == parent {
        true => Ok(()),
        false => Err(WireError::Closed),
    }
}

/// Loads the training data the config names (the shipped corpus by default), through the
/// token cache unless `tessera.data_cache` is "off"; warns when the cache was rebuilt or is
/// unavailable.
pub(crate) fn load_dataset(cfg: &Config) -> Result<Dataset> {
    let t = &cfg.tessera;
    let data_path = t.data.as_ref().map_or_else(data::default_corpus_path, PathBuf::from);
    let cache_dir = match t.data_cache.as_deref() {
        Some("off") => None,
        Some(dir) => Some(PathBuf::from(dir)),
        None => Some(data::default_token_cache_dir()),
    };
    let opts = data::LoadOptions {
        tokenizer: t.tokenizer.as_ref().map(PathBuf::from),
        val_fraction: data::DEFAULT_VAL_FRACTION,
        text_field: t.data_field.clone(),
        end_of_text: t.data_eot.clone(),
        begin_of_text: t.data_bos.clone(),
        cache_dir,
    };
    let loaded = data::load_with(&data_path, &opts).map_err(|e| match e {
        DataError::ShardsNeedTokenizer { natural_vocab, .. } => anyhow::anyhow!("{e}{}", vocab_consequence(cfg, natural_vocab)),
        e => e.into(),
    });
    let dataset = loaded.with_context(|| format!("loading data from {}", data_path.display()))?;
    if let Some(warning) = dataset.cache.warning() {
        eprintln!("warning: {warning}");
    }
    Ok(dataset)
}

/// What a guessed vocabulary would have done to the model's size, for the refusal of token
/// shards without a tokenizer.
fn vocab_consequence(cfg: &Config, vocab: usize) -> String {
    let params = |vocab_size: usize| {
        let mut m = crate::zoo::preset(&cfg.tessera.model).ok()?;
        m.vocab_size = vocab_size;
        tessera_kernels::model::Model::new(m).ok().map(|m| m.num_params())
    };
    match (params(vocab), params(data::BYTE_VOCAB_SIZE)) {
        (Some(guessed), Some(bytes)) => format!(
            " (with a vocabulary of {vocab}, `{}` would have {guessed} parameters, {:.1}x the {bytes} of the 256-byte vocabulary)",
            cfg.tessera.model,
            guessed as f64 / bytes as f64
        ),
        _ => String::new(),
    }
}

/// BLAKE3 of the training and validation token counts and tokens: agents on other hosts must
/// train on the very tokens the coordinator evaluates with.
pub(super) fn data_blake3(ds: &Dataset) -> String {
    let mut h = blake3::Hasher::new();
    h.update(&(ds.train.len() as u64).to_le_bytes());
    h.update(&(ds.val.len() as u64).to_le_bytes());
    h.update(ds.tokens_blake3().as_bytes());
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
pub(super) fn recv_start(
    stream: &mut (impl ControlIo + ?Sized),
    cfg: &Config,
    plan: &Plan,
    rank: usize,
    faults: &Faults,
    wait: &Wait<'_>,
) -> Result<(RankState, u64)> {
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
    Ok((rank_state(cfg, plan, rank, &master, &cut, faults)?, step))
}

/// Sends this rank's masters, its optimizer buffers when asked, and counters.
pub(super) fn export(stream: &mut (impl ControlIo + ?Sized), st: &RankState, optim: bool) -> Result<(), WireError> {
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
    faults: Faults,
}

/// Says Hello, receives the addresses and the start state, and joins the QUIC mesh.
fn start_up(
    stream: &mut (impl ControlIo + ?Sized),
    m: &mut Member,
    alive: &dyn Fn() -> Result<(), WireError>,
) -> Result<(RankState, u64, QuicComm)> {
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
    let (state, at) = recv_start(stream, &m.cfg, &m.plan, rank, &m.faults, &wait).with_context(|| format!("rank {rank}: start state"))?;
    let addrs = super::worker_net::peer_addrs(addrs, rank)?;
    let spec = ClusterSpec { addrs, names: (0..m.world).map(node_name).collect() };
    let socket = m.socket.try_clone().context("the QUIC socket")?;
    let comm = QuicComm::connect_socket(socket, rank, &spec, &m.tls, MESH_TIMEOUT_MS).with_context(|| format!("rank {rank}: QUIC mesh"))?;
    Ok((state, at, comm))
}

/// A worker of the fleet's first epoch (elastic or with recovery off): start-up, then the
/// worker loop ([`super::elastic_worker`]) with its side connection dialled by `side` and each
/// later epoch's QUIC socket bound by `data`.
fn serve_fleet(
    conn: &mut ControlConn,
    mut m: Member,
    side: SideDial,
    data: DataNet,
    alive: &dyn Fn() -> Result<(), WireError>,
) -> Result<()> {
    let er = config::elastic_run(&m.cfg)?;
    super::elastic_worker::install_signal_handlers(&m.faults, er.enabled);
    let (state, at, comm) = start_up(conn, &mut m, alive)?;
    let rank = m.rank;
    let ready = snapshot(&state, rank);
    let (cfg, dataset, sampler, tls, faults) = (m.cfg, m.dataset, m.sampler, m.tls, m.faults);
    let setup = Setup { id: rank as u64, side, data, cfg, er, dataset, sampler, tls, faults };
    wire::send(conn, &ToParent::Ready { snapshot: ready })?;
    super::elastic_worker::serve_started(conn, setup, rank, m.plan, state, Box::new(comm), at, alive)
}

/// `tessera worker`: runs one rank until the parent says stop or goes away.
pub fn run_worker(a: &WorkerArgs) -> Result<()> {
    let parent = std::os::unix::process::parent_id();
    let alive = move || parent_alive(parent);
    let rank = a.rank;
    let (cfg, plan, sampler, dataset) = load_plan(a).with_context(|| format!("rank {rank}"))?;
    let tls = NodeTls::load(&a.dir.join("pki"), &node_name(rank))?;
    // 127.0.0.1 next to the driver; the namespace's address when the run put us in one.
    let local_ip = route_to(a.control)?;
    let endpoint = Arc::new(ControlEndpoint::bind(SocketAddr::new(local_ip, 0), None)?);
    let client = tls.client_config_for(ALPN_CONTROL)?;
    let mut conn = endpoint
        .connect(a.control, COORDINATOR_NAME, client.clone(), STARTUP_TIMEOUT_MS)
        .with_context(|| format!("rank {rank}: connecting to the parent at {}", a.control))?;
    super::worker_net::init_worker(&a.dir, rank as u64)?;
    let (socket, quic_addr) = super::worker_net::bind_quic(local_ip).with_context(|| format!("rank {rank}"))?;
    let faults = a.faults.clone();
    let m = Member { rank, world: a.world, cfg, plan, sampler, tls, socket, quic_addr, data_blake3: None, dataset, faults };
    let side = SideDial { endpoint: Arc::clone(&endpoint), driver: a.control, client, who: format!("worker {rank}") };
    let data = DataNet { bind: local_ip, advertise: local_ip, port: 0 };
    let served = serve_fleet(&mut conn, m, side, data, &alive);
    conn.close("bye");
    served
}

/// How an agent proves it belongs to the run.
#[derive(Clone, PartialEq, Eq)]
pub enum AgentCredentials {
    /// A join token printed by the coordinator (text form).
    Token(String),
    /// A cluster directory with `ca.pem` and this agent's `node-<rank>.{pem,key}`.
    Certs(PathBuf),
}

impl std::fmt::Debug for AgentCredentials {
    /// Never prints the token.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AgentCredentials::Token(_) => f.write_str("Token(..)"),
            AgentCredentials::Certs(d) => f.debug_tuple("Certs").field(d).finish(),
        }
    }
}

/// An agent's TLS client config, its token and fresh key (token agents) or its own identity.
type AgentTls = (tessera_transport::quic::rustls::ClientConfig, Option<JoinToken>, Option<NodeKey>, Option<NodeTls>);

/// The agent's side of the TLS handshake and what its `Join` carries: a token agent pins the
/// coordinator's CA and sends the token's secret and a fresh public key; a certificate agent
/// presents `node-<rank>` (its `--rank`, or the only node identity in its directory).
fn agent_tls(a: &AgentArgs) -> Result<AgentTls> {
    match &a.credentials {
        AgentCredentials::Token(text) => {
            let token = JoinToken::parse(text)?;
            let key = NodeKey::generate()?;
            Ok((token.client_config(ALPN_CONTROL)?, Some(token), Some(key), None))
        }
        AgentCredentials::Certs(dir) => {
            let rank = match a.rank {
                Some(r) => r,
                None => only_node_in(dir)?,
            };
            let tls =
                NodeTls::load(dir, &node_name(rank)).with_context(|| format!("loading {} from {}", node_name(rank), dir.display()))?;
            Ok((tls.client_config_for(ALPN_CONTROL)?, None, None, Some(tls)))
        }
    }
}

/// The rank of the one `node-<r>.pem` in `dir`.
fn only_node_in(dir: &Path) -> Result<usize> {
    let entries = std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))?;
    let ranks: Vec<usize> =
        entries.filter_map(|e| e.ok()?.file_name().to_str()?.strip_suffix(".pem")?.strip_prefix("node-")?.parse().ok()).collect();
    match ranks.as_slice() {
        [r] => Ok(*r),
        [] => bail!("{} holds no node-<rank>.pem", dir.display()),
        _ => bail!("{} holds the identities of ranks {ranks:?}: give --rank to pick one", dir.display()),
    }
}

/// The coordinator at the join address is not the one the join token was made for: its CA
/// differs from the token's fingerprint (another coordinator's token, or an earlier run's).
/// Retrying with the same token cannot help.
#[derive(Debug, thiserror::Error)]
#[error(
    "the coordinator at {join} is not the one this join token was made for (its CA differs from the token's fingerprint): \
     use the token that coordinator printed ({detail})"
)]
pub struct WrongCoordinator {
    pub join: String,
    pub detail: String,
}

/// Dials the coordinator at `join` until it answers or `timeout_ms` passes.
fn connect_coordinator(
    endpoint: &ControlEndpoint,
    a: &AgentArgs,
    client: &tessera_transport::quic::rustls::ClientConfig,
) -> Result<ControlConn> {
    let (join, timeout_ms) = (&a.join, a.connect_timeout_ms);
    let deadline = Instant::now() + Duration::from_millis(timeout_ms);
    let mut last = String::from("no attempt made");
    loop {
        match join.to_socket_addrs() {
            Ok(addrs) => {
                for addr in addrs.filter(|x| x.is_ipv4() == endpoint.local_addr().is_ok_and(|l| l.is_ipv4())) {
                    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
                    match endpoint.connect(addr, COORDINATOR_NAME, client.clone(), left.as_millis() as u64) {
                        Ok(c) => return Ok(c),
                        // The token pins another CA: another coordinator's token, or this
                        // address is some other run's. Retrying cannot help.
                        Err(e) if e.to_string().contains(tessera_transport::quic::pki::NOT_THE_TOKENS_CA) => {
                            return Err(WrongCoordinator { join: join.clone(), detail: e.to_string() }.into())
                        }
                        Err(e) => last = e.to_string(),
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

/// What a driver answers an agent's `Join` with.
enum Answer {
    /// A rank of the first epoch: (rank, world, resolved config, identity).
    Assign(usize, usize, String, Option<AssignedIdentity>),
    /// A running elastic job takes it as worker `id`: (id, resolved config, identity).
    Admit(u64, String, Option<AssignedIdentity>),
}

/// Waits for the coordinator's `Assign` (or, from a running elastic job, `Admit`), answering its
/// pings meanwhile.
fn recv_assign(conn: &mut ControlConn, name: &str) -> Result<Answer> {
    loop {
        let wait = Wait {
            what: "the coordinator's rank assignment (or a ping)",
            deadline: Some(Instant::now() + Duration::from_millis(AGENT_IDLE_TIMEOUT_MS)),
            alive: &|| Ok(()),
        };
        let got = wire::recv(conn, "Assign", &wait).map_err(|e| {
            // Why the coordinator closed the connection (a wrong join token, a refused rank)
            // travels in the close frame; `e` alone says only that it closed.
            let why = conn.closed_reason().map(|r| format!(" ({r})")).unwrap_or_default();
            anyhow::anyhow!("agent {name}: waiting for the other agents to join: {e}{why}")
        })?;
        match got {
            ToWorker::Ping => wire::send(conn, &ToParent::Pong)?,
            ToWorker::Assign { rank, world, config, identity } => {
                return Ok(Answer::Assign(rank as usize, world as usize, config, identity))
            }
            ToWorker::Admit { id, config, identity } => return Ok(Answer::Admit(id, config, identity)),
            ToWorker::Shutdown => bail!("agent {name}: the coordinator sent it away before the run started"),
            ToWorker::Refused { error } => bail!("agent {name}: the driver refused it: {error}"),
            other => bail!("agent {name}: expected a rank assignment, got {other:?}"),
        }
    }
}

/// Everything an agent does between `Assign` and `Hello` (errors are reported to the
/// coordinator as `Failed`).
fn agent_member(a: &AgentArgs, local_ip: IpAddr, assigned: (usize, usize, &str), tls: NodeTls, faults: &Faults) -> Result<Member> {
    let (rank, world, config) = assigned;
    let ctx = ResolveContext { world_size: Some(world), ..Default::default() };
    let cfg = config::from_str_named(config, "the coordinator's resolved config", &[], &ctx)?;
    let (plan, sampler, dataset) = plan_of(&cfg, world)?;
    let (socket, quic_addr) = match &a.worker_net {
        // Behind its fault link (on the route to the coordinator, as the later epochs' sockets).
        Some(file) => {
            super::worker_net::start_link(file, rank as u64)?;
            super::worker_net::bind_quic(local_ip)?
        }
        None => {
            let (bind, advertised) = agent_data_ips(a, local_ip);
            let socket =
                UdpSocket::bind((bind, a.quic_port)).with_context(|| format!("binding the QUIC socket on {bind} port {}", a.quic_port))?;
            let port = socket.local_addr().context("QUIC socket address")?.port();
            (socket, SocketAddr::new(advertised, port))
        }
    };
    let data_blake3 = Some(data_blake3(&dataset));
    Ok(Member { rank, world, cfg, plan, sampler, tls, socket, quic_addr, data_blake3, dataset, faults: faults.clone() })
}

/// The local address this machine uses to reach `peer` (no packet is sent).
fn route_to(peer: SocketAddr) -> Result<IpAddr> {
    let any: SocketAddr = if peer.is_ipv4() { ([0, 0, 0, 0], 0).into() } else { (Ipv6Addr::UNSPECIFIED, 0).into() };
    let probe = UdpSocket::bind(any).context("a probe socket")?;
    probe.connect(peer).with_context(|| format!("finding the route to {peer}"))?;
    Ok(probe.local_addr().context("the probe's address")?.ip())
}

/// The identity an agent runs under: its own (`--certs`), or its key with the certificate the
/// coordinator issued for it, under the CA the join token pins.
fn agent_identity(
    own: Option<NodeTls>,
    key: Option<NodeKey>,
    identity: Option<AssignedIdentity>,
    token: Option<&JoinToken>,
) -> Result<NodeTls> {
    match (own, key, identity, token) {
        (Some(tls), ..) => Ok(tls),
        (None, Some(key), Some(id), Some(token)) => {
            // The CA sent must be the one the token pins (the handshake already checked that it
            // signed the coordinator's certificate).
            let tls = key.identity(&id.ca_pem, &id.cert_pem).context("the certificate the coordinator issued")?;
            match tls.ca_sha256() == token.ca_sha256 {
                true => Ok(tls),
                false => bail!("the coordinator sent a CA other than the one the join token pins"),
            }
        }
        _ => bail!("the coordinator issued no certificate for this agent's key"),
    }
}

/// Where an agent's data-plane sockets bind and what they advertise: `--advertise IP` on every
/// interface, else the local address of its route to the coordinator.
fn agent_data_ips(a: &AgentArgs, local_ip: IpAddr) -> (IpAddr, IpAddr) {
    match a.advertise {
        Some(ip) if ip.is_ipv4() => (IpAddr::V4(Ipv4Addr::UNSPECIFIED), ip),
        Some(ip) => (IpAddr::V6(Ipv6Addr::UNSPECIFIED), ip),
        None => (local_ip, local_ip),
    }
}

/// `tessera agent`: joins the coordinator, runs the rank it is given, and returns when the
/// coordinator says stop (or fails when it goes away).
pub fn run_agent(a: &AgentArgs, faults: &Faults) -> Result<()> {
    join_and_serve(a, faults)
}

/// `tessera worker --join --dir DIR`: joins the running elastic job whose `procs` directory is
/// `dir` (on this machine) as a late agent would, with the address and join token found there.
pub fn run_joiner(dir: &Path, faults: &Faults) -> Result<()> {
    let read = |name: &str| {
        let path = dir.join(name);
        std::fs::read_to_string(&path).map(|t| t.trim().to_string()).with_context(|| format!("reading {}", path.display()))
    };
    let control = read("control")?;
    control.parse::<SocketAddr>().with_context(|| format!("{}/control: {control:?} is not an address", dir.display()))?;
    let token = read(super::elastic::JOIN_TOKEN_FILE)?;
    JoinToken::parse(&token).with_context(|| format!("{}/{}", dir.display(), super::elastic::JOIN_TOKEN_FILE))?;
    // The run's worker-net file, when it has one (its fault link, when the run has them).
    let net = dir.join(tessera_chaos::link::WORKER_NET_FILE);
    let a = AgentArgs {
        join: control,
        name: format!("joiner-{}", std::process::id()),
        rank: None,
        world: None,
        advertise: None,
        quic_port: 0,
        credentials: AgentCredentials::Token(token),
        connect_timeout_ms: STARTUP_TIMEOUT_MS,
        worker_net: net.exists().then_some(net),
    };
    join_and_serve(&a, faults)
}

/// An agent's life (see the module doc).
fn join_and_serve(a: &AgentArgs, faults: &Faults) -> Result<()> {
    let name = &a.name;
    let (client, token, key, own) = agent_tls(a).with_context(|| format!("agent {name}"))?;
    let v6 = a.join.to_socket_addrs().ok().and_then(|mut x| x.next()).is_some_and(|x| x.is_ipv6());
    let any: SocketAddr = if v6 { (Ipv6Addr::UNSPECIFIED, 0).into() } else { ([0, 0, 0, 0], 0).into() };
    let endpoint = Arc::new(ControlEndpoint::bind(any, None).with_context(|| format!("agent {name}"))?);
    let mut conn = connect_coordinator(&endpoint, a, &client).with_context(|| format!("agent {name}"))?;
    let local_ip = route_to(conn.remote_address())?;
    let join = ToParent::Join {
        name: name.clone(),
        pid: std::process::id(),
        rank: a.rank.map(|r| r as u64),
        world: a.world.map(|w| w as u64),
        version: env!("CARGO_PKG_VERSION").to_string(),
        token: token.as_ref().map(|t| t.secret.to_vec()),
        public_key: key.as_ref().map(NodeKey::public_key),
        host: super::elastic_join::host_id(),
    };
    wire::send(&mut conn, &join).with_context(|| format!("agent {name}: joining {}", a.join))?;
    let served = match recv_assign(&mut conn, name)? {
        Answer::Assign(rank, world, config, identity) => {
            // One write (shorter than PIPE_BUF), so agents sharing a terminal or pipe never interleave.
            let line = format!("agent {name}: rank {rank} of {world} (coordinator {})\n", a.join);
            let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
            let tls = agent_identity(own, key, identity, token.as_ref());
            let m = tls.and_then(|tls| agent_member(a, local_ip, (rank, world, &config), tls, faults));
            let m = match m {
                Ok(m) => m,
                Err(e) => return fail(&mut conn, format!("agent {name} (rank {rank})"), e),
            };
            let (bind, advertise) = agent_data_ips(a, local_ip);
            let data = DataNet { bind, advertise, port: a.quic_port };
            let served = m.tls.client_config_for(ALPN_CONTROL).map_err(anyhow::Error::from).and_then(|client| {
                let side =
                    SideDial { endpoint: Arc::clone(&endpoint), driver: conn.remote_address(), client, who: format!("agent {name}") };
                serve_fleet(&mut conn, m, side, data, &|| Ok(()))
            });
            served.with_context(|| format!("agent {name} (rank {rank})"))
        }
        Answer::Admit(id, config, identity) => {
            // Only an elastic run admits a late joiner.
            super::elastic_worker::install_signal_handlers(faults, true);
            let line = format!("agent {name}: joins the running job as worker {id} (driver {})\n", a.join);
            let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
            let setup = agent_identity(own, key, identity, token.as_ref())
                .and_then(|tls| late_setup(a, &endpoint, &mut conn, id, &config, (tls, faults), local_ip));
            match setup {
                Ok(setup) => super::elastic_worker::serve_joined(&mut conn, setup).with_context(|| format!("agent {name} (worker {id})")),
                Err(e) => return fail(&mut conn, format!("agent {name} (worker {id})"), e),
            }
        }
    };
    if let Err(e) = &served {
        // The coordinator may be waiting for this rank: tell it why (best effort).
        let _ = wire::send(&mut conn, &ToParent::Failed { error: WireComputeError::failed(format!("{e:#}")) });
    }
    conn.close("bye");
    served
}

/// Tells the driver why this agent cannot go on, and fails with it.
fn fail(conn: &mut ControlConn, who: String, e: anyhow::Error) -> Result<()> {
    let error = format!("{e:#}");
    let _ = wire::send(conn, &ToParent::Failed { error: WireComputeError::failed(error.clone()) });
    conn.close("failed");
    bail!("{who}: {error}")
}

/// A late joiner of an elastic job, between `Admit` and serving: loads the config it was given
/// and the data, says `Hello` (with the data's BLAKE3) and sets up what the elastic loop needs.
fn late_setup(
    a: &AgentArgs,
    endpoint: &Arc<ControlEndpoint>,
    conn: &mut ControlConn,
    id: u64,
    config: &str,
    (tls, faults): (NodeTls, &Faults),
    local_ip: IpAddr,
) -> Result<Setup> {
    let cfg = config::from_str_named(config, "the driver's resolved config", &[], &ResolveContext::default())?;
    let er = config::elastic_run(&cfg)?;
    if !er.enabled {
        bail!("the driver admitted this worker to a run that is not elastic");
    }
    let dataset = load_dataset(&cfg)?;
    let sampler =
        Arc::new(Sampler::new(dataset.train.clone(), Plan::new(&cfg, &dataset)?.seq_len, cfg.tessera.seed).context("training data")?);
    if let Some(file) = &a.worker_net {
        super::worker_net::start_link(file, id)?;
    }
    let hello = ToParent::Hello {
        rank: id,
        pid: std::process::id(),
        quic_addr: String::new(),
        config_hash: cfg.hash.clone(),
        data_blake3: Some(data_blake3(&dataset)),
    };
    wire::send(conn, &hello)?;
    let client = tls.client_config_for(ALPN_CONTROL)?;
    let who = format!("agent {} (worker {id})", a.name);
    let side = SideDial { endpoint: Arc::clone(endpoint), driver: conn.remote_address(), client, who };
    let (bind, advertise) = agent_data_ips(a, local_ip);
    let data = DataNet { bind, advertise, port: a.quic_port };
    Ok(Setup { id, side, data, cfg, er, dataset, sampler, tls, faults: faults.clone() })
}
