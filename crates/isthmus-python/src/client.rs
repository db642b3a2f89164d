//! Blocking calls: every wait releases the GIL. A unary call over `shm://` runs on the calling
//! thread, which reads its own reply; other calls run on the shared runtime.
//!
//! Which thread waits:
//!
//! - A unary call (`__call__`, `with_call`) over `shm://` runs on the engine's blocking channel on
//!   the calling thread, GIL released: the thread writes its request into the ring and reads its
//!   own reply, with no runtime and no thread hop. This is the fast path; it makes no Python call
//!   object, and a stub's call without metadata or a compression of its own runs it with no
//!   Python frame at all ([`UnaryCallable`], the base of `UnaryUnaryMultiCallable`).
//! - Every other call (streaming shapes, `.future()`), and every call over `unix://` and `http://`,
//!   runs on the engine's async `Channel` on the shared runtime, driven by `block_on` from the
//!   calling thread, GIL released. Over `shm://` that thread reads the connection while it waits
//!   (ADR 0008), so a reply within the spin bound reaches it with no wake across threads; a later
//!   one is read by the reader task and handed over.
//! - So an `shm://` channel may hold two connections to its server, each made on first use: the
//!   blocking one for unary calls, the async one for the rest.
//! - A request iterator (stream-unary, stream-stream) is consumed by a thread of its own per call
//!   (`isthmus-requests`), so responses can be read meanwhile and an iterator that blocks cannot
//!   hold up the status; the two halves meet in the call's `isthmus::binding::SharedCall`.
//! - A unary `.future()` is an operation of one process-wide `Reactor` (`unary_future`), its
//!   reply read by the connection's reader task; the Python thread `isthmus-futures` drains the
//!   reactor and resolves the futures, so no thread waits per call (ADR 0018). A `.future()`
//!   with a request iterator runs on a thread of its own.
//! - Connectivity (`connectivity`, `wait_connectivity`): READY while the fast path's blocking
//!   connection is up (its socket is looked at), else the engine channel's state, which
//!   `try_to_connect` starts connecting in the background (`isthmus::connectivity`).
//! - A wait on the main thread runs the signal handlers every 100 ms (`SIGNAL_SLICE`), as
//!   grpcio's do: Ctrl-C raises KeyboardInterrupt out of it, and cancels a unary call.
//! - `close` fails calls in progress CANCELLED "Channel closed!" as grpcio does, over `shm://`
//!   (its connections end) and over HTTP/2 alike (their streams reset; the connection closes
//!   with the channel). Of `options`, the message-size limits, `grpc.ssl_target_name_override` and
//!   `isthmus.upgrade` are used here; a call's `compression` (a `grpc-encoding` name, resolved
//!   against the channel's in Python) compresses its requests over HTTP/2.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use isthmus::binding::SharedCall;
use isthmus::{Code, MetadataMap, Status};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::buffers::{Block, Message, Outgoing, Request};
use crate::convert::{bytes_from_py, call_error, metadata_to_py, options, PyMetadata};
use crate::runtime;

/// A unary call's outcome. The metadata stays in Rust until asked for: most callers want only
/// the message, and two empty lists per call cost the asyncio loop ~0.1 µs of its time.
#[pyclass(module = "isthmus._native", frozen)]
pub(crate) struct UnaryResult {
    #[pyo3(get)]
    pub(crate) message: Py<PyBytes>,
    initial: MetadataMap,
    trailing: MetadataMap,
    /// The OK status's message (grpcio's `details()`), nearly always empty.
    #[pyo3(get)]
    details: String,
}

impl UnaryResult {
    pub(crate) fn new(py: Python<'_>, response: isthmus::Response) -> UnaryResult {
        UnaryResult {
            message: PyBytes::new(py, &response.message).unbind(),
            initial: response.metadata,
            trailing: response.trailers,
            details: response.status_message,
        }
    }
}

#[pymethods]
impl UnaryResult {
    #[getter]
    fn initial_metadata(&self, py: Python<'_>) -> PyResult<PyMetadata> {
        metadata_to_py(py, &self.initial)
    }

    #[getter]
    fn trailing_metadata(&self, py: Python<'_>) -> PyResult<PyMetadata> {
        metadata_to_py(py, &self.trailing)
    }
}

/// HTTP/2 keepalive as Python gives it (`_channel.keepalive`): grpc's `keepalive_time_ms`,
/// `keepalive_timeout_ms` and `keepalive_permit_without_calls`.
pub(crate) type Keepalive = (u64, u64, bool);

