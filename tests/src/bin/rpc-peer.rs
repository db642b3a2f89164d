//! The RPC server process of the cross-process engine tests: `rpc-peer ADDR [MAX_MESSAGE]`.
//!
//! Methods (all under `/test.Echo/`): `Unary` (echo, reflecting `x-echo`/`x-echo-bin` metadata into
//! headers and trailers), `ServerStream` (request `u32 count, u32 size`: that many patterned
//! messages), `EchoThenCancel` (echoes three messages, then ends the call with CANCELLED),
//! `ClientStream` (reply `u64 count, u64 bytes` of what arrived), `Bidi` (echo each),
//! `Fail` (request `u32 code`: that status, with details and a trailer), `Panic`, `Sleep` (never
//! returns; prints `SLEEP-DROPPED` when the server stops it), `TimeLeft` (milliseconds left),
//! `Slow` (prints `SLOW-STARTED`, answers after 500 ms), `Hog` (blocks its thread before its
//! first `.await`, as metadata `x-hog` says: `sleep:MS`, or `until-released`, which waits up to
//! 15 s for `/test.Admin/Release` and answers `released` or `not released`; Release answers
//! `released`, or `not-hogging` while no Hog waits), `After` (request `u32 µs`: its echo
//! after that long), `Every` (request `u32 µs, u32 count`: that many echoes, one every µs),
//! `InPlace` (request `u32 size`: a reply of that size built in place in shared memory), `Flood`
//! (64 KiB patterned messages until the call ends), `Stall` (never reads; returns only when
//! stopped); `/test.Admin/FloodSent`
//! answers `u64` messages `Flood` has sent so far; `/test.Admin/Shutdown` starts a graceful
//! shutdown, after which the process prints `SHUTDOWN-DONE` and exits.
//!
//! `Last` echoes with `send_last`, reflecting `x-echo` into trailers only (a one-frame call's
//! answer where the connection agreed to them); `LastThenFail` echoes with `send_last`, then
//! ends ABORTED with a 10,000-character message (too long to go beside it).
//!
//! `rpc-peer ADDR[,ADDR…] [MAX_MESSAGE [MAX_STREAMS]]`: the endpoints (`shm://`, and `unix://` or
//! `http://`, where the same handlers answer over HTTP/2; each HTTP/2 endpoint is announced as
//! `LISTENING ADDRESS` after `READY`), the largest request message accepted (0 = the default),
//! and the concurrent calls allowed per connection. `RPC_PEER_FEATURES` (a number) sets the
//! protocol features the server grants at most (all by default). `RPC_PEER_FDS_LEFT=N` lowers the
//! process's file-descriptor limit, once it serves, so that exactly N descriptor numbers are free
//! below it (the limit bounds numbers, not counts, and inherited descriptors leave gaps); and
//! `/test.Admin/AcceptErrors` answers `accept_errors=A handshakes_failed=H` from `ServerStats`.
//! `RPC_PEER_GRACE_MS` sets the graceful shutdown's grace period (10 s by default).

use std::io::Write;

use isthmus::{Code, MetadataMap, Server, ServerCall, Status};

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn reflect(md: &MetadataMap, tag: &str) -> MetadataMap {
    let mut out = MetadataMap::new();
    if let Some(v) = md.get("x-echo") {
        let _ = out.append("x-echo", &format!("{tag}:{v}"));
    }
    if let Some(v) = md.get_bin("x-echo-bin") {
        let _ = out.append_bin("x-echo-bin", v.to_vec());
    }
    out
}

/// The little-endian `u32` at `at` in a request; INVALID_ARGUMENT if the request is too short.
fn u32_at(m: &[u8], at: usize) -> Result<u32, Status> {
    m.get(at..at + 4)
        .and_then(|b| b.try_into().ok())
        .map(u32::from_le_bytes)
        .ok_or_else(|| Status::new(Code::InvalidArgument, format!("request of {} bytes has no u32 at {at}", m.len())))
}

async fn one(call: &mut ServerCall) -> Result<bytes::Bytes, Status> {
    call.recv().await?.ok_or_else(|| Status::new(Code::InvalidArgument, "expected a request message"))
}

/// Messages `/test.Echo/Flood` has handed to the engine, over all calls.
static FLOOD_SENT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

struct Loud;
impl Drop for Loud {
    fn drop(&mut self) {
        say("SLEEP-DROPPED");
    }
}

