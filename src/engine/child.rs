//! How a process becomes a worker of the fleet (every process run; the driver's side and the
//! whole design are in [`tessera_fleet::driver`], the worker loop in [`super::elastic_worker`], the
//! protocol in [`tessera_fleet::wire`]): one rank's `ZeroWorker` over a `QuicComm` with mutual TLS,
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
//!   filesystem needed; a coordinator silent for [`tessera_fleet::agent::AGENT_IDLE_TIMEOUT_MS`] meanwhile ends it).
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

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tessera_actors::faults::Faults;
use tessera_fleet::agent::{self, AgentArgs, AgentCredentials, Answer, Dialled};
use tessera_fleet::driver::JOIN_TOKEN_FILE;
use tessera_fleet::rendezvous::{node_name, COORDINATOR_NAME, STARTUP_TIMEOUT_MS};
use tessera_transport::quic::{ClusterSpec, ControlConn, ControlEndpoint, JoinToken, NodeTls, QuicComm, ALPN_CONTROL};

use super::elastic_worker::Setup;
use super::plan::Plan;
use super::ranks::{recv_start, snapshot};
use super::zero::RankState;
use crate::config::{self, Config, ResolveContext};
use crate::data::{self, DataError, Dataset, Sampler};
use tessera_fleet::wire::{self, ControlIo, ToParent, ToWorker, Wait, WireComputeError, WireError};
use tessera_fleet::worker::{install_signal_handlers, DataNet, SideDial};

/// Bound on building the QUIC mesh (ms).
const MESH_TIMEOUT_MS: u64 = 60_000;
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
    let addrs = super::worker_net::sockets().peer_addrs(addrs, rank)?;
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
    install_signal_handlers(&m.faults, er.enabled);
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
    let local_ip = agent::route_to(a.control)?;
    let endpoint = Arc::new(ControlEndpoint::bind(SocketAddr::new(local_ip, 0), None)?);
    let client = tls.client_config_for(ALPN_CONTROL)?;
    let mut conn = endpoint
        .connect(a.control, COORDINATOR_NAME, client.clone(), STARTUP_TIMEOUT_MS)
        .with_context(|| format!("rank {rank}: connecting to the parent at {}", a.control))?;
    super::worker_net::init_worker(&a.dir, rank as u64)?;
    let (socket, quic_addr) = super::worker_net::sockets().bind_epoch(local_ip).with_context(|| format!("rank {rank}"))?;
    let faults = a.faults.clone();
    let m = Member { rank, world: a.world, cfg, plan, sampler, tls, socket, quic_addr, data_blake3: None, dataset, faults };
    let side = SideDial { endpoint: Arc::clone(&endpoint), driver: a.control, client, who: format!("worker {rank}") };
    let data = DataNet { bind: local_ip, advertise: local_ip, port: 0, sockets: super::worker_net::sockets() };
    let served = serve_fleet(&mut conn, m, side, data, &alive);
    conn.close("bye");
    served
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
            super::worker_net::sockets().bind_epoch(local_ip)?
        }
        None => {
            let (bind, advertised) = agent::data_ips(a, local_ip);
            let socket =
                UdpSocket::bind((bind, a.quic_port)).with_context(|| format!("binding the QUIC socket on {bind} port {}", a.quic_port))?;
            let port = socket.local_addr().context("QUIC socket address")?.port();
            (socket, SocketAddr::new(advertised, port))
        }
    };
    let data_blake3 = Some(data_blake3(&dataset));
    Ok(Member { rank, world, cfg, plan, sampler, tls, socket, quic_addr, data_blake3, dataset, faults: faults.clone() })
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
    let token = read(JOIN_TOKEN_FILE)?;
    JoinToken::parse(&token).with_context(|| format!("{}/{}", dir.display(), JOIN_TOKEN_FILE))?;
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
    let Dialled { endpoint, mut conn, local_ip, tls } = agent::dial(a)?;
    let served = match agent::recv_assign(&mut conn, name)? {
        Answer::Assign(rank, world, config, identity) => {
            // One write (shorter than PIPE_BUF), so agents sharing a terminal or pipe never interleave.
            let line = format!("agent {name}: rank {rank} of {world} (coordinator {})\n", a.join);
            let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
            let tls = tls.identity(identity);
            let m = tls.and_then(|tls| agent_member(a, local_ip, (rank, world, &config), tls, faults));
            let m = match m {
                Ok(m) => m,
                Err(e) => return fail(&mut conn, format!("agent {name} (rank {rank})"), e),
            };
            let (bind, advertise) = agent::data_ips(a, local_ip);
            let data = DataNet { bind, advertise, port: a.quic_port, sockets: super::worker_net::sockets() };
            let served = m.tls.client_config_for(ALPN_CONTROL).map_err(anyhow::Error::from).and_then(|client| {
                let side =
                    SideDial { endpoint: Arc::clone(&endpoint), driver: conn.remote_address(), client, who: format!("agent {name}") };
                serve_fleet(&mut conn, m, side, data, &|| Ok(()))
            });
            served.with_context(|| format!("agent {name} (rank {rank})"))
        }
        Answer::Admit(id, config, identity) => {
            // Only an elastic run admits a late joiner.
            install_signal_handlers(faults, true);
            let line = format!("agent {name}: joins the running job as worker {id} (driver {})\n", a.join);
            let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
            let setup = tls.identity(identity).and_then(|tls| late_setup(a, &endpoint, &mut conn, id, &config, (tls, faults), local_ip));
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
    let (bind, advertise) = agent::data_ips(a, local_ip);
    let data = DataNet { bind, advertise, port: a.quic_port, sockets: super::worker_net::sockets() };
    Ok(Setup { id, side, data, cfg, er, dataset, sampler, tls, faults: faults.clone() })
}
