//! The ClusterSupervisor's step transaction as a sans-IO state machine: which commands go to
//! which members, how their answers, losses and the phase timer end a phase, the decision
//! between commit and abandon, what makes a commit fail, and what the driver is answered.
//!
//! No IO, no clock, no randomness, no threads. [`crate::cluster::ClusterSupervisor`] feeds
//! [`StepTxn::on`] what happened ([`Input`]) and carries out the [`Action`]s it answers: it
//! sends each [`Action::Send`] to the member's DeviceWorker (a send that fails is fed back as
//! [`Input::Lost`] with the cause "worker mailbox closed"), arms and cancels the phase timer
//! (`step_timeout_ms`; it answers [`Input::Timeout`]), and answers the request it is serving.
//! `txn_sim` drives it over thousands of seeded worlds.
//!
//! # The transaction
//! A step runs as phases; each phase sends one command per live member under a fresh
//! transaction id and ends when every member it was sent to answered or was written off (lost,
//! or still silent when the timer fired: then it is lost too, "no answer to <phase> within
//! <n> ms"). Answers of an earlier phase, and of a member already written off, are ignored.
//! - **Admission** ([`Input::RunStep`]): refused ([`Action::Refuse`]) while another request
//!   runs ([`Refusal::Busy`]), after a commit failed ([`Refusal::Inconsistent`], for good),
//!   while any member is lost ([`Refusal::MembersLost`]: the epoch's plan is void), or for a
//!   step at or before the last committed one ([`Refusal::AlreadyCommitted`]).
//! - **Prepare** (attempt 0, then 1, …). Every member answered `Ok` and none was lost: commit
//!   — unless it is attempt 0 of a step in `abandon_steps` (the chaos hook), which is abandoned
//!   and prepared again as the next attempt. Anything else (an error, a loss, a timeout):
//!   abandon. A member lost after it answered, before the phase ended, fails the phase too
//!   (before, the commit went to the survivors and the step was answered committed though that
//!   member never committed it; the simulation found it); so does one lost in the abandon.
//! - **Abandon**, sent to the survivors. After a failed prepare the step ends
//!   [`Reply::Abandoned`] with the prepare's failures and the abandon's, in rank order (a
//!   failure in the abandon alone, after the chaos hook's abandon, ends it too).
//! - **Commit**, sent to every member (all of them prepared). Every member committed:
//!   [`Reply::Committed`] with what each member's prepare answered; the step is the last
//!   committed. Anything else: [`Reply::CommitFailed`] (some members may have committed and
//!   others not) and every later step is refused as inconsistent.
//! - **Queries** ([`Input::Query`]): one phase to the live members; the answers in rank order,
//!   or the failures.
//!
//! Any member lost is lost for good ([`StepTxn::is_lost`]).
//!
//! # What the simulation checks
//! `txn_sim` builds worlds of 1–8 members whose answers to each command (answer, fail, die
//! before or after answering, hang, answer late, a closed mailbox) and their order are drawn
//! per seed, with requests arriving while one runs, repeated steps and queries. Its oracle keeps
//! each member's own books (what it staged, prepared, committed, abandoned) and the requests',
//! and checks: a commit is sent only once every member of the epoch prepared that attempt; no
//! member is sent a commit of an attempt that was abandoned anywhere, nor one it did not
//! prepare; commands go only to members not written off, once per transaction; a phase ends
//! only when every member it was sent to answered or was written off; every request is
//! answered exactly once and each step ends committed, abandoned or commit-failed (termination);
//! a commit that fails on any member is reported as such with exactly those failures, is never
//! counted as committed, and refuses every later step; abandon failures are exactly the ones
//! seen; refusals are right; and the machine's counts match the oracle's. Replay one seed with
//! `TESSERA_SIM_SEED=<seed> cargo test --release -p tessera-actors txn_replay -- --nocapture`.

use std::collections::{BTreeMap, BTreeSet};

use crate::compute::{ComputeError, StepOrder};
use crate::error::{FailureCause, RankFailure};

/// A command to one member.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cmd {
    Prepare(StepOrder),
    Commit(u64),
    Abandon(u64),
    Memory,
    Shards,
}

/// A query over the live members.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Query {
    Memory,
    Shards,
}

/// The kind of a phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PhaseKind {
    Prepare,
    Commit,
    Abandon,
    Memory,
    Shards,
}

