//! GPT-2 forward and backward on the GPU: bf16 parameters and activations, an f32 residual stream,
//! f32 gradients, cuBLAS GEMMs with f32 accumulation, fused flash attention, fused softmax
//! cross-entropy. The same parameter layout as the CPU [`Model`] (weights stored `[in, out]`,
//! tensors in the same order), padded per unit so ZeRO can split every unit evenly across ranks.
//!
//! Where the parameters come from and where the gradients go is the caller's business
//! ([`UnitHooks`]): plain data parallelism hands out one full buffer, ZeRO-3 gathers each unit
//! just before use (prefetching on a communication stream) and reduce-scatters its gradient as
//! soon as the unit's backward is done.
//!
//! Each micro-batch's gradient is written into a zeroed buffer (GEMMs with β = 0, the few
//! accumulating kernels add into zeros), so the result is a pure function of that micro-batch:
//! micro-batches are then combined by the caller's fixed tree, which is what makes 1 and 2 GPUs
//! give the same bits.

use std::ops::Range;

use cudarc::driver::CudaStream;

use super::attention::{self, AttnBackward, AttnShape};
use super::blas::{Dt, Mat};
use super::lt::{Epilogue, Gemm};
use super::{bf16, ops, Buf, CheckRow, DPtr, Gpu, GpuError, Result};
use crate::model::{Arch, Model, ModelConfig};

/// Units are padded to a multiple of `world × ALIGN` elements: every rank's piece of every unit
/// starts on a gradient-norm block boundary (the optimizer's `NORM_BLOCK`).
pub const ALIGN: usize = crate::optim::NORM_BLOCK;

/// The GPU's flat layout: the CPU layout with each unit padded so it splits evenly over `world`.
#[derive(Clone, Debug)]
pub struct GpuLayout {
    /// Unit ranges in the CPU (unpadded) flat buffer.
    pub cpu_units: Vec<Range<usize>>,
    /// Unit ranges in the padded GPU flat buffer.
    pub units: Vec<Range<usize>>,
    pub world: usize,
    pub total: usize,
    /// Where the model's tensors lie in their units, by architecture.
    pub tensors: Tensors,
    /// Weight-decay flag per padded element (padding: no decay; it stays zero either way).
    decay_tensors: Vec<(Range<usize>, bool)>,
}

/// Unit-local tensor ranges of a [`GpuLayout`]: GPT-2's, or the LLaMA family's (with what its
/// kernels need of the configuration).
#[derive(Clone, Debug)]
pub enum Tensors {
    Gpt {
        /// The 4 embedding-unit tensors (wte, wpe, ln_f.weight, ln_f.bias).
        embed: [Range<usize>; 4],
        /// A block's 12 tensors (identical for every block).
        block: [Range<usize>; 12],
    },
    Llama(super::llama::LlamaLayout),
}

/// GPT-2's tensors, from `local(unit, name)` (a tensor's unit-local range).
fn gpt_tensors(local: &dyn Fn(usize, &str) -> Result<Range<usize>>) -> Result<Tensors> {
    let embed = [local(0, "wte.weight")?, local(0, "wpe.weight")?, local(0, "ln_f.weight")?, local(0, "ln_f.bias")?];
    let names = [
        "ln_1.weight",
        "ln_1.bias",
        "attn.c_attn.weight",
        "attn.c_attn.bias",
        "attn.c_proj.weight",
        "attn.c_proj.bias",
        "ln_2.weight",
        "ln_2.bias",
        "mlp.c_fc.weight",
        "mlp.c_fc.bias",
        "mlp.c_proj.weight",
        "mlp.c_proj.bias",
    ];
    let mut block: [Range<usize>; 12] = Default::default();
    for (i, n) in names.iter().enumerate() {
        block[i] = local(1, &format!("h.0.{n}"))?;
    }
    Ok(Tensors::Gpt { embed, block })
}

impl GpuLayout {
    pub fn new(model: &Model, world: usize) -> Result<GpuLayout> {
        assert!(world >= 1);
        let cpu_units = model.units().to_vec();
        let specs = model.layout().specs();
        let quantum = world * ALIGN;
        let mut units = Vec::with_capacity(cpu_units.len());
        let mut off = 0;
        for u in &cpu_units {
            let len = (u.end - u.start).div_ceil(quantum) * quantum;
            units.push(off..off + len);
            off += len;
        }
        let local = |u: usize, name: &str| -> Result<Range<usize>> {
            let s = specs.iter().find(|s| s.name == name).ok_or_else(|| GpuError::Invalid(format!("model has no tensor `{name}`")))?;
            let base = cpu_units[u].start;
            Ok(s.offset - base..s.offset - base + s.numel())
        };
        if model.cfg.arch == Arch::Gpt && model.cfg.moe.is_some() {
            return Err(GpuError::Invalid(
                "the GPU runs mixture-of-experts feed-forwards only in LLaMA-family blocks; GPT MoE models train on the CPU".into(),
            ));
        }
        let tensors = match model.cfg.arch {
            Arch::Gpt => gpt_tensors(&local)?,
            Arch::Llama => Tensors::Llama(super::llama::LlamaLayout::new(model, &local)?),
        };
        let mut decay_tensors = Vec::new();
        for s in specs {
            let u = cpu_units.iter().position(|r| r.contains(&s.offset)).expect("every tensor lies in a unit");
            let g = units[u].start + (s.offset - cpu_units[u].start);
            decay_tensors.push((g..g + s.numel(), s.decay));
        }
        Ok(GpuLayout { cpu_units, units, world, total: off, tensors, decay_tensors })
    }

    /// The LLaMA family's tensors, when the model is one.
    pub fn llama(&self) -> Option<&super::llama::LlamaLayout> {
        match &self.tensors {
            Tensors::Llama(l) => Some(l),
            Tensors::Gpt { .. } => None,
        }
    }

    /// GPT-2's embedding-unit and block tensors.
    ///
    /// # Panics
    /// On a LLaMA layout: GPT-2 code is only reached through a GPT-2 workspace.
    fn gpt(&self) -> (&[Range<usize>; 4], &[Range<usize>; 12]) {
        match &self.tensors {
            Tensors::Gpt { embed, block } => (embed, block),
            Tensors::Llama(_) => panic!("GPT-2 kernels called on a LLaMA layout"),
        }
    }

    /// Rank `r`'s piece of unit `u`, as a range of the padded flat buffer.
    pub fn piece(&self, u: usize, r: usize) -> Range<usize> {
        let len = (self.units[u].end - self.units[u].start) / self.world;
        let s = self.units[u].start + r * len;
        s..s + len
    }

    /// Elements each rank owns (the same for every rank).
    pub fn shard_len(&self) -> usize {
        self.total / self.world
    }

    /// Where unit `u`'s piece starts inside a rank's shard.
    pub fn shard_offset(&self, u: usize) -> usize {
        self.units[..u].iter().map(|r| (r.end - r.start) / self.world).sum()
    }

    /// CPU flat buffer → padded GPU layout (padding zero).
    pub fn pad<T: Copy + Default>(&self, cpu: &[T]) -> Vec<T> {
        let mut out = vec![T::default(); self.total];
        for (c, g) in self.cpu_units.iter().zip(&self.units) {
            out[g.start..g.start + c.len()].copy_from_slice(&cpu[c.clone()]);
        }
        out
    }

    /// Padded GPU layout → CPU flat buffer.
    pub fn unpad<T: Copy + Default>(&self, gpu: &[T]) -> Vec<T> {
        let n = self.cpu_units.last().map_or(0, |u| u.end);
        let mut out = vec![T::default(); n];
        for (c, g) in self.cpu_units.iter().zip(&self.units) {
            out[c.clone()].copy_from_slice(&gpu[g.start..g.start + c.len()]);
        }
        out
    }

    /// Where each of the model's tensors starts in the padded buffer, in the CPU layout's order
    /// (the segments of `model.layout()`).
    pub fn tensor_starts(&self) -> Vec<usize> {
        self.decay_tensors.iter().map(|(r, _)| r.start).collect()
    }

    /// 1 where weight decay applies, per element of the padded buffer.
    pub fn decay_mask(&self) -> Vec<u8> {
        let mut m = vec![0u8; self.total];
        for (r, d) in &self.decay_tensors {
            if *d {
                m[r.clone()].fill(1);
            }
        }
        m
    }
}

