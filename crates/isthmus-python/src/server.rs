//! The engine's server with Python behind it. Every call, whatever its path, goes to Python:
//! the blocking server's threads take it from a queue, the asyncio server's event loop from an
//! inbox; the call's handler then receives, sends and finishes it through [`ServerCall`].
//!
//! - The engine's `Server` with one `fallback` handler, `PyHandler`: methods are known only to
//!   Python, possibly only after the ports are bound (grpcio allows `add_insecure_port` before
//!   `add_generic_rpc_handlers`), so the engine routes none itself.
//! - `PyHandler` hands the call over with `isthmus::binding::hand_off`, which makes its
//!   `HandedCall` (the engine's `ServerCall` under a tokio mutex, the path, metadata, deadline,
//!   whether it is active, its callbacks); the handler's future then waits for `finish`. This
//!   runs in the call's first poll on the connection's reader task, so it must not block:
//!   - the blocking server: the call goes into `queue::CallQueue`, without the
//!     GIL; loops on the executor's threads (`serve_calls`) take calls from it and run each
//!     handler where it is, and a dispatcher thread starts loops as calls need them (ADR 0015);
//!   - the asyncio server: the call goes into the server's `Inbox`, also without the GIL. The
//!     loop keeps one operation standing on its reactor, `listen_async`, which completes with
//!     everything the inbox got since it last looked (calls to start as tasks, calls
//!     abandoned, calls whose done-callbacks are due); the loop starts it again each time. A
//!     busy Python thread can delay the loop, never the connection's reader.
//! - `finish` writes the status onto the ring from the calling thread when no other operation
//!   of the call holds it (`ServerCall::end_now`), so the client's answer does not wait for the
//!   engine's task to be woken.
//! - The raw tier (`buffers`): `recv_raw` gives a request as a read-only `Message`, `alloc` a
//!   writable `Block` of the server's arena, `send_raw` sends either, or any C-contiguous
//!   buffer, with no copy into Python.
//! - `_handler.py` finds the method's handler as grpcio does (registered methods by path, then the
//!   generic handlers in order, behind the interceptors; none is UNIMPLEMENTED "Method not
//!   found!"). The handler works through the `ServerCall`: blocking calls on the runtime with
//!   `block_on`, GIL released (thread-pool server), or operations through the loop's `Reactor`
//!   (asyncio). Plain (not `async`) unary handlers of the asyncio server run on
//!   `migration_thread_pool` if one is given; other plain handlers run on the loop.
//! - A request-streaming handler's read sends no initial metadata, as grpcio's does not: the
//!   handler may send them after it has read (a client that waits for the response to open
//!   before its first request, as a tonic client awaiting its call does, waits on a handler
//!   that reads first, as on grpcio's server).
//! - The end: a handler that raises ends the call UNKNOWN in its server's words ("Exception calling
//!   application: …", or grpc.aio's "Unexpected <class '…'>: …"; `_context.py`), as grpcio does; a
//!   `ServerCall` dropped unfinished ends UNKNOWN too. The client's cancel, the deadline or the
//!   connection's end drop the engine's future; `hand_off` then marks the call inactive and runs
//!   the `add_callback` callbacks (the blocking server's with the GIL, on the engine's thread). A
//!   thread-pool handler is not interrupted (grpcio's are not either): its
//!   next read or write fails with the call's status. An asyncio handler's task is cancelled
//!   then, as grpc.aio's are: the inbox tells the loop (`aio/_server.py`).
//! - Ports: each `add_insecure_port` binds at once (`Server::bind`) as a `Bound` of its own, so it
//!   can return the port (the one chosen for `http://…:0`; 1 for other targets, since grpc callers
//!   take 0 for failure). An HTTP/2 port has its own loopback `shm://` endpoint, through which its
//!   calls reach Python: it sees one kind of call everywhere. `start` serves them all with
//!   `serve_until_deadline`, stopped by one `watch` whose value is when `stop(grace)` cuts the
//!   calls off (the earliest asked for). `wait`
//!   waits on a condvar with the GIL released; the blocking `wait_for_termination` waits in 1 s
//!   slices so Ctrl-C gets its turn. The asyncio `stop` cancels the handler tasks still running
//!   once the engine has ended every call.
//! - Options: `maximum_concurrent_rpcs` bounds the calls in progress on the whole server, as
//!   grpcio's does: one more is refused RESOURCE_EXHAUSTED "Concurrent RPC limit exceeded!"
//!   before Python sees it (counted from its arrival until its handler finishes it, queued or
//!   running, even past the client's cancel, as grpcio counts);
//!   `grpc.max_receive_message_length` becomes `max_message_size`, `grpc.max_concurrent_streams`
//!   the engine's `max_concurrent_streams`; other options and `compression`
//!   are accepted and unused. `add_port` with TLS settings is `add_secure_port` (TCP targets).
//! - A call's two halves have locks of their own (`HandedCall`): a handler that reads in one
//!   thread (or task) while it writes in another sees neither wait for the other.
//! - Health: the engine answers `grpc.health.v1` (`""` SERVING while it serves) unless a Python
//!   servicer serves that name, as `serve_health` says before `start` (whatever the order of
//!   the servicers and the ports); `add_port(.., health=False)` is that port's default.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use isthmus::binding::{hand_off, HandedCall, Lender};
use isthmus::{Code, Handler, HandlerFuture, Status};
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tokio::sync::watch;

