//! Decoding on the GPU over a paged key/value cache: a [`Decoder`] holds a dense GPT-2 or
//! LLaMA-family model's parameters in bf16 ([`weights`]), every layer's keys and values in
//! fixed-size blocks, and a workspace sized for a step of up to `max_tokens` tokens of up to
//! `max_seqs` sequences. A step ([`StepBatch`]) mixes prompt chunks and decode tokens of any
//! sequences; each token attends through its sequence's block table.
//!
//! ```text
//! GPT-2:  x = wte[tok] + wpe[pos]; h = LN1(x)
//!         per block: qkv = h·Wqkv; q, K[slot], V[slot] = qkv + b        (dec_qkv_store)
//!                    a = attention(q, K, V over the block table)       (dec_paged_attention)
//!                    x += a·Wo + bo; h = LN2(x)                        (residual_layernorm)
//!                    g = gelu(h·Wfc + bfc); x += g·Wfc2 + bfc2; h = LN1'(x) (or LNf)
//!         steps of few tokens (every linear a GEMV): each join but the last is the prologue of
//!         the GEMV after it (dec_gemv_ln_*, dec_gemv_qkv_ln_*: each block makes the normed rows
//!         in shared memory; x ping-pongs between ws.x and ws.x2), 4 kernels a block instead of 6
//! LLaMA:  x = wte[tok]; h = rms1(x)
//!         per block: qkv = h·Wqkv; q, K[slot], V[slot] = rope(qkv + b)
//!                    a = attention; x += a·Wo; h = rms2(x)             (dec_residual_rmsnorm)
//!                    g = swiglu(h·[Wg|Wu]); x += g·Wd; h = rms1'(x) (or rmsf)
//! logits = h[rows]·headᵀ (f32)
//! ```
//!
//! CUDA graphs: a step whose sequences each run one token and want its logits (a decode step) of
//! batch size `b ≤ graph_max` replays a graph captured for `b` on its first use; the step inputs
//! are copied to the same device addresses first, and every kernel reads sizes that vary
//! (positions, block tables) from them, so one graph serves every step of that batch size.
//!
//! Determinism: no atomics; each kernel reduces in a fixed order and cuBLAS is called with the
//! same shapes, so the same step gives the same bits, graph or not.

pub mod check;
pub mod launch;
pub mod quant;
pub mod weights;

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaGraph;

use super::blas::{Blas, Dt, Mat};
use super::{bf16, drv, ops, Buf, DPtr, Gpu, GpuError, Result};
use crate::model::{Arch, Model, ModelConfig};
use launch::{Heads, StepPtrs};
pub use quant::WeightFormat;
use weights::Linear;
pub use weights::Weights;

/// Bytes of the decoder's own cuBLAS workspace (so captured GEMMs never allocate).
const BLAS_WORKSPACE_BYTES: usize = 32 << 20;
/// Dynamic shared memory a kernel may use without opting in.
const SMEM_DEFAULT_MAX: usize = 48 << 10;
/// Quantized linear layers of steps up to this many tokens run the GEMV kernel; longer steps
/// (prefill) widen the weight to bf16 and run cuBLAS.
const WQ_GEMV_ROWS_MAX: usize = 64;
/// bf16 linear layers of steps up to this many tokens run the GEMV kernel, longer ones cuBLAS.
const BF16_GEMV_ROWS_MAX: usize = 8;

/// The sizes a [`Decoder`] is built for.
#[derive(Clone, Copy, Debug)]
pub struct DecodeOptions {
    /// Cache blocks (every layer's keys and values of `block_size` positions each).
    pub num_blocks: usize,
    /// Positions per cache block.
    pub block_size: usize,
    /// Tokens one step may run (prompt chunks and decode tokens together).
    pub max_tokens: usize,
    /// Sequences one step may run.
    pub max_seqs: usize,
    /// Decode steps of up to this many sequences replay CUDA graphs (0: never).
    pub graph_max: usize,
    /// How the blocks' linear layers are stored.
    pub weights: WeightFormat,
}

