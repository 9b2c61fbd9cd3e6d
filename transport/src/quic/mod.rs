//! The QUIC backend: ranks in different processes or hosts exchange tensors over QUIC (quinn)
//! with mutual TLS (rustls, ring) against a cluster CA, implementing [`Collective`].
//!
//! # Pieces
//! - [`pki`]: [`cluster_init`] writes the cluster CA and one certificate per node name;
//!   [`NodeTls`] loads a node's identity and builds rustls configs that *require* a client
//!   certificate signed by the cluster CA (a foreign CA's certificate fails the handshake).
//! - [`frame`]: one message per unidirectional stream; an rkyv control header checked with
//!   bytecheck, then raw f32/f64 bytes in chunks with a CRC32C each. Limits are named
//!   ([`frame::FRAME_BYTES_MAX`], [`frame::CHUNK_BYTES_MAX`], [`frame::MESSAGE_BYTES_MAX`]); a
//!   malformed, oversized or checksum-failing frame closes that peer's connection with a logged
//!   reason (stderr) and the peer is reported as gone — never a panic.
//! - [`QuicComm`]: rank `r` listens on `addrs[r]`, dials every lower rank and accepts every
//!   higher one (one connection per pair). The dialer sends `Hello{rank}`; the acceptor checks
//!   that the client certificate (already verified against the CA) is issued to
//!   `names[rank]`, then answers; the dialer's TLS checks the acceptor's name by SNI.
//!
//! # Runtime
//! The trait is synchronous. Each `QuicComm` owns a multi-thread tokio runtime with two worker
//! threads that drive the endpoint, one reader task per peer and one task per incoming stream;
//! readers file complete messages into an inbox (mutex + condvar) keyed by (sender, key). The
//! caller's thread sends with `Runtime::block_on` (returning once QUIC has the bytes) and
//! receives by waiting on the condvar. Every wait is bounded by the handle's `timeout_ms`; a
//! timeout aborts the group and tells the peers (an `Abort` message), as does
//! [`AbortHandle::abort`](crate::collective::AbortHandle::abort).
//!
//! # Algorithms and accounting
//! Every collective opens with a descriptor round (each rank sends its operation, lengths and
//! ranges to every peer) so that all ranks judge disagreement on the same data and report
//! `Mismatch` alike; this round is the barrier. Then:
//! - all-gather: a ring (step `s`: forward part `r−s` to `r+1`); bytes exactly as modelled.
//! - reduce-scatter: every rank sends each owner its slice directly and the owner sums in rank
//!   order. A summing ring cannot honour the rank-order determinism rule (the chain for part
//!   `k` would start at rank `k+1`), and the direct exchange sends exactly the ring's bytes
//!   (`total − |range r|`) and receives them too when ranges are equal.
//! - all-reduce: that reduce-scatter over [`even_ranges`](crate::collective::even_ranges), then
//!   the ring all-gather. gather_slices: direct sends, visited in rank order whatever the
//!   arrival order. broadcast: a chain from the root, pipelined in 4 MiB pieces.
//!   all_to_all, send/recv: direct; point-to-point messages carry a per-(sender, tag) number so
//!   they are received in the order sent although each travels on its own stream.
//!
//! Stats follow [`crate::collective`]'s model exactly (the same functions as the in-process
//! backend). Leaving (drop) announces how many streams were sent to each peer and waits for
//! each to confirm it filed them, so buffered sends are never lost.
//!
//! # Transport tuning (bulk tensors on a LAN)
//! - Stream receive window 16 MiB, connection window and send buffer 64 MiB: one large tensor
//!   streams at full rate up to ~10 Gb/s × 10 ms RTT without waiting for window updates, and a
//!   ring step plus point-to-point traffic fit at once. Memory is bounded by these per peer.
//! - 1024 concurrent unidirectional streams (one per message in flight), no bidirectional.
//! - Congestion control: Cubic with a 1 MiB initial window. Cubic is quinn's mature default and
//!   fills a low-loss datacenter link quickly; quinn's BBR is marked experimental, and our
//!   traffic is not latency-sensitive enough to need BBR's queue control.
//! - MTU discovery up to 8952 bytes (jumbo frames where the path allows, 1452 otherwise),
//!   keep-alive every 2 s and a 15 s idle timeout, which is how a silent dead peer is noticed.
//!
//! Hosts must be little-endian (payloads are the in-memory bytes).

pub mod comm;
pub mod frame;
pub mod net;
pub mod pki;

pub use comm::QuicComm;
pub use net::{transport_config, ClusterSpec, QuicError};
pub use pki::{cluster_init, ClusterFiles, NodeTls, PkiError};

#[cfg(test)]
mod tests;
