//! Mixture-of-experts routing, forward and backward: the router's choice of `k` experts per
//! token ([`route`]), each expert's rows in token order ([`dispatch`]), the weighted sum of the
//! experts' outputs ([`combine`]), and the router losses (transformers' load-balancing loss
//! over every MoE block of a micro-batch, [`AuxCounts`]; the ST-MoE z-loss, [`z_loss`]).
//! The experts' MLPs run in between, one expert at a time, wherever an
//! [`crate::experts::ExpertRunner`] puts them.
//!
//! Everything is a pure function of the token rows, in f32, in a fixed order: a token's choice,
//! its weights and its output do not depend on other micro-batches, threads or placement.

use crate::model::Gating;
use crate::tensor::exp_f32;

/// A micro-batch's routing at one MoE block: `n` tokens, `e` experts, `k` choices a token.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Routing {
    pub n: usize,
    pub e: usize,
    pub k: usize,
    /// Softmax of each token's router logits `[n, e]` (what the load-balancing loss reads).
    pub probs: Vec<f32>,
    /// The chosen experts `[n, k]`, best first (ties: the lower index).
    pub idx: Vec<usize>,
    /// Their weights `[n, k]`.
    pub w: Vec<f32>,
    /// For each (token, choice), the row of that token in its expert's rows `[n, k]`.
    pub row: Vec<usize>,
    /// Rows per expert.
    pub counts: Vec<usize>,
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

/// Routes `n` tokens by their router logits `[n, e]`: `SoftmaxThenTopK` takes the top `k` of
/// the softmax over every expert (Mixtral, Qwen2-MoE), `TopKThenSoftmax` the softmax over the
/// top `k` logits; `norm_topk` rescales the chosen weights to sum to one.
pub fn route(logits: &[f32], n: usize, e: usize, k: usize, gating: Gating, norm_topk: bool) -> Routing {
    assert_eq!(logits.len(), n * e, "route: logits must be [n, e]");
    assert!(k >= 1 && k <= e, "route: top {k} of {e} experts");
    let mut probs = vec![0.0f32; n * e];
    let (mut idx, mut w) = (Vec::with_capacity(n * k), Vec::with_capacity(n * k));
    for t in 0..n {
        let l = &logits[t * e..(t + 1) * e];
        let p = &mut probs[t * e..(t + 1) * e];
        softmax(p, l);
        let chosen = match gating {
            Gating::SoftmaxThenTopK => top_k(p, k),
            Gating::TopKThenSoftmax => top_k(l, k),
        };
        let mut wt: Vec<f32> = match gating {
            Gating::SoftmaxThenTopK => chosen.iter().map(|&x| p[x]).collect(),
            Gating::TopKThenSoftmax => {
                let sel: Vec<f32> = chosen.iter().map(|&x| l[x]).collect();
                let mut out = vec![0.0; k];
                softmax(&mut out, &sel);
                out
            }
        };
        if norm_topk && gating == Gating::SoftmaxThenTopK {
            let s: f32 = wt.iter().sum();
            wt.iter_mut().for_each(|x| *x /= s);
        }
        idx.extend(chosen);
        w.extend(wt);
    }
    let mut counts = vec![0usize; e];
    let row = idx
        .iter()
        .map(|&x| {
            counts[x] += 1;
            counts[x] - 1
        })
        .collect();
    Routing { n, e, k, probs, idx, w, row, counts }
}

