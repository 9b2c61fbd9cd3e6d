//! A pipelined rank's step ([`ZeroWorker::compute_pipelined`]): the rank is stage `p` of
//! replica `d` ([`PipePlan`]); it runs its stage's instruction stream
//! ([`schedule::stream`]) over the replica's micro-batches, exchanging streams and their
//! gradients point to point with the neighbouring stages, and adds each micro-batch's gradients
//! of the units it computes into the fixed tree, block by block. After the stream, the block
//! sums go to the partition owners in world all-to-alls, slot by slot as at ZeRO stages 0–1
//! ([`OwnerSums`], [`Plan::suppliers`]); the rest of the step (norm, clipping, optimizer,
//! sharing the parameters) is the unpipelined rank's.
//!
//! Parameters: a stage reads only its units (its blocks, and unit 0 on the first and last
//! stage). At ZeRO stages 0–2 every rank holds them all; at stage 3 the owners send each stage
//! the pieces of its units at the start of the step (point to point, only to the ranks that
//! read them), and the rank drops them at its end.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use tessera_actors::compute::{ComputeError, MoeTally, PhaseTimes};
use tessera_kernels::model::{noise_key_of, MicroBatch, UnitAccess, WStash, Workspace};
use tessera_transport::tree::TreeSum;

use super::super::moe_stats::tally_of;
use super::super::pipeline::schedule::{self, Kind, Op};
use super::super::pipeline::timeline::Timed;
use super::super::pipeline::PipePlan;
use super::super::plan::Plan;
use super::owner_sums::{tree, OwnerSums};
use super::{clamp_to, Computed, ParamStore, ZeroWorker};

/// Tags of the pipeline's point-to-point messages: "PIPE" in the high half, then the kind, the
/// step (mod 1024), the receiving chunk and the micro-batch (or unit).
const PIPE_TAG: u64 = 0x5049_5045 << 32;
const FORWARD: u64 = 0;
const BACKWARD: u64 = 1;
const EMBED: u64 = 2;
const PARAMS: u64 = 3;

fn tag(kind: u64, step: u64, chunk: usize, index: usize) -> u64 {
    debug_assert!(chunk < 64 && index < 1 << 14, "chunk {chunk}, index {index}");
    PIPE_TAG | (kind << 30) | ((step & 0x3ff) << 20) | ((chunk as u64 & 0x3f) << 14) | (index as u64 & 0x3fff)
}

/// The model's view of one instruction: the stage's parameters, and in a backward the
/// micro-batch's gradient buffers, filled as the units finish.
struct PipeAccess<'a> {
    params: &'a [Option<Vec<f32>>],
    units: &'a [Range<usize>],
    grads: &'a mut [Option<Vec<f32>>],
    backward: bool,
    /// Units whose gradients the instruction finished, in order.
    ready: Vec<usize>,
}

impl UnitAccess for PipeAccess<'_> {
    fn unit(&mut self, u: usize) -> (&[f32], &mut [f32]) {
        let p = self.params[u].as_deref().unwrap_or_else(|| panic!("unit {u} is not one of this stage's"));
        let len = self.units[u].len();
        let g = if self.backward { &mut self.grads[u].get_or_insert_with(|| vec![0.0; len])[..] } else { &mut [][..] };
        (p, g)
    }

    fn grads_ready(&mut self, u: usize) {
        self.ready.push(u);
    }
}

/// A micro-batch's chunk between its forward and the last instruction that needs it.
struct InFlight {
    ws: Workspace,
    tokens: Vec<u32>,
    targets: Vec<u32>,
    /// Its gradient buffers not yet finished (unit 0 on the last stage waits for the
    /// embeddings' backward).
    grads: Vec<Option<Vec<f32>>>,
    /// d(embeddings) of a one-stage pipeline, kept for its embeddings' backward.
    dx0: Option<Vec<f32>>,
    /// The weight gradients' inputs between a backward's input half and its weight half.
    stash: Option<WStash>,
}

