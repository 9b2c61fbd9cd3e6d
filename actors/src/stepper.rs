//! The elastic driver's step/commit/recover control loop as a sans-IO state machine: which step
//! runs next, what a recovery starts from, which committed steps are replayed after a restore
//! from an older state, when a step whose commit failed counts as committed, and the counts of
//! those events.
//!
//! No IO, no clock, no randomness. The process driver (`src/engine/run.rs`,
//! `Run::elastic_run_step` and `Run::recover`) feeds [`Stepper::on`] what happened
//! ([`Input`]) and carries out the [`Action`] it answers: it attempts a step (first checking
//! for a pending membership change and re-balancing), forms a new epoch
//! (`Fleet::reconfigure` over the candidate steps, [`crate::recovery::candidate_steps`]),
//! replays a committed step, re-copies replicas after a replayed one, and tells the fleet the
//! new epoch runs. `stepper_sim` drives it over thousands of seeded worlds.
//!
//! # Inputs and actions
//! - [`Input::Step`] (between steps): run step `committed` until it commits →
//!   [`Action::Attempt`].
//! - [`Input::Change`]: a membership change must be recovered from: between steps (a failed
//!   evaluation, checkpoint or replica re-copy), before an attempt ran (a change pending, a
//!   re-balance that failed on a loss), or after a replayed step committed but its replica
//!   re-copy failed on a loss → [`Action::Reconfigure`] with the candidate steps.
//! - [`Input::Committed`], [`Input::Abandoned`], [`Input::CommitFailed`]: the outcome of an
//!   attempt or a replay (abandoned: it failed on a membership change before its commit;
//!   commit failed: every rank prepared it and the commit failed on a lost member, so its state
//!   may have reached the next step). An attempt that commits → [`Action::Committed`]; a
//!   replay that commits → [`Action::Resync`]; the failures → [`Action::Reconfigure`].
//! - [`Input::Restored`]: the new epoch's state is at `step` → [`Action::Replay`] of the first
//!   step it lacks, or [`Action::Recovered`].
//! - [`Input::Resynced`]: the replicas follow the replayed step → the next replay, or
//!   [`Action::Recovered`].
//! - [`Input::Resumed`] (after [`Action::Recovered`]: the driver told the fleet the epoch
//!   runs) → [`Action::Committed`] when the failed commit of the step being run reached every
//!   shard, [`Action::Attempt`] of the step again when a recovery interrupted it (counted as a
//!   re-run when an attempt had failed), or [`Action::Ready`] after a recovery between steps.
//!
//! Any other input in a phase is a driver bug and panics.
//!
//! # Rules
//! - A recovery starts from `state_at` = the committed steps (or, after a failed replay, the
//!   step the replay had reached) and `maybe_committed` = whether the commit of step
//!   `state_at` failed after every rank prepared it; the candidates are
//!   `candidate_steps(state_at, maybe_committed)`.
//! - A restore at `state_at + 1` after such a failed commit counts one `commits_completed`.
//! - After a restore at `s < committed`, steps `s..committed` are replayed in order, each
//!   followed by a replica re-copy; a failure in a replay restarts the recovery from the step
//!   it reached (with `maybe_committed` when its commit failed).
//! - After a restore at `committed + 1` the step being run counts as committed (once).
//!
//! # What the simulation checks
//! `stepper_sim` models the world (the state a restore can find, in memory at `t` or `t + 1`
//! or in a checkpoint at an older step; attempts and replays that commit, are abandoned, or
//! fail to commit with the state whole at `t + 1` or not; changes pending, re-copies that
//! fail) with its own oracle, not this machine's bookkeeping, and checks: committed steps never
//! go backwards and are never lost; the run ends with exactly the target number of steps
//! committed; each step counts as committed once; after a restore from an older step every
//! step up to the committed count is replayed, in order, before a new step runs;
//! `commits_completed`, `steps_rerun` and `steps_replayed` match the oracle's counts; and the
//! loop terminates (faults per seed are bounded). Replay one seed with
//! `TESSERA_SIM_SEED=<seed> cargo test --release -p tessera-actors stepper_replay --
//! --nocapture` (it prints the trace).

use crate::recovery::candidate_steps;

