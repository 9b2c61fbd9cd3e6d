//! Tests of the actor tree with real actors and threads over a fake compute.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::recovery::{after_failure, AfterFailure};
use crate::{
    ActorError, Cluster, ClusterOptions, ComputeError, FailureCause, MemoryReport, Prepared, RankFailure, ShardInfo, ShardKind, ShardSpec,
    StepOrder, WorkerCompute,
};

/// What the fake computes did, in the order they did it.
#[derive(Default)]
struct Ledger {
    /// Committed value per rank.
    values: Vec<f64>,
    prepares: Vec<(usize, u64, u32)>,
    commits: Vec<(usize, u64)>,
    abandons: Vec<(usize, u64)>,
}

/// How a fake misbehaves at one step.
enum Fault {
    None,
    /// `prepare` of this step returns an error the first time.
    FailOnce(u64),
    /// `prepare` of this step panics.
    Panic(u64),
    /// `commit` of this step returns an error.
    FailCommit(u64),
    /// `prepare` of this step returns this error (its kind is what the test follows).
    Return(u64, ComputeError),
    /// `commit` of this step returns this error.
    ReturnInCommit(u64, ComputeError),
    /// `prepare` of this step blocks until the sender is dropped (or 10 s pass).
    Hang(u64, Receiver<()>),
}

struct Fake {
    rank: usize,
    staged: Option<(u64, f64)>,
    fault: Fault,
    ledger: Arc<Mutex<Ledger>>,
    alive: Arc<AtomicUsize>,
}

/// Rank `rank`'s contribution to step `step`: distinct per (rank, step), order-sensitive sums.
fn contribution(rank: usize, step: u64) -> f64 {
    (rank as f64 + 1.0) * 1.0e-3 + (step as f64).sqrt() * 1.0e5 + 0.1
}

