"""What grpcio users write on their first day, found wanting by a probe of isthmus beside
grpcio: each test runs the same code on a grpcio server or channel and on isthmus ones, in
this process, and expects the same result."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import errno
import gc
import os
import queue
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from peer import fresh, grpcio_target, runtime_dir, serve

import isthmus
import isthmus.aio
from isthmus.aio._call import READ_AHEAD_BYTES

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
    if request == b"abort":
        context.abort(grpc.StatusCode.NOT_FOUND, "gone")
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


def _key_value(request: bytes, context: Any) -> bytes:
    context.set_trailing_metadata((("x-t", "2"),))
    pairs = (f"{m.key}={m.value}" for m in context.invocation_metadata() if m.key.startswith("x-"))
    return ",".join(pairs).encode()


def _stream_then_fail(request: bytes, context: Any) -> Iterator[bytes]:
    yield b"one"
    context.abort(grpc.StatusCode.NOT_FOUND, "after a message")


def _until_cancelled(request: bytes, context: Any) -> bytes:
    end = time.monotonic() + 30
    while context.is_active() and time.monotonic() < end:
        time.sleep(0.01)
    return b"not cancelled"


def _head_until_cancelled(request: bytes, context: Any) -> bytes:
    context.send_initial_metadata((("x-h", "1"),))
    return _until_cancelled(request, context)


HANDLERS = {
    "UntilCancelled": _until_cancelled,
    "HeadUntilCancelled": _head_until_cancelled,
    "HeadThenFail": _head_then_fail,
    "KeyValue": _key_value,
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


def test_a_call_without_a_deadline_leaves_its_handler_a_time_far_away(server: list[Any]) -> None:
    """grpcio's `time_remaining()` for a call without a deadline is a float, a very large one,
    so a handler may compare it (`if context.time_remaining() < 1`); isthmus gave None."""
    for channel in server:
        left = float(channel.unary_unary("/users.T/Left")(b""))
        assert left > 1e18, left
        # With one, its time (grpc's reaches the server rounded up a little).
        assert 0 < float(channel.unary_unary("/users.T/Left")(b"", timeout=30)) < 31


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


def test_a_call_past_its_deadline_keeps_the_initial_metadata_sent_before(server: list[Any]) -> None:
    """The same for a blocking unary call that its deadline ends after the handler sent its
    initial metadata: isthmus's blocking client over shm:// gave none (its other ways, and
    every failure the server sends, kept them)."""
    for channel in server:
        with pytest.raises(grpc.RpcError) as caught:
            channel.unary_unary("/users.T/HeadUntilCancelled")(b"", timeout=1)
        e = caught.value
        assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, channel
        assert ("x-h", "1") in tuple(e.initial_metadata()), (channel, e.initial_metadata())


def test_a_method_without_its_leading_slash_is_unimplemented(server: list[Any]) -> None:
    """`channel.unary_unary("users.T/Left")`, the slash forgotten: grpcio sends it, and the
    server answers UNIMPLEMENTED (grpc-go's too). isthmus refused it INVALID_ARGUMENT."""

    def ours(c: Any) -> bool:
        return type(c).__module__.startswith("isthmus")

    for channel in server:
        if any(ours(c) for c in server) and not ours(channel):
            # grpcio's client of isthmus's HTTP/2 server: h2 resets a stream whose :path does not
            # start with '/' (PROTOCOL_ERROR, RFC 9113 8.3.1), as tonic's servers do.
            continue
        for path in ("users.T/Left", "Left"):
            with pytest.raises(grpc.RpcError) as caught:
                channel.unary_unary(path)(b"", timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED, (channel, path, caught.value)
            responses = channel.unary_stream(path)(b"", timeout=10)
            with pytest.raises(grpc.RpcError) as caught:
                list(responses)
            assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED, (channel, path, caught.value)


def _serving_asyncio_clients(
    kind: str, pool: futures.ThreadPoolExecutor, *more: grpc.GenericRpcHandler
) -> tuple[Any, Any, list[str]]:
    """A started blocking server of HANDLERS (and `more`), the asyncio module whose clients
    the test runs, and their targets: grpc.aio's to a grpcio server over a Unix socket;
    isthmus.aio's to an isthmus server over shm:// and the socket."""
    unix = fresh("unix")
    if kind == "grpc.aio":
        s, module, targets = grpc.server(pool), grpc.aio, [grpcio_target(unix)]
        s.add_insecure_port(grpcio_target(unix))
    else:
        shm = fresh("shm")
        s, module, targets = isthmus.server(pool), isthmus.aio, [shm, unix]
        s.add_insecure_port(shm)
        s.add_insecure_port(unix)
    s.add_generic_rpc_handlers((_generic(), *more))
    s.start()
    return s, module, targets


@pytest.mark.parametrize("kind", ["grpc.aio", "isthmus.aio"])
def test_an_asyncio_call_that_failed_keeps_the_initial_metadata_sent_before(kind: str) -> None:
    """As above, from grpc.aio's client to a grpcio server and isthmus.aio's to an isthmus
    server, over shm:// and the socket."""
    pool = futures.ThreadPoolExecutor(2)
    s, module, targets = _serving_asyncio_clients(kind, pool)

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


def _one_then_until_cancelled(request: bytes, context: Any) -> Iterator[bytes]:
    yield b"one"
    _until_cancelled(request, context)


@pytest.mark.parametrize("kind", ["grpcio", "isthmus"])
def test_a_call_past_its_deadline_says_deadline_exceeded(kind: str) -> None:
    """A call whose timeout runs out (a unary call, a stream after its first message) or is
    zero fails DEADLINE_EXCEEDED "Deadline Exceeded" in grpcio's and grpc.aio's clients:
    grpc-core's words, which code compares. isthmus's said "the call's deadline passed", or "the
    call's deadline had passed before it started". grpc's clients to a grpcio server, isthmus's
    to an isthmus server over shm:// and the socket."""
    pool = futures.ThreadPoolExecutor(4)
    streams = {"OneThenUntilCancelled": grpc.unary_stream_rpc_method_handler(_one_then_until_cancelled)}
    more = grpc.method_handlers_generic_handler("users.S", streams)
    s, aio, targets = _serving_asyncio_clients("grpc.aio" if kind == "grpcio" else "isthmus.aio", pool, more)
    blocking: Any = grpc if kind == "grpcio" else isthmus
    want = (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    unary, stream = "/users.T/UntilCancelled", "/users.S/OneThenUntilCancelled"

    def blocking_outcomes(target: str) -> list[Any]:
        seen = []
        with blocking.insecure_channel(target) as channel:
            for timeout in (0.2, 0):
                with pytest.raises(grpc.RpcError) as caught:
                    channel.unary_unary(unary)(b"", timeout=timeout)
                seen.append((caught.value.code(), caught.value.details()))
            got: list[bytes] = []
            with pytest.raises(grpc.RpcError) as caught:
                got.extend(channel.unary_stream(stream)(b"", timeout=0.3))
            assert got in ([], [b"one"]), got  # the first message may come after the deadline
            seen.append((caught.value.code(), caught.value.details()))
        return seen

    async def asyncio_outcomes(target: str) -> list[Any]:
        seen = []
        async with aio.insecure_channel(target) as channel:
            for timeout in (0.2, 0):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await channel.unary_unary(unary)(b"", timeout=timeout)
                seen.append((caught.value.code(), caught.value.details()))
            got = []
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for m in channel.unary_stream(stream)(b"", timeout=0.3):
                    got.append(m)
            assert got in ([], [b"one"]), got
            seen.append((caught.value.code(), caught.value.details()))
        return seen

    try:
        for target in targets:
            assert blocking_outcomes(target) == [want] * 3, target
            assert asyncio.run(asyncio_outcomes(target)) == [want] * 3, target
    finally:
        s.stop(None)
        pool.shutdown()


@pytest.mark.parametrize("kind", ["grpc.aio", "isthmus.aio"])
def test_wait_for_connection_raises_how_the_call_ended(kind: str) -> None:
    """grpc.aio's `wait_for_connection()` waits for a call to be sent, and then, if the call
    is over, raises how it ended: its failure as AioRpcError, CancelledError after its cancel;
    it returns for one that ended OK. isthmus.aio's returned in all three for a unary call, and
    for a stream that failed after it started. From grpc.aio's client to a grpcio server and
    isthmus.aio's to an isthmus server, over shm:// and the socket."""
    pool = futures.ThreadPoolExecutor(2)
    streams = {"StreamThenFail": grpc.unary_stream_rpc_method_handler(_stream_then_fail)}
    s, module, targets = _serving_asyncio_clients(
        kind, pool, grpc.method_handlers_generic_handler("users.S", streams)
    )

    async def calls(target: str) -> None:
        async with module.insecure_channel(target) as channel:
            ok = channel.unary_unary("/users.T/KeyValue")(b"", timeout=10)
            assert await ok.wait_for_connection() is None
            await ok
            failed = channel.unary_unary("/users.T/HeadThenFail")(b"", timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await failed.wait_for_connection()
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND
            cancelled = channel.unary_unary("/users.T/UntilCancelled")(b"", timeout=10)
            assert cancelled.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cancelled.wait_for_connection()
            stream = channel.unary_stream("/users.S/StreamThenFail")(b"", timeout=10)
            assert await stream.read() == b"one"
            with pytest.raises(grpc.aio.AioRpcError):
                await stream.read()
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stream.wait_for_connection()
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND

    try:
        for target in targets:
            asyncio.run(calls(target))
    finally:
        s.stop(None)
        pool.shutdown()


@pytest.mark.parametrize("kind", ["grpc.aio", "isthmus.aio"])
def test_an_asyncio_method_without_its_leading_slash_is_unimplemented(kind: str) -> None:
    """The asyncio side of the test above."""
    pool = futures.ThreadPoolExecutor(2)
    s, module, targets = _serving_asyncio_clients(kind, pool)

    async def run() -> None:
        for target in targets:
            async with module.insecure_channel(target) as channel:
                with pytest.raises(grpc.RpcError) as caught:
                    await channel.unary_unary("users.T/Left")(b"", timeout=10)
                assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED, (target, caught.value)
                call = channel.unary_stream("users.T/Left")(b"", timeout=10)
                with pytest.raises(grpc.RpcError) as caught:
                    [m async for m in call]
                assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED, (target, caught.value)

    try:
        asyncio.run(run())
    finally:
        s.stop(None)
        pool.shutdown()


def _two_then_ok(request: bytes, context: Any) -> Iterator[bytes]:
    yield b"one"
    yield b"two"


def _until_cancelled_stream(request: bytes, context: Any) -> Iterator[bytes]:
    yield _until_cancelled(request, context)


@pytest.mark.parametrize("kind", ["grpc.aio", "isthmus.aio"])
def test_done_callbacks_have_run_when_the_end_is_seen(kind: str) -> None:
    """grpc.aio runs a call's done callbacks as its status comes, and as `cancel()` ends it: a
    reader that saw a stream's end, a stream's failure, or the return of `cancel()`, finds them
    run. isthmus.aio ran a stream's, and a cancelled unary call's, on the loop's next turn."""
    streams = {
        "TwoThenOk": grpc.unary_stream_rpc_method_handler(_two_then_ok),
        "StreamThenFail": grpc.unary_stream_rpc_method_handler(_stream_then_fail),
        "UntilCancelled": grpc.unary_stream_rpc_method_handler(_until_cancelled_stream),
    }
    pool = futures.ThreadPoolExecutor(4)
    s, module, targets = _serving_asyncio_clients(
        kind, pool, grpc.method_handlers_generic_handler("users.S", streams)
    )

    async def calls(target: str) -> list[tuple[str, list[str]]]:
        seen: list[str] = []
        ran: list[tuple[str, list[str]]] = []
        async with module.insecure_channel(target) as channel:
            stream = channel.unary_stream("/users.S/TwoThenOk")(b"", timeout=10)
            stream.add_done_callback(lambda _: seen.append("ok stream"))
            assert [m async for m in stream] == [b"one", b"two"]
            ran.append(("after the stream's last read", list(seen)))
            failing = channel.unary_stream("/users.S/StreamThenFail")(b"", timeout=10)
            failing.add_done_callback(lambda _: seen.append("failed stream"))
            with pytest.raises(grpc.aio.AioRpcError):
                [m async for m in failing]
            ran.append(("after the failure's raise", list(seen)))
            for way in ("unary_unary", "unary_stream"):
                path = "/users.T/UntilCancelled" if way == "unary_unary" else "/users.S/UntilCancelled"
                call = getattr(channel, way)(path)(b"", timeout=10)
                call.add_done_callback(lambda _, way=way: seen.append(f"cancelled {way}"))
                await asyncio.sleep(0.05)  # started (a cancel before the start ends it as well)
                assert call.cancel()
                ran.append((f"after the {way} cancel()", list(seen)))
        return ran

    try:
        for target in targets:
            assert asyncio.run(calls(target)) == [
                ("after the stream's last read", ["ok stream"]),
                ("after the failure's raise", ["ok stream", "failed stream"]),
                ("after the unary_unary cancel()", ["ok stream", "failed stream", "cancelled unary_unary"]),
                (
                    "after the unary_stream cancel()",
                    ["ok stream", "failed stream", "cancelled unary_unary", "cancelled unary_stream"],
                ),
            ], (kind, target)
    finally:
        s.stop(None)
        pool.shutdown()


@pytest.mark.parametrize("kind", ["grpc.aio", "isthmus.aio"])
def test_a_unary_calls_reply_is_deserialized_once(kind: str) -> None:
    """grpc.aio deserializes a unary call's reply once: every await of the call gives that one
    object, and a `code()` asked before the await does not deserialize it again. isthmus.aio's
    deserialized it on every await, and once more after a `code()` asked first. From grpc.aio's
    client to a grpcio server and isthmus.aio's to an isthmus server, over shm:// and the
    socket."""
    pool = futures.ThreadPoolExecutor(2)
    s, module, targets = _serving_asyncio_clients(kind, pool)
    made: list[bytes] = []

    def deserialize(message: bytes) -> list[bytes]:
        made.append(message)
        return [message]

    async def calls(target: str) -> None:
        async with module.insecure_channel(target) as channel:
            method = channel.unary_unary("/users.T/KeyValue", response_deserializer=deserialize)
            asked_first = method(b"", timeout=10)
            assert await asked_first.code() == grpc.StatusCode.OK
            reply = await asked_first
            assert reply == [b""] and await asked_first is reply
            awaited = method(b"", timeout=10)
            reply = await awaited
            assert await awaited is reply
            assert await awaited.code() == grpc.StatusCode.OK

    try:
        for target in targets:
            made.clear()
            asyncio.run(calls(target))
            assert len(made) == 2, (target, made)
    finally:
        s.stop(None)
        pool.shutdown()


# What a handler says beside its success: grpcio's clients show it (`details()` of a call that
# ended OK); percent-encoded on HTTP/2, so a '%' and a non-ASCII character go too.
OK_WORDS = "all went well: 100 % \u2713"


def _ok_unary(request: bytes, context: Any) -> bytes:
    context.set_details(OK_WORDS)
    return request


def _ok_server_stream(request: bytes, context: Any) -> Iterator[bytes]:
    context.set_details(OK_WORDS)
    yield request


def _ok_client_stream(requests: Iterator[bytes], context: Any) -> bytes:
    context.set_details(OK_WORDS)
    return b"".join(requests)


def _ok_bidi(requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
    context.set_details(OK_WORDS)
    yield from requests


async def _ok_unary_aio(request: bytes, context: Any) -> bytes:
    context.set_details(OK_WORDS)
    return request


async def _ok_server_stream_aio(request: bytes, context: Any) -> Any:
    context.set_details(OK_WORDS)
    yield request


async def _ok_client_stream_aio(requests: Any, context: Any) -> bytes:
    context.set_details(OK_WORDS)
    return b"".join([r async for r in requests])


async def _ok_bidi_aio(requests: Any, context: Any) -> Any:
    context.set_details(OK_WORDS)
    async for r in requests:
        yield r


def _ok_words(aio: bool) -> grpc.GenericRpcHandler:
    """/users.Ok/{U,S,C,B}: the four shapes, each ending OK with OK_WORDS."""
    u, s, c, b = (
        (_ok_unary_aio, _ok_server_stream_aio, _ok_client_stream_aio, _ok_bidi_aio)
        if aio
        else (_ok_unary, _ok_server_stream, _ok_client_stream, _ok_bidi)
    )
    return grpc.method_handlers_generic_handler(
        "users.Ok",
        {
            "U": grpc.unary_unary_rpc_method_handler(u),
            "S": grpc.unary_stream_rpc_method_handler(s),
            "C": grpc.stream_unary_rpc_method_handler(c),
            "B": grpc.stream_stream_rpc_method_handler(b),
        },
    )


def _ok_details_blocking(channel: Any) -> list[str]:
    """`details()` of each shape's call, made as grpcio's users make them."""
    seen = []
    _, call = channel.unary_unary("/users.Ok/U").with_call(b"a", timeout=10)
    seen.append(call.details())
    future = channel.unary_unary("/users.Ok/U").future(b"a", timeout=10)
    assert future.result() == b"a"
    seen.append(future.details())
    responses = channel.unary_stream("/users.Ok/S")(b"a", timeout=10)
    assert list(responses) == [b"a"]
    seen.append(responses.details())
    _, call = channel.stream_unary("/users.Ok/C").with_call(iter([b"a", b"b"]), timeout=10)
    seen.append(call.details())
    responses = channel.stream_stream("/users.Ok/B")(iter([b"a"]), timeout=10)
    assert list(responses) == [b"a"]
    seen.append(responses.details())
    return seen


async def _ok_details_asyncio(channel: Any) -> list[str]:
    seen = []
    call = channel.unary_unary("/users.Ok/U")(b"a", timeout=10)
    assert await call == b"a"
    seen.append(await call.details())
    call = channel.unary_stream("/users.Ok/S")(b"a", timeout=10)
    assert [m async for m in call] == [b"a"]
    seen.append(await call.details())
    call = channel.stream_unary("/users.Ok/C")(iter([b"a", b"b"]), timeout=10)
    assert await call == b"ab"
    seen.append(await call.details())
    call = channel.stream_stream("/users.Ok/B")(iter([b"a"]), timeout=10)
    assert [m async for m in call] == [b"a"]
    seen.append(await call.details())
    return seen


@pytest.mark.parametrize("kind", ["grpcio", "isthmus", "grpc.aio", "isthmus.aio"])
def test_an_ok_status_keeps_the_details_its_handler_set(kind: str) -> None:
    """A handler that sets details and succeeds: grpcio's and grpc.aio's clients read them in
    `details()`, for every shape. isthmus sent none over HTTP/2 when the call ended through the
    engine's task, and its clients dropped those of an OK status whatever the transport."""
    if kind in ("grpcio", "isthmus"):
        pool = futures.ThreadPoolExecutor(4)
        unix = fresh("unix")
        s: Any = (grpc.server if kind == "grpcio" else isthmus.server)(pool)
        s.add_generic_rpc_handlers((_ok_words(aio=False),))
        s.add_insecure_port(grpcio_target(unix))
        if kind == "grpcio":
            module, targets = grpc.aio, [grpcio_target(unix)]
            channels = [grpc.insecure_channel(grpcio_target(unix))]
        else:
            shm = fresh("shm")
            s.add_insecure_port(shm)
            module, targets = isthmus.aio, [shm, unix]
            # grpcio's own client too: what an isthmus server sends over HTTP/2.
            channels = [isthmus.insecure_channel(shm), isthmus.insecure_channel(unix)]
            channels.append(grpc.insecure_channel(grpcio_target(unix)))
        s.start()
        try:
            for channel in channels:
                with channel:
                    assert _ok_details_blocking(channel) == [OK_WORDS] * 5, (kind, channel)

            async def asyncio_clients() -> None:
                for target in targets:
                    async with module.insecure_channel(target) as channel:
                        assert await _ok_details_asyncio(channel) == [OK_WORDS] * 4, (kind, target)

            asyncio.run(asyncio_clients())
        finally:
            s.stop(None)
            pool.shutdown()
        return

    module = grpc.aio if kind == "grpc.aio" else isthmus.aio

    async def asyncio_server() -> None:
        unix = fresh("unix")
        targets = [grpcio_target(unix)] + ([] if kind == "grpc.aio" else [fresh("shm")])
        server = module.server()
        server.add_generic_rpc_handlers((_ok_words(aio=True),))
        for target in targets:
            server.add_insecure_port(target)
        await server.start()
        try:
            for target in targets:
                async with module.insecure_channel(target) as channel:
                    assert await _ok_details_asyncio(channel) == [OK_WORDS] * 4, (kind, target)
        finally:
            await server.stop(None)

    asyncio.run(asyncio_server())


def _trailers_only(request: bytes, context: Any) -> Iterator[bytes]:
    context.set_details(OK_WORDS)
    context.set_trailing_metadata((("x-trailer", "t"),))
    return iter(())


def test_a_trailers_only_ok_end_keeps_its_details_and_gives_its_fields_as_trailers() -> None:
    """grpcio's server answers a stream that sends nothing with one HEADERS frame that ends it
    (trailers-only). Its fields are the call's trailing metadata and there is no initial
    metadata, in grpcio's and grpc.aio's clients. isthmus's lost the details and gave the fields
    as initial metadata."""
    pool = futures.ThreadPoolExecutor(2)
    unix = fresh("unix")
    s = grpc.server(pool)
    methods = {"S": grpc.unary_stream_rpc_method_handler(_trailers_only)}
    s.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("users.Ok", methods),))
    s.add_insecure_port(grpcio_target(unix))
    s.start()
    want = (OK_WORDS, [], [("x-trailer", "t")])
    try:
        for module in (grpc, isthmus):
            with module.insecure_channel(grpcio_target(unix)) as channel:
                call = channel.unary_stream("/users.Ok/S")(b"a", timeout=10)
                assert list(call) == []
                got = (call.details(), list(call.initial_metadata()), list(call.trailing_metadata()))
                assert got == want, module.__name__

        async def asyncio_clients() -> None:
            for module in (grpc.aio, isthmus.aio):
                async with module.insecure_channel(grpcio_target(unix)) as channel:
                    call = channel.unary_stream("/users.Ok/S")(b"a", timeout=10)
                    assert [m async for m in call] == []
                    initial, trailing = await call.initial_metadata(), await call.trailing_metadata()
                    got = (await call.details(), list(initial), list(trailing))
                    assert got == want, module.__name__

        asyncio.run(asyncio_clients())
    finally:
        s.stop(None)
        pool.shutdown()


def _returns_nothing(request: bytes, context: Any) -> None:
    return None


def _yields_then_nothing(request: bytes, context: Any) -> Iterator[bytes | None]:
    yield b"a"
    yield None
    yield b"b"


def _yields_then_raises(request: bytes, context: Any) -> Iterator[bytes]:
    yield b"a"
    raise ValueError("boom")


def _raises(request: bytes, context: Any) -> bytes:
    raise ValueError("boom")


async def _returns_nothing_aio(request: bytes, context: Any) -> None:
    return None


async def _yields_then_nothing_aio(request: bytes, context: Any) -> AsyncIterator[bytes | None]:
    yield b"a"
    yield None


async def _yields_then_raises_aio(request: bytes, context: Any) -> AsyncIterator[bytes]:
    yield b"a"
    raise ValueError("boom")


async def _raises_aio(request: bytes, context: Any) -> bytes:
    raise ValueError("boom")


async def _details_then_raises_aio(request: bytes, context: Any) -> bytes:
    context.set_details("mine")
    raise ValueError("boom")


def _serialized(response: Any) -> bytes:
    return response.SerializeToString()  # type: ignore[no-any-return]


def _careless(aio: bool) -> grpc.GenericRpcHandler:
    """/users.Careless/{Nothing,NothingInStream,RaiseInStream,Raise}: handlers that return
    None where a message belongs, or raise; each of the asyncio server's plain ones too."""
    unary, stream = grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler
    methods = {
        "Nothing": unary(_returns_nothing),
        "NothingInStream": stream(_yields_then_nothing),
        "RaiseInStream": stream(_yields_then_raises),
        "Raise": unary(_raises),
    }
    if aio:
        methods["PlainNothing"], methods["PlainRaiseInStream"] = methods["Nothing"], methods["RaiseInStream"]
        methods.update(
            Nothing=unary(_returns_nothing_aio),
            NothingInStream=stream(_yields_then_nothing_aio),
            RaiseInStream=stream(_yields_then_raises_aio),
            Raise=unary(_raises_aio),
            DetailsThenRaise=unary(_details_then_raises_aio),
            # A protobuf serializer given a handler's None (a forgotten `return`).
            Unserializable=unary(_returns_nothing_aio, response_serializer=_serialized),
        )
    return grpc.method_handlers_generic_handler("users.Careless", methods)


def _outcomes(channel: Any, methods: Iterable[str]) -> dict[str, Any]:
    """Each method's replies, or its failure's code and details, as a blocking client sees them."""
    seen: dict[str, Any] = {}
    for method in methods:
        path = f"/users.Careless/{method}"
        try:
            if "Stream" in method:
                seen[method] = list(channel.unary_stream(path)(b"", timeout=10))
            else:
                seen[method] = channel.unary_unary(path)(b"", timeout=10)
        except grpc.RpcError as e:
            seen[method] = (e.code(), e.details())
    return seen


@pytest.mark.parametrize("kind", ["grpcio", "isthmus"])
def test_a_blocking_handler_that_returns_nothing_or_raises_while_iterated(kind: str) -> None:
    """grpcio's server ends a unary call whose handler returned None INTERNAL "Failed to
    serialize response!" (isthmus's ended it OK with no message: grpcio's client got None), ends
    a stream at a None it yields, and says "Exception iterating responses" for an exception its
    iteration raised (isthmus said "Exception calling application")."""
    pool = futures.ThreadPoolExecutor(2)
    unix = fresh("unix")
    s: Any = (grpc.server if kind == "grpcio" else isthmus.server)(pool)
    s.add_generic_rpc_handlers((_careless(aio=False),))
    s.add_insecure_port(grpcio_target(unix))
    channels = [grpc.insecure_channel(grpcio_target(unix))]
    if kind == "isthmus":
        shm = fresh("shm")
        s.add_insecure_port(shm)
        channels += [isthmus.insecure_channel(shm), isthmus.insecure_channel(unix)]
    s.start()
    want = {
        "Nothing": (grpc.StatusCode.INTERNAL, "Failed to serialize response!"),
        "NothingInStream": [b"a"],
        "RaiseInStream": (grpc.StatusCode.UNKNOWN, "Exception iterating responses: boom"),
        "Raise": (grpc.StatusCode.UNKNOWN, "Exception calling application: boom"),
    }
    try:
        for channel in channels:
            with channel:
                assert _outcomes(channel, want) == want, channel
    finally:
        s.stop(None)
        pool.shutdown()


@pytest.mark.parametrize("kind", ["grpc.aio", "isthmus.aio"])
def test_an_asyncio_handler_that_returns_nothing_or_raises(kind: str) -> None:
    """grpc.aio's server sends a handler's None as an empty message, and words a handler's
    exception "Unexpected <class '…'>: …", for coroutines and plain handlers alike, also one
    that set its details first and a serializer's. isthmus.aio's failed a None UNKNOWN and used
    the blocking server's words (and its INTERNAL for a serializer's)."""
    module = grpc.aio if kind == "grpc.aio" else isthmus.aio
    pool = futures.ThreadPoolExecutor(2)
    unix = fresh("unix")
    targets = [grpcio_target(unix)] + ([] if kind == "grpc.aio" else [fresh("shm")])
    unexpected = (grpc.StatusCode.UNKNOWN, "Unexpected <class 'ValueError'>: boom")
    want = {
        "Nothing": b"",
        "PlainNothing": b"",
        "NothingInStream": [b"a", b""],
        "RaiseInStream": unexpected,
        "PlainRaiseInStream": unexpected,
        "Raise": unexpected,
        "DetailsThenRaise": unexpected,
        "Unserializable": (
            grpc.StatusCode.UNKNOWN,
            "Unexpected <class 'AttributeError'>: 'NoneType' object has no attribute 'SerializeToString'",
        ),
    }

    async def serve() -> None:
        server = module.server(migration_thread_pool=pool)
        server.add_generic_rpc_handlers((_careless(aio=True),))
        for target in targets:
            server.add_insecure_port(target)
        await server.start()
        loop = asyncio.get_running_loop()
        try:
            for target in targets:
                # grpcio's client over the socket; isthmus's over both, to an isthmus server.
                clients = [grpc.insecure_channel(target)] if target.startswith("unix") else []
                if kind == "isthmus.aio":
                    clients.append(isthmus.insecure_channel(target))
                for channel in clients:
                    with channel:
                        seen = await loop.run_in_executor(None, _outcomes, channel, want)
                    assert seen == want, (target, channel)
        finally:
            await server.stop(None)

    asyncio.run(serve())
    pool.shutdown()


@pytest.mark.parametrize("kind", ["grpcio", "isthmus", "isthmus.aio"])
def test_an_address_that_cannot_be_bound_raises_RuntimeError(kind: str, tmp_path: Any) -> None:
    """A TCP port another socket holds, a Unix socket in a directory that is not there, and an
    address that does not parse: grpcio raises RuntimeError, which grpcio users catch; isthmus
    raised OSError, and ValueError for the last."""
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
    # Addresses that do not parse: RuntimeError too (isthmus raised ValueError only; it is
    # both now).
    for address in (":0", "bogus://x"):
        with pytest.raises(RuntimeError) as malformed:
            server.add_insecure_port(address)
        assert kind == "grpcio" or isinstance(malformed.value, ValueError), malformed.value
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


@pytest.mark.parametrize("kind", ["grpcio", "isthmus"])
def test_a_stop_before_start_does_nothing_and_a_second_start_raises_valueerror(
    kind: str, tmp_path: Any
) -> None:
    """grpcio's stop of a server not yet started does nothing: its event is set, and a start
    after it serves. isthmus closed the ports then and refused the start ('the server was
    already started'). A start of a server that has started raises ValueError in grpcio;
    isthmus raised RuntimeError (it is both now)."""
    pool = futures.ThreadPoolExecutor(2)
    module: Any = grpc if kind == "grpcio" else isthmus
    server = module.server(pool)
    server.add_generic_rpc_handlers((_answering(b"served"),))
    port = server.add_insecure_port("127.0.0.1:0")
    targets = [f"127.0.0.1:{port}", f"unix:{tmp_path}/s.sock"]
    server.add_insecure_port(targets[1])
    assert server.stop(None).is_set()
    server.start()
    try:
        for target in targets:
            with module.insecure_channel(target) as channel:
                assert channel.unary_unary("/t.Port/Who")(b"", timeout=10) == b"served", target
        with pytest.raises(ValueError):
            server.start()
    finally:
        assert server.stop(None).wait(10)
    with pytest.raises(ValueError):
        server.start()  # once stopped, a server does not start again
    pool.shutdown()


@pytest.mark.parametrize("kind", ["grpc.aio", "isthmus.aio"])
def test_an_asyncio_stop_before_start_does_nothing_and_a_second_start_is_ignored(
    kind: str, tmp_path: Any
) -> None:
    """The same with grpc.aio: a stop before the start does nothing (isthmus.aio closed the
    ports and refused the start), a start of a serving server is ignored (isthmus.aio raised),
    and a start after the stop raises."""
    module: Any = grpc.aio if kind == "grpc.aio" else isthmus.aio

    async def run() -> None:
        server = module.server()
        server.add_generic_rpc_handlers((_answering(b"served"),))
        port = server.add_insecure_port("127.0.0.1:0")
        targets = [f"127.0.0.1:{port}", f"unix:{tmp_path}/s.sock"]
        server.add_insecure_port(targets[1])
        await server.stop(None)
        await server.start()
        try:
            await server.start()
            for target in targets:
                async with module.insecure_channel(target) as channel:
                    assert await channel.unary_unary("/t.Port/Who")(b"", timeout=10) == b"served", target
        finally:
            await server.stop(None)
        with pytest.raises(grpc.aio.UsageError):
            await server.start()

    asyncio.run(run())


def _answering(name: bytes) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        "t.Port", {"Who": grpc.unary_unary_rpc_method_handler(lambda request, context: name)}
    )


@pytest.mark.parametrize("kind", ["grpcio", "isthmus", "isthmus.aio"])
def test_servers_share_a_tcp_port_unless_so_reuseport_is_off(kind: str) -> None:
    """grpcio binds TCP ports with SO_REUSEPORT unless `grpc.so_reuseport` is 0: a second
    server (of this process or another) binds a port the first serves, and serves it once the
    first has stopped; with the option 0 that bind raises RuntimeError. isthmus refused the
    second bind (the port was in use)."""
    pool = futures.ThreadPoolExecutor(2)

    def server(name: bytes, options: list[tuple[str, Any]] | None = None) -> Any:
        if kind == "grpcio":
            return grpc.server(pool, handlers=[_answering(name)], options=options)
        if kind == "isthmus":
            return isthmus.server(pool, handlers=[_answering(name)], options=options)
        return isthmus.aio.server(options=options)

    first = server(b"first")
    port = first.add_insecure_port("127.0.0.1:0")
    second = server(b"second")
    assert second.add_insecure_port(f"127.0.0.1:{port}") == port
    with pytest.raises(RuntimeError):
        server(b"third", [("grpc.so_reuseport", 0)]).add_insecure_port(f"127.0.0.1:{port}")
    if kind != "isthmus.aio":  # bound only: an asyncio server starts on a loop
        first.start()
        second.start()
        first.stop(None).wait()
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                assert channel.unary_unary("/t.Port/Who")(b"", timeout=30) == b"second"
        finally:
            second.stop(None)
    pool.shutdown()


def _read_then_head(requests: Iterator[bytes], context: Any) -> bytes:
    first = next(requests)
    context.send_initial_metadata((("x-first", first.decode()),))
    return b"%d" % (1 + sum(1 for _ in requests))


async def _read_then_head_aio(requests: Any, context: Any) -> bytes:
    first = await context.read()
    await context.send_initial_metadata((("x-first", first.decode()),))
    n = 1
    while await context.read() is not grpc.aio.EOF:
        n += 1
    return b"%d" % n


@contextlib.contextmanager
def _blocking_server(kind: str, generic: grpc.GenericRpcHandler) -> Iterator[Any]:
    """A blocking server of `kind` (grpcio's or isthmus's) with `generic`, and a channel of the
    same kind to it, closed and stopped after."""
    address = fresh("shm") if kind == "isthmus" else grpcio_target(fresh("unix"))
    pool = futures.ThreadPoolExecutor(4)
    s = (grpc.server if kind == "grpcio" else isthmus.server)(pool)
    s.add_generic_rpc_handlers((generic,))
    s.add_insecure_port(address)
    s.start()
    try:
        with (grpc if kind == "grpcio" else isthmus).insecure_channel(address) as channel:
            yield channel
    finally:
        s.stop(None)
        pool.shutdown()


@pytest.mark.parametrize("kind", ["grpcio", "isthmus", "grpc.aio", "isthmus.aio"])
def test_a_handler_sends_initial_metadata_after_a_read_that_waited(kind: str) -> None:
    """A request-streaming handler that reads its first request (authenticating by it, say),
    then sends initial metadata: its read waits for the request. grpcio and grpc.aio send the
    metadata; isthmus had sent empty metadata when the read began to wait, and refused them
    ("Initial metadata no longer allowed!")."""
    aio = kind.endswith("aio")
    address = fresh("shm") if kind.startswith("isthmus") else grpcio_target(fresh("unix"))
    behaviour = _read_then_head_aio if aio else _read_then_head
    generic = grpc.method_handlers_generic_handler(
        "users.S", {"ReadThenHead": grpc.stream_unary_rpc_method_handler(behaviour)}
    )

    def later() -> Iterator[bytes]:
        time.sleep(0.2)  # the handler's read waits meanwhile
        yield b"alice"
        yield b"more"

    if not aio:
        with _blocking_server(kind, generic) as channel:
            reply, call = channel.stream_unary("/users.S/ReadThenHead").with_call(later(), timeout=10)
            assert (reply, tuple(call.initial_metadata())) == (b"2", (("x-first", "alice"),)), kind
        return

    module: Any = grpc.aio if kind == "grpc.aio" else isthmus.aio

    async def run() -> tuple[bytes, Any]:
        s = module.server()
        s.add_generic_rpc_handlers((generic,))
        s.add_insecure_port(address)
        await s.start()
        try:
            async with module.insecure_channel(address) as channel:

                async def requests() -> Any:
                    await asyncio.sleep(0.2)
                    yield b"alice"
                    yield b"more"

                call = channel.stream_unary("/users.S/ReadThenHead")(requests(), timeout=10)
                return await call, tuple(await call.initial_metadata())
        finally:
            await s.stop(None)

    assert asyncio.run(run()) == (b"2", (("x-first", "alice"),)), kind


def _head_then_echo(requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
    context.send_initial_metadata((("x-ready", "1"),))
    yield from requests


@pytest.mark.parametrize("kind", ["grpcio", "isthmus"])
def test_initial_metadata_come_while_another_thread_waits_for_a_message(kind: str) -> None:
    """A bidirectional stream's client reads on one thread and, on another, waits for the
    server's initial metadata (its "ready") before it sends: grpcio gives the metadata as they
    come. isthmus gave them only once the reading thread had its message, which never came."""
    generic = grpc.method_handlers_generic_handler(
        "users.S", {"HeadThenEcho": grpc.stream_stream_rpc_method_handler(_head_then_echo)}
    )
    go = threading.Event()

    def requests() -> Iterator[bytes]:
        go.wait(20)
        yield b"after the headers"

    try:
        with _blocking_server(kind, generic) as channel:
            call = channel.stream_stream("/users.S/HeadThenEcho")(requests(), timeout=30)
            received: list[bytes] = []
            reader = threading.Thread(target=lambda: received.extend(call))
            reader.start()
            time.sleep(0.1)  # the reader waits in its first read by now, most likely
            headers: list[Any] = []
            asker = threading.Thread(target=lambda: headers.extend(call.initial_metadata()), daemon=True)
            asker.start()
            asker.join(10)
            got = tuple(headers)
            go.set()
            reader.join(20)
            assert (got, received) == ((("x-ready", "1"),), [b"after the headers"]), kind
    finally:
        go.set()


async def _ready_then_count(requests: Any, context: Any) -> bytes:
    await context.send_initial_metadata((("x-ready", "1"),))
    n = 0
    async for _ in requests:
        n += 1
    return b"%d" % n


async def _ready_then_echo(requests: Any, context: Any) -> AsyncIterator[bytes]:
    await context.send_initial_metadata((("x-ready", "1"),))
    async for request in requests:
        yield request


async def _flood(request: bytes, context: Any) -> AsyncIterator[bytes]:
    for _ in range(4000):  # 250 MiB, far more than any read-ahead should hold
        yield b"x" * 65536


async def _fail_at_once(request: bytes, context: Any) -> AsyncIterator[bytes]:
    await context.abort(grpc.StatusCode.NOT_FOUND, "nothing here")
    yield b""  # a generator, as a streaming handler


async def _rich_aio(request: bytes, context: Any) -> bytes:
    await context.abort_with_status(
        RichStatus(grpc.StatusCode.INVALID_ARGUMENT, "rich", (("grpc-status-details-bin", RICH), ("k", "v")))
    )
    raise AssertionError("abort_with_status returned")


async def _details_then_abort(request: bytes, context: Any) -> bytes:
    context.set_details("quota")
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED)
    raise AssertionError("abort returned")


async def _late_compression(request: bytes, context: Any) -> AsyncIterator[bytes]:
    yield b"first"  # the initial metadata go with it
    try:
        context.set_compression(grpc.Compression.Gzip)
    except RuntimeError as e:
        yield str(e).encode()


def _picky(message: bytes) -> bytes:
    if message == b"bad":
        raise ValueError("not a request")
    return message


async def _count_or_refuse(requests: Any, context: Any) -> bytes:
    n = 0
    try:
        async for _ in requests:
            n += 1
    except ValueError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad: {e}")
    return b"%d" % n


def _plain_twice_abort(request: bytes, context: Any) -> bytes:
    try:
        context.abort(grpc.StatusCode.NOT_FOUND, "missing")
    except Exception as e:
        context.abort(grpc.StatusCode.INTERNAL, f"wrapped: {e}")
    return b"returned"  # grpc.aio's plain abort returns


async def _two(request: bytes, context: Any) -> AsyncIterator[bytes]:
    yield b"1"
    yield b"2"


_ENDINGS: dict[str, str] = {}


async def _echo_recording(requests: Any, context: Any) -> AsyncIterator[bytes]:
    key = dict(context.invocation_metadata())["x-key"]
    try:
        async for request in requests:
            yield request
        _ENDINGS[key] = "ended"
    except asyncio.CancelledError:
        _ENDINGS[key] = "CancelledError"
        raise
    except BaseException as e:
        _ENDINGS[key] = type(e).__name__
        raise


_AIO_USERS = grpc.method_handlers_generic_handler(
    "users.A",
    {
        "ReadyThenCount": grpc.stream_unary_rpc_method_handler(_ready_then_count),
        "ReadyThenEcho": grpc.stream_stream_rpc_method_handler(_ready_then_echo),
        "Flood": grpc.unary_stream_rpc_method_handler(_flood),
        "EchoRecording": grpc.stream_stream_rpc_method_handler(_echo_recording),
        "FailAtOnce": grpc.unary_stream_rpc_method_handler(_fail_at_once),
        "Two": grpc.unary_stream_rpc_method_handler(_two),
        "Rich": grpc.unary_unary_rpc_method_handler(_rich_aio),
        "DetailsThenAbort": grpc.unary_unary_rpc_method_handler(_details_then_abort),
        "LateCompression": grpc.unary_stream_rpc_method_handler(_late_compression),
        "PlainTwiceAbort": grpc.unary_unary_rpc_method_handler(_plain_twice_abort),
        "CountOrRefuse": grpc.stream_unary_rpc_method_handler(_count_or_refuse, request_deserializer=_picky),
    },
)


def _on_aio_server(kind: str, body: Callable[[Any], Awaitable[Any]]) -> Any:
    """`body(channel)` on an asyncio server of `kind` with `_AIO_USERS`, and its channel."""
    module: Any = grpc.aio if kind == "grpc.aio" else isthmus.aio
    address = fresh("shm") if kind == "isthmus.aio" else grpcio_target(fresh("unix"))

    async def run() -> Any:
        s = module.server()
        s.add_generic_rpc_handlers((_AIO_USERS,))
        s.add_insecure_port(address)
        await s.start()
        try:
            async with module.insecure_channel(address) as channel:
                return await body(channel)
        finally:
            await s.stop(None)

    return asyncio.run(run())


@pytest.mark.parametrize("kind", ["grpc.aio", "isthmus.aio"])
def test_an_asyncio_streams_initial_metadata_come_before_a_write_and_beside_a_read(kind: str) -> None:
    """A client-streaming client awaits the server's initial metadata (its "ready") before it
    writes, and a bidirectional one awaits them while a read waits for a message: grpc.aio
    gives them as they come. isthmus.aio waited behind the read (its own, for the one
    response of a client stream), which waited for a write that never came."""

    async def body(channel: Any) -> Any:
        upload = channel.stream_unary("/users.A/ReadyThenCount")(timeout=20)
        ready = tuple(await asyncio.wait_for(upload.initial_metadata(), 10))
        await upload.write(b"a")
        await upload.done_writing()
        chat = channel.stream_stream("/users.A/ReadyThenEcho")(timeout=20)
        reading = asyncio.ensure_future(chat.read())
        await asyncio.sleep(0.1)  # the read waits by now, most likely
        chat_ready = tuple(await asyncio.wait_for(chat.initial_metadata(), 10))
        await chat.write(b"b")
        await chat.done_writing()
        return ready, await upload, chat_ready, await reading, await chat.read() is grpc.aio.EOF

    ready = (("x-ready", "1"),)
    assert _on_aio_server(kind, body) == (ready, b"1", ready, b"b", True), kind


@pytest.mark.parametrize("kind", ["grpc.aio", "isthmus.aio"])
def test_an_asyncio_handler_aborts_with_a_status_and_keeps_the_details_it_set(kind: str) -> None:
    """As grpc.aio's: `await context.abort_with_status(status)` (grpc_status's rich errors)
    sends its code, details and trailers (isthmus.aio's context had no such method: UNKNOWN,
    AttributeError), and an `abort(code)` with no details sends those set before (isthmus.aio
    sent none)."""

    async def body(channel: Any) -> Any:
        seen = []
        for method in ("Rich", "DetailsThenAbort"):
            try:
                await channel.unary_unary(f"/users.A/{method}")(b"", timeout=20)
            except grpc.aio.AioRpcError as e:
                trailers = dict(list(e.trailing_metadata() or ()))
                seen.append(
                    (e.code(), e.details(), trailers.get("grpc-status-details-bin"), trailers.get("k"))
                )
        return seen

    assert _on_aio_server(kind, body) == [
        (grpc.StatusCode.INVALID_ARGUMENT, "rich", RICH, "v"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "quota", None, None),
    ], kind


async def _aio_failure(call: Awaitable[Any]) -> tuple[grpc.StatusCode, str] | None:
    """The code and details an awaited asyncio call failed with; None if it succeeded."""
    try:
        await call
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details()
    return None


@pytest.mark.parametrize("kind", ["grpc.aio", "isthmus.aio"])
def test_an_asyncio_handler_hears_of_a_request_that_does_not_deserialize(kind: str) -> None:
    """As grpc.aio's: a request whose deserializer raises raises that exception in the
    handler's read, which may catch it and abort in its own words. isthmus.aio aborted the
    call itself (the handler saw an AbortError, and its own abort was refused)."""

    async def body(channel: Any) -> Any:
        return await _aio_failure(
            channel.stream_unary("/users.A/CountOrRefuse")(iter([b"a", b"bad"]), timeout=20)
        )

    assert _on_aio_server(kind, body) == (grpc.StatusCode.INVALID_ARGUMENT, "bad: not a request"), kind


@pytest.mark.parametrize("kind", ["grpc.aio", "isthmus.aio"])
def test_a_plain_handlers_abort_on_the_asyncio_server_ends_the_call_at_once(kind: str) -> None:
    """A plain (not async) handler on the asyncio server whose `except` around an abort aborts
    again: grpc.aio's first abort sent its status there and then, and the client gets it.
    isthmus.aio only recorded it, and the second abort's replaced it."""

    async def body(channel: Any) -> Any:
        return await _aio_failure(channel.unary_unary("/users.A/PlainTwiceAbort")(b"", timeout=20))

    assert _on_aio_server(kind, body) == (grpc.StatusCode.NOT_FOUND, "missing"), kind


@pytest.mark.parametrize("kind", ["grpc.aio", "isthmus.aio"])
def test_an_asyncio_handler_sets_compression_before_its_initial_metadata_or_hears_of_it(kind: str) -> None:
    """As grpc.aio's: `set_compression` once the initial metadata went raises RuntimeError
    (isthmus.aio's said nothing, and the replies went on uncompressed)."""

    async def body(channel: Any) -> Any:
        return [m async for m in channel.unary_stream("/users.A/LateCompression")(b"", timeout=20)]

    assert _on_aio_server(kind, body) == [
        b"first",
        b"Compression setting must be specified before sending initial metadata",
    ], kind


@pytest.mark.parametrize("kind", ["grpc.aio", "isthmus.aio"])
def test_an_asyncio_stream_nobody_reads_to_its_end_is_done_when_its_server_ends_it(kind: str) -> None:
    """As grpc.aio's: a response stream its server ended is `done()`, and runs its done
    callbacks, with no read of its end: one that failed before any response, and one whose
    responses were all read (isthmus.aio's stayed undone, and a `cancel()` of them said
    CANCELLED). One flooding responses nobody reads stays undone, its read-ahead bounded."""

    async def body(channel: Any) -> Any:
        failed = channel.unary_stream("/users.A/FailAtOnce")(b"", timeout=20)
        ended = asyncio.Event()
        failed.add_done_callback(lambda _call: ended.set())
        await asyncio.wait_for(ended.wait(), 10)
        first = (failed.done(), failed.cancel(), await failed.code())
        two = channel.unary_stream("/users.A/Two")(b"", timeout=20)
        got = [await two.read(), await two.read()]
        for _ in range(1000):
            if two.done():
                break
            await asyncio.sleep(0.01)
        second = (got, two.done(), two.cancel(), await two.code())
        flood = channel.unary_stream("/users.A/Flood")(b"", timeout=20)
        undone = flood.done()
        await asyncio.sleep(0.5)
        held = sum(len(m) for m in getattr(flood, "_early", ()))
        flood.cancel()
        return first, second, (undone, held <= READ_AHEAD_BYTES + 65536)

    assert _on_aio_server(kind, body) == (
        (True, False, grpc.StatusCode.NOT_FOUND),
        ([b"1", b"2"], True, False, grpc.StatusCode.OK),
        (False, True),
    ), kind


@pytest.mark.parametrize("kind", ["grpc.aio", "isthmus.aio"])
def test_a_status_awaited_while_a_slow_reader_reads_holds_a_bounded_read_ahead(kind: str) -> None:
    """`code()` awaited while the caller reads a stream slowly: grpc.aio holds what its flow
    control lets in. isthmus.aio read the whole stream ahead into memory for the status
    (8,406 messages of 64 KiB, 584 MB, in the second a review measured)."""

    async def body(channel: Any) -> Any:
        call = channel.unary_stream("/users.A/Flood")(b"", timeout=60)
        status = asyncio.ensure_future(call.code())
        got = 0
        held = 0
        for _ in range(20):
            got += len(await call.read())
            await asyncio.sleep(0.02)
            held = max(held, sum(len(m) for m in getattr(call, "_early", ())))
        call.cancel()
        code = await status
        return got, held <= READ_AHEAD_BYTES + 65536, code

    assert _on_aio_server(kind, body) == (20 * 65536, True, grpc.StatusCode.CANCELLED), kind


@pytest.mark.parametrize("kind", ["grpc.aio", "isthmus.aio"])
def test_an_asyncio_handler_whose_client_cancels_is_cancelled_not_failed(kind: str) -> None:
    """A bidirectional handler reading its requests when its client cancels: grpc.aio ends
    the handler's loop or cancels its task; its read never raises an RpcError. isthmus.aio's
    read raised RpcError(CANCELLED), and the handler's `except CancelledError` never ran."""

    async def body(channel: Any) -> list[str]:
        seen = []
        for round in range(10):
            key = f"{kind}-{round}"
            call = channel.stream_stream("/users.A/EchoRecording")(metadata=(("x-key", key),))
            await call.write(b"a")
            await call.read()  # the handler waits for the next request now
            call.cancel()
            for _ in range(1000):
                if key in _ENDINGS:
                    break
                await asyncio.sleep(0.01)
            seen.append(_ENDINGS.pop(key, "nothing in 10 s"))
        return seen

    seen = _on_aio_server(kind, body)
    assert all(s in ("ended", "CancelledError") for s in seen), (kind, seen)


def _within(seconds: float, fn: Callable[[], Any]) -> Any:
    """`fn()`, or "hung" if it has not returned in `seconds` (its thread is left behind)."""
    out: list[Any] = ["hung"]

    def run() -> None:
        try:
            out[0] = fn()
        except Exception as e:  # an RpcError is an answer too
            out[0] = repr(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    return out[0]


class _UntellableError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("this exception cannot be told")


def _raises_untellable(request: bytes, context: Any) -> bytes:
    raise _UntellableError()


@pytest.mark.parametrize("kind", ["grpcio", "isthmus"])
def test_a_handler_whose_exception_cannot_be_told_ends_its_call(kind: str) -> None:
    """A handler raises an exception whose `str` raises: grpcio ends the call UNKNOWN
    "Calling application raised unprintable Exception!". isthmus's server failed while ending
    the call and never ended it: with no deadline its client waited for ever."""
    generic = grpc.method_handlers_generic_handler(
        "users.Untellable", {"Raise": grpc.unary_unary_rpc_method_handler(_raises_untellable)}
    )
    with _blocking_server(kind, generic) as channel:
        call = channel.unary_unary("/users.Untellable/Raise").future(b"")
        got = _within(10, lambda: (call.code(), call.details()))
        call.cancel()
    assert got == (grpc.StatusCode.UNKNOWN, "Calling application raised unprintable Exception!"), kind


_LET_GO: dict[str, threading.Event] = {}


def _echo_telling(requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
    context.add_callback(_LET_GO[dict(context.invocation_metadata())["x-key"]].set)
    yield from requests


@pytest.mark.parametrize("kind", ["grpcio", "isthmus"])
def test_a_stream_its_caller_lets_go_of_is_cancelled(kind: str) -> None:
    """A bidirectional call fed by an iterator that blocks (a queue nobody fills), dropped by
    its caller after one reply: grpcio cancels it when it is collected, and its handler ends.
    isthmus's thread that sends the requests held the call, which was never collected: the
    handler ran on, holding its server's thread, until the call's deadline, or for ever."""
    generic = grpc.method_handlers_generic_handler(
        "users.LetGo", {"Echo": grpc.stream_stream_rpc_method_handler(_echo_telling)}
    )
    ended = _LET_GO[kind] = threading.Event()
    feed: queue.Queue[bytes | None] = queue.Queue()
    feed.put(b"one")
    try:
        with _blocking_server(kind, generic) as channel:
            echo = channel.stream_stream("/users.LetGo/Echo")
            call = echo(iter(feed.get, None), metadata=(("x-key", kind),))
            first = next(call)
            del call
            gc.collect()
            assert (first, ended.wait(10)) == (b"one", True), kind
    finally:
        feed.put(None)


@pytest.mark.parametrize("kind", ["grpcio", "isthmus"])
def test_a_stream_that_waits_for_ready_is_returned_at_once(kind: str) -> None:
    """A response stream with `wait_for_ready` on a channel with no server yet: grpcio returns
    the call at once and waits in its first read, which a `cancel()` ends. isthmus's waited
    inside the stub call over shm:// (the whole timeout, or for ever), so the caller had no
    call to cancel."""
    address = fresh("shm") if kind == "isthmus" else grpcio_target(fresh("unix"))
    with (grpc if kind == "grpcio" else isthmus).insecure_channel(address) as channel:
        stub = channel.unary_stream("/users.Nobody/Stream")
        returned = _within(10, lambda: stub(b"", timeout=60, wait_for_ready=True))
        assert not isinstance(returned, str), (kind, returned)
        returned.cancel()
        with pytest.raises(grpc.RpcError) as failed:
            list(returned)
    assert failed.value.code() == grpc.StatusCode.CANCELLED, kind


def test_metadata_entries_read_as_key_and_value(server: list[Any]) -> None:
    """`m.key`, `m.value` of `invocation_metadata()` entries (grpc's `_Metadatum`), the way
    auth interceptors read them; isthmus's were plain tuples (AttributeError, UNKNOWN)."""
    for channel in server:
        method = channel.unary_unary("/users.T/KeyValue")
        reply, call = method.with_call(b"", metadata=(("x-a", "1"),), timeout=10)
        assert reply == b"x-a=1", channel
        assert [(m.key, m.value) for m in call.trailing_metadata()] == [("x-t", "2")], channel


def _aio_users(address: str, module: Any) -> Any:
    """An asyncio server of the handlers below and a channel to it, as an async context."""

    async def twice_abort(request: bytes, context: Any) -> bytes:
        try:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such user")
        except Exception as e:
            await context.abort(grpc.StatusCode.INTERNAL, f"internal: {e}")
        raise AssertionError("abort returned")

    async def twice_head(request: bytes, context: Any) -> bytes:
        await context.send_initial_metadata((("x-h", "1"),))
        try:
            await context.send_initial_metadata((("x-h", "2"),))
        except grpc.aio.UsageError as e:
            return f"UsageError: {e}".encode()
        return b"no error"

    async def defaults(request: bytes, context: Any) -> bytes:
        return repr((context.details(), tuple(context.trailing_metadata()))).encode()

    async def echo(request: bytes, context: Any) -> bytes:
        return request

    handlers = {"TwiceAbort": twice_abort, "TwiceHead": twice_head, "Defaults": defaults, "Echo": echo}
    generic = grpc.method_handlers_generic_handler(
        "users.A", {name: grpc.unary_unary_rpc_method_handler(h) for name, h in handlers.items()}
    )

    class Served:
        async def __aenter__(self) -> Any:
            self.server = module.server()
            self.server.add_generic_rpc_handlers((generic,))
            self.server.add_insecure_port(address)
            await self.server.start()
            self.channel = module.insecure_channel(address)
            return self.channel

        async def __aexit__(self, *exc: Any) -> None:
            await self.channel.close()
            await self.server.stop(None)

    return Served()


@pytest.mark.parametrize("kind", ["grpc.aio", "isthmus.aio"])
def test_asyncio_handlers_misusing_their_context_get_grpc_aios_answers(kind: str) -> None:
    """A second abort (a handler's `except Exception: abort(...)` around the first) leaves the
    first's status; a second `send_initial_metadata` raises UsageError; `details()` and
    `trailing_metadata()` start as '' and (). isthmus sent the second abort's status, raised an
    RpcError, and gave None and None."""
    isthmus_kind = kind.startswith("isthmus")
    address = fresh("shm") if isthmus_kind else grpcio_target(fresh("unix"))

    async def run() -> None:
        async with _aio_users(address, isthmus.aio if isthmus_kind else grpc.aio) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await channel.unary_unary("/users.A/TwiceAbort")(b"", timeout=10)
            e = caught.value
            assert (e.code(), e.details()) == (grpc.StatusCode.NOT_FOUND, "no such user")
            reply = await channel.unary_unary("/users.A/TwiceHead")(b"", timeout=10)
            assert reply == b"UsageError: Send initial metadata failed: already sent", reply
            assert await channel.unary_unary("/users.A/Defaults")(b"", timeout=10) == b"('', ())"

    asyncio.run(run())


@pytest.mark.parametrize("kind", ["grpcio", "isthmus", "grpc.aio", "isthmus.aio"])
def test_a_deadline_passed_already_fails_the_call(kind: str) -> None:
    """A negative timeout (`deadline - time.time()` past the deadline): DEADLINE_EXCEEDED
    every time, and `time_remaining()` 0. Over shm:// isthmus sent the call, and a fast handler's
    reply could come back OK; `time_remaining()` was negative."""
    isthmus_kind = kind.startswith("isthmus")
    address = fresh("shm") if isthmus_kind else grpcio_target(fresh("unix"))
    if kind.endswith("aio"):

        async def run() -> None:
            async with _aio_users(address, isthmus.aio if isthmus_kind else grpc.aio) as channel:
                for _ in range(20):
                    call = channel.unary_unary("/users.A/Echo")(b"x", timeout=-1)
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await call
                    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, caught.value
                    assert call.time_remaining() == 0

        asyncio.run(run())
        return
    pool = futures.ThreadPoolExecutor(2)
    s = (isthmus.server if isthmus_kind else grpc.server)(pool)
    s.add_generic_rpc_handlers((_generic(),))
    s.add_insecure_port(address)
    s.start()
    try:
        with (isthmus if isthmus_kind else grpc).insecure_channel(address) as channel:
            method = channel.unary_unary("/users.T/Metadata")
            for _ in range(20):
                with pytest.raises(grpc.RpcError) as caught:
                    method(b"", timeout=-1)
                assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, caught.value
            future = method.future(b"", timeout=-1)
            assert future.exception(timeout=10).code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert future.time_remaining() == 0
    finally:
        s.stop(None)
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


def test_trailing_metadata_that_cannot_be_sent_fails_the_call_at_once() -> None:
    """A trailer value that is not printable ASCII: isthmus's call ends at once (it hung to its
    deadline, 10 s here), without that trailer, and not OK: a handler that answered fails
    UNKNOWN with the refusal, as one that raised it would (isthmus sent OK and the reply without
    the trailer, as though all had gone; grpc.aio's server fails the call so, grpcio's waits for
    the deadline). One that aborted keeps its status."""
    pool = futures.ThreadPoolExecutor(2)
    shm = fresh("shm")
    s = isthmus.server(pool)
    s.add_insecure_port(shm)
    s.add_generic_rpc_handlers((_generic(),))
    s.start()
    try:
        with isthmus.insecure_channel(shm) as channel:
            bad_trailer = channel.unary_unary("/users.T/BadTrailer")
            with pytest.raises(grpc.RpcError) as failed:
                bad_trailer(b"", timeout=10)
            assert failed.value.code() == grpc.StatusCode.UNKNOWN
            assert failed.value.details().startswith("Exception calling application: invalid metadata: ")
            assert "'k'" in failed.value.details() or '"k"' in failed.value.details()
            assert tuple(failed.value.trailing_metadata()) == ()
            with pytest.raises(grpc.RpcError) as aborted:
                bad_trailer(b"abort", timeout=10)
            assert (aborted.value.code(), aborted.value.details()) == (grpc.StatusCode.NOT_FOUND, "gone")
            assert tuple(aborted.value.trailing_metadata()) == ()
    finally:
        s.stop(None)
        pool.shutdown()


def _streams_then_bad_trailer(request: bytes, context: Any) -> Iterator[bytes]:
    yield b"one"
    yield b"two"
    context.set_trailing_metadata((("k", "not ascii: \u00e9"),))


async def _streams_then_bad_trailer_async(request: bytes, context: Any) -> AsyncIterator[bytes]:
    yield b"one"
    yield b"two"
    context.set_trailing_metadata((("k", "not ascii: \u00e9"),))


@pytest.mark.parametrize("api", ["isthmus", "isthmus.aio"])
def test_a_streaming_handlers_trailing_metadata_that_cannot_be_sent_fails_its_call(api: str) -> None:
    """A response-streaming handler whose trailer cannot be sent: its messages have gone, and
    the call ends UNKNOWN with the refusal, not OK without the trailer, on the blocking server
    and the asyncio one (their words for a handler's exception)."""
    pool = futures.ThreadPoolExecutor(2)
    handler = _streams_then_bad_trailer if api == "isthmus" else _streams_then_bad_trailer_async
    methods = {"Stream": grpc.unary_stream_rpc_method_handler(handler)}
    generic = grpc.method_handlers_generic_handler("users.S", methods)
    shm = fresh("shm")

    async def test() -> None:
        server: Any = isthmus.server(pool) if api == "isthmus" else isthmus.aio.server()
        server.add_generic_rpc_handlers((generic,))
        server.add_insecure_port(shm)
        if api == "isthmus":
            server.start()
        else:
            await server.start()
        try:
            async with isthmus.aio.insecure_channel(shm) as channel:
                call = channel.unary_stream("/users.S/Stream")(b"", timeout=10)
                got = []
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    async for message in call:
                        got.append(message)
                assert got == [b"one", b"two"]
                assert failed.value.code() == grpc.StatusCode.UNKNOWN, failed.value
                assert "invalid metadata" in failed.value.details(), failed.value
                assert tuple(failed.value.trailing_metadata()) == ()
        finally:
            if api == "isthmus":
                server.stop(None)
            else:
                await server.stop(None)

    asyncio.run(test())
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


# Call credentials: the metadata grpc's call credentials give, per call and composed into a
# channel's credentials, and how a call fails when they cannot give it.


def _seen(request: Any, context: Any) -> bytes:
    """What the handler saw of the call credentials' metadata."""
    return repr(
        sorted((k, v) for k, v in context.invocation_metadata() if k in ("authorization", "x-ctx"))
    ).encode()


def _seen_stream(request: Any, context: Any) -> Iterator[bytes]:
    yield _seen(request, context)


def _seen_requests(requests: Iterator[bytes], context: Any) -> bytes:
    list(requests)
    return _seen(None, context)


def _seen_both(requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
    for _ in requests:
        yield _seen(None, context)


_SEEN = grpc.method_handlers_generic_handler(
    "t.Auth",
    {
        "Unary": grpc.unary_unary_rpc_method_handler(_seen),
        "Stream": grpc.unary_stream_rpc_method_handler(_seen_stream),
        "Requests": grpc.stream_unary_rpc_method_handler(_seen_requests),
        "Both": grpc.stream_stream_rpc_method_handler(_seen_both),
        "Left": grpc.unary_unary_rpc_method_handler(_left),
    },
)


class _Later(grpc.AuthMetadataPlugin):
    """Answers from another thread, `delay` seconds later, with the method's name."""

    def __init__(self, delay: float = 0.01) -> None:
        self.delay = delay
        self.urls: list[str] = []

    def __call__(self, context: grpc.AuthMetadataContext, callback: grpc.AuthMetadataPluginCallback) -> None:
        self.urls.append(context.service_url)
        threading.Timer(self.delay, callback, ((("x-ctx", context.method_name),), None)).start()


def _left(request: Any, context: Any) -> bytes:
    return str(context.time_remaining()).encode()


class _Raises(grpc.AuthMetadataPlugin):
    def __call__(self, context: grpc.AuthMetadataContext, callback: grpc.AuthMetadataPluginCallback) -> None:
        raise ValueError("no token here")


class _Silent(grpc.AuthMetadataPlugin):
    def __call__(self, context: grpc.AuthMetadataContext, callback: grpc.AuthMetadataPluginCallback) -> None:
        pass  # never answers


class _Illegal(grpc.AuthMetadataPlugin):
    def __call__(self, context: grpc.AuthMetadataContext, callback: grpc.AuthMetadataPluginCallback) -> None:
        callback((("Not A Key", "v"),), None)


_TOKEN = grpc.access_token_call_credentials("t0k")
_BEARER = "[('authorization', 'Bearer t0k')]"


def _auth_servers(tmp_path: Any) -> tuple[list[Any], dict[str, str], str]:
    """A grpcio and an isthmus server of `_SEEN`, each on a loopback port with local
    credentials; their targets by name, and a grpcio port without them."""
    grpcio = grpc.server(futures.ThreadPoolExecutor(4))
    ours = isthmus.server(futures.ThreadPoolExecutor(4))
    targets = {}
    for name, server, local in (
        ("grpcio", grpcio, grpc.local_server_credentials(grpc.LocalConnectionType.LOCAL_TCP)),
        ("isthmus", ours, isthmus.local_server_credentials()),
    ):
        server.add_generic_rpc_handlers((_SEEN,))
        targets[name] = f"127.0.0.1:{server.add_secure_port('127.0.0.1:0', local)}"
    plain = f"127.0.0.1:{grpcio.add_insecure_port('127.0.0.1:0')}"
    targets["isthmus, Unix socket"] = f"unix:{tmp_path}/auth.sock"
    ours.add_secure_port(targets["isthmus, Unix socket"], isthmus.local_server_credentials())
    for server in (grpcio, ours):
        server.start()
    return [grpcio, ours], targets, plain


def _outcome(call: Any, *args: Any, **kwargs: Any) -> str:
    """What `call(*args, **kwargs)` gave: a `with_call`'s response, a future's result, a
    response stream's first message (`first=True`), or the error's code and details."""
    first = kwargs.pop("first", False)
    try:
        value = call(*args, **kwargs)
        if first:
            value = next(value)
        elif isinstance(value, tuple):
            value = value[0]
        elif isinstance(value, grpc.Future):
            value = value.result()
        return value.decode() if isinstance(value, bytes) else str(value)
    except grpc.RpcError as e:
        return f"{e.code().name} {e.details()}"


def _told_with_an_authority(module: Any, target: str, local: Any, told: _Later) -> set[str]:
    """The service URLs `told` is given for a call on a channel to `target` whose
    `grpc.default_authority` is `routed.example:8443`."""
    told.urls.clear()
    routed = [("grpc.default_authority", "routed.example:8443")]
    with module.secure_channel(target, local, options=routed) as channel:
        got = _outcome(
            channel.unary_unary("/t.Auth/Unary"),
            b"",
            timeout=10,
            credentials=grpc.metadata_call_credentials(told),
        )
        assert got == "[('x-ctx', 'Unary')]", target
    return set(told.urls)


@pytest.mark.parametrize("kind", ["grpcio", "isthmus"])
def test_call_credentials_send_their_metadata_as_grpcios_do(kind: str, tmp_path: Any) -> None:
    """grpc's call credentials, given to a call or composed into the channel's local
    credentials, add their metadata to every call shape (a plugin may answer from another
    thread); a plugin that raises, never answers or gives an illegal key fails the call with
    grpcio's code and words, and call credentials on an insecure channel fail it
    UNAUTHENTICATED. isthmus ignored them all (and refused local credentials)."""
    module: Any = grpc if kind == "grpcio" else isthmus
    servers, targets, plain = _auth_servers(tmp_path)
    local = grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
    told = _Later()
    later = grpc.metadata_call_credentials(told)
    try:
        for name, target in targets.items():
            if kind == "grpcio" and target.startswith("unix:"):
                continue  # grpcio's LOCAL_TCP credentials take TCP targets only
            told.urls.clear()
            with module.secure_channel(target, local) as channel:
                unary = channel.unary_unary("/t.Auth/Unary")
                assert _outcome(unary, b"", timeout=10) == "[]", name
                assert _outcome(unary, b"", timeout=10, credentials=_TOKEN) == _BEARER, name
                both = grpc.composite_call_credentials(_TOKEN, later)
                want = "[('authorization', 'Bearer t0k'), ('x-ctx', '{}')]"
                with_call = _outcome(unary.with_call, b"", timeout=10, credentials=both)
                assert with_call == want.format("Unary"), name
                assert _outcome(unary.future, b"", timeout=10, credentials=both) == want.format("Unary"), name
                stream = channel.unary_stream("/t.Auth/Stream")
                got = _outcome(stream, b"", timeout=10, credentials=later, first=True)
                assert got == "[('x-ctx', 'Stream')]", name
                requests = channel.stream_unary("/t.Auth/Requests")
                got = _outcome(requests, iter([b""]), timeout=10, credentials=both)
                assert got == want.format("Requests"), name
                for plugin, words in (
                    (_Raises(), "UNAVAILABLE Getting metadata from plugin failed with error: no token here"),
                    (_Silent(), "DEADLINE_EXCEEDED Deadline Exceeded"),
                    (_Illegal(), "UNAVAILABLE Illegal metadata"),
                ):
                    got = _outcome(
                        unary, b"", timeout=0.5, credentials=grpc.metadata_call_credentials(plugin)
                    )
                    assert got == words, (name, plugin)
                # The plugin is told the service's URL as grpcio tells it (no scheme over local
                # credentials; a Unix socket's host is localhost).
                host = "localhost" if target.startswith("unix:") else target
                assert set(told.urls) == {f"://{host}/t.Auth"}, (name, told.urls)
                # A channel's `grpc.default_authority` is the URL's host, the calls' authority.
                assert _told_with_an_authority(module, target, local, told) == {
                    "://routed.example:8443/t.Auth"
                }
                # A plugin's time is not taken from the call's: grpcio's handler sees the
                # whole timeout after a plugin that took 0.3 s.
                slow = grpc.metadata_call_credentials(_Later(delay=0.3))
                left = float(_outcome(channel.unary_unary("/t.Auth/Left"), b"", timeout=10, credentials=slow))
                assert left > 9.5, (name, left)
            composite = grpc.composite_channel_credentials(local, _TOKEN)
            with module.secure_channel(target, composite) as channel:
                unary = channel.unary_unary("/t.Auth/Unary")
                assert _outcome(unary, b"", timeout=10) == _BEARER, name
                got = _outcome(unary, b"", timeout=10, credentials=later)
                assert got == "[('authorization', 'Bearer t0k'), ('x-ctx', 'Unary')]", name
            nested = grpc.composite_channel_credentials(composite, later)
            with module.secure_channel(target, nested) as channel:
                got = _outcome(channel.unary_unary("/t.Auth/Unary"), b"", timeout=10)
                assert got == "[('authorization', 'Bearer t0k'), ('x-ctx', 'Unary')]", name
        with module.insecure_channel(plain) as channel:
            got = _outcome(channel.unary_unary("/t.Auth/Unary"), b"", timeout=10, credentials=_TOKEN)
            assert got == (
                "UNAUTHENTICATED Established channel does not have a sufficient security level to transfer "
                "call credential."
            )
    finally:
        for server in servers:
            server.stop(None)


@pytest.mark.parametrize("kind", ["grpcio", "isthmus"])
def test_a_failing_plugin_fails_the_future_or_stream_not_the_call_making_it(kind: str, tmp_path: Any) -> None:
    """A future (`.future()`) or a response stream whose call credentials fail is returned
    all the same, and ends with the failure: `result()` and the first read raise it, as
    grpcio's do. isthmus raised it from the call that made the future or the stream."""
    module: Any = grpc if kind == "grpcio" else isthmus
    servers, targets, _ = _auth_servers(tmp_path)
    failing = grpc.metadata_call_credentials(_Raises())
    want = (grpc.StatusCode.UNAVAILABLE, "Getting metadata from plugin failed with error: no token here")
    try:
        local = grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
        with module.secure_channel(targets[kind], local) as channel:
            futures_ = (
                channel.unary_unary("/t.Auth/Unary").future(b"", timeout=10, credentials=failing),
                channel.stream_unary("/t.Auth/Requests").future(iter([b""]), timeout=10, credentials=failing),
            )
            for future in futures_:
                assert (future.code(), future.details()) == want
                with pytest.raises(grpc.RpcError) as raised:
                    future.result()
                assert (raised.value.code(), raised.value.details()) == want
            stream = channel.unary_stream("/t.Auth/Stream")(b"", timeout=10, credentials=failing)
            with pytest.raises(grpc.RpcError) as raised:
                next(stream)
            assert (raised.value.code(), raised.value.details()) == want
    finally:
        for server in servers:
            server.stop(None)


class _Held(grpc.AuthMetadataPlugin):
    """Answers once released (or after 30 s), with the method's name, and tells when it has."""

    def __init__(self) -> None:
        self.asked = threading.Event()
        self.release = threading.Event()
        self.answered = threading.Event()

    def __call__(self, context: grpc.AuthMetadataContext, callback: grpc.AuthMetadataPluginCallback) -> None:
        self.asked.set()
        self.release.wait(30)
        self.answered.set()
        callback((("x-ctx", context.method_name),), None)


@pytest.mark.parametrize("kind", ["grpcio", "isthmus"])
def test_a_future_or_stream_comes_back_before_its_plugin_answers(kind: str, tmp_path: Any) -> None:
    """A `.future()` call or a response stream is returned at once, its call credentials'
    plugin asked off the caller's thread, and the call goes once the plugin answers; one
    cancelled before that is cancelled. grpcio's do so; isthmus waited for the plugin in the
    call that made them."""
    module: Any = grpc if kind == "grpcio" else isthmus
    servers, targets, _ = _auth_servers(tmp_path)
    try:
        local = grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
        with module.secure_channel(targets[kind], local) as channel:
            unary = channel.unary_unary("/t.Auth/Unary").future
            requests = channel.stream_unary("/t.Auth/Requests").future
            stream = channel.unary_stream("/t.Auth/Stream")
            both = channel.stream_stream("/t.Auth/Both")
            result: Callable[[Any], Any] = lambda f: f.result(timeout=30)  # noqa: E731
            makers: list[tuple[str, Callable[[Any], Any], Callable[[Any], Any]]] = [
                ("Unary", lambda c: unary(b"", timeout=60, credentials=c), result),
                ("Requests", lambda c: requests(iter([b""]), timeout=60, credentials=c), result),
                ("Stream", lambda c: stream(b"", timeout=60, credentials=c), next),
                ("Both", lambda c: both(iter([b""]), timeout=60, credentials=c), next),
            ]
            for method, make, first in makers:
                plugin = _Held()
                call = make(grpc.metadata_call_credentials(plugin))
                assert not plugin.answered.is_set(), method
                plugin.release.set()
                assert first(call) == f"[('x-ctx', '{method}')]".encode(), method
                plugin = _Held()
                call = make(grpc.metadata_call_credentials(plugin))
                assert call.cancel(), method
                plugin.release.set()
                assert plugin.answered.wait(30), method
                assert call.code() == grpc.StatusCode.CANCELLED, method
    finally:
        for server in servers:
            server.stop(None)


@pytest.mark.parametrize("kind", ["grpcio", "isthmus"])
def test_closing_the_channel_ends_calls_waiting_for_their_plugins(kind: str, tmp_path: Any) -> None:
    """`close()` ends a future or response stream whose plugin has not answered yet CANCELLED
    ("Channel closed!"), as every call in progress, as grpcio's does. isthmus left it waiting
    for the plugin, to fail UNAVAILABLE afterwards (or never, with no deadline)."""
    module: Any = grpc if kind == "grpcio" else isthmus
    servers, targets, _ = _auth_servers(tmp_path)
    plugin = _Held()
    try:
        local = grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
        channel = module.secure_channel(targets[kind], local)
        held = grpc.metadata_call_credentials(plugin)
        future = channel.unary_unary("/t.Auth/Unary").future(b"", credentials=held)
        stream = channel.unary_stream("/t.Auth/Stream")(b"", credentials=held)
        channel.close()
        for call in (future, stream):
            assert (call.code(), call.details()) == (grpc.StatusCode.CANCELLED, "Channel closed!")
        # A call after the close is refused at once, as a call without credentials is, and
        # its plugin is not asked.
        late = _Held()
        with pytest.raises(ValueError, match="Cannot invoke RPC: Channel closed!"):
            channel.unary_unary("/t.Auth/Unary").future(b"", credentials=grpc.metadata_call_credentials(late))
        assert not late.asked.is_set()
        late.release.set()
    finally:
        plugin.release.set()
        for server in servers:
            server.stop(None)


def test_a_call_that_cannot_start_once_its_plugins_answer_ends(tmp_path: Any) -> None:
    """A future or response stream returned before its plugins answered, whose start then
    fails (metadata the engine refuses), ends INTERNAL with the reason; the thread that asked
    the plugins died with it, and the call waited for ever. Credentials isthmus cannot read
    still raise TypeError in the caller's thread."""
    servers, targets, _ = _auth_servers(tmp_path)
    try:
        local = grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
        with isthmus.secure_channel(targets["isthmus"], local) as channel:
            bad = (("x-bad", 7),)  # not a str or bytes value
            later = grpc.metadata_call_credentials(_Later())
            future = channel.unary_unary("/t.Auth/Unary").future(b"", metadata=bad, credentials=later)
            error = future.exception(timeout=30)
            assert error is not None and error.code() == grpc.StatusCode.INTERNAL, error
            assert "could not start" in error.details(), error.details()
            stream = channel.unary_stream("/t.Auth/Stream")(b"", metadata=bad, credentials=later)
            assert stream.code() == grpc.StatusCode.INTERNAL
            with pytest.raises(TypeError):
                channel.unary_unary("/t.Auth/Unary").future(b"", credentials=object())  # type: ignore[arg-type]
            assert channel.unary_unary("/t.Auth/Unary")(b"", timeout=10, credentials=later) == (
                b"[('x-ctx', 'Unary')]"
            )
    finally:
        for server in servers:
            server.stop(None)


@pytest.mark.parametrize("kind", ["grpc.aio", "isthmus.aio"])
def test_asyncio_call_credentials_send_their_metadata_as_grpc_aios_do(kind: str, tmp_path: Any) -> None:
    """The same through grpc.aio's API: per call and composed into the channel's credentials;
    a plugin that raises fails the call UNAVAILABLE; call credentials on an insecure channel
    raise grpc.aio's UsageError."""
    module: Any = grpc.aio if kind == "grpc.aio" else isthmus.aio
    servers, targets, plain = _auth_servers(tmp_path)
    local = grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
    later = grpc.metadata_call_credentials(_Later())

    async def run() -> None:
        for name, target in targets.items():
            if kind == "grpc.aio" and target.startswith("unix:"):
                continue
            async with module.secure_channel(target, local) as channel:
                unary = channel.unary_unary("/t.Auth/Unary")
                assert (await unary(b"", timeout=10, credentials=_TOKEN)).decode() == _BEARER, name
                stream = channel.unary_stream("/t.Auth/Stream")
                got = [m async for m in stream(b"", timeout=10, credentials=later)]
                assert got == [b"[('x-ctx', 'Stream')]"], name
                with pytest.raises(grpc.RpcError) as failed:
                    await unary(b"", timeout=10, credentials=grpc.metadata_call_credentials(_Raises()))
                assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, name
                assert "no token here" in str(failed.value.details()), name
            async with module.secure_channel(
                target, grpc.composite_channel_credentials(local, _TOKEN)
            ) as channel:
                assert (await channel.unary_unary("/t.Auth/Unary")(b"", timeout=10)).decode() == _BEARER, name
        async with module.insecure_channel(plain) as channel:
            with pytest.raises(grpc.aio.UsageError, match="only valid on secure channels"):
                await channel.unary_unary("/t.Auth/Unary")(b"", timeout=10, credentials=_TOKEN)

    try:
        asyncio.run(run())
    finally:
        for server in servers:
            server.stop(None)


def _on_aio_channel(kind: str, tmp_path: Any, body: Callable[[Any], Awaitable[None]]) -> None:
    """Runs `body(channel)` on a channel of `kind` (grpc.aio or isthmus.aio) with local
    credentials to its own kind's server of `_SEEN`, then stops the servers."""
    module: Any = grpc.aio if kind == "grpc.aio" else isthmus.aio
    servers, targets, _ = _auth_servers(tmp_path)
    local = grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
    target = targets["grpcio" if kind == "grpc.aio" else "isthmus"]

    async def run() -> None:
        async with module.secure_channel(target, local) as channel:
            await body(channel)

    try:
        asyncio.run(run())
    finally:
        for server in servers:
            server.stop(None)


class _NeedsTheLoop(grpc.AuthMetadataPlugin):
    """Waits (up to 10 s) for the event loop to let it go, then answers through that loop: a
    plugin asked on the loop's own thread hears nothing and fails the call."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.go = threading.Event()

    def __call__(self, context: grpc.AuthMetadataContext, callback: grpc.AuthMetadataPluginCallback) -> None:
        if not self.go.wait(10):
            raise RuntimeError("the loop never ran while the plugin waited")
        self.loop.call_soon_threadsafe(callback, (("x-ctx", context.method_name),), None)


@pytest.mark.parametrize("kind", ["grpc.aio", "isthmus.aio"])
def test_asyncio_call_credentials_are_asked_off_the_loop_as_grpc_aios_are(kind: str, tmp_path: Any) -> None:
    """grpc.aio asks call credentials' plugins on a thread of its own, so one may block, or
    answer through the event loop, while the loop runs on. isthmus.aio asked them on the loop's
    thread: such a plugin held the loop up and failed the call."""

    async def body(channel: Any) -> None:
        loop = asyncio.get_running_loop()
        unary, stream = channel.unary_unary("/t.Auth/Unary"), channel.unary_stream("/t.Auth/Stream")
        for method, call in (
            ("Unary", lambda c: unary(b"", timeout=30, credentials=c)),
            ("Stream", lambda c: stream(b"", timeout=30, credentials=c).read()),
        ):
            plugin = _NeedsTheLoop(loop)
            pending = asyncio.ensure_future(call(grpc.metadata_call_credentials(plugin)))
            await asyncio.sleep(0)  # the call is made: the loop runs on
            plugin.go.set()
            assert (await pending).decode() == f"[('x-ctx', '{method}')]", method

    _on_aio_channel(kind, tmp_path, body)


@pytest.mark.parametrize("kind", ["grpc.aio", "isthmus.aio"])
def test_asyncio_plugins_that_never_answer_hold_no_thread(kind: str, tmp_path: Any) -> None:
    """Calls whose plugin returns without answering wait for their deadline, and hold no
    thread meanwhile: more of them than the loop's default executor has threads leave it free.
    isthmus.aio waited for the answer on an executor thread, so twelve such calls took every
    thread of it (six on two cores) until their deadlines."""
    silent = grpc.metadata_call_credentials(_Silent())

    async def body(channel: Any) -> None:
        loop = asyncio.get_running_loop()
        unary, stream = channel.unary_unary("/t.Auth/Unary"), channel.unary_stream("/t.Auth/Stream")
        calls = [unary(b"", timeout=30, credentials=silent) for _ in range(6)]
        calls += [stream(b"", timeout=30, credentials=silent) for _ in range(6)]
        await asyncio.sleep(0.5)  # the plugins have been asked (not needed to pass)
        assert await asyncio.wait_for(loop.run_in_executor(None, sum, (1, 2)), 10) == 3
        assert not any(call.done() for call in calls)
        for call in calls:
            call.cancel()
        with pytest.raises(grpc.RpcError) as short:
            await unary(b"", timeout=0.2, credentials=silent)
        assert short.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    _on_aio_channel(kind, tmp_path, body)


@pytest.mark.parametrize("kind", ["grpc.aio", "isthmus.aio"])
def test_asyncio_credentials_of_no_known_kind_raise_at_the_call(kind: str, tmp_path: Any) -> None:
    """Call credentials that are not grpc's raise at the call, unary or streaming, as grpc.aio's
    (AttributeError there, TypeError here, as isthmus's blocking API). isthmus.aio failed the
    task that asks the plugins with them, and the call waited for ever."""

    async def body(channel: Any) -> None:
        unary, stream = channel.unary_unary("/t.Auth/Unary"), channel.unary_stream("/t.Auth/Stream")
        for call in (unary, stream):
            with pytest.raises((TypeError, AttributeError)):
                await asyncio.wait_for(_awaited(call(b"", credentials=object())), 10)
        assert await unary(b"", timeout=10) == b"[]"

    _on_aio_channel(kind, tmp_path, body)


async def _awaited(call: Any) -> Any:
    """A unary call's response, or a stream's first message."""
    return await (call.read() if hasattr(call, "read") else call)


def _identity(request: Any, context: Any) -> bytes:
    return repr((context.peer_identity_key(), context.peer_identities())).encode()


def test_call_credentials_go_over_shm_and_local_credentials_stay_local(tmp_path: Any) -> None:
    """`shm://` is local by construction: an insecure channel's calls there take call
    credentials, and a handler knows its client as grpc's local credentials name it ("local",
    under `transport_security_type`; it was None). Local credentials for a target or port
    elsewhere are refused at once (grpcio fails the handshake, or binds and refuses remote
    clients)."""
    shm = fresh("shm")
    server = isthmus.server(futures.ThreadPoolExecutor(2))
    who = grpc.method_handlers_generic_handler(
        "t.Who", {"Am": grpc.unary_unary_rpc_method_handler(_identity)}
    )
    server.add_generic_rpc_handlers((_SEEN, who))
    server.add_insecure_port(shm)
    server.start()
    try:
        with isthmus.insecure_channel(shm) as channel:
            seen = channel.unary_unary("/t.Auth/Unary")(b"", timeout=10, credentials=_TOKEN).decode()
            assert seen == _BEARER
            identity = channel.unary_unary("/t.Who/Am")(b"", timeout=10).decode()
            assert identity == "('transport_security_type', [b'local'])", identity
        with pytest.raises(ValueError, match="this machine"):
            isthmus.secure_channel("example.com:443", grpc.local_channel_credentials())
        with pytest.raises(ValueError, match="this machine"):  # a DNS server of its own names it
            isthmus.secure_channel("dns://8.8.8.8/localhost:1", grpc.local_channel_credentials())
        # isthmus's TLS credentials compose with call credentials as grpc's do.
        tls = grpc.composite_channel_credentials(isthmus.ssl_channel_credentials(None), _TOKEN)
        isthmus.secure_channel("localhost:1", tls).close()
        with pytest.raises(RuntimeError, match="this machine"):
            server.add_secure_port("0.0.0.0:0", isthmus.local_server_credentials())
    finally:
        server.stop(None)


_INTERRUPTED = """
import sys, threading, time
from concurrent import futures
import grpc
import isthmus

kind, shape, address = sys.argv[1:4]
ended = threading.Event()


def quiet(request, context):
    print("waiting", flush=True)  # the client's main thread is in its call by now
    while context.is_active():
        time.sleep(0.02)
    ended.set()
    return b""


def quiet_stream(request, context):
    yield from (quiet(request, context) and ())


server = (grpc.server if kind == "grpcio" else isthmus.server)(futures.ThreadPoolExecutor(2))
handlers = {
    "Unary": grpc.unary_unary_rpc_method_handler(quiet),
    "Stream": grpc.unary_stream_rpc_method_handler(quiet_stream),
}
server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Q", handlers),))
server.add_insecure_port(address)
server.start()
with (grpc if kind == "grpcio" else isthmus).insecure_channel(address) as channel:
    try:
        if shape == "unary":
            channel.unary_unary("/t.Q/Unary")(b"")
        else:
            call = channel.unary_stream("/t.Q/Stream")(b"")
            next(call)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    if shape == "stream":
        call.cancel()
    print("the handler saw its end" if ended.wait(20) else "the handler runs on", flush=True)
server.stop(None)
"""


@pytest.mark.parametrize("shape", ["unary", "stream"])
@pytest.mark.parametrize("kind", ["grpcio", "isthmus"])
def test_ctrl_c_ends_a_wait_for_a_reply_that_does_not_come(kind: str, shape: str) -> None:
    """SIGINT while the main thread waits for a unary reply or a stream's next message, with no
    deadline: grpcio waits in slices, runs the signal handlers between them and raises
    KeyboardInterrupt, and its server's handler sees the call end. isthmus's waits held no
    slices: Ctrl-C did nothing until a reply came."""
    address = fresh("shm") if kind == "isthmus" else grpcio_target(fresh("unix"))
    child = subprocess.Popen(
        [sys.executable, "-c", _INTERRUPTED, kind, shape, address], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "waiting"
        child.send_signal(signal.SIGINT)
        out, _ = child.communicate(timeout=30)
        assert out.split("\n")[:2] == ["interrupted", "the handler saw its end"], (kind, out)
    finally:
        child.kill()
        child.wait()


_INTERRUPTED_WAITING_FOR_READY = """
import signal, sys
import grpc
import isthmus

kind, address, handler = sys.argv[1:4]
with (grpc if kind == "grpcio" else isthmus).insecure_channel(address) as channel:

    def calls_then_raises(signum, frame):
        # A handler that calls on the channel its interrupted call waits on (a goodbye, say).
        try:
            channel.unary_unary("/t.Q/Unary")(b"", timeout=0.5)
        except grpc.RpcError:
            pass
        raise KeyboardInterrupt

    if handler == "calls":
        signal.signal(signal.SIGINT, calls_then_raises)
    try:
        print("waiting", flush=True)
        channel.unary_unary("/t.Q/Unary")(b"", wait_for_ready=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
"""


@pytest.mark.parametrize("handler", ["default", "calls"])
@pytest.mark.parametrize("kind", ["grpcio", "isthmus"])
def test_ctrl_c_ends_a_wait_for_a_server_that_is_not_there(kind: str, handler: str) -> None:
    """SIGINT while the main thread's unary call waits for a server to come up
    (`wait_for_ready`, no deadline): grpcio raises KeyboardInterrupt, also from a handler that
    first makes a call on the same channel. isthmus's wait between attempts to connect slept
    through it, until a server came; then its handler ran with the channel's connect lock held,
    and a call from it waited for that lock for ever."""
    address = fresh("shm") if kind == "isthmus" else grpcio_target(fresh("unix"))
    script = _INTERRUPTED_WAITING_FOR_READY
    argv = [sys.executable, "-c", script, kind, address, handler]
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "waiting"
        threading.Event().wait(0.5)  # into its wait by now, most likely; if not, it is all the same
        child.send_signal(signal.SIGINT)
        out, _ = child.communicate(timeout=30)
        assert out.strip() == "interrupted", (kind, out)
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("kind", ["grpcio", "grpc.aio", "isthmus", "isthmus.aio"])
def test_a_call_to_a_server_that_never_answers_ends_at_its_deadline(stubs: Any, kind: str) -> None:
    """A server that accepts the connection but never answers its handshake (stopped): a call
    with a 1 s timeout ends DEADLINE_EXCEEDED at its deadline, as grpcio's does. isthmus's
    waited for its handshake's own 5 s and then failed UNAVAILABLE."""
    grpcio = kind.startswith("grpc")
    served = serve("grpcio" if grpcio else "rust", ["unix" if grpcio else "shm"], stubs)
    target = grpcio_target(served.addresses["unix"]) if grpcio else served.addresses["shm"]
    module = {"grpcio": grpc, "grpc.aio": grpc.aio, "isthmus": isthmus, "isthmus.aio": isthmus.aio}[kind]

    async def aio_call() -> None:
        async with module.insecure_channel(target) as channel:
            await channel.unary_unary("/conformance.Echo/Unary")(b"", timeout=1)

    try:
        served.peer.stop()
        began = time.monotonic()
        with pytest.raises(grpc.RpcError) as raised:
            if kind.endswith(".aio"):
                asyncio.run(aio_call())
            else:
                with module.insecure_channel(target) as channel:
                    channel.unary_unary("/conformance.Echo/Unary")(b"", timeout=1)
        took = time.monotonic() - began
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, (kind, raised.value)
        assert took < 4, f"{kind}: {took:.1f} s for a call with a 1 s timeout"
    finally:
        served.peer.resume()
        served.close()


@pytest.mark.parametrize("kind", ["grpcio", "grpc.aio", "isthmus", "isthmus.aio"])
def test_default_authority_is_what_calls_send_as_their_authority(stubs: Any, kind: str) -> None:
    """`grpc.default_authority` replaces the `:authority` a channel's calls send, over TCP and a
    Unix socket; without it a call sends its target's host and port, or `localhost` for a
    Unix socket. The server (the tonic peer) answers what it saw. isthmus ignored the option."""
    served = serve("rust", ["http", "unix"], stubs)
    module = {"grpcio": grpc, "grpc.aio": grpc.aio, "isthmus": isthmus, "isthmus.aio": isthmus.aio}[kind]
    tcp, unix = grpcio_target(served.addresses["http"]), grpcio_target(served.addresses["unix"])
    cases = [
        (tcp, None, tcp),
        (tcp, "routed.example:8443", "routed.example:8443"),
        (unix, None, "localhost"),
        (unix, "routed.example", "routed.example"),
    ]
    asked = (("x-want-authority", "1"),)

    async def aio_seen(target: str, options: list[tuple[str, Any]]) -> Any:
        async with module.insecure_channel(target, options=options) as channel:
            call = channel.unary_unary("/conformance.Echo/Unary")(b"", metadata=asked, timeout=10)
            await call
            return next((v for k, v in await call.initial_metadata() if k == "x-authority"), None)

    try:
        for target, given, expected in cases:
            # Calls stay on HTTP/2 (grpcio ignores the option), where an `:authority` travels.
            options: list[tuple[str, Any]] = [("isthmus.upgrade", False)]
            if given is not None:
                options.append(("grpc.default_authority", given))
            if kind.endswith(".aio"):
                seen = asyncio.run(aio_seen(target, options))
            else:
                with module.insecure_channel(target, options=options) as channel:
                    _, call = channel.unary_unary("/conformance.Echo/Unary").with_call(
                        b"", metadata=asked, timeout=10
                    )
                    seen = dict(call.initial_metadata()).get("x-authority")
            assert seen == expected, (kind, target, given, seen)
    finally:
        served.close()


def _fill_backlog(path: str, queued: list[socket.socket]) -> None:
    """Connections to the Unix socket `path`, whose server does not accept, into `queued` (the
    caller closes them, however this ends) until its backlog turns the next one away. Servers
    listen with the kernel's largest backlog, so this raises the soft limit of open files where
    it must; the caller restores it."""
    backlog = int(Path("/proc/sys/net/core/somaxconn").read_text())
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = backlog + len(os.listdir("/proc/self/fd")) + 256
    if soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            pytest.skip(f"a backlog of {backlog} needs {needed} open files; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    for _ in range(backlog + 2):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        queued.append(s)
        connected = s.connect_ex(path)
        if connected == errno.EAGAIN:
            return
        assert connected == 0, (path, errno.errorcode.get(connected, connected))
    pytest.fail("the backlog never filled")


@pytest.mark.parametrize("kind", ["grpcio", "isthmus"])
def test_a_call_to_a_stopped_server_with_a_full_backlog_ends_at_its_deadline(stubs: Any, kind: str) -> None:
    """A stopped server whose listen backlog is full of connections it never accepted: a call
    with a 1 s timeout ends by its deadline. grpcio's non-blocking connect is turned away and
    the call fails UNAVAILABLE at once; isthmus waits for room in the backlog, as long as the
    deadline allows (DEADLINE_EXCEEDED). Its `connect(2)` waited with no bound, and the call
    hung."""
    grpcio = kind == "grpcio"
    served = serve("grpcio" if grpcio else "rust", ["unix" if grpcio else "shm"], stubs)
    if grpcio:
        target = grpcio_target(served.addresses["unix"])
        path = target.removeprefix("unix:")
    else:
        target = served.addresses["shm"]
        path = str(runtime_dir() / f"{target.removeprefix('shm://')}.sock")
    module = grpc if grpcio else isthmus
    queued: list[socket.socket] = []
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        served.peer.stop()
        _fill_backlog(path, queued)
        result: queue.Queue[tuple[BaseException, float]] = queue.Queue()

        def call() -> None:
            began = time.monotonic()
            try:
                with module.insecure_channel(target) as channel:
                    channel.unary_unary("/conformance.Echo/Unary")(b"", timeout=1)
            except BaseException as e:  # reported to the test's thread
                result.put((e, time.monotonic() - began))

        # A thread, so that a call that hangs fails the test instead of hanging it.
        threading.Thread(target=call, daemon=True).start()
        try:
            error, took = result.get(timeout=30)
        except queue.Empty:
            pytest.fail(f"{kind}: the call hung")
        assert isinstance(error, grpc.RpcError), (kind, error)
        expected = grpc.StatusCode.UNAVAILABLE if grpcio else grpc.StatusCode.DEADLINE_EXCEEDED
        assert error.code() == expected, (kind, error)
        assert took < 4, f"{kind}: {took:.1f} s for a call with a 1 s timeout"
    finally:
        for s in queued:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)
        served.peer.resume()
        served.close()


@pytest.mark.parametrize("kind", ["grpcio", "grpc.aio", "isthmus", "isthmus.aio"])
def test_a_call_behind_another_calls_connection_ends_at_its_deadline(stubs: Any, kind: str) -> None:
    """Two calls on a channel not yet connected, to a server that never answers the handshake
    (stopped): the first (30 s timeout) is connecting when the second (1 s) comes, which ends
    DEADLINE_EXCEEDED at its own deadline, as grpc's does. isthmus's waited for the first
    call's handshake, 5 s."""
    grpcio = kind.startswith("grpc")
    served = serve("grpcio" if grpcio else "rust", ["unix" if grpcio else "shm"], stubs)
    target = grpcio_target(served.addresses["unix"]) if grpcio else served.addresses["shm"]
    module = {"grpcio": grpc, "grpc.aio": grpc.aio, "isthmus": isthmus, "isthmus.aio": isthmus.aio}[kind]
    path = "/conformance.Echo/Unary"

    def second(call: Callable[[], Any]) -> tuple[Any, float]:
        began = time.monotonic()
        try:
            call()
        except grpc.RpcError as e:
            return e.code(), time.monotonic() - began
        return "OK", time.monotonic() - began

    async def aio_calls() -> tuple[Any, float]:
        async with module.insecure_channel(target) as channel:
            method = channel.unary_unary(path)
            first = asyncio.ensure_future(method(b"", timeout=30))
            await asyncio.sleep(0.3)  # the first is connecting by now
            began = time.monotonic()
            try:
                await method(b"", timeout=1)
                outcome: tuple[Any, float] = ("OK", time.monotonic() - began)
            except grpc.RpcError as e:
                outcome = (e.code(), time.monotonic() - began)
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.RpcError):
                await first
            return outcome

    try:
        served.peer.stop()
        if kind.endswith(".aio"):
            code, took = asyncio.run(aio_calls())
        else:
            with module.insecure_channel(target) as channel:
                method = channel.unary_unary(path)
                first = threading.Thread(target=second, args=(lambda: method(b"", timeout=30),))
                first.start()
                time.sleep(0.3)  # the first is connecting by now
                code, took = second(lambda: method(b"", timeout=1))
                served.peer.resume()  # the first call ends now, whichever way
                first.join(60)
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED, (kind, code)
        assert took < 3, f"{kind}: {took:.1f} s for a call with a 1 s timeout (the first's handshake: 5 s)"
    finally:
        served.peer.resume()
        served.close()


_INTERRUPTED_WAITING_FOR_ROOM = """
import sys
import grpc
import isthmus

big = b"x" * (30 << 20)
with isthmus.insecure_channel(sys.argv[1]) as channel:
    call = channel.unary_unary("/conformance.Echo/Unary")
    call(b"", timeout=30)  # connected
    print("connected", flush=True)
    sys.stdin.readline()
    # The server is stopped now: each request stays where it was sent, and two of them hold
    # 60 MiB of the client's 64 MiB arena, so the third waits for room.
    for _ in range(2):
        try:
            call(big, timeout=1)
        except grpc.RpcError as e:
            print(e.code().name, flush=True)
    try:
        print("waiting", flush=True)
        call(big)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
"""


def test_ctrl_c_ends_a_wait_for_room_for_the_request(stubs: Any) -> None:
    """SIGINT while the main thread's unary call waits for room in shared memory to send its
    request (a stopped server let none of the earlier ones go): KeyboardInterrupt, as grpcio's
    calls raise it in every wait (its own call of 30 MiB to a stopped server does not even end
    at its deadline, but Ctrl-C ends it). Before, that wait held no slices and went on until
    the server let some room go."""
    _interrupted_in_a_wait(
        stubs, _INTERRUPTED_WAITING_FOR_ROOM, ["DEADLINE_EXCEEDED", "DEADLINE_EXCEEDED", "waiting"]
    )


def _interrupted_in_a_wait(stubs: Any, script: str, before: list[str]) -> None:
    """Runs `script` against a Rust server on shm://, stops the server once the script says
    `connected`, lets the script go on, reads the lines `before` from it, then sends it SIGINT:
    it must say `interrupted` and end."""
    served = serve("rust", ["shm"], stubs)
    try:
        argv = [sys.executable, "-c", script, served.addresses["shm"]]
        child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdin is not None and child.stdout is not None
            assert child.stdout.readline().strip() == "connected"
            served.peer.stop()
            child.stdin.write("go\n")
            child.stdin.flush()
            seen = [child.stdout.readline().strip() for _ in before]
            assert seen == before, seen
            threading.Event().wait(0.5)  # into its wait by now, most likely; if not, it is all the same
            child.send_signal(signal.SIGINT)
            out, _ = child.communicate(timeout=30)
            assert out.strip() == "interrupted", out
        finally:
            child.kill()
            child.wait()
    finally:
        served.peer.resume()
        served.close()


_INTERRUPTED_WAITING_FOR_THE_RING = """
import sys, threading, time
import grpc
import isthmus

request = b"x" * (6 << 10)  # inside its call's HEADERS
with isthmus.insecure_channel(sys.argv[1]) as channel:
    call = channel.unary_unary("/conformance.Echo/Unary")
    call(b"", timeout=30)  # connected
    print("connected", flush=True)
    sys.stdin.readline()

    # The server is stopped now: no frame leaves the 1 MiB ring, and these threads' calls fill
    # it, until some wait for room (counted), and so will the main thread's.
    def fill():
        try:
            call(request, timeout=60)
        except grpc.RpcError:
            pass

    for _ in range(300):
        threading.Thread(target=fill, daemon=True).start()
    end = time.monotonic() + 30
    while channel.stats().ring_full_waits == 0 and time.monotonic() < end:
        time.sleep(0.01)
    print("full" if channel.stats().ring_full_waits else "never full", flush=True)
    try:
        print("waiting", flush=True)
        call(request)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
"""


def test_ctrl_c_ends_a_wait_for_ring_room_for_the_calls_head(stubs: Any) -> None:
    """SIGINT while the main thread's unary call waits for room in its connection's ring for
    its head (a stopped server reads none of the frames other threads' calls sent):
    KeyboardInterrupt, as grpcio's calls raise it in every wait. Before, that wait held no
    slices and went on until the server read some frames."""
    _interrupted_in_a_wait(stubs, _INTERRUPTED_WAITING_FOR_THE_RING, ["full", "waiting"])


_INTERRUPTED_WAITING_FOR_THE_HANDSHAKE = """
import sys, time
import grpc
import isthmus

with isthmus.insecure_channel(sys.argv[1]) as channel:  # not connected before its first call
    call = channel.unary_unary("/conformance.Echo/Unary")
    print("connected", flush=True)
    sys.stdin.readline()
    # The server is stopped now: the connection goes into its listen backlog, and the
    # handshake waits for its answer (5 s at most).
    began = time.monotonic()
    try:
        print("waiting", flush=True)
        call(b"")
    except KeyboardInterrupt:
        took = time.monotonic() - began
        print("interrupted" if took < 4 else f"interrupted only after {took:.1f} s", flush=True)
"""


def test_ctrl_c_ends_a_wait_for_a_servers_handshake(stubs: Any) -> None:
    """SIGINT while the main thread's first call on a channel waits for a stopped server to
    answer the handshake: KeyboardInterrupt at once, as grpcio's calls raise it in every wait.
    Before, the handshake ran on the calling thread and heard nothing until it timed out (5 s),
    then failed UNAVAILABLE."""
    _interrupted_in_a_wait(stubs, _INTERRUPTED_WAITING_FOR_THE_HANDSHAKE, ["waiting"])


def _counted(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
    """Streams request[0] responses, then aborts if request[1]."""
    for i in range(request[0]):
        yield b"m%d" % i
    if request[1]:
        context.abort(grpc.StatusCode.ABORTED, "aborted")


def _status_of(call: Any) -> tuple[Any, str, Any] | str:
    """The call's code, details and trailing metadata, or "waiting" if they did not come in
    10 s."""
    out: list[tuple[Any, str, Any]] = []

    def ask() -> None:
        out.append((call.code(), call.details(), call.trailing_metadata()))

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    asker.join(10)
    return out[0] if out else "waiting"


@pytest.mark.parametrize("kind", ["grpcio", "isthmus"])
def test_a_response_streams_status_comes_once_its_responses_are_read(kind: str) -> None:
    """grpcio gives a response stream's status (code(), details(), trailing_metadata()) once
    the server ended the call and every response before the end was read, without a reader
    asking for the end; until the deadline while responses stay unread. isthmus gave it only
    once a reader reached the end: after all responses were read, after an abort with none to
    read, and past the deadline, code() waited for ever."""
    ok, aborted = grpc.StatusCode.OK, grpc.StatusCode.ABORTED
    generic = grpc.method_handlers_generic_handler(
        "users.S", {"Counted": grpc.unary_stream_rpc_method_handler(_counted)}
    )
    with _blocking_server(kind, generic) as channel:
        counted = channel.unary_stream("/users.S/Counted")
        call = counted(bytes([3, 0]), timeout=30)
        read = [next(call) for _ in range(3)]
        assert (read, _status_of(call)) == ([b"m0", b"m1", b"m2"], (ok, "", ()))
        assert list(call) == []
        assert _status_of(counted(bytes([0, 1]), timeout=30)) == (aborted, "aborted", ())
        call = counted(bytes([1, 1]), timeout=30)
        assert (next(call), _status_of(call)) == (b"m0", (aborted, "aborted", ()))
        # Responses nobody reads: the status waits for them, here until the deadline, and
        # the reader that comes later finds the call failed.
        call = counted(bytes([3, 0]), timeout=1)
        assert _status_of(call) == (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", ())
        with pytest.raises(grpc.RpcError) as failed:
            next(call)
        assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # A reader beside a status waiter gets every response, in order.
        call = counted(bytes([50, 0]), timeout=30)
        status: list[Any] = []
        asker = threading.Thread(target=lambda: status.append(_status_of(call)))
        asker.start()
        assert list(call) == [b"m%d" % i for i in range(50)]
        asker.join(20)
        assert status == [(ok, "", ())]


@pytest.mark.parametrize("kind", ["grpcio", "isthmus"])
def test_a_response_streams_status_comes_when_it_starts_after_the_ask(kind: str) -> None:
    """A response stream returned before it started (its call credentials answer 0.5 s later)
    whose status is asked meanwhile: the status comes once the server ends it, as from grpcio.
    isthmus's asker took the stream for a call with one response and waited for a reader for
    ever."""
    generic = grpc.method_handlers_generic_handler(
        "users.S", {"Counted": grpc.unary_stream_rpc_method_handler(_counted)}
    )
    server = (grpc.server if kind == "grpcio" else isthmus.server)(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((generic,))
    credentials = (
        grpc.local_server_credentials(grpc.LocalConnectionType.LOCAL_TCP)
        if kind == "grpcio"
        else isthmus.local_server_credentials()
    )
    target = f"127.0.0.1:{server.add_secure_port('127.0.0.1:0', credentials)}"
    server.start()
    local = grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
    late = grpc.metadata_call_credentials(_Later(delay=0.5))
    try:
        with (grpc if kind == "grpcio" else isthmus).secure_channel(target, local) as channel:
            call = channel.unary_stream("/users.S/Counted")(bytes([0, 1]), timeout=30, credentials=late)
            status = _status_of(call)  # its trailers over HTTP/2 are the server's own: not compared
            assert status[:2] == (grpc.StatusCode.ABORTED, "aborted"), (kind, status)
    finally:
        server.stop(None)


def _held(request: bytes, context: grpc.ServicerContext) -> bytes:
    """Answers only when its call is over (cancelled, or past its deadline)."""
    while context.is_active():
        time.sleep(0.02)
    return b""


@pytest.mark.parametrize("kind", ["grpcio", "isthmus"])
def test_a_future_cancelled_under_a_lock_its_callback_takes_does_not_wait_for_itself(kind: str) -> None:
    """A future cancelled while the caller holds a lock its done-callback takes (a registry of
    calls in progress, say): grpcio runs the callback later, on a thread of its own, once the
    lock is free. isthmus ran it inside `cancel()`, on the thread that held the lock: the
    callback waited for a lock its own thread held, for ever."""
    held = grpc.unary_unary_rpc_method_handler(_held)
    generic = grpc.method_handlers_generic_handler("users.S", {"Held": held})
    registry = threading.Lock()
    seen: queue.Queue[str] = queue.Queue()

    def done(future: grpc.Future) -> None:
        if not registry.acquire(timeout=5):
            seen.put("the callback waited for the lock its own cancel held")
            return
        registry.release()
        seen.put(f"cancelled={future.cancelled()}")

    with _blocking_server(kind, generic) as channel:
        future = channel.unary_unary("/users.S/Held").future(b"", timeout=30)
        future.add_done_callback(done)
        with registry:
            assert future.cancel()
        assert seen.get(timeout=20) == "cancelled=True", kind


def _eventually(holds: Callable[[], bool]) -> bool:
    """Whether `holds()` comes to be true within 10 s: grpcio's stream is done, and has run its
    callbacks, a moment after its status came, from a thread of its own."""
    end = time.monotonic() + 10
    while not holds():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.parametrize("kind", ["grpcio", "isthmus"])
def test_a_response_streams_future_is_done_once_its_responses_are_read(kind: str) -> None:
    """A response stream is a future too, done (and its done callbacks run, and `result` and
    `exception` answer) once the server ended it and its responses were read, with no reader
    asking for the end: grpcio's are. isthmus's waited for a reader to reach the end (or for
    `code()`): the callbacks of a stream read to its last response never ran, and a timed
    `result` timed out."""
    generic = grpc.method_handlers_generic_handler(
        "users.S", {"Counted": grpc.unary_stream_rpc_method_handler(_counted)}
    )
    with _blocking_server(kind, generic) as channel:
        counted = channel.unary_stream("/users.S/Counted")
        called: list[Any] = []
        call = counted(bytes([3, 0]), timeout=30)
        call.add_done_callback(called.append)
        assert [next(call) for _ in range(3)] == [b"m0", b"m1", b"m2"]
        assert _eventually(call.done) and not call.is_active()
        assert call.result(5) is None and call.exception(5) is None
        assert _eventually(lambda: called == [call])
        assert list(call) == []
        # With no response at all, nothing is left to read.
        call = counted(bytes([0, 0]), timeout=30)
        assert _eventually(call.done) and call.result(5) is None
        # A failure after the responses: exception() gives it, result() raises it.
        call = counted(bytes([2, 1]), timeout=30)
        assert [next(call), next(call)] == [b"m0", b"m1"]
        assert call.exception(5).code() == grpc.StatusCode.ABORTED
        with pytest.raises(grpc.RpcError):
            call.result(5)
        # A response left unread holds it back, until the deadline.
        call = counted(bytes([3, 0]), timeout=30)
        assert next(call) == b"m0"
        with pytest.raises(grpc.FutureTimeoutError):
            call.result(0.3)
        assert not call.done() and call.is_active()
        call.cancel()
        called.clear()
        call = counted(bytes([3, 0]), timeout=1)
        call.add_done_callback(called.append)
        assert call.exception(10).code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert _eventually(lambda: called == [call])


def _two(request: bytes, context: Any) -> Iterator[bytes]:
    yield b"1"
    yield b"2"


# Released by a test once it has given a call to "Held" its callbacks.
_HELD = threading.Event()


def _held(request: bytes, context: grpc.ServicerContext) -> bytes:
    _HELD.wait(30)
    return b"ok:" + request


_CALLBACKS = grpc.method_handlers_generic_handler(
    "users.Callbacks",
    {
        "Ok": grpc.unary_unary_rpc_method_handler(lambda request, context: b"ok:" + request),
        "Held": grpc.unary_unary_rpc_method_handler(_held),
        "Two": grpc.unary_stream_rpc_method_handler(_two),
    },
)


@contextlib.contextmanager
def _two_channels(kind: str) -> Iterator[tuple[Any, Any]]:
    """Two channels of `kind` to one blocking server of `_CALLBACKS` of the same kind, closed
    and stopped after."""
    module: Any = grpc if kind == "grpcio" else isthmus
    address = fresh("shm") if kind == "isthmus" else grpcio_target(fresh("unix"))
    pool = futures.ThreadPoolExecutor(4)
    s = module.server(pool)
    s.add_generic_rpc_handlers((_CALLBACKS,))
    s.add_insecure_port(address)
    s.start()
    try:
        with module.insecure_channel(address) as one, module.insecure_channel(address) as other:
            yield one, other
    finally:
        s.stop(None)
        pool.shutdown()


@pytest.mark.parametrize("kind", ["grpcio", "isthmus"])
@pytest.mark.parametrize("step", ["done", "is_active", "add_done_callback", "result"])
def test_a_futures_done_callback_may_make_calls_and_wait_for_them(kind: str, step: str) -> None:
    """A `.future()`'s done callback that makes calls on another channel and waits for them
    (a response stream it asks `done()` or `is_active()` of, or gives a callback of its own
    and reads; another future's `result()`) gets their outcomes, as on grpcio, whose
    callbacks run on their channel's thread. isthmus ran callbacks on the one thread that
    completes every future and polls the status watches of response streams: the stream's
    read waited for ever, past its deadline, and a future's result until its timeout, while
    every other future in the process stood still."""
    with _two_channels(kind) as (channel, other):
        seen: queue.Queue[Any] = queue.Queue()

        def callback(_: Any) -> None:
            try:
                if step == "result":
                    future = other.unary_unary("/users.Callbacks/Ok").future(b"B", timeout=20)
                    seen.put(future.result(timeout=20))
                    return
                stream = other.unary_stream("/users.Callbacks/Two")(b"", timeout=20)
                if step == "done":
                    stream.done()
                elif step == "is_active":
                    stream.is_active()
                else:
                    stream.add_done_callback(lambda _: None)
                seen.put((list(stream), stream.code()))
            except BaseException as e:  # what the callback met, for the test to report
                seen.put(e)

        channel.unary_unary("/users.Callbacks/Ok").future(b"A", timeout=20).add_done_callback(callback)
        got = seen.get(timeout=30)
    want = b"ok:B" if step == "result" else ([b"1", b"2"], grpc.StatusCode.OK)
    assert got == want


@pytest.mark.parametrize("kind", ["grpcio", "isthmus"])
def test_a_done_callback_that_blocks_holds_up_no_other_channels_future(kind: str) -> None:
    """While one channel's future's done callback blocks, another channel's future completes
    and runs its own callbacks, as on grpcio (a thread per channel runs them). The blocked
    callback here waits for the other's, so before, on isthmus's one completion thread, the
    two waited for each other until the test gave up. The first call ends only once its
    callback is added: one added to a call that is over runs at once on the adding thread
    (grpcio's too), which under load made the grpcio case wait on itself."""
    _HELD.clear()
    with _two_channels(kind) as (channel, other):
        other.unary_unary("/users.Callbacks/Ok")(b"warm", timeout=20)
        second_ran = threading.Event()
        outcome: queue.Queue[bool] = queue.Queue()
        first = channel.unary_unary("/users.Callbacks/Held").future(b"A", timeout=20)
        first.add_done_callback(lambda _: outcome.put(second_ran.wait(20)))
        _HELD.set()
        first.result(timeout=20)
        second = other.unary_unary("/users.Callbacks/Ok").future(b"B", timeout=20)
        second.add_done_callback(lambda _: second_ran.set())
        assert outcome.get(timeout=30), "the other channel's callback did not run while the first blocked"


@pytest.mark.parametrize("kind", ["grpcio", "isthmus"])
def test_a_call_on_a_closed_channel_raises_valueerror(kind: str) -> None:
    """Every kind of call on a closed channel raises ValueError at once, in grpcio's words: a
    retry loop that retries UNAVAILABLE (what isthmus said) then stops. Calls in progress at
    the close still end CANCELLED (`test_closing_the_channel_ends_every_call_in_progress`)."""
    with _two_channels(kind) as (channel, _):
        channel.close()
        on_closed = "Cannot invoke RPC on closed channel!"
        closed = "Cannot invoke RPC: Channel closed!"
        calls: dict[str, tuple[Callable[[], Any], str]] = {
            "unary": (lambda: channel.unary_unary("/users.Callbacks/Ok")(b""), on_closed),
            "with_call": (lambda: channel.unary_unary("/users.Callbacks/Ok").with_call(b""), on_closed),
            "future": (lambda: channel.unary_unary("/users.Callbacks/Ok").future(b""), closed),
            "server stream": (lambda: channel.unary_stream("/users.Callbacks/Two")(b""), closed),
            "bidi": (lambda: channel.stream_stream("/users.Callbacks/Two")(iter(())), closed),
            "client stream future": (
                lambda: channel.stream_unary("/users.Callbacks/Ok").future(iter(())),
                closed,
            ),
        }
        for name, (call, words) in calls.items():
            with pytest.raises(ValueError) as raised:
                call()
            assert str(raised.value) == words, name


@pytest.mark.parametrize("kind", ["grpcio", "isthmus"])
def test_the_servers_threads_go_back_to_a_shared_pool_that_has_other_work(kind: str) -> None:
    """An application's task submitted to the thread pool its server uses runs at once after
    a burst of calls, and so does a second server's call on the same pool, as with grpcio,
    which takes a thread per call. isthmus's loops held the pool's threads, waiting for more
    calls, for 2 s after the last one."""
    pool = futures.ThreadPoolExecutor(1)
    module: Any = grpc if kind == "grpcio" else isthmus
    servers, channels = [], []
    try:
        for _ in range(2):
            address = fresh("shm") if kind == "isthmus" else grpcio_target(fresh("unix"))
            s = module.server(pool)
            s.add_generic_rpc_handlers((_CALLBACKS,))
            s.add_insecure_port(address)
            s.start()
            servers.append(s)
            channels.append(module.insecure_channel(address))
        a, b = (c.unary_unary("/users.Callbacks/Ok") for c in channels)
        for f in [a.future(b"", timeout=20) for _ in range(4)]:
            f.result(timeout=20)
        began = time.monotonic()
        pool.submit(lambda: None).result(timeout=20)
        b(b"", timeout=20)
        took = time.monotonic() - began
        assert took < 1.0, f"the task and the other server's call took {took:.2f} s"
    finally:
        for c in channels:
            c.close()
        for s in servers:
            s.stop(None)
        pool.shutdown()


def _started(kind: str, threads: int, **kwargs: Any) -> tuple[Any, str, Any, futures.ThreadPoolExecutor]:
    """A started blocking server of `kind` (`grpcio` or `isthmus`) made with `kwargs`, on one
    fresh port: its module, address, server and pool (the caller stops and shuts them down)."""
    module: Any = grpc if kind == "grpcio" else isthmus
    address = fresh("shm") if kind == "isthmus" else grpcio_target(fresh("unix"))
    pool = futures.ThreadPoolExecutor(threads)
    server = module.server(pool, **kwargs)
    server.add_insecure_port(address)
    server.start()
    return module, address, server, pool


_REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="unset")


def _remembers(request: bytes, context: grpc.ServicerContext) -> bytes:
    """Answers what the ContextVar held when the call came, and sets it (never resets it)."""
    seen = _REQUEST_ID.get()
    _REQUEST_ID.set(request.decode())
    return seen.encode()


class _ReplacingInterceptor(grpc.ServerInterceptor):
    """Passes each call on with its details `_replace`d and unpacked, as interceptors written
    against grpcio's named tuple do."""

    def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        method, _metadata = handler_call_details
        return continuation(handler_call_details._replace(method=method))


@pytest.mark.parametrize("kind", ["grpcio", "isthmus"])
def test_each_call_runs_in_a_context_of_its_own_and_interceptors_see_a_named_tuple(kind: str) -> None:
    """As grpcio's server: a ContextVar one call set (and did not reset) is unset in the next
    call served on the same thread (isthmus's leaked it), and an interceptor may `_replace`
    or unpack its HandlerCallDetails, a named tuple (isthmus's failed every call UNKNOWN)."""
    generic = grpc.method_handlers_generic_handler(
        "users.Vars", {"Remember": grpc.unary_unary_rpc_method_handler(_remembers)}
    )
    # One thread serves every call.
    module, address, s, pool = _started(kind, 1, handlers=(generic,), interceptors=(_ReplacingInterceptor(),))
    try:
        with module.insecure_channel(address) as channel:
            remember = channel.unary_unary("/users.Vars/Remember")
            assert [remember(b"first", timeout=20), remember(b"second", timeout=20)] == [b"unset", b"unset"]
    finally:
        s.stop(None)
        pool.shutdown()


def test_a_port_added_after_start_is_refused() -> None:
    """grpc's servers take ports "only before starting". A port added after, isthmus's bound and
    said its number, and nothing served it: its clients waited for their deadline. grpcio's does
    the same (its port 1, then DEADLINE_EXCEEDED, checked by hand); isthmus's raises RuntimeError
    instead, as for any port it cannot serve."""
    pool = futures.ThreadPoolExecutor(1)
    s = isthmus.server(pool)
    s.add_insecure_port(fresh("shm"))
    s.start()
    try:
        with pytest.raises(RuntimeError, match="ports can no longer be bound"):
            s.add_insecure_port(fresh("shm"))
    finally:
        s.stop(None)
        pool.shutdown()


@pytest.mark.parametrize("kind", ["grpcio", "isthmus"])
def test_a_server_dropped_without_a_stop_stops(kind: str) -> None:
    """grpcio's server stops when it is dropped (its `__del__`), and its calls fail
    UNAVAILABLE. isthmus's served on for the rest of the process, with its ports, its
    dispatcher thread and its loops, which held it."""
    module, address, s, pool = _started(kind, 2, handlers=(_CALLBACKS,))
    try:
        with module.insecure_channel(address) as channel:
            ok = channel.unary_unary("/users.Callbacks/Ok")
            assert ok(b"served", timeout=20) == b"ok:served"
            del s
            gc.collect()
            # grpcio's serving thread notices within a second: calls go on until then.
            end, code = time.monotonic() + 20, None
            while code is not grpc.StatusCode.UNAVAILABLE and time.monotonic() < end:
                try:
                    ok(b"dropped", timeout=5)
                    time.sleep(0.05)
                except grpc.RpcError as e:
                    code = e.code()
            assert code is grpc.StatusCode.UNAVAILABLE, code
    finally:
        pool.shutdown()


@pytest.mark.parametrize("kind", ["grpcio", "isthmus", "isthmus.aio"])
def test_a_unary_method_sent_no_request_is_unimplemented(kind: str) -> None:
    """A client that half-closes a unary method's call with no request (a stub of another
    shape): grpcio's server ends it UNIMPLEMENTED, "requires exactly one request message".
    isthmus's ended it INTERNAL. (grpc.aio's leaves it to the client's deadline.)"""
    generic = grpc.method_handlers_generic_handler(
        "users.Vars", {"Remember": grpc.unary_unary_rpc_method_handler(_remembers)}
    )
    if kind == "isthmus.aio":
        address = fresh("shm")

        async def run() -> grpc.StatusCode:
            server = isthmus.aio.server(handlers=(generic,))
            server.add_insecure_port(address)
            await server.start()
            try:
                async with isthmus.aio.insecure_channel(address) as channel:
                    try:
                        await channel.stream_unary("/users.Vars/Remember")(iter(()), timeout=20)
                    except grpc.aio.AioRpcError as e:
                        assert "requires exactly one request message" in (e.details() or "")
                        return e.code()
                    raise AssertionError("a unary call with no request succeeded")
            finally:
                await server.stop(None)

        assert asyncio.run(run()) is grpc.StatusCode.UNIMPLEMENTED
        return
    module, address, s, pool = _started(kind, 1, handlers=(generic,))
    try:
        with module.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as caught:
            channel.stream_unary("/users.Vars/Remember")(iter(()), timeout=20)
        assert caught.value.code() is grpc.StatusCode.UNIMPLEMENTED
        assert "requires exactly one request message" in (caught.value.details() or "")
    finally:
        s.stop(None)
        pool.shutdown()


@pytest.mark.parametrize("kind", ["grpcio", "isthmus"])
def test_stop_without_grace_returns_once_the_server_has_stopped(kind: str) -> None:
    """As grpcio's: `stop(None)` returns once the server has stopped, its event already set,
    while a handler still runs (isthmus's returned at once and stopped a moment later); the
    call in progress ends UNAVAILABLE."""
    started, release = threading.Event(), threading.Event()

    def held(request: bytes, context: grpc.ServicerContext) -> bytes:
        started.set()
        release.wait(30)
        return request

    generic = grpc.method_handlers_generic_handler(
        "users.Stop", {"Held": grpc.unary_unary_rpc_method_handler(held)}
    )
    module, address, s, pool = _started(kind, 2, handlers=(generic,))
    try:
        with module.insecure_channel(address) as channel:
            call = channel.unary_unary("/users.Stop/Held").future(b"x", timeout=30)
            assert started.wait(30)
            assert s.stop(None).is_set()
            assert call.exception(30).code() is grpc.StatusCode.UNAVAILABLE
    finally:
        release.set()
        s.stop(None)
        pool.shutdown()


@pytest.mark.parametrize("kind", ["grpcio", "isthmus"])
def test_a_server_with_no_port_serves_until_stopped(kind: str) -> None:
    """As grpcio's: a server started with no port is still serving, so `wait_for_termination`
    waits for its timeout (isthmus's returned at once, as if stopped) and ends with `stop`."""
    module: Any = grpc if kind == "grpcio" else isthmus
    pool = futures.ThreadPoolExecutor(1)
    s = module.server(pool)
    s.start()
    try:
        assert s.wait_for_termination(0.2) is True
        s.stop(None)
        assert s.wait_for_termination(30) is False
    finally:
        s.stop(None)
        pool.shutdown()


@pytest.mark.parametrize("kind", ["grpcio", "isthmus"])
def test_a_handler_reads_its_details_as_bytes(kind: str) -> None:
    """As grpcio's blocking server: `context.details()` is None until set, then the UTF-8 of
    what was set (isthmus's gave the `str`)."""

    def details(request: bytes, context: grpc.ServicerContext) -> bytes:
        before = context.details()
        context.set_details("caf\u00e9")
        return repr((before, context.details())).encode()

    generic = grpc.method_handlers_generic_handler(
        "users.Details", {"Read": grpc.unary_unary_rpc_method_handler(details)}
    )
    module, address, s, pool = _started(kind, 1, handlers=(generic,))
    try:
        with module.insecure_channel(address) as channel:
            reply = channel.unary_unary("/users.Details/Read")(b"", timeout=30)
        assert reply == repr((None, "caf\u00e9".encode())).encode()
    finally:
        s.stop(None)
        pool.shutdown()


@pytest.mark.parametrize("kind", ["grpcio", "isthmus"])
def test_a_client_refuses_the_metadata_grpcio_refuses(kind: str) -> None:
    """As grpcio's client, before any connection: a key with an upper-case letter, a key or
    value gRPC cannot carry are ValueError "metadata was invalid: …", a `str` on a `-bin` key
    a TypeError, for every shape of call (isthmus lower-cased the key and sent the `str`)."""
    module: Any = grpc if kind == "grpcio" else isthmus
    refused = (
        [("X-Request-Id", "a")],
        [("trace-bin", "abc")],
        [("ok", "v"), ("bad key", "x")],
        [("k", "\n")],
    )
    seen = []
    with module.insecure_channel(grpcio_target(fresh("unix"))) as channel:  # nothing listens there
        unary, stream = channel.unary_unary("/users.M/Unary"), channel.unary_stream("/users.M/Stream")
        calls = (
            lambda md: unary(b"", metadata=md, timeout=5),
            lambda md: unary.future(b"", metadata=md, timeout=5).result(),
            lambda md: list(stream(b"", metadata=md, timeout=5)),
        )
        for metadata in refused:
            for call in calls:
                with pytest.raises((ValueError, TypeError)) as caught:
                    call(metadata)
                seen.append((type(caught.value).__name__, str(caught.value)))
    assert seen == [
        *[("ValueError", "metadata was invalid: [('X-Request-Id', 'a')]")] * 3,
        *[("TypeError", "Binary metadata key=\"trace-bin\" expected bytes, got <class 'str'>")] * 3,
        *[("ValueError", "metadata was invalid: [('ok', 'v'), ('bad key', 'x')]")] * 3,
        *[("ValueError", "metadata was invalid: [('k', '\\n')]")] * 3,
    ]


@pytest.mark.parametrize("kind", ["grpcio", "isthmus"])
def test_the_call_with_call_returns_is_a_done_future(kind: str) -> None:
    """As grpcio's: the call `with_call` returns with its response is a done `grpc.Future` of
    that response (isthmus's had no `result`, `add_done_callback`… and raised
    AttributeError)."""
    generic = grpc.method_handlers_generic_handler(
        "users.WithCall", {"Echo": grpc.unary_unary_rpc_method_handler(lambda request, context: request)}
    )
    module, address, s, pool = _started(kind, 1, handlers=(generic,))
    try:
        with module.insecure_channel(address) as channel:
            response, call = channel.unary_unary("/users.WithCall/Echo").with_call(b"hi", timeout=30)
        called = []
        call.add_done_callback(lambda done: called.append(done is call))
        assert isinstance(call, grpc.Future)
        assert (response, call.result(), call.exception(), call.traceback()) == (b"hi", b"hi", None, None)
        assert (call.done(), call.running(), call.cancelled(), call.cancel(), called) == (
            True,
            False,
            False,
            False,
            [True],
        )
        assert (call.code(), call.details(), call.debug_error_string()) == (grpc.StatusCode.OK, "", "")
    finally:
        s.stop(None)
        pool.shutdown()


@pytest.mark.parametrize("kind", ["grpcio", "isthmus"])
def test_unsubscribe_ends_one_subscription_of_a_callback(kind: str) -> None:
    """As grpcio's: a callback subscribed twice and unsubscribed once is still told the
    channel's changes (isthmus's unsubscribe ended both)."""
    module: Any = grpc if kind == "grpcio" else isthmus
    address = grpcio_target(fresh("unix"))  # nothing listens there yet
    states: queue.Queue[grpc.ChannelConnectivity] = queue.Queue()
    pool = futures.ThreadPoolExecutor(1)
    s = module.server(pool)
    try:
        with module.insecure_channel(address) as channel:
            channel.subscribe(states.put)
            channel.subscribe(states.put)
            told = [states.get(timeout=30), states.get(timeout=30)]  # each told the state now
            assert told[0] is told[1]
            channel.unsubscribe(states.put)
            s.add_insecure_port(address)
            s.start()
            grpc.channel_ready_future(channel).result(timeout=30)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if states.get(timeout=30) is grpc.ChannelConnectivity.READY:
                    break
            else:
                raise AssertionError("the callback still subscribed was not told READY")
            channel.unsubscribe(states.put)
    finally:
        s.stop(None)
        pool.shutdown()


@pytest.mark.parametrize("kind", ["grpcio", "isthmus"])
def test_a_connectivity_callback_runs_on_a_thread_of_its_own(kind: str) -> None:
    """As grpcio's: a callback subscribed while another subscription watches the channel runs
    on a delivery thread, not on the subscriber's, so one that takes a lock its subscriber
    holds waits for it (isthmus's ran it on the subscriber's thread: a deadlock, here a
    failed acquire)."""
    module: Any = grpc if kind == "grpcio" else isthmus
    first: queue.Queue[grpc.ChannelConnectivity] = queue.Queue()
    took: queue.Queue[tuple[bool, bool]] = queue.Queue()
    lock = threading.Lock()
    subscriber = threading.current_thread()

    def locking(state: grpc.ChannelConnectivity) -> None:
        got = lock.acquire(timeout=5)
        if got:
            lock.release()
        took.put((got, threading.current_thread() is subscriber))

    with module.insecure_channel(grpcio_target(fresh("unix"))) as channel:
        channel.subscribe(first.put)
        first.get(timeout=30)  # the channel is watched now
        with lock:
            channel.subscribe(locking)
        assert took.get(timeout=30) == (True, False)
        channel.unsubscribe(locking)
        channel.unsubscribe(first.put)


def _count_requests(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
    return b"%d" % sum(1 for _ in requests)


@pytest.mark.parametrize("kind", ["grpcio", "isthmus"])
def test_a_request_stream_that_is_not_iterable_fails_its_call(kind: str) -> None:
    """As grpcio's: a streaming call given something that is not iterable (a single message
    by mistake) fails UNKNOWN "Exception iterating requests!", an RpcError, however it is
    called (isthmus's raised the TypeError in the caller)."""
    generic = grpc.method_handlers_generic_handler(
        "users.Requests",
        {
            "Count": grpc.stream_unary_rpc_method_handler(_count_requests),
            "Echo": grpc.stream_stream_rpc_method_handler(lambda requests, context: requests),
        },
    )
    module, address, s, pool = _started(kind, 2, handlers=(generic,))
    try:
        with module.insecure_channel(address) as channel:
            count, echo = (
                channel.stream_unary("/users.Requests/Count"),
                channel.stream_stream("/users.Requests/Echo"),
            )
            calls = (
                lambda: count(object(), timeout=30),
                lambda: count.with_call(object(), timeout=30),
                lambda: count.future(object(), timeout=30).result(),
                lambda: list(echo(object(), timeout=30)),
            )
            for call in calls:
                with pytest.raises(grpc.RpcError) as caught:
                    call()
                assert (caught.value.code(), caught.value.details()) == (
                    grpc.StatusCode.UNKNOWN,
                    "Exception iterating requests!",
                )
    finally:
        s.stop(None)
        pool.shutdown()


@pytest.mark.parametrize("kind", ["grpcio", "isthmus"])
def test_a_future_its_caller_drops_is_cancelled_unless_it_has_callbacks(kind: str) -> None:
    """As grpcio's: a unary `.future()` its caller lets go of is cancelled (its handler sees
    the call end), and one with a done callback runs on and calls it. isthmus's completion
    thread held every future, and a dropped one ran to its end."""
    ended: queue.Queue[str] = queue.Queue()
    started, release = threading.Semaphore(0), threading.Event()

    def held(request: bytes, context: grpc.ServicerContext) -> bytes:
        started.release()
        deadline = time.monotonic() + 30
        while context.is_active() and time.monotonic() < deadline and not release.is_set():
            time.sleep(0.01)
        ended.put(request.decode() + (" active" if context.is_active() else " cancelled"))
        return request

    generic = grpc.method_handlers_generic_handler(
        "users.Drop", {"Held": grpc.unary_unary_rpc_method_handler(held)}
    )
    module, address, s, pool = _started(kind, 2, handlers=(generic,))
    try:
        with module.insecure_channel(address) as channel:
            method = channel.unary_unary("/users.Drop/Held")
            dropped = method.future(b"dropped", timeout=60)
            assert started.acquire(timeout=30)  # the handler runs
            del dropped
            gc.collect()
            assert ended.get(timeout=30) == "dropped cancelled"
            done: queue.Queue[bytes] = queue.Queue()
            method.future(b"called back", timeout=60).add_done_callback(lambda f: done.put(f.result()))
            assert started.acquire(timeout=30)
            gc.collect()
            release.set()
            assert ended.get(timeout=30) == "called back active"
            assert done.get(timeout=30) == b"called back"
    finally:
        release.set()
        s.stop(None)
        pool.shutdown()


class _BlockingInterceptor(grpc.ServerInterceptor):
    def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        return continuation(handler_call_details)


@pytest.mark.parametrize("kind", ["grpc.aio", "isthmus.aio"])
def test_an_asyncio_server_refuses_a_blocking_servers_interceptor(kind: str) -> None:
    """As grpc.aio's: `server(interceptors=[...])` given a `grpc.ServerInterceptor` (the blocking
    server's kind, whose `intercept_service` returns a handler, not an awaitable) raises
    ValueError at once. isthmus.aio took it, and failed, UNKNOWN, only the calls it refused."""
    module: Any = grpc.aio if kind == "grpc.aio" else isthmus.aio

    async def make() -> None:
        module.server(interceptors=[_BlockingInterceptor()])

    with pytest.raises(ValueError, match="Interceptor must be ServerInterceptor"):
        asyncio.run(make())
