//! [`Backend`]: what the scheduler asks of a model with a paged key/value cache.

use std::collections::HashMap;

use anyhow::{bail, ensure, Result};
use tessera_kernels::model::ModelConfig;
use tessera_kernels::ops::paged_attention::PagedSeq;

/// One sequence's part of a forward step.
#[derive(Debug, Clone, Copy)]
pub struct SeqStep<'a> {
    /// The tokens to run now: a chunk of the prompt (prefill) or the token sampled last (decode).
    pub tokens: &'a [u32],
    /// The position of `tokens[0]` in the sequence: the cache holds positions `0..start` already
    /// (written by earlier steps, or by another sequence sharing those blocks).
    pub start: usize,
    /// The sequence's cache blocks in order: position `p` lives in block
    /// `block_table[p / block_size]`, slot `p % block_size`. Covers `0..start + tokens.len()`.
    pub block_table: &'a [u32],
    /// Whether the logits of the last of `tokens` are wanted (false for a prompt chunk that is not
    /// the prompt's last).
    pub want_logits: bool,
}

/// A model with a paged key/value cache of [`Backend::num_blocks`] blocks of
/// [`Backend::block_size`] positions (every layer's keys and values of a position sit in the same
/// block index). A block is written only through a sequence whose table names it; blocks shared
/// by several sequences (a common prompt prefix) are only read.
pub trait Backend: Send {
    /// Positions per cache block.
    fn block_size(&self) -> usize;
    /// Cache blocks in all.
    fn num_blocks(&self) -> usize;
    /// Logits per position.
    fn vocab_size(&self) -> usize;
    /// The longest sequence (prompt and output) the model takes.
    fn max_seq_len(&self) -> usize;
    /// Runs every sequence's `tokens` at positions `start..start + tokens.len()`, attending to
    /// positions `0..=p` through its block table, writes their keys and values into its blocks,
    /// and returns the logits (`vocab_size` each) of the last token of each sequence with
    /// `want_logits`, in batch order. The result for a sequence does not depend on what else is
    /// in the batch beyond floating-point summation order, which is fixed per backend.
    fn step(&mut self, batch: &[SeqStep<'_>]) -> Result<Vec<Vec<f32>>>;
    /// Runs `batch` as [`Backend::step`] does and returns, instead of each wanted row of logits,
    /// its greedy choice: the lowest index of the largest logit ([`super::sample::argmax`]). The
    /// engine calls it when every sequence wanting logits samples greedily without a repetition
    /// penalty; a GPU backend then moves token ids, not logits, to the host.
    fn step_greedy(&mut self, batch: &[SeqStep<'_>]) -> Result<Vec<u32>> {
        Ok(self.step(batch)?.iter().map(|l| super::sample::argmax(l)).collect())
    }
}

/// Checks a step against a model and a cache of `num_blocks` blocks of `block_size` positions,
/// before any kernel sees it; the error names the sequence (its index in the batch) and what is
/// wrong: no tokens, positions past the context, a token outside the vocabulary, a table too
/// short or naming a block past the cache, two sequences writing one block.
pub fn check_step(cfg: &ModelConfig, block_size: usize, num_blocks: usize, batch: &[SeqStep<'_>]) -> Result<()> {
    let (bs, blocks) = (block_size, num_blocks);
    let mut writer: HashMap<u32, usize> = HashMap::new();
    for (i, s) in batch.iter().enumerate() {
        let end = s.start + s.tokens.len();
        ensure!(!s.tokens.is_empty(), "sequence {i} of the step: no tokens to run");
        ensure!(end <= cfg.max_seq_len, "sequence {i}: positions up to {end} exceed the model's context of {}", cfg.max_seq_len);
        if let Some(t) = s.tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            bail!("sequence {i}: token {t} is outside the vocabulary of {}", cfg.vocab_size);
        }
        let need = end.div_ceil(bs);
        ensure!(s.block_table.len() >= need, "sequence {i}: {} positions need {need} blocks, its table has {}", end, s.block_table.len());
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

/// A step as the paged kernels take it: every sequence's tokens as consecutive rows, each
/// sequence's rows, and the rows whose logits are wanted (the last of each sequence that wants
/// them, in batch order).
pub struct StepRows<'a> {
    pub tokens: Vec<u32>,
    pub seqs: Vec<PagedSeq<'a>>,
    pub wanted: Vec<usize>,
}

impl<'a> StepRows<'a> {
    pub fn of(batch: &[SeqStep<'a>]) -> StepRows<'a> {
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
        StepRows { tokens, seqs, wanted }
    }
}

/// A backend that can run no step any more (a rank of a pipeline was lost): every step after
/// fails with it, and the server answers 503 from then on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the model's backend is lost: {0}")]
pub struct BackendLost(pub String);
