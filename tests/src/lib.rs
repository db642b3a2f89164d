//! Shared pieces of the cross-process tests: the payload pattern both processes agree on, fresh
//! addresses, the tests' runtime, and handles on spawned peer processes.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// splitmix64: a fast, well-mixed word sequence, so a payload's every byte depends on its seed
/// and position and a misplaced or stale chunk is caught.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Fills `buf` with the pattern for `seed`.
pub fn fill(buf: &mut [u8], seed: u64) {
    let mut words = buf.chunks_exact_mut(8);
    for (i, w) in (&mut words).enumerate() {
        w.copy_from_slice(&mix(seed ^ (i as u64).wrapping_mul(0x1000_0000_01b3)).to_le_bytes());
    }
    let rem = words.into_remainder();
    let tail = mix(!seed).to_le_bytes();
    rem.copy_from_slice(&tail[..rem.len()]);
}

/// A `len`-byte payload with the pattern for `seed`.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill(&mut v, seed);
    v
}

/// Index of the first byte of `buf` that breaks the pattern for `seed`, if any.
pub fn first_mismatch(buf: &[u8], seed: u64) -> Option<usize> {
    let mut words = buf.chunks_exact(8);
    for (i, w) in (&mut words).enumerate() {
        if w != mix(seed ^ (i as u64).wrapping_mul(0x1000_0000_01b3)).to_le_bytes() {
            return Some(i * 8);
        }
    }
    let rem = words.remainder();
    let tail = mix(!seed).to_le_bytes();
    (rem != &tail[..rem.len()]).then(|| buf.len() - rem.len())
}

/// A fresh `shm://` address no other test (or test run) uses.
pub fn fresh_addr(tag: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!("shm://t-{tag}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

/// A fresh unix socket path in the temp directory, unique like [`fresh_addr`].
pub fn fresh_socket(tag: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    std::env::temp_dir().join(format!(
        "isthmus-{tag}-{}-{}.sock",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ))
}

/// The tests' tokio runtime: multi-threaded, two workers (the machine has two cores).
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime")
}

/// A listening Unix socket that never accepts and whose backlog is full: a server that has
/// stopped accepting (hung, or stopped with SIGSTOP) under connections it never took. A
/// blocking `connect(2)` to it waits for room in the backlog. Its socket file is removed on
/// drop.
#[derive(Debug)]
pub struct FullBacklog {
    _listener: std::os::unix::net::UnixListener,
    _queued: Vec<std::os::unix::net::UnixStream>,
    path: Option<PathBuf>,
}

impl FullBacklog {
    /// Binds `path` and fills its backlog.
    pub fn bind(path: &std::path::Path) -> FullBacklog {
        let listener = std::os::unix::net::UnixListener::bind(path).expect("bind");
        let queued = FullBacklog::fill(&listener, || isthmus_shm::connect_unix(path, None));
        FullBacklog { _listener: listener, _queued: queued, path: Some(path.to_owned()) }
    }

    /// Binds `name` in Linux's abstract namespace and fills its backlog.
    pub fn bind_abstract(name: &[u8]) -> FullBacklog {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name).expect("abstract name");
        let listener = std::os::unix::net::UnixListener::bind_addr(&addr).expect("bind");
        let queued = FullBacklog::fill(&listener, || isthmus_shm::connect_unix_abstract(name, None));
        FullBacklog { _listener: listener, _queued: queued, path: None }
    }

    /// Connections the listener never accepts, until its backlog (made one place long) turns
    /// the next one away.
    fn fill(
        listener: &std::os::unix::net::UnixListener,
        connect: impl Fn() -> std::io::Result<std::os::unix::net::UnixStream>,
    ) -> Vec<std::os::unix::net::UnixStream> {
        use std::os::fd::AsRawFd;
        // SAFETY: a listening socket's backlog may be changed by listening again.
        assert_eq!(unsafe { libc::listen(listener.as_raw_fd(), 0) }, 0, "listen again");
        let mut queued = Vec::new();
        for _ in 0..64 {
            match connect() {
                Ok(s) => queued.push(s),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return queued,
                Err(e) => panic!("filling the backlog: {e}"),
            }
        }
        panic!("the backlog never filled");
    }
}