use crate::buffers::{Block, Message, Outgoing, Request};
use crate::convert::{bytes_from_py, call_error, metadata_from_py, metadata_to_py, trailers_from_py, PyMetadata};
use crate::queue::{CallQueue, Next};
use crate::reactor::{run_now, Now, Outcome, Reactor};
use crate::runtime;

/// Hands every call to Python: to the [`Inbox`] its event loop takes calls from (the asyncio
/// server), or to the queue the blocking server's threads take calls from; at most `limit` at
/// once, server-wide (grpcio's `maximum_concurrent_rpcs`). Neither takes the GIL.
struct PyHandler {
    deliver: Deliver,
    limit: Option<Arc<Limit>>,
}

enum Deliver {
    Loop(Arc<Inbox>),
    Queue(Arc<CallQueue>),
}

/// The asyncio server's news for its event loop, put here by the engine's threads without the
/// GIL: calls that arrived, calls that ended under their handler (whose tasks the loop
/// cancels) and calls whose `add_done_callback` callbacks are due (which the loop runs). The
/// loop's standing `listen_async` operation takes it all in one batch, through the loop's
/// reactor, so no engine thread ever waits for the GIL.
#[derive(Default)]
pub(crate) struct Inbox {
    news: Mutex<News>,
    ready: tokio::sync::Notify,
    /// Set while `news` holds something: the loop's `linger` looks at it between frames.
    told: AtomicBool,
    /// Set once the loop's listener was dropped before it had news (the server stopped, or its
    /// loop went away): calls are refused from then on instead of waiting for nobody.
    closed: AtomicBool,
    /// The connection of the last call the loop started, which its `linger` reads (weakly held).
    last: Mutex<Option<Lender>>,
    next_id: std::sync::atomic::AtomicU64,
}

/// What an [`Inbox`] holds: calls by id, and the ids of calls abandoned or done.
#[derive(Default)]
pub(crate) struct News {
    pub(crate) calls: Vec<(u64, Arc<HandedCall>)>,
    pub(crate) abandoned: Vec<u64>,
    pub(crate) done: Vec<u64>,
}

/// News dropped untaken (its loop's reactor went first) ends its calls as a closed inbox ends
/// those it holds: a call handed to nobody would wait for its deadline.
impl Drop for News {
    fn drop(&mut self) {
        for (_, call) in self.calls.drain(..) {
            call.finish(no_loop());
        }
    }
}

impl Inbox {
    /// The news, even if a thread panicked holding the lock: each change under it is one push
    /// or take.
    fn news(&self) -> std::sync::MutexGuard<'_, News> {
        self.news.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Adds to the news for the loop; false (and `add` not run) once no loop listens.
    /// `closed` is read under the lock `close` sets it under: what is told is either taken by
    /// `close` or refused here, never left where no loop takes it.
    fn tell(&self, add: impl FnOnce(&mut News)) -> bool {
        let mut news = self.news();
        if self.closed.load(Ordering::Acquire) {
            return false;
        }
        add(&mut news);
        self.told.store(true, Ordering::Release);
        drop(news);
        self.ready.notify_one();
        true
    }

    fn has_news(&self) -> bool {
        self.told.load(Ordering::Acquire)
    }

