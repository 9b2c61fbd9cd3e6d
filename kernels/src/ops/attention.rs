//! Causal multi-head self-attention over a fused qkv buffer (llm.c layout), forward and backward.
//!
//! qkv is [B, T, 3C]: q = cols 0..C, k = C..2C, v = 2C..3C, head h at cols h·hd..(h+1)·hd of each
//! part (hd = C/NH). Work is parallel over (b, head); inside a head, row blocks of [`BLOCK`]
//! rows skip the masked upper triangle, and products run through single-threaded GEMM.
//! Scratch: per-(b, head) results go to a buffer kept in a thread-local of the calling thread
//! (forward B·T·C floats, backward 3·B·T·C) and are then scattered into the caller's layout;
//! the backward also keeps one T×T buffer per worker thread. The buffers are reused across
//! calls (no allocation or page faults in steady state) and every element used is overwritten
//! before it is read, so results never depend on what they held before.
// Allowed: the ops keep llm.c's signatures (outputs, then inputs, then the shape), so each call
// reads against the math above it; a struct of buffers would hide which ones an op writes.
#![allow(clippy::too_many_arguments)]

use std::cell::RefCell;
use std::thread::LocalKey;

use rayon::prelude::*;

use crate::gemm::{gemm_strided, MatMut, MatRef};
use crate::tensor::{add_assign, dot_f32, exp_f32, max_f32, simd_dispatch, sum_f32};

/// Query rows per causal block.
const BLOCK: usize = 64;

thread_local! {
    static HEADS_SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    static DS_SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on `len` floats of the thread-local buffer `key` (grown as needed, contents
/// unspecified); falls back to a fresh buffer if this thread is already using it (re-entrant
/// calls through rayon work stealing).
fn with_scratch<R>(key: &'static LocalKey<RefCell<Vec<f32>>>, len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    key.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buf) => {
            if buf.len() < len {
                buf.resize(len, 0.0);
            }
            f(&mut buf[..len])
        }
        Err(_) => f(&mut vec![0.0; len]),
    })
}

/// Strided views of one (b, head)'s q, k, v inside qkv.
struct HeadViews<'a> {
    q: MatRef<'a>,
    k: MatRef<'a>,
    v: MatRef<'a>,
}

fn head_views(qkv: &[f32], bb: usize, h: usize, t: usize, c: usize, hd: usize) -> HeadViews<'_> {
    let base = bb * t * 3 * c + h * hd;
    let view = |off: usize| MatRef::new(&qkv[base + off..], t, hd, 3 * c, 1);
    HeadViews { q: view(0), k: view(c), v: view(2 * c) }
}

fn check_shapes(qkv: &[f32], att: &[f32], b: usize, t: usize, c: usize, nh: usize) -> usize {
    assert!(nh > 0 && c > 0 && c % nh == 0, "attention: C={c} must be a positive multiple of nh={nh}");
    assert_eq!(qkv.len(), b * t * 3 * c, "attention: qkv must be [B*T, 3C]");
    assert_eq!(att.len(), b * nh * t * t, "attention: att must be [B, NH, T, T]");
    c / nh
}

/// One head: S = scale·Q·Kᵀ (causal), P = softmax_rows(S) → `p` [T×T] (zeros above the
/// diagonal), O = P·V → `o` [T×hd].
fn head_forward(o: &mut [f32], p: &mut [f32], hv: &HeadViews, t: usize, hd: usize, scale: f32) {
    for r0 in (0..t).step_by(BLOCK) {
        let r1 = (r0 + BLOCK).min(t);
        let s_blk = MatMut::new(&mut p[r0 * t..], r1 - r0, r1, t, 1);
        gemm_strided(s_blk, hv.q.rows(r0, r1), hv.k.rows(0, r1).t(), 0.0, scale, false);
        for i in r0..r1 {
            let (live, masked) = p[i * t..][..t].split_at_mut(i + 1);
            softmax_in_place(live);
            masked.fill(0.0);
        }
        let p_blk = MatRef::new(&p[r0 * t..], r1 - r0, r1, t, 1);
        let o_blk = MatMut::new(&mut o[r0 * hd..], r1 - r0, hd, hd, 1);
        gemm_strided(o_blk, p_blk, hv.v.rows(0, r1), 0.0, 1.0, false);
    }
}

/// s ← softmax(s) = e^(s − max s) / Σ e^(s − max s).
#[inline(always)]
fn softmax_in_place_body(s: &mut [f32]) {
    let m = max_f32(s);
    s.iter_mut().for_each(|v| *v = exp_f32(*v - m));
    let inv = 1.0 / sum_f32(s);
    s.iter_mut().for_each(|v| *v *= inv);
}

simd_dispatch!(fn softmax_in_place(s: &mut [f32]) => softmax_in_place_body);

/// d ← p ⊙ (d − Σ p·d)   (softmax backward of one row).
#[inline(always)]
fn softmax_backward_row_body(d: &mut [f32], p: &[f32]) {
    let s = dot_f32(p, d);
    d.iter_mut().zip(p).for_each(|(d, &pv)| *d = pv * (*d - s));
}

