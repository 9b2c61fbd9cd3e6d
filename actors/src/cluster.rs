//! `ClusterSupervisor`: owns membership and the plan epoch, and runs each step as a
//! transaction: prepare on every member → (all succeeded) commit on every member, or
//! (anything failed) abandon on every survivor.
//!
//! It never blocks: a step is a state machine of phases (prepare, commit, abandon). Each phase
//! sends one command per live member, then advances on the members' reports, on a membership
//! event (a worker died), or on its timer (`step_timeout_ms`), whichever completes it. Reports
//! of an earlier phase are recognized by their transaction id and ignored. The transaction
//! itself — admission, phases, commit vs abandon, what fails a commit, the answers — is the
//! sans-IO machine [`crate::txn::StepTxn`] (simulated by `txn_sim`); this actor feeds it the
//! requests, reports, losses and timer expiries and carries out its sends, timers and replies.
//!
//! Mailbox bound (by protocol): the synchronous driver has at most one request in flight; each
//! phase has at most one report per member and one live timer (cancelled when the phase ends);
//! each member produces at most one `MemberLost`. A lost member stays lost: the epoch's plan is
//! void and steps are refused until a replan (elastic recovery is a later issue — `epoch` and
//! the membership table are kept for it).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::concurrency::JoinHandle;
use ractor::{Actor, ActorId, ActorProcessingErr, ActorRef, MessagingErr, RpcReplyPort, SupervisionEvent};

use crate::compute::{MemoryReport, Prepared, StepResult};
use crate::driver::ClusterOptions;
use crate::error::{ActorError, RankFailure};
use crate::node::{NodeArgs, NodeMsg, NodeSupervisor, RankSetup};
use crate::shard::ShardStatus;
use crate::txn::{Action, Attempted, Cmd, Input, PhaseKind, Query, Refusal, Reply, StepTxn};
use crate::worker::{ComputeThreads, RunCommand, WorkerMsg, CONTROL_TIMEOUT_MS};
use crate::worker_cmd::Outcome;

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

/// A node of the tree: its ranks (their computes run in this process; a worker process's
/// compute is reached through the one the engine gives, `ElasticCompute`).
pub(crate) struct NodeSetup(pub(crate) Vec<RankSetup>);

/// One member of the plan epoch.
struct Member {
    node: usize,
    worker: ActorRef<WorkerMsg>,
}

/// The phase timer's task.
type Timer = JoinHandle<Result<(), MessagingErr<ClusterMsg>>>;

/// The request being served: where its answer goes.
enum Waiting {
    Step(StepReply),
    Memory(RpcReplyPort<Result<Vec<MemoryReport>, ActorError>>),
    Shards(RpcReplyPort<Result<Vec<ShardStatus>, ActorError>>),
}

impl Waiting {
    fn refuse(self, e: ActorError) {
        match self {
            Waiting::Step(reply) => drop(reply.send(Err(e))),
            Waiting::Memory(reply) => drop(reply.send(Err(e))),
            Waiting::Shards(reply) => drop(reply.send(Err(e))),
        }
    }
}

