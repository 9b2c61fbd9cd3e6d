//! The transformer stack (GPT-2 and LLaMA styles) over one flat parameter buffer: the
//! parameter layout, the blocks as [`Layer`]s, the tied LM head with fused cross-entropy, and
//! activation recomputation.
//!
//! The flat buffer is cut into *units*: unit 0 holds the embeddings, the final norm and the LM
//! head (`wte` itself when tied, else `lm_head.weight` after the norm), unit `1 + l` holds
//! block `l`. A unit is the
//! grain at which ZeRO-3 gathers parameters; [`UnitAccess`] is how the caller hands them in.

use std::ops::Range;

pub mod paged;
mod stage;
pub use stage::{StageSpan, WStash};

use crate::experts::{ExpertMlp, ExpertRunner};
use crate::gemm::matmul;
use crate::layer::{Acts, Dims, Init, Layer, ParamLayout, ParamSpec};
use crate::moe_ffn::MoeFfn;
use crate::ops::gqa::{self, Groups};
use crate::ops::moe::MoePass;
pub use crate::ops::moe::{MoeBlockStats, MoeStats};
use crate::ops::rope::{RopeScaling, RopeTable};
use crate::ops::{attention, crossentropy, embedding, gelu, layernorm, linear, residual, rmsnorm, rope, swiglu};
use crate::wgrad::WeightGrads;

/// Which block design the model uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// GPT-2: learned positions, LayerNorm, GELU(tanh) MLP, biases.
    Gpt,
    /// LLaMA: RoPE, RMSNorm, SwiGLU MLP, no biases.
    Llama,
}

/// Shape of a model.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub max_seq_len: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub d_model: usize,
    /// Hidden width of the MLP (4·d for GPT, ~8/3·d for LLaMA).
    pub d_ff: usize,
    pub rope_theta: f32,
    pub norm_eps: f32,
    /// Key/value heads: `n_head` for multi-head attention, fewer for grouped-query attention
    /// (LLaMA only), each shared by `n_head / n_kv_head` query heads.
    pub n_kv_head: usize,
    /// The LM head is the token embedding `wte` (tied), or its own `lm_head.weight`.
    pub tied_head: bool,
    /// Biases on the q, k and v projections (Qwen2; LLaMA only: GPT-2 blocks always have them).
    pub qkv_bias: bool,
    /// RoPE frequency scaling (LLaMA 3; LLaMA only).
    pub rope_scaling: Option<RopeScaling>,
    /// Mixture-of-experts feed-forwards in some blocks (Mixtral, Qwen2-MoE, the GPT MoE
    /// presets); `None` for dense models.
    pub moe: Option<MoeConfig>,
}

/// A mixture-of-experts feed-forward (`ops::moe`): which blocks have one, their experts, and
/// how tokens are routed. An MoE block replaces its dense MLP by a router and `num_experts`
/// expert MLPs of the block's own kind (SwiGLU without biases in LLaMA-family blocks, GELU
/// with biases in GPT blocks).
///
/// Layout contract (what expert parallelism and the Hugging Face names rely on): in an MoE
/// block the router `h.{l}.moe.router.weight` `[c, num_experts]` comes after the attention
/// parameters and the second norm, then the experts in index order, each expert's parameters
/// one contiguous range (`h.{l}.moe.experts.{e}.w_gate.weight` `[c, f]`, `.w_up.weight`
/// `[c, f]`, `.w_down.weight` `[f, c]`; GPT: `.c_fc.weight`, `.c_fc.bias`, `.c_proj.weight`,
/// `.c_proj.bias`), then what every token also runs: the shared expert `h.{l}.moe.shared.…`
/// (the experts' names) and its gate `h.{l}.moe.shared_gate.weight` `[c, 1]`, then the residual
/// MLP `h.{l}.moe.residual.…` and its mixer `h.{l}.moe.coefficient.weight` `[c, 2]`,
/// `h.{l}.moe.coefficient.bias` `[2]`. So the experts `[a, b)` of a block are one contiguous
/// range of its unit.
///
/// Routing is a pure function of the block's input rows (and, for the noisy policies, of the
/// micro-batch's noise key), computed in f32 in a fixed order: the same tokens route the same
/// way whatever the world size, ZeRO stage or expert placement.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    /// Experts per MoE block.
    pub num_experts: usize,
    /// Experts each token is sent to (top-k).
    pub top_k: usize,
    /// Hidden width of one expert MLP (Mixtral `intermediate_size`, Qwen2-MoE
    /// `moe_intermediate_size`).
    pub d_expert: usize,
    /// Block `l` is MoE when `(l + 1) % sparse_step == 0` and `l` is not in `dense_layers`
    /// (Qwen2-MoE's `decoder_sparse_step` / `mlp_only_layers`; Mixtral: 1 and none; the GPT
    /// MoE presets: every other block, 2).
    pub sparse_step: usize,
    pub dense_layers: Vec<usize>,
    /// When the gate probabilities are taken (`Softmax` over all experts then top-k, or top-k
    /// of the logits then a softmax over those).
    pub gating: Gating,
    /// The top-k weights renormalised to sum to one (Mixtral always; Qwen2-MoE
    /// `norm_topk_prob`; DeepSpeed's top-2).
    pub norm_topk: bool,
    /// Expert capacity (tokens an expert takes per micro-batch, DeepSpeed's `capacity_factor`,
    /// `eval_capacity_factor`, `min_capacity`, `drop_tokens`); `None` is dropless (Mixtral,
    /// Qwen2-MoE).
    pub capacity: Option<Capacity>,
    /// DeepSpeed's `noisy_gate_policy`.
    pub noisy_gate: NoisyGate,
    /// DeepSpeed's `use_rts`: capacity slots go to tokens in a seeded random order, not in
    /// token order (only with `capacity`).
    pub random_token_selection: bool,
    /// Weight of the load-balancing loss in the objective (HF `router_aux_loss_coef` when
    /// `output_router_logits`, DeepSpeed's `l_aux`), and of the router z-loss (ST-MoE).
    pub aux_loss_coef: f32,
    pub z_loss_coef: f32,
    /// How the load-balancing loss is formed.
    pub aux_loss: AuxLoss,
    /// The Qwen2-MoE shared expert: a dense MLP of this width that every token runs, scaled by
    /// `sigmoid(x · shared_gate)`.
    pub shared_expert: Option<usize>,
    /// DeepSpeed's `use_residual` (PR-MoE): a dense MLP beside the experts (their kind, width
    /// `d_expert`), the two mixed per token by a learned two-way softmax of the input:
    /// `softmax(h·W + b)₀·experts(h) + softmax(h·W + b)₁·mlp(h)`.
    pub residual: bool,
}

impl MoeConfig {
    /// Mixtral's experts: `num_experts` SwiGLU experts of width `d_expert` in every block, the
    /// softmax over all of them then the top `top_k` renormalised, dropless, no noise,
    /// transformers' load-balancing loss weighted by `aux_loss_coef`. The base of the other
    /// dropless families (`MoeConfig { …, ..MoeConfig::mixtral(…) }`).
    pub fn mixtral(num_experts: usize, top_k: usize, d_expert: usize, aux_loss_coef: f32) -> MoeConfig {
        MoeConfig {
            num_experts,
            top_k,
            d_expert,
            sparse_step: 1,
            dense_layers: Vec::new(),
            gating: Gating::SoftmaxThenTopK,
            norm_topk: true,
            capacity: None,
            noisy_gate: NoisyGate::None,
            random_token_selection: false,
            aux_loss_coef,
            z_loss_coef: 0.0,
            aux_loss: AuxLoss::AcrossLayers,
            shared_expert: None,
            residual: false,
        }
    }

