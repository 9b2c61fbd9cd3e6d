//! tessera-chaos: seeded fault injection for tests and the `tessera chaos` harness: the UDP
//! fault proxy (delay, loss, reordering, duplication between QUIC endpoints), test hosts in
//! network namespaces (links cut, bandwidth capped), a worker's fault link (`link`: its QUIC
//! traffic through a proxy the harness steers), a collective exercise whose results must not
//! depend on the network, fault plans (`plan`: scenarios of kills, hangs, SIGTERM drains, joins,
//! checkpoint faults, partitions, link faults, throttles and a full disk, resolved by a seed)
//! and the runner that injects them into an elastic training run and compares it with the
//! fault-free one (`runner`, with the faulted run's test network in `hosts`, its checkpoint
//! file system in `disk`, and its picture over time in `timeline`), and the real fault hooks the
//! runtime calls when `TESSERA_TEST_FAULTS` asks for them (`hooks`).

pub mod disk;
pub mod exercise;
pub mod hooks;
pub mod hosts;
pub mod link;
pub mod netns;
pub mod plan;
pub mod proxy;
pub mod runner;
pub mod timeline;
