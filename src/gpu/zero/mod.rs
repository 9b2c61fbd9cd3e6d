//! One GPU rank of a ZeRO run: parameters, gradients and optimizer state on the device, NCCL
//! for the collectives on a communication stream that overlaps the compute stream. The optimizer
//! is the CPU engine's (`OptimizerKind`) as the elementwise kernels of `cuda::optim` (Adam/AdamW,
//! SGD, Lion, Adagrad), or LAMB over every tensor at once (`cuda::lamb`; one GPU or ZeRO-0 only:
//! [`refuse_split_lamb`]).
//!
//! - Stage 0: every rank holds everything; gradients are all-reduced unit by unit.
//! - Stages 1 and 2: fp32 masters and Adam moments are split per unit across ranks; gradients
//!   are reduce-scattered unit by unit (stage 2 as each unit's backward finishes, overlapping
//!   the rest of the backward; stage 1 after the whole backward), each rank updates its pieces,
//!   and the bf16 parameters are all-gathered unit by unit — the next step's forward waits
//!   only for the unit it is about to use.
//! - Stage 3: as stage 2, and the bf16 parameters themselves are split: each unit is gathered
//!   just before use into one of two rotating buffers (the next use is prefetched on the
//!   communication stream while the current one computes) and dropped after. The embedding
//!   unit stays gathered from the start of the forward to the end of the backward (it is used
//!   at both ends). The gradient buffer is full-length, as in stage 2.
//!
//! The last micro-batch's gradient is finished unit by unit: as the backward completes a unit,
//! that unit's share of the micro-batch tree's adds runs, then its reduction (so reductions
//! overlap the rest of the backward with or without gradient accumulation).
//!
//! Optimizer offload ([`OffloadOptions`], `src/gpu/offload.rs`): the masters and optimizer state
//! of the host part of each unit's piece live in host memory and are stepped by CPU threads as
//! each unit's reduced gradient reaches the host (any elementwise optimizer; LAMB is refused);
//! the new bf16 parameters come back per unit and are gathered as without offload.
//!
//! Optimizer in the backward (one GPU, `gradient_clipping` off, unless
//! `TESSERA_GPU_EARLY_ADAM=0`): as the last backward finishes a unit's gradient, that unit's
//! AdamW runs on a third stream, so the optimizer's memory traffic fills the gaps the backward's
//! kernels leave instead of running after it. The kernel and its inputs are the ones the step
//! would use after the backward (elementwise, so the same bits: a `gpu check` row compares the
//! two); the compute stream waits for that stream before the step returns.
//!
//! fp16 (`RankSpec::fp16`, the config's `fp16` section): parameters and activations stay bf16,
//! each micro-batch's gradient is stored as fp16 (rounded in place; beyond ±65504 it becomes
//! infinite, as the CPU path's 16-bit gradient storage does), the backward starts from the loss
//! times the loss scale, and the global norm of the unscaled gradient is always formed: a
//! non-finite one is an overflow ([`Prepared::overflow`]) and the caller's loss scaler decides
//! whether the step is committed or skipped ([`Rank::skip`]). The update multiplies the gradient
//! by 1/scale (and the clipping coefficient) as it reads it. The optimizer then never runs during
//! the backward. With optimizer offload the host worker waits for the verdict as it waits for
//! the clipping coefficient: on an overflow it hands every unit back unstepped, the device part
//! is not updated, and the prepared step can only be skipped ([`StagedStep::Overflowed`]).
//!
//! Determinism: a rank's micro-batches are combined by a fixed binary tree, ranks hold aligned
//! blocks of micro-batches, and with two ranks NCCL's sum is one IEEE add — so one GPU running
//! two micro-batches and two GPUs running one each produce the same bits (tested on the device).
//!
//! Files: this one builds a rank and runs its steps; `hooks.rs` the per-unit hooks of one
//! micro-batch (stage-3 gathers, finishing a unit's gradient); `state.rs` what the training driver
//! reads and restores (evaluation, host gathers, optimizer state in the CPU layout).

use std::sync::mpsc::RecvTimeoutError;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tessera_kernels::cuda::gpt::{self, GpuLayout, Shape, Workspace};
use tessera_kernels::cuda::lamb::LambSlots;
use tessera_kernels::cuda::optim::OptimStep;
use tessera_kernels::cuda::{self, bf16, ops, Buf, CudaEvent, CudaStream, DPtr, Gpu};
use tessera_kernels::model::Model;
use tessera_kernels::optim::{AdamParams, ElementwiseStep, FlatLayout, OptimizerKind};
use tessera_transport::nccl::NcclComm;

use super::lamb_host::LambHost;
use super::offload::{self, Offload, OffloadStats, Pipe, Split};
use super::param_offload::{ParamHost, ParamOffloadOptions, ParamOffloadStats};
use crate::offload::ResidentBytes;
use hooks::Hooks;

mod hooks;
mod state;

/// Bound on any wait for the communication stream.
const COMM_TIMEOUT: Duration = Duration::from_secs(300);

/// The optimizer a rank runs: the CPU engine's (its base `lr` unused: each step takes the
/// scheduled rate; OneCycle's momentum cycle follows the rank's optimizer step count, as on the
/// CPU) and the global gradient-norm clip.
#[derive(Clone, Copy, Debug)]
pub struct Optimizer {
    pub kind: OptimizerKind,
    /// Global gradient-norm clip (0 = off), DeepSpeed's `gradient_clipping`.
    pub clip: f32,
}

impl Optimizer {
    /// AdamW with bias correction (the checks' and the benchmark's optimizer).
    pub fn adamw(betas: (f32, f32), eps: f32, weight_decay: f32, clip: f32) -> Optimizer {
        let p = AdamParams { betas, eps, weight_decay, ..AdamParams::default() };
        Optimizer { kind: OptimizerKind::Adam(p), clip }
    }

    /// f32 state buffers per element (Adam 2, Lion 1, SGD 1 with momentum, else 0).
    pub fn states(&self) -> usize {
        self.kind.state_names().len()
    }

    /// Whether the host step of optimizer offload (`offload::HostStep`) runs it: every
    /// elementwise optimizer (all but LAMB).
    pub fn offloadable(&self) -> bool {
        tessera_kernels::cuda::optim::elementwise(&self.kind)
    }
}

/// ZeRO-Offload of the optimizer to host memory (`offload_optimizer.device = "cpu"`).
#[derive(Clone, Copy, Debug)]
pub struct OffloadOptions {
    /// Share of each unit's optimizer piece stepped on the host (`offload_optimizer.ratio`).
    pub ratio: f64,
    /// CPU threads of the host step.
    pub threads: usize,
}

/// A rank's model states by kind, as the device holds them, and what offload keeps on the host.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StateBytes {
    /// On the device: bf16 parameters (with stage 3's gather buffers), f32 gradients (the
    /// micro-batch tree's buffers and the reduced shard), fp32 masters + moments + decay mask.
    pub device: ResidentBytes,
    /// fp32 masters and moments (and their decay mask) in host memory.
    pub host_optim: u64,
    /// Page-locked staging buffers (gradient in, bf16 parameters out).
    pub host_staging: u64,
    /// NVMe optimizer offload: the swap files of the host parts' masters and moments (whole
    /// `aio.block_size` blocks per unit); `host_optim` then holds only their decay mask.
    pub nvme: u64,
    /// Parameter offload (stage 3): the bf16 shard's pieces in page-locked host memory (with
    /// NVMe: those within `max_in_cpu`, and the bounce buffers), and the parameter swap file.
    pub host_params: u64,
    pub nvme_params: u64,
}

/// Where a planned rank's optimizer and parameters go besides its device.
#[derive(Clone, Copy, Debug, Default)]
pub struct OffloadPlanned<'a> {
    /// `offload_optimizer.ratio` (optimizer offload on).
    pub ratio: Option<f64>,
    /// Optimizer offload to NVMe: the swap files' block size.
    pub nvme_block: Option<usize>,
    /// `offload_param` (stage 3).
    pub params: Option<&'a ParamOffloadOptions>,
}