/// Tensors of one block (views into a unit's buffer).
#[derive(Clone, Copy, Debug)]
pub struct BlockW<T> {
    pub ln1_w: DPtr<T>,
    pub ln1_b: DPtr<T>,
    pub qkv_w: DPtr<T>,
    pub qkv_b: DPtr<T>,
    pub proj_w: DPtr<T>,
    pub proj_b: DPtr<T>,
    pub ln2_w: DPtr<T>,
    pub ln2_b: DPtr<T>,
    pub fc_w: DPtr<T>,
    pub fc_b: DPtr<T>,
    pub fc2_w: DPtr<T>,
    pub fc2_b: DPtr<T>,
}

impl<T> BlockW<T> {
    pub fn at(unit: DPtr<T>, l: &GpuLayout) -> Self {
        let v = |i: usize| unit.slice(l.gpt().1[i].clone());
        BlockW {
            ln1_w: v(0),
            ln1_b: v(1),
            qkv_w: v(2),
            qkv_b: v(3),
            proj_w: v(4),
            proj_b: v(5),
            ln2_w: v(6),
            ln2_b: v(7),
            fc_w: v(8),
            fc_b: v(9),
            fc2_w: v(10),
            fc2_b: v(11),
        }
    }
}

/// Tensors of the embedding unit.
#[derive(Clone, Copy, Debug)]
pub struct EmbedW<T> {
    pub wte: DPtr<T>,
    pub wpe: DPtr<T>,
    pub lnf_w: DPtr<T>,
    pub lnf_b: DPtr<T>,
}

impl<T> EmbedW<T> {
    pub fn at(unit: DPtr<T>, l: &GpuLayout) -> Self {
        let v = |i: usize| unit.slice(l.gpt().0[i].clone());
        EmbedW { wte: v(0), wpe: v(1), lnf_w: v(2), lnf_b: v(3) }
    }
}

/// Forward or backward use of a unit's parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Forward,
    Backward,
}

/// Supplies parameters and takes gradients, unit by unit (unit 0 = embeddings + final norm,
/// unit `1 + l` = block `l`). All pointers refer to the padded unit (see [`GpuLayout`]).
pub trait UnitHooks {
    /// Unit `u`'s bf16 parameters, usable by work enqueued next on the compute stream.
    fn params(&mut self, u: usize, phase: Phase) -> Result<DPtr<bf16>>;
    /// The compute stream has enqueued its last read of unit `u`'s parameters for `phase`.
    fn params_done(&mut self, u: usize, phase: Phase) -> Result<()>;
    /// Where unit `u`'s f32 gradient for this micro-batch goes (zeroed by the caller).
    fn grads(&mut self, u: usize) -> Result<DPtr<f32>>;
    /// Unit `u`'s gradient for this micro-batch is complete once the compute stream reaches here.
    fn grads_done(&mut self, u: usize) -> Result<()>;
}

/// Shape of a run.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub b: usize,
    pub t: usize,
    pub c: usize,
    pub nh: usize,
    pub l: usize,
    pub v: usize,
    pub f: usize,
}

impl Shape {
    pub fn new(cfg: &ModelConfig, b: usize, t: usize) -> Result<Shape> {
        if t > cfg.max_seq_len {
            return Err(GpuError::Invalid(format!("sequence length {t} exceeds the model's context {}", cfg.max_seq_len)));
        }
        if cfg.arch == Arch::Llama {
            let g = super::llama::attention::GqaShape { b, t, nh: cfg.n_head, nkv: cfg.n_kv_head, hd: cfg.head_dim() };
            g.validate()?;
        } else if cfg.d_model / cfg.n_head != 64 {
            return Err(GpuError::Invalid(format!(
                "the GPU attention kernel needs head dimension 64; d_model {} / n_head {} = {}",
                cfg.d_model,
                cfg.n_head,
                cfg.d_model / cfg.n_head
            )));
        }
        Ok(Shape { b, t, c: cfg.d_model, nh: cfg.n_head, l: cfg.n_layer, v: cfg.vocab_size, f: cfg.d_ff })
    }
    pub fn n(&self) -> usize {
        self.b * self.t
    }
    /// The shape of each block's attention.
    pub fn attn(&self) -> AttnShape {
        AttnShape::mha(self.b, self.t, self.c, self.nh)
    }
}

/// Which cuBLASLt epilogue fusions a [`Workspace`] uses (each replaces one elementwise pass).
/// Chosen once when the workspace is made: of the set `TESSERA_GPU_FUSE` asks for
/// ([`Fusions::DEFAULT`] when unset; `all`; `none`/`0`; or a comma list of the names below),
/// what the GPU's cuBLASLt supports for the model's shapes. Forward and backward of a
/// micro-batch always use the same set. docs/PERFORMANCE.md has what each one saves on H200.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fusions {
    /// qkv GEMM adds its bias (no `bias_add` pass).
    pub bias: bool,
    /// fc GEMM adds its bias and applies GELU, keeping the biased pre-activation (no GELU pass).
    pub gelu: bool,
    /// fc2's input-gradient GEMM applies GELU' (no GELU backward pass); needs `gelu`.
    pub dgelu: bool,
    /// weight-gradient GEMMs sum their bias gradient (no bias-gradient passes).
    pub bgrad: bool,
    /// the projection and fc2 GEMMs add their bias and the f32 residual stream and write the
    /// new residual stream in f32 (no residual passes; one rounding instead of the bf16 product's
    /// and the sum's).
    pub residual: bool,
}

