//! Membership and the step commit protocol as a sans-IO state machine: the coordinator of an
//! elastic run. It is fed [`Event`]s (joins, heartbeats, reports, departures, drain requests,
//! timer ticks) with the current time and answers with [`Command`]s (install a plan epoch,
//! start / abandon / commit a step, release a drained worker, evict a dead one). It does no IO,
//! keeps no clock and draws no random numbers, so a simulator can drive it through any
//! interleaving (`crate::sim`) and the process layer can drive it from real sockets.
//!
//! # Protocol
//! - A **plan epoch** fixes the members (in rank order), each member's range of the flat
//!   buffer and its aligned dyadic micro-batch blocks. It is computed by
//!   [`crate::replan::replan_partition`] (survivors keep their ranges where possible) and
//!   [`crate::replan::blocks_for_speeds`] (slower workers get fewer micro-batches; the bits do
//!   not depend on the assignment). Members build the new epoch's ranges from the copies they
//!   hold of the last *installed* epoch (old copies are kept until a newer epoch is installed,
//!   so an install that fails half-way loses nothing) and report [`Event::Installed`]. The
//!   epoch is installed when every member did; only then does a step run under it.
//! - A **step** runs under one installed epoch: [`Command::StartStep`], one
//!   [`Event::Reported`] per member naming exactly the blocks it was assigned, then
//!   [`Command::Commit`]. Every block of the M micro-batches is therefore reported by a live
//!   member of the current epoch before the step commits. Any failure before that (a member
//!   lost, a compute error, a timeout) sends [`Command::Abandon`] to the survivors; the step
//!   then runs again under a new epoch (or, after a compute error with no membership change,
//!   as a new attempt of the same epoch after `retry_delay_ms`).
//! - **Commit** is decided here and is final: steps commit in order, each once. When a lost
//!   member held a range nobody else has (its owner is dead), the new epoch restores every
//!   range from the newest complete checkpoint ([`EpochPlan::restore`]; step 0 is the seeded
//!   initial state, always available) and re-runs the steps after it as *replays*
//!   (`replay: true`): determinism makes them reproduce the committed bits, so committed steps
//!   are never lost and never committed twice.
//! - **Checkpoints**: every `checkpoint_every` steps the commit asks members to save their
//!   ranges; the checkpoint becomes the restore point once every member of that epoch reported
//!   [`Event::Saved`].
//! - **Joins** take effect at the next step boundary; **drains** (SIGTERM) likewise: the
//!   draining worker stays a transfer source of the next epoch and gets [`Command::Release`]
//!   once that epoch is installed (its shards are handed over). If that does not happen within
//!   `drain_grace_ms` it is evicted (its range is then restored from a checkpoint).
//! - **Liveness**: a worker silent for `heartbeat_timeout_ms` is dead; a member that does not
//!   report a step (or install an epoch) within `step_timeout_ms` is hung and treated as dead.
//!   Dead workers are evicted ([`Command::Evict`]: the process layer fences/kills them) and
//!   their id is never readmitted: a restarted process joins under a new id.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::ops::Range;

use crate::replan::{blocks_for_speeds, replan_partition, OldShard, Transfer};

/// A worker's identity for the whole run (one process incarnation; never reused).
pub type WorkerId = u64;

/// An aligned dyadic block of micro-batches: `(first, level)` covers `first..first + 2^level`.
pub type Block = (usize, u32);

/// Fixed parameters of the coordinator.
#[derive(Debug, Clone, PartialEq)]
pub struct MembershipConfig {
    /// Micro-batches per step (M).
    pub micro_batches: usize,
    /// Elements of the flat buffer that the members partition.
    pub total_elems: usize,
    /// Partition boundaries are multiples of this (the optimizer's `NORM_BLOCK`).
    pub align: usize,
    /// Steps to run: `1..=steps`.
    pub steps: u64,
    /// Fewest members a plan may have; with fewer live workers the run pauses until joins.
    pub min_members: usize,
    /// A worker not heard from for this long is dead.
    pub heartbeat_timeout_ms: u64,
    /// A member that does not report a step (or install an epoch) within this is hung.
    pub step_timeout_ms: u64,
    /// How long a draining worker may take to hand its shards over.
    pub drain_grace_ms: u64,
    /// After a compute error, wait this long before the next attempt (failure detection of
    /// the peer that caused it, if any, gets to run first).
    pub retry_delay_ms: u64,
    /// Consecutive failed attempts of one worker after which it is evicted.
    pub max_step_failures: u32,
    /// Save a checkpoint at every step divisible by this (0: never; restores then go to step 0).
    pub checkpoint_every: u64,
}

