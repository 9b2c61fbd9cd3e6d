//! Actors across processes: the ClusterSupervisor in the driver's process and, in each worker
//! process, a NodeSupervisor with its DeviceWorkers, exchanging the tree's own messages over a
//! link the engine provides (the QUIC control connection).
//!
//! ```text
//! driver process                                   worker process
//! ClusterSupervisor                                ClusterProxy  (stands in for the supervisor)
//! └─ RemoteNode   (stands in for the node)         └─ NodeSupervisor
//!    └─ RemoteWorker (stands in for rank r) ─────►    └─ DeviceWorker r ── compute thread
//!        WorkerMsg::Run  → ActorCall   ── link ──►        WorkerMsg::Run
//!        ClusterMsg::Report ◄─ ActorEvent ◄─ link ──  ClusterMsg::Report / MemberLost
//! ```
//! As with remote actors elsewhere (Erlang's distribution, ractor_cluster's `RemoteActor`), a
//! remote actor is a local stand-in that turns messages into bytes and back; here the messages
//! are this tree's own, few and typed ([`ActorCall`], [`ActorEvent`]: plain data, rkyv-encoded
//! by the engine and validated with bytecheck on receipt), so no generic serialization layer is
//! needed, and tensors never ride on them.
//!
//! Liveness crosses the link as membership: the engine tells the [`UpSink`] that a rank is lost
//! when its process or connection is; a stand-in whose link fails stops with an error, which its
//! RemoteNode reports as `MemberLost`; in the worker process a DeviceWorker's death reaches the
//! ClusterProxy through the local NodeSupervisor and goes up as [`ActorEvent::MemberLost`].
//!
//! Mailbox bounds are the local tree's (one command outstanding per rank); the link's queue is
//! the engine's (bounded, non-blocking sends: a full or closed link fails the send, never waits).

use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};

use crate::cluster::{ClusterMsg, WorkerReport};
use crate::compute::{ComputeError, MemoryReport, PhaseTimes, Prepared, ShardInfo, ShardSpec, StepOrder, WorkerCompute};
use crate::error::ActorError;
use crate::node::{NodeArgs, NodeMsg, NodeSupervisor, RankSetup};
use crate::shard::{ShardKind, ShardStatus};
use crate::worker::{Command, ComputeThreads, RunCommand, WorkerMsg, CONTROL_TIMEOUT_MS};
use crate::worker_cmd::Outcome;

/// A command of the ClusterSupervisor to rank `rank`, under transaction `txn`.
#[derive(Debug, Clone, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct ActorCall {
    pub rank: u64,
    pub txn: u64,
    pub cmd: WireCommand,
}

/// [`crate::worker::Command`] as it crosses processes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum WireCommand {
    Prepare { step: u64, epoch: u64, attempt: u32 },
    Commit { step: u64 },
    Abandon { step: u64 },
    Memory,
    Shards,
}

/// What a remote node tells the ClusterSupervisor.
#[derive(Debug, Clone, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum ActorEvent {
    /// Rank `rank`'s answer to transaction `txn`.
    Report { rank: u64, txn: u64, outcome: WireOutcome },
    /// Rank `rank`'s DeviceWorker died in its process (a membership event).
    MemberLost { rank: u64, cause: String },
}

/// [`crate::worker_cmd::Outcome`] as it crosses processes.
#[derive(Debug, Clone, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum WireOutcome {
    Prepared(WirePrepared),
    PrepareFailed(WireComputeError),
    Committed { step: u64 },
    CommitFailed { step: u64, error: WireComputeError },
    Abandoned { step: u64 },
    Memory { param_bytes: u64, grad_bytes: u64, optim_bytes: u64 },
    Shards(Vec<WireShard>),
    Refused(String),
}

/// [`ComputeError`]'s kind on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub enum WireErrorKind {
    /// [`ComputeError::Lost`], with the peer's rank when known.
    Lost {
        rank: Option<u64>,
    },
    Aborted,
    Failed,
}

