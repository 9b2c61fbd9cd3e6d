//! A rank of a ZeRO data-parallel run: [`ZeroWorker`] is the compute a `DeviceWorker` actor
//! drives. It computes its micro-batches, sends their gradients to the partition owners as the
//! backward produces them (who combine them with the fixed micro-batch tree), and on commit
//! applies the optimizer to the fp32 masters it owns and shares the new parameters.
//!
//! What each stage keeps per rank (Ψ parameters, N ranks, 16-bit storage):
//!
//! | stage | parameters | gradients | fp32 master + moments |
//! |---|---|---|---|
//! | 0 | Ψ, every rank | Ψ (all-reduced) | Ψ (every rank steps everything) |
//! | 1 | Ψ | Ψ (all-reduced) | Ψ/N (own partition), then all-gather parameters |
//! | 2 | Ψ | Ψ/N (reduce-scattered) | Ψ/N, then all-gather parameters |
//! | 3 | Ψ/N (gathered unit by unit for compute, released after) | Ψ/N | Ψ/N |
//!
//! Stage 3 keeps *persistent* units (smaller than `stage3_param_persistence_threshold`) whole on
//! every rank besides its shard: they are never gathered, their optimizer state stays
//! partitioned, and the commit all-gathers their new values.
//!
//! Gradients reach their owners in all-to-alls of fixed buckets of at most `reduce_bucket_size`
//! elements, each sent as soon as the backward has finished every unit it covers (units finish
//! from the end of the flat buffer towards its start). Stages 2–3 send every micro-batch's
//! gradient (as DeepSpeed's ZeRO-2 reduces at every micro-step), so a rank holds a unit's
//! gradient only from its backward until its buckets leave, never a full-length one unless the
//! bucket is that large; the owner combines each sender's micro-batches with the block's tree.
//! Stages 0–1, whose gradients are full-length anyway, add each unit's gradient to the unit's
//! block tree and send the block's sum with its last micro-batch. Collectives run in one
//! ordered lane per rank ([`super::lane`]): on a communication thread with `overlap_comm` (the
//! exchanges then run while the backward goes on) or stage-3 prefetch (`stage3_prefetch_bucket_size`:
//! the next units' gathers are queued ahead of use, [`gather_schedule`]). The tree is
//! elementwise, so neither bucketing, nor unit-by-unit sending, nor overlap changes a bit.
//!
//! Numerics are the same for every stage and world size: a leaf (one micro-batch's gradient) and
//! every node of the tree are rounded to the storage type; the final gradient is unscaled,
//! clipped by the global norm (block-aligned partials, see `tessera_kernels::optim::norm`) and
//! rounded again. Transient memory (activations, the gradients in flight, the gathered units) is
//! not part of the model states above.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rayon::prelude::*;
use tessera_actors::compute::{ComputeError, MemoryReport, PhaseTimes, Prepared, StepOrder, WorkerCompute};
use tessera_kernels::dtype::{round_to, DType};
use tessera_kernels::model::UnitAccess;
#[cfg(test)]
use tessera_kernels::model::Workspace;
use tessera_kernels::optim::{clip_coefficient, LocalReduce, LossScaler, NormAllReduce, StepContext, StepOutcome};
use tessera_transport::collective::{Collective, CollectiveError};
use tessera_transport::tree::TreeSum;

use super::device::Device;
use super::lane::{Lane, Ticket};
use super::plan::{Plan, UnitEvent};
use super::replica::{self, FeedConfig, StepRecord, Update};
use super::store::{Store, PAR_CHUNK, PAR_MIN};
use crate::data::Sampler;
use crate::offload::{self, AioOptions, AlignedBuf, Masters, OptimState, SwapFile, Tier};

/// The persistent state of one rank: what a checkpoint saves and memory accounting counts.
pub struct RankState {
    /// Working parameters in the storage type: the whole buffer, or in stage 3 `ranges[r]`
    /// plus the persistent units (`Plan::param_ranges`).
    pub params: ParamStore,
    /// Reduced gradients in the storage type: the whole buffer (stages 0–1) or `ranges[r]`.
    pub grads: Store,
    /// fp32 masters of `plan.optim_range(r)`, in the tier `offload_optimizer` names.
    pub master: Masters,
    /// Optimizer moments of the same range, in the same tier.
    pub optim: OptimState,
    /// Whether `offload_param` keeps the stage-3 parameter shard out of the device budget.
    pub params_offloaded: bool,
    /// Bytes of the masters and moments out of the device budget (`Plan::offloaded_optim_bytes`).
    pub optim_offloaded: u64,
    /// An NVMe swap file that could not be set up at start (the states then stay in memory and
    /// the rank reports this before its first step).
    pub offload_error: Option<String>,
    pub scaler: Option<LossScaler>,
    /// Optimizer steps applied (the LR schedule's clock) and steps skipped on overflow.
    pub applied: u64,
    pub skipped: u64,
    /// Bytes this rank has sent through collectives so far (prepare and commit), for the
    /// driver's per-step communication figures.
    pub bytes_sent_total: u64,
    /// Collective operations this rank has completed so far (prepare and commit).
    pub ops_total: u64,
}

/// Working parameters of one rank: disjoint flat ranges of the buffer, each held in memory
/// (packed in order in one `Store`, so its bytes are the bytes really held) or, with
/// `offload_param.device = nvme`, the stage-3 shard's ranges in a swap file.
pub struct ParamStore {
    /// (flat range, where it is held), sorted by flat start.
    segs: Vec<(Range<usize>, Held)>,
    store: Store,
    swap: Option<ParamSwap>,
    /// Bytes of the stage-3 shard among them (what `offload_param` moves out of the budget).
    pub shard_bytes: u64,
}

#[derive(Clone, Copy, Debug)]
enum Held {
    /// At this offset of `store`.
    Memory(usize),
    /// At this element offset of the swap file.
    Swap(usize),
}

/// A swap file of parameters in the storage type (little-endian f32, bf16 or fp16 bits), read
/// and written through block-aligned buffers (O_DIRECT where the filesystem allows).
struct ParamSwap {
    file: SwapFile,
    dtype: DType,
    elems: usize,
}

impl ParamSwap {
    fn elem_bytes(&self) -> usize {
        self.dtype.size_bytes()
    }

    /// The block-aligned byte window covering elements `start..start + len`, and the offset of
    /// element `start` inside it.
    fn window(&self, start: usize, len: usize) -> (u64, usize, usize) {
        let (es, block) = (self.elem_bytes(), self.file.block());
        let (b0, b1) = (start * es, (start + len) * es);
        let a0 = b0 / block * block;
        let a1 = b1.div_ceil(block) * block;
        (a0 as u64, a1 - a0, b0 - a0)
    }

    fn io_error(&self, what: &str, off: u64, e: std::io::Error) -> String {
        format!("{what} parameter swap file {} at byte {off}: {e}", self.file.path().display())
    }

    fn read(&self, start: usize, out: &mut [f32]) -> Result<(), String> {
        let (off, len, skip) = self.window(start, out.len());
        let mut buf = AlignedBuf::new(len, self.file.block());
        self.file.read_at(off, &mut buf, len).map_err(|e| self.io_error("reading", off, e))?;
        decode(self.dtype, &buf.bytes()[skip..skip + out.len() * self.elem_bytes()], out);
        Ok(())
    }

    fn write(&self, start: usize, src: &[f32]) -> Result<(), String> {
        let (off, len, skip) = self.window(start, src.len());
        let block = self.file.block();
        let mut buf = AlignedBuf::new(len, block);
        let end = skip + src.len() * self.elem_bytes();
        // Partial first and last blocks keep their other elements: read them first.
        if skip != 0 {
            self.read_block(off, &mut buf, 0)?;
        }
        if end % block != 0 && (end / block != 0 || skip == 0) {
            self.read_block(off, &mut buf, end / block * block)?;
        }
        encode(self.dtype, src, &mut buf.bytes_mut()[skip..end]);
        self.file.write_at(off, &mut buf, len).map_err(|e| self.io_error("writing", off, e))
    }

    /// Reads the block at byte `at` of the window starting at `off` into the same place of `buf`.
    fn read_block(&self, off: u64, buf: &mut AlignedBuf, at: usize) -> Result<(), String> {
        let block = self.file.block();
        let mut one = AlignedBuf::new(block, block);
        let pos = off + at as u64;
        self.file.read_at(pos, &mut one, block).map_err(|e| self.io_error("reading", pos, e))?;
        buf.bytes_mut()[at..at + block].copy_from_slice(one.bytes());
        Ok(())
    }
}

/// Little-endian values of the storage type → f32 (on the thread pool from `PAR_MIN` values).
fn decode(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    let size = dtype.size_bytes();
    if out.len() >= PAR_MIN {
        // Element by element, so the chunking cannot change a bit.
        out.par_chunks_mut(PAR_CHUNK).zip(bytes.par_chunks(PAR_CHUNK * size)).for_each(|(o, b)| decode_serial(dtype, b, o));
        return;
    }
    decode_serial(dtype, bytes, out);
}

