//! The blocking client end to end, from plain threads with no async runtime in this process;
//! the server (`rpc-peer`) runs in another.

use std::time::{Duration, Instant};

use isthmus::blocking::Channel;
use isthmus::{CallOptions, Code, MetadataMap};
use isthmus_tests::{eventually, first_mismatch, fresh_addr, mix, pattern, Peer};

fn server() -> (Peer, String) {
    let addr = fresh_addr("blk");
    (Peer::spawn_bin("rpc-peer", &[&addr]), addr)
}

#[test]
fn every_call_shape_from_a_plain_thread() {
    let (_server, addr) = server();
    let ch = Channel::connect(&addr).expect("connect");

    let mut md = MetadataMap::new();
    md.append("x-echo", "hi").expect("ascii");
    md.append_bin("x-echo-bin", vec![1u8, 2, 255]).expect("binary");
    let r =
        ch.unary("/test.Echo/Unary", b"payload", CallOptions { metadata: md, ..Default::default() }).expect("unary");
    assert_eq!(&r.message[..], b"payload");
    assert_eq!(r.metadata.get("x-echo"), Some("head:hi"));
    assert_eq!(r.trailers.get_bin("x-echo-bin"), Some(&[1u8, 2, 255][..]));

    let mut call = ch.start("/test.Echo/ServerStream", CallOptions::default()).expect("start");
    let mut req = 300u32.to_le_bytes().to_vec();
    req.extend_from_slice(&(30_000u32).to_le_bytes());
    call.send_last(&req).expect("request");
    let mut n = 0u64;
    while let Some(m) = call.recv().expect("message") {
        assert_eq!((m.len(), first_mismatch(&m, n)), (30_000, None), "message {n}");
        n += 1;
    }
    assert_eq!(n, 300);

    let mut call = ch.start("/test.Echo/ClientStream", CallOptions::default()).expect("start");
    for i in 0..500u64 {
        call.send(&pattern(10_000, i)).expect("send");
    }
    call.close_send().expect("half-close");
    let reply = call.recv().expect("reply").expect("a message");
    assert_eq!(u64::from_le_bytes(reply[0..8].try_into().expect("u64")), 500);

    let mut call = ch.start("/test.Echo/Bidi", CallOptions::default()).expect("start");
    for i in 0..100u64 {
        let m = pattern(1 + (i as usize * 997) % 100_000, i);
        call.send(&m).expect("send");
        assert_eq!(call.recv().expect("echo").as_deref(), Some(&m[..]), "echo {i}");
    }
    call.close_send().expect("half-close");
    assert_eq!(call.recv().expect("end"), None);

    let s = ch.unary("/test.Echo/Fail", &(Code::Aborted as u32).to_le_bytes(), Default::default()).expect_err("fail");
    assert_eq!((s.code(), &s.details()[..]), (Code::Aborted, &b"\x00details\xff"[..]));
    let mut md = MetadataMap::new();
    md.append("x-echo", "early").expect("ascii");
    let options = CallOptions { metadata: md, ..CallOptions::default() };
    let s = ch.unary("/test.Echo/Fail", &(Code::Aborted as u32).to_le_bytes(), options).expect_err("fail");
    assert_eq!((s.code(), s.headers().get("x-echo")), (Code::Aborted, Some("head:early")), "initial metadata kept");
    let s = ch.unary("/test.Nope/Missing", b"", Default::default()).expect_err("unknown");
    assert_eq!(s.code(), Code::Unimplemented);
    // A deadline passed already: DEADLINE_EXCEEDED every time, the call never sent.
    let passed = CallOptions { timeout: Some(Duration::ZERO), ..CallOptions::default() };
    for _ in 0..20 {
        let s = ch.unary("/test.Echo/Unary", b"x", passed.clone()).expect_err("passed");
        assert_eq!(s.code(), Code::DeadlineExceeded, "{s}");
    }
}

#[test]
fn messages_built_in_place_travel_both_ways() {
    let (_server, addr) = server();
    let ch = Channel::connect(&addr).expect("connect");
    let mut call = ch.start("/test.Echo/Unary", CallOptions::default()).expect("start");
    let mut block = call.alloc(3 << 20).expect("block");
    block.copy_from_slice(&pattern(3 << 20, 4));
    call.send_block(block, true).expect("send block");
    let m = call.recv().expect("reply").expect("message");
    assert_eq!((m.len(), first_mismatch(&m, 4)), (3 << 20, None));
    drop(m);
    assert_eq!(call.recv().expect("end"), None);

    let r = ch.unary("/test.Echo/InPlace", &(5u32 << 20).to_le_bytes(), Default::default()).expect("in place");
    assert_eq!((r.message.len(), first_mismatch(&r.message, 9)), (5 << 20, None));
}

