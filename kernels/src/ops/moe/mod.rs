//! Mixture-of-experts routing, forward and backward: the router's choice of `k` experts per
//! token ([`route`], [`route_with`] for capacity and noise), each expert's rows in token order
//! ([`dispatch`]), the weighted sum of the experts' outputs ([`combine`]), and the router losses
//! (transformers' load-balancing loss over every MoE block of a micro-batch, [`AuxCounts`];
//! DeepSpeed's per-block `l_aux`, [`aux_per_layer`]; the ST-MoE z-loss, [`z_loss`]).
//! The experts' MLPs run in between, one expert at a time, wherever an
//! [`crate::experts::ExpertRunner`] puts them. `capacity.rs`: DeepSpeed's expert capacity and
//! the seeded noise (Jitter, Gumbel, the random token order).
//!
//! Everything is a pure function of the token rows (and, for the noisy policies, of the
//! micro-batch's noise key and the block), in f32, in a fixed order: a token's choice, its
//! weights and its output do not depend on threads or placement, and — without capacity — on no
//! other token.

pub mod capacity;
#[cfg(test)]
mod tests;

pub use capacity::{capacity, NoiseKey};

use crate::model::{Capacity, Gating};
use crate::tensor::exp_f32;

/// A micro-batch's routing at one MoE block: `n` tokens, `e` experts, `k` choices a token.
/// Per-(token, choice) arrays are `[n, k]`, choice `j` of token `t` at `t·k + j`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Routing {
    pub n: usize,
    pub e: usize,
    pub k: usize,
    /// Softmax of each token's (noise-free) router logits `[n, e]` (what the load-balancing
    /// losses read).
    pub probs: Vec<f32>,
    /// The chosen experts `[n, k]`, best first (ties: the lower index); distinct per token.
    pub idx: Vec<usize>,
    /// Each choice's gate before drops: `probs[t, idx]` (softmax then top-k) or the softmax
    /// over the token's chosen logits (top-k then softmax).
    pub gate: Vec<f32>,
    /// The combine weights `[n, k]` (0 for a dropped choice).
    pub w: Vec<f32>,
    /// Whether each choice got a capacity slot (all, when dropless).
    pub kept: Vec<bool>,
    /// For each kept (token, choice), the row of that token in its expert's rows
    /// (`usize::MAX` when dropped).
    pub row: Vec<usize>,
    /// Rows per expert (kept choices).
    pub counts: Vec<usize>,
    /// Slots per expert, when a capacity applies.
    pub capacity: Option<usize>,
}

impl Routing {
    /// (token, choice) pairs dropped for capacity.
    pub fn dropped(&self) -> usize {
        self.kept.iter().filter(|&&k| !k).count()
    }

    /// Whether token `t`'s weights are its kept gates divided by their sum (see [`route_with`]).
    fn renormed(&self, t: usize, gating: Gating, norm_topk: bool) -> bool {
        norm_topk && (gating == Gating::SoftmaxThenTopK || self.kept[t * self.k..(t + 1) * self.k].contains(&false))
    }
}

/// How one block routes in one pass (training or evaluation): what [`route_with`] reads.
#[derive(Clone, Copy, Debug)]
pub struct RouteSpec {
    pub e: usize,
    pub k: usize,
    pub gating: Gating,
    pub norm_topk: bool,
    /// The capacity and this pass's factor (training or evaluation).
    pub capacity: Option<(Capacity, f32)>,
    /// RSample: Gumbel noise on the logits for the choice (training only).
    pub gumbel: Option<NoiseKey>,
    /// Random token selection: capacity slots filled in a seeded token order (training only).
    pub rts: Option<NoiseKey>,
}

/// Softmax of `x` into `out` (max subtracted, summed left to right).
fn softmax(out: &mut [f32], x: &[f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut s = 0.0f32;
    for (o, &v) in out.iter_mut().zip(x) {
        *o = exp_f32(v - m);
        s += *o;
    }
    let inv = 1.0 / s;
    out.iter_mut().for_each(|o| *o *= inv);
}

/// The `k` largest of `x`, largest first, ties to the lower index.
fn top_k(x: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..x.len()).collect();
    order.sort_by(|&a, &b| x[b].total_cmp(&x[a]).then(a.cmp(&b)));
    order.truncate(k);
    order
}

