//! `ClusterSupervisor`: owns membership and the plan epoch, and runs each step as a
//! transaction: prepare on every member → (all succeeded) commit on every member, or
//! (anything failed) abandon on every survivor.
//!
//! It never blocks: a step is a state machine of phases (prepare, commit, abandon). Each phase
//! sends one command per live member, then advances on the members' reports, on a membership
//! event (a worker died), or on its timer (`step_timeout_ms`), whichever completes it. Reports
//! of an earlier phase are recognized by their transaction id and ignored.
//!
//! Mailbox bound (by protocol): the synchronous driver has at most one request in flight; each
//! phase has at most one report per member and one live timer (cancelled when the phase ends);
//! each member produces at most one `MemberLost`. A lost member stays lost: the epoch's plan is
//! void and steps are refused until a replan (elastic recovery is a later issue — `epoch` and
//! the membership table are kept for it).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use ractor::concurrency::JoinHandle;
use ractor::{Actor, ActorId, ActorProcessingErr, ActorRef, MessagingErr, RpcReplyPort, SupervisionEvent};

use crate::compute::{MemoryReport, Prepared, StepOrder};
use crate::driver::{ClusterOptions, StepResult};
use crate::error::{ActorError, FailureCause, RankFailure};
use crate::node::{NodeArgs, NodeMsg, NodeSupervisor, RankSetup};
use crate::remote::{RemoteNode, RemoteNodeArgs, RemoteNodeSpec};
use crate::shard::ShardStatus;
use crate::worker::{Command, ComputeThreads, Outcome, RunCommand, WorkerMsg, CONTROL_TIMEOUT_MS};

/// Reply port of a step request.
pub(crate) type StepReply = RpcReplyPort<Result<StepResult, ActorError>>;

/// Messages to the ClusterSupervisor.
pub enum ClusterMsg {
    /// Run step `step` as a transaction (from the driver).
    RunStep { step: u64, reply: RpcReplyPort<Result<StepResult, ActorError>> },
    /// Collect every live member's memory report (from the driver).
    Memory(RpcReplyPort<Result<Vec<MemoryReport>, ActorError>>),
    /// Collect every live member's shard status (from the driver).
    Shards(RpcReplyPort<Result<Vec<ShardStatus>, ActorError>>),
    /// A worker's answer to the command of transaction `txn` (opaque outside the crate).
    Report(WorkerReport),
    /// A worker died (from its NodeSupervisor): a membership event.
    MemberLost { rank: usize, cause: String },
    /// The timer of the phase of transaction `txn` expired.
    PhaseTimeout { txn: u64 },
    /// Stop rank `rank`'s DeviceWorker actor (the chaos harness's `stop_actor` fault, through
    /// [`crate::driver::WorkerStopper`]); its death then reaches this supervisor like any other,
    /// as a `MemberLost` from its NodeSupervisor.
    StopWorker { rank: usize, reason: String },
}

/// A worker's answer (see [`ClusterMsg::Report`]).
pub struct WorkerReport {
    pub(crate) rank: usize,
    pub(crate) txn: u64,
    pub(crate) outcome: Outcome,
}

impl ClusterMsg {
    pub(crate) fn report(rank: usize, txn: u64, outcome: Outcome) -> Self {
        ClusterMsg::Report(WorkerReport { rank, txn, outcome })
    }
}

/// Start-up arguments: the ranks of each node, the options, the shared thread registry
/// (opaque outside the crate).
pub struct ClusterArgs {
    pub(crate) nodes: Vec<NodeSetup>,
    pub(crate) opts: ClusterOptions,
    pub(crate) threads: Arc<ComputeThreads>,
}

/// A node of the tree: its ranks in this process, or in another one behind a link.
pub(crate) enum NodeSetup {
    Local(Vec<RankSetup>),
    Remote(RemoteNodeSpec),
}

/// One member of the plan epoch.
struct Member {
    node: usize,
    worker: ActorRef<WorkerMsg>,
    /// Why this member was lost, if it was.
    lost: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PhaseKind {
    Prepare,
    Commit,
    Abandon,
    Memory,
    Shards,
}

impl PhaseKind {
    fn name(self) -> &'static str {
        match self {
            PhaseKind::Prepare => "prepare",
            PhaseKind::Commit => "commit",
            PhaseKind::Abandon => "abandon",
            PhaseKind::Memory => "memory",
            PhaseKind::Shards => "shards",
        }
    }
}

/// One round of commands and the answers collected so far.
struct Phase {
    txn: u64,
    kind: PhaseKind,
    pending: BTreeSet<usize>,
    outcomes: BTreeMap<usize, Outcome>,
    failures: Vec<RankFailure>,
    timer: Option<JoinHandle<Result<(), MessagingErr<ClusterMsg>>>>,
}

