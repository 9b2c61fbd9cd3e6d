//! Int8 weight-only quantization of a linear layer, per output channel (inference).
//!
//! A weight `W [ic, oc]` (the layout of [`crate::ops::linear`]) is stored as `q [oc, ic]` int8 and
//! one scale per output channel:
//!
//!   s_j = max_i |W_ij| / 127,   q_ji = round(W_ij / s_j) ∈ [−127, 127]
//!   y_rj = s_j · Σ_i x_ri · q_ji  (+ b_j)
//!
//! so the product reads a quarter of the f32 weight's bytes; activations stay f32. Each output
//! is one dot product over `i` in a fixed lane order, so a row's result does not depend on the
//! other rows or on threads.

use std::collections::HashMap;

use rayon::prelude::*;

use crate::ops::linear;
use crate::tensor::simd_dispatch;

/// Lanes of the int8 dot product's partial sums.
const LANES: usize = 16;

/// A linear layer's weight as int8 with per-output-channel scales.
#[derive(Clone, Debug)]
pub struct QuantMatrix {
    /// `[oc, ic]`: row `j` is output channel `j`.
    q: Vec<i8>,
    scale: Vec<f32>,
    ic: usize,
    oc: usize,
}

impl QuantMatrix {
    /// Quantizes `w [ic, oc]` (input-major, a linear layer's layout).
    pub fn from_in_out(w: &[f32], ic: usize, oc: usize) -> QuantMatrix {
        assert_eq!(w.len(), ic * oc, "quantize: weight must be [IC, OC]");
        QuantMatrix::quantize(ic, oc, |j, i| w[i * oc + j])
    }

    /// Quantizes `w [oc, ic]` (output-major, e.g. an LM head `[v, c]` used as `x · Wᵀ`).
    pub fn from_out_in(w: &[f32], oc: usize, ic: usize) -> QuantMatrix {
        assert_eq!(w.len(), ic * oc, "quantize: weight must be [OC, IC]");
        QuantMatrix::quantize(ic, oc, |j, i| w[j * ic + i])
    }

    fn quantize(ic: usize, oc: usize, at: impl Fn(usize, usize) -> f32 + Sync) -> QuantMatrix {
        let mut q = vec![0i8; oc * ic];
        let mut scale = vec![0f32; oc];
        q.par_chunks_mut(ic.max(1)).zip(scale.par_iter_mut()).enumerate().for_each(|(j, (row, s))| {
            let max = (0..ic).map(|i| at(j, i).abs()).fold(0f32, f32::max);
            *s = max / 127.0;
            let inv = if max > 0.0 { 127.0 / max } else { 0.0 };
            row.iter_mut().enumerate().for_each(|(i, q)| *q = (at(j, i) * inv).round().clamp(-127.0, 127.0) as i8);
        });
        QuantMatrix { q, scale, ic, oc }
    }

    pub fn shape(&self) -> (usize, usize) {
        (self.ic, self.oc)
    }

    /// Each output channel's scale (`max |W_·j| / 127`).
    pub fn scales(&self) -> &[f32] {
        &self.scale
    }

    /// Bytes held (int8 weights and f32 scales).
    pub fn bytes(&self) -> usize {
        self.q.len() + 4 * self.scale.len()
    }

