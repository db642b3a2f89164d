//! Calls for asyncio. Each operation runs on the event loop's own thread: it runs as far as it
//! can when started (a unary call over `shm://` writes its request into the ring there), and
//! when the engine wakes it (a reply arrived), it is queued in its loop's [`Reactor`], whose
//! eventfd the loop watches (`add_reader`); the loop's `drain` polls every queued operation and
//! hands back all that finished, in one batch.

use std::collections::HashMap;
use std::future::Future;
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll, Wake, Waker};

use bytes::Bytes;
use isthmus::EventFd;
use isthmus::{MetadataMap, Status};
use pyo3::exceptions::PyOSError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::client::{bad_target, UnaryResult};
use crate::convert::{bytes_from_py, call_error_value, metadata_to_py, options, PyMetadata};
use crate::core::CallCore;
use crate::runtime;

/// What a finished operation gives back.
pub(crate) enum Outcome {
    Unary(isthmus::Response),
    Message(Option<Bytes>),
    Metadata(MetadataMap),
    Sent(bool),
    Done,
    Started(Arc<CallCore>),
    Failed(Status),
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

impl From<()> for Outcome {
    fn from((): ()) -> Outcome {
        Outcome::Done
    }
}

type OpFuture = Pin<Box<dyn Future<Output = Outcome> + Send>>;

/// An operation that had to wait: its future, polled again on the loop's thread each time it
/// is woken.
struct Op {
    token: u64,
    future: Mutex<Option<OpFuture>>,
    completions: Weak<Completions>,
}

impl Wake for Op {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if let Some(completions) = self.completions.upgrade() {
            completions.queue(|q| q.woken.push(self.clone()));
        }
    }
}

/// What the loop's next `drain` takes.
#[derive(Default)]
struct Queue {
    done: Vec<(u64, Outcome)>,
    woken: Vec<Arc<Op>>,
}

/// The operations of one event loop: they run on the loop's own thread, so no task is
/// spawned and no thread is woken per call; a wake-up from the engine (a reply arrived) only
/// queues the operation and, for the first of a batch, signals the eventfd.
pub(crate) struct Completions {
    fd: EventFd,
    queue: Mutex<Queue>,
    /// Operations waiting, by token (to abandon them).
    running: Mutex<HashMap<u64, Arc<Op>>>,
}

impl Completions {
    fn queue(&self, add: impl FnOnce(&mut Queue)) {
        let Ok(mut queue) = self.queue.lock() else { return };
        let first = queue.done.is_empty() && queue.woken.is_empty();
        add(&mut queue);
        drop(queue);
        // The loop drains the eventfd before it takes the queue, so a queue found empty here
        // has been (or is being) taken: one signal per batch.
        if first {
            self.fd.signal();
        }
    }

    /// Runs `fut` and queues its outcome under `token`. Polled here first, so what can happen
    /// at once (sending a request) happens before this returns.
    pub(crate) fn run<F>(self: &Arc<Self>, token: u64, fut: F)
    where
        F: Future<Output = Outcome> + Send + 'static,
    {
        let op = Arc::new(Op { token, future: Mutex::new(None), completions: Arc::downgrade(self) });
        let Ok(mut slot) = op.future.lock() else { return };
        // In the slot before the first poll: a wake-up that comes before this returns finds
        // the future there (and waits for this lock).
        let future = slot.insert(Box::pin(fut));
        let _runtime = runtime().enter();
        match future.as_mut().poll(&mut Context::from_waker(&Waker::from(op.clone()))) {
            Poll::Ready(outcome) => {
                *slot = None;
                drop(slot);
                self.queue(|q| q.done.push((token, outcome)));
            }
            Poll::Pending => {
                drop(slot);
                if let Ok(mut running) = self.running.lock() {
                    running.insert(token, op);
                }
            }
        }
    }

    /// Polls every woken operation; the finished ones, with those that finished at once.
    fn take(&self) -> Vec<(u64, Outcome)> {
        self.fd.drain();
        let Queue { mut done, woken } = self.queue.lock().map(|mut q| std::mem::take(&mut *q)).unwrap_or_default();
        let _runtime = runtime().enter();
        for op in woken {
            let Ok(mut slot) = op.future.lock() else { continue };
            let Some(future) = slot.as_mut() else { continue }; // finished or abandoned
            if let Poll::Ready(outcome) = future.as_mut().poll(&mut Context::from_waker(&Waker::from(op.clone()))) {
                *slot = None;
                if let Ok(mut running) = self.running.lock() {
                    running.remove(&op.token);
                }
                done.push((op.token, outcome));
            }
        }
        done
    }

    /// Drops a waiting operation's future (a call's drop cancels it); its token never
    /// completes. `false` if it is not waiting.
    fn abort(&self, token: u64) -> bool {
        let Some(op) = self.running.lock().ok().and_then(|mut r| r.remove(&token)) else { return false };
        let future = op.future.lock().ok().and_then(|mut f| f.take());
        drop(future);
        true
    }
}

/// Completions for one asyncio loop (see the module's documentation).
#[pyclass(module = "isthmus._native", frozen)]
pub(crate) struct Reactor {
    pub(crate) completions: Arc<Completions>,
}

#[pymethods]
impl Reactor {
    #[new]
    fn new() -> PyResult<Reactor> {
        let fd = EventFd::new().map_err(|e| PyOSError::new_err(format!("cannot make an eventfd: {e}")))?;
        let completions = Completions { fd, queue: Mutex::default(), running: Mutex::default() };
        Ok(Reactor { completions: Arc::new(completions) })
    }

