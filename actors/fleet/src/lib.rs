//! Tessera's process runtime: how a driver and its worker processes (spawned `tessera worker`s,
//! agents on other hosts, late joiners) talk, admit each other and recover. It knows nothing of
//! the front crate's config, data or plan: compute comes in through `tessera_actors::compute`
//! and faults through `tessera_actors::faults`.
//!
//! - [`wire`]: the control protocol (messages, framing, bounded reads, bulk state).

pub mod wire;
