//! The systems under comparison. Each echo server runs in a child process (this binary, re-run
//! with a `serve-*` role), so every round trip crosses a real process boundary.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use isthmus_shm::{Address, Config, Connection, Kind, Listener, Receiver, Sender, SpinPolicy};

use crate::measure::{self, Budget, Sample};

/// One competitor.
pub trait System {
    /// The stable name written into results.json.
    fn name(&self) -> &'static str;
    /// One message in flight: send `size` bytes, wait for `size` bytes back.
    fn round_trip(&mut self, size: usize, budget: Budget) -> Sample;
    /// `inflight` messages kept in flight; `None` if the system has no such mode.
    fn pipelined(&mut self, _size: usize, _inflight: usize, _budget: Budget) -> Option<Sample> {
        None
    }
    /// One server stream of `size`-byte messages (about 256 MiB in all): per-message gaps, and
    /// messages per second as `rps`; `None` if the system has no such mode.
    fn stream(&mut self, _size: usize) -> Option<Sample> {
        None
    }
}

/// A child process that prints `READY` when it is set up and is killed on drop.
pub struct Server {
    child: Child,
    /// Its Unix sockets, removed on drop: a killed server leaves them behind.
    sockets: Vec<std::path::PathBuf>,
}

impl Server {
    /// Starts this binary in a server role. `ISTHMUS_BENCH_SERVER_WRAP` (a command and its
    /// arguments, split on spaces) runs the server under a profiler, e.g.
    /// `valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.server`.
    pub fn spawn(args: &[String]) -> Server {
        let exe = std::env::current_exe().expect("own path");
        let wrap = server_wrap().unwrap_or_default();
        let mut words = wrap.split_whitespace();
        let mut command = match words.next() {
            Some(tool) => {
                let mut c = Command::new(tool);
                c.args(words).arg(exe);
                c
            }
            None => Command::new(exe),
        };
        command.args(args);
        let mut server = Server::spawn_command(command, &format!("{args:?}"));
        server.sockets.extend(args.iter().filter_map(|a| shm_socket(a)));
        server
    }

    /// Starts `command` as a server that prints `READY` (a Python server, say).
    pub fn spawn_command(mut command: Command, what: &str) -> Server {
        let mut child = command.stdout(Stdio::piped()).spawn().unwrap_or_else(|e| panic!("spawn {what}: {e}"));
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("server output");
        assert_eq!(line.trim(), "READY", "server {what} failed to start");
        Server { child, sockets: Vec::new() }
    }

