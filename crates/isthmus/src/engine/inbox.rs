//! One stream's queue of [`Event`]s: filled by whoever reads the connection, emptied by the call.
//!
//! A queue under a mutex with one waker, since a stream has one consumer (its call). The queue
//! keeps its first event inline (`queue::Queue`), so a call that holds one event at a time, as most
//! do, allocates nothing for it, and opening a stream costs only the one allocation of its
//! [`StreamShared`](crate::engine::mux::StreamShared). `close` ends it: events after it are
//! dropped, and the call drains what is queued, then sees the end. `poll_recv` serves the async
//! client and the server's request side (so the bridge's bodies too); `try_recv` and `is_ready`
//! serve the blocking client, which waits in `Mux::wait` instead.
//!
//! `is_ready` takes no lock: the queue keeps a flag beside it, written under the lock whenever
//! an event or the end comes and whenever the call takes one, so a look at the flag is a look
//! at the queue as the last holder of the lock left it. A blocking call looks after every frame
//! its thread reads, and an async call a few times per poll: a lock each time was ~15 ns on every
//! call's way to its reply.
//!
//! There is no bound here: flow control bounds what a peer may queue on a stream (`flow`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;

use super::queue::Queue;
use crate::metadata::MetadataMap;
use crate::status::Status;

/// What a call hears from the other side.
#[derive(Debug)]
pub(crate) enum Event {
    /// The server's initial metadata (client side only).
    Headers(MetadataMap),
    /// One message.
    Message(Bytes),
    /// The other side's last message, and its half-close with it (a unary request): one event
    /// where two would fill a call's queue past the one it keeps inline.
    Last(Bytes),
    /// The other side will send no more messages (the client's half-close).
    HalfClose,
    /// The call is over: the server's trailers, a CANCEL, or the connection's death.
    End(Status),
    /// The server's last message and the call's end with it (a one-frame call's TRAILERS).
    Final(Bytes, Status),
}

/// Why [`Inbox::try_recv`] gave nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Empty {
    /// Nothing yet.
    Now,
    /// Nothing ever again: the stream is closed and drained.
    Closed,
}

#[derive(Debug, Default)]
pub(crate) struct Inbox {
    state: Mutex<State>,
    /// Whether `try_recv` would give something now: set and cleared only under `state`'s lock.
    ready: AtomicBool,
}

#[derive(Debug, Default)]
struct State {
    events: Queue<Event>,
    waker: Option<Waker>,
    closed: bool,
}

impl Inbox {
    fn state(&self) -> MutexGuard<'_, State> {
        // Nothing can panic while the lock is held (queue operations only), so a poisoned lock
        // still holds a consistent queue.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records what `st` holds now for `is_ready`; called with the lock held, after each change.
    fn mark(&self, st: &State) {
        self.ready.store(st.closed || !st.events.is_empty(), Ordering::Release);
    }

    /// Queues an event and wakes the call waiting for it. Events after `close` are dropped.
    pub(crate) fn push(&self, ev: Event) {
        if let Some(w) = self.push_unwoken(ev, false) {
            w.wake();
        }
    }

    /// Queues an event; the waker of the call waiting for it, for the caller to wake once it
    /// holds no lock: a wake-up may make a system call (an eventfd's write, a worker's unpark),
    /// which must not keep a connection's stream table locked. `close`: the stream's last event,
    /// and [`close`](Self::close) with it, in the same look.
    #[must_use = "the waker must be woken"]
    pub(crate) fn push_unwoken(&self, ev: Event, close: bool) -> Option<Waker> {
        let mut st = self.state();
        if st.closed {
            return None;
        }
        st.events.push_back(ev);
        st.closed = close;
        self.mark(&st);
        st.waker.take()
    }

    /// Queues the first event of a queue nothing else can see yet: no lock, no waker.
    pub(crate) fn push_fresh(&mut self, ev: Event) {
        let st = self.state.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner);
        st.events.push_back(ev);
        *self.ready.get_mut() = true;
    }

    /// No more events will come; the call drains what is queued, then sees the end.
    pub(crate) fn close(&self) {
        let waker = {
            let mut st = self.state();
            st.closed = true;
            self.mark(&st);
            st.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }

    pub(crate) fn try_recv(&self) -> Result<Event, Empty> {
        let mut st = self.state();
        let ev = st.events.pop_front();
        self.mark(&st);
        match ev {
            Some(ev) => Ok(ev),
            None if st.closed => Err(Empty::Closed),
            None => Err(Empty::Now),
        }
    }

    /// Whether `try_recv` would give something (an event, or the end).
    pub(crate) fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// The next event; `None` once closed and drained. Registers `cx`'s waker when nothing is
    /// queued.
    pub(crate) fn poll_recv(&self, cx: &mut Context<'_>) -> Poll<Option<Event>> {
        let mut st = self.state();
        if let Some(ev) = st.events.pop_front() {
            self.mark(&st);
            return Poll::Ready(Some(ev));
        }
        if st.closed {
            return Poll::Ready(None);
        }
        match &mut st.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            slot => *slot = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::{Empty, Event, Inbox};
    use crate::status::Status;

    /// `is_ready`, which takes no lock, says what `try_recv` would give after every kind of
    /// change: an event, taking it, the end, and a last event with the end.
    #[test]
    fn is_ready_follows_the_queue_through_each_change() {
        let inbox = Inbox::default();
        assert!(!inbox.is_ready(), "a new queue is empty");
        assert!(inbox.push_unwoken(Event::Message(Bytes::from_static(b"a")), false).is_none());
        assert!(inbox.is_ready(), "an event came");
        assert!(matches!(inbox.try_recv(), Ok(Event::Message(_))));
        assert!(!inbox.is_ready(), "it was taken");
        assert_eq!(inbox.try_recv().err(), Some(Empty::Now));
        assert!(inbox.push_unwoken(Event::End(Status::ok()), true).is_none());
        assert!(inbox.is_ready(), "the last event came");
        assert!(matches!(inbox.try_recv(), Ok(Event::End(_))));
        assert!(inbox.is_ready(), "taken, the end is still there to see");
        assert_eq!(inbox.try_recv().err(), Some(Empty::Closed));
        assert!(inbox.push_unwoken(Event::HalfClose, false).is_none());
        assert_eq!(inbox.try_recv().err(), Some(Empty::Closed), "nothing is queued after the end");

        let mut fresh = Inbox::default();
        fresh.push_fresh(Event::Last(Bytes::from_static(b"b")));
        assert!(fresh.is_ready(), "a fresh queue's first event counts as any other");
        assert!(matches!(fresh.try_recv(), Ok(Event::Last(_))));
        assert!(!fresh.is_ready());
        fresh.close();
        assert!(fresh.is_ready(), "the end alone");
    }
}
