//! The RPC engine end to end: a client in this process, the server (`rpc-peer`) in another.

use std::process::Command;
use std::time::{Duration, Instant};

use isthmus::{CallOptions, Channel, Code, Connectivity, MetadataMap};
use isthmus_tests::{first_mismatch, fresh_addr, fresh_socket, pattern, run, runtime, Peer};

fn server() -> (Peer, String) {
    let addr = fresh_addr("rpc");
    (Peer::spawn_bin("rpc-peer", &[&addr]), addr)
}

/// `rpc-peer` on shm:// and on unix:// and http://, where its handlers answer over HTTP/2
/// through the server's private shm:// endpoint; the addresses as clients reach them.
fn server_everywhere(tag: &str) -> (Peer, Vec<String>) {
    server_everywhere_with(tag, &[])
}

/// [`server_everywhere`] with `rpc-peer`'s other arguments (its message limit, its streams).
fn server_everywhere_with(tag: &str, args: &[&str]) -> (Peer, Vec<String>) {
    let (shm, socket) = (fresh_addr(tag), fresh_socket(tag));
    let targets = format!("{shm},unix://{},http://127.0.0.1:0", socket.display());
    let mut peer = Peer::spawn_bin("rpc-peer", &[&[targets.as_str()], args].concat());
    let mut addresses = vec![shm];
    for _ in 0..2 {
        let line = peer.expect_line("LISTENING ", Duration::from_secs(30));
        addresses.push(line["LISTENING ".len()..].to_owned());
    }
    (peer, addresses)
}

fn with_timeout(ms: u64) -> CallOptions {
    CallOptions { timeout: Some(Duration::from_millis(ms)), ..CallOptions::default() }
}

#[test]
fn unary_carries_metadata_and_trailers_both_ways() {
    let (_server, addrs) = server_everywhere("md");
    run(async move {
        for addr in addrs {
            let ch = Channel::connect(&addr).await.expect("connect");
            let mut md = MetadataMap::new();
            md.append("x-echo", "hi").expect("ascii");
            md.append_bin("x-echo-bin", vec![0u8, 0xfe, 0xff]).expect("binary");
            let r = ch
                .unary("/test.Echo/Unary", b"payload", CallOptions { metadata: md, ..CallOptions::default() })
                .await
                .expect("call");
            assert_eq!(&r.message[..], b"payload");
            assert_eq!(r.metadata.get("x-echo"), Some("head:hi"));
            assert_eq!(r.metadata.get_bin("x-echo-bin"), Some(&[0u8, 0xfe, 0xff][..]));
            assert_eq!(r.trailers.get("x-echo"), Some("tail:hi"));
            assert_eq!(r.trailers.get_bin("x-echo-bin"), Some(&[0u8, 0xfe, 0xff][..]));
        }
    });
}

#[test]
fn server_streaming_client_streaming_and_bidi() {
    let (_server, addrs) = server_everywhere("shapes");
    run(async move {
        for addr in addrs {
            let ch = Channel::connect(&addr).await.expect("connect");
            // Server streaming: 200 messages, some through the arena.
            let mut call = ch.start("/test.Echo/ServerStream", CallOptions::default()).await.expect("start");
            let mut req = 200u32.to_le_bytes().to_vec();
            req.extend_from_slice(&(20_000u32).to_le_bytes());
            call.send_last(&req).await.expect("request");
            let mut n = 0u64;
            while let Some(m) = call.recv().await.expect("message") {
                assert_eq!((m.len(), first_mismatch(&m, n)), (20_000, None), "message {n}");
                n += 1;
            }
            assert_eq!(n, 200);
            // Client streaming: 100 messages, then half-close with no message.
            let mut call = ch.start("/test.Echo/ClientStream", CallOptions::default()).await.expect("start");
            let mut bytes = 0u64;
            for i in 0..100u64 {
                let m = pattern((i as usize * 997) % 30_000, i);
                bytes += m.len() as u64;
                call.send(&m).await.expect("send");
            }
            call.close_send().await.expect("half-close");
            let reply = call.recv().await.expect("reply").expect("one message");
            assert_eq!(u64::from_le_bytes(reply[0..8].try_into().expect("8")), 100);
            assert_eq!(u64::from_le_bytes(reply[8..16].try_into().expect("8")), bytes);
            assert_eq!(call.recv().await.expect("ok"), None);
            // Bidi: each message answered before the next is sent.
            let mut call = ch.start("/test.Echo/Bidi", CallOptions::default()).await.expect("start");
            for i in 0..50u64 {
                call.send(&pattern(100 + i as usize, i)).await.expect("send");
                let m = call.recv().await.expect("echo").expect("message");
                assert_eq!(first_mismatch(&m, i), None);
            }
            call.close_send().await.expect("half-close");
            assert_eq!(call.recv().await.expect("ok"), None);
        }
    });
}

/// A call whose metadata is larger than a server takes (1 MiB over HTTP/2) fails alone,
/// RESOURCE_EXHAUSTED with its size and the limit: the server's `:authority` filter follows the
/// block without holding it, and the connection's other calls go on. It ended the connection.
#[test]
fn metadata_over_the_http2_servers_limit_fails_its_call_and_no_other() {
    let (_server, addrs) = server_everywhere("bigmd");
    run(async move {
        // shm:// refuses it at the ring, with its sizes too.
        for addr in &addrs {
            let ch = Channel::builder(addr).upgrade(false).connect().await.expect("connect");
            let mut open = ch.start("/test.Echo/Bidi", CallOptions::default()).await.expect("start");
            open.send(b"before").await.expect("send");
            assert_eq!(open.recv().await.expect("echo").as_deref(), Some(&b"before"[..]));
            // Text that Huffman-codes under 1 MiB, and bytes that do not.
            for big in [false, true] {
                let mut md = MetadataMap::new();
                if big {
                    md.append_bin("x-large-bin", vec![0xa5u8; 3 << 20]).expect("binary");
                } else {
                    md.append("x-large", &"x".repeat(1 << 20)).expect("ascii");
                }
                let e = ch
                    .unary("/test.Echo/Unary", b"payload", CallOptions { metadata: md, ..CallOptions::default() })
                    .await
                    .expect_err("too large");
                assert_eq!(e.code(), Code::ResourceExhausted, "{addr}: {e:?}");
                if !addr.starts_with("shm://") {
                    assert!(e.message().contains("bytes is larger than this server's limit of 1048576 bytes"), "{e:?}");
                }
                // The stream opened before goes on, on the same connection.
                open.send(b"after").await.expect("send");
                assert_eq!(open.recv().await.expect("echo").as_deref(), Some(&b"after"[..]), "{addr}");
            }
            let r = ch.unary("/test.Echo/Unary", b"next", CallOptions::default()).await.expect("the next call");
            assert_eq!(&r.message[..], b"next");
            open.close_send().await.expect("half-close");
            assert_eq!(open.recv().await.expect("ok"), None);
        }
    });
}

#[test]
fn every_status_code_arrives_with_message_details_and_trailers() {
    let (_server, addrs) = server_everywhere("codes");
    run(async move {
        for addr in addrs {
            let ch = Channel::connect(&addr).await.expect("connect");
            for code in Code::ALL.into_iter().skip(1) {
                let s = ch
                    .unary("/test.Echo/Fail", &(code as u32).to_le_bytes(), CallOptions::default())
                    .await
                    .expect_err("fails");
                assert_eq!(s.code(), code);
                assert_eq!(s.message(), format!("requested failure {}", code as u32));
                assert_eq!(&s.details()[..], b"\x00details\xff");
                assert_eq!(s.metadata().get("x-failed"), Some("yes"));
                // None of the handler's (over HTTP/2 the server's `date` may come).
                assert_eq!(s.headers().get("x-echo"), None, "{code:?} at {addr}: {s:?}");
            }
        }
    });
}

/// A server may end a call OK with a message (grpcio's `set_details`); grpcio's clients show
/// it. The engine's client dropped it: a unary `Response` had no place for it, a stream no way
/// to ask, and the HTTP/2 server's trailers went without it.
#[test]
fn an_ok_status_keeps_its_message() {
    let (_server, addrs) = server_everywhere("okwords");
    run(async move {
        for addr in addrs {
            let ch = Channel::connect(&addr).await.expect("connect");
            let r =
                ch.unary("/test.Echo/OkWithWords", b"100 % \xe2\x9c\x93", with_timeout(10_000)).await.expect("call");
            assert_eq!(r.status_message, "all went well: 100 % \u{2713}", "{addr}");
            let r = ch.unary("/test.Echo/Unary", b"x", with_timeout(10_000)).await.expect("call");
            assert_eq!(r.status_message, "", "{addr}");
            let mut call = ch.start("/test.Echo/OkWithWords", with_timeout(10_000)).await.expect("start");
            call.send_last(b"stream").await.expect("send");
            assert_eq!(call.status_message(), None, "{addr}: not before the end");
            assert_eq!(call.recv().await.expect("reply").as_deref(), Some(&b"stream"[..]));
            assert_eq!(call.recv().await.expect("end"), None);
            assert_eq!(call.status_message(), Some("all went well: stream"), "{addr}");
        }
    });
}

/// gRPC keeps a response's headers apart from its trailers even when the call fails: grpcio's
/// `RpcError.initial_metadata()` and grpc-go's `grpc.Header` give them. A unary call's status
/// carries them, and a stream's headers stay readable after its failure.
#[test]
fn a_failed_call_keeps_the_initial_metadata_sent_before_the_failure() {
    let (_server, addrs) = server_everywhere("failed-headers");
    run(async move {
        for addr in addrs {
            let ch = Channel::connect(&addr).await.expect("connect");
            let mut md = MetadataMap::new();
            md.append("x-echo", "early").expect("ascii");
            md.append_bin("x-echo-bin", vec![0u8, 0xff]).expect("binary");
            let options = CallOptions { metadata: md, ..CallOptions::default() };
            let s = ch
                .unary("/test.Echo/Fail", &(Code::NotFound as u32).to_le_bytes(), options.clone())
                .await
                .expect_err("fails");
            assert_eq!(s.code(), Code::NotFound, "{addr}");
            assert_eq!(s.headers().get("x-echo"), Some("head:early"), "{addr}: {s:?}");
            assert_eq!(s.headers().get_bin("x-echo-bin"), Some(&[0u8, 0xff][..]), "{addr}");
            assert_eq!(s.metadata().get("x-failed"), Some("yes"), "{addr}: the trailers stay apart");
            assert_eq!(s.metadata().get("x-echo"), None, "{addr}: the headers stay apart");

            let mut call = ch.start("/test.Echo/Fail", options).await.expect("start");
            call.send_last(&(Code::Aborted as u32).to_le_bytes()).await.expect("send");
            let s = call.recv().await.expect_err("fails");
            assert_eq!((s.code(), s.headers().get("x-echo")), (Code::Aborted, Some("head:early")), "{addr}");
            assert_eq!(call.headers().await.expect("headers").get("x-echo"), Some("head:early"), "{addr}");
        }
    });
}

#[test]
fn unknown_methods_and_panics_fail_the_call_not_the_server() {
    let (_server, addrs) = server_everywhere("unknown");
    run(async move {
        for addr in addrs {
            let ch = Channel::connect(&addr).await.expect("connect");
            let s = ch.unary("/test.Echo/Nope", b"", CallOptions::default()).await.expect_err("unknown");
            assert_eq!(s.code(), Code::Unimplemented);
            assert!(s.message().contains("/test.Echo/Nope"), "{s}");
            let s = ch.unary("/test.Echo/Panic", b"", CallOptions::default()).await.expect_err("panics");
            assert_eq!(s.code(), Code::Internal);
            assert!(s.message().contains("exploded on purpose"), "{s}");
            let r = ch.unary("/test.Echo/Unary", b"still alive", CallOptions::default()).await.expect("server goes on");
            assert_eq!(&r.message[..], b"still alive");
        }
    });
}

#[test]
fn deadlines_travel_and_end_the_call_on_both_sides() {
    let (mut server, addrs) = server_everywhere("deadline");
    run(async move {
        for addr in addrs {
            let ch = Channel::connect(&addr).await.expect("connect");
            let r = ch.unary("/test.Echo/TimeLeft", b"", with_timeout(60_000)).await.expect("call");
            let left: i64 = std::str::from_utf8(&r.message).expect("ascii").parse().expect("number");
            assert!((1..=60_000).contains(&left), "the server saw {left} ms left");
            let started = Instant::now();
            let s = ch.unary("/test.Echo/Sleep", b"", with_timeout(300)).await.expect_err("deadline");
            assert_eq!(s.code(), Code::DeadlineExceeded);
            assert!(started.elapsed() >= Duration::from_millis(300));
            server.expect_line("SLEEP-DROPPED", Duration::from_secs(30)); // the handler was stopped

            // Mid-stream: messages flow, then the deadline ends the call (one long enough for
            // the first echo on a busy machine).
            let mut call = ch.start("/test.Echo/Bidi", with_timeout(2_000)).await.expect("start");
            call.send(b"one").await.expect("send");
            assert_eq!(&call.recv().await.expect("echo").expect("message")[..], b"one");
            let s = call.recv().await.expect_err("nothing more before the deadline");
            assert_eq!(s.code(), Code::DeadlineExceeded);
        }
    });
}

#[test]
fn a_client_cancel_stops_the_server_handler() {
    let (mut server, addrs) = server_everywhere("cancel");
    run(async move {
        for addr in addrs {
            let ch = Channel::connect(&addr).await.expect("connect");
            let mut call = ch.start("/test.Echo/Sleep", CallOptions::default()).await.expect("start");
            call.send(b"x").await.expect("send");
            server.expect_line("SLEEPING", Duration::from_secs(30));
            call.cancel().await;
            server.expect_line("SLEEP-DROPPED", Duration::from_secs(30));
            let mut dropped = ch.start("/test.Echo/Sleep", CallOptions::default()).await.expect("start");
            dropped.send(b"x").await.expect("send");
            server.expect_line("SLEEPING", Duration::from_secs(30));
            drop(dropped); // dropping a call cancels it too
            server.expect_line("SLEEP-DROPPED", Duration::from_secs(30));
        }
    });
}