    /// Checks the experts are buildable and asks for nothing Tessera does not do yet; the error
    /// names what.
    pub fn validate(&self, arch: Arch) -> Result<(), String> {
        // Both block kinds have experts (SwiGLU in the LLaMA family, GELU with biases in GPT).
        let _ = arch;
        let m = self;
        if m.num_experts == 0 || m.d_expert == 0 || m.sparse_step == 0 {
            return Err(format!(
                "mixture of experts: num_experts {}, d_expert {} and sparse_step {} must be positive",
                m.num_experts, m.d_expert, m.sparse_step
            ));
        }
        if m.top_k == 0 || m.top_k > m.num_experts {
            return Err(format!("mixture of experts: top_k {} must be 1..={} (the number of experts)", m.top_k, m.num_experts));
        }
        if m.shared_expert == Some(0) {
            return Err("mixture of experts: the shared expert's width must be positive".into());
        }
        if let Some(c) = &m.capacity {
            let ok = |f: f32| f.is_finite() && f > 0.0;
            if !ok(c.train_factor) || !ok(c.eval_factor) {
                return Err(format!(
                    "mixture of experts: the capacity factors must be positive and finite, got capacity_factor {} and \
                     eval_capacity_factor {}",
                    c.train_factor, c.eval_factor
                ));
            }
        }
        if m.random_token_selection && !m.capacity.as_ref().is_some_and(|c| c.drop_tokens) {
            return Err("mixture of experts: random token selection (use_rts) orders the capacity slots, so it needs an expert \
                        capacity with drop_tokens"
                .into());
        }
        for (name, v) in [("aux_loss_coef", m.aux_loss_coef), ("z_loss_coef", m.z_loss_coef)] {
            if !v.is_finite() || v < 0.0 {
                return Err(format!("mixture of experts: {name} must be finite and non-negative, got {v}"));
            }
        }
        Ok(())
    }

    /// Whether a training pass draws noise (a noisy gate, or random token selection).
    pub fn is_noisy(&self) -> bool {
        self.noisy_gate != NoisyGate::None || self.random_token_selection
    }
}

/// When a router's probabilities are taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    /// Softmax over every expert, then the top k (Mixtral, Qwen2-MoE, DeepSpeed).
    SoftmaxThenTopK,
    /// The top k logits, then a softmax over them.
    TopKThenSoftmax,
}

/// Expert capacity: `max(min_capacity, ceil(factor · top_k · tokens / num_experts))` slots per
/// expert and micro-batch, the factor of training or of evaluation; `drop_tokens = false`
/// keeps every token (the capacity then only shapes the reported load).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Capacity {
    pub train_factor: f32,
    pub eval_factor: f32,
    pub min_capacity: usize,
    pub drop_tokens: bool,
}

/// DeepSpeed's `noisy_gate_policy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoisyGate {
    None,
    /// The router input multiplied by seeded uniform noise in `[1 − 1e-2, 1 + 1e-2]` (training).
    Jitter,
    /// Seeded Gumbel noise added to the logits when choosing experts (training).
    RSample,
}

/// How the load-balancing loss is formed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuxLoss {
    /// transformers' `load_balancing_loss_func`: one loss over the routing of every MoE block's
    /// tokens together (Mixtral, Qwen2-MoE).
    AcrossLayers,
    /// GShard/Switch, per block and summed (DeepSpeed).
    PerLayer,
}

impl ModelConfig {
    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_head
    }

    /// Checks the shape is buildable; the error says which dimension is wrong.
    pub fn validate(&self) -> Result<(), String> {
        let c = self;
        if c.vocab_size == 0 || c.max_seq_len == 0 || c.n_layer == 0 || c.n_head == 0 || c.d_ff == 0 {
            return Err(format!("model dimensions must be positive: {c:?}"));
        }
        if c.d_model % c.n_head != 0 {
            return Err(format!("d_model {} is not divisible by n_head {}", c.d_model, c.n_head));
        }
        if c.arch == Arch::Llama && c.head_dim() % 2 != 0 {
            return Err(format!("RoPE needs an even head dimension, got {}", c.head_dim()));
        }
        if c.n_kv_head == 0 || c.n_head % c.n_kv_head != 0 {
            return Err(format!("n_kv_head {} does not divide n_head {}", c.n_kv_head, c.n_head));
        }
        if c.arch == Arch::Gpt && (c.n_kv_head != c.n_head || c.qkv_bias || c.rope_scaling.is_some()) {
            return Err(format!(
                "GPT-2 blocks have one key/value head per query head, their own q/k/v biases and no RoPE: n_kv_head {}, \
                 qkv_bias {}, rope_scaling {:?}",
                c.n_kv_head, c.qkv_bias, c.rope_scaling
            ));
        }
        if let Some(m) = &c.moe {
            m.validate(c.arch)?;
        }
        Ok(())
    }

    /// Training FLOPs per token (forward + backward): 6·N for the matrices plus attention,
    /// 12·L·d·T (the PaLM/llm.c estimate; the embedding table counts through the tied head).
    ///
    /// With experts, `num_params` counts only the active ones: each MoE block's idle experts
    /// (`num_experts − top_k` of them: `3·c·f` parameters each in the LLaMA family,
    /// `2·c·f + f + c` in GPT blocks) are left out; the router, shared expert and residual MLP
    /// count whole (every token runs them). Dropped choices are not subtracted.
    pub fn flops_per_token(&self, num_params: usize, seq_len: usize) -> f64 {
        let attn = 12.0 * self.n_layer as f64 * self.d_model as f64 * seq_len as f64;
        let idle = self.moe.as_ref().map_or(0, |m| {
            let sparse = (0..self.n_layer).filter(|&l| crate::moe_ffn::is_sparse(m, l)).count();
            let (c, f) = (self.d_model, m.d_expert);
            let expert = match self.arch {
                Arch::Llama => 3 * c * f,
                Arch::Gpt => 2 * c * f + f + c,
            };
            sparse * (m.num_experts - m.top_k) * expert
        });
        6.0 * num_params.saturating_sub(idle) as f64 + attn
    }
}

/// Hands the parameters (and gradient accumulators) of one unit to the model.
pub trait UnitAccess {
    /// Parameters of unit `u` and its gradient accumulator (backward adds into it).
    fn unit(&mut self, u: usize) -> (&[f32], &mut [f32]);
    /// Called when the backward pass no longer needs unit `u` (its gradients are final).
    fn grads_ready(&mut self, _u: usize) {}
    /// [`UnitAccess::unit`], and for an MoE block whose experts run elsewhere (expert
    /// parallelism) the runner the block hands its experts' rows to; `None`: the block runs
    /// them itself.
    fn unit_with_experts(&mut self, u: usize) -> (&[f32], &mut [f32], Option<Box<dyn ExpertRunner + '_>>) {
        let (p, g) = self.unit(u);
        (p, g, None)
    }
}

/// [`UnitAccess`] over whole flat buffers (`grads` may be empty for forward-only use).
pub struct FlatAccess<'a> {
    pub params: &'a [f32],
    pub grads: &'a mut [f32],
    pub units: &'a [Range<usize>],
}

impl UnitAccess for FlatAccess<'_> {
    /// An empty `grads` (forward-only use) hands out empty gradient slices.
    fn unit(&mut self, u: usize) -> (&[f32], &mut [f32]) {
        let r = self.units[u].clone();
        let g = if self.grads.is_empty() { &mut self.grads[..] } else { &mut self.grads[r.clone()] };
        (&self.params[r], g)
    }
}

/// One micro-batch as the model reads it: `b` rows of `t` tokens and, for each token, the token
/// that follows it (`targets`); both `b*t` long, row-major.
#[derive(Clone, Copy, Debug)]
pub struct MicroBatch<'a> {
    pub tokens: &'a [u32],
    pub targets: &'a [u32],
    pub b: usize,
    pub t: usize,
    /// What the MoE blocks' randomness in training (noisy gates, random token selection) is
    /// drawn from, per block: [`noise_key_of`] the run's seed, the step and the micro-batch's
    /// global index, so it never depends on the rank or the world size. Dense models ignore it.
    pub noise_key: u64,
}

/// The [`MicroBatch::noise_key`] of micro-batch `index` (its index among the step's
/// micro-batches over every rank) of step `step` in a run seeded `seed`.
pub fn noise_key_of(seed: u64, step: u64, index: u64) -> u64 {
    // "moe-noise": a key of its own, apart from the seed's other streams.
    crate::tensor::Rng::derive(seed, &[0x6d6f_652d_6e6f_6973, step, index]).next_u64()
}

