"""grpcio's and grpc.aio's behaviours that isthmus keeps, each run with the same code on a grpc
channel and on isthmus channels (over a Unix socket and over shm://), expecting the same result;
isthmus.aio's under asyncio's own loop and under uvloop."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from concurrent import futures
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any

import grpc
import grpc.aio
import pytest
from clients import run_on as run
from peer import LOOP_ENV, PATIENCE, Peer, Served, fresh, grpcio_target, serve

import isthmus
import isthmus.aio

# (client API, transport, event loop)
CLIENTS = [
    ("grpc.aio", "unix", "asyncio"),
    ("isthmus.aio", "unix", "asyncio"),
    ("isthmus.aio", "shm", "asyncio"),
    ("isthmus.aio", "shm", "uvloop"),
]


@pytest.fixture(params=CLIENTS, ids="-".join)
def client(request: pytest.FixtureRequest, servers: Callable[[str], Any]) -> tuple[Callable[[], Any], str]:
    """A function that makes a channel of the client API to the Rust server, and the loop."""
    api, transport, loop = request.param
    address = str(servers("rust").addresses[transport])
    if api == "grpc.aio":
        return (lambda: grpc.aio.insecure_channel(grpcio_target(address))), loop
    return (lambda: isthmus.aio.insecure_channel(address)), loop


def test_close_cancels_the_calls_in_progress(
    client: tuple[Callable[[], Any], str], pb_grpc: ModuleType, pb: ModuleType
) -> None:
    make, loop = client

    async def test() -> None:
        channel = make()
        stub = pb_grpc.EchoStub(channel)
        assert (await stub.Unary(pb.EchoRequest(seq=1), timeout=60)).seq == 1
        slow = asyncio.ensure_future(stub.Unary(pb.EchoRequest(sleep_ms=30_000), timeout=60))
        stream = stub.Bidi(timeout=60)
        await stream.write(pb.EchoRequest(seq=2))
        # A round trip: `slow`'s call started meanwhile (grpc.aio starts it in a task scheduled
        # before the stream's; isthmus.aio when made).
        assert (await stream.read()).seq == 2
        assert not slow.done()
        start = time.monotonic()
        await channel.close()
        # Far below the slow call's 30 s (so close did not wait for it), and far above what a
        # stalled machine adds.
        assert time.monotonic() - start < 15
        with pytest.raises(asyncio.CancelledError):
            await slow
        if isinstance(channel, isthmus.aio.Channel):
            # grpc.aio cancels only calls that a task awaits: a read of this stream after the
            # close waits for ever there. isthmus cancels every call in progress.
            assert stream.cancelled() and await stream.code() == grpc.StatusCode.CANCELLED
        with pytest.raises(grpc.aio.UsageError):
            await stub.Unary(pb.EchoRequest(), timeout=60)

    run(loop, test)


def test_close_with_a_grace_lets_calls_finish_within_it(
    client: tuple[Callable[[], Any], str], pb_grpc: ModuleType, pb: ModuleType
) -> None:
    make, loop = client

    async def test() -> None:
        channel = make()
        stub = pb_grpc.EchoStub(channel)
        await stub.Unary(pb.EchoRequest(), timeout=60)
        # The quick call (half a second) leaves 2.5 s of the grace to spare, for a stalled machine.
        grace = 3.0
        quick = asyncio.ensure_future(stub.Unary(pb.EchoRequest(seq=3, sleep_ms=500), timeout=60))
        slow = asyncio.ensure_future(stub.Unary(pb.EchoRequest(sleep_ms=30_000), timeout=60))
        await asyncio.sleep(0)  # one turn of the loop: grpc.aio starts each call in a task
        assert not quick.done()  # in progress when the close begins
        start = time.monotonic()
        await channel.close(grace=grace)
        waited = time.monotonic() - start
        # All of the grace (the slow call outlasts it), and far from the slow call's 30 s.
        assert 0.9 * grace <= waited < grace + 12, waited
        assert (await quick).seq == 3  # finished within the grace
        with pytest.raises(asyncio.CancelledError):
            await slow  # cancelled when the grace ran out

    run(loop, test)


def test_a_calls_status_comes_without_reading_to_the_end(
    client: tuple[Callable[[], Any], str], pb_grpc: ModuleType, pb: ModuleType
) -> None:
    """`code()`, `details()` and `trailing_metadata()` of a streaming call end when the call
    does: once its responses were read but not the end of the stream, and at its deadline with
    nothing read or sent. grpc.aio's wait for ever while responses are left unread; isthmus's
    read them on, kept for `read`, and end too."""
    make, loop = client

    async def test() -> None:
        async with make() as channel:
            stub = pb_grpc.EchoStub(channel)
            read = stub.ServerStream(pb.StreamRequest(count=2, size=8), timeout=60)
            assert [len((await read.read()).payload) for _ in range(2)] == [8, 8]
            assert await asyncio.wait_for(read.code(), 30) == grpc.StatusCode.OK
            assert await read.details() in ("", None)
            await read.trailing_metadata()

            silent = stub.Bidi(timeout=0.5)  # the server waits for requests that never come
            assert await asyncio.wait_for(silent.code(), 30) == grpc.StatusCode.DEADLINE_EXCEEDED

            if isinstance(channel, isthmus.aio.Channel):
                some = stub.ServerStream(pb.StreamRequest(count=3, size=8), timeout=60)
                assert len((await some.read()).payload) == 8
                assert await asyncio.wait_for(some.code(), 30) == grpc.StatusCode.OK
                assert [len((await some.read()).payload) for _ in range(2)] == [8, 8]
                assert await some.read() is grpc.aio.EOF

    run(loop, test)


def test_a_call_is_read_and_written_one_way_only(
    client: tuple[Callable[[], Any], str], pb_grpc: ModuleType, pb: ModuleType
) -> None:
    """A streaming call's responses are read with `read()` or with `async for`, not both, and a
    call given a request iterator takes no `write()` or `done_writing()`: each mix is grpc.aio's
    UsageError. isthmus.aio allowed both, and a write went in among the iterator's requests."""
    make, loop = client

    async def test() -> None:
        async with make() as channel:
            stub = pb_grpc.EchoStub(channel)
            read = stub.ServerStream(pb.StreamRequest(count=2, size=8), timeout=60)
            assert len((await read.read()).payload) == 8
            with pytest.raises(grpc.aio.UsageError):
                [r async for r in read]
            iterated = stub.ServerStream(pb.StreamRequest(count=2, size=8), timeout=60)
            async for _ in iterated:
                break
            with pytest.raises(grpc.aio.UsageError):
                await iterated.read()
            given = stub.Bidi(iter([pb.EchoRequest(seq=1)]), timeout=60)
            with pytest.raises(grpc.aio.UsageError):
                await given.write(pb.EchoRequest(seq=2))
            with pytest.raises(grpc.aio.UsageError):
                await given.done_writing()
            assert [r.seq async for r in given] == [1]
            # Written, the other way: read with `read()` to the end.
            written = stub.Bidi(timeout=60)
            await written.write(pb.EchoRequest(seq=3))
            await written.done_writing()
            assert (await written.read()).seq == 3
            assert await written.read() is grpc.aio.EOF
            # A call over, its responses all read, reads as over whichever way it was read:
            # EOF, or its error again (isthmus.aio's raised UsageError).
            whole = stub.ServerStream(pb.StreamRequest(count=2, size=8), timeout=60)
            assert [len(r.payload) async for r in whole] == [8, 8]
            assert await whole.read() is grpc.aio.EOF
            aborting = pb.EchoRequest(fail_with=grpc.StatusCode.ABORTED.value[0])
            failing = stub.Bidi(iter([aborting]), timeout=60)
            with pytest.raises(grpc.aio.AioRpcError) as iterating:
                [r async for r in failing]
            with pytest.raises(grpc.aio.AioRpcError) as reading:
                await failing.read()
            assert iterating.value.code() == reading.value.code() == grpc.StatusCode.ABORTED

    run(loop, test)


def test_a_done_callback_added_to_a_finished_call_runs_at_once(
    client: tuple[Callable[[], Any], str], pb_grpc: ModuleType, pb: ModuleType
) -> None:
    """grpc.aio runs a callback added to a call that is over at once, as it is added (isthmus
    ran it on the loop's next turn); one added before the end runs at the end."""
    make, loop = client

    async def test() -> None:
        async with make() as channel:
            stub = pb_grpc.EchoStub(channel)
            unary = stub.Unary(pb.EchoRequest(seq=1), timeout=60)
            early: list[Any] = []
            unary.add_done_callback(early.append)
            await unary
            await asyncio.sleep(0)  # a callback of the end runs on the loop
            assert early == [unary]
            streamed = stub.ServerStream(pb.StreamRequest(count=1, size=8), timeout=60)
            assert [len(r.payload) async for r in streamed] == [8]
            for call in (unary, streamed):
                seen: list[Any] = []
                call.add_done_callback(seen.append)
                assert seen == [call]

    run(loop, test)


def _boom(_: Any) -> bytes:
    raise ValueError("cannot serialize this")


def test_a_response_deserializer_that_raises_fails_the_call_internal(servers: Callable[[str], Any]) -> None:
    """As grpcio does: INTERNAL, "Exception deserializing response!", for a blocking unary
    call with metadata and without (isthmus makes the second in one native step), over every
    transport; a request that is no `bytes`, with no serializer, raises TypeError."""

    def boom(_: bytes) -> Any:
        raise ValueError("cannot deserialize this")

    want = (grpc.StatusCode.INTERNAL, "Exception deserializing response!")
    addresses = servers("rust").addresses
    channels = [grpc.insecure_channel(grpcio_target(str(addresses["unix"])))]
    channels += [isthmus.insecure_channel(str(addresses[t])) for t in ("shm", "unix", "http")]
    for channel in channels:
        with channel:
            for metadata in (None, [("x-a", "1")]):
                call = channel.unary_unary("/conformance.Echo/Unary", response_deserializer=boom)
                with pytest.raises(grpc.RpcError) as caught:
                    call(b"", metadata=metadata, timeout=60)
                assert (caught.value.code(), caught.value.details()) == want, (channel, metadata)
                with pytest.raises(TypeError):
                    channel.unary_unary("/conformance.Echo/Unary")("text", metadata=metadata, timeout=60)


