//! A rank of a ZeRO data-parallel run: [`ZeroWorker`] is the compute a `DeviceWorker` actor
//! drives. It computes its micro-batch blocks, sends their gradient sums to the partition owners
//! (who combine them with the fixed micro-batch tree), and on commit applies the optimizer to the
//! fp32 masters it owns and shares the new parameters.
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
//! Numerics are the same for every stage and world size: a leaf (one micro-batch's gradient) and
//! every node of the tree are rounded to the storage type; the final gradient is unscaled,
//! clipped by the global norm (block-aligned partials, see `tessera_kernels::optim::norm`) and
//! rounded again. Transient memory (activations, leaf gradients, the gathered units) is not part
//! of the model states above: a leaf gradient is a full-length f32 buffer while it is computed.

use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use tessera_actors::compute::{MemoryReport, Prepared, StepOrder, WorkerCompute};
use tessera_kernels::dtype::{round_to, DType};
use tessera_kernels::model::{UnitAccess, Workspace};
use tessera_kernels::optim::{clip_coefficient, LocalReduce, LossScaler, NormAllReduce, OptimizerShard, StepContext, StepOutcome};
use tessera_transport::collective::Collective;
use tessera_transport::tree::TreeSum;

use super::plan::Plan;
use super::store::Store;
use crate::data::Sampler;

/// The persistent state of one rank: what a checkpoint saves and memory accounting counts.
pub struct RankState {
    /// Working parameters in the storage type: the whole buffer, or `ranges[r]` in stage 3.
    pub params: Store,
    /// Reduced gradients in the storage type: the whole buffer (stages 0–1) or `ranges[r]`.
    pub grads: Store,
    /// fp32 masters of `plan.optim_range(r)`.
    pub master: Vec<f32>,
    pub optim: OptimizerShard,
    pub scaler: Option<LossScaler>,
    /// Optimizer steps applied (the LR schedule's clock) and steps skipped on overflow.
    pub applied: u64,
    pub skipped: u64,
    /// Bytes this rank has sent through collectives so far (prepare and commit), for the
    /// driver's per-step communication figures.
    pub bytes_sent_total: u64,
}

impl RankState {
    /// A fresh rank from the full initial masters.
    pub fn new(plan: &Plan, rank: usize, full_master: &[f32], scaler: Option<LossScaler>) -> RankState {
        let dtype = plan.precision.dtype();
        let total = plan.total();
        let opt = plan.optim_range(rank);
        let (p_range, g_len) = match plan.stage {
            0 | 1 => (0..total, total),
            2 => (0..total, plan.ranges[rank].len()),
            _ => (plan.ranges[rank].clone(), plan.ranges[rank].len()),
        };
        let mut params = Store::zeros(dtype, p_range.len());
        params.write(0, &full_master[p_range]);
        RankState {
            params,
            grads: Store::zeros(dtype, g_len),
            master: full_master[opt.clone()].to_vec(),
            optim: OptimizerShard::new(plan.optimizer, opt.len()),
            scaler,
            applied: 0,
            skipped: 0,
            bytes_sent_total: 0,
        }
    }

    pub fn memory(&self, rank: usize) -> MemoryReport {
        let optim: usize = self.optim.state_buffers().iter().map(|(_, b)| b.len()).sum();
        MemoryReport {
            rank,
            param_bytes: self.params.bytes(),
            grad_bytes: self.grads.bytes(),
            optim_bytes: ((self.master.len() + optim) * 4) as u64,
        }
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

/// Lamb's per-tensor norms summed across ranks.
struct CommReduce<'a>(&'a mut dyn Collective, Option<String>);

impl NormAllReduce for CommReduce<'_> {
    fn all_reduce_sum(&mut self, v: &mut [f64]) {
        if let Err(e) = self.0.all_reduce_sum_f64(v) {
            self.1.get_or_insert(e.to_string());
        }
    }
}

/// The gradient sum of one aligned dyadic block of micro-batches: (first leaf, level, values).
type BlockSum = (usize, u32, Vec<f32>);

