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

/// Runs a test body on a fresh [`runtime`] under a 120 s watchdog: a hang fails instead of
/// stalling the suite.
pub fn run<F: std::future::Future<Output = ()>>(f: F) {
    runtime().block_on(async { tokio::time::timeout(Duration::from_secs(120), f).await.expect("watchdog") });
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

/// A spawned peer process; killed (SIGKILL) and reaped on drop. Its stdout lines arrive on a
/// channel, so waiting for one can give up instead of hanging the test run.
#[derive(Debug)]
pub struct Peer {
    pub child: Child,
    lines: std::sync::mpsc::Receiver<String>,
    reader: Option<std::thread::JoinHandle<()>>,
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
        let mut child =
            command.stdout(Stdio::piped()).stderr(Stdio::inherit()).spawn().expect("spawn the peer process");
        let (lines, reader) = forward_lines(child.stdout.take().expect("piped stdout"));
        let mut p = Peer { child, lines, reader: Some(reader) };
        p.expect_line("READY", Duration::from_secs(30));
        p
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

    /// SIGKILL, as a crash would; returns once the process and its stdout pipe are gone.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(reader) = self.reader.take() {
            let _ = reader.join(); // EOF on the pipe: the child is dead
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.kill9();
    }
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
    pub async fn client(addr: &str) -> EchoClient<isthmus::Channel> {
        let channel = isthmus::Channel::connect(addr).await.expect("connect");
        EchoClient::new(channel).max_decoding_message_size(64 << 20).max_encoding_message_size(64 << 20)
    }

    pub fn request(payload: Vec<u8>, seq: u64) -> EchoRequest {
        EchoRequest { payload, seq, ..EchoRequest::default() }
    }

    /// Every kind of call, with metadata both ways and a 16 MiB message each way.
    pub async fn every_kind_of_call(addr: &str) {
        {
            let mut c = client(addr).await;

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
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            let mut replies = c.bidi(ReceiverStream::new(rx)).await.expect("bidi").into_inner();
            for i in 0..50u64 {
                tx.send(request(pattern(i as usize * 100, i), i)).await.expect("send");
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
