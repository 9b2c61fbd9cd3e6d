//! The control plane's transport: one QUIC connection per driver ↔ worker (or agent) pair, with
//! TLS 1.3 from [`super::pki`] (mutual TLS against the cluster CA, or a server pinned by a
//! [`JoinToken`](super::pki::JoinToken) for an agent that has no certificate yet).
//!
//! # Streams
//! The dialer opens [`LANES`] bidirectional streams at once and names each with its first byte;
//! each lane carries frames in order both ways (`[u32 LE length ≤ FRAME_BYTES_MAX][bytes]`):
//! lane [`LANE_REQUESTS`] the driver's requests and their replies, lane [`LANE_ACTORS`] actor
//! messages, so a long step's actor traffic never sits in front of a ping. The frames' content is
//! the caller's (the engine sends rkyv messages and validates them with bytecheck). Bulk state
//! goes on its own unidirectional stream per transfer ([`ControlConn::send_bulk`]): raw bytes of
//! lengths the receiver checked against its plan before reading.
//!
//! # Threads and bounds
//! A [`ControlEndpoint`] owns a one-thread tokio runtime that runs, per connection, one writer
//! and one reader task per lane and one task accepting bulk streams. Callers are plain threads
//! (never tasks of a tokio runtime): [`ControlConn::send`] queues a frame (at most
//! [`LANE_QUEUE_FRAMES`] per lane, [`SEND_TIMEOUT_MS`] to get a place),
//! [`ControlConn::try_send`] queues it without waiting (for actors), [`ControlConn::recv`] waits at
//! most the poll it is given, so the caller can check its own deadline and liveness between polls.
//! A frame over the limit closes the connection with the reason. Keep-alives every
//! [`KEEP_ALIVE_MS`] and an idle timeout of [`IDLE_TIMEOUT_MS`] notice a peer that vanished without
//! closing (a killed process).

use super::net::{endpoint_config, size_socket_buffers};
use quinn::{Connection, Endpoint, RecvStream, SendStream, VarInt};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;

/// Bidirectional streams per connection.
pub const LANES: usize = 2;
/// The lane of requests and replies.
pub const LANE_REQUESTS: usize = 0;
/// The lane of actor messages.
pub const LANE_ACTORS: usize = 1;
/// Largest frame accepted, in bytes.
pub const FRAME_BYTES_MAX: usize = 1 << 20;
/// Frames queued per lane and direction before a sender waits.
pub const LANE_QUEUE_FRAMES: usize = 64;
/// Bulk streams received but not yet read, per connection.
pub const BULK_QUEUE_STREAMS: usize = 4;
/// Bound on the wait for room in a lane's queue, in ms.
pub const SEND_TIMEOUT_MS: u64 = 30_000;
/// Bound on the TLS handshake and the opening of the lanes, in ms.
pub const HANDSHAKE_TIMEOUT_MS: u64 = 10_000;
/// Idle time after which a silent peer's connection is lost, in ms.
pub const IDLE_TIMEOUT_MS: u32 = 10_000;
/// Keep-alive period, in ms.
pub const KEEP_ALIVE_MS: u64 = 1_000;
/// Bound on flushing queued frames when a connection is closed, in ms.
pub const CLOSE_FLUSH_MS: u64 = 2_000;
/// Stream receive window (bulk state of a large rank streams without stalls), bytes.
const STREAM_WINDOW_BYTES: u32 = 16 << 20;
/// How long a reader whose lane ended waits for the connection's close reason, in ms.
pub const CLOSE_REASON_WAIT_MS: u64 = 500;
/// Application close code of a connection closed by its owner.
pub const CLOSE_DONE: u32 = 0;
/// Application close code of a connection closed after a protocol violation.
pub const CLOSE_VIOLATION: u32 = 1;

/// Why a control exchange failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ControlError {
    #[error("the control connection is closed: {0}")]
    Closed(String),
    #[error("binding the control endpoint on {addr}: {detail}")]
    Bind { addr: SocketAddr, detail: String },
    #[error("connecting to {addr}: {detail}")]
    Connect { addr: SocketAddr, detail: String },
    #[error("a control frame of {bytes} bytes exceeds the limit of {FRAME_BYTES_MAX}")]
    TooLarge { bytes: usize },
    #[error("no room in the control queue within {SEND_TIMEOUT_MS} ms")]
    QueueFull,
    #[error("bulk transfer: {0}")]
    Bulk(String),
    #[error("stopped: {0}")]
    Stopped(String),
}

