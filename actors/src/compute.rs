//! The compute interface a `DeviceWorker` drives: what the engine implements per rank.
//!
//! The actors decide *when* (prepare, commit, abandon); the compute decides *how* (kernels,
//! ZeRO buffers, collectives). Nothing here carries a tensor: results are small values.

use std::ops::Range;

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

/// The error a compute returns: a human-readable cause (the rank is added by the actors).
pub type ComputeError = String;

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
    fn commit(&mut self, step: u64) -> Result<(), ComputeError>;
    /// Drops the staged state of `step`; committed state is untouched.
    fn abandon(&mut self, step: u64);
    /// The bytes this rank holds now.
    fn memory(&self) -> MemoryReport;
}
