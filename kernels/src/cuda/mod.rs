//! The CUDA device: one [`Gpu`] per process and device, our CUDA C kernels compiled at start by
//! NVRTC for the GPU found (and cached on disk), cuBLAS(Lt) GEMMs, and device buffers addressed by
//! plain pointers ([`DPtr`]) so a model can carve one flat buffer into many tensors.
//!
//! Everything here is loaded dynamically (cudarc `dynamic-loading`): the binary builds and runs on
//! machines without CUDA, and [`Gpu::open`] then returns [`GpuError::NoDriver`] with a sentence a
//! user can act on instead of panicking.
//!
//! Kernel sources live in `kernels/cuda/*.cu`; `common.cuh` is prepended to each (NVRTC has no
//! built-in CUDA headers, so the prelude carries the bf16 helpers). Compiled images are cached
//! under `$TESSERA_KERNEL_CACHE` (default `$XDG_CACHE_HOME/tessera/kernels` or
//! `~/.cache/tessera/kernels`), keyed by the BLAKE3 of source, options, architecture and NVRTC
//! version.
//!
//! Determinism: kernels reduce in fixed orders (no float atomics); cuBLAS is asked for the same
//! algorithm every call, so one GPU model and input give the same bits run after run.

pub mod attention;
pub mod blas;
pub mod decode;
pub mod gpt;
pub mod lamb;
pub mod llama;
pub mod lt;
pub mod ops;
pub mod optim;

use std::collections::HashMap;
use std::ffi::CString;
use std::marker::PhantomData;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

pub use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
};
pub use half::bf16;

/// Our kernel sources: (module name, file contents). The prelude is prepended to each.
pub const PRELUDE: &str = include_str!("../../cuda/common.cuh");
pub const SOURCES: &[(&str, &str)] = &[
    ("ops", include_str!("../../cuda/ops.cu")),
    ("attention", include_str!("../../cuda/attention.cu")),
    // The Hopper attention kernels (warpgroup MMAs) use attention.cu's building blocks, so their
    // module is both files; it compiles only for sm_90a (see [`module_arch`]).
    ("attention_wg", concat!(include_str!("../../cuda/attention.cu"), "\n", include_str!("../../cuda/attention_wg.cu"))),
    // The LLaMA family's RMSNorm, RoPE, SwiGLU and embedding, and its grouped-query attention.
    ("llama", include_str!("../../cuda/llama.cu")),
    ("gqa_attention", include_str!("../../cuda/gqa_attention.cu")),
    // The mixture-of-experts routing, permutation, gather/combine and their backwards.
    ("moe", include_str!("../../cuda/moe.cu")),
    // Decoding over a paged key/value cache; reuses ops.cu's LayerNorm row path and llama.cu's
    // RMSNorm and SwiGLU helpers.
    (
        "decode",
        concat!(include_str!("../../cuda/ops.cu"), "\n", include_str!("../../cuda/llama.cu"), "\n", include_str!("../../cuda/decode.cu")),
    ),
];

/// The architecture module `name` compiles for on a GPU of compute capability `cc`, or `None`
/// where it cannot run: `attention_wg` uses wgmma, which exists only on sm_90a (H100/H200; not
/// on later architectures, whose `a` features differ). Every other module compiles for the GPU's
/// own `sm_XY`.
pub fn module_arch(name: &str, cc: (i32, i32)) -> Option<String> {
    match name {
        "attention_wg" => module_runs_on(name, cc).then(|| "sm_90a".to_string()),
        _ => Some(format!("sm_{}{}", cc.0, cc.1)),
    }
}

/// Whether module `name` can run on a GPU of compute capability `cc` ([`module_arch`] is
/// `Some`), without building the architecture's name: asked on every attention call.
pub fn module_runs_on(name: &str, cc: (i32, i32)) -> bool {
    name != "attention_wg" || cc == (9, 0)
}

