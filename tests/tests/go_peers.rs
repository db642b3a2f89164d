//! Go across the language line, in both directions: a tonic-generated Rust client calls the Go
//! server (`go/cmd/go-peer`, a `protoc-gen-go-grpc` service on `isthmus.NewServer`), and the Go
//! client's conformance checks (`go/cmd/go-conformance`, a generated client on `isthmus.Dial`)
//! call the Python servers, on `shm://`, `unix://` and `http://`. Needs `make go-bins` and the
//! venv (`make python`).

use std::process::Command;

use isthmus_tests::cases::{every_kind_of_call, failures_carry_their_status};
use isthmus_tests::{fresh_addr, fresh_socket, go_bin, python_server, run, Peer};

/// go-peer on all three transports; its addresses as clients reach them.
fn go_server() -> (Peer, Vec<String>) {
    let (shm, unix) = (fresh_addr("go"), format!("unix://{}", fresh_socket("go").display()));
    let mut peer = Peer::command(Command::new(go_bin("go-peer")).args([&shm, &unix, "http://127.0.0.1:0"]));
    let mut addresses = vec![shm];
    for _ in 0..2 {
        let line = peer.expect_line("LISTENING ", std::time::Duration::from_secs(30));
        addresses.push(line["LISTENING ".len()..].to_owned());
    }
    (peer, addresses)
}

#[test]
fn a_rust_client_calls_the_go_server_on_every_transport() {
    let (_server, addresses) = go_server();
    run(async move {
        for addr in &addresses {
            every_kind_of_call(addr).await;
            failures_carry_their_status(addr).await;
        }
    });
}

/// Runs go-conformance against `addresses`; fails the test with its transcript unless every
/// check passed.
fn go_client_checks(addresses: &[String]) {
    let out = Command::new(go_bin("go-conformance")).args(addresses).output().expect("run go-conformance");
    let transcript = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && transcript.contains(" 0 failed"), "go-conformance:\n{transcript}");
}

#[test]
fn the_go_client_calls_the_python_thread_pool_server_on_every_transport() {
    let (_server, addresses) = python_server("isthmus");
    go_client_checks(&addresses);
}

#[test]
fn the_go_client_calls_the_python_asyncio_server_on_every_transport() {
    let (_server, addresses) = python_server("isthmus-aio");
    go_client_checks(&addresses);
}
