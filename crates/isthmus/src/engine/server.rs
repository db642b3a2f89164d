//! The server side over `shm://`: accepting connections, running each call's handler against
//! its deadline and its client's cancel, and the [`ServerCall`] a handler is given. The public
//! [`Server`](crate::Server) builds the handler table and serves it here and over HTTP/2.
//!
//! Accepting: each `shm://` listener is registered with tokio (`bind_shm`: an `unsafe` call, sound
//! because the `AsyncFd` owns the listener, so its fd stays open and the same for the
//! registration's life) and gets an accept loop, a task of its own. A would-block clears the
//! readiness; any other accept error (out of fds, say) is logged (`tracing` warning), counted
//! ([`ServerStats::accept_errors`]) and pauses the loop, 5 ms after the first error in a row and
//! twice as long after each next one, up to 1 s (grpc-go's schedule); the calls in progress go
//! on. Each accepted socket gets a task that runs the handshake on `spawn_blocking` (a failed
//! handshake is counted, [`ServerStats::handshakes_failed`], and logged at debug level: it is
//! mostly the client's doing), joins the server's list of connections, and becomes that
//! connection's reader (`Mux::read_loop`).
//!
//! Each call: the reader looks the handler up when it routes the HEADERS; the call's future counts
//! itself in flight (for graceful shutdown), gets its first poll on the reader task, and is spawned
//! only if that poll returns `Pending` (a call handed to a foreign handler stays with the reader
//! instead, ADR 0019). No frame is read during that poll, so a handler that blocks its thread,
//! or computes for long, before its first `.await` would stall every call of its connection and
//! run them one after another: once such a first poll has taken about 100 µs or more (`Pace`,
//! timed with the time-stamp counter), the handler's next calls become tasks of their own
//! before it runs, which the runtime's other workers take while the reader reads on (ADR 0031).
//! `supervise` polls the handler inside the call's future (no task of its own, so no hand-off
//! between workers per call), racing the deadline (measured from the call's first poll, just after
//! its HEADERS was read) and the cancel signal; the loser is dropped:
//!
//! - `Ok(())` ends the call OK, `Err(status)` with that status; trailing metadata set with
//!   `set_trailers` is appended to the status's own, for OK and errors alike, and goes out as
//!   TRAILERS with END_STREAM.
//! - A panic is INTERNAL, "the handler panicked: " and its text (a `&str` or `String` payload, else
//!   "a non-text panic"): `CatchPanic` polls under `catch_unwind`, so it ends that call only, and
//!   the reader goes on if it came in the first poll.
//! - The deadline drops the handler's future: DEADLINE_EXCEEDED.
//! - The client's CANCEL, the connection's end, or a client past its window fires the cancel
//!   signal: the handler's future is dropped and the server answers with a CANCEL carrying that
//!   code instead of a status, so the client drops any response it had under way in pieces.
//!
//! A call over `max_concurrent_streams` is refused before any of this: RESOURCE_EXHAUSTED, "the
//! server's limit of n concurrent calls per connection is reached" (grpcio's code for
//! `maximum_concurrent_rpcs`, though that counts per server). A call is open from its HEADERS until
//! its handler returns or the client's CANCEL arrives.
//!
//! The [`ServerCall`]:
//!
//! - `recv()` gives the next request, `None` after the client half-closed, or the call's end as an
//!   error. It reads through `Requests` (the call's request side, whose `poll_recv` the bridge's
//!   request body uses too; `take_requests` hands it over). Taking a message may send a WINDOW,
//!   never waiting for ring room. A large message is a view into the client's arena.
//! - `send_headers(metadata)` sends initial metadata once, before the first message; again, or
//!   after a message, is INTERNAL. Without it no HEADERS goes at all: the first MESSAGE implies
//!   empty metadata, so a unary reply is MESSAGE then TRAILERS.
//! - `send(message)` first sends credit still owed (`settle`), then waits for credit and sends.
//!   `alloc` and `send_block` build a reply in place. `set_trailers` replaces the trailing
//!   metadata.
//! - `send_last(message)` holds a small first-and-only response (`hold_last`, where the handshake
//!   agreed to one-frame calls) and the call's end sends it inside its TRAILERS: a unary reply is
//!   then one frame (protocol 13.9, ADR 0025). A binding's one-step reply (`HandedCall::try_reply`)
//!   goes the same way.
//! - `set_compression(c)` chooses how the call's replies are compressed over HTTP/2; on a call
//!   from the server's own bridge it becomes the reply metadata `x-isthmus-reply-encoding` (in
//!   HEADERS, so those go before the first message), which the bridge reads and removes.
//! - Sends and allocations are not bounded by the deadline themselves: dropping the handler at the
//!   deadline bounds them. A send on an ended stream fails with the connection's status if it died,
//!   else CANCELLED.
//!
//! Each call runs inside a `tracing` span `isthmus.serve` at DEBUG, with `path`, `stream` and
//! `code` (the status's code, or the cancel's for a call cancelled under it), so the handler's
//! events are inside it.
//!
//! Closures and [`Handler`] objects alike are stored as one boxed function per path (`HandlerFn`)
//! that returns a [`HandlerFuture`].

use std::collections::HashMap;
use std::future::Future;
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use isthmus_shm::{flags, Address, BlockMut, Config, Connection, ErrorKind, Kind, Listener, SharedArena, SharedBlock};
use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;
use tokio::time::Instant;
use tracing::Instrument;

use super::flow::{self, Credit};
use super::inbox::Event;
use super::mux::{Accept, CallFuture, Cancel, ConnectionCounters, Incoming, Mux, Stream, StreamShared};
use super::wire;
use crate::metadata::MetadataMap;
use crate::status::{Code, Status};

/// The future a [`Handler`] returns.
pub type HandlerFuture = Pin<Box<dyn Future<Output = Result<(), Status>> + Send>>;

/// A method's handler as a trait object: for handlers that carry state, or that are chosen at run
/// time (register with [`Server::handler_object`](crate::Server::handler_object)). A closure registered with
/// [`Server::handler`](crate::Server::handler) is the same thing.
///
/// ```
/// use isthmus::{Handler, HandlerFuture, ServerCall};
///
/// struct Counter(std::sync::atomic::AtomicU64);
///
/// impl Handler for Counter {
///     fn handle(self: std::sync::Arc<Self>, mut call: ServerCall) -> HandlerFuture {
///         Box::pin(async move {
///             let n = self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
///             call.send(&n.to_le_bytes()).await
///         })
///     }
/// }
///
/// let server = isthmus::Server::builder()
///     .handler_object("/demo.Counter/Next", std::sync::Arc::new(Counter(Default::default())));
/// ```
pub trait Handler: Send + Sync + 'static {
    /// Runs one call; returning ends it (`Ok(())` with OK, `Err(status)` with that status).
    fn handle(self: Arc<Self>, call: ServerCall) -> HandlerFuture;
}

pub(crate) type BoxFuture = HandlerFuture;

/// What answers each method: handlers by path, then the tonic services, if any.
#[derive(Clone)]
pub(crate) struct Methods {
    pub(crate) by_path: HashMap<String, HandlerFn, PathKeys>,
    /// The tonic services by path prefix (`/package.Service/`).
    pub(crate) services: Vec<(String, HandlerFn)>,
    /// Takes every other path ([`Server::fallback`](crate::Server::fallback)).
    pub(crate) catch_all: Option<HandlerFn>,
}

