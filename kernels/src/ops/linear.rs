//! Fully connected layer y = x·W + b with W stored [in, out] (HF GPT-2 Conv1D layout).
// Allowed: the ops keep llm.c's signatures (outputs, then inputs, then the shape), so each call
// reads against the math above it; a struct of buffers would hide which ones an op writes.
#![allow(clippy::too_many_arguments)]

use rayon::prelude::*;

use crate::gemm::matmul;
use crate::tensor::{add_assign, reduce_cols};

/// out[n×oc] = inp[n×ic] · weight[ic×oc] (+ bias[oc] broadcast over rows). Overwrites `out`.
pub fn linear_forward(out: &mut [f32], inp: &[f32], weight: &[f32], bias: Option<&[f32]>, n: usize, ic: usize, oc: usize) {
    assert_eq!(out.len(), n * oc, "linear_forward: out must be [N, OC]");
    match bias {
        Some(bias) => {
            assert_eq!(bias.len(), oc, "linear_forward: bias must be [OC]");
            out.par_chunks_mut(oc.max(1)).for_each(|row| row.copy_from_slice(bias));
            matmul(out, inp, weight, n, ic, oc, false, false, 1.0);
        }
        None => matmul(out, inp, weight, n, ic, oc, false, false, 0.0),
    }
}

/// dinp[n×ic] += dout · weightᵀ,  dweight[ic×oc] += inpᵀ · dout,  dbias[oc] += Σ_rows dout.
/// All three accumulate; the bias sum adds rows in order per column block (thread-independent).
/// The input half ([`linear_backward_input`]) then the weight half ([`linear_backward_weight`]),
/// which a zero-bubble pipeline runs later: their outputs are disjoint, so either order gives
/// the same bits.
pub fn linear_backward(
    dinp: &mut [f32],
    dweight: &mut [f32],
    dbias: Option<&mut [f32]>,
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    n: usize,
    ic: usize,
    oc: usize,
) {
    linear_backward_input(dinp, dout, weight, n, ic, oc);
    linear_backward_weight(dweight, dbias, dout, inp, n, ic, oc);
}

/// dinp[n×ic] += dout · weightᵀ (the input half of [`linear_backward`]).
pub fn linear_backward_input(dinp: &mut [f32], dout: &[f32], weight: &[f32], n: usize, ic: usize, oc: usize) {
    matmul(dinp, dout, weight, n, oc, ic, false, true, 1.0);
}

/// dweight[ic×oc] += inpᵀ · dout,  dbias[oc] += Σ_rows dout (the weight half of
/// [`linear_backward`]).
pub fn linear_backward_weight(dweight: &mut [f32], dbias: Option<&mut [f32]>, dout: &[f32], inp: &[f32], n: usize, ic: usize, oc: usize) {
    matmul(dweight, inp, dout, ic, n, oc, true, false, 1.0);
    if let Some(dbias) = dbias {
        assert_eq!(dbias.len(), oc, "linear_backward: dbias must be [OC]");
        assert_eq!(dout.len(), n * oc, "linear_backward: dout must be [N, OC]");
        reduce_cols(dbias, n, |r, j0, acc| add_assign(acc, &dout[r * oc + j0..][..acc.len()]));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check_grad, randn, weighted_sum};

    #[test]
    fn forward_hand_computed() {
        // x = [1, 2], W = [[1, 0, 2], [0, 1, 3]], b = [0.5, 0.5, 0.5]
        let mut out = vec![0f32; 3];
        let w = [1.0, 0.0, 2.0, 0.0, 1.0, 3.0];
        linear_forward(&mut out, &[1.0, 2.0], &w, Some(&[0.5; 3]), 1, 2, 3);
        assert_eq!(out, vec![1.5, 2.5, 8.5]);
        linear_forward(&mut out, &[1.0, 2.0], &w, None, 1, 2, 3);
        assert_eq!(out, vec![1.0, 2.0, 8.0]);
    }

    #[test]
    fn backward_matches_finite_differences() {
        let (n, ic, oc) = (5, 4, 3);
        let inp = randn(1, n * ic, 1.0);
        let w = randn(2, ic * oc, 1.0);
        let bias = randn(3, oc, 1.0);
        let wout = randn(4, n * oc, 1.0);
        let (mut dinp, mut dw, mut db) = (vec![0f32; n * ic], vec![0f32; ic * oc], vec![0f32; oc]);
        linear_backward(&mut dinp, &mut dw, Some(&mut db), &wout, &inp, &w, n, ic, oc);
        let loss = |x: &[f32], w: &[f32], b: &[f32]| {
            let mut out = vec![0f32; n * oc];
            linear_forward(&mut out, x, w, Some(b), n, ic, oc);
            weighted_sum(&out, &wout)
        };
        check_grad(|x| loss(x, &w, &bias), &inp, &dinp, 1e-2, 1e-3).unwrap();
        check_grad(|x| loss(&inp, x, &bias), &w, &dw, 1e-2, 1e-3).unwrap();
        check_grad(|x| loss(&inp, &w, x), &bias, &db, 1e-2, 1e-3).unwrap();
        // A second call accumulates: gradients double.
        let before = dw.clone();
        linear_backward(&mut dinp, &mut dw, None, &wout, &inp, &w, n, ic, oc);
        assert!(dw.iter().zip(&before).all(|(a, b)| (a - 2.0 * b).abs() < 1e-5));
    }
}