fn relock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Transport settings of control connections: small messages and occasional bulk state.
fn transport_config() -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    t.stream_receive_window(VarInt::from_u32(STREAM_WINDOW_BYTES))
        .max_concurrent_bidi_streams(VarInt::from_u32(LANES as u32))
        .max_concurrent_uni_streams(VarInt::from_u32(BULK_QUEUE_STREAMS as u32))
        .max_idle_timeout(Some(VarInt::from_u32(IDLE_TIMEOUT_MS).into()))
        .keep_alive_interval(Some(Duration::from_millis(KEEP_ALIVE_MS)));
    t
}

/// A bound UDP socket serving control connections: it accepts them (a driver) or dials them
/// (a worker or agent). Keep it alive as long as its connections: they run on its runtime.
pub struct ControlEndpoint {
    endpoint: Endpoint,
    rt: tokio::runtime::Runtime,
}

impl ControlEndpoint {
    /// Binds `addr`; with `server` it accepts connections (see [`ControlEndpoint::accept`]).
    pub fn bind(addr: SocketAddr, server: Option<rustls::ServerConfig>) -> Result<Self, ControlError> {
        let bind_err = |detail: String| ControlError::Bind { addr, detail };
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("tessera-control")
            .enable_all()
            .build()
            .map_err(|e| bind_err(e.to_string()))?;
        let socket = std::net::UdpSocket::bind(addr).map_err(|e| bind_err(e.to_string()))?;
        size_socket_buffers(&socket);
        let server = match server {
            Some(cfg) => {
                let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(cfg).map_err(|e| bind_err(e.to_string()))?;
                let mut s = quinn::ServerConfig::with_crypto(Arc::new(crypto));
                s.transport_config(Arc::new(transport_config()));
                Some(s)
            }
            None => None,
        };
        let endpoint = {
            let _guard = rt.enter();
            let runtime = Arc::new(quinn::TokioRuntime);
            Endpoint::new(endpoint_config(), server, socket, runtime).map_err(|e| bind_err(e.to_string()))?
        };
        Ok(ControlEndpoint { endpoint, rt })
    }

    /// The bound address.
    pub fn local_addr(&self) -> Result<SocketAddr, ControlError> {
        self.endpoint.local_addr().map_err(|e| ControlError::Closed(e.to_string()))
    }

