//! A deterministic simulator for the membership protocol ([`crate::membership`]): simulated
//! workers, a network with delays, reordering (across links) and lost heartbeats, and seeded
//! faults (kills, hangs, network partitions, compute errors, joins, SIGTERM drains). Every
//! command the coordinator emits is checked against an oracle that does not trust the
//! coordinator's own bookkeeping; workers check that the state they are told to advance is the
//! state they hold. One seed gives one run, bit for bit.
//!
//! Replay a failing seed with `TESSERA_SIM_SEED=<seed> cargo test -p tessera-actors sim_replay
//! -- --nocapture` (it prints the trace).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::ops::Range;

use tessera_kernels::tensor::Rng;

use crate::membership::{Block, Command, Coordinator, EpochPlan, Event, MembershipConfig, WorkerId};

/// (step, epoch, attempt).
type Attempt = (u64, u64, u32);

/// Simulated time (ms) after which a run that has not finished is a liveness failure.
const TIME_LIMIT_MS: u64 = 120_000;
/// No new faults after this time, so a correct protocol always finishes.
const FAULTS_UNTIL_MS: u64 = 20_000;
const HEARTBEAT_EVERY_MS: u64 = 20;
const TICK_EVERY_MS: u64 = 10;

/// What a simulated process does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Health {
    Running,
    /// The compute never finishes; heartbeats and the data server keep going.
    Hung,
    /// Cut off from everyone (it keeps running: a zombie once evicted).
    Partitioned,
    /// Exited (crashed, evicted, released or killed after the drain grace).
    Exited,
}

/// One copy of a range at a committed step, held for a plan epoch.
#[derive(Debug, Clone, PartialEq)]
struct Holding {
    range: Range<usize>,
    step: u64,
}

#[derive(Debug)]
struct SimWorker {
    speed: f64,
    health: Health,
    plans: BTreeMap<u64, EpochPlan>,
    copies: BTreeMap<u64, Holding>,
    staged: Option<(u64, u64, u32)>,
    /// Asked to leave (SIGTERM): it still serves until released or killed.
    draining: bool,
    /// The next compute fails (an injected error) instead of reporting.
    fail_next: bool,
    /// The newest plan epoch this worker was sent.
    latest_plan: u64,
}

#[derive(Debug)]
enum Item {
    /// A message reaches the coordinator.
    ToCoord(Event),
    /// A command reaches a worker.
    ToWorker(WorkerId, Command),
    ComputeDone {
        worker: WorkerId,
        step: u64,
        epoch: u64,
        attempt: u32,
    },
    Heartbeat(WorkerId),
    Tick,
    Fault,
    /// The drain grace ran out: the process is killed.
    Kill(WorkerId),
    /// A transfer source had not applied the step the plan resumes from: ask again.
    RetryInstall(WorkerId, Box<EpochPlan>),
}

/// The outcome of one simulated run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimOutcome {
    pub seed: u64,
    /// Simulated time at the end (ms).
    pub time_ms: u64,
    pub events: u64,
    pub epochs: u64,
    pub evictions: u64,
    pub replays: u64,
    pub faults: u64,
}

struct Sim {
    rng: Rng,
    now: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<(u64, u64, usize)>>,
    items: Vec<Option<Item>>,
    coord: Coordinator,
    workers: BTreeMap<WorkerId, SimWorker>,
    next_id: WorkerId,
    /// FIFO per link: the last delivery time of coordinator → worker and worker → coordinator.
    link_down: BTreeMap<WorkerId, u64>,
    link_up: BTreeMap<WorkerId, u64>,
    // Oracle state.
    plans: BTreeMap<u64, EpochPlan>,
    installed_acks: BTreeMap<u64, BTreeSet<WorkerId>>,
    reports: BTreeMap<Attempt, Vec<(WorkerId, Vec<Block>)>>,
    open_attempt: Option<(u64, u64, u32)>,
    /// Workers the coordinator evicted or released (from its commands, in order).
    fenced: BTreeSet<WorkerId>,
    high: u64,
    checkpoints: BTreeMap<u64, Vec<Range<usize>>>,
    trace: Vec<String>,
    keep_trace: bool,
    out: SimOutcome,
}

