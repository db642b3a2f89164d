//! What one call costs besides time (issue 19, step 2): heap allocations on each side,
//! counted by this binary's allocator, and frames and doorbells from the connections'
//! counters. `isthmus-bench count-per-call [SIZE] [CALLS]` prints them for the engine's echo.
//!
//! The allocator counts only in a process that turned it on ([`start`]): the server role
//! `serve-isthmus-counting` does, and the client of `count-per-call`; everywhere else it is
//! the system allocator behind one relaxed load.
//!
//! `bench/count_per_call.py` counts the same from outside, for the Python client and the tonic
//! bridge as well (uprobes on the C library's allocator, system calls by kind); its clients here
//! are [`client`]'s.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// The system allocator, counting allocations (`alloc`, `alloc_zeroed` and `realloc`) once
/// [`start`]ed.
pub struct Counting;

static ON: AtomicBool = AtomicBool::new(false);
static ALLOCS: AtomicU64 = AtomicU64::new(0);

fn counted() {
    if ON.load(Ordering::Relaxed) {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
    }
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so each
// keeps `System`'s guarantees; counting touches only atomics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        counted();
        // SAFETY: as `GlobalAlloc::alloc`'s caller promised.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        counted();
        // SAFETY: as `GlobalAlloc::alloc_zeroed`'s caller promised.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        counted();
        // SAFETY: as `GlobalAlloc::realloc`'s caller promised.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as `GlobalAlloc::dealloc`'s caller promised.
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// Turns counting on in this process.
pub fn start() {
    ON.store(true, Ordering::Relaxed);
}

/// Allocations counted so far.
pub fn count() -> u64 {
    ALLOCS.load(Ordering::Relaxed)
}

/// The method of the counting server that answers with its process's count (8 bytes LE).
pub const COUNT_PATH: &str = "/bench.Stats/Allocations";

/// The engine's echo of `size` bytes, `calls` times: allocations per call on each side, and
/// frames and doorbells per call on the client's connection.
pub fn per_call(size: usize, calls: u64) {
    start();
    let addr = format!("shm://{}", crate::system::unique("count"));
    let _server = crate::system::Server::spawn(&["serve-isthmus-counting".into(), addr.clone()]);
    let channel = isthmus::blocking::Channel::connect(&addr).expect("connect");
    let payload = vec![0x5au8; size];
    let echo = || {
        let r = channel.unary(crate::rpc::PATH, &payload, Default::default()).expect("echo");
        assert_eq!(r.message.len(), size);
    };
    let server_count = || {
        let r = channel.unary(COUNT_PATH, &[], Default::default()).expect("count");
        u64::from_le_bytes(r.message[..].try_into().expect("8 bytes"))
    };
    for _ in 0..10_000 {
        echo(); // connections, pools and maps grown
    }
    // What asking costs the server, to take off: two asks in a row.
    let (a, b) = (server_count(), server_count());
    let ask = b - a;
    let (server0, client0, frames0) = (server_count(), count(), channel.counters().transport);
    for _ in 0..calls {
        echo();
    }
    let (client1, frames1) = (count(), channel.counters().transport);
    let server1 = server_count();
    let per = |n: u64| n as f64 / calls as f64;
    println!(
        "{size} B echo, {calls} calls: allocations per call: client {:.2}, server {:.2}; \
         frames per call: sent {:.2}, received {:.2}; doorbells rung per call {:.3}, sleeps {:.3}",
        per(client1 - client0),
        per(server1 - server0 - ask),
        per(frames1.frames_sent - frames0.frames_sent),
        per(frames1.frames_received - frames0.frames_received),
        per(frames1.doorbells_rung - frames0.doorbells_rung),
        per(frames1.sleeps - frames0.sleeps),
    );
}

/// `count-client engine|tonic ADDR SIZE CALLS`: a client for `bench/count_per_call.py`, which
/// counts this process's allocations and system calls from outside. It prints `READY` once
/// warm, makes `CALLS` echo calls of `SIZE` bytes when a line arrives on stdin, prints
/// `DONE FRAMES_SENT FRAMES_RECEIVED DOORBELLS_RUNG SLEEPS` (this side's transport counters over
/// those calls) and exits at the next line. `engine` is the blocking client (`isthmus-rust`),
/// `tonic` a tonic client on an `isthmus::Channel` (`tonic-isthmus-shm`).
pub fn client(args: &[String]) {
    use std::io::BufRead;
    let [kind, addr, size, calls] = args else { panic!("count-client engine|tonic ADDR SIZE CALLS") };
    let size: usize = size.parse().expect("size");
    let calls: u64 = calls.parse().expect("calls");
    let payload = vec![0x5au8; size];
    let go = || {
        let mut line = String::new();
        std::io::stdin().lock().read_line(&mut line).expect("stdin");
    };
    let report = |before: isthmus_shm::Counters, after: isthmus_shm::Counters| {
        println!(
            "DONE {} {} {} {}",
            after.frames_sent - before.frames_sent,
            after.frames_received - before.frames_received,
            after.doorbells_rung - before.doorbells_rung,
            after.sleeps - before.sleeps
        );
    };
    match kind.as_str() {
        "engine" => {
            let channel = isthmus::blocking::Channel::connect(addr).expect("connect");
            let echo = || {
                let r = channel.unary(crate::rpc::PATH, &payload, Default::default()).expect("echo");
                assert_eq!(r.message.len(), size);
            };
            (0..10_000).for_each(|_| echo());
            crate::system::ready();
            go();
            let before = channel.counters().transport;
            (0..calls).for_each(|_| echo());
            report(before, channel.counters().transport);
        }
        "tonic" => {
            let rt = crate::rpc::runtime();
            let channel = rt.block_on(isthmus::Channel::connect(addr)).expect("connect");
            let payload = bytes::Bytes::from(payload);
            // In a task of the runtime, as a tonic user's code runs.
            let run = |n: u64| {
                let (channel, payload) = (channel.clone(), payload.clone());
                rt.block_on(rt.spawn(async move {
                    for _ in 0..n {
                        assert_eq!(crate::rpc::tonic_echo(channel.clone(), payload.clone()).await, size);
                    }
                }))
                .expect("client task")
            };
            run(10_000);
            crate::system::ready();
            go();
            let before = channel.counters().transport;
            run(calls);
            report(before, channel.counters().transport);
        }
        other => panic!("count-client: no client {other}"),
    }
    let _ = std::io::Write::flush(&mut std::io::stdout());
    go();
}