/// One sequence's part of a step (the kernels' side of `infer::SeqStep`).
#[derive(Clone, Copy, Debug)]
pub struct StepSeq<'a> {
    pub tokens: &'a [u32],
    pub start: usize,
    pub block_table: &'a [u32],
    pub want_logits: bool,
}

/// A step's inputs, validated and packed as the kernels read them (int32): tokens, positions,
/// slots and sequence indices per token, the rows whose logits are wanted, the block tables.
#[derive(Debug)]
pub struct StepBatch {
    packed: Vec<i32>,
    n: usize,
    m: usize,
    seqs: usize,
    /// Every sequence runs one token and wants its logits.
    decode: bool,
}

impl StepBatch {
    /// Checks `batch` against the decoder's sizes and packs it.
    pub fn pack(d: &Decoder, batch: &[StepSeq<'_>]) -> Result<StepBatch> {
        let (bs, mb) = (d.opts.block_size, d.max_blocks());
        let n: usize = batch.iter().map(|s| s.tokens.len()).sum();
        let m = batch.iter().filter(|s| s.want_logits).count();
        let bad = |msg: String| Err(GpuError::Invalid(format!("GPU decode step: {msg}")));
        if n > d.opts.max_tokens || batch.len() > d.opts.max_seqs {
            return bad(format!(
                "{n} tokens of {} sequences exceed the decoder's {} tokens / {} sequences a step",
                batch.len(),
                d.opts.max_tokens,
                d.opts.max_seqs
            ));
        }
        let mut v = vec![0i32; 4 * n + m + batch.len() * mb];
        let (mut r, mut row) = (0usize, 0usize);
        for (i, s) in batch.iter().enumerate() {
            let end = s.start + s.tokens.len();
            if s.tokens.is_empty() {
                return bad(format!("sequence {i} has no tokens"));
            }
            if end > d.cfg.max_seq_len {
                return bad(format!("sequence {i} reaches position {end}, past the model's context of {}", d.cfg.max_seq_len));
            }
            if s.block_table.len() * bs < end || s.block_table.len() > mb {
                return bad(format!(
                    "sequence {i}: a block table of {} blocks of {bs} cannot hold positions 0..{end}",
                    s.block_table.len()
                ));
            }
            if let Some(b) = s.block_table.iter().find(|&&b| b as usize >= d.opts.num_blocks) {
                return bad(format!("sequence {i}: block {b} is past the cache's {} blocks", d.opts.num_blocks));
            }
            for (k, &t) in s.tokens.iter().enumerate() {
                if t as usize >= d.cfg.vocab_size {
                    return bad(format!("sequence {i}: token id {t} is past the vocabulary of {}", d.cfg.vocab_size));
                }
                let p = s.start + k;
                v[r] = t as i32;
                v[n + r] = p as i32;
                v[2 * n + r] = (s.block_table[p / bs] as usize * bs + p % bs) as i32;
                v[3 * n + r] = i as i32;
                r += 1;
            }
            if s.want_logits {
                v[4 * n + row] = (r - 1) as i32;
                row += 1;
            }
            for (k, &b) in s.block_table.iter().enumerate() {
                v[4 * n + m + i * mb + k] = b as i32;
            }
        }
        let decode = batch.iter().all(|s| s.tokens.len() == 1 && s.want_logits);
        Ok(StepBatch { packed: v, n, m, seqs: batch.len(), decode })
    }

    /// Rows of logits the step gives.
    pub fn logits_rows(&self) -> usize {
        self.m
    }
}

/// The model's dimensions the decoder runs with.
#[derive(Clone, Copy, Debug)]
struct Dims {
    arch: Arch,
    c: usize,
    f: usize,
    heads: Heads,
    vocab: usize,
    eps: f32,
}

/// Activations of one step (capacity `max_tokens` rows; logits `max_seqs` rows).
struct Work {
    x: Buf<f32>,
    /// GPT-2's residual stream between a block's two joins when they are folded into the GEMVs
    /// (the prologue reads `x` while writing here: ping-pong).
    x2: Buf<f32>,
    h: Buf<bf16>,
    qkv: Buf<bf16>,
    q: Buf<bf16>,
    att: Buf<bf16>,
    tmp: Buf<bf16>,
    big: Buf<bf16>,
    act: Buf<bf16>,
    mean: Buf<f32>,
    rstd: Buf<f32>,
    hsel: Buf<bf16>,
    logits: Buf<f32>,
    next: Buf<i32>,
    inputs: Buf<i32>,
    /// A quantized linear layer widened to bf16 for a step of many tokens.
    widened: Buf<bf16>,
}

/// The decode steps' CUDA graphs by batch size.
struct Graphs(HashMap<usize, CudaGraph>);

// SAFETY: a CUDA graph may be launched from any thread whose context is current (`launch` binds
// it) as long as calls on it are serialised; the graphs are reached only through `&mut Decoder`.
unsafe impl Send for Graphs {}

/// A model ready to decode on one GPU. Fields drop in order: the cuBLAS handle before its
/// workspace.
pub struct Decoder {
    blas: Blas,
    graphs: Graphs,
    _blas_ws: Buf<u8>,
    pub gpu: Arc<Gpu>,
    pub cfg: ModelConfig,
    pub opts: DecodeOptions,
    dims: Dims,
    w: Weights,
    inv_freq: Option<Buf<f64>>,
    /// Per layer: keys, values `[num_blocks · block_size, nkv, hd]`.
    kv: Vec<(Buf<bf16>, Buf<bf16>)>,
    ws: Work,
    /// Steps of up to this many tokens run quantized layers through the GEMV kernel.
    wq_rows_max: usize,
    /// GPT-2 steps whose linear layers all run the GEMV fold each residual + LayerNorm into the
    /// next GEMV's prologue (the final norm excepted).
    fold_norms: bool,
}

impl Decoder {
    /// Uploads the model and allocates the cache and workspace.
    pub fn new(gpu: Arc<Gpu>, model: &Model, params: &[f32], opts: DecodeOptions) -> Result<Decoder> {
        let cfg = model.cfg.clone();
        let hd = cfg.head_dim();
        let heads = Heads { nh: cfg.n_head, nkv: if cfg.arch == Arch::Llama { cfg.n_kv_head } else { cfg.n_head }, hd };
        let f = cfg.d_ff;
        let dims = Dims { arch: cfg.arch, c: cfg.d_model, f, heads, vocab: cfg.vocab_size, eps: cfg.norm_eps };
        if opts.block_size == 0 || opts.num_blocks == 0 || opts.max_tokens == 0 || opts.max_seqs == 0 {
            return Err(GpuError::Invalid(format!("GPU decoder: every size must be positive: {opts:?}")));
        }
        if hd % 8 != 0 || hd > 2 * launch::ATT_THREADS as usize || cfg.d_model % 4 != 0 {
            return Err(GpuError::Invalid(format!(
                "GPU decoder: head size {hd} (d_model {} / {} heads): the kernels take head sizes that are multiples of 8 up to {}",
                cfg.d_model,
                cfg.n_head,
                2 * launch::ATT_THREADS
            )));
        }
        if launch::attention_smem_bytes(hd, cfg.max_seq_len) > SMEM_DEFAULT_MAX {
            return Err(GpuError::Invalid(format!(
                "GPU decoder: a context of {} positions exceeds the paged attention's shared memory",
                cfg.max_seq_len
            )));
        }
        // Load every module a step uses now: nothing may load while a graph is being captured.
        for (module, func) in [("ops", "layernorm_fwd_gen"), ("llama", "rmsnorm_fwd"), ("decode", "dec_paged_attention")] {
            gpu.func(module, func)?;
        }
        let w = Weights::upload(&gpu, model, params, opts.weights)?;
        let inv_freq = match cfg.arch {
            Arch::Llama => Some(gpu.upload(&crate::ops::rope::inv_freq(hd, cfg.rope_theta, cfg.rope_scaling.as_ref()))?),
            Arch::Gpt => None,
        };
        let slots = opts.num_blocks * opts.block_size * heads.nkv * hd;
        let kv = (0..cfg.n_layer).map(|_| Ok((gpu.alloc::<bf16>(slots)?, gpu.alloc::<bf16>(slots)?))).collect::<Result<Vec<_>>>()?;
        let ws = Work::new(&gpu, &dims, &opts, cfg.max_seq_len.div_ceil(opts.block_size), w.widened_max())?;
        let blas = Blas::new(&gpu.stream)?;
        let blas_ws = gpu.alloc::<u8>(BLAS_WORKSPACE_BYTES)?;
        // SAFETY: the workspace is a field of the decoder, dropped after `blas`.
        unsafe { blas.set_workspace(blas_ws.ptr().raw, BLAS_WORKSPACE_BYTES)? };
        Ok(Decoder {
            blas,
            graphs: Graphs(HashMap::new()),
            _blas_ws: blas_ws,
            gpu,
            cfg,
            opts,
            dims,
            w,
            inv_freq,
            kv,
            ws,
            wq_rows_max: WQ_GEMV_ROWS_MAX,
            fold_norms: true,
        })
    }