fn sim_config(rng: &mut Rng) -> MembershipConfig {
    MembershipConfig {
        micro_batches: 1 + rng.gen_range(12) as usize,
        total_elems: 16 + rng.gen_range(200) as usize,
        align: [1, 4, 16][rng.gen_range(3) as usize],
        steps: 4 + rng.gen_range(28),
        min_members: 1 + rng.gen_range(2) as usize,
        heartbeat_timeout_ms: 100,
        step_timeout_ms: 1_000,
        drain_grace_ms: 800,
        retry_delay_ms: 150,
        max_step_failures: 3,
        checkpoint_every: rng.gen_range(4),
    }
}

/// Runs seed `seed`; `Err` names the violated invariant, with the trace's tail (or all of it
/// when `keep_trace`).
pub fn run_seed(seed: u64, keep_trace: bool) -> Result<SimOutcome, String> {
    let mut rng = Rng::derive(seed, &[0x51_u64]);
    let cfg = sim_config(&mut rng);
    let mut sim = Sim {
        rng,
        now: 0,
        seq: 0,
        queue: BinaryHeap::new(),
        items: Vec::new(),
        coord: Coordinator::new(cfg.clone()),
        workers: BTreeMap::new(),
        next_id: 1,
        link_down: BTreeMap::new(),
        link_up: BTreeMap::new(),
        plans: BTreeMap::new(),
        installed_acks: BTreeMap::new(),
        reports: BTreeMap::new(),
        open_attempt: None,
        fenced: BTreeSet::new(),
        high: 0,
        checkpoints: BTreeMap::new(),
        trace: Vec::new(),
        keep_trace,
        out: SimOutcome { seed, time_ms: 0, events: 0, epochs: 0, evictions: 0, replays: 0, faults: 0 },
    };
    sim.note(format!("config {cfg:?}"));
    let first = 1 + sim.rng.gen_range(4);
    for _ in 0..first {
        sim.spawn_worker();
    }
    sim.push(TICK_EVERY_MS, Item::Tick);
    let first_fault = 50 + sim.rng.gen_range(300);
    sim.push(first_fault, Item::Fault);
    let result = sim.run();
    match result {
        Ok(()) => Ok(sim.out),
        Err(e) => {
            let tail = if keep_trace { sim.trace.len() } else { 40.min(sim.trace.len()) };
            let trace = sim.trace[sim.trace.len() - tail..].join("\n  ");
            Err(format!("seed {seed}: {e}\n  coordinator: {}\n  trace (last {tail}):\n  {trace}", sim.coord.describe()))
        }
    }
}

impl Sim {
    fn note(&mut self, line: String) {
        if self.keep_trace || self.trace.len() < 100_000 {
            self.trace.push(format!("{:>6} {line}", self.now));
        }
        if self.trace.len() > 2_000 && !self.keep_trace {
            self.trace.drain(..1_000);
        }
    }

    fn push(&mut self, delay: u64, item: Item) {
        self.seq += 1;
        self.items.push(Some(item));
        self.queue.push(Reverse((self.now + delay, self.seq, self.items.len() - 1)));
    }

    fn delay(&mut self) -> u64 {
        1 + self.rng.gen_range(20)
    }

    fn spawn_worker(&mut self) {
        let id = self.next_id;
        self.next_id += 1;
        let speed = 0.05 + self.rng.next_f64() * 0.4;
        self.workers.insert(
            id,
            SimWorker {
                speed,
                health: Health::Running,
                plans: BTreeMap::new(),
                copies: BTreeMap::new(),
                staged: None,
                draining: false,
                fail_next: false,
                latest_plan: 0,
            },
        );
        // Measured speed: the true one with ±20 % noise.
        let measured = speed * (0.8 + 0.4 * self.rng.next_f64());
        self.note(format!("spawn worker {id} speed {speed:.3}"));
        self.send_up(id, Event::Joined { worker: id, speed: measured });
        let first_beat = self.rng.gen_range(HEARTBEAT_EVERY_MS);
        self.push(first_beat, Item::Heartbeat(id));
    }

