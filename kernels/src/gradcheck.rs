//! Finite-difference gradient checking shared by every kernel test and the model-stack tests:
//! central differences in f64 around an f32 point, compared coordinate-wise with an analytic
//! gradient.

use crate::tensor::Rng;

/// Inputs longer than this are checked on this many deterministically sampled coordinates.
const SAMPLES_MAX: usize = 64;

/// Coordinates to perturb: all of them for short inputs, else one random index per equal-width
/// stratum (distinct, spread over the whole input, the same on every run).
fn sample_coords(len: usize) -> Vec<usize> {
    if len <= SAMPLES_MAX {
        return (0..len).collect();
    }
    let mut rng = Rng::derive(0x6772_6164, &[len as u64]);
    (0..SAMPLES_MAX)
        .map(|s| {
            let lo = s * len / SAMPLES_MAX;
            let hi = (s + 1) * len / SAMPLES_MAX;
            lo + rng.gen_range((hi - lo) as u64) as usize
        })
        .collect()
}

/// Checks `analytic` ≈ ∇f(x) by central differences (f(x+h·e_i) − f(x−h·e_i)) / (2h), where the
/// step h ≈ `eps` is the one actually representable in f32 around x_i.
///
/// Coordinate i fails when |num_i − ana_i| / max(|num_i|, |ana_i|, floor) > `tol`, with
/// floor = 1e-2 · max over checked coordinates of max(|num|, |ana|) (so coordinates whose
/// gradient is tiny compared with the rest are judged on an absolute scale, which f32 rounding
/// noise in `f` would otherwise swamp). The error names the worst coordinate.
pub fn check_grad(mut f: impl FnMut(&[f32]) -> f64, x: &[f32], analytic: &[f32], eps: f64, tol: f64) -> Result<(), String> {
    if analytic.len() != x.len() {
        return Err(format!("analytic gradient has {} entries but x has {}", analytic.len(), x.len()));
    }
    let mut xp = x.to_vec();
    let mut checked = Vec::new();
    for i in sample_coords(x.len()) {
        let hi = (x[i] as f64 + eps) as f32;
        let lo = (x[i] as f64 - eps) as f32;
        xp[i] = hi;
        let f_hi = f(&xp);
        xp[i] = lo;
        let f_lo = f(&xp);
        xp[i] = x[i];
        let num = (f_hi - f_lo) / (hi as f64 - lo as f64);
        checked.push((i, num, analytic[i] as f64));
    }
    let scale = checked.iter().fold(0f64, |m, &(_, n, a)| m.max(n.abs()).max(a.abs()));
    let floor = (1e-2 * scale).max(f64::MIN_POSITIVE);
    // A NaN error (NaN gradient or objective) counts as infinitely wrong.
    let rel = |n: f64, a: f64| {
        let r = (n - a).abs() / n.abs().max(a.abs()).max(floor);
        if r.is_nan() {
            f64::INFINITY
        } else {
            r
        }
    };
    let worst = checked.iter().map(|&(i, n, a)| (i, n, a, rel(n, a))).reduce(|w, c| if c.3 > w.3 { c } else { w });
    match worst {
        Some((i, n, a, r)) if r > tol => Err(format!(
            "gradient mismatch at coordinate {i}: numeric {n:.6e} vs analytic {a:.6e}, \
             relative error {r:.3e} > tol {tol:.1e}"
        )),
        _ => Ok(()),
    }
}

/// ||a − b||₂ / max(||b||₂, 1e-30), accumulated in f64. Panics if the lengths differ.
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "rel_err length mismatch");
    let diff: f64 = a.iter().zip(b).map(|(&x, &y)| (x as f64 - y as f64).powi(2)).sum();
    let norm: f64 = b.iter().map(|&y| (y as f64).powi(2)).sum();
    diff.sqrt() / norm.sqrt().max(1e-30)
}

/// Σ out·w accumulated in f64: the scalar objective that turns a vector output into a loss for
/// gradient checks (its gradient with respect to `out` is `w`). Panics if the lengths differ.
pub fn weighted_sum(out: &[f32], w: &[f32]) -> f64 {
    assert_eq!(out.len(), w.len(), "weighted_sum length mismatch");
    out.iter().zip(w).map(|(&o, &v)| o as f64 * v as f64).sum()
}

/// `len` samples of N(0, std²) from a stream keyed by `seed`: reproducible test inputs.
pub fn randn(seed: u64, len: usize, std: f32) -> Vec<f32> {
    let mut v = vec![0f32; len];
    Rng::derive(seed, &[len as u64]).fill_normal(&mut v, std);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cubic(x: &[f32]) -> f64 {
        x.iter().map(|&v| (v as f64).powi(3)).sum()
    }

    #[test]
    fn accepts_correct_and_rejects_wrong_gradients() {
        let x: Vec<f32> = (0..10).map(|i| i as f32 * 0.3 - 1.0).collect();
        let good: Vec<f32> = x.iter().map(|v| 3.0 * v * v).collect();
        assert_eq!(check_grad(cubic, &x, &good, 1e-3, 1e-3), Ok(()));
        let mut bad = good.clone();
        bad[4] *= 1.5;
        let err = check_grad(cubic, &x, &bad, 1e-3, 1e-3).unwrap_err();
        assert!(err.contains("coordinate 4"), "{err}");
        assert!(check_grad(cubic, &x, &good[..3], 1e-3, 1e-3).is_err());
    }

    #[test]
    fn nan_gradients_fail() {
        let x = vec![1.0f32, 2.0];
        let err = check_grad(cubic, &x, &[3.0, f32::NAN], 1e-3, 1e-2).unwrap_err();
        assert!(err.contains("coordinate 1"), "{err}");
    }

    #[test]
    fn samples_large_inputs_deterministically() {
        let c = sample_coords(10_000);
        assert_eq!(c.len(), SAMPLES_MAX);
        assert_eq!(c, sample_coords(10_000));
        assert!(c.windows(2).all(|w| w[0] < w[1]) && *c.last().unwrap() < 10_000);
        let x = vec![0.5f32; 10_000];
        let g = vec![0.75f32; 10_000];
        assert_eq!(check_grad(cubic, &x, &g, 1e-3, 1e-3), Ok(()));
    }

    #[test]
    fn rel_err_values() {
        assert_eq!(rel_err(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        assert!((rel_err(&[3.0, 4.0], &[0.0, 0.0]) - 5e30).abs() < 1e20);
        assert!((rel_err(&[1.0, 0.0], &[0.0, 1.0]) - 2f64.sqrt()).abs() < 1e-12);
        assert_eq!(weighted_sum(&[1.0, 2.0], &[3.0, -1.0]), 1.0);
        assert_eq!(randn(1, 5, 1.0), randn(1, 5, 1.0));
        assert_ne!(randn(1, 5, 1.0), randn(2, 5, 1.0));
    }
}
