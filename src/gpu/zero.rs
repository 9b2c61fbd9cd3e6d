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
//! Determinism: a rank's micro-batches are combined by a fixed binary tree, ranks hold aligned
//! blocks of micro-batches, and with two ranks NCCL's sum is one IEEE add — so one GPU running
//! two micro-batches and two GPUs running one each produce the same bits (tested on the device).

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tessera_kernels::cuda::gpt::{self, GpuLayout, Phase, Shape, UnitHooks, Workspace};
use tessera_kernels::cuda::{self, bf16, ops, Buf, CudaEvent, CudaStream, DPtr, Gpu};
use tessera_kernels::model::Model;
use tessera_transport::nccl::NcclComm;

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
}

pub struct Rank {
    pub gpu: Arc<Gpu>,
    comm: Option<NcclComm>,
    cstream: Arc<CudaStream>,
    pub rank: usize,
    pub world: usize,
    pub stage: u8,
    pub layout: GpuLayout,
    /// Stage ≤ 2: full bf16 parameters (padded layout). Stage 3: this rank's shard.
    params: Buf<bf16>,
    /// Stage 3 only: the gathered embedding unit and two rotating block buffers.
    u0: Option<Buf<bf16>>,
    pool: Vec<Buf<bf16>>,
    /// Optimizer shard (stage ≥ 1) or everything (stage 0): fp32 masters and moments.
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
}

