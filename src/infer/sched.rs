//! [`Scheduler`]: continuous batching over a [`BlockPool`]. Every step it plans what each
//! sequence runs: the running ones first (oldest first: one token each when decoding, a chunk of
//! the prompt when prefilling), then new ones from the queue in arrival order while the step's
//! token budget and free blocks last (chunked prefill: a long prompt takes several steps). When
//! the blocks run out, the newest running sequence is preempted: its blocks are released and it
//! goes back to the head of the queue, to be computed again from its tokens (recompute).
//!
//! Why nothing starves: the oldest running sequence is planned first with the whole budget and
//! may preempt every other, and a sequence is only accepted if it fits the pool alone, so it
//! always advances; the queue is served in arrival order, and a preempted sequence goes back
//! before every later arrival.
//!
//! Prefix sharing: a block is registered in the pool's prefix cache once all its positions are
//! computed; a sequence entering the batch takes the cached blocks of its leading full blocks
//! (never its last token's block: it must compute at least one token to get logits).

use std::collections::VecDeque;

use super::blocks::{BlockHash, BlockPool};

/// A request's id, given by the caller.
pub type SeqId = u64;

/// Limits of one step.
#[derive(Debug, Clone, Copy)]
pub struct SchedConfig {
    /// Tokens run in one step, all sequences together (decode tokens and prompt chunks).
    pub max_batch_tokens: usize,
    /// Sequences in the batch at once.
    pub max_seqs: usize,
    /// The longest sequence (prompt and output) the model takes.
    pub max_seq_len: usize,
}

/// Why a request is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt ({prompt} tokens) and max_tokens ({max_tokens}) together exceed the model's context of {max_seq_len} tokens")]
    TooLong { prompt: usize, max_tokens: usize, max_seq_len: usize },
    #[error("max_tokens must be at least 1")]
    NoTokens,
    #[error("token id {token} is outside the model's vocabulary of {vocab_size}")]
    TokenOutOfRange { token: u32, vocab_size: usize },
    #[error("request id {0} is in use")]
    DuplicateId(SeqId),
}

/// One sequence's part of a step: run `tokens[start..start + len]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Work {
    pub id: SeqId,
    pub start: usize,
    pub len: usize,
    /// The chunk ends at the sequence's last token: its logits give the next token.
    pub want_logits: bool,
}

/// What a step runs, and the sequences preempted to make room for it.
#[derive(Debug, Default, Clone)]
pub struct Plan {
    pub work: Vec<Work>,
    pub preempted: Vec<SeqId>,
    /// Positions of the sequences admitted in this step taken from the prefix cache.
    pub cached_tokens: usize,
}

#[derive(Debug)]
struct Seq {
    id: SeqId,
    tokens: Vec<u32>,
    /// Positions whose keys and values are in the cache.
    computed: usize,
    blocks: Vec<u32>,
    /// Prefix-cache keys of `blocks[..hashes.len()]` (full, computed).
    hashes: Vec<BlockHash>,
}

/// The continuous-batching scheduler; see the module documentation.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedConfig,
    pool: BlockPool,
    /// Admitted, oldest first.
    running: Vec<Seq>,
    /// Not admitted (new, or preempted), in arrival order.
    waiting: VecDeque<Seq>,
}

impl Scheduler {
    pub fn new(cfg: SchedConfig, pool: BlockPool) -> Scheduler {
        assert!(cfg.max_batch_tokens > 0 && cfg.max_seqs > 0, "a step must run something: {cfg:?}");
        Scheduler { cfg, pool, running: Vec::new(), waiting: VecDeque::new() }
    }