/// The supervisor's state: the members, and the step transaction machine ([`StepTxn`]: the
/// membership table, commit history and the transaction in flight) with the request it serves
/// and its phase timer.
pub struct ClusterState {
    members: Vec<Member>,
    node_of: HashMap<ActorId, usize>,
    txn: StepTxn<Outcome>,
    waiting: Option<Waiting>,
    timer: Option<(u64, Timer)>,
    opts: ClusterOptions,
    /// When the commit phase of the step in flight was sent (its length is
    /// [`StepResult::commit_s`]).
    commit_sent: Option<Instant>,
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
            let node_args = NodeArgs { ranks: setup.0, cluster: myself.clone(), threads: Arc::clone(&args.threads) };
            let spawned = Actor::spawn_linked(None, NodeSupervisor, node_args, myself.get_cell()).await;
            let (node_ref, _) = spawned.map_err(|e| format!("node {node} did not start: {e}"))?;
            node_of.insert(node_ref.get_id(), node);
            let bound = Some(Duration::from_millis(CONTROL_TIMEOUT_MS));
            let workers = match node_ref.call(NodeMsg::Members, bound).await? {
                ractor::rpc::CallResult::Success(w) => w,
                other => return Err(format!("node {node} did not list its workers: {other:?}").into()),
            };
            for (rank, worker) in workers {
                members.insert(rank, Member { node, worker });
            }
        }
        let members: Vec<Member> = members.into_values().collect();
        let txn = StepTxn::new(members.len(), 0, args.opts.step_timeout_ms, args.opts.abandon_steps.clone());
        Ok(ClusterState { members, node_of, txn, waiting: None, timer: None, opts: args.opts, commit_sent: None })
    }

    async fn handle(&self, myself: ActorRef<ClusterMsg>, msg: ClusterMsg, state: &mut ClusterState) -> Result<(), ActorProcessingErr> {
        match msg {
            ClusterMsg::RunStep { step, reply } => state.request(&myself, Input::RunStep { step }, Waiting::Step(reply)),
            ClusterMsg::Memory(reply) => state.request(&myself, Input::Query(Query::Memory), Waiting::Memory(reply)),
            ClusterMsg::Shards(reply) => state.request(&myself, Input::Query(Query::Shards), Waiting::Shards(reply)),
            ClusterMsg::Report(WorkerReport { rank, txn, outcome }) => {
                state.feed(&myself, Input::Answer { rank, txn, result: outcome.into_answer() });
            }
            ClusterMsg::MemberLost { rank, cause } => state.feed(&myself, Input::Lost { rank, cause }),
            ClusterMsg::PhaseTimeout { txn } => state.feed(&myself, Input::Timeout { txn }),
            ClusterMsg::StopWorker { rank, reason } => {
                if let Some(m) = state.members.get(rank).filter(|_| !state.txn.is_lost(rank)) {
                    m.worker.stop(Some(reason));
                }
            }
        }
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
            ranks.into_iter().for_each(|rank| state.feed(&myself, Input::Lost { rank, cause: cause.clone() }));
        }
        Ok(())
    }

    async fn post_stop(&self, myself: ActorRef<ClusterMsg>, state: &mut ClusterState) -> Result<(), ActorProcessingErr> {
        if let Some((_, timer)) = state.timer.take() {
            timer.abort();
        }
        myself.stop_children_and_wait(None, Some(Duration::from_millis(CONTROL_TIMEOUT_MS))).await;
        Ok(())
    }
}

impl ClusterState {
    /// Feeds a request to the machine: refused at once, or served (answered now or later).
    fn request(&mut self, myself: &ActorRef<ClusterMsg>, input: Input<Outcome>, waiting: Waiting) {
        let mut actions = self.txn.on(input);
        if let Some(i) = actions.iter().position(|a| matches!(a, Action::Refuse(_))) {
            if let Action::Refuse(r) = actions.remove(i) {
                waiting.refuse(refusal(r));
            }
        } else {
            self.waiting = Some(waiting);
        }
        self.carry_out(myself, actions);
    }

    /// Feeds `input` to the machine and carries out its actions.
    fn feed(&mut self, myself: &ActorRef<ClusterMsg>, input: Input<Outcome>) {
        let actions = self.txn.on(input);
        self.carry_out(myself, actions);
    }

