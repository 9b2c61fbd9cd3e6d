//! DeepSpeed's expert capacity (`_capacity`, the drop rule of `top2gating`) and the seeded
//! noise of the noisy policies (`multiplicative_jitter`, `gumbel_rsample`, the random token
//! order of `use_rts`), as pure functions of (noise key, block).

use crate::tensor::Rng;

/// Keys of the noise streams under a micro-batch's noise key.
const TAG_JITTER: u64 = 0x6a69_7474;
const TAG_GUMBEL: u64 = 0x6775_6d62;
const TAG_RTS: u64 = 0x7274_7373;

/// Jitter half-width (DeepSpeed's `multiplicative_jitter` epsilon).
pub const JITTER_EPS: f32 = 1e-2;

/// Slots per expert for `n` tokens: `max(min_capacity, ceil(n / E · factor · k))` — DeepSpeed's
/// `_capacity(gates, capacity_factor · k, min_capacity)` — computed in f64.
pub fn capacity(n: usize, num_experts: usize, top_k: usize, factor: f32, min_capacity: usize) -> usize {
    let c = ((n as f64 / num_experts as f64) * (f64::from(factor) * top_k as f64)).ceil() as usize;
    c.max(min_capacity)
}

/// Which (token, choice) pairs of `idx` `[n, k]` get one of an expert's `slots`: every token's
/// first choice, in token order (or in `order`, a permutation of the tokens, under RTS), then
/// every second choice, …; a choice whose expert is full is dropped. This is DeepSpeed's
/// `top2gating` rule (second choices' locations start after all first choices of the expert)
/// for any k, and its `top1gating` with RTS keeps the same set (the first `slots` tokens of the
/// expert in the random order).
pub fn assign(idx: &[usize], n: usize, e: usize, k: usize, slots: usize, order: Option<&[u32]>) -> Vec<bool> {
    let mut kept = vec![true; n * k];
    let mut used = vec![0usize; e];
    for j in 0..k {
        for i in 0..n {
            let t = order.map_or(i, |o| o[i] as usize);
            let x = idx[t * k + j];
            if used[x] < slots {
                used[x] += 1;
            } else {
                kept[t * k + j] = false;
            }
        }
    }
    kept
}

/// The noise of one MoE block in one training micro-batch: a pure function of the micro-batch's
/// noise key (itself of the run seed and the micro-batch's global index) and the block — never
/// of rank, world size or thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NoiseKey {
    pub key: u64,
    pub block: usize,
}

impl NoiseKey {
    fn rng(self, tag: u64) -> Rng {
        Rng::derive(self.key, &[tag, self.block as u64])
    }

    /// `len` multipliers uniform in `[1 − ε, 1 + ε]` (Jitter on the router's input).
    pub fn jitter(self, len: usize) -> Vec<f32> {
        let mut rng = self.rng(TAG_JITTER);
        (0..len).map(|_| 1.0 - JITTER_EPS + 2.0 * JITTER_EPS * rng.next_f32()).collect()
    }

    /// `len` standard Gumbel samples `−ln(−ln U)`, `U` uniform in `(0, 1)` (RSample).
    pub fn gumbel(self, len: usize) -> Vec<f32> {
        let mut rng = self.rng(TAG_GUMBEL);
        let half_ulp = 0.5 / (1u64 << 53) as f64;
        (0..len).map(|_| (-(-(rng.next_f64() + half_ulp).ln()).ln()) as f32).collect()
    }

    /// A uniformly random permutation of `0..n` (Fisher–Yates): the token order in which
    /// capacity slots are filled under random token selection.
    pub fn permutation(self, n: usize) -> Vec<u32> {
        let mut rng = self.rng(TAG_RTS);
        let mut p: Vec<u32> = (0..n as u32).collect();
        for i in (1..n).rev() {
            let j = rng.gen_range(i as u64 + 1) as usize;
            p.swap(i, j);
        }
        p
    }
}