/// Dropless, noise-free routing of `n` tokens by their router logits `[n, e]`:
/// [`route_with`] without capacity or noise.
pub fn route(logits: &[f32], n: usize, e: usize, k: usize, gating: Gating, norm_topk: bool) -> Routing {
    route_with(logits, n, &RouteSpec { e, k, gating, norm_topk, capacity: None, gumbel: None, rts: None })
}

/// Routes `n` tokens by their router logits `[n, e]`:
/// 1. The choice: `SoftmaxThenTopK` takes the top `k` of the softmax over every expert
///    (Mixtral, Qwen2-MoE, DeepSpeed), `TopKThenSoftmax` the top `k` logits; ties to the lower
///    index. With RSample (`spec.gumbel`) the choice reads `logits + Gumbel noise` instead:
///    every choice when k = 1 (DeepSpeed's `top1gating`), every choice but the first when
///    k ≥ 2 (DeepSpeed's `top2gating` samples its second expert so).
/// 2. The gate of a choice: its probability (softmax then top-k) or the softmax over the
///    token's chosen (noise-free) logits (top-k then softmax).
/// 3. Capacity with `drop_tokens` ([`capacity::assign`]): slots go to every token's first
///    choice, in token order (or the seeded permutation under RTS), then every second choice,
///    …; a choice whose expert is full is dropped. Without `drop_tokens` nothing is dropped
///    (the capacity is only reported).
/// 4. The weights: with `norm_topk`, the kept gates divided by their sum (clamped below at
///    f32's epsilon, as DeepSpeed's top-2 clamps its denominator) — always for softmax then
///    top-k, and for top-k then softmax only for a token that lost a choice (its gates already
///    sum to one otherwise); without `norm_topk`, the kept gates as they are. A dropped choice
///    weighs 0, so a token with every choice dropped gets 0 from the experts (the residual
///    stream carries it).
pub fn route_with(logits: &[f32], n: usize, spec: &RouteSpec) -> Routing {
    let (e, k, gating) = (spec.e, spec.k, spec.gating);
    assert_eq!(logits.len(), n * e, "route: logits must be [n, e]");
    assert!(k >= 1 && k <= e, "route: top {k} of {e} experts");
    let mut probs = vec![0.0f32; n * e];
    let (mut idx, mut gate) = (Vec::with_capacity(n * k), Vec::with_capacity(n * k));
    let noise = spec.gumbel.map(|key| key.gumbel(n * e));
    let mut noisy = vec![0.0f32; e];
    for t in 0..n {
        let l = &logits[t * e..(t + 1) * e];
        let p = &mut probs[t * e..(t + 1) * e];
        softmax(p, l);
        let clean = match gating {
            Gating::SoftmaxThenTopK => top_k(p, k),
            Gating::TopKThenSoftmax => top_k(l, k),
        };
        let chosen = match &noise {
            None => clean,
            Some(g) => {
                noisy.iter_mut().zip(l.iter().zip(&g[t * e..(t + 1) * e])).for_each(|(o, (a, b))| *o = a + b);
                if k == 1 {
                    top_k(&noisy, 1)
                } else {
                    // The clean first choice, then the best noisy logits among the others.
                    noisy[clean[0]] = f32::NEG_INFINITY;
                    let mut ch = vec![clean[0]];
                    ch.extend(top_k(&noisy, k - 1));
                    ch
                }
            }
        };
        match gating {
            Gating::SoftmaxThenTopK => gate.extend(chosen.iter().map(|&x| p[x])),
            Gating::TopKThenSoftmax => {
                let sel: Vec<f32> = chosen.iter().map(|&x| l[x]).collect();
                let mut out = vec![0.0; k];
                softmax(&mut out, &sel);
                gate.extend(out);
            }
        }
        idx.extend(chosen);
    }
    let (kept, cap) = match spec.capacity {
        Some((c, factor)) => {
            let slots = capacity(n, e, k, factor, c.min_capacity);
            let kept = match c.drop_tokens {
                true => capacity::assign(&idx, n, e, k, slots, spec.rts.map(|key| key.permutation(n)).as_deref()),
                false => vec![true; n * k],
            };
            (kept, Some(slots))
        }
        None => (vec![true; n * k], None),
    };
    let mut r =
        Routing { n, e, k, probs, idx, gate, w: vec![0.0; n * k], kept, row: vec![usize::MAX; n * k], counts: vec![0; e], capacity: cap };
    for t in 0..n {
        let renorm = r.renormed(t, gating, spec.norm_topk);
        let (g, kp) = (&r.gate[t * k..(t + 1) * k], &r.kept[t * k..(t + 1) * k]);
        let s: f32 = g.iter().zip(kp).filter(|(_, &kp)| kp).map(|(g, _)| g).sum();
        let s = s.max(f32::EPSILON);
        for j in 0..k {
            if kp[j] {
                r.w[t * k + j] = if renorm { g[j] / s } else { g[j] };
            }
        }
    }
    for i in 0..n * k {
        if r.kept[i] {
            let x = r.idx[i];
            r.row[i] = r.counts[x];
            r.counts[x] += 1;
        }
    }
    r
}

