#!/usr/bin/env python3
"""Regenerates the benchmark table in README.md from docs/bench/results.json (medians across
rounds), between the markers <!-- bench-table:start --> and <!-- bench-table:end -->."""

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES = {
    64: "64 B",
    1 << 10: "1 KiB",
    64 << 10: "64 KiB",
    1 << 20: "1 MiB",
    16 << 20: "16 MiB",
    256 << 20: "256 MiB",
}


def fmt(us: float) -> str:
    if us >= 10_000:
        return f"{us / 1000:.1f} ms"
    if us >= 100:
        return f"{us:.0f} µs"
    return f"{us:.2f} µs"


def main() -> int:
    data = json.loads((ROOT / "docs/bench/results.json").read_text())
    recs = data["records"]

    def med(system: str, size: int, inflight: int, field: str) -> float | None:
        vals = [
            r[field]
            for r in recs
            if (r["system"], r["size"], r["inflight"]) == (system, size, inflight) and r[field] is not None
        ]
        return statistics.median(vals) if vals else None

    h = data["header"]
    machine, versions = h["machine"], h["versions"]
    rows = [
        f"This run: commit {versions['commit']}, {h['date'][:10]}, {machine['cores']} vCPUs "
        f"({machine['cpu']}), {machine['memory_gib']} GiB RAM, Linux {machine['kernel']}; medians of "
        f"{h['rounds']} rounds{' (QUICK)' if h.get('quick') else ''}.",
        "",
        "![Round-trip latency against message size, Python clients](docs/bench/latency-python.png)",
        "",
    ]
    gateway = ["gateway-isthmus-shm", "gateway-grpc-aio-uds", "gateway-httpx-axum-uds"]
    callers = sorted({r["inflight"] for r in recs if r["system"] in gateway})
    if callers:
        rows += [
            "The gateway ↔ sidecar demo (`examples/gateway-sidecar`: Python asyncio gateway, Rust sidecar, ~1 KiB JSON requests, every response checked), requests/s (p99):",
            "",
            "| callers | isthmus (shm://) | grpc.aio → tonic (UDS) | httpx → axum (UDS) | isthmus ÷ grpc.aio | isthmus ÷ httpx |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for n in callers:
            size = next(r["size"] for r in recs if r["system"] == gateway[0])
            rps = [med(g, size, n, "rps") for g in gateway]
            p99 = [med(g, size, n, "p99_us") for g in gateway]
            if None in rps or None in p99:
                continue
            cells = [f"{r:,.0f} ({fmt(p)})" for r, p in zip(rps, p99, strict=True)]
            rows.append(
                f"| {n} | " + " | ".join(cells) + f" | {rps[0] / rps[1]:.1f}× | {rps[0] / rps[2]:.0f}× |"
            )
        rows.append("")
        floor = med("gateway-floor", size, max(callers), "rps")
        top = med(gateway[0], size, max(callers), "rps")
        floor_async = med("gateway-floor-async", size, max(callers), "rps")
        if floor and top:
            rows += [
                f"The gateway's own Python work, with no transport (`bench/gateway_floor.py`, same run), "
                f"allows at most {floor:,.0f} requests/s at {max(callers)} callers: isthmus reaches "
                f"{top / floor:.0%} of it."
                + (
                    f" With one turn of the event loop per reply and per streamed message, the least a "
                    f"transport that completes calls on the loop adds (`gateway-floor-async`), it allows "
                    f"{floor_async:,.0f}: isthmus reaches {top / floor_async:.0%} of that."
                    if floor_async
                    else ""
                ),
                "",
            ]
    rows += [
        "Unary echo through whole RPC stacks, client and server in two processes: the isthmus engine (`isthmus-rust`: blocking client → server on shm://), a tonic client and tonic service with isthmus under both (`tonic-isthmus-shm`), and the same tonic client and service over a Unix socket (`tonic-uds`).",
        "",
        "| message | isthmus-rust p50 (p99) | tonic-isthmus-shm p50 (p99) | tonic-uds p50 (p99) | isthmus-rust ÷ tonic-uds | tonic-isthmus-shm ÷ tonic-uds |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for size, name in SIZES.items():
        i50, i99 = med("isthmus-rust", size, 1, "p50_us"), med("isthmus-rust", size, 1, "p99_us")
        s50, s99 = med("tonic-isthmus-shm", size, 1, "p50_us"), med("tonic-isthmus-shm", size, 1, "p99_us")
        t50, t99 = med("tonic-uds", size, 1, "p50_us"), med("tonic-uds", size, 1, "p99_us")
        if None in (i50, i99, t50, t99):
            continue
        bridged = f"{fmt(s50)} ({fmt(s99)})" if s50 and s99 else "-"
        ratio = f"{t50 / s50:.1f}×" if s50 else "-"
        rows.append(
            f"| {name} | {fmt(i50)} ({fmt(i99)}) | {bridged} | {fmt(t50)} ({fmt(t99)}) | {t50 / i50:.1f}× | {ratio} |"
        )
    ir, sr, tr = (
        med("isthmus-rust", 64, 32, "rps"),
        med("tonic-isthmus-shm", 64, 32, "rps"),
        med("tonic-uds", 64, 32, "rps"),
    )
    floor, s64, t64 = (
        med("tonic-floor", 64, 1, "p50_us"),
        med("tonic-isthmus-shm", 64, 1, "p50_us"),
        med("tonic-uds", 64, 1, "p50_us"),
    )
    if floor and s64 and t64:
        rows += [
            "",
            f"tonic's own floor at 64 B (`tonic-floor`: the same tonic client and service in one task, no transport): "
            f"{fmt(floor)}. `tonic-isthmus-shm` is that plus {fmt(s64 - floor)} of isthmus; 20× `tonic-uds` would be {fmt(t64 / 20)}.",
        ]
    if ir and tr:
        bridged = f", tonic-isthmus-shm {sr / 1e3:.0f} k ({sr / tr:.1f}×)" if sr else ""
        rows += [
            "",
            f"64 B with 32 calls in flight: isthmus-rust {ir / 1e3:.0f} k calls/s ({ir / tr:.1f}× tonic-uds){bridged}, tonic-uds {tr / 1e3:.0f} k calls/s.",
            "",
        ]
    py = [
        "py-isthmus-sync",
        "py-isthmus-aio",
        "py-grpc-sync-tonic-uds",
        "py-grpc-aio-tonic-uds",
        "py-raw-uds",
    ]
    if med(py[0], 64, 1, "p50_us") is not None:
        rows += [
            "Python clients against Rust servers: isthmus's sync and asyncio API over shm:// beside grpcio and grpc.aio against tonic over a Unix socket, and a plain Python socket against a length-prefixed echo (p50):",
            "",
            "| message | isthmus sync | isthmus aio | grpcio sync | grpc.aio | Python socket | sync ÷ grpcio | aio ÷ grpc.aio |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for size, name in SIZES.items():
            v = [med(system, size, 1, "p50_us") for system in py]
            if None in v:
                continue
            rows.append(
                f"| {name} | "
                + " | ".join(fmt(x) for x in v)
                + f" | {v[2] / v[0]:.1f}× | {v[3] / v[1]:.1f}× |"
            )
        up = [
            (name, med("py-isthmus-upgraded", size, 1, "p50_us"), med(py[0], size, 1, "p50_us"))
            for size, name in SIZES.items()
        ]
        ratios = [f"{a / b:.2f}× at {name}" for name, a, b in up if a and b]
        if ratios:
            rows += [
                "",
                "The sync client given `localhost:PORT` of a server that also serves shm:// (it moves "
                f"there by itself, ADR 0013) costs {', '.join(ratios)} what the direct shm:// call costs.",
            ]
        sr, ar = med(py[0], 64, 32, "rps"), med(py[1], 64, 32, "rps")
        gsr, gar = med(py[2], 64, 32, "rps"), med(py[3], 64, 32, "rps")
        if sr and ar and gsr and gar:
            rows += [
                "",
                f"64 B with 32 calls in flight: isthmus aio {ar / 1e3:.0f} k calls/s ({ar / gar:.1f}× grpc.aio's {gar / 1e3:.0f} k); isthmus sync {sr / 1e3:.0f} k ({sr / gsr:.1f}× grpcio's {gsr / 1e3:.0f} k).",
                "",
            ]
            floor = med("py-aio-floor", 64, 32, "rps")
            if floor:
                rows[-1:-1] = [
                    f"The same asyncio client with no transport at all (`py-aio-floor`) makes {floor / 1e3:.0f} k calls/s "
                    f"({floor / gar:.1f}× grpc.aio): isthmus aio reaches {100 * ar / floor:.0f} % of it.",
                ]
    pp, pg = med("py-py-isthmus", 64, 1, "p50_us"), med("py-py-grpcio", 64, 1, "p50_us")
    ap, ag = med("py-aio-py-isthmus", 64, 1, "p50_us"), med("py-aio-py-grpc-aio", 64, 1, "p50_us")
    if pp and pg and ap and ag:
        rows += [
            f"A Python client of a Python server (`bench/py_server.py`), 64 B p50: isthmus {fmt(pp)} "
            f"(grpcio {fmt(pg)}, {pg / pp:.0f}×); asyncio at both ends, isthmus {fmt(ap)} "
            f"(grpc.aio {fmt(ag)}, {ag / ap:.0f}×).",
            "",
        ]
    go = ["go-isthmus-shm", "go-isthmus-raw", "go-grpc-uds"]
    if med(go[0], 64, 1, "p50_us") is not None:
        rows += [
            "Go: a `protoc-gen-go-grpc` client and a Go server over isthmus (`go-isthmus-shm`), the raw tier writing into and reading from shared memory in place (`go-isthmus-raw`), and grpc-go over a Unix socket with 64 MiB windows and 1 MiB buffers (`go-grpc-uds`), p50:",
            "",
            "| message | go-isthmus-shm | go-isthmus-raw | go-grpc-uds | shm ÷ grpc-go | raw ÷ memcpy |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for size in (64, 1 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20):
            v = [med(g, size, 1, "p50_us") for g in go]
            if None in v:
                continue
            mc = med("go-memcpy", size, 1, "p50_us")
            label = SIZES.get(size, f"{size >> 20} MiB")
            ratio = f"{v[1] / mc:.2f}×" if mc else "-"
            rows.append(
                f"| {label} | {fmt(v[0])} | {fmt(v[1])} | {fmt(v[2])} | {v[2] / v[0]:.1f}× | {ratio} |"
            )
        r32 = [med(g, 64, 32, "rps") for g in go]
        if None not in r32:
            rows += [
                "",
                f"64 B with 32 in flight: go-isthmus-shm {r32[0] / 1e3:.0f} k calls/s, go-grpc-uds {r32[2] / 1e3:.0f} k ({r32[0] / r32[2]:.1f}×).",
            ]
        gr = (
            med("go-isthmus-shm-goroutines", 64, 1, "p50_us"),
            med("go-isthmus-shm-goroutines", 64, 32, "rps"),
        )
        if None not in gr:
            rows += [
                "",
                f"go-isthmus-shm's server runs its unary handlers on the connection's reader (`InlineUnary`); with `NewServer`'s defaults, each handler on a goroutine (`go-isthmus-shm-goroutines`), 64 B p50 {fmt(gr[0])}, 32 in flight {gr[1] / 1e3:.0f} k calls/s.",
            ]
        dl = [med(s, 64, 1, "p50_us") for s in ("go-isthmus-shm-deadline", "go-grpc-uds-deadline")]
        if None not in dl:
            rows += [
                "",
                f"With a 10 s deadline on each call (a context that can be cancelled), 64 B p50: go-isthmus-shm {fmt(dl[0])}, go-grpc-uds {fmt(dl[1])} ({dl[1] / dl[0]:.1f}×).",
            ]
        rows.append("")
    lua = ["lua-isthmus-shm", "lua-cosocket-uds"]
    if med(lua[0], 512, 1, "p50_us") is not None:
        rows += [
            "nginx + Lua (`resty.isthmus`, one worker, 100,000 sequential echo calls in one `content_by_lua`) over shm:// beside the hand-made alternative, a cosocket to a Unix socket with a 4-byte length (`lua-cosocket-uds`), p50 (p99):",
            "",
            "| message | lua-isthmus-shm | lua-cosocket-uds | isthmus ÷ cosocket | floor: three copies (`lua-floor-copy-out`) | isthmus ÷ floor |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for size in (512, 4096, 10240, 102400):
            v = [med(s, size, 1, "p50_us") for s in lua]
            p = [med(s, size, 1, "p99_us") for s in lua]
            if None in v or None in p:
                continue
            f = med("lua-floor-copy-out", size, 1, "p50_us")
            floor = f"{fmt(f)} | {v[0] / f:.2f}×" if f else "– | –"
            rows.append(
                f"| {size:,} B | {fmt(v[0])} ({fmt(p[0])}) | {fmt(v[1])} ({fmt(p[1])}) | {v[1] / v[0]:.1f}× | {floor} |"
            )
        http = [
            med(s, 512, 32, "rps")
            for s in ("lua-isthmus-shm-http", "lua-cosocket-uds-http", "nginx-lua-nocall-http")
        ]
        if None not in http:
            yielding = med("nginx-lua-yield-http", 512, 32, "rps")
            floor = (
                f"; with no call but one yield to the event loop (`ngx.sleep(0)`, the floor under a call that does not block the worker) {yielding / 1e3:.1f} k (isthmus reaches {100 * http[0] / yielding:.0f} % of it)"
                if yielding
                else ""
            )
            rows += [
                "",
                f"wrk at 32 connections, one 512 B call per request: isthmus {http[0] / 1e3:.1f} k requests/s, cosocket {http[1] / 1e3:.1f} k ({http[0] / http[1]:.2f}×); the same location with no call {http[2] / 1e3:.1f} k (isthmus reaches {100 * http[0] / http[2]:.0f} %){floor}.",
            ]
        rows.append("")
    rows += [
        "The transport alone (`isthmus-shm`, no RPC layer) beside a length-prefixed echo over a Unix socket (`raw-uds`), one `memcpy`, and the physical floor of the echo's two copies between two processes (`floor-copy`: the same copies through a shared memfd, handed over by spinning, no transport; ADR 0014):",
        "",
        "| message | isthmus-shm p50 (p99) | Unix socket p50 (p99) | speed-up | one memcpy | isthmus ÷ memcpy | floor-copy | isthmus ÷ floor |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size, name in SIZES.items():
        i50, i99 = (
            med("isthmus-shm-transport", size, 1, "p50_us"),
            med("isthmus-shm-transport", size, 1, "p99_us"),
        )
        u50, u99 = med("raw-uds", size, 1, "p50_us"), med("raw-uds", size, 1, "p99_us")
        m = med("memcpy", size, 1, "p50_us")
        if None in (i50, i99, u50, u99, m):
            continue
        f = med("floor-copy", size, 1, "p50_us")
        floor = f"{fmt(f)} | {i50 / f:.2f}×" if f else "– | –"
        rows.append(
            f"| {name} | {fmt(i50)} ({fmt(i99)}) | {fmt(u50)} ({fmt(u99)}) | {u50 / i50:.1f}× | {fmt(m)} | {i50 / m:.2f}× | {floor} |"
        )
    ir, ur = med("isthmus-shm-transport", 64, 32, "rps"), med("raw-uds", 64, 32, "rps")
    if ir and ur:
        rows += [
            "",
            f"64 B with 32 in flight: isthmus-shm {ir / 1e6:.2f} M msg/s, Unix socket {ur / 1e3:.0f} k msg/s ({ir / ur:.1f}×).",
        ]
    regimes = [
        ("isthmus-shm-transport", 64, "bounded spin"),
        ("isthmus-shm-transport-nospin", 64, "no spin (eventfd sleep every time)"),
        ("isthmus-shm-transport-samecore", 64, "client and server forced onto one core"),
        ("floor-spin", 0, "floor: two processes spinning"),
        ("floor-eventfd", 0, "floor: eventfd ping-pong"),
    ]
    parts = [
        f"{what} {fmt(v)}"
        for system, size, what in regimes
        if (v := med(system, size, 1, "p50_us")) is not None
    ]
    rows.append("Wake-up regimes at 64 B (p50): " + "; ".join(parts) + ".")
    soaks = [r for r in data["records"] if r["system"].startswith("soak-")]
    if soaks:
        rows.append(
            "Soak (`isthmus-bench soak`, 125 in flight, every reply checked): "
            + "; ".join(
                f"{r['system']} {r['calls']:,} calls, lost {r['lost']}, mismatched {r['mismatched']}, p99.9 {fmt(r['p999_us'])}"
                for r in soaks
            )
            + "."
        )

    def fan(system: str, subs: int, field: str) -> float | None:
        vals = [
            r[field]
            for r in recs
            if r["system"] == system
            and r["size"] == 1 << 20
            and r.get("subscribers") == subs
            and r.get(field)
        ]
        return statistics.median(vals) if vals else None

    last, tonic = fan("fanout-isthmus-shm", 32, "p50_us"), fan("fanout-tonic-uds", 32, "p50_us")
    cpu = [
        fan(s, n, "cpu_us_per_publish") for s in ("fanout-isthmus-shm", "fanout-tonic-uds") for n in (1, 32)
    ]
    if last and tonic and None not in cpu:
        rows.append(
            f"Fan-out (`isthmus-bench fanout`, `isthmus::Topic`): 1 MiB to 32 subscribers reaches the last in {fmt(last)} "
            f"(tonic over UDS {fmt(tonic)}, {tonic / last:.0f}×); the publisher's CPU per publish is "
            f"{cpu[1] / cpu[0]:.1f}× its cost for one subscriber (tonic {cpu[3] / cpu[2]:.1f}×)."
        )
    h = data["header"]
    rows.append(
        f"Run of {h['date']}, commit {h['versions']['commit']}, {h['machine']['cores']} vCPUs ({h['machine']['cpu']}), kernel {h['machine']['kernel']}."
    )
    readme = ROOT / "README.md"
    text = readme.read_text()
    start, end = "<!-- bench-table:start -->", "<!-- bench-table:end -->"
    if start not in text or end not in text:
        print("README.md has no bench-table markers", file=sys.stderr)
        return 1
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(head + start + "\n" + "\n".join(rows) + "\n" + end + tail)
    print("README.md benchmark table regenerated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
