//! The optimizer front: [`OptimizerKind`] picks the algorithm, [`OptimizerShard`] owns its fp32
//! state for one contiguous range of the flat parameter buffer and steps it in parallel.

use std::ops::Range;

use rayon::prelude::*;

use super::adagrad::AdagradParams;
use super::adam::AdamParams;
use super::cycle::{check_step_betas, MomentumCycle};
use super::elementwise::ElementwiseStep;
use super::lamb::{lamb_commit_kernel, lamb_update_kernel, LambParams};
use super::lion::LionParams;
use super::norm::{FlatLayout, NormAllReduce};
use super::pieces::{shard_pieces, split_mut, split_ref, Piece};
use super::sgd::SgdParams;
use super::OptimError;

/// Elements per parallel task. Elementwise results do not depend on it.
pub const PAR_CHUNK: usize = 1 << 15;

/// Which optimizer, with its hyper-parameters (`lr` there is the base rate; each step takes the
/// scheduled rate explicitly).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OptimizerKind {
    Adam(AdamParams),
    Lamb(LambParams),
    Lion(LionParams),
    Sgd(SgdParams),
    Adagrad(AdagradParams),
}

impl OptimizerKind {
    /// Short lowercase name ("adam", "lamb", "lion", "sgd", "adagrad").
    pub fn name(&self) -> &'static str {
        match self {
            Self::Adam(_) => "adam",
            Self::Lamb(_) => "lamb",
            Self::Lion(_) => "lion",
            Self::Sgd(_) => "sgd",
            Self::Adagrad(_) => "adagrad",
        }
    }

    /// Validates the hyper-parameters.
    pub fn validate(&self) -> Result<(), OptimError> {
        match self {
            Self::Adam(p) => p.validate(),
            Self::Lamb(p) => p.validate(),
            Self::Lion(p) => p.validate(),
            Self::Sgd(p) => p.validate(),
            Self::Adagrad(p) => p.validate(),
        }
    }

    /// OneCycle's momentum cycle when the params carry one (never for SGD and Adagrad, which
    /// have no betas).
    pub fn momentum_cycle(&self) -> Option<&MomentumCycle> {
        match self {
            Self::Adam(p) => p.momentum_cycle.as_ref(),
            Self::Lamb(p) => p.momentum_cycle.as_ref(),
            Self::Lion(p) => p.momentum_cycle.as_ref(),
            Self::Sgd(_) | Self::Adagrad(_) => None,
        }
    }

    /// The betas of update number `applied + 1`: OneCycle's cycled pair when the params carry
    /// a momentum cycle, else the configured pair; `None` for SGD and Adagrad, which have none.
    pub fn betas_at(&self, applied: u64) -> Option<(f32, f32)> {
        match self {
            Self::Adam(p) => Some(p.betas_at(applied)),
            Self::Lamb(p) => Some(p.betas_at(applied)),
            Self::Lion(p) => Some(p.betas_at(applied)),
            Self::Sgd(_) | Self::Adagrad(_) => None,
        }
    }

    /// The base learning rate of the params.
    pub fn lr(&self) -> f32 {
        match self {
            Self::Adam(p) => p.lr,
            Self::Lamb(p) => p.lr,
            Self::Lion(p) => p.lr,
            Self::Sgd(p) => p.lr,
            Self::Adagrad(p) => p.lr,
        }
    }

    /// The value every state buffer starts at: Adagrad's `initial_accumulator_value`, else 0.
    pub fn state_init(&self) -> f32 {
        match self {
            Self::Adagrad(p) => p.initial_accumulator_value,
            _ => 0.0,
        }
    }

    /// Names of the checkpointed state buffers, in the order [`OptimizerShard::state_buffers`]
    /// returns them.
    pub fn state_names(&self) -> &'static [&'static str] {
        match self {
            Self::Adam(_) | Self::Lamb(_) => &["exp_avg", "exp_avg_sq"],
            Self::Lion(_) => &["exp_avg"],
            Self::Sgd(p) if p.has_momentum() => &["momentum_buffer"],
            Self::Sgd(_) => &[],
            Self::Adagrad(_) => &["sum"],
        }
    }
}

