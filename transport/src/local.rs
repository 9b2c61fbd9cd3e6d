//! The in-process backend: ranks are OS threads of one process that meet in shared memory;
//! reductions read the peers' buffers in place, published for the duration of the operation.
//!
//! # How an operation runs
//!
//! Each collective is a *session* of rounds of one generation-counted rendezvous (a `Mutex` +
//! `Condvar`). In the first round (`join`) every rank publishes raw views of its arguments; this
//! is the only round that can time out, be aborted or notice a dropped peer, and a rank that
//! gives up withdraws its post under the lock, so a round either completes with everyone or with
//! no one. Once it completes, every rank validates all posts (so all reach the same verdict),
//! reads the peers' buffers directly and writes its own output; the closing rounds (`sync`) wait
//! only for ranks that are inside the same session, which always arrive, even on panic (the
//! session's `Drop` performs them), so no buffer is released while a peer may still read it.
//!
//! Ranks must each run on their own OS thread (they block); they may use rayon inside, but must
//! not themselves be tasks of one rayon pool smaller than the world.

use crate::collective::CollectiveOp as Op;
use crate::collective::{
    chain_broadcast_traffic, check_ranges, even_ranges, gather_slices_traffic, ring_all_gather_traffic, ring_all_reduce_traffic,
    ring_reduce_scatter_traffic, AbortHandle, Collective, CollectiveError, CommStats, Traffic, DEFAULT_TIMEOUT_MS,
};
use std::collections::{HashMap, VecDeque};
use std::ops::{AddAssign, Range};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// The collective a rank is in; all ranks of a session must agree.
impl Op {
    /// Closing rounds after `join`: all-reduce publishes its reduced chunk in a second round.
    fn syncs(self) -> u32 {
        match self {
            Op::AllReduce | Op::AllReduceF64 => 2,
            _ => 1,
        }
    }
}

/// A borrowed slice published to the peers as a raw view.
#[derive(Debug)]
struct Raw<T> {
    ptr: *const T,
    len: usize,
}

impl<T> Clone for Raw<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Raw<T> {}

impl<T> Raw<T> {
    fn of(s: &[T]) -> Self {
        Self { ptr: s.as_ptr(), len: s.len() }
    }

    fn empty() -> Self {
        Self { ptr: NonNull::dangling().as_ptr(), len: 0 }
    }

    /// # Safety
    /// The publisher must keep the slice alive and unwritten until the round after the reader's
    /// use completes (the session protocol guarantees it for views read between rounds).
    unsafe fn get<'a>(self) -> &'a [T] {
        // SAFETY: `ptr` comes from a live slice of `len` elements (caller's contract).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// What a rank publishes in one round.
#[derive(Debug, Clone, Copy)]
struct Post {
    op: Op,
    f32s: Raw<f32>,
    f64s: Raw<f64>,
    ranges: Raw<Range<usize>>,
    /// all-to-all: one view per destination rank.
    lists: Raw<Raw<f32>>,
    out_len: usize,
    root: usize,
    /// Posted by a session unwinding from a panic instead of its data.
    panicked: bool,
}

// SAFETY: a `Post` only carries views whose use is synchronised by the session protocol.
unsafe impl Send for Post {}
// SAFETY: as above; posts are read, never written, by other threads.
unsafe impl Sync for Post {}

impl Post {
    fn new(op: Op) -> Self {
        Post { op, f32s: Raw::empty(), f64s: Raw::empty(), ranges: Raw::empty(), lists: Raw::empty(), out_len: 0, root: 0, panicked: false }
    }
}

struct State {
    posts: Vec<Option<Post>>,
    arrived: usize,
    /// Completed rounds.
    round: u64,
    /// Posts of the last completed round.
    done: Arc<[Post]>,
    aborted: Option<String>,
    gone: Vec<bool>,
    /// Point-to-point mailboxes keyed by (from, to, tag).
    mail: HashMap<(usize, usize, u64), VecDeque<Vec<f32>>>,
}

struct Shared {
    world: usize,
    state: Mutex<State>,
    cv: Condvar,
    /// Mirrors `state.aborted.is_some()` for lock-free checks on the world-1 path.
    aborted: AtomicBool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // No critical section can panic half-way, so a poisoned state is still consistent.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn abort(&self, reason: &str) {
        let mut st = self.lock();
        if st.aborted.is_none() {
            st.aborted = Some(reason.to_string());
        }
        self.aborted.store(true, Ordering::SeqCst);
        self.cv.notify_all();
    }

    /// Publishes `post`; the round completes when every rank has posted.
    fn arrive(&self, st: &mut State, rank: usize, post: Post) -> bool {
        st.posts[rank] = Some(post);
        st.arrived += 1;
        if st.arrived < self.world {
            return false;
        }
        st.done = st.posts.iter_mut().filter_map(Option::take).collect();
        st.arrived = 0;
        st.round += 1;
        self.cv.notify_all();
        true
    }

    /// The interruptible first round of a session.
    fn join(&self, rank: usize, post: Post, timeout_ms: u64) -> Result<Arc<[Post]>, CollectiveError> {
        let op = post.op.name();
        let mut st = self.lock();
        if let Some(reason) = &st.aborted {
            return Err(CollectiveError::Aborted { op, reason: reason.clone() });
        }
        let my_round = st.round;
        if self.arrive(&mut st, rank, post) {
            return Ok(st.done.clone());
        }
        let start = Instant::now();
        let deadline = start + Duration::from_millis(timeout_ms);
        loop {
            if st.round != my_round {
                return Ok(st.done.clone());
            }
            let gone = (0..self.world).find(|&p| st.gone[p] && st.posts[p].is_none());
            if let Some(err) = self.why_give_up(&mut st, rank, op, gone, start, deadline) {
                st.posts[rank] = None;
                st.arrived -= 1;
                return Err(err);
            }
            let wait = deadline.saturating_duration_since(Instant::now());
            st = self.cv.wait_timeout(st, wait).unwrap_or_else(PoisonError::into_inner).0;
        }
    }

    /// Why a rank waiting in `join` or `recv` must stop waiting, if it must: an abort, a peer
    /// it waits for that has left (`gone`), or its deadline (a timeout aborts the group).
    fn why_give_up(
        &self,
        st: &mut State,
        rank: usize,
        op: &'static str,
        gone: Option<usize>,
        start: Instant,
        deadline: Instant,
    ) -> Option<CollectiveError> {
        if let Some(reason) = &st.aborted {
            return Some(CollectiveError::Aborted { op, reason: reason.clone() });
        }
        if let Some(peer) = gone {
            return Some(CollectiveError::PeerGone { op, peer });
        }
        let now = Instant::now();
        if now < deadline {
            return None;
        }
        let waited_ms = now.duration_since(start).as_millis() as u64;
        st.aborted = Some(format!("rank {rank} timed out in {op} after {waited_ms} ms"));
        self.aborted.store(true, Ordering::SeqCst);
        self.cv.notify_all();
        Some(CollectiveError::Timeout { op, rank, waited_ms })
    }

    /// A closing round: waits only for ranks of the same session, which always arrive.
    fn sync(&self, rank: usize, post: Post) -> Arc<[Post]> {
        let mut st = self.lock();
        let my_round = st.round;
        if !self.arrive(&mut st, rank, post) {
            while st.round == my_round {
                st = self.cv.wait(st).unwrap_or_else(PoisonError::into_inner);
            }
        }
        st.done.clone()
    }
}

/// A joined collective: its `Drop` runs the closing rounds still owed, so peers reading this
/// rank's buffers finish before the buffers can be released (also when unwinding).
struct Session<'a> {
    shared: &'a Shared,
    rank: usize,
    op: Op,
    posts: Arc<[Post]>,
    syncs_left: u32,
}