/// Why the GPU path could not run; every message names what was being done.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error(
        "no CUDA driver could be loaded (libcuda.so): {0}. `--device cuda` needs an NVIDIA GPU and its driver; \
         use `--device cpu` on this machine"
    )]
    NoDriver(String),
    #[error("CUDA device {ordinal} does not exist: this machine has {count} GPU(s)")]
    NoDevice { ordinal: usize, count: usize },
    #[error("NVRTC (libnvrtc.so) could not be loaded: {0}. Point LD_LIBRARY_PATH at the CUDA 13 libraries (see docs/GPU.md)")]
    NoNvrtc(String),
    #[error("{lib} could not be loaded. Point LD_LIBRARY_PATH at the CUDA 13 libraries (see docs/GPU.md)")]
    NoLibrary { lib: &'static str },
    #[error("CUDA error while {what}: {err}")]
    Driver { what: String, err: String },
    #[error("NVRTC could not compile kernels/cuda/{module}.cu for {arch}:\n{log}")]
    Compile { module: String, arch: String, log: String },
    #[error("unknown kernel module `{0}` (known: kernels/cuda/*.cu registered in cuda::SOURCES)")]
    UnknownModule(String),
    #[error("cuBLAS error while {what}: {err}")]
    Blas { what: String, err: String },
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, GpuError>;

/// Wraps a driver error with what we were doing.
pub fn drv<E: std::fmt::Debug>(what: impl Into<String>) -> impl FnOnce(E) -> GpuError {
    let what = what.into();
    move |e| GpuError::Driver { what, err: format!("{e:?}") }
}

/// Number of CUDA devices, or why there are none usable.
pub fn device_count() -> Result<usize> {
    // SAFETY: only tries to dlopen the driver library; no CUDA call is made when it is absent.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(GpuError::NoDriver("no libcuda.so on the library path".into()));
    }
    let n = CudaContext::device_count().map_err(|e| GpuError::NoDriver(format!("cuInit/cuDeviceGetCount failed: {e:?}")))?;
    Ok(n.max(0) as usize)
}

/// A device pointer with an element count: a view into some [`CudaSlice`] that the caller keeps
/// alive. Copyable so a model can hand out many sub-tensors of one flat buffer; the kernels'
/// wrappers check lengths against it.
#[derive(Debug)]
pub struct DPtr<T> {
    pub raw: u64,
    pub len: usize,
    _t: PhantomData<T>,
}

impl<T> Clone for DPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for DPtr<T> {}

impl<T> DPtr<T> {
    /// # Safety
    /// `raw` must point to `len` valid elements of `T` on the device for as long as it is used.
    pub unsafe fn from_raw(raw: u64, len: usize) -> Self {
        Self { raw, len, _t: PhantomData }
    }

    pub fn slice(&self, r: Range<usize>) -> DPtr<T> {
        assert!(r.start <= r.end && r.end <= self.len, "device slice {r:?} out of bounds of {}", self.len);
        DPtr { raw: self.raw + (r.start * std::mem::size_of::<T>()) as u64, len: r.end - r.start, _t: PhantomData }
    }

    pub fn bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// Reinterprets the elements (e.g. bf16 bits as u16); lengths are in the new type.
    pub fn cast<U>(&self) -> DPtr<U> {
        let bytes = self.bytes();
        assert_eq!(bytes % std::mem::size_of::<U>(), 0, "cast of {bytes} bytes to a {}-byte type", std::mem::size_of::<U>());
        DPtr { raw: self.raw, len: bytes / std::mem::size_of::<U>(), _t: PhantomData }
    }
}

/// An owned device buffer (freed on drop) that hands out [`DPtr`]s.
pub struct Buf<T: DeviceRepr> {
    slice: CudaSlice<T>,
    ptr: DPtr<T>,
}

impl<T: DeviceRepr> Buf<T> {
    pub fn ptr(&self) -> DPtr<T> {
        self.ptr
    }
    pub fn len(&self) -> usize {
        self.ptr.len
    }
    pub fn is_empty(&self) -> bool {
        self.ptr.len == 0
    }
    pub fn slice(&self, r: Range<usize>) -> DPtr<T> {
        self.ptr.slice(r)
    }
    pub fn inner(&self) -> &CudaSlice<T> {
        &self.slice
    }
    pub fn inner_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.slice
    }
}

