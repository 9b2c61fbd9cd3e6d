//! A seeded simulation of the elastic driver's failure detection ([`crate::liveness`]). Each seed
//! draws a world: a heartbeat timeout `T` (20–400 ms), a heartbeat period (at most `T / 2`, as
//! the config demands), the monitor's poll period and phase, heartbeat delivery delays with
//! jitter, and 1–8 first-epoch workers plus up to 3 that join later (fresh ids, some whose pid is
//! learnt after their side connection registered them), each a spawned child (its exit status
//! seen), a process of the driver's host watched through a pidfd ("ended") or a process elsewhere
//! (its exit unseen). Each worker meets up to two faults over time: SIGKILL, a crash (exit status
//! 1), SIGSTOP with or without a later SIGCONT (beats resume: one already declared lost must stay
//! lost), its side connection closing, a partition holding its beats back for a while (shorter or
//! longer than the timeout; held beats arrive when it heals), SIGTERM then being told to leave
//! (it closes its side connection and exits 0) or exiting on its own before that, a request
//! timeout that fences it elsewhere. A killed process's side connection closes later or never
//! (QUIC sends nothing). Some runs close, telling every worker to leave. After a loss the driver's
//! actions come back as inputs: the kill (an exit), its side connection aborted, sometimes the
//! fenced id's side connection reconnecting, and its beats still in flight (or resumed after
//! SIGCONT) keep arriving; inputs about ids never registered arrive too.
//!
//! The machine is fed either every fact as it happens, or (half the seeds) as the monitor in
//! `actors/fleet/src/driver/monitor.rs` feeds it: at each poll everything it sees again (every registered
//! worker with the time of its latest heartbeat, exits, closed connections, the leaving and
//! fenced ids), then the tick.
//!
//! The oracle works from the world's own timeline, not from the inputs: at every poll `t`, each
//! registered worker that is neither leaving nor fenced by `t` must be declared lost at this very
//! poll if its process exit was seen by `t`, its side connection closed by `t`, or its latest
//! delivered heartbeat (or registration) is more than `T` before `t` — and only then (accuracy:
//! exactly `T` quiet is not lost; a worker whose beats keep arriving with gaps ≤ `T - poll` is
//! never lost) — with the reason of the first of these causes, word for word (the pid known
//! then, the quiet ms); so every loss comes no later than one poll after its cause (timeout +
//! one poll after the last delivered beat). Each loss is reported exactly once; a leaving or
//! fenced worker, or an id never registered, never.
//!
//! Replay a failing seed with `TESSERA_SIM_SEED=<seed> cargo test --release -p tessera-actors
//! liveness_replay -- --nocapture` (it prints the world and every input and loss).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

use tessera_kernels::tensor::Rng;

use crate::liveness::{Action, Exit, Input, Liveness};

/// How the driver sees a worker's process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Spawned by the driver: its exit status is seen.
    Child,
    /// Of the driver's host, watched through a pidfd: "ended" is seen.
    Local,
    /// Elsewhere: its exit is not seen.
    Remote,
}

/// A fault, at ms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    Kill {
        at: u64,
    },
    /// It exits on its own with status 1.
    Crash {
        at: u64,
    },
    /// SIGSTOP, and SIGCONT when `cont` says.
    Stop {
        at: u64,
        cont: Option<u64>,
    },
    /// Its side connection alone closes.
    Close {
        at: u64,
    },
    /// Its beats sent in `from..until` are held back until `until`.
    Partition {
        from: u64,
        until: u64,
    },
    /// SIGTERM at `at`: it goes on and is told to leave at `leave`, or (`None`) exits 0 on its own
    /// after `grace` ms (no step boundary came), which is a loss.
    Drain {
        at: u64,
        leave: Option<u64>,
        grace: u64,
    },
    /// A request to it timed out: the driver declared it lost on another path.
    Fence {
        at: u64,
    },
}

