//! The driver's requests to members: one reply per request, bounded by the step timeout, a
//! transport failure declared a loss; the state a member exports; and [`ElasticCompute`], the
//! driver's proxy of one member's compute in the current epoch.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tessera_actors::compute::{ComputeError, MemoryReport, Prepared, StepOrder, WorkerCompute};
use tessera_transport::quic::ControlConn;

use super::{now_ms, relock, tracing, Fleet, Shared};
use crate::rendezvous;
use crate::state::FleetPlan;
use crate::state::{OptimBuffers, RankCounters};
use crate::wire::{self, Snapshot, ToParent, ToWorker, Wait, WireError};

/// A member's control connection and its latest snapshot.
pub(super) struct Link {
    pub(super) stream: ControlConn,
    pub(super) snapshot: Snapshot,
}

/// A member of the current epoch.
pub(super) struct Member {
    pub(super) id: u64,
    pub(super) pid: u32,
    pub(super) link: Mutex<Link>,
}

/// Why a request to a member failed.
pub(super) enum Failure {
    /// The member is lost (already recorded): recovery starts again.
    Lost,
    /// The member answered with an error.
    Refused(String),
}

impl<P: FleetPlan> Fleet<P> {
    pub(super) fn computes(&self) -> Vec<Box<dyn WorkerCompute>> {
        self.members
            .iter()
            .enumerate()
            .map(|(rank, m)| {
                Box::new(ElasticCompute { rank, member: Arc::clone(m), shared: Arc::clone(&self.shared) }) as Box<dyn WorkerCompute>
            })
            .collect()
    }

    /// Sends `msg` to `m` and waits (bounded by the step timeout) for its reply.
    pub(super) fn request(&self, m: &Member, link: &mut Link, msg: &ToWorker, expected: &'static str) -> Result<ToParent, Failure> {
        request(&self.shared, m, link, msg, expected)
    }

    /// Masters, optimizer buffers and counters of one range (`Export` or `ExportReplica`).
    pub(super) fn export_from(&self, m: &Member, msg: &ToWorker, want: usize) -> Result<(Vec<f32>, OptimBuffers, RankCounters), Failure> {
        let mut link = relock(&m.link);
        let (counters, descs) = match self.request(m, &mut link, msg, "Exported")? {
            ToParent::Exported { counters, buffers } => (counters, buffers),
            ToParent::Failed { error } => return Err(Failure::Refused(error.to_string())),
            other => return Err(Failure::Refused(format!("answered {msg:?} with {other:?}"))),
        };
        if descs.first().is_none_or(|d| d.len != want as u64) {
            return Err(Failure::Refused(format!("exported {:?} master values, the range holds {want}", descs.first().map(|d| d.len))));
        }
        let wait = Wait {
            what: "exported state",
            deadline: Some(Instant::now() + Duration::from_millis(self.shared.er.step_timeout_ms)),
            alive: &|| Ok(()),
        };
        match wire::recv_bulk(&mut link.stream, &descs, want, &wait) {
            Ok(bufs) => Ok(rendezvous::exported(&descs, bufs, counters)),
            Err(e) => {
                self.shared.loss(m.id, &format!("worker {} (pid {}): exporting its state: {e}", m.id, m.pid));
                Err(Failure::Lost)
            }
        }
    }

    /// Rank `r`'s masters, its optimizer buffers when `with_optim`, and counters.
    pub fn export(&self, r: usize, plan: &P, with_optim: bool) -> Result<(Vec<f32>, OptimBuffers, RankCounters)> {
        let m = self.members.get(r).with_context(|| format!("no rank {r} in epoch {}", self.epoch))?;
        match self.export_from(m, &ToWorker::Export { optim: with_optim }, plan.optim_range(r).len()) {
            Ok(x) => Ok(x),
            Err(Failure::Lost) => bail!("exporting the state of rank {r}: worker {} was lost", m.id),
            Err(Failure::Refused(e)) => bail!("exporting the state of rank {r} (worker {}): {e}", m.id),
        }
    }

    /// Every member's latest snapshot, in rank order.
    pub fn snapshots(&self) -> Vec<Snapshot> {
        self.members.iter().map(|m| relock(&m.link).snapshot).collect()
    }
}

