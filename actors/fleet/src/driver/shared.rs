//! What the driver's threads share ([`Shared`]): membership, ids, losses and fencing, the
//! event log; a worker's signs of life ([`Beat`]) and joiners waiting for the next epoch.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::Write;
use std::process::Child;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde_json::json;
use tessera_actors::faults::Faults;
use tessera_actors::liveness::Exit;
use tessera_actors::WorkerStopper;
use tessera_transport::quic::ControlConn;

use super::{now_ms, relock};
use crate::join::{Admission, Pidfd};
use crate::rendezvous::{self, Launched};
use crate::spec::ElasticRun;
use crate::wire::{self, ToWorker};

/// A worker's signs of life, fed by its side connection (and, for a process of this host that
/// is not our child, its pidfd).
pub(crate) struct Beat {
    pid: AtomicU32,
    /// A joiner or agent on this host: watched and killed through its pidfd.
    pub local: Mutex<Option<Pidfd>>,
    pub last: Mutex<Instant>,
    pub closed: AtomicBool,
    pub draining: AtomicBool,
}

impl Beat {
    pub fn new(pid: u32) -> Arc<Beat> {
        Arc::new(Beat {
            pid: AtomicU32::new(pid),
            local: Mutex::new(None),
            last: Mutex::new(Instant::now()),
            closed: AtomicBool::new(false),
            draining: AtomicBool::new(false),
        })
    }

    pub fn pid(&self) -> u32 {
        self.pid.load(Ordering::SeqCst)
    }

    pub fn set_pid(&self, pid: u32) {
        self.pid.store(pid, Ordering::SeqCst);
    }
}

/// A loss not yet recovered from.
#[derive(Debug, Clone)]
pub(super) struct Loss {
    pub(super) id: u64,
    pub(super) why: String,
    /// How its process had ended when it was declared (a child or a launched agent of this
    /// process), if it had.
    pub(super) exit: Option<Exit>,
}

/// A worker that joined and waits for the next epoch.
pub(crate) struct Joiner {
    pub id: u64,
    pub pid: u32,
    pub conn: ControlConn,
}

/// What the driver's threads share.
pub(crate) struct Shared {
    pub er: ElasticRun,
    pub cfg_hash: String,
    /// Ids a worker may have: `0..ids` (the first epoch's, then `max_joins` more).
    pub ids: u64,
    pub(super) next_id: AtomicU64,
    /// Ids given out (never given again).
    pub known: Mutex<BTreeSet<u64>>,
    pub closing: AtomicBool,
    /// The monitor's clock starts here (before any heartbeat).
    pub(super) clock: Instant,
    pub(super) epoch: AtomicU64,
    pub(super) children: Mutex<Vec<(u64, Child)>>,
    /// Processes `tessera launch` started for the agents (reaped by it after the run).
    pub(super) launched: Arc<Mutex<Vec<Launched>>>,
    /// Who each first-epoch worker is in messages ("worker process of rank 1 (pid 42)", "agent
    /// of rank 1 (a1 at 10.0.0.2, pid 42)").
    pub(super) names: Mutex<BTreeMap<u64, String>>,
    pub beats: Mutex<BTreeMap<u64, Arc<Beat>>>,
    pub sides: Mutex<BTreeMap<u64, ControlConn>>,
    /// Every worker's control connection, closed when it is lost.
    pub controls: Mutex<BTreeMap<u64, ControlConn>>,
    /// The current epoch's member ids.
    pub(super) members: Mutex<Vec<u64>>,
    pub(super) losses: Mutex<Vec<Loss>>,
    pub(super) fenced: Mutex<BTreeSet<u64>>,
    /// Ids told to leave (their exit is not a loss).
    pub(super) leaving: Mutex<BTreeSet<u64>>,
    pub joiners: Mutex<Vec<Joiner>>,
    pub(super) events: Mutex<File>,
    pub admission: Admission,
    /// Stops a rank's DeviceWorker actor of the current epoch's tree (the `stop_actor` fault).
    pub(super) stopper: Mutex<Option<WorkerStopper>>,
    /// The driver's fault hooks (`stop_actor`; no-op unless a test asked for them).
    pub(super) faults: Faults,
}

impl Shared {
    pub fn event(&self, mut v: serde_json::Value) {
        v["t_ms"] = json!(now_ms());
        let mut f = relock(&self.events);
        let _ = writeln!(f, "{v}");
        let _ = f.flush();
    }

    pub fn is_fenced(&self, id: u64) -> bool {
        relock(&self.fenced).contains(&id)
    }

    fn pid_of(&self, id: u64) -> Option<u32> {
        relock(&self.beats).get(&id).map(|b| b.pid())
    }

    /// The next free id for a joiner, if `tessera.elastic.max_joins` leaves one.
    pub fn take_id(&self) -> Option<u64> {
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        (id < self.ids).then(|| {
            relock(&self.known).insert(id);
            id
        })
    }

