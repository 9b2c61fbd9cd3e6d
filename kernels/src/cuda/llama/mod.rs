//! The LLaMA family (LLaMA, Mistral, Qwen2) forward and backward on the GPU: bf16 parameters and
//! activations, an f32 residual stream, f32 gradients, cuBLAS GEMMs with f32 accumulation,
//! RMSNorm, RoPE (with LLaMA 3 frequency scaling), SwiGLU and causal grouped-query attention
//! (head dimension 64 or 128), the q/k/v bias of Qwen2, a tied or untied LM head. The same
//! parameter layout as the CPU [`crate::model::Model`] for `Arch::Llama`, padded per unit as
//! [`GpuLayout`] does; callers reach it through [`crate::cuda::gpt`]'s `forward_backward`,
//! `forward_loss` and `Workspace`, which dispatch on the layout's architecture.
//!
//! Each micro-batch's gradient is written into buffers the caller zeroed (GEMMs with β = 0, the
//! column sums and the embedding backward add into zeros), so it is a pure function of that
//! micro-batch, and every kernel reduces in a fixed order: the same bits every run.
//!
//! ```text
//! h1 = rms(x)·w1; qkv = h1·Wqkv (+ b); q, k = rope(q, k); a = attention(qkv)
//! x2 = x + a·Wo; h2 = rms(x2)·w2; y = x2 + (silu(h2·Wg) ∘ (h2·Wu))·Wd
//! ```

pub mod attention;
pub(crate) mod check;
mod check_moe;
pub mod moe;
pub mod ops;

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::CudaStream;

pub use check::check;

use self::attention::GqaShape;
use self::ops::{RmsBackward, RopeDev};
use super::blas::{Dt, Mat};
use super::gpt::{GpuLayout, Phase, Shape, UnitHooks};
use super::{bf16, Buf, DPtr, Gpu, GpuError, Result};
use crate::model::Model;

/// Unit-local ranges of one block's tensors (identical for every block).
#[derive(Clone, Debug)]
pub struct BlockRanges {
    pub attn_norm: Range<usize>,
    pub wqkv: Range<usize>,
    pub wo: Range<usize>,
    pub mlp_norm: Range<usize>,
    pub mlp: MlpRanges,
    /// The q/k/v bias (Qwen2).
    pub bqkv: Option<Range<usize>>,
}

/// A block's feed-forward: one SwiGLU MLP, or a router and its experts ([`moe`]).
#[derive(Clone, Debug)]
pub enum MlpRanges {
    Dense { w_gate: Range<usize>, w_up: Range<usize>, w_down: Range<usize> },
    Moe(moe::MoeLayout),
}

impl BlockRanges {
    /// The MoE block's layout, when the blocks are MoE.
    pub fn moe(&self) -> Option<&moe::MoeLayout> {
        match &self.mlp {
            MlpRanges::Moe(m) => Some(m),
            MlpRanges::Dense { .. } => None,
        }
    }
}

/// What the GPU LLaMA needs of the model: where its tensors lie in their units, and the
/// attention and RoPE settings.
#[derive(Clone, Debug)]
pub struct LlamaLayout {
    /// Unit-0-local: the token embedding, the final norm and the LM head (`wte` itself when tied).
    pub wte: Range<usize>,
    pub norm_f: Range<usize>,
    pub head: Range<usize>,
    pub block: BlockRanges,
    pub nkv: usize,
    pub hd: usize,
    pub eps: f32,
    /// RoPE frequency of each rotation pair (with the model's scaling), as the CPU block has it.
    pub inv_freq: Vec<f64>,
}

