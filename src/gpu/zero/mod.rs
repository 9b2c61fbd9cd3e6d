//! One GPU rank of a ZeRO run: parameters, gradients and AdamW state on the device, NCCL for
//! the collectives on a communication stream that overlaps the compute stream.
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
//! Optimizer offload ([`OffloadOptions`], `src/gpu/offload.rs`): the masters and moments of
//! the host part of each unit's piece live in host memory and are stepped by CPU threads as
//! each unit's reduced gradient reaches the host; the new bf16 parameters come back per unit
//! and are gathered as without offload.
//!
//! Optimizer in the backward (one GPU, `gradient_clipping` off, unless
//! `TESSERA_GPU_EARLY_ADAM=0`): as the last backward finishes a unit's gradient, that unit's
//! AdamW runs on a third stream, so the optimizer's memory traffic fills the gaps the backward's
//! kernels leave instead of running after it. The kernel and its inputs are the ones the step
//! would use after the backward (elementwise, so the same bits: a `gpu check` row compares the
//! two); the compute stream waits for that stream before the step returns.
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
use tessera_kernels::cuda::{self, bf16, ops, Buf, CudaEvent, CudaStream, DPtr, Gpu};
use tessera_kernels::model::Model;
use tessera_kernels::optim::MomentumCycle;
use tessera_transport::nccl::NcclComm;

use super::offload::{self, Offload, OffloadStats, Pipe, Split};
use crate::offload::ResidentBytes;
use hooks::Hooks;

mod hooks;
mod state;

/// Bound on any wait for the communication stream.
const COMM_TIMEOUT: Duration = Duration::from_secs(300);

/// Optimizer settings (AdamW; DeepSpeed's `optimizer.params`).
#[derive(Clone, Copy, Debug)]
pub struct AdamW {
    pub betas: (f32, f32),
    pub eps: f32,
    pub weight_decay: f32,
    /// Global gradient-norm clip (0 = off), DeepSpeed's `gradient_clipping`.
    pub clip: f32,
    /// OneCycle's `cycle_momentum`: each step's betas come from the cycle (on the optimizer's
    /// step count, as on the CPU) instead of `betas`.
    pub momentum_cycle: Option<MomentumCycle>,
}

