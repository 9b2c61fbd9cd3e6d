//! The `Layer` trait and the flat parameter layout: every parameter is a named view
//! (name, shape, offset) into one flat `f32` buffer, which ZeRO later partitions into ranges.

use std::ops::Range;

use crate::experts::{ExpertMlp, ExpertRunner};
use crate::tensor::Rng;
use crate::wgrad::WeightGrads;

/// How a parameter is initialised.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// N(0, std²).
    Normal(f32),
    Zeros,
    Ones,
}

/// One named parameter: a view `[offset, offset + numel)` of the flat buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<usize>,
    /// Offset in the model's flat buffer.
    pub offset: usize,
    pub init: Init,
    /// Whether weight decay applies (matrices and embeddings yes; biases and norm gains no).
    pub decay: bool,
}

impl ParamSpec {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.numel()
    }
}

/// The ordered list of parameters of a model, packed back to back.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ParamLayout {
    specs: Vec<ParamSpec>,
    total: usize,
}

impl ParamLayout {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a parameter and returns its range in the flat buffer.
    pub fn push(&mut self, name: String, shape: &[usize], init: Init, decay: bool) -> Range<usize> {
        let spec = ParamSpec { name, shape: shape.to_vec(), offset: self.total, init, decay };
        let range = spec.range();
        self.total = range.end;
        self.specs.push(spec);
        range
    }

    pub fn specs(&self) -> &[ParamSpec] {
        &self.specs
    }

    /// Total number of parameters (length of the flat buffer).
    pub fn total(&self) -> usize {
        self.total
    }

    pub fn get(&self, name: &str) -> Option<&ParamSpec> {
        self.specs.iter().find(|s| s.name == name)
    }

    /// Tensor boundaries as global ranges, in layout order.
    pub fn segments(&self) -> Vec<Range<usize>> {
        self.specs.iter().map(ParamSpec::range).collect()
    }

    /// Per-segment weight-decay flags, in layout order.
    pub fn decay_flags(&self) -> Vec<bool> {
        self.specs.iter().map(|s| s.decay).collect()
    }

    /// Fills a fresh flat buffer. Each parameter draws from its own stream keyed by
    /// (seed, parameter index), so initialisation does not depend on layout changes elsewhere,
    /// and the parameters fill in parallel (rayon's pool) with the bits of a serial fill (a
    /// 1.3B model's fill took 26 s on one core of the dev box).
    pub fn init(&self, seed: u64) -> Vec<f32> {
        use rayon::prelude::*;
        let mut flat = vec![0.0f32; self.total];
        // The specs are packed back to back (`push`), so the buffer splits into their views.
        let mut views = Vec::with_capacity(self.specs.len());
        let mut rest = flat.as_mut_slice();
        for (i, spec) in self.specs.iter().enumerate() {
            let (view, tail) = std::mem::take(&mut rest).split_at_mut(spec.numel());
            rest = tail;
            views.push((i, spec.init, view));
        }
        // Largest first, so the embedding does not start last.
        views.sort_by_key(|(_, _, v)| std::cmp::Reverse(v.len()));
        views.into_par_iter().with_max_len(1).for_each(|(i, init, view)| match init {
            Init::Zeros => {}
            Init::Ones => view.fill(1.0),
            Init::Normal(std) => Rng::derive(seed, &[0x1417, i as u64]).fill_normal(view, std),
        });
        flat
    }
}

/// Shape of the activations a layer sees: `b` sequences of `t` tokens with `c` channels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    pub b: usize,
    pub t: usize,
    pub c: usize,
}

impl Dims {
    /// Rows of the activation matrix (`b * t`).
    pub fn n(&self) -> usize {
        self.b * self.t
    }
}

/// Saved activations and scratch space of one layer, reused from step to step.
#[derive(Debug, Default)]
pub struct Acts {
    bufs: Vec<Vec<f32>>,
    /// An MoE block's routing and experts' outputs (and, before its backward, what the model
    /// hands it: the load-balancing loss's gradient).
    pub moe: Option<crate::ops::moe::MoeActs>,
}