/// [`decode`] on one thread.
fn decode_serial(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    match dtype {
        DType::F32 => out.iter_mut().zip(bytes.chunks_exact(4)).for_each(|(o, b)| *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        DType::BF16 => out.iter_mut().zip(bytes.chunks_exact(2)).for_each(|(o, b)| *o = half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        DType::F16 => out.iter_mut().zip(bytes.chunks_exact(2)).for_each(|(o, b)| *o = half::f16::from_le_bytes([b[0], b[1]]).to_f32()),
    }
}

/// f32 → little-endian values of the storage type, rounded like `Store::write`.
fn encode(dtype: DType, src: &[f32], bytes: &mut [u8]) {
    let size = dtype.size_bytes();
    if src.len() >= PAR_MIN {
        bytes.par_chunks_mut(PAR_CHUNK * size).zip(src.par_chunks(PAR_CHUNK)).for_each(|(b, x)| encode_serial(dtype, x, b));
        return;
    }
    encode_serial(dtype, src, bytes);
}

/// [`encode`] on one thread.
fn encode_serial(dtype: DType, src: &[f32], bytes: &mut [u8]) {
    match dtype {
        DType::F32 => bytes.chunks_exact_mut(4).zip(src).for_each(|(b, x)| b.copy_from_slice(&x.to_le_bytes())),
        DType::BF16 => bytes.chunks_exact_mut(2).zip(src).for_each(|(b, x)| b.copy_from_slice(&half::bf16::from_f32(*x).to_le_bytes())),
        DType::F16 => bytes.chunks_exact_mut(2).zip(src).for_each(|(b, x)| b.copy_from_slice(&half::f16::from_f32(*x).to_le_bytes())),
    }
}

impl ParamStore {
    /// Holds `ranges` (sorted, disjoint) of `full` in memory, rounded to `dtype`.
    pub fn new(dtype: DType, ranges: &[Range<usize>], full: &[f32]) -> ParamStore {
        let segs: Vec<(Range<usize>, bool)> = ranges.iter().map(|r| (r.clone(), false)).collect();
        Self::build(dtype, &segs, full, None).unwrap_or_else(|e| unreachable!("memory-only store: {e}"))
    }

    /// Holds `memory` in memory and `swapped` in a new swap file at `path` (both sorted,
    /// disjoint, not overlapping each other), rounded to `dtype`. Fails naming the file.
    fn with_swap(
        dtype: DType,
        memory: &[Range<usize>],
        swapped: &[Range<usize>],
        full: &[f32],
        path: std::path::PathBuf,
        aio: &AioOptions,
    ) -> Result<ParamStore, String> {
        let elems: usize = swapped.iter().map(Range::len).sum();
        let bytes = (elems * dtype.size_bytes()) as u64;
        let file = SwapFile::create(path.clone(), bytes, aio)
            .map_err(|e| format!("creating parameter swap file {} ({bytes} bytes): {e}", path.display()))?;
        let mut segs: Vec<(Range<usize>, bool)> =
            memory.iter().map(|r| (r.clone(), false)).chain(swapped.iter().map(|r| (r.clone(), true))).collect();
        segs.sort_by_key(|(r, _)| r.start);
        Self::build(dtype, &segs, full, Some(ParamSwap { file, dtype, elems }))
    }

    fn build(dtype: DType, ranges: &[(Range<usize>, bool)], full: &[f32], swap: Option<ParamSwap>) -> Result<ParamStore, String> {
        let (mut mem, mut sw) = (0, 0);
        let segs: Vec<(Range<usize>, Held)> = ranges
            .iter()
            .map(|(r, swapped)| {
                let held = if *swapped { Held::Swap(sw) } else { Held::Memory(mem) };
                *(if *swapped { &mut sw } else { &mut mem }) += r.len();
                (r.clone(), held)
            })
            .collect();
        let mut p = ParamStore { segs, store: Store::zeros(dtype, mem), swap, shard_bytes: 0 };
        for (r, _) in ranges {
            p.write(r.start, &full[r.clone()])?;
        }
        Ok(p)
    }

    /// Bytes held, in memory and in the swap file.
    pub fn bytes(&self) -> u64 {
        self.store.bytes() + self.swap.as_ref().map_or(0, |s| (s.elems * s.elem_bytes()) as u64)
    }

    /// Bytes held in the swap file.
    pub fn swapped_bytes(&self) -> u64 {
        self.swap.as_ref().map_or(0, |s| (s.elems * s.elem_bytes()) as u64)
    }

    /// The held pieces covering flat `[start, start + len)`, in order, as (offset into the
    /// caller's slice, length, where held); fails if part of it is not held by this rank.
    fn pieces(&self, start: usize, len: usize) -> Result<Vec<(usize, usize, Held)>, String> {
        let end = start + len;
        let mut out = Vec::new();
        let mut at = start;
        for (r, held) in self.segs.iter().filter(|(r, _)| r.start < end && r.end > start) {
            if r.start > at {
                break;
            }
            let hi = r.end.min(end);
            let inner = at - r.start;
            let h = match *held {
                Held::Memory(o) => Held::Memory(o + inner),
                Held::Swap(o) => Held::Swap(o + inner),
            };
            out.push((at - start, hi - at, h));
            at = hi;
        }
        if at < end {
            return Err(format!("parameters {start}..{end} are not held by this rank"));
        }
        Ok(out)
    }

    /// `out = params[start .. start + out.len()]` (flat indices), widened to f32.
    pub fn read(&self, start: usize, out: &mut [f32]) -> Result<(), String> {
        for (o, n, held) in self.pieces(start, out.len())? {
            match (held, &self.swap) {
                (Held::Memory(off), _) => self.store.read(off, &mut out[o..o + n]),
                (Held::Swap(off), Some(sw)) => sw.read(off, &mut out[o..o + n])?,
                (Held::Swap(_), None) => return Err("a swapped parameter range has no swap file".into()),
            }
        }
        Ok(())
    }

    /// `params[start ..] = src` (flat indices), rounded to the storage type.
    pub fn write(&mut self, start: usize, src: &[f32]) -> Result<(), String> {
        for (o, n, held) in self.pieces(start, src.len())? {
            match (held, &self.swap) {
                (Held::Memory(off), _) => self.store.write(off, &src[o..o + n]),
                (Held::Swap(off), Some(sw)) => sw.write(off, &src[o..o + n])?,
                (Held::Swap(_), None) => return Err("a swapped parameter range has no swap file".into()),
            }
        }
        Ok(())
    }
}

/// Rank `rank`'s working parameters: in memory, or with `offload_param.device = nvme` its
/// stage-3 shard (less the persistent units, which every rank holds whole in memory) in a swap
/// file under `nvme_path`, one per rank, removed when the run ends.
fn param_store(plan: &Plan, rank: usize, full: &[f32]) -> Result<ParamStore, String> {
    let dtype = plan.precision.dtype();
    let held = plan.param_ranges(rank);
    let (Tier::Nvme, Some(dir), 3) = (plan.offload.param, plan.offload.param_dir.as_ref(), plan.stage) else {
        return Ok(ParamStore::new(dtype, &held, full));
    };
    let swapped = plan.param_swap_ranges(rank);
    let memory = super::plan::subtract(&held, &swapped);
    let path = dir.join(format!("tessera-{}-rank{rank}-params.swp", std::process::id()));
    ParamStore::with_swap(dtype, &memory, &swapped, full, path, &plan.offload.aio)
}

/// The part of `r` inside `within`, relative to `within.start` (empty when they do not meet).
fn clamp_to(r: &Range<usize>, within: &Range<usize>) -> Range<usize> {
    let (a, b) = (r.start.clamp(within.start, within.end), r.end.clamp(within.start, within.end));
    a - within.start..b - within.start
}

impl RankState {
    /// A fresh rank from the full initial masters.
    pub fn new(plan: &Plan, rank: usize, full_master: &[f32], scaler: Option<LossScaler>) -> RankState {
        let dtype = plan.precision.dtype();
        let total = plan.total();
        let opt = plan.optim_range(rank);
        let g_len = if plan.stage <= 1 { total } else { plan.ranges[rank].len() };
        let site = offload::state::site(&plan.offload, rank);
        let (master, e1) = Masters::new(full_master[opt.clone()].to_vec(), plan.offload.optimizer, site.as_ref());
        let (optim, e2) = OptimState::new(plan.optimizer, opt.len(), plan.offload.optimizer, site.as_ref());
        let mut e3 = None;
        RankState {
            params: {
                let mut p = match param_store(plan, rank, full_master) {
                    Ok(p) => p,
                    Err(e) => {
                        e3 = Some(e);
                        ParamStore::new(dtype, &plan.param_ranges(rank), full_master)
                    }
                };
                if plan.stage == 3 {
                    p.shard_bytes = (plan.ranges[rank].len() * dtype.size_bytes()) as u64;
                }
                p
            },
            grads: Store::zeros(dtype, g_len),
            master,
            optim,
            params_offloaded: plan.stage == 3 && plan.offload.param != Tier::Device,
            optim_offloaded: plan.offloaded_optim_bytes(rank),
            offload_error: e1.or(e2).or(e3),
            scaler,
            applied: 0,
            skipped: 0,
            bytes_sent_total: 0,
            ops_total: 0,
        }
    }

    /// The model states this rank keeps resident ("device" memory): offloaded parts are not
    /// counted (`Plan::offloaded_bytes` reports them).
    pub fn memory(&self, rank: usize) -> MemoryReport {
        let optim = (self.master.bytes() + self.optim.bytes()).saturating_sub(self.optim_offloaded);
        let shard = if self.params_offloaded { self.params.shard_bytes } else { 0 };
        MemoryReport { rank, param_bytes: self.params.bytes() - shard, grad_bytes: self.grads.bytes(), optim_bytes: optim }
    }
}

fn round_bf16(x: &mut [f32]) {
    round_to(DType::BF16, x)
}
fn round_f16(x: &mut [f32]) {
    round_to(DType::F16, x)
}

/// The tree over micro-batch index, rounding inner nodes to the storage type.
fn tree(dtype: DType) -> TreeSum {
    match dtype {
        DType::F32 => TreeSum::new(),
        DType::BF16 => TreeSum::with_rounding(round_bf16),
        DType::F16 => TreeSum::with_rounding(round_f16),
    }
}

/// Lamb's per-tensor norms summed across ranks; the results are kept for the replicas.
struct CommReduce<'a> {
    lane: &'a mut Lane,
    /// The reduction's failure, with its kind (the kernel is told its words).
    error: Option<ComputeError>,
    results: Vec<Vec<f64>>,
}

impl NormAllReduce for CommReduce<'_> {
    fn all_reduce_sum(&mut self, v: &mut [f64]) -> Result<(), String> {
        match all_reduce_f64(self.lane, "the optimizer's norm all-reduce", v) {
            Ok(()) => {
                self.results.push(v.to_vec());
                Ok(())
            }
            Err(e) => Err(self.error.get_or_insert(e).to_string()),
        }
    }
}

/// The gradient sum of one aligned dyadic block of micro-batches: (first leaf, level, values).
type BlockSum = (usize, u32, Vec<f32>);

/// What `prepare` leaves for `commit`: the reduced, clipped gradient sits in `RankState::grads`.
struct Staged {
    step: u64,
    overflow: bool,
    /// What the ring predecessors sent at the end of prepare (elastic runs): received before
    /// `Prepared` is answered, so once every rank has prepared, every holder has its owners'
    /// updates and a loss during the commit cannot leave a replica behind its owner.
    received: Option<Received>,
}

/// What each ring predecessor sent this rank (nearest first): its encoded step record and its
/// packed gradient (empty for a skipped step).
type Received = Vec<(Vec<f32>, Vec<f32>)>;

/// The replica update exchange in flight.
type Exchange = Ticket<Result<Received, ComputeError>>;

/// A rank feeding its ring successors' replicas of its shard ([`super::replica`]).
struct Feed {
    cfg: FeedConfig,
    /// What the last commit produced for the replicas this rank holds, or why it could not.
    updates: Option<Result<Vec<Update>, String>>,
}

/// What a step's forward/backward left.
struct Computed {
    /// Sum of this rank's micro-batch losses.
    loss: f64,
    /// This rank's reduced range combined by the micro-batch tree, not yet unscaled.
    grad: Vec<f32>,
    /// Seconds spent computing the micro-batches of the slots every rank computes in (without
    /// the waits on its peers), and their number.
    busy_s: f64,
    busy_micro_batches: usize,
    /// Where the time went (the gradient's norm and all-gather are added by the prepare).
    phases: PhaseTimes,
}

/// What the optimizer part of a commit did (for the replicas' step records).
struct StepDone {
    applied: bool,
    lr: f32,
    reductions: Vec<Vec<f64>>,
}

/// One rank's compute.
pub struct ZeroWorker {
    rank: usize,
    plan: Arc<Plan>,
    sampler: Arc<Sampler>,
    lane: Lane,
    state: Arc<Mutex<RankState>>,
    staged: Option<Staged>,
    /// Where this rank's forward and backward run (`tessera.device`).
    dev: Device,
    feed: Option<Feed>,
}

/// Why an optimizer step failed, and what it left.
enum StepFailure {
    /// Nothing of the shard changed (the norm all-reduce failed before any write).
    Untouched(ComputeError),
    /// The shard may be partly stepped: not a usable state.
    Torn(ComputeError),
}

fn lock<T>(state: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere never leaves the state half-written in a way we could repair here;
    // recover the guard and let the transaction protocol discard the step.
    state.lock().unwrap_or_else(|p| p.into_inner())
}

/// `out ← Σ_r out_r` in f64 across the group, through the lane.
fn all_reduce_f64(lane: &mut Lane, what: &'static str, out: &mut [f64]) -> Result<(), ComputeError> {
    let mut v = out.to_vec();
    v = lane.call(what, move |c| c.all_reduce_sum_f64(&mut v).map(|()| v).map_err(ComputeError::from))??;
    out.copy_from_slice(&v);
    Ok(())
}

/// All-gathers `mine` (this rank's `ranges[rank]` part) into a buffer of `len`, through the lane.
fn all_gather(
    lane: &mut Lane,
    what: &'static str,
    mine: Vec<f32>,
    ranges: Vec<Range<usize>>,
    len: usize,
) -> Result<Vec<f32>, ComputeError> {
    lane.call(what, move |c| {
        let mut out = vec![0.0; len];
        c.all_gather(&mine, &ranges, &mut out).map(|()| out).map_err(|e| ComputeError::from(e).context(what))
    })?
}

impl ZeroWorker {
    /// Rank `rank`'s compute over `comm`. Its collectives run on a communication thread when
    /// the plan overlaps communication (`overlap_comm`) or prefetches stage-3 units.
    pub fn new(rank: usize, plan: Arc<Plan>, sampler: Arc<Sampler>, comm: Box<dyn Collective>, state: Arc<Mutex<RankState>>) -> Self {
        let threaded = plan.overlap_comm || (plan.gathers() && plan.prefetch_elems > 0);
        let lane = Lane::new(comm, threaded);
        let dev = Device::new(plan.device);
        ZeroWorker { rank, plan, sampler, lane, state, staged: None, dev, feed: None }
    }

    /// Keeps ring successors' replicas of this rank's shard in step ([`super::replica`]): each
    /// prepared step sends the step record and the final gradient, and each commit turns the
    /// predecessors' into updates ([`ZeroWorker::take_replica_updates`]). Every rank of the
    /// group must do the same.
    pub fn with_replica_feed(mut self, cfg: FeedConfig) -> Self {
        self.feed = (cfg.successors > 0 && self.plan.stage > 0 && self.plan.world > 1).then_some(Feed { cfg, updates: None });
        self
    }

    /// Runs the next steps under `plan`, which may assign other micro-batch blocks (speeds
    /// measured by the driver) but keeps the partition; only at a step boundary.
    pub fn set_plan(&mut self, plan: Arc<Plan>) -> Result<(), String> {
        if let Some(s) = &self.staged {
            return Err(format!("rank {}: new blocks while step {} is prepared", self.rank, s.step));
        }
        if plan.world != self.plan.world || plan.stage != self.plan.stage || plan.ranges != self.plan.ranges {
            return Err(format!("rank {}: a new plan must keep the world, stage and partition", self.rank));
        }
        self.plan = plan;
        Ok(())
    }

    /// The updates of the replicas this rank holds from the last commit (in predecessor order,
    /// nearest first), or why the exchange failed; `None` without a feed or before a commit.
    pub fn take_replica_updates(&mut self) -> Option<Result<Vec<Update>, String>> {
        self.feed.as_mut().and_then(|f| f.updates.take())
    }

    /// Forward/backward of this rank's micro-batches, slot by slot, with their gradients
    /// travelling to the partition owners as the backward produces them.
    fn compute_and_reduce(&mut self, step: u64, scale: f32, params: &ParamStore) -> Result<Computed, ComputeError> {
        let plan = Arc::clone(&self.plan);
        let (mb, t) = (plan.micro, plan.seq_len);
        let dloss = scale / plan.micro_batches as f32;
        let mut inputs = vec![0u32; mb * t];
        let mut targets = vec![0u32; mb * t];
        let leaves = plan.leaves(self.rank);
        let owner = Arc::new(Mutex::new(OwnerSums::new(&plan, self.rank)));
        let ZeroWorker { rank, sampler, lane, dev, .. } = self;
        dev.begin_step();
        let mut acc = StepAccess::new(Arc::clone(&plan), *rank, params, lane, Arc::clone(&owner));
        let mut loss = 0.0f64;
        let mut busy = Duration::ZERO;
        let mut phases = PhaseTimes::default();
        // Slots in which every rank computes: the ones measured (see `Prepared::busy_s`).
        let common = plan.counts().into_iter().min().unwrap_or(0);
        for s in 0..plan.slots() {
            let t0 = Instant::now();
            match leaves.get(s) {
                Some(&i) => {
                    sampler.fill(plan.first_sample(step, i), mb, &mut inputs, &mut targets);
                    acc.begin_slot(s, true);
                    let (t0, waited, grad_waited) = (Instant::now(), acc.waited, acc.grad_waited);
                    match dev.forward_backward(&plan.model, &mut acc, &inputs, &targets, mb, t, dloss, *rank) {
                        Ok(l) => loss += f64::from(l),
                        Err(e) => acc.fail(ComputeError::failed(format!("rank {rank}: {e}"))),
                    }
                    let end = Instant::now();
                    if s < common {
                        busy += (end - t0).saturating_sub(acc.waited.saturating_sub(waited));
                    }
                    let forward = dev.take_loss_instant().unwrap_or(end).saturating_duration_since(t0);
                    let reduce = acc.grad_waited.saturating_sub(grad_waited);
                    phases.forward_s += forward.as_secs_f64();
                    phases.backward_inner_s += (end - t0).saturating_sub(forward + reduce).as_secs_f64();
                    phases.backward_allreduce_s += reduce.as_secs_f64();
                }
                // A rank with fewer micro-batches still serves its shards to the others'
                // gathers and joins their gradient exchanges, with nothing of its own to send.
                None if plan.gathers() || plan.slot_active(s) => {
                    acc.begin_slot(s, false);
                    acc.replay();
                    phases.backward_allreduce_s += t0.elapsed().as_secs_f64();
                }
                None => continue,
            }
            acc.end_slot();
            if acc.error.is_some() {
                break;
            }
        }
        let (error, tickets) = acc.finish();
        // Every queued exchange is waited for, also after an error, so none is left running.
        let tail = Instant::now();
        let mut first_err = error;
        for ticket in tickets {
            if let Err(e) = ticket.wait().and_then(|r| r) {
                first_err.get_or_insert(e);
            }
        }
        phases.backward_allreduce_s += tail.elapsed().as_secs_f64();
        if let Some(e) = first_err {
            return Err(e);
        }
        let sums = std::mem::replace(&mut *lock(&owner), OwnerSums::new(&plan, self.rank));
        let grad = sums.finish(&plan).map_err(ComputeError::failed)?;
        Ok(Computed { loss, grad, busy_s: busy.as_secs_f64(), busy_micro_batches: common, phases })
    }

