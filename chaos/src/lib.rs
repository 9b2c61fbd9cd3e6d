//! tessera-chaos: seeded fault injection for tests and (later) the `tessera chaos` harness: the
//! UDP fault proxy (delay, loss, reordering, duplication between QUIC endpoints), test hosts in
//! network namespaces (links cut, bandwidth capped), and a collective exercise whose results must
//! not depend on the network. Fault plans, process killers and invariant checkers come with the
//! fault-tolerance issue.

pub mod exercise;
pub mod netns;
pub mod proxy;
