//! The errors of the actor layer: which rank failed, in which phase, and why.

use crate::compute::{ComputeError, StepResult};
use std::fmt;

/// Why one rank did not complete a phase of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FailureCause {
    /// The compute returned an error (the worker is alive), or the worker refused the command.
    Returned(ComputeError),
    /// The worker actor died (its compute panicked or the actor failed/terminated): a
    /// membership event reported through supervision.
    Died(String),
    /// No answer within the phase timeout; the compute thread may be hung.
    TimedOut {
        /// The phase that timed out: "prepare", "commit", "abandon", "memory" or "shards".
        phase: &'static str,
        /// The bound that expired.
        timeout_ms: u64,
    },
}

/// One rank's failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankFailure {
    /// The failed rank.
    pub rank: usize,
    /// What happened.
    pub cause: FailureCause,
}

impl fmt::Display for RankFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.cause {
            FailureCause::Returned(e) => write!(f, "rank {} failed: {e}", self.rank),
            FailureCause::Died(e) => write!(f, "rank {} died: {e}", self.rank),
            FailureCause::TimedOut { phase, timeout_ms } => {
                write!(f, "rank {} did not finish {phase} within {timeout_ms} ms", self.rank)
            }
        }
    }
}

/// Renders a list of failures as "rank 1 failed: x; rank 3 died: y".
pub struct Failures<'a>(pub &'a [RankFailure]);

impl fmt::Display for Failures<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, failure) in self.0.iter().enumerate() {
            if i > 0 {
                write!(f, "; ")?;
            }
            write!(f, "{failure}")?;
        }
        Ok(())
    }
}

/// Errors of the supervisor tree and its synchronous driver.
#[derive(Debug, thiserror::Error)]
pub enum ActorError {
    /// The arguments of `Cluster::start` are inconsistent.
    #[error("invalid cluster setup: {0}")]
    Setup(String),
    /// The tokio runtime or an actor could not be started.
    #[error("could not start {what}: {cause}")]
    Spawn { what: String, cause: String },
    /// A step failed before commit; it was abandoned on every surviving worker and may be run
    /// again (after replanning if a member was lost).
    #[error("step {step} abandoned: {}", Failures(failures))]
    StepAbandoned { step: u64, failures: Vec<RankFailure> },
    /// A worker failed while committing: some ranks may have committed `step` and others not.
    /// `prepared` is what the step's prepare reported on every rank: an elastic driver that
    /// finds every shard at `step + 1` counts the step as committed with it.
    #[error("step {step} commit failed (ranks may disagree: an elastic run recovers from memory at step {step} + 1 or {step}, else from a checkpoint; a plain run resumes from the last checkpoint): {}", Failures(failures))]
    CommitFailed { step: u64, failures: Vec<RankFailure>, prepared: Box<StepResult> },
    /// Members were lost (died or hung); the plan of epoch `epoch` is no longer valid and
    /// steps are refused until a replan. `causes[i]` is why `ranks[i]` was lost.
    #[error("plan epoch {epoch} lost ranks {ranks:?} ({}); cannot run steps without replanning", causes.join("; "))]
    MembersLost { epoch: u64, ranks: Vec<usize>, causes: Vec<String> },
    /// A previous commit failed part-way; ranks may hold different committed steps.
    #[error("cluster is inconsistent after the failed commit of step {step}")]
    Inconsistent { step: u64 },
    /// `run_step` was asked for a step that is already committed.
    #[error("step {step} is already committed (last committed step is {last_committed})")]
    AlreadyCommitted { step: u64, last_committed: u64 },
    /// Another request is still in flight (a previous call gave up waiting for it).
    #[error("the cluster supervisor is busy with another request")]
    Busy,
    /// A query failed on some ranks.
    #[error("{what} query failed: {}", Failures(failures))]
    QueryFailed { what: &'static str, failures: Vec<RankFailure> },
    /// The ClusterSupervisor did not answer within the bound (it died or is wedged).
    #[error("no answer from the cluster supervisor to {what} within {timeout_ms} ms")]
    NoReply { what: &'static str, timeout_ms: u64 },
    /// The supervisor is gone (it stopped or failed).
    #[error("the cluster supervisor is gone ({0})")]
    SupervisorGone(String),
    /// Shutdown finished, but some compute threads did not exit within the bound; they were
    /// detached (a thread cannot be killed) and will exit when their compute call returns.
    #[error("shutdown: compute threads of ranks {ranks:?} did not exit within {bound_ms} ms and were detached")]
    ThreadsDetached { ranks: Vec<usize>, bound_ms: u64 },
    /// Shutdown could not stop the actor tree within the bound.
    #[error("shutdown: the actor tree did not stop within {bound_ms} ms")]
    StopTimedOut { bound_ms: u64 },
}
