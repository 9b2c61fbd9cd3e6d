//! Connections of the QUIC backend: transport tuning, the full mesh with rank identities
//! checked against certificates, the per-peer reader tasks and the inbox they fill.

use super::frame::{
    read_body, read_header, read_message, write_message, write_message_with, ChunkSum, Control, FrameError, Key, OpDesc, Payload,
};
use super::pki::{check_cert_names_node, NodeTls, PkiError};
use super::refusals::RefusalLog;
use quinn::udp::{RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, Connection, Endpoint, RecvStream, UdpPoller, VarInt};
use std::collections::HashMap;
use std::future::Future;
use std::io::IoSliceMut;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
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
/// Largest UDP payload accepted, and the upper bound of path-MTU discovery: the largest IPv4 UDP
/// datagram. See [`transport_config`] for why so large.
pub const UDP_PAYLOAD_MAX: u16 = 65_507;
/// Congestion window before the first loss or ACK: 1 MiB.
pub const INITIAL_WINDOW_BYTES: u64 = 1 << 20;
/// After a suspected MTU black hole, probe again this soon (quinn's default is 60 s).
pub const BLACK_HOLE_COOLDOWN_MS: u64 = 5_000;
/// A packet counts as lost once this many later packets were acknowledged (quinn's default: 3);
/// see [`transport_config`], "Reordering".
pub const REORDER_PACKETS: u32 = 50;
/// … or once this many RTTs passed since it was sent (quinn's default: 9/8).
pub const REORDER_RTTS: f32 = 2.0;

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

/// The variable that sets how many parallel connections (lanes) a rank asks each peer for:
/// `1` to [`LANES_MAX`]; unset, [`lanes_default`].
pub const LANES_ENV: &str = "TESSERA_QUIC_LANES";
/// Most lanes a pair of ranks may use.
pub const LANES_MAX: usize = 8;

/// Lanes asked for between processes of one host when [`LANES_ENV`] is unset: 4 on hosts with
/// at least 8 cores, else 1 (see [`lanes_wanted`]).
///
/// A QUIC connection is driven by one task: it packetises and seals everything sent on the
/// connection and opens everything received, so one connection moves at most what one core can
/// encrypt and copy, however many streams it carries; and an endpoint's one driver reads and
/// dispatches every datagram of its socket. Measured on the GPU machine's 16 idle cores
/// (loopback, `collective_bench --procs 2,4 --mib 64`, 2026-12-01): with one lane no thread of a
/// rank was saturated, yet QUIC moved 28–41 % of the TCP ring's bus bandwidth (the connection
/// driver, moving between the runtime's workers, was the limit); lanes sharing one endpoint
/// reached 48–76 %; one endpoint per lane (as now) 56–95 % with 4 lanes over three rounds (up to
/// 100 % in other runs; 2 lanes 48–69 %,
/// 6 and 8 lanes no better than 4). On a 2-core host the ranks already share both cores, and
/// a second lane only adds threads: one lane there (measured: no gain).
pub fn lanes_default() -> usize {
    match std::thread::available_parallelism().map_or(1, usize::from) {
        n if n >= 8 => 4,
        _ => 1,
    }
}

/// The lanes a rank listening on `addr` asks for: [`LANES_ENV`] when set (an error names a bad
/// value); else [`lanes_default`] for a loopback address and 1 for any other. A pair uses the
/// smaller of its two ranks' numbers.
///
/// Lanes after the first run between extra UDP sockets on ports the OS picks, announced in the
/// hellos. Between processes of one host (loopback) nothing stands in their way; across hosts a
/// firewall or security group that opens only the data port (`--quic-port`) would block them, so
/// there lanes are the user's choice (`TESSERA_QUIC_LANES`, with those ports open).
pub fn lanes_wanted(addr: SocketAddr) -> Result<usize, String> {
    match lanes_from_env()? {
        Some(n) => Ok(n),
        None if addr.ip().is_loopback() => Ok(lanes_default()),
        None => Ok(1),
    }
}

/// The number that variable `name` holds, given its value as [`std::env::var`] returns it:
/// `None` when it is unset; an error naming the variable, its value and what was expected
/// (a number of `what` in `range`) when the value is anything else — not a number, out of
/// range, not UTF-8. Every count the transport reads from the environment goes through here,
/// and so does `tessera`'s start-up check of every `TESSERA_*` count (`tessera::env`, the table
/// that lists and checks every variable, this crate's included, before a command starts;
/// [`QuicComm`](super::QuicComm) reads them again, refusing the same values, when it connects).
pub fn env_count(
    name: &str,
    value: Result<String, std::env::VarError>,
    range: std::ops::RangeInclusive<usize>,
    what: &str,
) -> Result<Option<usize>, String> {
    let bad = |v: &dyn std::fmt::Debug| format!("{name}={v:?}: expected a number of {what} from {} to {}", range.start(), range.end());
    match value {
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(v)) => Err(bad(&v)),
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n) if range.contains(&n) => Ok(Some(n)),
            _ => Err(bad(&v)),
        },
    }
}

/// The variable that sets how many worker threads a rank's tokio runtime gets (for
/// measurements): `1` to [`WORKERS_MAX`]; unset, [`runtime_workers`] chooses.
pub const WORKERS_ENV: &str = "TESSERA_QUIC_WORKERS";
/// Most runtime worker threads [`WORKERS_ENV`] may ask for: a bound, so that a typo cannot
/// start thousands of threads per rank ([`runtime_workers`] itself picks at most half the
/// cores; the measurements behind it found nothing gained past as many as the lanes).
pub const WORKERS_MAX: usize = 64;