    /// Steps of more than `rows` tokens run the linear layers through cuBLAS (quantized weights
    /// widened to bf16) instead of the GEMV kernel (default 64 for quantized weights, 8 for
    /// bf16; the checks lower it to reach both paths).
    pub fn set_gemv_rows_max(&mut self, rows: usize) {
        self.wq_rows_max = rows;
    }

    /// Whether GPT-2's residual + LayerNorm joins run in the next GEMV's prologue (default on;
    /// the checks turn it off to compare with the separate kernels). Set it before the first step:
    /// captured graphs keep the kernels they were captured with.
    pub fn set_fold_norms(&mut self, on: bool) {
        self.fold_norms = on;
    }

    /// Blocks a sequence of the model's whole context needs (the block tables' width).
    pub fn max_blocks(&self) -> usize {
        self.cfg.max_seq_len.div_ceil(self.opts.block_size)
    }

    /// Bytes on the device: parameters, cache, workspace.
    pub fn bytes(&self) -> (usize, usize, usize) {
        let kv: usize = self.kv.iter().map(|(k, v)| 2 * (k.len() + v.len())).sum();
        (self.w.bytes(), kv, self.ws.bytes() + BLAS_WORKSPACE_BYTES)
    }

    /// Runs one step; its logits stay on the device ([`Decoder::logits`], [`Decoder::argmax`]).
    pub fn run(&mut self, b: &StepBatch) -> Result<()> {
        let graph = b.decode && b.n <= self.opts.graph_max;
        self.gpu.write(&mut self.ws.inputs, 0, &b.packed)?;
        if !graph {
            return self.forward(b.n, b.m, b.seqs, b.decode);
        }
        if !self.graphs.0.contains_key(&b.n) {
            let st = self.gpu.stream.clone();
            st.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(drv("starting a CUDA graph capture"))?;
            let fwd = self.forward(b.n, b.m, b.seqs, true);
            let g = st.end_capture(CUgraphInstantiate_flags(0)).map_err(drv("ending a CUDA graph capture"));
            fwd?;
            let g = g?.ok_or_else(|| GpuError::Invalid("CUDA graph capture of a decode step captured nothing".into()))?;
            self.graphs.0.insert(b.n, g);
        }
        self.graphs.0[&b.n].launch().map_err(drv("launching a decode step's CUDA graph"))
    }

