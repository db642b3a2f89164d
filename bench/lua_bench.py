"""The Lua benchmark (issue "OpenResty/nginx"), run by `make bench`: one nginx worker calls an
echo server 100,000 times in a row from one `content_by_lua` (the lua-resty-ffi seed's shape),
at 512 B, 4 KiB, 10 KiB and 100 KiB, over isthmus (`lua-isthmus-shm`) and over the hand-made
alternative it replaces, a cosocket to a Unix socket with a 4-byte length before each message
(`lua-cosocket-uds`, echoed by a Rust server); then wrk at 32 connections against a location that
makes one 512 B call per request (`lua-isthmus-shm-http`, `lua-cosocket-uds-http`), against
the same location making none (`nginx-lua-nocall-http`, the ceiling), and against one making none
but yielding once to the event loop (`nginx-lua-yield-http`, `ngx.sleep(0)`: the floor under any
call that does not block the worker, which must suspend the request and resume it).

The floor under the sequential echo is measured in the same rounds (`lua-floor-copy-out`:
`isthmus-bench floor-copy-out`, two processes that spin on each other and make the echo's three
copies, with no transport and no Lua: the request into shared memory, the server's answer, and
the answer out into memory of the caller's own, as `ffi.string` makes it; the lowest of three
short runs).

Two other ways to wait that the ADR (docs/adr/0011) weighed are measured at 512 B too:
`lua-isthmus-shm-nospin` (every reply through the completion queue's cosocket bell) and
`lua-isthmus-worker-thread` (a blocking call inside `ngx.run_worker_thread`).

Records go into results.json (rows of these systems replaced): system, size, inflight, p50_us,
p99_us, rps, round, and total_s for the sequential runs.

    python bench/lua_bench.py docs/bench/results.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = [512, 4096, 10240, 102400]
CALLS = 100_000
WRK_SECONDS = 10
ROUNDS = 3

CONF = """
load_module /usr/lib/nginx/modules/ndk_http_module.so;
load_module /usr/lib/nginx/modules/ngx_http_lua_module.so;
{user}
worker_processes 1;
daemon off;
master_process on;
error_log {prefix}/error.log warn;
pid {prefix}/nginx.pid;
env ISTHMUS_LIB;
thread_pool isthmus threads=2;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    lua_package_path "{root}/lua/lib/?.lua;{root}/bench/lua/?.lua;;";
    lua_socket_log_errors off;
    init_worker_by_lua_block {{ require("isthmus_bench").init("{target}", "{uds}") }}
    server {{
        listen 127.0.0.1:{port} reuseport backlog=4096;
        keepalive_requests 1000000;
        location = /seq {{ content_by_lua_block {{ require("isthmus_bench").seq() }} }}
        location = /http/nginx-lua-yield-http {{
            # Debian's module lacks OpenResty's delayed-events patch, so ngx.sleep(0) logs a
            # warning on every call: the floor would pay for writing it to the log.
            error_log {prefix}/error.log error;
            content_by_lua_block {{ require("isthmus_bench").http("nginx-lua-yield-http") }}
        }}
        location ~ ^/http/([a-z0-9-]+)$ {{
            content_by_lua_block {{ require("isthmus_bench").http(ngx.var[1]) }}
        }}
    }}
}}
"""

HTTP = [
    "lua-isthmus-shm-http",
    "lua-isthmus-shm-nospin-http",
    "lua-cosocket-uds-http",
    "nginx-lua-yield-http",
    "nginx-lua-nocall-http",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(argv: list[str]) -> subprocess.Popen[str]:
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.strip() == "READY", f"{argv[1]} printed {line!r}"
    return p


def get(port: int, path: str, timeout: float = 600) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
        return str(r.read().decode())


def cpu_seconds(pid: int) -> float:
    """User and system CPU time a process (all its threads) has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wrk(port: int, path: str, seconds: int, pids: dict[str, list[int]]) -> dict[str, float]:
    """Requests/s and latency percentiles at 32 connections (2 threads), and the cores each of
    `pids`' groups and wrk itself used meanwhile (`cpu_<group>`): where the two cores went."""
    before = {g: sum(cpu_seconds(p) for p in ps) for g, ps in pids.items()}
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    out = subprocess.run(
        ["wrk", "-t2", "-c32", f"-d{seconds}s", "--latency", f"http://127.0.0.1:{port}{path}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    timeouts = re.search(r"Socket errors:.*timeout (\d+)", out)
    if re.search(r"Non-2xx", out) or (timeouts and int(timeouts.group(1))):
        raise AssertionError(f"wrk saw failed or unanswered requests at {path}:\n{out}")

    def pct(p: str) -> float:
        m = re.search(rf"^\s+{p}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        assert m, out
        return float(m.group(1)) * {"us": 1, "ms": 1e3, "s": 1e6}[m.group(2)]

    wall = time.monotonic() - start
    cpu = {
        f"cpu_{g}": round((sum(cpu_seconds(p) for p in ps) - before[g]) / wall, 2) for g, ps in pids.items()
    }
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu["cpu_wrk"] = round(
        (after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime) / wall, 2
    )
    return {"rps": rps, "p50_us": pct("50"), "p99_us": pct("99"), **cpu}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    calls, rounds, seconds = (20_000, 1, 3) if args.quick else (CALLS, ROUNDS, WRK_SECONDS)
    bench_bin = ROOT / "target" / "release" / "isthmus-bench"
    lib = ROOT / "target" / "release" / "libisthmus_capi.so"
    for need in (bench_bin, lib):
        assert need.is_file(), f"{need} is not built (make bench builds it)"
    assert shutil.which("nginx") and shutil.which("wrk"), "nginx and wrk are needed (make lua-tools)"

    prefix = Path(tempfile.mkdtemp(prefix="isthmus-lua-bench-"))
    target = f"shm://{prefix}/isthmus.sock"  # removed with the prefix: the server is killed
    uds = prefix / "echo.sock"
    servers = [
        start_server([str(bench_bin), "serve-isthmus", target]),
        start_server([str(bench_bin), "serve-uds-len4", str(uds)]),
    ]
    port = free_port()
    (prefix / "nginx.conf").write_text(
        CONF.format(
            user="user root;" if os.geteuid() == 0 else "",
            prefix=prefix,
            root=ROOT,
            target=target,
            uds=uds,
            port=port,
        )
    )
    nginx = subprocess.Popen(
        ["nginx", "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-e", str(prefix / "stderr.log")],
        env=dict(os.environ, ISTHMUS_LIB=str(lib)),
    )
    records: list[dict[str, object]] = []
    stuck = False
    try:
        for _ in range(200):
            try:
                get(port, "/http/nginx-lua-nocall-http", timeout=5)
                break
            except OSError:
                time.sleep(0.05)
        workers = subprocess.run(["pgrep", "-P", str(nginx.pid)], check=True, capture_output=True, text=True)
        pids = {
            "nginx": [int(p) for p in workers.stdout.split()],
            "isthmus_server": [servers[0].pid],
            "uds_server": [servers[1].pid],
        }
        for rnd in range(1, rounds + 1):
            records += run_round(port, rnd, calls, seconds, pids, bench_bin, 1.0 if args.quick else 2.0)
    finally:
        nginx.send_signal(signal.SIGQUIT)
        try:
            nginx.wait(timeout=30)
        except subprocess.TimeoutExpired:
            # A graceful quit that hangs is a bug to see, not to hide (a worker once waited for
            # ever after its last call).
            nginx.kill()
            print("nginx did not quit gracefully within 30 s: killed", file=sys.stderr, flush=True)
            stuck = True
        for s in servers:
            s.kill()
            s.wait()
        shutil.rmtree(prefix, ignore_errors=True)

    if stuck:
        return 1
    path = Path(args.results)
    data = json.loads(path.read_text())
    ours = {str(r["system"]) for r in records}
    data["records"] = [r for r in data["records"] if r.get("system") not in ours] + records
    path.write_text(json.dumps(data, indent=1) + "\n")
    summarize(records)
    return 0


def run_round(
    port: int,
    rnd: int,
    calls: int,
    seconds: int,
    pids: dict[str, list[int]],
    bench_bin: Path,
    floor_seconds: float,
) -> list[dict[str, object]]:
    """One round: the sequential runs, each size's floor right after them (this host's speed
    drifts by 2-4x within minutes), then wrk against each location."""
    records: list[dict[str, object]] = []
    runs = [
        (s, size, calls)
        for size in SIZES
        for s in ("lua-isthmus-shm", "lua-cosocket-uds", "lua-floor-copy-out")
    ]
    runs += [(s, 512, calls // 5) for s in ("lua-isthmus-shm-nospin", "lua-isthmus-worker-thread")]
    for system, size, n in runs:
        if system == "lua-floor-copy-out":
            records.append(floor(bench_bin, rnd, size, floor_seconds))
            continue
        r = json.loads(get(port, f"/seq?system={system}&size={size}&n={n}"))
        assert "error" not in r, (system, size, r)
        rec = {"system": system, "size": size, "inflight": 1, "round": rnd, "calls": n}
        rec.update(p50_us=round(r["p50_us"], 3), p99_us=round(r["p99_us"], 3))
        rec.update(total_s=round(r["total_s"], 4), rps=round(n / r["total_s"], 1))
        records.append(rec)
        p50, p99 = r["p50_us"], r["p99_us"]
        print(f"round {rnd} {system:28} {size:>7} B  p50 {p50:8.2f} µs  p99 {p99:8.2f} µs", flush=True)
    for system in HTTP:
        w = wrk(port, f"/http/{system}", seconds, pids)
        records.append({"system": system, "size": 512, "inflight": 32, "round": rnd, **w})
        cores = ", ".join(f"{k.removeprefix('cpu_')} {v}" for k, v in w.items() if k.startswith("cpu_"))
        print(f"round {rnd} {system:28} wrk -c32: {w['rps']:10.0f} requests/s  cores: {cores}", flush=True)
    return records


def floor(bench_bin: Path, rnd: int, size: int, budget: float) -> dict[str, object]:
    """One `lua-floor-copy-out` record (see the module's doc): the lowest p50 of three short
    runs, each with processes of its own. A floor is the least the copies can cost, and on this
    host one run in a few lands in a phase where it costs 3-4x that (as `floor-copy` does in
    the transport's table), while the echoes beside it do not."""
    runs = []
    for _ in range(3):
        done = subprocess.run(
            [str(bench_bin), "floor-copy-out", str(budget / 3), str(size)],
            check=True,
            capture_output=True,
            text=True,
        )
        runs.append(json.loads(done.stdout))
    r = min(runs, key=lambda run: float(run["p50_us"]))
    rec: dict[str, object] = {"system": "lua-floor-copy-out", "size": size, "inflight": 1, "round": rnd}
    rec.update(p50_us=round(r["p50_us"], 3), p99_us=round(r["p99_us"], 3), rps=round(r["rps"], 1))
    seen = ", ".join(f"{run['p50_us']:.2f}" for run in runs)
    print(
        f"round {rnd} {'lua-floor-copy-out':28} {size:>7} B  p50 {r['p50_us']:8.2f} µs (runs: {seen})",
        flush=True,
    )
    return rec


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def summarize(records: list[dict[str, object]]) -> None:
    def med(system: str, size: int, field: str) -> float:
        return median([float(r[field]) for r in records if r["system"] == system and r["size"] == size])  # type: ignore[arg-type]

    print("\nmedians across rounds:")
    for size in SIZES:
        ours, theirs = med("lua-isthmus-shm", size, "p50_us"), med("lua-cosocket-uds", size, "p50_us")
        low = med("lua-floor-copy-out", size, "p50_us")  # not `floor`: that is the function above
        print(
            f"  {size:>6} B  isthmus p50 {ours:7.2f} µs, cosocket p50 {theirs:7.2f} µs: {theirs / ours:.1f}x;"
            f" floor {low:.2f} µs (isthmus {ours / low:.2f}x it; 5x the cosocket is {theirs / 5:.2f} µs)"
        )
    wrk_systems = (
        "lua-isthmus-shm-http",
        "lua-cosocket-uds-http",
        "nginx-lua-yield-http",
        "nginx-lua-nocall-http",
    )
    ours, theirs, yielding, none = (med(s, 512, "rps") for s in wrk_systems)
    print(f"  wrk -c32: isthmus {ours:.0f}/s, cosocket {theirs:.0f}/s ({ours / theirs:.2f}x)")
    print(f"  no call {none:.0f}/s: isthmus reaches {100 * ours / none:.0f} % of the ceiling")
    print(f"  one yield, no call {yielding:.0f}/s: isthmus reaches {100 * ours / yielding:.0f} % of it")


if __name__ == "__main__":
    raise SystemExit(main())
