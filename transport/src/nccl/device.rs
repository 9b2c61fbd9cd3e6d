//! The communicator ([`NcclComm`]) and its device-buffer collectives on explicit streams (what
//! the GPU trainer uses): joining a group, enqueueing, the bounded wait, aborting and dropping.

use super::error::{ensure_library, is_ok, nccl_err, NcclError};
use super::id::NcclId;
use super::staging::{Elem, Staging};
use crate::collective::{CommStats, DEFAULT_TIMEOUT_MS};
use cudarc::nccl::sys;
use std::collections::{HashMap, VecDeque};
use std::ffi::{c_int, c_void};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, TryLockError};
use std::time::{Duration, Instant};
use tessera_kernels::cuda::{bf16, CudaContext, CudaStream, DPtr, Gpu, GpuError};

/// The communicator handle and whether it is still usable.
pub(super) struct Handle {
    comm: sys::ncclComm_t,
    /// `Some(reason)` once aborted (or destroyed); no NCCL call is made on it then.
    dead: Option<String>,
    /// The last operation enqueued (named by `wait`'s errors).
    last_op: &'static str,
}

// SAFETY: an NCCL communicator may be used from any thread as long as one thread uses it at a
// time, which the `Mutex` around the `Handle` guarantees.
unsafe impl Send for Handle {}

impl Handle {
    /// `ncclCommAbort` unless already dead.
    pub(super) fn abort(&mut self, reason: &str) {
        if self.dead.is_none() {
            // SAFETY: `comm` is live (not yet aborted or destroyed) and not used concurrently.
            // Its result only says whether NCCL freed everything; the handle is dead either way.
            let _ = unsafe { sys::ncclCommAbort(self.comm) };
            self.dead = Some(reason.to_string());
        }
    }
}

pub(super) struct Shared {
    ctx: Arc<CudaContext>,
    handle: Mutex<Handle>,
    /// An abort asked for through an [`AbortHandle`](crate::collective::AbortHandle) (performed as soon as the handle is free).
    abort_requested: AtomicBool,
    abort_reason: Mutex<Option<String>>,
}

impl Shared {
    pub(super) fn lock(&self) -> MutexGuard<'_, Handle> {
        // No critical section leaves the handle half-updated, so a poisoned lock is consistent.
        self.handle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Performs a requested abort (the caller holds the handle).
    pub(super) fn apply_request(&self, h: &mut Handle) {
        if self.abort_requested.load(Ordering::SeqCst) && h.dead.is_none() {
            let reason = self.abort_reason.lock().unwrap_or_else(PoisonError::into_inner).clone().unwrap_or_default();
            let _ = self.ctx.bind_to_thread();
            h.abort(&reason);
        }
    }

    /// Asks for an abort from any thread: done at once when no NCCL call is in progress,
    /// otherwise by the owner as soon as its call returns (and at its next `wait` poll).
    pub(super) fn request_abort(&self, reason: &str) {
        {
            let mut r = self.abort_reason.lock().unwrap_or_else(PoisonError::into_inner);
            if r.is_none() {
                *r = Some(reason.to_string());
            }
        }
        self.abort_requested.store(true, Ordering::SeqCst);
        let h = match self.handle.try_lock() {
            Ok(h) => Some(h),
            Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        };
        if let Some(mut h) = h {
            self.apply_request(&mut h);
        }
    }
}

/// A device pointer as NCCL's `void*`.
pub(super) fn vp<T>(p: DPtr<T>) -> *mut c_void {
    p.raw as *mut c_void
}

pub(super) fn cu(stream: &CudaStream) -> sys::cudaStream_t {
    stream.cu_stream() as sys::cudaStream_t
}