    /// Runs `b` kernel by kernel (no graph) with timing marks: (what, ms, launches) in order of
    /// first appearance.
    pub fn profile(&mut self, b: &StepBatch) -> Result<Vec<(&'static str, f64, usize)>> {
        self.gpu.write(&mut self.ws.inputs, 0, &b.packed)?;
        self.gpu.sync()?;
        self.gpu.profile(true)?;
        let r = self.forward(b.n, b.m, b.seqs, b.decode);
        let report = self.gpu.profile_report();
        self.gpu.profile(false)?;
        r?;
        report
    }

    /// The step's logits, one `vocab` row per sequence that wanted them (in batch order).
    pub fn logits(&self, b: &StepBatch) -> Result<Vec<Vec<f32>>> {
        let v = self.dims.vocab;
        let all = self.gpu.download(self.ws.logits.slice(0..b.m * v))?;
        Ok(all.chunks_exact(v).map(|r| r.to_vec()).collect())
    }

    /// The greedy choice of each row of the step's logits, computed on the device.
    pub fn argmax(&self, b: &StepBatch) -> Result<Vec<u32>> {
        let v = self.dims.vocab;
        launch::argmax(&self.gpu, &self.gpu.stream, self.ws.next.slice(0..b.m), self.ws.logits.slice(0..b.m * v), v)?;
        Ok(self.gpu.download(self.ws.next.slice(0..b.m))?.into_iter().map(|t| t as u32).collect())
    }

