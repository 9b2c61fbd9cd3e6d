//! How a process run's first workers arrive, for the fleet ([`crate::driver::Fleet`]) that drives
//! them — with recovery on (`tessera.elastic.enabled`) or off (the first loss ends the run):
//!
//! - `tessera train --nprocs N`: the driver spawns N `tessera worker` processes on this machine
//!   ([`spawn_worker`]; each in its own process group, so a terminal's Ctrl-C reaches only the
//!   driver, which stops between steps, checkpoints and then ends the workers). Each dials the
//!   driver's control endpoint with its `node-<rank>` certificate (the driver's is checked by
//!   name, [`COORDINATOR_NAME`]), binds its data-plane QUIC socket and says `Hello {rank, pid,
//!   address, config hash}`; [`accept_workers`] checks the certificate's name against the rank
//!   and the hash.
//! - `tessera coordinator` / `tessera launch`: N agents (`tessera agent`, any host) join the
//!   coordinator's control endpoint ([`Rendezvous`], handed to the run in
//!   `TrainOptions::rendezvous`; [`rendezvous_agents`]).
//!
//! # Agents
//! The coordinator waits (bounded by the rendezvous' join timeout; the error names who joined)
//! until N agents said `Join` and proved they belong ([`AgentAuth`]): with a join token (the
//! secret of the token the coordinator printed, sent over TLS the agent verified against the CA
//! the token pins) plus a public key the agent generated, or with a certificate of a
//! pre-distributed cluster directory (`--certs DIR`, mutual TLS; its name fixes the rank). A
//! connection that proves neither is refused and logged; the run goes on. Agents that joined are
//! pinged every [`PING_MS`] while the others come. Ranks are given in join order, except that an
//! agent started with a rank (`--rank`, torchrun's `RANK`, Slurm's `SLURM_PROCID`, or its
//! certificate) gets that one. Each agent then receives `Assign`: its rank, the resolved config
//! and, for a token agent, a `node-<rank>` certificate over its own key with the run's CA. No
//! private key ever travels. From `Hello` on, an agent is served exactly as a spawned worker,
//! plus two checks: the BLAKE3 of its training and validation tokens must equal the
//! coordinator's (hosts may hold different files at the same path), and its QUIC address is the
//! local address on its route to the coordinator (or the one it advertises), so the mesh forms
//! over the network the agents reached the coordinator by.
//!
//! Then every worker gets the addresses and its cut of the start state ([`send_start`]: a header
//! and raw f32 bulk on its own stream), and its state comes back the same way between steps
//! ([`exported`]).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tessera_actors::liveness::Exit;
use tessera_transport::quic::pki::check_cert_names_node;
use tessera_transport::quic::{ClientAuth, ClusterCa, ControlConn, ControlEndpoint, JoinToken, NodeTls, RefusalLog, ALPN_CONTROL};

use crate::relock;
use crate::spec::{FleetSpec, Host, Placement};
use crate::state::{master_window, FleetPlan, OptimBuffers, RankCounters, Start};
use crate::wire::{self, AssignedIdentity, ControlIo, StateCounters, ToParent, ToWorker, Wait, WireError};

/// Bound on the workers' start-up: connecting, loading data, building the QUIC mesh (ms).
pub const STARTUP_TIMEOUT_MS: u64 = 120_000;
/// Bound on the workers' exit after `Shutdown` (ms).
pub const EXIT_TIMEOUT_MS: u64 = 15_000;
/// Default bound on the wait for every agent to join (ms).
pub const JOIN_TIMEOUT_MS: u64 = 120_000;
/// Bound on a new connection's first message (`Join`) (ms).
const JOIN_MESSAGE_TIMEOUT_MS: u64 = 10_000;
/// How often the coordinator pings an idle agent (ms).
const PING_MS: u64 = 5_000;
/// Bound on an agent's answer to a ping (ms).
const PONG_TIMEOUT_MS: u64 = 10_000;
/// How long one wait for a new connection lasts while workers or agents are awaited (ms).
const ACCEPT_POLL_MS: u64 = 50;
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

