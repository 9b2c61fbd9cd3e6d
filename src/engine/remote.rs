//! Ranks as worker processes (`tessera train --nprocs N`): the parent keeps the driver and the
//! actor tree; each rank's `WorkerCompute` is a [`RemoteCompute`] proxy that forwards prepare,
//! commit and abandon to its worker process (`tessera worker`, see [`super::child`]) over a
//! local TCP control connection ([`super::wire`]) and returns the worker's reply. The workers
//! run real `ZeroWorker`s whose collectives are a `QuicComm` with mutual TLS: ranks exchange
//! tensors directly, never through the parent.
//!
//! # Start-up ([`launch`])
//! 1. The parent writes the resolved config and a fresh cluster PKI (`cluster_init`: CA and
//!    certificates `node-0..N`) into `<output>/procs/`, listens on `127.0.0.1:0` and spawns the
//!    N workers (each in its own process group, so a terminal's Ctrl-C reaches only the parent,
//!    which stops between steps, checkpoints and then ends the workers).
//! 2. Each worker binds its QUIC socket on `127.0.0.1:0` and says `Hello {rank, pid, address,
//!    config hash}`; the parent checks the hash and broadcasts every address (no port races).
//! 3. The parent sends each worker its cut of the start state (bulk) — fresh or resumed, the
//!    parent decides; the worker builds its `RankState`, connects the QUIC mesh and says `Ready`.
//!
//! # Between steps
//! Evaluation, checkpoints and the final hash need full buffers: `Export` asks an owner rank for
//! its masters and optimizer buffers, which come back as raw f32 bulk after a header (the one
//! control-plane exception). Per-step figures (bytes sent, applied steps, loss scale, memory)
//! ride on every reply as a small [`Snapshot`].
//!
//! # Failure
//! Every wait is bounded. A monitor thread polls the workers; when one exits unexpectedly, it
//! records which rank and how, and kills the others at once (as torchrun does), so every proxy
//! sees its connection close and the step fails with an error naming the dead rank. Dropping
//! [`Procs`] kills and reaps every worker; workers also exit when their control connection
//! closes or the parent process disappears. `<output>/procs` (config, CA and node keys) lives
//! only as long as the workers.

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tessera_actors::compute::{MemoryReport, Prepared, StepOrder, WorkerCompute};
use tessera_actors::DEFAULT_STEP_TIMEOUT_MS;

use super::plan::Plan;
use super::ranks::{master_window, OptimBuffers, RankCounters, Start};
use super::wire::{self, Snapshot, StateCounters, ToParent, ToWorker, Wait, WireError};
use crate::config::Config;

/// Bound on the workers' start-up: connecting, loading data, building the QUIC mesh (ms).
pub const STARTUP_TIMEOUT_MS: u64 = 120_000;
/// Bound on a worker's reply to one request (a whole prepare or commit included) (ms).
pub const REPLY_TIMEOUT_MS: u64 = DEFAULT_STEP_TIMEOUT_MS;
/// Bound on the workers' exit after `Shutdown` (ms).
pub const EXIT_TIMEOUT_MS: u64 = 15_000;
/// How often the monitor polls the workers (ms).
const MONITOR_POLL_MS: u64 = 50;

/// The node name of rank `r` in the cluster PKI.
pub fn node_name(r: usize) -> String {
    format!("node-{r}")
}

/// What the workers share with the parent: their processes and the first failure seen.
struct Shared {
    children: Mutex<Vec<(usize, Child)>>,
    /// Set by the parent before it ends the workers itself: exits are then expected.
    closing: AtomicBool,
    /// The first unexpected worker exit, e.g. "rank 1 (pid 42) was killed by signal 9".
    died: Mutex<Option<String>>,
}

