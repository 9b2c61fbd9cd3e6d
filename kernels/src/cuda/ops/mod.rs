//! Every non-GEMM, non-attention kernel of the GPU GPT-2 (sources in `kernels/cuda/ops.cu`):
//! embedding, LayerNorm, bias/GELU/residual epilogues, bias gradients, casts, fused softmax
//! cross-entropy, sums of squares for gradient norms and fused AdamW.
//!
//! Conventions: activations and parameters are bf16, the residual stream, gradients, optimizer
//! state and master weights f32. `n` = rows (tokens), `c`/`f` = row width. Outputs documented
//! with "+=" accumulate into what the buffer already holds. Every wrapper checks the lengths of
//! its [`DPtr`]s (panicking with expected vs got: a length mismatch is a caller bug) and launches
//! on the given stream.
//!
//! Determinism: no float atomics; every reduction runs in an order fixed by the shapes alone, so
//! the same inputs give the same bits on every run. Column sums (LayerNorm dweight/dbias, bias
//! gradients) run in two passes through a caller-provided scratch buffer: row block `k` (of
//! [`colsum_rows_per`] rows) sums its rows in ascending order into a partial, then the partials
//! are summed in ascending block order and added to the destination.
//!
//! Rounding: elementwise kernels use explicit round-to-nearest float intrinsics (the module is
//! compiled with fast-math) and follow the CPU formulas' operation order, so the embedding, bias,
//! residual, cast, AdamW and sum-of-squares kernels reproduce the CPU's f32 bits. Where speed
//! mattered more than bit-equality with the CPU the kernels differ by a few ulp, deterministically:
//! LayerNorm's row sums run lane-parallel (a fixed shuffle tree) on its register path, GELU uses the
//! hardware exponential, and the cross-entropy is a one-read online softmax (f32 per thread, f64
//! across threads). Column sums (dweight, dbias, bias gradients) use their own blocked order (see
//! above); subnormals are flushed to zero on the GPU. [`check`] (`ops/check.rs`) compares everything with
//! the CPU ops.

use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};

use super::{bf16, drv, grid_1d, DPtr, Gpu, Result};

mod check;
pub use check::check;

/// Launches `ops.cu` kernel `$name` on stream `$s`. Arguments must be places (locals or fields),
/// since the builder keeps references to them until the launch.
macro_rules! launch {
    ($gpu:expr, $s:expr, $name:literal, $cfg:expr; $($a:expr),* $(,)?) => {{
        let f = $gpu.func("ops", $name)?;
        let mut lb = $s.launch_builder(&f);
        $( lb.arg(&$a); )*
        // SAFETY: the argument list matches the kernel's parameter list in ops.cu (device
        // pointers as u64, `int` as i32, `u64` as u64, `float` as f32), and the wrappers have
        // checked every buffer's length against the extents the kernel touches.
        unsafe { lb.launch($cfg) }.map(|_| ()).map_err(drv(concat!("launching ops.cu kernel `", $name, "`")))
    }};
}
pub(crate) use launch;

/// Threads per block of the elementwise kernels (each thread handles 8 elements).
const EW_THREADS: u32 = 256;
/// Rows (warps) per block of the LayerNorm kernels.
const LN_ROWS_PER_BLOCK: u32 = 8;
/// Threads per block of the column-sum kernels (threads over columns).
const COL_THREADS: u32 = 256;
/// Threads per block of the 8-columns-per-thread column sums.
const COL_THREADS8: u32 = 128;
/// Threads per block of the cross-entropy kernel (one block per row).
const CE_THREADS: u32 = 512;
/// LayerNorm register path: c % 128 == 0 and c ≤ 128·LN_MAXV (must equal LN_MAXV in ops.cu);
/// the kernels named `…16` hold twice as much (c ≤ 256·LN_MAXV).
const LN_MAXV: usize = 8;

/// Which register-path LayerNorm kernels fit a row of `c` (both give a row's sums in the same
/// lane-parallel order): `Some(false)` the plain ones (c ≤ 1024), `Some(true)` the `…16` ones
/// (c ≤ 2048), `None` the generic ones.
fn ln_wide(c: usize) -> Option<bool> {
    if c == 0 || c % 128 != 0 {
        None
    } else if c <= 128 * LN_MAXV {
        Some(false)
    } else if c <= 256 * LN_MAXV {
        Some(true)
    } else {
        None
    }
}

fn aligned<T>(p: DPtr<T>, bytes: u64) -> bool {
    p.raw % bytes == 0
}

fn i32_of(what: &str, v: usize) -> i32 {
    i32::try_from(v).unwrap_or_else(|_| panic!("{what} = {v} does not fit the kernels' 32-bit index"))
}

fn check_len<T>(what: &str, p: DPtr<T>, want: usize) {
    assert!(p.len == want, "{what}: expected {want} elements, got {}", p.len);
}

/// Launch shape for `len` elements at 8 per thread.
fn ew_cfg(what: &str, len: usize) -> LaunchConfig {
    let groups = len.div_ceil(8);
    assert!(groups.div_ceil(EW_THREADS as usize) <= i32::MAX as usize, "{what}: {len} elements exceed the grid limit");
    grid_1d(groups, EW_THREADS)
}

/// Rows per block of the two-pass column sums: at least 32, and few enough blocks (≤ 4096) for
/// the partials and the grid's y extent. A function of `n` only (part of the fixed order).
pub fn colsum_rows_per(n: usize) -> usize {
    32usize.max(n.div_ceil(4096))
}

/// Warps per block of `colsum_finish` (must equal COLSUM_WARPS in ops.cu): warp w sums the
/// partial rows ≡ w (mod 8), the warps combine by a fixed pairwise tree.
pub const COLSUM_WARPS: usize = 8;

