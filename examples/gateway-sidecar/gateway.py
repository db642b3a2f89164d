"""The example's Python gateway: N concurrent callers for T seconds hand requests to the Rust
sidecar, over each transport in turn, and a table compares them.

- ``isthmus``: the generated stubs on ``isthmus.aio`` over ``shm://``;
- ``grpc-uds``: the same stubs on ``grpc.aio`` to a plain tonic server over a Unix socket;
- ``http-uds``: ``httpx`` to ``axum`` over a Unix socket, JSON bodies.

The mix is a gateway's: mostly ``Invoke`` with ~1 KiB JSON bodies, some ``InvokeStream``, a few
``CloseSession``. Every response is checked (status, echoed body, chunk count); a wrong one is a
failure.

While the isthmus load runs, ``--workers`` gateway worker processes (4) each subscribe to the
sidecar's ``WatchCatalog``; the sidecar changes its catalog every 250 ms, and the gateway prints
how long each change took to reach all of them. Usage::

    python gateway.py [--callers 32] [--seconds 5] [--transports isthmus,grpc-uds,http-uds]
                      [--workers 4] [--sidecar PATH] [--json FILE]

Exits non-zero if any call failed.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import httpx
from grpc_tools import protoc

import isthmus.aio

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
TRANSPORTS = ["isthmus", "grpc-uds", "http-uds"]
SCOPES = ["tools:invoke", "tools:read"]
NAMES = {
    "isthmus": "isthmus (shm://)",
    "grpc-uds": "grpc.aio → tonic (UDS)",
    "http-uds": "httpx → axum (UDS)",
}


def stubs(out: str) -> tuple[Any, Any]:
    proto = HERE / "proto"
    args = [
        "protoc",
        f"-I{proto}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        str(proto / "sidecar.proto"),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("generating the stubs failed")
    return load_stubs(out)


def load_stubs(out: str) -> tuple[Any, Any]:
    """The stubs `stubs` made in `out`, imported."""
    sys.path.insert(0, out)
    return importlib.import_module("sidecar_pb2"), importlib.import_module("sidecar_pb2_grpc")


@dataclass
class Work:
    """One caller's next request: which kind, and the JSON body it carries."""

    kind: str
    body: dict[str, Any]
    session: str


def next_work(rng: random.Random, caller: int, n: int) -> Work:
    roll = rng.random()
    kind = "invoke" if roll < 0.90 else "stream" if roll < 0.98 else "close"
    body = {
        "tool": "search",
        "nonce": f"{caller}-{n}",
        "args": {
            "query": "shared memory ipc",
            "limit": 10,
            "filters": {"lang": "en", "safe": True},
        },
        "pad": "x" * 880,  # ~1 KiB of JSON in all
    }
    return Work(kind, body, f"session-{caller}-{n // 50}")


def auth() -> dict[str, Any]:
    return {
        "subject": "user-42",
        "scopes": SCOPES,
        "tenant": "acme",
        "expires_at_unix_ms": int(time.time() * 1000) + 3_600_000,
    }


class MismatchError(Exception):
    """A response that is not what the sidecar should have said."""


def check_invoke(status: int, body: Any, work: Work) -> None:
    if (
        status != 200
        or body.get("echo", {}).get("nonce") != work.body["nonce"]
        or body.get("tenant") != "acme"
    ):
        raise MismatchError(f"unexpected Invoke reply: status {status}, body {str(body)[:120]}")


def check_stream(chunks: list[tuple[Any, bool, int]]) -> None:
    if len(chunks) != 4 or not chunks[-1][1] or chunks[-1][2] != 200 or chunks[0][0].get("of") != 4:
        raise MismatchError(f"unexpected InvokeStream reply: {str(chunks)[:120]}")


