"""What grpcio users write on their first day, found wanting by a probe of isthmus beside
grpcio: each test runs the same code on a grpcio server or channel and on isthmus ones, in
this process, and expects the same result."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import grpc.aio
import pytest
from peer import fresh, grpcio_target

import isthmus
import isthmus.aio

# A serialized google.rpc.Status (code 3, message "rich"): what grpc_status.rpc_status.to_status
# puts under grpc-status-details-bin.
RICH = b"\x08\x03\x12\x04rich"


class RichStatus(grpc.Status):
    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata: Any) -> None:
        self.code, self.details, self.trailing_metadata = code, details, trailing_metadata


def _rich(request: bytes, context: Any) -> bytes:
    context.abort_with_status(
        RichStatus(grpc.StatusCode.INVALID_ARGUMENT, "rich", (("grpc-status-details-bin", RICH), ("k", "v")))
    )
    raise AssertionError("abort_with_status returned")


def _reserved_trailer(request: bytes, context: Any) -> bytes:
    context.set_trailing_metadata((("grpc-foo", "v"), ("k", "v")))
    return b"ok"


def _bad_trailer(request: bytes, context: Any) -> bytes:
    context.set_trailing_metadata((("k", "not ascii: é"),))
    return b"ok"


def _metadata(request: bytes, context: Any) -> bytes:
    # Sorted: gRPC keeps the order of one key's values, not the order of the keys.
    pairs = sorted(f"{k}={v}" for k, v in context.invocation_metadata() if k.startswith("x-"))
    return ",".join(pairs).encode()


def _left(request: bytes, context: Any) -> bytes:
    return repr(context.time_remaining()).encode()


def _head_then_fail(request: bytes, context: Any) -> bytes:
    context.send_initial_metadata((("x-h", "1"),))
    context.abort(grpc.StatusCode.NOT_FOUND, "after a header")
    raise AssertionError("abort returned")


HANDLERS = {
    "HeadThenFail": _head_then_fail,
    "Left": _left,
    "Rich": _rich,
    "ReservedTrailer": _reserved_trailer,
    "BadTrailer": _bad_trailer,
    "Metadata": _metadata,
}


def _generic() -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        "users.T", {name: grpc.unary_unary_rpc_method_handler(h) for name, h in HANDLERS.items()}
    )


@pytest.fixture(params=["grpcio", "isthmus"])
def server(request: pytest.FixtureRequest) -> Iterator[list[Any]]:
    """A blocking server of HANDLERS, and channels to it: grpcio's to a grpcio server; isthmus's
    over shm:// and the Unix socket, and grpcio's over the socket, to an isthmus server."""
    pool = futures.ThreadPoolExecutor(4)
    unix = fresh("unix")
    if request.param == "grpcio":
        s = grpc.server(pool)
        s.add_insecure_port(grpcio_target(unix))
        channels = [grpc.insecure_channel(grpcio_target(unix))]
    else:
        s = isthmus.server(pool)
        shm = fresh("shm")
        s.add_insecure_port(shm)
        s.add_insecure_port(unix)
        channels = [isthmus.insecure_channel(shm), isthmus.insecure_channel(unix)]
        channels.append(grpc.insecure_channel(grpcio_target(unix)))
    s.add_generic_rpc_handlers((_generic(),))
    s.start()
    yield channels
    for c in channels:
        c.close()
    s.stop(None)
    pool.shutdown()


def test_a_rich_status_reaches_the_client_with_its_details(server: list[Any]) -> None:
    """`abort_with_status` with grpc-status-details-bin (grpc_status.rpc_status's way): the
    client gets the code and the details under that trailer, where `rpc_status.from_call` looks.
    isthmus's server refused the trailer inside its finish, and the call hung to its deadline."""
    for channel in server:
        with pytest.raises(grpc.RpcError) as caught:
            channel.unary_unary("/users.T/Rich")(b"", timeout=10)
        e = caught.value
        assert (e.code(), e.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "rich"), channel
        trailers = dict(e.trailing_metadata())
        assert trailers["grpc-status-details-bin"] == RICH and trailers["k"] == "v", channel


def test_a_failed_call_keeps_the_initial_metadata_sent_before_the_failure(server: list[Any]) -> None:
    """`RpcError.initial_metadata()` of a unary call whose handler sent initial metadata, then
    aborted: grpcio gives them; isthmus's client gave nothing."""
    for channel in server:
        method = channel.unary_unary("/users.T/HeadThenFail")
        future = method.future
        for way in (method, method.with_call, lambda r, timeout, f=future: f(r, timeout=timeout).result()):
            with pytest.raises(grpc.RpcError) as caught:
                way(b"", timeout=10)
            e = caught.value
            assert (e.code(), e.details()) == (grpc.StatusCode.NOT_FOUND, "after a header"), (channel, way)
            assert ("x-h", "1") in tuple(e.initial_metadata()), (channel, way, e.initial_metadata())


@pytest.mark.parametrize("kind", ["grpc.aio", "isthmus.aio"])
def test_an_asyncio_call_that_failed_keeps_the_initial_metadata_sent_before(kind: str) -> None:
    """As above, from grpc.aio's client to a grpcio server and isthmus.aio's to an isthmus
    server, over shm:// and the socket."""
    pool = futures.ThreadPoolExecutor(2)
    unix = fresh("unix")
    if kind == "grpc.aio":
        s, module, targets = grpc.server(pool), grpc.aio, [grpcio_target(unix)]
        s.add_insecure_port(grpcio_target(unix))
    else:
        shm = fresh("shm")
        s, module, targets = isthmus.server(pool), isthmus.aio, [shm, unix]
        s.add_insecure_port(shm)
        s.add_insecure_port(unix)
    s.add_generic_rpc_handlers((_generic(),))
    s.start()

    async def fail(target: str) -> grpc.aio.AioRpcError:
        async with module.insecure_channel(target) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await channel.unary_unary("/users.T/HeadThenFail")(b"", timeout=10)
            return caught.value

    try:
        for target in targets:
            e = asyncio.run(fail(target))
            assert e.code() == grpc.StatusCode.NOT_FOUND, target
            assert ("x-h", "1") in tuple(e.initial_metadata()), (target, e.initial_metadata())
    finally:
        s.stop(None)
        pool.shutdown()


