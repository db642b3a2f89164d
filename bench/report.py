"""Turns docs/bench/results.json into docs/bench/RESULTS.md and its PNG charts: latency against
message size (log-log; Rust clients and Python clients apart), the gateway scenario's requests/s
(bars, log scale) and isthmus's speed-up over each competitor. Medians across rounds, with the
min-max range.

Usage: report.py [docs/bench]
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parent.parent
SIZES = [64, 1 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 256 << 20]
RUST = ["isthmus-rust", "tonic-isthmus-shm", "tonic-uds", "tonic-floor", "isthmus-shm-transport", "raw-uds"]
PYTHON = [
    "py-isthmus-sync",
    "py-isthmus-upgraded",
    "py-isthmus-aio",
    "py-grpc-sync-tonic-uds",
    "py-grpc-aio-tonic-uds",
    "py-raw-uds",
]
PY_PY = ["py-py-isthmus", "py-py-grpcio", "py-isthmus-sync"]
PY_AIO = ["py-aio-py-isthmus", "py-aio-py-grpc-aio", "py-isthmus-aio"]
RAW = ["py-isthmus-raw", "py-ray-actor", "py-py-grpcio", "py-memcpy", "py-floor-copy"]
GO = ["go-isthmus-shm", "go-isthmus-raw", "go-grpc-uds", "go-memcpy"]
GATEWAY = ["gateway-isthmus-shm", "gateway-grpc-aio-uds", "gateway-httpx-axum-uds"]
FANOUT = ["fanout-isthmus-shm", "fanout-tonic-uds", "fanout-grpcio"]
PAIRS = [
    ("isthmus-rust", "tonic-uds", "Rust: isthmus engine vs tonic over UDS"),
    ("py-isthmus-sync", "py-grpc-sync-tonic-uds", "Python sync: isthmus vs grpcio→tonic (UDS)"),
    ("py-isthmus-aio", "py-grpc-aio-tonic-uds", "Python asyncio: isthmus vs grpc.aio→tonic (UDS)"),
]

Cell = tuple[str, int, int]


def size_name(size: int) -> str:
    if size >= 1 << 20:
        return f"{size >> 20} MiB"
    if size >= 1 << 10:
        return f"{size >> 10} KiB"
    return f"{size} B"


def us(v: float) -> str:
    if v >= 10_000:
        return f"{v / 1000:.1f} ms"
    return f"{v:.0f} µs" if v >= 100 else f"{v:.2f} µs"


class Results:
    def __init__(self, data: dict[str, Any]) -> None:
        self.header = data["header"]
        self.records: list[dict[str, Any]] = data["records"]
        self.cells: dict[Cell, list[dict[str, Any]]] = defaultdict(list)
        for r in data["records"]:
            self.cells[(r["system"], r["size"], r["inflight"])].append(r)

    def get(self, system: str, size: int, inflight: int, field: str) -> tuple[float, float, float] | None:
        """Median, min, max of `field` across rounds."""
        values = [r[field] for r in self.cells.get((system, size, inflight), []) if r.get(field) is not None]
        return (statistics.median(values), min(values), max(values)) if values else None

    def sizes(self, system: str) -> list[int]:
        return sorted({s for (sys_, s, n) in self.cells if sys_ == system and n == 1})


def latency_chart(res: Results, systems: list[str], title: str, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 5))
    for system in systems:
        points = [(s, res.get(system, s, 1, "p50_us")) for s in res.sizes(system)]
        xs = [s for s, v in points if v]
        ys = [v[0] for _, v in points if v]
        if not xs:
            continue
        lows = [v[0] - v[1] for _, v in points if v]
        highs = [v[2] - v[0] for _, v in points if v]
        ax.errorbar(xs, ys, yerr=[lows, highs], marker="o", capsize=3, label=system)
    ax.set(
        xscale="log", yscale="log", xlabel="message size (bytes)", ylabel="round trip p50 (µs)", title=title
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def gateway_chart(res: Results, path: Path) -> None:
    callers = sorted({n for (s, _, n) in res.cells if s in GATEWAY})
    fig, ax = plt.subplots(figsize=(8, 5))
    width = 0.8 / len(GATEWAY)
    for i, system in enumerate(GATEWAY):
        size = next((s for (sys_, s, _) in res.cells if sys_ == system), 0)
        values = [res.get(system, size, n, "rps") for n in callers]
        xs = [c + i * width for c in range(len(callers))]
        ax.bar(xs, [v[0] if v else 0 for v in values], width, label=system)
    ax.set_xticks([c + width for c in range(len(callers))], [f"{n} callers" for n in callers])
    ax.set(yscale="log", ylabel="requests/s (log scale)", title="Gateway ↔ sidecar: requests/s")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def speedup_chart(res: Results, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 5))
    for ours, theirs, label in PAIRS:
        xs, ys = [], []
        for s in res.sizes(ours):
            a, b = res.get(ours, s, 1, "p50_us"), res.get(theirs, s, 1, "p50_us")
            if a and b:
                xs.append(s)
                ys.append(b[0] / a[0])
        if xs:
            ax.plot(xs, ys, marker="o", label=label)
    ax.set(xscale="log", xlabel="message size (bytes)", ylabel="speed-up (competitor p50 ÷ isthmus p50)")
    ax.set_title("isthmus's speed-up, one call in flight")
    ax.axhline(1, color="grey", lw=0.8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def latency_table(res: Results, systems: list[str]) -> list[str]:
    rows = ["| size | " + " | ".join(systems) + " |", "|---:|" + "---:|" * len(systems)]
    for size in SIZES:
        cells = [res.get(s, size, 1, "p50_us") for s in systems]
        if not any(cells):
            continue
        shown = [f"{us(c[0])} ({us(c[1])}–{us(c[2])})" if c else "-" for c in cells]
        rows.append(f"| {size_name(size)} | " + " | ".join(shown) + " |")
    rows.append("")
    for s in systems:
        for size in (64, 1 << 10):
            v = res.get(s, size, 32, "rps")
            if v and (size == 64 or s.startswith("go-")):
                rate = f"{v[0]:,.0f} calls/s ({v[1]:,.0f}–{v[2]:,.0f})"
                rows.append(f"- {s}, {size_name(size)} with 32 in flight: {rate}")
    return rows


def cgo_line(res: Results) -> list[str]:
    v = res.get("go-cgo-call", 0, 1, "p50_us")
    return [f"- one empty cgo call: {v[0] * 1000:.0f} ns"] if v else []


def go_split_line(res: Results) -> list[str]:
    """The Go client against the Rust engine's echo server beside Go to Go: which side a Go
    figure's cost is on."""
    parts = []
    for inflight, field, show in ((1, "p50_us", us), (32, "rps", lambda v: f"{v:,.0f} calls/s")):
        split = res.get("go-client-engine-server", 64, inflight, field)
        whole = res.get("go-isthmus-shm", 64, inflight, field)
        if split and whole:
            where = "p50" if inflight == 1 else "32 in flight"
            parts.append(f"{where} {show(split[0])} (Go to Go: {show(whole[0])})")
    if not parts:
        return []
    against = "the same client against the Rust engine's echo server (`go-client-engine-server`)"
    return [f"- {against}, 64 B: {'; '.join(parts)}"]


