//! The client: a [`Channel`] to one server, and the [`ClientCall`]s made on it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use isthmus_shm::{flags, BlockMut, Config, Connection, Kind};
use tokio::time::Instant;

use crate::call::{check_path, open_head, CallOptions, CallState, Next, Reconnect, Response, Slot};
use crate::endpoint::{connector, http_endpoint, Target};
use crate::flow::{self, Credit};
use crate::http_call::HttpCall;
use crate::mux::{ConnectionCounters, Mux};
use crate::status::{Code, Status};
use crate::wire;

struct Inner {
    via: Via,
    /// Serialises reconnecting, so a burst of calls makes one connection, not many.
    connecting: tokio::sync::Mutex<()>,
}

/// A connection to one server. Cheap to clone; clones share the connection. If the
/// connection dies (the server restarted, say), the next call connects again.
///
/// ```no_run
/// # async fn demo() -> Result<(), isthmus::Status> {
/// let channel = isthmus::Channel::connect("shm://sidecar").await?;
/// let reply = channel.unary("/demo.Echo/Say", b"hello", Default::default()).await?;
/// assert_eq!(&reply.message[..], b"hello");
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Channel {
    inner: Arc<Inner>,
    /// Whether this handle's waiting calls read the connection themselves
    /// ([`with_calls_read`](Self::with_calls_read)).
    calls_read: bool,
}

/// What a channel runs over.
enum Via {
    /// isthmus shared memory.
    Shm(Slot),
    /// Standard gRPC over HTTP/2 (tonic's channel), to a `unix://` or `http://` target.
    Http { channel: tonic::transport::Channel, target: String },
}

impl Inner {
    /// The shared-memory connection slot (`shm://` channels only).
    fn slot(&self) -> Result<&Slot, Status> {
        match &self.via {
            Via::Shm(slot) => Ok(slot),
            Via::Http { target, .. } => {
                Err(Status::new(Code::Unimplemented, format!("{target}: this needs an shm:// channel")))
            }
        }
    }
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let target = match &self.inner.via {
            Via::Shm(slot) => slot.target.to_string(),
            Via::Http { target, .. } => target.clone(),
        };
        f.debug_struct("Channel").field("target", &target).finish_non_exhaustive()
    }
}

impl Channel {
    /// Connects to `target` now. Must run inside a tokio runtime.
    ///
    /// - `shm://NAME` or `shm:///path.sock`: isthmus over shared memory (the handshake runs on a
    ///   blocking thread);
    /// - `unix:///path.sock` or `http://host:port`: standard gRPC over HTTP/2 (tonic's
    ///   transport), for servers elsewhere or not isthmus: with a tonic client
    ///   (`FooClient::new(channel)`) or by method path ([`start`](Self::start),
    ///   [`unary`](Self::unary)), as over `shm://`.
    pub async fn connect(target: &str) -> Result<Channel, Status> {
        Channel::connect_with(target, Config::default()).await
    }

    /// [`connect`](Self::connect) with a transport configuration (ring and arena sizes, the
    /// largest message accepted, spinning).
    pub async fn connect_with(target: &str, config: Config) -> Result<Channel, Status> {
        match Target::parse(target)? {
            Target::Shm(_) => {
                let channel = Channel::lazy_with(target, config)?;
                channel.mux(false, None).await?;
                Ok(channel)
            }
            other => {
                let channel = http_endpoint(&other)?
                    .connect_with_connector(connector(&other))
                    .await
                    .map_err(|e| Status::new(Code::Unavailable, format!("cannot connect to {target}: {e}")))?;
                Ok(Channel::over_http(channel, target))
            }
        }
    }

    fn over_http(channel: tonic::transport::Channel, target: &str) -> Channel {
        let via = Via::Http { channel, target: target.to_owned() };
        Channel { inner: Arc::new(Inner { via, connecting: tokio::sync::Mutex::new(()) }), calls_read: true }
    }

