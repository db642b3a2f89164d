//! HTTP/2 keepalive (`ChannelBuilder::keepalive`): a connection that goes silent, as one
//! through a network that drops its flow does, ends its calls UNAVAILABLE instead of leaving them
//! to their deadline; a connection that answers its PINGs lives on, however long a call takes.
//! The silence is made by a TCP proxy between the client and `rpc-peer` that stops forwarding
//! while keeping both sockets open.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use isthmus::{CallOptions, Channel, Code, Keepalive};
use isthmus_tests::{run, OnDrop, Peer};

/// A TCP proxy to `upstream` that forwards both ways until it is frozen. Frozen, it reads what
/// either side sends and drops it, and keeps every socket open: to both ends the connection is
/// up and the other side silent. Connections made while it is thawed forward again.
struct SilentProxy {
    addr: String,
    frozen: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    acceptor: Option<std::thread::JoinHandle<()>>,
}

impl SilentProxy {
    fn to(upstream: String) -> SilentProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        listener.set_nonblocking(true).expect("nonblocking");
        let addr = listener.local_addr().expect("address").to_string();
        let (frozen, stop) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        let (f, s) = (frozen.clone(), stop.clone());
        let acceptor = std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((client, _)) => {
                        client.set_nonblocking(false).expect("blocking");
                        let server = TcpStream::connect(&upstream).expect("connect upstream");
                        for (from, to) in [(&client, &server), (&server, &client)] {
                            let (from, to, f) =
                                (from.try_clone().expect("clone"), to.try_clone().expect("clone"), f.clone());
                            std::thread::spawn(move || pump(from, to, &f));
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(5))
                    }
                    Err(e) => panic!("accept: {e}"),
                }
            }
        });
        SilentProxy { addr, frozen, stop, acceptor: Some(acceptor) }
    }

    fn freeze(&self, on: bool) {
        self.frozen.store(on, Ordering::SeqCst);
    }
}

impl Drop for SilentProxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
    }
}

/// Copies `from` to `to` while the proxy is thawed, drops what comes while it is frozen; ends
/// both when either side closes. (Its sockets close with the test's peer and channel.)
fn pump(mut from: TcpStream, mut to: TcpStream, frozen: &AtomicBool) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) if !frozen.load(Ordering::SeqCst) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Ok(_) => {}
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

/// `rpc-peer` on shm:// (which its handlers answer HTTP/2 through) and TCP, and a proxy to the
/// latter.
fn server_behind_a_proxy(tag: &str) -> (Peer, SilentProxy) {
    let (server, _, http) = Peer::rpc_peer_with_http(tag, &[]);
    let upstream = http.trim_start_matches("http://").to_owned();
    (server, SilentProxy::to(upstream))
}

/// A channel through `proxy` with a quick keepalive, kept on HTTP/2 (the server is on this
/// machine and offers shm://, which would bypass the proxy).
async fn channel(proxy: &SilentProxy) -> Channel {
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
        let proxy = SilentProxy::to(addr.trim_start_matches("http://").to_owned());
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
