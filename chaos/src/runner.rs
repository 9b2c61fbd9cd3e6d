//! `tessera chaos run`: runs a scenario's training job twice — fault-free, then with the
//! scenario's faults injected — and compares the final parameters.
//!
//! Both runs are `tessera train --nprocs N` with the elastic runtime on — or, with the scenario's
//! `"launch": "agents"`, the faulted run is `tessera coordinator` on a free port and N
//! `tessera agent --join` processes holding its join token (the harness starts the agents once
//! the token is written — each in its own network namespace when the scenario has network
//! faults, the coordinator then on the harness's bridge address, and with the worker-net file
//! when it has datagram faults, so each agent's QUIC traffic crosses its fault link; `join`
//! faults start more agents). The harness follows
//! the faulted run through its event log (`<output>/elastic_events.jsonl`: plan epochs with each
//! member's rank and pid, committed steps, losses, drains, joins, checkpoints written or not, and
//! when training resumed) and fires each fault when its trigger is met: signals go to the pid of
//! the targeted rank of the epoch in force, a join starts `tessera worker --join`, checkpoint
//! faults touch the run's checkpoint folder, a `slow` fault runs a thread that SIGSTOPs and
//! SIGCONTs the worker on the seeded duty cycle, and network faults act on the targeted worker's
//! namespace (link down, `tc … tbf`) or on its fault link (delay, loss, reordering,
//! duplication). Faults with a duration are undone when it ends.
//!
//! With network faults in the scenario, the faulted run's workers each live in a network
//! namespace of their own ([`crate::hosts`]); with `disk_full`, its checkpoint folder is a small
//! tmpfs ([`crate::disk`]). Both need root; without it the harness refuses such a scenario
//! before running anything. The fault-free run always runs on loopback.
//!
//! The report gives, per fault, when it was injected and undone, when the run noticed (the
//! matching loss, drain, join or failed checkpoint; for `slow`, the first re-assignment of
//! micro-batch blocks) and when it was training (or checkpointing) again, and the summary of
//! both runs; a fault whose trigger never came is listed as not injected. The runs must end
//! with equal `params_blake3` and every step committed, and the checkpoint folder must hold
//! nothing half-written.
//!
//! Faults that act inside a process (`kill_in_commit`'s SIGUSR1 trigger, `stop_actor`'s
//! SIGUSR2) need that process's fault hooks ([`crate::hooks`]): the harness sets
//! `TESSERA_TEST_FAULTS` on every process of the faulted run to the faults its scenario uses
//! (with what its own caller set, [`ChaosOptions::faults`]); the fault-free run gets only the
//! caller's. Without them a worker's SIGUSR1 is a stop request, as a scheduler's is.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use indicatif::{ProgressBar, ProgressStyle};
use serde_json::Value;

use crate::disk::{self, Disk};
use crate::hooks::{FaultSpec, FAULTS_ENV};
use crate::hosts::{self, Hosts};
use crate::plan::{Fault, FaultKind, Launch, Scenario, Trigger, DURATION_MS_DEFAULT};
use crate::proxy::ProxyStats;

/// The event log the elastic driver writes (`tessera_fleet::driver::EVENTS_FILE`).
pub const EVENTS_FILE: &str = "elastic_events.jsonl";
/// How often the harness reads the event log and fires or undoes faults (ms).
const POLL_MS: u64 = 20;
/// Bound on a joiner's exit after its run ended (ms).
const JOINER_EXIT_MS: u64 = 15_000;
/// Default bound on each run (s).
const RUN_TIMEOUT_S: u64 = 600;
/// Bound on the coordinator writing its join token (agents launch), ms.
const TOKEN_WAIT_MS: u64 = 30_000;

/// What a chaos run needs.
pub struct ChaosOptions {
    /// The `tessera` executable.
    pub exe: PathBuf,
    pub scenario: Scenario,
    /// The scenario file's folder (a relative `config` is taken from there).
    pub base: PathBuf,
    pub seed: u64,
    /// Where both runs write (`clean/`, `faulted/`, `report.json`).
    pub output: PathBuf,
    pub progress: bool,
    /// Faults the caller's `TESSERA_TEST_FAULTS` asked for (knobs no scenario fault makes: a
    /// replica corrupted, a copy held open): both runs' processes get them.
    pub faults: FaultSpec,
}

/// What went wrong while running the scenario.
#[derive(Debug, thiserror::Error)]
pub enum ChaosError {
    /// The I/O error is the source (printed after `what` by `{:#}`).
    #[error("{what}")]
    Io { what: String, source: std::io::Error },
    #[error("{0}")]
    Run(String),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> ChaosError {
    let what = what.into();
    move |source| ChaosError::Io { what, source }
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// One injected fault and what the run made of it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FaultReport {
    pub kind: &'static str,
    /// False when the fault's trigger never came before the run ended.
    pub injected: bool,
    /// The scenario marked it optional: not injected, it does not fail the scenario.
    pub optional: bool,
    /// What was hit: "rank 2 (worker 2, pid 1234)", "new worker (pid 99)", a checkpoint path.
    pub target: String,
    /// From the faulted run's start to the injection.
    pub injected_ms: u64,
    /// From the faulted run's start to the fault's end (`None`: it lasted until the run ended,
    /// or it has no duration).
    pub until_ms: Option<u64>,
    /// How long the fault was to last (`None`: an instant, like a kill, or until the run ends).
    pub duration_ms: Option<u64>,
    /// From injection to the run noticing it (a loss, drain, join or failed checkpoint event).
    pub detection_ms: Option<u64>,
    /// From noticing to training again (the next epoch's first step running), or for
    /// checkpoint faults to the next checkpoint written.
    pub recovery_ms: Option<u64>,
    /// For link faults: what the worker's fault link did over the worker's life.
    pub link: Option<ProxyStats>,
    pub note: String,
}

impl FaultReport {
    /// A report with only what is known before the run's events are read.
    pub(crate) fn new(kind: FaultKind, injected: bool, note: String) -> FaultReport {
        FaultReport {
            kind: kind.name(),
            injected,
            optional: false,
            target: String::new(),
            injected_ms: 0,
            until_ms: None,
            duration_ms: None,
            detection_ms: None,
            recovery_ms: None,
            link: None,
            note,
        }
    }
}

/// One run's figures.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct RunReport {
    pub ok: bool,
    /// When the run started (Unix ms: the event log's clock).
    pub started_unix_ms: u64,
    pub wall_s: f64,
    pub steps: u64,
    pub params_blake3: String,
    pub tokens_per_s: f64,
    /// The summary's `elastic` block (recoveries, losses, reruns, replays).
    pub elastic: Value,
    pub error: Option<String>,
}