/// d(logits) `[n, e]` for d(weights) `dw` `[n, k]` plus, with `dprob`, a gradient on every
/// token's softmax probabilities `[e]` (the load-balancing losses', the same for each token).
/// Overwrites `dlogits`. The noise and the drops are constants of the routing.
pub fn route_backward(dlogits: &mut [f32], r: &Routing, dw: &[f32], dprob: Option<&[f32]>, gating: Gating, norm_topk: bool) {
    let (n, e, k) = (r.n, r.e, r.k);
    assert!(dlogits.len() == n * e && dw.len() == n * k, "route_backward: shapes");
    let mut dp = vec![0.0f32; e];
    let mut dg = vec![0.0f32; k];
    for t in 0..n {
        let p = &r.probs[t * e..(t + 1) * e];
        let (idx, w, dwt) = (&r.idx[t * k..(t + 1) * k], &r.w[t * k..(t + 1) * k], &dw[t * k..(t + 1) * k]);
        let (g, kp) = (&r.gate[t * k..(t + 1) * k], &r.kept[t * k..(t + 1) * k]);
        // d(gates) through step 4: w_i = g_i / S over the kept ones:
        // dg_i = (dw_i − Σ_j dw_j w_j) / S (dw_i / ε where S is clamped).
        dg.fill(0.0);
        if r.renormed(t, gating, norm_topk) {
            let s: f32 = g.iter().zip(kp).filter(|(_, &kp)| kp).map(|(g, _)| g).sum();
            let dot: f32 = if s < f32::EPSILON { 0.0 } else { dwt.iter().zip(w).map(|(a, b)| a * b).sum() };
            let s = s.max(f32::EPSILON);
            for j in (0..k).filter(|&j| kp[j]) {
                dg[j] = (dwt[j] - dot) / s;
            }
        } else {
            (0..k).filter(|&j| kp[j]).for_each(|j| dg[j] = dwt[j]);
        }
        let dl = &mut dlogits[t * e..(t + 1) * e];
        dl.fill(0.0);
        match gating {
            Gating::SoftmaxThenTopK => {
                dp.fill(0.0);
                for (j, &x) in idx.iter().enumerate() {
                    dp[x] = dg[j];
                }
                if let Some(extra) = dprob {
                    dp.iter_mut().zip(extra).for_each(|(a, b)| *a += b);
                }
                // Softmax backward: dl = p ⊙ (dp − Σ p·dp).
                let dot: f32 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                for x in 0..e {
                    dl[x] = p[x] * (dp[x] - dot);
                }
            }
            Gating::TopKThenSoftmax => {
                let dot: f32 = dg.iter().zip(g).map(|(a, b)| a * b).sum();
                for (j, &x) in idx.iter().enumerate() {
                    dl[x] = g[j] * (dg[j] - dot);
                }
                if let Some(extra) = dprob {
                    let dot: f32 = p.iter().zip(extra).map(|(a, b)| a * b).sum();
                    for x in 0..e {
                        dl[x] += p[x] * (extra[x] - dot);
                    }
                }
            }
        }
    }
}

