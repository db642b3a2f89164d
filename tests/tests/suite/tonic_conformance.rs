//! The conformance suite: one set of cases, run unchanged over `shm://`, `unix://` and
//! `http://`. A generated tonic client on an `isthmus::Channel` calls a generated tonic service
//! behind `isthmus::Server::add_service` (`tonic-peer`, another process serving all three).

use std::process::Command;
use std::time::Duration;

use isthmus_tests::cases::{bidi_given_up, client, client_on, connect, every_kind_of_call, request};
use isthmus_tests::conformance::EchoRequest;
use isthmus_tests::{fresh_addr, fresh_socket, pattern, peer_bin, run, runtime, spawn_tonic_peer, Peer};
use tonic::codec::CompressionEncoding;
use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Request};

/// Starts `tonic-peer` on all three transports; its targets as clients reach them.
fn server() -> (Peer, Vec<String>) {
    let (shm, unix) = (fresh_addr("tonic"), format!("unix://{}", fresh_socket("conf").display()));
    spawn_tonic_peer(&[&shm, &unix, "http://127.0.0.1:0"])
}

#[test]
fn a_generated_client_and_service_make_every_kind_of_call() {
    let (_server, targets) = server();
    run(async move {
        for addr in &targets {
            every_kind_of_call(addr).await;
        }
    });
}

/// A tonic service behind `add_service` learns where an HTTP/2 call came from as tonic's own
/// server tells it: `remote_addr()` and `local_addr()` over TCP, the client's credentials
/// (`UdsConnectInfo`) over a unix socket. It learned neither (`None`): the server's connections
/// gave tonic no connection info of its kind. Over `shm://` there is none, as over a unix
/// socket for `remote_addr()`.
#[test]
fn a_tonic_service_learns_its_http2_callers_address_as_from_tonics_server() {
    let (_server, targets) = server();
    run(async move {
        for addr in &targets {
            let mut c = isthmus_tests::cases::client_on(
                isthmus::Channel::builder(addr).upgrade(false).connect().await.expect("connect"),
            );
            let mut req = Request::new(request(b"a".to_vec(), 0));
            req.metadata_mut().insert("x-want-peer", "1".parse().expect("ascii"));
            let reply = c.unary(req).await.expect("unary");
            let seen = reply.metadata().get("x-peer").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
            let seen: Vec<&str> = seen.split(' ').collect();
            match addr.split_once("://") {
                Some(("http", server)) => {
                    let remote: std::net::SocketAddr = seen[0].parse().expect("the remote address");
                    assert!(remote.ip().is_loopback() && remote.to_string() != server, "{addr}: {seen:?}");
                    assert_eq!((seen[1], seen[2]), (server, "none"), "{addr}");
                }
                Some(("unix", _)) => assert_eq!(seen, ["none", "none", &std::process::id().to_string()], "{addr}"),
                _ => assert_eq!(seen, ["none", "none", "none"], "{addr}"),
            }
        }
    });
}