    fn can_talk(&self, id: WorkerId) -> bool {
        self.workers.get(&id).is_some_and(|w| matches!(w.health, Health::Running | Health::Hung))
    }

    /// Worker → coordinator on its (reliable, FIFO) link.
    fn send_up(&mut self, id: WorkerId, event: Event) {
        if !self.can_talk(id) {
            return;
        }
        let at = (self.now + self.delay()).max(self.link_up.get(&id).copied().unwrap_or(0));
        self.link_up.insert(id, at);
        self.push(at - self.now, Item::ToCoord(event));
    }

    /// Coordinator → worker on its (reliable, FIFO) link.
    fn send_down(&mut self, id: WorkerId, cmd: Command) {
        let at = (self.now + self.delay()).max(self.link_down.get(&id).copied().unwrap_or(0));
        self.link_down.insert(id, at);
        self.push(at - self.now, Item::ToWorker(id, cmd));
    }

    fn run(&mut self) -> Result<(), String> {
        while let Some(Reverse((at, _, idx))) = self.queue.pop() {
            self.now = at;
            self.out.time_ms = at;
            if at > TIME_LIMIT_MS {
                return Err(format!("liveness: not finished after {TIME_LIMIT_MS} ms of simulated time"));
            }
            let Some(item) = self.items[idx].take() else { continue };
            self.out.events += 1;
            match item {
                Item::ToCoord(event) => {
                    let sender = sender_of(&event);
                    if !self.can_talk(sender) && !matches!(event, Event::Left { .. }) {
                        continue; // the sender was cut off after sending: the message is lost
                    }
                    self.deliver_to_coord(event)?;
                }
                Item::ToWorker(id, cmd) => self.on_worker_command(id, cmd)?,
                Item::ComputeDone { worker, step, epoch, attempt } => self.compute_done(worker, step, epoch, attempt),
                Item::Heartbeat(id) => {
                    if self.workers.get(&id).is_some_and(|w| w.health != Health::Exited) {
                        // Heartbeats are datagrams: some are lost.
                        if self.rng.gen_range(20) != 0 {
                            let at = self.delay();
                            if self.can_talk(id) {
                                self.push(at, Item::ToCoord(Event::Heartbeat { worker: id }));
                            }
                        }
                        self.push(HEARTBEAT_EVERY_MS, Item::Heartbeat(id));
                    }
                }
                Item::Tick => {
                    self.deliver_to_coord(Event::Tick)?;
                    if self.coord.finished() {
                        return self.check_end();
                    }
                    self.push(TICK_EVERY_MS, Item::Tick);
                }
                Item::Fault => {
                    if self.now < FAULTS_UNTIL_MS {
                        self.fault();
                    } else {
                        self.top_up();
                    }
                    let next = 20 + self.rng.gen_range(300);
                    self.push(next, Item::Fault);
                }
                Item::RetryInstall(id, plan) => {
                    let current = self.workers.get(&id).is_some_and(|w| w.latest_plan == plan.epoch);
                    if current && self.can_talk(id) {
                        self.install(id, *plan)?;
                    }
                }
                Item::Kill(id) => {
                    if let Some(w) = self.workers.get_mut(&id) {
                        if w.health != Health::Exited {
                            w.health = Health::Exited;
                            self.note(format!("worker {id} killed after its drain grace"));
                            self.push(1, Item::ToCoord(Event::Left { worker: id, cause: "killed after drain grace".into() }));
                        }
                    }
                }
            }
        }
        Err("the event queue ran dry before the run finished".into())
    }

