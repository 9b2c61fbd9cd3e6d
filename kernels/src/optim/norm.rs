//! Deterministic, partition-independent sums of squares over a flat buffer split into tensors.
//!
//! The global flat buffer `0..total` is cut two ways: into tensors ("segments") and into fixed
//! global blocks `[k*NORM_BLOCK, (k+1)*NORM_BLOCK)`. Every non-empty intersection
//! `segment ∩ block` is one *slot*; slots are numbered in global index order. A shard whose range
//! is block-aligned owns whole blocks, hence whole slots, so each slot's partial sum is computed by
//! exactly one worker with a summation order fixed by the global layout alone. Other workers
//! contribute `0.0` for that slot, so an element-wise all-reduce in any order reproduces the same
//! bits, and the final combination (slots → segments → global) runs in one fixed order. Result:
//! gradient norms and LAMB trust ratios are bit-identical for every world size.

use std::ops::Range;

use rayon::prelude::*;

use super::OptimError;

/// Size of the fixed global blocks that partial norms are kept per. ZeRO shard boundaries must be
/// multiples of this (or equal the total length) for norm computations.
pub const NORM_BLOCK: usize = 16384;

/// Number of interleaved f64 accumulators inside one slot's sum (part of the fixed order).
const SUM_LANES: usize = 8;

/// Element-wise sum across workers of a vector of partial sums (a collective: every worker calls
/// it with the same length, and afterwards every worker holds the sum). An `Err` (a lost peer,
/// an aborted group) names what failed; the optimizer step that asked then changes nothing.
pub trait NormAllReduce {
    fn all_reduce_sum(&mut self, v: &mut [f64]) -> Result<(), String>;
}

/// The single-worker reduce: the local vector already is the sum.
#[derive(Debug, Clone, Copy, Default)]
pub struct LocalReduce;

impl NormAllReduce for LocalReduce {
    fn all_reduce_sum(&mut self, _v: &mut [f64]) -> Result<(), String> {
        Ok(())
    }
}

/// One `segment ∩ block` piece of the flat buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Slot {
    segment: usize,
    range: Range<usize>,
}

/// Global tensor ranges of a flat parameter buffer plus the precomputed slot table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlatLayout {
    segments: Vec<Range<usize>>,
    total: usize,
    slots: Vec<Slot>,
    /// Slots of block `k` are `block_first_slot[k]..block_first_slot[k + 1]`.
    block_first_slot: Vec<usize>,
}

impl FlatLayout {
    /// Validates that `segments` are sorted, contiguous and start at 0; they cover
    /// `0..segments.last().end`. Empty segments (zero-element tensors) are allowed.
    pub fn new(segments: Vec<Range<usize>>) -> Result<Self, OptimError> {
        let mut expected_start = 0;
        for (index, seg) in segments.iter().enumerate() {
            if seg.start != expected_start || seg.end < seg.start {
                return Err(OptimError::LayoutNotContiguous { index, expected_start, found: seg.clone() });
            }
            expected_start = seg.end;
        }
        let total = expected_start;
        let slots = build_slots(&segments);
        let block_first_slot = build_block_index(&slots, total);
        Ok(Self { segments, total, slots, block_first_slot })
    }

    /// Layout of tensors with the given element counts, laid out back to back.
    pub fn from_sizes(sizes: &[usize]) -> Result<Self, OptimError> {
        let mut start = 0;
        let segments = sizes
            .iter()
            .map(|&n| {
                let r = start..start + n;
                start += n;
                r
            })
            .collect();
        Self::new(segments)
    }

    /// Global range of every tensor, in order.
    pub fn segments(&self) -> &[Range<usize>] {
        &self.segments
    }

    /// Total number of elements of the flat buffer.
    pub fn total(&self) -> usize {
        self.total
    }

    /// Number of `segment ∩ block` slots: the length of every partials vector.
    pub fn slots(&self) -> usize {
        self.slots.len()
    }