/// A block allocated from another connection is refused INVALID_ARGUMENT before it takes any
/// of the call's credit, and the call goes on: it took the credit first, so that after 4 MiB
/// of refused blocks (the stream's window) the next message waited for credit for good.
#[test]
fn a_block_of_another_connection_is_refused_and_takes_no_credit() {
    let (_server, addr) = server();
    let (ch, other) = (Channel::connect(&addr).expect("connect"), Channel::connect(&addr).expect("connect"));
    let mut donor = other.start("/test.Echo/Bidi", CallOptions::default()).expect("start");
    let timeout = Some(Duration::from_secs(30));
    let mut call = ch.start("/test.Echo/Bidi", CallOptions { timeout, ..CallOptions::default() }).expect("start");
    for _ in 0..6 {
        let block = donor.alloc(1 << 20).expect("a block of the other connection");
        let s = call.send_block(block, false).expect_err("another connection's block");
        assert_eq!(s.code(), Code::InvalidArgument, "{s}");
    }
    let mut block = call.alloc(1 << 20).expect("a block of its own");
    block.copy_from_slice(&pattern(1 << 20, 6));
    call.send_block(block, false).expect("its own block goes");
    let m = call.recv().expect("the echo").expect("a message");
    assert_eq!((m.len(), first_mismatch(&m, 6)), (1 << 20, None));
    call.send_last(b"still").expect("a message after them goes");
    assert_eq!(&call.recv().expect("the echo").expect("a message")[..], b"still");
    assert_eq!(call.recv().expect("end"), None);
    drop(donor);
}

#[test]
fn threads_share_one_channel_and_every_reply_reaches_its_caller() {
    let (_server, addr) = server();
    let ch = Channel::connect(&addr).expect("connect");
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let ch = ch.clone();
            std::thread::spawn(move || {
                for i in 0..1500u64 {
                    let seed = mix(t << 32 | i);
                    let req = pattern(16 + (seed % 2000) as usize, seed);
                    let r = ch.unary("/test.Echo/Unary", &req, Default::default()).expect("unary");
                    assert_eq!(r.message[..], req[..], "thread {t} call {i}");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().expect("thread");
    }
    assert_eq!(ch.counters().finished(Code::Ok), 8 * 1500);
}

#[test]
fn deadlines_end_blocking_calls_on_both_sides() {
    let (mut server, addr) = server();
    let ch = Channel::connect(&addr).expect("connect");
    let opts = CallOptions { timeout: Some(Duration::from_millis(300)), ..Default::default() };
    let mut call = ch.start("/test.Echo/Sleep", opts.clone()).expect("start");
    call.send(b"z").expect("send");
    let s = call.recv().expect_err("deadline");
    assert_eq!(s.code(), Code::DeadlineExceeded, "{s}");
    server.expect_line("SLEEP-DROPPED", Duration::from_secs(30));

    // Mid-stream: messages flow, then the deadline ends the stream (one long enough for the
    // first echo on a busy machine).
    let opts = CallOptions { timeout: Some(Duration::from_secs(2)), ..Default::default() };
    let mut call = ch.start("/test.Echo/Bidi", opts).expect("start");
    call.send(b"one").expect("send");
    assert_eq!(call.recv().expect("echo").as_deref(), Some(&b"one"[..]));
    let s = call.recv().expect_err("deadline mid-stream");
    assert_eq!(s.code(), Code::DeadlineExceeded, "{s}");

    let opts = CallOptions { timeout: Some(Duration::from_secs(30)), ..Default::default() };
    let r = ch.unary("/test.Echo/TimeLeft", b"", opts).expect("time left");
    let left: i64 = std::str::from_utf8(&r.message).expect("utf8").parse().expect("number");
    assert!((1..=30_000).contains(&left), "{left}");
}

#[test]
fn a_killed_server_wakes_every_blocked_thread_and_a_restart_is_picked_up() {
    let (mut server, addr) = server();
    let ch = Channel::connect(&addr).expect("connect");
    let (started, ready) = std::sync::mpsc::channel();
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let (ch, started) = (ch.clone(), started.clone());
            std::thread::spawn(move || {
                let mut call = ch.start("/test.Echo/Bidi", CallOptions::default()).expect("start");
                call.send(b"x").expect("send");
                assert_eq!(call.recv().expect("echo").as_deref(), Some(&b"x"[..]));
                started.send(()).expect("report");
                let s = call.recv().expect_err("server gone");
                (s.code(), Instant::now())
            })
        })
        .collect();
    for _ in 0..4 {
        ready.recv_timeout(Duration::from_secs(30)).expect("call started");
    }
    let killed = Instant::now();
    server.kill9();
    for t in threads {
        let (code, when) = t.join().expect("thread");
        assert_eq!(code, Code::Unavailable);
        println!("a blocked thread woke {:?} after kill -9", when.saturating_duration_since(killed));
        assert!(when.saturating_duration_since(killed) < Duration::from_secs(1));
    }
    let s = ch.unary("/test.Echo/Unary", b"x", Default::default()).expect_err("no server");
    assert_eq!(s.code(), Code::Unavailable, "{s}");

    let _again = Peer::spawn_bin("rpc-peer", &[&addr]);
    let r = ch.unary("/test.Echo/Unary", b"after", Default::default()).expect("reconnected");
    assert_eq!(&r.message[..], b"after");
}

