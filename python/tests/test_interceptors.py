"""Client interceptors, each case run with the same client code on grpc's channels and on
isthmus's, expecting the same result: grpc.aio's interceptors on `grpc.aio` and `isthmus.aio`
channels (isthmus's under asyncio's own loop and under uvloop), and grpc's blocking ones through
`grpc.intercept_channel` on `grpc` and `isthmus` channels. The server is `parity_server`'s
`/parity.Meta` service, which sends the call's `x-…` metadata back on every shape, served by
isthmus's blocking server in a process of its own over a Unix socket and shm://."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import certs
import grpc
import grpc.aio
import pytest
from clients import WATCHDOG, as_dict
from clients import run_on as run
from peer import Peer, Served, fresh, grpcio_target

import isthmus
import isthmus.aio

SHAPES = ["unary_unary", "unary_stream", "stream_unary", "stream_stream"]

# Each shape's method of /parity.Meta, and what the calls below get back from it.
METHODS = {
    "unary_unary": "Unary",
    "unary_stream": "ServerStream",
    "stream_unary": "ClientStream",
    "stream_stream": "Bidi",
}
ANSWERS = {
    "unary_unary": b"req",
    "unary_stream": [b"req-0", b"req-1", b"req-2"],
    "stream_unary": b"a+b",
    "stream_stream": [b"a", b"b"],
}


@pytest.fixture(scope="module")
def meta() -> Iterator[dict[str, str]]:
    """The server's address for each transport, as isthmus's channels take them."""
    targets = {"unix": fresh("unix"), "shm": fresh("shm")}
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parent), env.get("PYTHONPATH")])
    )
    served = Served(
        "isthmus", Peer([sys.executable, "-m", "parity_server", "isthmus", *targets.values()], env)
    )
    served.addresses = targets  # so that `close` removes the socket
    yield targets
    served.close()


def echoed(metadata: Any) -> dict[str, Any]:
    """The `x-…` keys (grpc's transport adds others of its own)."""
    return {k: v for k, v in as_dict(metadata).items() if k.startswith("x-")}


class RefusedError(Exception):
    """What the interceptors that raise raise."""


# grpc.aio's intercepted call (the class is grpc.aio's, on either channel) re-raises from its
# __del__ whatever its interceptors ended with other than an AioRpcError or a cancel, and
# fails so too when one answered a stream with no call under it. The tests where that happens
# collect their garbage before they return, so that it is reported (and let be) there.
RAISES_WHEN_COLLECTED = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


# grpc.aio: its channel files each interceptor under the first of the four classes it is an
# instance of, so it takes one object per shape.

Intercept = Callable[[Any, Any, Any], Awaitable[Any]]


class _AioUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, intercept: Intercept) -> None:
        self.intercept = intercept

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await self.intercept(continuation, details, request)


class _AioUnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, intercept: Intercept) -> None:
        self.intercept = intercept

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await self.intercept(continuation, details, request)


class _AioStreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, intercept: Intercept) -> None:
        self.intercept = intercept

    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await self.intercept(continuation, details, requests)


class _AioStreamStream(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, intercept: Intercept) -> None:
        self.intercept = intercept

    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await self.intercept(continuation, details, requests)


def aio_interceptors(intercept: Intercept) -> list[grpc.aio.ClientInterceptor]:
    """One interceptor of each shape, all running `intercept`."""
    return [
        _AioUnaryUnary(intercept),
        _AioUnaryStream(intercept),
        _AioStreamUnary(intercept),
        _AioStreamStream(intercept),
    ]


# (client API, transport, event loop)
AIO_CLIENTS = [
    ("grpc.aio", "unix", "asyncio"),
    ("isthmus.aio", "unix", "asyncio"),
    ("isthmus.aio", "shm", "asyncio"),
    ("isthmus.aio", "unix", "uvloop"),
    ("isthmus.aio", "shm", "uvloop"),
]

AioChannel = Callable[[list[grpc.aio.ClientInterceptor]], Any]


