//! The client: a [`Channel`] to one server, and the [`ClientCall`]s made on it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use isthmus_shm::{flags, Address, Config, Connection, Kind};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::metadata::MetadataMap;
use crate::mux::{ConnectionCounters, Event, Mux};
use crate::status::{Code, Status};
use crate::wire;

/// Per-call options: metadata to send and the time the call may take.
#[derive(Debug, Clone, Default)]
pub struct CallOptions {
    /// Initial metadata.
    pub metadata: MetadataMap,
    /// The call's deadline, from when it starts; it travels to the server.
    pub timeout: Option<Duration>,
    /// If no server is reachable, keep trying until the deadline instead of failing at once
    /// with UNAVAILABLE (gRPC's `wait_for_ready`).
    pub wait_for_ready: bool,
}

/// A unary call's result.
#[derive(Debug, Clone)]
pub struct Response {
    /// The server's initial metadata.
    pub metadata: MetadataMap,
    /// The response message.
    pub message: Bytes,
    /// The server's trailing metadata.
    pub trailers: MetadataMap,
}

struct Inner {
    target: Address,
    config: Config,
    /// The live connection, if any; replaced when it dies and a call needs one.
    current: std::sync::Mutex<Option<Arc<Mux>>>,
    /// Serialises reconnecting, so a burst of calls makes one connection, not many.
    connecting: tokio::sync::Mutex<()>,
    next_stream: AtomicU64,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The last handle is gone: hang up, which also ends the reader task.
        if let Some(mux) = self.current.get_mut().ok().and_then(|m| m.take()) {
            mux.sender.close();
        }
    }
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
}

impl std::fmt::Debug for Channel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Channel").field("target", &self.inner.target.to_string()).finish_non_exhaustive()
    }
}

impl Channel {
    /// Connects to `target` (`shm://NAME` or `shm:///path.sock`) now. Must run inside a tokio
    /// runtime; the handshake runs on a blocking thread.
    pub async fn connect(target: &str) -> Result<Channel, Status> {
        Channel::connect_with(target, Config::default()).await
    }

    /// [`connect`](Self::connect) with a transport configuration (ring and arena sizes, the
    /// largest message accepted, spinning).
    pub async fn connect_with(target: &str, config: Config) -> Result<Channel, Status> {
        let channel = Channel::lazy_with(target, config)?;
        channel.mux(false, None).await?;
        Ok(channel)
    }

    /// A channel that connects on its first call.
    pub fn lazy(target: &str) -> Result<Channel, Status> {
        Channel::lazy_with(target, Config::default())
    }

    /// [`lazy`](Self::lazy) with a transport configuration.
    pub fn lazy_with(target: &str, config: Config) -> Result<Channel, Status> {
        let target: Address = target.parse().map_err(|e| Status::from_transport(&e))?;
        config.validate().map_err(|e| Status::from_transport(&e))?;
        Ok(Channel {
            inner: Arc::new(Inner {
                target,
                config,
                current: std::sync::Mutex::new(None),
                connecting: tokio::sync::Mutex::new(()),
                next_stream: AtomicU64::new(1),
            }),
        })
    }

    fn live(&self) -> Option<Arc<Mux>> {
        let current = self.inner.current.lock().ok()?;
        current.as_ref().filter(|m| m.dead().is_none()).cloned()
    }

    /// The live connection, connecting (again) if there is none.
    async fn mux(&self, wait_for_ready: bool, deadline: Option<Instant>) -> Result<Arc<Mux>, Status> {
        if let Some(m) = self.live() {
            return Ok(m);
        }
        let _one_at_a_time = self.inner.connecting.lock().await;
        let mut backoff = Duration::from_millis(5);
        loop {
            if let Some(m) = self.live() {
                return Ok(m); // another call connected while we waited
            }
            match self.connect_once().await {
                Ok(mux) => {
                    if let Ok(mut current) = self.inner.current.lock() {
                        *current = Some(mux.clone());
                    }
                    return Ok(mux);
                }
                Err(s) if wait_for_ready && s.code() == Code::Unavailable => {
                    let next = Instant::now() + backoff;
                    if deadline.is_some_and(|d| next >= d) {
                        return Err(Status::new(
                            Code::DeadlineExceeded,
                            format!("no server became ready before the deadline: {s}"),
                        ));
                    }
                    tokio::time::sleep_until(next).await;
                    backoff = (backoff * 2).min(Duration::from_millis(500));
                }
                Err(s) => return Err(s),
            }
        }
    }

