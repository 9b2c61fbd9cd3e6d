//! Fault plans for `tessera chaos run`: a scenario names the training run (config, process
//! count, steps, `--set` overrides) and the faults to inject into it; the seed resolves every
//! `"random"` choice. Scenarios are JSON:
//!
//! ```json
//! {
//!   "config": "configs/gpt-tiny.json", "nprocs": 4, "steps": 12,
//!   "set": ["tessera.seq_len=32", "tessera.elastic.heartbeat_timeout_ms=1000"],
//!   "faults": [
//!     {"at_step": 2, "kind": "kill", "rank": "random"},
//!     {"at_step": 2, "kind": "stop_actor", "rank": 0},
//!     {"at_step": 3, "kind": "kill_in_commit", "rank": 1},
//!     {"at_step": 4, "kind": "stop", "rank": 1, "duration_ms": 3000},
//!     {"at_step": 3, "kind": "slow", "rank": 2, "duration_ms": 8000, "period_ms": 100, "duty_percent": 60},
//!     {"at_step": 5, "kind": "term"},
//!     {"at_step": 5, "kind": "usr1", "rank": 0},
//!     {"at_step": 6, "kind": "join"},
//!     {"at_ms": 9000, "kind": "corrupt_checkpoint"},
//!     {"at_step": 8, "kind": "fail_writes", "duration_ms": 2000}
//!   ]
//! }
//! ```
//!
//! A fault fires once the run has committed `at_step` steps, `at_ms` after the faulted run
//! started, or (`at_epoch`) as soon as the run has formed plan epoch `at_epoch` — while that
//! epoch's replicas get their first full copy (exactly one of the three). Faults fire in the
//! order: `at_step` ones by step, then `at_epoch` ones by epoch, then `at_ms` ones by time. `rank` (every fault aimed at a worker) is a rank of the plan
//! epoch in force when the fault fires, or `"random"` (the default): the seed picks one of the
//! members then. `stop` sends SIGSTOP and, after `duration_ms` (default 5000), SIGCONT — a stop
//! longer than the run's heartbeat timeout is a hang the run must detect. `slow` makes a
//! straggler with real signals: for `duration_ms` (default 5000) the worker is SIGSTOPped for part
//! of every `period_ms` (default 100) and SIGCONTed for the rest; each period's stopped part is
//! drawn by the seed around `duty_percent` (default 50) of the period (uniform in ±50 % of it,
//! each stop at most 90 % of the period), so the worker runs at roughly `100 - duty_percent` % of
//! its speed; the run should measure it and give it fewer micro-batches. `term` and `usr1` send
//! SIGTERM (preemption) and SIGUSR1 (Slurm's `--signal=USR1@T` time-limit warning): the worker
//! should hand its shard over at the next step boundary and leave. `kill_in_commit`
//! sends SIGUSR1 to a worker whose fault hooks arm on it (the harness turns them on,
//! `TESSERA_TEST_FAULTS=kill_in_commit`, only for a scenario with this fault, which therefore
//! cannot hold a `usr1` too): it SIGKILLs itself when the driver's next `Commit`
//! reaches it (every rank has prepared that step; the others commit it, or fail to where they
//! share parameters with the lost worker); its detection
//! time counts from the signal, so it includes the rest of the step in flight. `stop_actor` stops
//! the rank's DeviceWorker actor in the driver's supervision tree (a `sigqueue` of SIGUSR2 with the
//! rank to the driver; the worker's process lives on): the tree reports the rank died, and the
//! driver must fence and replace it as it does a dead process (detection counts from the signal
//! to the loss, so it includes the rest of the step in flight). `fail_writes` makes
//! the checkpoint folder unwritable for `duration_ms` (default 5000); `corrupt_checkpoint` flips
//! bytes in the newest checkpoint's tensors.
//!
//! Network faults need every worker in its own network namespace (the harness makes them; root
//! and iproute2): `partition` sets the worker's link down, `throttle` caps its egress with
//! `tc … tbf` at `rate_mbit`, and `delay` (`delay_ms`, `jitter_ms`), `loss`, `reorder`
//! (`reorder_ms`, default 20) and `duplicate` (each with a `probability`) act on every QUIC
//! datagram the worker sends or receives, through the seeded fault proxy in front of its QUIC
//! socket. `disk_full` fills the checkpoint folder (a small tmpfs the harness mounts; root).
//! For these, `duration_ms` is optional: without it the fault lasts until the run ends.
//!
//! `"launch"` picks how the faulted run starts its workers: `"procs"` (the default) runs
//! `tessera train --nprocs N`, whose driver spawns the N worker processes; `"agents"` runs
//! `tessera coordinator` and N `tessera agent --join` processes beside it (each agent is a
//! worker; a `join` fault starts one more agent with the coordinator's join token), the way a
//! job spread over machines starts. The fault-free run is always `train --nprocs N`, so the
//! comparison also checks that agents give the bits of spawned workers. With network faults
//! each agent runs in a network namespace of its own (the coordinator on the harness's bridge
//! address), and with faults on QUIC datagrams (`delay`, `loss`, `reorder`, `duplicate`) each
//! agent puts its QUIC socket behind its own fault proxy, as spawned workers do (the harness
//! hands it the worker-net file, hidden `agent --worker-net FILE`).
//!
//! Any fault may say `"optional": true`: when the run ends before its trigger (a time late in a
//! run whose length depends on the machine) it is reported as not injected without failing the
//! scenario; every other fault must be injected for the scenario to pass.
//!
//! ```json
//! {"at_step": 2, "kind": "partition", "rank": 1, "duration_ms": 4000},
//! {"at_step": 0, "kind": "delay", "rank": 2, "delay_ms": 2, "jitter_ms": 3},
//! {"at_step": 3, "kind": "loss", "probability": 0.02, "duration_ms": 3000},
//! {"at_step": 4, "kind": "throttle", "rate_mbit": 40, "duration_ms": 2000},
//! {"at_step": 5, "kind": "disk_full", "duration_ms": 2500}
//! ```

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::proxy::LinkFaults;

