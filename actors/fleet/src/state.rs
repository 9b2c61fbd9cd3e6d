//! The training state as the fleet moves it: full-length flat buffers (fp32 masters and named
//! optimizer buffers, world-size independent, as checkpointed), cut per rank by the run's plan.
//! The plan itself is the front crate's; the fleet sees it through [`FleetPlan`] and makes new
//! ones (a new world at a recovery, new micro-batch blocks) through [`Planner`].

use std::ops::Range;

/// What the fleet needs of a run's plan: how the flat state is cut across its ranks and how the
/// global batch's micro-batches are spread over them.
pub trait FleetPlan: Send + Sync + 'static {
    /// Ranks of the plan.
    fn world(&self) -> usize;
    /// Length of the flat parameter buffer (elements).
    fn total(&self) -> usize;
    /// The range of the flat buffer whose optimizer state rank `r` owns.
    fn optim_range(&self, r: usize) -> Range<usize>;
    /// Whether the state is sharded across the ranks (ZeRO stage ≥ 1); else every rank holds it
    /// whole.
    fn sharded(&self) -> bool;
    /// Micro-batches of one global batch.
    fn micro_batches(&self) -> usize;
    /// Micro-batches per rank, in rank order.
    fn counts(&self) -> Vec<usize>;
}

/// Makes the plans a fleet switches to.
pub trait Planner<P> {
    /// The ordinary plan for `world` ranks (a new epoch after a recovery).
    fn plan(&self, world: usize) -> anyhow::Result<P>;
    /// The plan for `world` ranks with these micro-batch blocks per rank (`(first, level)`,
    /// contiguous, rank order), sized by the measured speeds.
    fn with_blocks(&self, world: usize, blocks: Vec<Vec<(usize, u32)>>) -> anyhow::Result<P>;
}

/// Optimizer state buffers by name, full length (world-size independent, as checkpointed).
pub type OptimBuffers = Vec<(String, Vec<f32>)>;

/// Where training starts: fresh or from a checkpoint, as full-length buffers.
pub struct Start {
    pub step: u64,
    pub master: Vec<f32>,
    pub optim: Option<(u64, OptimBuffers)>,
    pub applied: u64,
    pub skipped: u64,
    pub scaler: Option<serde_json::Value>,
}

/// Counters kept alike by every rank (read from rank 0).
pub struct RankCounters {
    pub optimizer_steps: u64,
    pub applied: u64,
    pub skipped: u64,
    pub scaler: Option<serde_json::Value>,
}

/// One rank's share of the start state besides the masters: its cut of the optimizer buffers.
pub struct StartCut {
    pub optim: Option<(u64, OptimBuffers)>,
    pub applied: u64,
    pub skipped: u64,
    pub scaler: Option<serde_json::Value>,
}

impl Start {
    /// Rank `r`'s cut: the optimizer buffers over `plan.optim_range(r)`.
    pub fn cut(&self, plan: &dyn FleetPlan, r: usize) -> StartCut {
        let range = plan.optim_range(r);
        let optim = self.optim.as_ref().map(|(steps, bufs)| {
            (*steps, bufs.iter().map(|(n, b)| (n.clone(), b.get(range.clone()).map(<[f32]>::to_vec).unwrap_or_default())).collect())
        });
        StartCut { optim, applied: self.applied, skipped: self.skipped, scaler: self.scaler.clone() }
    }
}

/// The part of the flat buffer whose masters a rank is sent to start: today the whole buffer,
/// because what a rank's state reads beyond its own ranges depends on the ZeRO-3 unit policy
/// (persistent units are held whole by every rank). A start-up cost only: N × 4Ψ bytes over
/// loopback.
pub fn master_window(plan: &dyn FleetPlan, _r: usize) -> Range<usize> {
    0..plan.total()
}