/// One plan epoch: who owns what and runs which micro-batches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EpochPlan {
    pub epoch: u64,
    /// Members in rank order.
    pub members: Vec<WorkerId>,
    /// `ranges[r]`: the flat-buffer range `members[r]` owns (aligned, contiguous, covering).
    pub ranges: Vec<Range<usize>>,
    /// `blocks[r]`: the micro-batch blocks `members[r]` computes (contiguous, in rank order).
    pub blocks: Vec<Vec<Block>>,
    /// The installed epoch whose copies the transfers read (`None` for the first plan).
    pub from_epoch: Option<u64>,
    /// Copies to make from the `from_epoch` holders (empty when restoring).
    pub transfers: Vec<Transfer<WorkerId>>,
    /// `Some(step)`: every member loads its range from the checkpoint of `step` (0: the seeded
    /// initial state) instead of copying from peers.
    pub restore: Option<u64>,
    /// The first step that runs under this epoch.
    pub resume_step: u64,
}

impl EpochPlan {
    /// The rank of `worker` in this epoch.
    pub fn rank_of(&self, worker: WorkerId) -> Option<usize> {
        self.members.iter().position(|&m| m == worker)
    }

    /// Everyone who must receive this plan: the members and every transfer source.
    pub fn recipients(&self) -> Vec<WorkerId> {
        let mut all: BTreeSet<WorkerId> = self.members.iter().copied().collect();
        all.extend(self.transfers.iter().map(|t| t.from));
        all.into_iter().collect()
    }
}

/// What happened (from the transport, a worker or the timer).
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A worker asks to join, with its measured throughput (micro-batches per second).
    Joined { worker: WorkerId, speed: f64 },
    /// A worker is alive.
    Heartbeat { worker: WorkerId },
    /// A worker holds its range of `epoch` (its transfers or its restore are done).
    Installed { worker: WorkerId, epoch: u64 },
    /// A worker prepared its blocks of `step` (attempt `attempt`) under `epoch`.
    Reported { worker: WorkerId, step: u64, epoch: u64, attempt: u32, blocks: Vec<Block> },
    /// A worker's prepare failed (it is alive).
    StepFailed { worker: WorkerId, step: u64, epoch: u64, attempt: u32, cause: String },
    /// A worker saved its range of committed `step` (committed under `epoch`).
    Saved { worker: WorkerId, step: u64, epoch: u64 },
    /// A worker is gone (connection closed, process exited).
    Left { worker: WorkerId, cause: String },
    /// A worker was asked to stop (SIGTERM): hand its shards over, then leave.
    DrainRequested { worker: WorkerId },
    /// The clock moved; timeouts are checked.
    Tick,
}

/// What the process layer must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    /// Send the plan to [`EpochPlan::recipients`]: members build their ranges (copy the
    /// transfers, or load the checkpoint) and answer [`Event::Installed`].
    Replan(EpochPlan),
    /// Members of `epoch` prepare `step`: each runs its blocks of the plan.
    StartStep { step: u64, epoch: u64, attempt: u32, replay: bool, to: Vec<WorkerId> },
    /// Drop the staged state of this attempt; committed state is untouched.
    Abandon { step: u64, epoch: u64, attempt: u32, to: Vec<WorkerId> },
    /// Make the staged state of this attempt current (and save it if `checkpoint`).
    Commit { step: u64, epoch: u64, attempt: u32, replay: bool, checkpoint: bool, to: Vec<WorkerId> },
    /// A drained worker's shards are handed over: it may exit.
    Release { worker: WorkerId },
    /// A worker is dead to the run: fence it (ignore it, kill the process if it still runs).
    Evict { worker: WorkerId, reason: String },
    /// Every step is committed: save the final state (members' ranges, draining members
    /// included) and stop every worker. Nothing follows.
    Finished { step: u64 },
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Status {
    /// Joined, waiting for the next step boundary.
    Joining,
    /// In the plan (or eligible for the next one).
    Member,
    /// Asked to leave: must hand over by `deadline`.
    Draining { deadline: u64 },
}