/// The model-state bytes a rank of this geometry will hold, before anything is allocated
/// (the budget check at start uses it; [`Rank::state_bytes`] counts the same).
/// `states`: the optimizer's f32 state buffers per element ([`Optimizer::states`]);
/// `off`: what goes to host memory or NVMe (optimizer offload, parameter offload).
pub fn planned_state_bytes(
    model: &Model,
    stage: u8,
    world: usize,
    m_local: usize,
    states: usize,
    off: OffloadPlanned<'_>,
) -> Result<StateBytes> {
    let OffloadPlanned { ratio, nvme_block, params: poff } = off;
    let opt_world = if stage == 0 { 1 } else { world.max(1) };
    let layout = GpuLayout::new(model, opt_world)?;
    let split = Split::new((0..layout.units.len()).map(|u| layout.piece(u, 0).len()).collect(), ratio.unwrap_or(0.0));
    let levels = tree_levels(m_local) as u64;
    let (total, shard) = (layout.total as u64, layout.shard_len() as u64);
    let (mut host_params, mut nvme_params) = (0, 0);
    let params = if stage == 3 {
        let blk = layout.units.get(1).map_or(0, |r| r.len()) as u64;
        let gathered = (layout.units[0].len() as u64 + 2 * blk) * 2;
        match poff {
            None => shard * 2 + gathered,
            Some(o) => {
                let pieces: Vec<usize> = (0..layout.units.len()).map(|u| layout.piece(u, 0).len()).collect();
                let host = ParamHost::plan(&pieces, o);
                (host_params, nvme_params) = (host.0, host.1);
                gathered + offloaded_param_buffers(&pieces, &split, world) * 2
            }
        }
    } else {
        total * 2
    };
    let gshard = if stage >= 1 && world > 1 { shard } else { 0 };
    let staged: u64 = split.host.iter().filter(|&&h| h > 0).map(|&h| h as u64 * 6).sum();
    // fp32 masters, the state buffers and the one-byte decay mask, per element.
    let per_elem = 4 + 4 * states as u64 + 1;
    Ok(StateBytes {
        device: ResidentBytes { params, grads: (levels * total + gshard) * 4, optim: split.dev_total as u64 * per_elem },
        host_optim: split.host_total as u64 * if nvme_block.is_some() { 1 } else { per_elem },
        nvme: nvme_block.map_or(0, |b| split.host.iter().map(|&h| ((h * 4).div_ceil(b) * b) as u64).sum::<u64>() * 3),
        host_staging: staged,
        host_params,
        nvme_params,
    })
}

/// Parameter offload: the device buffers a rank adds (elements) — with several ranks two piece
/// buffers the all-gathers read from, and the device optimizer's output buffer (the largest
/// device part of a piece).
fn offloaded_param_buffers(pieces: &[usize], split: &Split, world: usize) -> u64 {
    let big = pieces.iter().copied().max().unwrap_or(0);
    let dev = (0..pieces.len()).map(|u| pieces[u] - split.host[u]).max().unwrap_or(0);
    (if world > 1 { 2 * big } else { 0 } + dev) as u64
}

/// Buffers the micro-batch tree holds at once for `m_local` micro-batches: ⌊log2 M⌋ + 1.
fn tree_levels(m_local: usize) -> usize {
    usize::BITS as usize - m_local.max(1).leading_zeros() as usize
}

/// The last micro-batch's tree adds `(dst slot, src slot)`, done unit by unit in its backward,
/// and the slot that then holds the rank's summed gradient.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Tail {
    merges: Vec<(usize, usize)>,
    fin: usize,
}

/// The adds the micro-batch tree does once leaf `slot` (the last micro-batch) is pushed on
/// `stack` ((level, slot) pairs): equal levels merge, then everything collapses — the order of
/// [`Rank::step`]'s whole-buffer adds for the earlier micro-batches.
fn tail_plan(stack: &[(u32, usize)], slot: usize) -> Tail {
    let mut st = stack.to_vec();
    st.push((0, slot));
    let mut merges = Vec::new();
    while st.len() >= 2 && st[st.len() - 1].0 == st[st.len() - 2].0 {
        let (lv, top) = st.pop().expect("len ≥ 2");
        let below = st.last_mut().expect("len ≥ 1");
        merges.push((below.1, top));
        below.0 = lv + 1;
    }
    while st.len() >= 2 {
        let (_, top) = st.pop().expect("len ≥ 2");
        merges.push((st.last().expect("len ≥ 1").1, top));
    }
    Tail { merges, fin: st[0].1 }
}

pub struct Rank {
    pub gpu: Arc<Gpu>,
    /// `zero_optimization.overlap_comm`: collectives on the communication stream overlap the
    /// compute stream (default). Off: the compute stream waits for each one as it is issued.
    pub overlap: bool,
    comm: Option<NcclComm>,
    cstream: Arc<CudaStream>,
    /// The optimizer stream: units stepped during the backward (see the module notes).
    ostream: Arc<CudaStream>,
    /// Step each unit's optimizer as soon as its gradient is final (one GPU, no clipping);
    /// default on, `TESSERA_GPU_EARLY_ADAM=0` turns it off.
    pub early_adam: bool,
    /// Units this step's optimizer already ran for (on `ostream`).
    stepped: Vec<bool>,
    pub rank: usize,
    pub world: usize,
    pub stage: u8,
    pub layout: GpuLayout,
    /// Stage ≤ 2: full bf16 parameters (padded layout). Stage 3: this rank's shard.
    params: Buf<bf16>,
    /// Stage 3 only: the gathered embedding unit and two rotating block buffers.
    u0: Option<Buf<bf16>>,
    pool: Vec<Buf<bf16>>,
    /// Parameter offload (stage 3): the shard off the device (`params` is then empty), the two
    /// piece buffers the all-gathers read (several ranks) and the device optimizer's output.
    phost: Option<ParamHost>,
    dpiece: Vec<Buf<bf16>>,
    opiece: Option<Buf<bf16>>,
    /// Optimizer shard (stage ≥ 1) or everything (stage 0): fp32 masters and the optimizer's
    /// state (`m`: Adam's and Lion's `exp_avg`, SGD's momentum buffer; `v`: Adam's `exp_avg_sq`;
    /// empty where the optimizer keeps no such buffer) — the device parts of the pieces
    /// ([`Split`]; all of them without offload).
    master: Buf<f32>,
    m: Buf<f32>,
    v: Buf<f32>,
    decay: Buf<u8>,
    /// Reduced gradient shard (stage ≥ 1, world > 1); otherwise the gradient buffer itself is used.
    gshard: Option<Buf<f32>>,
    /// Micro-batch gradient buffers (full, padded): a stack for the fixed micro-batch tree.
    gbufs: Vec<Buf<f32>>,
    norm_partials: Buf<f64>,
    norm_all: Buf<f64>,
    ws: Option<Workspace>,
    optim: Optimizer,
    /// fp16 gradients with a loss scale (see the module notes).
    fp16: bool,
    step: u64,
    /// Per-unit "parameters are ready" events (gathers of stages 1–3).
    ready: Vec<Option<CudaEvent>>,
    /// Stage 3: "block use k is gathered" events.
    pool_ready: std::collections::HashMap<usize, CudaEvent>,
    /// Per-position losses of this step's micro-batches (copied out of the workspace).
    losses: Buf<f32>,
    /// Which part of each unit's piece is stepped on the host.
    split: Split,
    off: Option<Offload>,
    /// The step prepared and not yet committed or abandoned.
    staged: Option<StagedStep>,
    /// LAMB (one GPU, or ZeRO-0): the CPU layout's norm slots on the device and the update
    /// scratch `u` (as long as the masters).
    lamb: Option<(LambSlots, Buf<f32>)>,
    /// Why this rank refuses further steps (a commit that failed part-way, an abandoned step
    /// whose update had begun).
    torn: Option<String>,
}

/// A prepared step ([`Rank::prepare`]).
enum StagedStep {
    /// The update is still to run: the gradient's slot, the optimizer's scalars, the clipping
    /// coefficient.
    Pending { fin: usize, hp: OptimStep, scale: f32 },
    /// The update ran with the backward (optimizer offload).
    Applied,
    /// fp16 with optimizer offload: the gradient overflowed, so nothing was updated (the host
    /// worker handed its units back unstepped); the step can only be skipped.
    Overflowed,
}

