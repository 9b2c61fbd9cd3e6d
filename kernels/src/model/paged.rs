//! Inference over a paged key/value cache: the model's forward on one decoding step — rows of
//! several sequences, each a run of positions after what the cache already holds — that writes
//! each row's keys and values into its sequence's cache blocks and attends over them
//! ([`crate::ops::paged_attention`]), and optional int8 weight-only linears ([`QuantMatrix`]):
//! every projection, the LM head and the MoE blocks' expert MLPs; routers, gates and norms stay
//! f32.
//!
//! The math is the training forward's ([`super::Model::loss`]) row by row: the same ops (norms,
//! linears, RoPE, GELU/SwiGLU, the MoE feed-forward routed as in evaluation), with attention
//! reading the cache instead of the window's q/k/v. So `forward_paged` on a prompt, in one
//! chunk or many, gives the logits [`super::Model::next_token_logits`] gives for it, to f32
//! summation order.

use std::ops::Range;

use super::{Arch, GptBlock, LlamaBlock, Model, ModelConfig};
use super::{FCP_B, FCP_W, FC_B, FC_W, LN1_B, LN1_W, LN2_B, LN2_W, PROJ_B, PROJ_W, QKV_B, QKV_W};
use super::{L_DOWN, L_GATE, L_N1, L_N2, L_QKV, L_UP, L_WO};
use crate::gemm::matmul;
use crate::layer::Acts;
use crate::ops::gqa::Groups;
use crate::ops::paged_attention::{self, PagedSeq};
use crate::ops::rope::{self, RopeTable};
use crate::ops::{embedding, gelu, layernorm, residual, rmsnorm, swiglu};
use crate::quant::{self, QuantMatrix, QuantUnit};