/// The whole chaos report.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    pub seed: u64,
    pub clean: RunReport,
    pub faulted: RunReport,
    pub faults: Vec<FaultReport>,
    /// Steps of the faulted run committed / expected (a lost committed step would show here).
    pub steps_expected: u64,
    /// Where the faulted run's workers ran (network namespaces), when not on loopback.
    pub network: Option<String>,
    /// The faulted run's checkpoint file system, when `disk_full` needed one.
    pub checkpoint_disk: Option<String>,
    /// Half-written files or folders left in the faulted run's checkpoint folder (must be none).
    pub checkpoint_leftovers: Vec<String>,
    /// Equal `params_blake3` and every step committed.
    pub equal: bool,
    /// The faulted run as a picture (`timeline.svg`), when it could be written.
    pub timeline: Option<PathBuf>,
}

impl Report {
    /// Whether the scenario passed: every fault injected, the fault-free bits, every step,
    /// nothing half-written.
    pub fn passed(&self) -> bool {
        self.equal && self.checkpoint_leftovers.is_empty() && self.not_injected() == 0
    }

    /// Faults that never reached the run (trigger never came, no such rank, nothing to hit,
    /// a `kill_in_commit` that no commit followed), but for those marked optional.
    pub fn not_injected(&self) -> usize {
        self.faults.iter().filter(|f| !f.injected && !f.optional).count()
    }

    /// The report as people read it.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let ms = |v: Option<u64>| v.map_or_else(|| "-".to_string(), |v| format!("{v} ms"));
        s.push_str(&format!("chaos run, seed {}\n", self.seed));
        if let Some(n) = &self.network {
            s.push_str(&format!("workers: {n}\n"));
        }
        if let Some(d) = &self.checkpoint_disk {
            s.push_str(&format!("checkpoints: {d}\n"));
        }
        let injected = self.faults.iter().filter(|f| f.injected).count();
        s.push_str(&format!("\nfaults injected: {injected} of {}\n", self.faults.len()));
        s.push_str(&format!(
            "  {:<18} {:>9} {:>9} {:<44} {:>10} {:>10}  note\n",
            "fault", "at", "until", "target", "detection", "recovery"
        ));
        for f in &self.faults {
            let until = f.until_ms.map_or_else(|| "end".to_string(), |v| format!("{v} ms"));
            s.push_str(&format!(
                "  {:<18} {:>9} {:>9} {:<44} {:>10} {:>10}  {}\n",
                f.kind,
                format!("{} ms", f.injected_ms),
                until,
                f.target,
                ms(f.detection_ms),
                ms(f.recovery_ms),
                f.note
            ));
        }
        let el = &self.faulted.elastic;
        let get = |k: &str| el.get(k).and_then(Value::as_u64).unwrap_or(0);
        s.push_str(&format!(
            "\nfaulted run: {} of {} steps committed, {} step attempt(s) rerun, {} failed commit(s) completed from memory, \
             {} committed step(s) replayed from a checkpoint, \
             {} recoveries ({} from memory, {} from a checkpoint), {} worker(s) lost, {} joined, {} drained, {} checkpoint(s) not written, \
             {} rebalance(s) by measured speed\n",
            self.faulted.steps,
            self.steps_expected,
            get("steps_rerun"),
            get("commits_completed"),
            get("steps_replayed"),
            get("recoveries"),
            get("restored_from_memory"),
            get("restored_from_checkpoint"),
            get("workers_lost"),
            get("workers_joined"),
            get("workers_drained"),
            get("checkpoints_failed"),
            get("rebalances"),
        ));
        s.push_str(&format!("wall time: fault-free {:.1} s, faulted {:.1} s\n", self.clean.wall_s, self.faulted.wall_s));
        if let Some(t) = &self.timeline {
            s.push_str(&format!("timeline: {}\n", t.display()));
        }
        s.push_str(&format!("params_blake3 fault-free {}\n", self.clean.params_blake3));
        s.push_str(&format!("params_blake3 faulted    {}\n", self.faulted.params_blake3));
        for (name, r) in [("fault-free", &self.clean), ("faulted", &self.faulted)] {
            if let Some(e) = &r.error {
                s.push_str(&format!("the {name} run failed: {e}\n"));
            }
        }
        if !self.checkpoint_leftovers.is_empty() {
            s.push_str(&format!("half-written checkpoint leftovers: {}\n", self.checkpoint_leftovers.join(", ")));
        }
        let missed = self.not_injected();
        s.push_str(&match (self.equal, self.checkpoint_leftovers.is_empty(), missed) {
            (true, true, 0) => "result: EQUAL — the faulted run gives the fault-free bits; no committed step lost\n".to_string(),
            (true, false, _) => "result: FAILED — the bits are equal, but a checkpoint was left half-written\n".to_string(),
            (true, true, n) => format!(
                "result: NOT TESTED — the bits are equal, but {n} of {} fault(s) were not injected (see their notes)\n",
                self.faults.len()
            ),
            (false, _, _) => "result: DIFFERENT\n".to_string(),
        });
        s
    }
}

/// The scenario's training config (a relative path is taken from the scenario's folder).
fn config_path(o: &ChaosOptions) -> PathBuf {
    match o.scenario.config.is_absolute() {
        true => o.scenario.config.clone(),
        false => o.base.join(&o.scenario.config),
    }
}

/// The run's driver command line: `train --nprocs N` (workers in the namespaces of `net` when
/// given), or with `agents` the coordinator's.
fn train_args(o: &ChaosOptions, out: &Path, net: Option<&Path>, agents: Option<&AgentJob>) -> Vec<String> {
    let cfg = config_path(o);
    let (verb, n) = match agents {
        None => ("train", "--nprocs"),
        Some(_) => ("coordinator", "--nodes"),
    };
    let mut a: Vec<String> = vec![verb.into(), "--config".into(), cfg.display().to_string(), "--output".into(), out.display().to_string()];
    a.extend(["--no-progress".into(), "--steps".into(), o.scenario.steps.to_string(), n.into(), o.scenario.nprocs.to_string()]);
    if let Some(j) = agents {
        a.extend(["--listen".into(), j.join.clone(), "--token-file".into(), j.token.display().to_string()]);
    }
    a.extend(["--set".into(), "tessera.elastic.enabled=true".into()]);
    for s in &o.scenario.set {
        a.extend(["--set".into(), s.clone()]);
    }
    // (A coordinator spawns no workers: the harness put its agents in their namespaces.)
    if let (Some(net), None) = (net, agents) {
        a.extend(["--worker-net".into(), net.display().to_string()]);
    }
    a
}

/// Follows a run's event log (lines appended as the run goes).
struct Events {
    path: PathBuf,
    read: usize,
    all: Vec<Value>,
}

impl Events {
    fn new(path: PathBuf) -> Self {
        Events { path, read: 0, all: Vec::new() }
    }

    /// Reads the lines written since the last poll (a partial last line waits).
    fn poll(&mut self) {
        let Ok(f) = std::fs::File::open(&self.path) else { return };
        let mut r = BufReader::new(f);
        let mut text = String::new();
        let (mut skipped, already) = (0, self.read);
        let mut line = String::new();
        while r.read_line(&mut line).unwrap_or(0) > 0 {
            if skipped < already {
                skipped += 1;
            } else if line.ends_with('\n') {
                text.push_str(&line);
                self.read += 1;
            }
            line.clear();
        }
        self.all.extend(text.lines().filter_map(|l| serde_json::from_str::<Value>(l).ok()));
    }