/// What a step's computation leaves for its update.
struct Computed {
    fin: usize,
    /// The global norm of the unscaled gradient (when clipping, or with fp16).
    norm: Option<f64>,
    /// The gradient's multiplier in the update: 1/loss scale times the clipping coefficient.
    scale: f32,
    overflow: bool,
}

/// What [`Rank::prepare`] reports of a step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Prepared {
    /// The mean loss of this rank's micro-batches (unscaled).
    pub loss: f32,
    /// The global norm of the unscaled gradient, when clipping or with fp16.
    pub norm: Option<f64>,
    /// fp16: the gradient overflowed (its norm is not finite), the same on every rank.
    pub overflow: bool,
}

/// What a [`Rank`] is built from, besides its GPU and its communicator.
pub struct RankSpec<'a> {
    pub model: &'a Model,
    /// `zero_optimization.stage`, 0 to 3.
    pub stage: u8,
    /// One micro-batch's shape.
    pub shape: Shape,
    /// The initial parameters (CPU layout, f32).
    pub init: &'a [f32],
    pub optim: Optimizer,
    /// This rank's micro-batches per step (sizes the micro-batch tree and the loss buffer).
    pub m_local: usize,
    pub offload: Option<OffloadOptions>,
    /// Activation checkpointing (see [`Workspace::with_options`]).
    pub recompute: bool,
    /// fp16 gradients with a loss scale (see the module notes).
    pub fp16: bool,
    /// Optimizer offload to NVMe (`offload_optimizer.device = "nvme"`): where the host parts'
    /// masters and moments live instead of host memory (with `offload`).
    pub nvme: Option<&'a super::offload::NvmeSite>,
    /// Parameter offload (`offload_param`, stage 3): where the bf16 shard lives instead.
    pub params_offload: Option<&'a ParamOffloadOptions>,
}

impl RankSpec<'_> {
    /// Refuses a stage or an offload this rank cannot run.
    fn validate(&self) -> Result<()> {
        let stage = self.stage;
        if stage > 3 {
            bail!("zero_optimization.stage = {stage}: expected 0, 1, 2 or 3");
        }
        if self.offload.is_some() && stage == 0 {
            bail!("zero_optimization.offload_optimizer needs ZeRO stage 1, 2 or 3 (the optimizer shard is what moves to the host); this run has stage 0");
        }
        if let Some(o) = self.offload.filter(|o| !(0.0..=1.0).contains(&o.ratio)) {
            bail!("zero_optimization.offload_optimizer.ratio = {}: expected a share from 0 to 1", o.ratio);
        }
        if self.params_offload.is_some() && !tessera_kernels::cuda::optim::elementwise(&self.optim.kind) {
            bail!(
                "optimizer.type = \"Lamb\" with zero_optimization.offload_param: LAMB's update on GPU ranks runs over every tensor \
                 held on the device at once; drop offload_param, or use --device cpu"
            );
        }
        if self.nvme.is_some() && self.offload.is_none() {
            bail!("NVMe optimizer offload without offload options: the rank needs offload_optimizer's ratio and threads");
        }
        if let Some(p) = self.params_offload {
            if stage != 3 {
                bail!("zero_optimization.offload_param needs ZeRO stage 3 (the stage with parameter shards); this rank has stage {stage}");
            }
            let partial = self.offload.is_some_and(|o| o.ratio > 0.0 && o.ratio < 1.0);
            if p.nvme.is_some() && partial {
                bail!(
                    "zero_optimization.offload_param.device = \"nvme\" with offload_optimizer.ratio strictly between 0 and 1: a \
                     piece on NVMe is written whole, by the host or by the GPU optimizer; use ratio 1 or 0, or offload_param.device = \"cpu\""
                );
            }
        }
        if let Some(o) = self.offload {
            refuse_partial_lamb_offload(!self.optim.offloadable(), o.ratio, self.nvme.is_some())?;
        }
        Ok(())
    }
}

/// LAMB's trust ratios need each tensor's norms over the CPU's fixed slots (tensor ∩ 16384-element
/// block); a rank runs LAMB where it holds every tensor (one GPU, or ZeRO-0). With ZeRO 1–3 on
/// several GPUs the ranks' pieces (units / world, padded) split slots, so it is refused.
pub fn refuse_split_lamb(lamb: bool, stage: u8, world: usize) -> Result<()> {
    if lamb && stage >= 1 && world > 1 {
        bail!(
            "optimizer.type = \"Lamb\" with zero_optimization.stage = {stage} on {world} GPUs: LAMB's per-tensor trust ratios \
             need each tensor's norm over the CPU's fixed 16384-element blocks, which the GPU ranks' ZeRO pieces split (their \
             partial sums are not exchanged); use zero_optimization.stage = 0 or one GPU for LAMB, or --device cpu"
        );
    }
    Ok(())
}

/// Refuses LAMB with optimizer offload on NVMe or of a `ratio` below 1: its host step
/// ([`super::lamb_host`]) needs every tensor's state in host memory.
pub fn refuse_partial_lamb_offload(lamb: bool, ratio: f64, nvme: bool) -> Result<()> {
    if lamb && (nvme || ratio < 1.0) {
        bail!(
            "zero_optimization.offload_optimizer.device = \"{}\" (ratio {}) with optimizer.type = \"Lamb\": the GPU ranks' \
             LAMB host step needs every tensor's state in host memory (its trust ratios span whole tensors, and it reads the \
             state twice a step); use device \"cpu\" with ratio 1, another optimizer, or --device cpu",
            if nvme { "nvme" } else { "cpu" },
            ratio as f32 // as the config holds it
        );
    }
    Ok(())
}

/// This rank's optimizer shard of the padded parameters and of the decay mask, unit piece by
/// unit piece.
fn optimizer_shard(layout: &GpuLayout, padded: &[f32], opt_rank: usize) -> (Vec<f32>, Vec<u8>) {
    let shard_len = layout.shard_len();
    let mut master_h = Vec::with_capacity(shard_len);
    let mask_full = layout.decay_mask();
    let mut mask_h = Vec::with_capacity(shard_len);
    for u in 0..layout.units.len() {
        let p = layout.piece(u, opt_rank);
        master_h.extend_from_slice(&padded[p.clone()]);
        mask_h.extend_from_slice(&mask_full[p]);
    }
    (master_h, mask_h)
}