impl Fusions {
    pub const NAMES: [&'static str; 5] = ["bias", "gelu", "dgelu", "bgrad", "residual"];

    /// Names of the fusions in use, comma-separated (`none` for none).
    pub fn describe(&self) -> String {
        let on = [self.bias, self.gelu, self.dgelu, self.bgrad, self.residual];
        let v: Vec<&str> = Self::NAMES.iter().zip(on).filter(|(_, o)| *o).map(|(n, _)| *n).collect();
        if v.is_empty() {
            "none".into()
        } else {
            v.join(",")
        }
    }

    /// Every fusion.
    pub const ALL: Fusions = Fusions { bias: true, gelu: true, dgelu: true, bgrad: true, residual: true };
    /// The fusions that paid on H200 (GPT-2 124M): `bgrad` slows the weight-gradient GEMMs
    /// more than the bias-gradient kernels it removes cost.
    pub const DEFAULT: Fusions = Fusions { bias: true, gelu: true, dgelu: true, bgrad: false, residual: true };

    /// What `TESSERA_GPU_FUSE` asks for ([`Fusions::DEFAULT`] when unset or empty).
    pub fn requested() -> Result<Fusions> {
        let Ok(v) = std::env::var("TESSERA_GPU_FUSE") else { return Ok(Fusions::DEFAULT) };
        Self::parse(&v).map_err(|e| GpuError::Invalid(format!("TESSERA_GPU_FUSE: {e}")))
    }

    /// A value of `TESSERA_GPU_FUSE`: `all`, `none` (or `0`), empty (the default) or a comma
    /// list of [`Fusions::NAMES`]; the error names what is wrong (the variable's table,
    /// `tessera::env`, checks values with it).
    pub fn parse(v: &str) -> std::result::Result<Fusions, String> {
        let v = v.trim();
        if v.is_empty() {
            return Ok(Fusions::DEFAULT);
        }
        if v == "all" {
            return Ok(Fusions::ALL);
        }
        let mut f = Fusions::default();
        if v == "0" || v == "none" {
            return Ok(f);
        }
        for name in v.split(',').map(str::trim) {
            match name {
                "bias" => f.bias = true,
                "gelu" => f.gelu = true,
                "dgelu" => f.dgelu = true,
                "bgrad" => f.bgrad = true,
                "residual" => f.residual = true,
                other => {
                    return Err(format!("unknown fusion `{other}` (expected `all`, `none` or a comma list of {})", Self::NAMES.join(", ")))
                }
            }
        }
        Ok(f)
    }

    /// The requested fusions that cuBLASLt can run for shape `s`: each fused GEMM is planned
    /// once (nothing runs) with operands of the alignment the model gives them: activations at
    /// the start of their own allocations, a block's parameters and gradients at their offset
    /// in a unit (units start 256-byte aligned).
    fn probe(gpu: &Gpu, want: Fusions, s: Shape, layout: &GpuLayout) -> Result<Fusions> {
        let Some(lt) = gpu.lt.as_ref() else { return Ok(Fusions::default()) };
        let probes = Probes::new(gpu, s, layout)?;
        let bias = want.bias && probes.qkv_bias(lt);
        let gelu = want.gelu && probes.fc_gelu(lt);
        let dgelu = gelu && want.dgelu && probes.dgelu(lt);
        let bgrad = want.bgrad && probes.bgrad(lt);
        let residual = want.residual && probes.residual(lt);
        Ok(Fusions { bias, gelu, dgelu, bgrad, residual })
    }
}

/// cuBLASLt support of each fused GEMM for a shape (`tessera gpu check` prints it).
pub fn fusion_support(gpu: &Gpu, s: Shape, layout: &GpuLayout) -> Result<Vec<(&'static str, bool)>> {
    let Some(lt) = gpu.lt.as_ref() else { return Ok(Vec::new()) };
    let p = Probes::new(gpu, s, layout)?;
    Ok(vec![
        ("qkv GEMM + bias (bf16)", p.qkv_bias(lt)),
        ("fc GEMM + bias + GELU, pre-activation kept", p.fc_gelu(lt)),
        ("fc2 input-gradient GEMM + GELU'", p.dgelu(lt)),
        ("weight-gradient GEMMs + bias gradient", p.bgrad(lt)),
        ("projection and fc2 GEMMs + bias + f32 residual", p.residual(lt)),
    ])
}

/// Operands for planning the fused GEMMs of one block (pointers only matter for alignment).
struct Probes {
    _buf: Buf<f32>,
    base: u64,
    s: Shape,
    offsets: [usize; 12],
}

impl Probes {
    fn new(gpu: &Gpu, s: Shape, layout: &GpuLayout) -> Result<Probes> {
        let buf = gpu.alloc::<f32>(1024)?;
        let offsets = std::array::from_fn(|i| layout.gpt().1[i].start);
        Ok(Probes { base: buf.ptr().raw, _buf: buf, s, offsets })
    }
    /// An activation (own allocation: 256-byte aligned).
    fn act(&self, dt: Dt) -> Mat {
        Mat::new(self.base, dt)
    }
    /// Block tensor `i` as bf16 parameter / f32 gradient.
    fn p16(&self, i: usize) -> u64 {
        self.base + ((self.offsets[i] * 2) % 256) as u64
    }
    fn g32(&self, i: usize) -> u64 {
        self.base + ((self.offsets[i] * 4) % 256) as u64
    }
    fn ok(lt: &super::lt::Lt, c: Mat, a: Mat, b: Mat, (m, k, n): (usize, usize, usize), residual: Option<Mat>, epilogue: Epilogue) -> bool {
        lt.supports(&Gemm { c, a, b, m, k, n, residual, epilogue })
    }
    fn qkv_bias(&self, lt: &super::lt::Lt) -> bool {
        let (n, c) = (self.s.n(), self.s.c);
        let e = Epilogue::Bias { bias: self.p16(3) };
        Self::ok(lt, self.act(Dt::Bf16), self.act(Dt::Bf16), Mat::new(self.p16(2), Dt::Bf16), (n, c, 3 * c), None, e)
    }
    fn fc_gelu(&self, lt: &super::lt::Lt) -> bool {
        let (n, c, f) = (self.s.n(), self.s.c, self.s.f);
        let e = Epilogue::GeluAuxBias { bias: self.p16(9), pre: self.base };
        Self::ok(lt, self.act(Dt::Bf16), self.act(Dt::Bf16), Mat::new(self.p16(8), Dt::Bf16), (n, c, f), None, e)
    }
    fn dgelu(&self, lt: &super::lt::Lt) -> bool {
        let (n, c, f) = (self.s.n(), self.s.c, self.s.f);
        let e = Epilogue::DGelu { pre: self.base };
        Self::ok(lt, self.act(Dt::Bf16), self.act(Dt::Bf16), Mat::tr(self.p16(10), Dt::Bf16), (n, c, f), None, e)
    }
    fn residual(&self, lt: &super::lt::Lt) -> bool {
        let (n, c, f) = (self.s.n(), self.s.c, self.s.f);
        [(4, c), (10, f)].into_iter().all(|(w, k)| {
            let e = Epilogue::BiasF32 { bias: self.base };
            let res = Some(self.act(Dt::F32));
            Self::ok(lt, self.act(Dt::F32), self.act(Dt::Bf16), Mat::new(self.p16(w), Dt::Bf16), (n, k, c), res, e)
        })
    }
    fn bgrad(&self, lt: &super::lt::Lt) -> bool {
        let (n, c, f) = (self.s.n(), self.s.c, self.s.f);
        [(2, 3, c, 3 * c), (4, 5, c, c), (8, 9, c, f), (10, 11, f, c)].into_iter().all(|(w, b, rows, cols)| {
            let e = Epilogue::BgradB { dbias: self.g32(b) };
            Self::ok(lt, Mat::new(self.g32(w), Dt::F32), Mat::tr(self.base, Dt::Bf16), self.act(Dt::Bf16), (rows, n, cols), None, e)
        })
    }
}

/// Saved activations of one block.
struct LayerActs {
    ln1: Buf<bf16>,
    m1: Buf<f32>,
    r1: Buf<f32>,
    qkv: Buf<bf16>,
    atty: Buf<bf16>,
    lse: Buf<f32>,
    x2: Buf<f32>,
    ln2: Buf<bf16>,
    m2: Buf<f32>,
    r2: Buf<f32>,
    pre: Buf<bf16>,
    gl: Buf<bf16>,
}

/// Activations and scratch of one micro-batch shape, allocated once: GPT-2's, or the LLaMA
/// family's ([`super::llama`]), by the layout's architecture. [`forward_backward`],
/// [`forward_loss`] and [`mean_loss`] dispatch on it, so callers need not know which.
pub enum Workspace {
    Gpt(Box<GptWorkspace>),
    Llama(Box<super::llama::Workspace>),
}

impl Workspace {
    /// A workspace with the fusions `TESSERA_GPU_FUSE` asks for ([`Fusions::DEFAULT`]) that
    /// cuBLASLt supports here.
    pub fn new(gpu: &Gpu, s: Shape, layout: &GpuLayout) -> Result<Workspace> {
        Self::with_options(gpu, s, layout, Fusions::requested()?, false)
    }

    /// As [`GptWorkspace::with_options`] for GPT-2; the LLaMA family's GEMMs run without
    /// cuBLASLt fusions (`want` is not used there: [`Workspace::fusions`] says `none`).
    pub fn with_options(gpu: &Gpu, s: Shape, layout: &GpuLayout, want: Fusions, recompute: bool) -> Result<Workspace> {
        match layout.tensors {
            Tensors::Gpt { .. } => Ok(Workspace::Gpt(Box::new(GptWorkspace::with_options(gpu, s, layout, want, recompute)?))),
            Tensors::Llama(_) => Ok(Workspace::Llama(Box::new(super::llama::Workspace::new(gpu, s, layout, recompute)?))),
        }
    }

    /// The micro-batch shape.
    pub fn shape(&self) -> Shape {
        match self {
            Workspace::Gpt(w) => w.shape,
            Workspace::Llama(w) => w.shape,
        }
    }

    /// The cuBLASLt fusions in use.
    pub fn fusions(&self) -> Fusions {
        match self {
            Workspace::Gpt(w) => w.fusions,
            Workspace::Llama(_) => Fusions::default(),
        }
    }

    /// Per-position losses of the last micro-batch.
    pub fn losses(&self) -> DPtr<f32> {
        match self {
            Workspace::Gpt(w) => w.losses.ptr(),
            Workspace::Llama(w) => w.losses.ptr(),
        }
    }

