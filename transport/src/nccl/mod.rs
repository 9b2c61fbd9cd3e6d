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
//!
//! # Files
//!
//! `id.rs` the rendezvous id; `device.rs` the communicator and its device-buffer operations,
//! the bounded wait and aborts; `staging.rs` the staging buffers and copies of the host path;
//! `host.rs` the [`Collective`] implementation (descriptor exchange, rank-order host sums,
//! point-to-point); `error.rs` [`NcclError`] and reading NCCL's result codes.
//!
//! [`Collective`]: crate::collective::Collective
//! [`Collective::abort_handle`]: crate::collective::Collective::abort_handle
//! [`Collective::barrier`]: crate::collective::Collective::barrier
//! [`CollectiveError::Mismatch`]: crate::collective::CollectiveError::Mismatch
//! [`CommStats`]: crate::collective::CommStats

mod device;
mod error;
mod host;
mod id;
mod staging;

pub use device::NcclComm;
pub use error::{NcclError, LIBRARY_MISSING};
pub use id::NcclId;
