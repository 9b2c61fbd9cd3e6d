//! Routing, dispatch, combine and the router losses: finite differences and properties.

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
                r.counts.iter().enumerate().map(|(x, &m)| (0..m * c).map(|i| outs_flat[(x * 7 + i) % outs_flat.len()]).collect()).collect()
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

fn spec(e: usize, k: usize, gating: Gating, norm_topk: bool) -> RouteSpec {
    RouteSpec { e, k, gating, norm_topk, capacity: None, gumbel: None, rts: None }
}

fn dropping(factor: f32, min_capacity: usize) -> Option<(Capacity, f32)> {
    Some((Capacity { train_factor: factor, eval_factor: 2.0, min_capacity, drop_tokens: true }, factor))
}

#[test]
fn capacity_formula() {
    // max(min_capacity, ceil(n / E · factor · k)).
    assert_eq!(capacity(16, 4, 2, 1.0, 0), 8);
    assert_eq!(capacity(10, 4, 1, 1.0, 0), 3);
    assert_eq!(capacity(10, 4, 2, 1.25, 0), 7);
    assert_eq!(capacity(10, 4, 1, 0.1, 4), 4);
    assert_eq!(capacity(0, 4, 2, 1.0, 0), 0);
}

/// DeepSpeed's rule written the other way round: the location of choice j of token t in its
/// expert is (every choice of rank < j of that expert) + (choices of rank j of tokens before t in
/// the slot order); the choice is kept when its location is below the capacity. Dropped choices
/// weigh 0, the kept ones are renormalised, and dispatch lists each expert's kept rows in token
/// order.
#[test]
fn drops_follow_deepspeeds_capacity_rule() {
    let (n, e, k) = (23, 4, 2);
    let logits = randn(5, n * e, 2.0);
    for rts in [None, Some(NoiseKey { key: 9, block: 2 })] {
        let s = RouteSpec { capacity: dropping(0.75, 2), rts, ..spec(e, k, Gating::SoftmaxThenTopK, true) };
        let r = route_with(&logits, n, &s);
        let slots = capacity(n, e, k, 0.75, 2);
        assert_eq!(r.capacity, Some(slots));
        let order: Vec<usize> = match rts {
            Some(key) => key.permutation(n).iter().map(|&t| t as usize).collect(),
            None => (0..n).collect(),
        };
        let rank: Vec<usize> = (0..n).map(|t| order.iter().position(|&u| u == t).unwrap()).collect();
        let mut dropped = 0;
        for t in 0..n {
            for j in 0..k {
                let x = r.idx[t * k + j];
                let earlier = (0..n).flat_map(|u| (0..j).map(move |i| (u, i))).filter(|&(u, i)| r.idx[u * k + i] == x).count();
                let before = (0..n).filter(|&u| rank[u] < rank[t] && r.idx[u * k + j] == x).count();
                let kept = earlier + before < slots;
                assert_eq!(r.kept[t * k + j], kept, "rts {rts:?}: token {t} choice {j}");
                dropped += usize::from(!kept);
                if !kept {
                    assert_eq!((r.w[t * k + j], r.row[t * k + j]), (0.0, usize::MAX));
                }
            }
            let kept: Vec<usize> = (0..k).filter(|&j| r.kept[t * k + j]).collect();
            if !kept.is_empty() {
                let s: f32 = kept.iter().map(|&j| r.w[t * k + j]).sum();
                assert!((s - 1.0).abs() < 1e-6, "kept weights renormalised: {s}");
            }
        }
        assert!(dropped > 0 && dropped == r.dropped());
        assert!(r.counts.iter().all(|&c| c <= slots));
        let x: Vec<f32> = (0..n).map(|t| t as f32).collect();
        let rows = dispatch(&x, &r, 1);
        for (xp, rows) in rows.iter().enumerate() {
            assert_eq!(rows.len(), r.counts[xp]);
            assert!(rows.windows(2).all(|w| w[0] < w[1]), "token order");
        }
        // Without drop_tokens nothing is dropped (the capacity is only reported).
        let keep = RouteSpec { capacity: Some((Capacity { drop_tokens: false, ..s.capacity.unwrap().0 }, 0.75)), ..s };
        let r2 = route_with(&logits, n, &keep);
        assert_eq!((r2.dropped(), r2.capacity), (0, Some(slots)));
    }
}

