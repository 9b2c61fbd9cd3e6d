//! One update of an elementwise optimizer (Adam/AdamW, Lion, SGD, Adagrad: each element's new
//! value depends on that element only) over any run of elements inside one tensor: the kernel
//! [`super::OptimizerShard::step`] runs piece by piece, and what a host step outside the shard
//! (the GPU ranks' optimizer offload) runs over its own buffers, so both give the same bits.

use super::adagrad::{adagrad_kernel, AdagradCoeffs};
use super::adam::{adam_kernel, AdamCoeffs};
use super::lion::{lion_kernel, LionCoeffs};
use super::sgd::{sgd_momentum_kernel, sgd_plain_kernel, SgdMomentum, SgdParams};
use super::OptimizerKind;

/// The f32 scalars of one update, by optimizer.
#[derive(Debug, Clone, Copy)]
enum Coeffs {
    Adam(AdamCoeffs),
    Lion(LionCoeffs),
    Sgd { params: SgdParams, lr: f32, first: bool },
    Adagrad(AdagradCoeffs),
}

/// One update (its learning rate and 1-based number fixed) of an elementwise optimizer.
#[derive(Debug, Clone, Copy)]
pub struct ElementwiseStep(Coeffs);

impl ElementwiseStep {
    /// Update `step` (1-based) of `kind` at learning rate `lr` (this step's betas under
    /// OneCycle's momentum cycle); `None` for LAMB, which is not elementwise.
    pub fn new(kind: &OptimizerKind, lr: f32, step: u64) -> Option<ElementwiseStep> {
        let c = match kind {
            OptimizerKind::Adam(p) => Coeffs::Adam(p.coeffs(lr, step)),
            OptimizerKind::Lion(p) => Coeffs::Lion(p.coeffs(lr, step)),
            OptimizerKind::Sgd(p) => Coeffs::Sgd { params: *p, lr, first: step == 1 },
            OptimizerKind::Adagrad(p) => Coeffs::Adagrad(p.coeffs(lr, step)),
            OptimizerKind::Lamb(_) => return None,
        };
        Some(ElementwiseStep(c))
    }

    /// Steps one run of elements of one tensor: masters `p` with gradients `g` (already
    /// unscaled and clipped) and the state buffers `m`, `v` in `OptimizerKind::state_names`
    /// order (an empty slice for a buffer the optimizer does not keep). `decay`: whether weight
    /// decay applies to the tensor.
    ///
    /// # Panics
    /// If a kept state buffer is shorter than `p`.
    pub fn run(&self, decay: bool, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
        let n = p.len();
        let g = &g[..n];
        match &self.0 {
            Coeffs::Adam(c) => adam_kernel(c, decay, p, g, &mut m[..n], &mut v[..n]),
            Coeffs::Lion(c) => lion_kernel(c, decay, p, g, &mut m[..n]),
            Coeffs::Adagrad(c) => adagrad_kernel(c, decay, p, g, &mut m[..n]),
            Coeffs::Sgd { params, lr, first } => {
                let wd = if decay { params.weight_decay } else { 0.0 };
                if !params.has_momentum() {
                    return sgd_plain_kernel(*lr, wd, p, g);
                }
                let c = SgdMomentum {
                    lr: *lr,
                    wd,
                    momentum: params.momentum,
                    one_minus_dampening: (1.0 - f64::from(params.dampening)) as f32,
                    nesterov: params.nesterov,
                    first: *first,
                };
                sgd_momentum_kernel(&c, p, g, &mut m[..n]);
            }
        }
    }
}