/// A call dropped while the ring to the server is full still stops its handler: its CANCEL
/// goes once the ring has room. The server is stopped (SIGSTOP) with a handler running, the
/// client fills its 4 KiB ring with another call's messages, drops the first call, and the
/// server is let go on. Before, a drop's CANCEL that found no room was lost, and the handler ran
/// on until the connection ended.
#[test]
fn a_call_dropped_while_the_ring_is_full_still_stops_its_handler() {
    let (mut server, addr) = server();
    run(async move {
        let small = isthmus::Config { ring_size: 4096, inline_max: 512, ..isthmus::Config::default() };
        let ch = Channel::connect_with(&addr, small).await.expect("connect");
        let mut sleeping = ch.start("/test.Echo/Sleep", CallOptions::default()).await.expect("start");
        sleeping.send(b"x").await.expect("send");
        server.expect_line("SLEEPING", Duration::from_secs(30));

        server.stop();
        let mut filler = ch.start("/test.Echo/Stall", CallOptions::default()).await.expect("start");
        let mut sent = 0;
        // A send that waits this long for room has found the ring full (the server reads
        // nothing while stopped); a watchdog bounds the loop.
        while let Ok(sending) = tokio::time::timeout(Duration::from_millis(200), filler.send(&[7u8; 256])).await {
            sending.unwrap_or_else(|e| panic!("send {sent} on a stalled call: {e:?}"));
            sent += 1;
            let state = std::fs::read_to_string(format!("/proc/{}/stat", server.pid())).unwrap_or_default();
            assert!(sent < 1000, "4 KiB of ring took {sent} messages of 256 B and is still not full; server: {state}");
        }
        drop(sleeping);
        server.resume();
        server.expect_line("SLEEP-DROPPED", Duration::from_secs(30));
        drop(filler);
        drop(ch);
    });
}

/// A server that reads nothing (stopped) with the ring full: calls with a deadline end
/// DEADLINE_EXCEEDED at it, whether their HEADERS could not go or a send waited for room; their
/// CANCEL waits in the connection's queue, not the caller. Before, the unary call waited for
/// ring room for its HEADERS, and the stream for its CANCEL, until the server read again.
#[test]
fn a_deadline_ends_calls_that_wait_for_a_stopped_servers_ring() {
    let (server, addr) = server();
    run(async move {
        let small = isthmus::Config { ring_size: 4096, inline_max: 512, ..isthmus::Config::default() };
        let ch = Channel::connect_with(&addr, small).await.expect("connect");
        ch.unary("/test.Echo/Unary", b"up", CallOptions::default()).await.expect("a first call");
        // Started (its HEADERS out) before the server stops; its deadline passes while it waits.
        let within = CallOptions { timeout: Some(Duration::from_secs(3)), ..CallOptions::default() };
        let mut stream = ch.start("/test.Echo/Bidi", within).await.expect("start");
        server.stop();
        let mut filler = ch.start("/test.Echo/Stall", CallOptions::default()).await.expect("start");
        let mut sent = 0;
        // A send that waits this long for room has found the ring full; then smaller ones fill
        // what is left, so that no HEADERS and no CANCEL fits either. A watchdog bounds it.
        for size in [256, 1] {
            while let Ok(sending) =
                tokio::time::timeout(Duration::from_millis(200), filler.send(&vec![7u8; size])).await
            {
                sending.unwrap_or_else(|e| panic!("send {sent} on a stalled call: {e:?}"));
                sent += 1;
                assert!(sent < 1000, "4 KiB of ring took {sent} messages and is still not full");
            }
        }
        let quick = CallOptions { timeout: Some(Duration::from_millis(300)), ..CallOptions::default() };
        // Watchdogs far past the deadline: the server stays stopped all the while.
        let unary = tokio::time::timeout(Duration::from_secs(20), ch.unary("/test.Echo/Unary", &[1u8; 64], quick));
        let s = unary.await.expect("the unary call ended while the server was stopped").expect_err("no reply");
        assert_eq!(s.code(), Code::DeadlineExceeded, "{s}");
        let send = async {
            loop {
                stream.send(&[2u8; 256]).await?;
            }
        };
        let sent: Result<(), isthmus::Status> = tokio::time::timeout(Duration::from_secs(20), send)
            .await
            .expect("the sends ended while the server was stopped");
        let s = sent.expect_err("no room");
        assert_eq!(s.code(), Code::DeadlineExceeded, "{s}");
        server.resume();
        drop((stream, filler));
        let r = ch.unary("/test.Echo/Unary", b"after", CallOptions::default()).await.expect("the channel goes on");
        assert_eq!(&r.message[..], b"after");
    });
}

/// A GOAWAY from a client (only a server sends one, protocol 13.7) is malformed input: it ends
/// that client's connection with a GOAWAY naming it, as any fault does. Before, the server took
/// it as its own going away and ended the connection's calls UNAVAILABLE.
#[test]
fn a_clients_goaway_ends_its_connection_as_a_fault() {
    use isthmus::wire;
    use isthmus_shm::Kind;
    let (server, addr) = server();
    let shm: isthmus_shm::Address = addr.parse().expect("address");
    let mut c = isthmus_shm::Connection::connect(&shm, &isthmus_shm::Config::default()).expect("connect");
    let away = wire::GoAway { last_stream: 0, message: "bye".into() }.encode();
    c.sender.send(Kind::GoAway, 0, 0, &away, patience_30s()).expect("GOAWAY");
    let f = c.receiver.recv(patience_30s()).expect("a GOAWAY back");
    assert_eq!(f.kind, Kind::GoAway, "{f:?}");
    let g = wire::GoAway::decode(&f.body).expect("a GOAWAY body");
    assert!(g.message.contains("a client's GOAWAY"), "{}", g.message);
    let mut next = isthmus_shm::Connection::connect(&shm, &isthmus_shm::Config::default()).expect("reconnect");
    serves_on_and_ends_stream_1_once(&mut next, "started=");
    drop(server);
}

#[test]
fn a_server_that_ends_a_stream_midway_cancels_it_for_the_client() {
    let (_server, addr) = server();
    run(async move {
        let ch = Channel::connect(&addr).await.expect("connect");
        let mut call = ch.start("/test.Echo/EchoThenCancel", CallOptions::default()).await.expect("start");
        for i in 0..3u64 {
            // Arena-sized messages, so the cancel has blocks to give back.
            let m = pattern(1 << 20, i);
            call.send(&m).await.expect("send");
            let echo = call.recv().await.expect("echo").expect("message");
            assert_eq!(first_mismatch(&echo, i), None);
        }
        let s = call.recv().await.expect_err("the server cancelled");
        assert_eq!(s.code(), Code::Cancelled, "{s}");
        assert!(s.message().contains("gave up"), "{s}");
        // Later sends report the end instead of vanishing.
        let s = call.send(b"more").await.expect_err("the call is over");
        assert_eq!(s.code(), Code::Cancelled, "{s}");
        drop(call);
        let c = ch.counters();
        assert_eq!((c.in_flight(), c.finished(Code::Cancelled)), (0, 1));
        // The connection and its arena are whole: a message of most of the arena goes through.
        let big = pattern(30 << 20, 77);
        let r = ch.unary("/test.Echo/Unary", &big, CallOptions::default()).await.expect("big echo");
        assert_eq!(first_mismatch(&r.message, 77), None);
    });
}

/// A ping-pong stream alone on its connection: each response is read by the call that waits for
/// it, and between messages the receiver stays parked for the calls (ADR 0029), so the channel's
/// reader task neither spins nor sleeps on the doorbell meanwhile. Before, it took the receiver
/// back after every message, read the next one itself and woke the call: a doorbell wait per
/// message, and two threads taking turns for the core. A call that waits without reading (an
/// event loop's) is answered all the same: it has the reader task take the receiver back.
#[test]
fn a_lone_stream_reads_its_own_messages_and_the_reader_task_rests() {
    let (_server, addr) = server();
    run(async move {
        let ch = Channel::connect(&addr).await.expect("connect");
        const N: u64 = 2_000;
        // Round trips on a new stream of `ch`; the times the reader task waited on the doorbell
        // meanwhile.
        async fn doorbell_waits(ch: &Channel) -> (u64, isthmus::ClientCall) {
            let mut call = ch.start("/test.Echo/Bidi", CallOptions::default()).await.expect("start");
            call.send(b"first").await.expect("send");
            assert_eq!(call.recv().await.expect("echo").as_deref(), Some(&b"first"[..]));
            let waits = || {
                let c = ch.counters().transport;
                c.spin_hits + c.sleeps
            };
            let before = waits();
            for i in 0..N {
                let m = pattern(64, i);
                call.send(&m).await.expect("send");
                assert_eq!(call.recv().await.expect("echo").as_deref(), Some(&m[..]), "message {i}");
            }
            (waits() - before, call)
        }
        // The baseline: calls that never read, as all did before.
        let polled = ch.with_calls_read(false);
        // (Both share the one connection, and its counters.)
        let (baseline, mut old) = doorbell_waits(&polled).await;
        old.close_send().await.expect("half-close");
        assert_eq!(old.recv().await.expect("OK end"), None);
        let (waited, mut call) = doorbell_waits(&ch).await;
        // A thread that loses its core for over a millisecond lets the reader task take the
        // receiver back (and wait once); on a busy machine that is hundreds of times in a run,
        // far from once per message all the same.
        assert!(
            waited < baseline * 3 / 4,
            "the reader task waited on the doorbell {waited} times in {N} round trips ({baseline} with the reader reading)"
        );
        for i in 0..100u64 {
            let m = pattern(64, i);
            let r = polled.unary("/test.Echo/Unary", &m, CallOptions::default()).await.expect("unary");
            assert_eq!(r.message, m, "call {i}");
            call.send(&m).await.expect("send");
            assert_eq!(call.recv().await.expect("echo").as_deref(), Some(&m[..]), "message {i}");
        }
        call.close_send().await.expect("half-close");
        assert_eq!(call.recv().await.expect("OK end"), None);
    });
}

/// Calls on one channel whose replies come at once, and after the spin a waiting call reads for
/// (replies a millisecond or two late): the connection passes between the calls reading for
/// themselves and the channel's reader task, on a runtime of two workers and on one where a
/// reading call holds the only thread. Every call must be answered, and soon: a lost wake-up
/// leaves a call waiting until a timer polls it again (its deadline's, or here the 10 s of
/// `timeout`, which finds the reply waiting in the ring), so a call that took seconds fails.
#[test]
fn calls_answered_late_and_at_once_pass_the_connection_between_readers() {
    let (_server, addr) = server();
    async fn after(ch: &Channel, req: &[u8]) -> Vec<u8> {
        let start = Instant::now();
        let call = ch.unary("/test.Echo/After", req, CallOptions::default());
        let r = tokio::time::timeout(Duration::from_secs(10), call).await;
        assert!(start.elapsed() < Duration::from_secs(5), "a lost wake-up: the call took {:?}", start.elapsed());
        r.expect("answered").expect("every call is answered").message.to_vec()
    }
    let calls = |addr: String| async move {
        let ch = Channel::connect(&addr).await.expect("connect");
        // One caller alone: nobody else reads while it waits.
        for i in 0..150u32 {
            let mut req = [0u32, 300, 1_500][i as usize % 3].to_le_bytes().to_vec();
            req.extend(pattern(64, i.into()));
            assert_eq!(after(&ch, &req).await, req, "call {i}");
        }
        // Many at once.
        let tasks: Vec<_> = (0..48u64)
            .map(|t| {
                let ch = ch.clone();
                tokio::spawn(async move {
                    for i in 0..40u64 {
                        let delay: u32 = match (t + i) % 4 {
                            0 => 1_500,
                            1 => 300,
                            _ => 0,
                        };
                        let mut req = delay.to_le_bytes().to_vec();
                        req.extend(pattern(64, t * 1000 + i));
                        assert_eq!(after(&ch, &req).await, req, "task {t} call {i}");
                    }
                })
            })
            .collect();
        for task in tasks {
            task.await.expect("caller task");
        }
    };
    run(calls(addr.clone()));
    let one_thread = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    one_thread.block_on(async { tokio::time::timeout(Duration::from_secs(120), calls(addr)).await.expect("watchdog") });
}

#[test]
fn ten_thousand_concurrent_unary_calls_all_answered_intact() {
    let (_server, addr) = server();
    run(async move {
        let ch = Channel::connect(&addr).await.expect("connect");
        let calls: Vec<_> = (0..10_000u64)
            .map(|i| {
                let ch = ch.clone();
                tokio::spawn(async move {
                    let req = pattern(16 + (i as usize % 64) * 32, i);
                    let r = ch.unary("/test.Echo/Unary", &req, CallOptions::default()).await.expect("call");
                    assert_eq!(r.message, req, "call {i}");
                })
            })
            .collect();
        for c in calls {
            c.await.expect("call task");
        }
    });
}

#[test]
fn a_killed_server_ends_every_open_call_with_unavailable() {
    let (mut server, addr) = server();
    run(async move {
        let ch = Channel::connect(&addr).await.expect("connect");
        let mut calls = Vec::new();
        for _ in 0..3 {
            let mut call = ch.start("/test.Echo/Bidi", CallOptions::default()).await.expect("start");
            call.send(b"x").await.expect("send");
            assert_eq!(&call.recv().await.expect("echo").expect("message")[..], b"x");
            calls.push(call);
        }
        let killed = Instant::now();
        server.kill9();
        for mut call in calls {
            let s = call.recv().await.expect_err("server gone");
            assert_eq!(s.code(), Code::Unavailable, "{s}");
        }
        println!("every call ended {:?} after kill -9", killed.elapsed());
        assert!(killed.elapsed() < Duration::from_secs(1));
        let s = ch.unary("/test.Echo/Unary", b"x", CallOptions::default()).await.expect_err("no server");
        assert_eq!(s.code(), Code::Unavailable);
    });
}

