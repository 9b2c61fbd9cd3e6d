//! The mixture-of-experts feed-forward of a sparse block ([`MoeFfn`]): its parameters in the
//! layout (`MoeConfig`'s contract: the router, then each expert contiguous in index order, then
//! the shared expert and the residual MLP), its experts as an [`ExpertMlp`] (an MLP of the
//! block's kind on one expert's rows: SwiGLU without biases in LLaMA-family blocks, GELU(tanh)
//! with biases in GPT blocks), and its forward and backward around an [`ExpertRunner`].
//!
//! Forward, for the block's normed stream `h [n, c]`: router logits `h·W_r` (of the jittered
//! `h` under Jitter), routing ([`moe::route_with`]: gating, capacity, noise), each expert's rows,
//! the experts (through the runner), the weighted sum of their outputs; then — DeepSpeed's
//! `use_residual` — `q₀·y + q₁·mlp(h)` with `q = softmax(h·W_coef + b_coef)`, and — Qwen2-MoE —
//! `+ sigmoid(h·w_sg) ⊙ shared(h)`. The shared expert and the residual MLP run here on every
//! token, never through the runner. The load-balancing loss's gradient reaches the router
//! through `MoeActs::dprob` (the model forms it over every block, or per block); the z-loss's
//! is the block's own.
//!
//! Inference may hold int8 copies of the MLPs' linears ([`MoeFfn::linears`], [`MoeFfn::forward_with`]):
//! every expert's, the shared expert's and the residual MLP's; the router, the shared expert's
//! gate and the residual mixer stay f32, so routing reads the f32 router.

use std::ops::Range;

use crate::experts::{ExpertActs, ExpertMlp, ExpertRunner, LocalExperts};
use crate::gemm::matmul;
use crate::layer::{Init, ParamLayout, ParamSpec};
use crate::model::paged::LinearSpec;
use crate::model::{Arch, MoeConfig, NoisyGate};
use crate::ops::moe::{self, MoeActs, NoiseKey, RouteSpec};
use crate::ops::{gelu, linear, swiglu};
use crate::quant::{self, QuantUnit};
use crate::tensor::exp_f32;
use crate::wgrad::WeightGrads;

/// One MLP of an MoE block — an expert, the shared expert or the residual MLP — of the
/// block's own kind, its weights unit-relative.
#[derive(Clone, Debug)]
enum Mlp {
    /// LLaMA family: `(silu(x·Wg) ⊙ x·Wu)·Wd`, no biases; weights `[c, f]`, `[c, f]`, `[f, c]`.
    Swiglu { gate: Range<usize>, up: Range<usize>, down: Range<usize>, f: usize },
    /// GPT-2: `gelu(x·Wfc + bfc)·Wproj + bproj` (GELU tanh); `[c, f]`, `[f]`, `[f, c]`, `[c]`.
    Gelu { fc_w: Range<usize>, fc_b: Range<usize>, proj_w: Range<usize>, proj_b: Range<usize>, f: usize },
}

impl Mlp {
    /// Appends the MLP's parameters `{prefix}.…` to `layout` (its unit at `base`).
    fn push(layout: &mut ParamLayout, base: usize, prefix: &str, arch: Arch, c: usize, f: usize, proj_std: f32) -> Mlp {
        let w = Init::Normal(0.02);
        let mut push = |name: &str, shape: &[usize], init: Init, decay: bool| {
            let r = layout.push(format!("{prefix}.{name}"), shape, init, decay);
            r.start - base..r.end - base
        };
        match arch {
            Arch::Llama => Mlp::Swiglu {
                gate: push("w_gate.weight", &[c, f], w, true),
                up: push("w_up.weight", &[c, f], w, true),
                down: push("w_down.weight", &[f, c], Init::Normal(proj_std), true),
                f,
            },
            Arch::Gpt => Mlp::Gelu {
                fc_w: push("c_fc.weight", &[c, f], w, true),
                fc_b: push("c_fc.bias", &[f], Init::Zeros, false),
                proj_w: push("c_proj.weight", &[f, c], Init::Normal(proj_std), true),
                proj_b: push("c_proj.bias", &[c], Init::Zeros, false),
                f,
            },
        }
    }

