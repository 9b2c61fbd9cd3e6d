//! A seeded simulation of the timing of joins and drains ([`crate::formation`]): the driver's
//! wait for the members of a new epoch ([`FormMembers`]) and the workers' drain timers
//! ([`DrainTimer`]). Each seed draws `min_workers` (1–4), `max_workers` (up to 4 more),
//! `join_wait_ms` (0, a multiple of 100, or any up to 2 s), the heartbeat period (20–300 ms), the
//! driver's polls (every 100 ms plus 0–30 ms of work, or exactly 100), 1–`max_workers` first
//! members, each of which may get SIGTERM at a drawn time with a drawn `drain_grace_ms` (its
//! heartbeat thread beats at a drawn phase) and may crash, up to 7 joiners arriving at drawn times
//! (some fenced before or after they are admitted, more than `max_workers` leaves room for), and
//! 2–5 step boundaries at drawn times, each forming a new epoch.
//!
//! At a boundary `B` the survivors are the members neither crashed, fenced nor exited on their own
//! by `B`, draining when their `Draining` was sent by `B`. The machine is polled at `B` and every
//! poll after, handed each joiner once it arrived, told which are fenced. The oracle works from
//! the world's timeline: at each poll `p` the answer must be `Formed` with the non-draining
//! survivors in their old order then the joiners arrived and not fenced by `p` (in arrival order,
//! those members already excluded) up to `max_workers`, and the draining survivors, as soon as
//! they number `min_workers`; else `Fail` with the driver's message word for word exactly when
//! `p - B >= join_wait_ms`; else `Wait`, saying the driver's line at the first wait only. No
//! worker is both member and drainer, none twice, a fenced joiner never. A drain timer sends
//! `Draining` at its first beat at or after SIGTERM and leaves at its first beat more than the
//! grace later (worked out by arithmetic, not by the machine); a drainer whose epoch formed before
//! it left is drained (a transfer source of the new epoch, not a member), one whose grace ran out
//! first exited on its own and counts as lost.
//!
//! Replay a failing seed with `TESSERA_SIM_SEED=<seed> cargo test --release -p tessera-actors
//! formation_replay -- --nocapture` (it prints the world and every poll).

use tessera_kernels::tensor::Rng;

use crate::formation::{DrainTimer, FormMembers, Formation};
use crate::recovery::Survivor;

/// A worker of the world (first members `0..`, joiners `100..`).
#[derive(Debug, Clone)]
struct Worker {
    id: u64,
    /// Joiners: when it arrives (the driver hands it to the machine at the first poll after).
    arrives: Option<u64>,
    /// SIGTERM at, and its drain grace (first members only).
    term: Option<(u64, u64)>,
    /// The phase of its heartbeats (beats at `phase + k * beat`).
    phase: u64,
    /// It crashes (first members) or is fenced (joiners; a fenced member is lost).
    crash: Option<u64>,
    fence: Option<u64>,
}

#[derive(Debug, Clone)]
struct World {
    min_workers: usize,
    max_workers: usize,
    join_wait_ms: u64,
    beat: u64,
    /// The driver's work per poll on top of its 100 ms sleep: 0..=`poll_jitter`.
    poll_jitter: u64,
    first: usize,
    workers: Vec<Worker>,
    boundaries: Vec<u64>,
}

fn build(seed: u64) -> World {
    let mut rng = Rng::derive(seed, &[0xf0e1]);
    let mut pick = |n: u64| rng.gen_range(n.max(1));
    let min_workers = 1 + pick(4) as usize;
    let max_workers = min_workers + pick(5) as usize;
    let join_wait_ms = match pick(3) {
        0 => 0,
        1 => 100 * pick(15),
        _ => pick(2000),
    };
    let beat = 20 + pick(281);
    let poll_jitter = match pick(2) {
        0 => 0,
        _ => 30,
    };
    let first = 1 + pick(max_workers as u64) as usize;
    let mut boundaries = Vec::new();
    let mut t = 0;
    for _ in 0..2 + pick(4) {
        t += 50 + pick(1500);
        boundaries.push(t);
    }
    let horizon = t + 1000;
    let mut workers = Vec::new();
    for id in 0..first as u64 {
        let term = (pick(3) == 0).then(|| (pick(horizon), pick(2000)));
        let crash = (pick(7) == 0).then(|| pick(horizon));
        workers.push(Worker { id, arrives: None, term, phase: pick(beat), crash, fence: None });
    }
    for k in 0..pick(8) {
        let arrives = pick(horizon);
        let fence = (pick(4) == 0).then(|| pick(horizon));
        workers.push(Worker { id: 100 + k, arrives: Some(arrives), term: None, phase: 0, crash: None, fence });
    }
    World { min_workers, max_workers, join_wait_ms, beat, poll_jitter, first, workers, boundaries }
}

/// What the seeds covered.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    formed: u64,
    failed: u64,
    waits_said: u64,
    formed_after_waiting: u64,
    drained: u64,
    exited_on_own: u64,
    exited_while_waiting: u64,
    fenced_joiners: u64,
    left_over_joiners: u64,
    crashed: u64,
}

