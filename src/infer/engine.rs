//! [`Engine`]: a [`Backend`] driven by the [`Scheduler`], token by token. Each
//! [`Engine::step`] plans a batch, runs it, samples every sequence whose prompt is done with its
//! own [`Sampler`], and reports the new tokens; a sequence ends on one of its stop tokens or at
//! its `max_tokens`. Text (detokenizing, stop strings) is the caller's ([`super::text`]).

use std::collections::HashMap;

use anyhow::{ensure, Result};

use super::backend::{Backend, SeqStep};
use super::blocks::BlockPool;
use super::sample::{Sampler, SamplingParams};
use super::sched::{AdmitError, SchedConfig, Scheduler, SeqId};

/// A generation request in tokens.
#[derive(Debug, Clone)]
pub struct Request {
    pub prompt: Vec<u32>,
    /// New tokens at most.
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Tokens that end the sequence when sampled (the end-of-text token); not part of the output.
    pub stop_tokens: Vec<u32>,
}

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// `max_tokens` reached.
    Length,
    /// A stop token was sampled (or, at the text level, a stop string appeared).
    Stop,
}

impl Finish {
    /// The OpenAI API's `finish_reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Length => "length",
            Finish::Stop => "stop",
        }
    }
}

/// A sampled token of a sequence. A stop token is reported (with `finish`) but is not output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    pub id: SeqId,
    pub token: u32,
    pub finish: Option<Finish>,
}

/// Counters since the start (for `/metrics` and benchmarks).
#[derive(Debug, Default, Clone, Copy)]
pub struct EngineStats {
    pub steps: u64,
    /// Tokens run through the model (prompt chunks, recomputation and decode tokens).
    pub computed_tokens: u64,
    pub sampled_tokens: u64,
    pub preemptions: u64,
    /// Prompt positions taken from the prefix cache instead of computed.
    pub prefix_hit_tokens: u64,
}

struct Live {
    sampler: Sampler,
    max_tokens: usize,
    generated: usize,
    stop_tokens: Vec<u32>,
}

/// The inference engine over one backend.
pub struct Engine {
    backend: Box<dyn Backend>,
    sched: Scheduler,
    live: HashMap<SeqId, Live>,
    stats: EngineStats,
}

impl Engine {
    /// The engine over `backend`'s cache, running at most `max_batch_tokens` tokens and
    /// `max_seqs` sequences a step.
    pub fn new(backend: Box<dyn Backend>, max_batch_tokens: usize, max_seqs: usize) -> Result<Engine> {
        ensure!(max_batch_tokens > 0, "max_batch_tokens must be at least 1");
        ensure!(max_seqs > 0, "max_seqs must be at least 1");
        let pool = BlockPool::new(backend.num_blocks(), backend.block_size());
        let cfg = SchedConfig { max_batch_tokens, max_seqs, max_seq_len: backend.max_seq_len() };
        Ok(Engine { sched: Scheduler::new(cfg, pool), backend, live: HashMap::new(), stats: EngineStats::default() })
    }

    /// The longest sequence (prompt and output) a request may reach.
    pub fn max_seq_len(&self) -> usize {
        self.backend.max_seq_len().min(self.backend.num_blocks() * self.backend.block_size())
    }

    pub fn vocab_size(&self) -> usize {
        self.backend.vocab_size()
    }

    pub fn stats(&self) -> EngineStats {
        self.stats
    }

    pub fn num_running(&self) -> usize {
        self.sched.num_running()
    }

    pub fn num_waiting(&self) -> usize {
        self.sched.num_waiting()
    }

    pub fn free_blocks(&self) -> usize {
        self.sched.pool().num_free()
    }

    pub fn is_idle(&self) -> bool {
        self.sched.is_idle()
    }

    /// Queues a request under `id`.
    pub fn add(&mut self, id: SeqId, req: Request) -> Result<(), AdmitError> {
        if let Some(&t) = req.prompt.iter().find(|&&t| t as usize >= self.backend.vocab_size()) {
            return Err(AdmitError::TokenOutOfRange { token: t, vocab_size: self.backend.vocab_size() });
        }
        self.sched.add(id, req.prompt, req.max_tokens)?;
        let live = Live { sampler: Sampler::new(req.sampling), max_tokens: req.max_tokens, generated: 0, stop_tokens: req.stop_tokens };
        self.live.insert(id, live);
        Ok(())
    }

    /// Drops a request (cancelled, or ended by a stop string); false if unknown.
    pub fn abort(&mut self, id: SeqId) -> bool {
        self.live.remove(&id);
        self.sched.remove(id)
    }

    /// Runs one step; the tokens sampled in it, in batch order (none when idle).
    pub fn step(&mut self) -> Result<Vec<Event>> {
        let plan = self.sched.schedule();
        if plan.work.is_empty() {
            return Ok(Vec::new());
        }
        self.stats.steps += 1;
        self.stats.preemptions += plan.preempted.len() as u64;
        let batch: Vec<SeqStep<'_>> = plan
            .work
            .iter()
            .map(|w| SeqStep {
                tokens: &self.sched.tokens(w.id)[w.start..w.start + w.len],
                start: w.start,
                block_table: self.sched.block_table(w.id),
                want_logits: w.want_logits,
            })
            .collect();
        self.stats.computed_tokens += plan.work.iter().map(|w| w.len as u64).sum::<u64>();
        self.stats.prefix_hit_tokens += plan.cached_tokens as u64;
        let wanted: Vec<SeqId> = plan.work.iter().filter(|w| w.want_logits).map(|w| w.id).collect();
        let greedy = wanted.iter().all(|id| self.live[id].sampler.is_greedy());
        let mut sampled = HashMap::new();
        if greedy {
            let ids = self.backend.step_greedy(&batch)?;
            ensure!(ids.len() == wanted.len(), "the backend returned {} greedy tokens, expected {}", ids.len(), wanted.len());
            sampled.extend(wanted.iter().copied().zip(ids));
        } else {
            let logits = self.backend.step(&batch)?;
            ensure!(logits.len() == wanted.len(), "the backend returned {} rows of logits, expected {}", logits.len(), wanted.len());
            for (id, mut l) in wanted.iter().copied().zip(logits) {
                ensure!(
                    l.len() == self.backend.vocab_size(),
                    "the backend returned {} logits, expected {}",
                    l.len(),
                    self.backend.vocab_size()
                );
                let live = self.live.get_mut(&id).expect("a planned sequence is live");
                sampled.insert(id, live.sampler.sample(&mut l, self.sched.tokens(id)));
            }
        }
        self.sched.complete(&plan, |id| sampled.get(&id).copied());
        self.finish_sampled(&plan.work, &sampled)
    }

    /// The events of the step's sampled tokens; ends the sequences that stop.
    fn finish_sampled(&mut self, work: &[super::sched::Work], sampled: &HashMap<SeqId, u32>) -> Result<Vec<Event>> {
        let mut events = Vec::with_capacity(sampled.len());
        for w in work.iter().filter(|w| w.want_logits) {
            let token = sampled[&w.id];
            let live = self.live.get_mut(&w.id).expect("a planned sequence is live");
            live.generated += 1;
            let finish = if live.stop_tokens.contains(&token) {
                Some(Finish::Stop)
            } else if live.generated >= live.max_tokens {
                Some(Finish::Length)
            } else {
                None
            };
            if finish.is_some() {
                self.abort(w.id);
            }
            self.stats.sampled_tokens += 1;
            events.push(Event { id: w.id, token, finish });
        }
        Ok(events)
    }
}