    /// The MLP's linears (weights unit-relative), for width `c`.
    fn linears(&self, c: usize) -> Vec<LinearSpec> {
        let spec = |w: &Range<usize>, ic, oc| LinearSpec { weight: w.clone(), ic, oc, moe: true };
        match self {
            Mlp::Swiglu { gate, up, down, f } => vec![spec(gate, c, *f), spec(up, c, *f), spec(down, *f, c)],
            Mlp::Gelu { fc_w, proj_w, f, .. } => vec![spec(fc_w, c, *f), spec(proj_w, *f, c)],
        }
    }

    /// `y` for `x [m, c]`, `p` the weights' owner (offsets `off` below the ranges), each linear
    /// through its int8 copy in `int8` (the unit's) when there is one; keeps in `acts` what the
    /// backward needs (SwiGLU `[x, gate, up, sw]`, GELU `[x, fc, gelu]`).
    fn forward(&self, p: &[f32], off: usize, x: &[f32], c: usize, acts: &mut ExpertActs, int8: Option<&QuantUnit>) -> Vec<f32> {
        let w = |r: &Range<usize>| &p[r.start - off..r.end - off];
        let lin = |out: &mut [f32], x: &[f32], wr: &Range<usize>, b: Option<&Range<usize>>, ic: usize, oc: usize| {
            quant::linear_forward(int8, wr.start, out, x, w(wr), b.map(w), ic, oc);
        };
        let m = x.len() / c;
        let mut y = vec![0.0; m * c];
        match self {
            Mlp::Swiglu { gate: wg, up: wu, down: wd, f } => {
                let f = *f;
                let mut gate = vec![0.0; m * f];
                let mut up = vec![0.0; m * f];
                lin(&mut gate, x, wg, None, c, f);
                lin(&mut up, x, wu, None, c, f);
                let mut sw = vec![0.0; m * f];
                swiglu::swiglu_forward(&mut sw, &gate, &up);
                lin(&mut y, &sw, wd, None, f, c);
                *acts = vec![x.to_vec(), gate, up, sw];
            }
            Mlp::Gelu { fc_w, fc_b, proj_w, proj_b, f } => {
                let f = *f;
                let mut fc = vec![0.0; m * f];
                lin(&mut fc, x, fc_w, Some(fc_b), c, f);
                let mut gl = vec![0.0; m * f];
                gelu::gelu_forward(&mut gl, &fc);
                lin(&mut y, &gl, proj_w, Some(proj_b), f, c);
                *acts = vec![x.to_vec(), fc, gl];
            }
        }
        y
    }

    /// `dx` for `dy`; sends the weights' gradients to `wg` (unit-relative ranges).
    fn backward(&self, p: &[f32], off: usize, acts: &ExpertActs, dy: &[f32], c: usize, wg: &mut WeightGrads<'_>) -> Vec<f32> {
        let w = |r: &Range<usize>| &p[r.start - off..r.end - off];
        match self {
            Mlp::Swiglu { gate: w_gate, up: wu, down: wd, f } => {
                let [x, gate, up, sw] = &acts[..] else { panic!("an expert's backward without its forward") };
                let (m, f) = (x.len() / c, *f);
                let mut d_sw = vec![0.0; m * f];
                linear::linear_backward_input(&mut d_sw, dy, w(wd), m, f, c);
                wg.linear(wd.clone(), None, dy, sw, m, f, c);
                let (mut d_gate, mut d_up) = (vec![0.0; m * f], vec![0.0; m * f]);
                swiglu::swiglu_backward(&mut d_gate, &mut d_up, &d_sw, gate, up);
                let mut dx = vec![0.0; m * c];
                linear::linear_backward_input(&mut dx, &d_gate, w(w_gate), m, c, f);
                wg.linear(w_gate.clone(), None, &d_gate, x, m, c, f);
                linear::linear_backward_input(&mut dx, &d_up, w(wu), m, c, f);
                wg.linear(wu.clone(), None, &d_up, x, m, c, f);
                dx
            }
            Mlp::Gelu { fc_w, fc_b, proj_w, proj_b, f } => {
                let [x, fc, gl] = &acts[..] else { panic!("an expert's backward without its forward") };
                let (m, f) = (x.len() / c, *f);
                let mut d_gl = vec![0.0; m * f];
                linear::linear_backward_input(&mut d_gl, dy, w(proj_w), m, f, c);
                wg.linear(proj_w.clone(), Some(proj_b.clone()), dy, gl, m, f, c);
                let mut d_fc = vec![0.0; m * f];
                gelu::gelu_backward(&mut d_fc, fc, &d_gl);
                let mut dx = vec![0.0; m * c];
                linear::linear_backward_input(&mut dx, &d_fc, w(fc_w), m, c, f);
                wg.linear(fc_w.clone(), Some(fc_b.clone()), &d_fc, x, m, c, f);
                dx
            }
        }
    }
}