impl Rank {
    /// Builds rank `comm.rank()` of `comm.world()` (rank 0 of 1 without a communicator) as
    /// `spec` describes.
    pub fn new(gpu: Arc<Gpu>, comm: Option<NcclComm>, spec: RankSpec<'_>) -> Result<Rank> {
        spec.validate()?;
        let RankSpec { model, stage, shape, init, optim, m_local, offload, recompute, fp16, nvme, params_offload } = spec;
        let (rank, world) = comm.as_ref().map_or((0, 1), |c| (c.rank(), c.world()));
        refuse_split_lamb(matches!(optim.kind, OptimizerKind::Lamb(_)), stage, world)?;
        // Stage 0 shards nothing: one piece holds every unit.
        let opt_world = if stage == 0 { 1 } else { world };
        let layout = GpuLayout::new(model, opt_world)?;
        let opt_rank = if stage == 0 { 0 } else { rank };
        let padded: Vec<f32> = layout.pad(init);
        let shard_len = layout.shard_len();
        let (master_h, mask_h) = optimizer_shard(&layout, &padded, opt_rank);
        // In parallel: a 1.3B model's parameters are 1.3 G conversions (same bits in any order).
        let to_bf = |x: &[f32]| {
            use rayon::prelude::*;
            x.par_iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>()
        };
        let pieces: Vec<usize> = (0..layout.units.len()).map(|u| layout.piece(u, opt_rank).len()).collect();
        let phost = match params_offload {
            Some(o) => Some(ParamHost::new(&gpu, rank, &pieces, &to_bf(&master_h), o)?),
            None => None,
        };
        let params = match (stage, &phost) {
            (3, Some(_)) => gpu.alloc::<bf16>(0)?,
            (3, None) => gpu.upload(&to_bf(&master_h))?,
            _ => gpu.upload(&to_bf(&padded))?,
        };
        let (u0, pool) = if stage == 3 {
            let blk = layout.units.get(1).map_or(0, |r| r.len());
            (Some(gpu.alloc::<bf16>(layout.units[0].len())?), vec![gpu.alloc::<bf16>(blk)?, gpu.alloc::<bf16>(blk)?])
        } else {
            (None, Vec::new())
        };
        let split =
            Split::new((0..layout.units.len()).map(|u| layout.piece(u, opt_rank).len()).collect(), offload.map_or(0.0, |o| o.ratio));
        let (master_host, master_dev) = split.cut(&master_h);
        let (mask_host, mask_dev) = split.cut(&mask_h);
        let (dpiece, opiece) = match &phost {
            Some(_) => {
                let big = pieces.iter().copied().max().unwrap_or(0);
                let dpiece = if world > 1 { vec![gpu.alloc::<bf16>(big)?, gpu.alloc::<bf16>(big)?] } else { Vec::new() };
                let dev = (0..pieces.len()).map(|u| pieces[u] - split.host[u]).max().unwrap_or(0);
                (dpiece, Some(gpu.alloc::<bf16>(dev)?))
            }
            None => (Vec::new(), None),
        };
        let master = gpu.upload(&master_dev)?;
        let (states, init) = (optim.states(), optim.kind.state_init());
        let state_buf = |k: usize| {
            let n = if states > k { split.dev_total } else { 0 };
            if init == 0.0 {
                gpu.alloc::<f32>(n)
            } else {
                gpu.upload(&vec![init; n])
            }
        };
        let (m, v) = (state_buf(0)?, state_buf(1)?);
        let decay = gpu.upload(&mask_dev)?;
        let flat = || FlatLayout::new(model.layout().segments()).context("LAMB's norm layout");
        let lamb_host = match (optim.kind, offload) {
            (OptimizerKind::Lamb(_), Some(_)) => {
                let host_units: Vec<_> = (0..layout.units.len()).map(|u| split.host_range(u)).collect();
                Some(LambHost::new(flat()?, &layout.tensor_starts(), &layout.units, &host_units)?)
            }
            _ => None,
        };
        let off = match offload {
            None => None,
            Some(o) => Some(Offload::new(&gpu, rank, &split, (master_host, mask_host), (states, init), o, (nvme, lamb_host))?),
        };
        let gshard = if stage >= 1 && world > 1 { Some(gpu.alloc::<f32>(shard_len)?) } else { None };
        // The micro-batch tree holds at most ⌊log2 M⌋ + 1 partial sums at once.
        let levels = tree_levels(m_local);
        let mut gbufs = Vec::new();
        for _ in 0..levels {
            gbufs.push(gpu.alloc::<f32>(layout.total)?);
        }
        let nblocks = shard_len / gpt::ALIGN;
        let norm_partials = gpu.alloc::<f64>(nblocks)?;
        let norm_all = gpu.alloc::<f64>(nblocks * world)?;
        let ws = Some(Workspace::with_options(&gpu, shape, &layout, gpt::Fusions::requested()?, recompute)?);
        let losses = gpu.alloc::<f32>(shape.n() * m_local.max(1))?;
        let cstream = gpu.ctx.new_stream().map_err(cuda::drv("creating the communication stream"))?;
        let ostream = gpu.ctx.new_stream().map_err(cuda::drv("creating the optimizer stream"))?;
        // (With optimizer offload LAMB steps on the host: `lamb_host` above.)
        let lamb = match (optim.kind, offload) {
            (OptimizerKind::Lamb(_), None) => {
                Some((LambSlots::new(&gpu, &flat()?, &layout.tensor_starts())?, gpu.alloc::<f32>(shard_len)?))
            }
            _ => None,
        };
        let n_units = layout.units.len();
        Ok(Rank {
            gpu,
            comm,
            overlap: true,
            cstream,
            ostream,
            early_adam: std::env::var("TESSERA_GPU_EARLY_ADAM").map_or(true, |v| v.trim() != "0"),
            stepped: vec![false; n_units],
            rank,
            world,
            stage,
            layout,
            params,
            u0,
            pool,
            phost,
            dpiece,
            opiece,
            master,
            m,
            v,
            decay,
            gshard,
            gbufs,
            norm_partials,
            norm_all,
            ws,
            optim,
            fp16,
            step: 0,
            ready: (0..n_units).map(|_| None).collect(),
            pool_ready: std::collections::HashMap::new(),
            losses,
            split,
            off,
            lamb,
            staged: None,
            torn: None,
        })
    }

    fn comm(&self) -> &NcclComm {
        self.comm.as_ref().expect("collectives are only issued when world > 1")
    }

    /// Without overlap, the compute stream waits for the collective just issued.
    fn comm_issued(&self) -> Result<()> {
        if !self.overlap && self.world > 1 {
            self.order(&self.cstream, &self.gpu.stream)?;
        }
        Ok(())
    }

    /// Makes `to` wait for everything enqueued so far on `from`.
    fn order(&self, from: &CudaStream, to: &CudaStream) -> Result<()> {
        let ev = from.record_event(None).map_err(cuda::drv("recording an event"))?;
        to.wait(&ev).map_err(cuda::drv("waiting on an event"))?;
        Ok(())
    }

    /// One optimizer step over `mbs` (this rank's micro-batches, in global order):
    /// [`Rank::prepare`] then [`Rank::commit`]. Returns the mean loss of this rank's
    /// micro-batches and the global gradient norm (if clipping).
    pub fn step(&mut self, mbs: &[(Vec<u32>, Vec<u32>)], lr: f32, dloss: f32) -> Result<(f32, Option<f64>)> {
        let p = self.prepare(mbs, lr, dloss, 1.0)?;
        self.commit()?;
        Ok((p.loss, p.norm))
    }