impl PhaseKind {
    /// The phase's name in failures ("prepare", "commit", "abandon", "memory", "shards").
    pub fn name(self) -> &'static str {
        match self {
            PhaseKind::Prepare => "prepare",
            PhaseKind::Commit => "commit",
            PhaseKind::Abandon => "abandon",
            PhaseKind::Memory => "memory",
            PhaseKind::Shards => "shards",
        }
    }
}

/// What happened, as the driver tells the machine. `T` is a member's answer (opaque here).
#[derive(Debug, Clone, PartialEq)]
pub enum Input<T> {
    /// Run step `step` as a transaction (a request).
    RunStep { step: u64 },
    /// Ask every live member (a request).
    Query(Query),
    /// Member `rank` answered the command of transaction `txn`: `Ok` (its answer) or the
    /// error it returned (or the refusal of the command).
    Answer { rank: usize, txn: u64, result: Result<T, ComputeError> },
    /// Member `rank` is lost (it died, its mailbox closed, its node failed).
    Lost { rank: usize, cause: String },
    /// The timer of transaction `txn`'s phase expired.
    Timeout { txn: u64 },
}

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Another request runs.
    Busy,
    /// The commit of `step` failed part-way: members may hold different committed steps.
    Inconsistent { step: u64 },
    /// Members `ranks` of epoch `epoch` are lost (`causes[i]` is why `ranks[i]` was).
    MembersLost { epoch: u64, ranks: Vec<usize>, causes: Vec<String> },
    /// `step` is already committed.
    AlreadyCommitted { step: u64, last_committed: u64 },
}

/// A step's attempt as its answer reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct Attempted<T> {
    pub step: u64,
    pub epoch: u64,
    /// Attempts prepared and then abandoned by the chaos hook.
    pub abandoned_attempts: Vec<u32>,
    /// Each member's answer to the prepare of the attempt that went to commit, by rank.
    pub prepared: BTreeMap<usize, T>,
}

/// The answer to the request being served.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply<T> {
    /// Every member committed.
    Committed(Attempted<T>),
    /// The step failed before its commit and was abandoned on every survivor.
    Abandoned { step: u64, failures: Vec<RankFailure> },
    /// Every member prepared and the commit failed on `failures`.
    CommitFailed { failures: Vec<RankFailure>, attempted: Attempted<T> },
    /// A query's answers by rank, or its failures.
    Queried { query: Query, result: Result<BTreeMap<usize, T>, Vec<RankFailure>> },
}

/// What the driver does.
#[derive(Debug, Clone, PartialEq)]
pub enum Action<T> {
    /// Send `cmd` under transaction `txn` to member `rank` (a failure: [`Input::Lost`]).
    Send { rank: usize, txn: u64, cmd: Cmd },
    /// Arm the timer of transaction `txn`'s phase (`step_timeout_ms`; then [`Input::Timeout`]).
    ArmTimer { txn: u64 },
    /// Transaction `txn`'s phase is over: cancel its timer.
    CancelTimer { txn: u64 },
    /// Refuse the request just fed (the one being served, if any, goes on).
    Refuse(Refusal),
    /// Answer the request being served.
    Reply(Reply<T>),
}

/// The machine's counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Steps committed.
    pub committed: u64,
    /// Steps answered [`Reply::Abandoned`].
    pub abandoned: u64,
    /// Steps answered [`Reply::CommitFailed`].
    pub commits_failed: u64,
    /// Abandon phases (every failed prepare and each chaos abandon).
    pub abandon_phases: u64,
    /// Requests refused.
    pub refused: u64,
}

/// One round of commands and the answers collected so far.
#[derive(Debug)]
struct Phase<T> {
    txn: u64,
    kind: PhaseKind,
    pending: BTreeSet<usize>,
    outcomes: BTreeMap<usize, T>,
    failures: Vec<RankFailure>,
    timer: bool,
}

#[derive(Debug)]
struct StepJob<T> {
    step: u64,
    attempt: u32,
    abandoned_attempts: Vec<u32>,
    prepared: BTreeMap<usize, T>,
    /// Set when the step must end abandoned once the abandon phase is over.
    failure: Option<Vec<RankFailure>>,
}

#[derive(Debug)]
enum Job<T> {
    Step(StepJob<T>),
    Query(Query),
}

/// The step transaction (module doc).
#[derive(Debug)]
pub struct StepTxn<T> {
    lost: Vec<Option<String>>,
    epoch: u64,
    step_timeout_ms: u64,
    abandon_steps: Vec<u64>,
    next_txn: u64,
    last_committed: Option<u64>,
    inconsistent_at: Option<u64>,
    active: Option<(Job<T>, Phase<T>)>,
    counts: Counts,
}

