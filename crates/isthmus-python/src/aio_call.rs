//! grpc.aio's unary call in native steps: a stub's `__call__` ([`AioUnaryCallable`], the base of
//! `isthmus.aio`'s `UnaryUnaryMultiCallable`) and the awaiting of its call ([`AioUnaryCall`], the
//! base of its `UnaryUnaryCall`). With 32 calls in flight the event loop's thread is the
//! bottleneck; written in Python, these two (frames, a generator, keyword arguments, attribute
//! lookups) cost it ~1 µs of its ~7.7 µs per 64 B call (ADR 0017's amendment of 2026-12-02).
//!
//! Only the common case is here: a call without metadata or a compression of its own, on the
//! standard loop's thread while it runs (it says which thread that is; uvloop does not), in the
//! process that bound the channel. Every other call goes to the subclass's `_call`, the Python
//! path, which does the same with all its options. What the two share on the Python side is the
//! channel's `_fast` tuple, set when it binds to its loop and cleared when it closes.
//!
//! Failures stay written once, in Python: a serializer that raised goes to the multi-callable's
//! `_serialize_failed`, a call that failed to the call's `_raise`, a deserializer that raised to
//! its `_undecodable`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use pyo3::exceptions::{PyException, PyRuntimeError, PyStopIteration};
use pyo3::gc::PyVisit;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyIterator, PySet, PyString, PyTuple, PyWeakrefReference};
use pyo3::PyTraverseError;

use crate::client::UnaryResult;
use crate::reactor::AsyncChannel;

/// The fork count a channel's `_fast` tuple records when it binds: a channel bound before a
/// fork must not take the fast path in the child, whose loop, driver and connections are the
/// parent's ([`isthmus::binding::forks`]).
#[pyfunction]
pub(crate) fn forks() -> u64 {
    isthmus::binding::forks()
}

/// What `_fast` holds, in this order (the channel's `_bind` writes it).
struct Fast<'py> {
    loop_: Bound<'py, PyAny>,
    driver: Bound<'py, PyAny>,
    /// An `AsyncChannel`, or what stands for one (`bench/py_aio_overhead.py`'s stand-in).
    native: Bound<'py, PyAny>,
    waiting: Bound<'py, PyDict>,
    /// The driver's count of tokens (`itertools.count`).
    tokens: Bound<'py, PyIterator>,
    calls: Bound<'py, PySet>,
    forget: Bound<'py, PyAny>,
    /// The channel's default compression, by name (borrowed per call, not copied).
    compression: Option<Bound<'py, PyString>>,
}

impl<'py> Fast<'py> {
    /// The channel's fast-path state if a call made now may use it: bound, not closed, in
    /// this process, and called on its loop's thread while the loop runs.
    fn of(channel: &Bound<'py, PyAny>) -> PyResult<Option<Fast<'py>>> {
        let py = channel.py();
        let fast = channel.getattr(intern!(py, "_fast"))?;
        let Ok(fast) = fast.cast_into::<PyTuple>() else {
            return Ok(None);
        };
        if fast.get_item(0)?.extract::<u64>()? != isthmus::binding::forks() {
            return Ok(None);
        }
        let loop_ = fast.get_item(1)?;
        // A loop names its thread while it runs (None once stopped): a stopped loop's channel
        // used from another loop on the same thread is the Python path's UsageError.
        let Some(thread) = loop_.getattr_opt(intern!(py, "_thread_id"))? else {
            return Ok(None);
        };
        // SAFETY: pthread_self has no preconditions; Python's threading.get_ident is the same
        // value.
        let me = unsafe { libc::pthread_self() } as u64;
        if thread.extract::<u64>().ok() != Some(me) {
            return Ok(None);
        }
        Ok(Some(Fast {
            loop_,
            driver: fast.get_item(2)?,
            native: fast.get_item(3)?,
            waiting: fast.get_item(4)?.cast_into::<PyDict>()?,
            tokens: fast.get_item(5)?.cast_into::<PyIterator>()?,
            calls: fast.get_item(6)?.cast_into::<PySet>()?,
            forget: fast.get_item(7)?,
            compression: fast.get_item(8)?.cast_into::<PyString>().ok(),
        }))
    }
}

/// An asyncio stub's unary call (see the module's documentation).
#[pyclass(module = "isthmus._native", frozen, subclass)]
pub(crate) struct AioUnaryCallable {
    channel: Py<PyAny>,
    /// Shared with each call's operation, which must own it (a count, not a copy).
    path: std::sync::Arc<str>,
    serialize: Option<Py<PyAny>>,
    deserialize: Py<PyAny>,
}

#[pymethods]
impl AioUnaryCallable {
    #[new]
    fn new(channel: Py<PyAny>, path: String, serialize: Option<Py<PyAny>>, deserialize: Py<PyAny>) -> Self {
        AioUnaryCallable { channel, path: path.into(), serialize, deserialize }
    }

