//! A seeded simulation of the step transaction ([`crate::txn`]). Each seed builds a world of
//! 1–8 members and a series of 1–12 requests (steps, mostly the next one, sometimes one already
//! committed; queries), some steps in the chaos hook's `abandon_steps`, and fault rates; then it
//! drives a [`StepTxn`] through them. Each command a member is sent gets a behaviour drawn per
//! seed: answer, return an error, die before or after answering, hang (only the phase timer ends
//! the wait), hang and answer after the timeout, or a mailbox already closed (the driver feeds
//! the loss back at once). Deliveries (answers, losses, timer expiries, stale ones included)
//! happen in a random order; timer expiries mostly last. Requests also arrive while one runs,
//! and members are lost between requests.
//!
//! The oracle keeps its own books: each member's (the attempt it staged and prepared, the steps
//! it committed, what it was told to abandon), each phase's (sent to, answered, written off,
//! failures), and the requests'. It derives from them what the transaction must do at the end
//! of each phase (every member of the epoch prepared → commit, or the chaos hook's abandon and
//! a new attempt; a failure in prepare → abandon on the survivors and answer the failures;
//! every member committed → committed, else commit failed) and checks the machine's actions
//! against it, and independently that: a commit is sent only to a member that prepared that
//! very attempt and was not told to abandon it, and only once every member of the epoch
//! prepared it; nothing is sent to a member written off, nor twice in a transaction; a phase
//! ends only when every member it was sent to answered or was written off; a step answered
//! committed was committed by every member; a commit answered failed is never counted as
//! committed and refuses every later step; every request gets exactly one answer and none is
//! left running once nothing is left to deliver (termination); refusals are right; the
//! machine's counts equal the oracle's.
//!
//! Replay a failing seed with `TESSERA_SIM_SEED=<seed> cargo test --release -p tessera-actors
//! txn_replay -- --nocapture` (it prints the world and the trace).
//!
//! `loop_sim` reuses the members, the deliveries and the oracle ([`Oracle::new`], [`serve`],
//! [`feed`]) for each plan epoch of its runs.

use std::collections::{BTreeMap, BTreeSet};

use tessera_kernels::tensor::Rng;

use crate::compute::{ComputeError, StepOrder};
use crate::error::{FailureCause, RankFailure};
use crate::txn::{Action, Attempted, Cmd, Counts, Input, PhaseKind, Query, Refusal, Reply, StepTxn};

/// A member's answer: who answered which transaction (so the oracle can tell whose prepare a
/// committed step reports).
pub(crate) type Ans = (usize, u64);

/// The error member `rank` returns to transaction `txn` (`Behaviour::Error`): each kind in
/// turn, fixed by the pair so that drawing it takes nothing from the seed's stream. A member
/// that returns a loss or an abort is not itself lost: no loss follows unless one is drawn.
pub(crate) fn returned_error(rank: usize, txn: u64) -> ComputeError {
    let why = format!("rank {rank} failed {txn}");
    match (rank as u64 + txn) % 4 {
        0 => ComputeError::failed(why),
        1 => ComputeError::Lost { rank: Some((rank + 1) % 8), why },
        2 => ComputeError::Aborted { why },
        _ => ComputeError::Lost { rank: None, why }.torn(Some(txn)),
    }
}

pub(crate) const TIMEOUT_MS: u64 = 1_000;

/// A world to simulate.
#[derive(Debug, Clone)]
pub(crate) struct World {
    pub(crate) members: usize,
    pub(crate) requests: u32,
    pub(crate) abandon_steps: Vec<u64>,
    /// Percent: a command meets a fault; a request is a query; a step request repeats a
    /// committed step; another request arrives while one runs; a member is lost between
    /// requests; a stale timer expiry stays deliverable after its phase.
    pub(crate) p_fault: u64,
    pub(crate) p_query: u64,
    pub(crate) p_repeat: u64,
    pub(crate) p_busy: u64,
    pub(crate) p_idle_loss: u64,
    pub(crate) p_stale_timer: u64,
}

