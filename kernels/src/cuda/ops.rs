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
//! above); subnormals are flushed to zero on the GPU. `check` compares everything with the CPU ops.
#![allow(clippy::too_many_arguments)]

use cudarc::driver::{CudaStream, LaunchConfig, PushKernelArg};

use super::{bf16, drv, grid_1d, CheckRow, DPtr, Gpu, Result};

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
    let vocab = u32::try_from(dwte.len / c).expect("vocabulary fits u32");
    let c_i = i32_of("c", c);
    if uniq.len > 0 {
        let cfg = LaunchConfig {
            grid_dim: (u32::try_from(uniq.len).expect("unique tokens fit the grid"), c.div_ceil(COL_THREADS as usize) as u32, 1),
            block_dim: (COL_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        assert!(cfg.grid_dim.1 <= 65535, "embedding_backward: c={c} too wide for the grid");
        launch!(gpu, s, "embedding_bwd_wte", cfg; dwte.raw, dx.raw, uniq.raw, offsets.raw, positions.raw, c_i, vocab)?;
    }
    let (b_i, t_i) = (i32_of("b", b), i32_of("t", t));
    let cfg = grid_1d(t * c, COL_THREADS);
    launch!(gpu, s, "embedding_bwd_wpe", cfg; dwpe.raw, dx.raw, b_i, t_i, c_i)
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

/// `xo = x + (y + yb)` (f32; `xo` may be `x`) then `out = LN(xo)·w + b` with mean and rstd: the
/// residual add of a projection and the LayerNorm after it. One pass (`residual_layernorm_fwd_vec`,
/// which keeps the row in registers) where [`layernorm_forward`] takes its register path, else
/// the two kernels; either way the bits of [`residual_bias_add`] then [`layernorm_forward`].
#[allow(clippy::too_many_arguments)]
pub fn residual_layernorm_forward(
    gpu: &Gpu,
    s: &CudaStream,
    xo: DPtr<f32>,
    out: DPtr<bf16>,
    mean: DPtr<f32>,
    rstd: DPtr<f32>,
    x: DPtr<f32>,
    y: DPtr<bf16>,
    yb: DPtr<bf16>,
    w: DPtr<bf16>,
    b: DPtr<bf16>,
    n: usize,
    c: usize,
) -> Result<()> {
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
    /// 1 − lr·wd (decoupled weight decay), applied where the decay mask is set.
    pub decoupled_factor: f32,
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
        }
    }
}

/// Fused AdamW on a flat shard, per element as `optim::adam` (AdamW mode): g = grad·grad_scale;
/// p ← p·(1−lr·wd) where decay[i] != 0; m ← lerp(m, g, 1−β1); v ← β2·v + ((1−β2)·g)·g;
/// p ← p − step_size·(m / (√v/√bc2 + eps)); master = p, param = bf16(p).
pub fn adamw(
    gpu: &Gpu,
    s: &CudaStream,
    master: DPtr<f32>,
    param: DPtr<bf16>,
    grad: DPtr<f32>,
    m: DPtr<f32>,
    v: DPtr<f32>,
    decay: DPtr<u8>,
    hp: &AdamStep,
    grad_scale: f32,
) -> Result<()> {
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
        hp.lerp_w, hp.beta2, hp.one_minus_beta2, hp.step_size, hp.bc2_sqrt, hp.eps, hp.decoupled_factor, grad_scale)
}

// ---------------------------------------------------------------------------------------------
// GPU vs CPU check
// ---------------------------------------------------------------------------------------------

const F32_FLOOR: f64 = 1e-3;
const F32_TOL: f64 = 1e-5;
const BF16_FLOOR: f64 = 1e-2;
const BF16_TOL: f64 = 1e-2;

fn randv(seed: u64, key: u64, len: usize, std: f32) -> Vec<f32> {
    let mut v = vec![0f32; len];
    crate::tensor::Rng::derive(seed, &[0x006f_7073, key]).fill_normal(&mut v, std);
    v
}