    /// Device bytes held by activations and scratch.
    pub fn bytes(&self) -> usize {
        match self {
            Workspace::Gpt(w) => w.bytes(),
            Workspace::Llama(w) => w.bytes(),
        }
    }
}

/// Every activation and scratch buffer of one GPT-2 micro-batch shape, allocated once.
pub struct GptWorkspace {
    pub shape: Shape,
    /// The cuBLASLt fusions this workspace's forward and backward use.
    pub fusions: Fusions,
    /// Activation checkpointing: one shared set of block activations, recomputed in backward.
    pub recompute: bool,
    /// Shared, so the model functions can hold it while they write into the workspace.
    pub layout: std::sync::Arc<GpuLayout>,
    tmp: Buf<bf16>,
    /// f32 copies of one block's projection and fc2 biases (the `residual` fusion's GEMMs
    /// take an f32 bias with their f32 output).
    bias32: Buf<f32>,
    xs: Vec<Buf<f32>>,
    layers: Vec<LayerActs>,
    xf: Buf<bf16>,
    mf: Buf<f32>,
    rf: Buf<f32>,
    logits: Buf<bf16>,
    /// Per-position losses of the last micro-batch.
    pub losses: Buf<f32>,
    dx: Buf<f32>,
    dres: Buf<bf16>,
    dbig1: Buf<bf16>,
    dbig2: Buf<bf16>,
    dln: Buf<bf16>,
    dqkv: Buf<bf16>,
    datt: Buf<bf16>,
    delta: Buf<f32>,
    ln_scratch: Buf<f32>,
    bias_scratch: Buf<f32>,
    /// The first pass of `dres`'s column sums (its linear layer's bias gradient), written by the
    /// LayerNorm backward that writes `dres`.
    dres_sums: Buf<f32>,
    tokens: Buf<u32>,
    targets: Buf<u32>,
    uniq: Buf<u32>,
    offsets: Buf<u32>,
    positions: Buf<u32>,
}

impl GptWorkspace {
    /// The block forward's scratch: the bf16 projection outputs and the f32 biases.
    fn fwd_scratch(&self) -> (DPtr<bf16>, DPtr<f32>) {
        (self.tmp.ptr(), self.bias32.ptr())
    }

    /// A workspace with the fusions `TESSERA_GPU_FUSE` asks for ([`Fusions::DEFAULT`]) that
    /// cuBLASLt supports here.
    pub fn new(gpu: &Gpu, s: Shape, layout: &GpuLayout) -> Result<GptWorkspace> {
        Self::with_options(gpu, s, layout, Fusions::requested()?, false)
    }

    /// A workspace with the fusions of `want` that cuBLASLt supports here.
    pub fn with_fusions(gpu: &Gpu, s: Shape, layout: &GpuLayout, want: Fusions) -> Result<GptWorkspace> {
        Self::with_options(gpu, s, layout, want, false)
    }

    /// As [`GptWorkspace::with_fusions`]; with `recompute` (activation checkpointing) the blocks
    /// keep only their inputs (`xs`) and share one set of activations, which the backward
    /// recomputes block by block: about a block's activations instead of all of them, for one
    /// more forward of the blocks (without the last projection). Same bits either way.
    pub fn with_options(gpu: &Gpu, s: Shape, layout: &GpuLayout, want: Fusions, recompute: bool) -> Result<GptWorkspace> {
        let (n, c, f) = (s.n(), s.c, s.f);
        let bht = s.b * s.nh * s.t;
        let kept = if recompute { s.l.min(1) } else { s.l };
        let mut layers = Vec::with_capacity(kept);
        for _ in 0..kept {
            layers.push(LayerActs {
                ln1: gpu.alloc(n * c)?,
                m1: gpu.alloc(n)?,
                r1: gpu.alloc(n)?,
                qkv: gpu.alloc(n * 3 * c)?,
                atty: gpu.alloc(n * c)?,
                lse: gpu.alloc(bht)?,
                x2: gpu.alloc(n * c)?,
                ln2: gpu.alloc(n * c)?,
                m2: gpu.alloc(n)?,
                r2: gpu.alloc(n)?,
                pre: gpu.alloc(n * f)?,
                gl: gpu.alloc(n * f)?,
            });
        }
        let xs = (0..=s.l).map(|_| gpu.alloc(n * c)).collect::<Result<Vec<_>>>()?;
        let scratch_cols = (3 * c).max(f).max(c);
        let tmp = gpu.alloc(n * c)?;
        let dx: Buf<f32> = gpu.alloc(n * c)?;
        let fusions = Fusions::probe(gpu, want, s, layout)?;
        Ok(GptWorkspace {
            shape: s,
            fusions,
            recompute,
            layout: std::sync::Arc::new(layout.clone()),
            tmp,
            bias32: gpu.alloc(2 * bias32_stride(c))?,
            xs,
            layers,
            xf: gpu.alloc(n * c)?,
            mf: gpu.alloc(n)?,
            rf: gpu.alloc(n)?,
            logits: gpu.alloc(n * s.v)?,
            losses: gpu.alloc(n)?,
            dx,
            dres: gpu.alloc(n * c)?,
            dbig1: gpu.alloc(n * f.max(3 * c))?,
            dbig2: gpu.alloc(n * f)?,
            dln: gpu.alloc(n * c)?,
            dqkv: gpu.alloc(n * 3 * c)?,
            datt: gpu.alloc(n * c)?,
            delta: gpu.alloc(bht)?,
            ln_scratch: gpu.alloc(ops::layernorm_backward_scratch(n, c))?,
            bias_scratch: gpu.alloc(ops::bias_grad_scratch(n, scratch_cols))?,
            dres_sums: gpu.alloc(ops::bias_grad_scratch(n, c))?,
            tokens: gpu.alloc(n)?,
            targets: gpu.alloc(n)?,
            uniq: gpu.alloc(n)?,
            offsets: gpu.alloc(n + 1)?,
            positions: gpu.alloc(n)?,
        })
    }

    /// Block `l`'s activations (the shared set under `recompute`).
    fn acts(&self, l: usize) -> &LayerActs {
        &self.layers[if self.recompute { 0 } else { l }]
    }

