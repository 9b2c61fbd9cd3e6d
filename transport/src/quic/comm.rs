//! [`QuicComm`]: one rank's [`Collective`] handle over QUIC — operation descriptors, the
//! algorithms, timeouts, abort and the graceful leave.

use super::frame::{Control, Key, OpDesc, Payload, ELEM_F32, ELEM_F64};
use super::net::{broadcast_abort, build_mesh, serve_peer, transport_config, write_stream, ClusterSpec, Delivery, QuicError, Shared};
use super::pki::NodeTls;
use crate::collective::CollectiveOp as Op;
use crate::collective::{
    chain_broadcast_traffic, check_ranges, even_ranges, gather_slices_traffic, ring_all_gather_traffic, ring_all_reduce_traffic,
    ring_reduce_scatter_traffic, AbortHandle, Collective, CollectiveError, CommStats, Traffic, DEFAULT_TIMEOUT_MS,
};
use quinn::{Connection, Endpoint, VarInt};
use std::collections::HashMap;
use std::ops::{AddAssign, Range};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Elements per broadcast piece (4 MiB of f32): the chain forwards piece k while piece k+1 arrives.
const PIECE_ELEMS: usize = 1 << 20;

/// An element type carried in payloads and summed in rank order.
trait Elem: bytemuck::Pod + AddAssign {
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

fn ends_of(ranges: &[Range<usize>]) -> Vec<u64> {
    ranges.iter().map(|r| r.end as u64).collect()
}

/// One collective in progress: its number, operation and deadline.
#[derive(Clone, Copy)]
struct Call {
    seq: u64,
    op: Op,
    start: Instant,
    deadline: Instant,
}

/// One rank's handle on a QUIC group. Owns a tokio runtime (two worker threads) that drives the
/// endpoint and one reader task per peer; the synchronous trait methods block the caller on
/// that runtime (`block_on` for sends) and on the inbox's condition variable (for receives).
/// Dropping it leaves the group gracefully: each peer confirms it has every message sent.
pub struct QuicComm {
    rank: usize,
    world: usize,
    timeout_ms: u64,
    stats: CommStats,
    seq: u64,
    p2p_sent: HashMap<(usize, u64), u64>,
    p2p_next: HashMap<(usize, u64), u64>,
    streams_sent: Vec<u64>,
    shared: Arc<Shared>,
    conns: Vec<Option<Connection>>,
    endpoint: Endpoint,
    scratch_f32: Vec<f32>,
    scratch_f64: Vec<f64>,
    rt: tokio::runtime::Runtime,
}

impl std::fmt::Debug for QuicComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuicComm").field("rank", &self.rank).field("world", &self.world).finish()
    }
}

impl QuicComm {
    /// Binds `spec.addrs[rank]` and connects to every peer (see [`QuicComm::connect_socket`]).
    pub fn connect(rank: usize, spec: &ClusterSpec, tls: &NodeTls, connect_timeout_ms: u64) -> Result<Self, QuicError> {
        let addr = *spec.addrs.get(rank).ok_or_else(|| QuicError::Spec { rank, detail: format!("{} addresses", spec.addrs.len()) })?;
        let socket = std::net::UdpSocket::bind(addr).map_err(|e| QuicError::Endpoint { rank, addr, detail: e.to_string() })?;
        Self::connect_socket(socket, rank, spec, tls, connect_timeout_ms)
    }

