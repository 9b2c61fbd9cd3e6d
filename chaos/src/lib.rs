//! tessera-chaos: seeded fault injection for tests and the `tessera chaos` harness — today the
//! UDP fault proxy (delay, loss, reordering, duplication between QUIC endpoints); fault plans,
//! process killers and invariant checkers come with the fault-tolerance issue.

pub mod proxy;
