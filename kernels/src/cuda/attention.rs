//! Fused causal attention on the GPU (kernels/cuda/attention.cu): FlashAttention-2 style forward
//! and a deterministic backward (no atomics; fixed loop orders), bf16 in/out with f32 accumulation
//! on tensor cores (mma.sync m16n8k16). On sm_90 (H100/H200) the default kernels are the Hopper
//! ones of kernels/cuda/attention_wg.cu (module `attention_wg`, compiled for sm_90a): the same
//! loops on warpgroup MMAs (wgmma m64n64k16, operands read by the tensor cores from swizzled shared
//! memory), which give the same bits as the mma.sync kernels (`gpu check` compares them) and took
//! ~1.5 ms off a 31 ms GPT-2 124M step on an H200. `TESSERA_ATTN_FWD` / `TESSERA_ATTN_BWD` pick
//! the kernels by name (see [`FWD_KERNELS`], [`BWD_LAYOUTS`]).
//!
//! Layout as in [`crate::ops::attention`]: `qkv` [B, T, 3C] (q | k | v, head h at cols h·hd of
//! each part), `y` and `dy` [B, T, C], `lse` and `delta` [B, NH, T] f32 (`lse` in log2 units). Head dim 64 only.
//! Grouped-query attention (`nkv` < `nh` key/value heads, the LLaMA family) runs on the same
//! kernels in the grouped layout of [`crate::ops::gqa`]: `qkv` [B, T, C + 2·KV] (q | k | v, KV =
//! nkv·hd), query head h reading key/value head h / (nh / nkv). The dK/dV kernel then works per
//! key/value head and adds its group's query heads in ascending order in registers: no atomics,
//! deterministic, and with `nkv = nh` the loops (and bits) of multi-head attention.
//!
//! Precision: by default P and dS go through the tensor cores as plain bf16 (one mma per product)
//! and the backward takes delta = rowsum(dy∘y) from the bf16 `y`, as FlashAttention-2 / PyTorch
//! do: about 2.5e-3 rms-relative error on y, dq, dk, dv. Setting the environment variable
//! `TESSERA_ATTN_PRECISE=1` (read once per process, at the first attention call) selects the
//! `_precise` kernels instead: P and dS as two bf16 halves (hi + lo remainder, two mmas per product)
//! and delta = rowsum(P∘dP) in f32, which keeps the outputs at f32-reference accuracy for ~15% more
//! time.

use std::sync::OnceLock;
use std::time::Instant;

use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};

use super::{bf16, drv, CheckRow, DPtr, Gpu, GpuError, Result};

/// The only head dimension the kernels support.
pub const HEAD_DIM: usize = 64;
/// Rows per tile (queries per CTA in the forward and dQ kernels, keys per CTA in dK/dV).
pub const TILE: usize = 64;
const THREADS: u32 = 128;

/// The shape of one attention call: `b` sequences of `t` tokens, `c` channels split into `nh`
/// query heads (of [`HEAD_DIM`] each), and `nkv` key/value heads (`nkv = nh`: multi-head
/// attention; fewer: grouped-query attention, `nkv` dividing `nh`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    pub b: usize,
    pub t: usize,
    pub c: usize,
    pub nh: usize,
    pub nkv: usize,
}

impl AttnShape {
    /// Multi-head attention: as many key/value heads as query heads.
    pub fn mha(b: usize, t: usize, c: usize, nh: usize) -> AttnShape {
        AttnShape { b, t, c, nh, nkv: nh }
    }
    /// Elements of one qkv row: C + 2·nkv·hd (3C for multi-head attention).
    pub fn row(&self) -> usize {
        self.c + 2 * self.nkv * HEAD_DIM
    }
}

/// The buffers of [`attention_backward`]: it writes `dqkv` [B, T, row] and uses `delta`
/// [B, nh, T] as scratch; it reads `dy` [B, T, C], the forward's input `qkv` [B, T, row] (row =
/// [`AttnShape::row`]), output `y` [B, T, C] and log-sum-exp `lse` [B, nh, T].
#[derive(Clone, Copy)]
pub struct AttnBackward {
    pub dqkv: DPtr<bf16>,
    pub delta: DPtr<f32>,
    pub dy: DPtr<bf16>,
    pub qkv: DPtr<bf16>,
    pub y: DPtr<bf16>,
    pub lse: DPtr<f32>,
}