#[test]
fn wait_for_ready_on_a_blocking_channel() {
    let addr = fresh_addr("blk-ready");
    let ch = Channel::lazy(&addr).expect("lazy");
    let s = ch.unary("/test.Echo/Unary", b"x", Default::default()).expect_err("no server");
    assert_eq!(s.code(), Code::Unavailable, "{s}");
    // Waiting for ready waits until the deadline, as grpc's calls do: it gave up when its
    // next try would come after it (here at 155 ms).
    let opts = CallOptions { wait_for_ready: true, timeout: Some(Duration::from_millis(200)), ..Default::default() };
    let began = Instant::now();
    let s = ch.unary("/test.Echo/Unary", b"x", opts).expect_err("still none");
    assert_eq!(s.code(), Code::DeadlineExceeded, "{s}");
    assert!(s.message().contains("no server became ready"), "{s}");
    assert!(began.elapsed() >= Duration::from_millis(200), "gave up after {:?}", began.elapsed());
    let addr2 = addr.clone();
    let starter = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        Peer::spawn_bin("rpc-peer", &[&addr2])
    });
    let opts = CallOptions { wait_for_ready: true, timeout: Some(Duration::from_secs(60)), ..Default::default() };
    let r = ch.unary("/test.Echo/Unary", b"ready", opts).expect("waited for the server");
    assert_eq!(&r.message[..], b"ready");
    drop(starter.join());
}

#[test]
fn a_pending_unary_waits_a_moment_and_the_rest_of_the_wait_goes_elsewhere() {
    let (mut server, addr) = server();
    let ch = Channel::connect(&addr).expect("connect");

    // A reply that comes: waited for in moments until it is there.
    let mut pending = ch.unary_begin("/test.Echo/Unary", b"quick", CallOptions::default()).expect("begin");
    let reply = loop {
        if let Some(r) = pending.wait_until(Instant::now() + Duration::from_millis(10)) {
            break r.expect("reply");
        }
    };
    assert_eq!(&reply.message[..], b"quick");

    // A reply that never comes (the handler sleeps): the moment passes with the call running,
    // and another thread waits out its deadline.
    let opts = CallOptions { timeout: Some(Duration::from_millis(300)), ..Default::default() };
    let mut pending = ch.unary_begin("/test.Echo/Sleep", b"z", opts).expect("begin");
    assert!(pending.wait_until(Instant::now() + Duration::from_millis(1)).is_none());
    let s = std::thread::spawn(move || pending.wait()).join().expect("thread").expect_err("deadline");
    assert_eq!(s.code(), Code::DeadlineExceeded, "{s}");
    server.expect_line("SLEEP-DROPPED", Duration::from_secs(30));

    // Given up on: the server sees the cancel.
    let mut pending = ch.unary_begin("/test.Echo/Sleep", b"z", CallOptions::default()).expect("begin");
    assert!(pending.wait_until(Instant::now() + Duration::from_millis(1)).is_none());
    pending.cancel();
    server.expect_line("SLEEP-DROPPED", Duration::from_secs(30));

    // The channel still serves.
    assert_eq!(&ch.unary("/test.Echo/Unary", b"after", CallOptions::default()).expect("unary").message[..], b"after");
}

#[test]
fn a_call_after_a_pause_finds_the_restarted_server_instead_of_failing() {
    let (mut server, addr) = server();
    let ch = Channel::connect(&addr).expect("connect");
    ch.unary("/test.Echo/Unary", b"before", CallOptions::default()).expect("first server");
    server.kill9();
    let mut again = Peer::spawn_bin("rpc-peer", &[&addr]);
    // wait_for_ready covers the new server's start, not a call sent on the dead connection.
    let opts = CallOptions { wait_for_ready: true, timeout: Some(Duration::from_secs(30)), ..CallOptions::default() };
    let r = ch.unary("/test.Echo/Unary", b"after", opts).expect("the first call after the restart goes through");
    assert_eq!(&r.message[..], b"after");
    assert_eq!(ch.connectivity(false), isthmus::Connectivity::Ready);
    again.kill9();
    // Nobody reads the connection between calls: its end is found by looking at the socket.
    assert_ne!(ch.connectivity(false), isthmus::Connectivity::Ready);
    ch.close(isthmus::Status::new(Code::Cancelled, "Channel closed!"));
    let s = ch.unary("/test.Echo/Unary", b"x", CallOptions::default()).expect_err("closed");
    assert_eq!(s.code(), Code::Unavailable, "{s}");
}

#[test]
fn a_request_sent_as_one_block_goes_with_its_call_also_after_a_restart() {
    // Above the inline bound (8 KiB) and up to half the arena, a request is copied into a block
    // of the connection the call takes before its HEADERS go out; below and above, the usual way.
    let (mut server, addr) = server();
    let ch = Channel::connect(&addr).expect("connect");
    for (i, len) in [8 << 10, (8 << 10) + 1, 64 << 10, 1 << 20, 40 << 20].into_iter().enumerate() {
        let m = pattern(len, i as u64);
        let r = ch.unary("/test.Echo/Unary", &m, CallOptions::default()).expect("unary");
        assert_eq!((r.message.len(), first_mismatch(&r.message, i as u64)), (len, None), "unary of {len} bytes");
        let patience = Duration::from_secs(5);
        let begun = ch.unary_begin_within("/test.Echo/Unary", &m, &CallOptions::default(), patience);
        let r = begun.expect("no error").expect("room").wait().expect("echo");
        assert_eq!((r.message.len(), first_mismatch(&r.message, i as u64)), (len, None), "begun of {len} bytes");
    }
    server.kill9();
    let _again = Peer::spawn_bin("rpc-peer", &[&addr]);
    let opts = CallOptions { wait_for_ready: true, timeout: Some(Duration::from_secs(30)), ..CallOptions::default() };
    let m = pattern(64 << 10, 7);
    let r = ch.unary("/test.Echo/Unary", &m, opts).expect("the first call after the restart goes through");
    assert_eq!(first_mismatch(&r.message, 7), None);
}

