//! The blocking client: calls from plain threads, with no async runtime at all.
//!
//! A blocking [`Channel`] has no reader task. The threads waiting on its calls read the
//! connection themselves, one at a time: the first to need a frame reads until it has what it
//! waits for, routing whatever else arrives to the other calls and waking their threads. With a
//! single call in flight, the calling thread sends its request and reads its reply itself; no
//! other thread is involved.
//!
//! It has the async client's methods and meaning (see `engine::client`); where they differ:
//!
//! - No runtime: the handshake runs on the calling thread (on a thread of its own when the call
//!   has less time left than a handshake may take, so that it can outlive the call, or may be
//!   interrupted), and the connection is read by the threads waiting in its calls
//!   (`Mux::driven`, `Mux::wait`). Between calls nobody reads: frames from the server stay in
//!   the ring (once it is full, the server's sends wait). A call that starts after a pause of
//!   about 1 ms or more (`STALE_TICKS`) first looks at the socket (one non-blocking system
//!   call), so a server that died meanwhile is noticed before the call goes out, and the call
//!   connects anew; a GOAWAY, or a death between calls closer together, is noticed by the next
//!   call, which fails UNAVAILABLE, and the call after it connects anew.
//! - Deadlines are `std::time::Instant`s; the send of HEADERS is bounded by the deadline too. The
//!   CANCEL that a deadline or `cancel()` sends waits at most 100 ms for ring room
//!   (`CANCEL_PATIENCE`); a drop's never waits.
//! - `wait_for_ready`'s backoff sleeps the thread.
//! - `shm://` only: a `unix://` or `http://` target is INVALID_ARGUMENT. Over HTTP/2 the async
//!   `Channel` is the only client (the Python binding runs such calls with `block_on`).
//! - How its threads read: the `Receiver` sits in a `Pump` (leader, generation, sleepers) under a
//!   mutex and condvar. A thread that needs a frame and finds no leader leads: it reads with the
//!   blocking `recv`, routes each frame, wakes sleepers if any, and steps down once its own
//!   condition holds; the others sleep until a new generation or the leader steps down.
//! - A channel may be used from any number of threads at once; 8 threads × 1,500 calls on one
//!   channel each get their own replies (`rpc_blocking.rs`).
//!
//! ```no_run
//! # fn demo() -> Result<(), isthmus::Status> {
//! let channel = isthmus::blocking::Channel::connect("shm://sidecar")?;
//! let reply = channel.unary("/demo.Echo/Say", b"hello", Default::default())?;
//! assert_eq!(&reply.message[..], b"hello");
//! # Ok(()) }
//! ```

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use isthmus_shm::{flags, BlockMut, Config, Kind};

use super::call::{
    count_inside, head_frame, open_head, request_in_head, CallState, ConnectLock, Next, Reconnect, Slot, TimedGuard,
    TimedLock,
};
use crate::call::{check_start, CallOptions, Response};
use crate::connectivity::{Connectivity, Live, Tracker};
use crate::engine::flow::{self, Credit};
use crate::engine::mux::{ConnectionCounters, Mux, Outgoing};
use crate::status::{Code, Status, DEADLINE_EXCEEDED};

struct Inner {
    slot: Slot,
    /// Serialises reconnecting, so a burst of calls makes one connection, not many.
    connecting: ConnectLock<TimedLock>,
    connectivity: Arc<Tracker>,
    /// The newest connection, and what holds the channel READY for it. Nobody reads it
    /// between calls, so its end is seen by the next look ([`Channel::connectivity`], a call
    /// after a pause) or by a call that reads it.
    live: Mutex<Option<(Arc<Mux>, Live)>>,
    /// When the last call started, in [`isthmus_shm::ticks`]: a call after a pause looks at the
    /// socket first ([`STALE_TICKS`]).
    last_start: AtomicU64,
    /// Looked at while a call waits to connect ([`Channel::set_interrupt`]).
    interrupt: std::sync::OnceLock<Interrupt>,
    /// Whether the calling thread's wait for a handshake may be interrupted now
    /// ([`Channel::set_interrupt`]).
    interruptible: std::sync::OnceLock<Interrupt>,
}

/// A binding's look at whether a wait should go on ([`Channel::set_interrupt`]).
pub type Interrupt = Arc<dyn Fn() -> bool + Send + Sync>;

/// How often a wait to connect looks at its channel's [`Interrupt`].
const INTERRUPT_EVERY: Duration = Duration::from_millis(100);