def grpc_caller(pb: Any, stub: Any) -> Callable[[Work], Awaitable[None]]:
    """One request over a gRPC stub (isthmus.aio's or grpc.aio's: the same generated code)."""

    def request(work: Work, query: str = "") -> Any:
        return pb.InvokeRequest(
            method="POST",
            path="/tools/search",
            query=query,
            headers={
                "content-type": "application/json",
                "x-request-id": work.body["nonce"],
            },
            body=json.dumps(work.body).encode(),
            auth=pb.AuthContext(**auth()),
            session_id=work.session,
        )

    async def call(work: Work) -> None:
        if work.kind == "invoke":
            reply = await stub.Invoke(request(work), timeout=30)
            check_invoke(reply.status, json.loads(reply.body), work)
        elif work.kind == "stream":
            chunks = [
                (json.loads(c.data), c.last, c.status)
                async for c in stub.InvokeStream(request(work, "chunks=4"), timeout=30)
            ]
            check_stream(chunks)
        elif not (
            await stub.CloseSession(pb.CloseSessionRequest(session_id=work.session), timeout=30)
        ).closed:
            raise MismatchError("CloseSession did not close")

    return call


def http_caller(client: Any) -> Callable[[Work], Awaitable[None]]:
    def request(work: Work, query: str = "") -> dict[str, Any]:
        headers = {
            "content-type": "application/json",
            "x-request-id": work.body["nonce"],
        }
        return {
            "method": "POST",
            "path": "/tools/search",
            "query": query,
            "headers": headers,
            "body": work.body,
            "auth": auth(),
            "session_id": work.session,
        }

    async def call(work: Work) -> None:
        if work.kind == "invoke":
            reply = (await client.post("/invoke", json=request(work))).raise_for_status().json()
            check_invoke(reply["status"], reply["body"], work)
        elif work.kind == "stream":
            r = (await client.post("/invoke_stream", json=request(work, "chunks=4"))).raise_for_status()
            check_stream([(c["data"], c["last"], c["status"]) for c in map(json.loads, r.text.splitlines())])
        elif (
            not (await client.post("/close_session", json={"session_id": work.session}))
            .raise_for_status()
            .json()["closed"]
        ):
            raise MismatchError("close_session did not close")

    return call


@dataclass
class Result:
    transport: str
    callers: int
    seconds: float
    latencies: list[float] = field(default_factory=list)
    failures: int = 0
    first_error: str = ""

    def row(self) -> dict[str, Any]:
        lat = sorted(self.latencies) or [float("nan")]
        body = len(json.dumps(next_work(random.Random(0), 0, 0).body))
        pick = lambda q: lat[min(len(lat) - 1, int(len(lat) * q))] * 1e6  # noqa: E731
        return {
            "transport": self.transport,
            "callers": self.callers,
            "requests": len(self.latencies),
            "rps": len(self.latencies) / self.seconds,
            "avg_us": statistics.fmean(lat) * 1e6,
            "p50_us": pick(0.50),
            "p99_us": pick(0.99),
            "failures": self.failures,
            "body_bytes": body,
        }


def progress(line: str) -> None:
    if sys.stderr.isatty():
        sys.stderr.write(f"\r\x1b[K{line}")
        sys.stderr.flush()


async def drive(
    transport: str,
    call: Callable[[Work], Awaitable[None]],
    callers: int,
    seconds: float,
) -> Result:
    result = Result(transport, callers, seconds)
    # A short warm-up (connections, caches), not counted.
    await asyncio.gather(*(call(next_work(random.Random(-c), c, 0)) for c in range(min(callers, 8))))
    start = time.perf_counter()
    stop = start + seconds

    async def caller(c: int) -> None:
        rng, n = random.Random(c), 0
        while (now := time.perf_counter()) < stop:
            n += 1
            try:
                await call(next_work(rng, c, n))
                result.latencies.append(time.perf_counter() - now)
            except Exception as e:  # a failed call is counted and shown, not fatal
                result.failures += 1
                result.first_error = result.first_error or f"{type(e).__name__}: {e}"

    async def ticker() -> None:
        while (now := time.perf_counter()) < stop:
            progress(
                f"{NAMES[transport]}: {now - start:4.1f} / {seconds:.0f} s, {len(result.latencies)} requests"
            )
            await asyncio.sleep(0.25)

    await asyncio.gather(ticker(), *(caller(c) for c in range(callers)))
    result.seconds = time.perf_counter() - start
    progress("")
    return result


