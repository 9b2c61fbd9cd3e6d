//! The elastic driver's failure detection (its monitor thread, `actors/fleet/src/driver/monitor.rs`) as a
//! sans-IO state machine: which workers are watched, what makes one lost, and the reason it is
//! declared lost with.
//!
//! No IO, no clock, no threads. The monitor polls every `MONITOR_POLL_MS`: it feeds
//! [`Liveness::on`] what it sees — the workers whose side connection or join registered them
//! ([`Input::Watch`], with the time of their latest heartbeat as [`Input::Heartbeat`]), side
//! connections closed, processes ended (its spawned children, and processes of its host watched
//! through a pidfd), the ids told to leave and the ids fenced — and then [`Input::Tick`] with the
//! current time, and carries out each [`Action::Lost`] it answers (`Shared::loss`: fence, kill,
//! close the connections, abort the epoch's group). Feeding the same observation again changes
//! nothing, so the monitor feeds everything it sees at every poll. Times are milliseconds on
//! any one clock; inputs need not come in time order (the latest heartbeat counts).
//! `liveness_sim` drives it over thousands of seeded worlds.
//!
//! # The rules
//! - A worker is watched from its [`Input::Watch`] on; heartbeats are due from then (the driver
//!   registers a first-epoch worker once it is `Ready`, a joiner when it joins or opens its side
//!   connection).
//! - At each [`Input::Tick`] a watched worker is lost when, in this order: its process ended
//!   ("worker {id} (pid {pid}): the process {how}", `how` the [`Exit`] the driver saw, e.g.
//!   "was killed by signal 9", or "ended" for a pidfd), its side connection closed ("worker {id} (pid {pid}): its side
//!   connection closed"), or its latest heartbeat is more than `timeout_ms` old ("worker {id}
//!   (pid {pid}): no heartbeat for {quiet} ms (hung, stopped or cut off)"; exactly
//!   `timeout_ms` is not yet lost). Workers are looked at in id order.
//! - Each loss is answered once: a worker declared lost is fenced.
//! - A worker told to leave ([`Input::Leaving`]: drained, or the run closing) is never
//!   declared lost: its exit, its closed connection and its silence are expected. Asking to
//!   drain (SIGTERM) changes nothing here: a draining worker is watched like any other until
//!   the driver tells it to leave.
//! - A fenced id ([`Input::Fenced`]: declared lost by another path — a request that timed out
//!   after `step_timeout_ms` or failed, a dead actor, a failed admission — or by this machine)
//!   is never reported and never watched again, whatever arrives for it later (a late
//!   heartbeat, a reconnecting side connection, its exit after the kill).
//! - Inputs about an id never watched are ignored.
//!
//! Request timeouts (`step_timeout_ms`) are not measured here: the thread waiting for a reply
//! has the deadline and declares the loss itself; this machine learns it as a fenced id.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

/// How a worker's process ended, as the driver saw it; its sentence finishes "the process …"
/// ("exited with status 1", "was killed by signal 9", "ended").
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Exit {
    /// It exited with this status.
    Code(i32),
    /// A signal ended it.
    Signal(i32),
    /// It had asked to drain (SIGTERM) and exited with status `code` because no step boundary
    /// came within its drain grace (`tessera.elastic.drain_grace_ms` = `grace_ms`).
    DrainGrace { code: i32, grace_ms: u64 },
    /// Its pidfd says it ended (a process of this host that is not the driver's child: how is
    /// not known).
    Ended,
    /// Not a process the driver can watch: its control connection closed.
    Left,
    /// It did not end within `bound_ms` of being told to leave; `killed` when it was then
    /// killed (a child), else its connection was dropped.
    Overdue { bound_ms: u64, killed: bool },
    /// Anything else the OS reports.
    Other(String),
}

impl Exit {
    /// A process's exit status.
    pub fn of(status: std::process::ExitStatus) -> Exit {
        use std::os::unix::process::ExitStatusExt;
        match (status.code(), status.signal()) {
            (Some(c), _) => Exit::Code(c),
            (None, Some(s)) => Exit::Signal(s),
            _ => Exit::Other(status.to_string()),
        }
    }

    /// Whether a worker told to leave left as it should: status 0, or its connection closed.
    pub fn is_clean(&self) -> bool {
        matches!(self, Exit::Code(0) | Exit::Left)
    }
}

impl fmt::Display for Exit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Exit::Code(c) => write!(f, "exited with status {c}"),
            Exit::Signal(s) => write!(f, "was killed by signal {s}"),
            Exit::DrainGrace { code, grace_ms } => write!(
                f,
                "exited with status {code}: it was asked to drain (SIGTERM or SIGUSR1) and no step boundary came within its drain grace \
                 (tessera.elastic.drain_grace_ms = {grace_ms})"
            ),
            Exit::Ended => write!(f, "ended"),
            Exit::Left => write!(f, "left"),
            Exit::Overdue { bound_ms, killed: true } => write!(f, "did not exit within {bound_ms} ms (killed)"),
            Exit::Overdue { bound_ms, killed: false } => write!(f, "did not leave within {bound_ms} ms"),
            Exit::Other(how) => write!(f, "ended ({how})"),
        }
    }
}

