//! Learning-rate schedules with DeepSpeed's names, parameters, defaults and exact math
//! (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest). The typed parameters
//! are filled by `crate::config`; this module only evaluates them.
//!
//! Step convention: `step` is the number of optimizer updates already applied (0 before the
//! first update; DeepSpeed does not count updates skipped on fp16 overflow). `lr_at(s, lr,
//! step)` is the learning rate the next update (number `step + 1`) uses. That equals
//! DeepSpeed's scheduler state after construction and `step` calls of `scheduler.step()`,
//! i.e. `last_batch_iteration = step - 1` (−1 at the start).

use std::f64::consts::PI;

use tessera_kernels::optim::{CycleShape, MomentumCycle};

/// Warmup curve of the Warmup* schedules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WarmupType {
    /// `ln(it + 1) / ln(warmup_num_steps)` (DeepSpeed's default).
    Log,
    /// `it / warmup_num_steps`.
    Linear,
}

/// `WarmupLR`: warm up from `warmup_min_lr` to `warmup_max_lr`, then stay there.
#[derive(Debug, Clone, PartialEq)]
pub struct WarmupLr {
    pub warmup_min_lr: f32,
    /// `None` = the optimizer's lr (DeepSpeed's default).
    pub warmup_max_lr: Option<f32>,
    /// Values below 2 act as 2, as in DeepSpeed.
    pub warmup_num_steps: u64,
    pub warmup_type: WarmupType,
}

/// `WarmupDecayLR`: WarmupLR, then linear decay to 0 at `total_num_steps`.
#[derive(Debug, Clone, PartialEq)]
pub struct WarmupDecayLr {
    pub warmup_min_lr: f32,
    /// DeepSpeed's default is 0.001 (not the optimizer lr).
    pub warmup_max_lr: f32,
    pub warmup_num_steps: u64,
    pub warmup_type: WarmupType,
    pub total_num_steps: u64,
}

/// `WarmupCosineLR`: a ratio of the optimizer lr, warmed up from `warmup_min_ratio` to 1,
/// then cosine-decayed to `cos_min_ratio` at `total_num_steps`.
#[derive(Debug, Clone, PartialEq)]
pub struct WarmupCosineLr {
    pub total_num_steps: u64,
    pub warmup_min_ratio: f32,
    pub cos_min_ratio: f32,
    pub warmup_num_steps: u64,
    pub warmup_type: WarmupType,
}

/// `OneCycle`: one triangular lr (and inverse momentum) cycle, then optional decay.
#[derive(Debug, Clone, PartialEq)]
pub struct OneCycle {
    pub cycle_min_lr: f32,
    pub cycle_max_lr: f32,
    pub decay_lr_rate: f32,
    pub cycle_first_step_size: u64,
    /// DeepSpeed default: `cycle_first_step_size`.
    pub cycle_second_step_size: u64,
    /// 0 = continuous (no stairs).
    pub cycle_first_stair_count: u64,
    /// DeepSpeed default: `cycle_first_stair_count`.
    pub cycle_second_stair_count: u64,
    /// 0 = no post-cycle decay.
    pub decay_step_size: u64,
    pub cycle_momentum: bool,
    pub cycle_min_mom: f32,
    pub cycle_max_mom: f32,
    pub decay_mom_rate: f32,
}

/// `LRRangeTest`: lr grows linearly (or in stairs) from `lr_range_test_min_lr`.
#[derive(Debug, Clone, PartialEq)]
pub struct LrRangeTest {
    pub lr_range_test_min_lr: f32,
    pub lr_range_test_step_size: u64,
    pub lr_range_test_step_rate: f32,
    pub lr_range_test_staircase: bool,
}

/// A DeepSpeed `scheduler` section, typed.
#[derive(Debug, Clone, PartialEq)]
pub enum SchedulerConfig {
    WarmupLr(WarmupLr),
    WarmupDecayLr(WarmupDecayLr),
    WarmupCosineLr(WarmupCosineLr),
    OneCycle(OneCycle),
    LrRangeTest(LrRangeTest),
}

impl SchedulerConfig {
    /// DeepSpeed's name of the schedule.
    pub fn name(&self) -> &'static str {
        match self {
            SchedulerConfig::WarmupLr(_) => "WarmupLR",
            SchedulerConfig::WarmupDecayLr(_) => "WarmupDecayLR",
            SchedulerConfig::WarmupCosineLr(_) => "WarmupCosineLR",
            SchedulerConfig::OneCycle(_) => "OneCycle",
            SchedulerConfig::LrRangeTest(_) => "LRRangeTest",
        }
    }
}