    /// Device bytes held by activations and scratch.
    pub fn bytes(&self) -> usize {
        let b16 = |b: &Buf<bf16>| b.len() * 2;
        let b32 = |b: &Buf<f32>| b.len() * 4;
        let u32b = |b: &Buf<u32>| b.len() * 4;
        let layers: usize = self
            .layers
            .iter()
            .map(|a| {
                b16(&a.ln1)
                    + b32(&a.m1)
                    + b32(&a.r1)
                    + b16(&a.qkv)
                    + b16(&a.atty)
                    + b32(&a.lse)
                    + b32(&a.x2)
                    + b16(&a.ln2)
                    + b32(&a.m2)
                    + b32(&a.r2)
                    + b16(&a.pre)
                    + b16(&a.gl)
            })
            .sum();
        layers
            + b16(&self.tmp)
            + b32(&self.bias32)
            + self.xs.iter().map(b32).sum::<usize>()
            + b16(&self.xf)
            + b32(&self.mf)
            + b32(&self.rf)
            + b16(&self.logits)
            + b32(&self.losses)
            + b32(&self.dx)
            + b16(&self.dres)
            + b16(&self.dbig1)
            + b16(&self.dbig2)
            + b16(&self.dln)
            + b16(&self.dqkv)
            + b16(&self.datt)
            + b32(&self.delta)
            + b32(&self.ln_scratch)
            + b32(&self.bias_scratch)
            + b32(&self.dres_sums)
            + u32b(&self.tokens)
            + u32b(&self.targets)
            + u32b(&self.uniq)
            + u32b(&self.offsets)
            + u32b(&self.positions)
    }
}

fn bf(p: DPtr<bf16>) -> Mat {
    Mat::new(p.raw, Dt::Bf16)
}
fn bft(p: DPtr<bf16>) -> Mat {
    Mat::tr(p.raw, Dt::Bf16)
}
/// Where the fc2 bias starts in the f32 bias scratch: `c` rounded up to 64 floats, so both
/// halves are 256-byte aligned as the fusion's probe planned them.
fn bias32_stride(c: usize) -> usize {
    c.div_ceil(64) * 64
}

fn f32m(p: DPtr<f32>) -> Mat {
    Mat::new(p.raw, Dt::F32)
}

/// One micro-batch: forward, mean cross-entropy, backward. Gradients of `dloss × mean loss` go
/// to the hooks' buffers; per-position losses stay in `ws.losses` (read them with
/// [`mean_loss`]). `tokens`/`targets` are `b·t` host ids. GPT-2 here, the LLaMA family in
/// [`super::llama::forward_backward`], by the workspace's architecture.
// Long: the micro-batch in the order the device runs it (embedding, blocks, head, then the
// backward in reverse), each phase a few lines beside its hooks and timing marks.
pub fn forward_backward(
    gpu: &Gpu,
    hooks: &mut dyn UnitHooks,
    ws: &mut Workspace,
    tokens: &[u32],
    targets: &[u32],
    dloss: f32,
) -> Result<()> {
    match ws {
        Workspace::Gpt(ws) => gpt_forward_backward(gpu, hooks, ws, tokens, targets, dloss),
        Workspace::Llama(ws) => super::llama::forward_backward(gpu, hooks, ws, tokens, targets, dloss),
    }
}

/// GPT-2's [`forward_backward`].
fn gpt_forward_backward(
    gpu: &Gpu,
    hooks: &mut dyn UnitHooks,
    ws: &mut GptWorkspace,
    tokens: &[u32],
    targets: &[u32],
    dloss: f32,
) -> Result<()> {
    let s = ws.shape;
    let (n, c, v) = (s.n(), s.c, s.v);
    if tokens.len() != n || targets.len() != n {
        return Err(GpuError::Invalid(format!("micro-batch of {} tokens / {} targets, expected b·t = {n}", tokens.len(), targets.len())));
    }
    if let Some(&bad) = tokens.iter().chain(targets).find(|&&x| x as usize >= v) {
        return Err(GpuError::Invalid(format!("token id {bad} is outside the vocabulary of {v}")));
    }
    let st: &CudaStream = &gpu.stream;
    let r = BlockRun { gpu, st, s, fu: ws.fusions };
    gpu.write(&mut ws.tokens, 0, tokens)?;
    gpu.write(&mut ws.targets, 0, targets)?;

    // ---- forward ----
    let p0 = hooks.params(0, Phase::Forward)?;
    let layout = ws.layout.clone(); // an Arc: holding it does not borrow `ws`
    let lay = &*layout;
    let e = EmbedW::at(p0, lay);
    ops::embedding_forward(gpu, st, ws.xs[0].ptr(), ws.tokens.ptr(), e.wte, e.wpe, s.b, s.t, c)?;
    gpu.mark("embedding");
    for l in 0..s.l {
        let p = hooks.params(1 + l, Phase::Forward)?;
        let w = BlockW::at(p, lay);
        block_forward(&r, &w, ws.xs[l].ptr(), ws.xs[l + 1].ptr(), ws.acts(l), ws.fwd_scratch(), true)?;
        hooks.params_done(1 + l, Phase::Forward)?;
    }
    // ---- head ----
    let x_last = ws.xs[s.l].ptr();
    ops::layernorm_forward(gpu, st, ws.xf.ptr(), ws.mf.ptr(), ws.rf.ptr(), x_last, e.lnf_w, e.lnf_b, n, c)?;
    gpu.mark("head layernorm");
    gemm(gpu, bf(ws.logits.ptr()), bf(ws.xf.ptr()), bft(e.wte), n, c, v)?;
    gpu.mark("head gemm logits");
    ops::crossentropy(gpu, st, ws.losses.ptr(), ws.logits.ptr(), ws.targets.ptr(), n, v, v, dloss / n as f32)?;
    gpu.mark("head cross-entropy");
    // The embedding backward's token index, sorted on the host while the GPU runs the forward
    // (the copies are ordered on the stream after it, before the backward that reads them).
    let idx = ops::TokenIndex::new(tokens, v);
    gpu.write(&mut ws.uniq, 0, &idx.uniq)?;
    gpu.write(&mut ws.offsets, 0, &idx.offsets)?;
    gpu.write(&mut ws.positions, 0, &idx.positions)?;
    let uniq = ws.uniq.slice(0..idx.uniq.len());
    let offsets = ws.offsets.slice(0..idx.offsets.len());
    // ---- backward ----
    let g0 = hooks.grads(0)?;
    let ge = EmbedW::at(g0, lay);
    // d(xf) = dlogits · wte ; d(wte) = dlogitsᵀ · xf
    gemm(gpu, bf(ws.dln.ptr()), bf(ws.logits.ptr()), bf(e.wte), n, v, c)?;
    gpu.mark("head gemm dgrad");
    gemm(gpu, f32m(ge.wte), bft(ws.logits.ptr()), bf(ws.xf.ptr()), v, n, c)?;
    gpu.mark("head gemm wgrad");
    gpu.zero(ws.dx.ptr(), st)?;
    gpu.mark("zero");
    let head_ln = Scratch::of(ws).ln_backward((ge.lnf_w, ge.lnf_b), x_last, e.lnf_w, (ws.mf.ptr(), ws.rf.ptr()), n, c);
    ops::layernorm_backward(gpu, st, &head_ln)?;
    gpu.mark("head layernorm bwd");
    for l in (0..s.l).rev() {
        let p = hooks.params(1 + l, Phase::Backward)?;
        let w = BlockW::at(p, lay);
        let g = hooks.grads(1 + l)?;
        let gw = BlockW::at(g, lay);
        if ws.recompute {
            // The block's activations again, from its kept input (its output is not needed).
            block_forward(&r, &w, ws.xs[l].ptr(), ws.xs[l + 1].ptr(), ws.acts(l), ws.fwd_scratch(), false)?;
        }
        block_backward(&r, &w, &gw, ws.xs[l].ptr(), ws.acts(l), &mut Scratch::of(ws))?;
        hooks.params_done(1 + l, Phase::Backward)?;
        hooks.grads_done(1 + l)?;
    }
    ops::embedding_backward(gpu, st, ge.wte, ge.wpe, ws.dx.ptr(), uniq, offsets, ws.positions.ptr(), s.b, s.t, c)?;
    gpu.mark("embedding bwd");
    hooks.params_done(0, Phase::Backward)?;
    hooks.grads_done(0)?;
    Ok(())
}

/// Forward only: fills the workspace's losses (no gradients, no backward).
pub fn forward_loss(gpu: &Gpu, hooks: &mut dyn UnitHooks, ws: &mut Workspace, tokens: &[u32], targets: &[u32]) -> Result<()> {
    match ws {
        Workspace::Gpt(ws) => gpt_forward_loss(gpu, hooks, ws, tokens, targets),
        Workspace::Llama(ws) => super::llama::forward_loss(gpu, hooks, ws, tokens, targets),
    }
}

fn gpt_forward_loss(gpu: &Gpu, hooks: &mut dyn UnitHooks, ws: &mut GptWorkspace, tokens: &[u32], targets: &[u32]) -> Result<()> {
    let s = ws.shape;
    let (n, c, v) = (s.n(), s.c, s.v);
    if tokens.len() != n || targets.len() != n {
        return Err(GpuError::Invalid(format!("batch of {} tokens, expected {n}", tokens.len())));
    }
    let st: &CudaStream = &gpu.stream;
    let r = BlockRun { gpu, st, s, fu: ws.fusions };
    let layout = ws.layout.clone(); // an Arc: holding it does not borrow `ws`
    let lay = &*layout;
    gpu.write(&mut ws.tokens, 0, tokens)?;
    gpu.write(&mut ws.targets, 0, targets)?;
    let p0 = hooks.params(0, Phase::Forward)?;
    let e = EmbedW::at(p0, lay);
    ops::embedding_forward(gpu, st, ws.xs[0].ptr(), ws.tokens.ptr(), e.wte, e.wpe, s.b, s.t, c)?;
    for l in 0..s.l {
        let p = hooks.params(1 + l, Phase::Forward)?;
        block_forward(&r, &BlockW::at(p, lay), ws.xs[l].ptr(), ws.xs[l + 1].ptr(), ws.acts(l), ws.fwd_scratch(), true)?;
        hooks.params_done(1 + l, Phase::Forward)?;
    }
    ops::layernorm_forward(gpu, st, ws.xf.ptr(), ws.mf.ptr(), ws.rf.ptr(), ws.xs[s.l].ptr(), e.lnf_w, e.lnf_b, n, c)?;
    gemm(gpu, bf(ws.logits.ptr()), bf(ws.xf.ptr()), bft(e.wte), n, c, v)?;
    ops::crossentropy(gpu, st, ws.losses.ptr(), ws.logits.ptr(), ws.targets.ptr(), n, v, v, 0.0)?;
    hooks.params_done(0, Phase::Forward)?;
    Ok(())
}

/// Mean of the workspace's losses (waits for the compute stream).
pub fn mean_loss(gpu: &Gpu, ws: &Workspace) -> Result<f32> {
    mean_of(gpu, ws.losses())
}

/// Mean of per-position losses on the device (waits for the compute stream).
pub fn mean_of(gpu: &Gpu, losses: DPtr<f32>) -> Result<f32> {
    let l = gpu.download(losses)?;
    let sum: f64 = l.iter().map(|&x| x as f64).sum();
    Ok((sum / l.len() as f64) as f32)
}

/// `gpu.lt`, which a workspace with any fusion on has (its fusions were planned there).
fn lt(gpu: &Gpu) -> &super::lt::Lt {
    gpu.lt.as_ref().expect("a workspace uses cuBLASLt fusions only where cuBLASLt was loaded")
}

/// `c = a·b` (row-major `[m,k]·[k,n]`): through cuBLAS, or through cuBLASLt when its GEMMs are
/// tuned (`TESSERA_GPU_TUNE`), so the plain GEMMs are tuned too.
fn gemm(gpu: &Gpu, c: Mat, a: Mat, b: Mat, m: usize, k: usize, n: usize) -> Result<()> {
    let g = Gemm { c, a, b, m, k, n, residual: None, epilogue: Epilogue::None };
    match gpu.lt.as_ref() {
        // A shape or alignment cuBLASLt has no algorithm for stays on cuBLAS.
        Some(l) if l.routes_plain() && l.supports(&g) => l.run(&g),
        _ => gpu.blas.matmul(c, a, b, m, k, n),
    }
}

/// `c = a·b` (row-major `[m,k]·[k,n]`) with an epilogue and optional residual, through cuBLASLt.
// Allowed: the fields of `lt::Gemm` in order, so that each of the blocks' GEMMs stays one line.
#[allow(clippy::too_many_arguments)]
fn gemm_lt(gpu: &Gpu, c: Mat, a: Mat, b: Mat, m: usize, k: usize, n: usize, residual: Option<Mat>, epilogue: Epilogue) -> Result<()> {
    lt(gpu).run(&Gemm { c, a, b, m, k, n, residual, epilogue })
}

/// One block forward; `tmp` is a bf16 `[n, c]` scratch for the two projection outputs and
/// `b32` an f32 one for their biases (the `residual` fusion; two 256-byte aligned halves). With
/// `full` false (a recomputation for the backward) it stops after the GELU: `y` is not written.
///
/// ```text
/// ln1 = LN(x); qkv = ln1·Wqkv + bqkv; atty = attention(qkv)
/// x2 = x + atty·Wproj + bproj; ln2 = LN(x2)
/// pre = ln2·Wfc + bfc; gl = gelu(pre); y = x2 + gl·Wfc2 + bfc2
/// ```
/// Unfused, `pre` holds `ln2·Wfc` without its bias (the GELU kernels add it); with the `gelu`
/// fusion it holds the biased pre-activation, as cuBLASLt's GELU epilogue keeps it. With the
/// `residual` fusion the projection and fc2 GEMMs write `x2` and `y` themselves (f32, the
/// product, bias and residual summed before one rounding); without it they write bf16 products
/// to `tmp`, which the residual kernels add.
// Long: the math above, line by line, each step fused and unfused side by side (llm.c's layout).
fn block_forward(
    r: &BlockRun,
    w: &BlockW<bf16>,
    x: DPtr<f32>,
    y: DPtr<f32>,
    a: &LayerActs,
    (tmp, b32): (DPtr<bf16>, DPtr<f32>),
    full: bool,
) -> Result<()> {
    let BlockRun { gpu, st, s, fu } = *r;
    let (n, c, f) = (s.n(), s.c, s.f);
    let half = bias32_stride(c);
    let (proj_b32, fc2_b32) = (b32.slice(0..c), b32.slice(half..half + c));
    ops::layernorm_forward(gpu, st, a.ln1.ptr(), a.m1.ptr(), a.r1.ptr(), x, w.ln1_w, w.ln1_b, n, c)?;
    gpu.mark("fwd layernorm");
    if fu.bias {
        gemm_lt(gpu, bf(a.qkv.ptr()), bf(a.ln1.ptr()), bf(w.qkv_w), n, c, 3 * c, None, Epilogue::Bias { bias: w.qkv_b.raw })?;
        gpu.mark("fwd gemm qkv+bias");
    } else {
        gemm(gpu, bf(a.qkv.ptr()), bf(a.ln1.ptr()), bf(w.qkv_w), n, c, 3 * c)?;
        gpu.mark("fwd gemm qkv");
        ops::bias_add(gpu, st, a.qkv.ptr(), w.qkv_b, n, 3 * c)?;
        gpu.mark("fwd bias");
    }
    attention::attention_forward(gpu, st, a.atty.ptr(), a.lse.ptr(), a.qkv.ptr(), s.attn())?;
    gpu.mark("fwd attention");
    if fu.residual {
        // x2 = x + atty·Wproj + bproj in f32 from the GEMM, then ln2 = LN(x2).
        ops::cast_bf16_to_f32(gpu, st, proj_b32, w.proj_b)?;
        if full {
            ops::cast_bf16_to_f32(gpu, st, fc2_b32, w.fc2_b)?;
        }
        let e = Epilogue::BiasF32 { bias: proj_b32.raw };
        gemm_lt(gpu, f32m(a.x2.ptr()), bf(a.atty.ptr()), bf(w.proj_w), n, c, c, Some(f32m(x)), e)?;
        gpu.mark("fwd gemm proj+bias+residual");
        ops::layernorm_forward(gpu, st, a.ln2.ptr(), a.m2.ptr(), a.r2.ptr(), a.x2.ptr(), w.ln2_w, w.ln2_b, n, c)?;
        gpu.mark("fwd layernorm");
    } else {
        gemm(gpu, bf(tmp), bf(a.atty.ptr()), bf(w.proj_w), n, c, c)?;
        gpu.mark("fwd gemm proj");
        // x2 = x + (proj + bias) and ln2 = LN(x2) in one pass (the bits of the two kernels).
        let fused = ops::ResidualLn {
            xo: a.x2.ptr(),
            out: a.ln2.ptr(),
            mean: a.m2.ptr(),
            rstd: a.r2.ptr(),
            x,
            y: tmp,
            yb: w.proj_b,
            w: w.ln2_w,
            b: w.ln2_b,
            n,
            c,
        };
        ops::residual_layernorm_forward(gpu, st, &fused)?;
        gpu.mark("fwd residual+layernorm");
    }
    if fu.gelu {
        let e = Epilogue::GeluAuxBias { bias: w.fc_b.raw, pre: a.pre.ptr().raw };
        gemm_lt(gpu, bf(a.gl.ptr()), bf(a.ln2.ptr()), bf(w.fc_w), n, c, f, None, e)?;
        gpu.mark("fwd gemm fc+bias+gelu");
    } else {
        gemm(gpu, bf(a.pre.ptr()), bf(a.ln2.ptr()), bf(w.fc_w), n, c, f)?;
        gpu.mark("fwd gemm fc");
        ops::bias_gelu_forward_out(gpu, st, a.pre.ptr(), a.gl.ptr(), w.fc_b, n, f)?;
        gpu.mark("fwd bias+gelu");
    }
    if !full {
        return Ok(()); // a recomputation for the backward: y is not needed
    }
    if fu.residual {
        let e = Epilogue::BiasF32 { bias: fc2_b32.raw };
        gemm_lt(gpu, f32m(y), bf(a.gl.ptr()), bf(w.fc2_w), n, f, c, Some(f32m(a.x2.ptr())), e)?;
        gpu.mark("fwd gemm fc2+bias+residual");
    } else {
        gemm(gpu, bf(tmp), bf(a.gl.ptr()), bf(w.fc2_w), n, f, c)?;
        gpu.mark("fwd gemm fc2");
        ops::residual_bias_add(gpu, st, y, a.x2.ptr(), tmp, w.fc2_b, n, c)?;
        gpu.mark("fwd residual");
    }
    Ok(())
}

/// What every launch of a block's forward and backward shares: the GPU, its compute stream, the
/// micro-batch's shape and the workspace's fusions.
#[derive(Clone, Copy)]
struct BlockRun<'a> {
    gpu: &'a Gpu,
    st: &'a CudaStream,
    s: Shape,
    fu: Fusions,
}

