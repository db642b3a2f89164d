//! HTTP/2 keepalive (`ChannelBuilder::keepalive`): a connection that goes silent, as one
//! through a network that drops its flow does, ends its calls UNAVAILABLE instead of leaving them
//! to their deadline; a connection that answers its PINGs lives on, however long a call takes.
//! The silence is made by a TCP proxy between the client and `rpc-peer` that stops forwarding
//! while keeping both sockets open.

use std::time::Duration;

use isthmus::{CallOptions, Channel, Code, Keepalive};
use isthmus_tests::{run, OnDrop, Peer, TcpProxy};

/// `rpc-peer` on shm:// (which its handlers answer HTTP/2 through) and TCP, and a proxy to the
/// latter.
fn server_behind_a_proxy(tag: &str) -> (Peer, TcpProxy) {
    let (server, _, http) = Peer::rpc_peer_with_http(tag, &[]);
    let upstream = http.trim_start_matches("http://").to_owned();
    (server, TcpProxy::to(upstream))
}

/// A channel through `proxy` with a quick keepalive, kept on HTTP/2 (the server is on this
/// machine and offers shm://, which would bypass the proxy).
async fn channel(proxy: &TcpProxy) -> Channel {
    let keepalive = Keepalive {
        time: Duration::from_millis(200),
        timeout: Duration::from_millis(500),
        permit_without_calls: false,
    };
    Channel::builder(&format!("http://{}", proxy.addr))
        .upgrade(false)
        .keepalive(keepalive)
        .connect()
        .await
        .expect("connect")
}

fn within(secs: u64) -> CallOptions {
    CallOptions { timeout: Some(Duration::from_secs(secs)), ..CallOptions::default() }
}

#[test]
fn keepalive_ends_a_call_on_a_connection_gone_silent_with_unavailable_and_the_channel_recovers() {
    let (mut server, proxy) = server_behind_a_proxy("ka-silent");
    run(async move {
        let ch = channel(&proxy).await;
        let reply = ch.unary("/test.Echo/Unary", &b"before"[..], within(30)).await.expect("a call through the proxy");
        assert_eq!(&reply.message[..], b"before");

        // A call the server never answers, with a deadline far off: only keepalive can end it
        // sooner, and then as UNAVAILABLE, not DEADLINE_EXCEEDED.
        let sleeper = {
            let ch = ch.clone();
            tokio::spawn(async move { ch.unary("/test.Echo/Sleep", &b"z"[..], within(60)).await })
        };
        let server = tokio::task::spawn_blocking(move || {
            server.expect_line("SLEEPING", Duration::from_secs(30));
            server
        })
        .await
        .expect("the server");
        proxy.freeze(true);
        let status = sleeper.await.expect("the call's task").expect_err("a call the server never answers");
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        // What broke, from under tonic's "transport error".
        assert!(status.message().contains("keep-alive"), "{status:?}");

        // Connections made from here on forward again; the channel makes one.
        proxy.freeze(false);
        let reply = ch.unary("/test.Echo/Unary", &b"after"[..], within(30)).await.expect("a call after the silence");
        assert_eq!(&reply.message[..], b"after");
        drop(server);
    });
}

#[test]
fn keepalive_leaves_a_slow_call_on_a_live_connection_alone() {
    let (_server, proxy) = server_behind_a_proxy("ka-slow");
    run(async move {
        let ch = channel(&proxy).await;
        // An answer after 2 s: ten keepalive periods of a quiet connection whose PINGs are
        // answered.
        let request = 2_000_000u32.to_le_bytes();
        let reply = ch.unary("/test.Echo/After", &request[..], within(60)).await.expect("a slow call");
        assert_eq!(&reply.message[..], &request[..]);
    });
}

#[test]
fn a_servers_keepalive_cancels_the_calls_of_a_client_gone_silent() {
    // `Server::keepalive`: the server PINGs a quiet HTTP/2 client, and when the PING goes
    // unanswered it closes the connection, which cancels the client's calls and so drops their
    // handlers. Without it the handler below would wait for ever. The client (no keepalive of
    // its own) is behind the proxy.
    run(async move {
        let (entered_tx, entered) = tokio::sync::mpsc::unbounded_channel::<()>();
        let (dropped_tx, dropped) = std::sync::mpsc::channel::<tokio::sync::oneshot::Receiver<()>>();
        let dropped_tx = std::sync::Mutex::new(dropped_tx);
        let bound = isthmus::Server::builder()
            .handler("/test.Echo/Wait", move |mut call: isthmus::ServerCall| {
                let (tx, rx) = tokio::sync::oneshot::channel();
                let _ = dropped_tx.lock().expect("lock").send(rx);
                let entered = entered_tx.clone();
                async move {
                    let _guard = OnDrop(Some(tx));
                    let _ = call.recv().await;
                    let _ = entered.send(());
                    std::future::pending::<Result<(), isthmus::Status>>().await
                }
            })
            .keepalive(Duration::from_millis(200), Duration::from_millis(500))
            .bind_all(["http://127.0.0.1:0"])
            .expect("bind");
        let addr = bound.http_addresses().into_iter().next().expect("an address");
        tokio::spawn(bound.serve());
        let proxy = TcpProxy::to(addr.trim_start_matches("http://").to_owned());
        let ch = Channel::builder(&format!("http://{}", proxy.addr)).upgrade(false).connect().await.expect("connect");
        let call = {
            let ch = ch.clone();
            tokio::spawn(async move { ch.unary("/test.Echo/Wait", &b"z"[..], within(60)).await })
        };
        let mut entered = entered;
        entered.recv().await.expect("the handler runs");
        let handler_dropped = dropped.recv().expect("the handler's drop signal");
        proxy.freeze(true);
        tokio::time::timeout(Duration::from_secs(30), handler_dropped)
            .await
            .expect("the handler of the silent client's call still runs after 30 s")
            .expect("dropped");
        call.abort();
    });
}
