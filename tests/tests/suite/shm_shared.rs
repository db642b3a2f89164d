//! The listener's shared arena (ADR 0016): one block written once reaches every client in place,
//! comes back when the last of them lets go, and a client that lies about it, or dies holding
//! it, harms no one else.

use std::time::{Duration, Instant};

use isthmus_shm::layout::{self, SERVER_TO_CLIENT};
use isthmus_shm::{Address, Config, Connection, ErrorKind, Listener, SharedArena, SharedBlock};
use isthmus_tests::{fill, fresh_addr, Peer};

const PATIENCE: Duration = Duration::from_secs(30);

fn listener(tag: &str, shared: usize) -> (Listener, String) {
    let uri = fresh_addr(tag);
    let cfg = Config { shared_arena_size: shared, ..Config::default() };
    (Listener::bind(&uri.parse::<Address>().expect("address"), cfg).expect("bind"), uri)
}

/// A block of `len` bytes patterned with `seed`.
fn block(arena: &SharedArena, len: usize, seed: u64) -> SharedBlock {
    let mut b = arena.try_alloc(len).expect("size").expect("room");
    fill(&mut b, seed);
    b.freeze()
}

#[test]
fn one_write_reaches_every_client_in_place() {
    let (listener, uri) = listener("shared-fan", 4 << 20);
    let arena = listener.shared_arena().expect("a shared arena").clone();
    const SUBS: usize = 3;
    const COUNT: usize = 20;
    let mut peers: Vec<Peer> = Vec::new();
    let mut conns = Vec::new();
    for _ in 0..SUBS {
        peers.push(Peer::spawn(&["shared-sink", &uri, &COUNT.to_string(), "0"]));
        conns.push(listener.accept().expect("accept"));
    }
    for k in 0..COUNT {
        // Sizes on both sides of the inline limit: the small ones go inline, as copies.
        let len = if k % 4 == 3 { 1000 } else { 100_000 + k };
        let b = block(&arena, len, k as u64);
        for c in &conns {
            c.sender.send_shared(1, 0, &b, None).expect("send");
        }
    }
    for p in &mut peers {
        for k in 0..COUNT {
            let line = p.expect_line("", PATIENCE);
            assert!(line.starts_with(&format!("GOT {k} ")), "message {k}: {line}");
        }
        p.expect_line("DONE", PATIENCE);
    }
    for c in &conns {
        let counters = c.sender.counters();
        assert_eq!(counters.shared_sent, 15, "every large message went by reference");
        assert_eq!(counters.arena_high_water, 0, "nothing was copied into the connection's arena");
    }
    // The peers exited after dropping every message; their releases wait on the rings until
    // someone drains them, which a full arena does.
    let big = arena.size() / 2;
    let first = arena.try_alloc(big).expect("size").expect("the released blocks came back");
    drop(first);
    drop(conns);
    assert_eq!(arena.in_use(), 0, "every block is free once the connections are gone");
}

#[test]
fn a_client_still_holding_a_block_gets_a_copy_instead() {
    let (listener, uri) = listener("shared-twice", 1 << 20);
    let arena = listener.shared_arena().expect("a shared arena").clone();
    let mut peer = Peer::spawn(&["shared-sink", &uri, "2", "1"]);
    let conn = listener.accept().expect("accept");
    let mut b = arena.try_alloc(50_000).expect("size").expect("room");
    fill(&mut b, 0);
    let b = b.freeze();
    conn.sender.send_shared(1, 0, &b, None).expect("first");
    // The same bytes again (seed 0 for message 1 would fail its check, so use a second block
    // for what the peer verifies, and check the counter on a repeat of the first).
    conn.sender.send_shared(1, 0, &b, None).expect("again");
    assert_eq!(conn.sender.counters().shared_sent, 1, "the second send, while the peer holds it, was a copy");
    assert!(peer.expect_line("GOT 0", PATIENCE).starts_with("GOT 0 50000"));
    let line = peer.expect_line("", PATIENCE);
    assert!(line.starts_with("BAD 1"), "message 1 carries seed 0's bytes, as sent: {line}");
    peer.expect_line("HOLDING", PATIENCE);
    assert_eq!(conn.sender.shared_lent(), 1);
}

#[test]
fn a_client_killed_while_holding_blocks_frees_them() {
    let (listener, uri) = listener("shared-kill", 1 << 20);
    let arena = listener.shared_arena().expect("a shared arena").clone();
    let mut holder = Peer::spawn(&["shared-sink", &uri, "4", "1"]);
    let held = listener.accept().expect("accept");
    let mut reader = Peer::spawn(&["shared-sink", &uri, "4", "0"]);
    let other = listener.accept().expect("accept");
    // Four blocks that fill the arena.
    for k in 0..4 {
        let b = block(&arena, 250_000, k);
        held.sender.send_shared(1, 0, &b, None).expect("send");
        other.sender.send_shared(1, 0, &b, None).expect("send");
    }
    holder.expect_line("HOLDING", PATIENCE);
    reader.expect_line("DONE", PATIENCE);
    assert_eq!(held.sender.shared_lent(), 4);
    assert!(arena.try_alloc(arena.size() / 2).expect("size").is_none(), "full while the holder lives");
    holder.child.kill().expect("kill -9");
    holder.child.wait().expect("reap");
    let (_held_sender, mut held_receiver) = held.split();
    assert_eq!(held_receiver.recv(Some(Instant::now() + PATIENCE)).expect_err("gone").kind(), ErrorKind::PeerGone);
    // A full arena drains every connection: the dead one forgets what it held, the live one
    // gives back what its reader released. Two halves need the whole arena.
    let half = arena.size() / 2;
    let a = arena.try_alloc(half).expect("size").expect("room");
    let b = arena.try_alloc(half).expect("size").expect("room once the dead holder's blocks are freed");
    assert_eq!(arena.in_use(), arena.size());
    drop((a, b));
    assert_eq!(arena.in_use(), 0);
    assert_eq!(held_receiver.recv(None).expect_err("still gone").kind(), ErrorKind::PeerGone);
}