async def run(
    transport: str,
    endpoints: dict[str, str],
    pb: Any,
    pb_grpc: Any,
    callers: int,
    seconds: float,
) -> Result:
    if transport == "isthmus":
        async with isthmus.aio.insecure_channel(endpoints["shm"]) as channel:
            return await drive(
                transport,
                grpc_caller(pb, pb_grpc.SidecarStub(channel)),
                callers,
                seconds,
            )
    if transport == "grpc-uds":
        # grpcio's best settings for a Unix socket: a plain authority, no message-size limits.
        options = [
            ("grpc.default_authority", "localhost"),
            ("grpc.max_receive_message_length", -1),
        ]
        async with grpc.aio.insecure_channel(f"unix:{endpoints['grpc']}", options=options) as channel:
            return await drive(
                transport,
                grpc_caller(pb, pb_grpc.SidecarStub(channel)),
                callers,
                seconds,
            )
    limits = httpx.Limits(max_connections=callers, max_keepalive_connections=callers)
    http = httpx.AsyncHTTPTransport(uds=endpoints["http"], limits=limits)
    async with httpx.AsyncClient(transport=http, base_url="http://sidecar", timeout=30) as client:
        return await drive(transport, http_caller(client), callers, seconds)


def watch(address: str, stubs_dir: str) -> None:
    """A gateway worker's catalog subscription (``--watch``): prints ``READY`` once it has the
    current catalog, then ``UPDATE version published_ns µs`` for each change: when the sidecar
    published it (CLOCK_MONOTONIC), and the µs from then to here. It imports the gateway's stubs
    from `stubs_dir` and makes no file of its own: it ends by a signal, which cleans up nothing."""
    pb, pb_grpc = load_stubs(stubs_dir)
    with isthmus.insecure_channel(address) as channel:
        updates = pb_grpc.SidecarStub(channel).WatchCatalog(pb.WatchCatalogRequest())
        for n, update in enumerate(updates):
            now = time.monotonic_ns()
            if n == 0:  # the current catalog, published before we came
                print("READY", flush=True)
                continue
            published = update.published_monotonic_ns
            print(f"UPDATE {update.version} {published} {(now - published) / 1e3:.1f}", flush=True)


class Watchers:
    """``n`` worker processes subscribed to the catalog while a load runs, on the stubs in
    `stubs_dir`."""

    def __init__(self, n: int, address: str, stubs_dir: str) -> None:
        argv = [sys.executable, __file__, "--watch", address, "--stubs", stubs_dir]
        self.procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) for _ in range(n)]
        for p in self.procs:
            if p.stdout is None or p.stdout.readline().strip() != "READY":
                self.stop()
                raise SystemExit("a catalog watcher did not start")

    def stop(self) -> dict[int, list[float]]:
        """Stops them; per catalog version published until now, how long it took to reach each
        worker (µs). A change published while they stop is not counted."""
        until = time.monotonic_ns()
        seen: dict[int, list[float]] = {}
        for p in self.procs:
            p.terminate()
            out, _ = p.communicate(timeout=10)
            for line in out.splitlines():
                if line.startswith("UPDATE "):
                    _, version, published, us = line.split()
                    if int(published) < until:
                        seen.setdefault(int(version), []).append(float(us))
        return seen


