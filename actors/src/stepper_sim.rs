//! A seeded simulation of the elastic driver's step/commit/recover loop ([`crate::stepper`]).
//! Each seed builds a run (a start step, a target of 1–24 steps, a budget of 0–16 faults) and
//! drives a [`Stepper`] through it with a model of the world: attempts and replays that commit,
//! are abandoned, or fail to commit after every rank prepared with the state whole at `t + 1`
//! or not; changes pending before an attempt; losses between steps (a failed evaluation,
//! checkpoint or replica re-copy) and after a replayed step; recoveries that restore from
//! memory at `t + 1` or `t`, or from a checkpoint at an older step (the newest, or an older one
//! when newer ones are corrupt). Checkpoints are written at random step boundaries.
//!
//! The oracle keeps its own books (the world's committed steps, the step the live state is
//! at, which failed commit may have reached the next step, its own counts), not the machine's,
//! and checks every action against them: an attempt runs only the next uncommitted step with
//! the live state there (every step up to the committed count replayed first); replays run in
//! order from the restored step; the candidate steps of a recovery are the live step and, after
//! a failed commit, the step after; a step is reported committed exactly when its attempt
//! committed or its failed commit was restored at `t + 1`, once, in order; committed steps
//! never go backwards; the run ends with exactly the target committed; the counts match; and
//! the loop ends within a bound (faults stop when the budget is spent).
//!
//! Replay a failing seed with `TESSERA_SIM_SEED=<seed> cargo test --release -p tessera-actors
//! stepper_replay -- --nocapture` (it prints the run and the trace).

use tessera_kernels::tensor::Rng;

use crate::stepper::{Action, Counts, Input, Stepper};

/// A run to simulate.
#[derive(Debug, Clone)]
struct Run {
    /// Where it starts (a resumed run: a checkpoint there).
    start: u64,
    /// The committed steps it ends with.
    target: u64,
    /// Faults it may meet; then every attempt commits.
    faults: u32,
    /// Probabilities in percent: an attempt (or replay) fails; a failure is a failed commit;
    /// a failed commit's state is whole at `t + 1`; memory is whole at `t`; a loss between
    /// steps; a checkpoint is written; a change is pending before an attempt.
    p_fail: u64,
    p_commit_failed: u64,
    p_whole_next: u64,
    p_memory: u64,
    p_boundary: u64,
    p_checkpoint: u64,
    p_pending: u64,
}

fn build(seed: u64) -> Run {
    let mut rng = Rng::derive(seed, &[0x57e9]);
    let mut pick = |n: u64| rng.gen_range(n);
    let start = match pick(4) {
        0 => pick(10),
        _ => 0,
    };
    Run {
        start,
        target: start + 1 + pick(24),
        faults: pick(17) as u32,
        p_fail: 10 + pick(50),
        p_commit_failed: pick(80),
        p_whole_next: pick(100),
        p_memory: pick(100),
        p_boundary: pick(30),
        p_checkpoint: pick(50),
        p_pending: pick(30),
    }
}

/// What was exercised.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    runs: u64,
    commits_by_recovery: u64,
    commits_completed_in_replay: u64,
    from_checkpoint: u64,
    replays: u64,
    replay_failures: u64,
    resync_losses: u64,
    boundary_recoveries: u64,
    pending_changes: u64,
    reruns: u64,
}

impl Tally {
    fn add(&mut self, t: Tally) {
        self.runs += t.runs;
        self.commits_by_recovery += t.commits_by_recovery;
        self.commits_completed_in_replay += t.commits_completed_in_replay;
        self.from_checkpoint += t.from_checkpoint;
        self.replays += t.replays;
        self.replay_failures += t.replay_failures;
        self.resync_losses += t.resync_losses;
        self.boundary_recoveries += t.boundary_recoveries;
        self.pending_changes += t.pending_changes;
        self.reruns += t.reruns;
    }
}

