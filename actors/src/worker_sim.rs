//! A seeded simulation of the workers' side of a command: the members of a real [`StepTxn`]
//! are [`WorkerCmd`] machines, each with a mailbox and a simulated compute thread behind a
//! queue of one, carried out the way `DeviceWorker` carries them out.
//!
//! Each seed builds a world of 1–6 workers and 1–12 requests (the next step, some steps in the
//! chaos hook's `abandon_steps`, queries) and fault rates. What happens next is drawn among
//! everything that can: a worker's actor takes the next message of its mailbox (a command, or
//! its compute thread's completion: the two interleave in any order), a compute thread takes
//! the command in its queue or finishes the call it runs, the ClusterSupervisor gets one of the
//! reports or losses in flight (in any order, stale ones included), a phase timer expires
//! (mostly when nothing else can happen). A compute call may return an error, panic (the
//! worker fails and is reported lost), hang for good, or finish only after a phase timer
//! expired (its answer arrives after its member was written off); a worker's actor may be
//! stopped (the chaos harness's `stop_actor`); a shard query may fail. Stray commands, under
//! transactions the step transaction never uses, arrive in workers' mailboxes: memory and
//! shard queries at any time (a worker running one refuses the step transaction's command that
//! follows: the refusal is the member's failure), and prepares, commits and abandons of any
//! step while the worker has a command in flight (the worker runs any step command that finds
//! it idle: the order of prepare, commit and abandon is its sender's to keep). Without strays
//! no command of the step transaction finds its worker busy (it keeps one outstanding per
//! worker), which is checked too.
//!
//! The oracle keeps each compute's books (the prepare it staged and under which transaction,
//! the prepares it abandoned, the steps it committed) and each worker's (the command in flight,
//! the commands it took, the answers it gave), and checks: a worker hands its compute one
//! command at a time (never a second while one is in flight), and its completion ends that
//! very command; a command answered `Refused("busy with transaction T")` found `T` in flight,
//! and a refused command changes no state (the machine, the compute, its queue); every command
//! a worker takes is answered exactly once, unless the worker died or its compute still runs
//! it; the shard actors hear of a commit only once the compute applied it; a compute applies a
//! commit only to the attempt the step transaction prepared on it, never once that attempt was
//! abandoned there, and commits steps in order, each once; the step transaction's view of who
//! committed equals the computes' books (a step answered committed was applied by every
//! worker; after a failed commit, by exactly the workers not named as failed, plus perhaps
//! ones that died or timed out after applying it; a step answered abandoned by none); every
//! request is answered (the run ends within a bound).
//!
//! Replay a failing seed with `TESSERA_SIM_SEED=<seed> cargo test --release -p tessera-actors
//! worker_replay -- --nocapture` (it prints the world and the trace).

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use tessera_kernels::tensor::Rng;

use crate::compute::{ComputeError, MemoryReport, Prepared, ShardSpec, StepOrder};
use crate::error::FailureCause;
use crate::shard::{ShardKind, ShardStatus};
use crate::txn::{self, Cmd, Query, Reply, StepTxn};
use crate::worker_cmd::{self, Outcome, ShardNote, WorkerCmd};

const TIMEOUT_MS: u64 = 1_000;

/// Adds a line to the trace when one is kept (formatting costs more than the run otherwise).
macro_rules! log {
    ($sim:expr, $($arg:tt)*) => {
        if let Some(t) = $sim.trace.as_deref_mut() {
            t.push(format!($($arg)*));
        }
    };
}
/// Stray commands' transactions start here (the step transaction's never get there).
const STRAY_TXN: u64 = 1 << 40;
/// Bound on events per run (far above what a run needs).
const MAX_EVENTS: usize = 20_000;

/// A world to simulate.
#[derive(Debug, Clone)]
struct World {
    members: usize,
    requests: u32,
    abandon_steps: Vec<u64>,
    /// Percent: a request is a query; a compute call returns an error, panics, hangs, finishes
    /// only after a timer expired; a shard query fails; a cancelled timer's expiry stays
    /// deliverable.
    p_query: u64,
    p_error: u64,
    p_panic: u64,
    p_hang: u64,
    p_slow: u64,
    p_shard_fail: u64,
    p_stale_timer: u64,
    /// Per mille per event: a phase timer expires while something else could happen; a stray
    /// command arrives; a worker's actor is stopped.
    pm_early_timer: u64,
    pm_stray: u64,
    pm_stop: u64,
    /// At most this many strays and stops per run.
    strays: u32,
    stops: u32,
}

