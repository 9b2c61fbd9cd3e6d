//! A serving rank's side: [`Stage`], the blocks it holds (their parameters, their int8 copies,
//! their layers of the paged cache), and [`serve_rank`], which answers the serving process's
//! steps on the control connection until it says stop or goes away.

use std::net::SocketAddr;
use std::ops::Range;
use std::path::PathBuf;

use anyhow::{bail, ensure, Context, Result};
use tessera_fleet::rendezvous::{node_name, COORDINATOR_NAME, STARTUP_TIMEOUT_MS};
use tessera_fleet::wire::{self, Wait};
use tessera_kernels::model::paged::{KvCache, PagedWorkspace, ParamsAt, QuantWeights};
use tessera_kernels::model::Model;
use tessera_transport::quic::{ControlConn, ControlEndpoint, NodeTls, ALPN_CONTROL};

use super::wire::{FromRank, ToRank, WireSeq};
use crate::infer::backend::{check_step, SeqStep, StepRows};

/// What `tessera serve-rank` is started with.
#[derive(Debug, Clone)]
pub struct RankArgs {
    pub rank: usize,
    /// The serving process's control address.
    pub control: SocketAddr,
    /// The folder of the run's certificates (`ca.pem`, `node-<rank>.pem`/`.key`).
    pub pki: PathBuf,
}

/// One pipeline stage of a served model: blocks `blocks` and their layers of the cache.
pub struct Stage {
    model: Model,
    blocks: Range<usize>,
    /// The blocks' units of the flat buffer, from flat offset `base`.
    params: Vec<f32>,
    base: usize,
    int8: Option<QuantWeights>,
    cache: KvCache,
    ws: PagedWorkspace,
}

impl Stage {
    /// Loads `blocks`' parameters (`load`: the flat range of their units) and makes their cache.
    pub fn new(model: Model, load: &WeightLoader, blocks: Range<usize>, block_size: usize, num_blocks: usize, int8: bool) -> Result<Stage> {
        let n = model.cfg.n_layer;
        ensure!(blocks.start < blocks.end && blocks.end <= n, "blocks {blocks:?}: expected a non-empty range of the model's {n}");
        let flat = model.units_range(blocks.start + 1..blocks.end + 1);
        let params = load(&model, flat.clone()).with_context(|| format!("loading the parameters of blocks {blocks:?}"))?;
        ensure!(params.len() == flat.len(), "{} parameters for blocks {blocks:?}, which have {}", params.len(), flat.len());
        let base = flat.start;
        let cache = KvCache::for_layers(&model.cfg, blocks.clone(), num_blocks, block_size).map_err(anyhow::Error::msg)?;
        let int8 =
            int8.then(|| model.quantize_int8_units(&ParamsAt { params: &params, base, int8: None }, blocks.start + 1..blocks.end + 1));
        Ok(Stage { model, blocks, params, base, int8, cache, ws: PagedWorkspace::default() })
    }

    /// Bytes of parameters held (f32, and int8 copies).
    pub fn param_bytes(&self) -> usize {
        4 * self.params.len() + self.int8.as_ref().map_or(0, QuantWeights::bytes)
    }

    pub fn cache_bytes(&self) -> usize {
        self.cache.bytes()
    }

