//! A client outlives a hundred servers killed under it, and keeps nothing of theirs once its
//! connections and received views are gone. (Alone in its test binary: it counts the whole
//! process's fds and maps.)

use std::time::Duration;

use isthmus_shm::{Address, Config, Connection, ErrorKind};
use isthmus_tests::{fresh_addr, open_fds, segment_mappings, watchdog, Peer};

#[test]
fn a_client_survives_a_hundred_server_kills() {
    watchdog(Duration::from_secs(600), || {
        let uri = fresh_addr("srvcycles");
        let addr: Address = uri.parse().expect("address");
        let mut baseline = None;
        for _ in 0..100 {
            let mut server = Peer::spawn(&["echo-server", &uri]);
            {
                let mut c = Connection::connect(&addr, &Config::default()).expect("connect");
                c.sender.send_message(1, 0, &[1u8; 100_000], None).expect("send");
                let echo = c.receiver.recv(None).expect("echo"); // a view into the server's arena
                server.kill9();
                assert_eq!(c.receiver.recv(None).expect_err("gone").kind(), ErrorKind::PeerGone);
                assert_eq!(echo.body.len(), 100_000, "a received view outlives its sender");
            }
            let now = (open_fds(), segment_mappings());
            assert_eq!(now.1, 0, "the segment is unmapped once the connection and its views are dropped");
            assert_eq!(*baseline.get_or_insert(now), now, "fds leaked");
        }
    });
}
