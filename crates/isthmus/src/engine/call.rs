//! What the async and the blocking client calls over `shm://` share, so they cannot disagree on
//! what a call means: the channel's connection slot, and the state of one call as its events
//! arrive, with no waiting in it.
//!
//! `Slot` is a channel's connection: the target, the configuration, the current connection and the
//! stream-id counter, behind a connect lock. Clones of a channel share the slot, hence one
//! connection, one counter and one lock. Dropping the last clone closes the connection (and ends an
//! async channel's reader task). Ids start at 1, only grow, and are not reset by a reconnect.
//!
//! Reconnect: a call takes the current connection unless its `dead` status is set; otherwise it
//! takes the connect lock (so a burst of calls makes one connection), looks again, and connects
//! anew. A connection whose server died, restarted or sent GOAWAY is thus replaced by the next
//! call; the call that meets it just as it dies can still fail UNAVAILABLE. Without
//! `wait_for_ready` a failed connect fails the call with its status; with it, an UNAVAILABLE
//! connect is retried after a backoff (`Reconnect`) from 5 ms doubling to 500 ms, and if the next
//! try would come at or after the deadline the call fails DEADLINE_EXCEEDED ("no server became
//! ready before the deadline: …"); with no deadline it waits for ever.
//!
//! `open_head` builds the opening HEADERS with what is left of the deadline (at least 1 ns). The
//! deadline starts when the call starts, before any connect, so time spent waiting for a server
//! counts against it.
//!
//! `CallState` is one call as its events arrive: its `Stream`, the connection, messages read while
//! waiting for headers, the initial and trailing metadata, the final status and the call's span. It
//! takes events in without ever waiting (`try_event`, `absorb`); absorbing a message counts it for
//! flow control, and `settle` sends credit still owed. Each client supplies only how to wait
//! (`Inbox::poll_recv` with a timer, or `Mux::wait`) and how to send.

use std::sync::Arc;

use bytes::Bytes;
use isthmus_shm::{Address, Config, Connection};

use super::inbox::{Empty, Event};
use super::mux::{ConnectionCounters, Mux, Stream};
use super::wire;
use crate::call::Response;
use crate::metadata::MetadataMap;
use crate::status::{Code, Status};

/// Retrying a connect for `wait_for_ready`: waits that start at 5 ms and double up to 500 ms,
/// until the deadline. The last wait ends [`LAST_TRY`] before it, for one more attempt, and the
/// call ends at the deadline, as grpc's waiting calls do: it gave up when the next wait would
/// have passed the deadline, up to 500 ms early, missing a server that came up meanwhile.
pub(crate) struct Reconnect {
    backoff: std::time::Duration,
    /// The last attempt's failure, once there was one: what the call ends with at the deadline.
    failed: Option<Status>,
}

/// How long before the deadline the last attempt to connect starts: a handshake takes about
/// half a millisecond on the machines measured.
const LAST_TRY: std::time::Duration = std::time::Duration::from_millis(1);

impl Reconnect {
    pub(crate) fn new() -> Reconnect {
        Reconnect { backoff: std::time::Duration::from_millis(5), failed: None }
    }

    /// After a connect failed with `failed`: how long to wait before trying again, or the status
    /// the call ends with (the failure itself without `wait_for_ready` or if it is not
    /// UNAVAILABLE; DEADLINE_EXCEEDED once the deadline has passed).
    pub(crate) fn after(
        &mut self,
        failed: Status,
        wait_for_ready: bool,
        deadline: Option<std::time::Instant>,
    ) -> Result<std::time::Duration, Status> {
        if !wait_for_ready || failed.code() != Code::Unavailable {
            return Err(failed);
        }
        let backoff = self.backoff;
        self.backoff = (backoff * 2).min(std::time::Duration::from_millis(500));
        self.failed = Some(failed);
        self.too_late(deadline)?;
        let Some(left) = deadline.map(|d| d.saturating_duration_since(std::time::Instant::now())) else {
            return Ok(backoff);
        };
        // Short of the last try: wait for it. Past it (the last try failed): wait out the
        // deadline, after which the next attempt is not made (`too_late`).
        Ok(match left.checked_sub(LAST_TRY) {
            Some(before_last) if !before_last.is_zero() => backoff.min(before_last),
            _ => left,
        })
    }