@pytest.mark.parametrize("kind", ["grpcio", "isthmus", "isthmus.aio"])
def test_an_address_that_cannot_be_bound_raises_RuntimeError(kind: str, tmp_path: Any) -> None:
    """A TCP port another socket holds, and a Unix socket in a directory that is not there:
    grpcio raises RuntimeError, which grpcio users catch; isthmus raised OSError."""
    pool = futures.ThreadPoolExecutor(1)
    server = {
        "grpcio": lambda: grpc.server(pool),
        "isthmus": lambda: isthmus.server(pool),
        "isthmus.aio": isthmus.aio.server,
    }[kind]()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        for address in (f"127.0.0.1:{held.getsockname()[1]}", f"unix:{tmp_path}/not-there/s.sock"):
            with pytest.raises(RuntimeError):
                server.add_insecure_port(address)
    if kind == "isthmus":  # an shm:// name another server serves
        shm = fresh("shm")
        first = isthmus.server(pool)
        first.add_insecure_port(shm)
        try:
            with pytest.raises(RuntimeError) as caught:
                server.add_insecure_port(shm)
            assert isinstance(caught.value, OSError) and shm in str(caught.value)
        finally:
            first.stop(None)
    pool.shutdown()


def test_trailing_metadata_gRPC_reserves_does_not_fail_the_call(server: list[Any]) -> None:
    """A handler's trailer under a `grpc-` key: grpcio sends it; isthmus leaves it out. Either
    way the call succeeds with the rest (isthmus's hung to its deadline)."""
    for channel in server:
        reply, call = channel.unary_unary("/users.T/ReservedTrailer").with_call(b"", timeout=10)
        assert reply == b"ok" and ("k", "v") in call.trailing_metadata(), channel


def test_a_client_may_send_metadata_as_lists_and_with_keys_grpc_sets_itself(server: list[Any]) -> None:
    """Pairs as lists, and `user-agent` among them (as a proxy forwarding what its grpcio
    server received does): grpcio takes both; isthmus raised TypeError and ValueError."""
    for channel in server:
        md = [["x-a", "1"], ("user-agent", "forwarded"), ("x-b", "2")]
        assert channel.unary_unary("/users.T/Metadata")(b"", metadata=md, timeout=10) == b"x-a=1,x-b=2"


def test_trailing_metadata_that_cannot_be_sent_does_not_hold_the_call() -> None:
    """A trailer value that is not printable ASCII: isthmus's call ends with the handler's
    status and reply, without that trailer (logged), at once (it hung to its deadline, 10 s
    here)."""
    pool = futures.ThreadPoolExecutor(2)
    shm = fresh("shm")
    s = isthmus.server(pool)
    s.add_insecure_port(shm)
    s.add_generic_rpc_handlers((_generic(),))
    s.start()
    try:
        with isthmus.insecure_channel(shm) as channel:
            reply, call = channel.unary_unary("/users.T/BadTrailer").with_call(b"", timeout=10)
            assert (reply, call.code(), tuple(call.trailing_metadata())) == (b"ok", grpc.StatusCode.OK, ())
    finally:
        s.stop(None)
        pool.shutdown()


@pytest.mark.parametrize("api", ["grpcio", "isthmus", "grpc.aio", "isthmus.aio"])
@pytest.mark.parametrize("transport", ["unix", "http"])
def test_wait_for_ready_waits_for_a_server_that_starts_later(api: str, transport: str) -> None:
    """A call with wait_for_ready made before its server listens goes through once it does, over
    a Unix socket and TCP (isthmus failed it UNAVAILABLE at once over HTTP/2), and the server is
    told the time left then, not the whole timeout. The server starts a second later; the call
    may wait 30 s."""
    address = fresh(transport)
    if transport == "http":  # a port no one listens on yet, then the server's
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            address = f"http://127.0.0.1:{free.getsockname()[1]}"
    target = address if api.startswith("isthmus") else grpcio_target(address)
    pool = futures.ThreadPoolExecutor(2)
    s = grpc.server(pool)
    s.add_generic_rpc_handlers((_generic(),))

    def listen() -> None:  # nothing listens at the address until now
        s.add_insecure_port(grpcio_target(address))
        s.start()

    starter = threading.Timer(1.0, listen)
    starter.start()
    try:
        if api.endswith("aio"):
            module: Any = grpc.aio if api == "grpc.aio" else isthmus.aio

            async def call() -> bytes:
                async with module.insecure_channel(target) as channel:
                    method = channel.unary_unary("/users.T/Left")
                    return bytes(await method(b"", timeout=30, wait_for_ready=True))

            left = float(asyncio.run(call()))
        else:
            module = grpc if api == "grpcio" else isthmus
            with module.insecure_channel(target) as channel:
                left = float(channel.unary_unary("/users.T/Left")(b"", timeout=30, wait_for_ready=True))
        # A second or more of the 30 went waiting (isthmus told the server 30).
        assert 0 < left < 29.5, left
    finally:
        starter.join()
        s.stop(None)
        pool.shutdown()
