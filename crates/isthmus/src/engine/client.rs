//! The async client over `shm://`: `ShmChannel`, a channel's connection (made, and made again after
//! it dies), and `ShmCall`, one call on it. The public [`Channel`](crate::Channel) and
//! [`ClientCall`](crate::ClientCall) put this and the HTTP/2 calls behind one API.
//!
//! Connecting needs a tokio runtime: the handshake runs on `spawn_blocking` (to its end or the
//! handshake timeout, past a call whose deadline is sooner: dropping the runtime then waits for
//! it), and the connection's reader task is spawned on the runtime current at connect, whose
//! reactor the transport registers the connection's fds with. The channel must be used within
//! that runtime; if it shuts down, the reader task is dropped and its `Watch` guard ends every
//! call UNAVAILABLE (no test shows it yet).
//!
//! A call: `start` checks the path, takes a connection (see `call`), registers the stream and sends
//! HEADERS (once more on a new connection if the old one died before they went out: the server
//! never saw the call, and gRPC retries such a call transparently). A connect attempt the server
//! does not answer within the handshake timeout is UNAVAILABLE, as any failed connect. The front's
//! `Channel::unary` is `start`, `send_last`, one `recv` that must give a message and one that must
//! give the end (INTERNAL if the server sent none or more than one).
//! `send` waits for credit, then sends one MESSAGE inline, in an arena block or in pieces;
//! `send_last` adds END_STREAM, `close_send` half-closes with an empty TRAILERS. `alloc` and
//! `send_block` build a message in place in this side's arena: no copy on either side. `recv` gives
//! the next message, `None` after an OK end (trailers then in `trailers()`), or the call's status:
//! the server's TRAILERS, the peer's CANCEL, or the connection's end. `headers()` waits for the
//! initial metadata: a HEADERS, or the first MESSAGE, which implies empty metadata and is kept for
//! `recv`. A large message received is a view into the server's arena: holding it holds that
//! memory.
//!
//! After the end, `send` fails and sends nothing, and `close_send` does nothing. A send that finds
//! the stream closed while asking for credit returns the call's status if it failed, and `Ok(())`
//! without sending if the server already ended it OK (gRPC drops such a message too).
//!
//! The deadline bounds every operation, their waits for credit, ring room and arena room included,
//! and the send of HEADERS; when it passes, the call sends CANCEL with DEADLINE_EXCEEDED and
//! returns DEADLINE_EXCEEDED. That CANCEL never waits for ring room: with none, it waits in the
//! connection's queue of answers (ADR 0027) and the call returns at once. One connect attempt is
//! bounded by the handshake's timeout, not the deadline.
//!
//! `cancel()` sends CANCEL with CANCELLED and the server stops the handler. Dropping a call that
//! has not ended unregisters it and sends the same CANCEL without blocking (`Mux::send_cancel`
//! with a patience of now): if the ring is full at that moment, the CANCEL goes once it has room,
//! from a task of the connection's runtime.
//!
//! `SendHalf` sends a call's requests from another task (the bridge's request pump, a
//! `CallSender`), waiting for credit on the stream's send window, while the call's own task reads
//! responses. While waiting, a call on a tokio thread reads the connection itself
//! (`Mux::read_here`, ADR 0008) unless the channel was made `with_calls_read(false)`.
//!
//! Each call is a `tracing` span `isthmus.call` at DEBUG, with `path`, `stream` and `code`; `code`
//! is recorded when the call ends, with a DEBUG event "call ended". The span records the call; it
//! is not entered while the call's methods run.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use isthmus_shm::{flags, BlockMut, Config, Kind};
use tokio::time::Instant;

use super::call::{
    count_inside, head_frame, open_head, request_in_head, CallState, ConnectLock, Next, Reconnect, Slot,
};
use super::flow::{self, Credit};
use super::inbox::Event;
use super::mux::{ConnectionCounters, Mux, Outgoing, StreamShared};
use crate::call::{check_start, until, CallOptions};
use crate::connectivity::Tracker;
use crate::metadata::MetadataMap;
use crate::status::{Code, Status, DEADLINE_EXCEEDED};

