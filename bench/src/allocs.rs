//! What one call costs besides time (issue 19, step 2): heap allocations on each side,
//! counted by this binary's allocator, and frames and doorbells from the connections'
//! counters. `isthmus-bench count-per-call [SIZE] [CALLS]` prints them for the engine's echo.
//!
//! The allocator counts only in a process that turned it on ([`start`]): the server role
//! `serve-isthmus-counting` does, and the client of `count-per-call`; everywhere else it is
//! the system allocator behind one relaxed load.

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