impl LlamaLayout {
    /// From the model and `local(unit, name)`, a tensor's unit-local range.
    pub fn new(model: &Model, local: &dyn Fn(usize, &str) -> Result<Range<usize>>) -> Result<LlamaLayout> {
        let cfg = &model.cfg;
        let hd = cfg.head_dim();
        let b = |name: &str| local(1, &format!("h.0.{name}"));
        let block = BlockRanges {
            attn_norm: b("attn_norm.weight")?,
            wqkv: b("attn.wqkv.weight")?,
            wo: b("attn.wo.weight")?,
            mlp_norm: b("mlp_norm.weight")?,
            mlp: if cfg.moe.is_some() {
                MlpRanges::Moe(moe::MoeLayout::new(cfg, &b)?)
            } else {
                MlpRanges::Dense { w_gate: b("mlp.w_gate.weight")?, w_up: b("mlp.w_up.weight")?, w_down: b("mlp.w_down.weight")? }
            },
            bqkv: if cfg.qkv_bias { Some(b("attn.wqkv.bias")?) } else { None },
        };
        let wte = local(0, "wte.weight")?;
        let head = if cfg.tied_head { wte.clone() } else { local(0, "lm_head.weight")? };
        let inv_freq = crate::ops::rope::inv_freq(hd, cfg.rope_theta, cfg.rope_scaling.as_ref());
        Ok(LlamaLayout { wte, norm_f: local(0, "norm_f.weight")?, head, block, nkv: cfg.n_kv_head, hd, eps: cfg.norm_eps, inv_freq })
    }

    fn gqa(&self, s: Shape) -> GqaShape {
        GqaShape { b: s.b, t: s.t, nh: s.nh, nkv: self.nkv, hd: self.hd }
    }
}

/// Tensors of one block (views into a unit's buffer).
#[derive(Clone, Copy, Debug)]
struct BlockW<T> {
    attn_norm: DPtr<T>,
    wqkv: DPtr<T>,
    wo: DPtr<T>,
    mlp_norm: DPtr<T>,
    mlp: MlpW<T>,
    bqkv: Option<DPtr<T>>,
}

/// A block's feed-forward tensors.
#[derive(Clone, Copy, Debug)]
enum MlpW<T> {
    Dense { w_gate: DPtr<T>, w_up: DPtr<T>, w_down: DPtr<T> },
    Moe(moe::MoeW<T>),
}

impl<T> BlockW<T> {
    fn at(unit: DPtr<T>, r: &BlockRanges) -> Self {
        let v = |r: &Range<usize>| unit.slice(r.clone());
        BlockW {
            attn_norm: v(&r.attn_norm),
            wqkv: v(&r.wqkv),
            wo: v(&r.wo),
            mlp_norm: v(&r.mlp_norm),
            mlp: match &r.mlp {
                MlpRanges::Dense { w_gate, w_up, w_down } => MlpW::Dense { w_gate: v(w_gate), w_up: v(w_up), w_down: v(w_down) },
                MlpRanges::Moe(m) => MlpW::Moe(moe::MoeW { router: v(&m.router), unit }),
            },
            bqkv: r.bqkv.as_ref().map(v),
        }
    }
}

/// Saved activations of one block.
struct Acts {
    h1: Buf<bf16>,
    r1: Buf<f32>,
    qkv: Buf<bf16>,
    atty: Buf<bf16>,
    lse: Buf<f32>,
    x2: Buf<f32>,
    h2: Buf<bf16>,
    r2: Buf<f32>,
    gate: Buf<bf16>,
    up: Buf<bf16>,
    sw: Buf<bf16>,
    /// The routing and expert rows of an MoE block (`gate`, `up`, `sw` are then the experts'
    /// `[n·k, d_expert]`).
    moe: Option<moe::MoeActs>,
}

/// Elements of a block's MLP activations (`gate`, `up`, `sw`): `[n, d_ff]`, or the experts'
/// `[n·k, d_expert]`.
fn mlp_elems(s: Shape, ll: &LlamaLayout) -> usize {
    match ll.block.moe() {
        Some(m) => s.n() * m.top_k * m.d_expert,
        None => s.n() * s.f,
    }
}

impl Acts {
    fn new(gpu: &Gpu, s: Shape, g: GqaShape, ll: &LlamaLayout) -> Result<Acts> {
        let (n, c) = (s.n(), s.c);
        let nf = mlp_elems(s, ll);
        Ok(Acts {
            h1: gpu.alloc(n * c)?,
            r1: gpu.alloc(n)?,
            qkv: gpu.alloc(n * g.row())?,
            atty: gpu.alloc(n * c)?,
            lse: gpu.alloc(s.b * s.nh * s.t)?,
            x2: gpu.alloc(n * c)?,
            h2: gpu.alloc(n * c)?,
            r2: gpu.alloc(n)?,
            gate: gpu.alloc(nf)?,
            up: gpu.alloc(nf)?,
            sw: gpu.alloc(nf)?,
            moe: ll.block.moe().map(|m| moe::MoeActs::new(gpu, m, n, c)).transpose()?,
        })
    }

