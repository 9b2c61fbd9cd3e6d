//! Micro-batch blocks re-assigned by the members' measured speeds at a step boundary.

use std::sync::{Arc, MutexGuard};

use anyhow::{bail, Context, Result};
use serde_json::json;
use tessera_actors::compute::Prepared;

use super::proxy::{recv_reply, Link};
use super::{relock, tracing, Fleet};
use crate::state::{FleetPlan, Planner};
use crate::wire::{self, ToParent, ToWorker};

/// Steps a member is measured under the current blocks before they may change again; its
/// speed is their median (`tessera_actors::replan::Speeds`).
pub(super) const SPEED_WINDOW_STEPS: usize = 5;
/// The quiet period after a re-assignment whose promised gain did not come, and its bound
/// (it doubles with each such miss in a row; [`Rebalancer`]).
pub(super) const REBALANCE_QUIET_STEPS: u64 = 20;
pub(super) const REBALANCE_QUIET_MAX_STEPS: u64 = 640;

/// Micro-batch blocks re-assigned by measured speed at a step boundary.
pub struct Rebalanced<P> {
    pub plan: Arc<P>,
    /// Micro-batches per rank, before and after.
    pub before: Vec<usize>,
    pub after: Vec<usize>,
    /// Predicted compute of the slowest rank per step (ms), before and after.
    pub before_ms: f64,
    pub after_ms: f64,
}

impl<P: FleetPlan> Fleet<P> {
    /// A committed step's reports: each member's measured micro-batches and compute seconds.
    pub fn observe(&mut self, per_rank: &[Prepared]) {
        for (m, p) in self.members.iter().zip(per_rank) {
            if tracing() {
                eprintln!(
                    "[speed] worker {}: {} of {} micro-batches in {:.1} ms busy, prepare {:.1} ms",
                    m.id,
                    p.busy_micro_batches,
                    p.micro_batches,
                    p.busy_s * 1e3,
                    p.compute_s * 1e3
                );
            }
            self.speeds.observe(m.id, p.busy_micro_batches, p.busy_s);
        }
    }

    /// At a step boundary (`step` committed steps): when re-assigning the micro-batch blocks by
    /// the members' measured speeds shortens the predicted step by more than
    /// `tessera.elastic.rebalance_threshold`, every member takes the new blocks (the state
    /// partition stays; the bits do not change) — unless the last re-assignment's promised gain
    /// did not come, which starts a quiet period ([`Rebalancer`]). A member that cannot is lost
    /// (recovery forms an epoch with consistent plans); the error says so.
    pub fn rebalance(&mut self, step: u64, planner: &dyn Planner<P>) -> Result<Option<Rebalanced<P>>> {
        let ids: Vec<u64> = self.members.iter().map(|m| m.id).collect();
        let Some(speeds) = self.speeds.of(&ids) else { return Ok(None) };
        let before = self.plan.counts();
        let threshold = self.shared.er.rebalance_threshold;
        let Some(rb) = self.rebalancer.propose(step, self.plan.micro_batches(), &before, &speeds, threshold) else { return Ok(None) };
        let world = self.plan.world();
        let plan = Arc::new(planner.with_blocks(world, rb.blocks.clone()).with_context(|| format!("planning {world} ranks"))?);
        let blocks: Vec<Vec<(u64, u32)>> = rb.blocks.iter().map(|b| b.iter().map(|&(f, l)| (f as u64, l)).collect()).collect();
        let mut links: Vec<MutexGuard<'_, Link>> = self.members.iter().map(|m| relock(&m.link)).collect();
        for (m, link) in self.members.iter().zip(links.iter_mut()) {
            if let Err(e) = wire::send(&mut link.stream, &ToWorker::Blocks { blocks: blocks.clone() }) {
                self.shared.loss(m.id, &format!("worker {} (pid {}): sending new blocks: {e}", m.id, m.pid));
            }
        }
        let mut errors = Vec::new();
        for (m, link) in self.members.iter().zip(links.iter_mut()) {
            if self.shared.is_fenced(m.id) {
                errors.push(format!("worker {} lost", m.id));
                continue;
            }
            match recv_reply(&self.shared, m, link, "Rebalanced") {
                Ok(ToParent::Rebalanced) => {}
                Ok(other) => {
                    let why = format!("worker {} (pid {}) answered new blocks with {other:?}", m.id, m.pid);
                    self.shared.loss(m.id, &why);
                    errors.push(why);
                }
                Err(_) => errors.push(format!("worker {} lost", m.id)),
            }
        }
        drop(links);
        if !errors.is_empty() {
            bail!("re-assigning the micro-batch blocks at step {step}: {}", errors.join("; "));
        }
        self.plan = Arc::clone(&plan);
        self.speeds.restart();
        let r = Rebalanced { plan, before, after: rb.counts, before_ms: rb.before_s * 1e3, after_ms: rb.after_s * 1e3 };
        self.shared.event(json!({
            "event": "rebalance", "step": step, "epoch": self.epoch, "ids": ids,
            "micro_batches_before": r.before, "micro_batches": r.after,
            "speeds": speeds.iter().map(|s| (s * 100.0).round() / 100.0).collect::<Vec<_>>(),
            "predicted_ms_before": (r.before_ms * 10.0).round() / 10.0, "predicted_ms": (r.after_ms * 10.0).round() / 10.0,
        }));
        Ok(Some(r))
    }
}
