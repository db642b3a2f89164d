//! The handshake socket after the handshake: the connection's liveness, and its health.
//!
//! Nothing is sent on the socket once the segment is set up. EOF on it means the peer is gone
//! (it exited, crashed, or closed), and every waiter polls it beside its doorbell, so a dead peer
//! wakes them all at once.
//!
//! Liveness: when a poller's socket is readable, `Link::observe_socket` peeks one byte:
//! end-of-file or a reset records `PeerGone`; bytes record an error and shut the socket down. If
//! the bytes are a client's late refusal (`late_refusal`, decoded by `handshake`), the error is the
//! refusal's, with the client's reason; anything else is a protocol error.
//!
//! `Health` keeps the first fatal error of the connection; later ones are ignored, and every
//! operation checks it first. It outlives the socket (views of the peer's arena hold it through
//! their `Releaser`), so it keeps only the socket's raw fd, under a mutex, and `Link`'s drop clears
//! that fd under the same mutex before the socket closes. `Health::fail_and_hang_up` can therefore
//! shut the socket down from anywhere, a destructor included, but never a recycled fd number.
//!
//! How a connection ends:
//!
//! - A fatal error (protocol, I/O, peer gone, closed) is recorded and the socket shut down, so the
//!   peer sees end-of-file (`PeerGone`) and this side's sleepers, which poll the same socket, wake
//!   at once. No reason is sent to the peer. Every check of peer data on an established connection
//!   reports this way: in `try_recv` and `arm`, in an allocation or a push, and in the condition a
//!   wait checks.
//! - A failure found in a destructor (the drop of a received view finds the release ring full or
//!   corrupted) goes the same way, through `fail_and_hang_up`.
//! - `Sender::close` records `Closed` and shuts the socket down; the peer sees end-of-file, and
//!   this side's pollers see the shutdown, wake, and return `Closed`.
//! - After the peer died, `recv` and `recv_async` treat `PeerGone` from a wait as a cue to look
//!   again: `try_recv` still delivers the frames the peer published before it died, then reports
//!   `PeerGone`. Any other error is reported at once; `disarm` reports a dead peer too.
//!
//! Lifetimes: the socket, the doorbells and the mapping belong to the connection's core, which
//! lives while any `Sender` clone, the `Receiver` or a `BlockMut` lives. A received view holds an
//! `Arc<Releaser>`, which holds the `Arc<Segment>`, so the mapping outlives every view, even after
//! the connection is dropped.
//!
//! Each fd (every eventfd, and the socket) is registered with tokio's reactor once, on first use,
//! in a `OnceLock` (`AsyncCell`), even if the receive and send pollers race to do it: a second
//! registration of one fd would fail with `EEXIST`. `lazy_async_fd` is `unsafe` because it
//! registers a borrowed fd; it is sound because the owning field is declared after the registration
//! and so outlives it. The registration runs under `catch_unwind`, which turns tokio's panic in a
//! runtime without I/O into `InvalidConfig`; a failed registration is not retried, and every later
//! async wait on that fd reports the same kind and message.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use crate::error::{Error, ErrorKind, Result};
use crate::handshake;
use crate::sys::{self, SocketState};

/// Whether a connection is still usable, and if not, why. Outlives the socket (views of the
/// peer's arena hold it), so it keeps only the socket's number, cleared under the lock before
/// the socket is closed: a late failure can still shut the socket down, never a recycled fd.
///
/// A connection belongs to the process that made it. In a child forked since, it counts as
/// closed, and nothing of it may reach the peer: its rings, arena and socket are the parent's
/// still, so the child sends, receives and releases nothing, and never shuts the socket down
/// (which would end the parent's connection too).
#[derive(Debug)]
pub(crate) struct Health {
    closed: AtomicBool,
    reason: Mutex<Option<(ErrorKind, String)>>,
    socket: Mutex<Option<RawFd>>,
    made_in: MadeIn,
}

impl Default for Health {
    fn default() -> Health {
        Health {
            closed: AtomicBool::new(false),
            reason: Mutex::default(),
            socket: Mutex::default(),
            made_in: MadeIn::now(),
        }
    }
}