    fn bytes(&self) -> usize {
        let b16 = [&self.h1, &self.qkv, &self.atty, &self.h2, &self.gate, &self.up, &self.sw].iter().map(|b| b.len() * 2).sum::<usize>();
        b16 + [&self.r1, &self.lse, &self.x2, &self.r2].iter().map(|b| b.len() * 4).sum::<usize>()
            + self.moe.as_ref().map_or(0, |m| m.bytes())
    }

    fn mlp(&self) -> (DPtr<bf16>, DPtr<bf16>, DPtr<bf16>) {
        (self.gate.ptr(), self.up.ptr(), self.sw.ptr())
    }
}

/// Every activation and scratch buffer of one micro-batch shape, allocated once.
pub struct Workspace {
    pub shape: Shape,
    /// Activation checkpointing: one shared set of block activations, recomputed in backward.
    pub recompute: bool,
    pub layout: Arc<GpuLayout>,
    ll: LlamaLayout,
    gqa: GqaShape,
    rope_cos: Buf<f32>,
    rope_sin: Buf<f32>,
    xs: Vec<Buf<f32>>,
    layers: Vec<Acts>,
    xf: Buf<bf16>,
    rf: Buf<f32>,
    logits: Buf<bf16>,
    /// Per-position losses of the last micro-batch.
    pub losses: Buf<f32>,
    dx: Buf<f32>,
    dres: Buf<bf16>,
    dh: Buf<f32>,
    dsw: Buf<bf16>,
    dgate: Buf<bf16>,
    dup: Buf<bf16>,
    datt: Buf<bf16>,
    dqkv: Buf<bf16>,
    delta: Buf<f32>,
    rms_scratch: Buf<f32>,
    bias_scratch: Buf<f32>,
    tokens: Buf<u32>,
    targets: Buf<u32>,
    uniq: Buf<u32>,
    offsets: Buf<u32>,
    positions: Buf<u32>,
    /// The MoE blocks' backward scratch, load counts and grouped-GEMM tables.
    moe: Option<moe::MoeScratch>,
    /// The load-balancing loss of the last micro-batch (MoE models; not in `losses`).
    pub aux_loss: Option<f32>,
}

impl Workspace {
    /// A workspace for micro-batches of shape `s` of the LLaMA model laid out by `layout`; with
    /// `recompute` the blocks keep only their inputs and share one set of activations, which the
    /// backward recomputes block by block (same bits either way).
    pub fn new(gpu: &Gpu, s: Shape, layout: &GpuLayout, recompute: bool) -> Result<Workspace> {
        let ll = layout.llama().ok_or_else(|| GpuError::Invalid("a LLaMA workspace needs a LLaMA layout".into()))?.clone();
        let g = ll.gqa(s);
        g.validate()?;
        let (n, c) = (s.n(), s.c);
        let nf = mlp_elems(s, &ll);
        let kept = if recompute { s.l.min(1) } else { s.l };
        let layers = (0..kept).map(|_| Acts::new(gpu, s, g, &ll)).collect::<Result<Vec<_>>>()?;
        let moe = ll.block.moe().map(|m| moe::MoeScratch::new(gpu, m, n, c, s.l, moe::gemm_mode()?)).transpose()?;
        let table = crate::ops::rope::RopeTable::with_inv_freq(s.t, &ll.inv_freq);
        Ok(Workspace {
            shape: s,
            recompute,
            layout: Arc::new(layout.clone()),
            gqa: g,
            rope_cos: gpu.upload(table.cos())?,
            rope_sin: gpu.upload(table.sin())?,
            xs: (0..=s.l).map(|_| gpu.alloc(n * c)).collect::<Result<Vec<_>>>()?,
            layers,
            xf: gpu.alloc(n * c)?,
            rf: gpu.alloc(n)?,
            logits: gpu.alloc(n * s.v)?,
            losses: gpu.alloc(n)?,
            dx: gpu.alloc(n * c)?,
            dres: gpu.alloc(n * c)?,
            dh: gpu.alloc(n * c)?,
            dsw: gpu.alloc(nf)?,
            dgate: gpu.alloc(nf)?,
            dup: gpu.alloc(nf)?,
            datt: gpu.alloc(n * c)?,
            dqkv: gpu.alloc(n * g.row())?,
            delta: gpu.alloc(s.b * s.nh * s.t)?,
            rms_scratch: gpu.alloc(ops::rmsnorm_backward_scratch(n, c))?,
            bias_scratch: gpu.alloc(if ll.block.bqkv.is_some() { super::ops::bias_grad_scratch(n, g.row()) } else { 0 })?,
            tokens: gpu.alloc(n)?,
            targets: gpu.alloc(n)?,
            uniq: gpu.alloc(n)?,
            offsets: gpu.alloc(n + 1)?,
            positions: gpu.alloc(n)?,
            moe,
            aux_loss: None,
            ll,
        })
    }