impl Rank {
    /// Builds rank `rank` of `world` with the initial parameters `init` (CPU layout, f32).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        gpu: Arc<Gpu>,
        comm: Option<NcclComm>,
        model: &Model,
        stage: u8,
        shape: Shape,
        init: &[f32],
        adam: AdamW,
        m_local: usize,
    ) -> Result<Rank> {
        let (rank, world) = comm.as_ref().map_or((0, 1), |c| (c.rank(), c.world()));
        if stage > 3 {
            bail!("zero_optimization.stage = {stage}: expected 0, 1, 2 or 3");
        }
        // Stage 0 shards nothing: one piece holds every unit.
        let opt_world = if stage == 0 { 1 } else { world };
        let layout = GpuLayout::new(model, opt_world)?;
        let opt_rank = if stage == 0 { 0 } else { rank };
        let padded: Vec<f32> = layout.pad(init);
        let shard_len = layout.shard_len();
        // This rank's optimizer shard, unit piece by unit piece.
        let mut master_h = Vec::with_capacity(shard_len);
        let mask_full = layout.decay_mask();
        let mut mask_h = Vec::with_capacity(shard_len);
        for u in 0..layout.units.len() {
            let p = layout.piece(u, opt_rank);
            master_h.extend_from_slice(&padded[p.clone()]);
            mask_h.extend_from_slice(&mask_full[p]);
        }
        let to_bf = |x: &[f32]| x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>();
        let params = if stage == 3 { gpu.upload(&to_bf(&master_h))? } else { gpu.upload(&to_bf(&padded))? };
        let (u0, pool) = if stage == 3 {
            let blk = layout.units.get(1).map_or(0, |r| r.len());
            (Some(gpu.alloc::<bf16>(layout.units[0].len())?), vec![gpu.alloc::<bf16>(blk)?, gpu.alloc::<bf16>(blk)?])
        } else {
            (None, Vec::new())
        };
        let master = gpu.upload(&master_h)?;
        let m = gpu.alloc::<f32>(shard_len)?;
        let v = gpu.alloc::<f32>(shard_len)?;
        let decay = gpu.upload(&mask_h)?;
        let gshard = if stage >= 1 && world > 1 { Some(gpu.alloc::<f32>(shard_len)?) } else { None };
        // The micro-batch tree holds at most ⌊log2 M⌋ + 1 partial sums at once.
        let levels = usize::BITS as usize - m_local.max(1).leading_zeros() as usize;
        let mut gbufs = Vec::new();
        for _ in 0..levels {
            gbufs.push(gpu.alloc::<f32>(layout.total)?);
        }
        let nblocks = shard_len / gpt::ALIGN;
        let norm_partials = gpu.alloc::<f64>(nblocks)?;
        let norm_all = gpu.alloc::<f64>(nblocks * world)?;
        let ws = Some(Workspace::new(&gpu, shape, &layout)?);
        let losses = gpu.alloc::<f32>(shape.n() * m_local.max(1))?;
        let cstream = gpu.ctx.new_stream().map_err(cuda::drv("creating the communication stream"))?;
        let n_units = layout.units.len();
        Ok(Rank {
            gpu,
            comm,
            cstream,
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
        })
    }

    fn comm(&self) -> &NcclComm {
        self.comm.as_ref().expect("collectives are only issued when world > 1")
    }

    /// Makes `to` wait for everything enqueued so far on `from`.
    fn order(&self, from: &CudaStream, to: &CudaStream) -> Result<()> {
        let ev = from.record_event(None).map_err(cuda::drv("recording an event"))?;
        to.wait(&ev).map_err(cuda::drv("waiting on an event"))?;
        Ok(())
    }

    /// One optimizer step over `mbs` (this rank's micro-batches, in global order): forward,
    /// backward, the micro-batch tree, reduction, clipping, AdamW, parameter gather. Returns
    /// the mean loss of this rank's micro-batches and the global gradient norm (if clipping).
    pub fn step(&mut self, mbs: &[(Vec<u32>, Vec<u32>)], lr: f32, dloss: f32) -> Result<(f32, Option<f64>)> {
        let m_local = mbs.len();
        if m_local == 0 || m_local * self.ws_n() > self.losses.len() {
            bail!("rank {} was given {m_local} micro-batches; it was built for {}", self.rank, self.losses.len() / self.ws_n());
        }
        let overlap = m_local == 1 && self.world > 1;
        let mut stack: Vec<(u32, usize)> = Vec::new();
        let mut free: Vec<usize> = (0..self.gbufs.len()).rev().collect();
        let n = self.ws_n();
        for (i, (tok, tgt)) in mbs.iter().enumerate() {
            let slot = free.pop().context("micro-batch tree ran out of buffers")?;
            let g = self.gbufs[slot].ptr();
            // (The previous step's reductions finished before its optimizer ran on this stream.)
            self.gpu.zero(g, &self.gpu.stream)?;
            self.gpu.mark("zero grads");
            let mut ws = self.ws.take().expect("workspace present between micro-batches");
            let gpu = self.gpu.clone();
            let res = {
                let mut hooks = Hooks { r: self, grads: g, overlap, use_idx: 0, uses: Vec::new() };
                hooks.begin().and_then(|_| gpt::forward_backward(&gpu, &mut hooks, &mut ws, tok, tgt, dloss).map_err(anyhow::Error::from))
            };
            let copied = gpu.copy(self.losses.slice(i * n..(i + 1) * n).cast(), ws.losses.ptr().cast(), &gpu.stream);
            self.ws = Some(ws);
            res?;
            copied?;
            stack.push((0, slot));
            while stack.len() >= 2 && stack[stack.len() - 1].0 == stack[stack.len() - 2].0 {
                let (lv, top) = stack.pop().expect("len ≥ 2");
                let (_, below) = *stack.last().expect("len ≥ 1");
                ops::add_f32(&self.gpu, &self.gpu.stream, self.gbufs[below].ptr(), self.gbufs[top].ptr())?;
                free.push(top);
                stack.last_mut().expect("len ≥ 1").0 = lv + 1;
            }
        }
        while stack.len() >= 2 {
            let (_, top) = stack.pop().expect("len ≥ 2");
            let (_, below) = *stack.last().expect("len ≥ 1");
            ops::add_f32(&self.gpu, &self.gpu.stream, self.gbufs[below].ptr(), self.gbufs[top].ptr())?;
            free.push(top);
        }
        let full = self.gbufs[stack[0].1].ptr();
        if self.world > 1 && !overlap {
            for u in (0..self.layout.units.len()).rev() {
                self.reduce_unit(u, full)?;
            }
        }
        self.gpu.mark("micro-batch tree");
        // Optimizer input: this rank's reduced pieces.
        if self.world > 1 {
            self.order(&self.cstream, &self.gpu.stream)?;
        }
        self.gpu.mark("wait for reductions");
        let gshard: DPtr<f32> = match &self.gshard {
            Some(b) => b.ptr(),
            None => {
                // Stage 0 (or one rank): the full buffer is the shard (layout world 1).
                full
            }
        };
        let norm = if self.adam.clip > 0.0 { Some(self.grad_norm(gshard)?) } else { None };
        self.gpu.mark("gradient norm");
        let scale = match norm {
            Some(n) if n > self.adam.clip as f64 => (self.adam.clip as f64 / (n + 1e-6)) as f32,
            _ => 1.0,
        };
        self.step += 1;
        let hp = ops::AdamStep::new(lr, self.adam.betas, self.adam.eps, self.adam.weight_decay, self.step);
        let opt_rank = if self.stage == 0 { 0 } else { self.rank };
        for u in 0..self.layout.units.len() {
            let off = self.layout.shard_offset(u);
            let piece = self.layout.piece(u, opt_rank);
            let len = piece.len();
            let sh = off..off + len;
            let param = if self.stage == 3 { self.params.slice(sh.clone()) } else { self.params.slice(piece.clone()) };
            ops::adamw(
                &self.gpu,
                &self.gpu.stream,
                self.master.slice(sh.clone()),
                param,
                gshard.slice(sh.clone()),
                self.m.slice(sh.clone()),
                self.v.slice(sh.clone()),
                self.decay.slice(sh.clone()),
                &hp,
                scale,
            )?;
            if self.world > 1 && (self.stage == 1 || self.stage == 2) {
                // Gather this unit's updated bf16 parameters while the optimizer moves on to the
                // next unit; the next forward waits per unit.
                self.order(&self.gpu.stream, &self.cstream)?;
                let unit = self.params.slice(self.layout.units[u].clone());
                let mine = self.params.slice(self.layout.piece(u, self.rank));
                self.comm().all_gather_bf16(mine, unit, &self.cstream)?;
                let ev = self.cstream.record_event(None).map_err(cuda::drv("recording an event"))?;
                self.ready[u] = Some(ev);
            }
        }
        self.gpu.mark("adamw");
        let losses = self.gpu.download(self.losses.slice(0..m_local * n))?;
        let loss = losses.iter().map(|&x| x as f64).sum::<f64>() / losses.len() as f64;
        Ok((loss as f32, norm))
    }

    fn ws_n(&self) -> usize {
        self.ws.as_ref().map_or(0, |w| w.shape.n())
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
        Ok(())
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

    /// The fp32 master parameters in the CPU layout (gathered from every rank).
    pub fn masters(&mut self) -> Result<Vec<f32>> {
        let shard = self.gpu.download(self.master.ptr())?;
        if self.world == 1 || self.stage == 0 {
            return Ok(self.layout.unpad(&self.layout_full_from_shards(&[shard])));
        }
        let all = self.gpu.alloc::<f32>(self.master.len() * self.world)?;
        self.order(&self.gpu.stream, &self.cstream)?;
        self.comm().all_gather_f32(self.master.ptr(), all.ptr(), &self.cstream)?;
        self.comm().wait(&self.cstream, COMM_TIMEOUT)?;
        let flat = self.gpu.download(all.ptr())?;
        let n = self.master.len();
        let shards: Vec<Vec<f32>> = (0..self.world).map(|r| flat[r * n..(r + 1) * n].to_vec()).collect();
        Ok(self.layout.unpad(&self.layout_full_from_shards(&shards)))
    }

    fn layout_full_from_shards(&self, shards: &[Vec<f32>]) -> Vec<f32> {
        let mut full = vec![0f32; self.layout.total];
        for (r, sh) in shards.iter().enumerate() {
            for u in 0..self.layout.units.len() {
                let p = self.layout.piece(u, r);
                let off = self.layout.shard_offset(u);
                full[p.clone()].copy_from_slice(&sh[off..off + p.len()]);
            }
        }
        full
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
        let b16 = |b: &Buf<bf16>| b.len() * 2;
        let b32 = |b: &Buf<f32>| b.len() * 4;
        b16(&self.params)
            + self.u0.as_ref().map_or(0, b16)
            + self.pool.iter().map(b16).sum::<usize>()
            + b32(&self.master)
            + b32(&self.m)
            + b32(&self.v)
            + self.decay.len()
            + self.gshard.as_ref().map_or(0, b32)
            + self.gbufs.iter().map(b32).sum::<usize>()
            + (self.norm_partials.len() + self.norm_all.len()) * 8
            + self.losses.len() * 4
            + self.ws.as_ref().map_or(0, Workspace::bytes)
    }
}