#[test]
fn the_same_channel_works_again_after_a_server_restart() {
    let (mut server, addr) = server();
    let rt = runtime();
    let addr2 = addr.clone();
    let ch = rt.block_on(async move {
        let ch = Channel::connect(&addr2).await.expect("connect");
        ch.unary("/test.Echo/Unary", b"before", CallOptions::default()).await.expect("first server");
        ch
    });
    server.kill9();
    let _again = Peer::spawn_bin("rpc-peer", &[&addr]);
    rt.block_on(async move {
        // The first call may still meet the dead connection; the next one reconnects.
        let first = ch.unary("/test.Echo/Unary", b"after", CallOptions::default()).await;
        if let Err(s) = &first {
            assert_eq!(s.code(), Code::Unavailable, "the first call after the restart: {s:?}");
        }
        // The new server may still be starting: wait for it (the restart is the test, not its speed).
        let opts =
            CallOptions { wait_for_ready: true, timeout: Some(Duration::from_secs(30)), ..CallOptions::default() };
        let r = match ch.unary("/test.Echo/Unary", b"after", opts).await {
            Ok(r) => r,
            Err(s) => panic!("the second call after the restart: {s:?} (the first: {:?})", first.map(|r| r.message)),
        };
        assert_eq!(&r.message[..], b"after");
    });
}

