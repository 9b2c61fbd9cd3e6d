//! The decoder's parameters on the device: the CPU [`Model`]'s tensors (found by name in its
//! layout) in bf16, one buffer each, laid out for inference: LLaMA's gate and up projections
//! fused into one `[c, 2f]` weight whose row `i` is the gate's row `i` then the up's, so one GEMM
//! gives both halves of every token's row. The blocks' linear layers may instead be int8 or fp8
//! with per-output-channel scales ([`super::quant`]).

use super::quant::{self, WeightFormat};
use crate::cuda::{bf16, Buf, DPtr, Gpu, GpuError, Result};
use crate::model::{Arch, Model};

/// A linear layer's weight on the device.
pub enum Linear {
    /// `[n, k]` bf16 (output-major, as the GEMV reads it; cuBLAS takes it transposed).
    Bf16(Buf<bf16>),
    /// `q [n, k]` int8 or e4m3 bytes, `s [n]` f32 (see [`super::quant`]).
    Quant { q: Buf<u8>, s: Buf<f32>, fmt: WeightFormat, k: usize, n: usize },
}

impl Linear {
    fn upload(gpu: &Gpu, w: &[f32], (k, n): (usize, usize), fmt: WeightFormat) -> Result<Linear> {
        assert_eq!(w.len(), k * n, "linear weight must be [k={k}, n={n}]");
        match fmt {
            WeightFormat::Bf16 => {
                let mut t = vec![bf16::ZERO; k * n];
                for (i, row) in w.chunks_exact(n).enumerate() {
                    for (j, &v) in row.iter().enumerate() {
                        t[j * k + i] = bf16::from_f32(v);
                    }
                }
                Ok(Linear::Bf16(gpu.upload(&t)?))
            }
            _ => {
                let t = quant::quantize(w, k, n, fmt);
                Ok(Linear::Quant { q: gpu.upload(&t.q)?, s: gpu.upload(&t.s)?, fmt, k, n })
            }
        }
    }

    /// The GEMV's view of the weight.
    pub fn gemv(&self) -> super::launch::GemvW {
        match self {
            Linear::Bf16(b) => super::launch::GemvW { w: b.ptr().raw, s: None, fmt: WeightFormat::Bf16 },
            Linear::Quant { q, s, fmt, .. } => super::launch::GemvW { w: q.ptr().raw, s: Some(s.ptr()), fmt: *fmt },
        }
    }

    pub fn bytes(&self) -> usize {
        match self {
            Linear::Bf16(b) => 2 * b.len(),
            Linear::Quant { q, s, .. } => q.len() + 4 * s.len(),
        }
    }

    /// Elements of the bf16 copy a many-row product widens it into (0 for bf16 weights).
    pub fn widened_len(&self) -> usize {
        match self {
            Linear::Bf16(_) => 0,
            Linear::Quant { k, n, .. } => k * n,
        }
    }
}

/// One block's tensors (weights `[in, out]` as the CPU model stores them). GPT-2 has every bias
/// and both norms' biases; the LLaMA family has none of them but Qwen2's q/k/v bias.
pub struct LayerW {
    pub ln1_w: Buf<bf16>,
    pub ln1_b: Option<Buf<bf16>>,
    pub qkv_w: Linear,
    pub qkv_b: Option<Buf<bf16>>,
    pub o_w: Linear,
    pub o_b: Option<Buf<bf16>>,
    pub ln2_w: Buf<bf16>,
    pub ln2_b: Option<Buf<bf16>>,
    /// GPT-2: `c_fc` `[c, f]`; LLaMA: gate | up `[c, 2f]`.
    pub up_w: Linear,
    pub up_b: Option<Buf<bf16>>,
    pub down_w: Linear,
    pub down_b: Option<Buf<bf16>>,
}

/// The whole model's tensors.
pub struct Weights {
    pub wte: Buf<bf16>,
    pub wpe: Option<Buf<bf16>>,
    pub lnf_w: Buf<bf16>,
    pub lnf_b: Option<Buf<bf16>>,
    /// An untied LM head `[V, c]`; `None` when the head is `wte`.
    pub head: Option<Buf<bf16>>,
    pub layers: Vec<LayerW>,
}

