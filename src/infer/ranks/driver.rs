//! The serving process's side: [`PipelineBackend`] starts the ranks, gives each its blocks, and
//! runs every step through them in order behind [`Backend`].

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tessera_fleet::rendezvous::{
    assign_ranks, node_name, read_join, AgentAuth, Joined, NotAdmitted, COORDINATOR_NAME, EXIT_TIMEOUT_MS, STARTUP_TIMEOUT_MS,
};
use tessera_fleet::wire::{self, Wait, WireError};
use tessera_kernels::model::paged::{ParamsAt, QuantWeights};
use tessera_kernels::model::Model;
use tessera_transport::quic::{ClientAuth, ClusterCa, ControlConn, ControlEndpoint, RefusalLog, ALPN_CONTROL};

use super::rank::WeightLoader;
use super::tables::TableSender;
use super::wire::{FromRank, TableUpdate, ToRank, WireSeq};
use super::{span_blake3, stage_blocks, RankProcess};
use crate::infer::backend::{check_step, Backend, BackendLost, SeqStep, StepRows};
use crate::infer::cpu::{refuse_dropping_experts, LinearFormat};

/// Bound on one step of one rank (a long prompt chunk of a large model on a slow CPU), ms. A
/// rank that dies is seen at once (its process, or its connection closing); one that hangs
/// loses its connection after the control plane's idle timeout.
pub const RANK_STEP_TIMEOUT_MS: u64 = 600_000;
/// How often the start-up waits look at the rank processes, ms.
const ACCEPT_POLL_MS: u64 = 100;
/// Bound on a joined rank's `Hello` (it opened its model before dialling), ms.
const HELLO_TIMEOUT_MS: u64 = 10_000;

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

/// Where a pipeline's ranks come from.
pub enum RankSource<'a> {
    /// Started here by `start` (rank, the control address, the folder of certificates made for
    /// this server → its process); each joins with its `node-<r>` certificate (mutual TLS).
    Spawn(&'a mut StartRank<'a>),
    /// `tessera serve-rank --join` processes from any host (`tessera serve --rank-listen`), at
    /// an endpoint [`crate::launch::rendezvous_endpoint`] bound (a join token, or `--certs`),
    /// within `join_timeout_ms`.
    Join { endpoint: Box<ControlEndpoint>, auth: AgentAuth, join_timeout_ms: u64 },
}

/// One rank as the serving process sees it.
struct Link {
    conn: ControlConn,
    process: Mutex<Box<dyn RankProcess>>,
    blocks: Range<usize>,
    /// "pid 42 at 10.0.0.2".
    at: String,
}

impl Link {
    fn who(&self, r: usize) -> String {
        format!("rank {r} (blocks {}..{}, {})", self.blocks.start, self.blocks.end, self.at)
    }

    /// `Err` once the rank's process (or thread, or connection) has ended.
    fn alive(&self) -> Result<(), WireError> {
        match self.process.lock().unwrap_or_else(|p| p.into_inner()).exited() {
            Some(how) => Err(WireError::Control(format!("its process {how}"))),
            None => Ok(()),
        }
    }
}

/// A rank on another host, watched through its connection.
struct Remote(ControlConn);

impl RankProcess for Remote {
    fn exited(&mut self) -> Option<String> {
        self.0.closed_reason().map(|r| format!("is unreachable: its connection closed ({r})"))
    }

    fn stop(&mut self) {
        self.0.abort("the pipeline stops");
    }
}

