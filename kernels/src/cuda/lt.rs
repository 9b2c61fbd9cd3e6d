//! cuBLASLt GEMMs with fused epilogues, in row-major terms like [`super::blas`]: the bias add,
//! GELU keeping its pre-activation, dGELU with the bias gradient, the bias gradient of the `B`
//! operand of a weight-gradient GEMM, and a residual input (`out = A·B + bias + residual`).
//! Each fusion removes one pass of an elementwise kernel over an activation.
//!
//! Determinism: the algorithm for a GEMM is the first one cuBLASLt's heuristic returns for its
//! shape, types, epilogue and operand alignments, asked once and cached; the same call then
//! runs the same algorithm every time. cuBLASLt's reductions (split-K included) run in a fixed
//! order.
//!
//! Tuning (on unless `TESSERA_GPU_TUNE=0`): on a GEMM's first run the heuristic's first
//! [`TUNE_CANDIDATES`] algorithms are timed on that call's own operands (outputs go to zeroed
//! scratch buffers, nothing the model owns is written) and the fastest is kept — but only among
//! those whose every output byte equals the first algorithm's and whose split-K count and
//! reduction scheme are the same. Timing may pick differently on another run or rank; what it
//! may pick gave the first algorithm's bits on real data. That is strong evidence, not a proof,
//! of the same summation order, so it is only taken where it is strong: an output of at least
//! [`TUNE_MIN_ELEMENTS_BF16`] bf16 elements (a different order would show in ~16 of them) or
//! [`TUNE_MIN_ELEMENTS_F32`] f32 ones (it would show in most); smaller GEMMs keep the first
//! algorithm. `TESSERA_GPU_TUNE=0` gives the untuned choice everywhere.
//!
//! Row-major `C[m,n] = A[m,k]·B[k,n]` is column-major `Cᵀ = Bᵀ·Aᵀ`: cuBLASLt's `A` is our `B`
//! and its `B` our `A`; a column-major row is our column, so a bias "per row of D" is our bias
//! per output feature, and `BGRADA` (reduce cuBLASLt's `A` over `k`) is the column sum of our
//! `B` over its `k` rows: the bias gradient of a weight-gradient GEMM `dW = Xᵀ·dY`.

use std::collections::HashMap;
use std::ffi::c_void;
use std::mem::size_of;
use std::sync::{Arc, Mutex};

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use cudarc::driver::{CudaSlice, CudaStream};

use super::blas::{Dt, Mat};
use super::{drv, GpuError, Result};

/// Workspace cuBLASLt may use per GEMM (NVIDIA's recommendation for Hopper).
pub const WORKSPACE_BYTES: usize = 32 << 20;
/// Algorithms asked of the heuristic when tuning.
pub const TUNE_CANDIDATES: usize = 8;
/// Timed runs per candidate (after one untimed run, whose output is compared).
const TUNE_REPS: usize = 5;
/// A GEMM with a bf16 output of fewer elements than this is not tuned: a different summation
/// order changes an f32 result in its last bits, which survive rounding to bf16 in about one
/// element in 2^16, so only a large output makes bit-equality good evidence of the same order
/// (2^20 elements: ~16 differing elements expected if the order differed). f32 outputs show
/// a different order in most elements; they need [`TUNE_MIN_ELEMENTS_F32`].
const TUNE_MIN_ELEMENTS_BF16: usize = 1 << 20;
const TUNE_MIN_ELEMENTS_F32: usize = 1 << 12;
/// A GEMM whose outputs would need more scratch than this (per copy), or more than
/// 1/[`TUNE_FREE_FRACTION`] of the device memory free at the time, is not tuned.
pub const TUNE_SCRATCH_BYTES_MAX: usize = 4 << 30;
const TUNE_FREE_FRACTION: usize = 8;

/// What the GEMM does after the product. Pointers are device addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Epilogue {
    /// `out = A·B (+ residual)`.
    None,
    /// `out = A·B + bias[n]` (bf16 bias) (+ residual).
    Bias { bias: u64 },
    /// `out = A·B + bias[n]` with an f32 bias (+ residual): cuBLASLt takes the bias in the
    /// output's type when that is f32.
    BiasF32 { bias: u64 },
    /// `pre = A·B + bias[n]` written to `pre` (bf16, `[m, n]`), `out = gelu(pre)` (tanh form).
    GeluAuxBias { bias: u64, pre: u64 },
    /// `out = (A·B) ∘ gelu'(pre)` with `pre` as stored by [`Epilogue::GeluAuxBias`].
    DGelu { pre: u64 },
    /// `dbias[n] = Σ_k B[k, n]` (f32, overwritten): the bias gradient of `dW = Xᵀ·dY`.
    BgradB { dbias: u64 },
}