    /// This server, whose Unix socket `path` (a file, or an `shm://` address's socket) is
    /// removed when it is dropped. [`Server::spawn`] does this itself for the `shm://`
    /// addresses among its arguments.
    pub fn removing(mut self, path: &str) -> Server {
        self.sockets.push(shm_socket(path).unwrap_or_else(|| path.into()));
        self
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if server_wrap().is_some() {
            // A profiler writes its output when the process ends on SIGTERM, not on SIGKILL.
            // SAFETY: kill(2) with our own child's pid.
            unsafe { libc::kill(self.pid(), libc::SIGTERM) };
        } else {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
        for path in &self.sockets {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// The handshake socket of `arg`, if it is an `shm://` address.
fn shm_socket(arg: &str) -> Option<std::path::PathBuf> {
    arg.parse::<Address>().ok().map(|a| a.socket_path().to_owned())
}

/// The profiler command servers run under, if one is set.
fn server_wrap() -> Option<String> {
    std::env::var("ISTHMUS_BENCH_SERVER_WRAP").ok().filter(|w| !w.trim().is_empty())
}

pub fn ready() {
    println!("READY");
    let _ = std::io::stdout().flush();
}

pub fn unique(tag: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!("bench-{tag}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

// ---------------------------------------------------------------------------------------------
// isthmus-shm: echo through the transport.

fn shm_config(spin: Duration) -> Config {
    Config { spin: SpinPolicy { max: spin, ..SpinPolicy::default() }, ..Config::default() }
}

/// Server role: echo every MESSAGE on its stream.
pub fn serve_shm(addr: &str, spin_us: u64) {
    let addr: Address = addr.parse().expect("address");
    let listener = Listener::bind(&addr, shm_config(Duration::from_micros(spin_us))).expect("bind");
    ready();
    while let Ok(conn) = listener.accept() {
        std::thread::spawn(move || {
            let Connection { sender, mut receiver } = conn;
            while let Ok(f) = receiver.recv(None) {
                if f.kind != Kind::Message {
                    continue;
                }
                // Large replies are written into a block of our arena and the request is given
                // back before the reply goes out, so both sides reuse the same warm blocks.
                let len = f.body.len();
                let sent = if len > sender.inline_max() && len <= sender.max_block() / 2 {
                    sender.alloc(len, None).and_then(|mut block| {
                        isthmus_shm::copy_into_shared(&mut block, &f.body);
                        let (stream, flags) = (f.stream, f.flags);
                        drop(f);
                        sender.send_block(stream, flags, block, None)
                    })
                } else {
                    sender.send_message(f.stream, f.flags, &f.body, None)
                };
                if sent.is_err() {
                    break;
                }
            }
        });
    }
}

/// isthmus-shm echo, with a name per configuration (default, no spin, both on one core).
pub struct ShmEcho {
    name: &'static str,
    pub server: Server,
    sender: Sender,
    receiver: Receiver,
}

impl ShmEcho {
    pub fn start(name: &'static str, spin: Duration) -> ShmEcho {
        let addr = format!("shm://{}", unique("shm"));
        let server = Server::spawn(&["serve-shm".into(), addr.clone(), spin.as_micros().to_string()]);
        let conn = Connection::connect(&addr.parse().expect("address"), &shm_config(spin)).expect("connect");
        ShmEcho { name, server, sender: conn.sender, receiver: conn.receiver }
    }
}

impl System for ShmEcho {
    fn name(&self) -> &'static str {
        self.name
    }

    fn round_trip(&mut self, size: usize, budget: Budget) -> Sample {
        let payload = vec![0x5au8; size];
        let (sender, receiver) = (&self.sender, &mut self.receiver);
        measure::run(budget, size, || {
            sender.send_message(1, 0, &payload, None).expect("send");
            let f = receiver.recv(None).expect("echo");
            assert_eq!(f.body.len(), size);
        })
    }

    fn pipelined(&mut self, size: usize, inflight: usize, budget: Budget) -> Option<Sample> {
        let payload = vec![0x5au8; size];
        let (sender, receiver) = (&self.sender, &mut self.receiver);
        let mut sent_at = vec![Instant::now(); inflight];
        let total = (budget.max_iters * 4).max(inflight * 4);
        let mut lat = Vec::with_capacity(total);
        let start = Instant::now();
        for (s, at) in sent_at.iter_mut().enumerate() {
            *at = Instant::now();
            sender.send_message(s as u64, 0, &payload, None).expect("send");
        }
        let mut sent = inflight;
        while lat.len() < sent {
            let f = receiver.recv(None).expect("echo");
            let s = f.stream as usize;
            lat.push(sent_at[s].elapsed());
            if sent < total && start.elapsed() < budget.time {
                sent_at[s] = Instant::now();
                sender.send_message(s as u64, 0, &payload, None).expect("send");
                sent += 1;
            }
        }
        let n = lat.len();
        Some(measure::summarise(&mut lat, n, start.elapsed()))
    }
}

// ---------------------------------------------------------------------------------------------
// raw-uds: a length-prefixed echo over a Unix stream socket, the floor of socket IPC.

/// Server role: read `u64 length, bytes`, write them back.
pub fn serve_uds(path: &str) {
    serve_length_prefixed(path, 8, |head| u64::from_le_bytes(head.try_into().expect("8 bytes")) as usize)
}

/// The hand-made proxy an OpenResty user writes today, for `bench/lua_bench.py`: a Unix socket
/// with a 4-byte big-endian length before each message.
pub fn serve_uds_len4(path: &str) {
    serve_length_prefixed(path, 4, |head| u32::from_be_bytes(head.try_into().expect("4 bytes")) as usize)
}

/// An echo over a Unix socket of messages after a `head`-byte length, a thread per connection.
fn serve_length_prefixed(path: &str, head: usize, len: fn(&[u8]) -> usize) {
    let _ = std::fs::remove_file(path);
    let listener = UnixListener::bind(path).expect("bind");
    ready();
    while let Ok((mut s, _)) = listener.accept() {
        std::thread::spawn(move || {
            // The reply is the request as it came, length first: one write per message.
            let mut frame = vec![0u8; head];
            while s.read_exact(&mut frame[..head]).is_ok() {
                let n = len(&frame[..head]);
                frame.resize(head + n, 0);
                if s.read_exact(&mut frame[head..]).is_err() || s.write_all(&frame).is_err() {
                    break;
                }
            }
        });
    }
}

pub struct UdsEcho {
    _server: Server,
    stream: UnixStream,
    path: String,
}

impl UdsEcho {
    pub fn start() -> UdsEcho {
        let path = std::env::temp_dir().join(format!("{}.sock", unique("uds"))).display().to_string();
        let server = Server::spawn(&["serve-uds".into(), path.clone()]);
        let stream = UnixStream::connect(&path).expect("connect");
        UdsEcho { _server: server, stream, path }
    }

    /// A message as it travels: `u64 length, bytes`, built once and written in one call.
    fn frame(size: usize) -> Vec<u8> {
        let mut f = (size as u64).to_le_bytes().to_vec();
        f.resize(8 + size, 0x5a);
        f
    }

    fn recv(stream: &mut UnixStream, buf: &mut Vec<u8>) {
        let mut len = [0u8; 8];
        stream.read_exact(&mut len).expect("read");
        buf.resize(u64::from_le_bytes(len) as usize, 0);
        stream.read_exact(buf).expect("read");
    }
}

impl Drop for UdsEcho {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl System for UdsEcho {
    fn name(&self) -> &'static str {
        "raw-uds"
    }

    fn round_trip(&mut self, size: usize, budget: Budget) -> Sample {
        // The server reads a whole message before it answers, so writing it all and then
        // reading the answer cannot deadlock, at any size.
        let frame = Self::frame(size);
        let mut buf = Vec::with_capacity(size);
        let stream = &mut self.stream;
        measure::run(budget, size, || {
            stream.write_all(&frame).expect("write");
            Self::recv(stream, &mut buf);
        })
    }

    fn pipelined(&mut self, size: usize, inflight: usize, budget: Budget) -> Option<Sample> {
        let frame = Self::frame(size);
        let mut buf = Vec::new();
        let stream = &mut self.stream;
        let total = (budget.max_iters * 4).max(inflight * 4);
        let mut sent_at = std::collections::VecDeque::with_capacity(inflight);
        let mut lat = Vec::with_capacity(total);
        let start = Instant::now();
        for _ in 0..inflight {
            sent_at.push_back(Instant::now());
            stream.write_all(&frame).expect("write");
        }
        let mut sent = inflight;
        while lat.len() < sent {
            Self::recv(stream, &mut buf);
            lat.push(sent_at.pop_front().expect("in flight").elapsed());
            if sent < total && start.elapsed() < budget.time {
                sent_at.push_back(Instant::now());
                stream.write_all(&frame).expect("write");
                sent += 1;
            }
        }
        let n = lat.len();
        Some(measure::summarise(&mut lat, n, start.elapsed()))
    }
}

// ---------------------------------------------------------------------------------------------
// Floors: what two processes pay just to wake each other, and one memcpy.

fn inheritable_eventfd() -> OwnedFd {
    // SAFETY: eventfd takes scalars; flags 0 keeps the fd across exec for the child.
    let fd = unsafe { libc::eventfd(0, 0) };
    assert!(fd >= 0, "eventfd: {}", std::io::Error::last_os_error());
    // SAFETY: a fresh fd owned by nothing else.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

fn efd_write(fd: RawFd) {
    let one = 1u64;
    // SAFETY: `one` is valid for an 8-byte read.
    unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
}

fn efd_read(fd: RawFd) {
    let mut v = 0u64;
    // SAFETY: `v` is valid for an 8-byte write; a blocking eventfd read returns its count.
    unsafe { libc::read(fd, (&mut v as *mut u64).cast(), 8) };
}

/// Server role: wait on `ping`, signal `pong`, forever.
pub fn serve_eventfd(ping: RawFd, pong: RawFd) {
    ready();
    loop {
        efd_read(ping);
        efd_write(pong);
    }
}

/// Two processes waking each other through blocking eventfd reads: the sleep/wake floor.
pub struct FloorEventfd {
    _server: Server,
    ping: OwnedFd,
    pong: OwnedFd,
}

impl FloorEventfd {
    pub fn start() -> FloorEventfd {
        let (ping, pong) = (inheritable_eventfd(), inheritable_eventfd());
        let server =
            Server::spawn(&["serve-eventfd".into(), ping.as_raw_fd().to_string(), pong.as_raw_fd().to_string()]);
        FloorEventfd { _server: server, ping, pong }
    }
}

impl System for FloorEventfd {
    fn name(&self) -> &'static str {
        "floor-eventfd"
    }

    fn round_trip(&mut self, size: usize, budget: Budget) -> Sample {
        let (ping, pong) = (self.ping.as_raw_fd(), self.pong.as_raw_fd());
        measure::run(budget, size, || {
            efd_write(ping);
            efd_read(pong);
        })
    }
}

/// A memfd of `len` bytes that a child process inherits across exec.
fn inheritable_memfd(name: &std::ffi::CStr, len: usize) -> OwnedFd {
    // SAFETY: memfd_create with a valid name; flags 0 keeps the fd across exec.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), 0) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` was just created and is owned here.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ftruncate on our own memfd.
    assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) }, 0, "ftruncate");
    fd
}

/// A shared page two processes spin on: the floor of a cross-core round trip.
struct SharedPage(*mut AtomicU64);

impl SharedPage {
    fn map(fd: RawFd) -> SharedPage {
        // SAFETY: a fresh shared mapping of one page of `fd`, checked against MAP_FAILED.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), 4096, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
        };
        assert_ne!(p, libc::MAP_FAILED, "mmap");
        SharedPage(p.cast())
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        debug_assert!(i <= 2);
        // SAFETY: words 0 to 2 (128 bytes apart, the only ones used) lie inside the mapped
        // first page, which lives as long as `self`; atomics are how both processes touch it.
        unsafe { &*self.0.add(i * 16) }
    }
}

/// Server role: answer each new value of word 0 in word 1, spinning.
pub fn serve_spin(fd: RawFd) {
    let page = SharedPage::map(fd);
    let mut last = page.word(0).load(Ordering::Acquire);
    ready();
    loop {
        let v = page.word(0).load(Ordering::Acquire);
        if v != last {
            last = v;
            page.word(1).store(v, Ordering::Release);
        } else {
            std::hint::spin_loop();
        }
    }
}

/// The spinning peer holds a whole core while it lives, so it is started for each measurement
/// and killed after it, never left running beside the other systems.
pub struct FloorSpin {
    fd: OwnedFd,
    page: SharedPage,
    seq: u64,
}

impl FloorSpin {
    pub fn start() -> FloorSpin {
        let fd = inheritable_memfd(c"bench-spin", 4096);
        let page = SharedPage::map(fd.as_raw_fd());
        FloorSpin { fd, page, seq: 0 }
    }
}

impl System for FloorSpin {
    fn name(&self) -> &'static str {
        "floor-spin"
    }

