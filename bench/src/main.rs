//! `isthmus-bench`: runs isthmus beside its competitors in one run, alternating systems within
//! each round, and writes `docs/bench/results.json` plus a table of medians and ratios.
//!
//! ```text
//! isthmus-bench all|transport|rpc|python|fanout [--quick] [--out docs/bench/results.json]
//!     [--systems tonic-uds,grpcio]
//! isthmus-bench demo
//! isthmus-bench soak [--quick] [--calls N] [--python-calls M] [--out FILE]
//! isthmus-bench profile-transport SIZE…
//! isthmus-bench count-per-call [SIZE [CALLS]]
//! isthmus-bench count-client engine|tonic ADDR SIZE CALLS   (for bench/count_per_call.py)
//! ```
//!
//! `transport` is isthmus-shm against a raw Unix-socket echo and the physical floors; `rpc` is
//! echo through the RPC engine (`isthmus-rust`) beside tonic over a Unix socket (`tonic-uds`)
//! (with the transport matrix's `raw-uds` as the floor of socket IPC); `python` is Python clients
//! (isthmus sync and asyncio over `shm://`, grpcio and grpc.aio against tonic over a Unix socket, a
//! raw Python socket); `fanout` is one publisher's server stream to 1, 8 and 32 subscribers
//! (isthmus over `shm://`, tonic over a Unix socket, grpcio; `--systems` picks some of them);
//! `all` runs every part in one run.
//!
//! The `serve-*` roles are the servers this binary starts as child processes, and
//! `fanout-subscriber` the fan-out's subscriber processes.

mod allocs;
mod fanout;
mod measure;
mod python;
mod report;
mod rpc;
mod soak;
mod system;

use std::time::Duration;

use measure::Budget;
use report::Record;
use rpc::{IsthmusRust, TonicClient};
use system::{FloorCopy, FloorEventfd, FloorSpin, Memcpy, SameCore, ShmEcho, System, UdsEcho};

#[global_allocator]
static ALLOCATOR: allocs::Counting = allocs::Counting;

