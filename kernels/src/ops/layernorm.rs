//! LayerNorm over the last dimension (GPT-2), forward and backward.
// Allowed: the ops keep llm.c's signatures (outputs, then inputs, then the shape), so each call
// reads against the math above it; a struct of buffers would hide which ones an op writes.
#![allow(clippy::too_many_arguments)]

use rayon::prelude::*;

use crate::tensor::{add_assign, dot_f32, reduce_cols, simd_dispatch, sum_f32};

/// PyTorch's default LayerNorm epsilon.
pub const LAYERNORM_EPS: f32 = 1e-5;

/// μ = mean(x), σ² = mean((x−μ)²), rstd = 1/√(σ²+ε), out = (x−μ)·rstd·w + b   per row.
/// Shapes: out, inp [N, C]; mean, rstd [N] (saved for backward); weight, bias [C].
pub fn layernorm_forward(
    out: &mut [f32],
    mean: &mut [f32],
    rstd: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    bias: &[f32],
    n: usize,
    c: usize,
) {
    assert!(out.len() == n * c && inp.len() == n * c, "layernorm_forward: out/inp must be [N, C]");
    assert!(mean.len() == n && rstd.len() == n, "layernorm_forward: mean/rstd must be [N]");
    assert!(weight.len() == c && bias.len() == c, "layernorm_forward: weight/bias must be [C]");
    out.par_chunks_mut(c).zip(inp.par_chunks(c)).zip(mean.par_iter_mut().zip(rstd.par_iter_mut())).for_each(|((o, x), (m, rs))| {
        (*m, *rs) = forward_row(o, x, weight, bias);
    });
}

/// One row of [`layernorm_forward`]; returns (μ, rstd).
#[inline(always)]
fn forward_row_body(o: &mut [f32], x: &[f32], weight: &[f32], bias: &[f32]) -> (f32, f32) {
    let c = x.len();
    let mu = sum_f32(x) / c as f32;
    // Two-pass variance: exact centring before squaring.
    let mut acc = [0f32; 8];
    x.iter().enumerate().for_each(|(i, v)| acc[i % 8] += (v - mu) * (v - mu));
    let var = sum_f32(&acc) / c as f32;
    let r = 1.0 / (var + LAYERNORM_EPS).sqrt();
    for (((o, x), w), b) in o.iter_mut().zip(x).zip(weight).zip(bias) {
        *o = (x - mu) * r * w + b;
    }
    (mu, r)
}

simd_dispatch!(fn forward_row(o: &mut [f32], x: &[f32], weight: &[f32], bias: &[f32]) -> (f32, f32) => forward_row_body);

/// With x̂ = (x−μ)·rstd and g = dout·w:
///   dinp += rstd · (g − mean(g) − x̂ · mean(g·x̂))
///   dweight += Σ_rows dout·x̂,   dbias += Σ_rows dout   (rows in order per column block)
/// Shapes as in [`layernorm_forward`]. The input half ([`layernorm_backward_input`]) then the
/// weight half ([`layernorm_backward_weight`]): disjoint outputs, the same bits either way.
pub fn layernorm_backward(
    dinp: &mut [f32],
    dweight: &mut [f32],
    dbias: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    mean: &[f32],
    rstd: &[f32],
    n: usize,
    c: usize,
) {
    assert!(weight.len() == c && dweight.len() == c && dbias.len() == c, "layernorm_backward: weight/dweight/dbias must be [C]");
    layernorm_backward_input(dinp, dout, inp, weight, mean, rstd, n, c);
    layernorm_backward_weight(dweight, dbias, dout, inp, mean, rstd, n, c);
}

/// dinp += rstd · (g − mean(g) − x̂ · mean(g·x̂)) (the input half of [`layernorm_backward`]).
pub fn layernorm_backward_input(
    dinp: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    mean: &[f32],
    rstd: &[f32],
    n: usize,
    c: usize,
) {
    assert!(dinp.len() == n * c && dout.len() == n * c && inp.len() == n * c, "layernorm_backward: dinp/dout/inp must be [N, C]");
    assert!(mean.len() == n && rstd.len() == n, "layernorm_backward: mean/rstd must be [N]");
    assert!(weight.len() == c, "layernorm_backward: weight must be [C]");
    dinp.par_chunks_mut(c).enumerate().for_each_init(
        || (vec![0f32; c], vec![0f32; c]),
        |(g, xh), (r, di)| {
            let (x, d) = (&inp[r * c..][..c], &dout[r * c..][..c]);
            backward_row(di, g, xh, x, d, weight, mean[r], rstd[r]);
        },
    );
}