/// The Qwen2-MoE shared expert: an MLP on every token, gated by `sigmoid(h·w_sg)`.
#[derive(Clone, Debug)]
struct Shared {
    mlp: Mlp,
    gate: Range<usize>,
}

/// DeepSpeed's residual MoE (`use_residual`, PR-MoE): a dense MLP of the experts' kind and
/// width beside them, the two mixed per token by `q = softmax(h·W_coef + b_coef)` over two:
/// `y = q₀·experts(h) + q₁·mlp(h)`.
#[derive(Clone, Debug)]
struct Residual {
    mlp: Mlp,
    coef_w: Range<usize>,
    coef_b: Range<usize>,
}

/// What the residual MLP's backward needs: its activations, its output, the experts' combined
/// output and the mixing weights `[n, 2]`.
#[derive(Debug, Default)]
pub struct ResidualActs {
    mlp: ExpertActs,
    out: Vec<f32>,
    moe_out: Vec<f32>,
    q: Vec<f32>,
}

impl ResidualActs {
    pub fn bytes(&self) -> usize {
        4 * (self.mlp.iter().map(Vec::capacity).sum::<usize>() + self.out.capacity() + self.moe_out.capacity() + self.q.capacity())
    }
}

/// An MoE block's feed-forward.
#[derive(Clone, Debug)]
pub struct MoeFfn {
    /// The block's unit (what the runner is told).
    unit: usize,
    c: usize,
    cfg: MoeConfig,
    router: Range<usize>,
    experts: Vec<Mlp>,
    /// Each expert's whole range (unit-relative).
    ranges: Vec<Range<usize>>,
    shared: Option<Shared>,
    residual: Option<Residual>,
}