    /// The step inputs' device views for `n` tokens, `m` logits rows and `seqs` sequences.
    fn ptrs(&self, n: usize, m: usize, seqs: usize) -> StepPtrs {
        let i = self.ws.inputs.ptr();
        let mb = self.max_blocks();
        StepPtrs {
            tok: i.slice(0..n),
            pos: i.slice(n..2 * n),
            slot: i.slice(2 * n..3 * n),
            seq: i.slice(3 * n..4 * n),
            rows: i.slice(4 * n..4 * n + m),
            tables: i.slice(4 * n + m..4 * n + m + seqs * mb),
            max_blocks: mb,
        }
    }

    /// The whole forward of a step whose inputs are on the device. `rows_are_tokens`: the
    /// logits rows are the tokens themselves (a decode step), so no gather.
    fn forward(&self, n: usize, m: usize, seqs: usize, rows_are_tokens: bool) -> Result<()> {
        let p = self.ptrs(n, m, seqs);
        let (gpu, st, d) = (&*self.gpu, &*self.gpu.stream, self.dims);
        let (c, ws) = (d.c, &self.ws);
        let (x, h) = (ws.x.slice(0..n * c), ws.h.slice(0..n * c));
        match d.arch {
            Arch::Gpt => {
                let wpe = self.w.wpe.as_ref().expect("GPT-2 has position embeddings").ptr();
                launch::embed_pos(gpu, st, x, self.w.wte.ptr(), wpe, &p, c)?;
                let l0 = &self.w.layers[0];
                let ln1_b = l0.ln1_b.as_ref().expect("GPT-2 norms have biases").ptr();
                ops::layernorm_forward(gpu, st, h, ws.mean.slice(0..n), ws.rstd.slice(0..n), x, l0.ln1_w.ptr(), ln1_b, n, c)?;
                gpu.mark("embedding + norm");
            }
            Arch::Llama => {
                crate::cuda::llama::ops::embed_tokens(gpu, st, x, p.tok.cast(), self.w.wte.ptr(), c)?;
                crate::cuda::llama::ops::rmsnorm_forward(gpu, st, h, ws.rstd.slice(0..n), x, self.w.layers[0].ln1_w.ptr(), n, c, d.eps)?;
                gpu.mark("embedding + norm");
            }
        }
        let fold = self.folds(n);
        for l in 0..self.w.layers.len() {
            self.block(l, &p, fold)?;
        }
        let hs = if rows_are_tokens {
            h.slice(0..m * c)
        } else {
            launch::gather_rows(gpu, st, ws.hsel.slice(0..m * c), h, p.rows, c)?;
            gpu.mark("gather rows");
            ws.hsel.slice(0..m * c)
        };
        let logits = ws.logits.slice(0..m * d.vocab);
        if m <= self.wq_rows_max.min(BF16_GEMV_ROWS_MAX) && c % 16 == 0 {
            launch::gemv_f32(gpu, st, logits, hs, self.w.head(), m, (c, d.vocab))?;
            gpu.mark("head gemv");
        } else {
            self.gemm(Mat::new(logits.raw, Dt::F32), bf(hs), Mat::tr(self.w.head().raw, Dt::Bf16), (m, c, d.vocab))?;
            gpu.mark("head gemm");
        }
        Ok(())
    }

    /// Whether a step of `n` tokens folds GPT-2's joins into the GEMVs (see `fold_norms`).
    fn folds(&self, n: usize) -> bool {
        let all_gemv = self.w.layers.iter().all(|w| self.gemv_rows(&w.qkv_w, n) && self.gemv_rows(&w.up_w, n));
        self.fold_norms && self.dims.arch == Arch::Gpt && launch::ln_foldable(self.dims.c) && all_gemv
    }