#[derive(Debug, Clone)]
struct Worker {
    speed: f64,
    last_heard: u64,
    status: Status,
    failures: u32,
}

#[derive(Debug, Clone, PartialEq)]
enum Phase {
    /// Between steps. `retry_at`: the earliest time of the next attempt.
    Idle { retry_at: u64 },
    /// A plan is being installed.
    Installing { plan: Box<EpochPlan>, waiting: BTreeSet<WorkerId>, since: u64 },
    /// A step attempt is running under the installed epoch.
    Running { step: u64, attempt: u32, replay: bool, waiting: BTreeSet<WorkerId>, since: u64 },
    /// Every step committed.
    Done,
}

/// The coordinator (see the module doc).
#[derive(Debug, Clone)]
pub struct Coordinator {
    cfg: MembershipConfig,
    now: u64,
    workers: BTreeMap<WorkerId, Worker>,
    /// Evicted, left or released: never readmitted, their messages ignored.
    gone: BTreeSet<WorkerId>,
    installed: Option<EpochPlan>,
    last_epoch: u64,
    next_step: u64,
    attempt: u32,
    /// The highest step ever committed.
    high_water: u64,
    /// The newest complete checkpoint (0: the initial state).
    durable: u64,
    /// Checkpoints being saved: step → (epoch, members still to save).
    saves: BTreeMap<u64, (u64, BTreeSet<WorkerId>)>,
    phase: Phase,
    /// Set when the membership must be re-planned before the next step.
    replan_needed: bool,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Phase::Idle { .. } => write!(f, "idle"),
            Phase::Installing { plan, waiting, .. } => write!(f, "installing epoch {} (waiting for {waiting:?})", plan.epoch),
            Phase::Running { step, attempt, waiting, .. } => write!(f, "running step {step} attempt {attempt} (waiting for {waiting:?})"),
            Phase::Done => write!(f, "done"),
        }
    }
}

impl Coordinator {
    /// A coordinator with no workers yet; nothing happens until `min_members` have joined.
    pub fn new(cfg: MembershipConfig) -> Coordinator {
        Coordinator {
            cfg,
            now: 0,
            workers: BTreeMap::new(),
            gone: BTreeSet::new(),
            installed: None,
            last_epoch: 0,
            next_step: 1,
            attempt: 0,
            high_water: 0,
            durable: 0,
            saves: BTreeMap::new(),
            phase: Phase::Idle { retry_at: 0 },
            replan_needed: true,
        }
    }

    pub fn config(&self) -> &MembershipConfig {
        &self.cfg
    }
    /// The installed epoch's plan, if any.
    pub fn installed(&self) -> Option<&EpochPlan> {
        self.installed.as_ref()
    }
    /// The highest step ever committed.
    pub fn committed(&self) -> u64 {
        self.high_water
    }
    /// The newest complete checkpoint.
    pub fn durable(&self) -> u64 {
        self.durable
    }
    /// Whether every step is committed.
    pub fn finished(&self) -> bool {
        self.phase == Phase::Done
    }
    /// Whether `worker` is a live (non-evicted, non-released) worker known to the coordinator.
    pub fn is_live(&self, worker: WorkerId) -> bool {
        self.workers.contains_key(&worker)
    }
    /// A one-line description of the current phase (for logs and failing simulations).
    pub fn describe(&self) -> String {
        let epoch = self.installed.as_ref().map_or("none".to_string(), |p| format!("{} {:?}", p.epoch, p.members));
        format!(
            "{} | installed epoch {epoch} | next step {} | committed {} | durable {} | workers {:?}",
            self.phase,
            self.next_step,
            self.high_water,
            self.durable,
            self.workers.keys().collect::<Vec<_>>()
        )
    }

