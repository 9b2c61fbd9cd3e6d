//! The serving process's side: [`PipelineBackend`] starts the ranks, gives each its blocks, and
//! runs every step through them in order behind [`Backend`].

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use tessera_fleet::rendezvous::{node_name, COORDINATOR_NAME, EXIT_TIMEOUT_MS, STARTUP_TIMEOUT_MS};
use tessera_fleet::wire::{self, Wait, WireError};
use tessera_kernels::model::paged::{ParamsAt, QuantWeights};
use tessera_kernels::model::Model;
use tessera_transport::quic::pki::check_cert_names_node;
use tessera_transport::quic::{ClientAuth, ClusterCa, ControlConn, ControlEndpoint, ALPN_CONTROL};

use super::wire::{FromRank, ToRank, WireSeq};
use super::{stage_blocks, RankProcess};
use crate::infer::backend::{check_step, Backend, BackendLost, SeqStep, StepRows};
use crate::infer::cpu::{refuse_dropping_experts, LinearFormat};

/// Bound on one step of one rank (a long prompt chunk of a large model on a slow CPU), ms. A
/// rank that dies is seen at once (its process, or its connection closing); one that hangs
/// loses its connection after the control plane's idle timeout.
pub const RANK_STEP_TIMEOUT_MS: u64 = 600_000;
/// How often the start-up waits look at the rank processes, ms.
const ACCEPT_POLL_MS: u64 = 100;

/// How a rank starts: (rank, the serving process's control address, the folder of the ranks'
/// certificates) → its process.
pub type StartRank<'a> = dyn FnMut(usize, SocketAddr, &Path) -> Result<Box<dyn RankProcess>> + 'a;

/// The pipeline's geometry.
#[derive(Clone, Copy, Debug)]
pub struct PipelineOptions {
    /// Rank processes, each a contiguous run of blocks (`--pipeline-parallel-size`).
    pub ranks: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    pub weights: LinearFormat,
}

/// One rank as the serving process sees it.
struct Link {
    conn: ControlConn,
    process: Mutex<Box<dyn RankProcess>>,
    blocks: Range<usize>,
    pid: u32,
}

impl Link {
    fn who(&self, r: usize) -> String {
        format!("rank {r} (blocks {}..{}, pid {})", self.blocks.start, self.blocks.end, self.pid)
    }

    /// `Err` once the rank's process (or thread) has ended.
    fn alive(&self) -> Result<(), WireError> {
        match self.process.lock().unwrap_or_else(|p| p.into_inner()).exited() {
            Some(how) => Err(WireError::Control(format!("its process {how}"))),
            None => Ok(()),
        }
    }
}

/// A model served with its blocks split over rank processes (pipeline parallelism): this
/// process holds unit 0 (embeddings, final norm, head) and runs the embeddings and the head;
/// rank `r` holds blocks `spans[r]` and their layers of the paged cache. A step's stream goes
/// through the ranks in order over their control connections (QUIC, mutual TLS against a CA
/// made for this server). The same ops on the same rows as [`crate::infer::CpuBackend`]: the
/// same logits, bit for bit.
pub struct PipelineBackend {
    model: Model,
    /// Unit 0's parameters, and its int8 head.
    head: Vec<f32>,
    int8: Option<QuantWeights>,
    block_size: usize,
    num_blocks: usize,
    links: Vec<Link>,
    lost: Option<BackendLost>,
    next_id: u64,
    /// Removed when the backend is dropped.
    pki: PathBuf,
    _endpoint: ControlEndpoint,
}

