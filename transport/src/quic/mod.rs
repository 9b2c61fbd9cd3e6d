//! The QUIC backend: ranks in different processes or hosts exchange tensors over QUIC (quinn)
//! with mutual TLS (rustls; its aws-lc-rs crypto by default, ring with `TESSERA_TLS_PROVIDER=ring`) against a cluster CA, implementing [`Collective`](crate::collective::Collective).
//!
//! # Pieces
//! - [`pki`]: [`cluster_init`] writes the cluster CA and one certificate per node name;
//!   [`NodeTls`] loads a node's identity and builds rustls configs that *require* a client
//!   certificate signed by the cluster CA (a foreign CA's certificate fails the handshake).
//! - [`frame`]: one message per unidirectional stream; an rkyv control header checked with
//!   bytecheck, then raw f32/f64 bytes in chunks with a CRC32C each, read into place. Limits are named
//!   ([`frame::FRAME_BYTES_MAX`], [`frame::CHUNK_BYTES_MAX`], [`frame::MESSAGE_BYTES_MAX`]); a
//!   malformed, oversized or checksum-failing frame closes that peer's connection with a logged
//!   reason (stderr) and the peer is reported as gone — never a panic.
//! - [`lend`]: how a step hands quinn its payload without copying it — views of the caller's
//!   tensor that the step takes back (acknowledged by the peer, or discarded by resetting the
//!   stream) before it returns.
//! - [`crc`]: the chunks' CRC32C — carry-less-multiplication folding on CPUs with 512-bit
//!   `VPCLMULQDQ`, else the `crc32c` crate; the same checksum either way.
//! - [`control`]: the control plane's connections ([`ControlEndpoint`], [`ControlConn`]): one per
//!   driver ↔ worker pair, ordered frame lanes (requests; actor messages) and bulk transfers on
//!   their own streams, with [`pki::JoinToken`] admission for agents without a certificate.
//! - [`QuicComm`]: rank `r` listens on `addrs[r]`, dials every lower rank and accepts every
//!   higher one. The dialer sends `Hello{rank}`; the acceptor checks
//!   that the client certificate (already verified against the CA) is issued to
//!   `names[rank]`, then answers; the dialer's TLS checks the acceptor's name by SNI. A pair may
//!   use several connections, *lanes* ([`net::lanes_wanted`]: several for a rank on a loopback
//!   address, one otherwise unless `TESSERA_QUIC_LANES` says so; always one for a rank reached at
//!   another address than its socket's): the lane-0
//!   hellos agree on their number and the acceptor announces the UDP ports of its other lanes'
//!   endpoints (one socket and endpoint driver per lane), each further lane opened and checked
//!   like the first. A QUIC connection is packetised, sealed and opened by one driver task, so
//!   one connection moves what one core can; lanes spread that over cores (see
//!   [`net::lanes_default`] for the measurements).
//!
//! # Runtime
//! The trait is synchronous. Each `QuicComm` owns a multi-thread tokio runtime
//! ([`net::runtime_workers`]: one worker thread on hosts with fewer than 4 cores, else as many
//! as the lanes asked for (at least 2), at most half the cores; `TESSERA_QUIC_WORKERS` overrides it) that
//! drives the endpoints, one reader task per connection and one task per incoming stream. A
//! reader task reads each stream's header; it files a collective's payload as the open stream, and
//! every other message (descriptors, point-to-point data, control) whole, in an inbox keyed by
//! (sender, lane, key). The caller's thread runs each step of an algorithm — its sends and its
//! receives together — as one future with `Runtime::block_on`, so a rank always reads while it
//! writes (no deadlock whatever the message sizes), and it reads a collective's payload from
//! quinn's packet buffers straight into the destination tensor (or, when reducing, adds it in
//! from those buffers). With several lanes, a payload is cut into contiguous stripes of at
//! least [`comm::STRIPE_BYTES_MIN`], as many as the receiver's declared lanes allow
//! ([`comm::stripe_count`]; a rank declares the fewest lanes it has with any peer, so one peer
//! with a single lane gives that rank single stripes), and each lane's sends and receives run on a thread of
//! their own (lane 0 on the caller's, the others on scoped threads); the first lane to fail
//! cancels the others. Each lane sums its own stripe over the ranks in rank order, so the bits
//! are those of one lane. Waiting on the inbox is a `Notify`, not a
//! blocked thread. Every wait is bounded by the handle's `timeout_ms`; a timeout aborts the
//! group and tells the peers (an `Abort` message), as does
//! [`AbortHandle::abort`](crate::collective::AbortHandle::abort), which also ends any step in
//! progress — its sends too: a send that QUIC flow control holds back (a peer that stopped
//! reading) returns `Aborted` at once. Leaving an aborted group waits for no goodbye (the
//! connections close with [`net::CLOSE_ABORTED`] and the abort's reason, which aborts the
//! peers' groups too), and an abort during a graceful leave ends its waits.
//!
//! # Algorithms and accounting
//! Every collective opens with a descriptor round (each rank sends its operation, lengths and
//! ranges to every peer) so that all ranks judge disagreement on the same data and report
//! `Mismatch` alike; this round is the barrier. Then:
//! - all-gather: a ring (step `s`: forward part `r−s` to `r+1` while part `r−s−1` arrives from
//!   `r−1`); bytes exactly as modelled. Step 0 sends from the caller's shard, and the lanes copy
//!   the shard into the output while that step's transfers run, not before them. A part goes on
//!   to `r+1` with the checksums its chunks arrived with (where the stripes are cut alike).
//!
//! What the all-gather, reduce-scatter and all-reduce send is lent to quinn ([`lend`]), not
//! copied; the last chunk of each stream is a copy, so that the peer acknowledges the lent ones
//! at once (QUIC acknowledges every second packet at once, an odd last one only after its
//! delayed-ACK wait). Point-to-point messages, gather_slices, all_to_all, the broadcast's pieces
//! and control messages are copied.
//! - reduce-scatter: every rank sends each owner its slice directly and the owner sums in rank
//!   order. A summing ring cannot honour the rank-order determinism rule (the chain for part
//!   `k` would start at rank `k+1`), and the direct exchange sends exactly the ring's bytes
//!   (`total − |range r|`) and receives them too when ranges are equal.
//! - all-reduce: that reduce-scatter over [`even_ranges`](crate::collective::even_ranges), summed
//!   onto the rank's own slice in place (nothing copied aside first; a rank `r ≥ 2` sums the
//!   lower ranks' slices in a reused buffer, then adds its own), then the ring all-gather. gather_slices: direct sends, visited in rank order whatever the
//!   arrival order. broadcast: a chain from the root, pipelined in 4 MiB pieces.
//!   all_to_all, send/recv: direct; point-to-point messages carry a per-(sender, tag) number so
//!   they are received in the order sent although each travels on its own stream.
//!
//! Stats follow [`crate::collective`]'s model exactly (the same functions as the in-process
//! backend). Leaving (drop) announces how many streams were sent to each peer and waits for
//! each to confirm it has received (and, for collective payloads, read) them all, so buffered
//! sends are never lost.
//!
//! # Transport tuning (bulk tensors)
//! The settings and the reason for each are documented on [`net::transport_config`]: 64 KiB
//! packets where the path allows (path-MTU discovery up to 65 507 bytes, with
//! [`net::GsoSplit`] cutting segmentation-offload batches that a single `sendmsg` cannot carry),
//! 16 MiB stream / 64 MiB connection windows, one stream per message, Cubic with a 1 MiB
//! initial window, keep-alive every 2 s and a 15 s idle timeout (how a silent dead peer is
//! noticed). [`net::tune_allocator`] keeps glibc from trimming and re-faulting the heap that
//! quinn's per-packet buffers and a step's transient buffers cycle through. Measurements: `docs/PERFORMANCE.md`, section
//! "QUIC collectives between processes".
//!
//! Hosts must be little-endian (payloads are the in-memory bytes).

pub mod comm;
pub mod control;
pub mod crc;
pub mod frame;
pub mod lend;
pub mod net;
pub mod pki;
pub mod refusals;

pub use comm::QuicComm;
pub use control::{ControlConn, ControlEndpoint, ControlError};
pub use net::{transport_config, ClusterSpec, QuicError};
pub use pki::{cluster_init, ClientAuth, ClusterCa, ClusterFiles, JoinToken, NodeKey, NodeTls, PkiError, ALPN_CONTROL};
pub use refusals::{RefusalLog, REFUSAL_LOG_INTERVAL_MS};
/// The TLS library the configs of this module belong to.
pub use rustls;

#[cfg(test)]
mod tests;