/// Hashes method paths for [`Methods`]: eight bytes at a step (FxHash's rotate, xor and
/// multiply), then murmur3's finalizer so the top bits that tag a bucket mix too. Unkeyed, as
/// the table holds the server's own methods and never a key a peer chose: a peer's path is only
/// looked up, and a lookup that collides costs a comparison. SipHash's rounds took ~20 ns of a
/// call that costs ~1.6 µs.
#[derive(Clone, Copy, Default)]
pub(crate) struct PathKeys;

impl std::hash::BuildHasher for PathKeys {
    type Hasher = PathHasher;

    fn build_hasher(&self) -> PathHasher {
        PathHasher(0)
    }
}

/// [`PathKeys`]'s hasher.
pub(crate) struct PathHasher(u64);

impl std::hash::Hasher for PathHasher {
    fn finish(&self) -> u64 {
        super::mux::fmix64(self.0)
    }

    fn write(&mut self, bytes: &[u8]) {
        const K: u64 = 0x517c_c1b7_2722_0a95;
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let word = u64::from_le_bytes(c.try_into().unwrap_or_default());
            self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(K);
        }
        let mut tail = [0u8; 8];
        tail[..chunks.remainder().len()].copy_from_slice(chunks.remainder());
        // The length too, so that a tail of zero bytes is not the same as none.
        let last = u64::from_le_bytes(tail) ^ ((bytes.len() as u64) << 56);
        self.0 = (self.0.rotate_left(5) ^ last).wrapping_mul(K);
    }
}

impl Methods {
    fn find(&self, path: &str) -> Option<HandlerFn> {
        if let Some(h) = self.by_path.get(path) {
            return Some(h.clone());
        }
        if let Some((_, h)) = self.services.iter().find(|(prefix, _)| path.starts_with(prefix.as_str())) {
            return Some(h.clone());
        }
        // A path of no service at all gets the engine's UNIMPLEMENTED, which names the method.
        self.catch_all.clone()
    }
}
pub(crate) type HandlerFn = Arc<Route<dyn Fn(ServerCall) -> BoxFuture + Send + Sync>>;

/// A registered handler (a method's, a tonic service's or the fallback) and its [`Pace`], in
/// one allocation.
pub(crate) struct Route<F: ?Sized> {
    pace: Pace,
    run: F,
}

/// Stores `run` as a registered handler.
pub(crate) fn route(run: impl Fn(ServerCall) -> BoxFuture + Send + Sync + 'static) -> HandlerFn {
    Arc::new(Route { pace: Pace::default(), run })
}

/// Whether a handler's calls get their first poll on the connection's reader. That poll saves
/// a task and a wake-up per call, but the reader reads nothing while it runs: a handler that
/// computes, or blocks its thread, before its first `.await` held up every other call of its
/// connection, and all of them ran one after another on one thread. Once a poll on the reader has
/// taken `SLOW` or more, the handler's next calls become tasks of their own before it runs
/// (the runtime's other workers take them, and the reader goes on reading): 64 calls, then
/// one call on the reader again to look, and twice as many calls after each slow look,
/// up to 65,536; a fast look ends the streak.
#[derive(Default)]
struct Pace {
    /// Calls still to send to their own task.
    defer: AtomicU32,
    /// The streak's current length; 0 while polls on the reader are fast.
    window: AtomicU32,
}

impl Pace {
    /// A first poll that takes this long is a handler the reader should not run: tokio's advice
    /// is 10-100 µs of work at most between two `.await`s. In ticks of the time-stamp counter
    /// (`isthmus_shm::ticks`, cheaper than a clock: this is timed on every call), so 60-250
    /// µs depending on the host's counter rate.
    const SLOW: u64 = 250_000;
    const FIRST_WINDOW: u32 = 64;
    const LAST_WINDOW: u32 = 1 << 16;

    /// True if this call is to become a task of its own before its handler runs.
    fn defer(&self) -> bool {
        // One relaxed load per call while polls on the reader are fast: the line stays shared.
        self.defer.load(Ordering::Relaxed) != 0
            && self.defer.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_ok()
    }

    /// A poll the connection's reader made of the handler (its first, or the second of a call
    /// that waited for its request) took `took` ticks.
    fn reader_poll_took(&self, took: u64) {
        if took >= Self::SLOW {
            let window =
                self.window.load(Ordering::Relaxed).saturating_mul(2).clamp(Self::FIRST_WINDOW, Self::LAST_WINDOW);
            self.window.store(window, Ordering::Relaxed);
            self.defer.store(window, Ordering::Relaxed);
        } else if self.window.load(Ordering::Relaxed) != 0 {
            self.window.store(0, Ordering::Relaxed);
        }
    }
}

/// Pending when the connection's reader gives the call its first poll, so that the reader
/// makes it a task of its own at once (`Mux::start_calls`); ready on that task.
struct OwnTask;

impl Future for OwnTask {
    type Output = ();

    fn poll(self: Pin<&mut Self>, _cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        // No waker to register: the reader spawns a call it polled that returned `Pending`
        // without handing itself off, and a new task is polled at once.
        if super::mux::polled_by_reader() {
            super::mux::to_own_task();
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    }
}

/// The server's side of one call, handed to its handler.
///
/// Response messages are flow-controlled: a `send` waits while the client has not taken the
/// messages already sent (up to a window of [`INITIAL_WINDOW`](crate::INITIAL_WINDOW) bytes, or
/// [`SMALL_INITIAL_WINDOW`](crate::SMALL_INITIAL_WINDOW) where the handshake agreed to it), so
/// a slow client holds back this handler and no other.
pub struct ServerCall {
    id: u64,
    /// The request side, whose stream (with both windows) and connection the sends use too:
    /// one reference to each per call, not two, since taking and dropping them is on every
    /// call's way to its reply.
    requests: Requests,
    /// (A copy of) the request side was taken: by the tonic bridge for a service's request body,
    /// or for a foreign handler's requests.
    requests_taken: bool,
    head: wire::RequestHead,
    deadline: Option<Instant>,
    headers_sent: bool,
    /// The handler's choice of compression for the replies (`set_compression`), as the
    /// `grpc-encoding` name the bridge is to use: sent with the initial metadata.
    reply_encoding: Option<&'static str>,
    peer: Peer,
}

/// A server call's connection, to learn when its server starts to shut down
/// ([`ServerCall::going_away`]).
pub(crate) struct GoingAway(Arc<Mux>);

impl GoingAway {
    /// Resolves once the server is shutting down: at once if it is already.
    pub(crate) async fn wait(&self) {
        self.0.gone_away().await;
    }

    /// Whether the server is shutting down, now.
    pub(crate) fn is_set(&self) -> bool {
        self.0.is_draining()
    }
}

/// Who has claimed the sending of a call's end (its status, or a CANCEL): the engine when the
/// handler returns, the handler itself through [`ServerCall::end_now`], or the connection's
/// reader when the peer broke the call (past its window, a message too large); only one does,
/// so the peer gets one end.
#[derive(Debug, Default)]
pub(crate) struct EndedBy(std::sync::atomic::AtomicU8);

impl EndedBy {
    const OPEN: u8 = 0;
    const HANDLER: u8 = 1;
    const ENGINE: u8 = 2;
    pub(crate) const READER: u8 = 3;