impl Shared {
    fn died(&self) -> Option<String> {
        self.died.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn children(&self) -> MutexGuard<'_, Vec<(usize, Child)>> {
        self.children.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Kills and reaps every worker still running.
    fn kill_all(&self) {
        for (_, c) in self.children().iter_mut() {
            if let Ok(None) = c.try_wait() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// One worker's control connection and its latest snapshot.
struct Link {
    stream: TcpStream,
    snapshot: Snapshot,
}

/// The worker processes of a run (rank order); dropping it kills and reaps them.
pub struct Procs {
    links: Vec<Arc<Mutex<Link>>>,
    shared: Arc<Shared>,
    monitor: Option<JoinHandle<()>>,
    /// `<output>/procs`: the resolved config and the run's keys, removed when the workers end.
    dir: PathBuf,
}

fn lock_link(l: &Mutex<Link>) -> MutexGuard<'_, Link> {
    l.lock().unwrap_or_else(|p| p.into_inner())
}

/// Describes an exit status: "exited with status 1" or "was killed by signal 9".
fn describe_exit(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with status {c}"),
        (None, Some(s)) => format!("was killed by signal {s}"),
        _ => format!("ended ({status})"),
    }
}

/// Polls the workers; on the first unexpected exit records it and kills the rest.
fn monitor(shared: Arc<Shared>) {
    loop {
        std::thread::sleep(Duration::from_millis(MONITOR_POLL_MS));
        if shared.closing.load(Ordering::SeqCst) {
            return;
        }
        let dead = shared.children().iter_mut().find_map(|(r, c)| match c.try_wait() {
            Ok(Some(status)) => Some(format!("rank {r} (pid {}) {}", c.id(), describe_exit(status))),
            _ => None,
        });
        if let Some(why) = dead {
            eprintln!("error: worker process of {why}; stopping the other workers");
            *shared.died.lock().unwrap_or_else(|p| p.into_inner()) = Some(why);
            shared.kill_all();
            return;
        }
    }
}

impl Procs {
    fn alive_check(&self) -> impl Fn() -> Result<(), WireError> + '_ {
        move || match self.shared.died() {
            Some(why) => Err(WireError::Io(std::io::Error::other(format!("worker process of {why}")))),
            None => Ok(()),
        }
    }

    /// The latest snapshot of every rank.
    pub fn snapshots(&self) -> Vec<Snapshot> {
        self.links.iter().map(|l| lock_link(l).snapshot).collect()
    }

    /// Rank `r`'s masters, its optimizer buffers when `with_optim` (else none), and counters.
    pub fn export(&self, r: usize, plan: &Plan, with_optim: bool) -> Result<(Vec<f32>, OptimBuffers, RankCounters)> {
        let alive = self.alive_check();
        let wait = Wait { what: "exported state", deadline: Some(Instant::now() + Duration::from_millis(REPLY_TIMEOUT_MS)), alive: &alive };
        let mut link = lock_link(&self.links[r]);
        let ctx = || format!("exporting the state of rank {r}");
        wire::send(&mut link.stream, &ToWorker::Export { optim: with_optim }).with_context(ctx)?;
        let (counters, descs) = match wire::recv(&mut link.stream, "Exported", &wait).with_context(ctx)? {
            ToParent::Exported { counters, buffers } => (counters, buffers),
            ToParent::Failed { error } => bail!("rank {r} could not export its state: {error}"),
            other => bail!("rank {r} answered Export with {other:?}"),
        };
        let want = plan.optim_range(r).len();
        if descs.first().is_none_or(|d| d.len != want as u64) {
            bail!("rank {r} exported {:?} master values, its range holds {want}", descs.first().map(|d| d.len));
        }
        let mut bufs = wire::recv_bulk(&mut link.stream, &descs, want, &wait).with_context(ctx)?;
        let master = bufs.remove(0);
        let optim = descs[1..].iter().map(|d| d.name.clone()).zip(bufs).collect();
        let c = RankCounters {
            optimizer_steps: counters.optimizer_steps.unwrap_or(0),
            applied: counters.applied,
            skipped: counters.skipped,
            scaler: counters.scaler,
        };
        Ok((master, optim, c))
    }

    /// Asks every worker to leave and waits (bounded) for each to exit with status 0.
    pub fn close(mut self) -> Result<()> {
        self.shared.closing.store(true, Ordering::SeqCst);
        if let Some(m) = self.monitor.take() {
            let _ = m.join();
        }
        if let Some(why) = self.shared.died() {
            bail!("worker process of {why}");
        }
        for l in &self.links {
            let _ = wire::send(&mut lock_link(l).stream, &ToWorker::Shutdown);
        }
        let deadline = Instant::now() + Duration::from_millis(EXIT_TIMEOUT_MS);
        let mut failures = Vec::new();
        for (r, c) in self.shared.children().iter_mut() {
            let status = loop {
                match c.try_wait() {
                    Ok(Some(s)) => break Some(s),
                    Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(MONITOR_POLL_MS)),
                    _ => break None,
                }
            };
            match status {
                Some(s) if s.success() => {}
                Some(s) => failures.push(format!("rank {r} {}", describe_exit(s))),
                None => failures.push(format!("rank {r} did not exit within {EXIT_TIMEOUT_MS} ms (killed)")),
            }
        }
        if !failures.is_empty() {
            bail!("worker processes did not leave cleanly: {}", failures.join("; "));
        }
        Ok(())
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        self.shared.closing.store(true, Ordering::SeqCst);
        self.shared.kill_all();
        if let Some(m) = self.monitor.take() {
            let _ = m.join();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The parent-side proxy of rank `rank`'s compute.
pub struct RemoteCompute {
    rank: usize,
    link: Arc<Mutex<Link>>,
    shared: Arc<Shared>,
}

impl RemoteCompute {
    /// Sends `msg` and waits (bounded) for the reply; I/O failures name the dead worker if known.
    fn call(&self, msg: &ToWorker, expected: &'static str) -> Result<(ToParent, MutexGuard<'_, Link>), String> {
        let mut link = lock_link(&self.link);
        let shared = Arc::clone(&self.shared);
        let alive = move || match shared.died() {
            Some(why) => Err(WireError::Io(std::io::Error::other(format!("stopped after worker process of {why}")))),
            None => Ok(()),
        };
        let wait = Wait { what: expected, deadline: Some(Instant::now() + Duration::from_millis(REPLY_TIMEOUT_MS)), alive: &alive };
        let res = wire::send(&mut link.stream, msg).and_then(|()| wire::recv(&mut link.stream, expected, &wait));
        match res {
            Ok(reply) => Ok((reply, link)),
            Err(e) => Err(self.lost(e)),
        }
    }

    /// The error for a failed exchange: the worker's exit, once the monitor has seen it.
    fn lost(&self, e: WireError) -> String {
        let deadline = Instant::now() + Duration::from_millis(10 * MONITOR_POLL_MS);
        while self.shared.died().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(MONITOR_POLL_MS / 5));
        }
        match self.shared.died() {
            Some(why) if why.starts_with(&format!("rank {} ", self.rank)) => format!("worker process of {why}"),
            Some(why) => format!("worker process of rank {} stopped after worker process of {why}", self.rank),
            None => format!("worker process of rank {}: {e}", self.rank),
        }
    }
}

impl WorkerCompute for RemoteCompute {
    fn prepare(&mut self, order: &StepOrder) -> Result<Prepared, String> {
        match self.call(&ToWorker::prepare(order), "Prepared")? {
            (ToParent::Prepared { prepared, snapshot }, mut link) => {
                link.snapshot = snapshot;
                Ok(prepared.prepared())
            }
            (ToParent::Failed { error }, _) => Err(error),
            (other, _) => Err(format!("rank {} answered Prepare with {other:?}", self.rank)),
        }
    }