/// The hooks of one micro-batch.
struct Hooks<'a> {
    r: &'a mut Rank,
    grads: DPtr<f32>,
    overlap: bool,
    /// Stage 3: index of the next block use, and the uses in order (unit, phase).
    use_idx: usize,
    uses: Vec<(usize, Phase)>,
}

impl Hooks<'_> {
    /// Stage 3: starts gathering the embedding unit and the first two block uses.
    fn begin(&mut self) -> Result<()> {
        if self.r.stage != 3 {
            return Ok(());
        }
        let l = self.r.layout.units.len() - 1;
        self.uses = (1..=l).map(|u| (u, Phase::Forward)).chain((1..=l).rev().map(|u| (u, Phase::Backward))).collect();
        self.use_idx = 0;
        // Gathers read the parameter shard the last optimizer step wrote.
        self.r.order(&self.r.gpu.stream, &self.r.cstream)?;
        let u0 = self.r.u0.as_ref().expect("stage 3 has a unit-0 buffer").ptr();
        self.gather(0, u0)?;
        self.r.ready[0] = Some(record(&self.r.cstream)?);
        for k in 0..2.min(self.uses.len()) {
            self.gather_use(k)?;
        }
        Ok(())
    }

    fn gather(&self, u: usize, dst: DPtr<bf16>) -> Result<()> {
        let off = self.r.layout.shard_offset(u);
        let len = self.r.layout.units[u].len() / self.r.world;
        let mine = self.r.params.slice(off..off + len);
        if self.r.world == 1 {
            self.r.gpu.copy(dst.cast(), mine.cast(), &self.r.cstream)?;
        } else {
            self.r.comm().all_gather_bf16(mine, dst, &self.r.cstream)?;
        }
        Ok(())
    }

    /// Gathers block use `k` into pool slot `k % 2` and records its ready event.
    fn gather_use(&mut self, k: usize) -> Result<()> {
        let (u, _) = self.uses[k];
        let dst = self.r.pool[k % 2].ptr();
        self.gather(u, dst)?;
        let ev = record(&self.r.cstream)?;
        self.r.pool_ready.insert(k, ev);
        Ok(())
    }
}