    fn acts(&self, l: usize) -> &Acts {
        &self.layers[if self.recompute { 0 } else { l }]
    }

    fn rope(&self) -> RopeDev {
        RopeDev { cos: self.rope_cos.ptr(), sin: self.rope_sin.ptr(), t: self.shape.t, half: self.ll.hd / 2 }
    }

    /// Device bytes held by activations and scratch.
    pub fn bytes(&self) -> usize {
        let b16 = [&self.xf, &self.logits, &self.dres, &self.dsw, &self.dgate, &self.dup, &self.datt, &self.dqkv];
        let b32 = [
            &self.rope_cos,
            &self.rope_sin,
            &self.rf,
            &self.losses,
            &self.dx,
            &self.dh,
            &self.delta,
            &self.rms_scratch,
            &self.bias_scratch,
        ];
        let u32s = [&self.tokens, &self.targets, &self.uniq, &self.offsets, &self.positions];
        self.layers.iter().map(Acts::bytes).sum::<usize>()
            + self.xs.iter().map(|b| b.len() * 4).sum::<usize>()
            + b16.iter().map(|b| b.len() * 2).sum::<usize>()
            + b32.iter().map(|b| b.len() * 4).sum::<usize>()
            + u32s.iter().map(|b| b.len() * 4).sum::<usize>()
            + self.moe.as_ref().map_or(0, |m| m.bytes())
    }
}

fn bf(p: DPtr<bf16>) -> Mat {
    Mat::new(p.raw, Dt::Bf16)
}
fn bft(p: DPtr<bf16>) -> Mat {
    Mat::tr(p.raw, Dt::Bf16)
}
fn f32m(p: DPtr<f32>) -> Mat {
    Mat::new(p.raw, Dt::F32)
}

/// `c = a·b + beta·c` (row-major `[m,k]·[k,n]`) through cuBLAS: the same call, the same bits.
// Allowed: BLAS's argument list (operands, m, k, n, beta) plus the GPU.
#[allow(clippy::too_many_arguments)]
fn mm(gpu: &Gpu, c: Mat, a: Mat, b: Mat, m: usize, k: usize, n: usize, beta: f32) -> Result<()> {
    gpu.blas.matmul_beta(c, a, b, (m, k, n), beta)
}

/// `dst = src` on the stream (f32 residual streams).
fn copy(gpu: &Gpu, st: &CudaStream, dst: DPtr<f32>, src: DPtr<f32>) -> Result<()> {
    gpu.copy(dst.cast(), src.cast(), st)
}

