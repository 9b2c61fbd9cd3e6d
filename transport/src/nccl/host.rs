//! [`Collective`] on host slices, staged through the GPU: every operation agrees on a descriptor
//! first, then moves its data through NCCL (sums in rank order on the host for more than two
//! ranks); see the module notes of [`super`].

use super::device::{cu, vp, NcclComm};
use super::error::{is_ok, NcclError};
use super::staging::Elem;
use crate::collective::CollectiveOp as Op;
use crate::collective::{
    chain_broadcast_traffic, check_ranges, even_ranges, gather_slices_traffic, ring_all_gather_traffic, ring_all_reduce_traffic,
    ring_reduce_scatter_traffic, AbortHandle, Collective, CollectiveError, CommStats, Traffic,
};
use cudarc::nccl::sys;
use std::collections::VecDeque;
use std::ffi::c_int;
use std::ops::{AddAssign, Range};
use std::time::{Duration, Instant};

/// Descriptor fields (then one length per rank, for all-to-all).
const D_OP: usize = 0;
const D_LEN: usize = 1;
const D_OUT: usize = 2;
const D_ROOT: usize = 3;
const D_RANGES: usize = 4;
const D_LENS: usize = 5;

fn hash_ranges(ranges: &[Range<usize>]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for r in ranges {
        for v in [r.start as u64, r.end as u64] {
            h = (h ^ v).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h ^ ranges.len() as u64
}

impl NcclComm {
    fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }

    /// Converts a data-phase error, aborting the communicator for anything but a disagreement
    /// (after which the ranks are no longer in step).
    fn fail(&self, e: NcclError) -> CollectiveError {
        if !matches!(e, NcclError::Mismatch { .. } | NcclError::Invalid { .. }) {
            let _ = self.bind();
            self.shared.lock().abort(&e.to_string());
        }
        e.into()
    }

    fn wait_host(&self) -> Result<(), NcclError> {
        self.wait(&self.gpu.stream, self.timeout())
    }

    /// Opens host collective `op`: all-gathers every rank's descriptor (`fields` at D_OP..D_LENS
    /// then `lens`, one per rank) so every rank judges agreement on the same data.
    fn agree(&mut self, op: Op, fields: [u64; 4], lens: &[u64]) -> Result<Vec<Vec<u64>>, CollectiveError> {
        let w = self.world;
        let words = D_LENS + w;
        let mut mine = vec![0u64; words];
        mine[D_OP] = op as u64;
        mine[D_LEN..D_LENS].copy_from_slice(&fields);
        for (dst, &l) in mine[D_LENS..].iter_mut().zip(lens) {
            *dst = l;
        }
        let run = |c: &mut Self| -> Result<Vec<u64>, NcclError> {
            let all = c.stage::<u64>(w * words, false)?;
            let own = all.slice(c.rank * words..(c.rank + 1) * words);
            c.htod(own, &mine)?;
            // In place: the send buffer is this rank's block of the receive buffer.
            c.all_gather_raw(op.name(), own, all, sys::ncclDataType_t::ncclUint64, &c.gpu.stream)?;
            c.wait_host()?;
            let mut out = vec![0u64; w * words];
            c.dtoh(&mut out, all)?;
            Ok(out)
        };
        let flat = run(self).map_err(|e| self.fail(e))?;
        let rows: Vec<Vec<u64>> = flat.chunks(words).map(<[u64]>::to_vec).collect();
        if let Some(r) = rows.iter().position(|row| row[D_OP] != rows[0][D_OP]) {
            let detail =
                format!("rank {r} called {} but rank 0 called {}", Op::name_of_code(rows[r][D_OP]), Op::name_of_code(rows[0][D_OP]));
            return Err(CollectiveError::Mismatch { op: op.name(), detail });
        }
        Ok(rows)
    }

    /// Every rank's descriptor field `field` equals rank 0's.
    fn same(op: Op, rows: &[Vec<u64>], field: usize, what: &str) -> Result<(), CollectiveError> {
        match rows.iter().position(|row| row[field] != rows[0][field]) {
            Some(r) => Err(CollectiveError::Mismatch {
                op: op.name(),
                detail: format!("rank {r} has {what} {} but rank 0 has {}", rows[r][field], rows[0][field]),
            }),
            None => Ok(()),
        }
    }

    /// Same ranges on every rank (by hash), valid for `total` elements.
    fn same_ranges(&self, op: Op, rows: &[Vec<u64>], ranges: &[Range<usize>], total: usize) -> Result<(), CollectiveError> {
        if let Some(r) = rows.iter().position(|row| row[D_RANGES] != rows[0][D_RANGES]) {
            let detail = format!("rank {r} passed different ranges from rank 0's (this rank passed {ranges:?})");
            return Err(CollectiveError::Mismatch { op: op.name(), detail });
        }
        check_ranges(op.name(), ranges, self.world, total)
    }

    /// Each rank `r`'s descriptor `field` equals `want(r)`.
    fn each_is(op: Op, rows: &[Vec<u64>], field: usize, what: &str, want: impl Fn(usize) -> usize) -> Result<(), CollectiveError> {
        for (r, row) in rows.iter().enumerate() {
            if row[field] != want(r) as u64 {
                let detail = format!("rank {r} passed {what} of {} elements where {} were expected", row[field], want(r));
                return Err(CollectiveError::Mismatch { op: op.name(), detail });
            }
        }
        Ok(())
    }

    /// Point-to-point exchange of one group: `input[send[j]]` goes to rank `j`, and `recv_lens[j]`
    /// elements come from rank `j`; returns the received blocks concatenated in rank order, this
    /// rank's own block being `input[send[rank]]` (copied on the host).
    fn exchange<T: Elem>(&mut self, op: Op, input: &[T], send: &[Range<usize>], recv_lens: &[usize]) -> Result<Vec<T>, CollectiveError> {
        let (w, rank) = (self.world, self.rank);
        let offsets: Vec<usize> = recv_lens.iter().scan(0, |acc, &n| Some(std::mem::replace(acc, *acc + n))).collect();
        let total: usize = recv_lens.iter().sum();
        let run = |c: &mut Self| -> Result<Vec<T>, NcclError> {
            let a = c.stage::<T>(input.len(), false)?;
            let b = c.stage::<T>(total, true)?;
            c.htod(a, input)?;
            let blocks: Vec<_> =
                (0..w).filter(|&j| j != rank).map(|j| (j, send[j].clone(), recv_lens[j], offsets[j]..offsets[j] + recv_lens[j])).collect();
            c.grouped_p2p(op.name(), a, b, &blocks, &c.gpu.stream)?;
            c.wait_host()?;
            let mut out = vec![T::default(); total];
            c.dtoh(&mut out, b)?;
            Ok(out)
        };
        let mut out = run(self).map_err(|e| self.fail(e))?;
        out[offsets[rank]..offsets[rank] + recv_lens[rank]].copy_from_slice(&input[send[rank].clone()]);
        Ok(out)
    }

    /// `out[ranges[r]] ← shard_r` via NCCL's all-gather with every shard padded to the longest.
    fn padded_all_gather<T: Elem>(&mut self, op: Op, shard: &[T], ranges: &[Range<usize>], out: &mut [T]) -> Result<(), CollectiveError> {
        let w = self.world;
        let m = ranges.iter().map(Range::len).max().unwrap_or(0);
        let mut run = |c: &mut Self| -> Result<(), NcclError> {
            let a = c.stage::<T>(m, false)?;
            let b = c.stage::<T>(w * m, true)?;
            c.htod(a.slice(0..shard.len()), shard)?;
            c.gpu.zero(a.slice(shard.len()..m), &c.gpu.stream)?;
            c.all_gather_raw(op.name(), a, b, T::DT, &c.gpu.stream)?;
            c.wait_host()?;
            for (j, r) in ranges.iter().enumerate() {
                c.dtoh(&mut out[r.clone()], b.slice(j * m..j * m + r.len()))?;
            }
            Ok(())
        };
        run(self).map_err(|e| self.fail(e))
    }

    /// Sum of the received blocks (each `n` long) in rank order: `((b0 + b1) + b2) + …`.
    fn rank_order_sum<T: Elem + AddAssign>(blocks: &[T], n: usize, out: &mut [T]) {
        if n == 0 {
            return;
        }
        out.copy_from_slice(&blocks[..n]);
        for b in blocks.chunks(n).skip(1) {
            out.iter_mut().zip(b).for_each(|(o, &x)| *o += x);
        }
    }

    /// `out ← Σ_r input_r[ranges[rank]]` with agreed, valid ranges.
    fn reduce_scatter_data<T: Elem + AddAssign>(
        &mut self,
        op: Op,
        input: &[T],
        ranges: &[Range<usize>],
        out: &mut [T],
    ) -> Result<(), CollectiveError> {
        let (w, rank) = (self.world, self.rank);
        let own = ranges[rank].len();
        if w > 2 {
            // Rank order, not NCCL's order: exchange the un-reduced slices, add on the host.
            let blocks = self.exchange(op, input, ranges, &vec![own; w])?;
            Self::rank_order_sum(&blocks, own, out);
            return Ok(());
        }
        let m = ranges.iter().map(Range::len).max().unwrap_or(0);
        let mut run = |c: &mut Self| -> Result<(), NcclError> {
            let a = c.stage::<T>(w * m, false)?;
            let b = c.stage::<T>(m, true)?;
            c.gpu.zero(a, &c.gpu.stream)?;
            for (j, r) in ranges.iter().enumerate() {
                c.htod(a.slice(j * m..j * m + r.len()), &input[r.clone()])?;
            }
            // SAFETY: `a` has world·m and `b` m elements of live staging memory.
            c.enqueue(op.name(), |comm| unsafe {
                sys::ncclReduceScatter(vp(a), vp(b), m, T::DT, sys::ncclRedOp_t::ncclSum, comm, cu(&c.gpu.stream))
            })?;
            c.wait_host()?;
            c.dtoh(out, b.slice(0..own))
        };
        run(self).map_err(|e| self.fail(e))
    }

    /// All-reduce of agreed length, by the determinism rule of the module doc.
    fn all_reduce_data<T: Elem + AddAssign>(&mut self, op: Op, buf: &mut [T]) -> Result<(), CollectiveError> {
        let w = self.world;
        if w > 2 {
            let ranges = even_ranges(buf.len(), w);
            let mut part = vec![T::default(); ranges[self.rank].len()];
            self.reduce_scatter_data(op, &*buf, &ranges, &mut part)?;
            return self.padded_all_gather(op, &part, &ranges, buf);
        }
        let mut run = |c: &mut Self| -> Result<(), NcclError> {
            let a = c.stage::<T>(buf.len(), false)?;
            c.htod(a, buf)?;
            c.all_reduce_raw(op.name(), a, T::DT, &c.gpu.stream)?;
            c.wait_host()?;
            c.dtoh(buf, a)
        };
        run(self).map_err(|e| self.fail(e))
    }

    fn all_reduce_host<T: Elem + AddAssign>(&mut self, op: Op, buf: &mut [T]) -> Result<(), CollectiveError> {
        let rows = self.agree(op, [buf.len() as u64, 0, 0, 0], &[])?;
        Self::same(op, &rows, D_LEN, "length")?;
        self.all_reduce_data(op, buf)?;
        self.stats.record(ring_all_reduce_traffic(buf.len(), self.world, self.rank, T::BYTES));
        Ok(())
    }

    /// Posts one receive from `from` of `n` elements of `T` and waits for it.
    fn recv_raw<T: Elem>(&mut self, from: usize, n: usize, deadline: Instant) -> Result<Vec<T>, NcclError> {
        let mut out = vec![T::default(); n];
        if n == 0 {
            return Ok(out);
        }
        let a = self.stage::<T>(n, false)?;
        // SAFETY: `a` has `n` elements of live staging memory.
        self.enqueue("recv", |c| unsafe { sys::ncclRecv(vp(a), n, T::DT, from as c_int, c, cu(&self.gpu.stream)) })?;
        self.wait(&self.gpu.stream, deadline.saturating_duration_since(Instant::now()))?;
        self.dtoh(&mut out, a)?;
        Ok(out)
    }
}

impl Collective for NcclComm {
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
        let shared = self.shared.clone();
        AbortHandle::new(move |reason| shared.request_abort(reason))
    }

    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        self.all_reduce_host(Op::AllReduce, buf)
    }

    fn all_reduce_sum_f64(&mut self, buf: &mut [f64]) -> Result<(), CollectiveError> {
        self.all_reduce_host(Op::AllReduceF64, buf)
    }

    fn reduce_scatter_sum(&mut self, input: &[f32], ranges: &[Range<usize>], out: &mut [f32]) -> Result<(), CollectiveError> {
        let op = Op::ReduceScatter;
        let rows = self.agree(op, [input.len() as u64, out.len() as u64, 0, hash_ranges(ranges)], &[])?;
        Self::same(op, &rows, D_LEN, "input length")?;
        self.same_ranges(op, &rows, ranges, input.len())?;
        Self::each_is(op, &rows, D_OUT, "an output", |r| ranges[r].len())?;
        self.reduce_scatter_data(op, input, ranges, out)?;
        self.stats.record(ring_reduce_scatter_traffic(ranges, self.rank, 4));
        Ok(())
    }

    fn all_gather(&mut self, shard: &[f32], ranges: &[Range<usize>], out: &mut [f32]) -> Result<(), CollectiveError> {
        let op = Op::AllGather;
        let rows = self.agree(op, [shard.len() as u64, out.len() as u64, 0, hash_ranges(ranges)], &[])?;
        Self::same(op, &rows, D_OUT, "output length")?;
        self.same_ranges(op, &rows, ranges, out.len())?;
        Self::each_is(op, &rows, D_LEN, "a shard", |r| ranges[r].len())?;
        self.padded_all_gather(op, shard, ranges, out)?;
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
        let rows = self.agree(op, [input.len() as u64, 0, 0, hash_ranges(ranges)], &[])?;
        Self::same(op, &rows, D_LEN, "input length")?;
        self.same_ranges(op, &rows, ranges, input.len())?;
        let own = ranges[self.rank].len();
        let blocks = self.exchange(op, input, ranges, &vec![own; self.world])?;
        self.stats.record(gather_slices_traffic(ranges, self.rank, 4));
        for r in 0..self.world {
            visit(r, &blocks[r * own..(r + 1) * own]);
        }
        Ok(())
    }

    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CollectiveError> {
        let op = Op::Broadcast;
        let rows = self.agree(op, [buf.len() as u64, 0, root as u64, 0], &[])?;
        Self::same(op, &rows, D_LEN, "length")?;
        Self::same(op, &rows, D_ROOT, "root")?;
        if root >= self.world {
            return Err(CollectiveError::InvalidArgument { op: op.name(), detail: format!("root {root} of a world of {}", self.world) });
        }
        let mut run = |c: &mut Self| -> Result<(), NcclError> {
            let a = c.stage::<f32>(buf.len(), false)?;
            if c.rank == root {
                c.htod(a, buf)?;
            }
            c.broadcast_raw(op.name(), a, root, sys::ncclDataType_t::ncclFloat32, &c.gpu.stream)?;
            c.wait_host()?;
            c.dtoh(buf, a)
        };
        run(self).map_err(|e| self.fail(e))?;
        self.stats.record(chain_broadcast_traffic(buf.len(), self.world, root, self.rank, 4));
        Ok(())
    }

    fn all_to_all(&mut self, send: &[&[f32]]) -> Result<Vec<Vec<f32>>, CollectiveError> {
        let op = Op::AllToAll;
        let (w, rank) = (self.world, self.rank);
        let lens: Vec<u64> = send.iter().map(|s| s.len() as u64).collect();
        let rows = self.agree(op, [0, send.len() as u64, 0, 0], &lens)?;
        Self::each_is(op, &rows, D_OUT, "a list", |_| w)?;
        let mut input = Vec::with_capacity(send.iter().map(|s| s.len()).sum());
        let mut ranges = Vec::with_capacity(w);
        for s in send {
            ranges.push(input.len()..input.len() + s.len());
            input.extend_from_slice(s);
        }
        let recv_lens: Vec<usize> = rows.iter().map(|row| row[D_LENS + rank] as usize).collect();
        let flat = self.exchange(op, &input, &ranges, &recv_lens)?;
        let mut out = Vec::with_capacity(w);
        let mut at = 0;
        for &n in &recv_lens {
            out.push(flat[at..at + n].to_vec());
            at += n;
        }
        let peers = |v: &[usize]| v.iter().enumerate().filter(|&(j, _)| j != rank).map(|(_, &n)| n as u64 * 4).sum::<u64>();
        let sent: Vec<usize> = send.iter().map(|s| s.len()).collect();
        self.stats.record(Traffic { bytes_sent: peers(&sent), bytes_received: peers(&recv_lens) });
        Ok(out)
    }

    fn send(&mut self, to: usize, tag: u64, data: &[f32]) -> Result<(), CollectiveError> {
        const OP: &str = "send";
        if to >= self.world {
            return Err(CollectiveError::InvalidArgument { op: OP, detail: format!("rank {to} of a world of {}", self.world) });
        }
        if to == self.rank {
            self.mail.entry((to, tag)).or_default().push_back(data.to_vec());
            self.stats.record(Traffic::default());
            return Ok(());
        }
        let run = |c: &mut Self| -> Result<(), NcclError> {
            let h = c.stage::<u64>(2, false)?;
            let a = c.stage::<f32>(data.len(), false)?;
            c.htod(h, &[tag, data.len() as u64])?;
            c.htod(a, data)?;
            let stream = cu(&c.gpu.stream);
            c.enqueue(OP, |comm| {
                // SAFETY: `h` has 2 and `a` `data.len()` elements of live staging memory. The
                // header and payload are separate sends, matched in order by the peer's receives.
                unsafe {
                    let r = sys::ncclSend(vp(h), 2, sys::ncclDataType_t::ncclUint64, to as c_int, comm, stream);
                    if !is_ok(r) || data.is_empty() {
                        return r;
                    }
                    sys::ncclSend(vp(a), data.len(), sys::ncclDataType_t::ncclFloat32, to as c_int, comm, stream)
                }
            })?;
            c.wait_host()
        };
        run(self).map_err(|e| self.fail(e))?;
        self.stats.record(Traffic { bytes_sent: data.len() as u64 * 4, bytes_received: 0 });
        Ok(())
    }

    fn recv(&mut self, from: usize, tag: u64) -> Result<Vec<f32>, CollectiveError> {
        const OP: &str = "recv";
        if from >= self.world {
            return Err(CollectiveError::InvalidArgument { op: OP, detail: format!("rank {from} of a world of {}", self.world) });
        }
        let me = self.rank;
        let bytes = |v: &[f32]| if from == me { 0 } else { v.len() as u64 * 4 };
        if let Some(msg) = self.mail.get_mut(&(from, tag)).and_then(VecDeque::pop_front) {
            self.stats.record(Traffic { bytes_sent: 0, bytes_received: bytes(&msg) });
            return Ok(msg);
        }
        if from == self.rank {
            let detail = format!("rank {from} receives from itself under tag {tag} but sent nothing under it");
            return Err(CollectiveError::InvalidArgument { op: OP, detail });
        }
        let deadline = Instant::now() + self.timeout();
        loop {
            let run = |c: &mut Self| -> Result<(u64, Vec<f32>), NcclError> {
                let header = c.recv_raw::<u64>(from, 2, deadline)?;
                let payload = c.recv_raw::<f32>(from, header[1] as usize, deadline)?;
                Ok((header[0], payload))
            };
            let (got_tag, msg) = run(self).map_err(|e| self.fail(e))?;
            if got_tag == tag {
                self.stats.record(Traffic { bytes_sent: 0, bytes_received: bytes(&msg) });
                return Ok(msg);
            }
            self.mail.entry((from, got_tag)).or_default().push_back(msg);
        }
    }

    fn barrier(&mut self) -> Result<(), CollectiveError> {
        // The descriptor all-gather completes only once every rank has entered it.
        self.agree(Op::Barrier, [0; 4], &[])?;
        self.stats.record(Traffic::default());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_order_sum_adds_left_to_right() {
        let blocks = [1.0f32, 1e8, -1e8, 2.0, 3.0, 4.0];
        let mut out = [0.0; 2];
        NcclComm::rank_order_sum(&blocks, 2, &mut out);
        assert_eq!(out, [(1.0 + -1e8) + 3.0, (1e8 + 2.0) + 4.0]);
        let mut empty: [f32; 0] = [];
        NcclComm::rank_order_sum(&[], 0, &mut empty);
    }

    #[test]
    fn op_codes_round_trip() {
        for op in Op::ALL {
            assert_eq!(Op::name_of_code(op as u64), op.name());
        }
        assert_eq!(Op::name_of_code(Op::ALL.len() as u64), "an unknown operation");
    }
}