/// The keys and values of a run of layers (every layer of the model, or a pipeline stage's
/// blocks), in `num_blocks` blocks of `block_size` positions.
#[derive(Debug)]
pub struct KvCache {
    /// The model's layers this cache holds.
    layers: Range<usize>,
    num_blocks: usize,
    block_size: usize,
    /// Floats per position and layer, of keys (and of values): `n_kv_head · head_dim`.
    kv: usize,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl KvCache {
    /// A zeroed cache for `cfg`'s layers and key/value heads; the error names the product
    /// that does not fit in memory's address space.
    pub fn new(cfg: &ModelConfig, num_blocks: usize, block_size: usize) -> Result<KvCache, String> {
        KvCache::for_layers(cfg, 0..cfg.n_layer, num_blocks, block_size)
    }

    /// A zeroed cache of `layers` only (a pipeline stage's blocks): a rank holds its part of
    /// the cache, same block geometry as every other rank.
    pub fn for_layers(cfg: &ModelConfig, layers: Range<usize>, num_blocks: usize, block_size: usize) -> Result<KvCache, String> {
        if layers.start >= layers.end || layers.end > cfg.n_layer {
            return Err(format!(
                "a key/value cache of layers {layers:?}: expected a non-empty range within the model's {} layers",
                cfg.n_layer
            ));
        }
        let kv = cfg.n_kv_head * cfg.head_dim();
        let per_layer = num_blocks.checked_mul(block_size).and_then(|p| p.checked_mul(kv));
        let len = per_layer.and_then(|p| p.checked_mul(layers.len())).filter(|&l| l <= isize::MAX as usize / 8);
        let Some(len) = len.filter(|_| num_blocks > 0 && block_size > 0) else {
            return Err(format!(
                "a key/value cache of {num_blocks} blocks of {block_size} positions ({} layers of {kv} floats): expected \
                 positive sizes whose product fits in memory",
                layers.len()
            ));
        };
        Ok(KvCache { layers, num_blocks, block_size, kv, k: vec![0.0; len], v: vec![0.0; len] })
    }

    /// Bytes one block holds (keys and values of every layer).
    pub fn bytes_per_block(cfg: &ModelConfig, block_size: usize) -> usize {
        2 * 4 * cfg.n_layer * block_size * cfg.n_kv_head * cfg.head_dim()
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The model's layers this cache holds.
    pub fn layers(&self) -> Range<usize> {
        self.layers.clone()
    }

    /// Bytes of keys and values held.
    pub fn bytes(&self) -> usize {
        4 * (self.k.len() + self.v.len())
    }

    /// Layer `l`'s keys and values (`l` a layer of the model, within [`KvCache::layers`]).
    fn layer(&mut self, l: usize) -> (&mut [f32], &mut [f32]) {
        assert!(self.layers.contains(&l), "kv cache: layer {l}, the cache holds layers {:?}", self.layers);
        let len = self.num_blocks * self.block_size * self.kv;
        let i = l - self.layers.start;
        (&mut self.k[i * len..][..len], &mut self.v[i * len..][..len])
    }
}

/// A model's linear weights as int8 ([`QuantMatrix`]), per unit, keyed by the weight's
/// unit-relative offset: every block's attention projections, its dense MLP or its MoE
/// feed-forward's MLPs (each expert's, the shared expert's, the residual MLP's), and the LM head.
/// (Routers, the shared expert's gate, the residual mixer, norms and embeddings stay f32.)
#[derive(Debug, Default)]
pub struct QuantWeights {
    units: Vec<QuantUnit>,
}

impl QuantWeights {
    /// Bytes of the int8 matrices and their scales.
    pub fn bytes(&self) -> usize {
        self.units.iter().flat_map(|u| u.values()).map(QuantMatrix::bytes).sum()
    }

    /// The flat ranges the int8 matrices replace, for a model whose unit `u` starts at
    /// `units[u].start` (each unit's matrices are keyed by their offset in it).
    pub fn replaced(&self, units: &[Range<usize>]) -> Vec<Range<usize>> {
        let mut out: Vec<Range<usize>> = (self.units.iter().zip(units))
            .flat_map(|(q, u)| q.iter().map(move |(at, m)| u.start + at..u.start + at + m.shape().0 * m.shape().1))
            .collect();
        out.sort_by_key(|r| r.start);
        out
    }

    /// Floats replaced by int8 (the quantized matrices' sizes).
    pub fn numel(&self) -> usize {
        self.units.iter().flat_map(|u| u.values()).map(|m| m.shape().0 * m.shape().1).sum()
    }

    /// Unit `u`'s int8 linears (empty for a unit not quantized here).
    pub fn unit(&self, u: usize) -> Option<&QuantUnit> {
        self.units.get(u)
    }
}

/// A linear layer of a block: its weight `[ic, oc]` (unit-relative) and shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinearSpec {
    pub weight: Range<usize>,
    pub ic: usize,
    pub oc: usize,
    /// A linear of an MoE feed-forward's MLPs (an expert's, the shared expert's or the residual
    /// MLP's), not of the block's attention or dense MLP.
    pub moe: bool,
}

/// Which linears [`Model::quantize_int8_scope`] makes int8.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantScope {
    /// Every linear of [`PagedLayer::paged_linears`] and the LM head.
    All,
    /// All but the MoE feed-forwards' MLPs ([`LinearSpec::moe`]), which stay f32.
    Dense,
}

/// One unit's parameters, and its int8 linears if the model is quantized.
pub struct UnitWeights<'a> {
    pub p: &'a [f32],
    pub int8: Option<&'a QuantUnit>,
}

impl UnitWeights<'_> {
    /// `out = x · W (+ b)` through the int8 copy of `w` when there is one.
    fn linear(&self, out: &mut [f32], x: &[f32], w: &Range<usize>, b: Option<&Range<usize>>, ic: usize, oc: usize) {
        let bias = b.map(|r| &self.p[r.clone()]);
        quant::linear_forward(self.int8, w.start, out, x, &self.p[w.clone()], bias, ic, oc);
    }
}

/// What a block's paged forward needs besides its weights and input: the step's sequences, its
/// layer of the cache, the RoPE table (LLaMA), and scratch buffers.
pub struct PagedStep<'a> {
    pub seqs: &'a [PagedSeq<'a>],
    /// Each row's position.
    pub pos: &'a [usize],
    pub k: &'a mut [f32],
    pub v: &'a mut [f32],
    pub block_size: usize,
    pub rope: Option<&'a RopeTable>,
    pub scratch: &'a mut Acts,
}

/// Reusable memory of [`Model::forward_paged`].
#[derive(Debug, Default)]
pub struct PagedWorkspace {
    x: Vec<f32>,
    y: Vec<f32>,
    acts: Acts,
    rope: Option<RopeTable>,
}

