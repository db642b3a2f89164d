"""The asyncio server's plain (non-async) handlers, run as grpc.aio runs them: on an executor's
thread, with `SyncServicerContext`, a blocking context over the call's asyncio one (grpc.aio's
`_SyncServicerContext`): `abort` ends the handler there and then, `send_initial_metadata` and the
request iterator wait for the loop, the rest reads and sets what the asyncio context holds."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterable, Iterator
from typing import Any, NoReturn, TypeVar

import grpc
import grpc.aio

from .._metadata import Metadata, Metadatum
from .._native import Block
from ._context import ServicerContext

_LOG = logging.getLogger("isthmus")

T = TypeVar("T")


class SyncServicerContext(grpc.ServicerContext):
    """A plain handler's context on the asyncio server. Its outcome (code, details, trailing
    metadata, abort) is the asyncio context's, which ends the call when the handler returns."""

    def __init__(self, context: ServicerContext, loop: asyncio.AbstractEventLoop) -> None:
        self._context = context
        self._loop = loop

    def _wait(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Runs `coroutine` on the loop and waits for it (on the handler's thread). Refused on
        the loop's own thread (a coroutine a plain handler gave, using this context), where it
        would wait for ever, and every call of the server with it."""
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            coroutine.close()
            raise RuntimeError(
                "a plain handler's blocking context was used on the event loop's thread, where it"
                " would wait for ever: make the handler a coroutine function (async def)"
            )
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def _requests(self) -> Iterator[Any]:
        """A request-streaming handler's blocking request iterator."""
        while (request := self._wait(self._context.read())) is not grpc.aio.EOF:
            yield request

    def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Iterable[Metadatum] = ()
    ) -> NoReturn:
        # The asyncio context's abort, on the loop, as grpc.aio's: the status goes now, and a
        # second abort (a handler's `except` around the first) is refused, UsageError, leaving
        # the first's status (only recorded, the second's replaced it). grpc.aio's then returns
        # (its abort does not raise); this one raises the AbortError, as abort is documented to.
        self._wait(self._context.abort(code, details, tuple(trailing_metadata or ())))
        raise grpc.aio.AbortError(details)  # not reached: the abort raised

    def abort_with_status(self, status: grpc.Status) -> NoReturn:
        self.abort(status.code, status.details, status.trailing_metadata or ())

    def send_initial_metadata(self, initial_metadata: Iterable[Metadatum]) -> None:
        self._wait(self._context.send_initial_metadata(initial_metadata))

    def set_trailing_metadata(self, trailing_metadata: Iterable[Metadatum]) -> None:
        self._context.set_trailing_metadata(trailing_metadata)

    def trailing_metadata(self) -> Iterable[Metadatum] | None:
        return self._context.trailing_metadata()

    def set_code(self, code: grpc.StatusCode) -> None:
        self._context.set_code(code)

    def code(self) -> grpc.StatusCode | None:
        return self._context.code()

    def set_details(self, details: str) -> None:
        self._context.set_details(details)

    def details(self) -> str | None:
        return self._context.details()

    def invocation_metadata(self) -> Metadata:
        return self._context.invocation_metadata()

    def peer(self) -> str:
        return self._context.peer()

    def peer_identities(self) -> Iterable[bytes] | None:
        return self._context.peer_identities()

    def peer_identity_key(self) -> str | None:
        return self._context.peer_identity_key()

    def auth_context(self) -> dict[str, Iterable[bytes]]:
        return self._context.auth_context()

    def time_remaining(self) -> float | None:
        return self._context.time_remaining()

    def set_compression(self, compression: grpc.Compression) -> None:
        self._context.set_compression(compression)

    def disable_next_message_compression(self) -> None:
        self._context.disable_next_message_compression()

    def is_active(self) -> bool:
        return not self._context.done()

    def cancel(self) -> None:
        self._context._call.finish(grpc.StatusCode.CANCELLED.value[0], "Cancelled by the server", None)

    def add_callback(self, callback: Callable[[], None]) -> bool:
        """`callback()` when the call ends, on the loop's thread."""

        def guarded(_: Any) -> None:
            try:
                callback()
            except Exception:
                _LOG.exception("A ServicerContext callback raised")

        self._loop.call_soon_threadsafe(self._context.add_done_callback, guarded)
        return True

    def alloc(self, size: int) -> Block:
        """For a raw handler (`isthmus.raw`): the asyncio context's `alloc`."""
        return self._context.alloc(size)
