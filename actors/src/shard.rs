//! `ParamShard` and `OptimShard`: the control-plane owners of one rank's partition.
//!
//! Honest split: these actors hold METADATA only — the global range of the flat buffer a rank
//! owns, the bytes it holds for it, and the last step committed into it. They answer "what do
//! you hold" and receive commit/abandon notifications from their `DeviceWorker`. The bulk
//! buffers (parameter shards, fp32 masters, moments) stay with the worker's compute, and the
//! data plane (gathers, reduce-scatters) is the compute's collectives, issued in plan order;
//! no tensor ever passes through these mailboxes.
//!
//! Mailbox bound (by protocol): the owning worker sends at most one notification per phase and
//! one `Describe` per query, and only its supervisor queries it, so a shard mailbox holds at
//! most two messages.

use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

use crate::compute::ShardSpec;

/// Which kind of partition a shard actor owns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardKind {
    /// ZeRO-3 parameter shard (`ParamShard`).
    Param,
    /// ZeRO-1/2/3 optimizer-state shard (`OptimShard`).
    Optim,
}

/// What a shard actor reports about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardStatus {
    /// Owning rank.
    pub rank: usize,
    /// Parameter or optimizer shard.
    pub kind: ShardKind,
    /// The owned global range of the flat buffer and bytes held for it.
    pub spec: ShardSpec,
    /// The last step committed into this shard (`None` before the first commit).
    pub last_committed_step: Option<u64>,
    /// How many prepared-but-abandoned steps this shard was told to drop.
    pub abandoned: u64,
}

/// Messages to a shard actor (from its `DeviceWorker`).
#[derive(Debug)]
pub enum ShardMsg {
    /// The worker's compute committed `step`.
    Committed(u64),
    /// The worker's compute dropped the staged state of `step`.
    Abandoned(u64),
    /// Report the current status.
    Describe(RpcReplyPort<ShardStatus>),
}

/// Control-plane owner of a ZeRO-3 parameter shard.
pub struct ParamShard;

/// Control-plane owner of an optimizer-state shard (fp32 master + moments).
pub struct OptimShard;

/// Arguments of both shard actors: owning rank and the shard.
pub type ShardArgs = (usize, ShardSpec);

fn start(kind: ShardKind, (rank, spec): ShardArgs) -> ShardStatus {
    ShardStatus { rank, kind, spec, last_committed_step: None, abandoned: 0 }
}

fn apply(msg: ShardMsg, state: &mut ShardStatus) {
    match msg {
        ShardMsg::Committed(step) => state.last_committed_step = Some(step),
        ShardMsg::Abandoned(_) => state.abandoned += 1,
        // A closed port means the asker gave up waiting (it has its own timeout).
        ShardMsg::Describe(reply) => drop(reply.send(state.clone())),
    }
}

impl Actor for ParamShard {
    type Msg = ShardMsg;
    type State = ShardStatus;
    type Arguments = ShardArgs;

    async fn pre_start(&self, _: ActorRef<ShardMsg>, args: ShardArgs) -> Result<ShardStatus, ActorProcessingErr> {
        Ok(start(ShardKind::Param, args))
    }

    async fn handle(&self, _: ActorRef<ShardMsg>, msg: ShardMsg, state: &mut ShardStatus) -> Result<(), ActorProcessingErr> {
        apply(msg, state);
        Ok(())
    }
}

impl Actor for OptimShard {
    type Msg = ShardMsg;
    type State = ShardStatus;
    type Arguments = ShardArgs;

    async fn pre_start(&self, _: ActorRef<ShardMsg>, args: ShardArgs) -> Result<ShardStatus, ActorProcessingErr> {
        Ok(start(ShardKind::Optim, args))
    }

    async fn handle(&self, _: ActorRef<ShardMsg>, msg: ShardMsg, state: &mut ShardStatus) -> Result<(), ActorProcessingErr> {
        apply(msg, state);
        Ok(())
    }
}