    /// Feeds one event at time `now_ms` (non-decreasing; an earlier time counts as the last
    /// one) and returns the commands to carry out, in order.
    pub fn handle(&mut self, now_ms: u64, event: Event) -> Vec<Command> {
        self.now = self.now.max(now_ms);
        let mut out = Vec::new();
        match event {
            Event::Joined { worker, speed } => self.on_join(worker, speed),
            Event::Heartbeat { worker } => self.hear(worker),
            Event::Installed { worker, epoch } => {
                self.hear(worker);
                if let Phase::Installing { plan, waiting, .. } = &mut self.phase {
                    if plan.epoch == epoch {
                        waiting.remove(&worker);
                    }
                }
            }
            Event::Reported { worker, step, epoch, attempt, blocks } => {
                self.hear(worker);
                self.on_report(worker, step, epoch, attempt, &blocks);
            }
            Event::StepFailed { worker, step, epoch, attempt, cause } => {
                self.hear(worker);
                self.on_step_failed(worker, step, epoch, attempt, cause, &mut out);
            }
            Event::Saved { worker, step, epoch } => {
                self.hear(worker);
                self.on_saved(worker, step, epoch);
            }
            Event::Left { worker, cause } => self.lose(worker, format!("left: {cause}"), &mut out),
            Event::DrainRequested { worker } => self.on_drain(worker, &mut out),
            Event::Tick => self.check_timeouts(&mut out),
        }
        self.drive(&mut out);
        out
    }

    fn hear(&mut self, worker: WorkerId) {
        if let Some(w) = self.workers.get_mut(&worker) {
            w.last_heard = self.now;
        }
    }

    fn on_join(&mut self, worker: WorkerId, speed: f64) {
        if self.gone.contains(&worker) || self.workers.contains_key(&worker) {
            return; // fenced ids stay out; a duplicate join changes nothing
        }
        self.workers.insert(worker, Worker { speed, last_heard: self.now, status: Status::Joining, failures: 0 });
    }

    fn on_drain(&mut self, worker: WorkerId, out: &mut Vec<Command>) {
        let in_plan = self.in_current_plans(worker);
        let Some(w) = self.workers.get_mut(&worker) else { return };
        if matches!(w.status, Status::Draining { .. }) || self.phase == Phase::Done {
            return; // after Finished every worker is stopped anyway
        }
        if !in_plan {
            // Holds nothing anyone needs: it may go now.
            self.workers.remove(&worker);
            self.gone.insert(worker);
            out.push(Command::Release { worker });
            return;
        }
        w.status = Status::Draining { deadline: self.now.saturating_add(self.cfg.drain_grace_ms) };
        self.replan_needed = true;
    }

    /// Whether `worker` is a member or source of the installed or installing plan.
    fn in_current_plans(&self, worker: WorkerId) -> bool {
        let installing = match &self.phase {
            Phase::Installing { plan, .. } => plan.recipients().contains(&worker),
            _ => false,
        };
        installing || self.installed.as_ref().is_some_and(|p| p.rank_of(worker).is_some())
    }

    fn on_report(&mut self, worker: WorkerId, step: u64, epoch: u64, attempt: u32, blocks: &[Block]) {
        let Some(plan) = &self.installed else { return };
        let Phase::Running { step: s, attempt: a, waiting, .. } = &mut self.phase else { return };
        if (step, epoch, attempt) != (*s, plan.epoch, *a) || !waiting.contains(&worker) {
            return; // stale (an earlier attempt or epoch) or a duplicate
        }
        let assigned = plan.rank_of(worker).map(|r| plan.blocks[r].as_slice());
        if assigned == Some(blocks) {
            waiting.remove(&worker);
            if let Some(w) = self.workers.get_mut(&worker) {
                w.failures = 0;
            }
        }
    }

    fn on_step_failed(&mut self, worker: WorkerId, step: u64, epoch: u64, attempt: u32, cause: String, out: &mut Vec<Command>) {
        let current = match (&self.phase, &self.installed) {
            (Phase::Running { step: s, attempt: a, waiting, .. }, Some(plan)) => {
                (step, epoch, attempt) == (*s, plan.epoch, *a) && waiting.contains(&worker)
            }
            _ => false,
        };
        if !current {
            return;
        }
        let failures = self.workers.get_mut(&worker).map(|w| {
            w.failures += 1;
            w.failures
        });
        self.abandon_running(out);
        self.attempt += 1;
        self.phase = Phase::Idle { retry_at: self.now.saturating_add(self.cfg.retry_delay_ms) };
        if failures.is_some_and(|f| f >= self.cfg.max_step_failures.max(1)) {
            self.lose(worker, format!("failed {} attempts in a row (last: {cause})", self.cfg.max_step_failures.max(1)), out);
        }
    }