impl<T> StepTxn<T> {
    /// A machine over `world` members of plan epoch `epoch`; `step_timeout_ms` only names the
    /// bound in timeout failures (the driver keeps the clock); `abandon_steps` is the chaos hook.
    pub fn new(world: usize, epoch: u64, step_timeout_ms: u64, abandon_steps: Vec<u64>) -> StepTxn<T> {
        StepTxn {
            lost: vec![None; world],
            epoch,
            step_timeout_ms,
            abandon_steps,
            next_txn: 0,
            last_committed: None,
            inconsistent_at: None,
            active: None,
            counts: Counts::default(),
        }
    }

    /// Whether member `rank` is lost (or out of range).
    pub fn is_lost(&self, rank: usize) -> bool {
        self.lost.get(rank).is_none_or(|l| l.is_some())
    }

    /// Whether a request is being served.
    pub fn busy(&self) -> bool {
        self.active.is_some()
    }

    pub fn last_committed(&self) -> Option<u64> {
        self.last_committed
    }

    pub fn counts(&self) -> Counts {
        self.counts
    }

    /// Feeds `input`; the answer is what the driver does, in order.
    pub fn on(&mut self, input: Input<T>) -> Vec<Action<T>> {
        let mut out = Vec::new();
        match input {
            Input::RunStep { step } => match self.admit_step(step) {
                Err(r) => {
                    self.counts.refused += 1;
                    out.push(Action::Refuse(r));
                }
                Ok(()) => {
                    let job = StepJob { step, attempt: 0, abandoned_attempts: Vec::new(), prepared: BTreeMap::new(), failure: None };
                    let order = StepOrder { step, epoch: self.epoch, attempt: 0 };
                    let phase = self.dispatch(&mut out, PhaseKind::Prepare, Cmd::Prepare(order));
                    self.active = Some((Job::Step(job), phase));
                }
            },
            Input::Query(query) => {
                if self.active.is_some() {
                    self.counts.refused += 1;
                    out.push(Action::Refuse(Refusal::Busy));
                } else {
                    let (kind, cmd) = match query {
                        Query::Memory => (PhaseKind::Memory, Cmd::Memory),
                        Query::Shards => (PhaseKind::Shards, Cmd::Shards),
                    };
                    let phase = self.dispatch(&mut out, kind, cmd);
                    self.active = Some((Job::Query(query), phase));
                }
            }
            Input::Answer { rank, txn, result } => self.on_answer(rank, txn, result),
            Input::Lost { rank, cause } => self.on_lost(rank, cause),
            Input::Timeout { txn } => self.on_timeout(txn),
        }
        self.drive(&mut out);
        out
    }

    fn lost_ranks(&self) -> Vec<usize> {
        (0..self.lost.len()).filter(|&r| self.lost[r].is_some()).collect()
    }

    fn admit_step(&self, step: u64) -> Result<(), Refusal> {
        if self.active.is_some() {
            return Err(Refusal::Busy);
        }
        if let Some(step) = self.inconsistent_at {
            return Err(Refusal::Inconsistent { step });
        }
        let ranks = self.lost_ranks();
        if !ranks.is_empty() {
            let causes = ranks.iter().map(|&r| self.lost[r].clone().unwrap_or_default()).collect();
            return Err(Refusal::MembersLost { epoch: self.epoch, ranks, causes });
        }
        match self.last_committed {
            Some(last) if step <= last => Err(Refusal::AlreadyCommitted { step, last_committed: last }),
            _ => Ok(()),
        }
    }

    /// Sends `cmd` to every live member under a fresh transaction id and arms the phase timer.
    fn dispatch(&mut self, out: &mut Vec<Action<T>>, kind: PhaseKind, cmd: Cmd) -> Phase<T> {
        self.next_txn += 1;
        let txn = self.next_txn;
        let mut phase = Phase { txn, kind, pending: BTreeSet::new(), outcomes: BTreeMap::new(), failures: Vec::new(), timer: false };
        for rank in 0..self.lost.len() {
            if self.lost[rank].is_none() {
                out.push(Action::Send { rank, txn, cmd });
                phase.pending.insert(rank);
            }
        }
        if !phase.pending.is_empty() {
            phase.timer = true;
            out.push(Action::ArmTimer { txn });
        }
        phase
    }