#[test]
fn a_client_that_releases_what_it_does_not_hold_is_cut_off_alone() {
    for mode in ["never-sent", "twice", "wrong-length"] {
        let (listener, uri) = listener("shared-lie", 1 << 20);
        let arena = listener.shared_arena().expect("a shared arena").clone();
        let addr: Address = uri.parse().expect("address");
        let liar = std::thread::spawn({
            let addr = addr.clone();
            move || Connection::connect(&addr, &Config::default()).expect("connect")
        });
        let server_side = listener.accept().expect("accept");
        let mut liar = liar.join().expect("client");
        let honest = std::thread::spawn(move || Connection::connect(&addr, &Config::default()).expect("connect"));
        let honest_server = listener.accept().expect("accept");
        let mut honest = honest.join().expect("client");

        let b = block(&arena, 100_000, 9);
        server_side.sender.send_shared(1, 0, &b, None).expect("send");
        honest_server.sender.send_shared(1, 0, &b, None).expect("send");
        let got = liar.receiver.recv(Some(Instant::now() + PATIENCE)).expect("message");
        let l = liar.sender.layout_for_tests();
        let entry = |offset: u64, len: u64| {
            let mut e = [0u8; 16];
            e[0..8].copy_from_slice(&(offset | layout::SHARED_RELEASE).to_le_bytes());
            e[8..16].copy_from_slice(&len.to_le_bytes());
            e
        };
        let rel = l.rel_off[SERVER_TO_CLIENT];
        let tail = layout::control_base(SERVER_TO_CLIENT) + layout::CTL_REL_TAIL;
        match mode {
            "never-sent" => liar.sender.scribble_for_tests(rel, &entry(8 * 4096, 100_000)),
            "wrong-length" => liar.sender.scribble_for_tests(rel, &entry(0, 4096)),
            _ => {
                drop(got); // the honest release, at entry 0
                liar.sender.scribble_for_tests(rel + 16, &entry(0, 100_000));
                liar.sender.scribble_for_tests(tail, &2u64.to_le_bytes());
            }
        }
        if mode != "twice" {
            liar.sender.scribble_for_tests(tail, &1u64.to_le_bytes());
        }
        // The server reads its release ring before its next shared send.
        let next = block(&arena, 100_000, 10);
        let err = server_side.sender.send_shared(1, 0, &next, None).expect_err(mode);
        assert_eq!(err.kind(), ErrorKind::Protocol, "{mode}: {err}");
        // The honest client goes on.
        honest_server.sender.send_shared(1, 0, &next, None).expect("the honest connection is untouched");
        let first = honest.receiver.recv(Some(Instant::now() + PATIENCE)).expect("first");
        let second = honest.receiver.recv(Some(Instant::now() + PATIENCE)).expect("second");
        assert_eq!(isthmus_tests::first_mismatch(&first.body, 9), None, "{mode}");
        assert_eq!(isthmus_tests::first_mismatch(&second.body, 10), None, "{mode}");
    }
}

#[test]
fn a_server_without_a_shared_arena_sends_copies() {
    let (listener, uri) = listener("shared-none", 0);
    assert!(listener.shared_arena().is_none());
    // Every client could read all of it: a listener open to other users has none.
    let open = Config { peer_policy: isthmus_shm::PeerPolicy::Any, ..Config::default() };
    let addr: Address = fresh_addr("shared-any").parse().expect("address");
    assert!(Listener::bind(&addr, open).expect("bind").shared_arena().is_none());
    let (other, _) = listener_pair();
    let arena = other.shared_arena().expect("arena").clone();
    let mut peer = Peer::spawn(&["shared-sink", &uri, "1", "0"]);
    let conn = listener.accept().expect("accept");
    assert!(conn.sender.shared_arena().is_none());
    conn.sender.send_shared(1, 0, &block(&arena, 70_000, 0), None).expect("send");
    peer.expect_line("GOT 0 70000", PATIENCE);
    assert_eq!(conn.sender.counters().shared_sent, 0);
}

fn listener_pair() -> (Listener, String) {
    listener("shared-other", 1 << 20)
}

#[test]
fn a_client_still_reading_after_its_connection_ended_keeps_its_bytes() {
    let (listener, uri) = listener("shared-after", 1 << 20);
    let arena = listener.shared_arena().expect("a shared arena").clone();
    let mut reader = Peer::spawn(&["shared-sink", &uri, "4", "2"]);
    let conn = listener.accept().expect("accept");
    for k in 0..4 {
        conn.sender.send_shared(1, 0, &block(&arena, 250_000, k), None).expect("send");
    }
    reader.expect_line("CLOSED", PATIENCE);
    let (sender, mut receiver) = conn.split();
    assert_eq!(receiver.recv(Some(Instant::now() + PATIENCE)).expect_err("closed").kind(), ErrorKind::PeerGone);
    drop((sender, receiver));
    // The four blocks stay the reader's while its process lives: nothing can be written there.
    assert!(arena.try_alloc(250_000).expect("size").is_none(), "the arena is still full");
    for _ in 0..50 {
        let line = reader.expect_line("", PATIENCE);
        assert!(line.starts_with("CHECKED"), "the reader saw its bytes change: {line}");
    }
    reader.child.kill().expect("kill");
    reader.child.wait().expect("reap");
    let b = arena.try_alloc(250_000).expect("size").expect("freed once the reader's process is gone");
    drop(b);
    assert_eq!(arena.in_use(), 0);
}