impl PipelineBackend {
    /// Starts `opts.ranks` ranks through `start` (rank, the control address, the folder of
    /// certificates), hands each its blocks, and keeps unit 0 of `params` — parameters of the
    /// flat range from `base`, unit 0's at least (the rest is dropped here: the ranks read
    /// their own).
    pub fn launch(model: Model, params: Vec<f32>, base: usize, opts: PipelineOptions, start: &mut StartRank) -> Result<PipelineBackend> {
        refuse_dropping_experts(&model)?;
        let unit0 = model.units_range(0..1);
        ensure!(
            unit0.start >= base && unit0.end <= base + params.len(),
            "the serving process holds parameters {base}..{}, not the embeddings and head ({unit0:?})",
            base + params.len()
        );
        let spans = stage_blocks(&model, opts.ranks)?;
        let pki = pki_dir()?;
        let ca = ClusterCa::generate()?;
        for r in 0..opts.ranks {
            ca.issue_to_dir(&pki, &node_name(r)).with_context(|| format!("the identity of rank {r}"))?;
        }
        let server = ca.issue(COORDINATOR_NAME)?.server_config_for(ALPN_CONTROL, ClientAuth::Required)?;
        let endpoint = ControlEndpoint::bind(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0), Some(server))?;
        let control = endpoint.local_addr()?;
        let mut procs: Vec<Option<Box<dyn RankProcess>>> = Vec::with_capacity(opts.ranks);
        for r in 0..opts.ranks {
            procs.push(Some(start(r, control, &pki).with_context(|| format!("starting rank {r}"))?));
        }
        let links = accept_ranks(&endpoint, &model, procs, &spans);
        let links = match links {
            Ok(l) => l,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&pki);
                return Err(e);
            }
        };
        let head = params[unit0.start - base..unit0.end - base].to_vec();
        drop(params);
        let int8 =
            (opts.weights == LinearFormat::Int8).then(|| model.quantize_int8_units(&ParamsAt { params: &head, base: 0, int8: None }, 0..1));
        let mut b = PipelineBackend {
            model,
            head,
            int8,
            block_size: opts.block_size,
            num_blocks: opts.num_blocks,
            links,
            lost: None,
            next_id: 0,
            pki,
            _endpoint: endpoint,
        };
        b.assign(opts)?;
        Ok(b)
    }

    /// The blocks each rank holds.
    pub fn spans(&self) -> Vec<Range<usize>> {
        self.links.iter().map(|l| l.blocks.clone()).collect()
    }

    /// Sends each rank its blocks and waits for it to hold them.
    fn assign(&mut self, opts: PipelineOptions) -> Result<()> {
        for (r, l) in self.links.iter_mut().enumerate() {
            let msg = ToRank::Assign {
                blocks_start: l.blocks.start as u64,
                blocks_end: l.blocks.end as u64,
                block_size: opts.block_size as u64,
                num_blocks: opts.num_blocks as u64,
                int8: opts.weights == LinearFormat::Int8,
            };
            let who = l.who(r);
            wire::send(&mut l.conn, &msg).with_context(|| format!("assigning {who} its blocks"))?;
        }
        let deadline = Some(Instant::now() + Duration::from_millis(STARTUP_TIMEOUT_MS));
        for (r, l) in self.links.iter().enumerate() {
            let who = l.who(r);
            let wait = Wait { what: "Ready", deadline, alive: &|| l.alive() };
            match wire::recv(&mut l.conn.clone(), "Ready", &wait).with_context(|| format!("{who} while loading its blocks"))? {
                FromRank::Ready { param_bytes, cache_bytes } => {
                    tracing::info!("{who}: {param_bytes} bytes of parameters, {cache_bytes} bytes of key/value cache");
                }
                FromRank::Failed { why } => bail!("{who} could not hold its blocks: {why}"),
                other => bail!("{who} answered {other:?} instead of Ready"),
            }
        }
        Ok(())
    }

    /// Runs rank `r`'s blocks on the stream `x` of the step `seqs`.
    fn run_rank(&self, r: usize, id: u64, seqs: &[WireSeq], x: Vec<f32>) -> Result<Vec<f32>, String> {
        let l = &self.links[r];
        let mut conn = l.conn.clone();
        let step = ToRank::Step { id, seqs: seqs.to_vec(), x: wire::describe(&[("x", &x)]).remove(0) };
        wire::send(&mut conn, &step).and_then(|()| wire::send_bulk(&mut conn, &[&x])).map_err(|e| format!("sending it step {id}: {e}"))?;
        let deadline = Some(Instant::now() + Duration::from_millis(RANK_STEP_TIMEOUT_MS));
        let wait = Wait { what: "the rank's step", deadline, alive: &|| l.alive() };
        // A closed connection says why (an idle timeout: the rank hung).
        let why = |e: WireError| format!("{e}{}", conn.closed_reason().map(|r| format!(" ({r})")).unwrap_or_default());
        match wire::recv(&mut conn.clone(), "Done", &wait).map_err(|e| format!("waiting for step {id}: {}", why(e)))? {
            FromRank::Done { id: got, y } if got == id => {
                let mut ys = wire::recv_bulk(&mut conn, &[y], x.len(), &wait).map_err(|e| format!("reading step {id}: {e}"))?;
                let y = ys.remove(0);
                if y.len() != x.len() {
                    return Err(format!("step {id}: a stream of {} values back for {}", y.len(), x.len()));
                }
                Ok(y)
            }
            FromRank::Failed { why } => Err(format!("it failed step {id}: {why}")),
            other => Err(format!("it answered {other:?} to step {id}")),
        }
    }

    /// Marks the backend lost (rank `r`, `why`) and stops every rank.
    fn lose(&mut self, r: usize, why: String) -> BackendLost {
        let lost = BackendLost(format!("{} of the pipeline: {why}", self.links[r].who(r)));
        tracing::error!("{lost}");
        for l in &self.links {
            l.conn.abort("the pipeline lost a rank");
            l.process.lock().unwrap_or_else(|p| p.into_inner()).stop();
        }
        self.lost = Some(lost.clone());
        lost
    }
}

impl Backend for PipelineBackend {
    fn block_size(&self) -> usize {
        self.block_size
    }

    fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    fn vocab_size(&self) -> usize {
        self.model.cfg.vocab_size
    }

    fn max_seq_len(&self) -> usize {
        self.model.cfg.max_seq_len
    }

