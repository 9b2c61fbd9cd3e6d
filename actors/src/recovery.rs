//! The elastic driver's recovery decisions, as pure functions: whether a failure is a loss to
//! re-plan around or the end of the run ([`after_failure`], from the kinds of the failures),
//! which committed step a new epoch starts from, which survivor hands over each shard of it (or
//! that a checkpoint is needed), and who the members of the new epoch are.
//!
//! No IO, no clock, no randomness: the process driver (`actors/fleet/src/driver/`) asks the
//! survivors for their `Status`, calls [`choose_source`] and [`next_members`], and carries out
//! the answers (exports, checkpoint loads, waits for joins); the candidate steps come from
//! [`candidate_steps`] (asked by the step machine, [`crate::stepper`], that `src/engine/run.rs`
//! drives). `recovery_sim` checks these functions over
//! thousands of seeded scenarios against its own model of who holds what.
//!
//! # The rule for a holding
//! The state is read in the layout of the **installed** epoch (the newest one whose every member
//! got its first full replica copy). A survivor holds rank `o`'s range at committed step `t`
//! when
//! - it is a member of the installed epoch whose own state is at `t`, and it is `o`'s owner (or
//!   the plan is ZeRO stage 0, where every rank holds the whole state: one range);
//! - it is such a member (own state at `t`: a member whose own state is elsewhere, or unusable
//!   after a commit that failed half-way, is not trusted with its replicas either) and keeps a
//!   replica of `o` at `t`;
//! - or it kept a copy of the installed epoch while a newer one formed, and that copy is `o`'s
//!   range (stage 0: any rank's) at `t`; kept copies are usable whatever the worker's current
//!   state.

use crate::error::{ActorError, FailureCause};

/// What an elastic driver makes of an operation the actor tree failed (a step, a replayed
/// step, a query), read from the kinds of the failures alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AfterFailure {
    /// Members' DeviceWorker actors died, or the tree refuses steps because members are lost:
    /// declare these ranks lost (with why) and form a new epoch.
    Lost(Vec<(usize, String)>),
    /// Every failure is what a loss elsewhere looks like (a peer gone, the group aborted, no
    /// answer within the phase timeout, a commit torn by one of those): form a new epoch once
    /// the loss is noticed (the driver waits a moment for it); if none is, the error ends the
    /// run.
    AwaitLoss,
    /// A rank failed on its own ([`crate::ComputeError::Failed`], also as a torn commit's
    /// cause) and no member died: no loss explains it, so the error ends the run at once
    /// unless a change is already pending.
    Failed,
}

/// The verdict on `e` (see [`AfterFailure`]): died members first, then any failure no loss
/// explains, else a loss to wait for. The tree's own errors (no answer from the supervisor, a
/// busy or inconsistent tree) wait for a loss as well.
pub fn after_failure(e: &ActorError) -> AfterFailure {
    let failures = match e {
        ActorError::StepAbandoned { failures, .. }
        | ActorError::CommitFailed { failures, .. }
        | ActorError::QueryFailed { failures, .. } => failures,
        ActorError::MembersLost { ranks, causes, .. } => {
            return AfterFailure::Lost(ranks.iter().copied().zip(causes.iter().cloned()).collect())
        }
        _ => return AfterFailure::AwaitLoss,
    };
    let died: Vec<(usize, String)> = failures
        .iter()
        .filter_map(|f| match &f.cause {
            FailureCause::Died(why) => Some((f.rank, why.clone())),
            _ => None,
        })
        .collect();
    if !died.is_empty() {
        return AfterFailure::Lost(died);
    }
    match failures.iter().any(|f| matches!(&f.cause, FailureCause::Returned(e) if !e.explained_by_loss())) {
        true => AfterFailure::Failed,
        false => AfterFailure::AwaitLoss,
    }
}

/// A survivor at a recovery and what it holds (its `Status`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holdings<W> {
    pub id: W,
    /// The plan epoch it is a member of (`None`: none yet).
    pub epoch: Option<u64>,
    /// The committed steps of its own state (`None`: unusable, e.g. after a commit that failed
    /// half-way).
    pub at: Option<u64>,
    /// Its replicas of `epoch`: (owner rank, committed steps).
    pub replicas: Vec<(u64, u64)>,
    /// The installed epoch it kept copies of while a newer one formed, and those copies (its own
    /// shard and its replicas): (owner rank, committed steps).
    pub kept_epoch: Option<u64>,
    pub kept: Vec<(u64, u64)>,
}

