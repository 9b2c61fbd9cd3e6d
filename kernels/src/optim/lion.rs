//! Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") as in DeepSpeed
//! FusedLion / CPU Lion.
//!
//! Per element (decoupled decay `wd` only on tensors where decay applies):
//! ```text
//! c ← β1·m + (1−β1)·g
//! p ← p·(1 − lr·wd) − lr·sign(c)
//! m ← β2·m + (1−β2)·g
//! ```
//! `sign(0) = 0` as in the paper (DeepSpeed's CUDA kernel moves `p` by `+lr` when `c` is exactly
//! 0, which only happens for all-zero gradient history; its CPU kernel uses `copysign`).

use super::adam::{check_beta, check_nonneg};
use super::cycle::{step_betas, MomentumCycle};
use super::OptimError;

/// Lion hyper-parameters; [`Default`] follows the paper (lr 1e-4, betas (0.9, 0.99), no decay).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LionParams {
    pub lr: f32,
    pub betas: (f32, f32),
    pub weight_decay: f32,
    /// OneCycle's `cycle_momentum`: each step's betas come from the cycle instead of `betas`
    /// (DeepSpeed cycles any optimizer with `betas`, Lion's included).
    pub momentum_cycle: Option<MomentumCycle>,
}

impl Default for LionParams {
    fn default() -> Self {
        Self { lr: 1e-4, betas: (0.9, 0.99), weight_decay: 0.0, momentum_cycle: None }
    }
}

impl LionParams {
    /// Range checks (betas in [0, 1), non-negative lr and decay).
    pub fn validate(&self) -> Result<(), OptimError> {
        const NAME: &str = "lion";
        check_nonneg(NAME, "lr", self.lr)?;
        check_beta(NAME, "betas.0", self.betas.0)?;
        check_beta(NAME, "betas.1", self.betas.1)?;
        check_nonneg(NAME, "weight_decay", self.weight_decay)?;
        self.momentum_cycle.as_ref().map_or(Ok(()), |c| c.validate(NAME))
    }

    /// The betas of update number `applied + 1` (the cycle's, or the fixed pair).
    pub fn betas_at(&self, applied: u64) -> (f32, f32) {
        step_betas(self.betas, self.momentum_cycle.as_ref(), applied + 1)
    }

    /// The f32 scalars of 1-based step `step` at learning rate `lr`.
    pub(crate) fn coeffs(&self, lr: f32, step: u64) -> LionCoeffs {
        let betas = step_betas(self.betas, self.momentum_cycle.as_ref(), step);
        let (b1, b2) = (f64::from(betas.0), f64::from(betas.1));
        LionCoeffs {
            lr,
            beta1: betas.0,
            one_minus_beta1: (1.0 - b1) as f32,
            beta2: betas.1,
            one_minus_beta2: (1.0 - b2) as f32,
            after_decay: (1.0 - f64::from(lr) * f64::from(self.weight_decay)) as f32,
        }
    }
}

/// Per-step f32 scalars of the Lion kernel.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LionCoeffs {
    pub(crate) lr: f32,
    pub(crate) beta1: f32,
    pub(crate) one_minus_beta1: f32,
    pub(crate) beta2: f32,
    pub(crate) one_minus_beta2: f32,
    pub(crate) after_decay: f32,
}

// c ← β1·m + (1−β1)·g;  p ← p·(1−lr·wd) − lr·sign(c);  m ← β2·m + (1−β2)·g.
pub(crate) fn lion_kernel(c: &LionCoeffs, decay: bool, p: &mut [f32], g: &[f32], m: &mut [f32]) {
    let factor = if decay { c.after_decay } else { 1.0 };
    for ((p, &g), m) in p.iter_mut().zip(g).zip(m.iter_mut()) {
        let interp = c.beta1 * *m + c.one_minus_beta1 * g;
        let step = if interp > 0.0 {
            c.lr
        } else if interp < 0.0 {
            -c.lr
        } else {
            0.0
        };
        *p = *p * factor - step;
        *m = c.beta2 * *m + c.one_minus_beta2 * g;
    }
}
