//! [`QuicComm`]: one rank's [`Collective`] handle over QUIC — operation descriptors, the
//! algorithms, timeouts, abort and the graceful leave.

use super::frame::{
    read_payload_add, read_payload_into, read_payload_vec, ChunkSum, Control, FrameError, Key, OpDesc, Payload, ELEM_F32, ELEM_F64,
};
use super::lend::{lending, Lender};
use super::net::{
    broadcast_abort, build_mesh, close_reason, endpoint_config, lanes_wanted, reject, runtime_workers, serve_peer, size_socket_buffers,
    transport_config, tune_allocator, write_stream, write_stream_lent, ClusterSpec, Delivery, Fail, GsoSplit, QuicError, Shared,
    CLOSE_ABORTED, CLOSE_BYE, LANES_MAX,
};
use super::pki::NodeTls;
use crate::collective::CollectiveOp as Op;
use crate::collective::{
    chain_broadcast_traffic, check_ranges, even_ranges, gather_slices_traffic, ring_all_gather_traffic, ring_all_reduce_traffic,
    ring_reduce_scatter_traffic, AbortHandle, Collective, CollectiveError, CommStats, Traffic, DEFAULT_TIMEOUT_MS,
};
use quinn::{Connection, Endpoint, Runtime, VarInt};
use std::collections::HashMap;
use std::future::Future;
use std::ops::{AddAssign, Range};
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

/// Elements per broadcast piece (4 MiB of f32): the chain forwards piece k while piece k+1 arrives.
const PIECE_ELEMS: usize = 1 << 20;
/// Bound on a graceful leave (every peer confirming it has every message sent), in ms; the
/// handle's own timeout when that is shorter.
const LEAVE_TIMEOUT_MS: u64 = 10_000;
/// Bound on the wait for the close frames to go out when leaving, in ms.
const CLOSE_DRAIN_MS: u64 = 500;
/// A payload is cut into stripes over a pair's lanes only where each stripe carries at least
/// this many bytes: below it, a second thread and stream cost more than they save.
pub const STRIPE_BYTES_MIN: usize = 1 << 20;

/// How many stripes a payload of `bytes` takes when its receiver takes payloads on `lanes`
/// lanes. Sender and receiver compute it from the same two numbers (the receiver's declared
/// lanes, the length both sides checked), so they agree on every stripe's range.
pub fn stripe_count(lanes: usize, bytes: usize) -> usize {
    lanes.min(bytes / STRIPE_BYTES_MIN).max(1)
}

/// `buf` cut into `n` contiguous stripes ([`even_ranges`]).
fn stripes<T>(buf: &[T], n: usize) -> Vec<&[T]> {
    even_ranges(buf.len(), n).into_iter().map(|r| &buf[r]).collect()
}

/// `buf` cut into `n` contiguous, disjoint mutable stripes ([`even_ranges`]).
fn stripes_mut<T>(mut buf: &mut [T], n: usize) -> Vec<&mut [T]> {
    let mut out = Vec::with_capacity(n);
    for r in even_ranges(buf.len(), n) {
        let (head, rest) = std::mem::take(&mut buf).split_at_mut(r.len());
        out.push(head);
        buf = rest;
    }
    out
}

/// An element type carried in payloads and summed in rank order.
trait Elem: bytemuck::Pod + AddAssign + Send + Sync {
    const ELEM: u8;
    const BYTES: u64;
    fn take(p: Payload) -> Option<Vec<Self>>;
}

impl Elem for f32 {
    const ELEM: u8 = ELEM_F32;
    const BYTES: u64 = 4;
    fn take(p: Payload) -> Option<Vec<Self>> {
        match p {
            Payload::F32(v) => Some(v),
            Payload::F64(_) => None,
        }
    }
}

impl Elem for f64 {
    const ELEM: u8 = ELEM_F64;
    const BYTES: u64 = 8;
    fn take(p: Payload) -> Option<Vec<Self>> {
        match p {
            Payload::F64(v) => Some(v),
            Payload::F32(_) => None,
        }
    }
}

fn add_into<T: Elem>(acc: &mut [T], x: &[T]) {
    acc.iter_mut().zip(x).for_each(|(a, b)| *a += *b);
}

/// Makes `v` `n` long, zero-filling only what it never held (its values are about to be
/// overwritten whole).
fn set_len<T: bytemuck::Pod>(v: &mut Vec<T>, n: usize) {
    v.truncate(n);
    v.resize(n, T::zeroed());
}

fn ends_of(ranges: &[Range<usize>]) -> Vec<u64> {
    ranges.iter().map(|r| r.end as u64).collect()
}

/// `(&buf[a], &mut buf[b])` for disjoint ranges `a` and `b` (either may be empty).
fn split_pair<T>(buf: &mut [T], a: Range<usize>, b: Range<usize>) -> (&[T], &mut [T]) {
    if a.end <= b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.len()])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&hi[..a.len()], &mut lo[b])
    }
}

/// `(&mut buf[a], &mut buf[b])` for disjoint ranges `a` and `b` (either may be empty).
fn split_pair_mut<T>(buf: &mut [T], a: Range<usize>, b: Range<usize>) -> (&mut [T], &mut [T]) {
    if a.end <= b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&mut lo[a], &mut hi[..b.len()])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&mut hi[..a.len()], &mut lo[b])
    }
}

/// Bytes a lane copies between two polls of its step's streams (see [`copy_yielding`]).
const COPY_PIECE_BYTES: usize = 256 << 10;

/// Copies `src` into `dst` (as long) in pieces of [`COPY_PIECE_BYTES`], letting the other work
/// of the lane's step (its sends and receives) go on between pieces: a local copy then runs
/// beside the step's transfers instead of before them.
async fn copy_yielding<T: Copy>(dst: &mut [T], src: &[T]) -> Result<(), Fail> {
    let piece = (COPY_PIECE_BYTES / std::mem::size_of::<T>().max(1)).max(1);
    for (d, s) in dst.chunks_mut(piece).zip(src.chunks(piece)) {
        d.copy_from_slice(s);
        tokio::task::yield_now().await;
    }
    Ok(())
}

/// Where a reduction's own contribution is (for a whole output, or one lane's stripe of it).
enum Own<'a, T> {
    /// In a slice of its own (a reduce-scatter's input).
    Slice(&'a [T]),
    /// Already in the output (an all-reduce in place). `acc` (as long as the output; empty on
    /// ranks 0 and 1) is where ranks ≥ 2 sum the lower ranks' slices before adding their own.
    InPlace { acc: &'a mut [T] },
}

/// A buffer a rank reuses across calls, per element type: a slice (where an all-reduce sums
/// the lower ranks' slices, a gathered slice being visited).
#[derive(Default)]
struct Scratch<T> {
    owned: Vec<T>,
}

/// One collective in progress: its number, operation and deadline.
#[derive(Clone, Copy)]
struct Call {
    seq: u64,
    op: Op,
    start: Instant,
    deadline: Instant,
}

type Step<'a> = Pin<Box<dyn Future<Output = Result<(), Fail>> + Send + 'a>>;

/// A lane's steps, parked until its thread (or the caller) takes them.
fn take_parked<'a>(m: &std::sync::Mutex<Option<Vec<Step<'a>>>>) -> Vec<Step<'a>> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take().unwrap_or_default()
}