/// [`Keepalive`] as the engine takes it.
pub(crate) fn engine_keepalive((time_ms, timeout_ms, permit_without_calls): Keepalive) -> isthmus::Keepalive {
    isthmus::Keepalive {
        time: std::time::Duration::from_millis(time_ms),
        timeout: std::time::Duration::from_millis(timeout_ms),
        permit_without_calls,
    }
}

/// The engine's channel to `target`, with TLS settings from Python if given; connects on its
/// first call.
#[allow(clippy::too_many_arguments)] // grpc's channel options, one by one
pub(crate) fn lazy_channel(
    target: &str,
    tls: Option<crate::tls::ClientTls>,
    upgrade: Option<bool>,
    config: isthmus::Config,
    keepalive: Option<Keepalive>,
    user_agent: Option<&str>,
    authority: Option<&str>,
    connect_timeout_ms: Option<u64>,
) -> PyResult<isthmus::Channel> {
    let _runtime = runtime().enter();
    // No choice made: the process's (`ISTHMUS_UPGRADE`), the builder's default.
    let mut builder = isthmus::Channel::builder(target).config(config);
    if let Some(upgrade) = upgrade {
        builder = builder.upgrade(upgrade);
    }
    if let Some(agent) = user_agent {
        builder = builder.user_agent(agent);
    }
    if let Some(authority) = authority {
        builder = builder.authority(authority);
    }
    if let Some(tls) = tls {
        builder = builder.tls_config(crate::tls::client_config(tls)?);
    }
    if let Some(k) = keepalive {
        builder = builder.keepalive(engine_keepalive(k));
    }
    if let Some(ms) = connect_timeout_ms {
        builder = builder.connect_timeout(std::time::Duration::from_millis(ms));
    }
    builder.connect_lazy().map_err(|s| bad_target(&s))
}

/// The engine's blocking channel to an `shm://` `target`, naming `user_agent` if given.
pub(crate) fn blocking_channel(
    target: &str,
    config: isthmus::Config,
    user_agent: Option<&str>,
) -> Result<isthmus::blocking::Channel, isthmus::Status> {
    named(isthmus::blocking::Channel::lazy_with(target, config)?, user_agent)
}

/// `channel`, naming `user_agent` if given; a wait for its server runs the signal handlers,
/// and one that raises ends the wait with its exception ([`interrupted`]).
fn named(
    channel: isthmus::blocking::Channel,
    user_agent: Option<&str>,
) -> Result<isthmus::blocking::Channel, isthmus::Status> {
    if let Some(agent) = user_agent {
        channel.set_user_agent(agent)?;
    }
    channel.set_interrupt(
        std::sync::Arc::new(|| match signals() {
            Ok(()) => true,
            Err(raised) => {
                Python::attach(|py| raised.restore(py));
                false
            }
        }),
        std::sync::Arc::new(interruptible_here),
    );
    Ok(channel)
}

/// Whether a wait on this thread for a handshake should look at the signal handlers: inside a
/// unary call on the main thread (the only one they run on; [`Armed`], whose error
/// [`interrupted`] makes of what they raise). Elsewhere the handshake runs on the calling
/// thread, with no thread started for it and no handler run.
fn interruptible_here() -> bool {
    ARMED.get()
}

/// A unary call's wait on the main thread, which may be interrupted by a signal handler while
/// it waits for a handshake ([`interruptible_here`]), for as long as this lives; what it held
/// before comes back after.
struct Armed(bool);

impl Armed {
    fn new(py: Python<'_>) -> Armed {
        Armed(ARMED.replace(is_main_thread(py).unwrap_or(false)))
    }
}

impl Drop for Armed {
    fn drop(&mut self) {
        ARMED.set(self.0);
    }
}

/// The exception a signal handler raised while the call that failed with `status` waited for
/// its server (the channel's interrupt left it set), else `status`'s error.
fn interrupted(py: Python<'_>, status: &Status) -> PyErr {
    match status.code() == Code::Cancelled {
        true => PyErr::take(py).unwrap_or_else(|| call_error(py, status)),
        false => call_error(py, status),
    }
}

/// [`Channel::upgrade_status`] as Python sees it.
pub(crate) fn upgrade_status(engine: &isthmus::Channel) -> String {
    match engine.upgrade_status() {
        isthmus::UpgradeStatus::Off => "off".into(),
        isthmus::UpgradeStatus::Pending => "pending".into(),
        isthmus::UpgradeStatus::Http2 => "http2".into(),
        isthmus::UpgradeStatus::Shm(to) => to.target,
    }
}

/// The engine's settings for a client channel: grpc's `max_receive_message_length` (None for
/// no limit beyond the engine's own).
pub(crate) fn client_config(max_receive: Option<u64>) -> isthmus::Config {
    let mut config = isthmus::Config::default();
    if let Some(limit) = max_receive {
        config.max_message_size = limit;
    }
    config
}

