//! The engine's server with Python behind it: every call, whatever its path, goes to one
//! Python callable (`dispatch`), which hands it to a thread pool or an event loop; the call's
//! handler then receives, sends and finishes it through [`ServerCall`].

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use isthmus::{Code, Handler, HandlerFuture, MetadataMap, Status};
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;

use crate::convert::{bytes_from_py, call_error, metadata_from_py, metadata_to_py, PyMetadata};
use crate::reactor::Reactor;
use crate::runtime;

type Finish = oneshot::Sender<Result<(), Status>>;

/// A call as its handler's operations share it.
struct ServerCore {
    call: tokio::sync::Mutex<isthmus::ServerCall>,
    path: String,
    metadata: MetadataMap,
    deadline: Option<Instant>,
    active: AtomicBool,
    /// Initial metadata or a message has been sent.
    responded: AtomicBool,
    /// Run once when the call ends (grpc's `add_callback`).
    callbacks: Mutex<Vec<Py<PyAny>>>,
}

impl ServerCore {
    /// The next request. With `flush_headers`, a call that has sent nothing yet and must wait
    /// for a request sends its (empty) initial metadata first: a client that waits for the
    /// response to open before it sends its first request (tonic's generated clients do) is
    /// then not left waiting on a handler that waits for that request.
    async fn recv(&self, flush_headers: bool) -> Result<Option<Bytes>, Status> {
        let mut call = self.call.lock().await;
        if flush_headers && !self.responded.load(Ordering::Acquire) {
            let ready = {
                let mut next = std::pin::pin!(call.recv());
                std::future::poll_fn(|cx| Poll::Ready(next.as_mut().poll(cx))).await
            };
            if let Poll::Ready(r) = ready {
                return r;
            }
            self.responded.store(true, Ordering::Release);
            call.send_headers(MetadataMap::new()).await?;
        }
        call.recv().await
    }

    async fn send(&self, message: Bytes) -> Result<(), Status> {
        self.responded.store(true, Ordering::Release);
        self.call.lock().await.send(&message).await
    }

    async fn send_headers(&self, metadata: MetadataMap) -> Result<(), Status> {
        self.responded.store(true, Ordering::Release);
        self.call.lock().await.send_headers(metadata).await
    }
}

/// Marks the call over and runs its callbacks when the handler's future ends, however it
/// ends: finished, cancelled by the client, or past its deadline.
struct Ended(Arc<ServerCore>);

impl Drop for Ended {
    fn drop(&mut self) {
        self.0.active.store(false, Ordering::Release);
        let callbacks = self.0.callbacks.lock().map(|mut c| std::mem::take(&mut *c)).unwrap_or_default();
        if !callbacks.is_empty() {
            Python::attach(|py| {
                for callback in callbacks {
                    if let Err(e) = callback.call0(py) {
                        e.print(py);
                    }
                }
            });
        }
    }
}

/// Hands every call to the Python `dispatch` callable.
struct PyHandler {
    dispatch: Py<PyAny>,
}

impl Handler for PyHandler {
    fn handle(self: Arc<Self>, call: isthmus::ServerCall) -> HandlerFuture {
        Box::pin(async move {
            let core = Arc::new(ServerCore {
                path: call.path().to_owned(),
                metadata: call.metadata().clone(),
                deadline: call.time_remaining().map(|t| Instant::now() + t),
                call: tokio::sync::Mutex::new(call),
                active: AtomicBool::new(true),
                responded: AtomicBool::new(false),
                callbacks: Mutex::new(Vec::new()),
            });
            let _ended = Ended(core.clone());
            let (finish, finished) = oneshot::channel();
            let dispatched = Python::attach(|py| -> PyResult<()> {
                let call = Py::new(py, ServerCall { core, finish: Mutex::new(Some(finish)) })?;
                self.dispatch.call1(py, (call,)).map(drop)
            });
            if let Err(e) = dispatched {
                return Err(Status::new(Code::Unknown, format!("the server could not start the handler: {e}")));
            }
            finished.await.unwrap_or_else(|_| {
                Err(Status::new(Code::Unknown, "the handler was dropped without finishing the call"))
            })
        })
    }
}

