//! What a rank holds ([`RankState`]): its working parameters ([`ParamStore`], in memory or with
//! the stage-3 shard in a swap file), reduced gradients, fp32 masters and optimizer state.

use std::ops::Range;

use tessera_actors::compute::MemoryReport;
use tessera_kernels::dtype::DType;
use tessera_kernels::optim::LossScaler;

use super::super::plan::Plan;
use super::super::store::Store;
use super::swap::ParamSwap;
use crate::offload::{self, AioOptions, Masters, OptimState, SwapFile, Tier};

/// The persistent state of one rank: what a checkpoint saves and memory accounting counts.
pub struct RankState {
    /// Working parameters in the storage type: the whole buffer, or in stage 3 `ranges[r]`
    /// plus the persistent units (`Plan::param_ranges`).
    pub params: ParamStore,
    /// Reduced gradients in the storage type: the whole buffer (stages 0–1) or `ranges[r]`.
    pub grads: Store,
    /// fp32 masters of `plan.optim_range(r)`, in the tier `offload_optimizer` names.
    pub master: Masters,
    /// Optimizer moments of the same range, in the same tier.
    pub optim: OptimState,
    /// Whether `offload_param` keeps the stage-3 parameter shard out of the device budget.
    pub params_offloaded: bool,
    /// Bytes of the masters and moments out of the device budget (`Plan::offloaded_optim_bytes`).
    pub optim_offloaded: u64,
    /// An NVMe swap file that could not be set up at start (the states then stay in memory and
    /// the rank reports this before its first step).
    pub offload_error: Option<String>,
    pub scaler: Option<LossScaler>,
    /// Optimizer steps applied (the LR schedule's clock) and steps skipped on overflow.
    pub applied: u64,
    pub skipped: u64,
    /// Bytes this rank has sent through collectives so far (prepare and commit), for the
    /// driver's per-step communication figures.
    pub bytes_sent_total: u64,
    /// Collective operations this rank has completed so far (prepare and commit).
    pub ops_total: u64,
}

/// Working parameters of one rank: disjoint flat ranges of the buffer, each held in memory
/// (packed in order in one `Store`, so its bytes are the bytes really held) or, with
/// `offload_param.device = nvme`, the stage-3 shard's ranges in a swap file.
pub struct ParamStore {
    /// (flat range, where it is held), sorted by flat start.
    segs: Vec<(Range<usize>, Held)>,
    store: Store,
    swap: Option<ParamSwap>,
    /// Bytes of the stage-3 shard among them (what `offload_param` moves out of the budget).
    pub shard_bytes: u64,
}

#[derive(Clone, Copy, Debug)]
enum Held {
    /// At this offset of `store`.
    Memory(usize),
    /// At this element offset of the swap file.
    Swap(usize),
}

impl ParamStore {
    /// Holds `ranges` (sorted, disjoint) of `full` in memory, rounded to `dtype`.
    pub fn new(dtype: DType, ranges: &[Range<usize>], full: &[f32]) -> ParamStore {
        let segs: Vec<(Range<usize>, bool)> = ranges.iter().map(|r| (r.clone(), false)).collect();
        Self::build(dtype, &segs, full, None).unwrap_or_else(|e| unreachable!("memory-only store: {e}"))
    }

    /// Holds `memory` in memory and `swapped` in a new swap file at `path` (both sorted,
    /// disjoint, not overlapping each other), rounded to `dtype`. Fails naming the file.
    fn with_swap(
        dtype: DType,
        memory: &[Range<usize>],
        swapped: &[Range<usize>],
        full: &[f32],
        path: std::path::PathBuf,
        aio: &AioOptions,
    ) -> Result<ParamStore, String> {
        let elems: usize = swapped.iter().map(Range::len).sum();
        let bytes = (elems * dtype.size_bytes()) as u64;
        let file = SwapFile::create(path.clone(), bytes, aio)
            .map_err(|e| format!("creating parameter swap file {} ({bytes} bytes): {e}", path.display()))?;
        let mut segs: Vec<(Range<usize>, bool)> =
            memory.iter().map(|r| (r.clone(), false)).chain(swapped.iter().map(|r| (r.clone(), true))).collect();
        segs.sort_by_key(|(r, _)| r.start);
        Self::build(dtype, &segs, full, Some(ParamSwap { file, dtype, elems }))
    }

