//! Swap files of the NVMe tier: aligned buffers, O_DIRECT files (buffered where the filesystem
//! refuses O_DIRECT), and the transfers between them, split into `aio.block_size` requests,
//! shared among `aio.thread_count` threads, each keeping up to `aio.queue_depth` requests in
//! flight through its own io_uring (or issuing them one by one with `pread`/`pwrite` where the
//! kernel refuses io_uring, or `TESSERA_AIO=threads` asks for that path).

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use io_uring::{opcode, types, IoUring};

/// How swap-file transfers are issued (`aio.*`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AioOptions {
    /// Bytes: buffer and offset alignment, and the size of one request.
    pub block: usize,
    /// Requests in flight per thread.
    pub queue_depth: u32,
    /// Threads that split one transfer.
    pub threads: usize,
    /// io_uring: one `submit` per request.
    pub single_submit: bool,
    /// io_uring: refill the queue as requests complete (else batch by batch).
    pub overlap_events: bool,
}

impl Default for AioOptions {
    fn default() -> Self {
        AioOptions { block: 1 << 20, queue_depth: 8, threads: 1, single_submit: false, overlap_events: true }
    }
}

/// The transfer path in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    IoUring,
    /// Blocking `pread`/`pwrite` on `aio.thread_count` threads.
    Threads,
}

/// The path this process uses: io_uring unless the kernel refuses a ring (then a warning, once)
/// or `TESSERA_AIO=threads` is set.
pub fn backend() -> Backend {
    static CHOSEN: OnceLock<Backend> = OnceLock::new();
    *CHOSEN.get_or_init(|| {
        if std::env::var("TESSERA_AIO").is_ok_and(|v| v == "threads") {
            return Backend::Threads;
        }
        match IoUring::new(2) {
            Ok(_) => Backend::IoUring,
            Err(e) => {
                tracing::warn!("io_uring is not available ({e}); NVMe offload uses a thread pool of blocking reads and writes");
                Backend::Threads
            }
        }
    })
}

/// A zeroed heap buffer whose start is aligned to `align` bytes (O_DIRECT needs it).
pub struct AlignedBuf {
    ptr: *mut u8,
    layout: Layout,
}

// SAFETY: the buffer is uniquely owned heap memory, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// `bytes` (rounded up to a multiple of `align`, at least one block) of zeros.
    pub fn new(bytes: usize, align: usize) -> AlignedBuf {
        let size = bytes.div_ceil(align).max(1) * align;
        let layout = Layout::from_size_align(size, align).expect("an aligned buffer layout (align is a power of two)");
        // SAFETY: size > 0.
        let ptr = unsafe { alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        AlignedBuf { ptr, layout }
    }

    pub fn len(&self) -> usize {
        self.layout.size()
    }

    pub fn is_empty(&self) -> bool {
        false
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: ptr is valid for layout.size() initialised bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.layout.size()) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.layout.size()) }
    }

    /// The first `n` values as f32 (the alignment is at least 4).
    pub fn f32s(&self, n: usize) -> &[f32] {
        bytemuck::cast_slice(&self.bytes()[..n * 4])
    }

    pub fn f32s_mut(&mut self, n: usize) -> &mut [f32] {
        bytemuck::cast_slice_mut(&mut self.bytes_mut()[..n * 4])
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated with this layout in `new`.
        unsafe { dealloc(self.ptr, self.layout) }
    }
}

/// One request: `len` bytes at file offset `off`, to or from `ptr`.
#[derive(Clone, Copy)]
struct Req {
    off: u64,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: requests of one transfer cover disjoint parts of a buffer borrowed for the transfer.
unsafe impl Send for Req {}
unsafe impl Sync for Req {}

fn op_name(write: bool) -> &'static str {
    if write {
        "write"
    } else {
        "read"
    }
}

