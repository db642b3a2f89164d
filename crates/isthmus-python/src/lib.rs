//! `isthmus._native`: the isthmus engine for Python. The pure-Python package `isthmus` (in
//! `python/isthmus`) gives it grpcio's shapes; this module only moves bytes, metadata and
//! statuses between Python and the Rust engine.
//!
//! - `client`: blocking calls (`Channel`, `Call`); waits release the GIL.
//! - `reactor`: calls for asyncio (`AsyncChannel`, `AsyncCall`); they run on the event loop's
//!   thread and come back in batches through one eventfd per loop (`Reactor`).
//! - `server`: the engine's server, handing each call to a Python callable.
//! - `convert`: metadata, statuses and buffers across the boundary.
//!
//! One tokio runtime, started on first use, carries the connections' readers, the HTTP/2
//! channels and the server; a blocking unary call over `shm://` runs on the calling thread.

mod client;
mod convert;
mod core;
mod reactor;
mod server;

use pyo3::prelude::*;

/// The runtime under every connection and server of this process.
pub(crate) fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: std::sync::OnceLock<tokio::runtime::Runtime> = std::sync::OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("isthmus")
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("isthmus cannot start its runtime: {e}"))
    })
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<convert::CallError>()?;
    m.add_class::<client::UnaryResult>()?;
    m.add_class::<client::Channel>()?;
    m.add_class::<client::Call>()?;
    m.add_class::<reactor::Reactor>()?;
    m.add_class::<reactor::AsyncChannel>()?;
    m.add_class::<reactor::AsyncCall>()?;
    m.add_class::<server::ServerCall>()?;
    m.add_class::<server::Server>()?;
    Ok(())
}