/// What `/test.Echo/Panic` panics with.
const ON_PURPOSE: &str = "handler exploded on purpose";

/// `/test.Echo/Hog`'s state: whether one waits for `/test.Admin/Release`, and whether it came.
static HOG: std::sync::Mutex<(bool, bool)> = std::sync::Mutex::new((false, false));
static HOG_RELEASED: std::sync::Condvar = std::sync::Condvar::new();

/// Blocks the calling thread as `mode` says (see the module's documentation).
fn hog(mode: &str) -> &'static str {
    if let Some(ms) = mode.strip_prefix("sleep:").and_then(|ms| ms.parse().ok()) {
        std::thread::sleep(std::time::Duration::from_millis(ms));
        return "slept";
    }
    let mut state = HOG.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    *state = (true, false);
    let (mut state, _) = HOG_RELEASED
        .wait_timeout_while(state, std::time::Duration::from_secs(15), |s| !s.1)
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let released = state.1;
    *state = (false, false);
    if released {
        "released"
    } else {
        "not released"
    }
}

/// `/test.Admin/Release`: lets a waiting Hog go.
fn release_hog() -> &'static str {
    let mut state = HOG.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if !state.0 {
        return "not-hogging";
    }
    state.1 = true;
    HOG_RELEASED.notify_all();
    "released"
}

