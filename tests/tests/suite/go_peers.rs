//! Go across the language line, in both directions: a tonic-generated Rust client calls the Go
//! server (`go/cmd/go-peer`, a `protoc-gen-go-grpc` service on `isthmus.NewServer`): every kind
//! of call, statuses with their details, deadlines, a cancel the handler sees, a 64 MiB message
//! each way and the server's `kill -9`; and the Go client's conformance checks
//! (`go/cmd/go-conformance`, a generated client on `isthmus.Dial`) call the Python servers, on
//! `shm://`, `unix://` and `http://`. Needs `make go-bins` and the venv (`make python`).

use std::process::Command;
use std::time::{Duration, Instant};

use isthmus_tests::cases::{bidi_given_up, client, connect, every_kind_of_call, failures_carry_their_status, request};
use isthmus_tests::conformance::echo_client::EchoClient;
use isthmus_tests::conformance::EchoRequest;
use isthmus_tests::{first_mismatch, fresh_addr, fresh_socket, go_bin, pattern, python_server, run, runtime, Peer};
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Request};

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

/// `google.rpc.Status`, as grpc-go sends it in `grpc-status-details-bin`.
#[derive(Clone, PartialEq, prost::Message)]
struct RpcStatus {
    #[prost(int32, tag = "1")]
    code: i32,
    #[prost(string, tag = "2")]
    message: String,
    #[prost(message, repeated, tag = "3")]
    details: Vec<Any>,
}

/// `google.protobuf.Any`.
#[derive(Clone, PartialEq, prost::Message)]
struct Any {
    #[prost(string, tag = "1")]
    type_url: String,
    #[prost(bytes = "vec", tag = "2")]
    value: Vec<u8>,
}

#[test]
fn the_go_servers_status_details_reach_a_rust_client() {
    let (_server, addresses) = go_server();
    run(async move {
        for addr in &addresses {
            let mut c = client(addr).await;
            let req = EchoRequest {
                fail_with: Code::FailedPrecondition as i32,
                fail_message: "no ✓".into(),
                ..Default::default()
            };
            let s = c.unary(req).await.expect_err("fails");
            assert_eq!((s.code(), s.message()), (Code::FailedPrecondition, "no ✓"), "{addr}");
            // echo.FailureDetail: one google.rpc.ErrorInfo naming the failure.
            let details = <RpcStatus as prost::Message>::decode(s.details()).expect("a google.rpc.Status");
            assert_eq!((details.code, details.message.as_str()), (Code::FailedPrecondition as i32, "no ✓"), "{addr}");
            assert_eq!(details.details.len(), 1, "{addr}: {details:?}");
            assert_eq!(details.details[0].type_url, "type.googleapis.com/google.rpc.ErrorInfo", "{addr}");
            assert!(details.details[0].value.windows(9).any(|w| w == b"FAIL_WITH"), "{addr}: {details:?}");
        }
    });
}

#[test]
fn deadlines_reach_the_go_server_and_end_its_slow_calls() {
    let (_server, addresses) = go_server();
    run(async move {
        for addr in &addresses {
            let mut c = client(addr).await;
            // The handler sees the deadline.
            let mut req = Request::new(request(vec![], 1));
            req.set_timeout(Duration::from_secs(30));
            let left = c.unary(req).await.expect("in time").into_inner().time_left_ms;
            assert!((1..=30_000).contains(&left), "{addr}: {left}");
            // One it cannot meet ends the call.
            let mut req = Request::new(EchoRequest { sleep_ms: 10_000, ..EchoRequest::default() });
            req.set_timeout(Duration::from_millis(200));
            let s = c.unary(req).await.expect_err("too slow");
            assert_eq!(s.code(), Code::DeadlineExceeded, "{addr}: {s:?}");
            // A stream whose handler waits for a request that never comes ends at its deadline.
            let (tx, rx) = tokio::sync::mpsc::channel::<EchoRequest>(1);
            let mut req = Request::new(ReceiverStream::new(rx));
            req.set_timeout(Duration::from_millis(200));
            let s = match c.bidi(req).await {
                Ok(replies) => replies.into_inner().message().await.expect_err("past its deadline"),
                Err(s) => s,
            };
            assert_eq!(s.code(), Code::DeadlineExceeded, "{addr}: {s:?}");
            drop(tx);
            // The connection goes on.
            c.unary(request(b"after".to_vec(), 2)).await.expect("the call after");
        }
    });
}