/// The server's side of one call.
#[pyclass(module = "isthmus._native", frozen)]
pub(crate) struct ServerCall {
    core: Arc<ServerCore>,
    /// Taken by `finish`; dropped unfinished, the call ends UNKNOWN.
    finish: Mutex<Option<Finish>>,
}

#[pymethods]
impl ServerCall {
    #[getter]
    fn path(&self) -> &str {
        &self.core.path
    }

    fn invocation_metadata(&self, py: Python<'_>) -> PyResult<PyMetadata> {
        metadata_to_py(py, &self.core.metadata)
    }

    fn time_remaining(&self) -> Option<f64> {
        self.core.deadline.map(|d| d.saturating_duration_since(Instant::now()).as_secs_f64())
    }

    fn peer(&self) -> &'static str {
        "local:isthmus"
    }

    fn is_active(&self) -> bool {
        self.core.active.load(Ordering::Acquire) && self.finish.lock().is_ok_and(|f| f.is_some())
    }

    fn add_done_callback(&self, callback: Py<PyAny>) -> bool {
        let Ok(mut callbacks) = self.core.callbacks.lock() else { return false };
        if !self.core.active.load(Ordering::Acquire) {
            return false;
        }
        callbacks.push(callback);
        true
    }

    #[pyo3(signature = (flush_headers=false))]
    fn recv(&self, py: Python<'_>, flush_headers: bool) -> PyResult<Option<Py<PyBytes>>> {
        match py.detach(|| runtime().block_on(self.core.recv(flush_headers))) {
            Ok(m) => Ok(m.map(|m| PyBytes::new(py, &m).unbind())),
            Err(status) => Err(call_error(py, &status)),
        }
    }

    fn send(&self, py: Python<'_>, message: &Bound<'_, PyBytes>) -> PyResult<()> {
        let message = bytes_from_py(message);
        py.detach(|| runtime().block_on(self.core.send(message))).map_err(|s| call_error(py, &s))
    }

    fn send_initial_metadata(&self, py: Python<'_>, metadata: &Bound<'_, PyAny>) -> PyResult<()> {
        let metadata = metadata_from_py(Some(metadata))?;
        py.detach(|| runtime().block_on(self.core.send_headers(metadata))).map_err(|s| call_error(py, &s))
    }

    #[pyo3(signature = (reactor, token, flush_headers=false))]
    fn recv_async(&self, reactor: &Reactor, token: u64, flush_headers: bool) {
        let core = self.core.clone();
        reactor.completions.run(token, async move { core.recv(flush_headers).await.into() });
    }

    fn send_async(&self, reactor: &Reactor, token: u64, message: &Bound<'_, PyBytes>) {
        let (core, message) = (self.core.clone(), bytes_from_py(message));
        reactor.completions.run(token, async move { core.send(message).await.into() });
    }

    fn send_initial_metadata_async(&self, reactor: &Reactor, token: u64, metadata: &Bound<'_, PyAny>) -> PyResult<()> {
        let metadata = metadata_from_py(Some(metadata))?;
        let core = self.core.clone();
        reactor.completions.run(token, async move { core.send_headers(metadata).await.into() });
        Ok(())
    }

    /// Ends the call with this status (0 = OK) and trailing metadata.
    #[pyo3(signature = (code, details, trailing_metadata=None))]
    fn finish(&self, code: u32, details: String, trailing_metadata: Option<&Bound<'_, PyAny>>) -> PyResult<()> {
        let trailers = metadata_from_py(trailing_metadata)?;
        let Some(finish) = self.finish.lock().ok().and_then(|mut f| f.take()) else { return Ok(()) };
        let outcome = if code == 0 && trailers.is_empty() {
            Ok(())
        } else {
            // An OK status with trailers goes as a status too: the engine sends it as it is.
            Err(Status::new(Code::from_u32(code), details).with_metadata(trailers))
        };
        let _ = finish.send(outcome);
        Ok(())
    }
}