    fn round_trip(&mut self, size: usize, budget: Budget) -> Sample {
        let server = Server::spawn(&["serve-spin".into(), self.fd.as_raw_fd().to_string()]);
        let (page, seq) = (&self.page, &mut self.seq);
        let sample = measure::run(budget, size, || {
            *seq += 1;
            page.word(0).store(*seq, Ordering::Release);
            while page.word(1).load(Ordering::Acquire) != *seq {
                std::hint::spin_loop();
            }
        });
        drop(server);
        sample
    }
}

/// The largest message [`FloorCopy`] moves (its segment holds two of them).
const COPY_MAX: usize = 256 << 20;

/// Server role: on each new value of word 0, copy `len` (word 2) bytes from buffer A into
/// buffer B, then answer in word 1, spinning. The echo server's work, with no transport.
pub fn serve_copy(fd: RawFd) {
    let seg = CopySegment::map(fd);
    let mut last = seg.page.word(0).load(Ordering::Acquire);
    ready();
    loop {
        let v = seg.page.word(0).load(Ordering::Acquire);
        if v != last {
            last = v;
            let len = seg.page.word(2).load(Ordering::Relaxed) as usize;
            // SAFETY: A and B are disjoint COPY_MAX-byte regions of the mapping and `len` is
            // at most COPY_MAX (the client writes only sizes it mapped for); nothing else
            // touches B while the client waits for this answer.
            let (a, b) = unsafe {
                let len = len.min(COPY_MAX);
                (std::slice::from_raw_parts(seg.a, len), std::slice::from_raw_parts_mut(seg.b, len))
            };
            // The transport's copy (streaming stores for large ones), as its echo makes.
            isthmus_shm::copy_into_shared(b, a);
            seg.page.word(1).store(v, Ordering::Release);
        } else {
            std::hint::spin_loop();
        }
    }
}