simd_dispatch!(fn softmax_backward_row(d: &mut [f32], p: &[f32]) => softmax_backward_row_body);

/// out[b, t, h·hd..] = Σ_{s ≤ t} softmax_s(q_t·k_s / √hd) · v_s   per (b, head);
/// att[b, h, t, s] keeps the probabilities (0 for s > t) for the backward pass.
/// Shapes: out [B·T, C], att [B·NH·T·T], qkv [B·T, 3C].
pub fn attention_forward(out: &mut [f32], att: &mut [f32], qkv: &[f32], b: usize, t: usize, c: usize, nh: usize) {
    let hd = check_shapes(qkv, att, b, t, c, nh);
    assert_eq!(out.len(), b * t * c, "attention_forward: out must be [B*T, C]");
    if t == 0 || b == 0 {
        return;
    }
    let scale = 1.0 / (hd as f32).sqrt();
    with_scratch(&HEADS_SCRATCH, b * nh * t * hd, |o_heads| {
        o_heads.par_chunks_mut(t * hd).zip(att.par_chunks_mut(t * t)).enumerate().for_each(|(bh, (o, p))| {
            let hv = head_views(qkv, bh / nh, bh % nh, t, c, hd);
            head_forward(o, p, &hv, t, hd, scale);
        });
        out.par_chunks_mut(c).enumerate().for_each(|(bt, row)| {
            let (bb, tt) = (bt / t, bt % t);
            for (h, dst) in row.chunks_exact_mut(hd).enumerate() {
                dst.copy_from_slice(&o_heads[((bb * nh + h) * t + tt) * hd..][..hd]);
            }
        });
    });
}

/// One head's backward into `g` = [dQ | dK | dV], each [T×hd] (overwritten). `ds` is T×T scratch.
///   dP = dO·Vᵀ;  dS = P ⊙ (dP − rowsum(P ⊙ dP));  dQ = scale·dS·K;  dK = scale·dSᵀ·Q;  dV = Pᵀ·dO
fn head_backward(g: &mut [f32], ds: &mut [f32], p: &[f32], d_o: MatRef, hv: &HeadViews, t: usize, hd: usize, scale: f32) {
    let (dq, rest) = g.split_at_mut(t * hd);
    let (dk, dv) = rest.split_at_mut(t * hd);
    for r0 in (0..t).step_by(BLOCK) {
        let r1 = (r0 + BLOCK).min(t);
        let dp_blk = MatMut::new(&mut ds[r0 * t..], r1 - r0, r1, t, 1);
        gemm_strided(dp_blk, d_o.rows(r0, r1), hv.v.rows(0, r1).t(), 0.0, 1.0, false);
        for i in r0..r1 {
            let (live, masked) = ds[i * t..][..r1].split_at_mut(i + 1);
            softmax_backward_row(live, &p[i * t..][..=i]);
            masked.fill(0.0);
        }
        let ds_blk = MatRef::new(&ds[r0 * t..], r1 - r0, r1, t, 1);
        let dq_blk = MatMut::new(&mut dq[r0 * hd..], r1 - r0, hd, hd, 1);
        gemm_strided(dq_blk, ds_blk, hv.k.rows(0, r1), 0.0, scale, false);
    }
    // Key/value rows c0..c1 receive gradient only from query rows i ≥ c0.
    for c0 in (0..t).step_by(BLOCK) {
        let c1 = (c0 + BLOCK).min(t);
        let p_cols = MatRef::new(&p[c0 * t + c0..], t - c0, c1 - c0, t, 1);
        let dv_blk = MatMut::new(&mut dv[c0 * hd..], c1 - c0, hd, hd, 1);
        gemm_strided(dv_blk, p_cols.t(), d_o.rows(c0, t), 0.0, 1.0, false);
        let ds_cols = MatRef::new(&ds[c0 * t + c0..], t - c0, c1 - c0, t, 1);
        let dk_blk = MatMut::new(&mut dk[c0 * hd..], c1 - c0, hd, hd, 1);
        gemm_strided(dk_blk, ds_cols.t(), hv.q.rows(c0, t), 0.0, scale, false);
    }
}

