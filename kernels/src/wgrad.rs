//! The weight-gradient half of a backward ([`WeightGrads`]): where a layer's backward sends its
//! parameters' gradients — the linears' `dW += Xᵀ·dY` and bias sums, the norms' gain and bias
//! sums. Added at once ([`WeightGrads::Now`], one worker's fused backward), or recorded with
//! copies of what they read ([`WeightGrads::Later`] into a [`UnitStash`]) and added later: the
//! zero-bubble pipeline's `W` pass, run after the input-gradient pass `B` that the previous
//! stage waits for.
//!
//! Either way each gradient element gets the same additions of the same values in the same
//! order (the same op on the same operands; an op's output is disjoint from every input-gradient
//! buffer), so the deferred gradients are the fused ones bit for bit.

use std::ops::Range;
use std::sync::Arc;

use crate::ops::{layernorm, linear, rmsnorm};

/// Where a backward's parameter gradients go. Ranges are relative to the unit (the block, or
/// unit 0); `Now`'s `g` starts at unit offset `base` (an expert's range when an engine's expert
/// runner hands one expert's gradient).
pub enum WeightGrads<'g> {
    /// Added at once into `g`.
    Now { g: &'g mut [f32], base: usize },
    /// Recorded, with copies of their operands, for [`UnitStash::apply`]; the copies reuse
    /// `spare` buffers ([`UnitStash::into_buffers`] of spent stashes) before allocating.
    Later { stash: &'g mut UnitStash, spare: &'g mut Vec<Vec<f32>> },
}

/// The recorded weight-gradient ops of one unit and one micro-batch, in the order the backward
/// made them, with the operands they read.
#[derive(Debug, Default)]
pub struct UnitStash {
    /// The unit the ops add into.
    pub unit: usize,
    ops: Vec<WeightOp>,
    /// Every operand kept, to share equal ones (one copy of an input read by two linears).
    kept: Vec<Arc<Vec<f32>>>,
}

/// One deferred weight-gradient op.
#[derive(Debug)]
enum WeightOp {
    /// [`linear::linear_backward_weight`]: `g[w] += inpᵀ·dout`, `g[b] += Σ_rows dout`.
    Linear { w: Range<usize>, b: Option<Range<usize>>, dout: Arc<Vec<f32>>, inp: Arc<Vec<f32>>, n: usize, ic: usize, oc: usize },
    /// [`layernorm::layernorm_backward_weight`].
    LayerNorm {
        w: Range<usize>,
        b: Range<usize>,
        dout: Arc<Vec<f32>>,
        inp: Arc<Vec<f32>>,
        mean: Arc<Vec<f32>>,
        rstd: Arc<Vec<f32>>,
        c: usize,
    },
    /// [`rmsnorm::rmsnorm_backward_weight`].
    RmsNorm { w: Range<usize>, dout: Arc<Vec<f32>>, inp: Arc<Vec<f32>>, rstd: Arc<Vec<f32>>, c: usize },
}

