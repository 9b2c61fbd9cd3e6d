//! The `DeviceWorker`'s handling of commands as a sans-IO machine: which command it runs when,
//! what it refuses, what it reports and what it tells its shard actors.
//!
//! No IO, no channel, no thread. [`crate::worker::DeviceWorker`] feeds [`WorkerCmd::on`] what
//! arrived in its mailbox ([`Input`]) and carries out the [`Action`]s: it asks its shard actors
//! ([`Action::Describe`]), hands a command to its compute thread through the queue of one
//! (`try_send`, never blocking; a full queue is fed back as [`Input::QueueFull`]), notifies the
//! shard actors, reports to the ClusterSupervisor, or fails. `worker_sim` drives it with a
//! simulated compute thread under a real [`crate::txn::StepTxn`].
//!
//! # The rules
//! - A shard query ([`Cmd::Shards`]) is answered by the actor itself, busy or not: the compute
//!   is not involved.
//! - Any other command goes to the compute thread, one at a time: while a command is in flight
//!   (handed off, its completion not yet back) another one is answered
//!   `Refused("busy with transaction <txn in flight>")` and changes nothing; one the queue
//!   turns away is answered `Refused("compute queue full")` and the worker is idle again.
//! - The compute's completion ([`Input::Done`]) ends the command in flight and is reported
//!   under the transaction it was handed off with: first the shard actors hear of a commit that
//!   succeeded or an abandon, then the ClusterSupervisor gets the outcome. A compute that
//!   panicked fails the worker ("compute of rank <r> panicked: <panic>"), which its
//!   NodeSupervisor reports as the rank lost.
//!
//! The worker keeps no books of what it prepared or committed: those are the compute's, and
//! the order of prepare, commit and abandon is the step transaction's. It relies on its sender
//! for that order: a step command that arrives while no command is in flight is run whatever
//! it is.

use crate::compute::{ComputeError, MemoryReport, Prepared};
use crate::shard::ShardStatus;
use crate::txn::Cmd;

/// A worker's answer to one command.
#[derive(Debug, PartialEq)]
pub(crate) enum Outcome {
    Prepared(Result<Prepared, ComputeError>),
    Committed {
        step: u64,
        result: Result<(), ComputeError>,
    },
    Abandoned {
        step: u64,
    },
    Memory(MemoryReport),
    Shards(Vec<ShardStatus>),
    /// The worker could not run the command (protocol violation or shard query failure).
    Refused(String),
}

impl Outcome {
    /// The answer the step transaction is fed: a failed prepare or commit and a refusal are
    /// errors (a refusal is this worker's own failure: a protocol violation or a shard query).
    pub(crate) fn into_answer(self) -> Result<Outcome, ComputeError> {
        match self {
            Outcome::Prepared(Err(e)) | Outcome::Committed { result: Err(e), .. } => Err(e),
            Outcome::Refused(e) => Err(ComputeError::failed(e)),
            outcome => Ok(outcome),
        }
    }
}

/// What arrived in the worker's mailbox (and what its queue answered).
#[derive(Debug)]
pub(crate) enum Input {
    /// The ClusterSupervisor's command under transaction `txn`.
    Command { txn: u64, cmd: Cmd },
    /// The compute thread's queue turned away the command of transaction `txn` just handed
    /// off ([`Action::Start`]): it is full.
    QueueFull { txn: u64 },
    /// The compute thread finished the command of transaction `txn`: its outcome, or the text
    /// of its panic.
    Done { txn: u64, result: Result<Outcome, String> },
}

/// What the shard actors are told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ShardNote {
    Committed(u64),
    Abandoned(u64),
}

/// What the worker does.
#[derive(Debug, PartialEq)]
pub(crate) enum Action {
    /// Ask the shard actors for their status and report it under `txn` (or the query's failure
    /// as a refusal).
    Describe { txn: u64 },
    /// Hand `cmd` to the compute thread under `txn` (if its queue is full: [`Input::QueueFull`]).
    Start { txn: u64, cmd: Cmd },
    /// Tell every shard actor.
    Note(ShardNote),
    /// Answer transaction `txn` to the ClusterSupervisor.
    Report { txn: u64, outcome: Outcome },
    /// The worker fails with this error.
    Fail(String),
}

/// The machine (module doc): the transaction whose command is in flight, if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WorkerCmd {
    rank: usize,
    busy: Option<u64>,
}

impl WorkerCmd {
    pub(crate) fn new(rank: usize) -> WorkerCmd {
        WorkerCmd { rank, busy: None }
    }

    /// The transaction whose command is in flight on the compute thread.
    #[cfg(test)]
    pub(crate) fn busy(&self) -> Option<u64> {
        self.busy
    }