/// Reusable activation memory of a model, sized on first use.
#[derive(Debug, Default)]
pub struct Workspace {
    /// Residual stream: `xs[l]` is the input of block `l`, `xs[L]` the final stream.
    xs: Vec<Vec<f32>>,
    blocks: Vec<Acts>,
    head: Acts,
    dx: Vec<f32>,
    dx_prev: Vec<f32>,
    /// When the last [`Model::forward_backward`] had its loss: its forward done, its backward
    /// next (taken by [`Workspace::take_loss_instant`], for the engine's phase timers).
    loss_at: Option<std::time::Instant>,
    /// The MoE blocks' routing in the last forward (empty for dense models).
    moe: MoeStats,
    /// Buffers of a spent weight-gradient stash, for the next [`Model::stage_backward_input`]
    /// to copy its operands into (at most one stash's: [`Workspace::recycle`]).
    spare: Vec<Vec<f32>>,
}

impl Workspace {
    /// Readies the workspace for a forward through `blocks` blocks of streams of `nc` values:
    /// `blocks + 1` streams (the first the input), one `Acts` per block, no MoE statistics.
    fn begin(&mut self, blocks: usize, nc: usize) {
        self.xs.resize_with(blocks + 1, Vec::new);
        self.xs.truncate(blocks + 1);
        self.blocks.resize_with(blocks.max(1), Acts::default);
        self.xs.iter_mut().for_each(|x| x.resize(nc, 0.0));
        self.moe = MoeStats::default();
    }

    /// The MoE blocks' routing in the last forward (training or evaluation), for the engine to
    /// report: per MoE block the rows each expert received, the (token, choice) pairs dropped
    /// for capacity, its load-balancing and z-losses; and the objective's auxiliary terms.
    /// Empty (`blocks` empty, losses 0) for dense models.
    pub fn moe_stats(&self) -> &MoeStats {
        &self.moe
    }

    /// When the last [`Model::forward_backward`] finished its forward (the loss computed, the
    /// backward not begun); `None` when taken already or no training pass ran.
    pub fn take_loss_instant(&mut self) -> Option<std::time::Instant> {
        self.loss_at.take()
    }

    /// Bytes of activation memory currently held (a recycled stash's buffers included).
    pub fn bytes(&self) -> usize {
        let xs: usize = self.xs.iter().map(|x| x.capacity() * 4).sum();
        let blocks: usize = self.blocks.iter().map(Acts::bytes).sum();
        let spare: usize = self.spare.iter().map(|b| b.capacity() * 4).sum();
        xs + blocks + self.head.bytes() + (self.dx.capacity() + self.dx_prev.capacity()) * 4 + spare
    }

    /// Keeps the buffers of `spent` (a stash [`Model::stage_backward_weight`] returned) for the
    /// next [`Model::stage_backward_input`] on this workspace to copy into, unless it holds a
    /// stash's buffers already (then `spent` is dropped): at most one stash's memory waits here.
    pub fn recycle(&mut self, spent: WStash) {
        if self.spare.is_empty() {
            self.spare = spent.into_buffers();
        }
    }
}

/// A built model: its layout, units and layers. Holds no parameters.
pub struct Model {
    pub cfg: ModelConfig,
    layout: ParamLayout,
    units: Vec<Range<usize>>,
    blocks: Vec<Box<dyn Layer>>,
    /// Unit-0-relative ranges.
    embed: EmbedParams,
    /// Recompute each block's activations in backward instead of keeping them.
    pub checkpoint_activations: bool,
}

#[derive(Clone, Debug)]
struct EmbedParams {
    wte: Range<usize>,
    wpe: Option<Range<usize>>,
    norm_w: Range<usize>,
    norm_b: Option<Range<usize>>,
    /// The LM head `[v, c]`: `wte` when tied, else `lm_head.weight`.
    head: Range<usize>,
}

fn rel(r: Range<usize>, base: usize) -> Range<usize> {
    r.start - base..r.end - base
}

impl Model {
    pub fn new(cfg: ModelConfig) -> Result<Self, String> {
        cfg.validate()?;
        let mut layout = ParamLayout::new();
        let (v, c, l) = (cfg.vocab_size, cfg.d_model, cfg.n_layer);
        let wte = layout.push("wte.weight".into(), &[v, c], Init::Normal(0.02), true);
        let (wpe, norm_w, norm_b) = match cfg.arch {
            Arch::Gpt => {
                let wpe = layout.push("wpe.weight".into(), &[cfg.max_seq_len, c], Init::Normal(0.01), true);
                let w = layout.push("ln_f.weight".into(), &[c], Init::Ones, false);
                let b = layout.push("ln_f.bias".into(), &[c], Init::Zeros, false);
                (Some(wpe), w, Some(b))
            }
            Arch::Llama => (None, layout.push("norm_f.weight".into(), &[c], Init::Ones, false), None),
        };
        let head = match cfg.tied_head {
            true => wte.clone(),
            false => layout.push("lm_head.weight".into(), &[v, c], Init::Normal(0.02), true),
        };
        let mut units = Vec::with_capacity(l + 1);
        units.push(0..layout.total());
        let embed = EmbedParams { wte, wpe, norm_w, norm_b, head };
        let mut blocks: Vec<Box<dyn Layer>> = Vec::with_capacity(l);
        let proj_std = 0.02 / (2.0 * l as f32).sqrt();
        for i in 0..l {
            let start = layout.total();
            let block: Box<dyn Layer> = match cfg.arch {
                Arch::Gpt => Box::new(GptBlock::new(&cfg, i, &mut layout, proj_std)),
                Arch::Llama => Box::new(LlamaBlock::new(&cfg, i, &mut layout, proj_std)),
            };
            units.push(start..layout.total());
            blocks.push(block);
        }
        Ok(Model { cfg, layout, units, blocks, embed, checkpoint_activations: false })
    }

    pub fn layout(&self) -> &ParamLayout {
        &self.layout
    }

    /// Ranges of the flat buffer, one per unit (embeddings+head, then each block).
    pub fn units(&self) -> &[Range<usize>] {
        &self.units
    }

    pub fn num_params(&self) -> usize {
        self.layout.total()
    }

    /// GPT-2 initialisation (N(0, 0.02), output projections scaled by 1/√(2L)), seeded.
    pub fn init_params(&self, seed: u64) -> Vec<f32> {
        self.layout.init(seed)
    }

    fn dims(&self, b: usize, t: usize) -> Dims {
        Dims { b, t, c: self.cfg.d_model }
    }

    fn check_batch(&self, tokens: &[u32], b: usize, t: usize) {
        assert!(t <= self.cfg.max_seq_len, "sequence length {t} exceeds the model's {}", self.cfg.max_seq_len);
        assert_eq!(tokens.len(), b * t, "tokens must be b*t");
    }

    /// Forward through the embeddings and every block; leaves the final stream in `ws.xs[L]`
    /// and the MoE blocks' statistics in `ws.moe`. `pass`: training (its noise key) or
    /// evaluation (`None`).
    fn forward_stack(&self, acc: &mut dyn UnitAccess, tokens: &[u32], d: Dims, ws: &mut Workspace, keep: bool, pass: Option<u64>) {
        let span = 0..self.blocks.len();
        ws.begin(span.len(), d.n() * d.c);
        self.embed(acc, tokens, d, &mut ws.xs[0]);
        self.forward_blocks(acc, span, d, ws, keep, pass);
    }

    /// The embeddings of `tokens` (and learned positions) into `out` `[n, c]`.
    fn embed(&self, acc: &mut dyn UnitAccess, tokens: &[u32], d: Dims, out: &mut [f32]) {
        let (p0, _) = acc.unit(0);
        let e = &self.embed;
        let wpe = e.wpe.clone().map(|r| &p0[r]);
        embedding::embedding_forward(out, tokens, &p0[e.wte.clone()], wpe, d.b, d.t, d.c);
    }

