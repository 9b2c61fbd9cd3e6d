//! Parameter offload on GPU ranks (`zero_optimization.offload_param`, ZeRO stage 3 — the
//! parameter half of ZeRO-Infinity): the rank's bf16 parameter shard leaves the device. Each
//! unit's piece lives in page-locked host memory (`device = "cpu"`, or `"nvme"` within
//! `max_in_cpu` elements) or in one swap file per rank under `nvme_path` (`device = "nvme"`,
//! each piece on whole `aio.block_size` blocks, O_DIRECT + io_uring through
//! [`crate::offload::io`]).
//!
//! - Fetch: stage 3 gathers each unit just before use into its rotating device buffers, and
//!   prefetches the next uses on the communication stream (`zero::hooks`). With parameter
//!   offload the gather of a use first copies the rank's piece host → device on that stream
//!   (into the gather buffer itself with one rank, into a piece buffer that the all-gather reads
//!   with several), so the copy is prefetched exactly as far ahead as the gather. Pieces on NVMe
//!   are read by a reader thread ahead of their use in the micro-batch's use order, at most
//!   `buffer_count` pieces read and not yet used (the current one included), each at most
//!   `buffer_size` elements (a larger piece is refused at start); a read piece goes through one
//!   of two page-locked bounce buffers to the device.
//! - Write-back at commit: the optimizer's new bf16 values of a piece come back from the device
//!   optimizer (device → host into the piece's place, on the optimizer's stream) or from the host
//!   optimizer of optimizer offload (a host copy); on NVMe the piece is written to its blocks.
//! - Same bits: only where the bf16 shard lives changes; every gather moves the same bits to the
//!   same place, and the optimizer's output is the same.
//!
//! Host memory a fetch reads is never written while the copy may be in flight: a unit's piece
//! is only rewritten by its own optimizer step, which comes after its gradient is final, hence
//! after its last use in the step (whose copy the compute stream waited for); the next step's
//! fetches are issued after the commit on the streams that ordered it.

use std::ops::Range;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use half::bf16;
use tessera_kernels::cuda::ops::PinnedHostSlice;
use tessera_kernels::cuda::{self, CudaEvent, CudaStream, DPtr, Gpu};

use super::offload::{blocking_event, NvmeSite};
use crate::offload::io::{AlignedBuf, SwapFile};

/// `zero_optimization.offload_param` as a GPU rank takes it.
#[derive(Clone, Debug)]
pub struct ParamOffloadOptions {
    /// `device = "nvme"`: the swap file's directory and I/O options; `None` for `device = "cpu"`.
    pub nvme: Option<NvmeSite>,
    /// NVMe: elements of the shard kept in page-locked host memory (whole units, in order).
    pub max_in_cpu: usize,
    /// NVMe: pieces read ahead and not yet used, the current one included (≥ 1).
    pub buffer_count: usize,
    /// NVMe: elements per read buffer; a piece larger than it is refused.
    pub buffer_elems: usize,
}

/// Where each unit's piece of a rank's bf16 shard lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Per unit: its piece's length in elements.
    pub len: Vec<usize>,
    /// Per unit: its offset in host memory (elements), or `None` when it is in the swap file.
    pub mem_off: Vec<Option<usize>>,
    /// Per unit: its region's byte offset in the swap file (a multiple of the block; units in
    /// memory have an empty region).
    pub file_off: Vec<u64>,
    pub mem_elems: usize,
    pub file_bytes: u64,
    block: usize,
}

