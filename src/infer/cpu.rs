//! [`CpuBackend`]: the CPU models (GPT-2, the LLaMA family with grouped-query attention and
//! RoPE, their mixture-of-experts blocks) behind [`Backend`], over a paged key/value cache in
//! host memory, with f32 or int8 weight-only linears. The math is
//! `tessera_kernels::model::paged`; this file owns the memory and checks each step the
//! scheduler hands it before the kernels see it.

use anyhow::{bail, ensure, Result};
use tessera_kernels::model::paged::{KvCache, PagedWorkspace, ParamsAt, QuantScope, QuantWeights};
use tessera_kernels::model::Model;

use super::backend::{check_step, Backend, SeqStep, StepRows};

/// How the linear layers' weights are held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinearFormat {
    /// The parameters as they are.
    F32,
    /// Int8 with one scale per output channel: attention projections, dense MLPs, every MoE
    /// expert's MLP (and the shared expert's and residual MLP's), the LM head. Routers, the
    /// shared expert's gate, the residual mixer, norms and embeddings stay f32.
    Int8,
}

impl std::str::FromStr for LinearFormat {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "f32" => Ok(LinearFormat::F32),
            "int8" => Ok(LinearFormat::Int8),
            _ => bail!("weight format `{s}`: expected `f32` or `int8`"),
        }
    }
}

/// The cache's geometry and the weights' format.
#[derive(Clone, Copy, Debug)]
pub struct CpuOptions {
    pub block_size: usize,
    pub num_blocks: usize,
    pub weights: LinearFormat,
}

/// Refuses what no CPU backend can run as the model computes it: parameters of another size,
/// and experts that drop tokens for capacity (a token's routing would then depend on the other
/// tokens of the step, which a cache of past positions cannot reproduce).
pub fn check_servable(model: &Model, params: usize) -> Result<()> {
    ensure!(
        params == model.num_params(),
        "{params} parameters for a model of {}: the checkpoint does not match its configuration",
        model.num_params()
    );
    refuse_dropping_experts(model)
}

/// Refuses experts that drop tokens for capacity (see [`check_servable`]).
pub fn refuse_dropping_experts(model: &Model) -> Result<()> {
    if let Some(cap) = model.cfg.moe.as_ref().and_then(|m| m.capacity).filter(|c| c.drop_tokens) {
        bail!(
            "the model's experts drop tokens over capacity (`drop_tokens` with eval_capacity_factor {}): inference routes \
             each token alone and cannot reproduce that; serve a dropless model (`drop_tokens: false`)",
            cap.eval_factor
        );
    }
    Ok(())
}

/// A model, its parameters and its paged key/value cache on the CPU.
pub struct CpuBackend {
    model: Model,
    params: Vec<f32>,
    int8: Option<QuantWeights>,
    /// Bytes of `params` given back to the system under int8 ([`release_replaced`]).
    released: usize,
    cache: KvCache,
    ws: PagedWorkspace,
}

impl CpuBackend {
    /// Refuses what it cannot run ([`check_servable`]).
    pub fn new(model: Model, params: Vec<f32>, opts: CpuOptions) -> Result<CpuBackend> {
        CpuBackend::with_scope(model, params, opts, QuantScope::All)
    }

    /// [`CpuBackend::new`] whose int8 weights (with [`LinearFormat::Int8`]) are the linears
    /// `scope` names (`benches/decode_cpu.rs` compares int8 experts with f32 ones).
    pub fn with_scope(model: Model, mut params: Vec<f32>, opts: CpuOptions, scope: QuantScope) -> Result<CpuBackend> {
        check_servable(&model, params.len())?;
        let cache = KvCache::new(&model.cfg, opts.num_blocks, opts.block_size).map_err(anyhow::Error::msg)?;
        let all = 0..model.units().len();
        let int8 = (opts.weights == LinearFormat::Int8).then(|| model.quantize_int8_scope(&ParamsAt::whole(&params, None), all, scope));
        let released = int8.as_ref().map_or(0, |q| release_replaced(&model, &mut params, q));
        Ok(CpuBackend { model, params, int8, released, cache, ws: PagedWorkspace::default() })
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The int8 weights, when the backend holds them.
    pub fn int8(&self) -> Option<&QuantWeights> {
        self.int8.as_ref()
    }

    /// Bytes of weights held: the f32 parameters less the pages given back under int8, and
    /// the int8 copies with their scales.
    pub fn weight_bytes(&self) -> usize {
        4 * self.params.len() - self.released + self.int8.as_ref().map_or(0, QuantWeights::bytes)
    }
}

/// Gives the whole pages of `params` that only int8-replaced matrices occupy back to the system
/// (`madvise(MADV_DONTNEED)`: they read as zeros from then on, and the int8 path never reads
/// them), so int8 holds about a quarter of f32's bytes rather than both. The token embedding
/// stays: the embedding reads it as f32 (a tied LM head is quantized from it). Returns the
/// bytes given back.
fn release_replaced(model: &Model, params: &mut [f32], q: &QuantWeights) -> usize {
    let keep = model.layout().get("wte.weight").map_or(0..0, |s| s.range());
    // SAFETY: sysconf only reads a system constant.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096).max(4096);
    let base = params.as_mut_ptr() as usize;
    let mut released = 0;
    for r in q.replaced(model.units()) {
        if r.start < keep.end && keep.start < r.end {
            continue;
        }
        let (lo, hi) = ((base + 4 * r.start).next_multiple_of(page), (base + 4 * r.end) / page * page);
        if hi <= lo {
            continue;
        }
        // SAFETY: [lo, hi) lies inside `params` (rounded inwards to pages), which this function
        // borrows mutably: no reference into it is alive, and MADV_DONTNEED on private memory
        // only replaces those pages' contents with zeros, as a write of zeros would.
        if unsafe { libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_DONTNEED) } == 0 {
            released += hi - lo;
        }
    }
    released
}

impl Backend for CpuBackend {
    fn block_size(&self) -> usize {
        self.cache.block_size()
    }

    fn num_blocks(&self) -> usize {
        self.cache.num_blocks()
    }

    fn vocab_size(&self) -> usize {
        self.model.cfg.vocab_size
    }

    fn max_seq_len(&self) -> usize {
        self.model.cfg.max_seq_len
    }

    fn step(&mut self, batch: &[SeqStep<'_>]) -> Result<Vec<Vec<f32>>> {
        check_step(&self.model.cfg, self.cache.block_size(), self.cache.num_blocks(), batch)?;
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let rows = StepRows::of(batch);
        let logits = self.model.forward_paged(
            &self.params,
            self.int8.as_ref(),
            &mut self.cache,
            &rows.tokens,
            &rows.seqs,
            &rows.wanted,
            &mut self.ws,
        );
        Ok(logits.chunks_exact(self.model.cfg.vocab_size).map(<[f32]>::to_vec).collect())
    }
}

#[cfg(test)]
#[path = "cpu_tests.rs"]
pub(crate) mod tests;