fn build(seed: u64) -> World {
    let mut rng = Rng::derive(seed, &[0x7a11]);
    let mut pick = |n: u64| rng.gen_range(n);
    let members = 1 + pick(8) as usize;
    let requests = 1 + pick(12) as u32;
    let p_chaos = pick(30);
    let abandon_steps = (1..=12).filter(|_| pick(100) < p_chaos).collect();
    World {
        members,
        requests,
        abandon_steps,
        p_fault: match pick(3) {
            0 => pick(4),
            _ => pick(25),
        },
        p_query: pick(25),
        p_repeat: pick(15),
        p_busy: pick(10),
        p_idle_loss: pick(8),
        p_stale_timer: pick(50),
    }
}

/// What a member does with one command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Behaviour {
    Answer,
    Error,
    DieBefore,
    DieAfter,
    Hang,
    Late,
    Closed,
}

/// What was exercised.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Tally {
    runs: u64,
    committed: u64,
    abandoned: u64,
    commits_failed: u64,
    partial_commits: u64,
    lost_after_answering: u64,
    chaos_abandons: u64,
    timeouts: u64,
    late_answers: u64,
    closed_mailboxes: u64,
    busy_refusals: u64,
    lost_refusals: u64,
    repeat_refusals: u64,
    inconsistent_refusals: u64,
    queries: u64,
    queries_failed: u64,
    idle_losses: u64,
}

impl Tally {
    fn add(&mut self, t: Tally) {
        self.runs += t.runs;
        self.committed += t.committed;
        self.abandoned += t.abandoned;
        self.commits_failed += t.commits_failed;
        self.partial_commits += t.partial_commits;
        self.lost_after_answering += t.lost_after_answering;
        self.chaos_abandons += t.chaos_abandons;
        self.timeouts += t.timeouts;
        self.late_answers += t.late_answers;
        self.closed_mailboxes += t.closed_mailboxes;
        self.busy_refusals += t.busy_refusals;
        self.lost_refusals += t.lost_refusals;
        self.repeat_refusals += t.repeat_refusals;
        self.inconsistent_refusals += t.inconsistent_refusals;
        self.queries += t.queries;
        self.queries_failed += t.queries_failed;
        self.idle_losses += t.idle_losses;
    }
}

/// One member's own books.
#[derive(Debug, Default, Clone)]
pub(crate) struct Member {
    /// The transaction of the prepare it ran and answered `Ok` (its staged state), until it is
    /// committed or abandoned. (A step asked for again after it was abandoned starts from
    /// attempt 0 again: the transaction tells attempts apart.)
    prepared: Option<u64>,
    /// The transaction of the last prepare it answered `Ok` (kept after its commit or abandon).
    last_prepared: Option<u64>,
    /// Steps it committed.
    pub(crate) committed: Vec<u64>,
}

/// One phase, as the oracle saw it.
#[derive(Debug, Clone)]
struct Phase {
    txn: u64,
    kind: PhaseKind,
    pending: BTreeSet<usize>,
    ok: BTreeMap<usize, Ans>,
    failures: Vec<RankFailure>,
    timer: bool,
}

/// The request being served.
#[derive(Debug, Clone)]
enum Req {
    Step {
        step: u64,
        attempt: u32,
        /// The transaction of the attempt's prepare.
        prepare_txn: u64,
        abandoned_attempts: Vec<u32>,
        prepared: BTreeMap<usize, Ans>,
        failure: Option<Vec<RankFailure>>,
    },
    Query(Query),
}

/// What the oracle expects the machine to do at the end of a phase.
#[derive(Debug, Clone, PartialEq)]
enum Expect {
    Phase { kind: PhaseKind, cmd: Cmd, to: BTreeSet<usize> },
    Reply(Reply<Ans>),
}

pub(crate) struct Oracle {
    pub(crate) world: World,
    /// The plan epoch of the machine it checks.
    epoch: u64,
    pub(crate) members: Vec<Member>,
    /// Members written off, with why.
    pub(crate) lost: BTreeMap<usize, String>,
    /// Prepare transactions any member was told to abandon.
    abandoned: BTreeSet<u64>,
    last_txn: u64,
    last_committed: Option<u64>,
    inconsistent: Option<u64>,
    active: Option<Req>,
    phase: Option<Phase>,
    /// The armed timer's transaction.
    timer: Option<u64>,
    counts: Counts,
    pub(crate) tally: Tally,
    /// What each request got: its answer, or its refusal.
    pub(crate) replies: Vec<Result<Reply<Ans>, Refusal>>,
}