@pytest.fixture(params=AIO_CLIENTS, ids="-".join)
def aio_client(request: pytest.FixtureRequest, meta: dict[str, str]) -> tuple[AioChannel, str]:
    """A function that makes a channel of the client API with the interceptors given (call it
    on the loop), and the loop to run on."""
    api, transport, loop = request.param
    address = meta[transport]
    if api == "grpc.aio":
        return (
            lambda interceptors: grpc.aio.insecure_channel(grpcio_target(address), interceptors=interceptors)
        ), loop
    return (lambda interceptors: isthmus.aio.insecure_channel(address, interceptors=interceptors)), loop


async def aio_call(
    channel: Any, shape: str, method: str | None = None, write: bool = True, **kw: Any
) -> tuple[Any, Any]:
    """A call of `shape` to `/parity.Meta/METHOD` (the shape's own by default) run to its end:
    its response (a list of them for streaming responses) and its call object. The client
    stream sends an iterator; the bidi call writes and reads. Unless `write`, a streaming
    request sends nothing: for a call that fails at once, since grpc.aio's own send then races
    the end (its intercepted `write` may raise InvalidStateError, and the iterator it consumes
    may fail the call INTERNAL, "Failed execute_batch")."""
    path = f"/parity.Meta/{method or METHODS[shape]}"
    if shape == "unary_unary":
        call = channel.unary_unary(path)(b"req", **kw)
        return await call, call
    if shape == "unary_stream":
        call = channel.unary_stream(path)(b"req", **kw)
        return [response async for response in call], call
    if shape == "stream_unary":
        call = channel.stream_unary(path)(iter([b"a", b"b"]) if write else None, **kw)
        return await call, call
    if not write:
        call = channel.stream_stream(path)(**kw)
        return [response async for response in call], call
    call = channel.stream_stream(path)(**kw)
    responses = []
    for request in (b"a", b"b"):
        await call.write(request)
        responses.append(await call.read())
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    return responses, call


def with_metadata(details: Any, key: str, value: str) -> Any:
    metadata = grpc.aio.Metadata(*details.metadata)
    metadata.add(key, value)
    return details._replace(metadata=metadata)


@pytest.mark.parametrize("shape", SHAPES)
def test_aio_an_interceptor_adds_metadata(shape: str, aio_client: tuple[AioChannel, str]) -> None:
    """The interceptor gets grpc.aio's `ClientCallDetails` (the method as bytes, the metadata as
    `grpc.aio.Metadata`); what it adds reaches the server beside the caller's own."""
    make, loop = aio_client
    seen: list[Any] = []

    async def intercept(continuation: Any, details: Any, request: Any) -> Any:
        seen.append(details)
        return await continuation(with_metadata(details, "x-added", "yes"), request)

    async def test() -> None:
        channel = make(aio_interceptors(intercept))
        response, call = await aio_call(channel, shape, metadata=(("x-caller", "1"),), timeout=60)
        assert response == ANSWERS[shape]
        want = {"x-caller": "1", "x-added": "yes"}
        assert echoed(await call.initial_metadata()) == want
        assert echoed(await call.trailing_metadata()) == want
        assert await call.code() == grpc.StatusCode.OK
        await channel.close()

    run(loop, test)
    [details] = seen
    assert isinstance(details, grpc.aio.ClientCallDetails)
    assert details.method == f"/parity.Meta/{METHODS[shape]}".encode()
    assert isinstance(details.metadata, grpc.aio.Metadata)
    assert list(details.metadata) == [("x-caller", "1")]
    assert details.timeout == 60