impl Drop for FullBacklog {
    fn drop(&mut self) {
        if let Some(path) = &self.path {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// A TCP proxy to `upstream` for tests of a network that misbehaves. It accepts at once and,
/// once open, forwards both ways. Held (made by [`TcpProxy::held`]) it leaves what each client
/// sends unread until [`TcpProxy::open`] (a TLS handshake then waits, its ClientHello in the
/// socket, as on a slow network). Frozen ([`TcpProxy::freeze`]) it reads what either side sends
/// and drops it, keeping every socket open: to both ends the connection is up and the other
/// side silent.
#[derive(Debug)]
pub struct TcpProxy {
    /// `127.0.0.1:PORT`, to connect to.
    pub addr: String,
    open: std::sync::Arc<std::sync::atomic::AtomicBool>,
    frozen: std::sync::Arc<std::sync::atomic::AtomicBool>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    acceptor: Option<std::thread::JoinHandle<()>>,
}

impl TcpProxy {
    /// A proxy that forwards from the start.
    pub fn to(upstream: String) -> TcpProxy {
        let proxy = TcpProxy::held(upstream);
        proxy.open();
        proxy
    }

    /// A proxy that holds its connections until [`TcpProxy::open`].
    pub fn held(upstream: String) -> TcpProxy {
        use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
        use std::sync::Arc;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        listener.set_nonblocking(true).expect("nonblocking");
        let addr = listener.local_addr().expect("address").to_string();
        let (open, frozen, stop) =
            (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        let (o, f, s) = (open.clone(), frozen.clone(), stop.clone());
        let acceptor = std::thread::spawn(move || {
            let mut waiting = Vec::new();
            while !s.load(SeqCst) {
                match listener.accept() {
                    Ok((client, _)) => waiting.push(client),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(5))
                    }
                    Err(e) => panic!("accept: {e}"),
                }
                if !o.load(SeqCst) {
                    continue;
                }
                for client in waiting.drain(..) {
                    client.set_nonblocking(false).expect("blocking");
                    let server = std::net::TcpStream::connect(&upstream).expect("connect upstream");
                    for (from, to) in [(&client, &server), (&server, &client)] {
                        let (from, to, f) =
                            (from.try_clone().expect("clone"), to.try_clone().expect("clone"), f.clone());
                        std::thread::spawn(move || pump(from, to, &f));
                    }
                }
            }
        });
        TcpProxy { addr, open, frozen, stop, acceptor: Some(acceptor) }
    }

    /// Forwards the connections held so far and every later one.
    pub fn open(&self) {
        self.open.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Drops what either side sends (`true`), or forwards it again (`false`).
    pub fn freeze(&self, on: bool) {
        self.frozen.store(on, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
    }
}

/// Copies `from` to `to` while the proxy is not frozen, drops what comes while it is; ends both
/// when either side closes. (Its sockets close with the test's peer and channel.)
fn pump(mut from: std::net::TcpStream, mut to: std::net::TcpStream, frozen: &std::sync::atomic::AtomicBool) {
    use std::io::{Read, Write};
    let mut buf = vec![0u8; 64 << 10];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) if !frozen.load(std::sync::atomic::Ordering::SeqCst) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Ok(_) => {}
        }
    }
    let _ = from.shutdown(std::net::Shutdown::Both);
    let _ = to.shutdown(std::net::Shutdown::Both);
}

/// Runs a test body on a fresh [`runtime`] under a 120 s watchdog: a hang fails instead of
/// stalling the suite.
pub fn run<F: std::future::Future<Output = ()>>(f: F) {
    runtime().block_on(async { tokio::time::timeout(Duration::from_secs(120), f).await.expect("watchdog") });
}

/// Sends once when dropped. Held in a handler's future, it tells a test when the engine drops
/// that future, as it does a cancelled call's.
#[derive(Debug)]
pub struct OnDrop(pub Option<tokio::sync::oneshot::Sender<()>>);

impl Drop for OnDrop {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

/// A drop signal for a handler's first call: `guard()` gives that call an [`OnDrop`] (later
/// calls an inert one), and the receiver completes when it is dropped.
pub fn first_call_dropped() -> (impl Fn() -> OnDrop + Send + Sync + 'static, tokio::sync::oneshot::Receiver<()>) {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let tx = std::sync::Mutex::new(Some(tx));
    (move || OnDrop(tx.lock().ok().and_then(|mut tx| tx.take())), rx)
}

/// Starts `tonic-peer` on `targets` (`http://…:0` gets a port from the system); returns it and
/// the address of each target as clients reach it, in order.
pub fn spawn_tonic_peer(targets: &[&str]) -> (Peer, Vec<String>) {
    let mut peer = Peer::spawn_bin("tonic-peer", targets);
    let addresses = targets
        .iter()
        .map(|t| {
            if t.starts_with("shm://") {
                (*t).to_owned()
            } else {
                // HTTP/2 endpoints are announced in the order they were given.
                let line = peer.expect_line("LISTENING ", Duration::from_secs(30));
                line["LISTENING ".len()..].to_owned()
            }
        })
        .collect();
    (peer, addresses)
}

/// A peer binary cargo built beside the test binaries (`target/<profile>/NAME`; tests live in
/// `target/<profile>/deps/`).
pub fn peer_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let profile_dir = exe.parent().and_then(|deps| deps.parent()).expect("target/<profile>");
    profile_dir.join(name)
}

/// The repository's root.
pub fn root() -> PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The Python stubs of the conformance proto, generated by grpcio-tools into a fresh folder
/// once per process, which removes it when it exits.
fn stubs() -> PathBuf {
    static STUBS: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    extern "C" fn remove_stubs() {
        if let Some(dir) = STUBS.get() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
    STUBS
        .get_or_init(|| {
            let out = generate_stubs();
            // SAFETY: `remove_stubs` is an `extern "C" fn()` that touches only a static and the
            // file system, as an exit handler may; registering it has no other precondition.
            unsafe { libc::atexit(remove_stubs) };
            out
        })
        .clone()
}

fn generate_stubs() -> PathBuf {
    let python = root().join(".venv/bin/python");
    assert!(python.exists(), "{} is missing: run `make python`", python.display());
    let out = std::env::temp_dir().join(format!("isthmus-pystubs-{}", std::process::id()));
    std::fs::create_dir_all(&out).expect("stub folder");
    let proto = root().join("tests/proto");
    let status = Command::new(&python)
        .args(["-m", "grpc_tools.protoc", &format!("-I{}", proto.display())])
        .arg(format!("--python_out={}", out.display()))
        .arg(format!("--grpc_python_out={}", out.display()))
        .arg(proto.join("conformance.proto"))
        .status()
        .expect("run grpc_tools.protoc");
    assert!(status.success(), "grpc_tools.protoc failed");
    out
}

/// A Python server of `kind` (`isthmus`, `isthmus-aio`: `python/tests/echo_server.py`) on all
/// three transports; its addresses as clients reach them. Needs the venv (`make python`).
pub fn python_server(kind: &str) -> (Peer, Vec<String>) {
    let (shm, unix) = (fresh_addr("py"), format!("unix://{}", fresh_socket("py").display()));
    let path = format!("{}:{}", stubs().display(), root().join("python/tests").display());
    let mut peer = Peer::command(
        Command::new(root().join(".venv/bin/python"))
            .args(["-m", "echo_server", kind, &shm, &unix, "http://127.0.0.1:0"])
            .env("PYTHONPATH", path),
    );
    let mut addresses = vec![shm];
    for _ in 0..2 {
        let line = peer.expect_line("LISTENING ", std::time::Duration::from_secs(30));
        addresses.push(line["LISTENING ".len()..].to_owned());
    }
    (peer, addresses)
}

/// A binary of the Go module (`go/cmd/NAME`), built by `make go-bins` into `target/go-bin`.
pub fn go_bin(name: &str) -> PathBuf {
    let path = root().join("target/go-bin").join(name);
    assert!(path.exists(), "{} is missing: run `make go-bins`", path.display());
    path
}

/// A spawned peer process; killed (SIGKILL) and reaped on drop. Its stdout lines arrive on a
/// channel, so waiting for one can give up instead of hanging the test run.
#[derive(Debug)]
pub struct Peer {
    pub child: Child,
    lines: std::sync::mpsc::Receiver<String>,
    reader: Option<std::thread::JoinHandle<()>>,
    /// The socket files its arguments name (`unix://…`, `shm://NAME`): a peer killed by SIGKILL
    /// leaves them behind, so dropping the peer removes those nobody has bound since.
    sockets: Vec<PathBuf>,
}

fn forward_lines(stdout: ChildStdout) -> (std::sync::mpsc::Receiver<String>, std::thread::JoinHandle<()>) {
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (rx, reader)
}

impl Peer {
    /// Starts `shm-peer ARGS…` and waits (up to 30 s) for it to print `READY`.
    pub fn spawn(args: &[&str]) -> Peer {
        Peer::spawn_bin("shm-peer", args)
    }

    /// Starts peer binary `bin` with `args` and waits (up to 30 s) for it to print `READY`.
    pub fn spawn_bin(bin: &str, args: &[&str]) -> Peer {
        Peer::command(Command::new(peer_bin(bin)).args(args))
    }

    /// Starts `command` (a peer of any kind: a Python server, say) and waits (up to 30 s) for
    /// it to print `READY`.
    pub fn command(command: &mut Command) -> Peer {
        let sockets = command.get_args().flat_map(|a| socket_files(&a.to_string_lossy())).collect();
        let mut child =
            command.stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().expect("spawn the peer process");
        let (lines, reader) = forward_lines(child.stdout.take().expect("piped stdout"));
        let mut p = Peer { child, lines, reader: Some(reader), sockets };
        p.expect_line("READY", Duration::from_secs(30));
        p
    }

    /// `rpc-peer` on a fresh `shm://` address (tagged `tag`) and a TCP port, with `args` after
    /// its addresses: the peer, its `shm://` address and its HTTP/2 one (`http://127.0.0.1:PORT`).
    pub fn rpc_peer_with_http(tag: &str, args: &[&str]) -> (Peer, String, String) {
        let shm = fresh_addr(tag);
        let addresses = format!("{shm},http://127.0.0.1:0");
        let mut peer = Peer::spawn_bin("rpc-peer", &[&[addresses.as_str()], args].concat());
        let http = peer.http_address();
        (peer, shm, http)
    }

    /// The address of the peer's next HTTP/2 endpoint, as it announces it (`LISTENING ADDRESS`).
    pub fn http_address(&mut self) -> String {
        self.expect_line("LISTENING ", Duration::from_secs(30))["LISTENING ".len()..].to_owned()
    }

    /// Reads stdout lines until one starts with `prefix`; returns it. Panics if the peer exits
    /// first or nothing matching arrives within `patience` (a watchdog, not a timing test).
    pub fn expect_line(&mut self, prefix: &str, patience: Duration) -> String {
        let end = Instant::now() + patience;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.starts_with(prefix) => return line,
                Ok(_) => continue,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    panic!("peer printed no {prefix:?} line within {patience:?}")
                }
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    panic!("peer exited before printing {prefix:?}")
                }
            }
        }
    }

    /// Every stdout line still to come, once the peer has closed its stdout (exited). Panics if
    /// that takes longer than `patience` (a watchdog, not a timing test).
    pub fn rest(&mut self, patience: Duration) -> Vec<String> {
        let end = Instant::now() + patience;
        let mut lines = Vec::new();
        loop {
            match self.lines.recv_timeout(end.saturating_duration_since(Instant::now())) {
                Ok(line) => lines.push(line),
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => return lines,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    panic!("peer still running after {patience:?}; it printed {lines:?}")
                }
            }
        }
    }

    /// SIGKILL, as a crash would; returns once the process and its stdout pipe are gone.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        remove_loopbacks_of(self.child.id());
        if let Some(reader) = self.reader.take() {
            let _ = reader.join(); // EOF on the pipe: the child is dead
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGSTOP; returns once every thread of the peer has stopped. (kill(2) returns at once,
    /// and a process stops only when one of its threads takes the signal: on a busy machine its
    /// other threads ran on for milliseconds, reading and answering.)
    pub fn stop(&self) {
        self.signal(libc::SIGSTOP);
        let tasks = format!("/proc/{}/task", self.pid());
        let stopped = eventually(Duration::from_secs(60), || {
            std::fs::read_dir(&tasks).is_ok_and(|d| d.flatten().all(|t| thread_stopped(&t.path())))
        });
        assert!(stopped, "the peer did not stop within 60 s");
    }

    /// SIGCONT: a stopped peer goes on.
    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    fn signal(&self, signal: i32) {
        let pid = i32::try_from(self.pid()).expect("a pid fits an i32");
        // SAFETY: kill(2) on the peer process this test started; it only sends a signal.
        assert_eq!(unsafe { libc::kill(pid, signal) }, 0, "kill({pid}, {signal})");
    }
}

/// Whether the thread `/proc/PID/task/TID` is stopped (or gone, or exiting).
fn thread_stopped(task: &std::path::Path) -> bool {
    let Ok(stat) = std::fs::read_to_string(task.join("stat")) else { return true };
    // The state follows the command's closing parenthesis (a command may hold spaces).
    let state = stat.rfind(')').and_then(|i| stat.as_bytes().get(i + 2).copied());
    matches!(state, None | Some(b't' | b'T' | b'Z' | b'X'))
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.kill9();
        // A test may have started a successor on the same address: its socket stays.
        let bound = bound_unix_paths();
        for socket in self.sockets.iter().filter(|s| !bound.contains(*s)) {
            let _ = std::fs::remove_file(socket);
        }
    }
}

