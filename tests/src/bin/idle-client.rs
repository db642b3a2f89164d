//! A client process that waits for answers a server gives late, and reports the CPU it spent
//! meanwhile: `idle-client ADDR`, against `rpc-peer ADDR`.
//!
//! It waits for a unary call's answer that comes after 400 ms (`/test.Echo/After`), then for a
//! stream's messages that come every 100 ms (`/test.Echo/Every`: one at once, then five). For
//! each it prints `WAITED KIND WALL_MS CPU_MS` (after `READY`, once connected), the CPU being
//! this whole process's (every thread of its runtime and the engine's), then `DONE`. A waiting
//! call may spin for a few tens of µs; it must not keep a core busy until its answer comes.

use std::time::{Duration, Instant};

use isthmus::{CallOptions, Channel};

/// User and system CPU time of this process so far.
fn cpu() -> Duration {
    // SAFETY: `getrusage` writes a `rusage` we own; zeroed is a valid starting value for it.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        if libc::getrusage(libc::RUSAGE_SELF, &mut usage) != 0 {
            panic!("getrusage failed: {}", std::io::Error::last_os_error());
        }
        usage
    };
    let tv = |t: libc::timeval| Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64);
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

fn report(kind: &str, started: (Instant, Duration)) {
    let (wall, cpu) = (started.0.elapsed(), cpu() - started.1);
    println!("WAITED {kind} {} {}", wall.as_millis(), cpu.as_millis());
}

fn main() {
    let addr = std::env::args().nth(1).expect("address");
    // As a user's service runs: a multi-threaded runtime, calls on its workers.
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    rt.block_on(async move {
        let ch = Channel::connect(&addr).await.expect("connect");
        ch.unary("/test.Echo/After", &0u32.to_le_bytes(), CallOptions::default()).await.expect("a first call");
        println!("READY");

        let late = 400_000u32.to_le_bytes();
        let started = (Instant::now(), cpu());
        let r = ch.unary("/test.Echo/After", &late, CallOptions::default()).await.expect("the late unary call");
        report("unary", started);
        assert_eq!(&r.message[..], &late[..]);

        // Each wait for the next message begins just after one came, while the reader task may
        // still spin on the connection: where waits fell into a loop of asks and hand-backs.
        let every: Vec<u8> = [100_000u32.to_le_bytes(), 6u32.to_le_bytes()].concat();
        let mut call = ch.start("/test.Echo/Every", CallOptions::default()).await.expect("start");
        call.send_last(&every).await.expect("send");
        assert_eq!(call.recv().await.expect("recv").as_deref(), Some(&every[..]));
        let started = (Instant::now(), cpu());
        for _ in 0..5 {
            assert_eq!(call.recv().await.expect("recv").as_deref(), Some(&every[..]));
        }
        report("stream", started);
        println!("DONE");
    });
}