fn record(s: &CudaStream) -> Result<CudaEvent> {
    Ok(s.record_event(None).map_err(cuda::drv("recording an event"))?)
}

impl UnitHooks for Hooks<'_> {
    fn params(&mut self, u: usize, phase: Phase) -> tessera_kernels::cuda::Result<DPtr<bf16>> {
        let r = &mut *self.r;
        if r.stage == 3 {
            if u == 0 {
                if phase == Phase::Forward {
                    if let Some(ev) = r.ready[0].take() {
                        r.gpu.stream.wait(&ev).map_err(cuda::drv("waiting for the embedding gather"))?;
                    }
                }
                return Ok(r.u0.as_ref().expect("stage 3 has a unit-0 buffer").ptr());
            }
            let k = self.use_idx;
            debug_assert_eq!(self.uses[k], (u, phase), "stage-3 use order");
            let ev = r.pool_ready.remove(&k).ok_or_else(|| cuda::GpuError::Invalid(format!("stage 3: unit {u} was not prefetched")))?;
            r.gpu.stream.wait(&ev).map_err(cuda::drv("waiting for a parameter gather"))?;
            return Ok(r.pool[k % 2].ptr());
        }
        if let Some(ev) = r.ready[u].take() {
            r.gpu.stream.wait(&ev).map_err(cuda::drv("waiting for a parameter gather"))?;
        }
        Ok(r.params.slice(r.layout.units[u].clone()))
    }

    fn params_done(&mut self, u: usize, _phase: Phase) -> tessera_kernels::cuda::Result<()> {
        if self.r.stage != 3 || u == 0 {
            return Ok(());
        }
        let k = self.use_idx;
        self.use_idx += 1;
        if k + 2 < self.uses.len() {
            // Slot k % 2 is free once the compute stream is past this use.
            self.r.order(&self.r.gpu.stream, &self.r.cstream).map_err(|e| cuda::GpuError::Invalid(e.to_string()))?;
            self.gather_use(k + 2).map_err(|e| cuda::GpuError::Invalid(e.to_string()))?;
        }
        Ok(())
    }

    fn grads(&mut self, u: usize) -> tessera_kernels::cuda::Result<DPtr<f32>> {
        Ok(self.grads.slice(self.r.layout.units[u].clone()))
    }

    fn grads_done(&mut self, u: usize) -> tessera_kernels::cuda::Result<()> {
        if self.overlap && (self.r.stage != 1) {
            self.r.reduce_unit(u, self.grads).map_err(|e| cuda::GpuError::Invalid(e.to_string()))?;
        } else if self.overlap && self.r.stage == 1 && u == 0 {
            // Stage 1 reduces after the whole backward.
            for uu in (0..self.r.layout.units.len()).rev() {
                self.r.reduce_unit(uu, self.grads).map_err(|e| cuda::GpuError::Invalid(e.to_string()))?;
            }
        }
        Ok(())
    }
}