    /// The first half of a step, the step transaction's prepare: forward, backward, the
    /// micro-batch tree, the reductions and the gradient norm, with AdamW's hyper-parameters
    /// at `lr`. Nothing is updated, except where the update overlaps the backward: units stepped
    /// early ([`Rank::early_adam_active`]) and, with optimizer offload, the whole update (the
    /// host threads step each unit as its gradient arrives). An abandoned step of that kind
    /// leaves the rank unusable ([`Rank::abandon`]). Returns the mean loss of this rank's
    /// micro-batches, the global gradient norm (if clipping, or with fp16) and, with fp16, whether
    /// the gradient overflowed. `loss_scale` multiplies `dloss` for the backward and divides the
    /// gradient in the update (1 without fp16).
    pub fn prepare(&mut self, mbs: &[(Vec<u32>, Vec<u32>)], lr: f32, dloss: f32, loss_scale: f32) -> Result<Prepared> {
        if !(loss_scale.is_finite() && loss_scale > 0.0) || (!self.fp16 && loss_scale != 1.0) {
            bail!(
                "rank {}: loss scale {loss_scale} (this rank's fp16 is {}): expected 1 without fp16, a finite value > 0 with it",
                self.rank,
                self.fp16
            );
        }
        if let Some(why) = &self.torn {
            bail!("rank {}: {why}", self.rank);
        }
        let m_local = mbs.len();
        if m_local == 0 || m_local * self.ws_n() > self.losses.len() {
            bail!("rank {} was given {m_local} micro-batches; it was built for {}", self.rank, self.losses.len() / self.ws_n());
        }
        self.staged = None;
        let hp = OptimStep::new(&self.optim.kind, lr, self.step + 1)?;
        let Some(off) = self.off.as_mut() else {
            self.stepped.fill(false);
            let c = self.compute(mbs, dloss * loss_scale, loss_scale, &hp, None)?;
            let loss = self.local_loss(m_local)?;
            self.staged = Some(StagedStep::Pending { fin: c.fin, hp, scale: c.scale });
            return Ok(Prepared { loss, norm: c.norm, overflow: c.overflow });
        };
        let host_hp = match hp {
            OptimStep::Adam(a) => offload::HostStep::Adam(a),
            OptimStep::Lamb(l) => offload::HostStep::Lamb(l),
            _ => offload::HostStep::Cpu(
                ElementwiseStep::new(&self.optim.kind, lr, self.step + 1)
                    .with_context(|| format!("rank {}: the host step of {}", self.rank, self.optim.kind.name()))?,
            ),
        };
        let mut host = off.host.take().context("the host optimizer state was lost in an earlier failed step")?;
        let split = self.split.clone();
        // Known before the backward only without clipping and fp16 (no norm, no overflow to wait for).
        let known_scale = (self.optim.clip <= 0.0 && !self.fp16).then_some(1.0);
        let rank = self.rank;
        let (res, stats) = offload::run_step(&mut host, &split, host_hp, rank, known_scale, |tx, pipe| {
            if let Some(o) = self.off.as_mut() {
                o.tx = Some(tx);
            }
            self.stepped.fill(false);
            let res = self.compute(mbs, dloss * loss_scale, loss_scale, &hp, Some(&pipe)).and_then(|c| {
                if c.overflow {
                    // The worker hands the units back unstepped; the device part is not updated.
                    self.take_back_units(pipe)?;
                } else {
                    self.update(c.fin, &hp, c.scale, Some(pipe))?;
                }
                Ok(Prepared { loss: self.local_loss(m_local)?, norm: c.norm, overflow: c.overflow })
            });
            // Ends the worker if the step stopped early (it waits for units that will not come).
            if let Some(o) = self.off.as_mut() {
                o.tx = None;
            }
            res
        });
        let off = self.off.as_mut().expect("offload state present");
        off.host = Some(host);
        match stats {
            Some(Ok(Ok(st))) => off.stats.add(&st),
            Some(Ok(Err(e))) => {
                self.torn = Some(format!("the host optimizer state was not written back ({e})"));
                bail!("rank {}: {e}", self.rank)
            }
            Some(Err(_)) => bail!("rank {}: the host optimizer thread panicked", self.rank),
            None => {}
        }
        if let Ok(p) = &res {
            self.staged = Some(if p.overflow { StagedStep::Overflowed } else { StagedStep::Applied });
        }
        res
    }

    /// The second half of a step, the step transaction's commit: AdamW over the units not
    /// stepped yet and the gathers of the new parameters.
    pub fn commit(&mut self) -> Result<()> {
        match self.staged.take() {
            Some(StagedStep::Pending { fin, hp, scale }) => self.update(fin, &hp, scale, None).inspect_err(|e| {
                self.torn = Some(format!("a failed commit left the optimizer state part-way through a step ({e:#})"));
            }),
            Some(StagedStep::Applied) => Ok(()),
            Some(StagedStep::Overflowed) => {
                bail!("rank {}: commit of a step whose fp16 gradient overflowed (nothing was updated): skip it", self.rank)
            }
            None => bail!("rank {}: commit without a prepared step", self.rank),
        }
    }

    /// The loss scaler skips the prepared step (an fp16 overflow): nothing is updated, the
    /// optimizer's step count stays, and the rank takes the next step as if this one had not
    /// been prepared. Only a step whose update has not begun can be skipped (with fp16 it never
    /// begins before the commit).
    pub fn skip(&mut self) -> Result<()> {
        match self.staged.take() {
            Some(StagedStep::Pending { .. }) if !self.stepped.iter().any(|&s| s) => Ok(()),
            Some(StagedStep::Overflowed) => Ok(()),
            Some(_) => {
                self.torn = Some("a skipped step had already updated units during its backward".into());
                bail!("rank {}: the step to skip had already updated units (the optimizer ran during the backward)", self.rank)
            }
            None => bail!("rank {}: skip without a prepared step", self.rank),
        }
    }

    /// Drops a prepared step. The committed state is untouched unless the update already
    /// overlapped the backward ([`Rank::prepare`]): then the rank refuses every later step.
    pub fn abandon(&mut self) {
        let applied = match self.staged.take() {
            Some(StagedStep::Applied) => true,
            Some(StagedStep::Pending { .. }) => self.stepped.iter().any(|&s| s),
            Some(StagedStep::Overflowed) | None => false,
        };
        if applied {
            self.torn = Some(
                "an abandoned step had already updated units during its backward (early AdamW or optimizer offload): the \
                 state is neither the step before nor the step after"
                    .into(),
            );
        }
    }

    /// The prepare's computation: every micro-batch ([`Rank::micro_batches`]), the wait for
    /// the reductions, the global norm and the clipping coefficient (sent to the host optimizer
    /// through `pipe` when it waits for it).
    fn compute(
        &mut self,
        mbs: &[(Vec<u32>, Vec<u32>)],
        dloss: f32,
        loss_scale: f32,
        hp: &OptimStep,
        pipe: Option<&Pipe>,
    ) -> Result<Computed> {
        let fin = self.micro_batches(mbs, dloss, hp)?;
        self.gpu.mark("micro-batch tree");
        // Optimizer input: this rank's reduced pieces.
        if self.world > 1 {
            self.order(&self.cstream, &self.gpu.stream)?;
        }
        self.gpu.mark("wait for reductions");
        let gshard = self.gshard_ptr(fin);
        // The norm of the scaled gradient / the scale (a power of two unless static: exact).
        let need_norm = self.optim.clip > 0.0 || self.fp16;
        let norm = if need_norm { Some(self.grad_norm(gshard)? / f64::from(loss_scale)) } else { None };
        self.gpu.mark("gradient norm");
        let overflow = self.fp16 && norm.is_some_and(|n| !n.is_finite());
        let clip = match norm {
            Some(n) if self.optim.clip > 0.0 && n > self.optim.clip as f64 => (self.optim.clip as f64 / (n + 1e-6)) as f32,
            _ => 1.0,
        };
        let scale = clip * (1.0 / loss_scale);
        if let (Some(p), true) = (pipe, self.optim.clip > 0.0 || self.fp16) {
            // The host worker waits for this (`None`: skip). A worker that already stopped
            // reports why through `done`.
            let _ = p.scale.send((!overflow).then_some(scale));
        }
        Ok(Computed { fin, norm, scale, overflow })
    }

    /// The optimizer input: this rank's reduced pieces, or the full buffer in gradient slot
    /// `fin` (stage 0, or one rank: layout world 1).
    fn gshard_ptr(&self, fin: usize) -> DPtr<f32> {
        match &self.gshard {
            Some(b) => b.ptr(),
            None => self.gbufs[fin].ptr(),
        }
    }

    /// The update: the optimizer over every unit not stepped during the backward, the stage 1–2
    /// parameter gathers, and the host units' return (offload).
    fn update(&mut self, fin: usize, hp: &OptimStep, scale: f32, pipe: Option<Pipe>) -> Result<()> {
        let gshard = self.gshard_ptr(fin);
        if let (Some((slots, u)), OptimStep::Lamb(l)) = (self.lamb.as_mut(), hp) {
            // Every tensor is on this device (one GPU or ZeRO-0, no offload: checked at start).
            let bufs = ops::OptimBufs {
                master: self.master.ptr(),
                param: self.params.ptr(),
                grad: gshard,
                m: self.m.ptr(),
                v: self.v.ptr(),
                decay: self.decay.ptr(),
            };
            cuda::lamb::step(&self.gpu, &self.gpu.stream, slots, &bufs, u.ptr(), l, scale)?;
            self.step += 1;
            self.gpu.mark("optimizer");
            return Ok(());
        }
        self.step += 1;
        let gathers = self.world > 1 && (self.stage == 1 || self.stage == 2);
        for u in 0..self.layout.units.len() {
            if !self.stepped[u] {
                let s = self.gpu.stream.clone();
                self.optim_unit(u, gshard, hp, scale, &s)?;
            }
            let h = self.split.host[u];
            if gathers && h == 0 {
                // Gather this unit's updated bf16 parameters while the optimizer moves on to the
                // next unit; the next forward waits per unit.
                self.order(&self.gpu.stream, &self.cstream)?;
                self.gather_unit(u)?;
            }
        }
        if self.stepped.iter().any(|&s| s) {
            // What follows (the next step's zeroing of the gradient, reads of the state) comes
            // after the units stepped during the backward.
            self.order(&self.ostream, &self.gpu.stream)?;
        }
        self.gpu.mark("optimizer");
        if let Some(p) = pipe {
            self.land_host_units(p, gathers)?;
        }
        Ok(())
    }