impl Inner {
    /// One attempt to connect, made holding `lock`; what it makes serves every call. A call
    /// with less time left than a handshake may take (the handshake timeout), or one that may
    /// be interrupted ([`Inner::interruptible_here`]), leaves the attempt to a thread of its
    /// own, which holds the lock until the attempt ends: the call ends DEADLINE_EXCEEDED at its deadline (or CANCELLED
    /// when interrupted, looked at every [`INTERRUPT_EVERY`]), and a handshake slower than it
    /// still connects the channel for the calls after it, as gRPC's connection attempts outlive
    /// the call that began them. (Bounded by the call's deadline, a handshake slower than every
    /// call's never ended, and no call got through; on the calling thread, a Python call
    /// waited for a stopped server's handshake for its whole timeout, deaf to Ctrl-C.)
    ///
    /// The thread holds the channel weakly: a channel dropped meanwhile is not kept, and the
    /// connection made for it is closed (one closed meanwhile refuses it). Its handshake still
    /// runs to its end or its timeout, holding a socket and the thread that long.
    fn attempt(self: &Arc<Self>, lock: TimedGuard, deadline: Option<Instant>) -> Result<Arc<Mux>, Status> {
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        let short = left.is_some_and(|left| left < self.slot.config.handshake_timeout);
        let interruptible = self.interruptible_here();
        if !short && !interruptible {
            let _lock = lock;
            self.begin_attempt()?;
            return self.connected(Slot::connect(&self.slot.target, &self.slot.config, self.slot.expect_pid, deadline));
        }
        if left.is_some_and(|left| left.is_zero()) {
            return Err(Status::deadline_exceeded());
        }
        self.begin_attempt()?;
        // A signal handler run between slices may fork: the child has no connecting thread.
        let forks = isthmus_shm::forks();
        let (done, outcome) = std::sync::mpsc::sync_channel(1);
        let (inner, slot) = (Arc::downgrade(self), &self.slot);
        let (target, config, pid) = (slot.target.clone(), slot.config.clone(), slot.expect_pid);
        let spawned = std::thread::Builder::new().name("isthmus-connect".into()).spawn(move || {
            let conn = Slot::connect(&target, &config, pid, None);
            let made = match inner.upgrade() {
                Some(inner) => inner.connected(conn),
                None => Err(Status::new(Code::Cancelled, "the channel was dropped")),
            };
            drop(lock);
            let _ = done.send(made); // the call may have ended meanwhile
        });
        if let Err(e) = spawned {
            return Err(Status::new(Code::Unavailable, format!("cannot start a thread to connect on: {e}")));
        }
        let ended = || Status::new(Code::Internal, "the thread connecting the channel ended without an outcome");
        // Not to be interrupted: one wait, to the deadline (a short one: see above).
        if let (false, Some(left)) = (interruptible, left) {
            return match outcome.recv_timeout(left) {
                Ok(made) => made,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(Status::deadline_exceeded()),
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(ended()),
            };
        }
        loop {
            match outcome.recv_timeout(self.slice_of(deadline)?) {
                Ok(made) => return made,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    self.not_interrupted()?;
                    if isthmus_shm::forks() != forks {
                        return Err(Status::new(Code::Unavailable, "forked while connecting: connect anew"));
                    }
                }
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return Err(ended()),
            }
        }
    }

    /// The next slice of a wait that ends at `deadline` and looks at the channel's interrupt
    /// between slices: [`INTERRUPT_EVERY`] at most; DEADLINE_EXCEEDED once it has passed.
    fn slice_of(&self, deadline: Option<Instant>) -> Result<Duration, Status> {
        match deadline.map(|d| d.saturating_duration_since(Instant::now())) {
            Some(left) if left.is_zero() => Err(Status::deadline_exceeded()),
            Some(left) => Ok(left.min(INTERRUPT_EVERY)),
            None => Ok(INTERRUPT_EVERY),
        }
    }

    /// Whether the calling thread's wait may be interrupted now: the channel has an interrupt,
    /// and its binding says this thread's wait is one that looks at it.
    fn interruptible_here(&self) -> bool {
        self.interrupt.get().is_some() && self.interruptible.get().is_some_and(|here| here())
    }

    /// CANCELLED if the channel's interrupt says the wait should end.
    fn not_interrupted(&self) -> Result<(), Status> {
        match self.interrupt.get() {
            Some(interrupt) if !interrupt() => {
                Err(Status::new(Code::Cancelled, "the wait for a server was interrupted"))
            }
            _ => Ok(()),
        }
    }

    /// The channel's connect lock, waited for until `deadline` (DEADLINE_EXCEEDED past it) and,
    /// for a wait that may be interrupted, in slices that look at the interrupt. The lock is
    /// looked up for each slice: a signal handler may fork, and the child has a lock of its own.
    fn connect_lock(&self, deadline: Option<Instant>) -> Result<TimedGuard, Status> {
        if !self.interruptible_here() {
            return self.connecting.get().lock_until(deadline).ok_or_else(Status::deadline_exceeded);
        }
        loop {
            let slice = self.slice_of(deadline)?;
            if let Some(held) = self.connecting.get().lock_until(Instant::now().checked_add(slice)) {
                return Ok(held);
            }
            self.not_interrupted()?;
        }
    }

    /// Before an attempt to connect: CONNECTING, unless the channel is closed.
    fn begin_attempt(&self) -> Result<(), Status> {
        self.slot.closed()?;
        self.connectivity.connecting();
        Ok(())
    }

    /// What an attempt to connect made, installed for every call if it is a connection.
    fn connected(&self, made: Result<isthmus_shm::Connection, Status>) -> Result<Arc<Mux>, Status> {
        let slot = &self.slot;
        match made {
            Ok(conn) => {
                let (sender, receiver) = conn.split();
                let mux = Mux::driven(sender, receiver);
                slot.install(mux.clone())?;
                let live = self.connectivity.connected();
                if let Ok(mut held) = self.live.lock() {
                    *held = Some((mux.clone(), live));
                }
                Ok(mux)
            }
            Err(status) => {
                self.connectivity.failed();
                Err(status)
            }
        }
    }

    fn new(slot: Slot) -> Inner {
        Inner {
            slot,
            connecting: ConnectLock::default(),
            connectivity: Arc::default(),
            live: Mutex::new(None),
            last_start: AtomicU64::new(0),
            interrupt: std::sync::OnceLock::new(),
            interruptible: std::sync::OnceLock::new(),
        }
    }
}

/// A connection unused for this long is checked (one non-blocking system call) before a call
/// goes out on it: a server that went away meanwhile is then noticed before the call is sent,
/// and the call connects anew instead of failing. Calls closer together skip the check; a
/// server dying between two of them is the race every client has.
///
/// Counted in time-stamp counts, not read from the clock: a clock read (~20 ns) was on every
/// call's way out. The counter runs at 1-4 GHz, so this is 0.25-1 ms (1 ms where the counts are
/// nanoseconds), either way: threads sharing the channel store their counts in any order.
const STALE_TICKS: u64 = 1_000_000;

/// A connection to one server for blocking code. Cheap to clone and to share between threads;
/// clones share the connection. If the connection dies (the server restarted, say), the next
/// call connects again.
#[derive(Clone)]
pub struct Channel {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("blocking::Channel").field("target", &self.inner.slot.target.to_string()).finish_non_exhaustive()
    }
}

impl Channel {
    /// Connects to `target` (`shm://NAME` or `shm:///path.sock`) now.
    pub fn connect(target: &str) -> Result<Channel, Status> {
        Channel::connect_with(target, Config::default())
    }

    /// [`connect`](Self::connect) with a transport configuration.
    pub fn connect_with(target: &str, config: Config) -> Result<Channel, Status> {
        let channel = Channel::lazy_with(target, config)?;
        channel.mux(false, None)?;
        Ok(channel)
    }

