//! Pure planners: the flat-buffer partition and the micro-batch block assignment (no actors, no IO).
//!
//! Both are deterministic functions of their arguments, so every rank computes the same plan
//! from the same membership without talking to anyone.

use std::ops::Range;

use tessera_transport::tree::aligned_blocks;

/// Splits `0..total` into `world` contiguous ranges, one per rank, in rank order.
///
/// Every boundary is a multiple of `align` except `total` itself (callers pass
/// `tessera_kernels::optim::NORM_BLOCK` so partial norms combine per global block). The
/// `ceil(total / align)` blocks are dealt out as evenly as possible: block counts differ by at
/// most one, leading ranks take the extra blocks, and the last block may be partial. When there
/// are fewer blocks than ranks, trailing ranks get empty ranges `total..total`.
/// `world == 0` gives no ranges; `align == 0` is treated as 1.
pub fn partition(total: usize, world: usize, align: usize) -> Vec<Range<usize>> {
    let align = align.max(1);
    let blocks = total.div_ceil(align);
    let (base, extra) = blocks.checked_div(world).zip(blocks.checked_rem(world)).unwrap_or((0, 0));
    let mut ranges = Vec::with_capacity(world);
    let mut first_block = 0;
    for rank in 0..world {
        let count = base + usize::from(rank < extra);
        let lo = (first_block * align).min(total);
        let hi = ((first_block + count) * align).min(total);
        ranges.push(lo..hi);
        first_block += count;
    }
    ranges
}

/// Splits micro-batch indices `0..micro_batches` into aligned dyadic blocks `(first, level)`
/// (`first = k·2^level`, covering `first..min(first + 2^level, micro_batches)`) and gives each
/// worker a contiguous run of them, in rank order.
///
/// Worker `r` gets the leaves `[floor(M·W_r/W), floor(M·W_{r+1}/W))` where `W_r` is the sum of
/// the weights before `r` (relative speeds); with equal weights the counts differ by at most
/// one. Each run is cut greedily into the largest aligned blocks that fit inside it, so pushing
/// the workers' block sums into one `tessera_transport::tree::TreeSum` in rank order gives the
/// same bits as pushing every leaf. Weights that are negative or not finite count as 0; if no
/// weight is positive, all workers weigh the same. `weights.len()` is the world size.
pub fn assign_blocks(micro_batches: usize, weights: &[f64]) -> Vec<Vec<(usize, u32)>> {
    let bounds = leaf_bounds(micro_batches, weights);
    bounds.windows(2).map(|w| aligned_blocks(w[0], w[1])).collect()
}