/// One block forward from `x`; writes `y` unless `y` is `None` (a recomputation for the
/// backward, which needs only the activations).
// Allowed: weights, input, output, activations, shapes and RoPE table are separate things both
// callers (forward, recomputation) hold.
#[allow(clippy::too_many_arguments)]
fn block_forward(
    gpu: &Gpu,
    st: &CudaStream,
    l: usize,
    w: &BlockW<bf16>,
    x: DPtr<f32>,
    y: Option<DPtr<f32>>,
    a: &Acts,
    ws: &Workspace,
) -> Result<()> {
    let (s, g, ll) = (ws.shape, ws.gqa, &ws.ll);
    let (n, c, f, row) = (s.n(), s.c, s.f, g.row());
    ops::rmsnorm_forward(gpu, st, a.h1.ptr(), a.r1.ptr(), x, w.attn_norm, n, c, ll.eps)?;
    gpu.mark("fwd rmsnorm");
    mm(gpu, bf(a.qkv.ptr()), bf(a.h1.ptr()), bf(w.wqkv), n, c, row, 0.0)?;
    gpu.mark("fwd gemm qkv");
    if let Some(b) = w.bqkv {
        super::ops::bias_add(gpu, st, a.qkv.ptr(), b, n, row)?;
    }
    ops::rope(gpu, st, a.qkv.ptr(), &ws.rope(), row, s.nh + g.nkv, false)?;
    gpu.mark("fwd rope (+bias)");
    attention::forward(gpu, st, a.atty.ptr(), a.lse.ptr(), a.qkv.ptr(), g)?;
    gpu.mark("fwd attention");
    copy(gpu, st, a.x2.ptr(), x)?;
    mm(gpu, f32m(a.x2.ptr()), bf(a.atty.ptr()), bf(w.wo), n, c, c, 1.0)?;
    gpu.mark("fwd gemm o (+copy)");
    ops::rmsnorm_forward(gpu, st, a.h2.ptr(), a.r2.ptr(), a.x2.ptr(), w.mlp_norm, n, c, ll.eps)?;
    gpu.mark("fwd rmsnorm");
    let (w_gate, w_up, w_down) = match (&w.mlp, ll.block.moe()) {
        (MlpW::Dense { w_gate, w_up, w_down }, _) => (*w_gate, *w_up, *w_down),
        (MlpW::Moe(mw), Some(ml)) => return moe_forward(gpu, st, l, ml, mw, y, a, ws),
        (MlpW::Moe(_), None) => unreachable!("MoE weights come from an MoE layout"),
    };
    mm(gpu, bf(a.gate.ptr()), bf(a.h2.ptr()), bf(w_gate), n, c, f, 0.0)?;
    mm(gpu, bf(a.up.ptr()), bf(a.h2.ptr()), bf(w_up), n, c, f, 0.0)?;
    gpu.mark("fwd gemm gate+up");
    ops::swiglu_forward(gpu, st, a.sw.ptr(), a.gate.ptr(), a.up.ptr())?;
    gpu.mark("fwd swiglu");
    if let Some(y) = y {
        copy(gpu, st, y, a.x2.ptr())?;
        mm(gpu, f32m(y), bf(a.sw.ptr()), bf(w_down), n, f, c, 1.0)?;
        gpu.mark("fwd gemm down (+copy)");
    }
    Ok(())
}

/// An MoE block's feed-forward: route `h2`, run the experts, `y = x2 + Σ_k w·out` (the
/// routing and the experts' rows run in a recomputation too: the backward needs them).
// Allowed: block_forward's arguments, split by kind.
#[allow(clippy::too_many_arguments)]
fn moe_forward(
    gpu: &Gpu,
    st: &CudaStream,
    l: usize,
    ml: &moe::MoeLayout,
    mw: &moe::MoeW<bf16>,
    y: Option<DPtr<f32>>,
    a: &Acts,
    ws: &Workspace,
) -> Result<()> {
    let (n, c) = (ws.shape.n(), ws.shape.c);
    let (ma, scr) = (a.moe.as_ref().expect("MoE acts"), ws.moe.as_ref().expect("MoE scratch"));
    moe::route(gpu, st, ml, mw.router, a.h2.ptr(), ma, n, c)?;
    moe::experts_forward(gpu, st, ml, mw, ma, a.mlp(), scr, l, c)?;
    if let Some(y) = y {
        moe::combine(gpu, st, ml, y, a.x2.ptr(), ma, n, c)?;
        moe::record_load(gpu, st, ml, ma, scr, l, n)?;
    }
    Ok(())
}