    fn commit(&mut self, step: u64) -> Result<(), String> {
        match self.call(&ToWorker::Commit { step }, "Committed")? {
            (ToParent::Committed { snapshot }, mut link) => {
                link.snapshot = snapshot;
                Ok(())
            }
            (ToParent::Failed { error }, _) => Err(error),
            (other, _) => Err(format!("rank {} answered Commit with {other:?}", self.rank)),
        }
    }

    fn abandon(&mut self, step: u64) {
        // Nothing to report through this interface: a lost worker fails the next call. After a
        // worker died (already reported by the monitor) abandoning is expected to fail.
        if let Err(e) = self.call(&ToWorker::Abandon { step }, "Abandoned") {
            if self.shared.died().is_none() {
                eprintln!("warning: abandoning step {step}: {e}");
            }
        }
    }

    fn memory(&self) -> MemoryReport {
        lock_link(&self.link).snapshot.memory.report(self.rank)
    }
}

/// The worker processes and their proxies for `Cluster::start`.
pub type Started = (Procs, Vec<Box<dyn WorkerCompute>>);

/// Writes the resolved config and the PKI into `dir` (emptied first).
fn prepare_dir(cfg: &Config, world: usize, dir: &Path) -> Result<()> {
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("clearing {}", dir.display()))?;
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let text = serde_json::to_string_pretty(&cfg.resolved).context("serialising the resolved config")?;
    std::fs::write(dir.join("config.json"), text).with_context(|| format!("writing {}/config.json", dir.display()))?;
    let names: Vec<String> = (0..world).map(node_name).collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    tessera_transport::quic::cluster_init(&dir.join("pki"), &refs)
        .with_context(|| format!("creating certificates in {}", dir.display()))?;
    Ok(())
}