/// dqkv += ∂loss/∂qkv given dout = ∂loss/∂out [B·T, C] and the forward's `att` probabilities.
/// Shapes as in [`attention_forward`]; dqkv [B·T, 3C] accumulates.
pub fn attention_backward(dqkv: &mut [f32], dout: &[f32], qkv: &[f32], att: &[f32], b: usize, t: usize, c: usize, nh: usize) {
    let hd = check_shapes(qkv, att, b, t, c, nh);
    assert_eq!(dqkv.len(), qkv.len(), "attention_backward: dqkv must be [B*T, 3C]");
    assert_eq!(dout.len(), b * t * c, "attention_backward: dout must be [B*T, C]");
    if t == 0 || b == 0 {
        return;
    }
    let scale = 1.0 / (hd as f32).sqrt();
    with_scratch(&HEADS_SCRATCH, b * nh * 3 * t * hd, |g_heads| {
        g_heads.par_chunks_mut(3 * t * hd).zip(att.par_chunks(t * t)).enumerate().for_each(|(bh, (g, p))| {
            let (bb, h) = (bh / nh, bh % nh);
            let hv = head_views(qkv, bb, h, t, c, hd);
            let d_o = MatRef::new(&dout[bb * t * c + h * hd..], t, hd, c, 1);
            with_scratch(&DS_SCRATCH, t * t, |ds| head_backward(g, ds, p, d_o, &hv, t, hd, scale));
        });
        dqkv.par_chunks_mut(3 * c).enumerate().for_each(|(bt, row)| {
            let (bb, tt) = (bt / t, bt % t);
            for (j, dst) in row.chunks_exact_mut(hd).enumerate() {
                let (part, h) = (j / nh, j % nh);
                let src = &g_heads[(((bb * nh + h) * 3 + part) * t + tt) * hd..][..hd];
                add_assign(dst, src);
            }
        });
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::{check_grad, randn, rel_err, weighted_sum};

    fn forward(qkv: &[f32], b: usize, t: usize, c: usize, nh: usize) -> (Vec<f32>, Vec<f32>) {
        let (mut out, mut att) = (vec![0f32; b * t * c], vec![0f32; b * nh * t * t]);
        attention_forward(&mut out, &mut att, qkv, b, t, c, nh);
        (out, att)
    }

    /// Straightforward f64 causal attention for reference.
    fn naive(qkv: &[f32], b: usize, t: usize, c: usize, nh: usize) -> Vec<f32> {
        let hd = c / nh;
        let at = |bb: usize, tt: usize, off: usize| &qkv[(bb * t + tt) * 3 * c + off..][..hd];
        let mut out = vec![0f32; b * t * c];
        for bb in 0..b {
            for h in 0..nh {
                for i in 0..t {
                    let q = at(bb, i, h * hd);
                    let s: Vec<f64> = (0..=i)
                        .map(|j| {
                            let k = at(bb, j, c + h * hd);
                            q.iter().zip(k).map(|(&x, &y)| x as f64 * y as f64).sum::<f64>() / (hd as f64).sqrt()
                        })
                        .collect();
                    let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = s.iter().map(|v| (v - m).exp()).sum();
                    for d in 0..hd {
                        let o: f64 = (0..=i).map(|j| (s[j] - m).exp() / z * at(bb, j, 2 * c + h * hd)[d] as f64).sum();
                        out[(bb * t + i) * c + h * hd + d] = o as f32;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn single_position_returns_v() {
        let (b, t, c, nh) = (2, 1, 6, 3);
        let qkv = randn(1, b * t * 3 * c, 1.0);
        let (out, att) = forward(&qkv, b, t, c, nh);
        for bb in 0..b {
            assert_eq!(&out[bb * c..(bb + 1) * c], &qkv[bb * 3 * c + 2 * c..(bb + 1) * 3 * c]);
        }
        assert!(att.iter().all(|&p| p == 1.0));
    }

    #[test]
    fn forward_matches_naive_across_blocks() {
        let (b, t, c, nh) = (2, BLOCK + 9, 8, 2);
        let qkv = randn(2, b * t * 3 * c, 1.0);
        let (out, att) = forward(&qkv, b, t, c, nh);
        let want = naive(&qkv, b, t, c, nh);
        assert!(rel_err(&out, &want) < 1e-5, "{}", rel_err(&out, &want));
        for row in att.chunks(t).take(5) {
            assert!((row.iter().map(|&v| v as f64).sum::<f64>() - 1.0).abs() < 1e-5);
        }
        assert_eq!(att[1], 0.0, "masked entries are zero");
    }

    fn check_backward(b: usize, t: usize, c: usize, nh: usize) {
        let qkv = randn(3, b * t * 3 * c, 1.0);
        let w = randn(4, b * t * c, 1.0);
        let (_, att) = forward(&qkv, b, t, c, nh);
        let mut dqkv = vec![0f32; qkv.len()];
        attention_backward(&mut dqkv, &w, &qkv, &att, b, t, c, nh);
        let loss = |x: &[f32]| weighted_sum(&forward(x, b, t, c, nh).0, &w);
        check_grad(loss, &qkv, &dqkv, 1e-2, 2e-2).unwrap();
    }

    #[test]
    fn backward_matches_finite_differences() {
        check_backward(2, 5, 8, 2);
    }

    #[test]
    fn backward_matches_finite_differences_across_blocks() {
        check_backward(1, BLOCK + 5, 4, 1);
    }

    #[test]
    fn forward_and_backward_are_deterministic() {
        let (b, t, c, nh) = (2, 2 * BLOCK + 3, 16, 4);
        let qkv = randn(5, b * t * 3 * c, 1.0);
        let dout = randn(6, b * t * c, 1.0);
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let (out, att) = forward(&qkv, b, t, c, nh);
                let mut dqkv = vec![0.25f32; qkv.len()];
                attention_backward(&mut dqkv, &dout, &qkv, &att, b, t, c, nh);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                (bits(&out), bits(&att), bits(&dqkv))
            })
        };
        let first = run(1);
        assert!(first == run(3) && first == run(2));
    }
}
