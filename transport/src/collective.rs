//! The collective-communication contract every backend implements (in-process, QUIC, NCCL):
//! the [`Collective`] trait, its errors, and the traffic accounting of the algorithms it models.
//!
//! # Determinism
//!
//! Every sum adds the ranks' contributions **in rank order, left to right** with f32 (or f64)
//! adds: `((c0 + c1) + c2) + …`, whatever order they arrive in. The bits are therefore a pure
//! function of the inputs *and of the world size*: the same gradients split over 2 or 4 ranks
//! are associated differently and may differ in the last bits. Reductions that must not depend
//! on the world size (gradients over micro-batches) use [`Collective::gather_slices`] instead:
//! each owner receives every rank's un-reduced contribution for its range, in rank order, and
//! combines them with [`crate::tree::TreeSum`] (each rank holding an aligned dyadic block of
//! micro-batches), which gives the same bits for any assignment of blocks to ranks.
//!
//! # Failure
//!
//! No operation waits forever: every wait is bounded by the handle's timeout
//! ([`DEFAULT_TIMEOUT_MS`] unless set). A timeout **aborts the group** (as a timed-out NCCL
//! communicator must be aborted): the late ranks and every later operation get
//! [`CollectiveError::Aborted`]; recovery builds a new group. [`AbortHandle::abort`] does the same
//! on purpose (the supervisor calls it when a member dies). Disagreement between ranks (different
//! lengths, ranges, roots or operations) is detected by every rank alike and reported as
//! [`CollectiveError::Mismatch`] without leaving the group out of step.
//!
//! # Traffic accounting ([`CommStats`])
//!
//! Counters are the bytes a network backend would move for the algorithm modelled, per rank,
//! whatever the backend really does (the in-process one moves nothing):
//! - `reduce_scatter_sum`: a ring in rank order; rank `r` sends every chunk but its own and
//!   receives every chunk but its predecessor's: `sent = total − |range r|`,
//!   `received = total − |range r−1|` elements. For equal ranges: `(N−1)/N × buffer`.
//! - `all_gather`: a ring; `sent = total − |range r+1|`, `received = total − |range r|`.
//! - `all_reduce_sum(_f64)`: ring reduce-scatter then ring all-gather over [`even_ranges`] of the
//!   buffer: about `2 (N−1)/N × buffer` each way.
//! - `gather_slices`: direct sends to each owner: `sent = total − |range r|`,
//!   `received = (N−1) × |range r|`.
//! - `broadcast`: a pipelined chain from the root in rank order (root, root+1, …): every rank but
//!   the last in the chain sends the buffer once, every rank but the root receives it once.
//! - `all_to_all`, `send`/`recv`: the payloads exchanged with other ranks.
//! - `barrier`: no bytes. Every successful operation adds one to `ops`; sends to oneself and
//!   the rank's own slices count no bytes. Elements are 4 bytes (f32) or 8 (f64).

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

/// The collective operations, with stable codes: backends that exchange call descriptors (QUIC,
/// NCCL) send `op as u64` and name a peer's call with [`CollectiveOp::name_of_code`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CollectiveOp {
    AllReduce = 0,
    AllReduceF64,
    ReduceScatter,
    AllGather,
    GatherSlices,
    Broadcast,
    AllToAll,
    Barrier,
}

impl CollectiveOp {
    pub const ALL: [CollectiveOp; 8] = [
        CollectiveOp::AllReduce,
        CollectiveOp::AllReduceF64,
        CollectiveOp::ReduceScatter,
        CollectiveOp::AllGather,
        CollectiveOp::GatherSlices,
        CollectiveOp::Broadcast,
        CollectiveOp::AllToAll,
        CollectiveOp::Barrier,
    ];