    /// GPT-2's join after block `l - 1`'s MLP as the prologue of block `l`'s QKV GEMV: the
    /// residual comes from `ws.x2` and goes back to `ws.x`.
    fn join_into_qkv(&self, l: usize, n: usize) -> launch::ResidualLnIn {
        let (c, ws) = (self.dims.c, &self.ws);
        let (prev, w) = (&self.w.layers[l - 1], &self.w.layers[l]);
        let b = |b: &Option<Buf<bf16>>| b.as_ref().expect("GPT-2 blocks have biases").ptr();
        launch::ResidualLnIn {
            xo: ws.x.slice(0..n * c),
            x: ws.x2.slice(0..n * c),
            y: ws.tmp.slice(0..n * c),
            yb: b(&prev.down_b),
            w: w.ln1_w.ptr(),
            b: b(&w.ln1_b),
        }
    }

    /// Block `l`: attention then the MLP, ending with the next block's first norm (or the final
    /// norm) in `ws.h` — or, with `fold` (GPT-2, few tokens), with the residual in `ws.x2` and
    /// the MLP's output in `ws.tmp` for the next block's QKV GEMV to join (the last block joins
    /// into `ws.h` itself).
    fn block(&self, l: usize, p: &StepPtrs, fold: bool) -> Result<()> {
        let (gpu, st, d, ws) = (&*self.gpu, &*self.gpu.stream, self.dims, &self.ws);
        let (n, c, hh) = (p.n(), d.c, d.heads);
        let w = &self.w.layers[l];
        let h = ws.h.slice(0..n * c);
        let (qkv, q, att, tmp) = (ws.qkv.slice(0..n * hh.row()), ws.q.slice(0..n * c), ws.att.slice(0..n * c), ws.tmp.slice(0..n * c));
        let cache = (self.kv[l].0.ptr(), self.kv[l].1.ptr());
        let (qkv_b, inv_freq) = (w.qkv_b.as_ref().map(|b| b.ptr()), self.inv_freq.as_ref().map(|f| f.ptr()));
        if fold && l > 0 {
            let x = launch::GemvIn::ResidualLn(self.join_into_qkv(l, n));
            launch::gemv_qkv(gpu, st, q, cache, x, w.qkv_w.gemv(), (qkv_b, inv_freq), p, hh, c)?;
            gpu.mark("residual + norm + qkv gemv + bias/rope + cache store");
        } else if self.gemv_rows(&w.qkv_w, n) {
            launch::gemv_qkv(gpu, st, q, cache, launch::GemvIn::Rows(h), w.qkv_w.gemv(), (qkv_b, inv_freq), p, hh, c)?;
            gpu.mark("qkv gemv + bias/rope + cache store");
        } else {
            self.linear(qkv, h, &w.qkv_w, (n, c, hh.row()))?;
            gpu.mark("qkv gemm");
            launch::qkv_store(gpu, st, q, cache, qkv, qkv_b, inv_freq, p, hh)?;
            gpu.mark("qkv bias/rope + cache store");
        }
        launch::paged_attention(gpu, st, att, q, cache, p, hh, self.opts.block_size, self.cfg.max_seq_len)?;
        gpu.mark("paged attention");
        self.linear(tmp, att, &w.o_w, (n, c, c))?;
        gpu.mark("out-projection (gemv or gemm)");
        match d.arch {
            Arch::Gpt => self.gpt_mlp(l, n, fold),
            Arch::Llama => self.llama_mlp(l, n),
        }
    }

    /// The norm after block `l`: the next block's first, or the final one.
    fn next_norm(&self, l: usize) -> (DPtr<bf16>, Option<DPtr<bf16>>) {
        match self.w.layers.get(l + 1) {
            Some(nx) => (nx.ln1_w.ptr(), nx.ln1_b.as_ref().map(|b| b.ptr())),
            None => (self.w.lnf_w.ptr(), self.w.lnf_b.as_ref().map(|b| b.ptr())),
        }
    }