impl Weights {
    /// The head's `[V, c]` weight.
    pub fn head(&self) -> DPtr<bf16> {
        self.head.as_ref().unwrap_or(&self.wte).ptr()
    }

    /// Bytes on the device.
    pub fn bytes(&self) -> usize {
        let opt = |b: &Option<Buf<bf16>>| b.as_ref().map_or(0, |b| b.len() * 2);
        let mut n = self.wte.len() * 2 + opt(&self.wpe) + self.lnf_w.len() * 2 + opt(&self.lnf_b) + opt(&self.head);
        for l in &self.layers {
            n += 2 * (l.ln1_w.len() + l.ln2_w.len()) + l.qkv_w.bytes() + l.o_w.bytes() + l.up_w.bytes() + l.down_w.bytes();
            n += opt(&l.ln1_b) + opt(&l.qkv_b) + opt(&l.o_b) + opt(&l.ln2_b) + opt(&l.up_b) + opt(&l.down_b);
        }
        n
    }

    /// The largest bf16 widening of a quantized linear layer (0 for bf16 weights).
    pub fn widened_max(&self) -> usize {
        let l = self.layers.iter().flat_map(|l| [&l.qkv_w, &l.o_w, &l.up_w, &l.down_w]);
        l.map(Linear::widened_len).max().unwrap_or(0)
    }

    /// Uploads `params` (the model's flat f32 buffer) rounded to bf16, the blocks' linear
    /// layers in `fmt`.
    pub fn upload(gpu: &Gpu, model: &Model, params: &[f32], fmt: WeightFormat) -> Result<Weights> {
        if model.cfg.moe.is_some() {
            return Err(GpuError::Invalid(
                "GPU decoding runs dense models only; this model has mixture-of-experts blocks (decode it on the CPU)".into(),
            ));
        }
        if params.len() != model.num_params() {
            return Err(GpuError::Invalid(format!(
                "GPU decoding: {} parameters given, the model has {}",
                params.len(),
                model.num_params()
            )));
        }
        let t = Tensors { gpu, model, params, fmt };
        let llama = model.cfg.arch == Arch::Llama;
        let mut layers = Vec::with_capacity(model.cfg.n_layer);
        for l in 0..model.cfg.n_layer {
            layers.push(if llama { t.llama_layer(l)? } else { t.gpt_layer(l)? });
        }
        let (lnf_w, lnf_b) = if llama { (t.get("norm_f.weight")?, None) } else { (t.get("ln_f.weight")?, Some(t.get("ln_f.bias")?)) };
        Ok(Weights {
            wte: t.get("wte.weight")?,
            wpe: if llama { None } else { Some(t.get("wpe.weight")?) },
            lnf_w,
            lnf_b,
            head: t.maybe("lm_head.weight")?,
            layers,
        })
    }
}

/// Finds a model's tensors by name and uploads them.
struct Tensors<'a> {
    gpu: &'a Gpu,
    model: &'a Model,
    params: &'a [f32],
    fmt: WeightFormat,
}

