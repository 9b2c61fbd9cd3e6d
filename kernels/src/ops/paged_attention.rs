//! Causal attention of a decoding step's query rows over a paged key/value cache (forward only:
//! inference).
//!
//! The cache of one layer is `k`, `v`: `num_blocks` blocks of `bs` positions, each position a
//! row of `kv = nkv·hd` floats (block `b`, slot `s` at `(b·bs + s)·kv`). A sequence's position
//! `p` lives in block `table[p / bs]`, slot `p % bs`. A step's rows are the q/k/v projections
//! (rows of `Groups::row()` columns: q, then k, then v, as [`super::gqa`] lays them out) of
//! several sequences, each a run of consecutive positions [`PagedSeq`]:
//!
//!   write:  k_cache[p] = k_r,  v_cache[p] = v_r            for each row r at position p
//!   attend: out[r, h] = Σ_{s ≤ p} softmax_s(q_{r,h} · k_{s,j} / √hd) · v_{s,j},  j = h / (nh / nkv)
//!
//! Query head `h` reads key/value head `j` in place (no widening as in training). Each (row,
//! head) is one task whose sums run over positions in order, so a row's result does not depend
//! on the other rows of the step, the thread count or the block layout.

use std::ops::Range;

use rayon::prelude::*;

use super::gqa::Groups;
use crate::tensor::{dot_f32, exp_f32, max_f32, sum_f32};

/// One sequence's rows in a step: rows `rows` of the step are its positions `start..`, and
/// `table` names its cache blocks (covering at least `start + rows.len()` positions).
#[derive(Clone, Debug)]
pub struct PagedSeq<'a> {
    pub rows: Range<usize>,
    pub start: usize,
    pub table: &'a [u32],
}

impl PagedSeq<'_> {
    /// Position of step row `r` (one of `self.rows`).
    pub fn pos(&self, r: usize) -> usize {
        self.start + (r - self.rows.start)
    }
}

/// Float offset of position `p` of a sequence with block `table` in a cache of blocks of `bs`
/// positions of `kv` floats.
fn slot(table: &[u32], p: usize, bs: usize, kv: usize) -> usize {
    (table[p / bs] as usize * bs + p % bs) * kv
}

/// Copies each step row's k and v (columns `c..c + kv` and `c + kv..` of `qkv`'s rows) into its
/// sequence's cache slots.
///
/// # Panics
/// If a table is too short or names a block past the cache (callers validate tables first).
pub fn write_kv(k: &mut [f32], v: &mut [f32], qkv: &[f32], seqs: &[PagedSeq], bs: usize, gr: Groups) {
    let (c, kv, row) = (gr.c, gr.kv(), gr.row());
    for seq in seqs {
        for r in seq.rows.clone() {
            let at = slot(seq.table, seq.pos(r), bs, kv);
            let src = &qkv[r * row..][..row];
            k[at..at + kv].copy_from_slice(&src[c..c + kv]);
            v[at..at + kv].copy_from_slice(&src[c + kv..]);
        }
    }
}

