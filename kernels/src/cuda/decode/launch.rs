//! Launch wrappers of `kernels/cuda/decode.cu`: each checks the lengths its kernel touches
//! (a mismatch is a caller bug: it panics with expected vs got) and launches on the given stream.

use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};

use crate::cuda::{bf16, drv, DPtr, Gpu, GpuError, Result};

/// Launches `decode` module kernel `$name` on stream `$s` (arguments must be places).
macro_rules! launch {
    ($gpu:expr, $s:expr, $name:literal, $cfg:expr; $($a:expr),* $(,)?) => {{
        let f = $gpu.func("decode", $name)?;
        let mut lb = $s.launch_builder(&f);
        $( lb.arg(&$a); )*
        // SAFETY: the argument list matches the kernel's parameters in decode.cu (device pointers
        // as u64, `int` as i32, `float` as f32) and the wrapper checked the extents it touches.
        unsafe { lb.launch($cfg) }.map(|_| ()).map_err(drv(concat!("launching decode.cu kernel `", $name, "`")))
    }};
}

/// Threads of the paged attention kernel (DEC_ATT_THREADS in decode.cu).
pub const ATT_THREADS: u32 = 256;
/// Rows (warps) per block of the RMSNorm kernel.
const ROWS_PER_BLOCK: u32 = 8;

fn check_len<T>(what: &str, p: DPtr<T>, want: usize) {
    assert!(p.len == want, "{what}: expected {want} elements, got {}", p.len);
}

fn i32_of(what: &str, v: usize) -> i32 {
    i32::try_from(v).unwrap_or_else(|_| panic!("{what} = {v} does not fit the kernels' 32-bit index"))
}

