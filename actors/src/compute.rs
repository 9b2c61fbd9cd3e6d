//! The compute interface a `DeviceWorker` drives: what the engine implements per rank.
//!
//! The actors decide *when* (prepare, commit, abandon); the compute decides *how* (kernels,
//! ZeRO buffers, collectives). Nothing here carries a tensor: results are small values: one
//! rank's ([`Prepared`]) and a committed step's over all ranks ([`StepResult`]).

use std::ops::Range;

use tessera_transport::collective::CollectiveError;

/// The order to prepare one step, sent to every worker of plan epoch `epoch`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepOrder {
    /// The optimizer step being computed (the step the staged state becomes on commit).
    pub step: u64,
    /// Plan epoch: fixes membership and the assignment of micro-batches and shards.
    pub epoch: u64,
    /// 0 for the first attempt at `step`, incremented each time the step is abandoned and rerun.
    pub attempt: u32,
}

/// What one worker reports after preparing a step (small values only).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Prepared {
    /// Sum of the per-micro-batch losses over this worker's micro-batches.
    pub loss_sum: f64,
    /// Number of micro-batches this worker ran.
    pub micro_batches: usize,
    /// The global gradient norm before clipping, when the optimizer computed one (every rank
    /// computes the same global value).
    pub grad_norm: Option<f64>,
    /// fp16 overflow: the loss scaler skips this step's update.
    pub overflow: bool,
    /// Bytes this worker sent through collectives during the step.
    pub bytes_sent: u64,
    /// Bytes this worker received through collectives during the step.
    pub bytes_received: u64,
    /// Wall-clock seconds spent in `prepare`.
    pub compute_s: f64,
    /// Seconds this worker spent computing (forward/backward) `busy_micro_batches` of its
    /// micro-batches, without the time it waited on its peers: its measured speed is their
    /// ratio. Only micro-batch slots in which every worker computes are measured, so workers
    /// that share a machine's cores are measured under the same contention.
    pub busy_s: f64,
    pub busy_micro_batches: usize,
    /// Where the prepare's time went (DeepSpeed's `wall_clock_breakdown` timers).
    pub phases: PhaseTimes,
    /// The routing statistics of this worker's micro-batches, summed (models with
    /// mixture-of-experts blocks; `None` for dense ones).
    pub moe: Option<MoeTally>,
    /// A pipelined worker's instructions of the step, timed (empty otherwise).
    pub timeline: Vec<TimedOp>,
    /// A pipelined worker's most activation bytes held at once in the step (its micro-batches
    /// in flight; 0 otherwise).
    pub activation_bytes_peak: u64,
}

/// One pipeline instruction as a worker ran it ([`Prepared::timeline`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TimedOp {
    /// 0 forward, 1 backward, 2 embeddings backward, 3 a backward's input half, 4 its
    /// weight half.
    pub kind: u8,
    /// The stage's chunk (the interleaved schedule's virtual stage; 0 otherwise).
    pub chunk: u32,
    /// The micro-batch's index among its pipeline replica's.
    pub micro_batch: u32,
    /// Seconds from the start of the worker's prepare.
    pub start_s: f64,
    pub end_s: f64,
}

/// Mixture-of-experts routing statistics summed over micro-batches: one rank's in a step
/// ([`Prepared::moe`]), a step's over every rank ([`StepResult::moe`]), or a run's. The token
/// counts are exact whatever the order; the loss sums are added in micro-batch order on a
/// rank, then in rank order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MoeTally {
    /// Every MoE block, in stack order.
    pub blocks: Vec<MoeBlockTally>,
    /// Sums over the micro-batches of the load-balancing loss and the router z-loss (the
    /// objective's terms before their coefficients).
    pub aux_sum: f64,
    pub z_sum: f64,
    /// Micro-batches summed.
    pub micro_batches: u64,
}

/// One MoE block's share of a [`MoeTally`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MoeBlockTally {
    /// The block's index in the stack.
    pub block: usize,
    /// (token, choice) pairs each expert received.
    pub tokens_per_expert: Vec<u64>,
    /// (token, choice) pairs dropped for capacity.
    pub dropped: u64,
}

