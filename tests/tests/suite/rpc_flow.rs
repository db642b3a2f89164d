//! Flow control and the server's stream limit, end to end: a client in this process, the
//! server (`rpc-peer`) in another.

use std::time::Duration;

use isthmus::{CallOptions, Channel, Code, INITIAL_WINDOW, MESSAGE_OVERHEAD, SMALL_INITIAL_WINDOW};
use isthmus_tests::{eventually, first_mismatch, fresh_addr, run, Peer};

/// Messages of `len` bytes a writer can send into a fresh window before it must wait: it may
/// send while its credit is above zero.
fn fit(len: u64) -> u64 {
    INITIAL_WINDOW.div_ceil(len + MESSAGE_OVERHEAD)
}

async fn flood_sent(ch: &Channel) -> u64 {
    let r = ch.unary("/test.Admin/FloodSent", b"", CallOptions::default()).await.expect("FloodSent");
    u64::from_le_bytes(r.message[..8].try_into().expect("u64"))
}

#[test]
fn a_stalled_reader_holds_back_its_writer_and_no_other_stream() {
    let addr = fresh_addr("flow");
    let _server = Peer::spawn_bin("rpc-peer", &[&addr]);
    run(async move {
        let ch = Channel::connect(&addr).await.expect("connect");
        let mut flood = ch.start("/test.Echo/Flood", CallOptions::default()).await.expect("start");
        flood.send_last(b"go").await.expect("request");
        // Read nothing: the server's handler must stop after one window of 64 KiB messages.
        let window = fit(64 << 10);
        let rt = tokio::runtime::Handle::current();
        let ch2 = ch.clone();
        let filled = tokio::task::spawn_blocking(move || {
            eventually(Duration::from_secs(30), || rt.block_on(flood_sent(&ch2)) >= window)
        })
        .await
        .expect("poll");
        assert!(filled, "the flood never filled its window");
        // Other calls on the same connection go on while the flood is stalled.
        let calls: Vec<_> = (0..200u32)
            .map(|i| {
                let ch = ch.clone();
                tokio::spawn(async move {
                    let r = ch.unary("/test.Echo/Unary", &i.to_le_bytes(), CallOptions::default()).await;
                    assert_eq!(&r.expect("unary beside a stalled stream").message[..], &i.to_le_bytes());
                })
            })
            .collect();
        for c in calls {
            c.await.expect("call task");
        }
        assert_eq!(flood_sent(&ch).await, window, "the stalled writer sent past its window");
        // Reading resumes the flood, intact.
        for i in 0..(3 * window) {
            let m = flood.recv().await.expect("flood message").expect("more");
            assert_eq!((m.len(), first_mismatch(&m, i)), (64 << 10, None), "message {i}");
        }
        assert!(flood_sent(&ch).await >= 3 * window);
    });
}

#[test]
fn a_server_that_does_not_read_holds_back_a_streaming_client() {
    let addr = fresh_addr("flow");
    let _server = Peer::spawn_bin("rpc-peer", &[&addr]);
    run(async move {
        let ch = Channel::connect(&addr).await.expect("connect");
        let opts = CallOptions { timeout: Some(Duration::from_secs(2)), ..CallOptions::default() };
        let mut call = ch.start("/test.Echo/Stall", opts).await.expect("start");
        let message = vec![7u8; 64 << 10];
        let mut sent = 0u64;
        let err = loop {
            match call.send(&message).await {
                Ok(()) => sent += 1,
                Err(s) => break s,
            }
            assert!(sent <= 10 * fit(64 << 10), "sends never stopped");
        };
        assert_eq!(err.code(), Code::DeadlineExceeded, "{err}");
        assert_eq!(sent, fit(64 << 10), "sent before the window closed");
        // The connection is fine for the next call.
        let r = ch.unary("/test.Echo/Unary", b"after", CallOptions::default()).await.expect("unary");
        assert_eq!(&r.message[..], b"after");
    });
}

/// Three echoes of 100 kB (too large to go inline) from a new HTTP/2 connection to `http`, each
/// answered within 10 s.
async fn another_client_is_answered(http: &str) {
    let other = Channel::builder(http).upgrade(false).connect().await.expect("connect");
    let opts = CallOptions { timeout: Some(Duration::from_secs(10)), ..CallOptions::default() };
    for i in 0..3 {
        let m = isthmus_tests::pattern(100_000, i);
        let r = other.unary("/test.Echo/Unary", &m, opts.clone()).await.expect("another client's call");
        assert!(r.message[..] == m[..], "reply {i} differs");
    }
}