    /// Its references, for Python's cycle collector: a serializer that is a bound method of an
    /// object holding this multi-callable is a cycle the collector must see to free.
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.channel)?;
        visit.call(&self.serialize)?;
        visit.call(&self.deserialize)
    }

    #[pyo3(signature = (request, *, timeout=None, metadata=None, credentials=None, wait_for_ready=None, compression=None))]
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
        let this = slf.get();
        let fast = match metadata.is_none() && compression.is_none() && credentials.is_none() {
            true => Fast::of(this.channel.bind(py))?,
            false => None,
        };
        let Some(mut fast) = fast else {
            let args = (request, timeout, metadata, credentials, wait_for_ready, compression);
            return slf.call_method1(intern!(py, "_call"), args);
        };
        let timeout = timeout.map(|t| t.extract::<f64>()).transpose()?;
        // Encoded before the operation is registered: a failure here leaves nothing waiting.
        let encoded;
        let request = match &this.serialize {
            None => request,
            Some(serialize) => match serialize.bind(py).call1((request,)) {
                Ok(message) => {
                    encoded = message;
                    &encoded
                }
                Err(e) if e.is_instance_of::<PyException>(py) => {
                    return slf.call_method1(intern!(py, "_serialize_failed"), (e, timeout));
                }
                Err(e) => return Err(e),
            },
        };
        // A request that serializes to None fails as in the blocking API (and as grpcio's).
        if request.is_none() {
            let status = isthmus::Status::new(isthmus::Code::Internal, crate::client::SERIALIZE_FAILED);
            let failure = crate::convert::call_error_value(py, &status);
            return slf.call_method1(intern!(py, "_serialize_failed"), (failure, timeout));
        }
        let request = request.cast::<PyBytes>()?;
        let options = isthmus::CallOptions {
            timeout: crate::convert::timeout_from_py(timeout),
            wait_for_ready: wait_for_ready.map(|w| w.is_truthy()).transpose()?.unwrap_or(false),
            compression: crate::convert::compression_from_py(
                fast.compression.as_ref().map(|c| c.to_str()).transpose()?,
            )?,
            ..Default::default()
        };
        // Asked of the driver, whose rule it is (and which tests count), though a Python call;
        // but not while other operations are pending, which its rule's first test answers: with
        // many calls in flight that is nearly every call (the Python call was 1.6 % of the
        // loop's samples in a profile at 32 in flight).
        let idle =
            fast.waiting.is_empty() && fast.driver.call_method1(intern!(py, "idle"), (&fast.loop_,))?.is_truthy()?;
        // Driver.begin, written out: a Python frame fewer on every call.
        let token = fast.tokens.next().ok_or_else(|| PyRuntimeError::new_err("the token count ended"))??;
        let outcome = fast.loop_.call_method0(intern!(py, "create_future"))?;
        fast.waiting.set_item(&token, &outcome)?;
        let started = match fast.native.cast::<AsyncChannel>() {
            Ok(native) => native.get().unary_now(
                py,
                token.extract()?,
                this.path.clone(),
                crate::convert::PyBuffer::of(request),
                options,
                idle,
            ),
            Err(_) => {
                let args =
                    (&token, &*this.path, request, py.None(), timeout, options.wait_for_ready, &fast.compression, idle);
                fast.native.call_method1(intern!(py, "unary"), args).map(Bound::unbind)
            }
        };
        let done = match started {
            Ok(done) => done.into_bound(py),
            Err(e) => {
                fast.driver.call_method1(intern!(py, "abandon"), (&token,))?;
                return Err(e);
            }
        };
        if let Ok(finished) = done.cast::<PyTuple>() {
            // (ok, value): it finished in the spin.
            fast.driver.call_method1(intern!(py, "finish"), (&token, finished.get_item(1)?))?;
        }
        // After a spin that missed (False), the await does not wait on this thread again.
        let settle = !done.is(pyo3::types::PyBool::new(py, false));
        let call_type = slf.getattr(intern!(py, "_call_type"))?;
        let call = call_type.call1((fast.loop_, timeout, &this.deserialize, outcome, fast.driver, token, settle))?;
        fast.calls.add(PyWeakrefReference::new_with(&call, fast.forget)?)?;
        Ok(call)
    }
}