/// Bound on a link fault's `delay_ms`, `jitter_ms` and `reorder_ms`.
pub const LINK_DELAY_MS_MAX: u64 = 10_000;
/// Default hold-back of a reordered datagram (ms).
pub const REORDER_MS_DEFAULT: u64 = 20;
/// Default duration of `stop` and `fail_writes` (ms).
pub const DURATION_MS_DEFAULT: u64 = 5_000;

/// What to inject.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// SIGKILL a worker.
    Kill,
    /// Stop a worker's DeviceWorker actor in the driver's supervision tree (the process lives
    /// on): `sigqueue(driver, SIGUSR2, rank)`, which the driver's fault hooks
    /// (`TESSERA_TEST_FAULTS=stop_actor`, set by the harness) take. The driver must treat the
    /// rank as lost.
    StopActor,
    /// SIGUSR1 a worker whose fault hooks (`TESSERA_TEST_FAULTS=kill_in_commit`, which the
    /// harness sets for this fault) arm it to SIGKILL itself when the driver's next `Commit`
    /// arrives: a loss inside the commit window (every rank prepared that step), which a
    /// signal from outside cannot aim at.
    KillInCommit,
    /// SIGSTOP a worker for `duration_ms`, then SIGCONT it (if it is still there).
    Stop,
    /// SIGTERM a worker (spot preemption): it should hand its shard over and leave.
    Term,
    /// SIGUSR1 a worker (Slurm's time-limit warning, `--signal=USR1@T`): a stop request as
    /// SIGTERM is, without the fault hooks that make it `kill_in_commit`'s trigger.
    Usr1,
    /// Start a new worker process that joins the run.
    Join,
    /// Flip bytes in the newest checkpoint's tensor files.
    CorruptCheckpoint,
    /// Make writes in the checkpoint folder fail for `duration_ms`.
    FailWrites,
    /// Set a worker's network link down (for `duration_ms`, or for good).
    Partition,
    /// Delay (and jitter) every QUIC datagram of a worker.
    Delay,
    /// Drop a share of a worker's QUIC datagrams.
    Loss,
    /// Hold back a share of a worker's QUIC datagrams so later ones overtake them.
    Reorder,
    /// Send a share of a worker's QUIC datagrams twice.
    Duplicate,
    /// Cap a worker's egress bandwidth (`tc … tbf`).
    Throttle,
    /// Fill the checkpoint folder's file system: checkpoint writes fail with ENOSPC.
    DiskFull,
    /// SIGSTOP/SIGCONT a worker on a seeded duty cycle for `duration_ms` (a straggler).
    Slow,
}

impl FaultKind {
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Kill => "kill",
            FaultKind::StopActor => "stop_actor",
            FaultKind::KillInCommit => "kill_in_commit",
            FaultKind::Stop => "stop",
            FaultKind::Term => "term",
            FaultKind::Usr1 => "usr1",
            FaultKind::Join => "join",
            FaultKind::CorruptCheckpoint => "corrupt_checkpoint",
            FaultKind::FailWrites => "fail_writes",
            FaultKind::Partition => "partition",
            FaultKind::Delay => "delay",
            FaultKind::Loss => "loss",
            FaultKind::Reorder => "reorder",
            FaultKind::Duplicate => "duplicate",
            FaultKind::Throttle => "throttle",
            FaultKind::DiskFull => "disk_full",
            FaultKind::Slow => "slow",
        }
    }

    /// Whether the fault targets a worker of the run.
    pub fn targets_rank(self) -> bool {
        matches!(
            self,
            FaultKind::Kill
                | FaultKind::StopActor
                | FaultKind::KillInCommit
                | FaultKind::Stop
                | FaultKind::Term
                | FaultKind::Usr1
                | FaultKind::Slow
        ) || self.needs_net()
    }

    /// Whether the fault needs the workers in network namespaces.
    pub fn needs_net(self) -> bool {
        self.on_link() || matches!(self, FaultKind::Partition | FaultKind::Throttle)
    }

    /// Whether the fault acts through the fault proxy in front of a worker's QUIC socket.
    pub fn on_link(self) -> bool {
        matches!(self, FaultKind::Delay | FaultKind::Loss | FaultKind::Reorder | FaultKind::Duplicate)
    }

    /// The optional fields this kind takes (`kind`, `at_step`, `at_ms` and, for faults aimed at a
    /// worker, `rank` go with every kind).
    fn fields(self) -> &'static [&'static str] {
        match self {
            FaultKind::Stop | FaultKind::FailWrites | FaultKind::Partition | FaultKind::DiskFull => &["duration_ms"],
            FaultKind::Delay => &["duration_ms", "delay_ms", "jitter_ms"],
            FaultKind::Loss | FaultKind::Duplicate => &["duration_ms", "probability"],
            FaultKind::Reorder => &["duration_ms", "probability", "reorder_ms"],
            FaultKind::Throttle => &["duration_ms", "rate_mbit"],
            FaultKind::Slow => &["duration_ms", "period_ms", "duty_percent"],
            FaultKind::Kill
            | FaultKind::StopActor
            | FaultKind::KillInCommit
            | FaultKind::Term
            | FaultKind::Usr1
            | FaultKind::Join
            | FaultKind::CorruptCheckpoint => &[],
        }
    }
}

