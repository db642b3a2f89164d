"""A Python server of the Echo service, as a peer process for the tests.

Usage: python -m echo_server KIND TARGET...
KIND is `isthmus` (isthmus.server), `isthmus-aio` (isthmus.aio.server) or `grpcio` (grpc.server,
for `unix://` and `http://` targets). Targets are isthmus's (`shm://`, `unix:///`, `http://`).
Prints `READY`, then `LISTENING ADDRESS` for each `unix://` and `http://` target in order, as
the Rust peer does. SIGTERM stops the server with 3 s of grace; `SHUTDOWN-DONE` is printed at
the end. The generated `conformance_pb2*` modules must be on PYTHONPATH. `ECHO_MAX_RPCS` sets
`maximum_concurrent_rpcs`; `PEER_LOOP=uvloop` runs the asyncio server on uvloop.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any

import conformance_pb2_grpc as pb_grpc
import grpc
from echo_servicer import AsyncEcho, Echo
from peer import grpcio_target, run_loop

import isthmus
import isthmus.aio

# Past 64 MiB, like the Rust peer's limits: the suite sends a message of (almost) 64 MiB.
OPTIONS = [("grpc.max_receive_message_length", 65 << 20), ("grpc.max_send_message_length", 65 << 20)]


def bind(server: grpc.Server | grpc.aio.Server, kind: str, targets: list[str]) -> list[str]:
    """Binds every target; returns the addresses to announce."""
    announced = []
    for target in targets:
        scheme, _, rest = target.partition("://")
        port = server.add_insecure_port(grpcio_target(target) if kind == "grpcio" else target)
        if scheme == "http":
            announced.append(f"http://{rest.rsplit(':', 1)[0]}:{port}")
        elif scheme == "unix":
            announced.append(target)
    return announced


def announce(addresses: list[str]) -> None:
    print("READY", flush=True)
    for address in addresses:
        print(f"LISTENING {address}", flush=True)


async def serve_aio_forever(
    handlers: grpc.GenericRpcHandler,
    targets: list[str],
    options: Any = None,
    made: Callable[[isthmus.aio.Server], None] | None = None,
) -> None:
    """An `isthmus.aio` server of `handlers` on `targets`, announced, until the process is
    killed; `made(server)` is called once it exists."""
    server = isthmus.aio.server(handlers=[handlers], options=options)
    if made is not None:
        made(server)
    addresses = bind(server, "isthmus-aio", targets)
    await server.start()
    announce(addresses)
    await asyncio.Event().wait()


def max_rpcs() -> int | None:
    """`ECHO_MAX_RPCS`: the server's `maximum_concurrent_rpcs`."""
    value = os.environ.get("ECHO_MAX_RPCS")
    return None if value is None else int(value)


def serve(kind: str, targets: list[str]) -> None:
    pool = futures.ThreadPoolExecutor(max_workers=16)
    make = isthmus.server if kind == "isthmus" else grpc.server
    server = make(pool, options=OPTIONS, maximum_concurrent_rpcs=max_rpcs())
    pb_grpc.add_EchoServicer_to_server(Echo(), server)
    addresses = bind(server, kind, targets)
    server.start()
    term = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: term.set())
    announce(addresses)
    term.wait()
    server.stop(3).wait()
    print("SHUTDOWN-DONE", flush=True)


async def serve_aio(targets: list[str]) -> None:
    server = isthmus.aio.server(options=OPTIONS, maximum_concurrent_rpcs=max_rpcs())
    pb_grpc.add_EchoServicer_to_server(AsyncEcho(), server)
    addresses = bind(server, "isthmus-aio", targets)
    await server.start()
    term = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, term.set)
    announce(addresses)
    await term.wait()
    await server.stop(3)
    print("SHUTDOWN-DONE", flush=True)


def main() -> None:
    kind, targets = sys.argv[1], sys.argv[2:]
    if kind == "isthmus-aio":
        run_loop(serve_aio(targets))
    else:
        serve(kind, targets)


if __name__ == "__main__":
    main()