/// A tonic service behind `add_service` sees its caller's user agent as its request's
/// `user-agent` header over every transport: the agent a channel names, as it is over
/// `shm://` (the channel's calls, and those of a channel to an HTTP/2 address that moved to
/// shared memory), with tonic's after it over HTTP/2.
#[test]
fn a_tonic_service_sees_the_channels_user_agent_on_every_transport() {
    let (_server, targets) = server();
    run(async move {
        let agent_of = |channel: isthmus::Channel| async move {
            let mut c = isthmus_tests::cases::client_on(channel);
            let mut req = Request::new(request(b"a".to_vec(), 0));
            req.metadata_mut().insert("x-want-agent", "1".parse().expect("ascii"));
            let reply = c.unary(req).await.expect("unary");
            reply.metadata().get("x-user-agent").and_then(|v| v.to_str().ok()).unwrap_or("none").to_owned()
        };
        for addr in &targets {
            let named = isthmus::Channel::builder(addr).user_agent("rust-test/3.0").upgrade(false);
            let seen = agent_of(named.connect().await.expect("connect")).await;
            if addr.starts_with("shm://") {
                assert_eq!(seen, "rust-test/3.0", "{addr}");
                assert_eq!(agent_of(connect(addr).await).await, "none", "{addr}: no agent named");
            } else {
                assert!(seen.starts_with("rust-test/3.0 tonic/"), "{addr}: {seen}");
            }
        }
        // A channel to the HTTP/2 address that moves to the server's shm:// endpoint names its
        // agent there too.
        let http = targets.iter().find(|t| t.starts_with("http://")).expect("an http:// target");
        let moving = isthmus::Channel::builder(http).user_agent("rust-test/4.0").upgrade(true);
        let channel = moving.connect().await.expect("connect");
        let mut seen = String::new();
        for _ in 0..200 {
            seen = agent_of(channel.clone()).await;
            if channel.transport_counts().shm > 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(channel.transport_counts().shm > 0, "the channel never moved to shared memory");
        assert_eq!(seen, "rust-test/4.0", "over the shm:// endpoint it moved to");
    });
}

#[test]
fn a_tonic_services_refusal_of_a_message_too_large_is_resource_exhausted_in_a_streams_trailers_too() {
    // A stream's status goes in its trailers once its headers and messages have gone. A tonic
    // service's OUT_OF_RANGE in tonic's words for a message over a limit arrives as gRPC's
    // RESOURCE_EXHAUSTED (the service raises it itself here: a bidi message's `fail_with`); the
    // same code in other words, or tonic's words cut short, arrives as it left.
    let (_server, targets) = server();
    run(async move {
        let words = "Error, decoded message length too large: found 70000000 bytes, the limit is: 67108864 bytes";
        let cut = "Error, decoded message length too large: found 70000000 bytes";
        for addr in &targets {
            for (message, code) in
                [(words, Code::ResourceExhausted), ("page 9 of 3", Code::OutOfRange), (cut, Code::OutOfRange)]
            {
                let mut c = client(addr).await;
                let (tx, rx) = tokio::sync::mpsc::channel(4);
                let mut replies = c.bidi(ReceiverStream::new(rx)).await.expect("bidi").into_inner();
                tx.send(request(b"first".to_vec(), 0)).await.expect("send");
                assert!(replies.message().await.expect("echo").is_some(), "{addr}: the first echo");
                let mut failing = request(Vec::new(), 1);
                failing.fail_with = Code::OutOfRange as i32;
                failing.fail_message = message.to_owned();
                tx.send(failing).await.expect("send");
                let status = replies.message().await.expect_err("the failure");
                assert_eq!((status.code(), status.message()), (code, message), "{addr}");
            }
        }
    });
}

#[test]
fn a_generated_client_that_compresses_works_on_every_transport() {
    // Over shm:// the channel inflates the client's messages before they cross; over HTTP/2
    // they travel compressed, and the service's gzipped replies are read.
    let (shm, unix) = (fresh_addr("gzip"), format!("unix://{}", fresh_socket("gzip").display()));
    let targets = [shm.as_str(), unix.as_str(), "http://127.0.0.1:0"];
    let mut server = Peer::command(Command::new(peer_bin("tonic-peer")).args(targets).env("ISTHMUS_SEND_GZIP", "1"));
    let targets: Vec<String> = std::iter::once(shm.clone()).chain((0..2).map(|_| server.http_address())).collect();
    run(async move {
        let payload = pattern(4096, 3).repeat(32);
        for addr in &targets {
            for encoding in [CompressionEncoding::Gzip, CompressionEncoding::Deflate] {
                let mut c = client(addr).await.send_compressed(encoding).accept_compressed(CompressionEncoding::Gzip);
                let r = c.unary(request(payload.clone(), 9)).await.expect("unary").into_inner();
                assert!(r.seq == 9 && r.payload == payload, "{addr} {encoding:?}");
                let (tx, rx) = tokio::sync::mpsc::channel(4);
                let mut replies = c.bidi(ReceiverStream::new(rx)).await.expect("bidi").into_inner();
                for seq in 0..3 {
                    tx.send(request(payload.clone(), seq)).await.expect("send");
                    let r = replies.message().await.expect("echo").expect("reply");
                    assert!(r.seq == seq && r.payload == payload, "{addr} {encoding:?}");
                }
            }
        }
        // isthmus's own HTTP/2 calls (what the Python, Go, Lua and C clients make) say they
        // read gzip, get gzipped replies, and read them.
        for addr in &targets[1..] {
            let ch = isthmus::Channel::builder(addr).upgrade(false).connect().await.expect("connect");
            let req = prost::Message::encode_to_vec(&request(payload.clone(), 11));
            let r = ch.unary("/conformance.Echo/Unary", &req, isthmus::CallOptions::default()).await.expect("unary");
            let reply: isthmus_tests::conformance::EchoReply = prost::Message::decode(r.message).expect("a reply");
            assert!(reply.seq == 11 && reply.payload == payload, "{addr}");
        }
    });
}

#[test]
fn statuses_deadlines_and_unknown_methods_cross_the_bridge() {
    let (_server, targets) = server();
    run(async move {
        for addr in &targets {
            statuses_and_deadlines(addr).await;
        }
    });
}

async fn statuses_and_deadlines(addr: &str) {
    {
        let mut c = client(addr).await;
        for code in 1..=16 {
            let req =
                EchoRequest { fail_with: code, fail_message: format!("failure {code} ✓"), ..EchoRequest::default() };
            let s = c.unary(req).await.expect_err("fails");
            assert_eq!(s.code(), Code::from_i32(code));
            assert_eq!(s.message(), format!("failure {code} ✓"));
            assert_eq!(s.details(), b"\x00details\xff");
            assert_eq!(s.metadata().get("x-failed").and_then(|v| v.to_str().ok()), Some("yes"), "code {code}");
        }
        // The deadline travels: the service sees it, and one it cannot meet ends the call.
        let mut req = Request::new(request(vec![], 1));
        req.set_timeout(Duration::from_secs(30));
        let left = c.unary(req).await.expect("in time").into_inner().time_left_ms;
        assert!((1..=30_000).contains(&left), "{left}");
        let mut req = Request::new(EchoRequest { sleep_ms: 10_000, ..EchoRequest::default() });
        req.set_timeout(Duration::from_millis(200));
        let s = c.unary(req).await.expect_err("too slow");
        assert_eq!(s.code(), Code::DeadlineExceeded, "{s:?}");
        // A failure mid-stream reaches the client after the messages before it.
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let mut replies = c.bidi(ReceiverStream::new(rx)).await.expect("bidi").into_inner();
        tx.send(request(b"a".to_vec(), 0)).await.expect("send");
        assert_eq!(replies.message().await.expect("echo").expect("reply").payload, b"a");
        tx.send(EchoRequest { fail_with: Code::Aborted as i32, fail_message: "stop".into(), ..EchoRequest::default() })
            .await
            .expect("send");
        let s = replies.message().await.expect_err("aborted");
        assert_eq!((s.code(), s.message()), (Code::Aborted, "stop"));
        // Methods the server does not have: of its service, and of a service it lacks.
        let channel = isthmus_tests::cases::connect(addr).await;
        for path in ["/conformance.Echo/Nope", "/other.Service/Call"] {
            let mut grpc = tonic::client::Grpc::new(channel.clone());
            grpc.ready().await.expect("ready");
            let codec = tonic_prost::ProstCodec::<EchoRequest, EchoRequest>::default();
            let path = http::uri::PathAndQuery::from_static(path);
            let s = grpc.unary(Request::new(EchoRequest::default()), path, codec).await.expect_err("unknown");
            assert_eq!(s.code(), Code::Unimplemented, "{addr}: {s:?}");
        }
    }
}

#[test]
fn a_deadline_ends_a_stream_in_the_middle_on_both_sides() {
    // A bidi stream whose deadline passes after one echo, while the client waits for a reply
    // that will not come and keeps its request stream open: the client's read fails
    // DEADLINE_EXCEEDED (tonic's own client bounds only the wait for the response's headers),
    // and the service's stream ends too (it prints BIDI-ENDED; tonic's HTTP/2 server gives a
    // reset stream as its plain end).
    let (mut server, targets) = server();
    for target in &targets {
        let (addr, open) = (target.clone(), std::sync::Arc::new(std::sync::Mutex::new(None)));
        let keep = open.clone();
        run(async move {
            let mut c = client(&addr).await;
            let (tx, rx) = tokio::sync::mpsc::channel(4);
            let mut call = Request::new(ReceiverStream::new(rx));
            call.set_timeout(Duration::from_millis(300));
            let mut replies = c.bidi(call).await.expect("bidi").into_inner();
            tx.send(request(b"one".to_vec(), 1)).await.expect("send");
            assert_eq!(replies.message().await.expect("echo").expect("reply").payload, b"one", "{addr}");
            let read = tokio::time::timeout(Duration::from_secs(20), replies.message()).await;
            let s = read.unwrap_or_else(|_| panic!("{addr}: the deadline did not end the read")).expect_err("no reply");
            assert_eq!((s.code(), s.message()), (Code::DeadlineExceeded, "Deadline Exceeded"), "{addr}");
            *keep.lock().expect("lock") = Some(tx); // the request stream stays open
        });
        server.expect_line("BIDI-ENDED ", Duration::from_secs(20));
        drop(open);
    }
}

#[test]
fn the_health_service_answers_on_every_endpoint() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let (_server, targets) = server();
    run(async move {
        for addr in &targets {
            let mut health = HealthClient::new(isthmus_tests::cases::connect(addr).await);
            for service in ["", "conformance.Echo"] {
                let r = health.check(HealthCheckRequest { service: service.into() }).await.expect("check");
                assert_eq!(r.into_inner().status(), ServingStatus::Serving, "{addr}: {service:?}");
            }
            let s = health.check(HealthCheckRequest { service: "no.Such".into() }).await.expect_err("unknown");
            assert_eq!(s.code(), Code::NotFound, "{addr}");
        }
    });
}