/// [`ComputeError`] as it crosses processes: its kind, what a torn commit reached, and the
/// human cause. A torn commit travels flat (its cause's kind with `torn` set).
#[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct WireComputeError {
    pub kind: WireErrorKind,
    /// `Some(stepped)` for [`ComputeError::Torn`].
    pub torn: Option<Option<u64>>,
    pub why: String,
}

impl From<ComputeError> for WireComputeError {
    fn from(e: ComputeError) -> Self {
        let (torn, cause) = match e {
            ComputeError::Torn { stepped, cause } => (Some(stepped), *cause),
            e => (None, e),
        };
        let (kind, why) = match cause {
            ComputeError::Lost { rank, why } => (WireErrorKind::Lost { rank: rank.map(|r| r as u64) }, why),
            ComputeError::Aborted { why } => (WireErrorKind::Aborted, why),
            // A torn cause is never torn itself (`ComputeError::torn` keeps one level).
            ComputeError::Failed { why } => (WireErrorKind::Failed, why),
            e @ ComputeError::Torn { .. } => (WireErrorKind::Failed, e.to_string()),
        };
        WireComputeError { kind, torn, why }
    }
}

impl std::fmt::Display for WireComputeError {
    /// The human cause, as the [`ComputeError`] it stands for shows it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.why)
    }
}

impl WireComputeError {
    /// A failure of the sender alone ([`ComputeError::Failed`]).
    pub fn failed(why: impl Into<String>) -> Self {
        ComputeError::failed(why).into()
    }
}

impl From<WireComputeError> for ComputeError {
    fn from(w: WireComputeError) -> Self {
        let why = w.why;
        let cause = match w.kind {
            WireErrorKind::Lost { rank } => ComputeError::Lost { rank: rank.map(|r| r as usize), why },
            WireErrorKind::Aborted => ComputeError::Aborted { why },
            WireErrorKind::Failed => ComputeError::Failed { why },
        };
        match w.torn {
            Some(stepped) => cause.torn(stepped),
            None => cause,
        }
    }
}

/// [`Prepared`] on the wire (f64s travel as their bits: NaN and infinities survive).
#[derive(Debug, Clone, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct WirePrepared {
    pub loss_sum: f64,
    pub micro_batches: u64,
    pub grad_norm: Option<f64>,
    pub overflow: bool,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    pub compute_s: f64,
    pub busy_s: f64,
    pub busy_micro_batches: u64,
    /// [`PhaseTimes`]: forward, backward inner, backward allreduce (seconds).
    pub phases: [f64; 3],
}

/// [`ShardStatus`] on the wire.
#[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct WireShard {
    pub rank: u64,
    /// 0 = parameters, 1 = optimizer state.
    pub kind: u8,
    pub start: u64,
    pub end: u64,
    pub bytes: u64,
    pub last_committed_step: Option<u64>,
    pub abandoned: u64,
}

impl WireCommand {
    fn from_command(cmd: Command) -> Self {
        match cmd {
            Command::Prepare(o) => WireCommand::Prepare { step: o.step, epoch: o.epoch, attempt: o.attempt },
            Command::Commit(step) => WireCommand::Commit { step },
            Command::Abandon(step) => WireCommand::Abandon { step },
            Command::Memory => WireCommand::Memory,
            Command::Shards => WireCommand::Shards,
        }
    }

    fn command(self) -> Command {
        match self {
            WireCommand::Prepare { step, epoch, attempt } => Command::Prepare(StepOrder { step, epoch, attempt }),
            WireCommand::Commit { step } => Command::Commit(step),
            WireCommand::Abandon { step } => Command::Abandon(step),
            WireCommand::Memory => Command::Memory,
            WireCommand::Shards => Command::Shards,
        }
    }
}