/// A rank, or `"random"`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "serde_json::Value")]
pub enum Target {
    Rank(usize),
    Named(String),
}

impl TryFrom<serde_json::Value> for Target {
    type Error = String;

    fn try_from(v: serde_json::Value) -> Result<Target, String> {
        match v {
            serde_json::Value::Number(n) if n.as_u64().is_some() => Ok(Target::Rank(n.as_u64().unwrap_or(0) as usize)),
            serde_json::Value::String(s) => Ok(Target::Named(s)),
            other => Err(format!("rank: expected a rank number (0, 1, …) or \"random\", found {other}")),
        }
    }
}

impl Default for Target {
    fn default() -> Self {
        Target::Named("random".into())
    }
}

/// One fault as the scenario file states it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultSpec {
    pub kind: FaultKind,
    #[serde(default)]
    pub at_step: Option<u64>,
    #[serde(default)]
    pub at_ms: Option<u64>,
    #[serde(default)]
    pub at_epoch: Option<u64>,
    #[serde(default)]
    pub rank: Target,
    #[serde(default)]
    pub duration_ms: Option<u64>,
    /// `delay`: the fixed one-way delay of every datagram.
    #[serde(default)]
    pub delay_ms: Option<u64>,
    /// `delay`: extra uniform random delay in `0..=jitter_ms`.
    #[serde(default)]
    pub jitter_ms: Option<u64>,
    /// `loss`, `reorder`, `duplicate`: the share of datagrams hit.
    #[serde(default)]
    pub probability: Option<f64>,
    /// `reorder`: how long a reordered datagram is held back.
    #[serde(default)]
    pub reorder_ms: Option<u64>,
    /// `throttle`: the egress cap.
    #[serde(default)]
    pub rate_mbit: Option<u32>,
    /// `slow`: the length of one stop/continue cycle (ms).
    #[serde(default)]
    pub period_ms: Option<u64>,
    /// `slow`: the mean share of each period the worker is stopped (percent).
    #[serde(default)]
    pub duty_percent: Option<u64>,
    /// A fault the run may end before (a time trigger late in a run whose length depends on
    /// the machine): not injected, it is reported but does not fail the scenario.
    #[serde(default)]
    pub optional: bool,
}

impl FaultSpec {
    /// The optional fields given, by name.
    fn given(&self) -> Vec<&'static str> {
        let mut g = Vec::new();
        for (name, set) in [
            ("duration_ms", self.duration_ms.is_some()),
            ("delay_ms", self.delay_ms.is_some()),
            ("jitter_ms", self.jitter_ms.is_some()),
            ("probability", self.probability.is_some()),
            ("reorder_ms", self.reorder_ms.is_some()),
            ("rate_mbit", self.rate_mbit.is_some()),
            ("period_ms", self.period_ms.is_some()),
            ("duty_percent", self.duty_percent.is_some()),
        ] {
            if set {
                g.push(name);
            }
        }
        g
    }

    /// Checks the kind's own fields; `Err` says what is wrong.
    fn check_fields(&self) -> Result<(), String> {
        let allowed = self.kind.fields();
        if let Some(f) = self.given().into_iter().find(|f| !allowed.contains(f)) {
            let takes = match allowed.is_empty() {
                true => "no optional fields".to_string(),
                false => allowed.join(", "),
            };
            return Err(format!("a {} fault takes no {f} (it takes {takes})", self.kind.name()));
        }
        let ms = |name: &str, v: Option<u64>| match v {
            Some(v) if v > LINK_DELAY_MS_MAX => Err(format!("{name} {v} is above the limit of {LINK_DELAY_MS_MAX} ms")),
            _ => Ok(()),
        };
        ms("delay_ms", self.delay_ms)?;
        ms("jitter_ms", self.jitter_ms)?;
        ms("reorder_ms", self.reorder_ms)?;
        match self.kind {
            FaultKind::Delay if self.delay_ms.unwrap_or(0) == 0 && self.jitter_ms.unwrap_or(0) == 0 => {
                Err("give delay_ms or jitter_ms (milliseconds, above 0)".into())
            }
            FaultKind::Loss | FaultKind::Reorder | FaultKind::Duplicate => match self.probability {
                None => Err("give probability (the share of datagrams hit, above 0)".into()),
                Some(p) if !(p > 0.0 && p <= 1.0) => Err(format!("probability {p} is not in (0, 1]")),
                Some(p) if self.kind == FaultKind::Loss && p >= 1.0 => {
                    Err("probability 1 drops every datagram: that is a partition (kind \"partition\")".into())
                }
                _ => Ok(()),
            },
            FaultKind::Throttle => match self.rate_mbit {
                None | Some(0) => Err("give rate_mbit (the egress cap in Mbit/s, at least 1)".into()),
                _ => Ok(()),
            },
            FaultKind::Slow => match (self.period_ms, self.duty_percent) {
                (Some(p), _) if !(SLOW_PERIOD_MIN_MS..=SLOW_PERIOD_MAX_MS).contains(&p) => {
                    Err(format!("period_ms {p} is outside {SLOW_PERIOD_MIN_MS}..={SLOW_PERIOD_MAX_MS}"))
                }
                (_, Some(d)) if !(1..=SLOW_DUTY_MAX_PERCENT).contains(&d) => {
                    Err(format!("duty_percent {d} is outside 1..={SLOW_DUTY_MAX_PERCENT}"))
                }
                _ => Ok(()),
            },
            _ => Ok(()),
        }
    }

    /// What this fault does to a link (zero for faults that are not link faults).
    fn link_faults(&self) -> LinkFaults {
        let p = self.probability.unwrap_or(0.0);
        match self.kind {
            FaultKind::Delay => {
                LinkFaults { delay_ms: self.delay_ms.unwrap_or(0), jitter_ms: self.jitter_ms.unwrap_or(0), ..Default::default() }
            }
            FaultKind::Loss => LinkFaults { loss: p, ..Default::default() },
            FaultKind::Reorder => {
                LinkFaults { reorder: p, reorder_ms: self.reorder_ms.unwrap_or(REORDER_MS_DEFAULT), ..Default::default() }
            }
            FaultKind::Duplicate => LinkFaults { duplicate: p, ..Default::default() },
            _ => LinkFaults::default(),
        }
    }
}

