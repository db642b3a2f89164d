//! A server's maximum connection age (`Server::max_connection_age`, `..._grace`): an HTTP/2
//! connection that reaches it gets a GOAWAY, its client moves its next calls to a new
//! connection without losing one, calls in progress finish on the old one, and once the grace
//! is over they are cancelled. The server runs in the test's process; each call's handler
//! answers with the call's peer address, whose port names the connection it came on.

use std::collections::BTreeSet;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;

use isthmus::{CallOptions, Channel, Code, Server, ServerCall, Status};
use isthmus_tests::{first_call_dropped, run};

fn within(secs: u64) -> CallOptions {
    CallOptions { timeout: Some(Duration::from_secs(secs)), ..CallOptions::default() }
}

/// `/test.Age/Peer` answers the caller's address; `/test.Age/Ticks` sends N (its request, one
/// byte) messages 100 ms apart, then ends OK.
fn server() -> Server {
    Server::builder()
        .handler("/test.Age/Peer", |mut call: ServerCall| async move {
            let _ = call.recv().await?;
            let peer = call.peer().to_owned();
            call.send_last(peer.as_bytes()).await
        })
        .handler("/test.Age/Ticks", |mut call: ServerCall| async move {
            let n = call.recv().await?.and_then(|r| r.first().copied()).unwrap_or(0);
            for i in 0..n {
                tokio::time::sleep(Duration::from_millis(100)).await;
                call.send(&[i]).await?;
            }
            Ok::<(), Status>(())
        })
}

/// Serves `server` on a fresh TCP port, plaintext; the `http://` address.
fn serve(server: Server) -> String {
    let bound = server.bind_all(["http://127.0.0.1:0"]).expect("bind");
    let addr = bound.http_addresses().into_iter().next().expect("an address");
    tokio::spawn(bound.serve());
    addr
}

/// A channel that stays on HTTP/2 (the server would offer `shm://` otherwise).
async fn channel(addr: &str) -> Channel {
    Channel::builder(addr).upgrade(false).connect().await.expect("connect")
}

/// Unary calls one after another for `secs` (at least one); the connections (peer addresses)
/// they came on.
async fn peers_over(ch: &Channel, secs: f64) -> BTreeSet<String> {
    let mut peers = BTreeSet::new();
    let start = Instant::now();
    let mut calls = 0;
    while calls == 0 || start.elapsed().as_secs_f64() < secs {
        let reply = ch.unary("/test.Age/Peer", b"", within(30)).await;
        let reply = reply.unwrap_or_else(|s| panic!("call {calls} failed: {s:?}"));
        peers.insert(String::from_utf8(reply.message.to_vec()).expect("utf-8"));
        calls += 1;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    peers
}

#[test]
fn an_aged_connection_is_replaced_and_no_call_fails() {
    // A GOAWAY every 50 ms: some calls start as their connection closes, before it sent them,
    // and go again on the next (`http/retry.rs`); none may fail.
    run(async {
        let addr = serve(server().max_connection_age(Duration::from_millis(50)));
        let ch = channel(&addr).await;
        let peers = peers_over(&ch, 2.0).await;
        // ~40 ages in 2 s; one connection would mean no GOAWAY came.
        assert!(peers.len() >= 2, "every call came on one connection: {peers:?}");
    });
}

#[test]
fn without_a_maximum_age_a_connection_lives_on() {
    // The control for the test above: the same calls, one connection.
    run(async {
        let addr = serve(server());
        let ch = channel(&addr).await;
        let peers = peers_over(&ch, 1.0).await;
        assert_eq!(peers.len(), 1, "{peers:?}");
    });
}

#[test]
fn a_call_in_progress_finishes_on_an_aged_connection() {
    // GOAWAY refuses new calls on the connection; it does not end those on it. 10 ticks take
    // 1 s, past three ages of 300 ms.
    run(async {
        let addr = serve(server().max_connection_age(Duration::from_millis(300)));
        let ch = channel(&addr).await;
        let before = peers_over(&ch, 0.0).await;
        let mut call = ch.start("/test.Age/Ticks", within(60)).await.expect("start");
        call.send_last(&[10]).await.expect("request");
        let mut got = Vec::new();
        while let Some(m) = call.recv().await.expect("a tick") {
            got.extend_from_slice(&m);
        }
        assert_eq!(got, (0..10).collect::<Vec<u8>>());
        // The GOAWAY did come meanwhile: the next call goes on another connection.
        let after = peers_over(&ch, 0.0).await;
        assert!(before.is_disjoint(&after), "no GOAWAY during the call: {before:?} then {after:?}");
    });
}

#[test]
fn the_grace_ends_a_call_still_in_progress_unavailable() {
    // Age 200 ms, grace 300 ms: a call that would take 60 s is cut off after about half a
    // second, and its handler stops.
    run(async {
        let (guard, dropped) = first_call_dropped();
        let srv = server()
            .handler("/test.Age/Forever", move |mut call: ServerCall| {
                let guard = guard();
                async move {
                    let _guard = guard;
                    let _ = call.recv().await;
                    call.send(b"started").await?;
                    std::future::pending::<Result<(), Status>>().await
                }
            })
            .max_connection_age(Duration::from_millis(200))
            .max_connection_age_grace(Duration::from_millis(300));
        let addr = serve(srv);
        let ch = channel(&addr).await;
        let mut call = ch.start("/test.Age/Forever", within(60)).await.expect("start");
        call.send_last(b"").await.expect("request");
        assert_eq!(call.recv().await.expect("first message").as_deref(), Some(&b"started"[..]));
        let status = tokio::time::timeout(Duration::from_secs(30), call.recv())
            .await
            .expect("the call still runs 30 s past its connection's age and grace")
            .expect_err("a call cut off");
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        tokio::time::timeout(Duration::from_secs(30), dropped).await.expect("the handler still runs").expect("dropped");
        // The channel opens a new connection for the next call.
        let reply = ch.unary("/test.Age/Peer", b"", within(30)).await.expect("a call after the cut");
        assert!(!reply.message.is_empty());
    });
}

/// A TCP stream whose reads stop (pending for ever) once `stalled` is set, its socket left
/// open: a client that stops reading, so the server's writes fill the socket and block.
struct Stalling {
    tcp: tokio::net::TcpStream,
    stalled: Arc<AtomicBool>,
}

impl tokio::io::AsyncRead for Stalling {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.stalled.load(Ordering::SeqCst) {
            true => Poll::Pending,
            false => Pin::new(&mut self.tcp).poll_read(cx, buf),
        }
    }
}