    fn live_ids(&self) -> Vec<WorkerId> {
        self.workers.iter().filter(|(_, w)| w.health != Health::Exited).map(|(&id, _)| id).collect()
    }

    /// After the faults stop: keep enough healthy workers for the run to finish.
    fn top_up(&mut self) {
        let healthy = self.workers.values().filter(|w| w.health == Health::Running && !w.draining).count();
        if healthy < self.coord.config().min_members && self.workers.len() < 40 {
            self.spawn_worker();
        }
    }

    fn fault(&mut self) {
        let live = self.live_ids();
        let healthy: Vec<WorkerId> =
            live.iter().copied().filter(|id| self.workers[id].health == Health::Running && !self.workers[id].draining).collect();
        let kind = self.rng.gen_range(8);
        // Keep the pool from running dry: join when few workers are healthy.
        let min = self.coord.config().min_members;
        if healthy.len() < min + 1 || kind == 0 || kind == 1 {
            if self.workers.len() < 24 {
                self.out.faults += 1;
                self.spawn_worker();
            }
            return;
        }
        let victim = healthy[self.rng.gen_range(healthy.len() as u64) as usize];
        self.out.faults += 1;
        match kind {
            2 => {
                // Crash: sometimes the connection reset tells the coordinator, sometimes only silence does.
                self.note(format!("fault: crash worker {victim}"));
                let tell = self.rng.gen_range(2) == 0;
                if tell {
                    let at = self.delay();
                    self.push(at, Item::ToCoord(Event::Left { worker: victim, cause: "connection reset".into() }));
                }
                self.set_health(victim, Health::Exited);
            }
            3 => {
                self.note(format!("fault: hang worker {victim}"));
                self.set_health(victim, Health::Hung);
            }
            4 => {
                self.note(format!("fault: partition worker {victim}"));
                self.set_health(victim, Health::Partitioned);
            }
            5 => {
                self.note(format!("fault: SIGTERM worker {victim}"));
                if let Some(w) = self.workers.get_mut(&victim) {
                    w.draining = true;
                }
                self.send_up(victim, Event::DrainRequested { worker: victim });
                let grace = self.coord.config().drain_grace_ms + 50;
                self.push(grace, Item::Kill(victim));
            }
            _ => {
                self.note(format!("fault: the next compute of worker {victim} fails"));
                if let Some(w) = self.workers.get_mut(&victim) {
                    w.fail_next = true;
                }
            }
        }
    }

    fn set_health(&mut self, id: WorkerId, h: Health) {
        if let Some(w) = self.workers.get_mut(&id) {
            w.health = h;
        }
    }

    fn deliver_to_coord(&mut self, event: Event) -> Result<(), String> {
        if !matches!(event, Event::Tick | Event::Heartbeat { .. }) {
            self.note(format!("coord <- {event:?}"));
        }
        let cmds = self.coord.handle(self.now, event);
        for cmd in cmds {
            self.note(format!("coord -> {}", short(&cmd)));
            self.check_command(&cmd)?;
            self.dispatch(cmd);
        }
        Ok(())
    }

    fn dispatch(&mut self, cmd: Command) {
        let to: Vec<WorkerId> = match &cmd {
            Command::Replan(plan) => plan.recipients(),
            Command::StartStep { to, .. } | Command::Abandon { to, .. } | Command::Commit { to, .. } => to.clone(),
            Command::Release { worker } | Command::Evict { worker, .. } => vec![*worker],
            Command::Finished { .. } => Vec::new(),
        };
        for id in to {
            if self.can_talk(id) {
                self.send_down(id, cmd.clone());
            }
        }
    }