/// A control page and two message buffers in one shared memfd.
struct CopySegment {
    page: SharedPage,
    a: *mut u8,
    b: *mut u8,
}

impl Drop for CopySegment {
    fn drop(&mut self) {
        // The mapping would otherwise keep up to 512 MiB of the memfd resident for the rest of
        // the run.
        // SAFETY: the whole mapping made in `map`, unmapped once; `page`'s own drop does not
        // unmap (it does not own this mapping), and nothing uses these pointers afterwards.
        unsafe { libc::munmap(self.page.0.cast(), 4096 + 2 * COPY_MAX) };
    }
}

impl CopySegment {
    fn map(fd: RawFd) -> CopySegment {
        let len = 4096 + 2 * COPY_MAX;
        // SAFETY: a fresh shared mapping of the whole memfd, checked against MAP_FAILED.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
        };
        assert_ne!(p, libc::MAP_FAILED, "mmap");
        // The same advice as the transport's arenas (ADR 0023), so the floor is of the same
        // memory: huge pages where the host allows them for shared memory, else no change.
        // SAFETY: advice over this mapping only; it changes no contents and no validity.
        unsafe { libc::madvise(p, len, libc::MADV_HUGEPAGE) };
        let base = p.cast::<u8>();
        // SAFETY: both offsets lie inside the `len`-byte mapping.
        let (a, b) = unsafe { (base.add(4096), base.add(4096 + COPY_MAX)) };
        CopySegment { page: SharedPage(base.cast()), a, b }
    }
}