impl WireOutcome {
    fn from_outcome(o: Outcome) -> Self {
        match o {
            Outcome::Prepared(Ok(p)) => WireOutcome::Prepared(WirePrepared {
                loss_sum: p.loss_sum,
                micro_batches: p.micro_batches as u64,
                grad_norm: p.grad_norm,
                overflow: p.overflow,
                bytes_sent: p.bytes_sent,
                bytes_received: p.bytes_received,
                compute_s: p.compute_s,
                busy_s: p.busy_s,
                busy_micro_batches: p.busy_micro_batches as u64,
                phases: [p.phases.forward_s, p.phases.backward_inner_s, p.phases.backward_allreduce_s],
            }),
            Outcome::Prepared(Err(e)) => WireOutcome::PrepareFailed(e.into()),
            Outcome::Committed { step, result: Ok(()) } => WireOutcome::Committed { step },
            Outcome::Committed { step, result: Err(error) } => WireOutcome::CommitFailed { step, error: error.into() },
            Outcome::Abandoned { step } => WireOutcome::Abandoned { step },
            Outcome::Memory(m) => WireOutcome::Memory { param_bytes: m.param_bytes, grad_bytes: m.grad_bytes, optim_bytes: m.optim_bytes },
            Outcome::Shards(s) => WireOutcome::Shards(
                s.into_iter()
                    .map(|s| WireShard {
                        rank: s.rank as u64,
                        kind: match s.kind {
                            ShardKind::Param => 0,
                            ShardKind::Optim => 1,
                        },
                        start: s.spec.range.start as u64,
                        end: s.spec.range.end as u64,
                        bytes: s.spec.bytes,
                        last_committed_step: s.last_committed_step,
                        abandoned: s.abandoned,
                    })
                    .collect(),
            ),
            Outcome::Refused(e) => WireOutcome::Refused(e),
        }
    }

    /// The outcome for rank `rank`; a malformed one (a shard range that runs backwards, an
    /// unknown shard kind) is refused with the reason.
    fn outcome(self, rank: usize) -> Outcome {
        match self {
            WireOutcome::Prepared(p) => Outcome::Prepared(Ok(Prepared {
                loss_sum: p.loss_sum,
                micro_batches: p.micro_batches as usize,
                grad_norm: p.grad_norm,
                overflow: p.overflow,
                bytes_sent: p.bytes_sent,
                bytes_received: p.bytes_received,
                compute_s: p.compute_s,
                busy_s: p.busy_s,
                busy_micro_batches: p.busy_micro_batches as usize,
                phases: PhaseTimes { forward_s: p.phases[0], backward_inner_s: p.phases[1], backward_allreduce_s: p.phases[2] },
            })),
            WireOutcome::PrepareFailed(e) => Outcome::Prepared(Err(e.into())),
            WireOutcome::Committed { step } => Outcome::Committed { step, result: Ok(()) },
            WireOutcome::CommitFailed { step, error } => Outcome::Committed { step, result: Err(error.into()) },
            WireOutcome::Abandoned { step } => Outcome::Abandoned { step },
            WireOutcome::Memory { param_bytes, grad_bytes, optim_bytes } => {
                Outcome::Memory(MemoryReport { rank, param_bytes, grad_bytes, optim_bytes })
            }
            WireOutcome::Shards(s) => {
                let mut out = Vec::with_capacity(s.len());
                for w in s {
                    let kind = match w.kind {
                        0 => ShardKind::Param,
                        1 => ShardKind::Optim,
                        k => return Outcome::Refused(format!("rank {rank} reported a shard of unknown kind {k}")),
                    };
                    if w.start > w.end || w.rank != rank as u64 {
                        return Outcome::Refused(format!("rank {rank} reported a bad shard {}..{} of rank {}", w.start, w.end, w.rank));
                    }
                    let spec = ShardSpec { range: w.start as usize..w.end as usize, bytes: w.bytes };
                    out.push(ShardStatus { rank, kind, spec, last_committed_step: w.last_committed_step, abandoned: w.abandoned });
                }
                Outcome::Shards(out)
            }
            WireOutcome::Refused(e) => Outcome::Refused(e),
        }
    }
}

// ── The driver's side ─────────────────────────────────────────────────────────────────────────

/// Where a remote node's commands go (the engine's link). Must not block: queue the call or fail.
pub trait Downlink: Send + Sync + 'static {
    fn send(&self, call: ActorCall) -> Result<(), String>;
}

/// Delivers what a remote node says to the ClusterSupervisor (handed to the engine when the
/// node starts; cheap to clone, usable from any thread).
#[derive(Clone)]
pub struct UpSink {
    cluster: ActorRef<ClusterMsg>,
    ranks: Arc<[usize]>,
}