#[test]
fn a_token_whose_choices_are_all_dropped_gets_zero() {
    // Every token prefers expert 0 then 1; one slot each: the first choices fill expert 0 with
    // token 0, the second choices expert 1 with token 0 again; tokens 1.. lose both.
    let logits: Vec<f32> = (0..4).flat_map(|_| [3.0, 2.0, 0.0]).collect();
    let s = RouteSpec { capacity: dropping(0.1, 1), ..spec(3, 2, Gating::SoftmaxThenTopK, true) };
    let r = route_with(&logits, 4, &s);
    assert_eq!(r.kept, vec![true, true, false, false, false, false, false, false]);
    assert_eq!(&r.w[2..], &[0.0; 6]);
    assert_eq!(r.counts, vec![1, 1, 0]);
    let outs = vec![vec![1.0, 1.0], vec![2.0, 2.0], vec![]];
    let mut y = vec![9.0; 8];
    combine(&mut y, &outs, &r, 2);
    assert_eq!(&y[2..], &[0.0; 6]);
    assert!((r.w[0] + r.w[1] - 1.0).abs() < 1e-6);
}

/// d(Σ a·y) through route_with (drops, RTS, RSample noise fixed by its key) and combine, and a
/// per-token probability gradient, against finite differences: the drops and the noise are
/// constants of a small step.
#[test]
fn routing_with_drops_and_noise_matches_finite_differences() {
    let (n, e, c) = (9, 4, 3);
    let logits = randn(21, n * e, 1.0);
    let outs_flat = randn(22, 64 * c, 1.0);
    let wy = randn(23, n * c, 1.0);
    let extra = randn(24, e, 0.3);
    let key = NoiseKey { key: 3, block: 1 };
    for k in [1, 2, 3] {
        for gating in [Gating::SoftmaxThenTopK, Gating::TopKThenSoftmax] {
            for norm in [false, true] {
                let s = RouteSpec { capacity: dropping(0.8, 1), rts: Some(key), gumbel: Some(key), ..spec(e, k, gating, norm) };
                let r0 = route_with(&logits, n, &s);
                assert!(r0.dropped() > 0, "k {k}: some choice dropped");
                let outs_of = |r: &Routing| -> Vec<Vec<f32>> {
                    r.counts
                        .iter()
                        .enumerate()
                        .map(|(x, &m)| (0..m * c).map(|i| outs_flat[(x * 11 + i) % outs_flat.len()]).collect())
                        .collect()
                };
                let f = |l: &[f32]| {
                    let r = route_with(l, n, &s);
                    let mut y = vec![0.0; n * c];
                    combine(&mut y, &outs_of(&r), &r, c);
                    let probs_term: f64 = (0..n).map(|t| weighted_sum(&r.probs[t * e..(t + 1) * e], &extra)).sum();
                    weighted_sum(&y, &wy) + probs_term
                };
                let (_, dw) = combine_backward(&wy, &outs_of(&r0), &r0, c);
                let mut dl = vec![0.0; n * e];
                route_backward(&mut dl, &r0, &dw, Some(&extra), gating, norm);
                check_grad(f, &logits, &dl, 1e-3, 2e-2).unwrap_or_else(|m| panic!("k {k} {gating:?} norm {norm}: {m}"));
            }
        }
    }
}