impl Epilogue {
    fn kind(&self) -> u8 {
        match self {
            Epilogue::None => 0,
            Epilogue::Bias { .. } => 1,
            Epilogue::GeluAuxBias { .. } => 2,
            Epilogue::DGelu { .. } => 3,
            Epilogue::BgradB { .. } => 4,
            Epilogue::BiasF32 { .. } => 5,
        }
    }
    fn code(&self) -> sys::cublasLtEpilogue_t {
        use sys::cublasLtEpilogue_t as E;
        match self {
            Epilogue::None => E::CUBLASLT_EPILOGUE_DEFAULT,
            Epilogue::Bias { .. } | Epilogue::BiasF32 { .. } => E::CUBLASLT_EPILOGUE_BIAS,
            Epilogue::GeluAuxBias { .. } => E::CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
            Epilogue::DGelu { .. } => E::CUBLASLT_EPILOGUE_DGELU,
            Epilogue::BgradB { .. } => E::CUBLASLT_EPILOGUE_BGRADA,
        }
    }
    /// The vector operand (bias or bias gradient) and its element type.
    fn vector(&self) -> Option<(u64, Dt)> {
        match *self {
            Epilogue::None | Epilogue::DGelu { .. } => None,
            Epilogue::Bias { bias } | Epilogue::GeluAuxBias { bias, .. } => Some((bias, Dt::Bf16)),
            Epilogue::BgradB { dbias } | Epilogue::BiasF32 { bias: dbias } => Some((dbias, Dt::F32)),
        }
    }
    /// The auxiliary `[m, n]` bf16 matrix (the GELU pre-activation).
    fn aux(&self) -> Option<u64> {
        match *self {
            Epilogue::GeluAuxBias { pre, .. } | Epilogue::DGelu { pre } => Some(pre),
            _ => None,
        }
    }
}

/// One row-major GEMM: `c[m,n] = a·b (+ residual)` then the epilogue; f32 accumulation.
#[derive(Clone, Copy, Debug)]
pub struct Gemm {
    pub c: Mat,
    pub a: Mat,
    pub b: Mat,
    pub m: usize,
    pub k: usize,
    pub n: usize,
    /// Added to the product with β = 1 (same type and shape as `c`; may be `c` itself).
    pub residual: Option<Mat>,
    pub epilogue: Epilogue,
}

/// Largest power of two (at most 256) dividing `p`: what the heuristic may assume of a pointer.
fn align_of(p: u64) -> u32 {
    if p == 0 {
        256
    } else {
        (1u64 << p.trailing_zeros().min(8)) as u32
    }
}

/// Everything the algorithm choice depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    m: usize,
    k: usize,
    n: usize,
    a: (Dt, bool),
    b: (Dt, bool),
    c: Dt,
    residual: bool,
    epilogue: u8,
    align: [u32; 6],
}

impl Key {
    fn of(g: &Gemm) -> Key {
        let (vec, aux) = (g.epilogue.vector().map_or(0, |v| v.0), g.epilogue.aux().unwrap_or(0));
        let res = g.residual.map_or(g.c.ptr, |r| r.ptr);
        Key {
            m: g.m,
            k: g.k,
            n: g.n,
            a: (g.a.dt, g.a.t),
            b: (g.b.dt, g.b.t),
            c: g.c.dt,
            residual: g.residual.is_some(),
            epilogue: g.epilogue.kind(),
            align: [align_of(g.a.ptr), align_of(g.b.ptr), align_of(res), align_of(g.c.ptr), align_of(vec), align_of(aux)],
        }
    }
}

fn cuda_type(dt: Dt) -> sys::cudaDataType {
    match dt {
        Dt::Bf16 => sys::cudaDataType::CUDA_R_16BF,
        Dt::F32 => sys::cudaDataType::CUDA_R_32F,
    }
}

fn lt_err(what: impl Into<String>) -> impl FnOnce(lt::CublasError) -> GpuError {
    let what = what.into();
    move |e| GpuError::Blas { what, err: format!("{e:?}") }
}