/// A channel's way to one `shm://` server: the connection slot its clones share.
pub(crate) struct ShmChannel {
    /// Shared with a connection attempt that outlives the call that began it (`mux`).
    slot: Arc<Slot>,
    /// Serialises reconnecting, so a burst of calls makes one connection, not many.
    connecting: ConnectLock<tokio::sync::Mutex<()>>,
    /// gRPC's connectivity state: set as connections are made and as their readers end.
    pub(crate) connectivity: Arc<Tracker>,
}

impl ShmChannel {
    pub(crate) fn new(target: &str, config: Config) -> Result<ShmChannel, Status> {
        Ok(ShmChannel::on(Slot::new(target, config)?))
    }

    fn on(slot: Slot) -> ShmChannel {
        ShmChannel { slot: Arc::new(slot), connecting: ConnectLock::default(), connectivity: Arc::default() }
    }

    /// Names `agent`, if given, as the user agent of the channel's calls (see
    /// [`Slot::set_agent`]).
    pub(crate) fn set_agent(&self, agent: Option<&str>) -> Result<(), Status> {
        agent.map_or(Ok(()), |agent| self.slot.set_agent(agent))
    }

    /// A channel that refuses any server but process `pid` (an upgrade's check, ADR 0013).
    pub(crate) fn expecting(target: &str, config: Config, pid: u32) -> Result<ShmChannel, Status> {
        let mut slot = Slot::new(target, config)?;
        slot.expect_pid = Some(pid);
        Ok(ShmChannel::on(slot))
    }

    /// Closes the connection, failing its calls with `status`; later calls fail UNAVAILABLE.
    pub(crate) fn close(&self, status: Status) {
        self.slot.close(status);
        self.connectivity.shutdown();
    }

    /// The channel's state; READY only while a connection takes calls (one that sent GOAWAY, or
    /// whose end its reader has not yet seen, does not).
    pub(crate) fn connectivity(&self) -> crate::Connectivity {
        match self.connectivity.get() {
            crate::Connectivity::Ready if self.live().is_none() => crate::Connectivity::Idle,
            state => state,
        }
    }

    /// Whether a connection is up now.
    pub(crate) fn is_connected(&self) -> bool {
        self.live().is_some()
    }

    /// The target, as the user gave it (parsed).
    pub(crate) fn target(&self) -> String {
        self.slot.target.to_string()
    }

    fn live(&self) -> Option<Arc<Mux>> {
        self.slot.live()
    }

    /// The live connection, connecting (again) if there is none.
    pub(crate) async fn mux(&self, wait_for_ready: bool, deadline: Option<Instant>) -> Result<Arc<Mux>, Status> {
        if let Some(m) = self.live() {
            return Ok(m);
        }
        self.slot.closed()?;
        let mut reconnect = Reconnect::new();
        // Held through the backoff between this call's attempts, as before a call's attempt
        // could outlive it: other calls wait for it rather than try too.
        let mut held = None;
        loop {
            reconnect.too_late(deadline.map(Instant::into_std))?;
            let one_at_a_time = match held.take() {
                Some(held) => held,
                // Another call's handshake is waited for within this call's deadline.
                None => {
                    let lock = self.connecting.get().lock_owned();
                    match deadline {
                        None => lock.await,
                        Some(d) => tokio::time::timeout_at(d, lock).await.map_err(|_| reconnect.deadline_passed())?,
                    }
                }
            };
            if let Some(m) = self.live() {
                return Ok(m); // another call connected while we waited
            }
            self.slot.closed()?;
            let (slot, connectivity) = (Arc::downgrade(&self.slot), self.connectivity.clone());
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            let made = match left.filter(|left| *left < self.slot.config.handshake_timeout) {
                None => {
                    let made = connect_once(slot, connectivity, deadline).await;
                    held = Some(one_at_a_time);
                    made
                }
                Some(left) if left.is_zero() => return Err(reconnect.deadline_passed()),
                // Less time left than a handshake may take: the attempt goes on in a task of
                // its own, holding the lock, and connects the channel for the calls after this
                // one even if it ends after this call's deadline (as the blocking channel's).
                // It holds the channel weakly: one dropped meanwhile is not kept.
                Some(_) => {
                    let (done, outcome) = tokio::sync::oneshot::channel();
                    tokio::spawn(async move {
                        let made = connect_once(slot, connectivity, None).await;
                        drop(one_at_a_time);
                        let _ = done.send(made); // the call may have ended meanwhile
                    });
                    let outcome = match deadline {
                        Some(d) => {
                            tokio::time::timeout_at(d, outcome).await.map_err(|_| reconnect.deadline_passed())?
                        }
                        None => outcome.await,
                    };
                    outcome.unwrap_or_else(|_| {
                        Err(Status::new(Code::Internal, "the task connecting the channel ended without an outcome"))
                    })
                }
            };
            match made {
                Ok(mux) => return Ok(mux),
                Err(s) => {
                    let wait = reconnect.after(s, wait_for_ready, deadline.map(Instant::into_std))?;
                    tokio::time::sleep(wait).await;
                }
            }
        }
    }