/// What `prepare` leaves for `commit`: the reduced, clipped gradient sits in `RankState::grads`.
struct Staged {
    step: u64,
    overflow: bool,
}

/// One rank's compute.
pub struct ZeroWorker {
    rank: usize,
    plan: Arc<Plan>,
    sampler: Arc<Sampler>,
    comm: Box<dyn Collective>,
    state: Arc<Mutex<RankState>>,
    staged: Option<Staged>,
    ws: Workspace,
}

fn lock(state: &Mutex<RankState>) -> MutexGuard<'_, RankState> {
    // A panic elsewhere never leaves the state half-written in a way we could repair here;
    // recover the guard and let the transaction protocol discard the step.
    state.lock().unwrap_or_else(|p| p.into_inner())
}

impl ZeroWorker {
    pub fn new(rank: usize, plan: Arc<Plan>, sampler: Arc<Sampler>, comm: Box<dyn Collective>, state: Arc<Mutex<RankState>>) -> Self {
        ZeroWorker { rank, plan, sampler, comm, state, staged: None, ws: Workspace::default() }
    }

    /// Forward/backward of every leaf of this rank; returns (loss sum, block sums).
    fn compute_blocks(&mut self, step: u64, scale: f32, params: &Store) -> Result<(f64, Vec<BlockSum>), String> {
        let plan = Arc::clone(&self.plan);
        let (mb, t) = (plan.micro, plan.seq_len);
        let dloss = scale / plan.micro_batches as f32;
        let dtype = plan.precision.dtype();
        let mut inputs = vec![0u32; mb * t];
        let mut targets = vec![0u32; mb * t];
        let gathered = plan.stage == 3 && plan.world > 1;
        let mut acc = ParamAccess::new(&plan, params, if gathered { Some((&mut *self.comm, self.rank)) } else { None });
        let mut loss = 0.0f64;
        let mut sums = Vec::new();
        let mut slots = 0;
        for &(first, level) in &plan.blocks[self.rank] {
            let mut block = tree(dtype);
            for i in first..(first + (1 << level)).min(plan.micro_batches) {
                self.sampler.fill(plan.first_sample(step, i), mb, &mut inputs, &mut targets);
                acc.grads = vec![0.0; plan.total()];
                loss += f64::from(plan.model.forward_backward(&mut acc, &inputs, &targets, mb, t, dloss, &mut self.ws));
                let mut leaf = std::mem::take(&mut acc.grads);
                plan.precision.round(&mut leaf);
                block.push_block(i - first, 0, leaf).map_err(|e| e.to_string())?;
                slots += 1;
            }
            sums.push((first, level, block.finish().ok_or("empty micro-batch block")?));
        }
        // ZeRO-3 ranks with fewer leaves still serve their shards to the others' gathers.
        if gathered {
            for _ in slots..plan.max_leaves() {
                acc.replay_one_micro_batch();
            }
        }
        match acc.error.take() {
            Some(e) => Err(e),
            None => Ok((loss, sums)),
        }
    }

    /// Sends every block sum's slices to their owners; the owner combines its range with the tree.
    fn reduce_to_owner(&mut self, sums: &[BlockSum]) -> Result<Vec<f32>, String> {
        let plan = &self.plan;
        let rounds = plan.blocks.iter().map(Vec::len).max().unwrap_or(0);
        let mine = plan.ranges[self.rank].clone();
        let mut received: Vec<BlockSum> = Vec::new();
        for j in 0..rounds {
            let send: Vec<&[f32]> = match sums.get(j) {
                Some((_, _, s)) => plan.ranges.iter().map(|r| &s[r.clone()]).collect(),
                None => vec![&[][..]; plan.world],
            };
            let got = self.comm.all_to_all(&send).map_err(|e| e.to_string())?;
            for (from, data) in got.into_iter().enumerate() {
                if let Some(&(first, level)) = plan.blocks[from].get(j) {
                    if data.len() != mine.len() {
                        return Err(format!("rank {from} sent {} gradient values for block {first}, expected {}", data.len(), mine.len()));
                    }
                    received.push((first, level, data));
                }
            }
        }
        received.sort_by_key(|&(first, _, _)| first);
        let mut t = tree(plan.precision.dtype());
        for (first, level, data) in received {
            t.push_block(first, level, data).map_err(|e| e.to_string())?;
        }
        Ok(t.finish().unwrap_or_else(|| vec![0.0; mine.len()]))
    }

