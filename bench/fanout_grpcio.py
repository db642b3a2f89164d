"""grpcio's side of the fan-out benchmark (`isthmus-bench fanout`, the system `fanout-grpcio`): a
publisher serving the server stream `/bench.Fanout/Watch` and the subscribers that call it, with
the same arguments, protocol and output as the Rust roles (`bench/src/fanout.rs`).

    python bench/fanout_grpcio.py serve PATH SIZE COUNT INTERVAL_US SUBS [WARMUP]
    python bench/fanout_grpcio.py subscribe PATH CONNS COUNT

`serve`: `grpc.server` on the Unix socket PATH, a generic handler without (de)serializers, a pool
of SUBS + 1 threads (every subscriber's handler holds one for its stream's life), no message
limits. Each Watch call is a subscriber: its handler yields what it takes from its own
`queue.Queue`. Prints READY, waits for SUBS subscribers, then publishes COUNT messages of SIZE
bytes (u64 sequence number and u64 CLOCK_MONOTONIC ns, little-endian, then filler), one
`bytes` put into every queue, INTERVAL_US after the one before and not before every handler
has taken the one before. The CPU window (getrusage, user + system) runs from the publish of
seq WARMUP to the line `stop` on stdin; then every stream ends with OK, it prints
`{"cpu_us_per_publish", "publishes_per_s", "published"}`, and it stops at the end of stdin.

`subscribe`: CONNS subscriptions, each on its own channel and connection (a local subchannel
pool: grpcio would otherwise share one connection between channels to one target) and its own
thread. Prints DONE once each has COUNT messages (or failed), then, once the streams have ended,
`{"lat_us": [per seq the largest now - stamp, µs, null if none], "lost": N, "size": bytes or -1}`.
"""

from __future__ import annotations

import json
import queue
import resource
import struct
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc

SERVICE, METHOD = "bench.Fanout", "Watch"
PATH = f"/{SERVICE}/{METHOD}"
NO_LIMIT = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
# One connection per channel: without it grpc-core shares a subchannel between channels.
OWN_CONNECTION = [*NO_LIMIT, ("grpc.use_local_subchannel_pool", 1)]
HEADER = struct.Struct("<QQ")


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def cpu_us() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return (ru.ru_utime + ru.ru_stime) * 1e6


class Hub:
    """The subscribers' queues, and how many streams are alive."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.queues: list[queue.Queue[bytes | None]] = []
        self.active = 0

    def watch(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        q: queue.Queue[bytes | None] = queue.Queue()
        with self.cond:
            self.queues.append(q)
            self.active += 1
            self.cond.notify_all()
        try:
            while True:
                message = q.get()
                q.task_done()  # taken: the publisher's `join` returns
                if message is None:
                    return
                yield message
        finally:
            with self.cond:
                self.active -= 1
                self.cond.notify_all()


def serve(path: str, size: int, count: int, interval_us: int, subs: int, warmup: int) -> int:
    hub = Hub()
    handler = grpc.method_handlers_generic_handler(
        SERVICE, {METHOD: grpc.unary_stream_rpc_method_handler(hub.watch)}
    )
    pool = futures.ThreadPoolExecutor(max_workers=subs + 1)
    server = grpc.server(pool, handlers=[handler], options=NO_LIMIT)
    server.add_insecure_port(f"unix:{path}")
    server.start()
    print("READY", flush=True)
    with hub.cond:
        if not hub.cond.wait_for(lambda: len(hub.queues) >= subs, timeout=60):
            print("fanout_grpcio.py serve: the subscribers did not come", file=sys.stderr)
            server.stop(None)
            return 1
        queues = list(hub.queues)
    filler = b"\xa5" * (size - HEADER.size)
    interval = interval_us / 1e6
    window: tuple[float, float] | None = None
    last = last_publish = 0.0
    for seq in range(count):
        if seq:
            delay = last + interval - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        for q in queues:
            q.join()
        if seq == warmup:
            window = (cpu_us(), time.perf_counter())
        last = last_publish = time.perf_counter()
        message = HEADER.pack(seq, now_ns()) + filler
        for q in queues:
            q.put(message)
    for q in queues:
        q.join()
    sys.stdin.readline()  # `stop`: every subscriber has every message
    cpu = cpu_us()
    measured = count - warmup
    report: dict[str, float | int | None] = {"cpu_us_per_publish": None, "publishes_per_s": None}
    if window is not None:
        span = last_publish - window[1]
        report["cpu_us_per_publish"] = (cpu - window[0]) / max(measured, 1)
        report["publishes_per_s"] = (measured - 1) / span if measured > 1 and span > 0 else None
    report["published"] = count
    for q in queues:
        q.put(None)  # the handlers return: the streams end with OK
    print(json.dumps(report), flush=True)
    with hub.cond:
        hub.cond.wait_for(lambda: hub.active == 0, timeout=10)
    sys.stdin.read()  # its end: every subscriber has seen its stream end and left
    server.stop(None)
    return 0


class Tally:
    """One subscription's messages: per seq, now - stamp in µs, if it came in order."""

    def __init__(self, count: int) -> None:
        self.lat_us: list[float | None] = [None] * count
        self.next = 0
        self.bad = 0
        self.sizes: set[int] = set()

    def take(self, message: bytes, now: int) -> None:
        self.sizes.add(len(message))
        if len(message) < HEADER.size:
            self.bad += 1
            return
        seq, stamp = HEADER.unpack_from(message)
        if seq == self.next and seq < len(self.lat_us):
            self.lat_us[seq] = (now - stamp) / 1e3
            self.next += 1
        else:
            self.bad += 1

    def complete(self) -> bool:
        return self.next == len(self.lat_us)

    def lost(self) -> int:
        return len(self.lat_us) - self.next + self.bad


def subscribe(path: str, conns: int, count: int) -> int:
    done = threading.Semaphore(0)
    tallies = [Tally(count) for _ in range(conns)]

    def one(tally: Tally) -> None:
        signalled = False
        try:
            with grpc.insecure_channel(f"unix:{path}", options=OWN_CONNECTION) as channel:
                for message in channel.unary_stream(PATH)(b""):
                    tally.take(message, now_ns())
                    if not signalled and tally.complete():
                        signalled = True
                        done.release()
        except grpc.RpcError as e:
            print(f"fanout_grpcio.py subscribe: {e}", file=sys.stderr)
        finally:
            if not signalled:
                done.release()

    threads = [threading.Thread(target=one, args=(t,), daemon=True) for t in tallies]
    for t in threads:
        t.start()
    for _ in threads:
        done.acquire()
    print("DONE", flush=True)
    for t in threads:
        t.join()
    lat: list[float | None] = []
    for seq in range(count):
        seen = [v for t in tallies if (v := t.lat_us[seq]) is not None]
        lat.append(round(max(seen), 3) if seen else None)
    sizes = set().union(*(t.sizes for t in tallies))
    size = sizes.pop() if len(sizes) == 1 else -1
    report = {"lat_us": lat, "lost": sum(t.lost() for t in tallies), "size": size}
    print(json.dumps(report), flush=True)
    return 0


def main() -> int:
    role, args = sys.argv[1] if len(sys.argv) > 1 else "", sys.argv[2:]
    if role == "serve" and len(args) in (5, 6):
        path, *numbers = args
        size, count, interval_us, subs, *rest = (int(a) for a in numbers)
        return serve(path, size, count, interval_us, subs, rest[0] if rest else 0)
    if role == "subscribe" and len(args) == 3:
        return subscribe(args[0], int(args[1]), int(args[2]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
