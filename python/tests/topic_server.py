"""A Python isthmus server that publishes an `isthmus.Topic`, as a peer process for the topic
tests.

Usage: python -m topic_server [--aio] CAPACITY SLOW TARGET...   (prints `READY`, then
`LISTENING ADDRESS` for each `unix://` and `http://` target, and serves until killed)

Methods, all under `/topic.Feed/`, with raw bytes:
- `Watch`: server streaming; subscribes the call to the topic. After `n` messages were dropped
  for it, it is sent `GAP n` instead.
- `Publish`: the request is three little-endian u64s, count, size and state; publishes `count`
  messages of `size` bytes: message `seq` (from 1) is seq as a u64, then bytes `seq % 251`.
  With state 1 the last one is also kept as the current state. Returns the subscribers reached
  by the last.
- `Stats`: the topic's counters as JSON.
- `Close`: closes the topic.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
from echo_server import announce, bind, serve_aio_forever

import isthmus
import isthmus.aio

published = 0
lock = threading.Lock()


def message(seq: int, size: int) -> bytes:
    return seq.to_bytes(8, "little") + bytes([seq % 251]) * max(0, size - 8)


def gap(n: int) -> bytes:
    return b"GAP %d" % n


def publish(topic: isthmus.Topic, request: bytes) -> bytes:
    global published
    count, size, state = (int.from_bytes(request[i : i + 8], "little") for i in (0, 8, 16))
    reached = 0
    with lock:
        for i in range(count):
            published += 1
            last = i == count - 1
            send = topic.publish_state if state and last else topic.publish
            reached = send(message(published, size))
    return reached.to_bytes(8, "little")


def handlers(topic: isthmus.Topic, aio: bool) -> grpc.GenericRpcHandler:
    def watch(request: bytes, context: Any) -> Iterator[bytes]:
        return topic.subscribe(context, on_gap=gap)

    async def watch_aio(request: bytes, context: Any) -> None:
        await topic.subscribe_async(context, on_gap=gap)

    def stats(request: bytes, context: Any) -> bytes:
        return json.dumps(topic.stats().__dict__).encode()

    def close(request: bytes, context: Any) -> bytes:
        topic.close()
        return b""

    return grpc.method_handlers_generic_handler(
        "topic.Feed",
        {
            "Watch": grpc.unary_stream_rpc_method_handler(watch_aio if aio else watch),
            "Publish": grpc.unary_unary_rpc_method_handler(lambda r, c: publish(topic, r)),
            "Stats": grpc.unary_unary_rpc_method_handler(stats),
            "Close": grpc.unary_unary_rpc_method_handler(close),
        },
    )


def main() -> None:
    args = sys.argv[1:]
    aio = args[0] == "--aio"
    if aio:
        args = args[1:]
    topic = isthmus.Topic("feed", capacity=int(args[0]), slow=args[1])
    targets = args[2:]
    if aio:
        asyncio.run(serve_aio_forever(handlers(topic, True), targets))
        return
    server = isthmus.server(futures.ThreadPoolExecutor(max_workers=64), handlers=[handlers(topic, False)])
    addresses = bind(server, "isthmus", targets)
    server.start()
    announce(addresses)
    threading.Event().wait()


if __name__ == "__main__":
    main()