    /// Feeds `input`; the answer is what the worker does, in order.
    pub(crate) fn on(&mut self, input: Input) -> Vec<Action> {
        match input {
            Input::Command { txn, cmd: Cmd::Shards } => vec![Action::Describe { txn }],
            Input::Command { txn, cmd } => match self.busy {
                Some(busy) => vec![Action::Report { txn, outcome: Outcome::Refused(format!("busy with transaction {busy}")) }],
                None => {
                    self.busy = Some(txn);
                    vec![Action::Start { txn, cmd }]
                }
            },
            Input::QueueFull { txn } => {
                if self.busy == Some(txn) {
                    self.busy = None;
                }
                vec![Action::Report { txn, outcome: Outcome::Refused("compute queue full".into()) }]
            }
            Input::Done { txn, result } => {
                self.busy = None;
                let outcome = match result {
                    Ok(outcome) => outcome,
                    Err(panic) => return vec![Action::Fail(format!("compute of rank {} panicked: {panic}", self.rank))],
                };
                let note = match outcome {
                    Outcome::Committed { step, result: Ok(()) } => Some(ShardNote::Committed(step)),
                    Outcome::Abandoned { step } => Some(ShardNote::Abandoned(step)),
                    _ => None,
                };
                let mut out: Vec<Action> = note.map(Action::Note).into_iter().collect();
                out.push(Action::Report { txn, outcome });
                out
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compute::{Prepared, StepOrder};

    const ORDER: StepOrder = StepOrder { step: 3, epoch: 0, attempt: 0 };

    fn refused(txn: u64, why: &str) -> Vec<Action> {
        vec![Action::Report { txn, outcome: Outcome::Refused(why.into()) }]
    }

    #[test]
    fn one_command_at_a_time_and_a_refusal_changes_nothing() {
        let mut w = WorkerCmd::new(2);
        assert_eq!(w.on(Input::Command { txn: 1, cmd: Cmd::Prepare(ORDER) }), vec![Action::Start { txn: 1, cmd: Cmd::Prepare(ORDER) }]);
        let before = w.clone();
        assert_eq!(w.on(Input::Command { txn: 2, cmd: Cmd::Commit(3) }), refused(2, "busy with transaction 1"));
        assert_eq!(w.on(Input::Command { txn: 3, cmd: Cmd::Memory }), refused(3, "busy with transaction 1"));
        assert_eq!(w, before);
        let done = w.on(Input::Done { txn: 1, result: Ok(Outcome::Prepared(Ok(Prepared::default()))) });
        assert_eq!(done, vec![Action::Report { txn: 1, outcome: Outcome::Prepared(Ok(Prepared::default())) }]);
        assert_eq!(w.busy(), None);
        assert_eq!(w.on(Input::Command { txn: 4, cmd: Cmd::Commit(3) }), vec![Action::Start { txn: 4, cmd: Cmd::Commit(3) }]);
    }

    #[test]
    fn shard_queries_are_answered_by_the_actor_even_when_busy() {
        let mut w = WorkerCmd::new(0);
        assert_eq!(w.on(Input::Command { txn: 1, cmd: Cmd::Shards }), vec![Action::Describe { txn: 1 }]);
        assert_eq!(w.busy(), None);
        w.on(Input::Command { txn: 2, cmd: Cmd::Memory });
        assert_eq!(w.on(Input::Command { txn: 3, cmd: Cmd::Shards }), vec![Action::Describe { txn: 3 }]);
        assert_eq!(w.busy(), Some(2));
    }

    #[test]
    fn a_full_queue_refuses_and_leaves_the_worker_idle() {
        let mut w = WorkerCmd::new(0);
        w.on(Input::Command { txn: 5, cmd: Cmd::Abandon(3) });
        assert_eq!(w.on(Input::QueueFull { txn: 5 }), refused(5, "compute queue full"));
        assert_eq!(w.busy(), None);
        assert_eq!(w.on(Input::Command { txn: 6, cmd: Cmd::Abandon(3) }), vec![Action::Start { txn: 6, cmd: Cmd::Abandon(3) }]);
    }

    #[test]
    fn shards_hear_of_commits_that_succeeded_and_of_abandons_before_the_report() {
        let mut w = WorkerCmd::new(1);
        w.on(Input::Command { txn: 1, cmd: Cmd::Commit(3) });
        let ok = Outcome::Committed { step: 3, result: Ok(()) };
        let want = vec![Action::Note(ShardNote::Committed(3)), Action::Report { txn: 1, outcome: ok }];
        assert_eq!(w.on(Input::Done { txn: 1, result: Ok(Outcome::Committed { step: 3, result: Ok(()) }) }), want);
        w.on(Input::Command { txn: 2, cmd: Cmd::Commit(4) });
        let failed = || Outcome::Committed { step: 4, result: Err(crate::compute::ComputeError::failed("no")) };
        assert_eq!(w.on(Input::Done { txn: 2, result: Ok(failed()) }), vec![Action::Report { txn: 2, outcome: failed() }]);
        w.on(Input::Command { txn: 3, cmd: Cmd::Abandon(4) });
        let want = vec![Action::Note(ShardNote::Abandoned(4)), Action::Report { txn: 3, outcome: Outcome::Abandoned { step: 4 } }];
        assert_eq!(w.on(Input::Done { txn: 3, result: Ok(Outcome::Abandoned { step: 4 }) }), want);
    }

    #[test]
    fn a_panic_fails_the_worker() {
        let mut w = WorkerCmd::new(7);
        w.on(Input::Command { txn: 1, cmd: Cmd::Prepare(ORDER) });
        assert_eq!(w.on(Input::Done { txn: 1, result: Err("boom".into()) }), vec![Action::Fail("compute of rank 7 panicked: boom".into())]);
    }
}