    /// A channel that connects on its first call.
    pub fn lazy(target: &str) -> Result<Channel, Status> {
        Channel::lazy_with(target, Config::default())
    }

    /// [`lazy`](Self::lazy) with a transport configuration.
    pub fn lazy_with(target: &str, config: Config) -> Result<Channel, Status> {
        Ok(Channel { inner: Arc::new(Inner::new(Slot::new(target, config)?)) })
    }

    /// Names `agent` as the user agent of every call from now on, as gRPC's channels do
    /// (grpcio's `grpc.primary_user_agent`, grpc-go's `WithUserAgent`): a server's handlers
    /// see it as `user-agent` in their metadata. Printable ASCII, at most 1 KiB, set once:
    /// INVALID_ARGUMENT otherwise.
    pub fn set_user_agent(&self, agent: &str) -> Result<(), Status> {
        self.inner.slot.set_agent(agent)
    }

    /// Has `interrupt` looked at every 100 ms while a call waits for a server to connect to
    /// (`wait_for_ready`, between attempts) and, where `interruptible` says so for the calling
    /// thread, for a handshake (its own, which then runs on a thread of its own, or another
    /// call's): `false` from it ends the wait CANCELLED. A binding's way to let a signal end
    /// such a wait (Python's Ctrl-C, which the binding raises then; `interruptible` is true on
    /// the main thread inside a call that raises what the interrupt leaves); waits for a reply
    /// take a check of their own ([`unary_checked`](Self::unary_checked)). Set once: later
    /// ones are ignored.
    pub fn set_interrupt(&self, interrupt: Interrupt, interruptible: Interrupt) {
        let _ = self.inner.interrupt.set(interrupt);
        let _ = self.inner.interruptible.set(interruptible);
    }

