//! The fleet's entries in `<output>/elastic_events.jsonl` ([`super::EVENTS_FILE`]): epochs,
//! committed steps, checkpoints, resumptions.

use std::path::Path;
use std::sync::Arc;

use serde_json::json;

use super::Fleet;
use crate::state::FleetPlan;

impl<P: FleetPlan> Fleet<P> {
    pub(super) fn log_epoch(&self, step: u64, source: &str) {
        let members: Vec<_> = self.members.iter().enumerate().map(|(r, m)| json!({"rank": r, "id": m.id, "pid": m.pid})).collect();
        self.shared.event(
            json!({"event": "epoch", "epoch": self.epoch, "step": step, "world": self.members.len(), "members": members, "source": source}),
        );
    }

    /// Writes one event (`{"event": …}` plus the time) to `<output>/elastic_events.jsonl`;
    /// the sink outlives borrows of the fleet (a recovery's checkpoint loader logs through it).
    pub fn event_sink(&self) -> impl Fn(serde_json::Value) + 'static {
        let shared = Arc::clone(&self.shared);
        move |v| shared.event(v)
    }

    /// Records a committed step in the event log.
    pub fn committed(&self, step: u64) {
        self.shared.event(json!({"event": "step", "step": step, "epoch": self.epoch, "world": self.members.len()}));
    }

    /// Records a checkpoint written (`Ok(path)`) or not (`Err(why)`) at `step` committed steps.
    pub fn checkpointed(&self, step: u64, saved: Result<&Path, String>) {
        self.shared.event(match saved {
            Ok(path) => json!({"event": "checkpoint", "step": step, "path": path.display().to_string()}),
            Err(error) => json!({"event": "checkpoint_failed", "step": step, "error": error}),
        });
    }

    /// Logs that training runs again after a recovery that began at `began_ms`.
    pub fn resumed(&self, began_ms: u64, step: u64) {
        self.shared.event(json!({"event": "resumed", "step": step, "epoch": self.epoch, "began_ms": began_ms}));
    }
}