/// The `world + 1` leaf boundaries of [`assign_blocks`]: 0, the weighted cut points, `m`.
fn leaf_bounds(m: usize, weights: &[f64]) -> Vec<usize> {
    let world = weights.len();
    let clean: Vec<f64> = weights.iter().map(|&w| if w.is_finite() && w > 0.0 { w } else { 0.0 }).collect();
    let total: f64 = clean.iter().sum();
    let equal = total <= 0.0 || clean.iter().all(|&w| w == clean[0]);
    let mut bounds = Vec::with_capacity(world + 1);
    let mut cum = 0.0;
    for (rank, w) in clean.iter().enumerate() {
        let cut = if equal { m * rank / world } else { ((m as f64) * cum / total).floor() as usize };
        // Monotone and within 0..=m even if float rounding wobbles.
        bounds.push(cut.clamp(bounds.last().copied().unwrap_or(0), m));
        cum += w;
    }
    bounds.push(m);
    bounds
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_kernels::tensor::Rng;
    use tessera_transport::tree::TreeSum;

    const CASES: usize = 400;

    #[test]
    fn partition_covers_in_order_aligned_and_balanced() {
        let mut rng = Rng::new(7);
        for case in 0..CASES {
            let align = [1, 3, 16, 16384][case % 4];
            let total = rng.gen_range(if align == 16384 { 200_000 } else { 300 }) as usize;
            let world = 1 + rng.gen_range(9) as usize;
            let parts = partition(total, world, align);
            assert_eq!(parts.len(), world, "total {total} world {world} align {align}");
            let mut next = 0;
            for r in &parts {
                assert_eq!(r.start, next, "contiguous, in order: {parts:?}");
                assert!(r.start <= r.end);
                assert!(r.end == total || r.end % align == 0, "aligned: {parts:?} align {align}");
                next = r.end;
            }
            assert_eq!(next, total, "covers 0..{total}: {parts:?}");
            let counts: Vec<usize> = parts.iter().map(|r| r.len().div_ceil(align)).collect();
            let (min, max) = (counts.iter().min().copied(), counts.iter().max().copied());
            assert!(max.zip(min).is_some_and(|(a, b)| a - b <= 1), "balanced blocks: {counts:?}");
            // Empty ranks only trail.
            let first_empty = parts.iter().position(|r| r.is_empty()).unwrap_or(world);
            assert!(parts[first_empty..].iter().all(|r| r.is_empty()), "empties trail: {parts:?}");
        }
    }

    #[test]
    fn partition_edge_cases() {
        assert!(partition(10, 0, 4).is_empty());
        assert_eq!(partition(0, 3, 4), vec![0..0, 0..0, 0..0]);
        assert_eq!(partition(10, 3, 0), vec![0..4, 4..7, 7..10]);
        assert_eq!(partition(10, 2, 4), vec![0..8, 8..10]);
        assert_eq!(partition(5, 3, 4), vec![0..4, 4..5, 5..5]);
    }

    /// Leaf values whose sums round differently under different association orders.
    fn leaf(i: usize) -> Vec<f32> {
        (0..4).map(|j| 1.0 / (1.0 + 3.0 * i as f32 + j as f32) + (i % 5) as f32 * 1.0e7 - 3.3e6).collect()
    }

    fn sum_blocks(plan: &[Vec<(usize, u32)>], m: usize) -> Vec<f32> {
        let mut global = TreeSum::new();
        for worker in plan {
            for &(first, level) in worker {
                let mut own = TreeSum::new();
                for i in first..(first + (1usize << level)).min(m) {
                    own.push_leaf(leaf(i)).expect("leaves in order");
                }
                global.push_block(first, level, own.finish().expect("non-empty block")).expect("blocks in order");
            }
        }
        global.finish().expect("m >= 1")
    }

    fn random_weights(rng: &mut Rng, world: usize) -> Vec<f64> {
        match rng.gen_range(3) {
            0 => vec![1.0; world],
            1 => (0..world).map(|_| 0.1 + rng.next_f64() * 4.0).collect(),
            _ => (0..world).map(|_| if rng.gen_range(3) == 0 { 0.0 } else { rng.next_f64() }).collect(),
        }
    }

    #[test]
    fn assigned_blocks_sum_to_the_same_bits_as_leaves() {
        let mut rng = Rng::new(11);
        for _ in 0..CASES {
            let m = 1 + rng.gen_range(63) as usize;
            let world = 1 + rng.gen_range(6) as usize;
            let weights = random_weights(&mut rng, world);
            let plan = assign_blocks(m, &weights);
            assert_eq!(plan.len(), world);
            let mut next = 0;
            for &(first, level) in plan.iter().flatten() {
                assert_eq!(first, next, "blocks cover each leaf once, in order: {plan:?}");
                assert_eq!(first % (1usize << level), 0, "aligned: {plan:?}");
                assert!(first + (1usize << level) <= m, "inside 0..{m}: {plan:?}");
                next = first + (1usize << level);
            }
            assert_eq!(next, m);
            let mut by_leaf = TreeSum::new();
            (0..m).for_each(|i| by_leaf.push_leaf(leaf(i)).expect("in order"));
            let want = by_leaf.finish().expect("m >= 1");
            let got = sum_blocks(&plan, m);
            assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "m {m} w {weights:?}");
        }
    }

    #[test]
    fn leaf_counts_follow_the_weights() {
        let mut rng = Rng::new(13);
        for _ in 0..CASES {
            let m = 1 + rng.gen_range(200) as usize;
            let world = 1 + rng.gen_range(6) as usize;
            let weights = random_weights(&mut rng, world);
            let plan = assign_blocks(m, &weights);
            let counts: Vec<usize> = plan.iter().map(|b| b.iter().map(|&(_, l)| 1usize << l).sum()).collect();
            let positive: f64 = weights.iter().filter(|w| **w > 0.0).sum();
            for (r, &c) in counts.iter().enumerate() {
                let ideal = if positive > 0.0 { m as f64 * weights[r] / positive } else { m as f64 / world as f64 };
                assert!((c as f64 - ideal).abs() < 1.0 + 1e-9, "rank {r}: {c} vs {ideal} ({weights:?}, m {m})");
            }
            if weights.iter().all(|&w| w == weights[0]) {
                let (min, max) = (counts.iter().min(), counts.iter().max());
                assert!(max.zip(min).is_some_and(|(a, b)| a - b <= 1), "even split: {counts:?}");
            }
        }
    }

    #[test]
    fn assign_blocks_uses_large_blocks() {
        assert_eq!(assign_blocks(8, &[1.0]), vec![vec![(0, 3)]]);
        assert_eq!(assign_blocks(6, &[1.0, 1.0]), vec![vec![(0, 1), (2, 0)], vec![(3, 0), (4, 1)]]);
        assert_eq!(assign_blocks(3, &[1.0, f64::NAN]), vec![vec![(0, 1), (2, 0)], vec![]]);
        assert_eq!(assign_blocks(2, &[0.0, 0.0]), vec![vec![(0, 0)], vec![(1, 0)]]);
    }
}
