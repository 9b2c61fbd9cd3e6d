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