    /// Sleeps `pause` between two attempts to connect, looking at the channel's
    /// [`Interrupt`] every [`INTERRUPT_EVERY`].
    fn pause(&self, pause: Duration) -> Result<(), Status> {
        let Some(interrupt) = self.inner.interrupt.get() else {
            std::thread::sleep(pause);
            return Ok(());
        };
        let until = Instant::now() + pause;
        loop {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(());
            }
            std::thread::sleep(left.min(INTERRUPT_EVERY));
            if !interrupt() {
                return Err(Status::new(Code::Cancelled, "the wait for a server was interrupted"));
            }
        }
    }

    /// A lazy channel to the `shm://` endpoint an HTTP/2 channel was upgraded to
    /// ([`crate::Channel::route_for_binding`]): it refuses any server but that process.
    pub fn lazy_upgraded(upgrade: &crate::UpgradedTo, config: Config) -> Result<Channel, Status> {
        let mut slot = Slot::new(&upgrade.target, config)?;
        slot.expect_pid = Some(upgrade.pid);
        Ok(Channel { inner: Arc::new(Inner::new(slot)) })
    }

    /// The live connection, connecting (again) if there is none.
    fn mux(&self, wait_for_ready: bool, deadline: Option<Instant>) -> Result<Arc<Mux>, Status> {
        if let Some(m) = self.inner.slot.live() {
            return Ok(m);
        }
        self.inner.slot.closed()?;
        let mut reconnect = Reconnect::new();
        loop {
            reconnect.too_late(deadline)?;
            let failed = {
                // One attempt at a time, not the pause after it: a thread waiting for a server
                // holds up no other, and the interrupt (a Python signal handler, which may call
                // on this channel, or fork) runs with nothing held; the lock is this process's,
                // looked up for each attempt. Another call's handshake is waited for within
                // this call's deadline.
                let one_at_a_time = self.inner.connect_lock(deadline).map_err(|s| reconnect.passed(s))?;
                if let Some(m) = self.inner.slot.live() {
                    return Ok(m);
                }
                self.inner.slot.closed()?;
                match self.inner.attempt(one_at_a_time, deadline) {
                    Ok(mux) => return Ok(mux),
                    // The deadline came during an attempt after an earlier one failed: the call
                    // says why it never started, as the async client's does.
                    Err(status) => reconnect.passed(status),
                }
            };
            self.pause(reconnect.after(failed, wait_for_ready, deadline)?)?;
        }
    }

    /// The live connection for a call starting now: after a pause, one whose peer has gone is
    /// found out here (see [`STALE_TICKS`]) and replaced.
    fn mux_for_call(&self, wait_for_ready: bool, deadline: Option<Instant>) -> Result<Arc<Mux>, Status> {
        self.check_if_stale();
        self.mux(wait_for_ready, deadline)
    }

    /// [`check_alive`](Self::check_alive) if no call started in the last [`STALE_TICKS`].
    fn check_if_stale(&self) {
        let now = isthmus_shm::ticks();
        // A load and a store, not a swap: threads racing here at worst both check, or neither
        // for a call that came right after another anyway. Another thread may have stored a
        // later count just before: only a gap that large either way is a pause.
        let last = self.inner.last_start.load(Ordering::Relaxed);
        self.inner.last_start.store(now, Ordering::Relaxed);
        if now.abs_diff(last) >= STALE_TICKS {
            self.check_alive();
        }
    }

    /// Looks at the newest connection's socket now (one non-blocking system call); a
    /// connection whose peer has gone is given up, and every call on it fails UNAVAILABLE. One
    /// found dead (here, or by a call that read it) no longer holds the channel READY.
    fn check_alive(&self) {
        let Ok(mut held) = self.inner.live.lock() else { return };
        let Some((mux, _)) = held.as_ref() else { return };
        if mux.dead().is_none() {
            match mux.sender.check_alive() {
                Ok(()) => return,
                Err(e) => mux.fail_all(Status::from_transport(&e)),
            }
        }
        // Its `Live` ends here: IDLE, unless a newer connection came up.
        drop(held.take());
    }

    /// Whether a connection is up now (a call would not have to connect first). After a pause
    /// of a millisecond or more this looks at its socket, so a server that went away is not
    /// taken for one.
    pub fn is_connected(&self) -> bool {
        self.check_if_stale();
        self.inner.slot.live().is_some()
    }

    /// The channel's connectivity state, gRPC's ([`crate::connectivity`]): the socket of the
    /// current connection is looked at now. With `try_to_connect`, an IDLE or failed channel
    /// connects on this thread (blocking for the handshake).
    pub fn connectivity(&self, try_to_connect: bool) -> Connectivity {
        self.check_alive();
        let state = self.inner.connectivity.get();
        if try_to_connect && matches!(state, Connectivity::Idle | Connectivity::TransientFailure) {
            let _ = self.connect_now();
        }
        state
    }

    /// Connects now if no connection is up (a call connects on its own otherwise).
    pub fn connect_now(&self) -> Result<(), Status> {
        self.mux(false, None).map(drop)
    }

    /// [`connect_now`](Self::connect_now) by `deadline` (DEADLINE_EXCEEDED past it), for a
    /// binding that connects for a call before it makes it.
    pub fn connect_by(&self, deadline: Option<Instant>) -> Result<(), Status> {
        self.mux(false, deadline).map(drop)
    }

    /// Starts a call of any shape: send messages, half-close, read responses.
    pub fn start(&self, path: &str, options: CallOptions) -> Result<Call, Status> {
        let mut call = self.start_by(path, &options, None).map_err(|e| e.unwrap_or_else(no_room))?;
        call.state.keep_channel(self.inner.clone());
        Ok(call)
    }

    /// [`start`](Self::start), waiting for ring room only until `patience` (if sooner than the
    /// deadline): `Err(None)` if it passed.
    fn start_by(&self, path: &str, options: &CallOptions, patience: Option<Instant>) -> Result<Call, Option<Status>> {
        check_start(path, options)?;
        let deadline = options.timeout.and_then(crate::call::deadline_in);
        self.start_with(None, path, options, deadline, patience, None, None).map(|(call, _)| call)
    }

    /// [`start_by`](Self::start_by) with the call's deadline already set (a unary call sets it
    /// before it stages its request, and keeps it), sending `first`, the call's only request,
    /// inside its HEADERS when it can (a one-frame call, `request_in_head`); whether it did.
    /// `live` is the connection the caller just took for it, if it did; `slice` bounds a wait
    /// for ring room for the head as [`open`](Self::open) says.
    #[allow(clippy::too_many_arguments)] // open's, and the connection to open it on
    fn start_with(
        &self,
        mut live: Option<Arc<Mux>>,
        path: &str,
        options: &CallOptions,
        deadline: Option<Instant>,
        patience: Option<Instant>,
        slice: Option<Duration>,
        first: Option<&[u8]>,
    ) -> Result<(Call, bool), Option<Status>> {
        let mut again = true;
        loop {
            let mux = match live.take() {
                Some(mux) => mux,
                None => self.mux_for_call(options.wait_for_ready, deadline)?,
            };
            // The connection moves into the call: a reference taken and dropped per call was on
            // its way out.
            match self.open(mux, path, options, deadline, patience, slice, first) {
                Ok(opened) => return Ok(opened),
                // As the async client's `start`: a call whose connection died before its HEADERS
                // went out never reached the server, and starts once more on a new connection.
                Err((Some(_), true)) if again => again = false,
                Err((status, _)) => return Err(status),
            }
        }
    }

    /// Opens a call on `mux`: its HEADERS sent (with `first` inside if it fits), waiting for
    /// ring room until the deadline or `patience`, and with `slice` for no longer than that from
    /// when the wait begins. Past `patience` or `slice` the call is forgotten, with no trace
    /// (`Err(None)`): nothing went out, so the caller may start afresh. A call whose head could
    /// not go for another reason ends here with it, and no CANCEL goes either; the error says
    /// too whether `mux` has stopped taking calls (its end, or a close).
    #[allow(clippy::too_many_arguments)] // a call's start, its bounds, and what it carries
    fn open(
        &self,
        mux: Arc<Mux>,
        path: &str,
        options: &CallOptions,
        deadline: Option<Instant>,
        patience: Option<Instant>,
        slice: Option<Duration>,
        first: Option<&[u8]>,
    ) -> Result<(Call, bool), (Option<Status>, bool)> {
        let stream = match mux.register(self.inner.slot.next_stream()) {
            Ok(stream) => stream,
            Err(status) => return Err((Some(status), !mux.takes_calls())),
        };
        // The channel is kept by the calls handed to the caller (`start`, `PendingUnary`) only.
        let mut call = Call { state: CallState::new(stream, mux, path, None), deadline };
        let head = open_head(path, &options.metadata, deadline, self.inner.slot.agent());
        let by = sooner(deadline, patience);
        let first = first.filter(|m| request_in_head(&call.state, &head, m));
        let (f, body) = head_frame(&head, first);
        let (sender, id) = (&call.state.mux.sender, call.state.id());
        let sent = match slice {
            None => sender.send_parts(Kind::Headers, f, id, &body, by),
            // The clock is read only for a head that must wait: most find room at once.
            Some(slice) => match sender.try_send_parts(Kind::Headers, f, id, &body) {
                Ok(true) => Ok(()),
                Ok(false) => {
                    sender.send_parts(Kind::Headers, f, id, &body, sooner(by, Instant::now().checked_add(slice)))
                }
                Err(e) => Err(e),
            },
        };
        match sent {
            Ok(()) => {
                count_inside(&call.state, first);
                Ok((call, first.is_some()))
            }
            Err(e) if impatient(&e, deadline) => {
                call.state.forget_unsent();
                Err((None, !call.state.mux.takes_calls()))
            }
            Err(e) => {
                let status = Status::from_transport(&e);
                call.state.end(status.clone());
                Err((Some(status), !call.state.mux.takes_calls()))
            }
        }
    }

    /// A unary call: one request, one response.
    pub fn unary(&self, path: &str, request: &[u8], options: CallOptions) -> Result<Response, Status> {
        // No `PendingUnary` (which owns a copy of the path, for its errors): waited for here.
        let (mut call, _) = self.begin(path, request, &options, None)?.ok_or_else(no_room)?;
        unary_wait(&mut call, &mut None, path)
    }

    /// [`unary`](Self::unary) for a caller that has something else to look at while it waits
    /// (a Python thread its signal handlers, as grpcio's waits do): `check` runs each time
    /// `every` passes with the call still running, or still waiting for ring room for its head
    /// (with the request inside, when it fits), or for arena room for a request sent as one
    /// block (up to half the arena). Nothing has gone out before that room is there, so those
    /// waits are taken in slices and leave no trace (a call forgotten, a block kept for the
    /// next slice). An `Err` from `check` cancels a call that went out (the server sees
    /// CANCELLED) and is returned; the call's own outcome is the `Ok`. Not sliced: a wait for
    /// ring room for a request that follows its head, and for arena room for a larger
    /// request's pieces.
    pub fn unary_checked<E>(
        &self,
        path: &str,
        request: &[u8],
        options: CallOptions,
        every: Duration,
        mut check: impl FnMut() -> Result<(), E>,
    ) -> Result<Result<Response, Status>, E> {
        if let Err(status) = check_start(path, &options) {
            return Ok(Err(status));
        }
        let deadline = options.timeout.and_then(crate::call::deadline_in);
        // A request staged in an arena block whose head found no ring room: sent with the
        // next slice's head, not copied again.
        let mut staged = None;
        let (mut call, _) = loop {
            match self.begin_by(path, request, &options, deadline, Room::Slice(every), None, &mut staged) {
                Ok(Some(begun)) => break begun,
                Ok(None) => check()?, // no ring or arena room yet: nothing went out
                Err(status) => return Ok(Err(status)),
            }
        };
        unary_wait_checked(&mut call, &mut None, path, every, check)
    }

    /// A unary call whose request is sent and whose response is waited for later, on this
    /// thread or another: [`PendingUnary::wait_until`] gives up at a time of the caller's
    /// choosing and leaves the call running. An event loop waits a moment for a fast reply and
    /// hands a slow one to a thread of its own.
    pub fn unary_begin(&self, path: &str, request: &[u8], options: CallOptions) -> Result<PendingUnary, Status> {
        let (call, sent) = self.begin(path, request, &options, None)?.ok_or_else(no_room)?;
        Ok(PendingUnary::new(call, path, sent, self.inner.clone()))
    }

    /// For a request that travels as one block of the arena: that block, filled, from the
    /// connection a call would take now, to send right after the call's HEADERS. Copied first,
    /// the request reaches the server with its HEADERS, and the handler finds it at its first
    /// look; copied after, a handler the server runs inline (Go's, C's) found it missing and
    /// waited for it through a queue and a wake-up: a Go echo of 64 KiB took 90 µs that way,
    /// and 15 µs through the raw tier, which fills its block first. `room` bounds the wait
    /// for arena room (`Staged::NoRoom` past it).
    fn stage(
        &self,
        request: &[u8],
        options: &CallOptions,
        deadline: Option<Instant>,
        room: Room,
    ) -> Result<Staged, Status> {
        let mux = self.mux_for_call(options.wait_for_ready, deadline)?;
        if !mux.sender.sends_as_block(request.len()) {
            return Ok(Staged::Usual(Some(mux)));
        }
        // Read the clock only for a request that may wait for room: most calls' are inline.
        let patience = match room {
            Room::Until(until) => until,
            Room::Slice(slice) => Instant::now().checked_add(slice),
        };
        match mux.sender.alloc(request.len(), sooner(deadline, patience)) {
            Ok(mut block) => {
                isthmus_shm::copy_into_shared(&mut block, request);
                Ok(Staged::Ready(mux, block))
            }
            Err(e) if patience.is_some() && impatient(&e, deadline) => Ok(Staged::NoRoom),
            // The connection died under it: the usual way starts the call on a new one.
            Err(_) if !mux.takes_calls() => Ok(Staged::Usual(None)),
            Err(e) => Err(Status::from_transport(&e)),
        }
    }

    /// [`unary_begin`](Self::unary_begin) for a thread that must not wait long for room (an
    /// event loop's): `Ok(None)` if the ring or the arena had no room for the request within
    /// `patience` (the server is behind, or has stopped reading). A call whose head went out is
    /// then cancelled (its handler, if it started, sees CANCELLED and never the request); one
    /// whose head did not leaves no trace (not counted, no CANCEL). The caller sends the
    /// request another way, where waiting costs it nothing. The patience
    /// bounds waits for room only: connecting, if no connection is up, is not bounded by it.
    pub fn unary_begin_within(
        &self,
        path: &str,
        request: &[u8],
        options: &CallOptions,
        patience: Duration,
    ) -> Result<Option<PendingUnary>, Status> {
        let begun = self.begin(path, request, options, Some(Instant::now() + patience))?;
        Ok(begun.map(|(call, sent)| PendingUnary::new(call, path, sent, self.inner.clone())))
    }

    /// [`unary_begin`](Self::unary_begin), or with `patience`
    /// [`unary_begin_within`](Self::unary_begin_within): the call and its request's size, or
    /// `None` only if the patience passed.
    fn begin(
        &self,
        path: &str,
        request: &[u8],
        options: &CallOptions,
        patience: Option<Instant>,
    ) -> Result<Option<(Call, usize)>, Status> {
        check_start(path, options)?;
        let deadline = options.timeout.and_then(crate::call::deadline_in);
        self.begin_by(path, request, options, deadline, Room::Until(patience), patience, &mut None)
    }

    /// [`begin`](Self::begin) with its deadline worked out, and a patience of its own for the
    /// arena room a request sent as one block waits for (`room`, with `None` past it before
    /// anything is sent), apart from the patience for the rest (`patience`). A `Room::Slice`
    /// bounds the wait for ring room for the head too; a block staged for a head that found
    /// none within the slice is left in `staged`, for the next call of this to send.
    #[allow(clippy::too_many_arguments)] // begin's, with how it waits and what it kept
    fn begin_by(
        &self,
        path: &str,
        request: &[u8],
        options: &CallOptions,
        deadline: Option<Instant>,
        room: Room,
        patience: Option<Instant>,
        staged: &mut Option<(Arc<Mux>, BlockMut)>,
    ) -> Result<Option<(Call, usize)>, Status> {
        let slice = match room {
            Room::Slice(slice) => Some(slice),
            Room::Until(_) => None,
        };
        let staging = match staged.take() {
            Some((mux, block)) => Staged::Ready(mux, block),
            None => self.stage(request, options, deadline, room)?,
        };
        let live = match staging {
            Staged::Usual(live) => live,
            Staged::NoRoom => return Ok(None),
            Staged::Ready(mux, block) => match self.open(mux.clone(), path, options, deadline, patience, slice, None) {
                Ok((call, _)) => return send_last(call, Body::Block(block), patience),
                Err((None, _)) => {
                    if slice.is_some() {
                        *staged = Some((mux, block));
                    }
                    return Ok(None);
                }
                // Its HEADERS never went out: as `start_by`, once more on a new connection.
                Err((Some(_), true)) => None,
                Err((Some(status), false)) => return Err(status),
            },
        };
        let call = match self.start_with(live, path, options, deadline, patience, slice, Some(request)) {
            Ok((call, true)) => return Ok(Some((call, request.len()))),
            Ok((call, false)) => call,
            Err(None) => return Ok(None),
            Err(Some(status)) => return Err(status),
        };
        send_last(call, Body::Bytes(request), patience)
    }

    /// A writable block of `len` bytes in this side's shared memory, for a request built in
    /// place and sent with [`unary_block`](Self::unary_block) (connecting first if need be).
    /// Waits up to `timeout` for arena room. The block belongs to the current connection: if
    /// that connection ends before the block is sent, sending it fails UNAVAILABLE.
    pub fn alloc(&self, len: usize, timeout: Option<Duration>) -> Result<BlockMut, Status> {
        self.alloc_for(len, &CallOptions { timeout, ..CallOptions::default() })
    }

    /// [`alloc`](Self::alloc) for the request of a call with these options: within its
    /// timeout, and with `wait_for_ready` waiting for a server to connect to as the call would.
    pub fn alloc_for(&self, len: usize, options: &CallOptions) -> Result<BlockMut, Status> {
        let deadline = options.timeout.and_then(crate::call::deadline_in);
        let mux = self.mux(options.wait_for_ready, deadline)?;
        mux.sender.alloc(len, deadline).map_err(|e| Status::from_transport(&e))
    }

    /// A unary call whose request is a block from [`alloc`](Self::alloc), sent where it is.
    pub fn unary_block(&self, path: &str, request: BlockMut, options: CallOptions) -> Result<Response, Status> {
        self.unary_block_begin(path, request, options)?.wait()
    }

    /// Whether `block` can be sent on this channel now: it came from the channel's connection,
    /// which is still the one calls take (a block lives and dies with its connection).
    pub fn can_send(&self, block: &BlockMut) -> bool {
        self.inner.slot.live().is_some_and(|mux| block.is_from(&mux.sender))
    }

    /// [`unary_begin`](Self::unary_begin) with a block from [`alloc`](Self::alloc) as the
    /// request, sent where it is.
    pub fn unary_block_begin(
        &self,
        path: &str,
        request: BlockMut,
        options: CallOptions,
    ) -> Result<PendingUnary, Status> {
        // Checked before anything is sent, and never by connecting: a block lives and dies
        // with the connection it came from.
        if !self.can_send(&request) {
            return Err(Status::new(
                Code::Unavailable,
                "the connection the block was allocated from is gone (or the block is another channel's)",
            ));
        }
        let len = request.len();
        let mut call = self.start(path, options)?;
        call.send_block(request, true)?;
        Ok(PendingUnary::new(call, path, len, self.inner.clone()))
    }

    /// Counters of the current connection (zero if there is none yet).
    pub fn counters(&self) -> ConnectionCounters {
        self.inner.slot.counters()
    }

    /// Closes the channel: its connection ends now, its calls in progress fail with `status`
    /// (CANCELLED for OK), and later calls fail UNAVAILABLE (no connection is made again).
    pub fn close(&self, status: Status) {
        self.inner.slot.close(Status::closing(status));
        self.inner.connectivity.shutdown();
        if let Ok(mut held) = self.inner.live.lock() {
            held.take();
        }
    }
}

