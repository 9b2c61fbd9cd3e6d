//! `tessera chaos run`: runs a scenario's training job twice — fault-free, then with the
//! scenario's faults injected — and compares the final parameters.
//!
//! Both runs are `tessera train --nprocs N` with the elastic runtime on. The harness follows
//! the faulted run through its event log (`<output>/elastic_events.jsonl`: plan epochs with each
//! member's rank and pid, committed steps, losses, drains, joins, and when training resumed)
//! and fires each fault when its trigger is met: signals go to the pid of the targeted rank of
//! the epoch in force, a join starts `tessera worker --join`, checkpoint faults touch the run's
//! checkpoint folder, a `slow` fault runs a thread that SIGSTOPs and SIGCONTs the worker on the
//! seeded duty cycle. The report gives, per fault, when it was injected, when the run noticed
//! (the matching loss, drain or join event; for `slow`, the first re-assignment of micro-batch
//! blocks) and when it was training again, and the summary of both runs. The runs must end with equal `params_blake3` and every step committed.

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

use crate::plan::{Fault, FaultKind, Scenario, Trigger};

/// The event log the elastic driver writes (`engine::elastic::EVENTS_FILE`).
pub const EVENTS_FILE: &str = "elastic_events.jsonl";

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
}

/// What went wrong while running the scenario.
#[derive(Debug, thiserror::Error)]
pub enum ChaosError {
    #[error("{what}: {source}")]
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
    /// False for a fault whose trigger never came before the run ended.
    pub injected: bool,
    /// What was hit: "rank 2 (worker 2, pid 1234)", "new worker (pid 99)", a checkpoint path.
    pub target: String,
    pub injected_ms: u64,
    /// From injection to the run noticing it (a loss, drain or join event).
    pub detection_ms: Option<u64>,
    /// From noticing to training again (the next epoch's first step running).
    pub recovery_ms: Option<u64>,
    pub note: String,
}

/// One run's figures.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct RunReport {
    pub ok: bool,
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
    pub equal: bool,
}

