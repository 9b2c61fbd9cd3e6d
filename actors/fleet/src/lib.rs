//! Tessera's process runtime: how a driver and its worker processes (spawned `tessera worker`s,
//! agents on other hosts, late joiners) talk, admit each other and recover. It knows nothing of
//! the front crate's config, data or plan: the run comes in as a [`spec::FleetSpec`], the plan
//! through [`state::FleetPlan`] and [`state::Planner`], compute through
//! `tessera_actors::compute`, faults through `tessera_actors::faults`, and the host process and
//! the workers' network through [`spec::Host`], [`spec::Placement`] and [`worker::Sockets`].
//!
//! - [`wire`]: the control protocol (messages, framing, bounded reads, bulk state).
//! - [`spec`]: what a fleet runs with.
//! - [`state`]: the training state as full-length buffers, cut per rank by the plan.
//! - [`rendezvous`]: how a run's first workers arrive (spawned, or agents joining).
//! - [`join`]: who may talk to a running driver (side connections, late joins).
//! - [`agent`]: an agent's way in: its credentials, dialling the coordinator, `Join`, the answer.
//! - [`driver`]: the fleet itself: launch, monitor, proxies of the members' compute, recovery,
//!   epochs, replicas, rebalancing, the event log, close.
//! - [`worker`]: a worker process's plumbing: its side connection (heartbeats, drain, abort),
//!   the drain signals, the group its compute shares, where its data-plane sockets bind.

pub mod agent;
pub mod driver;
pub mod join;
pub mod rendezvous;
pub mod spec;
pub mod state;
pub mod wire;
pub mod worker;

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, also when a thread panicked holding it (the fleet's state stays usable for the
/// shutdown that follows).
pub(crate) fn relock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
