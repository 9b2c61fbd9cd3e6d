//! The mixture-of-experts feed-forward of a LLaMA-family block ([`MoeFfn`]): its parameters in
//! the layout (`MoeConfig`'s contract: the router, then each expert contiguous in index order,
//! then the shared expert), its experts as an [`ExpertMlp`] (a SwiGLU MLP without biases on one
//! expert's rows), and its forward and backward around an [`ExpertRunner`].
//!
//! Forward, for the block's normed stream `h [n, c]`: router logits `h·W_r`, routing
//! ([`moe::route`]), each expert's rows, the experts (through the runner), the weighted sum of
//! their outputs, plus — Qwen2-MoE — `sigmoid(h·w_sg) ⊙ shared(h)`. The load-balancing loss's
//! gradient reaches the router through `MoeActs::dprob` (the model sums the counts over every
//! block first); the z-loss's is the block's own.

use std::ops::Range;

use crate::experts::{ExpertActs, ExpertMlp, ExpertRunner, LocalExperts};
use crate::gemm::matmul;
use crate::layer::{Init, ParamLayout, ParamSpec};
use crate::model::{Gating, MoeConfig};
use crate::ops::moe::{self, MoeActs};
use crate::ops::{linear, swiglu};

/// A dense SwiGLU MLP's weights, unit-relative: `[c, f]`, `[c, f]`, `[f, c]`.
#[derive(Clone, Debug)]
struct Swiglu {
    gate: Range<usize>,
    up: Range<usize>,
    down: Range<usize>,
    f: usize,
}

impl Swiglu {
    fn push(layout: &mut ParamLayout, base: usize, prefix: &str, c: usize, f: usize, proj_std: f32) -> Swiglu {
        let w = Init::Normal(0.02);
        let rel = |r: Range<usize>| r.start - base..r.end - base;
        let gate = rel(layout.push(format!("{prefix}.w_gate.weight"), &[c, f], w, true));
        let up = rel(layout.push(format!("{prefix}.w_up.weight"), &[c, f], w, true));
        let down = rel(layout.push(format!("{prefix}.w_down.weight"), &[f, c], Init::Normal(proj_std), true));
        Swiglu { gate, up, down, f }
    }

    /// `y = (silu(x·Wg) ⊙ x·Wu)·Wd` for `x [m, c]`, `p` the weights' owner (offsets `off`
    /// below the ranges); keeps `[x, gate, up, sw]` in `acts`.
    fn forward(&self, p: &[f32], off: usize, x: &[f32], c: usize, acts: &mut ExpertActs) -> Vec<f32> {
        let (m, f) = (x.len() / c, self.f);
        let w = |r: &Range<usize>| &p[r.start - off..r.end - off];
        let mut gate = vec![0.0; m * f];
        let mut up = vec![0.0; m * f];
        linear::linear_forward(&mut gate, x, w(&self.gate), None, m, c, f);
        linear::linear_forward(&mut up, x, w(&self.up), None, m, c, f);
        let mut sw = vec![0.0; m * f];
        swiglu::swiglu_forward(&mut sw, &gate, &up);
        let mut y = vec![0.0; m * c];
        linear::linear_forward(&mut y, &sw, w(&self.down), None, m, f, c);
        *acts = vec![x.to_vec(), gate, up, sw];
        y
    }

    /// `dx` for `dy`; adds the weights' gradients into `g` (same offsets as `p`).
    fn backward(&self, p: &[f32], g: &mut [f32], off: usize, acts: &ExpertActs, dy: &[f32], c: usize) -> Vec<f32> {
        let [x, gate, up, sw] = &acts[..] else { panic!("an expert's backward without its forward") };
        let (m, f) = (x.len() / c, self.f);
        let w = |r: &Range<usize>| &p[r.start - off..r.end - off];
        let mut d_sw = vec![0.0; m * f];
        linear::linear_backward(&mut d_sw, &mut g[self.down.start - off..self.down.end - off], None, dy, sw, w(&self.down), m, f, c);
        let (mut d_gate, mut d_up) = (vec![0.0; m * f], vec![0.0; m * f]);
        swiglu::swiglu_backward(&mut d_gate, &mut d_up, &d_sw, gate, up);
        let mut dx = vec![0.0; m * c];
        linear::linear_backward(&mut dx, &mut g[self.gate.start - off..self.gate.end - off], None, &d_gate, x, w(&self.gate), m, c, f);
        linear::linear_backward(&mut dx, &mut g[self.up.start - off..self.up.end - off], None, &d_up, x, w(&self.up), m, c, f);
        dx
    }
}

