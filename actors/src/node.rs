//! `NodeSupervisor`: one per host/process; starts that host's `DeviceWorker`s and turns their
//! deaths into membership events for the ClusterSupervisor.
//!
//! It decides nothing about steps: a dead worker (`ActorFailed` / `ActorTerminated`) is
//! reported upward as `MemberLost { rank, cause }`, never restarted here (the ClusterSupervisor
//! owns membership and replanning). Mailbox bound (by protocol): one `Members` query at start,
//! plus at most one supervision event per worker.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use ractor::{Actor, ActorId, ActorProcessingErr, ActorRef, RpcReplyPort, SupervisionEvent};

use crate::cluster::ClusterMsg;
use crate::compute::{ShardInfo, WorkerCompute};
use crate::worker::{ComputeThreads, DeviceWorker, WorkerArgs, WorkerMsg, CONTROL_TIMEOUT_MS};

/// One rank to start on a node: its compute and its shard metadata.
pub(crate) struct RankSetup {
    pub rank: usize,
    pub compute: Box<dyn WorkerCompute>,
    pub shard: ShardInfo,
}

/// Start-up arguments of a NodeSupervisor (opaque outside the crate).
pub struct NodeArgs {
    pub(crate) ranks: Vec<RankSetup>,
    pub(crate) cluster: ActorRef<ClusterMsg>,
    pub(crate) threads: Arc<ComputeThreads>,
}

/// Messages to a NodeSupervisor.
pub enum NodeMsg {
    /// The node's workers, by rank (asked once by the ClusterSupervisor at start).
    Members(RpcReplyPort<Vec<(usize, ActorRef<WorkerMsg>)>>),
}

/// A node's state: its workers and which rank each actor id is.
pub struct NodeState {
    workers: Vec<(usize, ActorRef<WorkerMsg>)>,
    rank_of: HashMap<ActorId, usize>,
    cluster: ActorRef<ClusterMsg>,
}

/// The per-host supervisor (see the module doc).
pub struct NodeSupervisor;

impl Actor for NodeSupervisor {
    type Msg = NodeMsg;
    type State = NodeState;
    type Arguments = NodeArgs;

    async fn pre_start(&self, myself: ActorRef<NodeMsg>, args: NodeArgs) -> Result<NodeState, ActorProcessingErr> {
        let mut workers = Vec::with_capacity(args.ranks.len());
        let mut rank_of = HashMap::new();
        for setup in args.ranks {
            let rank = setup.rank;
            let worker_args = WorkerArgs {
                rank,
                compute: setup.compute,
                shard: setup.shard,
                cluster: args.cluster.clone(),
                threads: Arc::clone(&args.threads),
            };
            let (worker, _) = Actor::spawn_linked(None, DeviceWorker, worker_args, myself.get_cell())
                .await
                .map_err(|e| format!("rank {rank}: worker did not start: {e}"))?;
            rank_of.insert(worker.get_id(), rank);
            workers.push((rank, worker));
        }
        Ok(NodeState { workers, rank_of, cluster: args.cluster })
    }

    async fn handle(&self, _: ActorRef<NodeMsg>, msg: NodeMsg, state: &mut NodeState) -> Result<(), ActorProcessingErr> {
        match msg {
            NodeMsg::Members(reply) => drop(reply.send(state.workers.clone())),
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _: ActorRef<NodeMsg>,
        evt: SupervisionEvent,
        state: &mut NodeState,
    ) -> Result<(), ActorProcessingErr> {
        let (cell, cause) = match evt {
            SupervisionEvent::ActorFailed(cell, err) => (cell, err.to_string()),
            SupervisionEvent::ActorTerminated(cell, _, reason) => {
                (cell, format!("worker terminated ({})", reason.unwrap_or_else(|| "no reason given".into())))
            }
            _ => return Ok(()),
        };
        if let Some(rank) = state.rank_of.remove(&cell.get_id()) {
            state.workers.retain(|(r, _)| *r != rank);
            // The supervisor being gone means the tree is shutting down.
            let _ = state.cluster.send_message(ClusterMsg::MemberLost { rank, cause });
        }
        Ok(())
    }

    async fn post_stop(&self, myself: ActorRef<NodeMsg>, _: &mut NodeState) -> Result<(), ActorProcessingErr> {
        myself.stop_children_and_wait(None, Some(Duration::from_millis(CONTROL_TIMEOUT_MS))).await;
        Ok(())
    }
}