/// A step in progress.
struct StepJob {
    step: u64,
    attempt: u32,
    abandoned_attempts: Vec<u32>,
    prepared: BTreeMap<usize, Prepared>,
    /// Set when the step must end in an error once the abandon phase is over.
    failure: Option<Vec<RankFailure>>,
    reply: StepReply,
}

/// What the current phases serve.
enum Job {
    Step(StepJob),
    Memory(RpcReplyPort<Result<Vec<MemoryReport>, ActorError>>),
    Shards(RpcReplyPort<Result<Vec<ShardStatus>, ActorError>>),
}

/// The supervisor's state: membership, epoch, commit history and the transaction in flight.
pub struct ClusterState {
    members: Vec<Member>,
    node_of: HashMap<ActorId, usize>,
    epoch: u64,
    opts: ClusterOptions,
    next_txn: u64,
    last_committed: Option<u64>,
    inconsistent_at: Option<u64>,
    active: Option<(Job, Phase)>,
}

/// The root of the tree (see the module doc).
pub struct ClusterSupervisor;

impl Actor for ClusterSupervisor {
    type Msg = ClusterMsg;
    type State = ClusterState;
    type Arguments = ClusterArgs;

    async fn pre_start(&self, myself: ActorRef<ClusterMsg>, args: ClusterArgs) -> Result<ClusterState, ActorProcessingErr> {
        let mut members = BTreeMap::new();
        let mut node_of = HashMap::new();
        for (node, setup) in args.nodes.into_iter().enumerate() {
            let spawned = match setup {
                NodeSetup::Local(ranks) => {
                    let node_args = NodeArgs { ranks, cluster: myself.clone(), threads: Arc::clone(&args.threads) };
                    Actor::spawn_linked(None, NodeSupervisor, node_args, myself.get_cell()).await
                }
                NodeSetup::Remote(spec) => {
                    let node_args = RemoteNodeArgs { spec, cluster: myself.clone() };
                    Actor::spawn_linked(None, RemoteNode, node_args, myself.get_cell()).await
                }
            };
            let (node_ref, _) = spawned.map_err(|e| format!("node {node} did not start: {e}"))?;
            node_of.insert(node_ref.get_id(), node);
            let bound = Some(Duration::from_millis(CONTROL_TIMEOUT_MS));
            let workers = match node_ref.call(NodeMsg::Members, bound).await? {
                ractor::rpc::CallResult::Success(w) => w,
                other => return Err(format!("node {node} did not list its workers: {other:?}").into()),
            };
            for (rank, worker) in workers {
                members.insert(rank, Member { node, worker, lost: None });
            }
        }
        let members = members.into_values().collect();
        Ok(ClusterState {
            members,
            node_of,
            epoch: 0,
            opts: args.opts,
            next_txn: 0,
            last_committed: None,
            inconsistent_at: None,
            active: None,
        })
    }

    async fn handle(&self, myself: ActorRef<ClusterMsg>, msg: ClusterMsg, state: &mut ClusterState) -> Result<(), ActorProcessingErr> {
        match msg {
            ClusterMsg::RunStep { step, reply } => state.start_step(&myself, step, reply),
            ClusterMsg::Memory(reply) => state.start_query(&myself, Job::Memory(reply), PhaseKind::Memory),
            ClusterMsg::Shards(reply) => state.start_query(&myself, Job::Shards(reply), PhaseKind::Shards),
            ClusterMsg::Report(report) => state.on_report(report),
            ClusterMsg::MemberLost { rank, cause } => state.on_member_lost(rank, cause),
            ClusterMsg::PhaseTimeout { txn } => state.on_timeout(txn),
            ClusterMsg::StopWorker { rank, reason } => {
                if let Some(m) = state.members.get(rank).filter(|m| m.lost.is_none()) {
                    m.worker.stop(Some(reason));
                }
            }
        }
        state.drive(&myself);
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<ClusterMsg>,
        evt: SupervisionEvent,
        state: &mut ClusterState,
    ) -> Result<(), ActorProcessingErr> {
        // A NodeSupervisor never fails by design; if one does, all of its ranks are lost.
        let (cell, cause) = match evt {
            SupervisionEvent::ActorFailed(cell, err) => (cell, format!("node supervisor failed: {err}")),
            SupervisionEvent::ActorTerminated(cell, _, _) => (cell, "node supervisor terminated".to_string()),
            _ => return Ok(()),
        };
        if let Some(node) = state.node_of.remove(&cell.get_id()) {
            let ranks: Vec<usize> = (0..state.members.len()).filter(|&r| state.members[r].node == node).collect();
            ranks.into_iter().for_each(|rank| state.on_member_lost(rank, cause.clone()));
            state.drive(&myself);
        }
        Ok(())
    }

