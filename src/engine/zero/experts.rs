//! A rank's side of expert parallelism in a step ([`ExpertState`]): the experts it runs for its
//! group's micro-batches, their saved activations, and the expert gradients it supplies for
//! each member's micro-batch (summed by that micro-batch's block tree at stages 0–1, sent
//! micro-batch by micro-batch at stages 2–3, like a rank's own gradients).
//!
//! Messages (f32 only, as every collective): a micro-batch's rows for a member's experts are
//! the row count of each of that member's experts, then the rows, expert after expert, in token
//! order; the outputs and the gradients that travel back have the same row counts and no
//! header.

use std::collections::HashMap;
use std::ops::Range;
use std::time::{Duration, Instant};

use tessera_actors::compute::ComputeError;
use tessera_kernels::dtype::DType;
use tessera_kernels::experts::{ExpertActs, ExpertMlp, ExpertRunner};
use tessera_transport::tree::TreeSum;

use super::super::lane::Lane;
use super::super::plan::Plan;
use super::owner_sums::tree;

/// Rows of each of `experts` (`rows[e]` is `[n_e, c]`, `c` columns) as one message: the counts,
/// then the rows.
pub(super) fn pack_rows(rows: &[Vec<f32>], experts: Range<usize>, c: usize) -> Vec<f32> {
    let mut out: Vec<f32> = experts.clone().map(|e| (rows[e].len() / c) as f32).collect();
    for e in experts {
        out.extend_from_slice(&rows[e]);
    }
    out
}

/// The rows of a [`pack_rows`] message of `n` experts: one `[n_e, c]` buffer per expert.
pub(super) fn unpack_rows(msg: &[f32], n: usize, c: usize) -> Result<Vec<Vec<f32>>, String> {
    let head = msg.get(..n).ok_or_else(|| format!("an expert message of {} values has no header of {n} row counts", msg.len()))?;
    let counts: Vec<usize> = head
        .iter()
        .map(|&x| {
            if x >= 0.0 && x.fract() == 0.0 && x < 16_777_216.0 {
                Ok(x as usize)
            } else {
                Err(format!("row count {x} in an expert message"))
            }
        })
        .collect::<Result<_, _>>()?;
    unpack_plain(&msg[n..], &counts, c)
}

/// Rows of each of `experts`, without counts (the receiver knows them).
pub(super) fn pack_plain(rows: &[Vec<f32>], experts: Range<usize>) -> Vec<f32> {
    experts.flat_map(|e| rows[e].iter().copied()).collect()
}

/// `counts[i]` rows of `c` columns for each expert `i`, from a [`pack_plain`] message.
pub(super) fn unpack_plain(msg: &[f32], counts: &[usize], c: usize) -> Result<Vec<Vec<f32>>, String> {
    let want: usize = counts.iter().sum::<usize>() * c;
    if msg.len() != want {
        return Err(format!("an expert message holds {} values, its row counts {counts:?} × {c} columns make {want}", msg.len()));
    }
    let mut at = 0;
    Ok(counts
        .iter()
        .map(|&n| {
            let rows = msg[at..at + n * c].to_vec();
            at += n * c;
            rows
        })
        .collect())
}

/// What a rank keeps of one member's micro-batch at one MoE block between the forward and the
/// backward: how many rows it ran each of its experts on, and their saved activations.
pub(super) struct Served {
    pub counts: Vec<usize>,
    pub acts: Vec<ExpertActs>,
}

/// A rank's expert-parallel state during one step.
pub(super) struct ExpertState {
    dtype: DType,
    /// Per unit and group member: this slot's gradient of the slice this rank runs, from the
    /// member's micro-batch (added to by the experts' backward).
    grads: Vec<Vec<Option<Vec<f32>>>>,
    /// Per unit and group member: the values ready to send (a micro-batch's gradient, or at
    /// stages 0–1 its block's tree sum).
    pieces: Vec<Vec<Option<Vec<f32>>>>,
    trees: Vec<Vec<Option<TreeSum>>>,
    /// Per (unit, member): what the forward left for the backward.
    pub served: HashMap<(usize, usize), Served>,
}

impl ExpertState {
    pub(super) fn new(plan: &Plan) -> Self {
        let (n, size) = (plan.model.units().len(), plan.experts.as_ref().map_or(0, |ep| ep.size));
        ExpertState {
            dtype: plan.precision.dtype(),
            grads: (0..n).map(|_| vec![None; size]).collect(),
            pieces: (0..n).map(|_| vec![None; size]).collect(),
            trees: (0..n).map(|_| (0..size).map(|_| None).collect()).collect(),
            served: HashMap::new(),
        }
    }