fn build(seed: u64) -> World {
    let mut rng = Rng::derive(seed, &[0x3017]);
    let mut pick = |n: u64| rng.gen_range(n);
    let members = 1 + pick(6) as usize;
    let requests = 1 + pick(12) as u32;
    let p_chaos = pick(30);
    let abandon_steps = (1..=12).filter(|_| pick(100) < p_chaos).collect();
    // A third of the worlds have computes that never fail.
    let faulty = u64::from(pick(3) != 0);
    World {
        members,
        requests,
        abandon_steps,
        p_query: pick(25),
        p_error: faulty * pick(8),
        p_panic: faulty * pick(3),
        p_hang: faulty * pick(3),
        p_slow: faulty * pick(4),
        p_shard_fail: pick(20),
        p_stale_timer: pick(50),
        pm_early_timer: pick(10),
        pm_stray: pick(40),
        pm_stop: pick(6),
        strays: pick(5) as u32,
        stops: pick(3) as u32,
    }
}

/// What a compute call does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    Finish,
    Error,
    Panic,
    Hang,
    /// Finishes only once a phase timer expired after it started.
    Slow {
        timers_then: u64,
    },
}

/// A message in a worker's mailbox from the ClusterSupervisor's side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mail {
    Command {
        txn: u64,
        cmd: Cmd,
    },
    /// A stray command: what it is is drawn when the worker takes it (see the module doc).
    Stray {
        txn: u64,
    },
}

/// The compute's own books.
#[derive(Debug, Clone, Default, PartialEq)]
struct Books {
    /// The attempt staged and the transaction of its prepare.
    staged: Option<(StepOrder, u64)>,
    /// Transactions of prepares abandoned here.
    abandoned: BTreeSet<u64>,
    committed: Vec<u64>,
}

/// The compute thread.
#[derive(Debug, Clone, PartialEq)]
enum Thread {
    Idle,
    Running {
        txn: u64,
        cmd: Cmd,
        fate: Fate,
    },
    /// It panicked, or its worker is gone.
    Exited,
}

/// One worker: its actor's machine and mailbox, its queue of one, its compute thread.
#[derive(Debug)]
struct Worker {
    m: WorkerCmd,
    alive: bool,
    mailbox: VecDeque<Mail>,
    /// The compute thread's completions on their way to the actor.
    done: VecDeque<(u64, Result<Outcome, String>)>,
    queue: Option<(u64, Cmd)>,
    thread: Thread,
    books: Books,
    /// The command handed to the compute and not yet completed at the actor.
    in_flight: Option<u64>,
    /// Commands it took, and how many answers each got.
    answers: BTreeMap<u64, u32>,
    /// The transaction of the last prepare the step transaction sent it.
    last_prepare_sent: Option<u64>,
    /// The prepare each commit the step transaction sent it follows.
    commit_of: BTreeMap<u64, Option<u64>>,
    /// Steps its shard actors heard committed.
    shard_commits: Vec<u64>,
    /// Stray commands it took.
    strays: u32,
}

/// What was exercised.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    runs: u64,
    committed: u64,
    abandoned: u64,
    commits_failed: u64,
    chaos_abandons: u64,
    queries: u64,
    strays: u64,
    busy_refusals: u64,
    refusals_to_the_txn: u64,
    stale_answers: u64,
    errors: u64,
    panics: u64,
    hangs: u64,
    slow: u64,
    stops: u64,
    timeouts: u64,
    shard_failures: u64,
    unheard_commits: u64,
}

impl Tally {
    fn add(&mut self, t: Tally) {
        self.runs += t.runs;
        self.committed += t.committed;
        self.abandoned += t.abandoned;
        self.commits_failed += t.commits_failed;
        self.chaos_abandons += t.chaos_abandons;
        self.queries += t.queries;
        self.strays += t.strays;
        self.busy_refusals += t.busy_refusals;
        self.refusals_to_the_txn += t.refusals_to_the_txn;
        self.stale_answers += t.stale_answers;
        self.errors += t.errors;
        self.panics += t.panics;
        self.hangs += t.hangs;
        self.slow += t.slow;
        self.stops += t.stops;
        self.timeouts += t.timeouts;
        self.shard_failures += t.shard_failures;
        self.unheard_commits += t.unheard_commits;
    }
}