#[test]
fn a_send_that_would_wait_for_room_gives_up_after_its_patience() {
    // A 1 MiB arena, held whole by requests a handler never reads.
    let (_server, addr) = server();
    let config = isthmus::Config { arena_size: 1 << 20, ..isthmus::Config::default() };
    let ch = Channel::connect_with(&addr, config).expect("connect");
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut call = ch.start("/test.Echo/Stall", CallOptions::default()).expect("start");
        call.send(&pattern(256 << 10, 1)).expect("fits");
        held.push(call);
    }
    let request = pattern(64 << 10, 2);
    let started = Instant::now();
    let begun = ch.unary_begin_within("/test.Echo/Unary", &request, &CallOptions::default(), Duration::from_millis(20));
    assert!(begun.expect("no error").is_none(), "no room: given up, not sent");
    // No deadline was set, so only the patience can have ended the wait (5 s: a bound a
    // loaded machine keeps).
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
    drop(held); // cancelled: the server lets the blocks go
    let opts = CallOptions { timeout: Some(Duration::from_secs(30)), ..CallOptions::default() };
    let r = ch.unary("/test.Echo/Unary", &request, opts).expect("room again");
    assert!(first_mismatch(&r.message, 2).is_none());
}

/// A blocking channel with a small ring to `server`, which is then stopped with the ring full
/// of one-frame calls begun with `unary_begin_within` (returned, to be waited for): none of
/// their frames leaves the ring until it goes on.
fn ring_filled(server: &Peer, addr: &str, request: &[u8]) -> (Channel, Vec<isthmus::blocking::PendingUnary>) {
    let config = isthmus::Config { ring_size: 64 << 10, ..isthmus::Config::default() };
    let ch = Channel::connect_with(addr, config).expect("connect");
    ch.unary("/test.Echo/Unary", b"connected", CallOptions::default()).expect("first call");
    server.stop();
    let patience = Duration::from_millis(50);
    let mut begun = Vec::new();
    loop {
        match ch.unary_begin_within("/test.Echo/Unary", request, &CallOptions::default(), patience) {
            Ok(Some(call)) => begun.push(call),
            Ok(None) => break,
            Err(status) => panic!("begun {}: {status}", begun.len()),
        }
        assert!(begun.len() < 1000, "a 64 KiB ring of a stopped server took 1,000 calls of 1 KiB");
    }
    (ch, begun)
}

#[test]
fn a_head_that_finds_no_ring_room_in_time_leaves_no_trace() {
    // A call given up before its HEADERS went out is not a call: it is not counted, and no
    // CANCEL follows it (before, it counted as started and cancelled, and a CANCEL for a stream
    // the server never heard of waited for ring room). The fast path of an event loop's call
    // gives up so, then sends the request another way.
    let (server, addr) = server();
    let request = pattern(1 << 10, 3);
    let (ch, begun) = ring_filled(&server, &addr, &request);
    let n = begun.len() as u64 + 1; // and the first call
    let before = ch.counters();
    assert_eq!((before.calls_started, before.finished(Code::Ok)), (n, 1), "{before:?}");
    for _ in 0..3 {
        let given_up =
            ch.unary_begin_within("/test.Echo/Unary", &request, &CallOptions::default(), Duration::from_millis(20));
        assert!(given_up.expect("no error").is_none(), "the ring is still full");
    }
    let after = ch.counters();
    assert_eq!(after.calls_started, n, "calls given up before they went out are not counted");
    assert_eq!(after.finished(Code::Cancelled), 0, "nor cancelled");
    assert_eq!(after.transport.frames_sent, before.transport.frames_sent, "nothing more went out");
    assert_eq!(after.transport.bytes_sent, before.transport.bytes_sent, "nor counted as sent");
    server.resume();
    for call in begun {
        let r = call.wait().expect("answered once the server goes on");
        assert_eq!(first_mismatch(&r.message, 3), None);
    }
    let last = ch.counters();
    assert_eq!((last.calls_started, last.finished(Code::Ok), last.finished(Code::Cancelled)), (n, n, 0), "{last:?}");
}