    /// A new call for the loop; when it ends under its handler, the loop hears of it.
    /// UNAVAILABLE once no loop listens.
    fn deliver(self: &Arc<Self>, core: Arc<HandedCall>) -> Result<(), Status> {
        if self.closed.load(Ordering::Acquire) {
            return Err(no_loop());
        }
        if let (Some(c), Ok(mut last)) = (core.connection(), self.last.lock()) {
            if !last.as_ref().is_some_and(|l| l.same(c)) {
                *last = Some(c.clone());
            }
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let inbox = Arc::downgrade(self);
        // Before the news lock is taken: a call abandoned already runs this at once.
        core.add_abandon_callback(Box::new(move || {
            if let Some(inbox) = inbox.upgrade() {
                inbox.tell(|n| n.abandoned.push(id));
            }
        }));
        match self.tell(|n| n.calls.push((id, core))) {
            true => Ok(()),
            false => Err(no_loop()),
        }
    }

    /// No loop listens any more: the calls waiting for one end UNAVAILABLE, as later ones will.
    fn close(&self) {
        let mut news = self.news();
        self.closed.store(true, Ordering::Release);
        let waiting = std::mem::take(&mut news.calls);
        drop(news);
        for (_, call) in waiting {
            call.finish(no_loop());
        }
    }

    /// Everything told since the last take, once there is something. Dropped before it has
    /// any (the loop abandoned it, or went away), it closes the inbox.
    async fn take(self: Arc<Self>) -> News {
        struct Listening(Option<Arc<Inbox>>);
        impl Drop for Listening {
            fn drop(&mut self) {
                if let Some(inbox) = self.0.take() {
                    inbox.close();
                }
            }
        }
        let mut listening = Listening(Some(self.clone()));
        let news = self.next_news().await;
        listening.0 = None;
        news
    }

    async fn next_news(&self) -> News {
        loop {
            {
                let mut news = self.news();
                if !(news.calls.is_empty() && news.abandoned.is_empty() && news.done.is_empty()) {
                    self.told.store(false, Ordering::Release);
                    return std::mem::take(&mut *news);
                }
            }
            self.ready.notified().await;
        }
    }
}

/// Calls in progress on every port of one server, and how many may be.
struct Limit {
    max: usize,
    active: AtomicUsize,
}

/// One call counted in a [`Limit`]: until its handler finishes it (before the client can see
/// its end, so that a client's next call finds the room), or until both the engine's future and
/// the call are gone (a call never finished).
struct Counted {
    limit: Arc<Limit>,
    released: AtomicBool,
}

impl Counted {
    fn release(&self) {
        if !self.released.swap(true, Ordering::AcqRel) {
            self.limit.active.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.release();
    }
}

impl Handler for PyHandler {
    fn handle(self: Arc<Self>, call: isthmus::ServerCall) -> HandlerFuture {
        let counted = match &self.limit {
            Some(limit) if limit.active.fetch_add(1, Ordering::AcqRel) >= limit.max => {
                limit.active.fetch_sub(1, Ordering::AcqRel);
                // grpcio's words for it.
                let refused = Status::new(Code::ResourceExhausted, "Concurrent RPC limit exceeded!");
                return Box::pin(std::future::ready(Err(refused)));
            }
            Some(limit) => Some(Arc::new(Counted { limit: limit.clone(), released: AtomicBool::new(false) })),
            None => None,
        };
        Box::pin(async move {
            // Two shares: the finish hook's, and this future's (for a call never finished).
            let (held, _counted) = (counted.clone(), counted);
            hand_off(call, move |core| {
                if let Some(counted) = held {
                    core.on_finish(Box::new(move || counted.release()));
                }
                match &self.deliver {
                    Deliver::Queue(queue) => {
                        queue.push(core);
                        Ok(())
                    }
                    Deliver::Loop(inbox) => inbox.deliver(core),
                }
            })
            .await
        })
    }
}

/// The server's side of one call.
#[pyclass(module = "isthmus._native", frozen)]
pub(crate) struct ServerCall {
    core: Arc<HandedCall>,
    /// The asyncio server's: the call's number in its inbox's news, and the inbox.
    inbox: Option<(u64, std::sync::Weak<Inbox>)>,
}

/// A call its handler let go of without finishing it (Python code that failed while ending it,
/// a call the server never got to) ends UNKNOWN now, not at its deadline (or never, without
/// one): the engine's future for it waits for a finish that would not come. Does nothing for a
/// call finished or over already.
impl Drop for ServerCall {
    fn drop(&mut self) {
        if self.core.is_active() {
            self.core.finish(Status::new(Code::Unknown, "the handler was dropped without finishing the call"));
        }
    }
}

impl ServerCall {
    /// A call of the blocking server.
    fn queued(core: Arc<HandedCall>) -> ServerCall {
        ServerCall { core, inbox: None }
    }

    /// `(calls, abandoned ids, done ids)` for the asyncio server's loop.
    pub(crate) fn news_to_py(py: Python<'_>, mut news: News, inbox: &std::sync::Weak<Inbox>) -> PyResult<Py<PyAny>> {
        let calls = std::mem::take(&mut news.calls)
            .into_iter()
            .map(|(id, core)| Py::new(py, ServerCall { core, inbox: Some((id, inbox.clone())) }))
            .collect::<PyResult<Vec<_>>>()?;
        let (abandoned, done) = (std::mem::take(&mut news.abandoned), std::mem::take(&mut news.done));
        Ok((calls, abandoned, done).into_pyobject(py)?.into_any().unbind())
    }
}

#[pymethods]
impl ServerCall {
    /// The asyncio server's number for the call (0 on the blocking server): what `listen_async`
    /// names it by when it was abandoned or is done.
    #[getter]
    fn id(&self) -> u64 {
        self.inbox.as_ref().map_or(0, |(id, _)| *id)
    }

    /// The asyncio server's: tells the loop (through `listen_async`, by `id`) when the call
    /// ends; False if it has ended already.
    fn watch_done(&self) -> PyResult<bool> {
        let Some((id, inbox)) = self.inbox.clone() else {
            return Err(PyRuntimeError::new_err("only the asyncio server's calls report their end to a loop"));
        };
        Ok(self.core.add_done_callback(Box::new(move || {
            if let Some(inbox) = inbox.upgrade() {
                inbox.tell(|n| n.done.push(id));
            }
        })))
    }
    #[getter]
    fn path(&self) -> &str {
        self.core.path()
    }

    fn invocation_metadata(&self, py: Python<'_>) -> PyResult<PyMetadata> {
        metadata_to_py(py, self.core.metadata())
    }

    fn time_remaining(&self) -> Option<f64> {
        self.core.time_remaining().map(|t| t.as_secs_f64())
    }

    fn peer(&self) -> String {
        self.core.peer().to_owned()
    }