/// One GPU: context, a compute stream, the compiled kernel modules and cuBLAS handles.
pub struct Gpu {
    pub ordinal: usize,
    pub ctx: Arc<CudaContext>,
    /// The stream kernels and GEMMs run on unless told otherwise.
    pub stream: Arc<CudaStream>,
    pub name: String,
    /// Compute capability (9, 0) on H100/H200.
    pub cc: (i32, i32),
    modules: Mutex<HashMap<String, Arc<CudaModule>>>,
    funcs: Mutex<HashMap<(String, String), CudaFunction>>,
    pub blas: blas::Blas,
    /// cuBLASLt (fused-epilogue GEMMs) on the compute stream; `None` without libcublasLt.
    pub lt: Option<lt::Lt>,
    /// Timing marks on the compute stream while profiling ([`Gpu::profile`]).
    marks: Mutex<Option<Vec<(&'static str, CudaEvent)>>>,
}

impl Gpu {
    /// Opens device `ordinal`, makes its context current on this thread and creates the
    /// compute stream and cuBLAS handles. Kernels compile on first use ([`Gpu::func`]).
    pub fn open(ordinal: usize) -> Result<Arc<Gpu>> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(GpuError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(drv(format!("creating a context on GPU {ordinal}")))?;
        // We order work across streams with explicit events (see the model); cudarc's per-buffer
        // tracking would add an event per kernel argument.
        // SAFETY: every cross-stream dependency in this crate is made explicit with events.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(drv("creating the compute stream"))?;
        let name = ctx.name().map_err(drv("reading the device name"))?;
        let cc = ctx.compute_capability().map_err(drv("reading the compute capability"))?;
        let blas = blas::Blas::new(&stream)?;
        let lt = lt::Lt::new(&stream)?;
        Ok(Arc::new(Gpu {
            ordinal,
            ctx,
            stream,
            name,
            cc,
            modules: Mutex::new(HashMap::new()),
            funcs: Mutex::new(HashMap::new()),
            blas,
            lt,
            marks: Mutex::new(None),
        }))
    }

    /// Starts (or with `false`, stops and discards) recording timing marks.
    pub fn profile(&self, on: bool) -> Result<()> {
        let mut m = self.marks.lock().expect("profiler poisoned");
        *m = if on { Some(Vec::new()) } else { None };
        drop(m);
        if on {
            self.mark("start");
        }
        Ok(())
    }

    /// While profiling, records an event on the compute stream: the GPU time since the previous
    /// mark is attributed to `what` (marks follow the work they name). Free when not profiling.
    pub fn mark(&self, what: &'static str) {
        let mut m = self.marks.lock().expect("profiler poisoned");
        if let Some(v) = m.as_mut() {
            let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
            if let Ok(ev) = self.stream.record_event(flags) {
                v.push((what, ev));
            }
        }
    }

