//! A rank's fp32 masters ([`Masters`]) and optimizer state ([`OptimState`]) in their tier, and
//! the optimizer step over them: in place for the device and host tiers, sub-group by sub-group
//! through aligned buffers for the NVMe tier.
//!
//! Between steps the NVMe tier keeps nothing resident. Readers between steps (evaluation,
//! checkpoints, the summary) see the values through a transient copy read on first use and
//! dropped when the next step starts ([`Masters::release`], [`OptimState::release`]).

use std::io;
use std::ops::{Deref, Range};
use std::path::PathBuf;
use std::sync::OnceLock;
use std::thread::ScopedJoinHandle;
use std::time::Instant;

use anyhow::Context;
use tessera_actors::faults::Faults;
use tessera_kernels::optim::{NormAllReduce, OptimizerKind, OptimizerShard, StepContext};

use super::io::{AioOptions, AlignedBuf, SwapFile};
use super::{OffloadPlan, Tier};

/// Where a rank's swap files go and how they are accessed.
#[derive(Clone, Debug)]
pub struct SwapSite {
    pub dir: PathBuf,
    pub rank: usize,
    pub aio: AioOptions,
    pub chunk_elems: usize,
    pub pipeline_read: bool,
    pub pipeline_write: bool,
}

/// The swap site of rank `rank`, when the plan puts its optimizer states on NVMe.
pub fn site(plan: &OffloadPlan, rank: usize) -> Option<SwapSite> {
    match (plan.optimizer, &plan.optimizer_dir) {
        (Tier::Nvme, Some(dir)) => Some(SwapSite {
            dir: dir.clone(),
            rank,
            aio: plan.aio.clone(),
            chunk_elems: plan.chunk_elems,
            pipeline_read: plan.pipeline_read,
            pipeline_write: plan.pipeline_write,
        }),
        _ => None,
    }
}

fn io_err(e: io::Error, what: &str, file: &SwapFile, off: u64) -> io::Error {
    io::Error::new(e.kind(), format!("{what} optimizer swap file {} at byte {off}: {e}", file.path().display()))
}

/// One f32 buffer on NVMe: its file, and a transient copy for readers between steps.
struct Swapped {
    file: SwapFile,
    len: usize,
    cache: OnceLock<Vec<f32>>,
}

/// Elements moved per staging buffer when a whole buffer is written or read.
const STAGING_BYTES: usize = 64 << 20;

impl Swapped {
    fn create(site: &SwapSite, name: &str, len: usize) -> io::Result<Swapped> {
        let path = site.dir.join(format!("tessera-{}-rank{}-{name}.swp", std::process::id(), site.rank));
        let file = SwapFile::create(path.clone(), (len * 4) as u64, &site.aio)
            .map_err(|e| io::Error::new(e.kind(), format!("creating optimizer swap file {} ({} bytes): {e}", path.display(), len * 4)))?;
        Ok(Swapped { file, len, cache: OnceLock::new() })
    }

    fn staging(&self) -> (usize, AlignedBuf) {
        let block = self.file.block();
        let elems = (STAGING_BYTES.max(block) / block * block / 4).min(self.len.div_ceil(block / 4) * (block / 4)).max(block / 4);
        (elems, AlignedBuf::new(elems * 4, block))
    }

    fn write_all(&mut self, data: &[f32]) -> io::Result<()> {
        self.cache.take();
        let block = self.file.block();
        let (elems, mut buf) = self.staging();
        for (k, part) in data.chunks(elems).enumerate() {
            let bytes = (part.len() * 4).div_ceil(block) * block;
            buf.bytes_mut()[..bytes].fill(0);
            buf.f32s_mut(part.len()).copy_from_slice(part);
            let off = (k * elems * 4) as u64;
            self.file.write_at(off, &mut buf, bytes).map_err(|e| io_err(e, "writing", &self.file, off))?;
        }
        Ok(())
    }