    fn on_saved(&mut self, worker: WorkerId, step: u64, epoch: u64) {
        let Some((e, waiting)) = self.saves.get_mut(&step) else { return };
        if *e != epoch {
            return;
        }
        waiting.remove(&worker);
        if waiting.is_empty() {
            self.saves.remove(&step);
            self.durable = self.durable.max(step);
        }
    }

    /// Sends Abandon for the running attempt to its live members.
    fn abandon_running(&mut self, out: &mut Vec<Command>) {
        if let (Phase::Running { step, attempt, .. }, Some(plan)) = (&self.phase, &self.installed) {
            let to: Vec<WorkerId> = plan.members.iter().copied().filter(|m| self.workers.contains_key(m)).collect();
            out.push(Command::Abandon { step: *step, epoch: plan.epoch, attempt: *attempt, to });
        }
    }

    /// `worker` is dead to the run (left, silent, hung, or out of grace): evict and recover.
    fn lose(&mut self, worker: WorkerId, reason: String, out: &mut Vec<Command>) {
        if self.workers.remove(&worker).is_none() {
            return;
        }
        self.gone.insert(worker);
        out.push(Command::Evict { worker, reason });
        // A checkpoint this worker had not saved yet will never be complete.
        self.saves.retain(|_, (_, waiting)| !waiting.contains(&worker));
        let in_installed = self.installed.as_ref().is_some_and(|p| p.rank_of(worker).is_some());
        match &self.phase {
            Phase::Running { .. } if in_installed => {
                self.abandon_running(out);
                self.phase = Phase::Idle { retry_at: self.now };
            }
            Phase::Installing { plan, .. } if plan.recipients().contains(&worker) => {
                // Members keep their copies of the installed epoch: plan again from those.
                self.phase = Phase::Idle { retry_at: self.now };
                self.replan_needed = true;
            }
            _ => {}
        }
        if in_installed {
            self.replan_needed = true;
        }
    }

    fn check_timeouts(&mut self, out: &mut Vec<Command>) {
        let now = self.now;
        let mut lost: Vec<(WorkerId, String)> = Vec::new();
        for (&id, w) in &self.workers {
            if now.saturating_sub(w.last_heard) > self.cfg.heartbeat_timeout_ms {
                lost.push((id, format!("no heartbeat for {} ms (timeout {} ms)", now - w.last_heard, self.cfg.heartbeat_timeout_ms)));
            } else if let Status::Draining { deadline } = w.status {
                if now > deadline {
                    lost.push((id, format!("did not hand over its shards within the drain grace of {} ms", self.cfg.drain_grace_ms)));
                }
            }
        }
        match &self.phase {
            Phase::Running { step, waiting, since, .. } if now.saturating_sub(*since) > self.cfg.step_timeout_ms => {
                let why = format!("hung: no report of step {step} within {} ms", self.cfg.step_timeout_ms);
                lost.extend(waiting.iter().map(|&w| (w, why.clone())));
            }
            Phase::Installing { plan, waiting, since } if now.saturating_sub(*since) > self.cfg.step_timeout_ms => {
                let why = format!("hung: epoch {} not installed within {} ms", plan.epoch, self.cfg.step_timeout_ms);
                lost.extend(waiting.iter().map(|&w| (w, why.clone())));
            }
            _ => {}
        }
        for (worker, reason) in lost {
            self.lose(worker, reason, out);
        }
    }

    /// Advances the protocol as far as it goes without new events.
    fn drive(&mut self, out: &mut Vec<Command>) {
        loop {
            match &mut self.phase {
                Phase::Done => return,
                Phase::Installing { waiting, .. } if waiting.is_empty() => self.finish_install(out),
                Phase::Running { waiting, .. } if waiting.is_empty() => self.commit(out),
                Phase::Installing { .. } | Phase::Running { .. } => return,
                Phase::Idle { retry_at } => {
                    let retry_at = *retry_at;
                    if !self.boundary(retry_at, out) {
                        return;
                    }
                }
            }
        }
    }

