//! An epoch's formation and installation: every member of a new epoch gets its rank, the
//! addresses and its state, and joins the new mesh; a formation that stops half-way is settled;
//! the epoch is installed once its replicas got their first full copy ([`Installed`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use anyhow::Result;
use serde_json::json;
use tessera_actors::recovery::Layout;

use super::close::shutdown_and_wait;
use super::proxy::{recv_reply, Member};
use super::{relock, Fleet};
use crate::rendezvous::{node_name, send_start};
use crate::state::{FleetPlan, Start};
use crate::wire::{self, ToParent, ToWorker};

/// The newest epoch whose every member got its first full replica copy: a loss is restored
/// from what its members hold (their shards and replicas, kept until a newer epoch is
/// installed) until then.
pub(super) struct Installed<P> {
    pub(super) epoch: u64,
    pub(super) plan: Arc<P>,
    /// The members' ids in rank order.
    ids: Vec<u64>,
}

// Not derived: that would ask `P: Clone`, and the plan is shared, not copied.
impl<P> Clone for Installed<P> {
    fn clone(&self) -> Self {
        Installed { epoch: self.epoch, plan: Arc::clone(&self.plan), ids: self.ids.clone() }
    }
}

impl<P: FleetPlan> Installed<P> {
    /// The layout the state is read in at a recovery ([`tessera_actors::recovery::choose_source`]).
    pub(super) fn layout(&self) -> Layout<'_, u64> {
        Layout { epoch: self.epoch, members: &self.ids, world: self.plan.world(), sharded: self.plan.sharded() }
    }
}

impl<P: FleetPlan> Fleet<P> {
    /// Recovery's step 4: forms epoch `epoch` of `next` (in rank order) under `plan`, from
    /// `start`: each member gets `Epoch` and answers with its new QUIC address, then the
    /// addresses, node names and its cut of the state, and says `Ready` once it joined the new
    /// mesh. Returns whether every member did; when one was lost, the formation that stopped
    /// half-way is settled first ([`Fleet::settle_epoch`]), and an answer out of protocol is
    /// an error.
    pub(super) fn form_epoch(&self, next: &[Arc<Member>], epoch: u64, plan: &P, start: &Start) -> Result<bool> {
        self.shared.epoch.store(epoch, Ordering::SeqCst);
        *relock(&self.shared.members) = next.iter().map(|m| m.id).collect();
        // Members that answered `Epoch` owe a final `Ready`/`Failed` (`true` once sent the
        // addresses); if the formation stops half-way those answers are settled before anything
        // else is asked of them.
        let mut owing: Vec<(Arc<Member>, bool)> = Vec::with_capacity(next.len());
        let Some(addrs) = self.ask_epoch(next, epoch, &mut owing)? else { return Ok(false) };
        if !self.send_mesh_and_state(next, addrs, plan, start, &mut owing) {
            return Ok(false);
        }
        self.await_ready(next, epoch, &owing)
    }

    /// Asks each member of `next` to start epoch `epoch` (it leaves the old group and binds a
    /// fresh QUIC socket); each that answers is added to `owing`, not yet sent the addresses.
    /// Returns the members' new addresses in rank order; `Ok(None)` when one was lost.
    fn ask_epoch(&self, next: &[Arc<Member>], epoch: u64, owing: &mut Vec<(Arc<Member>, bool)>) -> Result<Option<Vec<String>>> {
        let world = next.len();
        let mut addrs = Vec::with_capacity(world);
        for (r, m) in next.iter().enumerate() {
            let mut link = relock(&m.link);
            let installed = self.installed.as_ref().map(|i| i.epoch);
            let msg = ToWorker::Epoch { epoch, rank: r as u64, world: world as u64, installed };
            let failed = match self.request(m, &mut link, &msg, "EpochAddr") {
                Ok(ToParent::EpochAddr { quic_addr }) => {
                    addrs.push(quic_addr);
                    owing.push((Arc::clone(m), false));
                    continue;
                }
                Ok(ToParent::Failed { error }) => {
                    self.shared.loss(m.id, &format!("worker {} could not start epoch {epoch}: {error}", m.id));
                    None
                }
                Ok(other) => Some(format!("worker {} answered Epoch with {other:?}", m.id)),
                Err(_) => None,
            };
            drop(link);
            self.settle_epoch(owing);
            return match failed {
                Some(e) => Err(anyhow::anyhow!(e)),
                None => Ok(None),
            };
        }
        Ok(Some(addrs))
    }

