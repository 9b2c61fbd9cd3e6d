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
//!     {"at_step": 4, "kind": "stop", "rank": 1, "duration_ms": 3000},
//!     {"at_step": 3, "kind": "slow", "rank": 2, "duration_ms": 8000, "period_ms": 100, "duty_percent": 60},
//!     {"at_step": 5, "kind": "term"},
//!     {"at_step": 6, "kind": "join"},
//!     {"at_ms": 9000, "kind": "corrupt_checkpoint"},
//!     {"at_step": 8, "kind": "fail_writes", "duration_ms": 2000}
//!   ]
//! }
//! ```
//!
//! A fault fires once the run has committed `at_step` steps, or `at_ms` after the faulted run
//! started (exactly one of the two). `rank` (kill, stop, term) is a rank of the plan epoch in
//! force when the fault fires, or `"random"` (the default): the seed picks one of the members
//! then. `stop` sends SIGSTOP and, after `duration_ms` (default 5000), SIGCONT — a stop longer
//! than the run's heartbeat timeout is a hang the run must detect. `slow` makes a straggler with
//! real signals: for `duration_ms` (default 5000) the worker is SIGSTOPped for part of every
//! `period_ms` (default 100) and SIGCONTed for the rest; each period's stopped part is drawn by
//! the seed around `duty_percent` (default 50) of the period (uniform in ±50 % of it, each
//! stop at most 90 % of the period), so the worker runs at roughly `100 - duty_percent` % of its
//! speed; the run should measure it and give it fewer micro-batches. `fail_writes` makes the
//! checkpoint folder unwritable for `duration_ms`; `corrupt_checkpoint` flips bytes in the newest
//! checkpoint's tensors.

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// What to inject.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    /// SIGKILL a worker.
    Kill,
    /// SIGSTOP a worker for `duration_ms`, then SIGCONT it (if it is still there).
    Stop,
    /// SIGTERM a worker (spot preemption): it should hand its shard over and leave.
    Term,
    /// Start a new worker process that joins the run.
    Join,
    /// Flip bytes in the newest checkpoint's tensor files.
    CorruptCheckpoint,
    /// Make writes in the checkpoint folder fail for `duration_ms`.
    FailWrites,
    /// SIGSTOP/SIGCONT a worker on a seeded duty cycle for `duration_ms` (a straggler).
    Slow,
}

impl FaultKind {
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::Kill => "kill",
            FaultKind::Stop => "stop",
            FaultKind::Term => "term",
            FaultKind::Join => "join",
            FaultKind::CorruptCheckpoint => "corrupt_checkpoint",
            FaultKind::FailWrites => "fail_writes",
            FaultKind::Slow => "slow",
        }
    }

    /// Whether the fault targets a worker of the run.
    pub fn targets_rank(self) -> bool {
        matches!(self, FaultKind::Kill | FaultKind::Stop | FaultKind::Term | FaultKind::Slow)
    }
}

/// A rank, or `"random"`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum Target {
    Rank(usize),
    Named(String),
}

impl Default for Target {
    fn default() -> Self {
        Target::Named("random".into())
    }
}

/// One fault as the scenario file states it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultSpec {
    pub kind: FaultKind,
    #[serde(default)]
    pub at_step: Option<u64>,
    #[serde(default)]
    pub at_ms: Option<u64>,
    #[serde(default)]
    pub rank: Target,
    #[serde(default)]
    pub duration_ms: Option<u64>,
    /// `slow`: the length of one stop/continue cycle (ms).
    #[serde(default)]
    pub period_ms: Option<u64>,
    /// `slow`: the mean share of each period the worker is stopped (percent).
    #[serde(default)]
    pub duty_percent: Option<u64>,
}

/// `slow`: default cycle length (ms) and stopped share (percent), and their bounds.
pub const SLOW_PERIOD_MS: u64 = 100;
pub const SLOW_DUTY_PERCENT: u64 = 50;
const SLOW_PERIOD_MIN_MS: u64 = 10;
const SLOW_PERIOD_MAX_MS: u64 = 60_000;
const SLOW_DUTY_MAX_PERCENT: u64 = 90;

/// A scenario file.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
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
}

/// When a fault fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// Once the run has committed this many steps.
    Step(u64),
    /// This long after the faulted run started.
    Ms(u64),
}