def go_floor_line(res: Results) -> list[str]:
    """The raw echo against one copy in Go, the ratio issue 16's 2.5x target is set in, beside
    its floor: two copies between the processes (`floor-copy`) against one copy (`memcpy`).
    The floor is put against the `memcpy` of its own run: the Go rows may come from a rerun
    (`header.reruns`) on a host whose memory ran at another speed."""
    parts = []
    for size in (4 << 20, 16 << 20):
        memcpy = res.get("go-memcpy", size, 1, "p50_us")
        raw = res.get("go-isthmus-raw", size, 1, "p50_us")
        floor = res.get("floor-copy", size, 1, "p50_us")
        copy = res.get("memcpy", size, 1, "p50_us")
        if memcpy and raw and floor and copy:
            parts.append(
                f"{size_name(size)}: `go-isthmus-raw` {raw[0] / memcpy[0]:.2f}× `go-memcpy`, "
                f"its floor (`floor-copy`) {floor[0] / copy[0]:.2f}× `memcpy`"
            )
    return [f"- the raw echo against one Go copy, p50: {'; '.join(parts)}"] if parts else []


def stream_table(res: Results) -> list[str]:
    rows = ["| message | system | messages/s | GB/s |", "|---:|---|---:|---:|"]
    for size in (1 << 10, 1 << 20):
        for system in ("isthmus-rust", "tonic-isthmus-shm", "tonic-uds"):
            v = res.get(f"stream-{system}", size, 1, "rps")
            if v:
                rate = f"{v[0]:,.0f} ({v[1]:,.0f}–{v[2]:,.0f})"
                rows.append(f"| {size_name(size)} | {system} | {rate} | {v[0] * size / 1e9:.2f} |")
    return rows