/// Scratch slots of a block's paged forward.
const S_H: usize = 0;
const S_QKV: usize = 1;
const S_ATT: usize = 2;
const S_TMP: usize = 3;
const S_X2: usize = 4;
const S_FC: usize = 5;
const S_ACT: usize = 6;
const S_UP: usize = 7;
const S_MEAN: usize = 8;
const S_RSTD: usize = 9;

/// The attention half of a block on `h` = norm1(x): `x2 = x + wo(attend(rope(wqkv·h + b)))`,
/// writing this step's keys and values into the cache first.
#[allow(clippy::too_many_arguments)]
fn attention_half(
    w: &UnitWeights,
    h: &[f32],
    x: &[f32],
    (qkv_w, qkv_b): (&Range<usize>, Option<&Range<usize>>),
    (o_w, o_b): (&Range<usize>, Option<&Range<usize>>),
    gr: Groups,
    s: &mut PagedStep,
    x2: &mut [f32],
) {
    let (n, c) = (s.pos.len(), gr.c);
    let mut qkv = s.scratch.take(S_QKV, n * gr.row());
    w.linear(&mut qkv, h, qkv_w, qkv_b, c, gr.row());
    if let Some(table) = s.rope {
        rope::rope_forward_at(&mut qkv, |r| s.pos[r], gr.row(), c + gr.kv(), table);
    }
    paged_attention::write_kv(s.k, s.v, &qkv, s.seqs, s.block_size, gr);
    let mut att = s.scratch.take(S_ATT, n * c);
    paged_attention::paged_attention_forward(&mut att, &qkv, s.k, s.v, s.seqs, s.block_size, gr);
    let mut tmp = s.scratch.take(S_TMP, n * c);
    w.linear(&mut tmp, &att, o_w, o_b, c, c);
    residual::residual_forward(x2, x, &tmp);
    s.scratch.put(S_QKV, qkv);
    s.scratch.put(S_ATT, att);
    s.scratch.put(S_TMP, tmp);
}

/// A block's inference over a paged cache (every [`crate::layer::Layer`] is one: [`crate::layer::Layer::paged`]).
pub trait PagedLayer {
    /// The block's linear layers (what [`Model::quantize_int8`] quantizes), for width `c`.
    fn paged_linears(&self, c: usize) -> Vec<LinearSpec>;
    /// `y = block(x)` on a step's rows `x [n, c]`, writing their keys and values into the cache.
    fn forward_paged(&self, w: &UnitWeights, x: &[f32], s: &mut PagedStep, y: &mut [f32]);
}

impl PagedLayer for GptBlock {
    fn paged_linears(&self, c: usize) -> Vec<LinearSpec> {
        let dense = |weight: &Range<usize>, ic, oc| LinearSpec { weight: weight.clone(), ic, oc, moe: false };
        let mut l = vec![dense(&self.p[QKV_W], c, 3 * c), dense(&self.p[PROJ_W], c, c)];
        match &self.moe {
            Some(m) => l.extend(m.linears()),
            None => l.extend([dense(&self.p[FC_W], c, self.ff), dense(&self.p[FCP_W], self.ff, c)]),
        }
        l
    }

    /// `x2 = x + proj(attn(ln1(x)))`, `y = x2 + mlp(ln2(x2))` (or the experts) on a step's rows.
    fn forward_paged(&self, w: &UnitWeights, x: &[f32], s: &mut PagedStep, y: &mut [f32]) {
        let (p, n) = (w.p, s.pos.len());
        let c = x.len() / n;
        let gr = Groups { c, nh: self.nh, nkv: self.nh };
        let r = |k: usize| &p[self.p[k].clone()];
        let mut h = s.scratch.take(S_H, n * c);
        let (mut mean, mut rstd) = (s.scratch.take(S_MEAN, n), s.scratch.take(S_RSTD, n));
        layernorm::layernorm_forward(&mut h, &mut mean, &mut rstd, x, r(LN1_W), r(LN1_B), n, c);
        let mut x2 = s.scratch.take(S_X2, n * c);
        let o = (&self.p[PROJ_W], Some(&self.p[PROJ_B]));
        attention_half(w, &h, x, (&self.p[QKV_W], Some(&self.p[QKV_B])), o, gr, s, &mut x2);
        layernorm::layernorm_forward(&mut h, &mut mean, &mut rstd, &x2, r(LN2_W), r(LN2_B), n, c);
        let mut tmp = s.scratch.take(S_TMP, n * c);
        match &self.moe {
            Some(m) => m.forward_with(p, w.int8, &h, &mut tmp, &mut s.scratch.moe, None),
            None => {
                let (f, mut fc, mut act) = (self.ff, s.scratch.take(S_FC, n * self.ff), s.scratch.take(S_ACT, n * self.ff));
                w.linear(&mut fc, &h, &self.p[FC_W], Some(&self.p[FC_B]), c, f);
                gelu::gelu_forward(&mut act, &fc);
                w.linear(&mut tmp, &act, &self.p[FCP_W], Some(&self.p[FCP_B]), f, c);
                s.scratch.put(S_FC, fc);
                s.scratch.put(S_ACT, act);
            }
        }
        residual::residual_forward(y, &x2, &tmp);
        for (slot, buf) in [(S_H, h), (S_MEAN, mean), (S_RSTD, rstd), (S_X2, x2), (S_TMP, tmp)] {
            s.scratch.put(slot, buf);
        }
    }
}