fn spawn_worker(exe: &Path, r: usize, world: usize, control: &str, dir: &Path) -> Result<Child> {
    use std::os::unix::process::CommandExt;
    Command::new(exe)
        .args(["worker", "--rank", &r.to_string(), "--world", &world.to_string(), "--control", control])
        .arg("--dir")
        .arg(dir)
        .stdin(Stdio::null())
        .process_group(0)
        .spawn()
        .with_context(|| format!("starting the worker process of rank {r} ({})", exe.display()))
}

/// Accepts one control connection per rank and reads its Hello; returns streams and addresses.
fn accept_workers(listener: &TcpListener, cfg: &Config, shared: &Shared, world: usize) -> Result<Vec<(TcpStream, String)>> {
    listener.set_nonblocking(true).context("control listener")?;
    let deadline = Instant::now() + Duration::from_millis(STARTUP_TIMEOUT_MS);
    let mut got: Vec<Option<(TcpStream, String)>> = (0..world).map(|_| None).collect();
    while got.iter().any(Option::is_none) {
        if let Some((r, status)) = shared.children().iter_mut().find_map(|(r, c)| c.try_wait().ok().flatten().map(|s| (*r, s))) {
            bail!("worker process of rank {r} {} during start-up", describe_exit(status));
        }
        if Instant::now() >= deadline {
            bail!("workers did not connect within {STARTUP_TIMEOUT_MS} ms");
        }
        let mut stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(MONITOR_POLL_MS));
                continue;
            }
            Err(e) => return Err(e).context("accepting a worker's control connection"),
        };
        stream.set_nonblocking(false).context("control connection")?;
        let _ = stream.set_nodelay(true);
        let wait = Wait { what: "Hello", deadline: Some(deadline), alive: &|| Ok(()) };
        let (rank, quic_addr, hash) = match wire::recv(&mut stream, "Hello", &wait).context("reading a worker's Hello")? {
            ToParent::Hello { rank, quic_addr, config_hash, .. } => (rank as usize, quic_addr, config_hash),
            other => bail!("a worker opened with {other:?} instead of Hello"),
        };
        if hash != cfg.hash {
            bail!("worker of rank {rank} resolved the config to hash {hash}, the parent has {}", cfg.hash);
        }
        match got.get_mut(rank) {
            Some(slot @ None) => *slot = Some((stream, quic_addr)),
            _ => bail!("a worker said it is rank {rank}: not a free rank of {world}"),
        }
    }
    Ok(got.into_iter().flatten().collect())
}

