//! Calls for asyncio. Each operation runs on the event loop's own thread: it runs as far as it
//! can when started (a unary call over `shm://` writes its request into the ring there), and
//! when the engine wakes it (a reply arrived), it is queued in its loop's [`Reactor`], whose
//! eventfd the loop watches (`add_reader`); the loop's `resolve` polls every queued operation and
//! resolves the futures of all that finished, in one batch.
//!
//! - Each running loop gets one `Reactor`, around the engine's `isthmus::binding::Completions`
//!   (an eventfd and a queue). Every operation (a unary call, a call's start, `send`,
//!   `close_send`, `recv`, initial metadata; and the asyncio server's `recv_async`, `send_async`,
//!   `send_initial_metadata_async`) gets a token and an asyncio future on the Python side, and a
//!   Rust future here.
//! - That future is polled at once, on the loop's thread, inside the runtime's context (so its
//!   timers and the connection's reader task belong to the shared runtime): a unary call over an
//!   `shm://` connection that is up writes its request into the ring right there. A streaming
//!   call's operation that finishes in that poll (its start, a send with room in the ring, a
//!   message already received) returns its outcome to the caller at once: a trip through the
//!   eventfd and the loop's selector per message made a 4-message server stream cost ~100 µs.
//! - A future that must wait is kept by token. When the engine wakes it (on a runtime thread: the
//!   reader task delivered the reply, or a timer fired), the wake-up only queues the operation,
//!   and the first of a batch signals the eventfd.
//! - `resolve(waiting)` clears the eventfd, takes the queue, polls each woken operation on the
//!   loop's thread, and resolves the asyncio future of each that finished (found by token in the
//!   driver's dict), one native call a batch; what has no future there (a server's news) comes
//!   back as `(token, value)`. A failure is a `CallError` value, not an exception, so one nobody
//!   awaits is not logged as a lost exception. `wait` (the blocking API's completion thread)
//!   gives `(token, ok, value)` for each instead.
//! - So no task is spawned and no thread woken per call on the way out, and the loop wakes once per
//!   batch. The reply still crosses one thread, from the reader task to the loop, through the
//!   eventfd. These channels are made `with_calls_read(false)`: a spin on the loop's thread
//!   would hold up every other coroutine.
//! - Except on an idle loop (ADR 0017): a unary call started while the loop waits for nothing
//!   else is sent over the channel's blocking connection (`SpinFirst`, direct `shm://` targets)
//!   and its reply waited for on the loop's thread, GIL released, up to the spin bound; it
//!   comes back from `unary` itself. `Reactor.resolve` with `spin_us` waits the same way for any
//!   other operation the loop awaits alone.
//! - Cancelling a unary call (or the task awaiting it) abandons its token: `Reactor.cancel` drops
//!   the Rust future, and dropping an engine call sends CANCEL. A streaming call's `cancel` goes
//!   through its `isthmus::binding::SharedCall`. A request iterator is written by a task on the
//!   loop.
//! - A channel stays with the loop it was first used on, as a grpc.aio channel does; using it on
//!   another is a `grpc.aio.UsageError`. `close` (after the Python side's grace) ends its
//!   `shm://` connections; `connectivity` and `watch_connectivity` give gRPC's state (ADR 0018).
//! - A request the loop's thread sends itself waits at most `SEND_PATIENCE` for ring room;
//!   past it the call takes the reactor's path, where a task waits instead of the loop.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use isthmus::binding::{finish_unary, unary_block_off_loop, SharedCall, SpinFirst, SEND_PATIENCE};
use isthmus::{MetadataMap, Status};
use pyo3::exceptions::PyOSError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

use crate::buffers::{Block, Message, Outgoing, Request};
use crate::client::UnaryResult;
use crate::convert::{bytes_from_py, call_error_value, metadata_to_py, options, PyMetadata};

/// What a finished operation gives back.
pub(crate) enum Outcome {
    Unary(isthmus::Response),
    Message(Option<Bytes>),
    /// The raw tier's: a reply, or a request, as a `Message` buffer.
    Raw(Option<Bytes>),
    Metadata(MetadataMap),
    Sent(bool),
    /// A response stream's status watch (`Call.watch_end`): true once it ended OK with every
    /// response read, false if a response was still unread at the deadline.
    Drained(bool),
    Done,
    Started(Arc<SharedCall>),
    /// The asyncio server's news of its calls (`Server.listen_async`).
    News(crate::server::News, std::sync::Weak<crate::server::Inbox>),
    Failed(Status),
}

