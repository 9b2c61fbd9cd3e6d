//! Causal grouped-query attention on the GPU for the LLaMA family (kernels/cuda/gqa_attention.cu):
//! head dimension 64 or 128, `n_kv` key/value heads shared by `nh / n_kv` query heads each, any
//! sequence length, bf16 in and out with f32 arithmetic, deterministic (no atomics; the key/value
//! gradient of a group sums its query heads in ascending order inside one thread).
//!
//! Layout: the grouped projection of [`crate::ops::gqa`]: `qkv` [B, T, C + 2·KV] (q | k | v with
//! KV = n_kv·hd), `y` and `dy` [B, T, C], `lse` and `delta` [B, nh, T] f32 (`lse` in log2 units).
//!
//! Head dimension 64 runs on the tensor-core kernels of [`crate::cuda::attention`] (the GPT-2
//! ones, wgmma on sm_90, mma.sync elsewhere), which take the grouped layout: the dK/dV kernel
//! works per key/value head and adds its group's query heads in ascending order in registers.
//! Head dimension 128 runs FlashAttention-2's loops on CUDA cores (kernels/cuda/gqa_attention.cu:
//! a lane per key, shuffles for the softmax statistics): correct and deterministic, not yet fast.

use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};

use crate::cuda::attention::{self, AttnBackward, AttnShape};
use crate::cuda::{bf16, drv, DPtr, Gpu, GpuError, Result};

/// Head dimensions the GPU runs: 64 on the tensor cores, 128 on the CUDA-core kernels.
pub const HEAD_DIMS: [usize; 2] = [64, 128];
/// The head dimension the CUDA-core kernels of gqa_attention.cu are instantiated for.
const CUDA_CORE_HD: usize = 128;
/// Query rows per block (forward, dQ); keys per block (dK/dV).
const ROWS: usize = 16;
const KEYS: usize = 32;
const THREADS: u32 = 128;

/// The shape of one attention call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GqaShape {
    pub b: usize,
    pub t: usize,
    /// Query heads.
    pub nh: usize,
    /// Key/value heads (divides `nh`).
    pub nkv: usize,
    pub hd: usize,
}

impl GqaShape {
    /// Head dimension 64 goes to the tensor-core kernels, in their shape.
    fn tensor_cores(&self) -> Option<AttnShape> {
        (self.hd == attention::HEAD_DIM).then_some(AttnShape { b: self.b, t: self.t, c: self.c(), nh: self.nh, nkv: self.nkv })
    }
    /// Model width (the q columns and `y`'s row).
    pub fn c(&self) -> usize {
        self.nh * self.hd
    }
    /// Width of a grouped qkv row.
    pub fn row(&self) -> usize {
        (self.nh + 2 * self.nkv) * self.hd
    }

    /// Checks the kernels can run this shape; the error names what is wrong.
    pub fn validate(&self) -> Result<()> {
        let s = self;
        if !HEAD_DIMS.contains(&s.hd) {
            return Err(GpuError::Invalid(format!(
                "grouped-query attention: head dimension {} is not supported on the GPU (64 or 128)",
                s.hd
            )));
        }
        if s.nkv == 0 || s.nh % s.nkv != 0 {
            return Err(GpuError::Invalid(format!(
                "grouped-query attention: {} key/value heads do not divide {} query heads",
                s.nkv, s.nh
            )));
        }
        if s.b * s.nh > 65535 || s.t.div_ceil(ROWS) > i32::MAX as usize {
            return Err(GpuError::Invalid(format!("grouped-query attention: B·nh = {} or T = {} exceeds the grid", s.b * s.nh, s.t)));
        }
        if s.t > i32::MAX as usize || s.row() > i32::MAX as usize {
            return Err(GpuError::Invalid(format!("grouped-query attention: T={} or row {} exceeds 32-bit indices", s.t, s.row())));
        }
        Ok(())
    }
}

fn check_len<T>(what: &str, name: &str, p: &DPtr<T>, want: usize) -> Result<()> {
    if p.len != want {
        return Err(GpuError::Invalid(format!("{what}: `{name}` has {} elements, expected {want}", p.len)));
    }
    if p.raw % 4 != 0 {
        return Err(GpuError::Invalid(format!("{what}: `{name}` at {:#x} is not 4-byte aligned", p.raw)));
    }
    Ok(())
}

fn scales(hd: usize) -> (f32, f32) {
    let scale = 1.0 / (hd as f32).sqrt();
    (scale, scale * std::f32::consts::LOG2_E)
}

fn cfg(blocks_x: usize, blocks_y: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (blocks_x as u32, blocks_y as u32, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }
}