/// A unary call of `isthmus.aio`, awaited natively ([`AioUnaryWait`]).
#[pyclass(module = "isthmus._native", frozen, subclass)]
pub(crate) struct AioUnaryCall {
    #[pyo3(get, name = "_loop")]
    loop_: Py<PyAny>,
    #[pyo3(get, name = "_timeout")]
    timeout: Option<f64>,
    #[pyo3(get, name = "_deadline")]
    deadline: Option<f64>,
    #[pyo3(get, name = "_deserialize")]
    deserialize: Py<PyAny>,
    /// Resolves to a `UnaryResult` or a `CallError`.
    #[pyo3(get, name = "_outcome")]
    outcome: Py<PyAny>,
    /// None: nothing to abandon (a call that failed before it started).
    #[pyo3(get, name = "_driver")]
    driver: Py<PyAny>,
    #[pyo3(get, name = "_token")]
    token: Py<PyAny>,
    /// Wait for the outcome on this thread first (`Driver.settle`), once.
    settle: AtomicBool,
    /// The reply, deserialized once, as grpc.aio's call does: every await gives this one
    /// object, and a status asked first does not deserialize again. None: the deserializer
    /// raised, and the call is over INTERNAL, also for its `code()` (`UnaryUnaryCall._end`).
    reply: OnceLock<Option<Py<PyAny>>>,
}

#[pymethods]
impl AioUnaryCall {
    #[new]
    #[pyo3(signature = (r#loop, timeout, deserialize, outcome, driver, token, settle))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        r#loop: Py<PyAny>,
        timeout: Option<f64>,
        deserialize: Py<PyAny>,
        outcome: Py<PyAny>,
        driver: Py<PyAny>,
        token: Py<PyAny>,
        settle: bool,
    ) -> PyResult<Self> {
        let loop_ = r#loop;
        let deadline = match timeout {
            Some(t) => Some(loop_.bind(py).call_method0(intern!(py, "time"))?.extract::<f64>()? + t),
            None => None,
        };
        Ok(AioUnaryCall {
            loop_,
            timeout,
            deadline,
            deserialize,
            outcome,
            driver,
            token,
            settle: AtomicBool::new(settle),
            reply: OnceLock::new(),
        })
    }

    /// Whether the reply of `value` (the outcome, a `UnaryResult`) deserializes, trying it
    /// once: for a status asked before the call was awaited.
    fn _decodes(&self, value: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self.reply(&message_of(value)?)?.is_some())
    }

    fn __await__(slf: Bound<'_, Self>) -> PyResult<Bound<'_, AioUnaryWait>> {
        Bound::new(slf.py(), AioUnaryWait { call: slf.unbind(), yielded: AtomicBool::new(false) })
    }

    /// Its references, for Python's cycle collector (see `AioUnaryCallable`'s).
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.loop_)?;
        visit.call(&self.deserialize)?;
        visit.call(&self.outcome)?;
        visit.call(&self.driver)?;
        visit.call(&self.token)?;
        if let Some(Some(reply)) = self.reply.get() {
            visit.call(reply)?;
        }
        Ok(())
    }
}

/// An await of an [`AioUnaryCall`]: what `__await__` gives the awaiting coroutine, whose
/// `__next__` hands the task the outcome future until that is done and then returns the reply,
/// with no generator frame. Not the call
/// itself: a call that were its own iterator would loop for ever in `list(call)`.
#[pyclass(module = "isthmus._native", frozen)]
pub(crate) struct AioUnaryWait {
    call: Py<AioUnaryCall>,
    /// The outcome future was handed to the task: resumed before it is done, this is not
    /// driven by a task (Future.__await__'s RuntimeError).
    yielded: AtomicBool,
}