/// Starts the worker process of rank `r` (where `placement` puts it, else right here).
pub(crate) fn spawn_worker(
    exe: &Path,
    r: usize,
    world: usize,
    control: &str,
    dir: &Path,
    placement: Option<&dyn Placement>,
) -> Result<Child> {
    use std::os::unix::process::CommandExt;
    let mut command = match placement {
        Some(p) => p.command(exe, r)?,
        None => Command::new(exe),
    };
    command
        .args(["worker", "--rank", &r.to_string(), "--world", &world.to_string(), "--control", control])
        .arg("--dir")
        .arg(dir)
        .stdin(Stdio::null())
        .process_group(0)
        .spawn()
        .with_context(|| format!("starting the worker process of rank {r} ({})", exe.display()))
}

/// The checks of every rank's `Hello`: the config hash and a free rank.
fn check_hello(config_hash: &str, world: usize, rank: usize, hash: &str, taken: bool) -> Result<()> {
    if hash != config_hash {
        bail!("worker of rank {rank} resolved the config to hash {hash}, the parent has {config_hash}");
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
    config_hash: &str,
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
        let mut conn = match endpoint.accept(ACCEPT_POLL_MS) {
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
        check_hello(config_hash, world, rank, &hash, got.get(rank).is_some_and(Option::is_some))?;
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
pub(super) fn send_start(stream: &mut (impl ControlIo + ?Sized), plan: &dyn FleetPlan, start: &Start, r: usize) -> Result<()> {
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

/// An agent that said `Join` and proved it belongs to the run.
pub struct Joined {
    pub conn: ControlConn,
    pub name: String,
    pub pid: u32,
    pub peer: SocketAddr,
    /// The rank it asked for (`--rank`), or its certificate names.
    pub rank: Option<usize>,
    /// The agent's own public key, to certify (token agents).
    pub public_key: Option<Vec<u8>>,
    /// Its machine and pid namespace ([`crate::join::host_id`]).
    pub host: String,
}

impl Joined {
    /// "agent NAME at IP (pid PID)".
    pub fn who(&self) -> String {
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
pub struct NotAdmitted(pub String);

/// Reads a new connection's `Join`, authenticates it (`auth`) and checks it against the run.
/// `Ok(Err(_))`: a stranger, refused; `Err(_)`: an authenticated agent that cannot take part,
/// which fails the run with the reason. (Also how `tessera serve-rank`s join a server.)
pub fn read_join(mut conn: ControlConn, nodes: usize, auth: &AgentAuth) -> Result<std::result::Result<Joined, NotAdmitted>> {
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
fn gather_agents(rdv: &Rendezvous, launched_exit: &dyn Fn() -> Option<String>, host: &dyn Host) -> Result<Vec<Joined>> {
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
        if let Some(why) = host.stop_requested() {
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
        match rdv.endpoint.accept(ACCEPT_POLL_MS) {
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
/// messages, and its machine ([`crate::join::host_id`]).
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
    spec: &FleetSpec,
    world: usize,
    rdv: &Rendezvous,
    launched_exit: &dyn Fn() -> Option<String>,
    host: &dyn Host,
) -> Result<Vec<AgentStart>> {
    if rdv.nodes != world {
        bail!("the coordinator waits for {} agents, but the config resolves to world {world}", rdv.nodes);
    }
    let config = serde_json::to_string(&spec.config).context("serialising the resolved config")?;
    let joined = gather_agents(rdv, launched_exit, host)?;
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
        if hash != spec.config_hash {
            bail!("{who} resolved the config to hash {hash}, the coordinator has {}", spec.config_hash);
        }
        let data_blake3 = &spec.data_blake3;
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

/// How the launched process `pid` (`tessera launch`'s local agent) ended, if it is one and did.
pub(super) fn launched_exit_of(launched: &Mutex<Vec<Launched>>, pid: u32) -> Option<Exit> {
    let mut launched = relock(launched);
    let l = launched.iter_mut().find(|l| l.child.id() == pid)?;
    l.child.try_wait().ok().flatten().map(Exit::of)
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