/// Deliveries waiting: inputs in any order, timer expiries preferably last, late answers
/// released by their phase's timer.
#[derive(Default)]
pub(crate) struct Pool {
    events: Vec<Input<Ans>>,
    timers: Vec<u64>,
    late: Vec<(u64, Input<Ans>)>,
}

/// Bound on deliveries per run (far above what a run needs).
const MAX_DELIVERIES: usize = 10_000;

fn run_seed(seed: u64, trace: Option<&mut Vec<String>>) -> Result<Tally, String> {
    let world = build(seed);
    let mut rng = Rng::derive(seed, &[0x7a11, 1]);
    let mut trace = trace;
    let mut log = |s: String| {
        if let Some(t) = trace.as_deref_mut() {
            t.push(s);
        }
    };
    let mut m: StepTxn<Ans> = StepTxn::new(world.members, 0, TIMEOUT_MS, world.abandon_steps.clone());
    let mut o = Oracle::new(world.clone(), 0);
    let mut pool = Pool::default();
    let mut deliveries = 0;
    for _ in 0..world.requests {
        if rng.gen_range(100) < world.p_idle_loss {
            let rank = rng.gen_range(world.members as u64) as usize;
            o.tally.idle_losses += 1;
            feed(&mut m, &mut o, &mut pool, &mut rng, &mut log, Input::Lost { rank, cause: "lost between requests".into() })?;
        }
        let request = request(&o, &mut rng);
        serve(&mut m, &mut o, &mut pool, &mut rng, &mut log, &mut deliveries, request)?;
    }
    o.check_end(&m)?;
    Ok(o.tally)
}

/// Feeds `request` and delivers what it causes until it is answered (or refused), then
/// whatever is still in flight; `deliveries` counts deliveries against [`MAX_DELIVERIES`].
pub(crate) fn serve(
    m: &mut StepTxn<Ans>,
    o: &mut Oracle,
    pool: &mut Pool,
    rng: &mut Rng,
    log: &mut impl FnMut(String),
    deliveries: &mut usize,
    request: Input<Ans>,
) -> Result<(), String> {
    let p_busy = o.world.p_busy;
    feed(m, o, pool, rng, log, request)?;
    while o.active.is_some() {
        if rng.gen_range(100) < p_busy {
            let extra = request_while_busy(o, rng);
            feed(m, o, pool, rng, log, extra)?;
        }
        let Some(input) = pool.next(rng) else {
            return Err(format!("the request is not answered and nothing is left to deliver: {:?} in {:?}", o.active, o.phase));
        };
        *deliveries += 1;
        if *deliveries > MAX_DELIVERIES {
            return Err(format!("no end after {MAX_DELIVERIES} deliveries"));
        }
        if let Input::Timeout { txn } = input {
            // A member hanging in this phase answers once it is written off.
            let (now, later): (Vec<_>, Vec<_>) = pool.late.drain(..).partition(|(t, _)| *t == txn);
            pool.late = later;
            o.tally.late_answers += now.len() as u64;
            pool.events.extend(now.into_iter().map(|(_, i)| i));
        }
        feed(m, o, pool, rng, log, input)?;
    }
    // Whatever is still in flight is delivered before the next request, stale or not.
    while let Some(input) = pool.next(rng) {
        feed(m, o, pool, rng, log, input)?;
    }
    pool.late.clear();
    Ok(())
}

impl Oracle {
    /// An oracle for a machine over `world.members` members of plan epoch `epoch`.
    pub(crate) fn new(world: World, epoch: u64) -> Oracle {
        Oracle {
            members: vec![Member::default(); world.members],
            world,
            epoch,
            lost: BTreeMap::new(),
            abandoned: BTreeSet::new(),
            last_txn: 0,
            last_committed: None,
            inconsistent: None,
            active: None,
            phase: None,
            timer: None,
            counts: Counts::default(),
            tally: Tally { runs: 1, ..Tally::default() },
            replies: Vec::new(),
        }
    }

