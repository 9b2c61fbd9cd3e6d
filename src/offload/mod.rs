//! ZeRO-Offload for CPU ranks: where a rank's model states live, and a per-rank budget on what
//! it keeps resident.
//!
//! A rank's "device" memory is what it keeps resident for compute: its working parameters,
//! reduced gradients, fp32 masters and optimizer moments (the model states of
//! `model_state_bytes_per_rank`; activations and transient buffers are not counted).
//! `tessera.device_memory_bytes_max` bounds it per rank; a run over the bound is refused at
//! start. Offload moves states out of that budget into another tier:
//!
//! * `offload_optimizer.device = cpu`: the fp32 masters and moments of the rank's shard live in
//!   host-tier memory (on a CPU rank the same RAM, accounted apart as
//!   `offloaded_bytes_per_rank.host`); the optimizer steps them in place.
//! * `offload_optimizer.device = nvme`: they live in swap files under `nvme_path`, one per rank
//!   and buffer, created at start and removed at exit ([`io::SwapFile`]). Each optimizer step
//!   reads them sub-group by sub-group (`sub_group_size` elements, rounded to `aio.block_size`),
//!   steps, and writes them back; with `pipeline_read`/`pipeline_write` the next sub-group's read
//!   and the previous one's write overlap the current step ([`state::OptimState::step`]).
//! * `offload_param.device = cpu` (stage 3): the rank's parameter shard lives in host-tier
//!   memory; units are fetched from it before use (a read, then the gather), as without offload.
//! * `offload_param.device = nvme` (stage 3): the shard (less the small persistent units every
//!   rank holds whole) lives in one swap file per rank under `offload_param.nvme_path`, in the
//!   storage type; each gather reads the rank's piece of the unit from it — ahead of use when
//!   stage-3 prefetch queues the gather early — and the optimizer's new values are written back
//!   at commit (`engine::zero::ParamStore`). `max_in_cpu` elements of each shard stay in host
//!   memory; `buffer_count` × `buffer_size` bound the pieces read ahead (and a piece larger than
//!   `buffer_size` is refused at start).
//! * `offload_optimizer.ratio` < 1 with `device = cpu` (ZeRO-3, as in DeepSpeed): that share of
//!   the masters and moments is host-tier, the rest resident — accounting of one machine's
//!   memory on a CPU rank; on a GPU rank (`src/gpu/offload.rs`) the host really steps that share.
//!
//! Numerics never change: Adam, Lion and SGD are elementwise, so stepping sub-groups one by one
//! gives the same bits; Lamb (per-tensor norms over the shard) steps the shard as one sub-group.

pub mod io;
pub mod state;

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use serde::Serialize;

use crate::config::{Config, OffloadDevice};

pub use io::{AioOptions, AlignedBuf, Backend, SwapFile};
pub use state::{Masters, OptimState, Publish, SwapStats};

/// Where a kind of model state lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    /// Resident: counted against `tessera.device_memory_bytes_max`.
    Device,
    /// Host-tier memory.
    Host,
    /// Swap files.
    Nvme,
}

/// The run's offload decisions, fixed at start.
#[derive(Debug, Clone)]
pub struct OffloadPlan {
    pub optimizer: Tier,
    /// Swap-file directory of the optimizer states (`Tier::Nvme`).
    pub optimizer_dir: Option<PathBuf>,
    /// `offload_optimizer.ratio`: the share of each rank's optimizer states in the host tier
    /// (`optimizer` = `Tier::Host`; the rest stays resident).
    pub optimizer_ratio: f64,
    pub param: Tier,
    /// Swap-file directory of the stage-3 parameter shards (`param` = `Tier::Nvme`).
    pub param_dir: Option<PathBuf>,
    /// `offload_param.buffer_count` / `buffer_size` (elements): parameter pieces read from NVMe
    /// and not yet used may occupy at most this many buffers of this size.
    pub param_buffer_count: usize,
    pub param_buffer_elems: usize,
    /// `offload_param.max_in_cpu` (elements): this much of each shard stays in memory.
    pub param_max_in_cpu: usize,
    pub aio: AioOptions,
    pub pipeline_read: bool,
    pub pipeline_write: bool,
    /// Elements per swapped sub-group (a multiple of `aio.block / 4`).
    pub chunk_elems: usize,
    /// `tessera.device_memory_bytes_max`.
    pub budget: Option<u64>,
}