    fn of(&self, kind: &str) -> impl Iterator<Item = &Value> {
        let kind = kind.to_string();
        self.all.iter().filter(move |e| e["event"] == kind.as_str())
    }

    fn step(&self) -> u64 {
        self.of("step").filter_map(|e| e["step"].as_u64()).max().unwrap_or(0)
    }

    /// The pid of the process that joined as worker `id`.
    fn join_pid(&self, id: u64) -> Option<u32> {
        self.of("join_requested").find(|e| e["id"].as_u64() == Some(id)).and_then(|e| e["pid"].as_u64()).map(|p| p as u32)
    }

    /// The members of the newest epoch: (rank, id, pid).
    fn members(&self) -> Vec<(usize, u64, u32)> {
        self.of("epoch")
            .last()
            .and_then(|e| e["members"].as_array())
            .map(|ms| {
                ms.iter().filter_map(|m| Some((m["rank"].as_u64()? as usize, m["id"].as_u64()?, m["pid"].as_u64()? as u32))).collect()
            })
            .unwrap_or_default()
    }
}

fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: kill(2) on a pid the run reported for one of its workers; no memory is touched.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// Asks the driver process `pid` to stop rank `rank`'s DeviceWorker actor: SIGUSR2 with the rank
/// as the signal's value (`sigqueue`), which the driver's fault hooks read ([`crate::hooks`]).
fn stop_actor(pid: u32, rank: usize) -> std::io::Result<()> {
    let value = libc::sigval { sival_ptr: rank as *mut libc::c_void };
    // SAFETY: sigqueue(3) on the run's own driver process; it only reads its arguments.
    match unsafe { libc::sigqueue(pid as libc::pid_t, libc::SIGUSR2, value) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

/// "for 2000 ms" or "until the run ends".
fn lasts(duration_ms: Option<u64>) -> String {
    duration_ms.map_or_else(|| "until the run ends".to_string(), |ms| format!("for {ms} ms"))
}

/// What ends a fault with a duration.
enum Undo {
    Cont {
        pid: u32,
    },
    Writes {
        root: PathBuf,
        held: PathBuf,
    },
    LinkUp {
        host: usize,
    },
    Unthrottle {
        host: usize,
    },
    LinkClear {
        id: u64,
    },
    DiskFree,
    /// A `slow` duty cycle: `stop` ends it early; the thread leaves the worker running.
    Slow {
        stop: Arc<AtomicBool>,
        thread: JoinHandle<()>,
    },
}

/// When process `pid` started (field 22 of `/proc/<pid>/stat`, clock ticks since boot), so
/// that a pid the kernel gave to a new process is not taken for the worker.
fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: count after it.
    stat.rsplit_once(')')?.1.split_whitespace().nth(19)?.parse().ok()
}

/// Runs `f`'s duty cycle on `pid` until its duration is over, `stop` is set or the worker is
/// gone (its pid no longer names the process it named at the start); ends with it continued.
fn duty_cycle(pid: u32, f: &Fault, stop: &AtomicBool) {
    let end = Instant::now() + Duration::from_millis(f.duration_ms.unwrap_or(DURATION_MS_DEFAULT));
    let period = Duration::from_millis(f.period_ms);
    let born = start_time(pid);
    let mut k = 0;
    while !stop.load(Ordering::SeqCst) && Instant::now() < end {
        if born.is_none() || start_time(pid) != born {
            return;
        }
        let start = Instant::now();
        signal(pid, libc::SIGSTOP);
        std::thread::sleep(Duration::from_millis(f.slow_stop_ms(k)));
        signal(pid, libc::SIGCONT);
        std::thread::sleep(period.saturating_sub(start.elapsed()));
        k += 1;
    }
    signal(pid, libc::SIGCONT);
}

/// A fault in force: its number in the report, when it ends and how.
struct Active {
    fault: usize,
    at: Instant,
    undo: Undo,
}

/// What the faulted run has besides its process (none for the fault-free run).
#[derive(Default)]
struct Env {
    hosts: Option<Hosts>,
    disk: Option<Disk>,
    agents: Option<AgentJob>,
    /// The fault hooks every process of the run gets (`TESSERA_TEST_FAULTS`).
    hooks: FaultSpec,
}

/// `cmd` with the fault hooks `hooks` asks for, and no others (not the harness's own).
fn with_hooks(mut cmd: Command, hooks: &FaultSpec) -> Command {
    match hooks.is_empty() {
        true => cmd.env_remove(FAULTS_ENV),
        false => cmd.env(FAULTS_ENV, hooks.to_string()),
    };
    cmd
}

/// The hooks of the faulted run: the caller's, and those the scenario's faults act through.
fn faulted_hooks(o: &ChaosOptions, faults: &[Fault]) -> FaultSpec {
    let has = |k: FaultKind| faults.iter().any(|f| f.kind == k);
    FaultSpec { kill_in_commit: has(FaultKind::KillInCommit), stop_actor: has(FaultKind::StopActor), ..o.faults.clone() }
}

/// A run launched as a coordinator and agents (`"launch": "agents"`).
struct AgentJob {
    /// Where agents join (a free UDP port on `ip`, taken when the run starts).
    join: String,
    /// The coordinator's join token file.
    token: PathBuf,
}

impl AgentJob {
    /// A free port on `ip` (loopback, or the harness's bridge address when the agents live in
    /// namespaces), and the token file under `output`.
    fn new(output: &Path, ip: &str) -> Result<AgentJob, ChaosError> {
        let probe = std::net::UdpSocket::bind((ip, 0)).map_err(io(format!("finding a free port on {ip} for the coordinator")))?;
        let port = probe.local_addr().map_err(io("finding a free port for the coordinator"))?.port();
        Ok(AgentJob { join: format!("{ip}:{port}"), token: output.join("faulted.token") })
    }

    /// `c` (tessera, here or in a namespace) as `agent --join …` (with `rank` for the initial
    /// agents; with the worker-net file `net`, behind its fault link), started.
    fn agent(&self, mut c: Command, rank: Option<usize>, net: Option<&Path>, log: &std::fs::File) -> Result<Child, ChaosError> {
        c.args(["agent", "--join", &self.join, "--token-file"]).arg(&self.token);
        if let Some(r) = rank {
            c.args(["--rank", &r.to_string(), "--name", &format!("agent-{r}")]);
        }
        if let Some(net) = net {
            c.arg("--worker-net").arg(net);
        }
        let (out, err) = (log.try_clone().map_err(io("the run's log"))?, log.try_clone().map_err(io("the run's log"))?);
        c.stdin(Stdio::null()).stdout(out).stderr(err).spawn().map_err(io("starting an agent"))
    }
}

/// Waits until the coordinator `driver` wrote the join token (bounded; an exit of the
/// coordinator first is an error naming its log).
fn wait_token(job: &AgentJob, driver: &mut Child, log: &Path) -> Result<(), ChaosError> {
    let deadline = Instant::now() + Duration::from_millis(TOKEN_WAIT_MS);
    while !job.token.is_file() {
        if let Some(s) = driver.try_wait().map_err(io("waiting for the coordinator"))? {
            return Err(ChaosError::Run(format!("the coordinator exited ({s}) before writing its join token; see {}", log.display())));
        }
        if Instant::now() > deadline {
            let _ = driver.kill();
            let _ = driver.wait();
            return Err(ChaosError::Run(format!(
                "the coordinator wrote no join token to {} within {} s; see {}",
                job.token.display(),
                TOKEN_WAIT_MS / 1000,
                log.display()
            )));
        }
        std::thread::sleep(Duration::from_millis(POLL_MS));
    }
    Ok(())
}

/// One injected fault as the run goes: the report, the worker id it hit (the pid, for a join)
/// and when (wall-clock ms).
struct Fired {
    kind: FaultKind,
    report: FaultReport,
    id: Option<u64>,
    at_ms: u64,
    /// When the fault was undone (wall-clock ms; `None`: it lasted until the run ended).
    undone_ms: Option<u64>,
    duration_ms: Option<u64>,
}

/// A run with faults being injected into it.
struct Faulting<'a> {
    o: &'a ChaosOptions,
    /// The run's driver process (`tessera train`), which `stop_actor` signals.
    driver: u32,
    out: PathBuf,
    env: &'a mut Env,
    fired: Vec<Fired>,
    active: Vec<Active>,
    joiners: Vec<Child>,
}