    /// Unscales, measures the global norm, clips and rounds this rank's reduced range.
    /// Returns (global norm, overflow).
    fn finish_gradient(&mut self, g: &mut [f32], scale: f32, clip: f64) -> Result<(f64, bool), ComputeError> {
        let plan = Arc::clone(&self.plan);
        if scale != 1.0 {
            let inv = 1.0 / scale;
            g.iter_mut().for_each(|x| *x *= inv);
        }
        let mine = plan.ranges[self.rank].clone();
        let mut partials = vec![0.0f64; plan.flat.slots()];
        plan.flat.partial_sumsq(g, mine, &mut partials).map_err(|e| ComputeError::failed(e.to_string()))?;
        all_reduce_f64(&mut self.lane, "the gradient-norm all-reduce", &mut partials)?;
        let norm = plan.flat.global_norm(&partials);
        if !norm.is_finite() {
            return Ok((norm, true));
        }
        if let Some(coef) = clip_coefficient(norm, clip) {
            g.iter_mut().for_each(|x| *x *= coef);
        }
        plan.precision.round(g);
        Ok((norm, false))
    }

    /// Parameters after the optimizer, which has written this rank's new masters (rounded to
    /// the storage type) into its own range of `st.params`: share them as the stage requires.
    fn publish_params(&mut self, st: &mut RankState) -> Result<(), ComputeError> {
        let plan = Arc::clone(&self.plan);
        match plan.stage {
            0 => Ok(()),
            3 => self.share_persistent_units(st),
            _ => {
                let own = plan.ranges[self.rank].clone();
                let mut mine = vec![0.0; own.len()];
                st.params.read(own.start, &mut mine).map_err(ComputeError::failed)?;
                let full = all_gather(&mut self.lane, "the parameter all-gather", mine, plan.ranges.clone(), plan.total())?;
                st.params.write(0, &full).map_err(ComputeError::failed)
            }
        }
    }

    /// Stage 3: every rank's copy of each persistent unit takes the owners' new values.
    fn share_persistent_units(&mut self, st: &mut RankState) -> Result<(), ComputeError> {
        let plan = Arc::clone(&self.plan);
        for (u, unit) in plan.model.units().iter().enumerate().filter(|(u, _)| plan.persistent[*u]) {
            let parts: Vec<Range<usize>> = plan.ranges.iter().map(|r| clamp_to(r, unit)).collect();
            let mine = &parts[self.rank];
            // The owned part of the unit lies inside this rank's shard, whose new values the
            // optimizer has written to the parameters (rounding again changes nothing).
            let mut vals = vec![0.0; mine.len()];
            st.params.read(mine.start + unit.start, &mut vals).map_err(ComputeError::failed)?;
            plan.precision.round(&mut vals);
            let buf = all_gather(&mut self.lane, "sharing a persistent unit", vals, parts, unit.len())
                .map_err(|e| e.context(format!("unit {u}")))?;
            st.params.write(unit.start, &buf).map_err(ComputeError::failed)?;
        }
        Ok(())
    }

    fn prepare_inner(&mut self, order: &StepOrder, st: &mut RankState) -> Result<Prepared, ComputeError> {
        let t0 = Instant::now();
        let before = self.lane.stats()?;
        if let Some(e) = &st.offload_error {
            return Err(ComputeError::failed(format!("rank {}: setting up NVMe offload failed at start: {e}", self.rank)));
        }
        // Copies made for readers between steps (evaluation, checkpoints) go now.
        st.master.release();
        st.optim.release();
        let scale = st.scaler.as_ref().map_or(1.0, LossScaler::scale);
        let Computed { loss: loss_sum, grad: mut g, busy_s, busy_micro_batches, mut phases } =
            self.compute_and_reduce(order.step, scale, &st.params)?;
        let clip = f64::from(self.plan_clip());
        let reduce = Instant::now();
        let (norm, overflow) = self.finish_gradient(&mut g, scale, clip)?;
        let plan = Arc::clone(&self.plan);
        let mut fed = None;
        match plan.stage {
            0 | 1 => {
                let full = all_gather(&mut self.lane, "the gradient all-gather", g, plan.ranges.clone(), plan.total())?;
                st.grads.write(0, &full);
            }
            _ => {
                st.grads.write(0, &g);
                // The f32 store now holds exactly `g`: the replicas' feed sends `g` itself.
                if matches!(st.grads, Store::F32(_)) {
                    fed = Some(g);
                }
            }
        }
        phases.backward_allreduce_s += reduce.elapsed().as_secs_f64();
        let after = self.lane.stats()?;
        (st.bytes_sent_total, st.ops_total) = (after.bytes_sent, after.ops);
        // Queued last (after the counters) and waited for here: `Prepared` means this rank holds
        // its owners' updates. A loss before that fails the prepare (the step is abandoned and
        // every shard stays at `step`); a loss after it, while the step commits, leaves every
        // shard able to reach `step + 1` — the survivors' own, and the lost owner's replica.
        let received = match self.feed.as_ref().map(|f| f.cfg) {
            Some(cfg) => {
                let exchange = self.send_replica_update(cfg, order.step, st, overflow, fed);
                let t0 = Instant::now();
                let got = exchange.wait().and_then(|r| r)?;
                if super::elastic::tracing() {
                    let ms = t0.elapsed().as_secs_f64() * 1e3;
                    eprintln!("[feed] rank {}: step {}'s replica updates waited for {ms:.2} ms in prepare", self.rank, order.step);
                }
                Some(got)
            }
            None => None,
        };
        self.staged = Some(Staged { step: order.step, overflow, received });
        Ok(Prepared {
            loss_sum,
            micro_batches: plan.leaves(self.rank).len(),
            grad_norm: Some(norm),
            overflow,
            bytes_sent: after.bytes_sent - before.bytes_sent,
            bytes_received: after.bytes_received - before.bytes_received,
            compute_s: t0.elapsed().as_secs_f64(),
            busy_s,
            busy_micro_batches,
            phases,
        })
    }

    /// A commit's error says what the shard reached (the trait's promise): one before the
    /// optimizer changed anything (a staged step that is not `step`, LAMB's norm all-reduce with
    /// a lost peer) is not torn, the shard is still at `step` (and its replicas on the
    /// successors too, no update was made); one in the middle of the optimizer step is torn
    /// with nothing stepped; one after it (the replicas' updates are made, then the parameters'
    /// all-gather fails on a lost peer) is torn with `stepped = Some(step)`: the shard is a
    /// consistent state at `step + 1` and the replica updates are there.
    fn commit_inner(&mut self, step: u64, st: &mut RankState) -> Result<(), ComputeError> {
        let staged = match self.staged.take() {
            Some(s) if s.step == step => s,
            other => {
                let staged = other.map(|s| s.step);
                return Err(ComputeError::failed(format!("rank {}: commit of step {step} but staged {staged:?}", self.rank)));
            }
        };
        let done = match self.optimizer_step(staged.overflow, st) {
            Ok(done) => done,
            Err(StepFailure::Untouched(e)) => return Err(e),
            Err(StepFailure::Torn(e)) => return Err(e.torn(None)),
        };
        // The shard is at `step + 1` now; what follows (the replicas' updates, the parameters'
        // all-gather) may fail on a lost peer without making it unusable.
        self.after_step(step, st, staged, done).map_err(|e| e.torn(Some(step)))
    }

    /// The rest of a commit once the shard took the optimizer step: the replicas' updates and
    /// the new parameters' sharing.
    fn after_step(&mut self, step: u64, st: &mut RankState, staged: Staged, done: StepDone) -> Result<(), ComputeError> {
        let applied = done.applied;
        if let Some(received) = staged.received {
            let updates = self.finish_replica_updates(step, received, done);
            if let Some(f) = self.feed.as_mut() {
                f.updates = Some(updates);
            }
        }
        if applied {
            self.publish_params(st)?;
        }
        let stats = self.lane.stats()?;
        (st.bytes_sent_total, st.ops_total) = (stats.bytes_sent, stats.ops);
        Ok(())
    }

    /// The optimizer part of a commit: the loss scaler's decision and the step on this rank's
    /// masters and optimizer state (the new parameters of its own range are written locally;
    /// the caller shares them as the stage requires). A failed norm all-reduce (LAMB at stage
    /// ≥ 1, a peer lost) comes back as `Untouched`: the kernel writes nothing before the
    /// reduction succeeds and the scaler's decision is kept only after the step, so the shard
    /// is still exactly its state before the step.
    fn optimizer_step(&mut self, overflow: bool, st: &mut RankState) -> Result<StepDone, StepFailure> {
        let lr = self.lr_at(st.applied);
        let skipped = StepDone { applied: false, lr, reductions: Vec::new() };
        let mut scaler = st.scaler.clone();
        if let Some(sc) = scaler.as_mut() {
            if let StepOutcome::SkippedOverflow { .. } =
                sc.update(overflow).map_err(|e| StepFailure::Torn(ComputeError::failed(e.to_string())))?
            {
                st.scaler = scaler;
                st.skipped += 1;
                return Ok(skipped);
            }
        } else if overflow {
            st.skipped += 1;
            return Ok(skipped);
        }
        let plan = Arc::clone(&self.plan);
        let range = plan.optim_range(self.rank);
        let mut g = vec![0.0; range.len()];
        match plan.stage {
            0 | 1 => st.grads.read(range.start, &mut g),
            _ => st.grads.read(0, &mut g),
        }
        let start = range.start;
        let ctx = StepContext { shard_range: range, layout: &plan.flat, decay: &plan.decay };
        let RankState { master, optim, params, .. } = st;
        let mut publish = |off: usize, vals: &[f32]| params.write(start + off, vals);
        let mut reductions = Vec::new();
        if plan.stage == 0 {
            optim.step(master, &g, lr, &ctx, &mut LocalReduce, &mut publish).map_err(|e| StepFailure::Torn(ComputeError::failed(e)))?;
        } else {
            let mut reducer = CommReduce { lane: &mut self.lane, error: None, results: Vec::new() };
            let res = optim.step(master, &g, lr, &ctx, &mut reducer, &mut publish);
            if let Some(e) = reducer.error {
                return Err(StepFailure::Untouched(e));
            }
            res.map_err(|e| StepFailure::Torn(ComputeError::failed(e)))?;
            reductions = reducer.results;
        }
        st.scaler = scaler;
        st.applied += 1;
        Ok(StepDone { applied: true, lr, reductions })
    }

    /// End of prepare: queues the messages that send this rank's successors its step record and
    /// its final gradient (exactly what the optimizer will read; nothing for a step skipped on
    /// overflow), then receive its predecessors'. Everything in the record is known now: the
    /// step is skipped exactly when the gradient overflowed, the learning rate follows the
    /// applied steps, and the digest (when due) is of the state the step starts from; only
    /// LAMB's reduced norms come later.
    ///
    /// Point-to-point messages, not an all-to-all: a send is delivered into the successor's
    /// mailbox whether or not it is receiving yet (both transports file point-to-point messages
    /// as they arrive), so no rank waits for the whole group to finish its prepare before its
    /// gradient travels, and every send precedes every receive, so a ring of them cannot
    /// deadlock. `fed` is the gradient itself when the store holds it unchanged (f32 at stage
    /// 2/3): sent from where it lies, without packing a copy.
    fn send_replica_update(&mut self, cfg: FeedConfig, step: u64, st: &RankState, overflow: bool, fed: Option<Vec<f32>>) -> Exchange {
        let range = self.plan.optim_range(self.rank);
        let local = if self.plan.stage <= 1 { range } else { 0..range.len() };
        let record = StepRecord {
            step,
            applied: !overflow,
            lr: self.lr_at(st.applied),
            optimizer_steps: st.optim.step_count() + u64::from(!overflow),
            digest: cfg.digest_due(step).then(|| replica::shard_digest(&st.master, &st.optim.state_buffers())),
        };
        let rec = record.encode();
        let grad = match (overflow, fed) {
            (true, _) => Vec::new(),
            (false, Some(g)) if g.len() == local.len() => g,
            (false, _) => {
                let mut out = Vec::with_capacity(replica::packed_len(self.plan.precision.dtype(), local.len()));
                replica::pack_gradient(&st.grads, local, &mut out);
                out
            }
        };
        let (succ, pred) = (cfg.successors_of(self.rank, self.plan.world), cfg.predecessors_of(self.rank, self.plan.world));
        let tag = replica::feed_tag(step);
        self.lane.submit("the replica update exchange", move |c| {
            let fail = |what: &str, peer: usize, e: CollectiveError| {
                ComputeError::from(e).context(format!("the replica update exchange: {what} rank {peer}"))
            };
            for &to in &succ {
                c.send(to, tag, &rec).map_err(|e| fail("sending the step record to", to, e))?;
                c.send(to, tag, &grad).map_err(|e| fail("sending the gradient to", to, e))?;
            }
            drop(grad);
            pred.iter()
                .map(|&from| {
                    let r = c.recv(from, tag).map_err(|e| fail("receiving the step record of", from, e))?;
                    let g = c.recv(from, tag).map_err(|e| fail("receiving the gradient of", from, e))?;
                    Ok((r, g))
                })
                .collect()
        })
    }