/// A generated client's unary request, which tonic hands over whole, goes inside its call's
/// HEADERS over `shm://` (ADR 0025): one frame per call. A request too large for that frame, and
/// a client stream whose messages are all ready at once, go as before.
#[test]
fn a_generated_clients_unary_request_goes_in_one_frame() {
    let (_server, targets) = server();
    run(async move {
        let channel = connect(&targets[0]).await;
        let mut c = client_on(channel.clone());
        c.unary(request(b"warm".to_vec(), 0)).await.expect("warm");
        let before = channel.counters().transport.frames_sent;
        for i in 1..=10u64 {
            let r = c.unary(request(pattern(64, i), i)).await.expect("unary").into_inner();
            assert_eq!((r.seq, r.payload), (i, pattern(64, i)));
        }
        let sent = channel.counters().transport.frames_sent - before;
        // A WINDOW of credit may go besides, never a second frame per call.
        assert!(sent <= 12, "10 unary calls sent {sent} frames");

        let big = pattern(100 << 10, 11);
        let r = c.unary(request(big.clone(), 11)).await.expect("100 KiB").into_inner();
        assert_eq!(r.payload, big);
        let requests: Vec<_> = (0..3u64).map(|i| request(pattern(10, i), i)).collect();
        let summary = c.client_stream(tonic::codegen::tokio_stream::iter(requests)).await.expect("client stream");
        assert_eq!((summary.get_ref().count, summary.get_ref().bytes), (3, 30));
        let one = vec![request(pattern(10, 0), 0)];
        let summary = c.client_stream(tonic::codegen::tokio_stream::iter(one)).await.expect("one message");
        assert_eq!(summary.get_ref().count, 1);
    });
}