def test_aio_a_call_without_compression_leaves_its_callers_metadata_alone(
    aio_client: tuple[AioChannel, str],
) -> None:
    """A call through interceptors given `grpc.aio.Metadata` and `NoCompression`: the caller's
    object is unchanged after it, as grpc.aio leaves it (isthmus.aio added its compression key
    to the caller's own object)."""
    make, loop = aio_client

    async def intercept(continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(details, request)

    async def test() -> None:
        channel = make(aio_interceptors(intercept))
        given = grpc.aio.Metadata(("x-caller", "1"))
        response, _ = await aio_call(
            channel, "unary_unary", metadata=given, compression=grpc.Compression.NoCompression, timeout=60
        )
        assert response == ANSWERS["unary_unary"]
        assert list(given) == [("x-caller", "1")]
        await channel.close()

    run(loop, test)


@pytest.mark.parametrize("shape", SHAPES)
def test_aio_an_interceptor_rewrites_the_method(shape: str, aio_client: tuple[AioChannel, str]) -> None:
    make, loop = aio_client

    async def intercept(continuation: Any, details: Any, request: Any) -> Any:
        method = details.method.replace(b"/Missing", f"/{METHODS[shape]}".encode())
        return await continuation(details._replace(method=method), request)

    async def test() -> None:
        channel = make(aio_interceptors(intercept))
        response, _ = await aio_call(channel, shape, method="Missing", timeout=60)
        assert response == ANSWERS[shape]
        await channel.close()

    run(loop, test)


def test_aio_an_interceptor_changes_the_timeout(aio_client: tuple[AioChannel, str]) -> None:
    """The server sees the deadline the interceptor sets (shorter than the caller's, or one
    where the caller gave none), and none once the interceptor takes it away."""
    make, loop = aio_client
    timeouts: list[float | None] = []

    async def intercept(continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(details._replace(timeout=timeouts.pop(0)), request)

    async def test() -> None:
        channel = make(aio_interceptors(intercept))
        time_left = channel.unary_unary("/parity.Meta/TimeLeft")
        for caller, interceptor in ((60, 5.0), (None, 5.0)):
            timeouts.append(interceptor)
            left = float(await time_left(b"", timeout=caller))
            assert 0 < left < 10, left  # grpc's transport may add a little slack: not 60
        timeouts.append(None)
        assert await time_left(b"", timeout=60) == b"none"
        await channel.close()

    run(loop, test)


@RAISES_WHEN_COLLECTED
def test_aio_an_interceptor_answers_without_calling_the_channel(aio_client: tuple[AioChannel, str]) -> None:
    """An interceptor of a unary call may answer with a response (the call is then OK, with no
    metadata), one of streaming responses with an iterator of them."""
    make, loop = aio_client

    async def cached(continuation: Any, details: Any, request: Any) -> Any:
        if details.method.endswith(b"/Unary"):
            return b"cached"
        if details.method.endswith(b"/ServerStream"):
            return _iterate([b"x", b"y"])
        return _upper(request)  # Bidi: the requests, answered here

    async def test() -> None:
        channel = make(aio_interceptors(cached))
        call = channel.unary_unary("/parity.Meta/Unary")(b"req", timeout=60)
        assert await call == b"cached"
        assert call.done() and await call.code() == grpc.StatusCode.OK
        assert await call.initial_metadata() is None and await call.trailing_metadata() is None
        call = channel.unary_stream("/parity.Meta/ServerStream")(b"req", timeout=60)
        assert [r async for r in call] == [b"x", b"y"]
        call = channel.stream_stream("/parity.Meta/Bidi")(_iterate([b"a", b"b"]), timeout=60)
        assert [r async for r in call] == [b"A", b"B"]
        await channel.close()

    run(loop, test)
    gc.collect()


def test_aio_an_interceptor_answers_with_what_the_call_gave(aio_client: tuple[AioChannel, str]) -> None:
    """An interceptor may give back the call's response instead of the call (the caller then
    sees an OK call with no metadata), or an iterator over a streaming call's responses (the
    status and metadata are still the call's)."""
    make, loop = aio_client

    async def answer(continuation: Any, details: Any, request: Any) -> Any:
        call = await continuation(details, request)
        return await call if details.method.endswith(b"/Unary") else _upper(call)

    async def test() -> None:
        channel = make(aio_interceptors(answer))
        call = channel.unary_unary("/parity.Meta/Unary")(b"own", metadata=(("x-k", "v"),), timeout=60)
        assert await call == b"own"
        assert await call.code() == grpc.StatusCode.OK and await call.trailing_metadata() is None
        call = channel.unary_stream("/parity.Meta/ServerStream")(b"req", metadata=(("x-k", "v"),), timeout=60)
        assert [r async for r in call] == [b"REQ-0", b"REQ-1", b"REQ-2"]
        assert await call.code() == grpc.StatusCode.OK
        assert echoed(await call.trailing_metadata()) == {"x-k": "v"}
        call = channel.stream_stream("/parity.Meta/Bidi")(metadata=(("x-k", "v"),), timeout=60)
        await call.write(b"a")
        assert await call.read() == b"A"
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
        assert echoed(await call.initial_metadata()) == {"x-k": "v"}
        await _others_done()
        await channel.close()

    run(loop, test)


async def _others_done() -> None:
    """Lets the loop's other tasks end first: grpc.aio's intercepted stream keeps one that feeds
    its requests a moment after the call is over, and its channel's `close()` fails on that one
    ("Unrecognized call object") if it is still pending. Turns of the loop, not a sleep; bounded,
    for a client whose tasks live on."""
    me = asyncio.current_task()
    for _ in range(10_000):
        if all(t is me or t.done() for t in asyncio.all_tasks()):
            return
        await asyncio.sleep(0)


async def _iterate(items: list[bytes]) -> AsyncIterator[bytes]:
    for item in items:
        yield item


async def _upper(messages: Any) -> AsyncIterator[bytes]:
    async for message in messages:
        yield message.upper()


@RAISES_WHEN_COLLECTED
@pytest.mark.parametrize("shape", SHAPES)
def test_aio_an_interceptor_that_raises(shape: str, aio_client: tuple[AioChannel, str]) -> None:
    """The caller gets the interceptor's exception, whether it raised before calling the
    channel or after the call failed."""
    make, loop = aio_client

    async def refuse(continuation: Any, details: Any, request: Any) -> Any:
        raise RefusedError(details.method)

    async def translate(continuation: Any, details: Any, request: Any) -> Any:
        call = await continuation(details, request)
        try:
            return await call
        except grpc.aio.AioRpcError as error:
            raise RefusedError(error.code(), error.details()) from None

    async def test() -> None:
        channel = make(aio_interceptors(refuse))
        with pytest.raises(RefusedError) as refused:
            await aio_call(channel, shape, timeout=60)
        assert refused.value.args == (f"/parity.Meta/{METHODS[shape]}".encode(),)
        await channel.close()
        if shape == "unary_unary":
            channel = make(aio_interceptors(translate))
            with pytest.raises(RefusedError) as translated:
                await channel.unary_unary("/parity.Meta/Fail")(b"no entry", timeout=60)
            assert translated.value.args == (grpc.StatusCode.PERMISSION_DENIED, "no entry")
            await channel.close()

    run(loop, test)
    gc.collect()


@pytest.mark.parametrize("shape", SHAPES)
def test_aio_a_failed_call_reaches_the_caller_through_the_interceptor(
    shape: str, aio_client: tuple[AioChannel, str]
) -> None:
    """A failed call's AioRpcError (its code, details and trailers) reaches the caller through
    an interceptor that returns the call."""
    make, loop = aio_client

    async def through(continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(details, request)

    async def test() -> None:
        channel = make(aio_interceptors(through))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await aio_call(channel, shape, method="Missing", write=False, timeout=60)
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await channel.unary_unary("/parity.Meta/Fail")(b"no entry", metadata=(("x-k", "v"),), timeout=60)
        assert (failed.value.code(), failed.value.details()) == (
            grpc.StatusCode.PERMISSION_DENIED,
            "no entry",
        )
        assert echoed(failed.value.trailing_metadata()) == {"x-k": "v"}
        await channel.close()

    run(loop, test)


@pytest.mark.parametrize("shape", SHAPES)
def test_aio_interceptors_run_in_order(shape: str, aio_client: tuple[AioChannel, str]) -> None:
    """The first is the outermost: it runs first, and sees the call last; the second sees
    the metadata the first added."""
    make, loop = aio_client
    order: list[str] = []
    seen: dict[str, list[str]] = {}

    def named(name: str) -> Intercept:
        async def intercept(continuation: Any, details: Any, request: Any) -> Any:
            order.append(f"{name}>")
            seen[name] = [key for key, _ in details.metadata]
            call = await continuation(with_metadata(details, f"x-{name}", "1"), request)
            order.append(f"<{name}")
            return call

        return intercept

    async def test() -> None:
        channel = make([*aio_interceptors(named("outer")), *aio_interceptors(named("inner"))])
        response, call = await aio_call(channel, shape, timeout=60)
        assert response == ANSWERS[shape]
        assert echoed(await call.trailing_metadata()) == {"x-outer": "1", "x-inner": "1"}
        await channel.close()

    run(loop, test)
    assert order == ["outer>", "inner>", "<inner", "<outer"]
    assert seen == {"outer": [], "inner": ["x-outer"]}


@RAISES_WHEN_COLLECTED  # the UsageError
def test_aio_close_cancels_calls_in_their_interceptors(aio_client: tuple[AioChannel, str]) -> None:
    """The channel's close cancels a call whose interceptor still waits, for something of its
    own or for the end of the call it made, and one whose interceptor has returned; a call
    after it fails UsageError."""
    make, loop = aio_client

    async def test() -> None:
        never = asyncio.Event()

        async def intercept(continuation: Any, details: Any, request: Any) -> Any:
            if request == b"wait":
                await never.wait()
            call = await continuation(details, request)
            if ("x-hold", "1") in details.metadata:
                await call.code()
            return call

        async def stalled() -> AsyncIterator[bytes]:
            yield b"a"
            await never.wait()

        channel = make(aio_interceptors(intercept))
        unary = channel.unary_unary("/parity.Meta/Unary")
        bidi = channel.stream_stream("/parity.Meta/Bidi")
        waiting = asyncio.ensure_future(unary(b"wait", timeout=60))
        held = bidi(stalled(), metadata=(("x-hold", "1"),), timeout=60)
        running = bidi(timeout=60)
        await running.write(b"b")
        assert await running.read() == b"b"
        await asyncio.sleep(0.05)  # not needed, but the interceptors are likelier to wait by now
        await channel.close()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        with pytest.raises(asyncio.CancelledError):
            await held.read()
        assert running.cancelled() and await running.code() == grpc.StatusCode.CANCELLED
        with pytest.raises(grpc.aio.UsageError):
            await unary(b"req", timeout=60)

    run(loop, test)
    gc.collect()


def test_aio_an_object_that_is_no_interceptor_is_refused(meta: dict[str, str]) -> None:
    """ValueError, with grpc.aio's words, from `insecure_channel` and `secure_channel` alike,
    even beside a good interceptor."""
    bad, good = object(), _AioUnaryUnary(lambda *_: asyncio.sleep(0))
    with pytest.raises(ValueError) as grpcs:
        grpc.aio.insecure_channel(grpcio_target(meta["unix"]), interceptors=[good, bad])
    with pytest.raises(ValueError) as grpc_tls:
        grpc.aio.secure_channel("localhost:1", grpc.ssl_channel_credentials(), interceptors=[bad])
    assert str(grpc_tls.value) == str(grpcs.value)
    for address in meta.values():
        with pytest.raises(ValueError) as isthmus_s:
            isthmus.aio.insecure_channel(address, interceptors=[good, bad])
        assert str(isthmus_s.value) == str(grpcs.value)
    with pytest.raises(ValueError) as isthmus_tls:
        isthmus.aio.secure_channel("localhost:1", isthmus.ssl_channel_credentials(), interceptors=[bad])
    assert str(isthmus_tls.value) == str(grpcs.value)


def test_aio_a_secure_channel_runs_its_interceptors() -> None:
    """Over TLS (mutual, against `whoami_server`), as over an insecure channel: the method the
    interceptor names is the one that answers, and the server knows the client's certificate."""
    pems = certs.make()
    with tempfile.TemporaryDirectory(prefix="isthmus-tls-") as cert_dir:
        pems.write(Path(cert_dir))
        tests = Path(__file__).resolve().parent
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tests), os.environ.get("PYTHONPATH")]))
        )
        server = Peer(
            [sys.executable, str(tests / "whoami_server.py"), "isthmus", cert_dir, "mtls", "localhost:0"], env
        )
        try:
            target = f"localhost:{server.expect('PORTS').split()[1]}"

            async def rewrite(continuation: Any, details: Any, request: Any) -> Any:
                return await continuation(details._replace(method=b"/whoami.Who/Am"), request)

            async def test() -> None:
                channels = [
                    grpc.aio.secure_channel(
                        target,
                        grpc.ssl_channel_credentials(pems.ca, pems.client.key, pems.client.cert),
                        interceptors=aio_interceptors(rewrite),
                    ),
                    isthmus.aio.secure_channel(
                        target,
                        isthmus.ssl_channel_credentials(pems.ca, pems.client.key, pems.client.cert),
                        interceptors=aio_interceptors(rewrite),
                    ),
                ]
                for channel in channels:
                    answer = json.loads(await channel.unary_unary("/whoami.Who/Missing")(b"", timeout=60))
                    assert answer["identities"] == ["client.example", "spiffe://isthmus.test/client"]
                    await channel.close()

            run("asyncio", test)
        finally:
            server.close()