    async fn post_stop(&self, myself: ActorRef<ClusterMsg>, state: &mut ClusterState) -> Result<(), ActorProcessingErr> {
        if let Some((_, phase)) = &state.active {
            if let Some(timer) = &phase.timer {
                timer.abort();
            }
        }
        myself.stop_children_and_wait(None, Some(Duration::from_millis(CONTROL_TIMEOUT_MS))).await;
        Ok(())
    }
}

impl ClusterState {
    fn lost_ranks(&self) -> Vec<usize> {
        (0..self.members.len()).filter(|&r| self.members[r].lost.is_some()).collect()
    }

    /// Checks that step `step` may run now; the error to answer otherwise.
    fn admit_step(&self, step: u64) -> Result<(), ActorError> {
        if self.active.is_some() {
            return Err(ActorError::Busy);
        }
        if let Some(step) = self.inconsistent_at {
            return Err(ActorError::Inconsistent { step });
        }
        let lost = self.lost_ranks();
        if !lost.is_empty() {
            let causes = lost.iter().map(|&r| self.members[r].lost.clone().unwrap_or_default()).collect();
            return Err(ActorError::MembersLost { epoch: self.epoch, ranks: lost, causes });
        }
        match self.last_committed {
            Some(last) if step <= last => Err(ActorError::AlreadyCommitted { step, last_committed: last }),
            _ => Ok(()),
        }
    }

    fn start_step(&mut self, myself: &ActorRef<ClusterMsg>, step: u64, reply: StepReply) {
        if let Err(e) = self.admit_step(step) {
            let _ = reply.send(Err(e));
            return;
        }
        let job = StepJob { step, attempt: 0, abandoned_attempts: Vec::new(), prepared: BTreeMap::new(), failure: None, reply };
        let order = StepOrder { step, epoch: self.epoch, attempt: 0 };
        let phase = self.dispatch(myself, PhaseKind::Prepare, Command::Prepare(order));
        self.active = Some((Job::Step(job), phase));
    }

    fn start_query(&mut self, myself: &ActorRef<ClusterMsg>, job: Job, kind: PhaseKind) {
        if self.active.is_some() {
            match job {
                Job::Memory(reply) => drop(reply.send(Err(ActorError::Busy))),
                Job::Shards(reply) => drop(reply.send(Err(ActorError::Busy))),
                Job::Step(job) => drop(job.reply.send(Err(ActorError::Busy))),
            }
            return;
        }
        let cmd = if kind == PhaseKind::Memory { Command::Memory } else { Command::Shards };
        let phase = self.dispatch(myself, kind, cmd);
        self.active = Some((job, phase));
    }

    /// Sends `cmd` to every live member under a fresh transaction id and arms the phase timer.
    fn dispatch(&mut self, myself: &ActorRef<ClusterMsg>, kind: PhaseKind, cmd: Command) -> Phase {
        self.next_txn += 1;
        let txn = self.next_txn;
        let mut phase = Phase { txn, kind, pending: BTreeSet::new(), outcomes: BTreeMap::new(), failures: Vec::new(), timer: None };
        for (rank, member) in self.members.iter_mut().enumerate() {
            if member.lost.is_some() {
                continue;
            }
            if member.worker.send_message(WorkerMsg::Run(RunCommand { txn, cmd })).is_ok() {
                phase.pending.insert(rank);
            } else {
                let cause = "worker mailbox closed".to_string();
                member.lost = Some(cause.clone());
                phase.failures.push(RankFailure { rank, cause: FailureCause::Died(cause) });
            }
        }
        if !phase.pending.is_empty() {
            let after = Duration::from_millis(self.opts.step_timeout_ms);
            phase.timer = Some(myself.send_after(after, move || ClusterMsg::PhaseTimeout { txn }));
        }
        phase
    }

    fn on_report(&mut self, report: WorkerReport) {
        let Some((_, phase)) = self.active.as_mut() else { return };
        if phase.txn != report.txn || !phase.pending.remove(&report.rank) {
            return; // a late answer to an earlier phase, or from a member already written off
        }
        let error = match report.outcome {
            Outcome::Prepared(Err(e)) | Outcome::Committed { result: Err(e), .. } | Outcome::Refused(e) => e,
            outcome => {
                phase.outcomes.insert(report.rank, outcome);
                return;
            }
        };
        phase.failures.push(RankFailure { rank: report.rank, cause: FailureCause::Returned(error) });
    }

    fn on_member_lost(&mut self, rank: usize, cause: String) {
        let Some(member) = self.members.get_mut(rank) else { return };
        if member.lost.is_some() {
            return;
        }
        member.lost = Some(cause.clone());
        if let Some((_, phase)) = self.active.as_mut() {
            if phase.pending.remove(&rank) {
                phase.failures.push(RankFailure { rank, cause: FailureCause::Died(cause) });
            }
        }
    }