/// Backward of one block: `ws.dx` holds d(block output) (and `ws.dres` its bf16 copy) on
/// entry, d(block input) (and its copy) on exit. A linear layer's weight gradient is
/// `inpᵀ·dY`, its input gradient `dY·Wᵀ`.
// Allowed: the block's index, weights, gradients, input, activations and workspace.
#[allow(clippy::too_many_arguments)]
fn block_backward(
    gpu: &Gpu,
    st: &CudaStream,
    l: usize,
    w: &BlockW<bf16>,
    gw: &BlockW<f32>,
    x: DPtr<f32>,
    a: &Acts,
    ws: &Workspace,
) -> Result<()> {
    let (s, g) = (ws.shape, ws.gqa);
    let (n, c, f, row) = (s.n(), s.c, s.f, g.row());
    let (dres, dh) = (ws.dres.ptr(), ws.dh.ptr());
    let rms = |dw, xin, wn, rstd| RmsBackward {
        dx: ws.dx.ptr(),
        dx_bf16: dres,
        dw,
        dout: dh,
        x: xin,
        w: wn,
        rstd,
        scratch: ws.rms_scratch.ptr(),
        n,
        c,
    };
    match (&w.mlp, &gw.mlp, ws.ll.block.moe()) {
        (MlpW::Dense { w_gate, w_up, w_down }, MlpW::Dense { w_gate: g_gate, w_up: g_up, w_down: g_down }, _) => {
            // MLP branch: y = x2 + sw·Wd, sw = silu(h2·Wg) ∘ (h2·Wu).
            mm(gpu, f32m(*g_down), bft(a.sw.ptr()), bf(dres), f, n, c, 0.0)?;
            mm(gpu, bf(ws.dsw.ptr()), bf(dres), bft(*w_down), n, c, f, 0.0)?;
            gpu.mark("bwd gemm down (w+x)");
            ops::swiglu_backward(gpu, st, ws.dgate.ptr(), ws.dup.ptr(), ws.dsw.ptr(), a.gate.ptr(), a.up.ptr())?;
            gpu.mark("bwd swiglu");
            mm(gpu, f32m(*g_gate), bft(a.h2.ptr()), bf(ws.dgate.ptr()), c, n, f, 0.0)?;
            mm(gpu, f32m(*g_up), bft(a.h2.ptr()), bf(ws.dup.ptr()), c, n, f, 0.0)?;
            gpu.mark("bwd gemm gate+up wgrad");
            mm(gpu, f32m(dh), bf(ws.dgate.ptr()), bft(*w_gate), n, f, c, 0.0)?;
            mm(gpu, f32m(dh), bf(ws.dup.ptr()), bft(*w_up), n, f, c, 1.0)?;
            gpu.mark("bwd gemm gate+up dgrad");
        }
        (MlpW::Moe(mw), MlpW::Moe(mg), Some(ml)) => {
            let (ma, scr) = (a.moe.as_ref().expect("MoE acts"), ws.moe.as_ref().expect("MoE scratch"));
            let d = (ws.dgate.ptr(), ws.dup.ptr(), ws.dsw.ptr());
            moe::backward(gpu, st, ml, (mw, mg), a.h2.ptr(), ws.dx.ptr(), dh, ma, a.mlp(), d, scr, l, (n, c))?;
        }
        _ => unreachable!("a block's weights and gradients have one layout"),
    }
    ops::rmsnorm_backward(gpu, st, &rms(gw.mlp_norm, a.x2.ptr(), w.mlp_norm, a.r2.ptr()))?;
    gpu.mark("bwd rmsnorm");
    // Attention branch: x2 = x + attention(rope(h1·Wqkv + b))·Wo.
    mm(gpu, f32m(gw.wo), bft(a.atty.ptr()), bf(dres), c, n, c, 0.0)?;
    mm(gpu, bf(ws.datt.ptr()), bf(dres), bft(w.wo), n, c, c, 0.0)?;
    gpu.mark("bwd gemm o (w+x)");
    attention::backward(gpu, st, ws.dqkv.ptr(), ws.delta.ptr(), ws.datt.ptr(), a.qkv.ptr(), a.atty.ptr(), a.lse.ptr(), g)?;
    gpu.mark("bwd attention");
    ops::rope(gpu, st, ws.dqkv.ptr(), &ws.rope(), row, s.nh + g.nkv, true)?;
    gpu.mark("bwd rope");
    mm(gpu, f32m(gw.wqkv), bft(a.h1.ptr()), bf(ws.dqkv.ptr()), c, n, row, 0.0)?;
    if let Some(db) = gw.bqkv {
        super::ops::bias_grad(gpu, st, db, ws.dqkv.ptr(), ws.bias_scratch.ptr(), n, row)?;
    }
    mm(gpu, f32m(dh), bf(ws.dqkv.ptr()), bft(w.wqkv), n, row, c, 0.0)?;
    gpu.mark("bwd gemm qkv (w+bias+x)");
    ops::rmsnorm_backward(gpu, st, &rms(gw.attn_norm, x, w.attn_norm, a.r1.ptr()))?;
    gpu.mark("bwd rmsnorm");
    Ok(())
}