impl WeightGrads<'_> {
    /// Gradients added at once into `g`, a whole unit's gradient.
    pub fn now(g: &mut [f32]) -> WeightGrads<'_> {
        WeightGrads::Now { g, base: 0 }
    }

    /// The weight half of [`linear::linear_backward`] for the weight at `w` (and bias at `b`,
    /// after it): `inp [n, ic]`, `dout [n, oc]`.
    // Allowed: linear_backward_weight's arguments, ranges for slices.
    #[allow(clippy::too_many_arguments)]
    pub fn linear(&mut self, w: Range<usize>, b: Option<Range<usize>>, dout: &[f32], inp: &[f32], n: usize, ic: usize, oc: usize) {
        match self {
            WeightGrads::Now { g, base } => {
                let (gw, gb) = split_two(g, shift(&w, *base), b.map(|b| shift(&b, *base)));
                linear::linear_backward_weight(gw, gb, dout, inp, n, ic, oc);
            }
            WeightGrads::Later { stash: s, spare } => {
                let (dout, inp) = (s.keep(dout, spare), s.keep(inp, spare));
                s.ops.push(WeightOp::Linear { w, b, dout, inp, n, ic, oc });
            }
        }
    }

    /// The weight half of [`layernorm::layernorm_backward`] (gain at `w`, bias at `b` after it).
    #[allow(clippy::too_many_arguments)]
    pub fn layernorm(&mut self, w: Range<usize>, b: Range<usize>, dout: &[f32], inp: &[f32], mean: &[f32], rstd: &[f32], c: usize) {
        match self {
            WeightGrads::Now { g, base } => {
                let (gw, gb) = split_two(g, shift(&w, *base), Some(shift(&b, *base)));
                let gb = gb.expect("a bias range");
                layernorm::layernorm_backward_weight(gw, gb, dout, inp, mean, rstd, rstd.len(), c);
            }
            WeightGrads::Later { stash: s, spare } => {
                let (dout, inp, mean, rstd) = (s.keep(dout, spare), s.keep(inp, spare), s.keep(mean, spare), s.keep(rstd, spare));
                s.ops.push(WeightOp::LayerNorm { w, b, dout, inp, mean, rstd, c });
            }
        }
    }

    /// The weight half of [`rmsnorm::rmsnorm_backward`] (gain at `w`).
    pub fn rmsnorm(&mut self, w: Range<usize>, dout: &[f32], inp: &[f32], rstd: &[f32], c: usize) {
        match self {
            WeightGrads::Now { g, base } => {
                rmsnorm::rmsnorm_backward_weight(&mut g[shift(&w, *base)], dout, inp, rstd, rstd.len(), c);
            }
            WeightGrads::Later { stash: s, spare } => {
                let (dout, inp, rstd) = (s.keep(dout, spare), s.keep(inp, spare), s.keep(rstd, spare));
                s.ops.push(WeightOp::RmsNorm { w, dout, inp, rstd, c });
            }
        }
    }
}

impl UnitStash {
    /// An empty stash for unit `unit`.
    pub fn new(unit: usize) -> UnitStash {
        UnitStash { unit, ..UnitStash::default() }
    }

    /// A copy of `v` (into the smallest `spare` buffer that holds it, else a new one), or the
    /// kept copy of an equal operand (bit for bit).
    fn keep(&mut self, v: &[f32], spare: &mut Vec<Vec<f32>>) -> Arc<Vec<f32>> {
        let same = |k: &&Arc<Vec<f32>>| k.len() == v.len() && k.iter().zip(v).all(|(a, b)| a.to_bits() == b.to_bits());
        if let Some(k) = self.kept.iter().find(same) {
            return Arc::clone(k);
        }
        let fit = spare.iter().enumerate().filter(|(_, b)| b.capacity() >= v.len()).min_by_key(|(_, b)| b.capacity()).map(|(i, _)| i);
        let mut buf = fit.map_or_else(|| Vec::with_capacity(v.len()), |i| spare.swap_remove(i));
        buf.clear();
        buf.extend_from_slice(v);
        let k = Arc::new(buf);
        self.kept.push(Arc::clone(&k));
        k
    }

    /// Adds the recorded gradients into `g`, the unit's whole gradient, in recorded order.
    pub fn apply(&self, g: &mut [f32]) {
        for op in &self.ops {
            match op {
                WeightOp::Linear { w, b, dout, inp, n, ic, oc } => {
                    let (gw, gb) = split_two(g, w.clone(), b.clone());
                    linear::linear_backward_weight(gw, gb, dout, inp, *n, *ic, *oc);
                }
                WeightOp::LayerNorm { w, b, dout, inp, mean, rstd, c } => {
                    let (gw, gb) = split_two(g, w.clone(), Some(b.clone()));
                    let gb = gb.expect("a bias range");
                    layernorm::layernorm_backward_weight(gw, gb, dout, inp, mean, rstd, rstd.len(), *c);
                }
                WeightOp::RmsNorm { w, dout, inp, rstd, c } => {
                    rmsnorm::rmsnorm_backward_weight(&mut g[w.clone()], dout, inp, rstd, rstd.len(), *c);
                }
            }
        }
    }

