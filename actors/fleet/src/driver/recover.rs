//! Recovery (see the module doc's "Recovery"): whether a step boundary must form a new epoch,
//! and what the new one is made of: the survivors, the joiners, the state in memory or a
//! checkpoint ([`super::epoch`] forms and installs it).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tessera_actors::compute::WorkerCompute;
use tessera_actors::formation::{FormMembers, Formation};
use tessera_actors::recovery::{self, Holdings, Survivor};

use super::epoch::Installed;
use super::proxy::{Failure, Link, Member};
use super::{relock, Fleet, MONITOR_POLL_MS};
use crate::state::{FleetPlan, OptimBuffers, Planner, RankCounters, Start};
use crate::wire::{Snapshot, ToParent, ToWorker};

/// A new epoch, ready to run steps from `step`.
pub struct Reconfigured<P> {
    pub plan: Arc<P>,
    pub computes: Vec<Box<dyn WorkerCompute>>,
    /// The committed steps of the state the epoch starts from (below the driver's count when it
    /// came from a checkpoint: the driver replays the steps in between).
    pub step: u64,
    /// Where the state came from, for people.
    pub source: String,
    /// Whether it came from the members' memory (else from a checkpoint or the seeded start).
    pub from_memory: bool,
    /// Losses recovered from.
    pub losses: usize,
    /// Workers that drained and joined.
    pub drained: usize,
    pub joined: usize,
    /// Seconds the formation of the epoch waited for its members (joins below `min_workers`):
    /// not training time.
    pub join_wait_s: f64,
}

/// Who answered recovery's first step ([`Fleet::poll_survivors`]).
struct Survivors {
    /// The members and drainers that answered `Status`.
    alive: Vec<Arc<Member>>,
    /// What each of them holds, in the same order.
    holdings: Vec<Holdings<u64>>,
}

/// The members of a new epoch ([`Fleet::next_members`]).
struct NewMembers {
    /// In rank order.
    next: Vec<Arc<Member>>,
    /// Survivors that asked to drain: no members, they leave once the new epoch is installed.
    draining: Vec<Arc<Member>>,
}

/// The state a new epoch starts from ([`Fleet::recovered_state`]).
struct RecoveredState {
    start: Start,
    /// Where it came from, for people.
    source: String,
    /// Whether it came from the members' memory (else from a checkpoint or the seeded start).
    from_memory: bool,
}

/// Loads the state at or before a step from checkpoints (the driver's restore path).
pub type Restore<'a> = dyn Fn(u64) -> Result<(Start, String)> + 'a;

impl<P: FleetPlan> Fleet<P> {
    /// Whether the next step boundary must form a new epoch: a loss, a drain request, or a
    /// join with room for it. Waits up to `settle_ms` for a loss to be noticed (after a step
    /// failed, the monitor may still be looking).
    pub fn pending(&self, settle_ms: u64) -> bool {
        let deadline = Instant::now() + Duration::from_millis(settle_ms);
        loop {
            let lost = !relock(&self.shared.losses).is_empty();
            let draining = self.members.iter().any(|m| self.shared.draining(m.id));
            let waiting = !relock(&self.shared.joiners).is_empty() || !self.admitted.is_empty();
            let joins = waiting && self.members.len() < self.shared.er.max_workers;
            if lost || draining || joins || Instant::now() >= deadline {
                return lost || draining || joins;
            }
            std::thread::sleep(Duration::from_millis(MONITOR_POLL_MS));
        }
    }

    /// Forms a new epoch at the boundary of the first of `at` (committed steps, best first)
    /// whose state is whole in memory, else from a checkpoint (see the module doc).
    pub fn reconfigure(&mut self, at: &[u64], planner: &dyn Planner<P>, restore: &Restore<'_>) -> Result<Reconfigured<P>> {
        let attempts = self.shared.ids as usize + 2;
        let mut losses = 0;
        // (drained, joined) over every epoch formed meanwhile, also ones lost again at once.
        let mut moved = (0, 0);
        // Seconds every attempt's formation waited for its members.
        let mut join_wait_s = 0.0;
        for _ in 0..attempts {
            losses += std::mem::take(&mut *relock(&self.shared.losses)).len();
            if let Some(mut r) = self.try_reconfigure(at, planner, restore, &mut moved, &mut join_wait_s)? {
                losses += std::mem::take(&mut *relock(&self.shared.losses)).len();
                (r.losses, r.drained, r.joined, r.join_wait_s) = (losses, moved.0, moved.1, join_wait_s);
                return Ok(r);
            }
        }
        bail!("gave up forming a new epoch after {attempts} attempts: workers kept failing")
    }

