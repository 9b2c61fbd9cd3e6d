//! Detection: the monitor thread (see the module doc's "Detection"), how a spawned worker's
//! exit reads, and the fleet's side of losses the actor tree reports (`stop_actor`, dead
//! DeviceWorker actors) and of the first loss of a run without recovery.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tessera_actors::liveness::{self, Exit, Liveness};
use tessera_actors::WorkerStopper;

use super::{relock, Beat, Fleet, Shared, MONITOR_POLL_MS};
use crate::join::Pidfd;
use crate::state::FleetPlan;
use crate::wire::EXIT_DRAIN_GRACE;

/// Watches exits and heartbeats (see the module doc): each poll feeds the failure detector
/// ([`Liveness`]) what it sees and declares lost whom it answers.
pub(super) fn monitor(shared: Arc<Shared>) {
    use liveness::{Action, Input};
    let mut detector = Liveness::new(shared.er.heartbeat_timeout_ms);
    let clock = shared.clock;
    let ms = |t: Instant| t.saturating_duration_since(clock).as_millis() as u64;
    while !shared.closing.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(MONITOR_POLL_MS));
        let leaving = relock(&shared.leaving).clone();
        let fenced = relock(&shared.fenced).clone();
        let now = ms(Instant::now());
        for &id in &leaving {
            detector.on(now, Input::Leaving { id });
        }
        for &id in &fenced {
            detector.on(now, Input::Fenced { id });
        }
        // Registered workers first: a child's exit counts only for a watched worker.
        let beats: Vec<(u64, Arc<Beat>)> = relock(&shared.beats).iter().map(|(id, b)| (*id, Arc::clone(b))).collect();
        for (id, b) in beats {
            let last = ms(*relock(&b.last));
            detector.on(last, Input::Watch { id, pid: b.pid() });
            detector.on(last, Input::Heartbeat { id });
            if relock(&b.local).as_ref().is_some_and(Pidfd::exited) {
                detector.on(now, Input::Exited { id, pid: b.pid(), how: Exit::Ended });
            }
            if b.closed.load(Ordering::SeqCst) {
                detector.on(now, Input::Closed { id });
            }
        }
        for (id, c) in relock(&shared.children).iter_mut().filter(|(id, _)| !leaving.contains(id) && !fenced.contains(id)) {
            if let Some(status) = c.try_wait().ok().flatten() {
                let how = worker_exit(status, shared.draining(*id), shared.er.drain_grace_ms);
                detector.on(now, Input::Exited { id: *id, pid: c.id(), how });
            }
        }
        for Action::Lost { id, why } in detector.on(ms(Instant::now()), Input::Tick) {
            if !shared.closing.load(Ordering::SeqCst) {
                shared.loss(id, &why);
            }
        }
        if let Some(rank) = shared.faults.take_stop_actor() {
            let id = relock(&shared.members).get(rank).copied();
            let stopped = relock(&shared.stopper).as_ref().is_some_and(|s| s.stop(rank, "stopped by the chaos fault stop_actor"));
            tracing::info!("elastic: stop_actor: rank {rank}'s actor {}", if stopped { "asked to stop" } else { "not found" });
            shared.event(json!({"event": "actor_stop", "rank": rank, "id": id, "stopped": stopped}));
        }
    }
}

/// How a spawned worker's process ended, for the reason of its loss: a worker that asked to
/// drain and exited with [`EXIT_DRAIN_GRACE`] left because no step boundary came within its
/// drain grace, which the reason then says (its own line on stderr says it too).
fn worker_exit(status: std::process::ExitStatus, draining: bool, grace_ms: u64) -> Exit {
    match (draining, Exit::of(status)) {
        (true, Exit::Code(EXIT_DRAIN_GRACE)) => Exit::DrainGrace { code: EXIT_DRAIN_GRACE, grace_ms },
        (_, exit) => exit,
    }
}

impl<P: FleetPlan> Fleet<P> {
    /// Gives the monitor thread the current epoch's actor tree, for the `stop_actor` fault.
    pub fn set_stopper(&self, stopper: Option<WorkerStopper>) {
        *relock(&self.shared.stopper) = stopper;
    }

    /// Members whose DeviceWorker actor died (`(rank, cause)`, as the actor tree reported them)
    /// are lost like members whose process died: fenced, killed and recovered from.
    pub fn lose_ranks(&self, ranks: &[(usize, String)]) {
        for (rank, cause) in ranks {
            if let Some(m) = self.members.get(*rank) {
                self.shared.loss(m.id, &format!("worker {} (rank {rank}): its actor died: {cause}", m.id));
            }
        }
    }

    /// The first loss, as a run without recovery ends on it: who the worker is (as the start
    /// named it: "worker process of rank 1 (pid 42)", "agent of rank 1 (…)") and how its process
    /// ended when it had, else why the failure detector declared it lost.
    pub fn first_loss(&self) -> Option<String> {
        let loss = relock(&self.shared.losses).first().cloned()?;
        let who = relock(&self.shared.names).get(&loss.id).cloned().unwrap_or_else(|| format!("worker {}", loss.id));
        Some(match loss.exit {
            Some(how) => format!("{who} {how}"),
            None => format!("{who} was lost: {}", loss.why),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;
    use std::process::ExitStatus;

    use super::*;

    /// Status 3 names the drain grace only for a worker that asked to drain; any other exit of
    /// a drainer, and status 3 of a worker that never asked, read as before.
    #[test]
    fn a_drainers_exit_with_status_3_names_the_drain_grace() {
        let exited = |code: i32| ExitStatus::from_raw(code << 8);
        assert_eq!(
            worker_exit(exited(EXIT_DRAIN_GRACE), true, 300).to_string(),
            "exited with status 3: it was asked to drain (SIGTERM or SIGUSR1) and no step boundary came within its drain grace \
             (tessera.elastic.drain_grace_ms = 300)"
        );
        assert_eq!(worker_exit(exited(EXIT_DRAIN_GRACE), false, 300), Exit::Code(3));
        assert_eq!(worker_exit(exited(4), true, 300).to_string(), "exited with status 4");
        assert_eq!(worker_exit(ExitStatus::from_raw(libc::SIGKILL), true, 300).to_string(), "was killed by signal 9");
    }
}