impl<'a> Session<'a> {
    fn open(shared: &'a Shared, rank: usize, post: Post, timeout_ms: u64) -> Result<Self, CollectiveError> {
        let posts = shared.join(rank, post, timeout_ms)?;
        // Every rank computes the same count from the same posts.
        let agree = posts.iter().all(|p| p.op == post.op);
        let syncs_left = if agree { post.op.syncs() } else { 1 };
        Ok(Session { shared, rank, op: post.op, posts, syncs_left })
    }

    /// Runs the next closing round, publishing `post`; errors if a peer is unwinding.
    fn sync(&mut self, post: Post) -> Result<Arc<[Post]>, CollectiveError> {
        self.syncs_left = self.syncs_left.saturating_sub(1);
        let posts = self.shared.sync(self.rank, post);
        match posts.iter().position(|p| p.panicked) {
            Some(peer) => Err(CollectiveError::Aborted { op: self.op.name(), reason: format!("rank {peer} panicked") }),
            None => Ok(posts),
        }
    }

    fn mismatch(&self, detail: String) -> CollectiveError {
        CollectiveError::Mismatch { op: self.op.name(), detail }
    }

    /// Every rank is in the same operation (checked on the posts, so all ranks agree).
    fn check_same_op(&self) -> Result<(), CollectiveError> {
        match self.posts.iter().position(|p| p.op != self.posts[0].op) {
            Some(r) => {
                Err(self.mismatch(format!("rank {r} called {} but rank 0 called {}", self.posts[r].op.name(), self.posts[0].op.name())))
            }
            None => Ok(()),
        }
    }

    /// Every rank passed the same `len(post)`.
    fn check_same(&self, what: &str, len: impl Fn(&Post) -> usize) -> Result<(), CollectiveError> {
        let want = len(&self.posts[0]);
        match self.posts.iter().position(|p| len(p) != want) {
            Some(r) => Err(self.mismatch(format!("rank {r} has {what} {} but rank 0 has {want}", len(&self.posts[r])))),
            None => Ok(()),
        }
    }

    /// Every rank passed the same ranges (so each may go on using its own), valid for buffers
    /// of `total` elements.
    fn check_ranges(&self, total: usize) -> Result<(), CollectiveError> {
        // SAFETY: every post's views stay valid until this session's closing round.
        let ranges = |p: &Post| unsafe { p.ranges.get() };
        let first = ranges(&self.posts[0]);
        if let Some(r) = self.posts.iter().position(|p| ranges(p) != first) {
            return Err(self.mismatch(format!("rank {r} passed ranges {:?} but rank 0 passed {first:?}", ranges(&self.posts[r]))));
        }
        check_ranges(self.op.name(), first, self.posts.len(), total)
    }

    fn peer_f32s(&self, r: usize) -> &[f32] {
        // SAFETY: views published in `join` stay valid until this session's closing round.
        unsafe { self.posts[r].f32s.get() }
    }
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        let mut post = Post::new(self.op);
        post.panicked = std::thread::panicking();
        while self.syncs_left > 0 {
            // The result only reports peers' panics, which their own callers see.
            let _ = self.sync(post);
        }
    }
}

/// Builds in-process groups.
pub struct LocalGroup;

impl LocalGroup {
    /// One handle per rank of a group of `world` (empty for 0), with [`DEFAULT_TIMEOUT_MS`];
    /// move each to its own thread.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(world: usize) -> Vec<LocalComm> {
        Self::with_timeout_ms(world, DEFAULT_TIMEOUT_MS)
    }

    /// As [`LocalGroup::new`] with every handle's wait bounded by `timeout_ms`.
    pub fn with_timeout_ms(world: usize, timeout_ms: u64) -> Vec<LocalComm> {
        let state = State {
            posts: vec![None; world],
            arrived: 0,
            round: 0,
            done: Arc::from(Vec::new()),
            aborted: None,
            gone: vec![false; world],
            mail: HashMap::new(),
        };
        let shared = Arc::new(Shared { world, state: Mutex::new(state), cv: Condvar::new(), aborted: AtomicBool::new(false) });
        (0..world)
            .map(|rank| LocalComm {
                shared: shared.clone(),
                rank,
                timeout_ms,
                stats: CommStats::default(),
                scratch_f32: Vec::new(),
                scratch_f64: Vec::new(),
            })
            .collect()
    }
}