/// A binding channel's connectivity: READY while its blocking fast path's connection is up
/// (its socket is looked at), else the engine channel's state, which `try_to_connect` starts
/// connecting in the background.
pub(crate) fn connectivity(
    blocking: Option<&isthmus::blocking::Channel>,
    engine: &isthmus::Channel,
    try_to_connect: bool,
) -> isthmus::Connectivity {
    if blocking.is_some_and(|b| b.connectivity(false) == isthmus::Connectivity::Ready) {
        return isthmus::Connectivity::Ready;
    }
    let _runtime = runtime().enter();
    engine.connectivity(try_to_connect)
}

/// What `close()` does to calls in progress, in grpcio's words.
pub(crate) fn closed_by_close() -> Status {
    Status::new(Code::Cancelled, "Channel closed!")
}

pub(crate) fn bad_target(status: &Status) -> PyErr {
    PyValueError::new_err(status.message().to_owned())
}

/// What a call made on a closed channel raises, as grpcio's: `ValueError`, in its words for a
/// blocking unary call (`on_closed`) or for the others. Calls failed UNAVAILABLE, which a
/// retry loop takes as a reason to try again.
fn closed(on_closed: bool) -> PyErr {
    PyValueError::new_err(match on_closed {
        true => "Cannot invoke RPC on closed channel!",
        false => "Cannot invoke RPC: Channel closed!",
    })
}

/// A channel for blocking calls.
#[pyclass(module = "isthmus._native", frozen)]
pub(crate) struct Channel {
    /// Unary calls over `shm://` (the fast path).
    blocking: Option<isthmus::blocking::Channel>,
    /// Everything else.
    engine: isthmus::Channel,
    /// The same channel, for unary calls this binding has routed itself (HTTP/2).
    direct: isthmus::Channel,
    /// For a channel to an HTTP/2 address that moved to shared memory: the fast path's own
    /// channel to where it moved.
    upgraded: std::sync::Mutex<Option<(isthmus::UpgradedTo, isthmus::blocking::Channel)>>,
    /// The engine's settings for every connection of this channel.
    config: isthmus::Config,
    /// The user agent its calls name (grpc's `grpc.primary_user_agent`), if any.
    user_agent: Option<String>,
    closed: AtomicBool,
}

impl Channel {
    /// The fast path's channel for a unary call, if this channel to an HTTP/2 address has moved
    /// to shared memory and that connection is up (connecting it if need be, by `deadline`);
    /// `Ok(None)` for HTTP/2, `Err` (DEADLINE_EXCEEDED) if the deadline passed while it
    /// connected, or (CANCELLED) if a signal handler ended the wait. Blocks (a handshake): call
    /// without the GIL.
    fn upgraded(&self, deadline: Option<Instant>) -> Result<Option<isthmus::blocking::Channel>, Status> {
        let to = {
            let _runtime = runtime().enter();
            self.engine.route_for_binding()
        };
        let Some(to) = to else { return Ok(None) };
        let channel = {
            let Ok(mut cached) = self.upgraded.lock() else { return Ok(None) };
            match &*cached {
                Some((current, channel)) if *current == to => channel.clone(),
                _ => {
                    let channel = isthmus::blocking::Channel::lazy_upgraded(&to, self.config.clone());
                    let Some(channel) = channel.ok().and_then(|c| named(c, self.user_agent.as_deref()).ok()) else {
                        return Ok(None);
                    };
                    *cached = Some((to.clone(), channel.clone()));
                    channel
                }
            }
        };
        if channel.is_connected() {
            return Ok(Some(channel));
        }
        match channel.connect_by(deadline) {
            Ok(()) => Ok(Some(channel)),
            // The call's deadline came before the handshake ended (which goes on), or a signal
            // handler ended the wait: that says nothing of the connection.
            Err(status) if matches!(status.code(), Code::DeadlineExceeded | Code::Cancelled) => Err(status),
            Err(_) => {
                self.engine.upgrade_lost(&to);
                Ok(None)
            }
        }
    }

