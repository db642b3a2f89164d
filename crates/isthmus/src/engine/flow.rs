//! Per-stream flow control: a slow reader holds back the writer of its stream, and only that
//! one.
//!
//! Each side of each stream may have at most [`INITIAL_WINDOW`] bytes of messages that the
//! other side's application has not taken yet ([`SMALL_INITIAL_WINDOW`] on a connection whose
//! handshake agreed to it: a server's loopback, ADR 0037). A message costs its length plus
//! [`MESSAGE_OVERHEAD`], so even empty messages use up the window. A writer may send while its
//! credit is above zero, so one message of any size always goes (the window never makes a message
//! too big to send) and the credit may end below zero. The reader gives credit back with WINDOW
//! frames once its application has taken half a window's worth, so an even stream of messages
//! flows without stopping and a unary call sends no WINDOW (a server never grants for a request
//! that came with its half-close; a client, under the small window, grants for a reply over
//! 32 KiB that came before its TRAILERS).
//!
//! Memory held for one stalled stream is therefore at most a window plus one message, however
//! many the writer tries to send; the transport's rings and arenas stay free for the others.
//!
//! The writer (any `send`, `send_last`, `send_block`, on either side) takes credit before each
//! MESSAGE; at zero or below it waits, an async call on the window's `Notify`, a blocking one in
//! `Mux::wait`, so the thread that waits for credit is also the one that reads the WINDOW bringing
//! it. A stream has one writer (the call's methods take `&mut self`) and the reader only adds, so
//! taking needs no lock. When the stream ends its window closes and a waiting writer wakes for
//! good.
//!
//! Giving credit back is one mechanism for every kind of call (both clients, `ServerCall`, the
//! bridge's request body): the call's `Stream` counts what the application took (`took`), counting
//! when a message is taken off the queue, not when it arrives, so an application that stops reading
//! stops the grants and with them its peer's writer. Once the count reaches half a window it is all
//! granted in one WINDOW. A WINDOW never waits for ring room (the sender may be inside a poll or on
//! an event loop): without room it waits behind the reader's other answers for a flusher that
//! sends them as room comes (`Mux::reply`), so it goes out as soon as the peer reads, whatever
//! this call does meanwhile, however many other answers wait (the peer's window bounds an open
//! stream's grants; `Mux::reply` keeps four per open stream past its limit). Only if it cannot
//! be queued (a poisoned lock, or a peer that filled the queue with ended streams' grants) is
//! the grant taken back (`Consumed::undo`); it stays owed, and goes with the next `took` or with
//! `settle`, which every call runs before it waits for a message. Who settles: the async
//! `ClientCall` at each poll, the blocking call before it waits, the server's
//! `Requests::poll_recv` (behind `ServerCall::recv` and the bridge's request body), and a
//! `ServerCall` before each send while it holds its request side.
//!
//! The receiving side charges every arriving MESSAGE to its own count
//! (`RecvWindow::charge_arrival`); one that arrives at zero or below ends that call alone with
//! INTERNAL ("the peer sent on stream N past its flow-control window (W bytes)") and a CANCEL
//! to the peer. Credit adds with saturation, so a peer that grants too much only lets us send more
//! to it.
//!
//! There is no window per connection: the ring and the arena already bound each direction as a
//! whole. A large received message is a view into the sender's arena, so streams stalled while
//! holding such messages keep that arena's memory, and enough of them (about 64 MiB with the
//! default arena) make every send that needs a block wait; copying out of the arena when a message
//! waits in a queue would remove this at the price of a copy (ADR 0006). A message larger than the
//! window leaves the credit below zero, so for such messages one is in flight per stream.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};

use tokio::sync::Notify;

/// Bytes a side may send on one stream before the reader gives credit back.
pub const INITIAL_WINDOW: u64 = 4 << 20;

/// The window instead of [`INITIAL_WINDOW`] on a connection whose handshake granted
/// `features::SMALL_WINDOW` (protocol 13.8): a server's loopback, which every HTTP/2 client
/// shares, so that a stream nobody reads holds little of it (ADR 0037). As grpc-go's write
/// quota: a stream holds this and one message.
pub const SMALL_INITIAL_WINDOW: u64 = 64 << 10;

/// What each message costs beyond its length: the bookkeeping a queued message takes, so a flood
/// of empty messages is bounded too.
pub const MESSAGE_OVERHEAD: u64 = 64;

/// The credit a message of `len` bytes takes.
pub(crate) fn charge(len: usize) -> i64 {
    (len as u64).saturating_add(MESSAGE_OVERHEAD).min(i64::MAX as u64 / 4) as i64
}