/// A step's work per lane: `lanes[k]` runs on lane `k`'s thread (see `QuicComm::drive_lanes`).
#[derive(Default)]
struct Lanes<'a> {
    lanes: Vec<Vec<Step<'a>>>,
}

impl<'a> Lanes<'a> {
    fn push(&mut self, lane: usize, step: Step<'a>) {
        if self.lanes.len() <= lane {
            self.lanes.resize_with(lane + 1, Vec::new);
        }
        self.lanes[lane].push(step);
    }
}

/// Runs `futs` concurrently; the first failure ends them all.
async fn all_ok(mut futs: Vec<Step<'_>>) -> Result<(), Fail> {
    std::future::poll_fn(|cx| {
        let mut i = 0;
        while i < futs.len() {
            match futs[i].as_mut().poll(cx) {
                Poll::Ready(Ok(())) => drop(futs.swap_remove(i)),
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => i += 1,
            }
        }
        match futs.is_empty() {
            true => Poll::Ready(Ok(())),
            false => Poll::Pending,
        }
    })
    .await
}

/// The connection to `to`, unless `to` is gone.
fn live_conn<'c>(shared: &Shared, conn: Option<&'c Connection>, to: usize) -> Result<&'c Connection, Fail> {
    conn.filter(|_| shared.lock().gone[to].is_none()).ok_or(Fail::Gone(to))
}

/// A message to `to` written (counted in `streams_sent`) or not (`to` is gone).
fn sent(shared: &Shared, to: usize, written: Result<(), String>) -> Result<(), Fail> {
    match written {
        Ok(()) => {
            shared.streams_sent[to].fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
        Err(_) => Err(Fail::Gone(to)),
    }
}

/// Sends one message on a new stream to `to`; counted in `streams_sent` once written.
async fn tx_msg(shared: &Shared, conn: Option<&Connection>, to: usize, control: &Control, payload: &[u8]) -> Result<(), Fail> {
    let conn = live_conn(shared, conn, to)?;
    sent(shared, to, write_stream(conn, control, payload).await)
}

async fn tx<T: Elem>(shared: &Shared, conn: Option<&Connection>, to: usize, key: Key, data: &[T]) -> Result<(), Fail> {
    let control = Control::Data { key, elem: T::ELEM, elems: data.len() as u64 };
    tx_msg(shared, conn, to, &control, bytemuck::cast_slice(data)).await
}

/// [`tx`] of data lent to quinn instead of copied ([`super::lend`]), with the chunk checksums
/// `sums` where they match; returns once the peer has acknowledged every lent piece.
async fn tx_lent<'d, T: Elem>(
    shared: &Shared,
    conn: Option<&Connection>,
    to: usize,
    key: Key,
    data: &'d [T],
    lender: &Lender<'d>,
    sums: Option<&[ChunkSum]>,
) -> Result<(), Fail> {
    let conn = live_conn(shared, conn, to)?;
    let control = Control::Data { key, elem: T::ELEM, elems: data.len() as u64 };
    sent(shared, to, write_stream_lent(conn, lender, &control, bytemuck::cast_slice(data), sums).await)
}

/// How [`QuicComm::tx_striped`] hands a payload to quinn: lent through `lender`, and with the
/// checksums each stripe's chunks arrived with (`sums[k]` for stripe `k`, used where the stripes
/// are cut alike) when the payload is being forwarded.
#[derive(Clone, Copy)]
struct Lending<'a, 'd> {
    lender: &'a Lender<'d>,
    sums: &'a [Vec<ChunkSum>],
}

/// The header of `from`'s message `key` announced `elems` values of type `elem`; `want` of `T`
/// were expected.
fn check_header<T: Elem>(from: usize, key: Key, elem: u8, elems: u64, want: Option<usize>) -> Result<(), Fail> {
    if elem != T::ELEM {
        return Err(Fail::Mismatch(format!("rank {from} sent the wrong kind of message for {key:?}")));
    }
    match want {
        Some(n) if elems != n as u64 => Err(Fail::Mismatch(format!("rank {from} sent {elems} elements where {n} were expected"))),
        _ => Ok(()),
    }
}

/// A message filed whole (point-to-point, or sent to oneself) as values of `T`.
fn take_data<T: Elem>(from: usize, key: Key, d: Delivery, want: Option<usize>) -> Result<Vec<T>, Fail> {
    let v = match d {
        Delivery::Data(p) => T::take(p),
        Delivery::Desc(_) | Delivery::Stream { .. } => None,
    };
    match (v, want) {
        (None, _) => Err(Fail::Mismatch(format!("rank {from} sent the wrong kind of message for {key:?}"))),
        (Some(v), Some(n)) if v.len() != n => Err(Fail::Mismatch(format!("rank {from} sent {} elements where {n} were expected", v.len()))),
        (Some(v), _) => Ok(v),
    }
}

/// Reads the rest of `from`'s collective stream with `read` (after `check`), then counts it as
/// done. A bad frame closes the connection (logged); a failed read reports the peer as gone.
async fn read_stream<'a, R, F: Future<Output = Result<R, FrameError>> + 'a>(
    shared: &Shared,
    conn: Option<&Connection>,
    from: usize,
    check: Result<(), Fail>,
    read: F,
) -> Result<R, Fail> {
    let r = match check {
        Ok(()) => read.await,
        Err(e) => {
            shared.stream_done(from);
            return Err(e);
        }
    };
    match r {
        Ok(v) => {
            shared.stream_done(from);
            Ok(v)
        }
        Err(FrameError::Io(e)) => {
            shared.peer_gone(from, format!("stream failed: {e}"));
            Err(Fail::Gone(from))
        }
        Err(e) => {
            if let Some(conn) = conn {
                reject(shared, conn, from, &e.to_string());
            }
            Err(Fail::Gone(from))
        }
    }
}

/// Where a receive reads from: `rank`'s messages on `lane`, whose streams arrive over `conn`.
#[derive(Clone, Copy)]
struct Src<'a> {
    shared: &'a Shared,
    conn: Option<&'a Connection>,
    rank: usize,
    lane: usize,
}

/// Receives `p`'s message `key` straight into `dest` (exactly `dest.len()` values).
async fn rx_into<T: Elem>(p: Src<'_>, key: Key, dest: &mut [T]) -> Result<(), Fail> {
    rx_into_summed(p, key, dest, None).await
}

/// [`rx_into`], recording the chunks' lengths and checksums in `sums` when given (left empty for
/// a message that was filed whole).
async fn rx_into_summed<T: Elem>(p: Src<'_>, key: Key, dest: &mut [T], mut sums: Option<&mut Vec<ChunkSum>>) -> Result<(), Fail> {
    if let Some(sums) = sums.as_deref_mut() {
        sums.clear();
    }
    match p.shared.wait_for(p.rank, p.lane, key).await? {
        Delivery::Stream { elem, elems, mut stream } => {
            let check = check_header::<T>(p.rank, key, elem, elems, Some(dest.len()));
            read_stream(p.shared, p.conn, p.rank, check, read_payload_into(&mut stream, dest, sums)).await
        }
        d => {
            dest.copy_from_slice(&take_data::<T>(p.rank, key, d, Some(dest.len()))?);
            Ok(())
        }
    }
}

