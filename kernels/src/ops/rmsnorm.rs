//! RMSNorm over the last dimension (LLaMA), forward and backward.
// Allowed: the ops keep llm.c's signatures (outputs, then inputs, then the shape), so each call
// reads against the math above it; a struct of buffers would hide which ones an op writes.
#![allow(clippy::too_many_arguments)]

use rayon::prelude::*;

use crate::tensor::{dot_f32, reduce_cols};

/// rstd = 1/√(mean(x²) + ε),  out = x · rstd · w   per row.
/// Shapes: out, inp [N, C]; rstd [N] (saved for backward); weight [C].
pub fn rmsnorm_forward(out: &mut [f32], rstd: &mut [f32], inp: &[f32], weight: &[f32], n: usize, c: usize, eps: f32) {
    assert!(out.len() == n * c && inp.len() == n * c, "rmsnorm_forward: out/inp must be [N, C]");
    assert!(rstd.len() == n, "rmsnorm_forward: rstd must be [N]");
    assert!(weight.len() == c, "rmsnorm_forward: weight must be [C]");
    out.par_chunks_mut(c).zip(inp.par_chunks(c)).zip(rstd.par_iter_mut()).for_each(|((o, x), rs)| {
        let r = 1.0 / (dot_f32(x, x) / c as f32 + eps).sqrt();
        for ((o, x), w) in o.iter_mut().zip(x).zip(weight) {
            *o = x * r * w;
        }
        *rs = r;
    });
}

/// With g = dout·w:  dinp += rstd · (g − x · rstd² · mean(g·x))
///                   dweight += Σ_rows dout · x · rstd   (rows in order per column block)
/// Shapes as in [`rmsnorm_forward`]. The input half ([`rmsnorm_backward_input`]) then the
/// weight half ([`rmsnorm_backward_weight`]): disjoint outputs, the same bits either way.
pub fn rmsnorm_backward(
    dinp: &mut [f32],
    dweight: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    rstd: &[f32],
    n: usize,
    c: usize,
) {
    rmsnorm_backward_input(dinp, dout, inp, weight, rstd, n, c);
    rmsnorm_backward_weight(dweight, dout, inp, rstd, n, c);
}

/// dinp += rstd · (g − x · rstd² · mean(g·x)) (the input half of [`rmsnorm_backward`]).
pub fn rmsnorm_backward_input(dinp: &mut [f32], dout: &[f32], inp: &[f32], weight: &[f32], rstd: &[f32], n: usize, c: usize) {
    assert!(dinp.len() == n * c && dout.len() == n * c && inp.len() == n * c, "rmsnorm_backward: dinp/dout/inp must be [N, C]");
    assert!(rstd.len() == n, "rmsnorm_backward: rstd must be [N]");
    assert!(weight.len() == c, "rmsnorm_backward: weight must be [C]");
    dinp.par_chunks_mut(c).enumerate().for_each_init(
        || vec![0f32; c],
        |g, (r, di)| {
            let (x, d) = (&inp[r * c..][..c], &dout[r * c..][..c]);
            let rs = rstd[r];
            g.iter_mut().zip(d.iter().zip(weight)).for_each(|(g, (d, w))| *g = d * w);
            let k = rs * rs * dot_f32(g, x) / c as f32;
            for i in 0..c {
                di[i] += rs * (g[i] - x[i] * k);
            }
        },
    );
}

/// dweight += Σ_rows dout · x · rstd (the weight half of [`rmsnorm_backward`]).
pub fn rmsnorm_backward_weight(dweight: &mut [f32], dout: &[f32], inp: &[f32], rstd: &[f32], n: usize, c: usize) {
    assert!(dout.len() == n * c && inp.len() == n * c, "rmsnorm_backward: dout/inp must be [N, C]");
    assert!(rstd.len() == n && dweight.len() == c, "rmsnorm_backward: rstd must be [N], dweight [C]");
    reduce_cols(dweight, n, |r, j0, acc| {
        let w = acc.len();
        let (x, d) = (&inp[r * c + j0..][..w], &dout[r * c + j0..][..w]);
        let rs = rstd[r];
        for i in 0..w {
            acc[i] += d[i] * x[i] * rs;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check_grad, randn, weighted_sum};

    const EPS: f32 = 1e-6;

    fn forward(inp: &[f32], w: &[f32], n: usize, c: usize) -> (Vec<f32>, Vec<f32>) {
        let (mut out, mut rstd) = (vec![0f32; n * c], vec![0f32; n]);
        rmsnorm_forward(&mut out, &mut rstd, inp, w, n, c, EPS);
        (out, rstd)
    }

    #[test]
    fn forward_has_unit_rms() {
        let (n, c) = (4, 29);
        let inp = randn(1, n * c, 4.0);
        let (out, _) = forward(&inp, &vec![1.0; c], n, c);
        for r in 0..n {
            let ms: f64 = out[r * c..(r + 1) * c].iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / c as f64;
            assert!((ms - 1.0).abs() < 1e-4, "row {r}: {ms}");
        }
        let (out, _) = forward(&[3.0, 4.0], &[1.0, 2.0], 1, 2);
        let r = 1.0 / (12.5f32 + EPS).sqrt();
        assert!((out[0] - 3.0 * r).abs() < 1e-6 && (out[1] - 8.0 * r).abs() < 1e-6);
    }

    #[test]
    fn backward_matches_finite_differences() {
        let (n, c) = (3, 8);
        let inp = randn(1, n * c, 1.0);
        let w = randn(2, c, 1.0);
        let wout = randn(3, n * c, 1.0);
        let (_, rstd) = forward(&inp, &w, n, c);
        let (mut dinp, mut dw) = (vec![0f32; n * c], vec![0f32; c]);
        rmsnorm_backward(&mut dinp, &mut dw, &wout, &inp, &w, &rstd, n, c);
        let loss = |x: &[f32], w: &[f32]| weighted_sum(&forward(x, w, n, c).0, &wout);
        check_grad(|x| loss(x, &w), &inp, &dinp, 1e-2, 1e-2).unwrap();
        check_grad(|x| loss(&inp, x), &w, &dw, 1e-2, 1e-2).unwrap();
    }
}