    /// [`upgraded`](Self::upgraded) for a unary request of `len` bytes, which waits for a
    /// probe under way first if HTTP/2 would likely refuse the request
    /// (`isthmus::Channel::settle_upgrade`). Takes the time waited, and spent connecting, from
    /// `options`' timeout, so that a call that goes on over HTTP/2 keeps its deadline. Blocks:
    /// call without the GIL.
    fn settled_upgrade(
        &self,
        len: usize,
        options: &mut isthmus::CallOptions,
    ) -> Result<Option<isthmus::blocking::Channel>, Status> {
        // `settle_upgrade` looks at the size too; here it saves the calls that cannot wait
        // (nearly all) a trip into the runtime.
        if len as u64 > isthmus::HTTP_MAX_MESSAGE {
            options.timeout = runtime().block_on(self.engine.settle_upgrade(len, options.timeout));
        }
        let began = Instant::now();
        // A timeout too long for the clock (a caller's "forever") bounds nothing.
        let deadline = options.timeout.and_then(|t| began.checked_add(t));
        let channel = self.upgraded(deadline)?;
        // Whichever way the call goes, connecting took from its time.
        options.timeout = options.timeout.map(|t| t.saturating_sub(began.elapsed()));
        Ok(channel)
    }

    /// One unary call, the GIL released while it runs.
    fn call_unary(
        &self,
        py: Python<'_>,
        path: &str,
        request: &[u8],
        mut options: isthmus::CallOptions,
    ) -> PyResult<isthmus::Response> {
        if self.closed.load(Ordering::Relaxed) {
            return Err(closed(true));
        }
        let _armed = Armed::new(py);
        let response = match &self.blocking {
            Some(channel) => py.detach(|| channel.unary_checked(path, request, options, SIGNAL_SLICE, signals))?,
            None => py.detach(|| match self.settled_upgrade(request.len(), &mut options) {
                // As the engine's own upgraded calls: over shm:// the call does not wait for a
                // server (it would retry the address a restarted server left for good).
                Ok(Some(channel)) => {
                    let options = isthmus::CallOptions { wait_for_ready: false, ..options };
                    channel.unary_checked(path, request, options, SIGNAL_SLICE, signals)
                }
                Ok(None) => block_on_checked(self.direct.unary(path, request, options)),
                Err(status) => Ok(Err(status)),
            })?,
        };
        response.map_err(|status| interrupted(py, &status))
    }
}

#[pymethods]
impl Channel {
    #[new]
    #[pyo3(signature = (target, tls=None, upgrade=None, max_receive=None, keepalive=None, user_agent=None, authority=None, connect_timeout_ms=None))]
    #[allow(clippy::too_many_arguments)] // grpc's channel options, one by one
    fn new(
        target: &str,
        tls: Option<crate::tls::ClientTls>,
        upgrade: Option<bool>,
        max_receive: Option<u64>,
        keepalive: Option<Keepalive>,
        user_agent: Option<String>,
        authority: Option<&str>,
        connect_timeout_ms: Option<u64>,
    ) -> PyResult<Channel> {
        let config = client_config(max_receive);
        let agent = user_agent.as_deref();
        let blocking = match target.starts_with("shm:") && tls.is_none() {
            true => Some(blocking_channel(target, config.clone(), agent).map_err(|s| bad_target(&s))?),
            false => None,
        };
        let engine =
            lazy_channel(target, tls, upgrade, config.clone(), keepalive, agent, authority, connect_timeout_ms)?;
        let direct = engine.without_upgrade();
        let upgraded = std::sync::Mutex::new(None);
        Ok(Channel { blocking, engine, direct, upgraded, config, user_agent, closed: AtomicBool::new(false) })
    }