    /// Dials `addr` (whose certificate must be issued to `server_name`) with `client` and opens
    /// the lanes, within `timeout_ms`.
    pub fn connect(
        &self,
        addr: SocketAddr,
        server_name: &str,
        client: rustls::ClientConfig,
        timeout_ms: u64,
    ) -> Result<ControlConn, ControlError> {
        let err = |detail: String| ControlError::Connect { addr, detail };
        let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(client).map_err(|e| err(e.to_string()))?;
        let mut cfg = quinn::ClientConfig::new(Arc::new(crypto));
        cfg.transport_config(Arc::new(transport_config()));
        let deadline = Duration::from_millis(timeout_ms.min(HANDSHAKE_TIMEOUT_MS));
        let opened = async {
            // quinn starts the connection's driver task here: inside the runtime.
            let connecting = self.endpoint.connect_with(cfg, addr, server_name).map_err(|e| e.to_string())?;
            let conn = connecting.await.map_err(|e| e.to_string())?;
            let mut lanes = Vec::with_capacity(LANES);
            for lane in 0..LANES {
                let (mut send, recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
                // A bidirectional stream reaches the peer with its first byte: the lane's number.
                send.write_all(&[lane as u8]).await.map_err(|e| e.to_string())?;
                lanes.push((send, recv));
            }
            Ok::<_, String>((conn, lanes))
        };
        let (conn, lanes) = match self.rt.block_on(async { tokio::time::timeout(deadline, opened).await }) {
            Ok(r) => r.map_err(err)?,
            Err(_) => return Err(err(format!("no handshake within {} ms", deadline.as_millis()))),
        };
        Ok(ControlConn::start(self.rt.handle().clone(), conn, lanes))
    }

    /// Waits at most `poll_ms` for a new connection and completes its handshake and lanes
    /// (bounded by [`HANDSHAKE_TIMEOUT_MS`]). `Ok(None)`: nobody came; `Err(why)` a peer failed
    /// its handshake (this endpoint goes on accepting).
    pub fn accept(&self, poll_ms: u64) -> Result<Option<ControlConn>, String> {
        let incoming = self.rt.block_on(async { tokio::time::timeout(Duration::from_millis(poll_ms), self.endpoint.accept()).await });
        let incoming = match incoming {
            Err(_) => return Ok(None),
            Ok(None) => return Err("the endpoint is closed".into()),
            Ok(Some(i)) => i,
        };
        let from = incoming.remote_address();
        let admitted = self.rt.block_on(async {
            let opened = async {
                let conn = incoming.await.map_err(|e| format!("handshake failed: {e}"))?;
                let mut lanes: Vec<Option<(SendStream, RecvStream)>> = (0..LANES).map(|_| None).collect();
                for _ in 0..LANES {
                    let (send, mut recv) = conn.accept_bi().await.map_err(|e| format!("opening the lanes: {e}"))?;
                    let mut id = [0u8; 1];
                    recv.read_exact(&mut id).await.map_err(|e| format!("opening the lanes: {e}"))?;
                    match lanes.get_mut(id[0] as usize) {
                        Some(slot @ None) => *slot = Some((send, recv)),
                        _ => {
                            conn.close(VarInt::from_u32(CLOSE_VIOLATION), b"bad lane");
                            return Err(format!("it opened lane {} twice or out of range", id[0]));
                        }
                    }
                }
                Ok((conn, lanes.into_iter().flatten().collect::<Vec<_>>()))
            };
            tokio::time::timeout(Duration::from_millis(HANDSHAKE_TIMEOUT_MS), opened).await
        });
        match admitted {
            Ok(Ok((conn, lanes))) => Ok(Some(ControlConn::start(self.rt.handle().clone(), conn, lanes))),
            Ok(Err(why)) => Err(format!("{from}: {why}")),
            Err(_) => Err(format!("{from}: no handshake within {HANDSHAKE_TIMEOUT_MS} ms")),
        }
    }
}

impl Drop for ControlEndpoint {
    fn drop(&mut self) {
        // Let the close frames of the connections go out (bounded), then stop the runtime.
        let endpoint = self.endpoint.clone();
        let _ = self.rt.block_on(async { tokio::time::timeout(Duration::from_millis(500), endpoint.wait_idle()).await });
    }
}

/// One control connection (cheap to clone: clones share it). See the module doc.
#[derive(Clone)]
pub struct ControlConn {
    inner: Arc<Inner>,
}

struct Inner {
    rt: tokio::runtime::Handle,
    conn: Connection,
    out: Mutex<Vec<Option<mpsc::Sender<Vec<u8>>>>>,
    writers: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    inbox: Vec<Mutex<mpsc::Receiver<Vec<u8>>>>,
    bulk: Mutex<mpsc::Receiver<RecvStream>>,
}

impl std::fmt::Debug for ControlConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlConn").field("peer", &self.inner.conn.remote_address()).finish()
    }
}

/// Writes the frames queued on `rx` to `send`, then finishes the stream.
async fn write_lane(mut send: SendStream, mut rx: mpsc::Receiver<Vec<u8>>) {
    while let Some(frame) = rx.recv().await {
        let mut buf = Vec::with_capacity(4 + frame.len());
        buf.extend_from_slice(&(frame.len() as u32).to_le_bytes());
        buf.extend_from_slice(&frame);
        if send.write_all(&buf).await.is_err() {
            return;
        }
    }
    let _ = send.finish();
    let _ = send.shutdown().await;
}