/// How the machine is fed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Feed {
    /// Every fact as it happens.
    Events,
    /// What the monitor sees, all of it again at every poll.
    Polls,
}

#[derive(Debug, Clone)]
struct Worker {
    id: u64,
    pid: u32,
    kind: Kind,
    /// When it is registered (heartbeats due from then).
    join: u64,
    /// Its pid is 0 (unknown) until then.
    pid_from: u64,
    faults: Vec<Fault>,
    /// After its process died: its side connection closes this much later, or never.
    close_after_death: Option<u64>,
    /// Told to leave: it closes its side connection, then exits, this much later.
    leave_close: u64,
    leave_exit: u64,
}

/// A world to simulate.
#[derive(Debug, Clone)]
struct World {
    timeout: u64,
    heartbeat: u64,
    poll: u64,
    /// The first poll.
    phase: u64,
    /// A heartbeat arrives `delay.0 + 0..=delay.1` ms after it is sent.
    delay: (u64, u64),
    end: u64,
    feed: Feed,
    /// The run closes then: every worker is told to leave.
    close_all: Option<u64>,
    workers: Vec<Worker>,
    /// Ids never registered that inputs arrive for.
    junk: Vec<u64>,
    /// Percent: a fenced worker's side connection reconnects.
    p_rewatch: u64,
}

fn build(seed: u64) -> World {
    let mut rng = Rng::derive(seed, &[0x11fe]);
    let mut pick = |n: u64| rng.gen_range(n.max(1));
    let timeout = 20 + pick(381);
    let heartbeat = (timeout / 20).max(1) + pick(timeout / 2 - (timeout / 20).max(1) + 1);
    let poll = (timeout / 40).max(1) + pick(timeout / 3);
    let phase = pick(poll);
    let delay = match pick(3) {
        0 => (0, 0),
        1 => (pick(heartbeat), pick(heartbeat)),
        _ => (pick(timeout / 4), pick(timeout)),
    };
    let end = timeout * (4 + pick(9));
    let feed = if pick(2) == 0 { Feed::Events } else { Feed::Polls };
    let close_all = (pick(10) < 3).then(|| end - pick(timeout));
    let first = 1 + pick(8);
    let joiners = pick(4);
    let mut workers = Vec::new();
    for id in 0..first + joiners {
        let joiner = id >= first;
        let kind = match (joiner, pick(3)) {
            (false, 0) | (false, 1) => Kind::Child,
            (_, 0) => Kind::Local,
            _ => Kind::Remote,
        };
        // First-epoch workers register as each says Ready, before the first poll; joiners later.
        let join = if joiner { end / 8 + pick(end * 5 / 8) } else { pick(phase + 1) };
        // A joiner's side connection may register it before its join says its pid.
        let pid_from = if joiner && pick(3) == 0 { join + 1 + pick(2 * timeout) } else { join };
        // Its exit is seen through its pid: a pidfd's only once the pid is known.
        let from = if kind == Kind::Remote { join } else { pid_from };
        let mut faults = Vec::new();
        for _ in 0..pick(3) {
            let at = from + 1 + pick(end.saturating_sub(from));
            faults.push(match pick(9) {
                0 => Fault::Kill { at },
                1 => Fault::Crash { at },
                2 | 3 => Fault::Stop { at, cont: (pick(3) > 0).then(|| at + 1 + pick(3 * timeout)) },
                4 => Fault::Close { at },
                5 | 6 => Fault::Partition { from: at, until: at + 1 + pick(2 * timeout) },
                7 => Fault::Drain { at, leave: (pick(2) > 0).then(|| at + pick(2 * timeout)), grace: 1 + pick(2 * timeout) },
                _ => Fault::Fence { at },
            });
        }
        let leave_close = pick(heartbeat);
        workers.push(Worker {
            id,
            pid: 1_000 + pick(30_000) as u32,
            kind,
            join,
            pid_from,
            faults,
            close_after_death: (pick(2) == 0).then(|| pick(2 * timeout)),
            leave_close,
            leave_exit: leave_close + pick(heartbeat),
        });
    }
    let junk = (0..pick(3)).map(|k| 1_000 + k).collect();
    World { timeout, heartbeat, poll, phase, delay, end, feed, close_all, workers, junk, p_rewatch: pick(101) }
}