pub use tessera_kernels::optim::ONE_CYCLE_BETA2;

/// Learning rate for the next optimizer update after `step` updates (see module docs).
/// `base_lr` is the optimizer's configured lr; no scheduler means use it unchanged.
pub fn lr_at(sched: &SchedulerConfig, base_lr: f32, step: u64) -> f32 {
    let it = last_batch_iteration(step);
    let lr = match sched {
        SchedulerConfig::WarmupLr(s) => {
            let max = f64::from(s.warmup_max_lr.unwrap_or(base_lr));
            warmup_lr(f64::from(s.warmup_min_lr), max, s.warmup_num_steps, s.warmup_type, it)
        }
        SchedulerConfig::WarmupDecayLr(s) => warmup_decay_lr(s, it),
        SchedulerConfig::WarmupCosineLr(s) => f64::from(base_lr) * cosine_ratio(s, it),
        SchedulerConfig::OneCycle(s) => one_cycle_lr(s, it),
        SchedulerConfig::LrRangeTest(s) => range_test_lr(s, it),
    };
    lr as f32
}

/// The momentum cycle the optimizer applies: OneCycle with `cycle_momentum`, else `None`. As in
/// DeepSpeed, the first update uses `cycle_min_mom` (set at construction), later ones the cycled
/// value, and beta2 is [`ONE_CYCLE_BETA2`]; SGD has no betas and is not cycled.
pub fn momentum_cycle(sched: Option<&SchedulerConfig>) -> Option<MomentumCycle> {
    match sched {
        Some(SchedulerConfig::OneCycle(s)) if s.cycle_momentum => Some(MomentumCycle {
            shape: s.shape(),
            decay_step_size: s.decay_step_size,
            min_mom: s.cycle_min_mom,
            max_mom: s.cycle_max_mom,
            decay_mom_rate: s.decay_mom_rate,
        }),
        _ => None,
    }
}

impl OneCycle {
    /// The triangle the lr and the momentum share.
    pub fn shape(&self) -> CycleShape {
        CycleShape {
            first_step_size: self.cycle_first_step_size,
            second_step_size: self.cycle_second_step_size,
            first_stair_count: self.cycle_first_stair_count,
            second_stair_count: self.cycle_second_stair_count,
        }
    }
}

/// DeepSpeed's `last_batch_iteration` after `step` scheduler steps.
fn last_batch_iteration(step: u64) -> i64 {
    i64::try_from(step).unwrap_or(i64::MAX) - 1
}

/// Warmup progress in [0, 1) while `it < warmup` (warmup already clamped to ≥ 2):
/// log: ln(it+1)/ln(W); linear: it/W.
fn warmup_gamma(it: i64, warmup: u64, ty: WarmupType) -> Option<f64> {
    let (itf, w) = (it as f64, warmup as f64);
    (it < warmup as i64).then(|| match ty {
        WarmupType::Log => (itf + 1.0).ln() / w.ln(),
        WarmupType::Linear => itf / w,
    })
}

/// lr = min + (max − min)·γ, γ = warmup progress, then 1; `it < 0` gives min.
fn warmup_lr(min: f64, max: f64, warmup: u64, ty: WarmupType, it: i64) -> f64 {
    if it < 0 {
        return min;
    }
    let gamma = warmup_gamma(it, warmup.max(2), ty).unwrap_or(1.0);
    min + (max - min) * gamma
}

/// After warmup: γ = max(0, (T − it) / max(1, T − W)).
fn warmup_decay_lr(s: &WarmupDecayLr, it: i64) -> f64 {
    let (min, max) = (f64::from(s.warmup_min_lr), f64::from(s.warmup_max_lr));
    if it < 0 {
        return min;
    }
    let w = s.warmup_num_steps.max(2);
    let gamma = warmup_gamma(it, w, s.warmup_type).unwrap_or_else(|| {
        let total = s.total_num_steps as f64;
        ((total - it as f64) / (total - w as f64).max(1.0)).max(0.0)
    });
    min + (max - min) * gamma
}

/// Ratio of the base lr: 0 before the first step; warmup wmin + γ(1 − wmin); then
/// max(0, cmin + (1 − cmin)(1 + cos(π·p))/2), p = min(1, (it − W + 1) / max(1, T − W)).
fn cosine_ratio(s: &WarmupCosineLr, it: i64) -> f64 {
    if it < 0 {
        return 0.0;
    }
    let w = s.warmup_num_steps.max(2);
    if let Some(gamma) = warmup_gamma(it, w, s.warmup_type) {
        let wmin = f64::from(s.warmup_min_ratio);
        return wmin + gamma * (1.0 - wmin);
    }
    let done = (it - w as i64 + 1) as f64;
    let span = (s.total_num_steps as f64 - w as f64).max(1.0);
    let progress = (done / span).min(1.0);
    let cmin = f64::from(s.cos_min_ratio);
    (cmin + (1.0 - cmin) * (1.0 + (PI * progress).cos()) / 2.0).max(0.0)
}

