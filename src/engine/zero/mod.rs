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
//!
//! The module, one concept per file: this file is the step ([`ZeroWorker`]: prepare, commit,
//! abandon, the optimizer step); `state` is what a rank holds ([`RankState`], [`ParamStore`]),
//! `swap` the stage-3 parameter swap file and its byte codec, `access` the model's view of a
//! step (gathers in use, gradient buckets sent), `owner_sums` the owners' side of the gradient
//! exchange (the fixed micro-batch tree), `gather` stage 3's gather schedule and release
//! policy, and `feed` the replica feed of elastic runs.

mod access;
mod experts;
mod feed;
mod gather;
mod owner_sums;
mod pipeline;
mod state;
mod swap;
#[cfg(test)]
mod testing;

use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tessera_actors::compute::{ComputeError, MemoryReport, MoeTally, PhaseTimes, Prepared, StepOrder, WorkerCompute};
use tessera_kernels::model::{noise_key_of, MicroBatch};
use tessera_kernels::optim::{clip_coefficient, LocalReduce, LossScaler, NormAllReduce, StepContext, StepOutcome};
use tessera_transport::collective::Collective;

pub use gather::{gather_schedule, Gather};
pub use state::{ParamStore, RankState};

use self::access::StepAccess;
use self::feed::{Feed, Received};
use self::owner_sums::OwnerSums;
use super::device::Device;
use super::lane::Lane;
use super::plan::Plan;
use super::store::Store;
use crate::data::Sampler;