impl tokio::io::AsyncWrite for Stalling {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write(cx, data)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

#[test]
fn the_grace_ends_a_connection_whose_client_stopped_reading() {
    // A handler streams 64 KiB messages to a client that reads two and then stops reading its
    // socket; its HTTP/2 window (2^31 - 1) lets the server write until the socket is full, so
    // the server's connection waits to write, not to read. The grace must end it all the same.
    run(async {
        let (guard, dropped) = first_call_dropped();
        let srv = server()
            .handler("/test.Age/Flood", move |mut call: ServerCall| {
                let guard = guard();
                async move {
                    let _guard = guard;
                    let _ = call.recv().await;
                    let message = vec![7u8; 64 << 10];
                    loop {
                        call.send(&message).await?;
                    }
                }
            })
            .max_connection_age(Duration::from_millis(200))
            .max_connection_age_grace(Duration::from_millis(300));
        let addr = serve(srv);
        let host = addr.trim_start_matches("http://").to_owned();
        let stalled = Arc::new(AtomicBool::new(false));
        let tcp = tokio::net::TcpStream::connect(&host).await.expect("connect");
        let io = Stalling { tcp, stalled: stalled.clone() };
        let (mut client, connection) = h2::client::Builder::new()
            .initial_window_size(i32::MAX as u32)
            .initial_connection_window_size(i32::MAX as u32)
            .handshake::<_, Bytes>(io)
            .await
            .expect("HTTP/2 handshake");
        tokio::spawn(connection);
        let request = http::Request::post(format!("http://{host}/test.Age/Flood"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
            .expect("request");
        let (response, mut send) = client.send_request(request, false).expect("send");
        send.send_data(Bytes::from_static(&[0, 0, 0, 0, 0]), true).expect("an empty message");
        let mut body = response.await.expect("the response's headers").into_body();
        let mut got = 0;
        while got < 2 * (64 << 10) {
            got += body.data().await.expect("a frame").expect("data").len();
        }
        stalled.store(true, Ordering::SeqCst);
        tokio::time::timeout(Duration::from_secs(30), dropped)
            .await
            .expect("the handler still runs 30 s past its connection's age and grace")
            .expect("dropped");
        drop((client, send, body));
    });
}