impl UpSink {
    /// Delivers one event; an event about a rank this node does not hold is refused (a peer's
    /// protocol violation: the caller should drop the link). False when the tree is gone.
    pub fn deliver(&self, ev: ActorEvent) -> Result<bool, String> {
        let rank = match &ev {
            ActorEvent::Report { rank, .. } | ActorEvent::MemberLost { rank, .. } => *rank as usize,
        };
        if !self.ranks.contains(&rank) {
            return Err(format!("an event about rank {rank}, which this node does not hold ({:?})", self.ranks));
        }
        let msg = match ev {
            ActorEvent::Report { txn, outcome, .. } => ClusterMsg::Report(WorkerReport { rank, txn, outcome: outcome.outcome(rank) }),
            ActorEvent::MemberLost { cause, .. } => ClusterMsg::MemberLost { rank, cause },
        };
        Ok(self.cluster.send_message(msg).is_ok())
    }

    /// Every rank of this node is lost because of `cause` (its process or link is gone).
    pub fn lost(&self, cause: &str) {
        for &rank in self.ranks.iter() {
            let _ = self.cluster.send_message(ClusterMsg::MemberLost { rank, cause: cause.to_string() });
        }
    }
}

/// A node whose ranks run in another process: its ranks, its link, and what to do with the
/// [`UpSink`] once the stand-ins are up (typically: start reading the link into it).
pub struct RemoteNodeSpec {
    pub ranks: Vec<usize>,
    pub downlink: Arc<dyn Downlink>,
    pub on_start: Box<dyn FnOnce(UpSink) + Send>,
}

/// Arguments of a [`RemoteNode`] (opaque outside the crate).
pub struct RemoteNodeArgs {
    pub(crate) spec: RemoteNodeSpec,
    pub(crate) cluster: ActorRef<ClusterMsg>,
}

/// The driver-side stand-in of a worker process's NodeSupervisor.
pub struct RemoteNode;

/// A RemoteNode's state: its stand-ins by rank.
pub struct RemoteNodeState {
    workers: Vec<(usize, ActorRef<WorkerMsg>)>,
    cluster: ActorRef<ClusterMsg>,
}

impl Actor for RemoteNode {
    type Msg = NodeMsg;
    type State = RemoteNodeState;
    type Arguments = RemoteNodeArgs;

    async fn pre_start(&self, myself: ActorRef<NodeMsg>, args: RemoteNodeArgs) -> Result<RemoteNodeState, ActorProcessingErr> {
        let RemoteNodeSpec { ranks, downlink, on_start } = args.spec;
        let mut workers = Vec::with_capacity(ranks.len());
        for &rank in &ranks {
            let (w, _) = Actor::spawn_linked(None, RemoteWorker, (rank, Arc::clone(&downlink)), myself.get_cell())
                .await
                .map_err(|e| format!("rank {rank}: stand-in did not start: {e}"))?;
            workers.push((rank, w));
        }
        on_start(UpSink { cluster: args.cluster.clone(), ranks: ranks.into() });
        Ok(RemoteNodeState { workers, cluster: args.cluster })
    }

    async fn handle(&self, _: ActorRef<NodeMsg>, msg: NodeMsg, state: &mut RemoteNodeState) -> Result<(), ActorProcessingErr> {
        match msg {
            NodeMsg::Members(reply) => drop(reply.send(state.workers.clone())),
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _: ActorRef<NodeMsg>,
        evt: SupervisionEvent,
        state: &mut RemoteNodeState,
    ) -> Result<(), ActorProcessingErr> {
        let (cell, cause) = match evt {
            SupervisionEvent::ActorFailed(cell, err) => (cell, err.to_string()),
            SupervisionEvent::ActorTerminated(cell, _, reason) => (cell, reason.unwrap_or_else(|| "stand-in stopped".into())),
            _ => return Ok(()),
        };
        if let Some(i) = state.workers.iter().position(|(_, w)| w.get_id() == cell.get_id()) {
            let (rank, _) = state.workers.remove(i);
            let _ = state.cluster.send_message(ClusterMsg::MemberLost { rank, cause });
        }
        Ok(())
    }

    async fn post_stop(&self, myself: ActorRef<NodeMsg>, _: &mut RemoteNodeState) -> Result<(), ActorProcessingErr> {
        myself.stop_children_and_wait(None, Some(Duration::from_millis(CONTROL_TIMEOUT_MS))).await;
        Ok(())
    }
}

/// The driver-side stand-in of one remote DeviceWorker: forwards its commands over the link.
struct RemoteWorker;

impl Actor for RemoteWorker {
    type Msg = WorkerMsg;
    type State = (usize, Arc<dyn Downlink>);
    type Arguments = (usize, Arc<dyn Downlink>);