/// One rank's handle on an in-process group. Dropping it tells the peers it has left
/// ([`CollectiveError::PeerGone`]).
pub struct LocalComm {
    shared: Arc<Shared>,
    rank: usize,
    timeout_ms: u64,
    stats: CommStats,
    /// All-reduce chunk buffers, kept between calls.
    scratch_f32: Vec<f32>,
    scratch_f64: Vec<f64>,
}

impl std::fmt::Debug for LocalComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalComm").field("rank", &self.rank).field("world", &self.shared.world).finish()
    }
}

impl Drop for LocalComm {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        st.gone[self.rank] = true;
        self.shared.cv.notify_all();
    }
}

/// An element type the in-process all-reduce sums.
trait Elem: Copy + AddAssign + Send + Sync + 'static {
    const OP: Op;
    const BYTES: u64;
    fn publish(post: &mut Post, data: &[Self]);
    fn view(post: &Post) -> Raw<Self>;
    fn scratch(comm: &mut LocalComm) -> &mut Vec<Self>;
}

impl Elem for f32 {
    const OP: Op = Op::AllReduce;
    const BYTES: u64 = 4;
    fn publish(post: &mut Post, data: &[Self]) {
        post.f32s = Raw::of(data);
    }
    fn view(post: &Post) -> Raw<Self> {
        post.f32s
    }
    fn scratch(comm: &mut LocalComm) -> &mut Vec<Self> {
        &mut comm.scratch_f32
    }
}

impl Elem for f64 {
    const OP: Op = Op::AllReduceF64;
    const BYTES: u64 = 8;
    fn publish(post: &mut Post, data: &[Self]) {
        post.f64s = Raw::of(data);
    }
    fn view(post: &Post) -> Raw<Self> {
        post.f64s
    }
    fn scratch(comm: &mut LocalComm) -> &mut Vec<Self> {
        &mut comm.scratch_f64
    }
}

/// `acc ← acc + x`, elementwise (contributions are always added in rank order).
fn add_into<T: Elem>(acc: &mut [T], x: &[T]) {
    acc.iter_mut().zip(x).for_each(|(a, b)| *a += *b);
}

impl LocalComm {
    fn check_alive(&self, op: Op) -> Result<(), CollectiveError> {
        if !self.shared.aborted.load(Ordering::SeqCst) {
            return Ok(());
        }
        let reason = self.shared.lock().aborted.clone().unwrap_or_default();
        Err(CollectiveError::Aborted { op: op.name(), reason })
    }

    fn open(&self, post: Post) -> Result<Session<'_>, CollectiveError> {
        Session::open(&self.shared, self.rank, post, self.timeout_ms)
    }

    fn check_rank(&self, op: &'static str, what: &str, rank: usize) -> Result<(), CollectiveError> {
        match rank < self.shared.world {
            true => Ok(()),
            false => Err(CollectiveError::InvalidArgument {
                op,
                detail: format!("{what} {rank} is not a rank of a world of {}", self.shared.world),
            }),
        }
    }

    /// Ring-modelled all-reduce: each rank sums its [`even_ranges`] chunk of every buffer in
    /// rank order into `chunk`, publishes it, then copies all chunks into its buffer.
    fn all_reduce_generic<T: Elem>(&mut self, buf: &mut [T]) -> Result<(), CollectiveError> {
        let (world, rank) = (self.shared.world, self.rank);
        if world == 1 {
            self.check_alive(T::OP)?;
            self.stats.record(Traffic::default());
            return Ok(());
        }
        // Declared before the session, so it outlives the closing round in which peers read it.
        let mut chunk = std::mem::take(T::scratch(self));
        chunk.clear();
        let mut post = Post::new(T::OP);
        T::publish(&mut post, buf);
        let mut session = self.open(post)?;
        session.check_same_op()?;
        session.check_same("a buffer of length", |p| T::view(p).len)?;
        let ranges = even_ranges(buf.len(), world);
        // SAFETY: views published in `join` stay valid until the session's closing rounds.
        let peer = |r: usize| unsafe { T::view(&session.posts[r]).get() };
        let mine = ranges[rank].clone();
        chunk.extend_from_slice(&peer(0)[mine.clone()]);
        (1..world).for_each(|r| add_into(&mut chunk, &peer(r)[mine.clone()]));
        let mut chunk_post = Post::new(T::OP);
        T::publish(&mut chunk_post, &chunk);
        let chunks = session.sync(chunk_post)?;
        for (r, range) in ranges.iter().enumerate() {
            // SAFETY: chunks published in the second round live until the closing round.
            buf[range.clone()].copy_from_slice(unsafe { T::view(&chunks[r]).get() });
        }
        drop(session);
        *T::scratch(self) = chunk;
        self.stats.record(ring_all_reduce_traffic(buf.len(), world, rank, T::BYTES));
        Ok(())
    }
}