impl Default for OffloadPlan {
    fn default() -> Self {
        OffloadPlan {
            optimizer: Tier::Device,
            optimizer_dir: None,
            optimizer_ratio: 1.0,
            param: Tier::Device,
            param_dir: None,
            param_buffer_count: 5,
            param_buffer_elems: 100_000_000,
            param_max_in_cpu: 1_000_000_000,
            aio: AioOptions::default(),
            pipeline_read: false,
            pipeline_write: false,
            chunk_elems: 1 << 18,
            budget: None,
        }
    }
}

/// What one rank keeps resident, by kind, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ResidentBytes {
    pub params: u64,
    pub grads: u64,
    pub optim: u64,
}

impl ResidentBytes {
    pub fn total(&self) -> u64 {
        self.params + self.grads + self.optim
    }
}

/// What one rank keeps outside its device budget (`summary.json`'s `offloaded_bytes_per_rank`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct OffloadedBytes {
    pub rank: usize,
    pub host: u64,
    pub nvme: u64,
}

/// Checks that `dir` is an existing directory this process can create files in.
fn check_dir(key: &str, dir: &Path) -> Result<()> {
    let shown = dir.display();
    let meta = std::fs::metadata(dir).map_err(|e| anyhow::anyhow!("{key} = \"{shown}\": {e}; create the directory first"))?;
    if !meta.is_dir() {
        bail!("{key} = \"{shown}\" is not a directory");
    }
    let probe = dir.join(format!(".tessera-probe-{}", std::process::id()));
    std::fs::write(&probe, b"probe").map_err(|e| anyhow::anyhow!("{key} = \"{shown}\" is not writable: {e}"))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// Free bytes for an unprivileged writer on the filesystem of `dir`.
fn free_bytes(dir: &Path, key: &str) -> Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())?;
    // SAFETY: a zeroed statvfs is a valid out-parameter; `c` is NUL-terminated.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        let e = std::io::Error::last_os_error();
        bail!("{key} = \"{}\": {e}", dir.display());
    }
    Ok(st.f_bavail as u64 * st.f_frsize as u64)
}

fn tier_of(d: OffloadDevice) -> Tier {
    match d {
        OffloadDevice::None => Tier::Device,
        OffloadDevice::Cpu => Tier::Host,
        OffloadDevice::Nvme => Tier::Nvme,
    }
}

