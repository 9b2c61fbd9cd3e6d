//! NVMe optimizer offload on GPU ranks (`offload_optimizer.device = "nvme"`): the host part of
//! each unit's optimizer piece — fp32 masters and up to two state buffers (Adam's moments; Lion's
//! `exp_avg`, SGD's momentum or Adagrad's `sum` in the second file, the third unused) — lives in three swap files
//! under `nvme_path` ([`crate::offload::io`]: O_DIRECT where the filesystem allows it, io_uring
//! requests of `aio.block_size`), each unit's region starting on a block boundary, so one unit
//! moves in whole-block requests.
//!
//! During a step the host optimizer ([`super::offload::worker`]) takes each unit's state from a
//! reader thread that reads ahead, in the order the units' gradients arrive (the backward's, last
//! unit first), steps it in place with the same host step as the host-memory tier (same bits), and
//! hands it to a writer thread that writes it back while the next unit is stepped; the step ends
//! once every write is done. Read-ahead and write-behind are bounded by [`PIPELINE_DEPTH`] units
//! each. Between steps nothing is resident: the driver's reads (checkpoints, the summary) read
//! the files whole.

use std::io;
use std::path::Path;
use std::sync::mpsc;
use std::time::Instant;

use anyhow::{Context, Result};

use super::offload::Split;
use crate::offload::io::{AioOptions, AlignedBuf, SwapFile};

/// Units read ahead of the one being stepped, and units waiting to be written back.
pub const PIPELINE_DEPTH: usize = 2;

/// The three buffers of a unit's host part, in file order.
const NAMES: [&str; 3] = ["master", "exp_avg", "exp_avg_sq"];

/// One rank's host optimizer state on NVMe.
pub struct NvmeStore {
    files: [SwapFile; 3],
    /// Per unit: its region's byte offset (a multiple of the block) and length in elements.
    off: Vec<u64>,
    len: Vec<usize>,
    block: usize,
}

/// One unit's state read from the files: masters, `exp_avg`, `exp_avg_sq`, `len` values each.
pub struct UnitState {
    pub u: usize,
    pub len: usize,
    bufs: [AlignedBuf; 3],
}

impl UnitState {
    /// The three buffers as f32 slices (master, m, v).
    pub fn slices(&mut self) -> (&mut [f32], &mut [f32], &mut [f32]) {
        let n = self.len;
        let [a, b, c] = &mut self.bufs;
        (a.f32s_mut(n), b.f32s_mut(n), c.f32s_mut(n))
    }
}

/// Seconds of swap I/O in one step, and how much of it the optimizer waited for.
#[derive(Clone, Copy, Debug, Default)]
pub struct NvmeStats {
    pub read_s: f64,
    pub write_s: f64,
    pub bytes: u64,
    /// Time the host optimizer waited for a read (not hidden behind stepping or the GPU).
    pub wait_s: f64,
}

impl NvmeStore {
    /// Creates rank `rank`'s three files under `dir` with room for `split`'s host parts, writes
    /// `master_host` (the host parts unit after unit) into the masters' file; the moments start
    /// at zero (the files are created zero-filled).
    pub fn create(dir: &Path, rank: usize, aio: &AioOptions, split: &Split, master_host: &[f32]) -> Result<NvmeStore> {
        let block = aio.block;
        let (mut off, mut at) = (Vec::with_capacity(split.units()), 0u64);
        for &h in &split.host {
            off.push(at);
            at += ((h * 4).div_ceil(block) * block) as u64;
        }
        let pid = std::process::id();
        let create = |name: &str| -> Result<SwapFile> {
            let path = dir.join(format!("tessera-{pid}-gpu{rank}-{name}.swp"));
            SwapFile::create(path.clone(), at.max(1), aio)
                .with_context(|| format!("creating the optimizer swap file {} ({at} bytes)", path.display()))
        };
        let files = [create(NAMES[0])?, create(NAMES[1])?, create(NAMES[2])?];
        let store = NvmeStore { files, off, len: split.host.clone(), block };
        store.write_buffer(0, master_host).context("writing the fp32 masters to their swap file")?;
        Ok(store)
    }

    /// Bytes of the three files.
    pub fn bytes(&self) -> u64 {
        self.files.iter().map(SwapFile::size).sum()
    }