    /// Forward through blocks `span` from the stream in `ws.xs[0]` (the input of block
    /// `span.start`; `ws` was begun for `span.len()` blocks): `ws.xs[k]` is the input of block
    /// `span.start + k`, the last one the span's output. Adds the MoE blocks' statistics to
    /// `ws.moe`.
    fn forward_blocks(&self, acc: &mut dyn UnitAccess, span: Range<usize>, d: Dims, ws: &mut Workspace, keep: bool, pass: Option<u64>) {
        for (k, i) in span.enumerate() {
            let block = &self.blocks[i];
            let (p, _, mut experts) = acc.unit_with_experts(i + 1);
            let (head, tail) = ws.xs.split_at_mut(k + 1);
            // With recomputation every block shares one scratch `Acts`: only inputs are kept.
            let acts = if keep { &mut ws.blocks[k] } else { &mut ws.blocks[0] };
            set_pass(block.as_ref(), acts, pass, i);
            block.forward_with(p, &head[k], d, acts, &mut tail[0], runner(&mut experts));
            if let Some(m) = &acts.moe {
                let per_layer = self.cfg.moe.as_ref().is_some_and(|c| c.aux_loss == AuxLoss::PerLayer);
                ws.moe.add(i, m, per_layer);
            }
        }
    }

    /// Final norm → LM head → softmax cross-entropy over the stream `ws.xs`'s last entry,
    /// keeping what the head's backward needs in `ws.head`. Returns the mean loss over the
    /// `b*t` positions.
    fn head_forward(&self, p0: &[f32], targets: &[u32], d: Dims, ws: &mut Workspace) -> f32 {
        let (n, c, v) = (d.n(), d.c, self.cfg.vocab_size);
        let e = &self.embed;
        let x = ws.xs.last().expect("a begun workspace");
        let h = &mut ws.head;
        let mut xn = h.take(0, n * c);
        let mut mean = h.take(1, n);
        let mut rstd = h.take(2, n);
        match e.norm_b.clone() {
            Some(b) => layernorm::layernorm_forward(&mut xn, &mut mean, &mut rstd, x, &p0[e.norm_w.clone()], &p0[b], n, c),
            None => rmsnorm::rmsnorm_forward(&mut xn, &mut rstd, x, &p0[e.norm_w.clone()], n, c, self.cfg.norm_eps),
        }
        let wte = &p0[e.head.clone()];
        let mut logits = h.take(3, n * v);
        let mut probs = h.take(4, n * v);
        let mut losses = h.take(5, n);
        matmul(&mut logits, &xn, wte, n, c, v, false, true, 0.0);
        let loss = crossentropy::crossentropy_forward(&mut losses, &mut probs, &logits, targets, n, v);
        for (i, buf) in [xn, mean, rstd, logits, probs, losses].into_iter().enumerate() {
            h.put(i, buf);
        }
        loss
    }

    /// The head's backward after [`Model::head_forward`] on the same workspace: sends unit 0's
    /// gradients (the head, the final norm) to `wg` and leaves d(stream) in `ws.dx`.
    fn head_backward(&self, p0: &[f32], wg: &mut WeightGrads<'_>, targets: &[u32], d: Dims, ws: &mut Workspace, dloss: f32) {
        let (n, c, v) = (d.n(), d.c, self.cfg.vocab_size);
        let e = &self.embed;
        let x = ws.xs.last().expect("a begun workspace");
        let h = &mut ws.head;
        let xn = h.take(0, n * c);
        let mean = h.take(1, n);
        let rstd = h.take(2, n);
        // Reuse the logits buffer for d(logits).
        let mut logits = h.take(3, n * v);
        let probs = h.take(4, n * v);
        let wte = &p0[e.head.clone()];
        logits.fill(0.0);
        crossentropy::crossentropy_backward(&mut logits, &probs, targets, n, v, dloss);
        let mut dxn = h.take(6, n * c);
        matmul(&mut dxn, &logits, wte, n, v, c, false, false, 0.0);
        // d(head) += d(logits)ᵀ·xn: the weight half of a linear whose input is d(logits).
        wg.linear(e.head.clone(), None, &xn, &logits, n, v, c);
        ws.dx.clear();
        ws.dx.resize(n * c, 0.0);
        let norm_w = &p0[e.norm_w.clone()];
        match e.norm_b.clone() {
            Some(b) => {
                layernorm::layernorm_backward_input(&mut ws.dx, &dxn, x, norm_w, &mean, &rstd, n, c);
                wg.layernorm(e.norm_w.clone(), b, &dxn, x, &mean, &rstd, c);
            }
            None => {
                rmsnorm::rmsnorm_backward_input(&mut ws.dx, &dxn, x, norm_w, &rstd, n, c);
                wg.rmsnorm(e.norm_w.clone(), &dxn, x, &rstd, c);
            }
        }
        for (i, buf) in [xn, mean, rstd, logits, probs].into_iter().enumerate() {
            h.put(i, buf);
        }
        h.put(6, dxn);
    }

    /// One training micro-batch: forward, loss, backward. Gradients of `dloss · objective` are
    /// *accumulated* into the units' gradient buffers, the objective being the mean
    /// cross-entropy plus, with MoE blocks, `aux_loss_coef · aux + z_loss_coef · z`
    /// ([`Workspace::moe_stats`] has both terms). Returns the mean cross-entropy alone: what the
    /// loss curve and the validation loss show. MoE routing draws its training noise from
    /// `batch.noise_key` and uses the training capacity factor.
    ///
    /// # Panics
    /// If `tokens`/`targets` are not `b*t` long or `t` exceeds the model's context.
    pub fn forward_backward(&self, acc: &mut dyn UnitAccess, batch: MicroBatch<'_>, dloss: f32, ws: &mut Workspace) -> f32 {
        let MicroBatch { tokens, targets, b, t, noise_key } = batch;
        self.check_batch(tokens, b, t);
        let d = self.dims(b, t);
        let keep = !self.checkpoint_activations;
        self.forward_stack(acc, tokens, d, ws, keep, Some(noise_key));
        // The head's parameters are taken once for its forward and backward.
        let (p0, g0) = acc.unit(0);
        let loss = self.head_forward(p0, targets, d, ws);
        ws.loss_at = Some(std::time::Instant::now());
        self.head_backward(p0, &mut WeightGrads::now(g0), targets, d, ws, dloss);
        self.backward_blocks(acc, 0..self.blocks.len(), d, ws, noise_key, dloss, None);
        self.embed_backward(acc, tokens, d, &ws.dx);
        loss
    }

    /// Backward through blocks `span` (after [`Model::forward_blocks`] on the same workspace),
    /// from d(span output) in `ws.dx`; leaves d(span input) in `ws.dx`. Without `stash` it adds
    /// each block's gradients and marks them ready as it finishes; with one it is the
    /// input-gradient pass alone, each block's weight gradients recorded in `stash`.
    #[allow(clippy::too_many_arguments)]
    fn backward_blocks(
        &self,
        acc: &mut dyn UnitAccess,
        span: Range<usize>,
        d: Dims,
        ws: &mut Workspace,
        noise_key: u64,
        dloss: f32,
        mut stash: Option<&mut WStash>,
    ) {
        let keep = !self.checkpoint_activations;
        ws.dx_prev.resize(d.n() * d.c, 0.0);
        // The router losses' gradients, for the MoE blocks' backward (scaled like the loss's):
        // the across-layers loss's is the same for every block (it needs every block's counts,
        // so only now is it known); the per-layer loss's is each block's own (below).
        let (dprob, z_coef, per_layer) = match &self.cfg.moe {
            Some(m) if !ws.moe.blocks.is_empty() => {
                let per_layer = (m.aux_loss == AuxLoss::PerLayer && m.aux_loss_coef != 0.0).then_some(m.aux_loss_coef * dloss);
                let across =
                    (m.aux_loss == AuxLoss::AcrossLayers && m.aux_loss_coef != 0.0).then(|| ws.moe.aux.dprob(m.aux_loss_coef * dloss));
                (across, m.z_loss_coef * dloss, per_layer)
            }
            _ => (None, 0.0, None),
        };
        for (k, i) in span.clone().enumerate().rev() {
            let block = &self.blocks[i];
            let (p, g, mut experts) = acc.unit_with_experts(i + 1);
            let acts = if keep { &mut ws.blocks[k] } else { &mut ws.blocks[0] };
            if !keep {
                // Recompute this block's activations from its saved input (an MoE block's
                // experts run again, in the same exchanges as its forward's, with the same
                // noise).
                let mut y = std::mem::take(&mut ws.dx_prev);
                set_pass(block.as_ref(), acts, Some(noise_key), i);
                block.forward_with(p, &ws.xs[k], d, acts, &mut y, runner(&mut experts));
                ws.dx_prev = y;
            }
            if let Some(m) = acts.moe.as_mut() {
                (m.dprob, m.z_coef) = (dprob.clone(), z_coef);
                if let Some(scale) = per_layer {
                    m.dprob = Some(crate::ops::moe::aux_per_layer(&m.routing).1.iter().map(|v| v * scale).collect());
                }
            }
            let mut wg = match stash.as_deref_mut() {
                Some(s) => s.unit(i + 1),
                None => WeightGrads::now(g),
            };
            block.backward_with(p, &mut wg, &ws.xs[k], &ws.dx, d, acts, &mut ws.dx_prev, runner(&mut experts));
            drop((wg, experts));
            std::mem::swap(&mut ws.dx, &mut ws.dx_prev);
            if stash.is_none() {
                acc.grads_ready(i + 1);
            }
        }
    }

