//! Loss scaling for fp16 training: a static scale, or DeepSpeed's `DynamicLossScaler` (halve on
//! overflow once hysteresis is used up, double after `scale_window` clean iterations).
//!
//! `update(overflow)` follows `deepspeed/runtime/fp16/loss_scaler.py` step by step:
//! ```text
//! overflow:
//!   if delayed_shift == 1 or cur_hysteresis == 1:
//!     if cur_scale == min_scale and raise_error_at_min_scale: error
//!     cur_scale = max(cur_scale / scale_factor, min_scale)
//!   else: cur_hysteresis -= 1
//!   last_overflow_iter = cur_iter
//! no overflow:
//!   if consecutive_hysteresis: cur_hysteresis = delayed_shift
//!   stable = cur_iter - last_overflow_iter - 1
//!   if stable > 0 and stable % scale_window == 0:
//!     if not consecutive_hysteresis: cur_hysteresis = delayed_shift
//!     cur_scale *= scale_factor
//! cur_iter += 1
//! ```
//! One deviation: the scale is an f32, so growth stops at the largest finite power of two
//! instead of reaching infinity.

use super::OptimError;

/// What the trainer does with this iteration's gradients.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StepOutcome {
    /// Gradients were finite: the optimizer step runs.
    Applied,
    /// Gradients overflowed: skip the optimizer step; `new_scale` is the scale from now on.
    SkippedOverflow { new_scale: f32 },
}

/// Checkpointed loss-scaler state (DeepSpeed saves the same fields).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossScalerState {
    pub cur_scale: f32,
    pub cur_iter: u64,
    /// `-1` before the first overflow.
    pub last_overflow_iter: i64,
    pub cur_hysteresis: u32,
}

/// DeepSpeed's dynamic loss scaler (scale factor 2).
#[derive(Debug, Clone, PartialEq)]
pub struct DynamicLossScaler {
    cur_scale: f32,
    cur_iter: u64,
    last_overflow_iter: i64,
    scale_factor: f32,
    scale_window: u64,
    min_scale: f32,
    delayed_shift: u32,
    cur_hysteresis: u32,
    consecutive_hysteresis: bool,
    raise_error_at_min_scale: bool,
}

impl Default for DynamicLossScaler {
    /// DeepSpeed's fp16 defaults: 2^16, window 1000, min scale 1, hysteresis 2.
    fn default() -> Self {
        Self::build(16, 1000, 1.0, 2)
    }
}

impl DynamicLossScaler {
    /// `init_scale = 2^initial_scale_power`, `delayed_shift = hysteresis`; consecutive
    /// hysteresis off and raise-at-minimum on, as DeepSpeed's engine builds it.
    pub fn new(initial_scale_power: u32, scale_window: u64, min_scale: f32, hysteresis: u32) -> Result<Self, OptimError> {
        let invalid = |name, value: f64, expected| Err(OptimError::InvalidParam { optimizer: "dynamic_loss_scale", name, value, expected });
        if initial_scale_power > 127 {
            return invalid("initial_scale_power", f64::from(initial_scale_power), "<= 127");
        }
        if scale_window == 0 {
            return invalid("loss_scale_window", 0.0, "> 0");
        }
        if !(min_scale.is_finite() && min_scale > 0.0) {
            return invalid("min_loss_scale", f64::from(min_scale), "a finite value > 0");
        }
        if hysteresis == 0 {
            return invalid("hysteresis", 0.0, ">= 1");
        }
        Ok(Self::build(initial_scale_power, scale_window, min_scale, hysteresis))
    }

    fn build(power: u32, scale_window: u64, min_scale: f32, hysteresis: u32) -> Self {
        Self {
            cur_scale: 2f32.powi(power as i32),
            cur_iter: 0,
            last_overflow_iter: -1,
            scale_factor: 2.0,
            scale_window,
            min_scale,
            delayed_shift: hysteresis,
            cur_hysteresis: hysteresis,
            consecutive_hysteresis: false,
            raise_error_at_min_scale: true,
        }
    }

    /// Refill hysteresis on every clean iteration instead of only when the scale grows.
    pub fn with_consecutive_hysteresis(mut self, on: bool) -> Self {
        self.consecutive_hysteresis = on;
        self
    }

    /// Whether an overflow at `min_scale` is an error (DeepSpeed's default) or just a skip.
    pub fn with_raise_error_at_min_scale(mut self, on: bool) -> Self {
        self.raise_error_at_min_scale = on;
        self
    }

    /// The current loss scale.
    pub fn scale(&self) -> f32 {
        self.cur_scale
    }

