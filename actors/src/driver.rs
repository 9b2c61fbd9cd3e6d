//! `Cluster`: the synchronous driver the engine calls; it owns the tokio runtime, the actor
//! tree and the compute threads, and guarantees they are all gone after `shutdown` (or drop).
//!
//! Runtime: a multi-thread tokio runtime with ONE worker thread (`tessera-actors`). The
//! actors only route small messages, so one thread suffices, and a multi-thread runtime keeps
//! the tree running between driver calls (a current-thread runtime would only make progress
//! inside `block_on`). The compute runs on one OS thread per rank, started by its
//! `DeviceWorker`. Methods block the calling thread and must not be called from inside a tokio
//! runtime.
//!
//! Every wait is bounded: a phase of a step by `step_timeout_ms` (the ClusterSupervisor's own
//! timer), the driver's wait for a whole step by [`Cluster::step_wait_bound_ms`], queries by
//! `CONTROL_TIMEOUT_MS` plus one phase, each stage of shutdown by `shutdown_timeout_ms`.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ractor::concurrency::JoinHandle as TaskHandle;
use ractor::rpc::CallResult;
use ractor::{Actor, ActorRef, RpcReplyPort};

use crate::cluster::{ClusterArgs, ClusterMsg, ClusterSupervisor, NodeSetup};
use crate::compute::{MemoryReport, ShardInfo, StepResult, WorkerCompute};
use crate::error::ActorError;
use crate::node::RankSetup;
use crate::shard::ShardStatus;
use crate::worker::{ComputeThreads, CONTROL_TIMEOUT_MS};

/// Default bound on one phase (prepare, commit or abandon) of a step.
pub const DEFAULT_STEP_TIMEOUT_MS: u64 = 600_000;
/// Default bound on each stage of shutdown (stopping the tree, joining compute threads).
pub const DEFAULT_SHUTDOWN_TIMEOUT_MS: u64 = 10_000;
/// A step has at most this many phases: prepare, abandon (chaos hook), prepare, commit or
/// abandon (failure).
pub const STEP_PHASES_MAX: u64 = 4;
/// How often shutdown polls compute threads for exit while waiting for them.
pub const JOIN_POLL_MS: u64 = 2;

/// Options of [`Cluster::start`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterOptions {
    /// Bound on each phase of a step; a member that does not answer in time is written off.
    pub step_timeout_ms: u64,
    /// Test/chaos hook: after every worker prepared step `s` (first attempt only), abandon it
    /// instead of committing, then run it again.
    pub abandon_steps: Vec<u64>,
    /// Ranks per NodeSupervisor (consecutive ranks share a node); 0 puts all on one node.
    pub ranks_per_node: usize,
    /// Bound on each stage of shutdown.
    pub shutdown_timeout_ms: u64,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        Self {
            step_timeout_ms: DEFAULT_STEP_TIMEOUT_MS,
            abandon_steps: Vec::new(),
            ranks_per_node: 0,
            shutdown_timeout_ms: DEFAULT_SHUTDOWN_TIMEOUT_MS,
        }
    }
}

/// The running tree: runtime, root actor, compute threads.
struct Running {
    runtime: tokio::runtime::Runtime,
    root: ActorRef<ClusterMsg>,
    root_task: TaskHandle<()>,
}

/// Stops one rank's DeviceWorker actor of a running tree, from any thread, without waiting:
/// the actor stops (terminated with the reason), its NodeSupervisor reports the rank lost, and the step
/// in flight (or the next one) fails naming the rank as died (`FailureCause::Died`) or lost
/// (`ActorError::MembersLost`). The chaos harness's `stop_actor` fault; a clone of the tree's
/// root reference, so it outlives nothing it points to (a stopped tree ignores it).
#[derive(Clone)]
pub struct WorkerStopper(ActorRef<ClusterMsg>);

impl WorkerStopper {
    /// Asks the tree to stop rank `rank`'s worker with `reason`; false when the tree is gone.
    pub fn stop(&self, rank: usize, reason: &str) -> bool {
        self.0.send_message(ClusterMsg::StopWorker { rank, reason: reason.to_string() }).is_ok()
    }
}

/// The synchronous driver of the actor tree (see the module doc).
pub struct Cluster {
    running: Option<Running>,
    threads: Arc<ComputeThreads>,
    opts: ClusterOptions,
    world: usize,
}