    /// Stops profiling and returns (what, total ms, count) in first-seen order.
    pub fn profile_report(&self) -> Result<Vec<(&'static str, f64, usize)>> {
        self.sync()?;
        let marks = self.marks.lock().expect("profiler poisoned").take().unwrap_or_default();
        let mut out: Vec<(&'static str, f64, usize)> = Vec::new();
        for w in marks.windows(2) {
            let ms = w[0].1.elapsed_ms(&w[1].1).map_err(drv("reading profiler events"))? as f64;
            match out.iter_mut().find(|(n, _, _)| *n == w[1].0) {
                Some(e) => {
                    e.1 += ms;
                    e.2 += 1;
                }
                None => out.push((w[1].0, ms, 1)),
            }
        }
        Ok(out)
    }

    /// `sm_90` for an H200.
    pub fn arch(&self) -> String {
        format!("sm_{}{}", self.cc.0, self.cc.1)
    }

    /// Allocates `n` zeroed elements.
    pub fn alloc<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(&self, n: usize) -> Result<Buf<T>> {
        let slice = self.stream.alloc_zeros::<T>(n.max(1)).map_err(drv(format!("allocating {n} elements on GPU {}", self.ordinal)))?;
        let raw = raw_ptr(&slice, &self.stream);
        // SAFETY: `raw` is the start of `slice`, which `Buf` owns and keeps alive.
        let ptr = unsafe { DPtr::from_raw(raw, n) };
        Ok(Buf { slice, ptr })
    }

    /// Copies host data into a new device buffer.
    pub fn upload<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(&self, host: &[T]) -> Result<Buf<T>> {
        let mut b = self.alloc::<T>(host.len())?;
        self.write(&mut b, 0, host)?;
        Ok(b)
    }

    /// Copies host data into `dst[offset..]` (ordered on the compute stream).
    pub fn write<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(&self, dst: &mut Buf<T>, offset: usize, host: &[T]) -> Result<()> {
        if host.is_empty() {
            return Ok(());
        }
        assert!(offset + host.len() <= dst.len(), "upload of {} at {offset} past {}", host.len(), dst.len());
        let mut view = dst.slice.slice_mut(offset..offset + host.len());
        self.stream.memcpy_htod(host, &mut view).map_err(drv("copying host → device"))
    }

    /// Copies `src` to a host vector (waits for the compute stream).
    pub fn download<T: DeviceRepr + Default + Clone>(&self, src: DPtr<T>) -> Result<Vec<T>> {
        let mut out = vec![T::default(); src.len];
        if src.len == 0 {
            return Ok(out);
        }
        self.sync()?;
        // SAFETY: `src` points to `src.len` valid elements (DPtr contract) and `out` has that room.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_sync(&mut out, src.raw).map_err(drv("copying device → host"))?;
        }
        Ok(out)
    }

    /// Device-to-device copy on `stream` (same length).
    pub fn copy(&self, dst: DPtr<u8>, src: DPtr<u8>, stream: &CudaStream) -> Result<()> {
        assert_eq!(dst.len, src.len, "device copy of unequal lengths");
        if src.len == 0 {
            return Ok(());
        }
        // SAFETY: both pointers cover `len` bytes (DPtr contract).
        unsafe { cudarc::driver::result::memcpy_dtod_async(dst.raw, src.raw, src.len, stream.cu_stream()) }
            .map_err(drv("copying device → device"))
    }

    /// Zeroes `dst` on `stream`.
    pub fn zero<T>(&self, dst: DPtr<T>, stream: &CudaStream) -> Result<()> {
        if dst.len == 0 {
            return Ok(());
        }
        // SAFETY: `dst` covers `bytes()` bytes (DPtr contract).
        unsafe { cudarc::driver::result::memset_d8_async(dst.raw, 0, dst.bytes(), stream.cu_stream()) }
            .map_err(drv("zeroing device memory"))
    }

    pub fn sync(&self) -> Result<()> {
        self.stream.synchronize().map_err(drv("waiting for the GPU"))
    }

    /// The kernel `func` of module `module` (compiled, cached and loaded on first use).
    pub fn func(&self, module: &str, func: &str) -> Result<CudaFunction> {
        let key = (module.to_string(), func.to_string());
        if let Some(f) = self.funcs.lock().expect("kernel table poisoned").get(&key) {
            return Ok(f.clone());
        }
        let m = self.module(module)?;
        let f = m.load_function(func).map_err(drv(format!("looking up kernel `{func}` in kernels/cuda/{module}.cu")))?;
        self.funcs.lock().expect("kernel table poisoned").insert(key, f.clone());
        Ok(f)
    }

    fn module(&self, name: &str) -> Result<Arc<CudaModule>> {
        if let Some(m) = self.modules.lock().expect("module table poisoned").get(name) {
            return Ok(m.clone());
        }
        let src = SOURCES.iter().find(|(n, _)| *n == name).map(|(_, s)| *s).ok_or_else(|| GpuError::UnknownModule(name.into()))?;
        let arch = module_arch(name, self.cc).ok_or_else(|| {
            GpuError::Invalid(format!("kernels/cuda/{name}.cu needs an sm_90 GPU (H100/H200); this one is {}", self.arch()))
        })?;
        let image = compile_cached(name, src, &arch)?;
        let m = self.ctx.load_module(cudarc::nvrtc::Ptx::from_binary(image)).map_err(drv(format!("loading kernels/cuda/{name}.cu")))?;
        self.modules.lock().expect("module table poisoned").insert(name.to_string(), m.clone());
        Ok(m)
    }

