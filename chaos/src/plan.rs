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
//! than the run's heartbeat timeout is a hang the run must detect. `fail_writes` makes the
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
        }
    }

    /// Whether the fault targets a worker of the run.
    pub fn targets_rank(self) -> bool {
        matches!(self, FaultKind::Kill | FaultKind::Stop | FaultKind::Term)
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
}

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
}

impl Fault {
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
            if f.duration_ms.is_some() && !matches!(f.kind, FaultKind::Stop | FaultKind::FailWrites) {
                return Err(bad(format!("{which}: only stop and fail_writes take duration_ms")));
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
    }
}
