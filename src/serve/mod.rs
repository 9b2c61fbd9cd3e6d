//! `tessera serve`: a model behind an HTTP server with the OpenAI API's shape
//! (`/v1/completions`, `/v1/chat/completions` with the tokenizer's chat template, `/v1/models`,
//! server-sent-event streaming, `/health`, `/metrics`), on axum and tokio.
//!
//! The engine ([`crate::infer::Engine`]) runs on a thread of its own ([`worker`]): handlers
//! check a request ([`api`]), tokenize it, and hand it over with a channel for its answer; the
//! engine batches everything live (continuous batching) and sends text back as it comes.
//! Requests in flight are bounded (`--max-queue`: more are answered 429); SIGTERM or SIGINT stops
//! accepting (503 to new requests on open connections) and finishes the requests in flight.

pub mod api;
pub mod bench;
pub mod chat;
pub mod http;
pub mod metrics;
pub mod model;
pub mod worker;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{ensure, Context, Result};

use crate::infer::Engine;
use http::{AppState, Limits};
use metrics::Metrics;
use model::{BackendChoice, LoadedModel};
use worker::Worker;

/// Options of `tessera serve`.
#[derive(Debug, Clone)]
pub struct ServeOpts {
    /// A Hugging Face model folder or a Tessera checkpoint.
    pub model: PathBuf,
    /// A checkpoint's tokenizer (the recorded one when absent).
    pub tokenizer: Option<PathBuf>,
    /// The name requests use (the folder's name when absent).
    pub served_name: Option<String>,
    pub addr: SocketAddr,
    /// Cache positions per block, and blocks in all (0: enough for `max_seqs` full sequences).
    pub block_size: usize,
    pub kv_blocks: usize,
    /// The device and the linear layers' format.
    pub backend: BackendChoice,
    pub max_seqs: usize,
    pub max_batch_tokens: usize,
    pub limits: Limits,
}

/// The engine for `m` with the options' cache and batch sizes; the model's name, tokenizer,
/// special tokens and template stay with the caller.
pub fn engine_for(
    m: LoadedModel,
    block_size: usize,
    kv_blocks: usize,
    backend: BackendChoice,
    max_seqs: usize,
    max_batch_tokens: usize,
) -> Result<Engine> {
    ensure!(block_size > 0, "--block-size must be at least 1");
    ensure!(max_seqs > 0, "--max-seqs must be at least 1");
    ensure!(max_batch_tokens > 0, "--max-batch-tokens must be at least 1");
    let blocks = if kv_blocks == 0 { m.model.cfg.max_seq_len.div_ceil(block_size) * max_seqs } else { kv_blocks };
    Engine::new(m.backend(backend, block_size, blocks, max_seqs, max_batch_tokens)?, max_batch_tokens, max_seqs)
}

/// Runs the server until SIGTERM/SIGINT, then finishes the requests in flight.
pub fn serve(o: ServeOpts) -> Result<()> {
    ensure!(o.limits.max_queue > 0, "--max-queue must be at least 1");
    let mut m = LoadedModel::load_with(&o.model, o.tokenizer.as_deref(), o.backend.pipeline.is_some())?;
    let name = o.served_name.clone().unwrap_or_else(|| m.name.clone());
    let codec = Arc::new(std::mem::replace(&mut m.codec, crate::data::Codec::Bytes));
    let (bos, eos, chat) = (m.bos, m.eos.clone(), m.chat.take());
    let engine = engine_for(m, o.block_size, o.kv_blocks, o.backend, o.max_seqs, o.max_batch_tokens)?;
    let metrics = Arc::new(Metrics::default());
    let lost = Arc::new(std::sync::OnceLock::new());
    let limits = Limits { max_prompt_tokens: o.limits.max_prompt_tokens.min(engine.max_seq_len().saturating_sub(1)), ..o.limits };
    let (jobs_tx, jobs_rx) = std::sync::mpsc::channel();
    let state = Arc::new(AppState {
        model_name: name.clone(),
        codec: codec.clone(),
        bos,
        chat,
        jobs: Mutex::new(Some(jobs_tx)),
        limits,
        metrics: metrics.clone(),
        max_seq_len: engine.max_seq_len(),
        vocab_size: engine.vocab_size(),
        in_flight: AtomicUsize::new(0),
        draining: AtomicBool::new(false),
        lost: lost.clone(),
        next_id: AtomicU64::new(0),
        seed_base: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64),
        created: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
    });
    let ctx = engine.max_seq_len();
    let worker = Worker::new(engine, codec, eos, metrics, lost);
    let engine_thread = std::thread::Builder::new().name("tessera-engine".into()).spawn(move || worker.run(jobs_rx))?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let served = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(o.addr).await.with_context(|| format!("listening on {}", o.addr))?;
        let addr = listener.local_addr()?;
        // The line scripts wait for (the port is known once bound: `--addr 127.0.0.1:0`).
        crate::outln!("serving `{name}` (context {ctx} tokens) on http://{addr}");
        let s = state.clone();
        axum::serve(listener, http::router(state.clone())).with_graceful_shutdown(shutdown_signal(s)).await.context("serving HTTP")
    });
    // No new jobs: the engine finishes what it has (nothing, once every response ended) and stops.
    state.jobs.lock().expect("jobs lock").take();
    drop(rt);
    engine_thread.join().map_err(|_| anyhow::anyhow!("the engine thread panicked"))?;
    served
}

/// `tessera serve-rank`: opens the model the server serves, joins the server (`--join`, as an
/// agent joins a coordinator: `launch::agent_args` reads the flags) and holds the blocks it
/// assigns (reading only their weights from a model folder) until it says stop
/// ([`crate::infer::ranks`]).
pub fn serve_rank(f: &crate::launch::AgentFlags, model: &std::path::Path, tokenizer: Option<&std::path::Path>) -> Result<()> {
    let mut f = f.clone();
    if f.token.as_deref() == Some("-") {
        f.token = Some(crate::launch::read_token(&mut std::io::stdin().lock(), "standard input")?);
    }
    let no_proof = f.certs.is_none() && f.token.is_none() && f.token_file.is_none();
    if no_proof && std::env::var(crate::launch::TOKEN_ENV).map_or(true, |t| t.trim().is_empty()) {
        anyhow::bail!(
            "tessera serve-rank needs the server's join token (--token TOKEN, --token - to read it from standard input, \
             --token-file PATH or ${}) or a cluster directory (--certs DIR)",
            crate::launch::TOKEN_ENV
        );
    }
    let args = crate::launch::agent_args(&f, &|k| std::env::var(k).ok())?;
    let (m, load) = model::open_for_rank(model, tokenizer)?;
    let (_endpoint, conn) = crate::infer::ranks::rank::connect(&args)?;
    crate::infer::ranks::rank::serve_rank(conn, m, &*load)
}

/// Resolves on SIGTERM or SIGINT, after marking the server as draining.
async fn shutdown_signal(s: Arc<AppState>) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        tracing::error!("could not install the SIGTERM/SIGINT handlers; stop the server with SIGKILL");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    s.draining.store(true, Ordering::Relaxed);
    tracing::info!("shutting down: finishing {} request(s) in flight", s.in_flight.load(Ordering::Relaxed));
}