/// `out [n, c]` = the attention of every step row's query heads over its sequence's positions
/// `0..=pos` in the cache (which [`write_kv`] has filled for this step's rows).
pub fn paged_attention_forward(out: &mut [f32], qkv: &[f32], k: &[f32], v: &[f32], seqs: &[PagedSeq], bs: usize, gr: Groups) {
    let (c, hd, kv, row) = (gr.c, gr.hd(), gr.kv(), gr.row());
    let n = qkv.len() / row;
    assert_eq!(out.len(), n * c, "paged_attention: out must be [N, C]");
    assert_eq!(k.len(), v.len(), "paged_attention: the key and value caches differ in size");
    let mut seq_of = vec![usize::MAX; n];
    for (i, s) in seqs.iter().enumerate() {
        seq_of[s.rows.clone()].iter_mut().for_each(|x| *x = i);
    }
    assert!(seq_of.iter().all(|&i| i != usize::MAX), "paged_attention: a row belongs to no sequence");
    let (scale, group) = (1.0 / (hd as f32).sqrt(), gr.nh / gr.nkv);
    out.par_chunks_mut(hd).enumerate().for_each_init(Vec::new, |scores: &mut Vec<f32>, (i, o)| {
        let (r, h) = (i / gr.nh, i % gr.nh);
        let seq = &seqs[seq_of[r]];
        let (q, j) = (&qkv[r * row + h * hd..][..hd], h / group);
        let len = seq.pos(r) + 1;
        scores.clear();
        scores.extend((0..len).map(|s| scale * dot_f32(q, &k[slot(seq.table, s, bs, kv) + j * hd..][..hd])));
        let m = max_f32(scores);
        scores.iter_mut().for_each(|x| *x = exp_f32(*x - m));
        let inv = 1.0 / sum_f32(scores);
        o.fill(0.0);
        for (s, &w) in scores.iter().enumerate() {
            let vs = &v[slot(seq.table, s, bs, kv) + j * hd..][..hd];
            o.iter_mut().zip(vs).for_each(|(o, v)| *o += w * v);
        }
        o.iter_mut().for_each(|x| *x *= inv);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{randn, rel_err};
    use crate::ops::{attention, gqa};

    /// Two sequences of `t` positions through a scattered block layout, written over three
    /// steps (a chunk of 3 rows, then 2, then the rest), against the training attention over
    /// the whole window with the key/value heads widened.
    fn matches_full_attention(gr: Groups) {
        let (t, bs) = (11, 4);
        let row = gr.row();
        let qkv = [randn(1, t * row, 1.0), randn(2, t * row, 1.0)];
        let tables: [&[u32]; 2] = [&[5, 0, 3], &[1, 6, 2]];
        let (mut k, mut v) = (vec![f32::NAN; 7 * bs * gr.kv()], vec![f32::NAN; 7 * bs * gr.kv()]);
        let mut got = [vec![0.0; t * gr.c], vec![0.0; t * gr.c]];
        for span in [0..3, 3..5, 5..t] {
            let n = span.len();
            let rows: Vec<f32> = qkv.iter().flat_map(|q| q[span.start * row..span.end * row].to_vec()).collect();
            let seqs: Vec<PagedSeq> = (0..2).map(|i| PagedSeq { rows: i * n..(i + 1) * n, start: span.start, table: tables[i] }).collect();
            write_kv(&mut k, &mut v, &rows, &seqs, bs, gr);
            let mut out = vec![0.0; 2 * n * gr.c];
            paged_attention_forward(&mut out, &rows, &k, &v, &seqs, bs, gr);
            for i in 0..2 {
                got[i][span.start * gr.c..span.end * gr.c].copy_from_slice(&out[i * n * gr.c..(i + 1) * n * gr.c]);
            }
        }
        for i in 0..2 {
            let mut full = vec![0.0; t * 3 * gr.c];
            gqa::repeat_kv_forward(&mut full, &qkv[i], gr);
            let (mut want, mut att) = (vec![0.0; t * gr.c], vec![0.0; gr.nh * t * t]);
            attention::attention_forward(&mut want, &mut att, &full, 1, t, gr.c, gr.nh);
            let e = rel_err(&got[i], &want);
            assert!(e < 1e-5, "{gr:?}: sequence {i}: rel err {e:e} against the full causal attention");
        }
    }

    #[test]
    fn chunked_steps_match_full_causal_attention() {
        matches_full_attention(Groups { c: 16, nh: 4, nkv: 4 });
    }

    #[test]
    fn grouped_heads_match_widened_attention() {
        matches_full_attention(Groups { c: 24, nh: 6, nkv: 2 });
        matches_full_attention(Groups { c: 16, nh: 4, nkv: 1 });
    }

    #[test]
    fn a_row_reads_only_its_own_sequence() {
        // The same query over the same cached positions gives the same bits whatever else the
        // step holds (the other sequence's blocks are overwritten between the two calls).
        let gr = Groups { c: 8, nh: 2, nkv: 2 };
        let (bs, row) = (2, gr.row());
        let qkv = randn(3, 2 * row, 1.0);
        let (mut k, mut v) = (randn(4, 4 * bs * gr.kv(), 1.0), randn(5, 4 * bs * gr.kv(), 1.0));
        let seqs = [PagedSeq { rows: 0..1, start: 2, table: &[0, 1] }, PagedSeq { rows: 1..2, start: 0, table: &[3] }];
        let mut a = vec![0.0; 2 * gr.c];
        write_kv(&mut k, &mut v, &qkv, &seqs, bs, gr);
        paged_attention_forward(&mut a, &qkv, &k, &v, &seqs, bs, gr);
        k[3 * bs * gr.kv()..].fill(9.0);
        let mut b = vec![0.0; gr.c];
        paged_attention_forward(&mut b, &qkv[..row], &k, &v, &seqs[..1], bs, gr);
        assert_eq!(a[..gr.c], b[..]);
    }
}