/// Helpers for the training driver (`gpu::train`): evaluation, small host-side gathers, and
/// the optimizer state in the CPU checkpoint layout.
impl Rank {
    /// Mean loss of one batch of this rank's micro-batch shape, forward only (evaluation) on the
    /// current bf16 parameters. At stage 3 with several ranks the parameters are gathered unit by
    /// unit, so every rank must call this together, with batches in the same order.
    pub fn forward_loss(&mut self, tokens: &[u32], targets: &[u32]) -> Result<f32> {
        let mut ws = self.ws.take().expect("workspace present between steps");
        let gpu = self.gpu.clone();
        // Forward only: no gradient is written; the hooks still need a buffer to name.
        let grads = self.gbufs[0].ptr();
        let res = {
            let mut hooks = Hooks { r: self, grads, overlap: false, use_idx: 0, uses: Vec::new() };
            hooks.begin().and_then(|_| gpt::forward_loss(&gpu, &mut hooks, &mut ws, tokens, targets).map_err(anyhow::Error::from))
        };
        let loss = res.and_then(|_| gpt::mean_loss(&gpu, &ws).map_err(anyhow::Error::from));
        self.ws = Some(ws);
        loss
    }

    /// Every rank's `values` (the same count on each), rank-major: `out[r·k + i]` is rank `r`'s
    /// `values[i]`. One rank: `values` itself. A collective: every rank must call it together.
    pub fn gather_host(&mut self, values: &[f64]) -> Result<Vec<f64>> {
        if self.world == 1 || values.is_empty() {
            return Ok(values.to_vec());
        }
        // f64 values travel as pairs of f32 words (a gather moves bits, it adds nothing).
        let words: Vec<f32> = values
            .iter()
            .flat_map(|v| {
                let b = v.to_bits();
                [f32::from_bits(b as u32), f32::from_bits((b >> 32) as u32)]
            })
            .collect();
        let send = self.gpu.upload(&words)?;
        let recv = self.gpu.alloc::<f32>(words.len() * self.world)?;
        self.order(&self.gpu.stream, &self.cstream)?;
        self.comm().all_gather_f32(send.ptr(), recv.ptr(), &self.cstream)?;
        self.comm().wait(&self.cstream, COMM_TIMEOUT)?;
        let flat = self.gpu.download(recv.ptr())?;
        Ok(flat.chunks_exact(2).map(|w| f64::from_bits(u64::from(w[0].to_bits()) | (u64::from(w[1].to_bits()) << 32))).collect())
    }