impl MoeTally {
    /// Adds `other`'s counts and sums to this tally (the first one sets the blocks).
    ///
    /// # Panics
    /// If both have blocks and they differ in number, index or expert count (the same model
    /// gives the same blocks).
    pub fn add(&mut self, other: &MoeTally) {
        // Blocks merge by index: a pipeline stage's tally has only its own blocks.
        for b in &other.blocks {
            match self.blocks.binary_search_by_key(&b.block, |a| a.block) {
                Ok(i) => {
                    let a = &mut self.blocks[i];
                    assert_eq!(a.tokens_per_expert.len(), b.tokens_per_expert.len(), "MoE tallies of different models");
                    a.tokens_per_expert.iter_mut().zip(&b.tokens_per_expert).for_each(|(x, y)| *x += y);
                    a.dropped += b.dropped;
                }
                Err(i) => self.blocks.insert(i, b.clone()),
            }
        }
        self.aux_sum += other.aux_sum;
        self.z_sum += other.z_sum;
        self.micro_batches += other.micro_batches;
    }

    /// The tallies of `parts` added in their order; `None` when none has one.
    pub fn sum<'a>(parts: impl IntoIterator<Item = Option<&'a MoeTally>>) -> Option<MoeTally> {
        parts.into_iter().flatten().fold(None, |acc, t| {
            let mut acc = acc.unwrap_or_default();
            acc.add(t);
            Some(acc)
        })
    }

    /// Mean load-balancing loss and z-loss per micro-batch.
    pub fn aux_mean(&self) -> f64 {
        self.aux_sum / self.micro_batches.max(1) as f64
    }

    pub fn z_mean(&self) -> f64 {
        self.z_sum / self.micro_batches.max(1) as f64
    }

    /// The share of (token, choice) pairs dropped for capacity, over every block.
    pub fn dropped_fraction(&self) -> f64 {
        let dropped: u64 = self.blocks.iter().map(|b| b.dropped).sum();
        dropped as f64 / (dropped + self.blocks.iter().map(MoeBlockTally::kept).sum::<u64>()).max(1) as f64
    }

    /// The most and least loaded experts over every block, as their share of the block's
    /// kept pairs times the number of experts (1 is a perfectly even load); `None` when no
    /// pair was kept.
    pub fn load_range(&self) -> Option<(f64, f64)> {
        let loads = self.blocks.iter().flat_map(|b| b.loads());
        loads.fold(None, |acc, l| Some(acc.map_or((l, l), |(hi, lo): (f64, f64)| (hi.max(l), lo.min(l)))))
    }
}

impl MoeBlockTally {
    /// (token, choice) pairs the block's experts received.
    pub fn kept(&self) -> u64 {
        self.tokens_per_expert.iter().sum()
    }

    /// The share of the block's pairs dropped for capacity.
    pub fn dropped_fraction(&self) -> f64 {
        self.dropped as f64 / (self.dropped + self.kept()).max(1) as f64
    }

    /// Each expert's share of the block's kept pairs (empty when none was kept).
    pub fn shares(&self) -> Vec<f64> {
        let kept = self.kept();
        if kept == 0 {
            return Vec::new();
        }
        self.tokens_per_expert.iter().map(|&n| n as f64 / kept as f64).collect()
    }

    /// Each expert's share times the number of experts (1 is an even load).
    pub fn loads(&self) -> Vec<f64> {
        let e = self.tokens_per_expert.len() as f64;
        self.shares().into_iter().map(|s| s * e).collect()
    }
}

/// Wall-clock seconds of one rank's prepare by phase, summed over its micro-batches, as
/// DeepSpeed's engine times them: the forward (to the loss; stage-3 parameter gathers it
/// waited for included), the backward's computation (`backward_inner`), and the waits on
/// gradient communication (`backward_allreduce`: the exchanges the backward waited for, the
/// ones still running when it ended, the norm all-reduce and, at stages 0-1, the gradient
/// all-gather; also the slots in which the rank only serves its peers).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PhaseTimes {
    pub forward_s: f64,
    pub backward_inner_s: f64,
    pub backward_allreduce_s: f64,
}

/// The outcome of one committed step, aggregated over ranks in rank order.
#[derive(Debug, Clone, PartialEq)]
pub struct StepResult {
    /// The committed step.
    pub step: u64,
    /// The plan epoch it ran under.
    pub epoch: u64,
    /// Sum of every rank's `loss_sum` (rank order).
    pub loss_sum: f64,
    /// Micro-batches run by all ranks together.
    pub micro_batches: usize,
    /// The global gradient norm (the first rank, in rank order, that reported one).
    pub grad_norm: Option<f64>,
    /// Whether any rank saw fp16 overflow.
    pub overflow: bool,
    /// Collective bytes sent, summed over ranks.
    pub bytes_sent: u64,
    /// Collective bytes received, summed over ranks.
    pub bytes_received: u64,
    /// The slowest rank's `prepare` time in seconds.
    pub compute_s_max: f64,
    /// Seconds from the commit's dispatch to the last rank's answer, as the ClusterSupervisor
    /// measured them (the optimizer step and the parameters' sharing; 0 when not measured).
    pub commit_s: f64,
    /// Attempts of this step that were prepared and then abandoned (e.g. `[0]` when the chaos
    /// hook abandoned the first attempt); the committed attempt is the next one.
    pub abandoned_attempts: Vec<u32>,
    /// Each rank's report of the committed attempt, by rank.
    pub per_rank: Vec<Prepared>,
    /// Every rank's MoE routing statistics added in rank order (`None` for dense models).
    pub moe: Option<MoeTally>,
}