    fn on_answer(&mut self, rank: usize, txn: u64, result: Result<T, ComputeError>) {
        let Some((_, phase)) = self.active.as_mut() else { return };
        if phase.txn != txn || !phase.pending.remove(&rank) {
            return; // a late answer to an earlier phase, or from a member already written off
        }
        match result {
            Ok(outcome) => {
                phase.outcomes.insert(rank, outcome);
            }
            Err(error) => phase.failures.push(RankFailure { rank, cause: FailureCause::Returned(error) }),
        }
    }

    fn on_lost(&mut self, rank: usize, cause: String) {
        let Some(lost) = self.lost.get_mut(rank) else { return };
        if lost.is_some() {
            return;
        }
        *lost = Some(cause.clone());
        if let Some((job, phase)) = self.active.as_mut() {
            // A member lost after it answered its prepare (or abandon) fails the phase all the
            // same: it will not commit, so the step must not go to commit without it.
            let answered = matches!(job, Job::Step(_))
                && matches!(phase.kind, PhaseKind::Prepare | PhaseKind::Abandon)
                && phase.outcomes.remove(&rank).is_some();
            if phase.pending.remove(&rank) || answered {
                phase.failures.push(RankFailure { rank, cause: FailureCause::Died(cause) });
            }
        }
    }

    fn on_timeout(&mut self, txn: u64) {
        let timeout_ms = self.step_timeout_ms;
        let Some((_, phase)) = self.active.as_mut() else { return };
        if phase.txn != txn {
            return;
        }
        let phase_name = phase.kind.name();
        for rank in std::mem::take(&mut phase.pending) {
            // A member that does not answer may be wedged in its compute: write it off.
            self.lost[rank] = Some(format!("no answer to {phase_name} within {timeout_ms} ms"));
            phase.failures.push(RankFailure { rank, cause: FailureCause::TimedOut { phase: phase_name, timeout_ms } });
        }
    }

    /// Advances completed phases until one is waiting for answers or the request is answered.
    fn drive(&mut self, out: &mut Vec<Action<T>>) {
        while self.active.as_ref().is_some_and(|(_, phase)| phase.pending.is_empty()) {
            let Some((job, mut phase)) = self.active.take() else { return };
            if phase.timer {
                out.push(Action::CancelTimer { txn: phase.txn });
            }
            phase.failures.sort_by_key(|f| f.rank);
            match job {
                Job::Step(job) => self.advance_step(out, job, phase),
                Job::Query(query) => {
                    let result = if phase.failures.is_empty() { Ok(phase.outcomes) } else { Err(phase.failures) };
                    out.push(Action::Reply(Reply::Queried { query, result }));
                }
            }
        }
    }

    /// The step transaction's transitions at the end of a phase.
    fn advance_step(&mut self, out: &mut Vec<Action<T>>, mut job: StepJob<T>, phase: Phase<T>) {
        let step = job.step;
        match phase.kind {
            PhaseKind::Prepare if phase.failures.is_empty() => {
                job.prepared = phase.outcomes;
                let chaos = job.attempt == 0 && self.abandon_steps.contains(&step);
                let (kind, cmd) = if chaos {
                    job.abandoned_attempts.push(job.attempt);
                    self.counts.abandon_phases += 1;
                    (PhaseKind::Abandon, Cmd::Abandon(step))
                } else {
                    (PhaseKind::Commit, Cmd::Commit(step))
                };
                let next = self.dispatch(out, kind, cmd);
                self.active = Some((Job::Step(job), next));
            }
            PhaseKind::Prepare => {
                job.failure = Some(phase.failures);
                job.abandoned_attempts.push(job.attempt);
                self.counts.abandon_phases += 1;
                let next = self.dispatch(out, PhaseKind::Abandon, Cmd::Abandon(step));
                self.active = Some((Job::Step(job), next));
            }
            PhaseKind::Abandon => self.after_abandon(out, job, phase),
            PhaseKind::Commit => {
                let attempted = Attempted { step, epoch: self.epoch, abandoned_attempts: job.abandoned_attempts, prepared: job.prepared };
                if phase.failures.is_empty() {
                    self.last_committed = Some(step);
                    self.counts.committed += 1;
                    out.push(Action::Reply(Reply::Committed(attempted)));
                } else {
                    self.inconsistent_at = Some(step);
                    self.counts.commits_failed += 1;
                    out.push(Action::Reply(Reply::CommitFailed { failures: phase.failures, attempted }));
                }
            }
            // A step job is only ever paired with its own phases.
            PhaseKind::Memory | PhaseKind::Shards => unreachable!("a step job in a {} phase", phase.kind.name()),
        }
    }