    fn region(&self, u: usize) -> (u64, usize) {
        (self.off[u], (self.len[u] * 4).div_ceil(self.block).max(1) * self.block)
    }

    /// Reads unit `u`'s three buffers.
    pub fn read_unit(&self, u: usize) -> io::Result<UnitState> {
        let (off, bytes) = self.region(u);
        let mut bufs = [AlignedBuf::new(bytes, self.block), AlignedBuf::new(bytes, self.block), AlignedBuf::new(bytes, self.block)];
        for (f, b) in self.files.iter().zip(bufs.iter_mut()) {
            f.read_at(off, b, bytes).map_err(|e| with_path(e, "reading", f))?;
        }
        Ok(UnitState { u, len: self.len[u], bufs })
    }

    /// Writes unit `s.u`'s three buffers back.
    pub fn write_unit(&self, s: &mut UnitState) -> io::Result<()> {
        let (off, bytes) = self.region(s.u);
        for (f, b) in self.files.iter().zip(s.bufs.iter_mut()) {
            f.write_at(off, b, bytes).map_err(|e| with_path(e, "writing", f))?;
        }
        Ok(())
    }

    /// Buffer `which` (0 masters, 1 `exp_avg`, 2 `exp_avg_sq`): the host parts unit after unit.
    pub fn read_buffer(&self, which: usize) -> io::Result<Vec<f32>> {
        let mut out = Vec::with_capacity(self.len.iter().sum());
        for u in 0..self.len.len() {
            let (off, bytes) = self.region(u);
            let mut b = AlignedBuf::new(bytes, self.block);
            self.files[which].read_at(off, &mut b, bytes).map_err(|e| with_path(e, "reading", &self.files[which]))?;
            out.extend_from_slice(b.f32s(self.len[u]));
        }
        Ok(out)
    }

    /// Writes buffer `which` from `data` (the host parts unit after unit).
    pub fn write_buffer(&self, which: usize, data: &[f32]) -> io::Result<()> {
        let total: usize = self.len.iter().sum();
        if data.len() != total {
            return Err(io::Error::other(format!("{} values for the {} swap file of {total}", data.len(), NAMES[which])));
        }
        let mut at = 0;
        for u in 0..self.len.len() {
            let (off, bytes) = self.region(u);
            let mut b = AlignedBuf::new(bytes, self.block);
            b.f32s_mut(self.len[u]).copy_from_slice(&data[at..at + self.len[u]]);
            at += self.len[u];
            self.files[which].write_at(off, &mut b, bytes).map_err(|e| with_path(e, "writing", &self.files[which]))?;
        }
        Ok(())
    }

    /// Runs one step's swap pipeline around `step_units`: a reader thread reads the units of
    /// `order` ahead (at most [`PIPELINE_DEPTH`] waiting), `step_units` receives them through
    /// `next` (which returns unit `u`'s state, read in order, or read now if it arrives out of
    /// order) and hands each stepped unit to `done`, which a writer thread writes back (at most
    /// [`PIPELINE_DEPTH`] waiting). Returns when every write has finished.
    pub fn pipeline<T>(
        &self,
        order: &[usize],
        step_units: impl FnOnce(&mut dyn FnMut(usize) -> io::Result<UnitState>, &mut dyn FnMut(UnitState) -> io::Result<()>) -> T,
    ) -> (T, io::Result<NvmeStats>) {
        let mut stats = NvmeStats::default();
        std::thread::scope(|s| {
            let (rtx, rrx) = mpsc::sync_channel::<io::Result<UnitState>>(PIPELINE_DEPTH);
            let (wtx, wrx) = mpsc::sync_channel::<UnitState>(PIPELINE_DEPTH);
            let reader = s.spawn(move || {
                let t = Instant::now();
                for &u in order {
                    let r = self.read_unit(u);
                    let failed = r.is_err();
                    if rtx.send(r).is_err() || failed {
                        break;
                    }
                }
                t.elapsed().as_secs_f64()
            });
            let writer = s.spawn(move || -> io::Result<(f64, u64)> {
                let (mut busy, mut bytes) = (0f64, 0u64);
                for mut st in wrx {
                    let t = Instant::now();
                    self.write_unit(&mut st)?;
                    busy += t.elapsed().as_secs_f64();
                    bytes += 3 * self.region(st.u).1 as u64;
                }
                Ok((busy, bytes))
            });
            let mut pending = order.iter().copied().peekable();
            let mut next = |u: usize| -> io::Result<UnitState> {
                if pending.peek() == Some(&u) {
                    pending.next();
                    let t = Instant::now();
                    let got = rrx.recv().map_err(|_| io::Error::other("the swap reader stopped"))?;
                    stats.wait_s += t.elapsed().as_secs_f64();
                    got
                } else {
                    self.read_unit(u)
                }
            };
            let mut done = |st: UnitState| wtx.send(st).map_err(|_| io::Error::other("the swap writer stopped"));
            let out = step_units(&mut next, &mut done);
            // Closing both channels ends the threads: the writer after the last queued write,
            // the reader at its next send (it stops early if the step stopped early). (`next`
            // and `done` only borrow them, and are done with them.)
            drop((rrx, wtx));
            let read_s = reader.join().unwrap_or(0.0);
            let res = match writer.join() {
                Ok(Ok((write_s, bytes))) => {
                    stats.read_s = read_s;
                    stats.write_s = write_s;
                    stats.bytes = bytes * 2;
                    Ok(stats)
                }
                Ok(Err(e)) => Err(e),
                Err(_) => Err(io::Error::other("the swap writer panicked")),
            };
            (out, res)
        })
    }
}

