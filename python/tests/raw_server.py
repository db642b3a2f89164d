"""A Python isthmus server of raw methods (`isthmus.raw`), as a peer process for the raw tier's
tests.

Usage: python -m raw_server [--workers N | --aio] TARGET...   (prints `READY`, then `LISTENING ADDRESS`
for each `unix://` and `http://` target, and serves until killed; handlers run on a pool of N
threads, 16 by default; with `--aio`, on `isthmus.aio.server`, where these plain handlers run on
the loop's default executor, as grpc.aio runs them; `PEER_LOOP=uvloop` runs that one on uvloop)

Methods, all under `/raw.Raw/`:
- `Echo`: returns the request `Message` as it is (sent from the client's memory it views).
- `Double`: the request as float64s, doubled into a reply block of the server's shared memory.
- `Fill`: the request is 9 bytes, a size (little-endian u64) and a byte; the reply is a block of
  that many of that byte (in place, no copy).
- `KeepExported`: returns a block it still holds a view of: the send raises BufferError.
- `Count`: server streaming; the request is a count n; n blocks of 4 KiB, block i filled with i.
- `Sum`: client streaming; the sum of every byte of every request.
- `Hold` keeps each request (a view of the client's memory); `CheckHeld` checks that every
  request held still reads as it was sent, then lets them go.
- `Busy`: sleeps 0.3 s; returns how many calls were in a handler at once at most so far.
- `ArenaInUse`: the server's `stats().arena_in_use` (little-endian u64).
- `HandshakesFailed`: the server's `stats().handshakes_failed` (little-endian u64).
- `HogGil`: holds the GIL for the request's number of milliseconds (little-endian u64): it
  spins in Python with the switch interval raised, so no other thread of the process runs Python.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import numpy as np
from echo_server import announce, bind, serve_aio_forever
from peer import run_loop

import isthmus
import isthmus.aio

held: list[isthmus.Message] = []
kept_views: list[memoryview] = []


@isthmus.raw
def echo(request: isthmus.Message, context: Any) -> isthmus.Message:
    return request


@isthmus.raw
def double(request: isthmus.Message, context: Any) -> isthmus.Block:
    values = np.frombuffer(request, dtype=np.float64)
    reply = context.alloc(len(request))
    out = np.frombuffer(reply, dtype=np.float64)
    np.multiply(values, 2.0, out=out)
    del out  # the view must be released before the block is sent
    return reply


@isthmus.raw
def fill(request: isthmus.Message, context: Any) -> isthmus.Block:
    size, byte = int.from_bytes(bytes(request)[:8], "little"), bytes(request)[8]
    reply = context.alloc(size)
    with memoryview(reply) as view:
        view[:] = bytes([byte]) * size
    return reply


@isthmus.raw
def keep_exported(request: isthmus.Message, context: Any) -> isthmus.Block:
    reply = context.alloc(16)
    kept_views.append(memoryview(reply))
    return reply


@isthmus.raw
def count(request: isthmus.Message, context: Any) -> Iterator[isthmus.Block]:
    for i in range(int.from_bytes(bytes(request), "little")):
        block = context.alloc(4096)
        with memoryview(block) as view:
            view[:] = bytes([i % 256]) * 4096
        yield block


@isthmus.raw
def total(requests: Iterator[isthmus.Message], context: Any) -> bytes:
    return int(sum(int(np.frombuffer(r, dtype=np.uint8).sum(dtype=np.uint64)) for r in requests)).to_bytes(
        8, "little"
    )


@isthmus.raw
def hold(request: isthmus.Message, context: Any) -> bytes:
    held.append(request)
    return len(held).to_bytes(8, "little")


@isthmus.raw
def check_held(request: isthmus.Message, context: Any) -> bytes:
    """1 if the k-th request held (from 1) still reads as k in every byte, as it was sent, else
    0; then lets them go."""
    ok = all(np.all(np.frombuffer(m, dtype=np.uint8) == k) for k, m in enumerate(held, 1))
    held.clear()
    return bytes([int(ok)])


busy_lock = threading.Lock()
busy_now = 0
busy_most = 0


@isthmus.raw
def busy(request: isthmus.Message, context: Any) -> bytes:
    global busy_now, busy_most
    with busy_lock:
        busy_now += 1
        busy_most = max(busy_most, busy_now)
    time.sleep(0.3)
    with busy_lock:
        busy_now -= 1
        return busy_most.to_bytes(8, "little")


serving: list[Any] = []


@isthmus.raw
def arena_in_use(request: isthmus.Message, context: Any) -> bytes:
    return int(serving[0].stats().arena_in_use).to_bytes(8, "little")


@isthmus.raw
def handshakes_failed(request: isthmus.Message, context: Any) -> bytes:
    return int(serving[0].stats().handshakes_failed).to_bytes(8, "little")


@isthmus.raw
def hog_gil(request: isthmus.Message, context: Any) -> bytes:
    end = time.monotonic() + int.from_bytes(bytes(request), "little") / 1000
    interval = sys.getswitchinterval()
    sys.setswitchinterval(100.0)
    try:
        while time.monotonic() < end:
            pass
    finally:
        sys.setswitchinterval(interval)
    return b"done"


def main() -> None:
    args = sys.argv[1:]
    workers, aio = 16, False
    if args[0] == "--workers":
        workers, args = int(args[1]), args[2:]
    if args[0] == "--aio":
        aio, args = True, args[1:]
    handlers = grpc.method_handlers_generic_handler(
        "raw.Raw",
        {
            "Echo": grpc.unary_unary_rpc_method_handler(echo),
            "Double": grpc.unary_unary_rpc_method_handler(double),
            "Fill": grpc.unary_unary_rpc_method_handler(fill),
            "KeepExported": grpc.unary_unary_rpc_method_handler(keep_exported),
            "Count": grpc.unary_stream_rpc_method_handler(count),
            "Sum": grpc.stream_unary_rpc_method_handler(total),
            "Hold": grpc.unary_unary_rpc_method_handler(hold),
            "CheckHeld": grpc.unary_unary_rpc_method_handler(check_held),
            "Busy": grpc.unary_unary_rpc_method_handler(busy),
            "ArenaInUse": grpc.unary_unary_rpc_method_handler(arena_in_use),
            "HandshakesFailed": grpc.unary_unary_rpc_method_handler(handshakes_failed),
            "HogGil": grpc.unary_unary_rpc_method_handler(hog_gil),
        },
    )
    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    if aio:
        run_loop(serve_aio_forever(handlers, args, options, serving.append))
        return
    pool = futures.ThreadPoolExecutor(max_workers=workers)
    server = isthmus.server(pool, handlers=[handlers], options=options)
    serving.append(server)
    addresses = bind(server, "isthmus", args)
    server.start()
    announce(addresses)
    threading.Event().wait()


if __name__ == "__main__":
    main()
