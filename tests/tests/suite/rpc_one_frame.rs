//! One-frame unary calls (protocol 13.9): the request inside the client's HEADERS, the response
//! inside the server's TRAILERS, where the handshake granted `features::UNARY_IN_ONE_FRAME`; two
//! frames each way where either side lacks it. Both clients (async and blocking) against
//! `rpc-peer`, whose `/test.Echo/Last` answers with `send_last`.

use std::process::Command;

use isthmus::{CallOptions, Code, Config, MetadataMap};
use isthmus_shm::features;
use isthmus_tests::{fresh_addr, peer_bin, run, Peer};

fn server(tag: &str, features: u16, max_message: u64) -> (Peer, String) {
    let addr = fresh_addr(tag);
    let peer = Peer::command(
        Command::new(peer_bin("rpc-peer"))
            .args([addr.as_str(), &max_message.to_string()])
            .env("RPC_PEER_FEATURES", features.to_string()),
    );
    (peer, addr)
}

fn with_echo() -> CallOptions {
    let mut metadata = MetadataMap::new();
    metadata.append("x-echo", "hi").expect("metadata");
    CallOptions { metadata, ..CallOptions::default() }
}

/// Frames and message bytes this client sent and received, as its connection counts them.
fn traffic(c: &isthmus::ConnectionCounters) -> [u64; 4] {
    let t = &c.transport;
    [t.frames_sent, t.frames_received, t.bytes_sent, t.bytes_received]
}

#[test]
fn a_unary_call_takes_one_frame_each_way_only_where_both_sides_agree() {
    for (server_features, client_features) in
        [(features::ALL, features::ALL), (0, features::ALL), (features::ALL, 0), (0, 0)]
    {
        let agreed = server_features & client_features & features::UNARY_IN_ONE_FRAME != 0;
        let (_server, addr) = server("one-frame", server_features, 0);
        let config = Config { features: client_features, ..Config::default() };
        let what = format!("server {server_features:#x}, client {client_features:#x}");
        run({
            let (addr, config, what) = (addr.clone(), config.clone(), what.clone());
            async move {
                let ch = isthmus::Channel::connect_with(&addr, config).await.expect("connect");
                ch.unary("/test.Echo/Last", b"warm", CallOptions::default()).await.expect("first call");
                let before = traffic(&ch.counters());
                for i in 0..10u8 {
                    let r = ch.unary("/test.Echo/Last", &[i; 64], with_echo()).await.expect("unary");
                    assert_eq!(&r.message[..], &[i; 64], "{what}");
                    assert_eq!(r.trailers.get("x-echo"), Some("tail:hi"), "{what}");
                    assert!(r.metadata.is_empty(), "{what}: {:?}", r.metadata);
                }
                let after = traffic(&ch.counters());
                let frames = [after[0] - before[0], after[1] - before[1]];
                match agreed {
                    // A WINDOW of credit may go either way besides, never a frame per call.
                    true => assert!(frames[0] <= 12 && frames[1] <= 12, "{what}: {frames:?}"),
                    false => assert!(frames[0] >= 20 && frames[1] >= 20, "{what}: {frames:?}"),
                }
                assert_eq!([after[2] - before[2], after[3] - before[3]], [640, 640], "{what}: message bytes");

                // What does not fit one frame, and a status with its details and trailers, are
                // the same either way.
                let big = vec![7u8; 100 << 10];
                let r = ch.unary("/test.Echo/Last", &big, CallOptions::default()).await.expect("100 KiB");
                assert_eq!(r.message, big, "{what}");
                let code = (Code::NotFound as u32).to_le_bytes();
                let s = ch.unary("/test.Echo/Fail", &code, CallOptions::default()).await.expect_err("fails");
                assert_eq!(s.code(), Code::NotFound, "{what}: {s}");
                assert!(!s.details().is_empty() && !s.metadata().is_empty(), "{what}: {s:?}");
            }
        });
        let blocking = isthmus::blocking::Channel::connect_with(&addr, config).expect("blocking connect");
        for i in 0..3u8 {
            let r = blocking.unary("/test.Echo/Last", &[i; 100], with_echo()).expect("blocking unary");
            assert_eq!(&r.message[..], &[i; 100], "{what}");
            assert_eq!(r.trailers.get("x-echo"), Some("tail:hi"), "{what}");
        }
    }
}