    fn build(dtype: DType, ranges: &[(Range<usize>, bool)], full: &[f32], swap: Option<ParamSwap>) -> Result<ParamStore, String> {
        let (mut mem, mut sw) = (0, 0);
        let segs: Vec<(Range<usize>, Held)> = ranges
            .iter()
            .map(|(r, swapped)| {
                let held = if *swapped { Held::Swap(sw) } else { Held::Memory(mem) };
                *(if *swapped { &mut sw } else { &mut mem }) += r.len();
                (r.clone(), held)
            })
            .collect();
        let mut p = ParamStore { segs, store: Store::zeros(dtype, mem), swap, shard_bytes: 0 };
        for (r, _) in ranges {
            p.write(r.start, &full[r.clone()])?;
        }
        Ok(p)
    }

    /// Bytes held, in memory and in the swap file.
    pub fn bytes(&self) -> u64 {
        self.store.bytes() + self.swap.as_ref().map_or(0, |s| (s.elems * s.elem_bytes()) as u64)
    }

    /// Bytes held in the swap file.
    pub fn swapped_bytes(&self) -> u64 {
        self.swap.as_ref().map_or(0, |s| (s.elems * s.elem_bytes()) as u64)
    }

    /// The held pieces covering flat `[start, start + len)`, in order, as (offset into the
    /// caller's slice, length, where held); fails if part of it is not held by this rank.
    fn pieces(&self, start: usize, len: usize) -> Result<Vec<(usize, usize, Held)>, String> {
        let end = start + len;
        let mut out = Vec::new();
        let mut at = start;
        for (r, held) in self.segs.iter().filter(|(r, _)| r.start < end && r.end > start) {
            if r.start > at {
                break;
            }
            let hi = r.end.min(end);
            let inner = at - r.start;
            let h = match *held {
                Held::Memory(o) => Held::Memory(o + inner),
                Held::Swap(o) => Held::Swap(o + inner),
            };
            out.push((at - start, hi - at, h));
            at = hi;
        }
        if at < end {
            return Err(format!("parameters {start}..{end} are not held by this rank"));
        }
        Ok(out)
    }

    /// `out = params[start .. start + out.len()]` (flat indices), widened to f32.
    pub fn read(&self, start: usize, out: &mut [f32]) -> Result<(), String> {
        for (o, n, held) in self.pieces(start, out.len())? {
            match (held, &self.swap) {
                (Held::Memory(off), _) => self.store.read(off, &mut out[o..o + n]),
                (Held::Swap(off), Some(sw)) => sw.read(off, &mut out[o..o + n])?,
                (Held::Swap(_), None) => return Err("a swapped parameter range has no swap file".into()),
            }
        }
        Ok(())
    }

    /// `params[start ..] = src` (flat indices), rounded to the storage type.
    pub fn write(&mut self, start: usize, src: &[f32]) -> Result<(), String> {
        for (o, n, held) in self.pieces(start, src.len())? {
            match (held, &self.swap) {
                (Held::Memory(off), _) => self.store.write(off, &src[o..o + n]),
                (Held::Swap(off), Some(sw)) => sw.write(off, &src[o..o + n])?,
                (Held::Swap(_), None) => return Err("a swapped parameter range has no swap file".into()),
            }
        }
        Ok(())
    }
}

/// Rank `rank`'s working parameters: in memory, or with `offload_param.device = nvme` its
/// stage-3 shard (less the persistent units, which every rank holds whole in memory) in a swap
/// file under `nvme_path`, one per rank, removed when the run ends.
fn param_store(plan: &Plan, rank: usize, full: &[f32]) -> Result<ParamStore, String> {
    let dtype = plan.precision.dtype();
    let held = plan.param_ranges(rank);
    let (Tier::Nvme, Some(dir), 3) = (plan.offload.param, plan.offload.param_dir.as_ref(), plan.stage) else {
        return Ok(ParamStore::new(dtype, &held, full));
    };
    let swapped = plan.param_swap_ranges(rank);
    let memory = super::super::plan::subtract(&held, &swapped);
    let path = dir.join(format!("tessera-{}-rank{rank}-params.swp", std::process::id()));
    ParamStore::with_swap(dtype, &memory, &swapped, full, path, &plan.offload.aio)
}

impl RankState {
    /// A fresh rank from the full initial masters.
    pub fn new(plan: &Plan, rank: usize, full_master: &[f32], scaler: Option<LossScaler>) -> RankState {
        let dtype = plan.precision.dtype();
        let total = plan.total();
        let opt = plan.optim_range(rank);
        let g_len = if plan.stage <= 1 { total } else { plan.ranges[rank].len() };
        let site = offload::state::site(&plan.offload, rank);
        let (master, e1) = Masters::new(full_master[opt.clone()].to_vec(), plan.offload.optimizer, site.as_ref());
        let (optim, e2) = OptimState::new(plan.optimizer, opt.len(), plan.offload.optimizer, site.as_ref());
        let mut e3 = None;
        RankState {
            params: {
                let mut p = match param_store(plan, rank, full_master) {
                    Ok(p) => p,
                    Err(e) => {
                        e3 = Some(e);
                        ParamStore::new(dtype, &plan.param_ranges(rank), full_master)
                    }
                };
                if plan.stage == 3 {
                    p.shard_bytes = (plan.ranges[rank].len() * dtype.size_bytes()) as u64;
                }
                p
            },
            grads: Store::zeros(dtype, g_len),
            master,
            optim,
            params_offloaded: plan.stage == 3 && plan.offload.param != Tier::Device,
            optim_offloaded: plan.offloaded_optim_bytes(rank),
            offload_error: e1.or(e2).or(e3),
            scaler,
            applied: 0,
            skipped: 0,
            bytes_sent_total: 0,
            ops_total: 0,
        }
    }