/// `colsum_finish` over `c` columns: 32 columns per block of [`COLSUM_WARPS`] warps.
fn colsum_finish_cfg(c: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (u32::try_from(c.div_ceil(32)).expect("columns fit the grid"), 1, 1),
        block_dim: (32 * COLSUM_WARPS as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Number of row blocks (partials) of the column sums over `n` rows.
pub fn colsum_blocks(n: usize) -> usize {
    n.div_ceil(colsum_rows_per(n))
}

// ---------------------------------------------------------------------------------------------
// Embedding
// ---------------------------------------------------------------------------------------------

/// x[bi*t+ti, :] = wte[tokens[bi*t+ti]] + wpe[ti]   (f32 out = bf2f(wte)+bf2f(wpe)).
/// `wte` is [V, c] (V = wte.len / c), `wpe` has at least `t` rows. A token id ≥ V gives a NaN
/// row on the device (loaders validate ids; [`TokenIndex::new`] panics on them).
// Allowed: llm.c's order, as the CPU ops take it (outputs, inputs, then the shape), plus the GPU
// and the stream.
#[allow(clippy::too_many_arguments)]
pub fn embedding_forward(
    gpu: &Gpu,
    s: &CudaStream,
    x: DPtr<f32>,
    tokens: DPtr<u32>,
    wte: DPtr<bf16>,
    wpe: DPtr<bf16>,
    b: usize,
    t: usize,
    c: usize,
) -> Result<()> {
    check_len("embedding_forward x [b*t, c]", x, b * t * c);
    check_len("embedding_forward tokens [b*t]", tokens, b * t);
    assert!(c > 0 && wte.len % c == 0 && wte.len > 0, "embedding_forward: wte must be [V, c={c}], got {} elements", wte.len);
    assert!(wpe.len >= t * c, "embedding_forward: wpe must have at least t={t} rows of c={c} ({} elements), got {}", t * c, wpe.len);
    if b * t == 0 {
        return Ok(());
    }
    let vocab = u32::try_from(wte.len / c).expect("vocabulary fits u32");
    let vec = c % 8 == 0 && aligned(x, 16) && aligned(wte, 16) && aligned(wpe, 16);
    let (rows, t_i, c_i, vec_i) = ((b * t) as u64, i32_of("t", t), i32_of("c", c), vec as i32);
    let items = if vec { b * t * c / 8 } else { b * t * c };
    assert!(items.div_ceil(EW_THREADS as usize) <= i32::MAX as usize, "embedding_forward: too many elements for one grid");
    let cfg = grid_1d(items, EW_THREADS);
    launch!(gpu, s, "embedding_fwd", cfg; x.raw, tokens.raw, wte.raw, wpe.raw, rows, t_i, c_i, vocab, vec_i)
}

/// Host-side index for the deterministic embedding backward: tokens grouped by id (ids
/// ascending), positions ascending within each id. `positions[offsets[u]..offsets[u+1]]` are the
/// flat positions (bi*t+ti) holding token `uniq[u]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenIndex {
    pub uniq: Vec<u32>,
    /// `uniq.len() + 1` entries; `offsets[0] = 0`, last = number of tokens.
    pub offsets: Vec<u32>,
    pub positions: Vec<u32>,
}

impl TokenIndex {
    /// Counting sort of `tokens` by id. Panics if an id is ≥ `vocab` (loaders validate ids first).
    pub fn new(tokens: &[u32], vocab: usize) -> TokenIndex {
        assert!(u32::try_from(tokens.len()).is_ok(), "TokenIndex: {} tokens exceed u32 positions", tokens.len());
        let mut count = vec![0u32; vocab];
        for (p, &tok) in tokens.iter().enumerate() {
            assert!((tok as usize) < vocab, "TokenIndex: token id {tok} at position {p} is outside the vocabulary of {vocab}");
            count[tok as usize] += 1;
        }
        let mut uniq = Vec::new();
        let mut offsets = vec![0u32];
        // start[v]: where token v's positions begin in `positions`.
        let mut start = vec![0u32; vocab];
        let mut total = 0u32;
        for (v, &k) in count.iter().enumerate() {
            if k > 0 {
                uniq.push(v as u32);
                start[v] = total;
                total += k;
                offsets.push(total);
            }
        }
        let mut positions = vec![0u32; tokens.len()];
        for (p, &tok) in tokens.iter().enumerate() {
            let slot = &mut start[tok as usize];
            positions[*slot as usize] = p as u32;
            *slot += 1;
        }
        TokenIndex { uniq, offsets, positions }
    }
}

/// dwte[tok] += Σ dx[p] over that token's positions p (ascending, added one at a time onto the
/// existing row exactly as the CPU does), dwpe[ti] += Σ_bi dx[bi*t+ti] (bi ascending).
/// `uniq`/`offsets`/`positions` are device copies of a [`TokenIndex`] of these `b*t` tokens.
// Allowed: llm.c's order, as the CPU ops take it (outputs, inputs, then the shape), plus the GPU
// and the stream.
#[allow(clippy::too_many_arguments)]
pub fn embedding_backward(
    gpu: &Gpu,
    s: &CudaStream,
    dwte: DPtr<f32>,
    dwpe: DPtr<f32>,
    dx: DPtr<f32>,
    uniq: DPtr<u32>,
    offsets: DPtr<u32>,
    positions: DPtr<u32>,
    b: usize,
    t: usize,
    c: usize,
) -> Result<()> {
    check_len("embedding_backward dx [b*t, c]", dx, b * t * c);
    check_len("embedding_backward positions [b*t]", positions, b * t);
    check_len("embedding_backward offsets [uniq+1]", offsets, uniq.len + 1);
    assert!(c > 0 && dwte.len % c == 0 && dwte.len > 0, "embedding_backward: dwte must be [V, c={c}], got {} elements", dwte.len);
    assert!(dwpe.len >= t * c, "embedding_backward: dwpe must have at least t={t} rows of c={c} ({} elements), got {}", t * c, dwpe.len);
    assert!(uniq.len <= b * t, "embedding_backward: {} unique tokens but only {} positions", uniq.len, b * t);
    if b * t == 0 {
        return Ok(());
    }
    embedding_backward_wte(gpu, s, dwte, dx, uniq, offsets, positions, b * t, c)?;
    let (b_i, t_i, c_i) = (i32_of("b", b), i32_of("t", t), i32_of("c", c));
    let cfg = grid_1d(t * c, COL_THREADS);
    launch!(gpu, s, "embedding_bwd_wpe", cfg; dwpe.raw, dx.raw, b_i, t_i, c_i)
}

/// The token half of [`embedding_backward`] (models without learned positions use it alone):
/// dwte[tok] += Σ dx[p] over that token's positions p, ascending, onto the existing row.
// Allowed: as `embedding_backward`.
#[allow(clippy::too_many_arguments)]
pub fn embedding_backward_wte(
    gpu: &Gpu,
    s: &CudaStream,
    dwte: DPtr<f32>,
    dx: DPtr<f32>,
    uniq: DPtr<u32>,
    offsets: DPtr<u32>,
    positions: DPtr<u32>,
    n: usize,
    c: usize,
) -> Result<()> {
    check_len("embedding_backward dx [n, c]", dx, n * c);
    check_len("embedding_backward positions [n]", positions, n);
    check_len("embedding_backward offsets [uniq+1]", offsets, uniq.len + 1);
    assert!(c > 0 && dwte.len % c == 0 && dwte.len > 0, "embedding_backward: dwte must be [V, c={c}], got {} elements", dwte.len);
    assert!(uniq.len <= n, "embedding_backward: {} unique tokens but only {n} positions", uniq.len);
    if n == 0 || uniq.len == 0 {
        return Ok(());
    }
    let vocab = u32::try_from(dwte.len / c).expect("vocabulary fits u32");
    let c_i = i32_of("c", c);
    let cfg = LaunchConfig {
        grid_dim: (u32::try_from(uniq.len).expect("unique tokens fit the grid"), c.div_ceil(COL_THREADS as usize) as u32, 1),
        block_dim: (COL_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    assert!(cfg.grid_dim.1 <= 65535, "embedding_backward: c={c} too wide for the grid");
    launch!(gpu, s, "embedding_bwd_wte", cfg; dwte.raw, dx.raw, uniq.raw, offsets.raw, positions.raw, c_i, vocab)
}

// ---------------------------------------------------------------------------------------------
// LayerNorm
// ---------------------------------------------------------------------------------------------

fn ln_cfg(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(LN_ROWS_PER_BLOCK as usize);
    assert!(blocks <= i32::MAX as usize, "layernorm: {n} rows exceed the grid limit");
    LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (32 * LN_ROWS_PER_BLOCK, 1, 1), shared_mem_bytes: 0 }
}

/// out = LN(x)·w + bias (bf16 out), saves mean and rstd (f32, [n]); eps = 1e-5
/// (`ops::layernorm::LAYERNORM_EPS`), two-pass variance like the CPU. One warp per row.
// Allowed: llm.c's order, as the CPU ops take it (outputs, inputs, then the shape), plus the GPU
// and the stream.
#[allow(clippy::too_many_arguments)]
pub fn layernorm_forward(
    gpu: &Gpu,
    s: &CudaStream,
    out: DPtr<bf16>,
    mean: DPtr<f32>,
    rstd: DPtr<f32>,
    x: DPtr<f32>,
    w: DPtr<bf16>,
    bias: DPtr<bf16>,
    n: usize,
    c: usize,
) -> Result<()> {
    check_len("layernorm_forward out [n, c]", out, n * c);
    check_len("layernorm_forward x [n, c]", x, n * c);
    check_len("layernorm_forward mean [n]", mean, n);
    check_len("layernorm_forward rstd [n]", rstd, n);
    check_len("layernorm_forward weight [c]", w, c);
    check_len("layernorm_forward bias [c]", bias, c);
    if n == 0 {
        return Ok(());
    }
    assert!(c > 0, "layernorm_forward: c must be > 0");
    let (n_i, c_i) = (i32_of("n", n), i32_of("c", c));
    let cfg = ln_cfg(n);
    let aligned_all = aligned(x, 16) && aligned(out, 8) && aligned(w, 8) && aligned(bias, 8);
    match ln_wide(c).filter(|_| aligned_all) {
        Some(false) => launch!(gpu, s, "layernorm_fwd_vec", cfg; out.raw, mean.raw, rstd.raw, x.raw, w.raw, bias.raw, n_i, c_i),
        Some(true) => launch!(gpu, s, "layernorm_fwd_vec16", cfg; out.raw, mean.raw, rstd.raw, x.raw, w.raw, bias.raw, n_i, c_i),
        None => launch!(gpu, s, "layernorm_fwd_gen", cfg; out.raw, mean.raw, rstd.raw, x.raw, w.raw, bias.raw, n_i, c_i),
    }
}

/// f32 elements of scratch [`layernorm_backward`] needs: 2 · row_blocks · c.
pub fn layernorm_backward_scratch(n: usize, c: usize) -> usize {
    2 * colsum_blocks(n) * c
}

/// The operands of [`layernorm_backward`]: `dx += LN backward` with `dout` the gradient of the
/// LayerNorm's output, `x` its input, `w` its weight, `mean`/`rstd` the forward's row
/// statistics; `dw`, `db` receive the weight and bias gradients (+=), `scratch` holds the
/// column partials, and optionally `dx_bf16` gets the updated dx rounded to bf16 and
/// `dx_bf16_sums` the first pass of that tensor's column sums. `[n, c]` rows.
#[derive(Clone, Copy)]
pub struct LnBackward {
    pub dx: DPtr<f32>,
    pub dx_bf16: Option<DPtr<bf16>>,
    pub dx_bf16_sums: Option<DPtr<f32>>,
    pub dw: DPtr<f32>,
    pub db: DPtr<f32>,
    pub dout: DPtr<bf16>,
    pub x: DPtr<f32>,
    pub w: DPtr<bf16>,
    pub mean: DPtr<f32>,
    pub rstd: DPtr<f32>,
    pub scratch: DPtr<f32>,
    pub n: usize,
    pub c: usize,
}

impl LnBackward {
    /// Whether the one-pass kernel (`layernorm_bwd_fused`) fits these buffers (it runs unless
    /// `TESSERA_GPU_LN_FUSED=0`): the rows the register-path dx kernels take ([`ln_wide`]:
    /// c % 128 == 0, c ≤ 2048 — wider rows go to `layernorm_bwd_dx_gen`, whose row sums run in
    /// another order, so the one pass would not give its bits), x/dx/scratch/sums 16-byte and
    /// dout/w/dx_bf16 8-byte aligned.
    fn one_pass_fits(&self) -> bool {
        ln_wide(self.c).is_some()
            && aligned(self.x, 16)
            && aligned(self.dx, 16)
            && aligned(self.dout, 8)
            && aligned(self.w, 8)
            && self.dx_bf16.is_none_or(|b| aligned(b, 8))
            && aligned(self.scratch, 16)
            && self.dx_bf16_sums.is_none_or(|p| aligned(p, 16))
    }
}

/// dx += LN backward (f32); dw += Σ_rows dout·x̂, db += Σ_rows dout, the column sums in two
/// fixed-order passes through `scratch` (≥ [`layernorm_backward_scratch`] elements). With
/// `dx_bf16`, the updated dx is also written rounded to bf16 there (the next GEMM's input), and
/// with `dx_bf16_sums` (≥ [`bias_grad_scratch`]`(n, c)` elements) the first pass of that bf16
/// tensor's column sums (its linear layer's bias gradient) is written there too: finish it with
/// [`colsum_finish`]; the bits are [`bias_grad`]'s on the bf16 dx.
///
/// Where [`LnBackward::one_pass_fits`] holds (and `TESSERA_GPU_LN_FUSED` is not `0`) this is one kernel that
/// reads x, dout and dx once (`layernorm_bwd_fused`) and gives the bits of the separate kernels
/// (a `check` row compares them); otherwise the dx kernel,
/// the column-partial kernel and (with `dx_bf16_sums`) `bias_grad`'s first pass run one after
/// the other.
pub fn layernorm_backward(gpu: &Gpu, s: &CudaStream, a: &LnBackward) -> Result<()> {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let off = *OFF.get_or_init(|| std::env::var("TESSERA_GPU_LN_FUSED").is_ok_and(|v| v == "0"));
    layernorm_backward_with(gpu, s, a, !off && a.one_pass_fits())
}

/// [`layernorm_backward`] with the kernel choice given (`fused` needs
/// [`LnBackward::one_pass_fits`]).
fn layernorm_backward_with(gpu: &Gpu, s: &CudaStream, a: &LnBackward, fused: bool) -> Result<()> {
    let LnBackward { dx, dx_bf16, dx_bf16_sums, dw, db, dout, x, w, mean, rstd, scratch, n, c } = *a;
    check_len("layernorm_backward dx [n, c]", dx, n * c);
    check_len("layernorm_backward dout [n, c]", dout, n * c);
    check_len("layernorm_backward x [n, c]", x, n * c);
    check_len("layernorm_backward dweight [c]", dw, c);
    check_len("layernorm_backward dbias [c]", db, c);
    check_len("layernorm_backward weight [c]", w, c);
    check_len("layernorm_backward mean [n]", mean, n);
    check_len("layernorm_backward rstd [n]", rstd, n);
    if let Some(b) = dx_bf16 {
        check_len("layernorm_backward dx_bf16 [n, c]", b, n * c);
    }
    let dxb = dx_bf16.map_or(0u64, |b| b.raw);
    let need = layernorm_backward_scratch(n, c);
    assert!(scratch.len >= need, "layernorm_backward: scratch needs {need} f32 elements, got {}", scratch.len);
    if let Some(cs) = dx_bf16_sums {
        assert!(dx_bf16.is_some(), "layernorm_backward: the bf16 dx's column sums need the bf16 dx");
        let need = bias_grad_scratch(n, c);
        assert!(cs.len >= need, "layernorm_backward: the bf16 dx's column sums need {need} f32 elements, got {}", cs.len);
    }
    if n == 0 || c == 0 {
        return Ok(());
    }
    let (n_i, c_i) = (i32_of("n", n), i32_of("c", c));
    let nb = colsum_blocks(n);
    let rows_per = i32_of("rows per block", colsum_rows_per(n));
    let (pw, pb) = (scratch.slice(0..nb * c), scratch.slice(nb * c..2 * nb * c));
    // First pass: dx (and its bf16 copy) and the column partials; then both sums finish.
    if fused {
        assert!(a.one_pass_fits(), "layernorm_backward: the one-pass kernel does not fit c={c}");
        let cfg = LaunchConfig { grid_dim: (nb as u32, 1, 1), block_dim: ((c / 4) as u32, 1, 1), shared_mem_bytes: 0 };
        let cs = dx_bf16_sums.map_or(0u64, |p| p.raw);
        launch!(gpu, s, "layernorm_bwd_fused", cfg; dx.raw, dxb, scratch.raw, cs, dout.raw, x.raw, w.raw, mean.raw, rstd.raw, n_i, c_i, rows_per)?;
    } else {
        let cfg = ln_cfg(n);
        let aligned_all = aligned(x, 16) && aligned(dx, 16) && aligned(dout, 8) && aligned(w, 8) && dx_bf16.is_none_or(|b| aligned(b, 8));
        match ln_wide(c).filter(|_| aligned_all) {
            Some(false) => launch!(gpu, s, "layernorm_bwd_dx_vec", cfg; dx.raw, dxb, dout.raw, x.raw, w.raw, mean.raw, rstd.raw, n_i, c_i)?,
            Some(true) => {
                launch!(gpu, s, "layernorm_bwd_dx_vec16", cfg; dx.raw, dxb, dout.raw, x.raw, w.raw, mean.raw, rstd.raw, n_i, c_i)?
            }
            None => launch!(gpu, s, "layernorm_bwd_dx_gen", cfg; dx.raw, dxb, dout.raw, x.raw, w.raw, mean.raw, rstd.raw, n_i, c_i)?,
        }
        if c % 4 == 0 && aligned(x, 16) && aligned(dout, 8) && aligned(scratch, 16) {
            let cfg = LaunchConfig {
                grid_dim: ((c / 4).div_ceil(COL_THREADS8 as usize) as u32, nb as u32, 1),
                block_dim: (COL_THREADS8, 1, 1),
                shared_mem_bytes: 0,
            };
            launch!(gpu, s, "layernorm_bwd_dwdb_partial4", cfg; scratch.raw, dout.raw, x.raw, mean.raw, rstd.raw, n_i, c_i, rows_per)?;
        } else {
            let cfg = LaunchConfig {
                grid_dim: (c.div_ceil(COL_THREADS as usize) as u32, nb as u32, 1),
                block_dim: (COL_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            launch!(gpu, s, "layernorm_bwd_dwdb_partial", cfg; scratch.raw, dout.raw, x.raw, mean.raw, rstd.raw, n_i, c_i, rows_per)?;
        }
        if let (Some(cs), Some(b)) = (dx_bf16_sums, dx_bf16) {
            bias_grad_partials(gpu, s, cs, b, n, c)?;
        }
    }
    colsum_finish(gpu, s, dw, pw, n, c)?;
    colsum_finish(gpu, s, db, pb, n, c)
}

// ---------------------------------------------------------------------------------------------
// Bias, GELU, residual
// ---------------------------------------------------------------------------------------------

/// y[r, j] = bf16(y[r, j] + bias[j])   (in place).
pub fn bias_add(gpu: &Gpu, s: &CudaStream, y: DPtr<bf16>, bias: DPtr<bf16>, n: usize, f: usize) -> Result<()> {
    check_len("bias_add y [n, f]", y, n * f);
    check_len("bias_add bias [f]", bias, f);
    if n * f == 0 {
        return Ok(());
    }
    let vec = (f % 8 == 0 && aligned(y, 16) && aligned(bias, 16)) as i32;
    let (len, f_i) = ((n * f) as u64, i32_of("f", f));
    let cfg = ew_cfg("bias_add", n * f);
    launch!(gpu, s, "bias_add", cfg; y.raw, bias.raw, len, f_i, vec)
}

/// pre[r, j] = bf16(pre + bias[j]) in place, then out = bf16(gelu_tanh(pre)) of the rounded pre.
pub fn bias_gelu_forward(gpu: &Gpu, s: &CudaStream, pre: DPtr<bf16>, out: DPtr<bf16>, bias: DPtr<bf16>, n: usize, f: usize) -> Result<()> {
    check_len("bias_gelu_forward pre [n, f]", pre, n * f);
    check_len("bias_gelu_forward out [n, f]", out, n * f);
    check_len("bias_gelu_forward bias [f]", bias, f);
    if n * f == 0 {
        return Ok(());
    }
    let vec = (f % 8 == 0 && aligned(pre, 16) && aligned(out, 16) && aligned(bias, 16)) as i32;
    let (len, f_i) = ((n * f) as u64, i32_of("f", f));
    let cfg = ew_cfg("bias_gelu_forward", n * f);
    launch!(gpu, s, "bias_gelu_fwd", cfg; pre.raw, out.raw, bias.raw, len, f_i, vec)
}

/// out = bf16(gelu(bf16(pre + bias))) with `pre` (the GEMM output) left as it is: bit-identical
/// to [`bias_gelu_forward`]'s `out`, one write fewer; pair it with [`gelu_backward_bias`].
pub fn bias_gelu_forward_out(
    gpu: &Gpu,
    s: &CudaStream,
    pre: DPtr<bf16>,
    out: DPtr<bf16>,
    bias: DPtr<bf16>,
    n: usize,
    f: usize,
) -> Result<()> {
    check_len("bias_gelu_forward_out pre [n, f]", pre, n * f);
    check_len("bias_gelu_forward_out out [n, f]", out, n * f);
    check_len("bias_gelu_forward_out bias [f]", bias, f);
    if n * f == 0 {
        return Ok(());
    }
    let vec = (f % 8 == 0 && aligned(pre, 16) && aligned(out, 16) && aligned(bias, 16)) as i32;
    let (len, f_i) = ((n * f) as u64, i32_of("f", f));
    let cfg = ew_cfg("bias_gelu_forward_out", n * f);
    launch!(gpu, s, "bias_gelu_fwd_out", cfg; pre.raw, out.raw, bias.raw, len, f_i, vec)
}

/// dpre = bf16(gelu'(bf16(pre + bias)) · dout) for an unbiased `pre` (see [`bias_gelu_forward_out`]).
// Allowed: llm.c's order, as the CPU ops take it (outputs, inputs, then the shape), plus the GPU
// and the stream.
#[allow(clippy::too_many_arguments)]
pub fn gelu_backward_bias(
    gpu: &Gpu,
    s: &CudaStream,
    dpre: DPtr<bf16>,
    dout: DPtr<bf16>,
    pre: DPtr<bf16>,
    bias: DPtr<bf16>,
    n: usize,
    f: usize,
) -> Result<()> {
    check_len("gelu_backward_bias dpre [n, f]", dpre, n * f);
    check_len("gelu_backward_bias dout [n, f]", dout, n * f);
    check_len("gelu_backward_bias pre [n, f]", pre, n * f);
    check_len("gelu_backward_bias bias [f]", bias, f);
    if n * f == 0 {
        return Ok(());
    }
    let vec = (f % 8 == 0 && aligned(dpre, 16) && aligned(dout, 16) && aligned(pre, 16) && aligned(bias, 16)) as i32;
    let (len, f_i) = ((n * f) as u64, i32_of("f", f));
    let cfg = ew_cfg("gelu_backward_bias", n * f);
    launch!(gpu, s, "gelu_bwd_bias", cfg; dpre.raw, dout.raw, pre.raw, bias.raw, len, f_i, vec)
}

/// dpre = bf16(gelu'(pre) · dout)   (written, not accumulated).
pub fn gelu_backward(gpu: &Gpu, s: &CudaStream, dpre: DPtr<bf16>, dout: DPtr<bf16>, pre: DPtr<bf16>, len: usize) -> Result<()> {
    check_len("gelu_backward dpre", dpre, len);
    check_len("gelu_backward dout", dout, len);
    check_len("gelu_backward pre", pre, len);
    if len == 0 {
        return Ok(());
    }
    let vec = (aligned(dpre, 16) && aligned(dout, 16) && aligned(pre, 16)) as i32;
    let len_u = len as u64;
    let cfg = ew_cfg("gelu_backward", len);
    launch!(gpu, s, "gelu_bwd", cfg; dpre.raw, dout.raw, pre.raw, len_u, vec)
}

/// out[r, j] = x[r, j] + (bf2f(y[r, j]) + bf2f(bias[j]))   (f32 residual stream; `out` may be `x`).
// Allowed: llm.c's order, as the CPU ops take it (outputs, inputs, then the shape), plus the GPU
// and the stream.
#[allow(clippy::too_many_arguments)]
pub fn residual_bias_add(
    gpu: &Gpu,
    s: &CudaStream,
    out: DPtr<f32>,
    x: DPtr<f32>,
    y: DPtr<bf16>,
    bias: DPtr<bf16>,
    n: usize,
    c: usize,
) -> Result<()> {
    check_len("residual_bias_add out [n, c]", out, n * c);
    check_len("residual_bias_add x [n, c]", x, n * c);
    check_len("residual_bias_add y [n, c]", y, n * c);
    check_len("residual_bias_add bias [c]", bias, c);
    assert!(
        out.raw == x.raw || out.raw + out.bytes() as u64 <= x.raw || x.raw + x.bytes() as u64 <= out.raw,
        "residual_bias_add: out partially overlaps x"
    );
    if n * c == 0 {
        return Ok(());
    }
    let vec = (c % 8 == 0 && aligned(out, 16) && aligned(x, 16) && aligned(y, 16) && aligned(bias, 16)) as i32;
    let (len, c_i) = ((n * c) as u64, i32_of("c", c));
    let cfg = ew_cfg("residual_bias_add", n * c);
    launch!(gpu, s, "residual_bias_add", cfg; out.raw, x.raw, y.raw, bias.raw, len, c_i, vec)
}

/// The buffers of [`residual_layernorm_forward`] over `[n, c]` rows: `xo ← x + (y + yb)` (f32 residual
/// stream; `xo` may be `x`), then `out`, `mean`, `rstd` as [`layernorm_forward`] writes them for
/// `xo` with weight `w` and bias `b`.
#[derive(Clone, Copy)]
pub struct ResidualLn {
    pub xo: DPtr<f32>,
    pub out: DPtr<bf16>,
    pub mean: DPtr<f32>,
    pub rstd: DPtr<f32>,
    pub x: DPtr<f32>,
    pub y: DPtr<bf16>,
    pub yb: DPtr<bf16>,
    pub w: DPtr<bf16>,
    pub b: DPtr<bf16>,
    pub n: usize,
    pub c: usize,
}

/// `xo = x + (y + yb)` (f32; `xo` may be `x`) then `out = LN(xo)·w + b` with mean and rstd: the
/// residual add of a projection and the LayerNorm after it. One pass (`residual_layernorm_fwd_vec`,
/// which keeps the row in registers) where [`layernorm_forward`] takes its register path, else
/// the two kernels; either way the bits of [`residual_bias_add`] then [`layernorm_forward`].
pub fn residual_layernorm_forward(gpu: &Gpu, s: &CudaStream, a: &ResidualLn) -> Result<()> {
    let ResidualLn { xo, out, mean, rstd, x, y, yb, w, b, n, c } = *a;
    let wide = ln_wide(c);
    let vec = wide.is_some()
        && aligned(x, 16)
        && aligned(xo, 16)
        && aligned(y, 8)
        && aligned(yb, 8)
        && aligned(out, 8)
        && aligned(w, 8)
        && aligned(b, 8)
        && (xo.raw == x.raw || xo.raw + xo.bytes() as u64 <= x.raw || x.raw + x.bytes() as u64 <= xo.raw);
    if !vec || n == 0 {
        residual_bias_add(gpu, s, xo, x, y, yb, n, c)?;
        return layernorm_forward(gpu, s, out, mean, rstd, xo, w, b, n, c);
    }
    check_len("residual_layernorm_forward xo [n, c]", xo, n * c);
    check_len("residual_layernorm_forward x [n, c]", x, n * c);
    check_len("residual_layernorm_forward y [n, c]", y, n * c);
    check_len("residual_layernorm_forward y bias [c]", yb, c);
    check_len("residual_layernorm_forward out [n, c]", out, n * c);
    check_len("residual_layernorm_forward mean [n]", mean, n);
    check_len("residual_layernorm_forward rstd [n]", rstd, n);
    check_len("residual_layernorm_forward weight [c]", w, c);
    check_len("residual_layernorm_forward bias [c]", b, c);
    let (n_i, c_i) = (i32_of("n", n), i32_of("c", c));
    let cfg = ln_cfg(n);
    if wide == Some(true) {
        launch!(gpu, s, "residual_layernorm_fwd_vec16", cfg; xo.raw, out.raw, mean.raw, rstd.raw, x.raw, y.raw, yb.raw, w.raw, b.raw, n_i, c_i)
    } else {
        launch!(gpu, s, "residual_layernorm_fwd_vec", cfg; xo.raw, out.raw, mean.raw, rstd.raw, x.raw, y.raw, yb.raw, w.raw, b.raw, n_i, c_i)
    }
}

/// f32 elements of scratch [`bias_grad`] needs: row_blocks · f.
pub fn bias_grad_scratch(n: usize, f: usize) -> usize {
    colsum_blocks(n) * f
}

/// db[j] += Σ_r dy[r, j]   (two fixed-order passes through `scratch`, ≥ [`bias_grad_scratch`]).
pub fn bias_grad(gpu: &Gpu, s: &CudaStream, db: DPtr<f32>, dy: DPtr<bf16>, scratch: DPtr<f32>, n: usize, f: usize) -> Result<()> {
    check_len("bias_grad db [f]", db, f);
    bias_grad_partials(gpu, s, scratch, dy, n, f)?;
    colsum_finish(gpu, s, db, scratch, n, f)
}

/// The first pass of [`bias_grad`]: `scratch[rb, j]` = Σ of dy[r, j] over row block rb's rows
/// in ascending order ([`colsum_rows_per`] rows a block).
fn bias_grad_partials(gpu: &Gpu, s: &CudaStream, scratch: DPtr<f32>, dy: DPtr<bf16>, n: usize, f: usize) -> Result<()> {
    check_len("bias_grad dy [n, f]", dy, n * f);
    let need = bias_grad_scratch(n, f);
    assert!(scratch.len >= need, "bias_grad: scratch needs {need} f32 elements, got {}", scratch.len);
    if n == 0 || f == 0 {
        return Ok(());
    }
    let nb = colsum_blocks(n);
    let (n_i, f_i, rows_per) = (i32_of("n", n), i32_of("f", f), i32_of("rows per block", colsum_rows_per(n)));
    if f % 8 == 0 && aligned(dy, 16) && aligned(scratch, 16) {
        let cfg = LaunchConfig {
            grid_dim: ((f / 8).div_ceil(COL_THREADS8 as usize) as u32, nb as u32, 1),
            block_dim: (COL_THREADS8, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(gpu, s, "bias_grad_partial8", cfg; scratch.raw, dy.raw, n_i, f_i, rows_per)
    } else {
        let cfg = LaunchConfig {
            grid_dim: (f.div_ceil(COL_THREADS as usize) as u32, nb as u32, 1),
            block_dim: (COL_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(gpu, s, "bias_grad_partial", cfg; scratch.raw, dy.raw, n_i, f_i, rows_per)
    }
}

/// The second pass of the column sums over `n` rows and `c` columns: dst[j] += Σ_rb
/// partials[rb, j] in the fixed order of `colsum_finish` ([`COLSUM_WARPS`] interleaved chains,
/// then a pairwise tree).
pub fn colsum_finish(gpu: &Gpu, s: &CudaStream, dst: DPtr<f32>, partials: DPtr<f32>, n: usize, c: usize) -> Result<()> {
    check_len("colsum_finish dst [c]", dst, c);
    let nb = colsum_blocks(n);
    assert!(partials.len >= nb * c, "colsum_finish: {nb} × {c} partials needed, got {}", partials.len);
    if n == 0 || c == 0 {
        return Ok(());
    }
    let (nb_i, c_i) = (i32_of("row blocks", nb), i32_of("c", c));
    let cfg = colsum_finish_cfg(c);
    launch!(gpu, s, "colsum_finish", cfg; dst.raw, partials.raw, nb_i, c_i)
}

// ---------------------------------------------------------------------------------------------
// Casts, f32 helpers
// ---------------------------------------------------------------------------------------------

/// out = bf16(x) (round to nearest even, as `half::bf16::from_f32`).
pub fn cast_f32_to_bf16(gpu: &Gpu, s: &CudaStream, out: DPtr<bf16>, x: DPtr<f32>) -> Result<()> {
    check_len("cast_f32_to_bf16 out", out, x.len);
    if x.len == 0 {
        return Ok(());
    }
    let (len, vec) = (x.len as u64, (aligned(out, 16) && aligned(x, 16)) as i32);
    let cfg = ew_cfg("cast_f32_to_bf16", x.len);
    launch!(gpu, s, "cast_f32_bf16", cfg; out.raw, x.raw, len, vec)
}

/// out = f32(x).
pub fn cast_bf16_to_f32(gpu: &Gpu, s: &CudaStream, out: DPtr<f32>, x: DPtr<bf16>) -> Result<()> {
    check_len("cast_bf16_to_f32 out", out, x.len);
    if x.len == 0 {
        return Ok(());
    }
    let (len, vec) = (x.len as u64, (aligned(out, 16) && aligned(x, 16)) as i32);
    let cfg = ew_cfg("cast_bf16_to_f32", x.len);
    launch!(gpu, s, "cast_bf16_f32", cfg; out.raw, x.raw, len, vec)
}

/// dst += src.
pub fn add_f32(gpu: &Gpu, s: &CudaStream, dst: DPtr<f32>, src: DPtr<f32>) -> Result<()> {
    check_len("add_f32 src", src, dst.len);
    if dst.len == 0 {
        return Ok(());
    }
    let (len, vec) = (dst.len as u64, (aligned(dst, 16) && aligned(src, 16)) as i32);
    let cfg = ew_cfg("add_f32", dst.len);
    launch!(gpu, s, "add_f32", cfg; dst.raw, src.raw, len, vec)
}

/// x ← f32(f16(x)) in place: fp16 storage of f32 values (round to nearest even, beyond ±65504
/// → ±inf, fp16 subnormals kept), as the CPU's `dtype::round_to(F16, …)` and the `half` crate.
pub fn round_f16(gpu: &Gpu, s: &CudaStream, x: DPtr<f32>) -> Result<()> {
    if x.len == 0 {
        return Ok(());
    }
    assert!(x.len.div_ceil(256) <= i32::MAX as usize, "round_f16: {} elements exceed the grid limit", x.len);
    let (len, cfg) = (x.len as u64, grid_1d(x.len, 256));
    launch!(gpu, s, "round_f16", cfg; x.raw, len)
}

/// dst *= a.
pub fn scale_f32(gpu: &Gpu, s: &CudaStream, dst: DPtr<f32>, a: f32) -> Result<()> {
    if dst.len == 0 {
        return Ok(());
    }
    let (len, vec) = (dst.len as u64, aligned(dst, 16) as i32);
    let cfg = ew_cfg("scale_f32", dst.len);
    launch!(gpu, s, "scale_f32", cfg; dst.raw, a, len, vec)
}

// ---------------------------------------------------------------------------------------------
// Cross-entropy
// ---------------------------------------------------------------------------------------------

/// Fused softmax cross-entropy over rows of `logits` [n, vp] (row stride vp ≥ v; columns v..vp
/// are padding, excluded from the softmax, their gradient set to 0). losses[r] = lse −
/// logit[target] (f64 Σexp and log like the CPU, rounded to f32 once). If `dscale != 0`,
/// overwrites `logits` IN PLACE with d = (softmax − onehot)·dscale in bf16 (dscale = d(loss)/n for
/// a mean). A target ≥ v gives a NaN loss. One block of 512 threads per row.
// Allowed: llm.c's order, as the CPU ops take it (outputs, inputs, then the shape), plus the GPU
// and the stream.
#[allow(clippy::too_many_arguments)]
pub fn crossentropy(
    gpu: &Gpu,
    s: &CudaStream,
    losses: DPtr<f32>,
    logits: DPtr<bf16>,
    targets: DPtr<u32>,
    n: usize,
    v: usize,
    vp: usize,
    dscale: f32,
) -> Result<()> {
    assert!(v > 0 && v <= vp, "crossentropy: need 0 < v ≤ vp, got v={v}, vp={vp}");
    check_len("crossentropy losses [n]", losses, n);
    check_len("crossentropy targets [n]", targets, n);
    check_len("crossentropy logits [n, vp]", logits, n * vp);
    if n == 0 {
        return Ok(());
    }
    let (v_i, vp_i) = (i32_of("v", v), i32_of("vp", vp));
    let vec = (vp % 8 == 0 && aligned(logits, 16)) as i32;
    let cfg = LaunchConfig {
        grid_dim: (u32::try_from(n).ok().filter(|&g| g <= i32::MAX as u32).expect("crossentropy: too many rows"), 1, 1),
        block_dim: (CE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    launch!(gpu, s, "crossentropy_fwd_bwd", cfg; losses.raw, logits.raw, targets.raw, v_i, vp_i, dscale, vec)
}

// ---------------------------------------------------------------------------------------------
// Gradient norms, AdamW
// ---------------------------------------------------------------------------------------------

/// out[i] = Σ x[i*block .. min((i+1)*block, len)]², in f64 exactly as the CPU's partial norms
/// (`optim::norm`: 8 interleaved f64 lanes relative to the block start, index order, combined
/// ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7))). With `block = NORM_BLOCK` over a flat buffer whose
/// tensors are block-aligned these are the CPU's slot partials bit for bit. `out` has
/// ceil(len/block) elements.
pub fn sum_squares_blocks(gpu: &Gpu, s: &CudaStream, out: DPtr<f64>, x: DPtr<f32>, block: usize) -> Result<()> {
    assert!(block > 0, "sum_squares_blocks: block must be > 0");
    let nblocks = x.len.div_ceil(block);
    check_len("sum_squares_blocks out [ceil(len/block)]", out, nblocks);
    if nblocks == 0 {
        return Ok(());
    }
    let (len, blk, nb) = (x.len as u64, block as u64, nblocks as u64);
    assert!((nblocks * 8).div_ceil(256) <= i32::MAX as usize, "sum_squares_blocks: too many blocks");
    let cfg = grid_1d(nblocks * 8, 256);
    launch!(gpu, s, "sum_squares_blocks", cfg; out.raw, x.raw, len, blk, nb)
}

/// Page-locked host memory and event flags, for the host-side AdamW of optimizer offload
/// (`src/gpu/offload.rs`), which stages gradients and parameters through such memory and waits
/// for the copies with blocking events.
pub use cudarc::driver::{sys::CUevent_flags as EventFlags, PinnedHostSlice};

/// Scalar hyper-parameters of one AdamW step, computed on the host like the CPU optimizer
/// (`optim::adam::AdamParams::coeffs`, AdamW mode with bias correction): f64 → f32 once.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamStep {
    /// The learning rate this step ran at (for logs).
    pub lr: f32,
    /// 1 − β1 (the lerp weight of m).
    pub lerp_w: f32,
    pub beta2: f32,
    pub one_minus_beta2: f32,
    /// lr / (1 − β1^step).
    pub step_size: f32,
    /// √(1 − β2^step).
    pub bc2_sqrt: f32,
    pub eps: f32,
    /// 1 − lr·wd (decoupled weight decay, AdamW), applied where the decay mask is set; 1 for
    /// Adam with an L2 penalty.
    pub decoupled_factor: f32,
    /// Adam with an L2 penalty (`adam_w_mode = false`): `g ← g + wd·p` where the decay mask is
    /// set; 0 for AdamW.
    pub l2: f32,
}

impl AdamStep {
    /// `step` is 1-based (the step being taken). Panics on step 0.
    pub fn new(lr: f32, betas: (f32, f32), eps: f32, weight_decay: f32, step: u64) -> AdamStep {
        assert!(step >= 1, "AdamStep: step is 1-based, got 0");
        let (b1, b2) = (f64::from(betas.0), f64::from(betas.1));
        let (bc1, bc2) = crate::optim::adam::bias_corrections(b1, b2, step, true);
        let lr64 = f64::from(lr);
        AdamStep {
            lr,
            lerp_w: (1.0 - b1) as f32,
            beta2: betas.1,
            one_minus_beta2: (1.0 - b2) as f32,
            step_size: (lr64 / bc1) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            eps,
            decoupled_factor: (1.0 - lr64 * f64::from(weight_decay)) as f32,
            l2: 0.0,
        }
    }

    /// The scalars of update `step` (1-based) of the CPU optimizer `p` at learning rate `lr`,
    /// from its own coefficient code (`AdamParams::coeffs`: this step's betas under a momentum
    /// cycle, bias correction on or off, AdamW's decoupled decay or Adam's L2 penalty).
    pub fn of(p: &crate::optim::AdamParams, lr: f32, step: u64) -> AdamStep {
        let c = p.coeffs(lr, step);
        let (decoupled, l2) = (c.has_decay && c.adam_w_mode, c.has_decay && !c.adam_w_mode);
        AdamStep {
            lr,
            lerp_w: c.lerp_w,
            beta2: c.beta2,
            one_minus_beta2: c.one_minus_beta2,
            step_size: c.step_size,
            bc2_sqrt: c.bc2_sqrt,
            eps: c.eps,
            decoupled_factor: if decoupled { c.decoupled_factor } else { 1.0 },
            l2: if l2 { c.l2 } else { 0.0 },
        }
    }
}

/// The buffers one optimizer launch ([`adamw`], `cuda::optim::step`) reads and writes, as long
/// as `master`: the fp32 masters and state (updated in place: Adam's `m` and `v`, Lion's `m`,
/// SGD's momentum buffer in `m`; a buffer the optimizer does not keep is empty), the gradient,
/// the bf16 parameters (written: the new masters rounded) and the decay mask (1 where weight
/// decay applies).
#[derive(Clone, Copy)]
pub struct OptimBufs {
    pub master: DPtr<f32>,
    pub param: DPtr<bf16>,
    pub grad: DPtr<f32>,
    pub m: DPtr<f32>,
    pub v: DPtr<f32>,
    pub decay: DPtr<u8>,
}

/// Fused Adam/AdamW on a flat shard, per element as `optim::adam`: g = grad·grad_scale;
/// p ← p·(1−lr·wd) where decay[i] != 0 (AdamW) or g ← g + wd·p there (Adam, `hp.l2`);
/// m ← lerp(m, g, 1−β1); v ← β2·v + ((1−β2)·g)·g;
/// p ← p − step_size·(m / (√v/√bc2 + eps)); master = p, param = bf16(p).
pub fn adamw(gpu: &Gpu, s: &CudaStream, bufs: &OptimBufs, hp: &AdamStep, grad_scale: f32) -> Result<()> {
    let OptimBufs { master, param, grad, m, v, decay } = *bufs;
    let len = master.len;
    check_len("adamw param", param, len);
    check_len("adamw grad", grad, len);
    check_len("adamw m", m, len);
    check_len("adamw v", v, len);
    check_len("adamw decay mask", decay, len);
    if len == 0 {
        return Ok(());
    }
    assert!(len.div_ceil(256) <= i32::MAX as usize, "adamw: {len} elements exceed the grid limit");
    let len_u = len as u64;
    let cfg = grid_1d(len, 256);
    launch!(gpu, s, "adamw", cfg; master.raw, param.raw, grad.raw, m.raw, v.raw, decay.raw, len_u,
        hp.lerp_w, hp.beta2, hp.one_minus_beta2, hp.step_size, hp.bc2_sqrt, hp.eps, hp.decoupled_factor, grad_scale, hp.l2)
}
