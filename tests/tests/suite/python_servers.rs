//! Rust clients call isthmus's Python servers: a tonic-generated client on an `isthmus::Channel`
//! against `isthmus.server` (a thread pool) and `isthmus.aio.server`, each serving the
//! conformance `Echo` on `shm://`, `unix://` and `http://` from another process
//! (`python/tests/echo_server.py`). Needs the project's venv with isthmus built (`make python`).

use isthmus_tests::cases::{client, every_kind_of_call, failures_carry_their_status};
use isthmus_tests::conformance::EchoRequest;
use isthmus_tests::{python_server, run};
use tonic::Code;

fn rust_client_calls(kind: &str) {
    let (_server, addresses) = python_server(kind);
    run(async move {
        for addr in &addresses {
            every_kind_of_call(addr).await;
            failures_carry_their_status(addr).await;
            let mut c = client(addr).await;
            // A handler that raises is UNKNOWN with the exception, as in grpcio.
            let req = EchoRequest { fail_with: -1, fail_message: "boom".into(), ..Default::default() };
            let s = c.unary(req).await.expect_err("raises");
            assert_eq!(s.code(), Code::Unknown, "{addr}: {s:?}");
            assert!(s.message().contains("boom"), "{addr}: {s:?}");
        }
    });
}

#[test]
fn a_rust_client_calls_the_python_thread_pool_server_on_every_transport() {
    rust_client_calls("isthmus");
}

#[test]
fn a_rust_client_calls_the_python_asyncio_server_on_every_transport() {
    rust_client_calls("isthmus-aio");
}