impl AdamW {
    /// The betas of update number `applied + 1`.
    pub fn betas_at(&self, applied: u64) -> (f32, f32) {
        self.momentum_cycle.map_or(self.betas, |c| c.betas_at(applied))
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
}

/// The model-state bytes a rank of this geometry will hold, before anything is allocated
/// (the budget check at start uses it; [`Rank::state_bytes`] counts the same).
pub fn planned_state_bytes(model: &Model, stage: u8, world: usize, m_local: usize, ratio: Option<f64>) -> Result<StateBytes> {
    let opt_world = if stage == 0 { 1 } else { world.max(1) };
    let layout = GpuLayout::new(model, opt_world)?;
    let split = Split::new((0..layout.units.len()).map(|u| layout.piece(u, 0).len()).collect(), ratio.unwrap_or(0.0));
    let levels = tree_levels(m_local) as u64;
    let (total, shard) = (layout.total as u64, layout.shard_len() as u64);
    let params = if stage == 3 {
        let blk = layout.units.get(1).map_or(0, |r| r.len()) as u64;
        (shard + layout.units[0].len() as u64 + 2 * blk) * 2
    } else {
        total * 2
    };
    let gshard = if stage >= 1 && world > 1 { shard } else { 0 };
    let staged: u64 = split.host.iter().filter(|&&h| h > 0).map(|&h| h as u64 * 6).sum();
    Ok(StateBytes {
        device: ResidentBytes { params, grads: (levels * total + gshard) * 4, optim: split.dev_total as u64 * 13 },
        host_optim: split.host_total as u64 * 13,
        host_staging: staged,
    })
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
    /// Step each unit's AdamW as soon as its gradient is final (one GPU, no clipping); default
    /// on, `TESSERA_GPU_EARLY_ADAM=0` turns it off.
    pub early_adam: bool,
    /// Units this step's AdamW already ran for (on `ostream`).
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
    /// Optimizer shard (stage ≥ 1) or everything (stage 0): fp32 masters and moments — the
    /// device parts of the pieces ([`Split`]; all of them without offload).
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
    adam: AdamW,
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
    /// Why this rank refuses further steps (a commit that failed part-way, an abandoned step
    /// whose update had begun).
    torn: Option<String>,
}

/// A prepared step ([`Rank::prepare`]).
enum StagedStep {
    /// The update is still to run: the gradient's slot, AdamW's hyper-parameters, the
    /// clipping coefficient.
    Pending { fin: usize, hp: ops::AdamStep, scale: f32 },
    /// The update ran with the backward (optimizer offload).
    Applied,
}

/// What a step's computation leaves for its update.
struct Computed {
    fin: usize,
    norm: Option<f64>,
    scale: f32,
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
    pub adam: AdamW,
    /// This rank's micro-batches per step (sizes the micro-batch tree and the loss buffer).
    pub m_local: usize,
    pub offload: Option<OffloadOptions>,
    /// Activation checkpointing (see [`Workspace::with_options`]).
    pub recompute: bool,
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
        Ok(())
    }
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
        let RankSpec { model, stage, shape, init, adam, m_local, offload, recompute } = spec;
        let (rank, world) = comm.as_ref().map_or((0, 1), |c| (c.rank(), c.world()));
        // Stage 0 shards nothing: one piece holds every unit.
        let opt_world = if stage == 0 { 1 } else { world };
        let layout = GpuLayout::new(model, opt_world)?;
        let opt_rank = if stage == 0 { 0 } else { rank };
        let padded: Vec<f32> = layout.pad(init);
        let shard_len = layout.shard_len();
        let (master_h, mask_h) = optimizer_shard(&layout, &padded, opt_rank);
        let to_bf = |x: &[f32]| x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>();
        let params = if stage == 3 { gpu.upload(&to_bf(&master_h))? } else { gpu.upload(&to_bf(&padded))? };
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
        let master = gpu.upload(&master_dev)?;
        let m = gpu.alloc::<f32>(split.dev_total)?;
        let v = gpu.alloc::<f32>(split.dev_total)?;
        let decay = gpu.upload(&mask_dev)?;
        let off = match offload {
            None => None,
            Some(o) => Some(Offload::new(&gpu, rank, &split, master_host, mask_host, o)?),
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
            master,
            m,
            v,
            decay,
            gshard,
            gbufs,
            norm_partials,
            norm_all,
            ws,
            adam,
            step: 0,
            ready: (0..n_units).map(|_| None).collect(),
            pool_ready: std::collections::HashMap::new(),
            losses,
            split,
            off,
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
        let res = self.prepare(mbs, lr, dloss)?;
        self.commit()?;
        Ok(res)
    }