/// The engine's server (see the module's documentation).
#[pyclass(module = "isthmus._native", frozen)]
pub(crate) struct Server {
    handler: Arc<PyHandler>,
    stream_limit: Option<usize>,
    config: isthmus::Config,
    bound: Mutex<Vec<isthmus::Bound>>,
    stop: watch::Sender<Option<Duration>>,
    stopped: Arc<(Mutex<bool>, Condvar)>,
    started: AtomicBool,
}

#[pymethods]
impl Server {
    #[new]
    #[pyo3(signature = (dispatch, max_concurrent_streams=None, max_message_size=None))]
    fn new(dispatch: Py<PyAny>, max_concurrent_streams: Option<usize>, max_message_size: Option<u64>) -> Server {
        let mut config = isthmus::Config::default();
        if let Some(limit) = max_message_size {
            config.max_message_size = limit;
        }
        Server {
            handler: Arc::new(PyHandler { dispatch }),
            stream_limit: max_concurrent_streams,
            config,
            bound: Mutex::new(Vec::new()),
            stop: watch::Sender::new(None),
            stopped: Arc::new((Mutex::new(false), Condvar::new())),
            started: AtomicBool::new(false),
        }
    }

    fn add_port(&self, target: &str) -> PyResult<String> {
        let _runtime = runtime().enter();
        let mut server = isthmus::Server::builder().fallback(self.handler.clone()).config(self.config.clone());
        if let Some(limit) = self.stream_limit {
            server = server.max_concurrent_streams(limit);
        }
        let bound = server.bind(target).map_err(|s| match s.code() {
            Code::InvalidArgument => PyValueError::new_err(s.message().to_owned()),
            _ => PyOSError::new_err(s.message().to_owned()),
        })?;
        let address = bound.http_addresses().into_iter().next().unwrap_or_else(|| target.to_owned());
        self.bound.lock().map_err(|_| PyRuntimeError::new_err("server state poisoned"))?.push(bound);
        Ok(address)
    }

    fn start(&self) -> PyResult<()> {
        if self.started.swap(true, Ordering::AcqRel) {
            return Err(PyRuntimeError::new_err("the server was already started"));
        }
        let bound = self.bound.lock().map(|mut b| std::mem::take(&mut *b)).unwrap_or_default();
        let stopped = self.stopped.clone();
        let stop = self.stop.clone();
        runtime().spawn(async move {
            let mut serving = tokio::task::JoinSet::new();
            for b in bound {
                let mut rx = stop.subscribe();
                serving.spawn(b.serve_until(async move {
                    match rx.wait_for(Option::is_some).await {
                        Ok(grace) => grace.unwrap_or_default(),
                        Err(_) => Duration::ZERO,
                    }
                }));
            }
            while serving.join_next().await.is_some() {}
            mark_stopped(&stopped);
        });
        Ok(())
    }

    #[pyo3(signature = (grace=None))]
    fn stop(&self, grace: Option<f64>) {
        let grace = grace.filter(|g| g.is_finite() && *g > 0.0).map_or(Duration::ZERO, Duration::from_secs_f64);
        self.stop.send_replace(Some(grace));
        if !self.started.swap(true, Ordering::AcqRel) {
            // Never served: what was bound closes now.
            drop(self.bound.lock().map(|mut b| std::mem::take(&mut *b)));
            mark_stopped(&self.stopped);
        }
    }

    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> bool {
        let stopped = self.stopped.clone();
        py.detach(move || {
            let (lock, cv) = &*stopped;
            let Ok(guard) = lock.lock() else { return true };
            match timeout.filter(|t| t.is_finite()) {
                None => cv.wait_while(guard, |s| !*s).map_or(true, |g| *g),
                Some(t) => {
                    cv.wait_timeout_while(guard, Duration::from_secs_f64(t.max(0.0)), |s| !*s).map_or(true, |(g, _)| *g)
                }
            }
        })
    }
}

fn mark_stopped(stopped: &(Mutex<bool>, Condvar)) {
    if let Ok(mut s) = stopped.0.lock() {
        *s = true;
    }
    stopped.1.notify_all();
}