    fn auth_context(&self) -> std::collections::HashMap<&'static str, Vec<Vec<u8>>> {
        crate::tls::auth_context(&self.core)
    }

    fn is_active(&self) -> bool {
        self.core.is_active()
    }

    fn add_done_callback(&self, callback: Py<PyAny>) -> bool {
        self.core.add_done_callback(engine_callback(callback))
    }

    /// Compresses the replies with `encoding` (`gzip`, `deflate`; `None`: uncompressed) where
    /// they cross a wire (`HandedCall::set_compression`); false once too late.
    #[pyo3(signature = (encoding=None))]
    fn set_compression(&self, encoding: Option<&str>) -> PyResult<bool> {
        let compression = match encoding {
            None => None,
            Some(name) => Some(isthmus::Compression::from_name(name).ok_or_else(|| {
                pyo3::exceptions::PyValueError::new_err(format!("no compression {name:?}: gzip or deflate"))
            })?),
        };
        Ok(self.core.set_compression(compression))
    }

    fn recv(&self, py: Python<'_>) -> PyResult<Option<Py<PyBytes>>> {
        match crate::recv(py, &self.core) {
            Ok(m) => Ok(m.map(|m| PyBytes::new(py, &m).unbind())),
            Err(status) => Err(call_error(py, &status)),
        }
    }

    fn send(&self, py: Python<'_>, message: &Bound<'_, PyBytes>) -> PyResult<()> {
        let message = bytes_from_py(message);
        py.detach(|| runtime().block_on(self.core.send(&message))).map_err(|s| call_error(py, &s))
    }

    /// A unary response's end in one step: [`send`](Self::send) `message` (any buffer on the
    /// raw tier, as [`send_raw`](Self::send_raw)), then [`finish`](Self::finish).
    #[pyo3(signature = (message, code, details, trailing_metadata=None, raw=false))]
    fn reply(
        &self,
        py: Python<'_>,
        message: &Bound<'_, PyAny>,
        code: u32,
        details: String,
        trailing_metadata: Option<&Bound<'_, PyAny>>,
        raw: bool,
    ) -> PyResult<()> {
        let status = trailers_from_py(code, details, trailing_metadata)?;
        if raw {
            self.send_raw(py, message)?;
        } else {
            let message = message.cast::<PyBytes>()?;
            // Now, from this thread, when that takes no wait: the status, and the message inside
            // it where the connection agreed to one-frame calls.
            if self.core.try_reply(message.as_bytes(), || status.clone()) {
                return Ok(());
            }
            self.send(py, message)?;
        }
        self.core.finish(status);
        Ok(())
    }

    /// [`reply`](Self::reply) for an event loop's thread: only if it takes no wait. False, with
    /// nothing sent, otherwise (the loop then sends and finishes as usual, without blocking;
    /// the send fails if the call ended meanwhile).
    #[pyo3(signature = (message, code, details, trailing_metadata=None))]
    fn try_reply(
        &self,
        message: &Bound<'_, PyBytes>,
        code: u32,
        details: String,
        trailing_metadata: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let status = trailers_from_py(code, details, trailing_metadata)?;
        Ok(self.core.try_reply(message.as_bytes(), || status))
    }

    /// [`recv`](Self::recv) for the raw tier: the request as a read-only [`Message`], a view
    /// of the client's shared memory when it came through its arena (a copy when it came over
    /// HTTP/2, through the loopback).
    fn recv_raw(&self, py: Python<'_>) -> PyResult<Option<Message>> {
        match crate::recv(py, &self.core) {
            Ok(m) => Ok(m.map(Message::new)),
            Err(status) => Err(call_error(py, &status)),
        }
    }

    /// A writable block of the server's shared memory to build a reply in, sent with
    /// [`send_raw`](Self::send_raw) with no copy.
    /// A reply block in the server's shared memory, waiting for arena room; without `wait`
    /// (an event loop's thread) a heap block when there is no room at once (sent as a copy).
    /// Either way a heap block for a size the whole arena could not hold (RESOURCE_EXHAUSTED:
    /// no wait would make room), which goes as a copy, in pieces.
    #[pyo3(signature = (size, wait=true))]
    fn alloc(&self, py: Python<'_>, size: usize, wait: bool) -> PyResult<Block> {
        if !wait {
            return match self.core.try_alloc(size) {
                Ok(Some(block)) => Ok(Block::shm(block)),
                Err(s) if s.code() != Code::ResourceExhausted => Err(call_error(py, &s)),
                _ => Block::heap(size),
            };
        }
        match py.detach(|| runtime().block_on(self.core.alloc(size))) {
            Ok(block) => Ok(Block::shm(block)),
            Err(s) if s.code() == Code::ResourceExhausted => Block::heap(size),
            Err(s) => Err(call_error(py, &s)),
        }
    }

