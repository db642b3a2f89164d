//! A peer that writes garbage into the segment gets its connection closed with a clear error;
//! the process on the other side survives and goes on serving.

use std::time::{Duration, Instant};

use isthmus_shm::layout::{self, CLIENT_TO_SERVER, SERVER_TO_CLIENT};
use isthmus_shm::{flags, Address, Config, Connection, ErrorKind, Kind, Sender};
use isthmus_tests::{fresh_addr, Peer};

fn ctl(dir: usize, field: usize) -> usize {
    layout::control_base(dir) + field
}

/// Damage done by a hostile client to the client→server direction (or, for `bad-release`, to
/// the release ring of the server's arena).
fn damage(sender: &Sender, mode: &str) {
    let l = sender.layout_for_tests();
    let ring = l.ring_off[CLIENT_TO_SERVER];
    let publish = |tail: u64| sender.scribble_for_tests(ctl(CLIENT_TO_SERVER, layout::CTL_TAIL), &tail.to_le_bytes());
    match mode {
        "tail-jump" => publish(1 << 40),
        "tail-short" => publish(5),
        "bad-kind" => {
            let mut h = [0u8; 16];
            h[4] = 200;
            sender.scribble_for_tests(ring, &h);
            publish(16);
        }
        "huge-len" => {
            let mut h = [0u8; 16];
            h[0..4].copy_from_slice(&u32::MAX.to_le_bytes());
            h[4] = Kind::Message as u8;
            sender.scribble_for_tests(ring, &h);
            publish(16);
        }
        "bad-descriptor" => {
            let mut f = [0u8; 40];
            f[0..4].copy_from_slice(&24u32.to_le_bytes());
            f[4] = Kind::Message as u8;
            f[5] = flags::ARENA;
            f[16..24].copy_from_slice(&(l.arena_size[CLIENT_TO_SERVER] as u64).to_le_bytes());
            f[24..32].copy_from_slice(&4096u64.to_le_bytes());
            f[32..40].copy_from_slice(&4096u64.to_le_bytes());
            sender.scribble_for_tests(ring, &f);
            publish(40);
        }
        "bad-release" => {
            // Give back a block of the server's arena that the server never sent us.
            let mut e = [0u8; 16];
            e[0..8].copy_from_slice(&(8 * 4096u64).to_le_bytes());
            e[8..16].copy_from_slice(&100u64.to_le_bytes());
            sender.scribble_for_tests(l.rel_off[SERVER_TO_CLIENT], &e);
            sender.scribble_for_tests(ctl(SERVER_TO_CLIENT, layout::CTL_REL_TAIL), &1u64.to_le_bytes());
            // Make the server allocate, so it reads the release ring.
            sender.send_message(1, 0, &vec![7u8; 100 << 10], None).expect("trigger");
            return;
        }
        other => panic!("unknown mode {other}"),
    }
    sender.ring_peer_for_tests();
}

#[test]
fn a_server_survives_every_kind_of_damage_from_a_client() {
    let uri = fresh_addr("victim-srv");
    let mut server = Peer::spawn(&["echo-server", &uri]);
    let addr: Address = uri.parse().expect("address");
    for mode in ["tail-jump", "tail-short", "bad-kind", "huge-len", "bad-descriptor", "bad-release"] {
        let conn = Connection::connect(&addr, &Config::default()).expect("connect");
        damage(&conn.sender, mode);
        let line = server.expect_line("CONN-END", Duration::from_secs(30));
        assert!(line.starts_with("CONN-END Protocol"), "{mode}: {line}");
        println!("{mode}: {line}");
        // The server closed that connection: our side sees it.
        let mut receiver = conn.receiver;
        let end = loop {
            match receiver.recv(Some(Instant::now() + Duration::from_secs(30))) {
                Ok(_) => continue, // an echo sent before the damage was found
                Err(e) => break e,
            }
        };
        assert_eq!(end.kind(), ErrorKind::PeerGone, "{mode}: {end}");
        assert!(server.child.try_wait().expect("status").is_none(), "{mode}: the server process died");
        // ...and it still serves a well-behaved client.
        let mut good = Connection::connect(&addr, &Config::default()).expect("connect after damage");
        good.sender.send_message(5, 0, b"still serving", None).expect("send");
        assert_eq!(&good.receiver.recv(None).expect("echo").body[..], b"still serving");
        drop(good);
        let line = server.expect_line("CONN-END", Duration::from_secs(30));
        assert!(line.starts_with("CONN-END PeerGone"), "a clean hang-up: {line}");
    }
}

