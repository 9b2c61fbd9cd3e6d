//! [`RecomputeBackend`]: the reference [`Backend`]. Its "cache" holds the token at each
//! position instead of keys and values; a step writes each sequence's tokens into its blocks,
//! reads the whole sequence back through its block table, and computes the last position's
//! logits with [`Model::next_token_logits`] over the whole sequence. Slow (it recomputes every
//! position every step) but exactly the model's logits, and it checks the scheduler's side of the
//! seam: a block table naming a wrong, unwritten or overwritten block gives wrong tokens, which
//! are refused. The paged backends (`infer::cpu`, `infer::gpu`) are tested against it.

use anyhow::{bail, ensure, Result};
use tessera_kernels::model::{Model, Workspace};

use super::backend::{Backend, SeqStep};

/// The recomputing reference backend; see the module documentation.
pub struct RecomputeBackend {
    model: Model,
    params: Vec<f32>,
    ws: Workspace,
    block_size: usize,
    /// The token at each position of each block (`None`: never written).
    cache: Vec<Vec<Option<u32>>>,
}

impl RecomputeBackend {
    pub fn new(model: Model, params: Vec<f32>, block_size: usize, num_blocks: usize) -> Result<RecomputeBackend> {
        ensure!(block_size > 0 && num_blocks > 0, "block_size and num_blocks must be positive");
        ensure!(params.len() == model.num_params(), "{} parameters for a model of {}", params.len(), model.num_params());
        Ok(RecomputeBackend { model, params, ws: Workspace::default(), block_size, cache: vec![vec![None; block_size]; num_blocks] })
    }

    /// The sequence's tokens at positions `0..upto`, read through its block table.
    fn read_back(&self, s: &SeqStep<'_>, upto: usize) -> Result<Vec<u32>> {
        (0..upto)
            .map(|p| {
                let b = *s.block_table.get(p / self.block_size).ok_or_else(|| anyhow::anyhow!("position {p} is past the block table"))?;
                let slot = self.cache.get(b as usize).ok_or_else(|| anyhow::anyhow!("block {b} is outside the cache"))?;
                slot[p % self.block_size].ok_or_else(|| anyhow::anyhow!("position {p} (block {b}) was never written"))
            })
            .collect()
    }
}

impl Backend for RecomputeBackend {
    fn block_size(&self) -> usize {
        self.block_size
    }

    fn num_blocks(&self) -> usize {
        self.cache.len()
    }

    fn vocab_size(&self) -> usize {
        self.model.cfg.vocab_size
    }

    fn max_seq_len(&self) -> usize {
        self.model.cfg.max_seq_len
    }

    fn step(&mut self, batch: &[SeqStep<'_>]) -> Result<Vec<Vec<f32>>> {
        let mut out = Vec::new();
        for s in batch {
            let end = s.start + s.tokens.len();
            ensure!(end <= self.max_seq_len(), "position {end} is past the model's context of {}", self.max_seq_len());
            for (k, &t) in s.tokens.iter().enumerate() {
                let p = s.start + k;
                let Some(&b) = s.block_table.get(p / self.block_size) else { bail!("position {p} is past the block table") };
                self.cache[b as usize][p % self.block_size] = Some(t);
            }
            if s.want_logits {
                let window = self.read_back(s, end)?;
                ensure!(window[s.start..] == *s.tokens, "the block table reads back other tokens than were written");
                out.push(self.model.next_token_logits(&self.params, &window, &mut self.ws));
            }
        }
        Ok(out)
    }
}
