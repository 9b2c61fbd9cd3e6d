//! The deterministic gradient reduction: one fixed binary tree over micro-batch index.
//!
//! The global batch is `M` micro-batches. Their gradients are summed by the tree whose leaves
//! are indices `0..M` padded to the next power of two (an absent subtree contributes nothing).
//! A worker may own any *aligned dyadic block* `[k·2^j, (k+1)·2^j)` and sum it with the same
//! tree; combining the blocks by [`TreeSum`] gives the same bits whatever the assignment.

/// Accumulates tree nodes pushed left to right. Push leaves (level 0) or whole aligned blocks
/// (level `j` = a block of `2^j` leaves); nodes of equal level merge as `left + right`.
#[derive(Debug, Default)]
pub struct TreeSum {
    /// (first leaf, level, partial sum): strictly decreasing levels from bottom to top.
    stack: Vec<(usize, u32, Vec<f32>)>,
    next_leaf: usize,
    /// Applied to every inner node after its addition (e.g. rounding to bf16, so that a node
    /// has the same bits whether it is held in a 16-bit or an f32 buffer).
    round: Option<fn(&mut [f32])>,
}

/// Errors of misuse: a block that is not aligned or not the next in order.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TreeError {
    #[error("block at leaf {first} of level {level} is not aligned to 2^{level}")]
    Unaligned { first: usize, level: u32 },
    #[error("block starts at leaf {first} but leaf {expected} is next")]
    OutOfOrder { first: usize, expected: usize },
    #[error("block of {got} values does not match {want}")]
    Length { got: usize, want: usize },
}

/// `left += right`, elementwise (the tree's one arithmetic operation).
pub fn add_assign(left: &mut [f32], right: &[f32]) {
    left.iter_mut().zip(right).for_each(|(l, r)| *l += *r);
}

impl TreeSum {
    pub fn new() -> Self {
        Self::default()
    }

    /// A tree whose inner nodes are passed through `round` after each addition.
    pub fn with_rounding(round: fn(&mut [f32])) -> Self {
        TreeSum { round: Some(round), ..Self::default() }
    }

    /// Number of leaves covered so far.
    pub fn leaves(&self) -> usize {
        self.next_leaf
    }

    /// Pushes one leaf (the next micro-batch's gradient).
    pub fn push_leaf(&mut self, leaf: Vec<f32>) -> Result<(), TreeError> {
        self.push_block(self.next_leaf, 0, leaf)
    }

    /// Pushes the sum of the aligned block `[first, first + 2^level)` (the last block of the
    /// batch may be partial: it is the same tree node with its absent leaves left out).
    pub fn push_block(&mut self, first: usize, level: u32, mut sum: Vec<f32>) -> Result<(), TreeError> {
        if !first.is_multiple_of(1usize << level) {
            return Err(TreeError::Unaligned { first, level });
        }
        if first != self.next_leaf {
            return Err(TreeError::OutOfOrder { first, expected: self.next_leaf });
        }
        if let Some((_, _, top)) = self.stack.last() {
            if top.len() != sum.len() {
                return Err(TreeError::Length { got: sum.len(), want: top.len() });
            }
        }
        self.next_leaf = first + (1usize << level);
        let mut node_first = first;
        let mut lvl = level;
        while let Some(&(top_first, top_lvl, _)) = self.stack.last() {
            if top_lvl != lvl || top_first + (1usize << lvl) != node_first {
                break;
            }
            let (_, _, mut left) = self.stack.pop().expect("checked non-empty");
            add_assign(&mut left, &sum);
            if let Some(round) = self.round {
                round(&mut left);
            }
            sum = left;
            node_first = top_first;
            lvl += 1;
        }
        self.stack.push((node_first, lvl, sum));
        Ok(())
    }

    /// The root: pending nodes combine right to left (`left + (… + right)`), which is the
    /// padded tree with absent subtrees dropped. `None` if nothing was pushed.
    pub fn finish(mut self) -> Option<Vec<f32>> {
        let (_, _, mut acc) = self.stack.pop()?;
        while let Some((_, _, mut left)) = self.stack.pop() {
            add_assign(&mut left, &acc);
            if let Some(round) = self.round {
                round(&mut left);
            }
            acc = left;
        }
        Some(acc)
    }
}

/// Cuts leaves `lo..hi` into the largest aligned dyadic blocks `(first, level)` that fit inside
/// it, left to right: the blocks a planner hands to the worker that owns `lo..hi`.
pub fn aligned_blocks(lo: usize, hi: usize) -> Vec<(usize, u32)> {
    let mut out = Vec::new();
    let mut first = lo;
    while first < hi {
        // Largest level the start is aligned to (any level for 0), then shrink until it fits.
        let mut level = if first == 0 { usize::BITS - 1 } else { first.trailing_zeros() };
        while level > 0 && (1usize << level) > hi - first {
            level -= 1;
        }
        out.push((first, level));
        first += 1usize << level;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaf(i: usize) -> Vec<f32> {
        // Values whose sums round differently under different association orders.
        (0..8).map(|j| 1.0 / (1.0 + i as f32 * 3.0 + j as f32) + (i as f32) * 1e7).collect()
    }

    fn by_leaves(m: usize) -> Vec<f32> {
        let mut t = TreeSum::new();
        (0..m).for_each(|i| t.push_leaf(leaf(i)).unwrap());
        t.finish().unwrap()
    }

    /// Reference: the padded recursive tree written directly.
    fn recursive(lo: usize, hi: usize, m: usize) -> Option<Vec<f32>> {
        if lo >= m {
            return None;
        }
        if hi - lo == 1 {
            return Some(leaf(lo));
        }
        let mid = lo + (hi - lo) / 2;
        match (recursive(lo, mid, m), recursive(mid, hi, m)) {
            (Some(mut l), Some(r)) => {
                add_assign(&mut l, &r);
                Some(l)
            }
            (l, None) => l,
            (None, r) => r,
        }
    }

    #[test]
    fn leaves_match_the_padded_recursive_tree() {
        for m in 1usize..40 {
            let want = recursive(0, m.next_power_of_two(), m).unwrap();
            assert_eq!(by_leaves(m), want, "m = {m}");
        }
    }

    #[test]
    fn any_dyadic_block_assignment_gives_the_same_bits() {
        for m in 1..40 {
            let want = by_leaves(m);
            // Workers own contiguous runs of `run` leaves, each cut into aligned blocks.
            for run in 1..=m {
                let mut t = TreeSum::new();
                for lo in (0..m).step_by(run) {
                    for (first, level) in aligned_blocks(lo, (lo + run).min(m)) {
                        // A worker sums its block with the same tree.
                        let mut inner = TreeSum::new();
                        for i in first..first + (1 << level) {
                            inner.push_block(i - first, 0, leaf(i)).unwrap();
                        }
                        t.push_block(first, level, inner.finish().unwrap()).unwrap();
                    }
                }
                assert_eq!(t.finish().unwrap(), want, "m = {m}, runs of {run}");
            }
        }
    }

    #[test]
    fn misuse_is_reported() {
        let mut t = TreeSum::new();
        assert_eq!(t.push_block(1, 0, vec![0.0]), Err(TreeError::OutOfOrder { first: 1, expected: 0 }));
        assert_eq!(t.push_block(0, 0, vec![0.0]), Ok(()));
        assert_eq!(t.push_block(1, 1, vec![0.0]), Err(TreeError::Unaligned { first: 1, level: 1 }));
        assert_eq!(t.push_block(1, 0, vec![0.0, 1.0]), Err(TreeError::Length { got: 2, want: 1 }));
    }
}