    /// The trait method's name, as errors report it.
    pub fn name(self) -> &'static str {
        match self {
            CollectiveOp::AllReduce => "all_reduce_sum",
            CollectiveOp::AllReduceF64 => "all_reduce_sum_f64",
            CollectiveOp::ReduceScatter => "reduce_scatter_sum",
            CollectiveOp::AllGather => "all_gather",
            CollectiveOp::GatherSlices => "gather_slices",
            CollectiveOp::Broadcast => "broadcast",
            CollectiveOp::AllToAll => "all_to_all",
            CollectiveOp::Barrier => "barrier",
        }
    }

    /// The name of the operation with code `c` (a peer's descriptor), or "an unknown operation".
    pub fn name_of_code(c: u64) -> &'static str {
        Self::ALL.get(c as usize).map_or("an unknown operation", |op| op.name())
    }
}

/// Default bound on any wait of a collective or `recv`, in milliseconds (5 minutes: long enough
/// for a peer writing a checkpoint, short enough that a hung job is noticed).
pub const DEFAULT_TIMEOUT_MS: u64 = 300_000;

/// Why a collective failed. Every rank of a failed collective gets an error (not always the
/// same variant: the rank that timed out gets `Timeout`, the others `Aborted`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CollectiveError {
    #[error("{op}: rank {rank} waited {waited_ms} ms for its peers and gave up; the group is aborted")]
    Timeout { op: &'static str, rank: usize, waited_ms: u64 },
    #[error("{op}: the group was aborted: {reason}")]
    Aborted { op: &'static str, reason: String },
    #[error("{op}: peer rank {peer} has left the group")]
    PeerGone { op: &'static str, peer: usize },
    #[error("{op}: ranks disagree: {detail}")]
    Mismatch { op: &'static str, detail: String },
    #[error("{op}: invalid argument: {detail}")]
    InvalidArgument { op: &'static str, detail: String },
}

/// A cloneable, thread-safe way to abort a whole group from outside its ranks' threads: every
/// rank waiting in (or later entering) an operation gets [`CollectiveError::Aborted`].
#[derive(Clone)]
pub struct AbortHandle {
    abort: Arc<dyn Fn(&str) + Send + Sync>,
}

impl AbortHandle {
    /// Wraps a backend's abort action (`reason` is reported to every waiter).
    pub fn new(abort: impl Fn(&str) + Send + Sync + 'static) -> Self {
        Self { abort: Arc::new(abort) }
    }

    /// Aborts the group; the first reason given wins.
    pub fn abort(&self, reason: &str) {
        (self.abort)(reason)
    }
}

impl fmt::Debug for AbortHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AbortHandle")
    }
}

/// Bytes one operation moves for one rank under the modelled algorithm.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traffic {
    pub bytes_sent: u64,
    pub bytes_received: u64,
}

/// Per-rank traffic counters since the handle was made (see the module doc for the accounting).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommStats {
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// Successful operations (collectives, sends, receives, barriers).
    pub ops: u64,
}

impl CommStats {
    /// Adds one successful operation and its traffic.
    pub fn record(&mut self, traffic: Traffic) {
        self.bytes_sent += traffic.bytes_sent;
        self.bytes_received += traffic.bytes_received;
        self.ops += 1;
    }

    /// The counts accumulated since `earlier` was taken (e.g. one training step).
    pub fn since(&self, earlier: &CommStats) -> CommStats {
        CommStats {
            bytes_sent: self.bytes_sent.saturating_sub(earlier.bytes_sent),
            bytes_received: self.bytes_received.saturating_sub(earlier.bytes_received),
            ops: self.ops.saturating_sub(earlier.ops),
        }
    }
}

/// Collective operations and tag-matched point-to-point messages among the `world` ranks of a
/// group; one handle per rank. Buffers are host memory. All collectives must be called by every
/// rank of the group in the same order (like MPI/NCCL); sums follow the module's determinism rule.
pub trait Collective: Send {
    /// This handle's rank, `0..world`.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn world(&self) -> usize;
    /// Bound on every wait of this handle, in milliseconds.
    fn timeout_ms(&self) -> u64;
    /// Sets the bound on every later wait of this handle.
    fn set_timeout_ms(&mut self, timeout_ms: u64);
    /// Traffic counters of this rank.
    fn stats(&self) -> CommStats;
    /// A handle that aborts the whole group from any thread.
    fn abort_handle(&self) -> AbortHandle;

