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
//! Stage 3 keeps *persistent* units (smaller than `stage3_param_persistence_threshold`) whole on
//! every rank besides its shard: they are never gathered, their optimizer state stays
//! partitioned, and the commit all-gathers their new values. Gradients reach their owners in
//! all-to-alls of at most `reduce_bucket_size` elements; the owner combines whole ranges with the
//! tree, which is elementwise, so bucketing never changes a bit.
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
use tessera_kernels::optim::{clip_coefficient, LocalReduce, LossScaler, NormAllReduce, StepContext, StepOutcome};
use tessera_transport::collective::Collective;
use tessera_transport::tree::TreeSum;

use super::plan::Plan;
use super::store::Store;
use crate::data::Sampler;
use crate::offload::{self, Masters, OptimState, Tier};

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

/// Working parameters of one rank: disjoint flat ranges of the buffer, packed in order in one
/// `Store` (so its bytes are the bytes really held).
pub struct ParamStore {
    /// (flat range, offset in `store`), sorted by flat start.
    segs: Vec<(Range<usize>, usize)>,
    store: Store,
    /// Bytes of the stage-3 shard among them (what `offload_param` moves to the host tier).
    pub shard_bytes: u64,
}

impl ParamStore {
    /// Holds `ranges` (sorted, disjoint) of `full`, rounded to `dtype`.
    pub fn new(dtype: DType, ranges: &[Range<usize>], full: &[f32]) -> ParamStore {
        let mut segs = Vec::with_capacity(ranges.len());
        let mut len = 0;
        for r in ranges {
            segs.push((r.clone(), len));
            len += r.len();
        }
        let mut store = Store::zeros(dtype, len);
        for (r, off) in &segs {
            store.write(*off, &full[r.clone()]);
        }
        ParamStore { segs, store, shard_bytes: 0 }
    }

    pub fn bytes(&self) -> u64 {
        self.store.bytes()
    }

    /// Where flat `[start, start + len)` sits in the store: it must lie inside one held range.
    fn offset(&self, start: usize, len: usize) -> Result<usize, String> {
        if len == 0 {
            return Ok(0);
        }
        self.segs
            .iter()
            .find(|(r, _)| r.start <= start && start + len <= r.end)
            .map(|(r, off)| off + start - r.start)
            .ok_or_else(|| format!("parameters {start}..{} are not held by this rank", start + len))
    }

    /// `out = params[start .. start + out.len()]` (flat indices), widened to f32.
    pub fn read(&self, start: usize, out: &mut [f32]) -> Result<(), String> {
        let off = self.offset(start, out.len())?;
        self.store.read(off, out);
        Ok(())
    }