/// One rank's handle on an NCCL communicator over its GPU.
pub struct NcclComm {
    pub(super) gpu: Arc<Gpu>,
    pub(super) rank: usize,
    pub(super) world: usize,
    pub(super) shared: Arc<Shared>,
    pub(super) timeout_ms: u64,
    pub(super) stats: CommStats,
    pub(super) staging: Staging,
    /// Point-to-point messages received ahead of their `recv` (other tag) or sent to oneself.
    pub(super) mail: HashMap<(usize, u64), VecDeque<Vec<f32>>>,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm").field("rank", &self.rank).field("world", &self.world).field("gpu", &self.gpu.ordinal).finish()
    }
}

impl NcclComm {
    /// Joins communicator `id` as `rank` of `world` on `gpu` (`ncclCommInitRank`; blocks until
    /// every rank has joined), then runs one 1-element all-reduce so the group is connected.
    /// Host waits are bounded by [`DEFAULT_TIMEOUT_MS`] until
    /// [`Collective::set_timeout_ms`](crate::collective::Collective::set_timeout_ms).
    pub fn new(gpu: Arc<Gpu>, rank: usize, world: usize, id: &NcclId) -> Result<NcclComm, NcclError> {
        ensure_library()?;
        const OP: &str = "ncclCommInitRank";
        if rank >= world || c_int::try_from(world).is_err() {
            return Err(NcclError::Invalid { op: OP, detail: format!("rank {rank} of a world of {world}") });
        }
        gpu.ctx.bind_to_thread().map_err(tessera_kernels::cuda::drv(format!("making GPU {}'s context current", gpu.ordinal)))?;
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is an out-parameter; the id is a plain 128-byte value.
        let r = unsafe { sys::ncclCommInitRank(&mut comm, world as c_int, id.raw(), rank as c_int) };
        if !is_ok(r) || comm.is_null() {
            return Err(nccl_err(OP, rank, r, comm));
        }
        let shared = Arc::new(Shared {
            ctx: gpu.ctx.clone(),
            handle: Mutex::new(Handle { comm, dead: None, last_op: OP }),
            abort_requested: AtomicBool::new(false),
            abort_reason: Mutex::new(None),
        });
        let comm = NcclComm {
            gpu,
            rank,
            world,
            shared,
            timeout_ms: DEFAULT_TIMEOUT_MS,
            stats: CommStats::default(),
            staging: Staging::default(),
            mail: HashMap::new(),
        };
        let one = comm.gpu.alloc::<f32>(1)?;
        comm.all_reduce_sum_f32(one.ptr(), &comm.gpu.stream)?;
        comm.wait(&comm.gpu.stream, Duration::from_millis(DEFAULT_TIMEOUT_MS))?;
        Ok(comm)
    }

    /// This communicator's rank, `0..world`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The GPU this rank runs on.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Whether the communicator has been aborted (explicitly, by a timeout or an error).
    pub fn is_aborted(&self) -> bool {
        self.shared.lock().dead.is_some()
    }

    pub(super) fn bind(&self) -> Result<(), NcclError> {
        self.gpu.ctx.bind_to_thread().map_err(tessera_kernels::cuda::drv(format!("making GPU {}'s context current", self.gpu.ordinal)))?;
        Ok(())
    }

    /// Runs `f` (NCCL enqueue calls) on the live communicator.
    pub(super) fn enqueue(&self, op: &'static str, f: impl FnOnce(sys::ncclComm_t) -> sys::ncclResult_t) -> Result<(), NcclError> {
        self.bind()?;
        let mut h = self.shared.lock();
        self.shared.apply_request(&mut h);
        if let Some(reason) = &h.dead {
            return Err(NcclError::Aborted { op, rank: self.rank, reason: reason.clone() });
        }
        h.last_op = op;
        let r = f(h.comm);
        let out = if is_ok(r) { Ok(()) } else { Err(nccl_err(op, self.rank, r, h.comm)) };
        self.shared.apply_request(&mut h);
        out
    }