/// Uploads a micro-batch's ids after checking them against the vocabulary.
fn upload_batch(gpu: &Gpu, ws: &mut Workspace, tokens: &[u32], targets: &[u32]) -> Result<()> {
    let (n, v) = (ws.shape.n(), ws.shape.v);
    if tokens.len() != n || targets.len() != n {
        return Err(GpuError::Invalid(format!("micro-batch of {} tokens / {} targets, expected b·t = {n}", tokens.len(), targets.len())));
    }
    if let Some(&bad) = tokens.iter().chain(targets).find(|&&x| x as usize >= v) {
        return Err(GpuError::Invalid(format!("token id {bad} is outside the vocabulary of {v}")));
    }
    gpu.write(&mut ws.tokens, 0, tokens)?;
    gpu.write(&mut ws.targets, 0, targets)
}

/// Embedding and every block forward, then the final norm, the logits and the cross-entropy
/// (with `dscale` ≠ 0 the logits become d(logits), scaled by `dscale`). Returns unit 0's
/// parameters (the caller releases them).
fn forward_head(gpu: &Gpu, hooks: &mut dyn UnitHooks, ws: &Workspace, dscale: f32) -> Result<DPtr<bf16>> {
    let st: &CudaStream = &gpu.stream;
    let s = ws.shape;
    let (n, c, v) = (s.n(), s.c, s.v);
    let p0 = hooks.params(0, Phase::Forward)?;
    ops::embed_tokens(gpu, st, ws.xs[0].ptr(), ws.tokens.ptr(), p0.slice(ws.ll.wte.clone()), c)?;
    gpu.mark("embedding");
    for l in 0..s.l {
        let w = BlockW::at(hooks.params(1 + l, Phase::Forward)?, &ws.ll.block);
        block_forward(gpu, st, l, &w, ws.xs[l].ptr(), Some(ws.xs[l + 1].ptr()), ws.acts(l), ws)?;
        hooks.params_done(1 + l, Phase::Forward)?;
    }
    let head = p0.slice(ws.ll.head.clone());
    ops::rmsnorm_forward(gpu, st, ws.xf.ptr(), ws.rf.ptr(), ws.xs[s.l].ptr(), p0.slice(ws.ll.norm_f.clone()), n, c, ws.ll.eps)?;
    gpu.mark("head rmsnorm");
    mm(gpu, bf(ws.logits.ptr()), bf(ws.xf.ptr()), bft(head), n, c, v, 0.0)?;
    gpu.mark("head gemm logits");
    super::ops::crossentropy(gpu, st, ws.losses.ptr(), ws.logits.ptr(), ws.targets.ptr(), n, v, v, dscale)?;
    gpu.mark("head cross-entropy");
    Ok(p0)
}