/// The process something was made in, as the fork count ([`forks`](crate::forks)) then: in a
/// child forked since, it is the parent's, and the child leaves it alone (ADR 0030).
/// Looking costs one relaxed load.
#[derive(Debug, Clone, Copy)]
pub struct MadeIn(u64);

impl MadeIn {
    /// This process, now.
    pub fn now() -> MadeIn {
        MadeIn(sys::forks())
    }

    /// Whether this process is a child forked since.
    pub fn forked(self) -> bool {
        sys::forks_counted() != self.0
    }
}

impl Health {
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire) || self.forked()
    }

    /// Whether this process is a child forked since the connection was made.
    pub(crate) fn forked(&self) -> bool {
        self.made_in.forked()
    }

    /// Records the first fatal error; later ones are ignored.
    pub(crate) fn fail(&self, e: Error) {
        if let Ok(mut r) = self.reason.lock() {
            if r.is_none() {
                *r = Some((e.kind(), e.to_string()));
            }
        }
        self.closed.store(true, Ordering::Release);
    }

    /// Records `e` and shuts the socket down, so the peer sees EOF and our sleepers wake (not
    /// in a forked child: the socket is the parent's connection too).
    pub(crate) fn fail_and_hang_up(&self, e: Error) {
        self.fail(e);
        if self.forked() {
            return;
        }
        if let Ok(sock) = self.socket.lock() {
            if let Some(fd) = *sock {
                sys::shutdown(fd);
            }
        }
    }

    /// The error that closed the connection.
    pub(crate) fn error(&self) -> Error {
        if self.forked() {
            return Error::new(
                ErrorKind::Closed,
                "the connection was made by the parent of this process, before a fork; this process makes its own",
            );
        }
        match self.reason.lock().ok().and_then(|r| r.clone()) {
            Some((kind, msg)) => Error::new(kind, msg),
            None => Error::new(ErrorKind::Closed, "the connection is closed"),
        }
    }

    /// Ok while open; the closing error after.
    pub(crate) fn check(&self) -> Result<()> {
        if self.is_closed() {
            Err(self.error())
        } else {
            Ok(())
        }
    }
}

/// A raw fd for tokio's `AsyncFd`, which must not own it: the owner is a field declared after
/// the `AsyncFd`, so the registration is dropped before the fd is closed.
#[cfg(feature = "tokio")]
#[derive(Debug)]
pub(crate) struct FdRef(RawFd);

#[cfg(feature = "tokio")]
impl AsRawFd for FdRef {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// A lazily made tokio registration, or why it could not be made.
#[cfg(feature = "tokio")]
pub(crate) type AsyncCell =
    std::sync::OnceLock<std::result::Result<tokio::io::unix::AsyncFd<FdRef>, (ErrorKind, String)>>;

/// Registers `fd` with the current tokio runtime on first use.
///
/// # Safety
///
/// `fd` must stay open until `cell` is dropped: callers pass an fd owned by a field declared
/// *after* `cell` in the same struct, so the registration is dropped first.
#[cfg(feature = "tokio")]
pub(crate) unsafe fn lazy_async_fd<'a>(
    cell: &'a AsyncCell,
    fd: BorrowedFd<'_>,
) -> Result<&'a tokio::io::unix::AsyncFd<FdRef>> {
    let no_runtime = || Error::new(ErrorKind::InvalidConfig, "async waits need a tokio runtime with I/O enabled");
    if tokio::runtime::Handle::try_current().is_err() {
        return Err(no_runtime());
    }
    // Registration runs once even if the rx and tx pollers race here (a second registration of
    // the same fd would fail with EEXIST). tokio panics, rather than failing, in a runtime built
    // without I/O; that panic becomes an error instead of tearing down the caller.
    let registered = cell.get_or_init(|| {
        let register = std::panic::AssertUnwindSafe(|| {
            // SAFETY: the caller guarantees `fd` outlives `cell`, and so the AsyncFd stored in it.
            unsafe {
                tokio::io::unix::AsyncFd::register_with_interest(FdRef(fd.as_raw_fd()), tokio::io::Interest::READABLE)
            }
        });
        match std::panic::catch_unwind(register) {
            Ok(Ok(a)) => Ok(a),
            Ok(Err(e)) => {
                let e = Error::io("cannot register with the tokio reactor", e.into());
                Err((e.kind(), e.to_string()))
            }
            Err(_) => Err((ErrorKind::InvalidConfig, no_runtime().to_string())),
        }
    });
    registered.as_ref().map_err(|(kind, msg)| Error::new(*kind, msg.clone()))
}