    /// [`send`](Self::send) for the raw tier: a [`Block`] (sent where it is) or any
    /// C-contiguous buffer (read in place).
    fn send_raw(&self, py: Python<'_>, message: &Bound<'_, PyAny>) -> PyResult<()> {
        let sent = match Request::from_py(message)? {
            Request::Block(Outgoing::Shm(block)) => py.detach(|| runtime().block_on(self.core.send_block(block))),
            other => {
                let bytes = other.as_slice().unwrap_or_default();
                py.detach(|| runtime().block_on(self.core.send(bytes)))
            }
        };
        sent.map_err(|s| call_error(py, &s))
    }

    fn send_initial_metadata(&self, py: Python<'_>, metadata: &Bound<'_, PyAny>) -> PyResult<()> {
        let metadata = metadata_from_py(Some(metadata))?;
        py.detach(|| runtime().block_on(self.core.send_headers(metadata))).map_err(|s| call_error(py, &s))
    }

    // The asyncio server's operations: each runs as operation `token` of the loop's `reactor`,
    // polled here first. One that finishes at once (a unary request that came with its call, a
    // reply the ring has room for) gives back `(ok, value)` here, with no trip through the
    // reactor's eventfd and the loop's selector; else `None`, and it completes through the
    // reactor.

    fn recv_async(&self, py: Python<'_>, reactor: &Reactor, token: u64) -> Now {
        let core = self.core.clone();
        run_now(py, &reactor.completions, token, async move { core.recv(false).await.into() })
    }

    /// [`recv_async`](Self::recv_async) of the raw tier: completes with a `Message`.
    fn recv_raw_async(&self, py: Python<'_>, reactor: &Reactor, token: u64) -> Now {
        let core = self.core.clone();
        run_now(py, &reactor.completions, token, async move {
            match core.recv(false).await {
                Ok(message) => Outcome::Raw(message),
                Err(status) => Outcome::Failed(status),
            }
        })
    }

    /// [`send_async`](Self::send_async) of the raw tier: a [`Block`] or any C-contiguous
    /// buffer, read when sent (so it must not change until the send completes).
    fn send_raw_async(&self, py: Python<'_>, reactor: &Reactor, token: u64, message: &Bound<'_, PyAny>) -> Now {
        let (core, message) = (self.core.clone(), Request::from_py(message)?);
        run_now(py, &reactor.completions, token, async move {
            match message {
                Request::Block(Outgoing::Shm(block)) => core.send_block(block).await.into(),
                other => core.send(other.as_slice().unwrap_or_default()).await.into(),
            }
        })
    }

    fn send_async(&self, py: Python<'_>, reactor: &Reactor, token: u64, message: &Bound<'_, PyBytes>) -> Now {
        let (core, message) = (self.core.clone(), bytes_from_py(message));
        run_now(py, &reactor.completions, token, async move { core.send(&message).await.into() })
    }

    fn send_initial_metadata_async(
        &self,
        py: Python<'_>,
        reactor: &Reactor,
        token: u64,
        metadata: &Bound<'_, PyAny>,
    ) -> Now {
        let metadata = metadata_from_py(Some(metadata))?;
        let core = self.core.clone();
        run_now(py, &reactor.completions, token, async move { core.send_headers(metadata).await.into() })
    }

    /// Delivers `topic` to this call until the client leaves or the topic closes, GIL released
    /// (no Python per message); `on_gap(n)` may return a message to send after `n` were dropped.
    /// A message (or resync) over `max_send` bytes, the server's `grpc.max_send_message_length`,
    /// ends the call RESOURCE_EXHAUSTED.
    #[pyo3(signature = (topic, on_gap=None, max_send=None))]
    fn serve_topic(
        &self,
        py: Python<'_>,
        topic: &crate::topic::Topic,
        on_gap: Option<Py<PyAny>>,
        max_send: Option<usize>,
    ) -> PyResult<()> {
        let (core, topic) = (&self.core, &topic.inner);
        let on_gap = crate::topic::gap_callback(on_gap);
        py.detach(|| runtime().block_on(core.serve_topic(topic, max_send, on_gap))).map_err(|s| call_error(py, &s))
    }

    /// [`serve_topic`](Self::serve_topic) for the asyncio server: completes when it ends.
    #[pyo3(signature = (reactor, token, topic, on_gap=None, max_send=None))]
    fn serve_topic_async(
        &self,
        reactor: &Reactor,
        token: u64,
        topic: &crate::topic::Topic,
        on_gap: Option<Py<PyAny>>,
        max_send: Option<usize>,
    ) {
        let (core, topic) = (self.core.clone(), topic.inner.clone());
        let on_gap = crate::topic::gap_callback(on_gap);
        reactor.completions.run(token, async move { core.serve_topic(&topic, max_send, on_gap).await.into() });
    }

