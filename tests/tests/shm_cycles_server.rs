//! A thousand clients connect and are killed; the server that survives them keeps no fd and no
//! mapping of theirs. (Alone in its test binary: it counts the whole process's fds and maps.)

use std::time::Duration;

use isthmus_shm::{Address, Config, Connection, ErrorKind, Listener};
use isthmus_tests::{fresh_addr, open_fds, segment_mappings, watchdog, Peer};

fn one_cycle(listener: &Listener, addr: &Address) {
    let mut peer = Peer::spawn(&["hang-client", &addr.to_string()]);
    let Connection { sender, mut receiver } = listener.accept().expect("accept");
    assert_eq!(&receiver.recv(None).expect("hello").body[..], b"hello");
    peer.kill9();
    let e = receiver.recv(None).expect_err("peer gone");
    assert_eq!(e.kind(), ErrorKind::PeerGone);
    drop((sender, receiver));
}

#[test]
fn a_thousand_connect_kill_cycles_leave_no_fd_or_mapping() {
    watchdog(Duration::from_secs(600), || {
        let addr: Address = fresh_addr("cycles").parse().expect("address");
        let listener = Listener::bind(&addr, Config::default()).expect("bind");
        one_cycle(&listener, &addr); // warm up lazily opened fds (e.g. /dev/urandom)
        let (fds, maps) = (open_fds(), segment_mappings());
        assert_eq!(maps, 0, "no segment is mapped between connections");
        for _ in 0..1000 {
            one_cycle(&listener, &addr);
        }
        assert_eq!(open_fds(), fds, "fds leaked");
        assert_eq!(segment_mappings(), maps, "mappings leaked");
        println!("1000 cycles: {fds} fds before and after, {maps} segment mappings");
    });
}
