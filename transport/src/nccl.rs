//! The NCCL backend: collectives between GPUs through NVIDIA's NCCL, on device buffers
//! ([`NcclComm`]'s `*_f32`/`*_bf16` methods, what the GPU trainer uses) and, staged through the
//! GPU, on host slices ([`Collective`], so the backend-independent tests run against it).
//!
//! NCCL is loaded at run time (cudarc `dynamic-loading`): without it, [`NcclId::new`] and
//! [`NcclComm::new`] return [`NcclError::Library`] instead of panicking. cudarc opens the library
//! as `libnccl.so` (or `libnccl.so.13`, `.12`, …, but not `.2`): where only `libnccl.so.2` exists
//! (pip's `nvidia-nccl-cu13`), put a link `libnccl.so -> libnccl.so.2` in a directory on
//! `LD_LIBRARY_PATH`.
//!
//! # Setting up a group
//!
//! One process (or thread) per GPU. A launcher makes one [`NcclId`] ([`NcclId::new`]), hands it
//! to every worker as text ([`NcclId::to_hex`] / [`NcclId::from_hex`], e.g. in an environment
//! variable), and each worker calls [`NcclComm::new`] with its GPU, rank and the world size.
//! `NcclComm::new` blocks until all `world` ranks have joined (NCCL's blocking init has no
//! timeout: the launcher must bound it, e.g. by killing workers that do not report in).
//!
//! # Device operations and waiting
//!
//! The device methods only *enqueue* work on the stream given (the buffers must stay alive and
//! unwritten until it has run) and check lengths with `assert!` (a wrong length is a bug in the
//! caller, and NCCL would otherwise read or write out of bounds or hang). Every rank must enqueue
//! the same collectives with the same counts in the same order. [`NcclComm::wait`] is the
//! bounded wait: it polls the stream (`cuStreamQuery`) and the communicator's asynchronous error
//! (`ncclCommGetAsyncError`) and, past its timeout, **aborts the communicator**
//! (`ncclCommAbort`: NCCL kernels stuck waiting for a dead peer exit) and returns
//! [`NcclError::Timeout`]. An aborted communicator refuses every later operation
//! ([`NcclError::Aborted`]); recovery builds a new one with a new id. NCCL does not tell the
//! peers of a rank that aborted: they time out in their own `wait` (or the supervisor aborts them
//! through [`Collective::abort_handle`]).
//!
//! NCCL sets up connections lazily (`NCCL_RUNTIME_CONNECT=1`, its default): the first use of an
//! algorithm or peer may block *on the host* inside the enqueueing call until the peers reach
//! the same operation, outside the bound of `wait`. [`NcclComm::new`] runs one small all-reduce
//! so that at least the group is connected for that; set `NCCL_RUNTIME_CONNECT=0` to connect
//! everything at init where a dead peer must never block the host.
//!
//! Dropping a communicator destroys it (`ncclCommDestroy`, which waits for its outstanding
//! operations) unless it was aborted (or an abort was requested); call [`NcclComm::abort`] before
//! dropping one whose peers may be gone.
//!
//! # Determinism
//!
//! With **2 ranks** every NCCL sum is a single IEEE add per element (`a + b`, commutative), so the
//! bits equal a single-process `a + b` and the rank-order rule of [`crate::collective`]. With
//! **more ranks** NCCL's ring/tree adds in an order of its own (depending on the algorithm,
//! channel count and message size), which is neither rank order nor the trainer's micro-batch
//! tree: the trainer's deterministic mode therefore needs `world ≤ 2` for the NCCL sum
//! (`reduce_scatter_f32`, `all_reduce_sum_*`), or a gather-based reduction (all-to-all of the
//! un-reduced slices, then [`crate::tree::TreeSum`] on each owner) for larger worlds.
//! The [`Collective`] implementation keeps the trait's rule for every world: with `world ≤ 2` it
//! uses NCCL's sums, with more ranks it exchanges the un-reduced slices (grouped send/recv) and
//! adds them on the host in rank order, so it matches [`crate::local::LocalGroup`] bit for bit.
//!
//! # The host ([`Collective`]) implementation
//!
//! Each operation uploads its arguments to staging buffers on the GPU's compute stream
//! (`gpu.stream`), runs NCCL there, waits (bounded by the handle's timeout) and copies back.
//! Before its data moves, every collective all-gathers a small fixed-size descriptor (operation,
//! lengths, root, ranges) so that all ranks detect a disagreement alike and report
//! [`CollectiveError::Mismatch`] without leaving the group out of step (NCCL itself would hang or
//! corrupt memory); that all-gather is also what [`Collective::barrier`] is. Uneven `ranges` are
//! padded with zeros to the longest range for NCCL's equal-count reduce-scatter and all-gather.
//! [`CommStats`] count the bytes of the modelled ring/chain algorithms, as in every backend.
//!
//! Point-to-point: NCCL has no tags and its sends are rendezvous. A message is a header
//! (tag, length) followed by the payload, matched between a pair of ranks in FIFO order. `recv`
//! takes messages from the peer in the order they were sent, keeping those under other tags in
//! a mailbox for later `recv`s, so tags are honoured; but a `send` completes only once the peer
//! is inside a `recv` from this rank (of any tag): two ranks that both send to each other before
//! receiving wait for each other until the timeout (use `all_to_all` for exchanges). Sends to
//! oneself are buffered on the host.