def raw_table(res: Results) -> list[str]:
    """SlimeRPC's table shape (bench/py_raw_bench.py): avg / p50 / p99 and GB/s per system."""
    rows = ["| size | " + " | ".join(RAW) + " |", "|---:|" + "---:|" * len(RAW)]
    for size in sorted({s for (sys_, s, n) in res.cells if sys_ == "py-isthmus-raw" and n == 1}):
        shown = []
        for system in RAW:
            fields = ("avg_us", "p50_us", "p99_us", "gbps")
            avg, p50, p99, gbps = (res.get(system, size, 1, f) for f in fields)
            if avg and p50 and p99 and gbps:
                shown.append(f"{us(avg[0])} / {us(p50[0])} / {us(p99[0])}, {gbps[0]:.2f} GB/s")
            else:
                shown.append("-")
        rows.append(f"| {size_name(size)} | " + " | ".join(shown) + " |")
    return rows


def fanout_table(res: Results) -> list[str]:
    """Per size and subscribers: each fan-out system's publish-to-last-delivery p50 (p99) and the
    publisher's CPU per publish, medians across rounds, and the competitors' p50 ÷ isthmus's."""
    groups: dict[tuple[str, int, int], list[dict[str, Any]]] = defaultdict(list)
    for r in res.records:
        if r["system"] in FANOUT:
            groups[(r["system"], r["size"], r.get("subscribers", 0))].append(r)

    def med(system: str, size: int, subs: int, field: str) -> float | None:
        values = [r[field] for r in groups.get((system, size, subs), []) if r.get(field) is not None]
        return statistics.median(values) if values else None

    names = [s.removeprefix("fanout-") for s in FANOUT]
    rows = [
        "| size | subscribers | "
        + " | ".join(f"{n} p50 (p99), CPU/publish" for n in names)
        + " | tonic-uds ÷ isthmus | grpcio ÷ isthmus |",
        "|---:|---:|" + "---:|" * (len(FANOUT) + 2),
    ]
    for size, subs in sorted({(k[1], k[2]) for k in groups}):
        shown, p50s = [], []
        for system in FANOUT:
            p50, p99, cpu = (med(system, size, subs, f) for f in ("p50_us", "p99_us", "cpu_us_per_publish"))
            p50s.append(p50)
            shown.append(f"{us(p50)} ({us(p99)}), {us(cpu)}" if p50 and p99 and cpu else "-")
        ratios = [f"{theirs / p50s[0]:.1f}×" if p50s[0] and theirs else "-" for theirs in p50s[1:]]
        rows.append(f"| {size_name(size)} | {subs} | " + " | ".join(shown + ratios) + " |")
    growth = []
    for system in FANOUT:
        one, many = (med(system, 1 << 20, n, "cpu_us_per_publish") for n in (1, 32))
        if one and many:
            growth.append(f"{system} {many / one:.1f}×")
    if growth:
        rows += ["", "CPU per publish of 1 MiB, 32 subscribers ÷ 1 subscriber: " + ", ".join(growth) + "."]
    return rows