    /// At a step boundary: finish, re-plan, or start the next attempt. False when waiting.
    fn boundary(&mut self, retry_at: u64, out: &mut Vec<Command>) -> bool {
        if self.next_step > self.cfg.steps {
            self.phase = Phase::Done;
            // The process layer saves the final state from the members (draining ones included)
            // and stops every worker: no Release follows.
            out.push(Command::Finished { step: self.high_water });
            return false;
        }
        let joining = self.workers.values().any(|w| w.status == Status::Joining);
        if self.replan_needed || joining || self.installed.is_none() {
            return self.start_replan(out);
        }
        if self.now < retry_at {
            return false;
        }
        let Some(plan) = &self.installed else { return false };
        let replay = self.next_step <= self.high_water;
        let (step, attempt) = (self.next_step, self.attempt);
        out.push(Command::StartStep { step, epoch: plan.epoch, attempt, replay, to: plan.members.clone() });
        self.phase = Phase::Running { step, attempt, replay, waiting: plan.members.iter().copied().collect(), since: self.now };
        true
    }

    /// Computes and sends the next epoch's plan. False when too few workers are left.
    fn start_replan(&mut self, out: &mut Vec<Command>) -> bool {
        let eligible: Vec<WorkerId> =
            self.workers.iter().filter(|(_, w)| matches!(w.status, Status::Joining | Status::Member)).map(|(&id, _)| id).collect();
        if eligible.len() < self.cfg.min_members.max(1) {
            return false; // paused: wait for joins (drain deadlines and timeouts still run)
        }
        let old: Vec<OldShard<WorkerId>> = self.installed.as_ref().map_or_else(Vec::new, |p| {
            p.members
                .iter()
                .zip(&p.ranges)
                .map(|(&m, r)| OldShard { member: m, range: r.clone(), alive: self.workers.contains_key(&m) })
                .collect()
        });
        let re = replan_partition(self.cfg.total_elems, self.cfg.align, &old, &eligible);
        let speeds: Vec<f64> = re.members.iter().map(|m| self.workers.get(m).map_or(0.0, |w| w.speed)).collect();
        let restore = (self.installed.is_none() || !re.orphaned.is_empty()).then_some(self.durable);
        self.last_epoch += 1;
        let plan = EpochPlan {
            epoch: self.last_epoch,
            blocks: blocks_for_speeds(self.cfg.micro_batches, &speeds),
            members: re.members,
            ranges: re.ranges,
            from_epoch: self.installed.as_ref().map(|p| p.epoch),
            transfers: if restore.is_some() { Vec::new() } else { re.transfers },
            restore,
            resume_step: restore.map_or(self.next_step, |d| d + 1),
        };
        for m in &plan.members {
            if let Some(w) = self.workers.get_mut(m) {
                w.status = Status::Member;
            }
        }
        out.push(Command::Replan(plan.clone()));
        let waiting = plan.members.iter().copied().collect();
        self.phase = Phase::Installing { plan: Box::new(plan), waiting, since: self.now };
        self.replan_needed = false;
        true
    }

    fn finish_install(&mut self, out: &mut Vec<Command>) {
        let Phase::Installing { plan, .. } = std::mem::replace(&mut self.phase, Phase::Idle { retry_at: self.now }) else { return };
        let plan = *plan;
        if plan.restore.is_some() || plan.resume_step != self.next_step {
            self.attempt = 0;
        }
        self.next_step = plan.resume_step;
        // Draining workers outside the new plan have handed everything over (a drain that
        // arrived while this plan was installing keeps its member until the next plan).
        let draining: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|(id, w)| matches!(w.status, Status::Draining { .. }) && plan.rank_of(**id).is_none())
            .map(|(&id, _)| id)
            .collect();
        for worker in draining {
            self.workers.remove(&worker);
            self.gone.insert(worker);
            out.push(Command::Release { worker });
        }
        self.installed = Some(plan);
    }

    fn commit(&mut self, out: &mut Vec<Command>) {
        let Phase::Running { step, attempt, replay, .. } = self.phase else { return };
        let Some(plan) = &self.installed else { return };
        let checkpoint = self.cfg.checkpoint_every > 0 && step % self.cfg.checkpoint_every == 0;
        out.push(Command::Commit { step, epoch: plan.epoch, attempt, replay, checkpoint, to: plan.members.clone() });
        if checkpoint {
            self.saves.insert(step, (plan.epoch, plan.members.iter().copied().collect()));
        }
        self.high_water = self.high_water.max(step);
        self.next_step = step + 1;
        self.attempt = 0;
        self.phase = Phase::Idle { retry_at: self.now };
    }
}