const SIZES: [usize; 6] = [64, 1 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20];
/// Sizes of the RPC matrix (gRPC stacks top out well below 256 MiB messages).
const RPC_SIZES: [usize; 5] = [64, 1 << 10, 64 << 10, 1 << 20, 16 << 20];
const ROUNDS: usize = 3;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize| args.get(i).cloned().unwrap_or_default();
    let num = |i: usize| arg(i).parse::<i64>().unwrap_or_else(|_| panic!("argument {i} must be a number"));
    match arg(1).as_str() {
        "serve-shm" => system::serve_shm(&arg(2), num(3) as u64),
        "serve-uds" => system::serve_uds(&arg(2)),
        "serve-uds-len4" => system::serve_uds_len4(&arg(2)),
        "serve-eventfd" => system::serve_eventfd(num(2) as i32, num(3) as i32),
        "serve-spin" => system::serve_spin(num(2) as i32),
        "serve-copy" => system::serve_copy(num(2) as i32),
        // `serve-isthmus TARGET…`: the echo on every target (an HTTP/2 one offers the shm:// one).
        "serve-isthmus" => rpc::serve_isthmus(&args[2..]),
        // The echo, its allocations counted (`count-per-call`).
        "serve-isthmus-counting" => {
            allocs::start();
            rpc::serve_isthmus(&args[2..])
        }
        "serve-isthmus-spin" => rpc::serve_isthmus_spin(&arg(2), num(3) as u64),
        "serve-isthmus-soak" => rpc::serve_isthmus_soak(&arg(2), &arg(3)),
        "serve-tonic" => rpc::serve_tonic(&arg(2)),
        "serve-tonic-isthmus" => rpc::serve_tonic_isthmus(&arg(2)),
        // `serve-fanout-tonic|serve-fanout-isthmus TARGET SIZE COUNT INTERVAL_US SUBS [WARMUP]`
        role @ ("serve-fanout-tonic" | "serve-fanout-isthmus") => fanout::serve(role, &args[2..]),
        // `fanout-subscriber tonic|isthmus ADDR CONNS COUNT`
        "fanout-subscriber" => fanout::subscribe(&args[2..]),
        "demo" => demo(),
        // For profilers: one system's echo alone for a few seconds:
        // `profile-rpc INFLIGHT [SIZE [isthmus-rust|tonic-isthmus-shm|tonic-uds|tonic-floor|SPLIT]]`, where
        // the SPLIT systems put the tonic layer on one side only: `tonic-client-engine-server`,
        // `engine-client-tonic-server`.
        "profile-rpc" => {
            let budget = Budget { time: Duration::from_secs(3), min_iters: 1, max_iters: 2_000_000 };
            let mut sys: Box<dyn System> = match arg(4).as_str() {
                "tonic-isthmus-shm" => Box::new(TonicClient::over_isthmus()),
                "tonic-client-engine-server" => Box::new(TonicClient::over_isthmus_against("serve-isthmus")),
                "engine-client-tonic-server" => Box::new(IsthmusRust::against("serve-tonic-isthmus")),
                "tonic-uds" => Box::new(TonicClient::over_uds()),
                "tonic-floor" => Box::new(TonicClient::in_process()),
                _ => Box::new(IsthmusRust::start()),
            };
            let size = arg(3).parse().unwrap_or(64);
            let s = match num(2) {
                1 => sys.round_trip(size, budget),
                n => sys.pipelined(size, n as usize, budget).expect("pipelined"),
            };
            println!("p50 {:.2} µs, {:.0} calls/s", s.p50_us, s.rps);
        }
        // `profile-transport SIZE…`: the transport's echo beside its floors at these sizes.
        "profile-transport" => {
            let budget = Budget { time: Duration::from_secs(1), min_iters: 5, max_iters: 200_000 };
            let spin = isthmus_shm::SpinPolicy::default().max;
            let mut systems: Vec<Box<dyn System>> = vec![
                Box::new(ShmEcho::start("isthmus-shm-transport", spin)),
                Box::new(FloorCopy::start()),
                Box::new(Memcpy),
            ];
            for size in args[2..].iter().map(|a| a.parse::<usize>().expect("size")) {
                for sys in systems.iter_mut() {
                    let s = sys.round_trip(size, budget);
                    println!("{:>10} {:<24} p50 {:>10.2} µs  p99 {:>10.2} µs", size, sys.name(), s.p50_us, s.p99_us);
                }
            }
        }
        // `count-per-call [SIZE [CALLS]]`: allocations, frames and doorbells per call of the
        // engine's echo (64 B, 100,000 calls by default).
        "count-per-call" => {
            let size = args.get(2).map_or(64, |a| a.parse().expect("size"));
            let calls = args.get(3).map_or(100_000, |a| a.parse().expect("calls"));
            allocs::per_call(size, calls);
        }
        // `count-client engine|tonic ADDR SIZE CALLS`: `bench/count_per_call.py`'s client.
        "count-client" => allocs::client(&args[2..]),
        // `floor-copy SECONDS SIZE…`: the copy floor alone, one JSON line per size, for
        // `py_raw_bench.py` to measure in its own rounds; `floor-copy-out` the same with the
        // answer copied out (`lua_bench.py`'s floor).
        "floor-copy" | "floor-copy-out" => {
            let time = Duration::from_secs_f64(arg(2).parse().expect("seconds"));
            let budget = Budget { time, min_iters: 20, max_iters: 100_000 };
            let mut floor = if arg(1) == "floor-copy" { FloorCopy::start() } else { FloorCopy::copying_out() };
            for size in args[3..].iter().map(|a| a.parse::<usize>().expect("size")) {
                let s = floor.round_trip(size, budget);
                let line = serde_json::json!({"size": size, "p50_us": s.p50_us, "p99_us": s.p99_us, "rps": s.rps});
                println!("{line}");
            }
        }
        "soak" => {
            let opt = |name: &str, default: u64| {
                args.iter()
                    .position(|a| a == name)
                    .and_then(|i| args.get(i + 1))
                    .map_or(default, |v| v.parse().unwrap_or_else(|_| panic!("{name} takes a number")))
            };
            let out = args.iter().position(|a| a == "--out").and_then(|i| args.get(i + 1)).cloned();
            let quick = args.iter().any(|a| a == "--quick");
            let (calls, python_calls) = if quick { (1_000_000, 100_000) } else { (10_000_000, 1_000_000) };
            let (records, clean) = soak::run(opt("--calls", calls), opt("--python-calls", python_calls));
            report::write(out.as_deref().unwrap_or("docs/bench/results.json"), &records, quick);
            if !clean {
                eprintln!("soak: calls were lost or came back wrong");
                std::process::exit(1);
            }
        }
        which @ ("all" | "transport" | "rpc" | "python" | "fanout") => {
            let quick = args.iter().any(|a| a == "--quick");
            let out = args.iter().position(|a| a == "--out").and_then(|i| args.get(i + 1)).cloned();
            let budget = if quick {
                Budget { time: Duration::from_millis(120), min_iters: 3, max_iters: 50_000 }
            } else {
                Budget { time: Duration::from_millis(500), min_iters: 5, max_iters: 200_000 }
            };
            let mut records = Vec::new();
            let runs = |part: &str| which == "all" || which == part;
            if runs("transport") {
                records.extend(transport(budget));
            }
            if runs("rpc") {
                records.extend(rpc(budget));
            }
            if runs("python") {
                let mut systems: Vec<Box<dyn System>> =
                    python::PyClient::all().into_iter().map(|c| Box::new(c) as Box<dyn System>).collect();
                records.extend(matrix(&mut systems, budget));
            }
            let mut clean = true;
            if runs("fanout") {
                let only = args
                    .iter()
                    .position(|a| a == "--systems")
                    .and_then(|i| args.get(i + 1))
                    .map(|v| v.split(',').map(str::to_owned).collect::<Vec<_>>());
                let (fanout, fanout_clean) = fanout::run(quick, only.as_deref());
                records.extend(fanout);
                clean = fanout_clean;
            }
            report::write(out.as_deref().unwrap_or("docs/bench/results.json"), &records, quick);
            if runs("transport") {
                report::print_transport(&records);
            }
            if runs("rpc") {
                report::print_rpc(&records);
            }
            if runs("python") {
                report::print_python(&records);
            }
            if runs("fanout") {
                report::print_fanout(&records);
            }
            if !clean {
                eprintln!("fanout: a cell failed, or messages were lost or came out of order");
                std::process::exit(1);
            }
        }
        _ => {
            eprintln!(
                "usage: isthmus-bench all|transport|rpc|python|fanout [--quick] [--out FILE] [--systems A,B] | demo"
            );
            std::process::exit(2);
        }
    }
}