/// The oracle's books.
#[derive(Debug)]
struct World {
    /// Steps committed.
    committed: u64,
    /// The step the live epoch's state is at (`None`: being recovered).
    live: Option<u64>,
    /// The failure that started (or restarted) the recovery under way: the step the live state
    /// was at, and whether it was a failed commit whose state is whole at the step after.
    failure: Option<(u64, FailedCommit)>,
    /// Steps with a valid checkpoint (the start always).
    checkpoints: Vec<u64>,
    /// Whether the attempt of the step being run failed and its recovery is under way (the step
    /// is re-run, unless its failed commit is restored at the step after).
    attempt_failed: bool,
    /// Whether the recovery under way restored a failed commit of the step being run at the
    /// step after: it must be reported committed by the recovery.
    committed_by_recovery: bool,
    /// Whether the recovery under way began between steps.
    boundary: bool,
    counts: Counts,
    faults: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FailedCommit {
    /// Not a failed commit (abandoned, a loss).
    No,
    /// A failed commit; the state is whole at the step after.
    WholeNext,
    /// A failed commit; the state is not whole at the step after.
    NotWhole,
}

/// Bound on the machine's actions per run (far above what the bounded faults allow).
const MAX_ACTIONS: usize = 100_000;

fn run_seed(seed: u64, trace: Option<&mut Vec<String>>) -> Result<Tally, String> {
    let run = build(seed);
    let mut rng = Rng::derive(seed, &[0x57e9, 1]);
    let mut trace = trace;
    let mut log = |s: String| {
        if let Some(t) = trace.as_deref_mut() {
            t.push(s);
        }
    };
    let mut w = World {
        committed: run.start,
        live: Some(run.start),
        failure: None,
        checkpoints: vec![run.start],
        attempt_failed: false,
        committed_by_recovery: false,
        boundary: false,
        counts: Counts::default(),
        faults: run.faults,
    };
    let mut tally = Tally { runs: 1, ..Tally::default() };
    let mut m = Stepper::new(run.start);
    let mut chance = |w: &mut World, p: u64| -> bool {
        let hit = rng.gen_range(100) < p;
        if hit && w.faults > 0 {
            w.faults -= 1;
            return true;
        }
        false
    };
    let mut roll = Rng::derive(seed, &[0x57e9, 2]);
    let mut pct = |p: u64| roll.gen_range(100) < p;
    let mut input = Input::Step;
    let mut ended = false;
    for _ in 0..MAX_ACTIONS {
        let action = m.on(input);
        log(format!("{input:?} -> {action:?}"));
        // The world counts a failed commit restored at the step after at the restore; the
        // machine once the recovery is over (whether it is, the `Committed` arm checks).
        let reported = matches!(action, Action::Committed { by_recovery: true, .. });
        let want = w.committed - u64::from(w.committed_by_recovery && !reported);
        if m.committed() != want {
            return Err(format!("the machine has {} committed, the world {want}", m.committed()));
        }
        input = match action {
            Action::Attempt { step } => {
                if step != w.committed || w.live != Some(w.committed) {
                    return Err(format!("attempt of step {step} with {} committed and the state at {:?}", w.committed, w.live));
                }
                if w.committed_by_recovery || w.boundary || w.attempt_failed {
                    return Err(format!("attempt of step {step} while a recovery is not over ({w:?})"));
                }
                if chance(&mut w, run.p_pending) {
                    tally.pending_changes += 1;
                    w.live = None;
                    w.failure = Some((step, FailedCommit::No));
                    Input::Change
                } else if chance(&mut w, run.p_fail) {
                    w.attempt_failed = true;
                    let failed = fail(&mut w, step, &run, &mut pct);
                    match failed {
                        FailedCommit::No => Input::Abandoned,
                        _ => Input::CommitFailed,
                    }
                } else {
                    w.committed += 1;
                    w.live = Some(w.committed);
                    Input::Committed
                }
            }
            Action::Committed { step, by_recovery } => {
                // The world counted the commit already (an attempt that committed, or a
                // recovery that restored a failed commit's next step).
                if step + 1 != w.committed || m.committed() != w.committed {
                    return Err(format!("step {step} reported committed; the world has {} committed", w.committed));
                }
                if by_recovery != w.committed_by_recovery {
                    return Err(format!("step {step} reported committed (by recovery: {by_recovery}); the world: {w:?}"));
                }
                tally.commits_by_recovery += u64::from(by_recovery);
                w.committed_by_recovery = false;
                if pct(run.p_checkpoint) {
                    w.checkpoints.push(w.committed);
                }
                if w.committed == run.target {
                    ended = true;
                    break;
                }
                if chance(&mut w, run.p_boundary) {
                    tally.boundary_recoveries += 1;
                    w.live = None;
                    w.failure = Some((w.committed, FailedCommit::No));
                    w.boundary = true;
                    Input::Change
                } else {
                    Input::Step
                }
            }
            Action::Reconfigure { at } => {
                let Some((t, failed)) = w.failure else {
                    return Err(format!("a recovery with candidates {at:?} and no failure"));
                };
                let want = match failed {
                    FailedCommit::No => vec![t],
                    _ => vec![t + 1, t],
                };
                if at != want {
                    return Err(format!("candidates {at:?}, want {want:?} (failure at {t}: {failed:?})"));
                }
                // The state: the failed commit's next step when whole, memory at `t`, else the
                // newest valid checkpoint at or before `t` (sometimes an older one: newer ones
                // are corrupt).
                let step = if failed == FailedCommit::WholeNext {
                    if t < w.committed {
                        tally.commits_completed_in_replay += 1;
                    } else {
                        // The step being run committed with this recovery.
                        w.committed += 1;
                        w.attempt_failed = false;
                        w.committed_by_recovery = true;
                    }
                    w.counts.commits_completed += 1;
                    t + 1
                } else if pct(run.p_memory) {
                    t
                } else {
                    let mut older: Vec<u64> = w.checkpoints.iter().copied().filter(|&c| c <= t).collect();
                    older.sort_unstable();
                    older.dedup();
                    let newest = older.len() - 1;
                    let i = match pct(20) {
                        true => roll_index(&mut pct, newest),
                        false => newest,
                    };
                    tally.from_checkpoint += 1;
                    older[i]
                };
                w.live = Some(step);
                w.failure = None;
                Input::Restored { step }
            }
            Action::Replay { step } => {
                let Some(live) = w.live else { return Err(format!("replay of step {step} with no live state")) };
                if step != live || step >= w.committed {
                    return Err(format!("replay of step {step} with the state at {live} and {} committed", w.committed));
                }
                if chance(&mut w, run.p_fail) {
                    tally.replay_failures += 1;
                    match fail(&mut w, step, &run, &mut pct) {
                        FailedCommit::No => Input::Abandoned,
                        _ => Input::CommitFailed,
                    }
                } else {
                    w.counts.steps_replayed += 1;
                    tally.replays += 1;
                    w.live = Some(step + 1);
                    Input::Committed
                }
            }
            Action::Resync { at } => {
                if w.live != Some(at) {
                    return Err(format!("replicas re-copied at {at} with the state at {:?}", w.live));
                }
                if chance(&mut w, run.p_boundary) {
                    tally.resync_losses += 1;
                    w.live = None;
                    w.failure = Some((at, FailedCommit::No));
                    Input::Change
                } else {
                    Input::Resynced
                }
            }
            Action::Recovered { at } => {
                if w.live != Some(at) || at < w.committed {
                    return Err(format!(
                        "recovered at {at} with the state at {:?} and {} committed: steps not replayed",
                        w.live, w.committed
                    ));
                }
                if at > w.committed {
                    return Err(format!("recovered at {at} past the {} committed steps", w.committed));
                }
                if w.attempt_failed {
                    // The failed attempt did not commit: it runs again.
                    w.counts.steps_rerun += 1;
                    tally.reruns += 1;
                    w.attempt_failed = false;
                }
                Input::Resumed
            }
            Action::Ready => {
                if !w.boundary || !m.idle() {
                    return Err("ready without a recovery between steps".into());
                }
                w.boundary = false;
                Input::Step
            }
        };
    }
    if !ended {
        return Err(format!("no end after {MAX_ACTIONS} actions: {} of {} steps committed", w.committed, run.target));
    }
    if w.committed != run.target || m.committed() != run.target {
        return Err(format!("ended with {} committed (the machine: {}), want {}", w.committed, m.committed(), run.target));
    }
    if m.counts() != w.counts {
        return Err(format!("counts {:?}, the world counted {:?}", m.counts(), w.counts));
    }
    Ok(tally)
}

/// A failure of the attempt or replay of step `t`: abandoned, or a failed commit with the state
/// whole at `t + 1` or not. The live state is gone until the recovery.
fn fail(w: &mut World, t: u64, run: &Run, pct: &mut impl FnMut(u64) -> bool) -> FailedCommit {
    let failed = match pct(run.p_commit_failed) {
        false => FailedCommit::No,
        true => match pct(run.p_whole_next) {
            true => FailedCommit::WholeNext,
            false => FailedCommit::NotWhole,
        },
    };
    w.live = None;
    w.failure = Some((t, failed));
    failed
}

/// An index in `0..=newest`, drawn with `pct`.
fn roll_index(pct: &mut impl FnMut(u64) -> bool, newest: usize) -> usize {
    let mut i = newest;
    while i > 0 && pct(50) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Seeds per CI run (override with TESSERA_SIM_SEEDS).
    const DEFAULT_SEEDS: u64 = 50_000;

    #[test]
    fn stepper_many_seeds() {
        let mut tally = Tally::default();
        let n =
            crate::sim_support::many_seeds("step machine", "-p tessera-actors stepper_replay", DEFAULT_SEEDS, run_seed, |t| tally.add(t));
        println!("{tally:?}");
        // Every path must actually be exercised.
        let some = n / 50;
        let counts = [
            tally.commits_by_recovery,
            tally.commits_completed_in_replay,
            tally.from_checkpoint,
            tally.replays,
            tally.replay_failures,
            tally.resync_losses,
            tally.boundary_recoveries,
            tally.pending_changes,
            tally.reruns,
        ];
        assert!(counts.iter().all(|&c| c >= some), "some path is rarely exercised: {tally:?}");
    }

    #[test]
    fn stepper_replay() {
        crate::sim_support::replay(build, run_seed);
    }

    #[test]
    fn stepper_sim_is_deterministic() {
        crate::sim_support::assert_deterministic(run_seed);
    }
}
