//! Lending a caller's tensor to quinn for one step of a collective instead of copying it.
//!
//! quinn keeps every chunk written to a stream until the peer acknowledges it, and may read it
//! again to retransmit it; after a failure it keeps the chunks until the stream is reset or the
//! connection dropped. A chunk that views the caller's tensor may therefore reach quinn only if
//! the collective cannot return while quinn still holds it. [`lending`] gives that guarantee:
//!
//! - Pieces are lent only through a [`LentStream`], which owns the stream they are written to
//!   and exists only inside the `lending` call (it borrows the [`Lender`]).
//! - Every lent piece counts itself alive until quinn (or whoever holds it) drops it.
//! - On success the writer waits until the peer has acknowledged every lent piece of its stream
//!   ([`LentStream::returned`]); quinn drops a piece as its acknowledgement arrives.
//! - A `LentStream` dropped with pieces still out (a failure, a cancelled lane, a timeout, a
//!   panic unwinding) resets its stream, and quinn discards what it held of it at once.
//! - When the `lending` call ends, by return or by unwinding, no lent piece may be alive; one
//!   that is (which would be a bug here or a change in quinn) aborts the process, since
//!   returning would let quinn read memory the caller may already have freed.
//!
//! The lender is invariant in the data's lifetime `'d`, a parameter of [`lending`]: lent data
//! outlives the whole call, and cannot be swapped for a shorter borrow inside it.

use super::frame::Lend;
use bytes::Bytes;
use quinn::{SendStream, VarInt};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Stream reset code of a stream abandoned with lent pieces still out.
pub const RESET_ABANDONED: u32 = 7;

/// Streams reset because they were abandoned with lent pieces still out (since the process
/// started): the failure path the tests check was taken.
static ABANDONED: AtomicUsize = AtomicUsize::new(0);

/// How many streams were reset because they were abandoned with lent pieces still out.
#[cfg(test)]
pub fn abandoned_streams() -> usize {
    ABANDONED.load(Ordering::Relaxed)
}

/// Lent pieces alive, and a wake-up for the one who waits until none is.
#[derive(Default)]
struct Count {
    live: AtomicUsize,
    none: tokio::sync::Notify,
}

impl Count {
    fn lent(&self) {
        self.live.fetch_add(1, Ordering::Relaxed);
    }

    fn returned(&self) {
        // Release: quinn's last read of the piece happens before a waiter sees the count drop.
        if self.live.fetch_sub(1, Ordering::AcqRel) == 1 {
            // A stored permit, should nobody wait yet: the waiter's next `notified` completes.
            self.none.notify_one();
        }
    }

    fn alive(&self) -> usize {
        self.live.load(Ordering::Acquire)
    }
}

/// A lent piece: the owner behind a `Bytes` that views the caller's data.
struct Lent {
    ptr: *const u8,
    len: usize,
    stream: Arc<Count>,
    scope: Arc<Count>,
}

// SAFETY: a `Lent` is a shared view of bytes that `lending`'s caller keeps borrowed (so alive and
// unchanged) until no `Lent` is left (`lending` aborts the process rather than return before
// that). Reading them from any thread is what a `&[u8]`, which is `Send`, allows.
unsafe impl Send for Lent {}

impl AsRef<[u8]> for Lent {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `ptr` and `len` come from a `&'d [u8]` whose borrow outlives this piece (see the
        // `Send` impl above).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        self.stream.returned();
        self.scope.returned();
    }
}

/// What a [`lending`] call lends data of lifetime `'d` through.
pub struct Lender<'d> {
    scope: Arc<Count>,
    /// Invariant in `'d` (as `std::thread::Scope`), and `Send + Sync`.
    _data: PhantomData<&'d mut &'d ()>,
}

/// Runs `f` with a [`Lender`] for data that outlives this call, and returns only once no piece
/// lent through it is alive (see the module doc).
pub fn lending<'d, R>(f: impl for<'l> FnOnce(&'l Lender<'d>) -> R) -> R {
    /// Checks, when the call ends (returning or unwinding), that every lent piece is back.
    struct Settle(Arc<Count>);
    impl Drop for Settle {
        fn drop(&mut self) {
            let alive = self.0.alive();
            if alive != 0 {
                eprintln!("tessera-quic: {alive} lent tensor pieces still held by the transport when the step ended; aborting");
                std::process::abort();
            }
        }
    }
    let lender = Lender { scope: Arc::default(), _data: PhantomData };
    let _settle = Settle(lender.scope.clone());
    f(&lender)
}

impl<'d> Lender<'d> {
    /// Takes `stream` to write lent pieces to.
    pub fn stream(&self, stream: SendStream) -> LentStream<'_, 'd> {
        LentStream { stream, loan: Loan { lender: self, count: Arc::default() } }
    }
}

/// A stream that pieces of the lender's data are written to (see the module doc).
pub struct LentStream<'l, 'd> {
    pub stream: SendStream,
    pub loan: Loan<'l, 'd>,
}

/// Lends pieces for one [`LentStream`].
pub struct Loan<'l, 'd> {
    lender: &'l Lender<'d>,
    count: Arc<Count>,
}

impl<'d> Lend<'d> for Loan<'_, 'd> {
    /// `data` as a `Bytes` that quinn may hold, without a copy.
    fn lend(&self, data: &'d [u8]) -> Bytes {
        self.count.lent();
        self.lender.scope.lent();
        Bytes::from_owner(Lent { ptr: data.as_ptr(), len: data.len(), stream: self.count.clone(), scope: self.lender.scope.clone() })
    }
}

impl Loan<'_, '_> {
    /// Completes once no piece lent for this stream is alive.
    pub async fn returned(&self) {
        while self.count.alive() != 0 {
            self.count.none.notified().await;
        }
    }

    /// Pieces lent for this stream that are still alive.
    pub fn alive(&self) -> usize {
        self.count.alive()
    }
}

impl Drop for LentStream<'_, '_> {
    fn drop(&mut self) {
        if self.loan.alive() != 0 {
            // Discards everything quinn still holds of the stream (quinn-proto `Send::reset`).
            // An error means the stream is already reset or gone, and its pieces with it.
            let _ = self.stream.reset(VarInt::from_u32(RESET_ABANDONED));
            ABANDONED.fetch_add(1, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_piece_counts_itself_alive_until_every_view_of_it_is_dropped() {
        let data = [7u8; 64];
        lending(|lender| {
            let count = Arc::new(Count::default());
            let loan = Loan { lender, count: count.clone() };
            let a = loan.lend(&data[..32]);
            let b = a.slice(8..16);
            assert_eq!((&a[..], &b[..]), (&data[..32], &data[8..16]));
            assert_eq!((loan.alive(), lender.scope.alive()), (1, 1));
            drop(a);
            assert_eq!(loan.alive(), 1, "a slice keeps its piece alive");
            drop(b);
            assert_eq!((loan.alive(), lender.scope.alive()), (0, 0));
        });
    }

    #[test]
    fn waiting_for_the_pieces_ends_when_the_last_one_is_dropped_on_another_thread() {
        let data = vec![1u8; 1024];
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        lending(|lender| {
            let loan = Loan { lender, count: Arc::default() };
            let pieces: Vec<Bytes> = data.chunks(256).map(|c| loan.lend(c)).collect();
            assert_eq!(loan.alive(), 4);
            std::thread::scope(|s| {
                s.spawn(move || {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                    drop(pieces);
                });
                rt.block_on(loan.returned());
            });
            assert_eq!(loan.alive(), 0);
        });
    }
}
