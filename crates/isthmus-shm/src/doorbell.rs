//! Doorbells: an eventfd plus a "parked" flag in the segment, so a producer makes a system call
//! only when its consumer really sleeps.
//!
//! The sleeper sets its parked flag, issues a full fence, and checks its condition once more
//! before it sleeps; the waker publishes its change, issues a full fence, and reads the flag.
//! Whichever runs second sees the other's write (Dekker), so no wake-up is lost. The waker swaps
//! the flag back to zero so a burst of frames costs one `write(2)`, not one each.
//!
//! Several threads may wait on one bell (two senders, one blocked on ring room and one on arena
//! room). Only one of them — the *poller* — sleeps on the eventfd and drains it; the others wait
//! on an in-process event the poller fires when it wakes. A drain can therefore never swallow a
//! wake-up meant for a thread that has not reached `poll(2)` yet.
//!
//! A wait (`Waiter`) spins first, checking its condition in batches of 64: purely for
//! `SpinPolicy::yield_after`, then yielding the CPU after every batch, until `SpinPolicy::max` (see
//! `config`), or past it while the peer announces a large message it is writing for us (ADR
//! 0026: a wait woken by that announcement spins for the message before it sleeps again).
//! Then it parks: it sets the parked flag, fences, checks once more
//! (`announce_and_check`), and sleeps in `poll(2)` on the eventfd and the socket for the time left.
//! A deadline that passes is `Timeout`, and the connection stays usable; an error from the
//! condition itself (a corrupted cursor found while a receive or a send waits) closes the
//! connection like any protocol error.
//!
//! The async wait (feature `tokio`) follows the same protocol with `AsyncFd` in place of `poll(2)`:
//!
//! - The poller awaits `readable()` futures on the eventfd and on the socket, not
//!   `poll_read_ready`: the socket's registration is shared by the receive and send pollers, tokio
//!   keeps only one waker for the poll form, and any number of `readable()` futures may wait. After
//!   end-of-file the socket's readiness is not cleared, so every other waiter sees the end too.
//! - It spins like a blocking wait, synchronously, on the runtime's worker thread, and holds that
//!   worker meanwhile: a task woken on the same worker waits (at most `SpinPolicy::max`) unless
//!   another worker takes it. A caller that wakes tasks should give the scheduler a turn before it
//!   waits again, as the RPC reader does after a batch.
//! - Deadlines are the caller's (`tokio::time::timeout`). Dropping the future gives up the poller
//!   role and clears the parked flag; a dropped receive loses no frame. The registration belongs to
//!   the runtime that made it: use one runtime per connection.
//! - Blocking and async waiters share a bell: the poller role does not care which kind holds it.
//!
//! [`EventFd`] is a public non-blocking eventfd for wake-ups inside one process; the Python
//! binding's asyncio `Reactor` gives one to its event loop to watch.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use event_listener::{Event, Listener};

use crate::config::SpinPolicy;
use crate::error::{Error, Result};
use crate::link::Link;
use crate::stats::Stats;
use crate::sys;

/// One eventfd and the in-process state of the threads waiting on it.
#[derive(Debug)]
pub(crate) struct Bell {
    #[cfg(feature = "tokio")]
    async_fd: crate::link::AsyncCell,
    fd: OwnedFd,
    poller: AtomicBool,
    woken: Event,
    /// See [`crate::link::keep_registration_if_forked`].
    #[cfg(feature = "tokio")]
    made_in: crate::link::MadeIn,
}

impl Drop for Bell {
    fn drop(&mut self) {
        #[cfg(feature = "tokio")]
        crate::link::keep_registration_if_forked(&mut self.async_fd, self.made_in);
    }
}

impl Bell {
    pub(crate) fn new(fd: OwnedFd) -> Bell {
        Bell {
            #[cfg(feature = "tokio")]
            async_fd: Default::default(),
            fd,
            poller: AtomicBool::new(false),
            woken: Event::new(),
            #[cfg(feature = "tokio")]
            made_in: crate::link::MadeIn::now(),
        }
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Rings the bell.
    pub(crate) fn ring(&self) {
        sys::eventfd_signal(self.fd.as_fd());
    }

    #[cfg(feature = "tokio")]
    fn async_fd(&self) -> Result<&tokio::io::unix::AsyncFd<crate::link::FdRef>> {
        // SAFETY: `fd` is declared after `async_fd`, so it is closed after the registration.
        unsafe { crate::link::lazy_async_fd(&self.async_fd, self.fd.as_fd()) }
    }
}

/// Publishes-then-checks half of the protocol: after making a change the parked side waits for,
/// wake it if it sleeps. Returns true if a system call was made.
pub(crate) fn wake_if_parked(parked: &AtomicU32, bell: &Bell) -> bool {
    fence(Ordering::SeqCst);
    if parked.load(Ordering::Relaxed) != 0 && parked.swap(0, Ordering::AcqRel) != 0 {
        bell.ring();
        return true;
    }
    false
}

/// Everything one wait needs: which bell, which flag announces the sleep, and the link whose
/// death must end the wait.
pub(crate) struct Waiter<'a> {
    pub(crate) bell: &'a Bell,
    pub(crate) parked: &'a AtomicU32,
    pub(crate) link: &'a Link,
    pub(crate) spin: SpinPolicy,
    pub(crate) stats: &'a Stats,
    /// Says what was being waited for, in timeout errors.
    pub(crate) what: &'static str,
    /// For a wait for the peer's frames: the peer's `CTL_COMPOSING` word, the bytes it says it
    /// is writing for us. While it is large the spin goes on longer, and a wait woken with no
    /// frame yet spins again instead of sleeping at once (ADR 0026).
    pub(crate) composing: Option<&'a AtomicU64>,
}