    /// One attempt; `moved` counts the workers that drained and joined once the epoch formed
    /// (before its replicas are copied, which a loss can still make fail). `at` lists the
    /// committed steps whose state may be taken, best first: the first one that every shard
    /// reaches in memory, else a checkpoint at or before the last one. `Ok(None)`: a member was
    /// lost meanwhile (recorded), and the caller starts again.
    fn try_reconfigure(
        &mut self,
        at: &[u64],
        planner: &dyn Planner<P>,
        restore: &Restore<'_>,
        moved: &mut (usize, usize),
        join_wait_s: &mut f64,
    ) -> Result<Option<Reconfigured<P>>> {
        // 1. Who is left and what they hold (members, and drainers not yet let go).
        let Some(Survivors { alive, holdings }) = self.poll_survivors()? else { return Ok(None) };
        // 2. Where the state comes from: the installed epoch's shards in memory (owners,
        // replicas, or shards kept while a later epoch formed), else a checkpoint.
        let Some(RecoveredState { start, source, from_memory }) = self.recovered_state(&alive, &holdings, at, restore)? else {
            return Ok(None);
        };
        // 3. The members of the new epoch: survivors minus drainers in their old order, then
        // admitted joiners (`recovery::next_members`); below `min_workers` wait for joins.
        let Some(NewMembers { next, draining }) = self.next_members(&alive, join_wait_s)? else { return Ok(None) };
        let joined = next.iter().filter(|m| !self.members.iter().any(|o| o.id == m.id)).count();
        // 4. The new plan and epoch: every member gets its rank, the addresses and its state.
        let world = next.len();
        let plan = Arc::new(planner.plan(world).with_context(|| format!("planning {world} ranks"))?);
        let epoch = self.epoch + 1;
        if !self.form_epoch(&next, epoch, &plan, &start)? {
            return Ok(None);
        }
        // 5. The new epoch takes over; its replicas get their first full copy, which installs
        // it. Until then the workers keep what they hold of the installed epoch and draining
        // workers stay (they hold some of it): a loss meanwhile is restored from memory.
        self.take_over(next, draining, epoch, &plan);
        self.log_epoch(start.step, &source);
        tracing::info!("elastic: epoch {epoch}: {world} worker(s), state from {source}");
        moved.1 += joined;
        if self.replicate(start.step).is_err() {
            return Ok(None);
        }
        moved.0 += self.install();
        let computes = self.computes();
        let (drained, joined) = *moved;
        Ok(Some(Reconfigured { plan, computes, step: start.step, source, from_memory, losses: 0, drained, joined, join_wait_s: 0.0 }))
    }

    /// Recovery's step 1: every member not fenced, and every drainer not yet let go, reports
    /// its `Status`. Returns those that answered and what each holds; `Ok(None)` when one was
    /// lost.
    fn poll_survivors(&self) -> Result<Option<Survivors>> {
        let mut alive: Vec<Arc<Member>> = Vec::new();
        let mut holdings: Vec<Holdings<u64>> = Vec::new();
        let polled: Vec<Arc<Member>> = self.members.iter().chain(&self.leavers).filter(|m| !self.shared.is_fenced(m.id)).cloned().collect();
        for m in polled {
            let mut link = relock(&m.link);
            match self.request(&m, &mut link, &ToWorker::Status, "Status") {
                Ok(ToParent::Status { epoch, at, replicas, kept_epoch, kept }) => {
                    drop(link);
                    holdings.push(Holdings { id: m.id, epoch, at, replicas, kept_epoch, kept });
                    alive.push(m);
                }
                Ok(other) => bail!("worker {} answered Status with {other:?}", m.id),
                Err(_) => return Ok(None),
            }
        }
        Ok(Some(Survivors { alive, holdings }))
    }

    /// Recovery's step 2: the state the new epoch starts from, as [`recovery::choose_source`]
    /// picks it from what the survivors (`alive`, holding `holdings`) reported: the installed
    /// epoch's shards in memory at the first of `at` they all reach, else `restore` from a
    /// checkpoint. `Ok(None)` when a holder was lost while handing its shard over.
    fn recovered_state(
        &self,
        alive: &[Arc<Member>],
        holdings: &[Holdings<u64>],
        at: &[u64],
        restore: &Restore<'_>,
    ) -> Result<Option<RecoveredState>> {
        let installed = self.installed.clone();
        let chosen = recovery::choose_source(installed.as_ref().map(Installed::layout), holdings, at).context("no step to recover at")?;
        let from_memory = matches!(chosen, recovery::Restore::Memory { .. });
        let (start, source) = match chosen {
            recovery::Restore::Memory { step: t, sources } => {
                let inst = installed.as_ref().context("a restore from memory without an installed epoch")?;
                match self.state_from_memory(inst, t, sources, alive)? {
                    Some(state) => state,
                    None => return Ok(None),
                }
            }
            recovery::Restore::Checkpoint { at_most } => restore(at_most)?,
        };
        Ok(Some(RecoveredState { start, source, from_memory }))
    }