    fn on_timeout(&mut self, txn: u64) {
        let timeout_ms = self.opts.step_timeout_ms;
        let Some((_, phase)) = self.active.as_mut() else { return };
        if phase.txn != txn {
            return;
        }
        let phase_name = phase.kind.name();
        for rank in std::mem::take(&mut phase.pending) {
            // A worker that does not answer may be wedged in its compute: write it off.
            self.members[rank].lost = Some(format!("no answer to {phase_name} within {timeout_ms} ms"));
            phase.failures.push(RankFailure { rank, cause: FailureCause::TimedOut { phase: phase_name, timeout_ms } });
        }
    }

    /// Advances completed phases until one is waiting for answers or the job is done.
    fn drive(&mut self, myself: &ActorRef<ClusterMsg>) {
        while self.active.as_ref().is_some_and(|(_, phase)| phase.pending.is_empty()) {
            let Some((job, mut phase)) = self.active.take() else { return };
            if let Some(timer) = phase.timer.take() {
                timer.abort();
            }
            phase.failures.sort_by_key(|f| f.rank);
            match job {
                Job::Step(job) => self.advance_step(myself, job, phase),
                Job::Memory(reply) => drop(reply.send(collect(phase, |o| if let Outcome::Memory(m) = o { vec![m] } else { vec![] }))),
                Job::Shards(reply) => drop(reply.send(collect(phase, |o| if let Outcome::Shards(s) = o { s } else { vec![] }))),
            }
        }
    }

    /// The step transaction's transitions at the end of a phase.
    fn advance_step(&mut self, myself: &ActorRef<ClusterMsg>, mut job: StepJob, phase: Phase) {
        let step = job.step;
        match phase.kind {
            PhaseKind::Prepare if phase.failures.is_empty() => {
                job.prepared = phase.outcomes.into_iter().filter_map(|(r, o)| prepared(o).map(|p| (r, p))).collect();
                let chaos = job.attempt == 0 && self.opts.abandon_steps.contains(&step);
                let (kind, cmd) = if chaos {
                    job.abandoned_attempts.push(job.attempt);
                    (PhaseKind::Abandon, Command::Abandon(step))
                } else {
                    (PhaseKind::Commit, Command::Commit(step))
                };
                let next = self.dispatch(myself, kind, cmd);
                self.active = Some((Job::Step(job), next));
            }
            PhaseKind::Prepare => {
                job.failure = Some(phase.failures);
                job.abandoned_attempts.push(job.attempt);
                let next = self.dispatch(myself, PhaseKind::Abandon, Command::Abandon(step));
                self.active = Some((Job::Step(job), next));
            }
            PhaseKind::Abandon => self.after_abandon(myself, job, phase),
            PhaseKind::Commit if phase.failures.is_empty() => {
                self.last_committed = Some(step);
                let result = StepResult::aggregate(step, self.epoch, job.abandoned_attempts, job.prepared);
                let _ = job.reply.send(Ok(result));
            }
            PhaseKind::Commit => {
                self.inconsistent_at = Some(step);
                let prepared = Box::new(StepResult::aggregate(step, self.epoch, job.abandoned_attempts, job.prepared));
                let _ = job.reply.send(Err(ActorError::CommitFailed { step, failures: phase.failures, prepared }));
            }
            // Query phases never serve a step job (`start_query` pairs them with query jobs).
            PhaseKind::Memory | PhaseKind::Shards => {
                let _ = job.reply.send(Err(ActorError::Busy));
            }
        }
    }

    /// After an abandon: report the failure that caused it, or rerun the step (chaos hook).
    fn after_abandon(&mut self, myself: &ActorRef<ClusterMsg>, mut job: StepJob, phase: Phase) {
        let step = job.step;
        let mut failures = job.failure.take().unwrap_or_default();
        failures.extend(phase.failures);
        if !failures.is_empty() {
            failures.sort_by_key(|f| f.rank);
            let _ = job.reply.send(Err(ActorError::StepAbandoned { step, failures }));
            return;
        }
        job.attempt += 1;
        job.prepared.clear();
        let order = StepOrder { step, epoch: self.epoch, attempt: job.attempt };
        let next = self.dispatch(myself, PhaseKind::Prepare, Command::Prepare(order));
        self.active = Some((Job::Step(job), next));
    }
}

fn prepared(outcome: Outcome) -> Option<Prepared> {
    match outcome {
        Outcome::Prepared(Ok(p)) => Some(p),
        _ => None,
    }
}

/// A query's answers in rank order, or the error naming the ranks that failed.
fn collect<T>(phase: Phase, pick: impl Fn(Outcome) -> Vec<T>) -> Result<Vec<T>, ActorError> {
    if !phase.failures.is_empty() {
        return Err(ActorError::QueryFailed { what: phase.kind.name(), failures: phase.failures });
    }
    Ok(phase.outcomes.into_values().flat_map(pick).collect())
}