    /// The mean of the per-position losses of this step's `m_local` micro-batches.
    fn local_loss(&self, m_local: usize) -> Result<f32> {
        let losses = self.gpu.download(self.losses.slice(0..m_local * self.ws_n()))?;
        Ok((losses.iter().map(|&x| x as f64).sum::<f64>() / losses.len() as f64) as f32)
    }

    /// Forward and backward of every micro-batch, summed by the micro-batch tree (the last one
    /// finishes the tree, the reductions and the host copies unit by unit during its backward,
    /// and steps units early where [`Rank::early_adam_active`]). Returns the slot of the gradient
    /// buffer that holds this rank's summed gradient.
    fn micro_batches(&mut self, mbs: &[(Vec<u32>, Vec<u32>)], dloss: f32, hp: &OptimStep) -> Result<usize> {
        let m_local = mbs.len();
        let mut stack: Vec<(u32, usize)> = Vec::new();
        let mut free: Vec<usize> = (0..self.gbufs.len()).rev().collect();
        let n = self.ws_n();
        let mut fin = 0;
        // Without clipping the scale is 1 before the backward ends, and one GPU has no reduction
        // to wait for: each unit can be stepped as its gradient is finished.
        let early = self.early_adam_active().then_some(hp);
        for (i, (tok, tgt)) in mbs.iter().enumerate() {
            let slot = free.pop().context("micro-batch tree ran out of buffers")?;
            let g = self.gbufs[slot].ptr();
            // (The previous step's reductions and copies finished before it returned.)
            self.gpu.zero(g, &self.gpu.stream)?;
            self.gpu.mark("zero grads");
            // The last micro-batch finishes the tree, the reduction and the copy to the host
            // unit by unit during its backward.
            let tail = (i + 1 == m_local).then(|| tail_plan(&stack, slot));
            let mut ws = self.ws.take().expect("workspace present between micro-batches");
            let gpu = self.gpu.clone();
            let res = {
                let mut hooks = Hooks { r: self, grads: g, tail: tail.as_ref(), early, use_idx: 0, uses: Vec::new(), requested: 0 };
                hooks.begin().and_then(|_| gpt::forward_backward(&gpu, &mut hooks, &mut ws, tok, tgt, dloss).map_err(anyhow::Error::from))
            };
            let copied = gpu.copy(self.losses.slice(i * n..(i + 1) * n).cast(), ws.losses().cast(), &gpu.stream);
            self.ws = Some(ws);
            res?;
            copied?;
            if self.fp16 && tail.is_none() {
                // fp16 storage of this micro-batch's gradient (the last one's is rounded unit by
                // unit as its backward finishes each: `Hooks::finish_unit`).
                ops::round_f16(&self.gpu, &self.gpu.stream, g)?;
            }
            if let Some(t) = tail {
                fin = t.fin;
                break;
            }
            stack.push((0, slot));
            while stack.len() >= 2 && stack[stack.len() - 1].0 == stack[stack.len() - 2].0 {
                let (lv, top) = stack.pop().expect("len ≥ 2");
                let (_, below) = *stack.last().expect("len ≥ 1");
                ops::add_f32(&self.gpu, &self.gpu.stream, self.gbufs[below].ptr(), self.gbufs[top].ptr())?;
                if self.fp16 {
                    // Every node of the micro-batch tree is stored in fp16, as the CPU's tree
                    // rounds it (`owner_sums::tree`).
                    ops::round_f16(&self.gpu, &self.gpu.stream, self.gbufs[below].ptr())?;
                }
                free.push(top);
                stack.last_mut().expect("len ≥ 1").0 = lv + 1;
            }
        }
        Ok(fin)
    }

    /// Whether this rank's steps run each unit's optimizer during the backward (see the module
    /// notes; every GPU optimizer but LAMB is elementwise, so any of them may).
    pub fn early_adam_active(&self) -> bool {
        // Parameters on NVMe: the device optimizer's write-back waits for each unit's copy, which
        // would stall the backward; they are stepped after it.
        let swapped = self.phost.as_ref().is_some_and(|p| p.nvme_bytes() > 0);
        self.early_adam && self.world == 1 && self.optim.clip <= 0.0 && !self.fp16 && !swapped && self.optim.offloadable()
    }

    /// The optimizer over the device part of unit `u`'s piece (this rank's, or all of it at
    /// stage 0) on stream `s`, reading the reduced gradient `gshard` (the full buffer with one
    /// rank or at stage 0).
    fn optim_unit(&mut self, u: usize, gshard: DPtr<f32>, hp: &OptimStep, scale: f32, s: &CudaStream) -> Result<()> {
        let opt_rank = if self.stage == 0 { 0 } else { self.rank };
        let off = self.layout.shard_offset(u);
        let piece = self.layout.piece(u, opt_rank);
        let (len, h) = (piece.len(), self.split.host[u]);
        if len <= h {
            return Ok(());
        }
        // The device part of the piece: [h, len).
        let sh = off + h..off + len;
        let dr = self.split.dev_range(u);
        let param = match (&self.opiece, self.stage) {
            // Parameter offload: the new values land in the output buffer, then go back to the host.
            (Some(o), _) => o.slice(0..len - h),
            (None, 3) => self.params.slice(sh.clone()),
            (None, _) => self.params.slice(piece.start + h..piece.end),
        };
        // A state buffer the optimizer does not keep is empty: an empty view stands for it.
        let state = |b: &Buf<f32>| if b.is_empty() { b.slice(0..0) } else { b.slice(dr.clone()) };
        let bufs = ops::OptimBufs {
            master: self.master.slice(dr.clone()),
            param,
            grad: gshard.slice(sh),
            m: state(&self.m),
            v: state(&self.v),
            decay: self.decay.slice(dr.clone()),
        };
        tessera_kernels::cuda::optim::step(&self.gpu, s, &bufs, hp, scale)?;
        if let Some(ph) = self.phost.as_mut() {
            // (The next unit's kernel writes the output buffer after this copy: same stream.)
            ph.store_dev(u, h..len, param, s)?;
        }
        Ok(())
    }

    /// All-gathers unit `u`'s bf16 parameters on the communication stream (after what it was
    /// ordered behind) and records the unit's ready event.
    fn gather_unit(&mut self, u: usize) -> Result<()> {
        let unit = self.params.slice(self.layout.units[u].clone());
        let mine = self.params.slice(self.layout.piece(u, self.rank));
        self.comm().all_gather_bf16(mine, unit, &self.cstream)?;
        self.ready[u] = Some(record(&self.cstream)?);
        self.comm_issued()
    }