struct Scratch {
    dx: DPtr<f32>,
    dres: DPtr<bf16>,
    dbig1: DPtr<bf16>,
    dbig2: DPtr<bf16>,
    dln: DPtr<bf16>,
    dqkv: DPtr<bf16>,
    datt: DPtr<bf16>,
    delta: DPtr<f32>,
    ln_scratch: DPtr<f32>,
    bias_scratch: DPtr<f32>,
    dres_sums: DPtr<f32>,
}

impl Scratch {
    /// A LayerNorm's backward through this scratch: `dx += ` its input gradient from `dln`, with
    /// the bf16 copy in `dres` and that copy's column sums (the next linear layer's bias
    /// gradient) in `dres_sums`; `(dw, db)` its parameter gradients, `x`/`w` its input and
    /// weight, `(mean, rstd)` the forward's row statistics.
    fn ln_backward(
        &self,
        (dw, db): (DPtr<f32>, DPtr<f32>),
        x: DPtr<f32>,
        w: DPtr<bf16>,
        (mean, rstd): (DPtr<f32>, DPtr<f32>),
        n: usize,
        c: usize,
    ) -> ops::LnBackward {
        ops::LnBackward {
            dx: self.dx,
            dx_bf16: Some(self.dres),
            dx_bf16_sums: Some(self.dres_sums),
            dw,
            db,
            dout: self.dln,
            x,
            w,
            mean,
            rstd,
            scratch: self.ln_scratch,
            n,
            c,
        }
    }