    /// The checks once the machine serves no more requests.
    pub(crate) fn check_end(&self, m: &StepTxn<Ans>) -> Result<(), String> {
        let o = self;
        if m.counts() != o.counts {
            return Err(format!("counts {:?}, the oracle counted {:?}", m.counts(), o.counts));
        }
        if m.last_committed() != o.last_committed {
            return Err(format!("the machine's last committed step is {:?}, the oracle's {:?}", m.last_committed(), o.last_committed));
        }
        for (rank, member) in o.members.iter().enumerate() {
            if member.committed.windows(2).any(|w| w[0] >= w[1]) {
                return Err(format!("member {rank} committed {:?}: not each step once in order", member.committed));
            }
        }
        Ok(())
    }
}

impl Pool {
    fn next(&mut self, rng: &mut Rng) -> Option<Input<Ans>> {
        if !self.events.is_empty() && (self.timers.is_empty() || rng.gen_range(100) >= 5) {
            let i = rng.gen_range(self.events.len() as u64) as usize;
            return Some(self.events.swap_remove(i));
        }
        if self.timers.is_empty() {
            return None;
        }
        let i = rng.gen_range(self.timers.len() as u64) as usize;
        Some(Input::Timeout { txn: self.timers.swap_remove(i) })
    }
}

/// The next request: mostly the next step, sometimes a query or a step already committed.
fn request(o: &Oracle, rng: &mut Rng) -> Input<Ans> {
    if rng.gen_range(100) < o.world.p_query {
        return Input::Query(if rng.gen_range(2) == 0 { Query::Memory } else { Query::Shards });
    }
    let next = o.last_committed.map_or(1, |s| s + 1);
    match o.last_committed {
        Some(last) if rng.gen_range(100) < o.world.p_repeat => Input::RunStep { step: 1 + rng.gen_range(last) },
        _ => Input::RunStep { step: next },
    }
}

fn request_while_busy(o: &Oracle, rng: &mut Rng) -> Input<Ans> {
    match rng.gen_range(3) {
        0 => Input::Query(Query::Memory),
        _ => Input::RunStep { step: o.last_committed.map_or(1, |s| s + 1) },
    }
}