/// Removes the private loopback sockets (`isthmus-loopback-PID-N`) of process `pid`, which is
/// gone: a server killed with SIGKILL leaves them in the runtime directory.
fn remove_loopbacks_of(pid: u32) {
    let prefix = format!("isthmus-loopback-{pid}-");
    let Ok(entries) = std::fs::read_dir(isthmus_shm::runtime_dir()) else { return };
    for entry in entries.flatten() {
        if entry.file_name().to_str().is_some_and(|n| n.starts_with(&prefix)) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// The paths of the Unix sockets bound in this network namespace (`/proc/net/unix`).
fn bound_unix_paths() -> std::collections::HashSet<PathBuf> {
    let table = std::fs::read_to_string("/proc/net/unix").unwrap_or_default();
    // Num RefCount Protocol Flags Type St Inode [Path]
    table.lines().skip(1).filter_map(|line| line.split_whitespace().nth(7)).map(PathBuf::from).collect()
}

/// The socket files a peer's argument names: `unix://` targets that lie in the temp directory
/// (where `fresh_socket` makes them), and `shm://NAME` ones (their sockets in the runtime
/// directory), alone or in a comma-separated list.
fn socket_files(arg: &str) -> Vec<PathBuf> {
    arg.split(',')
        .filter_map(|t| match t.strip_prefix("unix://") {
            Some(path) => Some(PathBuf::from(path)).filter(|p| p.starts_with(std::env::temp_dir())),
            None => {
                t.parse::<isthmus_shm::Address>().ok().filter(|a| a.is_named()).map(|a| a.socket_path().to_path_buf())
            }
        })
        .collect()
}

/// Runs `f` on a thread and fails the test if it has not finished within `limit`: a watchdog
/// for code that would otherwise deadlock silently. Not a timing assertion; limits are generous.
pub fn watchdog<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    let worker = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(v) => v,
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => match worker.join() {
            Err(panic) => std::panic::resume_unwind(panic),
            Ok(()) => unreachable!("the worker either sends or panics"),
        },
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!("watchdog: not finished after {limit:?}"),
    }
}