/// The physical floor of the transport's echo: the client copies the message into shared memory,
/// the server, spinning, copies it into a second shared buffer, and the client, spinning, sees
/// the answer. The same two copies (the transport's own, `copy_into_shared`) and two hand-overs
/// as `isthmus-shm-transport`, with no transport at all; what a round trip costs beyond this is
/// the transport's own.
///
/// [`FloorCopy::copying_out`] adds a third copy: the client copies the answer out of shared
/// memory into its own buffer, as a binding does that hands its language a string of its own
/// (Lua's `ffi.string`, Python's `bytes`). That is the floor of such a binding's echo.
pub struct FloorCopy {
    fd: OwnedFd,
    seg: CopySegment,
    seq: u64,
    copy_out: bool,
}

impl FloorCopy {
    pub fn start() -> FloorCopy {
        let fd = inheritable_memfd(c"bench-copy", 4096 + 2 * COPY_MAX);
        let seg = CopySegment::map(fd.as_raw_fd());
        FloorCopy { fd, seg, seq: 0, copy_out: false }
    }

    /// The floor with the answer copied out too (system `floor-copy-out`).
    pub fn copying_out() -> FloorCopy {
        FloorCopy { copy_out: true, ..FloorCopy::start() }
    }
}

impl System for FloorCopy {
    fn name(&self) -> &'static str {
        if self.copy_out {
            "floor-copy-out"
        } else {
            "floor-copy"
        }
    }

    fn round_trip(&mut self, size: usize, budget: Budget) -> Sample {
        assert!(size <= COPY_MAX);
        let server = Server::spawn(&["serve-copy".into(), self.fd.as_raw_fd().to_string()]);
        let payload = vec![0x5au8; size];
        let mut answer = vec![0u8; if self.copy_out { size } else { 0 }];
        let (seg, seq, copy_out) = (&self.seg, &mut self.seq, self.copy_out);
        seg.page.word(2).store(size as u64, Ordering::Relaxed);
        let sample = measure::run(budget, size, || {
            // SAFETY: A is a COPY_MAX-byte region of the mapping, `size` fits in it, and the
            // server does not read it until the store below.
            let a = unsafe { std::slice::from_raw_parts_mut(seg.a, size) };
            isthmus_shm::copy_into_shared(a, &payload);
            *seq += 1;
            seg.page.word(0).store(*seq, Ordering::Release);
            while seg.page.word(1).load(Ordering::Acquire) != *seq {
                std::hint::spin_loop();
            }
            if copy_out {
                // SAFETY: B is a COPY_MAX-byte region the server finished writing before its
                // store to word 1, which the load above acquired; it writes B again only after
                // the next store to word 0.
                let b = unsafe { std::slice::from_raw_parts(seg.b, size) };
                answer.copy_from_slice(b);
                std::hint::black_box(&mut answer);
            }
        });
        drop(server);
        sample
    }
}