impl OffloadPlan {
    /// The decisions the config asks for; refuses what is not implemented and an unusable
    /// `nvme_path` (missing, not a directory, not writable), naming the key and the path.
    pub fn new(cfg: &Config) -> Result<OffloadPlan> {
        let (zero, a) = (&cfg.zero, &cfg.aio);
        let key = "zero_optimization.offload_optimizer";
        let mut plan = OffloadPlan { budget: cfg.tessera.device_memory_bytes_max, ..OffloadPlan::default() };
        if let Some(o) = &zero.offload_optimizer {
            plan.optimizer = tier_of(o.device);
            if plan.optimizer == Tier::Nvme && o.ratio < 1.0 {
                bail!(
                    "{key}.ratio = {}: partial offload splits the states between device and host memory; with device = \"nvme\" use 1.0",
                    o.ratio
                );
            }
            if plan.optimizer == Tier::Host {
                plan.optimizer_ratio = f64::from(o.ratio);
            }
            (plan.pipeline_read, plan.pipeline_write) = (o.pipeline_read, o.pipeline_write);
            if plan.optimizer == Tier::Nvme {
                let Some(path) = o.nvme_path.as_deref().filter(|p| !p.is_empty()) else {
                    bail!("{key}.device = \"nvme\" needs {key}.nvme_path (a writable directory for the swap files)");
                };
                check_dir(&format!("{key}.nvme_path"), Path::new(path))?;
                plan.optimizer_dir = Some(PathBuf::from(path));
            }
        }
        if let Some(p) = &zero.offload_param {
            plan.param = tier_of(p.device);
            if plan.param != Tier::Device && zero.stage != 3 {
                bail!(
                    "zero_optimization.offload_param needs ZeRO stage 3 (the stage with parameter shards); this run has stage {}",
                    zero.stage
                );
            }
            if plan.param == Tier::Nvme {
                let key = "zero_optimization.offload_param";
                let Some(path) = p.nvme_path.as_deref().filter(|p| !p.is_empty()) else {
                    bail!("{key}.device = \"nvme\" needs {key}.nvme_path (a writable directory for the parameter swap files)");
                };
                check_dir(&format!("{key}.nvme_path"), Path::new(path))?;
                plan.param_dir = Some(PathBuf::from(path));
                if p.buffer_count == 0 || p.buffer_size == 0 {
                    bail!(
                        "{key}.buffer_count = {} and buffer_size = {}: NVMe parameter offload needs at least one buffer of one element",
                        p.buffer_count,
                        p.buffer_size
                    );
                }
                plan.param_buffer_count = usize::try_from(p.buffer_count).unwrap_or(usize::MAX);
                plan.param_buffer_elems = usize::try_from(p.buffer_size).unwrap_or(usize::MAX);
                plan.param_max_in_cpu = usize::try_from(p.max_in_cpu).unwrap_or(usize::MAX);
            }
        }
        if plan.optimizer == Tier::Nvme || plan.param == Tier::Nvme {
            if a.block_size == 0 || a.block_size % 4096 != 0 || !a.block_size.is_power_of_two() || a.block_size > 1 << 30 {
                bail!("aio.block_size = {}: NVMe offload needs a power of two from 4096 to 2^30 bytes", a.block_size);
            }
            if !(1..=4096).contains(&a.queue_depth) {
                bail!("aio.queue_depth = {}: expected 1..=4096", a.queue_depth);
            }
            if !(1..=64).contains(&a.intra_op_parallelism) {
                bail!("aio.thread_count (or its older name aio.intra_op_parallelism) = {}: expected 1..=64", a.intra_op_parallelism);
            }
        }
        plan.aio = AioOptions {
            block: usize::try_from(a.block_size).unwrap_or(1 << 20).max(4096),
            queue_depth: u32::try_from(a.queue_depth).unwrap_or(8).max(1),
            threads: usize::try_from(a.intra_op_parallelism).unwrap_or(1).max(1),
            single_submit: a.single_submit,
            overlap_events: a.overlap_events,
        };
        let per_block = plan.aio.block / 4;
        let sub = usize::try_from(zero.sub_group_size).unwrap_or(usize::MAX).max(1);
        plan.chunk_elems = sub.div_ceil(per_block).saturating_mul(per_block);
        Ok(plan)
    }

    /// Bytes the optimizer swap files of one rank take on disk: `buffers` files of `elems` f32
    /// values, each rounded up to whole blocks.
    pub fn swap_bytes(&self, elems: usize, buffers: usize) -> u64 {
        if self.optimizer != Tier::Nvme {
            return 0;
        }
        let block = self.aio.block as u64;
        buffers as u64 * (elems as u64 * 4).div_ceil(block).max(1) * block
    }

    /// Refuses to start when `offload_param.nvme_path` has less free space than the parameter
    /// swap files need (`needed` bytes over every rank).
    pub fn check_param_space(&self, needed: u64) -> Result<()> {
        let Some(dir) = &self.param_dir else { return Ok(()) };
        let free = free_bytes(dir, "zero_optimization.offload_param.nvme_path")?;
        if needed > free {
            bail!(
                "zero_optimization.offload_param.nvme_path = \"{}\" has {free} bytes free, but the parameter swap files \
                 (every rank's stage-3 shard in the storage type, in whole aio.block_size blocks) need {needed}",
                dir.display()
            );
        }
        Ok(())
    }

    /// Refuses to start when `nvme_path` has less free space than the swap files need.
    pub fn check_space(&self, needed: u64) -> Result<()> {
        let Some(dir) = &self.optimizer_dir else { return Ok(()) };
        let free = free_bytes(dir, "zero_optimization.offload_optimizer.nvme_path")?;
        if needed > free {
            bail!(
                "zero_optimization.offload_optimizer.nvme_path = \"{}\" has {free} bytes free, but the optimizer swap files \
                 (fp32 masters and moments of every rank, in whole aio.block_size blocks) need {needed}",
                dir.display()
            );
        }
        Ok(())
    }

