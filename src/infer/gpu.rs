//! [`GpuBackend`]: the inference [`Backend`] on one CUDA GPU — the model in bf16, its keys and
//! values in a paged cache on the device, fused decode kernels and CUDA graphs for decode steps
//! ([`tessera_kernels::cuda::decode`], docs/GPU.md "Decoding").

use std::sync::Arc;

use anyhow::{Context, Result};
use tessera_kernels::cuda::decode::{DecodeOptions, Decoder, StepBatch, StepSeq};
use tessera_kernels::cuda::Gpu;
use tessera_kernels::model::Model;

use super::{Backend, SeqStep};

/// A model decoding on one GPU.
pub struct GpuBackend {
    dec: Decoder,
}

impl GpuBackend {
    /// Opens GPU `ordinal` and uploads `model`'s `params` (rounded to bf16) with a cache of
    /// `opts.num_blocks` blocks of `opts.block_size` positions.
    pub fn new(ordinal: usize, model: &Model, params: &[f32], opts: DecodeOptions) -> Result<GpuBackend> {
        let gpu: Arc<Gpu> = Gpu::open(ordinal)?;
        let dec = Decoder::new(gpu, model, params, opts).context("preparing the model for GPU decoding")?;
        Ok(GpuBackend { dec })
    }

    /// The decoder (its device memory figures, its GPU).
    pub fn decoder(&self) -> &Decoder {
        &self.dec
    }

    /// Runs `batch` kernel by kernel with GPU timing marks: (what, ms, launches) per kind of
    /// kernel, in order of first appearance (for `gpu decode-bench --profile`).
    pub fn profile_step(&mut self, batch: &[SeqStep<'_>]) -> Result<Vec<(&'static str, f64, usize)>> {
        let sb = self.pack(batch)?;
        Ok(self.dec.profile(&sb)?)
    }

    fn pack(&self, batch: &[SeqStep<'_>]) -> Result<StepBatch> {
        let seqs: Vec<StepSeq> = batch
            .iter()
            .map(|s| StepSeq { tokens: s.tokens, start: s.start, block_table: s.block_table, want_logits: s.want_logits })
            .collect();
        Ok(StepBatch::pack(&self.dec, &seqs)?)
    }

    fn run(&mut self, batch: &[SeqStep<'_>]) -> Result<StepBatch> {
        let sb = self.pack(batch)?;
        self.dec.run(&sb)?;
        Ok(sb)
    }
}

impl Backend for GpuBackend {
    fn block_size(&self) -> usize {
        self.dec.opts.block_size
    }

    fn num_blocks(&self) -> usize {
        self.dec.opts.num_blocks
    }

    fn vocab_size(&self) -> usize {
        self.dec.cfg.vocab_size
    }

    fn max_seq_len(&self) -> usize {
        self.dec.cfg.max_seq_len
    }

    fn step(&mut self, batch: &[SeqStep<'_>]) -> Result<Vec<Vec<f32>>> {
        let sb = self.run(batch)?;
        Ok(self.dec.logits(&sb)?)
    }

    /// The greedy choices computed on the device: only the token ids cross to the host.
    fn step_greedy(&mut self, batch: &[SeqStep<'_>]) -> Result<Vec<u32>> {
        let sb = self.run(batch)?;
        Ok(self.dec.argmax(&sb)?)
    }
}
