//! A serving rank's side: [`Stage`], the blocks it holds (their parameters, their int8 copies,
//! their layers of the paged cache), and [`serve_rank`], which answers the serving process's
//! steps on the control connection until it says stop or goes away.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use tessera_fleet::agent::AgentArgs;
use tessera_fleet::rendezvous::STARTUP_TIMEOUT_MS;
use tessera_fleet::wire::{self, Wait, WireError};
use tessera_kernels::model::paged::{KvCache, PagedWorkspace, ParamsAt, QuantWeights};
use tessera_kernels::model::Model;
use tessera_transport::quic::{ControlConn, ControlEndpoint};

use super::tables::TableStore;
use super::wire::{FromRank, ToRank};
use crate::infer::backend::{check_step, SeqStep, StepRows};

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

/// How many times (10 ms apart) a rank whose server ended the connection looks for the close
/// frame that says why.
const CLOSE_REASON_POLLS: usize = 50;

/// Reads the parameters of a flat range of a model (a rank reads only its blocks').
pub type WeightLoader = dyn Fn(&Model, Range<usize>) -> Result<Vec<f32>>;

/// Dials the serving process (`a.join`) and joins it as an agent joins a coordinator
/// ([`tessera_fleet::agent::dial`]: its certificate, or the join token's secret over TLS pinned
/// to the server's CA; retried until `a.connect_timeout_ms`). Keep the endpoint as long as the
/// connection.
pub fn connect(a: &AgentArgs) -> Result<(Arc<ControlEndpoint>, ControlConn)> {
    let d = tessera_fleet::agent::dial(a).map_err(|e| anyhow::anyhow!("serve-rank: {e:#}"))?;
    Ok((d.endpoint, d.conn))
}

/// A rank's life on `conn`: says what model it opened, takes its rank and blocks (their
/// parameters read through `load`), then runs steps until `Shutdown` (`Ok`) or until the serving
/// process is gone (`Err`). A step that fails is reported (`Failed`) and ends the rank: its cache
/// is no longer what the serving process believes. The wait for the assignment has no deadline
/// of its own: the server's join timeout bounds it (a server gone closes the connection, or its
/// idle timeout does).
pub fn serve_rank(mut conn: ControlConn, model: Model, load: &WeightLoader) -> Result<()> {
    let gone = |conn: &ControlConn, e: WireError| {
        // The reason travels in the close frame, which can come just after the streams end.
        for _ in 0..CLOSE_REASON_POLLS {
            if conn.is_closed() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let why = conn.closed_reason().map(|r| format!(": {r}")).unwrap_or_default();
        anyhow::anyhow!("the serving process ended the connection ({e}){why}")
    };
    let hello = FromRank::Hello { pid: std::process::id(), model: format!("{:?}", model.cfg) };
    // A server that refuses this rank at once (every rank held) may close before the Hello.
    wire::send(&mut conn, &hello).map_err(|e| gone(&conn, e))?;
    let wait = Wait { what: "the blocks to hold (Assign)", deadline: None, alive: &|| Ok(()) };
    let (rank, mut stage) = match wire::recv(&mut conn, "Assign", &wait).map_err(|e| gone(&conn, e))? {
        ToRank::Assign { rank, blocks_start, blocks_end, block_size, num_blocks, int8 } => {
            let blocks = blocks_start as usize..blocks_end as usize;
            match Stage::new(model, load, blocks, block_size as usize, num_blocks as usize, int8) {
                Ok(s) => (rank, s),
                Err(e) => return fail(&mut conn, e),
            }
        }
        ToRank::Shutdown => return Ok(()),
        other => bail!("the serving process opened with {other:?} instead of Assign"),
    };
    tracing::info!("serve-rank: rank {rank}, blocks {:?}", stage.blocks);
    let ready = FromRank::Ready {
        param_bytes: stage.param_bytes() as u64,
        cache_bytes: stage.cache_bytes() as u64,
        params_blake3: super::span_blake3(&stage.params),
    };
    wire::send(&mut conn, &ready)?;
    let cfg = &stage.model.cfg;
    let (c, mut tables) = (cfg.d_model, TableStore::new(cfg.max_seq_len.div_ceil(stage.cache.block_size())));
    let mut zeros: Vec<u32> = Vec::new();
    loop {
        let wait = Wait { what: "a step", deadline: None, alive: &|| Ok(()) };
        let (id, seqs, desc) = match wire::recv(&mut conn, "Tables, Step or Shutdown", &wait).map_err(|e| gone(&conn, e))? {
            ToRank::Tables { updates } => {
                if let Err(e) = updates.iter().try_for_each(|u| tables.apply(u)) {
                    return fail(&mut conn, e.context("the serving process's block tables"));
                }
                continue;
            }
            ToRank::Step { id, seqs, x } => (id, seqs, x),
            ToRank::Shutdown => return Ok(()),
            other => bail!("the serving process sent {other:?} during the steps"),
        };
        let rows: usize = seqs.iter().map(|s| s.rows as usize).sum();
        let wait =
            Wait { what: "a step's stream", deadline: Some(Instant::now() + Duration::from_millis(STARTUP_TIMEOUT_MS)), alive: &|| Ok(()) };
        let mut x = wire::recv_bulk(&mut conn, std::slice::from_ref(&desc), rows * c, &wait)?.remove(0);
        // The token ids stay in the serving process; the checks need only how many rows each
        // sequence has.
        zeros.resize(zeros.len().max(seqs.iter().map(|s| s.rows as usize).max().unwrap_or(0)), 0);
        let batch: Result<Vec<SeqStep>> = seqs
            .iter()
            .map(|s| {
                let block_table = tables.table(s.slot)?;
                Ok(SeqStep { tokens: &zeros[..s.rows as usize], start: s.start as usize, block_table, want_logits: false })
            })
            .collect();
        if let Err(e) = batch.and_then(|b| stage.run(&b, &mut x)) {
            return fail(&mut conn, e.context(format!("step {id}")));
        }
        wire::send(&mut conn, &FromRank::Done { id, y: wire::describe(&[("y", &x)]).remove(0) })?;
        wire::send_bulk(&mut conn, &[&x])?;
    }
}

/// Tells the serving process why this rank stops, and stops.
fn fail(conn: &mut ControlConn, e: anyhow::Error) -> Result<()> {
    let _ = wire::send(conn, &FromRank::Failed { why: format!("{e:#}") });
    conn.close_when_read("failed", 2_000);
    Err(e)
}
