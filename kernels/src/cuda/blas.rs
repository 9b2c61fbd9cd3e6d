//! cuBLAS GEMMs in row-major terms (the layout of every tensor in Tessera), bf16 or f32 operands,
//! f32 accumulation. One handle per stream; cuBLAS gives the same bits for the same call on the
//! same GPU and stream, which is all our determinism needs from it.

use std::sync::Arc;

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::cublas::CudaBlas;
use cudarc::driver::CudaStream;

use super::{GpuError, Result};

/// Element type of a GEMM operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dt {
    Bf16,
    F32,
}

impl Dt {
    fn cuda(self) -> cudaDataType {
        match self {
            Dt::Bf16 => cudaDataType::CUDA_R_16BF,
            Dt::F32 => cudaDataType::CUDA_R_32F,
        }
    }
}

/// A row-major matrix operand: device address, element type, and whether it is stored transposed.
#[derive(Clone, Copy, Debug)]
pub struct Mat {
    pub ptr: u64,
    pub dt: Dt,
    /// Stored as the transpose of the logical operand (e.g. `W` of shape `[n, k]` used as `[k, n]`).
    pub t: bool,
}

impl Mat {
    pub fn new(ptr: u64, dt: Dt) -> Self {
        Mat { ptr, dt, t: false }
    }
    pub fn tr(ptr: u64, dt: Dt) -> Self {
        Mat { ptr, dt, t: true }
    }
}

/// cuBLAS handles: one for the compute stream, created with the [`super::Gpu`].
pub struct Blas {
    main: CudaBlas,
}

// SAFETY: the handle is only used from the thread that owns the Gpu's context (one per process);
// cudarc marks CudaBlas Send + Sync itself.
unsafe impl Send for Blas {}
unsafe impl Sync for Blas {}

impl Blas {
    pub(crate) fn new(stream: &Arc<CudaStream>) -> Result<Self> {
        // SAFETY: dlopen probe only.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(GpuError::NoLibrary { lib: "cuBLAS (libcublas.so)" });
        }
        let main = CudaBlas::new(stream.clone()).map_err(|e| GpuError::Blas { what: "creating a handle".into(), err: format!("{e:?}") })?;
        Ok(Blas { main })
    }

    /// Gives the handle a workspace of its own (`bytes` at `ptr`), so that its GEMMs never
    /// allocate: what capturing them into a CUDA graph needs.
    ///
    /// # Safety
    /// `ptr` must cover `bytes` bytes of device memory that outlive every use of this handle.
    pub(crate) unsafe fn set_workspace(&self, ptr: u64, bytes: usize) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { cudarc::cublas::sys::cublasSetWorkspace_v2(*self.main.handle(), ptr as *mut _, bytes) }
            .result()
            .map_err(|e| GpuError::Blas { what: "setting a workspace".into(), err: format!("{e:?}") })
    }

    /// Row-major `C[m,n] = op(A)[m,k] · op(B)[k,n]` (C overwritten), accumulating in f32.
    /// `A` is stored `[m,k]` (or `[k,m]` when `a.t`), `B` `[k,n]` (or `[n,k]` when `b.t`).
    pub fn matmul(&self, c: Mat, a: Mat, b: Mat, m: usize, k: usize, n: usize) -> Result<()> {
        self.matmul_beta(c, a, b, (m, k, n), 0.0)
    }

    /// [`Blas::matmul`] adding `beta · C` (`beta = 1`: accumulate into C).
    pub fn matmul_beta(&self, c: Mat, a: Mat, b: Mat, (m, k, n): (usize, usize, usize), beta: f32) -> Result<()> {
        let alpha = 1.0f32;
        assert!(!c.t, "the output of a GEMM is never stored transposed");
        // Row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: swap the operands.
        let op = |t: bool| if t { cublasOperation_t::CUBLAS_OP_T } else { cublasOperation_t::CUBLAS_OP_N };
        let ldb = if b.t { k } else { n };
        let lda = if a.t { m } else { k };
        let i = |x: usize| -> Result<i32> { i32::try_from(x).map_err(|_| GpuError::Invalid(format!("GEMM dimension {x} exceeds i32"))) };
        let (mm, nn, kk, lda, ldb, ldc) = (i(n)?, i(m)?, i(k)?, i(lda)?, i(ldb)?, i(n)?);
        let compute = cublasComputeType_t::CUBLAS_COMPUTE_32F;
        let algo = cublasGemmAlgo_t::CUBLAS_GEMM_DFALT;
        let status = unsafe {
            // SAFETY: the caller's pointers cover the matrices described (checked by the model's
            // wrappers); alpha/beta are f32 as COMPUTE_32F requires.
            cudarc::cublas::sys::cublasGemmEx(
                *self.main.handle(),
                op(b.t),
                op(a.t),
                mm,
                nn,
                kk,
                &alpha as *const f32 as *const _,
                b.ptr as *const _,
                b.dt.cuda(),
                ldb,
                a.ptr as *const _,
                a.dt.cuda(),
                lda,
                &beta as *const f32 as *const _,
                c.ptr as *mut _,
                c.dt.cuda(),
                ldc,
                compute,
                algo,
            )
        };
        status.result().map_err(|e| GpuError::Blas { what: format!("GEMM m={m} k={k} n={n}"), err: format!("{e:?}") })
    }
}