    /// The weight as f32 `[ic, oc]` (what the product computes with).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut w = vec![0f32; self.ic * self.oc];
        for (j, row) in self.q.chunks_exact(self.ic.max(1)).enumerate() {
            row.iter().enumerate().for_each(|(i, &q)| w[i * self.oc + j] = f32::from(q) * self.scale[j]);
        }
        w
    }

    /// `out [n, oc] = x [n, ic] · W (+ bias)`, overwriting `out`.
    pub fn forward(&self, out: &mut [f32], x: &[f32], bias: Option<&[f32]>, n: usize) {
        let (ic, oc) = (self.ic, self.oc);
        assert_eq!(x.len(), n * ic, "int8 linear: x must be [N, IC]");
        assert_eq!(out.len(), n * oc, "int8 linear: out must be [N, OC]");
        if let Some(b) = bias {
            assert_eq!(b.len(), oc, "int8 linear: bias must be [OC]");
        }
        let y = |j: usize, r: usize| self.scale[j] * dot_i8(&x[r * ic..][..ic], &self.q[j * ic..][..ic]) + bias.map_or(0.0, |b| b[j]);
        if n == 0 {
            return;
        }
        if n == 1 {
            out.par_iter_mut().enumerate().with_min_len(64).for_each(|(j, o)| *o = y(j, 0));
            return;
        }
        // Output-channel-major, so each int8 row is read once for all `n` inputs and converted
        // once for every [`ROWS`] of them (a short last group repeats its last row).
        let mut t = vec![0f32; oc * n];
        t.par_chunks_mut(n).enumerate().with_min_len(16).for_each(|(j, col)| {
            let (q, b) = (&self.q[j * ic..][..ic], bias.map_or(0.0, |b| b[j]));
            for (g, part) in col.chunks_mut(ROWS).enumerate() {
                let rows: [&[f32]; ROWS] = std::array::from_fn(|k| {
                    let r = g * ROWS + k.min(part.len() - 1);
                    &x[r * ic..][..ic]
                });
                let d = dot_i8_rows(rows, q);
                part.iter_mut().zip(d).for_each(|(o, d)| *o = self.scale[j] * d + b);
            }
        });
        out.par_chunks_mut(oc).enumerate().for_each(|(r, row)| row.iter_mut().enumerate().for_each(|(j, o)| *o = t[j * n + r]));
    }
}

/// A unit's int8 linears, keyed by each weight's offset in the unit.
pub type QuantUnit = HashMap<usize, QuantMatrix>;

/// `out [n, oc] = x [n, ic] · W (+ bias)`, overwriting `out`: through `int8`'s copy of the weight
/// at unit offset `at` when it holds one, else through the f32 weight `w [ic, oc]`.
#[allow(clippy::too_many_arguments)]
pub fn linear_forward(
    int8: Option<&QuantUnit>,
    at: usize,
    out: &mut [f32],
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    ic: usize,
    oc: usize,
) {
    let n = x.len() / ic;
    match int8.and_then(|q| q.get(&at)) {
        Some(m) => m.forward(out, x, bias, n),
        None => linear::linear_forward(out, x, w, bias, n, ic, oc),
    }
}

/// Input rows sharing one conversion of an int8 row in [`QuantMatrix::forward`].
const ROWS: usize = 4;

/// Sums `acc`'s lanes pairwise (the fixed order every int8 product uses).
#[inline(always)]
fn reduce_lanes(mut acc: [f32; LANES]) -> f32 {
    let mut w = LANES;
    while w > 1 {
        w /= 2;
        for l in 0..w {
            acc[l] += acc[l + w];
        }
    }
    acc[0]
}

/// [`dot_i8`] of each of `x` with one `q`: the same operations per row, so the same bits.
#[inline(always)]
fn dot_i8_rows_body(x: [&[f32]; ROWS], q: &[i8]) -> [f32; ROWS] {
    let mut acc = [[0f32; LANES]; ROWS];
    let full = q.len() / LANES * LANES;
    for c in (0..full).step_by(LANES) {
        let w: [f32; LANES] = std::array::from_fn(|l| f32::from(q[c + l]));
        for (a, x) in acc.iter_mut().zip(&x) {
            let x: &[f32; LANES] = x[c..c + LANES].try_into().expect("a full chunk");
            for l in 0..LANES {
                a[l] += x[l] * w[l];
            }
        }
    }
    for (a, x) in acc.iter_mut().zip(&x) {
        for (l, i) in (full..q.len()).enumerate() {
            a[l] += x[i] * f32::from(q[i]);
        }
    }
    acc.map(reduce_lanes)
}

simd_dispatch!(fn dot_i8_rows(x: [&[f32]; ROWS], q: &[i8]) -> [f32; ROWS] => dot_i8_rows_body);