    /// The oracle: every command against the invariants, using only what it saw.
    fn check_command(&mut self, cmd: &Command) -> Result<(), String> {
        let cfg = self.coord.config().clone();
        match cmd {
            Command::Replan(plan) => {
                self.out.epochs += 1;
                if let Some(open) = self.open_attempt {
                    return Err(format!("re-plan while attempt {open:?} is open (joins/leaves must wait for the step boundary)"));
                }
                let mut next = 0;
                for r in &plan.ranges {
                    if r.start != next || (r.end != cfg.total_elems && r.end % cfg.align != 0) {
                        return Err(format!("epoch {} ranges are not an aligned cover: {:?}", plan.epoch, plan.ranges));
                    }
                    next = r.end;
                }
                if next != cfg.total_elems || plan.members.is_empty() {
                    return Err(format!("epoch {} does not own every element once: {:?}", plan.epoch, plan.ranges));
                }
                let mut leaf = 0;
                for &(first, level) in plan.blocks.iter().flatten() {
                    if first != leaf || first % (1 << level) != 0 {
                        return Err(format!("epoch {} blocks are not aligned and in order: {:?}", plan.epoch, plan.blocks));
                    }
                    leaf = first + (1 << level);
                }
                if leaf != cfg.micro_batches {
                    return Err(format!(
                        "epoch {} blocks do not cover the {} micro-batches: {:?}",
                        plan.epoch, cfg.micro_batches, plan.blocks
                    ));
                }
                if let Some(d) = plan.restore {
                    if d != 0 && !self.checkpoint_complete(d, cfg.total_elems) {
                        return Err(format!("epoch {} restores step {d}, whose checkpoint is incomplete", plan.epoch));
                    }
                    if plan.resume_step != d + 1 {
                        return Err(format!("epoch {} restores step {d} but resumes at {}", plan.epoch, plan.resume_step));
                    }
                }
                if plan.resume_step > self.high + 1 {
                    return Err(format!("epoch {} resumes at step {} but only {} are committed", plan.epoch, plan.resume_step, self.high));
                }
                self.plans.insert(plan.epoch, plan.clone());
            }
            Command::StartStep { step, epoch, attempt, replay, to } => {
                if self.open_attempt.is_some() {
                    return Err(format!("step {step} started while {:?} is open", self.open_attempt));
                }
                let plan = self.plans.get(epoch).ok_or(format!("step {step} under unknown epoch {epoch}"))?;
                let acks = self.installed_acks.get(epoch).cloned().unwrap_or_default();
                if plan.members.iter().any(|m| !acks.contains(m)) || *to != plan.members {
                    return Err(format!("step {step} started under epoch {epoch} before every member installed it ({acks:?})"));
                }
                if *replay != (*step <= self.high) || *step > self.high + 1 {
                    return Err(format!("step {step} replay={replay} but {} steps are committed", self.high));
                }
                self.open_attempt = Some((*step, *epoch, *attempt));
            }
            Command::Abandon { step, epoch, attempt, .. } => {
                if self.open_attempt != Some((*step, *epoch, *attempt)) {
                    return Err(format!("abandon of {:?} but the open attempt is {:?}", (step, epoch, attempt), self.open_attempt));
                }
                self.open_attempt = None;
            }
            Command::Commit { step, epoch, attempt, replay, .. } => {
                let key = (*step, *epoch, *attempt);
                if self.open_attempt != Some(key) {
                    return Err(format!("commit of {key:?} but the open attempt is {:?}", self.open_attempt));
                }
                self.open_attempt = None;
                let plan = self.plans.get(epoch).ok_or(format!("commit under unknown epoch {epoch}"))?;
                let mut covered = vec![0u32; cfg.micro_batches];
                for (worker, blocks) in self.reports.get(&key).map(Vec::as_slice).unwrap_or(&[]) {
                    if plan.rank_of(*worker).is_none() || self.fenced.contains(worker) {
                        return Err(format!("step {step} commits a report of worker {worker}, not a live member of epoch {epoch}"));
                    }
                    for &(first, level) in blocks {
                        (first..first + (1 << level)).for_each(|i| covered[i] += 1);
                    }
                }
                if covered.iter().any(|&c| c != 1) {
                    return Err(format!("step {step} commits without every micro-batch reported once: {covered:?}"));
                }
                if *replay {
                    self.out.replays += 1;
                    if *step > self.high {
                        return Err(format!("replay commit of step {step} beyond the committed {}", self.high));
                    }
                } else if *step != self.high + 1 {
                    return Err(format!("step {step} committed after step {} (lost or twice)", self.high));
                } else {
                    self.high = *step;
                }
            }
            Command::Release { worker } => {
                self.fenced.insert(*worker);
                // Released only once no installed or installing plan needs its copies.
                let latest = self.plans.keys().next_back().copied();
                if let Some(e) = latest {
                    let plan = &self.plans[&e];
                    let acks = self.installed_acks.get(&e).cloned().unwrap_or_default();
                    let installed = plan.members.iter().all(|m| acks.contains(m));
                    if plan.rank_of(*worker).is_some() || (!installed && !self.coord.finished() && plan.recipients().contains(worker)) {
                        return Err(format!("worker {worker} released while epoch {e} still needs it"));
                    }
                }
            }
            Command::Evict { worker, .. } => {
                self.fenced.insert(*worker);
                self.out.evictions += 1;
            }
            Command::Finished { step } => {
                if *step != cfg.steps || self.high != cfg.steps {
                    return Err(format!("finished at step {step}, committed {} of {}", self.high, cfg.steps));
                }
            }
        }
        Ok(())
    }