impl Collective for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.shared.world
    }

    fn timeout_ms(&self) -> u64 {
        self.timeout_ms
    }

    fn set_timeout_ms(&mut self, timeout_ms: u64) {
        self.timeout_ms = timeout_ms;
    }

    fn stats(&self) -> CommStats {
        self.stats
    }

    fn abort_handle(&self) -> AbortHandle {
        let shared = self.shared.clone();
        AbortHandle::new(move |reason| shared.abort(reason))
    }

    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        self.all_reduce_generic(buf)
    }

    fn all_reduce_sum_f64(&mut self, buf: &mut [f64]) -> Result<(), CollectiveError> {
        self.all_reduce_generic(buf)
    }

    fn reduce_scatter_sum(&mut self, input: &[f32], ranges: &[Range<usize>], out: &mut [f32]) -> Result<(), CollectiveError> {
        let mut post = Post::new(Op::ReduceScatter);
        (post.f32s, post.ranges, post.out_len) = (Raw::of(input), Raw::of(ranges), out.len());
        let session = self.open(post)?;
        session.check_same_op()?;
        session.check_same("an input of length", |p| p.f32s.len)?;
        session.check_ranges(input.len())?;
        check_out_lens(&session, |r| ranges[r].len())?;
        let mine = ranges[self.rank].clone();
        out.copy_from_slice(&session.peer_f32s(0)[mine.clone()]);
        (1..self.shared.world).for_each(|r| add_into(out, &session.peer_f32s(r)[mine.clone()]));
        drop(session);
        self.stats.record(ring_reduce_scatter_traffic(ranges, self.rank, 4));
        Ok(())
    }

    fn all_gather(&mut self, shard: &[f32], ranges: &[Range<usize>], out: &mut [f32]) -> Result<(), CollectiveError> {
        let mut post = Post::new(Op::AllGather);
        (post.f32s, post.ranges, post.out_len) = (Raw::of(shard), Raw::of(ranges), out.len());
        let session = self.open(post)?;
        session.check_same_op()?;
        session.check_same("an output of length", |p| p.out_len)?;
        session.check_ranges(out.len())?;
        if let Some(r) = (0..ranges.len()).find(|&r| session.posts[r].f32s.len != ranges[r].len()) {
            return Err(session.mismatch(format!("rank {r} passed a shard of {} for range {:?}", session.posts[r].f32s.len, ranges[r])));
        }
        for (r, range) in ranges.iter().enumerate() {
            out[range.clone()].copy_from_slice(session.peer_f32s(r));
        }
        drop(session);
        self.stats.record(ring_all_gather_traffic(ranges, self.rank, 4));
        Ok(())
    }

    fn gather_slices_with(
        &mut self,
        input: &[f32],
        ranges: &[Range<usize>],
        visit: &mut dyn FnMut(usize, &[f32]),
    ) -> Result<(), CollectiveError> {
        let mut post = Post::new(Op::GatherSlices);
        (post.f32s, post.ranges) = (Raw::of(input), Raw::of(ranges));
        let session = self.open(post)?;
        session.check_same_op()?;
        session.check_same("an input of length", |p| p.f32s.len)?;
        session.check_ranges(input.len())?;
        let mine = ranges[self.rank].clone();
        (0..self.shared.world).for_each(|r| visit(r, &session.peer_f32s(r)[mine.clone()]));
        drop(session);
        self.stats.record(gather_slices_traffic(ranges, self.rank, 4));
        Ok(())
    }

    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CollectiveError> {
        let world = self.shared.world;
        if world == 1 {
            self.check_alive(Op::Broadcast)?;
            self.check_rank("broadcast", "root", root)?;
            self.stats.record(Traffic::default());
            return Ok(());
        }
        let mut post = Post::new(Op::Broadcast);
        (post.f32s, post.root) = (Raw::of(buf), root);
        let session = self.open(post)?;
        session.check_same_op()?;
        session.check_same("root", |p| p.root)?;
        session.check_same("a buffer of length", |p| p.f32s.len)?;
        self.check_rank("broadcast", "root", root)?;
        if self.rank != root {
            buf.copy_from_slice(session.peer_f32s(root));
        }
        drop(session);
        self.stats.record(chain_broadcast_traffic(buf.len(), world, root, self.rank, 4));
        Ok(())
    }

    fn all_to_all(&mut self, send: &[&[f32]]) -> Result<Vec<Vec<f32>>, CollectiveError> {
        let (world, rank) = (self.shared.world, self.rank);
        let lists: Vec<Raw<f32>> = send.iter().map(|s| Raw::of(s)).collect(); // outlives the session
        let mut post = Post::new(Op::AllToAll);
        post.lists = Raw::of(&lists);
        let session = self.open(post)?;
        session.check_same_op()?;
        if let Some(r) = session.posts.iter().position(|p| p.lists.len != world) {
            return Err(session.mismatch(format!("rank {r} passed {} send buffers for a world of {world}", session.posts[r].lists.len)));
        }
        // SAFETY: every rank's list and the slices it points to live until the closing round.
        let recv: Vec<Vec<f32>> = session.posts.iter().map(|p| unsafe { p.lists.get()[rank].get() }.to_vec()).collect();
        drop(session);
        let others = |v: &mut dyn Iterator<Item = usize>| v.enumerate().filter(|&(r, _)| r != rank).map(|(_, n)| n as u64 * 4).sum();
        let bytes_sent = others(&mut send.iter().map(|s| s.len()));
        let bytes_received = others(&mut recv.iter().map(Vec::len));
        self.stats.record(Traffic { bytes_sent, bytes_received });
        Ok(recv)
    }

    fn send(&mut self, to: usize, tag: u64, data: &[f32]) -> Result<(), CollectiveError> {
        self.check_rank("send", "destination", to)?;
        let mut st = self.shared.lock();
        if let Some(reason) = &st.aborted {
            return Err(CollectiveError::Aborted { op: "send", reason: reason.clone() });
        }
        if st.gone[to] {
            return Err(CollectiveError::PeerGone { op: "send", peer: to });
        }
        st.mail.entry((self.rank, to, tag)).or_default().push_back(data.to_vec());
        self.shared.cv.notify_all();
        drop(st);
        let bytes_sent = if to == self.rank { 0 } else { data.len() as u64 * 4 };
        self.stats.record(Traffic { bytes_sent, bytes_received: 0 });
        Ok(())
    }

    fn recv(&mut self, from: usize, tag: u64) -> Result<Vec<f32>, CollectiveError> {
        self.check_rank("recv", "source", from)?;
        let shared = &self.shared;
        let mut st = shared.lock();
        let start = Instant::now();
        let deadline = start + Duration::from_millis(self.timeout_ms);
        let data = loop {
            // After an abort nothing is delivered; a gone sender's buffered messages still are.
            let live = st.aborted.is_none();
            if let Some(data) = st.mail.get_mut(&(from, self.rank, tag)).filter(|_| live).and_then(VecDeque::pop_front) {
                break data;
            }
            let gone = st.gone[from].then_some(from);
            if let Some(err) = shared.why_give_up(&mut st, self.rank, "recv", gone, start, deadline) {
                return Err(err);
            }
            let wait = deadline.saturating_duration_since(Instant::now());
            st = shared.cv.wait_timeout(st, wait).unwrap_or_else(PoisonError::into_inner).0;
        };
        drop(st);
        let bytes_received = if from == self.rank { 0 } else { data.len() as u64 * 4 };
        self.stats.record(Traffic { bytes_sent: 0, bytes_received });
        Ok(data)
    }

    fn barrier(&mut self) -> Result<(), CollectiveError> {
        if self.shared.world == 1 {
            self.check_alive(Op::Barrier)?;
        } else {
            let session = self.open(Post::new(Op::Barrier))?;
            session.check_same_op()?;
        }
        self.stats.record(Traffic::default());
        Ok(())
    }
}