/// The part of `r` inside `within`, relative to `within.start` (empty when they do not meet).
fn clamp_to(r: &Range<usize>, within: &Range<usize>) -> Range<usize> {
    let (a, b) = (r.start.clamp(within.start, within.end), r.end.clamp(within.start, within.end));
    a - within.start..b - within.start
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

/// What `prepare` leaves for `commit`: the reduced, clipped gradient sits in `RankState::grads`.
struct Staged {
    step: u64,
    overflow: bool,
    /// What the ring predecessors sent at the end of prepare (elastic runs): received before
    /// `Prepared` is answered, so once every rank has prepared, every holder has its owners'
    /// updates and a loss during the commit cannot leave a replica behind its owner.
    received: Option<Received>,
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
    /// The MoE routing statistics of this rank's micro-batches (MoE models).
    moe: Option<MoeTally>,
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
    /// A pipelined rank: its instructions of the last step, timed.
    timeline: Vec<super::pipeline::timeline::Timed>,
    /// A pipelined rank: the most activation bytes it held at once in the last step.
    activation_bytes_peak: u64,
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
        ZeroWorker { rank, plan, sampler, lane, state, staged: None, dev, feed: None, timeline: Vec::new(), activation_bytes_peak: 0 }
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

    /// Forward/backward of this rank's micro-batches, slot by slot, with their gradients
    /// travelling to the partition owners as the backward produces them.
    fn compute_and_reduce(&mut self, step: u64, scale: f32, params: &ParamStore) -> Result<Computed, ComputeError> {
        if self.plan.pipeline.is_some() {
            return self.compute_pipelined(step, scale, params);
        }
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
        // The MoE routing statistics of this rank's micro-batches, added in slot order.
        let mut moe = None;
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
                    match dev.forward_backward(
                        &plan.model,
                        &mut acc,
                        MicroBatch {
                            tokens: &inputs,
                            targets: &targets,
                            b: mb,
                            t,
                            noise_key: noise_key_of(sampler.seed(), step, i as u64),
                        },
                        dloss,
                        *rank,
                    ) {
                        Ok(l) => {
                            loss += f64::from(l);
                            if let Some(m) = dev.moe_tally() {
                                moe.get_or_insert_with(MoeTally::default).add(&m);
                            }
                        }
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
                // With expert parallelism it also runs its experts on its group's tokens.
                None if plan.gathers() || plan.slot_active(s) || (plan.experts.is_some() && plan.slot_computes(s)) => {
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
        Ok(Computed { loss, grad, busy_s: busy.as_secs_f64(), busy_micro_batches: common, phases, moe })
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
        let Computed { loss: loss_sum, grad: mut g, busy_s, busy_micro_batches, mut phases, moe } =
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
                if tessera_fleet::driver::tracing() {
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
            moe,
            timeline: std::mem::take(&mut self.timeline).iter().map(super::pipeline::timeline::Timed::op).collect(),
            activation_bytes_peak: std::mem::take(&mut self.activation_bytes_peak),
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
        self.plan.lr_at(applied)
    }
}

#[cfg(test)]
mod tests {
    use super::super::plan::UnitEvent;
    use super::testing::{plan, plan_error, two_steps, two_steps_with, LAMB, ONE_CYCLE, STAGED};
    use super::*;
    use tessera_kernels::model::{FlatAccess, UnitAccess, Workspace};
    use tessera_transport::collective::{AbortHandle, CollectiveError, CommStats};
    use tessera_transport::local::LocalComm;

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

    /// Every optimizer besides AdamW and Lamb (whose test is above) through the engine: its state
    /// (SGD's momentum buffer, Lion's exp_avg, Adagrad's sum from its initial accumulator) is
    /// sharded with the masters, and every world size and stage gives the one-worker bits.
    #[test]
    fn sgd_lion_and_adagrad_give_the_one_worker_bits_at_every_world_and_stage() {
        for opt in [
            r#"optimizer={"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}}"#,
            r#"optimizer={"type": "Lion", "params": {"lr": 1e-3, "weight_decay": 0.1}}"#,
            r#"optimizer={"type": "Adagrad", "params": {"lr": 0.05, "lr_decay": 0.1, "weight_decay": 0.01, "initial_accumulator_value": 0.1}}"#,
        ] {
            let (one, _) = two_steps(1, 0, &[opt]);
            let (adamw, _) = two_steps(1, 0, &[]);
            assert_ne!(one, adamw, "{opt}: the optimizer changed nothing");
            for (world, stage) in [(2, 1), (4, 2), (2, 3), (4, 3)] {
                let (got, _) = two_steps(world, stage, &[opt]);
                assert!(got == one, "{opt}: world {world} stage {stage} differs from one worker");
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

    /// A GPU rank takes every unit's parameters at its forward use, runs the whole micro-batch
    /// on the device and hands the gradients back at their backward uses
    /// ([`super::super::device::Staged`]). With the CPU's arithmetic behind that staging, every
    /// stage and world size gives the unit-by-unit bits: the unit events, the collectives they
    /// drive (stage 3's gathers at the forward uses, the buckets at the backward's) and the
    /// gradients are the same. So does fp16 (the gradients handed back are stored in fp16 under
    /// the loss scale, as `gradient_fed_replicas_stay_bit_identical_to_their_owners` sets it up;
    /// the skip itself is the engine's, tested there and on the GPU by `tests/e2e_gpu.rs`).
    #[test]
    fn whole_micro_batches_staged_as_on_the_gpu_give_the_unit_by_unit_bits() {
        let fp16 = ["bf16.enabled=false", "fp16.enabled=true", "fp16.initial_scale_power=18", "fp16.hysteresis=1"];
        for extra in [&[][..], &fp16[..]] {
            let (one, _) = two_steps(1, 0, extra);
            for (world, stage) in [(1, 0), (2, 1), (4, 2), (2, 3), (4, 3)] {
                let sets: Vec<&str> = ["zero_optimization.stage3_param_persistence_threshold=0"].iter().chain(extra).copied().collect();
                STAGED.set(true);
                let (staged, ops_staged) = two_steps(world, stage, &sets);
                STAGED.set(false);
                let (direct, ops_direct) = two_steps(world, stage, &sets);
                assert_eq!(staged, direct, "world {world}, stage {stage}, {extra:?}: staged bits differ");
                assert_eq!(ops_staged, ops_direct, "world {world}, stage {stage}, {extra:?}: other collectives");
                assert_eq!(staged, one, "world {world}, stage {stage}, {extra:?}: not the one-rank bits");
            }
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
            p.model.forward_backward(
                &mut rec,
                MicroBatch { tokens: &tokens, targets: &tokens, b: 1, t: 16, noise_key: 0 },
                1.0,
                &mut Workspace::default(),
            );
            assert_eq!(rec.events, p.micro_batch_events(), "activation recomputation {recompute}");
        }
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
}
