//! What crosses between Python and the engine: metadata as `(key, value)` pairs, statuses as
//! [`CallError`], request bytes without a copy.
//!
//! Metadata is a list of `(key, value)` pairs; keys are lowercased, `-bin` values are `bytes` both
//! ways (a `str` given for one is taken as its UTF-8 bytes), others `str`. A timeout is seconds as
//! a float; an infinite one, or one too long for a `Duration`, is none (grpcio fails both
//! DEADLINE_EXCEEDED at once: its deadline overflows past ~285 years). A request `bytes` becomes
//! the engine's `Bytes` without a copy (`bytes_from_py`: a `PyBuffer` keeps the object alive and
//! owns the `Bytes`), so the only copy is the transport's own. A response for the
//! grpcio-compatible API is copied once into a new `bytes`, so its arena block goes back at
//! once; the raw tier's views (`buffers.rs`) keep theirs until Python lets go of them.
//!
//! `CallError` is the native exception (code, details, initial and trailing metadata); the package
//! turns it into `isthmus.RpcError`: a `grpc.RpcError` and `grpc.Call` for the blocking API, a
//! `grpc.aio.AioRpcError` for `isthmus.aio`. A target that does not parse is a `ValueError`, and
//! every exception isthmus raises of its own is an `IsthmusError`.

use std::time::Duration;

use bytes::Bytes;
use isthmus::{metadata::is_binary_key, CallOptions, Code, ConnectionCounters, MetadataMap, Status};
use pyo3::exceptions::{PyException, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString};

/// The counters of a channel's or a server's `shm://` connections, as the dict behind
/// `isthmus.TransportStats`: sums over the connections, but the largest high-water mark.
pub(crate) fn counters_to_py<'py>(
    py: Python<'py>,
    counters: impl IntoIterator<Item = ConnectionCounters>,
) -> PyResult<Bound<'py, PyDict>> {
    let c = ConnectionCounters::total(counters);
    let d = PyDict::new(py);
    d.set_item("calls_started", c.calls_started)?;
    d.set_item("calls_in_flight", c.in_flight())?;
    d.set_item("bytes_sent", c.transport.bytes_sent)?;
    d.set_item("bytes_received", c.transport.bytes_received)?;
    d.set_item("frames_sent", c.transport.frames_sent)?;
    d.set_item("frames_received", c.transport.frames_received)?;
    d.set_item("doorbells_rung", c.transport.doorbells_rung)?;
    d.set_item("sleeps", c.transport.sleeps)?;
    d.set_item("spin_hits", c.transport.spin_hits)?;
    d.set_item("ring_full_waits", c.transport.ring_full_waits)?;
    d.set_item("arena_full_waits", c.transport.arena_full_waits)?;
    d.set_item("shared_sent", c.transport.shared_sent)?;
    d.set_item("arena_in_use", c.transport.arena_in_use)?;
    d.set_item("arena_high_water", c.transport.arena_high_water)?;
    d.set_item("answers_dropped", c.answers_dropped)?;
    Ok(d)
}

/// Python-side metadata: a list of `(str, str | bytes)`.
pub(crate) type PyMetadata = Py<PyList>;

/// A call that ended with a status other than OK.
#[pyclass(extends = PyException, module = "isthmus._native", subclass)]
pub(crate) struct CallError {
    #[pyo3(get)]
    code: u32,
    #[pyo3(get)]
    details: String,
    #[pyo3(get)]
    initial_metadata: PyMetadata,
    #[pyo3(get)]
    trailing_metadata: PyMetadata,
}

#[pymethods]
impl CallError {
    #[new]
    #[pyo3(signature = (code, details, initial_metadata=None, trailing_metadata=None))]
    fn new(
        py: Python<'_>,
        code: u32,
        details: String,
        initial_metadata: Option<&Bound<'_, PyAny>>,
        trailing_metadata: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let list = |m: Option<&Bound<'_, PyAny>>| -> PyResult<PyMetadata> {
            Ok(match m {
                None => PyList::empty(py).unbind(),
                Some(m) => PyList::new(py, m.try_iter()?.collect::<PyResult<Vec<_>>>()?)?.unbind(),
            })
        };
        Ok(CallError {
            code,
            details,
            initial_metadata: list(initial_metadata)?,
            trailing_metadata: list(trailing_metadata)?,
        })
    }

    fn __str__(&self) -> String {
        format!("{}: {}", Code::from_u32(self.code).name(), self.details)
    }
}

