//! The LLaMA family's non-GEMM, non-attention kernels (sources in `kernels/cuda/llama.cu`):
//! token embedding without positions, RMSNorm, RoPE and SwiGLU, forward and backward.
//!
//! Conventions as in [`crate::cuda::ops`]: bf16 activations and parameters, an f32 residual
//! stream and f32 gradients; every wrapper checks its buffers' lengths (a mismatch is a caller
//! bug: it panics naming expected and got) and launches on the given stream. No atomics; every
//! reduction runs in an order fixed by the shapes alone.

use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};

use crate::cuda::ops::{colsum_blocks, colsum_finish, colsum_rows_per};
use crate::cuda::{bf16, drv, grid_1d, DPtr, Gpu, Result};

/// Launches `llama.cu` kernel `$name` on stream `$s`; arguments must be places.
macro_rules! launch {
    ($gpu:expr, $s:expr, $name:literal, $cfg:expr; $($a:expr),* $(,)?) => {{
        let f = $gpu.func("llama", $name)?;
        let mut lb = $s.launch_builder(&f);
        $( lb.arg(&$a); )*
        // SAFETY: the argument list matches the kernel's parameters in llama.cu (device pointers
        // as u64, `int` as i32, `u64` as u64, `float` as f32), and the wrappers checked every
        // buffer's length against the extents the kernel touches.
        unsafe { lb.launch($cfg) }.map(|_| ()).map_err(drv(concat!("launching llama.cu kernel `", $name, "`")))
    }};
}

/// Threads per block of the elementwise kernels (one element a thread; SwiGLU's 8).
const EW_THREADS: u32 = 256;
/// Threads per block of RoPE (one block a row).
const ROPE_THREADS: u32 = 128;
/// Elements a SwiGLU thread takes (one 16-byte load of each bf16 input).
const SWIGLU_PER_THREAD: usize = 8;
/// Rows (warps) per block of the RMSNorm kernels.
const ROWS_PER_BLOCK: u32 = 8;
/// Threads per block of the weight-gradient column sums (one column a thread).
const COL_THREADS: u32 = 256;

fn i32_of(what: &str, v: usize) -> i32 {
    i32::try_from(v).unwrap_or_else(|_| panic!("{what} = {v} does not fit the kernels' 32-bit index"))
}

fn check_len<T>(what: &str, p: DPtr<T>, want: usize) {
    assert!(p.len == want, "{what}: expected {want} elements, got {}", p.len);
}

/// The vectorised kernels' alignment contract: `p` starts on an `align`-byte boundary (every
/// buffer the GPU models pass is a whole allocation or a row-aligned slice of one).
fn check_align<T>(what: &str, p: DPtr<T>, align: u64) {
    assert!(p.raw % align == 0, "{what}: device pointer {:#x} is not {align}-byte aligned", p.raw);
}

/// RMSNorm rows are read 4 f32 at a time: c a multiple of 4 (the GPU models' widths are
/// multiples of the head dimension).
fn check_rms_width(c: usize) {
    assert!(c % 4 == 0, "rmsnorm: width {c} is not a multiple of 4");
}

fn rows_cfg(n: usize) -> LaunchConfig {
    let blocks = u32::try_from(n.div_ceil(ROWS_PER_BLOCK as usize)).expect("rmsnorm: rows fit the grid");
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (32 * ROWS_PER_BLOCK, 1, 1), shared_mem_bytes: 0 }
}

/// x[r, :] = wte[tokens[r], :] as f32 (`wte` [V, c]). A token id ≥ V gives a NaN row.
pub fn embed_tokens(gpu: &Gpu, s: &CudaStream, x: DPtr<f32>, tokens: DPtr<u32>, wte: DPtr<bf16>, c: usize) -> Result<()> {
    assert!(c > 0 && wte.len % c == 0 && wte.len > 0, "embed_tokens: wte must be [V, c={c}], got {} elements", wte.len);
    check_len("embed_tokens x [n, c]", x, tokens.len * c);
    if tokens.len == 0 {
        return Ok(());
    }
    let (rows, c_i, vocab) = (tokens.len as u64, i32_of("c", c), u32::try_from(wte.len / c).expect("vocabulary fits u32"));
    launch!(gpu, s, "embed_tokens", grid_1d(x.len, EW_THREADS); x.raw, tokens.raw, wte.raw, rows, c_i, vocab)
}