    /// Compiles every registered module now (start-up), so a compile error shows before training.
    pub fn compile_all(&self) -> Result<()> {
        for (name, _) in SOURCES {
            if module_arch(name, self.cc).is_none() {
                continue;
            }
            self.module(name)?;
        }
        Ok(())
    }
}

/// The raw device address of a slice.
pub fn raw_ptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    use cudarc::driver::DevicePtr;
    let (p, _guard) = s.device_ptr(stream);
    p
}

/// NVRTC options every module is compiled with.
fn nvrtc_options(arch: &str) -> Vec<String> {
    vec![format!("--gpu-architecture={arch}"), "-std=c++17".into(), "--use_fast_math".into(), "-default-device".into(), "-lineinfo".into()]
}

fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TESSERA_KERNEL_CACHE") {
        return PathBuf::from(d);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("tessera").join("kernels")
}

/// NVRTC's version, e.g. (13, 0).
pub fn nvrtc_version() -> Result<(i32, i32)> {
    // SAFETY: dlopen probe only.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(GpuError::NoNvrtc("libnvrtc.so not found on the library path".into()));
    }
    let (mut a, mut b) = (0i32, 0i32);
    // SAFETY: plain out-parameters.
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut a, &mut b) }.result().map_err(|e| GpuError::NoNvrtc(format!("{e:?}")))?;
    Ok((a, b))
}

/// Compiles `PRELUDE + src` for `arch` to a cubin, or reads it from the cache.
pub fn compile_cached(name: &str, src: &str, arch: &str) -> Result<Vec<u8>> {
    let ver = nvrtc_version()?;
    let opts = nvrtc_options(arch);
    let mut h = blake3::Hasher::new();
    for part in [PRELUDE, src, arch, &opts.join(" "), &format!("{ver:?}")] {
        h.update(part.as_bytes());
        h.update(&[0]);
    }
    let path = cache_dir().join(format!("{name}-{arch}-{}.cubin", &h.finalize().to_hex()[..16]));
    if let Ok(bytes) = std::fs::read(&path) {
        if !bytes.is_empty() {
            return Ok(bytes);
        }
    }
    let cubin = compile(name, src, arch)?;
    // The cache is an optimisation: failing to write it only costs a recompile next time.
    if std::fs::create_dir_all(cache_dir()).is_ok() {
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &cubin).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok(cubin)
}

/// Compiles `PRELUDE + src` for a real architecture (`sm_90`) to a cubin with NVRTC. Works
/// without a GPU (only libnvrtc is needed), which is how the sources are checked off the GPU machine.
pub fn compile(name: &str, src: &str, arch: &str) -> Result<Vec<u8>> {
    use cudarc::nvrtc::{result, sys};
    nvrtc_version()?;
    let full = format!("{PRELUDE}\n#line 1 \"{name}.cu\"\n{src}");
    let c_src = CString::new(full).map_err(|_| GpuError::Invalid(format!("kernels/cuda/{name}.cu contains a NUL byte")))?;
    let c_name = CString::new(format!("{name}.cu")).expect("module names have no NUL");
    let prog = result::create_program(&c_src, Some(&c_name)).map_err(|e| GpuError::NoNvrtc(format!("{e:?}")))?;
    let opts = nvrtc_options(arch);
    // SAFETY: `prog` is a live program; it is destroyed below on every path.
    let out = unsafe {
        let compiled = result::compile_program(prog, &opts);
        let log = result::get_program_log(prog).map(|l| log_string(&l)).unwrap_or_default();
        match compiled {
            Err(_) => Err(GpuError::Compile { module: name.into(), arch: arch.into(), log }),
            Ok(()) => {
                let mut size = 0usize;
                let r = sys::nvrtcGetCUBINSize(prog, &mut size).result();
                if r.is_err() || size == 0 {
                    Err(GpuError::Compile { module: name.into(), arch: arch.into(), log: format!("no cubin produced ({r:?}); {log}") })
                } else {
                    let mut buf = vec![0u8; size];
                    match sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut std::ffi::c_char).result() {
                        Ok(()) => Ok(buf),
                        Err(e) => Err(GpuError::Compile { module: name.into(), arch: arch.into(), log: format!("nvrtcGetCUBIN: {e:?}") }),
                    }
                }
            }
        }
    };
    // SAFETY: destroyed once.
    let _ = unsafe { result::destroy_program(prog) };
    out
}