impl Faulting<'_> {
    /// Ends faults whose time is up (all of them with `all`).
    fn undo_due(&mut self, all: bool) {
        let now = Instant::now();
        let (due, keep): (Vec<Active>, Vec<Active>) = std::mem::take(&mut self.active).into_iter().partition(|a| all || now >= a.at);
        self.active = keep;
        for a in due {
            let result = match a.undo {
                Undo::Cont { pid } => {
                    signal(pid, libc::SIGCONT);
                    Ok(())
                }
                Undo::Writes { root, held } => disk::unblock_writes(&root, &held),
                Undo::LinkUp { host } => self.env.hosts.as_ref().map_or(Ok(()), |h| h.set_link(host, true)),
                Undo::Unthrottle { host } => self.env.hosts.as_ref().map_or(Ok(()), |h| h.unthrottle(host)),
                Undo::LinkClear { id } => self.env.hosts.as_mut().map_or(Ok(()), |h| h.clear_link(id, a.fault)),
                Undo::DiskFree => {
                    if let Some(d) = &self.env.disk {
                        d.free();
                    }
                    Ok(())
                }
                Undo::Slow { stop, thread } => {
                    stop.store(true, Ordering::SeqCst);
                    thread.join().map_err(|_| "the duty-cycle thread panicked".to_string())
                }
            };
            let f = &mut self.fired[a.fault];
            if !all {
                f.undone_ms = Some(now_ms());
            }
            if let Err(e) = result {
                f.report.note.push_str(&format!("; undoing it failed: {e}"));
            }
        }
    }

    /// Keeps a full disk full: a failed checkpoint frees its temporary files.
    fn top_up(&mut self) {
        let filling = self.active.iter().any(|a| matches!(a.undo, Undo::DiskFree))
            || self.fired.iter().any(|f| f.kind == FaultKind::DiskFull && f.duration_ms.is_none());
        if let (true, Some(d)) = (filling, &self.env.disk) {
            let _ = d.fill();
        }
    }

    fn schedule(&mut self, fault: usize, duration_ms: Option<u64>, undo: Undo) {
        if let Some(ms) = duration_ms {
            self.active.push(Active { fault, at: Instant::now() + Duration::from_millis(ms), undo });
        }
    }

    /// Injects one fault into the epoch whose members are `members` (rank, id, pid).
    fn inject(&mut self, f: &Fault, members: &[(usize, u64, u32)], events: &Events) -> Result<(), ChaosError> {
        let n = self.fired.len();
        let mut report = FaultReport::new(f.kind, true, String::new());
        report.optional = f.optional;
        let id = match f.kind {
            k if k.targets_rank() => {
                let rank = f.rank_in(members.len());
                let Some(&(rank, id, pid)) = members.iter().find(|m| m.0 == rank) else {
                    report.target = format!("rank {rank}");
                    report.injected = false;
                    report.note = format!("skipped: the run has {} member(s)", members.len());
                    self.push(f, report, None);
                    return Ok(());
                };
                report.target = format!("rank {rank} (worker {id}, pid {pid})");
                let host = match (k.needs_net(), &self.env.hosts) {
                    (false, _) => None,
                    (true, Some(h)) => {
                        let join_pid = |id: u64| events.join_pid(id);
                        match h.host_of(id, join_pid) {
                            Some(host) => {
                                report.target = format!("rank {rank} (worker {id}, pid {pid}, {})", h.addr(host));
                                Some(host)
                            }
                            None => {
                                report.injected = false;
                                report.note = format!("skipped: no test host is known for worker {id}");
                                self.push(f, report, Some(id));
                                return Ok(());
                            }
                        }
                    }
                    (true, None) => return Err(ChaosError::Run(format!("a {} fault without the test network", k.name()))),
                };
                if k == FaultKind::StopActor {
                    stop_actor(self.driver, rank)
                        .map_err(io(format!("signalling the driver (pid {}) to stop rank {rank}'s actor", self.driver)))?;
                    report.note = format!("the driver (pid {}) asked to stop rank {rank}'s DeviceWorker actor (SIGUSR2)", self.driver);
                } else {
                    self.hit_worker(f, n, &mut report, id, pid, host)?;
                }
                Some(id)
            }
            FaultKind::Join => Some(self.start_joiner(&mut report)?),
            FaultKind::CorruptCheckpoint | FaultKind::FailWrites | FaultKind::DiskFull => {
                self.hit_checkpoints(f, n, &mut report)?;
                None
            }
            _ => return Err(ChaosError::Run(format!("no injector for {}", f.kind.name()))),
        };
        self.push(f, report, id);
        Ok(())
    }

    /// Starts `tessera worker --join` (on the next free test host when the workers live in
    /// namespaces), or with agents `tessera agent --join`; returns its pid.
    fn start_joiner(&mut self, report: &mut FaultReport) -> Result<u64, ChaosError> {
        let (cmd, host) = match &self.env.hosts {
            Some(h) => {
                let (cmd, host) = h.join_command(&self.o.exe).map_err(ChaosError::Run)?;
                report.note = format!("on {}", h.addr(host));
                (cmd, Some(host))
            }
            None => (Command::new(&self.o.exe), None),
        };
        let mut cmd = with_hooks(cmd, &self.env.hooks);
        let (child, what) = match &self.env.agents {
            Some(job) => {
                let log = std::fs::OpenOptions::new()
                    .append(true)
                    .open(self.o.output.join("faulted.log"))
                    .map_err(io("opening the run's log for a joining agent"))?;
                let net = self.env.hosts.as_ref().and_then(Hosts::link_file);
                (job.agent(cmd, None, net, &log)?, "agent")
            }
            None => {
                let child = cmd
                    .args(["worker", "--join", "--dir"])
                    .arg(self.out.join("procs"))
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::inherit())
                    .spawn()
                    .map_err(io("starting a joining worker"))?;
                (child, "worker")
            }
        };
        let pid = child.id();
        report.target = format!("new {what} (pid {pid})");
        if let (Some(h), Some(host)) = (self.env.hosts.as_mut(), host) {
            h.joined(pid, host);
        }
        self.joiners.push(child);
        Ok(u64::from(pid))
    }

    /// A fault aimed at the checkpoint folder.
    fn hit_checkpoints(&mut self, f: &Fault, n: usize, report: &mut FaultReport) -> Result<(), ChaosError> {
        let root = self.out.join("checkpoints");
        match f.kind {
            FaultKind::CorruptCheckpoint => match newest_checkpoint(&root) {
                Some(dir) => {
                    report.target = dir.display().to_string();
                    report.note = corrupt(&dir);
                }
                None => {
                    report.target = root.display().to_string();
                    report.injected = false;
                    report.note = "skipped: no checkpoint yet".into();
                }
            },
            FaultKind::FailWrites => {
                let held = self.out.join("checkpoints.held");
                // A file where the folder was: every write under it fails (even for root).
                disk::block_writes(&root, &held).map_err(ChaosError::Run)?;
                self.schedule(n, f.duration_ms, Undo::Writes { root: root.clone(), held });
                report.target = root.display().to_string();
                report.note = format!("unwritable {}", lasts(f.duration_ms));
            }
            FaultKind::DiskFull => {
                let d = self.env.disk.as_ref().ok_or_else(|| ChaosError::Run("a disk_full fault without its file system".into()))?;
                let (path, bytes) = d.fill().map_err(ChaosError::Run)?;
                report.target = path.display().to_string();
                report.note = format!("{} KiB written: the {} MiB file system full {}", bytes >> 10, d.bytes() >> 20, lasts(f.duration_ms));
                self.schedule(n, f.duration_ms, Undo::DiskFree);
            }
            k => return Err(ChaosError::Run(format!("{} is not a checkpoint fault", k.name()))),
        }
        Ok(())
    }

    fn push(&mut self, f: &Fault, report: FaultReport, id: Option<u64>) {
        self.fired.push(Fired { kind: f.kind, report, id, at_ms: now_ms(), undone_ms: None, duration_ms: f.duration_ms });
    }

    /// A fault aimed at worker `id` (process `pid`, on test host `host` for network faults).
    fn hit_worker(
        &mut self,
        f: &Fault,
        n: usize,
        report: &mut FaultReport,
        id: u64,
        pid: u32,
        host: Option<usize>,
    ) -> Result<(), ChaosError> {
        let hosts = || self.env.hosts.as_ref().zip(host).ok_or_else(|| ChaosError::Run("no test host".into()));
        match f.kind {
            FaultKind::Kill => signal(pid, libc::SIGKILL),
            FaultKind::KillInCommit => {
                signal(pid, libc::SIGUSR1);
                report.note = "armed (SIGUSR1): SIGKILL at its next commit".into();
            }
            FaultKind::Term => signal(pid, libc::SIGTERM),
            FaultKind::Usr1 => signal(pid, libc::SIGUSR1),
            FaultKind::Stop => {
                signal(pid, libc::SIGSTOP);
                self.schedule(n, f.duration_ms, Undo::Cont { pid });
                report.note = format!("stopped {}", lasts(f.duration_ms));
            }
            FaultKind::Slow => {
                let stop = Arc::new(AtomicBool::new(false));
                let (s, fault) = (Arc::clone(&stop), f.clone());
                let thread = std::thread::Builder::new()
                    .name("chaos-slow".into())
                    .spawn(move || duty_cycle(pid, &fault, &s))
                    .map_err(io("starting the slow fault's thread"))?;
                self.schedule(n, f.duration_ms.or(Some(DURATION_MS_DEFAULT)), Undo::Slow { stop, thread });
                report.note = format!("stopped ~{} % of every {} ms {}", f.duty_percent, f.period_ms, lasts(f.duration_ms));
            }
            FaultKind::Partition => {
                let (h, host) = hosts()?;
                h.set_link(host, false).map_err(ChaosError::Run)?;
                self.schedule(n, f.duration_ms, Undo::LinkUp { host });
                report.note = match f.duration_ms {
                    Some(ms) => format!("link down for {ms} ms"),
                    None => "link down for good".into(),
                };
            }
            FaultKind::Throttle => {
                let (h, host) = hosts()?;
                h.throttle(host, f.rate_mbit).map_err(ChaosError::Run)?;
                self.schedule(n, f.duration_ms, Undo::Unthrottle { host });
                report.note = format!("egress capped at {} Mbit/s (tc tbf) {}", f.rate_mbit, lasts(f.duration_ms));
            }
            k if k.on_link() => {
                let h = self.env.hosts.as_mut().ok_or_else(|| ChaosError::Run("no test host".into()))?;
                h.add_link(id, n, f.link, f.draw).map_err(ChaosError::Run)?;
                self.schedule(n, f.duration_ms, Undo::LinkClear { id });
                let l = f.link;
                let what = match k {
                    FaultKind::Delay => format!("delay {} ms + jitter 0..={} ms", l.delay_ms, l.jitter_ms),
                    FaultKind::Loss => format!("{:.1}% of datagrams dropped", l.loss * 100.0),
                    FaultKind::Reorder => format!("{:.1}% of datagrams held back {} ms", l.reorder * 100.0, l.reorder_ms),
                    _ => format!("{:.1}% of datagrams sent twice", l.duplicate * 100.0),
                };
                report.note = format!("{what} {}", lasts(f.duration_ms));
            }
            k => return Err(ChaosError::Run(format!("no injector for {}", k.name()))),
        }
        Ok(())
    }
}