    /// The embeddings' backward from d(stream after the embeddings) `dx`: accumulates into unit
    /// 0's gradients and marks them ready.
    fn embed_backward(&self, acc: &mut dyn UnitAccess, tokens: &[u32], d: Dims, dx: &[f32]) {
        let (_, g0) = acc.unit(0);
        let e = &self.embed;
        let (gwte, gwpe) = crate::wgrad::split_two(g0, e.wte.clone(), e.wpe.clone());
        embedding::embedding_backward(gwte, gwpe, dx, tokens, d.b, d.t, d.c);
        acc.grads_ready(0);
    }

    /// Mean cross-entropy of one batch, forward only: evaluation (MoE routing draws no noise
    /// and uses the evaluation capacity factor).
    pub fn loss(&self, acc: &mut dyn UnitAccess, tokens: &[u32], targets: &[u32], b: usize, t: usize, ws: &mut Workspace) -> f32 {
        self.check_batch(tokens, b, t);
        let d = self.dims(b, t);
        self.forward_stack(acc, tokens, d, ws, false, None);
        let (p0, _) = acc.unit(0);
        self.head_forward(p0, targets, d, ws)
    }

    /// Logits `[v]` of the last position of one sequence (for sampling).
    pub fn next_token_logits(&self, params: &[f32], tokens: &[u32], ws: &mut Workspace) -> Vec<f32> {
        let t = tokens.len();
        self.check_batch(tokens, 1, t);
        let d = self.dims(1, t);
        let mut acc = FlatAccess { params, grads: &mut [], units: &self.units };
        self.forward_stack(&mut acc, tokens, d, ws, false, None);
        let (c, v) = (d.c, self.cfg.vocab_size);
        let x_last = &ws.xs[self.blocks.len()][(t - 1) * c..t * c];
        let e = &self.embed;
        let p0 = &params[self.units[0].clone()];
        let mut xn = vec![0.0; c];
        let (mut mean, mut rstd) = (vec![0.0; 1], vec![0.0; 1]);
        match e.norm_b.clone() {
            Some(b) => layernorm::layernorm_forward(&mut xn, &mut mean, &mut rstd, x_last, &p0[e.norm_w.clone()], &p0[b], 1, c),
            None => rmsnorm::rmsnorm_forward(&mut xn, &mut rstd, x_last, &p0[e.norm_w.clone()], 1, c, self.cfg.norm_eps),
        }
        let mut logits = vec![0.0; v];
        matmul(&mut logits, &xn, &p0[e.head.clone()], 1, c, v, false, true, 0.0);
        logits
    }

    /// Block `l`'s kind (`gpt-block`, `llama-block`).
    pub fn block_kind(&self, l: usize) -> &'static str {
        self.blocks[l].kind()
    }

    /// Block `l`'s experts, if it is a mixture-of-experts block.
    pub fn expert_mlp(&self, l: usize) -> Option<&dyn ExpertMlp> {
        self.blocks.get(l)?.experts()
    }

    /// Parameter specs of block `l` with offsets relative to its unit.
    pub fn block_specs(&self, l: usize) -> &[ParamSpec] {
        self.blocks[l].param_specs()
    }
}

/// Tells an MoE block (`block` has experts) the pass it runs in: training with the
/// micro-batch's noise key, or evaluation (`None`).
fn set_pass(block: &dyn Layer, acts: &mut Acts, noise_key: Option<u64>, i: usize) {
    if block.experts().is_some() {
        let pass = MoePass { training: noise_key.is_some(), noise_key: noise_key.unwrap_or(0), block: i };
        acts.moe.get_or_insert_with(Default::default).pass = pass;
    }
}

/// The runner an access handed out, as the blocks take it.
fn runner<'a>(r: &'a mut Option<Box<dyn ExpertRunner + '_>>) -> Option<&'a mut dyn ExpertRunner> {
    r.as_mut().map(|b| &mut **b as &mut dyn ExpertRunner)
}

/// Pre-LN GPT-2 block:
/// `x2 = x + proj(attn(ln1(x)))`, `y = x2 + fcproj(gelu(fc(ln2(x2))))`; in a sparse block
/// `y = x2 + moe(ln2(x2))`, GELU experts with biases ([`MoeFfn`]).
struct GptBlock {
    specs: Vec<ParamSpec>,
    nh: usize,
    ff: usize,
    p: [Range<usize>; 12],
    /// The mixture-of-experts feed-forward that replaces the dense MLP in a sparse block
    /// (whose `p[FC_W..=FCP_B]` are then empty).
    moe: Option<MoeFfn>,
}

// Indices into GptBlock::p.
const LN1_W: usize = 0;
const LN1_B: usize = 1;
const QKV_W: usize = 2;
const QKV_B: usize = 3;
const PROJ_W: usize = 4;
const PROJ_B: usize = 5;
const LN2_W: usize = 6;
const LN2_B: usize = 7;
const FC_W: usize = 8;
const FC_B: usize = 9;
const FCP_W: usize = 10;
const FCP_B: usize = 11;

/// Appends a block's parameters to `layout`; returns their unit-relative specs and ranges.
fn push_block<const K: usize>(
    layout: &mut ParamLayout,
    items: [(String, Vec<usize>, Init, bool); K],
) -> (Vec<ParamSpec>, [Range<usize>; K]) {
    let base = layout.total();
    let ranges = items.map(|(name, shape, init, decay)| rel(layout.push(name, &shape, init, decay), base));
    let specs = layout.specs()[layout.specs().len() - K..].iter().map(|s| ParamSpec { offset: s.offset - base, ..s.clone() }).collect();
    (specs, ranges)
}

impl GptBlock {
    fn new(cfg: &ModelConfig, i: usize, layout: &mut ParamLayout, proj_std: f32) -> Self {
        let (c, f) = (cfg.d_model, cfg.d_ff);
        let n = |s: &str| format!("h.{i}.{s}");
        let w = Init::Normal(0.02);
        let base = layout.total();
        let (mut specs, head) = push_block(
            layout,
            [
                (n("ln_1.weight"), vec![c], Init::Ones, false),
                (n("ln_1.bias"), vec![c], Init::Zeros, false),
                (n("attn.c_attn.weight"), vec![c, 3 * c], w, true),
                (n("attn.c_attn.bias"), vec![3 * c], Init::Zeros, false),
                (n("attn.c_proj.weight"), vec![c, c], Init::Normal(proj_std), true),
                (n("attn.c_proj.bias"), vec![c], Init::Zeros, false),
                (n("ln_2.weight"), vec![c], Init::Ones, false),
                (n("ln_2.bias"), vec![c], Init::Zeros, false),
            ],
        );
        let sparse = cfg.moe.as_ref().filter(|m| crate::moe_ffn::is_sparse(m, i));
        let (moe, mlp) = match sparse {
            Some(m) => {
                let (ffn, more) = MoeFfn::new(m, Arch::Gpt, i, c, layout, base, proj_std);
                specs.extend(more);
                let at = head[LN2_B].end;
                (Some(ffn), [at..at, at..at, at..at, at..at])
            }
            None => {
                let mlp_base = layout.total() - base;
                let (more, mlp) = push_block(
                    layout,
                    [
                        (n("mlp.c_fc.weight"), vec![c, f], w, true),
                        (n("mlp.c_fc.bias"), vec![f], Init::Zeros, false),
                        (n("mlp.c_proj.weight"), vec![f, c], Init::Normal(proj_std), true),
                        (n("mlp.c_proj.bias"), vec![c], Init::Zeros, false),
                    ],
                );
                specs.extend(more.into_iter().map(|s| ParamSpec { offset: s.offset + mlp_base, ..s }));
                (None, mlp.map(|r| r.start + mlp_base..r.end + mlp_base))
            }
        };
        let [h0, h1, h2, h3, h4, h5, h6, h7] = head;
        let [m0, m1, m2, m3] = mlp;
        let p = [h0, h1, h2, h3, h4, h5, h6, h7, m0, m1, m2, m3];
        GptBlock { specs, nh: cfg.n_head, ff: f, p, moe }
    }
}

