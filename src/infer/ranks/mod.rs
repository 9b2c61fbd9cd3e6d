//! Serving a model over ranks (pipeline parallelism, `tessera serve --pipeline-parallel-size N`):
//! a model whose blocks do not fit one worker runs with its blocks cut into `N` contiguous
//! stages, each held by a rank process (`tessera serve-rank`) with its layers of the paged
//! key/value cache; the serving process keeps the embeddings, the final norm and the head, and
//! [`PipelineBackend`] is the same [`crate::infer::Backend`] the scheduler drives on one process.
//!
//! - [`driver`]: the serving process's side (start, certificates, checks, steps, loss);
//! - [`rank`]: a rank's side ([`rank::Stage`], [`rank::serve_rank`]);
//! - [`wire`]: their messages;
//! - [`tables`]: the block tables, kept on every rank and sent as changes.
//!
//! # Transport and joining
//! Each rank dials the serving process's control endpoint (QUIC) and joins it as an agent joins
//! a coordinator (`tessera_fleet::agent::dial` → `tessera_fleet::rendezvous::read_join`): ranks
//! the server starts itself (`--pipeline-parallel-size N`) present `node-<r>` certificates of a
//! CA made for this server (mutual TLS); ranks started by hand on other hosts (`tessera serve
//! --rank-listen ADDR`, then `tessera serve-rank --join ADDR` on each host) present the join
//! token the server printed (its secret over TLS pinned to the server's CA) or, with `--certs
//! DIR` (`tessera cluster init`), their own `node-<r>` certificates. A rank then says what model
//! it loaded (refused by the key that differs), takes its rank (the one it asked for, else in
//! join order) and blocks, and proves its blocks' parameters are the server's
//! ([`span_blake3`]). Once every rank is held, a rank that joins is refused, naming who holds
//! the ranks. A step's residual stream `[rows, d_model]` goes out to rank 0, back, out to rank
//! 1, … (a bulk f32 transfer with its CRC32C each way), after the step's block-table changes
//! ([`tables`]).
//!
//! # Bits
//! The stages run [`tessera_kernels::model::Model::blocks_paged`] on their blocks, the serving
//! process `embed_paged` and `head_paged`: the ops of `forward_paged`, in its order, on the
//! same rows, so the logits are the one-process backend's bit for bit (`ranks::tests`).
//!
//! # Loss
//! A rank whose process ends, whose connection closes (a host cut off or killed: QUIC's idle
//! timeout, 10 s) or that reports a failed step makes the backend lost ([`crate::infer::BackendLost`]): every rank is stopped, the step and every later
//! one fail with the rank's name and how it ended, and `tessera serve` answers 503.

pub mod driver;
pub mod rank;
pub mod tables;
pub mod wire;

#[cfg(test)]
mod tests;

use std::net::SocketAddr;
use std::ops::Range;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};

use anyhow::{ensure, Context, Result};
use tessera_actors::liveness::Exit;
use tessera_kernels::model::Model;

pub use driver::{PipelineBackend, PipelineOptions, RankSource};

/// A rank's process as the serving process watches it.
pub trait RankProcess: Send {
    /// How it ended, once it has.
    fn exited(&mut self) -> Option<String>;
    /// Ends it (if it still runs) and reaps it.
    fn stop(&mut self);
}

/// A `tessera serve-rank` child process; killed when dropped.
pub struct ChildRank(pub Child);

impl RankProcess for ChildRank {
    fn exited(&mut self) -> Option<String> {
        match self.0.try_wait() {
            Ok(Some(status)) => Some(Exit::of(status).to_string()),
            Ok(None) => None,
            Err(e) => Some(format!("cannot be waited for: {e}")),
        }
    }

    fn stop(&mut self) {
        if self.exited().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

impl Drop for ChildRank {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The blocks of each of `ranks` stages: contiguous runs balanced by parameter count (the
/// pipeline planner's partition, `engine::pipeline::balanced_cuts`).
pub fn stage_blocks(model: &Model, ranks: usize) -> Result<Vec<Range<usize>>> {
    let n = model.cfg.n_layer;
    ensure!(ranks >= 1 && ranks <= n, "--pipeline-parallel-size {ranks}: expected 1 to the model's {n} blocks");
    let weights: Vec<f64> = (0..n).map(|l| model.units()[l + 1].len() as f64).collect();
    let cuts = crate::engine::pipeline::balanced_cuts(&weights, ranks, (0.0, 0.0));
    Ok(cuts.windows(2).map(|w| w[0]..w[1]).collect())
}

/// The fingerprint of a run of blocks' parameters (`checkpoint::params_blake3` of the flat
/// range): a rank's must be the server's.
pub fn span_blake3(params: &[f32]) -> String {
    crate::checkpoint::params_blake3(&[("blocks", params)])
}

/// What a rank process loads: the model the server serves (the same path and tokenizer).
#[derive(Clone, Debug)]
pub struct ModelSource {
    pub model: std::path::PathBuf,
    pub tokenizer: Option<std::path::PathBuf>,
}

impl PipelineBackend {
    /// Starts `opts.ranks` `tessera serve-rank` processes of this executable on this machine,
    /// each loading `source` and joining with its certificate (see [`PipelineBackend::launch`]
    /// for the rest).
    pub fn spawn(
        model: Model,
        params: &[f32],
        base: usize,
        load: &rank::WeightLoader,
        source: &ModelSource,
        opts: PipelineOptions,
    ) -> Result<PipelineBackend> {
        let exe = std::env::current_exe().context("finding the tessera executable")?;
        let mut start = |r: usize, control: SocketAddr, pki: &Path| -> Result<Box<dyn RankProcess>> {
            let mut c = Command::new(&exe);
            c.args(["serve-rank", "--rank", &r.to_string(), "--join", &control.to_string()]).arg("--certs").arg(pki);
            c.args(["--name", &format!("local-{r}")]).arg("--model").arg(&source.model);
            if let Some(t) = &source.tokenizer {
                c.arg("--tokenizer").arg(t);
            }
            // Its own process group: a terminal's Ctrl-C reaches the server, which finishes its
            // requests and then stops the ranks.
            let child =
                c.stdin(Stdio::null()).process_group(0).spawn().with_context(|| format!("starting {} serve-rank", exe.display()))?;
            Ok(Box::new(ChildRank(child)))
        };
        PipelineBackend::launch(model, params, base, load, opts, RankSource::Spawn(&mut start))
    }
}
