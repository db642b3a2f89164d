"""A server for the parity tests (`test_grpc_parity.py`): `parity_server.py API TARGET…` with API
`grpcio`, `grpc.aio`, `isthmus` or `isthmus-aio`. It prints READY, then LISTENING <address> for
each HTTP/2 target, and serves until killed:

- the application's own `grpc.health.v1.Health` servicer: Check answers SERVING for "" and
  NOT_SERVING for "custom", and fails NOT_FOUND "no such service: NAME" for any other name
  (grpcio-health-checking's servicer answers so);
- `/parity.Slow/Wait` (asyncio servers): waits a minute; when the call ends first and its task is
  cancelled, it prints HANDLER-CANCELLED."""

from __future__ import annotations

import asyncio
import sys
from concurrent import futures
from typing import Any

import grpc
import grpc.aio

import isthmus
import isthmus.aio

SERVICE = "grpc.health.v1.Health"


def _name(request: bytes) -> str:
    """The `service` field (1) of a HealthCheckRequest, for the short names this test sends."""
    if not request:
        return ""
    assert request[0] == 0x0A and request[1] < 0x80, request
    return request[2 : 2 + request[1]].decode()


def check(request: bytes, context: Any) -> bytes:
    name = _name(request)
    statuses = {"": 1, "custom": 2}  # SERVING, NOT_SERVING
    if name not in statuses:
        context.abort(grpc.StatusCode.NOT_FOUND, f"no such service: {name}")
    return bytes([0x08, statuses[name]])


async def check_async(request: bytes, context: Any) -> bytes:
    name = _name(request)
    statuses = {"": 1, "custom": 2}
    if name not in statuses:
        await context.abort(grpc.StatusCode.NOT_FOUND, f"no such service: {name}")
    return bytes([0x08, statuses[name]])


async def wait(request: bytes, context: Any) -> bytes:
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        print("HANDLER-CANCELLED", flush=True)
        raise
    return b""


def handlers(method: Any) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        SERVICE, {"Check": grpc.unary_unary_rpc_method_handler(method)}
    )


SLOW = grpc.method_handlers_generic_handler(
    "parity.Slow", {"Wait": grpc.unary_unary_rpc_method_handler(wait)}
)


def announce(addresses: list[str]) -> None:
    print("READY", flush=True)
    for address in addresses:
        print("LISTENING", address, flush=True)


def main() -> None:
    api, targets = sys.argv[1], sys.argv[2:]
    if api in ("isthmus-aio", "grpc.aio"):

        async def serve() -> None:
            server = isthmus.aio.server() if api == "isthmus-aio" else grpc.aio.server()
            server.add_generic_rpc_handlers((handlers(check_async), SLOW))
            for target in targets:
                server.add_insecure_port(target)
            await server.start()
            announce([t for t in targets if not t.startswith("shm://")])
            await server.wait_for_termination()

        asyncio.run(serve())
        return
    make = grpc.server if api == "grpcio" else isthmus.server
    server = make(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((handlers(check),))
    for target in targets:
        server.add_insecure_port(target)
    server.start()
    announce([t for t in targets if not t.startswith("shm://")])
    server.wait_for_termination()


if __name__ == "__main__":
    main()