fn to_bf(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

fn bf_to_f32(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// The CPU f32 reference rounded to bf16 (what a bf16 output can at best be).
fn round_bf(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}

fn row_f32(name: String, gpu: &[f32], cpu: &[f32]) -> CheckRow {
    CheckRow::compare(name, gpu, cpu, F32_FLOOR, F32_TOL)
}

fn row_bf(name: String, gpu: &[bf16], cpu_f32: &[f32]) -> CheckRow {
    CheckRow::compare(name, &bf_to_f32(gpu), &round_bf(cpu_f32), BF16_FLOOR, BF16_TOL)
}

/// dst[j] + Σ_r term(r, j) in the GPU's two-pass order — f32 on the host: row blocks of
/// [`colsum_rows_per`] rows summed ascending from 0; then partial rows ≡ w (mod
/// [`COLSUM_WARPS`]) summed ascending per w, combined ((w0+w1)+(w2+w3))+((w4+w5)+(w6+w7)), added
/// to dst.
fn colsum_blocked_ref(dst: &[f32], n: usize, c: usize, term: impl Fn(usize, usize) -> f32) -> Vec<f32> {
    let rows_per = colsum_rows_per(n);
    let nb = colsum_blocks(n);
    let mut partials = vec![0f32; nb * c];
    for rb in 0..nb {
        for r in rb * rows_per..((rb + 1) * rows_per).min(n) {
            for j in 0..c {
                partials[rb * c + j] += term(r, j);
            }
        }
    }
    (0..c)
        .map(|j| {
            let mut w = [0f32; COLSUM_WARPS];
            for (rb, p) in partials.chunks_exact(c).enumerate() {
                w[rb % COLSUM_WARPS] += p[j];
            }
            dst[j] + (((w[0] + w[1]) + (w[2] + w[3])) + ((w[4] + w[5]) + (w[6] + w[7])))
        })
        .collect()
}

/// GPU vs CPU on fresh random inputs (`seed`): every kernel above at GPT-2 small sizes (n = 4096
/// rows, c = 768, f = 3072; cross-entropy n = 512, v = 50257, vp = 50304; embedding B=4, T=1024,
/// V=50257 with many repeated tokens). One [`CheckRow`] per output tensor.
///
/// References: the CPU ops in `crate::ops` / `crate::optim` on the same (bf16-valued) inputs.
/// f32 outputs: tol 1e-5 relative with floor 1e-3. bf16 outputs: the CPU's f32 result rounded to
/// bf16, tol 1e-2 with floor 1e-2. Exceptions, each named in its row:
/// * column sums (LayerNorm dweight/dbias, bias_grad): the reference is the same f32 sum in the
///   GPU's documented blocked order (the CPU sums all rows sequentially, whose own rounding error
///   on 4096-row sums exceeds 1e-5 relative for columns that nearly cancel);
/// * LayerNorm backward uses the GPU's saved mean/rstd on both sides (isolates the backward);
/// * cross-entropy gradients (≈1e-5·dscale each) use floor = 1e-2 · max|reference|;
/// * sums of squares are f64 and compared at 1e-12.
pub fn check(gpu: &Gpu, seed: u64) -> Result<Vec<CheckRow>> {
    let s: &CudaStream = &gpu.stream;
    let mut rows = Vec::new();
    let (n, c, f) = (4096usize, 768usize, 3072usize);
    let mut rng = crate::tensor::Rng::derive(seed, &[0x006f_7073]);

    // ---- embedding ----
    {
        let (b, t, vocab) = (4usize, 1024usize, 50257usize);
        let tokens: Vec<u32> = (0..b * t)
            .map(|i| if i % 3 == 0 { rng.gen_range(vocab as u64) as u32 } else { rng.gen_range(40) as u32 * 997 % vocab as u32 })
            .collect();
        let wte = round_bf(&randv(seed, 1, vocab * c, 0.02));
        let wpe = round_bf(&randv(seed, 2, t * c, 0.01));
        let (d_wte, d_wpe, d_tok) = (gpu.upload(&to_bf(&wte))?, gpu.upload(&to_bf(&wpe))?, gpu.upload(&tokens)?);
        let d_x = gpu.alloc::<f32>(b * t * c)?;
        embedding_forward(gpu, s, d_x.ptr(), d_tok.ptr(), d_wte.ptr(), d_wpe.ptr(), b, t, c)?;
        let mut want = vec![0f32; b * t * c];
        crate::ops::embedding::embedding_forward(&mut want, &tokens, &wte, Some(&wpe), b, t, c);
        rows.push(row_f32(format!("embedding_forward x [{}×{c}]", b * t), &gpu.download(d_x.ptr())?, &want));

        let dx = randv(seed, 3, b * t * c, 1.0);
        let dwte0 = randv(seed, 4, vocab * c, 0.1);
        let dwpe0 = randv(seed, 5, t * c, 0.1);
        let idx = TokenIndex::new(&tokens, vocab);
        let (d_dx, d_dwte, d_dwpe) = (gpu.upload(&dx)?, gpu.upload(&dwte0)?, gpu.upload(&dwpe0)?);
        let (d_u, d_o, d_p) = (gpu.upload(&idx.uniq)?, gpu.upload(&idx.offsets)?, gpu.upload(&idx.positions)?);
        embedding_backward(gpu, s, d_dwte.ptr(), d_dwpe.ptr(), d_dx.ptr(), d_u.ptr(), d_o.ptr(), d_p.ptr(), b, t, c)?;
        let (mut dwte, mut dwpe) = (dwte0, dwpe0);
        crate::ops::embedding::embedding_backward(&mut dwte, Some(&mut dwpe), &dx, &tokens, b, t, c);
        rows.push(row_f32(format!("embedding_backward dwte [{vocab}×{c}] ({} uniq)", idx.uniq.len()), &gpu.download(d_dwte.ptr())?, &dwte));
        rows.push(row_f32(format!("embedding_backward dwpe [{t}×{c}]"), &gpu.download(d_dwpe.ptr())?, &dwpe));
    }

    // ---- layernorm (GPT-2's width, and 2048: the wide register path) ----
    for (n, c) in [(n, c), (1024usize, 2048usize)] {
        let x: Vec<f32> = randv(seed, 10, n * c, 1.0).iter().map(|v| v + 0.3).collect();
        let w = round_bf(&randv(seed, 11, c, 0.2).iter().map(|v| v + 1.0).collect::<Vec<_>>());
        let bias = round_bf(&randv(seed, 12, c, 0.1));
        let (d_x, d_w, d_b) = (gpu.upload(&x)?, gpu.upload(&to_bf(&w))?, gpu.upload(&to_bf(&bias))?);
        let (d_out, d_mean, d_rstd) = (gpu.alloc::<bf16>(n * c)?, gpu.alloc::<f32>(n)?, gpu.alloc::<f32>(n)?);
        layernorm_forward(gpu, s, d_out.ptr(), d_mean.ptr(), d_rstd.ptr(), d_x.ptr(), d_w.ptr(), d_b.ptr(), n, c)?;
        let (mut out, mut mean, mut rstd) = (vec![0f32; n * c], vec![0f32; n], vec![0f32; n]);
        crate::ops::layernorm::layernorm_forward(&mut out, &mut mean, &mut rstd, &x, &w, &bias, n, c);
        rows.push(row_bf(format!("layernorm_forward out [{n}×{c}] (bf16)"), &gpu.download(d_out.ptr())?, &out));
        let g_mean = gpu.download(d_mean.ptr())?;
        let g_rstd = gpu.download(d_rstd.ptr())?;
        rows.push(row_f32(format!("layernorm_forward mean [{n}]"), &g_mean, &mean));
        rows.push(row_f32(format!("layernorm_forward rstd [{n}]"), &g_rstd, &rstd));

        let dout = round_bf(&randv(seed, 13, n * c, 1.0));
        let (dx0, dw0, db0) = (randv(seed, 14, n * c, 0.5), randv(seed, 15, c, 0.5), randv(seed, 16, c, 0.5));
        let (d_dout, d_dx, d_dw, d_db) = (gpu.upload(&to_bf(&dout))?, gpu.upload(&dx0)?, gpu.upload(&dw0)?, gpu.upload(&db0)?);
        let d_scratch = gpu.alloc::<f32>(layernorm_backward_scratch(n, c))?;
        let d_dxb = gpu.alloc::<bf16>(n * c)?;
        let a = LnBackward {
            dx: d_dx.ptr(),
            dx_bf16: Some(d_dxb.ptr()),
            dx_bf16_sums: None,
            dw: d_dw.ptr(),
            db: d_db.ptr(),
            dout: d_dout.ptr(),
            x: d_x.ptr(),
            w: d_w.ptr(),
            mean: d_mean.ptr(),
            rstd: d_rstd.ptr(),
            scratch: d_scratch.ptr(),
            n,
            c,
        };
        layernorm_backward(gpu, s, &a)?;
        let (mut dx, mut dw_seq, mut db_seq) = (dx0.clone(), dw0.clone(), db0.clone());
        crate::ops::layernorm::layernorm_backward(&mut dx, &mut dw_seq, &mut db_seq, &dout, &x, &w, &g_mean, &g_rstd, n, c);
        // Row sums run lane-parallel on the GPU (sequential on the CPU): compare relative to the
        // tensor's scale.
        let rms = (dx.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / dx.len() as f64).sqrt();
        let g_dx = gpu.download(d_dx.ptr())?;
        rows.push(CheckRow::compare(format!("layernorm_backward dx [{n}×{c}] (+=, rms-relative)"), &g_dx, &dx, rms, F32_TOL));
        rows.push(row_bf(format!("layernorm_backward dx copy [{n}×{c}] (bf16)"), &gpu.download(d_dxb.ptr())?, &g_dx));
        let dw = colsum_blocked_ref(&dw0, n, c, |r, j| dout[r * c + j] * (x[r * c + j] - g_mean[r]) * g_rstd[r]);
        let db = colsum_blocked_ref(&db0, n, c, |r, j| dout[r * c + j]);
        rows.push(row_f32(format!("layernorm_backward dweight [{c}] (+=, blocked-order ref)"), &gpu.download(d_dw.ptr())?, &dw));
        rows.push(row_f32(format!("layernorm_backward dbias [{c}] (+=, blocked-order ref)"), &gpu.download(d_db.ptr())?, &db));
    }

    // The one-pass LayerNorm backward gives the separate kernels' bits (dx, its bf16 copy, dweight,
    // dbias and the bf16 dx's column sums), at GPT-2's width (also with a ragged last row block)
    // and on the wide register path.
    // (4133 rows: a last row block of 5 rows and a column-sum finish with a ragged tail.)
    for (n, c) in [(n, c), (4133usize, c), (1024usize, 2048usize)] {
        let x = randv(seed, 40, n * c, 1.0);
        let dout = to_bf(&round_bf(&randv(seed, 41, n * c, 1.0)));
        let lw = to_bf(&round_bf(&randv(seed, 42, c, 0.2).iter().map(|v| v + 1.0).collect::<Vec<_>>()));
        let lb = to_bf(&round_bf(&randv(seed, 43, c, 0.1)));
        let (dx0, dw0, db0, bb0) = (randv(seed, 44, n * c, 0.5), randv(seed, 45, c, 0.5), randv(seed, 46, c, 0.5), randv(seed, 47, c, 0.5));
        let (d_x, d_w, d_b, d_dout) = (gpu.upload(&x)?, gpu.upload(&lw)?, gpu.upload(&lb)?, gpu.upload(&dout)?);
        let (d_mean, d_rstd, d_ln) = (gpu.alloc::<f32>(n)?, gpu.alloc::<f32>(n)?, gpu.alloc::<bf16>(n * c)?);
        layernorm_forward(gpu, s, d_ln.ptr(), d_mean.ptr(), d_rstd.ptr(), d_x.ptr(), d_w.ptr(), d_b.ptr(), n, c)?;
        // `None` when the one-pass kernel does not fit the run's own buffers.
        let run = |fused: bool| -> Result<Option<Vec<u32>>> {
            let (d_dx, d_dw, d_db, d_bb) = (gpu.upload(&dx0)?, gpu.upload(&dw0)?, gpu.upload(&db0)?, gpu.upload(&bb0)?);
            let (d_dxb, d_scratch) = (gpu.alloc::<bf16>(n * c)?, gpu.alloc::<f32>(layernorm_backward_scratch(n, c))?);
            let d_sums = gpu.alloc::<f32>(bias_grad_scratch(n, c))?;
            let a = LnBackward {
                dx: d_dx.ptr(),
                dx_bf16: Some(d_dxb.ptr()),
                dx_bf16_sums: Some(d_sums.ptr()),
                dw: d_dw.ptr(),
                db: d_db.ptr(),
                dout: d_dout.ptr(),
                x: d_x.ptr(),
                w: d_w.ptr(),
                mean: d_mean.ptr(),
                rstd: d_rstd.ptr(),
                scratch: d_scratch.ptr(),
                n,
                c,
            };
            if fused && !a.one_pass_fits() {
                return Ok(None);
            }
            layernorm_backward_with(gpu, s, &a, fused)?;
            colsum_finish(gpu, s, d_bb.ptr(), d_sums.ptr(), n, c)?;
            let mut bits: Vec<u32> = gpu.download(d_dx.ptr())?.iter().map(|v| v.to_bits()).collect();
            bits.extend(gpu.download(d_dxb.ptr())?.iter().map(|v| v.to_bits() as u32));
            for p in [d_dw.ptr(), d_db.ptr(), d_bb.ptr()] {
                bits.extend(gpu.download(p)?.iter().map(|v| v.to_bits()));
            }
            Ok(Some(bits))
        };
        let same_bits = matches!((run(true)?, run(false)?), (Some(one), Some(separate)) if one == separate);
        let flag = |ok: bool| if ok { 0.0f32 } else { 1.0 };
        rows.push(CheckRow::compare(
            format!("layernorm_backward one pass = dx + column-sum kernels + bias_grad of the bf16 dx [{n}×{c}] (bits)"),
            &[flag(same_bits)],
            &[0.0],
            0.0,
            0.0,
        ));
    }

    // ---- bias / GELU / residual / bias_grad ----
    {
        let y = round_bf(&randv(seed, 20, n * f, 1.0));
        let bias = round_bf(&randv(seed, 21, f, 0.5));
        let d_bias = gpu.upload(&to_bf(&bias))?;
        let biased = round_bf(&(0..n * f).map(|i| y[i] + bias[i % f]).collect::<Vec<_>>());

        let d_y = gpu.upload(&to_bf(&y))?;
        bias_add(gpu, s, d_y.ptr(), d_bias.ptr(), n, f)?;
        rows.push(row_bf(format!("bias_add y [{n}×{f}] (bf16)"), &gpu.download(d_y.ptr())?, &biased));

        let d_pre = gpu.upload(&to_bf(&y))?;
        let d_act = gpu.alloc::<bf16>(n * f)?;
        bias_gelu_forward(gpu, s, d_pre.ptr(), d_act.ptr(), d_bias.ptr(), n, f)?;
        let mut act = vec![0f32; n * f];
        crate::ops::gelu::gelu_forward(&mut act, &biased);
        rows.push(row_bf(format!("bias_gelu_forward pre [{n}×{f}] (bf16)"), &gpu.download(d_pre.ptr())?, &biased));
        rows.push(row_bf(format!("bias_gelu_forward out [{n}×{f}] (bf16)"), &gpu.download(d_act.ptr())?, &act));

        let dout = round_bf(&randv(seed, 22, n * f, 1.0));
        let d_dout = gpu.upload(&to_bf(&dout))?;
        let d_dpre = gpu.alloc::<bf16>(n * f)?;
        gelu_backward(gpu, s, d_dpre.ptr(), d_dout.ptr(), d_pre.ptr(), n * f)?;
        let mut dpre = vec![0f32; n * f];
        crate::ops::gelu::gelu_backward(&mut dpre, &biased, &dout);
        let g_dpre = gpu.download(d_dpre.ptr())?;
        rows.push(row_bf(format!("gelu_backward dpre [{n}×{f}] (bf16)"), &g_dpre, &dpre));
        // The variants that leave the GEMM output unbiased must give the very same bits.
        let (d_raw, d_act2, d_dpre2) = (gpu.upload(&to_bf(&y))?, gpu.alloc::<bf16>(n * f)?, gpu.alloc::<bf16>(n * f)?);
        bias_gelu_forward_out(gpu, s, d_raw.ptr(), d_act2.ptr(), d_bias.ptr(), n, f)?;
        gelu_backward_bias(gpu, s, d_dpre2.ptr(), d_dout.ptr(), d_raw.ptr(), d_bias.ptr(), n, f)?;
        let same = |a: &[bf16], b: &[bf16]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        let (out1, out2) = (gpu.download(d_act.ptr())?, gpu.download(d_act2.ptr())?);
        let (dp2, raw) = (gpu.download(d_dpre2.ptr())?, gpu.download(d_raw.ptr())?);
        let flag = |ok: bool| if ok { 0.0 } else { 1.0 };
        let untouched = same(&raw, &to_bf(&y));
        rows.push(CheckRow::compare("bias_gelu_forward_out = bias_gelu_forward out (bits)", &[flag(same(&out1, &out2))], &[0.0], 0.0, 0.0));
        rows.push(CheckRow::compare("bias_gelu_forward_out leaves pre unbiased (bits)", &[flag(untouched)], &[0.0], 0.0, 0.0));
        rows.push(CheckRow::compare("gelu_backward_bias = gelu_backward (bits)", &[flag(same(&g_dpre, &dp2))], &[0.0], 0.0, 0.0));

        let db0 = randv(seed, 23, f, 0.5);
        let d_db = gpu.upload(&db0)?;
        let d_scratch = gpu.alloc::<f32>(bias_grad_scratch(n, f))?;
        bias_grad(gpu, s, d_db.ptr(), d_dout.ptr(), d_scratch.ptr(), n, f)?;
        let db = colsum_blocked_ref(&db0, n, f, |r, j| dout[r * f + j]);
        rows.push(row_f32(format!("bias_grad db [{f}] (+=, blocked-order ref)"), &gpu.download(d_db.ptr())?, &db));

        let x = randv(seed, 24, n * c, 1.0);
        let yc = round_bf(&randv(seed, 25, n * c, 1.0));
        let bc = round_bf(&randv(seed, 26, c, 0.5));
        let (d_x, d_yc, d_bc) = (gpu.upload(&x)?, gpu.upload(&to_bf(&yc))?, gpu.upload(&to_bf(&bc))?);
        residual_bias_add(gpu, s, d_x.ptr(), d_x.ptr(), d_yc.ptr(), d_bc.ptr(), n, c)?;
        let want: Vec<f32> = (0..n * c).map(|i| x[i] + (yc[i] + bc[i % c])).collect();
        rows.push(row_f32(format!("residual_bias_add out=x [{n}×{c}] (in place)"), &gpu.download(d_x.ptr())?, &want));

        // The fused residual + LayerNorm gives the two kernels' bits (in place, as the model runs
        // it), at GPT-2's width and on the wide register path.
        for (n, c) in [(n, c), (1024usize, 2048usize)] {
            let x = randv(seed, 24, n * c, 1.0);
            let yc = round_bf(&randv(seed, 25, n * c, 1.0));
            let bc = round_bf(&randv(seed, 26, c, 0.5));
            let (d_yc, d_bc) = (gpu.upload(&to_bf(&yc))?, gpu.upload(&to_bf(&bc))?);
            let lw = round_bf(&randv(seed, 27, c, 0.2).iter().map(|v| v + 1.0).collect::<Vec<_>>());
            let lb = round_bf(&randv(seed, 28, c, 0.1));
            let (d_lw, d_lb) = (gpu.upload(&to_bf(&lw))?, gpu.upload(&to_bf(&lb))?);
            // Every output's bits, concatenated.
            let two = |fused: bool| -> Result<Vec<u32>> {
                let d_x = gpu.upload(&x)?;
                let (d_out, d_mean, d_rstd) = (gpu.alloc::<bf16>(n * c)?, gpu.alloc::<f32>(n)?, gpu.alloc::<f32>(n)?);
                if fused {
                    residual_layernorm_forward(
                        gpu,
                        s,
                        d_x.ptr(),
                        d_out.ptr(),
                        d_mean.ptr(),
                        d_rstd.ptr(),
                        d_x.ptr(),
                        d_yc.ptr(),
                        d_bc.ptr(),
                        d_lw.ptr(),
                        d_lb.ptr(),
                        n,
                        c,
                    )?;
                } else {
                    residual_bias_add(gpu, s, d_x.ptr(), d_x.ptr(), d_yc.ptr(), d_bc.ptr(), n, c)?;
                    layernorm_forward(gpu, s, d_out.ptr(), d_mean.ptr(), d_rstd.ptr(), d_x.ptr(), d_lw.ptr(), d_lb.ptr(), n, c)?;
                }
                let mut bits: Vec<u32> = gpu.download(d_x.ptr())?.iter().map(|v| v.to_bits()).collect();
                bits.extend(gpu.download(d_out.ptr())?.iter().map(|v| v.to_bits() as u32));
                bits.extend(gpu.download(d_mean.ptr())?.iter().map(|v| v.to_bits()));
                bits.extend(gpu.download(d_rstd.ptr())?.iter().map(|v| v.to_bits()));
                Ok(bits)
            };
            let same_bits = two(true)? == two(false)?;
            let flag = |ok: bool| if ok { 0.0f32 } else { 1.0 };
            rows.push(CheckRow::compare(
                format!("residual_layernorm_forward = residual_bias_add + layernorm_forward [{n}×{c}] (bits)"),
                &[flag(same_bits)],
                &[0.0],
                0.0,
                0.0,
            ));
        }
    }

    // ---- casts, add, scale ----
    {
        let len = n * c + 5; // a ragged tail exercises the scalar path
        let x = randv(seed, 30, len, 3.0);
        let d_x = gpu.upload(&x)?;
        let d_b = gpu.alloc::<bf16>(len)?;
        cast_f32_to_bf16(gpu, s, d_b.ptr(), d_x.ptr())?;
        rows.push(row_bf(format!("cast_f32_to_bf16 [{len}]"), &gpu.download(d_b.ptr())?, &x));
        let xb = to_bf(&x);
        let d_xb = gpu.upload(&xb)?;
        let d_f = gpu.alloc::<f32>(len)?;
        cast_bf16_to_f32(gpu, s, d_f.ptr(), d_xb.ptr())?;
        rows.push(row_f32(format!("cast_bf16_to_f32 [{len}]"), &gpu.download(d_f.ptr())?, &bf_to_f32(&xb)));

        let y = randv(seed, 31, len, 1.0);
        let d_y = gpu.upload(&y)?;
        add_f32(gpu, s, d_y.ptr(), d_x.ptr())?;
        let want: Vec<f32> = y.iter().zip(&x).map(|(a, b)| a + b).collect();
        rows.push(row_f32(format!("add_f32 [{len}]"), &gpu.download(d_y.ptr())?, &want));
        scale_f32(gpu, s, d_y.ptr(), 0.37)?;
        let want: Vec<f32> = want.iter().map(|a| a * 0.37).collect();
        rows.push(row_f32(format!("scale_f32 [{len}]"), &gpu.download(d_y.ptr())?, &want));
    }

    // ---- cross-entropy ----
    {
        let (n, v, vp) = (512usize, 50257usize, 50304usize);
        let logits = round_bf(&randv(seed, 40, n * v, 2.0));
        let targets: Vec<u32> = (0..n).map(|_| rng.gen_range(v as u64) as u32).collect();
        // Padding columns hold large values: if they leaked into the softmax, losses would show it.
        let mut padded = vec![bf16::from_f32(100.0); n * vp];
        for r in 0..n {
            padded[r * vp..r * vp + v].copy_from_slice(&to_bf(&logits[r * v..(r + 1) * v]));
        }
        let (d_logits, d_tg, d_loss) = (gpu.upload(&padded)?, gpu.upload(&targets)?, gpu.alloc::<f32>(n)?);
        let (mut losses, mut probs) = (vec![0f32; n], vec![0f32; n * v]);
        crate::ops::crossentropy::crossentropy_forward(&mut losses, &mut probs, &logits, &targets, n, v);

        crossentropy(gpu, s, d_loss.ptr(), d_logits.ptr(), d_tg.ptr(), n, v, vp, 0.0)?;
        rows.push(row_f32(format!("crossentropy losses [{n}] (dscale=0)"), &gpu.download(d_loss.ptr())?, &losses));
        let untouched = gpu.download(d_logits.ptr())?;
        rows.push(CheckRow::compare(
            "crossentropy dscale=0 leaves logits unchanged",
            &bf_to_f32(&untouched),
            &bf_to_f32(&padded),
            BF16_FLOOR,
            0.0,
        ));

        let dscale = 1.0 / n as f32;
        gpu.zero(d_loss.ptr(), s)?;
        crossentropy(gpu, s, d_loss.ptr(), d_logits.ptr(), d_tg.ptr(), n, v, vp, dscale)?;
        rows.push(row_f32(format!("crossentropy losses [{n}] (with backward)"), &gpu.download(d_loss.ptr())?, &losses));
        let mut dl = vec![0f32; n * v];
        crate::ops::crossentropy::crossentropy_backward(&mut dl, &probs, &targets, n, v, 1.0);
        let mut want = vec![0f32; n * vp];
        for r in 0..n {
            want[r * vp..r * vp + v].copy_from_slice(&dl[r * v..(r + 1) * v]);
        }
        let floor = 1e-2 * want.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
        let got = bf_to_f32(&gpu.download(d_logits.ptr())?);
        rows.push(CheckRow::compare(
            format!("crossentropy dlogits [{n}×{vp}] (bf16, floor 1e-2·max)"),
            &got,
            &round_bf(&want),
            floor,
            BF16_TOL,
        ));
    }

    // ---- sums of squares ----
    {
        let block = crate::optim::norm::NORM_BLOCK;
        let len = 3 * block + 1003;
        let x = randv(seed, 50, len, 1.0);
        let d_x = gpu.upload(&x)?;
        let nb = len.div_ceil(block);
        let d_out = gpu.alloc::<f64>(nb)?;
        sum_squares_blocks(gpu, s, d_out.ptr(), d_x.ptr(), block)?;
        let got = gpu.download(d_out.ptr())?;
        let layout = crate::optim::norm::FlatLayout::from_sizes(&[len]).expect("one-segment layout");
        let mut want = vec![0f64; layout.slots()];
        layout.partial_sumsq(&x, 0..len, &mut want).expect("aligned full shard");
        let (mut max_abs, mut max_rel, mut non_finite) = (0f64, 0f64, false);
        for (g, w) in got.iter().zip(&want) {
            non_finite |= !g.is_finite();
            max_abs = max_abs.max((g - w).abs());
            max_rel = max_rel.max((g - w).abs() / (w.abs() + 1e-30));
        }
        rows.push(CheckRow { name: format!("sum_squares_blocks [{nb}] of [{len}] (f64)"), max_abs, max_rel, tol: 1e-12, non_finite });
    }

    // ---- AdamW ----
    {
        let len = (1usize << 20) + 37;
        let master = randv(seed, 60, len, 0.02);
        let grad = randv(seed, 61, len, 0.01);
        let m0 = randv(seed, 62, len, 1e-3);
        let v0: Vec<f32> = randv(seed, 63, len, 1e-3).iter().map(|x| x * x).collect();
        // Tensors of varying sizes alternating decay / no decay.
        let mut decay = vec![0u8; len];
        let mut segs = Vec::new();
        let (mut at, mut k) = (0usize, 0usize);
        while at < len {
            let sz = (1000 + 7919 * k % 5000).min(len - at);
            let on = k % 2 == 0;
            decay[at..at + sz].iter_mut().for_each(|d| *d = on as u8);
            segs.push((at..at + sz, on));
            at += sz;
            k += 1;
        }
        let (lr, betas, eps, wd, step, grad_scale) = (6e-4f32, (0.9f32, 0.95f32), 1e-8f32, 0.1f32, 7u64, 0.5f32);
        let hp = AdamStep::new(lr, betas, eps, wd, step);
        let (d_master, d_grad, d_m, d_v, d_decay) =
            (gpu.upload(&master)?, gpu.upload(&grad)?, gpu.upload(&m0)?, gpu.upload(&v0)?, gpu.upload(&decay)?);
        let d_param = gpu.alloc::<bf16>(len)?;
        adamw(gpu, s, d_master.ptr(), d_param.ptr(), d_grad.ptr(), d_m.ptr(), d_v.ptr(), d_decay.ptr(), &hp, grad_scale)?;
        let params =
            crate::optim::AdamParams { lr, betas, eps, weight_decay: wd, adam_w_mode: true, bias_correction: true, momentum_cycle: None };
        let coeffs = params.coeffs(lr, step);
        let g: Vec<f32> = grad.iter().map(|x| x * grad_scale).collect();
        let (mut p, mut m, mut v) = (master.clone(), m0.clone(), v0.clone());
        for (r, on) in segs {
            crate::optim::adam::adam_kernel(&coeffs, on, &mut p[r.clone()], &g[r.clone()], &mut m[r.clone()], &mut v[r]);
        }
        rows.push(row_f32(format!("adamw master [{len}]"), &gpu.download(d_master.ptr())?, &p));
        rows.push(row_bf(format!("adamw param [{len}] (bf16)"), &gpu.download(d_param.ptr())?, &p));
        rows.push(row_f32(format!("adamw m [{len}]"), &gpu.download(d_m.ptr())?, &m));
        rows.push(row_f32(format!("adamw v [{len}]"), &gpu.download(d_v.ptr())?, &v));
    }
    Ok(rows)
}