fn blocks(n: usize, threads: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (n.max(1) as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
}

/// The step's per-token inputs on the device: token ids, positions, cache slots and sequence
/// indices (`[n]` each), the rows whose logits are wanted (`[m]`) and the block tables
/// (`[seqs, max_blocks]`).
#[derive(Clone, Copy, Debug)]
pub struct StepPtrs {
    pub tok: DPtr<i32>,
    pub pos: DPtr<i32>,
    pub slot: DPtr<i32>,
    pub seq: DPtr<i32>,
    pub rows: DPtr<i32>,
    pub tables: DPtr<i32>,
    pub max_blocks: usize,
}

impl StepPtrs {
    pub fn n(&self) -> usize {
        self.tok.len
    }
}

/// x[r] = wte[tok[r]] + wpe[pos[r]] (f32 `[n, c]`; an out-of-range token gives a NaN row).
pub fn embed_pos(gpu: &Gpu, s: &CudaStream, x: DPtr<f32>, wte: DPtr<bf16>, wpe: DPtr<bf16>, p: &StepPtrs, c: usize) -> Result<()> {
    let n = p.n();
    check_len("embed_pos x [n, c]", x, n * c);
    assert!(wte.len % c == 0 && wpe.len % c == 0, "embed_pos: tables must be [*, c={c}]");
    let (n_i, c_i, v_i) = (i32_of("n", n), i32_of("c", c), i32_of("vocab", wte.len / c));
    launch!(gpu, s, "dec_embed_pos", blocks(n, 256); x.raw, wte.raw, wpe.raw, p.tok.raw, p.pos.raw, n_i, c_i, v_i)
}

/// The heads of a QKV product: `nh` query heads, `nkv` key/value heads of `hd`.
#[derive(Clone, Copy, Debug)]
pub struct Heads {
    pub nh: usize,
    pub nkv: usize,
    pub hd: usize,
}

impl Heads {
    /// Columns of a QKV row: q | k | v.
    pub fn row(&self) -> usize {
        (self.nh + 2 * self.nkv) * self.hd
    }
}

/// The QKV epilogue (decode.cu `dec_qkv_store`): bias, RoPE where `inv_freq` is given (f64,
/// `[hd/2]`), q to `q [n, nh·hd]`, k and v into the layer's cache at each token's slot.
#[allow(clippy::too_many_arguments)]
pub fn qkv_store(
    gpu: &Gpu,
    s: &CudaStream,
    q: DPtr<bf16>,
    (kc, vc): (DPtr<bf16>, DPtr<bf16>),
    qkv: DPtr<bf16>,
    bias: Option<DPtr<bf16>>,
    inv_freq: Option<DPtr<f64>>,
    p: &StepPtrs,
    h: Heads,
) -> Result<()> {
    let n = p.n();
    check_len("qkv_store q [n, nh·hd]", q, n * h.nh * h.hd);
    check_len("qkv_store qkv [n, row]", qkv, n * h.row());
    assert_eq!(kc.len, vc.len, "qkv_store: K and V caches differ");
    if let Some(b) = bias {
        check_len("qkv_store bias [row]", b, h.row());
    }
    if let Some(f) = inv_freq {
        check_len("qkv_store inv_freq [hd/2]", f, h.hd / 2);
    }
    let (b_raw, f_raw) = (bias.map_or(0, |b| b.raw), inv_freq.map_or(0, |f| f.raw));
    let (n_i, nh, nkv, hd) = (i32_of("n", n), i32_of("nh", h.nh), i32_of("nkv", h.nkv), i32_of("hd", h.hd));
    launch!(gpu, s, "dec_qkv_store", blocks(n, 256); q.raw, kc.raw, vc.raw, qkv.raw, b_raw, f_raw, p.pos.raw, p.slot.raw, n_i, nh, nkv, hd)
}

/// Shared memory of [`paged_attention`] for sequences up to `max_len` positions (the scores,
/// later the output's partial sums of up to 8 · ATT_THREADS floats).
pub fn attention_smem_bytes(hd: usize, max_len: usize) -> usize {
    4 * (hd + 32 + max_len.max(8 * ATT_THREADS as usize))
}

/// y = attention of each token's q over its sequence's cache positions `0..=pos` (decode.cu
/// `dec_paged_attention`); `max_len` bounds every position + 1 (it sizes the shared memory).
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    gpu: &Gpu,
    s: &CudaStream,
    y: DPtr<bf16>,
    q: DPtr<bf16>,
    (kc, vc): (DPtr<bf16>, DPtr<bf16>),
    p: &StepPtrs,
    h: Heads,
    block_size: usize,
    max_len: usize,
) -> Result<()> {
    let n = p.n();
    check_len("paged_attention y [n, nh·hd]", y, n * h.nh * h.hd);
    check_len("paged_attention q [n, nh·hd]", q, n * h.nh * h.hd);
    if h.hd % 8 != 0 || h.hd > 2 * ATT_THREADS as usize || h.nkv == 0 || h.nh % h.nkv != 0 {
        return Err(GpuError::Invalid(format!(
            "paged attention takes head sizes that are multiples of 8 up to {} and query heads a multiple of the key/value heads; got hd {} with {}/{} heads",
            2 * ATT_THREADS,
            h.hd,
            h.nh,
            h.nkv
        )));
    }
    if n == 0 {
        return Ok(());
    }
    let smem = attention_smem_bytes(h.hd, max_len);
    let cfg = LaunchConfig { grid_dim: (n as u32, h.nh as u32, 1), block_dim: (ATT_THREADS, 1, 1), shared_mem_bytes: smem as u32 };
    let scale = 1.0 / (h.hd as f32).sqrt();
    let (mb, nh, nkv, hd, bs) =
        (i32_of("max_blocks", p.max_blocks), i32_of("nh", h.nh), i32_of("nkv", h.nkv), i32_of("hd", h.hd), i32_of("bs", block_size));
    launch!(gpu, s, "dec_paged_attention", cfg; y.raw, q.raw, kc.raw, vc.raw, p.pos.raw, p.seq.raw, p.tables.raw, mb, nh, nkv, hd, bs, scale)
}

/// x += y, out = RMSNorm(x)·w (decode.cu `dec_residual_rmsnorm`).
#[allow(clippy::too_many_arguments)]
pub fn residual_rmsnorm(
    gpu: &Gpu,
    s: &CudaStream,
    x: DPtr<f32>,
    out: DPtr<bf16>,
    y: DPtr<bf16>,
    w: DPtr<bf16>,
    n: usize,
    c: usize,
    eps: f32,
) -> Result<()> {
    check_len("residual_rmsnorm x [n, c]", x, n * c);
    check_len("residual_rmsnorm out [n, c]", out, n * c);
    check_len("residual_rmsnorm y [n, c]", y, n * c);
    check_len("residual_rmsnorm w [c]", w, c);
    assert!(c % 4 == 0 && x.raw % 16 == 0 && out.raw % 8 == 0, "residual_rmsnorm: rows of c % 4 == 0, 16-byte aligned");
    if n == 0 {
        return Ok(());
    }
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(ROWS_PER_BLOCK as usize) as u32, 1, 1),
        block_dim: (32 * ROWS_PER_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    let (n_i, c_i) = (i32_of("n", n), i32_of("c", c));
    launch!(gpu, s, "dec_residual_rmsnorm", cfg; x.raw, out.raw, y.raw, w.raw, n_i, c_i, eps)
}