/// Echo through whole RPC stacks: the isthmus engine against tonic over a Unix socket.
fn rpc(budget: Budget) -> Vec<Record> {
    // raw-uds, the socket floor, is measured by the transport matrix.
    let mut systems: Vec<Box<dyn System>> =
        vec![Box::new(IsthmusRust::start()), Box::new(TonicClient::over_isthmus()), Box::new(TonicClient::over_uds())];
    let mut records = matrix(&mut systems, budget);
    records.extend(streams(&mut systems));
    // tonic's own floor, for the 64 B call only: what tonic-isthmus-shm cannot go below.
    let mut floor = TonicClient::in_process();
    for round in 1..=ROUNDS {
        status(&format!("round {round}: tonic-floor 64 B"));
        records.push(Record::new("tonic-floor", 64, 1, round, floor.round_trip(64, budget)));
    }
    status("");
    records
}

/// Sizes of the streaming-throughput cells.
const STREAM_SIZES: [usize; 2] = [1 << 10, 1 << 20];

/// Server-stream throughput: each system's one stream of 1 KiB and of 1 MiB messages, as the
/// systems `stream-NAME` (`rps` = messages/s).
fn streams(systems: &mut [Box<dyn System>]) -> Vec<Record> {
    let mut records = Vec::new();
    for round in 1..=ROUNDS {
        for &size in &STREAM_SIZES {
            for sys in systems.iter_mut() {
                status(&format!("round {round}: {} server stream of {}", sys.name(), report::size_name(size)));
                if let Some(s) = sys.stream(size) {
                    records.push(Record::new(&format!("stream-{}", sys.name()), size, 1, round, s));
                }
            }
        }
    }
    status("");
    records
}

/// Every RPC size with one call in flight, then 64 B with 32 in flight, for each system in
/// turn within each round.
fn matrix(systems: &mut [Box<dyn System>], budget: Budget) -> Vec<Record> {
    let cells = ROUNDS * systems.len() * (RPC_SIZES.len() + 1);
    let mut done = 0;
    let mut records = Vec::new();
    for round in 1..=ROUNDS {
        for &size in &RPC_SIZES {
            for sys in systems.iter_mut() {
                done += 1;
                status(&format!("[{done:>3}/{cells}] round {round}: {} {}", sys.name(), report::size_name(size)));
                records.push(Record::new(sys.name(), size, 1, round, sys.round_trip(size, budget)));
            }
        }
        for sys in systems.iter_mut() {
            done += 1;
            status(&format!("[{done:>3}/{cells}] round {round}: {} 64 B x32 in flight", sys.name()));
            if let Some(s) = sys.pipelined(64, 32, budget) {
                records.push(Record::new(sys.name(), 64, 32, round, s));
            }
        }
    }
    status("");
    records
}