/// One GEMM of a grouped call ([`Blas::matmul_grouped`]): `C[m,n] = op(A)·op(B) + beta·C`, the
/// operands as [`Blas::matmul_beta`] takes them.
#[derive(Clone, Copy, Debug)]
pub struct GemmDesc {
    pub c: Mat,
    pub a: Mat,
    pub b: Mat,
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub beta: f32,
}

/// Whether [`Blas::matmul_grouped`] runs one `cublasGemmGroupedBatchedEx` or a loop of
/// `cublasGemmEx` (the same products; the bits may differ between the two, never between runs
/// of one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupMode {
    Loop,
    Grouped,
}

impl Blas {
    /// Every GEMM of `gs` (their outputs disjoint), as one grouped cuBLAS call or a loop. The
    /// grouped call reads its pointer arrays from `table` (device, ≥ 3·`gs.len()` u64), written
    /// here with a synchronous copy: the caller guarantees no earlier kernel still reads `table`.
    /// Where cuBLAS does not support a grouped call's types, it falls back to the loop. Returns
    /// whether one grouped call ran.
    pub fn matmul_grouped(&self, gs: &[GemmDesc], mode: GroupMode, table: super::DPtr<u64>) -> Result<bool> {
        let each = |gs: &[GemmDesc]| gs.iter().try_for_each(|g| self.matmul_beta(g.c, g.a, g.b, (g.m, g.k, g.n), g.beta)).map(|_| false);
        if mode == GroupMode::Loop || gs.len() <= 1 {
            return each(gs);
        }
        let (a0, b0, c0) = (gs[0].a.dt, gs[0].b.dt, gs[0].c.dt);
        assert!(gs.iter().all(|g| g.a.dt == a0 && g.b.dt == b0 && g.c.dt == c0 && !g.c.t), "a grouped GEMM has one type per operand");
        assert!(table.len >= 3 * gs.len(), "grouped GEMM: pointer table of {} for {} GEMMs", table.len, gs.len());
        let i = |x: usize| -> Result<i32> { i32::try_from(x).map_err(|_| GpuError::Invalid(format!("GEMM dimension {x} exceeds i32"))) };
        let op = |t: bool| if t { cublasOperation_t::CUBLAS_OP_T } else { cublasOperation_t::CUBLAS_OP_N };
        // Column-major with the operands swapped, as in `matmul_beta`.
        let (mut ta, mut tb, mut mm, mut nn, mut kk, mut lda, mut ldb, mut ldc) =
            (vec![], vec![], vec![], vec![], vec![], vec![], vec![], vec![]);
        let mut ptrs = Vec::with_capacity(3 * gs.len());
        for g in gs {
            ta.push(op(g.b.t));
            tb.push(op(g.a.t));
            mm.push(i(g.n)?);
            nn.push(i(g.m)?);
            kk.push(i(g.k)?);
            lda.push(i(if g.b.t { g.k } else { g.n })?);
            ldb.push(i(if g.a.t { g.m } else { g.k })?);
            ldc.push(i(g.n)?);
        }
        ptrs.extend(gs.iter().map(|g| g.b.ptr));
        ptrs.extend(gs.iter().map(|g| g.a.ptr));
        ptrs.extend(gs.iter().map(|g| g.c.ptr));
        let alpha = vec![1.0f32; gs.len()];
        let beta: Vec<f32> = gs.iter().map(|g| g.beta).collect();
        let sizes = vec![1i32; gs.len()];
        let n = gs.len();
        // SAFETY: `table` covers 3·n u64 (asserted) and no kernel reads it now (caller contract).
        unsafe { cudarc::driver::result::memcpy_htod_sync(table.raw, &ptrs) }.map_err(super::drv("uploading a grouped GEMM's pointers"))?;
        let (pa, pb, pc) = (table.raw, table.raw + 8 * n as u64, table.raw + 16 * n as u64);
        let status = unsafe {
            // SAFETY: every host array has n entries; the device pointer arrays hold n pointers
            // each, to matrices the caller's wrappers sized; alpha/beta are f32 for COMPUTE_32F.
            cudarc::cublas::sys::cublasGemmGroupedBatchedEx(
                *self.main.handle(),
                ta.as_ptr(),
                tb.as_ptr(),
                mm.as_ptr(),
                nn.as_ptr(),
                kk.as_ptr(),
                alpha.as_ptr() as *const _,
                pa as *const *const _,
                b0.cuda(),
                lda.as_ptr(),
                pb as *const *const _,
                a0.cuda(),
                ldb.as_ptr(),
                beta.as_ptr() as *const _,
                pc as *const *mut _,
                c0.cuda(),
                ldc.as_ptr(),
                i(n)?,
                sizes.as_ptr(),
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
            )
        };
        use cudarc::cublas::sys::cublasStatus_t as S;
        match status {
            S::CUBLAS_STATUS_SUCCESS => Ok(true),
            S::CUBLAS_STATUS_NOT_SUPPORTED | S::CUBLAS_STATUS_INVALID_VALUE => each(gs),
            e => Err(GpuError::Blas { what: format!("grouped GEMM of {n}"), err: format!("{e:?}") }),
        }
    }
}
