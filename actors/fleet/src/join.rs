//! Who may talk to a running elastic driver, over its QUIC control endpoint (the driver's
//! side; the design is in [`crate::driver`]): side connections of members and joins of new
//! workers or agents.
//!
//! # Side connections
//! Every worker opens a second control connection after it started (`Side { id }`), with the
//! certificate of `node-<id>`: heartbeats, `Draining`, and the driver's `Abort`. One without a
//! certificate, with another node's, or under an id that was fenced or never admitted is
//! answered `Refused` and closed (the worker exits).
//!
//! # Joins
//! A process joins a running job the way an agent joins a coordinator (`Join`, see
//! [`crate::rendezvous`]): `tessera agent --join HOST:PORT --token …` on any host, or
//! `tessera worker --join --dir <output>/procs` next to a `train --nprocs` driver (it reads the
//! address and the run's join token there). With a join token it verified the driver against
//! the CA the token pins, sends the token's secret and a public key it generated, and gets an
//! id and a certificate for `node-<id>` over that key (no private key travels); with a cluster
//! directory (`--certs`) it presents its own `node-<k>` certificate and runs as id `k`. The
//! driver answers `Admit { id, config, identity }`; the joiner loads the data, says `Hello`
//! (the BLAKE3 of its data must equal the driver's), opens its side connection and waits for
//! the next step boundary, where it becomes a member. At most `tessera.elastic.max_joins`
//! join; the ids are never reused.
//!
//! # Processes on this host
//! A joiner says which machine and pid namespace it runs in ([`host_id`]). When that is the
//! driver's, the driver watches it through a pidfd ([`Pidfd`]): its exit is a loss at once
//! (QUIC, unlike TCP, gets no reset from a killed peer), and a loss kills it (SIGKILL through the
//! pidfd: never another process that took its pid). Elsewhere the heartbeat timeout notices a
//! dead joiner, and a fenced one leaves on its own when its side connection closes.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::json;
use tessera_transport::quic::pki::check_cert_names_node;
use tessera_transport::quic::{ControlConn, ControlEndpoint, RefusalLog};

use crate::driver::{Beat, Joiner, Shared};
use crate::relock;
use crate::rendezvous::{node_name, AgentAuth, STARTUP_TIMEOUT_MS};
use crate::wire::{self, AssignedIdentity, ToParent, ToWorker, Wait};

/// How often the acceptor looks for new connections (ms).
pub(super) const ACCEPT_POLL_MS: u64 = 20;
/// Bound on the first message of a new connection that presented a certificate of the run's CA
/// (ms).
const FIRST_MESSAGE_MS: u64 = 10_000;
/// Bound on the first message of a connection without a certificate (a join with a token, or
/// anybody who can reach the port), ms: short, so silent connections cannot hold the slots.
const ANON_FIRST_MESSAGE_MS: u64 = 2_000;
/// Certified connections being admitted at once; more are turned away (each holds a thread).
const ADMITTING_MAX: usize = 32;
/// Connections without a certificate being admitted at once: a pool of their own, so that
/// strangers filling it cannot turn away members' side connections.
const ANON_ADMITTING_MAX: usize = 8;

/// What joiners are checked against and given.
pub(super) struct Admission {
    /// How they prove they belong (a join token and the run CA, or a cluster directory).
    pub auth: AgentAuth,
    /// The resolved config (JSON text), sent to every joiner.
    pub config: String,
    /// BLAKE3 of the driver's training and validation tokens (`child::data_blake3`).
    pub data_blake3: String,
    /// This process's [`host_id`].
    pub host: String,
}

/// Which machine and pid namespace this process runs in: the kernel's boot id and the pid
/// namespace's inode ("" when unknown, which matches nothing). Two processes with the same
/// value see each other's pids.
pub fn host_id() -> String {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|s| s.trim().to_string());
    let pidns = std::fs::read_link("/proc/self/ns/pid").map(|p| p.display().to_string());
    match (boot, pidns) {
        (Ok(b), Ok(p)) if !b.is_empty() => format!("{b}/{p}"),
        _ => String::new(),
    }
}