    /// Starts a call and sends its head; with `first`, the call's only request, inside its
    /// HEADERS when it can (a one-frame call, ADR 0025): whether it did. `reads`: whether its
    /// waits read the connection themselves (`Channel::with_calls_read`); `keep`: what keeps the
    /// channel's connection open while the call lives.
    pub(crate) async fn start_with(
        &self,
        path: &str,
        options: CallOptions,
        reads: bool,
        keep: Arc<dyn std::any::Any + Send + Sync>,
        first: Option<&[u8]>,
    ) -> Result<(ShmCall, bool), Status> {
        check_start(path, &options)?;
        let deadline = options.timeout.and_then(crate::call::deadline_in).map(Instant::from_std);
        let mut again = true;
        loop {
            // Connecting, and a wait for ring room, are boxed: their state would sit in every
            // call's future, which the bindings allocate per call (`Channel::start_shm_with`'s:
            // 992 bytes with them inline, 384 now).
            let mux = match self.live() {
                Some(mux) => mux,
                None => Box::pin(self.mux(options.wait_for_ready, deadline)).await?,
            };
            // Awaited outside the match, whose scrutinee (a call) would sit in the future.
            let sending = match self.open(mux.clone(), path, &options, deadline, reads, keep.clone(), first) {
                Ok((call, inside, true)) => return Ok((call, inside)),
                Ok((call, inside, false)) => {
                    Ok((Box::pin(send_head(call, path, &options, first.filter(|_| inside), self.slot.agent())), inside))
                }
                Err(status) => Err(status),
            };
            let opened = match sending {
                Ok((sending, inside)) => sending.await.map(|call| (call, inside)),
                Err(status) => Err(status),
            };
            match opened {
                // Its connection died before the call's HEADERS went out: the server never saw
                // it, so it starts once more on a new connection (gRPC's transparent retry).
                Err(_) if again && !mux.takes_calls() => again = false,
                opened => return opened,
            }
        }
    }

    /// Registers the call and sends its HEADERS if the ring has room now, as it mostly has:
    /// the call, whether `first` went inside the HEADERS (or will, [`send_head`]), and whether
    /// they went.
    #[allow(clippy::too_many_arguments)] // `start_with`'s own, passed down
    fn open(
        &self,
        mux: Arc<Mux>,
        path: &str,
        options: &CallOptions,
        deadline: Option<Instant>,
        reads: bool,
        keep: Arc<dyn std::any::Any + Send + Sync>,
        first: Option<&[u8]>,
    ) -> Result<(ShmCall, bool, bool), Status> {
        let stream = mux.register(self.slot.next_stream())?;
        let call = ShmCall {
            state: CallState::new(stream, mux, path, Some(keep)),
            deadline,
            timer: None,
            reads,
            read_dry: false,
        };
        let head = open_head(path, &options.metadata, deadline.map(Instant::into_std), self.slot.agent());
        let first = first.filter(|m| request_in_head(&call.state, &head, m));
        let (f, body) = head_frame(&head, first);
        let sent = call.state.mux.sender.try_send_parts(Kind::Headers, f, call.state.id(), &body);
        let sent = sent.map_err(|e| Status::from_transport(&e))?;
        if sent {
            count_inside(&call.state, first);
        }
        Ok((call, first.is_some(), sent))
    }