impl isthmus::binding::Outcome for Outcome {
    fn panicked(status: Status) -> Outcome {
        Outcome::Failed(status)
    }
}

impl<T: Into<Outcome>> From<Result<T, Status>> for Outcome {
    fn from(r: Result<T, Status>) -> Outcome {
        r.map_or_else(Outcome::Failed, Into::into)
    }
}

impl From<Option<Bytes>> for Outcome {
    fn from(m: Option<Bytes>) -> Outcome {
        Outcome::Message(m)
    }
}

impl From<MetadataMap> for Outcome {
    fn from(m: MetadataMap) -> Outcome {
        Outcome::Metadata(m)
    }
}

impl From<isthmus::Response> for Outcome {
    fn from(r: isthmus::Response) -> Outcome {
        Outcome::Unary(r)
    }
}

impl From<()> for Outcome {
    fn from((): ()) -> Outcome {
        Outcome::Done
    }
}

/// The completions of one asyncio loop.
pub(crate) type Completions = isthmus::binding::Completions<Outcome>;

/// Completions for one asyncio loop (see the module's documentation).
#[pyclass(module = "isthmus._native", frozen)]
pub(crate) struct Reactor {
    pub(crate) completions: Arc<Completions>,
}

impl Drop for Reactor {
    /// The loop's driver is gone: its waiting operations end with it (an operation's future
    /// holds its own waker, so nothing else would drop them; a server's listener, dropped,
    /// refuses the calls that wait for that loop).
    fn drop(&mut self) {
        self.completions.abort_all();
    }
}

#[pymethods]
impl Reactor {
    #[new]
    fn new() -> PyResult<Reactor> {
        let completions = Completions::new().map_err(|e| PyOSError::new_err(format!("cannot make an eventfd: {e}")))?;
        Ok(Reactor { completions })
    }

    fn fileno(&self) -> i32 {
        self.completions.fd()
    }