    fn checkpoint_complete(&self, step: u64, total: usize) -> bool {
        let mut pieces = self.checkpoints.get(&step).cloned().unwrap_or_default();
        pieces.sort_by_key(|r| r.start);
        let mut next = 0;
        for r in pieces {
            if r.start > next {
                return false;
            }
            next = next.max(r.end);
        }
        next >= total
    }

    fn on_worker_command(&mut self, id: WorkerId, cmd: Command) -> Result<(), String> {
        if !self.can_talk(id) {
            return Ok(()); // lost: the worker is gone or cut off
        }
        match cmd {
            Command::Replan(plan) => {
                if let Some(w) = self.workers.get_mut(&id) {
                    w.latest_plan = w.latest_plan.max(plan.epoch);
                }
                self.install(id, plan)?
            }
            Command::StartStep { step, epoch, attempt, .. } => {
                let w = self.workers.get_mut(&id).ok_or("unknown worker")?;
                let holding = w.copies.get(&epoch).cloned();
                if holding.as_ref().map(|h| h.step) != Some(step - 1) {
                    return Err(format!("worker {id} told to run step {step} under epoch {epoch} while holding {holding:?}"));
                }
                w.copies.retain(|&e, _| e >= epoch);
                w.staged = None;
                let blocks = w.plans.get(&epoch).and_then(|p| p.rank_of(id).map(|r| p.blocks[r].clone())).unwrap_or_default();
                let leaves: usize = blocks.iter().map(|&(_, l)| 1usize << l).sum();
                let time = (leaves as f64 / w.speed).ceil() as u64 + 1;
                if w.health == Health::Running {
                    self.push(time, Item::ComputeDone { worker: id, step, epoch, attempt });
                }
            }
            Command::Abandon { step, epoch, attempt, .. } => {
                let w = self.workers.get_mut(&id).ok_or("unknown worker")?;
                if w.staged == Some((step, epoch, attempt)) {
                    w.staged = None;
                }
            }
            Command::Commit { step, epoch, attempt, checkpoint, .. } => {
                let w = self.workers.get_mut(&id).ok_or("unknown worker")?;
                if w.staged != Some((step, epoch, attempt)) {
                    return Err(format!("worker {id} told to commit {:?} but staged {:?}", (step, epoch, attempt), w.staged));
                }
                w.staged = None;
                let h = w.copies.get_mut(&epoch).ok_or(format!("worker {id} commits without a copy for epoch {epoch}"))?;
                if h.step + 1 != step {
                    return Err(format!("worker {id} commits step {step} onto state of step {}", h.step));
                }
                h.step = step;
                let range = h.range.clone();
                if checkpoint {
                    self.checkpoints.entry(step).or_default().push(range);
                    self.send_up(id, Event::Saved { worker: id, step, epoch });
                }
            }
            Command::Release { .. } | Command::Evict { .. } => {
                self.note(format!("worker {id} exits"));
                self.set_health(id, Health::Exited);
            }
            Command::Finished { .. } => {}
        }
        Ok(())
    }