impl Placement {
    /// `pieces`: each unit's piece length. `max_in_cpu`: `None` keeps everything in host memory
    /// (`device = "cpu"`); `Some(n)` keeps units in memory in unit order while their total stays
    /// within `n` elements, and puts the rest in the swap file, each on whole `block`-byte blocks.
    pub fn new(pieces: &[usize], max_in_cpu: Option<usize>, block: usize) -> Placement {
        let (mut mem_off, mut file_off) = (Vec::with_capacity(pieces.len()), Vec::with_capacity(pieces.len()));
        let (mut mem, mut file) = (0usize, 0u64);
        let mut in_mem = true;
        for &p in pieces {
            in_mem &= max_in_cpu.is_none_or(|n| mem + p <= n);
            file_off.push(file);
            if in_mem {
                mem_off.push(Some(mem));
                mem += p;
            } else {
                mem_off.push(None);
                file += Self::region_bytes(p, block) as u64;
            }
        }
        Placement { len: pieces.to_vec(), mem_off, file_off, mem_elems: mem, file_bytes: file, block: block.max(1) }
    }

    fn region_bytes(len: usize, block: usize) -> usize {
        (len * 2).div_ceil(block.max(1)).max(1) * block.max(1)
    }

    /// The largest piece in the swap file (elements), 0 if none.
    pub fn largest_on_file(&self) -> usize {
        self.len.iter().zip(&self.mem_off).filter(|(_, m)| m.is_none()).map(|(&l, _)| l).max().unwrap_or(0)
    }

    /// Refuses a piece in the swap file larger than a read buffer (`buffer_size`).
    pub fn check_buffers(&self, buffer_elems: usize) -> Result<()> {
        let big = self.largest_on_file();
        if big > buffer_elems {
            bail!(
                "zero_optimization.offload_param.buffer_size = {buffer_elems}: a GPU rank's piece of one unit is {big} elements \
                 and is read from the swap file whole; use a buffer_size of at least {big}"
            );
        }
        Ok(())
    }
}

/// A piece read from the swap file, or why not.
type Read = (usize, std::io::Result<AlignedBuf>);

/// The swap file of the pieces not in memory, its reader thread and the page-locked buffers
/// the read pieces go to the device through.
struct Swap {
    file: Arc<SwapFile>,
    /// Unit numbers to read, in use order; the reader answers in the same order.
    req: Option<Sender<usize>>,
    resp: Receiver<Read>,
    reader: Option<std::thread::JoinHandle<()>>,
    /// Requests sent and not yet taken.
    outstanding: usize,
    /// Two page-locked bounce buffers (the largest piece on file each), used in turn, each with
    /// the event after the last copy out of it.
    bounce: [PinnedHostSlice<bf16>; 2],
    bounce_free: [Option<CudaEvent>; 2],
    next_bounce: usize,
    /// Page-locked landing buffer of a piece the device optimizer rewrote, before its write.
    out: PinnedHostSlice<bf16>,
}

/// Figures of the parameter tier.
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct ParamOffloadStats {
    /// Pieces fetched host → device and bytes moved.
    pub fetches: u64,
    pub fetch_bytes: u64,
    /// NVMe: bytes read and written, seconds the issuing thread waited for a read.
    pub nvme_read_bytes: u64,
    pub nvme_write_bytes: u64,
    pub nvme_wait_s: f64,
    pub nvme_write_s: f64,
}

/// One rank's bf16 parameter shard off the device.
pub struct ParamHost {
    pub place: Placement,
    /// The pieces in memory, page-locked (at least one element).
    mem: PinnedHostSlice<bf16>,
    swap: Option<Swap>,
    /// Pieces read ahead at most (the current one included).
    depth: usize,
    pub stats: ParamOffloadStats,
}

/// Page-locked host memory for `n` bf16 values (at least one).
fn pinned(gpu: &Gpu, n: usize, what: &str) -> Result<PinnedHostSlice<bf16>> {
    // Flags 0: cached page-locked memory (the host reads and writes it).
    // SAFETY: every element is written (the shard at start, pieces before they are read) before
    // it is read.
    Ok(unsafe { gpu.ctx.alloc_pinned_with_flags::<bf16>(n.max(1), 0) }
        .map_err(cuda::drv(format!("allocating {} bytes of page-locked host memory for {what}", n.max(1) * 2)))?)
}

