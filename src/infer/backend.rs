//! [`Backend`]: what the scheduler asks of a model with a paged key/value cache.

use anyhow::Result;

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