/// What the driver saw, fed with the time it happened (or was seen) in ms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    /// Worker `id` (process `pid`, 0 while not known) is registered: watched from now on, a
    /// heartbeat due within the timeout. Again for a watched worker: its pid (a joiner's,
    /// learnt after its side connection registered it), nothing else.
    Watch { id: u64, pid: u32 },
    /// A heartbeat of `id` arrived (the newest counts).
    Heartbeat { id: u64 },
    /// The side connection of `id` closed.
    Closed { id: u64 },
    /// The process of `id` (`pid`) ended, `how` as the driver saw it.
    Exited { id: u64, pid: u32, how: Exit },
    /// The driver told `id` to leave: never lost from now on.
    Leaving { id: u64 },
    /// `id` is fenced (declared lost elsewhere): never reported, never watched again.
    Fenced { id: u64 },
    /// A poll: report the watched workers that are lost now.
    Tick,
}

/// What the driver must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Declare `id` lost (fence it, kill it, abort the epoch), with `why` in the log.
    Lost { id: u64, why: String },
}

/// What is known of one watched worker.
#[derive(Debug, Clone)]
struct Watched {
    pid: u32,
    /// When its latest heartbeat arrived (or it was registered).
    last: u64,
    closed: bool,
    /// Its process ended: the pid and how.
    exited: Option<(u32, Exit)>,
}

/// The failure detector (see the module doc).
#[derive(Debug, Clone)]
pub struct Liveness {
    timeout_ms: u64,
    watched: BTreeMap<u64, Watched>,
    leaving: BTreeSet<u64>,
    fenced: BTreeSet<u64>,
}

impl Liveness {
    /// A detector that declares a worker lost after more than `timeout_ms` without a heartbeat
    /// (`tessera.elastic.heartbeat_timeout_ms`).
    pub fn new(timeout_ms: u64) -> Liveness {
        Liveness { timeout_ms, watched: BTreeMap::new(), leaving: BTreeSet::new(), fenced: BTreeSet::new() }
    }

    /// Feeds what happened at `now_ms`; answers the losses to carry out (only a tick has any).
    pub fn on(&mut self, now_ms: u64, input: Input) -> Vec<Action> {
        match input {
            Input::Watch { id, pid } => {
                if !self.fenced.contains(&id) && !self.leaving.contains(&id) {
                    self.watched.entry(id).or_insert(Watched { pid, last: now_ms, closed: false, exited: None }).pid = pid;
                }
            }
            Input::Heartbeat { id } => {
                if let Some(w) = self.watched.get_mut(&id) {
                    w.last = w.last.max(now_ms);
                }
            }
            Input::Closed { id } => {
                if let Some(w) = self.watched.get_mut(&id) {
                    w.closed = true;
                }
            }
            Input::Exited { id, pid, how } => {
                if let Some(w) = self.watched.get_mut(&id) {
                    w.exited.get_or_insert((pid, how));
                }
            }
            Input::Leaving { id } => {
                if !self.fenced.contains(&id) {
                    self.leaving.insert(id);
                    self.watched.remove(&id);
                }
            }
            Input::Fenced { id } => {
                self.fenced.insert(id);
                self.watched.remove(&id);
            }
            Input::Tick => return self.tick(now_ms),
        }
        Vec::new()
    }

    fn tick(&mut self, now: u64) -> Vec<Action> {
        let lost: Vec<Action> = self
            .watched
            .iter()
            .filter_map(|(&id, w)| {
                let why = if let Some((pid, how)) = &w.exited {
                    format!("worker {id} (pid {pid}): the process {how}")
                } else if w.closed {
                    format!("worker {id} (pid {}): its side connection closed", w.pid)
                } else {
                    let quiet = now.saturating_sub(w.last);
                    if quiet <= self.timeout_ms {
                        return None;
                    }
                    format!("worker {id} (pid {}): no heartbeat for {quiet} ms (hung, stopped or cut off)", w.pid)
                };
                Some(Action::Lost { id, why })
            })
            .collect();
        for Action::Lost { id, .. } in &lost {
            self.watched.remove(id);
            self.fenced.insert(*id);
        }
        lost
    }

    /// Whether `id` is fenced (declared lost, here or elsewhere).
    #[cfg(test)]
    pub fn is_fenced(&self, id: u64) -> bool {
        self.fenced.contains(&id)
    }

