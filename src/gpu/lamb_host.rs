//! LAMB's host step for optimizer offload on a GPU rank (`optimizer.type = "Lamb"` with
//! `offload_optimizer.device = "cpu"`, the whole optimizer shard on the host: one GPU, ratio 1).
//!
//! LAMB is not elementwise: each tensor's trust ratio `‖p‖/‖u‖` needs the whole tensor's update
//! `u` before any element moves. The host worker ([`super::offload`]) therefore runs it in the
//! CPU engine's two phases around the norms, with the CPU engine's own kernels
//! (`optim::lamb::lamb_update_kernel` / `lamb_commit_kernel`), which the GPU LAMB reproduces bit
//! for bit (`tessera gpu check`'s LAMB rows):
//! 1. as each unit's gradient arrives (and the gradient's multiplier is known), [`LambHost::update`]
//!    writes that unit's `u` into a host scratch buffer; the state is not touched yet (an fp16
//!    overflow can still skip the step);
//! 2. once every unit is in, [`LambHost::ratios`] sums the squares of the masters and of `u` over
//!    the CPU layout's slots (tensor ∩ 16384-element block, [`sumsq_f64`]'s lane order) and
//!    combines them per tensor in slot order, as `FlatLayout::segment_sumsq` does;
//! 3. [`LambHost::commit`] stores the moments and steps each tensor with its ratio, unit by unit.
//!
//! The host arrays hold the rank's optimizer shard in the GPU's padded layout (one rank, every
//! piece on the host: the same coordinates as the device buffers `cuda::lamb` steps), so the
//! slots are the ones `cuda::lamb::slot_table` maps for the device.

use std::ops::Range;

use anyhow::{bail, Result};
use rayon::prelude::*;
use tessera_kernels::cuda::lamb::slot_table;
use tessera_kernels::cuda::optim::LambStep;
use tessera_kernels::optim::lamb::{lamb_commit_kernel, lamb_update_kernel, LambCoeffs};
use tessera_kernels::optim::norm::sumsq_f64;
use tessera_kernels::optim::FlatLayout;

use super::offload::CHUNK;

/// The norm layout of LAMB's host step and its scratch (see the module notes).
pub struct LambHost {
    /// The CPU's norm layout (segments = tensors).
    layout: FlatLayout,
    /// Per slot, in global slot order: its range in the host arrays.
    slots: Vec<Range<usize>>,
    /// Per unit: its tensors' pieces (tensor index, range in the host arrays), at most
    /// [`CHUNK`] long (elementwise jobs: the same bits however cut).
    pieces: Vec<Vec<(usize, Range<usize>)>>,
    /// Phase 1's update `u`, as long as the host arrays.
    u: Vec<f32>,
}

impl LambHost {
    /// `layout`'s tensors at `tensor_starts` of the padded GPU layout, whose unit `u` spans
    /// `units[u]`; `host_units[u]`: where the host arrays hold unit `u` (they must be the same
    /// ranges: one rank with every piece on the host).
    pub fn new(layout: FlatLayout, tensor_starts: &[usize], units: &[Range<usize>], host_units: &[Range<usize>]) -> Result<LambHost> {
        if units != host_units {
            bail!(
                "optimizer.type = \"Lamb\" with offload_optimizer: the host step needs every tensor of the model on the host of one \
                 rank (offload_optimizer.ratio = 1, one GPU or ZeRO stage 0)"
            );
        }
        let t = slot_table(&layout, tensor_starts)?;
        let len = units.last().map_or(0, |r| r.end);
        if let Some(r) = t.dev.iter().find(|r| r.end > len) {
            bail!("LAMB's host step: a tensor at {r:?} lies beyond the {len} elements of the host arrays");
        }
        let slots = t.starts.iter().zip(&t.lens).map(|(&s, &l)| s as usize..s as usize + l as usize).collect();
        let pieces = units
            .iter()
            .map(|unit| {
                let mut out = Vec::new();
                for (k, r) in t.dev.iter().enumerate() {
                    let (lo, hi) = (r.start.max(unit.start), r.end.min(unit.end));
                    let mut at = lo;
                    while at < hi {
                        let end = (at + CHUNK).min(hi);
                        out.push((k, at..end));
                        at = end;
                    }
                }
                out
            })
            .collect();
        Ok(LambHost { layout, slots, pieces, u: vec![0.0; len] })
    }