    /// Carries out the machine's actions; a send that fails is fed back as a lost member.
    fn carry_out(&mut self, myself: &ActorRef<ClusterMsg>, actions: Vec<Action<Outcome>>) {
        let mut closed = Vec::new();
        for action in actions {
            match action {
                Action::Send { rank, txn, cmd } => {
                    match cmd {
                        Cmd::Prepare(_) => self.commit_sent = None,
                        Cmd::Commit(_) => _ = self.commit_sent.get_or_insert_with(Instant::now),
                        _ => {}
                    }
                    if self.members[rank].worker.send_message(WorkerMsg::Run(RunCommand { txn, cmd })).is_err() {
                        closed.push(rank);
                    }
                }
                Action::ArmTimer { txn } => {
                    let after = Duration::from_millis(self.opts.step_timeout_ms);
                    self.timer = Some((txn, myself.send_after(after, move || ClusterMsg::PhaseTimeout { txn })));
                }
                Action::CancelTimer { txn } => {
                    if let Some((armed, timer)) = self.timer.take() {
                        if armed == txn {
                            timer.abort();
                        } else {
                            self.timer = Some((armed, timer));
                        }
                    }
                }
                // Refusals concern the request just fed (`request`).
                Action::Refuse(r) => drop(refusal(r)),
                Action::Reply(reply) => {
                    let commit_s = self.commit_sent.take().map_or(0.0, |t| t.elapsed().as_secs_f64());
                    if let Some(waiting) = self.waiting.take() {
                        answer(waiting, reply, commit_s);
                    }
                }
            }
        }
        for rank in closed {
            self.feed(myself, Input::Lost { rank, cause: "worker mailbox closed".to_string() });
        }
    }
}

/// The error answering a refused request.
fn refusal(r: Refusal) -> ActorError {
    match r {
        Refusal::Busy => ActorError::Busy,
        Refusal::Inconsistent { step } => ActorError::Inconsistent { step },
        Refusal::MembersLost { epoch, ranks, causes } => ActorError::MembersLost { epoch, ranks, causes },
        Refusal::AlreadyCommitted { step, last_committed } => ActorError::AlreadyCommitted { step, last_committed },
    }
}

fn result_of(a: Attempted<Outcome>, commit_s: f64) -> StepResult {
    let by_rank = a.prepared.into_iter().filter_map(|(r, o)| prepared(o).map(|p| (r, p)));
    StepResult { commit_s, ..StepResult::aggregate(a.step, a.epoch, a.abandoned_attempts, by_rank) }
}

/// Answers the request being served with the machine's reply (`commit_s`: how long its commit
/// phase took, 0 without one).
fn answer(waiting: Waiting, reply: Reply<Outcome>, commit_s: f64) {
    match (waiting, reply) {
        (Waiting::Step(port), Reply::Committed(a)) => drop(port.send(Ok(result_of(a, commit_s)))),
        (Waiting::Step(port), Reply::Abandoned { step, failures }) => drop(port.send(Err(ActorError::StepAbandoned { step, failures }))),
        (Waiting::Step(port), Reply::CommitFailed { failures, attempted }) => {
            let step = attempted.step;
            let prepared = Box::new(result_of(attempted, commit_s));
            drop(port.send(Err(ActorError::CommitFailed { step, failures, prepared })));
        }
        (Waiting::Memory(port), Reply::Queried { query, result }) => {
            drop(port.send(collect(query, result, |o| if let Outcome::Memory(m) = o { vec![m] } else { vec![] })))
        }
        (Waiting::Shards(port), Reply::Queried { query, result }) => {
            drop(port.send(collect(query, result, |o| if let Outcome::Shards(s) = o { s } else { vec![] })))
        }
        // The machine answers each request with its own kind of reply.
        (waiting, _) => waiting.refuse(ActorError::Busy),
    }
}

fn prepared(outcome: Outcome) -> Option<Prepared> {
    match outcome {
        Outcome::Prepared(Ok(p)) => Some(p),
        _ => None,
    }
}

/// A query's answers in rank order, or the error naming the ranks that failed.
fn collect<T>(
    query: Query,
    result: Result<BTreeMap<usize, Outcome>, Vec<RankFailure>>,
    pick: impl Fn(Outcome) -> Vec<T>,
) -> Result<Vec<T>, ActorError> {
    let what = match query {
        Query::Memory => PhaseKind::Memory.name(),
        Query::Shards => PhaseKind::Shards.name(),
    };
    match result {
        Err(failures) => Err(ActorError::QueryFailed { what, failures }),
        Ok(outcomes) => Ok(outcomes.into_values().flat_map(pick).collect()),
    }
}
