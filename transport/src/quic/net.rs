//! Connections of the QUIC backend: transport tuning, the full mesh with rank identities
//! checked against certificates, the per-peer reader tasks and the inbox they fill.

use super::frame::{read_message, write_message, Control, FrameError, Key, OpDesc, Payload};
use super::pki::{check_cert_names_node, NodeTls, PkiError};
use quinn::{Connection, Endpoint, VarInt};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// Per-stream receive window: 16 MiB in flight per message (one 10 Gb/s link at 10 ms RTT, or a
/// 100 Gb/s link at 1 ms), so a large tensor streams without waiting for window updates.
pub const STREAM_WINDOW_BYTES: u32 = 16 << 20;
/// Connection receive window and send buffer: several messages (a ring step plus
/// point-to-point traffic) in flight at full speed.
pub const CONNECTION_WINDOW_BYTES: u32 = 64 << 20;
/// Concurrent unidirectional streams a peer may open (one per message in flight).
pub const STREAMS_MAX: u32 = 1024;
/// Idle time after which a silent peer's connection is declared lost.
pub const IDLE_TIMEOUT_MS: u32 = 15_000;
/// Keep-alive period, well under the idle timeout, so idle groups stay connected.
pub const KEEP_ALIVE_MS: u64 = 2_000;

/// UDP socket buffers asked for (each way). Linux's defaults (~208 KiB) drop datagrams whenever
/// a receiver falls a few milliseconds behind a sender filling a 16 MiB stream window, and every
/// drop costs a loss-recovery round and a congestion-window cut. The kernel caps the request at
/// `net.core.{r,w}mem_max` (4 MiB on a stock host); as root the cap is lifted (`*BUFFORCE`).
pub const SOCKET_BUFFER_BYTES: usize = 16 << 20;

/// Enlarges `socket`'s send and receive buffers towards [`SOCKET_BUFFER_BYTES`]: forced when
/// the process may (root), else as far as the system maximum allows. Best effort: a refusal
/// leaves the defaults, which only costs throughput.
pub fn size_socket_buffers(socket: &std::net::UdpSocket) {
    use std::os::fd::AsRawFd;
    let fd = socket.as_raw_fd();
    let want = SOCKET_BUFFER_BYTES as libc::c_int;
    for (force, plain) in [(libc::SO_RCVBUFFORCE, libc::SO_RCVBUF), (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF)] {
        let set = |opt: libc::c_int| {
            // SAFETY: a valid fd and a c_int option value of the right size.
            unsafe {
                libc::setsockopt(
                    fd,
                    libc::SOL_SOCKET,
                    opt,
                    &want as *const libc::c_int as *const libc::c_void,
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            }
        };
        if set(force) != 0 {
            set(plain);
        }
    }
}

/// Why building the mesh failed.
#[derive(Debug, thiserror::Error)]
pub enum QuicError {
    #[error(transparent)]
    Pki(#[from] PkiError),
    #[error("rank {rank}: bad cluster spec: {detail}")]
    Spec { rank: usize, detail: String },
    #[error("rank {rank}: endpoint on {addr}: {detail}")]
    Endpoint { rank: usize, addr: SocketAddr, detail: String },
    #[error("rank {rank}: connecting to rank {peer}: {detail}")]
    Connect { rank: usize, peer: usize, detail: String },
    #[error("rank {rank}: ranks {missing:?} did not connect within {waited_ms} ms")]
    Accept { rank: usize, missing: Vec<usize>, waited_ms: u64 },
    #[error("rank {rank}: cannot start the runtime: {detail}")]
    Runtime { rank: usize, detail: String },
}

/// The group: rank `r` listens on `addrs[r]` and presents a certificate for `names[r]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterSpec {
    pub addrs: Vec<SocketAddr>,
    pub names: Vec<String>,
}

/// Transport settings tuned for bulk tensor transfer (see the module doc of `quic`).
pub fn transport_config() -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    t.stream_receive_window(VarInt::from_u32(STREAM_WINDOW_BYTES))
        .receive_window(VarInt::from_u32(CONNECTION_WINDOW_BYTES))
        .send_window(u64::from(CONNECTION_WINDOW_BYTES))
        .max_concurrent_uni_streams(VarInt::from_u32(STREAMS_MAX))
        .max_concurrent_bidi_streams(VarInt::from_u32(0))
        .max_idle_timeout(Some(VarInt::from_u32(IDLE_TIMEOUT_MS).into()))
        .keep_alive_interval(Some(Duration::from_millis(KEEP_ALIVE_MS)));
    let mut mtu = quinn::MtuDiscoveryConfig::default();
    mtu.upper_bound(8952); // probe up to jumbo frames; stays at 1452 on ordinary Ethernet
    t.mtu_discovery_config(Some(mtu));
    let mut cubic = quinn::congestion::CubicConfig::default();
    cubic.initial_window(u64::from(STREAM_WINDOW_BYTES) / 16);
    t.congestion_controller_factory(Arc::new(cubic));
    t
}

