//! `DeviceWorker`: one per rank; owns the rank's compute, runs it on a dedicated OS thread, and
//! supervises the rank's `ParamShard` / `OptimShard` metadata actors.
//!
//! The actor never blocks the tokio runtime: it hands each command to its compute thread
//! through a bounded std channel (`COMMAND_QUEUE_CAPACITY` = 1, sent with `try_send`) and the
//! thread answers with one `ThreadDone` message into the actor's mailbox. Mailbox bound (by
//! protocol): the ClusterSupervisor keeps at most one command outstanding per worker, so the
//! mailbox holds at most that command plus the thread's single answer. A panic in the compute
//! is caught on the thread, reported, and turned into an actor failure, so the NodeSupervisor
//! sees `ActorFailed` (a membership event) and the thread exits. The thread exits when the
//! actor drops its command sender (stop or failure); `Cluster::shutdown` joins it.
//!
//! Which command runs when, the refusals, the reports and the shard notes are the sans-IO
//! machine [`crate::worker_cmd::WorkerCmd`] (simulated by `worker_sim`); this actor feeds it its
//! mailbox and carries out its actions.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use dashmap::DashMap;
use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};

use crate::cluster::ClusterMsg;
use crate::compute::{ShardInfo, WorkerCompute};
use crate::shard::{OptimShard, ParamShard, ShardMsg};
use crate::worker_cmd::{Action, Input, Outcome, ShardNote, WorkerCmd};

/// Capacity of the command channel from a worker actor to its compute thread: one outstanding
/// command at a time.
pub const COMMAND_QUEUE_CAPACITY: usize = 1;
/// Bound on control-plane calls that never touch the compute (shard queries, child stops).
pub const CONTROL_TIMEOUT_MS: u64 = 5_000;

/// The compute threads of one cluster: join handles by rank and a live count (a thread
/// decrements it on exit, whether joined or detached).
#[derive(Default)]
pub struct ComputeThreads {
    pub(crate) handles: DashMap<usize, JoinHandle<()>>,
    pub(crate) live: AtomicUsize,
}

/// A command from the ClusterSupervisor, tagged with its transaction id: the step
/// transaction's command ([`crate::txn::Cmd`]).
pub(crate) type Command = crate::txn::Cmd;

/// Messages to a `DeviceWorker`.
pub enum WorkerMsg {
    /// A command from the ClusterSupervisor (opaque outside the crate).
    Run(RunCommand),
    /// The compute thread's answer (opaque outside the crate).
    ThreadDone(ThreadAnswer),
}

/// A tagged command (see [`WorkerMsg::Run`]).
pub struct RunCommand {
    pub(crate) txn: u64,
    pub(crate) cmd: Command,
}

/// A tagged answer of the compute thread (see [`WorkerMsg::ThreadDone`]).
pub struct ThreadAnswer {
    txn: u64,
    result: Result<Outcome, String>,
}

/// Start-up arguments of a `DeviceWorker` (opaque outside the crate).
pub struct WorkerArgs {
    pub(crate) rank: usize,
    pub(crate) compute: Box<dyn WorkerCompute>,
    pub(crate) shard: ShardInfo,
    pub(crate) cluster: ActorRef<ClusterMsg>,
    pub(crate) threads: Arc<ComputeThreads>,
}

/// A worker's state: the command sender (dropping it ends the compute thread), the command
/// machine and its shards.
pub struct WorkerState {
    rank: usize,
    cmd_tx: Option<SyncSender<(u64, Command)>>,
    cmds: WorkerCmd,
    cluster: ActorRef<ClusterMsg>,
    shards: Vec<ActorRef<ShardMsg>>,
}

/// The per-rank actor (see the module doc).
pub struct DeviceWorker;

impl Actor for DeviceWorker {
    type Msg = WorkerMsg;
    type State = WorkerState;
    type Arguments = WorkerArgs;

    async fn pre_start(&self, myself: ActorRef<WorkerMsg>, args: WorkerArgs) -> Result<WorkerState, ActorProcessingErr> {
        let mut shards = Vec::new();
        if let Some(spec) = args.shard.params.clone() {
            shards.push(Actor::spawn_linked(None, ParamShard, (args.rank, spec), myself.get_cell()).await?.0);
        }
        if let Some(spec) = args.shard.optim.clone() {
            shards.push(Actor::spawn_linked(None, OptimShard, (args.rank, spec), myself.get_cell()).await?.0);
        }
        let (cmd_tx, cmd_rx) = sync_channel(COMMAND_QUEUE_CAPACITY);
        spawn_compute_thread(args.rank, args.compute, cmd_rx, myself, &args.threads)?;
        Ok(WorkerState { rank: args.rank, cmd_tx: Some(cmd_tx), cmds: WorkerCmd::new(args.rank), cluster: args.cluster, shards })
    }

    async fn handle(&self, _: ActorRef<WorkerMsg>, msg: WorkerMsg, state: &mut WorkerState) -> Result<(), ActorProcessingErr> {
        let input = match msg {
            WorkerMsg::Run(RunCommand { txn, cmd }) => Input::Command { txn, cmd },
            WorkerMsg::ThreadDone(ThreadAnswer { txn, result }) => Input::Done { txn, result },
        };
        let actions = state.cmds.on(input);
        carry_out(state, actions).await
    }

    async fn handle_supervisor_evt(
        &self,
        _: ActorRef<WorkerMsg>,
        evt: SupervisionEvent,
        state: &mut WorkerState,
    ) -> Result<(), ActorProcessingErr> {
        // A shard actor holds no bulk data, but without it the rank cannot answer for its
        // partition: the worker fails and the NodeSupervisor reports the rank as lost.
        match evt {
            SupervisionEvent::ActorFailed(_, err) => Err(format!("rank {}: shard actor failed: {err}", state.rank).into()),
            SupervisionEvent::ActorTerminated(_, _, reason) => {
                Err(format!("rank {}: shard actor terminated ({})", state.rank, reason.unwrap_or_default()).into())
            }
            _ => Ok(()),
        }
    }

