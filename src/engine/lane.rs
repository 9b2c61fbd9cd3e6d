//! A rank's collectives, run one after another in the order they are submitted: on the
//! caller's thread (`zero_optimization.overlap_comm = false`) or on a dedicated communication
//! thread (`overlap_comm = true`), so that a gradient bucket travels to its owners, or a ZeRO-3
//! unit is gathered ahead of use, while the rank goes on computing.
//!
//! Every rank submits the same sequence of collectives (the plan decides it, never timing), so
//! one queue per rank keeps the group in step. The queue is bounded ([`QUEUE_DEPTH`] jobs; a
//! full queue makes the submitter wait) and every wait for a result is bounded: the thread
//! records when it last finished a job, and a waiter gives up once it has seen no progress for
//! twice the collective's timeout (each collective bounds its own waits by that timeout).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tessera_actors::compute::ComputeError;
use tessera_transport::collective::{Collective, CommStats};

/// Jobs a communication thread may have queued before a submitter waits.
pub const QUEUE_DEPTH: usize = 256;

type Job = Box<dyn FnOnce(&mut dyn Collective) + Send>;

/// The result of a submitted job, to wait for.
pub struct Ticket<T> {
    inner: TicketInner<T>,
}

enum TicketInner<T> {
    Ready(T),
    Failed(String),
    Pending { rx: Receiver<T>, progress: Arc<Progress>, rank: usize, what: &'static str },
}

/// When the communication thread last finished a job (ms since `epoch`), and its bound.
struct Progress {
    epoch: Instant,
    last_ms: AtomicU64,
    stall_ms: u64,
}

impl Progress {
    fn touch(&self) {
        self.last_ms.store(self.epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    fn stalled_for(&self) -> u64 {
        (self.epoch.elapsed().as_millis() as u64).saturating_sub(self.last_ms.load(Ordering::Relaxed))
    }
}

impl<T> Ticket<T> {
    /// Waits for the job's result. Fails if the communication thread has stopped or made no
    /// progress for twice the collective timeout.
    pub fn wait(self) -> Result<T, ComputeError> {
        match self.inner {
            TicketInner::Ready(v) => Ok(v),
            TicketInner::Failed(e) => Err(ComputeError::failed(e)),
            TicketInner::Pending { rx, progress, rank, what } => loop {
                match rx.recv_timeout(Duration::from_millis(200)) {
                    Ok(v) => return Ok(v),
                    Err(RecvTimeoutError::Disconnected) => {
                        return Err(ComputeError::failed(format!("rank {rank}: the communication thread stopped before finishing {what}")))
                    }
                    // A collective that outlived its own timeout twice over: a peer that does
                    // not come, as a collective's timeout is.
                    Err(RecvTimeoutError::Timeout) if progress.stalled_for() > progress.stall_ms => {
                        let why = format!(
                            "rank {rank}: the communication thread made no progress for {} ms while {what} waited",
                            progress.stall_ms
                        );
                        return Err(ComputeError::Lost { rank: None, why });
                    }
                    Err(RecvTimeoutError::Timeout) => {}
                }
            },
        }
    }
}

/// One rank's ordered collectives (see the module docs).
pub struct Lane {
    rank: usize,
    inner: Inner,
}

enum Inner {
    Inline(Box<dyn Collective>),
    /// The communication thread could not be started: every job fails with this reason.
    Broken(String),
    Thread {
        tx: Option<SyncSender<Job>>,
        handle: Option<JoinHandle<()>>,
        progress: Arc<Progress>,
    },
}

impl Lane {
    /// Runs `comm`'s collectives on the caller's thread (`threaded = false`) or on a new
    /// communication thread named after the rank. If that thread cannot be started, every job
    /// fails with the reason (the step then fails and says why).
    pub fn new(comm: Box<dyn Collective>, threaded: bool) -> Lane {
        let rank = comm.rank();
        if !threaded {
            return Lane { rank, inner: Inner::Inline(comm) };
        }
        let progress = Arc::new(Progress { epoch: Instant::now(), last_ms: AtomicU64::new(0), stall_ms: 2 * comm.timeout_ms() });
        progress.touch();
        let (tx, rx) = mpsc::sync_channel::<Job>(QUEUE_DEPTH);
        let p = Arc::clone(&progress);
        let handle = std::thread::Builder::new().name(format!("tessera-comm-{rank}")).spawn(move || {
            let mut comm = comm;
            while let Ok(job) = rx.recv() {
                p.touch();
                job(&mut *comm);
                p.touch();
            }
        });
        match handle {
            Ok(h) => Lane { rank, inner: Inner::Thread { tx: Some(tx), handle: Some(h), progress } },
            Err(e) => Lane { rank, inner: Inner::Broken(format!("rank {rank}: starting the communication thread: {e}")) },
        }
    }

    #[cfg(test)]
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Whether jobs run on a communication thread (overlapping the caller's compute).
    #[cfg(test)]
    pub fn threaded(&self) -> bool {
        matches!(self.inner, Inner::Thread { .. })
    }

    /// Queues `f` after every job submitted before it; `what` names it in errors.
    pub fn submit<T, F>(&mut self, what: &'static str, f: F) -> Ticket<T>
    where
        T: Send + 'static,
        F: FnOnce(&mut dyn Collective) -> T + Send + 'static,
    {
        let rank = self.rank;
        match &mut self.inner {
            Inner::Inline(comm) => Ticket { inner: TicketInner::Ready(f(&mut **comm)) },
            Inner::Broken(e) => Ticket { inner: TicketInner::Failed(format!("{e} (needed for {what})")) },
            Inner::Thread { tx, progress, .. } => {
                let (rtx, rrx) = mpsc::sync_channel(1);
                let job: Job = Box::new(move |c| {
                    // The waiter may have given up; its result is then dropped.
                    let _ = rtx.send(f(c));
                });
                // A job waiting in the queue is progress too: an idle spell before it is no stall.
                progress.touch();
                // A closed queue (thread gone) surfaces as a disconnected ticket.
                if let Some(tx) = tx.as_ref() {
                    let _ = tx.send(job);
                }
                Ticket { inner: TicketInner::Pending { rx: rrx, progress: Arc::clone(progress), rank, what } }
            }
        }
    }

    /// Submits `f` and waits for its result.
    pub fn call<T, F>(&mut self, what: &'static str, f: F) -> Result<T, ComputeError>
    where
        T: Send + 'static,
        F: FnOnce(&mut dyn Collective) -> T + Send + 'static,
    {
        self.submit(what, f).wait()
    }

    /// The collective's traffic counters, after every job submitted so far.
    pub fn stats(&mut self) -> Result<CommStats, ComputeError> {
        self.call("reading traffic counters", |c| c.stats())
    }

    /// Waits until every job submitted so far has run (results nobody waits for are dropped).
    pub fn drain(&mut self) -> Result<(), ComputeError> {
        self.call("draining the communication queue", |_| ())
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        if let Inner::Thread { tx, handle, .. } = &mut self.inner {
            // Closing the queue ends the thread after the jobs already queued (each bounded).
            drop(tx.take());
            if let Some(h) = handle.take() {
                let _ = h.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_transport::local::LocalGroup;

    fn lanes(world: usize, threaded: bool) -> Vec<Lane> {
        LocalGroup::new(world).into_iter().map(|c| Lane::new(Box::new(c), threaded)).collect()
    }

    /// Two ranks queue several collectives without waiting, then collect the results in order.
    #[test]
    fn queued_collectives_run_in_order_on_either_kind_of_lane() {
        for threaded in [false, true] {
            let results: Vec<Vec<f32>> = std::thread::scope(|s| {
                let hs: Vec<_> = lanes(2, threaded)
                    .into_iter()
                    .map(|mut lane| {
                        s.spawn(move || {
                            assert_eq!(lane.threaded(), threaded);
                            let r = lane.rank() as f32;
                            let tickets: Vec<_> = (0..5)
                                .map(|k| {
                                    lane.submit("test all-reduce", move |c| {
                                        let mut v = vec![r + k as f32; 3];
                                        c.all_reduce_sum(&mut v).map(|()| v[0])
                                    })
                                })
                                .collect();
                            let out: Vec<f32> = tickets.into_iter().map(|t| t.wait().expect("lane").expect("collective")).collect();
                            assert_eq!(lane.stats().expect("stats").ops, 5);
                            lane.drain().expect("drain");
                            out
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().expect("rank")).collect()
            });
            // Σ over ranks 0 and 1 of (r + k) = 2k + 1, for k = 0..5, on both ranks.
            let want: Vec<f32> = (0..5).map(|k| 2.0 * k as f32 + 1.0).collect();
            assert_eq!(results, vec![want.clone(), want], "threaded = {threaded}");
        }
    }

    /// A job that never gets its peer fails by the collective's own timeout, and the waiter
    /// gets that error rather than hanging; a dropped lane joins its thread.
    #[test]
    fn a_missing_peer_fails_the_job_within_its_timeout() {
        let mut comms = LocalGroup::with_timeout_ms(2, 50);
        let lonely = comms.remove(0);
        let mut lane = Lane::new(Box::new(lonely), true);
        let res = lane.call("lonely barrier", |c| c.barrier()).expect("the thread answers");
        assert!(
            matches!(&res, Err(tessera_transport::collective::CollectiveError::Timeout { .. })),
            "a barrier without its peer fails by its timeout: {res:?}"
        );
        drop(lane);
    }
}
