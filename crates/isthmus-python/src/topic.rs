//! `isthmus.Topic`'s native half: the engine's [`isthmus::Topic`], published to from Python and
//! served on Python's server calls by [`ServerCall::serve_topic`](crate::server::ServerCall).
//!
//! `publish` takes any C-contiguous buffer (the Python side serialises a protobuf message once
//! before) and copies it, GIL released, once into each shared arena its subscribers came through.
//! Serving a subscription runs entirely in Rust: no Python runs per message, except `on_gap`.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::buffers::Exported;

/// A topic that server-streaming calls subscribe to.
#[pyclass(module = "isthmus._native", frozen)]
pub(crate) struct Topic {
    pub(crate) inner: isthmus::Topic,
}

#[pymethods]
impl Topic {
    #[new]
    #[pyo3(signature = (name, capacity=64, slow="drop_oldest"))]
    fn new(name: String, capacity: usize, slow: &str) -> PyResult<Topic> {
        let slow = match slow {
            "drop_oldest" => isthmus::SlowSubscriber::DropOldest,
            "cancel" => isthmus::SlowSubscriber::Cancel,
            other => {
                return Err(PyValueError::new_err(format!("slow must be \"drop_oldest\" or \"cancel\", not {other:?}")))
            }
        };
        if capacity == 0 {
            return Err(PyValueError::new_err("capacity must be at least 1"));
        }
        Ok(Topic { inner: isthmus::Topic::with_options(name, isthmus::TopicOptions { capacity, slow }) })
    }

    #[getter]
    fn name(&self) -> &str {
        self.inner.name()
    }

    /// Queues `message` (any C-contiguous buffer) for every subscriber; how many.
    fn publish(&self, py: Python<'_>, message: &Bound<'_, PyAny>) -> PyResult<usize> {
        let buffer = Exported::get(message)?;
        let bytes = buffer.as_slice();
        Ok(py.detach(|| self.inner.publish(bytes)))
    }

    /// `publish`, and keep the message for later subscribers.
    fn publish_state(&self, py: Python<'_>, message: &Bound<'_, PyAny>) -> PyResult<usize> {
        let buffer = Exported::get(message)?;
        let bytes = buffer.as_slice();
        Ok(py.detach(|| self.inner.publish_state(bytes)))
    }

    // The topic's lock, which these take, is held through a publish (a copy of up to half a
    // shared arena): each waits for it with the GIL released, or every Python thread waited.

    /// The state kept by `publish_state`, if any.
    fn state<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        py.detach(|| self.inner.state()).map(|b| PyBytes::new(py, &b))
    }

    /// The state, if no plain `publish` came after it: a resync's message.
    fn current_state<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        py.detach(|| self.inner.current_state()).map(|b| PyBytes::new(py, &b))
    }

    fn clear_state(&self, py: Python<'_>) {
        py.detach(|| self.inner.clear_state());
    }

    fn close(&self, py: Python<'_>) {
        py.detach(|| self.inner.close());
    }

    /// The counters, as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = py.detach(|| self.inner.stats());
        let d = PyDict::new(py);
        d.set_item("subscribers", s.subscribers)?;
        d.set_item("published", s.published)?;
        d.set_item("bytes", s.bytes)?;
        d.set_item("delivered", s.delivered)?;
        d.set_item("dropped", s.dropped)?;
        d.set_item("cancelled", s.cancelled)?;
        Ok(d)
    }
}

/// `on_gap(n)` as the engine wants it: Python's callable, called with the GIL; its bytes (or
/// None) are the resync message. A callable that raises, or returns something that is not a
/// buffer, has its error printed and sends nothing, as grpcio treats a callback's error.
pub(crate) fn gap_callback(on_gap: Option<Py<PyAny>>) -> Option<impl FnMut(u64) -> Option<bytes::Bytes>> {
    let on_gap = on_gap?;
    Some(move |n| {
        Python::attach(|py| {
            let made = on_gap.call1(py, (n,)).and_then(|r| {
                if r.is_none(py) {
                    return Ok(None);
                }
                let buffer = Exported::get(r.bind(py))?;
                Ok(Some(bytes::Bytes::copy_from_slice(buffer.as_slice())))
            });
            made.unwrap_or_else(|e| {
                // Not `print`, which ends the process on a `SystemExit`.
                e.write_unraisable(py, Some(on_gap.bind(py)));
                None
            })
        })
    })
}
