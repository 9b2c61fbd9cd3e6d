//! SwiGLU gating (LLaMA MLP): out = silu(gate) ⊙ up, forward and backward.

use rayon::prelude::*;

use crate::tensor::exp_f32;

/// Elements per parallel task.
const CHUNK: usize = 1 << 14;

/// σ(x) = 1/(1 + e^{−x})
#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp_f32(-x))
}

/// out = gate·σ(gate) · up   elementwise (all shapes equal).
pub fn swiglu_forward(out: &mut [f32], gate: &[f32], up: &[f32]) {
    assert!(out.len() == gate.len() && up.len() == gate.len(), "swiglu_forward: out, gate and up differ in length");
    out.par_chunks_mut(CHUNK).zip(gate.par_chunks(CHUNK).zip(up.par_chunks(CHUNK))).for_each(|(o, (g, u))| {
        for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
            *o = g * sigmoid(g) * u;
        }
    });
}

/// With s = σ(gate):  dgate += dout · up · s·(1 + gate·(1 − s)),   dup += dout · gate·s
pub fn swiglu_backward(dgate: &mut [f32], dup: &mut [f32], dout: &[f32], gate: &[f32], up: &[f32]) {
    let len = gate.len();
    assert!(dgate.len() == len && dup.len() == len && dout.len() == len && up.len() == len, "swiglu_backward: buffers differ in length");
    dgate
        .par_chunks_mut(CHUNK)
        .zip(dup.par_chunks_mut(CHUNK))
        .zip(dout.par_chunks(CHUNK).zip(gate.par_chunks(CHUNK).zip(up.par_chunks(CHUNK))))
        .for_each(|((dg, du), (d, (g, u)))| {
            for i in 0..dg.len() {
                let s = sigmoid(g[i]);
                dg[i] += d[i] * u[i] * s * (1.0 + g[i] * (1.0 - s));
                du[i] += d[i] * g[i] * s;
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check_grad, randn, weighted_sum};

    #[test]
    fn forward_known_values() {
        let mut out = vec![0f32; 3];
        swiglu_forward(&mut out, &[0.0, 1.0, -2.0], &[5.0, 2.0, 1.0]);
        let silu = |x: f64| x / (1.0 + (-x).exp());
        let want = [0.0, silu(1.0) * 2.0, silu(-2.0)];
        for (o, w) in out.iter().zip(want) {
            assert!((*o as f64 - w).abs() < 1e-6, "{o} vs {w}");
        }
    }

    #[test]
    fn backward_matches_finite_differences() {
        let (g, u, w) = (randn(1, 40, 2.0), randn(2, 40, 1.0), randn(3, 40, 1.0));
        let (mut dg, mut du) = (vec![0f32; 40], vec![0f32; 40]);
        swiglu_backward(&mut dg, &mut du, &w, &g, &u);
        let loss = |g: &[f32], u: &[f32]| {
            let mut out = vec![0f32; 40];
            swiglu_forward(&mut out, g, u);
            weighted_sum(&out, &w)
        };
        check_grad(|x| loss(x, &u), &g, &dg, 1e-3, 1e-2).unwrap();
        check_grad(|x| loss(&g, x), &u, &du, 1e-3, 1e-2).unwrap();
    }
}