impl Cluster {
    /// Starts the tree: one ClusterSupervisor, NodeSupervisors of `ranks_per_node` ranks, one
    /// DeviceWorker (with its compute thread and shard actors) per entry of `workers`.
    /// `shards[r]` describes rank `r`'s partition (`shards[r].rank == r`).
    pub fn start(workers: Vec<Box<dyn WorkerCompute>>, shards: Vec<ShardInfo>, opts: ClusterOptions) -> Result<Cluster, ActorError> {
        let world = workers.len();
        validate(world, &shards, &opts)?;
        let per_node = if opts.ranks_per_node == 0 { world.max(1) } else { opts.ranks_per_node };
        let mut nodes: Vec<Vec<RankSetup>> = Vec::new();
        for (rank, (compute, shard)) in workers.into_iter().zip(shards).enumerate() {
            if rank % per_node == 0 {
                nodes.push(Vec::new());
            }
            if let Some(node) = nodes.last_mut() {
                node.push(RankSetup { rank, compute, shard });
            }
        }
        Self::start_nodes(nodes.into_iter().map(NodeSetup).collect(), world, opts)
    }

    fn start_nodes(nodes: Vec<NodeSetup>, world: usize, opts: ClusterOptions) -> Result<Cluster, ActorError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("tessera-actors")
            .enable_time()
            .build()
            .map_err(|e| ActorError::Spawn { what: "the tokio runtime".into(), cause: e.to_string() })?;
        let threads = Arc::new(ComputeThreads::default());
        let args = ClusterArgs { nodes, opts: opts.clone(), threads: Arc::clone(&threads) };
        let spawned = runtime.block_on(Actor::spawn(None, ClusterSupervisor, args));
        let mut cluster = Cluster { running: None, threads, opts, world };
        match spawned {
            Ok((root, root_task)) => {
                cluster.running = Some(Running { runtime, root, root_task });
                Ok(cluster)
            }
            Err(e) => {
                // Whatever started before the failure is stopped with the runtime; join it.
                runtime.shutdown_timeout(Duration::from_millis(cluster.opts.shutdown_timeout_ms));
                let _ = cluster.join_threads();
                Err(ActorError::Spawn { what: "the actor tree".into(), cause: e.to_string() })
            }
        }
    }

    /// A handle that stops a rank's DeviceWorker actor from any thread (see [`WorkerStopper`]);
    /// `None` once the tree was shut down.
    pub fn stopper(&self) -> Option<WorkerStopper> {
        self.running.as_ref().map(|r| WorkerStopper(r.root.clone()))
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.world
    }

    /// The driver's bound on one `run_step`: every phase of the step plus a margin.
    pub fn step_wait_bound_ms(&self) -> u64 {
        self.opts.step_timeout_ms.saturating_mul(STEP_PHASES_MAX + 1).saturating_add(CONTROL_TIMEOUT_MS)
    }

    /// Runs step `step` as a transaction: prepare on every worker, then commit on every worker
    /// (or abandon on every survivor if anything failed, naming the ranks in the error).
    pub fn run_step(&mut self, step: u64) -> Result<StepResult, ActorError> {
        let bound_ms = self.step_wait_bound_ms();
        self.ask("run_step", bound_ms, |reply| ClusterMsg::RunStep { step, reply })?
    }

    /// Every live rank's memory report, in rank order.
    pub fn memory(&self) -> Result<Vec<MemoryReport>, ActorError> {
        let bound_ms = self.opts.step_timeout_ms.saturating_add(CONTROL_TIMEOUT_MS);
        self.ask("memory", bound_ms, ClusterMsg::Memory)?
    }

    /// Every live rank's shard actors' status (params before optim), in rank order.
    pub fn shards(&self) -> Result<Vec<ShardStatus>, ActorError> {
        let bound_ms = self.opts.step_timeout_ms.saturating_add(CONTROL_TIMEOUT_MS);
        self.ask("shards", bound_ms, ClusterMsg::Shards)?
    }

    /// Compute threads that have not exited yet (joined or detached).
    pub fn live_compute_threads(&self) -> usize {
        self.threads.live.load(Ordering::SeqCst)
    }

    /// Sends a request to the ClusterSupervisor and waits (bounded) for the answer.
    fn ask<T: Send + 'static>(
        &self,
        what: &'static str,
        bound_ms: u64,
        build: impl FnOnce(RpcReplyPort<T>) -> ClusterMsg,
    ) -> Result<T, ActorError> {
        let Some(running) = &self.running else { return Err(ActorError::SupervisorGone("the cluster was shut down".into())) };
        let bound = Duration::from_millis(bound_ms);
        let answer = running.runtime.block_on(running.root.call(build, Some(bound)));
        match answer {
            Ok(CallResult::Success(value)) => Ok(value),
            Ok(CallResult::Timeout) => Err(ActorError::NoReply { what, timeout_ms: bound_ms }),
            Ok(CallResult::SenderError) => Err(ActorError::SupervisorGone(format!("{what}: reply dropped"))),
            Err(e) => Err(ActorError::SupervisorGone(format!("{what}: {e}"))),
        }
    }

    /// Stops the tree, shuts the runtime down and joins every compute thread, each stage within
    /// `shutdown_timeout_ms`. A compute thread still inside a call after the bound (e.g. a hung
    /// `prepare`) cannot be killed: it is detached, will exit when that call returns (its
    /// command channel is closed), and the error names its rank.
    pub fn shutdown(mut self) -> Result<(), ActorError> {
        self.stop()
    }

    fn stop(&mut self) -> Result<(), ActorError> {
        let Some(Running { runtime, root, root_task }) = self.running.take() else { return Ok(()) };
        let bound_ms = self.opts.shutdown_timeout_ms;
        let bound = Duration::from_millis(bound_ms);
        let stopped = runtime.block_on(async {
            let stop = root.stop_and_wait(Some("shutdown".into()), Some(bound)).await;
            let task = tokio::time::timeout(bound, root_task).await;
            stop.is_ok() && task.is_ok()
        });
        // Dropping the runtime's tasks drops any actor state left, closing every command channel.
        runtime.shutdown_timeout(bound);
        let joined = self.join_threads();
        match (stopped, joined) {
            (_, Err(e)) => Err(e),
            (false, Ok(())) => Err(ActorError::StopTimedOut { bound_ms }),
            (true, Ok(())) => Ok(()),
        }
    }

    /// Joins every compute thread that exits within the bound; detaches the rest.
    fn join_threads(&self) -> Result<(), ActorError> {
        let bound_ms = self.opts.shutdown_timeout_ms;
        let deadline = Instant::now() + Duration::from_millis(bound_ms);
        let keys: Vec<usize> = self.threads.handles.iter().map(|e| *e.key()).collect();
        let mut handles: Vec<(usize, JoinHandle<()>)> = keys.into_iter().filter_map(|r| self.threads.handles.remove(&r)).collect();
        handles.sort_by_key(|(rank, _)| *rank);
        loop {
            let (done, waiting): (Vec<_>, Vec<_>) = handles.into_iter().partition(|(_, h)| h.is_finished());
            // The thread body catches panics, so a join error cannot carry anything new.
            done.into_iter().for_each(|(_, h)| drop(h.join()));
            handles = waiting;
            if handles.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                let ranks = handles.iter().map(|(r, _)| *r).collect();
                return Err(ActorError::ThreadsDetached { ranks, bound_ms });
            }
            std::thread::sleep(Duration::from_millis(JOIN_POLL_MS));
        }
    }
}

impl Drop for Cluster {
    /// Same as `shutdown`, with the error dropped (call `shutdown` to see it).
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

fn validate(world: usize, shards: &[ShardInfo], opts: &ClusterOptions) -> Result<(), ActorError> {
    if world == 0 {
        return Err(ActorError::Setup("no workers".into()));
    }
    if shards.len() != world {
        return Err(ActorError::Setup(format!("{} shard descriptions for {world} workers", shards.len())));
    }
    if let Some((i, s)) = shards.iter().enumerate().find(|(i, s)| s.rank != *i) {
        return Err(ActorError::Setup(format!("shards[{i}] describes rank {} (expected {i})", s.rank)));
    }
    if opts.step_timeout_ms == 0 {
        return Err(ActorError::Setup("step_timeout_ms must be positive".into()));
    }
    Ok(())
}