/// A prepared GEMM: descriptors and the chosen algorithm (owned; destroyed on drop).
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    c: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    /// The algorithm every run uses: the heuristic's first until tuning picks another.
    algo: Mutex<sys::cublasLtMatmulAlgo_t>,
    /// The heuristic's answers in its order (the first is `algo`'s start); more than one only
    /// when tuning.
    candidates: Vec<sys::cublasLtMatmulAlgo_t>,
    /// Whether tuning has looked at this plan (it runs once, on the first call).
    tuned: std::sync::atomic::AtomicBool,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each handle was created by this plan and is destroyed once.
        unsafe {
            let _ = lt::destroy_matmul_desc(self.desc);
            for l in [self.a, self.b, self.c, self.d] {
                let _ = lt::destroy_matrix_layout(l);
            }
        }
    }
}

unsafe fn set_desc<T>(desc: sys::cublasLtMatmulDesc_t, attr: sys::cublasLtMatmulDescAttributes_t, v: &T) -> Result<()> {
    lt::set_matmul_desc_attribute(desc, attr, v as *const T as *const c_void, size_of::<T>()).map_err(lt_err(format!("setting {attr:?}")))
}

/// Sets the pointers of one call on a plan's descriptor.
unsafe fn set_pointers(desc: sys::cublasLtMatmulDesc_t, e: &Epilogue) -> Result<()> {
    use sys::cublasLtMatmulDescAttributes_t as A;
    if let Some((v, _)) = e.vector() {
        set_desc(desc, A::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &v)?;
    }
    if let Some(aux) = e.aux() {
        set_desc(desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux)?;
    }
    Ok(())
}

impl Plan {
    /// Builds the descriptors for `g` and asks the heuristic for `want` algorithms (at least
    /// one must come back).
    fn new(handle: sys::cublasLtHandle_t, g: &Gemm, key: &Key, want: usize) -> Result<Plan> {
        use sys::cublasLtMatmulDescAttributes_t as A;
        let i64_of = |x: usize| x as i64;
        // cublasOperation_t: CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 (an int32 attribute).
        let op = |t: bool| -> i32 { i32::from(t) };
        // cuBLASLt A = our B, stored [k, n] (col-major n×k, ld n) or, transposed, [n, k] (k×n, ld k).
        let (ar, ac, ald) = if g.b.t { (g.k, g.n, g.k) } else { (g.n, g.k, g.n) };
        // cuBLASLt B = our A, stored [m, k] (col-major k×m, ld k) or, transposed, [k, m] (m×k, ld m).
        let (br, bc, bld) = if g.a.t { (g.m, g.k, g.m) } else { (g.k, g.m, g.k) };
        let layout = |dt: Dt, r: usize, c: usize, ld: usize| {
            lt::create_matrix_layout(cuda_type(dt), r as u64, c as u64, i64_of(ld)).map_err(lt_err("creating a matrix layout"))
        };
        let cdt = g.residual.map_or(g.c.dt, |r| r.dt);
        let (la, lb, lc, ld) =
            (layout(g.b.dt, ar, ac, ald)?, layout(g.a.dt, br, bc, bld)?, layout(cdt, g.n, g.m, g.n)?, layout(g.c.dt, g.n, g.m, g.n)?);
        let desc = lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType::CUDA_R_32F)
            .map_err(lt_err("creating a matmul descriptor"))?;
        let mut plan = Plan {
            desc,
            a: la,
            b: lb,
            c: lc,
            d: ld,
            algo: Mutex::new(unsafe { std::mem::zeroed() }),
            candidates: Vec::new(),
            tuned: std::sync::atomic::AtomicBool::new(false),
        };
        // SAFETY: the descriptor is live; every attribute value has the type cuBLASLt documents.
        unsafe {
            set_desc(desc, A::CUBLASLT_MATMUL_DESC_TRANSA, &op(g.b.t))?;
            set_desc(desc, A::CUBLASLT_MATMUL_DESC_TRANSB, &op(g.a.t))?;
            set_desc(desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE, &g.epilogue.code())?;
            if let Some((_, dt)) = g.epilogue.vector() {
                set_desc(desc, A::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &cuda_type(dt))?;
            }
            if g.epilogue.aux().is_some() {
                set_desc(desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &i64_of(g.n))?;
                set_desc(desc, A::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, &cuda_type(Dt::Bf16))?;
            }
            set_pointers(desc, &g.epilogue)?;
        }
        let hs = heuristic(handle, desc, [la, lb, lc, ld], key, g, want)?;
        *plan.algo.get_mut().expect("fresh plan") = hs[0].algo;
        plan.candidates = hs.iter().map(|h| h.algo).collect();
        Ok(plan)
    }
}