#[test]
fn a_checked_unary_call_looks_between_slices_of_its_wait_for_ring_room() {
    // Python's blocking calls wait so, looking at Ctrl-C between slices. Before, a wait for ring
    // room for the head was not sliced: `check` never ran until the server read again. A
    // request too large for the head travels in an arena block, given back when the call is
    // given up.
    let (server, addr) = server();
    let (ch, begun) = ring_filled(&server, &addr, &pattern(1 << 10, 4));
    let n = begun.len() as u64 + 1;
    let (in_use, sent) = (ch.counters().transport.arena_in_use, ch.counters().transport.bytes_sent);
    // Metadata of 2 KiB: a head too large for what the 1 KiB calls left of the ring.
    let mut metadata = MetadataMap::new();
    metadata.append("x-pad", &"p".repeat(2 << 10)).expect("metadata");
    for request in [pattern(1 << 10, 5), pattern(64 << 10, 6)] {
        let (done, result) = std::sync::mpsc::channel();
        let waiter = {
            let ch = ch.clone();
            let options = CallOptions { metadata: metadata.clone(), ..CallOptions::default() };
            std::thread::spawn(move || {
                let mut looks = 0;
                let outcome =
                    ch.unary_checked("/test.Echo/Unary", &request, options, Duration::from_millis(20), || {
                        looks += 1;
                        if looks < 5 {
                            Ok(())
                        } else {
                            Err(looks)
                        }
                    });
                done.send(outcome.map(|r| r.map(|r| r.message.len()))).expect("the test waits");
            })
        };
        let got = result.recv_timeout(Duration::from_secs(60));
        if got.is_err() {
            server.resume(); // lets the waiter go, and the test end
        }
        waiter.join().expect("waiter");
        assert_eq!(got.expect("the wait looked between slices and ended"), Err(5), "ended by the fifth look");
        let c = ch.counters();
        assert_eq!((c.calls_started, c.finished(Code::Cancelled)), (n, 0), "left no trace: {c:?}");
        assert_eq!(c.transport.arena_in_use, in_use, "the staged block went back to the arena");
        assert_eq!(c.transport.bytes_sent, sent, "no request counted as sent");
    }
    server.resume();
    for call in begun {
        call.wait().expect("answered once the server goes on");
    }
}

#[test]
fn a_handshake_slower_than_the_calls_deadline_still_connects_the_channel() {
    // gRPC's connection attempts outlive the call that began them. Before, the handshake was
    // bounded by the call's deadline: with every call's deadline shorter than a handshake, the
    // channel never connected. A stopped server takes the connection into its backlog and
    // answers the handshake only once it goes on.
    let (server, addr) = server();
    let ch = Channel::lazy(&addr).expect("lazy");
    ch.unary("/test.Echo/Unary", b"up", CallOptions::default()).expect("the server is up");
    // A fresh channel, not connected; a handshake timeout long enough for a loaded machine.
    let config = isthmus::Config { handshake_timeout: Duration::from_secs(60), ..isthmus::Config::default() };
    let ch = Channel::lazy_with(&addr, config).expect("lazy");
    server.stop();
    let short = CallOptions { timeout: Some(Duration::from_millis(100)), ..CallOptions::default() };
    let s = ch.unary("/test.Echo/Unary", b"x", short.clone()).expect_err("no handshake within 100 ms");
    assert_eq!(s.code(), Code::DeadlineExceeded, "{s}");
    server.resume(); // within the handshake's timeout
    let connected = eventually(Duration::from_secs(30), || ch.connectivity(false) == isthmus::Connectivity::Ready);
    assert!(connected, "the attempt the call began went on and connected the channel");
    let later = CallOptions { timeout: Some(Duration::from_secs(10)), ..CallOptions::default() };
    let r = ch.unary("/test.Echo/Unary", b"after", later).expect("a call on the connected channel");
    assert_eq!(&r.message[..], b"after");
}

#[test]
fn closing_the_channel_ends_a_call_waiting_for_a_server() {
    // `wait_for_ready` with nobody at the address: the call waits between attempts until the
    // channel closes, then ends UNAVAILABLE "the channel was closed" (Go's `Close` relies on
    // it, and names grpc-go's status).
    let ch = Channel::lazy(&fresh_addr("nobody")).expect("lazy");
    let (done, ended) = std::sync::mpsc::channel();
    let waiting = {
        let ch = ch.clone();
        std::thread::spawn(move || {
            let opts = CallOptions { wait_for_ready: true, ..CallOptions::default() };
            let _ = done.send(ch.unary("/test.Echo/Unary", b"x", opts).map(|_| ()));
        })
    };
    std::thread::sleep(Duration::from_millis(100)); // waiting by then, most likely; if not, the same
    ch.close(isthmus::Status::new(Code::Cancelled, "Channel closed!"));
    let s = ended.recv_timeout(Duration::from_secs(60)).expect("the call ended").expect_err("closed");
    assert_eq!((s.code(), s.message()), (Code::Unavailable, "the channel was closed"), "{s}");
    waiting.join().expect("thread");
}

#[test]
fn a_connection_found_dead_by_a_call_no_longer_counts_as_ready() {
    let (mut server, addr) = server();
    let ch = Channel::connect(&addr).expect("connect");
    assert_eq!(ch.connectivity(false), isthmus::Connectivity::Ready);
    let waiting = {
        let ch = ch.clone();
        std::thread::spawn(move || {
            let mut call = ch.start("/test.Echo/Sleep", CallOptions::default()).expect("start");
            call.send_last(b"x").expect("send");
            call.recv().expect_err("the server dies under it").code()
        })
    };
    server.expect_line("SLEEPING", Duration::from_secs(30));
    server.kill9();
    // The waiting call reads the connection, and finds it dead first.
    assert_eq!(waiting.join().expect("thread"), Code::Unavailable);
    assert_ne!(ch.connectivity(false), isthmus::Connectivity::Ready);
}