    /// Before an attempt after a pause: DEADLINE_EXCEEDED, with the last failure, if the
    /// deadline has passed meanwhile.
    pub(crate) fn too_late(&self, deadline: Option<std::time::Instant>) -> Result<(), Status> {
        match &self.failed {
            Some(_) if deadline.is_some_and(|d| std::time::Instant::now() >= d) => Err(self.deadline_passed()),
            _ => Ok(()),
        }
    }

    /// `status`, unless it is the deadline's: then [`deadline_passed`](Self::deadline_passed)'s,
    /// which names the failure before it.
    pub(crate) fn passed(&self, status: Status) -> Status {
        match status.code() {
            Code::DeadlineExceeded => self.deadline_passed(),
            _ => status,
        }
    }

    /// DEADLINE_EXCEEDED for a call whose deadline passed while it connected: with the last
    /// failure, if an attempt failed before. Whichever wait saw the deadline first (the
    /// backoff's, or one on an attempt under way), the call says why it never started.
    pub(crate) fn deadline_passed(&self) -> Status {
        match &self.failed {
            Some(failed) => {
                Status::new(Code::DeadlineExceeded, format!("no server became ready before the deadline: {failed}"))
            }
            None => Status::deadline_exceeded(),
        }
    }
}

/// The HEADERS body that opens a call. Time spent waiting for a server is the call's: what is
/// left of the deadline travels (at least 1 ns).
/// `agent` is the channel's user agent ([`Slot::agent`]), if it has one.
pub(crate) fn open_head<'a>(
    path: &'a str,
    metadata: &MetadataMap,
    deadline: Option<std::time::Instant>,
    agent: Option<(&str, &'a [u8])>,
) -> wire::HeadParts<'a> {
    let timeout = deadline
        .map(|d| d.saturating_duration_since(std::time::Instant::now()).max(std::time::Duration::from_nanos(1)));
    wire::HeadParts::with_agent(path, timeout, metadata, agent)
}

/// Whether `request` travels inside the HEADERS `head` that opens `state`'s call, as a one-frame
/// call (protocol 13.9): the connection agreed to them, the two fit inline in the ring, and the
/// stream has credit for the request (a new one always has). If so, that credit is taken; the
/// caller then sends `head.parts_with(request)` with `END_STREAM | WITH_MESSAGE`, and counts the
/// request as sent once that frame went ([`count_inside`]).
pub(crate) fn request_in_head(state: &CallState, head: &wire::HeadParts<'_>, request: &[u8]) -> bool {
    state.mux.one_frame()
        && head.len() + request.len() <= state.mux.sender.inline_max()
        && state.stream.shared.send_window.try_take(super::flow::charge(request.len())) == super::flow::Credit::Taken
}

/// Counts `first`, a request that went inside its call's HEADERS, as message bytes sent: only
/// once they went, so that a head given up before it did leaves no count behind.
pub(crate) fn count_inside(state: &CallState, first: Option<&[u8]>) {
    if let Some(request) = first {
        state.mux.sender.count_sent_inside(request.len());
    }
}