    /// Claims the end for `who`; false if another has it.
    pub(crate) fn claim(&self, who: u8) -> bool {
        use std::sync::atomic::Ordering;
        self.0.compare_exchange(Self::OPEN, who, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }

    /// The reader sent the call's end.
    fn by_reader(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Acquire) == Self::READER
    }
}

/// Who called: the client's address in gRPC's form, and its TLS certificate under mutual TLS.
#[derive(Debug, Clone, Default)]
pub(crate) struct Peer {
    addr: Arc<str>,
    tls: bool,
    cert: Option<Bytes>,
    /// The call came over HTTP/2, through this server's own bridge.
    bridged: bool,
}

impl Peer {
    /// An `shm://` client, by its credentials: `shm:pid=PID,uid=UID`.
    fn shm(info: isthmus_shm::PeerInfo) -> Peer {
        Peer { addr: format!("shm:pid={},uid={}", info.pid, info.uid).into(), tls: false, cert: None, bridged: false }
    }

    /// The peer of one call. Over the loopback (HTTP/2 calls handed on by this process's own
    /// bridge) the HTTP/2 client's address and certificate arrive as metadata, which is taken
    /// out here; any other client's metadata of those names is dropped, so no client can claim
    /// an identity (ADR 0012). The client's user agent, which any client may name as it likes
    /// (over HTTP/2 as over `shm://`), goes back into the metadata under `user-agent`, as
    /// grpcio's and grpc-go's handlers see it.
    fn of_call(&self, metadata: &mut MetadataMap, bridged: bool) -> Peer {
        use crate::http::endpoint::{PEER_CERT_HEADER, PEER_HEADER, PEER_TLS_HEADER};
        // One pass over the (usually few) keys; most calls carry none of these.
        if !metadata.iter().any(|(key, _)| key.starts_with(PEER_HEADER)) {
            return self.clone();
        }
        let addr = metadata.remove(PEER_HEADER);
        let cert = metadata.remove(PEER_CERT_HEADER);
        let tls = metadata.remove(PEER_TLS_HEADER).is_some();
        // The last: a channel's own agent follows the metadata a caller gave its call.
        if let Some(agent) = metadata.remove_last(crate::engine::wire::AGENT_KEY) {
            metadata.append_transport("user-agent", agent);
        }
        match (bridged, addr) {
            (true, Some(addr)) => Peer { addr: String::from_utf8_lossy(&addr).into(), tls, cert, bridged: true },
            _ => self.clone(),
        }
    }
}

impl std::fmt::Debug for ServerCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerCall").field("stream", &self.id).field("path", &self.head.path).finish()
    }
}

/// The receiving side of a server call: the client's messages, and the credit given back for
/// them.
pub(crate) struct Requests {
    stream: Stream,
    mux: Arc<Mux>,
    half_closed: bool,
}

impl Requests {
    /// Whether the next [`poll_recv`](Self::poll_recv) has something to give: a request, the
    /// half-close or the stream's end.
    pub(crate) fn is_ready(&self) -> bool {
        self.half_closed || self.stream.shared.inbox.is_ready()
    }

    /// Whether the client has half-closed and its requests have all been taken.
    pub(crate) fn half_closed(&self) -> bool {
        self.half_closed
    }

    /// Sends credit still owed to the client (see `Stream::settle`).
    pub(crate) fn settle(&mut self) {
        self.stream.settle(&self.mux);
    }

    /// The next request message; `None` once the client has half-closed.
    pub(crate) fn poll_recv(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<Option<Bytes>, Status>> {
        use std::task::Poll;
        if self.half_closed {
            return Poll::Ready(Ok(None));
        }
        self.settle();
        loop {
            let Poll::Ready(event) = self.stream.shared.inbox.poll_recv(cx) else {
                // Someone must read the connection for the request to come (ADR 0020).
                self.mux.need_reader();
                return Poll::Pending;
            };
            return Poll::Ready(match event {
                Some(Event::Message(m)) => {
                    self.stream.took(m.len(), &self.mux);
                    Ok(Some(m))
                }
                Some(Event::Last(m)) => {
                    // No credit back: the client sends nothing more (with a small window a
                    // unary request of 32 KiB would otherwise cost a WINDOW frame).
                    self.half_closed = true;
                    Ok(Some(m))
                }
                Some(Event::HalfClose) => {
                    self.half_closed = true;
                    Ok(None)
                }
                Some(Event::Headers(_)) => continue,
                Some(Event::End(status) | Event::Final(_, status)) => Err(status),
                None => Err(self.mux.dead().unwrap_or_else(|| Status::new(Code::Cancelled, "the call was cancelled"))),
            });
        }
    }
}

impl ServerCall {
    /// The call's stream as the reader shares it: events, windows, the end's state.
    fn shared(&self) -> &Arc<StreamShared> {
        &self.requests.stream.shared
    }

    /// The call's connection.
    fn mux(&self) -> &Arc<Mux> {
        &self.requests.mux
    }

    /// The connection, for a foreign handler's thread to read while it waits for calls.
    pub(crate) fn lender(&self) -> Option<super::mux::Lender> {
        self.mux().lender()
    }

    /// The method path, `/package.Service/Method`.
    pub fn path(&self) -> &str {
        &self.head.path
    }

    /// The client's initial metadata.
    pub fn metadata(&self) -> &MetadataMap {
        &self.head.metadata
    }

    /// The client's address as gRPC names peers: `ipv4:127.0.0.1:50000`, `ipv6:%5B::1%5D:50000` (grpc-core's form) or
    /// `unix:` over HTTP/2, `shm:pid=PID,uid=UID` over shared memory.
    pub fn peer(&self) -> &str {
        &self.peer.addr
    }

    /// Whether the call came over TLS.
    pub fn is_tls(&self) -> bool {
        self.peer.tls
    }

    /// The client's certificate, for a call that came over mutual TLS.
    pub fn peer_certificate(&self) -> Option<crate::PeerCertificate> {
        self.peer.cert.as_deref().and_then(crate::PeerCertificate::from_der)
    }

    /// Time left before the client's deadline, if it set one.
    pub fn time_remaining(&self) -> Option<Duration> {
        self.deadline.map(|d| d.saturating_duration_since(Instant::now()))
    }

    /// The next request message; `None` once the client has half-closed.
    ///
    /// A large message is a view into the client's shared memory, not a copy; holding it keeps
    /// that memory from the client, so drop it (or copy what you keep) when done.
    pub async fn recv(&mut self) -> Result<Option<Bytes>, Status> {
        if self.requests_taken {
            return Err(Status::new(Code::FailedPrecondition, "the request stream was handed to a tonic service"));
        }
        std::future::poll_fn(|cx| self.requests.poll_recv(cx)).await
    }

    /// Takes the request side, for the tonic bridge or a foreign handler; `recv` then fails.
    pub(crate) fn take_requests(&mut self) -> Option<Requests> {
        if std::mem::replace(&mut self.requests_taken, true) {
            return None;
        }
        let requests = &mut self.requests;
        Some(Requests {
            stream: requests.stream.hand_over(),
            mux: requests.mux.clone(),
            half_closed: requests.half_closed,
        })
    }

    /// Sends empty initial metadata now unless some already went (or a message, which implies
    /// it): for a handler about to wait for a request that the client sends only once the
    /// response has opened.
    pub(crate) async fn flush_headers(&mut self) -> Result<(), Status> {
        match self.headers_sent {
            true => Ok(()),
            false => self.send_headers(MetadataMap::new()).await,
        }
    }

