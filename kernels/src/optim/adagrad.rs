//! Adagrad (Duchi et al. 2011) as `torch.optim.Adagrad` (single-tensor path), which DeepSpeed
//! builds for `optimizer.type = "Adagrad"` without optimizer offload.
//!
//! Per element (L2 decay `wd` only on tensors where decay applies), at 1-based step `t`:
//! ```text
//! clr ← lr / (1 + (t − 1)·lr_decay)          (a scalar: f64, rounded to f32 once)
//! g   ← g + wd·p
//! s   ← s + g·g                              (s starts at initial_accumulator_value)
//! p   ← p + ((−clr)·g) / (√s + eps)          (torch's CPU addcdiv: value·t1 / t2)
//! ```
//! DeepSpeed's CPU Adagrad (with `offload_optimizer`) divides the *undecayed* gradient by the
//! decayed accumulator and has neither `lr_decay` nor `initial_accumulator_value`; Tessera follows
//! torch's formula everywhere (the two agree without weight decay).

use super::adam::check_nonneg;
use super::OptimError;

/// Adagrad hyper-parameters; [`Default`] is torch's (lr 1e-2, eps 1e-10, everything else 0).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdagradParams {
    pub lr: f32,
    /// The learning rate of step `t` is `lr / (1 + (t − 1)·lr_decay)`.
    pub lr_decay: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// Every element's accumulated squared gradient starts here.
    pub initial_accumulator_value: f32,
}

impl Default for AdagradParams {
    fn default() -> Self {
        Self { lr: 1e-2, lr_decay: 0.0, eps: 1e-10, weight_decay: 0.0, initial_accumulator_value: 0.0 }
    }
}

impl AdagradParams {
    /// Range checks as torch's constructor does them (every value finite and ≥ 0).
    pub fn validate(&self) -> Result<(), OptimError> {
        const NAME: &str = "adagrad";
        check_nonneg(NAME, "lr", self.lr)?;
        check_nonneg(NAME, "lr_decay", self.lr_decay)?;
        check_nonneg(NAME, "eps", self.eps)?;
        check_nonneg(NAME, "weight_decay", self.weight_decay)?;
        check_nonneg(NAME, "initial_accumulator_value", self.initial_accumulator_value)
    }

    /// The f32 scalars of 1-based step `step` at learning rate `lr` (the scheduled rate, which
    /// `lr_decay` then decays, as torch applies it to the param group's current lr).
    pub fn coeffs(&self, lr: f32, step: u64) -> AdagradCoeffs {
        let clr = f64::from(lr) / (1.0 + (step.saturating_sub(1)) as f64 * f64::from(self.lr_decay));
        AdagradCoeffs { neg_clr: (-clr) as f32, eps: self.eps, wd: self.weight_decay }
    }
}

/// Per-step f32 scalars of the Adagrad kernel (`wd` applies where the decay flag is set).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdagradCoeffs {
    /// −lr / (1 + (t − 1)·lr_decay).
    pub neg_clr: f32,
    pub eps: f32,
    pub wd: f32,
}

// g ← g + wd·p;  s ← s + g·g;  p ← p + ((−clr)·g) / (√s + eps).
pub(crate) fn adagrad_kernel(c: &AdagradCoeffs, decay: bool, p: &mut [f32], g: &[f32], s: &mut [f32]) {
    let wd = if decay { c.wd } else { 0.0 };
    for ((p, &g), s) in p.iter_mut().zip(g).zip(s.iter_mut()) {
        let g = g + wd * *p;
        *s += g * g;
        let std = s.sqrt() + c.eps;
        *p += (c.neg_clr * g) / std;
    }
}