/// dweight += Σ_rows dout·x̂,  dbias += Σ_rows dout (the weight half of [`layernorm_backward`]).
pub fn layernorm_backward_weight(
    dweight: &mut [f32],
    dbias: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    mean: &[f32],
    rstd: &[f32],
    n: usize,
    c: usize,
) {
    assert!(dout.len() == n * c && inp.len() == n * c, "layernorm_backward: dout/inp must be [N, C]");
    assert!(mean.len() == n && rstd.len() == n, "layernorm_backward: mean/rstd must be [N]");
    assert!(dweight.len() == c && dbias.len() == c, "layernorm_backward: dweight/dbias must be [C]");
    reduce_cols(dbias, n, |r, j0, acc| add_assign(acc, &dout[r * c + j0..][..acc.len()]));
    reduce_cols(dweight, n, |r, j0, acc| {
        let w = acc.len();
        dweight_row(acc, &inp[r * c + j0..][..w], &dout[r * c + j0..][..w], mean[r], rstd[r]);
    });
}

/// One row of the input gradient; `g`, `xh` are scratch of the row's length.
#[inline(always)]
fn backward_row_body(di: &mut [f32], g: &mut [f32], xh: &mut [f32], x: &[f32], d: &[f32], weight: &[f32], mu: f32, rs: f32) {
    let c = x.len();
    for i in 0..c {
        xh[i] = (x[i] - mu) * rs;
        g[i] = d[i] * weight[i];
    }
    let g_mean = sum_f32(g) / c as f32;
    let gx_mean = dot_f32(g, xh) / c as f32;
    for i in 0..c {
        di[i] += rs * (g[i] - g_mean - xh[i] * gx_mean);
    }
}

simd_dispatch!(fn backward_row(di: &mut [f32], g: &mut [f32], xh: &mut [f32], x: &[f32], d: &[f32], weight: &[f32], mu: f32, rs: f32) => backward_row_body);

/// acc += d·(x − μ)·rstd   (one row's dweight contribution over a column block).
#[inline(always)]
fn dweight_row_body(acc: &mut [f32], x: &[f32], d: &[f32], mu: f32, rs: f32) {
    for ((a, x), d) in acc.iter_mut().zip(x).zip(d) {
        *a += d * (x - mu) * rs;
    }
}

simd_dispatch!(fn dweight_row(acc: &mut [f32], x: &[f32], d: &[f32], mu: f32, rs: f32) => dweight_row_body);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check_grad, randn, weighted_sum};

    fn forward(inp: &[f32], w: &[f32], b: &[f32], n: usize, c: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let (mut out, mut mean, mut rstd) = (vec![0f32; n * c], vec![0f32; n], vec![0f32; n]);
        layernorm_forward(&mut out, &mut mean, &mut rstd, inp, w, b, n, c);
        (out, mean, rstd)
    }

    #[test]
    fn forward_normalises_rows() {
        let (n, c) = (3, 37);
        let inp: Vec<f32> = randn(1, n * c, 3.0).iter().map(|v| v + 5.0).collect();
        let (out, mean, _) = forward(&inp, &vec![1.0; c], &vec![0.0; c], n, c);
        for r in 0..n {
            let row = &out[r * c..(r + 1) * c];
            let mu: f64 = row.iter().map(|&v| v as f64).sum::<f64>() / c as f64;
            let var: f64 = row.iter().map(|&v| (v as f64 - mu).powi(2)).sum::<f64>() / c as f64;
            assert!(mu.abs() < 1e-5 && (var - 1.0).abs() < 1e-4, "row {r}: {mu} {var}");
            let want_mean: f64 = inp[r * c..(r + 1) * c].iter().map(|&v| v as f64).sum::<f64>() / c as f64;
            assert!((mean[r] as f64 - want_mean).abs() < 1e-4);
        }
        // Affine part: out = x̂·w + b.
        let (out2, _, _) = forward(&inp, &vec![2.0; c], &vec![0.5; c], n, c);
        assert!(out.iter().zip(&out2).all(|(a, b)| (a * 2.0 + 0.5 - b).abs() < 1e-5));
    }

    #[test]
    fn backward_matches_finite_differences() {
        let (n, c) = (3, 8);
        let inp = randn(1, n * c, 1.0);
        let w = randn(2, c, 1.0);
        let bias = randn(3, c, 1.0);
        let wout = randn(4, n * c, 1.0);
        let (_, mean, rstd) = forward(&inp, &w, &bias, n, c);
        let (mut dinp, mut dw, mut db) = (vec![0.5f32; n * c], vec![0.5f32; c], vec![0.5f32; c]);
        layernorm_backward(&mut dinp, &mut dw, &mut db, &wout, &inp, &w, &mean, &rstd, n, c);
        // Backward accumulates: subtract the initial 0.5 before comparing.
        let sub = |v: &[f32]| v.iter().map(|x| x - 0.5).collect::<Vec<_>>();
        let loss = |x: &[f32], w: &[f32], b: &[f32]| weighted_sum(&forward(x, w, b, n, c).0, &wout);
        check_grad(|x| loss(x, &w, &bias), &inp, &sub(&dinp), 1e-2, 1e-2).unwrap();
        check_grad(|x| loss(&inp, x, &bias), &w, &sub(&dw), 1e-2, 1e-2).unwrap();
        check_grad(|x| loss(&inp, &w, x), &bias, &sub(&db), 1e-2, 1e-2).unwrap();
    }
}