    /// The gradient accumulator of unit `u`'s slice for member `k`'s micro-batch (`len` long).
    pub(super) fn grad(&mut self, u: usize, k: usize, len: usize) -> &mut [f32] {
        self.grads[u][k].get_or_insert_with(|| vec![0.0; len])
    }

    /// Values of unit `u`'s slice ready to send for member `k`.
    pub(super) fn piece(&self, u: usize, k: usize) -> Option<&[f32]> {
        self.pieces.get(u)?.get(k)?.as_deref()
    }

    /// Unit `u`'s expert gradients are final for this slot: each member that computed a
    /// micro-batch in `slot` gets its slice's values ready (rounded to the storage type like any
    /// gradient; at stages 0–1 added to the member's block tree, ready with the block's last
    /// micro-batch).
    pub(super) fn ready(&mut self, plan: &Plan, rank: usize, slot: usize, u: usize) -> Result<(), String> {
        let Some(ep) = &plan.experts else { return Ok(()) };
        if !ep.is_moe(u) {
            return Ok(());
        }
        let len = ep.slice_range(u, ep.slice_of(rank)).len();
        for (k, q) in ep.group(rank).enumerate() {
            let Some(&leaf) = plan.leaves(q).get(slot) else { continue };
            let mut g = self.grads[u][k].take().unwrap_or_else(|| vec![0.0; len]);
            plan.precision.round(&mut g);
            if plan.reduces_per_micro_batch() {
                self.pieces[u][k] = Some(g);
                continue;
            }
            let (first, level) = plan.blocks[q]
                .iter()
                .copied()
                .find(|&(f, l)| f <= leaf && leaf < f + (1 << l))
                .ok_or_else(|| format!("micro-batch {leaf} is in none of rank {q}'s blocks"))?;
            if leaf == first {
                self.trees[u][k] = Some(tree(self.dtype));
            }
            let t = self.trees[u][k].as_mut().ok_or_else(|| format!("unit {u}: rank {q}'s micro-batch {leaf} before its block began"))?;
            t.push_block(leaf - first, 0, g).map_err(|e| e.to_string())?;
            if leaf + 1 == (first + (1 << level)).min(plan.micro_batches) {
                self.pieces[u][k] = self.trees[u][k].take().and_then(TreeSum::finish);
            }
        }
        Ok(())
    }

    /// The slot is over: its pieces were sent, its saved activations are done with.
    pub(super) fn end_slot(&mut self) {
        self.pieces.iter_mut().flatten().for_each(|p| *p = None);
        self.grads.iter_mut().flatten().for_each(|g| *g = None);
        self.served.clear();
    }
}

/// The expert-parallel [`ExpertRunner`] of one rank in one slot: its micro-batch's rows go to
/// the group members that run their experts (one all-to-all over the world, empty outside the
/// group), it runs its own slice's experts on every member's rows — member by member, so each
/// expert sees exactly the rows of one micro-batch, as with one worker — and the outputs come
/// back (a second all-to-all); the backward mirrors it, and the experts' parameter gradients
/// stay in [`ExpertState`], per member, for the owners. A rank without a micro-batch in the
/// slot runs it with no rows of its own.
pub(super) struct EpRunner<'s> {
    pub plan: &'s Plan,
    pub rank: usize,
    pub lane: &'s mut Lane,
    pub state: &'s mut ExpertState,
    pub error: &'s mut Option<ComputeError>,
    pub waited: &'s mut Duration,
}