/// Releases the poller role (and the parked flag) however the wait ends, and lets the other
/// waiters re-check.
struct PollerGuard<'a> {
    bell: &'a Bell,
    parked: &'a AtomicU32,
}

impl Drop for PollerGuard<'_> {
    fn drop(&mut self) {
        self.parked.store(0, Ordering::Relaxed);
        self.bell.poller.store(false, Ordering::Release);
        self.bell.woken.notify(usize::MAX);
    }
}

impl Waiter<'_> {
    /// Spins for at most the policy's bound, yielding the CPU after `yield_after`; past it, for
    /// as long as the peer's announced message plausibly takes to write.
    fn spin(&self, deadline: Option<Instant>, ready: &mut impl FnMut() -> Result<bool>) -> Result<bool> {
        self.spin_for(self.spin.max, deadline, ready)
    }

    /// The spin after a wake-up that found no frame (perhaps the peer's announcement of a large
    /// message woke us): catch that message by spinning, not by a second sleep and wake-up; only
    /// while the peer announces one, and once per wait (`tried`), so a peer that rings and
    /// announces without sending costs one such spin per frame it sends, as an honest one does.
    fn spin_after_wake(
        &self,
        tried: &mut bool,
        deadline: Option<Instant>,
        ready: &mut impl FnMut() -> Result<bool>,
    ) -> Result<bool> {
        if std::mem::replace(tried, true) || self.composing_extra().is_zero() {
            return Ok(false);
        }
        self.spin_for(Duration::ZERO, deadline, ready)
    }

    fn composing_extra(&self) -> Duration {
        self.composing.map_or(Duration::ZERO, |c| self.spin.composing_extra(c.load(Ordering::Relaxed)))
    }

    fn spin_for(
        &self,
        base: Duration,
        deadline: Option<Instant>,
        ready: &mut impl FnMut() -> Result<bool>,
    ) -> Result<bool> {
        if self.spin.max.is_zero() {
            return Ok(false);
        }
        let start = Instant::now();
        loop {
            for _ in 0..64 {
                if ready()? {
                    self.stats.add(&self.stats.spin_hits, 1);
                    return Ok(true);
                }
                std::hint::spin_loop();
            }
            let now = Instant::now();
            let spent = now - start;
            if deadline.is_some_and(|d| now >= d) {
                return Ok(false);
            }
            // The announcement is read only once the base bound is spent: one load per batch
            // of a line the peer writes twice per large message.
            if spent >= base && spent >= base.saturating_add(self.composing_extra()) {
                return Ok(false);
            }
            if spent >= self.spin.yield_after {
                std::thread::yield_now();
            }
        }
    }

    /// Blocks until `ready()` holds, the deadline passes, or the link dies.
    pub(crate) fn wait(&self, deadline: Option<Instant>, mut ready: impl FnMut() -> Result<bool>) -> Result<()> {
        self.link.check()?;
        if self.spin(deadline, &mut ready)? {
            return Ok(());
        }
        let mut spun_after_wake = false;
        loop {
            self.link.check()?;
            if ready()? {
                return Ok(());
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(Error::timeout(self.what));
            }
            if self.bell.poller.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_ok() {
                let _guard = PollerGuard { bell: self.bell, parked: self.parked };
                if self.announce_and_check(&mut ready)? {
                    return Ok(());
                }
                self.stats.add(&self.stats.sleeps, 1);
                let r = sys::wait_readable(self.bell.fd(), self.link.fd(), deadline)
                    .map_err(|e| Error::io("waiting on the doorbell failed", e))?;
                if r.first {
                    sys::eventfd_drain(self.bell.fd());
                }
                if r.second {
                    self.link.observe_socket();
                }
            } else {
                let listener = self.bell.woken.listen();
                if !self.bell.poller.load(Ordering::Acquire) {
                    continue; // the poller left before we listened; take its place
                }
                // Announce ourselves too before the last check: a change published after it
                // then rings the bell, which wakes the poller, which wakes us.
                if self.announce_and_check(&mut ready)? {
                    return Ok(());
                }
                match deadline {
                    Some(d) => drop(listener.wait_deadline(d)),
                    None => listener.wait(),
                }
            }
            if self.spin_after_wake(&mut spun_after_wake, deadline, &mut ready)? {
                return Ok(());
            }
        }
    }

    /// Sets the parked flag, fences, and checks `ready` once more (the sleeper's half of the
    /// Dekker protocol).
    fn announce_and_check(&self, ready: &mut impl FnMut() -> Result<bool>) -> Result<bool> {
        self.parked.store(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        ready()
    }

    /// The async form of [`wait`](Self::wait), for tokio. Cancel-safe: dropping the future gives
    /// up the poller role. Deadlines are the caller's (`tokio::time::timeout`).
    #[cfg(feature = "tokio")]
    pub(crate) async fn wait_async(&self, mut ready: impl FnMut() -> Result<bool>) -> Result<()> {
        use std::future::Future;
        use std::task::Poll;
        self.link.check()?;
        // The spin holds this worker thread: a task woken meanwhile on this worker waits for
        // it (at most the spin's bound), unless another worker takes it. Callers that wake
        // tasks (the RPC reader) give the scheduler a turn before they wait again.
        if self.spin(None, &mut ready)? {
            return Ok(());
        }
        let mut spun_after_wake = false;
        loop {
            self.link.check()?;
            if ready()? {
                return Ok(());
            }
            if self.bell.poller.compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed).is_ok() {
                let _guard = PollerGuard { bell: self.bell, parked: self.parked };
                let bell_fd = self.bell.async_fd()?;
                let link_fd = self.link.async_fd()?;
                if self.announce_and_check(&mut ready)? {
                    return Ok(());
                }
                self.stats.add(&self.stats.sleeps, 1);
                // `readable()` futures, not `poll_read_ready`: the socket is shared by the rx and
                // tx pollers, and tokio keeps only one waker for the poll form.
                let mut bell_ready = std::pin::pin!(bell_fd.readable());
                let mut link_ready = std::pin::pin!(link_fd.readable());
                std::future::poll_fn(|cx| {
                    if let Poll::Ready(r) = bell_ready.as_mut().poll(cx) {
                        let mut g = r.map_err(|e| Error::io("waiting on the doorbell failed", e))?;
                        sys::eventfd_drain(self.bell.fd());
                        g.clear_ready();
                        return Poll::Ready(Ok::<(), Error>(()));
                    }
                    if let Poll::Ready(r) = link_ready.as_mut().poll(cx) {
                        let mut g = r.map_err(|e| Error::io("waiting on the socket failed", e))?;
                        self.link.observe_socket();
                        // After EOF the socket stays readable for every other waiter.
                        if !self.link.health.is_closed() {
                            g.clear_ready();
                        }
                        return Poll::Ready(Ok(()));
                    }
                    Poll::Pending
                })
                .await?;
            } else {
                let listener = self.bell.woken.listen();
                if !self.bell.poller.load(Ordering::Acquire) {
                    continue;
                }
                if self.announce_and_check(&mut ready)? {
                    return Ok(());
                }
                listener.await;
            }
            if self.spin_after_wake(&mut spun_after_wake, None, &mut ready)? {
                return Ok(());
            }
        }
    }
}