/// Receives `p`'s message `key`, exactly `acc.len()` values, and adds them into `acc`.
async fn rx_add<T: Elem>(p: Src<'_>, key: Key, acc: &mut [T]) -> Result<(), Fail> {
    match p.shared.wait_for(p.rank, p.lane, key).await? {
        Delivery::Stream { elem, elems, mut stream } => {
            let check = check_header::<T>(p.rank, key, elem, elems, Some(acc.len()));
            read_stream(p.shared, p.conn, p.rank, check, read_payload_add(&mut stream, acc)).await
        }
        d => {
            add_into(acc, &take_data::<T>(p.rank, key, d, Some(acc.len()))?);
            Ok(())
        }
    }
}

/// Receives `p`'s message `key` into a new vector, whatever its length.
async fn rx_vec<T: Elem>(p: Src<'_>, key: Key) -> Result<Vec<T>, Fail> {
    match p.shared.wait_for(p.rank, p.lane, key).await? {
        Delivery::Stream { elem, elems, mut stream } => {
            let check = check_header::<T>(p.rank, key, elem, elems, None);
            read_stream(p.shared, p.conn, p.rank, check, read_payload_vec(&mut stream, elems)).await
        }
        d => take_data::<T>(p.rank, key, d, None),
    }
}

/// One rank's handle on a QUIC group. Owns a tokio runtime ([`runtime_workers`]) that drives the
/// endpoint and one reader task per connection. Each pair of ranks talks over one or more
/// parallel connections (lanes, [`lanes_wanted`]); a collective's large payloads are cut into
/// one contiguous stripe per lane ([`stripe_count`]). The synchronous trait methods run each
/// step of an algorithm with `block_on`: the step's sends and receives on a lane as one future,
/// so a rank always reads while it writes (no deadlock however large the messages), lane 0 on
/// the caller's thread and each further lane on a scoped thread of its own, and a collective's
/// payload is read from its QUIC streams straight into the destination tensor. Every element
/// is summed in rank order whatever the lanes, so the bits do not depend on them. Dropping it
/// leaves the group gracefully: each peer confirms it has every message sent.
pub struct QuicComm {
    rank: usize,
    world: usize,
    timeout_ms: u64,
    stats: CommStats,
    seq: u64,
    p2p_sent: HashMap<(usize, u64), u64>,
    p2p_next: HashMap<(usize, u64), u64>,
    shared: Arc<Shared>,
    /// Each peer's connections, one per lane (empty for this rank).
    conns: Vec<Vec<Connection>>,
    /// Lanes this rank receives stripes on: the fewest it has with any peer.
    recv_lanes: usize,
    /// Each rank's receive lanes as declared for the current collective.
    peer_lanes: Vec<usize>,
    /// One endpoint per lane (endpoint 0 on the rank's address).
    endpoints: Vec<Endpoint>,
    scratch_f32: Scratch<f32>,
    scratch_f64: Scratch<f64>,
    rt: tokio::runtime::Runtime,
}

impl std::fmt::Debug for QuicComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuicComm").field("rank", &self.rank).field("world", &self.world).finish()
    }
}

impl QuicComm {
    /// Binds `spec.addrs[rank]` and connects to every peer (see [`QuicComm::connect_socket`]).
    ///
    /// [`lanes_wanted`] sets how many connections per peer this rank asks for
    /// (`TESSERA_QUIC_LANES`, else several on loopback and one across hosts); a bad value is an
    /// error naming it.
    pub fn connect(rank: usize, spec: &ClusterSpec, tls: &NodeTls, connect_timeout_ms: u64) -> Result<Self, QuicError> {
        let addr = *spec.addrs.get(rank).ok_or_else(|| QuicError::Spec { rank, detail: format!("{} addresses", spec.addrs.len()) })?;
        let socket = std::net::UdpSocket::bind(addr).map_err(|e| QuicError::Endpoint { rank, addr, detail: e.to_string() })?;
        Self::connect_socket(socket, rank, spec, tls, connect_timeout_ms)
    }

    /// Serves on an already bound `socket` and connects with mutual TLS to every peer: rank `r`
    /// dials the ranks below it and accepts those above, each proving its rank with a
    /// certificate for `spec.names[rank]` signed by the cluster CA. Waits ≤ `connect_timeout_ms`.
    /// Asks each peer for [`lanes_wanted`] lanes.
    pub fn connect_socket(
        socket: std::net::UdpSocket,
        rank: usize,
        spec: &ClusterSpec,
        tls: &NodeTls,
        connect_timeout_ms: u64,
    ) -> Result<Self, QuicError> {
        let addr = socket.local_addr().map_err(|e| QuicError::Endpoint { rank, addr: spec.addrs[rank], detail: e.to_string() })?;
        let lanes = lanes_wanted(addr).map_err(|detail| QuicError::Spec { rank, detail })?;
        Self::connect_socket_with_lanes(socket, rank, spec, tls, connect_timeout_ms, lanes)
    }