def gateway_table(res: Results) -> list[str]:
    rows = [
        "| callers | system | requests/s | p50 | p99 | failures | isthmus ÷ it (requests/s) |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    callers = sorted({n for (s, _, n) in res.cells if s in GATEWAY})
    for n in callers:
        base = None
        for system in GATEWAY:
            size = next((s for (sys_, s, _) in res.cells if sys_ == system), 0)
            rps, p50, p99 = (res.get(system, size, n, f) for f in ("rps", "p50_us", "p99_us"))
            failures = sum(r.get("failures", 0) for r in res.cells.get((system, size, n), []))
            if not (rps and p50 and p99):
                continue
            base = base or rps[0]
            ratio = "" if system == GATEWAY[0] else f"{base / rps[0]:.1f}×"
            rows.append(
                f"| {n} | {system} | {rps[0]:,.0f} ({rps[1]:,.0f}–{rps[2]:,.0f}) | {us(p50[0])} "
                f"| {us(p99[0])} | {failures} | {ratio} |"
            )
    return rows


LUA = ["lua-isthmus-shm", "lua-cosocket-uds", "lua-floor-copy-out"]
LUA_HTTP = [
    "lua-isthmus-shm-http",
    "lua-isthmus-shm-nospin-http",
    "lua-cosocket-uds-http",
    "nginx-lua-nocall-http",
    "nginx-lua-yield-http",
]


def lua_tables(res: Results) -> list[str]:
    """`bench/lua_bench.py`'s rows: the sequential echo's latency and seconds per 100,000 calls,
    the other ways to wait at 512 B, and requests/s under wrk with each process's CPU."""
    sizes = res.sizes(LUA[0])
    if not sizes:
        return ["No Lua rows in this run."]
    rows = [
        "| size | " + " | ".join(f"{s} p50 (p99)" for s in LUA) + " | total s, isthmus / cosocket |",
        "|---:|" + "---:|" * (len(LUA) + 1),
    ]
    for size in sizes:
        cells = []
        for s in LUA:
            p50, p99 = res.get(s, size, 1, "p50_us"), res.get(s, size, 1, "p99_us")
            cells.append(f"{us(p50[0])} ({us(p99[0])})" if p50 and p99 else "-")
        totals = [res.get(s, size, 1, "total_s") for s in LUA[:2]]
        total = " / ".join(f"{t[0]:.2f}" if t else "-" for t in totals)
        rows.append(f"| {size:,} B | " + " | ".join(cells) + f" | {total} |")
    rows.append("")
    for s, what in (
        ("lua-isthmus-shm-nospin", "no spin on the worker, every reply through the bell"),
        ("lua-isthmus-worker-thread", "`ngx.run_worker_thread` and a blocking call"),
    ):
        v = res.get(s, 512, 1, "p50_us")
        if v:
            rows.append(f"- {s} ({what}), 512 B: p50 {us(v[0])} ({us(v[1])}–{us(v[2])})")
    rows += [
        "",
        "wrk at 32 connections, one 512 B call per request (`nginx-lua-nocall-http`: the same "
        "location with no call; `nginx-lua-yield-http`: no call but one `ngx.sleep(0)`); CPU in cores "
        "over the run:",
        "",
        "| system | requests/s | p50 | p99 | CPU nginx | CPU server | CPU wrk |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s in LUA_HTTP:
        rps, p50, p99 = (res.get(s, 512, 32, f) for f in ("rps", "p50_us", "p99_us"))
        if not (rps and p50 and p99):
            continue
        cpu = [
            res.get(s, 512, 32, f) for f in ("cpu_nginx", "cpu_isthmus_server", "cpu_uds_server", "cpu_wrk")
        ]
        nginx, isthmus_server, uds_server, wrk = (c[0] if c else 0.0 for c in cpu)
        rows.append(
            f"| {s} | {rps[0]:,.0f} ({rps[1]:,.0f}–{rps[2]:,.0f}) | {us(p50[0])} | {us(p99[0])} "
            f"| {nginx:.2f} | {max(isthmus_server, uds_server):.2f} | {wrk:.2f} |"
        )
    return rows


def targets_table(res: Results) -> list[str]:
    """The open issues' speed targets as this run measured them, each beside the best that
    run's floors allow: a target beyond its floor cannot be met on that host by any transport
    (the two copies alone, the transport alone, tonic's own layers, the event loop's own
    future per call, nginx's own yield)."""

    def med(system: str, size: int, inflight: int = 1, field: str = "p50_us") -> float | None:
        v = res.get(system, size, inflight, field)
        return v[0] if v else None

    def over(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    rows = [
        "| issue | target | this run | best the floors allow | verdict |",
        "|---|---|---:|---:|---|",
    ]

    def row(
        issue: int,
        what: str,
        value: float | None,
        want: str,
        limit: float,
        bound: float | None = None,
        unit: str = "×",
    ) -> None:
        if value is None:
            return
        ok = value <= limit if want == "≤" else value >= limit

        def fmt(v: float) -> str:
            if unit == "%":
                return f"{v:.0%}"
            # Two decimals, or three where two would hide which side of the target it is.
            return f"{v:.3f}×" if f"{v:.2f}" == f"{limit:.2f}" and v != limit else f"{v:.2f}×"

        allowed = "" if bound is None else fmt(bound)
        beyond = bound is not None and (bound > limit if want == "≤" else bound < limit)
        verdict = "met" if ok else ("missed; beyond this host's floor" if beyond else "missed")
        target = f"{limit:.0%}" if unit == "%" else f"{limit:g}×"
        rows.append(f"| {issue} | {what} {want} {target} | {fmt(value)} | {allowed} | {verdict} |")

    transport, rust = med("isthmus-shm-transport", 64), med("isthmus-rust", 64)
    for size in (64 << 10, 1 << 20, 16 << 20):
        row(
            19,
            f"`isthmus-shm-transport` {size_name(size)} ÷ `memcpy`",
            over(med("isthmus-shm-transport", size), med("memcpy", size)),
            "≤",
            2.5,
            over(med("floor-copy", size), med("memcpy", size)),
        )
    row(19, "`isthmus-rust` 64 B ÷ the transport", over(rust, transport), "≤", 2.5)
    row(
        19,
        "`tonic-uds` ÷ `isthmus-rust` 64 B",
        over(med("tonic-uds", 64), rust),
        "≥",
        40,
        over(med("tonic-uds", 64), transport),
    )
    row(19, "`py-isthmus-sync` 64 B ÷ the transport", over(med("py-isthmus-sync", 64), transport), "≤", 4)
    row(
        19,
        "`py-grpc-sync-tonic-uds` ÷ `py-isthmus-sync` 64 B",
        over(med("py-grpc-sync-tonic-uds", 64), med("py-isthmus-sync", 64)),
        "≥",
        40,
        over(med("py-grpc-sync-tonic-uds", 64), transport),
    )
    tonic_floor = med("tonic-floor", 64)
    row(
        19,
        "`tonic-uds` ÷ `tonic-isthmus-shm` 64 B",
        over(med("tonic-uds", 64), med("tonic-isthmus-shm", 64)),
        "≥",
        20,
        over(med("tonic-uds", 64), tonic_floor + transport) if tonic_floor and transport else None,
    )
    row(
        18,
        "`py-isthmus-aio` ÷ `py-isthmus-sync` 64 B",
        over(med("py-isthmus-aio", 64), med("py-isthmus-sync", 64)),
        "≤",
        4,
    )
    row(
        18,
        "`py-grpc-aio-tonic-uds` ÷ `py-isthmus-aio` 64 B",
        over(med("py-grpc-aio-tonic-uds", 64), med("py-isthmus-aio", 64)),
        "≥",
        12,
    )
    aio32 = med("py-grpc-aio-tonic-uds", 64, 32, "rps")
    row(
        18,
        "`py-isthmus-aio` ÷ grpc.aio, calls/s at 64 B × 32",
        over(med("py-isthmus-aio", 64, 32, "rps"), aio32),
        "≥",
        10,
        over(med("py-aio-floor", 64, 32, "rps"), aio32),
    )
    gw125 = med("gateway-isthmus-shm", 1019, 125, "rps")
    gw_floor = med("gateway-floor", 1019, 125, "rps")
    for than, system, callers, limit, best in (
        # The least a transport completing calls on the loop adds: one turn per reply.
        (
            "`gateway-floor`",
            "gateway-floor",
            125,
            0.85,
            over(med("gateway-floor-async", 1019, 125, "rps"), gw_floor),
        ),
        ("at 32", "gateway-isthmus-shm", 32, 1.0, None),
    ):
        row(
            18,
            f"gateway at 125 callers ÷ {than}",
            over(gw125, med(system, 1019, callers, "rps")),
            "≥",
            limit,
            best,
            unit="%",
        )
    for size in (512, 102400):
        cosocket = med("lua-cosocket-uds", size)
        row(
            17,
            f"`lua-cosocket-uds` ÷ `lua-isthmus-shm` {size_name(size)}",
            over(cosocket, med("lua-isthmus-shm", size)),
            "≥",
            5,
            over(cosocket, med("lua-floor-copy-out", size)),
        )
    cos_http, yielding = (
        med("lua-cosocket-uds-http", 512, 32, "rps"),
        med("nginx-lua-yield-http", 512, 32, "rps"),
    )
    lua_http, nocall = (
        med("lua-isthmus-shm-http", 512, 32, "rps"),
        med("nginx-lua-nocall-http", 512, 32, "rps"),
    )
    row(
        17,
        "`lua-isthmus-shm-http` ÷ `lua-cosocket-uds-http`, requests/s",
        over(lua_http, cos_http),
        "≥",
        2,
        over(yielding, cos_http),
    )
    row(
        17,
        "`lua-isthmus-shm-http` ÷ `nginx-lua-nocall-http`",
        over(lua_http, nocall),
        "≥",
        0.75,
        over(yielding, nocall),
        unit="%",
    )
    grpc_go = med("go-grpc-uds", 64)
    row(16, "`go-grpc-uds` ÷ `go-isthmus-shm` 64 B", over(grpc_go, med("go-isthmus-shm", 64)), "≥", 20)
    row(
        16,
        "`go-isthmus-shm` ÷ `go-grpc-uds`, calls/s at 64 B × 32",
        over(med("go-isthmus-shm", 64, 32, "rps"), med("go-grpc-uds", 64, 32, "rps")),
        "≥",
        5,
    )
    row(
        16,
        "`go-grpc-uds` ÷ `go-isthmus-shm` 4 MiB",
        over(med("go-grpc-uds", 4 << 20), med("go-isthmus-shm", 4 << 20)),
        "≥",
        3,
    )
    for size in (4 << 20, 16 << 20):
        # No floor: Go's copies are not floor-copy's (go-isthmus-raw has run below its ratio).
        row(
            16,
            f"`go-isthmus-raw` {size_name(size)} ÷ `go-memcpy`",
            over(med("go-isthmus-raw", size), med("go-memcpy", size)),
            "≤",
            2.5,
        )
    for soak in ("soak-isthmus-rust", "soak-py-isthmus-aio"):
        lost = [r.get("lost", 0) + r.get("mismatched", 0) for r in res.records if r["system"] == soak]
        if lost:
            verdict = "met" if max(lost) == 0 else "missed"
            rows.append(f"| 19 | `{soak}`: calls lost or mismatched = 0 | {max(lost)} |  | {verdict} |")
    return rows


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs/bench"
    res = Results(json.loads((out / "results.json").read_text()))
    latency_chart(res, RUST, "Rust clients: echo round trip between two processes", out / "latency-rust.png")
    latency_chart(res, PYTHON, "Python clients → Rust servers: echo round trip", out / "latency-python.png")
    gateway_chart(res, out / "gateway-rps.png")
    speedup_chart(res, out / "speedup.png")
    h = res.header
    machine = h["machine"]
    text = [
        "# Benchmark results",
        "",
        f"Generated by `make bench` ({'QUICK, ' if h.get('quick') else ''}{h.get('rounds')} rounds) from "
        f"`results.json`: run of {h['date']}, commit {h['versions']['commit']}, {machine['cores']} vCPUs "
        f"({machine['cpu']}), {machine['memory_gib']} GiB, kernel {machine['kernel']}, "
        f"{h['versions']['rustc']}. "
        "Cells are medians across rounds with the min–max range; how each system runs, and what each "
        "competitor was given, is in [README.md](README.md).",
        "",
        "## Rust clients",
        "",
        "![latency, Rust clients](latency-rust.png)",
        "",
        *latency_table(res, RUST),
        "",
        "### Server-stream throughput",
        "",
        "One stream of about 256 MiB from the server, the client taking each message (it does not read "
        "the payload: over shm:// a large message is a view into the server's memory).",
        "",
        *stream_table(res),
        "",
        "## Python clients",
        "",
        "![latency, Python clients](latency-python.png)",
        "",
        *latency_table(res, PYTHON),
        "",
        "## Python clients → Python servers",
        "",
        "`bench/py_server.py`: `py-py-isthmus` (isthmus's client and server over shm://) beside "
        "`py-py-grpcio` (grpcio's over a Unix socket), each handler returning its request on a pool of "
        "16 threads; `py-isthmus-sync` is the same client against the Rust server.",
        "",
        *latency_table(res, PY_PY),
        "",
        "asyncio at both ends: `py-aio-py-isthmus` (`isthmus.aio`'s client and server over shm://) "
        "beside `py-aio-py-grpc-aio` (grpc.aio's over a Unix socket), an `async def` handler "
        "returning its request; `py-isthmus-aio` is the same client against the Rust server.",
        "",
        *latency_table(res, PY_AIO),
        "",
        "### The raw tier, in SlimeRPC's table shape",
        "",
        "`bench/py_raw_bench.py`: a numpy `uint8` echo, one call in flight; avg / p50 / p99 and GB/s "
        "(2 × size / avg; one copy for `py-memcpy`). `py-isthmus-raw`: `Channel.raw_unary` to an "
        "in-place raw handler; `py-ray-actor`: Ray's actor echo, warmed with 300 calls per size; "
        "`py-floor-copy`: the floor under an echo that copies twice (`floor-copy`, in the same rounds). "
        "numpy's copy runs on huge pages; shared memory has them only where the host allows "
        "(ADR 0023; this run's host: `shmem_huge_pages` in results.json's header).",
        "",
        *raw_table(res),
        "",
        "## Go clients",
        "",
        "`go/cmd/go-bench`: a `protoc-gen-go-grpc` client and a Go server over isthmus (`go-isthmus-shm`, "
        "server with `InlineUnary`), the raw tier (`go-isthmus-raw`: request written into an allocated "
        "block, read by the server in place; reply likewise), grpc-go over a Unix socket with 64 MiB "
        "windows and 1 MiB buffers (`go-grpc-uds`), and one copy of the payload in Go (`go-memcpy`).",
        "",
        *latency_table(res, GO),
        *cgo_line(res),
        *go_split_line(res),
        *go_floor_line(res),
        "",
        "## Lua in nginx",
        "",
        "`bench/lua_bench.py`: one nginx worker; 100,000 sequential echo calls in one "
        "`content_by_lua` through `resty.isthmus` over shm:// to the engine's echo server "
        "(`lua-isthmus-shm`), beside a cosocket to a Unix socket with a 4-byte length and a Rust "
        "echo server (`lua-cosocket-uds`), and the floor under an echo whose reply Lua copies out "
        "(`lua-floor-copy-out`: three copies, spinning, no transport).",
        "",
        *lua_tables(res),
        "",
        "## Fan-out (publish/subscribe)",
        "",
        "`isthmus-bench fanout`: one publisher's server stream `/bench.Fanout/Watch` to 1, 8 and 32 "
        "subscribers, each on its own connection, held by up to 4 subscriber processes; a publish every "
        "2 ms at most. p50 (p99) of the time from a publish to its delivery to the last subscriber, and "
        "the publisher process's CPU time per publish.",
        "",
        *fanout_table(res),
        "",
        "## The gateway ↔ sidecar scenario",
        "",
        "`examples/gateway-sidecar`: a Python asyncio gateway, a Rust sidecar; 90% `Invoke` with ~1 KiB "
        "JSON bodies, 8% `InvokeStream`, 2% `CloseSession`; every response checked.",
        "",
        "![gateway requests/s](gateway-rps.png)",
        "",
        *gateway_table(res),
        "",
        "## Speed-up",
        "",
        "![speed-up](speedup.png)",
        "",
        "## The open issues' targets in this run",
        "",
        "Ratios of the medians above. The floors column is the best any transport could reach on "
        "this host: for a copy target, `floor-copy` (the echo's two copies, spinning, no transport) "
        "÷ `memcpy`; against a competitor, the competitor ÷ the least our side cannot avoid (the "
        "bare transport; tonic's own layers, `tonic-floor`, plus the transport; the event loop's one "
        "future per call, `py-aio-floor`, and per gateway reply, `gateway-floor-async`; nginx's own "
        "yield, `nginx-lua-yield-http`; the Lua echo's three copies, `lua-floor-copy-out`).",
        "",
        *targets_table(res),
        "",
    ]
    (out / "RESULTS.md").write_text("\n".join(text))
    print(f"wrote {out / 'RESULTS.md'} and its charts", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