/// [`LANES_ENV`]'s number, if set.
fn lanes_from_env() -> Result<Option<usize>, String> {
    env_count(LANES_ENV, std::env::var(LANES_ENV), 1..=LANES_MAX, "lanes")
}

/// [`WORKERS_ENV`]'s number, if set.
fn workers_from_env() -> Result<Option<usize>, String> {
    env_count(WORKERS_ENV, std::env::var(WORKERS_ENV), 1..=WORKERS_MAX, "worker threads")
}

/// Worker threads of a rank's tokio runtime for `lanes` connections per peer: 1 on hosts with
/// fewer than 4 cores; else as many as the lanes (at least 2), at most half the cores.
///
/// The workers run the endpoint driver (UDP receive and dispatch) and one driver per connection
/// (packetising, AEAD, ACKs); the rank's own threads copy payloads in and out. With two workers
/// a rank's send- and receive-side connections encrypt and decrypt in parallel, which pays where
/// cores are free; each further lane's driver wants a worker of its own, but not one more: on
/// the GPU machine's 16 idle cores (4 lanes, `collective_bench --procs 2,3,4 --mib 64`, three
/// rounds alternated, 2026-12-02) 4 workers a rank were the best or level with the best in five
/// of six rows against 5 (the rule before) and 3 — a matter of scheduling, within the machine's
/// run-to-run spread (docs/PERFORMANCE.md). On a 2-core host several
/// ranks already share the cores: a second worker per rank then only adds thread hand-offs —
/// measured on the 2-core dev box, one worker halved the context switches (130 k → 57 k per
/// benchmark run), cut p99 small-message latency from ~1.3 ms to ~0.13 ms, and used less CPU per
/// bulk call (4 ranks: ~355 against ~400 ms per 64 MiB all-gather).
/// [`WORKERS_ENV`] overrides the number (for measurements); a value that is not a number from
/// 1 to [`WORKERS_MAX`] is an error naming it.
pub fn runtime_workers(lanes: usize) -> Result<usize, String> {
    if let Some(n) = workers_from_env()? {
        return Ok(n);
    }
    Ok(match std::thread::available_parallelism().map_or(1, usize::from) {
        n if n >= 4 => lanes.max(2).min(n / 2),
        _ => 1,
    })
}

/// The variable that leaves glibc's malloc settings alone when set to `0` (for comparisons).
pub const MALLOC_TUNE_ENV: &str = "TESSERA_MALLOC_TUNE";

/// glibc heap settings, applied once per process (by `tessera`'s `main` for every command and by
/// [`QuicComm`](super::QuicComm)): allocations below 32 MiB come from the heap (the most glibc's
/// own heuristic would reach), freed memory at an arena's top goes back to the kernel only
/// beyond 1 GiB (glibc's default is 128 KiB, raised by its heuristic to twice the mmap
/// threshold, at most 64 MiB), and a process has at most as many malloc arenas as the host has
/// cores (glibc's default is 8 per core).
///
/// A training step allocates and frees its transient buffers (gradient buckets to send, the
/// pieces received, GEMM outputs, quinn's per-datagram buffers) a wave at a time. With glibc's
/// defaults the top of the main heap is trimmed after every wave whose free tail passes the
/// threshold, and a thread whose arena outgrows its heap maps a new 64 MiB heap that glibc unmaps
/// again as soon as it is free (whatever the threshold; fewer arenas make that rarer, they do not
/// prevent it); every page is then faulted back in, zeroed, on the next step (with a TLB
/// shoot-down per unmap in a multi-threaded process). Whether a run's waves stay under the
/// threshold depended on where long-lived allocations happened to sit in the heap, so identical
/// runs differed by 15 %. Measured on the 2-core dev box (gpt-10m, 4 elastic worker processes,
/// 100 steps): 6.5 M page faults and 384 tokens/s with the old 64 MiB threshold, 0.84 M and
/// 464 tokens/s with these settings (`docs/PERFORMANCE.md`, "The allocator"). The cost is that
/// freed memory stays with the process for reuse: up to 1 GiB at the main heap's top, and the
/// other arenas' heaps (≤ 64 MiB each, one arena per core at most) no longer shrink in place;
/// buffers of 32 MiB and more are mapped and unmapped on their own, as before. This overrides a
/// user's `MALLOC_ARENA_MAX`/`MALLOC_TRIM_THRESHOLD_`; `TESSERA_MALLOC_TUNE=0` leaves glibc's
/// settings (and those variables) in place. Other allocators and non-glibc targets are left alone.
pub fn tune_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            if std::env::var_os(MALLOC_TUNE_ENV).is_some_and(|v| v == "0") {
                return;
            }
            let arenas = std::thread::available_parallelism().map_or(2, usize::from).max(2);
            let arenas = libc::c_int::try_from(arenas).unwrap_or(libc::c_int::MAX);
            // SAFETY: mallopt only changes glibc's malloc parameters; every value is in range.
            unsafe {
                libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
                libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
                libc::mallopt(libc::M_ARENA_MAX, arenas);
            }
        });
    }
}

/// Application close code of a graceful leave.
pub const CLOSE_BYE: u32 = 0;
/// Application close code of a leave from an aborted group (the reason is the abort's).
pub const CLOSE_ABORTED: u32 = 3;
/// Longest close reason sent, in bytes (a close frame must fit in one packet).
pub const CLOSE_REASON_BYTES_MAX: usize = 256;