    /// Takes each unit the host stepped (in the order it stepped them, the same on every rank),
    /// copies its new bf16 parameters host → device and gathers them (stages 1–2 with several
    /// ranks); the next forward waits per unit.
    fn land_host_units(&mut self, p: Pipe, gathers: bool) -> Result<()> {
        // The device parts' kernels were enqueued above: the gathers also wait for them.
        let dev_done = record(&self.gpu.stream)?;
        // Every gradient is on the host once the copy stream is idle: from then on, the time
        // until the host step ends is not hidden behind the GPU.
        if let Some(o) = &self.off {
            o.d2h.synchronize().map_err(cuda::drv("waiting for the gradient copies to the host"))?;
        }
        let arrived = std::time::Instant::now();
        for _ in 0..p.expected {
            let st = self.host_unit(&p)?;
            let u = st.u;
            let h = self.split.host[u];
            let dst = if self.stage == 3 {
                let off = self.layout.shard_offset(u);
                off..off + h
            } else {
                let start = self.layout.piece(u, if self.stage == 0 { 0 } else { self.rank }).start;
                start..start + h
            };
            let o = self.off.as_mut().expect("a pipe implies offload");
            if let Some(ph) = self.phost.as_mut() {
                // Parameter offload: the new values go to the host shard itself (stage 3).
                let vals = st.param.as_slice().map_err(cuda::drv("reading a parameter staging buffer"))?;
                ph.store_host(u, 0..h, &vals[..h])?;
                o.staging[u] = Some(st);
                continue;
            }
            {
                let mut view = self.params.inner_mut().slice_mut(dst);
                o.h2d.memcpy_htod(&st.param, &mut view).map_err(cuda::drv(format!("copying unit {u}'s parameters host → device")))?;
            }
            let ev = record(&o.h2d)?;
            let mut st = st;
            st.param_free = Some(offload::blocking_event(&o.h2d)?);
            o.staging[u] = Some(st);
            if gathers {
                self.cstream.wait(&ev).map_err(cuda::drv("waiting for a parameter copy"))?;
                self.cstream.wait(&dev_done).map_err(cuda::drv("waiting for the device optimizer"))?;
                self.gather_unit(u)?;
            } else if self.stage != 3 {
                self.ready[u] = Some(ev);
            }
        }
        if let Some(o) = self.off.as_mut() {
            o.stats.exposed_s += arrived.elapsed().as_secs_f64();
        }
        if self.stage == 3 {
            // The next forward's gathers read the parameter shard the copies wrote.
            let o = self.off.as_ref().expect("a pipe implies offload");
            let ev = record(&o.h2d)?;
            self.cstream.wait(&ev).map_err(cuda::drv("waiting for the parameter copies"))?;
        }
        self.gpu.mark("host optimizer");
        Ok(())
    }

    /// The next unit the host worker hands back (stepped, or not when the step overflowed).
    fn host_unit(&self, p: &Pipe) -> Result<offload::Staging> {
        match p.done.recv_timeout(offload::HOST_STEP_TIMEOUT) {
            Ok(Ok(st)) => Ok(st),
            Ok(Err(e)) => bail!("rank {}: the host optimizer step failed: {e}", self.rank),
            Err(RecvTimeoutError::Timeout) => bail!(
                "rank {}: the host optimizer step of a unit did not finish within {} s",
                self.rank,
                offload::HOST_STEP_TIMEOUT.as_secs()
            ),
            Err(RecvTimeoutError::Disconnected) => {
                bail!("rank {}: the host optimizer thread stopped before the step was done", self.rank)
            }
        }
    }

    /// fp16 overflow with optimizer offload: takes back every unit the worker hands back
    /// unstepped (its staging buffers, for the next step); nothing is copied or gathered.
    fn take_back_units(&mut self, p: Pipe) -> Result<()> {
        for _ in 0..p.expected {
            let st = self.host_unit(&p)?;
            let u = st.u;
            self.off.as_mut().expect("a pipe implies offload").staging[u] = Some(st);
        }
        self.gpu.mark("host optimizer (skipped)");
        Ok(())
    }

    /// Offload: copies the host part of unit `u`'s reduced gradient (final once `src` reaches
    /// here) to its staging buffer on the copy stream and hands it to the worker.
    fn send_grad(&mut self, u: usize, fin: usize) -> Result<()> {
        let h = self.split.host[u];
        let opt_rank = if self.stage == 0 { 0 } else { self.rank };
        let src_stream = if self.world > 1 { &self.cstream } else { &self.gpu.stream };
        let Some(o) = self.off.as_mut() else { return Ok(()) };
        if h == 0 || o.tx.is_none() {
            return Ok(());
        }
        let mut st = o.staging[u].take().with_context(|| format!("unit {u}'s host staging buffers were lost in an earlier failed step"))?;
        let ev = record(src_stream)?;
        o.d2h.wait(&ev).map_err(cuda::drv("waiting for a reduction"))?;
        let copied = match &self.gshard {
            Some(b) => {
                let off = self.layout.shard_offset(u);
                o.d2h.memcpy_dtoh(&b.inner().slice(off..off + h), &mut st.grad)
            }
            None => {
                let start = self.layout.piece(u, opt_rank).start;
                o.d2h.memcpy_dtoh(&self.gbufs[fin].inner().slice(start..start + h), &mut st.grad)
            }
        };
        copied.map_err(cuda::drv(format!("copying unit {u}'s gradient device → host")))?;
        st.grad_ready = Some(offload::blocking_event(&o.d2h)?);
        let tx = o.tx.as_ref().expect("checked above");
        if tx.send(st).is_err() {
            bail!("rank {}: the host optimizer thread stopped (unit {u}'s gradient had nowhere to go)", self.rank);
        }
        Ok(())
    }

    fn ws_n(&self) -> usize {
        self.ws.as_ref().map_or(0, |w| w.shape().n())
    }

    /// Reduces unit `u` of the gradient buffer `g` on the communication stream (after the
    /// compute stream's work so far).
    fn reduce_unit(&self, u: usize, g: DPtr<f32>) -> Result<()> {
        self.order(&self.gpu.stream, &self.cstream)?;
        let unit = g.slice(self.layout.units[u].clone());
        if self.stage == 0 {
            self.comm().all_reduce_sum_f32(unit, &self.cstream)?;
        } else {
            let gs = self.gshard.as_ref().expect("stage ≥ 1 with world > 1 has a gradient shard");
            let off = self.layout.shard_offset(u);
            let len = self.layout.units[u].len() / self.world;
            self.comm().reduce_scatter_f32(unit, gs.slice(off..off + len), &self.cstream)?;
        }
        self.comm_issued()
    }

    /// Global L2 norm of the reduced gradient: per-block partial sums of squares (blocks of
    /// `ALIGN`, aligned to unit starts), gathered from every rank and added in (unit, block) order
    /// in f64 — the same order for any world size (padding blocks are exact zeros).
    fn grad_norm(&mut self, gshard: DPtr<f32>) -> Result<f64> {
        ops::sum_squares_blocks(&self.gpu, &self.gpu.stream, self.norm_partials.ptr(), gshard, gpt::ALIGN)?;
        let nb = self.norm_partials.len();
        let all = if self.world > 1 && self.stage > 0 {
            self.order(&self.gpu.stream, &self.cstream)?;
            // f64 partials travel as pairs of f32 words (a gather moves bits, it adds nothing).
            self.comm().all_gather_f32(self.norm_partials.ptr().cast(), self.norm_all.ptr().cast(), &self.cstream)?;
            self.comm().wait(&self.cstream, COMM_TIMEOUT)?;
            self.gpu.download(self.norm_all.ptr())?
        } else {
            self.gpu.download(self.norm_partials.ptr())?
        };
        let ranks = if self.stage == 0 { 1 } else { self.world };
        let mut sum = 0f64;
        for u in 0..self.layout.units.len() {
            let off = self.layout.shard_offset(u) / gpt::ALIGN;
            let len = self.layout.units[u].len() / ranks / gpt::ALIGN;
            for r in 0..ranks {
                for b in 0..len {
                    sum += all[r * nb + off + b];
                }
            }
        }
        Ok(sum.sqrt())
    }

    /// Waits for both streams.
    pub fn sync(&self) -> Result<()> {
        self.gpu.sync()?;
        if let Some(c) = &self.comm {
            c.wait(&self.cstream, COMM_TIMEOUT)?;
        }
        Ok(())
    }

    /// Bytes of device memory this rank allocated (parameters, optimizer, gradients, activations).
    pub fn device_bytes(&self) -> usize {
        let st = self.state_bytes().device;
        st.total() as usize
            + (self.norm_partials.len() + self.norm_all.len()) * 8
            + self.losses.len() * 4
            + self.ws.as_ref().map_or(0, Workspace::bytes)
            + self.gpu.lt.as_ref().map_or(0, |lt| lt.bytes())
    }

    /// The cuBLASLt fusions this rank's model uses (`bias,gelu,…` or `none`).
    pub fn fusions(&self) -> String {
        self.ws.as_ref().map_or_else(|| "none".into(), |w| w.fusions().describe())
    }