#[test]
fn a_stream_has_the_small_window_only_where_both_sides_ask_for_it() {
    // `features::SMALL_WINDOW` (protocol 3.12, 13.8): what a stream nobody reads lets its writer
    // send, both ways. Asked by one side only, the window is the usual one.
    use isthmus::features::{ALL, SMALL_WINDOW};
    let small = SMALL_INITIAL_WINDOW.div_ceil((64 << 10) + MESSAGE_OVERHEAD);
    for (server, client) in
        [(ALL | SMALL_WINDOW, ALL | SMALL_WINDOW), (ALL, ALL | SMALL_WINDOW), (ALL | SMALL_WINDOW, ALL)]
    {
        let agreed = server & client & SMALL_WINDOW != 0;
        let want = if agreed { small } else { fit(64 << 10) };
        let addr = fresh_addr("small-window");
        let _server = Peer::command(
            std::process::Command::new(isthmus_tests::peer_bin("rpc-peer"))
                .arg(&addr)
                .env("RPC_PEER_FEATURES", server.to_string()),
        );
        let what = format!("server {server:#x}, client {client:#x}");
        run(async move {
            let config = isthmus::Config { features: client, ..isthmus::Config::default() };
            let ch = Channel::connect_with(&addr, config).await.expect("connect");
            // Replies nobody reads: the server's handler sends what the window lets through.
            let mut flood = ch.start("/test.Echo/Flood", CallOptions::default()).await.expect("start");
            flood.send_last(b"go").await.expect("request");
            let rt = tokio::runtime::Handle::current();
            let admin = ch.clone();
            let sent = tokio::task::spawn_blocking(move || settled(1, || rt.block_on(flood_sent(&admin))))
                .await
                .expect("poll");
            assert_eq!(sent, want, "{what}: replies sent into a window nobody reads");
            // Requests nobody reads: this client sends what the window lets through.
            let mut stall = ch.start("/test.Echo/Stall", CallOptions::default()).await.expect("start");
            let message = vec![7u8; 64 << 10];
            let mut sent = 0;
            let wait = Duration::from_secs(1);
            while let Ok(Ok(())) = tokio::time::timeout(wait, stall.send(&message)).await {
                sent += 1;
            }
            assert_eq!(sent, want, "{what}: requests sent into a window nobody reads");
            drop((flood, stall));
        });
    }
}

/// HTTP/2 calls one client leaves unread in the tests below: with the 4 MiB window of other
/// connections, some 80 of them filled the loopback's arena and the copies it may hold (ADR 0036).
const UNREAD: u64 = 120;

/// `count` once it has reached `at_least` (waiting up to 30 s) and then stayed the same for a
/// second, twice running (at most 30 s more).
fn settled(at_least: u64, mut count: impl FnMut() -> u64) -> u64 {
    assert!(eventually(Duration::from_secs(30), || count() >= at_least), "fewer than {at_least} in 30 s");
    let end = std::time::Instant::now() + Duration::from_secs(30);
    let (mut last, mut same) = (count(), 0);
    while same < 2 && std::time::Instant::now() < end {
        std::thread::sleep(Duration::from_secs(1));
        let now = count();
        same = if now == last { same + 1 } else { 0 };
        last = now;
    }
    last
}

#[test]
fn an_http2_client_that_reads_no_replies_holds_up_no_other_clients_replies() {
    // Every HTTP/2 call to a handler goes through the server's one loopback connection. A client
    // that reads none of the replies of its floods filled that connection's 64 MiB arena, and
    // every other client's replies too large to go inline waited for room until their
    // deadlines: at 24 floods, until the loopback took what arrives out of its arena (ADR 0036);
    // at some 80, until its streams had small windows (ADR 0037). Each flood now holds the
    // loopback's 64 KiB window and a message, and what HTTP/2 buffers for it.
    let (_server, shm, http) = Peer::rpc_peer_with_http("h2hog", &[]);
    run(async move {
        let hog = Channel::builder(&http).upgrade(false).connect().await.expect("connect");
        let mut floods = Vec::new();
        for _ in 0..UNREAD {
            let mut flood = hog.start("/test.Echo/Flood", CallOptions::default()).await.expect("start");
            flood.send_last(b"go").await.expect("request");
            floods.push(flood);
        }
        let admin = Channel::connect(&shm).await.expect("connect");
        let rt = tokio::runtime::Handle::current();
        let sent = tokio::task::spawn_blocking(move || settled(UNREAD, || rt.block_on(flood_sent(&admin))))
            .await
            .expect("poll");
        // Every flood started, and none got to send its old window.
        assert!(sent >= UNREAD, "only {sent} messages for {UNREAD} floods");
        assert!(sent < UNREAD * fit(64 << 10) / 4, "{sent} messages held for {UNREAD} unread floods");
        another_client_is_answered(&http).await;
        drop(floods);
    });
}