/// Runs `reqs` on one io_uring with at most `queue_depth` in flight.
fn run_uring(fd: RawFd, reqs: &[Req], write: bool, o: &AioOptions) -> io::Result<()> {
    let qd = (o.queue_depth as usize).clamp(1, reqs.len().max(1));
    let mut ring = IoUring::new(qd as u32)?;
    let (mut next, mut inflight) = (0usize, 0usize);
    let mut first_err: Option<io::Error> = None;
    loop {
        if first_err.is_none() && (o.overlap_events || inflight == 0) {
            while inflight < qd && next < reqs.len() {
                let r = reqs[next];
                let len = u32::try_from(r.len).map_err(|_| io::Error::other("an I/O request above 4 GiB"))?;
                let entry = if write {
                    opcode::Write::new(types::Fd(fd), r.ptr, len).offset(r.off).build()
                } else {
                    opcode::Read::new(types::Fd(fd), r.ptr, len).offset(r.off).build()
                }
                .user_data(next as u64);
                // SAFETY: the buffer outlives the ring's use of it: we wait for every request below.
                unsafe { ring.submission().push(&entry) }.map_err(|_| io::Error::other("io_uring submission queue full"))?;
                next += 1;
                inflight += 1;
                if o.single_submit {
                    ring.submit()?;
                }
            }
        }
        if inflight == 0 {
            break;
        }
        let want = if o.overlap_events { 1 } else { inflight };
        match ring.submit_and_wait(want) {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
        for cqe in ring.completion() {
            inflight -= 1;
            let r = reqs[cqe.user_data() as usize];
            let res = cqe.result();
            if res < 0 {
                first_err.get_or_insert(io::Error::from_raw_os_error(-res));
            } else if res as usize != r.len {
                first_err.get_or_insert(io::Error::other(format!(
                    "short {} of {res} of {} bytes at offset {}",
                    op_name(write),
                    r.len,
                    r.off
                )));
            }
        }
    }
    first_err.map_or(Ok(()), Err)
}

/// Runs `reqs` one by one with blocking positional I/O.
fn run_blocking(file: &File, reqs: &[Req], write: bool) -> io::Result<()> {
    for r in reqs {
        // SAFETY: each request covers its own part of the buffer borrowed for the transfer.
        let buf = unsafe { std::slice::from_raw_parts_mut(r.ptr, r.len) };
        if write {
            file.write_all_at(buf, r.off)?;
        } else {
            file.read_exact_at(buf, r.off)?;
        }
    }
    Ok(())
}

/// Moves `len` bytes between `buf` and the file at `off`, split as `o` says.
fn transfer(file: &File, off: u64, buf: *mut u8, len: usize, write: bool, o: &AioOptions) -> io::Result<()> {
    let block = o.block.max(4096);
    let reqs: Vec<Req> = (0..len.div_ceil(block))
        .map(|i| {
            let at = i * block;
            // SAFETY: at < len, inside the buffer.
            Req { off: off + at as u64, ptr: unsafe { buf.add(at) }, len: block.min(len - at) }
        })
        .collect();
    let threads = o.threads.clamp(1, reqs.len().max(1));
    let per = reqs.len().div_ceil(threads).max(1);
    let run = |part: &[Req]| match backend() {
        Backend::IoUring => run_uring(file.as_raw_fd(), part, write, o),
        Backend::Threads => run_blocking(file, part, write),
    };
    if threads == 1 {
        return run(&reqs);
    }
    std::thread::scope(|s| {
        let mut parts = reqs.chunks(per);
        let first = parts.next().unwrap_or(&[]);
        let handles: Vec<_> = parts.map(|p| s.spawn(move || run(p))).collect();
        let mut res = run(first);
        for h in handles {
            let r = h.join().unwrap_or_else(|_| Err(io::Error::other("an I/O thread panicked")));
            res = res.and(r);
        }
        res
    })
}

/// One swap file: created (and its whole size allocated) at start, removed when dropped.
pub struct SwapFile {
    path: PathBuf,
    file: File,
    direct: bool,
    /// Allocated size, a multiple of the block.
    size: u64,
    opts: AioOptions,
}

fn open(path: &Path, direct: bool) -> io::Result<File> {
    let mut o = OpenOptions::new();
    o.read(true).write(true).create(true).truncate(true);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    o.open(path)
}

impl SwapFile {
    /// Creates `path` with room for `bytes` (rounded up to the block), all zeros, opened with
    /// O_DIRECT unless the filesystem refuses it (then buffered, with a warning).
    pub fn create(path: PathBuf, bytes: u64, opts: &AioOptions) -> io::Result<SwapFile> {
        let block = opts.block as u64;
        let size = bytes.div_ceil(block).max(1) * block;
        let (file, direct) = match open(&path, true) {
            Ok(f) => (f, true),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => (open(&path, false)?, false),
            Err(e) => return Err(e),
        };
        let mut sf = SwapFile { path, file, direct, size, opts: opts.clone() };
        // SAFETY: a plain fd owned by `sf.file`.
        let rc = unsafe { libc::posix_fallocate(sf.file.as_raw_fd(), 0, size as libc::off_t) };
        if rc == libc::EOPNOTSUPP || rc == libc::EINVAL {
            sf.file.set_len(size)?;
        } else if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        // Probe one direct write: some filesystems accept the flag at open and refuse the I/O.
        if sf.direct {
            let mut probe = AlignedBuf::new(opts.block, opts.block);
            if let Err(e) = sf.write_at(0, &mut probe, opts.block) {
                if e.raw_os_error() != Some(libc::EINVAL) {
                    return Err(e);
                }
                sf.file = open(&sf.path, false)?;
                sf.file.set_len(size)?;
                sf.direct = false;
            }
        }
        if !sf.direct {
            warn_buffered(&sf.path);
        }
        Ok(sf)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn direct(&self) -> bool {
        self.direct
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// The alignment and request size (`aio.block_size`).
    pub fn block(&self) -> usize {
        self.opts.block
    }

    /// Reads `len` bytes (a multiple of the block, inside the file) at `off` into `buf`.
    pub fn read_at(&self, off: u64, buf: &mut AlignedBuf, len: usize) -> io::Result<()> {
        self.check(off, buf, len)?;
        transfer(&self.file, off, buf.bytes_mut().as_mut_ptr(), len, false, &self.opts)
    }

    /// Writes the first `len` bytes of `buf` at `off`.
    pub fn write_at(&self, off: u64, buf: &mut AlignedBuf, len: usize) -> io::Result<()> {
        self.check(off, buf, len)?;
        transfer(&self.file, off, buf.bytes_mut().as_mut_ptr(), len, true, &self.opts)
    }

    fn check(&self, off: u64, buf: &AlignedBuf, len: usize) -> io::Result<()> {
        let block = self.opts.block as u64;
        if off % block != 0 || len as u64 % block != 0 || len > buf.len() || off + len as u64 > self.size {
            return Err(io::Error::other(format!(
                "unaligned or out-of-range swap transfer: {len} bytes at {off} (block {block}, buffer {}, file {})",
                buf.len(),
                self.size
            )));
        }
        Ok(())
    }
}

fn warn_buffered(path: &Path) {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        tracing::warn!(
            "the filesystem of {} refuses O_DIRECT; NVMe offload falls back to buffered I/O (through the page cache)",
            path.display()
        );
    });
}

impl Drop for SwapFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transfers_round_trip_with_every_option() {
        let dir = tempfile::tempdir().expect("tempdir");
        let data: Vec<f32> = (0..300_000).map(|i| i as f32 * 0.5).collect();
        for (threads, qd, single, overlap) in [(1, 1, false, true), (3, 4, true, false), (2, 8, false, false), (4, 2, true, true)] {
            let o = AioOptions { block: 64 * 1024, queue_depth: qd, threads, single_submit: single, overlap_events: overlap };
            let f = SwapFile::create(dir.path().join(format!("t{threads}{qd}")), (data.len() * 4) as u64, &o).expect("create");
            assert_eq!(f.size() % (64 * 1024), 0);
            let len = f.size() as usize;
            let mut buf = AlignedBuf::new(len, o.block);
            buf.f32s_mut(data.len()).copy_from_slice(&data);
            f.write_at(0, &mut buf, len).expect("write");
            let mut back = AlignedBuf::new(len, o.block);
            f.read_at(0, &mut back, len).expect("read");
            assert_eq!(back.f32s(data.len()), &data[..]);
            // A block in the middle only.
            let mut one = AlignedBuf::new(o.block, o.block);
            f.read_at(2 * o.block as u64, &mut one, o.block).expect("read one block");
            assert_eq!(one.f32s(16)[0], data[2 * o.block / 4]);
            assert!(f.read_at(100, &mut one, o.block).is_err(), "an unaligned offset is refused");
            let path = f.path().to_path_buf();
            drop(f);
            assert!(!path.exists(), "dropping a swap file removes it");
        }
    }
}