    async fn connect_once(&self) -> Result<Arc<Mux>, Status> {
        let (addr, config) = (self.inner.target.clone(), self.inner.config.clone());
        let conn = tokio::task::spawn_blocking(move || Connection::connect(&addr, &config))
            .await
            .map_err(|e| Status::new(Code::Internal, format!("connect task failed: {e}")))?
            .map_err(|e| Status::from_transport(&e))?;
        let (sender, receiver) = conn.split();
        let mux = Mux::new(sender);
        tokio::spawn(mux.clone().read_loop(receiver, None));
        Ok(mux)
    }

    /// Starts a call of any shape: send messages, half-close, read responses.
    pub async fn start(&self, path: &str, options: CallOptions) -> Result<ClientCall, Status> {
        if !path.starts_with('/') || path.len() > wire::MAX_PATH_LEN || !path.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(Status::new(
                Code::InvalidArgument,
                format!(
                    "method path {path:?} must start with '/', be printable ASCII and at most {} bytes",
                    wire::MAX_PATH_LEN
                ),
            ));
        }
        let deadline = options.timeout.map(|t| Instant::now() + t);
        let mux = self.mux(options.wait_for_ready, deadline).await?;
        let stream = self.inner.next_stream.fetch_add(1, Ordering::Relaxed);
        let events = mux.register(stream)?;
        mux.calls.start();
        // Time spent waiting for a server is the call's: send what is left.
        let timeout = deadline.map(|d| d.saturating_duration_since(Instant::now()).max(Duration::from_nanos(1)));
        let head = wire::RequestHead { path: path.to_owned(), timeout, metadata: options.metadata };
        let call = ClientCall {
            stream,
            mux,
            events,
            deadline,
            pending: VecDeque::new(),
            headers: None,
            trailers: None,
            finished: false,
        };
        call.mux
            .sender
            .send_async(Kind::Headers, 0, stream, &head.encode())
            .await
            .map_err(|e| Status::from_transport(&e))?;
        Ok(call)
    }

    /// Counters of the current connection (zero if there is none yet); they start afresh when
    /// the channel reconnects.
    pub fn counters(&self) -> ConnectionCounters {
        self.inner.current.lock().ok().and_then(|c| c.as_ref().map(|m| m.counters())).unwrap_or_default()
    }

    /// A unary call: one request, one response.
    pub async fn unary(&self, path: &str, request: &[u8], options: CallOptions) -> Result<Response, Status> {
        let mut call = self.start(path, options).await?;
        call.send_last(request).await?;
        let message = call.recv().await?.ok_or_else(|| {
            Status::new(Code::Internal, format!("{path}: the server ended the call without a response"))
        })?;
        if call.recv().await?.is_some() {
            return Err(Status::new(Code::Internal, format!("{path}: the server sent more than one response")));
        }
        Ok(Response {
            metadata: call.headers.take().unwrap_or_default(),
            message,
            trailers: call.trailers.take().unwrap_or_default(),
        })
    }
}

/// Runs `fut` until `deadline`; `None` if the deadline came first (the future is dropped).
async fn until<T>(deadline: Option<Instant>, fut: impl std::future::Future<Output = T>) -> Option<T> {
    match deadline {
        None => Some(fut.await),
        Some(d) => tokio::time::timeout_at(d, fut).await.ok(),
    }
}

/// One call in progress. Dropping it before the server has finished cancels it.
pub struct ClientCall {
    stream: u64,
    mux: Arc<Mux>,
    events: mpsc::UnboundedReceiver<Event>,
    deadline: Option<Instant>,
    pending: VecDeque<Bytes>,
    headers: Option<MetadataMap>,
    trailers: Option<MetadataMap>,
    finished: bool,
}

impl std::fmt::Debug for ClientCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientCall").field("stream", &self.stream).field("finished", &self.finished).finish()
    }
}

impl ClientCall {
    /// Ends the call at its deadline: cancels it on both sides and gives the status.
    async fn expire(&mut self) -> Status {
        self.finish_with_cancel(Code::DeadlineExceeded).await;
        Status::new(Code::DeadlineExceeded, "the call's deadline passed")
    }

    /// Marks the call over with `code`, once.
    fn finish(&mut self, code: Code) {
        if !self.finished {
            self.finished = true;
            self.mux.calls.finish(code);
        }
    }