impl StepResult {
    pub(crate) fn aggregate(
        step: u64,
        epoch: u64,
        abandoned_attempts: Vec<u32>,
        by_rank: impl IntoIterator<Item = (usize, Prepared)>,
    ) -> Self {
        let per_rank: Vec<Prepared> = by_rank.into_iter().map(|(_, p)| p).collect();
        StepResult {
            step,
            epoch,
            loss_sum: per_rank.iter().map(|p| p.loss_sum).sum(),
            micro_batches: per_rank.iter().map(|p| p.micro_batches).sum(),
            grad_norm: per_rank.iter().find_map(|p| p.grad_norm),
            overflow: per_rank.iter().any(|p| p.overflow),
            bytes_sent: per_rank.iter().map(|p| p.bytes_sent).sum(),
            bytes_received: per_rank.iter().map(|p| p.bytes_received).sum(),
            compute_s_max: per_rank.iter().map(|p| p.compute_s).fold(0.0, f64::max),
            commit_s: 0.0,
            abandoned_attempts,
            moe: MoeTally::sum(per_rank.iter().map(|p| p.moe.as_ref())),
            per_rank,
        }
    }

    /// Mean loss per micro-batch (`None` when no micro-batch ran).
    pub fn loss_mean(&self) -> Option<f64> {
        (self.micro_batches > 0).then(|| self.loss_sum / self.micro_batches as f64)
    }
}

/// The bytes one rank holds for parameters, gradients and optimizer state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryReport {
    /// The reporting rank.
    pub rank: usize,
    /// Parameter bytes held (a shard under ZeRO-3, the full model otherwise).
    pub param_bytes: u64,
    /// Gradient bytes held.
    pub grad_bytes: u64,
    /// fp32 master weights + optimizer moments held.
    pub optim_bytes: u64,
}

/// One rank's share of the flat buffer, as the planner assigned it: the metadata its
/// `ParamShard` and `OptimShard` actors own. `None` means "not partitioned" (e.g. parameters
/// are replicated below ZeRO-3): no shard actor of that kind is started.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShardInfo {
    /// The rank owning these shards (must equal its index in `Cluster::start`'s list).
    pub rank: usize,
    /// ZeRO-3 parameter shard: the global range of the flat buffer and bytes held.
    pub params: Option<ShardSpec>,
    /// ZeRO-1/2/3 optimizer shard: the global range and bytes of fp32 master + moments.
    pub optim: Option<ShardSpec>,
}

/// A global range of the flat parameter buffer and the bytes a rank holds for it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShardSpec {
    /// Range of the flat buffer (element indices).
    pub range: Range<usize>,
    /// Bytes held for this range.
    pub bytes: u64,
}

/// Why a compute call failed, in the terms recovery decides on: a member gone, the group
/// aborted, a failure of this rank alone, or a commit torn part-way with what its shard reached.
/// `Display` is the human cause alone (the actors add the rank); nothing decides on its text.
///
/// A collective's error keeps its kind ([`From<CollectiveError>`]): a peer that left is
/// [`ComputeError::Lost`] with its rank, a wait past the timeout is `Lost` with no rank (which
/// peer did not come is not known), an aborted group is [`ComputeError::Aborted`], ranks that
/// disagree or a bad argument are [`ComputeError::Failed`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ComputeError {
    /// A member of the group is gone or did not come: peer `rank` left the group (`None`: not
    /// known which, e.g. a collective that waited past its timeout), or, as an elastic driver
    /// sees it, this rank's own worker process was declared lost. A loss explains it.
    #[error("{why}")]
    Lost { rank: Option<usize>, why: String },
    /// The group was aborted (an elastic driver aborts the epoch's group when it declares a
    /// member lost or a rank failed, so that its peers stop waiting): whoever caused it reports
    /// the cause. A loss explains it.
    #[error("{why}")]
    Aborted { why: String },
    /// This rank failed on its own: I/O, the GPU, bad input, ranks that disagree, a protocol
    /// violation. No loss explains it and no new epoch mends it.
    #[error("{why}")]
    Failed { why: String },
    /// A commit failed after it began changing the shard. `stepped` is `Some(step)` when the
    /// shard took that step's optimizer update before the failure (it is a consistent state at
    /// `step + 1` committed steps, e.g. the parameters' all-gather failed later), `None` when
    /// it may be partly stepped (not a usable state). `cause` is why (never `Torn` itself).
    #[error("{cause}")]
    Torn { stepped: Option<u64>, cause: Box<ComputeError> },
}