    /// Ends the call with this status (0 = OK) and trailing metadata.
    #[pyo3(signature = (code, details, trailing_metadata=None))]
    fn finish(&self, code: u32, details: String, trailing_metadata: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        self.core.finish(trailers_from_py(code, details, trailing_metadata)?);
        Ok(())
    }
}

/// A port added once the server has started: grpcio refuses it too (RuntimeError).
fn started_already() -> PyErr {
    PyOSError::new_err("the server has started: ports can no longer be bound")
}

fn no_loop() -> Status {
    Status::new(Code::Unavailable, "the server's event loop is not taking calls")
}

/// `callback()` as a call's callback, run by the engine (with the GIL, on an engine thread);
/// what it raises is reported as an unraisable exception (`PyErr::print` would have ended the
/// process on a `SystemExit`).
fn engine_callback(callback: Py<PyAny>) -> Box<dyn FnOnce() + Send> {
    Box::new(move || {
        Python::attach(|py| {
            if let Err(e) = callback.call0(py) {
                e.write_unraisable(py, Some(callback.bind(py)));
            }
        })
    })
}

/// The engine's server (see the module's documentation).
#[pyclass(module = "isthmus._native", frozen)]
pub(crate) struct Server {
    handler: Arc<PyHandler>,
    /// The blocking server's calls on their way to its threads (not `to_loop`).
    queue: Option<Arc<CallQueue>>,
    /// grpcio's `grpc.max_receive_message_length`, for every port; unset, the engine's
    /// defaults (4 GiB over `shm://`, 4 MiB over HTTP/2).
    max_message: Option<u64>,
    /// grpcio's `grpc.max_concurrent_streams`: calls one connection may have open at once.
    max_streams: Option<usize>,
    /// Every port's replies over HTTP/2 are compressed with this, for clients that read it.
    compression: Option<isthmus::Compression>,
    /// What every port's HTTP/2 clients are offered: the `shm://` port, whichever call bound it.
    offer: Option<isthmus::ShmOffer>,
    /// TCP ports are bound with `SO_REUSEPORT` (`grpc.so_reuseport`).
    reuse_port: bool,
    /// HTTP/2 keepalive of every port's connections (`grpc.keepalive_time_ms`,
    /// `grpc.keepalive_timeout_ms`).
    keepalive: Option<isthmus::Keepalive>,
    /// Every port's HTTP/2 connections get a GOAWAY at this age, and are closed this grace
    /// later (`grpc.max_connection_age_ms`, `grpc.max_connection_age_grace_ms`).
    max_connection_age: Option<(Duration, Option<Duration>)>,
    bound: Mutex<Vec<isthmus::Bound>>,
    /// Every port's counters, kept past `start` (which consumes `bound`).
    stats: Mutex<Vec<isthmus::ServerStats>>,
    stop: watch::Sender<Option<tokio::time::Instant>>,
    stopped: Arc<(Mutex<bool>, Condvar)>,
    started: AtomicBool,
}

#[pymethods]
impl Server {
    #[new]
    #[pyo3(signature = (to_loop, max_concurrent_rpcs=None, max_message_size=None, offer_shm=true, max_threads=None, compression=None, reuse_port=false, keepalive=None, max_connection_age=None, max_streams=None))]
    #[allow(clippy::too_many_arguments)] // Python's keywords
    fn new(
        to_loop: bool,
        max_concurrent_rpcs: Option<usize>,
        max_message_size: Option<u64>,
        offer_shm: bool,
        max_threads: Option<usize>,
        compression: Option<&str>,
        reuse_port: bool,
        keepalive: Option<crate::client::Keepalive>,
        max_connection_age: Option<(u64, Option<u64>)>,
        max_streams: Option<usize>,
    ) -> PyResult<Server> {
        let compression = crate::convert::compression_from_py(compression)?;
        let (deliver, queue) = match to_loop {
            true => (Deliver::Loop(Arc::default()), None),
            false => {
                let queue = Arc::new(CallQueue::new(max_threads.unwrap_or(usize::MAX)));
                (Deliver::Queue(queue.clone()), Some(queue))
            }
        };
        let limit = max_concurrent_rpcs.map(|max| Arc::new(Limit { max, active: AtomicUsize::new(0) }));
        Ok(Server {
            handler: Arc::new(PyHandler { deliver, limit }),
            queue,
            max_message: max_message_size,
            max_streams,
            compression,
            offer: offer_shm.then(isthmus::ShmOffer::new),
            reuse_port,
            keepalive: keepalive.map(crate::client::engine_keepalive),
            max_connection_age: max_connection_age
                .map(|(age, grace)| (Duration::from_millis(age), grace.map(Duration::from_millis))),
            bound: Mutex::new(Vec::new()),
            stats: Mutex::new(Vec::new()),
            stop: watch::Sender::new(None),
            stopped: Arc::new((Mutex::new(false), Condvar::new())),
            started: AtomicBool::new(false),
        })
    }