/// The writer's credit on one stream. The stream's one writer takes it; the connection's reader
/// adds to it when a WINDOW frame comes.
#[derive(Debug)]
pub(crate) struct SendWindow {
    credit: AtomicI64,
    /// The stream has ended: no credit will come, waiting writers must stop.
    closed: AtomicBool,
    changed: Notify,
    /// Writers in [`take`](Self::take): only then do a grant and the close wake anyone, and
    /// most streams never wait (a `Notify` takes a lock even with nobody to wake).
    waiting: AtomicUsize,
}

/// One waiter counted in [`SendWindow::waiting`] while it lives.
struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    fn new(count: &'a AtomicUsize) -> Waiting<'a> {
        count.fetch_add(1, Ordering::SeqCst);
        Waiting(count)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// What a writer may do now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Credit {
    /// Send: the credit was taken.
    Taken,
    /// Wait for a WINDOW frame.
    Wait,
    /// The stream is over; nothing more will be sent on it.
    Closed,
}

impl SendWindow {
    /// A stream's credit as it opens: its connection's window.
    pub(crate) fn new(window: u64) -> SendWindow {
        SendWindow {
            credit: AtomicI64::new(window as i64),
            closed: AtomicBool::new(false),
            changed: Notify::new(),
            waiting: AtomicUsize::new(0),
        }
    }

    /// Takes credit for a message costing `charge`, if the window is open.
    pub(crate) fn try_take(&self, charge: i64) -> Credit {
        // SeqCst: a waiting writer's half of the handshake with `grant` and `close` (`take`).
        if self.closed.load(Ordering::SeqCst) {
            return Credit::Closed;
        }
        // Taken only while some is left, in one step: two writers of one stream (clones of a
        // `CallSender`, a C caller's threads) that both saw credit had both taken it, and the
        // peer saw one of them send past its window. The reader only ever adds.
        let taken = self.credit.fetch_update(Ordering::AcqRel, Ordering::SeqCst, |c| (c > 0).then(|| c - charge));
        if taken.is_ok() {
            Credit::Taken
        } else {
            Credit::Wait
        }
    }

    /// Whether the writer has used up its credit on a stream still open: it waits, or will at
    /// its next message, for a WINDOW.
    pub(crate) fn starved(&self) -> bool {
        !self.closed.load(Ordering::Acquire) && self.credit.load(Ordering::Acquire) <= 0
    }

    /// Whether the stream is over: nothing more will be sent on it.
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Whether a writer waiting for credit should look again.
    pub(crate) fn ready(&self) -> bool {
        self.closed.load(Ordering::Acquire) || self.credit.load(Ordering::Acquire) > 0
    }

    /// Waits (async) until credit for `charge` is taken or the stream is over.
    pub(crate) async fn take(&self, charge: i64) -> Credit {
        match self.try_take(charge) {
            Credit::Wait => self.wait_for(|| Some(self.try_take(charge)).filter(|c| *c != Credit::Wait)).await,
            done => done,
        }
    }

    /// Resolves once the stream is over: nothing more will be sent on it. For a writer that
    /// waits for something else meanwhile (the next request of an application's stream).
    pub(crate) async fn closed(&self) {
        self.wait_for(|| self.closed.load(Ordering::SeqCst).then_some(())).await;
    }

    /// Waits until `look` finds what it looks for, looking again at each grant and at the
    /// close. Counted in `waiting` before the first look, and `grant`/`close` change the window
    /// before they look at the count (all SeqCst): one of the two sees the other, so either a
    /// look finds the change or the change wakes the wait.
    async fn wait_for<T>(&self, mut look: impl FnMut() -> Option<T>) -> T {
        let _waiting = Waiting::new(&self.waiting);
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if let Some(found) = look() {
                return found;
            }
            changed.await;
        }
    }

    /// Wakes the writers waiting in [`take`](Self::take), if any.
    fn wake(&self) {
        if self.waiting.load(Ordering::SeqCst) > 0 {
            self.changed.notify_waiters();
        }
    }

    /// The reader gives `n` bytes of credit back (a WINDOW frame).
    pub(crate) fn grant(&self, n: u64) {
        // Increments are at most 2^40 each and an honest reader never grants more than it was
        // charged, so this cannot overflow; a hostile one that tries only hurts its own stream.
        let n = n.min(i64::MAX as u64 / 4) as i64;
        let _ = self.credit.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |c| Some(c.saturating_add(n)));
        self.wake();
    }

    /// The stream ended: wake any waiting writer for good.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.wake();
    }
}

/// The reader's side of one stream: how much the peer may still send, shared between the
/// connection's reader (which charges arriving messages) and the call (which gives credit back
/// as its application takes messages).
#[derive(Debug)]
pub(crate) struct RecvWindow {
    remaining: AtomicI64,
    /// The connection's window: where `remaining` starts, and twice what is granted at once.
    window: u64,
}

impl RecvWindow {
    /// What the peer may send on a stream as it opens: its connection's window.
    pub(crate) fn new(window: u64) -> RecvWindow {
        RecvWindow { remaining: AtomicI64::new(window as i64), window }
    }

