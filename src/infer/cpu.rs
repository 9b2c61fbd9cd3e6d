//! [`CpuBackend`]: the CPU models (GPT-2, the LLaMA family with grouped-query attention and
//! RoPE, their mixture-of-experts blocks) behind [`Backend`], over a paged key/value cache in
//! host memory, with f32 or int8 weight-only linears. The math is
//! `tessera_kernels::model::paged`; this file owns the memory and checks each step the
//! scheduler hands it before the kernels see it.

use std::collections::HashMap;

use anyhow::{bail, ensure, Result};
use tessera_kernels::model::paged::{KvCache, PagedWorkspace, QuantWeights};
use tessera_kernels::model::Model;
use tessera_kernels::ops::paged_attention::PagedSeq;

use super::backend::{Backend, SeqStep};

/// How the linear layers' weights are held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinearFormat {
    /// The parameters as they are.
    F32,
    /// Int8 with one scale per output channel (attention and dense-MLP projections, LM head;
    /// experts, routers and norms stay f32).
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

/// A model, its parameters and its paged key/value cache on the CPU.
pub struct CpuBackend {
    model: Model,
    params: Vec<f32>,
    int8: Option<QuantWeights>,
    cache: KvCache,
    ws: PagedWorkspace,
}

impl CpuBackend {
    /// Refuses what it cannot run as the model computes it: parameters of another size, and
    /// experts that drop tokens for capacity (a token's routing would then depend on the other
    /// tokens of the step, which a cache of past positions cannot reproduce).
    pub fn new(model: Model, params: Vec<f32>, opts: CpuOptions) -> Result<CpuBackend> {
        ensure!(
            params.len() == model.num_params(),
            "{} parameters for a model of {}: the checkpoint does not match its configuration",
            params.len(),
            model.num_params()
        );
        if let Some(cap) = model.cfg.moe.as_ref().and_then(|m| m.capacity).filter(|c| c.drop_tokens) {
            bail!(
                "the model's experts drop tokens over capacity (`drop_tokens` with eval_capacity_factor {}): inference routes \
                 each token alone and cannot reproduce that; serve a dropless model (`drop_tokens: false`)",
                cap.eval_factor
            );
        }
        let cache = KvCache::new(&model.cfg, opts.num_blocks, opts.block_size).map_err(anyhow::Error::msg)?;
        let int8 = (opts.weights == LinearFormat::Int8).then(|| model.quantize_int8(&params));
        Ok(CpuBackend { model, params, int8, cache, ws: PagedWorkspace::default() })
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The int8 weights, when the backend holds them.
    pub fn int8(&self) -> Option<&QuantWeights> {
        self.int8.as_ref()
    }

    /// Checks a step against the model and the cache; the error names the sequence (its index
    /// in the batch) and what is wrong.
    fn validate(&self, batch: &[SeqStep<'_>]) -> Result<()> {
        let (bs, blocks, cfg) = (self.cache.block_size(), self.cache.num_blocks(), &self.model.cfg);
        let mut writer: HashMap<u32, usize> = HashMap::new();
        for (i, s) in batch.iter().enumerate() {
            let end = s.start + s.tokens.len();
            ensure!(!s.tokens.is_empty(), "sequence {i} of the step: no tokens to run");
            ensure!(end <= cfg.max_seq_len, "sequence {i}: positions up to {end} exceed the model's context of {}", cfg.max_seq_len);
            if let Some(t) = s.tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
                bail!("sequence {i}: token {t} is outside the vocabulary of {}", cfg.vocab_size);
            }
            let need = end.div_ceil(bs);
            ensure!(
                s.block_table.len() >= need,
                "sequence {i}: {} positions need {need} blocks, its table has {}",
                end,
                s.block_table.len()
            );
            if let Some(b) = s.block_table[..need].iter().find(|&&b| b as usize >= blocks) {
                bail!("sequence {i}: block {b} is past the cache's {blocks} blocks");
            }
            for &b in &s.block_table[s.start / bs..need] {
                if let Some(j) = writer.insert(b, i).filter(|&j| j != i) {
                    bail!("sequences {j} and {i} of the step both write block {b}");
                }
            }
        }
        Ok(())
    }
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
        self.validate(batch)?;
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let tokens: Vec<u32> = batch.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        let (mut seqs, mut wanted, mut row) = (Vec::with_capacity(batch.len()), Vec::new(), 0);
        for s in batch {
            let rows = row..row + s.tokens.len();
            row = rows.end;
            if s.want_logits {
                wanted.push(rows.end - 1);
            }
            seqs.push(PagedSeq { rows, start: s.start, table: s.block_table });
        }
        let logits = self.model.forward_paged(&self.params, self.int8.as_ref(), &mut self.cache, &tokens, &seqs, &wanted, &mut self.ws);
        Ok(logits.chunks_exact(self.model.cfg.vocab_size).map(<[f32]>::to_vec).collect())
    }
}

#[cfg(test)]
#[path = "cpu_tests.rs"]
mod tests;