    pub fn config(&self) -> &SchedConfig {
        &self.cfg
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Queues a request of `prompt` that may grow by `max_tokens`; refused if it could never
    /// run (longer than the context, or needing more blocks than the pool has).
    pub fn add(&mut self, id: SeqId, prompt: Vec<u32>, max_tokens: usize) -> Result<(), AdmitError> {
        if prompt.is_empty() {
            return Err(AdmitError::EmptyPrompt);
        }
        if max_tokens == 0 {
            return Err(AdmitError::NoTokens);
        }
        let bs = self.pool.block_size();
        let max_len = self.cfg.max_seq_len.min(self.pool.num_blocks() * bs);
        if prompt.len() + max_tokens > max_len {
            return Err(AdmitError::TooLong { prompt: prompt.len(), max_tokens, max_seq_len: max_len });
        }
        if self.find(id).is_some() {
            return Err(AdmitError::DuplicateId(id));
        }
        self.waiting.push_back(Seq { id, tokens: prompt, computed: 0, blocks: Vec::new(), hashes: Vec::new() });
        Ok(())
    }

    fn find(&self, id: SeqId) -> Option<&Seq> {
        self.running.iter().chain(self.waiting.iter()).find(|s| s.id == id)
    }

    /// The sequence's tokens (prompt and output so far).
    pub fn tokens(&self, id: SeqId) -> &[u32] {
        &self.find(id).expect("unknown sequence").tokens
    }

    /// The sequence's block table.
    pub fn block_table(&self, id: SeqId) -> &[u32] {
        &self.find(id).expect("unknown sequence").blocks
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    /// Plans the next step (see the module documentation). Empty when nothing waits or runs.
    pub fn schedule(&mut self) -> Plan {
        let mut plan = Plan::default();
        let mut budget = self.cfg.max_batch_tokens;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let s = &self.running[i];
            let (start, n) = (s.computed, (s.tokens.len() - s.computed).min(budget));
            if !self.make_room(i, start + n, &mut plan) {
                break; // sequence `i` preempted itself: it was the newest
            }
            let s = &mut self.running[i];
            grow(&mut self.pool, s, start + n);
            plan.work.push(Work { id: s.id, start, len: n, want_logits: start + n == s.tokens.len() });
            budget -= n;
            i += 1;
        }
        if plan.preempted.is_empty() {
            self.admit(&mut budget, &mut plan);
        }
        plan
    }

    /// Frees blocks until running sequence `i` can cover `upto` positions, preempting the newest
    /// running sequences; false if `i` itself had to go.
    fn make_room(&mut self, i: usize, upto: usize, plan: &mut Plan) -> bool {
        let bs = self.pool.block_size();
        let need = upto.div_ceil(bs).saturating_sub(self.running[i].blocks.len());
        while self.pool.num_free() < need {
            let victim = self.running.len() - 1;
            self.preempt(victim, plan);
            if victim == i {
                return false;
            }
        }
        true
    }

    fn preempt(&mut self, i: usize, plan: &mut Plan) {
        let mut s = self.running.remove(i);
        for &b in &s.blocks {
            self.pool.release(b);
        }
        s.blocks.clear();
        s.hashes.clear();
        s.computed = 0;
        plan.preempted.push(s.id);
        self.waiting.push_front(s);
    }

    /// Admits queued sequences in order while the budget, the batch size and the blocks allow.
    fn admit(&mut self, budget: &mut usize, plan: &mut Plan) {
        let bs = self.pool.block_size();
        while *budget > 0 && self.running.len() < self.cfg.max_seqs {
            let Some(mut s) = self.waiting.pop_front() else { break };
            self.take_cached_prefix(&mut s);
            let cached = s.computed;
            let n = (s.tokens.len() - s.computed).min(*budget);
            let need = (s.computed + n).div_ceil(bs) - s.blocks.len();
            if self.pool.num_free() < need {
                for &b in &s.blocks {
                    self.pool.release(b);
                }
                s.blocks.clear();
                s.hashes.clear();
                s.computed = 0;
                self.waiting.push_front(s);
                break;
            }
            let start = s.computed;
            grow(&mut self.pool, &mut s, start + n);
            plan.work.push(Work { id: s.id, start, len: n, want_logits: start + n == s.tokens.len() });
            *budget -= n;
            plan.cached_tokens += cached;
            self.running.push(s);
        }
    }

    /// Points the new sequence's leading full blocks at cached ones holding the same prefix.
    fn take_cached_prefix(&mut self, s: &mut Seq) {
        let bs = self.pool.block_size();
        let full = (s.tokens.len() - 1) / bs;
        for k in 0..full {
            let parent = s.hashes.last().copied();
            match self.pool.lookup(parent, &s.tokens[k * bs..(k + 1) * bs]) {
                Some((b, h)) => {
                    s.blocks.push(b);
                    s.hashes.push(h);
                }
                None => break,
            }
        }
        s.computed = s.blocks.len() * bs;
    }

    /// Records a step's outcome: its positions are computed (full blocks enter the prefix cache),
    /// and each sequence that wanted logits takes its sampled token from `sampled` (called with
    /// the sequence's id, in plan order).
    pub fn complete(&mut self, plan: &Plan, mut sampled: impl FnMut(SeqId) -> Option<u32>) {
        let bs = self.pool.block_size();
        for w in &plan.work {
            let Some(s) = self.running.iter_mut().find(|s| s.id == w.id) else { continue };
            debug_assert_eq!(s.computed, w.start);
            s.computed = w.start + w.len;
            while (s.hashes.len() + 1) * bs <= s.computed {
                let k = s.hashes.len();
                let h = self.pool.register(s.blocks[k], s.hashes.last().copied(), &s.tokens[k * bs..(k + 1) * bs]);
                s.hashes.push(h);
            }
            if w.want_logits {
                if let Some(t) = sampled(w.id) {
                    s.tokens.push(t);
                }
            }
        }
    }

    /// Removes a sequence (finished, or cancelled) and releases its blocks; false if unknown.
    pub fn remove(&mut self, id: SeqId) -> bool {
        let s = if let Some(i) = self.running.iter().position(|s| s.id == id) {
            self.running.remove(i)
        } else if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            self.waiting.remove(i).expect("index found")
        } else {
            return false;
        };
        for &b in &s.blocks {
            self.pool.release(b);
        }
        true
    }

    /// Whether the sequence was admitted and not preempted since (tests and metrics).
    pub fn is_running(&self, id: SeqId) -> bool {
        self.running.iter().any(|s| s.id == id)
    }

    /// Checks the bookkeeping: every block a sequence holds is counted once per holder, and the
    /// pool's free and held blocks add up (tests).
    pub fn check(&self) {
        self.pool.check();
        let mut holders = vec![0u32; self.pool.num_blocks()];
        for s in self.running.iter().chain(self.waiting.iter()) {
            assert!(s.blocks.len() * self.pool.block_size() >= s.computed, "seq {} computed beyond its blocks", s.id);
            for &b in &s.blocks {
                holders[b as usize] += 1;
            }
        }
        for (b, &h) in holders.iter().enumerate() {
            assert_eq!(h, self.pool.refs(b as u32), "block {b}: holders vs reference count");
        }
    }
}

/// Gives `s` blocks until it covers `upto` positions (the caller checked there are enough).
fn grow(pool: &mut BlockPool, s: &mut Seq, upto: usize) {
    while s.blocks.len() * pool.block_size() < upto {
        s.blocks.push(pool.alloc().expect("blocks checked before growing"));
    }
}