    #[pyo3(signature = (target, tls=None, health=true))]
    fn add_port(&self, target: &str, tls: Option<crate::tls::ServerTls>, health: bool) -> PyResult<String> {
        if self.started.load(Ordering::Acquire) {
            return Err(started_already());
        }
        let tls = tls.map(crate::tls::server_config).transpose()?;
        let _runtime = runtime().enter();
        let mut server =
            isthmus::Server::builder().fallback(self.handler.clone()).health(health).reuse_port(self.reuse_port);
        if let Some(limit) = self.max_message {
            server = server.max_message_size(limit);
        }
        if let Some(limit) = self.max_streams {
            server = server.max_concurrent_streams(limit);
        }
        if let Some(compression) = self.compression {
            server = server.send_compressed(compression);
        }
        if let Some(k) = self.keepalive {
            server = server.keepalive(k.time, k.timeout);
        }
        if let Some((age, grace)) = self.max_connection_age {
            server = server.max_connection_age(age);
            if let Some(grace) = grace {
                server = server.max_connection_age_grace(grace);
            }
        }
        server = match &self.offer {
            Some(offer) => server.shm_offer(offer.clone()),
            None => server.offer_shm(false),
        };
        let bound = match tls {
            Some(tls) => server.bind_secure(target, tls),
            None => server.bind(target),
        };
        let bound = bound.map_err(|s| match s.code() {
            Code::InvalidArgument => PyValueError::new_err(s.message().to_owned()),
            _ => PyOSError::new_err(s.message().to_owned()),
        })?;
        let address = bound.http_addresses().into_iter().next().unwrap_or_else(|| target.to_owned());
        let mut bound_now = self.bound.lock().map_err(|_| PyRuntimeError::new_err("server state poisoned"))?;
        // Again under the lock `start` takes what is bound under: a port bound as it started
        // would listen with nothing serving it, its clients waiting for their deadline.
        if self.started.load(Ordering::Acquire) {
            return Err(started_already());
        }
        self.stats.lock().map_err(|_| PyRuntimeError::new_err("server state poisoned"))?.push(bound.stats());
        bound_now.push(bound);
        Ok(address)
    }

    /// Takes calls from the queue and runs `handle(call)` for each, on the calling thread (one
    /// of the executor's), until none comes for a while or the server stops, or, while none
    /// comes, `others_waiting()` (the executor's queue's `qsize`) says other work waits for
    /// the executor's threads.
    #[pyo3(signature = (handle, others_waiting=None))]
    fn serve_calls(&self, py: Python<'_>, handle: Py<PyAny>, others_waiting: Option<Py<PyAny>>) -> PyResult<()> {
        let queue = self.blocking_queue()?;
        queue.loop_running(true);
        let _running = LoopRunning(queue);
        // The connection of the last call: this thread reads it while it waits (ADR 0020).
        let mut connection: Option<Lender> = None;
        // A look that fails (the executor's queue gone strange) is taken as nothing waiting.
        let look =
            |f: &Py<PyAny>| Python::attach(|py| f.call0(py).and_then(|n| n.bind(py).is_truthy()).unwrap_or(false));
        let others = others_waiting.as_ref().map(|f| move || look(f));
        let others: Option<&(dyn Fn() -> bool + Sync)> = others.as_ref().map(|f| f as &(dyn Fn() -> bool + Sync));
        loop {
            match py.detach(|| queue.next(crate::queue::SPIN, connection.as_ref(), others)) {
                Next::Call(core) => {
                    if let Some(c) = core.connection() {
                        if !connection.as_ref().is_some_and(|last| last.same(c)) {
                            connection = Some(c.clone());
                        }
                    }
                    let call = Py::new(py, ServerCall::queued(core))?;
                    if let Err(e) = handle.call1(py, (call,)) {
                        // `handle` reports a handler's own errors; this is a bug in it. Not
                        // `print`, which ends the process on a `SystemExit`.
                        e.write_unraisable(py, Some(handle.bind(py)));
                    }
                }
                Next::Idle | Next::Closed => return Ok(()),
            }
        }
    }

    /// The asyncio server's: completes operation `token` of `reactor` with the news of its
    /// calls, once there is some: `(calls, abandoned ids, done ids)`. The loop starts it again
    /// each time; calls that come meanwhile wait in the inbox.
    fn listen_async(&self, reactor: &Reactor, token: u64) -> PyResult<()> {
        let Deliver::Loop(inbox) = &self.handler.deliver else {
            return Err(PyRuntimeError::new_err("this server hands its calls to its executor's threads"));
        };
        let inbox = inbox.clone();
        reactor.completions.run(token, async move {
            let weak = Arc::downgrade(&inbox);
            Outcome::News(inbox.take().await, weak)
        });
        Ok(())
    }

