//! tessera-chaos: seeded fault injection for tests and the `tessera chaos` harness: the UDP
//! fault proxy (delay, loss, reordering, duplication between QUIC endpoints), test hosts in
//! network namespaces (links cut, bandwidth capped), a collective exercise whose results must
//! not depend on the network, fault plans (`plan`: scenarios of kills, hangs, SIGTERM drains,
//! joins and checkpoint faults, resolved by a seed) and the runner that injects them into an
//! elastic training run and compares it with the fault-free one (`runner`).

pub mod exercise;
pub mod netns;
pub mod plan;
pub mod proxy;
pub mod runner;
