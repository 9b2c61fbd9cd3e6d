//! Expert parallelism's plan ([`ExpertPlan`]): which rank runs which experts, and who supplies
//! each micro-batch's expert gradients to the partition owners.
//!
//! With `ep_size = P` the world's ranks form expert-parallel groups of `P` consecutive ranks
//! (`g·P .. g·P + P`); the `j`-th rank of every group runs the experts of slice `j`
//! (`j·E/P .. (j+1)·E/P` of every MoE block). A micro-batch computed by rank `q` sends each
//! expert's token rows to the group member running that expert (an all-to-all), which runs the
//! expert on those rows alone — the same rows, the same function as one worker running every
//! expert — and sends the outputs back. The expert's parameter gradient from `q`'s micro-batch
//! is therefore made by that member: for the owners of the flat buffer (the ZeRO partition,
//! which stays over the whole world) it *supplies* `q`'s values over that slice's range
//! ([`ExpertPlan::suppliers`]). The owners combine every micro-batch's values with the same
//! fixed tree, so the parameters do not depend on `P`, the world size or the ZeRO stage.

use std::ops::Range;

use tessera_kernels::model::Model;

/// Expert parallelism of a run (`tessera.moe.ep_size` > 1).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertPlan {
    /// Ranks per expert-parallel group (`ep_size`).
    pub size: usize,
    /// Experts per MoE block.
    pub num_experts: usize,
    /// Per unit: the flat range of each expert of the unit's MoE block (`None`: a dense unit).
    pub experts: Vec<Option<Vec<Range<usize>>>>,
}

impl ExpertPlan {
    /// The plan for `size` ranks a group over `model`'s MoE blocks. The layout keeps each
    /// block's experts in index order and each expert contiguous (`MoeConfig`'s contract);
    /// checked here, since the slices rely on it.
    pub fn new(model: &Model, size: usize, world: usize) -> Result<ExpertPlan, String> {
        let moe = model.cfg.moe.as_ref().ok_or("tessera.moe.ep_size > 1 needs a mixture-of-experts model")?;
        let e = moe.num_experts;
        if size == 0 || e % size != 0 {
            return Err(format!("tessera.moe.ep_size = {size} must divide the {e} experts of each MoE block"));
        }
        if world % size != 0 {
            return Err(format!("tessera.moe.ep_size = {size} must divide the world size {world}"));
        }
        let units = model.units();
        let mut experts: Vec<Option<Vec<Option<Range<usize>>>>> = vec![None; units.len()];
        for spec in model.layout().specs() {
            let Some((l, x)) = expert_of(&spec.name) else { continue };
            let u = l + 1;
            let slot = experts.get_mut(u).ok_or_else(|| format!("parameter {} names block {l}, which does not exist", spec.name))?;
            let list = slot.get_or_insert_with(|| vec![None; e]);
            let r = list.get_mut(x).ok_or_else(|| format!("parameter {} names expert {x} of {e}", spec.name))?;
            *r = Some(match r.take() {
                None => spec.range(),
                Some(prev) if prev.end == spec.offset => prev.start..spec.range().end,
                Some(prev) => return Err(format!("expert {x} of block {l} is not contiguous: {prev:?} then {}", spec.name)),
            });
        }
        let mut out = vec![None; units.len()];
        for (u, list) in experts.into_iter().enumerate() {
            let Some(list) = list else { continue };
            let ranges: Vec<Range<usize>> = list
                .into_iter()
                .enumerate()
                .map(|(x, r)| r.ok_or(format!("block {} has no parameters of expert {x}", u - 1)))
                .collect::<Result<_, _>>()?;
            if ranges.windows(2).any(|w| w[0].end != w[1].start) {
                return Err(format!("the experts of block {} are not back to back in index order", u - 1));
            }
            out[u] = Some(ranges);
        }
        if out.iter().all(Option::is_none) {
            return Err("tessera.moe.ep_size > 1, but the model has no MoE block".into());
        }
        Ok(ExpertPlan { size, num_experts: e, experts: out })
    }

    /// The ranks of `r`'s expert-parallel group.
    pub fn group(&self, r: usize) -> Range<usize> {
        let g = r / self.size;
        g * self.size..(g + 1) * self.size
    }

    /// The expert slice rank `r` runs.
    pub fn slice_of(&self, r: usize) -> usize {
        r % self.size
    }

    /// The experts of slice `j`.
    pub fn experts_of(&self, j: usize) -> Range<usize> {
        let per = self.num_experts / self.size;
        j * per..(j + 1) * per
    }

