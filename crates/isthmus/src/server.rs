//! The server: handlers registered by method path, served on an `shm://` endpoint.

use std::collections::HashMap;
use std::future::Future;
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use isthmus_shm::{flags, Address, Config, Connection, ErrorKind, Kind, Listener};
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, Notify};
use tokio::time::Instant;

use crate::metadata::MetadataMap;
use crate::mux::{Cancel, ConnectionCounters, Event, Incoming, Mux};
use crate::status::{Code, Status};
use crate::wire;

type BoxFuture = Pin<Box<dyn Future<Output = Result<(), Status>> + Send>>;
type Handler = Arc<dyn Fn(ServerCall) -> BoxFuture + Send + Sync>;

/// The server's side of one call, handed to its handler.
pub struct ServerCall {
    stream: u64,
    mux: Arc<Mux>,
    head: wire::RequestHead,
    deadline: Option<Instant>,
    events: mpsc::UnboundedReceiver<Event>,
    half_closed: bool,
    headers_sent: bool,
    trailers: Arc<Mutex<MetadataMap>>,
}

impl std::fmt::Debug for ServerCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerCall").field("stream", &self.stream).field("path", &self.head.path).finish()
    }
}

impl ServerCall {
    /// The method path, `/package.Service/Method`.
    pub fn path(&self) -> &str {
        &self.head.path
    }

    /// The client's initial metadata.
    pub fn metadata(&self) -> &MetadataMap {
        &self.head.metadata
    }

    /// Time left before the client's deadline, if it set one.
    pub fn time_remaining(&self) -> Option<Duration> {
        self.deadline.map(|d| d.saturating_duration_since(Instant::now()))
    }

    /// The next request message; `None` once the client has half-closed.
    pub async fn recv(&mut self) -> Result<Option<Bytes>, Status> {
        if self.half_closed {
            return Ok(None);
        }
        loop {
            match self.events.recv().await {
                Some(Event::Message(m)) => return Ok(Some(m)),
                Some(Event::HalfClose) => {
                    self.half_closed = true;
                    return Ok(None);
                }
                Some(Event::Headers(_)) => {}
                Some(Event::End(status)) => return Err(status),
                None => {
                    return Err(self
                        .mux
                        .dead()
                        .unwrap_or_else(|| Status::new(Code::Cancelled, "the call was cancelled")))
                }
            }
        }
    }

    /// Sends initial metadata now (otherwise empty metadata goes with the first message).
    pub async fn send_headers(&mut self, metadata: MetadataMap) -> Result<(), Status> {
        if self.headers_sent {
            return Err(Status::new(Code::Internal, "initial metadata was already sent"));
        }
        self.headers_sent = true;
        let body = wire::ResponseHead { metadata }.encode();
        self.mux.sender.send_async(Kind::Headers, 0, self.stream, &body).await.map_err(|e| Status::from_transport(&e))
    }

    /// Sends one response message.
    pub async fn send(&mut self, message: &[u8]) -> Result<(), Status> {
        if !self.headers_sent {
            self.send_headers(MetadataMap::new()).await?;
        }
        self.mux.sender.send_message_async(self.stream, 0, message).await.map_err(|e| Status::from_transport(&e))
    }

    /// Trailing metadata to send with the final status (OK or not).
    pub fn set_trailers(&self, metadata: MetadataMap) {
        if let Ok(mut t) = self.trailers.lock() {
            *t = metadata;
        }
    }
}

/// A server: handlers by method path, served on one or more endpoints.
///
/// ```no_run
/// # async fn demo() -> Result<(), isthmus::Status> {
/// isthmus::Server::builder()
///     .handler("/demo.Echo/Say", |mut call: isthmus::ServerCall| async move {
///         while let Some(m) = call.recv().await? {
///             call.send(&m).await?;
///         }
///         Ok(())
///     })
///     .serve("shm://sidecar")
///     .await
/// # }
/// ```
#[derive(Clone)]
pub struct Server {
    handlers: HashMap<String, Handler>,
    config: Config,
    grace: Duration,
}

impl Default for Server {
    fn default() -> Server {
        Server { handlers: HashMap::new(), config: Config::default(), grace: Duration::from_secs(10) }
    }
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server").field("methods", &self.handlers.keys().collect::<Vec<_>>()).finish()
    }
}

impl Server {
    /// A server with no handlers and the default transport configuration.
    pub fn builder() -> Server {
        Server::default()
    }

