"""The gateway scenario's floor: what the gateway's own Python work costs per request, with the
transport taken away.

The gateway (`examples/gateway-sidecar/gateway.py`) runs unchanged with its stub replaced by one
that answers in this process: it serialises each request as a stub must, and parses a reply of
the real sidecar's shape and size from bytes. What is left per request is the gateway's own
work (JSON, protobuf, the check, the coroutine) that every transport pays alike. The replies
cost this process something the real sidecar pays in Rust; that share is timed on its own and
taken off.

So the gateway's requests/s on one core cannot exceed ``1 / floor``, whatever the transport,
and ``grpc.aio``'s measured requests/s over that is the most any transport could gain on it.

The same stub with ``suspend`` (system ``gateway-floor-async``) adds what any transport that
completes calls on the event loop costs the loop at least: each call, and each message of a
stream, waits for one future that the loop resolves on its next turn, as ``py-aio-floor`` does
for the echo. The caller's task is suspended and resumed once per message, as it is when a
reply comes from another process; nothing else is added::

    python bench/gateway_floor.py [--callers 125] [--seconds 5] [--results docs/bench/results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples" / "gateway-sidecar"))

import gateway  # noqa: E402


async def next_turn() -> None:
    """Suspends the calling task until the loop's next turn: one future, resolved by the loop."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    loop.call_soon(future.set_result, None)
    await future


class InProcessSidecar:
    """A stub whose replies are made here: the sidecar's shapes, no transport; with `suspend`,
    each reply and each streamed message is awaited for one turn of the loop."""

    def __init__(self, pb: Any, suspend: bool = False) -> None:
        self.pb = pb
        self.suspend = suspend
        self.reply_seconds = 0.0
        self.chunks = [
            pb.InvokeChunk(
                data=json.dumps({"seq": i, "of": 4, "path": "/tools/search", "tenant": "acme"}).encode(),
                last=i == 3,
                status=200 if i == 3 else 0,
            ).SerializeToString()
            for i in range(4)
        ]
        self.closed = pb.CloseSessionResponse(closed=True).SerializeToString()

    def _invoke_reply(self, request: Any) -> bytes:
        start = time.perf_counter()
        body = b'{"status":"ok","tenant":"acme","subject":"user-42","echo":' + request.body + b"}"
        headers = {"content-type": "application/json", "x-tenant": "acme"}
        wire = self.pb.InvokeResponse(status=200, headers=headers, body=body).SerializeToString()
        self.reply_seconds += time.perf_counter() - start
        return wire

    async def Invoke(self, request: Any, timeout: float | None = None) -> Any:
        request = self.pb.InvokeRequest.FromString(request.SerializeToString())
        if self.suspend:
            await next_turn()
        return self.pb.InvokeResponse.FromString(self._invoke_reply(request))

    async def _chunks(self, request: Any) -> Any:
        request.SerializeToString()
        for c in self.chunks:
            if self.suspend:
                await next_turn()
            yield self.pb.InvokeChunk.FromString(c)

    def InvokeStream(self, request: Any, timeout: float | None = None) -> Any:
        return self._chunks(request)

    async def CloseSession(self, request: Any, timeout: float | None = None) -> Any:
        request.SerializeToString()
        if self.suspend:
            await next_turn()
        return self.pb.CloseSessionResponse.FromString(self.closed)


def grpc_aio_rps(results: Path, callers: int) -> float | None:
    """The latest run's median grpc.aio requests/s at `callers`, from results.json."""
    if not results.exists():
        return None
    rows = [
        r["rps"]
        for r in json.loads(results.read_text())["records"]
        if r["system"] == "gateway-grpc-aio-uds" and r["inflight"] == callers
    ]
    return sorted(rows)[len(rows) // 2] if rows else None


def measure(callers: int, seconds: float, suspend: bool = False) -> tuple[float, float, float]:
    """The gateway's own work per request at `callers`, in seconds (with `suspend`, plus one
    turn of the loop per reply), with the whole time per request and the in-process replies'
    share; ValueError if requests failed."""
    with tempfile.TemporaryDirectory() as out:
        pb, _ = gateway.stubs(out)
        stub = InProcessSidecar(pb, suspend)
        result = asyncio.run(gateway.drive("isthmus", gateway.grpc_caller(pb, stub), callers, seconds))
    n = len(result.latencies)
    if result.failures or not n:
        raise ValueError(f"{result.failures} failed: {result.first_error}")
    total = result.seconds / n
    replies = stub.reply_seconds / n
    return total - replies, total, replies


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--callers", type=int, default=125)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--results", type=Path, default=ROOT / "docs" / "bench" / "results.json")
    args = parser.parse_args()
    try:
        floor, total, replies = measure(args.callers, args.seconds)
        suspended, _, _ = measure(args.callers, args.seconds, suspend=True)
    except ValueError as e:
        print(e)
        return 1
    print(f"{args.callers} callers, {args.seconds:.1f} s, no transport")
    print(f"  per request: {total * 1e6:.1f} µs, of which the in-process replies {replies * 1e6:.1f} µs")
    print(f"  the gateway's own work: {floor * 1e6:.1f} µs a request, at most {1 / floor:,.0f} requests/s")
    print(
        f"  with one turn of the loop per reply and per streamed message (gateway-floor-async): "
        f"{suspended * 1e6:.1f} µs a request, at most {1 / suspended:,.0f} requests/s"
    )
    base = grpc_aio_rps(args.results, args.callers)
    if base:
        print(
            f"  grpc.aio → tonic measured {base:,.0f} requests/s at {args.callers} callers "
            f"({args.results.name}): no transport can make this gateway more than "
            f"{1 / floor / base:.1f}× faster than that"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