    /// The largest message this channel accepts (its configuration's `max_message_size`).
    pub(crate) fn max_message_size(&self) -> usize {
        usize::try_from(self.slot.config.max_message_size).unwrap_or(usize::MAX)
    }

    /// Counters of the current connection (zero if there is none yet).
    pub(crate) fn counters(&self) -> ConnectionCounters {
        self.slot.counters()
    }
}

/// Connects `slot` once, within `deadline` (and the handshake timeout), and installs the
/// connection, whose reader then runs as a task of its own; `connectivity` follows. A slot
/// dropped meanwhile gets nothing: the connection closes.
async fn connect_once(
    slot: std::sync::Weak<Slot>,
    connectivity: Arc<Tracker>,
    deadline: Option<Instant>,
) -> Result<Arc<Mux>, Status> {
    let dropped = || Status::new(Code::Cancelled, "the channel was dropped");
    let (addr, config, pid) = {
        let slot = slot.upgrade().ok_or_else(dropped)?;
        (slot.target.clone(), slot.config.clone(), slot.expect_pid)
    };
    connectivity.connecting();
    let deadline = deadline.map(Instant::into_std);
    let conn = tokio::task::spawn_blocking(move || Slot::connect(&addr, &config, pid, deadline))
        .await
        .map_err(|e| Status::new(Code::Internal, format!("connect task failed: {e}")))
        .and_then(|made| made)
        .inspect_err(|_| connectivity.failed())?;
    let slot = slot.upgrade().ok_or_else(dropped)?;
    let (sender, receiver) = conn.split();
    let mux = Mux::led(sender, &receiver);
    // The channel is READY while the reader runs: it ends when the connection does.
    let live = connectivity.connected();
    let reader = mux.clone().read_loop(receiver, None);
    tokio::spawn(async move {
        reader.await;
        drop(live);
    });
    slot.install(mux.clone())?;
    Ok(mux)
}

/// Sends the HEADERS of a call that found no room in the ring ([`ShmChannel::open`]), with
/// `first` inside them if it was let in, within the call's deadline: a server that reads nothing
/// must not hold the call past it. The HEADERS never went, so the server knows nothing of the
/// call to cancel.
async fn send_head(
    call: ShmCall,
    path: &str,
    options: &CallOptions,
    first: Option<&[u8]>,
    agent: Option<(&str, &[u8])>,
) -> Result<ShmCall, Status> {
    let head = open_head(path, &options.metadata, call.deadline.map(Instant::into_std), agent);
    let (f, body) = head_frame(&head, first);
    let (sender, id) = (&call.state.mux.sender, call.state.id());
    match until(call.deadline, sender.send_parts_async(Kind::Headers, f, id, &body)).await {
        Some(sent) => sent.map_err(|e| Status::from_transport(&e))?,
        None => return Err(Status::deadline_exceeded()),
    }
    count_inside(&call.state, first);
    Ok(call)
}

/// Takes credit for a message of `len` bytes on a stream, waiting for the server's window; a
/// writer that has to wait has the reader task read, since the grant comes as a frame.
async fn credit(mux: &Mux, shared: &StreamShared, len: usize) -> Credit {
    let _wanted = shared.send_window.starved().then(|| mux.reader_wanted());
    shared.send_window.take(flow::charge(len)).await
}

/// A call over `shm://`.
pub(crate) struct ShmCall {
    state: CallState,
    deadline: Option<Instant>,
    /// The deadline as a timer, once a poll has had to wait.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Whether a poll that has to wait reads the connection itself (`Channel::with_calls_read`).
    reads: bool,
    /// This call read the connection for a whole spin and found nothing for itself: it waits for
    /// the reader task until its next event. Reading again at every poll would not end: the
    /// reader task, asked for the receiver, wakes the asking call when it gives it back, so each
    /// fruitless read could lead to another poll, another ask and another spin, for as long as
    /// the call waited (a catalog watcher, idle between updates, spent 18% of a core so).
    read_dry: bool,
}

