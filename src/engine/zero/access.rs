//! The model's view of a step ([`StepAccess`], the [`UnitAccess`] of the ZeRO engine): the
//! parameters each unit call is served (read, or gathered on the schedule) and the gradient
//! buckets sent to their owners as the backward finishes them.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tessera_actors::compute::ComputeError;
use tessera_kernels::experts::ExpertRunner;
use tessera_kernels::model::UnitAccess;
use tessera_transport::tree::TreeSum;

use super::super::lane::{Lane, Ticket};
use super::super::plan::{Plan, UnitEvent};
use super::experts::{EpRunner, ExpertState};
use super::gather::{gather_schedule, release, Gather};
use super::owner_sums::{tree, OwnerSums};
use super::{clamp_to, lock, ParamStore};

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
pub(super) struct StepAccess<'a> {
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
    pub(super) error: Option<ComputeError>,
    /// Expert parallelism: the experts' gradients this rank supplies for its group's
    /// micro-batches, and what their forwards saved.
    experts: ExpertState,
    /// Time spent in the lane on the model's behalf (collectives run inline, results waited
    /// for): waits on peers, not this rank's compute.
    pub(super) waited: Duration,
    /// The part of `waited` spent on gradient exchanges (during the backward).
    pub(super) grad_waited: Duration,
}