/// cuBLASLt's heuristic for the GEMM `g` described by `desc` and its layouts (A, B, C, D):
/// up to `want` algorithms (at least one comes back, or an error) that need at most
/// [`WORKSPACE_BYTES`], for the operand alignments of `key`.
fn heuristic(
    handle: sys::cublasLtHandle_t,
    desc: sys::cublasLtMatmulDesc_t,
    [la, lb, lc, ld]: [sys::cublasLtMatrixLayout_t; 4],
    key: &Key,
    g: &Gemm,
    want: usize,
) -> Result<Vec<sys::cublasLtMatmulHeuristicResult_t>> {
    let pref = lt::create_matmul_pref().map_err(lt_err("creating matmul preferences"))?;
    let chosen = (|| -> Result<Vec<sys::cublasLtMatmulHeuristicResult_t>> {
        use sys::cublasLtMatmulPreferenceAttributes_t as P;
        // SAFETY: `pref` is live; values are u64 / u32 as documented.
        unsafe {
            let set = |attr: P, v: *const c_void, n: usize| {
                lt::set_matmul_pref_attribute(pref, attr, v, n).map_err(lt_err(format!("setting {attr:?}")))
            };
            let ws = WORKSPACE_BYTES as u64;
            set(P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws as *const u64 as *const c_void, 8)?;
            for (attr, a) in [
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align[1]),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align[0]),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align[2]),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align[3]),
            ] {
                set(attr, &a as *const u32 as *const c_void, 4)?;
            }
            let mut results: Vec<sys::cublasLtMatmulHeuristicResult_t> = vec![std::mem::zeroed(); want.max(1)];
            let mut got: i32 = 0;
            let status = sys::cublasLtMatmulAlgoGetHeuristic(
                handle,
                desc,
                la,
                lb,
                lc,
                ld,
                pref,
                results.len() as i32,
                results.as_mut_ptr(),
                &mut got,
            );
            let none = || GpuError::Blas {
                what: format!("no cuBLASLt algorithm for {:?} m={} k={} n={}", g.epilogue.code(), g.m, g.k, g.n),
                err: format!("{status:?}"),
            };
            if status != sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS || got < 1 {
                return Err(none());
            }
            results.truncate(got as usize);
            results.retain(|h| h.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS && h.workspaceSize <= WORKSPACE_BYTES);
            if results.is_empty() {
                return Err(none());
            }
            Ok(results)
        }
    })();
    // SAFETY: created above, destroyed once.
    unsafe {
        let _ = lt::destroy_matmul_pref(pref);
    }
    chosen
}

/// An algorithm's split-K count and reduction scheme (`u32::MAX` where cuBLASLt does not say):
/// tuning only considers algorithms that sum in the first one's order.
fn split_config(a: &sys::cublasLtMatmulAlgo_t) -> (u32, u32) {
    let get = |attr: sys::cublasLtMatmulAlgoConfigAttributes_t| -> u32 {
        let (mut v, mut n) = (0u32, 0usize);
        // SAFETY: both attributes are uint32 per the cuBLASLt documentation.
        let st = unsafe { sys::cublasLtMatmulAlgoConfigGetAttribute(a, attr, &mut v as *mut u32 as *mut c_void, 4, &mut n) };
        if st == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            v
        } else {
            u32::MAX
        }
    };
    use sys::cublasLtMatmulAlgoConfigAttributes_t as C;
    (get(C::CUBLASLT_ALGO_CONFIG_SPLITK_NUM), get(C::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME))
}

/// The bytes of a GEMM's outputs that tuning compares, each rounded up to 256: D, the GELU
/// epilogue's aux output (the pre-activation, bf16) and the bias gradient (f32).
fn tuned_output_bytes(g: &Gemm) -> [usize; 3] {
    let esz = match g.c.dt {
        Dt::Bf16 => 2usize,
        Dt::F32 => 4,
    };
    let pad = |b: usize| b.div_ceil(256) * 256;
    let aux = if matches!(g.epilogue, Epilogue::GeluAuxBias { .. }) { g.m * g.n * 2 } else { 0 };
    let vec = if matches!(g.epilogue, Epilogue::BgradB { .. }) { g.n * 4 } else { 0 };
    [pad(g.m * g.n * esz), pad(aux), pad(vec)]
}