/// The sending side of a [`ClientCall`](crate::ClientCall), usable beside it (see [`ShmCall::send_half`]).
#[derive(Clone)]
pub(crate) struct SendHalf {
    mux: Arc<Mux>,
    id: u64,
    shared: Arc<StreamShared>,
    /// The call's: it bounds every wait here as it does the call's own.
    deadline: Option<Instant>,
}

impl SendHalf {
    /// Runs `op` until the call's deadline; past it the call ends, here and at the server,
    /// DEADLINE_EXCEEDED. A sender whose caller reads no response (a client stream sent whole
    /// before its reply is read) waited for credit, ring or arena room for ever.
    async fn within<T>(&self, op: impl std::future::Future<Output = T>) -> Result<T, Status> {
        match until(self.deadline, op).await {
            Some(done) => Ok(done),
            None => {
                self.mux.abandon(self.id, Status::deadline_exceeded());
                Err(Status::deadline_exceeded())
            }
        }
    }

    /// Sends one message once the server's window allows; `last` half-closes with it. An error
    /// means the call is over (its status comes from the receiving side).
    pub(crate) async fn send(&self, message: &[u8], last: bool) -> Result<(), ()> {
        if self.within(credit(&self.mux, &self.shared, message.len())).await != Ok(Credit::Taken) {
            return Err(());
        }
        let f = if last { flags::END_STREAM } else { 0 };
        let deadline = self.deadline.map(Instant::into_std);
        let out = Outgoing { id: self.id, shared: &self.shared, flags: f, deadline };
        sent(self.within(self.mux.send_message(out, message)).await)
    }

    /// A writable block in this side's shared memory, for a message built in place.
    pub(crate) async fn alloc(&self, len: usize) -> Result<BlockMut, Status> {
        self.within(self.mux.sender.alloc_async(len)).await?.map_err(|e| Status::from_transport(&e))
    }

    /// Sends a block from [`alloc`](Self::alloc) once the server's window allows; `last`
    /// half-closes with it.
    pub(crate) async fn send_block(&self, block: BlockMut, last: bool) -> Result<(), ()> {
        // A block of another connection is refused before it takes credit it would never give
        // back: the call stalled for good once refused blocks had taken its window.
        if !self.owns(&block) || self.within(credit(&self.mux, &self.shared, block.len())).await != Ok(Credit::Taken) {
            return Err(());
        }
        let f = if last { flags::END_STREAM } else { 0 };
        sent(self.within(self.mux.sender.send_block_async(self.id, f, block)).await)
    }

    /// Whether `block` can be sent on this call: it was allocated from its connection.
    pub(crate) fn owns(&self, block: &BlockMut) -> bool {
        self.mux.sender.owns(block)
    }

    /// Ends the call with `status` on both sides (the request could not be sent).
    pub(crate) fn fail(&self, status: Status) {
        self.mux.abandon(self.id, status);
    }

    /// Resolves once the call is over (it ended, or was cancelled or dropped).
    pub(crate) async fn closed(&self) {
        self.shared.send_window.closed().await;
    }

    /// Half-closes without a message.
    pub(crate) async fn close(&self) -> Result<(), ()> {
        sent(self.within(self.mux.sender.send_async(Kind::Trailers, flags::END_STREAM, self.id, &[])).await)
    }
}

/// A `SendHalf` send's outcome: `Err` if its deadline passed or the connection failed (the
/// call's status comes from the receiving side either way).
fn sent(outcome: Result<Result<(), isthmus_shm::Error>, Status>) -> Result<(), ()> {
    match outcome {
        Ok(Ok(())) => Ok(()),
        _ => Err(()),
    }
}

impl std::fmt::Debug for ShmCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmCall").field("stream", &self.state.id()).field("over", &self.state.is_over()).finish()
    }
}

