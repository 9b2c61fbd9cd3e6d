//! GELU activation, tanh approximation (PyTorch `gelu(approximate="tanh")`, GPT-2's MLP).

use rayon::prelude::*;

use crate::tensor::{simd_dispatch, tanh_f32};

/// Elements per parallel task.
const CHUNK: usize = 1 << 14;
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const GELU_COEF: f32 = 0.044_715;

/// out = ½·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))   elementwise (shapes equal).
pub fn gelu_forward(out: &mut [f32], inp: &[f32]) {
    assert_eq!(out.len(), inp.len(), "gelu_forward: out and inp differ in length");
    out.par_chunks_mut(CHUNK).zip(inp.par_chunks(CHUNK)).for_each(|(o, x)| forward_chunk(o, x));
}

#[inline(always)]
fn forward_chunk_body(out: &mut [f32], inp: &[f32]) {
    for (o, &x) in out.iter_mut().zip(inp) {
        let u = SQRT_2_OVER_PI * (x + GELU_COEF * x * x * x);
        *o = 0.5 * x * (1.0 + tanh_f32(u));
    }
}

simd_dispatch!(fn forward_chunk(out: &mut [f32], inp: &[f32]) => forward_chunk_body);

/// With u = √(2/π)(x + 0.044715x³), th = tanh(u):
/// dinp += dout · [½(1 + th) + ½x(1 − th²)·√(2/π)(1 + 3·0.044715x²)]
pub fn gelu_backward(dinp: &mut [f32], inp: &[f32], dout: &[f32]) {
    assert!(dinp.len() == inp.len() && dout.len() == inp.len(), "gelu_backward: dinp, inp and dout differ in length");
    dinp.par_chunks_mut(CHUNK).zip(inp.par_chunks(CHUNK).zip(dout.par_chunks(CHUNK))).for_each(|(di, (x, d))| backward_chunk(di, x, d));
}

#[inline(always)]
fn backward_chunk_body(dinp: &mut [f32], inp: &[f32], dout: &[f32]) {
    for ((di, &x), &d) in dinp.iter_mut().zip(inp).zip(dout) {
        let u = SQRT_2_OVER_PI * (x + GELU_COEF * x * x * x);
        let th = tanh_f32(u);
        let du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_COEF * x * x);
        *di += d * (0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * du);
    }
}

simd_dispatch!(fn backward_chunk(dinp: &mut [f32], inp: &[f32], dout: &[f32]) => backward_chunk_body);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check_grad, randn, weighted_sum};

    #[test]
    fn forward_known_values() {
        // Reference values of torch.nn.functional.gelu(x, approximate="tanh").
        let x = [-3.0f32, -1.0, 0.0, 0.5, 1.0, 2.0];
        let want = [-0.003_637_392, -0.158_808, 0.0, 0.345_714, 0.841_192, 1.954_597_7];
        let mut out = vec![0f32; x.len()];
        gelu_forward(&mut out, &x);
        for (o, w) in out.iter().zip(want) {
            assert!((o - w).abs() < 2e-6, "{o} vs {w}");
        }
    }

    #[test]
    fn dispatched_paths_match_the_baseline_bits() {
        if !crate::tensor::has_avx512() {
            eprintln!("SKIP: this CPU has no AVX-512F, so the dispatched path is the baseline itself");
            return;
        }
        let x = randn(3, 4099, 3.0);
        let d = randn(4, 4099, 1.0);
        let (mut a, mut b) = (vec![0f32; x.len()], vec![0f32; x.len()]);
        forward_chunk(&mut a, &x);
        forward_chunk_body(&mut b, &x);
        assert_eq!(a, b);
        let (mut da, mut db) = (d.clone(), d.clone());
        backward_chunk(&mut da, &x, &d);
        backward_chunk_body(&mut db, &x, &d);
        assert_eq!(da, db);
    }

    #[test]
    fn backward_matches_finite_differences() {
        let x = randn(1, 50, 2.0);
        let w = randn(2, 50, 1.0);
        let mut dx = vec![0f32; 50];
        gelu_backward(&mut dx, &x, &w);
        let loss = |x: &[f32]| {
            let mut out = vec![0f32; x.len()];
            gelu_forward(&mut out, x);
            weighted_sum(&out, &w)
        };
        check_grad(loss, &x, &dx, 1e-3, 1e-2).unwrap();
    }
}
