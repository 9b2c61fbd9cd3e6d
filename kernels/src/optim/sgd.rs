//! SGD with momentum, dampening, L2 weight decay and Nesterov, as `torch.optim.SGD`.
//!
//! Per element (L2 decay `wd` only on tensors where decay applies):
//! ```text
//! g ← g + wd·p
//! b ← g                         on the first step (torch clones the gradient)
//! b ← μ·b + (1−dampening)·g     afterwards
//! g ← g + μ·b  (nesterov)   or   g ← b
//! p ← p − lr·g
//! ```
//! With momentum 0 there is no buffer and the update is `p ← p − lr·g`.

use super::adam::check_nonneg;
use super::OptimError;

/// SGD hyper-parameters; [`Default`] is torch's (lr 1e-3, everything else off).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdParams {
    pub lr: f32,
    pub momentum: f32,
    pub dampening: f32,
    pub weight_decay: f32,
    pub nesterov: bool,
}

impl Default for SgdParams {
    fn default() -> Self {
        Self { lr: 1e-3, momentum: 0.0, dampening: 0.0, weight_decay: 0.0, nesterov: false }
    }
}

impl SgdParams {
    /// Range checks as torch does them (Nesterov needs momentum > 0 and zero dampening).
    pub fn validate(&self) -> Result<(), OptimError> {
        const NAME: &str = "sgd";
        check_nonneg(NAME, "lr", self.lr)?;
        check_nonneg(NAME, "momentum", self.momentum)?;
        check_nonneg(NAME, "weight_decay", self.weight_decay)?;
        if !self.dampening.is_finite() {
            return Err(OptimError::InvalidParam {
                optimizer: NAME,
                name: "dampening",
                value: f64::from(self.dampening),
                expected: "a finite value",
            });
        }
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(OptimError::InvalidParam {
                optimizer: NAME,
                name: "nesterov",
                value: f64::from(self.momentum),
                expected: "nesterov requires momentum > 0 and dampening == 0",
            });
        }
        Ok(())
    }

    /// Whether this configuration keeps a momentum buffer.
    pub fn has_momentum(&self) -> bool {
        self.momentum != 0.0
    }
}

// No momentum: g ← g + wd·p;  p ← p − lr·g.
pub(crate) fn sgd_plain_kernel(lr: f32, wd: f32, p: &mut [f32], g: &[f32]) {
    for (p, &g) in p.iter_mut().zip(g) {
        let g = g + wd * *p;
        *p += -lr * g;
    }
}

/// Scalars of the momentum kernel.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SgdMomentum {
    pub lr: f32,
    pub wd: f32,
    pub momentum: f32,
    pub one_minus_dampening: f32,
    pub nesterov: bool,
    /// First step: the buffer is initialised to the (decayed) gradient.
    pub first: bool,
}

// g ← g + wd·p;  b ← first ? g : μ·b + (1−d)·g;  g ← nesterov ? g + μ·b : b;  p ← p − lr·g.
pub(crate) fn sgd_momentum_kernel(c: &SgdMomentum, p: &mut [f32], g: &[f32], buf: &mut [f32]) {
    for ((p, &g), b) in p.iter_mut().zip(g).zip(buf.iter_mut()) {
        let g = g + c.wd * *p;
        *b = if c.first { g } else { *b * c.momentum + c.one_minus_dampening * g };
        let d = if c.nesterov { g + c.momentum * *b } else { *b };
        *p += -c.lr * d;
    }
}
