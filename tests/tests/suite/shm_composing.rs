//! A writer announces a large message while it writes it (ADR 0026): the announcement wakes a
//! reader that sleeps, and a reader trusts the announced size only to bound its spin.

use std::time::Duration;

use isthmus_shm::layout::{self, CLIENT_TO_SERVER};
use isthmus_shm::{flags, Address, Config, Connection, Listener, Receiver};
use isthmus_tests::{eventually, first_mismatch, fresh_addr, watchdog, Peer};

const SIZE: usize = 16 << 20;

fn field(line: &str, name: &str) -> u64 {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(name)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name}= in {line:?}"))
}

#[test]
fn a_large_block_is_announced_while_written_and_wakes_the_sleeping_reader() {
    watchdog(Duration::from_secs(120), || {
        let addr: Address = fresh_addr("composing").parse().expect("address");
        let listener = Listener::bind(&addr, Config::default()).expect("bind");
        let mut peer = Peer::spawn(&["composing-client", &addr.to_string(), &SIZE.to_string()]);
        let Connection { sender, mut receiver } = listener.accept().expect("accept");

        // A hostile or broken writer may announce anything: the reader's spin stays bounded,
        // and it goes to sleep (on `u64::MAX`, after 4 ms) like any reader with nothing to read.
        let announced = layout::control_base(CLIENT_TO_SERVER) + layout::CTL_COMPOSING;
        sender.scribble_for_tests(announced, &u64::MAX.to_le_bytes());
        let reader = std::thread::spawn(move || {
            let f = receiver.recv(None).expect("the block");
            (receiver, f)
        });
        assert!(
            eventually(Duration::from_secs(30), || sender.counters().sleeps >= 1),
            "a reader told of an endless message spun instead of sleeping"
        );
        sender.scribble_for_tests(announced, &0u64.to_le_bytes());

        sender.send_message(1, 0, b"go", None).expect("go");
        let line = peer.expect_line("ANNOUNCED", Duration::from_secs(60));
        assert_eq!(field(&line, "rung"), 1, "taking the block rang the sleeping reader: {line}");
        assert_eq!(field(&line, "composing"), SIZE as u64, "{line}");

        let (_receiver, f): (Receiver, _) = reader.join().expect("reader");
        assert_eq!(f.body.len(), SIZE);
        assert_eq!(f.flags & flags::END_STREAM, flags::END_STREAM);
        assert_eq!(first_mismatch(&f.body, SIZE as u64), None, "corrupted");
        let line = peer.expect_line("SENT", Duration::from_secs(60));
        assert_eq!(field(&line, "composing"), 0, "sending takes the announcement back: {line}");
        let line = peer.expect_line("DROPPED", Duration::from_secs(60));
        assert_eq!(field(&line, "composing"), 0, "dropping a block takes it back: {line}");
    });
}