/// Reads frames from `recv` into `tx` until the stream ends; an oversized frame closes `conn`.
async fn read_lane(conn: Connection, mut recv: RecvStream, tx: mpsc::Sender<Vec<u8>>) {
    loop {
        let mut len = [0u8; 4];
        if recv.read_exact(&mut len).await.is_err() {
            return;
        }
        let len = u32::from_le_bytes(len) as usize;
        if len > FRAME_BYTES_MAX {
            let why = format!("a control frame of {len} bytes exceeds the limit of {FRAME_BYTES_MAX}");
            eprintln!("tessera-control: closing the connection to {}: {why}", conn.remote_address());
            conn.close(VarInt::from_u32(CLOSE_VIOLATION), why.as_bytes());
            return;
        }
        let mut body = vec![0u8; len];
        if recv.read_exact(&mut body).await.is_err() || tx.send(body).await.is_err() {
            return;
        }
    }
}

impl ControlConn {
    fn start(rt: tokio::runtime::Handle, conn: Connection, lanes: Vec<(SendStream, RecvStream)>) -> Self {
        let (mut out, mut writers, mut inbox) = (Vec::new(), Vec::new(), Vec::new());
        for (send, recv) in lanes {
            let (otx, orx) = mpsc::channel(LANE_QUEUE_FRAMES);
            writers.push(rt.spawn(write_lane(send, orx)));
            out.push(Some(otx));
            let (itx, irx) = mpsc::channel(LANE_QUEUE_FRAMES);
            rt.spawn(read_lane(conn.clone(), recv, itx));
            inbox.push(Mutex::new(irx));
        }
        let (btx, brx) = mpsc::channel(BULK_QUEUE_STREAMS);
        let c = conn.clone();
        rt.spawn(async move {
            while let Ok(stream) = c.accept_uni().await {
                if btx.send(stream).await.is_err() {
                    return;
                }
            }
        });
        let inner = Inner { rt, conn, out: Mutex::new(out), writers: Mutex::new(writers), inbox, bulk: Mutex::new(brx) };
        ControlConn { inner: Arc::new(inner) }
    }

    /// Why the connection is closed, if it is.
    pub fn closed_reason(&self) -> Option<String> {
        self.inner.conn.close_reason().map(|e| describe_close(&e))
    }

    /// Whether the connection is closed (by either side, or lost).
    pub fn is_closed(&self) -> bool {
        self.inner.conn.close_reason().is_some()
    }

    /// The peer's address.
    pub fn remote_address(&self) -> SocketAddr {
        self.inner.conn.remote_address()
    }