impl ComputeError {
    /// A failure of this rank alone ([`ComputeError::Failed`]).
    pub fn failed(why: impl Into<String>) -> Self {
        ComputeError::Failed { why: why.into() }
    }

    /// The same error with `what: ` before its cause (the kind, rank and step stay).
    pub fn context(self, what: impl std::fmt::Display) -> Self {
        match self {
            ComputeError::Lost { rank, why } => ComputeError::Lost { rank, why: format!("{what}: {why}") },
            ComputeError::Aborted { why } => ComputeError::Aborted { why: format!("{what}: {why}") },
            ComputeError::Failed { why } => ComputeError::Failed { why: format!("{what}: {why}") },
            ComputeError::Torn { stepped, cause } => ComputeError::Torn { stepped, cause: Box::new(cause.context(what)) },
        }
    }

    /// This error as the failure of a commit that already changed the shard: `stepped` as in
    /// [`ComputeError::Torn`]. An error that is torn already stays as it is.
    pub fn torn(self, stepped: Option<u64>) -> Self {
        match self {
            torn @ ComputeError::Torn { .. } => torn,
            cause => ComputeError::Torn { stepped, cause: Box::new(cause) },
        }
    }

    /// Whether a membership change explains the failure (a member lost, the group aborted, or
    /// a commit torn by one of those), so that an elastic run re-plans once the loss is
    /// noticed; a [`ComputeError::Failed`] one ends it.
    pub fn explained_by_loss(&self) -> bool {
        match self {
            ComputeError::Lost { .. } | ComputeError::Aborted { .. } => true,
            ComputeError::Failed { .. } => false,
            ComputeError::Torn { cause, .. } => cause.explained_by_loss(),
        }
    }

    /// The committed steps a rank's state holds after its `commit(step)` failed with this
    /// error, when it held `before`: `step + 1` when the shard took the step
    /// (`Torn { stepped: Some(step) }`), nothing usable when it was torn part-way, and
    /// otherwise the state it had (the trait's promise: an error that is not `Torn` left the
    /// shard unchanged), which is usable only at `step`.
    pub fn state_after_commit(&self, step: u64, before: Option<u64>) -> Option<u64> {
        match self {
            ComputeError::Torn { stepped: Some(s), .. } if *s == step => Some(step + 1),
            ComputeError::Torn { .. } => None,
            _ => before.filter(|&b| b == step),
        }
    }
}

impl From<CollectiveError> for ComputeError {
    fn from(e: CollectiveError) -> Self {
        let why = e.to_string();
        match e {
            CollectiveError::PeerGone { peer, .. } => ComputeError::Lost { rank: Some(peer), why },
            CollectiveError::Timeout { .. } => ComputeError::Lost { rank: None, why },
            CollectiveError::Aborted { .. } => ComputeError::Aborted { why },
            CollectiveError::Mismatch { .. } | CollectiveError::InvalidArgument { .. } => ComputeError::Failed { why },
        }
    }
}

