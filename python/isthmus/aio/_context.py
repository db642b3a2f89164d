"""The asyncio server's `ServicerContext`: grpc.aio's, with `read`, `write`, metadata and
`abort` as coroutines on the loop's Reactor."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, NoReturn

import grpc
import grpc.aio

from .._channel import encoding
from .._context import Context, status_details, status_number
from .._metadata import Metadatum, outgoing
from .._native import Block, CallError, ServerCall
from ._reactor import Driver

#: How a call that its handler did not end ends (CANCELLED, DEADLINE_EXCEEDED, UNAVAILABLE):
#: a read that finds it so is the handler's cancellation, as grpc.aio's task is cancelled.
_ENDED_UNDER_THE_HANDLER = frozenset(
    code.value[0]
    for code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
)


class ServicerContext(Context, grpc.aio.ServicerContext):
    _NUMBERS = True  # grpc.aio's server takes `abort(5, ...)` as NOT_FOUND
    _KEEPS_DETAILS_ON_FAULT = False

    def __init__(
        self,
        call: ServerCall,
        handler: grpc.RpcMethodHandler,
        loop: asyncio.AbstractEventLoop,
        driver: Driver,
        raw: bool = False,
        done_callbacks: dict[int, list[Callable[[], None]]] | None = None,
        max_send: int | None = None,
    ) -> None:
        super().__init__(call, handler, raw, max_send)
        self._loop = loop
        self._driver = driver
        self._done_callbacks = {} if done_callbacks is None else done_callbacks
        # A raw handler (`isthmus.raw`) reads `Message` buffers and writes buffers as they are.
        self._recv_op = call.recv_raw_async if raw else call.recv_async
        self._send_op = call.send_raw_async if raw else call.send_async
        # A receive whose reader was cancelled, still under way or holding its message.
        self._unread: asyncio.Future[Any] | None = None
        # What `abort` raised: raised again by every later read, write or metadata send, as
        # grpc.aio's are.
        self._abort_error: grpc.aio.AbortError | None = None

    def alloc(self, size: int) -> Block:
        """For a raw handler (`isthmus.raw`): a writable reply buffer of `size` bytes, in the
        server's shared memory if its arena has room at once (the client reads it where it
        is), else on the heap (sent as a copy): the event loop never waits for room. Release
        every view of it before it is sent."""
        try:
            return self._call.alloc(size, False)
        except CallError as e:
            raise self._ended_by(e, aio=True) from None

    async def _op(self, start: Callable[..., tuple[bool, Any] | None], *args: Any) -> Any:
        """One engine operation on the call; raises an RpcError if the call is over. One that
        finishes as it starts (a unary request already here, a reply the ring has room for)
        costs no trip through the loop's selector."""
        driver = self._driver
        token = driver.token()
        now = start(driver.reactor, token, *args)
        value = now[1] if now is not None else await driver.wait(self._loop, token)
        if isinstance(value, CallError):
            raise self._ended_by(value, aio=True)
        return value

    def _after_abort(self) -> None:
        if self._abort_error is not None:
            raise self._abort_error

    async def read(self) -> Any:
        self._after_abort()
        message = await self._receive()
        return grpc.aio.EOF if message is None else self._decode(message)

    async def _receive(self) -> Any:
        """The next message (None at the end). A read whose waiter is cancelled
        (`asyncio.wait_for(context.read(), t)`) leaves its receive under way, and the next read
        takes that receive's message: a message is never taken by a read nobody awaits."""
        future = self._unread
        if future is None:
            driver = self._driver
            token = driver.token()
            now = self._recv_op(driver.reactor, token)
            if now is not None:
                value = now[1]
            else:
                future = self._unread = driver.wait(self._loop, token)
        if future is not None:
            # Shielded: cancelling this waiter must not cancel the receive, whose message is
            # the next read's.
            value = await asyncio.shield(future)
            self._unread = None
        if isinstance(value, CallError):
            if value.code in _ENDED_UNDER_THE_HANDLER:
                # The client cancelled, went away or ran out of time: grpc.aio cancels the
                # handler's task then, and its read never raises an RpcError of it. The task's
                # own cancel may come after this read: it sees the CancelledError now.
                raise asyncio.CancelledError()
            raise self._ended_by(value, aio=True)
        return value

    async def write(self, message: Any) -> None:
        self._after_abort()
        await self._op(self._send_op, self._encode(message))

    async def send_initial_metadata(self, initial_metadata: Iterable[Metadatum]) -> None:
        self._after_abort()
        try:
            await self._op(self._call.send_initial_metadata_async, outgoing(initial_metadata) or ())
        except grpc.RpcError as e:
            # Sent already (or implied by a message): grpc.aio's error for it.
            if self._call.is_active() and "already sent" in (e.details() or ""):
                raise grpc.aio.UsageError("Send initial metadata failed: already sent") from None
            raise

    def set_compression(self, compression: grpc.Compression) -> None:
        # grpc.aio's error once the initial metadata went (the blocking server's ignores it).
        if not self._call.set_compression(encoding(compression)):
            raise RuntimeError("Compression setting must be specified before sending initial metadata")

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Iterable[Metadatum] = ()
    ) -> NoReturn:
        # A second abort (a handler's `except Exception: abort(...)` around the first) leaves
        # the first's status, as grpc.aio does.
        if self._aborted:
            raise grpc.aio.UsageError("Abort already called!")
        if trailing_metadata:
            self._trailing = trailing_metadata
        if not details and self._details:
            details = self._details  # as grpc.aio's: an abort with none keeps those set before
        try:
            self._abort(code, details)
        except grpc.aio.AbortError as e:
            # The status goes now, as grpc.aio sends it: a handler whose broad `except` caught
            # this went on writing, and its client got those messages before the status.
            self._abort_error = e
            self._finish(None)
            raise

    async def abort_with_status(self, status: grpc.Status) -> NoReturn:
        # grpc.aio's: the code, details and trailers of `status` (grpc_status's rich errors).
        await self.abort(status.code, status.details, status.trailing_metadata)

    def _encode(self, response: Any) -> bytes:
        # grpc.aio's server sends a `str` reply of a method with no serializer as its UTF-8
        # (grpcio's blocking one never answers the call).
        if self._serialize is None and isinstance(response, str):
            response = response.encode()
        return super()._encode(response)

    def _no_message(self) -> bytes:
        return b""  # grpc.aio's server sends a handler's None as an empty message

    def _fault(self, error: BaseException) -> str:
        return f"Unexpected {type(error)}: {error}"  # grpc.aio's words

    def _codec_failed(self, error: Exception, words: str, logged: str | None = None) -> NoReturn:
        # grpc.aio's server does not catch its method's serializers: their exception is the
        # handler's (raised in its `read()` or `write()`, which it may catch and abort in its
        # own words), UNKNOWN in grpc.aio's words if it goes out of it. Aborted here, the call
        # took no later abort, and the handler saw an AbortError.
        raise error

    def details(self) -> str:
        return self._details or ""

    def trailing_metadata(self) -> Iterable[Metadatum]:
        return () if self._trailing is None else self._trailing

    def done(self) -> bool:
        return self._finished or not self._call.is_active()

    def cancelled(self) -> bool:
        return not self._finished and not self._call.is_active()

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        # Run on the loop, as grpc.aio does: the server's inbox tells the loop the call is done.
        if not self._call.watch_done():  # done already
            self._loop.call_soon(callback, self)
            return
        self._done_callbacks.setdefault(self._call.id, []).append(lambda: callback(self))

    async def _reply(self, response: Any) -> None:
        """A unary handler's response: with the call's status in one step, now, when that takes
        no wait (the message inside the status frame where the connection agreed, ADR 0025);
        else written as `write` does, and the status follows when the handler's task ends."""
        self._after_abort()  # its status went with the abort
        encoded = self._encode(response)
        if not self._raw and isinstance(encoded, bytes):
            md = None if self._trailing is None else outgoing(self._trailing)
            code, details = status_number(self._code, self._NUMBERS), status_details(self._details)
            if self._call.try_reply(encoded, code, details, md):
                self._finished = True
                return
        await self._op(self._send_op, encoded)

    async def _unary_request(self) -> Any:
        return self._request(await self._op(self._recv_op))

    async def _requests(self) -> AsyncIterator[Any]:
        while (request := await self.read()) is not grpc.aio.EOF:
            yield request