/// The first beat at or after `t`, with beats at `phase + k * beat`.
fn beat_at_or_after(t: u64, phase: u64, beat: u64) -> u64 {
    match t <= phase {
        true => phase,
        false => phase + (t - phase).div_ceil(beat) * beat,
    }
}

/// The drain timer run over a worker's beats: when it sent `Draining` and when it left, if it did
/// before `horizon`.
fn run_timer(w: &Worker, beat: u64, horizon: u64) -> (Option<u64>, Option<u64>) {
    let Some((term_at, grace)) = w.term else { return (None, None) };
    let mut timer = DrainTimer::new(grace);
    let (mut sent, mut t) = (None, w.phase);
    while t <= horizon {
        let tick = timer.tick(t, t >= term_at);
        if tick.draining {
            if sent.is_some() {
                return (sent, Some(u64::MAX)); // a second `Draining`: caught by the caller
            }
            sent = Some(t);
        }
        if tick.leave {
            return (sent, Some(t));
        }
        t += beat;
    }
    (sent, None)
}

fn run_seed(seed: u64, mut trace: Option<&mut Vec<String>>) -> Result<Tally, String> {
    let world = build(seed);
    let mut log = |line: String| {
        if let Some(t) = trace.as_deref_mut() {
            t.push(line);
        }
    };
    let mut tally = Tally::default();
    let w_of = |id: u64| world.workers.iter().find(|w| w.id == id).expect("a worker of the world");
    let horizon = world.boundaries.last().copied().unwrap_or(0) + world.join_wait_ms + 10_000;
    // The drain timers, checked against arithmetic.
    let mut timers = std::collections::BTreeMap::new();
    for w in &world.workers {
        let got = run_timer(w, world.beat, horizon);
        if let Some((term_at, grace)) = w.term {
            let sent = beat_at_or_after(term_at, w.phase, world.beat);
            let left = sent + (grace / world.beat + 1) * world.beat;
            let want = (Some(sent).filter(|&s| s <= horizon), Some(left).filter(|&l| l <= horizon));
            if got != want {
                return Err(format!(
                    "worker {}'s drain timer (SIGTERM at {term_at}, grace {grace}): sent/left {got:?}, want {want:?}",
                    w.id
                ));
            }
            log(format!("worker {}: SIGTERM at {term_at}, grace {grace}: Draining at {sent}, leaves on its own at {left}", w.id));
        }
        timers.insert(w.id, got);
    }
    let sent_by = |id: u64, t: u64| timers[&id].0.is_some_and(|s| s <= t);
    let left_by = |id: u64, t: u64| timers[&id].1.is_some_and(|l| l <= t);
    // Joiners in the order they arrive (ties: by id).
    let mut joiners: Vec<&Worker> = world.workers.iter().filter(|w| w.arrives.is_some()).collect();
    joiners.sort_by_key(|w| (w.arrives, w.id));
    let mut handed = 0;
    let mut members: Vec<u64> = (0..world.first as u64).collect();
    let mut admitted: Vec<u64> = Vec::new();
    let mut ever_members: Vec<u64> = members.clone();
    let mut formed_at = 0;
    for (k, &b) in world.boundaries.iter().enumerate() {
        let b = b.max(formed_at + 1);
        let mut survivors = Vec::new();
        for &m in &members {
            let w = w_of(m);
            if w.crash.is_some_and(|c| c <= b) || w.fence.is_some_and(|f| f <= b) {
                tally.crashed += 1;
                log(format!("boundary {k} at {b}: worker {m} lost"));
            } else if left_by(m, b) {
                tally.exited_on_own += 1;
                log(format!("boundary {k} at {b}: worker {m} exited on its own (grace ran out): lost"));
            } else {
                survivors.push(Survivor { id: m, draining: sent_by(m, b) });
            }
        }
        log(format!("boundary {k} at {b}: survivors {survivors:?}"));
        let staying: Vec<u64> = survivors.iter().filter(|s| !s.draining).map(|s| s.id).collect();
        let draining: Vec<u64> = survivors.iter().filter(|s| s.draining).map(|s| s.id).collect();
        let mut form =
            FormMembers::new(survivors.clone(), std::mem::take(&mut admitted), world.min_workers, world.max_workers, world.join_wait_ms, b);
        let mut rng = Rng::derive(seed, &[0xf0e1, k as u64]);
        let (mut p, mut waits, mut said) = (b, 0u64, 0u64);
        let formed = loop {
            while handed < joiners.len() && joiners[handed].arrives.is_some_and(|a| a <= p) {
                form.join(joiners[handed].id);
                handed += 1;
            }
            let fenced = |id: &u64| w_of(*id).fence.is_some_and(|f| f <= p);
            let got = form.poll(p, fenced);
            // The oracle, from the timeline.
            let eligible = joiners
                .iter()
                .filter(|j| j.arrives.is_some_and(|a| a <= p) && j.fence.is_none_or(|f| f > p) && !ever_members.contains(&j.id))
                .map(|j| j.id);
            let room = world.max_workers.saturating_sub(staying.len());
            let want_members: Vec<u64> = staying.iter().copied().chain(eligible.take(room)).collect();
            let have = want_members.len();
            let want = if have >= world.min_workers {
                Formation::Formed { members: want_members, draining: draining.clone() }
            } else if p - b >= world.join_wait_ms {
                Formation::Fail(format!(
                    "only {have} worker(s) left and none joined within tessera.elastic.join_wait_ms = {} ms; tessera.elastic.min_workers = {}",
                    world.join_wait_ms, world.min_workers
                ))
            } else {
                let say = (waits == 0).then(|| {
                    format!(
                        "elastic: {have} worker(s), waiting up to {} ms for joins (min_workers = {})",
                        world.join_wait_ms, world.min_workers
                    )
                });
                Formation::Wait { say }
            };
            log(format!("  poll at {p} (+{}): {got:?}", p - b));
            if got != want {
                return Err(format!("boundary {k} at {b}, poll at {p}: the machine answered {got:?}, the oracle wants {want:?}"));
            }
            match got {
                Formation::Formed { members, draining } => break Some((members, draining)),
                Formation::Fail(_) => break None,
                Formation::Wait { say } => {
                    waits += 1;
                    said += say.is_some() as u64;
                }
            }
            p += 100 + rng.gen_range(world.poll_jitter + 1);
        };
        tally.waits_said += said;
        if said > 1 {
            return Err(format!("boundary {k}: the wait was said {said} times"));
        }
        let Some((next, leaving)) = formed else {
            tally.failed += 1;
            log(format!("boundary {k}: the run fails"));
            return Ok(tally);
        };
        tally.formed += 1;
        tally.formed_after_waiting += (waits > 0) as u64;
        for m in &next {
            if leaving.contains(m) {
                return Err(format!("worker {m} is both a member and a drainer of epoch {k}"));
            }
            if next.iter().filter(|&x| x == m).count() > 1 {
                return Err(format!("worker {m} is a member of epoch {k} twice"));
            }
            // (A survivor fenced during the wait is the driver's check after the machine: the
            // formation stops and the next boundary recovers; here it is lost there.)
            if !staying.contains(m) && w_of(*m).fence.is_some_and(|f| f <= p) {
                return Err(format!("joiner {m}, fenced, is a member of epoch {k}"));
            }
        }
        if next.len() > world.max_workers.max(staying.len()) {
            return Err(format!("epoch {k} has {} members, above max_workers = {}", next.len(), world.max_workers));
        }
        formed_at = p;
        // Installed: each drainer leaves, drained when its grace had not run out meanwhile.
        for &d in &leaving {
            match left_by(d, p) {
                true => {
                    tally.exited_while_waiting += 1;
                    tally.exited_on_own += 1;
                    log(format!("  worker {d} exited on its own while the epoch formed: lost, not drained"));
                }
                false => {
                    tally.drained += 1;
                    log(format!("  worker {d} drained and left (a transfer source of epoch {k})"));
                }
            }
        }
        admitted = form.into_admitted();
        admitted.retain(|a| !next.contains(a));
        tally.left_over_joiners += admitted.len() as u64;
        ever_members.extend(next.iter().copied());
        members = next;
        log(format!("  epoch {k}: members {members:?}, admitted {admitted:?}"));
    }
    tally.fenced_joiners +=
        joiners.iter().filter(|j| j.fence.is_some_and(|f| f <= formed_at) && !ever_members.contains(&j.id)).count() as u64;
    Ok(tally)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formation_many_seeds() {
        let mut all = Tally::default();
        crate::sim_support::many_seeds("formation", "-p tessera-actors formation_replay", 20_000, run_seed, |t| {
            all.formed += t.formed;
            all.failed += t.failed;
            all.waits_said += t.waits_said;
            all.formed_after_waiting += t.formed_after_waiting;
            all.drained += t.drained;
            all.exited_on_own += t.exited_on_own;
            all.exited_while_waiting += t.exited_while_waiting;
            all.fenced_joiners += t.fenced_joiners;
            all.left_over_joiners += t.left_over_joiners;
            all.crashed += t.crashed;
        });
        println!("{all:?}");
        // Every kind of case came up.
        let t = all;
        for (what, n) in [
            ("formed", t.formed),
            ("failed", t.failed),
            ("waits said", t.waits_said),
            ("formed after waiting", t.formed_after_waiting),
            ("drained", t.drained),
            ("exited on its own", t.exited_on_own),
            ("exited while the epoch formed", t.exited_while_waiting),
            ("fenced joiners", t.fenced_joiners),
            ("joiners beyond max_workers", t.left_over_joiners),
            ("crashed", t.crashed),
        ] {
            assert!(n > 0, "no seed had a case of: {what}");
        }
    }

    #[test]
    fn formation_replay() {
        crate::sim_support::replay(build, run_seed);
    }

    #[test]
    fn formation_sim_is_deterministic() {
        crate::sim_support::assert_deterministic(run_seed);
    }
}