/// Each expert's input rows `[counts[x], c]`, tokens in order.
pub fn dispatch(x: &[f32], r: &Routing, c: usize) -> Vec<Vec<f32>> {
    let mut rows: Vec<Vec<f32>> = r.counts.iter().map(|&m| Vec::with_capacity(m * c)).collect();
    for t in 0..r.n {
        for j in (0..r.k).filter(|&j| r.kept[t * r.k + j]) {
            rows[r.idx[t * r.k + j]].extend_from_slice(&x[t * c..(t + 1) * c]);
        }
    }
    rows
}

/// `dx[t] += Σ_j d_rows[idx[t, j]][row[t, j]]` over the kept choices, in order.
pub fn dispatch_backward(dx: &mut [f32], d_rows: &[Vec<f32>], r: &Routing, c: usize) {
    for t in 0..r.n {
        let d = &mut dx[t * c..(t + 1) * c];
        for j in (0..r.k).filter(|&j| r.kept[t * r.k + j]) {
            let (x, at) = (r.idx[t * r.k + j], r.row[t * r.k + j]);
            d.iter_mut().zip(&d_rows[x][at * c..(at + 1) * c]).for_each(|(a, b)| *a += b);
        }
    }
}

/// `y[t] = Σ_j w[t, j] · outs[idx[t, j]][row[t, j]]` over the kept choices, in order, from
/// zero (a token with every choice dropped gets zero). Overwrites `y`.
pub fn combine(y: &mut [f32], outs: &[Vec<f32>], r: &Routing, c: usize) {
    for t in 0..r.n {
        let yt = &mut y[t * c..(t + 1) * c];
        yt.fill(0.0);
        for j in (0..r.k).filter(|&j| r.kept[t * r.k + j]) {
            let (x, at, w) = (r.idx[t * r.k + j], r.row[t * r.k + j], r.w[t * r.k + j]);
            yt.iter_mut().zip(&outs[x][at * c..(at + 1) * c]).for_each(|(a, b)| *a += w * b);
        }
    }
}

/// The backward of [`combine`]: each expert's output-row gradients and d(weights) `[n, k]`
/// (0 for dropped choices).
pub fn combine_backward(dy: &[f32], outs: &[Vec<f32>], r: &Routing, c: usize) -> (Vec<Vec<f32>>, Vec<f32>) {
    let mut d_outs: Vec<Vec<f32>> = r.counts.iter().map(|&m| vec![0.0; m * c]).collect();
    let mut dw = vec![0.0f32; r.n * r.k];
    for t in 0..r.n {
        let d = &dy[t * c..(t + 1) * c];
        for j in (0..r.k).filter(|&j| r.kept[t * r.k + j]) {
            let (x, at, w) = (r.idx[t * r.k + j], r.row[t * r.k + j], r.w[t * r.k + j]);
            let o = &outs[x][at * c..(at + 1) * c];
            dw[t * r.k + j] = d.iter().zip(o).map(|(a, b)| a * b).sum();
            d_outs[x][at * c..(at + 1) * c].iter_mut().zip(d).for_each(|(a, b)| *a = w * b);
        }
    }
    (d_outs, dw)
}

/// The pass an MoE block runs in, set by the model before its forward.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MoePass {
    /// Training (noise, the training capacity factor) or evaluation (neither).
    pub training: bool,
    /// The micro-batch's noise key (`MicroBatch::noise_key`; the noisy policies and RTS read
    /// it when training).
    pub noise_key: u64,
    /// The block's index (keys its noise streams).
    pub block: usize,
}