    /// Sends initial metadata now (otherwise the first message implies empty metadata).
    pub async fn send_headers(&mut self, mut metadata: MetadataMap) -> Result<(), Status> {
        if self.headers_sent {
            return Err(Status::new(Code::Internal, "initial metadata was already sent"));
        }
        self.headers_sent = true;
        // The key is the engine's to send (`set_compression`), not a handler's.
        metadata.remove(crate::http::endpoint::REPLY_ENCODING_HEADER);
        if let Some(encoding) = self.reply_encoding.take() {
            // A name of `Compression`'s, or "identity": a valid value, so this cannot fail.
            let _ = metadata.append(crate::http::endpoint::REPLY_ENCODING_HEADER, encoding);
        }
        let body = wire::ResponseHead { metadata }.encode();
        self.mux().sender.send_async(Kind::Headers, 0, self.id, &body).await.map_err(|e| Status::from_transport(&e))
    }

    /// Compresses this call's response messages with `compression`, or sends them
    /// uncompressed (`None`) even where the server compresses its replies
    /// ([`Server::send_compressed`](crate::Server::send_compressed)): grpcio's
    /// `context.set_compression`. It applies where replies cross a wire: a call that came over
    /// HTTP/2 (through the server's bridge, which compresses them for a client whose
    /// `grpc-accept-encoding` lists the encoding; the others get them uncompressed). Over
    /// `shm://` nothing is compressed, and this does nothing.
    ///
    /// The choice goes with the initial metadata, so it must come before them (or the first
    /// message, which sends them): `false`, and nothing changed, after that.
    pub fn set_compression(&mut self, compression: Option<crate::Compression>) -> bool {
        if self.headers_sent {
            return false;
        }
        if self.peer.bridged {
            self.reply_encoding = Some(compression.map_or("identity", crate::Compression::name));
        }
        true
    }

    /// Sends the initial metadata now if a choice of compression is pending: it goes with them,
    /// and a message would imply them empty.
    async fn send_chosen_encoding(&mut self) -> Result<(), Status> {
        match self.reply_encoding.is_some() && !self.headers_sent {
            true => self.send_headers(MetadataMap::new()).await,
            false => Ok(()),
        }
    }

    /// Waits for credit to send `len` bytes. Initial metadata not sent by now is empty, which
    /// the first MESSAGE implies on its own (protocol 13.7, rule 2): one frame less per call;
    /// unless a choice of compression must go with them (`set_compression`).
    async fn ready_to_send(&mut self, len: usize) -> Result<(), Status> {
        self.send_chosen_encoding().await?;
        self.headers_sent = true;
        // Credit owed to the client goes first: it may be waiting for it to send what this
        // handler waits for.
        if !self.requests_taken {
            self.requests.settle();
        }
        if self.shared().send_window.starved() {
            // The credit comes in a WINDOW frame, which someone must read (ADR 0020).
            self.mux().need_reader();
        }
        match self.shared().send_window.take(flow::charge(len)).await {
            Credit::Taken => Ok(()),
            _ => Err(self.mux().dead().unwrap_or_else(|| Status::new(Code::Cancelled, "the call was cancelled"))),
        }
    }

    /// Sends one response message.
    pub async fn send(&mut self, message: &[u8]) -> Result<(), Status> {
        let shared = self.shared().clone();
        let mut writing = Writer::claim(&shared).await;
        self.ready_to_send(message.len()).await?;
        let out = super::mux::Outgoing { id: self.id, shared: &shared, flags: 0, deadline: None };
        let sent = self.mux().send_message(out, message).await;
        sent.map_err(|e| Status::from_transport(&e))?;
        writing.done();
        Ok(())
    }

    /// Sends the call's last response message. When it is the call's only one and small, and
    /// the connection agreed to one-frame calls, it is held and goes out inside the call's
    /// TRAILERS when the handler returns: one frame where two would go (protocol 13.9). So
    /// send nothing after it, and return soon: the client has it only then. Otherwise (or held
    /// in vain: the call ended first) as [`send`](Self::send).
    pub async fn send_last(&mut self, message: &[u8]) -> Result<(), Status> {
        if self.hold_last(message) {
            return Ok(());
        }
        // Boxed: held is the usual way, and `send`'s future would make every unary handler's
        // future (which this one is part of) larger by its size.
        Box::pin(self.send(message)).await
    }

    /// Holds `message` to go out inside the call's TRAILERS if it can (see
    /// [`send_last`](Self::send_last) and [`reserve_last`](Self::reserve_last)).
    fn hold_last(&mut self, message: &[u8]) -> bool {
        if !self.reserve_last(message.len()) {
            return false;
        }
        // `reserve_last` holds once per call at most (it marks the headers sent), so this sets.
        let _ = self.shared().last.set(message.to_vec());
        true
    }

    /// Makes ready for a last message of `len` bytes inside the call's TRAILERS, if it can go
    /// there: the call's first message, small, on a connection that agreed to one-frame calls,
    /// with credit for it now (taken). The caller then sends it with the status
    /// ([`end_now`](Self::end_now)) or holds it.
    pub(crate) fn reserve_last(&mut self, len: usize) -> bool {
        let ready = !self.headers_sent
            && self.reply_encoding.is_none()
            && self.mux().one_frame()
            && len + wire::PLAIN_TRAILERS_LEN <= self.mux().sender.inline_max()
            && self.shared().send_window.try_take(flow::charge(len)) == Credit::Taken;
        // The message implies empty initial metadata (protocol 13.7, rule 2).
        self.headers_sent |= ready;
        ready
    }

    /// Sends one small response message now, from the calling thread, if that takes no wait:
    /// it fits inline in the ring, the stream has credit, the ring has room, and no other send
    /// of the call is under way. False, with nothing sent, otherwise ([`send`](Self::send) then
    /// waits as it must). A foreign thread's unary reply goes this way with no future polled.
    pub(crate) fn try_send_now(&mut self, message: &[u8]) -> bool {
        let (sender, id) = (&self.mux().sender, self.id);
        // A choice of compression goes in HEADERS first, which `send` sends.
        let sent = (self.headers_sent || self.reply_encoding.is_none())
            && message.len() <= sender.inline_max()
            && push_now(self.shared(), Writer::HANDLER, message.len(), || {
                matches!(sender.try_send(Kind::Message, 0, id, message), Ok(true))
            });
        // The first message implies empty initial metadata (protocol 13.7, rule 2).
        self.headers_sent |= sent;
        sent
    }

    /// A writable block of `len` bytes in the server's shared memory, for a reply built in
    /// place: fill it (or serialize into it), then [`send_block`](Self::send_block) it. The
    /// client reads it where it is, with no copy on either side.
    ///
    /// ```no_run
    /// # async fn handler(mut call: isthmus::ServerCall) -> Result<(), isthmus::Status> {
    /// let mut block = call.alloc(4096).await?;
    /// block.fill(0xAB);
    /// call.send_block(block).await
    /// # }
    /// ```
    pub async fn alloc(&mut self, len: usize) -> Result<BlockMut, Status> {
        self.mux().sender.alloc_async(len).await.map_err(|e| Status::from_transport(&e))
    }

    /// [`alloc`](Self::alloc) without waiting: `None` while the arena has no room for `len`
    /// bytes, for a handler on an event loop's thread that must not wait (it can build its
    /// reply elsewhere and send it as a copy).
    pub fn try_alloc(&mut self, len: usize) -> Result<Option<BlockMut>, Status> {
        self.mux().sender.try_alloc(len).map_err(|e| Status::from_transport(&e))
    }