/// One run: the step transaction, the workers, what is in flight to the supervisor, the books.
struct Sim<'a> {
    w: World,
    rng: Rng,
    trace: Option<&'a mut Vec<String>>,
    txn: StepTxn<Outcome>,
    workers: Vec<Worker>,
    /// Reports and losses on their way to the ClusterSupervisor.
    inbox: Vec<txn::Input<Outcome>>,
    timers: Vec<u64>,
    /// Timer expiries delivered so far.
    expired: u64,
    /// The transaction of the phase under way (its timer armed).
    phase: Option<u64>,
    next_stray: u64,
    strays: u32,
    stops: u32,
    /// The steps the step transaction says each worker committed.
    view: Vec<Vec<u64>>,
    /// (step, rank): named failed in a failed commit after it died or timed out.
    unheard: BTreeSet<(u64, usize)>,
    answered: bool,
    /// Scratch: the events that can happen.
    can: Vec<(u8, usize)>,
    /// The refusal a worker answered last.
    refused: Option<String>,
    tally: Tally,
}

fn run_seed(seed: u64, trace: Option<&mut Vec<String>>) -> Result<Tally, String> {
    let w = build(seed);
    let worker = |rank| Worker {
        m: WorkerCmd::new(rank),
        alive: true,
        mailbox: VecDeque::new(),
        done: VecDeque::new(),
        queue: None,
        thread: Thread::Idle,
        books: Books::default(),
        in_flight: None,
        answers: BTreeMap::new(),
        last_prepare_sent: None,
        commit_of: BTreeMap::new(),
        shard_commits: Vec::new(),
        strays: 0,
    };
    let workers = (0..w.members).map(worker).collect();
    let mut sim = Sim {
        txn: StepTxn::new(w.members, 0, TIMEOUT_MS, w.abandon_steps.clone()),
        rng: Rng::derive(seed, &[0x3017, 1]),
        trace,
        workers,
        inbox: Vec::new(),
        timers: Vec::new(),
        expired: 0,
        phase: None,
        next_stray: STRAY_TXN,
        strays: 0,
        stops: 0,
        view: vec![Vec::new(); w.members],
        unheard: BTreeSet::new(),
        answered: false,
        refused: None,
        can: Vec::new(),
        tally: Tally { runs: 1, ..Tally::default() },
        w,
    };
    let mut events = 0;
    let mut next_step = 1;
    for _ in 0..sim.w.requests {
        let request = if sim.rng.gen_range(100) < sim.w.p_query {
            sim.tally.queries += 1;
            txn::Input::Query(if sim.rng.gen_range(2) == 0 { Query::Memory } else { Query::Shards })
        } else {
            txn::Input::RunStep { step: next_step }
        };
        sim.answered = false;
        sim.supervise(request)?;
        // Until the request is answered, then until nothing but a timer expiry is left.
        loop {
            let busy = sim.txn.busy();
            if !sim.step(busy)? {
                if busy {
                    return Err("the request is not answered and nothing is left to happen".into());
                }
                break;
            }
            events += 1;
            if events > MAX_EVENTS {
                return Err(format!("no end after {MAX_EVENTS} events"));
            }
        }
        if !sim.answered {
            return Err("a request got no answer".into());
        }
        next_step = sim.txn.last_committed().map_or(1, |s| s + 1);
    }
    sim.check_end()?;
    Ok(sim.tally)
}