/// Reads one reply of `m` (bounded by the step timeout; a fenced member fails at once). A
/// transport failure is a loss.
pub(super) fn recv_reply(shared: &Arc<Shared>, m: &Member, link: &mut Link, expected: &'static str) -> Result<ToParent, Failure> {
    let id = m.id;
    let s = Arc::clone(shared);
    let alive = move || match s.is_fenced(id) {
        true => Err(WireError::Io(std::io::Error::other("lost"))),
        false => Ok(()),
    };
    let ms = shared.er.step_timeout_ms;
    let wait = Wait { what: expected, deadline: Some(Instant::now() + Duration::from_millis(ms)), alive: &alive };
    match wire::recv(&mut link.stream, expected, &wait) {
        Ok(r) => Ok(r),
        Err(e) => {
            let why = match e {
                WireError::Timeout { .. } => format!("worker {id} (pid {}): no {expected} within {ms} ms", m.pid),
                e => format!("worker {id} (pid {}): control connection: {e}", m.pid),
            };
            shared.loss(id, &why);
            Err(Failure::Lost)
        }
    }
}

fn request(shared: &Arc<Shared>, m: &Member, link: &mut Link, msg: &ToWorker, expected: &'static str) -> Result<ToParent, Failure> {
    if tracing() {
        eprintln!("[{}] driver -> worker {}: {msg:?}", now_ms() % 100_000, m.id);
    }
    if shared.is_fenced(m.id) {
        return Err(Failure::Lost);
    }
    if let Err(e) = wire::send(&mut link.stream, msg) {
        shared.loss(m.id, &format!("worker {} (pid {}): control connection: {e}", m.id, m.pid));
        return Err(Failure::Lost);
    }
    recv_reply(shared, m, link, expected)
}

/// The driver's proxy of one member's compute in the current epoch.
struct ElasticCompute {
    rank: usize,
    member: Arc<Member>,
    shared: Arc<Shared>,
}

impl ElasticCompute {
    /// The member's reply to `msg`; its error keeps the kind the worker gave it, and a member
    /// that is lost (declared here or by the monitor) is [`ComputeError::Lost`] with its rank.
    fn call(&self, msg: &ToWorker, expected: &'static str) -> Result<(ToParent, MutexGuard<'_, Link>), ComputeError> {
        let mut link = relock(&self.member.link);
        match request(&self.shared, &self.member, &mut link, msg, expected) {
            Ok(ToParent::Failed { error }) => {
                // Peers may wait on this rank inside a collective: let them go.
                self.shared.abort_epoch();
                Err(ComputeError::from(error).context(format_args!("rank {} (worker {})", self.rank, self.member.id)))
            }
            Ok(reply) => Ok((reply, link)),
            Err(_) => {
                let why = relock(&self.shared.losses).iter().rev().find(|l| l.id == self.member.id).map(|l| l.why.clone());
                let why = why.unwrap_or_else(|| format!("rank {} (worker {}) was lost", self.rank, self.member.id));
                Err(ComputeError::Lost { rank: Some(self.rank), why })
            }
        }
    }
}

impl WorkerCompute for ElasticCompute {
    fn prepare(&mut self, order: &StepOrder) -> Result<Prepared, ComputeError> {
        match self.call(&ToWorker::prepare(order), "Prepared")? {
            (ToParent::Prepared { prepared, snapshot }, mut link) => {
                link.snapshot = snapshot;
                Ok(prepared.prepared())
            }
            (other, _) => Err(ComputeError::failed(format!("rank {} answered Prepare with {other:?}", self.rank))),
        }
    }

    fn commit(&mut self, step: u64) -> Result<(), ComputeError> {
        match self.call(&ToWorker::Commit { step }, "Committed")? {
            (ToParent::Committed { snapshot }, mut link) => {
                link.snapshot = snapshot;
                Ok(())
            }
            (other, _) => Err(ComputeError::failed(format!("rank {} answered Commit with {other:?}", self.rank))),
        }
    }

    fn abandon(&mut self, step: u64) {
        if !self.shared.is_fenced(self.member.id) {
            let _ = self.call(&ToWorker::Abandon { step }, "Abandoned");
        }
    }

    fn memory(&self) -> MemoryReport {
        relock(&self.member.link).snapshot.memory.report(self.rank)
    }
}