/// out = bf16((x · rstd) · w) with rstd = 1/√(mean(x²) + eps) saved per row
/// ([`crate::ops::rmsnorm::rmsnorm_forward`]). One warp per row.
// Allowed: the CPU op's order (outputs, inputs, shape, eps) plus the GPU and the stream.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_forward(
    gpu: &Gpu,
    s: &CudaStream,
    out: DPtr<bf16>,
    rstd: DPtr<f32>,
    x: DPtr<f32>,
    w: DPtr<bf16>,
    n: usize,
    c: usize,
    eps: f32,
) -> Result<()> {
    check_len("rmsnorm_forward out [n, c]", out, n * c);
    check_len("rmsnorm_forward x [n, c]", x, n * c);
    check_len("rmsnorm_forward rstd [n]", rstd, n);
    check_len("rmsnorm_forward w [c]", w, c);
    check_rms_width(c);
    check_align("rmsnorm_forward x", x, 16);
    check_align("rmsnorm_forward out", out, 8);
    if n == 0 {
        return Ok(());
    }
    let (n_i, c_i) = (i32_of("n", n), i32_of("c", c));
    launch!(gpu, s, "rmsnorm_fwd", rows_cfg(n); out.raw, rstd.raw, x.raw, w.raw, n_i, c_i, eps)
}

/// f32 elements of the scratch [`rmsnorm_backward`] needs.
pub fn rmsnorm_backward_scratch(n: usize, c: usize) -> usize {
    colsum_blocks(n) * c
}

/// One RMSNorm backward ([`crate::ops::rmsnorm::rmsnorm_backward`]): `dx += ` the input
/// gradient of `dout` (f32 [n, c]) with its bf16 copy in `dx_bf16`, and `dw += Σ_rows dout·x·rstd`
/// through `scratch` (≥ [`rmsnorm_backward_scratch`]) in the fixed two-pass column order.
pub struct RmsBackward {
    pub dx: DPtr<f32>,
    pub dx_bf16: DPtr<bf16>,
    pub dw: DPtr<f32>,
    pub dout: DPtr<f32>,
    pub x: DPtr<f32>,
    pub w: DPtr<bf16>,
    pub rstd: DPtr<f32>,
    pub scratch: DPtr<f32>,
    pub n: usize,
    pub c: usize,
}