/// Where a shard sits in the flat buffer and which tensors get weight decay.
#[derive(Debug, Clone)]
pub struct StepContext<'a> {
    /// Global range `[lo, hi)` of the flat buffer this shard owns.
    pub shard_range: Range<usize>,
    /// Tensor boundaries of the whole flat buffer.
    pub layout: &'a FlatLayout,
    /// Per segment of `layout`: whether weight decay applies to that tensor.
    pub decay: &'a [bool],
}

/// Algorithm-specific state; the params live next to the buffers they describe.
#[derive(Debug, Clone)]
enum Inner {
    /// Adam, Lion, SGD, Adagrad: the state buffers in `state_names` order (`m` first), each as
    /// long as the shard or empty where the optimizer keeps fewer.
    Elementwise { kind: OptimizerKind, m: Vec<f32>, v: Vec<f32> },
    Lamb {
        p: LambParams,
        m: Vec<f32>,
        v: Vec<f32>,
        /// Scratch for the update `u` between the two phases (not checkpointed).
        u: Vec<f32>,
        ratios: Vec<f32>,
    },
}

/// fp32 optimizer state (moments) for `len` elements of the flat buffer, plus the step count.
#[derive(Debug, Clone)]
pub struct OptimizerShard {
    inner: Inner,
    step: u64,
    len: usize,
}

impl OptimizerShard {
    /// Zero-initialised state for a shard of `len` elements at step 0.
    /// State at step 0 for a shard of `len` elements: every state buffer at
    /// [`OptimizerKind::state_init`] (zeros but for Adagrad's initial accumulator).
    pub fn new(kind: OptimizerKind, len: usize) -> Self {
        let states = kind.state_names().len();
        let buf = |k: usize| if states > k { vec![kind.state_init(); len] } else { Vec::new() };
        let inner = match kind {
            OptimizerKind::Lamb(p) => Inner::Lamb { p, m: buf(0), v: buf(1), u: Vec::new(), ratios: Vec::new() },
            kind => Inner::Elementwise { kind, m: buf(0), v: buf(1) },
        };
        Self { inner, step: 0, len }
    }

    /// The optimizer and its hyper-parameters.
    pub fn kind(&self) -> OptimizerKind {
        match &self.inner {
            Inner::Elementwise { kind, .. } => *kind,
            Inner::Lamb { p, .. } => OptimizerKind::Lamb(*p),
        }
    }

    /// Number of elements this shard owns.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the shard owns no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of completed steps (the `step` torch/DeepSpeed keep in optimizer state).
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// LAMB trust ratio of every segment from the last step (empty for other optimizers or
    /// before the first step); DeepSpeed's `get_lamb_coeffs`.
    pub fn last_trust_ratios(&self) -> &[f32] {
        match &self.inner {
            Inner::Lamb { ratios, .. } => ratios,
            _ => &[],
        }
    }

