"""The four call shapes through one interface, whichever API makes them: isthmus or grpcio,
blocking or asyncio. The conformance cases are written once against it; what belongs to one
API alone (futures, iterators, read/write, cancel) has tests of its own."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
import uvloop
from peer import grpcio_target

import isthmus
import isthmus.aio

WATCHDOG = 120.0  # no call in the suite should take nearly this long


def aio(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Runs an `async def` test on a fresh event loop of each kind, asyncio's own and uvloop's,
    under the watchdog."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        for loop in ("asyncio", "uvloop"):
            run_on(loop, functools.partial(test, *args, **kwargs))

    return run


def run_on(loop: str, test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Runs a coroutine function on a fresh loop of kind `loop` (`asyncio` or `uvloop`), under
    the watchdog."""
    coroutine = asyncio.wait_for(test(), WATCHDOG)
    if loop == "uvloop":
        uvloop.run(coroutine)
    else:
        asyncio.run(coroutine)


def as_dict(metadata: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    # Not dict(metadata): grpc.aio.Metadata's keys() yields pairs, which dict() takes for keys.
    return dict(iter(metadata))


@dataclass
class Outcome:
    """A call that ended OK: its response (a list of them for streaming responses) and its
    metadata as dicts."""

    response: Any
    initial: dict[str, str | bytes]
    trailing: dict[str, str | bytes]


class SyncClient:
    def __init__(self, channel: Any, pb_grpc: Any) -> None:
        self.channel = channel
        self.stub = pb_grpc.EchoStub(channel)

    def close(self) -> None:
        self.channel.close()

    def unary(self, request: Any, **kw: Any) -> Outcome:
        response, call = self.stub.Unary.with_call(request, **kw)
        return Outcome(response, as_dict(call.initial_metadata()), as_dict(call.trailing_metadata()))

    def server_stream(self, request: Any, **kw: Any) -> Outcome:
        call = self.stub.ServerStream(request, **kw)
        responses = list(call)
        return Outcome(responses, as_dict(call.initial_metadata()), as_dict(call.trailing_metadata()))

    def client_stream(self, requests: Iterable[Any], **kw: Any) -> Outcome:
        response, call = self.stub.ClientStream.with_call(iter(requests), **kw)
        return Outcome(response, as_dict(call.initial_metadata()), as_dict(call.trailing_metadata()))

    def bidi(self, requests: Iterable[Any], **kw: Any) -> Outcome:
        call = self.stub.Bidi(iter(requests), **kw)
        responses = list(call)
        return Outcome(responses, as_dict(call.initial_metadata()), as_dict(call.trailing_metadata()))

    def call(self, path: str, request: bytes, **kw: Any) -> bytes:
        """A unary call by path, with bytes in and out (no serializers)."""
        return self.channel.unary_unary(path)(request, **kw)  # type: ignore[no-any-return]

    def unary_many(self, requests: list[Any], **kw: Any) -> list[Any]:
        """All at once, as futures."""
        futures = [self.stub.Unary.future(r, **kw) for r in requests]
        return [f.result(timeout=WATCHDOG) for f in futures]


class AioClient:
    """Runs each call to its end on a loop of its own."""

    def __init__(self, make_channel: Callable[[], Any], pb_grpc: Any) -> None:
        self.loop = asyncio.new_event_loop()

        async def make() -> Any:
            return make_channel()

        self.channel = self._run(make())
        self.stub = pb_grpc.EchoStub(self.channel)

    def _run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coroutine, WATCHDOG))

    def close(self) -> None:
        self._run(self.channel.close())
        self.loop.close()

    @staticmethod
    async def _outcome(call: Any, response: Any) -> Outcome:
        return Outcome(
            response, as_dict(await call.initial_metadata()), as_dict(await call.trailing_metadata())
        )

    def unary(self, request: Any, **kw: Any) -> Outcome:
        async def run() -> Outcome:
            call = self.stub.Unary(request, **kw)
            return await self._outcome(call, await call)

        return self._run(run())  # type: ignore[no-any-return]

    def server_stream(self, request: Any, **kw: Any) -> Outcome:
        async def run() -> Outcome:
            call = self.stub.ServerStream(request, **kw)
            return await self._outcome(call, [r async for r in call])

        return self._run(run())  # type: ignore[no-any-return]

    def client_stream(self, requests: Iterable[Any], **kw: Any) -> Outcome:
        async def run() -> Outcome:
            call = self.stub.ClientStream(iter(requests), **kw)
            return await self._outcome(call, await call)

        return self._run(run())  # type: ignore[no-any-return]

    def bidi(self, requests: Iterable[Any], **kw: Any) -> Outcome:
        async def run() -> Outcome:
            call = self.stub.Bidi(iter(requests), **kw)
            return await self._outcome(call, [r async for r in call])

        return self._run(run())  # type: ignore[no-any-return]

    def call(self, path: str, request: bytes, **kw: Any) -> bytes:
        async def run() -> bytes:
            return await self.channel.unary_unary(path)(request, **kw)  # type: ignore[no-any-return]

        return self._run(run())  # type: ignore[no-any-return]

    def unary_many(self, requests: list[Any], **kw: Any) -> list[Any]:
        async def run() -> list[Any]:
            return await asyncio.gather(*(self.stub.Unary(r, **kw) for r in requests))

        return self._run(run())  # type: ignore[no-any-return]


def make_client(api: str, address: str, pb_grpc: Any) -> SyncClient | AioClient:
    """`api`: `isthmus`, `isthmus.aio`, `grpcio` or `grpcio.aio`."""
    # grpcio's 4 MiB default is below the suite's largest message.
    options = [("grpc.max_receive_message_length", 65 << 20), ("grpc.max_send_message_length", 65 << 20)]
    # The transport the address names is the one under test: no move to shm:// (the upgrade
    # has tests of its own, test_upgrade.py).
    stay = [("isthmus.upgrade", False)]
    if api == "isthmus":
        return SyncClient(isthmus.insecure_channel(address, options=stay), pb_grpc)
    if api == "isthmus.aio":
        return AioClient(lambda: isthmus.aio.insecure_channel(address, options=stay), pb_grpc)
    if api == "grpcio":
        return SyncClient(grpc.insecure_channel(grpcio_target(address), options=options), pb_grpc)
    return AioClient(lambda: grpc.aio.insecure_channel(grpcio_target(address), options=options), pb_grpc)