/// Runs one training job; injects `faults` when given (into the surroundings `env`). Returns the
/// run's report and the reports of the faults.
fn run_one(
    o: &ChaosOptions,
    name: &str,
    faults: &[Fault],
    env: &mut Env,
    pb: &ProgressBar,
) -> Result<(RunReport, Vec<FaultReport>), ChaosError> {
    let out = o.output.join(name);
    let log = std::fs::File::create(o.output.join(format!("{name}.log"))).map_err(io("creating the run's log"))?;
    let log2 = log.try_clone().map_err(io("the run's log"))?;
    let started = Instant::now();
    let start_ms = now_ms();
    let net = env.hosts.as_ref().map(|h| h.file.clone());
    let agent_log = log.try_clone().map_err(io("the run's log"))?;
    if let Some(job) = &env.agents {
        // A token left by an earlier run would start the agents before this coordinator listens.
        let _ = std::fs::remove_file(&job.token);
    }
    let mut child = with_hooks(Command::new(&o.exe), &env.hooks)
        .args(train_args(o, &out, net.as_deref(), env.agents.as_ref()))
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log2)
        .spawn()
        .map_err(io(format!("starting {}", o.exe.display())))?;
    // Agents: once the coordinator has written its join token, one agent per rank (reaped with
    // the joiners when the run ends).
    let mut agents = Vec::new();
    if let Some(job) = &env.agents {
        wait_token(job, &mut child, &o.output.join(format!("{name}.log")))?;
        for r in 0..o.scenario.nprocs {
            let cmd = match &env.hosts {
                Some(h) => h.command(r, &o.exe),
                None => Command::new(&o.exe),
            };
            match job.agent(with_hooks(cmd, &env.hooks), Some(r), env.hosts.as_ref().and_then(Hosts::link_file), &agent_log) {
                Ok(a) => agents.push(a),
                Err(e) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    reap(agents);
                    return Err(e);
                }
            }
        }
    }
    pb.set_length(o.scenario.steps);
    pb.set_position(0);
    pb.set_message(name.to_string());
    let timeout = Duration::from_secs(o.scenario.timeout_s.unwrap_or(RUN_TIMEOUT_S));
    let mut events = Events::new(out.join(EVENTS_FILE));
    let mut pending: VecDeque<Fault> = faults.iter().cloned().collect();
    let driver = child.id();
    let mut run = Faulting { o, driver, out: out.clone(), env, fired: Vec::new(), active: Vec::new(), joiners: agents };
    let status = loop {
        if let Some(s) = child.try_wait().map_err(io("waiting for the run"))? {
            break s;
        }
        if started.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            run.undo_due(true);
            reap(std::mem::take(&mut run.joiners));
            return Err(ChaosError::Run(format!("the {name} run did not finish within {} s", timeout.as_secs())));
        }
        events.poll();
        pb.set_position(events.step());
        let elapsed = started.elapsed().as_millis() as u64;
        let is_due = |f: &Fault| match f.trigger {
            Trigger::Step(s) => events.step() >= s,
            Trigger::Ms(ms) => elapsed >= ms,
            Trigger::Epoch(e) => events.of("epoch").any(|x| x["epoch"].as_u64().is_some_and(|x| x >= e)),
        };
        // The first fault (in trigger order) whose trigger came: one whose trigger has not come
        // yet does not hold back a later one of another kind of trigger.
        let due = pending.iter().position(is_due);
        // One fault per poll, and only while the run has an epoch to aim at.
        let members = events.members();
        if let (Some(k), false) = (due, members.is_empty()) {
            let f = pending.remove(k).ok_or_else(|| ChaosError::Run("no fault due".into()))?;
            if let Err(e) = run.inject(&f, &members, &events) {
                let _ = child.kill();
                let _ = child.wait();
                run.undo_due(true);
                reap(std::mem::take(&mut run.joiners));
                return Err(e);
            }
            if let Some(r) = run.fired.last() {
                pb.println(format!("  injected {} into {}", r.report.kind, r.report.target));
            }
        }
        run.undo_due(false);
        run.top_up();
        std::thread::sleep(Duration::from_millis(POLL_MS));
    };
    run.undo_due(true);
    reap(std::mem::take(&mut run.joiners));
    events.poll();
    let mut report = run_report(o, name, status, started.elapsed().as_secs_f64());
    report.started_unix_ms = start_ms;
    let hosts = run.env.hosts.as_ref();
    // A loss belongs to the newest fault on that worker injected before it.
    let aimed: Vec<(Option<u64>, u64)> = run.fired.iter().map(|f| (f.id.filter(|_| f.kind.targets_rank()), f.at_ms)).collect();
    let mut faults: Vec<FaultReport> = run
        .fired
        .into_iter()
        .enumerate()
        .map(|(i, f)| {
            let next = aimed.iter().skip(i + 1).filter(|(id, _)| id.is_some() && *id == aimed[i].0).map(|(_, at)| *at).min();
            timings(f, &events, start_ms, hosts, next.unwrap_or(u64::MAX))
        })
        .collect();
    // A fault whose trigger never came is reported, not silently left out.
    let why = format!("not injected: the run ended first ({} steps committed, {} events seen)", events.step(), events.all.len());
    faults.extend(pending.iter().map(|f| FaultReport { optional: f.optional, ..FaultReport::new(f.kind, false, why.clone()) }));
    Ok((report, faults))
}