/// Validates the shape; returns hd.
fn check_shape(what: &str, s: AttnShape) -> Result<usize> {
    let AttnShape { b, t, c, nh, nkv } = s;
    if nh == 0 || c == 0 || c % nh != 0 {
        return Err(GpuError::Invalid(format!("{what}: C={c} must be a positive multiple of nh={nh}")));
    }
    if nkv == 0 || nh % nkv != 0 {
        return Err(GpuError::Invalid(format!("{what}: {nkv} key/value heads do not divide {nh} query heads")));
    }
    let hd = c / nh;
    if hd != HEAD_DIM {
        return Err(GpuError::Invalid(format!("{what}: head dim C/nh = {c}/{nh} = {hd} is not supported (only {HEAD_DIM})")));
    }
    if b * nh > 65535 {
        return Err(GpuError::Invalid(format!("{what}: B·nh = {b}·{nh} = {} exceeds the grid limit of 65535", b * nh)));
    }
    if t > i32::MAX as usize || s.row() > i32::MAX as usize {
        return Err(GpuError::Invalid(format!("{what}: T={t} or the qkv row {} exceeds the kernels' 32-bit row/column indices", s.row())));
    }
    Ok(hd)
}

fn check_len<T>(what: &str, name: &str, p: &DPtr<T>, want: usize, shape: &str) -> Result<()> {
    if p.len != want {
        return Err(GpuError::Invalid(format!("{what}: `{name}` has {} elements, expected {want} ({shape})", p.len)));
    }
    Ok(())
}

fn check_align<T>(what: &str, name: &str, p: &DPtr<T>, align: u64) -> Result<()> {
    if p.raw % align != 0 {
        return Err(GpuError::Invalid(format!("{what}: `{name}` at {:#x} is not {align}-byte aligned", p.raw)));
    }
    Ok(())
}

/// Which kernel family runs: plain bf16 P/dS (default) or the split hi+lo one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    Plain,
    Precise,
}

impl Variant {
    /// From `TESSERA_ATTN_PRECISE` (`1` selects [`Variant::Precise`]), read once per process.
    fn from_env() -> Variant {
        static V: OnceLock<Variant> = OnceLock::new();
        *V.get_or_init(
            || if std::env::var("TESSERA_ATTN_PRECISE").is_ok_and(|v| v.trim() == "1") { Variant::Precise } else { Variant::Plain },
        )
    }
}

/// One way to run the backward: its dQ kernel and its dK/dV kernel (the dQ kernel runs first
/// and writes delta), the module they live in, and the number of 16-row blocks a warp owns
/// (queries in dQ, keys in dK/dV).
#[derive(Clone, Copy, Debug)]
struct BwdLayout {
    name: &'static str,
    module: &'static str,
    dq: &'static str,
    dkdv: &'static str,
    rb: usize,
}

/// The plain variant's backward layouts (`TESSERA_ATTN_BWD`, read once per process):
/// - `wg` (default on sm_90: H100/H200): the Hopper kernels of attention_wg.cu, one warpgroup of
///   4 warps per 64 rows on warpgroup MMAs (wgmma) with K/V (dQ) or Q/dY (dK/dV) read by the
///   tensor cores straight from swizzled shared memory;
/// - `r2` (default elsewhere): mma.sync, each warp owns 2 blocks of 16 rows (128 per block of
///   threads), so every fragment read from shared memory feeds two products; S and dP in 4 column
///   pieces of 16 (to fit the registers);
/// - `full`: mma.sync, each warp owns 16 rows and computes S and dP of a whole 64 × 64 tile at
///   once (the layout of the `_precise` kernels).
///
/// All three give the same bits: each element of S, dP, dQ, dK and dV sums the same products in
/// the same order (`wg` through another tensor-core instruction, whose products round as
/// mma.sync's do on an H200); `gpu check` rows compare every layout this GPU runs.
const BWD_LAYOUTS: [BwdLayout; 3] = [
    BwdLayout { name: "wg", module: "attention_wg", dq: "attn_bwd_dq_wg", dkdv: "attn_bwd_dkdv_wg", rb: 1 },
    BwdLayout { name: "r2", module: "attention", dq: "attn_bwd_dq_r2", dkdv: "attn_bwd_dkdv_r2", rb: 2 },
    BwdLayout { name: "full", module: "attention", dq: "attn_bwd_dq", dkdv: "attn_bwd_dkdv", rb: 1 },
];

/// The `_precise` kernels (16 rows a warp, whole tiles).
const PRECISE_LAYOUT: BwdLayout =
    BwdLayout { name: "precise", module: "attention", dq: "attn_bwd_dq_precise", dkdv: "attn_bwd_dkdv_precise", rb: 1 };

/// One forward kernel: (name, module, function).
#[derive(Clone, Copy, Debug)]
struct FwdKernel {
    name: &'static str,
    module: &'static str,
    func: &'static str,
}

/// The plain variant's forward kernels (`TESSERA_ATTN_FWD`, read once per process): `wg` (default
/// on sm_90), the warpgroup-MMA kernel of attention_wg.cu, and `mma` (default elsewhere), the
/// mma.sync one. Both give the same bits (a `gpu check` row compares them).
const FWD_KERNELS: [FwdKernel; 2] = [
    FwdKernel { name: "wg", module: "attention_wg", func: "attn_fwd_wg" },
    FwdKernel { name: "mma", module: "attention", func: "attn_fwd" },
];