/// The stage's gradient trees: per unit the block in progress, and the finished block sums.
struct StageSums {
    trees: Vec<Option<TreeSum>>,
    /// Per block (by its first leaf), per unit: the block's sum.
    done: BTreeMap<usize, Vec<Option<Vec<f32>>>>,
}

impl StageSums {
    /// Adds micro-batch `leaf`'s gradient `g` of unit `u` (rounded to the storage type, as
    /// every leaf is) to its block's tree.
    fn add(&mut self, plan: &Plan, blocks: &[(usize, u32)], leaf: usize, u: usize, mut g: Vec<f32>) -> Result<(), String> {
        let &(first, level) =
            blocks.iter().find(|&&(f, l)| f <= leaf && leaf < f + (1 << l)).ok_or_else(|| format!("micro-batch {leaf} is in no block"))?;
        plan.precision.round(&mut g);
        if leaf == first {
            self.trees[u] = Some(tree(plan.precision.dtype()));
        }
        let t = self.trees[u].as_mut().ok_or_else(|| format!("unit {u}: micro-batch {leaf} before its block began"))?;
        t.push_block(leaf - first, 0, g).map_err(|e| e.to_string())?;
        if leaf + 1 == (first + (1 << level)).min(plan.micro_batches) {
            let sum = self.trees[u].take().and_then(TreeSum::finish).ok_or("an empty block")?;
            let n = self.trees.len();
            self.done.entry(first).or_insert_with(|| vec![None; n])[u] = Some(sum);
        }
        Ok(())
    }

    /// The sums of block `first` over flat `range` (inside this stage's units).
    fn values(&self, plan: &Plan, first: usize, range: Range<usize>) -> Result<Vec<f32>, String> {
        let block = self.done.get(&first).ok_or_else(|| format!("the block at micro-batch {first} has no sums"))?;
        let mut out = Vec::with_capacity(range.len());
        for (u, unit) in plan.model.units().iter().enumerate() {
            let (lo, hi) = (range.start.max(unit.start), range.end.min(unit.end));
            if lo >= hi {
                continue;
            }
            let sum = block[u].as_ref().ok_or_else(|| format!("unit {u} has no sum for the block at micro-batch {first}"))?;
            out.extend_from_slice(&sum[lo - unit.start..hi - unit.start]);
        }
        Ok(out)
    }
}

/// One step of this rank's stage: what its instructions read.
struct StageStep<'a> {
    plan: &'a Plan,
    pp: &'a PipePlan,
    step: u64,
    /// The stage and replica.
    p: usize,
    d: usize,
    leaves: Vec<usize>,
    blocks: Vec<(usize, u32)>,
    params: Vec<Option<Vec<f32>>>,
    dloss: f32,
}

/// One step of this rank's stage: what its instructions leave.
#[derive(Default)]
struct StageState {
    flight: HashMap<(usize, usize), InFlight>,
    pool: Vec<Workspace>,
    sums: Option<StageSums>,
    loss: f64,
    moe: Option<MoeTally>,
    /// The most bytes the micro-batches in flight held at once.
    held_peak: usize,
}