    /// End of commit: turns what the predecessors sent at the end of prepare into their
    /// replicas' updates, after checking the records against what this commit did (every
    /// rank takes the same decision). LAMB's replicas replay this rank's own norm reductions:
    /// the all-reduce gave every rank the same bits (each slot has one non-zero contributor, so
    /// its sum is exact in any order), so no further message is needed, and an owner lost
    /// after the reduction still has its replica stepped.
    fn finish_replica_updates(&mut self, step: u64, got: Received, done: StepDone) -> Result<Vec<Update>, String> {
        let cfg = self.feed.as_ref().map(|f| f.cfg).ok_or("no replica feed")?;
        let (rank, world) = (self.rank, self.plan.world);
        let preds = cfg.predecessors_of(rank, world);
        if got.len() != preds.len() {
            return Err(format!("the replica update exchange returned {} updates for {} predecessors", got.len(), preds.len()));
        }
        let dtype = self.plan.precision.dtype();
        let mut updates = Vec::new();
        for (owner, (rec, words)) in preds.into_iter().zip(got) {
            let record = StepRecord::decode(&rec).map_err(|e| format!("rank {owner}: {e}"))?;
            if record.step != step || record.applied != done.applied || record.lr.to_bits() != done.lr.to_bits() {
                return Err(format!(
                    "rank {owner}'s record (step {}, applied {}, lr {}) disagrees with this rank's commit (step {step}, applied {}, lr {})",
                    record.step, record.applied, record.lr, done.applied, done.lr
                ));
            }
            let grad = match record.applied {
                true => {
                    replica::unpack_gradient(dtype, words, self.plan.optim_range(owner).len()).map_err(|e| format!("rank {owner}: {e}"))?
                }
                false => Vec::new(),
            };
            updates.push(Update { owner, grad, record, reductions: done.reductions.clone() });
        }
        Ok(updates)
    }
}

impl WorkerCompute for ZeroWorker {
    fn prepare(&mut self, order: &StepOrder) -> Result<Prepared, ComputeError> {
        let state = Arc::clone(&self.state);
        let mut st = lock(&state);
        let res = self.prepare_inner(order, &mut st);
        if res.is_err() {
            // Nothing this step queued may still be running when the error is reported.
            let _ = self.lane.drain();
        }
        res
    }

    fn commit(&mut self, step: u64) -> Result<(), ComputeError> {
        let state = Arc::clone(&self.state);
        let mut st = lock(&state);
        self.commit_inner(step, &mut st)
    }

    fn abandon(&mut self, _step: u64) {
        self.staged = None;
    }

    fn memory(&self) -> MemoryReport {
        lock(&self.state).memory(self.rank)
    }
}

/// Config values the worker needs at step time, kept in the plan's terms.
impl ZeroWorker {
    fn plan_clip(&self) -> f32 {
        self.plan.clip
    }

    fn lr_at(&self, applied: u64) -> f32 {
        self.plan.schedule.as_ref().map_or(self.plan.base_lr, |s| crate::schedule::lr_at(s, self.plan.base_lr, applied))
    }
}

/// The owner's side of the gradient exchange: what each sender sent for this rank's range in
/// the current slot, each sender's current block (stages 2–3 receive it micro-batch by
/// micro-batch and combine it with the block's tree), and the finished block sums. Updated by
/// the exchange jobs on the communication lane, in slot order.
struct OwnerSums {
    mine: Range<usize>,
    dtype: DType,
    current: Vec<Option<Vec<f32>>>,
    blocks: Vec<Option<TreeSum>>,
    done: Vec<BlockSum>,
}

impl OwnerSums {
    fn new(plan: &Plan, rank: usize) -> Self {
        let w = plan.world;
        OwnerSums {
            mine: plan.ranges[rank].clone(),
            dtype: plan.precision.dtype(),
            current: vec![None; w],
            blocks: (0..w).map(|_| None).collect(),
            done: Vec::new(),
        }
    }

    /// One bucket's all-to-all of slot `slot` arrived (`got[r]` from rank `r`); `last` marks the
    /// slot's final bucket, after which every sender's values for this range are complete.
    fn receive(&mut self, plan: &Plan, slot: usize, bucket: &Range<usize>, got: Vec<Vec<f32>>, last: bool) -> Result<(), String> {
        let part = clamp_to(bucket, &self.mine);
        for (r, data) in got.into_iter().enumerate() {
            let want = if plan.slot_send(r, slot).is_some() { part.len() } else { 0 };
            if data.len() != want {
                return Err(format!(
                    "rank {r} sent {} gradient values for flat {}..{} in slot {slot}, expected {want}",
                    data.len(),
                    bucket.start,
                    bucket.end
                ));
            }
            if want > 0 {
                let buf = self.current[r].get_or_insert_with(|| vec![0.0; self.mine.len()]);
                buf[part.clone()].copy_from_slice(&data);
            }
        }
        if !last {
            return Ok(());
        }
        for r in 0..plan.world {
            let Some(send) = plan.slot_send(r, slot) else { continue };
            let vals = self.current[r].take().unwrap_or_else(|| vec![0.0; self.mine.len()]);
            let (first, level) = send.block;
            if send.block_sum {
                self.done.push((first, level, vals));
                continue;
            }
            if send.leaf == first {
                self.blocks[r] = Some(tree(self.dtype));
            }
            let t =
                self.blocks[r].as_mut().ok_or_else(|| format!("rank {r}'s micro-batch {} arrived before its block began", send.leaf))?;
            t.push_block(send.leaf - first, 0, vals).map_err(|e| e.to_string())?;
            if send.leaf + 1 == (first + (1 << level)).min(plan.micro_batches) {
                let sum = self.blocks[r].take().and_then(TreeSum::finish).ok_or("empty micro-batch block")?;
                self.done.push((first, level, sum));
            }
        }
        Ok(())
    }

    /// The blocks combined by the micro-batch tree, in leaf order.
    fn finish(mut self, plan: &Plan) -> Result<Vec<f32>, String> {
        self.done.sort_by_key(|&(first, _, _)| first);
        let covered: usize = self.done.iter().map(|&(first, level, _)| (first + (1 << level)).min(plan.micro_batches) - first).sum();
        if covered != plan.micro_batches {
            return Err(format!("the gradient sums received cover {covered} of {} micro-batches", plan.micro_batches));
        }
        let mut t = tree(self.dtype);
        for (first, level, data) in self.done {
            t.push_block(first, level, data).map_err(|e| e.to_string())?;
        }
        Ok(t.finish().unwrap_or_else(|| vec![0.0; self.mine.len()]))
    }
}

/// A step's parameters and gradients as the model sees them ([`UnitAccess`]).
///
/// Parameters: read from this rank's store (stages 0–2, persistent units) or gathered from
/// every rank's shard (stage 3). Of the blocks only the one in use is held; unit 0
/// (embeddings and the tied head, used at both ends) stays for the whole step when
/// `Plan::keep_unit0`, else it is released whenever a block is gathered. The step's gathers
/// are known in advance ([`gather_schedule`]): with `stage3_prefetch_bucket_size` the next ones
/// are queued on the communication lane while the current unit computes, as long as the
/// elements in flight stay within that size and everything live within
/// `stage3_max_live_parameters`.
///
/// Gradients: a micro-batch's gradient exists unit by unit, from the unit's first backward
/// use until `grads_ready`; then it is rounded to the storage type and either sent (stages 2–3)
/// or added to the unit's block tree (stages 0–1, sent as the block sum with the block's last
/// micro-batch). Sending goes by the fixed buckets of `reduce_bucket_size` elements, each an
/// all-to-all of its slice per owner, issued as soon as every unit it covers is ready — with
/// `overlap_comm` it runs while the backward goes on. Every rank issues the same collectives
/// in the same order (idle slots replay the unit events), so the lane keeps the group in step.
struct StepAccess<'a> {
    plan: Arc<Plan>,
    rank: usize,
    store: &'a ParamStore,
    lane: &'a mut Lane,
    owner: Arc<Mutex<OwnerSums>>,
    events: Vec<UnitEvent>,
    // Parameters.
    cache: Vec<Option<Vec<f32>>>,
    held_block: Option<usize>,
    /// The step's gathers ([`gather_schedule`]); the next to use and the next to queue.
    gathers: Vec<Gather>,
    next_gather: usize,
    issued: usize,
    inflight: VecDeque<Ticket<Result<Vec<f32>, ComputeError>>>,
    /// Index of the next parameter use in the step.
    use_pos: usize,
    // Gradients of the current slot.
    slot: usize,
    computing: bool,
    event_pos: usize,
    grads: Vec<Option<Vec<f32>>>,
    trees: Vec<Option<TreeSum>>,
    pieces: Vec<Option<Vec<f32>>>,
    buckets: Vec<Range<usize>>,
    next_bucket: usize,
    tickets: Vec<Ticket<Result<(), ComputeError>>>,
    error: Option<ComputeError>,
    /// Time spent in the lane on the model's behalf (collectives run inline, results waited
    /// for): waits on peers, not this rank's compute.
    waited: Duration,
    /// The part of `waited` spent on gradient exchanges (during the backward).
    grad_waited: Duration,
}

/// One stage-3 gather of a step: unit `unit` for its use number `use_at`, queued on the
/// communication lane at use number `issue_at` (≤ `use_at`; earlier = prefetched).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Gather {
    pub unit: usize,
    pub use_at: usize,
    pub issue_at: usize,
}

/// The step's stage-3 gathers, in order: every use of a non-persistent unit that is not held
/// at that moment under the release policy of [`StepAccess`] (see [`release`]), each queued as
/// early as `stage3_prefetch_bucket_size` (elements queued ahead and not yet used) and
/// `stage3_max_live_parameters` (elements held, counting those queued ahead) allow. A pure
/// function of the plan, so every rank queues the same collectives at the same points.
pub fn gather_schedule(plan: &Plan) -> Vec<Gather> {
    if !plan.gathers() {
        return Vec::new();
    }
    let units = plan.model.units();
    let uses: Vec<usize> = (0..plan.slots())
        .flat_map(|_| plan.micro_batch_events())
        .filter_map(|e| match e {
            UnitEvent::Use(u) => Some(u),
            UnitEvent::Ready(_) => None,
        })
        .collect();
    // Which uses gather, under the release policy.
    let mut cached = vec![false; units.len()];
    let mut held: Option<usize> = None;
    let mut live_at = Vec::with_capacity(uses.len());
    let mut out = Vec::new();
    for (j, &u) in uses.iter().enumerate() {
        if !cached[u] {
            release(plan, &mut cached, &mut held, u, |c, x| c[x] = false);
            cached[u] = true;
            if !plan.persistent[u] {
                out.push(Gather { unit: u, use_at: j, issue_at: j });
            }
        }
        live_at.push(cached.iter().zip(units).filter(|(c, _)| **c).map(|(_, r)| r.len()).sum::<usize>());
    }
    // When each is queued: after use `j`, the next gathers go ahead while they fit.
    let mut next = 0;
    let mut ahead = 0usize;
    for (j, &live) in live_at.iter().enumerate() {
        while next < out.len() && out[next].use_at <= j {
            // Used now: queued at its use unless queued earlier; no longer ahead.
            if out[next].issue_at < out[next].use_at {
                ahead -= units[out[next].unit].len();
            }
            next += 1;
        }
        let mut k = next;
        while k < out.len() && out[k].issue_at < out[k].use_at {
            k += 1;
        }
        while k < out.len() {
            let len = units[out[k].unit].len();
            // Pieces read from NVMe wait in `offload_param.buffer_count` buffers, one of them
            // the current unit's.
            let buffers_full = plan.offload.param == Tier::Nvme && k - next + 1 >= plan.offload.param_buffer_count;
            if ahead + len > plan.prefetch_elems || live + ahead + len > plan.max_live_elems || buffers_full {
                break;
            }
            out[k].issue_at = j;
            ahead += len;
            k += 1;
        }
    }
    out
}

/// The release policy: what goes before unit `u` is loaded — the previous block, and unit 0
/// too when it may not stay live next to a block (or a block next to it).
fn release<C>(plan: &Plan, cache: &mut C, held: &mut Option<usize>, u: usize, drop_unit: impl Fn(&mut C, usize)) {
    if u != 0 {
        if let Some(prev) = held.replace(u) {
            drop_unit(cache, prev);
        }
        if !plan.keep_unit0 {
            drop_unit(cache, 0);
        }
    } else if !plan.keep_unit0 {
        if let Some(prev) = held.take() {
            drop_unit(cache, prev);
        }
    }
}