/// Waits (bounded) for the joiners to leave with their run, then kills what is left.
fn reap(joiners: Vec<Child>) {
    for mut j in joiners {
        let deadline = Instant::now() + Duration::from_millis(JOINER_EXIT_MS);
        while matches!(j.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = j.kill();
        let _ = j.wait();
    }
}

/// A finished run's figures from its exit status, log and `summary.json`.
fn run_report(o: &ChaosOptions, name: &str, status: std::process::ExitStatus, wall_s: f64) -> RunReport {
    let mut report = RunReport { ok: status.success(), wall_s, ..RunReport::default() };
    if !status.success() {
        let text = std::fs::read_to_string(o.output.join(format!("{name}.log"))).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(6).collect();
        report.error = Some(format!("{status}; log tail: {}", tail.into_iter().rev().collect::<Vec<_>>().join(" | ")));
    }
    if let Ok(text) = std::fs::read_to_string(o.output.join(name).join("summary.json")) {
        let v: Value = serde_json::from_str(&text).unwrap_or_default();
        report.steps = v["steps"].as_u64().unwrap_or(0);
        report.params_blake3 = v["params_blake3"].as_str().unwrap_or("").to_string();
        report.tokens_per_s = v["tokens_per_s"].as_f64().unwrap_or(0.0);
        report.elastic = v["elastic"].clone();
    }
    report
}

/// Fills detection and recovery times from the event log (and a link fault's proxy figures);
/// a loss of the worker at or after `next_ms` (when the next fault on it was injected) belongs
/// to that fault.
fn timings(f: Fired, events: &Events, start_ms: u64, hosts: Option<&Hosts>, next_ms: u64) -> FaultReport {
    let (mut r, at) = (f.report, f.at_ms);
    r.injected_ms = at.saturating_sub(start_ms);
    r.until_ms = f.undone_ms.map(|u| u.saturating_sub(start_ms));
    r.duration_ms = f.duration_ms;
    let after = |e: &&Value| e["t_ms"].as_u64().unwrap_or(0) >= at;
    let mine = |e: &&Value| e["t_ms"].as_u64().unwrap_or(0) < next_ms;
    let lost = |id: u64| events.of("lost").filter(after).filter(mine).find(|e| e["id"].as_u64() == Some(id)).cloned();
    if f.kind == FaultKind::Slow {
        // Noticed when the run re-assigns the micro-batch blocks by measured speed.
        match events.of("rebalance").find(after) {
            Some(e) => {
                r.note = format!("{}; rebalanced at step {}: micro-batches per rank {}", r.note, e["step"], e["micro_batches"]);
                r.detection_ms = e["t_ms"].as_u64().map(|t| t.saturating_sub(at));
            }
            None => r.note.push_str("; no rebalance"),
        }
        return r;
    }
    let noticed = match (f.kind, f.id) {
        (FaultKind::Term | FaultKind::Usr1, Some(id)) => {
            events.of("drain_requested").filter(after).find(|e| e["id"].as_u64() == Some(id)).cloned().or_else(|| lost(id))
        }
        (FaultKind::Join, _) => events.of("join_requested").find(|e| e["pid"].as_u64() == f.id).cloned(),
        (k, Some(id)) if k.targets_rank() => lost(id),
        (FaultKind::FailWrites | FaultKind::DiskFull, _) => events.of("checkpoint_failed").find(after).cloned(),
        // Noticed when a recovery skips the damaged checkpoint (the same step folder).
        (FaultKind::CorruptCheckpoint, _) => {
            let name = |p: &str| Path::new(p).file_name().map(|n| n.to_os_string());
            let target = name(&r.target);
            events.of("checkpoint_skipped").filter(after).find(|e| e["path"].as_str().map(name) == Some(target.clone())).cloned()
        }
        _ => None,
    };
    if let Some(n) = noticed {
        let t = n["t_ms"].as_u64().unwrap_or(at);
        r.detection_ms = Some(t.saturating_sub(at));
        let drain = matches!(f.kind, FaultKind::Term | FaultKind::Usr1);
        if n["event"] == "lost" && drain {
            r.note = "left after the drain grace period (lost)".into();
        } else if let (true, Some(l)) = (drain, f.id.and_then(lost)) {
            // It asked to drain, then was lost before a step boundary let it go.
            r.note = match l["why"].as_str() {
                Some(why) if why.contains("drain grace") => "asked to drain; left after the drain grace period (lost)".into(),
                why => format!("asked to drain; lost before a step boundary: {}", why.unwrap_or("?")),
            };
        }
        let back = match n["event"].as_str() {
            Some("checkpoint_failed") => events.of("checkpoint").find(|e| e["t_ms"].as_u64().unwrap_or(0) >= t),
            _ => events.of("resumed").find(|e| e["t_ms"].as_u64().unwrap_or(0) >= t),
        };
        r.recovery_ms = back.and_then(|b| b["t_ms"].as_u64()).map(|b| b.saturating_sub(t));
        if n["event"] == "lost"
            && !matches!(
                f.kind,
                FaultKind::Kill
                    | FaultKind::StopActor
                    | FaultKind::KillInCommit
                    | FaultKind::Stop
                    | FaultKind::Partition
                    | FaultKind::Term
                    | FaultKind::Usr1
            )
        {
            r.note.push_str("; the worker was lost");
        }
    } else {
        match f.kind {
            FaultKind::Stop => r.note = "not noticed: it resumed within the heartbeat timeout".into(),
            // The tree was replaced (a join or drain formed a new epoch at that step boundary)
            // before any step ran on the stopped actor: nothing to recover from.
            FaultKind::StopActor => r.note.push_str("; no loss: a new epoch replaced the actor tree before a step used it"),
            FaultKind::Partition if f.duration_ms.is_some() => {
                r.note.push_str("; not noticed: the link came back within the heartbeat timeout")
            }
            FaultKind::FailWrites | FaultKind::DiskFull => r.note.push_str("; no checkpoint was due while it lasted"),
            FaultKind::KillInCommit => {
                // Armed, but it never killed: the fault did not happen.
                r.injected = false;
                r.note.push_str("; no loss followed: no further commit reached the worker");
            }
            FaultKind::CorruptCheckpoint if r.injected => r.note.push_str("; never read: no recovery needed that checkpoint"),
            _ => {}
        }
    }
    if let (true, Some(h), Some(id)) = (f.kind.on_link(), hosts, f.id) {
        r.link = h.link_stats(id);
        if let Some(s) = r.link {
            r.note.push_str(&format!(
                " (worker {id}'s link: {} datagrams relayed, {} dropped, {} reordered, {} duplicated)",
                s.relayed, s.dropped, s.reordered, s.duplicated
            ));
        }
    }
    r
}

fn newest_checkpoint(root: &Path) -> Option<PathBuf> {
    let mut dirs: Vec<(u64, PathBuf)> = std::fs::read_dir(root)
        .ok()?
        .filter_map(|e| {
            let e = e.ok()?;
            let step = e.file_name().to_str()?.strip_prefix("step_")?.parse().ok()?;
            Some((step, e.path()))
        })
        .collect();
    dirs.sort();
    dirs.pop().map(|(_, p)| p)
}

/// Flips bytes in the middle of each tensor file of `dir`.
fn corrupt(dir: &Path) -> String {
    let mut hit = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            if let Ok(mut bytes) = std::fs::read(&p) {
                let mid = bytes.len() / 2;
                for b in bytes.iter_mut().skip(mid).take(64) {
                    *b ^= 0xA5;
                }
                if std::fs::write(&p, &bytes).is_ok() {
                    hit.push(p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default());
                }
            }
        }
    }
    format!("flipped 64 bytes in {}", hit.join(", "))
}