impl StageStep<'_> {
    /// The rank and chunk of the span before (`after` false) or after chunk `c` of this stage.
    fn neighbour(&self, c: usize, after: bool) -> Option<(usize, usize)> {
        let (p, d) = (self.p, self.d);
        let n = if after { self.pp.after(p, c) } else { self.pp.before(p, c) };
        n.map(|(q, qc)| (self.pp.rank(q, d), qc))
    }

    /// Where the instruction's result goes: (rank, tag), if anywhere.
    fn destination(&self, op: Op) -> Option<(usize, u64)> {
        let (k, c) = (op.mb, op.chunk);
        match op.kind {
            Kind::Forward => self.neighbour(c, true).map(|(to, tc)| (to, tag(FORWARD, self.step, tc, k))),
            Kind::Backward | Kind::Input => match self.neighbour(c, false) {
                Some((to, tc)) => Some((to, tag(BACKWARD, self.step, tc, k))),
                None if self.pp.stages > 1 => Some((self.pp.last_rank(self.d), tag(EMBED, self.step, 0, k))),
                None => None,
            },
            Kind::Weight | Kind::EmbedBackward => None,
        }
    }

    /// Where the instruction's input comes from: (rank, tag), if anywhere.
    fn source(&self, op: Op) -> Option<(usize, u64)> {
        let (k, c) = (op.mb, op.chunk);
        match op.kind {
            Kind::Forward => self.neighbour(c, false).map(|(from, _)| (from, tag(FORWARD, self.step, c, k))),
            Kind::Backward | Kind::Input => self.neighbour(c, true).map(|(from, _)| (from, tag(BACKWARD, self.step, c, k))),
            Kind::EmbedBackward if self.pp.stages > 1 => Some((self.pp.rank(0, self.d), tag(EMBED, self.step, 0, k))),
            Kind::EmbedBackward | Kind::Weight => None,
        }
    }

    /// The chunk whose entry an instruction works on: the embeddings' backward finishes the
    /// head's chunk's unit 0.
    fn entry(&self, op: Op) -> (usize, usize) {
        match op.kind {
            Kind::EmbedBackward => (op.mb, self.pp.chunks - 1),
            _ => (op.mb, op.chunk),
        }
    }
}

impl ZeroWorker {
    /// The step's forward and backward as pipeline stage, and the gradients' way to their
    /// owners; what [`ZeroWorker::compute_and_reduce`] is for an unpipelined rank.
    pub(super) fn compute_pipelined(&mut self, step: u64, scale: f32, params: &ParamStore) -> Result<Computed, ComputeError> {
        let plan = Arc::clone(&self.plan);
        let pp = plan.pipeline.as_ref().expect("a pipelined plan");
        let (me, p, d) = (self.rank, pp.stage_of(self.rank), pp.replica_of(self.rank));
        let t_step = Instant::now();
        let at = StageStep {
            plan: &plan,
            pp,
            step,
            p,
            d,
            leaves: plan.leaves(pp.last_rank(d)),
            blocks: plan.blocks[pp.last_rank(d)].clone(),
            params: self.stage_params(pp, step, params)?,
            dloss: scale / plan.micro_batches as f32,
        };
        let n_units = plan.model.units().len();
        let ops = schedule::stream(pp.schedule, pp.stages, pp.chunks, p, at.leaves.len());
        let mut st = StageState {
            sums: Some(StageSums { trees: (0..n_units).map(|_| None).collect(), done: BTreeMap::new() }),
            ..StageState::default()
        };
        let mut phases = PhaseTimes::default();
        let mut timeline = Vec::with_capacity(ops.len());
        let fail = |e: String| ComputeError::failed(format!("rank {me} (stage {p}, replica {d}): {e}"));
        for op in ops {
            // What the instruction receives, before its compute starts.
            let input = at.source(op).map(|(from, tag)| self.recv(from, tag)).transpose()?;
            let start = Instant::now();
            let out = self.run_instruction(&at, op, input, &mut st).map_err(fail)?;
            let end = Instant::now();
            let secs = (end - start).as_secs_f64();
            match op.kind {
                Kind::Forward => phases.forward_s += secs,
                _ => phases.backward_inner_s += secs,
            }
            timeline.push(Timed { stage: p, op, start_s: (start - t_step).as_secs_f64(), end_s: (end - t_step).as_secs_f64() });
            if let (Some((to, tag)), Some(data)) = (at.destination(op), out) {
                self.lane.call("sending a pipeline stream", move |c| c.send(to, tag, &data).map_err(ComputeError::from))??;
            }
        }
        if !st.flight.is_empty() {
            return Err(fail(format!("{} micro-batch chunks were left unfinished by the schedule", st.flight.len())));
        }
        let reduce = Instant::now();
        let sums = st.sums.take().expect("the stage's sums");
        let grad = self.send_block_sums(&sums).map_err(|e| e.context(format!("rank {me} (stage {p}, replica {d})")))?;
        phases.backward_allreduce_s += reduce.elapsed().as_secs_f64();
        self.timeline = timeline;
        self.activation_bytes_peak = st.held_peak as u64;
        // No speed is reported (`busy_micro_batches` 0): a pipeline's replicas keep equal blocks,
        // so the elastic driver never re-weights them.
        Ok(Computed { loss: st.loss, grad, busy_s: 0.0, busy_micro_batches: 0, phases, moe: st.moe })
    }