    async fn pre_start(&self, _: ActorRef<WorkerMsg>, args: Self::Arguments) -> Result<Self::State, ActorProcessingErr> {
        Ok(args)
    }

    async fn handle(&self, _: ActorRef<WorkerMsg>, msg: WorkerMsg, state: &mut Self::State) -> Result<(), ActorProcessingErr> {
        let (rank, downlink) = state;
        match msg {
            WorkerMsg::Run(RunCommand { txn, cmd }) => {
                let call = ActorCall { rank: *rank as u64, txn, cmd: WireCommand::from_command(cmd) };
                // A link that cannot take the command is a lost member.
                downlink.send(call).map_err(|e| format!("rank {rank}: the link to its process failed: {e}"))?;
                Ok(())
            }
            WorkerMsg::ThreadDone(_) => Err(format!("rank {rank}: a stand-in has no compute thread").into()),
        }
    }
}

// ── The worker process's side ──────────────────────────────────────────────────────────────────

/// Where a worker process's events go (the engine's link). Must not block.
pub trait Uplink: Send + Sync + 'static {
    fn send(&self, ev: ActorEvent) -> Result<(), String>;
}

/// The actor tree of one worker process: a NodeSupervisor with a DeviceWorker per rank, under a
/// ClusterProxy that sends everything meant for the ClusterSupervisor up the link. Commands
/// arrive through [`NodeHost::deliver`]. Owns its runtime (one thread) and compute threads.
pub struct NodeHost {
    runtime: Option<tokio::runtime::Runtime>,
    proxy: Option<ActorRef<ClusterMsg>>,
    workers: Vec<(usize, ActorRef<WorkerMsg>)>,
    threads: Arc<ComputeThreads>,
    shutdown_timeout_ms: u64,
}