/// `reason` cut to at most [`CLOSE_REASON_BYTES_MAX`] bytes at a character boundary.
pub fn close_reason(reason: &str) -> &str {
    let mut end = reason.len().min(CLOSE_REASON_BYTES_MAX);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    &reason[..end]
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

/// Transport settings tuned for bulk tensor transfer between the ranks of one job:
///
/// - **Packet size.** Path-MTU discovery searches up to [`UDP_PAYLOAD_MAX`] (64 KiB, and the
///   endpoint accepts datagrams that large: [`endpoint_config`]). Every QUIC packet costs a fixed
///   amount of work on both sides — an AEAD seal/open with its own nonce and tag, header
///   protection, a packet number to track and acknowledge, a pass through the congestion
///   controller — so the packet size sets the CPU cost per byte as much as the crypto does. On
///   loopback (MTU 65 536), where ranks on one host talk, discovery settles at ~64 KiB; measured
///   on the 2-core dev box this cut user CPU per byte by ~45 % against quinn's default 1 472-byte
///   packets. Jumbo-frame LANs settle at ~9 000, ordinary Ethernet at ~1 450; the only cost of
///   the high bound there is a few extra lost probes after the handshake (binary search, in the
///   background). Large packets need [`GsoSplit`] underneath. quinn sizes its receive buffer for
///   32 GRO batches of the largest datagram (~128 MiB of address space); only the bytes of
///   datagrams actually received are touched (a 2-rank benchmark child stays at ~27 MiB resident).
/// - **Windows.** A 16 MiB stream window ([`STREAM_WINDOW_BYTES`]) keeps one large message
///   streaming without waiting for window updates up to ~10 Gb/s × 10 ms; the 64 MiB connection
///   window and send buffer ([`CONNECTION_WINDOW_BYTES`]) let a ring step and point-to-point
///   traffic be in flight together. These also bound the memory a peer can make us hold, per
///   lane (a pair with 4 lanes may hold 4 connection windows).
/// - **Streams.** One unidirectional stream per message ([`STREAMS_MAX`] may be open), none
///   bidirectional. A ring step is one stream per neighbour, direction and lane: all streams of
///   a connection are packetised by that connection's one driver task, so splitting a message
///   over parallel streams of one connection adds framing but no parallelism — parallel
///   connections (lanes, [`lanes_default`]) do.
/// - **Congestion control: Cubic** with a 1 MiB initial window ([`INITIAL_WINDOW_BYTES`]).
///   Cubic is quinn's mature default and fills a low-loss datacenter link within a few RTTs;
///   quinn's BBR is marked experimental, and collectives are throughput- not queue-sensitive.
///   Pacing stays on (quinn spreads a window over an RTT), which keeps bursts below the
///   receiver's socket buffer ([`SOCKET_BUFFER_BYTES`]).
/// - **ACKs**: quinn's defaults (an ACK every second ack-eliciting packet, 25 ms max delay).
///   With 64 KiB packets that is one ACK per 128 KiB, a negligible cost.
/// - **Reordering.** A packet is declared lost once [`REORDER_PACKETS`] later packets were
///   acknowledged, or [`REORDER_RTTS`] RTTs after it was sent (quinn: 3 packets, 9/8 RTT). Each
///   spurious loss halves Cubic's window, so under reordering quinn's thresholds collapse the
///   throughput: measured with the chaos harness (gpt-tiny, 4 workers, 8 steps, one worker's
///   datagrams delayed 2 ms with 2 ms of seeded jitter by its fault proxy) the run did not finish
///   within 150 s with quinn's thresholds, against 5.0 s with the same delay and no jitter; with
///   these it took 19–23 s (50 packets and 4 or 2 RTTs; 1 000 packets and 1.5 RTT: 45 s; 4 RTTs
///   alone did not finish within 60 s, nor 20 packets alone within 40 s). On loopback and clean links
///   nothing is reordered or lost, so this changes nothing; a real loss is now noticed after
///   2 RTTs or 50 later packets, where quinn's thresholds noticed it after 9/8 RTT or 3.
/// - **MTU black holes**: after a burst of losses quinn may suspect the large MTU and fall back
///   to 1 200 bytes; it re-probes after [`BLACK_HOLE_COOLDOWN_MS`] rather than quinn's 60 s, since a
///   minute of 1 200-byte packets costs several times the CPU per byte.
/// - Keep-alive every [`KEEP_ALIVE_MS`] and a [`IDLE_TIMEOUT_MS`] idle timeout, which is how a
///   silent dead peer is noticed.
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
    mtu.upper_bound(UDP_PAYLOAD_MAX).black_hole_cooldown(Duration::from_millis(BLACK_HOLE_COOLDOWN_MS));
    t.mtu_discovery_config(Some(mtu));
    t.packet_threshold(REORDER_PACKETS).time_threshold(REORDER_RTTS);
    let mut cubic = quinn::congestion::CubicConfig::default();
    cubic.initial_window(INITIAL_WINDOW_BYTES);
    t.congestion_controller_factory(Arc::new(cubic));
    t
}

/// Endpoint settings: datagrams up to [`UDP_PAYLOAD_MAX`] are accepted (quinn's default, 1 472,
/// would cap every path at the Ethernet MTU whatever discovery finds; see [`transport_config`]).
pub fn endpoint_config() -> quinn::EndpointConfig {
    let mut e = quinn::EndpointConfig::default();
    // 65 507 lies within quinn's accepted range (1 200..=65 527), so this cannot fail.
    if let Err(e) = e.max_udp_payload_size(UDP_PAYLOAD_MAX) {
        unreachable!("max_udp_payload_size({UDP_PAYLOAD_MAX}) refused: {e}");
    }
    e
}

/// Largest UDP payload one `sendmsg` may carry, segmented (GSO) or not: the IPv4 limit.
pub const SENDMSG_BYTES_MAX: usize = 65_507;