/// A process of this host held by a pidfd (`pidfd_open(2)`): its exit can be polled and it can
/// be signalled without the risk of reaching a process that took its pid later.
pub(super) struct Pidfd(OwnedFd);

impl Pidfd {
    /// The process `pid`, if it exists.
    pub fn open(pid: u32) -> Option<Pidfd> {
        let pid = libc::pid_t::try_from(pid).ok().filter(|p| *p > 0)?;
        // SAFETY: pidfd_open(2) takes a pid and flags and returns a new descriptor or -1; no
        // memory is passed.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        let fd = i32::try_from(fd).ok().filter(|fd| *fd >= 0)?;
        // SAFETY: `fd` was just returned by the kernel and is owned by nothing else.
        Some(Pidfd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Whether the process has ended (a pidfd polls readable then).
    pub fn exited(&self) -> bool {
        let mut p = libc::pollfd { fd: self.0.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: poll(2) on one valid pollfd that lives for the call; zero timeout.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        n > 0 && p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0
    }

    /// SIGKILLs the process.
    pub fn kill(&self) {
        // SAFETY: pidfd_send_signal(2) with our descriptor, a signal number, no siginfo and no
        // flags; failure (it is gone) is harmless.
        unsafe {
            libc::syscall(libc::SYS_pidfd_send_signal, self.0.as_raw_fd(), libc::SIGKILL, std::ptr::null::<libc::siginfo_t>(), 0);
        }
    }
}

/// Accepts connections on the driver's control endpoint until the run closes; each is admitted
/// on a thread of its own, so a slow joiner holds up nobody. Connections with a certificate of
/// the run's CA (the TLS handshake verified it) and those without one have separate bounds
/// ([`ADMITTING_MAX`], [`ANON_ADMITTING_MAX`]) and first-message deadlines.
pub(super) fn acceptor(shared: Arc<Shared>, endpoint: Arc<ControlEndpoint>, early: Vec<(ControlConn, ToParent)>) {
    let (certified, anonymous) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let serve = |conn: ControlConn, first: Option<ToParent>| {
        let has_cert = conn.peer_certificate().is_some();
        let (pool, max, first_ms) =
            if has_cert { (&certified, ADMITTING_MAX, FIRST_MESSAGE_MS) } else { (&anonymous, ANON_ADMITTING_MAX, ANON_FIRST_MESSAGE_MS) };
        if pool.fetch_add(1, Ordering::SeqCst) >= max {
            pool.fetch_sub(1, Ordering::SeqCst);
            conn.abort("too many connections being admitted; try again");
            return;
        }
        let (s, busy) = (Arc::clone(&shared), Arc::clone(pool));
        let spawned = std::thread::Builder::new().name("tessera-admit".into()).spawn(move || {
            let peer = conn.remote_address();
            if let Err(e) = admit(&s, conn, first, first_ms) {
                tracing::info!("elastic: a connection from {peer}: {e:#}");
            }
            busy.fetch_sub(1, Ordering::SeqCst);
        });
        if spawned.is_err() {
            pool.fetch_sub(1, Ordering::SeqCst);
        }
    };
    for (conn, first) in early {
        serve(conn, Some(first));
    }
    let mut refusals = RefusalLog::new("elastic: refused a connection");
    while !shared.closing.load(Ordering::SeqCst) {
        match endpoint.accept(ACCEPT_POLL_MS) {
            Ok(Some(conn)) => serve(conn, None),
            Ok(None) => {}
            Err(why) => refusals.refused(&why),
        }
    }
}

/// Serves a new connection whose first message is `first` (else read here, within
/// `first_ms`): a side connection or a join.
fn admit(shared: &Arc<Shared>, mut conn: ControlConn, first: Option<ToParent>, first_ms: u64) -> Result<()> {
    let first = match first {
        Some(m) => m,
        None => {
            let deadline = Some(Instant::now() + Duration::from_millis(first_ms));
            let wait = Wait { what: "a first message", deadline, alive: &|| Ok(()) };
            match wire::recv::<ToParent>(&mut conn, "Side or Join", &wait) {
                Ok(m) => m,
                Err(e) => {
                    conn.abort("no valid first message");
                    return Err(e).context("reading its first message");
                }
            }
        }
    };
    match first {
        ToParent::Side { id } => side(shared, conn, id),
        ToParent::Join { name, pid, version, token, public_key, host, .. } => {
            join(shared, conn, JoinRequest { name, pid, version, token, public_key, host })
        }
        other => {
            conn.abort("expected Side or Join");
            bail!("it opened with {other:?}")
        }
    }
}

/// How long a refusal waits for the peer to read it and close (a peer that does not is cut
/// off after it).
const REFUSE_LINGER_MS: u64 = 1_000;

/// Refuses `conn` with `error` (the peer prints it and leaves).
fn refuse(mut conn: ControlConn, error: String) -> Result<()> {
    let sent = wire::send(&mut conn, &ToWorker::Refused { error: error.clone() });
    conn.close_when_read("refused", REFUSE_LINGER_MS);
    sent?;
    bail!("refused: {error}")
}

/// A side connection of worker `id` (see the module doc).
fn side(shared: &Arc<Shared>, conn: ControlConn, id: u64) -> Result<()> {
    let named = conn.peer_certificate().map(|c| check_cert_names_node(&c, &node_name(id as usize)));
    match named {
        None => return refuse(conn, format!("a side connection for worker {id} without a certificate")),
        Some(Err(e)) => return refuse(conn, format!("a side connection for worker {id}: {e}")),
        Some(Ok(())) => {}
    }
    if shared.is_fenced(id) {
        // A fenced worker never comes back under its id (a new process joins with a new one);
        // it reads this and leaves.
        return refuse(conn, format!("worker {id} was declared lost and is fenced: it cannot come back under that id"));
    }
    if !relock(&shared.known).contains(&id) {
        return refuse(conn, format!("no worker {id} was admitted"));
    }
    let beat = Arc::clone(relock(&shared.beats).entry(id).or_insert_with(|| Beat::new(0)));
    *relock(&beat.last) = Instant::now();
    relock(&shared.sides).insert(id, conn.clone());
    if shared.is_fenced(id) {
        // Fenced between the check above and the insert: the loss did not see this connection.
        relock(&shared.sides).remove(&id);
        relock(&shared.beats).remove(&id);
        return refuse(conn, format!("worker {id} was declared lost and is fenced: it cannot come back under that id"));
    }
    let s = Arc::clone(shared);
    std::thread::Builder::new().name(format!("tessera-side-{id}")).spawn(move || side_reader(s, id, conn, beat))?;
    Ok(())
}

/// Reads a worker's side connection: heartbeats and drain requests.
fn side_reader(shared: Arc<Shared>, id: u64, mut conn: ControlConn, beat: Arc<Beat>) {
    loop {
        let wait = Wait { what: "heartbeats", deadline: None, alive: &|| Ok(()) };
        match wire::recv::<ToParent>(&mut conn, "Heartbeat", &wait) {
            Ok(ToParent::Heartbeat) => *relock(&beat.last) = Instant::now(),
            Ok(ToParent::Draining) => {
                if !beat.draining.swap(true, Ordering::SeqCst) {
                    tracing::info!("elastic: worker {id} got SIGTERM; it leaves at the next step boundary");
                    shared.event(json!({"event": "drain_requested", "id": id, "pid": beat.pid()}));
                }
            }
            Ok(_) => {}
            Err(_) => {
                beat.closed.store(true, std::sync::atomic::Ordering::SeqCst);
                return;
            }
        }
    }
}

/// What a `Join` says.
struct JoinRequest {
    name: String,
    pid: u32,
    version: String,
    token: Option<Vec<u8>>,
    public_key: Option<Vec<u8>>,
    host: String,
}

/// A worker or agent joining the running job (see the module doc).
fn join(shared: &Arc<Shared>, mut conn: ControlConn, j: JoinRequest) -> Result<()> {
    let peer = conn.remote_address();
    let who = format!("{} at {} (pid {})", j.name, peer.ip(), j.pid);
    if shared.closing.load(Ordering::SeqCst) {
        wire::send(&mut conn, &ToWorker::Shutdown)?;
        return Ok(());
    }
    // Who it is first (a stranger learns nothing, not even the version), then the version.
    let (id, identity) = match &shared.admission.auth {
        AgentAuth::Token { ca, token } => {
            if !j.token.as_deref().is_some_and(|s| token.admits(s)) {
                conn.abort("wrong join token");
                bail!("{who} did not present this run's join token");
            }
            let Some(key) = j.public_key.as_deref() else { return refuse(conn, format!("{who} sent no public key to certify")) };
            if let Some(e) = version_mismatch(&j.version, &who) {
                return refuse(conn, e);
            }
            if !shared.er.enabled {
                return refuse(conn, format!("{who}: this run is not elastic (tessera.elastic.enabled = false): it takes no joins"));
            }
            let Some(id) = shared.take_id() else {
                let n = shared.er.max_joins;
                return refuse(conn, format!("no worker identity left for a join (tessera.elastic.max_joins allows {n})"));
            };
            match ca.sign_node_key(&node_name(id as usize), key) {
                Ok(cert_pem) => (id, Some(AssignedIdentity { ca_pem: ca.ca_pem(), cert_pem })),
                Err(e) => {
                    shared.forget(id); // never handed out: fenced, so it cannot turn up later
                    return refuse(conn, format!("certifying the key of {who}: {e:#}"));
                }
            }
        }
        AgentAuth::Certs { .. } => {
            let Some(cert) = conn.peer_certificate() else { return refuse(conn, format!("{who} presents no certificate")) };
            let Some(id) = (0..shared.ids).find(|&k| check_cert_names_node(&cert, &node_name(k as usize)).is_ok()) else {
                return refuse(conn, format!("{who} presents a certificate for none of node-0..node-{}", shared.ids.saturating_sub(1)));
            };
            if let Some(e) = version_mismatch(&j.version, &who) {
                return refuse(conn, e);
            }
            if !shared.er.enabled {
                return refuse(conn, format!("{who}: this run is not elastic (tessera.elastic.enabled = false): it takes no joins"));
            }
            if shared.is_fenced(id) || !relock(&shared.known).insert(id) {
                return refuse(conn, format!("{who}: {} is already in this run (or was fenced)", node_name(id as usize)));
            }
            (id, None)
        }
    };
    let config = shared.admission.config.clone();
    if let Err(e) = wire::send(&mut conn, &ToWorker::Admit { id, config, identity }) {
        match shared.admission.auth {
            // A token's id was made for this joiner alone: never used again.
            AgentAuth::Token { .. } => shared.forget(id),
            // A node's own id: it may try again.
            AgentAuth::Certs { .. } => {
                relock(&shared.known).remove(&id);
            }
        }
        return Err(e).with_context(|| format!("admitting {who}"));
    }
    if let Err(e) = hello(shared, &mut conn, id, &who) {
        shared.forget(id);
        return refuse(conn, format!("{e:#}"));
    }
    let beat = Arc::clone(relock(&shared.beats).entry(id).or_insert_with(|| Beat::new(j.pid)));
    beat.set_pid(j.pid);
    if !j.host.is_empty() && j.host == shared.admission.host && runs_this_binary(j.pid) {
        *relock(&beat.local) = Pidfd::open(j.pid);
    }
    relock(&shared.controls).insert(id, conn.clone());
    relock(&shared.joiners).push(Joiner { id, pid: j.pid, conn });
    tracing::info!("elastic: worker {id} ({who}) joined; it becomes a member at the next step boundary");
    shared.event(json!({"event": "join_requested", "id": id, "pid": j.pid, "name": j.name}));
    Ok(())
}

/// Why a joiner running `tessera` version `theirs` cannot join this driver, if it cannot.
fn version_mismatch(theirs: &str, who: &str) -> Option<String> {
    let mine = env!("CARGO_PKG_VERSION");
    (theirs != mine).then(|| format!("{who} runs tessera {theirs}, the driver {mine}"))
}

/// Whether process `pid` of this host runs the same executable file as this process (device
/// and inode of `/proc/<pid>/exe`): the driver watches and may SIGKILL a joiner by the pid it
/// claims, so it must at least be a Tessera process, never any process a peer names.
fn runs_this_binary(pid: u32) -> bool {
    use std::os::unix::fs::MetadataExt;
    if pid == 0 {
        return false;
    }
    match (std::fs::metadata(format!("/proc/{pid}/exe")), std::fs::metadata("/proc/self/exe")) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// Waits (bounded: loading the data) for a joiner's `Hello` and checks its config and data.
fn hello(shared: &Shared, conn: &mut ControlConn, id: u64, who: &str) -> Result<()> {
    let deadline = Some(Instant::now() + Duration::from_millis(STARTUP_TIMEOUT_MS));
    let closing = || match shared.closing.load(Ordering::SeqCst) {
        true => Err(wire::WireError::Io(std::io::Error::other("the run is finishing"))),
        false => Ok(()),
    };
    let wait = Wait { what: "Hello", deadline, alive: &closing };
    let (rank, hash, data) = match wire::recv(conn, "Hello", &wait).with_context(|| format!("waiting for {who} to load its data"))? {
        ToParent::Hello { rank, config_hash, data_blake3, .. } => (rank, config_hash, data_blake3),
        ToParent::Failed { error } => bail!("{who} could not start: {error}"),
        other => bail!("{who} answered Admit with {other:?}"),
    };
    if rank != id {
        bail!("{who} says it is worker {rank}, it was admitted as {id}");
    }
    if hash != shared.cfg_hash {
        bail!("{who} resolved the config to hash {hash}, the run has {}", shared.cfg_hash);
    }
    if data.as_deref() != Some(shared.admission.data_blake3.as_str()) {
        bail!(
            "{who} loaded different training data (tokens BLAKE3 {}, the driver's {}): every host needs the same data at the path the config names",
            data.as_deref().unwrap_or("none"),
            shared.admission.data_blake3
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    //! Who the elastic endpoint turns away: real QUIC connections with mutual TLS on loopback,
    //! against the acceptor a driver runs.
    use super::*;
    use crate::spec::ElasticRun;
    use std::collections::BTreeMap;
    use tessera_transport::quic::{ClientAuth, ClusterCa, JoinToken, NodeKey, NodeTls, ALPN_CONTROL};

    use crate::rendezvous::COORDINATOR_NAME;

    /// Bound on each exchange in these tests (ms).
    const TEST_WAIT_MS: u64 = 10_000;

    fn wait() -> Wait<'static> {
        Wait { what: "the driver's answer", deadline: Some(Instant::now() + Duration::from_millis(TEST_WAIT_MS)), alive: &|| Ok(()) }
    }

    /// What the run's CA issued before the driver took it: `node-<k>` identities and its
    /// fingerprint.
    struct Issued {
        nodes: BTreeMap<usize, NodeTls>,
        ca_sha256: [u8; 32],
    }

    /// A driver's acceptor for 2 first-epoch workers with a join token, running with `er`; id 1
    /// is fenced. Returns (shared state, endpoint address, identities of node-0, -1 and -7 from
    /// the run's CA, its token, the acceptor thread).
    fn driver(
        dir: &std::path::Path,
        er: ElasticRun,
    ) -> (Arc<Shared>, std::net::SocketAddr, Issued, JoinToken, std::thread::JoinHandle<()>) {
        let ca = ClusterCa::generate().expect("CA");
        let nodes = [0, 1, 7].into_iter().map(|k| (k, ca.issue(&node_name(k)).expect("id"))).collect();
        let issued = Issued { nodes, ca_sha256: ca.ca_sha256() };
        let token = JoinToken::generate(ca.ca_sha256()).expect("token");
        let server = ca.issue(COORDINATOR_NAME).expect("identity").server_config_for(ALPN_CONTROL, ClientAuth::Optional).expect("tls");
        let endpoint = Arc::new(ControlEndpoint::bind(([127, 0, 0, 1], 0).into(), Some(server)).expect("bind"));
        let addr = endpoint.local_addr().expect("addr");
        let auth = AgentAuth::Token { ca: Box::new(ca), token: token.clone() };
        let admission = Admission { auth, config: "{}".into(), data_blake3: "d".into(), host: host_id() };
        let events = std::fs::File::create(dir.join("events.jsonl")).expect("events");
        let shared = Arc::new(Shared::for_tests(er, 2, admission, events));
        shared.fence_for_tests(1);
        let s = Arc::clone(&shared);
        let t = std::thread::spawn(move || acceptor(s, endpoint, Vec::new()));
        (shared, addr, issued, token, t)
    }

    /// Dials the driver with `client` and sends `first`; returns the answer (Err: none came,
    /// the connection was closed or the handshake failed).
    fn ask(
        addr: std::net::SocketAddr,
        client: tessera_transport::quic::rustls::ClientConfig,
        first: &ToParent,
    ) -> Result<ToWorker, String> {
        let local = ControlEndpoint::bind(([127, 0, 0, 1], 0).into(), None).map_err(|e| e.to_string())?;
        let mut conn = local.connect(addr, COORDINATOR_NAME, client, TEST_WAIT_MS).map_err(|e| format!("connect: {e}"))?;
        wire::send(&mut conn, first).map_err(|e| format!("send: {e}"))?;
        let got = wire::recv::<ToWorker>(&mut conn, "an answer", &wait()).map_err(|e| format!("recv: {e}"));
        conn.close("bye");
        got
    }

    fn join(token: Option<&JoinToken>) -> ToParent {
        ToParent::Join {
            name: "j".into(),
            pid: std::process::id(),
            rank: None,
            world: None,
            version: env!("CARGO_PKG_VERSION").into(),
            token: token.map(|t| t.secret.to_vec()),
            public_key: Some(NodeKey::generate().expect("key").public_key()),
            host: String::new(),
        }
    }

    #[test]
    fn foreign_wrong_fenced_and_tokenless_peers_are_refused() {
        let tmp = tempfile::tempdir().expect("tmp");
        let (shared, addr, ca, token, acceptor_thread) = driver(tmp.path(), ElasticRun { enabled: true, ..ElasticRun::default() });
        let side = |id| ToParent::Side { id };
        let refused = |r: Result<ToWorker, String>, want: &str| match r {
            Ok(ToWorker::Refused { error }) => assert!(error.contains(want), "refused for another reason: {error}"),
            other => panic!("expected Refused ({want}), got {other:?}"),
        };
        let node = |k: usize| ca.nodes[&k].client_config_for(ALPN_CONTROL).expect("tls");

        // A certificate the run's CA did not sign: the handshake fails, nothing is registered.
        let foreign = ClusterCa::generate().expect("CA").issue(&node_name(0)).expect("id");
        let r = ask(addr, foreign.client_config_for(ALPN_CONTROL).expect("tls"), &side(0));
        assert!(
            !matches!(r, Ok(ToWorker::Refused { .. }) | Ok(ToWorker::Admit { .. })) && r.is_err(),
            "a foreign CA's certificate got {r:?}"
        );
        // Another node's certificate, a fenced id, an id never admitted, no certificate at all.
        refused(ask(addr, node(0), &side(1)), "node-1");
        refused(ask(addr, node(1), &side(1)), "fenced");
        refused(ask(addr, node(7), &side(7)), "no worker 7 was admitted");
        refused(ask(addr, token.client_config(ALPN_CONTROL).expect("tls"), &side(0)), "without a certificate");
        // A join without the run's token is dropped without an answer; a wrong token too.
        let r = ask(addr, token.client_config(ALPN_CONTROL).expect("tls"), &join(None));
        assert!(r.is_err(), "a join without a token got {r:?}");
        let other = JoinToken::generate(ca.ca_sha256).expect("token");
        let r = ask(addr, token.client_config(ALPN_CONTROL).expect("tls"), &join(Some(&other)));
        assert!(r.is_err(), "a join with a wrong token got {r:?}");
        assert!(relock(&shared.sides).is_empty() && relock(&shared.joiners).is_empty(), "a refused peer was registered");
        assert_eq!(relock(&shared.known).len(), 2, "a refused join took an id");

        // The one that belongs: worker 0 with its own certificate gets its side connection.
        let local = ControlEndpoint::bind(([127, 0, 0, 1], 0).into(), None).expect("bind");
        let mut conn = local.connect(addr, COORDINATOR_NAME, node(0), TEST_WAIT_MS).expect("connect");
        wire::send(&mut conn, &side(0)).expect("send");
        let deadline = Instant::now() + Duration::from_millis(TEST_WAIT_MS);
        while !relock(&shared.sides).contains_key(&0) {
            assert!(Instant::now() < deadline, "worker 0's side connection was not taken");
            std::thread::sleep(Duration::from_millis(10));
        }
        // And a joiner with the run's token is admitted under a new id with a certificate for
        // the key it sent, signed by the run's CA.
        let key = NodeKey::generate().expect("key");
        let mut j = join(Some(&token));
        if let ToParent::Join { public_key, .. } = &mut j {
            *public_key = Some(key.public_key());
        }
        let local2 = ControlEndpoint::bind(([127, 0, 0, 1], 0).into(), None).expect("bind");
        let mut jc =
            local2.connect(addr, COORDINATOR_NAME, token.client_config(ALPN_CONTROL).expect("tls"), TEST_WAIT_MS).expect("connect");
        wire::send(&mut jc, &j).expect("send");
        match wire::recv::<ToWorker>(&mut jc, "Admit", &wait()).expect("an answer") {
            ToWorker::Admit { id, identity: Some(identity), .. } => {
                assert_eq!(id, 2, "the first free id after the first epoch's");
                let tls = key.identity(&identity.ca_pem, &identity.cert_pem).expect("the issued certificate fits the key");
                assert_eq!(tls.ca_sha256(), ca.ca_sha256);
            }
            other => panic!("expected Admit with an identity, got {other:?}"),
        }
        jc.close("bye");
        conn.close("bye");
        shared.closing.store(true, Ordering::SeqCst);
        acceptor_thread.join().expect("acceptor");
    }

    /// A run whose recovery is off (a plain process run) admits no join, even with its token,
    /// and says why; no id is taken.
    #[test]
    fn a_run_without_recovery_refuses_joins_saying_why() {
        let tmp = tempfile::tempdir().expect("tmp");
        let off = ElasticRun { enabled: false, max_joins: 0, replicas: 0, ..ElasticRun::default() };
        let (shared, addr, _ca, token, acceptor_thread) = driver(tmp.path(), off);
        match ask(addr, token.client_config(ALPN_CONTROL).expect("tls"), &join(Some(&token))) {
            Ok(ToWorker::Refused { error }) => assert!(error.contains("this run is not elastic"), "{error}"),
            other => panic!("expected Refused, got {other:?}"),
        }
        assert!(relock(&shared.joiners).is_empty() && relock(&shared.known).len() == 2, "the refused joiner was registered");
        shared.closing.store(true, Ordering::SeqCst);
        acceptor_thread.join().expect("acceptor");
    }
}