impl MoeFfn {
    /// Appends the router, the experts, the shared expert and the residual MLP of block `l`
    /// (experts of `arch`'s kind) to `layout`, whose unit starts at `base`; returns the FFN and
    /// its unit-relative specs.
    ///
    /// Names, in layout order: `h.{l}.moe.router.weight` `[c, E]`; per expert `e`
    /// `h.{l}.moe.experts.{e}.{w_gate,w_up,w_down}.weight` (LLaMA) or
    /// `.{c_fc.weight, c_fc.bias, c_proj.weight, c_proj.bias}` (GPT); the shared expert
    /// `h.{l}.moe.shared.…` (same MLP names) and `h.{l}.moe.shared_gate.weight` `[c, 1]`; the
    /// residual MLP `h.{l}.moe.residual.…` (width `d_expert`) and its mixer
    /// `h.{l}.moe.coefficient.weight` `[c, 2]`, `h.{l}.moe.coefficient.bias` `[2]`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: &MoeConfig,
        arch: Arch,
        l: usize,
        c: usize,
        layout: &mut ParamLayout,
        base: usize,
        proj_std: f32,
    ) -> (MoeFfn, Vec<ParamSpec>) {
        let first = layout.specs().len();
        let n = |s: &str| format!("h.{l}.moe.{s}");
        let rel = |r: Range<usize>| r.start - base..r.end - base;
        let router = rel(layout.push(n("router.weight"), &[c, cfg.num_experts], Init::Normal(0.02), true));
        let mut experts = Vec::with_capacity(cfg.num_experts);
        let mut ranges = Vec::with_capacity(cfg.num_experts);
        for e in 0..cfg.num_experts {
            let start = layout.total() - base;
            experts.push(Mlp::push(layout, base, &n(&format!("experts.{e}")), arch, c, cfg.d_expert, proj_std));
            ranges.push(start..layout.total() - base);
        }
        let shared = cfg.shared_expert.map(|f| {
            let mlp = Mlp::push(layout, base, &n("shared"), arch, c, f, proj_std);
            let gate = rel(layout.push(n("shared_gate.weight"), &[c, 1], Init::Normal(0.02), true));
            Shared { mlp, gate }
        });
        let residual = cfg.residual.then(|| {
            let mlp = Mlp::push(layout, base, &n("residual"), arch, c, cfg.d_expert, proj_std);
            let coef_w = rel(layout.push(n("coefficient.weight"), &[c, 2], Init::Normal(0.02), true));
            let coef_b = rel(layout.push(n("coefficient.bias"), &[2], Init::Zeros, false));
            Residual { mlp, coef_w, coef_b }
        });
        let specs = layout.specs()[first..].iter().map(|s| ParamSpec { offset: s.offset - base, ..s.clone() }).collect();
        (MoeFfn { unit: l + 1, c, cfg: cfg.clone(), router, experts, ranges, shared, residual }, specs)
    }

    /// The linears of the FFN's MLPs — each expert's, then the shared expert's and the residual
    /// MLP's — unit-relative (what int8 inference quantizes; the router and gates are not here).
    pub fn linears(&self) -> Vec<LinearSpec> {
        let shared = self.shared.iter().map(|s| &s.mlp);
        let residual = self.residual.iter().map(|r| &r.mlp);
        self.experts.iter().chain(shared).chain(residual).flat_map(|m| m.linears(self.c)).collect()
    }

    /// The FFN of the normed stream `h [n, c]` into `y` (overwritten); keeps what the backward
    /// needs in `acts`.
    pub fn forward(&self, p: &[f32], h: &[f32], y: &mut [f32], acts: &mut Option<MoeActs>, runner: Option<&mut dyn ExpertRunner>) {
        self.forward_with(p, None, h, y, acts, runner);
    }

    /// [`MoeFfn::forward`] with int8 copies of the MLPs' linears ([`MoeFfn::linears`]) where
    /// `int8` (the block unit's) holds them: inference, whose experts run here, never through a
    /// runner.
    ///
    /// # Panics
    /// With both `int8` and a `runner`.
    pub fn forward_with(
        &self,
        p: &[f32],
        int8: Option<&QuantUnit>,
        h: &[f32],
        y: &mut [f32],
        acts: &mut Option<MoeActs>,
        runner: Option<&mut dyn ExpertRunner>,
    ) {
        assert!(int8.is_none() || runner.is_none(), "int8 experts run in their block, not through a runner");
        let (c, e) = (self.c, self.cfg.num_experts);
        let n = h.len() / c;
        let mut a = acts.take().unwrap_or_default();
        a.expert_acts.clear();
        (a.dprob, a.z_coef) = (None, 0.0);
        // The noise of a training pass — Jitter on the router's input, Gumbel on its logits, the
        // random token order of the capacity slots — keyed by (noise key, block).
        let (cfg, pass) = (&self.cfg, a.pass);
        let key = (pass.training && cfg.is_noisy()).then_some(NoiseKey { key: pass.noise_key, block: pass.block });
        a.jitter = match key {
            Some(k) if cfg.noisy_gate == NoisyGate::Jitter => k.jitter(n * c),
            _ => Vec::new(),
        };
        let jittered: Vec<f32>;
        let h_r = if a.jitter.is_empty() {
            h
        } else {
            jittered = h.iter().zip(&a.jitter).map(|(x, j)| x * j).collect();
            &jittered
        };
        a.logits.resize(n * e, 0.0);
        matmul(&mut a.logits, h_r, &p[self.router.clone()], n, c, e, false, false, 0.0);
        let spec = RouteSpec {
            e,
            k: cfg.top_k,
            gating: cfg.gating,
            norm_topk: cfg.norm_topk,
            capacity: cfg.capacity.map(|cap| (cap, if pass.training { cap.train_factor } else { cap.eval_factor })),
            gumbel: key.filter(|_| cfg.noisy_gate == NoisyGate::RSample),
            rts: key.filter(|_| cfg.random_token_selection),
        };
        a.routing = moe::route_with(&a.logits, n, &spec);
        a.z = moe::z_loss(&a.logits, n, e);
        let rows = moe::dispatch(h, &a.routing, c);
        a.outs = match (runner, int8) {
            (Some(r), _) => r.forward(self.unit, self, p, rows),
            (None, None) => {
                let mut g: [f32; 0] = [];
                LocalExperts { wg: &mut WeightGrads::now(&mut g), acts: &mut a.expert_acts }.forward(self.unit, self, p, rows)
            }
            // As `LocalExperts`, each expert's linears through their int8 copies; nothing kept.
            (None, Some(_)) => {
                let run = |(e, x): (usize, &Vec<f32>)| {
                    if x.is_empty() {
                        Vec::new()
                    } else {
                        self.experts[e].forward(p, 0, x, c, &mut Vec::new(), int8)
                    }
                };
                rows.iter().enumerate().map(run).collect()
            }
        };
        moe::combine(y, &a.outs, &a.routing, c);
        a.residual = self.residual.as_ref().map(|r| {
            let mut ra = ResidualActs::default();
            ra.out = r.mlp.forward(p, 0, h, c, &mut ra.mlp, int8);
            ra.moe_out = y.to_vec();
            ra.q = vec![0.0; n * 2];
            linear::linear_forward(&mut ra.q, h, &p[r.coef_w.clone()], Some(&p[r.coef_b.clone()]), n, c, 2);
            for t in 0..n {
                let q = &mut ra.q[2 * t..2 * t + 2];
                let m = q[0].max(q[1]);
                let (e0, e1) = (exp_f32(q[0] - m), exp_f32(q[1] - m));
                let s = e0 + e1;
                (q[0], q[1]) = (e0 / s, e1 / s);
                let (yt, rt) = (&mut y[t * c..(t + 1) * c], &ra.out[t * c..(t + 1) * c]);
                yt.iter_mut().zip(rt).for_each(|(a, b)| *a = q[0] * *a + q[1] * b);
            }
            ra
        });
        if let Some(s) = &self.shared {
            let mut sa = Vec::new();
            let out = s.mlp.forward(p, 0, h, c, &mut sa, int8);
            let mut z = vec![0.0; n];
            matmul(&mut z, h, &p[s.gate.clone()], n, c, 1, false, false, 0.0);
            for t in 0..n {
                let sig = 1.0 / (1.0 + exp_f32(-z[t]));
                y[t * c..(t + 1) * c].iter_mut().zip(&out[t * c..(t + 1) * c]).for_each(|(a, b)| *a += sig * b);
            }
            a.expert_acts.push(sa);
            a.expert_acts.push(vec![out, z]);
        }
        *acts = Some(a);
    }

    /// `dh [n, c]` (overwritten) for `dy`; sends the router's, shared expert's and residual
    /// MLP's gradients to `wg`, over the block's unit (and, when the block runs its experts
    /// itself, theirs; a `runner` keeps them).
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        p: &[f32],
        wg: &mut WeightGrads<'_>,
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
        // The residual mix: d(experts' output) = q₀·dy, d(residual MLP) = q₁·dy, and the
        // mixer's logits get the two-way softmax backward of (dy·moe_out, dy·out).
        let mut d_res = None;
        let dy_moe = match (&self.residual, a.residual.as_ref()) {
            (Some(_), Some(ra)) => {
                let (mut d_moe, mut d_out, mut dz) = (vec![0.0; n * c], vec![0.0; n * c], vec![0.0; n * 2]);
                for t in 0..n {
                    let (q, d) = (&ra.q[2 * t..2 * t + 2], &dy[t * c..(t + 1) * c]);
                    d_moe[t * c..(t + 1) * c].iter_mut().zip(d).for_each(|(o, v)| *o = q[0] * v);
                    d_out[t * c..(t + 1) * c].iter_mut().zip(d).for_each(|(o, v)| *o = q[1] * v);
                    let dq0: f32 = d.iter().zip(&ra.moe_out[t * c..(t + 1) * c]).map(|(u, v)| u * v).sum();
                    let dq1: f32 = d.iter().zip(&ra.out[t * c..(t + 1) * c]).map(|(u, v)| u * v).sum();
                    let dot = q[0] * dq0 + q[1] * dq1;
                    (dz[2 * t], dz[2 * t + 1]) = (q[0] * (dq0 - dot), q[1] * (dq1 - dot));
                }
                d_res = Some((d_out, dz));
                d_moe
            }
            (None, None) => dy.to_vec(),
            _ => panic!("a residual MoE block's backward without its forward"),
        };
        let (d_outs, dw) = moe::combine_backward(&dy_moe, &a.outs, &a.routing, c);
        let d_rows = match runner {
            Some(r) => r.backward(self.unit, self, p, d_outs),
            None => LocalExperts { wg: &mut *wg, acts: &mut a.expert_acts }.backward(self.unit, self, p, d_outs),
        };
        let mut dl = vec![0.0; n * e];
        moe::route_backward(&mut dl, &a.routing, &dw, a.dprob.as_deref(), self.cfg.gating, self.cfg.norm_topk);
        if a.z_coef != 0.0 {
            moe::z_loss_backward(&mut dl, &a.logits, &a.routing.probs, n, e, a.z_coef);
        }
        // dh = dlogits·W_rᵀ, then each choice's row gradient, then the residual's and the
        // shared expert's.
        // (With Jitter the router saw h ⊙ jitter: its gradient reads that, and dh is scaled.)
        matmul(dh, &dl, &p[self.router.clone()], n, e, c, false, true, 0.0);
        if a.jitter.is_empty() {
            wg.linear(self.router.clone(), None, &dl, h, n, c, e);
        } else {
            let h_r: Vec<f32> = h.iter().zip(&a.jitter).map(|(x, j)| x * j).collect();
            wg.linear(self.router.clone(), None, &dl, &h_r, n, c, e);
            dh.iter_mut().zip(&a.jitter).for_each(|(d, j)| *d *= j);
        }
        moe::dispatch_backward(dh, &d_rows, &a.routing, c);
        if let (Some(r), Some(ra), Some((d_out, dz))) = (&self.residual, a.residual.as_ref(), d_res) {
            let dx = r.mlp.backward(p, 0, &ra.mlp, &d_out, c, wg);
            dh.iter_mut().zip(&dx).for_each(|(a, b)| *a += b);
            linear::linear_backward_input(dh, &dz, &p[r.coef_w.clone()], n, c, 2);
            wg.linear(r.coef_w.clone(), Some(r.coef_b.clone()), &dz, h, n, c, 2);
        }
        if let (Some(s), Some((sa, zs))) = (&self.shared, shared_acts) {
            let [out, z] = &zs[..] else { panic!("shared expert outputs") };
            let mut d_out = vec![0.0; n * c];
            let mut dz = vec![0.0; n];
            for t in 0..n {
                let sig = 1.0 / (1.0 + exp_f32(-z[t]));
                let d = &dy[t * c..(t + 1) * c];
                d_out[t * c..(t + 1) * c].iter_mut().zip(d).for_each(|(o, v)| *o = sig * v);
                let dot: f32 = d.iter().zip(&out[t * c..(t + 1) * c]).map(|(u, v)| u * v).sum();
                dz[t] = dot * sig * (1.0 - sig);
            }
            let dx = s.mlp.backward(p, 0, &sa, &d_out, c, wg);
            dh.iter_mut().zip(&dx).for_each(|(a, b)| *a += b);
            linear::linear_backward_input(dh, &dz, &p[s.gate.clone()], n, c, 1);
            wg.linear(s.gate.clone(), None, &dz, h, n, c, 1);
        }
        *acts = Some(a);
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
        self.experts[e].forward(p, self.ranges[e].start, x, self.c, acts, None)
    }

    fn backward_to(&self, e: usize, p: &[f32], acts: &mut ExpertActs, dy: &[f32], wg: &mut WeightGrads<'_>) -> Vec<f32> {
        self.experts[e].backward(p, self.ranges[e].start, acts, dy, self.c, wg)
    }
}