    fn read_all(&self) -> io::Result<Vec<f32>> {
        let block = self.file.block();
        let (elems, mut buf) = self.staging();
        let mut out = Vec::with_capacity(self.len);
        for start in (0..self.len).step_by(elems.max(1)) {
            let n = elems.min(self.len - start);
            let off = (start * 4) as u64;
            self.file.read_at(off, &mut buf, (n * 4).div_ceil(block) * block).map_err(|e| io_err(e, "reading", &self.file, off))?;
            out.extend_from_slice(buf.f32s(n));
        }
        Ok(out)
    }

    /// The values, read into a transient copy on first use after a step.
    fn view(&self, what: &str) -> &[f32] {
        self.cache.get_or_init(|| self.read_all().unwrap_or_else(|e| panic!("reading the offloaded {what} back: {e}")))
    }
}

/// A rank's fp32 masters (of `Plan::optim_range`), in their tier. Reads as a slice.
pub struct Masters {
    tier: Tier,
    mem: Vec<f32>,
    swap: Option<Swapped>,
}

impl Masters {
    /// Masters holding `data` in `tier`. On NVMe the swap file is created and written now; if
    /// that fails the values stay in memory and the error is returned beside them (the rank
    /// reports it before its first step).
    pub fn new(data: Vec<f32>, tier: Tier, site: Option<&SwapSite>) -> (Masters, Option<String>) {
        let Some(site) = site.filter(|_| tier == Tier::Nvme) else {
            return (Masters { tier, mem: data, swap: None }, None);
        };
        match Swapped::create(site, "fp32_master", data.len()).and_then(|mut s| s.write_all(&data).map(|()| s)) {
            Ok(s) => (Masters { tier, mem: Vec::new(), swap: Some(s) }, None),
            Err(e) => (Masters { tier: Tier::Device, mem: data, swap: None }, Some(e.to_string())),
        }
    }

    pub fn tier(&self) -> Tier {
        self.tier
    }

    /// Drops the transient copy readers may have made since the last step.
    pub fn release(&mut self) {
        if let Some(s) = &mut self.swap {
            s.cache.take();
        }
    }

    /// Bytes the masters occupy in their tier.
    pub fn bytes(&self) -> u64 {
        (self.len() * 4) as u64
    }
}

impl Deref for Masters {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match &self.swap {
            Some(s) => s.view("fp32 masters"),
            None => &self.mem,
        }
    }
}

/// Time and bytes of the NVMe tier's optimizer steps, for measurements.
#[derive(Debug, Clone, Copy, Default)]
pub struct SwapStats {
    pub steps: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Seconds spent in reads and writes (summed over the I/O, wherever it ran).
    pub read_s: f64,
    pub write_s: f64,
    /// Seconds the optimizer waited for I/O (I/O not hidden behind compute).
    pub wait_s: f64,
    /// Seconds of optimizer compute (including the copies in and out of the staging buffers).
    pub compute_s: f64,
}

impl SwapStats {
    /// Adds `o`'s bytes and seconds (not its steps).
    fn add_io(&mut self, o: &SwapStats) {
        self.bytes_read += o.bytes_read;
        self.bytes_written += o.bytes_written;
        self.read_s += o.read_s;
        self.write_s += o.write_s;
        self.wait_s += o.wait_s;
        self.compute_s += o.compute_s;
    }

    /// Share of the I/O time hidden behind compute.
    pub fn hidden_fraction(&self) -> f64 {
        let io = self.read_s + self.write_s;
        if io <= 0.0 {
            0.0
        } else {
            (1.0 - self.wait_s / io).clamp(0.0, 1.0)
        }
    }
}