    /// Unscales, measures the global norm, clips and rounds this rank's reduced range.
    /// Returns (global norm, overflow).
    fn finish_gradient(&mut self, g: &mut [f32], scale: f32, clip: f64) -> Result<(f64, bool), String> {
        let plan = &self.plan;
        if scale != 1.0 {
            let inv = 1.0 / scale;
            g.iter_mut().for_each(|x| *x *= inv);
        }
        let mine = plan.ranges[self.rank].clone();
        let mut partials = vec![0.0f64; plan.flat.slots()];
        plan.flat.partial_sumsq(g, mine, &mut partials).map_err(|e| e.to_string())?;
        self.comm.all_reduce_sum_f64(&mut partials).map_err(|e| e.to_string())?;
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

    /// Parameters after the optimizer: share them as the stage requires.
    fn publish_params(&mut self, st: &mut RankState) -> Result<(), String> {
        let plan = &self.plan;
        match plan.stage {
            0 => st.params.write(0, &st.master),
            3 => st.params.write(0, &st.master),
            _ => {
                let mut full = vec![0.0; plan.total()];
                let mut mine = st.master.clone();
                plan.precision.round(&mut mine);
                self.comm.all_gather(&mine, &plan.ranges, &mut full).map_err(|e| e.to_string())?;
                st.params.write(0, &full);
            }
        }
        Ok(())
    }
}

impl WorkerCompute for ZeroWorker {
    fn prepare(&mut self, order: &StepOrder) -> Result<Prepared, String> {
        let t0 = Instant::now();
        let before = self.comm.stats();
        let state = Arc::clone(&self.state);
        let mut st = lock(&state);
        let scale = st.scaler.as_ref().map_or(1.0, LossScaler::scale);
        let (loss_sum, sums) = self.compute_blocks(order.step, scale, &st.params)?;
        let mut g = self.reduce_to_owner(&sums)?;
        drop(sums);
        let clip = f64::from(self.plan_clip());
        let (norm, overflow) = self.finish_gradient(&mut g, scale, clip)?;
        let plan = Arc::clone(&self.plan);
        let mine = plan.ranges[self.rank].clone();
        match plan.stage {
            0 | 1 => {
                let mut full = vec![0.0; plan.total()];
                self.comm.all_gather(&g, &plan.ranges, &mut full).map_err(|e| e.to_string())?;
                st.grads.write(0, &full);
            }
            _ => st.grads.write(0, &g),
        }
        debug_assert_eq!(g.len(), mine.len());
        self.staged = Some(Staged { step: order.step, overflow });
        st.bytes_sent_total = self.comm.stats().bytes_sent;
        let after = self.comm.stats();
        Ok(Prepared {
            loss_sum,
            micro_batches: plan.leaves(self.rank).len(),
            grad_norm: Some(norm),
            overflow,
            bytes_sent: after.bytes_sent - before.bytes_sent,
            bytes_received: after.bytes_received - before.bytes_received,
            compute_s: t0.elapsed().as_secs_f64(),
        })
    }