    /// The HTTP/2 channel under a `unix://` or `http://` target.
    pub(crate) fn http(&self) -> Option<&tonic::transport::Channel> {
        match &self.inner.via {
            Via::Http { channel, .. } => Some(channel),
            Via::Shm(_) => None,
        }
    }

    /// A channel that connects on its first call.
    pub fn lazy(target: &str) -> Result<Channel, Status> {
        Channel::lazy_with(target, Config::default())
    }

    /// [`lazy`](Self::lazy) with a transport configuration.
    pub fn lazy_with(target: &str, config: Config) -> Result<Channel, Status> {
        match Target::parse(target)? {
            Target::Shm(_) => {
                let via = Via::Shm(Slot::new(target, config)?);
                Ok(Channel {
                    inner: Arc::new(Inner { via, connecting: tokio::sync::Mutex::new(()) }),
                    calls_read: true,
                })
            }
            other => {
                let channel = http_endpoint(&other)?.connect_with_connector_lazy(connector(&other));
                Ok(Channel::over_http(channel, target))
            }
        }
    }

    /// A handle on the same connection whose calls over `shm://`, when they wait for their next
    /// message, do (`true`, the default) or do not read the connection themselves, on the
    /// thread that polls them, for up to the connection's spin bound. With one call in flight
    /// its reply then reaches it with no task woken and no thread handed anything; the
    /// connection's reader task reads whenever no call does (ADR 0008). Turn it off for calls
    /// that an event loop polls among other work (the Python binding's asyncio channels do),
    /// where the spin would hold that work up. Clones keep the setting.
    pub fn with_calls_read(&self, on: bool) -> Channel {
        Channel { inner: self.inner.clone(), calls_read: on }
    }

    fn live(&self) -> Option<Arc<Mux>> {
        self.inner.slot().ok()?.live()
    }

    /// The live connection, connecting (again) if there is none.
    async fn mux(&self, wait_for_ready: bool, deadline: Option<Instant>) -> Result<Arc<Mux>, Status> {
        if let Some(m) = self.live() {
            return Ok(m);
        }
        let _one_at_a_time = self.inner.connecting.lock().await;
        let mut reconnect = Reconnect::new();
        loop {
            if let Some(m) = self.live() {
                return Ok(m); // another call connected while we waited
            }
            match self.connect_once().await {
                Ok(mux) => {
                    self.inner.slot()?.install(mux.clone());
                    return Ok(mux);
                }
                Err(s) => {
                    let wait = reconnect.after(s, wait_for_ready, deadline.map(Instant::into_std))?;
                    tokio::time::sleep(wait).await;
                }
            }
        }
    }

    async fn connect_once(&self) -> Result<Arc<Mux>, Status> {
        let slot = self.inner.slot()?;
        let (addr, config) = (slot.target.clone(), slot.config.clone());
        let conn = tokio::task::spawn_blocking(move || Connection::connect(&addr, &config))
            .await
            .map_err(|e| Status::new(Code::Internal, format!("connect task failed: {e}")))?
            .map_err(|e| Status::from_transport(&e))?;
        let (sender, receiver) = conn.split();
        let mux = Mux::led(sender, &receiver);
        tokio::spawn(mux.clone().read_loop(receiver, None));
        Ok(mux)
    }

    /// Starts a call of any shape: send messages, half-close, read responses.
    pub async fn start(&self, path: &str, options: CallOptions) -> Result<ClientCall, Status> {
        let via = match &self.inner.via {
            Via::Shm(_) => CallVia::Shm(self.start_shm(path, options).await?),
            Via::Http { .. } => {
                check_path(path)?;
                let limit = self.max_message_size();
                CallVia::Http(Box::new(HttpCall::start(self.clone(), path, options, limit)?))
            }
        };
        Ok(ClientCall { via })
    }