/// A fault with its randomness resolved by the seed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    pub kind: FaultKind,
    pub trigger: Trigger,
    /// A fixed rank, or `None`: pick with `draw` among the members when the fault fires.
    pub rank: Option<usize>,
    /// The seed's draw for this fault.
    pub draw: u64,
    pub duration_ms: u64,
    /// `slow`: cycle length (ms) and mean stopped share (percent).
    pub period_ms: u64,
    pub duty_percent: u64,
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
    #[error("reading scenario {path}: {source}")]
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
        let s: Scenario = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        if s.nprocs == 0 {
            return Err(bad("nprocs must be at least 1".into()));
        }
        if s.steps == 0 {
            return Err(bad("steps must be at least 1".into()));
        }
        for (i, f) in s.faults.iter().enumerate() {
            let which = format!("faults[{i}] ({})", f.kind.name());
            match (f.at_step, f.at_ms) {
                (Some(_), Some(_)) | (None, None) => return Err(bad(format!("{which}: give exactly one of at_step and at_ms"))),
                (Some(st), None) if st >= s.steps => {
                    return Err(bad(format!("{which}: at_step {st} is not before the run's end ({} steps)", s.steps)))
                }
                _ => {}
            }
            match &f.rank {
                Target::Named(n) if n != "random" => return Err(bad(format!("{which}: rank {n:?}: a rank number or \"random\""))),
                Target::Rank(_) if !f.kind.targets_rank() => return Err(bad(format!("{which}: a {} fault takes no rank", f.kind.name()))),
                _ => {}
            }
            if f.duration_ms.is_some() && !matches!(f.kind, FaultKind::Stop | FaultKind::FailWrites | FaultKind::Slow) {
                return Err(bad(format!("{which}: only stop, slow and fail_writes take duration_ms")));
            }
            if (f.period_ms.is_some() || f.duty_percent.is_some()) && f.kind != FaultKind::Slow {
                return Err(bad(format!("{which}: only slow takes period_ms and duty_percent")));
            }
            if let Some(p) = f.period_ms.filter(|p| !(SLOW_PERIOD_MIN_MS..=SLOW_PERIOD_MAX_MS).contains(p)) {
                return Err(bad(format!("{which}: period_ms {p} is outside {SLOW_PERIOD_MIN_MS}..={SLOW_PERIOD_MAX_MS}")));
            }
            if let Some(d) = f.duty_percent.filter(|d| !(1..=SLOW_DUTY_MAX_PERCENT).contains(d)) {
                return Err(bad(format!("{which}: duty_percent {d} is outside 1..={SLOW_DUTY_MAX_PERCENT}")));
            }
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
                trigger: match (f.at_step, f.at_ms) {
                    (Some(s), _) => Trigger::Step(s),
                    (None, ms) => Trigger::Ms(ms.unwrap_or(0)),
                },
                rank: match f.rank {
                    Target::Rank(r) => Some(r),
                    Target::Named(_) => None,
                },
                draw: splitmix(&mut state),
                duration_ms: f.duration_ms.unwrap_or(5_000),
                period_ms: f.period_ms.unwrap_or(SLOW_PERIOD_MS),
                duty_percent: f.duty_percent.unwrap_or(SLOW_DUTY_PERCENT),
            })
            .collect();
        out.sort_by_key(|f| match f.trigger {
            Trigger::Step(s) => (0, s),
            Trigger::Ms(ms) => (1, ms),
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OK: &str = r#"{"config": "c.json", "nprocs": 4, "steps": 10, "faults": [
        {"at_step": 3, "kind": "kill"}, {"at_step": 1, "kind": "stop", "rank": 2, "duration_ms": 100},
        {"at_ms": 500, "kind": "join"}]}"#;

    #[test]
    fn scenarios_parse_and_the_seed_decides_random_ranks() {
        let s = Scenario::parse(OK, Path::new("s.json")).expect("valid");
        let a = s.resolve(7);
        assert_eq!(a.iter().map(|f| f.kind).collect::<Vec<_>>(), [FaultKind::Stop, FaultKind::Kill, FaultKind::Join]);
        assert_eq!(a[0].rank_in(4), 2, "a fixed rank stays");
        assert_eq!(a, s.resolve(7), "one seed, one plan");
        let draws: Vec<usize> = (0..32).map(|seed| s.resolve(seed)[1].rank_in(4)).collect();
        assert!(draws.iter().all(|r| *r < 4));
        assert!(draws.iter().any(|r| *r != draws[0]), "seeds pick different ranks: {draws:?}");
    }

    #[test]
    fn bad_scenarios_name_the_fault_and_the_problem() {
        let p = Path::new("s.json");
        let err = |text: &str| Scenario::parse(text, p).expect_err("invalid").to_string();
        let e = err(r#"{"config": "c", "nprocs": 2, "steps": 5, "faults": [{"kind": "kill"}]}"#);
        assert!(e.contains("faults[0] (kill)") && e.contains("exactly one"), "{e}");
        let e = err(r#"{"config": "c", "nprocs": 2, "steps": 5, "faults": [{"kind": "kill", "at_step": 5}]}"#);
        assert!(e.contains("at_step 5"), "{e}");
        let e = err(r#"{"config": "c", "nprocs": 2, "steps": 5, "faults": [{"kind": "join", "at_step": 1, "rank": 0}]}"#);
        assert!(e.contains("takes no rank"), "{e}");
        let e = err(r#"{"config": "c", "nprocs": 2, "steps": 5, "faults": [{"kind": "kill", "at_step": 1, "rank": "any"}]}"#);
        assert!(e.contains("\"any\""), "{e}");
        let e = err(r#"{"config": "c", "nprocs": 2, "steps": 5, "faults": [{"kind": "explode", "at_step": 1}]}"#);
        assert!(e.contains("explode"), "{e}");
        let e = err(r#"{"config": "c", "nprocs": 2, "steps": 5, "faults": [], "extra": 1}"#);
        assert!(e.contains("extra"), "{e}");
        let e = err(r#"{"config": "c", "nprocs": 2, "steps": 5, "faults": [{"kind": "kill", "at_step": 1, "period_ms": 100}]}"#);
        assert!(e.contains("only slow takes period_ms"), "{e}");
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
        assert_eq!((f.kind, f.rank, f.period_ms, f.duty_percent, f.duration_ms), (FaultKind::Slow, Some(1), 200, 60, 2000));
        let stops: Vec<u64> = (0..400).map(|k| f.slow_stop_ms(k)).collect();
        assert_eq!(stops, (0..400).map(|k| s.resolve(3)[0].slow_stop_ms(k)).collect::<Vec<_>>(), "one seed, one cycle");
        assert!(stops.iter().all(|&ms| (60..=180).contains(&ms)), "{stops:?}");
        let mean = stops.iter().sum::<u64>() as f64 / stops.len() as f64;
        assert!((mean - 120.0).abs() < 10.0, "mean stop {mean} ms of 200");
        assert_ne!(stops, (0..400).map(|k| s.resolve(4)[0].slow_stop_ms(k)).collect::<Vec<_>>(), "seeds differ");
    }
}