#[test]
fn rsample_chooses_by_noisy_logits_and_weighs_by_clean_ones() {
    let (n, e) = (200, 4);
    let logits = randn(31, n * e, 0.3);
    let key = NoiseKey { key: 1, block: 0 };
    let clean = route_with(&logits, n, &spec(e, 2, Gating::SoftmaxThenTopK, false));
    let noisy = route_with(&logits, n, &RouteSpec { gumbel: Some(key), ..spec(e, 2, Gating::SoftmaxThenTopK, false) });
    // top-2: the first choice stays the clean one, the second is sampled.
    assert!((0..n).all(|t| noisy.idx[t * 2] == clean.idx[t * 2]));
    assert!((0..n).any(|t| noisy.idx[t * 2 + 1] != clean.idx[t * 2 + 1]));
    // Weights are the clean probabilities of the chosen experts.
    assert!((0..2 * n).all(|i| noisy.w[i] == noisy.probs[(i / 2) * e + noisy.idx[i]]));
    // top-1: the choice itself is sampled.
    let one = route_with(&logits, n, &RouteSpec { gumbel: Some(key), ..spec(e, 1, Gating::SoftmaxThenTopK, false) });
    assert!((0..n).any(|t| one.idx[t] != clean.idx[t * 2]));
    // The same key gives the same routing.
    assert_eq!(one, route_with(&logits, n, &RouteSpec { gumbel: Some(key), ..spec(e, 1, Gating::SoftmaxThenTopK, false) }));
}

#[test]
fn noise_is_a_function_of_key_and_block_only() {
    let a = NoiseKey { key: 5, block: 1 };
    assert_eq!(a.permutation(50), a.permutation(50));
    let mut sorted = a.permutation(50);
    sorted.sort_unstable();
    assert_eq!(sorted, (0..50).collect::<Vec<u32>>());
    assert_ne!(a.permutation(50), NoiseKey { key: 5, block: 2 }.permutation(50));
    assert_ne!(a.permutation(50), NoiseKey { key: 6, block: 1 }.permutation(50));
    let eps = capacity::JITTER_EPS;
    assert!(a.jitter(1000).iter().all(|&v| (1.0 - eps..=1.0 + eps).contains(&v)));
    let g = a.gumbel(20000);
    assert!(g.iter().all(|v| v.is_finite()));
    // The standard Gumbel's mean is the Euler–Mascheroni constant.
    let mean = g.iter().map(|&v| f64::from(v)).sum::<f64>() / g.len() as f64;
    assert!((mean - 0.5772).abs() < 0.03, "Gumbel mean {mean}");
}

#[test]
fn per_layer_aux_matches_deepspeed_and_finite_differences() {
    let (n, e) = (7, 4);
    let logits = randn(41, n * e, 1.5);
    for k in [1, 2, 3] {
        let r = route(&logits, n, e, k, Gating::SoftmaxThenTopK, true);
        let me: Vec<f64> = (0..e).map(|x| (0..n).map(|t| f64::from(r.probs[t * e + x])).sum::<f64>() / n as f64).collect();
        // ce: first choices (k ≤ 2, scale E), every choice (k ≥ 3, scale E/k).
        let ce: Vec<f64> = (0..e)
            .map(|x| {
                let hits = (0..n).flat_map(|t| (0..if k <= 2 { 1 } else { k }).map(move |j| t * k + j)).filter(|&i| r.idx[i] == x).count();
                hits as f64 / n as f64
            })
            .collect();
        let scale = if k <= 2 { e as f64 } else { e as f64 / k as f64 };
        let want = scale * me.iter().zip(&ce).map(|(a, b)| a * b).sum::<f64>();
        let (v, dp) = aux_per_layer(&r);
        assert!((f64::from(v) - want).abs() < 1e-6, "k {k}: {v} vs {want}");
        // Its gradient through the softmax (counts constant under a small step).
        let f = |l: &[f32]| {
            let r2 = route(l, n, e, k, Gating::SoftmaxThenTopK, true);
            let me2: Vec<f64> = (0..e).map(|x| (0..n).map(|t| f64::from(r2.probs[t * e + x])).sum::<f64>() / n as f64).collect();
            scale * me2.iter().zip(&ce).map(|(a, b)| a * b).sum::<f64>()
        };
        let mut dl = vec![0.0; n * e];
        route_backward(&mut dl, &r, &vec![0.0; n * k], Some(&dp), Gating::SoftmaxThenTopK, true);
        check_grad(f, &logits, &dl, 1e-2, 2e-2).unwrap_or_else(|m| panic!("k {k}: {m}"));
    }
}