/// One blocking call in progress. Dropping it before the server has finished cancels it.
/// Request messages are flow-controlled as in [`crate::ClientCall`].
pub struct Call {
    state: CallState,
    deadline: Option<Instant>,
}

impl std::fmt::Debug for Call {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("blocking::Call").field("stream", &self.state.id()).field("over", &self.state.is_over()).finish()
    }
}

/// A unary request: bytes to copy, or a block already filled.
enum Body<'a> {
    Bytes(&'a [u8]),
    Block(BlockMut),
}

/// The end of [`Channel::begin`]: sends `call`'s request with END_STREAM; `None` (the call
/// cancelled) if the ring or the arena had no room for it by `patience`.
fn send_last(mut call: Call, body: Body<'_>, patience: Option<Instant>) -> Result<Option<(Call, usize)>, Status> {
    let len = match &body {
        Body::Bytes(b) => b.len(),
        Body::Block(b) => b.len(),
    };
    if !call.credit(len)? {
        return Ok(Some((call, len)));
    }
    let (sender, id, until) = (&call.state.mux.sender, call.state.id(), sooner(call.deadline, patience));
    let sent = match body {
        Body::Bytes(b) => sender.send_message(id, flags::END_STREAM, b, until),
        Body::Block(b) => sender.send_block(id, flags::END_STREAM, b, until),
    };
    match sent {
        Ok(()) => Ok(Some((call, len))),
        Err(e) if patience.is_some() && impatient(&e, call.deadline) => {
            drop(call); // cancels it, without waiting for room for the CANCEL
            Ok(None)
        }
        Err(e) => Err(call.failed(e)),
    }
}