    /// The model states this rank holds, by kind and place (what [`planned_state_bytes`] predicts).
    pub fn state_bytes(&self) -> StateBytes {
        let b16 = |b: &Buf<bf16>| (b.len() * 2) as u64;
        let b32 = |b: &Buf<f32>| (b.len() * 4) as u64;
        let params = b16(&self.params)
            + self.u0.as_ref().map_or(0, b16)
            + self.pool.iter().map(b16).sum::<u64>()
            + self.dpiece.iter().map(b16).sum::<u64>()
            + self.opiece.as_ref().map_or(0, b16);
        let grads = self.gshard.as_ref().map_or(0, b32) + self.gbufs.iter().map(b32).sum::<u64>();
        let optim = b32(&self.master) + b32(&self.m) + b32(&self.v) + self.decay.len() as u64;
        let (host_optim, host_staging, nvme) = match &self.off {
            Some(o) => (
                o.host.as_ref().map_or(0, |h| (h.master.len() + h.m.len() + h.v.len()) as u64 * 4 + h.decay.len() as u64),
                o.staging.iter().flatten().map(|s| s.bytes() as u64).sum(),
                o.host.as_ref().and_then(|h| h.nvme.as_ref()).map_or(0, |n| n.bytes()),
            ),
            None => (0, 0, 0),
        };
        let (host_params, nvme_params) = self.phost.as_ref().map_or((0, 0), |p| (p.host_bytes(), p.nvme_bytes()));
        StateBytes { device: ResidentBytes { params, grads, optim }, host_optim, host_staging, nvme, host_params, nvme_params }
    }

    /// The parameter tier's figures so far (parameter offload only).
    pub fn param_offload_stats(&self) -> Option<ParamOffloadStats> {
        self.phost.as_ref().map(|p| p.stats)
    }

    /// The host optimizer's figures so far (offload only).
    pub fn offload_stats(&self) -> Option<OffloadStats> {
        self.off.as_ref().map(|o| o.stats)
    }

    /// `offload_optimizer.ratio` (offload only).
    pub fn offload_ratio(&self) -> Option<f64> {
        self.off.as_ref().map(|o| o.ratio)
    }
}

/// An event recorded on `s` now.
fn record(s: &CudaStream) -> Result<CudaEvent> {
    Ok(s.record_event(None).map_err(cuda::drv("recording an event"))?)
}

#[cfg(test)]
mod tests {
    use super::{planned_state_bytes, tail_plan, tree_levels, OffloadPlanned};

    /// The device budget counts the state buffers the optimizer keeps: fp32 masters and the
    /// decay mask (5 bytes an element), plus 4 bytes per buffer (SGD without momentum none, SGD
    /// with momentum and Lion one, Adam two).
    #[test]
    fn planned_optimizer_bytes_follow_the_optimizers_state_buffers() {
        let model = tessera_kernels::model::Model::new(crate::zoo::preset("gpt-mini-gpu").unwrap()).unwrap();
        let plan = |ratio, nvme_block| OffloadPlanned { ratio, nvme_block, params: None };
        let optim = |states| planned_state_bytes(&model, 2, 1, 1, states, plan(None, None)).unwrap().device.optim;
        let elems = optim(0) / 5;
        assert!(elems >= model.num_params() as u64, "{elems} elements for {} parameters", model.num_params());
        assert_eq!((optim(0), optim(1), optim(2)), (elems * 5, elems * 9, elems * 13));
        let host = planned_state_bytes(&model, 2, 1, 1, 2, plan(Some(1.0), None)).unwrap();
        assert_eq!((host.device.optim, host.host_optim), (0, elems * 13));
        // On NVMe: the decay mask stays in host memory; each unit's three regions are whole blocks.
        let nvme = planned_state_bytes(&model, 2, 1, 1, 2, plan(Some(1.0), Some(4096))).unwrap();
        assert_eq!(nvme.host_optim, elems);
        assert!(nvme.nvme >= elems * 12 && nvme.nvme < elems * 12 + 3 * 4096 * (model.cfg.n_layer as u64 + 1));
    }

    /// Parameter offload (stage 3) takes the bf16 shard off the device into host memory (or,
    /// past `max_in_cpu`, a swap file of whole blocks beside three page-locked piece buffers);
    /// with the GPU optimizer the device adds one piece-sized output buffer.
    #[test]
    fn planned_parameter_offload_moves_the_shard_off_the_device() {
        use crate::gpu::param_offload::ParamOffloadOptions;
        let model = tessera_kernels::model::Model::new(crate::zoo::preset("gpt-mini-gpu").unwrap()).unwrap();
        let cpu = ParamOffloadOptions { nvme: None, max_in_cpu: 0, buffer_count: 5, buffer_elems: usize::MAX };
        let plan = |ratio, params| OffloadPlanned { ratio, nvme_block: None, params };
        let kept = planned_state_bytes(&model, 3, 1, 1, 2, plan(Some(1.0), None)).unwrap();
        let moved = planned_state_bytes(&model, 3, 1, 1, 2, plan(Some(1.0), Some(&cpu))).unwrap();
        assert!(moved.device.params < kept.device.params);
        assert_eq!(moved.host_params, kept.device.params - moved.device.params, "the shard's bytes move to the host");
        assert_eq!((moved.nvme_params, moved.device.grads, moved.host_optim), (0, kept.device.grads, kept.host_optim));
        // The GPU optimizer writes each piece's new values into a device buffer before the copy back.
        let gpu_opt = planned_state_bytes(&model, 3, 1, 1, 2, plan(None, Some(&cpu))).unwrap();
        assert!(gpu_opt.device.params > moved.device.params);
        let site = crate::gpu::offload::NvmeSite { dir: std::env::temp_dir(), aio: crate::offload::AioOptions::default() };
        let nvme = ParamOffloadOptions { nvme: Some(site), ..cpu };
        let swapped = planned_state_bytes(&model, 3, 1, 1, 2, plan(Some(1.0), Some(&nvme))).unwrap();
        assert!(swapped.nvme_params >= moved.host_params, "every piece in the swap file, on whole blocks");
        assert_eq!(swapped.device, moved.device);
    }

    /// The micro-batch tree as [`super::Rank::step`] runs it over whole buffers, on symbolic
    /// sums: (expression in each slot, the slot holding the result).
    fn whole_buffer_tree(m: usize, levels: usize, tail_from: Option<usize>) -> String {
        let mut slots: Vec<String> = vec![String::new(); levels];
        let mut stack: Vec<(u32, usize)> = Vec::new();
        let mut free: Vec<usize> = (0..levels).rev().collect();
        for i in 0..m {
            let slot = free.pop().expect("enough buffers");
            slots[slot] = format!("g{i}");
            if tail_from == Some(i) {
                let t = tail_plan(&stack, slot);
                for (dst, src) in t.merges {
                    slots[dst] = format!("({}+{})", slots[dst], slots[src]);
                }
                return slots[t.fin].clone();
            }
            stack.push((0, slot));
            while stack.len() >= 2 && stack[stack.len() - 1].0 == stack[stack.len() - 2].0 {
                let (lv, top) = stack.pop().unwrap();
                let (_, below) = *stack.last().unwrap();
                slots[below] = format!("({}+{})", slots[below], slots[top]);
                free.push(top);
                stack.last_mut().unwrap().0 = lv + 1;
            }
        }
        while stack.len() >= 2 {
            let (_, top) = stack.pop().unwrap();
            let (_, below) = *stack.last().unwrap();
            slots[below] = format!("({}+{})", slots[below], slots[top]);
        }
        slots[stack[0].1].clone()
    }

    /// Finishing the last micro-batch with the tail plan (unit by unit on the device) adds the
    /// same partial sums in the same order as the whole-buffer tree.
    #[test]
    fn the_last_micro_batch_finishes_the_same_tree() {
        assert_eq!(tree_levels(1), 1);
        assert_eq!(tree_levels(8), 4);
        for m in 1..=17 {
            let levels = tree_levels(m);
            let whole = whole_buffer_tree(m, levels, None);
            let tail = whole_buffer_tree(m, levels, Some(m - 1));
            assert_eq!(whole, tail, "M = {m}");
        }
        assert_eq!(whole_buffer_tree(3, 2, Some(2)), "((g0+g1)+g2)");
    }
}
