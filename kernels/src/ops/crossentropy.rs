//! Fused softmax + cross-entropy over vocabulary logits, its backward, and plain row softmax
//! (for sampling).

use rayon::prelude::*;

use crate::tensor::{exp_f32, max_f32};

/// probs_row = softmax(logits_row); returns ln Σ e^(logit − max) + max = logsumexp (f64).
fn softmax_row(probs: &mut [f32], logits: &[f32]) -> f64 {
    let m = max_f32(logits);
    probs.iter_mut().zip(logits).for_each(|(p, &l)| *p = exp_f32(l - m));
    // f64 lane sums in fixed order: exact enough for V ~ 50k and deterministic.
    let mut acc = [0f64; 4];
    let mut chunks = probs.chunks_exact(4);
    for ch in &mut chunks {
        for l in 0..4 {
            acc[l] += ch[l] as f64;
        }
    }
    chunks.remainder().iter().enumerate().for_each(|(l, &p)| acc[l] += p as f64);
    let z = (acc[0] + acc[2]) + (acc[1] + acc[3]);
    let inv = (1.0 / z) as f32;
    probs.iter_mut().for_each(|p| *p *= inv);
    z.ln() + m as f64
}

fn check_targets(targets: &[u32], v: usize) {
    if let Some(bad) = targets.iter().find(|&&tg| tg as usize >= v) {
        panic!("crossentropy: target id {bad} is outside the vocabulary of {v}");
    }
}

/// probs[r] = softmax(logits[r]), losses[r] = logsumexp(logits[r]) − logits[r, targets[r]];
/// returns the mean loss (losses summed in f64 in row order).
/// Shapes: losses [N], probs, logits [N, V], targets [N]. Panics if a target ≥ V.
pub fn crossentropy_forward(losses: &mut [f32], probs: &mut [f32], logits: &[f32], targets: &[u32], n: usize, v: usize) -> f32 {
    assert!(probs.len() == n * v && logits.len() == n * v, "crossentropy_forward: probs/logits must be [N, V]");
    assert!(losses.len() == n && targets.len() == n, "crossentropy_forward: losses/targets must be [N]");
    if n == 0 {
        return 0.0;
    }
    check_targets(targets, v);
    probs.par_chunks_mut(v).zip(logits.par_chunks(v)).zip(losses.par_iter_mut().zip(targets.par_iter())).for_each(
        |((p, l), (loss, &tg))| {
            let lse = softmax_row(p, l);
            *loss = (lse - l[tg as usize] as f64) as f32;
        },
    );
    let total: f64 = losses.iter().map(|&l| l as f64).sum();
    (total / n as f64) as f32
}

/// dlogits[r, j] += (probs[r, j] − [j = targets[r]]) · dloss_mean / N
/// (the gradient of dloss_mean × mean loss). Shapes as in [`crossentropy_forward`].
pub fn crossentropy_backward(dlogits: &mut [f32], probs: &[f32], targets: &[u32], n: usize, v: usize, dloss_mean: f32) {
    assert!(dlogits.len() == n * v && probs.len() == n * v, "crossentropy_backward: dlogits/probs must be [N, V]");
    assert_eq!(targets.len(), n, "crossentropy_backward: targets must be [N]");
    if n == 0 {
        return;
    }
    check_targets(targets, v);
    let scale = dloss_mean / n as f32;
    dlogits.par_chunks_mut(v).zip(probs.par_chunks(v)).zip(targets.par_iter()).for_each(|((d, p), &tg)| {
        d.iter_mut().zip(p).for_each(|(d, &p)| *d += p * scale);
        d[tg as usize] -= scale;
    });
}

/// probs[r] = softmax(logits[r]) for N rows of V (sampling).
pub fn softmax_rows(probs: &mut [f32], logits: &[f32], n: usize, v: usize) {
    assert!(probs.len() == n * v && logits.len() == n * v, "softmax_rows: probs/logits must be [N, V]");
    if v == 0 {
        return;
    }
    probs.par_chunks_mut(v).zip(logits.par_chunks(v)).for_each(|(p, l)| {
        softmax_row(p, l);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check_grad, randn};

    #[test]
    fn forward_hand_computed() {
        // Uniform logits over V: loss = ln V; a confident correct row has loss ≈ 0.
        let (n, v) = (2, 4);
        let logits = vec![0.0, 0.0, 0.0, 0.0, 0.0, 30.0, 0.0, 0.0];
        let (mut losses, mut probs) = (vec![0f32; n], vec![0f32; n * v]);
        let mean = crossentropy_forward(&mut losses, &mut probs, &logits, &[2, 1], n, v);
        assert!((losses[0] - 4f32.ln()).abs() < 1e-6);
        assert!(losses[1].abs() < 1e-6);
        assert!((mean - 4f32.ln() / 2.0).abs() < 1e-6);
        assert!(probs[..4].iter().all(|&p| (p - 0.25).abs() < 1e-7));
        // Large logits do not overflow.
        let big = vec![1000.0, 999.0];
        let (mut l1, mut p1) = (vec![0f32; 1], vec![0f32; 2]);
        crossentropy_forward(&mut l1, &mut p1, &big, &[1], 1, 2);
        assert!((l1[0] as f64 - (1.0 + (1.0 + (-1f64).exp()).ln())).abs() < 1e-5);
        let mut sp = vec![0f32; 2];
        softmax_rows(&mut sp, &big, 1, 2);
        assert_eq!(sp, p1);
    }

    #[test]
    fn backward_matches_finite_differences() {
        let (n, v) = (3, 7);
        let logits = randn(1, n * v, 2.0);
        let targets = [3u32, 0, 6];
        let (mut losses, mut probs) = (vec![0f32; n], vec![0f32; n * v]);
        crossentropy_forward(&mut losses, &mut probs, &logits, &targets, n, v);
        let mut d = vec![0f32; n * v];
        crossentropy_backward(&mut d, &probs, &targets, n, v, 2.0);
        let loss = |x: &[f32]| {
            let (mut l, mut p) = (vec![0f32; n], vec![0f32; n * v]);
            2.0 * crossentropy_forward(&mut l, &mut p, x, &targets, n, v) as f64
        };
        check_grad(loss, &logits, &d, 1e-2, 1e-2).unwrap();
    }

    #[test]
    #[should_panic(expected = "outside the vocabulary")]
    fn bad_target_panics() {
        let (mut l, mut p) = (vec![0f32; 1], vec![0f32; 2]);
        crossentropy_forward(&mut l, &mut p, &[0.0, 1.0], &[2], 1, 2);
    }
}