impl Sim<'_> {
    /// One event, drawn among what can happen (a timer expiry mostly when nothing else can, and
    /// only if `timers`); false when nothing could.
    fn step(&mut self, timers: bool) -> Result<bool, String> {
        self.inject();
        let mut can = std::mem::take(&mut self.can);
        can.clear();
        for (r, w) in self.workers.iter().enumerate() {
            if w.alive && !w.mailbox.is_empty() {
                can.push((0, r));
            }
            if w.alive && !w.done.is_empty() {
                can.push((1, r));
            }
            if w.alive && w.thread == Thread::Idle && w.queue.is_some() {
                can.push((2, r));
            }
            if let Thread::Running { fate, .. } = w.thread {
                if fate != Fate::Hang && !matches!(fate, Fate::Slow { timers_then } if timers_then == self.expired) {
                    can.push((3, r));
                }
            }
        }
        if !self.inbox.is_empty() {
            can.push((4, 0));
        }
        let timer = timers && !self.timers.is_empty() && (can.is_empty() || self.rng.gen_range(1000) < self.w.pm_early_timer);
        if timer {
            let i = self.rng.gen_range(self.timers.len() as u64) as usize;
            let txn = self.timers.swap_remove(i);
            self.expired += 1;
            self.tally.timeouts += u64::from(self.phase == Some(txn));
            self.supervise(txn::Input::Timeout { txn })?;
            return Ok(true);
        }
        if can.is_empty() {
            return Ok(false);
        }
        let (what, r) = can[self.rng.gen_range(can.len() as u64) as usize];
        self.can = can;
        match what {
            0 => self.take_mail(r)?,
            1 => {
                let (txn, result) = self.workers[r].done.pop_front().expect("a completion");
                if self.workers[r].in_flight != Some(txn) {
                    return Err(format!("worker {r} got the completion of {txn}; in flight: {:?}", self.workers[r].in_flight));
                }
                self.workers[r].in_flight = None;
                let actions = self.workers[r].m.on(worker_cmd::Input::Done { txn, result });
                log!(self, "worker {r}: done {txn} -> {actions:?}");
                self.carry_out(r, actions)?;
            }
            2 => {
                let (txn, cmd) = self.workers[r].queue.take().expect("a command");
                let fate = self.fate(&cmd);
                log!(self, "worker {r}: compute starts {txn} {cmd:?}: {fate:?}");
                self.workers[r].thread = Thread::Running { txn, cmd, fate };
            }
            3 => self.finish(r)?,
            _ => {
                let i = self.rng.gen_range(self.inbox.len() as u64) as usize;
                let input = self.inbox.swap_remove(i);
                self.supervise(input)?;
            }
        }
        Ok(true)
    }

    /// Maybe a stray command arrives, or a worker's actor is stopped.
    fn inject(&mut self) {
        let r = self.rng.gen_range(self.w.members as u64) as usize;
        if !self.workers[r].alive {
            return;
        }
        if self.strays < self.w.strays && self.rng.gen_range(1000) < self.w.pm_stray {
            self.strays += 1;
            self.next_stray += 1;
            self.workers[r].mailbox.push_back(Mail::Stray { txn: self.next_stray });
        } else if self.stops < self.w.stops && self.rng.gen_range(1000) < self.w.pm_stop {
            self.stops += 1;
            self.tally.stops += 1;
            self.kill(r, "stopped by the chaos fault stop_actor".into());
        }
    }

    fn fate(&mut self, cmd: &Cmd) -> Fate {
        let w = &self.w;
        let p = self.rng.gen_range(100);
        let can_fail = matches!(cmd, Cmd::Prepare(_) | Cmd::Commit(_));
        let fate = if p < w.p_error {
            if can_fail {
                Fate::Error
            } else {
                Fate::Finish
            }
        } else if p < w.p_error + w.p_panic {
            Fate::Panic
        } else if p < w.p_error + w.p_panic + w.p_hang {
            Fate::Hang
        } else if p < w.p_error + w.p_panic + w.p_hang + w.p_slow {
            Fate::Slow { timers_then: self.expired }
        } else {
            Fate::Finish
        };
        match fate {
            Fate::Error => self.tally.errors += 1,
            Fate::Panic => self.tally.panics += 1,
            Fate::Hang => self.tally.hangs += 1,
            Fate::Slow { .. } => self.tally.slow += 1,
            Fate::Finish => {}
        }
        fate
    }

    /// Worker `r`'s actor dies (stopped or failed): its mailbox and queue go with it; the
    /// supervisor hears of it as a loss.
    fn kill(&mut self, r: usize, cause: String) {
        let w = &mut self.workers[r];
        log!(self, "worker {r} dies: {cause}");
        w.alive = false;
        w.mailbox.clear();
        w.done.clear();
        w.queue = None;
        if w.thread == Thread::Idle {
            w.thread = Thread::Exited;
        }
        self.inbox.push(txn::Input::Lost { rank: r, cause });
    }

    /// Worker `r`'s actor takes the next command of its mailbox.
    fn take_mail(&mut self, r: usize) -> Result<(), String> {
        let (txn, cmd) = match self.workers[r].mailbox.pop_front().expect("mail") {
            Mail::Command { txn, cmd } => (txn, cmd),
            Mail::Stray { txn } => {
                self.tally.strays += 1;
                self.workers[r].strays += 1;
                let step = 1 + self.rng.gen_range(12);
                let busy = self.workers[r].m.busy().is_some();
                let cmd = match self.rng.gen_range(if busy { 5 } else { 2 }) {
                    0 => Cmd::Memory,
                    1 => Cmd::Shards,
                    2 => Cmd::Prepare(StepOrder { step, epoch: 0, attempt: self.rng.gen_range(2) as u32 }),
                    3 => Cmd::Commit(step),
                    _ => Cmd::Abandon(step),
                };
                (txn, cmd)
            }
        };
        let w = &mut self.workers[r];
        if w.answers.insert(txn, 0).is_some() {
            return Err(format!("worker {r} took transaction {txn} twice"));
        }
        let before = (w.m.clone(), w.books.clone(), w.queue, w.thread.clone(), w.in_flight);
        let actions = w.m.on(worker_cmd::Input::Command { txn, cmd });
        log!(self, "worker {r}: {txn} {cmd:?} -> {actions:?}");
        self.refused = None;
        self.carry_out(r, actions)?;
        if let Some(why) = self.refused.take() {
            let w = &self.workers[r];
            if let Some(busy) = why.strip_prefix("busy with transaction ") {
                self.tally.busy_refusals += 1;
                if w.in_flight.map(|t| t.to_string()).as_deref() != Some(busy) {
                    return Err(format!("worker {r} refused {txn}: {why}; in flight: {:?}", w.in_flight));
                }
            }
            if (w.m.clone(), w.books.clone(), w.queue, w.thread.clone(), w.in_flight) != before {
                return Err(format!("worker {r} refused {txn} ({why}) and its state changed"));
            }
        }
        Ok(())
    }

    /// Carries out worker `r`'s actions as `DeviceWorker` does.
    fn carry_out(&mut self, r: usize, actions: Vec<worker_cmd::Action>) -> Result<(), String> {
        let mut todo = VecDeque::from(actions);
        while let Some(action) = todo.pop_front() {
            match action {
                worker_cmd::Action::Describe { txn } => {
                    let outcome = if self.rng.gen_range(100) < self.w.p_shard_fail {
                        self.tally.shard_failures += 1;
                        Outcome::Refused("shard query failed: timeout".into())
                    } else {
                        let w = &self.workers[r];
                        let spec = ShardSpec { range: r..r + 1, bytes: 4 };
                        let last_committed_step = w.shard_commits.last().copied();
                        Outcome::Shards(vec![ShardStatus { rank: r, kind: ShardKind::Optim, spec, last_committed_step, abandoned: 0 }])
                    };
                    self.report(r, txn, outcome)?;
                }
                worker_cmd::Action::Start { txn, cmd } => {
                    let w = &mut self.workers[r];
                    if w.thread == Thread::Exited {
                        self.kill(r, format!("rank {r}: compute thread is gone"));
                        return Ok(());
                    }
                    if w.queue.is_some() {
                        todo.extend(w.m.on(worker_cmd::Input::QueueFull { txn }));
                        continue;
                    }
                    if let Some(other) = w.in_flight {
                        return Err(format!("worker {r} hands {txn} ({cmd:?}) to its compute while {other} is in flight"));
                    }
                    w.queue = Some((txn, cmd));
                    w.in_flight = Some(txn);
                }
                worker_cmd::Action::Note(ShardNote::Committed(step)) => {
                    let w = &mut self.workers[r];
                    if w.books.committed.last() != Some(&step) {
                        return Err(format!("worker {r}'s shards hear {step} committed; its compute committed {:?}", w.books.committed));
                    }
                    w.shard_commits.push(step);
                }
                worker_cmd::Action::Note(ShardNote::Abandoned(_)) => {}
                worker_cmd::Action::Report { txn, outcome } => self.report(r, txn, outcome)?,
                worker_cmd::Action::Fail(e) => {
                    self.kill(r, e);
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// Worker `r` answers `txn` to the ClusterSupervisor.
    fn report(&mut self, r: usize, txn: u64, outcome: Outcome) -> Result<(), String> {
        let n = self.workers[r].answers.get_mut(&txn).ok_or_else(|| format!("worker {r} answers {txn}, which it never took"))?;
        *n += 1;
        if *n > 1 {
            return Err(format!("worker {r} answers {txn} twice"));
        }
        if let Outcome::Refused(why) = &outcome {
            // The step transaction keeps one command outstanding per worker: only a stray
            // command can make a worker refuse one of its commands as busy.
            let ours = txn < STRAY_TXN;
            if ours && why.starts_with("busy") && self.workers[r].strays == 0 {
                return Err(format!("worker {r} refused the step transaction's {txn} ({why}) and took no stray command"));
            }
            self.tally.refusals_to_the_txn += u64::from(ours);
            self.refused = Some(why.clone());
        }
        self.inbox.push(txn::Input::Answer { rank: r, txn, result: outcome.into_answer() });
        Ok(())
    }

    /// Worker `r`'s compute finishes the call it runs: its books, and its completion.
    fn finish(&mut self, r: usize) -> Result<(), String> {
        let w = &mut self.workers[r];
        let Thread::Running { txn, cmd, fate } = w.thread.clone() else { unreachable!("a running call") };
        let ok = fate != Fate::Error;
        let result = match cmd {
            _ if fate == Fate::Panic => Err(format!("rank {r} panicked in {txn}")),
            Cmd::Prepare(order) => {
                w.books.staged = ok.then_some((order, txn));
                Ok(Outcome::Prepared(if ok {
                    Ok(Prepared::default())
                } else {
                    Err(ComputeError::failed(format!("rank {r} failed to prepare in {txn}")))
                }))
            }
            Cmd::Commit(step) => {
                let prepared = w.commit_of.get(&txn).copied().flatten();
                match (w.books.staged, prepared) {
                    (Some((order, p)), Some(want)) if order.step == step && p == want && !w.books.abandoned.contains(&p) => {}
                    (staged, want) => {
                        return Err(format!(
                            "worker {r}'s compute commits step {step} under {txn} with {staged:?} staged; the step transaction prepared it under {want:?} (abandoned here: {:?})",
                            w.books.abandoned
                        ))
                    }
                }
                w.books.staged = None;
                if ok {
                    if w.books.committed.last().is_some_and(|&last| last >= step) {
                        return Err(format!("worker {r}'s compute commits step {step} after {:?}", w.books.committed));
                    }
                    w.books.committed.push(step);
                }
                Ok(Outcome::Committed {
                    step,
                    result: if ok { Ok(()) } else { Err(ComputeError::failed(format!("rank {r} failed to commit in {txn}"))) },
                })
            }
            Cmd::Abandon(step) => {
                if let Some((_, p)) = w.books.staged.filter(|(o, _)| o.step == step) {
                    w.books.abandoned.insert(p);
                    w.books.staged = None;
                }
                Ok(Outcome::Abandoned { step })
            }
            Cmd::Memory => Ok(Outcome::Memory(MemoryReport { rank: r, ..MemoryReport::default() })),
            Cmd::Shards => Ok(Outcome::Refused("shard queries are answered by the actor".into())),
        };
        log!(self, "worker {r}: compute finishes {txn}: {result:?}");
        let panicked = result.is_err();
        if w.alive {
            w.done.push_back((txn, result));
        }
        w.thread = if panicked || !w.alive { Thread::Exited } else { Thread::Idle };
        Ok(())
    }

    /// Feeds the step transaction and carries out its actions as the ClusterSupervisor does.
    fn supervise(&mut self, input: txn::Input<Outcome>) -> Result<(), String> {
        if let txn::Input::Answer { txn, .. } = &input {
            self.tally.stale_answers += u64::from(Some(*txn) != self.phase);
        }
        let line = self.trace.is_some().then(|| format!("supervisor: {input:?}"));
        let actions = self.txn.on(input);
        log!(self, "{} -> {actions:?}", line.unwrap_or_default());
        let mut closed = Vec::new();
        for action in actions {
            match action {
                txn::Action::Send { rank, txn, cmd } => {
                    let w = &mut self.workers[rank];
                    match cmd {
                        Cmd::Prepare(_) => w.last_prepare_sent = Some(txn),
                        Cmd::Commit(_) => drop(w.commit_of.insert(txn, w.last_prepare_sent)),
                        _ => {}
                    }
                    if w.alive {
                        w.mailbox.push_back(Mail::Command { txn, cmd });
                    } else {
                        closed.push(rank);
                    }
                    self.phase = Some(txn);
                }
                txn::Action::ArmTimer { txn } => self.timers.push(txn),
                txn::Action::CancelTimer { txn } => {
                    if self.rng.gen_range(100) >= self.w.p_stale_timer {
                        self.timers.retain(|&t| t != txn);
                    }
                    self.phase = None;
                }
                txn::Action::Refuse(_) => self.answered = true,
                txn::Action::Reply(reply) => {
                    self.answered = true;
                    self.phase = None;
                    self.check_reply(reply)?;
                }
            }
        }
        for rank in closed {
            self.supervise(txn::Input::Lost { rank, cause: "worker mailbox closed".into() })?;
        }
        Ok(())
    }

    /// The step transaction's answer against the computes' books.
    fn check_reply(&mut self, reply: Reply<Outcome>) -> Result<(), String> {
        match reply {
            Reply::Committed(a) => {
                self.tally.committed += 1;
                self.tally.chaos_abandons += a.abandoned_attempts.len() as u64;
                for r in 0..self.w.members {
                    if self.workers[r].books.committed.last() != Some(&a.step) {
                        return Err(format!(
                            "step {} answered committed; worker {r} committed {:?}",
                            a.step, self.workers[r].books.committed
                        ));
                    }
                    self.view[r].push(a.step);
                }
            }
            Reply::CommitFailed { failures, attempted } => {
                self.tally.commits_failed += 1;
                let step = attempted.step;
                for r in 0..self.w.members {
                    let did = self.workers[r].books.committed.last() == Some(&step);
                    match failures.iter().find(|f| f.rank == r).map(|f| &f.cause) {
                        None if did => self.view[r].push(step),
                        None => return Err(format!("step {step}'s commit failed; worker {r} is not named failed and did not commit it")),
                        Some(FailureCause::Returned(e)) if did => {
                            return Err(format!("step {step}'s commit failed on worker {r} ({e}) and its compute committed it"))
                        }
                        Some(FailureCause::Returned(_)) => {}
                        Some(_) => {
                            self.tally.unheard_commits += u64::from(did);
                            self.unheard.insert((step, r));
                        }
                    }
                }
            }
            Reply::Abandoned { step, .. } => {
                self.tally.abandoned += 1;
                if let Some(r) = (0..self.w.members).find(|&r| self.workers[r].books.committed.contains(&step)) {
                    return Err(format!("step {step} answered abandoned; worker {r} committed it"));
                }
            }
            Reply::Queried { .. } => {}
        }
        Ok(())
    }

    /// Once every request is served: each worker's commits are the step transaction's view of
    /// them, and every command it took was answered unless it died or its compute still runs it.
    fn check_end(&self) -> Result<(), String> {
        for (r, w) in self.workers.iter().enumerate() {
            let books: BTreeSet<u64> = w.books.committed.iter().copied().collect();
            let view: BTreeSet<u64> = self.view[r].iter().copied().collect();
            if let Some(s) = view.difference(&books).next() {
                return Err(format!("the step transaction says worker {r} committed {s}; it committed {:?}", w.books.committed));
            }
            if let Some(s) = books.difference(&view).find(|&&s| !self.unheard.contains(&(s, r))) {
                return Err(format!("worker {r} committed {s} and the step transaction does not know it (its view {:?})", self.view[r]));
            }
            for (&txn, &n) in &w.answers {
                let running = w.in_flight == Some(txn);
                if n == 0 && w.alive && !running {
                    return Err(format!("worker {r} took {txn} and never answered it"));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Seeds per CI run (override with TESSERA_SIM_SEEDS).
    const DEFAULT_SEEDS: u64 = 10_000;

    #[test]
    fn worker_many_seeds() {
        let mut tally = Tally::default();
        let n =
            crate::sim_support::many_seeds("worker command", "-p tessera-actors worker_replay", DEFAULT_SEEDS, run_seed, |t| tally.add(t));
        println!("{tally:?}");
        // Every path must actually be exercised.
        let some = n / 200;
        let counts = [
            tally.committed,
            tally.abandoned,
            tally.commits_failed,
            tally.chaos_abandons,
            tally.queries,
            tally.strays,
            tally.busy_refusals,
            tally.refusals_to_the_txn,
            tally.stale_answers,
            tally.errors,
            tally.panics,
            tally.hangs,
            tally.slow,
            tally.stops,
            tally.timeouts,
            tally.shard_failures,
            tally.unheard_commits,
        ];
        assert!(counts.iter().all(|&c| c >= some), "some path is rarely exercised: {tally:?}");
    }

    #[test]
    fn worker_replay() {
        crate::sim_support::replay(build, run_seed);
    }

    #[test]
    fn worker_sim_is_deterministic() {
        crate::sim_support::assert_deterministic(run_seed);
    }
}