/// What an MoE block keeps from its forward for its backward.
#[derive(Debug, Default)]
pub struct MoeActs {
    /// The pass (set by the model before the forward; kept through it).
    pub pass: MoePass,
    /// The Jitter multipliers of the router's input (empty without Jitter).
    pub jitter: Vec<f32>,
    /// The router's logits `[n, e]` and the routing they gave.
    pub logits: Vec<f32>,
    pub routing: Routing,
    /// Each expert's output rows.
    pub outs: Vec<Vec<f32>>,
    /// The experts' saved activations when they run in the block ([`crate::experts::LocalExperts`]).
    pub expert_acts: Vec<crate::experts::ExpertActs>,
    /// Set by the model before the block's backward: d(objective)/d(each token's probability
    /// of expert x), from the load-balancing loss over every block (`None`: no such loss).
    pub dprob: Option<Vec<f32>>,
    /// The z-loss weight in the objective, times the backward's loss scale (set with `dprob`).
    pub z_coef: f32,
    /// This block's z-loss (forward).
    pub z: f32,
    /// The residual MLP's forward (DeepSpeed's `use_residual`), when the block has one.
    pub residual: Option<crate::moe_ffn::ResidualActs>,
}

impl MoeActs {
    pub fn bytes(&self) -> usize {
        let rows: usize =
            self.outs.iter().map(Vec::capacity).sum::<usize>() + self.expert_acts.iter().flatten().map(Vec::capacity).sum::<usize>();
        4 * (self.logits.capacity() + self.routing.probs.capacity() + self.jitter.capacity() + rows)
            + self.residual.as_ref().map_or(0, |r| r.bytes())
    }
}

/// transformers' `load_balancing_loss_func` over the MoE blocks of one micro-batch, summed as
/// it goes: each expert's number of (token, choice) assignments and its summed probability, and
/// the rows seen. `aux = E · Σ_x (count_x / R) · (prob_x / R)`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AuxCounts {
    pub counts: Vec<f64>,
    pub prob_sums: Vec<f64>,
    pub rows: usize,
}

impl AuxCounts {
    /// Adds one block's routing.
    pub fn add(&mut self, r: &Routing) {
        self.counts.resize(r.e, 0.0);
        self.prob_sums.resize(r.e, 0.0);
        for &x in &r.idx {
            self.counts[x] += 1.0;
        }
        for t in 0..r.n {
            for x in 0..r.e {
                self.prob_sums[x] += f64::from(r.probs[t * r.e + x]);
            }
        }
        self.rows += r.n;
    }

    /// The loss.
    pub fn loss(&self) -> f32 {
        let (e, rows) = (self.counts.len() as f64, self.rows.max(1) as f64);
        (e * self.counts.iter().zip(&self.prob_sums).map(|(c, p)| c / rows * (p / rows)).sum::<f64>()) as f32
    }

    /// d(loss)/d(prob of expert x) for any token of any block, times `coef`: `coef·E·count_x/R²`.
    pub fn dprob(&self, coef: f32) -> Vec<f32> {
        let (e, rows) = (self.counts.len() as f64, self.rows.max(1) as f64);
        self.counts.iter().map(|c| (f64::from(coef) * e * c / (rows * rows)) as f32).collect()
    }
}

/// DeepSpeed's per-block `l_aux` (GShard/Switch) and `∂l_aux/∂probs[t, x]` (the same for
/// every token): with `me` the mean probability of each expert and `ce` the fraction of tokens
/// choosing it (before drops), k = 1: `E·Σ me·ce` over first choices (`top1gating`); k = 2:
/// the same, first choices only (`top2gating`: `mean(me·ce)·E²`); k ≥ 3: `E/k·Σ me·ce` over
/// every choice (`topkgating`: `mean(me·ce)·E²/k`).
pub fn aux_per_layer(r: &Routing) -> (f32, Vec<f32>) {
    let (n, e, k) = (r.n, r.e, r.k);
    if n == 0 {
        return (0.0, vec![0.0; e]);
    }
    let mut counts = vec![0.0f64; e];
    let scale = if k <= 2 {
        r.idx.chunks(k).for_each(|ch| counts[ch[0]] += 1.0);
        e as f64
    } else {
        r.idx.iter().for_each(|&x| counts[x] += 1.0);
        e as f64 / k as f64
    };
    let mut me = vec![0.0f64; e];
    for t in 0..n {
        me.iter_mut().zip(&r.probs[t * e..(t + 1) * e]).for_each(|(m, &p)| *m += f64::from(p));
    }
    let nf = n as f64;
    let value = scale * me.iter().zip(&counts).map(|(m, c)| (m / nf) * (c / nf)).sum::<f64>();
    (value as f32, counts.iter().map(|c| (scale * c / (nf * nf)) as f32).collect())
}