impl Report {
    /// The report as people read it.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let ms = |v: Option<u64>| v.map_or_else(|| "-".to_string(), |v| format!("{v} ms"));
        let injected = self.faults.iter().filter(|f| f.injected).count();
        s.push_str(&format!("chaos run, seed {}\n\nfaults injected: {injected} of {}\n", self.seed, self.faults.len()));
        s.push_str(&format!("  {:<19} {:<40} {:>12} {:>12}  note\n", "fault", "target", "detection", "recovery"));
        for f in &self.faults {
            s.push_str(&format!("  {:<19} {:<40} {:>12} {:>12}  {}\n", f.kind, f.target, ms(f.detection_ms), ms(f.recovery_ms), f.note));
        }
        let el = &self.faulted.elastic;
        let get = |k: &str| el.get(k).and_then(Value::as_u64).unwrap_or(0);
        s.push_str(&format!(
            "\nfaulted run: {} of {} steps committed, {} step attempt(s) rerun, {} committed step(s) replayed from a checkpoint, \
             {} recoveries ({} from memory, {} from a checkpoint), {} worker(s) lost, {} joined, {} drained, {} checkpoint(s) not written, \
             {} rebalance(s) by measured speed\n",
            self.faulted.steps,
            self.steps_expected,
            get("steps_rerun"),
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
        s.push_str(&format!("params_blake3 fault-free {}\n", self.clean.params_blake3));
        s.push_str(&format!("params_blake3 faulted    {}\n", self.faulted.params_blake3));
        for (name, r) in [("fault-free", &self.clean), ("faulted", &self.faulted)] {
            if let Some(e) = &r.error {
                s.push_str(&format!("the {name} run failed: {e}\n"));
            }
        }
        s.push_str(match self.equal {
            true => "result: EQUAL — the faulted run gives the fault-free bits; no committed step lost\n",
            false => "result: DIFFERENT\n",
        });
        s
    }
}

/// The training command line of one run.
fn train_args(o: &ChaosOptions, out: &Path) -> Vec<String> {
    let cfg = match o.scenario.config.is_absolute() {
        true => o.scenario.config.clone(),
        false => o.base.join(&o.scenario.config),
    };
    let mut a: Vec<String> =
        vec!["train".into(), "--config".into(), cfg.display().to_string(), "--output".into(), out.display().to_string()];
    a.extend(["--no-progress".into(), "--steps".into(), o.scenario.steps.to_string(), "--nprocs".into(), o.scenario.nprocs.to_string()]);
    a.extend(["--set".into(), "tessera.elastic.enabled=true".into()]);
    for s in &o.scenario.set {
        a.extend(["--set".into(), s.clone()]);
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
        let mut skipped = 0;
        let mut line = String::new();
        while r.read_line(&mut line).unwrap_or(0) > 0 {
            if skipped < self.read {
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

/// A fault in flight: what to undo later.
enum Undo {
    Cont {
        pid: u32,
        at: Instant,
    },
    Writes {
        root: PathBuf,
        held: PathBuf,
        at: Instant,
    },
    /// A `slow` duty cycle: set `stop` to end it early; the thread leaves the worker running.
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
    let end = Instant::now() + Duration::from_millis(f.duration_ms);
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

/// Runs one training job; injects `faults` when given. Returns the run's report, the reports
/// of the faults and the joiners it started.
fn run_one(o: &ChaosOptions, name: &str, faults: &[Fault], pb: &ProgressBar) -> Result<(RunReport, Vec<FaultReport>), ChaosError> {
    let out = o.output.join(name);
    if out.exists() {
        std::fs::remove_dir_all(&out).map_err(io(format!("clearing {}", out.display())))?;
    }
    std::fs::create_dir_all(&out).map_err(io(format!("creating {}", out.display())))?;
    let log = std::fs::File::create(o.output.join(format!("{name}.log"))).map_err(io("creating the run's log"))?;
    let log2 = log.try_clone().map_err(io("the run's log"))?;
    let started = Instant::now();
    let start_ms = now_ms();
    let mut child = Command::new(&o.exe)
        .args(train_args(o, &out))
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log2)
        .spawn()
        .map_err(io(format!("starting {}", o.exe.display())))?;
    pb.set_length(o.scenario.steps);
    pb.set_position(0);
    pb.set_message(name.to_string());
    let timeout = Duration::from_secs(o.scenario.timeout_s.unwrap_or(600));
    let mut events = Events::new(out.join(EVENTS_FILE));
    let mut pending: VecDeque<Fault> = faults.iter().cloned().collect();
    let mut reports: Vec<(FaultReport, Option<u64>, u64)> = Vec::new(); // (report, worker id, injected at)
    let mut undo: Vec<Undo> = Vec::new();
    let mut joiners: Vec<Child> = Vec::new();
    let status = loop {
        if let Some(s) = child.try_wait().map_err(io("waiting for the run"))? {
            break s;
        }
        if started.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            return Err(ChaosError::Run(format!("the {name} run did not finish within {} s", timeout.as_secs())));
        }
        events.poll();
        pb.set_position(events.step());
        let elapsed = started.elapsed().as_millis() as u64;
        let due = pending.front().is_some_and(|f| match f.trigger {
            Trigger::Step(s) => events.step() >= s,
            Trigger::Ms(ms) => elapsed >= ms,
        });
        // One fault per poll, and only while the run has an epoch to aim at.
        let members = events.members();
        if due && !members.is_empty() {
            let f = pending.pop_front().ok_or_else(|| ChaosError::Run("no fault due".into()))?;
            let (report, id) = inject(o, &out, &f, &members, &mut undo, &mut joiners)?;
            pb.println(format!("  injected {} into {}", report.kind, report.target));
            reports.push((report, id, now_ms()));
        }
        undo.retain(|u| match u {
            Undo::Cont { pid, at } if Instant::now() >= *at => {
                signal(*pid, libc::SIGCONT);
                false
            }
            Undo::Writes { root, held, at } if Instant::now() >= *at => {
                let _ = std::fs::remove_file(root);
                let _ = std::fs::rename(held, root);
                false
            }
            Undo::Slow { thread, .. } => !thread.is_finished(),
            _ => true,
        });
        std::thread::sleep(Duration::from_millis(20));
    };
    for u in undo {
        match u {
            Undo::Writes { root, held, .. } => {
                let _ = std::fs::remove_file(&root);
                let _ = std::fs::rename(&held, &root);
            }
            Undo::Slow { stop, thread } => {
                stop.store(true, Ordering::SeqCst);
                let _ = thread.join();
            }
            Undo::Cont { .. } => {}
        }
    }
    for mut j in joiners {
        // A joiner leaves with the run; reap it (bounded).
        let deadline = Instant::now() + Duration::from_secs(15);
        while matches!(j.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = j.kill();
        let _ = j.wait();
    }
    events.poll();
    let wall_s = started.elapsed().as_secs_f64();
    let mut run = RunReport { ok: status.success(), wall_s, ..RunReport::default() };
    if !status.success() {
        let text = std::fs::read_to_string(o.output.join(format!("{name}.log"))).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(6).collect();
        run.error = Some(format!("{status}; log tail: {}", tail.into_iter().rev().collect::<Vec<_>>().join(" | ")));
    }
    if let Ok(text) = std::fs::read_to_string(out.join("summary.json")) {
        let v: Value = serde_json::from_str(&text).unwrap_or_default();
        run.steps = v["steps"].as_u64().unwrap_or(0);
        run.params_blake3 = v["params_blake3"].as_str().unwrap_or("").to_string();
        run.tokens_per_s = v["tokens_per_s"].as_f64().unwrap_or(0.0);
        run.elastic = v["elastic"].clone();
    }
    let mut faults: Vec<FaultReport> = reports.into_iter().map(|(r, id, at)| timings(r, id, at, &events, start_ms)).collect();
    // A fault whose trigger never came is reported, not silently left out.
    faults.extend(pending.iter().map(|f| FaultReport {
        kind: f.kind.name(),
        injected: false,
        target: String::new(),
        injected_ms: 0,
        detection_ms: None,
        recovery_ms: None,
        note: format!("not injected: the run ended first ({} steps committed, {} events seen)", events.step(), events.all.len()),
    }));
    Ok((run, faults))
}

/// Fills detection and recovery times from the event log.
fn timings(mut r: FaultReport, id: Option<u64>, at: u64, events: &Events, start_ms: u64) -> FaultReport {
    r.injected_ms = at.saturating_sub(start_ms);
    let after = |e: &&Value| e["t_ms"].as_u64().unwrap_or(0) >= at;
    let noticed = match (r.kind, id) {
        ("kill" | "stop", Some(id)) => events.of("lost").filter(after).find(|e| e["id"].as_u64() == Some(id)).cloned(),
        ("term", Some(id)) => events
            .of("drain_requested")
            .filter(after)
            .find(|e| e["id"].as_u64() == Some(id))
            .cloned()
            .or_else(|| events.of("lost").filter(after).find(|e| e["id"].as_u64() == Some(id)).cloned()),
        ("join", _) => events.of("join_requested").find(|e| e["pid"].as_u64() == id).cloned(),
        ("slow", Some(_)) => {
            let rb = events.of("rebalance").find(after).cloned();
            r.note = match &rb {
                Some(e) => format!("{}; rebalanced at step {}: micro-batches per rank {}", r.note, e["step"], e["micro_batches"]),
                None => format!("{}; no rebalance", r.note),
            };
            if let Some(e) = rb {
                r.detection_ms = e["t_ms"].as_u64().map(|t| t.saturating_sub(at));
            }
            return r;
        }
        _ => None,
    };
    if let Some(n) = noticed {
        let t = n["t_ms"].as_u64().unwrap_or(at);
        r.detection_ms = Some(t.saturating_sub(at));
        if n["event"] == "lost" && r.kind == "term" {
            r.note = "left after the drain grace period (lost)".into();
        }
        let back = events.of("resumed").find(|e| e["t_ms"].as_u64().unwrap_or(0) >= t);
        r.recovery_ms = back.and_then(|b| b["t_ms"].as_u64()).map(|b| b.saturating_sub(t));
    } else if r.kind == "stop" {
        r.note = "not noticed: it resumed within the heartbeat timeout".into();
    }
    r
}

/// Injects one fault; returns its report and the worker id it hit (the pid, for a join).
fn inject(
    o: &ChaosOptions,
    out: &Path,
    f: &Fault,
    members: &[(usize, u64, u32)],
    undo: &mut Vec<Undo>,
    joiners: &mut Vec<Child>,
) -> Result<(FaultReport, Option<u64>), ChaosError> {
    let mut report = FaultReport {
        kind: f.kind.name(),
        injected: true,
        target: String::new(),
        injected_ms: 0,
        detection_ms: None,
        recovery_ms: None,
        note: String::new(),
    };
    let id = match f.kind {
        FaultKind::Kill | FaultKind::Stop | FaultKind::Term | FaultKind::Slow => {
            let rank = f.rank_in(members.len());
            let Some(&(rank, id, pid)) = members.iter().find(|m| m.0 == rank) else {
                report.target = format!("rank {rank}");
                report.note = format!("skipped: the run has {} member(s)", members.len());
                return Ok((report, None));
            };
            report.target = format!("rank {rank} (worker {id}, pid {pid})");
            match f.kind {
                FaultKind::Kill => signal(pid, libc::SIGKILL),
                FaultKind::Term => signal(pid, libc::SIGTERM),
                FaultKind::Slow => {
                    let stop = Arc::new(AtomicBool::new(false));
                    let (s, fault) = (Arc::clone(&stop), f.clone());
                    let thread = std::thread::Builder::new()
                        .name("chaos-slow".into())
                        .spawn(move || duty_cycle(pid, &fault, &s))
                        .map_err(io("starting the slow fault's thread"))?;
                    undo.push(Undo::Slow { stop, thread });
                    report.note = format!("stopped ~{} % of every {} ms for {} ms", f.duty_percent, f.period_ms, f.duration_ms);
                }
                _ => {
                    signal(pid, libc::SIGSTOP);
                    undo.push(Undo::Cont { pid, at: Instant::now() + Duration::from_millis(f.duration_ms) });
                    report.note = format!("stopped for {} ms", f.duration_ms);
                }
            }
            Some(id)
        }
        FaultKind::Join => {
            let child = Command::new(&o.exe)
                .args(["worker", "--join", "--dir"])
                .arg(out.join("procs"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .map_err(io("starting a joining worker"))?;
            report.target = format!("new worker (pid {})", child.id());
            let pid = u64::from(child.id());
            joiners.push(child);
            Some(pid)
        }
        FaultKind::CorruptCheckpoint => {
            let root = out.join("checkpoints");
            match newest_checkpoint(&root) {
                Some(dir) => {
                    report.target = dir.display().to_string();
                    report.note = corrupt(&dir);
                }
                None => {
                    report.target = root.display().to_string();
                    report.note = "skipped: no checkpoint yet".into();
                }
            }
            None
        }
        FaultKind::FailWrites => {
            let root = out.join("checkpoints");
            let held = out.join("checkpoints.held");
            let _ = std::fs::create_dir_all(&root);
            // A file where the folder was: every write under it fails (even for root).
            std::fs::rename(&root, &held).map_err(io(format!("moving {} away", root.display())))?;
            std::fs::write(&root, b"chaos: writes fail here\n").map_err(io(format!("blocking {}", root.display())))?;
            undo.push(Undo::Writes { root: root.clone(), held, at: Instant::now() + Duration::from_millis(f.duration_ms) });
            report.target = root.display().to_string();
            report.note = format!("unwritable for {} ms", f.duration_ms);
            None
        }
    };
    Ok((report, id))
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

/// Runs the scenario (fault-free, then faulted) and returns the report; `report.json` is
/// written under the output folder.
pub fn run(o: &ChaosOptions) -> Result<Report, ChaosError> {
    std::fs::create_dir_all(&o.output).map_err(io(format!("creating {}", o.output.display())))?;
    let faults = o.scenario.resolve(o.seed);
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
    let (clean, _) = run_one(o, "clean", &[], &pb)?;
    let (faulted, reports) = run_one(o, "faulted", &faults, &pb)?;
    pb.finish_and_clear();
    let equal = clean.ok
        && faulted.ok
        && !clean.params_blake3.is_empty()
        && clean.params_blake3 == faulted.params_blake3
        && faulted.steps == o.scenario.steps;
    let report = Report { seed: o.seed, clean, faulted, faults: reports, steps_expected: o.scenario.steps, equal };
    let json = serde_json::to_string_pretty(&report).map_err(|e| ChaosError::Run(e.to_string()))?;
    std::fs::write(o.output.join("report.json"), json).map_err(io("writing report.json"))?;
    Ok(report)
}