/// A rank's optimizer state (moments and step count) in its tier.
pub struct OptimState {
    kind: OptimizerKind,
    len: usize,
    tier: Tier,
    /// Device and host tiers: the state itself.
    resident: Option<OptimizerShard>,
    /// NVMe tier: one swap file per state buffer, and the step count.
    swapped: Vec<(&'static str, Swapped)>,
    step: u64,
    site: Option<SwapSite>,
    /// Where a test makes the swap-file writes fail (`FaultHooks::offload_write_fails`).
    faults: Faults,
    pub stats: SwapStats,
}

type Set = Vec<AlignedBuf>;

/// Receives the new masters of a sub-group: (offset in the shard, values).
pub type Publish<'a> = dyn FnMut(usize, &[f32]) -> Result<(), String> + 'a;

impl OptimState {
    /// Fresh state for `len` elements in `tier`; on NVMe the swap files are created now (at
    /// [`OptimizerKind::state_init`]),
    /// or the state stays in memory and the error is returned beside it.
    pub fn new(kind: OptimizerKind, len: usize, tier: Tier, site: Option<&SwapSite>) -> (OptimState, Option<String>) {
        let faults = Faults::default();
        let mut st =
            OptimState { kind, len, tier, resident: None, swapped: Vec::new(), step: 0, site: None, faults, stats: SwapStats::default() };
        if let Some(site) = site.filter(|_| tier == Tier::Nvme) {
            let init = kind.state_init();
            let files: io::Result<Vec<_>> = kind
                .state_names()
                .iter()
                .map(|n| {
                    let mut f = Swapped::create(site, n, len)?;
                    if init != 0.0 {
                        // Created zero-filled; Adagrad's accumulator starts at its initial value.
                        f.write_all(&vec![init; len])?;
                    }
                    Ok((*n, f))
                })
                .collect();
            match files {
                Ok(f) => {
                    st.swapped = f;
                    st.site = Some(site.clone());
                    return (st, None);
                }
                Err(e) => {
                    st.tier = Tier::Device;
                    st.resident = Some(OptimizerShard::new(kind, len));
                    return (st, Some(e.to_string()));
                }
            }
        }
        st.resident = Some(OptimizerShard::new(kind, len));
        (st, None)
    }

    pub fn tier(&self) -> Tier {
        self.tier
    }

