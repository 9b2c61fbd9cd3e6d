//! The timing rules of joins and drains, as sans-IO machines fed the time in ms: the elastic
//! driver's wait for the members of a new epoch ([`FormMembers`], run by `Fleet::reconfigure` in
//! `actors/fleet/src/driver/recover.rs`) and a worker's drain timer after SIGTERM ([`DrainTimer`], run by the
//! heartbeat thread of `src/engine/elastic_worker.rs`). `formation_sim` checks both over
//! thousands of seeded runs.

use crate::recovery::{next_members, NextMembers, Survivor};

/// What the driver does after a poll of [`FormMembers`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Formation<W> {
    /// The members of the new epoch in rank order; `draining` are the survivors that leave once
    /// it is installed.
    Formed { members: Vec<W>, draining: Vec<W> },
    /// Too few yet: wait (the driver polls again 100 ms later), printing `say` when given (the
    /// first wait only).
    Wait { say: Option<String> },
    /// Too few when `join_wait_ms` passed: the run fails with this message.
    Fail(String),
}

/// The members of a new epoch as they become known: the survivors (fixed at the step boundary),
/// then the admitted joiners in the order they came. At each [`FormMembers::poll`] the fenced
/// joiners are dropped and [`next_members`] asked; below `min_workers` it waits until
/// `join_wait_ms` after it started, saying so once, then fails.
#[derive(Debug, Clone)]
pub struct FormMembers<W> {
    survivors: Vec<Survivor<W>>,
    admitted: Vec<W>,
    min_workers: usize,
    max_workers: usize,
    join_wait_ms: u64,
    deadline_ms: u64,
    said: bool,
}

impl<W: Clone> FormMembers<W> {
    /// Starts at `now_ms` with the survivors in their old order and the joiners admitted before
    /// (in the order they came).
    pub fn new(
        survivors: Vec<Survivor<W>>,
        admitted: Vec<W>,
        min_workers: usize,
        max_workers: usize,
        join_wait_ms: u64,
        now_ms: u64,
    ) -> Self {
        let deadline_ms = now_ms.saturating_add(join_wait_ms);
        FormMembers { survivors, admitted, min_workers, max_workers, join_wait_ms, deadline_ms, said: false }
    }

    /// A joiner arrived (after those before it).
    pub fn join(&mut self, w: W) {
        self.admitted.push(w);
    }

    /// At `now_ms`: drops the admitted joiners `fenced` names, then answers.
    pub fn poll(&mut self, now_ms: u64, fenced: impl Fn(&W) -> bool) -> Formation<W> {
        self.admitted.retain(|w| !fenced(w));
        let have = match next_members(&self.survivors, &self.admitted, self.min_workers, self.max_workers) {
            NextMembers::Formed { members, draining } => return Formation::Formed { members, draining },
            NextMembers::TooFew { have } => have,
        };
        if now_ms >= self.deadline_ms {
            return Formation::Fail(format!(
                "only {have} worker(s) left and none joined within tessera.elastic.join_wait_ms = {} ms; tessera.elastic.min_workers = {}",
                self.join_wait_ms, self.min_workers
            ));
        }
        let say = (!self.said).then(|| {
            format!("elastic: {have} worker(s), waiting up to {} ms for joins (min_workers = {})", self.join_wait_ms, self.min_workers)
        });
        self.said = true;
        Formation::Wait { say }
    }

    /// The admitted joiners (fenced ones dropped at the last poll), members of the new epoch
    /// included: the driver drops those once the epoch formed.
    pub fn into_admitted(self) -> Vec<W> {
        self.admitted
    }
}

/// What a worker's heartbeat thread does at one beat, before it sends its heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DrainTick {
    /// SIGTERM was seen for the first time: send `Draining` (once).
    pub draining: bool,
    /// More than the grace passed since `Draining` with no step boundary releasing the worker:
    /// it exits (status 3) on its own, and the driver then counts it lost.
    pub leave: bool,
}

/// A worker's drain timer: after SIGTERM it asks once to drain, and leaves on its own when no
/// step boundary released it within `grace_ms` (more than `grace_ms` since it asked).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainTimer {
    grace_ms: u64,
    since: Option<u64>,
}

impl DrainTimer {
    pub fn new(grace_ms: u64) -> Self {
        DrainTimer { grace_ms, since: None }
    }

    /// A beat at `now_ms`; `term`: SIGTERM was received.
    pub fn tick(&mut self, now_ms: u64, term: bool) -> DrainTick {
        let draining = self.since.is_none() && term;
        if draining {
            self.since = Some(now_ms);
        }
        let leave = self.since.is_some_and(|t| now_ms.saturating_sub(t) > self.grace_ms);
        DrainTick { draining, leave }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_saying_once_then_forms_or_fails_at_the_deadline() {
        let s = |id, draining| Survivor { id, draining };
        let mut f = FormMembers::new(vec![s(1, false), s(2, true)], vec![], 2, 3, 300, 1000);
        assert_eq!(
            f.poll(1000, |_| false),
            Formation::Wait { say: Some("elastic: 1 worker(s), waiting up to 300 ms for joins (min_workers = 2)".into()) }
        );
        f.join(9);
        assert_eq!(f.poll(1100, |&w| w == 9), Formation::Wait { say: None });
        f.join(7);
        assert_eq!(f.poll(1200, |&w| w == 9), Formation::Formed { members: vec![1, 7], draining: vec![2] });
        let mut f = FormMembers::new(vec![s(1, false)], vec![], 2, 3, 300, 0);
        assert_eq!(
            f.poll(299, |_| false),
            Formation::Wait { say: Some("elastic: 1 worker(s), waiting up to 300 ms for joins (min_workers = 2)".into()) }
        );
        assert_eq!(
            f.poll(300, |_| false),
            Formation::Fail(
                "only 1 worker(s) left and none joined within tessera.elastic.join_wait_ms = 300 ms; tessera.elastic.min_workers = 2"
                    .into()
            )
        );
    }

    #[test]
    fn a_drain_is_asked_once_and_leaves_after_more_than_the_grace() {
        let mut d = DrainTimer::new(100);
        assert_eq!(d.tick(0, false), DrainTick::default());
        assert_eq!(d.tick(50, true), DrainTick { draining: true, leave: false });
        assert_eq!(d.tick(150, true), DrainTick::default());
        assert_eq!(d.tick(151, true), DrainTick { draining: false, leave: true });
    }
}
