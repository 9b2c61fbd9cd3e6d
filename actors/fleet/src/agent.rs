//! An agent's way into a run (`tessera agent`, or `tessera worker --join`): its arguments and
//! credentials, dialling the coordinator or running driver (retrying, bounded), its `Join`, and
//! the answer it waits for (`Assign` to a first-epoch rank, `Admit` to a running elastic job).
//! What it then runs (the config it was given, its data, its rank's compute) is the front
//! crate's (`engine::child`).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tessera_transport::quic::{rustls, ControlConn, ControlEndpoint, JoinToken, NodeKey, NodeTls, ALPN_CONTROL};

use crate::rendezvous::{node_name, COORDINATOR_NAME};
use crate::wire::{self, AssignedIdentity, ToParent, ToWorker, Wait};

/// An agent gives up when the coordinator sends nothing (not even a ping) for this long (ms).
pub const AGENT_IDLE_TIMEOUT_MS: u64 = 60_000;
/// Default bound on an agent's attempts to reach the coordinator (ms).
pub const AGENT_CONNECT_TIMEOUT_MS: u64 = 120_000;
/// Pause between an agent's attempts to reach the coordinator (ms).
const CONNECT_RETRY_MS: u64 = 250;

/// Arguments of `tessera agent` (the front crate's `launch::agent_args` fills them from the
/// torchrun/Slurm variables).
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

/// An agent's side of the TLS handshake: its client config, and its join token and a fresh key
/// (a token agent) or its own identity (a certificate agent).
pub struct AgentTls {
    pub client: rustls::ClientConfig,
    pub token: Option<JoinToken>,
    pub key: Option<NodeKey>,
    pub own: Option<NodeTls>,
}

impl AgentTls {
    /// The identity the agent runs under once the driver answered its `Join` with `identity`:
    /// its own (`--certs`), or its key with the certificate the driver issued for it, under the
    /// CA the join token pins.
    pub fn identity(self, identity: Option<AssignedIdentity>) -> Result<NodeTls> {
        match (self.own, self.key, identity, self.token) {
            (Some(tls), ..) => Ok(tls),
            (None, Some(key), Some(id), Some(token)) => {
                // The CA sent must be the one the token pins (the handshake already checked that
                // it signed the coordinator's certificate).
                let tls = key.identity(&id.ca_pem, &id.cert_pem).context("the certificate the coordinator issued")?;
                match tls.ca_sha256() == token.ca_sha256 {
                    true => Ok(tls),
                    false => bail!("the coordinator sent a CA other than the one the join token pins"),
                }
            }
            _ => bail!("the coordinator issued no certificate for this agent's key"),
        }
    }
}

/// The agent's side of the TLS handshake and what its `Join` carries: a token agent pins the
/// coordinator's CA and sends the token's secret and a fresh public key; a certificate agent
/// presents `node-<rank>` (its `--rank`, or the only node identity in its directory).
fn agent_tls(a: &AgentArgs) -> Result<AgentTls> {
    match &a.credentials {
        AgentCredentials::Token(text) => {
            let token = JoinToken::parse(text)?;
            let key = NodeKey::generate()?;
            Ok(AgentTls { client: token.client_config(ALPN_CONTROL)?, token: Some(token), key: Some(key), own: None })
        }
        AgentCredentials::Certs(dir) => {
            let rank = match a.rank {
                Some(r) => r,
                None => only_node_in(dir)?,
            };
            let tls =
                NodeTls::load(dir, &node_name(rank)).with_context(|| format!("loading {} from {}", node_name(rank), dir.display()))?;
            Ok(AgentTls { client: tls.client_config_for(ALPN_CONTROL)?, token: None, key: None, own: Some(tls) })
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
fn connect_coordinator(endpoint: &ControlEndpoint, a: &AgentArgs, client: &rustls::ClientConfig) -> Result<ControlConn> {
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
pub enum Answer {
    /// A rank of the first epoch: (rank, world, resolved config, identity).
    Assign(usize, usize, String, Option<AssignedIdentity>),
    /// A running elastic job takes it as worker `id`: (id, resolved config, identity).
    Admit(u64, String, Option<AssignedIdentity>),
}

/// Waits for the coordinator's `Assign` (or, from a running elastic job, `Admit`), answering its
/// pings meanwhile.
pub fn recv_assign(conn: &mut ControlConn, name: &str) -> Result<Answer> {
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

/// The local address this machine uses to reach `peer` (no packet is sent).
pub fn route_to(peer: SocketAddr) -> Result<IpAddr> {
    let any: SocketAddr = if peer.is_ipv4() { ([0, 0, 0, 0], 0).into() } else { (Ipv6Addr::UNSPECIFIED, 0).into() };
    let probe = UdpSocket::bind(any).context("a probe socket")?;
    probe.connect(peer).with_context(|| format!("finding the route to {peer}"))?;
    Ok(probe.local_addr().context("the probe's address")?.ip())
}

/// Where an agent's data-plane sockets bind and what they advertise: `--advertise IP` on every
/// interface, else the local address of its route to the coordinator.
pub fn data_ips(a: &AgentArgs, local_ip: IpAddr) -> (IpAddr, IpAddr) {
    match a.advertise {
        Some(ip) if ip.is_ipv4() => (IpAddr::V4(Ipv4Addr::UNSPECIFIED), ip),
        Some(ip) => (IpAddr::V6(Ipv6Addr::UNSPECIFIED), ip),
        None => (local_ip, local_ip),
    }
}

/// An agent connected to its coordinator (or running driver), its `Join` sent.
pub struct Dialled {
    pub endpoint: Arc<ControlEndpoint>,
    pub conn: ControlConn,
    /// The local address of its route to the coordinator.
    pub local_ip: IpAddr,
    pub tls: AgentTls,
}

/// Dials the coordinator at `a.join` (retrying until it answers, bounded by
/// `a.connect_timeout_ms`) and says `Join`: who it is, the rank and world it was started for,
/// and its proof (the token's secret and a public key to certify, or its certificate).
pub fn dial(a: &AgentArgs) -> Result<Dialled> {
    let name = &a.name;
    let tls = agent_tls(a).with_context(|| format!("agent {name}"))?;
    let v6 = a.join.to_socket_addrs().ok().and_then(|mut x| x.next()).is_some_and(|x| x.is_ipv6());
    let any: SocketAddr = if v6 { (Ipv6Addr::UNSPECIFIED, 0).into() } else { ([0, 0, 0, 0], 0).into() };
    let endpoint = Arc::new(ControlEndpoint::bind(any, None).with_context(|| format!("agent {name}"))?);
    let mut conn = connect_coordinator(&endpoint, a, &tls.client).with_context(|| format!("agent {name}"))?;
    let local_ip = route_to(conn.remote_address())?;
    let join = ToParent::Join {
        name: name.clone(),
        pid: std::process::id(),
        rank: a.rank.map(|r| r as u64),
        world: a.world.map(|w| w as u64),
        version: env!("CARGO_PKG_VERSION").to_string(),
        token: tls.token.as_ref().map(|t| t.secret.to_vec()),
        public_key: tls.key.as_ref().map(NodeKey::public_key),
        host: crate::join::host_id(),
    };
    wire::send(&mut conn, &join).with_context(|| format!("agent {name}: joining {}", a.join))?;
    Ok(Dialled { endpoint, conn, local_ip, tls })
}