/// The UDP socket under the endpoint: quinn-udp's socket, except that a GSO batch larger than
/// one `sendmsg` may carry goes out in several calls.
///
/// quinn batches up to 10 datagrams of the path MTU into one segmentation-offload `sendmsg`.
/// Linux refuses a call of more than 64 KiB with `EMSGSIZE`, and quinn-udp drops such a batch
/// silently (it takes `EMSGSIZE` for a too-large MTU probe; see quinn-rs/quinn#2199 and #2653).
/// With jumbo frames (10 × 8 952 bytes) or on loopback (10 × ~64 KiB) every full batch would be
/// lost and the connection would stall or time out. This wrapper cuts such a batch into calls
/// of at most [`SENDMSG_BYTES_MAX`] bytes, each still segmented by the kernel where it holds
/// several datagrams. If a later part finds the socket full, the whole batch is reported as
/// blocked and retried: the parts already sent arrive twice, which QUIC discards as duplicates,
/// rather than be lost.
#[derive(Debug)]
pub struct GsoSplit(pub Arc<dyn AsyncUdpSocket>);

impl AsyncUdpSocket for GsoSplit {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        self.0.clone().create_io_poller()
    }

    fn try_send(&self, t: &Transmit) -> std::io::Result<()> {
        let Some(seg) = t.segment_size.filter(|_| t.contents.len() > SENDMSG_BYTES_MAX) else {
            return self.0.try_send(t);
        };
        for (range, segment_size) in sendmsg_parts(t.contents.len(), seg) {
            let part = Transmit { destination: t.destination, ecn: t.ecn, contents: &t.contents[range], segment_size, src_ip: t.src_ip };
            self.0.try_send(&part)?;
        }
        Ok(())
    }

    fn poll_recv(&self, cx: &mut Context, bufs: &mut [IoSliceMut<'_>], meta: &mut [RecvMeta]) -> Poll<std::io::Result<usize>> {
        self.0.poll_recv(cx, bufs, meta)
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.0.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        self.0.max_transmit_segments()
    }

    fn max_receive_segments(&self) -> usize {
        self.0.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.0.may_fragment()
    }
}

/// How [`GsoSplit`] cuts a batch of `len` bytes in datagrams of `seg` bytes (the last may be
/// shorter): byte ranges of whole datagrams, at most [`SENDMSG_BYTES_MAX`] each (one datagram
/// where a datagram is larger), with the segment size to give the kernel (`None`: one datagram).
fn sendmsg_parts(len: usize, seg: usize) -> impl Iterator<Item = (std::ops::Range<usize>, Option<usize>)> {
    let per_call = (SENDMSG_BYTES_MAX / seg).max(1) * seg;
    (0..len).step_by(per_call).map(move |at| {
        let end = (at + per_call).min(len);
        (at..end, (end - at > seg).then_some(seg))
    })
}

/// What a reader task delivered, keyed by (sender, lane, key).
#[derive(Debug)]
pub(crate) enum Delivery {
    Data(Payload),
    Desc(OpDesc),
    /// A collective's payload, not read yet: its header said `elems` values of type `elem`. The
    /// rank's caller reads it straight into its destination (see `QuicComm`), and counts the
    /// stream as done (`Shared::stream_done`) once it has read it to the end.
    Stream {
        elem: u8,
        elems: u64,
        stream: RecvStream,
    },
}

pub(crate) struct Inbox {
    /// Keyed by (sender, lane, key): the stripes of one message arrive on different lanes.
    pub msgs: HashMap<(usize, usize, Key), Delivery>,
    pub aborted: Option<String>,
    /// Why a peer is no longer reachable (it left, or its connection was lost or closed).
    pub gone: Vec<Option<String>>,
    /// Data and descriptor streams fully received from each peer.
    pub streams_done: Vec<u64>,
    pub bye_acked: Vec<bool>,
}

/// State shared by a rank's caller thread, its reader tasks and its abort handles. Every change
/// wakes the futures waiting on `notify` (the caller waits in `block_on`, so no thread blocks
/// on a condition variable and a delivery nobody waits for costs no system call).
pub(crate) struct Shared {
    pub rank: usize,
    state: Mutex<Inbox>,
    notify: tokio::sync::Notify,
    /// Data and descriptor streams fully written to each peer (announced when leaving).
    pub streams_sent: Vec<AtomicU64>,
}