/// The Python exception for `status`.
pub(crate) fn call_error(py: Python<'_>, status: &Status) -> PyErr {
    let built = (|| -> PyResult<PyErr> {
        let error = CallError {
            code: status.code() as u32,
            details: status.message().to_owned(),
            // What the server sent before it failed the call (grpcio's `RpcError.initial_metadata()`).
            initial_metadata: metadata_to_py(py, status.headers())?,
            trailing_metadata: trailers_to_py(py, status)?,
        };
        Ok(PyErr::from_value(Bound::new(py, error)?.into_any()))
    })();
    built.unwrap_or_else(|e| e)
}

/// `status` as the Python value a reactor hands back for a failed operation.
pub(crate) fn call_error_value(py: Python<'_>, status: &Status) -> Py<PyAny> {
    call_error(py, status).into_value(py).into_any()
}

/// A failed call's trailing metadata as grpcio gives it: with the status's details under
/// `grpc-status-details-bin`, where `grpc_status.rpc_status.from_call` looks for them.
fn trailers_to_py(py: Python<'_>, status: &Status) -> PyResult<PyMetadata> {
    let list = metadata_to_py(py, status.metadata())?;
    if !status.details().is_empty() {
        list.bind(py).append((DETAILS_KEY, PyBytes::new(py, status.details())))?;
    }
    Ok(list)
}

/// The trailer that carries a status's details (a serialized `google.rpc.Status`).
const DETAILS_KEY: &str = "grpc-status-details-bin";

/// Python metadata (any iterable of pairs, or None) as the engine's. Keys gRPC reserves for
/// itself (`grpc-*`, `user-agent`, `content-type`, `te`) are left out, as grpcio leaves out
/// the ones it sets itself, instead of failing the call.
pub(crate) fn metadata_from_py(metadata: Option<&Bound<'_, PyAny>>) -> PyResult<MetadataMap> {
    Ok(metadata_and_details_from_py(metadata, false)?.0)
}

/// A status's trailing metadata from Python, with the details a handler gave under
/// `grpc-status-details-bin` (what `grpc_status.rpc_status.to_status` builds), taken out of
/// it: the status carries them.
pub(crate) fn trailers_from_py(code: u32, details: String, metadata: Option<&Bound<'_, PyAny>>) -> PyResult<Status> {
    let (trailers, rich) = metadata_and_details_from_py(metadata, false)?;
    let status = Status::new(Code::from_u32(code), details).with_metadata(trailers);
    Ok(match rich {
        Some(rich) => status.with_details(rich),
        None => status,
    })
}

/// `caller`: the metadata of a call a client starts, checked as grpcio's client checks them:
/// a key with an upper-case letter (which the server side lower-cases, as HTTP/2 would) and
/// any other key or value gRPC refuses are grpcio's ValueError, "metadata was invalid: …"
/// with the metadata as given; a `str` on a `-bin` key its TypeError.
fn metadata_and_details_from_py(
    metadata: Option<&Bound<'_, PyAny>>,
    caller: bool,
) -> PyResult<(MetadataMap, Option<Bytes>)> {
    let mut map = MetadataMap::new();
    let mut rich = None;
    let Some(metadata) = metadata.filter(|m| !m.is_none()) else { return Ok((map, rich)) };
    let invalid = |e: &dyn std::fmt::Display| {
        if caller {
            let shown = metadata.repr().map_or_else(|_| String::from("?"), |r| r.to_string());
            PyValueError::new_err(format!("metadata was invalid: {shown}"))
        } else {
            PyValueError::new_err(format!("invalid metadata: {e}"))
        }
    };
    for pair in metadata.try_iter()? {
        let pair = pair?;
        // A pair is any two-item sequence: grpcio takes lists as well as tuples.
        let (key, value): (String, Bound<'_, PyAny>) = match pair.extract() {
            Ok(kv) => kv,
            Err(e) if pair.len().ok() == Some(2) => (pair.get_item(0)?.extract().map_err(|_| e)?, pair.get_item(1)?),
            Err(e) => return Err(e),
        };
        if caller && key.bytes().any(|b| b.is_ascii_uppercase()) {
            return Err(invalid(&"a key with an upper-case letter"));
        }
        let key = key.to_ascii_lowercase();
        if key == DETAILS_KEY {
            if let Ok(b) = value.cast::<PyBytes>() {
                rich = Some(Bytes::copy_from_slice(b.as_bytes()));
                continue;
            }
            if let Ok(s) = value.cast::<PyString>() {
                rich = Some(Bytes::copy_from_slice(s.to_str()?.as_bytes()));
                continue;
            }
        }
        if isthmus::metadata::is_reserved_key(&key) {
            continue;
        }
        let added = if let Ok(b) = value.cast::<PyBytes>() {
            map.append_raw(&key, Bytes::copy_from_slice(b.as_bytes()))
        } else if let Ok(s) = value.cast::<PyString>() {
            let s = s.to_str()?;
            if caller && is_binary_key(&key) {
                // grpcio's words.
                return Err(PyTypeError::new_err(format!(
                    "Binary metadata key=\"{key}\" expected bytes, got <class 'str'>"
                )));
            }
            if is_binary_key(&key) {
                map.append_bin(&key, Bytes::copy_from_slice(s.as_bytes()))
            } else {
                map.append(&key, s)
            }
        } else {
            // grpcio's error for this too (its is "Expected str, not <class 'int'>").
            return Err(PyTypeError::new_err(format!("metadata value for {key:?} must be str or bytes")));
        };
        added.map_err(|e| invalid(&e))?;
    }
    Ok((map, rich))
}