/// y = softmax(q kᵀ/√hd + causal mask) v per query head (its group's key/value head); saves the
/// per-row log-sum-exp of the scaled scores in log2 units.
pub fn forward(gpu: &Gpu, st: &CudaStream, y: DPtr<bf16>, lse: DPtr<f32>, qkv: DPtr<bf16>, s: GqaShape) -> Result<()> {
    const W: &str = "gqa attention forward";
    s.validate()?;
    if let Some(shape) = s.tensor_cores() {
        return attention::attention_forward(gpu, st, y, lse, qkv, shape);
    }
    debug_assert_eq!(s.hd, CUDA_CORE_HD);
    let n = s.b * s.t;
    check_len(W, "y", &y, n * s.c())?;
    check_len(W, "lse", &lse, s.b * s.nh * s.t)?;
    check_len(W, "qkv", &qkv, n * s.row())?;
    if n == 0 {
        return Ok(());
    }
    let (_, scale_log2) = scales(s.hd);
    let (t, c, nh, nkv) = (s.t as i32, s.c() as i32, s.nh as i32, s.nkv as i32);
    let name = format!("gqa_fwd_{}", s.hd);
    let f = gpu.func("gqa_attention", &name)?;
    let mut lb = st.launch_builder(&f);
    lb.arg(&y.raw).arg(&lse.raw).arg(&qkv.raw).arg(&t).arg(&c).arg(&nh).arg(&nkv).arg(&scale_log2);
    // SAFETY: lengths and alignment checked above; the kernel stays inside rows < T.
    unsafe { lb.launch(cfg(s.t.div_ceil(ROWS), s.b * s.nh)) }.map_err(drv(format!("launching {name}")))?;
    Ok(())
}

/// Writes (not accumulates) dqkv in qkv's layout from dy; `delta` [B, nh, T] is scratch for
/// rowsum(dy∘y) (written by the dQ kernel, read by the dK/dV kernel). `y` and `lse` are the
/// forward's for the same `qkv`.
// Allowed: the buffers of the backward (as the GPT kernels' `attention_backward`) plus the shape.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    gpu: &Gpu,
    st: &CudaStream,
    dqkv: DPtr<bf16>,
    delta: DPtr<f32>,
    dy: DPtr<bf16>,
    qkv: DPtr<bf16>,
    y: DPtr<bf16>,
    lse: DPtr<f32>,
    s: GqaShape,
) -> Result<()> {
    const W: &str = "gqa attention backward";
    s.validate()?;
    if let Some(shape) = s.tensor_cores() {
        return attention::attention_backward(gpu, st, &AttnBackward { dqkv, delta, dy, qkv, y, lse }, shape);
    }
    debug_assert_eq!(s.hd, CUDA_CORE_HD);
    let n = s.b * s.t;
    check_len(W, "dqkv", &dqkv, n * s.row())?;
    check_len(W, "qkv", &qkv, n * s.row())?;
    check_len(W, "dy", &dy, n * s.c())?;
    check_len(W, "y", &y, n * s.c())?;
    check_len(W, "lse", &lse, s.b * s.nh * s.t)?;
    check_len(W, "delta", &delta, s.b * s.nh * s.t)?;
    if n == 0 {
        return Ok(());
    }
    let (scale, scale_log2) = scales(s.hd);
    let (t, c, nh, nkv) = (s.t as i32, s.c() as i32, s.nh as i32, s.nkv as i32);
    let name = format!("gqa_bwd_dq_{}", s.hd);
    let f = gpu.func("gqa_attention", &name)?;
    let mut lb = st.launch_builder(&f);
    lb.arg(&dqkv.raw).arg(&delta.raw).arg(&dy.raw).arg(&qkv.raw).arg(&y.raw).arg(&lse.raw);
    lb.arg(&t).arg(&c).arg(&nh).arg(&nkv).arg(&scale).arg(&scale_log2);
    // SAFETY: as in `forward`; the dQ kernel writes only the q columns of dqkv.
    unsafe { lb.launch(cfg(s.t.div_ceil(ROWS), s.b * s.nh)) }.map_err(drv(format!("launching {name}")))?;
    let name = format!("gqa_bwd_dkdv_{}", s.hd);
    let f = gpu.func("gqa_attention", &name)?;
    let mut lb = st.launch_builder(&f);
    lb.arg(&dqkv.raw).arg(&dy.raw).arg(&qkv.raw).arg(&lse.raw).arg(&delta.raw);
    lb.arg(&t).arg(&c).arg(&nh).arg(&nkv).arg(&scale).arg(&scale_log2);
    // SAFETY: as above; the dK/dV kernel writes only the k and v columns, after the dQ kernel
    // (same stream) has written delta.
    unsafe { lb.launch(cfg(s.t.div_ceil(KEYS), s.b * s.nkv)) }.map_err(drv(format!("launching {name}")))?;
    Ok(())
}