/// Why an asynchronous wait or transfer of the caller ended early.
#[derive(Debug)]
pub(crate) enum Fail {
    Aborted(String),
    Gone(usize),
    Mismatch(String),
    /// Another lane of the same step failed first (its error is the step's).
    Cancelled,
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
        Shared {
            rank,
            state: Mutex::new(inbox),
            notify: tokio::sync::Notify::new(),
            streams_sent: (0..world).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, Inbox> {
        // No critical section panics half-way, so a poisoned inbox is still consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Wakes every waiter (call after changing the inbox).
    pub fn changed(&self) {
        self.notify.notify_waiters();
    }

    /// Marks the group aborted; true when this call set the reason (the first one wins).
    pub fn abort(&self, reason: &str) -> bool {
        let mut st = self.lock();
        let first = st.aborted.is_none();
        if first {
            st.aborted = Some(reason.to_string());
        }
        drop(st);
        self.changed();
        first
    }

    pub fn peer_gone(&self, peer: usize, reason: String) {
        let mut st = self.lock();
        if st.gone[peer].is_none() {
            st.gone[peer] = Some(reason);
        }
        drop(st);
        self.changed();
    }

    /// Files a received message; a repeated key is a protocol violation. A complete message
    /// counts as a finished stream; a [`Delivery::Stream`] counts once read ([`Self::stream_done`]).
    fn deliver(&self, peer: usize, lane: usize, key: Key, d: Delivery) -> Result<(), String> {
        let mut st = self.lock();
        if !matches!(d, Delivery::Stream { .. }) {
            st.streams_done[peer] += 1;
        }
        let dup = st.msgs.insert((peer, lane, key), d).is_some();
        drop(st);
        self.changed();
        match dup {
            false => Ok(()),
            true => Err(format!("duplicate message {key:?} on lane {lane}")),
        }
    }

    /// The caller has read a [`Delivery::Stream`] from `peer` to its end.
    pub fn stream_done(&self, peer: usize) {
        self.lock().streams_done[peer] += 1;
        self.changed();
    }

    /// Waits (without blocking a thread) for message `key` from `from` on `lane`; ends early
    /// when the group is aborted or `from` is gone with nothing left for `key`.
    pub async fn wait_for(&self, from: usize, lane: usize, key: Key) -> Result<Delivery, Fail> {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut st = self.lock();
                if let Some(reason) = &st.aborted {
                    return Err(Fail::Aborted(reason.clone()));
                }
                if let Some(d) = st.msgs.remove(&(from, lane, key)) {
                    return Ok(d);
                }
                if st.gone[from].is_some() {
                    return Err(Fail::Gone(from));
                }
            }
            notified.await;
        }
    }

    /// Resolves once the group is aborted, with the reason.
    pub async fn until_aborted(&self) -> String {
        self.until(|st| st.aborted.clone()).await
    }

    /// Resolves with the first `Some` that `f` finds in the inbox, re-checking after each change.
    pub async fn until<R>(&self, f: impl Fn(&Inbox) -> Option<R>) -> R {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(r) = f(&self.lock()) {
                return r;
            }
            notified.await;
        }
    }
}

/// Opens a unidirectional stream to `conn` and writes one message on it.
pub(crate) async fn write_stream(conn: &Connection, control: &Control, payload: &[u8]) -> Result<(), String> {
    let mut s = conn.open_uni().await.map_err(|e| lost_why(conn, e))?;
    write_message(&mut s, control, payload).await.map_err(|e| lost_why(conn, e))?;
    s.finish().map_err(|e| lost_why(conn, e))
}

/// [`write_stream`] for a payload lent to quinn rather than copied ([`super::lend`]), with the
/// chunks' checksums where `sums` has them. Returns once the peer has acknowledged every lent
/// piece (quinn then holds none of `payload`); on any failure the stream is reset on the way out,
/// which discards what quinn held of it.
pub(crate) async fn write_stream_lent<'d>(
    conn: &Connection,
    lender: &super::lend::Lender<'d>,
    control: &Control,
    payload: &'d [u8],
    sums: Option<&[ChunkSum]>,
) -> Result<(), String> {
    let mut lent = lender.stream(conn.open_uni().await.map_err(|e| lost_why(conn, e))?);
    let super::lend::LentStream { stream, loan } = &mut lent;
    write_message_with(stream, control, payload, Some(&*loan), sums).await.map_err(|e| lost_why(conn, e))?;
    stream.finish().map_err(|e| lost_why(conn, e))?;
    let stopped = stream.stopped();
    tokio::select! {
        biased;
        () = loan.returned() => Ok(()),
        r = stopped => match r {
            // Finished and all acknowledged: quinn dropped every piece as its ACK came.
            Ok(None) => {
                loan.returned().await;
                Ok(())
            }
            Ok(Some(code)) => Err(format!("the peer stopped reading the stream (code {code})")),
            Err(e) => Err(lost_why(conn, e)),
        },
    }
}

/// `e` with the reason `conn` was closed, when it was: quinn's stream errors say only
/// "connection lost", while the reason says who closed it and why (for a dialer whose client
/// certificate the peer refused after the dialer's side of the handshake had completed:
/// "aborted by peer: the cryptographic handshake failed: … invalid peer certificate …").
fn lost_why(conn: &Connection, e: impl std::fmt::Display) -> String {
    let e = e.to_string();
    match conn.close_reason().map(|why| why.to_string()) {
        Some(why) if !e.contains(&why) => format!("{e}: {why}"),
        _ => e,
    }
}

/// Tells every connected peer that the group is aborted (best effort, in the background), on
/// each pair's first lane.
pub(crate) fn broadcast_abort(rt: &tokio::runtime::Handle, conns: &[Vec<Connection>], reason: &str) {
    for conn in conns.iter().filter_map(|lanes| lanes.first()) {
        let (conn, control) = (conn.clone(), Control::Abort { reason: reason.to_string() });
        rt.spawn(async move { write_stream(&conn, &control, &[]).await });
    }
}

/// Closes `conn` after a bad frame or protocol violation, logging why.
pub(crate) fn reject(shared: &Shared, conn: &Connection, peer: usize, why: &str) {
    eprintln!("tessera-quic: rank {}: closing the connection to rank {peer}: {why}", shared.rank);
    conn.close(VarInt::from_u32(1), why.as_bytes());
    shared.peer_gone(peer, format!("connection closed: {why}"));
}