    /// The counters of this channel's `shm://` connections (`isthmus.TransportStats`).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let mut counters = vec![self.engine.counters()];
        counters.extend(self.blocking.as_ref().map(isthmus::blocking::Channel::counters));
        if let Some((_, channel)) = self.upgraded.lock().ok().as_ref().and_then(|u| u.as_ref()) {
            counters.push(channel.counters());
        }
        crate::convert::counters_to_py(py, counters)
    }

    /// Calls started over shared memory and over HTTP/2, for a channel to an HTTP/2 address.
    fn transport_counts(&self) -> (u64, u64) {
        let counts = self.engine.transport_counts();
        (counts.shm, counts.http2)
    }

    /// `off`, `pending`, `http2`, or the `shm://` target the channel moved to.
    fn upgrade_status(&self) -> String {
        upgrade_status(&self.engine)
    }

    #[pyo3(signature = (path, request, metadata, timeout, wait_for_ready, compression=None))]
    #[allow(clippy::too_many_arguments)]
    fn unary(
        &self,
        py: Python<'_>,
        path: &str,
        request: &Bound<'_, PyBytes>,
        metadata: Option<&Bound<'_, PyAny>>,
        timeout: Option<f64>,
        wait_for_ready: bool,
        compression: Option<&str>,
    ) -> PyResult<UnaryResult> {
        let options = options(metadata, timeout, wait_for_ready, compression)?;
        let response = self.call_unary(py, path, request.as_bytes(), options)?;
        Ok(UnaryResult::new(py, response))
    }

    /// [`unary`](Self::unary) when only the response message is wanted (a stub's plain call):
    /// no result object and no metadata lists to build.
    #[pyo3(signature = (path, request, metadata, timeout, wait_for_ready, compression=None))]
    #[allow(clippy::too_many_arguments)]
    fn unary_message<'py>(
        &self,
        py: Python<'py>,
        path: &str,
        request: &Bound<'_, PyBytes>,
        metadata: Option<&Bound<'_, PyAny>>,
        timeout: Option<f64>,
        wait_for_ready: bool,
        compression: Option<&str>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let options = options(metadata, timeout, wait_for_ready, compression)?;
        let response = self.call_unary(py, path, request.as_bytes(), options)?;
        Ok(PyBytes::new(py, &response.message))
    }

    /// A unary call (`.future()`) run as operation `token` of `reactor`: it completes with a
    /// `UnaryResult` (or a `CallError`) on the thread that drains the reactor, so no thread
    /// waits per call. The connection's reader task reads its reply.
    #[pyo3(signature = (reactor, token, path, request, metadata, timeout, wait_for_ready, compression=None))]
    #[allow(clippy::too_many_arguments)]
    fn unary_future(
        &self,
        reactor: &crate::reactor::Reactor,
        token: u64,
        path: String,
        request: &Bound<'_, PyBytes>,
        metadata: Option<&Bound<'_, PyAny>>,
        timeout: Option<f64>,
        wait_for_ready: bool,
        compression: Option<&str>,
    ) -> PyResult<()> {
        if self.closed.load(Ordering::Relaxed) {
            return Err(closed(false));
        }
        let options = options(metadata, timeout, wait_for_ready, compression)?;
        let engine = self.engine.with_calls_read(false);
        let request = crate::convert::PyBuffer::of(request);
        crate::reactor::run_unary(&reactor.completions, token, engine, None, path, request, options, false);
        Ok(())
    }

    /// A writable block to build a request in: this side's shared memory over `shm://`
    /// (waiting for room), heap memory on other transports, and for a size the whole arena
    /// could not hold (RESOURCE_EXHAUSTED: no wait would make room), sent as a copy.
    #[pyo3(signature = (size, timeout=None))]
    fn alloc(&self, py: Python<'_>, size: usize, timeout: Option<f64>) -> PyResult<Block> {
        match &self.blocking {
            Some(channel) => {
                // In slices, as every blocking wait here: Ctrl-C ends a wait for room that
                // nothing may ever make (this thread's own unsent blocks fill the arena).
                let timeout = crate::convert::timeout_from_py(timeout);
                let deadline = timeout.and_then(|t| std::time::Instant::now().checked_add(t));
                let allocated = py.detach(|| loop {
                    let left = deadline.map(|d| d.saturating_duration_since(std::time::Instant::now()));
                    let slice = left.map_or(SIGNAL_SLICE, |left| left.min(SIGNAL_SLICE));
                    match channel.alloc(size, Some(slice)) {
                        Err(s) if s.code() == Code::DeadlineExceeded && left.is_none_or(|l| l > slice) => {
                            signals()?;
                        }
                        done => return PyResult::Ok(done),
                    }
                })?;
                match allocated {
                    Ok(block) => Ok(Block::shm(block)),
                    Err(s) if s.code() == Code::ResourceExhausted => Block::heap(size),
                    Err(s) => Err(call_error(py, &s)),
                }
            }
            None => Block::heap(size),
        }
    }

    /// A unary call of the raw tier: `request` is a [`Block`] or any C-contiguous buffer,
    /// read where it is; the reply is a read-only [`Message`] (a view of shared memory when it
    /// came through the server's arena).
    #[pyo3(signature = (path, request, metadata=None, timeout=None, wait_for_ready=false, compression=None))]
    #[allow(clippy::too_many_arguments)]
    fn unary_raw(
        &self,
        py: Python<'_>,
        path: &str,
        request: &Bound<'_, PyAny>,
        metadata: Option<&Bound<'_, PyAny>>,
        timeout: Option<f64>,
        wait_for_ready: bool,
        compression: Option<&str>,
    ) -> PyResult<Message> {
        // Checked before the request is taken: a Block taken is a Block sent.
        if self.closed.load(Ordering::Relaxed) {
            return Err(closed(true));
        }
        let options = options(metadata, timeout, wait_for_ready, compression)?;
        if let Ok(block) = request.cast::<Block>() {
            let refused = block.try_borrow().is_ok_and(|block| match &self.blocking {
                Some(channel) => block.refused_by(|b| channel.can_send(b)),
                None => block.refused_by(|_| false),
            });
            if refused {
                let why = "the block was allocated by another channel, or by a connection of this one that is gone \
                           (allocate it again)";
                return Err(call_error(py, &Status::new(Code::InvalidArgument, why)));
            }
        }
        let response = match Request::from_py(request)? {
            Request::Block(Outgoing::Shm(block)) => {
                let sent = match &self.blocking {
                    Some(channel) => py.detach(|| match channel.unary_block_begin(path, block, options) {
                        Ok(pending) => pending.wait_checked(SIGNAL_SLICE, signals),
                        Err(status) => Ok(Err(status)),
                    })?,
                    None => Err(Status::new(Code::InvalidArgument, "this block was allocated by another channel")),
                };
                sent.map_err(|status| interrupted(py, &status))?
            }
            other => {
                let bytes = other.as_slice().unwrap_or_default();
                self.call_unary(py, path, bytes, options)?
            }
        };
        Ok(Message::new(response.message))
    }

    #[pyo3(signature = (path, metadata, timeout, wait_for_ready, compression=None))]
    fn start(
        &self,
        py: Python<'_>,
        path: &str,
        metadata: Option<&Bound<'_, PyAny>>,
        timeout: Option<f64>,
        wait_for_ready: bool,
        compression: Option<&str>,
    ) -> PyResult<Call> {
        if self.closed.load(Ordering::Relaxed) {
            return Err(closed(false));
        }
        let options = options(metadata, timeout, wait_for_ready, compression)?;
        match py.detach(|| block_on_checked(self.engine.start(path, options)))? {
            Ok(call) => Ok(Call(SharedCall::new(call))),
            Err(status) => Err(call_error(py, &status)),
        }
    }

    /// gRPC's connectivity state, numbered as grpcio's `ChannelConnectivity` (0 IDLE,
    /// 1 CONNECTING, 2 READY, 3 TRANSIENT_FAILURE, 4 SHUTDOWN).
    fn connectivity(&self, try_to_connect: bool) -> u8 {
        if self.closed.load(Ordering::Relaxed) {
            return isthmus::Connectivity::Shutdown as u8;
        }
        connectivity(self.blocking.as_ref(), &self.engine, try_to_connect) as u8
    }

    /// Waits, the GIL released, up to `timeout` seconds for the engine channel's state to
    /// change (the fast path's connection has no events: callers look again after the
    /// timeout), and gives [`connectivity`](Self::connectivity) then.
    fn wait_connectivity(&self, py: Python<'_>, timeout: f64) -> u8 {
        let timeout = seconds_up_to(timeout, 3600.0);
        let engine = &self.engine;
        py.detach(|| {
            runtime().block_on(async {
                let from = engine.connectivity(false);
                let _ = tokio::time::timeout(timeout, engine.connectivity_changed(from)).await;
            })
        });
        self.connectivity(false)
    }

    /// Closes the channel as grpcio's `close` does: calls in progress end CANCELLED "Channel
    /// closed!" (over HTTP/2 too) and the `shm://` connections close; later calls fail. The
    /// HTTP/2 connection closes when the channel is dropped.
    fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
        if let Some(blocking) = &self.blocking {
            blocking.close(closed_by_close());
        }
        self.engine.close(closed_by_close());
        if let Ok(mut upgraded) = self.upgraded.lock() {
            if let Some((_, channel)) = upgraded.take() {
                channel.close(closed_by_close());
            }
        }
    }
}