pub fn rmsnorm_backward(gpu: &Gpu, s: &CudaStream, a: &RmsBackward) -> Result<()> {
    let (n, c) = (a.n, a.c);
    for (what, p) in [("dx", a.dx), ("dout", a.dout), ("x", a.x)] {
        check_len(&format!("rmsnorm_backward {what} [n, c]"), p, n * c);
    }
    check_len("rmsnorm_backward dx_bf16 [n, c]", a.dx_bf16, n * c);
    check_len("rmsnorm_backward dw [c]", a.dw, c);
    check_len("rmsnorm_backward w [c]", a.w, c);
    check_len("rmsnorm_backward rstd [n]", a.rstd, n);
    let need = rmsnorm_backward_scratch(n, c);
    assert!(a.scratch.len >= need, "rmsnorm_backward: scratch needs {need} f32 elements, got {}", a.scratch.len);
    check_rms_width(c);
    for (what, p) in [("dx", a.dx), ("dout", a.dout), ("x", a.x)] {
        check_align(&format!("rmsnorm_backward {what}"), p, 16);
    }
    check_align("rmsnorm_backward dx_bf16", a.dx_bf16, 8);
    if n == 0 || c == 0 {
        return Ok(());
    }
    let (n_i, c_i, rows_per) = (i32_of("n", n), i32_of("c", c), i32_of("rows per block", colsum_rows_per(n)));
    let (dx, dxb, dout, x, w, rstd, scratch) = (a.dx.raw, a.dx_bf16.raw, a.dout.raw, a.x.raw, a.w.raw, a.rstd.raw, a.scratch.raw);
    launch!(gpu, s, "rmsnorm_bwd_dx", rows_cfg(n); dx, dxb, dout, x, w, rstd, n_i, c_i)?;
    let cfg = LaunchConfig {
        grid_dim: (c.div_ceil(COL_THREADS as usize) as u32, colsum_blocks(n) as u32, 1),
        block_dim: (COL_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    launch!(gpu, s, "rmsnorm_bwd_dw_partial", cfg; scratch, dout, x, rstd, n_i, c_i, rows_per)?;
    colsum_finish(gpu, s, a.dw, a.scratch, n, c)
}

/// The cos/sin table of RoPE on the device (the CPU's [`crate::ops::rope::RopeTable`], [t, hd/2]).
pub struct RopeDev {
    pub cos: DPtr<f32>,
    pub sin: DPtr<f32>,
    pub t: usize,
    pub half: usize,
}

/// Rotates (`inverse` false) or counter-rotates (the transpose, for the gradient) in place the
/// first `heads` head vectors of each row of `qkv` ([n, row] bf16; q heads then k heads), the
/// position of row r being r mod t ([`crate::ops::rope::rope_forward_rows`]).
pub fn rope(gpu: &Gpu, s: &CudaStream, qkv: DPtr<bf16>, table: &RopeDev, row: usize, heads: usize, inverse: bool) -> Result<()> {
    let (t, half) = (table.t, table.half);
    check_len("rope cos [t, hd/2]", table.cos, t * half);
    check_len("rope sin [t, hd/2]", table.sin, t * half);
    assert!(row > 0 && qkv.len % row == 0, "rope: qkv of {} elements is not rows of {row}", qkv.len);
    assert!(heads * 2 * half <= row, "rope: {heads} heads of {} exceed rows of {row}", 2 * half);
    assert!(row % 2 == 0 && half % 2 == 0, "rope: row {row} and half head {half} must be even (pairs of bf16 are read at once)");
    check_align("rope qkv", qkv, 4);
    check_align("rope cos", table.cos, 8);
    check_align("rope sin", table.sin, 8);
    let rows = qkv.len / row;
    if rows == 0 || heads == 0 {
        return Ok(());
    }
    let (t_i, row_i, heads_i, half_i) = (i32_of("t", t), i32_of("row", row), i32_of("heads", heads), i32_of("half", half));
    let sign: f32 = if inverse { -1.0 } else { 1.0 };
    // One block a row (rows ≤ 2³¹ − 1: the grid's x limit).
    let blocks = u32::try_from(rows).ok().filter(|&b| b <= i32::MAX as u32).expect("rope: rows fit the grid");
    let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (ROPE_THREADS, 1, 1), shared_mem_bytes: 0 };
    launch!(gpu, s, "rope_rotate", cfg; qkv.raw, table.cos.raw, table.sin.raw, t_i, row_i, heads_i, half_i, sign)
}

/// out = bf16((gate · σ(gate)) · up) elementwise ([`crate::ops::swiglu::swiglu_forward`]).
pub fn swiglu_forward(gpu: &Gpu, s: &CudaStream, out: DPtr<bf16>, gate: DPtr<bf16>, up: DPtr<bf16>) -> Result<()> {
    check_len("swiglu_forward gate", gate, out.len);
    check_len("swiglu_forward up", up, out.len);
    for (what, p) in [("out", out), ("gate", gate), ("up", up)] {
        check_align(&format!("swiglu_forward {what}"), p, 16);
    }
    if out.len == 0 {
        return Ok(());
    }
    let len = out.len as u64;
    launch!(gpu, s, "swiglu_fwd", grid_1d(out.len.div_ceil(SWIGLU_PER_THREAD), EW_THREADS); out.raw, gate.raw, up.raw, len)
}

/// dgate, dup = the SwiGLU gradients of `dout` ([`crate::ops::swiglu::swiglu_backward`]),
/// written (not accumulated) as bf16.
pub fn swiglu_backward(
    gpu: &Gpu,
    s: &CudaStream,
    dgate: DPtr<bf16>,
    dup: DPtr<bf16>,
    dout: DPtr<bf16>,
    gate: DPtr<bf16>,
    up: DPtr<bf16>,
) -> Result<()> {
    for (what, p) in [("dup", dup), ("dout", dout), ("gate", gate), ("up", up)] {
        check_len(&format!("swiglu_backward {what}"), p, dgate.len);
    }
    for (what, p) in [("dgate", dgate), ("dup", dup), ("dout", dout), ("gate", gate), ("up", up)] {
        check_align(&format!("swiglu_backward {what}"), p, 16);
    }
    if dgate.len == 0 {
        return Ok(());
    }
    let len = dgate.len as u64;
    let cfg = grid_1d(dgate.len.div_ceil(SWIGLU_PER_THREAD), EW_THREADS);
    launch!(gpu, s, "swiglu_bwd", cfg; dgate.raw, dup.raw, dout.raw, gate.raw, up.raw, len)
}