    /// Runs one instruction on its micro-batch chunk, adds the gradients it finishes to the
    /// stage's trees, and returns what it sends (the forward's output stream, a backward's
    /// d(input)).
    fn run_instruction(
        &self,
        at: &StageStep<'_>,
        op: Op,
        input: Option<Vec<f32>>,
        st: &mut StageState,
    ) -> Result<Option<Vec<f32>>, String> {
        let plan = at.plan;
        let model = &plan.model;
        let (mb, t) = (plan.micro, plan.seq_len);
        let leaf = at.leaves[op.mb];
        let key = at.entry(op);
        let span = at.pp.span(at.p, key.1);
        if op.kind == Kind::Forward {
            let mut f = InFlight {
                ws: st.pool.pop().unwrap_or_default(),
                tokens: vec![0; mb * t],
                targets: vec![0; mb * t],
                grads: vec![None; model.units().len()],
                dx0: None,
                stash: None,
            };
            self.sampler.fill(plan.first_sample(at.step, leaf), mb, &mut f.tokens, &mut f.targets);
            st.flight.insert(key, f);
        }
        let f = st.flight.get_mut(&key).ok_or_else(|| format!("{op} of a micro-batch chunk not in flight"))?;
        let batch = MicroBatch {
            tokens: &f.tokens,
            targets: &f.targets,
            b: mb,
            t,
            noise_key: noise_key_of(self.sampler.seed(), at.step, leaf as u64),
        };
        let mut acc = PipeAccess {
            params: &at.params,
            units: model.units(),
            grads: &mut f.grads,
            backward: op.kind != Kind::Forward,
            ready: Vec::new(),
        };
        let mut out = None;
        match op.kind {
            Kind::Forward => {
                if let Some(l) = model.stage_forward(&mut acc, span, batch, input.as_deref(), &mut f.ws) {
                    st.loss += f64::from(l);
                }
                // Every chunk adds its blocks' routing; the head's chunk counts the micro-batch.
                let mut tally = tally_of(f.ws.moe_stats());
                if let Some(m) = tally.as_mut() {
                    m.micro_batches = u64::from(span.head);
                } else if span.head && model.cfg.moe.is_some() {
                    tally = Some(MoeTally { micro_batches: 1, ..MoeTally::default() });
                }
                if let Some(m) = tally {
                    st.moe.get_or_insert_with(MoeTally::default).add(&m);
                }
                out = Some(model.stage_output(&f.ws).to_vec());
            }
            Kind::Backward => out = Some(model.stage_backward(&mut acc, span, batch, input.as_deref(), at.dloss, &mut f.ws).to_vec()),
            Kind::Input => {
                let (dx, stash) = model.stage_backward_input(&mut acc, span, batch, input.as_deref(), at.dloss, &mut f.ws);
                out = Some(dx.to_vec());
                f.stash = Some(stash);
                // The weight half reads only its stash: the activations go back to the pool.
                st.pool.push(std::mem::take(&mut f.ws));
            }
            Kind::Weight => {
                let stash = f.stash.take().ok_or_else(|| format!("{op} before its input half"))?;
                let spent = model.stage_backward_weight(&mut acc, stash);
                // Its buffers serve the next input half run on a pooled workspace.
                if let Some(ws) = st.pool.last_mut() {
                    ws.recycle(spent);
                }
            }
            Kind::EmbedBackward => {
                let dx = input.or_else(|| f.dx0.take()).ok_or_else(|| format!("no d(embeddings) for micro-batch {}", op.mb))?;
                model.stage_embed_backward(&mut acc, &f.tokens, mb, t, &dx);
            }
        }
        if op.sends_grad() && at.destination(op).is_none() {
            // One stage: d(embeddings) stays for its own embeddings' backward.
            f.dx0 = out.take();
        }
        let sums = st.sums.as_mut().expect("the stage's sums");
        for u in std::mem::take(&mut acc.ready) {
            let g = f.grads[u].take().unwrap_or_else(|| vec![0.0; model.units()[u].len()]);
            sums.add(plan, &at.blocks, leaf, u, g)?;
        }
        st.held_peak = st.held_peak.max(st.flight.values().map(|f| f.ws.bytes() + f.stash.as_ref().map_or(0, WStash::bytes)).sum());
        // A micro-batch chunk leaves once its last instruction here ran.
        let done = match op.kind {
            Kind::Backward | Kind::Weight => !span.head,
            Kind::EmbedBackward => true,
            Kind::Forward | Kind::Input => false,
        };
        if done {
            if let Some(f) = st.flight.remove(&key) {
                st.pool.push(f.ws);
            }
        }
        Ok(out)
    }