    /// `params[start ..] = src` (flat indices), rounded to the storage type.
    pub fn write(&mut self, start: usize, src: &[f32]) -> Result<(), String> {
        let off = self.offset(start, src.len())?;
        self.store.write(off, src);
        Ok(())
    }
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
        RankState {
            params: {
                let mut p = ParamStore::new(dtype, &plan.param_ranges(rank), full_master);
                if plan.stage == 3 {
                    p.shard_bytes = (plan.ranges[rank].len() * dtype.size_bytes()) as u64;
                }
                p
            },
            grads: Store::zeros(dtype, g_len),
            master,
            optim,
            params_offloaded: plan.stage == 3 && plan.offload.param != Tier::Device,
            offload_error: e1.or(e2),
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
        let optim = if self.optim.tier() == Tier::Device { self.master.bytes() + self.optim.bytes() } else { 0 };
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
    fn compute_blocks(&mut self, step: u64, scale: f32, params: &ParamStore) -> Result<(f64, Vec<BlockSum>), String> {
        let plan = Arc::clone(&self.plan);
        let (mb, t) = (plan.micro, plan.seq_len);
        let dloss = scale / plan.micro_batches as f32;
        let dtype = plan.precision.dtype();
        let mut inputs = vec![0u32; mb * t];
        let mut targets = vec![0u32; mb * t];
        let gathered = plan.gathers();
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

    /// Sends round `j`'s block sum (if this rank has one) to the owners, bucket by bucket: each
    /// bucket of the flat buffer is one all-to-all of its slice per owner. Returns, per sender,
    /// the values it sent for this rank's range.
    fn exchange_round(&mut self, sum: Option<&[f32]>) -> Result<Vec<Vec<f32>>, String> {
        let plan = Arc::clone(&self.plan);
        let mut from_each = vec![Vec::new(); plan.world];
        for bucket in plan.reduce_buckets() {
            let send: Vec<&[f32]> = match sum {
                Some(s) => plan.ranges.iter().map(|r| &s[bucket.clone()][clamp_to(r, &bucket)]).collect(),
                None => vec![&[][..]; plan.world],
            };
            let got = self.comm.all_to_all(&send).map_err(|e| e.to_string())?;
            for (acc, data) in from_each.iter_mut().zip(got) {
                acc.extend_from_slice(&data);
            }
        }
        Ok(from_each)
    }

    /// Sends every block sum's slices to their owners; the owner combines its range with the tree.
    fn reduce_to_owner(&mut self, sums: &[BlockSum]) -> Result<Vec<f32>, String> {
        let plan = Arc::clone(&self.plan);
        let rounds = plan.blocks.iter().map(Vec::len).max().unwrap_or(0);
        let mine = plan.ranges[self.rank].clone();
        let mut received: Vec<BlockSum> = Vec::new();
        for j in 0..rounds {
            let got = self.exchange_round(sums.get(j).map(|(_, _, s)| &s[..]))?;
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

    /// Parameters after the optimizer, which has written this rank's new masters (rounded to
    /// the storage type) into its own range of `st.params`: share them as the stage requires.
    fn publish_params(&mut self, st: &mut RankState) -> Result<(), String> {
        let plan = &self.plan;
        match plan.stage {
            0 => Ok(()),
            3 => self.share_persistent_units(st),
            _ => {
                let own = plan.ranges[self.rank].clone();
                let mut full = vec![0.0; plan.total()];
                let mut mine = vec![0.0; own.len()];
                st.params.read(own.start, &mut mine)?;
                self.comm.all_gather(&mine, &plan.ranges, &mut full).map_err(|e| e.to_string())?;
                st.params.write(0, &full)
            }
        }
    }

    /// Stage 3: every rank's copy of each persistent unit takes the owners' new values.
    fn share_persistent_units(&mut self, st: &mut RankState) -> Result<(), String> {
        let plan = Arc::clone(&self.plan);
        for (u, unit) in plan.model.units().iter().enumerate().filter(|(u, _)| plan.persistent[*u]) {
            let parts: Vec<Range<usize>> = plan.ranges.iter().map(|r| clamp_to(r, unit)).collect();
            let mine = &parts[self.rank];
            // The owned part of the unit lies inside this rank's shard, whose new values the
            // optimizer has written to the parameters (rounding again changes nothing).
            let mut vals = vec![0.0; mine.len()];
            st.params.read(mine.start + unit.start, &mut vals)?;
            plan.precision.round(&mut vals);
            let mut buf = vec![0.0; unit.len()];
            self.comm.all_gather(&vals, &parts, &mut buf).map_err(|e| format!("sharing persistent unit {u}: {e}"))?;
            st.params.write(unit.start, &buf)?;
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
        if let Some(e) = &st.offload_error {
            return Err(format!("rank {}: setting up NVMe offload failed at start: {e}", self.rank));
        }
        // Copies made for readers between steps (evaluation, checkpoints) go now.
        st.master.release();
        st.optim.release();
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
        let after = self.comm.stats();
        (st.bytes_sent_total, st.ops_total) = (after.bytes_sent, after.ops);
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
        let start = range.start;
        let ctx = StepContext { shard_range: range, layout: &plan.flat, decay: &plan.decay };
        let RankState { master, optim, params, .. } = &mut *st;
        let mut publish = |off: usize, vals: &[f32]| params.write(start + off, vals);
        if plan.stage == 0 {
            optim.step(master, &g, lr, &ctx, &mut LocalReduce, &mut publish)?;
        } else {
            let mut reducer = CommReduce(&mut *self.comm, None);
            let res = optim.step(master, &g, lr, &ctx, &mut reducer, &mut publish);
            if let Some(e) = reducer.1 {
                return Err(e);
            }
            res?;
        }
        self.publish_params(&mut st)?;
        st.applied += 1;
        let stats = self.comm.stats();
        (st.bytes_sent_total, st.ops_total) = (stats.bytes_sent, stats.ops);
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

/// Parameters of one unit for compute: read from this rank's store (stages 0–2, persistent
/// units) or gathered from every rank's shard (stage 3). Of the blocks, only the one in use is
/// held; unit 0 (embeddings and the tied head, used at both ends) stays for the whole step
/// when `Plan::keep_unit0`, else it is released whenever a block is gathered.
struct ParamAccess<'a> {
    plan: &'a Plan,
    store: &'a ParamStore,
    comm: Option<(&'a mut dyn Collective, usize)>,
    cache: Vec<Option<Vec<f32>>>,
    held_block: Option<usize>,
    /// The current leaf's gradient buffer (full length), or empty when replaying.
    grads: Vec<f32>,
    error: Option<String>,
}

impl<'a> ParamAccess<'a> {
    fn new(plan: &'a Plan, store: &'a ParamStore, comm: Option<(&'a mut dyn Collective, usize)>) -> Self {
        let n = plan.model.units().len();
        ParamAccess { plan, store, comm, cache: vec![None; n], held_block: None, grads: Vec::new(), error: None }
    }

    fn load(&mut self, u: usize) -> Vec<f32> {
        let unit = self.plan.model.units()[u].clone();
        let mut buf = vec![0.0; unit.len()];
        let res = match &mut self.comm {
            Some((comm, rank)) if !self.plan.persistent[u] => {
                let parts: Vec<Range<usize>> = self.plan.ranges.iter().map(|r| clamp_to(r, &unit)).collect();
                let own = &parts[*rank];
                let mut mine = vec![0.0; own.len()];
                self.store
                    .read(own.start + unit.start, &mut mine)
                    .and_then(|()| comm.all_gather(&mine, &parts, &mut buf).map_err(|e| e.to_string()))
            }
            _ => self.store.read(unit.start, &mut buf),
        };
        if let Err(e) = res {
            self.error.get_or_insert(format!("loading unit {u}: {e}"));
        }
        buf
    }

    /// Releases what must go before unit `u` is loaded: the previous block, and unit 0 too
    /// when it may not stay live next to a block (or a block next to it).
    fn release_for(&mut self, u: usize) {
        if u != 0 {
            if let Some(prev) = self.held_block.replace(u) {
                self.cache[prev] = None;
            }
            if !self.plan.keep_unit0 {
                self.cache[0] = None;
            }
        } else if !self.plan.keep_unit0 {
            if let Some(prev) = self.held_block.take() {
                self.cache[prev] = None;
            }
        }
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
            self.release_for(u);
            self.cache[u] = Some(self.load(u));
        }
        let range = self.plan.model.units()[u].clone();
        let grads = if self.grads.is_empty() { &mut self.grads[..] } else { &mut self.grads[range] };
        (self.cache[u].as_deref().unwrap_or(&[]), grads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{from_str_named, Config, ResolveContext};
    use crate::data::Dataset;
    use tessera_transport::local::LocalGroup;

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
        (cfg, Dataset { train: tokens.clone(), val: tokens, vocab_size: 256, source: "synthetic".into() })
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
        let plan = Arc::new(plan(world, stage, sets));
        let (_, data) = setup(world, stage, sets);
        let sampler = Arc::new(Sampler::new(data.train, plan.seq_len, 7).expect("sampler"));
        let init = plan.model.init_params(7);
        let states: Vec<_> = (0..world).map(|r| Arc::new(Mutex::new(RankState::new(&plan, r, &init, None)))).collect();
        let handles: Vec<_> = LocalGroup::new(world)
            .into_iter()
            .enumerate()
            .map(|(r, comm)| {
                let mut w = ZeroWorker::new(r, Arc::clone(&plan), Arc::clone(&sampler), Box::new(comm), Arc::clone(&states[r]));
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

    #[test]
    fn small_reduce_buckets_add_all_to_alls_and_change_no_bit() {
        let (whole, ops_whole) = two_steps(2, 2, &[]);
        let (bucketed, ops_bucketed) = two_steps(2, 2, &["zero_optimization.reduce_bucket_size=50000"]);
        assert_eq!(whole, bucketed, "bucketing changed the parameters");
        // 842,496 parameters make 17 buckets of 50,000 instead of one all-to-all per round; each
        // rank has one block of 2 micro-batches per step, so one round per step, two steps.
        let buckets = (UNIT0 + 4 * BLOCK).div_ceil(50_000) as u64;
        for (a, b) in ops_whole.iter().zip(&ops_bucketed) {
            assert_eq!(b - a, 2 * (buckets - 1), "ops {ops_whole:?} vs {ops_bucketed:?}");
        }
        let (one, _) = two_steps(1, 0, &[]);
        assert_eq!(one, whole, "world 2 stage 2 differs from one worker");
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
        let e = plan_error(2, 2, &["zero_optimization.reduce_bucket_size=0"]);
        assert!(e.contains("zero_optimization.reduce_bucket_size = 0"), "{e}");
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