impl PagedLayer for LlamaBlock {
    fn paged_linears(&self, c: usize) -> Vec<LinearSpec> {
        let dense = |weight: &Range<usize>, ic, oc| LinearSpec { weight: weight.clone(), ic, oc, moe: false };
        let mut l = vec![dense(&self.p[L_QKV], c, self.groups.row()), dense(&self.p[L_WO], c, c)];
        match &self.moe {
            Some(m) => l.extend(m.linears()),
            None => {
                let f = self.ff;
                l.extend([dense(&self.p[L_GATE], c, f), dense(&self.p[L_UP], c, f), dense(&self.p[L_DOWN], f, c)]);
            }
        }
        l
    }

    /// `x2 = x + wo(attn(rope(wqkv·rms1(x))))`, `y = x2 + swiglu-mlp(rms2(x2))` (or the
    /// experts) on a step's rows.
    fn forward_paged(&self, w: &UnitWeights, x: &[f32], s: &mut PagedStep, y: &mut [f32]) {
        let (p, n, c) = (w.p, s.pos.len(), self.groups.c);
        let r = |k: usize| &p[self.p[k].clone()];
        let mut h = s.scratch.take(S_H, n * c);
        let mut rstd = s.scratch.take(S_RSTD, n);
        rmsnorm::rmsnorm_forward(&mut h, &mut rstd, x, r(L_N1), n, c, self.eps);
        let mut x2 = s.scratch.take(S_X2, n * c);
        attention_half(w, &h, x, (&self.p[L_QKV], self.qkv_b.as_ref()), (&self.p[L_WO], None), self.groups, s, &mut x2);
        rmsnorm::rmsnorm_forward(&mut h, &mut rstd, &x2, r(L_N2), n, c, self.eps);
        let mut tmp = s.scratch.take(S_TMP, n * c);
        match &self.moe {
            Some(m) => m.forward_with(p, w.int8, &h, &mut tmp, &mut s.scratch.moe, None),
            None => {
                let f = self.ff;
                let (mut gate, mut up, mut act) = (s.scratch.take(S_FC, n * f), s.scratch.take(S_UP, n * f), s.scratch.take(S_ACT, n * f));
                w.linear(&mut gate, &h, &self.p[L_GATE], None, c, f);
                w.linear(&mut up, &h, &self.p[L_UP], None, c, f);
                swiglu::swiglu_forward(&mut act, &gate, &up);
                w.linear(&mut tmp, &act, &self.p[L_DOWN], None, f, c);
                for (slot, buf) in [(S_FC, gate), (S_UP, up), (S_ACT, act)] {
                    s.scratch.put(slot, buf);
                }
            }
        }
        residual::residual_forward(y, &x2, &tmp);
        for (slot, buf) in [(S_H, h), (S_RSTD, rstd), (S_X2, x2), (S_TMP, tmp)] {
            s.scratch.put(slot, buf);
        }
    }
}

/// Where a paged forward finds its parameters: a window of the flat buffer that starts at flat
/// offset `base` (the whole buffer at 0; a pipeline stage's blocks, which are contiguous units,
/// or unit 0 alone), and the int8 copies of its linears when it has them.
#[derive(Clone, Copy)]
pub struct ParamsAt<'a> {
    pub params: &'a [f32],
    pub base: usize,
    pub int8: Option<&'a QuantWeights>,
}