#[test]
fn a_client_gets_a_clean_error_from_a_damaging_server() {
    for mode in ["tail-jump", "bad-kind", "bad-descriptor", "bad-shared", "shared-piece", "random"] {
        let uri = fresh_addr("victim-cli");
        let mut server = Peer::spawn(&["hostile-server", &uri, mode]);
        let Connection { sender: _sender, mut receiver } =
            Connection::connect(&uri.parse().expect("address"), &Config::default()).expect("connect");
        server.expect_line("CORRUPTED", Duration::from_secs(30));
        let deadline = Instant::now() + Duration::from_secs(if mode == "random" { 3 } else { 30 });
        let mut frames = 0;
        let end = loop {
            match receiver.recv(Some(deadline)) {
                Ok(_) => frames += 1,
                Err(e) => break e,
            }
        };
        println!("{mode}: {frames} frames, then {:?}: {end}", end.kind());
        if mode == "random" {
            // Random bytes may or may not hit a checked field before the deadline; what matters
            // is an error, never a crash.
            assert!(
                matches!(end.kind(), ErrorKind::Protocol | ErrorKind::Timeout | ErrorKind::MessageTooLarge),
                "{end}"
            );
        } else {
            assert_eq!(end.kind(), ErrorKind::Protocol, "{mode}: {end}");
            assert!(receiver.try_recv().is_err(), "{mode}: the connection stays closed");
        }
    }
}

/// Messages a client starts in pieces and does not finish take at most the server's
/// `max_reassembly` in sum: the piece that would go past it fails its own message (the other
/// messages, and the connection, go on), and bytes a CANCEL discards count no more.
#[test]
fn messages_in_pieces_take_at_most_max_reassembly_in_sum() {
    let uri = fresh_addr("reassembly");
    let cfg = Config { max_reassembly: Some(1 << 20), ..Config::default() };
    let listener = isthmus_shm::Listener::bind(&uri.parse().expect("address"), cfg).expect("bind");
    let mut client = Peer::spawn(&["pieces-client", &uri]);
    let mut receiver = listener.accept().expect("accept").receiver;
    client.expect_line("SENT", Duration::from_secs(30));
    let deadline = Some(Instant::now() + Duration::from_secs(30));
    let block = isthmus_tests::pattern(768 << 10, 0);
    let whole = |parts: &[usize]| parts.iter().flat_map(|&k| &block[..k << 10]).copied().collect::<Vec<u8>>();

    let first = receiver.recv(deadline).expect("stream 1");
    assert_eq!((first.stream, first.kind), (1, Kind::Message));
    assert!(first.body[..] == whole(&[512, 512]), "stream 1's message is intact");

    let refused = receiver.recv(deadline).expect_err("stream 3 goes past the bound");
    assert_eq!((refused.kind(), refused.stream()), (ErrorKind::MessageTooLarge, Some(3)), "{refused}");
    let text = refused.to_string();
    assert!(text.contains("1048576-byte message") && text.contains("limit of 1048576 bytes"), "{text}");
    assert!(text.contains("524288 held for other messages"), "{text}");

    let cancel = receiver.recv(deadline).expect("stream 5's CANCEL");
    assert_eq!((cancel.stream, cancel.kind), (5, Kind::Cancel));
    let after_cancel = receiver.recv(deadline).expect("stream 7: the cancelled bytes were given back");
    assert_eq!((after_cancel.stream, after_cancel.kind), (7, Kind::Message));
    assert!(after_cancel.body[..] == whole(&[768, 256]), "stream 7's message is intact");

    let last = receiver.recv(deadline).expect("the connection goes on");
    assert_eq!((last.stream, &last.body[..]), (9, &b"after"[..]));
}

/// A message in more pieces than one `try_recv` takes comes whole from the next, so a peer
/// streaming pieces never holds an event loop in one call; and a client that begins one message
/// in pieces more than a receiver keeps (256) is a protocol error that ends its connection, and
/// only its connection.
#[test]
fn pieces_past_the_receivers_bounds_end_only_their_connection() {
    let uri = fresh_addr("partials");
    let listener = isthmus_shm::Listener::bind(&uri.parse().expect("address"), Config::default()).expect("bind");
    let mut client = Peer::spawn(&["partials-client", &uri]);
    let mut receiver = listener.accept().expect("accept").receiver;
    client.expect_line("SENT", Duration::from_secs(30));

    // Every frame was published at once: the first call takes 256 of the 300 pieces.
    assert!(receiver.try_recv().expect("pieces").is_none(), "one call took more than 256 pieces");
    let message = receiver.try_recv().expect("the rest").expect("the message, from the next call");
    assert_eq!((message.stream, message.kind), (1, Kind::Message));
    let block = isthmus_tests::pattern(1024, 0);
    assert!(message.body.chunks(1024).all(|c| c == &block[..]) && message.body.len() == 300 << 10, "intact");

    let deadline = Some(Instant::now() + Duration::from_secs(30));
    let e = match receiver.recv(deadline) {
        Ok(f) => panic!("a frame on stream {} from a message begun in pieces", f.stream),
        Err(e) => e,
    };
    assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
    assert!(e.to_string().contains("more than 256 messages in pieces at once"), "{e}");
    assert_eq!(client.expect_line("ENDED", Duration::from_secs(30)), "ENDED PeerGone", "the client is told");

    // The listener serves the next client.
    let other = std::thread::spawn({
        let uri = uri.clone();
        move || Connection::connect(&uri.parse().expect("address"), &Config::default()).expect("connect")
    });
    let mut next = listener.accept().expect("the next client");
    let mine = other.join().expect("the client thread");
    mine.sender.send(Kind::Message, 0, 1, b"next", None).expect("send");
    assert_eq!(&next.receiver.recv(deadline).expect("recv").body[..], b"next");
}