    /// Refuses a rank whose resident model states exceed the budget, naming both figures and
    /// what offload would save.
    pub fn check_budget(&self, rank: usize, resident: ResidentBytes, offloadable: ResidentBytes) -> Result<()> {
        let Some(max) = self.budget else { return Ok(()) };
        if resident.total() <= max {
            return Ok(());
        }
        let mut hints = Vec::new();
        if self.optimizer == Tier::Device {
            hints.push(format!(
                "zero_optimization.offload_optimizer.device = \"cpu\" or \"nvme\" moves the {} bytes of fp32 masters and moments out",
                offloadable.optim
            ));
        }
        if self.param == Tier::Device {
            hints.push(format!(
                "zero_optimization.offload_param.device = \"cpu\" (stage 3) moves the {} bytes of the parameter shard out",
                offloadable.params
            ));
        }
        let hint =
            if hints.is_empty() { "every offload is already on: use more ranks or a higher stage".to_string() } else { hints.join("; ") };
        check_resident(&format!("rank {rank}"), resident, max, &hint)
    }
}

/// Refuses `resident` model states over the budget `max`, naming both figures, each kind and
/// `hint` (what would bring them under). `who` names the rank(s), e.g. "rank 2".
pub fn check_resident(who: &str, resident: ResidentBytes, max: u64, hint: &str) -> Result<()> {
    if resident.total() <= max {
        return Ok(());
    }
    bail!(
        "{who} needs {} bytes of device memory for its model states (params {}, grads {}, fp32 masters and moments {}) \
         but tessera.device_memory_bytes_max = {max} ({} bytes over); {hint}",
        resident.total(),
        resident.params,
        resident.grads,
        resident.optim,
        resident.total() - max
    )
}

#[cfg(test)]
mod bench {
    //! Measurements (ignored by default): `cargo test --release --lib offload::bench -- --ignored --nocapture`,
    //! with `TESSERA_BENCH_DIR` naming a directory on the disk to measure (default: the current one).
    use std::path::{Path, PathBuf};
    use std::time::Instant;

    use tessera_kernels::optim::{AdamParams, FlatLayout, LocalReduce, OptimizerKind, OptimizerShard, StepContext};

    use super::io::{AioOptions, AlignedBuf, SwapFile};
    use super::state::{OptimState, SwapSite};
    use super::{Masters, Tier};

    fn gbps(bytes: f64, s: f64) -> f64 {
        bytes / s / 1e9
    }

    fn best_of<F: FnMut() -> f64>(n: usize, mut f: F) -> f64 {
        (0..n).map(|_| f()).fold(f64::INFINITY, f64::min)
    }

    /// Memory bandwidth, CPU AdamW, swap-file transfers and the NVMe tier's optimizer step on
    /// this machine (`TESSERA_BENCH_DIR` names where the swap files go).
    #[test]
    #[ignore = "measurement: run by hand"]
    fn measure_offload() {
        let dir = PathBuf::from(std::env::var("TESSERA_BENCH_DIR").unwrap_or_else(|_| ".".into()));
        let bw = measure_memcpy();
        measure_adamw(bw);
        measure_swap_file(&dir);
        measure_nvme_step(&dir);
    }

    /// 16M parameters of AdamW (weight decay 0.1) over one tensor: its optimizer, the layout and
    /// the gradient.
    fn adamw_16m() -> (OptimizerKind, FlatLayout, Vec<bool>, Vec<f32>) {
        let len = 16 << 20;
        let layout = FlatLayout::new(std::iter::once(0..len).collect()).unwrap();
        let kind = OptimizerKind::Adam(AdamParams { weight_decay: 0.1, ..AdamParams::default() });
        (kind, layout, vec![true], vec![0.01f32; len])
    }

    /// Returns the bandwidth in GB/s.
    fn measure_memcpy() -> f64 {
        // Memory bandwidth: a 512 MiB copy (read + write counted).
        let n = 128 << 20;
        let src = vec![1.0f32; n];
        let mut dst = vec![0.0f32; n];
        let s = best_of(5, || {
            let t = Instant::now();
            dst.copy_from_slice(&src);
            t.elapsed().as_secs_f64()
        });
        std::hint::black_box(&dst);
        let bw = gbps(2.0 * 4.0 * n as f64, s);
        println!("memcpy: {:.2} GB/s (read + write of {} MiB)", bw, (4 * n) >> 20);
        drop((src, dst));
        bw
    }