    /// Whether `id` is watched now (registered, neither leaving nor fenced).
    #[cfg(test)]
    pub fn is_watched(&self, id: u64) -> bool {
        self.watched.contains_key(&id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: u64 = 1_000;

    fn lost(actions: &[Action]) -> Vec<(u64, &str)> {
        actions.iter().map(|Action::Lost { id, why }| (*id, why.as_str())).collect()
    }

    fn watched(ids: &[u64]) -> Liveness {
        let mut m = Liveness::new(T);
        for &id in ids {
            m.on(0, Input::Watch { id, pid: 100 + id as u32 });
        }
        m
    }

    /// The exit's sentence is the reason's words, and only status 0 or a connection that
    /// closed is a clean leave (`Fleet::close`).
    #[test]
    fn an_exit_reads_as_before_and_only_status_0_or_a_closed_connection_is_clean() {
        use std::os::unix::process::ExitStatusExt;
        let status = |raw: i32| Exit::of(std::process::ExitStatus::from_raw(raw));
        assert_eq!((status(0), status(1 << 8), status(9)), (Exit::Code(0), Exit::Code(1), Exit::Signal(9)));
        let said: Vec<String> = [
            Exit::Code(1),
            Exit::Signal(9),
            Exit::Ended,
            Exit::Left,
            Exit::Overdue { bound_ms: 5, killed: true },
            Exit::Overdue { bound_ms: 5, killed: false },
        ]
        .iter()
        .map(Exit::to_string)
        .collect();
        let want = [
            "exited with status 1",
            "was killed by signal 9",
            "ended",
            "left",
            "did not exit within 5 ms (killed)",
            "did not leave within 5 ms",
        ];
        assert_eq!(said, want);
        let grace = Exit::DrainGrace { code: 3, grace_ms: 300 };
        assert_eq!(
            grace.to_string(),
            "exited with status 3: it was asked to drain (SIGTERM or SIGUSR1) and no step boundary came within its drain grace (tessera.elastic.drain_grace_ms = 300)"
        );
        let clean: Vec<bool> =
            [Exit::Code(0), Exit::Left, Exit::Code(1), Exit::Signal(15), Exit::Ended, grace, Exit::Overdue { bound_ms: 5, killed: false }]
                .iter()
                .map(Exit::is_clean)
                .collect();
        assert_eq!(clean, [true, true, false, false, false, false, false]);
    }

    #[test]
    fn exactly_the_timeout_is_not_lost_one_more_ms_is() {
        let mut m = watched(&[0]);
        m.on(500, Input::Heartbeat { id: 0 });
        assert!(m.on(1_500, Input::Tick).is_empty(), "quiet == timeout is not a loss");
        let got = m.on(1_501, Input::Tick);
        assert_eq!(lost(&got), [(0, "worker 0 (pid 100): no heartbeat for 1001 ms (hung, stopped or cut off)")]);
        assert!(m.is_fenced(0) && !m.is_watched(0));
    }

    #[test]
    fn quiet_past_the_timeout_reports_how_long() {
        let mut m = watched(&[3]);
        let got = m.on(4_321, Input::Tick);
        assert_eq!(lost(&got), [(3, "worker 3 (pid 103): no heartbeat for 4321 ms (hung, stopped or cut off)")]);
    }

    #[test]
    fn heartbeats_keep_a_worker_and_an_older_one_changes_nothing() {
        let mut m = watched(&[0]);
        for t in (100..=5_000).step_by(100) {
            m.on(t, Input::Heartbeat { id: 0 });
            assert!(m.on(t + 999, Input::Tick).is_empty());
        }
        // The monitor feeds the latest heartbeat again at every poll, and a poll may see an
        // older one: the newest counts.
        m.on(4_000, Input::Heartbeat { id: 0 });
        assert!(m.on(6_000, Input::Tick).is_empty());
        assert_eq!(m.on(6_001, Input::Tick).len(), 1);
    }

    #[test]
    fn heartbeats_are_due_from_registration() {
        let mut m = Liveness::new(T);
        assert!(m.on(0, Input::Tick).is_empty());
        m.on(5_000, Input::Watch { id: 7, pid: 0 });
        assert!(m.on(6_000, Input::Tick).is_empty());
        // Its pid learnt later; registering again neither resets nor restarts anything.
        m.on(6_000, Input::Watch { id: 7, pid: 42 });
        let got = m.on(6_001, Input::Tick);
        assert_eq!(lost(&got), [(7, "worker 7 (pid 42): no heartbeat for 1001 ms (hung, stopped or cut off)")]);
    }

    #[test]
    fn exit_before_closed_before_silence_each_reported_once() {
        let mut m = watched(&[0, 1, 2]);
        m.on(10, Input::Exited { id: 0, pid: 100, how: Exit::Signal(9) });
        m.on(10, Input::Closed { id: 0 });
        m.on(10, Input::Closed { id: 1 });
        m.on(11, Input::Exited { id: 2, pid: 102, how: Exit::Ended });
        m.on(12, Input::Exited { id: 2, pid: 102, how: Exit::Code(0) });
        let got = m.on(2_000, Input::Tick);
        assert_eq!(
            lost(&got),
            [
                (0, "worker 0 (pid 100): the process was killed by signal 9"),
                (1, "worker 1 (pid 101): its side connection closed"),
                (2, "worker 2 (pid 102): the process ended"),
            ]
        );
        // Everything about them from now on is ignored: no second report, no readmission.
        for id in 0..3 {
            m.on(2_001, Input::Watch { id, pid: 1 });
            m.on(2_001, Input::Heartbeat { id });
            m.on(2_001, Input::Closed { id });
            m.on(2_001, Input::Exited { id, pid: 1, how: Exit::Ended });
        }
        assert!(m.on(2_002, Input::Tick).is_empty());
        assert!(m.on(99_999, Input::Tick).is_empty());
        assert!((0..3).all(|id| m.is_fenced(id) && !m.is_watched(id)));
    }

    #[test]
    fn a_lost_worker_is_reported_at_the_tick_only() {
        let mut m = watched(&[0]);
        assert!(m.on(5, Input::Exited { id: 0, pid: 100, how: Exit::Code(1) }).is_empty());
        assert!(m.on(5, Input::Closed { id: 0 }).is_empty());
        assert_eq!(m.on(10, Input::Tick).len(), 1);
    }

    #[test]
    fn leaving_workers_are_never_lost() {
        let mut m = watched(&[0, 1]);
        m.on(100, Input::Leaving { id: 0 });
        m.on(100, Input::Exited { id: 0, pid: 100, how: Exit::Code(0) });
        m.on(100, Input::Closed { id: 0 });
        // The run closing: leaving first, the exit seen in the same poll.
        m.on(200, Input::Exited { id: 1, pid: 101, how: Exit::Code(0) });
        m.on(200, Input::Leaving { id: 1 });
        m.on(200, Input::Watch { id: 1, pid: 101 });
        assert!(m.on(200, Input::Tick).is_empty());
        assert!(m.on(50_000, Input::Tick).is_empty());
        assert!(!m.is_fenced(0) && !m.is_watched(0));
    }

    #[test]
    fn a_draining_worker_is_watched_until_it_leaves() {
        // SIGTERM is no input: a draining worker that dies before it is told to leave is lost.
        let mut m = watched(&[0]);
        m.on(900, Input::Heartbeat { id: 0 });
        m.on(950, Input::Exited { id: 0, pid: 100, how: Exit::Code(0) });
        assert_eq!(lost(&m.on(960, Input::Tick)), [(0, "worker 0 (pid 100): the process exited with status 0")]);
        // Told to leave after it was lost: still fenced, not readmitted.
        m.on(970, Input::Leaving { id: 0 });
        m.on(970, Input::Watch { id: 0, pid: 100 });
        assert!(m.is_fenced(0) && !m.is_watched(0));
    }

    #[test]
    fn fenced_elsewhere_is_never_reported_nor_readmitted() {
        let mut m = watched(&[0, 1]);
        m.on(10, Input::Fenced { id: 1 });
        m.on(20, Input::Heartbeat { id: 1 });
        m.on(20, Input::Watch { id: 1, pid: 9 });
        m.on(20, Input::Closed { id: 1 });
        m.on(20, Input::Heartbeat { id: 0 });
        let got = m.on(1_500, Input::Tick);
        assert_eq!(lost(&got), [(0, "worker 0 (pid 100): no heartbeat for 1480 ms (hung, stopped or cut off)")]);
        // Fenced before it ever registered: never watched.
        m.on(0, Input::Fenced { id: 5 });
        m.on(1_600, Input::Watch { id: 5, pid: 1 });
        assert!(!m.is_watched(5));
        assert!(m.on(9_000, Input::Tick).is_empty());
    }

    #[test]
    fn inputs_for_ids_never_watched_are_ignored() {
        let mut m = Liveness::new(T);
        m.on(0, Input::Heartbeat { id: 4 });
        m.on(0, Input::Closed { id: 4 });
        m.on(0, Input::Exited { id: 4, pid: 1, how: Exit::Ended });
        assert!(m.on(10_000, Input::Tick).is_empty());
        // Registering later starts from its registration, not from what came before.
        m.on(10_000, Input::Watch { id: 4, pid: 1 });
        assert!(m.on(10_500, Input::Tick).is_empty());
    }

    #[test]
    fn a_heartbeat_newer_than_the_tick_is_not_negative_quiet() {
        let mut m = watched(&[0]);
        m.on(2_000, Input::Heartbeat { id: 0 });
        assert!(m.on(1_990, Input::Tick).is_empty());
    }
}