/// A service that ends a bidirectional call while its client still feeds requests: the
/// client's request stream is let go (its sender sees the receiver closed), as tonic over
/// HTTP/2 lets it go. Over `shm://` the task sending it waited for its next request for as
/// long as the application kept the sender: a task, and what the stream holds, per such call.
#[test]
fn a_request_stream_is_let_go_once_the_service_ended_the_call() {
    let (_server, targets) = server();
    run(async move {
        for addr in &targets {
            let mut c = client(addr).await;
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            let fail = EchoRequest { fail_with: Code::FailedPrecondition as i32, seq: 1, ..Default::default() };
            tx.send(fail).await.expect("send");
            let ended = async {
                let mut replies = c.bidi(ReceiverStream::new(rx)).await?.into_inner();
                while replies.message().await?.is_some() {}
                Ok::<(), tonic::Status>(())
            };
            let status = ended.await.expect_err("the service fails the call");
            assert_eq!(status.code(), Code::FailedPrecondition, "{addr}");
            let let_go = tokio::time::timeout(Duration::from_secs(30), tx.closed()).await;
            assert!(let_go.is_ok(), "{addr}: the request stream is still held");
        }
    });
}

#[test]
fn a_client_cancel_reaches_the_service_and_concurrent_calls_stay_apart() {
    let (mut server, targets) = server();
    let rt = runtime();
    for addr in &targets {
        let tx = rt.block_on(bidi_given_up(addr));
        // The request stream is still open on the client, so only the cancel can end the
        // service's. tonic hands a service a CANCELLED request stream as its plain end
        // (`Streaming` returns `None`), on every transport, so either form proves it arrived.
        let line = server.expect_line("BIDI-ENDED", Duration::from_secs(30));
        println!("{addr}: {line}");
        assert!(line == "BIDI-ENDED half-close" || line == "BIDI-ENDED Cancelled", "{addr}: {line}");
        drop(tx);
        rt.block_on(async {
            let c = client(addr).await;
            let calls: Vec<_> = (0..200u64)
                .map(|i| {
                    let mut c = c.clone();
                    tokio::spawn(async move {
                        let payload = pattern(100 + (i as usize * 37) % 5000, i);
                        let r = c.unary(request(payload.clone(), i)).await.expect("unary").into_inner();
                        assert_eq!((r.seq, r.payload), (i, payload));
                    })
                })
                .collect();
            for call in calls {
                call.await.expect("call task");
            }
        });
    }
}