/// Clears and makes a run's output folder.
fn fresh_dir(out: &Path) -> Result<(), ChaosError> {
    if out.exists() {
        std::fs::remove_dir_all(out).map_err(io(format!("clearing {}", out.display())))?;
    }
    std::fs::create_dir_all(out).map_err(io(format!("creating {}", out.display())))
}

/// The faulted run's test network, when its faults need one; refuses when this machine cannot
/// make it.
fn test_network(o: &ChaosOptions) -> Result<Option<Hosts>, ChaosError> {
    let s = &o.scenario;
    if !s.needs_net() {
        return Ok(None);
    }
    let mut kinds: Vec<&str> = s.faults.iter().filter(|f| f.kind.needs_net()).map(|f| f.kind.name()).collect();
    kinds.dedup();
    let refuse = |why: String| {
        ChaosError::Run(format!(
            "this scenario's network faults ({}) put every worker in a network namespace of its own, which this machine cannot do: {why}",
            kinds.join(", ")
        ))
    };
    let needs_tc = s.faults.iter().any(|f| f.kind == FaultKind::Throttle);
    hosts::preflight(needs_tc).map_err(refuse)?;
    let hosts = Hosts::new(s.nprocs, s.joins(), s.needs_links(), &o.output.join("faulted.net")).map_err(refuse)?;
    Ok(Some(hosts))
}