/// Counts this process's open fds.
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

/// Counts this process's mappings of isthmus segments.
pub fn segment_mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .map(|m| m.lines().filter(|l| l.contains("isthmus-segment")).count())
        .unwrap_or(0)
}

/// Waits until `cond` holds or `limit` passes; returns whether it held.
pub fn eventually(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    cond()
}

/// The conformance suite's service, generated by `tonic-prost-build` from
/// `proto/conformance.proto` (see `build.rs`).
#[allow(clippy::all, clippy::pedantic, missing_docs, unreachable_pub)]
pub mod conformance {
    tonic::include_proto!("conformance");

    /// The encoded `FileDescriptorSet` of `conformance.proto`, for server reflection.
    pub const DESCRIPTORS: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/conformance_descriptor.bin"));
}

/// Cases that run against any server of the conformance `Echo` service: `tonic-peer`, and the
/// Python servers of `python/tests/echo_server.py`.
pub mod cases {
    use tonic::codegen::tokio_stream::wrappers::ReceiverStream;
    use tonic::Request;

    use crate::conformance::echo_client::EchoClient;
    use crate::conformance::{EchoRequest, StreamRequest};
    use crate::{first_mismatch, pattern};

    /// A generated client on an isthmus channel to `addr`, with 64 MiB message limits.
    /// Over the transport `addr` names: an HTTP/2 address stays on HTTP/2 (the upgrade to
    /// `shm://` has tests of its own, `upgrade.rs`).
    pub async fn client(addr: &str) -> EchoClient<isthmus::Channel> {
        client_on(connect(addr).await)
    }