/// What the world holds of one worker, whatever the driver does.
#[derive(Debug, Clone, Default)]
struct Facts {
    /// Its process's exit as the driver sees it: when, the pid, how.
    exit: Option<(u64, u32, Exit)>,
    /// Its side connection closing.
    closed: Option<u64>,
    /// Told to leave.
    leave: Option<u64>,
    /// Fenced on another path.
    fence: Option<u64>,
    /// When its heartbeats arrive (in order: one stream).
    arrivals: Vec<u64>,
    stopped: bool,
    resumed: bool,
    partitioned: bool,
    /// SIGTERM: told to leave (`Some(true)`) or exiting on its own (`Some(false)`).
    drained: Option<bool>,
}

fn facts(w: &World, k: &Worker, rng: &mut Rng) -> Facts {
    let mut f = Facts::default();
    let mut death: Option<(u64, Exit)> = None;
    let mut die = |at: u64, how: Exit| {
        if death.as_ref().is_none_or(|d| at < d.0) {
            death = Some((at, how));
        }
    };
    let mut leave = w.close_all;
    let mut closed = None::<u64>;
    let mut stops = Vec::new();
    let mut partitions = Vec::new();
    for &fault in &k.faults {
        match fault {
            Fault::Kill { at } => die(at, Exit::Signal(9)),
            Fault::Crash { at } => die(at, Exit::Code(1)),
            Fault::Stop { at, cont } => {
                f.stopped = true;
                f.resumed |= cont.is_some();
                stops.push((at, cont.unwrap_or(u64::MAX)));
            }
            Fault::Close { at } => closed = Some(closed.map_or(at, |c| c.min(at))),
            Fault::Partition { from, until } => {
                f.partitioned = true;
                partitions.push((from, until));
            }
            Fault::Drain { at, leave: Some(l), .. } => {
                f.drained = Some(true);
                leave = Some(leave.map_or(l.max(at), |x| x.min(l.max(at))));
            }
            Fault::Drain { at, leave: None, grace } => {
                f.drained = Some(false);
                die(at + grace, Exit::Code(0));
            }
            Fault::Fence { at } => f.fence = Some(f.fence.map_or(at, |x| x.min(at))),
        }
    }
    if let Some(l) = leave {
        die(l + k.leave_exit, Exit::Code(0));
        closed = Some(closed.map_or(l + k.leave_close, |c| c.min(l + k.leave_close)));
    }
    if let (Some((at, _)), Some(after)) = (&death, k.close_after_death) {
        closed = Some(closed.map_or(at + after, |c| c.min(at + after)));
    }
    let dead = death.as_ref().map_or(u64::MAX, |d| d.0);
    let gone = closed.unwrap_or(u64::MAX).min(dead).min(w.end);
    let mut send = k.join + w.heartbeat;
    let mut prev = 0;
    while send < gone {
        if !stops.iter().any(|&(a, b)| a <= send && send < b) {
            let mut at = send + w.delay.0 + rng.gen_range(w.delay.1 + 1);
            if let Some(&(_, until)) = partitions.iter().find(|&&(a, b)| a <= send && send < b) {
                at = at.max(until + w.delay.0 + rng.gen_range(w.delay.1 + 1));
            }
            prev = prev.max(at);
            if prev >= closed.unwrap_or(u64::MAX) {
                break;
            }
            f.arrivals.push(prev);
        }
        send += w.heartbeat;
    }
    f.exit = match (k.kind, death) {
        (Kind::Remote, _) | (_, None) => None,
        (Kind::Child, Some((at, how))) => Some((at, k.pid, how)),
        (Kind::Local, Some((at, _))) => Some((at, k.pid, Exit::Ended)),
    };
    f.closed = closed;
    f.leave = leave;
    f
}