/// A unary call's outcome if it ends by `until`, `None` if it is still running then; `message`
/// keeps the response between looks.
fn unary_outcome(
    call: &mut Call,
    message: &mut Option<Bytes>,
    path: &str,
    until: Instant,
) -> Option<Result<Response, Status>> {
    loop {
        let received = match call.recv_until(until)? {
            Ok(m) => m,
            Err(status) => return Some(Err(status)),
        };
        match (received, message.is_some()) {
            (Some(m), false) => *message = Some(m),
            (Some(_), true) => {
                let what = format!("{path}: the server sent more than one response");
                return Some(Err(Status::new(Code::Internal, what)));
            }
            (None, true) => return Some(Ok(call.state.take_response(message.take().unwrap_or_default()))),
            (None, false) => {
                let what = format!("{path}: the server ended the call without a response");
                return Some(Err(Status::new(Code::Internal, what)));
            }
        }
    }
}

/// [`unary_outcome`], waiting as long as the call's deadline allows.
fn unary_wait(call: &mut Call, message: &mut Option<Bytes>, path: &str) -> Result<Response, Status> {
    loop {
        let until = call.deadline.unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
        if let Some(outcome) = unary_outcome(call, message, path, until) {
            return outcome;
        }
    }
}

/// [`unary_wait`] with `check` run each time `every` passes ([`Channel::unary_checked`]).
fn unary_wait_checked<E>(
    call: &mut Call,
    message: &mut Option<Bytes>,
    path: &str,
    every: Duration,
    mut check: impl FnMut() -> Result<(), E>,
) -> Result<Result<Response, Status>, E> {
    loop {
        // Past the deadline `unary_outcome` ends the call itself: `until` needs no bound by it.
        if let Some(outcome) = unary_outcome(call, message, path, Instant::now() + every) {
            return Ok(outcome);
        }
        if let Err(e) = check() {
            call.state.cancel_blocking(Code::Cancelled, "the call was cancelled", CANCEL_PATIENCE);
            return Err(e);
        }
    }
}

