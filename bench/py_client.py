"""The Python clients of the benchmark, driven by `isthmus-bench` over stdin/stdout.

Usage: py_client.py SYSTEM TARGET. SYSTEM is one of:

- ``isthmus-sync`` / ``isthmus-aio``: ``isthmus.insecure_channel`` / ``isthmus.aio.insecure_channel``
  to the Rust echo server over ``shm://`` (TARGET); ``isthmus-sync`` given an HTTP/2 TARGET
  (``localhost:PORT``) first waits for the channel to move to the ``shm://`` endpoint the server
  offers (the upgrade);
- ``grpc-sync`` / ``grpc-aio``: ``grpc.insecure_channel`` / ``grpc.aio.insecure_channel`` to a
  tonic server on the Unix socket TARGET, at grpcio's best documented settings for it (no
  message-size limits, ``grpc.default_authority`` for the socket);
- ``raw-uds``: a Python socket to the length-prefixed echo on the Unix socket TARGET;
- ``aio-floor``: no transport and no TARGET: the asyncio loop of ``isthmus-aio`` where each call
  is one future that the loop itself resolves on its next turn, the least any transport that
  completes calls on an event loop needs (the system ``py-aio-floor``).

``py_client.py count TARGET SIZE CALLS`` is ``bench/count_per_call.py``'s client.

``py_client.py soak TARGET CALLS INFLIGHT`` is the soak (``isthmus-bench soak``): one JSON line
of counts and percentiles.

Each line on stdin is ``rt SIZE TIME_MS MIN MAX`` (one call in flight) or
``pipe SIZE INFLIGHT TIME_MS MIN MAX``; the answer is ``P50_US P99_US RPS``, or ``none`` for a
mode the system lacks. Every reply is checked against its request.
"""

from __future__ import annotations

import asyncio
import math
import socket
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future

PATH = "/bench.Echo/Unary"
NO_LIMIT = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


def summary(latencies: list[float], total: float) -> str:
    latencies.sort()

    def pick(q: float) -> float:
        return latencies[max(1, math.ceil(len(latencies) * q)) - 1] * 1e6

    return f"{pick(0.5):.3f} {pick(0.99):.3f} {len(latencies) / total:.1f}"


