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
    /// Table for positions 0..t and head size `hd` (must be even), unscaled frequencies.
    pub fn new(t: usize, hd: usize, theta: f32) -> RopeTable {
        RopeTable::with_inv_freq(t, &inv_freq(hd, theta, None))
    }

    /// Table for positions 0..t from the frequencies of each pair ([`inv_freq`]).
    pub fn with_inv_freq(t: usize, inv_freq: &[f64]) -> RopeTable {
        let half = inv_freq.len();
        let mut cos = vec![0f32; t * half];
        let mut sin = vec![0f32; t * half];
        for pos in 0..t {
            for (i, f) in inv_freq.iter().enumerate() {
                let (s, c) = (pos as f64 * f).sin_cos();
                cos[pos * half + i] = c as f32;
                sin[pos * half + i] = s as f32;
            }
        }
        RopeTable { half, cos, sin }
    }

    /// cos of angle(pos, i) at `pos · hd/2 + i` ([T, hd/2], f32; the GPU kernels take this table).
    pub fn cos(&self) -> &[f32] {
        &self.cos
    }

    /// sin of angle(pos, i), laid out as [`RopeTable::cos`].
    pub fn sin(&self) -> &[f32] {
        &self.sin
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

/// LLaMA 3's frequency scaling (transformers' `rope_type: "llama3"`): wavelengths longer than
/// `original_max_position_embeddings / low_freq_factor` are stretched by `factor`, those
/// shorter than `original_max_position_embeddings / high_freq_factor` are kept, and the band
/// between is interpolated smoothly.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: f64,
}

/// Frequency of each of the `hd / 2` rotation pairs: θ^(−2i/hd), scaled by `scaling`.
pub fn inv_freq(hd: usize, theta: f32, scaling: Option<&RopeScaling>) -> Vec<f64> {
    assert!(hd % 2 == 0, "rope: head size {hd} must be even");
    let base: Vec<f64> = (0..hd / 2).map(|i| f64::from(theta).powf(-2.0 * i as f64 / hd as f64)).collect();
    let Some(s) = scaling else { return base };
    let low_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
    let high_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
    base.into_iter()
        .map(|f| {
            let wavelen = 2.0 * std::f64::consts::PI / f;
            if wavelen > low_wavelen {
                f / s.factor
            } else if wavelen < high_wavelen {
                f
            } else {
                let smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                (1.0 - smooth) * f / s.factor + smooth * f
            }
        })
        .collect()
}

/// Applies `rotate` to every head of the first `rot` columns of each row of `qkv` (rows of
/// `row` columns; the q heads and then the k heads, `hd` wide), row `r` at position `pos(r)`.
fn rotate_rows(qkv: &mut [f32], pos: impl Fn(usize) -> usize + Sync, row: usize, rot: usize, table: &RopeTable, inverse: bool) {
    let hd = 2 * table.half;
    assert!(row > 0 && qkv.len() % row == 0 && rot <= row && rot % hd == 0, "rope: rows of {row}, {rot} rotated, head size {hd}");
    qkv.par_chunks_mut(row).enumerate().for_each(|(r, x)| {
        for head in x[..rot].chunks_exact_mut(hd) {
            table.rotate(head, pos(r), inverse);
        }
    });
}

/// q, k ← RoPE(q, k) in place on rows of `row` columns whose first `rot` columns are the q
/// and k heads (grouped-query attention has fewer k heads than q heads); v untouched. Row
/// `r` is at position `r mod t`.
pub fn rope_forward_rows(qkv: &mut [f32], t: usize, row: usize, rot: usize, table: &RopeTable) {
    rotate_rows(qkv, |r| r % t, row, rot, table, false);
}

/// [`rope_forward_rows`] with each row's position given (a decoding step's rows belong to
/// several sequences, each at its own offset). `table` must cover every position.
pub fn rope_forward_at(qkv: &mut [f32], pos: impl Fn(usize) -> usize + Sync, row: usize, rot: usize, table: &RopeTable) {
    rotate_rows(qkv, pos, row, rot, table, false);
}

/// The transpose of [`rope_forward_rows`] on the gradient (see [`rope_backward`]).
pub fn rope_backward_rows(dqkv: &mut [f32], t: usize, row: usize, rot: usize, table: &RopeTable) {
    rotate_rows(dqkv, |r| r % t, row, rot, table, true);
}

/// Applies `rotate` to every head of the q (cols 0..C) and k (cols C..2C) parts of [B·T, 3C].
fn rotate_qk(qkv: &mut [f32], b: usize, t: usize, c: usize, nh: usize, theta: f32, inverse: bool) {
    assert_eq!(qkv.len(), b * t * 3 * c, "rope: qkv must be [B*T, 3C]");
    assert!(nh > 0 && c > 0 && c % nh == 0, "rope: C={c} must be a positive multiple of nh={nh}");
    let table = RopeTable::new(t, c / nh, theta);
    rotate_rows(qkv, |r| r % t, 3 * c, 2 * c, &table, inverse);
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

    #[test]
    fn grouped_rows_backward_matches_finite_differences() {
        // 4 q heads and 2 k heads of 4 (rot = 24 of 32 columns), LLaMA 3 scaled frequencies.
        let (t, row, rot, hd) = (3, 32, 24, 4);
        let scaling = RopeScaling { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 8.0 };
        let table = RopeTable::with_inv_freq(t, &inv_freq(hd, 500_000.0, Some(&scaling)));
        let x = randn(3, 2 * t * row, 1.0);
        let w = randn(4, 2 * t * row, 1.0);
        let mut g = w.clone();
        rope_backward_rows(&mut g, t, row, rot, &table);
        let loss = |x: &[f32]| {
            let mut y = x.to_vec();
            rope_forward_rows(&mut y, t, row, rot, &table);
            weighted_sum(&y, &w)
        };
        check_grad(loss, &x, &g, 1e-2, 1e-3).unwrap();
        let mut y = x.clone();
        rope_forward_rows(&mut y, t, row, rot, &table);
        assert!(y.chunks(row).all(|r| r.len() == row));
        assert_eq!(&y[rot..row], &x[rot..row], "the v columns are untouched");
    }

    #[test]
    fn llama3_scaling_stretches_long_wavelengths_and_keeps_short_ones() {
        let s = RopeScaling { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 8192.0 };
        let (plain, scaled) = (inv_freq(128, 500_000.0, None), inv_freq(128, 500_000.0, Some(&s)));
        assert_eq!(plain[0], scaled[0], "the highest frequency (wavelength 2π) is kept");
        assert!((scaled[63] - plain[63] / 8.0).abs() < 1e-18, "the lowest frequency is divided by the factor");
        let mid = (0..64).find(|&i| scaled[i] != plain[i] && (scaled[i] - plain[i] / 8.0).abs() > 1e-18);
        assert!(mid.is_some(), "some frequencies lie in the smoothed band");
    }
}