/// What happened, as the driver tells the machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Input {
    /// Between steps: run step [`Stepper::committed`] until it commits.
    Step,
    /// A membership change must be recovered from (see the module doc for when).
    Change,
    /// The attempted or replayed step committed.
    Committed,
    /// The attempted or replayed step failed on a membership change before its commit.
    Abandoned,
    /// Every rank prepared the attempted or replayed step and its commit failed on a lost member.
    CommitFailed,
    /// The new epoch's state is at `step` committed steps.
    Restored { step: u64 },
    /// The replicas were re-copied after a replayed step.
    Resynced,
    /// The driver told the fleet the new epoch runs (after [`Action::Recovered`]).
    Resumed,
}

/// What the driver does next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Attempt step `step`: check for a pending change, re-balance, run it.
    Attempt { step: u64 },
    /// Step `step` is committed: by its attempt, or (`by_recovery`) by a failed commit whose
    /// state every shard reached. The driver goes on from `step + 1`.
    Committed { step: u64, by_recovery: bool },
    /// Form a new epoch whose state is at one of `at` (best first), else from a checkpoint at
    /// or before the lowest; answer [`Input::Restored`].
    Reconfigure { at: Vec<u64> },
    /// Replay committed step `step`; answer its outcome.
    Replay { step: u64 },
    /// Re-copy the replicas at `at` committed steps when needed (after a replayed step); answer
    /// [`Input::Resynced`] or [`Input::Change`].
    Resync { at: u64 },
    /// The recovery is over with the state at `at` committed steps; answer [`Input::Resumed`].
    Recovered { at: u64 },
    /// The recovery between steps is over; the driver goes on (retries what failed).
    Ready,
}

/// The machine's counts (they go into the run's elastic summary).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Failed commits (of the step being run or of one being replayed) whose state every shard
    /// reached: the recovery restored at the step after.
    pub commits_completed: u64,
    /// Attempts of a step that failed (abandoned, or commit failed and not completed) and ran
    /// again.
    pub steps_rerun: u64,
    /// Committed steps replayed after a restore from an older state.
    pub steps_replayed: u64,
}

/// Why a recovery runs, which decides what follows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Why {
    /// Between steps.
    Boundary,
    /// Before an attempt ran (a change pending, a re-balance failed).
    BeforeAttempt,
    /// The attempt of the step failed.
    AttemptFailed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Idle,
    Attempting,
    Recovering { state_at: u64, maybe_committed: bool, why: Why },
    Replaying { at: u64, why: Why },
    Resyncing { at: u64, why: Why },
    Recovered { at: u64, why: Why },
}

/// The step/commit/recover control loop (module doc).
#[derive(Debug, Clone)]
pub struct Stepper {
    committed: u64,
    phase: Phase,
    counts: Counts,
}

impl Stepper {
    /// A machine between steps, with `committed` steps committed (where the run starts).
    pub fn new(committed: u64) -> Stepper {
        Stepper { committed, phase: Phase::Idle, counts: Counts::default() }
    }

    /// The committed steps.
    pub fn committed(&self) -> u64 {
        self.committed
    }

    pub fn counts(&self) -> Counts {
        self.counts
    }

    /// Whether it is between steps.
    pub fn idle(&self) -> bool {
        self.phase == Phase::Idle
    }