/// Σ x_i · q_i in a fixed lane order.
#[inline(always)]
fn dot_i8_body(x: &[f32], q: &[i8]) -> f32 {
    let mut acc = [0f32; LANES];
    let (mut cx, mut cq) = (x.chunks_exact(LANES), q.chunks_exact(LANES));
    for (a, b) in (&mut cx).zip(&mut cq) {
        for l in 0..LANES {
            acc[l] += a[l] * f32::from(b[l]);
        }
    }
    for (l, (a, b)) in cx.remainder().iter().zip(cq.remainder()).enumerate() {
        acc[l] += a * f32::from(*b);
    }
    reduce_lanes(acc)
}

simd_dispatch!(fn dot_i8(x: &[f32], q: &[i8]) -> f32 => dot_i8_body);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{randn, rel_err};
    use crate::ops::linear;

    #[test]
    fn scales_are_per_output_channel_and_exact_on_the_grid() {
        // Column 0 spans ±2, column 1 ±0.5: each gets its own scale.
        let w = [2.0, 0.5, -2.0, -0.25, 0.0, 0.5];
        let m = QuantMatrix::from_in_out(&w, 3, 2);
        assert_eq!(m.scale, [2.0 / 127.0, 0.5 / 127.0]);
        // -0.25 is half a step off the grid of column 1 (−63.5 steps): it rounds away from 0.
        let back = m.dequantize();
        let want = [2.0, 0.5, -2.0, -64.0 * 0.5 / 127.0, 0.0, 0.5];
        assert!(back.iter().zip(&want).all(|(a, b)| (a - b).abs() <= 1e-6), "{back:?}");
        assert_eq!(m.q, [127, -127, 0, 127, -64, 127]);
    }

    #[test]
    fn product_equals_the_f32_linear_of_the_dequantized_weight() {
        for n in [1, 5] {
            let (ic, oc) = (37, 19);
            let (x, w, b) = (randn(1, n * ic, 1.0), randn(2, ic * oc, 0.1), randn(3, oc, 1.0));
            let m = QuantMatrix::from_in_out(&w, ic, oc);
            let (mut got, mut want) = (vec![0.0; n * oc], vec![0.0; n * oc]);
            m.forward(&mut got, &x, Some(&b), n);
            linear::linear_forward(&mut want, &x, &m.dequantize(), Some(&b), n, ic, oc);
            let e = rel_err(&got, &want);
            assert!(e < 1e-5, "n {n}: rel err {e:e}");
            // …and near the unquantized product: each weight is off by at most half a step.
            linear::linear_forward(&mut want, &x, &w, Some(&b), n, ic, oc);
            let e = rel_err(&got, &want);
            assert!(e < 2e-2, "n {n}: rel err {e:e} against the f32 weight");
        }
    }

    #[test]
    fn a_row_gives_the_same_bits_alone_or_among_others() {
        let (ic, oc) = (45, 7);
        let (x, w) = (randn(5, 6 * ic, 1.0), randn(6, ic * oc, 0.1));
        let m = QuantMatrix::from_in_out(&w, ic, oc);
        let mut all = vec![0.0; 6 * oc];
        m.forward(&mut all, &x, None, 6);
        for r in 0..6 {
            let mut one = vec![0.0; oc];
            m.forward(&mut one, &x[r * ic..(r + 1) * ic], None, 1);
            assert_eq!(one, all[r * oc..(r + 1) * oc], "row {r}");
        }
    }

    #[test]
    fn output_major_weights_quantize_per_row() {
        let (oc, ic) = (4, 6);
        let w = randn(4, oc * ic, 1.0);
        let a = QuantMatrix::from_out_in(&w, oc, ic);
        let t: Vec<f32> = (0..ic * oc).map(|k| w[(k % oc) * ic + k / oc]).collect();
        let b = QuantMatrix::from_in_out(&t, ic, oc);
        assert_eq!((a.q, a.scale), (b.q, b.scale));
    }
}