    /// Takes every finished operation and resolves its asyncio future, found in `waiting`
    /// (token → future) and removed from it, with its value (`set_result`; skipped if it was
    /// cancelled meanwhile). What has no future there (a standing operation's outcome, which goes
    /// to a callback) comes back as `(token, value)` pairs, None if there is none. With
    /// `spin_us`, first waits on this thread (the GIL released, never asleep) up to that long
    /// for something to finish, and returns None if nothing did. One call per batch, where a
    /// tuple and a turn of a Python loop per operation cost the asyncio loop ~0.3 µs each under
    /// load.
    #[pyo3(signature = (waiting, spin_us=0))]
    fn resolve(&self, py: Python<'_>, waiting: &Bound<'_, PyDict>, spin_us: u64) -> PyResult<Option<Py<PyList>>> {
        if spin_us > 0 {
            let completions = &self.completions;
            let yield_after = isthmus::SpinPolicy::default().yield_after;
            if !py.detach(|| completions.spin(Duration::from_micros(spin_us), yield_after)) {
                return Ok(None);
            }
        }
        let mut rest: Option<Bound<'_, PyList>> = None;
        // A failure is raised after the whole batch: the engine has handed it over already.
        let mut failed: Option<PyErr> = None;
        for (token, outcome) in self.completions.take() {
            let key = token.into_pyobject(py)?;
            let value = outcome_value(py, &self.completions, outcome).map(|(_, value)| value);
            let Some(future) = waiting.get_item(&key)? else {
                match value {
                    Ok(value) => rest.get_or_insert_with(|| PyList::empty(py)).append((key, value))?,
                    Err(e) => {
                        failed.get_or_insert(e);
                    }
                }
                continue;
            };
            waiting.del_item(&key)?;
            let set = match value {
                Ok(value) => future.call_method1(intern!(py, "set_result"), (value,)),
                Err(e) => future.call_method1(intern!(py, "set_exception"), (e.into_value(py),)),
            };
            // A future done already was cancelled by its waiter: nothing to tell it.
            if let Err(e) = set {
                if !future.call_method0(intern!(py, "done"))?.is_truthy()? {
                    failed.get_or_insert(e);
                }
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(rest.map(Bound::unbind)),
        }
    }

    /// `(token, ok, value)` for every finished operation (a failure as a `CallError` value),
    /// after waiting on this thread, asleep and the GIL released, up to `timeout` seconds
    /// (forever if None) for something to finish: for a thread that does nothing but complete
    /// operations (the blocking API's `.future()` calls). Empty if nothing did.
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Py<PyList>> {
        let deadline = timeout
            .filter(|t| t.is_finite())
            .map(|t| std::time::Instant::now() + Duration::from_secs_f64(t.clamp(0.0, 86_400.0)));
        let completions = &self.completions;
        match py.detach(|| completions.wait(Duration::ZERO, deadline)) {
            true => self.outcomes(py, self.completions.take()),
            false => Ok(PyList::empty(py).unbind()),
        }
    }

    /// Abandons the operation `token`: it will not complete, and a call it was making is
    /// cancelled. `false` if it has already finished.
    fn cancel(&self, token: u64) -> bool {
        self.completions.abort(token)
    }

    fn close(&self) {}
}

impl Reactor {
    /// The finished operations as `wait` gives them to Python.
    fn outcomes(&self, py: Python<'_>, done: Vec<(u64, Outcome)>) -> PyResult<Py<PyList>> {
        let list = PyList::empty(py);
        for (token, outcome) in done {
            let (ok, value) = outcome_value(py, &self.completions, outcome)?;
            list.append((token, ok, value))?;
        }
        Ok(list.unbind())
    }
}

/// An operation's outcome as Python gets it: `(ok, value)`, a failure as a `CallError` value.
pub(crate) fn outcome_value(
    py: Python<'_>,
    completions: &Arc<Completions>,
    outcome: Outcome,
) -> PyResult<(bool, Py<PyAny>)> {
    Ok(match outcome {
        Outcome::Unary(r) => (true, Py::new(py, UnaryResult::new(py, r))?.into_any()),
        Outcome::Message(Some(m)) => (true, PyBytes::new(py, &m).into_any().unbind()),
        Outcome::Raw(Some(m)) => (true, Py::new(py, Message::new(m))?.into_any()),
        Outcome::Message(None) | Outcome::Raw(None) | Outcome::Done => (true, py.None()),
        Outcome::Metadata(m) => (true, metadata_to_py(py, &m)?.into_any()),
        Outcome::Sent(b) | Outcome::Drained(b) => {
            (true, pyo3::types::PyBool::new(py, b).to_owned().into_any().unbind())
        }
        Outcome::Started(core) => {
            let call = AsyncCall { core, completions: completions.clone() };
            (true, Py::new(py, call)?.into_any())
        }
        Outcome::News(news, inbox) => (true, crate::server::ServerCall::news_to_py(py, news, &inbox)?),
        Outcome::Failed(status) => (false, call_error_value(py, &status)),
    })
}

/// Requests up to this size may be sent from the loop's thread (`unary`'s `spin`): larger ones
/// take the reactor's path, where the runtime sends them.
const SPIN_REQUEST_MAX: usize = 1024 * 1024;

/// A channel whose operations complete through a [`Reactor`].
#[pyclass(module = "isthmus._native", frozen)]
pub(crate) struct AsyncChannel {
    engine: isthmus::Channel,
    /// For a direct `shm://` target: unary calls the loop's thread sends and waits for itself
    /// for a moment (`unary`'s `spin`).
    spin_first: Option<SpinFirst>,
    completions: Arc<Completions>,
    closed: AtomicBool,
}

#[pymethods]
impl AsyncChannel {
    #[new]
    #[pyo3(signature = (target, reactor, tls=None, upgrade=None, max_receive=None, keepalive=None, user_agent=None, authority=None, connect_timeout_ms=None))]
    #[allow(clippy::too_many_arguments)] // grpc's channel options, one by one
    fn new(
        target: &str,
        reactor: &Reactor,
        tls: Option<crate::tls::ClientTls>,
        upgrade: Option<bool>,
        max_receive: Option<u64>,
        keepalive: Option<crate::client::Keepalive>,
        user_agent: Option<String>,
        authority: Option<&str>,
        connect_timeout_ms: Option<u64>,
    ) -> PyResult<AsyncChannel> {
        let config = crate::client::client_config(max_receive);
        let agent = user_agent.as_deref();
        // Calls are polled on the event loop's thread, which every other coroutine shares: a
        // call must not spin there reading the connection. The reader task reads for them.
        let spin_first = match target.starts_with("shm:") && tls.is_none() {
            true => Some(SpinFirst::new(
                crate::client::blocking_channel(target, config.clone(), agent)
                    .map_err(|s| crate::client::bad_target(&s))?,
            )),
            false => None,
        };
        let engine =
            crate::client::lazy_channel(target, tls, upgrade, config, keepalive, agent, authority, connect_timeout_ms)?
                .with_calls_read(false);
        Ok(AsyncChannel {
            engine,
            spin_first,
            completions: reactor.completions.clone(),
            closed: AtomicBool::new(false),
        })
    }