    pub fn kind(&self) -> OptimizerKind {
        self.kind
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of the state buffers (in whichever tier).
    pub fn bytes(&self) -> u64 {
        (self.kind.state_names().len() * self.len * 4) as u64
    }

    /// Completed optimizer steps.
    /// The fault hooks the swap-file writes consult (none until set).
    pub fn set_faults(&mut self, faults: Faults) {
        self.faults = faults;
    }

    pub fn step_count(&self) -> u64 {
        self.resident.as_ref().map_or(self.step, OptimizerShard::step_count)
    }

    /// The state buffers by name (see [`OptimizerShard::state_buffers`]); on NVMe, read into a
    /// transient copy on first use after a step.
    pub fn state_buffers(&self) -> Vec<(&'static str, &[f32])> {
        match &self.resident {
            Some(s) => s.state_buffers(),
            None => self.swapped.iter().map(|(n, s)| (*n, s.view("optimizer state"))).collect(),
        }
    }

    /// Restores a checkpoint's step count and buffers (all-or-nothing, as
    /// [`OptimizerShard::load_state`]); on NVMe they are written to the swap files.
    pub fn load_state(&mut self, step: u64, bufs: &[(&str, Vec<f32>)]) -> anyhow::Result<()> {
        if let Some(s) = &mut self.resident {
            return s.load_state(step, bufs).map_err(anyhow::Error::from);
        }
        let mut tmp = OptimizerShard::new(self.kind, self.len);
        tmp.load_state(step, bufs)?;
        for ((name, dst), (_, src)) in self.swapped.iter_mut().zip(tmp.state_buffers()) {
            dst.write_all(src).with_context(|| format!("writing the restored `{name}` to its swap file"))?;
        }
        self.step = step;
        Ok(())
    }

    /// Drops the transient copies readers may have made since the last step.
    pub fn release(&mut self) {
        for (_, s) in &mut self.swapped {
            s.cache.take();
        }
    }

    /// One optimizer step of `masters` with gradient `g` (both over `ctx.shard_range`). The new
    /// masters go to `publish(offset in the shard, values)` as they are produced.
    pub fn step(
        &mut self,
        masters: &mut Masters,
        g: &[f32],
        lr: f32,
        ctx: &StepContext<'_>,
        reducer: &mut dyn NormAllReduce,
        publish: &mut Publish<'_>,
    ) -> Result<(), String> {
        if let Some(shard) = &mut self.resident {
            if masters.swap.is_some() {
                return Err("the fp32 masters are on NVMe but the optimizer state is not".into());
            }
            shard.step(&mut masters.mem, g, lr, ctx, reducer).map_err(|e| e.to_string())?;
            return publish(0, &masters.mem);
        }
        let Some(mfile) = masters.swap.as_mut() else {
            return Err("the optimizer state is on NVMe but the fp32 masters are not".into());
        };
        mfile.cache.take();
        self.release();
        let res = self.swapped_step(&mfile.file, g, lr, ctx, reducer, publish);
        self.stats.steps += 1;
        res
    }

    // Long: the sub-groups' read-ahead, step and write-behind share one thread scope and hand
    // buffer sets between the I/O threads and the step; split further, the handles, the free
    // sets and the timings would pass through every piece.
    fn swapped_step(
        &mut self,
        mfile: &SwapFile,
        g: &[f32],
        lr: f32,
        ctx: &StepContext<'_>,
        reducer: &mut dyn NormAllReduce,
        publish: &mut Publish<'_>,
    ) -> Result<(), String> {
        let site = self.site.clone().ok_or("no swap site")?;
        let len = self.len;
        let block = mfile.block();
        // Lamb needs per-tensor norms over the whole shard: one sub-group.
        let whole = len.div_ceil(block / 4).max(1) * (block / 4);
        let chunk = match self.kind {
            OptimizerKind::Lamb(_) => whole,
            _ => site.chunk_elems.max(block / 4).min(whole),
        };
        let n = len.div_ceil(chunk);
        if n == 0 {
            return self.step_empty(lr, ctx, reducer);
        }
        let range_of = |k: usize| k * chunk..((k + 1) * chunk).min(len);
        let files: Vec<&SwapFile> = std::iter::once(mfile).chain(self.swapped.iter().map(|(_, s)| &s.file)).collect();
        let sets = 1 + usize::from(site.pipeline_read) + usize::from(site.pipeline_write);
        let mut free: Vec<Set> = (0..sets).map(|_| files.iter().map(|_| AlignedBuf::new(chunk * 4, block)).collect()).collect();
        // An injected failure hits the second sub-group (the first when there is only one).
        let fail_step = self.step + 1;
        let fail_chunk = self.faults.offload_write_fails(fail_step).then_some(1.min(n - 1));
        let padded = |r: &Range<usize>| (r.len() * 4).div_ceil(block) * block;
        let read = |mut set: Set, k: usize| -> io::Result<(Set, f64)> {
            let t = Instant::now();
            let r = range_of(k);
            let off = (r.start * 4) as u64;
            for (f, b) in files.iter().zip(set.iter_mut()) {
                f.read_at(off, b, padded(&r)).map_err(|e| io_err(e, "reading", f, off))?;
            }
            Ok((set, t.elapsed().as_secs_f64()))
        };
        let write = |mut set: Set, k: usize| -> io::Result<(Set, f64)> {
            let t = Instant::now();
            let r = range_of(k);
            let off = (r.start * 4) as u64;
            for (f, b) in files.iter().zip(set.iter_mut()) {
                if fail_chunk == Some(k) {
                    let e = io::Error::other(format!("injected write error (offload_fail_write_at_step={fail_step})"));
                    return Err(io_err(e, "writing", f, off));
                }
                f.write_at(off, b, padded(&r)).map_err(|e| io_err(e, "writing", f, off))?;
            }
            Ok((set, t.elapsed().as_secs_f64()))
        };
        let sub = SubGroupStep { kind: self.kind, step: self.step, g, lr, ctx };
        let mut stats = SwapStats::default();
        let mut scratch: Option<OptimizerShard> = None;
        let rank = site.rank;
        let fail = |e: io::Error| format!("rank {rank}: {e}");
        std::thread::scope(|s| -> Result<(), String> {
            let mut reading: Option<Io<'_>> = None;
            let mut writing: Option<Io<'_>> = None;
            for k in 0..n {
                let t = Instant::now();
                let mut cur = match reading.take() {
                    Some(h) => {
                        let (set, secs) = joined(h).map_err(fail)?;
                        stats.read_s += secs;
                        set
                    }
                    None => {
                        let set = free_set(&mut free, &mut writing, &mut stats).map_err(fail)?;
                        let (set, secs) = read(set, k).map_err(fail)?;
                        stats.read_s += secs;
                        set
                    }
                };
                stats.bytes_read += (padded(&range_of(k)) * files.len()) as u64;
                if site.pipeline_read && k + 1 < n {
                    let set = free_set(&mut free, &mut writing, &mut stats).map_err(fail)?;
                    reading = Some(s.spawn(move || read(set, k + 1)));
                }
                stats.wait_s += t.elapsed().as_secs_f64();
                // Compute: the shard's state for this sub-group, stepped as its own shard.
                let t = Instant::now();
                let r = range_of(k);
                sub.run(r.clone(), &mut cur, &mut scratch, reducer)?;
                publish(r.start, cur.first().ok_or("empty swap buffer set")?.f32s(r.len()))?;
                stats.compute_s += t.elapsed().as_secs_f64();
                stats.bytes_written += (padded(&r) * files.len()) as u64;
                let t = Instant::now();
                if site.pipeline_write {
                    if let Some(h) = writing.take() {
                        let (set, secs) = joined(h).map_err(fail)?;
                        stats.write_s += secs;
                        free.push(set);
                    }
                    writing = Some(s.spawn(move || write(cur, k)));
                } else {
                    let (set, secs) = write(cur, k).map_err(fail)?;
                    stats.write_s += secs;
                    free.push(set);
                }
                stats.wait_s += t.elapsed().as_secs_f64();
            }
            let t = Instant::now();
            if let Some(h) = writing.take() {
                let (_, secs) = joined(h).map_err(fail)?;
                stats.write_s += secs;
            }
            stats.wait_s += t.elapsed().as_secs_f64();
            Ok(())
        })?;
        self.step += 1;
        self.stats.add_io(&stats);
        Ok(())
    }

    /// The step of an empty shard, which still takes part in Lamb's collective norms.
    fn step_empty(&mut self, lr: f32, ctx: &StepContext<'_>, reducer: &mut dyn NormAllReduce) -> Result<(), String> {
        let mut empty = OptimizerShard::new(self.kind, 0);
        empty
            .load_state(self.step, &self.kind.state_names().iter().map(|s| (*s, Vec::new())).collect::<Vec<_>>())
            .map_err(|e| e.to_string())?;
        empty.step(&mut [], &[], lr, ctx, reducer).map_err(|e| e.to_string())?;
        self.step += 1;
        Ok(())
    }
}

/// A buffer set's I/O on its thread: the set back, and the seconds it took.
type Io<'scope> = ScopedJoinHandle<'scope, io::Result<(Set, f64)>>;

/// The set and seconds of I/O `h` (a panic on its thread is an I/O error).
fn joined(h: Io<'_>) -> io::Result<(Set, f64)> {
    h.join().unwrap_or_else(|_| Err(io::Error::other("an I/O thread panicked")))
}

/// A free buffer set, or else the one the write in flight gives back (its seconds counted).
fn free_set(free: &mut Vec<Set>, writing: &mut Option<Io<'_>>, stats: &mut SwapStats) -> io::Result<Set> {
    if let Some(set) = free.pop() {
        return Ok(set);
    }
    let (set, secs) = joined(writing.take().ok_or_else(|| io::Error::other("no free swap buffer"))?)?;
    stats.write_s += secs;
    Ok(set)
}

/// What the step of every sub-group of a swapped shard shares: the optimizer, the step count
/// before the step, the shard's gradient, the learning rate and the shard's context.
struct SubGroupStep<'a> {
    kind: OptimizerKind,
    step: u64,
    g: &'a [f32],
    lr: f32,
    ctx: &'a StepContext<'a>,
}

impl SubGroupStep<'_> {
    /// Steps elements `r` of the shard as a shard of their own: `set` holds their masters, then
    /// each state buffer (as read from the swap files), and is overwritten with the new values.
    /// `scratch` is the optimizer shard kept between sub-groups of one length.
    fn run(
        &self,
        r: Range<usize>,
        set: &mut Set,
        scratch: &mut Option<OptimizerShard>,
        reducer: &mut dyn NormAllReduce,
    ) -> Result<(), String> {
        let (mbuf, rest) = set.split_first_mut().ok_or("empty swap buffer set")?;
        let names = self.kind.state_names();
        let bufs: Vec<(&str, Vec<f32>)> = names.iter().zip(rest.iter()).map(|(nm, b)| (*nm, b.f32s(r.len()).to_vec())).collect();
        let mut sc = match scratch.take() {
            Some(sc) if sc.len() == r.len() => sc,
            _ => OptimizerShard::new(self.kind, r.len()),
        };
        sc.load_state(self.step, &bufs).map_err(|e| e.to_string())?;
        drop(bufs);
        let ctx = self.ctx;
        let sub = ctx.shard_range.start + r.start..ctx.shard_range.start + r.end;
        let sub_ctx = StepContext { shard_range: sub, layout: ctx.layout, decay: ctx.decay };
        sc.step(mbuf.f32s_mut(r.len()), &self.g[r.clone()], self.lr, &sub_ctx, reducer).map_err(|e| e.to_string())?;
        for ((_, src), dst) in sc.state_buffers().into_iter().zip(rest.iter_mut()) {
            dst.f32s_mut(r.len()).copy_from_slice(src);
        }
        *scratch = Some(sc);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use tessera_kernels::optim::{AdagradParams, FlatLayout, LocalReduce, OptimizerKind, OptimizerShard, StepContext};

    use super::*;
    use crate::offload::io::AioOptions;

    /// The NVMe tier starts Adagrad's swap files at its initial accumulator and, stepped sub-group
    /// by sub-group with read-ahead and write-behind, gives the in-memory shard's bits.
    #[test]
    fn nvme_adagrad_starts_from_its_initial_accumulator_and_keeps_the_bits() {
        let tmp = tempfile::tempdir().unwrap();
        let layout = FlatLayout::from_sizes(&[3000, 2000]).unwrap();
        let (len, decay) = (layout.total(), [true, false]);
        let params = AdagradParams { lr_decay: 0.1, weight_decay: 0.01, initial_accumulator_value: 0.1, ..AdagradParams::default() };
        let kind = OptimizerKind::Adagrad(params);
        // 4 KiB blocks: sub-groups of 1024 elements, five of them.
        let aio = AioOptions { block: 4096, ..AioOptions::default() };
        let site = SwapSite { dir: tmp.path().to_path_buf(), rank: 0, aio, chunk_elems: 1024, pipeline_read: true, pipeline_write: true };
        let p0: Vec<f32> = (0..len).map(|i| ((i * 37 % 101) as f32 - 50.0) / 100.0).collect();
        let (mut masters, e1) = Masters::new(p0.clone(), Tier::Nvme, Some(&site));
        let (mut st, e2) = OptimState::new(kind, len, Tier::Nvme, Some(&site));
        assert!(e1.is_none() && e2.is_none(), "{e1:?} {e2:?}");
        assert!(st.state_buffers()[0].1.iter().all(|&s| s == 0.1), "the swap file did not start at the initial accumulator");
        st.release();
        let mut shard = OptimizerShard::new(kind, len);
        let mut p = p0;
        let ctx = StepContext { shard_range: 0..len, layout: &layout, decay: &decay };
        for step in 0..3 {
            let g: Vec<f32> = (0..len).map(|i| (((i * 13 + step * 7) % 29) as f32 - 14.0) / 100.0).collect();
            st.step(&mut masters, &g, 0.05, &ctx, &mut LocalReduce, &mut |_, _| Ok(())).unwrap();
            shard.step(&mut p, &g, 0.05, &ctx, &mut LocalReduce).unwrap();
        }
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&masters), bits(&p), "masters");
        assert_eq!(st.state_buffers()[0].0, "sum");
        assert_eq!(bits(st.state_buffers()[0].1), bits(shard.state_buffers()[0].1), "sum");
        assert_eq!(st.step_count(), 3);
    }
}