/// The socket that ties a connection's life to the peer's.
#[derive(Debug)]
pub(crate) struct Link {
    #[cfg(feature = "tokio")]
    async_fd: AsyncCell,
    socket: UnixStream,
    pub(crate) health: std::sync::Arc<Health>,
}

impl Link {
    pub(crate) fn new(socket: UnixStream) -> Result<Link> {
        // fcntl, as std's `set_nonblocking` is an ioctl that Miri cannot run (`make miri`).
        sys::set_nonblocking(socket.as_fd()).map_err(|e| Error::io("cannot make the socket non-blocking", e))?;
        let health = std::sync::Arc::new(Health::default());
        if let Ok(mut s) = health.socket.lock() {
            *s = Some(socket.as_raw_fd());
        }
        Ok(Link {
            #[cfg(feature = "tokio")]
            async_fd: Default::default(),
            socket,
            health,
        })
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.socket.as_fd()
    }

    pub(crate) fn check(&self) -> Result<()> {
        self.health.check()
    }

    /// Called when the socket polled readable: decides whether the peer is gone.
    pub(crate) fn observe_socket(&self) {
        match sys::socket_state(self.fd()) {
            SocketState::Quiet => {}
            SocketState::Closed => self.health.fail(Error::peer_gone()),
            SocketState::Data => {
                let e = late_refusal(self.fd())
                    .unwrap_or_else(|| Error::protocol("the peer wrote to the handshake socket after the handshake"));
                self.fail(e);
            }
        }
    }

    /// Looks at the socket now, without waiting: for callers about to report success on a path
    /// where no wait has noticed a dead peer yet.
    pub(crate) fn poll_alive(&self) -> Result<()> {
        self.observe_socket();
        self.check()
    }

    /// Marks the connection failed and tells the peer.
    pub(crate) fn fail(&self, e: Error) {
        self.health.fail_and_hang_up(e);
    }

    #[cfg(feature = "tokio")]
    pub(crate) fn async_fd(&self) -> Result<&tokio::io::unix::AsyncFd<FdRef>> {
        // SAFETY: `socket` is declared after `async_fd`, so it is closed after the registration.
        unsafe { lazy_async_fd(&self.async_fd, self.fd()) }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        // Forget the fd before `socket` closes it, so no late failure shuts down a reused number.
        if let Ok(mut s) = self.health.socket.lock() {
            *s = None;
        }
        #[cfg(feature = "tokio")]
        keep_registration_if_forked(&mut self.async_fd, self.health.made_in);
    }
}

/// In a child forked since `made_in`, leaves the registration in `cell` with the parent's
/// reactor as it is: dropping it deregisters the fd (`EPOLL_CTL_DEL`) from the epoll instance
/// parent and child share, which would remove the parent's registration of the same file.
#[cfg(feature = "tokio")]
pub(crate) fn keep_registration_if_forked(cell: &mut AsyncCell, made_in: MadeIn) {
    if made_in.forked() {
        if let Some(Ok(registration)) = cell.take() {
            std::mem::forget(registration);
        }
    }
}

/// After a server's hello, the client may still refuse (bad segment, wrong uid). That refusal
/// arrives on a socket the server already treats as a liveness line; read it for a real reason.
fn late_refusal(sock: std::os::fd::BorrowedFd<'_>) -> Option<Error> {
    let mut buf = [0u8; handshake::HELLO_LEN + handshake::MAX_REASON_LEN];
    let n = sys::peek(sock, &mut buf);
    handshake::decode_late_refusal(&buf[..n.min(buf.len())])
}