#[test]
fn health_turns_not_serving_when_a_graceful_shutdown_begins() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let (mut server, targets) = server();
    run(async move {
        // A watch on every endpoint, opened while the server serves.
        let mut watches = Vec::new();
        for addr in &targets {
            let mut health = HealthClient::new(isthmus_tests::cases::connect(addr).await);
            let request = HealthCheckRequest { service: "conformance.Echo".into() };
            let mut updates = health.watch(request).await.expect("watch").into_inner();
            let first = updates.message().await.expect("status").expect("a status");
            assert_eq!(first.status(), ServingStatus::Serving, "{addr}");
            watches.push((addr.clone(), updates));
        }
        // SAFETY: kill(2) with a child's pid and SIGTERM touches no memory of ours.
        assert_eq!(unsafe { libc::kill(server.pid() as i32, libc::SIGTERM) }, 0);
        for (addr, mut updates) in watches {
            let next = updates.message().await.expect("status").expect("a status");
            assert_eq!(next.status(), ServingStatus::NotServing, "{addr}");
        }
        server.expect_line("SHUTDOWN-DONE", Duration::from_secs(30));
    });
}

/// An application that serves tonic_health's own health service, as tonic applications do
/// (`health_reporter`, added with `add_service`), gets its answers on every endpoint. The
/// server added its built-in one beside it, and the router panicked when serving began.
#[test]
fn an_applications_own_health_service_takes_the_built_in_ones_place() {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let rt = runtime();
    let shm = fresh_addr("own-health");
    let (reporter, service) = tonic_health::server::health_reporter();
    let bound = rt.block_on(async {
        reporter.set_service_status("app.Thing", tonic_health::ServingStatus::NotServing).await;
        isthmus::Server::builder().add_service(service).bind_all([shm.as_str(), "http://127.0.0.1:0"]).expect("bind")
    });
    let mut targets = vec![shm];
    targets.extend(bound.http_addresses());
    let serving = rt.spawn(bound.serve());
    rt.block_on(async {
        for addr in &targets {
            let mut health = HealthClient::new(isthmus_tests::cases::connect(addr).await);
            let r = health.check(HealthCheckRequest { service: "app.Thing".into() }).await.expect("check");
            assert_eq!(r.into_inner().status(), ServingStatus::NotServing, "{addr}: the application's own answer");
        }
    });
    assert!(!serving.is_finished(), "the server stopped serving");
    serving.abort();
}