    /// Every slot in global slot order: its segment and its global range (the order and the
    /// extents the partials of [`FlatLayout::partial_sumsq`] follow; a device that sums the same
    /// slots in the same lane order reproduces them).
    pub fn slot_ranges(&self) -> impl Iterator<Item = (usize, Range<usize>)> + '_ {
        self.slots.iter().map(|s| (s.segment, s.range.clone()))
    }

    /// Index of the segment holding global element `index` (skipping empty segments), if any.
    pub fn segment_of(&self, index: usize) -> Option<usize> {
        if index >= self.total {
            return None;
        }
        Some(self.segments.partition_point(|s| s.end <= index))
    }

    /// Checks that `range` lies inside `0..total`.
    pub fn check_range(&self, range: &Range<usize>) -> Result<(), OptimError> {
        if range.start > range.end || range.end > self.total {
            return Err(OptimError::ShardRangeOutOfBounds { range: range.clone(), total: self.total });
        }
        Ok(())
    }

    /// Checks that `range` is in bounds and both bounds are multiples of [`NORM_BLOCK`] or equal
    /// the total length (so an empty trailing shard `total..total` is fine).
    pub fn check_aligned(&self, range: &Range<usize>) -> Result<(), OptimError> {
        self.check_range(range)?;
        let aligned = |i: usize| i % NORM_BLOCK == 0 || i == self.total;
        if !aligned(range.start) || !aligned(range.end) {
            return Err(OptimError::ShardRangeUnaligned { range: range.clone(), block: NORM_BLOCK, total: self.total });
        }
        Ok(())
    }

    /// Fills (overwrites) `out[slot]` with the sum of squares of `x_shard` over that slot, for
    /// exactly the slots inside `shard_range`; every other entry of `out` is left untouched.
    /// `x_shard` holds the elements `shard_range` of the flat buffer.
    pub fn partial_sumsq(&self, x_shard: &[f32], shard_range: Range<usize>, out: &mut [f64]) -> Result<(), OptimError> {
        self.check_aligned(&shard_range)?;
        check_len("x_shard", shard_range.len(), x_shard.len())?;
        check_len("partials", self.slots.len(), out.len())?;
        if shard_range.is_empty() {
            return Ok(());
        }
        let lo = shard_range.start;
        let first_block = lo / NORM_BLOCK;
        let end_block = shard_range.end.div_ceil(NORM_BLOCK);
        let owned = self.block_first_slot[first_block]..self.block_first_slot[end_block];
        out[owned.clone()].par_iter_mut().zip(&self.slots[owned]).for_each(|(o, slot)| {
            *o = sumsq_f64(&x_shard[slot.range.start - lo..slot.range.end - lo]);
        });
        Ok(())
    }

    /// Sum of squares per segment, combining slots in global slot order.
    ///
    /// Panics if `partials.len() != self.slots()` (a caller bug, not a data error).
    pub fn segment_sumsq(&self, partials: &[f64]) -> Vec<f64> {
        assert_eq!(partials.len(), self.slots.len(), "partials length");
        let mut acc = vec![0.0f64; self.segments.len()];
        for (p, slot) in partials.iter().zip(&self.slots) {
            acc[slot.segment] += p;
        }
        acc
    }

    /// L2 norm of the whole buffer: `sqrt` of the slot partials summed in global slot order.
    ///
    /// Panics if `partials.len() != self.slots()` (a caller bug, not a data error).
    pub fn global_norm(&self, partials: &[f64]) -> f64 {
        assert_eq!(partials.len(), self.slots.len(), "partials length");
        partials.iter().fold(0.0f64, |acc, p| acc + p).sqrt()
    }
}

fn check_len(what: &'static str, expected: usize, found: usize) -> Result<(), OptimError> {
    if expected != found {
        return Err(OptimError::LengthMismatch { what, expected, found });
    }
    Ok(())
}

fn build_slots(segments: &[Range<usize>]) -> Vec<Slot> {
    let mut slots = Vec::new();
    for (segment, seg) in segments.iter().enumerate() {
        let mut a = seg.start;
        while a < seg.end {
            let b = seg.end.min((a / NORM_BLOCK + 1) * NORM_BLOCK);
            slots.push(Slot { segment, range: a..b });
            a = b;
        }
    }
    slots
}

fn build_block_index(slots: &[Slot], total: usize) -> Vec<usize> {
    let blocks = total.div_ceil(NORM_BLOCK);
    (0..=blocks).map(|k| slots.partition_point(|s| s.range.start < k * NORM_BLOCK)).collect()
}

/// Sum of squares in f64 with a fixed order: lane j accumulates x[i]^2 for i ≡ j (mod 8) in index
/// order, then lanes combine as ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)). The order depends only on the
/// slice itself (a slot), never on threads or partitioning, and the lanes let the loop vectorise;
/// a host summing the same slots with it reproduces [`FlatLayout::partial_sumsq`]'s partials.
pub fn sumsq_f64(x: &[f32]) -> f64 {
    let mut lanes = [0.0f64; SUM_LANES];
    let mut chunks = x.chunks_exact(SUM_LANES);
    for c in &mut chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            let v = f64::from(v);
            *l += v * v;
        }
    }
    for (l, &v) in lanes.iter_mut().zip(chunks.remainder()) {
        let v = f64::from(v);
        *l += v * v;
    }
    ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))
}

/// Global L2 norm of a gradient buffer sharded across workers: each worker passes its shard; all
/// get the same bits regardless of the partition. Collective (calls `reducer` once).
pub fn global_grad_norm(
    layout: &FlatLayout,
    grads_shard: &[f32],
    shard_range: Range<usize>,
    reducer: &mut dyn NormAllReduce,
) -> Result<f64, OptimError> {
    let mut partials = vec![0.0f64; layout.slots()];
    layout.partial_sumsq(grads_shard, shard_range, &mut partials)?;
    reducer.all_reduce_sum(&mut partials).map_err(OptimError::NormReduce)?;
    Ok(layout.global_norm(&partials))
}

/// Gradient-clipping factor per DeepSpeed's `clip_tensors_by_global_norm`:
/// `coef = max_norm / (norm + 1e-6)`; gradients are multiplied by `coef` only when `coef < 1`.
/// Returns `None` when no clipping applies (including `max_norm <= 0`, which disables clipping,
/// and a non-finite norm, which the overflow check handles instead).
pub fn clip_coefficient(global_norm: f64, max_norm: f64) -> Option<f32> {
    if max_norm <= 0.0 || !global_norm.is_finite() {
        return None;
    }
    let coef = max_norm / (global_norm + 1e-6);
    (coef < 1.0).then_some(coef as f32)
}
