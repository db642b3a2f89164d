//! The soak: millions of checked calls through the engine (and through Python) at 125 in flight,
//! counting every call that did not come back (`lost`) or came back different (`mismatched`).
//! Both must be 0. It also reports p50/p99/p99.9 and the arena high-water marks of both sides at
//! the end, which stay bounded by what 125 calls can hold at once.
//!
//! ```text
//! isthmus-bench soak [--quick] [--calls N] [--python-calls M] [--out docs/bench/results.json]
//! ```
//!
//! Messages cycle through 64 B, 1 KiB, 16 KiB and 100 KiB (inline and arena paths both), each
//! filled from its call number, so a reply that carries another call's bytes is caught.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::measure::Sample;
use crate::report::Record;
use crate::system::{unique, Server};

/// Calls in flight at once.
pub const INFLIGHT: usize = 125;
/// The sizes the calls cycle through: mostly small, as RPC traffic is.
const SIZES: [usize; 8] = [64, 64, 64, 1 << 10, 1 << 10, 64, 16 << 10, 100_000];
/// A call that takes longer than this is lost.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// The message of call `i`: its size from [`SIZES`], its bytes from `i`.
fn fill(i: u64, buf: &mut Vec<u8>) {
    let size = SIZES[(i % SIZES.len() as u64) as usize];
    buf.clear();
    let mut x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    while buf.len() < size {
        // xorshift64: cheap enough that filling costs little beside the call.
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        buf.extend_from_slice(&x.to_le_bytes());
    }
    buf.truncate(size);
}

/// What one soak measured.
struct Outcome {
    calls: u64,
    lost: u64,
    mismatched: u64,
    p50_us: f64,
    p99_us: f64,
    p999_us: f64,
    rps: f64,
    first_error: Option<String>,
}

fn percentile(sorted: &[u32], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let at = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len()) - 1;
    f64::from(sorted[at]) / 1000.0
}

/// `calls` checked calls through the engine's async client against the engine's echo server in
/// another process.
fn engine(calls: u64) -> (Outcome, Value) {
    let addr = format!("shm://{}", unique("soak"));
    let stats_path = std::env::temp_dir().join(format!("{}.json", unique("soak-stats")));
    let server = Server::spawn(&["serve-isthmus-soak".into(), addr.clone(), stats_path.display().to_string()]);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let next = Arc::new(AtomicU64::new(0));
    let (lost, mismatched) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let start = Instant::now();
    let (mut lat, first_error, client_high_water) = rt.block_on(async {
        let channel = isthmus::Channel::connect(&addr).await.expect("connect");
        let tasks: Vec<_> = (0..INFLIGHT)
            .map(|_| {
                let (channel, next, lost, mismatched) =
                    (channel.clone(), next.clone(), lost.clone(), mismatched.clone());
                tokio::spawn(async move {
                    let mut lat = Vec::with_capacity((calls as usize / INFLIGHT) + 1);
                    let mut first_error = None;
                    let mut buf = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= calls {
                            break;
                        }
                        fill(i, &mut buf);
                        let options = isthmus::CallOptions { timeout: Some(CALL_TIMEOUT), ..Default::default() };
                        let t = Instant::now();
                        // The outer timeout makes a call that the deadline failed to end count as
                        // lost too, instead of hanging the soak.
                        let call = channel.unary(crate::rpc::PATH, &buf, options);
                        match tokio::time::timeout(CALL_TIMEOUT + Duration::from_secs(5), call).await {
                            Ok(Ok(r)) if r.message == buf[..] => {}
                            Ok(Ok(_)) => {
                                mismatched.fetch_add(1, Ordering::Relaxed);
                            }
                            Ok(Err(e)) => {
                                lost.fetch_add(1, Ordering::Relaxed);
                                first_error.get_or_insert_with(|| format!("call {i}: {e}"));
                            }
                            Err(_) => {
                                lost.fetch_add(1, Ordering::Relaxed);
                                first_error
                                    .get_or_insert_with(|| format!("call {i}: no answer, not even its deadline"));
                            }
                        }
                        lat.push(u32::try_from(t.elapsed().as_nanos()).unwrap_or(u32::MAX));
                    }
                    (lat, first_error)
                })
            })
            .collect();
        let mut all = Vec::with_capacity(calls as usize);
        let mut first_error = None;
        for t in tasks {
            let (lat, err) = t.await.expect("soak task");
            all.extend(lat);
            first_error = first_error.or(err);
        }
        (all, first_error, channel.counters().transport.arena_high_water)
    });
    let total = start.elapsed();
    let server_high_water = server_high_water(server, &stats_path);
    lat.sort_unstable();
    let outcome = Outcome {
        calls: lat.len() as u64,
        lost: lost.load(Ordering::Relaxed),
        mismatched: mismatched.load(Ordering::Relaxed),
        p50_us: percentile(&lat, 0.5),
        p99_us: percentile(&lat, 0.99),
        p999_us: percentile(&lat, 0.999),
        rps: lat.len() as f64 / total.as_secs_f64(),
        first_error,
    };
    (outcome, json!({ "arena_high_water_client": client_high_water, "arena_high_water_server": server_high_water }))
}