impl Acts {
    /// Buffer `i` resized to `len`; contents are whatever was there (callers overwrite).
    pub fn buf(&mut self, i: usize, len: usize) -> &mut Vec<f32> {
        if self.bufs.len() <= i {
            self.bufs.resize_with(i + 1, Vec::new);
        }
        let b = &mut self.bufs[i];
        b.resize(len, 0.0);
        b
    }

    /// Buffer `i` resized to `len` and set to zero (for accumulating backward outputs).
    pub fn zeroed(&mut self, i: usize, len: usize) -> &mut Vec<f32> {
        let b = self.buf(i, len);
        b.fill(0.0);
        b
    }

    /// Takes buffer `i` out (to borrow several at once); give it back with [`Acts::put`].
    pub fn take(&mut self, i: usize, len: usize) -> Vec<f32> {
        std::mem::take(self.buf(i, len))
    }

    pub fn put(&mut self, i: usize, v: Vec<f32>) {
        self.bufs[i] = v;
    }

    /// Frees the memory held (used by activation checkpointing between forward and backward).
    pub fn release(&mut self) {
        self.bufs.iter_mut().for_each(|b| *b = Vec::new());
        self.moe = None;
    }

    /// Bytes currently held.
    pub fn bytes(&self) -> usize {
        self.bufs.iter().map(|b| b.capacity() * 4).sum::<usize>() + self.moe.as_ref().map_or(0, crate::ops::moe::MoeActs::bytes)
    }
}

/// A layer of the residual stack: maps `x [n, c]` to `y [n, c]`, with its parameters a
/// contiguous view of the flat buffer (`p`) and its gradients the same view of the gradient
/// buffer (`g`). Offsets in [`Layer::param_specs`] are relative to the layer's first parameter.
pub trait Layer: Send + Sync {
    /// Short name of the layer type (e.g. `gpt-block`).
    fn kind(&self) -> &'static str;
    /// Parameters of this layer, offsets relative to the layer.
    fn param_specs(&self) -> &[ParamSpec];
    /// Number of parameters (length of `p` and `g`).
    fn num_params(&self) -> usize {
        self.param_specs().iter().map(ParamSpec::numel).sum()
    }
    /// `y = f(p, x)`; saves what backward needs into `acts`.
    fn forward(&self, p: &[f32], x: &[f32], d: Dims, acts: &mut Acts, y: &mut [f32]);
    /// Given `dy`, accumulates parameter gradients into `g` and writes (overwrites) `dx`.
    /// Requires `acts` from a forward on the same `p` and `x`.
    // Allowed: llm.c's backward (p, g, x, dy, shape, acts, dx).
    #[allow(clippy::too_many_arguments)]
    fn backward(&self, p: &[f32], g: &mut [f32], x: &[f32], dy: &[f32], d: Dims, acts: &mut Acts, dx: &mut [f32]) {
        self.backward_with(p, &mut WeightGrads::now(g), x, dy, d, acts, dx, None)
    }

    /// The block's forward over a paged key/value cache (inference).
    fn paged(&self) -> &dyn crate::model::paged::PagedLayer;

    /// The block's experts, when it is a mixture-of-experts block (their MLPs one expert at a
    /// time, for an [`ExpertRunner`] that may run them elsewhere).
    fn experts(&self) -> Option<&dyn ExpertMlp> {
        None
    }

    /// [`Layer::forward`] with the experts run by `experts` (expert parallelism); `None` (and
    /// every dense block) runs them here.
    fn forward_with(&self, p: &[f32], x: &[f32], d: Dims, acts: &mut Acts, y: &mut [f32], experts: Option<&mut dyn ExpertRunner>) {
        let _ = experts;
        self.forward(p, x, d, acts, y)
    }

    /// [`Layer::backward`] with the parameter gradients sent to `wg` (added at once, or
    /// recorded for a zero-bubble pipeline's weight pass: then this is the input-gradient pass
    /// alone) and the experts run by `experts`, which then keeps their parameter gradients (`wg`
    /// gets the rest). `dx` is complete on return either way.
    #[allow(clippy::too_many_arguments)]
    fn backward_with(
        &self,
        p: &[f32],
        wg: &mut WeightGrads<'_>,
        x: &[f32],
        dy: &[f32],
        d: Dims,
        acts: &mut Acts,
        dx: &mut [f32],
        experts: Option<&mut dyn ExpertRunner>,
    );
}