fn with_path(e: io::Error, what: &str, f: &SwapFile) -> io::Error {
    io::Error::new(e.kind(), format!("{what} optimizer swap file {}: {e}", f.path().display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small_aio() -> AioOptions {
        AioOptions { block: 4096, ..AioOptions::default() }
    }

    /// Masters written at creation read back; a step through the pipeline (units arriving in the
    /// read-ahead order, and one out of it) changes exactly what it stepped, every unit's region
    /// on its own blocks; the files go with the store.
    #[test]
    fn the_pipeline_reads_ahead_steps_and_writes_back() {
        let dir = tempfile::tempdir().unwrap();
        let split = Split::new(vec![3000, 5000, 0, 1500], 1.0);
        let master: Vec<f32> = (0..split.host_total).map(|i| i as f32 * 0.25).collect();
        let store = NvmeStore::create(dir.path(), 3, &small_aio(), &split, &master).unwrap();
        assert_eq!(store.read_buffer(0).unwrap(), master);
        assert!(store.read_buffer(1).unwrap().iter().all(|&x| x == 0.0), "moments start at zero");
        // Unit 3 arrives first as read ahead, then unit 0 out of the order [3, 1, 0]; unit 1 never.
        let order = [3usize, 1, 0];
        let (stepped, io) = store.pipeline(&order, |next, put| {
            let mut seen = Vec::new();
            for u in [3usize, 0] {
                let mut st = next(u).unwrap();
                let (p, m, v) = st.slices();
                p.iter_mut().for_each(|x| *x = -*x);
                m.iter_mut().for_each(|x| *x = 1.0);
                v.iter_mut().for_each(|x| *x = u as f32);
                seen.push(st.u);
                put(st).unwrap();
            }
            seen
        });
        assert_eq!(stepped, vec![3, 0]);
        let io = io.unwrap();
        assert!(io.bytes > 0);
        let (p, m, v) = (store.read_buffer(0).unwrap(), store.read_buffer(1).unwrap(), store.read_buffer(2).unwrap());
        for u in 0..split.units() {
            for i in split.host_range(u) {
                let touched = u == 3 || u == 0;
                assert_eq!(p[i], if touched { -master[i] } else { master[i] }, "unit {u}, element {i}");
                assert_eq!((m[i], v[i]), if touched { (1.0, u as f32) } else { (0.0, 0.0) });
            }
        }
        let files = std::fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(files, 3);
        drop(store);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "the swap files are removed with the store");
    }

    /// A length mismatch on a whole-buffer write is refused, naming the buffer.
    #[test]
    fn a_whole_buffer_of_the_wrong_length_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let split = Split::new(vec![100], 1.0);
        let store = NvmeStore::create(dir.path(), 0, &small_aio(), &split, &[0.0; 100]).unwrap();
        let e = store.write_buffer(1, &[0.0; 99]).unwrap_err().to_string();
        assert!(e.contains("exp_avg") && e.contains("99"), "{e}");
    }
}