/// One memcpy of `size` bytes between two warm buffers in one process, both starting on a
/// 64-byte line: memcpy at its best. Two `Vec`s of 64 KiB lie 16 bytes apart within a line,
/// where glibc's `rep movsb` ran 18x slower on an AMD EPYC host (ADR 0032), which made the
/// row no floor there.
pub struct Memcpy;

impl System for Memcpy {
    fn name(&self) -> &'static str {
        "memcpy"
    }

    fn round_trip(&mut self, size: usize, budget: Budget) -> Sample {
        let (mut src, mut dst) = (vec![0x5au8; size + 64], vec![0u8; size + 64]);
        let on_line = |v: &[u8]| v.as_ptr().align_offset(64);
        let (from, to) = (on_line(&src), on_line(&dst));
        let (src, dst) = (&mut src[from..from + size], &mut dst[to..to + size]);
        measure::run(budget, size, || {
            dst.copy_from_slice(std::hint::black_box(&*src));
            std::hint::black_box(&mut *dst);
        })
    }
}

/// Runs another system with it and this thread both pinned to CPU 0: the case where the
/// scheduler puts client and server on one core, and every spin only delays the peer.
pub struct SameCore<S> {
    pub name: &'static str,
    pub inner: S,
    pub server_pid: i32,
}

impl<S: System> SameCore<S> {
    fn pinned<T>(&mut self, f: impl FnOnce(&mut S) -> T) -> T {
        pin_process(self.server_pid, Some(0));
        pin(0, Some(0));
        let r = f(&mut self.inner);
        pin(0, None);
        pin_process(self.server_pid, None);
        r
    }
}

impl<S: System> System for SameCore<S> {
    fn name(&self) -> &'static str {
        self.name
    }

    fn round_trip(&mut self, size: usize, budget: Budget) -> Sample {
        self.pinned(|s| s.round_trip(size, budget))
    }
}

/// Pins every thread of process `pid` (see [`pin`]).
pub fn pin_process(pid: i32, cpu: Option<usize>) {
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            if let Some(tid) = t.file_name().to_str().and_then(|s| s.parse().ok()) {
                pin(tid, cpu);
            }
        }
    }
}

/// Pins thread `tid` (0 = the calling thread) to one CPU, or to all of them with `None`.
pub fn pin(tid: i32, cpu: Option<usize>) {
    // SAFETY: cpu_set_t is plain data; zeroed is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // Not available_parallelism(): it honours the current mask, so a pinned thread would only
    // ever "unpin" itself to its one CPU.
    // SAFETY: sysconf takes a scalar and has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }.max(1) as usize;
    for c in 0..n {
        if cpu.is_none_or(|want| want == c) {
            // SAFETY: `c` is below the number of CPUs, well inside cpu_set_t.
            unsafe { libc::CPU_SET(c, &mut set) };
        }
    }
    // SAFETY: `set` is a valid cpu_set_t of the size passed.
    unsafe { libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) };
}
