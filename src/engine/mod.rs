//! The training engine: turns a resolved [`Config`](crate::config::Config) into steps. A step is
//! a transaction over `world` ranks (ZeRO stages 0–3, see [`zero`]): the global batch's `M`
//! micro-batches are split into aligned dyadic blocks, their gradients combined by the fixed tree
//! of [`tessera_transport::tree`], and the optimizer applied to fp32 masters on commit.

mod child;
pub mod device;
mod elastic_worker;
mod experts;
mod fleet;
mod lane;
mod moe_stats;
pub mod pipeline;
mod plan;
mod precision;
mod ranks;
mod replica;
#[cfg(test)]
mod restore_sim;
mod run;
mod store;
mod summary;
mod worker_net;
pub mod zero;

pub use child::{run_agent, run_joiner, run_worker, WorkerArgs};
pub use plan::Plan;
pub use precision::Precision16;
pub use run::{train, validate, TrainOptions, TrainOutcome};
pub use summary::{peak_rss_bytes, ElasticSummary, GpuFigures, HostOptimizerFigures, MemoryBytes, RunRecord, RunStatus, Summary};
pub use tessera_fleet::agent::{AgentArgs, AgentCredentials, WrongCoordinator, AGENT_CONNECT_TIMEOUT_MS};
pub use tessera_fleet::driver::{now_ms, EVENTS_FILE};
pub use tessera_fleet::rendezvous::{
    assign_ranks, control_server_config, AgentAuth, Launched, Rendezvous, RendezvousSlot, COORDINATOR_NAME, JOIN_TIMEOUT_MS,
};
