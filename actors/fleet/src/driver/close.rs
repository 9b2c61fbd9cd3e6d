//! How a fleet ends: every worker asked to leave and waited for (bounded), or, when the fleet
//! is dropped, its children killed and its connections aborted.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use tessera_actors::liveness::Exit;
use tessera_transport::quic::ControlConn;

use super::{relock, Fleet, Joiner, Shared, MONITOR_POLL_MS};
use crate::rendezvous::EXIT_TIMEOUT_MS;
use crate::state::FleetPlan;
use crate::wire::{self, ToWorker};

impl<P: FleetPlan> Fleet<P> {
    /// Asks every member (and waiting joiner) to leave and waits (bounded) for each to end
    /// cleanly.
    pub fn close(mut self) -> Result<()> {
        self.shared.closing.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        let mut failures = Vec::new();
        let joiners: Vec<Joiner> = std::mem::take(&mut *relock(&self.shared.joiners));
        for mut j in joiners {
            let _ = wire::send(&mut j.conn, &ToWorker::Shutdown);
        }
        for m in self.admitted.iter().chain(&self.leavers) {
            let _ = wire::send(&mut relock(&m.link).stream, &ToWorker::Shutdown);
        }
        let members: Vec<(u64, ControlConn)> = self.members.iter().map(|m| (m.id, relock(&m.link).stream.clone())).collect();
        for (id, conn) in &members {
            relock(&self.shared.leaving).insert(*id);
            let _ = wire::send(&mut conn.clone(), &ToWorker::Shutdown);
        }
        for (id, conn) in members {
            let exit = wait_exit(&self.shared, id, &conn);
            if !exit.is_clean() {
                failures.push(format!("worker {id}: {exit}"));
            }
        }
        if !failures.is_empty() {
            bail!("the workers did not leave cleanly: {}", failures.join("; "));
        }
        Ok(())
    }
}

/// Tells worker `id` to leave (its exit is then not a loss) and waits for it (see [`wait_exit`]).
pub(super) fn shutdown_and_wait(shared: &Shared, id: u64, mut conn: ControlConn) -> Exit {
    relock(&shared.leaving).insert(id);
    relock(&shared.beats).remove(&id);
    let _ = wire::send(&mut conn, &ToWorker::Shutdown);
    wait_exit(shared, id, &conn)
}

/// Waits (bounded) for worker `id` to end: its exit status when spawned, else its control
/// connection `conn` closing ([`Exit::Left`]).
fn wait_exit(shared: &Shared, id: u64, conn: &ControlConn) -> Exit {
    let deadline = Instant::now() + Duration::from_millis(EXIT_TIMEOUT_MS);
    let mut children = relock(&shared.children);
    let Some((_, c)) = children.iter_mut().find(|(cid, _)| *cid == id) else {
        drop(children);
        while !conn.is_closed() {
            if Instant::now() >= deadline {
                conn.abort("did not leave in time");
                return Exit::Overdue { bound_ms: EXIT_TIMEOUT_MS, killed: false };
            }
            std::thread::sleep(Duration::from_millis(MONITOR_POLL_MS));
        }
        return Exit::Left;
    };
    loop {
        match c.try_wait() {
            Ok(Some(s)) => return Exit::of(s),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(MONITOR_POLL_MS)),
            _ => {
                let _ = c.kill();
                let _ = c.wait();
                return Exit::Overdue { bound_ms: EXIT_TIMEOUT_MS, killed: true };
            }
        }
    }
}

impl<P: FleetPlan> Drop for Fleet<P> {
    fn drop(&mut self) {
        self.shared.closing.store(true, Ordering::SeqCst);
        for (_, c) in relock(&self.shared.children).iter_mut() {
            if let Ok(None) = c.try_wait() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        // Agents and joiners whose connections close leave on their own.
        for c in relock(&self.shared.controls).values().chain(relock(&self.shared.sides).values()) {
            c.abort("the run is stopping");
        }
        drop(self.endpoint.take());
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}