/// The Qwen2-MoE shared expert: a SwiGLU MLP on every token, gated by `sigmoid(h·w_sg)`.
#[derive(Clone, Debug)]
struct Shared {
    mlp: Swiglu,
    gate: Range<usize>,
}

/// An MoE block's feed-forward.
#[derive(Clone, Debug)]
pub struct MoeFfn {
    /// The block's unit (what the runner is told).
    unit: usize,
    c: usize,
    cfg: MoeConfig,
    router: Range<usize>,
    experts: Vec<Swiglu>,
    /// Each expert's whole range (unit-relative).
    ranges: Vec<Range<usize>>,
    shared: Option<Shared>,
}

impl MoeFfn {
    /// Appends the router, the experts and the shared expert of block `l` to `layout`, whose
    /// unit starts at `base`; returns the FFN and its unit-relative specs.
    pub fn new(cfg: &MoeConfig, l: usize, c: usize, layout: &mut ParamLayout, base: usize, proj_std: f32) -> (MoeFfn, Vec<ParamSpec>) {
        let first = layout.specs().len();
        let n = |s: &str| format!("h.{l}.moe.{s}");
        let rel = |r: Range<usize>| r.start - base..r.end - base;
        let router = rel(layout.push(n("router.weight"), &[c, cfg.num_experts], Init::Normal(0.02), true));
        let mut experts = Vec::with_capacity(cfg.num_experts);
        let mut ranges = Vec::with_capacity(cfg.num_experts);
        for e in 0..cfg.num_experts {
            let start = layout.total() - base;
            experts.push(Swiglu::push(layout, base, &n(&format!("experts.{e}")), c, cfg.d_expert, proj_std));
            ranges.push(start..layout.total() - base);
        }
        let shared = cfg.shared_expert.map(|f| {
            let mlp = Swiglu::push(layout, base, &n("shared"), c, f, proj_std);
            let gate = rel(layout.push(n("shared_gate.weight"), &[c, 1], Init::Normal(0.02), true));
            Shared { mlp, gate }
        });
        let specs = layout.specs()[first..].iter().map(|s| ParamSpec { offset: s.offset - base, ..s.clone() }).collect();
        (MoeFfn { unit: l + 1, c, cfg: cfg.clone(), router, experts, ranges, shared }, specs)
    }

    /// The FFN of the normed stream `h [n, c]` into `y` (overwritten); keeps what the backward
    /// needs in `acts`.
    pub fn forward(&self, p: &[f32], h: &[f32], y: &mut [f32], acts: &mut Option<MoeActs>, runner: Option<&mut dyn ExpertRunner>) {
        let (c, e) = (self.c, self.cfg.num_experts);
        let n = h.len() / c;
        let mut a = acts.take().unwrap_or_default();
        a.expert_acts.clear();
        (a.dprob, a.z_coef) = (None, 0.0);
        a.logits.resize(n * e, 0.0);
        matmul(&mut a.logits, h, &p[self.router.clone()], n, c, e, false, false, 0.0);
        a.routing = moe::route(&a.logits, n, e, self.cfg.top_k, self.cfg.gating, self.cfg.norm_topk);
        a.z = moe::z_loss(&a.logits, n, e);
        let rows = moe::dispatch(h, &a.routing, c);
        a.outs = match runner {
            Some(r) => r.forward(self.unit, self, p, rows),
            None => {
                let mut g: [f32; 0] = [];
                LocalExperts { g: &mut g, acts: &mut a.expert_acts }.forward(self.unit, self, p, rows)
            }
        };
        moe::combine(y, &a.outs, &a.routing, c);
        if let Some(s) = &self.shared {
            let mut sa = Vec::new();
            let out = s.mlp.forward(p, 0, h, c, &mut sa);
            let mut z = vec![0.0; n];
            matmul(&mut z, h, &p[s.gate.clone()], n, c, 1, false, false, 0.0);
            for t in 0..n {
                let sig = 1.0 / (1.0 + crate::tensor::exp_f32(-z[t]));
                y[t * c..(t + 1) * c].iter_mut().zip(&out[t * c..(t + 1) * c]).for_each(|(a, b)| *a += sig * b);
            }
            a.expert_acts.push(sa);
            a.expert_acts.push(vec![out, z]);
        }
        *acts = Some(a);
    }