    /// [`start`](Self::start) over `shm://`.
    pub(crate) async fn start_shm(&self, path: &str, options: CallOptions) -> Result<ShmCall, Status> {
        check_path(path)?;
        let deadline = options.timeout.map(|t| Instant::now() + t);
        let mux = self.mux(options.wait_for_ready, deadline).await?;
        let stream = mux.register(self.inner.slot()?.next_stream())?;
        let reads = self.calls_read;
        let call =
            ShmCall { state: CallState::new(stream, mux, path, self.inner.clone()), deadline, timer: None, reads };
        let head = open_head(path, options.metadata, deadline.map(Instant::into_std));
        call.state
            .mux
            .sender
            .send_async(Kind::Headers, 0, call.state.id(), &head)
            .await
            .map_err(|e| Status::from_transport(&e))?;
        Ok(call)
    }

    /// The largest message this channel accepts (its configuration's `max_message_size`).
    pub(crate) fn max_message_size(&self) -> usize {
        let limit = self.inner.slot().map_or(u64::MAX, |s| s.config.max_message_size);
        usize::try_from(limit).unwrap_or(usize::MAX)
    }

    /// Counters of the current connection (zero if there is none yet); they start afresh when
    /// the channel reconnects.
    pub fn counters(&self) -> ConnectionCounters {
        self.inner.slot().map(Slot::counters).unwrap_or_default()
    }

    /// A unary call: one request, one response.
    pub async fn unary(&self, path: &str, request: &[u8], options: CallOptions) -> Result<Response, Status> {
        if self.http().is_some() {
            let mut call = self.start(path, options).await?;
            call.send_last(request).await?;
            let message = call.recv().await?.ok_or_else(|| no_response(path))?;
            if call.recv().await?.is_some() {
                return Err(more_than_one(path));
            }
            let metadata = call.headers().await?;
            let trailers = call.trailers().cloned().unwrap_or_default();
            return Ok(Response { metadata, message, trailers });
        }
        let mut call = self.start_shm(path, options).await?;
        call.send_last(request).await?;
        let message = call.recv().await?.ok_or_else(|| no_response(path))?;
        if call.recv().await?.is_some() {
            return Err(more_than_one(path));
        }
        Ok(call.state.take_response(message))
    }
}

fn no_response(path: &str) -> Status {
    Status::new(Code::Internal, format!("{path}: the server ended the call without a response"))
}

fn more_than_one(path: &str) -> Status {
    Status::new(Code::Internal, format!("{path}: the server sent more than one response"))
}

/// Runs `fut` until `deadline`; `None` if the deadline came first (the future is dropped).
pub(crate) async fn until<T>(deadline: Option<Instant>, fut: impl std::future::Future<Output = T>) -> Option<T> {
    match deadline {
        None => Some(fut.await),
        Some(d) => tokio::time::timeout_at(d, fut).await.ok(),
    }
}

/// One call in progress. Dropping it before the server has finished cancels it.
///
/// Over `shm://`, request messages are flow-controlled: a `send` waits while the server has not
/// taken the messages already sent (up to a window of [`INITIAL_WINDOW`](crate::INITIAL_WINDOW)
/// bytes). Over `unix://` and `http://`, HTTP/2's own flow control does the same.
pub struct ClientCall {
    via: CallVia,
}

// The shm:// call is the common case, held inline: boxing it would cost an allocation per call.
#[allow(clippy::large_enum_variant)]
enum CallVia {
    Shm(ShmCall),
    Http(Box<HttpCall>),
}

/// A call over `shm://`.
pub(crate) struct ShmCall {
    state: CallState,
    deadline: Option<Instant>,
    /// The deadline as a timer, once a poll has had to wait.
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Whether a poll that has to wait reads the connection itself (`Channel::with_calls_read`).
    reads: bool,
}

/// The sending side of a [`ClientCall`], usable beside it (see [`ShmCall::send_half`]).
#[derive(Clone)]
pub(crate) struct SendHalf {
    mux: Arc<Mux>,
    id: u64,
    shared: Arc<crate::mux::StreamShared>,
}