def test_a_request_serializer_that_raises_fails_the_call_internal(servers: Callable[[str], Any]) -> None:
    """As grpcio's sync API does (grpc.aio instead logs the error and sends an empty request):
    INTERNAL, "Exception serializing request!"."""
    address = str(servers("rust").addresses["unix"])
    with grpc.insecure_channel(grpcio_target(address)) as channel, pytest.raises(grpc.RpcError) as caught:
        channel.unary_unary("/conformance.Echo/Unary", request_serializer=_boom)(object(), timeout=60)
    want = (caught.value.code(), caught.value.details())
    assert want == (grpc.StatusCode.INTERNAL, "Exception serializing request!")

    for loop in ("asyncio", "uvloop"):
        for transport in ("unix", "shm"):

            async def test(transport: str = transport) -> None:
                async with isthmus.aio.insecure_channel(servers("rust").addresses[transport]) as channel:
                    unary = channel.unary_unary("/conformance.Echo/Unary", request_serializer=_boom)
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await unary(object(), timeout=60)
                    assert (caught.value.code(), caught.value.details()) == want
                    stream = channel.stream_stream("/conformance.Echo/Bidi", request_serializer=_boom)
                    call = stream(timeout=60)
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await call.write(object())
                    assert (caught.value.code(), caught.value.details()) == want
                    assert await call.code() == grpc.StatusCode.INTERNAL
                    # A unary request of a server stream is encoded as the call starts.
                    path = "/conformance.Echo/ServerStream"
                    call = channel.unary_stream(path, request_serializer=_boom)(object(), timeout=60)
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await call.read()
                    assert (caught.value.code(), caught.value.details()) == want

            run(loop, test)


def _blocking_channels(servers: Callable[[str], Any]) -> list[Any]:
    """grpcio's channel to the Rust server over its Unix socket, and isthmus's over shm:// and
    the Unix socket."""
    addresses = servers("rust").addresses
    channels = [grpc.insecure_channel(grpcio_target(str(addresses["unix"])))]
    return channels + [isthmus.insecure_channel(str(addresses[t])) for t in ("shm", "unix")]


def test_a_request_that_serializes_to_none_fails_the_call_internal(servers: Callable[[str], Any]) -> None:
    """grpcio's sync API reads a request that serializes to None (a serializer that returns
    None, or None with no serializer) as a serializer's failure: INTERNAL "Exception serializing
    request!", on every shape, its future and with_call. isthmus raised TypeError from a unary
    call and failed the streaming ones UNKNOWN "Exception iterating requests!"."""
    want = (grpc.StatusCode.INTERNAL, "Exception serializing request!")

    def calls(channel: Any, serializer: Callable[[Any], Any] | None) -> list[Callable[[], Any]]:
        unary = channel.unary_unary("/conformance.Echo/Unary", request_serializer=serializer)
        server_stream = channel.unary_stream("/conformance.Echo/ServerStream", request_serializer=serializer)
        client_stream = channel.stream_unary("/conformance.Echo/ClientStream", request_serializer=serializer)
        bidi = channel.stream_stream("/conformance.Echo/Bidi", request_serializer=serializer)
        return [
            lambda: unary(None, timeout=60),
            lambda: unary.with_call(None, timeout=60),
            lambda: unary.future(None, timeout=60).result(),
            lambda: list(server_stream(None, timeout=60)),
            lambda: client_stream(iter([b"", None]), timeout=60),
            lambda: list(bidi(iter([b"", None]), timeout=60)),
        ]

    for channel in _blocking_channels(servers):
        with channel:
            for serializer in (None, lambda _: None):
                for i, call in enumerate(calls(channel, serializer)):
                    with pytest.raises(grpc.RpcError) as caught:
                        call()
                    assert (caught.value.code(), caught.value.details()) == want, (channel, serializer, i)

    # isthmus.aio's the same (grpc.aio sends it as an empty message), a unary call with and
    # without metadata (the second in one native step, which raised TypeError).
    async def asyncio_calls() -> None:
        async with isthmus.aio.insecure_channel(servers("rust").addresses["shm"]) as channel:
            for serializer in (None, lambda _: None):
                unary = channel.unary_unary("/conformance.Echo/Unary", request_serializer=serializer)
                for metadata in (None, [("x-a", "1")]):
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await unary(None, metadata=metadata, timeout=60)
                    assert (caught.value.code(), caught.value.details()) == want, (serializer, metadata)

    run("asyncio", asyncio_calls)


def test_a_failed_futures_traceback_is_a_traceback(servers: Callable[[str], Any], pb: ModuleType) -> None:
    """grpcio's `traceback()` of a future whose call failed is the traceback of raising its
    error, never None; isthmus's was None until the error had been raised."""
    failing = pb.EchoRequest(fail_with=grpc.StatusCode.NOT_FOUND.value[0], fail_message="no")
    for channel in _blocking_channels(servers):
        with channel:
            unary = channel.unary_unary("/conformance.Echo/Unary")
            future = unary.future(failing.SerializeToString(), timeout=60)
            assert isinstance(future.exception(), grpc.RpcError), channel
            assert isinstance(future.traceback(), TracebackType), channel


def test_a_metadata_value_neither_str_nor_bytes_raises_typeerror(servers: Callable[[str], Any]) -> None:
    """As grpcio's: TypeError (isthmus raised ValueError, which an `except TypeError` misses)."""
    for channel in _blocking_channels(servers):
        with channel, pytest.raises(TypeError):
            channel.unary_unary("/conformance.Echo/Unary")(b"", metadata=(("x-a", 5),), timeout=60)


LIMITED = [("grpc.max_send_message_length", 1000), ("grpc.max_receive_message_length", 1000)]


@pytest.mark.parametrize(
    "api,transport",
    [
        ("grpcio", "unix"),
        ("isthmus", "unix"),
        ("isthmus", "shm"),
        ("grpc.aio", "unix"),
        ("isthmus.aio", "unix"),
        ("isthmus.aio", "shm"),
    ],
)
def test_message_size_limits_from_the_channel_options(
    api: str, transport: str, servers: Callable[[str], Any], pb_grpc: ModuleType, pb: ModuleType
) -> None:
    """A request over the send limit, and a reply over the receive limit, fail their calls
    RESOURCE_EXHAUSTED in grpcio's words; the channel goes on."""
    address = str(servers("rust").addresses[transport])
    target = grpcio_target(address) if api.startswith("grpc") else address
    over, under = pb.EchoRequest(payload=b"x" * 2000), pb.EchoRequest(seq=5, payload=b"x" * 100)
    too_large = (grpc.StatusCode.RESOURCE_EXHAUSTED, "CLIENT: Sent message larger than max (2003 vs. 1000)")
    too_large_reply = (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "CLIENT: Received message larger than max (2014 vs. 1000)",
    )
    if api in ("grpcio", "isthmus"):
        make = grpc.insecure_channel if api == "grpcio" else isthmus.insecure_channel
        with make(target, options=LIMITED) as channel:
            stub = pb_grpc.EchoStub(channel)
            with pytest.raises(grpc.RpcError) as sent:
                stub.Unary(over, timeout=60)
            assert (sent.value.code(), sent.value.details()) == too_large
            with pytest.raises(grpc.RpcError) as streamed:
                stub.ClientStream(iter([over]), timeout=60)
            assert (streamed.value.code(), streamed.value.details()) == too_large
            with pytest.raises(grpc.RpcError) as received:
                stub.ServerStream(pb.StreamRequest(count=1, size=2000), timeout=60).next()
            assert (received.value.code(), received.value.details()) == too_large_reply
            assert stub.Unary(under, timeout=60).seq == 5
        return

    async def test() -> None:
        make = grpc.aio.insecure_channel if api == "grpc.aio" else isthmus.aio.insecure_channel
        async with make(target, options=LIMITED) as channel:
            stub = pb_grpc.EchoStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as sent:
                await stub.Unary(over, timeout=60)
            assert (sent.value.code(), sent.value.details()) == too_large

            async def one() -> AsyncIterator[Any]:
                yield over

            with pytest.raises(grpc.aio.AioRpcError) as streamed:
                await stub.ClientStream(one(), timeout=60)
            assert (streamed.value.code(), streamed.value.details()) == too_large
            with pytest.raises(grpc.aio.AioRpcError) as received:
                async for _ in stub.ServerStream(pb.StreamRequest(count=1, size=2000), timeout=60):
                    pass
            assert (received.value.code(), received.value.details()) == too_large_reply
            assert (await stub.Unary(under, timeout=60)).seq == 5

    for loop in ["asyncio", "uvloop"] if api == "isthmus.aio" else ["asyncio"]:
        run(loop, test)


def parity_server(api: str, *flags: str, loop: str = "asyncio") -> tuple[Served, list[str]]:
    """A `parity_server` process of `api` (with `flags`; an asyncio one on `loop`) on a fresh
    Unix socket, and over shm:// too unless grpc's."""
    transports = ["unix"] if api.startswith("grpc") else ["unix", "shm"]
    targets = [fresh(t) for t in transports]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parent), env.get("PYTHONPATH")])
    )
    env[LOOP_ENV] = loop
    served = Served(api, Peer([sys.executable, "-m", "parity_server", api, *flags, *targets], env))
    served.addresses = {t: t for t in targets}  # so that `close` removes the socket
    return served, targets