fn main() {
    let addr = std::env::args().nth(1).expect("address");
    // Optional second argument: the largest request message accepted, in bytes.
    let max_message = std::env::args().nth(2).and_then(|m| m.parse().ok()).filter(|&m: &u64| m > 0);
    let max_streams = std::env::args().nth(3).and_then(|m| m.parse().ok());
    // `/test.Echo/Panic` panics on purpose: one line for it, not a backtrace that would bury a
    // failing test's own message in a CI log.
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| match info.payload().downcast_ref::<&str>() {
        Some(&ON_PURPOSE) => eprintln!("rpc-peer: {ON_PURPOSE}"),
        _ => report(info),
    }));
    // Two workers: a Hog holds one while the other reads (rpc_calls.rs's blocking-handler test).
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    rt.block_on(async move {
        let shutdown = std::sync::Arc::new(tokio::sync::Notify::new());
        let stats: std::sync::Arc<std::sync::OnceLock<isthmus::ServerStats>> = Default::default();
        let stats_for_handler = stats.clone();
        let trigger = shutdown.clone();
        let server = Server::builder()
            .handler("/test.Admin/Shutdown", move |mut call: ServerCall| {
                let trigger = trigger.clone();
                async move {
                    trigger.notify_one();
                    call.send(b"").await
                }
            })
            .handler("/test.Admin/AcceptErrors", {
                let stats = stats.clone();
                move |mut call: ServerCall| {
                    let stats = stats.clone();
                    async move {
                        let text = stats.get().map_or(String::new(), |s| {
                            format!("accept_errors={} handshakes_failed={}", s.accept_errors(), s.handshakes_failed())
                        });
                        call.send(text.as_bytes()).await
                    }
                }
            })
            .handler("/test.Admin/Counters", move |mut call: ServerCall| {
                let stats = stats_for_handler.clone();
                async move {
                    // Counters of the other connections (the asking one has this call in flight).
                    let text: Vec<String> = stats
                        .get()
                        .map(|s| s.connections())
                        .unwrap_or_default()
                        .iter()
                        .map(|c| {
                            format!(
                                "started={} ok={} cancelled={} deadline={} internal={} resource_exhausted={} frames_received={} \
                                 answers_dropped={}",
                                c.calls_started,
                                c.finished(Code::Ok),
                                c.finished(Code::Cancelled),
                                c.finished(Code::DeadlineExceeded),
                                c.finished(Code::Internal),
                                c.finished(Code::ResourceExhausted),
                                c.transport.frames_received,
                                c.answers_dropped
                            )
                        })
                        .collect();
                    call.send(text.join("\n").as_bytes()).await
                }
            })
            .handler("/test.Echo/Hog", |mut call: ServerCall| async move {
                // Before any `.await`: the call's first poll blocks.
                let reply = hog(call.metadata().get("x-hog").unwrap_or(""));
                let _ = one(&mut call).await?;
                call.send(reply.as_bytes()).await
            })
            .handler("/test.Admin/Release", |mut call: ServerCall| async move {
                let _ = one(&mut call).await?;
                call.send(release_hog().as_bytes()).await
            })
            .handler("/test.Echo/Slow", |mut call: ServerCall| async move {
                let m = one(&mut call).await?;
                say("SLOW-STARTED");
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                call.send(&m).await
            })
            // Echoes after the delay the request's first four bytes give, in microseconds.
            .handler("/test.Echo/After", |mut call: ServerCall| async move {
                let m = one(&mut call).await?;
                let delay = u32_at(&m, 0)?;
                if delay > 0 {
                    tokio::time::sleep(std::time::Duration::from_micros(delay.into())).await;
                }
                call.send(&m).await
            })
            // Request `u32 µs, u32 count`: that many echoes, the first at once, then one every µs.
            .handler("/test.Echo/Every", |mut call: ServerCall| async move {
                let m = one(&mut call).await?;
                let (every, count) = (u32_at(&m, 0)?, u32_at(&m, 4)?);
                for i in 0..count {
                    if i > 0 {
                        tokio::time::sleep(std::time::Duration::from_micros(every.into())).await;
                    }
                    call.send(&m).await?;
                }
                Ok(())
            })
            .handler("/test.Echo/Unary", |mut call: ServerCall| async move {
                let m = one(&mut call).await?;
                call.send_headers(reflect(call.metadata(), "head")).await?;
                call.set_trailers(reflect(call.metadata(), "tail"));
                call.send(&m).await
            })
            .handler("/test.Echo/Last", |mut call: ServerCall| async move {
                let m = one(&mut call).await?;
                call.set_trailers(reflect(call.metadata(), "tail"));
                call.send_last(&m).await
            })
            .handler("/test.Echo/LastThenFail", |mut call: ServerCall| async move {
                // A status too long to go beside the held message: the two go in two frames.
                let m = one(&mut call).await?;
                call.send_last(&m).await?;
                Err(Status::new(Code::Aborted, "x".repeat(10_000)))
            })
            .handler("/test.Echo/ServerStream", |mut call: ServerCall| async move {
                let m = one(&mut call).await?;
                let count = u32_at(&m, 0)?;
                let size = u32_at(&m, 4)?;
                for i in 0..count {
                    call.send(&isthmus_tests::pattern(size as usize, i as u64)).await?;
                }
                Ok(())
            })
            .handler("/test.Echo/ClientStream", |mut call: ServerCall| async move {
                let (mut count, mut bytes) = (0u64, 0u64);
                while let Some(m) = call.recv().await? {
                    if isthmus_tests::first_mismatch(&m, count).is_some() {
                        return Err(Status::new(Code::DataLoss, format!("message {count} corrupted")));
                    }
                    count += 1;
                    bytes += m.len() as u64;
                }
                let mut reply = count.to_le_bytes().to_vec();
                reply.extend_from_slice(&bytes.to_le_bytes());
                call.send(&reply).await
            })
            .handler("/test.Echo/Bidi", |mut call: ServerCall| async move {
                while let Some(m) = call.recv().await? {
                    call.send(&m).await?;
                }
                Ok(())
            })
            .handler("/test.Echo/OkWithWords", |mut call: ServerCall| async move {
                // Success with words beside it (grpcio's `set_details`): an OK status as a status.
                let m = one(&mut call).await?;
                call.send(&m).await?;
                Err(Status::new(Code::Ok, format!("all went well: {}", String::from_utf8_lossy(&m))))
            })
            .handler("/test.Echo/Fail", |mut call: ServerCall| async move {
                let m = one(&mut call).await?;
                let code = u32_at(&m, 0)?;
                // Initial metadata ahead of the failure, when the client asks for them.
                let head = reflect(call.metadata(), "head");
                if !head.is_empty() {
                    call.send_headers(head).await?;
                }
                let mut t = MetadataMap::new();
                let _ = t.append("x-failed", "yes");
                // The message: what follows the code, if anything does.
                let message = match m.get(4..) {
                    Some(rest) if !rest.is_empty() => String::from_utf8_lossy(rest).into_owned(),
                    _ => format!("requested failure {code}"),
                };
                Err(Status::new(Code::from_u32(code), message)
                    .with_details(bytes::Bytes::from_static(b"\x00details\xff"))
                    .with_metadata(t))
            })
            .handler("/test.Echo/Panic", |_call: ServerCall| async move {
                std::panic::panic_any(ON_PURPOSE);
            })
            .handler("/test.Echo/Sleep", |mut call: ServerCall| async move {
                let _loud = Loud;
                say("SLEEPING");
                let _ = call.recv().await;
                std::future::pending::<()>().await;
                Ok(())
            })
            .handler("/test.Echo/EchoThenCancel", |mut call: ServerCall| async move {
                for _ in 0..3 {
                    let m = one(&mut call).await?;
                    call.send(&m).await?;
                }
                Err(Status::new(Code::Cancelled, "the server gave up on this stream"))
            })
            .handler("/test.Echo/InPlace", |mut call: ServerCall| async move {
                let m = one(&mut call).await?;
                let size = u32_at(&m, 0)?;
                let mut block = call.alloc(size as usize).await?;
                block.copy_from_slice(&isthmus_tests::pattern(size as usize, 9));
                call.send_block(block).await
            })
            .handler("/test.Echo/Flood", |mut call: ServerCall| async move {
                let _ = one(&mut call).await?;
                for i in 0u64.. {
                    call.send(&isthmus_tests::pattern(64 << 10, i)).await?;
                    FLOOD_SENT.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
                Ok(())
            })
            .handler("/test.Admin/FloodSent", |mut call: ServerCall| async move {
                call.send(&FLOOD_SENT.load(std::sync::atomic::Ordering::SeqCst).to_le_bytes()).await
            })
            .handler("/test.Echo/Stall", |_call: ServerCall| async move {
                std::future::pending::<()>().await;
                Ok(())
            })
            .handler("/test.Echo/TimeLeft", |mut call: ServerCall| async move {
                let _ = one(&mut call).await?;
                let left = call.time_remaining().map_or(-1, |d| d.as_millis() as i64);
                call.send(left.to_string().as_bytes()).await
            });
        let mut config = isthmus_shm::Config::default();
        if let Some(max) = max_message {
            config.max_message_size = max;
        }
        if let Some(features) = std::env::var("RPC_PEER_FEATURES").ok().and_then(|f| f.parse().ok()) {
            config.features = features;
        }
        let mut server = server.config(config);
        // The limit for every endpoint (Server::max_message_size), where the second argument
        // sets the transport's (and so HTTP/2's only below its default).
        if let Some(limit) = std::env::var("RPC_PEER_MAX_MESSAGE").ok().and_then(|n| n.parse().ok()) {
            server = server.max_message_size(limit);
        }
        if let Some(ms) = std::env::var("RPC_PEER_GRACE_MS").ok().and_then(|n| n.parse().ok()) {
            server = server.grace(std::time::Duration::from_millis(ms));
        }
        let server = match max_streams {
            Some(n) => server.max_concurrent_streams(n),
            None => server,
        };
        let bound = match server.bind_all(addr.split(',')) {
            Ok(b) => b,
            Err(e) => return say(&format!("BIND-ERROR {e}")),
        };
        let _ = stats.set(bound.stats());
        if let Some(left) = std::env::var("RPC_PEER_FDS_LEFT").ok().and_then(|n| n.parse::<usize>().ok()) {
            let limit = fd_limit_leaving(left);
            let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            // SAFETY: `rl` is a live, initialised `rlimit` of this frame, for both calls.
            let set = unsafe {
                libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) == 0 && {
                    rl.rlim_cur = limit;
                    libc::setrlimit(libc::RLIMIT_NOFILE, &rl) == 0
                }
            };
            say(&format!("FDS-LIMIT {limit} {set}"));
        }
        say("READY");
        for address in bound.http_addresses() {
            say(&format!("LISTENING {address}"));
        }
        match bound.serve_with_shutdown(async move { shutdown.notified().await }).await {
            Ok(()) => say("SHUTDOWN-DONE"),
            Err(e) => say(&format!("SERVE-ERROR {e}")),
        }
    });
}

/// The lowest descriptor limit below which exactly `left` numbers are free: new descriptors take
/// the lowest free number, so a limit of "open + left" would leave more or fewer than `left`
/// depending on where the inherited ones sit.
fn fd_limit_leaving(left: usize) -> u64 {
    let is_open = |fd: i32| {
        // SAFETY: F_GETFD on any number only reads that number's flags (EBADF when it is free).
        unsafe { libc::fcntl(fd, libc::F_GETFD) != -1 }
    };
    let (mut fd, mut free) = (0i32, 0usize);
    while free < left {
        if !is_open(fd) {
            free += 1;
        }
        fd += 1;
    }
    fd as u64
}
