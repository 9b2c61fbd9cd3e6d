//! Adam / AdamW over flat fp32 slices (DeepSpeed FusedAdam hyper-parameters, torch op order).
//!
//! Per element, in the order `torch.optim.AdamW` / `torch.optim.Adam` (single-tensor path) run:
//! 1. decoupled decay (AdamW, `adam_w_mode = true`): `p ← p·(1 − lr·wd)`;
//!    L2 penalty (Adam, `adam_w_mode = false`): `g ← g + wd·p`;
//! 2. `m ← lerp(m, g, 1 − β1)` (torch's lerp: `m + w·(g − m)` for `w < 0.5`, else
//!    `g − (g − m)·(1 − w)`);
//! 3. `v ← β2·v + ((1 − β2)·g)·g`;
//! 4. `p ← p − (lr / bc1) · (m / (√v / √bc2 + eps))` with `bc_i = 1 − β_i^step` (1 without bias
//!    correction).
//!
//! Scalar coefficients are computed in f64 (as Python does) and rounded to f32 once; elementwise
//! math is f32. DeepSpeed's FusedAdam in AdamW mode folds the decay into the update instead
//! (`p ← p − lr·(m̂/denom + wd·p)`); the two agree to first order in `lr·wd` and differ only in
//! rounding and an `O(lr²·wd)` term.

use super::cycle::{step_betas, MomentumCycle};
use super::OptimError;

/// Adam hyper-parameters; [`Default`] is DeepSpeed FusedAdam's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamParams {
    pub lr: f32,
    pub betas: (f32, f32),
    pub eps: f32,
    pub weight_decay: f32,
    /// `true`: decoupled weight decay (AdamW); `false`: L2 penalty added to the gradient (Adam).
    pub adam_w_mode: bool,
    pub bias_correction: bool,
    /// OneCycle's `cycle_momentum`: each step's betas come from the cycle instead of `betas`.
    pub momentum_cycle: Option<MomentumCycle>,
}

impl Default for AdamParams {
    fn default() -> Self {
        Self { lr: 1e-3, betas: (0.9, 0.999), eps: 1e-8, weight_decay: 0.0, adam_w_mode: true, bias_correction: true, momentum_cycle: None }
    }
}

impl AdamParams {
    /// Range checks as torch's constructor does them.
    pub fn validate(&self) -> Result<(), OptimError> {
        const NAME: &str = "adam";
        check_nonneg(NAME, "lr", self.lr)?;
        check_beta(NAME, "betas.0", self.betas.0)?;
        check_beta(NAME, "betas.1", self.betas.1)?;
        check_nonneg(NAME, "eps", self.eps)?;
        check_nonneg(NAME, "weight_decay", self.weight_decay)?;
        self.momentum_cycle.as_ref().map_or(Ok(()), |c| c.validate(NAME))
    }

    /// The betas of update number `applied + 1` (the cycle's, or the fixed pair).
    pub fn betas_at(&self, applied: u64) -> (f32, f32) {
        step_betas(self.betas, self.momentum_cycle.as_ref(), applied + 1)
    }

    /// The f32 scalars of one step at learning rate `lr` and 1-based step `step`; the bias
    /// corrections use this step's betas, as torch does when a scheduler changes them.
    pub(crate) fn coeffs(&self, lr: f32, step: u64) -> AdamCoeffs {
        let betas = step_betas(self.betas, self.momentum_cycle.as_ref(), step);
        let (b1, b2) = (f64::from(betas.0), f64::from(betas.1));
        let (bc1, bc2) = bias_corrections(b1, b2, step, self.bias_correction);
        let lr64 = f64::from(lr);
        let wd = f64::from(self.weight_decay);
        AdamCoeffs {
            lerp_w: (1.0 - b1) as f32,
            beta2: betas.1,
            one_minus_beta2: (1.0 - b2) as f32,
            step_size: (lr64 / bc1) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            eps: self.eps,
            decoupled_factor: (1.0 - lr64 * wd) as f32,
            l2: self.weight_decay,
            adam_w_mode: self.adam_w_mode,
            has_decay: self.weight_decay != 0.0,
        }
    }
}

/// `(1 − β1^step, 1 − β2^step)` or `(1, 1)` without bias correction.
pub(crate) fn bias_corrections(b1: f64, b2: f64, step: u64, enabled: bool) -> (f64, f64) {
    if !enabled {
        return (1.0, 1.0);
    }
    let t = step as f64;
    (1.0 - b1.powf(t), 1.0 - b2.powf(t))
}

pub(crate) fn check_nonneg(optimizer: &'static str, name: &'static str, v: f32) -> Result<(), OptimError> {
    if v.is_finite() && v >= 0.0 {
        return Ok(());
    }
    Err(OptimError::InvalidParam { optimizer, name, value: f64::from(v), expected: "a finite value >= 0" })
}

pub(crate) fn check_beta(optimizer: &'static str, name: &'static str, v: f32) -> Result<(), OptimError> {
    if (0.0..1.0).contains(&v) {
        return Ok(());
    }
    Err(OptimError::InvalidParam { optimizer, name, value: f64::from(v), expected: "a value in [0, 1)" })
}

/// Per-step f32 scalars of the Adam kernel.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AdamCoeffs {
    pub(crate) lerp_w: f32,
    pub(crate) beta2: f32,
    pub(crate) one_minus_beta2: f32,
    pub(crate) step_size: f32,
    pub(crate) bc2_sqrt: f32,
    pub(crate) eps: f32,
    pub(crate) decoupled_factor: f32,
    pub(crate) l2: f32,
    pub(crate) adam_w_mode: bool,
    pub(crate) has_decay: bool,
}

/// One Adam step over a run of elements of one tensor; `decay` says whether weight decay
/// applies to that tensor.
pub(crate) fn adam_kernel(c: &AdamCoeffs, decay: bool, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    let decay = decay && c.has_decay;
    match (decay, c.adam_w_mode) {
        (true, true) => adam_elems(c, c.decoupled_factor, 0.0, p, g, m, v),
        (true, false) => adam_elems(c, 1.0, c.l2, p, g, m, v),
        (false, _) => adam_elems(c, 1.0, 0.0, p, g, m, v),
    }
}

// p ← p·f;  g ← g + l2·p;  m ← lerp(m, g, 1−β1);  v ← β2·v + (1−β2)·g·g;
// p ← p − step_size · m / (√v/√bc2 + eps).   (f = 1 and l2 = 0 are exact no-ops)
#[inline(always)]
fn adam_elems(c: &AdamCoeffs, factor: f32, l2: f32, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    let (w, wc) = (c.lerp_w, 1.0 - c.lerp_w);
    let small_w = w < 0.5;
    for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        let pd = *p * factor;
        let g = if l2 != 0.0 { g + l2 * pd } else { g };
        *m = if small_w { *m + w * (g - *m) } else { g - (g - *m) * wc };
        *v = *v * c.beta2 + c.one_minus_beta2 * g * g;
        let denom = v.sqrt() / c.bc2_sqrt + c.eps;
        *p = pd - c.step_size * (*m / denom);
    }
}