/// Copies host → device on `s` (asynchronous for page-locked `src`).
fn htod(dst: DPtr<bf16>, src: &[bf16], s: &CudaStream) -> Result<()> {
    assert_eq!(dst.len, src.len(), "host → device copy of unequal lengths");
    if src.is_empty() {
        return Ok(());
    }
    // SAFETY: `dst` covers `src.len()` elements (DPtr contract); the caller keeps `src` alive and
    // unwritten until the copy is done (module notes).
    unsafe { cudarc::driver::result::memcpy_htod_async(dst.raw, src, s.cu_stream()) }
        .map_err(cuda::drv("copying parameters host → device"))?;
    Ok(())
}

/// Copies device → host on `s` (asynchronous for page-locked `dst`).
fn dtoh(dst: &mut [bf16], src: DPtr<bf16>, s: &CudaStream) -> Result<()> {
    assert_eq!(dst.len(), src.len, "device → host copy of unequal lengths");
    if dst.is_empty() {
        return Ok(());
    }
    // SAFETY: `src` covers `dst.len()` elements; nothing reads `dst` before the stream passes it.
    unsafe { cudarc::driver::result::memcpy_dtoh_async(dst, src.raw, s.cu_stream()) }
        .map_err(cuda::drv("copying parameters device → host"))?;
    Ok(())
}

fn as_bf16(b: &AlignedBuf, n: usize) -> &[bf16] {
    &bytemuck::cast_slice::<u8, bf16>(b.bytes())[..n]
}

fn as_bf16_mut(b: &mut AlignedBuf, n: usize) -> &mut [bf16] {
    &mut bytemuck::cast_slice_mut::<u8, bf16>(b.bytes_mut())[..n]
}

impl ParamHost {
    /// Rank `rank`'s shard `shard` (pieces unit after unit, of lengths `pieces`) placed as `o`
    /// asks: in page-locked memory, and with NVMe the units past `max_in_cpu` in a swap file.
    pub fn new(gpu: &Gpu, rank: usize, pieces: &[usize], shard: &[bf16], o: &ParamOffloadOptions) -> Result<ParamHost> {
        let block = o.nvme.as_ref().map_or(4096, |s| s.aio.block);
        let place = Placement::new(pieces, o.nvme.as_ref().map(|_| o.max_in_cpu), block);
        let mut mem = pinned(gpu, place.mem_elems, "the parameter shard")?;
        {
            let host = mem.as_mut_slice().map_err(cuda::drv("writing the page-locked parameter shard"))?;
            let mut at = 0;
            for (u, &len) in pieces.iter().enumerate() {
                if let Some(m) = place.mem_off[u] {
                    host[m..m + len].copy_from_slice(&shard[at..at + len]);
                }
                at += len;
            }
        }
        let swap = match &o.nvme {
            Some(site) if place.file_bytes > 0 => {
                place.check_buffers(o.buffer_elems)?;
                Some(Swap::create(gpu, rank, site, &place, shard)?)
            }
            _ => None,
        };
        Ok(ParamHost { place, mem, swap, depth: o.buffer_count.max(1), stats: ParamOffloadStats::default() })
    }

    /// What [`ParamHost::new`] will hold for a shard of `pieces` placed as `o` asks: bytes of
    /// page-locked host memory and of the swap file (the budget check at start uses it).
    pub fn plan(pieces: &[usize], o: &ParamOffloadOptions) -> (u64, u64) {
        let block = o.nvme.as_ref().map_or(4096, |s| s.aio.block);
        let place = Placement::new(pieces, o.nvme.as_ref().map(|_| o.max_in_cpu), block);
        let swapped = o.nvme.is_some() && place.file_bytes > 0;
        let buffers = if swapped { 3 * place.largest_on_file().max(1) } else { 0 };
        ((place.mem_elems.max(1) + buffers) as u64 * 2, if swapped { place.file_bytes } else { 0 })
    }

    /// Bytes of page-locked host memory (the shard's pieces in memory and the NVMe buffers).
    pub fn host_bytes(&self) -> u64 {
        let sw = self.swap.as_ref().map_or(0, |s| s.bounce.iter().map(|b| b.num_bytes()).sum::<usize>() + s.out.num_bytes());
        (self.mem.num_bytes() + sw) as u64
    }