impl ShmCall {
    /// Ends the call at its deadline: cancels it on both sides and gives the status. The CANCEL
    /// never waits for ring room (with none, it waits in the connection's queue of answers), so
    /// a server that reads nothing does not hold the caller past its deadline.
    fn expire(&mut self) -> Status {
        self.state.cancel_blocking(Code::DeadlineExceeded, DEADLINE_EXCEEDED, std::time::Duration::ZERO);
        // With the initial metadata that came before, as every other failure keeps them.
        Status::deadline_exceeded().after_headers(self.state.headers())
    }

    /// Waits for credit to send `len` bytes; `Ok(false)` if the call is already over and the
    /// message must be dropped.
    async fn credit(&mut self, len: usize) -> Result<bool, Status> {
        if self.state.is_over() {
            return Err(self.state.ended_error());
        }
        let shared = self.state.stream.shared.clone();
        match until(self.deadline, credit(&self.state.mux, &shared, len)).await {
            None => Err(self.expire()),
            Some(Credit::Taken) => Ok(true),
            Some(_) => self.state.after_close().map(|()| false),
        }
    }

    async fn send_flags(&mut self, message: &[u8], frame_flags: u8) -> Result<(), Status> {
        if !self.credit(message.len()).await? {
            return Ok(());
        }
        let (mux, id, shared) = (self.state.mux.clone(), self.state.id(), self.state.stream.shared.clone());
        let deadline = self.deadline.map(Instant::into_std);
        let out = Outgoing { id, shared: &shared, flags: frame_flags, deadline };
        match until(self.deadline, mux.send_message(out, message)).await {
            Some(sent) => sent.map_err(|e| Status::from_transport(&e)),
            None => Err(self.expire()),
        }
    }

    /// Sends one request message.
    pub(crate) async fn send(&mut self, message: &[u8]) -> Result<(), Status> {
        self.send_flags(message, 0).await
    }

    /// Sends the last request message and half-closes in the same frame.
    pub(crate) async fn send_last(&mut self, message: &[u8]) -> Result<(), Status> {
        self.send_flags(message, flags::END_STREAM).await
    }

    /// See [`ClientCall::alloc`](crate::ClientCall::alloc).
    pub(crate) async fn alloc(&mut self, len: usize) -> Result<BlockMut, Status> {
        let sender = self.state.mux.sender.clone();
        match until(self.deadline, sender.alloc_async(len)).await {
            Some(block) => block.map_err(|e| Status::from_transport(&e)),
            None => Err(self.expire()),
        }
    }

    /// Sends a block from [`alloc`](Self::alloc) as one request message, as it is; `last`
    /// half-closes with it.
    pub(crate) async fn send_block(&mut self, block: BlockMut, last: bool) -> Result<(), Status> {
        if !self.state.mux.sender.owns(&block) {
            return Err(foreign_block());
        }
        if !self.credit(block.len()).await? {
            return Ok(());
        }
        let (sender, id) = (self.state.mux.sender.clone(), self.state.id());
        let f = if last { flags::END_STREAM } else { 0 };
        match until(self.deadline, sender.send_block_async(id, f, block)).await {
            Some(sent) => sent.map_err(|e| Status::from_transport(&e)),
            None => Err(self.expire()),
        }
    }

    /// Half-closes: no more request messages.
    pub(crate) async fn close_send(&mut self) -> Result<(), Status> {
        if self.state.is_over() {
            return Ok(());
        }
        // From the client, an empty TRAILERS frame is a half-close without a message.
        let (sender, id) = (self.state.mux.sender.clone(), self.state.id());
        match until(self.deadline, sender.send_async(Kind::Trailers, flags::END_STREAM, id, &[])).await {
            Some(sent) => sent.map_err(|e| Status::from_transport(&e)),
            None => Err(self.expire()),
        }
    }