impl SendHalf {
    /// Sends one message once the server's window allows; `last` half-closes with it. An error
    /// means the call is over (its status comes from the receiving side).
    pub(crate) async fn send(&self, message: &[u8], last: bool) -> Result<(), ()> {
        if self.shared.send_window.take(flow::charge(message.len())).await != Credit::Taken {
            return Err(());
        }
        let f = if last { flags::END_STREAM } else { 0 };
        self.mux.sender.send_message_async(self.id, f, message).await.map_err(|_| ())
    }

    /// Ends the call with `status` on both sides (the request could not be sent).
    pub(crate) fn fail(&self, status: Status) {
        self.mux.abandon(self.id, status);
    }

    /// Half-closes without a message.
    pub(crate) async fn close(&self) -> Result<(), ()> {
        self.mux.sender.send_async(Kind::Trailers, flags::END_STREAM, self.id, &[]).await.map_err(|_| ())
    }
}

impl std::fmt::Debug for ShmCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmCall").field("stream", &self.state.id()).field("over", &self.state.is_over()).finish()
    }
}

impl ShmCall {
    /// Ends the call at its deadline: cancels it on both sides and gives the status.
    async fn expire(&mut self) -> Status {
        self.cancel_with(Code::DeadlineExceeded, "the call's deadline passed").await;
        Status::new(Code::DeadlineExceeded, "the call's deadline passed")
    }

    async fn cancel_with(&mut self, code: Code, message: &str) {
        if self.state.end_by_cancel(code, message) {
            let _ =
                self.state.mux.sender.send_async(Kind::Cancel, 0, self.state.id(), &wire::encode_cancel(code)).await;
        }
    }

    /// Waits for credit to send `len` bytes; `Ok(false)` if the call is already over and the
    /// message must be dropped.
    async fn credit(&mut self, len: usize) -> Result<bool, Status> {
        if self.state.is_over() {
            return Err(self.state.ended_error());
        }
        let shared = self.state.stream.shared.clone();
        match until(self.deadline, shared.send_window.take(flow::charge(len))).await {
            None => Err(self.expire().await),
            Some(Credit::Taken) => Ok(true),
            Some(_) => self.state.after_close().map(|()| false),
        }
    }