    /// Sends a block from [`alloc`](Self::alloc) as one response message, as it is.
    pub async fn send_block(&mut self, block: BlockMut) -> Result<(), Status> {
        if !self.mux().sender.owns(&block) {
            return Err(super::client::foreign_block());
        }
        let shared = self.shared().clone();
        let mut writing = Writer::claim(&shared).await;
        self.ready_to_send(block.len()).await?;
        self.mux().sender.send_block_async(self.id, 0, block).await.map_err(|e| Status::from_transport(&e))?;
        writing.done();
        Ok(())
    }

    /// The signal that this call's server is shutting down (it sent its connection GOAWAY):
    /// a call that would never end on its own (a [`Topic`](crate::Topic)'s subscription)
    /// ends on it, and the shutdown need not wait out its grace.
    pub(crate) fn going_away(&self) -> GoingAway {
        GoingAway(self.mux().clone())
    }

    /// The shared arena of the listener this call came through: a block of it
    /// ([`SharedArena::try_alloc`]) written once can be sent on many calls with
    /// [`send_shared`](Self::send_shared), each client reading it in place. `None` for a server
    /// configured without one.
    pub fn shared_arena(&self) -> Option<&SharedArena> {
        self.mux().sender.shared_arena()
    }

    /// The largest message this call's connection copies into its ring rather than sending
    /// a block (its `inline_max`).
    pub(crate) fn inline_max(&self) -> usize {
        self.mux().sender.inline_max()
    }

    /// Sends a block of a shared arena as one response message: by reference if it is this
    /// call's [`shared_arena`](Self::shared_arena) and the client does not hold it already, else
    /// as a copy. [`Topic`](crate::Topic) uses this to write a message once for every subscriber.
    pub async fn send_shared(&mut self, block: &SharedBlock) -> Result<(), Status> {
        let shared = self.shared().clone();
        let mut writing = Writer::claim(&shared).await;
        self.ready_to_send(block.len()).await?;
        self.mux().sender.send_shared_async(self.id, 0, block).await.map_err(|e| Status::from_transport(&e))?;
        writing.done();
        Ok(())
    }

    /// A way to send on this call from another thread while its handler waits, for a topic's
    /// publisher (see [`Direct`]). The initial metadata go now, if they have not: a subscriber
    /// may wait for them before the first message, which may be long in coming (tonic's
    /// generated client waits for them to return the stream; so does grpc-go's `Header()`).
    pub(crate) async fn direct(&mut self) -> Result<Direct, Status> {
        self.flush_headers().await?;
        Ok(Direct { sender: self.mux().sender.clone(), id: self.id, shared: self.shared().clone() })
    }

    /// Trailing metadata to send with the final status (OK or not).
    pub fn set_trailers(&self, metadata: MetadataMap) {
        if let Ok(mut t) = self.shared().trailers.lock() {
            *t = metadata;
            self.shared().trailers_set.store(true, Ordering::Release);
        }
    }

    /// Sends the call's status now, from the calling thread, instead of when the handler's
    /// future returns: a binding whose handlers run on threads of their own (Python's) ends
    /// each call without waking the engine's task first, which on a busy machine costs a
    /// cross-core wake-up per call. The status goes out at once if the ring has room, else
    /// from a task of the runtime. False, and nothing sent, if the call has already ended (its
    /// deadline, the client's cancel, or an earlier `end_now`). `last`, made ready with
    /// [`reserve_last`](Self::reserve_last) (or one held), goes inside the status: one frame.
    pub(crate) fn end_now(&self, status: Status, last: Option<&[u8]>) -> bool {
        if !self.shared().ended.claim(EndedBy::HANDLER) {
            return false;
        }
        let status = with_set_trailers(status, self.shared());
        // Closed once the end has gone, as `run_call` does.
        let _unlisted = self.mux().unlist(self.id);
        self.mux().calls.finish(status.code());
        let (mux, id, body) = (self.mux().clone(), self.id, wire::encode_trailers(&status));
        // A message given here was never held (`try_reply`): no lock to take for it.
        let held = if last.is_none() { self.shared().last.get() } else { None };
        let last = last.or(held.map(Vec::as_slice));
        // Straight onto the ring when it has room (the common case): no future, no runtime.
        if try_send_end(&mux.sender, id, &body, last) {
            return true;
        }
        let last = last.map(<[u8]>::to_vec);
        let mut send = Box::pin(async move {
            send_end(&mux.sender, id, &body, last.as_deref()).await;
        });
        // The caller is a foreign thread (Python's, C's): the send's wait for ring room needs the
        // runtime's reactor, so it runs in the runtime's context, and goes on as its task.
        let runtime = crate::binding::runtime();
        let first = {
            let _context = runtime.enter();
            send.as_mut().poll(&mut std::task::Context::from_waker(std::task::Waker::noop()))
        };
        if first.is_pending() {
            drop(runtime.spawn(send));
        }
        true
    }
}

/// Sends a call's end now if the ring has room: its TRAILERS `body`, with the call's held `last`
/// message inside when the two fit inline (a one-frame call's end, protocol 13.9). False, with
/// nothing sent, otherwise.
fn try_send_end(sender: &isthmus_shm::Sender, id: u64, body: &[u8], last: Option<&[u8]>) -> bool {
    let pushed = match last {
        None => sender.try_send(Kind::Trailers, flags::END_STREAM, id, body),
        Some(m) if body.len() + m.len() <= sender.inline_max() => {
            sender.try_send_parts(Kind::Trailers, flags::END_STREAM | wire::WITH_MESSAGE, id, &[body, m])
        }
        Some(_) => Ok(false),
    };
    let pushed = matches!(pushed, Ok(true));
    if let (true, Some(m)) = (pushed, last) {
        sender.count_sent_inside(m.len());
    }
    pushed
}

/// Sends a call's end, waiting for ring room: as [`try_send_end`], or the held message as a
/// MESSAGE of its own before the TRAILERS when the two do not fit one frame (a long status
/// message, many trailers). Its credit was taken when it was held.
async fn send_end(sender: &isthmus_shm::Sender, id: u64, body: &[u8], last: Option<&[u8]>) {
    let _ = match last {
        None => sender.send_async(Kind::Trailers, flags::END_STREAM, id, body).await,
        Some(m) if body.len() + m.len() <= sender.inline_max() => {
            let f = flags::END_STREAM | wire::WITH_MESSAGE;
            let sent = sender.send_parts_async(Kind::Trailers, f, id, &[body, m]).await;
            if sent.is_ok() {
                sender.count_sent_inside(m.len());
            }
            sent
        }
        Some(m) => match sender.send_message_async(id, 0, m).await {
            Ok(()) => sender.send_async(Kind::Trailers, flags::END_STREAM, id, body).await,
            Err(e) => Err(e),
        },
    };
}

/// Sends a response message on a call from outside its handler, only when that takes no wait:
/// the stream has credit and the ring has room. A topic's publisher uses it for subscribers whose
/// handlers wait idle, so a publish reaches them with no task woken (ADR 0016); the caller
/// keeps the order of the call's messages (the topic sends this way only when nothing of that
/// subscriber's is queued or being sent).
pub(crate) struct Direct {
    sender: isthmus_shm::Sender,
    id: u64,
    shared: Arc<StreamShared>,
}

impl Direct {
    /// Sends `block` by reference, or `bytes` inline, now; false, with nothing sent, if that would
    /// wait, copy a large message, or the call is over or being written by its handler.
    pub(crate) fn try_send(&self, block: Option<&SharedBlock>, bytes: impl FnOnce() -> Bytes) -> bool {
        // A look first (`push_now` claims the stream for real): `bytes` may copy, for nothing
        // while the handler writes.
        if self.shared.writer.load(Ordering::Acquire) != Writer::FREE {
            return false;
        }
        let bytes = if block.is_none() { Some(bytes()) } else { None };
        let len = bytes.as_ref().map_or_else(|| block.map_or(0, |b| b.len()), |b| b.len());
        // Only what goes in one frame: a message in pieces cut short by a full ring would leave
        // the stream in the middle of a message.
        let one_frame = match &bytes {
            Some(_) => len <= self.sender.inline_max(),
            None => len <= self.sender.max_block() / 2,
        };
        one_frame
            && push_now(&self.shared, Writer::DIRECT, len, || match (block, &bytes) {
                // A block the client still holds would be copied here, on the publisher's
                // thread: the handler sends that one.
                (Some(block), _) => {
                    let now = Some(std::time::Instant::now());
                    matches!(self.sender.send_shared_by_reference(self.id, 0, block, now), Ok(true))
                }
                (None, Some(bytes)) => matches!(self.sender.try_send(Kind::Message, 0, self.id, bytes), Ok(true)),
                (None, None) => false,
            })
    }
}

/// Sends a message on a stream now, with no wait, as writer `role`: if no one else is writing
/// it and it has credit for `len` bytes, `push` puts the message's one frame on the ring (without
/// waiting) and says whether it went; the credit comes back if it did not. False, with nothing
/// sent, otherwise. A topic's direct sends and a foreign handler's reply share it.
fn push_now(shared: &StreamShared, role: u8, len: usize, push: impl FnOnce() -> bool) -> bool {
    let writer = &shared.writer;
    if writer.compare_exchange(Writer::FREE, role, Ordering::AcqRel, Ordering::Acquire).is_err() {
        return false;
    }
    let charge = flow::charge(len);
    let sent = shared.send_window.try_take(charge) == Credit::Taken && {
        let pushed = push();
        if !pushed {
            // Nothing went: the credit comes back (a WINDOW's grant would do the same).
            shared.send_window.grant(charge as u64);
        }
        pushed
    };
    writer.store(Writer::FREE, Ordering::Release);
    sent
}

/// Who writes messages on a call's stream. The transport allows one writer per stream at a time
/// (a message in pieces must not be interleaved), and a topic's direct sends come from the
/// publisher's thread while the handler may send too: the handler waits the few µs a direct send
/// takes, and a direct send gives way to the handler. A handler's send abandoned midway (its
/// future dropped, or failed) may have cut a message in pieces, so no direct send follows it.
pub(crate) struct Writer<'a> {
    state: Option<&'a std::sync::atomic::AtomicU8>,
    done: bool,
}