/// A model served with its blocks split over rank processes (pipeline parallelism): this
/// process holds unit 0 (embeddings, final norm, head) and runs the embeddings and the head;
/// rank `r` holds blocks `spans[r]` and their layers of the paged cache. A step's stream goes
/// through the ranks in order over their control connections (QUIC; mutual TLS, or a join
/// token over TLS pinned to this server's CA). The same ops on the same rows as
/// [`crate::infer::CpuBackend`]: the same logits, bit for bit.
pub struct PipelineBackend {
    model: Model,
    /// Unit 0's parameters, and its int8 head.
    head: Vec<f32>,
    int8: Option<QuantWeights>,
    block_size: usize,
    num_blocks: usize,
    links: Vec<Link>,
    tables: TableSender,
    lost: Option<BackendLost>,
    next_id: u64,
    /// Removed when the backend is dropped.
    pki: Option<PathBuf>,
    /// Refuses ranks that come once every rank is held; stopped with the backend.
    door: Option<Door>,
}

impl PipelineBackend {
    /// Gathers `opts.ranks` ranks from `source`, hands each its blocks, checks that what each
    /// holds is this model's (`load` reads the parameters of a flat range outside `params`, for
    /// the check), and keeps unit 0 of `params` (parameters of the flat range from `base`, unit
    /// 0's at least).
    pub fn launch(
        model: Model,
        params: &[f32],
        base: usize,
        load: &WeightLoader,
        opts: PipelineOptions,
        source: RankSource,
    ) -> Result<PipelineBackend> {
        refuse_dropping_experts(&model)?;
        let unit0 = model.units_range(0..1);
        let held = base..base + params.len();
        ensure!(
            unit0.start >= held.start && unit0.end <= held.end,
            "the serving process holds parameters {held:?}, not the embeddings and head ({unit0:?})"
        );
        let spans = stage_blocks(&model, opts.ranks)?;
        let mut expected = Vec::with_capacity(spans.len());
        for s in &spans {
            let flat = model.units_range(s.start + 1..s.end + 1);
            expected.push(match flat.start >= held.start && flat.end <= held.end {
                true => span_blake3(&params[flat.start - base..flat.end - base]),
                false => span_blake3(&load(&model, flat).with_context(|| format!("reading the parameters of blocks {s:?}"))?),
            });
        }
        let (endpoint, auth, mut procs, join_timeout_ms, pki) = open(source, opts.ranks)?;
        let gathered = gather(&endpoint, &auth, join_timeout_ms, &model, &mut procs, spans.len());
        let links = gathered.and_then(|members| place(members, procs, &spans));
        let links = match links {
            Ok(l) => l,
            Err(e) => {
                if let Some(p) = &pki {
                    let _ = std::fs::remove_dir_all(p);
                }
                return Err(e);
            }
        };
        let head = params[unit0.start - base..unit0.end - base].to_vec();
        let int8 =
            (opts.weights == LinearFormat::Int8).then(|| model.quantize_int8_units(&ParamsAt { params: &head, base: 0, int8: None }, 0..1));
        let mut b = PipelineBackend {
            model,
            head,
            int8,
            block_size: opts.block_size,
            num_blocks: opts.num_blocks,
            links,
            tables: TableSender::default(),
            lost: None,
            next_id: 0,
            pki,
            door: None,
        };
        b.assign(opts, &expected)?;
        b.door = Some(Door::open(endpoint, auth, b.links.iter().enumerate().map(|(r, l)| l.who(r)).collect())?);
        Ok(b)
    }

    /// The blocks each rank holds.
    pub fn spans(&self) -> Vec<Range<usize>> {
        self.links.iter().map(|l| l.blocks.clone()).collect()
    }

    /// Sends each rank its blocks, waits for it to hold them and checks that they are this
    /// model's (`expected[r]`: the fingerprint of rank `r`'s blocks' parameters).
    fn assign(&mut self, opts: PipelineOptions, expected: &[String]) -> Result<()> {
        for (r, l) in self.links.iter_mut().enumerate() {
            let msg = ToRank::Assign {
                rank: r as u64,
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
                FromRank::Ready { params_blake3, .. } if params_blake3 != expected[r] => {
                    let why = format!(
                        "{who} loaded other weights for its blocks than this server's model (BLAKE3 {params_blake3}, the server's {}): \
                         every rank needs the served model at its --model",
                        expected[r]
                    );
                    l.conn.abort(&why);
                    bail!(why)
                }
                FromRank::Ready { param_bytes, cache_bytes, .. } => {
                    tracing::info!("{who}: {param_bytes} bytes of parameters, {cache_bytes} bytes of key/value cache");
                }
                FromRank::Failed { why } => bail!("{who} could not hold its blocks: {why}"),
                other => bail!("{who} answered {other:?} instead of Ready"),
            }
        }
        Ok(())
    }