    /// Serves on an already bound `socket` and connects with mutual TLS to every peer: rank `r`
    /// dials the ranks below it and accepts those above, each proving its rank with a
    /// certificate for `spec.names[rank]` signed by the cluster CA. Waits ≤ `connect_timeout_ms`.
    pub fn connect_socket(
        socket: std::net::UdpSocket,
        rank: usize,
        spec: &ClusterSpec,
        tls: &NodeTls,
        connect_timeout_ms: u64,
    ) -> Result<Self, QuicError> {
        let world = spec.addrs.len();
        if spec.names.len() != world || rank >= world {
            let detail = format!("{} addresses, {} names, rank {rank}", world, spec.names.len());
            return Err(QuicError::Spec { rank, detail });
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
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
        super::net::size_socket_buffers(&socket);
        let (endpoint, conns) = rt.block_on(async {
            let runtime = Arc::new(quinn::TokioRuntime);
            let endpoint =
                Endpoint::new(quinn::EndpointConfig::default(), Some(server), socket, runtime).map_err(|e| endpoint_err(e.to_string()))?;
            let conns = build_mesh(&endpoint, rank, spec, tls, deadline).await?;
            Ok::<_, QuicError>((endpoint, conns))
        })?;
        let shared = Arc::new(Shared::new(rank, world));
        for (peer, conn) in conns.iter().enumerate() {
            if let Some(conn) = conn {
                rt.spawn(serve_peer(shared.clone(), conn.clone(), peer));
            }
        }
        Ok(QuicComm {
            rank,
            world,
            timeout_ms: DEFAULT_TIMEOUT_MS,
            stats: CommStats::default(),
            seq: 0,
            p2p_sent: HashMap::new(),
            p2p_next: HashMap::new(),
            streams_sent: vec![0; world],
            shared,
            conns,
            endpoint,
            scratch_f32: Vec::new(),
            scratch_f64: Vec::new(),
            rt,
        })
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

    /// Sends one message to `to`, waiting until it is handed to QUIC (bounded by `deadline`).
    fn send_msg(
        &mut self,
        to: usize,
        control: &Control,
        payload: &[u8],
        op: &'static str,
        start: Instant,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        self.aborted(op)?;
        let conn = match (&self.conns[to], self.shared.lock().gone[to].is_some()) {
            (Some(conn), false) => conn.clone(),
            _ => return Err(CollectiveError::PeerGone { op, peer: to }),
        };
        match self.block_until(deadline, write_stream(&conn, control, payload)) {
            Ok(Ok(())) => {
                self.streams_sent[to] += 1;
                Ok(())
            }
            Ok(Err(_)) => self.aborted(op).and(Err(CollectiveError::PeerGone { op, peer: to })),
            Err(_) => Err(self.time_out(op, start)),
        }
    }

    fn send_data<T: Elem>(
        &mut self,
        to: usize,
        key: Key,
        data: &[T],
        op: &'static str,
        start: Instant,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        let control = Control::Data { key, elem: T::ELEM, elems: data.len() as u64 };
        self.send_msg(to, &control, bytemuck::cast_slice(data), op, start, deadline)
    }

    /// Waits for the message `key` from `from`.
    fn wait(&self, from: usize, key: Key, op: &'static str, start: Instant, deadline: Instant) -> Result<Delivery, CollectiveError> {
        let mut st = self.shared.lock();
        loop {
            if let Some(reason) = &st.aborted {
                return Err(CollectiveError::Aborted { op, reason: reason.clone() });
            }
            if let Some(d) = st.msgs.remove(&(from, key)) {
                return Ok(d);
            }
            if st.gone[from].is_some() {
                return Err(CollectiveError::PeerGone { op, peer: from });
            }
            let now = Instant::now();
            if now >= deadline {
                drop(st);
                return Err(self.time_out(op, start));
            }
            st = self.shared.cv.wait_timeout(st, deadline - now).unwrap_or_else(std::sync::PoisonError::into_inner).0;
        }
    }

    fn recv_data<T: Elem>(
        &self,
        from: usize,
        key: Key,
        want: Option<usize>,
        op: &'static str,
        start: Instant,
        deadline: Instant,
    ) -> Result<Vec<T>, CollectiveError> {
        let bad = |detail: String| Err(CollectiveError::Mismatch { op, detail });
        let v = match self.wait(from, key, op, start, deadline)? {
            Delivery::Data(p) => T::take(p),
            Delivery::Desc(_) => None,
        };
        match (v, want) {
            (None, _) => bad(format!("rank {from} sent the wrong kind of message for {key:?}")),
            (Some(v), Some(n)) if v.len() != n => bad(format!("rank {from} sent {} elements where {n} were expected", v.len())),
            (Some(v), _) => Ok(v),
        }
    }

    /// Opens collective `op`: every rank sends its descriptor to every peer and receives all
    /// of theirs, so all ranks judge agreement on the same data (this round is also the barrier).
    fn enter(&mut self, op: Op, desc: OpDesc) -> Result<(Call, Vec<OpDesc>), CollectiveError> {
        self.aborted(op.name())?;
        let start = Instant::now();
        let call = Call { seq: self.seq, op, start, deadline: start + Duration::from_millis(self.timeout_ms) };
        self.seq += 1;
        let control = Control::Desc { seq: call.seq, desc: desc.clone() };
        for s in 1..self.world {
            let to = (self.rank + s) % self.world;
            self.send_msg(to, &control, &[], op.name(), start, call.deadline)?;
        }
        let mut all = Vec::with_capacity(self.world);
        for from in 0..self.world {
            if from == self.rank {
                all.push(desc.clone());
                continue;
            }
            match self.wait(from, Key::Desc { seq: call.seq }, op.name(), start, call.deadline)? {
                Delivery::Desc(d) => all.push(d),
                Delivery::Data(_) => return Err(mismatch(op, format!("rank {from} sent data instead of a descriptor"))),
            }
        }
        if let Some(r) = all.iter().position(|d| d.op != all[0].op) {
            let detail = format!(
                "rank {r} called {} but rank 0 called {}",
                Op::name_of_code(u64::from(all[r].op)),
                Op::name_of_code(u64::from(all[0].op))
            );
            return Err(mismatch(op, detail));
        }
        Ok((call, all))
    }

    /// `out ← Σ_q input_q[ranges[rank]]` in rank order: every rank sends each owner its slice
    /// directly (see the module doc for why this is not a summing ring).
    fn reduce_to_owner<T: Elem>(
        &mut self,
        call: Call,
        step: u32,
        input: &[T],
        ranges: &[Range<usize>],
        out: &mut [T],
    ) -> Result<(), CollectiveError> {
        let op = call.op.name();
        for s in 1..self.world {
            let to = (self.rank + s) % self.world;
            self.send_data(to, Key::Coll { seq: call.seq, step }, &input[ranges[to].clone()], op, call.start, call.deadline)?;
        }
        let mine = ranges[self.rank].clone();
        for from in 0..self.world {
            let theirs;
            let slice = if from == self.rank {
                &input[mine.clone()]
            } else {
                theirs = self.recv_data::<T>(from, Key::Coll { seq: call.seq, step }, Some(mine.len()), op, call.start, call.deadline)?;
                &theirs[..]
            };
            match from {
                0 => out.copy_from_slice(slice),
                _ => add_into(out, slice),
            }
        }
        Ok(())
    }

    /// Ring all-gather in place: `out[ranges[rank]]` holds this rank's part; at step `s` it
    /// forwards part `rank − s` to `rank + 1` and receives part `rank − s − 1` from `rank − 1`.
    fn ring_gather<T: Elem>(&mut self, call: Call, step0: u32, ranges: &[Range<usize>], out: &mut [T]) -> Result<(), CollectiveError> {
        let (n, op) = (self.world, call.op.name());
        let (next, prev) = ((self.rank + 1) % n, (self.rank + n - 1) % n);
        for s in 0..n.saturating_sub(1) {
            let key = Key::Coll { seq: call.seq, step: step0 + s as u32 };
            let (send_part, recv_part) = ((self.rank + n - s) % n, (self.rank + 2 * n - s - 1) % n);
            self.send_data(next, key, &out[ranges[send_part].clone()], op, call.start, call.deadline)?;
            let part = ranges[recv_part].clone();
            let v = self.recv_data::<T>(prev, key, Some(part.len()), op, call.start, call.deadline)?;
            out[part].copy_from_slice(&v);
        }
        Ok(())
    }

    fn all_reduce_generic<T: Elem>(&mut self, buf: &mut [T], op: Op, scratch: &mut Vec<T>) -> Result<(), CollectiveError> {
        let (call, descs) = self.enter(op, OpDesc { op: op as u8, lens: vec![buf.len() as u64], ends: vec![] })?;
        same(op, &descs, "a buffer of length", |d| d.lens.first().copied())?;
        let ranges = even_ranges(buf.len(), self.world);
        let mine = ranges[self.rank].clone();
        scratch.clear();
        scratch.resize(mine.len(), T::zeroed());
        self.reduce_to_owner(call, 0, buf, &ranges, scratch)?;
        buf[mine].copy_from_slice(scratch);
        self.ring_gather(call, 1, &ranges, buf)?;
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
    /// confirm it has them all, then closes the connections.
    fn leave(&mut self) {
        let deadline = Instant::now() + Duration::from_millis(self.timeout_ms.min(10_000));
        for (peer, conn) in self.conns.iter().enumerate() {
            if let Some(conn) = conn {
                let bye = Control::Bye { streams: self.streams_sent[peer] };
                let _ = self.block_until(deadline, write_stream(conn, &bye, &[]));
            }
        }
        let mut st = self.shared.lock();
        while (0..self.world).any(|p| self.conns[p].is_some() && !st.bye_acked[p] && st.gone[p].is_none()) && Instant::now() < deadline {
            let wait = deadline.saturating_duration_since(Instant::now());
            st = self.shared.cv.wait_timeout(st, wait).unwrap_or_else(std::sync::PoisonError::into_inner).0;
        }
        drop(st);
        let _context = self.rt.enter();
        for conn in self.conns.iter().flatten() {
            conn.close(VarInt::from_u32(0), b"bye");
        }
        let endpoint = self.endpoint.clone();
        let _ = self.block_until(Instant::now() + Duration::from_millis(500), async move { endpoint.wait_idle().await });
        self.conns.clear();
    }

    /// Runs `f` on the runtime from the caller's thread; `Err` when `deadline` passes first.
    fn block_until<F: std::future::Future>(&self, deadline: Instant, f: F) -> Result<F::Output, tokio::time::error::Elapsed> {
        self.rt.block_on(async move { tokio::time::timeout_at(deadline.into(), f).await })
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
        let desc = OpDesc { op: op as u8, lens: vec![input.len() as u64, out.len() as u64], ends: ends_of(ranges) };
        let (call, descs) = self.enter(op, desc)?;
        self.check_ranged(op, &descs, "an input of length", ranges, input.len())?;
        if let Some(r) = (0..self.world).find(|&r| descs[r].lens.get(1) != Some(&(ranges[r].len() as u64))) {
            return Err(mismatch(op, format!("rank {r} passed an output of {:?} for {} elements", descs[r].lens.get(1), ranges[r].len())));
        }
        self.reduce_to_owner(call, 0, input, ranges, out)?;
        self.stats.record(ring_reduce_scatter_traffic(ranges, self.rank, 4));
        Ok(())
    }

    fn all_gather(&mut self, shard: &[f32], ranges: &[Range<usize>], out: &mut [f32]) -> Result<(), CollectiveError> {
        let op = Op::AllGather;
        let desc = OpDesc { op: op as u8, lens: vec![out.len() as u64, shard.len() as u64], ends: ends_of(ranges) };
        let (call, descs) = self.enter(op, desc)?;
        self.check_ranged(op, &descs, "an output of length", ranges, out.len())?;
        if let Some(r) = (0..self.world).find(|&r| descs[r].lens.get(1) != Some(&(ranges[r].len() as u64))) {
            return Err(mismatch(op, format!("rank {r} passed a shard of {:?} for range {:?}", descs[r].lens.get(1), ranges[r])));
        }
        out[ranges[self.rank].clone()].copy_from_slice(shard);
        self.ring_gather(call, 0, ranges, out)?;
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
        let (call, descs) = self.enter(op, OpDesc { op: op as u8, lens: vec![input.len() as u64], ends: ends_of(ranges) })?;
        self.check_ranged(op, &descs, "an input of length", ranges, input.len())?;
        for s in 1..self.world {
            let to = (self.rank + s) % self.world;
            self.send_data(to, Key::Coll { seq: call.seq, step: 0 }, &input[ranges[to].clone()], op.name(), call.start, call.deadline)?;
        }
        let mine = ranges[self.rank].clone();
        // Received in rank order whatever the arrival order: the inbox holds early arrivals.
        for from in 0..self.world {
            if from == self.rank {
                visit(from, &input[mine.clone()]);
            } else {
                let v = self.recv_data::<f32>(
                    from,
                    Key::Coll { seq: call.seq, step: 0 },
                    Some(mine.len()),
                    op.name(),
                    call.start,
                    call.deadline,
                )?;
                visit(from, &v);
            }
        }
        self.stats.record(gather_slices_traffic(ranges, self.rank, 4));
        Ok(())
    }

    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CollectiveError> {
        let op = Op::Broadcast;
        let (call, descs) = self.enter(op, OpDesc { op: op as u8, lens: vec![buf.len() as u64, root as u64], ends: vec![] })?;
        same(op, &descs, "root", |d| d.lens.get(1).copied())?;
        same(op, &descs, "a buffer of length", |d| d.lens.first().copied())?;
        self.check_rank(op.name(), "root", root)?;
        let n = self.world;
        let pos = (self.rank + n - root) % n;
        let (next, prev) = ((self.rank + 1) % n, (self.rank + n - 1) % n);
        for (k, lo) in (0..buf.len()).step_by(PIECE_ELEMS).enumerate() {
            let piece = lo..(lo + PIECE_ELEMS).min(buf.len());
            let key = Key::Coll { seq: call.seq, step: k as u32 };
            if pos > 0 {
                let v = self.recv_data::<f32>(prev, key, Some(piece.len()), op.name(), call.start, call.deadline)?;
                buf[piece.clone()].copy_from_slice(&v);
            }
            if pos + 1 < n {
                self.send_data(next, key, &buf[piece], op.name(), call.start, call.deadline)?;
            }
        }
        self.stats.record(chain_broadcast_traffic(buf.len(), n, root, self.rank, 4));
        Ok(())
    }

    fn all_to_all(&mut self, send: &[&[f32]]) -> Result<Vec<Vec<f32>>, CollectiveError> {
        let op = Op::AllToAll;
        let (call, descs) = self.enter(op, OpDesc { op: op as u8, lens: vec![send.len() as u64], ends: vec![] })?;
        let world = self.world;
        if let Some(r) = descs.iter().position(|d| d.lens.first() != Some(&(world as u64))) {
            return Err(mismatch(op, format!("rank {r} passed {:?} send buffers for a world of {world}", descs[r].lens.first())));
        }
        for s in 1..world {
            let to = (self.rank + s) % world;
            self.send_data(to, Key::Coll { seq: call.seq, step: 0 }, send[to], op.name(), call.start, call.deadline)?;
        }
        let mut recv = Vec::with_capacity(world);
        for (from, mine) in send.iter().enumerate() {
            match from == self.rank {
                true => recv.push(mine.to_vec()),
                false => recv.push(self.recv_data::<f32>(
                    from,
                    Key::Coll { seq: call.seq, step: 0 },
                    None,
                    op.name(),
                    call.start,
                    call.deadline,
                )?),
            }
        }
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
            self.shared.lock().msgs.insert((to, key), Delivery::Data(Payload::F32(data.to_vec())));
            self.shared.cv.notify_all();
        } else {
            let start = Instant::now();
            self.send_data(to, key, data, "send", start, start + Duration::from_millis(self.timeout_ms))?;
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
        let data = self.recv_data::<f32>(from, Key::P2p { tag, n }, None, "recv", start, start + Duration::from_millis(self.timeout_ms))?;
        self.p2p_next.insert((from, tag), n + 1);
        let bytes_received = if from == self.rank { 0 } else { data.len() as u64 * 4 };
        self.stats.record(Traffic { bytes_sent: 0, bytes_received });
        Ok(data)
    }

    fn barrier(&mut self) -> Result<(), CollectiveError> {
        self.enter(Op::Barrier, OpDesc { op: Op::Barrier as u8, lens: vec![], ends: vec![] })?;
        self.stats.record(Traffic::default());
        Ok(())
    }
}

#[cfg(test)]
impl QuicComm {
    /// The raw connection to `peer`, for tests that misbehave on the wire.
    pub(crate) fn conns_for_test(&self, peer: usize) -> Connection {
        self.conns[peer].clone().expect("a connected peer")
    }
}