    /// The next event, taken in; past the deadline the call ends with DEADLINE_EXCEEDED.
    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Result<Next, Status>> {
        self.state.settle();
        let inbox = &self.state.stream.shared.inbox;
        // A call made before a fork, in the child: nobody would ever read for it.
        if !inbox.is_ready() {
            self.state.mux.end_if_forked();
        }
        // The call reads its own reply (see `Mux::read_here`), unless its channel leaves that to
        // the reader task.
        if self.reads && !self.read_dry && !inbox.is_ready() {
            self.state.mux.read_here(self.state.id(), cx, || inbox.is_ready());
            self.read_dry = !inbox.is_ready();
        }
        if let Poll::Ready(ev) = inbox.poll_recv(cx) {
            self.read_dry = false;
            let ev = ev.unwrap_or_else(|| Event::End(self.state.connection_end()));
            return Poll::Ready(Ok(self.state.absorb(ev)));
        }
        // It waits without reading: the reader task must read for it.
        self.state.mux.want_reader();
        let Some(deadline) = self.deadline else { return Poll::Pending };
        let timer = self.timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        ready!(timer.as_mut().poll(cx));
        Poll::Ready(Err(self.expire()))
    }

    /// [`recv`](Self::recv) in poll form.
    pub(crate) fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Result<Option<Bytes>, Status>> {
        if let Some(r) = self.state.ready_result() {
            return Poll::Ready(r);
        }
        loop {
            match ready!(self.poll_next(cx))? {
                Next::More => {}
                Next::Ended(r) => return Poll::Ready(r),
                Next::Message(m) => return Poll::Ready(Ok(Some(m))),
            }
        }
    }

    /// The next response message; `Ok(None)` once the server ended the call with OK (its
    /// trailers are then in [`trailers`](Self::trailers)); the server's status otherwise.
    ///
    /// A large message is a view into the server's shared memory, not a copy; holding it keeps
    /// that memory from the server, so drop it (or copy what you keep) when done.
    pub(crate) async fn recv(&mut self) -> Result<Option<Bytes>, Status> {
        std::future::poll_fn(|cx| self.poll_recv(cx)).await
    }

    /// [`headers`](Self::headers) in poll form.
    pub(crate) fn poll_headers(&mut self, cx: &mut Context<'_>) -> Poll<Result<MetadataMap, Status>> {
        while self.state.headers().is_none() && !self.state.is_over() {
            match ready!(self.poll_next(cx))? {
                Next::More => {}
                Next::Message(m) => self.state.park(m),
                Next::Ended(Err(status)) => return Poll::Ready(Err(status)),
                Next::Ended(Ok(_)) => {}
            }
        }
        Poll::Ready(Ok(self.state.headers().cloned().unwrap_or_default()))
    }

    /// The server's initial metadata, waiting for it if needed.
    pub(crate) async fn headers(&mut self) -> Result<MetadataMap, Status> {
        std::future::poll_fn(|cx| self.poll_headers(cx)).await
    }

    /// A handle that sends this call's request messages from another task while this one reads
    /// the responses (the tonic bridge does so). It stops, with an error, once the call has
    /// ended.
    pub(crate) fn send_half(&self) -> SendHalf {
        SendHalf {
            mux: self.state.mux.clone(),
            id: self.state.id(),
            shared: self.state.stream.shared.clone(),
            deadline: self.deadline,
        }
    }

    /// The server's trailing metadata, once the call has ended with OK.
    pub(crate) fn trailers(&self) -> Option<&MetadataMap> {
        self.state.trailers()
    }

    /// The message of the OK status the call ended with, once it has.
    pub(crate) fn status_message(&self) -> Option<&str> {
        self.state.status_message()
    }

    /// A unary call's response, once its one message is in and the call has ended.
    pub(crate) fn take_response(&mut self, message: Bytes) -> crate::call::Response {
        self.state.take_response(message)
    }

    /// Cancels the call: the server sees CANCELLED and stops its handler.
    pub(crate) async fn cancel(mut self) {
        // As `expire`'s CANCEL, without waiting for ring room.
        self.state.cancel_blocking(Code::Cancelled, "the call was cancelled", std::time::Duration::ZERO);
    }
}

/// How a send of a block allocated from another connection (another channel's, or the one a
/// call had before it reconnected) fails, before it takes any credit.
pub(crate) fn foreign_block() -> Status {
    Status::new(Code::InvalidArgument, "a block can only be sent on the connection it was allocated from")
}