# (asyncio server, its event loop)
AIO_SERVERS = [("grpc.aio", "asyncio"), ("isthmus-aio", "asyncio"), ("isthmus-aio", "uvloop")]


def _handler_started(served: Served, loop: str) -> None:
    """Waits until `/parity.Slow/Wait`'s handler started, and checks that it runs on `loop`."""
    module = served.peer.expect("HANDLER-STARTED").split()[1]
    assert module == ("uvloop" if loop == "uvloop" else "asyncio.unix_events"), module


@pytest.mark.parametrize(("api", "loop"), AIO_SERVERS, ids="-".join)
def test_an_asyncio_handler_is_cancelled_when_its_call_ends(api: str, loop: str) -> None:
    """A handler awaiting something else is cancelled (its task gets CancelledError) when the
    client cancels the call or its deadline passes, as grpc.aio's server does."""
    served, targets = parity_server(api, loop=loop)
    try:
        for target in targets:
            with isthmus.insecure_channel(target) as channel:
                wait = channel.unary_unary("/parity.Slow/Wait")
                # The deadline must pass while the handler waits, so after it started: 3 s
                # leaves a loaded machine seconds to start it. The test waits that long.
                call = wait.future(b"", timeout=3.0)
                _handler_started(served, loop)
                with pytest.raises(grpc.RpcError) as caught:
                    call.result(timeout=60)
                assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                served.peer.expect("HANDLER-CANCELLED")
                call = wait.future(b"", timeout=60)
                _handler_started(served, loop)  # cancelled before it started, it never would be
                call.cancel()
                served.peer.expect("HANDLER-CANCELLED")
    finally:
        served.close()


# A client in a process of its own: it calls `/parity.Slow/Wait` on the target it is given, with
# a deadline far off, and waits for the reply (which never comes before it is killed).
_WAITING_CLIENT = """
import sys
import isthmus
with isthmus.insecure_channel(sys.argv[1]) as channel:
    channel.unary_unary("/parity.Slow/Wait")(b"", timeout=600)
"""


@pytest.mark.parametrize(("api", "loop"), AIO_SERVERS, ids="-".join)
def test_an_asyncio_handler_is_cancelled_when_its_client_process_dies(api: str, loop: str) -> None:
    """A handler awaiting something else is cancelled when its client's process is killed
    (SIGKILL: no cancel is sent, the connection just ends), over every transport, as grpc.aio's
    server does; the server serves the next client."""
    served, targets = parity_server(api, loop=loop)
    try:
        for target in targets:
            client = subprocess.Popen([sys.executable, "-c", _WAITING_CLIENT, target])
            try:
                _handler_started(served, loop)
            finally:
                client.kill()
                client.wait()
            served.peer.expect("HANDLER-CANCELLED")
            with isthmus.insecure_channel(target) as channel:
                check = channel.unary_unary("/grpc.health.v1.Health/Check")
                assert check(b"", timeout=60) == b"\x08\x01"
    finally:
        served.close()


def _guarded(channel: Any) -> tuple[list[Any], list[str]]:
    """What calls to `parity_server`'s intercepted `/parity.Guarded` get (each reply, or the
    call's code and details), and the calls its recording interceptor saw."""
    metadata = (("x-who", "parity"),)

    def outcome(method: str) -> Any:
        try:
            return channel.unary_unary("/parity.Guarded/" + method)(b"hi", metadata=metadata, timeout=60)
        except grpc.RpcError as e:
            return (e.code(), e.details())

    got = [outcome(m) for m in ("Echo", "Denied", "Hidden", "Shout")]
    got.append(list(channel.unary_stream("/parity.Guarded/Twice")(b"ab", metadata=metadata, timeout=60)))
    seen = channel.unary_unary("/parity.Guarded/Seen")(b"", timeout=60)
    return got, seen.decode().splitlines()


# (grpc's server, isthmus's of the same API, the event loop of isthmus's asyncio server)
INTERCEPTED = [
    ("grpcio", "isthmus", "asyncio"),
    ("grpc.aio", "isthmus-aio", "asyncio"),
    ("grpc.aio", "isthmus-aio", "uvloop"),
]


@pytest.mark.parametrize(("grpc_api", "api", "loop"), INTERCEPTED, ids="-".join)
def test_server_interceptors_run_as_grpcs_do(grpc_api: str, api: str, loop: str) -> None:
    """A server's `interceptors=` (`grpc.ServerInterceptor`s for the blocking server,
    `grpc.aio.ServerInterceptor`s for the asyncio one) see every call with its method and
    metadata, in order, and may pass it on, answer it with a handler of their own (one that
    aborts PERMISSION_DENIED), hide its method (UNIMPLEMENTED) or wrap its handler: the same
    calls get the same results from grpc's server and from isthmus's, over every transport."""
    reference, reference_targets = parity_server(grpc_api, "--intercepted")
    try:
        with grpc.insecure_channel(grpcio_target(reference_targets[0])) as channel:
            want = _guarded(channel)
    finally:
        reference.close()
    who = "parity"
    assert want == (
        [
            b"hi",
            (grpc.StatusCode.PERMISSION_DENIED, "denied by the interceptor"),
            (grpc.StatusCode.UNIMPLEMENTED, "Method not found!"),
            b"HI",
            [b"ab", b"ab"],
        ],
        [f"/parity.Guarded/{m} {who}" for m in ("Echo", "Denied", "Hidden", "Shout", "Twice")]
        + ["/parity.Guarded/Seen -"],
    )
    served, targets = parity_server(api, "--intercepted", loop=loop)
    try:
        for channel in _every_client(targets):
            with channel:
                assert _guarded(channel) == want
    finally:
        served.close()


def _every_client(targets: list[str]) -> Iterator[Any]:
    """A blocking isthmus channel to each target, and a grpcio one to each Unix socket."""
    for target in targets:
        yield isthmus.insecure_channel(target)
        if target.startswith("unix://"):
            yield grpc.insecure_channel(grpcio_target(target))


@pytest.mark.parametrize("api", ["grpcio", "grpc.aio", "isthmus", "isthmus-aio"])
def test_a_handler_writes_while_another_thread_of_it_reads(api: str) -> None:
    """A handler's reads and writes do not wait for each other: with one thread (or task) of
    it blocked reading, the handler's replies still go out (grpcio and grpc.aio behave so)."""
    served, targets = parity_server(api)
    try:
        for channel in _every_client(targets):
            with channel:
                replied = threading.Event()

                def requests(replied: threading.Event = replied) -> Iterator[bytes]:
                    # Nothing is sent until the replies that need no request have come.
                    assert replied.wait(60)
                    yield b"a"
                    yield b"b"

                talk = channel.stream_stream("/parity.Duplex/Talk")(requests(), timeout=60)
                first = [next(talk) for _ in range(3)]
                replied.set()
                assert (first, list(talk)) == ([b"first-0", b"first-1", b"first-2"], [b"a+b"])
    finally:
        served.close()


@pytest.mark.parametrize("order", ["first", "last"])
@pytest.mark.parametrize(
    ("api", "loop"),
    [("grpcio", "asyncio"), ("isthmus", "asyncio"), *AIO_SERVERS],
    ids="-".join,
)
def test_the_applications_health_servicer_is_the_one_that_answers(api: str, loop: str, order: str) -> None:
    """A `grpc.health.v1.Health` servicer of the application answers Check (isthmus's own
    health service steps aside), over every transport, with the same answers as under grpcio
    and grpc.aio: added before the ports are, or after them (before `start`), as they allow."""
    served, targets = parity_server(api, *(["--health-last"] if order == "last" else []), loop=loop)
    try:
        for channel in _every_client(targets):
            with channel:
                check = channel.unary_unary("/grpc.health.v1.Health/Check")
                assert check(b"", timeout=60) == b"\x08\x01"  # SERVING
                assert check(b"\x0a\x06custom", timeout=60) == b"\x08\x02"  # NOT_SERVING
                with pytest.raises(grpc.RpcError) as caught:
                    check(b"\x0a\x05other", timeout=60)
                assert (caught.value.code(), caught.value.details()) == (
                    grpc.StatusCode.NOT_FOUND,
                    "no such service: other",
                )
                # The application's servicer has no Watch, and isthmus's own does not stand in.
                with pytest.raises(grpc.RpcError) as caught:
                    next(channel.unary_stream("/grpc.health.v1.Health/Watch")(b"", timeout=60))
                assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        served.close()


@pytest.mark.parametrize(
    ("api", "loop"), [("grpcio", "asyncio"), ("isthmus", "asyncio"), *AIO_SERVERS], ids="-".join
)
def test_a_reply_over_the_servers_send_limit_fails_its_call(api: str, loop: str) -> None:
    """A server's `grpc.max_send_message_length` (100 bytes): a larger reply fails its call
    RESOURCE_EXHAUSTED in grpcio's words, the replies of a stream before it arrive, and the
    next call goes through; over every transport, as under grpcio and grpc.aio."""
    served, targets = parity_server(api, "--send-limit", loop=loop)
    aio = api.endswith("aio")
    # Methods that send their requests back: joined (one reply), and each as it comes.
    join, echo = (
        ("/parity.Plain/Join", "/parity.Plain/Echo")
        if aio
        else ("/parity.Meta/ClientStream", "/parity.Meta/Bidi")
    )
    over = (grpc.StatusCode.RESOURCE_EXHAUSTED, "SERVER: Sent message larger than max (150 vs. 100)")
    try:
        for channel in _every_client(targets):
            with channel:
                joined = channel.stream_unary(join)
                with pytest.raises(grpc.RpcError) as caught:
                    joined(iter([b"x" * 150]), timeout=60)
                assert (caught.value.code(), caught.value.details()) == over
                echoed = channel.stream_stream(echo)(iter([b"small", b"y" * 150, b"never"]), timeout=60)
                assert next(echoed) == b"small"
                with pytest.raises(grpc.RpcError) as caught:
                    next(echoed)
                assert (caught.value.code(), caught.value.details()) == over
                assert joined(iter([b"a", b"b"]), timeout=60) == b"a+b"
    finally:
        served.close()