/// One MoE block's routing in one micro-batch.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MoeBlockStats {
    /// The block's index in the stack.
    pub block: usize,
    /// Rows each expert received (kept (token, choice) pairs).
    pub tokens_per_expert: Vec<u32>,
    /// (token, choice) pairs dropped for capacity.
    pub dropped: usize,
    /// Slots per expert, when a capacity applies.
    pub capacity: Option<usize>,
    /// The block's load-balancing loss on its own: DeepSpeed's `l_aux` (per-layer), or
    /// `load_balancing_loss_func` over this block alone (across-layers; informative — the
    /// objective's is [`MoeStats::aux_loss`]).
    pub aux: f32,
    /// The block's router z-loss, `mean_t logsumexp(logits_t)²`.
    pub z: f32,
}

/// What the MoE blocks did in one forward (a micro-batch), in block order, and the auxiliary
/// terms of the training objective `ce + aux_loss_coef·aux_loss + z_loss_coef·z_loss`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MoeStats {
    pub blocks: Vec<MoeBlockStats>,
    /// The load-balancing loss: transformers' over every block together (across-layers) or
    /// the blocks' `l_aux` summed (per-layer).
    pub aux_loss: f32,
    /// The blocks' z-losses, summed.
    pub z_loss: f32,
    /// The across-layers loss's counts over every block.
    pub aux: AuxCounts,
}

impl MoeStats {
    /// Adds one block's routing (its z-loss `z`, its per-layer `l_aux` when `per_layer`).
    pub fn add(&mut self, block: usize, a: &MoeActs, per_layer: bool) {
        let r = &a.routing;
        let aux = if per_layer {
            aux_per_layer(r).0
        } else {
            let mut own = AuxCounts::default();
            own.add(r);
            own.loss()
        };
        self.aux.add(r);
        self.z_loss += a.z;
        self.aux_loss = if per_layer { self.aux_loss + aux } else { self.aux.loss() };
        self.blocks.push(MoeBlockStats {
            block,
            tokens_per_expert: r.counts.iter().map(|&c| c as u32).collect(),
            dropped: r.dropped(),
            capacity: r.capacity,
            aux,
            z: a.z,
        });
    }
}

/// ST-MoE's router z-loss of one block: the mean over tokens of `logsumexp(logits)²`.
pub fn z_loss(logits: &[f32], n: usize, e: usize) -> f32 {
    let mut s = 0.0f64;
    for t in 0..n {
        let lse = logsumexp(&logits[t * e..(t + 1) * e]);
        s += f64::from(lse * lse);
    }
    (s / n.max(1) as f64) as f32
}

/// `dlogits += coef · d(z_loss)/d(logits)` = `coef · 2·lse_t·softmax_t / n`.
pub fn z_loss_backward(dlogits: &mut [f32], logits: &[f32], probs: &[f32], n: usize, e: usize, coef: f32) {
    for t in 0..n {
        let lse = logsumexp(&logits[t * e..(t + 1) * e]);
        let f = coef * 2.0 * lse / n as f32;
        for x in 0..e {
            dlogits[t * e + x] += f * probs[t * e + x];
        }
    }
}

fn logsumexp(x: &[f32]) -> f32 {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    m + x.iter().map(|&v| exp_f32(v - m)).sum::<f32>().ln()
}