impl<'a> Writer<'a> {
    const FREE: u8 = 0;
    const HANDLER: u8 = 1;
    const DIRECT: u8 = 2;
    const ABANDONED: u8 = 3;

    /// Takes the stream for the handler's send.
    async fn claim(shared: &'a StreamShared) -> Writer<'a> {
        let state = &shared.writer;
        loop {
            match state.compare_exchange(Self::FREE, Self::HANDLER, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Writer { state: Some(state), done: false },
                // The handler's own stream; direct sends stay off.
                Err(Self::ABANDONED) => return Writer { state: None, done: false },
                Err(_) => tokio::task::yield_now().await,
            }
        }
    }

    /// The send went out whole.
    fn done(&mut self) {
        self.done = true;
    }
}

impl Drop for Writer<'_> {
    fn drop(&mut self) {
        if let Some(state) = self.state {
            state.store(if self.done { Self::FREE } else { Self::ABANDONED }, Ordering::Release);
        }
    }
}

/// `status` with the trailing metadata set by `set_trailers` after its own.
fn with_set_trailers(status: Status, shared: &StreamShared) -> Status {
    // The handler set its trailers before it returned or ended the call, which is before this.
    if !shared.trailers_set.load(Ordering::Acquire) {
        return status;
    }
    let set = shared.trailers.lock().map(|mut t| std::mem::take(&mut *t)).unwrap_or_default();
    if set.is_empty() {
        status
    } else {
        let mut all = status.metadata().clone();
        all.extend(&set);
        status.with_metadata(all)
    }
}

/// Binds an `shm://` listener and registers it with tokio; `bridge` marks the loopback.
pub(crate) fn bind_shm(target: &str, config: &Config, bridge: bool) -> Result<AsyncFd<Accepting>, Status> {
    let addr: Address = target.parse().map_err(|e| Status::from_transport(&e))?;
    let listener = Listener::bind(&addr, config.clone()).map_err(|e| Status::from_transport(&e))?;
    watch(listener, bridge, target)
}

/// [`bind_shm`], but `None` where a live server has the address already (or the path is no
/// socket), for a caller that then tries another name.
pub(crate) fn bind_shm_unless_taken(
    target: &str,
    config: &Config,
    bridge: bool,
) -> Result<Option<AsyncFd<Accepting>>, Status> {
    let addr: Address = target.parse().map_err(|e| Status::from_transport(&e))?;
    match Listener::bind(&addr, config.clone()) {
        Ok(listener) => watch(listener, bridge, target).map(Some),
        Err(e) if e.kind() == ErrorKind::AddrInUse => Ok(None),
        Err(e) => Err(Status::from_transport(&e)),
    }
}

/// A bound listener, non-blocking and registered with tokio.
fn watch(listener: Listener, bridge: bool, target: &str) -> Result<AsyncFd<Accepting>, Status> {
    listener.set_nonblocking(true).map_err(|e| Status::from_transport(&e))?;
    // SAFETY: the AsyncFd owns the listener, so its fd stays open for the registration's life.
    unsafe { AsyncFd::register_with_interest(Accepting { listener, bridge }, tokio::io::Interest::READABLE) }
        .map_err(|e| Status::new(Code::Unavailable, format!("cannot watch {target}: {}", std::io::Error::from(e))))
}

/// Reads a serving server's counters (from [`Bound::stats`](crate::Bound::stats)).
#[derive(Clone)]
pub struct ServerStats(pub(crate) Arc<Tracker>);

impl std::fmt::Debug for ServerStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerStats").field("connections", &self.connections().len()).finish()
    }
}

impl ServerStats {
    /// Accepts on a `shm://` listener that failed (out of file descriptors, say) since the
    /// server started serving; each is also logged as a `tracing` warning, and the listener
    /// tries again after a pause.
    pub fn accept_errors(&self) -> u64 {
        self.0.accept_errors.load(Ordering::Relaxed)
    }

    /// `shm://` connections accepted whose handshake failed: the client went away or spoke
    /// another version, a policy refused it, or the segment could not be made.
    pub fn handshakes_failed(&self) -> u64 {
        self.0.handshakes_failed.load(Ordering::Relaxed)
    }

    /// Counters of every live connection, one entry each.
    pub fn connections(&self) -> Vec<ConnectionCounters> {
        self.0
            .connections
            .lock()
            .map(|c| c.iter().filter_map(|w| w.upgrade()).map(|m| m.counters()).collect())
            .unwrap_or_default()
    }
}

/// What a graceful shutdown's GOAWAY says.
pub(crate) const GOING_AWAY: &str = "the server is shutting down";