    /// Registers `handler` for `path`. The handler ends the call by returning: `Ok(())` sends
    /// OK, `Err(status)` sends that status; a panic sends INTERNAL and the server goes on.
    pub fn handler<F, Fut>(mut self, path: &str, handler: F) -> Server
    where
        F: Fn(ServerCall) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), Status>> + Send + 'static,
    {
        self.handlers.insert(path.to_owned(), Arc::new(move |call| Box::pin(handler(call))));
        self
    }

    /// How long a graceful shutdown waits for calls in progress before it closes connections
    /// (default 10 s).
    pub fn grace(mut self, grace: Duration) -> Server {
        self.grace = grace;
        self
    }

    /// The transport configuration (sizes, message limit, peer policy, spinning).
    pub fn config(mut self, config: Config) -> Server {
        self.config = config;
        self
    }

    /// Binds `target` (`shm://…`) now, so clients can connect as soon as this returns; serve
    /// with [`Bound::serve`]. Must be called inside a tokio runtime.
    pub fn bind(self, target: &str) -> Result<Bound, Status> {
        let addr: Address = target.parse().map_err(|e| Status::from_transport(&e))?;
        let listener = Listener::bind(&addr, self.config.clone()).map_err(|e| Status::from_transport(&e))?;
        listener.set_nonblocking(true).map_err(|e| Status::from_transport(&e))?;
        // SAFETY: the AsyncFd owns the listener, so its fd stays open for the registration's life.
        let listener = unsafe { AsyncFd::register_with_interest(Accepting(listener), tokio::io::Interest::READABLE) }
            .map_err(|e| {
            Status::new(Code::Unavailable, format!("cannot watch {target}: {}", std::io::Error::from(e)))
        })?;
        Ok(Bound { listener, handlers: Arc::new(self.handlers), grace: self.grace, tracker: Arc::default() })
    }

    /// Binds and serves `target` until the listener fails.
    pub async fn serve(self, target: &str) -> Result<(), Status> {
        self.bind(target)?.serve().await
    }
}

/// A bound server, accepting once served.
pub struct Bound {
    listener: AsyncFd<Accepting>,
    handlers: Arc<HashMap<String, Handler>>,
    grace: Duration,
    tracker: Arc<Tracker>,
}

/// Reads a serving server's counters (from [`Bound::stats`]).
#[derive(Clone)]
pub struct ServerStats(Arc<Tracker>);

impl std::fmt::Debug for ServerStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerStats").field("connections", &self.connections().len()).finish()
    }
}

impl ServerStats {
    /// Counters of every live connection, one entry each.
    pub fn connections(&self) -> Vec<ConnectionCounters> {
        self.0
            .connections
            .lock()
            .map(|c| c.iter().filter_map(|w| w.upgrade()).map(|m| m.counters()).collect())
            .unwrap_or_default()
    }
}

/// The server's connections and calls in progress, for a graceful shutdown and counters.
#[derive(Default)]
struct Tracker {
    connections: Mutex<Vec<std::sync::Weak<Mux>>>,
    calls: std::sync::atomic::AtomicUsize,
    idle: Notify,
}

/// Counts a call in progress for as long as it lives.
struct CallGuard(Arc<Tracker>);

impl CallGuard {
    fn new(t: &Arc<Tracker>) -> CallGuard {
        t.calls.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        CallGuard(t.clone())
    }
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        if self.0.calls.fetch_sub(1, std::sync::atomic::Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl std::fmt::Debug for Bound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bound").field("address", self.listener.get_ref().0.address()).finish()
    }
}

impl Bound {
    /// A handle on the server's counters that stays valid while it serves.
    pub fn stats(&self) -> ServerStats {
        ServerStats(self.tracker.clone())
    }

    /// Serves until `shutdown` completes, then shuts down gracefully: the socket is removed,
    /// every client is sent GOAWAY, new calls are refused with UNAVAILABLE, and calls in progress
    /// get the grace period to finish before the connections close.
    pub async fn serve_with_shutdown(self, shutdown: impl Future<Output = ()>) -> Result<(), Status> {
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                ready = self.listener.readable() => {
                    let mut guard = ready.map_err(|e| Status::new(Code::Unavailable, e.to_string()))?;
                    match guard.get_inner().0.accept_incoming() {
                        Ok(incoming) => {
                            let (handlers, tracker) = (self.handlers.clone(), self.tracker.clone());
                            tokio::spawn(async move {
                                // The handshake reads with timeouts: keep it off the reactor.
                                if let Ok(Ok(conn)) = tokio::task::spawn_blocking(move || incoming.handshake()).await {
                                    serve_connection(conn, handlers, tracker).await;
                                }
                            });
                        }
                        Err(e) if e.kind() == ErrorKind::Timeout => guard.clear_ready(),
                        // Out of fds, say: keep serving the calls we have and try again shortly,
                        // rather than take the whole server down.
                        Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                    }
                }
            }
        }
        let Bound { listener, tracker, grace, .. } = self;
        drop(listener); // removes the socket: new clients find no server here
        let live: Vec<Arc<Mux>> =
            tracker.connections.lock().map(|c| c.iter().filter_map(|w| w.upgrade()).collect()).unwrap_or_default();
        for mux in &live {
            mux.go_away("the server is shutting down").await;
        }
        let drained = async {
            while tracker.calls.load(std::sync::atomic::Ordering::Acquire) > 0 {
                let idle = tracker.idle.notified();
                if tracker.calls.load(std::sync::atomic::Ordering::Acquire) == 0 {
                    break;
                }
                idle.await;
            }
        };
        let _ = tokio::time::timeout(grace, drained).await;
        for mux in &live {
            mux.sender.close(); // whatever is still running ends UNAVAILABLE on the client
        }
        Ok(())
    }

    /// Serves until the listener fails.
    pub async fn serve(self) -> Result<(), Status> {
        self.serve_with_shutdown(std::future::pending()).await
    }
}