/// The installed epoch's layout, in which the state is read.
#[derive(Debug, Clone, Copy)]
pub struct Layout<'a, W> {
    pub epoch: u64,
    /// Its members in rank order.
    pub members: &'a [W],
    /// Its ranks (one range each when `sharded`).
    pub world: usize,
    /// ZeRO stage > 0: rank `r` owns range `r`; stage 0: every rank holds the whole state.
    pub sharded: bool,
}

impl<W> Layout<'_, W> {
    /// The ranks whose ranges make up the state: every rank, or rank 0 alone at stage 0.
    pub fn owners(&self) -> std::ops::Range<usize> {
        match self.sharded {
            true => 0..self.world,
            false => 0..1,
        }
    }
}

/// Who hands over a rank's range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source<W> {
    /// The holder's own state (the owner's; at stage 0 any member's).
    Own { holder: W },
    /// The holder's replica of the rank's range, in the installed epoch.
    Replica { holder: W },
    /// A copy the holder kept of the installed epoch while a newer one formed: the range of rank
    /// `owner` (the rank asked for, or at stage 0 any rank), `replica` when the holder was not
    /// that rank's owner.
    Kept { holder: W, owner: u64, replica: bool },
}

impl<W> Source<W> {
    pub fn holder(&self) -> &W {
        match self {
            Source::Own { holder } | Source::Replica { holder } | Source::Kept { holder, .. } => holder,
        }
    }
}

/// Where the state of a new epoch comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Restore<W> {
    /// Every range of the installed epoch is held at `step` by a survivor: `sources` are
    /// (rank, who hands it over), in rank order ([`Layout::owners`]).
    Memory { step: u64, sources: Vec<(usize, Source<W>)> },
    /// Memory is not whole at any candidate step: the newest valid checkpoint at or before
    /// `at_most` (else where the run started), after which the driver replays the steps.
    Checkpoint { at_most: u64 },
}

/// The committed steps a recovery may take the state at, best first, when `committed` steps
/// are committed: after a commit of step `committed` that failed on a lost member (every rank
/// had prepared it), the survivors that took the step and the lost owners' replicas may hold
/// `committed + 1`, which then counts as committed; otherwise only `committed`.
pub fn candidate_steps(committed: u64, commit_failed: bool) -> Vec<u64> {
    match commit_failed {
        true => vec![committed + 1, committed],
        false => vec![committed],
    }
}

/// Where the state comes from: the first step of `at` (best first, [`candidate_steps`]) at
/// which every range of the installed epoch `installed` has a holder among `alive` (see the
/// module doc), else a checkpoint at or before the lowest of `at`. Without an installed epoch
/// only a checkpoint can serve. For each range the owner's own state is preferred, then a
/// replica, then a kept copy; among equals the first in `alive`. `None` only when `at` is
/// empty.
pub fn choose_source<W: Clone + PartialEq>(installed: Option<Layout<'_, W>>, alive: &[Holdings<W>], at: &[u64]) -> Option<Restore<W>> {
    let memory = installed.and_then(|inst| {
        at.iter().find_map(|&t| {
            let sources = inst.owners().map(|o| find_shard(&inst, alive, o, t).map(|s| (o, s))).collect::<Option<Vec<_>>>()?;
            Some(Restore::Memory { step: t, sources })
        })
    });
    memory.or_else(|| Some(Restore::Checkpoint { at_most: at.iter().copied().min()? }))
}

/// Who holds rank `o`'s range of the installed epoch at `t` committed steps, if anyone.
fn find_shard<W: Clone + PartialEq>(inst: &Layout<'_, W>, alive: &[Holdings<W>], o: usize, t: u64) -> Option<Source<W>> {
    let current = |a: &&Holdings<W>| a.epoch == Some(inst.epoch) && a.at == Some(t);
    let owner = inst.members.get(o);
    if let Some(a) = alive.iter().filter(current).find(|a| !inst.sharded || owner == Some(&a.id)) {
        return Some(Source::Own { holder: a.id.clone() });
    }
    if let Some(a) = alive.iter().filter(current).find(|a| a.replicas.contains(&(o as u64, t))) {
        return Some(Source::Replica { holder: a.id.clone() });
    }
    alive.iter().filter(|a| a.kept_epoch == Some(inst.epoch)).find_map(|a| {
        let &(held, _) = a.kept.iter().find(|&&(held, at)| at == t && (!inst.sharded || held == o as u64))?;
        let replica = inst.members.get(held as usize) != Some(&a.id);
        Some(Source::Kept { holder: a.id.clone(), owner: held, replica })
    })
}