    /// The flat range of slice `j`'s experts in unit `u` (empty for a dense unit).
    pub fn slice_range(&self, u: usize, j: usize) -> Range<usize> {
        match &self.experts[u] {
            None => 0..0,
            Some(list) => {
                let x = self.experts_of(j);
                list[x.start].start..list[x.end - 1].end
            }
        }
    }

    /// Whether unit `u` has an MoE block.
    pub fn is_moe(&self, u: usize) -> bool {
        self.experts.get(u).is_some_and(Option::is_some)
    }

    /// The MoE unit and slice whose experts' range holds flat index `x`, if any.
    pub fn slice_at(&self, x: usize) -> Option<(usize, usize)> {
        self.experts.iter().enumerate().find_map(|(u, list)| {
            let list = list.as_ref()?;
            if x < list[0].start || x >= list[list.len() - 1].end {
                return None;
            }
            (0..self.size).find(|&j| self.slice_range(u, j).contains(&x)).map(|j| (u, j))
        })
    }

    /// Who supplies rank `q`'s micro-batch values over flat `range`, cut where the supplier
    /// changes and at every slice's edges, in order: `q` itself outside the experts, the member
    /// of `q`'s group running the slice inside a slice's range.
    pub fn suppliers(&self, q: usize, range: Range<usize>) -> Vec<(Range<usize>, usize)> {
        let group = self.group(q).start;
        let mut out: Vec<(Range<usize>, usize)> = Vec::new();
        // Pieces are never merged across a slice's edge, even with the same supplier: a slice's
        // values and a rank's own come from different buffers.
        let mut push = |r: Range<usize>, who: usize| {
            if !r.is_empty() {
                out.push((r, who));
            }
        };
        let mut lo = range.start;
        for u in (0..self.experts.len()).filter(|&u| self.is_moe(u)) {
            for j in 0..self.size {
                let s = self.slice_range(u, j);
                let (a, b) = (s.start.max(lo), s.end.min(range.end));
                if a >= b {
                    continue;
                }
                push(lo..a, q);
                push(a..b, group + j);
                lo = b;
            }
        }
        push(lo..range.end.max(lo), q);
        out
    }
}

/// `(block, expert)` of a parameter named `h.{l}.moe.experts.{e}.…`.
fn expert_of(name: &str) -> Option<(usize, usize)> {
    let rest = name.strip_prefix("h.")?;
    let (l, rest) = rest.split_once('.')?;
    let rest = rest.strip_prefix("moe.experts.")?;
    let (e, _) = rest.split_once('.')?;
    Some((l.parse().ok()?, e.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan_of(experts: Vec<Option<Vec<Range<usize>>>>, size: usize) -> ExpertPlan {
        let num_experts = experts.iter().flatten().next().map_or(0, Vec::len);
        ExpertPlan { size, num_experts, experts }
    }

    #[test]
    fn names_of_experts_parse() {
        assert_eq!(expert_of("h.3.moe.experts.12.w_gate.weight"), Some((3, 12)));
        assert_eq!(expert_of("h.3.moe.router.weight"), None);
        assert_eq!(expert_of("h.3.mlp.w_gate.weight"), None);
    }

    #[test]
    fn suppliers_cut_at_the_slices_and_cover_the_range() {
        // Unit 1: experts 0..4 at 100..140 (10 each); unit 2 dense; unit 3: experts at 300..340.
        let e = |base: usize| Some((0..4).map(|x| base + 10 * x..base + 10 * (x + 1)).collect());
        let p = plan_of(vec![None, e(100), None, e(300)], 2);
        // Rank 5 is member 1 of group 4..6; slice 0 is run by rank 4, slice 1 by rank 5.
        let got = p.suppliers(5, 90..400);
        assert_eq!(got, vec![(90..100, 5), (100..120, 4), (120..140, 5), (140..300, 5), (300..320, 4), (320..340, 5), (340..400, 5)]);
        let covered: usize = got.iter().map(|(r, _)| r.len()).sum();
        assert_eq!(covered, 310);
        assert_eq!(p.suppliers(4, 0..50), vec![(0..50, 4)]);
        assert_eq!(p.suppliers(4, 105..115), vec![(105..115, 4)]);
        assert_eq!(p.suppliers(5, 105..115), vec![(105..115, 4)]);
        assert_eq!(p.slice_range(3, 1), 320..340);
        assert_eq!(p.group(5), 4..6);
    }
}