    fn measure_adamw(bw: f64) {
        // CPU AdamW: 16M parameters, in memory.
        let (kind, layout, decay, g) = adamw_16m();
        let len = g.len();
        let mut shard = OptimizerShard::new(kind, len);
        let mut p = vec![0.5f32; len];
        let ctx = StepContext { shard_range: 0..len, layout: &layout, decay: &decay };
        let s = best_of(5, || {
            let t = Instant::now();
            shard.step(&mut p, &g, 1e-3, &ctx, &mut LocalReduce).unwrap();
            t.elapsed().as_secs_f64()
        });
        let rate = len as f64 / s;
        // Bytes per parameter: p, m, v read and written, g read.
        println!(
            "AdamW in memory: {:.1} M params/s on {} threads = {:.2} GB/s of 28 B/param traffic ({:.0}% of memcpy)",
            rate / 1e6,
            rayon::current_num_threads(),
            gbps(28.0 * len as f64, s),
            100.0 * gbps(28.0 * len as f64, s) / bw
        );
    }

    fn measure_swap_file(dir: &Path) {
        // Swap-file transfers: 1 GiB, default aio settings (1 MiB requests, queue depth 8).
        let o = AioOptions::default();
        let bytes = 1usize << 30;
        let f = SwapFile::create(dir.join("tessera-bench.swp"), bytes as u64, &o).unwrap();
        let mut buf = AlignedBuf::new(bytes, o.block);
        buf.bytes_mut().iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
        let w = best_of(3, || {
            let t = Instant::now();
            f.write_at(0, &mut buf, bytes).unwrap();
            t.elapsed().as_secs_f64()
        });
        let r = best_of(3, || {
            let t = Instant::now();
            f.read_at(0, &mut buf, bytes).unwrap();
            t.elapsed().as_secs_f64()
        });
        println!(
            "swap file ({:?}, O_DIRECT {}): write {:.2} GB/s, read {:.2} GB/s",
            super::io::backend(),
            f.direct(),
            gbps(bytes as f64, w),
            gbps(bytes as f64, r)
        );
        drop(f);
        drop(buf);
    }

    fn measure_nvme_step(dir: &Path) {
        let (kind, layout, decay, g) = adamw_16m();
        let len = g.len();
        let ctx = StepContext { shard_range: 0..len, layout: &layout, decay: &decay };
        let o = AioOptions::default();
        // The NVMe tier's optimizer step, 16M parameters in sub-groups of 1M, with and without pipelining.
        for (pr, pw) in [(false, false), (true, false), (true, true)] {
            let site =
                SwapSite { dir: dir.to_path_buf(), rank: 0, aio: o.clone(), chunk_elems: 1 << 20, pipeline_read: pr, pipeline_write: pw };
            let (mut m, e1) = Masters::new(vec![0.5; len], Tier::Nvme, Some(&site));
            let (mut st, e2) = OptimState::new(kind, len, Tier::Nvme, Some(&site));
            assert!(e1.is_none() && e2.is_none(), "{e1:?} {e2:?}");
            let mut publish = |_: usize, _: &[f32]| Ok(());
            st.step(&mut m, &g, 1e-3, &ctx, &mut LocalReduce, &mut publish).unwrap();
            st.stats = Default::default();
            let t = Instant::now();
            for _ in 0..3 {
                st.step(&mut m, &g, 1e-3, &ctx, &mut LocalReduce, &mut publish).unwrap();
            }
            let s = t.elapsed().as_secs_f64() / 3.0;
            let x = st.stats;
            println!(
                "nvme step (pipeline_read {pr}, pipeline_write {pw}): {:.1} M params/s, {:.0} ms/step; I/O {:.0} ms/step \
                 (read {:.2} GB/s, write {:.2} GB/s), compute {:.0} ms/step, waited {:.0} ms/step: {:.0}% of the I/O hidden",
                len as f64 / s / 1e6,
                s * 1e3,
                (x.read_s + x.write_s) / 3.0 * 1e3,
                gbps(x.bytes_read as f64, x.read_s),
                gbps(x.bytes_written as f64, x.write_s),
                x.compute_s / 3.0 * 1e3,
                x.wait_s / 3.0 * 1e3,
                100.0 * x.hidden_fraction()
            );
        }
    }
}