/// What a reader task delivered, keyed by (sender, key).
#[derive(Debug)]
pub(crate) enum Delivery {
    Data(Payload),
    Desc(OpDesc),
}

pub(crate) struct Inbox {
    pub msgs: HashMap<(usize, Key), Delivery>,
    pub aborted: Option<String>,
    /// Why a peer is no longer reachable (it left, or its connection was lost or closed).
    pub gone: Vec<Option<String>>,
    /// Data and descriptor streams fully received from each peer.
    pub streams_done: Vec<u64>,
    pub bye_acked: Vec<bool>,
}

/// State shared by a rank's caller thread, its reader tasks and its abort handles.
pub(crate) struct Shared {
    pub rank: usize,
    state: Mutex<Inbox>,
    pub cv: Condvar,
}

impl Shared {
    pub fn new(rank: usize, world: usize) -> Self {
        let inbox = Inbox {
            msgs: HashMap::new(),
            aborted: None,
            gone: vec![None; world],
            streams_done: vec![0; world],
            bye_acked: vec![false; world],
        };
        Shared { rank, state: Mutex::new(inbox), cv: Condvar::new() }
    }

    pub fn lock(&self) -> MutexGuard<'_, Inbox> {
        // No critical section panics half-way, so a poisoned inbox is still consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Marks the group aborted; true when this call set the reason (the first one wins).
    pub fn abort(&self, reason: &str) -> bool {
        let mut st = self.lock();
        let first = st.aborted.is_none();
        if first {
            st.aborted = Some(reason.to_string());
        }
        self.cv.notify_all();
        first
    }

    pub fn peer_gone(&self, peer: usize, reason: String) {
        let mut st = self.lock();
        if st.gone[peer].is_none() {
            st.gone[peer] = Some(reason);
        }
        self.cv.notify_all();
    }

    /// Files a received message; a repeated key is a protocol violation.
    fn deliver(&self, peer: usize, key: Key, d: Delivery) -> Result<(), String> {
        let mut st = self.lock();
        st.streams_done[peer] += 1;
        self.cv.notify_all();
        match st.msgs.insert((peer, key), d) {
            None => Ok(()),
            Some(_) => Err(format!("duplicate message {key:?}")),
        }
    }
}

/// Opens a unidirectional stream to `conn` and writes one message on it.
pub(crate) async fn write_stream(conn: &Connection, control: &Control, payload: &[u8]) -> Result<(), String> {
    let mut s = conn.open_uni().await.map_err(|e| e.to_string())?;
    write_message(&mut s, control, payload).await.map_err(|e| e.to_string())?;
    s.finish().map_err(|e| e.to_string())
}

/// Tells every connected peer that the group is aborted (best effort, in the background).
pub(crate) fn broadcast_abort(rt: &tokio::runtime::Handle, conns: &[Option<Connection>], reason: &str) {
    for conn in conns.iter().flatten() {
        let (conn, control) = (conn.clone(), Control::Abort { reason: reason.to_string() });
        rt.spawn(async move { write_stream(&conn, &control, &[]).await });
    }
}

/// Closes `conn` after a bad frame or protocol violation, logging why.
fn reject(shared: &Shared, conn: &Connection, peer: usize, why: &str) {
    eprintln!("tessera-quic: rank {}: closing the connection to rank {peer}: {why}", shared.rank);
    conn.close(VarInt::from_u32(1), why.as_bytes());
    shared.peer_gone(peer, format!("connection closed: {why}"));
}