/// The per-rank compute a `DeviceWorker` owns and runs on its own OS thread.
///
/// Calls for one rank never overlap. For one step the sequence is `prepare`, then exactly one of
/// `commit` or `abandon` (after an abandon, `prepare` of the same step may follow again).
pub trait WorkerCompute: Send + 'static {
    /// This worker's share of the step up to commit: forward/backward of its micro-batch
    /// blocks, gradient reduction, optimizer into staged state. Blocking; runs on the worker's
    /// own OS thread; all workers' prepare calls run concurrently (they meet in collectives).
    fn prepare(&mut self, order: &StepOrder) -> Result<Prepared, ComputeError>;
    /// Makes the staged state of `step` current (may communicate, e.g. all-gather parameters).
    /// An error other than [`ComputeError::Torn`] leaves the committed state as it was; one
    /// that changed the shard before failing is `Torn`, saying whether it took the step.
    fn commit(&mut self, step: u64) -> Result<(), ComputeError>;
    /// Drops the staged state of `step`; committed state is untouched.
    fn abandon(&mut self, step: u64);
    /// The bytes this rank holds now.
    fn memory(&self) -> MemoryReport;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_collective_error_keeps_its_kind_and_its_words() {
        let cases = [
            (CollectiveError::PeerGone { op: "all_gather", peer: 2 }, ComputeError::Lost { rank: Some(2), why: String::new() }),
            (CollectiveError::Timeout { op: "all_gather", rank: 0, waited_ms: 50 }, ComputeError::Lost { rank: None, why: String::new() }),
            (CollectiveError::Aborted { op: "all_gather", reason: "epoch 4".into() }, ComputeError::Aborted { why: String::new() }),
            (CollectiveError::Mismatch { op: "all_gather", detail: "lengths".into() }, ComputeError::failed("")),
            (CollectiveError::InvalidArgument { op: "send", detail: "rank 9".into() }, ComputeError::failed("")),
        ];
        for (c, kind) in cases {
            let text = c.to_string();
            let e = ComputeError::from(c).context("unit 3");
            assert_eq!(e.to_string(), format!("unit 3: {text}"));
            assert_eq!(std::mem::discriminant(&e), std::mem::discriminant(&kind), "{e:?}");
            assert_eq!(e.explained_by_loss(), !matches!(kind, ComputeError::Failed { .. }), "{e:?}");
        }
    }

    #[test]
    fn a_failed_commit_leaves_the_state_its_error_says() {
        let lost = ComputeError::Lost { rank: Some(1), why: "gone".into() };
        assert_eq!(lost.state_after_commit(7, Some(7)), Some(7), "not torn: the shard is unchanged");
        assert_eq!(lost.state_after_commit(7, Some(6)), None, "unchanged, but not at the step committed");
        let stepped = lost.clone().torn(Some(7));
        assert_eq!(stepped.state_after_commit(7, Some(7)), Some(8));
        assert_eq!(stepped.to_string(), "gone");
        assert!(stepped.explained_by_loss());
        assert_eq!(stepped.clone().torn(None), stepped, "torn once: what it stepped stays");
        assert_eq!(lost.clone().torn(None).state_after_commit(7, Some(7)), None, "torn part-way: unusable");
        assert_eq!(lost.torn(Some(6)).state_after_commit(7, Some(7)), None, "stepped another step: unusable");
        assert!(!ComputeError::failed("disk").torn(Some(7)).explained_by_loss());
    }

    fn tally(counts: [&[u64]; 2], dropped: u64, aux: f64) -> MoeTally {
        let block = |(i, c): (usize, &[u64])| MoeBlockTally { block: 2 * i + 1, tokens_per_expert: c.to_vec(), dropped };
        MoeTally { blocks: counts.into_iter().enumerate().map(block).collect(), aux_sum: aux, z_sum: aux / 2.0, micro_batches: 1 }
    }

    #[test]
    fn a_steps_moe_tally_adds_the_ranks_in_rank_order() {
        let ranks = [tally([&[3, 1], &[2, 2]], 0, 0.5), tally([&[0, 4], &[4, 0]], 2, 0.25)];
        let per_rank: Vec<Prepared> = ranks.iter().map(|t| Prepared { moe: Some(t.clone()), ..Prepared::default() }).collect();
        let res = StepResult::aggregate(1, 0, Vec::new(), per_rank.into_iter().enumerate());
        let m = res.moe.expect("a tally");
        assert_eq!(
            m.blocks,
            vec![
                MoeBlockTally { block: 1, tokens_per_expert: vec![3, 5], dropped: 2 },
                MoeBlockTally { block: 3, tokens_per_expert: vec![6, 2], dropped: 2 },
            ]
        );
        assert_eq!((m.aux_sum, m.z_sum, m.micro_batches, m.aux_mean()), (0.75, 0.375, 2, 0.375));
        assert_eq!(m.dropped_fraction(), 4.0 / 20.0);
        assert_eq!(m.blocks[0].shares(), vec![3.0 / 8.0, 5.0 / 8.0]);
        // The busiest expert took 6 of its block's 8 pairs (1.5 times an even share), the
        // idlest 2 of 8.
        assert_eq!(m.load_range(), Some((1.5, 0.5)));
        let dense = StepResult::aggregate(1, 0, Vec::new(), [(0, Prepared::default())]);
        assert_eq!(dense.moe, None, "dense models have no tally");
    }
}