/// Whether block `l` of a model with `cfg` is an MoE block.
pub fn is_sparse(cfg: &MoeConfig, l: usize) -> bool {
    (l + 1) % cfg.sparse_step.max(1) == 0 && !cfg.dense_layers.contains(&l)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check_grad, randn, weighted_sum};
    use crate::model::{AuxLoss, Gating, NoisyGate};

    fn cfg(top_k: usize, shared: Option<usize>, residual: bool) -> MoeConfig {
        MoeConfig {
            num_experts: 3,
            top_k,
            d_expert: 5,
            sparse_step: 1,
            dense_layers: vec![],
            gating: Gating::SoftmaxThenTopK,
            norm_topk: true,
            capacity: None,
            noisy_gate: NoisyGate::None,
            random_token_selection: false,
            aux_loss_coef: 0.0,
            z_loss_coef: 0.0,
            aux_loss: AuxLoss::AcrossLayers,
            shared_expert: shared,
            residual,
        }
    }

    /// The block's FFN alone, its unit's parameters random (biases too).
    fn ffn(arch: Arch, cfg: &MoeConfig, c: usize) -> (MoeFfn, Vec<f32>) {
        let mut layout = ParamLayout::new();
        let (f, _) = MoeFfn::new(cfg, arch, 0, c, &mut layout, 0, 0.02);
        (f, randn(17, layout.total(), 0.4))
    }

    /// One expert MLP of either kind: finite differences of its input and parameters, and an
    /// expert without rows gives no rows and adds nothing.
    #[test]
    fn an_expert_mlp_matches_finite_differences_and_takes_zero_rows() {
        let c = 4;
        for arch in [Arch::Gpt, Arch::Llama] {
            let (f, p) = ffn(arch, &cfg(1, None, false), c);
            let r = f.expert_range(1);
            let pe = p[r.clone()].to_vec();
            let x = randn(3, 3 * c, 1.0);
            let wy = randn(4, 3 * c, 1.0);
            let mut acts = Vec::new();
            ExpertMlp::forward(&f, 1, &pe, &x, &mut acts);
            let mut ge = vec![0.0; pe.len()];
            let dx = ExpertMlp::backward(&f, 1, &pe, &mut ge, &mut acts, &wy);
            let loss = |pe: &[f32], x: &[f32]| weighted_sum(&ExpertMlp::forward(&f, 1, pe, x, &mut Vec::new()), &wy);
            check_grad(|x| loss(&pe, x), &x, &dx, 1e-2, 1e-3).unwrap_or_else(|e| panic!("{arch:?} dx: {e}"));
            check_grad(|q| loss(q, &x), &pe, &ge, 1e-2, 1e-3).unwrap_or_else(|e| panic!("{arch:?} dparams: {e}"));
            // Zero rows: an empty output, an empty input gradient, no parameter gradient.
            let mut acts = Vec::new();
            assert!(ExpertMlp::forward(&f, 1, &pe, &[], &mut acts).is_empty());
            let mut g0 = vec![0.0; pe.len()];
            assert!(ExpertMlp::backward(&f, 1, &pe, &mut g0, &mut acts, &[]).is_empty());
            assert!(g0.iter().all(|&v| v == 0.0), "{arch:?}: an expert without rows has no gradient");
        }
    }

    /// The whole FFN — router, experts, shared expert, residual MLP and its mixer — against
    /// finite differences of its input and every parameter. Every token goes to every expert
    /// (top-k = E), so no step moves a token to another expert.
    #[test]
    fn the_ffn_with_shared_and_residual_parts_matches_finite_differences() {
        let (c, n) = (4, 5);
        for arch in [Arch::Gpt, Arch::Llama] {
            for (shared, residual) in [(None, true), (Some(3), true), (Some(3), false)] {
                let cfg = cfg(3, shared, residual);
                let (f, p) = ffn(arch, &cfg, c);
                let h = randn(5, n * c, 1.0);
                let wy = randn(6, n * c, 1.0);
                let run = |p: &[f32], h: &[f32]| {
                    let mut y = vec![0.0; n * c];
                    f.forward(p, h, &mut y, &mut None, None);
                    weighted_sum(&y, &wy)
                };
                let mut acts = None;
                let mut y = vec![0.0; n * c];
                f.forward(&p, &h, &mut y, &mut acts, None);
                let (mut g, mut dh) = (vec![0.0; p.len()], vec![0.0; n * c]);
                f.backward(&p, &mut WeightGrads::now(&mut g), &h, &wy, &mut dh, &mut acts, None);
                let what = format!("{arch:?}, shared {shared:?}, residual {residual}");
                check_grad(|x| run(&p, x), &h, &dh, 1e-2, 2e-2).unwrap_or_else(|e| panic!("{what} dh: {e}"));
                check_grad(|q| run(q, &h), &p, &g, 1e-2, 2e-2).unwrap_or_else(|e| panic!("{what} dparams: {e}"));
            }
        }
    }

    /// Int8 inference: the FFN's linears are every weight matrix of its MLPs (each expert's,
    /// the shared expert's, the residual MLP's) and nothing else; each round-trips through
    /// [`QuantMatrix`] within half its channel's scale; and `forward_with` the int8 copies is the
    /// f32 forward of the dequantized weights (same routing: the router stays f32).
    #[test]
    fn int8_mlps_round_trip_within_half_a_step_and_match_their_dequantized_forward() {
        use crate::quant::QuantMatrix;
        let (c, n) = (8, 6);
        for arch in [Arch::Gpt, Arch::Llama] {
            let cfg = cfg(2, Some(7), true);
            let (f, p) = ffn(arch, &cfg, c);
            let lin = f.linears();
            let per_mlp = if arch == Arch::Llama { 3 } else { 2 };
            assert_eq!(lin.len(), per_mlp * (cfg.num_experts + 2), "{arch:?}: every MLP's matrices");
            assert!(lin.iter().all(|l| l.moe && l.weight.len() == l.ic * l.oc));
            assert!(lin.iter().all(|l| !l.weight.contains(&f.router.start)), "{arch:?}: the router stays f32");
            let (mut q, mut deq) = (QuantUnit::new(), p.clone());
            for l in &lin {
                let w = &p[l.weight.clone()];
                let m = QuantMatrix::from_in_out(w, l.ic, l.oc);
                let back = m.dequantize();
                for (k, (a, b)) in w.iter().zip(&back).enumerate() {
                    let bound = 0.5 * m.scales()[k % l.oc] * (1.0 + 1e-5);
                    assert!((a - b).abs() <= bound, "{arch:?} {:?}[{k}]: {a} vs {b}, bound {bound}", l.weight);
                }
                deq[l.weight.clone()].copy_from_slice(&back);
                q.insert(l.weight.start, m);
            }
            let h = randn(9, n * c, 1.0);
            let (mut got, mut want, mut plain) = (vec![0.0; n * c], vec![0.0; n * c], vec![0.0; n * c]);
            f.forward_with(&p, Some(&q), &h, &mut got, &mut None, None);
            f.forward(&deq, &h, &mut want, &mut None, None);
            f.forward(&p, &h, &mut plain, &mut None, None);
            let (e, e_f32) = (crate::gradcheck::rel_err(&got, &want), crate::gradcheck::rel_err(&got, &plain));
            assert!(e < 1e-5, "{arch:?}: int8 forward vs the dequantized weights' f32 forward: rel err {e:e}");
            assert!(e_f32 > 1e-6 && e_f32 < 2e-2, "{arch:?}: int8 forward vs the f32 weights: rel err {e_f32:e}");
        }
    }

    /// The residual mix is DeepSpeed's: `y = q₀·experts + q₁·mlp` with `q = softmax(h·W + b)`;
    /// with the mixer's bias pushing all weight to the MLP, the block is the MLP alone.
    #[test]
    fn the_residual_mix_weighs_the_experts_and_the_mlp() {
        let (c, n) = (4, 3);
        let cfg = cfg(2, None, true);
        let (f, mut p) = ffn(Arch::Gpt, &cfg, c);
        let r = f.residual.clone().unwrap();
        p[r.coef_w.clone()].fill(0.0);
        p[r.coef_b.clone()].copy_from_slice(&[-40.0, 40.0]);
        let h = randn(7, n * c, 1.0);
        let mut y = vec![0.0; n * c];
        f.forward(&p, &h, &mut y, &mut None, None);
        let want = r.mlp.forward(&p, 0, &h, c, &mut Vec::new(), None);
        assert!(y.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-6), "{y:?} vs {want:?}");
        // Equal logits: the mean of the two.
        p[r.coef_b.clone()].fill(0.0);
        let mut y_half = vec![0.0; n * c];
        let mut acts = None;
        f.forward(&p, &h, &mut y_half, &mut acts, None);
        let moe_out = &acts.as_ref().unwrap().residual.as_ref().unwrap().moe_out;
        for i in 0..n * c {
            assert!((y_half[i] - 0.5 * (moe_out[i] + want[i])).abs() < 1e-6);
        }
    }
}