/// Feeds `input` to the machine and the oracle, checks the actions, and carries them out
/// (a closed mailbox is fed back as a loss, as the driver does).
pub(crate) fn feed(
    m: &mut StepTxn<Ans>,
    o: &mut Oracle,
    pool: &mut Pool,
    rng: &mut Rng,
    log: &mut impl FnMut(String),
    input: Input<Ans>,
) -> Result<(), String> {
    let is_request = matches!(input, Input::RunStep { .. } | Input::Query(_));
    let expected_refusal = if is_request { o.refusal(&input) } else { None };
    o.deliver(&input);
    let actions = m.on(input.clone());
    log(format!("{input:?} -> {actions:?}"));
    let mut actions = actions.into_iter().peekable();
    if is_request {
        match (expected_refusal, actions.peek()) {
            (Some(want), Some(Action::Refuse(r))) if *r == want => {
                o.counts.refused += 1;
                o.replies.push(Err(want.clone()));
                match want {
                    Refusal::Busy => o.tally.busy_refusals += 1,
                    Refusal::MembersLost { .. } => o.tally.lost_refusals += 1,
                    Refusal::AlreadyCommitted { .. } => o.tally.repeat_refusals += 1,
                    Refusal::Inconsistent { .. } => o.tally.inconsistent_refusals += 1,
                }
                actions.next();
            }
            (Some(want), got) => return Err(format!("{input:?}: want the refusal {want:?}, got {got:?}")),
            (None, Some(Action::Refuse(r))) => return Err(format!("{input:?} refused ({r:?}); the oracle admits it")),
            (None, _) => o.start(&input),
        }
    }
    let mut closed = Vec::new();
    // The phases the input ended, one after another, each with what must follow it.
    while let Some(expect) = o.phase_over() {
        if let Some(phase) = &o.phase {
            if phase.timer {
                let txn = phase.txn;
                match actions.next() {
                    Some(Action::CancelTimer { txn: t }) if t == txn && o.timer == Some(txn) => {
                        o.timer = None;
                        if rng.gen_range(100) >= o.world.p_stale_timer {
                            pool.timers.retain(|&t| t != txn);
                        }
                    }
                    got => return Err(format!("phase {txn} is over: want its timer cancelled, got {got:?}")),
                }
            }
        }
        match expect {
            Expect::Reply(want) => {
                let Some(Action::Reply(got)) = actions.next() else {
                    return Err(format!("want the answer {want:?}, got no answer"));
                };
                // The rules on what the machine answered first, then the model's answer.
                o.answered(got.clone())?;
                if got != want {
                    return Err(format!("want the answer {want:?}, got {got:?}"));
                }
            }
            Expect::Phase { kind, cmd, to } => {
                o.last_txn += 1;
                let txn = o.last_txn;
                if let (PhaseKind::Prepare, Some(Req::Step { prepare_txn, .. })) = (kind, o.active.as_mut()) {
                    *prepare_txn = txn;
                }
                let mut sent = BTreeSet::new();
                while let Some(Action::Send { rank, txn: t, cmd: c }) = actions.peek().cloned() {
                    if t != txn || c != cmd {
                        return Err(format!("want {cmd:?} under transaction {txn}, got {c:?} under {t}"));
                    }
                    if !to.contains(&rank) || !sent.insert(rank) {
                        let why = o.lost.get(&rank).map_or("twice".to_string(), |c| format!("written off ({c})"));
                        return Err(format!("{cmd:?} sent to member {rank}, {why}"));
                    }
                    actions.next();
                    o.on_send(rank, cmd)?;
                    closed.extend(o.behave(rank, txn, cmd, pool, rng));
                }
                if sent != to {
                    return Err(format!("{cmd:?} sent to {sent:?}, want every live member {to:?}"));
                }
                let timer = !to.is_empty();
                if timer {
                    match actions.next() {
                        Some(Action::ArmTimer { txn: t }) if t == txn && o.timer.is_none() => {
                            o.timer = Some(txn);
                            pool.timers.push(txn);
                        }
                        got => return Err(format!("want the timer of {txn} armed (armed: {:?}), got {got:?}", o.timer)),
                    }
                }
                if kind == PhaseKind::Abandon && matches!(o.active, Some(Req::Step { failure: None, .. })) {
                    o.tally.chaos_abandons += 1;
                }
                o.phase = Some(Phase { txn, kind, pending: to, ok: BTreeMap::new(), failures: Vec::new(), timer });
            }
        }
    }
    if let Some(a) = actions.next() {
        return Err(format!("unexpected action {a:?} (phase {:?})", o.phase));
    }
    for rank in closed {
        o.tally.closed_mailboxes += 1;
        feed(m, o, pool, rng, log, Input::Lost { rank, cause: "worker mailbox closed".into() })?;
    }
    Ok(())
}

impl Oracle {
    fn live(&self) -> BTreeSet<usize> {
        (0..self.world.members).filter(|r| !self.lost.contains_key(r)).collect()
    }

    /// The refusal a request must get, if any.
    fn refusal(&self, input: &Input<Ans>) -> Option<Refusal> {
        if self.active.is_some() {
            return Some(Refusal::Busy);
        }
        let Input::RunStep { step } = *input else { return None };
        if let Some(step) = self.inconsistent {
            return Some(Refusal::Inconsistent { step });
        }
        if !self.lost.is_empty() {
            let (ranks, causes) = self.lost.iter().map(|(r, c)| (*r, c.clone())).unzip();
            return Some(Refusal::MembersLost { epoch: self.epoch, ranks, causes });
        }
        match self.last_committed {
            Some(last) if step <= last => Some(Refusal::AlreadyCommitted { step, last_committed: last }),
            _ => None,
        }
    }

    /// An admitted request: its first phase starts (`phase_over` sees a phase of nobody).
    fn start(&mut self, input: &Input<Ans>) {
        self.active = Some(match *input {
            Input::RunStep { step } => {
                Req::Step { step, attempt: 0, prepare_txn: 0, abandoned_attempts: Vec::new(), prepared: BTreeMap::new(), failure: None }
            }
            Input::Query(q) => {
                self.tally.queries += 1;
                Req::Query(q)
            }
            _ => unreachable!("not a request"),
        });
        self.phase = None;
    }

