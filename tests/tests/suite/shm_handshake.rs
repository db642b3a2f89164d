//! Binding, connecting, versions and credentials.

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::Duration;

use isthmus_shm::handshake::{Hello, HelloKind, HELLO_LEN, PROTOCOL_VERSION};
use isthmus_shm::{features, Address, Config, Connection, ErrorKind, Listener, PeerPolicy};
use isthmus_tests::{fresh_addr, Peer};

fn round_trip(addr: &Address) {
    let mut c = Connection::connect(addr, &Config::default()).expect("connect");
    c.sender.send_message(1, 0, b"ping", None).expect("send");
    assert_eq!(&c.receiver.recv(None).expect("echo").body[..], b"ping");
}

#[test]
fn a_crashed_servers_socket_is_replaced_on_restart() {
    let uri = fresh_addr("stale");
    let addr: Address = uri.parse().expect("address");
    let mut first = Peer::spawn(&["echo-server", &uri]);
    round_trip(&addr);
    first.kill9();
    assert!(addr.socket_path().exists(), "kill -9 leaves the socket file behind");
    let _second = Peer::spawn(&["echo-server", &uri]);
    round_trip(&addr);
}

#[test]
fn a_live_servers_socket_is_not_taken() {
    let uri = fresh_addr("live");
    let _server = Peer::spawn(&["echo-server", &uri]);
    let e = Listener::bind(&uri.parse().expect("address"), Config::default()).expect_err("in use");
    assert_eq!(e.kind(), ErrorKind::AddrInUse, "{e}");
}

/// `isthmus_shm::connect_unix`: to a listener with room it connects however short the wait, and
/// the stream comes back with no timeout of its own; to a full backlog it gives up at the wait
/// (`TimedOut`), or at once without one (`WouldBlock`).
#[test]
fn a_bounded_unix_connect_connects_or_says_why_not() {
    let open = isthmus_tests::fresh_socket("open");
    let listener = UnixListener::bind(&open).expect("bind");
    let s = isthmus_shm::connect_unix(&open, Some(Duration::ZERO)).expect("room in the backlog");
    assert_eq!(s.write_timeout().expect("timeout"), None, "the connect's own timeout is left behind");
    drop((s, listener));
    let _ = std::fs::remove_file(&open);
    let full = isthmus_tests::fresh_socket("full-connect");
    let _stopped = isthmus_tests::FullBacklog::bind(&full);
    let e = isthmus_shm::connect_unix(&full, Some(Duration::from_millis(50))).expect_err("full");
    assert_eq!(e.kind(), std::io::ErrorKind::TimedOut, "{e}");
    let e = isthmus_shm::connect_unix(&full, None).expect_err("full");
    assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock, "{e}");
}

/// A server that has stopped accepting with its backlog full still holds its address, and
/// binding finds that out at once (a full backlog is a live server): the probe's `connect(2)`
/// waited for room in the backlog with no bound.
#[test]
fn a_stopped_servers_socket_with_a_full_backlog_is_not_taken() {
    let path = isthmus_tests::fresh_socket("stuffed");
    let _stopped = isthmus_tests::FullBacklog::bind(&path);
    let addr: Address = format!("shm://{}", path.display()).parse().expect("address");
    let (done, ended) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(Listener::bind(&addr, Config::default()).map(drop));
    });
    let bound = ended.recv_timeout(Duration::from_secs(30)).expect("binding hung in connect(2)");
    let e = bound.expect_err("in use");
    assert_eq!(e.kind(), ErrorKind::AddrInUse, "{e}");
}

#[test]
fn the_socket_is_removed_on_shutdown_and_the_directory_is_private() {
    let addr: Address = fresh_addr("tidy").parse().expect("address");
    let listener = Listener::bind(&addr, Config::default()).expect("bind");
    assert!(addr.socket_path().exists());
    let dir = addr.socket_path().parent().expect("dir");
    assert_eq!(std::fs::metadata(dir).expect("dir").permissions().mode() & 0o777, 0o700);
    drop(listener);
    assert!(!addr.socket_path().exists());
}

#[test]
fn connecting_to_nobody_names_the_address() {
    let addr: Address = fresh_addr("nobody").parse().expect("address");
    let e = Connection::connect(&addr, &Config::default()).expect_err("no server");
    assert_eq!(e.kind(), ErrorKind::NotFound);
    assert!(e.to_string().contains(&addr.to_string()), "{e}");
}