    /// `buf ← Σ_r buf_r` (rank order), on every rank; all buffers have the same length.
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CollectiveError>;
    /// As [`Collective::all_reduce_sum`] in f64 (norm partials).
    fn all_reduce_sum_f64(&mut self, buf: &mut [f64]) -> Result<(), CollectiveError>;
    /// `out ← Σ_r input_r[ranges[rank]]` (rank order). `input` is the full buffer on every rank;
    /// `ranges` (the same on every rank) are contiguous, one per rank, and cover it.
    fn reduce_scatter_sum(&mut self, input: &[f32], ranges: &[Range<usize>], out: &mut [f32]) -> Result<(), CollectiveError>;
    /// `out[ranges[r]] ← shard_r` for every `r`: `shard` is this rank's `ranges[rank]` part and
    /// `out` the full buffer.
    fn all_gather(&mut self, shard: &[f32], ranges: &[Range<usize>], out: &mut [f32]) -> Result<(), CollectiveError>;
    /// Delivers to this rank, as owner of `ranges[rank]`, every rank's un-reduced
    /// `input_r[ranges[rank]]`: `visit(r, slice)` is called for `r = 0, 1, …, world−1` in order.
    /// Slices are borrowed only for the call (the in-process backend lends the peers' buffers
    /// themselves). This is the building block of world-size-independent reductions. `visit`
    /// must not block or call into the group: peers may be waiting for this rank to finish it.
    fn gather_slices_with(
        &mut self,
        input: &[f32],
        ranges: &[Range<usize>],
        visit: &mut dyn FnMut(usize, &[f32]),
    ) -> Result<(), CollectiveError>;
    /// [`Collective::gather_slices_with`] into caller-provided vectors (reused, no reallocation
    /// once large enough): `out[r]` ← rank `r`'s contribution; `out.len()` must be `world`.
    fn gather_slices(&mut self, input: &[f32], ranges: &[Range<usize>], out: &mut [Vec<f32>]) -> Result<(), CollectiveError> {
        let world = self.world();
        // Join the collective even when `out` is wrong so the peers are not left waiting.
        self.gather_slices_with(input, ranges, &mut |src, slice| {
            if let Some(dst) = out.get_mut(src) {
                dst.clear();
                dst.extend_from_slice(slice);
            }
        })?;
        if out.len() != world {
            let detail = format!("{} output vectors for a world of {world}", out.len());
            return Err(CollectiveError::InvalidArgument { op: "gather_slices", detail });
        }
        Ok(())
    }
    /// `buf ← buf_root` on every rank.
    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CollectiveError>;
    /// `send[j]` goes to rank `j` (any lengths); returns `recv` with `recv[j]` from rank `j`.
    fn all_to_all(&mut self, send: &[&[f32]]) -> Result<Vec<Vec<f32>>, CollectiveError>;
    /// Sends `data` to rank `to` under `tag`. It may return before the peer receives (the data is
    /// buffered); messages of one (sender, tag) arrive in the order sent.
    fn send(&mut self, to: usize, tag: u64, data: &[f32]) -> Result<(), CollectiveError>;
    /// Receives the oldest message from rank `from` under `tag`, waiting up to the timeout.
    fn recv(&mut self, from: usize, tag: u64) -> Result<Vec<f32>, CollectiveError>;
    /// Returns once every rank has entered the barrier.
    fn barrier(&mut self) -> Result<(), CollectiveError>;
}