/// Engine metadata as a Python list of `(key, str | bytes)`: bytes for `-bin` keys, as grpcio.
pub(crate) fn metadata_to_py(py: Python<'_>, metadata: &MetadataMap) -> PyResult<PyMetadata> {
    let list = PyList::empty(py);
    for (key, value) in metadata.iter() {
        if is_binary_key(key) {
            list.append((key, PyBytes::new(py, value)))?;
        } else {
            list.append((key, String::from_utf8_lossy(value)))?;
        }
    }
    Ok(list.unbind())
}

/// Call options from the Python arguments; `compression` is a `grpc-encoding` name (`gzip`,
/// `deflate`) or `None`.
pub(crate) fn options(
    metadata: Option<&Bound<'_, PyAny>>,
    timeout: Option<f64>,
    wait_for_ready: bool,
    compression: Option<&str>,
) -> PyResult<CallOptions> {
    let compression = compression_from_py(compression)?;
    Ok(CallOptions {
        metadata: metadata_and_details_from_py(metadata, true)?.0,
        timeout: timeout_from_py(timeout),
        wait_for_ready,
        compression,
    })
}

/// A compression from Python's side: a `grpc-encoding` name (`gzip`, `deflate`) or `None`.
pub(crate) fn compression_from_py(name: Option<&str>) -> PyResult<Option<isthmus::Compression>> {
    name.map(|name| {
        isthmus::Compression::from_name(name)
            .ok_or_else(|| PyValueError::new_err(format!("no compression {name:?}: gzip or deflate")))
    })
    .transpose()
}

/// A timeout in seconds from Python: none, or infinite, is no timeout (isthmus's reading:
/// grpcio fails an infinite one DEADLINE_EXCEEDED at once).
pub(crate) fn timeout_from_py(timeout: Option<f64>) -> Option<Duration> {
    match timeout {
        // One too long for a `Duration` (grpcio's callers pass `sys.maxsize` for "forever") is
        // none, as an infinite one is.
        Some(t) if t.is_finite() => Duration::try_from_secs_f64(t.max(0.0)).ok(),
        _ => None,
    }
}

/// A Python `bytes` as [`Bytes`] without a copy: the object is kept alive by the returned value.
pub(crate) fn bytes_from_py(data: &Bound<'_, PyBytes>) -> Bytes {
    Bytes::from_owner(PyBuffer::of(data))
}

/// A Python `bytes` object's buffer, with the reference that keeps it alive: for what needs its
/// bytes owned but not as `Bytes` (which would box it once more).
pub(crate) struct PyBuffer {
    ptr: *const u8,
    len: usize,
    _object: Py<PyBytes>,
}

// SAFETY: the buffer belongs to an immutable `bytes` object that `_object` keeps alive, so any
// thread may read it; dropping `_object` off the GIL defers the reference count change to
// PyO3's pool, which is made for that.
unsafe impl Send for PyBuffer {}

impl PyBuffer {
    /// The buffer of `data`, which it holds a reference to.
    pub(crate) fn of(data: &Bound<'_, PyBytes>) -> PyBuffer {
        let view = data.as_bytes();
        PyBuffer { ptr: view.as_ptr(), len: view.len(), _object: data.clone().unbind() }
    }
}

impl AsRef<[u8]> for PyBuffer {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `ptr`/`len` were read from the live, immutable `bytes` object that `_object`
        // still holds, so they describe valid memory that does not change.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}
