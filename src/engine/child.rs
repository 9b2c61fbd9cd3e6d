//! The worker process of `tessera train --nprocs N` (`tessera worker`, hidden): one rank's
//! `ZeroWorker` over a `QuicComm` with mutual TLS, driven by the parent through its control
//! connection (see [`super::remote`] for the whole design and [`super::wire`] for the protocol).
//!
//! The worker rebuilds the plan from the resolved config the parent wrote (and proves it by the
//! config hash), receives its start state from the parent, and then answers requests one at a
//! time. It exits when the control connection closes, on `Shutdown`, or when its parent process
//! is gone (the parent id changes), so a worker never outlives its run.

use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tessera_actors::compute::{StepOrder, WorkerCompute};
use tessera_transport::quic::{ClusterSpec, NodeTls, QuicComm};

use super::plan::Plan;
use super::ranks::{master_window, rank_state, StartCut};
use super::remote::{node_name, STARTUP_TIMEOUT_MS};
use super::wire::{self, Snapshot, StateCounters, ToParent, ToWorker, Wait, WireError, WirePrepared};
use super::zero::{RankState, ZeroWorker};
use crate::bridge;
use crate::config::{self, ResolveContext};
use crate::data::{self, Sampler};

/// Bound on building the QUIC mesh (ms).
const MESH_TIMEOUT_MS: u64 = 60_000;

/// Arguments of `tessera worker`.
#[derive(Debug, Clone)]
pub struct WorkerArgs {
    pub rank: usize,
    pub world: usize,
    /// The parent's control address.
    pub control: SocketAddr,
    /// The run's `procs` directory: `config.json` and `pki/`.
    pub dir: PathBuf,
}

fn snapshot(st: &RankState, rank: usize) -> Snapshot {
    Snapshot {
        memory: wire::WireMemory::from_report(&st.memory(rank)),
        applied: st.applied,
        skipped: st.skipped,
        scale_bits: st.scaler.as_ref().map(|s| s.scale().to_bits()),
        bytes_sent_total: st.bytes_sent_total,
    }
}

/// Fails once the process that started this worker is gone.
fn parent_alive(parent: u32) -> Result<(), WireError> {
    match std::os::unix::process::parent_id() == parent {
        true => Ok(()),
        false => Err(WireError::Closed),
    }
}

/// Loads the config, data and plan the parent resolved.
fn load_plan(a: &WorkerArgs) -> Result<(crate::config::Config, Arc<Plan>, Arc<Sampler>)> {
    let path = a.dir.join("config.json");
    let ctx = ResolveContext { world_size: Some(a.world), ..Default::default() };
    let cfg = config::load(&path, &[], &ctx).with_context(|| format!("loading {}", path.display()))?;
    let data_path = cfg.tessera.data.as_ref().map_or_else(data::default_corpus_path, PathBuf::from);
    let dataset = data::load(&data_path, cfg.tessera.tokenizer.as_deref().map(Path::new), data::DEFAULT_VAL_FRACTION)
        .with_context(|| format!("loading data from {}", data_path.display()))?;
    let plan = Arc::new(Plan::new(&cfg, &dataset)?);
    if plan.world != a.world {
        bail!("the config resolves to world {}, the parent asked for {}", plan.world, a.world);
    }
    let sampler = Arc::new(Sampler::new(dataset.train.clone(), plan.seq_len, cfg.tessera.seed).context("training data")?);
    Ok((cfg, plan, sampler))
}

/// Receives the start state and builds this rank's state from it.
fn recv_start(stream: &mut TcpStream, cfg: &crate::config::Config, plan: &Plan, rank: usize, wait: &Wait<'_>) -> Result<RankState> {
    let (master_start, counters, descs) = match wire::recv(stream, "Start", wait)? {
        ToWorker::Start { master_start, counters, buffers } => (master_start, counters, buffers),
        other => bail!("expected the start state, got {other:?}"),
    };
    let window = master_window(plan, rank);
    if master_start != window.start as u64 || descs.first().is_none_or(|d| d.len != window.len() as u64) {
        bail!("start state: masters at {master_start} of {:?} values, this rank needs {window:?}", descs.first().map(|d| d.len));
    }
    let mut bufs = wire::recv_bulk(stream, &descs, window.len(), wait)?;
    // Transient: the full-length buffer `RankState::new` indexes; only the window is read.
    let mut master = vec![0.0f32; plan.total()];
    master[window].copy_from_slice(&bufs.remove(0));
    let optim = counters.optimizer_steps.map(|steps| (steps, descs[1..].iter().map(|d| d.name.clone()).zip(bufs).collect()));
    let cut = StartCut { optim, applied: counters.applied, skipped: counters.skipped, scaler: counters.scaler };
    rank_state(cfg, plan, rank, &master, &cut)
}