/// A cuBLASLt handle bound to one stream, its workspace, and the plans of the GEMMs seen so far.
pub struct Lt {
    handle: sys::cublasLtHandle_t,
    stream: Arc<CudaStream>,
    workspace: CudaSlice<u8>,
    workspace_ptr: u64,
    plans: Mutex<HashMap<Key, Arc<Plan>>>,
    /// Held from setting a plan's pointers to enqueueing it (plans are shared by same-key calls).
    call: Mutex<()>,
    /// `TESSERA_GPU_TUNE`: time the heuristic's candidates on each GEMM's first call.
    tune: std::sync::atomic::AtomicBool,
    /// The model's plain GEMMs run here too, not through cuBLAS (always when tuning, so those
    /// are tuned; `TESSERA_GPU_TUNE=route` alone, to compare tuned with untuned bits).
    route: std::sync::atomic::AtomicBool,
    /// One line per GEMM tuning looked at (what it chose and why), in order.
    tune_log: Mutex<Vec<String>>,
}

// SAFETY: the handle and plans are used from the thread that owns the Gpu's context (one per
// process), serialised by the plan table's mutex where it matters.
unsafe impl Send for Lt {}
unsafe impl Sync for Lt {}
unsafe impl Send for Plan {}
unsafe impl Sync for Plan {}