/// How long [`Channel::stage`] waits for arena room for a request sent as one block.
#[derive(Clone, Copy)]
enum Room {
    /// Until then (`None`: the deadline alone bounds it).
    Until(Option<Instant>),
    /// This long from when it starts to wait (a slice of a wait that looks at something
    /// between slices).
    Slice(Duration),
}

/// What [`Channel::stage`] made of a request.
enum Staged {
    /// Sent the usual way, with or after the HEADERS: inline in the ring, or in pieces; on this
    /// connection if there is one (taken already, so the call need not look again).
    Usual(Option<Arc<Mux>>),
    /// One block of the arena, filled, on this connection.
    Ready(Arc<Mux>, BlockMut),
    /// A block, but no arena room for it within the caller's patience.
    NoRoom,
}

/// The sooner of two times, either of which may be missing.
fn sooner(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// A send that timed out before the call's deadline: it ran out of a caller's patience.
fn impatient(e: &isthmus_shm::Error, deadline: Option<Instant>) -> bool {
    e.kind() == isthmus_shm::ErrorKind::Timeout && deadline.is_none_or(|d| Instant::now() < d)
}

/// [`Channel::start`] never asks for patience, so never meets its end; if it did, this is it.
fn no_room() -> Status {
    Status::new(Code::ResourceExhausted, "no room in the connection for the call's head")
}

/// How long a CANCEL may wait for ring room once a call is given up.
const CANCEL_PATIENCE: Duration = Duration::from_millis(100);

impl Call {
    /// Ends the call at its deadline. The status keeps the initial metadata that came before
    /// it, as every other failure's does (grpcio's `RpcError.initial_metadata()`); it had none.
    fn expire(&mut self) -> Status {
        self.state.cancel_blocking(Code::DeadlineExceeded, DEADLINE_EXCEEDED, CANCEL_PATIENCE);
        Status::deadline_exceeded().after_headers(self.state.headers())
    }

    /// A transport failure while sending, past the deadline if it was a timeout.
    fn failed(&mut self, e: isthmus_shm::Error) -> Status {
        if e.kind() == isthmus_shm::ErrorKind::Timeout && self.deadline.is_some_and(|d| Instant::now() >= d) {
            return self.expire();
        }
        Status::from_transport(&e)
    }

    /// Waits for credit to send `len` bytes; `Ok(false)` if the call is over and the message
    /// must be dropped.
    fn credit(&mut self, len: usize) -> Result<bool, Status> {
        if self.state.is_over() {
            return Err(self.state.ended_error());
        }
        let shared = self.state.stream.shared.clone();
        let window = &shared.send_window;
        let charge = flow::charge(len);
        loop {
            match window.try_take(charge) {
                Credit::Taken => return Ok(true),
                Credit::Closed => return self.state.after_close().map(|()| false),
                Credit::Wait => {
                    if !self.state.mux.wait(self.deadline, || window.ready()) {
                        return Err(self.expire());
                    }
                }
            }
        }
    }

    fn send_flags(&mut self, message: &[u8], frame_flags: u8) -> Result<(), Status> {
        if !self.credit(message.len())? {
            return Ok(());
        }
        let out = Outgoing {
            id: self.state.id(),
            shared: &self.state.stream.shared,
            flags: frame_flags,
            deadline: self.deadline,
        };
        let sent = self.state.mux.send_message_blocking(out, message);
        sent.map_err(|e| self.failed(e))
    }

    /// Sends one request message.
    pub fn send(&mut self, message: &[u8]) -> Result<(), Status> {
        self.send_flags(message, 0)
    }

    /// Sends the last request message and half-closes in the same frame.
    pub fn send_last(&mut self, message: &[u8]) -> Result<(), Status> {
        self.send_flags(message, flags::END_STREAM)
    }

    /// A writable block of `len` bytes in this side's shared memory, for a message built in
    /// place; see [`crate::ClientCall::alloc`].
    pub fn alloc(&mut self, len: usize) -> Result<BlockMut, Status> {
        let block = self.state.mux.sender.alloc(len, self.deadline);
        block.map_err(|e| self.failed(e))
    }

    /// Sends a block from [`alloc`](Self::alloc) as one request message, as it is; `last`
    /// half-closes with it.
    pub fn send_block(&mut self, block: BlockMut, last: bool) -> Result<(), Status> {
        // Refused before it takes credit it would never give back (the call stalled for good
        // once refused blocks had taken its window).
        if !self.state.mux.sender.owns(&block) {
            return Err(super::client::foreign_block());
        }
        if !self.credit(block.len())? {
            return Ok(());
        }
        let f = if last { flags::END_STREAM } else { 0 };
        let sent = self.state.mux.sender.send_block(self.state.id(), f, block, self.deadline);
        sent.map_err(|e| self.failed(e))
    }

    /// Half-closes: no more request messages.
    pub fn close_send(&mut self) -> Result<(), Status> {
        if self.state.is_over() {
            return Ok(());
        }
        let sent = self.state.mux.sender.send(Kind::Trailers, flags::END_STREAM, self.state.id(), &[], self.deadline);
        sent.map_err(|e| self.failed(e))
    }

    /// The next event, read from the connection on this thread if no other thread is reading.
    fn next(&mut self) -> Result<Next, Status> {
        self.next_until(None).map(|next| next.unwrap_or(Next::More))
    }

    /// [`next`](Self::next), but `Ok(None)` once `until` (if it comes before the deadline)
    /// passes with no event; the call goes on.
    fn next_until(&mut self, until: Option<Instant>) -> Result<Option<Next>, Status> {
        self.state.settle();
        loop {
            if let Some(ev) = self.state.try_event() {
                return Ok(Some(self.state.absorb(ev)));
            }
            let limit = match (until, self.deadline) {
                (Some(u), Some(d)) => Some(u.min(d)),
                (u, d) => u.or(d),
            };
            let state = &self.state;
            if !state.mux.wait(limit, || state.has_event()) {
                if until.is_some() && self.deadline.is_none_or(|d| Instant::now() < d) {
                    return Ok(None);
                }
                return Err(self.expire());
            }
        }
    }

    /// [`recv`](Self::recv), but `None` if nothing came by `until` (when that is before the
    /// call's deadline): the call goes on, and a later `recv` picks up where this left off.
    pub fn recv_until(&mut self, until: Instant) -> Option<Result<Option<Bytes>, Status>> {
        if let Some(r) = self.state.ready_result() {
            return Some(r);
        }
        loop {
            match self.next_until(Some(until)) {
                Err(status) => return Some(Err(status)),
                Ok(None) => return None,
                Ok(Some(Next::More)) => {}
                Ok(Some(Next::Ended(r))) => return Some(r),
                Ok(Some(Next::Message(m))) => return Some(Ok(Some(m))),
            }
        }
    }

    /// The next response message; `Ok(None)` once the server ended the call with OK (its
    /// trailers are then in [`trailers`](Self::trailers)); the server's status otherwise.
    /// A large message is a view into the server's shared memory, not a copy.
    pub fn recv(&mut self) -> Result<Option<Bytes>, Status> {
        if let Some(r) = self.state.ready_result() {
            return r;
        }
        loop {
            match self.next()? {
                Next::More => {}
                Next::Ended(r) => return r,
                Next::Message(m) => return Ok(Some(m)),
            }
        }
    }

    /// The server's initial metadata, waiting for it if needed.
    pub fn headers(&mut self) -> Result<crate::MetadataMap, Status> {
        while self.state.headers().is_none() && !self.state.is_over() {
            match self.next()? {
                Next::More => {}
                Next::Message(m) => self.state.park(m),
                Next::Ended(Err(status)) => return Err(status),
                Next::Ended(Ok(_)) => {}
            }
        }
        Ok(self.state.headers().cloned().unwrap_or_default())
    }

    /// The server's trailing metadata, once the call has ended with OK.
    pub fn trailers(&self) -> Option<&crate::MetadataMap> {
        self.state.trailers()
    }

    /// The message of the OK status the call ended with, once it has (nearly always empty).
    pub fn status_message(&self) -> Option<&str> {
        self.state.status_message()
    }

    /// Cancels the call: the server sees CANCELLED and stops its handler.
    pub fn cancel(mut self) {
        self.state.cancel_blocking(Code::Cancelled, "the call was cancelled", CANCEL_PATIENCE);
    }
}

/// The most [`PendingUnary::spin_for`] adds: the caller's thread may be an event loop's (an
/// nginx worker's), which serves nobody while it waits; 50 µs covers a 200 KB request, and past
/// that the work dwarfs the hand-off's wake-ups.
const CALLER_SPIN_EXTRA_MAX: Duration = Duration::from_micros(50);

/// A unary call in progress (see [`Channel::unary_begin`]). Dropping it cancels the call.
#[derive(Debug)]
pub struct PendingUnary {
    call: Call,
    path: String,
    /// The response, once it came (the call's end is still to come).
    message: Option<Bytes>,
    /// The request's size.
    sent: usize,
}

impl PendingUnary {
    /// `channel` stays open while the call lives.
    fn new(mut call: Call, path: &str, sent: usize, channel: Arc<Inner>) -> PendingUnary {
        call.state.keep_channel(channel);
        PendingUnary { call, path: path.to_owned(), message: None, sent }
    }

    /// How long a caller that would wait `spin` for the reply to a small request should wait
    /// for this one's: longer by the time the server plausibly takes to read the request
    /// ([`SpinPolicy::owing`](isthmus_shm::SpinPolicy::owing), ADR 0014), since a reply that
    /// comes after the wait gave up costs a hand-off and a wake-up.
    pub fn spin_for(&self, spin: Duration) -> Duration {
        let policy = isthmus_shm::SpinPolicy { max: spin, yield_after: Duration::ZERO };
        policy.owing(self.sent as u64).max.min(spin.saturating_add(CALLER_SPIN_EXTRA_MAX))
    }

    /// The call's outcome if it ends by `until`; `None` if it is still running then.
    pub fn wait_until(&mut self, until: Instant) -> Option<Result<Response, Status>> {
        unary_outcome(&mut self.call, &mut self.message, &self.path, until)
    }

    /// Waits for the call's outcome (bounded by its deadline).
    pub fn wait(mut self) -> Result<Response, Status> {
        unary_wait(&mut self.call, &mut self.message, &self.path)
    }

    /// [`wait`](Self::wait) with `check` run each time `every` passes, as
    /// [`Channel::unary_checked`]'s.
    pub fn wait_checked<E>(
        mut self,
        every: Duration,
        check: impl FnMut() -> Result<(), E>,
    ) -> Result<Result<Response, Status>, E> {
        unary_wait_checked(&mut self.call, &mut self.message, &self.path, every, check)
    }

    /// Cancels the call: the server sees CANCELLED.
    pub fn cancel(self) {
        self.call.cancel();
    }
}