    /// One optimizer step on this shard: updates `master` (the shard's fp32 weights) from
    /// `grads` (already unscaled and clipped) at learning rate `lr`, which overrides the base
    /// rate in the params. The betas are the params' for this step ([`OptimizerKind::betas_at`]
    /// of the step count: a momentum cycle follows the shard's own count, so a restored or
    /// replicated shard steps with the same betas). LAMB is collective: every shard must call
    /// `step` together, since it all-reduces per-tensor norms through `reducer` (and needs a
    /// block-aligned shard range). An error leaves the masters, the state and the step count as
    /// they were.
    pub fn step(
        &mut self,
        master: &mut [f32],
        grads: &[f32],
        lr: f32,
        ctx: &StepContext<'_>,
        reducer: &mut dyn NormAllReduce,
    ) -> Result<(), OptimError> {
        self.check_step_inputs(master, grads, ctx)?;
        let kind = self.kind();
        if let Some(betas) = kind.betas_at(self.step) {
            check_step_betas(kind.name(), betas)?;
        }
        let pieces = shard_pieces(ctx.layout, ctx.decay, &ctx.shard_range, PAR_CHUNK);
        let step = self.step + 1;
        match &mut self.inner {
            Inner::Elementwise { kind, m, v } => {
                let c = ElementwiseStep::new(kind, lr, step).expect("LAMB is not an elementwise shard");
                let jobs = split_mut(master, &pieces).into_par_iter().zip(split_ref(grads, &pieces));
                let jobs = jobs.zip(split_state(m, &pieces)).zip(split_state(v, &pieces));
                jobs.zip(&pieces).for_each(|((((p, g), m), v), pc)| c.run(pc.decay, p, g, m, v));
            }
            Inner::Lamb { p, m, v, u, ratios } => {
                let bufs = LambBufs { m, v, u, ratios };
                lamb_step(p, bufs, step, lr, master, grads, ctx, &pieces, reducer)?;
            }
        }
        self.step = step;
        Ok(())
    }

    fn check_step_inputs(&self, master: &[f32], grads: &[f32], ctx: &StepContext<'_>) -> Result<(), OptimError> {
        let len_check = |what, found| {
            if found == self.len {
                Ok(())
            } else {
                Err(OptimError::LengthMismatch { what, expected: self.len, found })
            }
        };
        len_check("master", master.len())?;
        len_check("grads", grads.len())?;
        len_check("shard_range", ctx.shard_range.len())?;
        ctx.layout.check_range(&ctx.shard_range)?;
        if ctx.decay.len() != ctx.layout.segments().len() {
            return Err(OptimError::LengthMismatch {
                what: "decay flags (one per layout segment)",
                expected: ctx.layout.segments().len(),
                found: ctx.decay.len(),
            });
        }
        if matches!(self.inner, Inner::Lamb { .. }) {
            ctx.layout.check_aligned(&ctx.shard_range)?;
        }
        Ok(())
    }

    /// The checkpointed state buffers, named as torch names them ("exp_avg", "exp_avg_sq",
    /// "momentum_buffer"), in [`OptimizerKind::state_names`] order.
    pub fn state_buffers(&self) -> Vec<(&'static str, &[f32])> {
        let names = self.kind().state_names();
        let (Inner::Elementwise { m, v, .. } | Inner::Lamb { m, v, .. }) = &self.inner;
        names.iter().copied().zip([m.as_slice(), v.as_slice()]).collect()
    }

    /// Restores the step count and state buffers from a checkpoint. All-or-nothing: every
    /// expected buffer must be present exactly once with this shard's length, and no unknown
    /// buffer may appear; otherwise nothing changes and the error names the offending buffer.
    pub fn load_state(&mut self, step: u64, bufs: &[(&str, Vec<f32>)]) -> Result<(), OptimError> {
        let optimizer = self.kind().name();
        let expected = self.kind().state_names();
        let mut slot_of = vec![None; expected.len()];
        for (i, (name, data)) in bufs.iter().enumerate() {
            let pos = expected.iter().position(|e| e == name);
            let Some(k) = pos.filter(|&k| slot_of[k].is_none()) else {
                return Err(OptimError::UnexpectedStateBuffer { optimizer, name: (*name).to_string(), expected: expected.to_vec() });
            };
            if data.len() != self.len {
                return Err(OptimError::StateBufferLength { optimizer, name: (*name).to_string(), expected: self.len, found: data.len() });
            }
            slot_of[k] = Some(i);
        }
        if let Some(k) = slot_of.iter().position(Option::is_none) {
            return Err(OptimError::MissingStateBuffer { optimizer, name: expected[k] });
        }
        let sources = slot_of.iter().flatten().map(|&i| &bufs[i].1);
        for (dst, src) in self.state_buffers_mut().into_iter().zip(sources) {
            dst.copy_from_slice(src);
        }
        self.step = step;
        Ok(())
    }