    /// The asyncio server's loop with no handler running, before it sleeps: reads the
    /// connection of the last call it took (held weakly) on this thread, GIL released, as the
    /// blocking server's threads do (ADR 0020), for up to `spin_us` µs or until the inbox has
    /// news; then, for what is left of that time, waits on the reactor. True if `reactor` has
    /// something to drain. A call that comes meanwhile is read here, not by the connection's
    /// reader task on the other core, and starts with no thread woken.
    fn linger(&self, py: Python<'_>, reactor: &Reactor, spin_us: u64) -> PyResult<bool> {
        let Deliver::Loop(inbox) = &self.handler.deliver else {
            return Err(PyRuntimeError::new_err("this server hands its calls to its executor's threads"));
        };
        let lender = inbox.last.lock().ok().and_then(|l| l.clone());
        let (budget, completions) = (Duration::from_micros(spin_us), &reactor.completions);
        Ok(py.detach(|| {
            let start = std::time::Instant::now();
            if let Some(lender) = &lender {
                // A panic there ends that connection (its reader finds the lent receiver
                // poisoned); the loop goes on.
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    lender.serve_here(budget, || inbox.has_news() || completions.is_ready());
                }));
            }
            let left = budget.saturating_sub(start.elapsed());
            completions.is_ready()
                || (!left.is_zero() && completions.spin(left, isthmus::SpinPolicy::default().yield_after))
        }))
    }

    /// The counters of the server's live `shm://` connections, and its listeners' failed
    /// accepts and handshakes (`isthmus.TransportStats`).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let ports = self.stats.lock().map_err(|_| PyRuntimeError::new_err("server state poisoned"))?;
        let d = crate::convert::counters_to_py(py, ports.iter().flat_map(isthmus::ServerStats::connections))?;
        d.set_item("accept_errors", ports.iter().map(isthmus::ServerStats::accept_errors).sum::<u64>())?;
        d.set_item("handshakes_failed", ports.iter().map(isthmus::ServerStats::handshakes_failed).sum::<u64>())?;
        Ok(d)
    }

    /// For the dispatcher thread: waits until calls need one more `serve_calls` loop. False
    /// once the server has stopped.
    fn wait_demand(&self, py: Python<'_>) -> PyResult<bool> {
        let queue = self.blocking_queue()?;
        Ok(py.detach(|| queue.wait_demand()))
    }

    /// The dispatcher could not start the loop `wait_demand` asked for: calls fail UNAVAILABLE
    /// with `why` from now on.
    fn refuse_calls(&self, why: &str) -> PyResult<()> {
        self.blocking_queue()?.refuse(why);
        Ok(())
    }

    /// The process is exiting: loops end now (so the executor's threads can be joined), and
    /// calls fail UNAVAILABLE with `why` from now on.
    fn close_calls(&self, why: &str) -> PyResult<()> {
        self.blocking_queue()?.shut(why);
        Ok(())
    }

    /// Whether the engine answers `grpc.health.v1` on every port bound so far (before `start`).
    fn serve_health(&self, on: bool) -> PyResult<()> {
        let mut bound = self.bound.lock().map_err(|_| PyRuntimeError::new_err("server state poisoned"))?;
        for b in bound.iter_mut() {
            b.serve_health(on);
        }
        Ok(())
    }

    /// Starts serving what is bound; false if the server had started before (and may have
    /// stopped since): the wrappers raise or not, as grpcio and grpc.aio do.
    fn start(&self) -> bool {
        if self.started.swap(true, Ordering::AcqRel) {
            return false;
        }
        let bound = self.bound.lock().map(|mut b| std::mem::take(&mut *b)).unwrap_or_default();
        let stopped = self.stopped.clone();
        let stop = self.stop.clone();
        let queue = self.queue.clone();
        runtime().spawn(async move {
            if bound.is_empty() {
                // Nothing to serve still serves until stopped, as grpcio's: its
                // `wait_for_termination` returned at once.
                let _ = stop.subscribe().wait_for(Option::is_some).await;
            }
            let mut serving = tokio::task::JoinSet::new();
            for b in bound {
                serving.spawn(b.serve_until_deadline(stop.subscribe()));
            }
            while serving.join_next().await.is_some() {}
            if let Some(queue) = queue {
                queue.close();
            }
            mark_stopped(&stopped);
        });
        true
    }

    /// False if the server never started: then nothing is done, as grpcio's and grpc.aio's
    /// stop of a server not started does nothing (its ports stay bound, and `start` serves).
    #[pyo3(signature = (grace=None))]
    fn stop(&self, grace: Option<f64>) -> bool {
        if !self.started.load(Ordering::Acquire) {
            return false;
        }
        // None, zero or less: calls are cancelled now. A grace too long for a `Duration`, or
        // infinite, lets them finish, as grpcio's (whose timer thread fails on it).
        let grace = match grace {
            Some(g) if g > 0.0 => crate::convert::timeout_from_py(Some(g)).unwrap_or(Duration::MAX),
            _ => Duration::ZERO,
        };
        // A second stop with a smaller grace shortens the first one's, as in grpcio.
        isthmus::stop_by(&self.stop, grace);
        true
    }

    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> bool {
        let stopped = self.stopped.clone();
        py.detach(move || {
            let (lock, cv) = &*stopped;
            let Ok(guard) = lock.lock() else { return true };
            // Infinite, or too long for a `Duration`: no timeout, as a call's.
            match crate::convert::timeout_from_py(timeout) {
                None => cv.wait_while(guard, |s| !*s).map_or(true, |g| *g),
                Some(t) => cv.wait_timeout_while(guard, t, |s| !*s).map_or(true, |(g, _)| *g),
            }
        })
    }
}

impl Server {
    fn blocking_queue(&self) -> PyResult<&Arc<CallQueue>> {
        self.queue.as_ref().ok_or_else(|| PyRuntimeError::new_err("this server hands its calls to an event loop"))
    }
}

/// Counts a `serve_calls` loop out however it ends.
struct LoopRunning<'a>(&'a CallQueue);

impl Drop for LoopRunning<'_> {
    fn drop(&mut self) {
        self.0.loop_running(false);
    }
}

fn mark_stopped(stopped: &(Mutex<bool>, Condvar)) {
    if let Ok(mut s) = stopped.0.lock() {
        *s = true;
    }
    stopped.1.notify_all();
}