/// Splits `0..len` into `parts` contiguous ranges whose sizes differ by at most one (the first
/// `len % parts` get the extra element). Empty for `parts == 0`.
pub fn even_ranges(len: usize, parts: usize) -> Vec<Range<usize>> {
    let mut out = Vec::with_capacity(parts);
    let mut lo = 0;
    for i in 0..parts {
        let hi = lo + len / parts + usize::from(i < len % parts);
        out.push(lo..hi);
        lo = hi;
    }
    out
}

/// Checks that `ranges` has one range per rank of `world`, contiguous from 0 to `total`.
pub fn check_ranges(op: &'static str, ranges: &[Range<usize>], world: usize, total: usize) -> Result<(), CollectiveError> {
    let bad = |detail: String| Err(CollectiveError::InvalidArgument { op, detail });
    if ranges.len() != world {
        return bad(format!("{} ranges for a world of {world}", ranges.len()));
    }
    let mut expect = 0;
    for (r, range) in ranges.iter().enumerate() {
        if range.start != expect || range.end < range.start {
            return bad(format!("range {r} is {range:?} but must start at {expect} (ranges are contiguous from 0)"));
        }
        expect = range.end;
    }
    if expect != total {
        return bad(format!("ranges cover 0..{expect} but the buffer has {total} elements"));
    }
    Ok(())
}

fn bytes(elems: usize, elem_bytes: u64) -> u64 {
    elems as u64 * elem_bytes
}

/// Ring reduce-scatter traffic of `rank` (see the module doc); `ranges` are valid.
pub fn ring_reduce_scatter_traffic(ranges: &[Range<usize>], rank: usize, elem_bytes: u64) -> Traffic {
    let n = ranges.len();
    if n <= 1 {
        return Traffic::default();
    }
    let total = ranges[n - 1].end;
    Traffic {
        bytes_sent: bytes(total - ranges[rank].len(), elem_bytes),
        bytes_received: bytes(total - ranges[(rank + n - 1) % n].len(), elem_bytes),
    }
}

/// Ring all-gather traffic of `rank` (see the module doc); `ranges` are valid.
pub fn ring_all_gather_traffic(ranges: &[Range<usize>], rank: usize, elem_bytes: u64) -> Traffic {
    let n = ranges.len();
    if n <= 1 {
        return Traffic::default();
    }
    let total = ranges[n - 1].end;
    Traffic {
        bytes_sent: bytes(total - ranges[(rank + 1) % n].len(), elem_bytes),
        bytes_received: bytes(total - ranges[rank].len(), elem_bytes),
    }
}

/// Ring all-reduce traffic of `rank` for a buffer of `len` elements in a group of `world`.
pub fn ring_all_reduce_traffic(len: usize, world: usize, rank: usize, elem_bytes: u64) -> Traffic {
    let ranges = even_ranges(len, world);
    let rs = ring_reduce_scatter_traffic(&ranges, rank, elem_bytes);
    let ag = ring_all_gather_traffic(&ranges, rank, elem_bytes);
    Traffic { bytes_sent: rs.bytes_sent + ag.bytes_sent, bytes_received: rs.bytes_received + ag.bytes_received }
}

/// Traffic of `rank` in `gather_slices` (direct sends to each owner); `ranges` are valid.
pub fn gather_slices_traffic(ranges: &[Range<usize>], rank: usize, elem_bytes: u64) -> Traffic {
    let n = ranges.len();
    let total = ranges.last().map_or(0, |r| r.end);
    let own = ranges[rank].len();
    Traffic { bytes_sent: bytes(total - own, elem_bytes), bytes_received: bytes(n.saturating_sub(1) * own, elem_bytes) }
}