/// `slow`: default cycle length (ms) and stopped share (percent), and their bounds.
pub const SLOW_PERIOD_MS: u64 = 100;
pub const SLOW_DUTY_PERCENT: u64 = 50;
const SLOW_PERIOD_MIN_MS: u64 = 10;
const SLOW_PERIOD_MAX_MS: u64 = 60_000;
const SLOW_DUTY_MAX_PERCENT: u64 = 90;

/// A scenario file.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// The DeepSpeed config, relative to the scenario file's folder (or absolute).
    pub config: PathBuf,
    pub nprocs: usize,
    pub steps: u64,
    /// `--set KEY=VALUE` overrides for both runs.
    #[serde(default)]
    pub set: Vec<String>,
    pub faults: Vec<FaultSpec>,
    /// Bound on each run (seconds; default 600).
    #[serde(default)]
    pub timeout_s: Option<u64>,
    /// How the faulted run starts its workers.
    #[serde(default)]
    pub launch: Launch,
}

/// How the faulted run starts its workers (the module notes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Launch {
    /// `tessera train --nprocs N`.
    #[default]
    Procs,
    /// `tessera coordinator` and N `tessera agent --join`.
    Agents,
}

/// When a fault fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// Once the run has committed this many steps.
    Step(u64),
    /// This long after the faulted run started.
    Ms(u64),
    /// Once the run has formed this plan epoch (logged it; its first full replica copy is
    /// then under way).
    Epoch(u64),
}

/// A fault with its randomness resolved by the seed.
#[derive(Debug, Clone, PartialEq)]
pub struct Fault {
    pub kind: FaultKind,
    pub trigger: Trigger,
    /// A fixed rank, or `None`: pick with `draw` among the members when the fault fires.
    pub rank: Option<usize>,
    /// The seed's draw for this fault (also the seed of a link fault's proxy).
    pub draw: u64,
    /// How long the fault lasts; `None`: until the run ends.
    pub duration_ms: Option<u64>,
    /// What a link fault does to the worker's datagrams.
    pub link: LinkFaults,
    /// A throttle's cap (Mbit/s).
    pub rate_mbit: u32,
    /// `slow`: cycle length (ms) and mean stopped share (percent).
    pub period_ms: u64,
    pub duty_percent: u64,
    /// Not injected, it does not fail the scenario ([`FaultSpec::optional`]).
    pub optional: bool,
}

impl Fault {
    /// `slow`: how long cycle `k` keeps the worker stopped (ms): the seed's draw around
    /// `duty_percent` of the period (uniform in ±50 % of it), at least 1 ms and at most 90 %
    /// of the period.
    pub fn slow_stop_ms(&self, k: u64) -> u64 {
        let mut state = self.draw ^ k.wrapping_mul(0xA076_1D64_78BD_642F);
        let u = (splitmix(&mut state) >> 11) as f64 / (1u64 << 53) as f64;
        let mean = (self.period_ms * self.duty_percent) as f64 / 100.0;
        let ms = (mean * (0.5 + u)).round() as u64;
        ms.clamp(1, self.period_ms * SLOW_DUTY_MAX_PERCENT / 100)
    }

    /// The rank this fault hits in a world of `world` members.
    pub fn rank_in(&self, world: usize) -> usize {
        match self.rank {
            Some(r) => r,
            None => (self.draw % world.max(1) as u64) as usize,
        }
    }
}

