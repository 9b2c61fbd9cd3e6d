//! Rotary position embeddings (HF LLaMA "rotate_half" convention) applied in place to the q and
//! k parts of a fused qkv buffer, and the transposed rotation for the backward pass.

use rayon::prelude::*;

/// cos/sin of angle(pos, i) = pos · θ^(−2i/hd) for pos < T and i < hd/2, computed in f64.
#[derive(Clone, Debug)]
pub struct RopeTable {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    /// Table for positions 0..t and head size `hd` (must be even).
    pub fn new(t: usize, hd: usize, theta: f32) -> RopeTable {
        assert!(hd % 2 == 0, "rope: head size {hd} must be even");
        let half = hd / 2;
        let mut cos = vec![0f32; t * half];
        let mut sin = vec![0f32; t * half];
        for pos in 0..t {
            for i in 0..half {
                let inv_freq = (theta as f64).powf(-2.0 * i as f64 / hd as f64);
                let (s, c) = (pos as f64 * inv_freq).sin_cos();
                cos[pos * half + i] = c as f32;
                sin[pos * half + i] = s as f32;
            }
        }
        RopeTable { half, cos, sin }
    }

    /// Rotates one head vector x [hd] at position `pos`, pairing x[i] with x[i + hd/2]:
    ///   forward: (x1, x2) ← (x1·cos − x2·sin, x2·cos + x1·sin)
    ///   inverse (= transpose): (g1, g2) ← (g1·cos + g2·sin, g2·cos − g1·sin)
    pub fn rotate(&self, x: &mut [f32], pos: usize, inverse: bool) {
        let h = self.half;
        let (cos, sin) = (&self.cos[pos * h..][..h], &self.sin[pos * h..][..h]);
        let (x1, x2) = x.split_at_mut(h);
        let sign = if inverse { -1.0 } else { 1.0 };
        for i in 0..h {
            let (a, b) = (x1[i], x2[i]);
            let s = sign * sin[i];
            x1[i] = a * cos[i] - b * s;
            x2[i] = b * cos[i] + a * s;
        }
    }
}

/// Applies `rotate` to every head of the q (cols 0..C) and k (cols C..2C) parts of [B·T, 3C].
fn rotate_qk(qkv: &mut [f32], b: usize, t: usize, c: usize, nh: usize, theta: f32, inverse: bool) {
    assert_eq!(qkv.len(), b * t * 3 * c, "rope: qkv must be [B*T, 3C]");
    assert!(nh > 0 && c > 0 && c % nh == 0, "rope: C={c} must be a positive multiple of nh={nh}");
    let hd = c / nh;
    let table = RopeTable::new(t, hd, theta);
    qkv.par_chunks_mut(3 * c).enumerate().for_each(|(bt, row)| {
        for head in row[..2 * c].chunks_exact_mut(hd) {
            table.rotate(head, bt % t, inverse);
        }
    });
}

/// q, k ← RoPE(q, k) in place on qkv [B, T, 3C]; v untouched. Position = index within T.
pub fn rope_forward(qkv: &mut [f32], b: usize, t: usize, c: usize, nh: usize, theta: f32) {
    rotate_qk(qkv, b, t, c, nh, theta, false);
}

/// dq, dk ← Rᵀ·(dq, dk) in place on dqkv [B, T, 3C] (the rotation's transpose = its inverse);
/// dv untouched. Not an accumulation: it maps the gradient w.r.t. rotated q/k to the gradient
/// w.r.t. unrotated q/k.
pub fn rope_backward(dqkv: &mut [f32], b: usize, t: usize, c: usize, nh: usize, theta: f32) {
    rotate_qk(dqkv, b, t, c, nh, theta, true);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check_grad, randn, weighted_sum};

    #[test]
    fn rotate_half_convention() {
        // hd = 4, one head of q; position 1, θ = 100: angles (1, 1/10) for pairs (0,2), (1,3).
        let (b, t, c, nh, theta) = (1, 2, 4, 1, 100.0);
        let mut qkv = vec![0f32; b * t * 3 * c];
        qkv[12..16].copy_from_slice(&[1.0, 2.0, 3.0, 4.0]); // row t=1, q part
        qkv[16..20].copy_from_slice(&[1.0, 0.0, 0.0, 0.0]); // row t=1, k part
        qkv[20..24].copy_from_slice(&[9.0, 9.0, 9.0, 9.0]); // v is untouched
        let before = qkv.clone();
        rope_forward(&mut qkv, b, t, c, nh, theta);
        let (c0, s0, c1, s1) = (1f32.cos(), 1f32.sin(), 0.1f32.cos(), 0.1f32.sin());
        let want_q = [1.0 * c0 - 3.0 * s0, 2.0 * c1 - 4.0 * s1, 3.0 * c0 + 1.0 * s0, 4.0 * c1 + 2.0 * s1];
        for (g, w) in qkv[12..16].iter().zip(want_q) {
            assert!((g - w).abs() < 1e-6, "{g} vs {w}");
        }
        assert!((qkv[16] - c0).abs() < 1e-6 && (qkv[18] - s0).abs() < 1e-6);
        assert_eq!(&qkv[..12], &before[..12], "position 0 is the identity");
        assert_eq!(&qkv[20..], &before[20..]);
    }

    #[test]
    fn backward_matches_finite_differences_and_inverts() {
        let (b, t, c, nh, theta) = (2, 3, 8, 2, 10_000.0);
        let x = randn(1, b * t * 3 * c, 1.0);
        let w = randn(2, b * t * 3 * c, 1.0);
        let mut g = w.clone();
        rope_backward(&mut g, b, t, c, nh, theta);
        let loss = |x: &[f32]| {
            let mut y = x.to_vec();
            rope_forward(&mut y, b, t, c, nh, theta);
            weighted_sum(&y, &w)
        };
        check_grad(loss, &x, &g, 1e-2, 1e-3).unwrap();
        let mut y = x.clone();
        rope_forward(&mut y, b, t, c, nh, theta);
        rope_backward(&mut y, b, t, c, nh, theta);
        assert!(y.iter().zip(&x).all(|(a, b)| (a - b).abs() < 1e-5));
    }
}
