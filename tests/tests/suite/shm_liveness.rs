//! A peer that dies wakes every waiter on the other side at once.

use std::time::{Duration, Instant};

use isthmus_shm::{Config, Connection, ErrorKind, Listener};
use isthmus_tests::{eventually, fresh_addr, watchdog, Peer};

/// Generous on purpose: the wake-up takes microseconds; the bound only catches "never".
const WAKE_BOUND: Duration = Duration::from_secs(1);

#[test]
fn server_kill9_wakes_every_blocked_client_wait() {
    let addr = fresh_addr("srvkill");
    let mut peer = Peer::spawn(&["sink-server", &addr]);
    let addr = addr.parse().expect("address");
    let cfg = Config { ring_size: 4096, arena_size: 1 << 20, inline_max: 512, ..Config::default() };
    let Connection { sender, mut receiver } = Connection::connect(&addr, &cfg).expect("connect");
    peer.expect_line("ACCEPTED", Duration::from_secs(30));

    // The sink never reads: fill the ring until a sender blocks, and the arena until an
    // allocation blocks, and have the receiver block too.
    let (tx, rx) = std::sync::mpsc::channel();
    let ring_sender = sender.clone();
    let t1 = tx.clone();
    std::thread::spawn(move || {
        let r = (0..).try_for_each(|i| ring_sender.send_message(i, 0, &[0u8; 256], None));
        t1.send(("ring", Instant::now(), r.expect_err("send must fail").kind())).expect("report");
    });
    let arena_sender = sender.clone();
    let t2 = tx.clone();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        let r = loop {
            match arena_sender.alloc(256 << 10, None) {
                Ok(b) => held.push(b),
                Err(e) => break e,
            }
        };
        t2.send(("arena", Instant::now(), r.kind())).expect("report");
    });
    std::thread::spawn(move || {
        let r = receiver.recv(None);
        tx.send(("recv", Instant::now(), r.expect_err("recv must fail").kind())).expect("report");
    });
    // The waits begin (on a busy machine the threads may take a while to get there); the sleep
    // lets all three fall asleep.
    let waiting = || sender.counters().ring_full_waits > 0 || sender.counters().arena_full_waits > 0;
    assert!(eventually(Duration::from_secs(30), waiting), "neither the ring nor the arena filled");
    std::thread::sleep(Duration::from_millis(300));

    let killed = Instant::now();
    peer.kill9();
    for _ in 0..3 {
        let (what, when, kind) = rx.recv_timeout(Duration::from_secs(30)).expect("every waiter wakes");
        let after = when.saturating_duration_since(killed);
        println!("{what} wait ended {after:?} after kill -9: {kind:?}");
        assert_eq!(kind, ErrorKind::PeerGone, "{what}");
        assert!(after < WAKE_BOUND, "{what} took {after:?}");
    }
    let e = sender.send_message(1, 0, b"x", None).expect_err("the connection is dead");
    assert_eq!(e.kind(), ErrorKind::PeerGone);
    assert_eq!(sender.check_alive().expect_err("dead").kind(), ErrorKind::PeerGone);
}

#[test]
fn check_alive_sees_a_dead_peer_without_any_wait() {
    let addr = fresh_addr("alive");
    let mut peer = Peer::spawn(&["echo-server", &addr]);
    let Connection { sender, receiver: _receiver } =
        Connection::connect(&addr.parse().expect("address"), &Config::default()).expect("connect");
    sender.check_alive().expect("alive");
    peer.kill9();
    // Nobody is waiting on this connection; one look at the socket must notice.
    assert!(eventually(Duration::from_secs(30), || sender.check_alive().is_err()));
    assert_eq!(sender.check_alive().expect_err("dead").kind(), ErrorKind::PeerGone);
}

#[test]
fn client_kill9_wakes_the_blocked_server() {
    let addr: isthmus_shm::Address = fresh_addr("clikill").parse().expect("address");
    let listener = Listener::bind(&addr, Config::default()).expect("bind");
    let mut peer = Peer::spawn(&["hang-client", &addr.to_string()]);
    let Connection { sender: _sender, mut receiver } = listener.accept().expect("accept");
    let hello = receiver.recv(None).expect("hello");
    assert_eq!(&hello.body[..], b"hello");
    let waiter = std::thread::spawn(move || {
        let r = receiver.recv(None);
        (Instant::now(), r.expect_err("recv must fail").kind())
    });
    std::thread::sleep(Duration::from_millis(200));
    let killed = Instant::now();
    peer.kill9();
    let (when, kind) = watchdog(Duration::from_secs(30), move || waiter.join().expect("waiter"));
    let after = when.saturating_duration_since(killed);
    println!("server recv ended {after:?} after the client's kill -9");
    assert_eq!(kind, ErrorKind::PeerGone);
    assert!(after < WAKE_BOUND, "took {after:?}");
}

#[test]
fn closing_locally_wakes_local_waiters_and_the_peer() {
    let addr = fresh_addr("close");
    let mut peer = Peer::spawn(&["echo-server", &addr]);
    let addr = addr.parse().expect("address");
    let Connection { sender, mut receiver } = Connection::connect(&addr, &Config::default()).expect("connect");
    let waiter = std::thread::spawn(move || receiver.recv(None).expect_err("closed").kind());
    std::thread::sleep(Duration::from_millis(100));
    sender.close();
    assert_eq!(watchdog(Duration::from_secs(30), move || waiter.join().expect("waiter")), ErrorKind::Closed);
    let line = peer.expect_line("CONN-END", Duration::from_secs(30));
    assert!(line.contains("PeerGone"), "{line}");
}

#[test]
fn a_deadline_ends_a_wait_and_the_connection_lives_on() {
    let addr = fresh_addr("deadline");
    let _peer = Peer::spawn(&["echo-server", &addr]);
    let addr = addr.parse().expect("address");
    let Connection { sender, mut receiver } = Connection::connect(&addr, &Config::default()).expect("connect");
    let e = receiver.recv(Some(Instant::now() + Duration::from_millis(50))).expect_err("nothing to receive");
    assert_eq!(e.kind(), ErrorKind::Timeout);
    assert!(!e.is_fatal());
    sender.send_message(1, 0, b"still here", None).expect("send");
    assert_eq!(&receiver.recv(None).expect("echo").body[..], b"still here");
}

#[test]
fn a_full_arena_or_ring_waits_only_until_the_callers_deadline() {
    let addr = fresh_addr("fullwait");
    let mut peer = Peer::spawn(&["sink-server", &addr]);
    let cfg = Config { ring_size: 4096, arena_size: 1 << 20, inline_max: 512, ..Config::default() };
    let Connection { sender, receiver: _receiver } =
        Connection::connect(&addr.parse().expect("address"), &cfg).expect("connect");
    peer.expect_line("ACCEPTED", Duration::from_secs(30));
    let soon = || Some(Instant::now() + Duration::from_millis(100));
    // The sink never releases: the arena runs out, and the wait ends at the deadline.
    let held: Vec<_> = (0..4).map(|_| sender.alloc(256 << 10, soon()).expect("room for four")).collect();
    let e = sender.alloc(256 << 10, soon()).expect_err("arena full");
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    drop(held); // unsent blocks come straight back
    sender.alloc(1 << 20, soon()).expect("the whole arena again");
    // The sink never reads: the ring fills, and the send ends at the deadline.
    let e = (0..).find_map(|i| sender.send_message(i, 0, &[0u8; 256], soon()).err()).expect("ring full");
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert!(!sender.is_closed(), "a deadline does not close the connection");
    assert!(sender.counters().ring_full_waits > 0 && sender.counters().arena_full_waits > 0);
}