fn log_string(l: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = l.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// A launch configuration for `n` independent items with `threads` per block.
pub fn grid_1d(n: usize, threads: u32) -> LaunchConfig {
    let blocks = n.div_ceil(threads as usize).max(1) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a GPU the error is a sentence, not a panic.
    #[test]
    fn no_gpu_is_a_clear_error() {
        match Gpu::open(0) {
            Ok(g) => println!("GPU present ({}), nothing to check", g.name),
            Err(e) => {
                let msg = e.to_string();
                println!("no GPU: {msg}");
                assert!(msg.contains("CUDA") || msg.contains("GPU"), "{msg}");
            }
        }
    }

    /// Every registered source compiles for sm_90 when NVRTC is present (skips otherwise).
    #[test]
    fn sources_compile_for_hopper() {
        if let Err(e) = nvrtc_version() {
            println!("skipped: {e}");
            return;
        }
        for (name, src) in SOURCES {
            let arch = module_arch(name, (9, 0)).expect("every module runs on sm_90");
            let cubin = compile(name, src, &arch).unwrap_or_else(|e| panic!("{e}"));
            assert!(cubin.len() > 100, "{name}: empty cubin");
        }
    }
}

/// One line of a GPU-vs-CPU correctness check (printed by `tessera gpu check` and the GPU tests).
#[derive(Clone, Debug)]
pub struct CheckRow {
    /// What was compared, e.g. `layernorm_backward dx [4096×768]`.
    pub name: String,
    /// max |gpu − cpu|.
    pub max_abs: f64,
    /// max |gpu − cpu| / (|cpu| + atol_floor) — see `tol`.
    pub max_rel: f64,
    /// The bound the check must meet (on `max_rel`).
    pub tol: f64,
    /// Any NaN/inf on the GPU side.
    pub non_finite: bool,
}

impl CheckRow {
    /// Compares `gpu` with `cpu` elementwise; `floor` keeps near-zero references from dominating
    /// the relative error (the error is `|g−c| / (|c| + floor)`).
    pub fn compare(name: impl Into<String>, gpu: &[f32], cpu: &[f32], floor: f64, tol: f64) -> CheckRow {
        assert_eq!(gpu.len(), cpu.len(), "compare: lengths differ");
        let (mut max_abs, mut max_rel, mut non_finite) = (0f64, 0f64, false);
        for (&g, &c) in gpu.iter().zip(cpu) {
            if !g.is_finite() {
                non_finite = true;
                continue;
            }
            let d = (g as f64 - c as f64).abs();
            max_abs = max_abs.max(d);
            max_rel = max_rel.max(d / ((c as f64).abs() + floor));
        }
        CheckRow { name: name.into(), max_abs, max_rel, tol, non_finite }
    }

    /// A yes/no check of identical bits, as a row: max_abs 1 when `same` is false, else 0.
    pub fn same_bits(name: impl Into<String>, same: bool) -> CheckRow {
        CheckRow::compare(name, &[if same { 0.0 } else { 1.0 }], &[0.0], 0.0, 0.0)
    }

    pub fn pass(&self) -> bool {
        !self.non_finite && self.max_rel <= self.tol
    }
}

impl std::fmt::Display for CheckRow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:<48} max_abs {:>10.3e}  max_rel {:>10.3e}  tol {:>8.1e}  {}",
            self.name,
            self.max_abs,
            self.max_rel,
            self.tol,
            if self.pass() {
                "ok"
            } else if self.non_finite {
                "FAIL (non-finite)"
            } else {
                "FAIL"
            }
        )
    }
}