    /// The counters of this channel's `shm://` connections (`isthmus.TransportStats`).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let mut counters = vec![self.engine.counters()];
        counters.extend(self.spin_first.as_ref().map(|s| s.channel().counters()));
        crate::convert::counters_to_py(py, counters)
    }

    /// Calls started over shared memory and over HTTP/2, for a channel to an HTTP/2 address.
    fn transport_counts(&self) -> (u64, u64) {
        let counts = self.engine.transport_counts();
        (counts.shm, counts.http2)
    }

    /// `off`, `pending`, `http2`, or the `shm://` target the channel moved to.
    fn upgrade_status(&self) -> String {
        crate::client::upgrade_status(&self.engine)
    }

    /// Starts a unary call as operation `token`. With `spin` (the loop waits for nothing
    /// else), over `shm://`, the loop's thread sends it and waits up to the spin bound for its
    /// reply, which then comes back here as `(ok, value)` instead of through the reactor.
    /// Otherwise it comes through the reactor: `False` if this waited for it already, `None`
    /// if not.
    #[pyo3(signature = (token, path, request, metadata, timeout, wait_for_ready, compression=None, spin=false))]
    #[allow(clippy::too_many_arguments)]
    fn unary(
        &self,
        py: Python<'_>,
        token: u64,
        path: String,
        request: &Bound<'_, PyBytes>,
        metadata: Option<&Bound<'_, PyAny>>,
        timeout: Option<f64>,
        wait_for_ready: bool,
        compression: Option<&str>,
        spin: bool,
    ) -> PyResult<Py<PyAny>> {
        let options = options(metadata, timeout, wait_for_ready, compression)?;
        self.unary_now(py, token, path, crate::convert::PyBuffer::of(request), options, spin)
    }
    /// A block to build a request in: in the shared memory of the connection `unary_raw`
    /// sends it on (a direct `shm://` target that is connected and has arena room now), else
    /// heap memory, which the call copies into shared memory when it sends it. Never waits.
    fn alloc(&self, size: usize) -> PyResult<Block> {
        let shared = self
            .spin_first
            .as_ref()
            .filter(|s| self.is_closed().is_none() && s.connected())
            .and_then(|s| s.channel().alloc(size, Some(Duration::ZERO)).ok());
        shared.map_or_else(|| Block::heap(size), |block| Ok(Block::shm(block)))
    }

    /// True once `alloc` can give shared memory (a direct `shm://` target whose connection for
    /// blocks is up); starts connecting it if not. False for other targets.
    fn shm_ready(&self) -> bool {
        self.spin_first.as_ref().is_some_and(SpinFirst::connected)
    }

    /// [`unary`](Self::unary) of the raw tier: `request` is a heap [`Block`] or any
    /// C-contiguous buffer, read in place when the call sends it (so it must not change until
    /// the call completes); completes with a [`Message`].
    #[pyo3(signature = (token, path, request, metadata, timeout, wait_for_ready, compression=None))]
    #[allow(clippy::too_many_arguments)]
    fn unary_raw(
        &self,
        token: u64,
        path: String,
        request: &Bound<'_, PyAny>,
        metadata: Option<&Bound<'_, PyAny>>,
        timeout: Option<f64>,
        wait_for_ready: bool,
        compression: Option<&str>,
    ) -> PyResult<()> {
        let options = options(metadata, timeout, wait_for_ready, compression)?;
        let request = Request::from_py(request)?;
        if let Request::Block(Outgoing::Shm(block)) = request {
            // Sent where it is, on the connection it came from, by a thread that may wait.
            let (Some(spin_first), None) = (&self.spin_first, self.is_closed()) else {
                let status = self.is_closed().unwrap_or_else(|| {
                    Status::new(isthmus::Code::InvalidArgument, "this channel did not allocate the block")
                });
                self.completions.run(token, async move { Outcome::Failed(status) });
                return Ok(());
            };
            let call = unary_block_off_loop(spin_first.channel().clone(), path, block, options);
            self.completions.run(token, async move {
                match call.await {
                    Ok(response) => Outcome::Raw(Some(response.message)),
                    Err(status) => Outcome::Failed(status),
                }
            });
            return Ok(());
        }
        self.run_unary(token, path, request, options, true);
        Ok(())
    }

