//! `isthmus._native`: the isthmus engine for Python. The pure-Python package `isthmus` (in
//! `python/isthmus`) gives it grpcio's shapes; this module only moves bytes, metadata and
//! statuses between Python and the Rust engine.
//!
//! - `client`: blocking calls (`Channel`, `Call`); waits release the GIL.
//! - `reactor`: calls for asyncio (`AsyncChannel`, `AsyncCall`); they run on the event loop's
//!   thread and come back in batches through one eventfd per loop (`Reactor`). `aio_call`: an
//!   asyncio stub's unary call and its awaiting, natively.
//! - `server`: the engine's server, handing each call to the asyncio server's callable, or
//!   through `queue` to the blocking server's threads.
//! - `convert`: metadata, statuses and `bytes` across the boundary; `tls`: grpcio's TLS
//!   credentials and `auth_context()`.
//! - `buffers`: the raw tier's messages as Python buffers (`Message` read-only, `Block`
//!   writable), and any buffer-protocol object as a request, with no copy into a `bytes`.
//! - `topic`: `isthmus.Topic`, a publisher's messages written once for every subscriber.
//!
//! What every binding needs beyond that (a call whose halves two threads drive, completions
//! for event loops, a call handed to foreign code) is the engine's `isthmus::binding`.
//!
//! One tokio runtime, started on first use, carries the connections' readers, the HTTP/2
//! channels and the server; a blocking unary call over `shm://` runs on the calling thread.
//!
//! Why two layers (ADR 0007): grpcio's API is large and all Python-level behaviour (four call
//! shapes in two forms, futures, call objects, servicer contexts, generic and registered handlers);
//! the engine's is small (start a call, send, receive, status). So this module moves bytes,
//! metadata and statuses and owns every wait, and the package gives it grpcio's shapes. Python
//! never implements a transport: every endpoint, `unix://` and `http://` included, is the engine's.
//! The contract is `python/isthmus/_native.pyi`, every class and method of this module with its
//! types; `make lint` checks it against the built module with `mypy.stubtest`, so the two cannot
//! drift.
//!
//! The package, in `python/isthmus`: `__init__.py` (`insecure_channel`, `server`, `IsthmusError`,
//! `RpcError`); `_channel.py` and `_call.py` (the blocking channel, its multi-callables, and the
//! call object that is a `grpc.Call`, a `grpc.Future` and a response iterator); `_server.py`,
//! `_context.py` and `_handler.py` (the blocking server and what it shares with the asyncio one:
//! ports, finding a method's handler, the `ServicerContext`); `_errors.py`, `_metadata.py`; and
//! `aio/`, the same for grpc.aio, with `_reactor.py`, which ties one `Reactor` to each running
//! loop.

mod aio_call;
mod buffers;
mod client;
mod convert;
mod queue;
mod reactor;
mod server;
mod tls;
mod topic;

use pyo3::prelude::*;

/// The runtime under every connection and server of this process (the engine's, for
/// bindings).
pub(crate) fn runtime() -> &'static tokio::runtime::Runtime {
    isthmus::binding::runtime()
}

/// A handed call's next request ([`isthmus::binding::HandedCall::recv`]): polled once with
/// the GIL held, since the request is usually there already, and waited for with the GIL
/// released only if it is not. It sends no initial metadata (grpcio's receives do not), so the
/// one poll never waits on the ring.
pub(crate) fn recv(
    py: Python<'_>,
    call: &isthmus::binding::HandedCall,
) -> Result<Option<bytes::Bytes>, isthmus::Status> {
    use std::future::Future;
    use std::task::{Context, Poll, Waker};
    let mut next = std::pin::pin!(call.recv(false));
    {
        let _runtime = runtime().enter();
        if let Poll::Ready(out) = next.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
            return out;
        }
    }
    py.detach(|| isthmus::binding::block_on(next))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<convert::CallError>()?;
    m.add_class::<client::UnaryResult>()?;
    m.add_class::<client::Channel>()?;
    m.add_class::<client::UnaryCallable>()?;
    m.add_class::<client::Call>()?;
    m.add_class::<reactor::Reactor>()?;
    m.add_class::<reactor::AsyncChannel>()?;
    m.add_class::<reactor::AsyncCall>()?;
    m.add_class::<aio_call::AioUnaryCallable>()?;
    m.add_class::<aio_call::AioUnaryCall>()?;
    m.add_class::<aio_call::AioUnaryWait>()?;
    aio_call::install_send(m.py());
    m.add_function(wrap_pyfunction!(aio_call::forks, m)?)?;
    m.add_class::<server::ServerCall>()?;
    m.add_class::<server::Server>()?;
    m.add_class::<buffers::Message>()?;
    m.add_class::<buffers::Block>()?;
    m.add_class::<topic::Topic>()?;
    Ok(())
}