/// What the world looks like to the driver now (for the monitor's polls and the trace).
#[derive(Debug, Clone, Default)]
struct Seen {
    /// In the driver's map of heartbeats (a registered worker not yet lost, fenced or drained).
    entry: bool,
    pid: u32,
    last: u64,
    exit: Option<(u32, Exit)>,
    closed: bool,
    leaving: bool,
    fenced: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    Register(usize),
    Pid(usize),
    Arrive(usize),
    Exit(usize),
    Close(usize),
    Leave(usize),
    Fence(usize),
    Junk(u64, u8),
    /// The driver's SIGKILL after a loss.
    Killed(usize),
    /// The driver's abort of its side connection.
    Aborted(usize),
    /// A fenced worker's side connection reconnects.
    Rewatch(usize),
    Tick,
}

/// What was exercised.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    polled_seeds: u64,
    workers: u64,
    joiners: u64,
    lost_exit_status: u64,
    lost_pidfd: u64,
    lost_closed: u64,
    lost_silent: u64,
    lost_pid_unknown: u64,
    quiet_exactly_timeout: u64,
    stopped_survived: u64,
    stopped_lost_then_resumed: u64,
    partitions_survived: u64,
    partitions_lost: u64,
    drained_left: u64,
    drained_lost: u64,
    fenced_elsewhere: u64,
    inputs_after_fencing: u64,
    rewatches: u64,
    junk_inputs: u64,
    closed_runs: u64,
    healthy: u64,
}

impl Tally {
    fn add(&mut self, t: Tally) {
        let Tally {
            polled_seeds,
            workers,
            joiners,
            lost_exit_status,
            lost_pidfd,
            lost_closed,
            lost_silent,
            lost_pid_unknown,
            quiet_exactly_timeout,
            stopped_survived,
            stopped_lost_then_resumed,
            partitions_survived,
            partitions_lost,
            drained_left,
            drained_lost,
            fenced_elsewhere,
            inputs_after_fencing,
            rewatches,
            junk_inputs,
            closed_runs,
            healthy,
        } = t;
        self.polled_seeds += polled_seeds;
        self.workers += workers;
        self.joiners += joiners;
        self.lost_exit_status += lost_exit_status;
        self.lost_pidfd += lost_pidfd;
        self.lost_closed += lost_closed;
        self.lost_silent += lost_silent;
        self.lost_pid_unknown += lost_pid_unknown;
        self.quiet_exactly_timeout += quiet_exactly_timeout;
        self.stopped_survived += stopped_survived;
        self.stopped_lost_then_resumed += stopped_lost_then_resumed;
        self.partitions_survived += partitions_survived;
        self.partitions_lost += partitions_lost;
        self.drained_left += drained_left;
        self.drained_lost += drained_lost;
        self.fenced_elsewhere += fenced_elsewhere;
        self.inputs_after_fencing += inputs_after_fencing;
        self.rewatches += rewatches;
        self.junk_inputs += junk_inputs;
        self.closed_runs += closed_runs;
        self.healthy += healthy;
    }
}

struct Sim<'a> {
    world: &'a World,
    facts: Vec<Facts>,
    seen: Vec<Seen>,
    /// When each worker was declared lost.
    reported: Vec<Option<u64>>,
    machine: Liveness,
    queue: BinaryHeap<Reverse<(u64, u8, u64, Ev)>>,
    seq: u64,
    rng: Rng,
    trace: Option<&'a mut Vec<String>>,
    tally: Tally,
}