/// The flags and body of the HEADERS that opens a call: `head`, with `first` inside it for a
/// one-frame call (what [`request_in_head`] let through).
pub(crate) fn head_frame<'a>(head: &'a wire::HeadParts<'_>, first: Option<&'a [u8]>) -> (u8, [&'a [u8]; 4]) {
    let flags = if first.is_some() { isthmus_shm::flags::END_STREAM | wire::WITH_MESSAGE } else { 0 };
    (flags, head.parts_with(first.unwrap_or_default()))
}

/// The lock that serialises a channel's reconnecting, held through each attempt to connect (by
/// a thread or task of its own when the attempt outlives the call that began it): one per
/// process. A child forked while a thread or task
/// of its parent held it would otherwise find it held for ever, since nothing of the parent's
/// runs there to let it go (ADR 0030): its calls waited for their deadline, or, on a blocking
/// channel, for ever.
pub(crate) struct ConnectLock<L> {
    current: std::sync::Mutex<(u64, Arc<L>)>,
}

impl<L: Default> Default for ConnectLock<L> {
    fn default() -> ConnectLock<L> {
        ConnectLock { current: std::sync::Mutex::new((isthmus_shm::forks(), Arc::default())) }
    }
}

impl<L: Default> ConnectLock<L> {
    /// This process's lock.
    pub(crate) fn get(&self) -> Arc<L> {
        let forks = isthmus_shm::forks();
        let mut current = self.current.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if current.0 != forks {
            *current = (forks, Arc::default());
        }
        current.1.clone()
    }
}

/// The blocking client's connect lock: a mutex whose wait a deadline bounds, so that a call
/// waiting for another call's handshake ends at its own deadline.
#[derive(Default)]
pub(crate) struct TimedLock {
    held: std::sync::Mutex<bool>,
    freed: std::sync::Condvar,
}

/// [`TimedLock`] held; dropping it frees it. It holds its lock, so it can move to the thread
/// that goes on with the work the lock guards.
pub(crate) struct TimedGuard(Arc<TimedLock>);

impl TimedLock {
    /// Takes the lock, waiting until `deadline` at most (`None`: as long as it takes); `None`
    /// if the deadline came first.
    pub(crate) fn lock_until(self: &Arc<Self>, deadline: Option<std::time::Instant>) -> Option<TimedGuard> {
        let mut held = self.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        while *held {
            held = match deadline {
                None => self.freed.wait(held).unwrap_or_else(std::sync::PoisonError::into_inner),
                Some(d) => {
                    let left = d.saturating_duration_since(std::time::Instant::now());
                    if left.is_zero() {
                        return None;
                    }
                    self.freed.wait_timeout(held, left).unwrap_or_else(std::sync::PoisonError::into_inner).0
                }
            };
        }
        *held = true;
        Some(TimedGuard(self.clone()))
    }
}

impl Drop for TimedGuard {
    fn drop(&mut self) {
        *self.0.held.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = false;
        self.0.freed.notify_one();
    }
}

/// One channel's connection slot, shared by its clones: the target, and the live connection
/// that calls use until it dies.
pub(crate) struct Slot {
    pub(crate) target: Address,
    pub(crate) config: Config,
    /// The server process this channel must reach (an upgrade from HTTP/2, ADR 0013).
    pub(crate) expect_pid: Option<u32>,
    current: std::sync::Mutex<Option<Arc<Mux>>>,
    next_stream: std::sync::atomic::AtomicU64,
    /// Closed by the channel's owner: no connection is made again.
    closed: std::sync::atomic::AtomicBool,
    /// The user agent every call names (gRPC's `user-agent`), once set, and its metadata
    /// block alone ([`wire::agent_block`]).
    agent: std::sync::OnceLock<(Box<str>, Box<[u8]>)>,
}

impl Slot {
    pub(crate) fn new(target: &str, config: Config) -> Result<Slot, Status> {
        let target: Address = target.parse().map_err(|e| Status::from_transport(&e))?;
        config.validate().map_err(|e| Status::from_transport(&e))?;
        Ok(Slot {
            target,
            config,
            expect_pid: None,
            current: std::sync::Mutex::new(None),
            next_stream: std::sync::atomic::AtomicU64::new(1),
            closed: std::sync::atomic::AtomicBool::new(false),
            agent: std::sync::OnceLock::new(),
        })
    }

    /// The user agent this channel's calls name, if it has one, and its metadata block.
    pub(crate) fn agent(&self) -> Option<(&str, &[u8])> {
        self.agent.get().map(|(agent, block)| (&**agent, &**block))
    }

    /// Names `agent` as the user agent of every call from now on: printable ASCII, at most
    /// 1 KiB, set once (INVALID_ARGUMENT otherwise).
    pub(crate) fn set_agent(&self, agent: &str) -> Result<(), Status> {
        crate::call::check_user_agent(agent)?;
        self.agent
            .set((agent.into(), wire::agent_block(agent)))
            .map_err(|_| Status::new(Code::InvalidArgument, "the channel's user agent is set already"))
    }

    /// A new connection to the target (blocking: the handshake reads with timeouts). With
    /// `expect_pid`, a server that is not that process is refused, whoever bound the address.
    /// The handshake waits until `deadline` at most, if that comes before the configured
    /// handshake timeout: DEADLINE_EXCEEDED past it. The channels give it no deadline sooner
    /// than the handshake timeout: a call with less time left than that waits for an attempt
    /// that goes on without it.
    pub(crate) fn connect(
        target: &Address,
        config: &Config,
        expect_pid: Option<u32>,
        deadline: Option<std::time::Instant>,
    ) -> Result<Connection, Status> {
        let left = deadline.map(|d| d.saturating_duration_since(std::time::Instant::now()));
        let bounded;
        let config = match left {
            Some(left) if left.is_zero() => return Err(Status::deadline_exceeded()),
            Some(left) if left < config.handshake_timeout => {
                bounded = Config { handshake_timeout: left, ..config.clone() };
                &bounded
            }
            _ => config,
        };
        // A server that does not answer the handshake in time is one not ready for calls: gRPC's
        // UNAVAILABLE (which `wait_for_ready` waits out), unless the call's deadline came first.
        let conn = Connection::connect(target, config).map_err(|e| match e.kind() {
            // In grpc-core's words, as every deadline of a call (code compares them).
            isthmus_shm::ErrorKind::Timeout if deadline.is_some_and(|d| std::time::Instant::now() >= d) => {
                Status::deadline_exceeded()
            }
            isthmus_shm::ErrorKind::Timeout => Status::new(
                Code::Unavailable,
                format!(
                    "cannot connect to {target}: no answer within the handshake timeout ({:?}): {e}",
                    config.handshake_timeout
                ),
            ),
            _ => Status::from_transport(&e),
        })?;
        if let Some(pid) = expect_pid {
            let peer = conn.sender.peer().pid;
            if u32::try_from(peer).ok() != Some(pid) {
                return Err(Status::new(
                    Code::Unavailable,
                    format!("{target} is served by process {peer}, not by the server ({pid}) that offered it"),
                ));
            }
        }
        Ok(conn)
    }

    /// Closes the connection, failing its calls with `status`, and makes no other: later calls
    /// fail with [`closed`](Self::closed)'s status.
    pub(crate) fn close(&self, status: Status) {
        self.closed.store(true, std::sync::atomic::Ordering::Release);
        let current = self.current.lock().ok().and_then(|mut c| c.take());
        if let Some(mux) = current {
            mux.end(status);
        }
    }

    /// `Err` once the channel is closed: the status new calls get.
    pub(crate) fn closed(&self) -> Result<(), Status> {
        match self.closed.load(std::sync::atomic::Ordering::Acquire) {
            true => Err(Status::new(Code::Unavailable, "the channel was closed")),
            false => Ok(()),
        }
    }

    /// The connection, if it is alive and takes new calls.
    pub(crate) fn live(&self) -> Option<Arc<Mux>> {
        let current = self.current.lock().ok()?;
        current.as_ref().filter(|m| m.takes_calls()).cloned()
    }

    /// Makes `mux` the channel's connection; `Err` (and `mux` closed) if the channel was closed
    /// meanwhile (its connect raced `close`).
    pub(crate) fn install(&self, mux: Arc<Mux>) -> Result<(), Status> {
        if let Ok(mut current) = self.current.lock() {
            if let Err(closed) = self.closed() {
                drop(current);
                mux.end(closed.clone());
                return Err(closed);
            }
            // Calls still open on the old connection (after a GOAWAY) keep it until they end.
            *current = Some(mux);
        }
        Ok(())
    }

    /// A stream id never used on this channel, on any of its connections.
    pub(crate) fn next_stream(&self) -> u64 {
        self.next_stream.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    pub(crate) fn counters(&self) -> ConnectionCounters {
        self.current.lock().ok().and_then(|c| c.as_ref().map(|m| m.counters())).unwrap_or_default()
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        // The last handle is gone: hang up, which also ends a reader task.
        if let Some(mux) = self.current.get_mut().ok().and_then(|m| m.take()) {
            mux.sender.close();
        }
    }
}

/// The state of one client call, fed with its events.
pub(crate) struct CallState {
    pub(crate) stream: Stream,
    pub(crate) mux: Arc<Mux>,
    pending: crate::engine::queue::Queue<Bytes>,
    headers: Option<MetadataMap>,
    trailers: Option<MetadataMap>,
    /// The final status once the call has ended (OK or not).
    ended: Option<Status>,
    span: tracing::Span,
    /// The channel's shared state: while a call lives, its channel's connection stays open even
    /// if every handle on the channel is gone (a response stream read after the client that
    /// made it was dropped, say).
    /// `None` for a call that cannot outlive its caller's handle on the channel (the blocking
    /// client's own unary calls): taking and dropping a reference was on every call's way.
    _channel: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

/// What `recv` gives: a message, `None` at the end of an OK call, or the failed call's status.
pub(crate) type Received = Result<Option<Bytes>, Status>;

/// What one event means for a caller of `recv`.
pub(crate) enum Next {
    /// Nothing a caller waits for yet; look again.
    More,
    /// A message for the application.
    Message(Bytes),
    /// The call ended: `Ok(None)` for OK, the status otherwise.
    Ended(Received),
}

impl CallState {
    pub(crate) fn new(
        stream: Stream,
        mux: Arc<Mux>,
        path: &str,
        channel: Option<Arc<dyn std::any::Any + Send + Sync>>,
    ) -> CallState {
        let span = tracing::debug_span!("isthmus.call", path, stream = stream.id, code = tracing::field::Empty);
        mux.calls.start();
        CallState {
            stream,
            mux,
            pending: crate::engine::queue::Queue::default(),
            headers: None,
            trailers: None,
            ended: None,
            span,
            _channel: channel,
        }
    }

    pub(crate) fn id(&self) -> u64 {
        self.stream.id
    }

    /// Keeps the channel's connection open while this call lives: for a call handed to its
    /// caller, who may drop every handle on the channel before the call ends.
    pub(crate) fn keep_channel(&mut self, channel: Arc<dyn std::any::Any + Send + Sync>) {
        self._channel = Some(channel);
    }

    pub(crate) fn is_over(&self) -> bool {
        self.ended.is_some()
    }

    /// Ends the call here with `status`, once; the connection forgets the stream.
    pub(crate) fn end(&mut self, status: Status) {
        self.end_here(status, true);
    }

    /// [`end`](Self::end); `listed`: the stream may still be in the connection's table. An end
    /// that came as an event is not: whoever queued it took the stream out first.
    fn end_here(&mut self, status: Status, listed: bool) {
        if self.ended.is_none() {
            self.mux.calls.finish(status.code());
            if listed {
                self.mux.unregister(self.stream.id);
            }
            self.span.record("code", tracing::field::debug(status.code()));
            tracing::debug!(parent: &self.span, code = ?status.code(), "call ended");
            if status.code() == Code::Ok {
                self.trailers = Some(status.metadata().clone());
            }
            // A failure keeps the initial metadata that came before it (what grpcio's
            // `RpcError.initial_metadata()` and grpc-go's `grpc.Header` give).
            self.ended = Some(status.after_headers(self.headers.as_ref()));
        }
    }

    /// Forgets a call whose HEADERS never went out, leaving no trace of it: its stream leaves
    /// the connection's table, it no longer counts as started, and no CANCEL goes, since the
    /// server never heard of it. A caller that gave up waiting for ring room for the head (a
    /// slice of a wait that looks at something between slices, or its patience) starts
    /// afresh later, or another way.
    pub(crate) fn forget_unsent(&mut self) {
        if self.ended.is_none() {
            self.mux.calls.unstart();
            self.mux.unregister(self.stream.id);
            self.ended = Some(Status::new(Code::Cancelled, "the call was never sent"));
        }
    }

    /// The result a finished call gives every later `recv`.
    fn outcome(&self) -> Received {
        match &self.ended {
            Some(s) if s.code() != Code::Ok => Err(s.clone()),
            _ => Ok(None),
        }
    }

    /// Whether an event is waiting (or the queue is closed): a blocking waiter is done.
    pub(crate) fn has_event(&self) -> bool {
        self.stream.shared.inbox.is_ready()
    }

    /// Takes the next event without waiting: `None` if there is none yet.
    pub(crate) fn try_event(&mut self) -> Option<Event> {
        match self.stream.shared.inbox.try_recv() {
            Ok(ev) => Some(ev),
            Err(Empty::Now) => None,
            Err(Empty::Closed) => Some(Event::End(self.connection_end())),
        }
    }

    /// Why the queue closed without an end: the connection's fate.
    pub(crate) fn connection_end(&self) -> Status {
        self.mux.dead().unwrap_or_else(|| Status::new(Code::Unavailable, "the connection closed"))
    }

    /// Takes in one event.
    pub(crate) fn absorb(&mut self, ev: Event) -> Next {
        match ev {
            Event::Headers(md) => {
                self.headers = Some(md);
                Next::More
            }
            // A server's END_STREAM on a message means nothing more than its TRAILERS will.
            Event::Message(m) | Event::Last(m) => {
                // A message with no HEADERS before it implies empty initial metadata.
                self.headers.get_or_insert_with(MetadataMap::new);
                // Taken off the connection's queue: counted for flow control now, even if it is
                // parked until the application asks for it (only `headers` parks, briefly).
                self.hand_out(&m);
                Next::Message(m)
            }
            Event::HalfClose => Next::More,
            Event::End(status) => {
                self.end_here(status, false);
                Next::Ended(self.outcome())
            }
            // The message now, the end at the next look (`ready_result`).
            Event::Final(m, status) => {
                self.headers.get_or_insert_with(MetadataMap::new);
                self.end_here(status, false);
                Next::Message(m)
            }
        }
    }

    /// A message already read (while looking for headers), or the final result of an ended
    /// call, without waiting.
    pub(crate) fn ready_result(&mut self) -> Option<Received> {
        if let Some(m) = self.pending.pop_front() {
            return Some(Ok(Some(m)));
        }
        self.ended.as_ref().map(|_| self.outcome())
    }

    /// Counts a message for flow control (credit goes back to the server once due).
    fn hand_out(&mut self, m: &Bytes) {
        if self.ended.is_none() {
            self.stream.took(m.len(), &self.mux);
        }
    }

    /// Sends credit still owed to the server (see `Stream::settle`).
    pub(crate) fn settle(&mut self) {
        self.stream.settle(&self.mux);
    }

    /// Keeps a message read while waiting for the headers.
    pub(crate) fn park(&mut self, m: Bytes) {
        self.pending.push_back(m);
    }

    pub(crate) fn headers(&self) -> Option<&MetadataMap> {
        self.headers.as_ref()
    }

    pub(crate) fn take_response(&mut self, message: Bytes) -> Response {
        Response {
            metadata: self.headers.take().unwrap_or_default(),
            message,
            trailers: self.trailers.take().unwrap_or_default(),
            status_message: self.status_message().unwrap_or_default().to_owned(),
        }
    }

    pub(crate) fn trailers(&self) -> Option<&MetadataMap> {
        self.trailers.as_ref()
    }

    /// The message of the OK status the call ended with; `None` before it ended OK.
    pub(crate) fn status_message(&self) -> Option<&str> {
        self.ended.as_ref().filter(|s| s.code() == Code::Ok).map(|s| s.message())
    }

    /// What a send does once the stream is closed for writing: the final status if it failed, the
    /// connection's if that died, or nothing (the server ended the call with OK and wants no
    /// more; the message is dropped, as gRPC does).
    pub(crate) fn after_close(&mut self) -> Result<(), Status> {
        while self.ended.is_none() {
            match self.try_event() {
                Some(ev) => {
                    if let Next::Message(m) = self.absorb(ev) {
                        self.park(m);
                    }
                }
                None => {
                    // Closed by our own side (a cancel): nothing more to send.
                    return Err(Status::new(Code::Cancelled, "the call was cancelled"));
                }
            }
        }
        self.outcome().map(|_| ())
    }

    /// Why nothing more can be sent on a call that has ended: its status if it failed.
    pub(crate) fn ended_error(&self) -> Status {
        match &self.ended {
            Some(s) if s.code() != Code::Ok => s.clone(),
            _ => Status::new(Code::FailedPrecondition, "the call has already ended"),
        }
    }

    /// Ends the call here with `code`; `true` if it was still open, and a CANCEL must go to the
    /// server.
    pub(crate) fn end_by_cancel(&mut self, code: Code, message: &str) -> bool {
        let open = self.ended.is_none();
        if open {
            self.end(Status::new(code, message));
        }
        open
    }

    /// Ends the call with `code` and tells the server, waiting up to `patience` for ring room
    /// (`Mux::send_cancel`). The clock is read only if a CANCEL goes: most calls have ended
    /// before they are dropped.
    pub(crate) fn cancel_blocking(&mut self, code: Code, message: &str, patience: std::time::Duration) {
        if self.end_by_cancel(code, message) {
            self.mux.send_cancel(self.stream.id, code, std::time::Instant::now() + patience);
        }
    }
}

impl Drop for CallState {
    fn drop(&mut self) {
        // Never blocks: a drop may run on an event loop.
        self.cancel_blocking(Code::Cancelled, "the call was dropped", std::time::Duration::ZERO);
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::TimedLock;

    /// A wait for a held lock ends at its deadline (`None`), and the lock is taken once freed,
    /// by a waiter that was asleep on it too.
    #[test]
    fn a_timed_locks_wait_ends_at_its_deadline_or_when_it_is_freed() {
        let lock = std::sync::Arc::new(TimedLock::default());
        let held = lock.lock_until(None).expect("a free lock is taken");
        let began = Instant::now();
        assert!(lock.lock_until(Some(began + Duration::from_millis(50))).is_none(), "held by another");
        assert!(began.elapsed() >= Duration::from_millis(50), "not before the deadline");
        assert!(lock.lock_until(Some(Instant::now())).is_none(), "a deadline passed takes nothing");
        let waiter = {
            let lock = lock.clone();
            std::thread::spawn(move || lock.lock_until(None).is_some())
        };
        std::thread::sleep(Duration::from_millis(50)); // asleep on the lock by then, most likely
        drop(held);
        assert!(waiter.join().expect("waiter"), "freed, it is taken");
        assert!(lock.lock_until(Some(Instant::now() + Duration::from_secs(10))).is_some(), "and freed again");
    }
}