    /// Books a delivery (an answer, a loss, a timer expiry).
    fn deliver(&mut self, input: &Input<Ans>) {
        match input {
            Input::Answer { rank, txn, result } => {
                let Some(phase) = self.phase.as_mut().filter(|p| p.txn == *txn) else { return };
                if !phase.pending.remove(rank) {
                    return;
                }
                match result {
                    Ok(a) => drop(phase.ok.insert(*rank, *a)),
                    Err(e) => phase.failures.push(RankFailure { rank: *rank, cause: FailureCause::Returned(e.clone()) }),
                }
            }
            Input::Lost { rank, cause } => {
                if *rank >= self.world.members || self.lost.contains_key(rank) {
                    return;
                }
                self.lost.insert(*rank, cause.clone());
                let step = matches!(self.active, Some(Req::Step { .. }));
                if let Some(phase) = self.phase.as_mut() {
                    // A member lost in a step's prepare or abandon fails it, answered or not: it
                    // will commit nothing.
                    let before_commit = step && matches!(phase.kind, PhaseKind::Prepare | PhaseKind::Abandon);
                    let answered = before_commit && phase.ok.remove(rank).is_some();
                    self.tally.lost_after_answering += u64::from(answered);
                    if phase.pending.remove(rank) || answered {
                        phase.failures.push(RankFailure { rank: *rank, cause: FailureCause::Died(cause.clone()) });
                    }
                }
            }
            Input::Timeout { txn } => {
                if self.active.is_none() {
                    return;
                }
                let Some(phase) = self.phase.as_mut().filter(|p| p.txn == *txn) else { return };
                let name = phase.kind.name();
                for rank in std::mem::take(&mut phase.pending) {
                    self.tally.timeouts += 1;
                    self.lost.insert(rank, format!("no answer to {name} within {TIMEOUT_MS} ms"));
                    phase.failures.push(RankFailure { rank, cause: FailureCause::TimedOut { phase: name, timeout_ms: TIMEOUT_MS } });
                }
            }
            Input::RunStep { .. } | Input::Query(_) => {}
        }
    }

    /// When the phase of the request being served is over (or it has not started), what must
    /// follow; the books move to it.
    fn phase_over(&mut self) -> Option<Expect> {
        if self.phase.as_ref().is_some_and(|p| !p.pending.is_empty()) {
            return None;
        }
        let live = self.live();
        let epoch = self.epoch;
        let req = self.active.as_mut()?;
        let Some(phase) = self.phase.as_ref() else {
            // The request's first phase.
            return Some(match req {
                Req::Step { step, .. } => {
                    Expect::Phase { kind: PhaseKind::Prepare, cmd: Cmd::Prepare(StepOrder { step: *step, epoch, attempt: 0 }), to: live }
                }
                Req::Query(Query::Memory) => Expect::Phase { kind: PhaseKind::Memory, cmd: Cmd::Memory, to: live },
                Req::Query(Query::Shards) => Expect::Phase { kind: PhaseKind::Shards, cmd: Cmd::Shards, to: live },
            });
        };
        if !phase.pending.is_empty() {
            return None;
        }
        let mut failures = phase.failures.clone();
        failures.sort_by_key(|f| f.rank);
        Some(match req {
            Req::Query(query) => {
                let result = if failures.is_empty() { Ok(phase.ok.clone()) } else { Err(failures) };
                Expect::Reply(Reply::Queried { query: *query, result })
            }
            Req::Step { step, attempt, abandoned_attempts, prepared, failure, .. } => match phase.kind {
                PhaseKind::Prepare if failures.is_empty() => {
                    // No failure: every member of the epoch answered this attempt's prepare
                    // (steps run only with none lost).
                    let every: BTreeSet<usize> = (0..self.world.members).collect();
                    assert_eq!(phase.ok.keys().copied().collect::<BTreeSet<_>>(), every, "the oracle's books");
                    *prepared = phase.ok.clone();
                    if *attempt == 0 && self.world.abandon_steps.contains(step) {
                        abandoned_attempts.push(0);
                        self.counts.abandon_phases += 1;
                        Expect::Phase { kind: PhaseKind::Abandon, cmd: Cmd::Abandon(*step), to: live }
                    } else {
                        Expect::Phase { kind: PhaseKind::Commit, cmd: Cmd::Commit(*step), to: live }
                    }
                }
                PhaseKind::Prepare => {
                    *failure = Some(failures);
                    abandoned_attempts.push(*attempt);
                    self.counts.abandon_phases += 1;
                    Expect::Phase { kind: PhaseKind::Abandon, cmd: Cmd::Abandon(*step), to: live }
                }
                PhaseKind::Abandon => {
                    let mut all = failure.take().unwrap_or_default();
                    all.extend(failures);
                    all.sort_by_key(|f| f.rank);
                    if all.is_empty() {
                        *attempt += 1;
                        prepared.clear();
                        let order = StepOrder { step: *step, epoch, attempt: *attempt };
                        Expect::Phase { kind: PhaseKind::Prepare, cmd: Cmd::Prepare(order), to: live }
                    } else {
                        Expect::Reply(Reply::Abandoned { step: *step, failures: all })
                    }
                }
                PhaseKind::Commit => {
                    let attempted =
                        Attempted { step: *step, epoch, abandoned_attempts: abandoned_attempts.clone(), prepared: prepared.clone() };
                    if failures.is_empty() {
                        Expect::Reply(Reply::Committed(attempted))
                    } else {
                        Expect::Reply(Reply::CommitFailed { failures, attempted })
                    }
                }
                PhaseKind::Memory | PhaseKind::Shards => unreachable!("a step in a query phase"),
            },
        })
    }