#[pymethods]
impl AioUnaryWait {
    fn __iter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.call)
    }

    /// The awaiting task's step: the outcome future while it is pending (the task waits for
    /// it), then the reply, returned as StopIteration's value. (`await` on CPython 3.10 and
    /// 3.11 takes the `am_send` slot instead, [`install_send`], which returns the reply without
    /// the exception.)
    fn __next__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.step(py)?.raised()
    }

    /// As `__next__`, for a task that sends None (anything else is an error, as for a future).
    fn send<'py>(&self, value: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        self.sent(value)?.raised()
    }

    /// An exception thrown into the awaiting task (its cancellation) abandons the call, which
    /// ends it on both sides, and goes on up.
    #[pyo3(signature = (kind, value=None, _traceback=None))]
    fn throw(
        &self,
        py: Python<'_>,
        kind: &Bound<'_, PyAny>,
        value: Option<&Bound<'_, PyAny>>,
        _traceback: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        // As a generator's throw: an instance; or a class, made with `value` unless that is
        // an instance already.
        let raised = match value {
            _ if kind.is_instance_of::<pyo3::exceptions::PyBaseException>() => kind.clone(),
            Some(value) if value.is_instance_of::<pyo3::exceptions::PyBaseException>() => value.clone(),
            Some(value) if !value.is_none() => kind.call1((value,))?,
            _ => kind.call0()?,
        };
        let error = PyErr::from_value(raised);
        if error.is_instance_of::<pyo3::exceptions::asyncio::CancelledError>(py) {
            self.call.get().abandon(py)?;
        }
        Err(error)
    }
}

/// What one step of an await gives its task.
enum Step<'py> {
    /// The outcome future, still pending: the task waits for it.
    Wait(Bound<'py, PyAny>),
    /// The reply: the await is over.
    Return(Bound<'py, PyAny>),
}

impl<'py> Step<'py> {
    /// As an iterator's `__next__` gives it: the reply raised as StopIteration's value.
    fn raised(self) -> PyResult<Bound<'py, PyAny>> {
        match self {
            Step::Wait(outcome) => Ok(outcome),
            Step::Return(reply) => Err(PyStopIteration::new_err((reply.unbind(),))),
        }
    }
}

impl AioUnaryWait {
    /// The step of a `send(value)`: only None may be sent, as to a future.
    fn sent<'py>(&self, value: &Bound<'py, PyAny>) -> PyResult<Step<'py>> {
        if !value.is_none() {
            return Err(pyo3::exceptions::PyTypeError::new_err("can't send non-None value to an awaited call"));
        }
        self.step(value.py())
    }

    /// One step of the await, for `__next__` and `am_send` alike.
    fn step<'py>(&self, py: Python<'py>) -> PyResult<Step<'py>> {
        let slf = self.call.bind(py);
        let this = slf.get();
        let outcome = this.outcome.bind(py);
        let done = intern!(py, "done");
        if !outcome.call_method0(done)?.is_truthy()? {
            let mut settled = false;
            if this.settle.swap(false, Ordering::Relaxed) && !this.driver.is_none(py) {
                let driver = this.driver.bind(py);
                // Driver.settle's cheapest test first: under load many calls wait at once.
                if driver.getattr(intern!(py, "_waiting"))?.len()? == 1 {
                    driver.call_method1(intern!(py, "settle"), (&this.loop_, outcome))?;
                    settled = true;
                }
            }
            if !settled || !outcome.call_method0(done)?.is_truthy()? {
                if self.yielded.swap(true, Ordering::Relaxed) {
                    return Err(PyRuntimeError::new_err("await wasn't used with future"));
                }
                // What Future.__await__ does before it yields the future to the task.
                outcome.setattr(intern!(py, "_asyncio_future_blocking"), true)?;
                return Ok(Step::Wait(outcome.clone()));
            }
        }
        let value = match outcome.call_method0(intern!(py, "result")) {
            Ok(value) => value,
            Err(e) => {
                // Cancelled, by `cancel` or its task: the call ends on both sides.
                this.abandon(py)?;
                return Err(e);
            }
        };
        if value.cast::<UnaryResult>().is_err() && value.is_instance_of::<crate::convert::CallError>() {
            return Err(slf.call_method1(intern!(py, "_raise"), (value,)).err().unwrap_or_else(unraised));
        }
        let Some(reply) = this.reply(&message_of(&value)?)? else {
            return Err(slf.call_method0(intern!(py, "_undecodable")).err().unwrap_or_else(unraised));
        };
        Ok(Step::Return(reply))
    }
}