/// grpcio's details for a request that could not be serialized (`_call.SERIALIZE_FAILED`).
pub(crate) const SERIALIZE_FAILED: &str = "Exception serializing request!";

/// A stub's blocking unary call (`UnaryUnaryMultiCallable.__call__`) in one native step: the
/// request serialized, the call made and the reply deserialized with no Python frame between
/// them, which cost a 64 B call 0.5-0.8 µs of its ~4 µs. A call with metadata or a compression
/// of its own goes to the subclass's `_call`, as does no other: only that common case is here.
/// A failure becomes its exception through the subclass's `_failed(stage, error)` (0: the
/// serializer raised, 1: the call failed with a `CallError`, 2: the deserializer raised), so
/// that grpcio's errors and log lines stay written once, in Python.
#[pyclass(module = "isthmus._native", frozen, subclass)]
pub(crate) struct UnaryCallable {
    channel: Py<Channel>,
    path: String,
    serialize: Option<Py<PyAny>>,
    deserialize: Option<Py<PyAny>>,
    compression: Option<isthmus::Compression>,
}

#[pymethods]
impl UnaryCallable {
    #[new]
    #[pyo3(signature = (channel, path, serialize, deserialize, compression=None))]
    fn new(
        channel: Py<Channel>,
        path: String,
        serialize: Option<Py<PyAny>>,
        deserialize: Option<Py<PyAny>>,
        compression: Option<&str>,
    ) -> PyResult<UnaryCallable> {
        let compression = crate::convert::compression_from_py(compression)?;
        Ok(UnaryCallable { channel, path, serialize, deserialize, compression })
    }