    /// A channel to `addr` that stays on the transport `addr` names.
    pub async fn connect(addr: &str) -> isthmus::Channel {
        isthmus::Channel::builder(addr).upgrade(false).connect().await.expect("connect")
    }

    /// A generated client on `channel`, with 64 MiB message limits.
    pub fn client_on(channel: isthmus::Channel) -> EchoClient<isthmus::Channel> {
        EchoClient::new(channel).max_decoding_message_size(64 << 20).max_encoding_message_size(64 << 20)
    }

    pub fn request(payload: Vec<u8>, seq: u64) -> EchoRequest {
        EchoRequest { payload, seq, ..EchoRequest::default() }
    }

    /// A bidi call to `addr` given up midway: one message echoed, then the response dropped
    /// while the request stream stays open (the sender returned), so the handler, waiting for
    /// the next request, can only end by the cancel.
    pub async fn bidi_given_up(addr: &str) -> tokio::sync::mpsc::Sender<EchoRequest> {
        let mut c = client(addr).await;
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        // Sent before the call is awaited: the call returns once the response opens, and a
        // server that reads first (grpc-go's, grpcio's, isthmus's Go and Python ones) opens it
        // with its first reply.
        tx.send(request(b"first".to_vec(), 1)).await.expect("send");
        let mut replies = c.bidi(ReceiverStream::new(rx)).await.expect("bidi").into_inner();
        assert_eq!(replies.message().await.expect("echo").expect("reply").payload, b"first");
        tx
    }