    async fn send_flags(&mut self, message: &[u8], frame_flags: u8) -> Result<(), Status> {
        if !self.credit(message.len()).await? {
            return Ok(());
        }
        let (sender, id) = (self.state.mux.sender.clone(), self.state.id());
        match until(self.deadline, sender.send_message_async(id, frame_flags, message)).await {
            Some(sent) => sent.map_err(|e| Status::from_transport(&e)),
            None => Err(self.expire().await),
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

    /// See [`ClientCall::alloc`].
    pub(crate) async fn alloc(&mut self, len: usize) -> Result<BlockMut, Status> {
        let sender = self.state.mux.sender.clone();
        match until(self.deadline, sender.alloc_async(len)).await {
            Some(block) => block.map_err(|e| Status::from_transport(&e)),
            None => Err(self.expire().await),
        }
    }

    /// Sends a block from [`alloc`](Self::alloc) as one request message, as it is; `last`
    /// half-closes with it.
    pub(crate) async fn send_block(&mut self, block: BlockMut, last: bool) -> Result<(), Status> {
        if !self.credit(block.len()).await? {
            return Ok(());
        }
        let (sender, id) = (self.state.mux.sender.clone(), self.state.id());
        let f = if last { flags::END_STREAM } else { 0 };
        match until(self.deadline, sender.send_block_async(id, f, block)).await {
            Some(sent) => sent.map_err(|e| Status::from_transport(&e)),
            None => Err(self.expire().await),
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
            None => Err(self.expire().await),
        }
    }

    /// The next event, taken in; past the deadline the call ends with DEADLINE_EXCEEDED.
    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Result<Next, Status>> {
        self.state.settle();
        let inbox = &self.state.stream.shared.inbox;
        // The call reads its own reply (see `Mux::read_here`), unless its channel leaves that to
        // the reader task.
        if self.reads && !inbox.is_ready() {
            self.state.mux.read_here(cx, || inbox.is_ready());
        }
        if let Poll::Ready(ev) = inbox.poll_recv(cx) {
            let ev = ev.unwrap_or_else(|| crate::mux::Event::End(self.state.connection_end()));
            return Poll::Ready(Ok(self.state.absorb(ev)));
        }
        let Some(deadline) = self.deadline else { return Poll::Pending };
        let timer = self.timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        ready!(timer.as_mut().poll(cx));
        let message = "the call's deadline passed";
        self.state.cancel_blocking(Code::DeadlineExceeded, message, std::time::Instant::now());
        Poll::Ready(Err(Status::new(Code::DeadlineExceeded, message)))
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
    pub(crate) fn poll_headers(&mut self, cx: &mut Context<'_>) -> Poll<Result<crate::MetadataMap, Status>> {
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
    pub(crate) async fn headers(&mut self) -> Result<crate::MetadataMap, Status> {
        std::future::poll_fn(|cx| self.poll_headers(cx)).await
    }

    /// A handle that sends this call's request messages from another task while this one reads
    /// the responses (the tonic bridge does so). It stops, with an error, once the call has
    /// ended.
    pub(crate) fn send_half(&self) -> SendHalf {
        SendHalf { mux: self.state.mux.clone(), id: self.state.id(), shared: self.state.stream.shared.clone() }
    }

    /// The server's trailing metadata, once the call has ended with OK.
    pub(crate) fn trailers(&self) -> Option<&crate::MetadataMap> {
        self.state.trailers()
    }

    /// Cancels the call: the server sees CANCELLED and stops its handler.
    pub(crate) async fn cancel(mut self) {
        self.cancel_with(Code::Cancelled, "the call was cancelled").await;
    }
}

fn shm_only(what: &str) -> Status {
    Status::new(Code::Unimplemented, format!("{what} needs an shm:// channel"))
}

/// Sends a call's requests from one task or thread while another reads its responses
/// ([`ClientCall::sender`]); a bidi stream's two halves.
#[derive(Clone)]
pub struct CallSender {
    via: SenderVia,
}

#[derive(Clone)]
enum SenderVia {
    Shm(SendHalf),
    Http(crate::http_call::Requests),
}

impl std::fmt::Debug for CallSender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallSender").finish_non_exhaustive()
    }
}

impl CallSender {
    /// Sends one request message once flow control allows; `last` half-closes with it.
    /// `false` if the call is over (its status comes from the receiving side).
    pub async fn send(&self, message: &[u8], last: bool) -> bool {
        match &self.via {
            SenderVia::Shm(half) => half.send(message, last).await.is_ok(),
            SenderVia::Http(requests) => requests.send(Bytes::copy_from_slice(message), last).await,
        }
    }

    /// [`send`](Self::send) for a message already in [`Bytes`]: over HTTP/2 it is handed on
    /// without a copy (over `shm://` it is copied into shared memory either way).
    pub async fn send_bytes(&self, message: Bytes, last: bool) -> bool {
        match &self.via {
            SenderVia::Shm(half) => half.send(&message, last).await.is_ok(),
            SenderVia::Http(requests) => requests.send(message, last).await,
        }
    }

    /// Half-closes without a message.
    pub async fn close(&self) -> bool {
        match &self.via {
            SenderVia::Shm(half) => half.close().await.is_ok(),
            SenderVia::Http(requests) => {
                requests.close();
                true
            }
        }
    }
}

impl std::fmt::Debug for ClientCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.via {
            CallVia::Shm(call) => call.fmt(f),
            CallVia::Http(_) => f.debug_struct("ClientCall").field("over", &"http/2").finish_non_exhaustive(),
        }
    }
}