// Saved-activation slots of a GPT block.
const A_LN1: usize = 0;
const A_LN1_MEAN: usize = 1;
const A_LN1_RSTD: usize = 2;
const A_QKV: usize = 3;
const A_ATT: usize = 4;
const A_ATTY: usize = 5;
const A_X2: usize = 6;
const A_LN2: usize = 7;
const A_LN2_MEAN: usize = 8;
const A_LN2_RSTD: usize = 9;
const A_FC: usize = 10;
const A_GELU: usize = 11;
const A_TMP: usize = 12;
// Backward scratch.
const B_D1: usize = 13;
const B_D2: usize = 14;
const B_DQKV: usize = 15;

impl Layer for GptBlock {
    fn paged(&self) -> &dyn paged::PagedLayer {
        self
    }

    fn kind(&self) -> &'static str {
        "gpt-block"
    }

    fn param_specs(&self) -> &[ParamSpec] {
        &self.specs
    }

    fn experts(&self) -> Option<&dyn ExpertMlp> {
        self.moe.as_ref().map(|m| m as &dyn ExpertMlp)
    }

    fn forward(&self, p: &[f32], x: &[f32], d: Dims, a: &mut Acts, y: &mut [f32]) {
        self.forward_with(p, x, d, a, y, None)
    }

    fn forward_with(&self, p: &[f32], x: &[f32], d: Dims, a: &mut Acts, y: &mut [f32], experts: Option<&mut dyn ExpertRunner>) {
        // An MoE block keeps no dense-MLP activations.
        let f = if self.moe.is_some() { 0 } else { self.ff };
        let (n, c, (b, t)) = (d.n(), d.c, (d.b, d.t));
        let w = |k: usize| &p[self.p[k].clone()];
        let mut ln1 = a.take(A_LN1, n * c);
        let mut m1 = a.take(A_LN1_MEAN, n);
        let mut r1 = a.take(A_LN1_RSTD, n);
        layernorm::layernorm_forward(&mut ln1, &mut m1, &mut r1, x, w(LN1_W), w(LN1_B), n, c);
        let mut qkv = a.take(A_QKV, n * 3 * c);
        linear::linear_forward(&mut qkv, &ln1, w(QKV_W), Some(w(QKV_B)), n, c, 3 * c);
        let mut att = a.take(A_ATT, b * self.nh * t * t);
        let mut atty = a.take(A_ATTY, n * c);
        attention::attention_forward(&mut atty, &mut att, &qkv, b, t, c, self.nh);
        let mut tmp = a.take(A_TMP, n * c);
        linear::linear_forward(&mut tmp, &atty, w(PROJ_W), Some(w(PROJ_B)), n, c, c);
        let mut x2 = a.take(A_X2, n * c);
        residual::residual_forward(&mut x2, x, &tmp);
        let mut ln2 = a.take(A_LN2, n * c);
        let mut m2 = a.take(A_LN2_MEAN, n);
        let mut r2 = a.take(A_LN2_RSTD, n);
        layernorm::layernorm_forward(&mut ln2, &mut m2, &mut r2, &x2, w(LN2_W), w(LN2_B), n, c);
        let mut fc = a.take(A_FC, n * f);
        let mut gl = a.take(A_GELU, n * f);
        match &self.moe {
            Some(m) => m.forward(p, &ln2, &mut tmp, &mut a.moe, experts),
            None => {
                linear::linear_forward(&mut fc, &ln2, w(FC_W), Some(w(FC_B)), n, c, f);
                gelu::gelu_forward(&mut gl, &fc);
                linear::linear_forward(&mut tmp, &gl, w(FCP_W), Some(w(FCP_B)), n, f, c);
            }
        }
        residual::residual_forward(y, &x2, &tmp);
        for (slot, buf) in [
            (A_LN1, ln1),
            (A_LN1_MEAN, m1),
            (A_LN1_RSTD, r1),
            (A_QKV, qkv),
            (A_ATT, att),
            (A_ATTY, atty),
            (A_TMP, tmp),
            (A_X2, x2),
            (A_LN2, ln2),
            (A_LN2_MEAN, m2),
            (A_LN2_RSTD, r2),
            (A_FC, fc),
            (A_GELU, gl),
        ] {
            a.put(slot, buf);
        }
    }

    fn backward_with(
        &self,
        p: &[f32],
        wg: &mut WeightGrads<'_>,
        x: &[f32],
        dy: &[f32],
        d: Dims,
        a: &mut Acts,
        dx: &mut [f32],
        experts: Option<&mut dyn ExpertRunner>,
    ) {
        let f = if self.moe.is_some() { 0 } else { self.ff };
        let (n, c, (b, t)) = (d.n(), d.c, (d.b, d.t));
        // The MoE feed-forward's input gradient first (its router, experts and the rest lie
        // after the block's second norm).
        let moe_dh = self.moe.as_ref().map(|m| {
            let ln2 = a.take(A_LN2, n * c);
            let mut dh = vec![0.0; n * c];
            m.backward(p, wg, &ln2, dy, &mut dh, &mut a.moe, experts);
            a.put(A_LN2, ln2);
            dh
        });
        let w = |k: usize| &p[self.p[k].clone()];
        let r = |k: usize| self.p[k].clone();
        // MLP branch: y = x2 + fcproj(gelu(fc(ln2(x2)))); dy flows to x2 and to the branch.
        let mut d_gl = a.take(B_D1, n * f);
        let mut d_fc = a.take(B_D2, n * f);
        let mut d_ln = a.take(B_DQKV, n * 3 * c);
        match moe_dh {
            Some(dh) => d_ln[..n * c].copy_from_slice(&dh),
            None => {
                d_gl.fill(0.0);
                linear::linear_backward_input(&mut d_gl, dy, w(FCP_W), n, f, c);
                wg.linear(r(FCP_W), Some(r(FCP_B)), dy, a.buf(A_GELU, n * f), n, f, c);
                d_fc.fill(0.0);
                gelu::gelu_backward(&mut d_fc, a.buf(A_FC, n * f), &d_gl);
                d_ln[..n * c].fill(0.0);
                linear::linear_backward_input(&mut d_ln[..n * c], &d_fc, w(FC_W), n, c, f);
                wg.linear(r(FC_W), Some(r(FC_B)), &d_fc, a.buf(A_LN2, n * c), n, c, f);
            }
        }
        // d(x2) = dy + LN2 backward. (Reused buffers: `d_ff` may be narrower than `d_model`,
        // and is 0 in an MoE block, so they are resized, not cut.)
        let mut dx2 = std::mem::take(&mut d_gl);
        dx2.resize(n * c, 0.0);
        dx2.copy_from_slice(dy);
        let (m2, r2) = (a.take(A_LN2_MEAN, n), a.take(A_LN2_RSTD, n));
        layernorm::layernorm_backward_input(&mut dx2, &d_ln[..n * c], a.buf(A_X2, n * c), w(LN2_W), &m2, &r2, n, c);
        wg.layernorm(r(LN2_W), r(LN2_B), &d_ln[..n * c], a.buf(A_X2, n * c), &m2, &r2, c);
        a.put(A_LN2_MEAN, m2);
        a.put(A_LN2_RSTD, r2);
        // Attention branch: x2 = x + proj(attn(qkv(ln1(x)))).
        let mut d_atty = std::mem::take(&mut d_fc);
        d_atty.resize(n * c, 0.0);
        d_atty.fill(0.0);
        linear::linear_backward_input(&mut d_atty, &dx2, w(PROJ_W), n, c, c);
        wg.linear(r(PROJ_W), Some(r(PROJ_B)), &dx2, a.buf(A_ATTY, n * c), n, c, c);
        d_ln.fill(0.0);
        let (qkv, att) = (a.take(A_QKV, n * 3 * c), a.take(A_ATT, b * self.nh * t * t));
        attention::attention_backward(&mut d_ln, &d_atty, &qkv, &att, b, t, c, self.nh);
        let mut d_ln1 = d_atty;
        d_ln1.fill(0.0);
        linear::linear_backward_input(&mut d_ln1, &d_ln, w(QKV_W), n, c, 3 * c);
        wg.linear(r(QKV_W), Some(r(QKV_B)), &d_ln, a.buf(A_LN1, n * c), n, c, 3 * c);
        dx.copy_from_slice(&dx2);
        let (m1, r1) = (a.take(A_LN1_MEAN, n), a.take(A_LN1_RSTD, n));
        layernorm::layernorm_backward_input(dx, &d_ln1, x, w(LN1_W), &m1, &r1, n, c);
        wg.layernorm(r(LN1_W), r(LN1_B), &d_ln1, x, &m1, &r1, c);
        for (slot, buf) in [(A_QKV, qkv), (A_ATT, att), (A_LN1_MEAN, m1), (A_LN1_RSTD, r1), (B_D1, dx2), (B_D2, d_ln1), (B_DQKV, d_ln)] {
            a.put(slot, buf);
        }
    }
}