    /// `recv[i] ← Σ_r send_r[rank·k + i]`: `send` has `world·k` elements, `recv` `k`.
    pub fn reduce_scatter_f32(&self, send: DPtr<f32>, recv: DPtr<f32>, stream: &CudaStream) -> Result<(), NcclError> {
        let k = recv.len;
        assert!(
            send.len == self.world * k,
            "reduce_scatter_f32: send has {} elements but world {} × recv {k} = {} were expected",
            send.len,
            self.world,
            self.world * k
        );
        self.enqueue("reduce_scatter_f32", |c| {
            // SAFETY: lengths checked above; the buffers live on this GPU (caller's DPtr contract).
            unsafe {
                sys::ncclReduceScatter(vp(send), vp(recv), k, sys::ncclDataType_t::ncclFloat32, sys::ncclRedOp_t::ncclSum, c, cu(stream))
            }
        })
    }

    pub(super) fn all_gather_raw<T>(
        &self,
        op: &'static str,
        send: DPtr<T>,
        recv: DPtr<T>,
        dt: sys::ncclDataType_t,
        stream: &CudaStream,
    ) -> Result<(), NcclError> {
        let k = send.len;
        assert!(
            recv.len == self.world * k,
            "{op}: recv has {} elements but world {} × send {k} = {} were expected",
            recv.len,
            self.world,
            self.world * k
        );
        // SAFETY: lengths checked above; the buffers live on this GPU (caller's DPtr contract).
        self.enqueue(op, |c| unsafe { sys::ncclAllGather(vp(send), vp(recv), k, dt, c, cu(stream)) })
    }

    /// `recv[r·k..(r+1)·k] ← send_r` for every rank `r`: `send` has `k` elements, `recv` `world·k`.
    pub fn all_gather_bf16(&self, send: DPtr<bf16>, recv: DPtr<bf16>, stream: &CudaStream) -> Result<(), NcclError> {
        self.all_gather_raw("all_gather_bf16", send, recv, sys::ncclDataType_t::ncclBfloat16, stream)
    }

    /// As [`NcclComm::all_gather_bf16`] for f32.
    pub fn all_gather_f32(&self, send: DPtr<f32>, recv: DPtr<f32>, stream: &CudaStream) -> Result<(), NcclError> {
        self.all_gather_raw("all_gather_f32", send, recv, sys::ncclDataType_t::ncclFloat32, stream)
    }

    pub(super) fn all_reduce_raw<T>(
        &self,
        op: &'static str,
        buf: DPtr<T>,
        dt: sys::ncclDataType_t,
        stream: &CudaStream,
    ) -> Result<(), NcclError> {
        // SAFETY: in place over `buf.len` elements of a live buffer (caller's DPtr contract).
        self.enqueue(op, |c| unsafe { sys::ncclAllReduce(vp(buf), vp(buf), buf.len, dt, sys::ncclRedOp_t::ncclSum, c, cu(stream)) })
    }

    /// `buf ← Σ_r buf_r`, in place (same length on every rank).
    pub fn all_reduce_sum_f32(&self, buf: DPtr<f32>, stream: &CudaStream) -> Result<(), NcclError> {
        self.all_reduce_raw("all_reduce_sum_f32", buf, sys::ncclDataType_t::ncclFloat32, stream)
    }

    /// As [`NcclComm::all_reduce_sum_f32`] in f64.
    pub fn all_reduce_sum_f64(&self, buf: DPtr<f64>, stream: &CudaStream) -> Result<(), NcclError> {
        self.all_reduce_raw("all_reduce_sum_f64", buf, sys::ncclDataType_t::ncclFloat64, stream)
    }

    pub(super) fn broadcast_raw<T>(
        &self,
        op: &'static str,
        buf: DPtr<T>,
        root: usize,
        dt: sys::ncclDataType_t,
        stream: &CudaStream,
    ) -> Result<(), NcclError> {
        assert!(root < self.world, "{op}: root {root} is not a rank of a world of {}", self.world);
        // SAFETY: in place over `buf.len` elements of a live buffer (caller's DPtr contract).
        self.enqueue(op, |c| unsafe { sys::ncclBroadcast(vp(buf), vp(buf), buf.len, dt, root as c_int, c, cu(stream)) })
    }

