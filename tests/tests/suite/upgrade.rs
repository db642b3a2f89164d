//! The upgrade (ADR 0013), across processes: a channel given the HTTP/2 address of a local
//! isthmus server that also serves `shm://` moves its calls there (counted per transport, and
//! checked against the server's pid); it stays on HTTP/2 when the server offers nothing or the
//! channel turns the upgrade off, and it follows a server restarted without `shm://` back to
//! HTTP/2.

use std::time::{Duration, Instant};

use isthmus::{Channel, UpgradeStatus};
use isthmus_tests::cases::{client_on, every_kind_of_call_on, request};
use isthmus_tests::{fresh_addr, run, spawn_tonic_peer, Peer};

/// Makes calls until the channel's probe has finished (at most 30 s); its status then.
async fn settled(channel: &Channel) -> UpgradeStatus {
    let end = Instant::now() + Duration::from_secs(30);
    let mut client = client_on(channel.clone());
    loop {
        client.unary(request(b"probe".to_vec(), 1)).await.expect("a call while the probe runs");
        let status = channel.upgrade_status();
        if status != UpgradeStatus::Pending || Instant::now() > end {
            return status;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn port_of(address: &str) -> u16 {
    address.rsplit(':').next().and_then(|p| p.parse().ok()).expect("a port")
}

#[test]
fn http2_calls_to_a_local_isthmus_server_move_to_shm() {
    let shm = fresh_addr("upgrade");
    let (peer, addresses) = spawn_tonic_peer(&[&shm, "127.0.0.1:0"]);
    let port = port_of(&addresses[1]);
    let pid = peer.pid();
    run(async move {
        let targets =
            [format!("http://127.0.0.1:{port}"), format!("localhost:{port}"), format!("ipv4:127.0.0.1:{port}")];
        for (i, target) in targets.iter().enumerate() {
            let channel = Channel::connect(target).await.expect("connect");
            match settled(&channel).await {
                UpgradeStatus::Shm(to) => {
                    assert_eq!(to.pid, pid, "{target}");
                    assert!(to.target.starts_with("shm:///"), "{to:?}");
                    // A socket served by any other process than the one offered is refused.
                    let wrong = isthmus::UpgradedTo { target: to.target.clone(), pid: pid + 1 };
                    let squatted = isthmus::blocking::Channel::lazy_upgraded(&wrong, Default::default()).expect("lazy");
                    let err = squatted.connect_now().expect_err("another pid");
                    assert_eq!(err.code(), isthmus::Code::Unavailable, "{err:?}");
                    assert!(err.message().contains("not by the server"), "{err:?}");
                    let right = isthmus::blocking::Channel::lazy_upgraded(&to, Default::default()).expect("lazy");
                    right.connect_now().expect("the offered pid");
                }
                other => panic!("{target}: did not move to shm:// ({other:?})"),
            }
            let before = channel.transport_counts();
            assert!(before.http2 >= 1, "the first call went over HTTP/2: {before:?}");
            if i == 0 {
                every_kind_of_call_on(channel.clone()).await;
            } else {
                for seq in 0..4 {
                    client_on(channel.clone())
                        .unary(request(b"moved".to_vec(), seq))
                        .await
                        .expect("a call over shm://");
                }
            }
            let after = channel.transport_counts();
            assert_eq!(after.http2, before.http2, "{target}: {before:?} → {after:?}");
            assert!(after.shm >= before.shm + 4, "{target}: {before:?} → {after:?}");
            // The counters are the shm:// connection's it moved to.
            let counters = channel.counters();
            assert!(counters.calls_started >= 4 && counters.transport.bytes_sent > 0, "{target}: {counters:?}");
        }
        // Turned off for one channel: every call stays on HTTP/2.
        let channel = Channel::builder(&format!("localhost:{port}")).upgrade(false).connect().await.expect("connect");
        for seq in 0..4 {
            client_on(channel.clone()).unary(request(b"stays".to_vec(), seq)).await.expect("a call over HTTP/2");
        }
        assert_eq!(channel.upgrade_status(), UpgradeStatus::Off);
        assert_eq!(channel.transport_counts(), isthmus::TransportCounts::default());
        assert_eq!(channel.counters().calls_started, 0, "HTTP/2 calls are not counted");
    });
    drop(peer);
}

#[test]
fn a_first_request_too_large_for_http2_waits_for_the_move() {
    // A channel's first calls go over HTTP/2 while its probe runs, where a server takes 4 MiB
    // unless told otherwise (ADR 0034): a unary request larger than that waits for the probe,
    // and goes over shm:// (it failed RESOURCE_EXHAUSTED).
    let (_server, _, http) = Peer::rpc_peer_with_http("upgrade-large", &[]);
    run(async move {
        let channel = Channel::connect(&http).await.expect("connect");
        assert_eq!(channel.upgrade_status(), UpgradeStatus::Pending);
        let request = isthmus_tests::pattern(8 << 20, 1);
        let options = isthmus::CallOptions { timeout: Some(Duration::from_secs(30)), ..Default::default() };
        let response = channel.unary("/test.Echo/Unary", &request, options).await.expect("the first call");
        assert!(response.message[..] == request[..], "the echo differs");
        assert!(matches!(channel.upgrade_status(), UpgradeStatus::Shm(_)), "{:?}", channel.upgrade_status());
        assert_eq!(channel.transport_counts(), isthmus::TransportCounts { shm: 1, http2: 0 });
    });
}

#[test]
fn a_large_first_request_that_waits_for_the_probe_keeps_its_deadline() {
    // A server that accepts and never answers: the probe hangs, so the call waits for it until
    // its deadline, and then has no time left (it was given its whole timeout again).
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let target = format!("http://{}", listener.local_addr().expect("address"));
    run(async move {
        let channel = Channel::builder(&target).connect_lazy().expect("channel");
        let options = isthmus::CallOptions { timeout: Some(Duration::from_secs(2)), ..Default::default() };
        let began = Instant::now();
        let err = channel.unary("/test.Echo/Unary", &vec![0u8; 8 << 20], options).await.expect_err("no answer");
        assert_eq!(err.code(), isthmus::Code::DeadlineExceeded, "{err:?}");
        // 4 s before; the margin is for a loaded machine.
        assert!(began.elapsed() < Duration::from_millis(3500), "{:?}", began.elapsed());
        // A caller's "forever" is no deadline, not a panic: the call waits for the probe's own
        // bound, and then for HTTP/2, until the channel is closed.
        let forever = isthmus::CallOptions { timeout: Some(Duration::MAX), ..Default::default() };
        let call = tokio::spawn({
            let channel = channel.clone();
            async move { channel.unary("/test.Echo/Unary", &vec![0u8; 8 << 20], forever).await }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        channel.close(isthmus::Status::new(isthmus::Code::Cancelled, "closed by the test"));
        let err = call.await.expect("no panic").expect_err("closed");
        assert_eq!(err.code(), isthmus::Code::Cancelled, "{err:?}");
    });
    drop(listener);
}

#[test]
fn a_server_that_offers_nothing_keeps_its_clients_on_http2() {
    let shm = fresh_addr("no-offer");
    let mut command = std::process::Command::new(isthmus_tests::peer_bin("tonic-peer"));
    command.args([shm.as_str(), "127.0.0.1:0"]).env("ISTHMUS_NO_OFFER", "1");
    let mut peer = Peer::command(&mut command);
    let port = port_of(&peer.expect_line("LISTENING ", Duration::from_secs(30)));
    run(async move {
        let channel = Channel::connect(&format!("localhost:{port}")).await.expect("connect");
        assert_eq!(settled(&channel).await, UpgradeStatus::Http2);
        let before = channel.transport_counts();
        every_kind_of_call_on(channel.clone()).await;
        let after = channel.transport_counts();
        assert_eq!(after.shm, 0, "{after:?}");
        assert!(after.http2 > before.http2, "{after:?}");
    });
}

#[test]
fn a_server_restarted_without_shm_is_followed_back_to_http2() {
    let shm = fresh_addr("restart");
    let (mut first, addresses) = spawn_tonic_peer(&[&shm, "127.0.0.1:0"]);
    let port = port_of(&addresses[1]);
    let target = format!("localhost:{port}");
    let rt = isthmus_tests::runtime();
    let channel = rt.block_on(async {
        let channel = Channel::connect(&target).await.expect("connect");
        assert!(matches!(settled(&channel).await, UpgradeStatus::Shm(_)));
        channel
    });
    first.kill9();
    // The same port, HTTP/2 only.
    let (_second, again) = spawn_tonic_peer(&[&format!("127.0.0.1:{port}")]);
    assert_eq!(port_of(&again[0]), port);
    rt.block_on(async {
        let mut client = client_on(channel.clone());
        // Calls in flight when a server dies fail; the next ones reach the new server.
        let end = Instant::now() + Duration::from_secs(30);
        while client.unary(request(b"again".to_vec(), 2)).await.is_err() {
            assert!(Instant::now() < end, "no call reached the restarted server");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(!matches!(channel.upgrade_status(), UpgradeStatus::Shm(_)), "{:?}", channel.upgrade_status());
        let before = channel.transport_counts();
        every_kind_of_call_on(channel.clone()).await;
        let after = channel.transport_counts();
        assert_eq!(after.shm, before.shm, "{before:?} → {after:?}");
        assert!(after.http2 > before.http2, "{before:?} → {after:?}");
    });
}