/// A non-blocking eventfd for an in-process waker: readable while signalled. Event loops that
/// wait on file descriptors (asyncio's `add_reader`) wait on one of these.
#[derive(Debug)]
pub struct EventFd(OwnedFd);

impl EventFd {
    /// A fresh eventfd, not signalled.
    pub fn new() -> std::io::Result<EventFd> {
        sys::eventfd().map(EventFd)
    }

    /// Makes it readable.
    pub fn signal(&self) {
        sys::eventfd_signal(self.0.as_fd());
    }

    /// Makes it unreadable again; true if it was signalled.
    pub fn drain(&self) -> bool {
        sys::eventfd_drain(self.0.as_fd())
    }

    /// Sleeps until it is signalled or `deadline` passes (`None`: no limit), without draining
    /// it; true if signalled.
    pub fn wait(&self, deadline: Option<std::time::Instant>) -> bool {
        sys::wait_one(self.0.as_fd(), deadline)
    }
}

impl std::os::fd::AsRawFd for EventFd {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        std::os::fd::AsRawFd::as_raw_fd(&self.0)
    }
}

/// A bell on a connected Unix stream socket: ringing sends one byte, never blocking. For event
/// loops that watch only sockets they connected themselves (nginx's Lua cosockets), where an
/// [`EventFd`] cannot go.
#[derive(Debug)]
pub struct SocketBell(std::os::unix::net::UnixStream);

impl SocketBell {
    /// A bell that rings on `stream`.
    pub fn new(stream: std::os::unix::net::UnixStream) -> SocketBell {
        SocketBell(stream)
    }

    /// Sends one byte; if the socket's buffer is full (the watcher has not read yet) or the
    /// watcher is gone, the ring is dropped: a byte waiting already wakes it.
    pub fn ring(&self) {
        sys::send_nowait(self.0.as_fd(), &[1]);
    }
}