    /// A worker builds its range of the new epoch: from the checkpoint, or from its own copy
    /// and its sources' copies of `from_epoch` (a source that is gone or cut off fails it).
    fn install(&mut self, id: WorkerId, plan: EpochPlan) -> Result<(), String> {
        let Some(rank) = plan.rank_of(id) else {
            return Ok(()); // a transfer source: it serves from its copy
        };
        let range = plan.ranges[rank].clone();
        let want = plan.resume_step - 1;
        let holding = if let Some(d) = plan.restore {
            Holding { range: range.clone(), step: d }
        } else {
            let from = plan.from_epoch.ok_or(format!("epoch {} has neither a restore nor a source epoch", plan.epoch))?;
            let mut pieces: Vec<Range<usize>> = Vec::new();
            if let Some(own) = self.workers[&id].copies.get(&from) {
                if own.step != want {
                    return Err(format!(
                        "worker {id} keeps a copy of step {} but epoch {} resumes at {}",
                        own.step, plan.epoch, plan.resume_step
                    ));
                }
                pieces.push(own.range.start.max(range.start)..own.range.end.min(range.end));
            }
            for t in plan.transfers.iter().filter(|t| t.to == id) {
                let source = self.workers.get(&t.from);
                let serving = source.is_some_and(|s| matches!(s.health, Health::Running | Health::Hung));
                let copy = source.and_then(|s| s.copies.get(&from));
                match copy {
                    Some(c) if serving && c.range.start <= t.range.start && t.range.end <= c.range.end => {
                        if c.step < want {
                            // The source serves step `want` once its commit arrives (the request names the step).
                            self.push(5, Item::RetryInstall(id, Box::new(plan.clone())));
                            return Ok(());
                        }
                        if c.step != want {
                            return Err(format!(
                                "worker {id} copies step {} from {} for epoch {} (wants {want})",
                                c.step, t.from, plan.epoch
                            ));
                        }
                        pieces.push(t.range.clone());
                    }
                    _ if !serving => {
                        self.note(format!("worker {id}: transfer from {} failed (source gone)", t.from));
                        return Ok(()); // stuck until the coordinator re-plans
                    }
                    other => return Err(format!("worker {id}: source {} has no copy of {:?} in epoch {from}: {other:?}", t.from, t.range)),
                }
            }
            pieces.retain(|p| !p.is_empty());
            pieces.sort_by_key(|p| p.start);
            let mut next = range.start;
            for p in &pieces {
                if p.start != next {
                    return Err(format!("worker {id} cannot assemble {range:?} of epoch {}: pieces {pieces:?}", plan.epoch));
                }
                next = p.end;
            }
            if next != range.end {
                return Err(format!("worker {id} cannot assemble {range:?} of epoch {}: pieces {pieces:?}", plan.epoch));
            }
            Holding { range: range.clone(), step: want }
        };
        let w = self.workers.get_mut(&id).ok_or("unknown worker")?;
        w.copies.insert(plan.epoch, holding);
        w.plans.insert(plan.epoch, plan.clone());
        self.installed_acks.entry(plan.epoch).or_default().insert(id);
        self.send_up(id, Event::Installed { worker: id, epoch: plan.epoch });
        Ok(())
    }