impl EpRunner<'_> {
    fn all_to_all(&mut self, what: &'static str, sends: Vec<Vec<f32>>) -> Option<Vec<Vec<f32>>> {
        if self.error.is_some() {
            return None;
        }
        let t0 = Instant::now();
        let got = self.lane.call(what, move |c| {
            let refs: Vec<&[f32]> = sends.iter().map(Vec::as_slice).collect();
            c.all_to_all(&refs).map_err(ComputeError::from)
        });
        *self.waited += t0.elapsed();
        match got.and_then(|r| r) {
            Ok(v) => Some(v),
            Err(e) => {
                self.error.get_or_insert(e);
                None
            }
        }
    }

    fn fail(&mut self, e: String) {
        self.error.get_or_insert(ComputeError::failed(e));
    }

    /// `rows` of each expert as the group's messages (`pack(rows, experts of member k)` to
    /// member k, nothing to the rest of the world).
    fn to_members(&self, pack: impl Fn(Range<usize>) -> Vec<f32>) -> Vec<Vec<f32>> {
        let ep = self.plan.experts.as_ref().expect("an expert-parallel plan");
        let mut sends = vec![Vec::new(); self.plan.world];
        for (k, m) in ep.group(self.rank).enumerate() {
            sends[m] = pack(ep.experts_of(k));
        }
        sends
    }

    /// This rank's rows' results from the members' replies (`counts[e]` rows of expert `e`).
    fn results_from_members(&mut self, got: &[Vec<f32>], counts: &[usize], c: usize) -> Vec<Vec<f32>> {
        let ep = self.plan.experts.as_ref().expect("an expert-parallel plan").clone();
        let mut out = vec![Vec::new(); counts.len()];
        for (k, m) in ep.group(self.rank).enumerate() {
            let xs = ep.experts_of(k);
            match unpack_plain(&got[m], &counts[xs.clone()], c) {
                Ok(parts) => parts.into_iter().enumerate().for_each(|(i, p)| out[xs.start + i] = p),
                Err(e) => self.fail(format!("rank {m}'s expert results: {e}")),
            }
        }
        for (e, o) in out.iter_mut().enumerate() {
            o.resize(counts[e] * c, 0.0);
        }
        out
    }
}