    /// Failing calls carry their code, message and trailers.
    pub async fn failures_carry_their_status(addr: &str) {
        let mut c = client(addr).await;
        for code in
            [tonic::Code::InvalidArgument, tonic::Code::NotFound, tonic::Code::Unavailable, tonic::Code::DataLoss]
        {
            let req = EchoRequest { fail_with: code as i32, fail_message: format!("{addr} ✓"), ..Default::default() };
            let s = c.unary(req).await.expect_err("fails");
            assert_eq!((s.code(), s.message()), (code, format!("{addr} ✓").as_str()));
            assert_eq!(s.metadata().get("x-failed").and_then(|v| v.to_str().ok()), Some("yes"), "{addr}");
        }
    }

    /// Every kind of call, with metadata both ways and a 16 MiB message each way.
    pub async fn every_kind_of_call(addr: &str) {
        every_kind_of_call_on(connect(addr).await).await;
    }

    /// [`every_kind_of_call`] on a channel made by the caller (with TLS, say).
    pub async fn every_kind_of_call_on(channel: isthmus::Channel) {
        let addr = format!("{channel:?}");
        {
            let mut c = client_on(channel);

            // Unary, with ascii and binary metadata both ways.
            let mut req = Request::new(request(b"hello".to_vec(), 7));
            req.metadata_mut().insert("x-echo", "hi".parse().expect("ascii"));
            req.metadata_mut().insert_bin("x-echo-bin", tonic::metadata::MetadataValue::from_bytes(&[0u8, 1, 255]));
            let reply = c.unary(req).await.expect("unary");
            assert_eq!(reply.metadata().get("x-echo").and_then(|v| v.to_str().ok()), Some("hi"));
            assert_eq!(
                reply.metadata().get_bin("x-echo-bin").and_then(|v| v.to_bytes().ok()).as_deref(),
                Some(&[0u8, 1, 255][..])
            );
            let reply = reply.into_inner();
            assert_eq!((reply.payload.as_slice(), reply.seq, reply.time_left_ms), (&b"hello"[..], 7, -1));

            // Server streaming, some messages through the arena.
            let mut stream =
                c.server_stream(StreamRequest { count: 100, size: 20_000 }).await.expect("stream").into_inner();
            let mut n = 0u64;
            while let Some(r) = stream.message().await.expect("message") {
                assert_eq!((r.seq, r.payload.len(), first_mismatch(&r.payload, n)), (n, 20_000, None));
                n += 1;
            }
            assert_eq!(n, 100);

            // Client streaming.
            let requests: Vec<EchoRequest> = (0..300u64).map(|i| request(pattern(3000, i), i)).collect();
            let summary = c.client_stream(tonic::codegen::tokio_stream::iter(requests)).await.expect("client stream");
            assert_eq!((summary.get_ref().count, summary.get_ref().bytes), (300, 900_000));

            // Bidi: each echo comes back before the next request goes.
            // The first request goes before the call is awaited (see `bidi_given_up`).
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            tx.send(request(pattern(0, 0), 0)).await.expect("send");
            let mut replies = c.bidi(ReceiverStream::new(rx)).await.expect("bidi").into_inner();
            for i in 0..50u64 {
                if i > 0 {
                    tx.send(request(pattern(i as usize * 100, i), i)).await.expect("send");
                }
                let r = replies.message().await.expect("echo").expect("a reply");
                assert_eq!((r.seq, first_mismatch(&r.payload, i)), (i, None));
            }
            drop(tx);
            assert!(replies.message().await.expect("end").is_none());

            // A 16 MiB message each way.
            let big = pattern(16 << 20, 5);
            let reply = c.unary(request(big, 5)).await.expect("big unary").into_inner();
            assert_eq!((reply.payload.len(), first_mismatch(&reply.payload, 5)), (16 << 20, None), "{addr}");
        }
    }
}