/// The names `TESSERA_ATTN_FWD` takes (the variable's table, `tessera::env`, checks values
/// against them).
pub fn fwd_names() -> Vec<&'static str> {
    FWD_KERNELS.iter().map(|k| k.name).collect()
}

/// The names `TESSERA_ATTN_BWD` takes.
pub fn bwd_names() -> Vec<&'static str> {
    BWD_LAYOUTS.iter().map(|l| l.name).collect()
}

/// Whether `module`'s kernels can run on this GPU (the Hopper ones need sm_90).
fn runs_on(gpu: &Gpu, module: &str) -> bool {
    super::module_runs_on(module, gpu.cc)
}

/// A layout switch's value, read once per process (`None` when unset).
fn switch(cell: &'static OnceLock<std::result::Result<Option<String>, String>>, var: &str) -> Result<Option<&'static str>> {
    match cell.get_or_init(|| match std::env::var(var) {
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(e) => Err(format!("{var}: {e}")),
        Ok(v) => Ok(Some(v.trim().to_string())),
    }) {
        Ok(v) => Ok(v.as_deref()),
        Err(e) => Err(GpuError::Invalid(e.clone())),
    }
}

/// Picks the entry named by `var` (or the first one that runs on this GPU when unset); a name that
/// is no entry, or one this GPU cannot run, is an error, not ignored.
fn pick<T: Copy>(
    gpu: &Gpu,
    var: &str,
    chosen: Option<&str>,
    all: &[T],
    name: impl Fn(&T) -> &'static str,
    module: impl Fn(&T) -> &'static str,
) -> Result<T> {
    match chosen {
        None => Ok(*all.iter().find(|k| runs_on(gpu, module(k))).expect("a portable kernel is always listed")),
        Some(n) => {
            let k = all.iter().find(|k| name(k) == n).copied().ok_or_else(|| {
                let names: Vec<&str> = all.iter().map(&name).collect();
                GpuError::Invalid(format!("{var}={n:?} names no attention kernel (expected one of {names:?})"))
            })?;
            if !runs_on(gpu, module(&k)) {
                return Err(GpuError::Invalid(format!(
                    "{var}={n}: those kernels need an sm_90 GPU (H100/H200); this one is {}",
                    gpu.arch()
                )));
            }
            Ok(k)
        }
    }
}

/// The layout of [`attention_backward`]: the precise one under `TESSERA_ATTN_PRECISE=1`, else
/// `TESSERA_ATTN_BWD`'s (when unset, `wg` on sm_90 and `r2` elsewhere).
fn bwd_layout(gpu: &Gpu, variant: Variant) -> Result<BwdLayout> {
    static P: OnceLock<std::result::Result<Option<String>, String>> = OnceLock::new();
    match variant {
        Variant::Precise => Ok(PRECISE_LAYOUT),
        Variant::Plain => pick(gpu, "TESSERA_ATTN_BWD", switch(&P, "TESSERA_ATTN_BWD")?, &BWD_LAYOUTS, |l| l.name, |l| l.module),
    }
}

/// The kernel of [`attention_forward`]: the precise one under `TESSERA_ATTN_PRECISE=1`, else
/// `TESSERA_ATTN_FWD`'s (when unset, `wg` on sm_90 and `mma` elsewhere).
fn fwd_kernel(gpu: &Gpu, variant: Variant) -> Result<FwdKernel> {
    static F: OnceLock<std::result::Result<Option<String>, String>> = OnceLock::new();
    match variant {
        Variant::Precise => Ok(FwdKernel { name: "precise", module: "attention", func: "attn_fwd_precise" }),
        Variant::Plain => pick(gpu, "TESSERA_ATTN_FWD", switch(&F, "TESSERA_ATTN_FWD")?, &FWD_KERNELS, |k| k.name, |k| k.module),
    }
}

/// One block of threads per `TILE · rb` rows of each (b, head): query heads (forward, dQ) or
/// key/value heads (dK/dV).
fn tiles_cfg(t: usize, b: usize, heads: usize, rb: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (t.div_ceil(TILE * rb) as u32, (b * heads) as u32, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }
}

fn scales(hd: usize) -> (f32, f32) {
    let scale = 1.0 / (hd as f32).sqrt();
    (scale, scale * std::f32::consts::LOG2_E)
}

/// y = softmax(q kᵀ/√hd + causal mask) v per head; saves the per-row log-sum-exp of the scaled
/// scores for backward, in log2 units (`lse · ln 2` is the natural log-sum-exp).
/// `y` is [B, T, C], `lse` [B, nh, T], `qkv` [B, T, row] ([`AttnShape::row`]).
pub fn attention_forward(gpu: &Gpu, stream: &CudaStream, y: DPtr<bf16>, lse: DPtr<f32>, qkv: DPtr<bf16>, shape: AttnShape) -> Result<()> {
    let variant = Variant::from_env();
    forward_kernel(fwd_kernel(gpu, variant)?, gpu, stream, y, lse, qkv, shape)
}

/// [`attention_forward`] with the kernel given.
fn forward_kernel(
    kernel: FwdKernel,
    gpu: &Gpu,
    stream: &CudaStream,
    y: DPtr<bf16>,
    lse: DPtr<f32>,
    qkv: DPtr<bf16>,
    shape: AttnShape,
) -> Result<()> {
    let AttnShape { b, t, c, nh, nkv } = shape;
    const W: &str = "attention_forward";
    let hd = check_shape(W, shape)?;
    check_len(W, "y", &y, b * t * c, "[B, T, C]")?;
    check_len(W, "lse", &lse, b * nh * t, "[B, nh, T]")?;
    check_len(W, "qkv", &qkv, b * t * shape.row(), "[B, T, C + 2·nkv·hd]")?;
    check_align(W, "qkv", &qkv, 16)?;
    check_align(W, "y", &y, 4)?;
    if b == 0 || t == 0 {
        return Ok(());
    }
    let (_, scale_log2) = scales(hd);
    let (t_i, c_i, nh_i, nkv_i) = (t as i32, c as i32, nh as i32, nkv as i32);
    let name = kernel.func;
    let f = gpu.func(kernel.module, name)?;
    let mut lb = stream.launch_builder(&f);
    lb.arg(&y.raw).arg(&lse.raw).arg(&qkv.raw).arg(&t_i).arg(&c_i).arg(&nh_i).arg(&nkv_i).arg(&scale_log2);
    // SAFETY: lengths and alignment checked above; the kernel stays inside [B, T, ·] rows.
    unsafe { lb.launch(tiles_cfg(t, b, nh, 1)) }.map_err(drv(format!("launching {name}")))?;
    Ok(())
}

/// Writes (not accumulates) dqkv [b, t, row] (the key/value gradient of a group summed over its
/// query heads). `delta` is scratch [b, nh, t] (f32) for rowsum(dy∘y).
///
/// By default `delta` = rowsum(dy∘y) from the bf16 `y` (the forward's output for the same `qkv`),
/// computed by the dQ kernel for its own rows. With `TESSERA_ATTN_PRECISE=1` it is rowsum(P∘dP)
/// in f32 (equal to rowsum(dy∘o) for the exact f32 output o) and `y` is checked but not read.
pub fn attention_backward(gpu: &Gpu, stream: &CudaStream, bufs: &AttnBackward, shape: AttnShape) -> Result<()> {
    let variant = Variant::from_env();
    backward_layout(bwd_layout(gpu, variant)?, gpu, stream, bufs, shape)
}

/// [`attention_backward`] with the kernels given.
fn backward_layout(layout: BwdLayout, gpu: &Gpu, stream: &CudaStream, bufs: &AttnBackward, shape: AttnShape) -> Result<()> {
    let AttnShape { b, t, c, nh, nkv } = shape;
    let AttnBackward { dqkv, delta, dy, qkv, y, lse } = *bufs;
    const W: &str = "attention_backward";
    let hd = check_shape(W, shape)?;
    let row = shape.row();
    check_len(W, "dqkv", &dqkv, b * t * row, "[B, T, C + 2·nkv·hd]")?;
    check_len(W, "delta", &delta, b * nh * t, "[B, nh, T]")?;
    check_len(W, "dy", &dy, b * t * c, "[B, T, C]")?;
    check_len(W, "qkv", &qkv, b * t * row, "[B, T, C + 2·nkv·hd]")?;
    check_len(W, "y", &y, b * t * c, "[B, T, C]")?;
    check_len(W, "lse", &lse, b * nh * t, "[B, nh, T]")?;
    check_align(W, "qkv", &qkv, 16)?;
    check_align(W, "dy", &dy, 16)?;
    check_align(W, "y", &y, 4)?;
    check_align(W, "dqkv", &dqkv, 4)?;
    if b == 0 || t == 0 {
        return Ok(());
    }
    let (scale, scale_log2) = scales(hd);
    let (t_i, c_i, nh_i, nkv_i) = (t as i32, c as i32, nh as i32, nkv as i32);

    // dQ and delta first (one pass over keys, per query head), then dK/dV (per key/value head),
    // which read delta.
    let f = gpu.func(layout.module, layout.dq)?;
    let mut lb = stream.launch_builder(&f);
    lb.arg(&dqkv.raw).arg(&delta.raw).arg(&dy.raw).arg(&qkv.raw).arg(&y.raw).arg(&lse.raw);
    lb.arg(&t_i).arg(&c_i).arg(&nh_i).arg(&nkv_i).arg(&scale).arg(&scale_log2);
    // SAFETY: lengths and alignment checked above (y is read with 4-byte loads); rows ≥ T are never read or written.
    unsafe { lb.launch(tiles_cfg(t, b, nh, layout.rb)) }.map_err(drv(format!("launching {}", layout.dq)))?;

    let f = gpu.func(layout.module, layout.dkdv)?;
    let mut lb = stream.launch_builder(&f);
    lb.arg(&dqkv.raw).arg(&dy.raw).arg(&qkv.raw).arg(&lse.raw).arg(&delta.raw);
    lb.arg(&t_i).arg(&c_i).arg(&nh_i).arg(&nkv_i).arg(&scale).arg(&scale_log2);
    // SAFETY: as above; dQ columns (written by the dQ kernel) are not touched.
    unsafe { lb.launch(tiles_cfg(t, b, nkv, layout.rb)) }.map_err(drv(format!("launching {}", layout.dkdv)))?;
    Ok(())
}

fn round_bf16(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

fn to_f32(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// The q (`part` 0), k (1) or v (2) columns of every row of a [rows, C + 2·KV] qkv matrix.
fn part_cols(m: &[f32], shape: AttnShape, part: usize) -> Vec<f32> {
    let (c, kv) = (shape.c, shape.nkv * HEAD_DIM);
    let (lo, hi) = [(0, c), (c, c + kv), (c + kv, c + 2 * kv)][part];
    m.chunks_exact(shape.row()).flat_map(|row| row[lo..hi].iter().copied()).collect()
}

/// rms(x) = sqrt(mean(x²)) (0 for an empty slice).
fn rms(x: &[f32]) -> f64 {
    if x.is_empty() {
        return 0.0;
    }
    (x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / x.len() as f64).sqrt()
}

/// The rows for one bf16-attention output under the default (plain bf16 P/dS) kernels:
/// - `rms-rel`: rms(gpu − cpu) / rms(cpu) ≤ 2e-2 (norm-wise error; bf16 attention gives ~2.5e-3,
///   a perfectly rounded bf16 output ~1.7e-3);
/// - `max-rel, floor rms`: max |gpu − cpu| / (|cpu| + rms(cpu)) ≤ 1e-1 ([`CheckRow::compare`] with
///   floor = rms(cpu)). A CPU emulation of the kernels' bf16 roundings on random N(0,1) inputs at
///   t=1024 reaches up to ~5.6e-2 on this one (single bf16-rounded P entries of O(1) size), so 2e-2
///   would fail without a bug; an indexing/mask bug gives O(1).
fn plain_rows(name: &str, gpu: &[f32], cpu: &[f32]) -> [CheckRow; 2] {
    const TOL_RMS: f64 = 2e-2;
    const TOL_MAX: f64 = 1e-1;
    let r = rms(cpu);
    let diff: Vec<f32> = gpu.iter().zip(cpu).map(|(&g, &c)| g - c).collect();
    let mut rel = CheckRow::compare(format!("{name} rms-rel [rms(cpu)={r:.2e}]"), gpu, cpu, r, TOL_RMS);
    // compare() gives max_abs and non_finite; max_rel becomes the norm-wise rms ratio (NaN-free
    // because non-finite GPU values fail the row anyway).
    let finite: Vec<f32> = diff.iter().copied().filter(|d| d.is_finite()).collect();
    rel.max_rel = if r > 0.0 { rms(&finite) / r } else { rms(&finite) };
    // A reference that is identically zero (e.g. dq, dk at t = 1) gets an absolute floor.
    let max = CheckRow::compare(format!("{name} max-rel, floor rms"), gpu, cpu, r.max(1e-3), TOL_MAX);
    [rel, max]
}

/// GPU vs CPU (`crate::ops::attention` in f32 on the same bf16-rounded inputs) on fresh random inputs (seeded by `seed`), for a few shapes including t not a multiple of your tile and t=1024: rows for y, lse, dq, dk, dv, plus a bit-identical rerun.
///
/// The default (plain bf16) kernels are checked with rms-relative metrics (see `plain_rows`); when
/// `TESSERA_ATTN_PRECISE=1` is set, the `_precise` kernels are checked as well, with the strict
/// elementwise metric max |gpu − cpu| / (|cpu| + 1e-2) ≤ 2e-2 (rows tagged `precise`).
pub fn check(gpu: &Gpu, seed: u64) -> Result<Vec<CheckRow>> {
    let mut rows = if runs_on(gpu, "attention_wg") { check_wgmma_operands(gpu, seed)? } else { Vec::new() };
    rows.extend(check_variant(gpu, seed, Variant::Plain)?);
    if Variant::from_env() == Variant::Precise {
        rows.extend(check_variant(gpu, seed, Variant::Precise)?);
    }
    Ok(rows)
}

/// The three ways the Hopper kernels feed the tensor cores (attention_wg.cu's `attn_wg_probe`), each
/// on one 64 × 64 × 64 product of random bf16 matrices against the f32 product on the CPU: both
/// operands from shared memory with B K-major (S = Q Kᵀ in the forward), A from registers with B
/// MN-major (O = P V, dQ = dS K, dV, dK), A from registers with B K-major (S, dP in the backward).
/// A descriptor or fragment layout that is wrong gives O(1) errors; the bound leaves room only for
/// the order of f32 additions.
fn check_wgmma_operands(gpu: &Gpu, seed: u64) -> Result<Vec<CheckRow>> {
    use crate::gradcheck::randn;
    const N: usize = 64;
    let a_h = round_bf16(&randn(seed.wrapping_mul(7919).wrapping_add(11), N * N, 1.0));
    let b_h = round_bf16(&randn(seed.wrapping_mul(7919).wrapping_add(12), N * N, 1.0));
    let (a_f, b_f) = (to_f32(&a_h), to_f32(&b_h));
    let a = gpu.upload(&a_h)?;
    let b = gpu.upload(&b_h)?;
    let out = gpu.alloc::<f32>(N * N)?;
    let f = gpu.func("attention_wg", "attn_wg_probe")?;
    let mut rows = Vec::new();
    for (mode, what, b_transposed) in [
        (0i32, "A, B from shared memory, B K-major (a·bᵀ)", true),
        (1, "A from registers, B MN-major (a·b)", false),
        (2, "A from registers, B K-major (a·bᵀ)", true),
    ] {
        let (po, pa, pb) = (out.ptr().raw, a.ptr().raw, b.ptr().raw);
        let mut lb = gpu.stream.launch_builder(&f);
        lb.arg(&po).arg(&pa).arg(&pb).arg(&mode);
        let cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: a, b are 64×64 bf16 and out 64×64 f32, as the probe reads and writes.
        unsafe { lb.launch(cfg) }.map_err(drv("launching attn_wg_probe"))?;
        let got = gpu.download(out.ptr())?;
        let mut want = vec![0f32; N * N];
        for i in 0..N {
            for j in 0..N {
                let mut acc = 0f64;
                for k in 0..N {
                    let bv = if b_transposed { b_f[j * N + k] } else { b_f[k * N + j] };
                    acc += a_f[i * N + k] as f64 * bv as f64;
                }
                want[i * N + j] = acc as f32;
            }
        }
        rows.push(CheckRow::compare(format!("attention wgmma operands: {what} [64×64×64]"), &got, &want, 1.0, 1e-5));
    }
    Ok(rows)
}

/// Strict elementwise metric of the precise kernels (and of lse and the bit-identical rows).
const FLOOR: f64 = 1e-2;
const TOL: f64 = 2e-2;

fn check_variant(gpu: &Gpu, seed: u64, variant: Variant) -> Result<Vec<CheckRow>> {
    use crate::gradcheck::randn;

    // (b, t, c, nh, nkv): multi-head shapes, then grouped-query ones (2 and 4 query heads a
    // key/value head, and one key/value head for all: multi-query attention).
    let shapes: [(usize, usize, usize, usize, usize); 8] = [
        (2, 1, 128, 2, 2),
        (2, 77, 128, 2, 2),
        (1, 200, 192, 3, 3),
        (3, 64, 64, 1, 1),
        (2, 77, 256, 4, 2),
        (1, 200, 512, 8, 2),
        (2, 130, 256, 4, 1),
        (1, 1024, 128, 2, 2),
    ];
    let stream = gpu.stream.clone();
    let mut rows = Vec::new();
    let vtag = match variant {
        Variant::Plain => "",
        Variant::Precise => " precise",
    };
    for (si, &(b, t, c, nh, nkv)) in shapes.iter().enumerate() {
        let shape = AttnShape { b, t, c, nh, nkv };
        let row = shape.row();
        let s = seed.wrapping_mul(1000).wrapping_add(si as u64 * 2);
        let qkv_h = round_bf16(&randn(s, b * t * row, 1.0));
        let dy_h = round_bf16(&randn(s + 1, b * t * c, 1.0));
        let cpu = CpuReference::new(&to_f32(&qkv_h), &to_f32(&dy_h), shape);

        let qkv = gpu.upload(&qkv_h)?;
        let dy = gpu.upload(&dy_h)?;
        let y = gpu.alloc::<bf16>(b * t * c)?;
        let lse = gpu.alloc::<f32>(b * nh * t)?;
        let delta = gpu.alloc::<f32>(b * nh * t)?;
        // Poisoned with NaN bits so an element the backward fails to write shows as non-finite.
        let mut dqkv = gpu.alloc::<bf16>(b * t * row)?;
        gpu.write(&mut dqkv, 0, &vec![bf16::NAN; b * t * row])?;
        let bufs = AttnBackward { dqkv: dqkv.ptr(), delta: delta.ptr(), dy: dy.ptr(), qkv: qkv.ptr(), y: y.ptr(), lse: lse.ptr() };

        let run = || -> Result<()> {
            forward_kernel(fwd_kernel(gpu, variant)?, gpu, &stream, y.ptr(), lse.ptr(), qkv.ptr(), shape)?;
            backward_layout(bwd_layout(gpu, variant)?, gpu, &stream, &bufs, shape)
        };
        run()?;
        let y_gpu = to_f32(&gpu.download(y.ptr())?);
        let dqkv_gpu = to_f32(&gpu.download(dqkv.ptr())?);
        // The kernels keep lse in log2 units.
        let lse_gpu: Vec<f32> = gpu.download(lse.ptr())?.iter().map(|&l| l * std::f32::consts::LN_2).collect();

        let kv = if nkv == nh { String::new() } else { format!(" nkv={nkv}") };
        let tag = format!("[b={b} t={t} c={c} nh={nh}{kv}]{vtag}");
        let outputs: [(String, Vec<f32>, Vec<f32>); 4] = [
            (format!("attention_forward y {tag}"), y_gpu.clone(), cpu.y.clone()),
            (format!("attention_backward dq {tag}"), part_cols(&dqkv_gpu, shape, 0), part_cols(&cpu.dqkv, shape, 0)),
            (format!("attention_backward dk {tag}"), part_cols(&dqkv_gpu, shape, 1), part_cols(&cpu.dqkv, shape, 1)),
            (format!("attention_backward dv {tag}"), part_cols(&dqkv_gpu, shape, 2), part_cols(&cpu.dqkv, shape, 2)),
        ];
        rows.push(CheckRow::compare(format!("attention_forward lse {tag}"), &lse_gpu, &cpu.lse, FLOOR, 1e-3));
        for (name, g, cp) in &outputs {
            match variant {
                Variant::Plain => rows.extend(plain_rows(name, g, cp)),
                Variant::Precise => rows.push(CheckRow::compare(name.clone(), g, cp, FLOOR, TOL)),
            }
        }
        if variant == Variant::Plain {
            rows.extend(same_bits_everywhere(gpu, &bufs, shape, &tag, (&y_gpu, &dqkv_gpu))?);
        }

        // Determinism: a second run must give the same bits (tolerance 0).
        if si == shapes.len() - 1 {
            run()?;
            let y2 = to_f32(&gpu.download(y.ptr())?);
            let d2 = to_f32(&gpu.download(dqkv.ptr())?);
            rows.push(CheckRow::compare(format!("attention_forward rerun bit-identical {tag}"), &y2, &y_gpu, FLOOR, 0.0));
            rows.push(CheckRow::compare(format!("attention_backward rerun bit-identical {tag}"), &d2, &dqkv_gpu, FLOOR, 0.0));
        }
    }
    Ok(rows)
}

/// `crate::ops::attention` in f32 on the bf16-rounded inputs (grouped shapes through
/// `crate::ops::gqa`'s repeat_kv and its group sums, as the CPU model runs them): the output,
/// the input gradient and the natural log-sum-exp of each row's scaled scores.
struct CpuReference {
    y: Vec<f32>,
    dqkv: Vec<f32>,
    lse: Vec<f32>,
}

impl CpuReference {
    fn new(grouped: &[f32], dy_f: &[f32], shape: AttnShape) -> CpuReference {
        use crate::ops::attention as cpu;
        use crate::ops::gqa::{repeat_kv_backward, repeat_kv_forward, Groups};
        let AttnShape { b, t, c, nh, nkv } = shape;
        let gr = Groups { c, nh, nkv };
        let mut full = vec![0f32; b * t * 3 * c];
        repeat_kv_forward(&mut full, grouped, gr);
        let qkv_f = &full[..];
        let mut y = vec![0f32; b * t * c];
        let mut att = vec![0f32; b * nh * t * t];
        cpu::attention_forward(&mut y, &mut att, qkv_f, b, t, c, nh);
        let mut dfull = vec![0f32; b * t * 3 * c];
        cpu::attention_backward(&mut dfull, dy_f, qkv_f, &att, b, t, c, nh);
        let mut dqkv = vec![0f32; b * t * shape.row()];
        repeat_kv_backward(&mut dqkv, &dfull, gr);
        // lse from the CPU probabilities: p_ii = exp(s_ii − lse_i), so lse_i = s_ii − ln p_ii.
        let hd = c / nh;
        let scale = 1.0 / (hd as f64).sqrt();
        let mut lse = vec![0f32; b * nh * t];
        for bi in 0..b {
            for h in 0..nh {
                for i in 0..t {
                    let row = &qkv_f[(bi * t + i) * 3 * c..][..3 * c];
                    let sii: f64 = (0..hd).map(|d| row[h * hd + d] as f64 * row[c + h * hd + d] as f64).sum::<f64>() * scale;
                    let p = att[((bi * nh + h) * t + i) * t + i] as f64;
                    lse[(bi * nh + h) * t + i] = (sii - p.ln()) as f32;
                }
            }
        }
        CpuReference { y, dqkv, lse }
    }
}

/// Every forward kernel and backward layout this GPU runs gives the same bits (tolerance 0) as
/// the default ones did into `bufs` (`y_gpu`, `dqkv_gpu`: what they wrote, as f32).
fn same_bits_everywhere(
    gpu: &Gpu,
    bufs: &AttnBackward,
    shape: AttnShape,
    tag: &str,
    (y_gpu, dqkv_gpu): (&[f32], &[f32]),
) -> Result<Vec<CheckRow>> {
    let AttnShape { b, t, c, nh, .. } = shape;
    let stream = gpu.stream.clone();
    let mut rows = Vec::new();
    let lse_h = gpu.download(bufs.lse)?;
    for k in FWD_KERNELS.into_iter().filter(|k| runs_on(gpu, k.module)) {
        let y2 = gpu.alloc::<bf16>(b * t * c)?;
        let l2 = gpu.alloc::<f32>(b * nh * t)?;
        forward_kernel(k, gpu, &stream, y2.ptr(), l2.ptr(), bufs.qkv, shape)?;
        let yk = to_f32(&gpu.download(y2.ptr())?);
        let lk = gpu.download(l2.ptr())?;
        rows.push(CheckRow::compare(format!("attention_forward {} kernel y bit-identical {tag}", k.name), &yk, y_gpu, FLOOR, 0.0));
        rows.push(CheckRow::compare(format!("attention_forward {} kernel lse bit-identical {tag}", k.name), &lk, &lse_h, FLOOR, 0.0));
    }
    for layout in BWD_LAYOUTS.into_iter().filter(|l| runs_on(gpu, l.module)) {
        let mut other = gpu.alloc::<bf16>(b * t * shape.row())?;
        gpu.write(&mut other, 0, &vec![bf16::NAN; b * t * shape.row()])?;
        backward_layout(layout, gpu, &stream, &AttnBackward { dqkv: other.ptr(), ..*bufs }, shape)?;
        let o = to_f32(&gpu.download(other.ptr())?);
        let name = format!("attention_backward {} layout bit-identical {tag}", layout.name);
        rows.push(CheckRow::compare(name, &o, dqkv_gpu, FLOOR, 0.0));
    }
    Ok(rows)
}

/// Times forward and backward (CUDA events or stream sync + Instant over ≥20 reps after warm-up) at (b,t,c,nh) and returns (fwd_ms, bwd_ms).
pub fn bench(gpu: &Gpu, b: usize, t: usize, c: usize, nh: usize) -> Result<(f64, f64)> {
    check_shape("attention bench", AttnShape::mha(b, t, c, nh))?;
    const REPS: usize = 20;
    // Cheap deterministic inputs in about N(0, 1) range (a hash, not a quality RNG).
    let gen = |n: usize, salt: u64| -> Vec<bf16> {
        (0..n as u64)
            .map(|i| {
                let mut z = (i ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z ^= z >> 31;
                bf16::from_f32(((z >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 3.4)
            })
            .collect()
    };
    let qkv = gpu.upload(&gen(b * t * 3 * c, 1))?;
    let dy = gpu.upload(&gen(b * t * c, 2))?;
    let y = gpu.alloc::<bf16>(b * t * c)?;
    let lse = gpu.alloc::<f32>(b * nh * t)?;
    let delta = gpu.alloc::<f32>(b * nh * t)?;
    let dqkv = gpu.alloc::<bf16>(b * t * 3 * c)?;
    let stream = gpu.stream.clone();
    let shape = AttnShape::mha(b, t, c, nh);
    let bufs = AttnBackward { dqkv: dqkv.ptr(), delta: delta.ptr(), dy: dy.ptr(), qkv: qkv.ptr(), y: y.ptr(), lse: lse.ptr() };
    let fwd = || attention_forward(gpu, &stream, y.ptr(), lse.ptr(), qkv.ptr(), shape);
    let bwd = || attention_backward(gpu, &stream, &bufs, shape);
    for _ in 0..3 {
        fwd()?;
        bwd()?;
    }
    gpu.sync()?;
    let t0 = Instant::now();
    for _ in 0..REPS {
        fwd()?;
    }
    gpu.sync()?;
    let fwd_ms = t0.elapsed().as_secs_f64() * 1e3 / REPS as f64;
    let t0 = Instant::now();
    for _ in 0..REPS {
        bwd()?;
    }
    gpu.sync()?;
    let bwd_ms = t0.elapsed().as_secs_f64() * 1e3 / REPS as f64;
    Ok((fwd_ms, bwd_ms))
}