/// One micro-batch: forward, mean cross-entropy, backward (see `gpt::forward_backward`).
pub fn forward_backward(
    gpu: &Gpu,
    hooks: &mut dyn UnitHooks,
    ws: &mut Workspace,
    tokens: &[u32],
    targets: &[u32],
    dloss: f32,
) -> Result<()> {
    upload_batch(gpu, ws, tokens, targets)?;
    let st: &CudaStream = &gpu.stream;
    let s = ws.shape;
    let (n, c, v) = (s.n(), s.c, s.v);
    let p0 = forward_head(gpu, hooks, ws, dloss / n as f32)?;
    // The load-balancing loss needs every block's routing: known now, before the backward.
    if let (Some(ml), Some(scr)) = (ws.ll.block.moe(), ws.moe.as_ref()) {
        ws.aux_loss = Some(moe::aux_loss(gpu, ml, scr, n, dloss)?);
    }
    // The embedding backward's token index, sorted on the host while the GPU runs the forward
    // (the copies are ordered on the stream after it).
    let idx = super::ops::TokenIndex::new(tokens, v);
    gpu.write(&mut ws.uniq, 0, &idx.uniq)?;
    gpu.write(&mut ws.offsets, 0, &idx.offsets)?;
    gpu.write(&mut ws.positions, 0, &idx.positions)?;
    let ws = &*ws;
    let (uniq, offsets) = (ws.uniq.slice(0..idx.uniq.len()), ws.offsets.slice(0..idx.offsets.len()));
    let g0 = hooks.grads(0)?;
    let (head, xf) = (p0.slice(ws.ll.head.clone()), ws.xf.ptr());
    // d(xf) = dlogits · head;  d(head) = dlogitsᵀ · xf (written: the embedding backward adds onto it when tied).
    mm(gpu, f32m(ws.dh.ptr()), bf(ws.logits.ptr()), bf(head), n, v, c, 0.0)?;
    mm(gpu, f32m(g0.slice(ws.ll.head.clone())), bft(ws.logits.ptr()), bf(xf), v, n, c, 0.0)?;
    gpu.mark("head gemm dgrad+wgrad");
    gpu.zero(ws.dx.ptr(), st)?;
    let x_last = ws.xs[s.l].ptr();
    let head_rms = RmsBackward {
        dx: ws.dx.ptr(),
        dx_bf16: ws.dres.ptr(),
        dw: g0.slice(ws.ll.norm_f.clone()),
        dout: ws.dh.ptr(),
        x: x_last,
        w: p0.slice(ws.ll.norm_f.clone()),
        rstd: ws.rf.ptr(),
        scratch: ws.rms_scratch.ptr(),
        n,
        c,
    };
    ops::rmsnorm_backward(gpu, st, &head_rms)?;
    gpu.mark("head rmsnorm bwd");
    for l in (0..s.l).rev() {
        let w = BlockW::at(hooks.params(1 + l, Phase::Backward)?, &ws.ll.block);
        let gw = BlockW::at(hooks.grads(1 + l)?, &ws.ll.block);
        if ws.recompute {
            block_forward(gpu, st, l, &w, ws.xs[l].ptr(), None, ws.acts(l), ws)?;
        }
        block_backward(gpu, st, l, &w, &gw, ws.xs[l].ptr(), ws.acts(l), ws)?;
        hooks.params_done(1 + l, Phase::Backward)?;
        hooks.grads_done(1 + l)?;
    }
    let gwte = g0.slice(ws.ll.wte.clone());
    super::ops::embedding_backward_wte(gpu, st, gwte, ws.dx.ptr(), uniq, offsets, ws.positions.ptr(), n, c)?;
    gpu.mark("embedding bwd");
    hooks.params_done(0, Phase::Backward)?;
    hooks.grads_done(0)
}

/// Forward only: fills `ws.losses` (no gradients).
pub fn forward_loss(gpu: &Gpu, hooks: &mut dyn UnitHooks, ws: &mut Workspace, tokens: &[u32], targets: &[u32]) -> Result<()> {
    upload_batch(gpu, ws, tokens, targets)?;
    forward_head(gpu, hooks, ws, 0.0)?;
    if let (Some(ml), Some(scr)) = (ws.ll.block.moe(), ws.moe.as_ref()) {
        ws.aux_loss = Some(moe::aux_loss(gpu, ml, scr, ws.shape.n(), 0.0)?);
    }
    hooks.params_done(0, Phase::Forward)
}