    /// The model states this rank keeps resident ("device" memory): offloaded parts are not
    /// counted (`Plan::offloaded_bytes` reports them).
    pub fn memory(&self, rank: usize) -> MemoryReport {
        let optim = (self.master.bytes() + self.optim.bytes()).saturating_sub(self.optim_offloaded);
        let shard = if self.params_offloaded { self.params.shard_bytes } else { 0 };
        MemoryReport { rank, param_bytes: self.params.bytes() - shard, grad_bytes: self.grads.bytes(), optim_bytes: optim }
    }
}

#[cfg(test)]
mod tests {
    use super::super::gather_schedule;
    use super::super::testing::{plan, plan_error, two_steps};
    use super::*;

    /// A store with part of its ranges in a swap file reads and writes exactly like one held
    /// in memory, across segment and block boundaries, in every storage type.
    #[test]
    fn a_param_store_with_a_swap_file_matches_one_in_memory() {
        let dir = tempfile::tempdir().expect("tempdir");
        let aio = AioOptions { block: 4096, ..AioOptions::default() };
        let full: Vec<f32> = (0..20_000).map(|i| ((i as f32) * 0.731).sin() * 3.0 + 1.0 / 3.0).collect();
        let memory = [100..900, 5000..5100];
        let swapped = [900..5000, 7000..19_000];
        let all = [100..5100, 7000..19_000];
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let path = dir.path().join(format!("p-{dtype:?}.swp"));
            let mut sw = ParamStore::with_swap(dtype, &memory, &swapped, &full, path.clone(), &aio).expect("swap store");
            let mut mem = ParamStore::new(dtype, &all, &full);
            assert!(path.exists());
            assert_eq!(sw.bytes(), mem.bytes());
            assert_eq!(sw.swapped_bytes(), (16_100 * dtype.size_bytes()) as u64);
            // Writes straddling memory/swap boundaries and partial blocks.
            for (k, (start, len)) in [(850, 100), (4990, 110), (7001, 3), (9000, 4096), (18_990, 10), (100, 5000)].into_iter().enumerate() {
                let vals: Vec<f32> = (0..len).map(|i| (i as f32 + k as f32 * 0.1).cos() * 7.0).collect();
                sw.write(start, &vals).expect("swap write");
                mem.write(start, &vals).expect("memory write");
            }
            for (start, len) in [(100, 5000), (7000, 12_000), (899, 2), (4999, 2), (12_345, 1)] {
                let (mut a, mut b) = (vec![0.0; len], vec![0.0; len]);
                sw.read(start, &mut a).expect("swap read");
                mem.read(start, &mut b).expect("memory read");
                assert_eq!(a, b, "{dtype:?} {start}+{len}");
            }
            assert!(sw.read(5050, &mut [0.0; 100]).unwrap_err().contains("5050..5150"));
            drop(sw);
            assert!(!path.exists(), "the swap file is removed with the store");
        }
    }

    /// `offload_optimizer.ratio` keeps that share of the masters and moments out of the budget:
    /// a budget between the two splits refuses the smaller ratio and admits the larger.
    #[test]
    fn a_partial_optimizer_offload_moves_its_share_out_of_the_budget() {
        let cpu = "zero_optimization.offload_optimizer.device=cpu";
        let ratio = |r: f64| format!("zero_optimization.offload_optimizer.ratio={r}");
        let (r3, r7) = (ratio(0.3), ratio(0.7));
        let p3 = plan(2, 3, &[cpu, &r3]);
        let p7 = plan(2, 3, &[cpu, &r7]);
        let all = p3.model_state_bytes(0).optim;
        let off3 = p3.offloaded_bytes(0).host;
        assert!((off3 as f64 - 0.3 * all as f64).abs() <= 16.0, "{off3} of {all}");
        assert_eq!(p3.resident_bytes(0).optim + off3, all);
        let (need3, need7) = (p3.resident_bytes(0).total(), p7.resident_bytes(0).total());
        assert!(need7 < need3);
        let budget = format!("tessera.device_memory_bytes_max={}", (need3 + need7) / 2);
        let e = plan_error(2, 3, &[cpu, &r3, &budget]);
        assert!(e.contains("tessera.device_memory_bytes_max") && e.contains(&need3.to_string()), "{e}");
        assert_eq!(plan_error(2, 3, &[cpu, &r7, &budget]), "");
        // The split is accounting of one machine's memory: the bits do not change.
        let (one, _) = two_steps(1, 0, &[]);
        assert_eq!(two_steps(2, 3, &[cpu, &r3]).0, one);
        let e = plan_error(
            2,
            3,
            &["zero_optimization.offload_optimizer.device=nvme", "zero_optimization.offload_optimizer.nvme_path=/tmp", &r3],
        );
        assert!(e.contains("ratio = 0.3"), "{e}");
    }

    /// `offload_param.device = nvme` keeps stage 3 bit-identical; a missing path is refused.
    #[test]
    fn parameter_shards_on_nvme_keep_stage_3_bit_identical() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (one, _) = two_steps(1, 0, &[]);
        let path = format!("zero_optimization.offload_param.nvme_path={}", dir.path().display());
        for (persist, in_cpu) in [("0", "0"), ("100000", "0"), ("0", "150000")] {
            let sets = [
                "zero_optimization.offload_param.device=nvme",
                path.as_str(),
                &format!("zero_optimization.stage3_param_persistence_threshold={persist}"),
                &format!("zero_optimization.offload_param.max_in_cpu={in_cpu}"),
                "zero_optimization.offload_param.buffer_count=2",
                "aio.block_size=4096",
            ];
            let (two, _) = two_steps(2, 3, &sets);
            assert_eq!(one, two, "stage 3 with parameters on NVMe, persistence threshold {persist}, max_in_cpu {in_cpu}");
            // The shard leaves the budget: max_in_cpu of it in host memory, the rest on NVMe.
            let p = plan(2, 3, &sets);
            let off = p.offloaded_bytes(1);
            let shard = p.ranges[1].len() as u64 * 4;
            assert_eq!(off.host + off.nvme, shard);
            assert_eq!(off.host, shard.min(in_cpu.parse::<u64>().unwrap() * 4), "{off:?}");
        }
        // Two buffers: the current unit's and one read ahead.
        let p = plan(
            2,
            3,
            &[
                "zero_optimization.offload_param.device=nvme",
                path.as_str(),
                "zero_optimization.offload_param.buffer_count=2",
                "zero_optimization.stage3_param_persistence_threshold=0",
            ],
        );
        let sched = gather_schedule(&p);
        for g in &sched {
            let ahead = sched.iter().filter(|h| h.issue_at <= g.use_at && g.use_at < h.use_at).count();
            assert!(ahead <= 1, "at use {}: {ahead} gathers read ahead with 2 buffers", g.use_at);
        }
        assert!(sched.iter().any(|g| g.issue_at < g.use_at));
        let e = plan_error(
            2,
            3,
            &[
                "zero_optimization.offload_param.device=nvme",
                path.as_str(),
                "zero_optimization.offload_param.buffer_size=1000",
                "zero_optimization.stage3_param_persistence_threshold=0",
            ],
        );
        assert!(e.contains("buffer_size = 1000") && e.contains("unit 0"), "{e}");
        assert_eq!(std::fs::read_dir(dir.path()).expect("dir").count(), 0, "swap files are removed at the end");
        let e = plan_error(2, 3, &["zero_optimization.offload_param.device=nvme"]);
        assert!(e.contains("zero_optimization.offload_param.nvme_path"), "{e}");
        let e = plan_error(
            2,
            3,
            &["zero_optimization.offload_param.device=nvme", "zero_optimization.offload_param.nvme_path=/nonexistent/tessera"],
        );
        assert!(e.contains("/nonexistent/tessera"), "{e}");
    }

    #[test]
    fn a_param_store_reads_and_writes_only_what_it_holds() {
        let full: Vec<f32> = (0..100).map(|i| i as f32).collect();
        let mut s = ParamStore::new(DType::F32, &[10..20, 50..60], &full);
        assert_eq!(s.bytes(), 80);
        let mut out = [0.0; 3];
        s.read(52, &mut out).expect("held");
        assert_eq!(out, [52.0, 53.0, 54.0]);
        s.write(18, &[1.5, 2.5]).expect("held");
        s.read(17, &mut out).expect("held");
        assert_eq!(out, [17.0, 1.5, 2.5]);
        assert!(s.read(19, &mut out).unwrap_err().contains("19..22"));
        assert!(s.write(30, &[0.0]).is_err());
        s.read(99, &mut []).expect("an empty read touches nothing");
    }
}