# The blocking API: grpc.intercept_channel wraps any grpc.Channel; one interceptor object may
# intercept every shape.


class SyncInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, intercept: Callable[[Any, Any, Any], Any]) -> None:
        self.intercept = intercept

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return self.intercept(continuation, details, request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return self.intercept(continuation, details, request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return self.intercept(continuation, details, requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return self.intercept(continuation, details, requests)


SYNC_CLIENTS = [("grpcio", "unix"), ("isthmus", "unix"), ("isthmus", "shm")]


@pytest.fixture(params=SYNC_CLIENTS, ids="-".join)
def sync_channel(request: pytest.FixtureRequest, meta: dict[str, str]) -> Callable[[], grpc.Channel]:
    api, transport = request.param
    address = meta[transport]
    if api == "grpcio":
        return lambda: grpc.insecure_channel(grpcio_target(address))
    return lambda: isthmus.insecure_channel(address)


# (shape, how it is called): the shapes with one response also `.with_call` and `.future()`.
SYNC_CALLS = [
    ("unary_unary", "call"),
    ("unary_unary", "with_call"),
    ("unary_unary", "future"),
    ("unary_stream", "call"),
    ("stream_unary", "call"),
    ("stream_unary", "with_call"),
    ("stream_unary", "future"),
    ("stream_stream", "call"),
]
SYNC_IDS = [f"{shape}-{how}" for shape, how in SYNC_CALLS]


def sync_call(channel: Any, shape: str, how: str, method: str | None = None, **kw: Any) -> tuple[Any, Any]:
    """A call of `shape` made `how`: its response (a list for streaming responses) and its call
    object (None for a plain call with one response)."""
    path = f"/parity.Meta/{method or METHODS[shape]}"
    multi_callable = getattr(channel, shape)(path)
    request = b"req" if shape.startswith("unary") else iter([b"a", b"b"])
    if shape.endswith("stream"):
        call = multi_callable(request, **kw)
        return list(call), call
    if how == "call":
        return multi_callable(request, **kw), None
    if how == "with_call":
        return multi_callable.with_call(request, **kw)  # type: ignore[no-any-return]
    future = multi_callable.future(request, **kw)
    return future.result(WATCHDOG), future  # grpc names it `ignored_timeout` in places


@pytest.mark.parametrize("shape,how", SYNC_CALLS, ids=SYNC_IDS)
def test_sync_an_interceptor_adds_metadata(
    shape: str, how: str, sync_channel: Callable[[], grpc.Channel]
) -> None:
    seen: list[Any] = []

    def intercept(continuation: Any, details: Any, request: Any) -> Any:
        seen.append(details)
        return continuation(details._replace(metadata=[*details.metadata, ("x-added", "yes")]), request)

    with sync_channel() as channel:
        intercepted = grpc.intercept_channel(channel, SyncInterceptor(intercept))
        response, call = sync_call(intercepted, shape, how, metadata=[("x-caller", "1")], timeout=60)
    assert response == ANSWERS[shape]
    if call is not None:
        want = {"x-caller": "1", "x-added": "yes"}
        assert echoed(call.initial_metadata()) == want
        assert echoed(call.trailing_metadata()) == want
        assert call.code() == grpc.StatusCode.OK
    [details] = seen
    assert (details.method, details.timeout) == (f"/parity.Meta/{METHODS[shape]}", 60)


@pytest.mark.parametrize("shape,how", SYNC_CALLS, ids=SYNC_IDS)
def test_sync_an_interceptor_rewrites_the_method(
    shape: str, how: str, sync_channel: Callable[[], grpc.Channel]
) -> None:
    def intercept(continuation: Any, details: Any, request: Any) -> Any:
        method = details.method.replace("/Missing", f"/{METHODS[shape]}")
        return continuation(details._replace(method=method), request)

    with sync_channel() as channel:
        intercepted = grpc.intercept_channel(channel, SyncInterceptor(intercept))
        assert sync_call(intercepted, shape, how, method="Missing", timeout=60)[0] == ANSWERS[shape]


@pytest.mark.parametrize("how", ["call", "with_call", "future"])
def test_sync_an_interceptor_changes_the_timeout(how: str, sync_channel: Callable[[], grpc.Channel]) -> None:
    timeouts: list[float | None] = []

    def intercept(continuation: Any, details: Any, request: Any) -> Any:
        return continuation(details._replace(timeout=timeouts.pop(0)), request)

    with sync_channel() as channel:
        intercepted = grpc.intercept_channel(channel, SyncInterceptor(intercept))
        for caller, interceptor in ((60, 5.0), (None, 5.0)):
            timeouts.append(interceptor)
            left = float(sync_call(intercepted, "unary_unary", how, method="TimeLeft", timeout=caller)[0])
            assert 0 < left < 10, left
        timeouts.append(None)
        assert sync_call(intercepted, "unary_unary", how, method="TimeLeft", timeout=60)[0] == b"none"


class Answer(grpc.Call, grpc.Future):
    """A call that is over, OK, with `response`: what an interceptor may answer with."""

    def __init__(self, response: Any) -> None:
        self.response = response

    def initial_metadata(self) -> Any:
        return ()

    def trailing_metadata(self) -> Any:
        return ()

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.OK

    def details(self) -> str:
        return ""

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float | None:
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Any) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def running(self) -> bool:
        return False

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Any:
        return self.response

    def exception(self, timeout: float | None = None) -> None:
        return None

    def traceback(self, timeout: float | None = None) -> None:
        return None

    def add_done_callback(self, fn: Any) -> None:
        fn(self)


@pytest.mark.parametrize("shape,how", SYNC_CALLS, ids=SYNC_IDS)
def test_sync_an_interceptor_answers_in_the_calls_place(
    shape: str, how: str, sync_channel: Callable[[], grpc.Channel]
) -> None:
    def answer(continuation: Any, details: Any, request: Any) -> Any:
        return iter([b"x", b"y"]) if shape.endswith("stream") else Answer(b"cached")

    with sync_channel() as channel:
        intercepted = grpc.intercept_channel(channel, SyncInterceptor(answer))
        response, _ = sync_call(intercepted, shape, how, timeout=60)
    assert response == ([b"x", b"y"] if shape.endswith("stream") else b"cached")


@pytest.mark.parametrize("shape,how", SYNC_CALLS, ids=SYNC_IDS)
def test_sync_an_interceptor_that_raises(
    shape: str, how: str, sync_channel: Callable[[], grpc.Channel]
) -> None:
    def refuse(continuation: Any, details: Any, request: Any) -> Any:
        raise RefusedError(details.method)

    with sync_channel() as channel:
        intercepted = grpc.intercept_channel(channel, SyncInterceptor(refuse))
        with pytest.raises(RefusedError) as refused:
            sync_call(intercepted, shape, how, timeout=60)
    assert refused.value.args == (f"/parity.Meta/{METHODS[shape]}",)


@pytest.mark.parametrize("shape,how", SYNC_CALLS, ids=SYNC_IDS)
def test_sync_a_failed_call_reaches_the_caller_through_the_interceptor(
    shape: str, how: str, sync_channel: Callable[[], grpc.Channel]
) -> None:
    """The continuation gives the interceptor a failed call as its outcome (for a call with
    one response, the RpcError itself, as a done future); the caller gets the RpcError."""
    outcomes: list[Any] = []

    def through(continuation: Any, details: Any, request: Any) -> Any:
        outcome = continuation(details, request)
        outcomes.append(outcome)
        return outcome

    with sync_channel() as channel:
        intercepted = grpc.intercept_channel(channel, SyncInterceptor(through))
        with pytest.raises(grpc.RpcError) as caught:
            sync_call(intercepted, shape, how, method="Missing", timeout=60)
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
        if shape == "unary_unary":
            with pytest.raises(grpc.RpcError) as failed:
                sync_call(intercepted, shape, how, method="Fail", metadata=[("x-k", "v")], timeout=60)
            assert (failed.value.code(), failed.value.details()) == (grpc.StatusCode.PERMISSION_DENIED, "req")
            assert echoed(failed.value.trailing_metadata()) == {"x-k": "v"}
            outcome = outcomes[-1]
            assert (
                outcome.done()
                and outcome.exception(timeout=WATCHDOG).code() == grpc.StatusCode.PERMISSION_DENIED
            )


@pytest.mark.parametrize("shape,how", SYNC_CALLS, ids=SYNC_IDS)
def test_sync_interceptors_run_in_order(
    shape: str, how: str, sync_channel: Callable[[], grpc.Channel]
) -> None:
    order: list[str] = []

    def named(name: str) -> SyncInterceptor:
        def intercept(continuation: Any, details: Any, request: Any) -> Any:
            order.append(f"{name}>")
            keys = [key for key, _ in details.metadata or ()]
            metadata = [*(details.metadata or ()), (f"x-{name}", "saw:" + ",".join(keys))]
            call = continuation(details._replace(metadata=metadata), request)
            order.append(f"<{name}")
            return call

        return SyncInterceptor(intercept)

    with sync_channel() as channel:
        intercepted = grpc.intercept_channel(channel, named("outer"), named("inner"))
        response, call = sync_call(intercepted, shape, how, timeout=60)
    assert response == ANSWERS[shape]
    assert order == ["outer>", "inner>", "<inner", "<outer"]
    if call is not None:
        # What metadata each saw: the inner one, the outer one's.
        assert echoed(call.trailing_metadata()) == {"x-outer": "saw:", "x-inner": "saw:x-outer"}


def test_sync_an_object_that_is_no_interceptor_is_refused(meta: dict[str, str]) -> None:
    bad = object()
    with grpc.insecure_channel(grpcio_target(meta["unix"])) as channel, pytest.raises(TypeError) as grpcs:
        grpc.intercept_channel(channel, bad)
    for address in meta.values():
        with isthmus.insecure_channel(address) as channel, pytest.raises(TypeError) as isthmus_s:
            grpc.intercept_channel(channel, bad)
        assert str(isthmus_s.value) == str(grpcs.value)