/// Accepts the peer's streams on one of the pair's lanes until that connection ends; each
/// stream is read by its own task. A collective's payload is left in its stream for the caller
/// to read into place; every other message is read whole here. Lanes after the first carry
/// collective payload stripes only. The end of any lane's connection ends the peer.
pub(crate) async fn serve_peer(shared: Arc<Shared>, conn: Connection, peer: usize, lane: usize) {
    loop {
        match conn.accept_uni().await {
            Ok(mut stream) => {
                let (shared, conn) = (shared.clone(), conn.clone());
                tokio::spawn(async move {
                    let filed = async {
                        let control = read_header(&mut stream).await?;
                        if let Control::Data { key: key @ Key::Coll { .. }, elem, elems } = control {
                            return Ok(shared.deliver(peer, lane, key, Delivery::Stream { elem, elems, stream }));
                        }
                        if lane > 0 {
                            return Ok(Err(format!("unexpected {control:?} on lane {lane}, which carries collective payloads only")));
                        }
                        let payload = read_body(&mut stream, &control).await?;
                        Ok(handle(&shared, &conn, peer, (control, payload)))
                    };
                    match filed.await {
                        Ok(Ok(())) => {}
                        Ok(Err(why)) => reject(&shared, &conn, peer, &why),
                        Err(FrameError::Io(e)) => shared.peer_gone(peer, format!("stream failed: {e}")),
                        Err(e) => reject(&shared, &conn, peer, &e.to_string()),
                    }
                });
            }
            Err(e) => {
                // A peer that left an aborted group closes with CLOSE_ABORTED and the reason: the
                // group is aborted here too, even if its `Abort` message was overtaken.
                if let quinn::ConnectionError::ApplicationClosed(c) = &e {
                    if c.error_code == VarInt::from_u32(CLOSE_ABORTED) {
                        shared.abort(&format!("rank {peer}: {}", String::from_utf8_lossy(&c.reason)));
                    }
                }
                shared.peer_gone(peer, format!("connection ended: {e}"));
                return;
            }
        }
    }
}

fn handle(shared: &Arc<Shared>, conn: &Connection, peer: usize, msg: (Control, Option<Payload>)) -> Result<(), String> {
    match msg {
        (Control::Data { key, .. }, Some(p)) => shared.deliver(peer, 0, key, Delivery::Data(p)),
        (Control::Desc { seq, desc }, _) => shared.deliver(peer, 0, Key::Desc { seq }, Delivery::Desc(desc)),
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
            shared.changed();
            Ok(())
        }
        (other, _) => Err(format!("unexpected {other:?} on an established connection")),
    }
}

/// Once every stream the leaving peer announced has been received (and read, for collective
/// payloads), confirms and marks it gone.
/// An aborted group acknowledges nothing: the peer's leave ends its wait on the abort.
async fn ack_bye(shared: Arc<Shared>, conn: Connection, peer: usize, streams: u64) {
    let give_up = Duration::from_millis(u64::from(IDLE_TIMEOUT_MS));
    let received = shared.until(|st| (st.streams_done[peer] >= streams || st.aborted.is_some()).then_some(()));
    let _ = tokio::time::timeout(give_up, received).await;
    if shared.lock().aborted.is_some() {
        shared.peer_gone(peer, "it left the aborted group".into());
        return;
    }
    // The peer closes the connection once acknowledged; nothing to do if that already happened.
    let _ = write_stream(&conn, &Control::ByeAck, &[]).await;
    shared.peer_gone(peer, "it left the group".into());
}

/// Dials every lower rank and accepts every higher one; returns each peer's connections, one per
/// lane (none for this rank). Lane `k` of every pair runs between the two ranks' endpoints `k`
/// (`endpoints.len()` is the number of lanes this rank asks for; endpoint 0 listens on the
/// rank's address).
///
/// A pair agrees on its lanes in the first connection's hellos: the dialer asks for its number,
/// the acceptor answers with the smaller of that and its own (1 when it is reached at another
/// address than its socket's, e.g. through a proxy: its other ports may not be reachable), and with the UDP ports of its
/// endpoints for the other lanes; the dialer then opens each remaining lane from its own
/// endpoint of that lane to that port, announced by a hello that names the lane and is checked
/// against the certificate like the first.
pub(crate) async fn build_mesh(
    endpoints: &[Endpoint],
    rank: usize,
    spec: &ClusterSpec,
    tls: &NodeTls,
    deadline: Instant,
) -> Result<Vec<Vec<Connection>>, QuicError> {
    let tls_err = |e: String| QuicError::Pki(PkiError::Tls(e));
    if endpoints.is_empty() || endpoints.len() > LANES_MAX {
        return Err(QuicError::Spec { rank, detail: format!("{} endpoints; expected 1 to {LANES_MAX}", endpoints.len()) });
    }
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls.client_config()?).map_err(|e| tls_err(e.to_string()))?;
    let mut client = quinn::ClientConfig::new(Arc::new(crypto));
    client.transport_config(Arc::new(transport_config()));
    let mut ports = Vec::with_capacity(endpoints.len() - 1);
    for e in &endpoints[1..] {
        ports.push(e.local_addr().map_err(|e| QuicError::Spec { rank, detail: format!("a lane's endpoint has no address: {e}") })?.port());
    }
    // A rank that others reach at another address than its socket's (`--advertise` behind a
    // wildcard bind, a proxy, NAT) offers one lane: its other endpoints' ports might not be
    // reachable that way.
    let direct = endpoints[0].local_addr().ok() == Some(spec.addrs[rank]);
    let offer = if direct { endpoints.len() } else { 1 };
    let (lower, higher) = tokio::join!(
        dial_lower(endpoints, rank, spec, &client, deadline),
        accept_higher(endpoints, rank, spec, deadline, &ports[..offer - 1])
    );
    let mut conns: Vec<Vec<Connection>> = vec![Vec::new(); spec.addrs.len()];
    for (peer, lanes) in lower?.into_iter().chain(higher?) {
        conns[peer] = lanes;
    }
    Ok(conns)
}