    fn of(ws: &GptWorkspace) -> Scratch {
        Scratch {
            dx: ws.dx.ptr(),
            dres: ws.dres.ptr(),
            dbig1: ws.dbig1.ptr(),
            dbig2: ws.dbig2.ptr(),
            dln: ws.dln.ptr(),
            dqkv: ws.dqkv.ptr(),
            datt: ws.datt.ptr(),
            delta: ws.delta.ptr(),
            ln_scratch: ws.ln_scratch.ptr(),
            bias_scratch: ws.bias_scratch.ptr(),
            dres_sums: ws.dres_sums.ptr(),
        }
    }
}

/// Backward of one block. `k.dx` holds d(block output) on entry and d(block input) on exit.
/// Each linear layer's weight gradient is `dW = inpᵀ·dY`, its bias gradient `Σ_rows dY` (fused
/// into the weight-gradient GEMM with `bgrad`), its input gradient `dY·Wᵀ`; fc's `dY` is
/// `d(gl) ∘ gelu'(pre)` (GELU' fused into fc2's input-gradient GEMM with `dgelu`).
fn block_backward(r: &BlockRun, w: &BlockW<bf16>, g: &BlockW<f32>, x: DPtr<f32>, a: &LayerActs, k: &mut Scratch) -> Result<()> {
    let BlockRun { gpu, st, s, fu } = *r;
    let (n, c, f) = (s.n(), s.c, s.f);
    let dbig1 = k.dbig1.slice(0..n * f);
    let dbig2 = k.dbig2.slice(0..n * f);
    // MLP branch (k.dres = bf16 copy of d(block output), written by the LayerNorm backward that produced k.dx).
    weight_grad(r, g.fc2_w, Some((g.fc2_b, Some(k.dres_sums))), a.gl.ptr(), k.dres, k.bias_scratch, (f, n, c))?;
    if fu.dgelu {
        // dbig2 = (dres·Wfc2ᵀ) ∘ gelu'(pre) in one GEMM.
        gemm_lt(gpu, bf(dbig2), bf(k.dres), bft(w.fc2_w), n, c, f, None, Epilogue::DGelu { pre: a.pre.ptr().raw })?;
        gpu.mark("bwd gemm dgrad+dgelu");
    } else {
        gemm(gpu, bf(dbig1), bf(k.dres), bft(w.fc2_w), n, c, f)?;
        gpu.mark("bwd gemm dgrad");
        if fu.gelu {
            ops::gelu_backward(gpu, st, dbig2, dbig1, a.pre.ptr(), n * f)?; // pre holds the bias
        } else {
            ops::gelu_backward_bias(gpu, st, dbig2, dbig1, a.pre.ptr(), w.fc_b, n, f)?;
        }
        gpu.mark("bwd gelu");
    }
    weight_grad(r, g.fc_w, Some((g.fc_b, None)), a.ln2.ptr(), dbig2, k.bias_scratch, (c, n, f))?;
    gemm(gpu, bf(k.dln), bf(dbig2), bft(w.fc_w), n, f, c)?;
    gpu.mark("bwd gemm dgrad");
    ops::layernorm_backward(gpu, st, &k.ln_backward((g.ln2_w, g.ln2_b), a.x2.ptr(), w.ln2_w, (a.m2.ptr(), a.r2.ptr()), n, c))?;
    gpu.mark("bwd layernorm");
    // Attention branch (k.dres = bf16 copy of d(x2) from the LN2 backward).
    weight_grad(r, g.proj_w, Some((g.proj_b, Some(k.dres_sums))), a.atty.ptr(), k.dres, k.bias_scratch, (c, n, c))?;
    gemm(gpu, bf(k.datt), bf(k.dres), bft(w.proj_w), n, c, c)?;
    gpu.mark("bwd gemm dgrad");
    let bufs = AttnBackward { dqkv: k.dqkv, delta: k.delta, dy: k.datt, qkv: a.qkv.ptr(), y: a.atty.ptr(), lse: a.lse.ptr() };
    attention::attention_backward(gpu, st, &bufs, s.attn())?;
    gpu.mark("bwd attention");
    weight_grad(r, g.qkv_w, Some((g.qkv_b, None)), a.ln1.ptr(), k.dqkv, k.bias_scratch, (c, n, 3 * c))?;
    gemm(gpu, bf(k.dln), bf(k.dqkv), bft(w.qkv_w), n, 3 * c, c)?;
    gpu.mark("bwd gemm dgrad");
    ops::layernorm_backward(gpu, st, &k.ln_backward((g.ln1_w, g.ln1_b), x, w.ln1_w, (a.m1.ptr(), a.r1.ptr()), n, c))?;
    gpu.mark("bwd layernorm");
    Ok(())
}

/// `dw[rows, cols] = inpᵀ·dy` (`inp` `[n, rows]`, `dy` `[n, cols]`) and, given `db`, the bias
/// gradient `db = Σ_rows dy`: summed by the GEMM itself with the `bgrad` fusion, else from the
/// first pass of the column sums where the LayerNorm backward that wrote `dy` left it (`Some`
/// partials), else by the bias-gradient kernel (through `scratch`).
fn weight_grad(
    r: &BlockRun,
    dw: DPtr<f32>,
    db: Option<(DPtr<f32>, Option<DPtr<f32>>)>,
    inp: DPtr<bf16>,
    dy: DPtr<bf16>,
    scratch: DPtr<f32>,
    (rows, n, cols): (usize, usize, usize),
) -> Result<()> {
    let (gpu, st, fused) = (r.gpu, r.st, r.fu.bgrad);
    match db {
        Some((db, _)) if fused => {
            assert_eq!(db.len, cols, "bias gradient length");
            gemm_lt(gpu, f32m(dw), bft(inp), bf(dy), rows, n, cols, None, Epilogue::BgradB { dbias: db.raw })?;
            gpu.mark("bwd gemm wgrad+bias grad");
        }
        _ => {
            gemm(gpu, f32m(dw), bft(inp), bf(dy), rows, n, cols)?;
            gpu.mark("bwd gemm wgrad");
            match db {
                Some((db, Some(partials))) => ops::colsum_finish(gpu, st, db, partials, n, cols)?,
                Some((db, None)) => ops::bias_grad(gpu, st, db, dy, scratch, n, cols)?,
                None => return Ok(()),
            }
            gpu.mark("bwd bias grad");
        }
    }
    Ok(())
}

/// Hooks over one full (replicated) parameter buffer and one full gradient buffer, both in the
/// padded layout: single GPU, data parallelism, ZeRO-1/2 parameters.
pub struct Replicated<'a> {
    pub layout: &'a GpuLayout,
    pub params: DPtr<bf16>,
    pub grads: DPtr<f32>,
}

impl UnitHooks for Replicated<'_> {
    fn params(&mut self, u: usize, _: Phase) -> Result<DPtr<bf16>> {
        Ok(self.params.slice(self.layout.units[u].clone()))
    }
    fn params_done(&mut self, _: usize, _: Phase) -> Result<()> {
        Ok(())
    }
    fn grads(&mut self, u: usize) -> Result<DPtr<f32>> {
        Ok(self.grads.slice(self.layout.units[u].clone()))
    }
    fn grads_done(&mut self, _: usize) -> Result<()> {
        Ok(())
    }
}