    fn recv(&mut self, from: usize, tag: u64) -> Result<Vec<f32>, ComputeError> {
        self.lane.call("receiving a pipeline stream", move |c| c.recv(from, tag).map_err(ComputeError::from))?
    }

    /// The parameters of the units this rank's stage reads, by unit (`None` for the others):
    /// read from the rank's store, or at stage 3 sent by their owners.
    fn stage_params(&mut self, pp: &PipePlan, step: u64, store: &ParamStore) -> Result<Vec<Option<Vec<f32>>>, ComputeError> {
        let plan = Arc::clone(&self.plan);
        let units = plan.model.units();
        let mine = pp.param_units(pp.stage_of(self.rank));
        let mut out: Vec<Option<Vec<f32>>> = vec![None; units.len()];
        let gathered = |u: usize| plan.gathers() && !plan.persistent[u];
        let read = |range: Range<usize>| -> Result<Vec<f32>, ComputeError> {
            let mut buf = vec![0.0; range.len()];
            store.read(range.start, &mut buf).map_err(ComputeError::failed)?;
            Ok(buf)
        };
        // Stage 3: every owner sends its piece of each gathered unit to the ranks reading it
        // (all sends first: they do not wait), then each rank assembles its units.
        if plan.gathers() {
            for (u, unit) in units.iter().enumerate().filter(|(u, _)| gathered(*u)) {
                let piece = clamp_to(&plan.ranges[self.rank], unit);
                if piece.is_empty() {
                    continue;
                }
                let vals = read(piece.start + unit.start..piece.end + unit.start)?;
                for r in (0..plan.world).filter(|&r| r != self.rank && pp.param_units(pp.stage_of(r)).contains(&u)) {
                    let data = vals.clone();
                    self.lane.call("sending a stage its parameters", move |c| {
                        c.send(r, tag(PARAMS, step, 0, u), &data).map_err(ComputeError::from)
                    })??;
                }
            }
        }
        for u in mine {
            let unit = units[u].clone();
            if !gathered(u) {
                out[u] = Some(read(unit)?);
                continue;
            }
            let mut buf = vec![0.0; unit.len()];
            for o in 0..plan.world {
                let piece = clamp_to(&plan.ranges[o], &unit);
                if piece.is_empty() {
                    continue;
                }
                let vals = if o == self.rank {
                    read(piece.start + unit.start..piece.end + unit.start)?
                } else {
                    self.recv(o, tag(PARAMS, step, 0, u))?
                };
                if vals.len() != piece.len() {
                    return Err(ComputeError::failed(format!("rank {o} sent {} values of unit {u}, expected {}", vals.len(), piece.len())));
                }
                buf[piece].copy_from_slice(&vals);
            }
            out[u] = Some(buf);
        }
        Ok(out)
    }