/// Dials one connection from `endpoint` to `peer` at `to` (retrying while it may not listen yet).
async fn dial(
    endpoint: &Endpoint,
    spec: &ClusterSpec,
    peer: usize,
    to: SocketAddr,
    client: &quinn::ClientConfig,
    deadline: Instant,
) -> Result<Connection, String> {
    loop {
        let connecting = endpoint.connect_with(client.clone(), to, &spec.names[peer]).map_err(|e| e.to_string())?;
        let attempt = (Instant::now() + Duration::from_millis(1_000)).min(deadline);
        match tokio::time::timeout_at(attempt.into(), connecting).await {
            Ok(Ok(conn)) => return Ok(conn),
            Ok(Err(e)) => return Err(e.to_string()),
            Err(_) if Instant::now() >= deadline => return Err("no answer before the deadline".into()),
            Err(_) => continue, // the peer may not be listening yet
        }
    }
}

async fn dial_lower(
    endpoints: &[Endpoint],
    rank: usize,
    spec: &ClusterSpec,
    client: &quinn::ClientConfig,
    deadline: Instant,
) -> Result<Vec<(usize, Vec<Connection>)>, QuicError> {
    let mut out = Vec::new();
    let world = spec.addrs.len() as u32;
    let want = endpoints.len();
    for peer in 0..rank {
        let err = |detail: String| QuicError::Connect { rank, peer, detail };
        let mut lanes: Vec<Connection> = Vec::new();
        let (mut agreed, mut ports) = (want, Vec::new());
        while lanes.len() < agreed {
            let lane = lanes.len();
            let to = match lane {
                0 => spec.addrs[peer],
                k => {
                    let mut to = spec.addrs[peer]; // keeps an IPv6 scope id
                    to.set_port(ports[k - 1]);
                    to
                }
            };
            let conn = dial(&endpoints[lane], spec, peer, to, client, deadline).await.map_err(|e| match lane {
                0 => err(e),
                // Lanes 1.. use ports the OS picked: a firewall may pass only the data port.
                _ => err(format!(
                    "lane {lane} of {agreed} at {to}: {e} (is that port reachable? TESSERA_QUIC_LANES=1 uses the data port alone)"
                )),
            })?;
            let asked = if lane == 0 { want } else { agreed };
            let hello = Control::Hello { rank: rank as u32, world, lane: lane as u32, lanes: asked as u32, ports: Vec::new() };
            // Bounded too: a peer that grants no stream would otherwise hold the connect forever.
            match tokio::time::timeout_at(deadline.into(), write_stream(&conn, &hello, &[])).await {
                Ok(r) => r.map_err(err)?,
                Err(_) => return Err(err("could not send the hello before the deadline".into())),
            }
            // The peer answers only after checking our certificate, rank and lane.
            let answer = tokio::time::timeout_at(deadline.into(), read_hello(&conn)).await;
            match answer {
                Ok(Ok(h)) if h.rank != peer => return Err(err(format!("it answered as rank {}", h.rank))),
                Ok(Ok(h)) if h.lane != lane || h.lanes == 0 || h.lanes > asked || (lane == 0 && h.ports.len() + 1 < h.lanes) => {
                    let detail =
                        format!("it answered lane {} of {} with {} ports to our lane {lane} of {asked}", h.lane, h.lanes, h.ports.len());
                    return Err(err(detail));
                }
                Ok(Ok(h)) if lane == 0 => (agreed, ports) = (h.lanes, h.ports),
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(err(e)),
                Err(_) => return Err(err("no hello before the deadline".into())),
            }
            lanes.push(conn);
        }
        out.push((peer, lanes));
    }
    Ok(out)
}

/// What a hello says.
struct Hello {
    rank: usize,
    world: usize,
    lane: usize,
    lanes: usize,
    ports: Vec<u16>,
}

async fn read_hello(conn: &Connection) -> Result<Hello, String> {
    let mut s = conn.accept_uni().await.map_err(|e| lost_why(conn, e))?;
    match read_message(&mut s).await.map_err(|e| lost_why(conn, e))? {
        (Control::Hello { rank, world, lane, lanes, ports }, _) => {
            Ok(Hello { rank: rank as usize, world: world as usize, lane: lane as usize, lanes: lanes as usize, ports })
        }
        (other, _) => Err(format!("expected a hello, got {other:?}")),
    }
}

/// The next incoming connection on any of `endpoints`, with the endpoint's index (its lane);
/// `None` once an endpoint is closed.
async fn accept_any(endpoints: &[Endpoint]) -> Option<(usize, quinn::Incoming)> {
    let mut accepts: Vec<_> = endpoints.iter().map(|e| Box::pin(e.accept())).collect();
    std::future::poll_fn(|cx| {
        for (lane, a) in accepts.iter_mut().enumerate() {
            if let Poll::Ready(incoming) = a.as_mut().poll(cx) {
                return Poll::Ready(incoming.map(|i| (lane, i)));
            }
        }
        Poll::Pending
    })
    .await
}