#[test]
fn a_rust_clients_cancel_reaches_the_go_handler() {
    let (mut server, addresses) = go_server();
    let rt = runtime();
    for addr in &addresses {
        let tx = rt.block_on(bidi_given_up(addr));
        // go-peer prints how each Bidi call ended: Recv's error code, here.
        let line = server.expect_line("BIDI-ENDED", Duration::from_secs(30));
        assert_eq!(line, "BIDI-ENDED Canceled", "{addr}");
        drop(tx);
    }
}

#[test]
fn a_64_mib_message_crosses_to_the_go_server_and_back() {
    let (_server, addresses) = go_server();
    run(async move {
        for addr in &addresses {
            // go-peer takes requests up to 65 MiB; this client takes replies as large.
            let mut c = EchoClient::new(connect(addr).await)
                .max_decoding_message_size(65 << 20)
                .max_encoding_message_size(65 << 20);
            let reply = c.unary(request(pattern(64 << 20, 64), 64)).await.expect("64 MiB unary").into_inner();
            assert_eq!((reply.seq, reply.payload.len()), (64, 64 << 20), "{addr}");
            assert_eq!(first_mismatch(&reply.payload, 64), None, "{addr}");
        }
    });
}

#[test]
fn a_killed_go_server_fails_the_rust_clients_calls_unavailable() {
    let (mut server, addresses) = go_server();
    let rt = runtime();
    // A Bidi call open on each transport, one echo through each: in flight when the server dies.
    let mut open = Vec::new();
    rt.block_on(async {
        for addr in &addresses {
            let mut c = client(addr).await;
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            // Before the call is awaited: the Go server opens the response with its echo.
            tx.send(request(b"x".to_vec(), 1)).await.expect("send");
            let mut replies = c.bidi(ReceiverStream::new(rx)).await.expect("bidi").into_inner();
            assert_eq!(replies.message().await.expect("echo").expect("reply").payload, b"x", "{addr}");
            open.push((addr.clone(), c, tx, replies));
        }
    });
    let killed = Instant::now();
    server.kill9();
    run(async move {
        for (addr, mut c, tx, mut replies) in open {
            // A watchdog, not a timing test: the end must come, and soon, not at some timeout.
            let s = tokio::time::timeout(Duration::from_secs(30), replies.message())
                .await
                .unwrap_or_else(|_| panic!("{addr}: the call did not end after kill -9"))
                .expect_err("server gone");
            assert_eq!(s.code(), Code::Unavailable, "{addr}: {s:?}");
            drop(tx);
            // Nobody serves now: the next call fails at once, the same way.
            let s = c.unary(request(vec![], 2)).await.expect_err("no server");
            assert_eq!(s.code(), Code::Unavailable, "{addr}: {s:?}");
        }
        let elapsed = killed.elapsed();
        println!("every call ended {elapsed:?} after kill -9");
        assert!(elapsed < Duration::from_secs(10), "the calls took {elapsed:?} to end after kill -9");
    });
}

/// Runs go-conformance against `addresses`; fails the test with its transcript unless every
/// check passed.
fn go_client_checks(addresses: &[String]) {
    let out = Command::new(go_bin("go-conformance")).args(addresses).output().expect("run go-conformance");
    let transcript = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && transcript.contains(" 0 failed"), "go-conformance:\n{transcript}");
}

/// The Go client's calls in flight when a Python server (thread pool, then asyncio) is killed
/// end UNAVAILABLE, soon, on every transport, and the next calls too (`go-conformance --killed`).
#[test]
fn a_killed_python_server_fails_the_go_clients_calls_unavailable() {
    for kind in ["isthmus", "isthmus-aio"] {
        let (mut server, addresses) = python_server(kind);
        let mut client = Peer::command(Command::new(go_bin("go-conformance")).arg("--killed").args(&addresses));
        // Each call in its handler, sleeping: in flight.
        for _ in &addresses {
            server.expect_line("UNARY-SLEEPING ", Duration::from_secs(60));
        }
        let killed = Instant::now();
        server.kill9();
        let transcript = client.rest(Duration::from_secs(120));
        let elapsed = killed.elapsed();
        let summary = format!("{} passed, 0 failed", 2 * addresses.len());
        assert!(transcript.contains(&summary), "{kind}: go-conformance --killed:\n{transcript:#?}");
        assert!(client.child.wait().is_ok_and(|s| s.success()), "{kind}: {transcript:#?}");
        assert!(elapsed < Duration::from_secs(10), "{kind}: the calls took {elapsed:?} to end after kill -9");
    }
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