impl ClientCall {
    /// Sends one request message.
    pub async fn send(&mut self, message: &[u8]) -> Result<(), Status> {
        match &mut self.via {
            CallVia::Shm(call) => call.send(message).await,
            CallVia::Http(call) => call.send(Bytes::copy_from_slice(message), false).await.map(drop),
        }
    }

    /// Sends the last request message and half-closes in the same frame.
    pub async fn send_last(&mut self, message: &[u8]) -> Result<(), Status> {
        match &mut self.via {
            CallVia::Shm(call) => call.send_last(message).await,
            CallVia::Http(call) => call.send(Bytes::copy_from_slice(message), true).await.map(drop),
        }
    }

    /// A writable block of `len` bytes in this side's shared memory, for a message built in
    /// place: fill it (or serialize into it), then [`send_block`](Self::send_block) it. The
    /// server reads it where it is, with no copy on either side. Waits for room in the arena
    /// until the call's deadline. `shm://` only.
    ///
    /// ```no_run
    /// # async fn demo(channel: isthmus::Channel) -> Result<(), isthmus::Status> {
    /// let mut call = channel.start("/demo.Blob/Put", Default::default()).await?;
    /// let mut block = call.alloc(1 << 20).await?;
    /// block.fill(7); // or serialize straight into `&mut block[..]`
    /// call.send_block(block, true).await?;
    /// # Ok(()) }
    /// ```
    pub async fn alloc(&mut self, len: usize) -> Result<BlockMut, Status> {
        match &mut self.via {
            CallVia::Shm(call) => call.alloc(len).await,
            CallVia::Http(_) => Err(shm_only("alloc")),
        }
    }

    /// Sends a block from [`alloc`](Self::alloc) as one request message, as it is; `last`
    /// half-closes with it.
    pub async fn send_block(&mut self, block: BlockMut, last: bool) -> Result<(), Status> {
        match &mut self.via {
            CallVia::Shm(call) => call.send_block(block, last).await,
            CallVia::Http(_) => Err(shm_only("send_block")),
        }
    }

    /// Half-closes: no more request messages.
    pub async fn close_send(&mut self) -> Result<(), Status> {
        match &mut self.via {
            CallVia::Shm(call) => call.close_send().await,
            CallVia::Http(call) => {
                call.close_send();
                Ok(())
            }
        }
    }

    /// The next response message; `Ok(None)` once the server ended the call with OK (its
    /// trailers are then in [`trailers`](Self::trailers)); the server's status otherwise.
    ///
    /// Over `shm://` a large message is a view into the server's shared memory, not a copy;
    /// holding it keeps that memory from the server, so drop it (or copy what you keep) when
    /// done.
    pub async fn recv(&mut self) -> Result<Option<Bytes>, Status> {
        match &mut self.via {
            CallVia::Shm(call) => call.recv().await,
            CallVia::Http(call) => call.recv().await,
        }
    }

    /// The server's initial metadata, waiting for it if needed.
    pub async fn headers(&mut self) -> Result<crate::MetadataMap, Status> {
        match &mut self.via {
            CallVia::Shm(call) => call.headers().await,
            CallVia::Http(call) => call.headers().await,
        }
    }

    /// The server's trailing metadata, once the call has ended (with OK, over `shm://`).
    pub fn trailers(&self) -> Option<&crate::MetadataMap> {
        match &self.via {
            CallVia::Shm(call) => call.trailers(),
            CallVia::Http(call) => call.trailers(),
        }
    }

    /// A handle that sends this call's requests beside the task that reads its responses.
    pub fn sender(&self) -> CallSender {
        let via = match &self.via {
            CallVia::Shm(call) => SenderVia::Shm(call.send_half()),
            CallVia::Http(call) => SenderVia::Http(call.requests()),
        };
        CallSender { via }
    }

    /// Cancels the call: the server sees CANCELLED and stops its handler.
    pub async fn cancel(self) {
        match self.via {
            CallVia::Shm(call) => call.cancel().await,
            CallVia::Http(mut call) => call.cancel(),
        }
    }
}