    /// After an abandon: answer the failure that caused it, or prepare the step again (the
    /// chaos hook).
    fn after_abandon(&mut self, out: &mut Vec<Action<T>>, mut job: StepJob<T>, phase: Phase<T>) {
        let step = job.step;
        let mut failures = job.failure.take().unwrap_or_default();
        failures.extend(phase.failures);
        if !failures.is_empty() {
            failures.sort_by_key(|f| f.rank);
            self.counts.abandoned += 1;
            out.push(Action::Reply(Reply::Abandoned { step, failures }));
            return;
        }
        job.attempt += 1;
        job.prepared.clear();
        let order = StepOrder { step, epoch: self.epoch, attempt: job.attempt };
        let next = self.dispatch(out, PhaseKind::Prepare, Cmd::Prepare(order));
        self.active = Some((Job::Step(job), next));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sends<T>(a: &[Action<T>]) -> Vec<(usize, u64, Cmd)> {
        a.iter()
            .filter_map(|a| match a {
                Action::Send { rank, txn, cmd } => Some((*rank, *txn, *cmd)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_step_commits_once_every_member_prepared_and_committed() {
        let mut m: StepTxn<u32> = StepTxn::new(2, 0, 100, vec![]);
        let a = m.on(Input::RunStep { step: 1 });
        let order = StepOrder { step: 1, epoch: 0, attempt: 0 };
        assert_eq!(sends(&a), vec![(0, 1, Cmd::Prepare(order)), (1, 1, Cmd::Prepare(order))]);
        assert!(m.on(Input::Answer { rank: 1, txn: 1, result: Ok(11) }).is_empty());
        let a = m.on(Input::Answer { rank: 0, txn: 1, result: Ok(10) });
        assert_eq!(a[0], Action::CancelTimer { txn: 1 });
        assert_eq!(sends(&a), vec![(0, 2, Cmd::Commit(1)), (1, 2, Cmd::Commit(1))]);
        m.on(Input::Answer { rank: 0, txn: 2, result: Ok(0) });
        let a = m.on(Input::Answer { rank: 1, txn: 2, result: Ok(0) });
        let want = Attempted { step: 1, epoch: 0, abandoned_attempts: vec![], prepared: BTreeMap::from([(0, 10), (1, 11)]) };
        assert_eq!(a, vec![Action::CancelTimer { txn: 2 }, Action::Reply(Reply::Committed(want))]);
        assert_eq!(m.on(Input::RunStep { step: 1 }), vec![Action::Refuse(Refusal::AlreadyCommitted { step: 1, last_committed: 1 })]);
    }

    #[test]
    fn a_member_lost_mid_commit_fails_the_commit_and_refuses_later_steps() {
        let mut m: StepTxn<u32> = StepTxn::new(2, 0, 100, vec![]);
        m.on(Input::RunStep { step: 1 });
        m.on(Input::Answer { rank: 0, txn: 1, result: Ok(0) });
        m.on(Input::Answer { rank: 1, txn: 1, result: Ok(0) });
        m.on(Input::Answer { rank: 0, txn: 2, result: Ok(0) });
        let a = m.on(Input::Lost { rank: 1, cause: "gone".into() });
        let Some(Action::Reply(Reply::CommitFailed { failures, .. })) = a.last() else { panic!("{a:?}") };
        assert_eq!(failures, &vec![RankFailure { rank: 1, cause: FailureCause::Died("gone".into()) }]);
        assert_eq!(m.on(Input::RunStep { step: 2 }), vec![Action::Refuse(Refusal::Inconsistent { step: 1 })]);
        assert_eq!((m.counts().committed, m.counts().commits_failed), (0, 1));
    }

    #[test]
    fn a_member_lost_after_it_prepared_abandons_the_step() {
        let mut m: StepTxn<u32> = StepTxn::new(2, 0, 100, vec![]);
        m.on(Input::RunStep { step: 1 });
        m.on(Input::Answer { rank: 0, txn: 1, result: Ok(0) });
        assert!(m.on(Input::Lost { rank: 0, cause: "gone".into() }).is_empty());
        let a = m.on(Input::Answer { rank: 1, txn: 1, result: Ok(0) });
        assert_eq!(sends(&a), vec![(1, 2, Cmd::Abandon(1))], "no commit without rank 0");
        let a = m.on(Input::Answer { rank: 1, txn: 2, result: Ok(0) });
        let failures = vec![RankFailure { rank: 0, cause: FailureCause::Died("gone".into()) }];
        assert_eq!(a.last(), Some(&Action::Reply(Reply::Abandoned { step: 1, failures })));
    }
}