#[test]
fn wait_for_ready_waits_for_a_server_and_fail_fast_does_not() {
    let addr = fresh_addr("ready");
    let ch = Channel::lazy(&addr).expect("lazy channel");
    runtime().block_on(async {
        let s = ch.unary("/test.Echo/Unary", b"x", CallOptions::default()).await.expect_err("no server yet");
        assert_eq!(s.code(), Code::Unavailable, "{s}");
        // Until the deadline, as grpc's calls wait: it gave up when its next try would come
        // after it (here at 155 ms).
        let opts =
            CallOptions { wait_for_ready: true, timeout: Some(Duration::from_millis(200)), ..CallOptions::default() };
        let began = std::time::Instant::now();
        let s = ch.unary("/test.Echo/Unary", b"x", opts).await.expect_err("still no server");
        assert_eq!(s.code(), Code::DeadlineExceeded, "{s}");
        assert!(s.message().contains("no server became ready"), "{s}");
        assert!(began.elapsed() >= Duration::from_millis(200), "gave up after {:?}", began.elapsed());
    });
    let waiting = {
        let ch = ch.clone();
        std::thread::spawn(move || {
            runtime().block_on(async move {
                let opts = CallOptions {
                    wait_for_ready: true,
                    timeout: Some(Duration::from_secs(60)),
                    ..CallOptions::default()
                };
                ch.unary("/test.Echo/Unary", b"waited", opts).await
            })
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    let _server = Peer::spawn_bin("rpc-peer", &[&addr]);
    let r = isthmus_tests::watchdog(Duration::from_secs(90), move || waiting.join().expect("thread")).expect("served");
    assert_eq!(&r.message[..], b"waited");
}

/// A call whose deadline has passed before it starts (a zero timeout; the bindings make a
/// negative one zero) fails DEADLINE_EXCEEDED without going, as gRPC's do: over shm:// it went,
/// and a fast handler's reply could come back OK.
#[test]
fn a_call_whose_deadline_passed_already_fails_every_time() {
    let (_server, addrs) = server_everywhere("passed");
    run(async move {
        for addr in addrs {
            let ch = Channel::connect(&addr).await.expect("connect");
            let options = CallOptions { timeout: Some(Duration::ZERO), ..CallOptions::default() };
            for _ in 0..20 {
                let s = ch.unary("/test.Echo/Unary", b"x", options.clone()).await.expect_err("passed");
                assert_eq!(s.code(), Code::DeadlineExceeded, "{addr}: {s}");
            }
            let s = match ch.start("/test.Echo/Bidi", options.clone()).await {
                Ok(mut call) => call.recv().await.expect_err("passed"),
                Err(s) => s,
            };
            assert_eq!(s.code(), Code::DeadlineExceeded, "{addr}: a stream: {s}");
        }
    });
}

/// What the server saw of a call's deadline (`TimeLeft`): none, or more than 500 years. A
/// timeout the clock cannot hold (a caller's "forever": `Duration::MAX`, ~2^63 s) is none; a
/// long one that it can (2^40 s, ~35,000 years) reaches the server as the longest its transport
/// says (584 years in shm://'s nanoseconds, 11,415 in `grpc-timeout`'s 8 digits of hours).
fn far_or_none(left_ms: &[u8]) -> bool {
    let left: i64 = std::str::from_utf8(left_ms).expect("ascii").parse().expect("number");
    left == -1 || left > 500 * 365 * 86_400_000
}

/// The timeouts of [`far_or_none`]: each panicked, on `Instant + Duration`'s overflow or in
/// tonic, which refuses to write a `grpc-timeout` over 8 digits of hours.
const FOREVERS: [Duration; 3] = [Duration::MAX, Duration::from_secs(u64::MAX / 2), Duration::from_secs(1 << 40)];

#[test]
fn a_timeout_too_long_for_the_clock_is_no_deadline_on_every_transport() {
    let (_server, addrs) = server_everywhere("forever");
    run(async move {
        for addr in addrs {
            let ch = Channel::connect(&addr).await.expect("connect");
            for timeout in FOREVERS {
                let options = CallOptions { timeout: Some(timeout), ..CallOptions::default() };
                let r = ch.unary("/test.Echo/TimeLeft", b"", options.clone()).await;
                let r = r.unwrap_or_else(|s| panic!("{addr}, {timeout:?}: {s}"));
                assert!(far_or_none(&r.message), "{addr}, {timeout:?}: {:?}", r.message);
                let mut call = ch.start("/test.Echo/Bidi", options).await.expect("start");
                call.send(b"one").await.expect("send");
                assert_eq!(&call.recv().await.expect("echo").expect("message")[..], b"one");
            }
        }
    });
    // The blocking client, over shm://.
    let (_server, addr) = server();
    let ch = isthmus::blocking::Channel::connect(&addr).expect("connect");
    for timeout in FOREVERS {
        let options = CallOptions { timeout: Some(timeout), ..CallOptions::default() };
        let r = ch.unary("/test.Echo/TimeLeft", b"", options.clone()).unwrap_or_else(|s| panic!("{timeout:?}: {s}"));
        assert!(far_or_none(&r.message), "blocking, {timeout:?}: {:?}", r.message);
        let mut call = ch.start("/test.Echo/Bidi", options).expect("start");
        call.send(b"one").expect("send");
        assert_eq!(&call.recv().expect("echo").expect("message")[..], b"one");
    }
}

/// A stream over HTTP/2 that waits for ready, with no server: its sends beyond the one the
/// request queue holds waited for ever (the wait for READY knew no deadline), so a caller that
/// sends before it reads (a C caller, Lua outside nginx) never learnt of the deadline.
#[test]
fn a_stream_waiting_for_a_server_ends_its_sends_at_its_deadline() {
    let socket = fresh_socket("ready-sends");
    let addr = format!("unix://{}", socket.display());
    let started = Instant::now();
    let s = isthmus_tests::watchdog(Duration::from_secs(60), move || {
        runtime().block_on(async move {
            let ch = Channel::builder(&addr).upgrade(false).connect_lazy().expect("lazy channel");
            let opts = CallOptions {
                wait_for_ready: true,
                timeout: Some(Duration::from_millis(300)),
                ..CallOptions::default()
            };
            let mut call = ch.start("/test.Echo/Bidi", opts).await.expect("start");
            // The sender a binding's caller sends through (the C ABI's, Python's iterators).
            let sender = call.sender();
            for i in 0..4u64 {
                if !sender.send(&pattern(10, i), false).await {
                    break;
                }
            }
            call.recv().await.expect_err("no server")
        })
    });
    assert_eq!(s.code(), Code::DeadlineExceeded, "{s}");
    assert!(started.elapsed() >= Duration::from_millis(300), "not before the deadline: {:?}", started.elapsed());
}

/// A socket file removed when the test ends, however it ends.
struct Removed(std::path::PathBuf);

impl Drop for Removed {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn a_server_that_never_answers_the_handshake_is_unavailable_and_waited_for() {
    // A socket that takes connections (into its backlog) and never answers: a server hung
    // before its handshake. Connecting is the call's first step, so this is UNAVAILABLE, as
    // gRPC says of a failed connect, unless the call's deadline comes before the handshake
    // timeout: then DEADLINE_EXCEEDED at that deadline, as grpc's calls end.
    let path = Removed(fresh_socket("mute"));
    let _mute = std::os::unix::net::UnixListener::bind(&path.0).expect("bind");
    let config = isthmus::Config { handshake_timeout: Duration::from_millis(100), ..isthmus::Config::default() };
    let ch = Channel::lazy_with(&format!("shm://{}", path.0.display()), config).expect("lazy channel");
    run(async move {
        let s = ch.unary("/test.Echo/Unary", b"x", CallOptions::default()).await.expect_err("nobody answers");
        assert_eq!(s.code(), Code::Unavailable, "{s}");
        assert!(s.message().contains("hello"), "{s}");
        let opts = CallOptions { timeout: Some(Duration::from_millis(30)), ..CallOptions::default() };
        let s = ch.unary("/test.Echo/Unary", b"x", opts).await.expect_err("nobody answers in time");
        assert_eq!(s.code(), Code::DeadlineExceeded, "{s}");
        assert_eq!(s.message(), "Deadline Exceeded", "grpc-core's words");
        // Waiting for ready waits it out, to the call's deadline.
        let opts =
            CallOptions { wait_for_ready: true, timeout: Some(Duration::from_millis(500)), ..CallOptions::default() };
        let s = ch.unary("/test.Echo/Unary", b"x", opts).await.expect_err("still nobody");
        assert_eq!(s.code(), Code::DeadlineExceeded, "{s}");
        // Between two attempts, or cut short in one's handshake.
        assert!(s.message().contains("no server became ready") || s.message() == "Deadline Exceeded", "{s}");
    });
}

/// A server that has stopped accepting (hung, or stopped with SIGSTOP) and whose listen backlog
/// is full: `connect(2)` itself waits for room. That wait is bounded as the handshake is, by the
/// handshake timeout, and the call by its deadline; it had no bound, and the call hung.
#[test]
fn a_server_whose_listen_backlog_is_full_is_unavailable_and_waited_for() {
    let path = fresh_socket("full");
    let _stuffed = isthmus_tests::FullBacklog::bind(&path);
    let target = format!("shm://{}", path.display());
    let ended = std::sync::mpsc::channel();
    let done = ended.0.clone();
    std::thread::spawn(move || {
        let short = isthmus::Config { handshake_timeout: Duration::from_millis(200), ..isthmus::Config::default() };
        let ch = Channel::lazy_with(&target, short).expect("lazy channel");
        let began = Instant::now();
        let rt = runtime();
        let unavailable = rt.block_on(ch.unary("/test.Echo/Unary", b"x", CallOptions::default()));
        let _ = done.send(("handshake timeout", unavailable.map(drop), began.elapsed()));
        // The call's deadline, before the handshake's own timeout.
        let ch = Channel::lazy_with(&target, isthmus::Config::default()).expect("lazy channel");
        let opts = CallOptions { timeout: Some(Duration::from_millis(300)), ..CallOptions::default() };
        let began = Instant::now();
        let late = rt.block_on(ch.unary("/test.Echo/Unary", b"x", opts));
        let _ = done.send(("deadline", late.map(drop), began.elapsed()));
        // The blocking client's call too.
        let ch = isthmus::blocking::Channel::lazy_with(&target, isthmus::Config::default()).expect("lazy channel");
        let opts = CallOptions { timeout: Some(Duration::from_millis(300)), ..CallOptions::default() };
        let began = Instant::now();
        let late = ch.unary("/test.Echo/Unary", b"x", opts);
        let _ = done.send(("blocking deadline", late.map(drop), began.elapsed()));
    });
    let outcome = || ended.1.recv_timeout(Duration::from_secs(30)).expect("the call hung in connect(2)");
    let (what, r, took) = outcome();
    let s = r.expect_err(what);
    assert_eq!(s.code(), Code::Unavailable, "{what}: {s}");
    assert!(took >= Duration::from_millis(200), "{what}: not before the handshake timeout: {took:?}");
    for _ in 0..2 {
        let (what, r, took) = outcome();
        let s = r.expect_err(what);
        assert_eq!(s.code(), Code::DeadlineExceeded, "{what}: {s}");
        assert!(took >= Duration::from_millis(300), "{what}: not before the deadline: {took:?}");
    }
}

#[test]
fn graceful_shutdown_lets_calls_in_progress_finish_and_refuses_new_ones() {
    let (mut server, addr) = server();
    run(async move {
        let ch = Channel::connect(&addr).await.expect("connect");
        let slow = {
            let ch = ch.clone();
            tokio::spawn(async move { ch.unary("/test.Echo/Slow", b"in flight", CallOptions::default()).await })
        };
        let started = tokio::task::spawn_blocking(move || {
            server.expect_line("SLOW-STARTED", Duration::from_secs(30));
            server
        })
        .await
        .expect("peer");
        ch.unary("/test.Admin/Shutdown", b"", CallOptions::default()).await.expect("shutdown starts");
        let r = slow.await.expect("task").expect("the call in progress finishes");
        assert_eq!(&r.message[..], b"in flight");
        let s = ch.unary("/test.Echo/Unary", b"late", CallOptions::default()).await.expect_err("no new calls");
        assert_eq!(s.code(), Code::Unavailable, "{s}");
        let mut server = started;
        tokio::task::spawn_blocking(move || server.expect_line("SHUTDOWN-DONE", Duration::from_secs(30)))
            .await
            .expect("peer");
    });
}

/// A client whose handshake ends after the server's graceful shutdown (it connected to the
/// socket before, and sent its hello after) gets GOAWAY and a closed connection. Before, the
/// shutdown never listed such a connection, and it was served on after `serve` had returned.
/// The server runs in this process here, so that what outlives its `serve` can be seen.
#[test]
fn a_handshake_that_ends_after_the_shutdown_gets_a_closed_connection() {
    use isthmus_shm::handshake::{Hello, HelloKind, HELLO_LEN};
    use std::io::{Read, Write};
    let addr = fresh_addr("late-handshake");
    let path = addr.parse::<isthmus_shm::Address>().expect("address").socket_path().to_owned();
    run(async move {
        let bound = isthmus::Server::builder()
            .handler("/test.Echo/Unary", |mut call: isthmus::ServerCall| async move {
                let m = call.recv().await?.unwrap_or_default();
                call.send_last(&m).await
            })
            .bind(&addr)
            .expect("bind");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let serving = tokio::spawn(bound.serve_with_shutdown(async {
            let _ = stopped.await;
        }));
        let mut late = std::os::unix::net::UnixStream::connect(&path).expect("connect to the socket");
        // The listener accepts in order: once a later client is served, `late` was accepted
        // too, and its handshake waits for the hello.
        let ch = Channel::connect(&addr).await.expect("connect");
        ch.unary("/test.Echo/Unary", b"up", CallOptions::default()).await.expect("a call");
        let _ = stop.send(());
        serving.await.expect("task").expect("a clean shutdown");

        let late = tokio::task::spawn_blocking(move || {
            let mut hello = Hello::new(HelloKind::Client);
            let config = isthmus::Config::default();
            hello.ring_size = [config.ring_size as u64, 0];
            hello.arena_size = [config.arena_size as u64, 0];
            late.write_all(&hello.encode()).expect("send the hello");
            let mut reply = [0u8; HELLO_LEN];
            late.read_exact(&mut reply).expect("the server's hello: the handshake ends after the shutdown");
            assert_eq!(Hello::decode(&reply).expect("a hello").kind, HelloKind::Server);
            // A generous watchdog: the connection closes as its handshake ends.
            late.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
            late.read(&mut [0u8; 1])
        });
        match late.await.expect("task") {
            Ok(0) => {}
            other => panic!("the connection made after the shutdown stayed open: {other:?}"),
        }
    });
}

/// A `unix://` endpoint whose calls outlast the grace is aborted, and its socket file goes
/// with it (it used to stay until the next bind replaced it). In this process, so that the
/// file can be looked at once `serve` has returned.
#[test]
fn a_unix_endpoint_aborted_at_the_end_of_the_grace_removes_its_socket() {
    let socket = fresh_socket("aborted");
    let target = format!("unix://{}", socket.display());
    run(async move {
        let started = std::sync::Arc::new(tokio::sync::Notify::new());
        let starts = started.clone();
        let bound = isthmus::Server::builder()
            .grace(Duration::from_millis(200))
            .handler("/test.Echo/Sleep", move |_call: isthmus::ServerCall| {
                let starts = starts.clone();
                async move {
                    starts.notify_one();
                    std::future::pending::<()>().await;
                    Ok(())
                }
            })
            .bind(&target)
            .expect("bind");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let serving = tokio::spawn(bound.serve_with_shutdown(async {
            let _ = stopped.await;
        }));
        let ch = Channel::connect(&target).await.expect("connect");
        let mut call = ch.start("/test.Echo/Sleep", CallOptions::default()).await.expect("start");
        call.send(b"x").await.expect("send");
        started.notified().await; // the call is in flight over HTTP/2
        assert!(socket.exists());
        let _ = stop.send(());
        serving.await.expect("task").expect("the shutdown ends");
        assert!(!socket.exists(), "{} is still there", socket.display());
        drop(call);
    });
}

#[test]
fn a_message_over_the_limit_is_resource_exhausted_naming_size_and_limit() {
    // rpc-peer takes requests of up to 1 MiB, on every transport: over HTTP/2 its handlers answer
    // through its private shm:// endpoint, whose bridge holds requests to the same limit.
    let (_server, addrs) = server_everywhere_with("rpc-limit", &["1048576"]);
    run(async move {
        for addr in addrs {
            // Over HTTP/2 itself: no move to the server's shm:// endpoint (ADR 0013).
            let ch = Channel::builder(&addr).upgrade(false).connect().await.expect("connect");
            for size in [(1 << 20) + 1, 3 << 20] {
                let s = ch
                    .unary("/test.Echo/Unary", &vec![1u8; size], CallOptions::default())
                    .await
                    .expect_err("too large");
                assert_eq!(s.code(), Code::ResourceExhausted, "{addr}: {s}");
                // In grpc-core's words for the server's refusal, whatever the transport (over
                // HTTP/2 the bridge's said CLIENT).
                let words = format!("SERVER: Received message larger than max ({size} vs. 1048576)");
                assert_eq!(s.message(), words, "{addr}");
            }
            let r =
                ch.unary("/test.Echo/Unary", &vec![2u8; 1 << 20], CallOptions::default()).await.expect("at the limit");
            assert_eq!(r.message.len(), 1 << 20);
            // The limit is on what the server receives, not on what it sends: a 3 MiB reply
            // arrives (over HTTP/2 the loopback's client side once held replies to it too).
            let mut call = ch.start("/test.Echo/ServerStream", CallOptions::default()).await.expect("start");
            let mut request = 1u32.to_le_bytes().to_vec();
            request.extend_from_slice(&(3u32 << 20).to_le_bytes());
            call.send_last(&request).await.expect("request");
            let m = call.recv().await.unwrap_or_else(|s| panic!("{addr}: {s}")).expect("the reply");
            assert_eq!((m.len(), first_mismatch(&m, 0)), (3 << 20, None), "{addr}");
            assert!(call.recv().await.expect("the end").is_none(), "{addr}");
        }
    });
}

#[test]
fn tonic_services_refuse_a_message_over_their_limit_as_grpc_does() {
    // A tonic service keeps tonic's own limits: the health service every server serves takes
    // requests of up to 4 MiB. tonic refuses a larger one OUT_OF_RANGE; the server answers it
    // RESOURCE_EXHAUSTED, as grpc-go's and grpc-core's do, in tonic's words (size and limit),
    // over shm:// (the bridge) and over HTTP/2 (tonic's own server).
    let (_server, addrs) = server_everywhere("tonic-limit");
    run(async move {
        let request = vec![0x0au8; 5 << 20]; // a field 1 tag, as the start of a request's bytes
        for addr in &addrs {
            let ch = Channel::builder(addr).upgrade(false).connect().await.expect("connect");
            let s = ch
                .unary("/grpc.health.v1.Health/Check", &request, CallOptions::default())
                .await
                .expect_err("over tonic's limit");
            assert_eq!(s.code(), Code::ResourceExhausted, "{addr}: {s}");
            assert!(s.message().contains("5242880") && s.message().contains("4194304"), "{addr}: {s}");
            // A handler's status is its own, whatever its words: passed on from a tonic client
            // of its own, say. It arrives as it left, over every transport.
            let words = "Error, decoded message length too large: found 5242880 bytes, the limit is: 4194304 bytes";
            let mut request = (Code::OutOfRange as u32).to_le_bytes().to_vec();
            request.extend_from_slice(words.as_bytes());
            let s = ch.unary("/test.Echo/Fail", &request, CallOptions::default()).await.expect_err("fails");
            assert_eq!((s.code(), s.message()), (Code::OutOfRange, words), "{addr}");
        }
        // A tonic client's channel limits what it receives, not what it sends: a 2 MiB request
        // goes on a channel that takes 1 MiB, and a 2 MiB reply does not come.
        let config = isthmus::Config { max_message_size: 1 << 20, ..isthmus::Config::default() };
        let ch = Channel::builder(&addrs[0]).config(config).connect().await.expect("connect");
        let mut grpc = tonic::client::Grpc::new(ch);
        grpc.ready().await.expect("ready");
        let requests = tonic::codegen::tokio_stream::iter([bytes::Bytes::from(pattern(2 << 20, 0))]);
        let path = http::uri::PathAndQuery::from_static("/test.Echo/ClientStream");
        let reply = grpc
            .client_streaming(tonic::Request::new(requests), path, isthmus::BytesCodec)
            .await
            .expect("a 2 MiB request on a 1 MiB channel")
            .into_inner();
        assert_eq!(u64::from_le_bytes(reply[8..16].try_into().expect("8")), 2 << 20);
        grpc.ready().await.expect("ready");
        let path = http::uri::PathAndQuery::from_static("/test.Echo/Unary");
        let s = grpc
            .unary(tonic::Request::new(bytes::Bytes::from(vec![3u8; 2 << 20])), path, isthmus::BytesCodec)
            .await
            .expect_err("a 2 MiB reply");
        assert_eq!(s.code(), tonic::Code::ResourceExhausted, "{s}");
    });
}

#[test]
fn http2_takes_requests_up_to_grpcs_4_mib_unless_the_server_says_otherwise() {
    // Over HTTP/2 a request is gathered, and a compressed one inflated, in memory before its
    // handler sees it: with shm://'s 4 GiB there, 64 KiB of gzip from any client that reached
    // the port held 64 MiB of the server's memory (4 GiB for 4 MiB of gzip). grpc-go's,
    // grpcio's and tonic's servers take 4 MiB unless told otherwise, and so does this one.
    let five_mib = vec![5u8; 5 << 20];
    let (_server, addrs) = server_everywhere("http-default-limit");
    run(async move {
        let ch = Channel::connect(&addrs[0]).await.expect("connect");
        let r = ch.unary("/test.Echo/Unary", &five_mib, CallOptions::default()).await.expect("shm:// takes 5 MiB");
        assert_eq!(r.message.len(), 5 << 20);
        for addr in &addrs[1..] {
            let ch = Channel::builder(addr).upgrade(false).connect().await.expect("connect");
            let s = ch.unary("/test.Echo/Unary", &five_mib, CallOptions::default()).await.expect_err("5 MiB");
            assert_eq!(s.code(), Code::ResourceExhausted, "{addr}: {s}");
            assert!(s.message().contains("5242880") && s.message().contains("4194304"), "{addr}: {s}");
            let r = ch.unary("/test.Echo/Unary", &vec![4u8; 4 << 20], CallOptions::default()).await;
            assert_eq!(r.unwrap_or_else(|s| panic!("{addr}: 4 MiB: {s}")).message.len(), 4 << 20);
            let mut grpc = compressing_client(addr, tonic::codec::CompressionEncoding::Gzip).await;
            grpc.ready().await.expect("ready");
            let path = http::uri::PathAndQuery::from_static("/test.Echo/Unary");
            let bomb = bytes::Bytes::from(vec![0u8; 64 << 20]);
            let s = grpc.unary(tonic::Request::new(bomb), path, isthmus::BytesCodec).await.expect_err("bomb");
            assert_eq!(s.code(), tonic::Code::ResourceExhausted, "{addr}: {s:?}");
            assert!(s.message().contains("limit of 4194304 bytes"), "{addr}: {s:?}");
        }
    });
    // A server that sets a limit of its own has it on every endpoint, HTTP/2 too.
    let (shm, socket) = (fresh_addr("http-set-limit"), fresh_socket("http-set-limit"));
    let targets = format!("{shm},unix://{}", socket.display());
    let mut peer = Peer::command(
        Command::new(isthmus_tests::peer_bin("rpc-peer")).arg(&targets).env("RPC_PEER_MAX_MESSAGE", "8388608"),
    );
    let unix = peer.http_address();
    run(async move {
        for addr in [shm, unix] {
            let ch = Channel::builder(&addr).upgrade(false).connect().await.expect("connect");
            let r = ch.unary("/test.Echo/Unary", &vec![6u8; 6 << 20], CallOptions::default()).await;
            assert_eq!(r.unwrap_or_else(|s| panic!("{addr}: 6 MiB: {s}")).message.len(), 6 << 20);
            let s = ch.unary("/test.Echo/Unary", &vec![9u8; 9 << 20], CallOptions::default()).await.expect_err("9 MiB");
            assert_eq!(s.code(), Code::ResourceExhausted, "{addr}: {s}");
            assert!(s.message().contains("8388608"), "{addr}: {s}");
        }
    });
}

/// A raw gRPC client over tonic's own HTTP/2 transport (not isthmus's) that compresses every
/// request with `encoding`, as grpcio and grpc-go clients do when told to.
async fn compressing_client(
    addr: &str,
    encoding: tonic::codec::CompressionEncoding,
) -> tonic::client::Grpc<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(addr.to_owned()).expect("uri").connect().await;
    tonic::client::Grpc::new(channel.expect("connect")).send_compressed(encoding).max_encoding_message_size(usize::MAX)
}

#[test]
fn requests_compressed_with_gzip_or_deflate_reach_the_handlers() {
    // Path handlers answer HTTP/2 through the server's private shm:// endpoint, whose bridge
    // inflates what the client compressed (tonic's client, and isthmus's asked to compress),
    // within the server's 1 MiB limit. (unix:// takes the same way once accepted.)
    let (_server, shm, addr) = Peer::rpc_peer_with_http("gzip", &["1048576"]);
    run(async move {
        let message = pattern(4096, 7).repeat(64); // 256 KiB that compresses well
        {
            for encoding in [tonic::codec::CompressionEncoding::Gzip, tonic::codec::CompressionEncoding::Deflate] {
                let mut grpc = compressing_client(&addr, encoding).await;
                let path = http::uri::PathAndQuery::from_static("/test.Echo/Unary");
                grpc.ready().await.expect("ready");
                let reply = grpc
                    .unary(tonic::Request::new(bytes::Bytes::from(message.clone())), path.clone(), isthmus::BytesCodec)
                    .await
                    .expect("echoed");
                assert!(reply.into_inner() == message, "{addr} {encoding:?}: the echo differs");

                // Four messages, each compressed, on one bidi stream.
                let requests: Vec<bytes::Bytes> =
                    (0..4u64).map(|seed| bytes::Bytes::from(pattern(2048, seed).repeat(8))).collect();
                grpc.ready().await.expect("ready");
                let mut replies = grpc
                    .streaming(
                        tonic::Request::new(tonic::codegen::tokio_stream::iter(requests.clone())),
                        http::uri::PathAndQuery::from_static("/test.Echo/Bidi"),
                        isthmus::BytesCodec,
                    )
                    .await
                    .expect("bidi")
                    .into_inner();
                for want in &requests {
                    assert!(replies.message().await.expect("reply").as_ref() == Some(want), "{addr} {encoding:?}");
                }

                // 64 MiB of zeros compress to ~64 KiB: inflated, they pass the 1 MiB limit, and
                // the inflating stops there.
                grpc.ready().await.expect("ready");
                let bomb = bytes::Bytes::from(vec![0u8; 64 << 20]);
                let s = grpc.unary(tonic::Request::new(bomb), path, isthmus::BytesCodec).await.expect_err("bomb");
                assert_eq!(s.code(), tonic::Code::ResourceExhausted, "{addr} {encoding:?}: {s:?}");
                assert!(s.message().contains("limit of 1048576 bytes"), "{s:?}");
            }
            // isthmus's own HTTP/2 client compresses when a call asks: the bomb inflates at the
            // server (uncompressed, 64 MiB would be refused as too large before it was read).
            let ch = Channel::builder(&addr).upgrade(false).connect().await.expect("connect over HTTP/2");
            for compression in [isthmus::Compression::Gzip, isthmus::Compression::Deflate] {
                let opts = CallOptions { compression: Some(compression), ..CallOptions::default() };
                let reply = ch.unary("/test.Echo/Unary", &message, opts.clone()).await.expect("echoed");
                assert!(reply.message == message, "{compression:?}: the echo differs");
                let s = ch.unary("/test.Echo/Unary", &vec![0u8; 64 << 20], opts).await.expect_err("bomb");
                assert_eq!(s.code(), isthmus::Code::ResourceExhausted, "{compression:?}: {s:?}");
                assert!(s.message().contains("compressed message that inflates past the limit"), "{s:?}");
            }
        }
        // The server goes on.
        let ch = Channel::connect(&shm).await.expect("connect");
        assert_eq!(
            &ch.unary("/test.Echo/Unary", b"after", CallOptions::default()).await.expect("call").message[..],
            b"after"
        );
    });
}

#[test]
fn a_gibibyte_each_way_on_a_streaming_call() {
    let (_server, addr) = server();
    run(async move {
        let ch = Channel::connect(&addr).await.expect("connect");
        let mut call = ch.start("/test.Echo/Bidi", CallOptions::default()).await.expect("start");
        let big = pattern(1 << 30, 1234);
        call.send(&big).await.expect("1 GiB out");
        let back = call.recv().await.expect("echo").expect("1 GiB back");
        assert_eq!(back.len(), 1 << 30);
        assert_eq!(first_mismatch(&back, 1234), None);
        drop((big, back));
        call.close_send().await.expect("half-close");
        assert_eq!(call.recv().await.expect("ok"), None);
    });
}

#[test]
fn counters_count_calls_by_final_code_on_both_sides() {
    let (_server, addr) = server();
    run(async move {
        let ch = Channel::connect(&addr).await.expect("connect");
        for _ in 0..5 {
            ch.unary("/test.Echo/Unary", b"x", CallOptions::default()).await.expect("ok");
        }
        let _ = ch.unary("/test.Echo/Sleep", b"", with_timeout(100)).await.expect_err("deadline");
        let mut call = ch.start("/test.Echo/Bidi", CallOptions::default()).await.expect("start");
        call.send(b"y").await.expect("send");
        assert!(call.recv().await.expect("echo").is_some());
        call.cancel().await;
        let _ = ch.unary("/test.Echo/Fail", &(Code::NotFound as u32).to_le_bytes(), CallOptions::default()).await;
        let c = ch.counters();
        assert_eq!(c.calls_started, 8);
        assert_eq!((c.finished(Code::Ok), c.finished(Code::DeadlineExceeded)), (5, 1));
        assert_eq!((c.finished(Code::Cancelled), c.finished(Code::NotFound)), (1, 1));
        assert_eq!(c.in_flight(), 0);
        assert!(c.transport.frames_sent >= 8 && c.transport.bytes_received > 0, "{c:?}");
        // The server saw the same calls on that connection: ask from a second connection.
        // The server records a cancel when its task sees it: poll until the counts settle.
        let other = Channel::connect(&addr).await.expect("second connection");
        let mut text = String::new();
        for _ in 0..500 {
            let m = other.unary("/test.Admin/Counters", b"", CallOptions::default()).await.expect("counters").message;
            text = String::from_utf8(m.to_vec()).expect("utf-8");
            if text.lines().any(|l| l.starts_with("started=8 ok=5 cancelled=1 deadline=1")) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(text.lines().any(|l| l.starts_with("started=8 ok=5 cancelled=1 deadline=1")), "{text}");
    });
}

/// Waits through the channel's state changes until `ok(state)`, asking it to connect.
async fn until_state(ch: &Channel, ok: impl Fn(Connectivity) -> bool) -> Connectivity {
    let wait = async {
        loop {
            let state = ch.connectivity(true);
            if ok(state) {
                return state;
            }
            // A state change, or a look again: a failed attempt retries after its backoff.
            let _ = tokio::time::timeout(Duration::from_secs(1), ch.connectivity_changed(state)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), wait).await.expect("the state never came")
}

#[test]
fn connectivity_follows_the_server_as_it_comes_and_goes() {
    // One runtime for the whole test: tonic's channel lives on the one it was made in.
    let rt = runtime();
    for over in ["shm", "http"] {
        let (shm, socket) = (fresh_addr("state"), fresh_socket("state"));
        let target = match over {
            "shm" => shm.clone(),
            _ => format!("unix://{}", socket.display()),
        };
        let ch = {
            let _runtime = rt.enter();
            Channel::builder(&target).upgrade(false).connect_lazy().expect("lazy channel")
        };
        rt.block_on(async {
            assert_eq!(ch.connectivity(false), Connectivity::Idle, "{over}: nothing asked to connect yet");
            until_state(&ch, |s| s == Connectivity::TransientFailure).await;
        });
        let mut server = Peer::spawn_bin("rpc-peer", &[&format!("{shm},unix://{}", socket.display())]);
        if over == "http" {
            server.expect_line("LISTENING ", Duration::from_secs(30));
        }
        rt.block_on(async {
            until_state(&ch, |s| s == Connectivity::Ready).await;
            let r = ch.unary("/test.Echo/Unary", b"up", CallOptions::default()).await.expect("ready means calls go");
            assert_eq!(&r.message[..], b"up");
        });
        server.kill9();
        rt.block_on(async {
            // The connection's end is seen at once (its reader, or hyper's), without a call.
            let changed = tokio::time::timeout(Duration::from_secs(30), ch.connectivity_changed(Connectivity::Ready));
            assert_ne!(changed.await.expect("noticed"), Connectivity::Ready, "{over}");
        });
        ch.close(isthmus::Status::new(Code::Cancelled, "closed"));
        if over == "shm" {
            rt.block_on(async {
                let s = ch.unary("/test.Echo/Unary", b"x", CallOptions::default()).await.expect_err("closed");
                assert_eq!(s.code(), Code::Unavailable, "{s}");
                assert!(s.message().contains("closed"), "{s}");
            });
        }
    }
}

/// A channel to `addr` (kept on HTTP/2 for an HTTP/2 one) and a bidi call on it whose first
/// message came back.
async fn bidi_under_way(addr: &str) -> (Channel, isthmus::ClientCall) {
    let ch = Channel::builder(addr).upgrade(false).connect().await.expect("connect");
    let mut call = ch.start("/test.Echo/Bidi", CallOptions::default()).await.expect("start");
    call.send(b"x").await.expect("send");
    assert_eq!(call.recv().await.expect("echo").as_deref(), Some(&b"x"[..]), "{addr}");
    (ch, call)
}

/// `close` ends the calls in progress with its status, and later calls fail at their start
/// (over HTTP/2 with that status, as grpc-go's `NewStream` on a closed connection; its start
/// succeeded and only the first receive said so).
#[test]
fn close_ends_the_calls_in_progress_with_its_status() {
    let (_server, addrs) = server_everywhere("close");
    let rt = runtime();
    rt.block_on(async {
        for addr in &addrs {
            let (ch, mut call) = bidi_under_way(addr).await;
            ch.close(isthmus::Status::new(Code::Cancelled, "Channel closed!"));
            let s = call.recv().await.expect_err("closed under it");
            assert_eq!((s.code(), s.message()), (Code::Cancelled, "Channel closed!"), "{addr}");
            let later = match ch.start("/test.Echo/Bidi", CallOptions::default()).await {
                Ok(_) => panic!("{addr}: a call started on a closed channel"),
                Err(s) => s,
            };
            let unary = ch.unary("/test.Echo/Unary", b"x", CallOptions::default()).await.expect_err("closed");
            for s in [later, unary] {
                match addr.starts_with("shm://") {
                    true => assert_eq!(s.code(), Code::Unavailable, "{addr}: {s}"),
                    false => assert_eq!((s.code(), s.message()), (Code::Cancelled, "Channel closed!"), "{addr}"),
                }
            }
            // Closed with OK (the Rust API takes any status), its calls still fail: those in
            // progress CANCELLED, as a grpcio channel's close ends them, and later ones too.
            let (ch, mut call) = bidi_under_way(addr).await;
            ch.close(isthmus::Status::new(Code::Ok, ""));
            let s = call.recv().await.expect_err("closed under it");
            assert_eq!((s.code(), s.message()), (Code::Cancelled, "the channel was closed"), "{addr}");
            let s = ch.unary("/test.Echo/Unary", b"x", CallOptions::default()).await.expect_err("closed with OK");
            assert_ne!(s.code(), Code::Ok, "{addr}");
        }
    });
}

#[test]
fn replies_go_compressed_where_the_server_asks_and_the_client_reads_it() {
    // `Server::send_compressed` compresses the handlers' replies over HTTP/2 for clients whose
    // grpc-accept-encoding lists the encoding; the others get them as they are.
    run(async move {
        let bound = isthmus::Server::builder()
            .handler("/test.Echo/Unary", |mut call: isthmus::ServerCall| async move {
                let m = call.recv().await?.unwrap_or_default();
                call.send(&m).await
            })
            .send_compressed(isthmus::Compression::Gzip)
            .bind_all(["http://127.0.0.1:0"])
            .expect("bind");
        let addr = bound.http_addresses().into_iter().next().expect("an address");
        tokio::spawn(bound.serve());
        let message = bytes::Bytes::from(pattern(4096, 3).repeat(16));
        let channel =
            tonic::transport::Endpoint::from_shared(addr.clone()).expect("uri").connect().await.expect("connect");
        for accepts in [true, false] {
            let mut grpc = tonic::client::Grpc::new(channel.clone());
            if accepts {
                grpc = grpc.accept_compressed(tonic::codec::CompressionEncoding::Gzip);
            }
            grpc.ready().await.expect("ready");
            let path = http::uri::PathAndQuery::from_static("/test.Echo/Unary");
            let reply =
                grpc.unary(tonic::Request::new(message.clone()), path, isthmus::BytesCodec).await.expect("echoed");
            let encoding = reply.metadata().get("grpc-encoding").map(|v| v.to_str().unwrap_or("?").to_owned());
            assert_eq!(encoding.as_deref(), accepts.then_some("gzip"), "{addr}, accepts gzip: {accepts}");
            assert!(reply.into_inner() == message, "the echo differs");
        }
        // isthmus's own HTTP/2 client reads them too.
        let ch = Channel::builder(&addr).upgrade(false).connect().await.expect("connect");
        let reply = ch.unary("/test.Echo/Unary", &message, CallOptions::default()).await.expect("echoed");
        assert!(reply.message == message, "isthmus's client: the echo differs");
    });
}

#[test]
fn a_handler_chooses_how_its_replies_are_compressed() {
    // `ServerCall::set_compression` (grpcio's `context.set_compression`): over HTTP/2 the
    // handler's choice replaces the server's, for a client whose grpc-accept-encoding lists it;
    // too late once initial metadata went; over shm:// it changes nothing on the wire.
    use isthmus::Compression::{Deflate, Gzip};
    use tonic::codec::CompressionEncoding;
    fn choose(call: &mut isthmus::ServerCall) {
        let choice = match call.metadata().get("want") {
            Some("gzip") => Some(Some(Gzip)),
            Some("deflate") => Some(Some(Deflate)),
            Some("identity") => Some(None),
            _ => None,
        };
        if let Some(choice) = choice {
            assert!(call.set_compression(choice), "a choice before any reply is taken");
        }
    }
    let shm = fresh_addr("compress");
    let topic = isthmus::Topic::new("compressed");
    let message = bytes::Bytes::from(pattern(4096, 5).repeat(16));
    topic.publish_state(&message);
    run(async move {
        let bound = isthmus::Server::builder()
            .handler("/test.Echo/Chosen", |mut call: isthmus::ServerCall| async move {
                choose(&mut call);
                let m = call.recv().await?.unwrap_or_default();
                if call.metadata().get("forge").is_some() {
                    // A handler's own metadata of the engine's key chooses nothing.
                    let mut md = MetadataMap::new();
                    md.append("x-isthmus-reply-encoding", "identity").expect("ascii");
                    call.send_headers(md).await?;
                }
                if call.metadata().get("stream").is_some() {
                    call.send(&m).await?;
                    return call.send(&m).await;
                }
                if call.metadata().get("small").is_some() {
                    // Small enough for the one-frame reply, which a choice must not skip.
                    return call.send_last(&m[..100]).await;
                }
                call.send_last(&m).await
            })
            .handler("/test.Echo/Topic", move |mut call: isthmus::ServerCall| {
                let topic = topic.clone();
                async move {
                    choose(&mut call);
                    topic.serve(&mut call).await
                }
            })
            .handler("/test.Echo/Late", |mut call: isthmus::ServerCall| async move {
                let m = call.recv().await?.unwrap_or_default();
                call.send_headers(MetadataMap::new()).await?;
                let mut trailers = MetadataMap::new();
                trailers.append("late-choice-taken", &call.set_compression(Some(Gzip)).to_string()).expect("ascii");
                call.set_trailers(trailers);
                call.send(&m).await
            })
            .send_compressed(Gzip)
            .bind_all(["http://127.0.0.1:0", shm.as_str()])
            .expect("bind");
        let http = bound.http_addresses().into_iter().next().expect("an HTTP/2 address");
        tokio::spawn(bound.serve());
        let channel =
            tonic::transport::Endpoint::from_shared(http.clone()).expect("uri").connect().await.expect("connect");
        let both: &[CompressionEncoding] = &[CompressionEncoding::Gzip, CompressionEncoding::Deflate];
        let gzip_only: &[CompressionEncoding] = &[CompressionEncoding::Gzip];
        // (path, the handler's choice, how it answers, what the client reads, the replies'
        // encoding)
        type Case<'a> = (&'a str, Option<&'a str>, &'a str, &'a [CompressionEncoding], Option<&'a str>);
        let cases: [Case<'_>; 14] = [
            // The server's own choice, gzip, for a client that reads it, and none for one that
            // does not.
            ("/test.Echo/Chosen", None, "", both, Some("gzip")),
            ("/test.Echo/Chosen", None, "", &[], None),
            // The handler's choice replaces it, deflate or none at all: for a unary reply, a
            // streamed one, a small one (one frame where no choice is pending), a topic's.
            ("/test.Echo/Chosen", Some("deflate"), "", both, Some("deflate")),
            ("/test.Echo/Chosen", Some("deflate"), "stream", both, Some("deflate")),
            ("/test.Echo/Chosen", Some("identity"), "", both, None),
            ("/test.Echo/Chosen", Some("identity"), "stream", both, None),
            ("/test.Echo/Chosen", Some("gzip"), "stream", both, Some("gzip")),
            ("/test.Echo/Chosen", Some("deflate"), "small", both, Some("deflate")),
            ("/test.Echo/Chosen", Some("identity"), "small", both, None),
            ("/test.Echo/Topic", Some("identity"), "topic", both, None),
            ("/test.Echo/Topic", Some("deflate"), "topic", both, Some("deflate")),
            // A choice the client cannot read: uncompressed, which every client reads.
            ("/test.Echo/Chosen", Some("deflate"), "", gzip_only, None),
            // The engine's key in a handler's own metadata chooses nothing.
            ("/test.Echo/Chosen", None, "forge", both, Some("gzip")),
            // After the initial metadata the choice is refused, and the server's stands.
            ("/test.Echo/Late", None, "", both, Some("gzip")),
        ];
        for (path, want, how, accepts, expected) in cases {
            let case = format!("{path}, want {want:?}, {how:?}, accepts {accepts:?}");
            let mut grpc = tonic::client::Grpc::new(channel.clone());
            for &e in accepts {
                grpc = grpc.accept_compressed(e);
            }
            grpc.ready().await.expect("ready");
            let mut request = tonic::Request::new(message.clone());
            if let Some(want) = want {
                request.metadata_mut().insert("want", want.parse().expect("ascii"));
            }
            if !how.is_empty() {
                request.metadata_mut().insert(how, "1".parse().expect("ascii"));
            }
            let late_path = path == "/test.Echo/Late";
            let path = http::uri::PathAndQuery::from_static(path);
            let text = |md: &tonic::metadata::MetadataMap, key: &str| {
                md.get(key).map(|v| v.to_str().unwrap_or("?").to_owned())
            };
            let (encoding, late, leaked) = if how == "topic" {
                // The topic's state, the first message of a stream that goes on.
                let reply = grpc.server_streaming(request, path, isthmus::BytesCodec).await.expect("subscribed");
                let md = reply.metadata().clone();
                let first = reply.into_inner().message().await.expect("a message").expect("the state");
                assert!(first == message, "{case}: the topic's state differs");
                (text(&md, "grpc-encoding"), None, text(&md, "x-isthmus-reply-encoding"))
            } else {
                let reply = grpc.unary(request, path, isthmus::BytesCodec).await.expect("echoed");
                let md = reply.metadata().clone();
                let echoed = reply.into_inner();
                let whole = echoed.len() % message.len() == 0 && echoed.starts_with(&message);
                assert!(whole || (how == "small" && echoed == message[..100]), "{case}: the echo differs");
                (text(&md, "grpc-encoding"), text(&md, "late-choice-taken"), text(&md, "x-isthmus-reply-encoding"))
            };
            assert!(leaked.is_none(), "{case}: the bridge's own metadata reached the client: {leaked:?}");
            assert_eq!(encoding.as_deref(), expected, "{case}");
            if late_path {
                assert_eq!(late.as_deref(), Some("false"), "{case}: a choice after the initial metadata");
            }
        }
        // Over shm:// the choice is taken and nothing about it reaches the client, nor the key
        // from a handler's own metadata.
        let ch = Channel::builder(&shm).connect().await.expect("connect");
        for (want, how) in [("gzip", ""), ("identity", "small"), ("gzip", "forge")] {
            let mut md = MetadataMap::new();
            md.append("want", want).expect("ascii");
            if !how.is_empty() {
                md.append(how, "1").expect("ascii");
            }
            let opts = CallOptions { metadata: md, ..CallOptions::default() };
            let reply = ch.unary("/test.Echo/Chosen", &message, opts).await.expect("echoed over shm://");
            let expected = if how == "small" { &message[..100] } else { &message[..] };
            assert!(reply.message == expected, "shm://, want {want}, {how:?}: the echo differs");
            assert!(reply.metadata.get("x-isthmus-reply-encoding").is_none(), "shm://: {:?}", reply.metadata);
        }
    });
}

#[test]
fn a_handed_calls_choice_of_compression_made_while_the_call_is_held_waits_for_its_first_send() {
    // `HandedCall::set_compression` never waits: an event loop's thread may choose while the
    // loop's own operation holds the call, here an `alloc` waiting for room in a full arena.
    // The choice is kept for the first send, not refused.
    use std::future::Future;
    use std::task::{Context, Waker};
    const BLOCK: usize = 4 << 20;
    run(async move {
        let bound = isthmus::Server::builder()
            .handler("/test.Echo/Held", |call: isthmus::ServerCall| {
                isthmus::binding::hand_off(call, |handed| {
                    tokio::spawn(async move {
                        let mut held = Vec::new();
                        while let Some(block) = handed.try_alloc(BLOCK).expect("alloc") {
                            held.push(block);
                        }
                        assert!(!held.is_empty(), "the arena took some blocks");
                        // Polled once: it holds the call and waits for room.
                        let mut waiting = Box::pin(handed.alloc(BLOCK));
                        let pending = waiting.as_mut().poll(&mut Context::from_waker(Waker::noop())).is_pending();
                        assert!(pending, "the arena is full");
                        let taken = handed.set_compression(Some(isthmus::Compression::Deflate));
                        drop(waiting);
                        drop(held);
                        if !taken {
                            handed.finish(isthmus::Status::new(Code::FailedPrecondition, "the choice was refused"));
                            return;
                        }
                        let sent = handed.send(&pattern(64 << 10, 3)).await;
                        handed.finish(sent.err().unwrap_or_else(|| isthmus::Status::new(Code::Ok, "")));
                    });
                    Ok(())
                })
            })
            .bind_all(["http://127.0.0.1:0"])
            .expect("bind");
        let http = bound.http_addresses().into_iter().next().expect("an HTTP/2 address");
        tokio::spawn(bound.serve());
        let channel = tonic::transport::Endpoint::from_shared(http).expect("uri").connect().await.expect("connect");
        let mut grpc = tonic::client::Grpc::new(channel)
            .accept_compressed(tonic::codec::CompressionEncoding::Deflate)
            .max_decoding_message_size(1 << 20);
        grpc.ready().await.expect("ready");
        let path = http::uri::PathAndQuery::from_static("/test.Echo/Held");
        let reply =
            grpc.unary(tonic::Request::new(bytes::Bytes::new()), path, isthmus::BytesCodec).await.expect("a reply");
        let encoding = reply.metadata().get("grpc-encoding").map(|v| v.to_str().unwrap_or("?").to_owned());
        assert_eq!(encoding.as_deref(), Some("deflate"), "the choice reached the reply");
        assert!(reply.into_inner() == pattern(64 << 10, 3), "the reply differs");
    });
}

/// A call whose answer comes late waits asleep: it may read the connection for its spin, then
/// leaves the reading to the reader task. A fruitless read once led to another (the reader task,
/// asked for the receiver, woke the asking call as it gave the receiver back), and a stream
/// waiting for its next message could go on asking and spinning until it came: 37-122 ms of CPU
/// over the 500 ms this test waits, where a wait asleep costs 0-1 ms. The client is a process of
/// its own (`idle-client`), so the CPU it reports is its own, whatever else the host runs.
#[test]
fn a_call_waiting_for_a_late_answer_spends_no_cpu_meanwhile() {
    let (_server, addr) = server();
    let mut client = Peer::spawn_bin("idle-client", &[&addr]);
    for kind in ["unary", "stream"] {
        let line = client.expect_line("WAITED ", Duration::from_secs(60));
        let f: Vec<&str> = line.split_whitespace().collect();
        let (wall_ms, cpu_ms): (u64, u64) = (f[2].parse().expect("wall"), f[3].parse().expect("cpu"));
        assert_eq!(f[1], kind, "{line}");
        assert!(wall_ms >= 400, "the answers came sooner than the server sends them: {line}");
        // A twentieth of the wall time: 20 times what a wait asleep costs here.
        assert!(cpu_ms * 20 < wall_ms, "a {kind} call used {cpu_ms} ms of CPU while it waited {wall_ms} ms: {line}");
    }
    client.expect_line("DONE", Duration::from_secs(30));
}

/// A server, and a client of the spec that speaks raw frames to it.
fn raw_client() -> (Peer, isthmus_shm::Connection) {
    let (server, addr) = server();
    let addr: isthmus_shm::Address = addr.parse().expect("address");
    (server, isthmus_shm::Connection::connect(&addr, &isthmus_shm::Config::default()).expect("connect"))
}

fn patience_30s() -> Option<Instant> {
    Some(Instant::now() + Duration::from_secs(30))
}

/// A peer that keeps writing into the server's ring while it reads nothing of its own (a peer of
/// the spec: isthmus itself sends no PINGs): the server's answers that find no ring room wait
/// while its reader reads on, so the peer's writes go through, and every answer comes, in
/// order, once the peer reads. Before, the reader waited for room for its first answer that
/// had none, reading nothing meanwhile, and both rings stayed full.
#[test]
fn a_server_reads_on_while_its_answers_wait_for_ring_room() {
    use isthmus_shm::{flags, Kind};
    let (_server, mut c) = raw_client();
    // 48 PINGs of 60 KiB, and as many answers: 2.8 MiB each way, past both 1 MiB rings.
    let (pings, len) = (48, 60 << 10);
    for i in 0..pings {
        let patience = Some(Instant::now() + Duration::from_secs(30));
        let sent = c.sender.send(Kind::Ping, 0, 0, &pattern(len, i), patience);
        sent.unwrap_or_else(|e| panic!("PING {i} of {pings}: {e}"));
    }
    for i in 0..pings {
        let f = c.receiver.recv(Some(Instant::now() + Duration::from_secs(30))).expect("an answer");
        assert_eq!((f.kind, f.flags), (Kind::Ping, flags::ACK));
        assert!(f.body[..] == pattern(len, i)[..], "answer {i} comes in order");
    }
}

/// A peer that asks for more answers than the server keeps for it while it reads nothing of
/// ours (120 PINGs of 60 KiB: 1 MiB of answers fits the ring, 4 MiB the queue): the answers past
/// the bound are dropped and counted (`ConnectionCounters::answers_dropped`), those kept come
/// in order, and the connection goes on.
#[test]
fn answers_past_the_queue_bound_are_dropped_and_counted() {
    use isthmus::wire;
    use isthmus_shm::{flags, Kind};
    let (_server, mut c) = raw_client();
    let (pings, len) = (120, 60 << 10);
    for i in 0..pings {
        c.sender.send(Kind::Ping, 0, 0, &pattern(len, i), patience_30s()).expect("PING");
    }
    // The server reads every PING before this call, so its count is final when the call reads it.
    let head = wire::encode_request_head("/test.Admin/Counters", None, &MetadataMap::new());
    c.sender.send(Kind::Headers, 0, 1, &head, patience_30s()).expect("HEADERS");
    c.sender.send_message(1, flags::END_STREAM, b"", patience_30s()).expect("MESSAGE");
    let (mut acks, mut text, mut dropped) = (0u64, String::new(), None);
    // Which answers are dropped depends on when the server reads (while this client reads the
    // first answers, the queue has room again), but those that come, come in order.
    let mut next = 0;
    while dropped.is_none_or(|d| acks + d < pings) {
        let f = c.receiver.recv(patience_30s()).expect("an answer");
        match (f.kind, f.stream) {
            (Kind::Ping, 0) => {
                assert_eq!(f.flags, flags::ACK);
                let k = (next..pings).find(|&k| f.body[..] == pattern(len, k)[..]);
                next = 1 + k.unwrap_or_else(|| panic!("answer {acks} is none of PINGs {next} to {pings}, in order"));
                acks += 1;
            }
            (Kind::Message, 1) => text.push_str(&String::from_utf8_lossy(&f.body)),
            (Kind::Trailers, 1) => {
                let field = text.split([' ', '\n']).find_map(|f| f.strip_prefix("answers_dropped="));
                dropped = Some(field.and_then(|n| n.parse::<u64>().ok()).unwrap_or_else(|| panic!("{text}")));
            }
            (Kind::Headers | Kind::Window, 1) => {}
            (kind, stream) => panic!("unexpected {kind:?} on stream {stream}"),
        }
    }
    let dropped = dropped.unwrap_or_default();
    println!("{acks} answers, {dropped} dropped");
    assert!(dropped > 0 && acks + dropped == pings, "{acks} answers, {dropped} dropped");
    c.sender.send(Kind::Ping, 0, 0, b"after", patience_30s()).expect("PING");
    let f = c.receiver.recv(patience_30s()).expect("an answer");
    assert_eq!((f.kind, &f.body[..]), (Kind::Ping, &b"after"[..]), "the connection goes on");
}

/// Credit a server's handler gives back while the ring to its client is full goes out once the
/// client reads, though the handler, waiting for the next message, does nothing meanwhile. A
/// client of the spec (raw frames) fills that ring with PING answers it does not read, then
/// streams 40 messages of 64 KiB (over half the 4 MiB window) and stops, as a writer out of
/// credit would. Before, the grant was taken back to go with the handler's next read or send,
/// which never came: the client waited for credit until its deadline.
#[test]
fn credit_granted_while_the_ring_is_full_goes_out_once_the_peer_reads() {
    use isthmus::wire;
    use isthmus_shm::layout::{self, CLIENT_TO_SERVER};
    use isthmus_shm::Kind;
    let (_server, mut c) = raw_client();
    let patience = patience_30s;
    // Each answer takes 64 KiB of the ring with its header: 16 fill the 1 MiB ring to the byte.
    let (pings, len) = (20, (64 << 10) - 16);
    for i in 0..pings {
        c.sender.send(Kind::Ping, 0, 0, &pattern(len, i), patience()).expect("PING");
    }
    let head = wire::encode_request_head("/test.Echo/ClientStream", None, &MetadataMap::new());
    c.sender.send(Kind::Headers, 0, 1, &head, patience()).expect("HEADERS");
    for i in 0..40 {
        c.sender.send_message(1, 0, &pattern(64 << 10, i), patience()).expect("MESSAGE");
    }
    // The handler has taken all 40 (each block comes back once its message is dropped) and
    // waits for the next; a moment more for that wait to begin, so that the old code's last
    // try to grant came before we read.
    let released = || c.sender.control_word_for_tests(CLIENT_TO_SERVER, layout::CTL_REL_TAIL).expect("word");
    let end = Instant::now() + Duration::from_secs(30);
    while released() < 40 {
        assert!(Instant::now() < end, "the handler took {} of 40 messages", released());
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(100));
    let (mut answers, mut granted) = (0, 0);
    while granted == 0 {
        let f = c.receiver.recv(patience()).expect("the PING answers, then credit");
        match f.kind {
            Kind::Ping => answers += 1,
            Kind::Window if f.stream == 1 => granted = wire::decode_window(&f.body).expect("WINDOW"),
            other => panic!("unexpected {other:?} on stream {}", f.stream),
        }
    }
    assert_eq!(answers, pings, "every PING answered before the grant that waited behind them");
    assert!(granted >= 2 << 20, "half a window or more: {granted}");
}

/// A client of the spec (raw frames) that writes past a stream's flow-control window, to a
/// handler that reads nothing and so gives no credit back: the server ends that call (a CANCEL
/// with INTERNAL) and only that call; the connection serves the next.
#[test]
fn a_peer_past_its_window_ends_its_call_and_only_that_call() {
    use isthmus::wire;
    use isthmus_shm::Kind;
    let (_server, mut c) = raw_client();
    let patience = patience_30s;
    let head = wire::encode_request_head("/test.Echo/Stall", None, &MetadataMap::new());
    c.sender.send(Kind::Headers, 0, 1, &head, patience()).expect("HEADERS");
    // The window is 4 MiB: 64 messages of 64 KiB fill it, the 65th is past it.
    for i in 0..65 {
        c.sender.send_message(1, 0, &pattern(64 << 10, i), patience()).expect("MESSAGE");
    }
    let f = c.receiver.recv(patience()).expect("the server's answer to stream 1");
    assert_eq!((f.kind, f.stream), (Kind::Cancel, 1), "no credit from a handler that reads nothing");
    assert_eq!(wire::decode_cancel(&f.body).expect("a CANCEL's code"), Code::Internal);

    serves_on_and_ends_stream_1_once(&mut c, "internal=1");
}

/// Malformed input from a client (a HEADERS whose body is no request head) ends that client's
/// connection with a GOAWAY that names the fault, and nothing else: the server serves the next
/// client.
#[test]
fn a_malformed_headers_ends_its_connection_with_a_goaway_that_names_it() {
    use isthmus::wire;
    use isthmus_shm::Kind;
    let (server, addr) = server();
    let shm: isthmus_shm::Address = addr.parse().expect("address");
    let mut c = isthmus_shm::Connection::connect(&shm, &isthmus_shm::Config::default()).expect("connect");
    // Version 1, then a path whose length runs past the body.
    c.sender.send(Kind::Headers, 0, 1, b"\x01\x00\xff\xffnot a request head", patience_30s()).expect("HEADERS");
    let f = c.receiver.recv(patience_30s()).expect("a GOAWAY");
    assert_eq!(f.kind, Kind::GoAway, "{f:?}");
    let g = wire::GoAway::decode(&f.body).expect("a GOAWAY body");
    assert!(g.message.contains("a fault ends this connection: malformed frame"), "{}", g.message);
    let e = c.receiver.recv(patience_30s()).expect_err("then the end");
    assert_eq!(e.kind(), isthmus_shm::ErrorKind::PeerGone, "{e}");

    let mut next = isthmus_shm::Connection::connect(&shm, &isthmus_shm::Config::default()).expect("reconnect");
    serves_on_and_ends_stream_1_once(&mut next, "started=");
    drop(server);
}

/// A HEADERS that crosses the server's GOAWAY (sent after it, by a client that had not read
/// it yet) is refused with TRAILERS UNAVAILABLE and runs no handler, so the client may retry it
/// elsewhere (protocol 13.7, GOAWAY).
#[test]
fn a_headers_that_crosses_a_goaway_is_refused_unavailable() {
    use isthmus::wire;
    use isthmus_shm::{flags, Kind};
    let (mut server, addr) = server();
    let shm: isthmus_shm::Address = addr.parse().expect("address");
    let mut c = isthmus_shm::Connection::connect(&shm, &isthmus_shm::Config::default()).expect("connect");
    // A call in flight, which keeps the server draining for its grace period.
    let head = wire::encode_request_head("/test.Echo/Sleep", None, &MetadataMap::new());
    c.sender.send(Kind::Headers, 0, 1, &head, patience_30s()).expect("HEADERS");
    server.expect_line("SLEEPING", Duration::from_secs(30));
    let admin = isthmus::blocking::Channel::connect(&addr).expect("connect");
    admin.unary("/test.Admin/Shutdown", b"", CallOptions::default()).expect("shutdown starts");
    loop {
        let f = c.receiver.recv(patience_30s()).expect("the GOAWAY");
        match f.kind {
            Kind::GoAway => break,
            Kind::Headers | Kind::Window => assert_eq!(f.stream, 1, "{f:?}"),
            other => panic!("{other:?} on stream {} before the GOAWAY", f.stream),
        }
    }
    let head = wire::encode_request_head("/test.Echo/Unary", None, &MetadataMap::new());
    c.sender.send(Kind::Headers, 0, 3, &head, patience_30s()).expect("HEADERS after the GOAWAY");
    c.sender.send_message(3, flags::END_STREAM, b"late", patience_30s()).expect("its MESSAGE");
    let f = c.receiver.recv(patience_30s()).expect("the refusal");
    assert_eq!((f.kind, f.stream), (Kind::Trailers, 3), "{f:?}");
    let status = wire::decode_trailers(&f.body).expect("trailers");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    // The reader's refusal, before any handler: no call was opened for it.
    assert!(status.message().contains("shutting down and takes no new calls"), "{status:?}");
}

/// A raw client's request over the server's `max_message_size`: TRAILERS with
/// RESOURCE_EXHAUSTED naming both sizes end that call, once, and the connection goes on.
#[test]
fn a_request_too_large_from_a_raw_client_ends_its_call_once() {
    use isthmus::wire;
    use isthmus_shm::Kind;
    let addr = fresh_addr("raw-large");
    let _server = Peer::spawn_bin("rpc-peer", &[&addr, "1024"]);
    let addr: isthmus_shm::Address = addr.parse().expect("address");
    let mut c = isthmus_shm::Connection::connect(&addr, &isthmus_shm::Config::default()).expect("connect");
    let head = wire::encode_request_head("/test.Echo/Stall", None, &MetadataMap::new());
    c.sender.send(Kind::Headers, 0, 1, &head, patience_30s()).expect("HEADERS");
    c.sender.send_message(1, 0, &pattern(2048, 1), patience_30s()).expect("MESSAGE");
    let f = c.receiver.recv(patience_30s()).expect("the server's answer to stream 1");
    assert_eq!((f.kind, f.stream), (Kind::Trailers, 1));
    let status = wire::decode_trailers(&f.body).expect("trailers");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("2048") && status.message().contains("1024"), "{status:?}");
    serves_on_and_ends_stream_1_once(&mut c, "resource_exhausted=1");
}

/// The connection serves the next calls, and nothing more comes on stream 1, whose call the
/// server ended: its handler, stopped, sends no second end. The handler's task counts the call
/// (`counted`, in `/test.Admin/Counters`) as it ends, so once the count shows it, one more
/// call's answer comes after anything that task sent.
fn serves_on_and_ends_stream_1_once(c: &mut isthmus_shm::Connection, counted: &str) {
    use isthmus::wire;
    use isthmus_shm::{flags, Kind};
    let mut unary = |stream: u64, path: &str, body: &[u8]| {
        let head = wire::encode_request_head(path, None, &MetadataMap::new());
        c.sender.send(Kind::Headers, 0, stream, &head, patience_30s()).expect("HEADERS");
        c.sender.send_message(stream, flags::END_STREAM, body, patience_30s()).expect("MESSAGE");
        let mut answer = Vec::new();
        loop {
            let f = c.receiver.recv(patience_30s()).expect("an answer");
            match (f.kind, f.stream) {
                (Kind::Message, s) if s == stream => answer.extend_from_slice(&f.body),
                (Kind::Trailers, s) if s == stream => {
                    let status = wire::decode_trailers(&f.body).expect("trailers");
                    assert_eq!(status.code(), Code::Ok, "{status:?}");
                    return String::from_utf8_lossy(&answer).into_owned();
                }
                (Kind::Headers | Kind::Window, s) if s == stream => {}
                (kind, s) => panic!("{kind:?} on stream {s} during the call on stream {stream}"),
            }
        }
    };
    assert_eq!(unary(3, "/test.Echo/Unary", b"next"), "next");
    let mut stream = 5;
    while !unary(stream, "/test.Admin/Counters", b"").contains(counted) {
        stream += 2;
        assert!(stream < 20_000, "the broken call never finished");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(unary(stream + 2, "/test.Echo/Unary", b"last"), "last");
}

/// A channel whose reader task's runtime shut down: its connection counts as dead (the reader's
/// `Watch` guard), so a call from another runtime is made on a new connection (its counters
/// start afresh) rather than on one whose replies nobody reads.
#[test]
fn a_channel_whose_runtime_shut_down_calls_on_a_new_connection() {
    let (_server, addr) = server();
    let first = runtime();
    let channel = first.block_on(async {
        let channel = Channel::connect(&addr).await.expect("connect");
        let r = channel.unary("/test.Echo/Unary", b"one", CallOptions::default()).await.expect("a call");
        assert_eq!(&r.message[..], b"one");
        channel
    });
    first.shutdown_timeout(Duration::from_secs(10));
    run(async move {
        let options = CallOptions { timeout: Some(Duration::from_secs(60)), ..Default::default() };
        let r = channel.unary("/test.Echo/Unary", b"two", options).await.expect("a call on a new connection");
        assert_eq!(&r.message[..], b"two");
        let counters = channel.counters();
        assert_eq!(counters.calls_started, 1, "the old connection carried it: {counters:?}");
    });
}

/// A handler that blocks its thread before its first `.await` holds up its connection's reader
/// only until the server has seen it do so: its next calls become tasks of their own, and other
/// calls on the same connection are read and answered while one of them blocks.
#[test]
fn a_handler_that_blocks_its_thread_stops_holding_up_its_connection() {
    let (_server, addr) = server();
    run(async move {
        let ch = Channel::connect(&addr).await.expect("connect");
        let hog = |mode: &str| {
            let mut md = MetadataMap::new();
            md.append("x-hog", mode).expect("ascii");
            CallOptions { metadata: md, timeout: Some(Duration::from_secs(60)), ..CallOptions::default() }
        };
        // Seen blocking its thread for 20 ms in its first poll.
        let r = ch.unary("/test.Echo/Hog", b"", hog("sleep:20")).await.expect("the first hog");
        assert_eq!(&r.message[..], b"slept");
        // Blocks a server thread until the Release below has run; Release goes on the same
        // connection, and is read only if the hog's call is not on the reader.
        let waits = ch.unary("/test.Echo/Hog", b"", hog("until-released"));
        let releases = async {
            for _ in 0..1_000 {
                let r = ch.unary("/test.Admin/Release", b"", with_timeout(30_000)).await.expect("release");
                if &r.message[..] == b"released" {
                    return true;
                }
                tokio::time::sleep(Duration::from_millis(10)).await; // the hog has not begun to wait
            }
            false
        };
        let (waited, released) = tokio::join!(waits, releases);
        assert!(released, "no Hog call was seen waiting");
        assert_eq!(&waited.expect("the blocking hog").message[..], b"released");
    });
}

#[test]
fn an_async_channels_handshake_slower_than_the_calls_deadline_still_connects_it() {
    // As the blocking channel's (`rpc_blocking`): a stopped server answers the handshake only
    // once it goes on, after the call's deadline; the attempt goes on and connects the channel.
    let (server, addr) = server();
    run(async move {
        // A handshake timeout long enough for a loaded machine.
        let config = isthmus::Config { handshake_timeout: Duration::from_secs(60), ..isthmus::Config::default() };
        let ch = Channel::builder(&addr).config(config).upgrade(false).connect_lazy().expect("lazy channel");
        server.stop();
        let s = ch.unary("/test.Echo/Unary", b"x", with_timeout(100)).await.expect_err("no handshake in 100 ms");
        assert_eq!(s.code(), Code::DeadlineExceeded, "{s}");
        server.resume(); // within the handshake's timeout
        let began = Instant::now();
        while ch.connectivity(false) != Connectivity::Ready && began.elapsed() < Duration::from_secs(30) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(ch.connectivity(false), Connectivity::Ready, "the attempt the call began connected the channel");
        let r = ch.unary("/test.Echo/Unary", b"after", with_timeout(10_000)).await.expect("a call now");
        assert_eq!(&r.message[..], b"after");
    });
}

#[test]
fn a_malformed_grpc_timeout_or_binary_value_fails_the_call_internal_whatever_serves_it() {
    // grpc-go's server answers INTERNAL for both ("malformed grpc-timeout", "malformed binary
    // metadata"). The handlers behind the HTTP/2 endpoint answered INVALID_ARGUMENT, and its
    // tonic services (the health service here) ran the call with no deadline at all.
    let (_server, addrs) = server_everywhere("malformed");
    let host = addrs.iter().find_map(|a| a.strip_prefix("http://")).expect("an http:// address").to_owned();
    run(async move {
        let tcp = tokio::net::TcpStream::connect(&host).await.expect("connect");
        let (mut client, connection) = h2::client::handshake(tcp).await.expect("HTTP/2 handshake");
        tokio::spawn(connection);
        let malformed = [("grpc-timeout", "5x"), ("grpc-timeout", "123456789S"), ("x-trace-bin", "not base64!")];
        for path in ["/test.Echo/Unary", "/grpc.health.v1.Health/Check"] {
            for (key, value) in malformed {
                let request = http::Request::post(format!("http://{host}{path}"))
                    .header("content-type", "application/grpc")
                    .header("te", "trailers")
                    .header(key, value)
                    .body(())
                    .expect("request");
                // No body: the call is refused on its headers (a body sent after them raced the
                // refusal's end of the stream).
                let (response, _send) = client.send_request(request, true).expect("send");
                let response = response.await.expect("the response's headers");
                let (head, mut body) = response.into_parts();
                // Trailers-only, or trailers after the headers.
                let status = match head.headers.get("grpc-status") {
                    Some(s) => s.clone(),
                    None => {
                        while body.data().await.is_some() {}
                        let trailers = body.trailers().await.expect("trailers").expect("some");
                        trailers.get("grpc-status").expect("grpc-status").clone()
                    }
                };
                assert_eq!(status, "13", "{path} with {key}: {value}: INTERNAL");
            }
        }
    });
}

/// The status, and the response if it carries one, of the call on stream 1 of a raw client,
/// read to its TRAILERS (or its CANCEL, as a status with its code).
fn raw_outcome(c: &mut isthmus_shm::Connection) -> (isthmus::Status, Vec<u8>) {
    use isthmus::wire;
    use isthmus_shm::Kind;
    let mut reply = Vec::new();
    loop {
        let f = c.receiver.recv(patience_30s()).expect("an answer");
        match (f.kind, f.stream) {
            (Kind::Message, 1) => reply.extend_from_slice(&f.body),
            (Kind::Trailers, 1) if f.flags & wire::WITH_MESSAGE != 0 => {
                let (status, at) = wire::decode_trailers_prefix(&f.body).expect("trailers");
                reply.extend_from_slice(&f.body[at..]);
                return (status, reply);
            }
            (Kind::Trailers, 1) => return (wire::decode_trailers(&f.body).expect("trailers"), reply),
            (Kind::Cancel, 1) => {
                let code = wire::decode_cancel(&f.body).expect("cancel");
                return (isthmus::Status::new(code, "CANCEL"), reply);
            }
            (Kind::Headers | Kind::Window, _) | (Kind::Ping, 0) => {}
            (kind, stream) => panic!("unexpected {kind:?} on stream {stream}"),
        }
    }
}

/// A client of the spec may open a call half-closed: END_STREAM on its HEADERS and no request
/// (a client stream of none). Its handler's first read ends the requests. Before, the flag was
/// read only to tell a one-frame call, and the handler waited for a half-close that had come,
/// until the call's deadline.
#[test]
fn a_call_opened_half_closed_has_no_requests() {
    use isthmus::wire;
    use isthmus_shm::{flags, Kind};
    let (_server, mut c) = raw_client();
    let timeout = Some(Duration::from_secs(20));
    let head = wire::encode_request_head("/test.Echo/ClientStream", timeout, &MetadataMap::new());
    c.sender.send(Kind::Headers, flags::END_STREAM, 1, &head, patience_30s()).expect("HEADERS");
    let (status, reply) = raw_outcome(&mut c);
    assert_eq!(status.code(), Code::Ok, "{status:?}");
    assert_eq!(reply, [0u8; 16], "no requests, no bytes");
}

/// A client that sends on a stream it half-closed breaks that call (as a frame after
/// END_STREAM breaks an HTTP/2 stream): the server ends it INTERNAL with a CANCEL, and the
/// connection goes on. Before, the message was queued for a handler that would never read it
/// (`Sleep` read the half-close, then waits): the call went on, holding it.
#[test]
fn a_message_after_the_half_close_breaks_its_call_only() {
    use isthmus::wire;
    use isthmus_shm::{flags, Kind};
    let (_server, mut c) = raw_client();
    let head = wire::encode_request_head("/test.Echo/Sleep", None, &MetadataMap::new());
    c.sender.send(Kind::Headers, 0, 1, &head, patience_30s()).expect("HEADERS");
    c.sender.send(Kind::Trailers, flags::END_STREAM, 1, b"", patience_30s()).expect("TRAILERS");
    c.sender.send_message(1, 0, b"late", patience_30s()).expect("MESSAGE");
    let (status, _) = raw_outcome(&mut c);
    assert_eq!(status.code(), Code::Internal, "{status:?}");
    c.sender.send(Kind::Ping, 0, 0, b"after", patience_30s()).expect("PING");
    let f = c.receiver.recv(patience_30s()).expect("an answer");
    assert_eq!((f.kind, &f.body[..]), (Kind::Ping, &b"after"[..]), "the connection goes on");
}

/// Resident memory of process `pid`, in bytes.
fn resident(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let kib = status.lines().find_map(|l| l.strip_prefix("VmRSS:")).expect("VmRSS");
    kib.trim().trim_end_matches("kB").trim().parse::<u64>().expect("a number") << 10
}

/// A client that half-closes again and again, on a call whose handler no longer reads (as a
/// topic's subscriber's), costs the server nothing: a half-close counts once. Before, each of
/// a million 16-byte TRAILERS queued an event for the call: 46 MiB of the server's memory here.
#[test]
fn a_half_close_repeated_a_million_times_takes_no_memory() {
    use isthmus::wire;
    use isthmus_shm::{flags, Kind};
    let (server, mut c) = raw_client();
    let head = wire::encode_request_head("/test.Echo/Sleep", None, &MetadataMap::new());
    c.sender.send(Kind::Headers, 0, 1, &head, patience_30s()).expect("HEADERS");
    // The server has read all before the PING's answer.
    let settled = |c: &mut isthmus_shm::Connection| {
        c.sender.send(Kind::Ping, 0, 0, b"settled", patience_30s()).expect("PING");
        loop {
            let f = c.receiver.recv(patience_30s()).expect("an answer");
            if f.kind == Kind::Ping {
                break;
            }
        }
    };
    settled(&mut c);
    let before = resident(server.child.id());
    for _ in 0..1_000_000 {
        c.sender.send(Kind::Trailers, flags::END_STREAM, 1, b"", patience_30s()).expect("TRAILERS");
    }
    settled(&mut c);
    let grown = resident(server.child.id()).saturating_sub(before);
    println!("a million half-closes grew the server by {} KiB", grown >> 10);
    assert!(grown < 16 << 20, "a million half-closes grew the server by {} MiB", grown >> 20);
}

/// A message in pieces whose call ends here while its pieces go (its `CallSender` sends on
/// after the call is dropped) leaves the server holding no part of it: the pieces after the
/// call's CANCEL began a message the server held for the connection's life (one of its few
/// places for messages in pieces, and the bytes), until a CANCEL after them ended it. The
/// server here is the test's, of raw frames, which counts what it holds.
#[test]
fn pieces_sent_after_a_calls_cancel_leave_the_server_holding_nothing() {
    use isthmus_shm::{Config, Connection, Kind, Listener};
    let addr = fresh_addr("pieces-cut");
    let listener = Listener::bind(&addr.parse().expect("address"), Config::default()).expect("bind");
    let (cut_tx, cut_rx) = std::sync::mpsc::channel::<()>();
    let (resume_tx, resume_rx) = std::sync::mpsc::channel::<()>();
    let client = std::thread::spawn(move || {
        run(async move {
            let ch = Channel::builder(&addr).upgrade(false).connect().await.expect("connect");
            let call = ch.start("/test.Echo/Bidi", CallOptions::default()).await.expect("start");
            let sender = call.sender();
            // 256 MiB: sixteen pieces of a quarter of the 64 MiB arena, four of which fill it; the
            // server reads the first few, then nothing until the call is dropped.
            let sending = tokio::spawn(async move { sender.send(&vec![7u8; 256 << 20], false).await });
            tokio::task::spawn_blocking(move || cut_rx.recv()).await.expect("join").expect("cut");
            drop(call); // its CANCEL goes now, while the pieces wait for arena room
            resume_tx.send(()).expect("resume");
            let _ = sending.await.expect("the send");
            // A second call: the server reads to its HEADERS, after all that came before.
            let mut next = ch.start("/test.Echo/Bidi", CallOptions::default()).await.expect("start");
            next.send(b"x").await.expect("send");
        })
    });
    let Connection { sender: _sender, mut receiver } = listener.accept().expect("accept");
    let patience = || Some(Instant::now() + Duration::from_secs(30));
    // Until the first pieces are in (`recv` would wait for the whole message): then the
    // others wait for arena room, which this side frees only as it reads.
    let start = Instant::now();
    while receiver.partial_messages() == 0 {
        assert!(start.elapsed() < Duration::from_secs(30), "no piece came");
        match receiver.try_recv().expect("a frame") {
            Some(f) => assert!(matches!(f.kind, Kind::Headers), "{:?} before the first piece", f.kind),
            None => std::thread::sleep(Duration::from_millis(1)),
        }
    }
    cut_tx.send(()).expect("cut");
    resume_rx.recv_timeout(Duration::from_secs(30)).expect("the call dropped");
    let mut cancels = 0;
    let next = loop {
        let f = receiver.recv(patience()).expect("a frame");
        match (f.kind, f.stream) {
            (Kind::Cancel, 1) => cancels += 1,
            (Kind::Headers, id) if id != 1 => break id,
            (kind, stream) => panic!("{kind:?} on stream {stream}"),
        }
    };
    assert!(cancels >= 1 && next > 1, "{cancels} CANCELs");
    assert_eq!(receiver.partial_messages(), 0, "a message in pieces held after its stream's end");
    client.join().expect("the client");
}

/// A call's `CallSender` stops at the call's deadline, whoever reads the responses: with no
/// reader, and a server that reads nothing (the test's, of raw frames), a send waiting for
/// credit ends then, and the call with it. It waited for ever: only the call's own reads
/// watched the deadline.
#[test]
fn a_call_sender_stops_at_its_calls_deadline() {
    use isthmus_shm::{Config, Listener};
    let addr = fresh_addr("sender-deadline");
    let listener = Listener::bind(&addr.parse().expect("address"), Config::default()).expect("bind");
    let accepting = std::thread::spawn(move || listener.accept().expect("accept"));
    run(async move {
        let ch = Channel::builder(&addr).upgrade(false).connect().await.expect("connect");
        let mut call = ch.start("/test.Echo/Anything", with_timeout(1000)).await.expect("start");
        let sender = call.sender();
        let message = vec![1u8; 1 << 20];
        let sends = async {
            let mut sent = 0u32;
            while sender.send(&message, false).await {
                sent += 1;
            }
            sent
        };
        let sent = tokio::time::timeout(Duration::from_secs(30), sends).await;
        let sent = sent.expect("the sender still waits 30 s past the call's 1 s deadline");
        assert!(sent >= 1, "the window's first message went");
        let status = call.recv().await.expect_err("the call ended");
        assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    });
    drop(accepting.join().expect("accept")); // the server's side, held until now
}

/// A blocking channel made inside a runtime that has ended since still sends the answers that
/// wait for ring room: its server (the test's, of raw frames) sends 48 PINGs of 60 KiB while
/// it reads nothing, so that most answers wait, then reads them all. They went to a task of the
/// runtime the connecting thread was inside, which never ran once it had ended: every answer
/// after the ring filled stayed queued for the connection's life.
#[test]
fn a_blocking_channel_made_in_an_ended_runtime_still_sends_its_waiting_answers() {
    use isthmus::{wire, Status};
    use isthmus_shm::{flags, Config, Connection, Kind, Listener};
    let addr = fresh_addr("ended-runtime");
    let listener = Listener::bind(&addr.parse().expect("address"), Config::default()).expect("bind");
    let accepting = std::thread::spawn(move || listener.accept().expect("accept"));
    let rt = runtime();
    let ch = {
        let _inside = rt.enter();
        isthmus::blocking::Channel::connect(&addr).expect("connect")
    };
    drop(rt);
    let Connection { sender, mut receiver } = accepting.join().expect("accept");
    // A call that waits for its answer, and so reads the connection.
    let calling = std::thread::spawn(move || ch.unary("/t.T/Wait", b"", with_timeout(60_000)));
    let patience = || Some(Instant::now() + Duration::from_secs(30));
    let stream = receiver.recv(patience()).expect("the call").stream;
    let (pings, len) = (48, 60 << 10);
    for i in 0..pings {
        sender.send(Kind::Ping, 0, 0, &pattern(len, i), patience()).expect("PING");
    }
    let mut acks = 0;
    while acks < pings {
        let f = receiver.recv(patience()).unwrap_or_else(|e| panic!("answer {acks} of {pings}: {e}"));
        match f.kind {
            Kind::Ping => {
                assert!(f.body[..] == pattern(len, acks)[..], "answer {acks} comes in order");
                acks += 1;
            }
            Kind::Message | Kind::Trailers => {} // the call's request, in a frame of its own
            kind => panic!("unexpected {kind:?}"),
        }
    }
    sender.send_message(stream, 0, b"done", patience()).expect("MESSAGE");
    let ok = wire::encode_trailers(&Status::ok());
    sender.send(Kind::Trailers, flags::END_STREAM, stream, &ok, patience()).expect("TRAILERS");
    let answered = calling.join().expect("the call").expect("answered");
    assert_eq!(&answered.message[..], b"done");
}
