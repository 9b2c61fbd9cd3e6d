//! The owner's side of the gradient exchange ([`OwnerSums`]) and the fixed micro-batch tree that
//! combines gradients on both sides of it.

use std::ops::Range;

use tessera_kernels::dtype::{round_to, DType};
use tessera_transport::tree::TreeSum;

use super::super::plan::Plan;
use super::clamp_to;

fn round_bf16(x: &mut [f32]) {
    round_to(DType::BF16, x)
}
fn round_f16(x: &mut [f32]) {
    round_to(DType::F16, x)
}

/// The tree over micro-batch index, rounding inner nodes to the storage type.
pub(super) fn tree(dtype: DType) -> TreeSum {
    match dtype {
        DType::F32 => TreeSum::new(),
        DType::BF16 => TreeSum::with_rounding(round_bf16),
        DType::F16 => TreeSum::with_rounding(round_f16),
    }
}

/// The gradient sum of one aligned dyadic block of micro-batches: (first leaf, level, values).
type BlockSum = (usize, u32, Vec<f32>);

/// The owner's side of the gradient exchange: what each sender sent for this rank's range in
/// the current slot, each sender's current block (stages 2–3 receive it micro-batch by
/// micro-batch and combine it with the block's tree), and the finished block sums. Updated by
/// the exchange jobs on the communication lane, in slot order.
pub(super) struct OwnerSums {
    mine: Range<usize>,
    dtype: DType,
    current: Vec<Option<Vec<f32>>>,
    blocks: Vec<Option<TreeSum>>,
    done: Vec<BlockSum>,
}

impl OwnerSums {
    pub(super) fn new(plan: &Plan, rank: usize) -> Self {
        let w = plan.world;
        OwnerSums {
            mine: plan.ranges[rank].clone(),
            dtype: plan.precision.dtype(),
            current: vec![None; w],
            blocks: (0..w).map(|_| None).collect(),
            done: Vec::new(),
        }
    }

    /// One bucket's all-to-all of slot `slot` arrived (`got[r]` from rank `r`); `last` marks the
    /// slot's final bucket, after which every sender's values for this range are complete.
    pub(super) fn receive(
        &mut self,
        plan: &Plan,
        slot: usize,
        bucket: &Range<usize>,
        got: Vec<Vec<f32>>,
        last: bool,
    ) -> Result<(), String> {
        let part = clamp_to(bucket, &self.mine);
        let abs = self.mine.start + part.start..self.mine.start + part.end;
        // Each sender's message is, for every rank `q` sending in this slot (in rank order),
        // the pieces of `q`'s values it supplies (`Plan::suppliers`): `q`'s own, or with
        // expert parallelism the experts' gradients it computed for `q`'s micro-batch.
        let mut read = vec![0usize; got.len()];
        for q in 0..plan.world {
            if plan.slot_send(q, slot).is_none() {
                continue;
            }
            for (piece, who) in plan.suppliers(q, abs.clone()) {
                let data = got.get(who).ok_or_else(|| format!("rank {who} is not in the exchange of slot {slot}"))?;
                let Some(vals) = data.get(read[who]..read[who] + piece.len()) else {
                    return Err(format!(
                        "rank {who} sent {} gradient values for flat {}..{} in slot {slot}, fewer than it supplies",
                        data.len(),
                        bucket.start,
                        bucket.end
                    ));
                };
                let buf = self.current[q].get_or_insert_with(|| vec![0.0; self.mine.len()]);
                buf[piece.start - self.mine.start..piece.end - self.mine.start].copy_from_slice(vals);
                read[who] += piece.len();
            }
        }
        if let Some((r, data)) = got.iter().enumerate().find(|(r, d)| d.len() != read[*r]) {
            return Err(format!(
                "rank {r} sent {} gradient values for flat {}..{} in slot {slot}, expected {}",
                data.len(),
                bucket.start,
                bucket.end,
                read[r]
            ));
        }
        if !last {
            return Ok(());
        }
        for r in 0..plan.world {
            let Some(send) = plan.slot_send(r, slot) else { continue };
            let vals = self.current[r].take().unwrap_or_else(|| vec![0.0; self.mine.len()]);
            let (first, level) = send.block;
            if send.block_sum {
                self.done.push((first, level, vals));
                continue;
            }
            if send.leaf == first {
                self.blocks[r] = Some(tree(self.dtype));
            }
            let t =
                self.blocks[r].as_mut().ok_or_else(|| format!("rank {r}'s micro-batch {} arrived before its block began", send.leaf))?;
            t.push_block(send.leaf - first, 0, vals).map_err(|e| e.to_string())?;
            if send.leaf + 1 == (first + (1 << level)).min(plan.micro_batches) {
                let sum = self.blocks[r].take().and_then(TreeSum::finish).ok_or("empty micro-batch block")?;
                self.done.push((first, level, sum));
            }
        }
        Ok(())
    }

    /// The blocks combined by the micro-batch tree, in leaf order.
    pub(super) fn finish(mut self, plan: &Plan) -> Result<Vec<f32>, String> {
        self.done.sort_by_key(|&(first, _, _)| first);
        let covered: usize = self.done.iter().map(|&(first, level, _)| (first + (1 << level)).min(plan.micro_batches) - first).sum();
        if covered != plan.micro_batches {
            return Err(format!("the gradient sums received cover {covered} of {} micro-batches", plan.micro_batches));
        }
        let mut t = tree(self.dtype);
        for (first, level, data) in self.done {
            t.push_block(first, level, data).map_err(|e| e.to_string())?;
        }
        Ok(t.finish().unwrap_or_else(|| vec![0.0; self.mine.len()]))
    }
}
