//! DeepSpeed OneCycle's momentum cycle: the betas of Adam, AdamW, LAMB and Lion as a pure
//! function of the number of updates already applied, so every shard, replica and resumed run
//! that knows its step count steps with the same betas.
//!
//! OneCycle moves the learning rate up and then down one triangular cycle and the first beta
//! the opposite way, between `max_mom` (at the cycle's ends) and `min_mom` (at its peak), then
//! optionally scales it by `1 + decay_mom_rate · d / decay_step_size`, `d` decay iterations
//! after the cycle. As DeepSpeed's `OneCycle` does (`deepspeed/runtime/lr_schedules.py`):
//! - it writes the whole pair, `betas = (momentum, 0.99)`, so the configured betas are replaced,
//!   the second one by [`ONE_CYCLE_BETA2`];
//! - the first update runs at `min_mom` (written when the scheduler is built), update `k + 1`
//!   (`k ≥ 1` updates applied) at the cycle's value for DeepSpeed's `last_batch_iteration =
//!   k − 1`.
//!
//! The optimizers read the betas afresh each step as torch's do, bias correction included:
//! `1 − β1^t` with the *current* β1 and the step number `t`, not a product of past betas.

use super::adam::check_beta;
use super::OptimError;

/// The second beta DeepSpeed's OneCycle writes beside the cycled first one.
pub const ONE_CYCLE_BETA2: f32 = 0.99;

/// The shape of OneCycle's triangle, shared by its learning rate and its momentum
/// (DeepSpeed's `_get_scale_factor`): a rise over `first_step_size` iterations and a fall over
/// `second_step_size`, optionally in stairs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CycleShape {
    /// Must be positive (the config layer refuses 0, as DeepSpeed does).
    pub first_step_size: u64,
    pub second_step_size: u64,
    /// 0 = continuous.
    pub first_stair_count: u64,
    pub second_stair_count: u64,
}

impl CycleShape {
    /// Iterations of the whole cycle.
    pub fn total(&self) -> f64 {
        (self.first_step_size + self.second_step_size) as f64
    }

    /// Whether DeepSpeed's `last_batch_iteration` `it` is still inside the cycle.
    pub fn in_cycle(&self, it: i64) -> bool {
        (it as f64) < self.total()
    }

    /// Iterations into the post-cycle decay phase: `it − total + 1`.
    pub fn decay_iteration(&self, it: i64) -> f64 {
        it as f64 - self.total() + 1.0
    }

    /// Cycle position in [0, 1] at `last_batch_iteration` `it`: with b = it + 1,
    /// x = 1 + b/total − ⌊1 + b/total⌋; rising x/r while x ≤ r (r = first/total), falling
    /// (x − 1)/(r − 1) after; with stairs, the position is quantised to ⌊pos⌋/stairs from the
    /// integer offset into the cycle.
    pub fn scale(&self, it: i64) -> f64 {
        let (first, second) = (self.first_step_size as f64, self.second_step_size as f64);
        let total = first + second;
        let ratio = first / total;
        let b = (it + 1) as f64;
        let x = 1.0 + b / total - (1.0 + b / total).floor();
        let (scale, stairs) =
            if x <= ratio { (x / ratio, self.first_stair_count) } else { ((x - 1.0) / (ratio - 1.0), self.second_stair_count) };
        if stairs == 0 {
            return scale;
        }
        let stairs = stairs as f64;
        let in_cycle = b % total;
        let position = if in_cycle <= first { in_cycle * stairs / first } else { (total - in_cycle) * stairs / second };
        position.floor() / stairs
    }
}

/// OneCycle's momentum (`cycle_momentum: true`): the first beta cycles inversely to the
/// learning rate, the second is [`ONE_CYCLE_BETA2`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MomentumCycle {
    pub shape: CycleShape,
    /// 0 = no post-cycle decay.
    pub decay_step_size: u64,
    pub min_mom: f32,
    pub max_mom: f32,
    pub decay_mom_rate: f32,
}

impl MomentumCycle {
    /// The first beta of update number `applied + 1`: `min_mom` before any update, then
    /// `max − (max − min)·scale` inside the cycle and `max·(1 + rate·d/decay_step_size)` after
    /// it (`max` when there is no decay). Computed in f64 as DeepSpeed does, rounded once.
    pub fn beta1_at(&self, applied: u64) -> f32 {
        if applied == 0 {
            return self.min_mom;
        }
        let it = i64::try_from(applied).unwrap_or(i64::MAX) - 1;
        let (min, max) = (f64::from(self.min_mom), f64::from(self.max_mom));
        let mom = if self.shape.in_cycle(it) {
            max - (max - min) * self.shape.scale(it)
        } else if self.decay_step_size == 0 || self.decay_mom_rate == 0.0 {
            max
        } else {
            let interval = self.shape.decay_iteration(it) / self.decay_step_size as f64;
            max * (1.0 + f64::from(self.decay_mom_rate) * interval)
        };
        mom as f32
    }

    /// `(β1, β2)` of update number `applied + 1`.
    pub fn betas_at(&self, applied: u64) -> (f32, f32) {
        (self.beta1_at(applied), ONE_CYCLE_BETA2)
    }

    /// Both momentum bounds in [0, 1) (later values are checked step by step: a decay can
    /// leave the range).
    pub fn validate(&self, optimizer: &'static str) -> Result<(), OptimError> {
        check_beta(optimizer, "cycle_min_mom", self.min_mom)?;
        check_beta(optimizer, "cycle_max_mom", self.max_mom)
    }
}

/// The betas of 1-based step `step`: the cycle's when there is one, else the fixed pair.
pub(crate) fn step_betas(fixed: (f32, f32), cycle: Option<&MomentumCycle>, step: u64) -> (f32, f32) {
    cycle.map_or(fixed, |c| c.betas_at(step.saturating_sub(1)))
}

/// Refuses a step whose cycled betas left [0, 1) (a post-cycle `decay_mom_rate` moves β1 by a
/// factor that grows without bound): torch would divide by `1 − β1^t`, which is 0 at β1 = 1.
pub(crate) fn check_step_betas(optimizer: &'static str, betas: (f32, f32)) -> Result<(), OptimError> {
    if (0.0..1.0).contains(&betas.0) {
        return Ok(());
    }
    Err(OptimError::InvalidParam {
        optimizer,
        name: "betas.0",
        value: f64::from(betas.0),
        expected: "a value in [0, 1) (OneCycle's cycled momentum left it: check decay_mom_rate)",
    })
}