/// Chain-broadcast traffic of `rank` for `len` elements from `root` in a group of `world`.
pub fn chain_broadcast_traffic(len: usize, world: usize, root: usize, rank: usize, elem_bytes: u64) -> Traffic {
    let pos = (rank + world - root) % world;
    let sends = world > 1 && pos + 1 < world;
    Traffic { bytes_sent: if sends { bytes(len, elem_bytes) } else { 0 }, bytes_received: if pos > 0 { bytes(len, elem_bytes) } else { 0 } }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_ranges_cover_and_balance() {
        for len in 0..20 {
            for parts in 1..7 {
                let r = even_ranges(len, parts);
                check_ranges("t", &r, parts, len).unwrap();
                let (min, max) = (r.iter().map(|x| x.len()).min().unwrap(), r.iter().map(|x| x.len()).max().unwrap());
                assert!(max - min <= 1, "len {len} parts {parts}: {r:?}");
            }
        }
        assert!(even_ranges(5, 0).is_empty());
    }

    #[test]
    fn bad_ranges_are_described() {
        let err = |r: &[Range<usize>], world, total| check_ranges("op", r, world, total).unwrap_err().to_string();
        assert!(err(&[0..2, 3..4], 2, 4).contains("range 1 is 3..4 but must start at 2"));
        assert!(err(&[0..2, 2..4], 3, 4).contains("2 ranges for a world of 3"));
        assert!(err(&[0..2, 2..3], 2, 4).contains("cover 0..3 but the buffer has 4"));
        #[allow(clippy::reversed_empty_ranges)]
        let backwards = [0..2, 2..1];
        assert!(err(&backwards, 2, 1).contains("range 1 is 2..1"));
    }

    #[test]
    fn ring_accounting_matches_theory_for_equal_ranges() {
        // 4 ranks, 400 f32: reduce-scatter and all-gather move 3/4 of the buffer each way.
        let r = even_ranges(400, 4);
        for rank in 0..4 {
            let want = Traffic { bytes_sent: 1200, bytes_received: 1200 };
            assert_eq!(ring_reduce_scatter_traffic(&r, rank, 4), want);
            assert_eq!(ring_all_gather_traffic(&r, rank, 4), want);
            assert_eq!(ring_all_reduce_traffic(400, 4, rank, 4), Traffic { bytes_sent: 2400, bytes_received: 2400 });
        }
        assert_eq!(ring_all_reduce_traffic(400, 1, 0, 8), Traffic::default());
    }

    #[test]
    fn ring_accounting_conserves_bytes_for_uneven_ranges() {
        let r = [0..1, 1..6, 6..6, 6..13];
        let sum = |f: &dyn Fn(usize) -> Traffic| (0..4).map(f).fold((0, 0), |a, t| (a.0 + t.bytes_sent, a.1 + t.bytes_received));
        assert_eq!(sum(&|k| ring_reduce_scatter_traffic(&r, k, 4)), (3 * 13 * 4, 3 * 13 * 4));
        assert_eq!(sum(&|k| ring_all_gather_traffic(&r, k, 4)), (3 * 13 * 4, 3 * 13 * 4));
        assert_eq!(sum(&|k| gather_slices_traffic(&r, k, 4)), (3 * 13 * 4, 3 * 13 * 4));
        assert_eq!(sum(&|k| chain_broadcast_traffic(10, 4, 2, k, 4)), (3 * 40, 3 * 40));
        // The last rank of the chain from root 2 is rank 1: it only receives.
        assert_eq!(chain_broadcast_traffic(10, 4, 2, 1, 4), Traffic { bytes_sent: 0, bytes_received: 40 });
        assert_eq!(chain_broadcast_traffic(10, 4, 2, 2, 4), Traffic { bytes_sent: 40, bytes_received: 0 });
    }

    #[test]
    fn stats_since_subtracts() {
        let mut s = CommStats::default();
        s.record(Traffic { bytes_sent: 10, bytes_received: 3 });
        let before = s;
        s.record(Traffic { bytes_sent: 5, bytes_received: 7 });
        assert_eq!(s.since(&before), CommStats { bytes_sent: 5, bytes_received: 7, ops: 1 });
    }
}
