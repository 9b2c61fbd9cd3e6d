//! LAMB per DeepSpeed's FusedLamb (eps outside the square root), with per-tensor trust ratios.
//!
//! Per element of tensor `t` (decay `wd_t` = `weight_decay` if decay applies to `t`, else 0):
//! ```text
//! m ← β1·m + (1−β1)·g
//! v ← β2·v + (1−β2)·g·g
//! u ← m / (√v + eps) + wd_t·p                       (no bias correction inside u)
//! ```
//! then per tensor `ratio_t = ‖p_t‖ / ‖u_t‖` (norms of the weights *before* the update),
//! clamped to `[min_coeff, max_coeff]` (first to max, then to min), or 1 when either norm is 0,
//! and finally `p ← p − step_size·ratio_t·u` with `step_size = lr·√bc2 / bc1` (`lr` without
//! bias correction). Norms come from [`super::norm`], so they are identical for any sharding.

use super::adam::{bias_corrections, check_beta, check_nonneg};
use super::cycle::{step_betas, MomentumCycle};
use super::OptimError;

/// LAMB hyper-parameters; [`Default`] is DeepSpeed FusedLamb's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LambParams {
    pub lr: f32,
    pub betas: (f32, f32),
    pub eps: f32,
    pub weight_decay: f32,
    pub bias_correction: bool,
    pub max_coeff: f32,
    pub min_coeff: f32,
    /// OneCycle's `cycle_momentum`: each step's betas come from the cycle instead of `betas`.
    pub momentum_cycle: Option<MomentumCycle>,
}

impl Default for LambParams {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            bias_correction: true,
            max_coeff: 10.0,
            min_coeff: 0.01,
            momentum_cycle: None,
        }
    }
}

impl LambParams {
    /// Range checks (betas in [0, 1), non-negative lr/eps/decay, 0 <= min_coeff <= max_coeff).
    pub fn validate(&self) -> Result<(), OptimError> {
        const NAME: &str = "lamb";
        check_nonneg(NAME, "lr", self.lr)?;
        check_beta(NAME, "betas.0", self.betas.0)?;
        check_beta(NAME, "betas.1", self.betas.1)?;
        check_nonneg(NAME, "eps", self.eps)?;
        check_nonneg(NAME, "weight_decay", self.weight_decay)?;
        check_nonneg(NAME, "min_coeff", self.min_coeff)?;
        check_nonneg(NAME, "max_coeff", self.max_coeff)?;
        if self.max_coeff < self.min_coeff {
            return Err(OptimError::InvalidParam {
                optimizer: NAME,
                name: "max_coeff",
                value: f64::from(self.max_coeff),
                expected: "max_coeff >= min_coeff",
            });
        }
        self.momentum_cycle.as_ref().map_or(Ok(()), |c| c.validate(NAME))
    }

    /// The betas of update number `applied + 1` (the cycle's, or the fixed pair).
    pub fn betas_at(&self, applied: u64) -> (f32, f32) {
        step_betas(self.betas, self.momentum_cycle.as_ref(), applied + 1)
    }

    /// The f32 scalars of one step at learning rate `lr` and 1-based step `step` (this step's
    /// betas, bias corrections included).
    pub fn coeffs(&self, lr: f32, step: u64) -> LambCoeffs {
        let betas = step_betas(self.betas, self.momentum_cycle.as_ref(), step);
        let (b1, b2) = (f64::from(betas.0), f64::from(betas.1));
        let (bc1, bc2) = bias_corrections(b1, b2, step, self.bias_correction);
        LambCoeffs {
            beta1: betas.0,
            one_minus_beta1: (1.0 - b1) as f32,
            beta2: betas.1,
            one_minus_beta2: (1.0 - b2) as f32,
            eps: self.eps,
            weight_decay: self.weight_decay,
            step_size: (f64::from(lr) * bc2.sqrt() / bc1) as f32,
        }
    }

    /// Trust ratio of one tensor from its weight and update norms (DeepSpeed's clamp order).
    pub fn trust_ratio(&self, w_norm: f64, u_norm: f64) -> f32 {
        if w_norm == 0.0 || u_norm == 0.0 {
            return 1.0;
        }
        let mut r = (w_norm / u_norm) as f32;
        if r > self.max_coeff {
            r = self.max_coeff;
        }
        if r < self.min_coeff {
            r = self.min_coeff;
        }
        r
    }
}

/// Per-step f32 scalars of the LAMB kernels.
#[derive(Debug, Clone, Copy)]
pub struct LambCoeffs {
    pub(crate) beta1: f32,
    pub(crate) one_minus_beta1: f32,
    pub(crate) beta2: f32,
    pub(crate) one_minus_beta2: f32,
    pub(crate) eps: f32,
    pub(crate) weight_decay: f32,
    pub(crate) step_size: f32,
}

/// The new moments of one element: m ← β1·m + (1−β1)·g;  v ← β2·v + (1−β2)·g·g. Both passes
/// of a step compute them with this one function, so they agree bit for bit.
#[inline(always)]
fn lamb_moments(c: &LambCoeffs, g: f32, m: f32, v: f32) -> (f32, f32) {
    (c.beta1 * m + c.one_minus_beta1 * g, c.beta2 * v + c.one_minus_beta2 * g * g)
}

// Phase 1, writing only the scratch `u`: u ← m'/(√v' + eps) + wd·p, with m', v' the new
// moments; the state itself is untouched until the norms are known (a failed norm all-reduce
// leaves the shard as it was).
pub fn lamb_update_kernel(c: &LambCoeffs, decay: bool, p: &[f32], g: &[f32], m: &[f32], v: &[f32], u: &mut [f32]) {
    let wd = if decay { c.weight_decay } else { 0.0 };
    let elems = p.iter().zip(g).zip(m).zip(v).zip(u.iter_mut());
    for ((((&p, &g), &m), &v), u) in elems {
        let (m, v) = lamb_moments(c, g, m, v);
        *u = m / (v.sqrt() + c.eps) + wd * p;
    }
}

// Phase 2, once the norms are in: the moments are stored (recomputed, the same bits as phase 1's)
// and p ← p − (step_size·ratio)·u (DeepSpeed multiplies step_size·ratio·u left to right).
pub fn lamb_commit_kernel(c: &LambCoeffs, ratio: f32, g: &[f32], m: &mut [f32], v: &mut [f32], p: &mut [f32], u: &[f32]) {
    let elems = g.iter().zip(m.iter_mut()).zip(v.iter_mut()).zip(p.iter_mut()).zip(u);
    for ((((&g, m), v), p), &u) in elems {
        (*m, *v) = lamb_moments(c, g, *m, *v);
        *p -= c.step_size * ratio * u;
    }
}