#[test]
fn the_server_refuses_another_version_and_names_both() {
    let uri = fresh_addr("vsrv");
    let mut server = Peer::spawn(&["echo-server", &uri]);
    let addr: Address = uri.parse().expect("address");
    let mut s = UnixStream::connect(addr.socket_path()).expect("connect");
    let mut hello = Hello::new(HelloKind::Client);
    hello.version = 99;
    s.write_all(&hello.encode()).expect("send hello");
    let mut rec = [0u8; HELLO_LEN];
    s.read_exact(&mut rec).expect("answer");
    let answer = Hello::decode(&rec).expect("decodes");
    assert_eq!(answer.kind, HelloKind::Refuse);
    let mut reason = vec![0u8; answer.reason_len as usize];
    s.read_exact(&mut reason).expect("reason");
    let reason = String::from_utf8(reason).expect("utf-8");
    assert!(reason.contains("version 99") && reason.contains(&format!("version {PROTOCOL_VERSION}")), "{reason}");
    let line = server.expect_line("ACCEPT-ERROR", Duration::from_secs(30));
    assert!(line.contains("VersionMismatch") && line.contains("version 99"), "{line}");
    round_trip(&addr); // the server goes on
}

/// A fake server on a socket of its own: it reads the client's hello, answers with what `answer`
/// makes of it (and no fds), and reads the refusal the client then sends. Returns the directory to
/// remove, the address, and what the fake saw: the client's hello, the refusal's kind and reason.
fn fake_server(
    tag: &str,
    answer: impl FnOnce(&Hello) -> Hello + Send + 'static,
) -> (std::path::PathBuf, Address, std::thread::JoinHandle<(Hello, HelloKind, String)>) {
    let dir = std::env::temp_dir().join(format!("isthmus-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("fake.sock");
    let _ = std::fs::remove_file(&path);
    let fake = UnixListener::bind(&path).expect("bind fake server");
    let server = std::thread::spawn(move || {
        let (mut s, _) = fake.accept().expect("accept");
        let mut rec = [0u8; HELLO_LEN];
        s.read_exact(&mut rec).expect("client hello");
        let hello = Hello::decode(&rec).expect("decodes");
        s.write_all(&answer(&hello).encode()).expect("answer");
        let mut rec = [0u8; HELLO_LEN];
        s.read_exact(&mut rec).expect("refusal");
        let h = Hello::decode(&rec).expect("decodes");
        let mut reason = vec![0u8; h.reason_len as usize];
        s.read_exact(&mut reason).expect("reason");
        (hello, h.kind, String::from_utf8(reason).expect("utf-8"))
    });
    let addr: Address = format!("shm://{}", path.display()).parse().expect("address");
    (dir, addr, server)
}

#[test]
fn the_client_refuses_another_version_and_names_both() {
    let (dir, addr, server) = fake_server("vcli", |_| Hello { version: 99, ..Hello::new(HelloKind::Server) });
    let e = Connection::connect(&addr, &Config::default()).expect_err("refused");
    assert_eq!(e.kind(), ErrorKind::VersionMismatch);
    assert!(
        e.to_string().contains("version 99") && e.to_string().contains(&format!("version {PROTOCOL_VERSION}")),
        "{e}"
    );
    let (_, kind, reason) = server.join().expect("fake server");
    assert_eq!(kind, HelloKind::Refuse);
    assert!(reason.contains("version 99"), "{reason}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_server_grants_only_the_features_both_know_and_the_client_refuses_more() {
    // A client that offers every bit (future ones too) is granted those the server knows.
    let addr: Address = fresh_addr("features").parse().expect("address");
    let listener = Listener::bind(&addr, Config::default()).expect("bind");
    let server = std::thread::spawn(move || listener.accept().map(|c| c.sender.features()));
    let mut s = UnixStream::connect(addr.socket_path()).expect("connect");
    let mut hello = Hello::new(HelloKind::Client);
    hello.ring_size = [1 << 16, 0];
    hello.arena_size = [1 << 20, 0];
    hello.features = u16::MAX;
    s.write_all(&hello.encode()).expect("hello");
    let mut rec = [0u8; HELLO_LEN];
    s.read_exact(&mut rec).expect("server hello");
    let answer = Hello::decode(&rec).expect("decodes");
    assert_eq!((answer.kind, answer.features), (HelloKind::Server, features::ALL));
    assert_eq!(server.join().expect("server").expect("accepted"), features::ALL);
    // A server with a feature turned off does not grant it, and both sides agree.
    let addr: Address = fresh_addr("features-off").parse().expect("address");
    let listener = Listener::bind(&addr, Config { features: 0, ..Config::default() }).expect("bind");
    let server = std::thread::spawn(move || listener.accept().map(|c| c.sender.features()));
    let c = Connection::connect(&addr, &Config::default()).expect("connect");
    assert_eq!(c.sender.features(), 0);
    assert_eq!(server.join().expect("server").expect("accepted"), 0);

    // A server that grants what the client did not offer breaks the protocol.
    let (dir, addr, server) =
        fake_server("fcli", |_| Hello { features: features::UNARY_IN_ONE_FRAME, ..Hello::new(HelloKind::Server) });
    let e = Connection::connect(&addr, &Config { features: 0, ..Config::default() }).expect_err("refused");
    assert_eq!(e.kind(), ErrorKind::Protocol, "{e}");
    assert!(e.to_string().contains("granted features 0x0001"), "{e}");
    let (hello, kind, reason) = server.join().expect("fake server");
    assert_eq!((hello.features, kind), (0, HelloKind::Refuse));
    assert!(reason.contains("granted features"), "{reason}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A socket anyone may connect to, in a directory anyone may enter.
fn open_listener(tag: &str, policy: PeerPolicy) -> (Listener, Address, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("isthmus-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).expect("chmod dir");
    let addr: Address = format!("shm://{}/s.sock", dir.display()).parse().expect("address");
    let listener = Listener::bind(&addr, Config { peer_policy: policy, ..Config::default() }).expect("bind");
    std::fs::set_permissions(addr.socket_path(), std::fs::Permissions::from_mode(0o777)).expect("chmod socket");
    (listener, addr, dir)
}

fn running_as_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

#[test]
fn another_uid_is_refused_by_default_and_admitted_by_the_allow_list() {
    if !running_as_root() {
        println!("skipped: switching uid needs root");
        return;
    }
    let (listener, addr, dir) = open_listener("uid-deny", PeerPolicy::SameUid);
    let mut peer = Peer::spawn(&["client-as-uid", &addr.to_string(), "65534"]);
    let e = listener.accept().expect_err("uid 65534 is refused");
    assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
    assert!(e.to_string().contains("65534"), "{e}");
    let line = peer.expect_line("CONNECT-ERROR", Duration::from_secs(30));
    assert!(line.contains("PermissionDenied") && line.contains("65534"), "{line}");
    drop(listener);

    let (listener, addr, dir2) = open_listener("uid-allow", PeerPolicy::Uids(vec![65534]));
    let mut peer = Peer::spawn(&["client-as-uid", &addr.to_string(), "65534"]);
    let mut c = listener.accept().expect("uid 65534 is allowed");
    assert_eq!(c.sender.peer().uid, 65534);
    let f = c.receiver.recv(None).expect("ping");
    c.sender.send_message(f.stream, 0, &f.body, None).expect("echo");
    assert_eq!(peer.expect_line("CONNECTED", Duration::from_secs(30)), "CONNECTED ping");
    for d in [dir, dir2] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn no_file_appears_under_dev_shm() {
    let listing = || -> Vec<String> {
        std::fs::read_dir("/dev/shm")
            .map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
            .unwrap_or_default()
    };
    let before = listing();
    let uri = fresh_addr("devshm");
    let _server = Peer::spawn(&["echo-server", &uri]);
    let addr: Address = uri.parse().expect("address");
    let mut c = Connection::connect(&addr, &Config::default()).expect("connect");
    c.sender.send_message(1, 0, &vec![3u8; 1 << 20], None).expect("send through the arena");
    assert_eq!(c.receiver.recv(None).expect("echo").body.len(), 1 << 20);
    let after = listing();
    let new: Vec<_> = after.iter().filter(|f| !before.contains(f)).collect();
    assert!(new.is_empty(), "files appeared in /dev/shm: {new:?}");
}

#[test]
fn a_client_refuses_a_server_of_another_uid_unless_allowed() {
    if !running_as_root() {
        println!("skipped: switching uid needs root");
        return;
    }
    let dir = std::env::temp_dir().join(format!("isthmus-srvuid-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).expect("chmod dir");
    let addr: Address = format!("shm://{}/s.sock", dir.display()).parse().expect("address");
    let mut server = Peer::spawn(&["server-as-uid", &addr.to_string(), "65534"]);
    let e = Connection::connect(&addr, &Config::default()).expect_err("a server of uid 65534 is refused");
    assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{e}");
    assert!(e.to_string().contains("uid 65534"), "{e}");
    let line = server.expect_line("ACCEPT-ERROR", Duration::from_secs(30));
    assert!(line.contains("PeerGone"), "the client hung up before its hello: {line}");
    let allowed = Config { peer_policy: PeerPolicy::Uids(vec![65534]), ..Config::default() };
    let mut c = Connection::connect(&addr, &allowed).expect("allowed by the client's list");
    c.sender.send_message(1, 0, b"hi", None).expect("send");
    assert_eq!(&c.receiver.recv(None).expect("echo").body[..], b"hi");
    let _ = std::fs::remove_dir_all(&dir);
}