    /// Charges an arriving message; `false` if the peer had no credit left to send it.
    pub(crate) fn charge_arrival(&self, len: usize) -> bool {
        self.remaining.fetch_sub(charge(len), Ordering::AcqRel) > 0
    }

    /// [`charge_arrival`](Self::charge_arrival) on a window nothing else can see yet.
    pub(crate) fn charge_fresh(&mut self, len: usize) {
        *self.remaining.get_mut() -= charge(len);
    }
}

/// What the application of one call has taken and not yet given back as credit.
#[derive(Debug, Default)]
pub(crate) struct Consumed(u64);

impl Consumed {
    /// Counts a message the application took; returns the credit to grant now in a WINDOW frame
    /// (and already added to `window`), once half a window has been taken.
    pub(crate) fn take(&mut self, len: usize, window: &RecvWindow) -> Option<u64> {
        self.0 += charge(len) as u64;
        self.due(window)
    }

    /// The grant due now (half a window taken, or a grant that failed to send before), if any;
    /// already added to `window`.
    pub(crate) fn due(&mut self, window: &RecvWindow) -> Option<u64> {
        if self.0 < window.window / 2 {
            return None;
        }
        let grant = std::mem::take(&mut self.0);
        window.remaining.fetch_add(grant as i64, Ordering::AcqRel);
        Some(grant)
    }

    /// A grant from [`take`](Self::take) could not be sent: count it as taken-not-granted again,
    /// so the next message taken retries it.
    pub(crate) fn undo(&mut self, grant: u64, window: &RecvWindow) {
        window.remaining.fetch_sub(grant as i64, Ordering::AcqRel);
        self.0 += grant;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_for_the_streams_end_outlasts_grants_and_ends_with_it() {
        use std::future::Future;
        let w = SendWindow::new(INITIAL_WINDOW);
        let mut closed = std::pin::pin!(w.closed());
        let mut poll = || closed.as_mut().poll(&mut std::task::Context::from_waker(std::task::Waker::noop()));
        assert!(poll().is_pending());
        w.grant(100);
        assert!(poll().is_pending(), "a grant is no end");
        w.close();
        assert!(poll().is_ready());
        assert_eq!(w.waiting.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn one_message_of_any_size_goes_then_the_writer_waits() {
        let w = SendWindow::new(INITIAL_WINDOW);
        assert_eq!(w.try_take(charge(1 << 30)), Credit::Taken);
        assert_eq!(w.try_take(charge(1)), Credit::Wait);
        assert!(!w.ready());
        w.grant(charge(1 << 30) as u64);
        assert!(w.ready());
        assert_eq!(w.try_take(charge(1)), Credit::Taken);
        w.close();
        assert_eq!(w.try_take(charge(1)), Credit::Closed);
    }

    #[test]
    fn the_reader_catches_a_writer_that_ignores_its_window() {
        let r = RecvWindow::new(INITIAL_WINDOW);
        let big = INITIAL_WINDOW as usize;
        assert!(r.charge_arrival(big)); // the one message over the window a writer may send
        assert!(!r.charge_arrival(0), "a second message with no credit left is a violation");
    }

    #[test]
    fn credit_comes_back_in_half_windows() {
        let r = RecvWindow::new(INITIAL_WINDOW);
        let mut consumed = Consumed::default();
        let small = 1000;
        let mut granted = 0u64;
        let mut taken = 0u64;
        for _ in 0..10_000 {
            assert!(r.charge_arrival(small));
            taken += charge(small) as u64;
            if let Some(g) = consumed.take(small, &r) {
                assert!(g >= INITIAL_WINDOW / 2);
                granted += g;
            }
        }
        assert!(taken - granted < INITIAL_WINDOW / 2);
    }

    #[test]
    fn a_small_window_holds_its_writer_and_grants_in_its_own_halves() {
        let (w, r) = (SendWindow::new(SMALL_INITIAL_WINDOW), RecvWindow::new(SMALL_INITIAL_WINDOW));
        let mut consumed = Consumed::default();
        let len = 1000;
        let mut sent = 0;
        while w.try_take(charge(len)) == Credit::Taken {
            assert!(r.charge_arrival(len), "message {sent} was within the window");
            sent += 1;
        }
        assert_eq!(sent, SMALL_INITIAL_WINDOW.div_ceil(charge(len) as u64), "a writer sends its window and stops");
        assert!(!r.charge_arrival(len), "the reader's count agrees the window is used up");
        let grants: Vec<u64> = (0..sent).filter_map(|_| consumed.take(len, &r)).collect();
        assert_eq!(grants.len(), 2, "one WINDOW per half of the small window: {grants:?}");
        assert!(grants.iter().all(|&g| (SMALL_INITIAL_WINDOW / 2..SMALL_INITIAL_WINDOW).contains(&g)), "{grants:?}");
    }
}