/// In the cycle: min + (max − min)·scale; after it: min / (1 + rate · d/decay_step_size).
fn one_cycle_lr(s: &OneCycle, it: i64) -> f64 {
    let (min, max) = (f64::from(s.cycle_min_lr), f64::from(s.cycle_max_lr));
    let shape = s.shape();
    if shape.in_cycle(it) {
        return min + (max - min) * shape.scale(it);
    }
    if s.decay_step_size == 0 || s.decay_lr_rate == 0.0 {
        return min;
    }
    let interval = shape.decay_iteration(it) / s.decay_step_size as f64;
    min / (1.0 + f64::from(s.decay_lr_rate) * interval)
}

/// lr = min · (1 + rate · k), k = (it + 1)/step_size (floored when staircase).
fn range_test_lr(s: &LrRangeTest, it: i64) -> f64 {
    let mut interval = (it + 1) as f64 / s.lr_range_test_step_size.max(1) as f64;
    if s.lr_range_test_staircase {
        interval = interval.floor();
    }
    f64::from(s.lr_range_test_min_lr) * (1.0 + f64::from(s.lr_range_test_step_rate) * interval)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Beta1 of the next update after `step` updates under `sched` (`None` without a cycle).
    fn momentum_at(sched: &SchedulerConfig, step: u64) -> Option<f32> {
        momentum_cycle(Some(sched)).map(|c| c.beta1_at(step))
    }

    fn close(got: f32, want: f64) {
        let tol = 1e-6 * want.abs().max(1e-3);
        assert!((f64::from(got) - want).abs() <= tol, "got {got}, want {want}");
    }

    fn warmup(max: Option<f32>, n: u64, ty: WarmupType) -> SchedulerConfig {
        SchedulerConfig::WarmupLr(WarmupLr { warmup_min_lr: 0.0, warmup_max_lr: max, warmup_num_steps: n, warmup_type: ty })
    }

    #[test]
    fn warmup_lr_log_and_linear() {
        let log = warmup(Some(0.1), 10, WarmupType::Log);
        close(lr_at(&log, 9.0, 0), 0.0); // before any step: min lr
        close(lr_at(&log, 9.0, 1), 0.0); // it = 0: ln(1)/ln(10) = 0
        close(lr_at(&log, 9.0, 2), 0.030_102_999_566_398_114); // 0.1·ln2/ln10
        close(lr_at(&log, 9.0, 10), 0.1); // it = 9: ln10/ln10
        close(lr_at(&log, 9.0, 11), 0.1);
        let linear = warmup(Some(0.1), 10, WarmupType::Linear);
        close(lr_at(&linear, 9.0, 2), 0.01); // it = 1: 1/10
        close(lr_at(&linear, 9.0, 6), 0.05);
        close(lr_at(&linear, 9.0, 500), 0.1);
        // warmup_max_lr defaults to the optimizer lr; warmup_num_steps < 2 acts as 2.
        close(lr_at(&warmup(None, 4, WarmupType::Linear), 0.5, 3), 0.25);
        close(lr_at(&warmup(None, 1, WarmupType::Linear), 0.5, 2), 0.25);
    }

    #[test]
    fn warmup_decay_lr_linear_decay_to_zero() {
        let s = SchedulerConfig::WarmupDecayLr(WarmupDecayLr {
            warmup_min_lr: 0.0,
            warmup_max_lr: 0.1,
            warmup_num_steps: 10,
            warmup_type: WarmupType::Linear,
            total_num_steps: 110,
        });
        close(lr_at(&s, 1.0, 6), 0.05); // warming up: it = 5
        close(lr_at(&s, 1.0, 11), 0.1); // it = 10: (110 − 10)/100
        close(lr_at(&s, 1.0, 61), 0.05); // it = 60: 50/100
        close(lr_at(&s, 1.0, 111), 0.0);
        close(lr_at(&s, 1.0, 200), 0.0); // clamped at 0
    }

    #[test]
    fn warmup_cosine_lr_ratios() {
        let cosine = |wmin: f32, ty| {
            SchedulerConfig::WarmupCosineLr(WarmupCosineLr {
                total_num_steps: 110,
                warmup_min_ratio: wmin,
                cos_min_ratio: 0.0001,
                warmup_num_steps: 10,
                warmup_type: ty,
            })
        };
        let s = cosine(0.0, WarmupType::Linear);
        close(lr_at(&s, 2.0, 0), 0.0); // DeepSpeed starts at lr 0
        close(lr_at(&s, 2.0, 6), 1.0); // 2 · 5/10
        close(lr_at(&s, 2.0, 11), 2.0 * 0.999_753_304_854_847_5); // p = 1/100
        close(lr_at(&s, 2.0, 60), 2.0 * 0.50005); // p = 1/2
        close(lr_at(&s, 2.0, 110), 2.0 * 0.0001); // p = 1
        close(lr_at(&s, 2.0, 1000), 2.0 * 0.0001);
        let s = cosine(0.1, WarmupType::Log);
        close(lr_at(&s, 1.0, 2), 0.370_926_996_097_583_06); // 0.1 + 0.9·ln2/ln10
    }

    fn one_cycle(stairs: u64, decay_step: u64) -> OneCycle {
        OneCycle {
            cycle_min_lr: 0.01,
            cycle_max_lr: 0.1,
            decay_lr_rate: 0.5,
            cycle_first_step_size: 10,
            cycle_second_step_size: 10,
            cycle_first_stair_count: stairs,
            cycle_second_stair_count: stairs,
            decay_step_size: decay_step,
            cycle_momentum: true,
            cycle_min_mom: 0.8,
            cycle_max_mom: 0.9,
            decay_mom_rate: 0.1,
        }
    }

    #[test]
    fn one_cycle_lr_and_momentum() {
        let s = SchedulerConfig::OneCycle(one_cycle(0, 0));
        close(lr_at(&s, 5.0, 0), 0.01);
        close(lr_at(&s, 5.0, 5), 0.055); // x = 0.25, scale 0.5
        close(lr_at(&s, 5.0, 10), 0.1); // peak
        close(lr_at(&s, 5.0, 15), 0.055); // falling half
        close(lr_at(&s, 5.0, 20), 0.01);
        close(lr_at(&s, 5.0, 40), 0.01); // decay_step_size 0: stays at min
        assert_eq!(momentum_at(&s, 0), Some(0.8)); // set at construction
        close(momentum_at(&s, 1).unwrap_or(f32::NAN), 0.89); // scale 0.1
        close(momentum_at(&s, 5).unwrap_or(f32::NAN), 0.85);
        close(momentum_at(&s, 10).unwrap_or(f32::NAN), 0.8);
        close(momentum_at(&s, 40).unwrap_or(f32::NAN), 0.9);
    }

    #[test]
    fn one_cycle_decay_and_stairs() {
        let s = SchedulerConfig::OneCycle(one_cycle(0, 5));
        // it = 30: decay iteration 11, interval 2.2 → 0.01 / (1 + 0.5·2.2)
        close(lr_at(&s, 1.0, 31), 0.004_761_904_761_904_761_5);
        close(momentum_at(&s, 31).unwrap_or(f32::NAN), 1.098); // 0.9·(1 + 0.1·2.2)
        let s = SchedulerConfig::OneCycle(one_cycle(2, 0));
        close(lr_at(&s, 1.0, 3), 0.01); // ⌊0.6⌋/2 = 0
        close(lr_at(&s, 1.0, 5), 0.055); // ⌊1.0⌋/2
        close(lr_at(&s, 1.0, 10), 0.1);
        close(lr_at(&s, 1.0, 12), 0.055); // (20 − 12)·2/10 = 1.6 → 1/2
        let mut no_mom = one_cycle(0, 0);
        no_mom.cycle_momentum = false;
        assert_eq!(momentum_at(&SchedulerConfig::OneCycle(no_mom), 3), None);
    }

    #[test]
    fn lr_range_test_continuous_and_staircase() {
        let range = |staircase| {
            SchedulerConfig::LrRangeTest(LrRangeTest {
                lr_range_test_min_lr: 0.001,
                lr_range_test_step_size: 10,
                lr_range_test_step_rate: 1.0,
                lr_range_test_staircase: staircase,
            })
        };
        close(lr_at(&range(false), 1.0, 0), 0.001);
        close(lr_at(&range(false), 1.0, 5), 0.0015);
        close(lr_at(&range(false), 1.0, 20), 0.003);
        close(lr_at(&range(true), 1.0, 5), 0.001);
        close(lr_at(&range(true), 1.0, 15), 0.002);
        assert_eq!(momentum_at(&range(true), 5), None);
    }
}