/// Accepts the peer's streams until its connection ends; each stream is read by its own task.
pub(crate) async fn serve_peer(shared: Arc<Shared>, conn: Connection, peer: usize) {
    loop {
        match conn.accept_uni().await {
            Ok(mut stream) => {
                let (shared, conn) = (shared.clone(), conn.clone());
                tokio::spawn(async move {
                    match read_message(&mut stream).await {
                        Ok(msg) => handle(&shared, &conn, peer, msg),
                        Err(FrameError::Io(e)) => shared.peer_gone(peer, format!("stream failed: {e}")),
                        Err(e) => reject(&shared, &conn, peer, &e.to_string()),
                    }
                });
            }
            Err(e) => {
                shared.peer_gone(peer, format!("connection ended: {e}"));
                return;
            }
        }
    }
}

fn handle(shared: &Arc<Shared>, conn: &Connection, peer: usize, msg: (Control, Option<Payload>)) {
    let filed = match msg {
        (Control::Data { key, .. }, Some(p)) => shared.deliver(peer, key, Delivery::Data(p)),
        (Control::Desc { seq, desc }, _) => shared.deliver(peer, Key::Desc { seq }, Delivery::Desc(desc)),
        (Control::Abort { reason }, _) => {
            shared.abort(&format!("rank {peer}: {reason}"));
            Ok(())
        }
        (Control::Bye { streams }, _) => {
            tokio::spawn(ack_bye(shared.clone(), conn.clone(), peer, streams));
            Ok(())
        }
        (Control::ByeAck, _) => {
            shared.lock().bye_acked[peer] = true;
            shared.cv.notify_all();
            Ok(())
        }
        (other, _) => Err(format!("unexpected {other:?} on an established connection")),
    };
    if let Err(why) = filed {
        reject(shared, conn, peer, &why);
    }
}

/// Once every stream the leaving peer announced has been filed, confirms and marks it gone.
async fn ack_bye(shared: Arc<Shared>, conn: Connection, peer: usize, streams: u64) {
    let give_up = Instant::now() + Duration::from_millis(u64::from(IDLE_TIMEOUT_MS));
    while shared.lock().streams_done[peer] < streams && Instant::now() < give_up {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // The peer closes the connection once acknowledged; nothing to do if that already happened.
    let _ = write_stream(&conn, &Control::ByeAck, &[]).await;
    shared.peer_gone(peer, "it left the group".into());
}

/// Dials every lower rank and accepts every higher one; returns one connection per peer.
pub(crate) async fn build_mesh(
    endpoint: &Endpoint,
    rank: usize,
    spec: &ClusterSpec,
    tls: &NodeTls,
    deadline: Instant,
) -> Result<Vec<Option<Connection>>, QuicError> {
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls.client_config()?)
        .map_err(|e| QuicError::Pki(PkiError::Tls(e.to_string())))?;
    let mut client = quinn::ClientConfig::new(Arc::new(crypto));
    client.transport_config(Arc::new(transport_config()));
    let (lower, higher) = tokio::join!(dial_lower(endpoint, rank, spec, &client, deadline), accept_higher(endpoint, rank, spec, deadline));
    let mut conns: Vec<Option<Connection>> = vec![None; spec.addrs.len()];
    for (peer, conn) in lower?.into_iter().chain(higher?) {
        conns[peer] = Some(conn);
    }
    Ok(conns)
}