/// The listener as tokio sees it.
struct Accepting(Listener);

impl AsRawFd for Accepting {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsFd;
        self.0.as_fd().as_raw_fd()
    }
}

async fn serve_connection(conn: Connection, handlers: Arc<HashMap<String, Handler>>, tracker: Arc<Tracker>) {
    let (sender, receiver) = conn.split();
    let mux = Mux::new(sender);
    if let Ok(mut c) = tracker.connections.lock() {
        c.retain(|w| w.strong_count() > 0);
        c.push(Arc::downgrade(&mux));
    }
    let (new_calls, mut calls) = mpsc::unbounded_channel();
    tokio::spawn(mux.clone().read_loop(receiver, Some(new_calls)));
    while let Some(incoming) = calls.recv().await {
        let handler = handlers.get(&incoming.head.path).cloned();
        let guard = CallGuard::new(&tracker);
        let mux = mux.clone();
        tokio::spawn(async move {
            run_call(mux, incoming, handler).await;
            drop(guard);
        });
    }
}

/// Runs one call's handler against its deadline and the client's cancel, then sends its status.
async fn run_call(mux: Arc<Mux>, incoming: Incoming, handler: Option<Handler>) {
    let Incoming { stream, head, events, cancelled } = incoming;
    mux.calls.start();
    let status = match handler {
        None => Status::new(Code::Unimplemented, format!("method {} is not implemented by this server", head.path)),
        Some(handler) => {
            let deadline = head.timeout.map(|t| Instant::now() + t);
            let trailers = Arc::new(Mutex::new(MetadataMap::new()));
            let call = ServerCall {
                stream,
                mux: mux.clone(),
                head,
                deadline,
                events,
                half_closed: false,
                headers_sent: false,
                trailers: trailers.clone(),
            };
            let status = match supervise(handler(call), deadline, &cancelled).await {
                Outcome::Done(Ok(())) => Status::ok(),
                Outcome::Done(Err(status)) => status,
                Outcome::Panicked(what) => Status::new(Code::Internal, format!("the handler panicked: {what}")),
                Outcome::DeadlineExceeded => Status::new(Code::DeadlineExceeded, "the call's deadline passed"),
                // The client is gone or gave up: it expects no status.
                // Answer with CANCEL so the client drops anything half-sent on this stream.
                Outcome::Cancelled => {
                    let code = cancelled.code();
                    mux.calls.finish(code);
                    return mux.cancel(stream, code).await;
                }
            };
            // Trailers set on the call go after any the returned status carries.
            let set = trailers.lock().map(|mut t| std::mem::take(&mut *t)).unwrap_or_default();
            if set.is_empty() {
                status
            } else {
                let mut all = status.metadata().clone();
                all.extend(&set);
                status.with_metadata(all)
            }
        }
    };
    mux.unregister(stream);
    mux.calls.finish(status.code());
    let _ = mux.sender.send_async(Kind::Trailers, flags::END_STREAM, stream, &wire::encode_trailers(&status)).await;
}

enum Outcome {
    Done(Result<(), Status>),
    Panicked(String),
    DeadlineExceeded,
    Cancelled,
}

/// Polls a handler where it is (no task of its own, so no hand-off between worker threads per
/// call) and turns a panic inside it into a value instead of unwinding into the server.
struct CatchPanic(BoxFuture);

impl Future for CatchPanic {
    type Output = Result<Result<(), Status>, String>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        let handler = self.0.as_mut();
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handler.poll(cx))) {
            Ok(std::task::Poll::Pending) => std::task::Poll::Pending,
            Ok(std::task::Poll::Ready(r)) => std::task::Poll::Ready(Ok(r)),
            Err(p) => {
                let what = p
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a non-text panic".into());
                std::task::Poll::Ready(Err(what))
            }
        }
    }
}

/// Runs the handler against the deadline and the cancel signal; the losing branch's handler
/// future is dropped, which is what stops it.
async fn supervise(fut: BoxFuture, deadline: Option<Instant>, cancelled: &Cancel) -> Outcome {
    let expired = async {
        match deadline {
            Some(d) => tokio::time::sleep_until(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        r = CatchPanic(fut) => match r {
            Ok(r) => Outcome::Done(r),
            Err(what) => Outcome::Panicked(what),
        },
        () = expired => Outcome::DeadlineExceeded,
        () = cancelled.signal.notified() => Outcome::Cancelled,
    }
}
