//! The engine's thread: takes jobs from the HTTP handlers, steps the [`Engine`] while any are
//! live, turns each sequence's tokens into text ([`TextOut`], stop strings) and sends the pieces
//! back on the job's channel. A job whose receiver is gone (the client disconnected) is
//! cancelled before the next step; a failed step fails every live job with its error.

use std::collections::HashMap;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use tokio::sync::mpsc::UnboundedSender;

use super::metrics::Metrics;
use crate::data::Codec;
use crate::infer::sched::SeqId;
use crate::infer::text::TextOut;
use crate::infer::{BackendLost, Engine, Finish, Request, SamplingParams};

/// A generation job from a handler.
pub struct Job {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// Generate past the end-of-sequence tokens.
    pub ignore_eos: bool,
    pub tx: UnboundedSender<Out>,
}

/// What a job's handler receives, in order: text pieces, then one `Done` or `Failed`.
#[derive(Debug, Clone, PartialEq)]
pub enum Out {
    Text(String),
    Done {
        finish: Finish,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
    Failed(String),
    /// The backend is lost (a pipeline rank died): this and every later request fail.
    Lost(String),
}

struct Live {
    tx: UnboundedSender<Out>,
    text: TextOut,
    prompt_tokens: usize,
    completion_tokens: usize,
    started: Instant,
    first_token: bool,
}

/// The worker's state: the engine, the tokenizer, and the live jobs.
pub struct Worker {
    pub engine: Engine,
    pub codec: Arc<Codec>,
    pub eos: Vec<u32>,
    pub metrics: Arc<Metrics>,
    /// Set when the backend is lost ([`BackendLost`]), shared with the HTTP handlers.
    pub lost: Arc<OnceLock<String>>,
    live: HashMap<SeqId, Live>,
    next_id: SeqId,
}

impl Worker {
    pub fn new(engine: Engine, codec: Arc<Codec>, eos: Vec<u32>, metrics: Arc<Metrics>, lost: Arc<OnceLock<String>>) -> Worker {
        Worker { engine, codec, eos, metrics, lost, live: HashMap::new(), next_id: 0 }
    }

    /// Serves jobs until `rx` is closed (every sender dropped) and the last job is done.
    pub fn run(mut self, rx: Receiver<Job>) {
        let mut open = true;
        loop {
            if self.engine.is_idle() {
                if !open {
                    return;
                }
                match rx.recv() {
                    Ok(job) => self.add(job),
                    Err(_) => return,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(job) => self.add(job),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            }
            self.cancel_disconnected();
            self.step();
        }
    }

    fn add(&mut self, job: Job) {
        let id = self.next_id;
        self.next_id += 1;
        let prompt_tokens = job.prompt.len();
        let req = Request {
            prompt: job.prompt,
            max_tokens: job.max_tokens,
            sampling: job.sampling,
            stop_tokens: if job.ignore_eos { Vec::new() } else { self.eos.clone() },
        };
        match self.engine.add(id, req) {
            Ok(()) => {
                let live = Live {
                    tx: job.tx,
                    text: TextOut::new(job.stop),
                    prompt_tokens,
                    completion_tokens: 0,
                    started: Instant::now(),
                    first_token: false,
                };
                self.live.insert(id, live);
            }
            Err(e) => {
                let _ = job.tx.send(Out::Failed(e.to_string()));
            }
        }
    }

    fn cancel_disconnected(&mut self) {
        let gone: Vec<SeqId> = self.live.iter().filter(|(_, l)| l.tx.is_closed()).map(|(&id, _)| id).collect();
        for id in gone {
            self.engine.abort(id);
            self.live.remove(&id);
            self.metrics.cancelled.inc();
        }
    }

    fn step(&mut self) {
        let before = self.engine.stats();
        let events = match self.engine.step() {
            Ok(ev) => ev,
            Err(e) => {
                let msg = format!("the model failed: {e:#}");
                tracing::error!("{msg}");
                let lost = e.downcast_ref::<BackendLost>().map(|l| {
                    let _ = self.lost.set(l.0.clone());
                    l.0.clone()
                });
                for (id, l) in self.live.drain() {
                    self.engine.abort(id);
                    let _ = l.tx.send(lost.clone().map_or_else(|| Out::Failed(msg.clone()), Out::Lost));
                }
                return;
            }
        };
        self.metrics.record_step(&before, &self.engine);
        for ev in events {
            let Some(l) = self.live.get_mut(&ev.id) else { continue };
            if !l.first_token {
                l.first_token = true;
                self.metrics.ttft.observe(l.started.elapsed().as_secs_f64());
            }
            let mut finish = ev.finish;
            // A stop token ends the text without being part of it.
            if finish != Some(Finish::Stop) || !self.eos.contains(&ev.token) {
                l.completion_tokens += 1;
                let piece = l.text.push(&self.codec, ev.token);
                if !piece.is_empty() {
                    let _ = l.tx.send(Out::Text(piece));
                }
                if l.text.stopped() && finish.is_none() {
                    self.engine.abort(ev.id);
                    finish = Some(Finish::Stop);
                }
            }
            if let Some(f) = finish {
                let mut l = self.live.remove(&ev.id).expect("looked up above");
                let rest = l.text.finish(&self.codec);
                if !rest.is_empty() {
                    let _ = l.tx.send(Out::Text(rest));
                }
                self.metrics.finished(f, l.started.elapsed().as_secs_f64(), l.prompt_tokens, l.completion_tokens);
                let _ = l.tx.send(Out::Done { finish: f, prompt_tokens: l.prompt_tokens, completion_tokens: l.completion_tokens });
            }
        }
    }
}