    async fn finish_with_cancel(&mut self, code: Code) {
        if !self.finished {
            self.finish(code);
            self.mux.cancel(self.stream, code).await;
        }
    }

    async fn send_flags(&mut self, message: &[u8], frame_flags: u8) -> Result<(), Status> {
        if self.finished {
            return Err(Status::new(Code::FailedPrecondition, "the call has already ended"));
        }
        match until(self.deadline, self.mux.sender.send_message_async(self.stream, frame_flags, message)).await {
            Some(sent) => sent.map_err(|e| Status::from_transport(&e)),
            None => Err(self.expire().await),
        }
    }

    /// Sends one request message.
    pub async fn send(&mut self, message: &[u8]) -> Result<(), Status> {
        self.send_flags(message, 0).await
    }

    /// Sends the last request message and half-closes in the same frame.
    pub async fn send_last(&mut self, message: &[u8]) -> Result<(), Status> {
        self.send_flags(message, flags::END_STREAM).await
    }

    /// Half-closes: no more request messages.
    pub async fn close_send(&mut self) -> Result<(), Status> {
        if self.finished {
            return Ok(());
        }
        // From the client, an empty TRAILERS frame is a half-close without a message.
        match until(self.deadline, self.mux.sender.send_async(Kind::Trailers, flags::END_STREAM, self.stream, &[]))
            .await
        {
            Some(sent) => sent.map_err(|e| Status::from_transport(&e)),
            None => Err(self.expire().await),
        }
    }

    /// Reads the next event, past the deadline an error.
    async fn next(&mut self) -> Result<Option<Event>, Status> {
        if self.finished {
            return Ok(None);
        }
        let Some(ev) = until(self.deadline, self.events.recv()).await else {
            return Err(self.expire().await);
        };
        match ev {
            Some(ev) => Ok(Some(ev)),
            None => {
                let status = self.mux.dead().unwrap_or_else(|| Status::new(Code::Unavailable, "the connection closed"));
                self.finish(status.code());
                Err(status)
            }
        }
    }

    /// The next response message; `Ok(None)` once the server ended the call with OK (its
    /// trailers are then in [`trailers`](Self::trailers)); the server's status otherwise.
    pub async fn recv(&mut self) -> Result<Option<Bytes>, Status> {
        if let Some(m) = self.pending.pop_front() {
            return Ok(Some(m));
        }
        loop {
            match self.next().await? {
                None => return Ok(None),
                Some(Event::Headers(md)) => self.headers = Some(md),
                Some(Event::Message(m)) => return Ok(Some(m)),
                Some(Event::HalfClose) => {}
                Some(Event::End(status)) => {
                    self.finish(status.code());
                    self.mux.unregister(self.stream);
                    if status.code() == Code::Ok {
                        self.trailers = Some(status.metadata().clone());
                        return Ok(None);
                    }
                    return Err(status);
                }
            }
        }
    }

    /// The server's initial metadata, waiting for it if needed.
    pub async fn headers(&mut self) -> Result<MetadataMap, Status> {
        while self.headers.is_none() && !self.finished {
            match self.next().await? {
                None => break,
                Some(Event::Headers(md)) => self.headers = Some(md),
                Some(Event::Message(m)) => self.pending.push_back(m),
                Some(Event::HalfClose) => {}
                Some(Event::End(status)) => {
                    self.finish(status.code());
                    self.mux.unregister(self.stream);
                    if status.code() != Code::Ok {
                        return Err(status);
                    }
                    self.trailers = Some(status.metadata().clone());
                }
            }
        }
        Ok(self.headers.clone().unwrap_or_default())
    }

    /// The server's trailing metadata, once the call has ended with OK.
    pub fn trailers(&self) -> Option<&MetadataMap> {
        self.trailers.as_ref()
    }

    /// Cancels the call: the server sees CANCELLED and stops its handler.
    pub async fn cancel(mut self) {
        self.finish_with_cancel(Code::Cancelled).await;
    }
}

impl Drop for ClientCall {
    fn drop(&mut self) {
        if !self.finished {
            self.mux.calls.finish(Code::Cancelled);
            self.mux.unregister(self.stream);
            // Best effort and never blocking: if the ring is full right now the server learns of
            // it when the connection closes.
            let _ = self.mux.sender.send(
                Kind::Cancel,
                0,
                self.stream,
                &wire::encode_cancel(Code::Cancelled),
                Some(std::time::Instant::now()),
            );
        }
    }
}