    /// A command goes to member `rank`: the member-level rules.
    fn on_send(&mut self, rank: usize, cmd: Cmd) -> Result<(), String> {
        let Some(Req::Step { step, attempt, prepare_txn, .. }) = self.active.clone() else { return Ok(()) };
        match cmd {
            Cmd::Prepare(order) => {
                if order != (StepOrder { step, epoch: self.epoch, attempt }) {
                    return Err(format!("prepare {order:?} while step {step} attempt {attempt} runs"));
                }
            }
            Cmd::Commit(s) => {
                if s != step || self.members[rank].prepared != Some(prepare_txn) {
                    let staged = self.members[rank].prepared;
                    return Err(format!("commit of step {s} (prepared in {prepare_txn}) sent to member {rank}, which staged {staged:?}"));
                }
                if self.abandoned.contains(&prepare_txn) {
                    return Err(format!("commit of step {step} attempt {attempt}, which was abandoned"));
                }
                // Every member of the epoch prepared this attempt, as the driver heard it.
                let every = (0..self.world.members).all(|r| self.members[r].last_prepared == Some(prepare_txn));
                if !every {
                    return Err(format!("commit of step {step} attempt {attempt} before every member prepared it"));
                }
            }
            Cmd::Abandon(s) => {
                if s != step {
                    return Err(format!("abandon of step {s} while step {step} runs"));
                }
                self.abandoned.insert(prepare_txn);
            }
            Cmd::Memory | Cmd::Shards => return Err(format!("{cmd:?} during step {step}")),
        }
        Ok(())
    }

    /// Member `rank` gets `cmd` under `txn`: what it does, its books, the deliveries it
    /// causes. Returns the rank when its mailbox is closed.
    fn behave(&mut self, rank: usize, txn: u64, cmd: Cmd, pool: &mut Pool, rng: &mut Rng) -> Option<usize> {
        let b = if rng.gen_range(100) < self.world.p_fault {
            match rng.gen_range(12) {
                0..=2 => Behaviour::Error,
                3..=4 => Behaviour::DieBefore,
                5..=6 => Behaviour::DieAfter,
                7..=8 => Behaviour::Hang,
                9..=10 => Behaviour::Late,
                _ => Behaviour::Closed,
            }
        } else {
            Behaviour::Answer
        };
        if b == Behaviour::Closed {
            return Some(rank);
        }
        let member = &mut self.members[rank];
        let answers = matches!(b, Behaviour::Answer | Behaviour::DieAfter | Behaviour::Late);
        let error = match cmd {
            Cmd::Abandon(_) => None,
            _ => (b == Behaviour::Error).then(|| returned_error(rank, txn)),
        };
        // What the member did (it does it even if the driver never hears of it).
        match cmd {
            Cmd::Prepare(_) => {
                member.prepared = answers.then_some(txn);
                member.last_prepared = member.prepared;
            }
            Cmd::Commit(step) => {
                if answers {
                    member.committed.push(step);
                }
                member.prepared = None;
            }
            Cmd::Abandon(_) => member.prepared = None,
            Cmd::Memory | Cmd::Shards => {}
        }
        let answer = match error {
            Some(e) => Some(Input::Answer { rank, txn, result: Err(e) }),
            None => (answers || (b == Behaviour::Error)).then_some(Input::Answer { rank, txn, result: Ok((rank, txn)) }),
        };
        match b {
            Behaviour::Late => pool.late.extend(answer.map(|a| (txn, a))),
            _ => pool.events.extend(answer),
        }
        if matches!(b, Behaviour::DieBefore | Behaviour::DieAfter) {
            pool.events.push(Input::Lost { rank, cause: format!("rank {rank} died in {txn}") });
        }
        None
    }