impl Tensors<'_> {
    fn host(&self, name: &str) -> Option<&[f32]> {
        let s = self.model.layout().specs().iter().find(|s| s.name == name)?;
        Some(&self.params[s.offset..s.offset + s.numel()])
    }

    fn maybe(&self, name: &str) -> Result<Option<Buf<bf16>>> {
        match self.host(name) {
            Some(h) => Ok(Some(self.gpu.upload(&to_bf16(h))?)),
            None => Ok(None),
        }
    }

    fn get(&self, name: &str) -> Result<Buf<bf16>> {
        self.maybe(name)?.ok_or_else(|| GpuError::Invalid(format!("GPU decoding: the model has no tensor `{name}`")))
    }

    fn host_of(&self, name: &str) -> Result<&[f32]> {
        self.host(name).ok_or_else(|| GpuError::Invalid(format!("GPU decoding: the model has no tensor `{name}`")))
    }

    /// The linear layer `name` of shape `[k, n]` in the decoder's format.
    fn linear(&self, name: &str, kn: (usize, usize)) -> Result<Linear> {
        Linear::upload(self.gpu, self.host_of(name)?, kn, self.fmt)
    }

    fn gpt_layer(&self, l: usize) -> Result<LayerW> {
        let g = |s: &str| self.get(&format!("h.{l}.{s}"));
        let o = |s: &str| self.get(&format!("h.{l}.{s}")).map(Some);
        let lin = |s: &str, kn| self.linear(&format!("h.{l}.{s}"), kn);
        let (c, f) = (self.model.cfg.d_model, self.model.cfg.d_ff);
        Ok(LayerW {
            ln1_w: g("ln_1.weight")?,
            ln1_b: o("ln_1.bias")?,
            qkv_w: lin("attn.c_attn.weight", (c, 3 * c))?,
            qkv_b: o("attn.c_attn.bias")?,
            o_w: lin("attn.c_proj.weight", (c, c))?,
            o_b: o("attn.c_proj.bias")?,
            ln2_w: g("ln_2.weight")?,
            ln2_b: o("ln_2.bias")?,
            up_w: lin("mlp.c_fc.weight", (c, f))?,
            up_b: o("mlp.c_fc.bias")?,
            down_w: lin("mlp.c_proj.weight", (f, c))?,
            down_b: o("mlp.c_proj.bias")?,
        })
    }

    fn llama_layer(&self, l: usize) -> Result<LayerW> {
        let name = |s: &str| format!("h.{l}.{s}");
        let g = |s: &str| self.get(&name(s));
        let cfg = &self.model.cfg;
        let (c, f, row) = (cfg.d_model, cfg.d_ff, cfg.d_model + 2 * cfg.n_kv_head * cfg.head_dim());
        let (gate, up) = (self.host_of(&name("mlp.w_gate.weight"))?, self.host_of(&name("mlp.w_up.weight"))?);
        let mut gu = Vec::with_capacity(2 * c * f);
        for i in 0..c {
            gu.extend_from_slice(&gate[i * f..(i + 1) * f]);
            gu.extend_from_slice(&up[i * f..(i + 1) * f]);
        }
        Ok(LayerW {
            ln1_w: g("attn_norm.weight")?,
            ln1_b: None,
            qkv_w: self.linear(&name("attn.wqkv.weight"), (c, row))?,
            qkv_b: self.maybe(&name("attn.wqkv.bias"))?,
            o_w: self.linear(&name("attn.wo.weight"), (c, c))?,
            o_b: None,
            ln2_w: g("mlp_norm.weight")?,
            ln2_b: None,
            up_w: Linear::upload(self.gpu, &gu, (c, 2 * f), self.fmt)?,
            up_b: None,
            down_w: self.linear(&name("mlp.w_down.weight"), (f, c))?,
            down_b: None,
        })
    }
}

fn to_bf16(x: &[f32]) -> Vec<bf16> {
    x.iter().map(|&v| bf16::from_f32(v)).collect()
}

/// `params` with every linear layer the decoder quantizes replaced by the weight its kernels
/// compute with (`fmt` quantized, then widened back), and every other tensor rounded to bf16: the
/// CPU model on these parameters is the reference of a decoder in `fmt`.
pub fn reference_params(model: &Model, params: &[f32], fmt: WeightFormat) -> Vec<f32> {
    let mut out: Vec<f32> = params.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
    if fmt == WeightFormat::Bf16 {
        return out;
    }
    let linear = ["attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight", "attn.wqkv.weight", "attn.wo.weight"];
    let llama_mlp = ["mlp.w_gate.weight", "mlp.w_up.weight", "mlp.w_down.weight"];
    for s in model.layout().specs() {
        let quantized = s.name.starts_with("h.") && linear.iter().chain(&llama_mlp).any(|l| s.name.ends_with(l));
        if !quantized {
            continue;
        }
        let (k, n) = (s.shape[0], s.shape[1]);
        let t = quant::quantize(&params[s.offset..s.offset + s.numel()], k, n, fmt);
        out[s.offset..s.offset + s.numel()].copy_from_slice(&quant::dequantize(&t, fmt));
    }
    out
}