    /// Runs rank `r`'s blocks on the stream `x` of the step `seqs`, after the table changes
    /// `tables`.
    fn run_rank(&self, r: usize, id: u64, tables: &[Vec<TableUpdate>], seqs: &[WireSeq], x: Vec<f32>) -> Result<Vec<f32>, String> {
        let l = &self.links[r];
        let mut conn = l.conn.clone();
        for updates in tables {
            let msg = ToRank::Tables { updates: updates.clone() };
            wire::send(&mut conn, &msg).map_err(|e| format!("sending it the tables of step {id}: {e}"))?;
        }
        let step = ToRank::Step { id, seqs: seqs.to_vec(), x: wire::describe(&[("x", &x)]).remove(0) };
        wire::send(&mut conn, &step).and_then(|()| wire::send_bulk(&mut conn, &[&x])).map_err(|e| format!("sending it step {id}: {e}"))?;
        let deadline = Some(Instant::now() + Duration::from_millis(RANK_STEP_TIMEOUT_MS));
        let wait = Wait { what: "the rank's step", deadline, alive: &|| l.alive() };
        // A closed connection says why (an idle timeout: the rank hung, or its host is cut off).
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
        let tables: Vec<&[u32]> = batch.iter().map(|s| &s.block_table[..(s.start + s.tokens.len()).div_ceil(bs)]).collect();
        let (slots, updates) = self.tables.step(&tables);
        let seqs: Vec<WireSeq> =
            batch.iter().zip(slots).map(|(s, slot)| WireSeq { rows: s.tokens.len() as u32, start: s.start as u64, slot }).collect();
        let id = self.next_id;
        self.next_id += 1;
        for r in 0..self.links.len() {
            x = match self.run_rank(r, id, &updates, &seqs, x) {
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
        self.door.take();
        if let Some(p) = &self.pki {
            let _ = std::fs::remove_dir_all(p);
        }
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

/// The control endpoint, how ranks prove they belong, the spawned ranks' processes (by rank),
/// the join timeout and the folder of certificates made here.
type Opened = (ControlEndpoint, AgentAuth, Vec<Option<Box<dyn RankProcess>>>, u64, Option<PathBuf>);

/// Opens the door the ranks join by: for spawned ranks a loopback endpoint, a CA made for this
/// server and a `node-<r>` certificate for each (in a private folder), then the processes.
fn open(source: RankSource, ranks: usize) -> Result<Opened> {
    match source {
        RankSource::Join { endpoint, auth, join_timeout_ms } => {
            Ok((*endpoint, auth, (0..ranks).map(|_| None).collect(), join_timeout_ms, None))
        }
        RankSource::Spawn(start) => {
            let pki = pki_dir()?;
            let ca = ClusterCa::generate()?;
            for r in 0..ranks {
                ca.issue_to_dir(&pki, &node_name(r)).with_context(|| format!("the identity of rank {r}"))?;
            }
            let server = ca.issue(COORDINATOR_NAME)?.server_config_for(ALPN_CONTROL, ClientAuth::Required)?;
            let endpoint = ControlEndpoint::bind(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0), Some(server))?;
            let control = endpoint.local_addr()?;
            let mut procs = Vec::with_capacity(ranks);
            for r in 0..ranks {
                procs.push(Some(start(r, control, &pki).with_context(|| format!("starting rank {r}"))?));
            }
            Ok((endpoint, AgentAuth::Certs { dir: pki.clone() }, procs, STARTUP_TIMEOUT_MS, Some(pki)))
        }
    }
}

/// Waits (bounded by `join_timeout_ms`) for `ranks` ranks to join at `endpoint` ([`admit`]).
/// Fails at once when a spawned rank's process ends, when a rank loaded another model or when
/// two ask for the same rank; the ranks that joined then hear why (their connections close with
/// it).
fn gather(
    endpoint: &ControlEndpoint,
    auth: &AgentAuth,
    join_timeout_ms: u64,
    model: &Model,
    procs: &mut [Option<Box<dyn RankProcess>>],
    ranks: usize,
) -> Result<Vec<Joined>> {
    let at = endpoint.local_addr().map(|a| a.to_string()).unwrap_or_else(|_| "the control endpoint".into());
    let deadline = Instant::now() + Duration::from_millis(join_timeout_ms);
    let mut members: Vec<Joined> = Vec::new();
    let mut refusals = RefusalLog::new("serve: refused a connection to the ranks' endpoint");
    let ours = format!("{:?}", model.cfg);
    while members.len() < ranks {
        let next = procs.iter_mut().enumerate().find_map(|(r, p)| Some((r, p.as_mut()?.exited()?)));
        let got = match next {
            Some((r, how)) => Err(anyhow::anyhow!("rank {r} {how} during start-up")),
            None if Instant::now() >= deadline => {
                let joined = if members.is_empty() { "none".into() } else { members.iter().map(who).collect::<Vec<_>>().join(", ") };
                Err(anyhow::anyhow!("only {} of {ranks} ranks joined {at} within {join_timeout_ms} ms (joined: {joined})", members.len()))
            }
            None => admit(endpoint, auth, &ours, &members, ranks, &mut refusals),
        };
        match got {
            Ok(Some(j)) => {
                tracing::info!("serve: {} joined ({} of {ranks})", who(&j), members.len() + 1);
                members.push(j);
            }
            Ok(None) => {}
            Err(e) => {
                for m in &members {
                    m.conn.abort(&format!("{e:#}"));
                }
                return Err(e);
            }
        }
    }
    Ok(members)
}

/// One connection to the ranks' endpoint, if one comes within a poll: it proves it belongs
/// (`auth`: [`read_join`], as agents join a coordinator; a stranger is refused and logged,
/// `Ok(None)`) and says what model it loaded (its `ModelConfig`, which must be `ours`); a rank
/// it asks for must be free (`members` hold the others). `Err`: a rank that cannot take part
/// (its connection closes with why).
fn admit(
    endpoint: &ControlEndpoint,
    auth: &AgentAuth,
    ours: &str,
    members: &[Joined],
    ranks: usize,
    refusals: &mut RefusalLog,
) -> Result<Option<Joined>> {
    let conn = match endpoint.accept(ACCEPT_POLL_MS) {
        Ok(Some(c)) => c,
        Ok(None) => return Ok(None),
        Err(why) => {
            refusals.refused(&why);
            return Ok(None);
        }
    };
    let mut j = match read_join(conn, ranks, auth)? {
        Ok(j) => j,
        Err(NotAdmitted(why)) => {
            refusals.refused(&why);
            return Ok(None);
        }
    };
    let who = who(&j);
    let wait = Wait { what: "Hello", deadline: Some(Instant::now() + Duration::from_millis(HELLO_TIMEOUT_MS)), alive: &|| Ok(()) };
    let theirs = match wire::recv(&mut j.conn, "Hello", &wait).with_context(|| format!("{who}: its Hello"))? {
        FromRank::Hello { model, .. } => model,
        other => bail!("{who} opened with {other:?} instead of Hello"),
    };
    let refuse = |why: String| {
        j.conn.abort(&why);
        Err(anyhow::anyhow!(why))
    };
    if theirs != ours {
        return refuse(format!("{who} loaded another model than this server's: {}", config_difference(&theirs, ours)));
    }
    if let Some(other) = j.rank.and_then(|r| members.iter().find(|m| m.rank == Some(r))) {
        return refuse(format!("{who} asks for rank {}, which {} asked for first", j.rank.unwrap_or_default(), self::who(other)));
    }
    Ok(Some(j))
}

/// "serve-rank NAME at IP (pid PID)".
fn who(j: &Joined) -> String {
    format!("serve-rank {} at {} (pid {})", j.name, j.peer.ip(), j.pid)
}

/// Where two `ModelConfig` `Debug` texts first differ: "n_layer: 2 (the server's: 3)".
fn config_difference(theirs: &str, ours: &str) -> String {
    let split =
        |s: &str| s.split([',', '{', '}', '(', ')']).map(str::trim).filter(|p| !p.is_empty()).map(str::to_string).collect::<Vec<_>>();
    let (a, b) = (split(theirs), split(ours));
    match a.iter().zip(&b).find(|(x, y)| x != y) {
        Some((x, y)) => format!("{x} (the server's: {y})"),
        None => format!("{theirs} (the server's: {ours})"),
    }
}

/// Gives the members their ranks (asked-for ones first, the others in join order) and links
/// each to its process: the spawned one of its rank, or its connection.
fn place(members: Vec<Joined>, mut procs: Vec<Option<Box<dyn RankProcess>>>, spans: &[Range<usize>]) -> Result<Vec<Link>> {
    let names: Vec<String> = members.iter().map(|m| m.name.clone()).collect();
    let ranks = assign_ranks(&members.iter().map(|m| m.rank).collect::<Vec<_>>(), &names, spans.len())?;
    let mut links: Vec<Option<Link>> = (0..spans.len()).map(|_| None).collect();
    for (m, r) in members.into_iter().zip(ranks) {
        let at = format!("pid {} at {}", m.pid, m.peer.ip());
        let conn = m.conn;
        let process = procs[r].take().unwrap_or_else(|| Box::new(Remote(conn.clone())));
        links[r] = Some(Link { conn, process: Mutex::new(process), blocks: spans[r].clone(), at });
    }
    links.into_iter().enumerate().map(|(r, l)| l.with_context(|| format!("no rank {r}"))).collect()
}

/// The ranks' endpoint once every rank is held: a thread that refuses whoever else joins,
/// naming the ranks that hold the spans (a second `serve-rank --rank 1` hears who has it).
struct Door {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// The ranks' connections run on its runtime: it lives as long as they do.
    _endpoint: Arc<ControlEndpoint>,
}

impl Door {
    fn open(endpoint: ControlEndpoint, auth: AgentAuth, holders: Vec<String>) -> Result<Door> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let endpoint = Arc::new(endpoint);
        let ours = Arc::clone(&endpoint);
        let thread = std::thread::Builder::new()
            .name("tessera-serve-door".into())
            .spawn(move || {
                let full = format!("every rank of this server is held ({})", holders.join("; "));
                let mut refusals = RefusalLog::new("serve: refused a connection to the ranks' endpoint");
                while !flag.load(Ordering::Relaxed) {
                    match ours.accept(ACCEPT_POLL_MS) {
                        Ok(Some(conn)) => match read_join(conn, holders.len(), &auth) {
                            Ok(Ok(j)) => {
                                tracing::warn!("serve: refused {}: {full}", who(&j));
                                j.conn.abort(&full);
                            }
                            Ok(Err(NotAdmitted(why))) => refusals.refused(&why),
                            Err(e) => tracing::warn!("serve: refused a rank: {e:#}"),
                        },
                        Ok(None) => {}
                        Err(why) => refusals.refused(&why),
                    }
                }
            })
            .context("starting the thread that refuses more ranks")?;
        Ok(Door { stop, thread: Some(thread), _endpoint: endpoint })
    }
}

impl Drop for Door {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