#[test]
fn an_http2_client_whose_requests_are_not_read_holds_up_no_other_clients_requests() {
    // The other way through the loopback: calls whose handler never reads (Stall), each sent
    // all its windows let through, no longer fill the arena that other clients' requests of
    // 100 kB need.
    let (_server, _, http) = Peer::rpc_peer_with_http("h2stall", &[]);
    run(async move {
        let hog = Channel::builder(&http).upgrade(false).connect().await.expect("connect");
        let sent = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let mut stalls = Vec::new();
        for _ in 0..UNREAD {
            let mut call = hog.start("/test.Echo/Stall", CallOptions::default()).await.expect("start");
            let sent = sent.clone();
            stalls.push(tokio::spawn(async move {
                let message = vec![7u8; 64 << 10];
                while call.send(&message).await.is_ok() {
                    sent.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
            }));
        }
        let count = sent.clone();
        let sent =
            tokio::task::spawn_blocking(move || settled(UNREAD, || count.load(std::sync::atomic::Ordering::SeqCst)))
                .await
                .expect("poll");
        assert!(sent >= UNREAD, "only {sent} messages for {UNREAD} calls");
        assert!(sent < UNREAD * fit(64 << 10) / 4, "{sent} messages held for {UNREAD} unread calls");
        another_client_is_answered(&http).await;
        for stall in stalls {
            stall.abort();
        }
    });
}

/// `n` calls to `rpc-peer`'s Sleep on `ch`, each once its handler says it sleeps.
async fn sleeping(ch: &Channel, server: &mut Peer, n: usize) -> Vec<isthmus::ClientCall> {
    let mut sleepers = Vec::new();
    for _ in 0..n {
        let mut call = ch.start("/test.Echo/Sleep", CallOptions::default()).await.expect("start");
        call.send(b"z").await.expect("send");
        server.expect_line("SLEEPING", Duration::from_secs(30));
        sleepers.push(call);
    }
    sleepers
}

#[test]
fn an_http2_connection_is_held_to_the_stream_limit_in_its_settings() {
    // Over HTTP/2 the limit is each connection's SETTINGS_MAX_CONCURRENT_STREAMS, as grpc-go's
    // MaxConcurrentStreams: a third call on a connection with two open waits for a place (it
    // was refused RESOURCE_EXHAUSTED), and another connection is not counted with it (all
    // HTTP/2 calls to handlers counted together, through the loopback they share).
    let (mut server, _, addr) = Peer::rpc_peer_with_http("h2limit", &["0", "2"]);
    run(async move {
        let ch = Channel::builder(&addr).upgrade(false).connect().await.expect("connect");
        let mut sleepers = sleeping(&ch, &mut server, 2).await;
        let waits = CallOptions { timeout: Some(Duration::from_millis(300)), ..CallOptions::default() };
        let s = ch.unary("/test.Echo/Unary", b"x", waits).await.expect_err("no place on this connection");
        assert_eq!(s.code(), Code::DeadlineExceeded, "{s}");
        let other = Channel::builder(&addr).upgrade(false).connect().await.expect("connect");
        let r = other.unary("/test.Echo/Unary", b"y", CallOptions::default()).await.expect("another connection");
        assert_eq!(&r.message[..], b"y");
        let waiting = tokio::spawn({
            let ch = ch.clone();
            async move { ch.unary("/test.Echo/Unary", b"w", CallOptions::default()).await }
        });
        drop(sleepers.pop());
        let r = waiting.await.expect("task").expect("the place a cancel freed");
        assert_eq!(&r.message[..], b"w");
    });
}

#[test]
fn a_call_over_the_servers_stream_limit_is_resource_exhausted() {
    let addr = fresh_addr("limit");
    let mut server = Peer::spawn_bin("rpc-peer", &[&addr, "0", "2"]);
    run(async move {
        let ch = Channel::connect(&addr).await.expect("connect");
        let mut sleepers = sleeping(&ch, &mut server, 2).await;
        let s = ch.unary("/test.Echo/Unary", b"x", CallOptions::default()).await.expect_err("over the limit");
        assert_eq!(s.code(), Code::ResourceExhausted, "{s}");
        assert!(s.message().contains("limit of 2"), "{s}");
        drop(sleepers.pop());
        server.expect_line("SLEEP-DROPPED", Duration::from_secs(30));
        // The cancel freed a place (the handler's end and the table entry go together).
        let mut ok = false;
        for _ in 0..100 {
            if ch.unary("/test.Echo/Unary", b"x", CallOptions::default()).await.is_ok() {
                ok = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(ok, "no place freed after a cancel");
    });
}
