//! results.json (merged: a run replaces only the systems it measured) and the printed table.

use std::collections::BTreeMap;
use std::process::Command;

use serde_json::{json, Value};

use crate::measure::{median, Sample};

/// One measurement, in the field names other tools read.
#[derive(Debug, Clone)]
pub struct Record {
    pub system: String,
    pub size: usize,
    pub inflight: usize,
    pub round: usize,
    pub sample: Sample,
    /// Fields of this record beyond the common ones (the soak's counts).
    pub extra: Value,
}

impl Record {
    pub fn new(system: &str, size: usize, inflight: usize, round: usize, sample: Sample) -> Record {
        Record { system: system.to_owned(), size, inflight, round, sample, extra: Value::Null }
    }

    fn to_json(&self) -> Value {
        let r = |v: f64| if v.is_finite() { json!((v * 1000.0).round() / 1000.0) } else { Value::Null };
        let mut v = json!({
            "system": self.system, "size": self.size, "inflight": self.inflight,
            "p50_us": r(self.sample.p50_us), "p99_us": r(self.sample.p99_us), "rps": r(self.sample.rps),
            "round": self.round,
        });
        if let (Some(v), Some(extra)) = (v.as_object_mut(), self.extra.as_object()) {
            v.extend(extra.clone());
        }
        v
    }
}

pub fn size_name(size: usize) -> String {
    match size {
        0 => "-".into(),
        s if s >= 1 << 20 => format!("{} MiB", s >> 20),
        s if s >= 1 << 10 => format!("{} KiB", s >> 10),
        s => format!("{s} B"),
    }
}

fn command(cmd: &str, args: &[&str]) -> String {
    Command::new(cmd)
        .args(args)
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

/// The host's setting for huge pages in shared memory, the bracketed word of
/// `/sys/kernel/mm/transparent_hugepage/shmem_enabled` (`never`, `advise`, …).
fn shmem_huge_pages() -> String {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
        .ok()
        .and_then(|s| Some(s.split_once('[')?.1.split_once(']')?.0.to_owned()))
        .unwrap_or_else(|| "unknown".into())
}

fn header(quick: bool) -> Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines().find(|l| l.starts_with("model name")).map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".into());
    let mem_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| m.lines().next().and_then(|l| l.split_whitespace().nth(1)).and_then(|kb| kb.parse::<u64>().ok()))
        .map_or(0, |kb| kb >> 20);
    json!({
        "date": command("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"]),
        "machine": {
            "cpu": cpu,
            "cores": std::thread::available_parallelism().map_or(0, |n| n.get()),
            "memory_gib": mem_gib,
            "kernel": command("uname", &["-r"]),
            // Whether shared memory may have huge pages here (ADR 0023): the 16 MiB rows
            // depend on it.
            "shmem_huge_pages": shmem_huge_pages(),
        },
        "versions": {
            "isthmus": env!("CARGO_PKG_VERSION"),
            "rustc": command("rustc", &["--version"]),
            "commit": command("git", &["rev-parse", "--short", "HEAD"]),
        },
        "quick": quick,
        "rounds": crate::ROUNDS,
        "fields": "system, size (bytes), inflight, p50_us, p99_us, rps, round; medians are taken across rounds",
    })
}

/// Writes `records`, keeping records of systems this run did not measure.
pub fn write(path: &str, records: &[Record], quick: bool) {
    let ours: std::collections::HashSet<&str> = records.iter().map(|r| r.system.as_str()).collect();
    let mut kept: Vec<Value> = std::fs::read_to_string(path)
        .ok()
        .and_then(|s| serde_json::from_str::<Value>(&s).ok())
        .and_then(|v| v.get("records").and_then(|r| r.as_array()).cloned())
        .unwrap_or_default()
        .into_iter()
        .filter(|r| r.get("system").and_then(|s| s.as_str()).is_some_and(|s| !ours.contains(s)))
        .collect();
    kept.extend(records.iter().map(Record::to_json));
    // One record per line: diffs of the committed file stay readable.
    let lines: Vec<String> = kept.iter().map(|r| format!("    {r}")).collect();
    let head = serde_json::to_string_pretty(&header(quick)).expect("json").replace('\n', "\n  ");
    let text = format!("{{\n  \"header\": {head},\n  \"records\": [\n{}\n  ]\n}}\n", lines.join(",\n"));
    if let Some(dir) = std::path::Path::new(path).parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    std::fs::write(path, text).unwrap_or_else(|e| panic!("cannot write {path}: {e}"));
    eprintln!("wrote {path}");
}

