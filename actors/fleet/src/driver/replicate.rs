//! Replicas: full copies of every rank's shard to its ring successors, and the members whose
//! replicas need one again.

use std::sync::MutexGuard;

use anyhow::{bail, Result};
use serde_json::json;

use super::proxy::{recv_reply, Link};
use super::{relock, Fleet};
use crate::state::FleetPlan;
use crate::wire::{self, Snapshot, ToParent, ToWorker};

impl<P: FleetPlan> Fleet<P> {
    /// Ids of the members whose latest snapshot says they dropped a replica (first), and of
    /// those whose replicas wait for more updates than they apply (second).
    pub fn stale_replicas(&self) -> (Vec<u64>, Vec<u64>) {
        let snaps: Vec<(u64, Snapshot)> = self.members.iter().map(|m| (m.id, relock(&m.link).snapshot)).collect();
        let ids = |f: fn(&Snapshot) -> bool| snaps.iter().filter(|(_, s)| f(s)).map(|(id, _)| *id).collect();
        (ids(|s| s.replica_stale), ids(|s| s.replica_behind && !s.replica_stale))
    }

    /// Logs that full copies follow at `step`: members `dropped` dropped a replica, members
    /// `behind` had not applied the recent updates.
    pub fn replicas_recopied(&self, step: u64, dropped: &[u64], behind: &[u64]) {
        if !dropped.is_empty() {
            tracing::info!("elastic: worker(s) {dropped:?} dropped a replica (see their log); full copies at step {step}");
        }
        self.shared.event(json!({"event": "replicas_recopied", "step": step, "epoch": self.epoch, "dropped": dropped, "behind": behind}));
    }

    /// A full copy of the replicas at `step` committed steps (when an epoch forms, or after a
    /// member dropped a replica): every rank sends its shard to its ring successors. Between
    /// full copies the replicas follow the owners' gradients. Fails when a member is lost or
    /// refuses.
    pub fn replicate(&self, step: u64) -> Result<()> {
        let mut links: Vec<MutexGuard<'_, Link>> = self.members.iter().map(|m| relock(&m.link)).collect();
        for (m, link) in self.members.iter().zip(links.iter_mut()) {
            if let Err(e) = wire::send(&mut link.stream, &ToWorker::Replicate { step }) {
                self.shared.loss(m.id, &format!("worker {} (pid {}): sending Replicate: {e}", m.id, m.pid));
                bail!("replicating step {step}: worker {} lost", m.id);
            }
        }
        let mut errors = Vec::new();
        for (m, link) in self.members.iter().zip(links.iter_mut()) {
            match recv_reply(&self.shared, m, link, "Replicated") {
                Ok(ToParent::Replicated) => {}
                Ok(ToParent::Failed { error }) => {
                    self.shared.abort_epoch();
                    errors.push(format!("worker {}: {error}", m.id));
                }
                Ok(other) => errors.push(format!("worker {} answered Replicate with {other:?}", m.id)),
                Err(_) => errors.push(format!("worker {} lost", m.id)),
            }
        }
        match errors.is_empty() {
            true => Ok(()),
            false => bail!("replicating the shards of step {step}: {}", errors.join("; ")),
        }
    }
}