    /// GPT-2's second join and MLP of block `l` (the out-projection's output in `ws.tmp`).
    fn gpt_mlp(&self, l: usize, n: usize, fold: bool) -> Result<()> {
        let (gpu, st, d, ws) = (&*self.gpu, &*self.gpu.stream, self.dims, &self.ws);
        let (c, f, w) = (d.c, d.f, &self.w.layers[l]);
        let (x, x2, h, tmp) = (ws.x.slice(0..n * c), ws.x2.slice(0..n * c), ws.h.slice(0..n * c), ws.tmp.slice(0..n * c));
        let (mean, rstd) = (ws.mean.slice(0..n), ws.rstd.slice(0..n));
        let bias = |b: &Option<Buf<bf16>>| b.as_ref().expect("GPT-2 blocks have biases").ptr();
        let (pre, act) = (ws.big.slice(0..n * f), ws.act.slice(0..n * f));
        if fold {
            let join = launch::ResidualLnIn { xo: x2, x, y: tmp, yb: bias(&w.o_b), w: w.ln2_w.ptr(), b: bias(&w.ln2_b) };
            launch::gemv(gpu, st, act, launch::GemvIn::ResidualLn(join), w.up_w.gemv(), Some(bias(&w.up_b)), true, n, (c, f))?;
            gpu.mark("residual + norm + mlp up gemv + bias + gelu");
        } else {
            let ln2 = ops::ResidualLn { xo: x, out: h, mean, rstd, x, y: tmp, yb: bias(&w.o_b), w: w.ln2_w.ptr(), b: bias(&w.ln2_b), n, c };
            ops::residual_layernorm_forward(gpu, st, &ln2)?;
            gpu.mark("residual + norm");
            self.linear_gelu((pre, act), h, &w.up_w, bias(&w.up_b), (n, c, f))?;
        }
        self.linear(tmp, act, &w.down_w, (n, f, c))?;
        gpu.mark("mlp down (gemv or gemm)");
        if fold && l + 1 < self.w.layers.len() {
            return Ok(()); // the next block's QKV GEMV joins
        }
        let (next_w, next_b) = self.next_norm(l);
        let b = next_b.expect("GPT-2 norms have biases");
        // Folded steps keep the residual in x2 after the first join: bring it back to x.
        let from = if fold { x2 } else { x };
        let ln = ops::ResidualLn { xo: x, out: h, mean, rstd, x: from, y: tmp, yb: bias(&w.down_b), w: next_w, b, n, c };
        ops::residual_layernorm_forward(gpu, st, &ln)?;
        gpu.mark("residual + norm");
        Ok(())
    }

    /// LLaMA's second join and MLP of block `l` (the out-projection's output in `ws.tmp`).
    fn llama_mlp(&self, l: usize, n: usize) -> Result<()> {
        let (gpu, st, d, ws) = (&*self.gpu, &*self.gpu.stream, self.dims, &self.ws);
        let (c, f, w) = (d.c, d.f, &self.w.layers[l]);
        let (x, h, tmp) = (ws.x.slice(0..n * c), ws.h.slice(0..n * c), ws.tmp.slice(0..n * c));
        let (gu, act) = (ws.big.slice(0..2 * n * f), ws.act.slice(0..n * f));
        launch::residual_rmsnorm(gpu, st, x, h, tmp, w.ln2_w.ptr(), n, c, d.eps)?;
        gpu.mark("residual + norm");
        self.linear(gu, h, &w.up_w, (n, c, 2 * f))?;
        gpu.mark("mlp gate|up (gemv or gemm)");
        launch::swiglu_rows(gpu, st, act, gu, n, f)?;
        gpu.mark("swiglu");
        self.linear(tmp, act, &w.down_w, (n, f, c))?;
        gpu.mark("mlp down (gemv or gemm)");
        launch::residual_rmsnorm(gpu, st, x, h, tmp, self.next_norm(l).0, n, c, d.eps)?;
        gpu.mark("residual + norm");
        Ok(())
    }

    /// Whether a step of `m` tokens runs `w` through the GEMV kernel (else cuBLAS).
    fn gemv_rows(&self, w: &Linear, m: usize) -> bool {
        match w {
            Linear::Bf16(_) => m <= self.wq_rows_max.min(BF16_GEMV_ROWS_MAX),
            Linear::Quant { .. } => m <= self.wq_rows_max,
        }
    }