/// `calls` checked calls from Python (`isthmus.aio`, 125 tasks) against the engine's echo server.
fn python(calls: u64) -> Option<(Outcome, Value)> {
    let python = std::env::var("ISTHMUS_PYTHON").unwrap_or_else(|_| ".venv/bin/python".into());
    if !std::path::Path::new(&python).exists() {
        // A failure, not a skip: an old record of this system would otherwise stand for this run.
        eprintln!("no {python}: the Python soak cannot run (run `make python` first, or --python-calls 0)");
        return None;
    }
    let addr = format!("shm://{}", unique("soak-py"));
    let stats_path = std::env::temp_dir().join(format!("{}.json", unique("soak-py-stats")));
    let server = Server::spawn(&["serve-isthmus-soak".into(), addr.clone(), stats_path.display().to_string()]);
    let mut child = Command::new(&python)
        .args(["bench/py_client.py", "soak", &addr, &calls.to_string(), &INFLIGHT.to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the Python soak");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("Python soak output");
    let status = child.wait().expect("Python soak");
    assert!(status.success(), "the Python soak failed: {status}");
    let v: Value = serde_json::from_str(line.trim()).expect("the Python soak's JSON line");
    let server_high_water = server_high_water(server, &stats_path);
    let f = |k: &str| v.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN);
    let n = |k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(u64::MAX);
    let outcome = Outcome {
        calls: n("calls"),
        lost: n("lost"),
        mismatched: n("mismatched"),
        p50_us: f("p50_us"),
        p99_us: f("p99_us"),
        p999_us: f("p999_us"),
        rps: f("rps"),
        first_error: v.get("first_error").and_then(Value::as_str).map(str::to_owned),
    };
    let client_high_water = v.get("arena_high_water_client").and_then(Value::as_u64);
    Some((
        outcome,
        json!({ "arena_high_water_client": client_high_water, "arena_high_water_server": server_high_water }),
    ))
}

/// The soak server's arena high-water mark from the file it keeps writing; stops the server
/// and removes the file.
fn server_high_water(server: Server, stats_path: &std::path::Path) -> Option<u64> {
    // It writes a few times a second; give it one more turn, then stop it so that it writes
    // no more.
    std::thread::sleep(Duration::from_millis(400));
    drop(server);
    let high = std::fs::read_to_string(stats_path)
        .ok()
        .and_then(|s| serde_json::from_str::<Value>(&s).ok())
        .and_then(|v| v.get("arena_high_water").and_then(Value::as_u64));
    let _ = std::fs::remove_file(stats_path);
    let _ = std::fs::remove_file(format!("{}.tmp", stats_path.display()));
    high
}

fn record(system: &str, o: &Outcome, extra: Value) -> Record {
    let mut r = Record::new(system, 0, INFLIGHT, 1, Sample { p50_us: o.p50_us, p99_us: o.p99_us, rps: o.rps });
    let mut fields = json!({
        "calls": o.calls, "lost": o.lost, "mismatched": o.mismatched,
        "p999_us": (o.p999_us * 1000.0).round() / 1000.0,
    });
    if let (Some(f), Some(e)) = (fields.as_object_mut(), extra.as_object()) {
        f.extend(e.clone());
        if let Some(err) = &o.first_error {
            f.insert("first_error".into(), json!(err));
        }
    }
    r.extra = fields;
    r
}

fn print(system: &str, o: &Outcome, extra: &Value) {
    println!(
        "{system}: {} calls at {INFLIGHT} in flight, lost {}, mismatched {}; p50 {:.1} µs, p99 {:.1} µs, p99.9 {:.1} µs; {:.0} calls/s; {extra}",
        o.calls, o.lost, o.mismatched, o.p50_us, o.p99_us, o.p999_us, o.rps
    );
    if let Some(e) = &o.first_error {
        println!("  first error: {e}");
    }
}

/// Runs both soaks and returns their records; exits non-zero if any call was lost or wrong.
pub fn run(calls: u64, python_calls: u64) -> (Vec<Record>, bool) {
    let mut records = Vec::new();
    let mut clean = true;
    eprintln!("soak: {calls} calls through the engine at {INFLIGHT} in flight");
    let (o, extra) = engine(calls);
    print("soak-isthmus-rust", &o, &extra);
    clean &= o.lost == 0 && o.mismatched == 0 && o.calls == calls;
    records.push(record("soak-isthmus-rust", &o, extra));
    if python_calls > 0 {
        eprintln!("soak: {python_calls} calls from Python (isthmus.aio) at {INFLIGHT} in flight");
        match python(python_calls) {
            Some((o, extra)) => {
                print("soak-py-isthmus-aio", &o, &extra);
                clean &= o.lost == 0 && o.mismatched == 0 && o.calls == python_calls;
                records.push(record("soak-py-isthmus-aio", &o, extra));
            }
            None => clean = false,
        }
    }
    (records, clean)
}