    /// Its references, for Python's cycle collector: a serializer that is a bound method of an
    /// object holding this multi-callable is a cycle the collector must see to free.
    fn __traverse__(&self, visit: pyo3::gc::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
        visit.call(&self.channel)?;
        visit.call(&self.serialize)?;
        visit.call(&self.deserialize)
    }

    #[pyo3(signature = (request, timeout=None, metadata=None, credentials=None, wait_for_ready=None, compression=None))]
    fn __call__<'py>(
        slf: &Bound<'py, Self>,
        request: &Bound<'py, PyAny>,
        timeout: Option<&Bound<'py, PyAny>>,
        metadata: Option<&Bound<'py, PyAny>>,
        credentials: Option<&Bound<'py, PyAny>>,
        wait_for_ready: Option<&Bound<'py, PyAny>>,
        compression: Option<&Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        if metadata.is_some() || compression.is_some() || credentials.is_some() {
            let args = (request, timeout, metadata, credentials, wait_for_ready, compression);
            return slf.call_method1(pyo3::intern!(py, "_call"), args);
        }
        let this = slf.get();
        let failed = |stage: u8, error: PyErr| match slf.call_method1(pyo3::intern!(py, "_failed"), (stage, error)) {
            Ok(raised) => PyErr::from_value(raised),
            Err(e) => e,
        };
        // Only what Python's `except Exception` would catch becomes the call's error.
        let raised = |stage: u8, error: PyErr| match error.is_instance_of::<pyo3::exceptions::PyException>(py) {
            true => failed(stage, error),
            false => error,
        };
        let encoded;
        let request = match &this.serialize {
            None => request,
            Some(serialize) => {
                encoded = serialize.bind(py).call1((request,)).map_err(|e| raised(0, e))?;
                &encoded
            }
        };
        // grpcio reads a request that serializes to None as its serializer's failure.
        if request.is_none() {
            return Err(failed(1, call_error(py, &Status::new(Code::Internal, SERIALIZE_FAILED))));
        }
        let request = request.cast::<PyBytes>()?;
        let options = isthmus::CallOptions {
            timeout: crate::convert::timeout_from_py(timeout.map(|t| t.extract::<f64>()).transpose()?),
            wait_for_ready: wait_for_ready.map(|w| w.is_truthy()).transpose()?.unwrap_or(false),
            compression: this.compression,
            ..Default::default()
        };
        let response = this.channel.get().call_unary(py, &this.path, request.as_bytes(), options).map_err(|e| {
            match e.is_instance_of::<crate::convert::CallError>(py) {
                true => failed(1, e),
                false => e,
            }
        })?;
        let reply = PyBytes::new(py, &response.message).into_any();
        match &this.deserialize {
            None => Ok(reply),
            Some(deserialize) => deserialize.bind(py).call1((reply,)).map_err(|e| raised(2, e)),
        }
    }
}

/// `seconds` from Python as a duration of at most `max` seconds; a negative one or NaN is none
/// (`Duration::from_secs_f64` panics on both).
fn seconds_up_to(seconds: f64, max: f64) -> std::time::Duration {
    match seconds.is_nan() {
        true => std::time::Duration::ZERO,
        false => std::time::Duration::from_secs_f64(seconds.clamp(0.0, max)),
    }
}

/// How long a blocking wait runs before the waiting thread looks for a signal, as grpcio's
/// waits do: Ctrl-C ends a wait for a reply or a message that does not come.
const SIGNAL_SLICE: std::time::Duration = std::time::Duration::from_millis(100);