    fn fileno(&self) -> i32 {
        self.completions.fd.as_raw_fd()
    }

    /// `(token, ok, value)` for every finished operation.
    fn drain(&self, py: Python<'_>) -> PyResult<Py<PyList>> {
        let done = self.completions.take();
        let list = PyList::empty(py);
        for (token, outcome) in done {
            let (ok, value): (bool, Py<PyAny>) = match outcome {
                Outcome::Unary(r) => (true, Py::new(py, UnaryResult::new(py, &r)?)?.into_any()),
                Outcome::Message(Some(m)) => (true, PyBytes::new(py, &m).into_any().unbind()),
                Outcome::Message(None) | Outcome::Done => (true, py.None()),
                Outcome::Metadata(m) => (true, metadata_to_py(py, &m)?.into_any()),
                Outcome::Sent(sent) => (true, pyo3::types::PyBool::new(py, sent).to_owned().into_any().unbind()),
                Outcome::Started(core) => {
                    let call = AsyncCall { core, completions: self.completions.clone() };
                    (true, Py::new(py, call)?.into_any())
                }
                Outcome::Failed(status) => (false, call_error_value(py, &status)),
            };
            list.append((token, ok, value))?;
        }
        Ok(list.unbind())
    }

    /// Abandons the operation `token`: it will not complete, and a call it was making is
    /// cancelled. `false` if it has already finished.
    fn cancel(&self, token: u64) -> bool {
        self.completions.abort(token)
    }

    fn close(&self) {}
}

/// A channel whose operations complete through a [`Reactor`].
#[pyclass(module = "isthmus._native", frozen)]
pub(crate) struct AsyncChannel {
    engine: isthmus::Channel,
    completions: Arc<Completions>,
    closed: AtomicBool,
}

#[pymethods]
impl AsyncChannel {
    #[new]
    fn new(target: &str, reactor: &Reactor) -> PyResult<AsyncChannel> {
        let _runtime = runtime().enter();
        // Calls are polled on the event loop's thread, which every other coroutine shares: a
        // call must not spin there reading the connection. The reader task reads for them.
        let engine = isthmus::Channel::lazy(target).map_err(|s| bad_target(&s))?.with_calls_read(false);
        Ok(AsyncChannel { engine, completions: reactor.completions.clone(), closed: AtomicBool::new(false) })
    }

    #[pyo3(signature = (token, path, request, metadata, timeout, wait_for_ready))]
    fn unary(
        &self,
        token: u64,
        path: String,
        request: &Bound<'_, PyBytes>,
        metadata: Option<&Bound<'_, PyAny>>,
        timeout: Option<f64>,
        wait_for_ready: bool,
    ) -> PyResult<()> {
        let options = options(metadata, timeout, wait_for_ready)?;
        let (engine, request, closed) = (self.engine.clone(), bytes_from_py(request), self.is_closed());
        self.completions.run(token, async move {
            match closed {
                Some(status) => Outcome::Failed(status),
                None => engine.unary(&path, &request, options).await.map_or_else(Outcome::Failed, Outcome::Unary),
            }
        });
        Ok(())
    }

    #[pyo3(signature = (token, path, metadata, timeout, wait_for_ready))]
    fn start(
        &self,
        token: u64,
        path: String,
        metadata: Option<&Bound<'_, PyAny>>,
        timeout: Option<f64>,
        wait_for_ready: bool,
    ) -> PyResult<()> {
        let options = options(metadata, timeout, wait_for_ready)?;
        let (engine, closed) = (self.engine.clone(), self.is_closed());
        self.completions.run(token, async move {
            match closed {
                Some(status) => Outcome::Failed(status),
                None => engine
                    .start(&path, options)
                    .await
                    .map_or_else(Outcome::Failed, |c| Outcome::Started(CallCore::new(c))),
            }
        });
        Ok(())
    }

    fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
    }
}

impl AsyncChannel {
    fn is_closed(&self) -> Option<Status> {
        self.closed.load(Ordering::Relaxed).then(|| Status::new(isthmus::Code::Unavailable, "the channel was closed"))
    }
}

/// One call driven through a [`Reactor`].
#[pyclass(module = "isthmus._native", frozen)]
pub(crate) struct AsyncCall {
    core: Arc<CallCore>,
    completions: Arc<Completions>,
}

#[pymethods]
impl AsyncCall {
    #[pyo3(signature = (token, message, last=false))]
    fn send(&self, token: u64, message: &Bound<'_, PyBytes>, last: bool) {
        let (core, message) = (self.core.clone(), bytes_from_py(message));
        self.completions.run(token, async move { Outcome::Sent(core.send(message, last).await) });
    }

    fn close_send(&self, token: u64) {
        let core = self.core.clone();
        self.completions.run(token, async move {
            core.close_send().await;
            Outcome::Done
        });
    }

    fn recv(&self, token: u64) {
        let core = self.core.clone();
        self.completions.run(token, async move { core.recv().await.into() });
    }

    fn initial_metadata(&self, token: u64) {
        let core = self.core.clone();
        self.completions.run(token, async move { core.headers().await.into() });
    }

    fn trailing_metadata(&self, py: Python<'_>) -> PyResult<Option<PyMetadata>> {
        self.core.trailers().map(|t| metadata_to_py(py, &t)).transpose()
    }

    fn cancel(&self) {
        self.core.cancel();
    }
}