/// Medians across rounds: (p50, p99, rps) per (system, size, inflight).
pub fn medians(records: &[Record]) -> BTreeMap<(String, usize, usize), (f64, f64, f64)> {
    let mut groups: BTreeMap<(String, usize, usize), Vec<Sample>> = BTreeMap::new();
    for r in records {
        groups.entry((r.system.clone(), r.size, r.inflight)).or_default().push(r.sample);
    }
    groups
        .into_iter()
        .map(|(k, v)| {
            let mut p50: Vec<f64> = v.iter().map(|s| s.p50_us).collect();
            let mut p99: Vec<f64> = v.iter().map(|s| s.p99_us).collect();
            let mut rps: Vec<f64> = v.iter().map(|s| s.rps).collect();
            (k, (median(&mut p50), median(&mut p99), median(&mut rps)))
        })
        .collect()
}

pub fn us(v: f64) -> String {
    if v >= 10_000.0 {
        format!("{:.1} ms", v / 1000.0)
    } else if v >= 100.0 {
        format!("{v:.0} µs")
    } else {
        format!("{v:.2} µs")
    }
}

pub fn print_transport(records: &[Record]) {
    let m = medians(records);
    let get = |sys: &str, size: usize, inflight: usize| m.get(&(sys.to_owned(), size, inflight)).copied();
    println!("\nisthmus-shm transport: round trips between two processes (medians of {} rounds)\n", crate::ROUNDS);
    println!(
        "| size | isthmus-shm p50 | p99 | raw-uds p50 | p99 | speed-up | memcpy (one way) | isthmus ÷ memcpy | floor-copy | isthmus ÷ floor |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for &size in &crate::SIZES {
        let (Some(i), Some(u), Some(c)) =
            (get("isthmus-shm-transport", size, 1), get("raw-uds", size, 1), get("memcpy", size, 1))
        else {
            continue;
        };
        let (floor, over_floor) = match get("floor-copy", size, 1) {
            Some(f) => (us(f.0), format!("{:.2}×", i.0 / f.0)),
            None => ("–".into(), "–".into()),
        };
        println!(
            "| {} | {} | {} | {} | {} | {:.2}× | {} | {:.2}× | {floor} | {over_floor} |",
            size_name(size),
            us(i.0),
            us(i.1),
            us(u.0),
            us(u.1),
            u.0 / i.0,
            us(c.0),
            i.0 / c.0
        );
    }
    if let (Some(i), Some(u)) = (get("isthmus-shm-transport", 64, 32), get("raw-uds", 64, 32)) {
        println!(
            "\n64 B with 32 in flight: isthmus-shm {:.0} msg/s, raw-uds {:.0} msg/s ({:.1}×)",
            i.2,
            u.2,
            i.2 / u.2
        );
    }
    println!("\nWake-up regimes at 64 B (p50 / p99):");
    for (name, what) in [
        ("isthmus-shm-transport", "default: bounded spin, then eventfd sleep"),
        ("isthmus-shm-transport-nospin", "spin 0: every wait sleeps on the eventfd"),
        ("isthmus-shm-transport-samecore", "client and server pinned to one core"),
    ] {
        if let Some(v) = get(name, 64, 1) {
            println!("  {name:<32} {:>10} / {:>10}   {what}", us(v.0), us(v.1));
        }
    }
    for (name, what) in [
        ("floor-spin", "two processes spinning on one shared word"),
        ("floor-eventfd", "two processes waking each other by eventfd"),
    ] {
        if let Some(v) = get(name, 0, 1) {
            println!("  {name:<32} {:>10} / {:>10}   {what}", us(v.0), us(v.1));
        }
    }
}