    /// Bytes of the swap file.
    pub fn nvme_bytes(&self) -> u64 {
        self.swap.as_ref().map_or(0, |s| s.file.size())
    }

    /// Pieces read ahead at most (the current one included).
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// Whether unit `u`'s piece is in the swap file.
    fn on_file(&self, u: usize) -> bool {
        self.place.mem_off[u].is_none() && self.swap.is_some()
    }

    /// Asks the reader for unit `u`'s piece, to be taken by [`ParamHost::fetch`] in request
    /// order (no-op for a piece in memory).
    pub fn request(&mut self, u: usize) -> Result<()> {
        if !self.on_file(u) {
            return Ok(());
        }
        let sw = self.swap.as_mut().expect("on_file implies a swap file");
        let sent = sw.req.as_ref().is_some_and(|tx| tx.send(u).is_ok());
        if !sent {
            bail!("the parameter swap reader stopped");
        }
        sw.outstanding += 1;
        Ok(())
    }

    /// Reads still requested and not taken (an evaluation's forward leaves the backward's
    /// prefetches): received and dropped, so the next fetches see their own.
    pub fn drain(&mut self) -> Result<()> {
        if let Some(sw) = self.swap.as_mut() {
            while sw.outstanding > 0 {
                let _unused_read = sw.resp.recv().context("the parameter swap reader stopped")?;
                sw.outstanding -= 1;
            }
        }
        Ok(())
    }

    /// Enqueues the copy of unit `u`'s piece into `dst` on `s`. A piece on NVMe must have been
    /// requested ([`ParamHost::request`]) and is the next read to arrive.
    pub fn fetch(&mut self, u: usize, dst: DPtr<bf16>, s: &CudaStream) -> Result<()> {
        let len = self.place.len[u];
        self.stats.fetches += 1;
        self.stats.fetch_bytes += len as u64 * 2;
        if let Some(m) = self.place.mem_off[u] {
            let host = self.mem.as_slice().map_err(cuda::drv("reading the page-locked parameter shard"))?;
            return htod(dst, &host[m..m + len], s);
        }
        let sw = self.swap.as_mut().expect("a piece not in memory is in the swap file");
        let t = Instant::now();
        let (got, buf) = sw.resp.recv().context("the parameter swap reader stopped")?;
        sw.outstanding = sw.outstanding.saturating_sub(1);
        self.stats.nvme_wait_s += t.elapsed().as_secs_f64();
        if got != u {
            bail!("parameter swap: unit {got}'s piece arrived where unit {u}'s was expected (fetches out of their requested order)");
        }
        let buf = buf.with_context(|| format!("reading unit {u}'s parameter piece from {}", sw.file.path().display()))?;
        self.stats.nvme_read_bytes += buf.len() as u64;
        let k = sw.next_bounce;
        sw.next_bounce = 1 - k;
        if let Some(ev) = sw.bounce_free[k].take() {
            ev.synchronize().map_err(cuda::drv("waiting for a parameter bounce buffer"))?;
        }
        let bounce = sw.bounce[k].as_mut_slice().map_err(cuda::drv("writing a parameter bounce buffer"))?;
        bounce[..len].copy_from_slice(as_bf16(&buf, len));
        htod(dst, &bounce[..len], s)?;
        sw.bounce_free[k] = Some(blocking_event(s)?);
        Ok(())
    }

    /// Writes `vals` (the new values of `range` of unit `u`'s piece, from the host optimizer)
    /// in place. On NVMe only whole pieces are written.
    pub fn store_host(&mut self, u: usize, range: Range<usize>, vals: &[bf16]) -> Result<()> {
        if let Some(m) = self.place.mem_off[u] {
            let host = self.mem.as_mut_slice().map_err(cuda::drv("writing the page-locked parameter shard"))?;
            host[m + range.start..m + range.end].copy_from_slice(vals);
            return Ok(());
        }
        let len = self.place.len[u];
        if range != (0..len) {
            bail!("parameter swap: unit {u}'s piece is written whole (got {range:?} of {len})");
        }
        self.write_file(u, vals)
    }