    /// Advances one iteration; see the module docs for the exact order.
    pub fn update(&mut self, overflow: bool) -> Result<StepOutcome, OptimError> {
        if overflow {
            self.on_overflow()?;
            self.cur_iter += 1;
            return Ok(StepOutcome::SkippedOverflow { new_scale: self.cur_scale });
        }
        if self.consecutive_hysteresis {
            self.cur_hysteresis = self.delayed_shift;
        }
        let stable = self.cur_iter as i64 - self.last_overflow_iter - 1;
        if stable > 0 && stable as u64 % self.scale_window == 0 {
            if !self.consecutive_hysteresis {
                self.cur_hysteresis = self.delayed_shift;
            }
            let grown = self.cur_scale * self.scale_factor;
            if grown.is_finite() {
                self.cur_scale = grown;
            }
        }
        self.cur_iter += 1;
        Ok(StepOutcome::Applied)
    }

    fn on_overflow(&mut self) -> Result<(), OptimError> {
        if self.delayed_shift == 1 || self.cur_hysteresis == 1 {
            if self.cur_scale == self.min_scale && self.raise_error_at_min_scale {
                return Err(OptimError::LossScaleAtMinimum { scale: self.cur_scale, min_scale: self.min_scale });
            }
            self.cur_scale = (self.cur_scale / self.scale_factor).max(self.min_scale);
        } else {
            self.cur_hysteresis -= 1;
        }
        self.last_overflow_iter = self.cur_iter as i64;
        Ok(())
    }

    /// State for checkpoints.
    pub fn state(&self) -> LossScalerState {
        LossScalerState {
            cur_scale: self.cur_scale,
            cur_iter: self.cur_iter,
            last_overflow_iter: self.last_overflow_iter,
            cur_hysteresis: self.cur_hysteresis,
        }
    }

    /// Restores checkpointed state after checking it could come from a run of this scaler.
    pub fn load_state(&mut self, s: &LossScalerState) -> Result<(), OptimError> {
        let bad = |field, value: f64, expected| Err(OptimError::InvalidLossScalerState { field, value, expected });
        if !(s.cur_scale.is_finite() && s.cur_scale > 0.0) {
            return bad("cur_scale", f64::from(s.cur_scale), "finite and > 0");
        }
        if s.last_overflow_iter < -1 || s.last_overflow_iter >= s.cur_iter as i64 {
            return bad("last_overflow_iter", s.last_overflow_iter as f64, "in -1..cur_iter");
        }
        if s.cur_hysteresis == 0 || s.cur_hysteresis > self.delayed_shift {
            return bad("cur_hysteresis", f64::from(s.cur_hysteresis), "in 1..=hysteresis");
        }
        self.cur_scale = s.cur_scale;
        self.cur_iter = s.cur_iter;
        self.last_overflow_iter = s.last_overflow_iter;
        self.cur_hysteresis = s.cur_hysteresis;
        Ok(())
    }
}

/// A static or dynamic loss scaler (bf16/fp32 training uses `Static(1.0)`).
#[derive(Debug, Clone, PartialEq)]
pub enum LossScaler {
    Static(f32),
    Dynamic(DynamicLossScaler),
}

impl LossScaler {
    /// The current loss scale.
    pub fn scale(&self) -> f32 {
        match self {
            Self::Static(s) => *s,
            Self::Dynamic(d) => d.scale(),
        }
    }

    /// Whether the scale adapts to overflows.
    pub fn is_dynamic(&self) -> bool {
        matches!(self, Self::Dynamic(_))
    }

    /// Advances one iteration. A static scaler still reports overflows as skipped steps
    /// (DeepSpeed skips the step; the scale stays).
    pub fn update(&mut self, overflow: bool) -> Result<StepOutcome, OptimError> {
        match self {
            Self::Static(s) if overflow => Ok(StepOutcome::SkippedOverflow { new_scale: *s }),
            Self::Static(_) => Ok(StepOutcome::Applied),
            Self::Dynamic(d) => d.update(overflow),
        }
    }

    /// State for checkpoints (a static scaler reports its scale with neutral counters).
    pub fn state(&self) -> LossScalerState {
        match self {
            Self::Static(s) => LossScalerState { cur_scale: *s, cur_iter: 0, last_overflow_iter: -1, cur_hysteresis: 1 },
            Self::Dynamic(d) => d.state(),
        }
    }

    /// Restores checkpointed state (a static scaler takes only the scale).
    pub fn load_state(&mut self, s: &LossScalerState) -> Result<(), OptimError> {
        match self {
            Self::Static(_) if !(s.cur_scale.is_finite() && s.cur_scale > 0.0) => {
                Err(OptimError::InvalidLossScalerState { field: "cur_scale", value: f64::from(s.cur_scale), expected: "finite and > 0" })
            }
            Self::Static(scale) => {
                *scale = s.cur_scale;
                Ok(())
            }
            Self::Dynamic(d) => d.load_state(s),
        }
    }
}