    /// [`QuicComm::connect_socket`], asking each peer for `lanes` (1 to [`LANES_MAX`])
    /// connections; a pair uses the smaller of its two ranks' numbers.
    pub fn connect_socket_with_lanes(
        socket: std::net::UdpSocket,
        rank: usize,
        spec: &ClusterSpec,
        tls: &NodeTls,
        connect_timeout_ms: u64,
        lanes: usize,
    ) -> Result<Self, QuicError> {
        if !(1..=LANES_MAX).contains(&lanes) {
            return Err(QuicError::Spec { rank, detail: format!("{lanes} lanes asked for; expected 1 to {LANES_MAX}") });
        }
        let world = spec.addrs.len();
        // A rank that the others reach at another address than its socket's (a proxy, NAT,
        // `--advertise` on a wildcard bind) may reach them through other addresses too (a fault
        // link dials aliases): its other lanes' sockets would go around that, or nowhere. One lane.
        let bound = socket.local_addr().ok();
        let lanes = match (bound, spec.addrs.get(rank)) {
            (Some(b), Some(&a)) if b == a => lanes,
            _ => 1,
        };
        if spec.names.len() != world || rank >= world {
            let detail = format!("{} addresses, {} names, rank {rank}", world, spec.names.len());
            return Err(QuicError::Spec { rank, detail });
        }
        let workers = runtime_workers(lanes).map_err(|detail| QuicError::Spec { rank, detail })?;
        tune_allocator();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .thread_name(format!("tessera-quic-{rank}"))
            .enable_all()
            .build()
            .map_err(|e| QuicError::Runtime { rank, detail: e.to_string() })?;
        let addr = socket.local_addr().map_err(|e| QuicError::Endpoint { rank, addr: spec.addrs[rank], detail: e.to_string() })?;
        let endpoint_err = |detail: String| QuicError::Endpoint { rank, addr, detail };
        let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls.server_config()?).map_err(|e| endpoint_err(e.to_string()))?;
        let mut server = quinn::ServerConfig::with_crypto(Arc::new(crypto));
        server.transport_config(Arc::new(transport_config()));
        let deadline = Instant::now() + Duration::from_millis(connect_timeout_ms);
        // Lane k of every pair runs through this rank's endpoint k: one UDP socket and one
        // endpoint driver each, so receiving (the socket reads and the dispatch to connections)
        // runs in parallel too. Endpoint 0 is the rank's address; the others take free ports on
        // the same IP, which the hellos announce.
        let mut sockets = vec![socket];
        for _ in 1..lanes {
            let mut any_port = addr; // keeps an IPv6 scope id
            any_port.set_port(0);
            let extra = std::net::UdpSocket::bind(any_port).map_err(|e| endpoint_err(format!("a lane's socket: {e}")))?;
            sockets.push(extra);
        }
        let (endpoints, conns) = rt.block_on(async {
            let runtime = Arc::new(quinn::TokioRuntime);
            let mut endpoints = Vec::with_capacity(lanes);
            for socket in sockets {
                size_socket_buffers(&socket);
                let socket = Arc::new(GsoSplit(runtime.wrap_udp_socket(socket).map_err(|e| endpoint_err(e.to_string()))?));
                let endpoint = Endpoint::new_with_abstract_socket(endpoint_config(), Some(server.clone()), socket, runtime.clone())
                    .map_err(|e| endpoint_err(e.to_string()))?;
                endpoints.push(endpoint);
            }
            let conns = build_mesh(&endpoints, rank, spec, tls, deadline).await?;
            Ok::<_, QuicError>((endpoints, conns))
        })?;
        let shared = Arc::new(Shared::new(rank, world));
        for (peer, lanes) in conns.iter().enumerate() {
            for (lane, conn) in lanes.iter().enumerate() {
                rt.spawn(serve_peer(shared.clone(), conn.clone(), peer, lane));
            }
        }
        let recv_lanes = conns.iter().filter(|l| !l.is_empty()).map(Vec::len).min().unwrap_or(1);
        Ok(QuicComm {
            rank,
            world,
            timeout_ms: DEFAULT_TIMEOUT_MS,
            stats: CommStats::default(),
            seq: 0,
            p2p_sent: HashMap::new(),
            p2p_next: HashMap::new(),
            shared,
            conns,
            recv_lanes,
            peer_lanes: vec![recv_lanes; world],
            endpoints,
            scratch_f32: Scratch::default(),
            scratch_f64: Scratch::default(),
            rt,
        })
    }

    /// quinn's statistics of each lane to each peer (none for this rank): packets, losses,
    /// congestion events, the current window and RTT — for benchmarks and monitoring.
    pub fn connection_stats(&self) -> Vec<Vec<quinn::ConnectionStats>> {
        self.conns.iter().map(|lanes| lanes.iter().map(Connection::stats).collect()).collect()
    }

    fn aborted(&self, op: &'static str) -> Result<(), CollectiveError> {
        match &self.shared.lock().aborted {
            Some(reason) => Err(CollectiveError::Aborted { op, reason: reason.clone() }),
            None => Ok(()),
        }
    }

    /// Aborts the group after this rank's wait ran out; returns the rank's own error.
    fn time_out(&self, op: &'static str, start: Instant) -> CollectiveError {
        let waited_ms = start.elapsed().as_millis() as u64;
        let reason = format!("rank {} timed out in {op} after {waited_ms} ms", self.rank);
        if self.shared.abort(&reason) {
            broadcast_abort(self.rt.handle(), &self.conns, &reason);
        }
        CollectiveError::Timeout { op, rank: self.rank, waited_ms }
    }

    fn check_rank(&self, op: &'static str, what: &str, rank: usize) -> Result<(), CollectiveError> {
        match rank < self.world {
            true => Ok(()),
            false => {
                Err(CollectiveError::InvalidArgument { op, detail: format!("{what} {rank} is not a rank of a world of {}", self.world) })
            }
        }
    }

    /// The first lane to `peer`: every message that is not a striped payload travels on it.
    fn conn(&self, peer: usize) -> Option<&Connection> {
        self.lane(peer, 0)
    }

    fn lane(&self, peer: usize, lane: usize) -> Option<&Connection> {
        self.conns.get(peer).and_then(|l| l.get(lane))
    }

    /// Receiving from `peer` on `lane`.
    fn src(&self, peer: usize, lane: usize) -> Src<'_> {
        Src { shared: &self.shared, conn: self.lane(peer, lane), rank: peer, lane }
    }

    /// Lanes each pair uses, by peer (0 for this rank).
    pub fn lanes(&self) -> Vec<usize> {
        self.conns.iter().map(Vec::len).collect()
    }

    /// Adds the sends of `data` to `to` to `lanes`, one stripe per lane of `to`'s; copied, or
    /// lent to quinn as `lending` says.
    fn tx_striped<'a, 'd: 'a, T: Elem>(
        &'a self,
        lanes: &mut Lanes<'a>,
        to: usize,
        key: Key,
        data: &'d [T],
        lending: Option<Lending<'a, 'd>>,
    ) {
        let n = stripe_count(self.peer_lanes[to], data.len() * T::BYTES as usize);
        for (k, part) in stripes(data, n).into_iter().enumerate() {
            let conn = self.lane(to, k);
            match lending {
                None => lanes.push(k, Box::pin(tx(&self.shared, conn, to, key, part))),
                Some(Lending { lender, sums }) => {
                    let sums = sums.get(k).filter(|_| sums.len() == n).map(Vec::as_slice);
                    lanes.push(k, Box::pin(tx_lent(&self.shared, conn, to, key, part, lender, sums)));
                }
            }
        }
    }

    /// How many stripes this rank receives a payload of `elems` values of `T` in.
    fn rx_stripes<T: Elem>(&self, elems: usize) -> usize {
        stripe_count(self.recv_lanes, elems * T::BYTES as usize)
    }

    /// Runs one step (`f`: its sends and receives) on the caller's thread until it completes,
    /// the group is aborted, or `deadline` passes (which aborts the group).
    fn drive<R>(
        &self,
        op: &'static str,
        start: Instant,
        deadline: Instant,
        f: impl Future<Output = Result<R, Fail>>,
    ) -> Result<R, CollectiveError> {
        self.aborted(op)?;
        let r = self.drive_raw(deadline, f);
        self.finish(op, start, r)
    }

    /// `f` on the calling thread until it completes or the group is aborted (`Some`), or until
    /// `deadline` (`None`).
    fn drive_raw<R>(&self, deadline: Instant, f: impl Future<Output = Result<R, Fail>>) -> Option<Result<R, Fail>> {
        let shared = &self.shared;
        self.rt.block_on(async {
            tokio::select! {
                biased;
                reason = shared.until_aborted() => Some(Err(Fail::Aborted(reason))),
                r = tokio::time::timeout_at(deadline.into(), f) => r.ok(),
            }
        })
    }

    /// A step's outcome as the caller sees it (a timeout aborts the group).
    fn finish<R>(&self, op: &'static str, start: Instant, r: Option<Result<R, Fail>>) -> Result<R, CollectiveError> {
        match r {
            None => Err(self.time_out(op, start)),
            Some(Ok(v)) => Ok(v),
            Some(Err(Fail::Aborted(reason))) => Err(CollectiveError::Aborted { op, reason }),
            Some(Err(Fail::Gone(peer))) => self.aborted(op).and(Err(CollectiveError::PeerGone { op, peer })),
            Some(Err(Fail::Mismatch(detail))) => Err(CollectiveError::Mismatch { op, detail }),
            Some(Err(Fail::Cancelled)) => Err(CollectiveError::Aborted { op, reason: "a lane of the step was cancelled".into() }),
        }
    }

    /// Runs one step's work on every lane at once: lane 0 on the caller's thread, each further
    /// lane on a scoped thread of its own (a lane's sends and receives together, as in
    /// [`Self::drive`]). The first lane to fail (in time) cancels the others, and its error — a
    /// timeout included — is the step's. A lane whose thread cannot be started runs on the
    /// caller's thread with lane 0 (concurrently, as one lane would); a lane that panics cancels
    /// the others and the panic goes on in the caller once they have stopped.
    fn drive_lanes(&self, op: &'static str, start: Instant, deadline: Instant, lanes: Lanes<'_>) -> Result<(), CollectiveError> {
        let mut lanes: Vec<Vec<Step>> = lanes.lanes.into_iter().filter(|l| !l.is_empty()).collect();
        if lanes.len() <= 1 {
            return self.drive(op, start, deadline, all_ok(lanes.pop().unwrap_or_default()));
        }
        self.aborted(op)?;
        let (cancel, cancelled) = tokio::sync::watch::channel(false);
        // The first failure in time: `Some(None)` for a timeout.
        let first: std::sync::Mutex<Option<Option<Fail>>> = std::sync::Mutex::new(None);
        /// Cancels the step's other lanes when dropped before `ok` is set (failure or panic).
        struct CancelUnlessOk<'a> {
            cancel: &'a tokio::sync::watch::Sender<bool>,
            ok: bool,
        }
        impl Drop for CancelUnlessOk<'_> {
            fn drop(&mut self) {
                if !self.ok {
                    self.cancel.send_replace(true);
                }
            }
        }
        let run = |steps: Vec<Step>| {
            let mut guard = CancelUnlessOk { cancel: &cancel, ok: false };
            let mut cancelled = cancelled.clone();
            let r = self.drive_raw(deadline, async move {
                tokio::select! {
                    biased;
                    _ = cancelled.wait_for(|c| *c) => Err(Fail::Cancelled),
                    r = all_ok(steps) => r,
                }
            });
            let failure = match r {
                Some(Ok(())) => {
                    guard.ok = true;
                    return;
                }
                Some(Err(Fail::Cancelled)) => return,
                Some(Err(e)) => Some(e),
                None => None,
            };
            let mut first = first.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if first.is_none() {
                *first = Some(failure);
            }
        };
        let mut it = lanes.into_iter();
        let mut inline = it.next().unwrap_or_default();
        let parked: Vec<std::sync::Mutex<Option<Vec<Step>>>> = it.map(|steps| std::sync::Mutex::new(Some(steps))).collect();
        let panicked = std::thread::scope(|s| {
            let mut threads = Vec::with_capacity(parked.len());
            for (k, steps) in parked.iter().enumerate() {
                let lane = std::thread::Builder::new().name(format!("tessera-lane-{}", k + 1));
                match lane.spawn_scoped(s, || run(take_parked(steps))) {
                    Ok(t) => threads.push(t),
                    // No thread to be had (a process or cgroup limit): run the lane here.
                    Err(_) => inline.extend(take_parked(steps)),
                }
            }
            run(inline);
            threads.into_iter().filter_map(|t| t.join().err()).next()
        });
        if let Some(payload) = panicked {
            std::panic::resume_unwind(payload);
        }
        match first.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner) {
            None => Ok(()),
            Some(failure) => self.finish(op, start, failure.map(Err)),
        }
    }

    /// Opens collective `op`: every rank sends its descriptor to every peer and receives all
    /// of theirs, so all ranks judge agreement on the same data (this round is also the barrier).
    fn enter(&mut self, op: Op, desc: OpDesc) -> Result<(Call, Vec<OpDesc>), CollectiveError> {
        self.aborted(op.name())?;
        let start = Instant::now();
        let call = Call { seq: self.seq, op, start, deadline: start + Duration::from_millis(self.timeout_ms) };
        self.seq += 1;
        let (rank, world, shared) = (self.rank, self.world, &*self.shared);
        let desc = OpDesc { lanes: self.recv_lanes as u32, ..desc };
        let control = Control::Desc { seq: call.seq, desc: desc.clone() };
        let sends: Vec<Step> =
            (1..world).map(|s| (rank + s) % world).map(|to| Box::pin(tx_msg(shared, self.conn(to), to, &control, &[])) as Step).collect();
        let recvs = async {
            let mut all = Vec::with_capacity(world);
            for from in 0..world {
                if from == rank {
                    all.push(desc.clone());
                    continue;
                }
                match shared.wait_for(from, 0, Key::Desc { seq: call.seq }).await? {
                    Delivery::Desc(d) => all.push(d),
                    _ => return Err(Fail::Mismatch(format!("rank {from} sent data instead of a descriptor"))),
                }
            }
            Ok(all)
        };
        let all = self.drive(op.name(), start, call.deadline, async { tokio::try_join!(all_ok(sends), recvs).map(|(_, all)| all) })?;
        if let Some(r) = all.iter().position(|d| d.op != all[0].op) {
            let detail = format!(
                "rank {r} called {} but rank 0 called {}",
                Op::name_of_code(u64::from(all[r].op)),
                Op::name_of_code(u64::from(all[0].op))
            );
            return Err(mismatch(op, detail));
        }
        // A rank receives stripes on lanes 0..lanes of every pair it has: it cannot have more
        // lanes than its pair with this rank.
        for (r, d) in all.iter().enumerate() {
            let pair = if r == self.rank { self.recv_lanes } else { self.conns[r].len() };
            if d.lanes == 0 || d.lanes as usize > pair {
                return Err(mismatch(
                    op,
                    format!("rank {r} declared {} receive lanes, but its pair with rank {} has {pair}", d.lanes, self.rank),
                ));
            }
        }
        self.peer_lanes = all.iter().map(|d| d.lanes as usize).collect();
        Ok((call, all))
    }

    /// `out ← Σ_q x_q` in rank order, where `x_q` is rank `q`'s slice for this rank (`parts[r]`
    /// is what this rank sends rank `r`; `own` says where this rank's contribution is). Every
    /// rank sends each owner its slice directly (see the module doc for why this is not a
    /// summing ring), all sends at once, while it receives the peers' slices in rank order,
    /// adding each chunk in as it arrives.
    ///
    /// With the contribution in place (an all-reduce), nothing is copied aside first: rank 0
    /// adds the others onto its own; rank 1 adds rank 0's slice onto its own (`x₁ + x₀`, the same
    /// bits as `x₀ + x₁`: IEEE addition is commutative); a rank `r ≥ 2` receives rank 0's slice
    /// into `acc`, adds ranks `1..r` there, then adds `acc` onto its own, and adds the ranks
    /// above it — the sum `((x₀ + x₁) + …) + x_{n−1}` of the in-process backend on every rank.
    fn reduce_to_owner<T: Elem>(
        &mut self,
        call: Call,
        step: u32,
        parts: &[&[T]],
        own: Own<'_, T>,
        out: &mut [T],
    ) -> Result<(), CollectiveError> {
        let (rank, world, shared) = (self.rank, self.world, &*self.shared);
        let key = Key::Coll { seq: call.seq, step };
        lending(|lender| {
            let mut lanes = Lanes::default();
            for to in (1..world).map(|s| (rank + s) % world) {
                self.tx_striped(&mut lanes, to, key, parts[to], Some(Lending { lender, sums: &[] }));
            }
            // Each lane sums its own stripe of `out`, over the ranks in order: every element's sum
            // runs in rank order whatever the lanes.
            let n = self.rx_stripes::<T>(out.len());
            let owns: Vec<Own<T>> = match own {
                Own::Slice(mine) => stripes(mine, n).into_iter().map(Own::Slice).collect(),
                Own::InPlace { acc } => stripes_mut(acc, n).into_iter().map(|acc| Own::InPlace { acc }).collect(),
            };
            for (k, (out, own)) in stripes_mut(out, n).into_iter().zip(owns).enumerate() {
                let conns: Vec<Option<&Connection>> = (0..world).map(|p| self.lane(p, k)).collect();
                let src = move |from: usize| Src { shared, conn: conns[from], rank: from, lane: k };
                lanes.push(
                    k,
                    Box::pin(async move {
                        match own {
                            Own::Slice(mine) => {
                                for from in 0..world {
                                    match (from == rank, from == 0) {
                                        (true, true) => out.copy_from_slice(mine),
                                        (true, false) => add_into(out, mine),
                                        (false, true) => rx_into(src(from), key, out).await?,
                                        (false, false) => rx_add(src(from), key, out).await?,
                                    }
                                }
                            }
                            Own::InPlace { acc } => {
                                if rank >= 2 {
                                    rx_into(src(0), key, &mut *acc).await?;
                                    for from in 1..rank {
                                        rx_add(src(from), key, &mut *acc).await?;
                                    }
                                    add_into(out, acc);
                                } else if rank == 1 {
                                    rx_add(src(0), key, out).await?;
                                }
                                for from in rank + 1..world {
                                    rx_add(src(from), key, out).await?;
                                }
                            }
                        }
                        Ok(())
                    }),
                );
            }
            self.drive_lanes(call.op.name(), call.start, call.deadline, lanes)
        })
    }

    /// Ring all-gather: at step `s` this rank forwards part `rank − s` to `rank + 1` while it
    /// receives part `rank − s − 1` from `rank − 1` straight into `out`. `out[ranges[rank]]`
    /// holds this rank's part, or, with `shard`, is filled from it: step 0 then sends from
    /// `shard`, and the lanes copy it into `out` while they send and receive, so that the local
    /// copy does not hold up the first transfer.
    ///
    /// What is sent is lent to quinn, not copied ([`super::lend`]), and a part received in one
    /// step goes on in the next with the checksums its chunks arrived with (where the stripes
    /// are cut alike), so forwarding reads none of its bytes here.
    fn ring_gather<T: Elem>(
        &mut self,
        call: Call,
        step0: u32,
        ranges: &[Range<usize>],
        shard: Option<&[T]>,
        out: &mut [T],
    ) -> Result<(), CollectiveError> {
        let (n, rank) = (self.world, self.rank);
        let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
        if let (Some(shard), true) = (shard, n < 2) {
            out[ranges[rank].clone()].copy_from_slice(shard);
        }
        // By stripe, the checksums of the part received in the last step (forwarded in this
        // one), and of the part arriving in this one.
        let (mut forwarded, mut arriving): (Vec<Vec<ChunkSum>>, Vec<Vec<ChunkSum>>) = Default::default();
        for s in 0..n.saturating_sub(1) {
            let key = Key::Coll { seq: call.seq, step: step0 + s as u32 };
            let (send_part, recv_part) = ((rank + n - s) % n, (rank + 2 * n - s - 1) % n);
            let (src, dst, mine) = match shard.filter(|_| s == 0) {
                Some(shard) => {
                    let (mine, dst) = split_pair_mut(out, ranges[rank].clone(), ranges[recv_part].clone());
                    (shard, dst, Some(mine))
                }
                None => {
                    let (src, dst) = split_pair(out, ranges[send_part].clone(), ranges[recv_part].clone());
                    (src, dst, None)
                }
            };
            let sums: &[Vec<ChunkSum>] = if s == 0 { &[] } else { &forwarded };
            let arriving = &mut arriving;
            lending(|lender| {
                let mut lanes = Lanes::default();
                if let Some(mine) = mine {
                    let c = stripe_count(self.peer_lanes[next], std::mem::size_of_val(src));
                    for (k, (d, from)) in stripes_mut(mine, c).into_iter().zip(stripes(src, c)).enumerate() {
                        lanes.push(k, Box::pin(copy_yielding(d, from)));
                    }
                }
                self.tx_striped(&mut lanes, next, key, src, Some(Lending { lender, sums }));
                let m = self.rx_stripes::<T>(dst.len());
                arriving.resize_with(m, Vec::new);
                for (k, (dst, sums)) in stripes_mut(dst, m).into_iter().zip(arriving.iter_mut()).enumerate() {
                    lanes.push(k, Box::pin(rx_into_summed(self.src(prev, k), key, dst, Some(sums))));
                }
                self.drive_lanes(call.op.name(), call.start, call.deadline, lanes)
            })?;
            std::mem::swap(&mut forwarded, arriving);
        }
        Ok(())
    }

    fn all_reduce_generic<T: Elem>(&mut self, buf: &mut [T], op: Op, scratch: &mut Scratch<T>) -> Result<(), CollectiveError> {
        let (call, descs) = self.enter(op, OpDesc { op: op as u8, lens: vec![buf.len() as u64], ends: vec![], lanes: 0 })?;
        same(op, &descs, "a buffer of length", |d| d.lens.first().copied())?;
        let ranges = even_ranges(buf.len(), self.world);
        let mine = ranges[self.rank].clone();
        // The sum lands in place in `buf[mine]`, in rank order (see `reduce_to_owner`).
        let (lo, rest) = buf.split_at_mut(mine.start);
        let (out, hi) = rest.split_at_mut(mine.len());
        let parts: Vec<&[T]> = ranges
            .iter()
            .map(|r| match r.end <= mine.start {
                true => &lo[r.clone()],
                false => &hi[r.start.saturating_sub(mine.end)..r.end.saturating_sub(mine.end)],
            })
            .collect();
        set_len(&mut scratch.owned, if self.rank >= 2 { out.len() } else { 0 });
        self.reduce_to_owner(call, 0, &parts, Own::InPlace { acc: &mut scratch.owned }, out)?;
        self.ring_gather(call, 1, &ranges, None, buf)?;
        self.stats.record(ring_all_reduce_traffic(buf.len(), self.world, self.rank, T::BYTES));
        Ok(())
    }

    /// Agreement checks shared by the ranged operations: same `lens[0]`, same ranges, valid.
    fn check_ranged(&self, op: Op, descs: &[OpDesc], what: &str, ranges: &[Range<usize>], total: usize) -> Result<(), CollectiveError> {
        same(op, descs, what, |d| d.lens.first().copied())?;
        if let Some(r) = descs.iter().position(|d| d.ends != descs[0].ends) {
            return Err(mismatch(op, format!("rank {r} passed range ends {:?} but rank 0 passed {:?}", descs[r].ends, descs[0].ends)));
        }
        check_ranges(op.name(), ranges, self.world, total)
    }

    /// Leaves the group: announces the streams sent to each peer, waits (bounded) for each to
    /// confirm it has them all, then closes the connections. An aborted group has nothing worth
    /// delivering: it closes at once (reason `aborted`), and an abort that arrives while the
    /// group is leaving ends the waits.
    fn leave(&mut self) {
        let deadline = Instant::now() + Duration::from_millis(self.timeout_ms.min(LEAVE_TIMEOUT_MS));
        let aborted = |c: &Self| c.shared.lock().aborted.is_some();
        if !aborted(self) {
            for (peer, lanes) in self.conns.iter().enumerate() {
                if let Some(conn) = lanes.first() {
                    let bye = Control::Bye { streams: self.shared.streams_sent[peer].load(Ordering::Relaxed) };
                    let _ = self.block_until(deadline, write_stream(conn, &bye, &[]));
                }
            }
            let (shared, conns, world) = (&*self.shared, &self.conns, self.world);
            let all_acked =
                shared.until(|st| (0..world).all(|p| conns[p].is_empty() || st.bye_acked[p] || st.gone[p].is_some()).then_some(()));
            let _ = self.block_until(deadline, all_acked);
        }
        let abort_reason = self.shared.lock().aborted.clone();
        let (code, reason) = match &abort_reason {
            Some(why) => (CLOSE_ABORTED, close_reason(why)),
            None => (CLOSE_BYE, "bye"),
        };
        let _context = self.rt.enter();
        for conn in self.conns.iter().flatten() {
            conn.close(VarInt::from_u32(code), reason.as_bytes());
        }
        let endpoints = self.endpoints.clone();
        let idle = async move {
            for endpoint in &endpoints {
                endpoint.wait_idle().await;
            }
        };
        let _ = self.rt.block_on(async move { tokio::time::timeout(Duration::from_millis(CLOSE_DRAIN_MS), idle).await });
        self.conns.clear();
    }

    /// Runs `f` on the runtime from the caller's thread; `None` when `deadline` passes or the
    /// group is aborted first.
    fn block_until<F: std::future::Future>(&self, deadline: Instant, f: F) -> Option<F::Output> {
        let shared = &self.shared;
        self.rt.block_on(async move {
            tokio::select! {
                biased;
                _ = shared.until_aborted() => None,
                r = tokio::time::timeout_at(deadline.into(), f) => r.ok(),
            }
        })
    }
}