    /// `y [m, n] = x [m, k] · W` for a linear layer in any format.
    fn linear(&self, y: DPtr<bf16>, x: DPtr<bf16>, w: &Linear, (m, k, n): (usize, usize, usize)) -> Result<()> {
        let (gpu, st) = (&*self.gpu, &*self.gpu.stream);
        if self.gemv_rows(w, m) {
            return launch::gemv(gpu, st, y, launch::GemvIn::Rows(x), w.gemv(), None, false, m, (k, n));
        }
        match w {
            Linear::Bf16(b) => self.gemm(bf(y), bf(x), Mat::tr(b.ptr().raw, Dt::Bf16), (m, k, n)),
            Linear::Quant { q, s, fmt, .. } => {
                let wd = self.ws.widened.slice(0..k * n);
                launch::wq_dequant(gpu, st, wd, (q.ptr(), s.ptr()), *fmt == WeightFormat::Int8, (k, n))?;
                self.gemm(bf(y), bf(x), bf(wd), (m, k, n))
            }
        }
    }

    /// `act = gelu(x · W + bias)` (GPT-2's MLP up-projection): one GEMV with the bias and GELU
    /// in its epilogue for few rows, else the GEMM into `pre` and ops.cu's bias + GELU.
    fn linear_gelu(
        &self,
        (pre, act): (DPtr<bf16>, DPtr<bf16>),
        x: DPtr<bf16>,
        w: &Linear,
        bias: DPtr<bf16>,
        (m, k, n): (usize, usize, usize),
    ) -> Result<()> {
        let (gpu, st) = (&*self.gpu, &*self.gpu.stream);
        if self.gemv_rows(w, m) {
            launch::gemv(gpu, st, act, launch::GemvIn::Rows(x), w.gemv(), Some(bias), true, m, (k, n))?;
            gpu.mark("mlp up gemv + bias + gelu");
            return Ok(());
        }
        self.linear(pre, x, w, (m, k, n))?;
        gpu.mark("mlp up gemm");
        ops::bias_gelu_forward_out(gpu, st, pre, act, bias, m, n)?;
        gpu.mark("bias + gelu");
        Ok(())
    }

    fn gemm(&self, c: Mat, a: Mat, b: Mat, (m, k, n): (usize, usize, usize)) -> Result<()> {
        self.blas.matmul(c, a, b, m, k, n)
    }
}

fn bf(p: DPtr<bf16>) -> Mat {
    Mat::new(p.raw, Dt::Bf16)
}

impl Work {
    fn new(gpu: &Gpu, d: &Dims, o: &DecodeOptions, max_blocks: usize, widened: usize) -> Result<Work> {
        let (t, c, s) = (o.max_tokens, d.c, o.max_seqs);
        let big = if d.arch == Arch::Llama { 2 * d.f } else { d.f };
        Ok(Work {
            x: gpu.alloc(t * c)?,
            x2: gpu.alloc(if d.arch == Arch::Gpt { t * c } else { 1 })?,
            h: gpu.alloc(t * c)?,
            qkv: gpu.alloc(t * d.heads.row())?,
            q: gpu.alloc(t * c)?,
            att: gpu.alloc(t * c)?,
            tmp: gpu.alloc(t * c)?,
            big: gpu.alloc(t * big)?,
            act: gpu.alloc(t * d.f)?,
            mean: gpu.alloc(t)?,
            rstd: gpu.alloc(t)?,
            hsel: gpu.alloc(s * c)?,
            logits: gpu.alloc(s * d.vocab)?,
            next: gpu.alloc(s)?,
            inputs: gpu.alloc(4 * t + s + s * max_blocks)?,
            widened: gpu.alloc(widened)?,
        })
    }

    fn bytes(&self) -> usize {
        let b16 = self.widened.len()
            + self.h.len()
            + self.qkv.len()
            + self.q.len()
            + self.att.len()
            + self.tmp.len()
            + self.big.len()
            + self.act.len()
            + self.hsel.len();
        let b32 =
            self.x.len() + self.x2.len() + self.mean.len() + self.rstd.len() + self.logits.len() + self.next.len() + self.inputs.len();
        2 * b16 + 4 * b32
    }
}