/// The server's connections and calls in progress, for a graceful shutdown and counters.
#[derive(Default)]
pub(crate) struct Tracker {
    pub(crate) connections: Mutex<Vec<std::sync::Weak<Mux>>>,
    pub(crate) calls: std::sync::atomic::AtomicUsize,
    pub(crate) idle: Notify,
    /// Set by a graceful shutdown before it lists `connections`: a connection whose handshake
    /// ends after that list was made closes itself (`serve_connection`).
    pub(crate) stopping: std::sync::atomic::AtomicBool,
    /// [`ServerStats::accept_errors`].
    pub(crate) accept_errors: std::sync::atomic::AtomicU64,
    /// [`ServerStats::handshakes_failed`].
    pub(crate) handshakes_failed: std::sync::atomic::AtomicU64,
}

/// Counts a call in progress for as long as it lives.
struct CallGuard(Arc<Tracker>);

impl CallGuard {
    fn new(t: &Arc<Tracker>) -> CallGuard {
        t.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        CallGuard(t.clone())
    }
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        use std::sync::atomic::Ordering::SeqCst;
        // Only a graceful shutdown waits for `idle`, and it sets `stopping` before it looks at
        // `calls` (all SeqCst): it sees this call's end, or this sees it stopping. A `Notify`
        // takes a lock even with nobody to wake, and a server at one call in flight gets here
        // every call.
        if self.0.calls.fetch_sub(1, SeqCst) == 1 && self.0.stopping.load(SeqCst) {
            self.0.idle.notify_waiters();
        }
    }
}

/// Accepts `shm://` connections until `stop` completes, then drops the listener (which removes
/// its socket).
pub(crate) async fn accept_shm(
    listener: AsyncFd<Accepting>,
    handlers: Arc<Methods>,
    tracker: Arc<Tracker>,
    stream_limit: usize,
    stop: impl Future<Output = ()>,
) -> Result<(), Status> {
    tokio::pin!(stop);
    let mut pause = None;
    loop {
        tokio::select! {
            () = &mut stop => return Ok(()),
            ready = listener.readable() => {
                let mut guard = ready.map_err(|e| Status::new(Code::Unavailable, e.to_string()))?;
                match guard.get_inner().listener.accept_incoming() {
                    Ok(incoming) => {
                        pause = None;
                        let (handlers, tracker) = (handlers.clone(), tracker.clone());
                        let bridge = guard.get_inner().bridge;
                        tokio::spawn(async move {
                            // The handshake reads with timeouts: keep it off the reactor.
                            match tokio::task::spawn_blocking(move || incoming.handshake()).await {
                                Ok(Ok(conn)) => serve_connection(conn, handlers, tracker, stream_limit, bridge).await,
                                Ok(Err(e)) => {
                                    tracker.handshakes_failed.fetch_add(1, Ordering::Relaxed);
                                    tracing::debug!(error = %e, "isthmus: a shm:// handshake failed");
                                }
                                Err(_) => {
                                    tracker.handshakes_failed.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                        });
                    }
                    Err(e) if e.kind() == ErrorKind::Timeout => guard.clear_ready(),
                    // Out of fds, say: keep serving the calls we have and try again, less often
                    // while it lasts, rather than take the whole server down.
                    Err(e) => {
                        let p: Duration = pause.map_or(ACCEPT_PAUSE_MIN, |p: Duration| (p * 2).min(ACCEPT_PAUSE_MAX));
                        pause = Some(p);
                        tracker.accept_errors.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(error = %e, retry_in = ?p, "isthmus: accepting a shm:// connection failed");
                        tokio::time::sleep(p).await;
                    }
                }
            }
        }
    }
}

/// The pause after the first accept error in a row; each next one doubles it, up to
/// [`ACCEPT_PAUSE_MAX`].
pub(crate) const ACCEPT_PAUSE_MIN: Duration = Duration::from_millis(5);
/// The longest pause between two accepts that fail.
pub(crate) const ACCEPT_PAUSE_MAX: Duration = Duration::from_secs(1);

/// The listener as tokio sees it.
pub(crate) struct Accepting {
    pub(crate) listener: Listener,
    /// The server's private endpoint for its HTTP/2 bridge, whose calls carry their HTTP/2
    /// peer as metadata.
    pub(crate) bridge: bool,
}

impl AsRawFd for Accepting {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsFd;
        self.listener.as_fd().as_raw_fd()
    }
}

async fn serve_connection(
    conn: Connection,
    handlers: Arc<Methods>,
    tracker: Arc<Tracker>,
    stream_limit: usize,
    bridge: bool,
) {
    let info = conn.sender.peer();
    // Only this process's own bridge may say who an HTTP/2 caller is.
    let bridged = bridge && u32::try_from(info.pid).is_ok_and(|pid| pid == std::process::id());
    let peer = Peer::shm(info);
    let (sender, receiver) = conn.split();
    let mux = Mux::serving(sender, &receiver, stream_limit);
    if let Ok(mut c) = tracker.connections.lock() {
        c.retain(|w| w.strong_count() > 0);
        c.push(Arc::downgrade(&mux));
    }
    // Listed before this look, under the same lock as the shutdown's list: a connection the
    // shutdown did not list sees `stopping` here. Its client had begun the handshake before
    // the listener closed; it gets GOAWAY and the connection closes, as the others' will.
    if tracker.stopping.load(std::sync::atomic::Ordering::SeqCst) {
        mux.go_away(GOING_AWAY).await;
        mux.sender.close();
        return;
    }
    let reader_mux = mux.clone();
    let make = Box::new(move |mut incoming: Incoming| -> CallFuture {
        let handler = handlers.find(&incoming.head.path);
        let guard = CallGuard::new(&tracker);
        let mux = mux.clone();
        let peer = peer.of_call(&mut incoming.head.metadata, bridged);
        Box::pin(run_call(mux, incoming, handler, peer, guard))
    });
    reader_mux.read_loop(receiver, Some(Accept::new(make))).await;
}

/// Runs one call's handler against its deadline and the client's cancel, then sends its status;
/// `guard` counts the call in progress until then.
///
/// One future per call, allocated per call: a plain function around one `async` block (an
/// `async fn` would keep its arguments beside the block's copies of them), so that it stays
/// within the allocator's fast size classes.
fn run_call(
    mux: Arc<Mux>,
    incoming: Incoming,
    handler: Option<HandlerFn>,
    peer: Peer,
    guard: CallGuard,
) -> impl Future<Output = ()> + Send {
    let Incoming { head, stream } = incoming;
    let span =
        tracing::debug_span!("isthmus.serve", path = %head.path, stream = stream.id, code = tracing::field::Empty);
    let recorder = span.clone();
    async move {
        let _guard = guard;
        let id = stream.id;
        let shared = stream.shared.clone();
        let pace = handler.as_ref().map(|h| &h.pace);
        // When the call's own task is to run it: when it arrived, which its deadline counts from.
        let mut arrived = None;
        if pace.is_some_and(Pace::defer) {
            arrived = Some(Instant::now());
            OwnTask.await;
        }
        let status = match begin_call(&mux, head, stream, handler.as_ref(), peer, arrived) {
            Ok((fut, deadline)) => {
                // A call that waited for its task may be over already: its handler, which would
                // hold this thread first, does not run.
                let over = match arrived {
                    Some(_) if shared.cancel.fired() => Some(Outcome::Cancelled),
                    Some(_) if deadline.is_some_and(|d| d <= Instant::now()) => Some(Outcome::DeadlineExceeded),
                    _ => None,
                };
                let outcome = match over {
                    Some(outcome) => outcome,
                    None => supervise(fut, deadline, &shared.cancel, pace).await,
                };
                outcome_status(outcome, &shared)
            }
            Err(status) => Some(status),
        };
        // The cancel's code (under its lock) only for a call without a status.
        let code = status.as_ref().map_or_else(|| shared.cancel.code(), Status::code);
        recorder.record("code", tracing::field::debug(code));
        if !shared.ended.claim(EndedBy::ENGINE) {
            // The handler sent the end itself (`ServerCall::end_now`), which counted it; or the
            // reader did, which counts it not.
            if shared.ended.by_reader() {
                mux.calls.finish(shared.cancel.code());
            }
            return;
        }
        match status {
            Some(status) => {
                // Out of the table before the end goes (the client may open its next call at
                // once, and this one must not count against the limit then), closed after it:
                // the wakings that closing does are not on the client's way.
                let unlisted = mux.unlist(id);
                mux.calls.finish(status.code());
                let body = wire::encode_trailers(&status);
                let last = shared.last.get().map(Vec::as_slice);
                // Waiting for ring room is rare: its future, boxed, keeps every call's small.
                if !try_send_end(&mux.sender, id, &body, last) {
                    Box::pin(send_end(&mux.sender, id, &body, last)).await;
                }
                drop(unlisted);
            }
            // The client is gone or gave up: it expects no status. Answer with CANCEL so the
            // client drops anything half-sent on this stream.
            None => {
                let code = shared.cancel.code();
                mux.calls.finish(code);
                Box::pin(mux.cancel(id, code)).await;
            }
        }
    }
    .instrument(span)
}

/// The call's handler future and deadline; or, without a handler, the status to send at once.
/// Not `async`: what it takes moves into the `ServerCall`, and the call's future holds only the
/// handler's (boxed) future while it runs, not a second copy of them.
fn begin_call(
    mux: &Arc<Mux>,
    head: wire::RequestHead,
    stream: Stream,
    handler: Option<&HandlerFn>,
    peer: Peer,
    arrived: Option<Instant>,
) -> Result<(BoxFuture, Option<Instant>), Status> {
    mux.calls.start();
    let Some(handler) = handler else {
        return Err(Status::new(
            Code::Unimplemented,
            format!("method {} is not implemented by this server", head.path),
        ));
    };
    let deadline = head.timeout.map(|t| arrived.unwrap_or_else(Instant::now) + t);
    let call = ServerCall {
        id: stream.id,
        requests: Requests { stream, mux: mux.clone(), half_closed: false },
        requests_taken: false,
        head,
        deadline,
        headers_sent: false,
        reply_encoding: None,
        peer,
    };
    Ok(((handler.run)(call), deadline))
}

/// The status a handler's outcome sends; `None` if the call was cancelled under it.
fn outcome_status(outcome: Outcome, shared: &StreamShared) -> Option<Status> {
    let status = match outcome {
        Outcome::Done(Ok(())) => Status::ok(),
        Outcome::Done(Err(status)) => status,
        Outcome::Panicked(what) => Status::new(Code::Internal, format!("the handler panicked: {what}")),
        Outcome::DeadlineExceeded => Status::deadline_exceeded(),
        Outcome::Cancelled => return None,
    };
    // Trailers set on the call go after any the returned status carries.
    Some(with_set_trailers(status, shared))
}

enum Outcome {
    Done(Result<(), Status>),
    Panicked(String),
    DeadlineExceeded,
    Cancelled,
}

/// Polls a handler where it is (no task of its own, so no hand-off between worker threads per
/// call) and turns a panic inside it into a value instead of unwinding into the server. A poll
/// the connection's reader makes is timed for the handler's [`Pace`].
struct CatchPanic<'a>(BoxFuture, Option<&'a Pace>);