    fn compute_done(&mut self, id: WorkerId, step: u64, epoch: u64, attempt: u32) {
        let Some(w) = self.workers.get_mut(&id) else { return };
        if w.health != Health::Running {
            return;
        }
        let Some(blocks) = w.plans.get(&epoch).and_then(|p| p.rank_of(id).map(|r| p.blocks[r].clone())) else { return };
        if std::mem::take(&mut w.fail_next) {
            let cause = "injected compute error".to_string();
            self.send_up(id, Event::StepFailed { worker: id, step, epoch, attempt, cause });
            return;
        }
        w.staged = Some((step, epoch, attempt));
        self.reports.entry((step, epoch, attempt)).or_default().push((id, blocks.clone()));
        self.send_up(id, Event::Reported { worker: id, step, epoch, attempt, blocks });
    }

    /// After the run: every live member of the last plan holds the final step.
    fn check_end(&mut self) -> Result<(), String> {
        // Deliver what is in flight (commits of the last step) before looking.
        while let Some(Reverse((at, _, idx))) = self.queue.pop() {
            self.now = at;
            if let Some(Item::ToWorker(id, cmd)) = self.items[idx].take() {
                self.on_worker_command(id, cmd)?;
            }
        }
        let steps = self.coord.config().steps;
        let plan = self.coord.installed().cloned().ok_or("finished without an installed plan")?;
        for &m in &plan.members {
            let w = &self.workers[&m];
            if w.health == Health::Running && w.copies.get(&plan.epoch).map(|h| h.step) != Some(steps) {
                return Err(format!("worker {m} ends holding {:?}, not step {steps}", w.copies.get(&plan.epoch)));
            }
        }
        Ok(())
    }
}

fn sender_of(e: &Event) -> WorkerId {
    match e {
        Event::Joined { worker, .. }
        | Event::Heartbeat { worker }
        | Event::Installed { worker, .. }
        | Event::Reported { worker, .. }
        | Event::StepFailed { worker, .. }
        | Event::Saved { worker, .. }
        | Event::Left { worker, .. }
        | Event::DrainRequested { worker } => *worker,
        Event::Tick => 0,
    }
}

fn short(cmd: &Command) -> String {
    match cmd {
        Command::Replan(p) => format!(
            "Replan epoch {} members {:?} ranges {:?} blocks {:?} transfers {} restore {:?} resume {}",
            p.epoch,
            p.members,
            p.ranges,
            p.blocks,
            p.transfers.len(),
            p.restore,
            p.resume_step
        ),
        other => format!("{other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Seeds per CI run (override with TESSERA_SIM_SEEDS).
    const DEFAULT_SEEDS: u64 = 2_000;

    #[test]
    fn sim_many_seeds() {
        let n = std::env::var("TESSERA_SIM_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(DEFAULT_SEEDS);
        let start = std::time::Instant::now();
        let (mut evictions, mut replays, mut epochs, mut events) = (0, 0, 0, 0);
        for seed in 0..n {
            match run_seed(seed, false) {
                Ok(o) => {
                    evictions += o.evictions;
                    replays += o.replays;
                    epochs += o.epochs;
                    events += o.events;
                }
                Err(e) => panic!(
                    "membership simulation failed: {e}\n\nreplay: TESSERA_SIM_SEED={seed} cargo test -p tessera-actors sim_replay -- --nocapture"
                ),
            }
        }
        println!(
            "{n} seeds in {:.1} s: {events} events, {epochs} epochs, {evictions} evictions, {replays} replayed commits",
            start.elapsed().as_secs_f64()
        );
        // The faults must actually exercise recovery.
        assert!(evictions > n && replays > n / 4 && epochs > 2 * n, "too few faults exercised: {evictions} {replays} {epochs}");
    }

    #[test]
    fn sim_replay() {
        let seed = std::env::var("TESSERA_SIM_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(7);
        match run_seed(seed, true) {
            Ok(o) => println!("seed {seed}: {o:?}"),
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn sim_is_deterministic() {
        for seed in [1, 2, 3] {
            assert_eq!(run_seed(seed, false), run_seed(seed, false));
        }
    }
}