    /// The first half of a step, the step transaction's prepare: forward, backward, the
    /// micro-batch tree, the reductions and the gradient norm, with AdamW's hyper-parameters
    /// at `lr`. Nothing is updated, except where the update overlaps the backward: units stepped
    /// early ([`Rank::early_adam_active`]) and, with optimizer offload, the whole update (the
    /// host threads step each unit as its gradient arrives). An abandoned step of that kind
    /// leaves the rank unusable ([`Rank::abandon`]). Returns the mean loss of this rank's
    /// micro-batches and the global gradient norm (if clipping).
    pub fn prepare(&mut self, mbs: &[(Vec<u32>, Vec<u32>)], lr: f32, dloss: f32) -> Result<(f32, Option<f64>)> {
        if let Some(why) = &self.torn {
            bail!("rank {}: {why}", self.rank);
        }
        let m_local = mbs.len();
        if m_local == 0 || m_local * self.ws_n() > self.losses.len() {
            bail!("rank {} was given {m_local} micro-batches; it was built for {}", self.rank, self.losses.len() / self.ws_n());
        }
        self.staged = None;
        let betas = self.adam.betas_at(self.step);
        let hp = ops::AdamStep::new(lr, betas, self.adam.eps, self.adam.weight_decay, self.step + 1);
        let Some(off) = self.off.as_mut() else {
            self.stepped.fill(false);
            let c = self.compute(mbs, dloss, &hp, None)?;
            let loss = self.local_loss(m_local)?;
            self.staged = Some(StagedStep::Pending { fin: c.fin, hp, scale: c.scale });
            return Ok((loss, c.norm));
        };
        let mut host = off.host.take().context("the host optimizer state was lost in an earlier failed step")?;
        let split = self.split.clone();
        let (rank, clip) = (self.rank, self.adam.clip);
        let (res, stats) = offload::run_step(&mut host, &split, hp, rank, clip, |tx, pipe| {
            if let Some(o) = self.off.as_mut() {
                o.tx = Some(tx);
            }
            self.stepped.fill(false);
            let res = self.compute(mbs, dloss, &hp, Some(&pipe)).and_then(|c| {
                self.update(c.fin, &hp, c.scale, Some(pipe))?;
                Ok((self.local_loss(m_local)?, c.norm))
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
            Some(Ok(st)) => off.stats.add(&st),
            Some(Err(_)) => bail!("rank {}: the host optimizer thread panicked", self.rank),
            None => {}
        }
        if res.is_ok() {
            self.staged = Some(StagedStep::Applied);
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
            None => bail!("rank {}: commit without a prepared step", self.rank),
        }
    }

    /// Drops a prepared step. The committed state is untouched unless the update already
    /// overlapped the backward ([`Rank::prepare`]): then the rank refuses every later step.
    pub fn abandon(&mut self) {
        let applied = match self.staged.take() {
            Some(StagedStep::Applied) => true,
            Some(StagedStep::Pending { .. }) => self.stepped.iter().any(|&s| s),
            None => false,
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
    fn compute(&mut self, mbs: &[(Vec<u32>, Vec<u32>)], dloss: f32, hp: &ops::AdamStep, pipe: Option<&Pipe>) -> Result<Computed> {
        let fin = self.micro_batches(mbs, dloss, hp)?;
        self.gpu.mark("micro-batch tree");
        // Optimizer input: this rank's reduced pieces.
        if self.world > 1 {
            self.order(&self.cstream, &self.gpu.stream)?;
        }
        self.gpu.mark("wait for reductions");
        let gshard = self.gshard_ptr(fin);
        let norm = if self.adam.clip > 0.0 { Some(self.grad_norm(gshard)?) } else { None };
        self.gpu.mark("gradient norm");
        let scale = match norm {
            Some(n) if n > self.adam.clip as f64 => (self.adam.clip as f64 / (n + 1e-6)) as f32,
            _ => 1.0,
        };
        if let (Some(p), true) = (pipe, self.adam.clip > 0.0) {
            // A worker that already stopped reports why through `done`.
            let _ = p.scale.send(scale);
        }
        Ok(Computed { fin, norm, scale })
    }

    /// The optimizer input: this rank's reduced pieces, or the full buffer in gradient slot
    /// `fin` (stage 0, or one rank: layout world 1).
    fn gshard_ptr(&self, fin: usize) -> DPtr<f32> {
        match &self.gshard {
            Some(b) => b.ptr(),
            None => self.gbufs[fin].ptr(),
        }
    }

    /// The update: AdamW over every unit not stepped during the backward, the stage 1–2
    /// parameter gathers, and the host units' return (offload).
    fn update(&mut self, fin: usize, hp: &ops::AdamStep, scale: f32, pipe: Option<Pipe>) -> Result<()> {
        let gshard = self.gshard_ptr(fin);
        self.step += 1;
        let gathers = self.world > 1 && (self.stage == 1 || self.stage == 2);
        for u in 0..self.layout.units.len() {
            if !self.stepped[u] {
                self.adamw_unit(u, gshard, hp, scale, &self.gpu.stream)?;
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
        self.gpu.mark("adamw");
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
    fn micro_batches(&mut self, mbs: &[(Vec<u32>, Vec<u32>)], dloss: f32, hp: &ops::AdamStep) -> Result<usize> {
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
                let mut hooks = Hooks { r: self, grads: g, tail: tail.as_ref(), early, use_idx: 0, uses: Vec::new() };
                hooks.begin().and_then(|_| gpt::forward_backward(&gpu, &mut hooks, &mut ws, tok, tgt, dloss).map_err(anyhow::Error::from))
            };
            let copied = gpu.copy(self.losses.slice(i * n..(i + 1) * n).cast(), ws.losses().cast(), &gpu.stream);
            self.ws = Some(ws);
            res?;
            copied?;
            if let Some(t) = tail {
                fin = t.fin;
                break;
            }
            stack.push((0, slot));
            while stack.len() >= 2 && stack[stack.len() - 1].0 == stack[stack.len() - 2].0 {
                let (lv, top) = stack.pop().expect("len ≥ 2");
                let (_, below) = *stack.last().expect("len ≥ 1");
                ops::add_f32(&self.gpu, &self.gpu.stream, self.gbufs[below].ptr(), self.gbufs[top].ptr())?;
                free.push(top);
                stack.last_mut().expect("len ≥ 1").0 = lv + 1;
            }
        }
        Ok(fin)
    }

    /// Whether this rank's steps run each unit's AdamW during the backward (see the module notes).
    pub fn early_adam_active(&self) -> bool {
        self.early_adam && self.world == 1 && self.adam.clip <= 0.0
    }

    /// AdamW over the device part of unit `u`'s piece (this rank's, or all of it at stage 0)
    /// on stream `s`, reading the reduced gradient `gshard` (the full buffer with one rank or at
    /// stage 0).
    fn adamw_unit(&self, u: usize, gshard: DPtr<f32>, hp: &ops::AdamStep, scale: f32, s: &CudaStream) -> Result<()> {
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
        let param = if self.stage == 3 { self.params.slice(sh.clone()) } else { self.params.slice(piece.start + h..piece.end) };
        let bufs = ops::AdamBufs {
            master: self.master.slice(dr.clone()),
            param,
            grad: gshard.slice(sh),
            m: self.m.slice(dr.clone()),
            v: self.v.slice(dr.clone()),
            decay: self.decay.slice(dr),
        };
        ops::adamw(&self.gpu, s, &bufs, hp, scale)?;
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
            let st = match p.done.recv_timeout(offload::HOST_STEP_TIMEOUT) {
                Ok(Ok(st)) => st,
                Ok(Err(e)) => bail!("rank {}: the host optimizer step failed: {e}", self.rank),
                Err(RecvTimeoutError::Timeout) => bail!(
                    "rank {}: the host optimizer step of a unit did not finish within {} s",
                    self.rank,
                    offload::HOST_STEP_TIMEOUT.as_secs()
                ),
                Err(RecvTimeoutError::Disconnected) => {
                    bail!("rank {}: the host optimizer thread stopped before the step was done", self.rank)
                }
            };
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
        let params = b16(&self.params) + self.u0.as_ref().map_or(0, b16) + self.pool.iter().map(b16).sum::<u64>();
        let grads = self.gshard.as_ref().map_or(0, b32) + self.gbufs.iter().map(b32).sum::<u64>();
        let optim = b32(&self.master) + b32(&self.m) + b32(&self.v) + self.decay.len() as u64;
        let (host_optim, host_staging) = match &self.off {
            Some(o) => (
                o.host.as_ref().map_or(0, |h| (h.master.len() + h.m.len() + h.v.len()) as u64 * 4 + h.decay.len() as u64),
                o.staging.iter().flatten().map(|s| s.bytes() as u64).sum(),
            ),
            None => (0, 0),
        };
        StateBytes { device: ResidentBytes { params, grads, optim }, host_optim, host_staging }
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
    use super::{tail_plan, tree_levels};

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