def propagation(seen: dict[int, list[float]], workers: int) -> dict[str, Any]:
    """Time for each change to reach every worker: the slowest worker's, per change."""
    complete = sorted(max(us) for us in seen.values() if len(us) == workers)
    if not complete:
        return {"changes": 0, "workers": workers}
    return {
        "changes": len(complete),
        "workers": workers,
        "p50_us": complete[len(complete) // 2],
        "max_us": complete[-1],
        "missed": sum(1 for us in seen.values() if len(us) != workers),
    }


def table(rows: list[dict[str, Any]]) -> str:
    base = next((r for r in rows if r["transport"] == "isthmus"), None)
    fmt = lambda us: f"{us / 1000:.2f} ms" if us >= 1000 else f"{us:.0f} µs"  # noqa: E731
    lines = [
        f"{'transport':<24} {'requests/s':>11} {'avg':>9} {'p50':>9} {'p99':>9} {'failures':>8}"
        f"  {'isthmus is':>11}",
        "-" * 90,
    ]
    for r in rows:
        ratio = "" if base is None or r is base else f"{base['rps'] / r['rps']:.1f}× faster"
        lines.append(
            f"{NAMES[r['transport']]:<24} {r['rps']:>11,.0f} {fmt(r['avg_us']):>9} {fmt(r['p50_us']):>9} "
            f"{fmt(r['p99_us']):>9} {r['failures']:>8}  {ratio:>11}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--callers", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--transports", default=",".join(TRANSPORTS))
    parser.add_argument("--workers", type=int, default=4, help="catalog subscribers during the isthmus run")
    parser.add_argument("--sidecar", default=str(ROOT / "target/release/gateway-sidecar"))
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--watch", help=argparse.SUPPRESS)  # a worker's subscription (internal)
    parser.add_argument("--stubs", help=argparse.SUPPRESS)  # where its stubs are (internal)
    args = parser.parse_args()
    if args.watch:
        watch(args.watch, args.stubs)
        return 0
    transports = args.transports.split(",")
    with tempfile.TemporaryDirectory(prefix="isthmus-gateway-") as tmp:
        pb, pb_grpc = stubs(tmp)
        endpoints = {
            "shm": f"shm://gateway-demo-{os.getpid()}",
            "grpc": f"{tmp}/grpc.sock",
            "http": f"{tmp}/http.sock",
        }
        argv = [
            args.sidecar,
            "--shm",
            endpoints["shm"],
            "--grpc-uds",
            endpoints["grpc"],
            "--http-uds",
            endpoints["http"],
        ]
        sidecar = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        try:
            if sidecar.stdout is None or sidecar.stdout.readline().strip() != "READY":
                raise SystemExit("the sidecar did not start")
            mix = "90% Invoke (~1 KiB JSON), 8% InvokeStream, 2% CloseSession"
            print(f"{args.callers} concurrent callers, {args.seconds:g} s per transport; {mix}\n")
            rows = []
            catalog: dict[str, Any] | None = None
            for t in transports:
                watchers = (
                    Watchers(args.workers, endpoints["shm"], tmp) if t == "isthmus" and args.workers else None
                )
                rows.append(asyncio.run(run(t, endpoints, pb, pb_grpc, args.callers, args.seconds)))
                if watchers is not None:
                    catalog = propagation(watchers.stop(), args.workers)
        finally:
            sidecar.terminate()
            sidecar.wait(timeout=10)
    print(table([r.row() for r in rows]))
    if catalog is not None and catalog["changes"]:
        print(
            f"\ncatalog changes during the isthmus run: {catalog['changes']}, each reached all "
            f"{catalog['workers']} gateway workers in {catalog['p50_us']:.0f} µs (p50), "
            f"{catalog['max_us']:.0f} µs at most; {catalog['missed']} missed by a worker"
        )
    for r in rows:
        if r.failures:
            print(f"\n{NAMES[r.transport]}: {r.failures} failed calls; the first: {r.first_error}")
    if args.json:
        Path(args.json).write_text(json.dumps([r.row() for r in rows], indent=1) + "\n")
    return 1 if any(r.failures for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