    fn state_buffers_mut(&mut self) -> Vec<&mut Vec<f32>> {
        let states = self.kind().state_names().len();
        let (Inner::Elementwise { m, v, .. } | Inner::Lamb { m, v, .. }) = &mut self.inner;
        [m, v].into_iter().take(states).collect()
    }
}

/// Mutable LAMB state borrowed for one step.
struct LambBufs<'a> {
    m: &'a mut [f32],
    v: &'a mut [f32],
    u: &'a mut Vec<f32>,
    ratios: &'a mut Vec<f32>,
}

/// LAMB: the update per piece, per-tensor norms of weights and updates through the
/// deterministic slot partials (one all-reduce of both), then the moments and the
/// trust-ratio-scaled update. Transactional: nothing but the scratch `u` is written before the
/// all-reduce succeeds, so a failed one (a lost peer) leaves masters, moments, ratios and the
/// step count as they were, and the step can run again with the same bits.
// Allowed: called once, by the optimizer step, with what it holds (its buffers and context are
// already structs); grouping the rest would only rename them.
#[allow(clippy::too_many_arguments)]
fn lamb_step(
    params: &LambParams,
    b: LambBufs<'_>,
    step: u64,
    lr: f32,
    master: &mut [f32],
    grads: &[f32],
    ctx: &StepContext<'_>,
    pieces: &[Piece],
    reducer: &mut dyn NormAllReduce,
) -> Result<(), OptimError> {
    let c = params.coeffs(lr, step);
    b.u.resize(master.len(), 0.0);
    let jobs = split_ref(master, pieces).into_par_iter().zip(split_ref(grads, pieces));
    let jobs = jobs.zip(split_ref(b.m, pieces)).zip(split_ref(b.v, pieces));
    jobs.zip(split_mut(b.u, pieces)).zip(pieces).for_each(|(((((p, g), m), v), u), pc)| lamb_update_kernel(&c, pc.decay, p, g, m, v, u));

    let slots = ctx.layout.slots();
    let mut partials = vec![0.0f64; 2 * slots];
    let (w_part, u_part) = partials.split_at_mut(slots);
    ctx.layout.partial_sumsq(master, ctx.shard_range.clone(), w_part)?;
    ctx.layout.partial_sumsq(b.u, ctx.shard_range.clone(), u_part)?;
    reducer.all_reduce_sum(&mut partials).map_err(OptimError::NormReduce)?;
    let w_sq = ctx.layout.segment_sumsq(&partials[..slots]);
    let u_sq = ctx.layout.segment_sumsq(&partials[slots..]);
    *b.ratios = w_sq.iter().zip(&u_sq).map(|(w, u)| params.trust_ratio(w.sqrt(), u.sqrt())).collect();

    let ratios: &[f32] = b.ratios;
    let jobs = split_ref(grads, pieces).into_par_iter().zip(split_mut(b.m, pieces)).zip(split_mut(b.v, pieces));
    jobs.zip(split_mut(master, pieces)).zip(split_ref(b.u, pieces)).zip(pieces).for_each(|(((((g, m), v), p), u), pc)| {
        lamb_commit_kernel(&c, ratios[pc.segment], g, m, v, p, u);
    });
    Ok(())
}

/// A state buffer cut like the masters, or one empty slice a piece where the optimizer does
/// not keep that buffer.
fn split_state<'a>(buf: &'a mut [f32], pieces: &[Piece]) -> Vec<&'a mut [f32]> {
    if buf.is_empty() {
        return pieces.iter().map(|_| <&mut [f32]>::default()).collect();
    }
    split_mut(buf, pieces)
}
