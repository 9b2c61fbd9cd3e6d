//! cuBLASLt GEMMs with fused epilogues, in row-major terms like [`super::blas`]: the bias add,
//! GELU keeping its pre-activation, dGELU with the bias gradient, the bias gradient of the `B`
//! operand of a weight-gradient GEMM, and a residual input (`out = A·B + bias + residual`).
//! Each fusion removes one pass of an elementwise kernel over an activation.
//!
//! Determinism: the algorithm for a GEMM is the first one cuBLASLt's heuristic returns for its
//! shape, types, epilogue and operand alignments, asked once and cached; the same call then
//! runs the same algorithm every time (no autotuning by timing, which could differ between runs
//! or ranks). cuBLASLt's reductions (split-K included) run in a fixed order.
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

/// What the GEMM does after the product. Pointers are device addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Epilogue {
    /// `out = A·B (+ residual)`.
    None,
    /// `out = A·B + bias[n]` (bf16 bias) (+ residual).
    Bias { bias: u64 },
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
        }
    }
    fn code(&self) -> sys::cublasLtEpilogue_t {
        use sys::cublasLtEpilogue_t as E;
        match self {
            Epilogue::None => E::CUBLASLT_EPILOGUE_DEFAULT,
            Epilogue::Bias { .. } => E::CUBLASLT_EPILOGUE_BIAS,
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
            Epilogue::BgradB { dbias } => Some((dbias, Dt::F32)),
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
    algo: sys::cublasLtMatmulAlgo_t,
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
    /// Builds the descriptors for `g` and asks the heuristic for an algorithm.
    fn new(handle: sys::cublasLtHandle_t, g: &Gemm, key: &Key) -> Result<Plan> {
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
        let mut plan = Plan { desc, a: la, b: lb, c: lc, d: ld, algo: unsafe { std::mem::zeroed() } };
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
        let pref = lt::create_matmul_pref().map_err(lt_err("creating matmul preferences"))?;
        let chosen = (|| -> Result<sys::cublasLtMatmulHeuristicResult_t> {
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
                lt::get_matmul_algo_heuristic(handle, desc, la, lb, lc, ld, pref).map_err(lt_err(format!(
                    "no cuBLASLt algorithm for {:?} m={} k={} n={}",
                    g.epilogue.code(),
                    g.m,
                    g.k,
                    g.n
                )))
            }
        })();
        // SAFETY: created above, destroyed once.
        unsafe {
            let _ = lt::destroy_matmul_pref(pref);
        }
        let h = chosen?;
        if h.workspaceSize > WORKSPACE_BYTES {
            return Err(GpuError::Blas { what: "cuBLASLt heuristic".into(), err: format!("wants {} workspace bytes", h.workspaceSize) });
        }
        plan.algo = h.algo;
        Ok(plan)
    }
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
        let handle = lt::create_handle().map_err(lt_err("creating a cuBLASLt handle"))?;
        // SAFETY: the workspace is only handed to cuBLASLt, never read as typed data.
        let workspace = unsafe { stream.alloc::<u8>(WORKSPACE_BYTES) }.map_err(drv("allocating the cuBLASLt workspace"))?;
        let workspace_ptr = super::raw_ptr(&workspace, stream);
        Ok(Some(Lt { handle, stream: stream.clone(), workspace, workspace_ptr, plans: Mutex::new(HashMap::new()), call: Mutex::new(()) }))
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
        let p = Arc::new(Plan::new(self.handle, g, &key)?);
        plans.insert(key, p.clone());
        Ok(p)
    }

    /// Whether cuBLASLt has an algorithm for `g` (plans it; nothing runs).
    pub fn supports(&self, g: &Gemm) -> bool {
        self.plan(g).is_ok()
    }

    /// Enqueues `g` on the handle's stream.
    pub fn run(&self, g: &Gemm) -> Result<()> {
        assert!(!g.c.t, "the output of a GEMM is never stored transposed");
        if let Some(r) = g.residual {
            assert!(!r.t && r.dt == g.c.dt, "a residual input has the output's type and layout");
        }
        let plan = self.plan(g)?;
        let (alpha, beta) = (1.0f32, if g.residual.is_some() { 1.0f32 } else { 0.0 });
        let cptr = g.residual.map_or(g.c.ptr, |r| r.ptr);
        let _call = self.call.lock().expect("cuBLASLt call lock poisoned");
        // SAFETY: the caller's pointers cover the matrices and vectors described (checked by the
        // model's wrappers); the plan's descriptors match `g` (same key); alpha/beta are f32 as
        // the scale type requires; the workspace is ours and large enough for the algorithm.
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
                &plan.algo,
                self.workspace_ptr as *mut c_void,
                WORKSPACE_BYTES,
                self.stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(lt_err(format!("cuBLASLt GEMM {:?} m={} k={} n={}", g.epilogue.code(), g.m, g.k, g.n)))
    }
}