    /// Sends each member of `next` the new epoch's addresses, node names and its cut of
    /// `start` under `plan`, marking it in `owing` as sent the addresses. Returns whether every
    /// send went through; a member it failed for is lost.
    fn send_mesh_and_state(
        &self,
        next: &[Arc<Member>],
        addrs: Vec<String>,
        plan: &P,
        start: &Start,
        owing: &mut [(Arc<Member>, bool)],
    ) -> bool {
        let names: Vec<String> = next.iter().map(|m| node_name(m.id as usize)).collect();
        for (r, m) in next.iter().enumerate() {
            let mut link = relock(&m.link);
            let sent = wire::send(&mut link.stream, &ToWorker::Mesh { addrs: addrs.clone(), names: names.clone() })
                .map_err(anyhow::Error::from)
                .and_then(|()| send_start(&mut link.stream, plan, start, r));
            owing[r].1 = true;
            if let Err(e) = sent {
                self.shared.loss(m.id, &format!("worker {} (pid {}): sending its state: {e:#}", m.id, m.pid));
                drop(link);
                self.settle_epoch(owing);
                return false;
            }
        }
        true
    }

    /// Waits for each member of `next` to say `Ready` in epoch `epoch` (its mesh formed),
    /// keeping its snapshot. Returns whether all did; when one did not, the rest of `owing` is
    /// settled, and an answer out of protocol is an error.
    fn await_ready(&self, next: &[Arc<Member>], epoch: u64, owing: &[(Arc<Member>, bool)]) -> Result<bool> {
        for (k, m) in next.iter().enumerate() {
            let mut link = relock(&m.link);
            let failed = match recv_reply(&self.shared, m, &mut link, "Ready") {
                Ok(ToParent::Ready { snapshot }) => {
                    link.snapshot = snapshot;
                    continue;
                }
                Ok(ToParent::Failed { error }) => {
                    self.shared.loss(m.id, &format!("worker {} could not join epoch {epoch}: {error}", m.id));
                    None
                }
                Ok(other) => Some(format!("worker {} answered its epoch state with {other:?}", m.id)),
                Err(_) => None,
            };
            drop(link);
            self.settle_epoch(&owing[k + 1..]);
            return match failed {
                Some(e) => Err(anyhow::anyhow!(e)),
                None => Ok(false),
            };
        }
        Ok(true)
    }

    /// After an epoch formation that stopped half-way: each member in `owing` answered `Epoch`
    /// and still owes its final `Ready` or `Failed`. One not yet sent the addresses (`false`)
    /// is woken with a `Ping`, which ends its wait for them (it answers `Failed`); one that got
    /// them answers once its mesh forms or times out. Those answers are read and dropped, so
    /// the next request's reply is its own; a member that does not answer is lost.
    fn settle_epoch(&self, owing: &[(Arc<Member>, bool)]) {
        for (m, mesh_sent) in owing {
            if self.shared.is_fenced(m.id) {
                continue;
            }
            let mut link = relock(&m.link);
            if !mesh_sent {
                if let Err(e) = wire::send(&mut link.stream, &ToWorker::Ping) {
                    self.shared.loss(m.id, &format!("worker {} (pid {}): control connection: {e}", m.id, m.pid));
                    continue;
                }
            }
            // A lost member is recorded by `recv_reply`; any answer is stale.
            let _ = recv_reply(&self.shared, m, &mut link, "the abandoned epoch's answer");
        }
    }

    /// Marks the current epoch installed (every member holds its first full replica copy):
    /// members drop what they kept of the epoch before, and draining workers leave (exit
    /// status 0). Returns how many left. A member lost meanwhile is recovered from at the next
    /// step boundary, from this epoch.
    pub(super) fn install(&mut self) -> usize {
        let ids = self.members.iter().map(|m| m.id).collect();
        self.installed = Some(Installed { epoch: self.epoch, plan: Arc::clone(&self.plan), ids });
        self.shared.event(json!({"event": "installed", "epoch": self.epoch}));
        for m in &self.members {
            let mut link = relock(&m.link);
            match self.request(m, &mut link, &ToWorker::Installed { epoch: self.epoch }, "Installed") {
                Ok(ToParent::Installed) | Err(_) => {}
                Ok(other) => self.shared.loss(m.id, &format!("worker {} answered Installed with {other:?}", m.id)),
            }
        }
        let leavers = std::mem::take(&mut self.leavers);
        for d in &leavers {
            if self.shared.is_fenced(d.id) {
                continue;
            }
            let conn = relock(&d.link).stream.clone();
            let status = shutdown_and_wait(&self.shared, d.id, conn);
            tracing::info!("elastic: worker {} drained and left ({status})", d.id);
            self.shared.event(json!({"event": "drained", "id": d.id, "pid": d.pid, "exit": status.to_string()}));
        }
        leavers.iter().filter(|d| !self.shared.is_fenced(d.id)).count()
    }
}