    /// The certificate the peer presented (already verified against the cluster CA), if any.
    pub fn peer_certificate(&self) -> Option<rustls::pki_types::CertificateDer<'static>> {
        let certs = self.inner.conn.peer_identity()?.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>().ok()?;
        certs.first().cloned()
    }

    /// The error for a lane or stream that ended: the connection's close reason, which follows
    /// the end of the streams closely when the peer closed it (waited for at most
    /// [`CLOSE_REASON_WAIT_MS`]).
    fn closed_error(&self) -> ControlError {
        if let Some(why) = self.closed_reason() {
            return ControlError::Closed(why);
        }
        let conn = self.inner.conn.clone();
        let wait = Duration::from_millis(CLOSE_REASON_WAIT_MS);
        match self.inner.rt.block_on(async { tokio::time::timeout(wait, conn.closed()).await }) {
            Ok(e) => ControlError::Closed(describe_close(&e)),
            Err(_) => ControlError::Closed("the peer ended its stream".into()),
        }
    }

    fn sender(&self, lane: usize) -> Result<mpsc::Sender<Vec<u8>>, ControlError> {
        let out = relock(&self.inner.out);
        out.get(lane).and_then(Option::clone).ok_or_else(|| ControlError::Closed("closed by this side".into()))
    }

    /// Queues `frame` on `lane`, waiting at most [`SEND_TIMEOUT_MS`] for room. Call from a plain
    /// thread (not from inside a tokio runtime).
    pub fn send(&self, lane: usize, frame: Vec<u8>) -> Result<(), ControlError> {
        if frame.len() > FRAME_BYTES_MAX {
            return Err(ControlError::TooLarge { bytes: frame.len() });
        }
        if self.is_closed() {
            return Err(self.closed_error());
        }
        let tx = self.sender(lane)?;
        let sent = self.inner.rt.block_on(async { tokio::time::timeout(Duration::from_millis(SEND_TIMEOUT_MS), tx.send(frame)).await });
        match sent {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(self.closed_error()),
            Err(_) => Err(ControlError::QueueFull),
        }
    }

    /// Queues `frame` on `lane` without waiting (from any context, actors included); fails when
    /// the lane's queue is full or the connection closed.
    pub fn try_send(&self, lane: usize, frame: Vec<u8>) -> Result<(), ControlError> {
        if frame.len() > FRAME_BYTES_MAX {
            return Err(ControlError::TooLarge { bytes: frame.len() });
        }
        match self.sender(lane)?.try_send(frame) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Full(_)) => Err(ControlError::QueueFull),
            Err(mpsc::error::TrySendError::Closed(_)) => {
                Err(ControlError::Closed(self.closed_reason().unwrap_or_else(|| "the lane's writer ended".into())))
            }
        }
    }

    /// The next frame on `lane`, waiting at most `poll_ms`: `Ok(None)` when none came in time.
    pub fn recv(&self, lane: usize, poll_ms: u64) -> Result<Option<Vec<u8>>, ControlError> {
        let mut rx = relock(&self.inner.inbox[lane]);
        let got = self.inner.rt.block_on(async { tokio::time::timeout(Duration::from_millis(poll_ms), rx.recv()).await });
        match got {
            Ok(Some(frame)) => Ok(Some(frame)),
            Ok(None) => Err(self.closed_error()),
            Err(_) => Ok(None),
        }
    }

    /// Sends `bufs` as one bulk transfer on a new unidirectional stream, within `timeout_ms`.
    pub fn send_bulk(&self, bufs: &[&[u8]], timeout_ms: u64) -> Result<(), ControlError> {
        let conn = self.inner.conn.clone();
        let written = self.inner.rt.block_on(async {
            let write = async {
                let mut s = conn.open_uni().await.map_err(|e| e.to_string())?;
                for b in bufs {
                    s.write_all(b).await.map_err(|e| e.to_string())?;
                }
                s.finish().map_err(|e| e.to_string())
            };
            tokio::time::timeout(Duration::from_millis(timeout_ms), write).await
        });
        match written {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(ControlError::Bulk(e)),
            Err(_) => Err(ControlError::Bulk(format!("not sent within {timeout_ms} ms"))),
        }
    }

    /// Receives the next bulk transfer as buffers of exactly `lens` bytes (the stream must end
    /// there). Waits in polls of `poll_ms`; before each, `go_on` may stop the wait (its message
    /// is returned as [`ControlError::Stopped`]), and `deadline` bounds it all.
    pub fn recv_bulk(
        &self,
        lens: &[usize],
        poll_ms: u64,
        deadline: Option<Instant>,
        go_on: &dyn Fn() -> Result<(), String>,
    ) -> Result<Vec<Vec<u8>>, ControlError> {
        let stream = loop {
            go_on().map_err(ControlError::Stopped)?;
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(ControlError::Bulk("no bulk transfer before the deadline".into()));
            }
            let mut rx = relock(&self.inner.bulk);
            let got = self.inner.rt.block_on(async { tokio::time::timeout(Duration::from_millis(poll_ms), rx.recv()).await });
            match got {
                Ok(Some(s)) => break s,
                Ok(None) => return Err(self.closed_error()),
                Err(_) => continue,
            }
        };
        let read = async move {
            let mut stream = stream;
            let mut out = Vec::with_capacity(lens.len());
            for &n in lens {
                let mut b = vec![0u8; n];
                stream.read_exact(&mut b).await.map_err(|e| format!("reading {n} bytes: {e}"))?;
                out.push(b);
            }
            let mut extra = [0u8; 1];
            match stream.read(&mut extra).await.map_err(|e| e.to_string())? {
                None | Some(0) => Ok(out),
                Some(_) => Err("more bytes than announced".to_string()),
            }
        };
        let poll = Duration::from_millis(poll_ms);
        let got = self.inner.rt.block_on(async {
            tokio::pin!(read);
            loop {
                if let Err(why) = go_on() {
                    return Err(ControlError::Stopped(why));
                }
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Err(ControlError::Bulk("the bulk transfer did not end before the deadline".into()));
                }
                if let Ok(r) = tokio::time::timeout(poll, &mut read).await {
                    return r.map_err(ControlError::Bulk);
                }
            }
        });
        got
    }

    /// Sends what is queued (bounded by [`CLOSE_FLUSH_MS`]), then closes the connection with
    /// `reason`. Later sends fail; the peer's reads end.
    pub fn close(&self, reason: &str) {
        self.close_with(CLOSE_DONE, reason, true, 0)
    }

    /// As [`ControlConn::close`] for a last message the peer must see (a refusal): after
    /// sending what is queued it waits, at most `linger_ms`, for the peer to close the
    /// connection — it has read everything then. Closing at once can discard stream data the
    /// peer has not acknowledged yet, and it would see only the close.
    pub fn close_when_read(&self, reason: &str, linger_ms: u64) {
        self.close_with(CLOSE_DONE, reason, true, linger_ms)
    }

    /// Closes at once, dropping anything queued (the peer is lost or misbehaved).
    pub fn abort(&self, reason: &str) {
        self.close_with(CLOSE_VIOLATION, reason, false, 0)
    }

    fn close_with(&self, code: u32, reason: &str, flush: bool, linger_ms: u64) {
        relock(&self.inner.out).iter_mut().for_each(|s| *s = None);
        let writers: Vec<_> = std::mem::take(&mut *relock(&self.inner.writers));
        if flush && !self.is_closed() {
            let _ = self.inner.rt.block_on(async {
                tokio::time::timeout(Duration::from_millis(CLOSE_FLUSH_MS), async {
                    for w in writers {
                        let _ = w.await;
                    }
                })
                .await
            });
            if linger_ms > 0 {
                let conn = self.inner.conn.clone();
                let _ = self.inner.rt.block_on(async { tokio::time::timeout(Duration::from_millis(linger_ms), conn.closed()).await });
            }
        }
        self.inner.conn.close(VarInt::from_u32(code), super::net::close_reason(reason).as_bytes());
    }
}