    /// The stash's buffers, its ops dropped: for another [`WeightGrads::Later`]'s `spare`.
    pub fn into_buffers(self) -> impl Iterator<Item = Vec<f32>> {
        drop(self.ops);
        self.kept.into_iter().filter_map(|k| Arc::try_unwrap(k).ok())
    }

    /// Number of recorded ops.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Bytes of the operands kept (each shared copy once).
    pub fn bytes(&self) -> usize {
        self.kept.iter().map(|k| k.capacity() * 4).sum()
    }
}

fn shift(r: &Range<usize>, base: usize) -> Range<usize> {
    r.start - base..r.end - base
}

/// Two disjoint mutable views of `g` (the second optional, after the first).
pub(crate) fn split_two(g: &mut [f32], a: Range<usize>, b: Option<Range<usize>>) -> (&mut [f32], Option<&mut [f32]>) {
    match b {
        None => (&mut g[a], None),
        Some(b) => {
            assert!(a.end <= b.start, "ranges must be ordered and disjoint");
            let (lo, hi) = g.split_at_mut(b.start);
            (&mut lo[a], Some(&mut hi[..b.end - b.start]))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gradcheck::randn;

    /// Recorded then applied, a linear's and the norms' weight gradients are the ones added at
    /// once, bit for bit, and an operand read twice is kept once.
    #[test]
    fn later_gives_the_bits_of_now_and_shares_operands() {
        let (n, c, oc) = (7, 5, 3);
        let (x, dy, dn) = (randn(1, n * c, 1.0), randn(2, n * oc, 1.0), randn(3, n * c, 1.0));
        let (mean, rstd) = (randn(4, n, 1.0), randn(5, n, 1.0));
        // Layout: w [c, oc], b [oc], ln w [c], ln b [c], rms w [c]; a non-zero start.
        let (w, b) = (0..c * oc, c * oc..c * oc + oc);
        let (lw, lb, rw) = (b.end..b.end + c, b.end + c..b.end + 2 * c, b.end + 2 * c..b.end + 3 * c);
        let total = rw.end;
        let run = |wg: &mut WeightGrads| {
            wg.linear(w.clone(), Some(b.clone()), &dy, &x, n, c, oc);
            wg.layernorm(lw.clone(), lb.clone(), &dn, &x, &mean, &rstd, c);
            wg.rmsnorm(rw.clone(), &dn, &x, &rstd, c);
        };
        let start = randn(6, total, 1.0);
        let mut now = start.clone();
        run(&mut WeightGrads::now(&mut now));
        let mut stash = UnitStash::new(3);
        run(&mut WeightGrads::Later { stash: &mut stash, spare: &mut Vec::new() });
        assert_eq!(stash.len(), 3);
        // x, dy, dn, mean, rstd: five operands, x and dn and rstd shared.
        assert_eq!(stash.bytes(), 4 * (n * c + n * oc + n * c + n + n));
        let mut later = start.clone();
        stash.apply(&mut later);
        assert!(now.iter().zip(&later).all(|(a, b)| a.to_bits() == b.to_bits()));
        assert!(now.iter().zip(&start).any(|(a, b)| a != b), "the ops added nothing");
        // Spent, its buffers serve the next recording: no new allocation, the same bits.
        let mut spare: Vec<Vec<f32>> = stash.into_buffers().collect();
        let held: Vec<*const f32> = spare.iter().map(|b| b.as_ptr()).collect();
        assert_eq!(held.len(), 5);
        let mut again = UnitStash::new(3);
        run(&mut WeightGrads::Later { stash: &mut again, spare: &mut spare });
        assert!(spare.is_empty(), "every spare buffer reused");
        assert!(again.kept.iter().all(|k| held.contains(&k.as_ptr())));
        let mut later = start.clone();
        again.apply(&mut later);
        assert!(now.iter().zip(&later).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}