#[test]
fn a_held_last_message_comes_before_a_status_too_long_to_go_beside_it() {
    let (_server, addr) = server("one-frame-long-status", features::ALL, 0);
    run(async move {
        let ch = isthmus::Channel::connect(&addr).await.expect("connect");
        let mut call = ch.start("/test.Echo/LastThenFail", CallOptions::default()).await.expect("start");
        call.send_last(b"kept").await.expect("request");
        assert_eq!(call.recv().await.expect("the message first").as_deref(), Some(&b"kept"[..]));
        let s = call.recv().await.expect_err("then the status");
        assert_eq!((s.code(), s.message().len()), (Code::Aborted, 10_000));
        let s = ch.unary("/test.Echo/LastThenFail", b"x", CallOptions::default()).await.expect_err("unary");
        assert_eq!(s.code(), Code::Aborted);
    });
}

#[test]
fn a_request_over_the_servers_limit_in_one_frame_is_resource_exhausted_naming_both() {
    let (_server, addr) = server("one-frame-limit", features::ALL, 100);
    let ch = isthmus::blocking::Channel::connect(&addr).expect("connect");
    let s = ch.unary("/test.Echo/Last", &[1u8; 101], CallOptions::default()).expect_err("too large");
    assert_eq!(s.code(), Code::ResourceExhausted, "{s}");
    assert_eq!(s.message(), "SERVER: Received message larger than max (101 vs. 100)", "grpc-core's words");
    // The connection goes on.
    let r = ch.unary("/test.Echo/Last", &[2u8; 100], CallOptions::default()).expect("at the limit");
    assert_eq!(&r.message[..], &[2u8; 100]);
}

#[test]
fn a_response_over_the_clients_limit_in_one_frame_is_resource_exhausted_naming_both() {
    let (_server, addr) = server("one-frame-reply-limit", features::ALL, 0);
    run(async move {
        let config = Config { max_message_size: 100, ..Config::default() };
        let ch = isthmus::Channel::connect_with(&addr, config).await.expect("connect");
        let s = ch.unary("/test.Echo/Last", &[1u8; 101], CallOptions::default()).await.expect_err("too large");
        assert_eq!(s.code(), Code::ResourceExhausted, "{s}");
        assert_eq!(s.message(), "CLIENT: Received message larger than max (101 vs. 100)", "grpc-core's words");
        let r = ch.unary("/test.Echo/Last", &[2u8; 100], CallOptions::default()).await.expect("at the limit");
        assert_eq!(&r.message[..], &[2u8; 100]);
    });
}

/// A peer that speaks the protocol's frames itself, as a C or Go implementation of
/// `docs/protocol.md` would: a one-frame call is answered in one frame where it was agreed, and
/// a HEADERS with a message inside on a connection that did not agree ends the connection.
#[test]
fn a_peer_of_the_spec_gets_one_frame_back_and_loses_its_connection_for_one_not_agreed() {
    use isthmus::wire;
    use isthmus_shm::{flags, Address, Connection, ErrorKind, Kind};
    let head = wire::encode_request_head("/test.Echo/Last", None, &MetadataMap::new());
    for granted in [features::ALL, 0] {
        let (_server, addr) = server("one-frame-raw", granted, 0);
        let addr: Address = addr.parse().expect("address");
        let mut c = Connection::connect(&addr, &isthmus_shm::Config::default()).expect("connect");
        assert_eq!(c.sender.features(), granted);
        let body = [&head[..], b"raw request"].concat();
        let f = flags::END_STREAM | wire::WITH_MESSAGE;
        c.sender.send(Kind::Headers, f, 1, &body, None).expect("send");
        let deadline = Some(std::time::Instant::now() + std::time::Duration::from_secs(30));
        if granted != 0 {
            let reply = c.receiver.recv(deadline).expect("reply");
            assert_eq!((reply.kind, reply.stream), (Kind::Trailers, 1));
            assert_eq!(reply.flags, flags::END_STREAM | wire::WITH_MESSAGE);
            let (status, at) = wire::decode_trailers_prefix(&reply.body).expect("status");
            assert_eq!((status.code(), &reply.body[at..]), (Code::Ok, &b"raw request"[..]));
        } else {
            let e = loop {
                match c.receiver.recv(deadline) {
                    Ok(_) => continue,
                    Err(e) => break e,
                }
            };
            assert!(matches!(e.kind(), ErrorKind::PeerGone | ErrorKind::Closed), "{e}");
        }
    }
}