/// The blocking client's side of `rpc_calls::a_call_dropped_while_the_ring_is_full_…`: with no
/// runtime in this process, the CANCEL that finds the ring full waits on a thread of its own
/// (for up to 10 s) and goes once the server reads again.
#[test]
fn a_call_dropped_while_the_ring_is_full_still_stops_its_handler() {
    let (mut server, addr) = server();
    let small = isthmus::Config { ring_size: 4096, inline_max: 512, ..isthmus::Config::default() };
    let ch = Channel::connect_with(&addr, small).expect("connect");
    let mut sleeping = ch.start("/test.Echo/Sleep", CallOptions::default()).expect("start");
    sleeping.send(b"x").expect("send");
    server.expect_line("SLEEPING", Duration::from_secs(30));

    server.stop();
    // The filler's sends stop at its deadline once the ring is full (the server reads nothing
    // while stopped).
    let patient = CallOptions { timeout: Some(Duration::from_millis(300)), ..CallOptions::default() };
    let mut filler = ch.start("/test.Echo/Stall", patient).expect("start");
    let mut sent = 0;
    while filler.send(&[7u8; 256]).is_ok() {
        sent += 1;
        assert!(sent < 1000, "4 KiB of ring took {sent} messages of 256 B and is still not full");
    }
    drop(sleeping);
    server.resume();
    server.expect_line("SLEEP-DROPPED", Duration::from_secs(30));
}

/// A server that keeps writing into the client's ring while it reads nothing of its own (a peer
/// of the spec: isthmus itself sends no PINGs). The blocking call reads them while it waits, and
/// its answers that find no ring room wait for it, on a thread of their own, instead of holding
/// the reading thread for a second each and then being dropped: all of them arrive, in order.
#[test]
fn a_waiting_call_answers_every_ping_of_a_server_that_reads_nothing_meanwhile() {
    let addr = fresh_addr("blk-pings");
    // 48 PINGs of 60 KiB, and as many answers: 2.8 MiB each way, past both 1 MiB rings.
    let mut server = Peer::spawn(&["ping-server", &addr, "48", "61440"]);
    let ch = Channel::connect(&addr).expect("connect");
    let call = std::thread::spawn(move || {
        let options = CallOptions { timeout: Some(Duration::from_secs(120)), ..Default::default() };
        ch.unary("/test.Echo/Unary", b"waits", options)
    });
    server.expect_line("CALL", Duration::from_secs(30));
    let acks = server.expect_line("ACKS", Duration::from_secs(90));
    assert_eq!(acks, "ACKS 48");
    // The server hangs up without answering.
    let ended = call.join().expect("the calling thread").expect_err("no answer came");
    assert_eq!(ended.code(), Code::Unavailable, "{ended:?}");
}

/// Credit a blocking call grants while the ring to its server is full waits for room as long
/// as the connection lives. The server fills that ring with PING answers, streams 40 messages
/// of 64 KiB (over half the window, so taking them grants), then reads nothing for 3 s, past
/// the flusher thread's 1 s wait. Before, that thread gave up after its wait and dropped what
/// was queued, the grant with it: a stream waiting for the credit stalled once the server read
/// again.
#[test]
fn credit_queued_behind_a_full_ring_outlasts_a_long_stop_of_the_server() {
    let (mut server, _ch, mut call) = take_40_messages_of_a_credit_server(3000, 20, (64 << 10) - 16);
    let line = server.expect_line("ANSWERS", Duration::from_secs(30));
    let words: Vec<&str> = line.split(' ').collect();
    assert_eq!(words[1], "20", "every PING answered: {line}");
    let granted: u64 = words[3].parse().expect("a count");
    assert!(granted >= 2 << 20, "the grant came: {line}");
    assert!(call.recv().expect("the end").is_none(), "ends OK");
}

/// The same behind more answers than may wait (100 PING answers of 64 KiB: the ring holds some,
/// the queue exactly its 4 MiB, the rest are dropped): the grant waits all the same. It was dropped too, and
/// stayed owed to the next message the call took, which the server never sent without it.
#[test]
fn credit_is_not_dropped_with_the_answers_a_stopped_server_asks_for() {
    let (mut server, _ch, mut call) = take_40_messages_of_a_credit_server(3000, 100, 64 << 10);
    let line = server.expect_line("ANSWERS", Duration::from_secs(30));
    let words: Vec<&str> = line.split(' ').collect();
    let answers: u32 = words[1].parse().expect("a count");
    assert!(answers < 100, "some PING answers were dropped, so the queue was full: {line}");
    let granted: u64 = words[3].parse().expect("a count");
    assert!(granted >= 2 << 20, "the grant came: {line}");
    assert!(call.recv().expect("the end").is_none(), "ends OK");
}

/// The same, with the channel dropped while its answers wait: the flusher thread, which now
/// waits as long as the connection lives, does not hold the connection open behind a stopped
/// server. The server reads the answers the ring held, then finds the client gone.
#[test]
fn a_dropped_blocking_channel_lets_its_queued_answers_go() {
    let (mut server, ch, call) = take_40_messages_of_a_credit_server(5000, 20, (64 << 10) - 16);
    drop((call, ch));
    let line = server.expect_line("ANSWERS", Duration::from_secs(30));
    let words: Vec<&str> = line.split(' ').collect();
    let answers: u32 = words[1].parse().expect("a count");
    // The ring held some of the answers (and the call's frames); the rest went with the thread.
    assert!(answers < 20 && words[3] == "0", "only what the ring held: {line}");
    assert_eq!(words[5], "PeerGone", "the connection ended: {line}");
}