/// out [n, f] = silu(gate) · up over the fused gate|up rows `gu [n, 2f]`.
pub fn swiglu_rows(gpu: &Gpu, s: &CudaStream, out: DPtr<bf16>, gu: DPtr<bf16>, n: usize, f: usize) -> Result<()> {
    check_len("swiglu_rows out [n, f]", out, n * f);
    check_len("swiglu_rows gu [n, 2f]", gu, 2 * n * f);
    if n * f == 0 {
        return Ok(());
    }
    let (n_i, f_i) = (i32_of("n", n), i32_of("f", f));
    launch!(gpu, s, "dec_swiglu_rows", crate::cuda::grid_1d(n * f, 256); out.raw, gu.raw, n_i, f_i)
}

/// dst[i] = src[rows[i]] (bf16 rows of `c`).
pub fn gather_rows(gpu: &Gpu, s: &CudaStream, dst: DPtr<bf16>, src: DPtr<bf16>, rows: DPtr<i32>, c: usize) -> Result<()> {
    let m = rows.len;
    check_len("gather_rows dst [m, c]", dst, m * c);
    assert!(src.len % c == 0, "gather_rows: src must be [*, c]");
    let (m_i, c_i) = (i32_of("m", m), i32_of("c", c));
    launch!(gpu, s, "dec_gather_rows", blocks(m, 256); dst.raw, src.raw, rows.raw, m_i, c_i)
}

/// out[i] = argmax of logits row i (ties to the lower index).
pub fn argmax(gpu: &Gpu, s: &CudaStream, out: DPtr<i32>, logits: DPtr<f32>, v: usize) -> Result<()> {
    let m = out.len;
    check_len("argmax logits [m, v]", logits, m * v);
    let (m_i, v_i) = (i32_of("m", m), i32_of("v", v));
    launch!(gpu, s, "dec_argmax", blocks(m, 1024); out.raw, logits.raw, m_i, v_i)
}

/// Output channels (warps) per block of the GEMV.
const GEMV_COLS_PER_BLOCK: u32 = 8;
/// Rows per block of the GEMV (DEC_WQ_ROWS in decode.cu).
const GEMV_ROWS: usize = 8;

/// A GEMV's weight: `[n, k]` output-major bytes of `fmt` at `w`, and for the quantized formats
/// the scales `s [n]`.
#[derive(Clone, Copy, Debug)]
pub struct GemvW {
    pub w: u64,
    pub s: Option<DPtr<f32>>,
    pub fmt: super::WeightFormat,
}

/// GPT-2's join folded into a GEMV's prologue (decode.cu `dec_ln_prologue`): the GEMV's input
/// rows are `LayerNorm(xo)·w + b` with `xo = x + (y + yb)` (f32 `[m, c]`, stored to `xo`, which
/// must not overlap `x`), the bits of `ops::residual_layernorm_forward`.
#[derive(Clone, Copy, Debug)]
pub struct ResidualLnIn {
    pub xo: DPtr<f32>,
    pub x: DPtr<f32>,
    pub y: DPtr<bf16>,
    pub yb: DPtr<bf16>,
    pub w: DPtr<bf16>,
    pub b: DPtr<bf16>,
}

/// Where a GEMV's input rows `[m, k]` come from.
#[derive(Clone, Copy, Debug)]
pub enum GemvIn {
    /// bf16 rows in device memory.
    Rows(DPtr<bf16>),
    /// Made in the kernel's prologue from the residual stream (see [`ResidualLnIn`]).
    ResidualLn(ResidualLnIn),
}

/// LN_MAXV in ops.cu: the LayerNorm register path takes rows of up to 128 · this.
const LN_MAXV: usize = 8;

