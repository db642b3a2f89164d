//! A 2 GiB message through a 64 MiB arena: streamed in pieces, reassembled, intact.

use std::time::{Duration, Instant};

use isthmus_shm::{flags, Address, Config, Connection, Listener};
use isthmus_tests::{first_mismatch, fresh_addr, watchdog, Peer};

#[test]
fn two_gib_through_a_64_mib_arena() {
    const SIZE: usize = 2 << 30;
    watchdog(Duration::from_secs(600), || {
        let addr: Address = fresh_addr("big").parse().expect("address");
        let listener = Listener::bind(&addr, Config::default()).expect("bind");
        let mut peer = Peer::spawn(&["big-client", &addr.to_string(), &SIZE.to_string(), &(64usize << 20).to_string()]);
        let Connection { sender, mut receiver } = listener.accept().expect("accept");
        let start = Instant::now();
        let f = receiver.recv(None).expect("the whole message");
        let took = start.elapsed();
        assert_eq!(f.body.len(), SIZE);
        assert_eq!(f.flags & flags::END_STREAM, flags::END_STREAM, "END_STREAM rides on the last piece");
        assert_eq!(first_mismatch(&f.body, SIZE as u64), None, "corrupted");
        drop(f);
        sender.send_message(1, 0, b"ok", None).expect("reply");
        assert_eq!(peer.expect_line("REPLY", Duration::from_secs(60)), "REPLY ok");
        let counters = peer.expect_line("COUNTERS", Duration::from_secs(60));
        println!("2 GiB received in {took:?}; sender {counters}");
        let hw: u64 = counters.split("arena_high_water=").nth(1).and_then(|v| v.parse().ok()).expect("high water");
        assert!(hw <= 64 << 20, "never more than the arena in flight");
    });
}