/// The transport matrix: isthmus-shm against a raw Unix-socket echo and the physical floors.
fn transport(budget: Budget) -> Vec<Record> {
    let spin = isthmus_shm::SpinPolicy::default().max;
    let shm = ShmEcho::start("isthmus-shm-transport", spin);
    let nospin = ShmEcho::start("isthmus-shm-transport-nospin", Duration::ZERO);
    let samecore_inner = ShmEcho::start("isthmus-shm-transport-samecore", spin);
    let samecore_pid = samecore_inner.server.pid();
    let mut full: Vec<Box<dyn System>> =
        vec![Box::new(shm), Box::new(UdsEcho::start()), Box::new(Memcpy), Box::new(FloorCopy::start())];
    let mut small: Vec<Box<dyn System>> = vec![
        Box::new(nospin),
        Box::new(SameCore { name: "isthmus-shm-transport-samecore", inner: samecore_inner, server_pid: samecore_pid }),
    ];
    let mut floors: Vec<Box<dyn System>> = vec![Box::new(FloorEventfd::start()), Box::new(FloorSpin::start())];

    let cells = ROUNDS * (SIZES.len() * full.len() + 2 * small.len() + floors.len() + 2);
    let mut done = 0;
    let mut progress = |what: &str| {
        done += 1;
        status(&format!("[{done:>3}/{cells}] {what}"));
    };
    let mut records = Vec::new();
    for round in 1..=ROUNDS {
        for &size in &SIZES {
            for sys in full.iter_mut() {
                progress(&format!("round {round}: {} {}", sys.name(), report::size_name(size)));
                records.push(Record::new(sys.name(), size, 1, round, sys.round_trip(size, budget)));
            }
        }
        for &size in &SIZES[..2] {
            for sys in small.iter_mut() {
                progress(&format!("round {round}: {} {}", sys.name(), report::size_name(size)));
                records.push(Record::new(sys.name(), size, 1, round, sys.round_trip(size, budget)));
            }
        }
        for sys in floors.iter_mut() {
            progress(&format!("round {round}: {}", sys.name()));
            records.push(Record::new(sys.name(), 0, 1, round, sys.round_trip(0, budget)));
        }
        for sys in full.iter_mut() {
            if let Some(s) = sys.pipelined(64, 32, budget) {
                progress(&format!("round {round}: {} 64 B x32 in flight", sys.name()));
                records.push(Record::new(sys.name(), 64, 32, round, s));
            }
        }
    }
    status("");
    eprintln!("done: {} measurements", records.len());
    drop((full, small, floors));
    records
}

/// A short, friendly comparison for `make demo`: one round, a few sizes, no files written.
fn demo() {
    let budget = Budget { time: Duration::from_millis(300), min_iters: 5, max_iters: 100_000 };
    println!("isthmus demo: gRPC-style echo calls between two processes on this machine");
    println!("  isthmus:  a Rust client process -> a Rust isthmus server process, over shm://");
    println!("  baseline: a tonic client -> a tonic server, gRPC over a Unix socket\n");
    status("starting servers ...");
    let mut shm = IsthmusRust::start();
    let mut tonic = TonicClient::over_uds();
    status("");
    println!("| message | isthmus p50 | tonic over UDS p50 | speed-up |");
    println!("|---:|---:|---:|---:|");
    for size in [64, 4 << 10, 64 << 10, 1 << 20, 16 << 20] {
        status(&format!("measuring {} ...", report::size_name(size)));
        let a = shm.round_trip(size, budget);
        let b = tonic.round_trip(size, budget);
        status("");
        println!(
            "| {} | {} | {} | {:.1}× |",
            report::size_name(size),
            report::us(a.p50_us),
            report::us(b.p50_us),
            b.p50_us / a.p50_us
        );
    }
    status("measuring 32 calls in flight ...");
    let (a, b) = (shm.pipelined(64, 32, budget), tonic.pipelined(64, 32, budget));
    status("");
    if let (Some(a), Some(b)) = (a, b) {
        println!(
            "\n64 B, 32 calls in flight: isthmus {:.0} calls/s, tonic over UDS {:.0} calls/s ({:.1}×)",
            a.rps,
            b.rps,
            a.rps / b.rps
        );
    }
    println!("\n`make bench` runs the full matrix (3 rounds, more sizes, the transport floors).");
}

/// A progress line that rewrites itself on a terminal and stays silent in logs.
fn status(line: &str) {
    use std::io::IsTerminal;
    if std::io::stderr().is_terminal() {
        eprint!("\r\x1b[K{line}");
    }
}
