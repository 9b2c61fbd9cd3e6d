//! Grouped-query attention's key/value sharing: a projection with `nkv` key and value heads
//! (rows `[q | k | v]` of `C + 2·nkv·hd` columns) is widened to the `[q | k | v]` rows of `3C`
//! that [`super::attention`] takes, query head `h` reading key/value head `h / (nh / nkv)`
//! (transformers' `repeat_kv`); the backward sums each group's gradients back.

/// Column layout of a grouped projection row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Groups {
    /// Model width (q columns).
    pub c: usize,
    /// Query heads.
    pub nh: usize,
    /// Key/value heads (divides `nh`).
    pub nkv: usize,
}

impl Groups {
    pub fn hd(&self) -> usize {
        self.c / self.nh
    }
    /// Width of k (and of v) in a grouped row.
    pub fn kv(&self) -> usize {
        self.nkv * self.hd()
    }
    /// Width of a grouped row: q, then k, then v.
    pub fn row(&self) -> usize {
        self.c + 2 * self.kv()
    }
    fn check(&self, grouped: usize, full: usize) -> usize {
        assert!(self.nkv > 0 && self.nh % self.nkv == 0 && self.c % self.nh == 0, "gqa: {self:?}");
        assert!(grouped % self.row() == 0 && full == grouped / self.row() * 3 * self.c, "gqa: buffer sizes {grouped}, {full}");
        grouped / self.row()
    }
}

/// full[r] = [q | k_{h/g} for each h | v_{h/g} for each h] of grouped[r], g = nh / nkv.
pub fn repeat_kv_forward(full: &mut [f32], grouped: &[f32], gr: Groups) {
    let n = gr.check(grouped.len(), full.len());
    let (c, hd, kv, g) = (gr.c, gr.hd(), gr.kv(), gr.nh / gr.nkv);
    for r in 0..n {
        let src = &grouped[r * gr.row()..][..gr.row()];
        let dst = &mut full[r * 3 * c..][..3 * c];
        dst[..c].copy_from_slice(&src[..c]);
        for h in 0..gr.nh {
            let j = h / g;
            dst[c + h * hd..][..hd].copy_from_slice(&src[c + j * hd..][..hd]);
            dst[2 * c + h * hd..][..hd].copy_from_slice(&src[c + kv + j * hd..][..hd]);
        }
    }
}

/// d(grouped) ← the transpose of [`repeat_kv_forward`] of d(full): dq copied, each key/value
/// head's gradient the sum over its group's query heads in head order. Overwrites `dgrouped`.
pub fn repeat_kv_backward(dgrouped: &mut [f32], dfull: &[f32], gr: Groups) {
    let n = gr.check(dgrouped.len(), dfull.len());
    let (c, hd, kv, g) = (gr.c, gr.hd(), gr.kv(), gr.nh / gr.nkv);
    for r in 0..n {
        let src = &dfull[r * 3 * c..][..3 * c];
        let dst = &mut dgrouped[r * gr.row()..][..gr.row()];
        dst[..c].copy_from_slice(&src[..c]);
        dst[c..].fill(0.0);
        for h in 0..gr.nh {
            let j = h / g;
            for (part, off) in [(c, c + j * hd), (2 * c, c + kv + j * hd)] {
                let s = &src[part + h * hd..][..hd];
                dst[off..off + hd].iter_mut().zip(s).for_each(|(d, s)| *d += s);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check_grad, randn, weighted_sum};

    #[test]
    fn query_heads_share_their_groups_key_and_value() {
        // C = 4, 4 heads of 1, 2 kv heads: row [q0 q1 q2 q3 | k0 k1 | v0 v1].
        let gr = Groups { c: 4, nh: 4, nkv: 2 };
        let grouped = [1.0, 2.0, 3.0, 4.0, 10.0, 20.0, 100.0, 200.0];
        let mut full = vec![0.0; 12];
        repeat_kv_forward(&mut full, &grouped, gr);
        assert_eq!(full, [1.0, 2.0, 3.0, 4.0, 10.0, 10.0, 20.0, 20.0, 100.0, 100.0, 200.0, 200.0]);
    }

    #[test]
    fn backward_matches_finite_differences() {
        let gr = Groups { c: 12, nh: 6, nkv: 2 };
        let n = 3;
        let x = randn(5, n * gr.row(), 1.0);
        let w = randn(6, n * 3 * gr.c, 1.0);
        let mut g = vec![7.0; n * gr.row()];
        repeat_kv_backward(&mut g, &w, gr);
        let loss = |x: &[f32]| {
            let mut y = vec![0.0; n * 3 * gr.c];
            repeat_kv_forward(&mut y, x, gr);
            weighted_sum(&y, &w)
        };
        check_grad(loss, &x, &g, 1e-2, 1e-3).unwrap();
    }
}