    /// Phase 1 for unit `unit`: `u` of each of its tensors' elements from the masters, the
    /// gradient `grad` (the unit's, already multiplied by the step's coefficient; index 0 is the
    /// unit's first element) and the moments, which stay as they are.
    #[allow(clippy::too_many_arguments)]
    pub fn update(&mut self, pool: &rayon::ThreadPool, c: &LambCoeffs, unit: usize, base: usize, st: State<'_>, grad: &[f32]) {
        let State { master, m, v, decay } = st;
        let pieces = &self.pieces[unit];
        let outs = carve(&mut self.u, pieces.iter().map(|(_, r)| r.clone()));
        pool.install(|| {
            outs.into_par_iter().zip(pieces).for_each(|(u, (_, r))| {
                let g = &grad[r.start - base..r.end - base];
                lamb_update_kernel(c, decay[r.start] != 0, &master[r.clone()], g, &m[r.clone()], &v[r.clone()], u);
            })
        });
    }

    /// Phase 2's trust ratio of every tensor from the masters and phase 1's `u`.
    pub fn ratios(&self, pool: &rayon::ThreadPool, hp: &LambStep, master: &[f32]) -> Vec<f32> {
        let (w, q): (Vec<f64>, Vec<f64>) =
            pool.install(|| self.slots.par_iter().map(|s| (sumsq_f64(&master[s.clone()]), sumsq_f64(&self.u[s.clone()]))).unzip());
        let (w_sq, u_sq) = (self.layout.segment_sumsq(&w), self.layout.segment_sumsq(&q));
        w_sq.iter().zip(&u_sq).map(|(w, q)| hp.params.trust_ratio(w.sqrt(), q.sqrt())).collect()
    }

    /// Phase 3 for unit `unit`: the moments stored and each tensor stepped by its ratio.
    #[allow(clippy::too_many_arguments)]
    pub fn commit(
        &self,
        pool: &rayon::ThreadPool,
        c: &LambCoeffs,
        ratios: &[f32],
        unit: usize,
        base: usize,
        st: StateMut<'_>,
        grad: &[f32],
    ) {
        let StateMut { master, m, v } = st;
        let pieces = &self.pieces[unit];
        let ranges = || pieces.iter().map(|(_, r)| r.clone());
        let (ps, ms, vs) = (carve(master, ranges()), carve(m, ranges()), carve(v, ranges()));
        pool.install(|| {
            ps.into_par_iter().zip(ms).zip(vs).zip(pieces).for_each(|(((p, m), v), (k, r))| {
                let g = &grad[r.start - base..r.end - base];
                lamb_commit_kernel(c, ratios[*k], g, m, v, p, &self.u[r.clone()]);
            })
        });
    }
}

/// What phase 1 reads: the host arrays (masters, moments, the decay mask).
pub struct State<'a> {
    pub master: &'a [f32],
    pub m: &'a [f32],
    pub v: &'a [f32],
    pub decay: &'a [u8],
}

/// What phase 3 writes: the masters and the moments.
pub struct StateMut<'a> {
    pub master: &'a mut [f32],
    pub m: &'a mut [f32],
    pub v: &'a mut [f32],
}