    /// Feeds `input`; the answer is what the driver does next. Panics on an input the phase does
    /// not expect (a driver bug).
    pub fn on(&mut self, input: Input) -> Action {
        let c = self.committed;
        match (self.phase, input) {
            (Phase::Idle, Input::Step) => self.attempt(),
            (Phase::Idle, Input::Change) => self.recover(c, false, Why::Boundary),
            (Phase::Attempting, Input::Change) => self.recover(c, false, Why::BeforeAttempt),
            (Phase::Attempting, Input::Committed) => {
                self.committed += 1;
                self.phase = Phase::Idle;
                Action::Committed { step: c, by_recovery: false }
            }
            (Phase::Attempting, Input::Abandoned) => self.recover(c, false, Why::AttemptFailed),
            (Phase::Attempting, Input::CommitFailed) => self.recover(c, true, Why::AttemptFailed),
            (Phase::Recovering { state_at, maybe_committed, why }, Input::Restored { step }) => {
                let best = candidate_steps(state_at, maybe_committed)[0];
                assert!(step <= best, "restored at step {step}, past the best candidate {best}");
                self.counts.commits_completed += u64::from(maybe_committed && step == state_at + 1);
                self.replay_from(step, why)
            }
            (Phase::Replaying { at, why }, Input::Committed) => {
                self.counts.steps_replayed += 1;
                self.phase = Phase::Resyncing { at: at + 1, why };
                Action::Resync { at: at + 1 }
            }
            (Phase::Replaying { at, why }, Input::Abandoned) => self.recover(at, false, why),
            (Phase::Replaying { at, why }, Input::CommitFailed) => self.recover(at, true, why),
            (Phase::Resyncing { at, why }, Input::Resynced) => self.replay_from(at, why),
            (Phase::Resyncing { at, why }, Input::Change) => self.recover(at, false, why),
            (Phase::Recovered { at, why }, Input::Resumed) => {
                if at > c {
                    // Only a failed commit of the step being run gets past it.
                    assert!(at == c + 1 && why == Why::AttemptFailed, "recovered at {at} with {c} committed ({why:?})");
                    self.committed += 1;
                    self.phase = Phase::Idle;
                    return Action::Committed { step: c, by_recovery: true };
                }
                match why {
                    Why::Boundary => {
                        self.phase = Phase::Idle;
                        Action::Ready
                    }
                    Why::BeforeAttempt => self.attempt(),
                    Why::AttemptFailed => {
                        self.counts.steps_rerun += 1;
                        self.attempt()
                    }
                }
            }
            (phase, input) => panic!("step machine: {input:?} is not expected in {phase:?}"),
        }
    }

    fn attempt(&mut self) -> Action {
        self.phase = Phase::Attempting;
        Action::Attempt { step: self.committed }
    }

    fn recover(&mut self, state_at: u64, maybe_committed: bool, why: Why) -> Action {
        self.phase = Phase::Recovering { state_at, maybe_committed, why };
        Action::Reconfigure { at: candidate_steps(state_at, maybe_committed) }
    }

    /// With the state at `at`: the next committed step it lacks, or the end of the recovery.
    fn replay_from(&mut self, at: u64, why: Why) -> Action {
        if at < self.committed {
            self.phase = Phase::Replaying { at, why };
            Action::Replay { step: at }
        } else {
            self.phase = Phase::Recovered { at, why };
            Action::Recovered { at }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_commit_whose_state_reached_the_next_step_counts_once() {
        let mut m = Stepper::new(5);
        assert_eq!(m.on(Input::Step), Action::Attempt { step: 5 });
        assert_eq!(m.on(Input::CommitFailed), Action::Reconfigure { at: vec![6, 5] });
        assert_eq!(m.on(Input::Restored { step: 6 }), Action::Recovered { at: 6 });
        assert_eq!(m.on(Input::Resumed), Action::Committed { step: 5, by_recovery: true });
        assert_eq!((m.committed(), m.counts().commits_completed, m.counts().steps_rerun), (6, 1, 0));
    }

    #[test]
    fn a_restore_from_an_older_step_replays_and_a_replay_failure_restarts_from_where_it_got() {
        let mut m = Stepper::new(5);
        m.on(Input::Step);
        assert_eq!(m.on(Input::Abandoned), Action::Reconfigure { at: vec![5] });
        assert_eq!(m.on(Input::Restored { step: 3 }), Action::Replay { step: 3 });
        assert_eq!(m.on(Input::Committed), Action::Resync { at: 4 });
        assert_eq!(m.on(Input::Resynced), Action::Replay { step: 4 });
        assert_eq!(m.on(Input::CommitFailed), Action::Reconfigure { at: vec![5, 4] });
        assert_eq!(m.on(Input::Restored { step: 5 }), Action::Recovered { at: 5 });
        assert_eq!(m.on(Input::Resumed), Action::Attempt { step: 5 });
        let c = m.counts();
        assert_eq!((c.commits_completed, c.steps_rerun, c.steps_replayed), (1, 1, 1));
    }
}