use crate::collective::CollectiveOp as Op;
use crate::collective::{
    chain_broadcast_traffic, check_ranges, even_ranges, gather_slices_traffic, ring_all_gather_traffic, ring_all_reduce_traffic,
    ring_reduce_scatter_traffic, AbortHandle, Collective, CollectiveError, CommStats, Traffic, DEFAULT_TIMEOUT_MS,
};
use cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::sys;
use std::collections::{HashMap, VecDeque};
use std::ffi::{c_int, c_void, CStr};
use std::ops::{AddAssign, Range};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, TryLockError};
use std::time::{Duration, Instant};
use tessera_kernels::cuda::{bf16, Buf, CudaContext, CudaStream, DPtr, Gpu, GpuError};

/// The sentence [`NcclError::Library`] starts with.
pub const LIBRARY_MISSING: &str = "libnccl.so.2 could not be loaded; point LD_LIBRARY_PATH at NCCL (docs/GPU.md)";

/// Why an NCCL operation failed; every variant names the operation and, where it has one, the
/// rank that saw it.
#[derive(Debug, thiserror::Error)]
pub enum NcclError {
    #[error(
        "libnccl.so.2 could not be loaded; point LD_LIBRARY_PATH at NCCL (docs/GPU.md). cudarc opens it as libnccl.so: \
         where only libnccl.so.2 exists (pip's nvidia-nccl-cu13), add a link libnccl.so -> libnccl.so.2 in a directory \
         on LD_LIBRARY_PATH"
    )]
    Library,
    #[error("{op} failed on rank {rank}: {code}: {detail}")]
    Nccl { op: &'static str, rank: usize, code: String, detail: String },
    #[error("{op}: rank {rank} waited {waited_ms} ms for the operation to finish and gave up; the communicator is aborted")]
    Timeout { op: &'static str, rank: usize, waited_ms: u64 },
    #[error("{op}: rank {rank}: the communicator was aborted: {reason}")]
    Aborted { op: &'static str, rank: usize, reason: String },
    #[error(transparent)]
    Gpu(#[from] GpuError),
    #[error("{op}: ranks disagree (seen by rank {rank}): {detail}")]
    Mismatch { op: &'static str, rank: usize, detail: String },
    #[error("{op}: invalid argument: {detail}")]
    Invalid { op: &'static str, detail: String },
}

impl From<NcclError> for CollectiveError {
    fn from(e: NcclError) -> Self {
        match e {
            NcclError::Timeout { op, rank, waited_ms } => CollectiveError::Timeout { op, rank, waited_ms },
            NcclError::Aborted { op, reason, .. } => CollectiveError::Aborted { op, reason },
            NcclError::Mismatch { op, detail, .. } => CollectiveError::Mismatch { op, detail },
            NcclError::Invalid { op, detail } => CollectiveError::InvalidArgument { op, detail },
            // A failed NCCL call or GPU error leaves the group unusable (the host path aborts
            // the communicator on them): report it as the abort it is.
            e @ NcclError::Nccl { op, .. } => CollectiveError::Aborted { op, reason: e.to_string() },
            e @ (NcclError::Library | NcclError::Gpu(_)) => CollectiveError::Aborted { op: "nccl", reason: e.to_string() },
        }
    }
}

/// Whether cudarc can open NCCL (probed once).
fn ensure_library() -> Result<(), NcclError> {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to dlopen the library names cudarc uses; no NCCL call is made.
    if *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() }) {
        Ok(())
    } else {
        Err(NcclError::Library)
    }
}

fn is_ok(r: sys::ncclResult_t) -> bool {
    matches!(r, sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress)
}

/// NCCL's description of `r` and, when there is a communicator, its last error message.
fn describe(r: sys::ncclResult_t, comm: sys::ncclComm_t) -> String {
    let text = |p: *const std::ffi::c_char| {
        if p.is_null() {
            String::new()
        } else {
            // SAFETY: NCCL returns NUL-terminated static or per-thread strings.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    // SAFETY: plain queries; `comm` is null or a live communicator (NCCL accepts null here).
    let (what, last) = unsafe { (text(sys::ncclGetErrorString(r)), text(sys::ncclGetLastError(comm))) };
    if last.is_empty() || last == what {
        what
    } else {
        format!("{what} ({last})")
    }
}

fn nccl_err(op: &'static str, rank: usize, r: sys::ncclResult_t, comm: sys::ncclComm_t) -> NcclError {
    NcclError::Nccl { op, rank, code: format!("{r:?}"), detail: describe(r, comm) }
}

/// The rendezvous id of one communicator (NCCL's 128-byte `ncclUniqueId`): made once by a
/// launcher, passed to every rank. An id serves **one** communicator: a new group (also after
/// an abort) needs a new id (joining twice with one id fails in `ncclCommInitRank` with
/// `ncclRemoteError`, connection refused).
#[derive(Clone, Copy)]
pub struct NcclId(cudarc::nccl::Id);

impl NcclId {
    /// A fresh id (`ncclGetUniqueId`; it also opens the bootstrap socket the ranks will meet at,
    /// so make it on the launcher's or rank 0's host).
    pub fn new() -> Result<NcclId, NcclError> {
        ensure_library()?;
        cudarc::nccl::Id::new().map(NcclId).map_err(|e| nccl_err("ncclGetUniqueId", 0, e.0, std::ptr::null_mut()))
    }

    /// The 128 bytes as 256 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        self.0.internal().iter().map(|&c| format!("{:02x}", c as u8)).collect()
    }

    /// Parses [`NcclId::to_hex`]'s output (surrounding whitespace is ignored).
    pub fn from_hex(s: &str) -> Result<NcclId, NcclError> {
        let s = s.trim();
        let bad = |detail: String| Err(NcclError::Invalid { op: "NcclId::from_hex", detail });
        if s.len() != 256 {
            return bad(format!("an NCCL id is 256 hex digits (128 bytes), got {} characters", s.len()));
        }
        let mut raw = [0 as std::ffi::c_char; 128];
        for (i, out) in raw.iter_mut().enumerate() {
            let pair = &s[2 * i..2 * i + 2];
            match u8::from_str_radix(pair, 16) {
                Ok(b) => *out = b as std::ffi::c_char,
                Err(_) => return bad(format!("`{pair}` at position {} is not a hex byte", 2 * i)),
            }
        }
        Ok(NcclId(cudarc::nccl::Id::uninit(raw)))
    }

    fn raw(&self) -> sys::ncclUniqueId {
        sys::ncclUniqueId { internal: *self.0.internal() }
    }
}

impl PartialEq for NcclId {
    fn eq(&self, other: &Self) -> bool {
        self.0.internal() == other.0.internal()
    }
}

impl Eq for NcclId {}

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclId({}…)", &self.to_hex()[..16])
    }
}

/// The communicator handle and whether it is still usable.
struct Handle {
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
    fn abort(&mut self, reason: &str) {
        if self.dead.is_none() {
            // SAFETY: `comm` is live (not yet aborted or destroyed) and not used concurrently.
            // Its result only says whether NCCL freed everything; the handle is dead either way.
            let _ = unsafe { sys::ncclCommAbort(self.comm) };
            self.dead = Some(reason.to_string());
        }
    }
}

struct Shared {
    ctx: Arc<CudaContext>,
    handle: Mutex<Handle>,
    /// An abort asked for through an [`AbortHandle`] (performed as soon as the handle is free).
    abort_requested: AtomicBool,
    abort_reason: Mutex<Option<String>>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Handle> {
        // No critical section leaves the handle half-updated, so a poisoned lock is consistent.
        self.handle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Performs a requested abort (the caller holds the handle).
    fn apply_request(&self, h: &mut Handle) {
        if self.abort_requested.load(Ordering::SeqCst) && h.dead.is_none() {
            let reason = self.abort_reason.lock().unwrap_or_else(PoisonError::into_inner).clone().unwrap_or_default();
            let _ = self.ctx.bind_to_thread();
            h.abort(&reason);
        }
    }

    /// Asks for an abort from any thread: done at once when no NCCL call is in progress,
    /// otherwise by the owner as soon as its call returns (and at its next `wait` poll).
    fn request_abort(&self, reason: &str) {
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

/// An element type NCCL moves for us.
trait Elem: DeviceRepr + ValidAsZeroBits + Copy + Default + Send + Sync + 'static {
    const DT: sys::ncclDataType_t;
    const BYTES: u64;
    fn slots(s: &mut Staging) -> &mut Slots<Self>;
}

/// A pair of staging buffers, grown on demand and kept between calls.
struct Slots<T: DeviceRepr> {
    a: Option<Buf<T>>,
    b: Option<Buf<T>>,
}

impl<T: DeviceRepr> Default for Slots<T> {
    fn default() -> Self {
        Slots { a: None, b: None }
    }
}

#[derive(Default)]
struct Staging {
    f32s: Slots<f32>,
    f64s: Slots<f64>,
    u64s: Slots<u64>,
}

impl Elem for f32 {
    const DT: sys::ncclDataType_t = sys::ncclDataType_t::ncclFloat32;
    const BYTES: u64 = 4;
    fn slots(s: &mut Staging) -> &mut Slots<Self> {
        &mut s.f32s
    }
}

impl Elem for f64 {
    const DT: sys::ncclDataType_t = sys::ncclDataType_t::ncclFloat64;
    const BYTES: u64 = 8;
    fn slots(s: &mut Staging) -> &mut Slots<Self> {
        &mut s.f64s
    }
}

impl Elem for u64 {
    const DT: sys::ncclDataType_t = sys::ncclDataType_t::ncclUint64;
    const BYTES: u64 = 8;
    fn slots(s: &mut Staging) -> &mut Slots<Self> {
        &mut s.u64s
    }
}

/// A device pointer as NCCL's `void*`.
fn vp<T>(p: DPtr<T>) -> *mut c_void {
    p.raw as *mut c_void
}

fn cu(stream: &CudaStream) -> sys::cudaStream_t {
    stream.cu_stream() as sys::cudaStream_t
}

/// The host collectives, named as in every backend.
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

/// One rank's handle on an NCCL communicator over its GPU.
pub struct NcclComm {
    gpu: Arc<Gpu>,
    rank: usize,
    world: usize,
    shared: Arc<Shared>,
    timeout_ms: u64,
    stats: CommStats,
    staging: Staging,
    /// Point-to-point messages received ahead of their `recv` (other tag) or sent to oneself.
    mail: HashMap<(usize, u64), VecDeque<Vec<f32>>>,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm").field("rank", &self.rank).field("world", &self.world).field("gpu", &self.gpu.ordinal).finish()
    }
}

impl NcclComm {
    /// Joins communicator `id` as `rank` of `world` on `gpu` (`ncclCommInitRank`; blocks until
    /// every rank has joined), then runs one 1-element all-reduce so the group is connected.
    /// Host waits are bounded by [`DEFAULT_TIMEOUT_MS`] until [`Collective::set_timeout_ms`].
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

    fn bind(&self) -> Result<(), NcclError> {
        self.gpu.ctx.bind_to_thread().map_err(tessera_kernels::cuda::drv(format!("making GPU {}'s context current", self.gpu.ordinal)))?;
        Ok(())
    }

    /// Runs `f` (NCCL enqueue calls) on the live communicator.
    fn enqueue(&self, op: &'static str, f: impl FnOnce(sys::ncclComm_t) -> sys::ncclResult_t) -> Result<(), NcclError> {
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

    fn all_gather_raw<T>(
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

    fn all_reduce_raw<T>(&self, op: &'static str, buf: DPtr<T>, dt: sys::ncclDataType_t, stream: &CudaStream) -> Result<(), NcclError> {
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

    fn broadcast_raw<T>(
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
    fn grouped_p2p<T: Elem>(
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

    // ---- the host (Collective) path ----

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

    /// A staging buffer of `n` elements (slot `b` when `second`).
    fn stage<T: Elem>(&mut self, n: usize, second: bool) -> Result<DPtr<T>, NcclError> {
        let slots = T::slots(&mut self.staging);
        let slot = if second { &mut slots.b } else { &mut slots.a };
        if slot.as_ref().is_none_or(|b| b.len() < n) {
            *slot = None;
            *slot = Some(self.gpu.alloc::<T>(n)?);
        }
        Ok(slot.as_ref().expect("allocated above").slice(0..n))
    }

    /// Host → device on the compute stream (the host slice may be reused on return: pageable
    /// copies are staged by the driver).
    fn htod<T: Elem>(&self, dst: DPtr<T>, src: &[T]) -> Result<(), NcclError> {
        assert_eq!(dst.len, src.len(), "staging copy of {} elements into {}", src.len(), dst.len);
        if src.is_empty() {
            return Ok(());
        }
        // SAFETY: `dst` covers `src.len()` elements of a live staging buffer.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst.raw, src, self.gpu.stream.cu_stream()) }
            .map_err(tessera_kernels::cuda::drv("copying host → device for NCCL"))?;
        Ok(())
    }

    /// Device → host once the stream has been waited for.
    fn dtoh<T: Elem>(&self, dst: &mut [T], src: DPtr<T>) -> Result<(), NcclError> {
        assert_eq!(dst.len(), src.len, "staging copy of {} elements into {}", src.len, dst.len());
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: `src` covers `dst.len()` elements; the stream that wrote it has completed.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(dst, src.raw) }
            .map_err(tessera_kernels::cuda::drv("copying device → host for NCCL"))?;
        Ok(())
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
    fn ids_round_trip_through_hex() {
        let mut raw = [0 as std::ffi::c_char; 128];
        raw.iter_mut().enumerate().for_each(|(i, c)| *c = (i as u8).wrapping_mul(37) as std::ffi::c_char);
        let id = NcclId(cudarc::nccl::Id::uninit(raw));
        let hex = id.to_hex();
        assert_eq!(hex.len(), 256);
        assert_eq!(NcclId::from_hex(&format!(" {hex}\n")).unwrap(), id);
        assert!(NcclId::from_hex(&hex[..254]).unwrap_err().to_string().contains("256 hex digits"));
        let bad = format!("zz{}", &hex[2..]);
        assert!(NcclId::from_hex(&bad).unwrap_err().to_string().contains("`zz` at position 0"));
    }

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
    fn errors_map_to_collective_errors() {
        let t: CollectiveError = NcclError::Timeout { op: "all_gather", rank: 1, waited_ms: 5 }.into();
        assert_eq!(t, CollectiveError::Timeout { op: "all_gather", rank: 1, waited_ms: 5 });
        let m: CollectiveError = NcclError::Mismatch { op: "broadcast", rank: 0, detail: "x".into() }.into();
        assert_eq!(m, CollectiveError::Mismatch { op: "broadcast", detail: "x".into() });
        let l: CollectiveError = NcclError::Library.into();
        assert!(matches!(l, CollectiveError::Aborted { reason, .. } if reason.starts_with(LIBRARY_MISSING)));
    }

    #[test]
    fn op_codes_round_trip() {
        for op in Op::ALL {
            assert_eq!(Op::name_of_code(op as u64), op.name());
        }
        assert_eq!(Op::name_of_code(Op::ALL.len() as u64), "an unknown operation");
    }
}