/// Sends rank `r` its cut of the start state (header + bulk).
fn send_start(stream: &mut TcpStream, plan: &Plan, start: &Start, r: usize) -> Result<()> {
    let window = master_window(plan, r);
    let cut = start.cut(plan, r);
    let mut bufs: Vec<(&str, &[f32])> = vec![("master", &start.master[window.clone()])];
    if let Some((_, optim)) = &cut.optim {
        bufs.extend(optim.iter().map(|(n, b)| (n.as_str(), b.as_slice())));
    }
    let counters = StateCounters {
        optimizer_steps: cut.optim.as_ref().map(|o| o.0),
        applied: cut.applied,
        skipped: cut.skipped,
        scaler: cut.scaler.clone(),
    };
    let msg = ToWorker::Start { master_start: window.start as u64, counters, buffers: wire::describe(&bufs) };
    wire::send(stream, &msg)?;
    wire::send_bulk(stream, &bufs.iter().map(|(_, b)| *b).collect::<Vec<_>>())?;
    Ok(())
}

/// Starts `plan.world` worker processes for `cfg` from `start` (see the module doc).
pub fn launch(cfg: &Config, plan: &Plan, start: &Start, out_dir: &Path) -> Result<Started> {
    let world = plan.world;
    let dir = out_dir.join("procs");
    prepare_dir(cfg, world, &dir)?;
    let exe: PathBuf = std::env::current_exe().context("finding the tessera executable")?;
    let listener = TcpListener::bind("127.0.0.1:0").context("binding the control listener")?;
    let control = listener.local_addr().context("control listener address")?.to_string();
    let shared = Arc::new(Shared { children: Mutex::new(Vec::new()), closing: AtomicBool::new(false), died: Mutex::new(None) });
    // From here on, dropping `procs` kills whatever was started.
    let mut procs = Procs { links: Vec::new(), shared: Arc::clone(&shared), monitor: None, dir: dir.clone() };
    for r in 0..world {
        let child = spawn_worker(&exe, r, world, &control, &dir)?;
        shared.children().push((r, child));
    }
    let conns = accept_workers(&listener, cfg, &shared, world)?;
    let addrs: Vec<String> = conns.iter().map(|(_, a)| a.clone()).collect();
    let mut streams: Vec<TcpStream> = conns.into_iter().map(|(s, _)| s).collect();
    for (r, s) in streams.iter_mut().enumerate() {
        wire::send(s, &ToWorker::Mesh { addrs: addrs.clone() }).with_context(|| format!("sending rank {r} the addresses"))?;
        send_start(s, plan, start, r).with_context(|| format!("sending rank {r} its start state"))?;
    }
    let deadline = Instant::now() + Duration::from_millis(STARTUP_TIMEOUT_MS);
    for (r, mut stream) in streams.into_iter().enumerate() {
        let wait = Wait { what: "Ready", deadline: Some(deadline), alive: &|| Ok(()) };
        let snapshot = match wire::recv(&mut stream, "Ready", &wait).with_context(|| format!("waiting for rank {r} to start"))? {
            ToParent::Ready { snapshot } => snapshot,
            ToParent::Failed { error } => bail!("worker process of rank {r} failed to start: {error}"),
            other => bail!("rank {r} answered its start state with {other:?}"),
        };
        procs.links.push(Arc::new(Mutex::new(Link { stream, snapshot })));
    }
    let m = Arc::clone(&shared);
    procs.monitor =
        Some(std::thread::Builder::new().name("tessera-procs".into()).spawn(move || monitor(m)).context("starting the monitor")?);
    let computes = procs
        .links
        .iter()
        .enumerate()
        .map(|(rank, link)| Box::new(RemoteCompute { rank, link: Arc::clone(link), shared: Arc::clone(&shared) }) as Box<dyn WorkerCompute>)
        .collect();
    Ok((procs, computes))
}
