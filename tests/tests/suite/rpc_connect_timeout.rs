//! The connect timeout (`ChannelBuilder::connect_timeout`, gRPC's minimum connect timeout): an
//! HTTP/2 connection that does not come up within it fails, and the calls waiting on it fail
//! UNAVAILABLE instead of waiting for their deadline or for ever. The server here is a TCP
//! listener that never accepts: the kernel completes the client's connect, and nothing answers.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use isthmus::{CallOptions, Channel, Code};
use isthmus_tests::run;

const TIMEOUT: Duration = Duration::from_millis(300);

/// A listener that never accepts or answers, and its `host:port`.
fn silent_server() -> (TcpListener, String) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("address").to_string();
    (listener, addr)
}

/// A channel to `addr` over plaintext HTTP/2 with the tests' connect timeout.
fn plaintext(addr: &str) -> Channel {
    let ch = Channel::builder(&format!("http://{addr}")).upgrade(false).connect_timeout(TIMEOUT);
    ch.connect_lazy().expect("channel")
}

/// A call whose deadline is far off: only the connect timeout can end it sooner. (The tests
/// bound it at 10 s: before the deadline, and before the 20 s default.)
async fn call(ch: &Channel) -> (isthmus::Status, Duration) {
    let began = Instant::now();
    let options = CallOptions { timeout: Some(Duration::from_secs(60)), ..CallOptions::default() };
    let status = ch.unary("/test.Echo/Unary", &b"x"[..], options).await.expect_err("nobody answers");
    (status, began.elapsed())
}

/// What a call on a channel whose connection never comes up fails with: UNAVAILABLE saying
/// `words`, after the connect timeout (within 10 s).
async fn fails_at_the_connect_timeout(ch: &Channel, words: &str) {
    let (status, took) = call(ch).await;
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains(words), "{status:?}");
    assert!(took < Duration::from_secs(10), "failed after {took:?}, not at the deadline");
}

/// A call that waits for READY, 2 s at most, on a channel that never gets there: it ends at
/// its deadline, not sent anywhere.
async fn waits_for_ready_in_vain(ch: &Channel) {
    let options = CallOptions { timeout: Some(Duration::from_secs(2)), wait_for_ready: true, ..CallOptions::default() };
    let status = ch.unary("/test.Echo/Unary", &b"x"[..], options).await.expect_err("never READY");
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert_ne!(ch.connectivity(false), isthmus::Connectivity::Ready);
}

#[test]
fn a_server_that_never_says_a_word_fails_the_calls_unavailable_after_the_connect_timeout() {
    // Plaintext: the connect is the kernel's and succeeds; the server's SETTINGS never come.
    let (_listener, addr) = silent_server();
    run(async move {
        fails_at_the_connect_timeout(&plaintext(&addr), "sent nothing within the connect timeout").await;
    });
}

#[test]
fn a_tls_handshake_nobody_answers_fails_connect_and_calls_unavailable_after_the_connect_timeout() {
    let (_listener, addr) = silent_server();
    run(async move {
        let target = format!("https://{addr}");
        let began = Instant::now();
        let err = Channel::builder(&target).connect_timeout(TIMEOUT).connect().await.expect_err("no handshake");
        assert_eq!(err.code(), Code::Unavailable, "{err:?}");
        assert!(err.message().contains("connect timeout"), "{err:?}");
        assert!(began.elapsed() < Duration::from_secs(10), "connect failed after {:?}", began.elapsed());

        let ch = Channel::builder(&target).connect_timeout(TIMEOUT).connect_lazy().expect("channel");
        fails_at_the_connect_timeout(&ch, "connect timeout").await;
    });
}

#[test]
fn a_call_that_waits_for_ready_is_not_sent_on_a_connection_nobody_answers() {
    // The channel is READY from the server's SETTINGS: a call that waits for READY waits
    // through the silent connection and the attempts after it, and ends at its own deadline.
    // (READY counted from the connect sent it there, and it failed UNAVAILABLE.)
    let (_listener, addr) = silent_server();
    run(async move {
        let ch = plaintext(&addr);
        waits_for_ready_in_vain(&ch).await;
    });
}

#[test]
fn a_connect_timeout_of_zero_is_the_default_and_one_of_forever_is_none() {
    let (_server, _, addr) = isthmus_tests::Peer::rpc_peer_with_http("connect-timeout", &[]);
    run(async move {
        for timeout in [Duration::ZERO, Duration::MAX] {
            let ch = Channel::builder(&addr).upgrade(false).connect_timeout(timeout).connect().await.expect("connect");
            let options = CallOptions { timeout: Some(Duration::from_secs(30)), ..CallOptions::default() };
            let reply = ch.unary("/test.Echo/Unary", &b"x"[..], options).await.expect("a call");
            assert_eq!(&reply.message[..], b"x", "{timeout:?}");
            assert_eq!(ch.connectivity(false), isthmus::Connectivity::Ready, "{timeout:?}");
        }
    });
}

#[test]
fn a_server_that_answers_in_http1_never_makes_the_channel_ready() {
    // An HTTP/1 server answers the client's preface with a 400 and closes. Only a SETTINGS
    // frame first makes the channel READY: a call that waits for READY is not sent there and
    // ends at its own deadline. (Any first bytes made it READY, and the call failed INTERNAL.)
    let (listener, addr) = silent_server();
    listener.set_nonblocking(true).expect("nonblocking");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let answering = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            use std::io::Write;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                match listener.accept() {
                    Ok((mut s, _)) => {
                        let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\nConnection: close\r\n\r\n");
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        })
    };
    run(async move {
        let ch = plaintext(&addr);
        waits_for_ready_in_vain(&ch).await;
    });
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    answering.join().expect("the answering thread");
}