impl<'a> ParamsAt<'a> {
    /// The whole flat buffer.
    pub fn whole(params: &'a [f32], int8: Option<&'a QuantWeights>) -> ParamsAt<'a> {
        ParamsAt { params, base: 0, int8 }
    }
}

impl Model {
    /// The flat range of units `units` (contiguous: unit 0, then the blocks in order).
    pub fn units_range(&self, units: Range<usize>) -> Range<usize> {
        self.units[units.start].start..self.units[units.end - 1].end
    }

    /// Unit `u`'s weights in `at`.
    ///
    /// # Panics
    /// If `at` does not hold unit `u`.
    fn unit_weights<'a>(&self, at: &ParamsAt<'a>, u: usize) -> UnitWeights<'a> {
        let r = &self.units[u];
        assert!(
            r.start >= at.base && r.end - at.base <= at.params.len(),
            "paged forward: unit {u} ({r:?}) is not in the parameters held ({} from {})",
            at.params.len(),
            at.base
        );
        UnitWeights { p: &at.params[r.start - at.base..r.end - at.base], int8: at.int8.and_then(|q| q.units.get(u)) }
    }

    /// Every linear weight of the model (blocks' projections and MLPs, every expert's, the LM
    /// head) as int8 with per-output-channel scales, from the flat `params`.
    pub fn quantize_int8(&self, params: &[f32]) -> QuantWeights {
        self.quantize_int8_units(&ParamsAt::whole(params, None), 0..self.units.len())
    }

    /// The int8 linears of `units` only (a pipeline stage's), from the parameters `at` holds.
    pub fn quantize_int8_units(&self, at: &ParamsAt, units: Range<usize>) -> QuantWeights {
        self.quantize_int8_scope(at, units, QuantScope::All)
    }

    /// Block `l`'s linear layers, weights relative to its unit (what int8 quantizes).
    pub fn block_linears(&self, l: usize) -> Vec<LinearSpec> {
        self.blocks[l].paged().paged_linears(self.cfg.d_model)
    }

    /// [`Model::quantize_int8_units`] of the linears `scope` names.
    pub fn quantize_int8_scope(&self, at: &ParamsAt, units: Range<usize>, scope: QuantScope) -> QuantWeights {
        let c = self.cfg.d_model;
        let mut q = vec![QuantUnit::new(); self.units.len()];
        for u in units {
            let p = self.unit_weights(at, u).p;
            if u == 0 {
                let head = self.embed.head.clone();
                q[0].insert(head.start, QuantMatrix::from_out_in(&p[head], self.cfg.vocab_size, c));
                continue;
            }
            for l in self.block_linears(u - 1).into_iter().filter(|l| scope == QuantScope::All || !l.moe) {
                q[u].insert(l.weight.start, QuantMatrix::from_in_out(&p[l.weight.clone()], l.ic, l.oc));
            }
        }
        QuantWeights { units: q }
    }

    /// Each of a step's `n` rows' position (`seqs` cover the rows).
    ///
    /// # Panics
    /// If a row has no sequence or is past the model's context.
    pub fn paged_positions(&self, n: usize, seqs: &[PagedSeq]) -> Vec<usize> {
        let mut pos = vec![usize::MAX; n];
        for s in seqs {
            s.rows.clone().for_each(|r| pos[r] = s.pos(r));
        }
        assert!(pos.iter().all(|&p| p < self.cfg.max_seq_len), "forward_paged: a row without a sequence, or past the context");
        pos
    }

    /// One decoding step: `tokens` are the rows of `seqs` (each sequence's run of positions);
    /// writes every row's keys and values into `cache` and returns the logits `[v]` of each of
    /// `logit_rows`, concatenated. MoE blocks route as in evaluation. The same as
    /// [`Model::embed_paged`], [`Model::blocks_paged`] over every block and [`Model::head_paged`],
    /// which pipeline stages run apart.
    ///
    /// # Panics
    /// If the sequences do not cover `tokens` in order, a position is past the model's context,
    /// a token is outside the vocabulary, or a block table is too short or names a block past
    /// the cache: callers (`infer::cpu`) validate a step first.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_paged(
        &self,
        params: &[f32],
        int8: Option<&QuantWeights>,
        cache: &mut KvCache,
        tokens: &[u32],
        seqs: &[PagedSeq],
        logit_rows: &[usize],
        ws: &mut PagedWorkspace,
    ) -> Vec<f32> {
        let at = ParamsAt::whole(params, int8);
        let pos = self.paged_positions(tokens.len(), seqs);
        let mut x = std::mem::take(&mut ws.x);
        self.embed_paged(&at, tokens, &pos, &mut x);
        self.blocks_paged(&at, 0..self.blocks.len(), cache, seqs, &pos, &mut x, ws);
        let logits = self.head_paged(&at, &x, logit_rows);
        ws.x = x;
        logits
    }

    /// The embeddings of a step's rows (`tokens` at positions `pos`) into `x [n, c]`; `at`
    /// holds unit 0.
    pub fn embed_paged(&self, at: &ParamsAt, tokens: &[u32], pos: &[usize], x: &mut Vec<f32>) {
        let c = self.cfg.d_model;
        x.resize(tokens.len() * c, 0.0);
        let (e, p0) = (&self.embed, self.unit_weights(at, 0).p);
        embedding::embedding_forward_at(x, tokens, |r| pos[r], &p0[e.wte.clone()], e.wpe.clone().map(|r| &p0[r]), c);
    }

    /// `blocks` of the model on the stream `x [n, c]` of a step's rows (their positions `pos`),
    /// in place: each block writes the rows' keys and values into its layer of `cache` and
    /// attends over it. `at` holds the blocks' units, `cache` their layers.
    #[allow(clippy::too_many_arguments)]
    pub fn blocks_paged(
        &self,
        at: &ParamsAt,
        blocks: Range<usize>,
        cache: &mut KvCache,
        seqs: &[PagedSeq],
        pos: &[usize],
        x: &mut Vec<f32>,
        ws: &mut PagedWorkspace,
    ) {
        if self.cfg.arch == Arch::Llama && ws.rope.is_none() {
            let inv = rope::inv_freq(self.cfg.head_dim(), self.cfg.rope_theta, self.cfg.rope_scaling.as_ref());
            ws.rope = Some(RopeTable::with_inv_freq(self.cfg.max_seq_len, &inv));
        }
        let mut y = std::mem::take(&mut ws.y);
        y.resize(x.len(), 0.0);
        let block_size = cache.block_size;
        for l in blocks {
            let (k, v) = cache.layer(l);
            let mut step = PagedStep { seqs, pos, k, v, block_size, rope: ws.rope.as_ref(), scratch: &mut ws.acts };
            self.blocks[l].paged().forward_paged(&self.unit_weights(at, l + 1), x, &mut step, &mut y);
            std::mem::swap(x, &mut y);
        }
        ws.y = y;
    }

    /// Final norm and LM head of the stream's `rows` (`x [n, c]`): logits `[rows.len(), v]`;
    /// `at` holds unit 0.
    pub fn head_paged(&self, at: &ParamsAt, x: &[f32], rows: &[usize]) -> Vec<f32> {
        let w = self.unit_weights(at, 0);
        let (m, c, v) = (rows.len(), self.cfg.d_model, self.cfg.vocab_size);
        let e = &self.embed;
        let picked: Vec<f32> = rows.iter().flat_map(|&r| x[r * c..(r + 1) * c].iter().copied()).collect();
        let mut xn = vec![0.0; m * c];
        let (mut mean, mut rstd) = (vec![0.0; m], vec![0.0; m]);
        match e.norm_b.clone() {
            Some(b) => layernorm::layernorm_forward(&mut xn, &mut mean, &mut rstd, &picked, &w.p[e.norm_w.clone()], &w.p[b], m, c),
            None => rmsnorm::rmsnorm_forward(&mut xn, &mut rstd, &picked, &w.p[e.norm_w.clone()], m, c, self.cfg.norm_eps),
        }
        let mut logits = vec![0.0; m * v];
        match w.int8.and_then(|q| q.get(&e.head.start)) {
            Some(q) => q.forward(&mut logits, &xn, None, m),
            None => matmul(&mut logits, &xn, &w.p[e.head.clone()], m, c, v, false, true, 0.0),
        }
        logits
    }
}