/// Every rank's output has the length `want(rank)`.
fn check_out_lens(session: &Session<'_>, want: impl Fn(usize) -> usize) -> Result<(), CollectiveError> {
    match (0..session.posts.len()).find(|&r| session.posts[r].out_len != want(r)) {
        Some(r) => Err(session.mismatch(format!("rank {r} passed an output of {} for {} elements", session.posts[r].out_len, want(r)))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::TreeSum;
    use tessera_kernels::tensor::{reduce_rows, Rng};

    /// Long enough never to fire in a passing test, short enough that a bug fails instead of hanging.
    const TEST_TIMEOUT_MS: u64 = 5_000;

    /// Runs `f` on every rank of a group, each on its own OS thread; results in rank order.
    fn run<T: Send>(comms: Vec<LocalComm>, f: impl Fn(&mut LocalComm) -> T + Sync) -> Vec<T> {
        std::thread::scope(|s| {
            let f = &f;
            let threads: Vec<_> = comms.into_iter().map(|mut c| s.spawn(move || f(&mut c))).collect();
            threads.into_iter().map(|t| t.join().expect("rank thread panicked")).collect()
        })
    }

    fn group(world: usize) -> Vec<LocalComm> {
        LocalGroup::with_timeout_ms(world, TEST_TIMEOUT_MS)
    }

    /// Values of mixed magnitudes, so that sums depend on their association.
    fn data(seed: u64, who: usize, len: usize) -> Vec<f32> {
        let mut rng = Rng::derive(seed, &[who as u64]);
        (0..len).map(|i| rng.normal() * [1e-3, 1.0, 3e4][i % 3]).collect()
    }

    /// Contiguous ranges of random sizes (some empty) covering `0..len`.
    fn uneven(len: usize, world: usize, seed: u64) -> Vec<Range<usize>> {
        let mut rng = Rng::derive(seed, &[len as u64, world as u64]);
        let mut cuts: Vec<usize> = (1..world).map(|_| rng.gen_range(len as u64 + 1) as usize).collect();
        cuts.sort_unstable();
        let bounds: Vec<usize> = std::iter::once(0).chain(cuts).chain(std::iter::once(len)).collect();
        bounds.windows(2).map(|w| w[0]..w[1]).collect()
    }

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }

    /// The rank-order sum `((x0 + x1) + x2) + …`.
    fn rank_order_sum(parts: &[Vec<f32>]) -> Vec<f32> {
        let mut acc = parts[0].clone();
        parts[1..].iter().for_each(|p| acc.iter_mut().zip(p).for_each(|(a, b)| *a += *b));
        acc
    }

    fn sleep_jitter(rng: &mut Rng) {
        std::thread::sleep(Duration::from_micros(rng.gen_range(300)));
    }

    /// Checks every collective of one rank against its serial reference.
    fn check_every_op(c: &mut LocalComm, seed: u64, len: usize) {
        let (world, rank) = (c.world(), c.rank());
        let all: Vec<Vec<f32>> = (0..world).map(|r| data(seed, r, len)).collect();
        let ranges = uneven(len, world, seed);
        let sum = rank_order_sum(&all);
        let mut buf = all[rank].clone();
        c.all_reduce_sum(&mut buf).unwrap();
        assert_eq!(bits(&buf), bits(&sum), "all_reduce world {world} len {len}");
        let mut buf64: Vec<f64> = all[rank].iter().map(|&v| v as f64).collect();
        c.all_reduce_sum_f64(&mut buf64).unwrap();
        let want64: Vec<f64> = (0..len).map(|i| all[1..].iter().fold(all[0][i] as f64, |a, p| a + p[i] as f64)).collect();
        assert_eq!(buf64, want64, "all_reduce_f64 world {world}");
        let mut out = vec![f32::NAN; ranges[rank].len()];
        c.reduce_scatter_sum(&all[rank], &ranges, &mut out).unwrap();
        assert_eq!(bits(&out), bits(&sum[ranges[rank].clone()]), "reduce_scatter world {world} ranges {ranges:?}");
        let mut full = vec![f32::NAN; len];
        c.all_gather(&all[rank][ranges[rank].clone()], &ranges, &mut full).unwrap();
        let want: Vec<f32> = ranges.iter().enumerate().flat_map(|(r, range)| all[r][range.clone()].to_vec()).collect();
        assert_eq!(bits(&full), bits(&want), "all_gather world {world}");
        let mut slices = vec![vec![7.0; 3]; world];
        c.gather_slices(&all[rank], &ranges, &mut slices).unwrap();
        (0..world).for_each(|r| assert_eq!(bits(&slices[r]), bits(&all[r][ranges[rank].clone()]), "gather_slices from {r}"));
        for root in 0..world {
            let mut b = all[rank].clone();
            c.broadcast(&mut b, root).unwrap();
            assert_eq!(bits(&b), bits(&all[root]), "broadcast root {root}");
        }
        let msg = |from: usize, to: usize| data(seed + 1, from * world + to, (from + 2 * to + len) % 5);
        let send: Vec<Vec<f32>> = (0..world).map(|to| msg(rank, to)).collect();
        let recv = c.all_to_all(&send.iter().map(Vec::as_slice).collect::<Vec<_>>()).unwrap();
        (0..world).for_each(|from| assert_eq!(bits(&recv[from]), bits(&msg(from, rank)), "all_to_all from {from}"));
        c.barrier().unwrap();
    }

    #[test]
    fn every_op_matches_its_serial_reference() {
        for world in 1..=5 {
            for len in [0, 1, 7, 40] {
                run(group(world), |c| check_every_op(c, 10 * world as u64 + len as u64, len));
            }
        }
    }

    #[test]
    fn point_to_point_matches_tags_in_order() {
        for world in 1..=5 {
            run(group(world), |c| {
                let (world, rank) = (c.world(), c.rank());
                let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
                // Tag 2 goes first, two messages under tag 1 keep their order.
                c.send(next, 2, &[rank as f32, 2.0]).unwrap();
                c.send(next, 1, &[rank as f32]).unwrap();
                c.send(next, 1, &[rank as f32, 1.0, 1.0]).unwrap();
                assert_eq!(c.recv(prev, 1).unwrap(), vec![prev as f32]);
                assert_eq!(c.recv(prev, 1).unwrap(), vec![prev as f32, 1.0, 1.0]);
                assert_eq!(c.recv(prev, 2).unwrap(), vec![prev as f32, 2.0]);
                assert!(matches!(c.send(world, 0, &[]), Err(CollectiveError::InvalidArgument { .. })));
                assert!(matches!(c.recv(world + 3, 0), Err(CollectiveError::InvalidArgument { .. })));
            });
        }
    }

    #[test]
    fn sums_are_bit_exact_under_any_interleaving() {
        let (len, world) = (50, 4);
        let ranges = uneven(len, world, 3);
        // Different jitter seeds give different arrival orders.
        let once = |jitter_seed: u64| {
            run(group(world), |c| {
                let rank = c.rank();
                let mut rng = Rng::derive(jitter_seed, &[rank as u64]);
                let mut out = Vec::new();
                for step in 0..5 {
                    let input = data(99, rank * 10 + step, len);
                    let mut buf = input.clone();
                    sleep_jitter(&mut rng);
                    c.all_reduce_sum(&mut buf).unwrap();
                    let mut part = vec![0.0; ranges[rank].len()];
                    sleep_jitter(&mut rng);
                    c.reduce_scatter_sum(&input, &ranges, &mut part).unwrap();
                    out.push((bits(&buf), bits(&part)));
                }
                out
            })
        };
        let first = once(1);
        assert_eq!(first, once(2));
        assert_eq!(first, once(3));
        let step0: Vec<Vec<f32>> = (0..world).map(|r| data(99, r * 10, len)).collect();
        let want = rank_order_sum(&step0);
        for (rank, steps) in first.iter().enumerate() {
            assert_eq!(steps[0].0, bits(&want));
            assert_eq!(steps[0].1, bits(&want[ranges[rank].clone()]));
        }
    }

    /// Leaf (micro-batch) gradients of values whose sums depend on the association.
    fn leaf(i: usize, len: usize) -> Vec<f32> {
        data(7, 1000 + i, len)
    }

    /// Rank `r` of `world` sums its aligned dyadic block of `m` leaves, owners combine the
    /// blocks with `TreeSum` in rank order, and the shards are gathered: the full gradient.
    fn tree_reduce_over(world: usize, m: usize, len: usize) -> Vec<f32> {
        let ranges = uneven(len, world, 5);
        let per = m / world;
        let level = per.trailing_zeros();
        let results = run(group(world), |c| {
            let rank = c.rank();
            let mut block = TreeSum::new();
            (0..per).for_each(|i| block.push_leaf(leaf(rank * per + i, len)).unwrap());
            let block = block.finish().unwrap();
            let mut tree = TreeSum::new();
            c.gather_slices_with(&block, &ranges, &mut |r, s| tree.push_block(r * per, level, s.to_vec()).unwrap()).unwrap();
            let shard = tree.finish().unwrap();
            let mut full = vec![0.0; len];
            c.all_gather(&shard, &ranges, &mut full).unwrap();
            // The plain all-reduce of the blocks associates them by rank order instead.
            let mut plain = block.clone();
            c.all_reduce_sum(&mut plain).unwrap();
            (full, plain)
        });
        assert!(results.iter().all(|r| bits(&r.0) == bits(&results[0].0)), "ranks disagree");
        if world == 4 {
            assert_ne!(bits(&results[0].1), bits(&results[0].0), "test data should be association-sensitive");
        }
        results[0].0.clone()
    }

    #[test]
    fn gather_slices_with_tree_sum_is_independent_of_world_size() {
        let (m, len) = (8, 37);
        let mut serial = TreeSum::new();
        (0..m).for_each(|i| serial.push_leaf(leaf(i, len)).unwrap());
        let want = bits(&serial.finish().unwrap());
        for world in [1, 2, 4] {
            assert_eq!(bits(&tree_reduce_over(world, m, len)), want, "world {world}");
        }
    }

    #[test]
    fn a_missing_rank_times_out_and_aborts_the_group() {
        let results = run(LocalGroup::with_timeout_ms(3, 40), |c| {
            if c.rank() == 2 {
                std::thread::sleep(Duration::from_millis(300));
                return c.barrier();
            }
            c.all_reduce_sum(&mut [1.0, 2.0])
        });
        let timeouts = results[..2]
            .iter()
            .filter(|r| matches!(r, Err(CollectiveError::Timeout { op: "all_reduce_sum", waited_ms, .. }) if *waited_ms >= 40));
        assert!(timeouts.count() >= 1, "{results:?}");
        assert!(results[..2].iter().all(|r| matches!(r, Err(CollectiveError::Timeout { .. } | CollectiveError::Aborted { .. }))));
        match &results[2] {
            Err(CollectiveError::Aborted { op: "barrier", reason }) => assert!(reason.contains("timed out in all_reduce_sum"), "{reason}"),
            other => panic!("late rank got {other:?}"),
        }
    }

    #[test]
    fn recv_times_out() {
        let mut comms = LocalGroup::with_timeout_ms(2, 20);
        let err = comms[0].recv(1, 5).unwrap_err();
        assert!(matches!(err, CollectiveError::Timeout { op: "recv", rank: 0, .. }), "{err}");
        assert!(matches!(comms[1].barrier(), Err(CollectiveError::Aborted { .. })));
    }

    #[test]
    fn abort_wakes_every_waiter() {
        // A group timeout far above the 20 ms the abort takes: a waiter the abort did not wake
        // would only give up (also with `Aborted`) once that timeout ran out.
        let comms = LocalGroup::with_timeout_ms(4, 60_000);
        let abort = comms[0].abort_handle();
        let start = Instant::now();
        let results = std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(20));
                abort.abort("rank 3 died");
            });
            run(comms, |c| match c.rank() {
                3 => c.recv(0, 1).map(|_| ()),
                _ => c.all_reduce_sum(&mut [1.0; 10]),
            })
        });
        assert!(start.elapsed() < Duration::from_millis(60_000), "the waiters were not woken: they waited for the group timeout");
        for r in results {
            match r {
                Err(CollectiveError::Aborted { reason, .. }) => assert_eq!(reason, "rank 3 died"),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn a_dropped_peer_is_reported_and_its_messages_still_arrive() {
        let mut comms = group(2);
        let gone = comms.pop().unwrap();
        let mut c0 = comms.pop().unwrap();
        run(vec![gone], |c| c.send(0, 3, &[4.0]).unwrap());
        assert_eq!(c0.recv(1, 3).unwrap(), vec![4.0]);
        assert_eq!(c0.recv(1, 3), Err(CollectiveError::PeerGone { op: "recv", peer: 1 }));
        assert_eq!(c0.barrier(), Err(CollectiveError::PeerGone { op: "barrier", peer: 1 }));
        assert_eq!(c0.send(1, 0, &[]), Err(CollectiveError::PeerGone { op: "send", peer: 1 }));
    }

    fn is_mismatch(r: &Result<(), CollectiveError>) -> bool {
        matches!(r, Err(CollectiveError::Mismatch { .. }))
    }

    #[test]
    fn disagreements_are_errors_on_every_rank_and_the_group_goes_on() {
        let results = run(group(3), |c| {
            let rank = c.rank();
            let mut got = Vec::new();
            got.push(c.all_reduce_sum(&mut vec![1.0; 4 + usize::from(rank == 1)]));
            got.push(match rank {
                0 => c.barrier(),
                1 => c.all_reduce_sum(&mut [1.0]),
                _ => c.broadcast(&mut [1.0], 0),
            });
            let ranges = if rank == 2 { vec![0..1, 1..2, 2..4] } else { vec![0..2, 2..3, 3..4] };
            got.push(c.reduce_scatter_sum(&[1.0; 4], &ranges, &mut [0.0; 1]));
            let same = [0..2, 2..3, 3..4];
            got.push(c.reduce_scatter_sum(&[1.0; 4], &same, &mut vec![0.0; 1 + usize::from(rank == 1)]));
            got.push(c.all_gather(&[1.0; 1], &same, &mut [0.0; 4]));
            got.push(c.all_to_all(&vec![&[1.0f32][..]; 3 + usize::from(rank == 0)]).map(|_| ()));
            got.push(c.broadcast(&mut [1.0], rank % 2));
            // Agreed but invalid arguments are reported alike everywhere.
            got.push(c.gather_slices_with(&[1.0; 4], &[0..2, 2..3, 3..5], &mut |_, _| {}));
            got.push(c.broadcast(&mut [1.0], 3));
            // The group still works.
            let mut buf = [rank as f32];
            c.all_reduce_sum(&mut buf).unwrap();
            (got, buf[0])
        });
        for (rank, (got, sum)) in results.iter().enumerate() {
            assert!(got[..7].iter().all(is_mismatch), "rank {rank}: {got:?}");
            assert!(got[7..].iter().all(|r| matches!(r, Err(CollectiveError::InvalidArgument { .. }))), "rank {rank}: {got:?}");
            assert_eq!(*sum, 3.0);
        }
        let detail = results[0].0[1].as_ref().unwrap_err().to_string();
        assert!(detail.contains("rank 1 called all_reduce_sum but rank 0 called barrier"), "{detail}");
    }

    #[test]
    fn a_wrong_output_count_in_gather_slices_fails_only_locally() {
        let results = run(group(2), |c| {
            let mut out = vec![Vec::new(); 2 + c.rank()];
            c.gather_slices(&[1.0, 2.0], &[0..1, 1..2], &mut out)
        });
        assert_eq!(results[0], Ok(()));
        assert!(matches!(&results[1], Err(CollectiveError::InvalidArgument { op: "gather_slices", .. })));
    }

    #[test]
    fn counters_follow_the_ring_accounting() {
        let stats = run(group(4), |c| {
            let rank = c.rank();
            let even = even_ranges(400, 4);
            c.all_reduce_sum(&mut [0.0; 400]).unwrap(); // 2 × 3/4 × 1600 bytes each way
            c.all_reduce_sum_f64(&mut [0.0; 400]).unwrap(); // 2 × 3/4 × 3200
            c.reduce_scatter_sum(&[0.0; 400], &even, &mut [0.0; 100]).unwrap(); // 3/4 × 1600
            c.all_gather(&[0.0; 100], &even, &mut [0.0; 400]).unwrap(); // 3/4 × 1600
            c.gather_slices_with(&[0.0; 400], &even, &mut |_, _| {}).unwrap(); // 300 out, 3 × 100 in
            c.broadcast(&mut [0.0; 10], 1).unwrap(); // chain 1 → 2 → 3 → 0
            c.all_to_all(&[&[0.0; 1][..], &[0.0; 2], &[0.0; 3], &[0.0; 4]]).unwrap(); // 10 − own out
            c.send((rank + 1) % 4, 0, &[0.0; 5]).unwrap();
            c.recv((rank + 3) % 4, 0).unwrap();
            c.send(rank, 0, &[0.0; 5]).unwrap(); // to self: no bytes
            c.recv(rank, 0).unwrap();
            c.barrier().unwrap();
            c.stats()
        });
        for (rank, s) in stats.iter().enumerate() {
            let ring = 2400 + 4800 + 1200 + 1200 + 1200;
            let bcast_sent = if rank == 0 { 0 } else { 40 };
            let bcast_recv = if rank == 1 { 0 } else { 40 };
            let a2a_sent = 4 * (10 - (rank + 1)) as u64;
            let a2a_recv = 4 * 3 * (rank + 1) as u64;
            assert_eq!(s.bytes_sent, ring + bcast_sent + a2a_sent + 20, "rank {rank}");
            assert_eq!(s.bytes_received, ring + bcast_recv + a2a_recv + 20, "rank {rank}");
            assert_eq!(s.ops, 12);
        }
    }

    #[test]
    fn counters_for_uneven_ranges_match_the_accounting_functions() {
        let ranges = [0..3, 3..3, 3..10];
        let stats = run(group(3), |c| {
            let r = ranges[c.rank()].clone();
            c.reduce_scatter_sum(&[1.0; 10], &ranges, &mut vec![0.0; r.len()]).unwrap();
            c.all_gather(&vec![0.0; r.len()], &ranges, &mut [0.0; 10]).unwrap();
            c.stats()
        });
        for (rank, s) in stats.iter().enumerate() {
            let (a, b) = (ring_reduce_scatter_traffic(&ranges, rank, 4), ring_all_gather_traffic(&ranges, rank, 4));
            assert_eq!((s.bytes_sent, s.bytes_received), (a.bytes_sent + b.bytes_sent, a.bytes_received + b.bytes_received));
        }
        // Rank 1 owns nothing: it sends all 10 elements in the reduce-scatter ring.
        assert_eq!(ring_reduce_scatter_traffic(&ranges, 1, 4).bytes_sent, 40);
    }

    #[test]
    fn world_one_is_a_local_no_op() {
        let mut c = LocalGroup::new(1).pop().unwrap();
        let mut buf = [1.5, -2.0];
        c.all_reduce_sum(&mut buf).unwrap();
        c.broadcast(&mut buf, 0).unwrap();
        c.barrier().unwrap();
        assert_eq!(buf, [1.5, -2.0]);
        assert!(matches!(c.broadcast(&mut buf, 1), Err(CollectiveError::InvalidArgument { .. })));
        assert_eq!(c.stats(), CommStats { bytes_sent: 0, bytes_received: 0, ops: 3 });
        c.abort_handle().abort("stop");
        assert_eq!(c.barrier(), Err(CollectiveError::Aborted { op: "barrier", reason: "stop".into() }));
        assert!(LocalGroup::new(0).is_empty());
    }

    #[test]
    fn ranks_that_use_rayon_inside_work() {
        let len = 64;
        let rows = 200;
        let row =
            |rank: usize, r: usize, p: &mut [f32]| p.iter_mut().enumerate().for_each(|(j, v)| *v += ((rank * 7 + r * 3 + j) % 11) as f32);
        let results = run(group(4), |c| {
            let rank = c.rank();
            let mut out = Vec::new();
            for _ in 0..3 {
                let mut buf = vec![0.0; len];
                reduce_rows(&mut buf, rows, |r, p| row(rank, r, p));
                c.all_reduce_sum(&mut buf).unwrap();
                out.push(buf);
            }
            out
        });
        let parts: Vec<Vec<f32>> = (0..4)
            .map(|rank| {
                let mut b = vec![0.0; len];
                reduce_rows(&mut b, rows, |r, p| row(rank, r, p));
                b
            })
            .collect();
        let want = rank_order_sum(&parts);
        assert!(results.iter().flatten().all(|b| bits(b) == bits(&want)));
    }

    #[test]
    fn a_panic_inside_a_collective_does_not_deadlock_the_group() {
        let results = run(group(3), |c| {
            let input = vec![c.rank() as f32; 6];
            let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                c.gather_slices_with(&input, &[0..2, 2..4, 4..6], &mut |r, _| assert_ne!(r, 1, "the visitor fails on rank 1's slice"))
            }));
            let mut buf = [1.0];
            (panicked.is_err(), c.all_reduce_sum(&mut buf).map(|_| buf[0]))
        });
        // Every rank's visitor sees rank 1's slice and panics; the group still works afterwards.
        assert!(results.iter().all(|(p, r)| *p && *r == Ok(3.0)), "{results:?}");
    }
}