thread_local! {
    /// Whether this thread is Python's main thread, once a wait or a call has asked, and in
    /// which process (`isthmus::binding::forks`: a thread that forks is the child's main
    /// thread): only there do signal handlers run, so other threads need not take the GIL to
    /// look.
    static MAIN_THREAD: std::cell::Cell<Option<(u64, bool)>> = const { std::cell::Cell::new(None) };
    /// Inside a unary call on this thread ([`Armed`]).
    static ARMED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs the signal handlers if this is the main thread (called without the GIL, which it
/// takes): the exception one raised (KeyboardInterrupt) ends the wait that called.
fn signals() -> PyResult<()> {
    if MAIN_THREAD.get().filter(|(of, _)| *of == isthmus::binding::forks()).is_some_and(|(_, main)| !main) {
        return Ok(());
    }
    Python::attach(|py| {
        if !is_main_thread(py)? {
            return Ok(());
        }
        // What the handlers call is no part of the call that waits ([`Armed`]).
        let _disarmed = Armed(ARMED.replace(false));
        py.check_signals()
    })
}

/// Whether this is Python's main thread, looked up once per thread and process (no system
/// call after that: a unary call asks).
fn is_main_thread(py: Python<'_>) -> PyResult<bool> {
    let forks = isthmus::binding::forks();
    if let Some((_, main)) = MAIN_THREAD.get().filter(|(of, _)| *of == forks) {
        return Ok(main);
    }
    let threading = py.import(pyo3::intern!(py, "threading"))?;
    let main = threading.call_method0(pyo3::intern!(py, "main_thread"))?;
    let current = threading.call_method0(pyo3::intern!(py, "current_thread"))?;
    let main = main.is(&current);
    MAIN_THREAD.set(Some((forks, main)));
    Ok(main)
}

/// `fut` run to its end on the runtime, called without the GIL: the signal handlers run each
/// [`SIGNAL_SLICE`] it waits, and one that raises ends the wait with its exception, `fut`
/// dropped (a stream's receive, send and start are cancel-safe; a unary call is cancelled).
/// An outcome at hand costs no timer: the slice's timer waits until the first pending poll.
fn block_on_checked<F: std::future::Future>(fut: F) -> PyResult<F::Output> {
    let mut fut = std::pin::pin!(fut);
    loop {
        // Made inside `block_on`: a timer needs the runtime's context.
        match runtime().block_on(async { tokio::time::timeout(SIGNAL_SLICE, fut.as_mut()).await }) {
            Ok(out) => return Ok(out),
            Err(_) => signals()?,
        }
    }
}

/// One blocking call of any shape; its sending and receiving sides may be used from two
/// threads at once.
#[pyclass(module = "isthmus._native", frozen)]
pub(crate) struct Call(Arc<SharedCall>);

#[pymethods]
impl Call {
    #[pyo3(signature = (message, last=false))]
    fn send(&self, py: Python<'_>, message: &Bound<'_, PyBytes>, last: bool) -> PyResult<bool> {
        let message = bytes_from_py(message);
        py.detach(|| block_on_checked(self.0.send(message, last)))
    }

    fn close_send(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| block_on_checked(self.0.close_send()))
    }

    fn recv(&self, py: Python<'_>) -> PyResult<Option<Py<PyBytes>>> {
        match py.detach(|| block_on_checked(self.0.recv()))? {
            Ok(message) => Ok(message.map(|m| PyBytes::new(py, &m).unbind())),
            Err(status) => Err(call_error(py, &status)),
        }
    }

    fn initial_metadata(&self, py: Python<'_>) -> PyResult<PyMetadata> {
        match py.detach(|| block_on_checked(self.0.headers()))? {
            Ok(metadata) => metadata_to_py(py, &metadata),
            Err(status) => Err(call_error(py, &status)),
        }
    }

    fn trailing_metadata(&self, py: Python<'_>) -> PyResult<Option<PyMetadata>> {
        self.0.trailers().map(|t| metadata_to_py(py, &t)).transpose()
    }

    /// Waits for the call's end once every response before it was read
    /// (`SharedCall::drained_end`, a response stream's status as grpcio gives it): `True` for
    /// OK, the status's `CallError` otherwise; `False` if `left` seconds pass with a response
    /// still unread.
    #[pyo3(signature = (left=None))]
    fn drained_end(&self, py: Python<'_>, left: Option<f64>) -> PyResult<bool> {
        let until = left.map(|left| std::time::Instant::now() + seconds_up_to(left, 1e9));
        match py.detach(|| block_on_checked(self.0.drained_end(until)))? {
            Some(Ok(())) => Ok(true),
            Some(Err(status)) => Err(call_error(py, &status)),
            None => Ok(false),
        }
    }

    /// [`drained_end`](Self::drained_end) as operation `token` of `reactor`, waiting on no
    /// thread: it completes with `True`, `False` or the status's `CallError` as that returns.
    #[pyo3(signature = (reactor, token, left=None))]
    fn watch_end(&self, reactor: &crate::reactor::Reactor, token: u64, left: Option<f64>) {
        let until = left.map(|left| std::time::Instant::now() + seconds_up_to(left, 1e9));
        let call = self.0.clone();
        reactor.completions.run(token, async move {
            match call.drained_end(until).await {
                Some(Ok(())) => crate::reactor::Outcome::Drained(true),
                Some(Err(status)) => crate::reactor::Outcome::Failed(status),
                None => crate::reactor::Outcome::Drained(false),
            }
        });
    }

    fn details(&self) -> Option<String> {
        self.0.status_message()
    }

    fn cancel(&self) {
        self.0.cancel();
    }
}