    /// The stage's block sums to the partition owners: for every slot in which a replica's
    /// block ends, one world all-to-all per reduce bucket (from the end of the flat buffer, as
    /// the unpipelined ranks send), read by [`OwnerSums`] in the same order. Returns this
    /// rank's range combined by the tree.
    fn send_block_sums(&mut self, sums: &StageSums) -> Result<Vec<f32>, ComputeError> {
        let plan = Arc::clone(&self.plan);
        let mut owner = OwnerSums::new(&plan, self.rank);
        let buckets = plan.reduce_buckets();
        for s in (0..plan.slots()).filter(|&s| plan.slot_active(s)) {
            let sending: Vec<(usize, usize)> = (0..plan.world).filter_map(|q| plan.slot_send(q, s).map(|send| (q, send.block.0))).collect();
            for (k, bucket) in buckets.iter().enumerate().rev() {
                let mut sends = Vec::with_capacity(plan.world);
                for r in &plan.ranges {
                    let part = r.start.clamp(bucket.start, bucket.end)..r.end.clamp(bucket.start, bucket.end);
                    let mut out = Vec::new();
                    for &(q, first) in &sending {
                        for (piece, who) in plan.suppliers(q, part.clone()) {
                            if who == self.rank {
                                out.extend(sums.values(&plan, first, piece).map_err(ComputeError::failed)?);
                            }
                        }
                    }
                    sends.push(out);
                }
                let got = self.lane.call("a pipeline gradient exchange", move |c| {
                    let refs: Vec<&[f32]> = sends.iter().map(Vec::as_slice).collect();
                    c.all_to_all(&refs).map_err(ComputeError::from)
                })??;
                owner.receive(&plan, s, bucket, got, k == 0).map_err(ComputeError::failed)?;
            }
        }
        owner.finish(&plan).map_err(ComputeError::failed)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{plan_error, two_steps};

    /// Every schedule (GPipe, 1F1B, interleaved with 2 chunks a stage, ZB-H1), stage count,
    /// data-parallel size and ZeRO stage gives the one-worker bits, also with recomputation, an
    /// uneven cut and MoE blocks in the stages.
    #[test]
    fn pipelines_give_the_bits_of_one_worker() {
        let moe = ["tessera.moe.num_experts=4", "tessera.moe.k=2", "tessera.moe.expert_interval=1"];
        for extra in [&[][..], &moe[..]] {
            let (one, _) = two_steps(1, 0, extra);
            for (world, stages, schedule, stage, more) in [
                (2, 2, "gpipe", 0, None),
                (2, 2, "1f1b", 1, None),
                (4, 2, "1f1b", 2, None),
                (4, 2, "gpipe", 3, None),
                (4, 4, "1f1b", 3, Some("pipeline.activation_checkpoint_interval=1")),
                (4, 4, "gpipe", 1, Some("zero_optimization.reduce_bucket_size=70000")),
                (3, 3, "1f1b", 2, Some("pipeline.partition=type:gpt")),
                (2, 1, "1f1b", 2, None),
                (2, 2, "interleaved", 1, None),
                (4, 2, "interleaved", 3, Some("pipeline.activation_checkpoint_interval=1")),
                (2, 2, "zb-h1", 0, Some("pipeline.activation_checkpoint_interval=1")),
                (4, 2, "zb-h1", 2, None),
                (4, 4, "zb-h1", 3, Some("zero_optimization.reduce_bucket_size=70000")),
                (2, 1, "zb-h1", 1, None),
            ] {
                let mut sets: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
                sets.push(format!("pipeline.stages={stages}"));
                sets.push(format!("tessera.pipeline.schedule={schedule}"));
                sets.extend(more.map(str::to_string));
                let refs: Vec<&str> = sets.iter().map(String::as_str).collect();
                let (got, _) = two_steps(world, stage, &refs);
                assert!(
                    got == one,
                    "{extra:?}: {stages} stages × {} replicas, {schedule}, ZeRO {stage}, {more:?}: not the one-worker bits",
                    world / stages
                );
            }
        }
    }

    /// Offload inside a pipeline: the optimizer's states in host memory or on NVMe (the
    /// commit's), and at stage 3 the parameter shards on NVMe (what the owners send the stages
    /// at the step's start is read from the swap files) keep the one-worker bits.
    #[test]
    fn pipelines_with_offload_give_the_bits_of_one_worker() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = |k: &str| format!("zero_optimization.{k}.nvme_path={}", dir.path().display());
        let (one, _) = two_steps(1, 0, &[]);
        let (opt_path, param_path) = (path("offload_optimizer"), path("offload_param"));
        for (stage, sets) in [
            (2, vec!["zero_optimization.offload_optimizer.device=cpu".to_string()]),
            (1, vec!["zero_optimization.offload_optimizer.device=nvme".to_string(), opt_path.clone()]),
            (
                3,
                vec![
                    "zero_optimization.offload_param.device=nvme".to_string(),
                    param_path.clone(),
                    "zero_optimization.stage3_param_persistence_threshold=0".to_string(),
                    "aio.block_size=4096".to_string(),
                ],
            ),
        ] {
            let mut all = sets.clone();
            all.extend(["pipeline.stages=2".to_string(), "tessera.pipeline.schedule=1f1b".to_string()]);
            let refs: Vec<&str> = all.iter().map(String::as_str).collect();
            let (got, _) = two_steps(4, stage, &refs);
            assert!(got == one, "ZeRO {stage} with {sets:?} in 2 stages × 2 replicas: not the one-worker bits");
        }
    }