/// Disjoint mutable views of `buf` at `ranges` (ascending, not overlapping).
fn carve(mut buf: &mut [f32], ranges: impl Iterator<Item = Range<usize>>) -> Vec<&mut [f32]> {
    let (mut at, mut out) = (0, Vec::new());
    for r in ranges {
        let (_, rest) = std::mem::take(&mut buf).split_at_mut(r.start - at);
        let (piece, rest) = rest.split_at_mut(r.len());
        out.push(piece);
        (buf, at) = (rest, r.end);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_kernels::optim::{LambParams, LocalReduce, OptimizerKind, OptimizerShard, StepContext};
    use tessera_kernels::tensor::Rng;

    /// The host step over a padded layout cut into units (tensors crossing norm blocks, an empty
    /// one, one without decay) equals the CPU engine's `OptimizerShard::step` over the unpadded
    /// layout, bit for bit: masters and both moments, three steps, units arriving in reverse.
    #[test]
    fn the_host_lamb_is_the_cpu_engines() {
        let sizes = [700usize, 40_000, 0, 5_000, 20_000, 333];
        let decays = [true, true, true, false, true, true];
        let layout = FlatLayout::from_sizes(&sizes).unwrap();
        // Padded: each tensor at a multiple of 64 with a gap; units of two tensors each.
        let (mut starts, mut at) = (Vec::new(), 0usize);
        for &n in &sizes {
            at = (at + 17).next_multiple_of(64);
            starts.push(at);
            at += n;
        }
        let len = at.next_multiple_of(64);
        let unit_ends = [starts[2], starts[4], len];
        let units: Vec<Range<usize>> = unit_ends.iter().scan(0, |lo, &e| Some(std::mem::replace(lo, e)..e)).collect();
        let mut lamb = LambHost::new(layout.clone(), &starts, &units, &units).unwrap();
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        let total = layout.total();
        let mut p_cpu = vec![0f32; total];
        Rng::derive(3, &[0]).fill_normal(&mut p_cpu, 0.05);
        let (mut master, mut m, mut v, mut decay) = (vec![0f32; len], vec![0f32; len], vec![0f32; len], vec![0u8; len]);
        for (k, &s) in starts.iter().enumerate() {
            let seg = layout.segments()[k].clone();
            master[s..s + seg.len()].copy_from_slice(&p_cpu[seg]);
            decay[s..s + sizes[k]].fill(u8::from(decays[k]));
        }
        let params = LambParams { lr: 2e-3, weight_decay: 0.01, ..LambParams::default() };
        let mut shard = OptimizerShard::new(OptimizerKind::Lamb(params), total);
        for step in 1..=3u64 {
            let mut g_cpu = vec![0f32; total];
            Rng::derive(3, &[step]).fill_normal(&mut g_cpu, 0.01);
            let mut grad = vec![0f32; len];
            for (k, &s) in starts.iter().enumerate() {
                grad[s..s + sizes[k]].copy_from_slice(&g_cpu[layout.segments()[k].clone()]);
            }
            let ctx = StepContext { shard_range: 0..total, layout: &layout, decay: &decays };
            shard.step(&mut p_cpu, &g_cpu, 2e-3, &ctx, &mut LocalReduce).unwrap();
            let hp = LambStep { params, lr: 2e-3, step };
            let c = params.coeffs(2e-3, step);
            for (u, r) in units.iter().enumerate().rev() {
                lamb.update(&pool, &c, u, r.start, State { master: &master, m: &m, v: &v, decay: &decay }, &grad[r.clone()]);
            }
            let ratios = lamb.ratios(&pool, &hp, &master);
            for (u, r) in units.iter().enumerate().rev() {
                lamb.commit(&pool, &c, &ratios, u, r.start, StateMut { master: &mut master, m: &mut m, v: &mut v }, &grad[r.clone()]);
            }
            let state: Vec<&[f32]> = shard.state_buffers().into_iter().map(|(_, b)| b).collect();
            for (k, &s) in starts.iter().enumerate() {
                let seg = layout.segments()[k].clone();
                let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&master[s..s + sizes[k]]), bits(&p_cpu[seg.clone()]), "step {step}, tensor {k}: masters");
                assert_eq!(bits(&m[s..s + sizes[k]]), bits(&state[0][seg.clone()]), "step {step}, tensor {k}: exp_avg");
                assert_eq!(bits(&v[s..s + sizes[k]]), bits(&state[1][seg]), "step {step}, tensor {k}: exp_avg_sq");
            }
        }
    }

    #[test]
    fn a_host_that_does_not_hold_every_unit_is_refused() {
        let layout = FlatLayout::from_sizes(&[100, 100]).unwrap();
        let units = [0..128, 128..256];
        let e = LambHost::new(layout, &[0, 128], &units, &[0..64, 64..128]).err().unwrap().to_string();
        assert!(e.contains("offload_optimizer.ratio = 1"), "{e}");
    }
}