/// A call to `shm-peer credit-server` that sends `pings` PINGs of `len` bytes and reads nothing
/// for `wait_ms` once it has sent; its 40 messages taken (and checked), so that their credit is
/// granted.
fn take_40_messages_of_a_credit_server(wait_ms: u32, pings: u32, len: u32) -> (Peer, Channel, isthmus::blocking::Call) {
    let addr = fresh_addr("blk-credit");
    let (wait_ms, pings, len) = (wait_ms.to_string(), pings.to_string(), len.to_string());
    let mut server = Peer::spawn(&["credit-server", &addr, &wait_ms, &pings, &len]);
    let ch = Channel::connect(&addr).expect("connect");
    let options = CallOptions { timeout: Some(Duration::from_secs(60)), ..Default::default() };
    let mut call = ch.start("/test.Echo/ServerStream", options).expect("start");
    call.send_last(b"go").expect("request");
    server.expect_line("CALL", Duration::from_secs(30));
    for i in 0..40u64 {
        let m = call.recv().expect("a message").expect("40 messages");
        assert_eq!((m.len(), first_mismatch(&m, i)), (64 << 10, None), "message {i}");
    }
    (server, ch, call)
}

/// What process `pid` has open, for a failure's message.
fn fds_of(pid: u32) -> String {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else { return "unknown".into() };
    let mut fds: Vec<String> = dir
        .flatten()
        .map(|e| {
            format!(
                "{}→{}",
                e.file_name().to_string_lossy(),
                std::fs::read_link(e.path()).unwrap_or_default().display()
            )
        })
        .collect();
    fds.sort();
    fds.join(" ")
}