impl<'a> StepAccess<'a> {
    fn new(plan: Arc<Plan>, rank: usize, store: &'a ParamStore, lane: &'a mut Lane, owner: Arc<Mutex<OwnerSums>>) -> Self {
        let n = plan.model.units().len();
        let buckets: Vec<Range<usize>> = plan.reduce_buckets();
        StepAccess {
            events: plan.micro_batch_events(),
            gathers: gather_schedule(&plan),
            rank,
            store,
            lane,
            owner,
            cache: vec![None; n],
            held_block: None,
            next_gather: 0,
            issued: 0,
            inflight: VecDeque::new(),
            use_pos: 0,
            slot: 0,
            computing: false,
            event_pos: 0,
            grads: vec![None; n],
            trees: (0..n).map(|_| None).collect(),
            pieces: vec![None; n],
            next_bucket: buckets.len(),
            buckets,
            tickets: Vec::new(),
            error: None,
            waited: Duration::ZERO,
            grad_waited: Duration::ZERO,
            plan,
        }
    }

    fn fail(&mut self, e: ComputeError) {
        self.error.get_or_insert(e);
    }

    fn begin_slot(&mut self, slot: usize, computing: bool) {
        self.slot = slot;
        self.computing = computing;
        self.event_pos = 0;
        self.next_bucket = self.buckets.len();
    }

    /// Checks that the slot saw every unit event and sent every bucket.
    fn end_slot(&mut self) {
        if self.event_pos != self.events.len() {
            let e = format!("slot {}: the model made {} of the {} unit calls planned", self.slot, self.event_pos, self.events.len());
            self.fail(ComputeError::failed(e));
        }
        self.grads.iter_mut().for_each(|g| *g = None);
        self.pieces.iter_mut().for_each(|p| *p = None);
    }

    /// The unit events of one micro-batch without compute (a slot this rank has no
    /// micro-batch for): gathers are served and exchanges joined, with nothing to send.
    fn replay(&mut self) {
        for ev in self.events.clone() {
            match ev {
                UnitEvent::Use(u) if self.plan.gathers() => {
                    let _ = self.unit(u);
                }
                UnitEvent::Use(_) => {
                    self.event_pos += 1;
                    self.use_pos += 1;
                }
                UnitEvent::Ready(u) => self.grads_ready(u),
            }
        }
    }

    /// The error, if any, and every exchange still to wait for.
    fn finish(mut self) -> (Option<ComputeError>, Vec<Ticket<Result<(), ComputeError>>>) {
        // Prefetched gathers nobody used (after an error) are waited for too.
        for t in self.inflight.drain(..) {
            let _ = t.wait();
        }
        (self.error, self.tickets)
    }

    /// Checks that the model's next call is `ev`, as the plan's event list says.
    fn expect_event(&mut self, ev: UnitEvent) -> usize {
        let pos = self.event_pos;
        if self.events.get(pos) != Some(&ev) {
            let e = format!("slot {}: the model's unit call {pos} was {ev:?}, the plan expected {:?}", self.slot, self.events.get(pos));
            self.fail(ComputeError::failed(e));
        }
        self.event_pos += 1;
        pos
    }

    /// Queues the gather of `self.gathers[self.issued]`.
    fn issue_gather(&mut self) {
        let u = self.gathers[self.issued].unit;
        let unit = self.plan.model.units()[u].clone();
        let parts: Vec<Range<usize>> = self.plan.ranges.iter().map(|r| clamp_to(r, &unit)).collect();
        let own = parts[self.rank].clone();
        let mut mine = vec![0.0; own.len()];
        let read = self.store.read(own.start + unit.start, &mut mine);
        let len = unit.len();
        let t0 = Instant::now();
        let ticket = self.lane.submit("a stage-3 parameter gather", move |c| {
            read.map_err(ComputeError::failed)?;
            let mut buf = vec![0.0; len];
            c.all_gather(&mine, &parts, &mut buf).map(|()| buf).map_err(ComputeError::from)
        });
        self.waited += t0.elapsed();
        self.inflight.push_back(ticket);
        self.issued += 1;
    }

    /// Queues the gathers the schedule puts at the current use.
    fn prefetch(&mut self) {
        while self.issued < self.gathers.len() && self.gathers[self.issued].issue_at <= self.use_pos {
            self.issue_gather();
        }
    }

    /// Parameters of unit `u` for use number `self.use_pos`.
    fn load(&mut self, u: usize) -> Vec<f32> {
        let unit = self.plan.model.units()[u].clone();
        if !self.plan.gathers() || self.plan.persistent[u] {
            let mut buf = vec![0.0; unit.len()];
            if let Err(e) = self.store.read(unit.start, &mut buf) {
                self.fail(ComputeError::failed(format!("loading unit {u}: {e}")));
            }
            return buf;
        }
        let planned = self.gathers.get(self.next_gather).copied();
        if planned.map(|g| (g.use_at, g.unit)) != Some((self.use_pos, u)) {
            self.fail(ComputeError::failed(format!("use {} of unit {u} is not the planned gather {planned:?}", self.use_pos)));
            return vec![0.0; unit.len()];
        }
        self.prefetch();
        self.next_gather += 1;
        let Some(ticket) = self.inflight.pop_front() else {
            self.fail(ComputeError::failed(format!("the gather of unit {u} was not queued")));
            return vec![0.0; unit.len()];
        };
        let t0 = Instant::now();
        let got = ticket.wait().and_then(|r| r);
        self.waited += t0.elapsed();
        match got {
            Ok(buf) => buf,
            Err(e) => {
                self.fail(e.context(format!("gathering unit {u}")));
                vec![0.0; unit.len()]
            }
        }
    }

    /// Sends every bucket whose units are all ready (they become ready from the end of the
    /// flat buffer towards its start).
    fn send_ready_buckets(&mut self, ready_from: usize) {
        while self.next_bucket > 0 && self.buckets[self.next_bucket - 1].start >= ready_from {
            self.next_bucket -= 1;
            let k = self.next_bucket;
            self.send_bucket(k);
        }
    }

    fn send_bucket(&mut self, k: usize) {
        let bucket = self.buckets[k].clone();
        let plan = Arc::clone(&self.plan);
        let sends: Vec<Vec<f32>> = match plan.slot_send(self.rank, self.slot).filter(|_| self.computing) {
            None => vec![Vec::new(); plan.world],
            Some(_) => plan
                .ranges
                .iter()
                .map(|r| {
                    let lo = r.start.clamp(bucket.start, bucket.end);
                    let hi = r.end.clamp(bucket.start, bucket.end);
                    self.values(lo..hi)
                })
                .collect(),
        };
        // Units wholly above the bucket's start have nothing left to send.
        for (u, unit) in plan.model.units().iter().enumerate() {
            if unit.start >= bucket.start {
                self.pieces[u] = None;
            }
        }
        let (owner, slot, last) = (Arc::clone(&self.owner), self.slot, k == 0);
        let t0 = Instant::now();
        let ticket = self.lane.submit("a gradient bucket exchange", move |c| {
            let refs: Vec<&[f32]> = sends.iter().map(Vec::as_slice).collect();
            let got = c.all_to_all(&refs).map_err(ComputeError::from)?;
            lock(&owner).receive(&plan, slot, &bucket, got, last).map_err(ComputeError::failed)
        });
        if self.plan.overlap_comm {
            self.tickets.push(ticket);
        } else if let Err(e) = ticket.wait().and_then(|r| r) {
            self.fail(e);
        }
        self.waited += t0.elapsed();
        self.grad_waited += t0.elapsed();
    }

    /// This slot's values to send over flat `range`, from the ready units' pieces.
    fn values(&mut self, range: Range<usize>) -> Vec<f32> {
        let mut out = Vec::with_capacity(range.len());
        for (u, unit) in self.plan.model.units().iter().enumerate() {
            let (lo, hi) = (range.start.max(unit.start), range.end.min(unit.end));
            if lo >= hi {
                continue;
            }
            match &self.pieces[u] {
                Some(p) => out.extend_from_slice(&p[lo - unit.start..hi - unit.start]),
                None => {
                    self.error
                        .get_or_insert(ComputeError::failed(format!("unit {u}'s gradient was not ready when flat {lo}..{hi} was sent")));
                    out.resize(out.len() + hi - lo, 0.0);
                }
            }
        }
        out
    }
}