/// Sends this rank's masters, its optimizer buffers when asked, and counters.
fn export(stream: &mut TcpStream, st: &RankState, optim: bool) -> Result<(), WireError> {
    let mut bufs: Vec<(&str, &[f32])> = vec![("master", &st.master)];
    if optim {
        bufs.extend(st.optim.state_buffers());
    }
    let counters = StateCounters {
        optimizer_steps: Some(st.optim.step_count()),
        applied: st.applied,
        skipped: st.skipped,
        scaler: st.scaler.as_ref().map(bridge::scaler_to_json),
    };
    wire::send(stream, &ToParent::Exported { counters, buffers: wire::describe(&bufs) })?;
    wire::send_bulk(stream, &bufs.iter().map(|(_, b)| *b).collect::<Vec<_>>())
}

/// Answers one request; returns false on `Shutdown`.
fn serve_one(msg: ToWorker, stream: &mut TcpStream, worker: &mut ZeroWorker, state: &Mutex<RankState>, rank: usize) -> Result<bool> {
    let snap = || snapshot(&state.lock().unwrap_or_else(|p| p.into_inner()), rank);
    let reply = match msg {
        ToWorker::Prepare { step, epoch, attempt } => match worker.prepare(&StepOrder { step, epoch, attempt }) {
            Ok(p) => ToParent::Prepared { prepared: WirePrepared::new(&p), snapshot: snap() },
            Err(error) => ToParent::Failed { error },
        },
        ToWorker::Commit { step } => match worker.commit(step) {
            Ok(()) => ToParent::Committed { snapshot: snap() },
            Err(error) => ToParent::Failed { error },
        },
        ToWorker::Abandon { step } => {
            worker.abandon(step);
            ToParent::Abandoned
        }
        ToWorker::Export { optim } => {
            export(stream, &state.lock().unwrap_or_else(|p| p.into_inner()), optim)?;
            return Ok(true);
        }
        ToWorker::Shutdown => return Ok(false),
        other => bail!("unexpected request {other:?}"),
    };
    wire::send(stream, &reply)?;
    Ok(true)
}

/// `tessera worker`: runs one rank until the parent says stop or goes away.
pub fn run_worker(a: &WorkerArgs) -> Result<()> {
    let parent = std::os::unix::process::parent_id();
    let alive = move || parent_alive(parent);
    let rank = a.rank;
    let mut stream = TcpStream::connect_timeout(&a.control, Duration::from_millis(STARTUP_TIMEOUT_MS))
        .with_context(|| format!("rank {rank}: connecting to the parent at {}", a.control))?;
    let _ = stream.set_nodelay(true);
    let (cfg, plan, sampler) = load_plan(a).with_context(|| format!("rank {rank}"))?;
    let socket = UdpSocket::bind("127.0.0.1:0").context("binding the QUIC socket")?;
    let quic_addr = socket.local_addr().context("QUIC socket address")?.to_string();
    let hello = ToParent::Hello { rank: rank as u64, pid: std::process::id(), quic_addr, config_hash: cfg.hash.clone() };
    wire::send(&mut stream, &hello)?;
    let deadline = Some(Instant::now() + Duration::from_millis(STARTUP_TIMEOUT_MS));
    let wait = Wait { what: "the start-up messages", deadline, alive: &alive };
    let addrs = match wire::recv(&mut stream, "Mesh", &wait)? {
        ToWorker::Mesh { addrs } => addrs,
        other => bail!("rank {rank}: expected the addresses, got {other:?}"),
    };
    let addrs = addrs.iter().map(|s| s.parse::<SocketAddr>().with_context(|| format!("address {s:?}"))).collect::<Result<Vec<_>>>()?;
    let state = recv_start(&mut stream, &cfg, &plan, rank, &wait).with_context(|| format!("rank {rank}: start state"))?;
    let state = Arc::new(Mutex::new(state));
    let spec = ClusterSpec { addrs, names: (0..a.world).map(node_name).collect() };
    let tls = NodeTls::load(&a.dir.join("pki"), &node_name(rank))?;
    let comm = QuicComm::connect_socket(socket, rank, &spec, &tls, MESH_TIMEOUT_MS).with_context(|| format!("rank {rank}: QUIC mesh"))?;
    let mut worker = ZeroWorker::new(rank, Arc::clone(&plan), sampler, Box::new(comm), Arc::clone(&state));
    let ready = snapshot(&state.lock().unwrap_or_else(|p| p.into_inner()), rank);
    wire::send(&mut stream, &ToParent::Ready { snapshot: ready })?;
    let idle = Wait { what: "a request", deadline: None, alive: &alive };
    loop {
        let msg = match wire::recv(&mut stream, "a request", &idle) {
            Ok(m) => m,
            Err(WireError::Closed) => return Ok(()),
            Err(e) => return Err(e).context(format!("rank {rank}: control connection")),
        };
        if !serve_one(msg, &mut stream, &mut worker, &state, rank)? {
            return Ok(());
        }
    }
}