impl NodeHost {
    /// Starts the tree for `ranks` (rank, compute, shard), reporting through `uplink`.
    pub fn start(
        ranks: Vec<(usize, Box<dyn WorkerCompute>, ShardInfo)>,
        uplink: Arc<dyn Uplink>,
        shutdown_timeout_ms: u64,
    ) -> Result<NodeHost, ActorError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("tessera-actors")
            .enable_time()
            .build()
            .map_err(|e| ActorError::Spawn { what: "the tokio runtime".into(), cause: e.to_string() })?;
        let threads = Arc::new(ComputeThreads::default());
        let setups: Vec<RankSetup> = ranks.into_iter().map(|(rank, compute, shard)| RankSetup { rank, compute, shard }).collect();
        let started = runtime.block_on(async {
            let (proxy, _) = Actor::spawn(None, ClusterProxy, uplink).await.map_err(|e| e.to_string())?;
            let args = NodeArgs { ranks: setups, cluster: proxy.clone(), threads: Arc::clone(&threads) };
            let (node, _) = Actor::spawn_linked(None, NodeSupervisor, args, proxy.get_cell()).await.map_err(|e| e.to_string())?;
            let bound = Some(Duration::from_millis(CONTROL_TIMEOUT_MS));
            match node.call(NodeMsg::Members, bound).await.map_err(|e| e.to_string())? {
                ractor::rpc::CallResult::Success(w) => Ok((proxy, w)),
                other => Err(format!("the node did not list its workers: {other:?}")),
            }
        });
        let mut host = NodeHost { runtime: Some(runtime), proxy: None, workers: Vec::new(), threads, shutdown_timeout_ms };
        match started {
            Ok((proxy, workers)) => {
                host.proxy = Some(proxy);
                host.workers = workers;
                Ok(host)
            }
            Err(cause) => Err(ActorError::Spawn { what: "the node's actor tree".into(), cause }),
        }
    }

    /// Hands a command from the ClusterSupervisor to its DeviceWorker (never blocks).
    pub fn deliver(&self, call: ActorCall) -> Result<(), String> {
        let rank = call.rank as usize;
        let Some((_, w)) = self.workers.iter().find(|(r, _)| *r == rank) else {
            return Err(format!("a command for rank {rank}, which this process does not run"));
        };
        w.send_message(WorkerMsg::Run(RunCommand { txn: call.txn, cmd: call.cmd.command() }))
            .map_err(|e| format!("rank {rank}: its worker is gone: {e}"))
    }

    /// Stops the tree and joins the compute threads (each stage bounded).
    pub fn shutdown(mut self) -> Result<(), ActorError> {
        self.stop()
    }

    fn stop(&mut self) -> Result<(), ActorError> {
        let Some(runtime) = self.runtime.take() else { return Ok(()) };
        let bound = Duration::from_millis(self.shutdown_timeout_ms);
        if let Some(proxy) = self.proxy.take() {
            let _ = runtime.block_on(proxy.stop_and_wait(Some("shutdown".into()), Some(bound)));
        }
        runtime.shutdown_timeout(bound);
        self.workers.clear();
        let deadline = std::time::Instant::now() + bound;
        loop {
            let keys: Vec<usize> = self.threads.handles.iter().filter(|e| e.value().is_finished()).map(|e| *e.key()).collect();
            keys.into_iter().filter_map(|r| self.threads.handles.remove(&r)).for_each(|(_, h)| drop(h.join()));
            if self.threads.handles.is_empty() {
                return Ok(());
            }
            if std::time::Instant::now() >= deadline {
                let ranks = self.threads.handles.iter().map(|e| *e.key()).collect();
                return Err(ActorError::ThreadsDetached { ranks, bound_ms: self.shutdown_timeout_ms });
            }
            std::thread::sleep(Duration::from_millis(crate::driver::JOIN_POLL_MS));
        }
    }
}

impl Drop for NodeHost {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

/// The worker-process stand-in of the ClusterSupervisor: what the local tree reports goes up.
struct ClusterProxy;

impl Actor for ClusterProxy {
    type Msg = ClusterMsg;
    type State = Arc<dyn Uplink>;
    type Arguments = Arc<dyn Uplink>;

    async fn pre_start(&self, _: ActorRef<ClusterMsg>, uplink: Arc<dyn Uplink>) -> Result<Self::State, ActorProcessingErr> {
        Ok(uplink)
    }

    async fn handle(&self, _: ActorRef<ClusterMsg>, msg: ClusterMsg, uplink: &mut Self::State) -> Result<(), ActorProcessingErr> {
        let ev = match msg {
            ClusterMsg::Report(WorkerReport { rank, txn, outcome }) => {
                ActorEvent::Report { rank: rank as u64, txn, outcome: WireOutcome::from_outcome(outcome) }
            }
            ClusterMsg::MemberLost { rank, cause } => ActorEvent::MemberLost { rank: rank as u64, cause },
            // Driver requests are never sent to a worker process's proxy.
            _ => return Ok(()),
        };
        // A failed link ends the process's part in the run; the driver notices it as a loss.
        if let Err(e) = uplink.send(ev) {
            eprintln!("warning: the link to the driver failed: {e}");
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _: ActorRef<ClusterMsg>,
        evt: SupervisionEvent,
        uplink: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        // The NodeSupervisor never fails by design; if it does, say so (its ranks are lost).
        if let SupervisionEvent::ActorFailed(_, err) = evt {
            eprintln!("error: the node supervisor failed: {err}");
            let _ = uplink.send(ActorEvent::MemberLost { rank: u64::MAX, cause: format!("node supervisor failed: {err}") });
        }
        Ok(())
    }
}