/// Whether a GEMV of input width `k` can fold the residual + LayerNorm into its prologue.
pub fn ln_foldable(k: usize) -> bool {
    k > 0 && k % 128 == 0 && k <= 128 * LN_MAXV && GEMV_ROWS * k * 2 <= 48 << 10
}

impl GemvIn {
    /// Checks the input against `[m, k]`; returns (x or 0, the prologue's pointers or zeros, the
    /// dynamic shared memory bytes).
    fn args(&self, what: &str, m: usize, k: usize) -> (u64, [u64; 6], u32) {
        match *self {
            GemvIn::Rows(x) => {
                check_len(&format!("{what} x [m, k]"), x, m * k);
                (x.raw, [0; 6], 0)
            }
            GemvIn::ResidualLn(a) => {
                assert!(ln_foldable(k), "{what}: the residual + LayerNorm prologue takes k % 128 == 0, k <= {}; got {k}", 128 * LN_MAXV);
                check_len(&format!("{what} xo [m, k]"), a.xo, m * k);
                check_len(&format!("{what} x [m, k]"), a.x, m * k);
                check_len(&format!("{what} y [m, k]"), a.y, m * k);
                for (name, p) in [("y bias", a.yb), ("norm weight", a.w), ("norm bias", a.b)] {
                    check_len(&format!("{what} {name} [k]"), p, k);
                }
                let disjoint = a.xo.raw + a.xo.bytes() as u64 <= a.x.raw || a.x.raw + a.x.bytes() as u64 <= a.xo.raw;
                assert!(disjoint, "{what}: the prologue's residual output must not overlap its input");
                let al = a.xo.raw % 16 == 0 && a.x.raw % 16 == 0 && [a.y, a.yb, a.w, a.b].iter().all(|p| p.raw % 8 == 0);
                assert!(al, "{what}: residual rows 16-byte and bf16 rows 8-byte aligned");
                (0, [a.xo.raw, a.x.raw, a.y.raw, a.yb.raw, a.w.raw, a.b.raw], (GEMV_ROWS * k * 2) as u32)
            }
        }
    }
}

/// `y [m, n] = epilogue(x [m, k] · W)` for a few rows (decode.cu `dec_gemv_*`; k a multiple of
/// 16): the product rounded to bf16, then `+ bias` and GELU where asked (the bits of a GEMM and
/// ops.cu's bias kernel; GELU up to its exponential). With [`GemvIn::ResidualLn`] the input rows
/// are made in the kernel (`dec_gemv_ln_*`).
#[allow(clippy::too_many_arguments)]
pub fn gemv(
    gpu: &Gpu,
    st: &CudaStream,
    y: DPtr<bf16>,
    x: GemvIn,
    w: GemvW,
    bias: Option<DPtr<bf16>>,
    gelu: bool,
    m: usize,
    (k, n): (usize, usize),
) -> Result<()> {
    use super::WeightFormat as F;
    check_len("gemv y [m, n]", y, m * n);
    let (x_raw, [xo, xr, ry, ryb, lw, lb], smem) = x.args("gemv", m, k);
    if let Some(s) = w.s {
        check_len("gemv s [n]", s, n);
    }
    if let Some(b) = bias {
        check_len("gemv bias [n]", b, n);
    }
    assert!((w.fmt == F::Bf16) == w.s.is_none(), "gemv: scales go with quantized weights only");
    if k % 16 != 0 {
        return Err(GpuError::Invalid(format!("the decode GEMV needs an input width that is a multiple of 16; got {k}")));
    }
    if m == 0 {
        return Ok(());
    }
    let cfg = LaunchConfig { shared_mem_bytes: smem, ..gemv_cfg(m, n) };
    let (s_raw, b_raw, gelu_i) = (w.s.map_or(0, |s| s.raw), bias.map_or(0, |b| b.raw), i32::from(gelu));
    let (m_i, k_i, n_i) = (i32_of("m", m), i32_of("k", k), i32_of("n", n));
    match (x, w.fmt) {
        (GemvIn::Rows(_), F::Int8) => launch!(gpu, st, "dec_gemv_i8", cfg; y.raw, x_raw, w.w, s_raw, b_raw, gelu_i, m_i, k_i, n_i),
        (GemvIn::Rows(_), F::Fp8) => launch!(gpu, st, "dec_gemv_e4m3", cfg; y.raw, x_raw, w.w, s_raw, b_raw, gelu_i, m_i, k_i, n_i),
        (GemvIn::Rows(_), F::Bf16) => launch!(gpu, st, "dec_gemv_bf16", cfg; y.raw, x_raw, w.w, s_raw, b_raw, gelu_i, m_i, k_i, n_i),
        (GemvIn::ResidualLn(_), F::Int8) => {
            launch!(gpu, st, "dec_gemv_ln_i8", cfg; y.raw, xo, xr, ry, ryb, lw, lb, w.w, s_raw, b_raw, gelu_i, m_i, k_i, n_i)
        }
        (GemvIn::ResidualLn(_), F::Fp8) => {
            launch!(gpu, st, "dec_gemv_ln_e4m3", cfg; y.raw, xo, xr, ry, ryb, lw, lb, w.w, s_raw, b_raw, gelu_i, m_i, k_i, n_i)
        }
        (GemvIn::ResidualLn(_), F::Bf16) => {
            launch!(gpu, st, "dec_gemv_ln_bf16", cfg; y.raw, xo, xr, ry, ryb, lw, lb, w.w, s_raw, b_raw, gelu_i, m_i, k_i, n_i)
        }
    }
}