/// LLaMA block:
/// `x2 = x + wo(attn(rope(wqkv(rms1(x)) [+ bqkv])))`, `y = x2 + w_down(silu(w_gate(h)) * w_up(h))`,
/// `h = rms2(x2)`. With grouped-query attention `wqkv` projects to `nkv < nh` key/value heads,
/// widened to one per query head before the attention ([`gqa`]).
struct LlamaBlock {
    specs: Vec<ParamSpec>,
    groups: Groups,
    ff: usize,
    eps: f32,
    /// RoPE frequency of each rotation pair.
    inv_freq: Vec<f64>,
    p: [Range<usize>; 7],
    /// The q/k/v bias `[c + 2·kv]` (Qwen2).
    qkv_b: Option<Range<usize>>,
    /// The mixture-of-experts feed-forward that replaces the dense MLP in a sparse block
    /// (whose `p[L_GATE..=L_DOWN]` are then empty).
    moe: Option<MoeFfn>,
}

const L_N1: usize = 0;
const L_QKV: usize = 1;
const L_WO: usize = 2;
const L_N2: usize = 3;
const L_GATE: usize = 4;
const L_UP: usize = 5;
const L_DOWN: usize = 6;

impl LlamaBlock {
    fn new(cfg: &ModelConfig, i: usize, layout: &mut ParamLayout, proj_std: f32) -> Self {
        let (c, f) = (cfg.d_model, cfg.d_ff);
        let groups = Groups { c, nh: cfg.n_head, nkv: cfg.n_kv_head };
        let n = |s: &str| format!("h.{i}.{s}");
        let w = Init::Normal(0.02);
        let base = layout.total();
        let (mut specs, head) = push_block(
            layout,
            [
                (n("attn_norm.weight"), vec![c], Init::Ones, false),
                (n("attn.wqkv.weight"), vec![c, groups.row()], w, true),
                (n("attn.wo.weight"), vec![c, c], Init::Normal(proj_std), true),
                (n("mlp_norm.weight"), vec![c], Init::Ones, false),
            ],
        );
        let sparse = cfg.moe.as_ref().filter(|m| crate::moe_ffn::is_sparse(m, i));
        let (moe, mlp) = match sparse {
            Some(m) => {
                let (ffn, more) = MoeFfn::new(m, Arch::Llama, i, c, layout, base, proj_std);
                specs.extend(more);
                let at = head[L_N2].end;
                (Some(ffn), [at..at, at..at, at..at])
            }
            None => {
                let mlp_base = layout.total() - base;
                let (more, mlp) = push_block(
                    layout,
                    [
                        (n("mlp.w_gate.weight"), vec![c, f], w, true),
                        (n("mlp.w_up.weight"), vec![c, f], w, true),
                        (n("mlp.w_down.weight"), vec![f, c], Init::Normal(proj_std), true),
                    ],
                );
                specs.extend(more.into_iter().map(|s| ParamSpec { offset: s.offset + mlp_base, ..s }));
                (None, mlp.map(|r| r.start + mlp_base..r.end + mlp_base))
            }
        };
        let p = [head[0].clone(), head[1].clone(), head[2].clone(), head[3].clone(), mlp[0].clone(), mlp[1].clone(), mlp[2].clone()];
        // The bias goes last, so a block without it is laid out as before biases existed.
        let qkv_b = cfg.qkv_bias.then(|| {
            let r = rel(layout.push(n("attn.wqkv.bias"), &[groups.row()], Init::Zeros, false), base);
            let spec = &layout.specs()[layout.specs().len() - 1];
            specs.push(ParamSpec { offset: spec.offset - base, ..spec.clone() });
            r
        });
        let inv_freq = rope::inv_freq(groups.hd(), cfg.rope_theta, cfg.rope_scaling.as_ref());
        LlamaBlock { specs, groups, ff: f, eps: cfg.norm_eps, inv_freq, p, qkv_b, moe }
    }
}

// Saved-activation slots of a LLaMA block.
const LA_H1: usize = 0;
const LA_R1: usize = 1;
const LA_QKV: usize = 2;
const LA_ATT: usize = 3;
const LA_ATTY: usize = 4;
const LA_X2: usize = 5;
const LA_H2: usize = 6;
const LA_R2: usize = 7;
const LA_GATE: usize = 8;
const LA_UP: usize = 9;
const LA_SW: usize = 10;
const LA_TMP: usize = 11;
const LB_D1: usize = 12;
const LB_D2: usize = 13;
const LB_D3: usize = 14;
const LB_DQKV: usize = 15;
// Grouped-query attention: the q/k/v rows widened to one key/value head per query head, and
// the gradient summed back to the grouped rows.
const LA_QKVX: usize = 16;
const LB_DQKVG: usize = 17;

impl LlamaBlock {
    /// Whether key/value heads are shared (fewer than the query heads).
    fn grouped(&self) -> bool {
        self.groups.nkv != self.groups.nh
    }
}

impl Layer for LlamaBlock {
    fn paged(&self) -> &dyn paged::PagedLayer {
        self
    }