    /// Starts a streaming call as operation `token`: `(ok, value)` if it started (or failed)
    /// at once, None if it completes through the reactor.
    #[pyo3(signature = (token, path, metadata, timeout, wait_for_ready, compression=None))]
    #[allow(clippy::too_many_arguments)]
    fn start(
        &self,
        py: Python<'_>,
        token: u64,
        path: String,
        metadata: Option<&Bound<'_, PyAny>>,
        timeout: Option<f64>,
        wait_for_ready: bool,
        compression: Option<&str>,
    ) -> PyResult<Option<(bool, Py<PyAny>)>> {
        let options = options(metadata, timeout, wait_for_ready, compression)?;
        let (engine, closed) = (self.engine.clone(), self.is_closed());
        run_now(py, &self.completions, token, async move {
            match closed {
                Some(status) => Outcome::Failed(status),
                None => engine
                    .start(&path, options)
                    .await
                    .map_or_else(Outcome::Failed, |c| Outcome::Started(SharedCall::new(c))),
            }
        })
    }

    /// gRPC's connectivity state, numbered as grpcio's `ChannelConnectivity`; see the blocking
    /// channel's.
    fn connectivity(&self, try_to_connect: bool) -> u8 {
        if self.closed.load(Ordering::Relaxed) {
            return isthmus::Connectivity::Shutdown as u8;
        }
        let blocking = self.spin_first.as_ref().map(SpinFirst::channel);
        crate::client::connectivity(blocking, &self.engine, try_to_connect) as u8
    }

    /// Operation `token` completes once the engine channel's state changes (the fast path's
    /// connection has no events: callers look again after a while).
    fn watch_connectivity(&self, token: u64) {
        let engine = self.engine.clone();
        self.completions.run(token, async move {
            let from = engine.connectivity(false);
            engine.connectivity_changed(from).await;
            Outcome::Done
        });
    }

    /// Closes the channel's `shm://` connections (both: the reactor's and the fast path's);
    /// calls still on them end CANCELLED. Over HTTP/2 the connection closes when the channel
    /// is dropped.
    fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
        if let Some(spin_first) = &self.spin_first {
            spin_first.channel().close(crate::client::closed_by_close());
        }
        self.engine.close(crate::client::closed_by_close());
    }
}

impl AsyncChannel {
    /// [`unary`](Self::unary) with its arguments converted (also `AioUnaryCallable`'s).
    pub(crate) fn unary_now(
        &self,
        py: Python<'_>,
        token: u64,
        path: impl AsRef<str> + Send + 'static,
        request: impl AsRef<[u8]> + Send + 'static,
        options: isthmus::CallOptions,
        spin: bool,
    ) -> PyResult<Py<PyAny>> {
        let wait_for_ready = options.wait_for_ready;
        let fast =
            match spin && !wait_for_ready && request.as_ref().len() <= SPIN_REQUEST_MAX && self.is_closed().is_none() {
                true => self.spin_first.as_ref().and_then(SpinFirst::ready),
                false => None,
            };
        let Some(fast) = fast else {
            self.run_unary(token, path, request, options, false);
            return Ok(py.None());
        };
        let (to, message) = (path.as_ref(), request.as_ref());
        let begun = py.detach(|| {
            let begun = fast.unary_begin_within(to, message, &options, SEND_PATIENCE);
            begun.map(|unary| unary.map(|unary| finish_unary(unary, isthmus::SpinPolicy::default().max)))
        });
        let reply = match begun {
            Ok(Some(reply)) => Ok(reply),
            Err(status) => Err(status),
            // No room for it now: the reactor's path sends it (a task may wait; the loop not).
            Ok(None) => {
                self.run_unary(token, path, request, options, false);
                return Ok(py.None());
            }
        };
        let outcome = self.completions.run_now(token, async move {
            match reply {
                Ok(reply) => Outcome::from(reply.await),
                Err(status) => Outcome::Failed(status),
            }
        });
        match outcome {
            Some(o) => Ok(outcome_value(py, &self.completions, o)?.into_pyobject(py)?.into_any().unbind()),
            None => Ok(pyo3::types::PyBool::new(py, false).to_owned().into_any().unbind()),
        }
    }