/// `y [m, n] = x [m, k] · Wᵀ` in f32 for a few rows (decode.cu `dec_gemv_f32out`; the LM head),
/// `w [n, k]` bf16, k a multiple of 16.
pub fn gemv_f32(gpu: &Gpu, st: &CudaStream, y: DPtr<f32>, x: DPtr<bf16>, w: DPtr<bf16>, m: usize, (k, n): (usize, usize)) -> Result<()> {
    check_len("gemv_f32 y [m, n]", y, m * n);
    check_len("gemv_f32 x [m, k]", x, m * k);
    check_len("gemv_f32 w [n, k]", w, n * k);
    assert!(k % 16 == 0, "gemv_f32: k = {k} must be a multiple of 16");
    if m == 0 {
        return Ok(());
    }
    let (m_i, k_i, n_i) = (i32_of("m", m), i32_of("k", k), i32_of("n", n));
    launch!(gpu, st, "dec_gemv_f32out", gemv_cfg(m, n); y.raw, x.raw, w.raw, m_i, k_i, n_i)
}

fn gemv_cfg(m: usize, n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(GEMV_COLS_PER_BLOCK as usize) as u32, m.div_ceil(GEMV_ROWS) as u32, 1),
        block_dim: (32 * GEMV_COLS_PER_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The QKV projection of a few rows with [`qkv_store`]'s epilogue in one kernel (decode.cu
/// `dec_gemv_qkv_*`): `x [m, k] · W` (W `[row, k]` in any format), bias, RoPE where `inv_freq`
/// is given, q to `q [m, nh·hd]`, k and v into the cache at each token's slot — the bits of
/// [`gemv`] followed by [`qkv_store`]. With [`GemvIn::ResidualLn`] the input rows are made in
/// the kernel (`dec_gemv_qkv_ln_*`).
#[allow(clippy::too_many_arguments)]
pub fn gemv_qkv(
    gpu: &Gpu,
    st: &CudaStream,
    q: DPtr<bf16>,
    (kc, vc): (DPtr<bf16>, DPtr<bf16>),
    x: GemvIn,
    w: GemvW,
    (bias, inv_freq): (Option<DPtr<bf16>>, Option<DPtr<f64>>),
    p: &StepPtrs,
    h: Heads,
    k: usize,
) -> Result<()> {
    use super::WeightFormat as F;
    let (m, row) = (p.n(), h.row());
    check_len("gemv_qkv q [m, nh·hd]", q, m * h.nh * h.hd);
    let (x_raw, [xo, xr, ry, ryb, lw, lb], smem) = x.args("gemv_qkv", m, k);
    assert_eq!(kc.len, vc.len, "gemv_qkv: K and V caches differ");
    if let Some(s) = w.s {
        check_len("gemv_qkv s [row]", s, row);
    }
    if let Some(b) = bias {
        check_len("gemv_qkv bias [row]", b, row);
    }
    if let Some(f) = inv_freq {
        check_len("gemv_qkv inv_freq [hd/2]", f, h.hd / 2);
    }
    assert!((w.fmt == F::Bf16) == w.s.is_none(), "gemv_qkv: scales go with quantized weights only");
    // 4 column pairs a block: hd % 8 == 0 (the decoder's check) makes the pairs a multiple of 4.
    assert!(h.hd % 8 == 0 && k % 16 == 0, "gemv_qkv: hd = {} must be a multiple of 8, k = {k} of 16", h.hd);
    if m == 0 {
        return Ok(());
    }
    let cfg = LaunchConfig {
        grid_dim: ((row / 2 / 4) as u32, m.div_ceil(GEMV_ROWS) as u32, 1),
        block_dim: (32 * GEMV_COLS_PER_BLOCK, 1, 1),
        shared_mem_bytes: smem,
    };
    let (s_raw, b_raw, f_raw) = (w.s.map_or(0, |s| s.raw), bias.map_or(0, |b| b.raw), inv_freq.map_or(0, |f| f.raw));
    let (m_i, k_i, nh, nkv, hd) = (i32_of("m", m), i32_of("k", k), i32_of("nh", h.nh), i32_of("nkv", h.nkv), i32_of("hd", h.hd));
    let (pos, slot, out) = (p.pos.raw, p.slot.raw, (q.raw, kc.raw, vc.raw));
    match (x, w.fmt) {
        (GemvIn::Rows(_), F::Int8) => {
            launch!(gpu, st, "dec_gemv_qkv_i8", cfg; out.0, out.1, out.2, x_raw, w.w, s_raw, b_raw, f_raw, pos, slot, m_i, k_i, nh, nkv, hd)
        }
        (GemvIn::Rows(_), F::Fp8) => {
            launch!(gpu, st, "dec_gemv_qkv_e4m3", cfg; out.0, out.1, out.2, x_raw, w.w, s_raw, b_raw, f_raw, pos, slot, m_i, k_i, nh, nkv, hd)
        }
        (GemvIn::Rows(_), F::Bf16) => {
            launch!(gpu, st, "dec_gemv_qkv_bf16", cfg; out.0, out.1, out.2, x_raw, w.w, s_raw, b_raw, f_raw, pos, slot, m_i, k_i, nh, nkv, hd)
        }
        (GemvIn::ResidualLn(_), F::Int8) => launch!(gpu, st, "dec_gemv_qkv_ln_i8", cfg;
            out.0, out.1, out.2, xo, xr, ry, ryb, lw, lb, w.w, s_raw, b_raw, f_raw, pos, slot, m_i, k_i, nh, nkv, hd),
        (GemvIn::ResidualLn(_), F::Fp8) => launch!(gpu, st, "dec_gemv_qkv_ln_e4m3", cfg;
            out.0, out.1, out.2, xo, xr, ry, ryb, lw, lb, w.w, s_raw, b_raw, f_raw, pos, slot, m_i, k_i, nh, nkv, hd),
        (GemvIn::ResidualLn(_), F::Bf16) => launch!(gpu, st, "dec_gemv_qkv_ln_bf16", cfg;
            out.0, out.1, out.2, xo, xr, ry, ryb, lw, lb, w.w, s_raw, b_raw, f_raw, pos, slot, m_i, k_i, nh, nkv, hd),
    }
}

/// `wd [k, n] = bf16(dequant(q))`: a quantized weight widened for cuBLAS (steps of many rows).
pub fn wq_dequant(
    gpu: &Gpu,
    st: &CudaStream,
    wd: DPtr<bf16>,
    (q, s): (DPtr<u8>, DPtr<f32>),
    int8: bool,
    (k, n): (usize, usize),
) -> Result<()> {
    check_len("wq_dequant wd [k, n]", wd, k * n);
    check_len("wq_dequant q [n, k]", q, n * k);
    check_len("wq_dequant s [n]", s, n);
    let (k_i, n_i, fmt) = (i32_of("k", k), i32_of("n", n), if int8 { 0i32 } else { 1 });
    launch!(gpu, st, "dec_wq_dequant", crate::cuda::grid_1d(k * n, 256); wd.raw, q.raw, s.raw, k_i, n_i, fmt)
}