@pytest.mark.parametrize(
    ("api", "loop"), [("grpcio", "asyncio"), ("isthmus", "asyncio"), *AIO_SERVERS], ids="-".join
)
def test_a_servers_receive_limit_holds_its_requests_not_its_replies(api: str, loop: str) -> None:
    """A server's `grpc.max_receive_message_length` (1000 bytes) refuses a larger request
    RESOURCE_EXHAUSTED, naming its size and the limit, and leaves the server's replies alone: a
    4,999-byte reply arrives; over every transport, as under grpcio and grpc.aio. (Over a Unix
    socket isthmus's handlers answer through its bridge, which held replies to that limit.)"""
    served, targets = parity_server(api, "--receive-limit", loop=loop)
    join = "/parity.Plain/Join" if api.endswith("aio") else "/parity.Meta/ClientStream"
    parts = [bytes([c]) * 999 for c in b"abcde"]
    try:
        for channel in _every_client(targets):
            with channel:
                joined = channel.stream_unary(join)
                assert joined(iter(parts), timeout=60) == b"+".join(parts)
                with pytest.raises(grpc.RpcError) as caught:
                    joined(iter([b"y" * 1500]), timeout=60)
                assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "1500" in caught.value.details(), caught.value.details()
                assert "1000" in caught.value.details(), caught.value.details()
    finally:
        served.close()


WAIT_THEN_CANCEL = """
import asyncio, contextlib, sys
import grpc.aio, isthmus.aio

async def main():
    server = (grpc.aio if sys.argv[1] == "grpc.aio" else isthmus.aio).server()
    server.add_insecure_port(sys.argv[2])
    await server.start()
    assert await server.wait_for_termination(timeout=0.2) is True
    waiting = asyncio.ensure_future(server.wait_for_termination())
    await asyncio.sleep(0.2)
    waiting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiting

asyncio.run(main())
print("EXITED")
"""


@pytest.mark.parametrize("api", ["grpc.aio", "isthmus.aio"])
def test_a_cancelled_wait_for_termination_lets_the_program_exit(api: str, tmp_path: Path) -> None:
    """Ctrl-C under `asyncio.run` cancels `await server.wait_for_termination()` of a server
    nobody stops. isthmus.aio waited on an executor thread for the whole stop, which never
    came: `asyncio.run` waited for that thread when it closed the loop, for good."""
    done = subprocess.run(
        [sys.executable, "-c", WAIT_THEN_CANCEL, api, f"unix:{tmp_path}/s.sock"],
        capture_output=True,
        text=True,
        timeout=PATIENCE,
        check=False,
    )
    assert (done.returncode, done.stdout.strip()) == (0, "EXITED"), done.stderr