/// Runs the scenario (fault-free, then faulted) and returns the report; `report.json` is
/// written under the output folder.
pub fn run(o: &ChaosOptions) -> Result<Report, ChaosError> {
    // Before the output folder is made: a scenario naming no config file leaves nothing behind.
    let cfg = config_path(o);
    if !cfg.is_file() {
        return Err(ChaosError::Run(format!(
            "the scenario's config {} is not a file (a relative `config` is taken from the scenario file's folder)",
            cfg.display()
        )));
    }
    std::fs::create_dir_all(&o.output).map_err(io(format!("creating {}", o.output.display())))?;
    let faults = o.scenario.resolve(o.seed);
    let needs_disk = faults.iter().any(|f| f.kind == FaultKind::DiskFull);
    if needs_disk {
        // SAFETY: geteuid(2) has no preconditions and touches no memory.
        if unsafe { libc::geteuid() } != 0 {
            return Err(ChaosError::Run("disk_full mounts a small file system on the checkpoint folder, which needs root".into()));
        }
    }
    // Before anything runs: a scenario this machine cannot fault is refused at once.
    let mut faulted_env = Env { hosts: test_network(o)?, disk: None, agents: None, hooks: faulted_hooks(o, &faults) };
    let pb = match o.progress {
        true => {
            let pb = ProgressBar::new(o.scenario.steps);
            if let Ok(style) = ProgressStyle::with_template("{spinner} {msg:9} step {pos}/{len} [{bar:30.cyan/blue}] {elapsed}") {
                pb.set_style(style.progress_chars("=> "));
            }
            pb.enable_steady_tick(Duration::from_millis(200));
            pb
        }
        false => ProgressBar::hidden(),
    };
    fresh_dir(&o.output.join("clean"))?;
    let (clean, _) = run_one(o, "clean", &[], &mut Env { hooks: o.faults.clone(), ..Env::default() }, &pb)?;
    if !clean.ok {
        pb.finish_and_clear();
        let why = clean.error.clone().unwrap_or_else(|| "no summary".into());
        return Err(ChaosError::Run(format!(
            "the fault-free run failed ({why}); see {}; the faulted run was not started",
            o.output.join("clean.log").display()
        )));
    }
    let faulted_out = o.output.join("faulted");
    fresh_dir(&faulted_out)?;
    if needs_disk {
        let bytes = disk::size_for(disk::dir_bytes(&o.output.join("clean/checkpoints")));
        faulted_env.disk = Some(Disk::mount(&faulted_out.join("checkpoints"), bytes).map_err(ChaosError::Run)?);
    }
    if o.scenario.launch == Launch::Agents {
        // The port is taken just before the coordinator binds it.
        let ip = faulted_env.hosts.as_ref().map_or_else(|| "127.0.0.1".to_string(), Hosts::root_addr);
        faulted_env.agents = Some(AgentJob::new(&o.output, &ip)?);
    }
    let (faulted, reports) = run_one(o, "faulted", &faults, &mut faulted_env, &pb)?;
    pb.finish_and_clear();
    let network = faulted_env.hosts.as_ref().map(Hosts::describe);
    // Read before a disk_full tmpfs is copied out and unmounted.
    let checkpoint_leftovers = disk::checkpoint_leftovers(&faulted_out.join("checkpoints"));
    let checkpoint_disk = match faulted_env.disk.take() {
        Some(d) => {
            let what = format!("a {} MiB tmpfs on {}", d.bytes() >> 20, d.root().display());
            d.finish().map_err(ChaosError::Run)?;
            Some(what)
        }
        None => None,
    };
    let equal = clean.ok
        && faulted.ok
        && !clean.params_blake3.is_empty()
        && clean.params_blake3 == faulted.params_blake3
        && faulted.steps == o.scenario.steps;
    let mut events = Events::new(faulted_out.join(EVENTS_FILE));
    events.poll();
    let svg = crate::timeline::render(&events.all, &reports, faulted.started_unix_ms, faulted.wall_s);
    let path = o.output.join("timeline.svg");
    let timeline = std::fs::write(&path, svg).ok().map(|_| path);
    let report = Report {
        seed: o.seed,
        clean,
        faulted,
        faults: reports,
        steps_expected: o.scenario.steps,
        network,
        checkpoint_disk,
        checkpoint_leftovers,
        equal,
        timeline,
    };
    let json = serde_json::to_string_pretty(&report).map_err(|e| ChaosError::Run(e.to_string()))?;
    std::fs::write(o.output.join("report.json"), json).map_err(io("writing report.json"))?;
    Ok(report)
}

#[cfg(test)]
mod events_tests {
    use super::*;

    /// Regression: a poll that finds several new lines keeps every one of them (it used to skip
    /// every other line, counting the lines it had just read as already seen).
    #[test]
    fn a_poll_reads_every_new_line_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.jsonl");
        let line = |i: u64| format!("{{\"event\": \"step\", \"step\": {i}}}\n");
        std::fs::write(&path, (1..=5).map(line).collect::<String>()).unwrap();
        let mut e = Events::new(path.clone());
        e.poll();
        assert_eq!(e.all.iter().map(|v| v["step"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 2, 3, 4, 5]);
        let more: String = (6..=9).map(line).collect();
        std::fs::write(&path, (1..=5).map(line).collect::<String>() + &more + "{\"event\": \"st").unwrap();
        e.poll();
        assert_eq!(e.all.iter().map(|v| v["step"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 2, 3, 4, 5, 6, 7, 8, 9]);
        assert_eq!(e.step(), 9);
    }

    /// A SIGTERMed worker that asked to drain and then left at the end of its grace is reported
    /// as lost, not as a drain that went through (the note used to stay empty: the drain request
    /// is found first); a drain that completed keeps no such note.
    #[test]
    fn a_term_whose_drain_grace_ran_out_is_noted_as_lost() {
        let fired = || Fired {
            kind: FaultKind::Term,
            report: FaultReport::new(FaultKind::Term, true, String::new()),
            id: Some(2),
            at_ms: 1_000,
            undone_ms: None,
            duration_ms: None,
        };
        let mut events = Events::new(PathBuf::new());
        events.all = vec![
            serde_json::json!({"event": "drain_requested", "id": 2, "t_ms": 1_050}),
            serde_json::json!({"event": "lost", "id": 2, "t_ms": 1_400,
                "why": "worker 2 (pid 9): the process exited with status 3: it was asked to drain (SIGTERM or SIGUSR1) and no step boundary came within its drain grace (tessera.elastic.drain_grace_ms = 300)"}),
            serde_json::json!({"event": "resumed", "step": 2, "t_ms": 5_000}),
        ];
        let r = timings(fired(), &events, 0, None, u64::MAX);
        assert_eq!(r.note, "asked to drain; left after the drain grace period (lost)");
        assert_eq!((r.detection_ms, r.recovery_ms), (Some(50), Some(3_950)));
        events.all[1]["why"] = "worker 2 (pid 9): the process was killed by signal 9".into();
        assert_eq!(
            timings(fired(), &events, 0, None, u64::MAX).note,
            "asked to drain; lost before a step boundary: worker 2 (pid 9): the process was killed by signal 9"
        );
        events.all.remove(1);
        assert_eq!(timings(fired(), &events, 0, None, u64::MAX).note, "");
    }
}