/// A survivor in its old order, and whether it asked to drain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Survivor<W> {
    pub id: W,
    pub draining: bool,
}

/// The members of a new epoch, or why there are none yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NextMembers<W> {
    /// The members in rank order; `draining` are the survivors that leave once it is installed.
    Formed { members: Vec<W>, draining: Vec<W> },
    /// Fewer than the minimum: `have` workers. The driver waits for joins (up to
    /// `join_wait_ms`) and asks again, then fails.
    TooFew { have: usize },
}

/// The members of the new epoch: the survivors that do not drain, in their old order (none is
/// dropped), then the admitted joiners in the order they came, as many as `max_workers` leaves
/// room for; [`NextMembers::TooFew`] below `min_workers`.
pub fn next_members<W: Clone>(survivors: &[Survivor<W>], admitted: &[W], min_workers: usize, max_workers: usize) -> NextMembers<W> {
    let staying = survivors.iter().filter(|s| !s.draining).map(|s| s.id.clone());
    let draining = survivors.iter().filter(|s| s.draining).map(|s| s.id.clone()).collect();
    let room = max_workers.saturating_sub(survivors.iter().filter(|s| !s.draining).count());
    let members: Vec<W> = staying.chain(admitted.iter().take(room).cloned()).collect();
    match members.len() >= min_workers {
        true => NextMembers::Formed { members, draining },
        false => NextMembers::TooFew { have: members.len() },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compute::ComputeError;
    use crate::error::RankFailure;
    use crate::stepper::{self, Stepper};

    fn returned(rank: usize, e: ComputeError) -> RankFailure {
        RankFailure { rank, cause: FailureCause::Returned(e) }
    }

    #[test]
    fn the_verdict_follows_the_kind_of_each_failure() {
        let peer_gone = ComputeError::Lost { rank: Some(2), why: "all_to_all: peer rank 2 has left the group".into() };
        let aborted = ComputeError::Aborted { why: "the group was aborted".into() };
        let failed = ComputeError::failed("short read");
        let abandoned = |failures| ActorError::StepAbandoned { step: 4, failures };
        // A lost peer during prepare: abandon, and re-plan once the loss is noticed.
        assert_eq!(after_failure(&abandoned(vec![returned(0, peer_gone.clone()), returned(1, aborted.clone())])), AfterFailure::AwaitLoss);
        let timed_out = RankFailure { rank: 1, cause: FailureCause::TimedOut { phase: "prepare", timeout_ms: 9 } };
        assert_eq!(after_failure(&abandoned(vec![returned(0, aborted.clone()), timed_out])), AfterFailure::AwaitLoss);
        // A rank's own failure: no loss explains it, even next to the aborts it caused.
        assert_eq!(after_failure(&abandoned(vec![returned(0, aborted.clone()), returned(1, failed.clone())])), AfterFailure::Failed);
        // A member that died is declared lost, whatever else failed.
        let died = RankFailure { rank: 3, cause: FailureCause::Died("compute of rank 3 panicked".into()) };
        let want = AfterFailure::Lost(vec![(3, "compute of rank 3 panicked".into())]);
        assert_eq!(after_failure(&abandoned(vec![returned(1, failed.clone()), died])), want);
        let refused = ActorError::MembersLost { epoch: 2, ranks: vec![1], causes: vec!["worker terminated".into()] };
        assert_eq!(after_failure(&refused), AfterFailure::Lost(vec![(1, "worker terminated".into())]));
        // A torn commit is judged by its cause.
        let prepared = Box::new(crate::compute::StepResult::aggregate(4, 2, Vec::new(), Vec::new()));
        let torn = |e: ComputeError| ActorError::CommitFailed {
            step: 4,
            failures: vec![returned(0, e.torn(Some(4)))],
            prepared: prepared.clone(),
        };
        assert_eq!(after_failure(&torn(peer_gone)), AfterFailure::AwaitLoss);
        assert_eq!(after_failure(&torn(failed)), AfterFailure::Failed);
        assert_eq!(after_failure(&ActorError::Busy), AfterFailure::AwaitLoss);
    }

    /// A commit of step 5 fails on every survivor after their shards took the step (sharing
    /// the parameters with the lost rank 0 failed): each survivor's state is at 6 by the
    /// error's `stepped`, the lost owner's replica took the step too, so the recovery restores
    /// at 6 and the step machine counts step 5 committed. Torn part-way (`stepped: None`), the
    /// survivors' states are unusable and only a checkpoint serves; failed before the shard
    /// changed, they stay at 5 and step 5 runs again.
    #[test]
    fn a_commit_torn_after_its_step_counts_committed_and_one_torn_part_way_does_not() {
        let members = [10, 11, 12];
        let inst = Layout { epoch: 3, members: &members, world: 3, sharded: true };
        let lost = ComputeError::Lost { rank: Some(0), why: "the parameter all-gather: peer rank 0 has left the group".into() };
        let survivors = |e: &ComputeError| {
            let at = e.state_after_commit(5, Some(5));
            let replica = at.map_or(Vec::new(), |t| vec![(0, t)]);
            vec![
                Holdings { id: 11, epoch: Some(3), at, replicas: replica, kept_epoch: None, kept: Vec::new() },
                Holdings {
                    id: 12,
                    epoch: Some(3),
                    at,
                    replicas: at.map_or(Vec::new(), |t| vec![(1, t)]),
                    kept_epoch: None,
                    kept: Vec::new(),
                },
            ]
        };
        let run = |e: &ComputeError| {
            let mut m = Stepper::new(5);
            assert_eq!(m.on(stepper::Input::Step), stepper::Action::Attempt { step: 5 });
            let stepper::Action::Reconfigure { at } = m.on(stepper::Input::CommitFailed) else { panic!("no recovery") };
            let restored = match choose_source(Some(inst), &survivors(e), &at) {
                Some(Restore::Memory { step, .. }) => step,
                Some(Restore::Checkpoint { at_most }) => at_most.min(4),
                None => panic!("no candidate"),
            };
            let mut action = m.on(stepper::Input::Restored { step: restored });
            while let stepper::Action::Replay { .. } | stepper::Action::Resync { .. } = action {
                action = m.on(match action {
                    stepper::Action::Replay { .. } => stepper::Input::Committed,
                    _ => stepper::Input::Resynced,
                });
            }
            assert!(matches!(action, stepper::Action::Recovered { .. }), "{action:?}");
            (restored, m.on(stepper::Input::Resumed))
        };
        let stepped = lost.clone().torn(Some(5));
        assert_eq!(run(&stepped), (6, stepper::Action::Committed { step: 5, by_recovery: true }));
        assert_eq!(run(&lost.clone().torn(None)), (4, stepper::Action::Attempt { step: 5 }));
        assert_eq!(run(&lost), (5, stepper::Action::Attempt { step: 5 }));
    }

    fn holdings(id: u64, epoch: u64, at: u64, replicas: &[(u64, u64)]) -> Holdings<u64> {
        Holdings { id, epoch: Some(epoch), at: Some(at), replicas: replicas.to_vec(), kept_epoch: None, kept: Vec::new() }
    }

    #[test]
    fn a_lost_owner_is_read_from_its_replica_and_t_plus_one_wins_when_whole() {
        let members = [10, 11, 12];
        let inst = Layout { epoch: 3, members: &members, world: 3, sharded: true };
        // Rank 0 (worker 10) is lost after the commit of step 5 failed; worker 11 took the step
        // and holds rank 0's replica at 6; worker 12 did not.
        let alive = [holdings(11, 3, 6, &[(0, 6)]), holdings(12, 3, 5, &[(1, 5)])];
        let at = candidate_steps(5, true);
        // Rank 2 is only at 5 and rank 1 only at 6: neither step is whole.
        assert_eq!(choose_source(Some(inst), &alive, &at), Some(Restore::Checkpoint { at_most: 5 }));
        let alive = [holdings(11, 3, 6, &[(0, 6)]), holdings(12, 3, 6, &[(1, 6)])];
        let want = Restore::Memory {
            step: 6,
            sources: vec![(0, Source::Replica { holder: 11 }), (1, Source::Own { holder: 11 }), (2, Source::Own { holder: 12 })],
        };
        assert_eq!(choose_source(Some(inst), &alive, &at), Some(want));
        assert_eq!(choose_source(None, &alive, &at), Some(Restore::Checkpoint { at_most: 5 }));
        assert_eq!(choose_source(Some(inst), &alive, &[]), None);
    }

    #[test]
    fn drainers_leave_joiners_fill_up_to_the_maximum_and_too_few_waits() {
        let s = |id, draining| Survivor { id, draining };
        let survivors = [s(4, false), s(2, true), s(7, false)];
        let want = NextMembers::Formed { members: vec![4, 7, 20], draining: vec![2] };
        assert_eq!(next_members(&survivors, &[20, 21], 1, 3), want);
        assert_eq!(next_members(&survivors, &[], 3, 8), NextMembers::TooFew { have: 2 });
    }
}