    /// Optimizer steps taken so far (Adam's bias-correction clock).
    pub fn optimizer_steps(&self) -> u64 {
        self.step
    }

    /// The Adam moments (`exp_avg`, `exp_avg_sq`) in the CPU layout, full length, gathered from
    /// every rank (a collective at stages 1–3 with several ranks).
    pub fn moments(&mut self) -> Result<(Vec<f32>, Vec<f32>)> {
        let (m, v) = (self.m.ptr(), self.v.ptr());
        Ok((self.gather_cpu_layout(m)?, self.gather_cpu_layout(v)?))
    }

    /// A shard-shaped f32 buffer (this rank's optimizer pieces) of every rank → the CPU layout.
    fn gather_cpu_layout(&mut self, shard: DPtr<f32>) -> Result<Vec<f32>> {
        let own = self.gpu.download(shard)?;
        if self.world == 1 || self.stage == 0 {
            return Ok(self.layout.unpad(&self.layout_full_from_shards(&[own])));
        }
        let all = self.gpu.alloc::<f32>(shard.len * self.world)?;
        self.order(&self.gpu.stream, &self.cstream)?;
        self.comm().all_gather_f32(shard, all.ptr(), &self.cstream)?;
        self.comm().wait(&self.cstream, COMM_TIMEOUT)?;
        let flat = self.gpu.download(all.ptr())?;
        let n = shard.len;
        let shards: Vec<Vec<f32>> = (0..self.world).map(|r| flat[r * n..(r + 1) * n].to_vec()).collect();
        Ok(self.layout.unpad(&self.layout_full_from_shards(&shards)))
    }

    /// Restores the Adam moments (CPU layout, full length, as a checkpoint holds them) and the
    /// optimizer step count: this rank keeps its pieces.
    pub fn load_moments(&mut self, m: &[f32], v: &[f32], steps: u64) -> Result<()> {
        let n = self.layout.cpu_units.last().map_or(0, |u| u.end);
        for (name, b) in [("exp_avg", m), ("exp_avg_sq", v)] {
            if b.len() != n {
                bail!("optimizer buffer `{name}` has {} values; the model has {n} parameters", b.len());
            }
        }
        let opt_rank = if self.stage == 0 { 0 } else { self.rank };
        let cut = |full: &[f32]| -> Vec<f32> {
            let padded = self.layout.pad(full);
            let mut out = Vec::with_capacity(self.layout.shard_len());
            for u in 0..self.layout.units.len() {
                out.extend_from_slice(&padded[self.layout.piece(u, opt_rank)]);
            }
            out
        };
        let (mh, vh) = (cut(m), cut(v));
        self.gpu.write(&mut self.m, 0, &mh)?;
        self.gpu.write(&mut self.v, 0, &vh)?;
        self.gpu.sync()?;
        self.step = steps;
        Ok(())
    }

    /// Every rank's [`Rank::device_bytes`], in rank order (a collective with several ranks).
    pub fn device_bytes_per_rank(&mut self) -> Result<Vec<usize>> {
        let mine = self.device_bytes() as f64;
        Ok(self.gather_host(&[mine])?.into_iter().map(|b| b as usize).collect())
    }
}