    /// Copies `src` (the device optimizer's new values of `range` of unit `u`'s piece) back on
    /// `s`: into host memory asynchronously, or, on NVMe, through a page-locked buffer (waiting
    /// for `s`) into the swap file.
    pub fn store_dev(&mut self, u: usize, range: Range<usize>, src: DPtr<bf16>, s: &CudaStream) -> Result<()> {
        if let Some(m) = self.place.mem_off[u] {
            let host = self.mem.as_mut_slice().map_err(cuda::drv("writing the page-locked parameter shard"))?;
            return dtoh(&mut host[m + range.start..m + range.end], src, s);
        }
        let len = self.place.len[u];
        if range != (0..len) {
            bail!("parameter swap: unit {u}'s piece is written whole (got {range:?} of {len})");
        }
        let ParamHost { swap, place, stats, .. } = self;
        let sw = swap.as_mut().expect("a piece not in memory is in the swap file");
        let host = sw.out.as_mut_slice().map_err(cuda::drv("the parameter landing buffer"))?;
        dtoh(&mut host[..len], src, s)?;
        s.synchronize().map_err(cuda::drv("waiting for a parameter copy device → host"))?;
        write_piece(&sw.file, place, stats, u, &host[..len])
    }

    fn write_file(&mut self, u: usize, vals: &[bf16]) -> Result<()> {
        let sw = self.swap.as_ref().expect("a piece not in memory is in the swap file");
        write_piece(&sw.file, &self.place, &mut self.stats, u, vals)
    }

    /// The whole shard (pieces unit after unit), read back from memory and the swap file (for
    /// tests and checks; waits for nothing: call it with the streams idle).
    pub fn read_shard(&self) -> Result<Vec<bf16>> {
        let host = self.mem.as_slice().map_err(cuda::drv("reading the page-locked parameter shard"))?;
        let mut out = Vec::with_capacity(self.place.len.iter().sum());
        for (u, &len) in self.place.len.iter().enumerate() {
            match (self.place.mem_off[u], &self.swap) {
                (Some(m), _) => out.extend_from_slice(&host[m..m + len]),
                (None, Some(sw)) => out.extend_from_slice(as_bf16(&sw.read(&self.place, u)?, len)),
                (None, None) => unreachable!("a piece not in memory is in the swap file"),
            }
        }
        Ok(out)
    }
}

/// Writes unit `u`'s whole piece `vals` to its blocks of `file`.
fn write_piece(file: &SwapFile, place: &Placement, stats: &mut ParamOffloadStats, u: usize, vals: &[bf16]) -> Result<()> {
    let t = Instant::now();
    let bytes = Placement::region_bytes(vals.len(), place.block);
    let mut b = AlignedBuf::new(bytes, place.block);
    as_bf16_mut(&mut b, vals.len()).copy_from_slice(vals);
    file.write_at(place.file_off[u], &mut b, bytes)
        .with_context(|| format!("writing unit {u}'s parameter piece to {}", file.path().display()))?;
    stats.nvme_write_bytes += bytes as u64;
    stats.nvme_write_s += t.elapsed().as_secs_f64();
    Ok(())
}