async fn accept_higher(
    endpoints: &[Endpoint],
    rank: usize,
    spec: &ClusterSpec,
    deadline: Instant,
    ports: &[u16],
) -> Result<Vec<(usize, Vec<Connection>)>, QuicError> {
    let world = spec.addrs.len();
    let start = Instant::now();
    // Each higher peer's lanes so far, and how many the pair agreed on.
    let mut have: HashMap<usize, (usize, Vec<Connection>)> = HashMap::new();
    let mut refusals = RefusalLog::new(format!("tessera-quic: rank {rank}: refused a peer"));
    let complete = |have: &HashMap<usize, (usize, Vec<Connection>)>, p: usize| have.get(&p).is_some_and(|(n, l)| l.len() == *n);
    while !(rank + 1..world).all(|p| complete(&have, p)) {
        let Ok(Some((lane, incoming))) = tokio::time::timeout_at(deadline.into(), accept_any(endpoints)).await else {
            let missing = (rank + 1..world).filter(|&p| !complete(&have, p)).collect();
            return Err(QuicError::Accept { rank, missing, waited_ms: start.elapsed().as_millis() as u64 });
        };
        let admitting = Admitting { rank, spec, have: &have, want: ports.len() + 1, lane, ports };
        match tokio::time::timeout_at(deadline.into(), admit(incoming, admitting)).await {
            Ok(Ok((peer, agreed, conn))) => have.entry(peer).or_insert_with(|| (agreed, Vec::new())).1.push(conn),
            Ok(Err(why)) => refusals.refused(&why.to_string()),
            Err(_) => refusals.refused("it did not finish connecting before the deadline"),
        }
    }
    Ok(have.into_iter().map(|(p, (_, lanes))| (p, lanes)).collect())
}

/// What [`admit`] checks an incoming connection against.
struct Admitting<'a> {
    rank: usize,
    spec: &'a ClusterSpec,
    /// Each higher peer's lanes so far, and how many the pair agreed on.
    have: &'a HashMap<usize, (usize, Vec<Connection>)>,
    /// Lanes this rank offers (its endpoints, or 1 when it is reached at another address).
    want: usize,
    /// The endpoint (lane) the connection arrived on.
    lane: usize,
    /// The UDP ports of this rank's endpoints 1..
    ports: &'a [u16],
}

/// Completes an incoming handshake (the TLS layer has already checked the CA signature) and
/// checks that the claimed rank is a higher one, named in the peer's certificate, and that the
/// connection is that peer's next lane, arrived on that lane's endpoint: lane 0 of a new peer
/// (the pair then uses the smaller of the lanes asked for and this rank's), or the next lane of
/// one already agreed. Returns the peer, the pair's lanes and the connection.
async fn admit(incoming: quinn::Incoming, a: Admitting<'_>) -> Result<(usize, usize, Connection), String> {
    let conn = incoming.await.map_err(|e| format!("handshake failed: {e}"))?;
    let refuse = |why: String| {
        conn.close(VarInt::from_u32(2), why.as_bytes());
        Err(why)
    };
    let h = match read_hello(&conn).await {
        Ok(h) => h,
        Err(e) => return refuse(format!("no hello: {e}")),
    };
    let (peer, world, rank) = (h.rank, h.world, a.rank);
    if world != a.spec.addrs.len() || peer <= rank || peer >= world {
        return refuse(format!("claims rank {peer} of {world}; expected a rank in {}..{}", rank + 1, a.spec.addrs.len()));
    }
    if h.lane != a.lane {
        return refuse(format!("rank {peer} opened lane {} on this rank's endpoint of lane {}", h.lane, a.lane));
    }
    let agreed = match a.have.get(&peer) {
        None if h.lane == 0 && h.lanes >= 1 => h.lanes.min(a.want),
        Some((n, lanes)) if h.lane == lanes.len() && h.lane < *n && h.lanes == *n => *n,
        None => return refuse(format!("rank {peer} opened lane {} of {} before lane 0", h.lane, h.lanes)),
        Some((n, lanes)) => {
            return refuse(format!("rank {peer} opened lane {} of {}; expected lane {} of {n}", h.lane, h.lanes, lanes.len()))
        }
    };
    let certs = conn.peer_identity().and_then(|id| id.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>().ok());
    let Some(cert) = certs.as_ref().and_then(|c| c.first()) else {
        return refuse("no client certificate".into());
    };
    if let Err(why) = check_cert_names_node(cert, &a.spec.names[peer]) {
        return refuse(format!("claims rank {peer}: {why}"));
    }
    let ports = match h.lane {
        0 => a.ports[..agreed - 1].to_vec(),
        _ => Vec::new(),
    };
    let hello = Control::Hello { rank: rank as u32, world: world as u32, lane: h.lane as u32, lanes: agreed as u32, ports };
    write_stream(&conn, &hello, &[]).await?;
    Ok((peer, agreed, conn))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oversized_gso_batches_are_cut_into_whole_datagrams_that_fit_one_sendmsg() {
        // Ten jumbo-frame datagrams (89 520 bytes): 7 + 3.
        let parts: Vec<_> = sendmsg_parts(10 * 8_952, 8_952).collect();
        assert_eq!(parts, vec![(0..7 * 8_952, Some(8_952)), (7 * 8_952..10 * 8_952, Some(8_952))]);
        // Loopback-sized datagrams go one per call, the short last one too.
        let parts: Vec<_> = sendmsg_parts(2 * 65_000 + 100, 65_000).collect();
        assert_eq!(parts, vec![(0..65_000, None), (65_000..130_000, None), (130_000..130_100, None)]);
        // A short last datagram stays in its batch; every part is within the limit.
        let parts: Vec<_> = sendmsg_parts(30 * 1_452 - 700, 1_452).collect();
        assert_eq!(parts.len(), 1 + (30 * 1_452 - 700) / (SENDMSG_BYTES_MAX / 1_452 * 1_452));
        assert!(parts.iter().all(|(r, _)| r.len() <= SENDMSG_BYTES_MAX && r.start % 1_452 == 0));
        assert_eq!(parts.last().map(|(r, _)| r.end), Some(30 * 1_452 - 700));
    }
}