/// A server out of file descriptors: the connections it has go on serving, a new client is
/// turned away (UNAVAILABLE), the failed accepts and handshakes are counted in `ServerStats`
/// (and logged), and once descriptors are free again the listener accepts again.
#[test]
fn a_server_out_of_descriptors_counts_its_failed_accepts_and_accepts_again() {
    use std::process::Command;
    let addr = fresh_addr("blk-fds");
    let server =
        Peer::command(Command::new(isthmus_tests::peer_bin("rpc-peer")).arg(&addr).env("RPC_PEER_FDS_LEFT", "8"));
    let quick = isthmus::Config { handshake_timeout: Duration::from_secs(1), ..Default::default() };
    let options = || CallOptions { timeout: Some(Duration::from_secs(10)), ..Default::default() };
    let call = |ch: &Channel| ch.unary("/test.Echo/Unary", b"fds", options());
    let counts = |ch: &Channel| {
        let again = CallOptions { wait_for_ready: true, ..options() };
        let text = ch.unary("/test.Admin/AcceptErrors", b"", again).expect("the counts");
        let text = String::from_utf8_lossy(&text.message).into_owned();
        let count = |name: &str| -> u64 {
            let f = text.split(' ').find_map(|f| f.strip_prefix(name)).unwrap_or_else(|| panic!("{name} in {text}"));
            f.parse().expect("a count")
        };
        (count("accept_errors="), count("handshakes_failed="))
    };
    let mut held = Vec::new();
    let turned_away = loop {
        match Channel::connect_with(&addr, quick.clone()).and_then(|ch| call(&ch).map(|_| ch)) {
            Ok(ch) => held.push(ch),
            Err(status) => break status,
        }
        assert!(held.len() < 64, "the server never ran out of descriptors");
    };
    assert_eq!(turned_away.code(), Code::Unavailable, "{turned_away:?}");
    // A connection takes six descriptors while its handshake runs (the socket, the segment and
    // four doorbells) and keeps five: eight free fit one and turn the second away.
    assert!(!held.is_empty(), "no connection fitted: {turned_away:?}; the server's fds: {}", fds_of(server.pid()));
    let first = &held[0];
    // Counted once the server's handshake task is back, which may be after its client saw the
    // socket close.
    assert!(eventually(Duration::from_secs(30), || counts(first).1 > 0), "the turned-away handshake is counted");
    // Sockets that never say hello: each accepted one holds a descriptor for the server's
    // handshake timeout, so the server soon has none left even to accept.
    let path = addr.parse::<isthmus_shm::Address>().expect("address").socket_path().to_owned();
    let silent: Vec<_> = (0..8).map(|_| std::os::unix::net::UnixStream::connect(&path).expect("connect")).collect();
    assert!(
        eventually(Duration::from_secs(30), || counts(first).0 > 0),
        "no accept failed while the server had no descriptors; its fds: {}",
        fds_of(server.pid())
    );
    for ch in &held {
        call(ch).expect("a connection made before goes on serving");
    }
    let n = held.len();
    drop((held, silent));
    // The server sees those clients go, in its own time, and closes their descriptors; its
    // listener's pause after failing is at most 1 s. Until then a handshake may still fail.
    let end = Instant::now() + Duration::from_secs(30);
    let ch = loop {
        match Channel::connect(&addr) {
            Ok(ch) => break ch,
            Err(e) => {
                assert!(Instant::now() < end, "never accepted again: {e:?}; the server's fds: {}", fds_of(server.pid()))
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let (accept_errors, handshakes_failed) = counts(&ch);
    println!("{n} connections held, then {turned_away:?}; accept_errors={accept_errors} handshakes_failed={handshakes_failed}");
}

/// A handler still running when the grace period ends: the server cancels its call, which
/// drops the handler, its client's call ends UNAVAILABLE, and the shutdown finishes.
#[test]
fn a_handler_still_running_when_the_grace_ends_is_stopped_and_its_call_fails_unavailable() {
    use std::process::Command;
    let addr = fresh_addr("blk-grace");
    let mut server =
        Peer::command(Command::new(isthmus_tests::peer_bin("rpc-peer")).arg(&addr).env("RPC_PEER_GRACE_MS", "300"));
    let ch = Channel::connect(&addr).expect("connect");
    let sleeper = std::thread::spawn({
        let ch = ch.clone();
        // The handler reads its request, then never answers.
        move || ch.unary("/test.Echo/Sleep", b"", CallOptions::default())
    });
    server.expect_line("SLEEPING", Duration::from_secs(30));
    ch.unary("/test.Admin/Shutdown", b"", CallOptions::default()).expect("shutdown starts");
    let err = sleeper.join().expect("the calling thread").expect_err("the call outlived the grace");
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    // The grace's end cancels the call, which drops the handler on its own task, while the
    // serving task finishes: the two lines come in either order.
    let mut lines =
        [server.expect_line("S", Duration::from_secs(30)), server.expect_line("S", Duration::from_secs(30))];
    lines.sort();
    assert_eq!(lines, ["SHUTDOWN-DONE", "SLEEP-DROPPED"]);
}

/// GOAWAY seen by a blocking channel: a graceful shutdown lets the call in progress on another
/// thread finish, and a new call is refused UNAVAILABLE (the server no longer listens), not
/// sent on the connection that is going away.
#[test]
fn a_blocking_channel_sees_a_graceful_shutdown_finish_its_call_and_refuse_new_ones() {
    let (mut server, addr) = server();
    let ch = Channel::connect(&addr).expect("connect");
    let slow = std::thread::spawn({
        let ch = ch.clone();
        move || ch.unary("/test.Echo/Slow", b"in flight", CallOptions::default())
    });
    server.expect_line("SLOW-STARTED", Duration::from_secs(30));
    ch.unary("/test.Admin/Shutdown", b"", CallOptions::default()).expect("shutdown starts");
    let r = slow.join().expect("the calling thread").expect("the call in progress finishes");
    assert_eq!(&r.message[..], b"in flight");
    let late = ch.unary("/test.Echo/Unary", b"late", CallOptions::default()).expect_err("no new calls");
    assert_eq!(late.code(), Code::Unavailable, "{late:?}");
    server.expect_line("SHUTDOWN-DONE", Duration::from_secs(30));
}

/// A blocking call's `cancel()` stops its server handler (which sees CANCELLED and is dropped),
/// and the channel serves the next call.
#[test]
fn a_blocking_calls_cancel_stops_its_handler() {
    let (mut server, addr) = server();
    let ch = Channel::connect(&addr).expect("connect");
    let mut call = ch.start("/test.Echo/Sleep", CallOptions::default()).expect("start");
    call.send(b"x").expect("send");
    server.expect_line("SLEEPING", Duration::from_secs(30));
    call.cancel();
    server.expect_line("SLEEP-DROPPED", Duration::from_secs(30));
    let r = ch.unary("/test.Echo/Unary", b"next", CallOptions::default()).expect("the channel serves on");
    assert_eq!(&r.message[..], b"next");
}

/// The CPU time process `pid` has used so far (user and system), from /proc.
fn cpu_of(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("/proc/PID/stat");
    // The fields after the command's closing parenthesis: utime and stime are the 12th and 13th.
    let after = &stat[stat.rfind(')').expect("comm") + 2..];
    let fields: Vec<u64> = after.split(' ').skip(11).take(2).map(|f| f.parse().expect("ticks")).collect();
    // SAFETY: sysconf only reads a system constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Duration::from_millis((fields[0] + fields[1]) * 1000 / hz)
}

/// An HTTP/2 endpoint out of file descriptors waits between failed accepts, as the shm://
/// listener does: tonic took the failure and accepted again at once, and the server spun a
/// core for as long as the connections that held the descriptors lived.
#[test]
fn an_http2_endpoint_out_of_descriptors_does_not_spin() {
    use std::process::Command;
    let socket = isthmus_tests::fresh_socket("h2-fds");
    let targets = format!("{},unix://{}", fresh_addr("h2-fds"), socket.display());
    let mut server =
        Peer::command(Command::new(isthmus_tests::peer_bin("rpc-peer")).arg(&targets).env("RPC_PEER_FDS_LEFT", "4"));
    let path = server.http_address().trim_start_matches("unix://").to_owned();
    // Each accepted connection takes a descriptor: a few more than were left, and the
    // endpoint's accepts fail from then on (the rest wait in the listener's backlog).
    let held: Vec<_> = (0..16).map(|_| std::os::unix::net::UnixStream::connect(&path).expect("connect")).collect();
    std::thread::sleep(Duration::from_millis(500)); // the server accepts what it can
    let (before, at) = (cpu_of(server.pid()), Instant::now());
    std::thread::sleep(Duration::from_secs(2));
    let (used, over) = (cpu_of(server.pid()) - before, at.elapsed());
    // Spinning, it took a whole core (here, all it could get of one); waiting, a few accepts a
    // second. A quarter of the time is far from both.
    assert!(used < over / 4, "the server used {used:?} of CPU in {over:?} with no descriptors left");
    drop(held);
}