    /// Runs the stage's blocks on the stream `x` of `batch`'s rows, in place, writing the rows'
    /// keys and values into the stage's cache. The step is checked as the one-process backend
    /// checks it, and `x` against its rows.
    pub fn run(&mut self, batch: &[SeqStep<'_>], x: &mut Vec<f32>) -> Result<()> {
        check_step(&self.model.cfg, self.cache.block_size(), self.cache.num_blocks(), batch)?;
        let rows = StepRows::of(batch);
        let c = self.model.cfg.d_model;
        ensure!(x.len() == rows.tokens.len() * c, "a stream of {} values for {} rows of {c}", x.len(), rows.tokens.len());
        let pos = self.model.paged_positions(rows.tokens.len(), &rows.seqs);
        let at = ParamsAt { params: &self.params, base: self.base, int8: self.int8.as_ref() };
        self.model.blocks_paged(&at, self.blocks.clone(), &mut self.cache, &rows.seqs, &pos, x, &mut self.ws);
        Ok(())
    }
}

/// Reads the parameters of a flat range of a model (a rank reads only its blocks').
pub type WeightLoader = dyn Fn(&Model, Range<usize>) -> Result<Vec<f32>>;

/// Dials the serving process with the rank's certificate (mutual TLS against the run's CA).
pub fn connect(a: &RankArgs) -> Result<(ControlEndpoint, ControlConn)> {
    let tls =
        NodeTls::load(&a.pki, &node_name(a.rank)).with_context(|| format!("loading {} from {}", node_name(a.rank), a.pki.display()))?;
    let endpoint = ControlEndpoint::bind(SocketAddr::new(a.control.ip(), 0), None)?;
    let conn = endpoint.connect(a.control, COORDINATOR_NAME, tls.client_config_for(ALPN_CONTROL)?, STARTUP_TIMEOUT_MS)?;
    Ok((endpoint, conn))
}

/// A rank's life on `conn`: says what model it opened, takes its blocks (their parameters read
/// through `load`), then
/// runs steps until `Shutdown` (`Ok`) or until the serving process is gone (`Err`). A step that
/// fails is reported (`Failed`) and ends the rank: its cache is no longer what the serving
/// process believes.
pub fn serve_rank(mut conn: ControlConn, rank: usize, model: Model, load: &WeightLoader) -> Result<()> {
    let cfg = &model.cfg;
    let hello = FromRank::Hello {
        rank: rank as u64,
        pid: std::process::id(),
        num_params: model.num_params() as u64,
        n_layer: cfg.n_layer as u64,
        d_model: cfg.d_model as u64,
        vocab_size: cfg.vocab_size as u64,
    };
    wire::send(&mut conn, &hello)?;
    let deadline = Some(std::time::Instant::now() + std::time::Duration::from_millis(STARTUP_TIMEOUT_MS));
    let wait = Wait { what: "the blocks to hold (Assign)", deadline, alive: &|| Ok(()) };
    let mut stage = match wire::recv(&mut conn, "Assign", &wait)? {
        ToRank::Assign { blocks_start, blocks_end, block_size, num_blocks, int8 } => {
            let blocks = blocks_start as usize..blocks_end as usize;
            match Stage::new(model, load, blocks, block_size as usize, num_blocks as usize, int8) {
                Ok(s) => s,
                Err(e) => return fail(&mut conn, e),
            }
        }
        ToRank::Shutdown => return Ok(()),
        other => bail!("the serving process opened with {other:?} instead of Assign"),
    };
    let ready = FromRank::Ready { param_bytes: stage.param_bytes() as u64, cache_bytes: stage.cache_bytes() as u64 };
    wire::send(&mut conn, &ready)?;
    let c = stage.model.cfg.d_model;
    loop {
        let wait = Wait { what: "a step", deadline: None, alive: &|| Ok(()) };
        let msg = wire::recv(&mut conn, "Step or Shutdown", &wait).context("the serving process is gone")?;
        let (id, seqs, desc) = match msg {
            ToRank::Step { id, seqs, x } => (id, seqs, x),
            ToRank::Shutdown => return Ok(()),
            other => bail!("the serving process sent {other:?} during the steps"),
        };
        let rows: usize = seqs.iter().map(|s| s.tokens.len()).sum();
        let wait = Wait { what: "a step's stream", deadline, alive: &|| Ok(()) };
        let mut x = wire::recv_bulk(&mut conn, std::slice::from_ref(&desc), rows * c, &wait)?.remove(0);
        let batch: Vec<SeqStep> = seqs.iter().map(seq_step).collect();
        if let Err(e) = stage.run(&batch, &mut x) {
            return fail(&mut conn, e.context(format!("step {id}")));
        }
        wire::send(&mut conn, &FromRank::Done { id, y: wire::describe(&[("y", &x)]).remove(0) })?;
        wire::send_bulk(&mut conn, &[&x])?;
    }
}

fn seq_step(s: &WireSeq) -> SeqStep<'_> {
    SeqStep { tokens: &s.tokens, start: s.start as usize, block_table: &s.table, want_logits: false }
}

/// Tells the serving process why this rank stops, and stops.
fn fail(conn: &mut ControlConn, e: anyhow::Error) -> Result<()> {
    let _ = wire::send(conn, &FromRank::Failed { why: format!("{e:#}") });
    conn.close_when_read("failed", 2_000);
    Err(e)
}