    /// Drops a joiner that failed its admission: its id is never used again.
    pub fn forget(&self, id: u64) {
        relock(&self.fenced).insert(id);
        relock(&self.beats).remove(&id);
        if let Some(s) = relock(&self.sides).remove(&id) {
            s.abort("not admitted");
        }
    }

    /// Records that worker `id` is lost (once), kills it when it can (our child, or a process
    /// of this host through its pidfd), closes its connections and aborts the current epoch's
    /// group.
    pub(super) fn loss(&self, id: u64, why: &str) {
        if !relock(&self.fenced).insert(id) {
            return;
        }
        let pid = self.pid_of(id);
        tracing::info!("elastic: lost {why}");
        let exit = self.exit_of(id, pid);
        relock(&self.losses).push(Loss { id, why: why.to_string(), exit });
        self.event(json!({"event": "lost", "id": id, "pid": pid, "why": why}));
        let mut killed = false;
        for (_, c) in relock(&self.children).iter_mut().filter(|(cid, _)| *cid == id) {
            killed = true;
            let _ = c.kill();
            let _ = c.wait();
        }
        let beat = relock(&self.beats).remove(&id);
        if let (false, Some(b)) = (killed, &beat) {
            // A joiner is not our child: a stopped one must not come back.
            if let Some(fd) = relock(&b.local).as_ref() {
                fd.kill();
            }
        }
        // Elsewhere, a worker whose side connection closes leaves on its own.
        let reason = "declared lost (fenced)";
        if let Some(s) = relock(&self.sides).remove(&id) {
            s.abort(reason);
        }
        if let Some(c) = relock(&self.controls).remove(&id) {
            c.abort(reason);
        }
        relock(&self.joiners).retain(|j| j.id != id);
        self.abort_epoch();
    }

    /// How worker `id`'s process (`pid`) had ended, if it had and the driver can tell: its
    /// child, or an agent `tessera launch` started here.
    fn exit_of(&self, id: u64, pid: Option<u32>) -> Option<Exit> {
        let mut children = relock(&self.children);
        match children.iter_mut().find(|(cid, _)| *cid == id) {
            Some((_, c)) => c.try_wait().ok().flatten().map(Exit::of),
            None => pid.and_then(|p| rendezvous::launched_exit_of(&self.launched, p)),
        }
    }

    /// Aborts the current epoch's collectives on every member.
    pub(super) fn abort_epoch(&self) {
        let epoch = self.epoch.load(Ordering::SeqCst);
        let members = relock(&self.members).clone();
        let sides: Vec<ControlConn> = {
            let sides = relock(&self.sides);
            members.iter().filter_map(|id| sides.get(id).cloned()).collect()
        };
        for mut s in sides {
            let _ = wire::send(&mut s, &ToWorker::Abort { epoch });
        }
    }

    pub(super) fn draining(&self, id: u64) -> bool {
        relock(&self.beats).get(&id).is_some_and(|b| b.draining.load(Ordering::SeqCst))
    }
}

impl Shared {
    /// The driver's shared state at the start of a run: `world` first-epoch workers (ids
    /// `0..world`; `er.max_joins` more ids for joiners), nothing else known yet.
    pub(super) fn new(er: ElasticRun, world: u64, cfg_hash: String, admission: Admission, events: File) -> Shared {
        Shared {
            ids: world + er.max_joins as u64,
            er,
            cfg_hash,
            next_id: AtomicU64::new(world),
            known: Mutex::new((0..world).collect()),
            closing: AtomicBool::new(false),
            clock: Instant::now(),
            epoch: AtomicU64::new(0),
            children: Mutex::new(Vec::new()),
            launched: Arc::new(Mutex::new(Vec::new())),
            names: Mutex::new(BTreeMap::new()),
            beats: Mutex::new(BTreeMap::new()),
            sides: Mutex::new(BTreeMap::new()),
            controls: Mutex::new(BTreeMap::new()),
            members: Mutex::new(Vec::new()),
            losses: Mutex::new(Vec::new()),
            fenced: Mutex::new(BTreeSet::new()),
            leaving: Mutex::new(BTreeSet::new()),
            joiners: Mutex::new(Vec::new()),
            events: Mutex::new(events),
            admission,
            stopper: Mutex::new(None),
            faults: Faults::default(),
        }
    }
}

#[cfg(test)]
impl Shared {
    /// The driver's shared state with `world` first-epoch workers (ids `0..world`, `max_joins`
    /// more) and no fleet behind it: for tests of the acceptor ([`crate::join`]).
    pub fn for_tests(er: ElasticRun, world: u64, admission: Admission, events: File) -> Shared {
        Shared::new(er, world, "test".into(), admission, events)
    }

    /// Fences `id` as a loss would (without a fleet to abort).
    pub fn fence_for_tests(&self, id: u64) {
        relock(&self.fenced).insert(id);
    }
}