#[cfg(test)]
impl Coordinator {
    fn installing_plan(&self) -> Option<EpochPlan> {
        match &self.phase {
            Phase::Installing { plan, .. } => Some((**plan).clone()),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> MembershipConfig {
        MembershipConfig {
            micro_batches: 8,
            total_elems: 64,
            align: 4,
            steps: 3,
            min_members: 1,
            heartbeat_timeout_ms: 100,
            step_timeout_ms: 500,
            drain_grace_ms: 1000,
            retry_delay_ms: 150,
            max_step_failures: 3,
            checkpoint_every: 2,
        }
    }

    fn plan_of(cmds: &[Command]) -> EpochPlan {
        cmds.iter()
            .find_map(|c| if let Command::Replan(p) = c { Some(p.clone()) } else { None })
            .unwrap_or_else(|| panic!("no replan in {cmds:?}"))
    }

    fn install(c: &mut Coordinator, t: u64, plan: &EpochPlan) -> Vec<Command> {
        let mut out = Vec::new();
        for &m in &plan.members {
            out = c.handle(t, Event::Installed { worker: m, epoch: plan.epoch });
        }
        out
    }

    fn report_all(c: &mut Coordinator, t: u64, plan: &EpochPlan, step: u64, attempt: u32) -> Vec<Command> {
        let mut out = Vec::new();
        for (r, &m) in plan.members.iter().enumerate() {
            let blocks = plan.blocks[r].clone();
            out.extend(c.handle(t, Event::Reported { worker: m, step, epoch: plan.epoch, attempt, blocks }));
        }
        out
    }

    #[test]
    fn steps_commit_in_order_and_a_death_restores_and_replays() {
        let mut c = Coordinator::new(cfg());
        assert!(c.handle(0, Event::Joined { worker: 1, speed: 1.0 }).iter().any(|x| matches!(x, Command::Replan(_))));
        // The second joiner waits for the boundary after epoch 1 is installed.
        assert!(c.handle(0, Event::Joined { worker: 2, speed: 1.0 }).is_empty());
        let p1 = c.installing_plan().expect("installing");
        let out = install(&mut c, 1, &p1);
        let p2 = plan_of(&out);
        assert_eq!((p2.members.clone(), p2.restore), (vec![1, 2], None));
        assert_eq!(p2.transfers, vec![Transfer { range: 32..64, from: 1, to: 2 }]);
        let out = install(&mut c, 2, &p2);
        assert!(matches!(out.last(), Some(Command::StartStep { step: 1, epoch: 2, attempt: 0, replay: false, .. })), "{out:?}");
        let out = report_all(&mut c, 3, &p2, 1, 0);
        assert!(out.iter().any(|x| matches!(x, Command::Commit { step: 1, checkpoint: false, .. })), "{out:?}");
        let out = report_all(&mut c, 4, &p2, 2, 0);
        assert!(out.iter().any(|x| matches!(x, Command::Commit { step: 2, checkpoint: true, .. })), "{out:?}");
        c.handle(5, Event::Saved { worker: 1, step: 2, epoch: 2 });
        c.handle(5, Event::Saved { worker: 2, step: 2, epoch: 2 });
        assert_eq!(c.durable(), 2);
        // Step 3 runs; worker 2 dies before reporting: abandon, replan, restore from step 2.
        let out = c.handle(6, Event::Left { worker: 2, cause: "killed".into() });
        assert!(out.iter().any(|x| matches!(x, Command::Abandon { step: 3, .. })), "{out:?}");
        let p3 = plan_of(&out);
        assert_eq!((p3.members.clone(), p3.restore, p3.resume_step), (vec![1], Some(2), 3));
        let out = install(&mut c, 7, &p3);
        assert!(matches!(out.last(), Some(Command::StartStep { step: 3, epoch: 3, replay: false, .. })), "{out:?}");
        // A stale report of the abandoned attempt is ignored.
        let stale = c.handle(8, Event::Reported { worker: 1, step: 3, epoch: 2, attempt: 0, blocks: p2.blocks[0].clone() });
        assert!(stale.is_empty(), "{stale:?}");
        let out = report_all(&mut c, 9, &p3, 3, 0);
        assert!(out.iter().any(|x| matches!(x, Command::Finished { step: 3 })), "{out:?}");
        assert_eq!(c.committed(), 3);
    }

    #[test]
    fn hung_member_is_evicted_after_the_step_timeout_and_drain_hands_over() {
        let mut c = Coordinator::new(MembershipConfig { min_members: 2, steps: 10, ..cfg() });
        c.handle(0, Event::Joined { worker: 1, speed: 1.0 });
        let out = c.handle(0, Event::Joined { worker: 2, speed: 3.0 });
        let p = plan_of(&out);
        assert_eq!(p.blocks, vec![vec![(0, 1)], vec![(2, 1), (4, 2)]], "the faster worker gets more");
        install(&mut c, 1, &p);
        c.handle(10, Event::Reported { worker: 1, step: 1, epoch: p.epoch, attempt: 0, blocks: p.blocks[0].clone() });
        // Worker 2 heartbeats but never reports: hung.
        for t in (50..=500).step_by(50) {
            c.handle(t, Event::Heartbeat { worker: 1 });
            c.handle(t, Event::Heartbeat { worker: 2 });
        }
        let out = c.handle(502, Event::Tick);
        assert!(out.iter().any(|x| matches!(x, Command::Evict { worker: 2, .. })), "{out:?}");
        assert!(out.iter().any(|x| matches!(x, Command::Abandon { step: 1, .. })), "{out:?}");
        assert!(!out.iter().any(|x| matches!(x, Command::Replan(_))), "paused below min_members: {out:?}");
        let out = c.handle(503, Event::Joined { worker: 3, speed: 1.0 });
        let p = plan_of(&out);
        assert_eq!(p.restore, Some(0), "worker 2's range is gone: restore the initial state");
        install(&mut c, 504, &p);
        // Worker 3 drains: it stays a source of the next epoch and is released once installed.
        let out = c.handle(505, Event::DrainRequested { worker: 3 });
        assert!(out.is_empty(), "drain waits for the step boundary: {out:?}");
        let out = report_all(&mut c, 506, &p, 1, 0);
        assert!(!out.iter().any(|x| matches!(x, Command::Replan(_))), "paused: one member left would be below min: {out:?}");
        c.handle(507, Event::Joined { worker: 4, speed: 1.0 });
        let p = c.installing_plan().expect("installing");
        assert!(p.transfers.iter().any(|t| t.from == 3), "{p:?}");
        let out = install(&mut c, 508, &p);
        assert_eq!(out.first(), Some(&Command::Release { worker: 3 }), "{out:?}");
    }

    #[test]
    fn repeated_compute_errors_evict_the_worker() {
        let mut c = Coordinator::new(MembershipConfig { steps: 5, min_members: 2, ..cfg() });
        c.handle(0, Event::Joined { worker: 1, speed: 1.0 });
        c.handle(0, Event::Joined { worker: 2, speed: 1.0 });
        let p = c.installing_plan().expect("installing");
        install(&mut c, 1, &p);
        let mut t = 1;
        for attempt in 0..3 {
            let out = c.handle(t, Event::StepFailed { worker: 2, step: 1, epoch: p.epoch, attempt, cause: "nan".into() });
            assert!(out.iter().any(|x| matches!(x, Command::Abandon { step: 1, .. })), "{out:?}");
            t += 200;
            let mut out = c.handle(t, Event::Heartbeat { worker: 1 });
            out.extend(c.handle(t, Event::Heartbeat { worker: 2 }));
            if attempt < 2 {
                assert!(matches!(out.last(), Some(Command::StartStep { attempt: a, .. }) if *a == attempt + 1), "{out:?}");
            }
        }
        assert!(!c.is_live(2));
    }
}