/// What is wrong with a scenario.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// The I/O error is the source (printed after the path by `{:#}`).
    #[error("reading scenario {path}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("scenario {path}: {detail}")]
    Invalid { path: PathBuf, detail: String },
}

/// splitmix64: the seed's stream of draws (one per fault, in order).
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Scenario {
    /// Reads and checks a scenario file.
    pub fn load(path: &Path) -> Result<Scenario, PlanError> {
        let text = std::fs::read_to_string(path).map_err(|source| PlanError::Io { path: path.to_path_buf(), source })?;
        Scenario::parse(&text, path)
    }

    /// Parses and checks scenario text; `path` names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Scenario, PlanError> {
        let bad = |detail: String| PlanError::Invalid { path: path.to_path_buf(), detail };
        // A type error names the field it is in (serde_json alone gives only line and column).
        let s: Scenario =
            serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_str(text)).map_err(|e| match e.path().to_string() {
                p if p == "." => bad(e.inner().to_string()),
                p => bad(format!("{p}: {}", e.inner())),
            })?;
        if s.nprocs == 0 {
            return Err(bad("nprocs must be at least 1".into()));
        }
        if s.steps == 0 {
            return Err(bad("steps must be at least 1".into()));
        }
        for (i, f) in s.faults.iter().enumerate() {
            let which = format!("faults[{i}] ({})", f.kind.name());
            let given = [f.at_step.is_some(), f.at_ms.is_some(), f.at_epoch.is_some()].iter().filter(|g| **g).count();
            if given != 1 {
                return Err(bad(format!("{which}: give exactly one of at_step, at_ms and at_epoch")));
            }
            match (f.at_step, f.at_epoch) {
                (Some(st), _) if st >= s.steps => {
                    return Err(bad(format!("{which}: at_step {st} is not before the run's end ({} steps)", s.steps)))
                }
                (_, Some(0)) => return Err(bad(format!("{which}: at_epoch 0 is the start (the first epoch after a change is 1)"))),
                _ => {}
            }
            let most = s.nprocs + s.joins();
            match &f.rank {
                Target::Named(n) if n != "random" => return Err(bad(format!("{which}: rank {n:?}: a rank number or \"random\""))),
                Target::Rank(_) if !f.kind.targets_rank() => return Err(bad(format!("{which}: a {} fault takes no rank", f.kind.name()))),
                Target::Rank(r) if *r >= most => {
                    return Err(bad(format!(
                        "{which}: rank {r} cannot exist: the run has at most {most} member(s) ({} processes and {} join(s))",
                        s.nprocs,
                        s.joins()
                    )))
                }
                _ => {}
            }
            f.check_fields().map_err(|e| bad(format!("{which}: {e}")))?;
        }
        for (i, kv) in s.set.iter().enumerate() {
            let (key, value) = kv.split_once('=').unwrap_or((kv, ""));
            let off = match key.trim() {
                "tessera.elastic.enabled" => value.trim() != "true",
                // Replacing the whole section would drop the harness's `enabled=true`.
                "tessera" | "tessera.elastic" => true,
                _ => false,
            };
            if off {
                return Err(bad(format!(
                    "set[{i}] {kv:?}: the chaos harness runs elastic training (it sets tessera.elastic.enabled=true), and a \
                     scenario cannot turn it off or replace the tessera.elastic section; set its fields one by one \
                     (tessera.elastic.KEY=VALUE)"
                )));
            }
        }
        let has = |k: FaultKind| s.faults.iter().any(|f| f.kind == k);
        if has(FaultKind::Usr1) && has(FaultKind::KillInCommit) {
            return Err(bad(
                "usr1 and kill_in_commit cannot share a scenario: kill_in_commit turns on the fault hooks that make a worker's \
                 SIGUSR1 arm a kill, and usr1 tests SIGUSR1 as a stop request without them"
                    .into(),
            ));
        }
        if has(FaultKind::DiskFull) && has(FaultKind::FailWrites) {
            return Err(bad(
                "disk_full and fail_writes cannot share a scenario: disk_full mounts a file system on the checkpoint folder, \
                 and fail_writes replaces that folder"
                    .into(),
            ));
        }
        Ok(s)
    }

    /// The faults with the seed's choices, ordered by trigger (steps first by step, then times).
    pub fn resolve(&self, seed: u64) -> Vec<Fault> {
        let mut state = seed;
        let mut out: Vec<Fault> = self
            .faults
            .iter()
            .map(|f| Fault {
                kind: f.kind,
                trigger: match (f.at_step, f.at_epoch, f.at_ms) {
                    (Some(s), _, _) => Trigger::Step(s),
                    (None, Some(e), _) => Trigger::Epoch(e),
                    (None, None, ms) => Trigger::Ms(ms.unwrap_or(0)),
                },
                rank: match f.rank {
                    Target::Rank(r) => Some(r),
                    Target::Named(_) => None,
                },
                draw: splitmix(&mut state),
                duration_ms: match f.kind {
                    FaultKind::Stop | FaultKind::FailWrites | FaultKind::Slow => Some(f.duration_ms.unwrap_or(DURATION_MS_DEFAULT)),
                    _ => f.duration_ms,
                },
                link: f.link_faults(),
                rate_mbit: f.rate_mbit.unwrap_or(0),
                period_ms: f.period_ms.unwrap_or(SLOW_PERIOD_MS),
                duty_percent: f.duty_percent.unwrap_or(SLOW_DUTY_PERCENT),
                optional: f.optional,
            })
            .collect();
        out.sort_by_key(|f| match f.trigger {
            Trigger::Step(s) => (0, s),
            Trigger::Epoch(e) => (1, e),
            Trigger::Ms(ms) => (2, ms),
        });
        out
    }

    /// Whether any fault needs the workers in network namespaces.
    pub fn needs_net(&self) -> bool {
        self.faults.iter().any(|f| f.kind.needs_net())
    }

    /// Whether any fault acts through the workers' fault proxies.
    pub fn needs_links(&self) -> bool {
        self.faults.iter().any(|f| f.kind.on_link())
    }

    /// How many workers join during the run (each needs a namespace of its own).
    pub fn joins(&self) -> usize {
        self.faults.iter().filter(|f| f.kind == FaultKind::Join).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OK: &str = r#"{"config": "c.json", "nprocs": 4, "steps": 10, "faults": [
        {"at_step": 3, "kind": "kill"}, {"at_step": 1, "kind": "stop", "rank": 2, "duration_ms": 100},
        {"at_ms": 500, "kind": "join"}, {"at_epoch": 2, "kind": "kill", "rank": 0}]}"#;

    #[test]
    fn scenarios_parse_and_the_seed_decides_random_ranks() {
        let s = Scenario::parse(OK, Path::new("s.json")).expect("valid");
        let a = s.resolve(7);
        assert_eq!(a.iter().map(|f| f.kind).collect::<Vec<_>>(), [FaultKind::Stop, FaultKind::Kill, FaultKind::Kill, FaultKind::Join]);
        assert_eq!(a[2].trigger, Trigger::Epoch(2), "steps, then epochs, then times");
        assert_eq!(a[0].rank_in(4), 2, "a fixed rank stays");
        assert_eq!(a, s.resolve(7), "one seed, one plan");
        let draws: Vec<usize> = (0..32).map(|seed| s.resolve(seed)[1].rank_in(4)).collect();
        assert!(draws.iter().all(|r| *r < 4));
        assert!(draws.iter().any(|r| *r != draws[0]), "seeds pick different ranks: {draws:?}");
    }

    /// Every scenario shipped in `chaos/scenarios/` is valid; the ten-minute one marks its late
    /// time-triggered faults optional.
    #[test]
    fn the_shipped_scenarios_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
        let mut n = 0;
        for e in std::fs::read_dir(&dir).expect("chaos/scenarios").flatten() {
            let s = Scenario::load(&e.path()).unwrap_or_else(|e| panic!("{e:#}"));
            n += 1;
            if e.file_name() == "gpt10m-fault-per-minute.json" {
                let late = s.resolve(1).into_iter().filter(|f| matches!(f.trigger, Trigger::Ms(ms) if ms >= 360_000)).collect::<Vec<_>>();
                assert!(!late.is_empty() && late.iter().all(|f| f.optional));
            }
        }
        assert!(n >= 2, "{n} scenarios in {}", dir.display());
    }

    #[test]
    fn bad_scenarios_name_the_fault_and_the_problem() {
        let p = Path::new("s.json");
        let err = |text: &str| Scenario::parse(text, p).expect_err("invalid").to_string();
        let e = err(r#"{"config": "c", "nprocs": 2, "steps": 5, "faults": [{"kind": "kill"}]}"#);
        assert!(e.contains("faults[0] (kill)") && e.contains("exactly one"), "{e}");
        let e = err(r#"{"config": "c", "nprocs": 2, "steps": 5, "faults": [{"kind": "kill", "at_step": 5}]}"#);
        assert!(e.contains("at_step 5"), "{e}");
        let e = err(r#"{"config": "c", "nprocs": 2, "steps": 5, "faults": [{"kind": "kill", "at_step": 1, "at_epoch": 1}]}"#);
        assert!(e.contains("exactly one of at_step, at_ms and at_epoch"), "{e}");
        let e = err(r#"{"config": "c", "nprocs": 2, "steps": 5, "faults": [{"kind": "kill", "at_epoch": 0}]}"#);
        assert!(e.contains("at_epoch 0"), "{e}");
        let e = err(r#"{"config": "c", "nprocs": 2, "steps": 5, "faults": [{"kind": "join", "at_step": 1, "rank": 0}]}"#);
        assert!(e.contains("takes no rank"), "{e}");
        let e = err(r#"{"config": "c", "nprocs": 2, "steps": 5, "faults": [{"kind": "kill", "at_step": 1, "rank": "any"}]}"#);
        assert!(e.contains("\"any\""), "{e}");
        let e = err(r#"{"config": "c", "nprocs": 2, "steps": 5, "faults": [{"kind": "explode", "at_step": 1}]}"#);
        assert!(e.contains("explode"), "{e}");
        let e = err(r#"{"config": "c", "nprocs": 2, "steps": 5, "faults": [], "extra": 1}"#);
        assert!(e.contains("extra"), "{e}");
        let e = err(r#"{"config": "c", "nprocs": 2, "steps": 5, "faults": [{"kind": "kill", "at_step": 1, "rank": 7}]}"#);
        assert!(e.contains("rank 7 cannot exist") && e.contains("at most 2 member(s)"), "{e}");
        let ok = r#"{"config": "c", "nprocs": 2, "steps": 5, "faults": [{"kind": "join", "at_step": 1}, {"kind": "kill", "at_step": 2, "rank": 2}]}"#;
        Scenario::parse(ok, p).expect("rank 2 exists after one join");
        // A value of the wrong type names its field.
        let e =
            err(r#"{"config": "c", "nprocs": 2, "steps": 5, "faults": [{"kind": "join", "at_step": 1}, {"kind": "kill", "at_step": -1}]}"#);
        assert!(e.starts_with("scenario s.json: faults[1].at_step: invalid value: integer `-1`, expected u64"), "{e}");
        let e = err(r#"{"config": "c", "nprocs": "four", "steps": 5, "faults": []}"#);
        assert!(e.contains("nprocs: invalid type: string \"four\""), "{e}");
        let e = err(r#"{"config": "c", "nprocs": 2, "steps": 5, "faults": [{"kind": "kill", "at_step": 1, "rank": -1}]}"#);
        assert!(e.contains("expected a rank number") && e.contains("found -1"), "{e}");
        let e = err(r#"{"config": "c", "nprocs": 2, "steps": 5, "set": ["tessera.elastic.enabled=false"], "faults": []}"#);
        assert!(e.contains("set[0]") && e.contains("cannot turn it off"), "{e}");
        let e = err(r#"{"config": "c", "nprocs": 2, "steps": 5, "set": ["x=1", "tessera.elastic={\"enabled\": false}"], "faults": []}"#);
        assert!(e.contains("set[1]"), "{e}");
        let ok =
            r#"{"config": "c", "nprocs": 2, "steps": 5, "set": ["elasticity.enabled=false", "tessera.elastic.replicas=0"], "faults": []}"#;
        Scenario::parse(ok, p).expect("the harness's own setting still wins over these");
        let e = err(r#"{"config": "c", "nprocs": 2, "steps": 5, "faults": [{"kind": "kill", "at_step": 1, "period_ms": 100}]}"#);
        assert!(e.contains("a kill fault takes no period_ms"), "{e}");
        let e = err(r#"{"config": "c", "nprocs": 2, "steps": 5, "faults": [{"kind": "slow", "at_step": 1, "duty_percent": 95}]}"#);
        assert!(e.contains("duty_percent 95"), "{e}");
        let e = err(r#"{"config": "c", "nprocs": 2, "steps": 5, "faults": [{"kind": "slow", "at_step": 1, "period_ms": 5}]}"#);
        assert!(e.contains("period_ms 5"), "{e}");
    }

    #[test]
    fn a_slow_faults_duty_cycle_is_seeded_and_bounded() {
        let text = r#"{"config": "c", "nprocs": 2, "steps": 5, "faults": [
            {"kind": "slow", "at_step": 1, "rank": 1, "duration_ms": 2000, "period_ms": 200, "duty_percent": 60}]}"#;
        let s = Scenario::parse(text, Path::new("s.json")).expect("valid");
        let f = &s.resolve(3)[0];
        assert_eq!((f.kind, f.rank, f.period_ms, f.duty_percent, f.duration_ms), (FaultKind::Slow, Some(1), 200, 60, Some(2000)));
        let stops: Vec<u64> = (0..400).map(|k| f.slow_stop_ms(k)).collect();
        assert_eq!(stops, (0..400).map(|k| s.resolve(3)[0].slow_stop_ms(k)).collect::<Vec<_>>(), "one seed, one cycle");
        assert!(stops.iter().all(|&ms| (60..=180).contains(&ms)), "{stops:?}");
        let mean = stops.iter().sum::<u64>() as f64 / stops.len() as f64;
        assert!((mean - 120.0).abs() < 10.0, "mean stop {mean} ms of 200");
        assert_ne!(stops, (0..400).map(|k| s.resolve(4)[0].slow_stop_ms(k)).collect::<Vec<_>>(), "seeds differ");
    }

    #[test]
    fn network_and_disk_faults_parse_with_their_fields() {
        let text = r#"{"config": "c.json", "nprocs": 3, "steps": 8, "faults": [
            {"at_step": 2, "kind": "partition", "rank": 1, "duration_ms": 4000},
            {"at_step": 0, "kind": "delay", "rank": 2, "delay_ms": 2, "jitter_ms": 3},
            {"at_step": 3, "kind": "loss", "probability": 0.02, "duration_ms": 3000},
            {"at_step": 3, "kind": "reorder", "probability": 0.1},
            {"at_step": 3, "kind": "duplicate", "probability": 0.05},
            {"at_step": 4, "kind": "throttle", "rate_mbit": 40, "duration_ms": 2000},
            {"at_step": 5, "kind": "disk_full", "duration_ms": 2500},
            {"at_step": 6, "kind": "partition"}]}"#;
        let s = Scenario::parse(text, Path::new("s.json")).expect("valid");
        assert!(s.needs_net() && s.needs_links());
        let f = s.resolve(1);
        let kinds: Vec<&str> = f.iter().map(|f| f.kind.name()).collect();
        assert_eq!(kinds, ["delay", "partition", "loss", "reorder", "duplicate", "throttle", "disk_full", "partition"]);
        assert_eq!(f[0].link, LinkFaults { delay_ms: 2, jitter_ms: 3, ..Default::default() });
        assert_eq!(f[0].duration_ms, None, "a link fault without a duration lasts the run");
        assert_eq!(f[1].duration_ms, Some(4000));
        assert_eq!(f[2].link.loss, 0.02);
        assert_eq!((f[3].link.reorder, f[3].link.reorder_ms), (0.1, REORDER_MS_DEFAULT));
        assert_eq!(f[4].link.duplicate, 0.05);
        assert_eq!(f[5].rate_mbit, 40);
        assert!(f[6].link.is_clean() && f[7].duration_ms.is_none());
        let plain = Scenario::parse(OK, Path::new("s.json")).unwrap();
        assert!(!plain.needs_net() && !plain.needs_links());
        assert_eq!(plain.resolve(0)[0].duration_ms, Some(100));
        assert_eq!(plain.joins(), 1);
    }

    #[test]
    fn bad_network_and_disk_faults_say_which_field_is_wrong() {
        let p = Path::new("s.json");
        let err = |fault: &str| {
            let text = format!(r#"{{"config": "c", "nprocs": 2, "steps": 5, "faults": [{fault}]}}"#);
            Scenario::parse(&text, p).expect_err("invalid").to_string()
        };
        let e = err(r#"{"kind": "loss", "at_step": 1}"#);
        assert!(e.contains("faults[0] (loss)") && e.contains("give probability"), "{e}");
        let e = err(r#"{"kind": "loss", "at_step": 1, "probability": 1.0}"#);
        assert!(e.contains("partition"), "{e}");
        let e = err(r#"{"kind": "duplicate", "at_step": 1, "probability": 1.5}"#);
        assert!(e.contains("1.5") && e.contains("(0, 1]"), "{e}");
        let e = err(r#"{"kind": "delay", "at_step": 1}"#);
        assert!(e.contains("delay_ms or jitter_ms"), "{e}");
        let e = err(r#"{"kind": "delay", "at_step": 1, "delay_ms": 20000}"#);
        assert!(e.contains("20000") && e.contains("limit"), "{e}");
        let e = err(r#"{"kind": "throttle", "at_step": 1}"#);
        assert!(e.contains("rate_mbit"), "{e}");
        let e = err(r#"{"kind": "kill", "at_step": 1, "duration_ms": 5}"#);
        assert!(e.contains("a kill fault takes no duration_ms") && e.contains("no optional fields"), "{e}");
        let e = err(r#"{"kind": "partition", "at_step": 1, "probability": 0.5}"#);
        assert!(e.contains("takes no probability") && e.contains("duration_ms"), "{e}");
        let e = err(r#"{"kind": "disk_full", "at_step": 1, "rank": 0}"#);
        assert!(e.contains("takes no rank"), "{e}");
        let e = err(r#"{"kind": "disk_full", "at_step": 1}, {"kind": "fail_writes", "at_step": 2}"#);
        assert!(e.contains("disk_full and fail_writes"), "{e}");
        let e = err(r#"{"kind": "usr1", "at_step": 1, "rank": 0}, {"kind": "kill_in_commit", "at_step": 2}"#);
        assert!(e.contains("usr1 and kill_in_commit cannot share a scenario"), "{e}");
    }

    #[test]
    fn launch_defaults_to_procs_and_takes_agents_with_every_network_fault() {
        let p = Path::new("s.json");
        let parse = |extra: &str, fault: &str| {
            Scenario::parse(&format!(r#"{{"config": "c", "nprocs": 2, "steps": 5{extra}, "faults": [{fault}]}}"#), p)
        };
        let kill = r#"{"kind": "kill", "at_step": 1}"#;
        assert_eq!(parse("", kill).expect("valid").launch, Launch::Procs);
        assert_eq!(parse(r#", "launch": "agents""#, kill).expect("valid").launch, Launch::Agents);
        let e = parse(r#", "launch": "ssh""#, kill).expect_err("no such launch").to_string();
        assert!(e.contains("s.json") && e.contains("ssh") && e.contains("agents"), "{e}");
        let ok = parse(
            r#", "launch": "agents""#,
            r#"{"kind": "partition", "at_step": 1, "rank": 0}, {"kind": "throttle", "at_step": 2, "rate_mbit": 10}"#,
        );
        let ok = ok.expect("partition and throttle work with agents");
        assert!(ok.needs_net() && !ok.needs_links());
        let links = parse(
            r#", "launch": "agents""#,
            r#"{"kind": "loss", "at_step": 1, "probability": 0.1}, {"kind": "delay", "at_step": 1, "delay_ms": 2},
               {"kind": "reorder", "at_step": 2, "probability": 0.05}, {"kind": "duplicate", "at_step": 2, "probability": 0.05}"#,
        );
        let links = links.expect("datagram faults work with agents");
        assert!(links.launch == Launch::Agents && links.needs_net() && links.needs_links());
    }
}