impl Future for CatchPanic<'_> {
    type Output = Result<Result<(), Status>, String>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        // Every poll the reader makes (a call that waited for its request gets a second one).
        let timed = self.1.filter(|_| super::mux::polled_by_reader()).map(|p| (p, isthmus_shm::ticks()));
        let handler = self.0.as_mut();
        let polled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handler.poll(cx)));
        // A call handed to a foreign thread that did not finish it here ran no handler here
        // (Python's queue theirs): how long its poll took says nothing of the handler.
        let ran_here = !(matches!(polled, Ok(std::task::Poll::Pending)) && super::mux::handing_off());
        if let Some((pace, start)) = timed.filter(|_| ran_here) {
            pace.reader_poll_took(isthmus_shm::ticks().saturating_sub(start));
        }
        match polled {
            Ok(std::task::Poll::Pending) => std::task::Poll::Pending,
            Ok(std::task::Poll::Ready(r)) => std::task::Poll::Ready(Ok(r)),
            Err(p) => std::task::Poll::Ready(Err(crate::status::panic_text(&*p))),
        }
    }
}

/// Runs the handler against the deadline and the cancel signal; the losing branch's handler
/// future is dropped, which is what stops it.
async fn supervise(fut: BoxFuture, deadline: Option<Instant>, cancelled: &Cancel, pace: Option<&Pace>) -> Outcome {
    // Boxed, and only for a call with a deadline: a timer's state would make every call's
    // future larger than the allocator's fast size classes.
    let expired = async {
        match deadline {
            Some(d) => Box::pin(tokio::time::sleep_until(d)).await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        // In order, the handler first: no random number per poll, and the cancel signal is not
        // even registered for a handler that finishes in its first poll.
        biased;
        r = CatchPanic(fut, pace) => match r {
            Ok(r) => Outcome::Done(r),
            Err(what) => Outcome::Panicked(what),
        },
        () = expired => Outcome::DeadlineExceeded,
        () = cancelled.signal.notified() => Outcome::Cancelled,
    }
}

#[cfg(test)]
mod tests {
    use std::hash::BuildHasher;

    use super::{Pace, PathKeys};

    /// Paths that differ anywhere (in a full eight-byte word, in the tail, or only in length by
    /// trailing zero bytes) hash apart, and the same path alike.
    #[test]
    fn paths_hash_apart() {
        let paths = ["/a.B/C", "/a.B/D", "/pkg.Service/Method", "/pkg.Servicf/Method", "/x", "/x\0", "/x\0\0", ""];
        let hashes: Vec<u64> = paths.iter().map(|p| PathKeys.hash_one(p)).collect();
        for (i, a) in hashes.iter().enumerate() {
            for b in &hashes[i + 1..] {
                assert_ne!(a, b, "{paths:?}");
            }
        }
        assert_eq!(PathKeys.hash_one("/pkg.Service/Method"), hashes[2]);
    }

    const SLOW: u64 = Pace::SLOW;

    fn deferred(pace: &Pace) -> u32 {
        std::iter::from_fn(|| pace.defer().then_some(())).take(1 << 20).count() as u32
    }

    #[test]
    fn fast_first_polls_defer_nothing() {
        let pace = Pace::default();
        for _ in 0..10 {
            pace.reader_poll_took(SLOW - 1);
            assert!(!pace.defer());
        }
    }

    #[test]
    fn each_slow_look_doubles_the_streak_up_to_its_cap_and_a_fast_one_ends_it() {
        let pace = Pace::default();
        let mut streaks = Vec::new();
        for _ in 0..13 {
            pace.reader_poll_took(SLOW);
            streaks.push(deferred(&pace));
        }
        assert_eq!(streaks, [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 65536, 65536]);
        pace.reader_poll_took(0);
        assert!(!pace.defer());
        pace.reader_poll_took(u64::MAX);
        assert_eq!(deferred(&pace), 64, "a fast look starts the next streak over");
    }
}