impl ExpertRunner for EpRunner<'_> {
    fn forward(&mut self, unit: usize, mlp: &dyn ExpertMlp, p: &[f32], rows: Vec<Vec<f32>>) -> Vec<Vec<f32>> {
        let c = mlp.width();
        let ep = self.plan.experts.as_ref().expect("an expert-parallel plan").clone();
        let counts: Vec<usize> = rows.iter().map(|r| r.len() / c).collect();
        let sends = self.to_members(|xs| pack_rows(&rows, xs, c));
        let Some(got) = self.all_to_all("sending tokens to their experts", sends) else {
            return rows.iter().map(|r| vec![0.0; r.len()]).collect();
        };
        let mine = ep.experts_of(ep.slice_of(self.rank));
        let mut back = vec![Vec::new(); self.plan.world];
        for (k, m) in ep.group(self.rank).enumerate() {
            let theirs = match unpack_rows(&got[m], mine.len(), c) {
                Ok(t) => t,
                Err(e) => {
                    self.fail(format!("rank {m}'s tokens for experts {mine:?}: {e}"));
                    vec![Vec::new(); mine.len()]
                }
            };
            let mut acts = vec![ExpertActs::new(); mine.len()];
            let mut reply = Vec::new();
            for (i, x) in theirs.iter().enumerate() {
                if !x.is_empty() {
                    let e = mine.start + i;
                    reply.extend(mlp.forward(e, &p[mlp.expert_range(e)], x, &mut acts[i]));
                }
            }
            back[m] = reply;
            let served = Served { counts: theirs.iter().map(|x| x.len() / c).collect(), acts };
            self.state.served.insert((unit, k), served);
        }
        match self.all_to_all("returning the experts' outputs", back) {
            Some(got) => self.results_from_members(&got, &counts, c),
            None => rows.iter().map(|r| vec![0.0; r.len()]).collect(),
        }
    }

    fn backward(&mut self, unit: usize, mlp: &dyn ExpertMlp, p: &[f32], d_out: Vec<Vec<f32>>) -> Vec<Vec<f32>> {
        let c = mlp.width();
        let ep = self.plan.experts.as_ref().expect("an expert-parallel plan").clone();
        let counts: Vec<usize> = d_out.iter().map(|r| r.len() / c).collect();
        let sends = self.to_members(|xs| pack_plain(&d_out, xs));
        let Some(got) = self.all_to_all("sending output gradients to their experts", sends) else {
            return d_out.iter().map(|r| vec![0.0; r.len()]).collect();
        };
        let j = ep.slice_of(self.rank);
        let (mine, slice) = (ep.experts_of(j), ep.slice_range(unit, j));
        let base = self.plan.model.units()[unit].start;
        let mut back = vec![Vec::new(); self.plan.world];
        for (k, m) in ep.group(self.rank).enumerate() {
            let Some(mut served) = self.state.served.remove(&(unit, k)) else {
                self.fail(format!("unit {unit}: the backward of rank {m}'s tokens came before their forward"));
                continue;
            };
            let dys = match unpack_plain(&got[m], &served.counts, c) {
                Ok(d) => d,
                Err(e) => {
                    self.fail(format!("rank {m}'s output gradients for experts {mine:?}: {e}"));
                    continue;
                }
            };
            let g = self.state.grad(unit, k, slice.len());
            let mut reply = Vec::new();
            for (i, dy) in dys.iter().enumerate() {
                if dy.is_empty() {
                    continue;
                }
                let e = mine.start + i;
                let r = mlp.expert_range(e);
                let gr = r.start + base - slice.start..r.end + base - slice.start;
                reply.extend(mlp.backward(e, &p[r], &mut g[gr], &mut served.acts[i], dy));
            }
            back[m] = reply;
        }
        match self.all_to_all("returning the experts' input gradients", back) {
            Some(got) => self.results_from_members(&got, &counts, c),
            None => d_out.iter().map(|r| vec![0.0; r.len()]).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::super::testing::{two_steps, two_steps_with, EP_SIZE};

    /// The Mixtral fixture folder (4 experts, top 2, every block MoE), as `tessera.model`.
    fn mixtral() -> String {
        format!("tessera.model={:?}", concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/hf/mixtral"))
    }

    /// Expert parallelism changes where experts run, never a bit: every ep_size, world size and
    /// ZeRO stage, uneven blocks (ranks with fewer micro-batches serve their group's tokens in
    /// the slots they have none), overlap, small buckets and activation recomputation give the
    /// parameters of one worker.
    #[test]
    fn expert_parallel_ranks_give_the_bits_of_one_worker() {
        let m = mixtral();
        let (one, _) = two_steps(1, 0, &[m.as_str()]);
        let uneven: &[f64] = &[3.0, 1.0];
        let on = "zero_optimization.overlap_comm=true";
        let small = "zero_optimization.reduce_bucket_size=20000";
        let recompute = "tessera.activation_checkpointing=true";
        for (world, ep, stage, extra, speeds) in [
            (2, 2, 0, vec![], None),
            (2, 2, 1, vec![], Some(uneven)),
            (2, 2, 2, vec![on, small], None),
            (2, 2, 3, vec![], Some(uneven)),
            (4, 2, 3, vec![on, small], None),
            (4, 4, 2, vec![], None),
            (4, 4, 3, vec![recompute], None),
            (4, 2, 1, vec![recompute, small], None),
        ] {
            EP_SIZE.set(ep);
            let mut sets = vec![m.as_str()];
            sets.extend(extra.iter().copied());
            let (got, ops) = two_steps_with(world, stage, &sets, speeds, |c| Box::new(c));
            EP_SIZE.set(1);
            let (plain, plain_ops) = two_steps_with(world, stage, &sets, speeds, |c| Box::new(c));
            assert_eq!(got, one, "world {world}, ep_size {ep}, stage {stage}, {extra:?}, speeds {speeds:?}: not the bits of one worker");
            assert_eq!(plain, one, "world {world} stage {stage} without expert parallelism");
            // The experts' exchanges happened: two all-to-alls a block each way, every slot.
            assert!(ops.iter().zip(&plain_ops).all(|(a, b)| a > b), "ep {ep}: ops {ops:?} vs {plain_ops:?} without");
        }
    }

    #[test]
    fn messages_round_trip_and_bad_ones_are_named() {
        let c = 2;
        let rows = vec![vec![1.0, 2.0], vec![], vec![3.0, 4.0, 5.0, 6.0], vec![7.0, 8.0]];
        let msg = pack_rows(&rows, 1..3, c);
        assert_eq!(msg, vec![0.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!(unpack_rows(&msg, 2, c).unwrap(), vec![vec![], vec![3.0, 4.0, 5.0, 6.0]]);
        let plain = pack_plain(&rows, 0..2);
        assert_eq!(unpack_plain(&plain, &[1, 0], c).unwrap(), vec![vec![1.0, 2.0], vec![]]);
        assert!(unpack_plain(&plain, &[2, 0], c).unwrap_err().contains("holds 2 values"));
        assert!(unpack_rows(&[0.5, 1.0], 1, c).unwrap_err().contains("row count 0.5"));
        assert!(unpack_rows(&[], 1, c).unwrap_err().contains("no header"));
    }
}