/// A connection's end in words: "closed by the peer: bye", "timed out", ….
fn describe_close(e: &quinn::ConnectionError) -> String {
    match e {
        quinn::ConnectionError::ApplicationClosed(c) => format!("closed by the peer: {}", String::from_utf8_lossy(&c.reason)),
        quinn::ConnectionError::LocallyClosed => "closed by this side".into(),
        quinn::ConnectionError::TimedOut => format!("the peer was silent for {IDLE_TIMEOUT_MS} ms"),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::super::pki::{cluster_init, ClientAuth, ClusterCa, JoinToken, NodeKey, NodeTls, ALPN_CONTROL};
    use super::*;

    fn local() -> SocketAddr {
        "127.0.0.1:0".parse().expect("an address")
    }

    /// Accepts one connection within 10 s.
    fn accept_one(server: &ControlEndpoint) -> ControlConn {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match server.accept(100) {
                Ok(Some(c)) => return c,
                Ok(None) | Err(_) if Instant::now() < deadline => continue,
                other => panic!("no connection: {other:?}"),
            }
        }
    }

    fn recv_within(c: &ControlConn, lane: usize) -> Vec<u8> {
        for _ in 0..100 {
            if let Some(f) = c.recv(lane, 100).expect("open") {
                return f;
            }
        }
        panic!("no frame on lane {lane} within 10 s")
    }

    #[test]
    fn frames_keep_their_lane_and_order_and_bulk_arrives_whole() {
        let dir = std::env::temp_dir().join(format!("tessera-control-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        cluster_init(&dir, &["coordinator", "node-0"]).unwrap();
        let (co, n0) = (NodeTls::load(&dir, "coordinator").unwrap(), NodeTls::load(&dir, "node-0").unwrap());
        let _ = std::fs::remove_dir_all(&dir);
        let server = ControlEndpoint::bind(local(), Some(co.server_config_for(ALPN_CONTROL, ClientAuth::Required).unwrap())).unwrap();
        let addr = server.local_addr().unwrap();
        let client = ControlEndpoint::bind(local(), None).unwrap();
        let t = std::thread::spawn(move || (accept_one(&server), server));
        let c = client.connect(addr, "coordinator", n0.client_config_for(ALPN_CONTROL).unwrap(), 10_000).unwrap();
        let (s, _server) = t.join().unwrap();
        for i in 0..200u32 {
            c.send(LANE_REQUESTS, i.to_le_bytes().to_vec()).unwrap();
        }
        c.try_send(LANE_ACTORS, b"actor".to_vec()).unwrap();
        assert_eq!(recv_within(&s, LANE_ACTORS), b"actor");
        for i in 0..200u32 {
            assert_eq!(recv_within(&s, LANE_REQUESTS), i.to_le_bytes());
        }
        let big: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        s.send_bulk(&[&big[..1000], &big[1000..]], 10_000).unwrap();
        let got = c.recv_bulk(&[1000, big.len() - 1000], 100, None, &|| Ok(())).unwrap();
        assert_eq!((got[0].as_slice(), got[1].as_slice()), (&big[..1000], &big[1000..]));
        // A bulk transfer longer than announced is refused.
        s.send_bulk(&[&big[..10]], 10_000).unwrap();
        assert!(matches!(c.recv_bulk(&[9], 100, None, &|| Ok(())), Err(ControlError::Bulk(_))));
        assert!(c.peer_certificate().is_some() && s.peer_certificate().is_some());
        s.send(LANE_REQUESTS, b"last".to_vec()).unwrap();
        s.close("bye");
        assert_eq!(recv_within(&c, LANE_REQUESTS), b"last", "close sends what was queued first");
        let end = (0..100).find_map(|_| c.recv(LANE_REQUESTS, 100).err());
        assert!(matches!(&end, Some(ControlError::Closed(why)) if why.contains("bye")), "{end:?}");
    }

    #[test]
    fn a_join_token_pins_the_coordinators_ca_and_admits_keyless_agents() {
        let ca = ClusterCa::generate().unwrap();
        let co = ca.issue("coordinator").unwrap();
        let token = JoinToken::generate(ca.ca_sha256()).unwrap();
        assert_eq!(JoinToken::parse(&token.text()).unwrap(), token);
        for bad in ["", "tsr1-zz-00", "tsr2-00000000000000000000000000000000-00", &format!("{}-x", token.text())] {
            assert!(JoinToken::parse(bad).is_err(), "{bad:?} parsed");
        }
        assert!(token.admits(&token.secret) && !token.admits(&[0; 16]) && !token.admits(&token.secret[..8]));
        let server = ControlEndpoint::bind(local(), Some(co.server_config_for(ALPN_CONTROL, ClientAuth::Optional).unwrap())).unwrap();
        let addr = server.local_addr().unwrap();
        let client = ControlEndpoint::bind(local(), None).unwrap();
        let t = std::thread::spawn(move || {
            let c = accept_one(&server);
            (c.peer_certificate().is_none(), server)
        });
        let conn = client.connect(addr, "coordinator", token.client_config(ALPN_CONTROL).unwrap(), 10_000).unwrap();
        let (keyless, server) = t.join().unwrap();
        assert!(keyless, "the agent presented no certificate");
        // The agent's own key, signed by the coordinator's CA: a usable node identity.
        let key = NodeKey::generate().unwrap();
        let cert = ca.sign_node_key("node-3", &key.public_key()).unwrap();
        let id = key.identity(&ca.ca_pem(), &cert).unwrap();
        assert_eq!(id.ca_sha256(), ca.ca_sha256());
        assert!(ca.sign_node_key("node-3", &[4; 10]).is_err());
        drop(conn);
        // A token that pins another CA does not accept this coordinator.
        let other = JoinToken::generate(ClusterCa::generate().unwrap().ca_sha256()).unwrap();
        let t = std::thread::spawn(move || server.accept(3_000).map(|c| c.is_some()));
        let e = client.connect(addr, "coordinator", other.client_config(ALPN_CONTROL).unwrap(), 3_000).unwrap_err();
        assert!(e.to_string().contains("fingerprint"), "{e}");
        assert!(!matches!(t.join().unwrap(), Ok(true)), "the server admitted the connection");
    }
}