impl Drop for Lt {
    fn drop(&mut self) {
        self.plans.lock().unwrap_or_else(|p| p.into_inner()).clear();
        // SAFETY: created in `new`, destroyed once, after every plan.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

impl Lt {
    /// `None` when libcublasLt is not on the library path (the plain cuBLAS path is used then).
    pub(crate) fn new(stream: &Arc<CudaStream>) -> Result<Option<Lt>> {
        // SAFETY: dlopen probe only.
        if !unsafe { sys::is_culib_present() } {
            return Ok(None);
        }
        let (route, tune) = tune_requested()?;
        let handle = lt::create_handle().map_err(lt_err("creating a cuBLASLt handle"))?;
        // SAFETY: the workspace is only handed to cuBLASLt, never read as typed data.
        let workspace = unsafe { stream.alloc::<u8>(WORKSPACE_BYTES) }.map_err(drv("allocating the cuBLASLt workspace"))?;
        let workspace_ptr = super::raw_ptr(&workspace, stream);
        Ok(Some(Lt {
            handle,
            stream: stream.clone(),
            workspace,
            workspace_ptr,
            plans: Mutex::new(HashMap::new()),
            call: Mutex::new(()),
            tune: tune.into(),
            route: route.into(),
            tune_log: Mutex::new(Vec::new()),
        }))
    }

    /// Device bytes this handle holds (the workspace).
    pub fn bytes(&self) -> usize {
        self.workspace.len()
    }

    fn plan(&self, g: &Gemm) -> Result<Arc<Plan>> {
        let key = Key::of(g);
        let mut plans = self.plans.lock().expect("cuBLASLt plan table poisoned");
        if let Some(p) = plans.get(&key) {
            return Ok(p.clone());
        }
        let want = if self.tuning() { TUNE_CANDIDATES } else { 1 };
        let p = Arc::new(Plan::new(self.handle, g, &key, want)?);
        plans.insert(key, p.clone());
        Ok(p)
    }

    /// Whether cuBLASLt has an algorithm for `g` (plans it; nothing runs).
    pub fn supports(&self, g: &Gemm) -> bool {
        self.plan(g).is_ok()
    }

    /// Enqueues `g` on the handle's stream (tuning its plan first, once, when tuning is on).
    pub fn run(&self, g: &Gemm) -> Result<()> {
        assert!(!g.c.t, "the output of a GEMM is never stored transposed");
        if let Some(r) = g.residual {
            assert!(!r.t && r.dt == g.c.dt, "a residual input has the output's type and layout");
        }
        let plan = self.plan(g)?;
        if self.tuning() && !plan.tuned.swap(true, std::sync::atomic::Ordering::AcqRel) {
            let line = match self.tune_plan(&plan, g) {
                Ok(l) => l,
                Err(why) => format!("{} m={} k={} n={}: not tuned ({why})", epilogue_name(&g.epilogue), g.m, g.k, g.n),
            };
            self.tune_log.lock().expect("tuning log poisoned").push(line);
        }
        let algo = *plan.algo.lock().expect("plan algorithm poisoned");
        self.enqueue(&plan, g, &algo)
    }

    /// Whether GEMMs are tuned on their first call.
    pub fn tuning(&self) -> bool {
        self.tune.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Whether the model's plain GEMMs run through cuBLASLt.
    pub fn routes_plain(&self) -> bool {
        self.route.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Sets tuning and routing (forgetting every plan, so the next calls plan and tune anew):
    /// `tessera gpu check` compares tuned with untuned bits this way.
    pub fn set_tuning(&self, route: bool, tune: bool) {
        let _call = self.call.lock().expect("cuBLASLt call lock poisoned");
        self.plans.lock().expect("cuBLASLt plan table poisoned").clear();
        self.route.store(route || tune, std::sync::atomic::Ordering::Release);
        self.tune.store(tune, std::sync::atomic::Ordering::Release);
    }

    /// What tuning chose, one line per GEMM (empty when tuning is off).
    pub fn tune_report(&self) -> Vec<String> {
        self.tune_log.lock().expect("tuning log poisoned").clone()
    }

    fn enqueue(&self, plan: &Plan, g: &Gemm, algo: &sys::cublasLtMatmulAlgo_t) -> Result<()> {
        let (alpha, beta) = (1.0f32, if g.residual.is_some() { 1.0f32 } else { 0.0 });
        let cptr = g.residual.map_or(g.c.ptr, |r| r.ptr);
        let _call = self.call.lock().expect("cuBLASLt call lock poisoned");
        // SAFETY: the caller's pointers cover the matrices and vectors described (checked by the
        // model's wrappers); the plan's descriptors match `g` (same key); alpha/beta are f32 as
        // the scale type requires; the workspace is ours and large enough for the algorithm
        // (candidates wanting more were dropped when the plan was made).
        unsafe {
            set_pointers(plan.desc, &g.epilogue)?;
            lt::matmul(
                self.handle,
                plan.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                g.b.ptr as *const c_void,
                plan.a,
                g.a.ptr as *const c_void,
                plan.b,
                cptr as *const c_void,
                plan.c,
                g.c.ptr as *mut c_void,
                plan.d,
                algo,
                self.workspace_ptr as *mut c_void,
                WORKSPACE_BYTES,
                self.stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(lt_err(format!("cuBLASLt GEMM {:?} m={} k={} n={}", g.epilogue.code(), g.m, g.k, g.n)))
    }

    /// Times `plan`'s candidates on `g`'s operands with every output redirected to scratch, and
    /// keeps the fastest whose outputs are bit-equal to the first candidate's (see the module
    /// comment). Returns a line for the report; `Err` says why nothing was timed.
    fn tune_plan(&self, plan: &Plan, g: &Gemm) -> std::result::Result<String, String> {
        use std::fmt::Write as _;
        if plan.candidates.len() < 2 {
            return Err(format!("the heuristic offered {} algorithm", plan.candidates.len()));
        }
        let min = if g.c.dt == Dt::Bf16 { TUNE_MIN_ELEMENTS_BF16 } else { TUNE_MIN_ELEMENTS_F32 };
        if g.m * g.n < min {
            return Err(format!("{} output elements are too few for bit-equality to show the summation order", g.m * g.n));
        }
        let [d_bytes, aux_bytes, vec_bytes] = tuned_output_bytes(g);
        let set_bytes = d_bytes + aux_bytes + vec_bytes;
        let free = self.stream.context().mem_get_info().map(|(f, _)| f).unwrap_or(0);
        let cap = TUNE_SCRATCH_BYTES_MAX.min(free / TUNE_FREE_FRACTION);
        if set_bytes > cap {
            return Err(format!("outputs need {} MiB of scratch, above {} MiB", set_bytes >> 20, cap >> 20));
        }
        let e = |what: &str| {
            let what = what.to_string();
            move |err: cudarc::driver::DriverError| format!("{what}: {err:?}")
        };
        // Zeroed: the padding between the outputs is compared too and is never written.
        let scratch = self.stream.alloc_zeros::<u8>(2 * set_bytes).map_err(e("allocating tuning scratch"))?;
        let base = super::raw_ptr(&scratch, &self.stream);
        // Output pointers of scratch set `k` (0: the reference, 1: the candidate).
        let redirect = |k: usize| -> Gemm {
            let o = base + (k * set_bytes) as u64;
            let (d, aux, vec) = (o, o + d_bytes as u64, o + (d_bytes + aux_bytes) as u64);
            let epilogue = match g.epilogue {
                Epilogue::GeluAuxBias { bias, .. } => Epilogue::GeluAuxBias { bias, pre: aux },
                Epilogue::BgradB { .. } => Epilogue::BgradB { dbias: vec },
                other => other,
            };
            // The residual (C) is read where it is; only D and the epilogue's outputs move.
            Gemm { c: Mat { ptr: d, ..g.c }, epilogue, ..*g }
        };
        let (gref, gcand) = (redirect(0), redirect(1));
        let read = |k: usize| -> std::result::Result<Vec<u8>, String> {
            let view = scratch.slice(k * set_bytes..(k + 1) * set_bytes);
            self.stream.clone_dtoh(&view).map_err(e("reading tuning scratch"))
        };
        let time = |gg: &Gemm, algo: &sys::cublasLtMatmulAlgo_t| -> std::result::Result<f32, String> {
            let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
            let t0 = self.stream.record_event(flags).map_err(e("recording a tuning event"))?;
            for _ in 0..TUNE_REPS {
                self.enqueue(plan, gg, algo).map_err(|x| x.to_string())?;
            }
            let t1 = self.stream.record_event(flags).map_err(e("recording a tuning event"))?;
            Ok(t0.elapsed_ms(&t1).map_err(e("timing a candidate"))? / TUNE_REPS as f32)
        };
        let first = plan.candidates[0];
        let first_cfg = split_config(&first);
        self.enqueue(plan, &gref, &first).map_err(|x| x.to_string())?;
        let want = read(0)?;
        let mut best = (time(&gref, &first)?, 0usize);
        let mut line = format!("{} m={} k={} n={}: #0 {:.3} ms", epilogue_name(&g.epilogue), g.m, g.k, g.n, best.0);
        for (i, algo) in plan.candidates.iter().enumerate().skip(1) {
            if split_config(algo) != first_cfg {
                let _ = write!(line, ", #{i} other split-K/reduction");
                continue;
            }
            if let Err(x) = self.enqueue(plan, &gcand, algo) {
                let _ = write!(line, ", #{i} failed ({x})");
                continue;
            }
            if read(1)? != want {
                let _ = write!(line, ", #{i} other bits");
                continue;
            }
            let ms = time(&gcand, algo)?;
            let _ = write!(line, ", #{i} {ms:.3} ms");
            if ms < best.0 {
                best = (ms, i);
            }
        }
        *plan.algo.lock().expect("plan algorithm poisoned") = plan.candidates[best.1];
        let _ = write!(line, " -> #{}", best.1);
        Ok(line)
    }
}

/// The epilogue's name in tuning reports.
fn epilogue_name(e: &Epilogue) -> &'static str {
    match e {
        Epilogue::None => "gemm",
        Epilogue::Bias { .. } => "gemm+bias",
        Epilogue::GeluAuxBias { .. } => "gemm+bias+gelu",
        Epilogue::DGelu { .. } => "gemm+dgelu",
        Epilogue::BgradB { .. } => "gemm+bgrad",
        Epilogue::BiasF32 { .. } => "gemm+bias32",
    }
}

/// `TESSERA_GPU_TUNE` as (route plain GEMMs through cuBLASLt, tune): unset, empty, `1` or `on`
/// both (the default: tuning keeps the bits); `route` routes without tuning; `0` or `off`
/// neither (plain GEMMs through cuBLAS, the heuristic's first algorithm); anything else is an
/// error.
pub fn tune_requested() -> Result<(bool, bool)> {
    match std::env::var("TESSERA_GPU_TUNE") {
        Err(_) => Ok((true, true)),
        Ok(v) => tune_parse(&v).map_err(|e| GpuError::Invalid(format!("TESSERA_GPU_TUNE: {e}"))),
    }
}

/// A value of `TESSERA_GPU_TUNE` as [`tune_requested`]'s pair (the variable's table,
/// `tessera::env`, checks values with it).
pub fn tune_parse(v: &str) -> std::result::Result<(bool, bool), String> {
    match v.trim() {
        "" | "1" | "on" => Ok((true, true)),
        "0" | "off" => Ok((false, false)),
        "route" => Ok((true, false)),
        other => Err(format!("`{other}` is not 0, 1, on, off or route")),
    }
}
