"""A Python echo server for the benchmark's Python-to-Python systems: `/bench.Echo/Unary` returns
its request, with no (de)serializers, on a pool of 16 threads (the same pool for every server).

    python bench/py_server.py isthmus shm://NAME      # isthmus.server
    python bench/py_server.py isthmus-raw shm://NAME  # isthmus.server, an in-place raw handler
    python bench/py_server.py grpcio /path/to.sock    # grpc.server on a Unix socket
    python bench/py_server.py isthmus-aio shm://NAME  # isthmus.aio.server, an `async def` handler
    python bench/py_server.py grpc-aio /path/to.sock  # grpc.aio.server on a Unix socket, the same

The raw handler (`isthmus.raw`) reads the request where it arrived (a view of the client's shared
memory) and copies it into a reply block of the server's shared memory, which the client reads
where it is: the echo's one copy on the server, as grpcio's handler returning its request makes
none but its transport makes several.

Prints READY once it serves, then serves until killed."""

from __future__ import annotations

import asyncio
import sys
from concurrent import futures
from typing import Any

import grpc

import isthmus
import isthmus.aio

NO_LIMIT = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


def echo(request: bytes, context: grpc.ServicerContext) -> bytes:
    return request


async def echo_async(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return request


async def serve_aio(system: str, target: str) -> None:
    handler = grpc.method_handlers_generic_handler(
        "bench.Echo", {"Unary": grpc.unary_unary_rpc_method_handler(echo_async)}
    )
    if system == "isthmus-aio":
        server: grpc.aio.Server = isthmus.aio.server(handlers=[handler], options=NO_LIMIT)
        server.add_insecure_port(target)
    else:
        server = grpc.aio.server(handlers=[handler], options=NO_LIMIT)
        server.add_insecure_port(f"unix:{target}")
    await server.start()
    print("READY", flush=True)
    await server.wait_for_termination()


@isthmus.raw
def echo_in_place(request: isthmus.Message, context: Any) -> isthmus.Block:
    reply = context.alloc(len(request))
    reply.write(request)  # the transport's copy: streaming stores for a large one (ADR 0022)
    return reply


def main() -> None:
    system, target = sys.argv[1], sys.argv[2]
    if system.endswith("-aio"):
        asyncio.run(serve_aio(system, target))
        return
    behaviour = echo_in_place if system == "isthmus-raw" else echo
    handler = grpc.method_handlers_generic_handler(
        "bench.Echo", {"Unary": grpc.unary_unary_rpc_method_handler(behaviour)}
    )
    pool = futures.ThreadPoolExecutor(max_workers=16)
    if system.startswith("isthmus"):
        server = isthmus.server(pool, handlers=[handler], options=NO_LIMIT)
        server.add_insecure_port(target)
    else:
        server = grpc.server(pool, handlers=[handler], options=NO_LIMIT)
        server.add_insecure_port(f"unix:{target}")
    server.start()
    print("READY", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