    /// `dh [n, c]` (overwritten) for `dy`; adds the router's and shared expert's gradients into
    /// the unit's `g` (and, when the block runs its experts itself, theirs).
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        p: &[f32],
        g: &mut [f32],
        h: &[f32],
        dy: &[f32],
        dh: &mut [f32],
        acts: &mut Option<MoeActs>,
        runner: Option<&mut dyn ExpertRunner>,
    ) {
        let (c, e) = (self.c, self.cfg.num_experts);
        let n = h.len() / c;
        let mut a = acts.take().expect("an MoE block's backward without its forward");
        let shared_acts = match &self.shared {
            Some(_) => {
                let z = a.expert_acts.pop().expect("shared expert outputs");
                let sa = a.expert_acts.pop().expect("shared expert activations");
                Some((sa, z))
            }
            None => None,
        };
        let (d_outs, dw) = moe::combine_backward(dy, &a.outs, &a.routing, c);
        let d_rows = match runner {
            Some(r) => r.backward(self.unit, self, p, d_outs),
            None => LocalExperts { g: &mut *g, acts: &mut a.expert_acts }.backward(self.unit, self, p, d_outs),
        };
        let mut dl = vec![0.0; n * e];
        moe::route_backward(&mut dl, &a.routing, &dw, a.dprob.as_deref(), self.cfg.gating, self.cfg.norm_topk);
        if a.z_coef != 0.0 {
            moe::z_loss_backward(&mut dl, &a.logits, &a.routing.probs, n, e, a.z_coef);
        }
        // dh = dlogits·W_rᵀ, then each choice's row gradient, then the shared expert's.
        matmul(dh, &dl, &p[self.router.clone()], n, e, c, false, true, 0.0);
        matmul(&mut g[self.router.clone()], h, &dl, c, n, e, true, false, 1.0);
        moe::dispatch_backward(dh, &d_rows, &a.routing, c);
        if let (Some(s), Some((sa, zs))) = (&self.shared, shared_acts) {
            let [out, z] = &zs[..] else { panic!("shared expert outputs") };
            let mut d_out = vec![0.0; n * c];
            let mut dz = vec![0.0; n];
            for t in 0..n {
                let sig = 1.0 / (1.0 + crate::tensor::exp_f32(-z[t]));
                let d = &dy[t * c..(t + 1) * c];
                d_out[t * c..(t + 1) * c].iter_mut().zip(d).for_each(|(o, v)| *o = sig * v);
                let dot: f32 = d.iter().zip(&out[t * c..(t + 1) * c]).map(|(u, v)| u * v).sum();
                dz[t] = dot * sig * (1.0 - sig);
            }
            let dx = s.mlp.backward(p, g, 0, &sa, &d_out, c);
            dh.iter_mut().zip(&dx).for_each(|(a, b)| *a += b);
            linear::linear_backward(dh, &mut g[s.gate.clone()], None, &dz, h, &p[s.gate.clone()], n, c, 1);
        }
        *acts = Some(a);
    }

    pub fn config(&self) -> &MoeConfig {
        &self.cfg
    }
}

impl ExpertMlp for MoeFfn {
    fn num_experts(&self) -> usize {
        self.cfg.num_experts
    }

    fn width(&self) -> usize {
        self.c
    }

    fn expert_range(&self, e: usize) -> Range<usize> {
        self.ranges[e].clone()
    }

    fn forward(&self, e: usize, p: &[f32], x: &[f32], acts: &mut ExpertActs) -> Vec<f32> {
        self.experts[e].forward(p, self.ranges[e].start, x, self.c, acts)
    }

    fn backward(&self, e: usize, p: &[f32], g: &mut [f32], acts: &mut ExpertActs, dy: &[f32]) -> Vec<f32> {
        self.experts[e].backward(p, g, self.ranges[e].start, acts, dy, self.c)
    }
}

/// Whether block `l` of a model with `cfg` is an MoE block.
pub fn is_sparse(cfg: &MoeConfig, l: usize) -> bool {
    (l + 1) % cfg.sparse_step.max(1) == 0 && !cfg.dense_layers.contains(&l)
}

/// The gating a config's family uses is checked by `ModelConfig::validate`; this names it.
pub fn gating_name(g: Gating) -> &'static str {
    match g {
        Gating::SoftmaxThenTopK => "softmax then top-k",
        Gating::TopKThenSoftmax => "top-k then softmax",
    }
}