/// d(logits) `[n, e]` for d(weights) `dw` `[n, k]` plus, with `dprob`, a gradient on every
/// token's softmax probabilities `[e]` (the load-balancing loss's, the same for each token).
/// Overwrites `dlogits`.
pub fn route_backward(dlogits: &mut [f32], r: &Routing, dw: &[f32], dprob: Option<&[f32]>, gating: Gating, norm_topk: bool) {
    let (n, e, k) = (r.n, r.e, r.k);
    assert!(dlogits.len() == n * e && dw.len() == n * k, "route_backward: shapes");
    let mut dp = vec![0.0f32; e];
    for t in 0..n {
        let p = &r.probs[t * e..(t + 1) * e];
        let (idx, w, dwt) = (&r.idx[t * k..(t + 1) * k], &r.w[t * k..(t + 1) * k], &dw[t * k..(t + 1) * k]);
        let dl = &mut dlogits[t * e..(t + 1) * e];
        dl.fill(0.0);
        match gating {
            Gating::SoftmaxThenTopK => {
                dp.fill(0.0);
                if norm_topk {
                    // w_i = p_i / S:  dp_i = (dw_i − Σ_j dw_j w_j) / S.
                    let s: f32 = idx.iter().map(|&x| p[x]).sum();
                    let dot: f32 = dwt.iter().zip(w).map(|(a, b)| a * b).sum();
                    for (j, &x) in idx.iter().enumerate() {
                        dp[x] = (dwt[j] - dot) / s;
                    }
                } else {
                    for (j, &x) in idx.iter().enumerate() {
                        dp[x] = dwt[j];
                    }
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
                let dot: f32 = dwt.iter().zip(w).map(|(a, b)| a * b).sum();
                for (j, &x) in idx.iter().enumerate() {
                    dl[x] = w[j] * (dwt[j] - dot);
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
        for j in 0..r.k {
            rows[r.idx[t * r.k + j]].extend_from_slice(&x[t * c..(t + 1) * c]);
        }
    }
    rows
}

/// `dx[t] += Σ_j d_rows[idx[t, j]][row[t, j]]`, choices in order.
pub fn dispatch_backward(dx: &mut [f32], d_rows: &[Vec<f32>], r: &Routing, c: usize) {
    for t in 0..r.n {
        let d = &mut dx[t * c..(t + 1) * c];
        for j in 0..r.k {
            let (x, at) = (r.idx[t * r.k + j], r.row[t * r.k + j]);
            d.iter_mut().zip(&d_rows[x][at * c..(at + 1) * c]).for_each(|(a, b)| *a += b);
        }
    }
}

/// `y[t] = Σ_j w[t, j] · outs[idx[t, j]][row[t, j]]`, choices in order. Overwrites `y`.
pub fn combine(y: &mut [f32], outs: &[Vec<f32>], r: &Routing, c: usize) {
    for t in 0..r.n {
        let yt = &mut y[t * c..(t + 1) * c];
        yt.fill(0.0);
        for j in 0..r.k {
            let (x, at, w) = (r.idx[t * r.k + j], r.row[t * r.k + j], r.w[t * r.k + j]);
            yt.iter_mut().zip(&outs[x][at * c..(at + 1) * c]).for_each(|(a, b)| *a += w * b);
        }
    }
}

/// The backward of [`combine`]: each expert's output-row gradients and d(weights) `[n, k]`.
pub fn combine_backward(dy: &[f32], outs: &[Vec<f32>], r: &Routing, c: usize) -> (Vec<Vec<f32>>, Vec<f32>) {
    let mut d_outs: Vec<Vec<f32>> = r.counts.iter().map(|&m| vec![0.0; m * c]).collect();
    let mut dw = vec![0.0f32; r.n * r.k];
    for t in 0..r.n {
        let d = &dy[t * c..(t + 1) * c];
        for j in 0..r.k {
            let (x, at, w) = (r.idx[t * r.k + j], r.row[t * r.k + j], r.w[t * r.k + j]);
            let o = &outs[x][at * c..(at + 1) * c];
            dw[t * r.k + j] = d.iter().zip(o).map(|(a, b)| a * b).sum();
            d_outs[x][at * c..(at + 1) * c].iter_mut().zip(d).for_each(|(a, b)| *a = w * b);
        }
    }
    (d_outs, dw)
}

/// What an MoE block keeps from its forward for its backward.
#[derive(Debug, Default)]
pub struct MoeActs {
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
}

impl MoeActs {
    pub fn bytes(&self) -> usize {
        let rows: usize =
            self.outs.iter().map(Vec::capacity).sum::<usize>() + self.expert_acts.iter().flatten().map(Vec::capacity).sum::<usize>();
        4 * (self.logits.capacity() + self.routing.probs.capacity() + rows)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check_grad, randn, weighted_sum};

    #[test]
    fn routing_picks_the_top_k_and_counts_rows() {
        // Token 0 prefers 2 then 0; token 1 ties 1 and 3 (lower index first).
        let logits = [1.0, -1.0, 2.0, 0.0, 0.0, 1.0, -2.0, 1.0];
        let r = route(&logits, 2, 4, 2, Gating::SoftmaxThenTopK, true);
        assert_eq!(r.idx, vec![2, 0, 1, 3]);
        assert!((r.w[0] + r.w[1] - 1.0).abs() < 1e-6 && r.w[0] > r.w[1]);
        assert_eq!((r.w[2], r.w[3]), (0.5, 0.5));
        assert_eq!(r.counts, vec![1, 1, 1, 1]);
        assert_eq!(r.row, vec![0, 0, 0, 0]);
        let x: Vec<f32> = (0..6).map(|v| v as f32).collect();
        let rows = dispatch(&x, &r, 3);
        assert_eq!(rows[2], vec![0.0, 1.0, 2.0]);
        assert_eq!(rows[3], vec![3.0, 4.0, 5.0]);
    }

    /// d(Σ_t,j a·w + Σ b·(combined y)) through route and combine matches finite differences,
    /// for both gatings, with and without renormalisation and the aux gradient.
    #[test]
    fn routing_and_combining_match_finite_differences() {
        let (n, e, k, c) = (5, 4, 2, 3);
        let logits = randn(1, n * e, 1.0);
        let outs_flat = randn(2, n * k * c, 1.0);
        let wy = randn(3, n * c, 1.0);
        let extra = randn(4, e, 0.3);
        for gating in [Gating::SoftmaxThenTopK, Gating::TopKThenSoftmax] {
            for norm in [false, true] {
                let r0 = route(&logits, n, e, k, gating, norm);
                // Expert outputs: fixed per (expert, row) from outs_flat.
                let outs_of = |r: &Routing| -> Vec<Vec<f32>> {
                    r.counts
                        .iter()
                        .enumerate()
                        .map(|(x, &m)| (0..m * c).map(|i| outs_flat[(x * 7 + i) % outs_flat.len()]).collect())
                        .collect()
                };
                let f = |l: &[f32]| {
                    let r = route(l, n, e, k, gating, norm);
                    let mut y = vec![0.0; n * c];
                    combine(&mut y, &outs_of(&r), &r, c);
                    let probs_term: f64 = (0..n).map(|t| weighted_sum(&r.probs[t * e..(t + 1) * e], &extra)).sum();
                    weighted_sum(&y, &wy) + probs_term
                };
                let (_, dw) = combine_backward(&wy, &outs_of(&r0), &r0, c);
                let mut dl = vec![0.0; n * e];
                route_backward(&mut dl, &r0, &dw, Some(&extra), gating, norm);
                check_grad(f, &logits, &dl, 1e-3, 2e-2).unwrap_or_else(|m| panic!("{gating:?} norm {norm}: {m}"));
            }
        }
    }

    #[test]
    fn the_aux_and_z_losses_match_finite_differences() {
        let (n, e, k) = (6, 4, 2);
        let logits = randn(5, n * e, 1.0);
        // Aux: the counts are constant under a small change of the logits; only the probs move.
        let r = route(&logits, n, e, k, Gating::SoftmaxThenTopK, true);
        let mut a = AuxCounts::default();
        a.add(&r);
        let f = |l: &[f32]| {
            let r2 = route(l, n, e, k, Gating::SoftmaxThenTopK, true);
            let mut b = AuxCounts { counts: a.counts.clone(), prob_sums: vec![0.0; e], rows: 0 };
            for t in 0..n {
                for x in 0..e {
                    b.prob_sums[x] += f64::from(r2.probs[t * e + x]);
                }
            }
            b.rows = n;
            f64::from(b.loss()) + 0.5 * f64::from(z_loss(l, n, e))
        };
        let mut dl = vec![0.0; n * e];
        route_backward(&mut dl, &r, &vec![0.0; n * k], Some(&a.dprob(1.0)), Gating::SoftmaxThenTopK, true);
        z_loss_backward(&mut dl, &logits, &r.probs, n, e, 0.5);
        // (A large step: both losses are smooth here, and f32 rounding of a loss near 1 is
        // ~1e-7, which a small step would turn into noise.)
        check_grad(f, &logits, &dl, 1e-2, 2e-2).unwrap();
        // A uniform router gives the loss's minimum, k.
        let u = route(&vec![0.0; n * e], n, e, k, Gating::SoftmaxThenTopK, true);
        let mut b = AuxCounts::default();
        b.add(&u);
        assert!(b.loss() > 0.0);
    }

    #[test]
    fn dispatch_backward_adds_each_choice_in_order() {
        let logits = [0.0, 1.0, 2.0, 2.0, 1.0, 0.0];
        let r = route(&logits, 2, 3, 2, Gating::SoftmaxThenTopK, false);
        let d_rows = vec![vec![1.0, 1.0], vec![2.0, 2.0, 3.0, 3.0], vec![4.0, 4.0]];
        let mut dx = vec![0.0; 4];
        dispatch_backward(&mut dx, &d_rows, &r, 2);
        // Token 0: experts 2 then 1 (row 0); token 1: experts 0 then 1 (row 1).
        assert_eq!(dx, vec![6.0, 6.0, 4.0, 4.0]);
    }
}