impl Drop for QuicComm {
    fn drop(&mut self) {
        self.leave();
    }
}

fn mismatch(op: Op, detail: String) -> CollectiveError {
    CollectiveError::Mismatch { op: op.name(), detail }
}

/// Every rank declared the same `field` (as rank 0).
fn same(op: Op, descs: &[OpDesc], what: &str, field: impl Fn(&OpDesc) -> Option<u64>) -> Result<(), CollectiveError> {
    let want = field(&descs[0]);
    match descs.iter().position(|d| field(d) != want) {
        Some(r) => Err(mismatch(op, format!("rank {r} has {what} {:?} but rank 0 has {want:?}", field(&descs[r])))),
        None => Ok(()),
    }
}

impl Collective for QuicComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn timeout_ms(&self) -> u64 {
        self.timeout_ms
    }

    fn set_timeout_ms(&mut self, timeout_ms: u64) {
        self.timeout_ms = timeout_ms;
    }

    fn stats(&self) -> CommStats {
        self.stats
    }

    fn abort_handle(&self) -> AbortHandle {
        let (shared, rt, conns) = (self.shared.clone(), self.rt.handle().clone(), self.conns.clone());
        AbortHandle::new(move |reason| {
            if shared.abort(reason) {
                broadcast_abort(&rt, &conns, reason);
            }
        })
    }

    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        let mut scratch = std::mem::take(&mut self.scratch_f32);
        let r = self.all_reduce_generic(buf, Op::AllReduce, &mut scratch);
        self.scratch_f32 = scratch;
        r
    }

    fn all_reduce_sum_f64(&mut self, buf: &mut [f64]) -> Result<(), CollectiveError> {
        let mut scratch = std::mem::take(&mut self.scratch_f64);
        let r = self.all_reduce_generic(buf, Op::AllReduceF64, &mut scratch);
        self.scratch_f64 = scratch;
        r
    }

    fn reduce_scatter_sum(&mut self, input: &[f32], ranges: &[Range<usize>], out: &mut [f32]) -> Result<(), CollectiveError> {
        let op = Op::ReduceScatter;
        let desc = OpDesc { op: op as u8, lens: vec![input.len() as u64, out.len() as u64], ends: ends_of(ranges), lanes: 0 };
        let (call, descs) = self.enter(op, desc)?;
        self.check_ranged(op, &descs, "an input of length", ranges, input.len())?;
        if let Some(r) = (0..self.world).find(|&r| descs[r].lens.get(1) != Some(&(ranges[r].len() as u64))) {
            return Err(mismatch(op, format!("rank {r} passed an output of {:?} for {} elements", descs[r].lens.get(1), ranges[r].len())));
        }
        let parts: Vec<&[f32]> = ranges.iter().map(|r| &input[r.clone()]).collect();
        self.reduce_to_owner(call, 0, &parts, Own::Slice(parts[self.rank]), out)?;
        self.stats.record(ring_reduce_scatter_traffic(ranges, self.rank, 4));
        Ok(())
    }

    fn all_gather(&mut self, shard: &[f32], ranges: &[Range<usize>], out: &mut [f32]) -> Result<(), CollectiveError> {
        let op = Op::AllGather;
        let desc = OpDesc { op: op as u8, lens: vec![out.len() as u64, shard.len() as u64], ends: ends_of(ranges), lanes: 0 };
        let (call, descs) = self.enter(op, desc)?;
        self.check_ranged(op, &descs, "an output of length", ranges, out.len())?;
        if let Some(r) = (0..self.world).find(|&r| descs[r].lens.get(1) != Some(&(ranges[r].len() as u64))) {
            return Err(mismatch(op, format!("rank {r} passed a shard of {:?} for range {:?}", descs[r].lens.get(1), ranges[r])));
        }
        self.ring_gather(call, 0, ranges, Some(shard), out)?;
        self.stats.record(ring_all_gather_traffic(ranges, self.rank, 4));
        Ok(())
    }

    fn gather_slices_with(
        &mut self,
        input: &[f32],
        ranges: &[Range<usize>],
        visit: &mut dyn FnMut(usize, &[f32]),
    ) -> Result<(), CollectiveError> {
        let op = Op::GatherSlices;
        let (call, descs) = self.enter(op, OpDesc { op: op as u8, lens: vec![input.len() as u64], ends: ends_of(ranges), lanes: 0 })?;
        self.check_ranged(op, &descs, "an input of length", ranges, input.len())?;
        let mut scratch = std::mem::take(&mut self.scratch_f32);
        let (rank, world, shared) = (self.rank, self.world, &*self.shared);
        let key = Key::Coll { seq: call.seq, step: 0 };
        let sends: Vec<Step> = (1..world)
            .map(|s| (rank + s) % world)
            .map(|to| Box::pin(tx(shared, self.conn(to), to, key, &input[ranges[to].clone()])) as Step)
            .collect();
        let mine = ranges[rank].clone();
        let slice = &mut scratch.owned;
        // Received in rank order whatever the arrival order: later streams wait in QUIC's buffers.
        let recvs = async {
            for from in 0..world {
                if from == rank {
                    visit(from, &input[mine.clone()]);
                } else {
                    set_len(slice, mine.len());
                    rx_into(self.src(from, 0), key, slice).await?;
                    visit(from, slice);
                }
            }
            Ok(())
        };
        let r = self.drive(op.name(), call.start, call.deadline, async { tokio::try_join!(all_ok(sends), recvs).map(|_| ()) });
        self.scratch_f32 = scratch;
        r?;
        self.stats.record(gather_slices_traffic(ranges, self.rank, 4));
        Ok(())
    }

    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CollectiveError> {
        let op = Op::Broadcast;
        let (call, descs) = self.enter(op, OpDesc { op: op as u8, lens: vec![buf.len() as u64, root as u64], ends: vec![], lanes: 0 })?;
        same(op, &descs, "root", |d| d.lens.get(1).copied())?;
        same(op, &descs, "a buffer of length", |d| d.lens.first().copied())?;
        self.check_rank(op.name(), "root", root)?;
        let (n, rank) = (self.world, self.rank);
        let pos = (rank + n - root) % n;
        let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
        let len = buf.len();
        let piece = |k: usize| (k * PIECE_ELEMS).min(len)..((k + 1) * PIECE_ELEMS).min(len);
        let pieces = len.div_ceil(PIECE_ELEMS);
        let key = |k: usize| Key::Coll { seq: call.seq, step: k as u32 };
        // Step k receives piece k from the previous rank while forwarding piece k − 1.
        for k in 0..=pieces {
            let (recv_k, send_k) = ((pos > 0 && k < pieces).then_some(k), (pos + 1 < n && k > 0).then(|| k - 1));
            let (done, rest) = buf.split_at_mut(piece(k).start);
            let mut lanes = Lanes::default();
            if let Some(j) = send_k {
                self.tx_striped(&mut lanes, next, key(j), &done[piece(j)], None);
            }
            if let Some(j) = recv_k {
                let dst = &mut rest[..piece(j).len()];
                let n = self.rx_stripes::<f32>(dst.len());
                for (lane, dst) in stripes_mut(dst, n).into_iter().enumerate() {
                    lanes.push(lane, Box::pin(rx_into(self.src(prev, lane), key(j), dst)));
                }
            }
            if recv_k.is_some() || send_k.is_some() {
                self.drive_lanes(op.name(), call.start, call.deadline, lanes)?;
            }
        }
        self.stats.record(chain_broadcast_traffic(len, n, root, self.rank, 4));
        Ok(())
    }

    fn all_to_all(&mut self, send: &[&[f32]]) -> Result<Vec<Vec<f32>>, CollectiveError> {
        let op = Op::AllToAll;
        let (call, descs) = self.enter(op, OpDesc { op: op as u8, lens: vec![send.len() as u64], ends: vec![], lanes: 0 })?;
        let world = self.world;
        if let Some(r) = descs.iter().position(|d| d.lens.first() != Some(&(world as u64))) {
            return Err(mismatch(op, format!("rank {r} passed {:?} send buffers for a world of {world}", descs[r].lens.first())));
        }
        let (rank, shared) = (self.rank, &*self.shared);
        let key = Key::Coll { seq: call.seq, step: 0 };
        let sends: Vec<Step> =
            (1..world).map(|s| (rank + s) % world).map(|to| Box::pin(tx(shared, self.conn(to), to, key, send[to])) as Step).collect();
        let recvs = async {
            let mut recv = Vec::with_capacity(world);
            for (from, mine) in send.iter().enumerate() {
                match from == rank {
                    true => recv.push(mine.to_vec()),
                    false => recv.push(rx_vec::<f32>(self.src(from, 0), key).await?),
                }
            }
            Ok(recv)
        };
        let recv = self.drive(op.name(), call.start, call.deadline, async { tokio::try_join!(all_ok(sends), recvs).map(|(_, r)| r) })?;
        let others =
            |lens: &mut dyn Iterator<Item = usize>| lens.enumerate().filter(|&(r, _)| r != self.rank).map(|(_, n)| n as u64 * 4).sum();
        let bytes_sent = others(&mut send.iter().map(|s| s.len()));
        let bytes_received = others(&mut recv.iter().map(Vec::len));
        self.stats.record(Traffic { bytes_sent, bytes_received });
        Ok(recv)
    }

    fn send(&mut self, to: usize, tag: u64, data: &[f32]) -> Result<(), CollectiveError> {
        self.check_rank("send", "destination", to)?;
        self.aborted("send")?;
        let n = *self.p2p_sent.get(&(to, tag)).unwrap_or(&0);
        let key = Key::P2p { tag, n };
        if to == self.rank {
            self.shared.lock().msgs.insert((to, 0, key), Delivery::Data(Payload::F32(data.to_vec())));
            self.shared.changed();
        } else {
            let start = Instant::now();
            let deadline = start + Duration::from_millis(self.timeout_ms);
            self.drive("send", start, deadline, tx(&self.shared, self.conn(to), to, key, data))?;
        }
        self.p2p_sent.insert((to, tag), n + 1);
        let bytes_sent = if to == self.rank { 0 } else { data.len() as u64 * 4 };
        self.stats.record(Traffic { bytes_sent, bytes_received: 0 });
        Ok(())
    }

    fn recv(&mut self, from: usize, tag: u64) -> Result<Vec<f32>, CollectiveError> {
        self.check_rank("recv", "source", from)?;
        let n = *self.p2p_next.get(&(from, tag)).unwrap_or(&0);
        let start = Instant::now();
        let key = Key::P2p { tag, n };
        let data = self.drive("recv", start, start + Duration::from_millis(self.timeout_ms), async {
            take_data::<f32>(from, key, self.shared.wait_for(from, 0, key).await?, None)
        })?;
        self.p2p_next.insert((from, tag), n + 1);
        let bytes_received = if from == self.rank { 0 } else { data.len() as u64 * 4 };
        self.stats.record(Traffic { bytes_sent: 0, bytes_received });
        Ok(data)
    }

    fn barrier(&mut self) -> Result<(), CollectiveError> {
        self.enter(Op::Barrier, OpDesc { op: Op::Barrier as u8, lens: vec![], ends: vec![], lanes: 0 })?;
        self.stats.record(Traffic::default());
        Ok(())
    }
}

#[cfg(test)]
impl QuicComm {
    /// The raw connection to `peer`, for tests that misbehave on the wire.
    pub(crate) fn conns_for_test(&self, peer: usize) -> Connection {
        self.conns[peer].first().cloned().expect("a connected peer")
    }
}