impl UnitAccess for StepAccess<'_> {
    fn unit(&mut self, u: usize) -> (&[f32], &mut [f32]) {
        let pos = self.expect_event(UnitEvent::Use(u));
        if self.cache[u].is_none() {
            let plan = Arc::clone(&self.plan);
            release(&plan, &mut self.cache, &mut self.held_block, u, |c, x| c[x] = None);
            let vals = self.load(u);
            self.cache[u] = Some(vals);
        }
        self.prefetch();
        self.use_pos += 1;
        // Forward uses (the first `units` calls) need no gradient buffer.
        let backward = pos >= self.plan.model.units().len();
        let len = self.plan.model.units()[u].len();
        let grads = if backward && self.computing { &mut self.grads[u].get_or_insert_with(|| vec![0.0; len])[..] } else { &mut [][..] };
        (self.cache[u].as_deref().unwrap_or(&[]), grads)
    }

    fn grads_ready(&mut self, u: usize) {
        self.expect_event(UnitEvent::Ready(u));
        let plan = Arc::clone(&self.plan);
        if self.computing {
            let mut g = self.grads[u].take().unwrap_or_else(|| vec![0.0; plan.model.units()[u].len()]);
            plan.precision.round(&mut g);
            let leaf = plan.leaves(self.rank)[self.slot];
            let block = plan.blocks[self.rank].iter().copied().find(|&(f, l)| f <= leaf && leaf < f + (1 << l));
            match (plan.reduces_per_micro_batch(), block) {
                (true, _) => self.pieces[u] = Some(g),
                (false, Some((first, level))) => {
                    if leaf == first {
                        self.trees[u] = Some(tree(plan.precision.dtype()));
                    }
                    let pushed = match self.trees[u].as_mut() {
                        Some(t) => t.push_block(leaf - first, 0, g).map_err(|e| e.to_string()),
                        None => Err(format!("unit {u}: micro-batch {leaf} before its block began")),
                    };
                    if let Err(e) = pushed {
                        self.fail(ComputeError::failed(e));
                    }
                    if leaf + 1 == (first + (1 << level)).min(plan.micro_batches) {
                        self.pieces[u] = self.trees[u].take().and_then(TreeSum::finish);
                    }
                }
                (false, None) => self.fail(ComputeError::failed(format!("micro-batch {leaf} is in none of rank {}'s blocks", self.rank))),
            }
        }
        if plan.slot_active(self.slot) {
            self.send_ready_buckets(plan.model.units()[u].start);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{from_str_named, Config, ResolveContext};
    use crate::data::Dataset;
    use tessera_kernels::model::FlatAccess;
    use tessera_transport::collective::{AbortHandle, CollectiveError, CommStats};
    use tessera_transport::local::{LocalComm, LocalGroup};

    /// gpt-tiny over bytes: unit 0 holds 49,408 parameters, each of the 4 blocks 198,272.
    const UNIT0: usize = 49_408;
    const BLOCK: usize = 198_272;

    /// A gpt-tiny config over a synthetic byte stream: 4 micro-batches of 16 tokens per step.
    fn setup(world: usize, stage: u8, sets: &[&str]) -> (Config, Dataset) {
        let text = r#"{"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.002, "weight_decay": 0.1}},
            "gradient_clipping": 1.0, "tessera": {"model": "gpt-tiny", "seq_len": 16}}"#;
        let mut overrides = vec![format!("zero_optimization.stage={stage}")];
        overrides.extend(sets.iter().map(|s| s.to_string()));
        let cfg = from_str_named(text, "test.json", &overrides, &ResolveContext::with_world(world)).expect("test config");
        let tokens: Vec<u32> = (0..4096u32).map(|i| (i * 37 + i / 7) % 256).collect();
        (cfg, Dataset::from_tokens(tokens.clone(), tokens, 256, "synthetic".into()))
    }

    fn plan(world: usize, stage: u8, sets: &[&str]) -> Plan {
        let (cfg, data) = setup(world, stage, sets);
        Plan::new(&cfg, &data).expect("test plan")
    }

    fn plan_error(world: usize, stage: u8, sets: &[&str]) -> String {
        let (cfg, data) = setup(world, stage, sets);
        Plan::new(&cfg, &data).err().map(|e| format!("{e:#}")).unwrap_or_default()
    }

    /// Runs two committed steps on `world` threads; returns the full masters and each rank's ops.
    fn two_steps(world: usize, stage: u8, sets: &[&str]) -> (Vec<f32>, Vec<u64>) {
        two_steps_with(world, stage, sets, None, |c| Box::new(c))
    }

    thread_local! {
        /// Whether [`two_steps_with`]'s ranks run whole micro-batches through the GPU's staging
        /// (with the CPU's arithmetic) instead of unit by unit.
        static STAGED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    /// As [`two_steps`] with the micro-batch blocks sized by `speeds` (as the elastic planner
    /// does for uneven workers) and each rank's collective wrapped by `wrap`.
    fn two_steps_with(
        world: usize,
        stage: u8,
        sets: &[&str],
        speeds: Option<&[f64]>,
        wrap: impl Fn(LocalComm) -> Box<dyn Collective>,
    ) -> (Vec<f32>, Vec<u64>) {
        let mut plan = plan(world, stage, sets);
        if let Some(speeds) = speeds {
            plan.blocks = tessera_actors::plan::assign_blocks(plan.micro_batches, speeds);
            assert!((0..world).any(|r| plan.leaves(r).len() < plan.slots()), "speeds {speeds:?} gave even blocks {:?}", plan.blocks);
        }
        let plan = Arc::new(plan);
        let (_, data) = setup(world, stage, sets);
        let sampler = Arc::new(Sampler::new(data.train, plan.seq_len, 7).expect("sampler"));
        let init = plan.model.init_params(7);
        let states: Vec<_> = (0..world).map(|r| Arc::new(Mutex::new(RankState::new(&plan, r, &init, None)))).collect();
        let handles: Vec<_> = LocalGroup::new(world)
            .into_iter()
            .enumerate()
            .map(|(r, comm)| {
                let mut w = ZeroWorker::new(r, Arc::clone(&plan), Arc::clone(&sampler), wrap(comm), Arc::clone(&states[r]));
                if STAGED.get() {
                    w.dev = Device::Cuda(super::super::device::Staged::new(super::super::device::Whole::Cpu));
                }
                std::thread::spawn(move || {
                    for step in 0..2 {
                        w.prepare(&StepOrder { step, epoch: 0, attempt: 0 }).expect("prepare");
                        w.commit(step).expect("commit");
                    }
                })
            })
            .collect();
        handles.into_iter().for_each(|h| h.join().expect("rank thread"));
        let owners = if stage == 0 { 1 } else { world };
        let master = (0..owners).flat_map(|r| lock(&states[r]).master.to_vec()).collect();
        (master, states.iter().map(|s| lock(s).ops_total).collect())
    }

    /// What [`replicated_steps`] leaves: each rank's shard digest, the replicas each rank holds
    /// and (applied, skipped) steps.
    struct Replicated {
        owners: Vec<[u8; 32]>,
        held: Vec<Vec<replica::Replica>>,
        applied: u64,
        skipped: u64,
    }

    /// What the replica tests start from: `world` ranks' plan, sampler and states, and each
    /// rank's replicas of its `k` ring predecessors, copied from the initial state.
    struct ReplicaRig {
        plan: Arc<Plan>,
        sampler: Arc<Sampler>,
        states: Vec<Arc<Mutex<RankState>>>,
        feed: FeedConfig,
        held: Vec<Vec<replica::Replica>>,
    }

    fn replica_rig(world: usize, stage: u8, sets: &[&str], k: usize) -> ReplicaRig {
        let (cfg, data) = setup(world, stage, sets);
        let plan = Arc::new(Plan::new(&cfg, &data).expect("test plan"));
        let sampler = Arc::new(Sampler::new(data.train, plan.seq_len, 7).expect("sampler"));
        let init = plan.model.init_params(7);
        let scaler = || crate::bridge::loss_scaler(&cfg.precision).expect("scaler");
        let states = (0..world).map(|r| Arc::new(Mutex::new(RankState::new(&plan, r, &init, scaler())))).collect();
        let feed = FeedConfig { successors: k, check_every: 1 };
        let copy = |o: usize| {
            let fresh = RankState::new(&plan, o, &init, None);
            let bufs: Vec<(&str, Vec<f32>)> = fresh.optim.state_buffers().into_iter().map(|(n, b)| (n, b.to_vec())).collect();
            let range = plan.optim_range(o);
            replica::Replica::from_copy(o, range.clone(), 0, plan.optimizer, init[range].to_vec(), 0, &bufs).expect("copy")
        };
        let held = (0..world).map(|r| feed.predecessors_of(r, world).into_iter().map(copy).collect()).collect();
        ReplicaRig { plan, sampler, states, feed, held }
    }

    /// Applies what rank `r`'s commit of `step` produced to the replicas it holds; returns how
    /// many updates there were.
    fn apply_fed(w: &mut ZeroWorker, held: &mut [replica::Replica], plan: &Plan, r: usize, step: u64) -> usize {
        let updates = w.take_replica_updates().expect("a feed").expect("replica updates");
        let n = updates.len();
        for u in updates {
            let rep = held.iter_mut().find(|h| h.owner == u.owner).expect("a replica of the owner");
            rep.apply(plan, u).unwrap_or_else(|e| panic!("rank {r}, step {step}: {e}"));
        }
        n
    }

    /// Runs `steps` committed steps on `world` threads with every rank feeding `k` ring
    /// successors' replicas (started from a full copy of the initial state, a digest in every
    /// record, so each step's replica is checked against its owner).
    fn replicated_steps(world: usize, stage: u8, sets: &[&str], k: usize, steps: u64) -> Replicated {
        let ReplicaRig { plan, sampler, states, feed, held } = replica_rig(world, stage, sets, k);
        let handles: Vec<_> = LocalGroup::new(world)
            .into_iter()
            .zip(held)
            .enumerate()
            .map(|(r, (comm, mut held))| {
                let (plan, sampler, state) = (Arc::clone(&plan), Arc::clone(&sampler), Arc::clone(&states[r]));
                std::thread::spawn(move || {
                    let mut w = ZeroWorker::new(r, Arc::clone(&plan), sampler, Box::new(comm), state).with_replica_feed(feed);
                    for step in 0..steps {
                        w.prepare(&StepOrder { step, epoch: 0, attempt: 0 }).expect("prepare");
                        w.commit(step).expect("commit");
                        assert_eq!(apply_fed(&mut w, &mut held, &plan, r, step), k.min(world - 1));
                    }
                    held
                })
            })
            .collect();
        let held: Vec<_> = handles.into_iter().map(|h| h.join().expect("rank thread")).collect();
        let owners = states.iter().map(|s| {
            let st = lock(s);
            replica::shard_digest(&st.master, &st.optim.state_buffers())
        });
        let (applied, skipped) = {
            let st = lock(&states[0]);
            (st.applied, st.skipped)
        };
        Replicated { owners: owners.collect(), held, applied, skipped }
    }

    /// Replicas fed by the owners' gradients and step records stay bit-identical to the
    /// owners' shards: ZeRO-1/2/3, f32/bf16/fp16 (with a skipped overflow step), clipping (the
    /// setup clips at 1.0), LAMB's collective norms, overlap, two successors, an owner whose
    /// optimizer state is on NVMe. A flipped
    /// bit is caught by the digest.
    #[test]
    fn gradient_fed_replicas_stay_bit_identical_to_their_owners() {
        let on = "zero_optimization.overlap_comm=true";
        let dir = tempfile::tempdir().expect("tempdir");
        let nvme = format!("zero_optimization.offload_optimizer.nvme_path={}", dir.path().display());
        for (world, stage, sets, k) in [
            (4, 1, vec![], 1),
            (4, 3, vec!["bf16.enabled=true"], 2),
            (2, 3, vec!["bf16.enabled=true", on, "zero_optimization.reduce_bucket_size=70000"], 1),
            (2, 3, vec!["fp16.enabled=true", "fp16.initial_scale_power=18", "fp16.hysteresis=1"], 1),
            (2, 2, vec![LAMB], 1),
            (4, 1, vec![LAMB, "bf16.enabled=true"], 2),
            // OneCycle's momentum cycle: a replica steps with the betas of its own step count.
            (2, 3, vec![ONE_CYCLE], 1),
            (4, 2, vec![ONE_CYCLE, LAMB], 1),
            // The owner steps its NVMe-tier state sub-group by sub-group; the replica in memory.
            (
                2,
                3,
                vec![
                    "zero_optimization.offload_optimizer.device=nvme",
                    &nvme,
                    "aio.block_size=4096",
                    "zero_optimization.sub_group_size=100000",
                ],
                1,
            ),
        ] {
            let fp16 = sets.iter().any(|s| s.starts_with("fp16"));
            let got = replicated_steps(world, stage, &sets, k, if fp16 { 5 } else { 3 });
            let what = format!("world {world} stage {stage} {sets:?} with {k} successor(s)");
            for (r, held) in got.held.iter().enumerate() {
                assert_eq!(held.len(), k.min(world - 1), "{what}");
                for rep in held {
                    assert_eq!(rep.digest(), got.owners[rep.owner], "{what}: rank {r}'s replica of rank {}", rep.owner);
                }
            }
            if fp16 {
                assert!(got.skipped > 0 && got.applied > 0, "{what}: {} skipped, {} applied", got.skipped, got.applied);
            }
        }
        // The check can fail: a replica with one flipped bit no longer has its owner's digest.
        let got = replicated_steps(2, 3, &[], 1, 2);
        let rep = got.held[1][0].clone();
        let check = |rep: &mut replica::Replica| {
            let record = StepRecord { step: 2, applied: false, lr: 0.0, optimizer_steps: 2, digest: Some(got.owners[rep.owner]) };
            let plan = plan(2, 3, &[]);
            rep.apply(&plan, Update { owner: rep.owner, grad: vec![], record, reductions: vec![] })
        };
        check(&mut rep.clone()).expect("the replica has its owner's digest");
        let mut bad = rep;
        bad.master[5] = f32::from_bits(bad.master[5].to_bits() ^ 1);
        let e = check(&mut bad).expect_err("a flipped bit");
        assert!(e.contains("blake3"), "{e}");
    }

    const LAMB: &str = "optimizer.type=Lamb";
    /// OneCycle over 4 updates; `cycle_momentum` (DeepSpeed's default) cycles the betas.
    const ONE_CYCLE: &str = r#"scheduler={"type": "OneCycle", "params": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.004,
        "cycle_first_step_size": 2}}"#;

    /// OneCycle's momentum cycle changes the parameters (the flag does something), and every
    /// world size and stage still gives the one-worker bits, for AdamW and for Lamb (whose
    /// trust ratios need collective norms).
    #[test]
    fn one_cycle_momentum_changes_the_bits_but_not_their_world_size_independence() {
        for opt in [&[][..], &[LAMB][..]] {
            let on: Vec<&str> = [ONE_CYCLE].iter().chain(opt).copied().collect();
            let mut off = on.clone();
            off.push("scheduler.params.cycle_momentum=false");
            let (one, _) = two_steps(1, 0, &on);
            let (fixed, _) = two_steps(1, 0, &off);
            assert_ne!(one, fixed, "{opt:?}: cycle_momentum changed no parameter");
            for (world, stage) in [(2, 1), (4, 2), (4, 3)] {
                let (got, _) = two_steps(world, stage, &on);
                assert!(got == one, "{opt:?}: world {world} stage {stage} differs from one worker under OneCycle momentum");
            }
        }
    }

    /// A post-cycle momentum decay that would take beta1 out of [0, 1) within the run's steps
    /// is refused when the run is planned, naming the key; SGD, which is not cycled, is not.
    #[test]
    fn a_momentum_decay_past_one_is_refused_at_plan_time() {
        let decay = ["scheduler.params.decay_step_size=1", "scheduler.params.decay_mom_rate=0.1"];
        let sets: Vec<&str> = [ONE_CYCLE, "tessera.steps=7"].iter().chain(&decay).copied().collect();
        // The cycle is 4 updates long; beta1 = 0.9·(1 + 0.1·d) d updates later: 0.99 for
        // update 6, 1.08 for update 7.
        let e = plan_error(1, 0, &sets);
        assert!(e.contains("scheduler.params.decay_mom_rate = 0.1") && e.contains("by step 7"), "{e}");
        let short: Vec<&str> = [ONE_CYCLE, "tessera.steps=6"].iter().chain(&decay).copied().collect();
        assert_eq!(plan_error(1, 0, &short), "", "six steps stay below 1");
        let mut sgd = sets.clone();
        sgd.push(r#"optimizer={"type": "SGD", "params": {"lr": 0.01, "momentum": 0.9}}"#);
        assert_eq!(plan_error(1, 0, &sgd), "", "SGD is not cycled");
    }

    /// A loss inside the commit window, in process: every rank prepares step `at`, then rank
    /// `lost` leaves (its group handle is dropped, so its peers' collectives fail with
    /// `PeerGone`) and the others commit. Their commits fail (the parameters cannot be shared)
    /// after the optimizer step: their error is torn with `stepped = Some(step)` and the replica
    /// updates, received before `Prepared`, are there. With LAMB (`sets` holds [`LAMB`]) they
    /// fail inside the optimizer step, in its norm all-reduce, before anything changed: the
    /// error is not torn and no replica update is made. Returns each survivor's shard digest
    /// and the replicas each holds after applying them (the lost rank's entry is empty).
    fn loss_after_prepared(
        world: usize,
        stage: u8,
        sets: &[&str],
        at: u64,
        lost: usize,
    ) -> (Vec<Option<[u8; 32]>>, Vec<Vec<replica::Replica>>) {
        let lamb = sets.contains(&LAMB);
        let ReplicaRig { plan, sampler, states, feed, held } = replica_rig(world, stage, sets, 1);
        let prepared = Arc::new(std::sync::Barrier::new(world));
        let handles: Vec<_> = LocalGroup::new(world)
            .into_iter()
            .zip(held)
            .enumerate()
            .map(|(r, (comm, mut held))| {
                let (plan, sampler, state, prepared) =
                    (Arc::clone(&plan), Arc::clone(&sampler), Arc::clone(&states[r]), Arc::clone(&prepared));
                std::thread::spawn(move || {
                    let mut w = ZeroWorker::new(r, Arc::clone(&plan), sampler, Box::new(comm), state).with_replica_feed(feed);
                    for step in 0..=at {
                        w.prepare(&StepOrder { step, epoch: 0, attempt: 0 }).expect("prepare");
                        if step == at {
                            prepared.wait();
                            if r == lost {
                                return Vec::new();
                            }
                            let e = w.commit(step).expect_err("a commit with a lost rank");
                            assert!(e.explained_by_loss(), "rank {r}: a lost peer's failure is not a loss: {e:?}");
                            if lamb {
                                // LAMB's norm all-reduce inside the optimizer step fails first.
                                assert!(!matches!(e, ComputeError::Torn { .. }), "rank {r}: the shard should be untouched ({e:?})");
                                assert_eq!(e.state_after_commit(step, Some(step)), Some(step), "rank {r}");
                                assert!(w.take_replica_updates().is_none(), "rank {r}: replica updates without a step");
                                return held;
                            }
                            let stepped = matches!(e, ComputeError::Torn { stepped: Some(s), .. } if s == step);
                            assert!(stepped, "rank {r}: the shard took the step before the failure ({e:?})");
                            assert_eq!(e.state_after_commit(step, Some(step)), Some(step + 1), "rank {r}");
                        } else {
                            w.commit(step).expect("commit");
                        }
                        apply_fed(&mut w, &mut held, &plan, r, step);
                    }
                    held
                })
            })
            .collect();
        let held: Vec<_> = handles.into_iter().map(|h| h.join().expect("rank thread")).collect();
        let owners = (0..world)
            .map(|r| {
                (r != lost).then(|| {
                    let st = lock(&states[r]);
                    replica::shard_digest(&st.master, &st.optim.state_buffers())
                })
            })
            .collect();
        (owners, held)
    }

    /// Loses each of a few ranks after every rank prepared step 2 (ZeRO-1, 2 and 3, whose
    /// commits share parameters differently; the lost rank in the middle, at the end and at the
    /// start of the ring) and checks that every survivor's shard and the lost owner's replica on
    /// its successor equal a fault-free run's after `at` steps.
    fn check_state_after_a_loss_in_commit(sets: &[&str], at: u64) {
        for (world, stage, lost) in [(4, 1, 1), (4, 3, 3), (2, 2, 0)] {
            let what = format!("{sets:?}, world {world}, stage {stage}, rank {lost} lost after preparing step 2");
            let reference = replicated_steps(world, stage, sets, 1, at);
            let (owners, held) = loss_after_prepared(world, stage, sets, 2, lost);
            for (r, d) in owners.iter().enumerate() {
                if let Some(d) = d {
                    assert_eq!(*d, reference.owners[r], "{what}: rank {r}'s own shard");
                }
            }
            let holder = (lost + 1) % world;
            let rep = held[holder].iter().find(|h| h.owner == lost).unwrap_or_else(|| panic!("{what}: no replica of rank {lost}"));
            assert_eq!(rep.at, at, "{what}");
            assert_eq!(rep.digest(), reference.owners[lost], "{what}: rank {holder}'s replica of the lost rank {lost}");
        }
    }

    /// The state a recovery needs after a loss in the commit window exists in memory at t + 1:
    /// every survivor took step t, and so did the lost owner's replica.
    #[test]
    fn a_loss_after_prepared_leaves_every_shard_at_the_next_step() {
        check_state_after_a_loss_in_commit(&[], 3);
    }

    /// A LAMB commit that loses a member fails in the norm all-reduce with the state at t
    /// whole in memory: every survivor's shard and the lost owner's replica equal a fault-free
    /// run's after t steps (so the recovery restores from memory and reruns step t instead of
    /// loading a checkpoint).
    #[test]
    fn a_lamb_loss_after_prepared_leaves_every_shard_at_the_step_before() {
        check_state_after_a_loss_in_commit(&[LAMB], 2);
    }

    #[test]
    fn small_reduce_buckets_add_all_to_alls_and_change_no_bit() {
        let (whole, ops_whole) = two_steps(2, 2, &[]);
        let (bucketed, ops_bucketed) = two_steps(2, 2, &["zero_optimization.reduce_bucket_size=50000"]);
        assert_eq!(whole, bucketed, "bucketing changed the parameters");
        // 842,496 parameters make 17 buckets of 50,000 instead of one all-to-all per exchange;
        // stage 2 exchanges every micro-batch: 2 per rank and step, two steps.
        let buckets = (UNIT0 + 4 * BLOCK).div_ceil(50_000) as u64;
        for (a, b) in ops_whole.iter().zip(&ops_bucketed) {
            assert_eq!(b - a, 2 * 2 * (buckets - 1), "ops {ops_whole:?} vs {ops_bucketed:?}");
        }
        // Stage 1 sends each rank's block sum once, with its last micro-batch.
        let (_, ops_whole) = two_steps(2, 1, &[]);
        let (_, ops_bucketed) = two_steps(2, 1, &["zero_optimization.reduce_bucket_size=50000"]);
        for (a, b) in ops_whole.iter().zip(&ops_bucketed) {
            assert_eq!(b - a, 2 * (buckets - 1), "stage 1 ops {ops_whole:?} vs {ops_bucketed:?}");
        }
        let (one, _) = two_steps(1, 0, &[]);
        assert_eq!(one, whole, "world 2 stage 2 differs from one worker");
    }

    /// DeepSpeed reduces each parameter's gradient on its own with `reduce_bucket_size: 0`
    /// (its bucket is flushed before every parameter): one all-to-all per parameter tensor,
    /// the same bits.
    /// A GPU rank takes every unit's parameters at its forward use, runs the whole micro-batch
    /// on the device and hands the gradients back at their backward uses
    /// ([`super::super::device::Staged`]). With the CPU's arithmetic behind that staging, every
    /// stage and world size gives the unit-by-unit bits: the unit events, the collectives they
    /// drive (stage 3's gathers at the forward uses, the buckets at the backward's) and the
    /// gradients are the same.
    #[test]
    fn whole_micro_batches_staged_as_on_the_gpu_give_the_unit_by_unit_bits() {
        let (one, _) = two_steps(1, 0, &[]);
        for (world, stage) in [(1, 0), (2, 1), (4, 2), (2, 3), (4, 3)] {
            let sets = ["zero_optimization.stage3_param_persistence_threshold=0"];
            STAGED.set(true);
            let (staged, ops_staged) = two_steps(world, stage, &sets);
            STAGED.set(false);
            let (direct, ops_direct) = two_steps(world, stage, &sets);
            assert_eq!(staged, direct, "world {world}, stage {stage}: staged bits differ");
            assert_eq!(ops_staged, ops_direct, "world {world}, stage {stage}: other collectives");
            assert_eq!(staged, one, "world {world}, stage {stage}: not the one-rank bits");
        }
    }

    #[test]
    fn a_zero_reduce_bucket_is_one_bucket_per_tensor_as_deepspeed() {
        let zero = ["zero_optimization.reduce_bucket_size=0"];
        let p = plan(2, 2, &zero);
        let tensors: Vec<Range<usize>> = p.flat.segments().iter().filter(|s| !s.is_empty()).cloned().collect();
        assert_eq!(p.reduce_buckets(), tensors);
        let (whole, ops_whole) = two_steps(2, 2, &[]);
        let (per_tensor, ops_per_tensor) = two_steps(2, 2, &zero);
        assert_eq!(whole, per_tensor, "one bucket per tensor changed the parameters");
        for (a, b) in ops_whole.iter().zip(&ops_per_tensor) {
            assert_eq!(b - a, 2 * 2 * (tensors.len() as u64 - 1), "ops {ops_whole:?} vs {ops_per_tensor:?}");
        }
    }

    /// Records `Use`/`Ready` events of the model's calls.
    struct Recorder<'a> {
        flat: FlatAccess<'a>,
        events: Vec<UnitEvent>,
    }

    impl UnitAccess for Recorder<'_> {
        fn unit(&mut self, u: usize) -> (&[f32], &mut [f32]) {
            self.events.push(UnitEvent::Use(u));
            self.flat.unit(u)
        }
        fn grads_ready(&mut self, u: usize) {
            self.events.push(UnitEvent::Ready(u));
        }
    }

    #[test]
    fn the_plans_unit_events_are_the_models_calls() {
        for recompute in ["false", "true"] {
            let mut p = plan(2, 3, &[&format!("activation_checkpointing.partition_activations={recompute}")]);
            p.model.checkpoint_activations = recompute == "true";
            let params = p.model.init_params(1);
            let mut grads = vec![0.0; params.len()];
            let mut rec = Recorder { flat: FlatAccess { params: &params, grads: &mut grads, units: p.model.units() }, events: Vec::new() };
            let tokens: Vec<u32> = (0..16).collect();
            p.model.forward_backward(&mut rec, &tokens, &tokens, 1, 16, 1.0, &mut Workspace::default());
            assert_eq!(rec.events, p.micro_batch_events(), "activation recomputation {recompute}");
        }
    }

    /// Every combination of overlap, prefetch and bucket size gives the one-worker bits.
    #[test]
    fn overlap_and_prefetch_change_no_bit() {
        let (one, _) = two_steps(1, 0, &[]);
        let off = "zero_optimization.overlap_comm=false";
        let on = "zero_optimization.overlap_comm=true";
        let small = "zero_optimization.reduce_bucket_size=70000";
        let no_persist = "zero_optimization.stage3_param_persistence_threshold=0";
        // Uneven blocks (a rank with 3 micro-batches beside one with 1, which replays the
        // communication of two slots without computing) exercise the idle slots.
        let uneven: &[f64] = &[3.0, 1.0];
        for (world, stage, sets, speeds) in [
            (2, 1, vec![on, small], None),
            (2, 1, vec![on, small], Some(uneven)),
            (4, 1, vec![on], None),
            (2, 2, vec![on, small], None),
            (2, 2, vec![off, small], Some(uneven)),
            (4, 2, vec![on, small], None),
            (4, 3, vec![off, "zero_optimization.stage3_prefetch_bucket_size=0"], None),
            (2, 3, vec![on, small, no_persist, "zero_optimization.stage3_prefetch_bucket_size=400000"], None),
            (2, 3, vec![on, small, no_persist, "zero_optimization.stage3_prefetch_bucket_size=400000"], Some(uneven)),
            (2, 3, vec![off, no_persist, "zero_optimization.stage3_prefetch_bucket_size=1000000000"], None),
            (4, 3, vec![on, small, no_persist, "zero_optimization.stage3_max_live_parameters=300000"], None),
        ] {
            let (got, _) = two_steps_with(world, stage, &sets, speeds, |c| Box::new(c));
            assert_eq!(got, one, "world {world} stage {stage} with {sets:?}, speeds {speeds:?} differs from one worker");
        }
    }

    #[test]
    fn the_gather_schedule_prefetches_within_its_bounds() {
        let no_persist = "zero_optimization.stage3_param_persistence_threshold=0";
        let units = |p: &Plan| p.model.units().iter().map(|r| r.len()).collect::<Vec<_>>();
        // Without prefetch every gather is queued at its use.
        let p = plan(2, 3, &[no_persist, "zero_optimization.stage3_prefetch_bucket_size=0"]);
        let none = gather_schedule(&p);
        assert!(none.iter().all(|g| g.issue_at == g.use_at), "{none:?}");
        // Per slot (2 slots, 4 blocks): unit 0 once (kept), blocks 1-4 forward, 4 stays held
        // across the head, 3-1 backward; the next slot starts with block 1 still held.
        let order: Vec<usize> = none.iter().map(|g| g.unit).collect();
        assert_eq!(order, [0, 1, 2, 3, 4, 3, 2, 1, 2, 3, 4, 3, 2, 1]);
        for (prefetch, max_live) in [(BLOCK, 1_000_000_000), (2 * BLOCK, 1_000_000_000), (10 * BLOCK, UNIT0 + 3 * BLOCK)] {
            let sets = [
                no_persist.to_string(),
                format!("zero_optimization.stage3_prefetch_bucket_size={prefetch}"),
                format!("zero_optimization.stage3_max_live_parameters={max_live}"),
            ];
            let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
            let p = plan(2, 3, &sets);
            let sched = gather_schedule(&p);
            let sizes = units(&p);
            assert_eq!(
                sched.iter().map(|g| (g.unit, g.use_at)).collect::<Vec<_>>(),
                none.iter().map(|g| (g.unit, g.use_at)).collect::<Vec<_>>()
            );
            assert!(sched.iter().any(|g| g.issue_at < g.use_at), "prefetch {prefetch} queued nothing ahead");
            assert!(sched.windows(2).all(|w| w[0].issue_at <= w[1].issue_at), "gathers are queued in order");
            // At every use, what is queued ahead and not yet used fits the prefetch size.
            let last = sched.last().map_or(0, |g| g.use_at);
            for j in 0..=last {
                let ahead: usize = sched.iter().filter(|g| g.issue_at <= j && j < g.use_at).map(|g| sizes[g.unit]).sum();
                assert!(ahead <= prefetch, "use {j}: {ahead} elements ahead > {prefetch}");
                assert!(ahead + UNIT0 <= max_live, "use {j}: {ahead} ahead beside unit 0 exceed {max_live}");
            }
        }
        // A prefetch size below one block queues nothing ahead.
        let p = plan(2, 3, &[no_persist, "zero_optimization.stage3_prefetch_bucket_size=1000"]);
        assert_eq!(gather_schedule(&p), none);
    }

    /// Which thread ran each collective.
    struct ThreadLog {
        inner: LocalComm,
        log: Arc<Mutex<Vec<String>>>,
    }

    impl ThreadLog {
        fn note(&self) {
            let name = std::thread::current().name().unwrap_or("?").to_string();
            lock(&self.log).push(name);
        }
    }

    impl Collective for ThreadLog {
        fn rank(&self) -> usize {
            self.inner.rank()
        }
        fn world(&self) -> usize {
            self.inner.world()
        }
        fn timeout_ms(&self) -> u64 {
            self.inner.timeout_ms()
        }
        fn set_timeout_ms(&mut self, t: u64) {
            self.inner.set_timeout_ms(t)
        }
        fn stats(&self) -> CommStats {
            self.inner.stats()
        }
        fn abort_handle(&self) -> AbortHandle {
            self.inner.abort_handle()
        }
        fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CollectiveError> {
            self.note();
            self.inner.all_reduce_sum(buf)
        }
        fn all_reduce_sum_f64(&mut self, buf: &mut [f64]) -> Result<(), CollectiveError> {
            self.note();
            self.inner.all_reduce_sum_f64(buf)
        }
        fn reduce_scatter_sum(&mut self, input: &[f32], ranges: &[Range<usize>], out: &mut [f32]) -> Result<(), CollectiveError> {
            self.note();
            self.inner.reduce_scatter_sum(input, ranges, out)
        }
        fn all_gather(&mut self, shard: &[f32], ranges: &[Range<usize>], out: &mut [f32]) -> Result<(), CollectiveError> {
            self.note();
            self.inner.all_gather(shard, ranges, out)
        }
        fn gather_slices_with(
            &mut self,
            input: &[f32],
            ranges: &[Range<usize>],
            visit: &mut dyn FnMut(usize, &[f32]),
        ) -> Result<(), CollectiveError> {
            self.note();
            self.inner.gather_slices_with(input, ranges, visit)
        }
        fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CollectiveError> {
            self.note();
            self.inner.broadcast(buf, root)
        }
        fn all_to_all(&mut self, send: &[&[f32]]) -> Result<Vec<Vec<f32>>, CollectiveError> {
            self.note();
            self.inner.all_to_all(send)
        }
        fn send(&mut self, to: usize, tag: u64, data: &[f32]) -> Result<(), CollectiveError> {
            self.note();
            self.inner.send(to, tag, data)
        }
        fn recv(&mut self, from: usize, tag: u64) -> Result<Vec<f32>, CollectiveError> {
            self.note();
            self.inner.recv(from, tag)
        }
        fn barrier(&mut self) -> Result<(), CollectiveError> {
            self.note();
            self.inner.barrier()
        }
    }

    /// `overlap_comm` (and stage-3 prefetch) move every collective to the rank's communication
    /// thread; without them the rank's own thread runs them between its computations.
    #[test]
    fn overlap_comm_runs_the_collectives_on_the_communication_thread() {
        for (stage, sets, threaded) in [
            (2, vec!["zero_optimization.overlap_comm=true"], true),
            (2, vec!["zero_optimization.overlap_comm=false"], false),
            (3, vec!["zero_optimization.overlap_comm=false", "zero_optimization.stage3_prefetch_bucket_size=0"], false),
            (3, vec!["zero_optimization.overlap_comm=false", "zero_optimization.stage3_prefetch_bucket_size=1000000"], true),
        ] {
            let logs: Vec<Arc<Mutex<Vec<String>>>> = (0..2).map(|_| Arc::default()).collect();
            let ls = logs.clone();
            two_steps_with(2, stage, &sets, None, move |c| {
                let log = Arc::clone(&ls[c.rank()]);
                Box::new(ThreadLog { inner: c, log })
            });
            for (r, log) in logs.iter().enumerate() {
                let names = lock(log);
                assert!(!names.is_empty());
                let on_comm = names.iter().filter(|n| **n == format!("tessera-comm-{r}")).count();
                let want = if threaded { names.len() } else { 0 };
                assert_eq!(
                    on_comm,
                    want,
                    "stage {stage} {sets:?}: rank {r} ran {on_comm} of {} collectives on its communication thread",
                    names.len()
                );
            }
        }
    }

    #[test]
    fn persistent_and_released_units_keep_stage_3_bit_identical() {
        let (one, _) = two_steps(1, 0, &[]);
        for sets in [
            &["zero_optimization.stage3_param_persistence_threshold=0"][..],
            &["zero_optimization.stage3_param_persistence_threshold=1000000"][..],
            &["zero_optimization.stage3_param_persistence_threshold=0", "zero_optimization.stage3_max_live_parameters=200000"][..],
        ] {
            let (two, _) = two_steps(2, 3, sets);
            assert_eq!(one, two, "world 2 stage 3 with {sets:?} differs from one worker");
        }
    }

    #[test]
    fn the_unit_policy_follows_the_keys() {
        let p = plan(4, 3, &[]);
        assert_eq!(p.model.units()[0].len(), UNIT0);
        assert_eq!(p.model.units()[1].len(), BLOCK);
        // DeepSpeed's default threshold (1e5) makes unit 0 persistent, not the blocks.
        assert_eq!(p.persistent, [true, false, false, false, false]);
        assert!(p.keep_unit0);
        // Rank 1 holds its shard and unit 0 whole, merged into disjoint ranges.
        assert_eq!(p.param_ranges(1), vec![0..UNIT0, p.ranges[1].clone()]);
        assert_eq!(p.param_ranges(0), vec![p.ranges[0].clone()]);
        let no_persist = "zero_optimization.stage3_param_persistence_threshold=0";
        assert!(plan(4, 3, &[no_persist]).keep_unit0);
        assert!(!plan(4, 3, &[no_persist, "zero_optimization.stage3_max_live_parameters=247679"]).keep_unit0);
        assert!(plan(4, 3, &[no_persist, "zero_optimization.stage3_max_live_parameters=247680"]).keep_unit0);
        assert!(!plan(4, 3, &[no_persist, "zero_optimization.stage3_max_reuse_distance=793087"]).keep_unit0);
        assert!(plan(4, 3, &[no_persist, "zero_optimization.stage3_max_reuse_distance=793088"]).keep_unit0);
        // Without gathering (stages 0-2, or one rank) nothing is persistent or released.
        let p = plan(1, 3, &["zero_optimization.stage3_max_live_parameters=1"]);
        assert!(p.keep_unit0 && p.persistent.iter().all(|x| !x));
    }

    #[test]
    fn impossible_zero_settings_are_refused_naming_key_and_sizes() {
        let e = plan_error(2, 3, &["zero_optimization.stage3_max_live_parameters=100000"]);
        assert!(e.contains("stage3_max_live_parameters = 100000") && e.contains("unit 1 (transformer block 0)"), "{e}");
        assert!(e.contains(&BLOCK.to_string()), "{e}");
        // A unit that persists is never gathered, so the bound does not apply to it.
        assert_eq!(
            plan_error(
                2,
                3,
                &["zero_optimization.stage3_max_live_parameters=100000", "zero_optimization.stage3_param_persistence_threshold=1000000"]
            ),
            ""
        );
    }

    /// A store with part of its ranges in a swap file reads and writes exactly like one held
    /// in memory, across segment and block boundaries, in every storage type.
    #[test]
    fn a_param_store_with_a_swap_file_matches_one_in_memory() {
        let dir = tempfile::tempdir().expect("tempdir");
        let aio = AioOptions { block: 4096, ..AioOptions::default() };
        let full: Vec<f32> = (0..20_000).map(|i| ((i as f32) * 0.731).sin() * 3.0 + 1.0 / 3.0).collect();
        let memory = [100..900, 5000..5100];
        let swapped = [900..5000, 7000..19_000];
        let all = [100..5100, 7000..19_000];
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let path = dir.path().join(format!("p-{dtype:?}.swp"));
            let mut sw = ParamStore::with_swap(dtype, &memory, &swapped, &full, path.clone(), &aio).expect("swap store");
            let mut mem = ParamStore::new(dtype, &all, &full);
            assert!(path.exists());
            assert_eq!(sw.bytes(), mem.bytes());
            assert_eq!(sw.swapped_bytes(), (16_100 * dtype.size_bytes()) as u64);
            // Writes straddling memory/swap boundaries and partial blocks.
            for (k, (start, len)) in [(850, 100), (4990, 110), (7001, 3), (9000, 4096), (18_990, 10), (100, 5000)].into_iter().enumerate() {
                let vals: Vec<f32> = (0..len).map(|i| (i as f32 + k as f32 * 0.1).cos() * 7.0).collect();
                sw.write(start, &vals).expect("swap write");
                mem.write(start, &vals).expect("memory write");
            }
            for (start, len) in [(100, 5000), (7000, 12_000), (899, 2), (4999, 2), (12_345, 1)] {
                let (mut a, mut b) = (vec![0.0; len], vec![0.0; len]);
                sw.read(start, &mut a).expect("swap read");
                mem.read(start, &mut b).expect("memory read");
                assert_eq!(a, b, "{dtype:?} {start}+{len}");
            }
            assert!(sw.read(5050, &mut [0.0; 100]).unwrap_err().contains("5050..5150"));
            drop(sw);
            assert!(!path.exists(), "the swap file is removed with the store");
        }
    }

    /// `offload_optimizer.ratio` keeps that share of the masters and moments out of the budget:
    /// a budget between the two splits refuses the smaller ratio and admits the larger.
    #[test]
    fn a_partial_optimizer_offload_moves_its_share_out_of_the_budget() {
        let cpu = "zero_optimization.offload_optimizer.device=cpu";
        let ratio = |r: f64| format!("zero_optimization.offload_optimizer.ratio={r}");
        let (r3, r7) = (ratio(0.3), ratio(0.7));
        let p3 = plan(2, 3, &[cpu, &r3]);
        let p7 = plan(2, 3, &[cpu, &r7]);
        let all = p3.model_state_bytes(0).optim;
        let off3 = p3.offloaded_bytes(0).host;
        assert!((off3 as f64 - 0.3 * all as f64).abs() <= 16.0, "{off3} of {all}");
        assert_eq!(p3.resident_bytes(0).optim + off3, all);
        let (need3, need7) = (p3.resident_bytes(0).total(), p7.resident_bytes(0).total());
        assert!(need7 < need3);
        let budget = format!("tessera.device_memory_bytes_max={}", (need3 + need7) / 2);
        let e = plan_error(2, 3, &[cpu, &r3, &budget]);
        assert!(e.contains("tessera.device_memory_bytes_max") && e.contains(&need3.to_string()), "{e}");
        assert_eq!(plan_error(2, 3, &[cpu, &r7, &budget]), "");
        // The split is accounting of one machine's memory: the bits do not change.
        let (one, _) = two_steps(1, 0, &[]);
        assert_eq!(two_steps(2, 3, &[cpu, &r3]).0, one);
        let e = plan_error(
            2,
            3,
            &["zero_optimization.offload_optimizer.device=nvme", "zero_optimization.offload_optimizer.nvme_path=/tmp", &r3],
        );
        assert!(e.contains("ratio = 0.3"), "{e}");
    }

    /// `offload_param.device = nvme` keeps stage 3 bit-identical; a missing path is refused.
    #[test]
    fn parameter_shards_on_nvme_keep_stage_3_bit_identical() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (one, _) = two_steps(1, 0, &[]);
        let path = format!("zero_optimization.offload_param.nvme_path={}", dir.path().display());
        for (persist, in_cpu) in [("0", "0"), ("100000", "0"), ("0", "150000")] {
            let sets = [
                "zero_optimization.offload_param.device=nvme",
                path.as_str(),
                &format!("zero_optimization.stage3_param_persistence_threshold={persist}"),
                &format!("zero_optimization.offload_param.max_in_cpu={in_cpu}"),
                "zero_optimization.offload_param.buffer_count=2",
                "aio.block_size=4096",
            ];
            let (two, _) = two_steps(2, 3, &sets);
            assert_eq!(one, two, "stage 3 with parameters on NVMe, persistence threshold {persist}, max_in_cpu {in_cpu}");
            // The shard leaves the budget: max_in_cpu of it in host memory, the rest on NVMe.
            let p = plan(2, 3, &sets);
            let off = p.offloaded_bytes(1);
            let shard = p.ranges[1].len() as u64 * 4;
            assert_eq!(off.host + off.nvme, shard);
            assert_eq!(off.host, shard.min(in_cpu.parse::<u64>().unwrap() * 4), "{off:?}");
        }
        // Two buffers: the current unit's and one read ahead.
        let p = plan(
            2,
            3,
            &[
                "zero_optimization.offload_param.device=nvme",
                path.as_str(),
                "zero_optimization.offload_param.buffer_count=2",
                "zero_optimization.stage3_param_persistence_threshold=0",
            ],
        );
        let sched = gather_schedule(&p);
        for g in &sched {
            let ahead = sched.iter().filter(|h| h.issue_at <= g.use_at && g.use_at < h.use_at).count();
            assert!(ahead <= 1, "at use {}: {ahead} gathers read ahead with 2 buffers", g.use_at);
        }
        assert!(sched.iter().any(|g| g.issue_at < g.use_at));
        let e = plan_error(
            2,
            3,
            &[
                "zero_optimization.offload_param.device=nvme",
                path.as_str(),
                "zero_optimization.offload_param.buffer_size=1000",
                "zero_optimization.stage3_param_persistence_threshold=0",
            ],
        );
        assert!(e.contains("buffer_size = 1000") && e.contains("unit 0"), "{e}");
        assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 0, "swap files are removed at the end");
        let e = plan_error(2, 3, &["zero_optimization.offload_param.device=nvme"]);
        assert!(e.contains("zero_optimization.offload_param.nvme_path"), "{e}");
        let e = plan_error(
            2,
            3,
            &["zero_optimization.offload_param.device=nvme", "zero_optimization.offload_param.nvme_path=/nonexistent/tessera"],
        );
        assert!(e.contains("/nonexistent/tessera"), "{e}");
    }

    #[test]
    fn a_param_store_reads_and_writes_only_what_it_holds() {
        let full: Vec<f32> = (0..100).map(|i| i as f32).collect();
        let mut s = ParamStore::new(DType::F32, &[10..20, 50..60], &full);
        assert_eq!(s.bytes(), 80);
        let mut out = [0.0; 3];
        s.read(52, &mut out).expect("held");
        assert_eq!(out, [52.0, 53.0, 54.0]);
        s.write(18, &[1.5, 2.5]).expect("held");
        s.read(17, &mut out).expect("held");
        assert_eq!(out, [17.0, 1.5, 2.5]);
        assert!(s.read(19, &mut out).unwrap_err().contains("19..22"));
        assert!(s.write(30, &[0.0]).is_err());
        s.read(99, &mut []).expect("an empty read touches nothing");
    }
}