def warmup_count(size: int, max_iters: int) -> int:
    return 2 if size >= 16 << 20 else min(max(max_iters // 20, 2), 2000)


def timed(op: Callable[[], None], size: int, budget: float, min_iters: int, max_iters: int) -> str:
    for _ in range(warmup_count(size, max_iters)):
        op()
    latencies: list[float] = []
    start = time.perf_counter()
    while len(latencies) < max_iters and (len(latencies) < min_iters or time.perf_counter() - start < budget):
        t = time.perf_counter()
        op()
        latencies.append(time.perf_counter() - t)
    return summary(latencies, time.perf_counter() - start)


def payload_of(size: int) -> bytes:
    return (bytes(range(256)) * (size // 256 + 1))[:size]


# Up to this size a `bytes` reply is compared whole: one `memcmp`, ~10 ns at 64 B.
WHOLE_CHECK_MAX = 64 << 10


def check(reply: bytes | memoryview, payload: bytes) -> None:
    """Every reply is checked against its request, inside the timed interval, so the check is
    kept cheap: a `bytes` reply up to `WHOLE_CHECK_MAX` is compared whole; a larger one, or a
    view, by its length and its first and last 16 bytes (slicing them cost ~380 ns a call, a
    seventh of a 64 B call's time, when every reply was checked that way)."""
    if type(reply) is bytes and len(payload) <= WHOLE_CHECK_MAX:
        if reply != payload:
            raise SystemExit(f"bad echo: {len(reply)} bytes back for {len(payload)}, not the same")
        return
    if len(reply) != len(payload) or bytes(reply[:16]) != payload[:16] or bytes(reply[-16:]) != payload[-16:]:
        raise SystemExit(f"bad echo: {len(reply)} bytes back for {len(payload)}")


def sync_pipelined(
    start_call: Callable[[bytes], Future[bytes]], payload: bytes, inflight: int, budget: float, max_iters: int
) -> str:
    """`inflight` calls kept outstanding with `.future()`, each replaced as it completes."""
    latencies: list[float] = []
    deadline = time.perf_counter() + budget
    begun = time.perf_counter()
    done = 0
    pending: list[tuple[float, Future[bytes]]] = [
        (time.perf_counter(), start_call(payload)) for _ in range(inflight)
    ]
    while pending:
        t0, fut = pending.pop(0)
        check(fut.result(), payload)
        latencies.append(time.perf_counter() - t0)
        done += 1
        if time.perf_counter() < deadline and done < max_iters:
            pending.append((time.perf_counter(), start_call(payload)))
    return summary(latencies, time.perf_counter() - begun)


async def aio_timed(
    op: Callable[[], Awaitable[None]], size: int, inflight: int, budget: float, min_iters: int, max_iters: int
) -> str:
    for _ in range(warmup_count(size, max_iters)):
        await op()
    latencies: list[float] = []
    start = time.perf_counter()

    async def worker() -> None:
        while len(latencies) < max_iters and (
            len(latencies) < min_iters or time.perf_counter() - start < budget
        ):
            t = time.perf_counter()
            await op()
            latencies.append(time.perf_counter() - t)

    await asyncio.gather(*(worker() for _ in range(inflight)))
    return summary(latencies, time.perf_counter() - start)


def run_sync(system: str, target: str) -> None:
    if system == "isthmus-sync":
        import isthmus

        channel = isthmus.insecure_channel(target)
        if not target.startswith("shm://"):
            # An HTTP/2 address (the upgrade): calls move to shm:// once the probe that the
            # first call starts has connected; measure from then on.
            end = time.monotonic() + 10
            while channel.upgrade_status() == "pending" and time.monotonic() < end:
                check(channel.unary_unary(PATH)(b"warm"), b"warm")
                time.sleep(0.01)
            if not channel.upgrade_status().startswith("shm://"):
                raise SystemExit(f"{target}: the channel did not move to shm:// ({channel.upgrade_status()})")
    else:
        import grpc

        options = [*NO_LIMIT, ("grpc.default_authority", "localhost")]
        channel = grpc.insecure_channel(f"unix:{target}", options=options)
    echo = channel.unary_unary(PATH)
    for line in sys.stdin:
        words = line.split()
        size = int(words[1])
        payload = payload_of(size)

        def once(payload: bytes = payload) -> None:
            check(echo(payload), payload)

        if words[0] == "rt":
            budget, lo, hi = int(words[2]) / 1000, int(words[3]), int(words[4])
            print(timed(once, size, budget, lo, hi), flush=True)
        else:
            inflight, budget, hi = int(words[2]), int(words[3]) / 1000, int(words[5])
            print(sync_pipelined(echo.future, payload, inflight, budget, hi), flush=True)


async def run_aio(system: str, target: str) -> None:
    if system == "isthmus-aio":
        import isthmus.aio

        channel = isthmus.aio.insecure_channel(target)
    else:
        import grpc

        options = [*NO_LIMIT, ("grpc.default_authority", "localhost")]
        channel = grpc.aio.insecure_channel(f"unix:{target}", options=options)
    await serve_aio(channel.unary_unary(PATH))


def floor_echo(loop: asyncio.AbstractEventLoop) -> Callable[[bytes], Awaitable[bytes]]:
    """`py-aio-floor`'s call on `loop`: one future, which the loop resolves on its next turn."""

    async def echo(payload: bytes) -> bytes:
        future = loop.create_future()
        loop.call_soon(future.set_result, payload)
        return await future

    return echo


async def aio_floor(_target: str) -> None:
    await serve_aio(floor_echo(asyncio.get_running_loop()))


async def serve_aio(echo: Callable[[bytes], Awaitable[bytes]]) -> None:
    """Answers the harness's lines with `echo`'s figures."""
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        words = line.split()
        size = int(words[1])
        payload = payload_of(size)

        async def once(payload: bytes = payload) -> None:
            check(await echo(payload), payload)

        if words[0] == "rt":
            budget, lo, hi = int(words[2]) / 1000, int(words[3]), int(words[4])
            print(await aio_timed(once, size, 1, budget, lo, hi), flush=True)
        else:
            inflight, budget, lo, hi = int(words[2]), int(words[3]) / 1000, int(words[4]), int(words[5])
            print(await aio_timed(once, size, inflight, budget, lo, hi), flush=True)


def run_raw(target: str) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(target)
    for line in sys.stdin:
        words = line.split()
        if words[0] != "rt":
            print("none", flush=True)
            continue
        size = int(words[1])
        payload = payload_of(size)
        frame = struct.pack("<Q", size) + payload
        reply = bytearray(8 + size)
        view = memoryview(reply)

        def once(
            frame: bytes = frame, reply: bytearray = reply, view: memoryview = view, payload: bytes = payload
        ) -> None:
            sock.sendall(frame)
            got = 0
            while got < len(reply):
                n = sock.recv_into(view[got:])
                if n == 0:
                    raise SystemExit("the echo server closed the socket")
                got += n
            check(view[8:], payload)

        budget, lo, hi = int(words[2]) / 1000, int(words[3]), int(words[4])
        print(timed(once, size, budget, lo, hi), flush=True)


SOAK_SIZES = (64, 64, 64, 1 << 10, 1 << 10, 64, 16 << 10, 100_000)


async def soak(target: str, calls: int, inflight: int) -> dict[str, object]:
    """`calls` checked echo calls from ``isthmus.aio`` with `inflight` tasks; counts what was
    lost (failed, or never answered within 30 s) and what came back different. Each message
    starts with its call number, so a reply carrying another call's bytes is caught."""
    import os

    import isthmus.aio

    bodies = {size: os.urandom(size) for size in set(SOAK_SIZES)}
    channel = isthmus.aio.insecure_channel(target)
    echo = channel.unary_unary(PATH)
    latencies: list[float] = []
    lost = mismatched = 0
    first_error: str | None = None
    next_call = 0

    async def worker() -> None:
        nonlocal next_call, lost, mismatched, first_error
        while next_call < calls:
            i, next_call = next_call, next_call + 1
            size = SOAK_SIZES[i % len(SOAK_SIZES)]
            body = bodies[size]
            payload = (i.to_bytes(8, "little") + body[8:]) if size >= 8 else body
            t = time.perf_counter()
            try:
                reply = await echo(payload, timeout=30)
            except Exception as e:  # every failure is a lost call, counted
                lost += 1
                first_error = first_error or f"call {i}: {e!r}"
            else:
                if reply != payload:
                    mismatched += 1
            latencies.append(time.perf_counter() - t)

    start = time.perf_counter()
    # A watchdog over the whole soak rather than one per call (a task and a timer per call would
    # halve asyncio's throughput): calls that a broken deadline left hanging count as lost.
    workers = asyncio.gather(*(worker() for _ in range(inflight)))
    try:
        await asyncio.wait_for(workers, 60 + calls / 1000)
    except asyncio.TimeoutError:
        lost += calls - len(latencies)
        first_error = first_error or "the soak's watchdog expired with calls unanswered"
    total = time.perf_counter() - start
    client_high_water = channel.stats().arena_high_water
    await channel.close()
    latencies.sort()

    def pick(q: float) -> float:
        return round(latencies[max(1, math.ceil(len(latencies) * q)) - 1] * 1e6, 3)

    return {
        "calls": len(latencies),
        "lost": lost,
        "mismatched": mismatched,
        "p50_us": pick(0.5),
        "p99_us": pick(0.99),
        "p999_us": pick(0.999),
        "rps": round(len(latencies) / total, 1),
        "first_error": first_error,
        "arena_high_water_client": client_high_water,
    }


def count_client(target: str, size: int, calls: int) -> None:
    """``bench/count_per_call.py``'s Python client (``py-isthmus-sync``'s call): READY once
    warm; on a line from stdin, CALLS echo calls of SIZE bytes, then ``DONE FRAMES_SENT
    FRAMES_RECEIVED DOORBELLS_RUNG SLEEPS`` over them; exits at the next line."""
    import isthmus

    channel = isthmus.insecure_channel(target)
    echo = channel.unary_unary(PATH)
    payload = b"\x5a" * size
    for _ in range(10_000):
        check(echo(payload), payload)
    print("READY", flush=True)
    sys.stdin.readline()
    before = channel.stats()
    for _ in range(calls):
        check(echo(payload), payload)
    after = channel.stats()
    counts = (
        after.frames_sent - before.frames_sent,
        after.frames_received - before.frames_received,
        after.doorbells_rung - before.doorbells_rung,
        after.sleeps - before.sleeps,
    )
    print("DONE", *counts, flush=True)
    sys.stdin.readline()
    channel.close()


def main() -> None:
    if sys.argv[1] == "count":
        count_client(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    if sys.argv[1] == "soak":
        import json

        target, calls, inflight = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
        print(json.dumps(asyncio.run(soak(target, calls, inflight))), flush=True)
        return
    system, target = sys.argv[1], sys.argv[2]
    print("READY", flush=True)
    if system == "raw-uds":
        run_raw(target)
    elif system == "aio-floor":
        asyncio.run(aio_floor(target))
    elif system.endswith("-aio"):
        asyncio.run(run_aio(system, target))
    else:
        run_sync(system, target)


if __name__ == "__main__":
    main()