    /// `buf ← buf_root` on every rank, in place.
    pub fn broadcast_f32(&self, buf: DPtr<f32>, root: usize, stream: &CudaStream) -> Result<(), NcclError> {
        self.broadcast_raw("broadcast_f32", buf, root, sys::ncclDataType_t::ncclFloat32, stream)
    }

    /// Block `j` (`k` elements) of `send` goes to rank `j`; block `j` of `recv` comes from rank
    /// `j`. Both have `world·k` elements. Grouped sends and receives (`ncclGroupStart/End`).
    pub fn all_to_all_f32(&self, send: DPtr<f32>, recv: DPtr<f32>, stream: &CudaStream) -> Result<(), NcclError> {
        let w = self.world;
        assert!(
            send.len == recv.len && send.len.is_multiple_of(w),
            "all_to_all_f32: send and recv must both have world·k elements; send has {}, recv {}, world {w}",
            send.len,
            recv.len
        );
        let k = send.len / w;
        let blocks: Vec<(usize, Range<usize>, usize, Range<usize>)> =
            (0..w).map(|j| (j, j * k..(j + 1) * k, k, j * k..(j + 1) * k)).collect();
        self.grouped_p2p("all_to_all_f32", send, recv, &blocks, stream)
    }

    /// One group of sends and receives: for each `(peer, send range, receive count, receive
    /// range)`, sends `send[range]` to `peer` and receives into `recv[range]` from it (empty ones
    /// skipped; both sides know the counts).
    pub(super) fn grouped_p2p<T: Elem>(
        &self,
        op: &'static str,
        send: DPtr<T>,
        recv: DPtr<T>,
        blocks: &[(usize, Range<usize>, usize, Range<usize>)],
        stream: &CudaStream,
    ) -> Result<(), NcclError> {
        let (sends, recvs): (Vec<_>, Vec<_>) = blocks
            .iter()
            .map(|(peer, s, n, r)| {
                assert_eq!(*n, r.len(), "{op}: receive block of {} elements for a count of {n}", r.len());
                ((*peer, send.slice(s.clone())), (*peer, recv.slice(r.clone())))
            })
            .unzip();
        self.enqueue(op, |c| {
            // SAFETY: every slice is within its buffer (DPtr::slice checks); the group is
            // closed on every path.
            unsafe {
                let start = sys::ncclGroupStart();
                if !is_ok(start) {
                    return start;
                }
                let mut first = sys::ncclResult_t::ncclSuccess;
                for ((to, s), (from, r)) in sends.iter().zip(&recvs) {
                    if s.len > 0 {
                        let x = sys::ncclSend(vp(*s), s.len, T::DT, *to as c_int, c, cu(stream));
                        if !is_ok(x) && is_ok(first) {
                            first = x;
                        }
                    }
                    if r.len > 0 {
                        let x = sys::ncclRecv(vp(*r), r.len, T::DT, *from as c_int, c, cu(stream));
                        if !is_ok(x) && is_ok(first) {
                            first = x;
                        }
                    }
                }
                let end = sys::ncclGroupEnd();
                if is_ok(first) {
                    end
                } else {
                    first
                }
            }
        })
    }

    /// Sends `buf` to rank `to` (the peer posts a [`NcclComm::recv_f32`] of the same length).
    pub fn send_f32(&self, to: usize, buf: DPtr<f32>, stream: &CudaStream) -> Result<(), NcclError> {
        assert!(to < self.world, "send_f32: rank {to} is not a rank of a world of {}", self.world);
        // SAFETY: `buf` is a live device buffer (caller's DPtr contract).
        self.enqueue("send_f32", |c| unsafe {
            sys::ncclSend(vp(buf), buf.len, sys::ncclDataType_t::ncclFloat32, to as c_int, c, cu(stream))
        })
    }