    fn commit(&mut self, step: u64) -> Result<(), String> {
        let staged = match self.staged.take() {
            Some(s) if s.step == step => s,
            other => return Err(format!("rank {}: commit of step {step} but staged {:?}", self.rank, other.map(|s| s.step))),
        };
        let state = Arc::clone(&self.state);
        let mut st = lock(&state);
        if let Some(sc) = st.scaler.as_mut() {
            if let StepOutcome::SkippedOverflow { .. } = sc.update(staged.overflow).map_err(|e| e.to_string())? {
                st.skipped += 1;
                return Ok(());
            }
        } else if staged.overflow {
            st.skipped += 1;
            return Ok(());
        }
        let plan = Arc::clone(&self.plan);
        let lr = self.lr_at(st.applied);
        let range = plan.optim_range(self.rank);
        let mut g = vec![0.0; range.len()];
        match plan.stage {
            0 | 1 => st.grads.read(range.start, &mut g),
            _ => st.grads.read(0, &mut g),
        }
        let ctx = StepContext { shard_range: range, layout: &plan.flat, decay: &plan.decay };
        let RankState { master, optim, .. } = &mut *st;
        if plan.stage == 0 {
            optim.step(master, &g, lr, &ctx, &mut LocalReduce).map_err(|e| e.to_string())?;
        } else {
            let mut reducer = CommReduce(&mut *self.comm, None);
            optim.step(master, &g, lr, &ctx, &mut reducer).map_err(|e| e.to_string())?;
            if let Some(e) = reducer.1 {
                return Err(e);
            }
        }
        self.publish_params(&mut st)?;
        st.applied += 1;
        st.bytes_sent_total = self.comm.stats().bytes_sent;
        Ok(())
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

/// Parameters of one unit for compute: read from this rank's store (stages 0–2) or gathered
/// from every rank's shard (stage 3). Unit 0 stays for the whole step (embeddings and the tied
/// head use it at both ends); of the blocks, only the one in use is held.
struct ParamAccess<'a> {
    plan: &'a Plan,
    store: &'a Store,
    comm: Option<(&'a mut dyn Collective, usize)>,
    cache: Vec<Option<Vec<f32>>>,
    held_block: Option<usize>,
    /// The current leaf's gradient buffer (full length), or empty when replaying.
    grads: Vec<f32>,
    error: Option<String>,
}

impl<'a> ParamAccess<'a> {
    fn new(plan: &'a Plan, store: &'a Store, comm: Option<(&'a mut dyn Collective, usize)>) -> Self {
        let n = plan.model.units().len();
        ParamAccess { plan, store, comm, cache: vec![None; n], held_block: None, grads: Vec::new(), error: None }
    }

    fn load(&mut self, u: usize) -> Vec<f32> {
        let unit = self.plan.model.units()[u].clone();
        let mut buf = vec![0.0; unit.len()];
        match &mut self.comm {
            None => self.store.read(unit.start, &mut buf),
            Some((comm, rank)) => {
                let parts: Vec<Range<usize>> = self
                    .plan
                    .ranges
                    .iter()
                    .map(|r| {
                        let (a, b) = (r.start.clamp(unit.start, unit.end), r.end.clamp(unit.start, unit.end));
                        a - unit.start..b - unit.start
                    })
                    .collect();
                let own = &parts[*rank];
                let mut mine = vec![0.0; own.len()];
                if !own.is_empty() {
                    let shard_start = self.plan.ranges[*rank].start;
                    self.store.read(own.start + unit.start - shard_start, &mut mine);
                }
                if let Err(e) = comm.all_gather(&mine, &parts, &mut buf) {
                    self.error.get_or_insert(format!("gathering unit {u}: {e}"));
                }
            }
        }
        buf
    }

    /// The sequence of unit uses of one `forward_backward`, without compute (idle ZeRO-3 slots).
    fn replay_one_micro_batch(&mut self) {
        let l = self.plan.model.units().len() - 1;
        let seq = std::iter::once(0).chain(1..=l).chain(std::iter::once(0)).chain((1..=l).rev()).chain(std::iter::once(0));
        for u in seq.collect::<Vec<_>>() {
            let _ = self.unit(u);
        }
    }
}

impl UnitAccess for ParamAccess<'_> {
    fn unit(&mut self, u: usize) -> (&[f32], &mut [f32]) {
        if self.cache[u].is_none() {
            if u != 0 {
                if let Some(prev) = self.held_block.replace(u) {
                    self.cache[prev] = None;
                }
            }
            self.cache[u] = Some(self.load(u));
        }
        let range = self.plan.model.units()[u].clone();
        let grads = if self.grads.is_empty() { &mut self.grads[..] } else { &mut self.grads[range] };
        (self.cache[u].as_deref().unwrap_or(&[]), grads)
    }
}