fn run_seed(seed: u64, trace: Option<&mut Vec<String>>) -> Result<Tally, String> {
    let world = build(seed);
    let mut rng = Rng::derive(seed, &[0x11fe, 1]);
    let facts: Vec<Facts> = world.workers.iter().map(|k| facts(&world, k, &mut rng)).collect();
    let n = world.workers.len();
    let mut sim = Sim {
        world: &world,
        facts,
        seen: vec![Seen::default(); n],
        reported: vec![None; n],
        machine: Liveness::new(world.timeout),
        queue: BinaryHeap::new(),
        seq: 0,
        rng,
        trace,
        tally: Tally::default(),
    };
    sim.schedule_world();
    while let Some(Reverse((t, _, _, ev))) = sim.queue.pop() {
        sim.happen(t, ev)?;
    }
    sim.finish()
}

impl Sim<'_> {
    fn at(&mut self, t: u64, ev: Ev) {
        // World events at a poll's ms come before the poll.
        let class = u8::from(ev == Ev::Tick);
        self.seq += 1;
        self.queue.push(Reverse((t, class, self.seq, ev)));
    }

    fn schedule_world(&mut self) {
        let w = self.world;
        for (i, k) in w.workers.iter().enumerate() {
            self.tally.workers += 1;
            self.tally.joiners += u64::from(k.join > w.phase);
            self.at(k.join, Ev::Register(i));
            if k.pid_from > k.join {
                self.at(k.pid_from, Ev::Pid(i));
            }
            let f = &self.facts[i];
            let arrivals = f.arrivals.clone();
            let (exit, closed, leave, fence) = (f.exit.as_ref().map(|e| e.0), f.closed, f.leave, f.fence);
            for a in arrivals {
                self.at(a, Ev::Arrive(i));
            }
            for (t, ev) in [(exit, Ev::Exit(i)), (closed, Ev::Close(i)), (leave, Ev::Leave(i)), (fence, Ev::Fence(i))] {
                if let Some(t) = t {
                    self.at(t, ev);
                }
            }
        }
        for &id in &w.junk {
            for k in 0..3 {
                let t = self.rng.gen_range(w.end);
                self.at(t, Ev::Junk(id, k));
            }
        }
        let mut t = w.phase;
        while t <= w.end {
            self.at(t, Ev::Tick);
            t += w.poll;
        }
    }

    fn feed(&mut self, t: u64, input: Input) -> Result<Vec<Action>, String> {
        if let Some(tr) = self.trace.as_deref_mut() {
            tr.push(format!("{t:>6} {input:?}"));
        }
        let tick = input == Input::Tick;
        let out = self.machine.on(t, input);
        if !tick && !out.is_empty() {
            return Err(format!("at {t}: an input other than a tick answered {out:?}"));
        }
        Ok(out)
    }

    /// Feeds `input` about worker `i` as it happens (fed by the monitor's polls otherwise).
    fn event(&mut self, t: u64, i: usize, input: Input) -> Result<(), String> {
        if self.seen[i].fenced {
            self.tally.inputs_after_fencing += 1;
        }
        if self.world.feed == Feed::Events {
            self.feed(t, input)?;
        }
        Ok(())
    }

    fn happen(&mut self, t: u64, ev: Ev) -> Result<(), String> {
        let id = |i: usize| self.world.workers[i].id;
        match ev {
            Ev::Register(i) => {
                let k = &self.world.workers[i];
                let pid = if k.pid_from > k.join { 0 } else { k.pid };
                self.seen[i] = Seen { entry: true, pid, last: t, ..Seen::default() };
                self.event(t, i, Input::Watch { id: id(i), pid })?;
            }
            Ev::Pid(i) => {
                let pid = self.world.workers[i].pid;
                self.seen[i].pid = pid;
                self.event(t, i, Input::Watch { id: id(i), pid })?;
            }
            Ev::Arrive(i) => {
                self.seen[i].last = self.seen[i].last.max(t);
                self.event(t, i, Input::Heartbeat { id: id(i) })?;
            }
            Ev::Exit(i) | Ev::Killed(i) => {
                let k = &self.world.workers[i];
                let how = match (ev, k.kind) {
                    (Ev::Exit(_), _) => self.facts[i].exit.as_ref().map_or(Exit::Ended, |e| e.2.clone()),
                    (_, Kind::Child) => Exit::Signal(9),
                    _ => Exit::Ended,
                };
                let pid = k.pid;
                if self.seen[i].exit.is_none() {
                    self.seen[i].exit = Some((pid, how.clone()));
                    self.event(t, i, Input::Exited { id: id(i), pid, how })?;
                }
            }
            Ev::Close(i) | Ev::Aborted(i) => {
                self.seen[i].closed = true;
                self.event(t, i, Input::Closed { id: id(i) })?;
            }
            Ev::Leave(i) => {
                // Drained: the driver drops its heartbeats; the run closing keeps them.
                self.seen[i].entry &= self.world.close_all.is_some_and(|c| c <= t);
                self.seen[i].leaving = true;
                self.event(t, i, Input::Leaving { id: id(i) })?;
            }
            Ev::Fence(i) => {
                if !self.seen[i].fenced {
                    self.tally.fenced_elsewhere += u64::from(self.reported[i].is_none() && self.world.workers[i].join <= t);
                    self.event(t, i, Input::Fenced { id: id(i) })?;
                    self.fenced(t, i);
                }
            }
            Ev::Rewatch(i) => {
                self.tally.rewatches += 1;
                self.seen[i].entry = true;
                let pid = self.seen[i].pid;
                self.event(t, i, Input::Watch { id: id(i), pid })?;
                self.event(t, i, Input::Heartbeat { id: id(i) })?;
            }
            Ev::Junk(jid, k) => {
                self.tally.junk_inputs += 1;
                let input = match k {
                    0 => Input::Heartbeat { id: jid },
                    1 => Input::Closed { id: jid },
                    _ => Input::Exited { id: jid, pid: 1, how: Exit::Ended },
                };
                self.feed(t, input)?;
            }
            Ev::Tick => {
                if self.world.feed == Feed::Polls {
                    self.poll(t)?;
                }
                let out = self.feed(t, Input::Tick)?;
                self.check_tick(t, out)?;
            }
        }
        Ok(())
    }

    /// What the monitor feeds at a poll: the leaving and fenced ids, every heartbeat entry (its
    /// registration and latest heartbeat, a pidfd's exit, a closed side connection), and its
    /// children's exits.
    fn poll(&mut self, t: u64) -> Result<(), String> {
        for i in 0..self.seen.len() {
            let (id, s) = (self.world.workers[i].id, &self.seen[i]);
            let (leaving, fenced) = (s.leaving, s.fenced);
            if leaving {
                self.feed(t, Input::Leaving { id })?;
            }
            if fenced {
                self.feed(t, Input::Fenced { id })?;
            }
        }
        for i in 0..self.seen.len() {
            let (id, kind, s) = (self.world.workers[i].id, self.world.workers[i].kind, self.seen[i].clone());
            if s.entry {
                self.feed(s.last, Input::Watch { id, pid: s.pid })?;
                self.feed(s.last, Input::Heartbeat { id })?;
                if let (Kind::Local, Some((pid, how))) = (kind, &s.exit) {
                    self.feed(t, Input::Exited { id, pid: *pid, how: how.clone() })?;
                }
                if s.closed {
                    self.feed(t, Input::Closed { id })?;
                }
            }
        }
        // Its children last: one registered at this poll is watched by then.
        for i in 0..self.seen.len() {
            let (id, kind) = (self.world.workers[i].id, self.world.workers[i].kind);
            if let (Kind::Child, Some((pid, how))) = (kind, self.seen[i].exit.clone()) {
                self.feed(t, Input::Exited { id, pid, how })?;
            }
        }
        Ok(())
    }

    /// The driver fenced worker `i` (a loss): it kills it, aborts its side connection, and its
    /// side connection may reconnect.
    fn fenced(&mut self, t: u64, i: usize) {
        self.seen[i].fenced = true;
        self.seen[i].entry = false;
        if self.world.workers[i].kind != Kind::Remote {
            let after = self.rng.gen_range(3);
            self.at(t + after, Ev::Killed(i));
        }
        let after = self.rng.gen_range(3);
        self.at(t + after, Ev::Aborted(i));
        if self.rng.gen_range(100) < self.world.p_rewatch {
            let after = 1 + self.rng.gen_range(self.world.timeout);
            self.at(t + after, Ev::Rewatch(i));
        }
    }

    /// The latest heartbeat of worker `i` delivered by `t` (its registration when none).
    fn last(&self, i: usize, t: u64) -> u64 {
        let a = &self.facts[i].arrivals;
        let n = a.partition_point(|&x| x <= t);
        if n == 0 {
            self.world.workers[i].join
        } else {
            a[n - 1].max(self.world.workers[i].join)
        }
    }

    /// Why worker `i` must be declared lost at poll `t`, and since when, if it must.
    fn cause(&self, i: usize, t: u64) -> Option<(String, u64)> {
        let (k, f) = (&self.world.workers[i], &self.facts[i]);
        let id = k.id;
        let pid = if t >= k.pid_from { k.pid } else { 0 };
        if let Some((at, pid, how)) = f.exit.as_ref().filter(|e| e.0 <= t) {
            return Some((format!("worker {id} (pid {pid}): the process {how}"), *at));
        }
        if let Some(at) = f.closed.filter(|&c| c <= t) {
            return Some((format!("worker {id} (pid {pid}): its side connection closed"), at));
        }
        let last = self.last(i, t);
        let quiet = t - last;
        (quiet > self.world.timeout).then(|| {
            (format!("worker {id} (pid {pid}): no heartbeat for {quiet} ms (hung, stopped or cut off)"), last + self.world.timeout + 1)
        })
    }

    fn check_tick(&mut self, t: u64, out: Vec<Action>) -> Result<(), String> {
        let mut got: BTreeMap<u64, String> = BTreeMap::new();
        for Action::Lost { id, why } in out {
            if let Some(tr) = self.trace.as_deref_mut() {
                tr.push(format!("{t:>6}   -> lost {id}: {why}"));
            }
            if got.insert(id, why).is_some() {
                return Err(format!("at {t}: worker {id} declared lost twice in one poll"));
            }
        }
        if let Some(&id) = got.keys().find(|id| !self.world.workers.iter().any(|k| k.id == **id)) {
            return Err(format!("at {t}: id {id}, never registered, declared lost"));
        }
        for i in 0..self.world.workers.len() {
            let k = &self.world.workers[i];
            let f = &self.facts[i];
            let got = got.remove(&k.id);
            let exempt = if let Some(at) = self.reported[i] {
                Some(format!("it was declared lost at {at} already"))
            } else if k.join > t {
                Some("it is not registered yet".into())
            } else if f.leave.is_some_and(|l| l <= t) {
                Some("it was told to leave".into())
            } else if f.fence.is_some_and(|x| x <= t) {
                Some("it was fenced on another path".into())
            } else {
                None
            };
            if let Some(why) = exempt {
                if let Some(g) = got {
                    return Err(format!("at {t}: worker {} declared lost ({g}) though {why}", k.id));
                }
                continue;
            }
            let last = self.last(i, t);
            self.tally.quiet_exactly_timeout += u64::from(t - last == self.world.timeout && got.is_none());
            match (self.cause(i, t), got) {
                (None, None) => {}
                (Some((want, _)), None) => return Err(format!("at {t}: worker {} not declared lost: {want}", k.id)),
                (None, Some(g)) => {
                    return Err(format!("at {t}: worker {} declared lost without a cause (last heartbeat at {last}): {g}", k.id))
                }
                (Some((want, _)), Some(g)) if want != g => {
                    return Err(format!("at {t}: worker {} declared lost as \"{g}\", want \"{want}\"", k.id))
                }
                (Some((_, since)), Some(g)) => {
                    if !(since <= t && t < since + self.world.poll) {
                        return Err(format!("at {t}: worker {} declared lost more than a poll after its cause at {since}", k.id));
                    }
                    self.reported[i] = Some(t);
                    let pid_unknown = t < k.pid_from;
                    let tally = &mut self.tally;
                    tally.lost_pid_unknown += u64::from(pid_unknown);
                    if g.contains(": the process ended") {
                        tally.lost_pidfd += 1;
                    } else if g.contains(": the process ") {
                        tally.lost_exit_status += 1;
                    } else if g.ends_with(": its side connection closed") {
                        tally.lost_closed += 1;
                    } else {
                        tally.lost_silent += 1;
                    }
                    self.fenced(t, i);
                }
            }
        }
        Ok(())
    }

    fn finish(mut self) -> Result<Tally, String> {
        let w = self.world;
        self.tally.polled_seeds += u64::from(w.feed == Feed::Polls);
        self.tally.closed_runs += u64::from(w.close_all.is_some());
        for (i, k) in w.workers.iter().enumerate() {
            let f = &self.facts[i];
            let lost = self.reported[i].is_some();
            // Accuracy as a property of the world alone: beats every `T - poll` or sooner and
            // no other cause: never lost.
            let untouched = f.exit.is_none() && f.closed.is_none() && f.fence.is_none() && k.join <= w.end;
            if untouched {
                let mut gaps = f.arrivals.iter().scan(k.join, |prev, &a| Some(a - std::mem::replace(prev, a)));
                let tail = w.end - self.last(i, w.end);
                if gaps.all(|g| g + w.poll <= w.timeout) && tail + w.poll <= w.timeout {
                    if lost {
                        return Err(format!("worker {} declared lost though its beats never stopped", k.id));
                    }
                    self.tally.healthy += 1;
                }
            }
            let t = &mut self.tally;
            if f.stopped && !f.partitioned && k.faults.len() == 1 {
                t.stopped_survived += u64::from(!lost);
                let stale = self.reported[i].is_some_and(|at| f.arrivals.last().is_some_and(|&a| a > at));
                t.stopped_lost_then_resumed += u64::from(f.resumed && stale);
            }
            if f.partitioned && k.faults.len() == 1 && f.leave.is_none() {
                t.partitions_survived += u64::from(!lost);
                t.partitions_lost += u64::from(lost);
            }
            if k.faults.len() == 1 {
                t.drained_left += u64::from(f.drained == Some(true) && !lost);
                t.drained_lost += u64::from(f.drained == Some(false) && lost);
            }
        }
        Ok(self.tally)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Seeds per CI run (override with TESSERA_SIM_SEEDS).
    const DEFAULT_SEEDS: u64 = 5_000;

    #[test]
    fn liveness_many_seeds() {
        let mut tally = Tally::default();
        let n = crate::sim_support::many_seeds("failure detection", "-p tessera-actors liveness_replay", DEFAULT_SEEDS, run_seed, |t| {
            tally.add(t)
        });
        println!("{tally:?}");
        // Every path must actually be exercised.
        let some = n / 100;
        let counts = [
            tally.polled_seeds,
            tally.joiners,
            tally.lost_exit_status,
            tally.lost_pidfd,
            tally.lost_closed,
            tally.lost_silent,
            tally.lost_pid_unknown,
            tally.quiet_exactly_timeout,
            tally.stopped_survived,
            tally.stopped_lost_then_resumed,
            tally.partitions_survived,
            tally.partitions_lost,
            tally.drained_left,
            tally.drained_lost,
            tally.fenced_elsewhere,
            tally.inputs_after_fencing,
            tally.rewatches,
            tally.junk_inputs,
            tally.closed_runs,
            tally.healthy,
        ];
        assert!(counts.iter().all(|&c| c >= some), "some path is rarely exercised: {tally:?}");
    }

    #[test]
    fn liveness_replay() {
        crate::sim_support::replay(build, run_seed);
    }

    #[test]
    fn liveness_sim_is_deterministic() {
        crate::sim_support::assert_deterministic(run_seed);
    }
}