impl<'a> StepAccess<'a> {
    pub(super) fn new(plan: Arc<Plan>, rank: usize, store: &'a ParamStore, lane: &'a mut Lane, owner: Arc<Mutex<OwnerSums>>) -> Self {
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
            experts: ExpertState::new(&plan),
            waited: Duration::ZERO,
            grad_waited: Duration::ZERO,
            plan,
        }
    }

    pub(super) fn fail(&mut self, e: ComputeError) {
        self.error.get_or_insert(e);
    }

    pub(super) fn begin_slot(&mut self, slot: usize, computing: bool) {
        self.slot = slot;
        self.computing = computing;
        self.event_pos = 0;
        self.next_bucket = self.buckets.len();
    }

    /// Checks that the slot saw every unit event and sent every bucket.
    pub(super) fn end_slot(&mut self) {
        if self.event_pos != self.events.len() {
            let e = format!("slot {}: the model made {} of the {} unit calls planned", self.slot, self.event_pos, self.events.len());
            self.fail(ComputeError::failed(e));
        }
        self.grads.iter_mut().for_each(|g| *g = None);
        self.pieces.iter_mut().for_each(|p| *p = None);
        self.experts.end_slot();
    }

    /// The unit events of one micro-batch without compute (a slot this rank has no
    /// micro-batch for): gathers are served and exchanges joined, with nothing to send.
    pub(super) fn replay(&mut self) {
        let units = self.plan.model.units().len();
        for (pos, ev) in self.events.clone().into_iter().enumerate() {
            match ev {
                UnitEvent::Use(u) if self.plan.experts.as_ref().is_some_and(|ep| ep.is_moe(u)) => self.serve_experts(u, pos >= units),
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

    /// A use of MoE unit `u` without a micro-batch of this rank's: its experts still run on
    /// the group's tokens, in the exchanges the model makes at this use (the forward's; with
    /// activation recomputation the backward's recomputed forward and then its backward).
    fn serve_experts(&mut self, u: usize, backward: bool) {
        let plan = Arc::clone(&self.plan);
        let recompute = plan.model.checkpoint_activations;
        let Some(mlp) = plan.model.expert_mlp(u - 1) else {
            self.fail(ComputeError::failed(format!("unit {u} has experts in the plan but none in the model")));
            return;
        };
        let none = vec![Vec::new(); mlp.num_experts()];
        let (p, _, runner) = self.unit_parts(u);
        let Some(mut runner) = runner else { return };
        if !backward || recompute {
            runner.forward(u, mlp, p, none.clone());
        }
        if backward {
            runner.backward(u, mlp, p, none);
        }
    }

    /// The error, if any, and every exchange still to wait for.
    pub(super) fn finish(mut self) -> (Option<ComputeError>, Vec<Ticket<Result<(), ComputeError>>>) {
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
        // To each owner, the pieces this rank supplies of every sending rank's values, in the
        // order `OwnerSums::receive` reads them: its own values when it sends in this slot, and
        // with expert parallelism the expert gradients it made for its group's micro-batches.
        let slot = self.slot;
        let sending: Vec<usize> = (0..plan.world).filter(|&q| plan.slot_send(q, slot).is_some()).collect();
        let sends: Vec<Vec<f32>> = plan
            .ranges
            .iter()
            .map(|r| {
                let part = r.start.clamp(bucket.start, bucket.end)..r.end.clamp(bucket.start, bucket.end);
                let mut out = Vec::new();
                for &q in &sending {
                    for (piece, who) in plan.suppliers(q, part.clone()) {
                        if who == self.rank {
                            out.extend(self.values_of(q, piece));
                        }
                    }
                }
                out
            })
            .collect();
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

    /// Rank `q`'s values over flat `range` that this rank supplies: its own (outside the
    /// experts), or the expert gradients it computed for `q`'s micro-batch.
    fn values_of(&mut self, q: usize, range: Range<usize>) -> Vec<f32> {
        let plan = Arc::clone(&self.plan);
        let Some((u, j)) = plan.experts.as_ref().and_then(|ep| ep.slice_at(range.start)) else {
            return self.values(range);
        };
        let ep = plan.experts.as_ref().expect("checked");
        let slice = ep.slice_range(u, j);
        let k = q - ep.group(q).start;
        match self.experts.piece(u, k) {
            Some(p) if range.end <= slice.end => p[range.start - slice.start..range.end - slice.start].to_vec(),
            _ => {
                self.error.get_or_insert(ComputeError::failed(format!(
                    "the expert gradients of rank {q}'s micro-batch over flat {}..{} were not ready when sent",
                    range.start, range.end
                )));
                vec![0.0; range.len()]
            }
        }
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

impl<'a> StepAccess<'a> {
    /// Loads unit `u` for its next use (gathered on the schedule, or read); returns whether
    /// the use is a backward one (the first `units` uses are the forward's).
    fn use_unit(&mut self, u: usize) -> bool {
        let pos = self.expect_event(UnitEvent::Use(u));
        if self.cache[u].is_none() {
            let plan = Arc::clone(&self.plan);
            release(&plan, &mut self.cache, &mut self.held_block, u, |c, x| c[x] = None);
            let vals = self.load(u);
            self.cache[u] = Some(vals);
        }
        self.prefetch();
        self.use_pos += 1;
        pos >= self.plan.model.units().len()
    }

    /// Unit `u`'s parameters and gradient buffer (empty in the forward, or without a
    /// micro-batch of this rank's), and with expert parallelism the runner of its experts.
    fn unit_parts(&mut self, u: usize) -> (&[f32], &mut [f32], Option<EpRunner<'_>>) {
        let backward = self.use_unit(u);
        let len = self.plan.model.units()[u].len();
        let grads = if backward && self.computing { &mut self.grads[u].get_or_insert_with(|| vec![0.0; len])[..] } else { &mut [][..] };
        let runner = self.plan.experts.as_ref().filter(|ep| ep.is_moe(u)).map(|_| EpRunner {
            plan: &self.plan,
            rank: self.rank,
            lane: &mut *self.lane,
            state: &mut self.experts,
            error: &mut self.error,
            waited: &mut self.waited,
        });
        (self.cache[u].as_deref().unwrap_or(&[]), grads, runner)
    }
}

impl UnitAccess for StepAccess<'_> {
    fn unit(&mut self, u: usize) -> (&[f32], &mut [f32]) {
        let (p, g, _) = self.unit_parts(u);
        (p, g)
    }

    fn unit_with_experts(&mut self, u: usize) -> (&[f32], &mut [f32], Option<Box<dyn ExpertRunner + '_>>) {
        let (p, g, runner) = self.unit_parts(u);
        (p, g, runner.map(|r| Box::new(r) as Box<dyn ExpertRunner + '_>))
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
        // The experts' gradients this rank made for its group's micro-batches (also in a slot
        // without a micro-batch of its own).
        if let Err(e) = self.experts.ready(&plan, self.rank, self.slot, u) {
            self.fail(ComputeError::failed(e));
        }
        if plan.slot_active(self.slot) {
            self.send_ready_buckets(plan.model.units()[u].start);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{plan, two_steps, two_steps_with, BLOCK, UNIT0};
    use super::*;

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
}