    /// Receives `buf.len` elements from rank `from` into `buf`.
    pub fn recv_f32(&self, from: usize, buf: DPtr<f32>, stream: &CudaStream) -> Result<(), NcclError> {
        assert!(from < self.world, "recv_f32: rank {from} is not a rank of a world of {}", self.world);
        // SAFETY: `buf` is a live device buffer (caller's DPtr contract).
        self.enqueue("recv_f32", |c| unsafe {
            sys::ncclRecv(vp(buf), buf.len, sys::ncclDataType_t::ncclFloat32, from as c_int, c, cu(stream))
        })
    }

    /// Aborts the communicator (`ncclCommAbort`): its kernels stop, every later operation fails
    /// with [`NcclError::Aborted`]. Idempotent.
    pub fn abort(&self) {
        let _ = self.bind();
        let mut h = self.shared.lock();
        h.abort(&format!("rank {} aborted its communicator", self.rank));
    }

    /// Waits until everything enqueued on `stream` has run, at most `timeout`; polls
    /// `cuStreamQuery` and `ncclCommGetAsyncError`. On timeout, an asynchronous NCCL error or a
    /// requested abort, the communicator is aborted and the error returned.
    pub fn wait(&self, stream: &CudaStream, timeout: Duration) -> Result<(), NcclError> {
        use cudarc::driver::sys::CUresult;
        self.bind()?;
        let start = Instant::now();
        let mut polls = 0u32;
        loop {
            {
                let mut h = self.shared.lock();
                self.shared.apply_request(&mut h);
                let op = h.last_op;
                // Checked first: an abort makes NCCL's kernels exit, so the stream completes
                // without the operation having happened.
                if let Some(reason) = &h.dead {
                    return Err(NcclError::Aborted { op, rank: self.rank, reason: reason.clone() });
                }
                let mut async_err = sys::ncclResult_t::ncclSuccess;
                // SAFETY: live communicator (checked above), out-parameter.
                let r = unsafe { sys::ncclCommGetAsyncError(h.comm, &mut async_err) };
                let bad = if !is_ok(r) {
                    Some(r)
                } else if !is_ok(async_err) {
                    Some(async_err)
                } else {
                    None
                };
                if let Some(code) = bad {
                    let err = nccl_err(op, self.rank, code, h.comm);
                    h.abort(&err.to_string());
                    return Err(err);
                }
                // SAFETY: `stream` is a live stream of this GPU's context.
                match unsafe { cudarc::driver::sys::cuStreamQuery(stream.cu_stream()) } {
                    CUresult::CUDA_SUCCESS => return Ok(()),
                    CUresult::CUDA_ERROR_NOT_READY => {}
                    e => {
                        let what = format!("waiting for {op} on rank {} (GPU {})", self.rank, self.gpu.ordinal);
                        return Err(GpuError::Driver { what, err: format!("{e:?}") }.into());
                    }
                }
                let waited = start.elapsed();
                if waited >= timeout {
                    let waited_ms = waited.as_millis() as u64;
                    h.abort(&format!("rank {} timed out in {op} after {waited_ms} ms", self.rank));
                    return Err(NcclError::Timeout { op, rank: self.rank, waited_ms });
                }
            }
            polls += 1;
            if polls < 64 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(if polls < 1024 { 20 } else { 200 }));
            }
        }
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        let _ = self.bind();
        let mut h = self.shared.lock();
        self.shared.apply_request(&mut h);
        if h.dead.is_none() {
            // SAFETY: live communicator, used by no one else (we hold the lock; handles only
            // reach it through the lock and see it dead afterwards).
            let _ = unsafe { sys::ncclCommDestroy(h.comm) };
            h.dead = Some("the communicator was destroyed".into());
        }
    }
}