@pytest.mark.parametrize("aio", [grpc.aio, isthmus.aio], ids=["grpc.aio", "isthmus.aio"])
def test_abort_ends_the_call_though_the_handler_catches_it(aio: ModuleType, tmp_path: Path) -> None:
    """A streaming handler whose broad `except` catches `context.abort`'s exception and writes
    on: grpc.aio sends the status inside `abort`, and the write raises the abort again.
    isthmus.aio sent the status only when the handler ended: its client got the later message
    before it."""
    seen: list[str] = []
    ended: list[asyncio.Event] = []

    async def stream(request: bytes, context: grpc.aio.ServicerContext) -> None:
        try:
            await context.write(b"before")
            try:
                await context.abort(grpc.StatusCode.NOT_FOUND, "gone")
            except Exception as e:
                seen.append(type(e).__name__)
            for step in (context.write(b"after"), context.read()):
                try:
                    await step
                except Exception as e:
                    seen.append(type(e).__name__)
        finally:
            ended[0].set()

    address = f"unix:{tmp_path}/s.sock"

    async def run() -> tuple[list[bytes], Any, str]:
        server = aio.server()
        handlers = {"Stream": grpc.unary_stream_rpc_method_handler(stream)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Aborting", handlers),))
        server.add_insecure_port(address)
        await server.start()
        ended.append(asyncio.Event())
        got: list[bytes] = []
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                call = channel.unary_stream("/t.Aborting/Stream")(b"", timeout=30)
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    async for message in call:
                        got.append(message)
                # The client has the status once `abort` sent it, before the handler goes on:
                # a stop now (no grace) cancelled the handler at its next step, and grpc.aio's
                # saw none of the three once here.
                await asyncio.wait_for(ended[0].wait(), 30)
                return got, caught.value.code(), caught.value.details()
        finally:
            await server.stop(None)

    assert asyncio.run(run()) == ([b"before"], grpc.StatusCode.NOT_FOUND, "gone")
    assert seen == ["AbortError", "AbortError", "AbortError"], seen


@pytest.mark.parametrize("aio", [grpc.aio, isthmus.aio], ids=["grpc.aio", "isthmus.aio"])
@pytest.mark.parametrize("limit", [0, -1])
def test_an_asyncio_server_refuses_a_concurrency_limit_below_one(aio: ModuleType, limit: int) -> None:
    """isthmus.aio took `maximum_concurrent_rpcs=0`, and refused every call RESOURCE_EXHAUSTED."""

    async def make() -> None:
        aio.server(maximum_concurrent_rpcs=limit)

    with pytest.raises(ValueError, match="maximum_concurrent_rpcs should be a positive integer"):
        asyncio.run(make())


@pytest.mark.parametrize("kind", ["grpcio", "isthmus", "isthmus-aio", "isthmus-aio-uvloop"])
def test_maximum_concurrent_rpcs_counts_the_whole_server(
    kind: str, stubs: Path, pb_grpc: ModuleType, pb: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two slow calls on two ports fill a server whose `maximum_concurrent_rpcs` is 2: one
    more, on any port (isthmus's shm:// one too), is refused RESOURCE_EXHAUSTED "Concurrent
    RPC limit exceeded!", and once they end calls go through again."""
    monkeypatch.setenv("ECHO_MAX_RPCS", "2")
    transports = ["unix", "http"] if kind == "grpcio" else ["unix", "http", "shm"]
    served = serve(kind, transports, stubs)
    try:
        channels = [isthmus.insecure_channel(served.addresses[t]) for t in transports]
        echo = [pb_grpc.EchoStub(channel) for channel in channels]
        slow = [
            e.Unary.future(pb.EchoRequest(seq=i, sleep_ms=3500), timeout=60) for i, e in enumerate(echo[:2])
        ]
        # Both handlers hold their slots once they say they sleep; they sleep seconds longer
        # than the refused calls below take.
        started = {served.peer.expect("UNARY-SLEEPING").split()[1] for _ in slow}
        assert started == {"0", "1"}
        with pytest.raises(grpc.RpcError) as refused:
            echo[0].Unary(pb.EchoRequest(), timeout=60)
        assert (refused.value.code(), refused.value.details()) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "Concurrent RPC limit exceeded!",
        )
        for other_port in echo[1:]:
            with pytest.raises(grpc.RpcError) as refused:
                other_port.Unary(pb.EchoRequest(), timeout=60)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert [f.result(timeout=60).seq for f in slow] == [0, 1]
        # isthmus frees a call's slot before its client sees the call end; grpcio only when the
        # handler's thread is done, after it sent the reply, so a call may be refused until then.
        assert _accepted(echo[1], pb.EchoRequest(seq=4), patient=kind == "grpcio").seq == 4
        for channel in channels:
            channel.close()
    finally:
        served.close()


def _accepted(echo: Any, request: Any, patient: bool) -> Any:
    """`echo.Unary(request)`'s reply; if `patient`, retried while it is refused for the
    concurrency limit, for up to a minute."""
    end = time.monotonic() + PATIENCE
    while True:
        try:
            return echo.Unary(request, timeout=60)
        except grpc.RpcError as error:
            refused = error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            if not (patient and refused and time.monotonic() < end):
                raise
        time.sleep(0.01)


# (server, client API, transport): grpcio's blocking channel is the reference, over HTTP/2.
CLOSING = [
    ("grpcio", "grpcio", "unix"),
    ("grpcio", "grpcio", "http"),
    ("grpcio", "isthmus", "unix"),
    ("grpcio", "isthmus", "http"),
    ("isthmus", "grpcio", "http"),
    ("isthmus", "isthmus", "shm"),
    ("isthmus", "isthmus", "unix"),
    ("isthmus", "isthmus", "http"),
]

_closing_seq = itertools.count(9000)


def _sleeping(served: Served, *seqs: int) -> None:
    """Waits until the server runs the sleeping Unary calls `seqs`, in any order (earlier
    tests' lines are passed over)."""
    waiting = {str(seq) for seq in seqs}
    while waiting:
        waiting.discard(served.peer.expect("UNARY-SLEEPING").split()[1])


@pytest.mark.parametrize(("kind", "api", "transport"), CLOSING, ids=["-".join(c) for c in CLOSING])
def test_the_blocking_channels_close_cancels_the_calls_in_progress(
    kind: str, api: str, transport: str, servers: Callable[[str], Any], pb_grpc: ModuleType, pb: ModuleType
) -> None:
    """`Channel.close()` ends every call in progress CANCELLED "Channel closed!", as grpcio's
    does: a blocking unary call in another thread, a `.future()`, and a bidi stream being read,
    over HTTP/2 (isthmus's channel kept there: no move to shared memory) as over shm://."""
    served = servers(kind)
    address = served.addresses[transport]
    if api == "grpcio":
        channel: Any = grpc.insecure_channel(grpcio_target(address))
    else:
        channel = isthmus.insecure_channel(address, options=[("isthmus.upgrade", False)])
    stub = pb_grpc.EchoStub(channel)
    outcomes: dict[str, Any] = {}

    def outcome(name: str, call: Callable[[], Any]) -> None:
        try:
            outcomes[name] = call()
        except grpc.RpcError as e:
            outcomes[name] = (e.code(), e.details())

    blocking_seq, future_seq = next(_closing_seq), next(_closing_seq)
    blocking = threading.Thread(
        target=outcome,
        args=("blocking", lambda: stub.Unary(pb.EchoRequest(seq=blocking_seq, sleep_ms=30_000), timeout=60)),
    )
    blocking.start()
    future = stub.Unary.future(pb.EchoRequest(seq=future_seq, sleep_ms=30_000), timeout=60)
    requests: queue.Queue[Any] = queue.Queue()
    stream = stub.Bidi(iter(requests.get, None), timeout=60)
    try:
        requests.put(pb.EchoRequest(seq=1))
        assert next(stream).seq == 1  # the stream is open both ways
        _sleeping(served, blocking_seq, future_seq)
        channel.close()
        outcome("future", lambda: future.result(timeout=60))
        outcome("stream", lambda: next(stream))
        blocking.join(60)
    finally:
        requests.put(None)
        channel.close()
    cancelled = (grpc.StatusCode.CANCELLED, "Channel closed!")
    assert outcomes == {"blocking": cancelled, "future": cancelled, "stream": cancelled}


def _raw_shout(channel: Any) -> tuple[bytes, str | None]:
    """`/parity.Guarded/RawShout`'s reply and the type its raw handler got the request as."""
    reply, call = channel.unary_unary("/parity.Guarded/RawShout").with_call(b"quiet", timeout=60)
    return bytes(reply), dict(call.trailing_metadata()).get("x-request")


@pytest.mark.parametrize(("grpc_api", "api", "loop"), INTERCEPTED, ids="-".join)
def test_a_raw_handler_stays_raw_behind_an_interceptor_that_wraps_it(
    grpc_api: str, api: str, loop: str
) -> None:
    """A server interceptor that wraps a raw handler (`isthmus.raw`) in a handler of its own
    (upper-casing the reply) gets the same reply from isthmus's server as from grpc's, and on
    isthmus's the raw handler still gets its request as a `Message` (grpc's ignore the mark)."""
    reference, reference_targets = parity_server(grpc_api, "--intercepted")
    try:
        with grpc.insecure_channel(grpcio_target(reference_targets[0])) as channel:
            assert _raw_shout(channel) == (b"QUIET", "bytes")
    finally:
        reference.close()
    served, targets = parity_server(api, "--intercepted", loop=loop)
    try:
        for channel in _every_client(targets):
            with channel:
                assert _raw_shout(channel) == (b"QUIET", "Message")
    finally:
        served.close()


def _plain(channel: Any) -> list[Any]:
    """What `/parity.Plain`'s plain handlers answer (each reply, or code and details)."""

    def outcome(call: Callable[[], Any]) -> Any:
        try:
            return call()
        except grpc.RpcError as e:
            return (e.code(), e.details())

    def echoed(metadata: Any) -> list[tuple[str, Any]]:
        return [(k, v) for k, v in metadata if k.startswith("x-")]

    def info() -> Any:
        info = channel.unary_unary("/parity.Plain/Info")
        reply, call = info.with_call(b"", metadata=(("x-who", "plain"),), timeout=60)
        return reply, echoed(call.initial_metadata()), echoed(call.trailing_metadata())

    def stream() -> Any:
        got: list[bytes] = []
        return got, outcome(lambda: got.extend(channel.unary_stream("/parity.Plain/Stream")(b"", timeout=60)))

    return [
        outcome(lambda: channel.unary_unary("/parity.Plain/Abort")(b"", timeout=60)),
        outcome(lambda: channel.unary_unary("/parity.Plain/Code")(b"", timeout=60)),
        outcome(info),
        stream(),
        outcome(lambda: channel.stream_unary("/parity.Plain/Join")(iter([b"a", b"b"]), timeout=60)),
        outcome(lambda: list(channel.stream_stream("/parity.Plain/Echo")(iter([b"a", b"b"]), timeout=60))),
    ]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_plain_handlers_on_the_asyncio_server_run_as_grpc_aio_runs_them(loop: str) -> None:
    """Plain (non-async) handlers on the asyncio server get grpc.aio's blocking context, off the
    loop's thread: `abort` aborts, `set_code` and `set_details` end the call so, metadata both
    ways and `time_remaining` work, streamed requests come as a blocking iterator and a
    generator's responses are sent: the same results from isthmus.aio's server as from
    grpc.aio's, over every transport."""
    reference, reference_targets = parity_server("grpc.aio")
    try:
        with grpc.insecure_channel(grpcio_target(reference_targets[0])) as channel:
            want = _plain(channel)
    finally:
        reference.close()
    who = [("x-who", "plain")]
    assert want == [
        (grpc.StatusCode.PERMISSION_DENIED, "plain abort"),
        (grpc.StatusCode.NOT_FOUND, "plain code"),
        (b"deadline=True on_loop=False", who, who),
        ([b"a", b"b"], (grpc.StatusCode.OUT_OF_RANGE, "plain stream")),
        b"a+b",
        [b"a", b"b"],
    ]
    served, targets = parity_server("isthmus-aio", loop=loop)
    try:
        for channel in _every_client(targets):
            with channel:
                assert _plain(channel) == want
    finally:
        served.close()


@contextlib.contextmanager
def _serving(
    module: Any,
    handlers: dict[str, Callable[[bytes, grpc.ServicerContext], bytes]],
    options: list[tuple[str, Any]] | None = None,
) -> Iterator[tuple[Any, str]]:
    """A server of `module` (grpc or isthmus) with `options` answering `/t.T/<name>` with each
    of `handlers` on a fresh Unix socket, started; and its target. Stopped at once, with its
    pool, after."""
    methods = {name: grpc.unary_unary_rpc_method_handler(h) for name, h in handlers.items()}
    pool = futures.ThreadPoolExecutor(4)
    generic = grpc.method_handlers_generic_handler("t.T", methods)
    server = module.server(pool, handlers=[generic], options=options)
    target = fresh("unix")
    server.add_insecure_port(target)
    server.start()
    try:
        yield server, target
    finally:
        server.stop(None)
        pool.shutdown(wait=False)


def _length(request: bytes, context: grpc.ServicerContext) -> bytes:
    return str(len(request)).encode()


@pytest.mark.parametrize("limit", [None, -1, 8 << 20])
@pytest.mark.parametrize("api", ["grpc", "isthmus"])
def test_a_servers_default_receive_limit_over_http2_is_grpcios_4_mib(api: str, limit: int | None) -> None:
    """Unset, `grpc.max_receive_message_length` is 4 MiB over HTTP/2 on both servers: a 5 MiB
    request fails RESOURCE_EXHAUSTED, 4 MiB passes; -1 takes any, 8 MiB takes 6 MiB and not 9.
    (isthmus over shm:// takes 4 GiB unless told otherwise.) A grpcio client over a Unix
    socket."""
    module: Any = grpc if api == "grpc" else isthmus
    options = None if limit is None else [("grpc.max_receive_message_length", limit)]
    top = {None: 4 << 20, -1: 9 << 20, 8 << 20: 8 << 20}[limit]
    with _serving(module, {"Length": _length}, options) as (_, target), grpc.insecure_channel(target) as ch:
        length = ch.unary_unary("/t.T/Length")
        for size in (min(top, 6 << 20), top + 1) if limit != -1 else (top,):
            if size <= top:
                assert length(bytes(size), timeout=60) == str(size).encode()
                continue
            with pytest.raises(grpc.RpcError) as refused:
                length(bytes(size), timeout=60)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
            assert str(size) in refused.value.details() and str(top) in refused.value.details()


@pytest.mark.parametrize("api", ["grpc", "isthmus"])
def test_max_concurrent_streams_holds_each_connection_and_its_client_waits(api: str) -> None:
    """`grpc.max_concurrent_streams` 2: with two calls open on a connection, a third on it waits
    (its deadline passes, not refused), a call on another connection is served, and the one
    that waits goes once a place frees; grpcio clients over a Unix socket on both servers."""
    release = threading.Event()
    started = threading.Semaphore(0)

    def wait(request: bytes, context: grpc.ServicerContext) -> bytes:
        started.release()
        release.wait(60)
        return b"waited"

    module: Any = grpc if api == "grpc" else isthmus
    handlers = {"Wait": wait, "Length": _length}
    own_connection = [("grpc.use_local_subchannel_pool", 1)]
    with (
        _serving(module, handlers, [("grpc.max_concurrent_streams", 2)]) as (_, target),
        grpc.insecure_channel(target, options=own_connection) as ch,
        grpc.insecure_channel(target, options=own_connection) as other,
    ):
        waiting = [ch.unary_unary("/t.T/Wait").future(b"", timeout=60) for _ in range(2)]
        for _ in waiting:
            assert started.acquire(timeout=30)
        with pytest.raises(grpc.RpcError) as waited:
            ch.unary_unary("/t.T/Length")(b"abc", timeout=0.5)
        assert waited.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, waited.value
        assert other.unary_unary("/t.T/Length")(b"abcd", timeout=30) == b"4"
        third = ch.unary_unary("/t.T/Length").future(b"ab", timeout=60)
        release.set()
        assert [w.result(timeout=30) for w in waiting] == [b"waited", b"waited"]
        assert third.result(timeout=30) == b"2"


def test_a_servers_default_receive_limit_over_shm_is_4_gib() -> None:
    """The same server with no limit set takes 5 MiB over shm://."""
    pool = futures.ThreadPoolExecutor(2)
    methods = {"Length": grpc.unary_unary_rpc_method_handler(_length)}
    server = isthmus.server(pool, handlers=[grpc.method_handlers_generic_handler("t.T", methods)])
    target = fresh("shm")
    server.add_insecure_port(target)
    server.start()
    try:
        with isthmus.insecure_channel(target) as channel:
            assert channel.unary_unary("/t.T/Length")(bytes(5 << 20), timeout=60) == str(5 << 20).encode()
    finally:
        server.stop(None)
        pool.shutdown(wait=False)


@pytest.mark.parametrize("api", ["grpc", "isthmus"])
def test_a_second_stop_with_less_grace_cuts_the_first_ones_short(api: str) -> None:
    """`stop(60)` with a call in progress, then `stop(0)`: the call ends now, not in a minute, as
    grpcio's does. Server and client in this process, over a Unix socket."""
    started = threading.Event()

    def wait(request: bytes, context: grpc.ServicerContext) -> bytes:
        started.set()
        end = time.monotonic() + 90
        while context.is_active() and time.monotonic() < end:
            time.sleep(0.01)
        return b""

    module: Any = grpc if api == "grpc" else isthmus
    with _serving(module, {"Wait": wait}) as (server, target), module.insecure_channel(target) as channel:
        call = channel.unary_unary("/t.T/Wait").future(b"", timeout=120)
        assert started.wait(30)
        first = server.stop(60)
        began = time.monotonic()
        assert server.stop(0).wait(30)
        assert first.wait(30)
        with pytest.raises(grpc.RpcError) as ended:
            call.result(timeout=30)
        assert ended.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        assert time.monotonic() - began < 30  # far below the first stop's 60 s


# grpcio's thread that would cut the calls off at the end of the grace dies on such a grace
# (OverflowError: timestamp out of range), which pytest reports as a warning.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("grace", [float("inf"), 1e20])
@pytest.mark.parametrize("api", ["grpc", "isthmus"])
def test_a_stop_whose_grace_is_endless_lets_the_call_in_progress_finish(api: str, grace: float) -> None:
    """`stop(inf)` and `stop(1e20)` with a call in progress: the call finishes with its reply, as
    grpcio's does (its timer thread fails on such a grace, and nothing cuts the call off). In
    isthmus `inf` cancelled the call at once, and 1e20 raised a PanicException from `stop`."""
    started, release = threading.Event(), threading.Event()

    def wait(request: bytes, context: grpc.ServicerContext) -> bytes:
        started.set()
        release.wait(30)
        return b"finished"

    module: Any = grpc if api == "grpc" else isthmus
    try:
        with _serving(module, {"Wait": wait}) as (server, target), module.insecure_channel(target) as channel:
            call = channel.unary_unary("/t.T/Wait").future(b"", timeout=60)
            assert started.wait(30)
            stopped = server.stop(grace)
            # A stop that cut the call off did so at once: the handler still holds it here.
            time.sleep(0.2)
            release.set()
            assert call.result(timeout=30) == b"finished"
            assert stopped.wait(30)
    finally:
        release.set()


def _odd_statuses() -> dict[str, Callable[[bytes, grpc.ServicerContext], bytes]]:
    """Handlers that end their calls with a code that is a plain int, or details that are bytes."""

    def set_code(code: Any, details: Any = None) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        def handler(request: bytes, context: grpc.ServicerContext) -> bytes:
            context.set_code(code)
            if details is not None:
                context.set_details(details)
            return b"reply"

        return handler

    def abort(code: Any, details: Any) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        def handler(request: bytes, context: grpc.ServicerContext) -> bytes:
            context.abort(code, details)

        return handler

    return {
        "AbortInt": abort(5, "x"),
        "SetCodeInt": set_code(5),
        "AbortBytes": abort(grpc.StatusCode.NOT_FOUND, b"bytes"),
        "SetDetailsBytes": set_code(grpc.StatusCode.NOT_FOUND, b"bd"),
        "AbortSurrogate": abort(grpc.StatusCode.NOT_FOUND, "a \ud800 surrogate"),
    }


def _statuses(target: str, methods: Iterable[str]) -> list[Any]:
    """What grpcio's client gets from each method: its reply, or its error's code and details."""
    got: list[Any] = []
    with grpc.insecure_channel(target) as channel:
        for method in methods:
            try:
                got.append(channel.unary_unary(f"/t.T/{method}")(b"", timeout=10))
            except grpc.RpcError as e:
                got.append((e.code(), e.details()))
    return got


@pytest.mark.parametrize("api", ["grpc", "isthmus"])
def test_a_code_that_is_an_int_or_details_that_are_bytes_end_the_call_as_grpcio_ends_it(api: str) -> None:
    """A handler that sets a plain int as its code, bytes as its details, or details with no
    UTF-8 (a lone surrogate) has its call end: UNKNOWN for the int, the bytes' text as details,
    the encoding's failure as details, as grpcio's server does. In isthmus each raised inside
    the call's end, and the call waited for its deadline."""
    module: Any = grpc if api == "grpc" else isthmus
    handlers = _odd_statuses()
    with _serving(module, handlers) as (_, target):
        assert _statuses(target, handlers) == [
            (grpc.StatusCode.UNKNOWN, "x"),
            (grpc.StatusCode.UNKNOWN, ""),
            (grpc.StatusCode.NOT_FOUND, "bytes"),
            (grpc.StatusCode.NOT_FOUND, "bd"),
            # What has no UTF-8 is worded as grpcio's server words its failure to encode it.
            (
                grpc.StatusCode.NOT_FOUND,
                "Exception calling application: 'utf-8' codec can't encode character '\\ud800' in position 2:"
                " surrogates not allowed",
            ),
        ]


@contextlib.asynccontextmanager
async def _asyncio_serving(api: str, methods: dict[str, grpc.RpcMethodHandler]) -> AsyncIterator[str]:
    """grpc.aio's or isthmus.aio's server of `methods` (service `t.T`) on a fresh Unix socket,
    for the `async with` block: its target."""
    module: Any = grpc.aio if api == "grpc.aio" else isthmus.aio
    server = module.server(handlers=[grpc.method_handlers_generic_handler("t.T", methods)])
    target = fresh("unix")
    server.add_insecure_port(target)
    await server.start()
    try:
        yield target
    finally:
        await server.stop(None)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("api", ["grpc.aio", "isthmus.aio"])
def test_an_asyncio_handlers_code_that_is_an_int_is_that_code_as_in_grpc_aio(api: str, loop: str) -> None:
    """grpc.aio's server takes a plain int as the code of that number (`abort(5, ...)` is
    NOT_FOUND; `set_code(0)` lets the reply go). In isthmus.aio each raised inside the call's
    end, and the call waited for its deadline. (Bytes as details grpc.aio refuses, failing the
    call with a TypeError's text; isthmus.aio sends their text, as grpcio does.)"""

    async def abort_int(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await context.abort(5, "x")

    async def set_code_int(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        context.set_code(5)
        return b"reply"

    async def set_code_zero(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        context.set_code(0)
        return b"reply"

    async def test() -> None:
        handlers = {"AbortInt": abort_int, "SetCodeInt": set_code_int, "SetCodeZero": set_code_zero}
        methods = {name: grpc.unary_unary_rpc_method_handler(h) for name, h in handlers.items()}
        async with _asyncio_serving(api, methods) as target:
            got = await asyncio.to_thread(_statuses, target, handlers)
            assert got == [(grpc.StatusCode.NOT_FOUND, "x"), (grpc.StatusCode.NOT_FOUND, ""), b"reply"]

    run(loop, test)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("api", ["grpc.aio", "isthmus.aio"])
def test_an_asyncio_handlers_str_reply_goes_as_its_utf8_as_in_grpc_aio(api: str, loop: str) -> None:
    """grpc.aio's server sends a `str` reply of a method with no serializer as its UTF-8, from
    a unary handler and a streaming one; isthmus.aio failed the call UNKNOWN (a TypeError)."""

    async def unary(request: bytes, context: grpc.aio.ServicerContext) -> str:
        return "caf\u00e9"

    async def stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[str | bytes]:
        yield "one"
        yield b"two"

    async def test() -> None:
        methods = {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.unary_stream_rpc_method_handler(stream),
        }
        async with _asyncio_serving(api, methods) as target, grpc.aio.insecure_channel(target) as channel:
            assert await channel.unary_unary("/t.T/Unary")(b"", timeout=30) == "caf\u00e9".encode()
            replies = channel.unary_stream("/t.T/Stream")(b"", timeout=30)
            assert [r async for r in replies] == [b"one", b"two"]

    run(loop, test)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_an_asyncio_handler_that_raises_cancellederror_ends_its_call_cancelled(loop: str) -> None:
    """A handler that raises asyncio.CancelledError itself (or cancels its own task) ends its
    call CANCELLED "the handler was cancelled" at once, and the server serves on (the words
    said "the server stopped", which it had not). grpc.aio's server leaves such a call to its
    deadline, so this is isthmus.aio's alone."""

    async def cancels_itself(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if request == b"raise":
            raise asyncio.CancelledError()
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        await asyncio.sleep(30)
        return b"not cancelled"

    async def test() -> None:
        methods = {"Cancel": grpc.unary_unary_rpc_method_handler(cancels_itself)}
        serving = _asyncio_serving("isthmus.aio", methods)
        async with serving as target, grpc.aio.insecure_channel(target) as ch:
            for request in (b"raise", b"self"):
                start = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await ch.unary_unary("/t.T/Cancel")(request, timeout=30)
                assert (caught.value.code(), caught.value.details()) == (
                    grpc.StatusCode.CANCELLED,
                    "the handler was cancelled",
                ), request
                assert time.monotonic() - start < 20, request  # not the deadline's 30 s

    run(loop, test)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("api", ["grpc.aio", "isthmus.aio"])
def test_what_a_streaming_coroutine_handler_returns_is_not_sent(api: str, loop: str) -> None:
    """A response-streaming handler that is a coroutine (not an async generator) streams with
    `context.write`; grpc.aio's server sends nothing of what it returns. isthmus.aio's sent the
    items of a returned value, and a `bytes` one failed the call UNKNOWN (its items are ints)."""

    async def server_stream(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await context.write(b"one")
        await context.write(b"two")
        return b"returned"

    async def bidi(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> list[bytes]:
        async for request in requests:
            await context.write(request)
        return [b"returned"]

    async def test() -> None:
        methods = {
            "ServerStream": grpc.unary_stream_rpc_method_handler(server_stream),
            "Bidi": grpc.stream_stream_rpc_method_handler(bidi),
        }
        async with _asyncio_serving(api, methods) as target, grpc.aio.insecure_channel(target) as channel:
            replies = channel.unary_stream("/t.T/ServerStream")(b"", timeout=30)
            assert [r async for r in replies] == [b"one", b"two"]
            assert await replies.code() == grpc.StatusCode.OK
            replies = channel.stream_stream("/t.T/Bidi")(iter([b"a", b"b"]), timeout=30)
            assert [r async for r in replies] == [b"a", b"b"]
            assert await replies.code() == grpc.StatusCode.OK

    run(loop, test)


@pytest.mark.parametrize("transport", ["unix", "http"])
@pytest.mark.parametrize("kind", ["grpcio", "isthmus", "isthmus-aio", "go", "rust"])
def test_a_grpcio_client_that_compresses_is_understood(
    kind: str, transport: str, servers: Callable[[str], Served], pb_grpc: ModuleType, pb: ModuleType
) -> None:
    """grpcio clients that compress, for the whole channel or per call, with gzip or deflate,
    reach isthmus's servers (Python, asyncio, Go, and tonic's behind isthmus) as they reach
    grpcio's: every request is read, every reply comes back."""
    address = grpcio_target(str(servers(kind).addresses[transport]))
    payload = b"a compressible payload " * 2000
    for for_channel, for_call in [
        (grpc.Compression.Gzip, None),
        (grpc.Compression.Deflate, None),
        (grpc.Compression.NoCompression, grpc.Compression.Gzip),
    ]:
        with grpc.insecure_channel(address, compression=for_channel) as channel:
            stub = pb_grpc.EchoStub(channel)
            reply = stub.Unary(pb.EchoRequest(seq=7, payload=payload), timeout=60, compression=for_call)
            assert (reply.seq, reply.payload) == (7, payload)
            requests = [pb.EchoRequest(seq=seq, payload=payload) for seq in range(3)]
            replies = list(stub.Bidi(iter(requests), timeout=60, compression=for_call))
            assert [(r.seq, r.payload) for r in replies] == [(seq, payload) for seq in range(3)]


def _echo_bytes(request: bytes, context: grpc.ServicerContext) -> bytes:
    return request


def _echo_each(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
    yield from requests


# Bytes in, the same bytes out, unary and bidi: the compression tests' service.
_BYTES_ECHO = grpc.method_handlers_generic_handler(
    "t.Echo",
    {
        "Unary": grpc.unary_unary_rpc_method_handler(_echo_bytes),
        "Bidi": grpc.stream_stream_rpc_method_handler(_echo_each),
    },
)


# (the channel's compression, its options, the call's compression), and whether the requests
# go compressed: then a server that reads only identity refuses them.
COMPRESSIONS = [
    (None, [], None, None),
    (grpc.Compression.Gzip, [], None, "gzip"),
    (grpc.Compression.Deflate, [], None, "deflate"),
    (None, [("grpc.default_compression_algorithm", grpc.Compression.Gzip)], None, "gzip"),
    # grpcio adds `compression` as that option after the given ones, and the first one wins.
    (
        grpc.Compression.Gzip,
        [("grpc.default_compression_algorithm", grpc.Compression.Deflate)],
        None,
        "deflate",
    ),
    (None, [], grpc.Compression.Deflate, "deflate"),
    (grpc.Compression.Deflate, [], grpc.Compression.Gzip, "gzip"),
]
COMPRESSIBLE = b"a compressible request " * 100


def _outcome(error: grpc.RpcError | None) -> tuple[Any, ...]:
    return (None,) if error is None else (error.code(), error.details())


def _compressed_sync(make: Callable[..., Any], address: str, case: tuple[Any, ...]) -> tuple[Any, ...]:
    """A unary and a bidi call with `case`'s compressions on a blocking channel: their outcomes."""
    compression, options, per_call = case
    results = []
    with make(address, options=options, compression=compression) as channel:
        try:
            assert (
                channel.unary_unary("/t.Echo/Unary")(COMPRESSIBLE, timeout=30, compression=per_call)
                == COMPRESSIBLE
            )
            results.append(_outcome(None))
        except grpc.RpcError as e:
            results.append(_outcome(e))
        try:
            bidi = channel.stream_stream("/t.Echo/Bidi")
            assert (
                list(bidi(iter([COMPRESSIBLE] * 2), timeout=30, compression=per_call)) == [COMPRESSIBLE] * 2
            )
            results.append(_outcome(None))
        except grpc.RpcError as e:
            results.append(_outcome(e))
    return tuple(results)


async def _compressed_aio(make: Callable[..., Any], address: str, case: tuple[Any, ...]) -> tuple[Any, ...]:
    """The same on an asyncio channel."""
    compression, options, per_call = case
    results = []
    async with make(address, options=options, compression=compression) as channel:
        try:
            reply = await channel.unary_unary("/t.Echo/Unary")(COMPRESSIBLE, timeout=30, compression=per_call)
            assert reply == COMPRESSIBLE
            results.append(_outcome(None))
        except grpc.RpcError as e:
            results.append(_outcome(e))
        try:
            call = channel.stream_stream("/t.Echo/Bidi")(
                iter([COMPRESSIBLE] * 2), timeout=30, compression=per_call
            )
            assert [r async for r in call] == [COMPRESSIBLE] * 2
            results.append(_outcome(None))
        except grpc.RpcError as e:
            results.append(_outcome(e))
    return tuple(results)


class _PassOn(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(details, request)


async def _compressed_intercepted(
    make: Callable[..., Any], address: str, case: tuple[Any, ...]
) -> tuple[Any, ...]:
    """A unary call with `case`'s compressions through an asyncio channel's interceptor."""
    compression, options, per_call = case
    async with make(address, options=options, compression=compression, interceptors=[_PassOn()]) as channel:
        try:
            reply = await channel.unary_unary("/t.Echo/Unary")(COMPRESSIBLE, timeout=30, compression=per_call)
            assert reply == COMPRESSIBLE
            return _outcome(None)
        except grpc.RpcError as e:
            return _outcome(e)


@pytest.mark.parametrize("api", ["grpc", "isthmus", "grpc.aio", "isthmus.aio"])
def test_a_channel_that_compresses_sends_compressed_requests(api: str, tmp_path: Path) -> None:
    """The channel's `compression`, the option `grpc.default_compression_algorithm` and a call's
    own `compression=` compress the requests over HTTP/2 as grpcio's do: a grpcio server that
    reads no compressed message (`grpc.compression_enabled_algorithms_bitset` 1) fails those
    calls UNIMPLEMENTED naming the algorithm, and answers the others, unary and streaming, and
    through asyncio's interceptors."""
    pool = futures.ThreadPoolExecutor(4)
    server = grpc.server(
        pool, handlers=[_BYTES_ECHO], options=[("grpc.compression_enabled_algorithms_bitset", 1)]
    )
    address = f"unix:{tmp_path / 'identity-only.sock'}"
    server.add_insecure_port(address)
    server.start()
    cases = COMPRESSIONS
    if api.startswith("isthmus"):
        # A call's NoCompression on a compressing channel: grpcio still compresses it (its core
        # reads "identity" as no choice of the call's); isthmus sends it uncompressed.
        cases = [*cases, (grpc.Compression.Gzip, [], grpc.Compression.NoCompression, None)]
    try:
        for *case, sent in cases:
            refused = (grpc.StatusCode.UNIMPLEMENTED, f"Compression algorithm '{sent}' is disabled.")
            if api in ("grpc", "isthmus"):
                make = grpc.insecure_channel if api == "grpc" else isthmus.insecure_channel
                got = _compressed_sync(make, address, tuple(case))
            else:
                make = grpc.aio.insecure_channel if api == "grpc.aio" else isthmus.aio.insecure_channel
                got = asyncio.run(_compressed_aio(make, address, tuple(case)))
                intercepted = asyncio.run(_compressed_intercepted(make, address, tuple(case)))
                assert intercepted == (refused if sent else (None,)), case
            if api == "grpc.aio" and got[1] == (grpc.StatusCode.INTERNAL, "Internal error from Core"):
                got = (got[0], refused)  # grpc.aio's words for a refused stream; isthmus passes the server's
            assert got == (((None,), (None,)) if sent is None else (refused, refused)), case
    finally:
        server.stop(None)
        pool.shutdown(wait=False)


@pytest.mark.parametrize("kind", ["grpcio", "isthmus", "isthmus.aio"])
def test_a_server_that_compresses_replies_answers_every_client(kind: str, tmp_path: Path) -> None:
    """A server's `compression` (or `grpc.default_compression_algorithm`) compresses its replies
    only for clients that read the encoding, as grpcio's server does: a grpcio client that
    reads identity alone (`grpc.compression_enabled_algorithms_bitset` 1; it would refuse a
    compressed reply) and one that reads everything get every reply, unary and streaming.
    (That isthmus's replies do go compressed: the Rust suite's
    `replies_go_compressed_where_the_server_asks_and_the_client_reads_it`.)"""
    for n, (compression, options) in enumerate(
        [
            (grpc.Compression.Gzip, []),
            (None, [("grpc.default_compression_algorithm", grpc.Compression.Deflate)]),
        ]
    ):
        address = f"unix:{tmp_path / f'compressing-{n}.sock'}"
        pool = futures.ThreadPoolExecutor(4)
        loop: asyncio.AbstractEventLoop | None = None
        if kind == "isthmus.aio":
            loop = asyncio.new_event_loop()
            runner = threading.Thread(target=loop.run_forever, daemon=True)
            runner.start()

            async def make(options: Any, compression: Any, address: str) -> Any:
                s = isthmus.aio.server(handlers=[_BYTES_ECHO], options=options, compression=compression)
                s.add_insecure_port(address)
                await s.start()
                return s

            server: Any = asyncio.run_coroutine_threadsafe(make(options, compression, address), loop).result(
                30
            )
        else:
            make_server = grpc.server if kind == "grpcio" else isthmus.server
            server = make_server(pool, handlers=[_BYTES_ECHO], options=options, compression=compression)
            server.add_insecure_port(address)
            server.start()
        try:
            for client_options in [[], [("grpc.compression_enabled_algorithms_bitset", 1)]]:
                with grpc.insecure_channel(address, options=client_options) as channel:
                    assert channel.unary_unary("/t.Echo/Unary")(COMPRESSIBLE, timeout=30) == COMPRESSIBLE
                    if kind == "grpcio" and client_options:
                        # grpcio's server compresses a stream's replies even for this client,
                        # which then fails the call (UNIMPLEMENTED "Compression algorithm
                        # 'gzip' is disabled."); isthmus's keeps to what the client reads.
                        continue
                    bidi = channel.stream_stream("/t.Echo/Bidi")
                    assert list(bidi(iter([COMPRESSIBLE] * 2), timeout=30)) == [COMPRESSIBLE] * 2
        finally:
            if loop is not None:
                asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(30)
                loop.call_soon_threadsafe(loop.stop)
                runner.join(30)
                loop.close()
            else:
                server.stop(None)
            pool.shutdown(wait=False)


# A handler's own choice of compression for its replies (`context.set_compression`), named by
# the request's metadata `want`; the reply is large and compresses well.
COMPRESSIBLE_REPLY = b"a compressible reply " * 12_000
_WANT = {
    "gzip": grpc.Compression.Gzip,
    "deflate": grpc.Compression.Deflate,
    "none": grpc.Compression.NoCompression,
}


def _choose(context: Any) -> None:
    want = dict(context.invocation_metadata()).get("want")
    if want is not None:
        context.set_compression(_WANT[want])


def _reply_chosen(request: bytes, context: grpc.ServicerContext) -> bytes:
    _choose(context)
    return COMPRESSIBLE_REPLY


def _replies_chosen(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
    _choose(context)
    for _ in requests:
        yield COMPRESSIBLE_REPLY


async def _reply_chosen_aio(request: bytes, context: Any) -> bytes:
    _choose(context)
    return COMPRESSIBLE_REPLY


async def _replies_chosen_aio(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
    _choose(context)
    async for _ in requests:
        yield COMPRESSIBLE_REPLY


def _chosen_handlers(aio: bool) -> grpc.GenericRpcHandler:
    unary, bidi = (_reply_chosen_aio, _replies_chosen_aio) if aio else (_reply_chosen, _replies_chosen)
    return grpc.method_handlers_generic_handler(
        "t.Chosen",
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Bidi": grpc.stream_stream_rpc_method_handler(bidi),
        },
    )


class _CountingProxy:
    """A TCP proxy to `port` on 127.0.0.1 that counts the bytes the server sends: what a
    reply costs on the wire, compressed or not."""

    def __init__(self, port: int) -> None:
        self._upstream = port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._sent = 0
        self._sockets: list[socket.socket] = [self._listener]
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def sent(self) -> int:
        with self._lock:
            return self._sent

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            server = socket.create_connection(("127.0.0.1", self._upstream))
            with self._lock:
                self._sockets += [client, server]
            for source, sink, counted in ((client, server, False), (server, client, True)):
                t = threading.Thread(target=self._pump, args=(source, sink, counted), daemon=True)
                self._threads.append(t)
                t.start()

    def _pump(self, source: socket.socket, sink: socket.socket, counted: bool) -> None:
        while True:
            try:
                data = source.recv(1 << 16)
                if not data:
                    sink.shutdown(socket.SHUT_WR)
                    return
                if counted:  # before it is passed on: the client has no byte not counted yet
                    with self._lock:
                        self._sent += len(data)
                sink.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        with self._lock:
            sockets = list(self._sockets)
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        for t in self._threads:
            t.join(30)


class _ChoosingServer:
    """A server of `kind` (grpcio's or isthmus's, blocking or asyncio) with the `t.Chosen`
    service on a TCP port, replies compressed by `compression` unless a handler chooses."""

    def __init__(self, kind: str, compression: grpc.Compression | None) -> None:
        self._pool = futures.ThreadPoolExecutor(4)
        self._loop: asyncio.AbstractEventLoop | None = None
        if kind.endswith(".aio"):
            self._loop = asyncio.new_event_loop()
            self._runner = threading.Thread(target=self._loop.run_forever, daemon=True)
            self._runner.start()
            module: Any = grpc.aio if kind == "grpcio.aio" else isthmus.aio
            self._server, self.port = asyncio.run_coroutine_threadsafe(
                self._start_aio(module, compression), self._loop
            ).result(30)
        else:
            make_server = grpc.server if kind == "grpcio" else isthmus.server
            self._server = make_server(
                self._pool, handlers=[_chosen_handlers(False)], compression=compression
            )
            self.port = self._server.add_insecure_port("127.0.0.1:0")
            self._server.start()

    @staticmethod
    async def _start_aio(module: Any, compression: grpc.Compression | None) -> tuple[Any, int]:
        server = module.server(handlers=[_chosen_handlers(True)], compression=compression)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    def stop(self) -> None:
        if self._loop is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(None), self._loop).result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._runner.join(30)
            self._loop.close()
        else:
            self._server.stop(None)
        self._pool.shutdown(wait=False)


def _bytes_on_the_wire(proxy: _CountingProxy, want: str | None) -> tuple[int, int]:
    """What the server sends for a unary call's reply and for a bidi call's two, through
    `proxy` from a grpcio client that reads every encoding."""
    metadata = () if want is None else (("want", want),)
    with grpc.insecure_channel(f"127.0.0.1:{proxy.port}") as channel:
        before = proxy.sent()
        assert (
            channel.unary_unary("/t.Chosen/Unary")(b"", metadata=metadata, timeout=30) == COMPRESSIBLE_REPLY
        )
        unary = proxy.sent() - before
        before = proxy.sent()
        replies = list(
            channel.stream_stream("/t.Chosen/Bidi")(iter([b"", b""]), metadata=metadata, timeout=30)
        )
        assert replies == [COMPRESSIBLE_REPLY] * 2
        return unary, proxy.sent() - before


@pytest.mark.parametrize("kind", ["grpcio", "isthmus", "grpcio.aio", "isthmus.aio"])
def test_a_handler_chooses_the_compression_of_its_replies(kind: str) -> None:
    """`context.set_compression` in a handler compresses that call's replies (unary and
    streaming) over HTTP/2 even where the server compresses none, and `NoCompression` sends
    them uncompressed where the server compresses all; what crosses the wire is counted by a
    proxy between a grpcio client and the server."""
    for server_compression in (None, grpc.Compression.Gzip):
        server = _ChoosingServer(kind, server_compression)
        proxy = _CountingProxy(server.port)
        try:
            for want in (None, "gzip", "deflate", "none"):
                # isthmus: the handler's choice, else the server's. grpcio differs in two ways:
                # its blocking server takes `NoCompression` for no choice at all (its
                # `_compression.augment_metadata` tests the enum's truth, and NoCompression is
                # 0), and grpc.aio's compresses a unary reply by the server's setting alone (a
                # handler's choice reaches its streamed replies only).
                chosen = want in ("gzip", "deflate")
                server_compresses = server_compression is not None
                ignored = want == "none" and kind == "grpcio"
                compressed = chosen or (server_compresses and (want is None or ignored))
                unary_compressed = server_compresses if kind == "grpcio.aio" else compressed
                case = f"{kind}, server compression {server_compression}, want {want}"
                unary, streamed = _bytes_on_the_wire(proxy, want)
                # Compressed, each reply takes a few hundred bytes; uncompressed, all of its 252 KB.
                small = len(COMPRESSIBLE_REPLY) // 10
                assert (unary < small) == unary_compressed and unary > 0, (case, unary)
                assert (streamed < small) == compressed and streamed > 0, (case, streamed)
                if not compressed:
                    assert streamed >= 2 * len(COMPRESSIBLE_REPLY), (case, streamed)
        finally:
            proxy.close()
            server.stop()