    fn kind(&self) -> &'static str {
        "llama-block"
    }

    fn param_specs(&self) -> &[ParamSpec] {
        &self.specs
    }

    fn experts(&self) -> Option<&dyn ExpertMlp> {
        self.moe.as_ref().map(|m| m as &dyn ExpertMlp)
    }

    fn forward(&self, p: &[f32], x: &[f32], d: Dims, a: &mut Acts, y: &mut [f32]) {
        self.forward_with(p, x, d, a, y, None)
    }

    fn forward_with(&self, p: &[f32], x: &[f32], d: Dims, a: &mut Acts, y: &mut [f32], experts: Option<&mut dyn ExpertRunner>) {
        // An MoE block keeps no dense-MLP activations.
        let f = if self.moe.is_some() { 0 } else { self.ff };
        let (n, c, (b, t)) = (d.n(), d.c, (d.b, d.t));
        let (gr, nh) = (self.groups, self.groups.nh);
        let w = |k: usize| &p[self.p[k].clone()];
        let mut h1 = a.take(LA_H1, n * c);
        let mut r1 = a.take(LA_R1, n);
        rmsnorm::rmsnorm_forward(&mut h1, &mut r1, x, w(L_N1), n, c, self.eps);
        let mut qkv = a.take(LA_QKV, n * gr.row());
        linear::linear_forward(&mut qkv, &h1, w(L_QKV), self.qkv_b.clone().map(|r| &p[r]), n, c, gr.row());
        rope::rope_forward_rows(&mut qkv, t, gr.row(), c + gr.kv(), &RopeTable::with_inv_freq(t, &self.inv_freq));
        let mut full = a.take(LA_QKVX, if self.grouped() { n * 3 * c } else { 0 });
        if self.grouped() {
            gqa::repeat_kv_forward(&mut full, &qkv, gr);
        }
        let mut att = a.take(LA_ATT, b * nh * t * t);
        let mut atty = a.take(LA_ATTY, n * c);
        attention::attention_forward(&mut atty, &mut att, if self.grouped() { &full } else { &qkv }, b, t, c, nh);
        let mut tmp = a.take(LA_TMP, n * c);
        linear::linear_forward(&mut tmp, &atty, w(L_WO), None, n, c, c);
        let mut x2 = a.take(LA_X2, n * c);
        residual::residual_forward(&mut x2, x, &tmp);
        let mut h2 = a.take(LA_H2, n * c);
        let mut r2 = a.take(LA_R2, n);
        rmsnorm::rmsnorm_forward(&mut h2, &mut r2, &x2, w(L_N2), n, c, self.eps);
        let mut gate = a.take(LA_GATE, n * f);
        let mut up = a.take(LA_UP, n * f);
        let mut sw = a.take(LA_SW, n * f);
        match &self.moe {
            Some(m) => m.forward(p, &h2, &mut tmp, &mut a.moe, experts),
            None => {
                linear::linear_forward(&mut gate, &h2, w(L_GATE), None, n, c, f);
                linear::linear_forward(&mut up, &h2, w(L_UP), None, n, c, f);
                swiglu::swiglu_forward(&mut sw, &gate, &up);
                linear::linear_forward(&mut tmp, &sw, w(L_DOWN), None, n, f, c);
            }
        }
        residual::residual_forward(y, &x2, &tmp);
        for (slot, buf) in [
            (LA_H1, h1),
            (LA_R1, r1),
            (LA_QKV, qkv),
            (LA_QKVX, full),
            (LA_ATT, att),
            (LA_ATTY, atty),
            (LA_TMP, tmp),
            (LA_X2, x2),
            (LA_H2, h2),
            (LA_R2, r2),
            (LA_GATE, gate),
            (LA_UP, up),
            (LA_SW, sw),
        ] {
            a.put(slot, buf);
        }
    }

    fn backward_with(
        &self,
        p: &[f32],
        wg: &mut WeightGrads<'_>,
        x: &[f32],
        dy: &[f32],
        d: Dims,
        a: &mut Acts,
        dx: &mut [f32],
        experts: Option<&mut dyn ExpertRunner>,
    ) {
        let f = if self.moe.is_some() { 0 } else { self.ff };
        let (n, c, (b, t)) = (d.n(), d.c, (d.b, d.t));
        let (gr, nh) = (self.groups, self.groups.nh);
        // The MoE feed-forward's input gradient first (its router, experts and shared expert
        // lie after the block's second norm).
        let moe_dh = self.moe.as_ref().map(|m| {
            let h2 = a.take(LA_H2, n * c);
            let mut dh = vec![0.0; n * c];
            m.backward(p, wg, &h2, dy, &mut dh, &mut a.moe, experts);
            a.put(LA_H2, h2);
            dh
        });
        let w = |k: usize| &p[self.p[k].clone()];
        let r = |k: usize| self.p[k].clone();
        // MLP branch.
        let mut d_h = a.take(LB_DQKV, n * 3 * c);
        let mut d_sw = a.take(LB_D1, n * f);
        let mut d_gate = a.take(LB_D2, n * f);
        let mut d_up = a.take(LB_D3, n * f);
        match moe_dh {
            Some(dh) => d_h[..n * c].copy_from_slice(&dh),
            None => {
                d_sw.fill(0.0);
                linear::linear_backward_input(&mut d_sw, dy, w(L_DOWN), n, f, c);
                wg.linear(r(L_DOWN), None, dy, a.buf(LA_SW, n * f), n, f, c);
                d_gate.fill(0.0);
                d_up.fill(0.0);
                let (gate, up) = (a.take(LA_GATE, n * f), a.take(LA_UP, n * f));
                swiglu::swiglu_backward(&mut d_gate, &mut d_up, &d_sw, &gate, &up);
                a.put(LA_GATE, gate);
                a.put(LA_UP, up);
                d_h[..n * c].fill(0.0);
                let h2 = a.take(LA_H2, n * c);
                linear::linear_backward_input(&mut d_h[..n * c], &d_gate, w(L_GATE), n, c, f);
                wg.linear(r(L_GATE), None, &d_gate, &h2, n, c, f);
                linear::linear_backward_input(&mut d_h[..n * c], &d_up, w(L_UP), n, c, f);
                wg.linear(r(L_UP), None, &d_up, &h2, n, c, f);
                a.put(LA_H2, h2);
            }
        }
        // (Reused buffers: `d_ff` may be narrower than `d_model`, so they are resized, not cut.)
        let mut dx2 = std::mem::take(&mut d_sw);
        dx2.resize(n * c, 0.0);
        dx2.copy_from_slice(dy);
        let r2 = a.take(LA_R2, n);
        rmsnorm::rmsnorm_backward_input(&mut dx2, &d_h[..n * c], a.buf(LA_X2, n * c), w(L_N2), &r2, n, c);
        wg.rmsnorm(r(L_N2), &d_h[..n * c], a.buf(LA_X2, n * c), &r2, c);
        a.put(LA_R2, r2);
        // Attention branch.
        let mut d_atty = std::mem::take(&mut d_gate);
        d_atty.resize(n * c, 0.0);
        d_atty.fill(0.0);
        linear::linear_backward_input(&mut d_atty, &dx2, w(L_WO), n, c, c);
        wg.linear(r(L_WO), None, &dx2, a.buf(LA_ATTY, n * c), n, c, c);
        d_h.fill(0.0);
        let (qkv, att) = (a.take(LA_QKV, n * gr.row()), a.take(LA_ATT, b * nh * t * t));
        let full = a.take(LA_QKVX, if self.grouped() { n * 3 * c } else { 0 });
        attention::attention_backward(&mut d_h, &d_atty, if self.grouped() { &full } else { &qkv }, &att, b, t, c, nh);
        let mut d_grouped = a.take(LB_DQKVG, if self.grouped() { n * gr.row() } else { 0 });
        if self.grouped() {
            gqa::repeat_kv_backward(&mut d_grouped, &d_h, gr);
        }
        let d_qkv = if self.grouped() { &mut d_grouped } else { &mut d_h };
        rope::rope_backward_rows(d_qkv, t, gr.row(), c + gr.kv(), &RopeTable::with_inv_freq(t, &self.inv_freq));
        let mut d_h1 = d_atty;
        d_h1.fill(0.0);
        linear::linear_backward_input(&mut d_h1, d_qkv, w(L_QKV), n, c, gr.row());
        wg.linear(r(L_QKV), self.qkv_b.clone(), d_qkv, a.buf(LA_H1, n * c), n, c, gr.row());
        dx.copy_from_slice(&dx2);
        let r1 = a.take(LA_R1, n);
        rmsnorm::rmsnorm_backward_input(dx, &d_h1, x, w(L_N1), &r1, n, c);
        wg.rmsnorm(r(L_N1), &d_h1, x, &r1, c);
        for (slot, buf) in [
            (LA_QKV, qkv),
            (LA_QKVX, full),
            (LA_ATT, att),
            (LA_R1, r1),
            (LB_D1, dx2),
            (LB_D2, d_h1),
            (LB_D3, d_up),
            (LB_DQKV, d_h),
            (LB_DQKVG, d_grouped),
        ] {
            a.put(slot, buf);
        }
    }
}