    /// The request being served got `reply` (checked equal to what the oracle expected).
    fn answered(&mut self, reply: Reply<Ans>) -> Result<(), String> {
        self.replies.push(Ok(reply.clone()));
        match reply {
            Reply::Committed(a) => {
                // The driver heard every member of the epoch commit, each before it was lost.
                let heard: BTreeSet<usize> = self.phase.iter().flat_map(|p| p.ok.keys().copied()).collect();
                if self.phase.as_ref().map(|p| p.kind) != Some(PhaseKind::Commit) || heard.len() != self.world.members {
                    return Err(format!("step {} answered committed; commits heard from {heard:?} of {}", a.step, self.world.members));
                }
                for (rank, member) in self.members.iter().enumerate() {
                    if member.committed.last() != Some(&a.step) {
                        return Err(format!("step {} answered committed; member {rank} committed {:?}", a.step, member.committed));
                    }
                }
                self.last_committed = Some(a.step);
                self.counts.committed += 1;
                self.tally.committed += 1;
            }
            Reply::CommitFailed { attempted, .. } => {
                let done = self.members.iter().filter(|m| m.committed.last() == Some(&attempted.step)).count();
                if done == self.world.members && self.lost.is_empty() {
                    return Err(format!("the commit of step {} answered failed with every member committed and none lost", attempted.step));
                }
                self.tally.partial_commits += u64::from(done > 0);
                self.inconsistent = Some(attempted.step);
                self.counts.commits_failed += 1;
                self.tally.commits_failed += 1;
            }
            Reply::Abandoned { .. } => {
                self.counts.abandoned += 1;
                self.tally.abandoned += 1;
            }
            Reply::Queried { result, .. } => self.tally.queries_failed += u64::from(result.is_err()),
        }
        self.active = None;
        self.phase = None;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Seeds per CI run (override with TESSERA_SIM_SEEDS).
    const DEFAULT_SEEDS: u64 = 25_000;

    #[test]
    fn txn_many_seeds() {
        let mut tally = Tally::default();
        let n =
            crate::sim_support::many_seeds("step transaction", "-p tessera-actors txn_replay", DEFAULT_SEEDS, run_seed, |t| tally.add(t));
        println!("{tally:?}");
        // Every path must actually be exercised.
        let some = n / 100;
        let counts = [
            tally.committed,
            tally.abandoned,
            tally.commits_failed,
            tally.partial_commits,
            tally.lost_after_answering,
            tally.chaos_abandons,
            tally.timeouts,
            tally.late_answers,
            tally.closed_mailboxes,
            tally.busy_refusals,
            tally.lost_refusals,
            tally.repeat_refusals,
            tally.inconsistent_refusals,
            tally.queries,
            tally.queries_failed,
            tally.idle_losses,
        ];
        assert!(counts.iter().all(|&c| c >= some), "some path is rarely exercised: {tally:?}");
    }

    #[test]
    fn txn_replay() {
        crate::sim_support::replay(build, run_seed);
    }

    #[test]
    fn txn_sim_is_deterministic() {
        crate::sim_support::assert_deterministic(run_seed);
    }
}