impl Fake {
    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl WorkerCompute for Fake {
    fn prepare(&mut self, order: &StepOrder) -> Result<Prepared, ComputeError> {
        self.ledger().prepares.push((self.rank, order.step, order.attempt));
        match &self.fault {
            Fault::FailOnce(s) if *s == order.step => {
                let s = *s;
                self.fault = Fault::None;
                return Err(ComputeError::failed(format!("injected failure at step {s}")));
            }
            Fault::Return(s, e) if *s == order.step => return Err(e.clone()),
            Fault::Panic(s) if *s == order.step => panic!("injected panic at step {s}"),
            Fault::Hang(s, release) if *s == order.step => drop(release.recv_timeout(Duration::from_secs(10))),
            _ => {}
        }
        let c = contribution(self.rank, order.step);
        let base = self.ledger().values[self.rank];
        self.staged = Some((order.step, base + c));
        Ok(Prepared {
            loss_sum: c,
            micro_batches: 2,
            grad_norm: Some(1.5),
            bytes_sent: 10,
            bytes_received: 20,
            compute_s: 0.01,
            ..Prepared::default()
        })
    }

    fn commit(&mut self, step: u64) -> Result<(), ComputeError> {
        match &self.fault {
            Fault::FailCommit(s) if *s == step => return Err(ComputeError::failed(format!("injected commit failure at step {step}"))),
            Fault::ReturnInCommit(s, e) if *s == step => return Err(e.clone()),
            _ => {}
        }
        let Some((staged_step, value)) = self.staged.take() else {
            return Err(ComputeError::failed(format!("nothing staged for step {step}")));
        };
        if staged_step != step {
            return Err(ComputeError::failed(format!("staged step {staged_step}, asked to commit {step}")));
        }
        let mut ledger = self.ledger();
        ledger.values[self.rank] = value;
        ledger.commits.push((self.rank, step));
        Ok(())
    }

    fn abandon(&mut self, step: u64) {
        self.staged = None;
        self.ledger().abandons.push((self.rank, step));
    }

    fn memory(&self) -> MemoryReport {
        MemoryReport { rank: self.rank, param_bytes: 100 * (self.rank as u64 + 1), grad_bytes: 7, optim_bytes: 300 }
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        self.alive.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A world of fakes: the shared ledger, the live-compute counter, and the workers.
struct World {
    ledger: Arc<Mutex<Ledger>>,
    alive: Arc<AtomicUsize>,
}

impl World {
    fn new(world: usize) -> Self {
        let ledger = Ledger { values: vec![0.0; world], ..Ledger::default() };
        World { ledger: Arc::new(Mutex::new(ledger)), alive: Arc::new(AtomicUsize::new(0)) }
    }

    fn workers(&self, faults: Vec<Fault>) -> Vec<Box<dyn WorkerCompute>> {
        faults
            .into_iter()
            .enumerate()
            .map(|(rank, fault)| {
                self.alive.fetch_add(1, Ordering::SeqCst);
                let fake = Fake { rank, staged: None, fault, ledger: Arc::clone(&self.ledger), alive: Arc::clone(&self.alive) };
                Box::new(fake) as Box<dyn WorkerCompute>
            })
            .collect()
    }

    fn values(&self) -> Vec<f64> {
        self.ledger.lock().unwrap_or_else(|e| e.into_inner()).values.clone()
    }

    fn with<T>(&self, f: impl FnOnce(&Ledger) -> T) -> T {
        f(&self.ledger.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

fn shards(world: usize) -> Vec<ShardInfo> {
    let ranges = crate::partition(1000, world, 16);
    (0..world)
        .map(|rank| ShardInfo {
            rank,
            params: Some(ShardSpec { range: ranges[rank].clone(), bytes: 4 * ranges[rank].len() as u64 }),
            optim: Some(ShardSpec { range: ranges[rank].clone(), bytes: 12 * ranges[rank].len() as u64 }),
        })
        .collect()
}

fn no_faults(world: usize) -> Vec<Fault> {
    (0..world).map(|_| Fault::None).collect()
}

fn quick(opts: ClusterOptions) -> ClusterOptions {
    ClusterOptions { step_timeout_ms: 5_000, shutdown_timeout_ms: 2_000, ..opts }
}

/// Runs steps 1..=n with no faults and returns the committed values.
fn reference_values(world: usize, n: u64) -> Vec<f64> {
    let w = World::new(world);
    let mut cluster = Cluster::start(w.workers(no_faults(world)), shards(world), quick(ClusterOptions::default())).expect("start");
    (1..=n).for_each(|s| drop(cluster.run_step(s).expect("step")));
    cluster.shutdown().expect("shutdown");
    w.values()
}

#[test]
fn commit_applies_exactly_once_per_step() {
    let w = World::new(3);
    let mut cluster = Cluster::start(w.workers(no_faults(3)), shards(3), quick(ClusterOptions::default())).expect("start");
    assert_eq!(cluster.live_compute_threads(), 3);
    for step in 1..=5 {
        let r = cluster.run_step(step).expect("step");
        assert_eq!((r.step, r.epoch, r.micro_batches, r.bytes_sent, r.bytes_received), (step, 0, 6, 30, 60));
        let want: f64 = (0..3).map(|rank| contribution(rank, step)).sum();
        assert_eq!(r.loss_sum, want);
        assert_eq!(r.grad_norm, Some(1.5));
        assert!(r.abandoned_attempts.is_empty());
    }
    let mut commits = w.with(|l| l.commits.clone());
    commits.sort();
    let want: Vec<(usize, u64)> = (0..3).flat_map(|r| (1..=5).map(move |s| (r, s))).collect();
    assert_eq!(commits, want, "each rank commits each step once");
    let expect: Vec<f64> = (0..3).map(|r| (1..=5).fold(0.0, |acc, s| acc + contribution(r, s))).collect();
    assert_eq!(w.values(), expect);
    assert!(matches!(cluster.run_step(3), Err(ActorError::AlreadyCommitted { step: 3, last_committed: 5 })));
    assert_eq!(w.with(|l| l.commits.len()), 15, "a committed step is not applied again");
    check_queries(&cluster);
    cluster.shutdown().expect("shutdown");
    assert_eq!(w.alive.load(Ordering::SeqCst), 0, "every compute was dropped on its joined thread");
}

fn check_queries(cluster: &Cluster) {
    let memory = cluster.memory().expect("memory");
    assert_eq!(memory.iter().map(|m| (m.rank, m.param_bytes)).collect::<Vec<_>>(), vec![(0, 100), (1, 200), (2, 300)]);
    let status = cluster.shards().expect("shards");
    assert_eq!(status.len(), 6);
    let ranges = crate::partition(1000, 3, 16);
    for (i, s) in status.iter().enumerate() {
        assert_eq!(s.rank, i / 2);
        assert_eq!(s.kind, if i % 2 == 0 { ShardKind::Param } else { ShardKind::Optim });
        assert_eq!(s.spec.range, ranges[i / 2]);
        assert_eq!(s.last_committed_step, Some(5));
    }
}

#[test]
fn abandoned_steps_rerun_to_the_same_result() {
    let want = reference_values(3, 5);
    let w = World::new(3);
    let opts = quick(ClusterOptions { abandon_steps: vec![2, 4], ranks_per_node: 2, ..ClusterOptions::default() });
    let mut cluster = Cluster::start(w.workers(no_faults(3)), shards(3), opts).expect("start");
    for step in 1..=5 {
        let r = cluster.run_step(step).expect("step");
        let abandoned: &[u32] = if step == 2 || step == 4 { &[0] } else { &[] };
        assert_eq!(r.abandoned_attempts, abandoned, "step {step}");
    }
    assert_eq!(w.values(), want, "abandon + rerun commits the same values");
    let mut abandons = w.with(|l| l.abandons.clone());
    abandons.sort();
    assert_eq!(abandons, vec![(0, 2), (0, 4), (1, 2), (1, 4), (2, 2), (2, 4)]);
    assert!(w.with(|l| l.prepares.contains(&(1, 2, 0)) && l.prepares.contains(&(1, 2, 1))));
    assert!(cluster.shards().expect("shards").iter().all(|s| s.abandoned == 2 && s.last_committed_step == Some(5)));
    cluster.shutdown().expect("shutdown");
    assert_eq!(w.alive.load(Ordering::SeqCst), 0);
}

fn single_failure(err: &ActorError, step: u64) -> Option<RankFailure> {
    match err {
        ActorError::StepAbandoned { step: s, failures } if *s == step && failures.len() == 1 => Some(failures[0].clone()),
        _ => None,
    }
}

#[test]
fn a_failed_prepare_abandons_the_step_on_every_worker() {
    let w = World::new(3);
    let faults = vec![Fault::None, Fault::FailOnce(2), Fault::None];
    let mut cluster = Cluster::start(w.workers(faults), shards(3), quick(ClusterOptions::default())).expect("start");
    cluster.run_step(1).expect("step 1");
    let after_one = w.values();
    let err = cluster.run_step(2).expect_err("rank 1 fails step 2");
    let failure = single_failure(&err, 2).unwrap_or_else(|| panic!("unexpected error {err}"));
    assert_eq!(failure, RankFailure { rank: 1, cause: FailureCause::Returned(ComputeError::failed("injected failure at step 2")) });
    assert!(err.to_string().contains("rank 1 failed: injected failure at step 2"), "{err}");
    assert_eq!(w.values(), after_one, "committed state unchanged");
    let mut abandons = w.with(|l| l.abandons.clone());
    abandons.sort();
    assert_eq!(abandons, vec![(0, 2), (1, 2), (2, 2)], "every live worker dropped its staged state");
    // The member is alive, so the step can run again.
    cluster.run_step(2).expect("step 2 again");
    cluster.run_step(3).expect("step 3");
    assert_eq!(w.values(), reference_values(3, 3));
    cluster.shutdown().expect("shutdown");
}

#[test]
fn a_panicking_worker_is_a_membership_event() {
    let w = World::new(4);
    let faults = vec![Fault::None, Fault::None, Fault::Panic(2), Fault::None];
    let opts = quick(ClusterOptions { ranks_per_node: 2, ..ClusterOptions::default() });
    let mut cluster = Cluster::start(w.workers(faults), shards(4), opts).expect("start");
    cluster.run_step(1).expect("step 1");
    let after_one = w.values();
    // A panic is reported as the rank's death, not found by the step timeout (the cause would
    // be `TimedOut` then).
    let err = cluster.run_step(2).expect_err("rank 2 panics");
    let failure = single_failure(&err, 2).unwrap_or_else(|| panic!("unexpected error {err}"));
    assert_eq!(failure.rank, 2);
    assert!(matches!(&failure.cause, FailureCause::Died(c) if c.contains("panicked") && c.contains("injected panic")), "{failure}");
    assert_eq!(w.values(), after_one);
    let mut abandons = w.with(|l| l.abandons.clone());
    abandons.sort();
    assert_eq!(abandons, vec![(0, 2), (1, 2), (3, 2)]);
    assert!(matches!(cluster.run_step(2), Err(ActorError::MembersLost { epoch: 0, ref ranks, .. }) if ranks == &[2]));
    assert_eq!(cluster.memory().expect("survivors answer").len(), 3);
    cluster.shutdown().expect("the panicked rank's thread exited and was joined");
    assert_eq!(w.alive.load(Ordering::SeqCst), 0);
}

/// The chaos harness's `stop_actor`: a DeviceWorker stopped from another thread is a lost
/// member, whether it stops between steps (the next step is refused, naming it) or while a step
/// waits on it (the step fails at once with the rank died for the given reason, long before the
/// phase timeout), and its compute thread still exits.
#[test]
fn a_stopped_worker_actor_is_a_lost_member() {
    let w = World::new(3);
    let (release, hang): (Sender<()>, Receiver<()>) = channel();
    let faults = vec![Fault::None, Fault::None, Fault::Hang(2, hang)];
    let opts = ClusterOptions { step_timeout_ms: 60_000, ..quick(ClusterOptions::default()) };
    let mut cluster = Cluster::start(w.workers(faults), shards(3), opts).expect("start");
    cluster.run_step(1).expect("step 1");
    let stopper = cluster.stopper().expect("a running tree");
    // Mid-step: rank 2 hangs in its prepare of step 2; a thread stops its actor meanwhile.
    let t = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        assert!(stopper.stop(2, "chaos: stop_actor"));
        std::thread::sleep(Duration::from_millis(300));
        drop(release);
        stopper
    });
    let began = Instant::now();
    let err = cluster.run_step(2).expect_err("rank 2's actor was stopped");
    assert!(began.elapsed() < Duration::from_secs(20), "the step waited for its timeout: {err}");
    let failure = single_failure(&err, 2).unwrap_or_else(|| panic!("unexpected error {err}"));
    assert_eq!(failure.rank, 2);
    assert!(matches!(&failure.cause, FailureCause::Died(c) if c.contains("chaos: stop_actor")), "{failure}");
    assert!(matches!(cluster.run_step(2), Err(ActorError::MembersLost { ref ranks, .. }) if ranks == &[2]));
    // Between steps: rank 0 stopped while nothing runs; the next step is refused naming both,
    // each with why it was lost.
    let stopper = t.join().expect("stopper thread");
    assert!(stopper.stop(0, "chaos: stop_actor"));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match cluster.run_step(2) {
            Err(ActorError::MembersLost { ref ranks, ref causes, .. }) if ranks == &[0, 2] => {
                assert!(causes.iter().all(|c| c.contains("chaos: stop_actor")), "{causes:?}");
                break;
            }
            Err(ActorError::MembersLost { .. }) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            other => panic!("expected ranks 0 and 2 lost, got {other:?}"),
        }
    }
    cluster.shutdown().expect("the stopped ranks' threads exited and were joined");
    assert_eq!(w.alive.load(Ordering::SeqCst), 0);
}

#[test]
fn a_hung_worker_times_out_and_is_detached_at_shutdown() {
    let w = World::new(3);
    let (release, hang): (Sender<()>, Receiver<()>) = channel();
    let faults = vec![Fault::None, Fault::Hang(1, hang), Fault::None];
    let opts = ClusterOptions { step_timeout_ms: 200, shutdown_timeout_ms: 300, ..ClusterOptions::default() };
    let mut cluster = Cluster::start(w.workers(faults), shards(3), opts).expect("start");
    let err = cluster.run_step(1).expect_err("rank 1 hangs");
    let failure = single_failure(&err, 1).unwrap_or_else(|| panic!("unexpected error {err}"));
    assert_eq!(failure, RankFailure { rank: 1, cause: FailureCause::TimedOut { phase: "prepare", timeout_ms: 200 } });
    let mut abandons = w.with(|l| l.abandons.clone());
    abandons.sort();
    assert_eq!(abandons, vec![(0, 1), (2, 1)], "survivors abandoned");
    assert!(w.with(|l| l.commits.is_empty()));
    // Bounded: the hung thread is detached after `shutdown_timeout_ms`, and the error says so.
    let err = cluster.shutdown().expect_err("the hung thread is detached");
    assert!(matches!(&err, ActorError::ThreadsDetached { ranks, bound_ms: 300 } if ranks == &[1]), "{err}");
    assert_eq!(w.alive.load(Ordering::SeqCst), 1, "only the hung compute is still alive");
    drop(release);
    let deadline = Instant::now() + Duration::from_secs(5);
    while w.alive.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(w.alive.load(Ordering::SeqCst), 0, "the detached thread exits once its call returns");
}

#[test]
fn dropping_the_cluster_joins_its_threads() {
    let w = World::new(2);
    let mut cluster = Cluster::start(w.workers(no_faults(2)), shards(2), quick(ClusterOptions::default())).expect("start");
    cluster.run_step(1).expect("step");
    drop(cluster);
    assert_eq!(w.alive.load(Ordering::SeqCst), 0);
}

#[test]
fn inconsistent_setups_are_rejected() {
    let w = World::new(2);
    let err = Cluster::start(w.workers(no_faults(2)), shards(3), ClusterOptions::default()).err();
    assert!(matches!(err, Some(ActorError::Setup(ref m)) if m.contains("3 shard descriptions for 2 workers")), "{err:?}");
    let mut swapped = shards(2);
    swapped.swap(0, 1);
    let err = Cluster::start(w.workers(no_faults(2)), swapped, ClusterOptions::default()).err();
    assert!(matches!(err, Some(ActorError::Setup(ref m)) if m.contains("shards[0] describes rank 1")), "{err:?}");
    assert!(matches!(Cluster::start(Vec::new(), Vec::new(), ClusterOptions::default()), Err(ActorError::Setup(_))));
    assert_eq!(w.alive.load(Ordering::SeqCst), 0, "rejected computes are dropped");
}

#[test]
fn a_failed_commit_leaves_the_cluster_refusing_steps() {
    let w = World::new(2);
    let faults = vec![Fault::None, Fault::FailCommit(2)];
    let mut cluster = Cluster::start(w.workers(faults), shards(2), quick(ClusterOptions::default())).expect("start");
    cluster.run_step(1).expect("step 1");
    let err = cluster.run_step(2).expect_err("rank 1 cannot commit");
    let failures = match &err {
        ActorError::CommitFailed { step: 2, failures, .. } => failures.clone(),
        other => panic!("unexpected error {other}"),
    };
    assert_eq!(
        failures,
        vec![RankFailure { rank: 1, cause: FailureCause::Returned(ComputeError::failed("injected commit failure at step 2")) }]
    );
    let mut commits = w.with(|l| l.commits.clone());
    commits.sort();
    assert_eq!(commits, vec![(0, 1), (0, 2), (1, 1)], "rank 0 committed step 2, rank 1 did not");
    assert!(matches!(cluster.run_step(3), Err(ActorError::Inconsistent { step: 2 })));
    cluster.shutdown().expect("shutdown");
}

/// Each kind of compute error reaches the elastic driver's verdict as its variant (a worker
/// process's error arrives as itself: `ElasticCompute` rebuilds it from the wire's
/// `WireComputeError`, whose round trip `tessera_fleet::wire` tests): a lost peer in
/// prepare and an aborted group wait for the loss (then re-plan), a rank's own failure ends the
/// run, a commit torn after its step by a lost peer keeps what it stepped and waits for the loss.
#[test]
fn every_error_kind_reaches_the_verdict_as_itself() {
    let lost = ComputeError::Lost { rank: Some(0), why: "all_to_all: peer rank 0 has left the group".into() };
    let aborted = ComputeError::Aborted { why: "all_gather: the group was aborted: epoch 3".into() };
    let failed = ComputeError::failed("reading unit 4 from NVMe: short read");
    let torn = ComputeError::Lost { rank: Some(0), why: "the parameter all-gather: peer rank 0 has left the group".into() }.torn(Some(2));
    let in_prepare = [(lost, AfterFailure::AwaitLoss), (aborted, AfterFailure::AwaitLoss), (failed.clone(), AfterFailure::Failed)];
    for (e, verdict) in in_prepare {
        let w = World::new(2);
        let mut cluster =
            Cluster::start(w.workers(vec![Fault::None, Fault::Return(2, e.clone())]), shards(2), quick(ClusterOptions::default()))
                .expect("start");
        cluster.run_step(1).expect("step 1");
        let err = cluster.run_step(2).expect_err("rank 1 fails step 2");
        assert_eq!(single_failure(&err, 2), Some(RankFailure { rank: 1, cause: FailureCause::Returned(e.clone()) }), "{err}");
        assert_eq!(after_failure(&err), verdict, "{err}");
        assert!(err.to_string().contains(&format!("rank 1 failed: {e}")), "{err}");
    }
    for (e, verdict) in [(torn, AfterFailure::AwaitLoss), (failed.torn(None), AfterFailure::Failed)] {
        let w = World::new(2);
        let faults = vec![Fault::None, Fault::ReturnInCommit(2, e.clone())];
        let mut cluster = Cluster::start(w.workers(faults), shards(2), quick(ClusterOptions::default())).expect("start");
        cluster.run_step(1).expect("step 1");
        let err = cluster.run_step(2).expect_err("rank 1's commit of step 2 fails");
        let ActorError::CommitFailed { step: 2, failures, .. } = &err else { panic!("{err}") };
        assert_eq!(failures, &vec![RankFailure { rank: 1, cause: FailureCause::Returned(e.clone()) }]);
        assert_eq!(after_failure(&err), verdict, "{err}");
    }
}

/// The sans-IO cores import none of their drivers (the actors, the driver) and no IO, clock,
/// thread or runtime (docs/ARCHITECTURE.md, "API boundaries"): the library code of each file,
/// up to its tests, is read for such paths outside comments.
#[test]
fn sans_io_cores_import_no_drivers_and_no_io() {
    let cores = [
        ("plan.rs", include_str!("plan.rs")),
        ("replan.rs", include_str!("replan.rs")),
        ("txn.rs", include_str!("txn.rs")),
        ("worker_cmd.rs", include_str!("worker_cmd.rs")),
        ("stepper.rs", include_str!("stepper.rs")),
        ("recovery.rs", include_str!("recovery.rs")),
        ("liveness.rs", include_str!("liveness.rs")),
        ("formation.rs", include_str!("formation.rs")),
        ("membership.rs", include_str!("membership.rs")),
    ];
    let forbidden = [
        "crate::cluster",
        "crate::node",
        "crate::worker::",
        "crate::driver",
        "ractor",
        "tokio",
        "std::fs",
        "std::net",
        "std::thread",
        "std::sync::mpsc",
        "Instant",
        "SystemTime",
    ];
    for (file, text) in cores {
        let library = text.split("#[cfg(test)]\nmod tests").next().unwrap_or_default();
        for (n, line) in library.lines().enumerate() {
            let code = line.split("//").next().unwrap_or_default();
            if let Some(path) = forbidden.iter().find(|p| code.contains(*p)) {
                panic!("actors/src/{file}:{}: a sans-IO core names `{path}`: {line}", n + 1);
            }
        }
    }
}