    /// The `profile` partition cuts by the costs it is given (the head's time moves blocks off
    /// the last stage) and keeps the one-worker bits; measured at the start of `train`, the
    /// costs are recorded in the resolved config for every rank.
    #[test]
    fn the_profile_partition_cuts_by_the_costs_and_keeps_the_bits() {
        let (one, _) = two_steps(1, 0, &[]);
        let sets = [
            "pipeline.stages=2",
            "pipeline.partition=profile",
            "tessera.pipeline.profile.blocks_ms=[1,1,1,1]",
            "tessera.pipeline.profile.head_ms=2",
        ];
        let plan = super::super::testing::plan(2, 1, &sets);
        assert_eq!(plan.pipeline.as_ref().expect("a pipeline").blocks_per_stage(), vec![vec![[0, 3]], vec![[3, 4]]]);
        let (got, _) = two_steps(2, 1, &sets);
        assert!(got == one, "the profile partition: not the one-worker bits");
        let (cfg, _) = super::super::testing::setup(2, 1, &["pipeline.stages=2", "pipeline.partition=profile"]);
        let resolved = crate::engine::pipeline::profile::resolve(&cfg).expect("measured").expect("a profile to measure");
        let costs = &resolved.resolved["tessera"]["pipeline"]["profile"];
        assert_eq!(costs["blocks_ms"].as_array().map(Vec::len), Some(4), "{costs}");
        let sets = ["pipeline.stages=2".to_string(), "tessera.pipeline.profile.blocks_ms=[1,1,1]".to_string()];
        let ctx = crate::config::ResolveContext::with_world(2);
        let e = crate::config::from_str_named(r#"{"train_batch_size": 4}"#, "t.json", &sets, &ctx).unwrap_err().to_string();
        assert!(e.contains("pipeline.partition") && e.contains("read only by the profile partition"), "{e}");
        let e = plan_error(2, 1, &["pipeline.stages=2", "pipeline.partition=profile", "tessera.pipeline.profile.blocks_ms=[1,1,1]"]);
        assert!(e.contains("has 3 costs, the model has 4 blocks"), "{e}");
    }

    /// What a pipeline cannot take is refused by key when planned.
    #[test]
    fn pipelines_refuse_what_they_cannot_run() {
        let e = plan_error(4, 1, &["pipeline.stages=4", "pipeline.partition=type:moe"]);
        assert!(e.contains("pipeline.stages = 4") && e.contains("would not get one"), "{e}");
        let e = plan_error(8, 1, &["pipeline.stages=8"]);
        assert!(e.contains("8 stages for a model of 4 blocks"), "{e}");
        let e = plan_error(4, 1, &["pipeline.stages=2", "tessera.moe.num_experts=4", "tessera.moe.ep_size=2"]);
        assert!(e.contains("tessera.moe.ep_size > 1"), "{e}");
    }
}