async fn dial_lower(
    endpoint: &Endpoint,
    rank: usize,
    spec: &ClusterSpec,
    client: &quinn::ClientConfig,
    deadline: Instant,
) -> Result<Vec<(usize, Connection)>, QuicError> {
    let mut out = Vec::new();
    for peer in 0..rank {
        let err = |detail: String| QuicError::Connect { rank, peer, detail };
        let conn = loop {
            let connecting = endpoint.connect_with(client.clone(), spec.addrs[peer], &spec.names[peer]).map_err(|e| err(e.to_string()))?;
            let attempt = (Instant::now() + Duration::from_millis(1_000)).min(deadline);
            match tokio::time::timeout_at(attempt.into(), connecting).await {
                Ok(Ok(conn)) => break conn,
                Ok(Err(e)) => return Err(err(e.to_string())),
                Err(_) if Instant::now() >= deadline => return Err(err("no answer before the deadline".into())),
                Err(_) => continue, // the peer may not be listening yet
            }
        };
        let world = spec.addrs.len() as u32;
        write_stream(&conn, &Control::Hello { rank: rank as u32, world }, &[]).await.map_err(err)?;
        // The peer answers only after checking our certificate and rank.
        let answer = tokio::time::timeout_at(deadline.into(), read_hello(&conn)).await;
        match answer {
            Ok(Ok((r, _))) if r == peer => out.push((peer, conn)),
            Ok(Ok((r, _))) => return Err(err(format!("it answered as rank {r}"))),
            Ok(Err(e)) => return Err(err(e)),
            Err(_) => return Err(err("no hello before the deadline".into())),
        }
    }
    Ok(out)
}

async fn read_hello(conn: &Connection) -> Result<(usize, usize), String> {
    let mut s = conn.accept_uni().await.map_err(|e| e.to_string())?;
    match read_message(&mut s).await.map_err(|e| e.to_string())? {
        (Control::Hello { rank, world }, _) => Ok((rank as usize, world as usize)),
        (other, _) => Err(format!("expected a hello, got {other:?}")),
    }
}

async fn accept_higher(
    endpoint: &Endpoint,
    rank: usize,
    spec: &ClusterSpec,
    deadline: Instant,
) -> Result<Vec<(usize, Connection)>, QuicError> {
    let world = spec.addrs.len();
    let start = Instant::now();
    let mut out: Vec<(usize, Connection)> = Vec::new();
    while out.len() < world - 1 - rank {
        let Ok(Some(incoming)) = tokio::time::timeout_at(deadline.into(), endpoint.accept()).await else {
            let missing = (rank + 1..world).filter(|p| !out.iter().any(|(q, _)| q == p)).collect();
            return Err(QuicError::Accept { rank, missing, waited_ms: start.elapsed().as_millis() as u64 });
        };
        match tokio::time::timeout_at(deadline.into(), admit(incoming, rank, spec, &out)).await {
            Ok(Ok(pair)) => out.push(pair),
            Ok(Err(why)) => eprintln!("tessera-quic: rank {rank}: refused a peer: {why}"),
            Err(_) => eprintln!("tessera-quic: rank {rank}: a peer did not finish connecting before the deadline"),
        }
    }
    Ok(out)
}

/// Completes an incoming handshake (the TLS layer has already checked the CA signature) and
/// checks that the claimed rank is a higher one, new, and named in the peer's certificate.
async fn admit(
    incoming: quinn::Incoming,
    rank: usize,
    spec: &ClusterSpec,
    have: &[(usize, Connection)],
) -> Result<(usize, Connection), String> {
    let conn = incoming.await.map_err(|e| format!("handshake failed: {e}"))?;
    let refuse = |why: String| {
        conn.close(VarInt::from_u32(2), why.as_bytes());
        Err(why)
    };
    let (peer, world) = match read_hello(&conn).await {
        Ok(h) => h,
        Err(e) => return refuse(format!("no hello: {e}")),
    };
    if world != spec.addrs.len() || peer <= rank || peer >= world || have.iter().any(|(p, _)| *p == peer) {
        return refuse(format!("claims rank {peer} of {world}; expected a new rank in {}..{}", rank + 1, spec.addrs.len()));
    }
    let certs = conn.peer_identity().and_then(|id| id.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>().ok());
    let Some(cert) = certs.as_ref().and_then(|c| c.first()) else {
        return refuse("no client certificate".into());
    };
    if let Err(why) = check_cert_names_node(cert, &spec.names[peer]) {
        return refuse(format!("claims rank {peer}: {why}"));
    }
    let hello = Control::Hello { rank: rank as u32, world: world as u32 };
    write_stream(&conn, &hello, &[]).await?;
    Ok((peer, conn))
}