    /// The full state at step `t` in the installed epoch `inst`'s layout, gathered rank by rank
    /// from the holders `sources` names (owners, replicas, kept copies) among `alive`, and where
    /// it came from, for people. `Ok(None)` when a holder was lost.
    fn state_from_memory(
        &self,
        inst: &Installed<P>,
        t: u64,
        sources: Vec<(usize, recovery::Source<u64>)>,
        alive: &[Arc<Member>],
    ) -> Result<Option<(Start, String)>> {
        let old = &inst.plan;
        let mut master = Vec::with_capacity(old.total());
        let mut bufs: OptimBuffers = Vec::new();
        let mut counters: Option<RankCounters> = None;
        let mut from_replicas = Vec::new();
        for (o, src) in sources {
            let (msg, replica) = match src {
                recovery::Source::Own { .. } => (ToWorker::Export { optim: true }, false),
                recovery::Source::Replica { .. } => (ToWorker::ExportReplica { owner: o as u64, epoch: inst.epoch }, true),
                recovery::Source::Kept { owner, replica, .. } => (ToWorker::ExportReplica { owner, epoch: inst.epoch }, replica),
            };
            let holder = *src.holder();
            let m = alive
                .iter()
                .find(|m| m.id == holder)
                .with_context(|| format!("worker {holder} holds rank {o}'s shard but did not answer Status"))?;
            let want = old.optim_range(o).len();
            let (mm, ob, c) = match self.export_from(m, &msg, want) {
                Ok(x) => x,
                Err(Failure::Lost) => return Ok(None),
                Err(Failure::Refused(e)) => bail!("worker {} could not hand over the shard of rank {o}: {e}", m.id),
            };
            if replica {
                from_replicas.push(format!("rank {o} from worker {}", m.id));
            }
            master.extend_from_slice(&mm);
            for (i, (name, b)) in ob.into_iter().enumerate() {
                match bufs.get_mut(i) {
                    Some((_, v)) => v.extend_from_slice(&b),
                    None => bufs.push((name, b)),
                }
            }
            counters.get_or_insert(c);
        }
        let c = counters.context("no shard was exported")?;
        let of = match inst.epoch == self.epoch {
            true => String::new(),
            false => format!(" of epoch {} (kept while epoch {} formed)", inst.epoch, self.epoch),
        };
        let source = match from_replicas.is_empty() {
            true => format!("memory: the members' shards{of} at step {t}"),
            false => format!("memory: replicas ({}){of} at step {t}", from_replicas.join(", ")),
        };
        let start =
            Start { step: t, master, optim: Some((c.optimizer_steps, bufs)), applied: c.applied, skipped: c.skipped, scaler: c.scaler };
        Ok(Some((start, source)))
    }

    /// Recovery's step 3: the members of the new epoch and the drainers among the survivors
    /// `alive`, as [`FormMembers`] forms them from the survivors, the
    /// admitted joiners and those that join meanwhile; below `min_workers` it waits for joins
    /// (the wait is added to `join_wait_s`). `Ok(None)` when a chosen member was lost meanwhile.
    fn next_members(&mut self, alive: &[Arc<Member>], join_wait_s: &mut f64) -> Result<Option<NewMembers>> {
        let shared = Arc::clone(&self.shared);
        let survivors: Vec<Survivor<Arc<Member>>> =
            alive.iter().map(|m| Survivor { id: Arc::clone(m), draining: shared.draining(m.id) }).collect();
        // The wait for joins is `formation::FormMembers`, fed the ms since it started.
        let began = Instant::now();
        let ms = || began.elapsed().as_millis() as u64;
        let (er, admitted) = (&shared.er, std::mem::take(&mut self.admitted));
        let mut form = FormMembers::new(survivors, admitted, er.min_workers, er.max_workers, er.join_wait_ms, 0);
        let (next, draining) = loop {
            for j in relock(&shared.joiners).drain(..) {
                let link = Mutex::new(Link { stream: j.conn, snapshot: Snapshot::default() });
                form.join(Arc::new(Member { id: j.id, pid: j.pid, link }));
            }
            match form.poll(ms(), |m| shared.is_fenced(m.id)) {
                Formation::Formed { members, draining } => break (members, draining),
                Formation::Wait { say } => {
                    if let Some(line) = say {
                        tracing::info!("{line}");
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
                Formation::Fail(e) => {
                    self.admitted = form.into_admitted();
                    bail!("{e}");
                }
            }
        };
        self.admitted = form.into_admitted();
        *join_wait_s += began.elapsed().as_secs_f64();
        if next.iter().any(|m| shared.is_fenced(m.id)) {
            return Ok(None);
        }
        Ok(Some(NewMembers { next, draining }))
    }

    /// Recovery's step 5: the formed epoch `epoch` of `next` under `plan` becomes the current
    /// one. Admitted joiners in it stop waiting, `draining` survivors become leavers (they leave
    /// once it is installed), and its members are measured again under the plan's even blocks.
    fn take_over(&mut self, next: Vec<Arc<Member>>, draining: Vec<Arc<Member>>, epoch: u64, plan: &Arc<P>) {
        self.admitted.retain(|a| !next.iter().any(|m| m.id == a.id));
        self.leavers = draining;
        // The new epoch runs the plan's even blocks: its members are measured again.
        self.speeds.retain(|id| next.iter().any(|m| m.id == *id));
        self.speeds.restart();
        self.rebalancer.clear();
        self.members = next;
        self.epoch = epoch;
        self.plan = Arc::clone(plan);
    }
}