    async fn post_stop(&self, myself: ActorRef<WorkerMsg>, state: &mut WorkerState) -> Result<(), ActorProcessingErr> {
        state.cmd_tx = None; // the compute thread sees the channel close and exits
        let bound = Duration::from_millis(CONTROL_TIMEOUT_MS);
        myself.stop_children_and_wait(None, Some(bound)).await;
        Ok(())
    }
}

/// Carries out the command machine's actions; a command is handed to the compute thread
/// without blocking (a full queue is fed back to the machine).
async fn carry_out(state: &mut WorkerState, actions: Vec<Action>) -> Result<(), ActorProcessingErr> {
    let mut todo = VecDeque::from(actions);
    while let Some(action) = todo.pop_front() {
        match action {
            Action::Describe { txn } => {
                let outcome = describe_shards(&state.shards).await;
                report(state, txn, outcome);
            }
            Action::Start { txn, cmd } => {
                let Some(tx) = &state.cmd_tx else { return Err("compute channel already closed".into()) };
                match tx.try_send((txn, cmd)) {
                    Ok(()) => {}
                    Err(TrySendError::Full(_)) => todo.extend(state.cmds.on(Input::QueueFull { txn })),
                    Err(TrySendError::Disconnected(_)) => return Err(format!("rank {}: compute thread is gone", state.rank).into()),
                }
            }
            Action::Note(note) => notify_shards(state, note),
            Action::Report { txn, outcome } => report(state, txn, outcome),
            Action::Fail(error) => return Err(error.into()),
        }
    }
    Ok(())
}

fn report(state: &WorkerState, txn: u64, outcome: Outcome) {
    // The supervisor being gone means the tree is shutting down: nothing left to tell.
    let _ = state.cluster.send_message(ClusterMsg::report(state.rank, txn, outcome));
}

/// Tells the shard actors what the compute just did to the partition.
fn notify_shards(state: &WorkerState, note: ShardNote) {
    for shard in &state.shards {
        let note = match note {
            ShardNote::Committed(step) => ShardMsg::Committed(step),
            ShardNote::Abandoned(step) => ShardMsg::Abandoned(step),
        };
        // A dead shard is reported through supervision; nothing to do here.
        let _ = shard.send_message(note);
    }
}

async fn describe_shards(shards: &[ActorRef<ShardMsg>]) -> Outcome {
    let mut out = Vec::with_capacity(shards.len());
    for shard in shards {
        match shard.call(ShardMsg::Describe, Some(Duration::from_millis(CONTROL_TIMEOUT_MS))).await {
            Ok(ractor::rpc::CallResult::Success(status)) => out.push(status),
            Ok(other) => return Outcome::Refused(format!("shard query failed: {other:?}")),
            Err(e) => return Outcome::Refused(format!("shard query failed: {e}")),
        }
    }
    Outcome::Shards(out)
}

/// Decrements the live-thread count when the compute thread exits (normally or by unwinding).
struct LiveGuard(Arc<ComputeThreads>);

impl Drop for LiveGuard {
    fn drop(&mut self) {
        self.0.live.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Starts rank `rank`'s compute thread and registers its join handle.
fn spawn_compute_thread(
    rank: usize,
    compute: Box<dyn WorkerCompute>,
    cmd_rx: Receiver<(u64, Command)>,
    worker: ActorRef<WorkerMsg>,
    threads: &Arc<ComputeThreads>,
) -> Result<(), ActorProcessingErr> {
    threads.live.fetch_add(1, Ordering::SeqCst);
    let guard = LiveGuard(Arc::clone(threads));
    let handle = std::thread::Builder::new()
        .name(format!("tessera-rank-{rank}"))
        .spawn(move || compute_loop(compute, cmd_rx, worker, guard))
        .map_err(|e| format!("rank {rank}: cannot start the compute thread: {e}"))?;
    threads.handles.insert(rank, handle);
    Ok(())
}

/// The compute thread: runs commands until the channel closes, the actor is gone, or the
/// compute panics (the panic is reported and the compute is dropped).
fn compute_loop(mut compute: Box<dyn WorkerCompute>, cmd_rx: Receiver<(u64, Command)>, worker: ActorRef<WorkerMsg>, _live: LiveGuard) {
    while let Ok((txn, cmd)) = cmd_rx.recv() {
        let result = catch_unwind(AssertUnwindSafe(|| run_command(compute.as_mut(), cmd))).map_err(panic_text);
        let panicked = result.is_err();
        if worker.send_message(WorkerMsg::ThreadDone(ThreadAnswer { txn, result })).is_err() || panicked {
            break;
        }
    }
}

fn run_command(compute: &mut dyn WorkerCompute, cmd: Command) -> Outcome {
    match cmd {
        Command::Prepare(order) => Outcome::Prepared(compute.prepare(&order)),
        Command::Commit(step) => Outcome::Committed { step, result: compute.commit(step) },
        Command::Abandon(step) => {
            compute.abandon(step);
            Outcome::Abandoned { step }
        }
        Command::Memory => Outcome::Memory(compute.memory()),
        Command::Shards => Outcome::Refused("shard queries are answered by the actor".into()),
    }
}

fn panic_text(payload: Box<dyn std::any::Any + Send>) -> String {
    match payload.downcast::<String>() {
        Ok(s) => *s,
        Err(payload) => payload.downcast_ref::<&str>().map_or_else(|| "non-string panic payload".to_string(), |s| s.to_string()),
    }
}