    fn is_closed(&self) -> Option<Status> {
        self.closed.load(Ordering::Relaxed).then(|| Status::new(isthmus::Code::Unavailable, "the channel was closed"))
    }
}

/// One call driven through a [`Reactor`].
#[pyclass(module = "isthmus._native", frozen)]
pub(crate) struct AsyncCall {
    core: Arc<SharedCall>,
    completions: Arc<Completions>,
}

/// What an operation that may finish when it starts gives back: `(ok, value)` if it did (as
/// the reactor would have delivered it, with no trip through the eventfd and the loop's selector),
/// None if its outcome comes through the reactor.
pub(crate) type Now = PyResult<Option<(bool, Py<PyAny>)>>;

/// Runs `fut` as operation `token` of `completions`, its outcome returned if ready at once
/// (the streaming calls' operations, and the asyncio server's).
pub(crate) fn run_now(
    py: Python<'_>,
    completions: &Arc<Completions>,
    token: u64,
    fut: impl std::future::Future<Output = Outcome> + Send + 'static,
) -> Now {
    completions.run_now(token, fut).map(|outcome| outcome_value(py, completions, outcome)).transpose()
}

/// Each operation returns its outcome if it finished at once (a send with room in the ring, a
/// message already received), else None and completes through the reactor.
#[pymethods]
impl AsyncCall {
    #[pyo3(signature = (token, message, last=false))]
    fn send(&self, py: Python<'_>, token: u64, message: &Bound<'_, PyBytes>, last: bool) -> Now {
        let (core, message) = (self.core.clone(), bytes_from_py(message));
        run_now(py, &self.completions, token, async move { Outcome::Sent(core.send(message, last).await) })
    }

    fn close_send(&self, py: Python<'_>, token: u64) -> Now {
        let core = self.core.clone();
        run_now(py, &self.completions, token, async move {
            core.close_send().await;
            Outcome::Done
        })
    }

    fn recv(&self, py: Python<'_>, token: u64) -> Now {
        let core = self.core.clone();
        run_now(py, &self.completions, token, async move { core.recv().await.into() })
    }

    fn initial_metadata(&self, py: Python<'_>, token: u64) -> Now {
        let core = self.core.clone();
        run_now(py, &self.completions, token, async move { core.headers().await.into() })
    }

    fn trailing_metadata(&self, py: Python<'_>) -> PyResult<Option<PyMetadata>> {
        self.core.trailers().map(|t| metadata_to_py(py, &t)).transpose()
    }

    fn details(&self) -> Option<String> {
        self.core.status_message()
    }

    fn cancel(&self) {
        self.core.cancel();
    }
}

impl AsyncChannel {
    /// Runs one unary call as operation `token`; a `raw` one completes with a `Message`.
    fn run_unary(
        &self,
        token: u64,
        path: impl AsRef<str> + Send + 'static,
        request: impl AsRef<[u8]> + Send + 'static,
        options: isthmus::CallOptions,
        raw: bool,
    ) {
        let engine = self.engine.clone();
        run_unary(&self.completions, token, engine, self.is_closed(), path, request, options, raw);
    }
}

/// Runs one unary call on `engine` as operation `token` of `completions` (failed with
/// `closed` if the channel was closed); a `raw` one completes with a `Message`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_unary(
    completions: &Arc<Completions>,
    token: u64,
    engine: isthmus::Channel,
    closed: Option<Status>,
    path: impl AsRef<str> + Send + 'static,
    request: impl AsRef<[u8]> + Send + 'static,
    options: isthmus::CallOptions,
    raw: bool,
) {
    completions.run(token, async move {
        if let Some(status) = closed {
            return Outcome::Failed(status);
        }
        match engine.unary(path.as_ref(), request.as_ref(), options).await {
            Ok(response) if raw => Outcome::Raw(Some(response.message)),
            Ok(response) => Outcome::Unary(response),
            Err(status) => Outcome::Failed(status),
        }
    });
}