impl Swap {
    fn create(gpu: &Gpu, rank: usize, site: &NvmeSite, place: &Placement, shard: &[bf16]) -> Result<Swap> {
        let path = site.dir.join(format!("tessera-{}-gpu{rank}-params.swp", std::process::id()));
        let file = SwapFile::create(path.clone(), place.file_bytes.max(1), &site.aio)
            .with_context(|| format!("creating the parameter swap file {} ({} bytes)", path.display(), place.file_bytes))?;
        let file = Arc::new(file);
        let big = place.largest_on_file();
        let mut at = 0;
        for (u, &len) in place.len.iter().enumerate() {
            if place.mem_off[u].is_none() {
                let bytes = Placement::region_bytes(len, place.block);
                let mut b = AlignedBuf::new(bytes, place.block);
                as_bf16_mut(&mut b, len).copy_from_slice(&shard[at..at + len]);
                file.write_at(place.file_off[u], &mut b, bytes)
                    .with_context(|| format!("writing unit {u}'s parameter piece to {}", path.display()))?;
            }
            at += len;
        }
        let (req_tx, req_rx) = mpsc::channel::<usize>();
        let (resp_tx, resp_rx) = mpsc::channel::<Read>();
        let (rfile, rplace) = (file.clone(), place.clone());
        let reader = std::thread::Builder::new()
            .name(format!("tessera-param-swap-{rank}"))
            .spawn(move || {
                for u in req_rx {
                    let r = Swap::read_region(&rfile, &rplace, u);
                    if resp_tx.send((u, r)).is_err() {
                        break;
                    }
                }
            })
            .context("starting the parameter swap reader thread")?;
        Ok(Swap {
            file,
            req: Some(req_tx),
            resp: resp_rx,
            reader: Some(reader),
            outstanding: 0,
            bounce: [pinned(gpu, big, "a parameter bounce buffer")?, pinned(gpu, big, "a parameter bounce buffer")?],
            bounce_free: [None, None],
            next_bounce: 0,
            out: pinned(gpu, big, "the parameter landing buffer")?,
        })
    }

    fn read_region(file: &SwapFile, place: &Placement, u: usize) -> std::io::Result<AlignedBuf> {
        let bytes = Placement::region_bytes(place.len[u], place.block);
        let mut b = AlignedBuf::new(bytes, place.block);
        file.read_at(place.file_off[u], &mut b, bytes)?;
        Ok(b)
    }

    fn read(&self, place: &Placement, u: usize) -> Result<AlignedBuf> {
        Swap::read_region(&self.file, place, u)
            .with_context(|| format!("reading unit {u}'s parameter piece from {}", self.file.path().display()))
    }
}

impl Drop for Swap {
    fn drop(&mut self) {
        // Closing the request channel ends the reader after its current read.
        self.req = None;
        while self.resp.try_recv().is_ok() {}
        if let Some(h) = self.reader.take() {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Placement;

    /// `device = "cpu"` keeps every piece in memory, back to back; `nvme` keeps whole units in
    /// order within `max_in_cpu` and puts each later one on its own blocks of the swap file.
    #[test]
    fn pieces_are_placed_in_memory_then_on_whole_blocks() {
        let cpu = Placement::new(&[100, 3000, 3000, 50], None, 4096);
        assert_eq!(cpu.mem_off, vec![Some(0), Some(100), Some(3100), Some(6100)]);
        assert_eq!((cpu.mem_elems, cpu.file_bytes, cpu.largest_on_file()), (6150, 0, 0));
        let nvme = Placement::new(&[100, 3000, 3000, 50], Some(3200), 4096);
        assert_eq!(nvme.mem_off, vec![Some(0), Some(100), None, None]);
        // 3000 bf16 = 6000 bytes → two blocks; 50 → one block.
        assert_eq!(nvme.file_off[2..], [0, 8192]);
        assert_eq!((nvme.mem_elems, nvme.file_bytes, nvme.largest_on_file()), (3100, 3 * 4096, 3000));
        // Once a unit goes to the file, the later ones do too (the memory part is a prefix).
        let prefix = Placement::new(&[100, 5000, 10], Some(200), 4096);
        assert_eq!(prefix.mem_off, vec![Some(0), None, None]);
        let none = Placement::new(&[100, 10], Some(0), 4096);
        assert_eq!((none.mem_elems, none.mem_off[0]), (0, None));
        let e = nvme.check_buffers(2999).unwrap_err().to_string();
        assert!(e.contains("buffer_size = 2999") && e.contains("3000"), "{e}");
        nvme.check_buffers(3000).unwrap();
    }
}
