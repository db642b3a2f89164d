"""The asyncio server's `ServicerContext`: grpc.aio's, with `read`, `write`, metadata and
`abort` as coroutines on the loop's Reactor."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, NoReturn

import grpc
import grpc.aio

from .._context import Context
from .._errors import rpc_error
from .._metadata import Metadatum, outgoing
from .._native import CallError, ServerCall
from ._reactor import Driver


class ServicerContext(Context, grpc.aio.ServicerContext):
    def __init__(
        self,
        call: ServerCall,
        handler: grpc.RpcMethodHandler,
        loop: asyncio.AbstractEventLoop,
        driver: Driver,
        raw: bool = False,
    ) -> None:
        super().__init__(call, handler, raw)
        self._loop = loop
        self._driver = driver
        # A raw handler (`isthmus.raw`) reads `Message` buffers and writes buffers as they are.
        self._recv_op = call.recv_raw_async if raw else call.recv_async
        self._send_op = call.send_raw_async if raw else call.send_async

    async def _op(self, start: Callable[..., None], *args: Any) -> Any:
        """One engine operation on the call; raises an RpcError if the call is over."""
        token, future = self._driver.begin(self._loop)
        start(self._driver.reactor, token, *args)
        value = await future
        if isinstance(value, CallError):
            raise rpc_error(value, aio=True)
        return value

    async def read(self) -> Any:
        # A client may wait for the response to open before it sends a request.
        message = await self._op(self._recv_op, True)
        return grpc.aio.EOF if message is None else self._decode(message)

    async def write(self, message: Any) -> None:
        await self._op(self._send_op, self._encode(message))

    async def send_initial_metadata(self, initial_metadata: Iterable[Metadatum]) -> None:
        await self._op(self._call.send_initial_metadata_async, outgoing(initial_metadata) or ())

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Iterable[Metadatum] = ()
    ) -> NoReturn:
        if trailing_metadata:
            self._trailing = trailing_metadata
        self._abort(code, details)

    def done(self) -> bool:
        return self._finished or not self._call.is_active()

    def cancelled(self) -> bool:
        return not self._finished and not self._call.is_active()

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        # The engine runs it on one of its threads; grpc.aio runs it on the loop.
        def schedule() -> None:
            self._loop.call_soon_threadsafe(callback, self)

        self._call.add_done_callback(schedule)

    async def _unary_request(self) -> Any:
        return self._request(await self._op(self._recv_op))

    async def _requests(self) -> AsyncIterator[Any]:
        while (request := await self.read()) is not grpc.aio.EOF:
            yield request