    fn step(&mut self, batch: &[SeqStep<'_>]) -> Result<Vec<Vec<f32>>> {
        if let Some(lost) = &self.lost {
            return Err(lost.clone().into());
        }
        check_step(&self.model.cfg, self.block_size, self.num_blocks, batch)?;
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let rows = StepRows::of(batch);
        let pos = self.model.paged_positions(rows.tokens.len(), &rows.seqs);
        let at = ParamsAt { params: &self.head, base: 0, int8: self.int8.as_ref() };
        let mut x = Vec::new();
        self.model.embed_paged(&at, &rows.tokens, &pos, &mut x);
        let bs = self.block_size;
        let seqs: Vec<WireSeq> = batch
            .iter()
            .map(|s| {
                let need = (s.start + s.tokens.len()).div_ceil(bs);
                WireSeq { tokens: s.tokens.to_vec(), start: s.start as u64, table: s.block_table[..need].to_vec() }
            })
            .collect();
        let id = self.next_id;
        self.next_id += 1;
        for r in 0..self.links.len() {
            x = match self.run_rank(r, id, &seqs, x) {
                Ok(y) => y,
                Err(why) => return Err(self.lose(r, why).into()),
            };
        }
        let at = ParamsAt { params: &self.head, base: 0, int8: self.int8.as_ref() };
        let logits = self.model.head_paged(&at, &x, &rows.wanted);
        Ok(logits.chunks_exact(self.model.cfg.vocab_size).map(<[f32]>::to_vec).collect())
    }
}

impl Drop for PipelineBackend {
    /// Tells every rank to stop, waits for them (bounded), then stops those still running.
    fn drop(&mut self) {
        for l in &mut self.links {
            let _ = wire::send(&mut l.conn, &ToRank::Shutdown);
        }
        let deadline = Instant::now() + Duration::from_millis(EXIT_TIMEOUT_MS);
        for l in &self.links {
            let mut p = l.process.lock().unwrap_or_else(|p| p.into_inner());
            while p.exited().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            p.stop();
        }
        let _ = std::fs::remove_dir_all(&self.pki);
    }
}

/// A private folder for the ranks' certificates (mode 0700), removed by the backend.
fn pki_dir() -> Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let dir = std::env::temp_dir().join(format!("tessera-serve-{}-{nanos}", std::process::id()));
    std::fs::DirBuilder::new().mode(0o700).create(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

/// Accepts one connection per rank (each presenting its rank's certificate), reads each
/// `Hello` and checks the model it loaded against `model`; fails at once when a rank's
/// process ends, and after [`STARTUP_TIMEOUT_MS`].
fn accept_ranks(
    endpoint: &ControlEndpoint,
    model: &Model,
    mut procs: Vec<Option<Box<dyn RankProcess>>>,
    spans: &[Range<usize>],
) -> Result<Vec<Link>> {
    let deadline = Instant::now() + Duration::from_millis(STARTUP_TIMEOUT_MS);
    let mut links: Vec<Option<Link>> = (0..spans.len()).map(|_| None).collect();
    while links.iter().any(Option::is_none) {
        for (r, p) in procs.iter_mut().enumerate() {
            if let Some(how) = p.as_mut().and_then(|p| p.exited()) {
                bail!("rank {r} {how} during start-up");
            }
        }
        ensure!(Instant::now() < deadline, "the ranks did not connect within {STARTUP_TIMEOUT_MS} ms");
        let mut conn = match endpoint.accept(ACCEPT_POLL_MS) {
            Ok(Some(c)) => c,
            Ok(None) => continue,
            Err(why) => {
                tracing::warn!("refused a connection to the pipeline's control endpoint: {why}");
                continue;
            }
        };
        let wait = Wait { what: "Hello", deadline: Some(deadline), alive: &|| Ok(()) };
        let FromRank::Hello { rank, pid, num_params, n_layer, d_model, vocab_size } = wire::recv(&mut conn, "Hello", &wait)? else {
            bail!("a rank opened with another message than Hello");
        };
        let r = rank as usize;
        ensure!(r < spans.len() && links[r].is_none(), "a rank said it is rank {rank}: not a free rank of {}", spans.len());
        let cert = conn.peer_certificate().context("a rank connected without a certificate")?;
        check_cert_names_node(&cert, &node_name(r)).map_err(|e| anyhow::anyhow!("a rank claiming rank {r}: {e}"))?;
        let cfg = &model.cfg;
        let theirs = (num_params, n_layer, d_model, vocab_size);
        let ours = (model.num_params() as u64, cfg.n_layer as u64, cfg.d_model as u64, cfg.vocab_size as u64);
        ensure!(
            theirs == ours,
            "rank {r} loaded another model: (parameters, layers, width, vocabulary) = {theirs:?}, this server has {ours:?}"
        );
        let process = Mutex::new(procs[r].take().expect("a rank connects once"));
        links[r] = Some(Link { conn, process, blocks: spans[r].clone(), pid });
    }
    Ok(links.into_iter().flatten().collect())
}