/// Gives [`AioUnaryWait`]'s type the `am_send` slot, as asyncio's own future iterator has it:
/// the reply comes back as `PYGEN_RETURN`, where `__next__` must raise it in a StopIteration
/// that the interpreter then fetches and takes apart, an exception object made and dropped on
/// every call. CPython 3.10 and 3.11's `await` calls the slot (`PyIter_Send`; 3.10 only with
/// the type's `Py_TPFLAGS_HAVE_AM_SEND`); from 3.12 on `await` calls `__next__` of any iterator
/// that is not a generator, and the slot serves only `PyIter_Send`'s other callers.
pub(crate) fn install_send(py: Python<'_>) {
    /// 3.10's flag for a type whose `am_send` may be called (its slot is read from 3.11 on).
    const HAVE_AM_SEND: std::ffi::c_ulong = 1 << 21;
    let ty = py.get_type::<AioUnaryWait>();
    let tp = ty.as_type_ptr();
    let flag = py.version_info() < (3, 11);
    // SAFETY: a heap type's `tp_as_async` points into its own heap object (CPython sets it for
    // every heap type, NULL never here but checked), which lives as long as the type; the slot
    // and flag are set once, at import, before any instance exists, and `PyType_Modified` drops
    // what CPython cached of the type.
    unsafe {
        if let Some(slots) = (*tp).tp_as_async.as_mut() {
            slots.am_send = Some(wait_send);
            if flag {
                (*tp).tp_flags |= HAVE_AM_SEND;
            }
            pyo3::ffi::PyType_Modified(tp);
        }
    }
}

/// `am_send` of [`AioUnaryWait`]: its `send`, with the reply returned.
unsafe extern "C" fn wait_send(
    iter: *mut pyo3::ffi::PyObject,
    arg: *mut pyo3::ffi::PyObject,
    result: *mut *mut pyo3::ffi::PyObject,
) -> pyo3::ffi::PySendResult {
    use pyo3::ffi::PySendResult::{PYGEN_ERROR, PYGEN_NEXT, PYGEN_RETURN};
    // CPython calls a type's slots with the thread attached (it holds the GIL); `attach`
    // records that for pyo3 too, so a reference dropped inside is released at once, not left
    // to its pool, as pyo3's own entry points (`__next__`'s) do.
    Python::attach(|py| {
        let step = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // SAFETY: CPython passes live objects, borrowed for the call: `iter` of the type this
            // slot is installed on (checked all the same), `arg` never NULL (`PyIter_Send`).
            let (iter, arg) = unsafe { (Bound::from_borrowed_ptr(py, iter), Bound::from_borrowed_ptr(py, arg)) };
            iter.cast::<AioUnaryWait>()?.get().sent(&arg)
        }));
        let (code, value) = match step {
            Ok(Ok(Step::Wait(outcome))) => (PYGEN_NEXT, outcome.into_ptr()),
            Ok(Ok(Step::Return(reply))) => (PYGEN_RETURN, reply.into_ptr()),
            Ok(Err(e)) => {
                e.restore(py);
                (PYGEN_ERROR, std::ptr::null_mut())
            }
            Err(_) => {
                pyo3::panic::PanicException::new_err("isthmus: a panic while a unary call was awaited").restore(py);
                (PYGEN_ERROR, std::ptr::null_mut())
            }
        };
        // SAFETY: CPython passes a writable `result`; it takes the reference given there.
        unsafe { *result = value };
        code
    })
}

impl AioUnaryCall {
    /// The reply made of `message` by the call's deserializer, made once: later calls give
    /// the same object (or None again: the deserializer raised). An error that is not an
    /// Exception (KeyboardInterrupt) goes up and leaves the reply untried.
    fn reply<'py>(&self, message: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let py = message.py();
        if let Some(reply) = self.reply.get() {
            return Ok(reply.as_ref().map(|r| r.bind(py).clone()));
        }
        let reply = match self.deserialize.is_none(py) {
            true => Some(message.clone()),
            false => match self.deserialize.bind(py).call1((message,)) {
                Ok(reply) => Some(reply),
                Err(e) if e.is_instance_of::<PyException>(py) => None,
                Err(e) => return Err(e),
            },
        };
        // Another await that got here while the deserializer ran (Python code, which may let
        // another thread in) keeps its reply: every await gives one object.
        let kept = self.reply.get_or_init(|| reply.map(Bound::unbind));
        Ok(kept.as_ref().map(|r| r.bind(py).clone()))
    }

    fn abandon(&self, py: Python<'_>) -> PyResult<()> {
        if !self.driver.is_none(py) {
            self.driver.bind(py).call_method1(intern!(py, "abandon"), (&self.token,))?;
        }
        Ok(())
    }
}

/// The serialized reply a unary call's outcome carries.
fn message_of<'py>(value: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    match value.cast::<UnaryResult>() {
        Ok(result) => Ok(result.get().message.bind(value.py()).clone().into_any()),
        // What stands for a UnaryResult (`bench/py_aio_overhead.py`'s stand-in).
        Err(_) => value.getattr(intern!(value.py(), "message")),
    }
}

/// A Python method that was to raise returned instead.
fn unraised() -> PyErr {
    pyo3::exceptions::PySystemError::new_err("isthmus: an error handler returned instead of raising")
}