pub fn print_rpc(records: &[Record]) {
    let m = medians(records);
    let get = |sys: &str, size: usize, inflight: usize| m.get(&(sys.to_owned(), size, inflight)).copied();
    println!(
        "\nRPC echo: isthmus engine over shm:// beside tonic over a Unix socket (medians of {} rounds)\n",
        crate::ROUNDS
    );
    println!("| size | isthmus-rust p50 (p99) | tonic-isthmus-shm p50 (p99) | tonic-uds p50 (p99) | ÷ tonic-uds | ÷ tonic-uds | raw-uds p50 |");
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    for &size in &crate::RPC_SIZES {
        let (Some(i), Some(t)) = (get("isthmus-rust", size, 1), get("tonic-uds", size, 1)) else {
            continue;
        };
        let both = |v: (f64, f64, f64)| format!("{} ({})", us(v.0), us(v.1));
        let bridged = get("tonic-isthmus-shm", size, 1);
        println!(
            "| {} | {} | {} | {} | {:.1}× | {} | {} |",
            size_name(size),
            both(i),
            bridged.map_or_else(|| "-".into(), both),
            both(t),
            t.0 / i.0,
            bridged.map_or_else(|| "-".into(), |b| format!("{:.1}×", t.0 / b.0)),
            get("raw-uds", size, 1).map_or_else(|| "-".into(), |r| us(r.0)),
        );
    }
    if let (Some(f), Some(b), Some(t)) =
        (get("tonic-floor", 64, 1), get("tonic-isthmus-shm", 64, 1), get("tonic-uds", 64, 1))
    {
        println!(
            "\ntonic's own floor at 64 B (tonic-floor: the same client and service in one task, no transport): \
             {}; tonic-isthmus-shm {} is that plus {} of isthmus; 20× tonic-uds would be {}",
            us(f.0),
            us(b.0),
            us(b.0 - f.0),
            us(t.0 / 20.0)
        );
    }
    if let (Some(i), Some(t)) = (get("isthmus-rust", 64, 32), get("tonic-uds", 64, 32)) {
        println!(
            "\n64 B with 32 in flight: isthmus-rust {:.0} calls/s, tonic-uds {:.0} calls/s ({:.1}×)",
            i.2,
            t.2,
            i.2 / t.2
        );
    }
    println!("\nOne server stream (about 256 MiB): messages/s and GB/s");
    for size in crate::STREAM_SIZES {
        let line: Vec<String> = ["isthmus-rust", "tonic-isthmus-shm", "tonic-uds"]
            .iter()
            .filter_map(|sys| {
                let v = get(&format!("stream-{sys}"), size, 1)?;
                Some(format!("{sys} {:.0} msg/s ({:.2} GB/s)", v.2, v.2 * size as f64 / 1e9))
            })
            .collect();
        println!("  {}: {}", size_name(size), line.join(", "));
    }
}

/// The Python clients' table: isthmus (sync, asyncio) beside grpcio (sync, aio) against tonic.
pub fn print_python(records: &[Record]) {
    let m = medians(records);
    let get = |sys: &str, size: usize, inflight: usize| m.get(&(sys.to_owned(), size, inflight)).copied();
    println!("\nPython clients → Rust servers (medians of {} rounds, p50)\n", crate::ROUNDS);
    println!("| size | py-isthmus-sync | py-isthmus-upgraded | py-isthmus-aio | py-grpc-sync-tonic-uds | py-grpc-aio-tonic-uds | py-raw-uds | sync ÷ grpc | upgraded ÷ sync | aio ÷ grpc.aio |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let cell = |v: Option<(f64, f64, f64)>| v.map_or_else(|| "-".into(), |v| us(v.0));
    let ratio = |a: Option<(f64, f64, f64)>, b: Option<(f64, f64, f64)>| match (a, b) {
        (Some(a), Some(b)) => format!("{:.1}×", b.0 / a.0),
        _ => "-".into(),
    };
    for &size in &crate::RPC_SIZES {
        let [s, up, a, gs, ga, raw] = [
            "py-isthmus-sync",
            "py-isthmus-upgraded",
            "py-isthmus-aio",
            "py-grpc-sync-tonic-uds",
            "py-grpc-aio-tonic-uds",
            "py-raw-uds",
        ]
        .map(|sys| get(sys, size, 1));
        // The upgraded path's cost over direct shm:// (1.00× is none).
        let upgraded = match (up, s) {
            (Some(up), Some(s)) => format!("{:.2}×", up.0 / s.0),
            _ => "-".into(),
        };
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            size_name(size),
            cell(s),
            cell(up),
            cell(a),
            cell(gs),
            cell(ga),
            cell(raw),
            ratio(s, gs),
            upgraded,
            ratio(a, ga)
        );
    }
    for (ours, theirs) in [("py-isthmus-sync", "py-grpc-sync-tonic-uds"), ("py-isthmus-aio", "py-grpc-aio-tonic-uds")] {
        if let (Some(i), Some(t)) = (get(ours, 64, 32), get(theirs, 64, 32)) {
            println!(
                "\n64 B with 32 in flight: {ours} {:.0} calls/s, {theirs} {:.0} calls/s ({:.1}×)",
                i.2,
                t.2,
                i.2 / t.2
            );
        }
    }
    if let (Some(floor), Some(aio), Some(grpc)) =
        (get("py-aio-floor", 64, 32), get("py-isthmus-aio", 64, 32), get("py-grpc-aio-tonic-uds", 64, 32))
    {
        println!(
            "the same asyncio client with no transport (py-aio-floor): {:.0} calls/s, {:.1}× grpc.aio; py-isthmus-aio reaches {:.0} % of it",
            floor.2,
            floor.2 / grpc.2,
            100.0 * aio.2 / floor.2
        );
    }
}