/// The whole GPU model against the CPU model (f32) on a small GPT with random parameters
/// (biases and gains perturbed too) rounded to bf16: loss and every tensor's gradient. Both
/// sides see the same bf16 parameters; the GPU keeps activations in bf16, so gradients agree to
/// bf16 accuracy relative to each tensor's scale.
pub fn check(gpu: &Gpu, seed: u64) -> Result<Vec<CheckRow>> {
    use crate::model::{FlatAccess, MicroBatch};
    let (b, t) = (2, 96);
    let CheckCase { cfg, model, params, tokens, targets } = CheckCase::new(seed, b, t)?;
    // CPU reference.
    let mut grads = vec![0f32; params.len()];
    let mut cws = crate::model::Workspace::default();
    let cpu_loss = {
        let mut acc = FlatAccess { params: &params, grads: &mut grads, units: model.units() };
        model.forward_backward(&mut acc, MicroBatch { tokens: &tokens, targets: &targets, b, t, noise_key: 0 }, 1.0, &mut cws)
    };
    // GPU: unfused, with the default fusions and with all of them (each set cuBLASLt runs here, once).
    let layout = GpuLayout::new(&model, 1)?;
    let shape = Shape::new(&cfg, b, t)?;
    let pbf: Vec<bf16> = layout.pad(&params).iter().map(|&x| bf16::from_f32(x)).collect();
    let dparams = gpu.upload(&pbf)?;
    let dgrads = gpu.alloc::<f32>(layout.total)?;
    let mut rows = Vec::new();
    let mut seen = Vec::new();
    let run = |ws: &mut GptWorkspace| -> Result<(f32, Vec<f32>)> {
        gpu.zero(dgrads.ptr(), &gpu.stream)?;
        let mut hooks = Replicated { layout: &layout, params: dparams.ptr(), grads: dgrads.ptr() };
        gpt_forward_backward(gpu, &mut hooks, ws, &tokens, &targets, 1.0)?;
        Ok((mean_of(gpu, ws.losses.ptr())?, layout.unpad(&gpu.download(dgrads.ptr())?)))
    };
    for want in [Fusions::default(), Fusions::DEFAULT, Fusions::ALL] {
        let mut ws = GptWorkspace::with_fusions(gpu, shape, &layout, want)?;
        if seen.contains(&ws.fusions) {
            continue;
        }
        seen.push(ws.fusions);
        let tag = format!("[fused: {}]", ws.fusions.describe());
        let (gpu_loss, g) = run(&mut ws)?;
        rows.push(CheckRow::compare(format!("model loss {tag}"), &[gpu_loss], &[cpu_loss], 0.0, 1e-2));
        rows.extend(grad_rows(&model, &grads, &g, &tag));
    }
    // Activation checkpointing recomputes the same kernels on the same inputs: the same loss and
    // gradients, bit for bit.
    let mut ws = GptWorkspace::with_fusions(gpu, shape, &layout, Fusions::DEFAULT)?;
    let (loss, g) = run(&mut ws)?;
    let mut rws = GptWorkspace::with_options(gpu, shape, &layout, Fusions::DEFAULT, true)?;
    let (rloss, rg) = run(&mut rws)?;
    let tag = format!("[fused: {}]", ws.fusions.describe());
    rows.push(CheckRow::compare(format!("model loss, activations recomputed = kept (bits) {tag}"), &[rloss], &[loss], 0.0, 0.0));
    rows.push(CheckRow::compare(format!("model grads, activations recomputed = kept (bits) {tag}"), &rg, &g, 1.0, 0.0));
    // GEMM tuning only ever picks algorithms that gave the first one's bits: every GEMM through
    // cuBLASLt, untuned then tuned, the same loss and gradients.
    if let Some(lt) = gpu.lt.as_ref() {
        let (route, tune) = super::lt::tune_requested()?;
        lt.set_tuning(true, false);
        let plain = run(&mut GptWorkspace::with_fusions(gpu, shape, &layout, Fusions::DEFAULT)?);
        lt.set_tuning(true, true);
        let before = lt.tune_report().len();
        let tuned = run(&mut GptWorkspace::with_fusions(gpu, shape, &layout, Fusions::DEFAULT)?);
        let picked = lt.tune_report()[before..].iter().filter(|l| !l.ends_with("-> #0") && !l.contains("not tuned")).count();
        lt.set_tuning(route, tune);
        let ((ploss, pg), (tloss, tg)) = (plain?, tuned?);
        let tag = format!("[fused: {}; {picked} GEMMs took another algorithm]", ws.fusions.describe());
        rows.push(CheckRow::compare(format!("model loss, GEMMs tuned = untuned (bits) {tag}"), &[tloss], &[ploss], 0.0, 0.0));
        rows.push(CheckRow::compare(format!("model grads, GEMMs tuned = untuned (bits) {tag}"), &tg, &pg, 1.0, 0.0));
    }
    Ok(rows)
}

/// The model, parameters and batch [`check`] compares on: a 2-layer GPT with 64-wide heads,
/// parameters perturbed from the initialisation and rounded to bf16, random tokens.
struct CheckCase {
    cfg: ModelConfig,
    model: Model,
    params: Vec<f32>,
    tokens: Vec<u32>,
    targets: Vec<u32>,
}

impl CheckCase {
    fn new(seed: u64, b: usize, t: usize) -> Result<CheckCase> {
        use crate::tensor::Rng;
        let cfg = ModelConfig {
            arch: Arch::Gpt,
            vocab_size: 384,
            max_seq_len: 128,
            n_layer: 2,
            n_head: 2,
            d_model: 128,
            d_ff: 512,
            rope_theta: 10000.0,
            norm_eps: 1e-5,
            n_kv_head: 2,
            tied_head: true,
            qkv_bias: false,
            rope_scaling: None,
            moe: None,
        };
        let model = Model::new(cfg.clone()).map_err(GpuError::Invalid)?;
        let mut params = model.init_params(seed);
        let mut noise = vec![0f32; params.len()];
        Rng::derive(seed, &[0x9e0]).fill_normal(&mut noise, 0.02);
        for (p, n) in params.iter_mut().zip(&noise) {
            *p = bf16::from_f32(*p + n).to_f32();
        }
        let mut rng = Rng::derive(seed, &[0x70c]);
        let seq: Vec<u32> = (0..b * (t + 1)).map(|_| (rng.next_u64() % cfg.vocab_size as u64) as u32).collect();
        let (mut tokens, mut targets) = (Vec::new(), Vec::new());
        for r in 0..b {
            tokens.extend_from_slice(&seq[r * (t + 1)..r * (t + 1) + t]);
            targets.extend_from_slice(&seq[r * (t + 1) + 1..(r + 1) * (t + 1)]);
        }
        Ok(CheckCase { cfg, model, params, tokens, targets })
    }
}

/// Per tensor, what bf16 activations promise: the norm-wise error rms(gpu − cpu)/rms(cpu)
/// ≤ 2e-2 (measured ~5e-3), and no element off by more than 1.5e-1 of |cpu| + rms(cpu) (an
/// indexing bug gives O(1)).
fn grad_rows(model: &Model, grads: &[f32], g: &[f32], tag: &str) -> Vec<CheckRow> {
    let mut rows = Vec::new();
    let rms = |x: &mut dyn Iterator<Item = f64>| {
        let (s, n) = x.fold((0f64, 0usize), |(s, n), v| (s + v * v, n + 1));
        (s / n.max(1) as f64).sqrt()
    };
    for spec in model.layout().specs() {
        let r = spec.range();
        let (cpu, gg) = (&grads[r.clone()], &g[r]);
        let rc = rms(&mut cpu.iter().map(|&x| x as f64)).max(1e-12);
        let mut row = CheckRow::compare(format!("model grad {} rms-rel {tag}", spec.name), gg, cpu, rc, 2e-2);
        row.max_rel = rms(&mut gg.iter().zip(cpu).map(|(&a, &b)| a as f64 - b as f64)) / rc;
        rows.push(row);
        rows.push(CheckRow::compare(format!("model grad {} max-rel, floor rms {tag}", spec.name), gg, cpu, rc, 1.5e-1));
    }
    rows
}