/// The fan-out table: per (size, subscribers), each system's publish-to-last-delivery p50 (p99)
/// and CPU per publish, medians across rounds, with tonic's and grpcio's p50 over isthmus's.
pub fn print_fanout(records: &[Record]) {
    type Key = (String, usize, usize);
    let mut groups: BTreeMap<Key, Vec<(f64, f64, f64)>> = BTreeMap::new();
    let mut rounds = 0;
    for r in records.iter().filter(|r| r.system.starts_with("fanout-")) {
        let subs = r.extra["subscribers"].as_u64().unwrap_or(0) as usize;
        let cpu = r.extra["cpu_us_per_publish"].as_f64().unwrap_or(f64::NAN);
        groups.entry((r.system.clone(), r.size, subs)).or_default().push((r.sample.p50_us, r.sample.p99_us, cpu));
        rounds = rounds.max(r.round);
    }
    if groups.is_empty() {
        return;
    }
    let m: BTreeMap<Key, (f64, f64, f64)> = groups
        .into_iter()
        .map(|(k, v)| {
            let col = |f: fn(&(f64, f64, f64)) -> f64| median(&mut v.iter().map(f).collect::<Vec<_>>());
            let p50 = col(|x| x.0);
            let p99 = col(|x| x.1);
            let cpu = col(|x| x.2);
            (k, (p50, p99, cpu))
        })
        .collect();
    let get = |sys: &str, size: usize, subs: usize| m.get(&(format!("fanout-{sys}"), size, subs)).copied();
    let systems = ["isthmus-shm", "tonic-uds", "grpcio"];
    println!("\nFan-out: publish to delivery at the last subscriber, and the publisher's CPU per publish (medians of {rounds} rounds)\n");
    println!("| size | subscribers | isthmus-shm p50 (p99) | tonic-uds p50 (p99) | grpcio p50 (p99) | tonic ÷ isthmus | grpcio ÷ isthmus | CPU/publish isthmus | tonic | grpcio |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let dash = || "-".to_owned();
    for size in crate::fanout::SIZES {
        for subs in crate::fanout::SUBSCRIBERS {
            let [i, t, g] = systems.map(|sys| get(sys, size, subs));
            if i.is_none() && t.is_none() && g.is_none() {
                continue;
            }
            let both = |v: Option<(f64, f64, f64)>| v.map_or_else(dash, |v| format!("{} ({})", us(v.0), us(v.1)));
            let ratio = |theirs: Option<(f64, f64, f64)>| match (i, theirs) {
                (Some(i), Some(t)) => format!("{:.1}×", t.0 / i.0),
                _ => dash(),
            };
            let cpu = |v: Option<(f64, f64, f64)>| v.map_or_else(dash, |v| us(v.2));
            println!(
                "| {} | {subs} | {} | {} | {} | {} | {} | {} | {} | {} |",
                size_name(size),
                both(i),
                both(t),
                both(g),
                ratio(t),
                ratio(g),
                cpu(i),
                cpu(t),
                cpu(g)
            );
        }
    }
    let big = 1 << 20;
    let growth: Vec<String> = systems
        .iter()
        .filter_map(|sys| {
            let (one, many) = (get(sys, big, 1)?, get(sys, big, 32)?);
            Some(format!("{sys} {:.1}×", many.2 / one.2))
        })
        .collect();
    if !growth.is_empty() {
        println!("\nCPU per publish of 1 MiB, 32 subscribers ÷ 1 subscriber: {}", growth.join(", "));
    }
}
