"""The asyncio client: `Channel` and its multi-callables, in grpc.aio's shapes."""

from __future__ import annotations

import asyncio
import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar

import grpc
import grpc.aio

from .. import _native
from .._call import Deserializer, Serializer, encode
from .._channel import limited, limits, upgrades
from .._errors import rpc_error
from .._metadata import Metadatum, outgoing
from .._native import CallError
from ._call import (
    RequestIterable,
    StreamStreamCall,
    StreamUnaryCall,
    UnaryStreamCall,
    UnaryUnaryCall,
)
from ._reactor import Driver, driver


class _Closable(Protocol):
    """What `close` needs of a call in progress."""

    def _finished(self) -> asyncio.Future[Any]: ...
    def cancel(self) -> bool: ...
    def done(self) -> bool: ...


class _Pending:
    """A raw unary call in progress, as `close` sees it."""

    def __init__(self, outcome: asyncio.Future[Any], abandon: Callable[[], None]) -> None:
        self._outcome = outcome
        self._abandon = abandon

    def _finished(self) -> asyncio.Future[Any]:
        return self._outcome

    def cancel(self) -> bool:
        if not self._outcome.cancel():
            return False
        self._abandon()
        return True

    def done(self) -> bool:
        return self._outcome.done()


_T = TypeVar("_T", bound=_Closable)
_S = TypeVar("_S", UnaryStreamCall, StreamUnaryCall, StreamStreamCall)


class _MultiCallable:
    def __init__(self, channel: Channel, path: str, serialize: Serializer, deserialize: Deserializer):
        self._channel = channel
        self._path = path
        self._serialize = serialize
        self._deserialize = deserialize

    def _start(
        self,
        shape: type[_S],
        timeout: float | None,
        metadata: Iterable[Metadatum] | None,
        wait_for_ready: bool | None,
        requests: RequestIterable | None,
    ) -> _S:
        """A streaming call of `shape`, kept by the channel for `close`."""
        loop, driver, native = self._channel._bind()
        return self._channel._track(
            shape(
                loop,
                driver,
                native,
                self._path,
                outgoing(metadata),
                timeout,
                bool(wait_for_ready),
                self._serialize,
                self._deserialize,
                requests,
            )
        )


class UnaryUnaryMultiCallable(_MultiCallable, grpc.aio.UnaryUnaryMultiCallable):
    def __call__(
        self,
        request: Any,
        *,
        timeout: float | None = None,
        metadata: Iterable[Metadatum] | None = None,
        credentials: grpc.CallCredentials | None = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> UnaryUnaryCall:
        # The fast path: one engine operation and one future.
        loop, driver, native = self._channel._bind()
        # Encoded before the operation is registered: a failure here leaves nothing waiting.
        try:
            message = encode(self._serialize, request)
        except CallError as error:  # as grpcio's: the call fails INTERNAL
            return self._channel._track(_failed(loop, timeout, self._deserialize, error))
        outgoing_metadata = None if metadata is None else outgoing(metadata)
        spin = driver.idle(loop)
        token, outcome = driver.begin(loop)
        try:
            done = native.unary(
                token, self._path, message, outgoing_metadata, timeout, bool(wait_for_ready), spin
            )
        except BaseException:
            driver.abandon(token)
            raise
        if isinstance(done, tuple):
            driver.finish(token, done[1])
        # After a spin that missed, the await does not spin again.
        settle = _nothing if done is False else functools.partial(driver.settle, loop, outcome)
        return self._channel._track(
            UnaryUnaryCall(
                loop, timeout, self._deserialize, outcome, functools.partial(driver.abandon, token), settle
            )
        )


def _nothing() -> None:
    pass


def _failed(
    loop: asyncio.AbstractEventLoop, timeout: float | None, deserialize: Deserializer, error: CallError
) -> UnaryUnaryCall:
    """A unary call that failed before it started."""
    outcome: asyncio.Future[Any] = loop.create_future()
    outcome.set_result(error)
    return UnaryUnaryCall(loop, timeout, deserialize, outcome, _nothing, _nothing)


class UnaryStreamMultiCallable(_MultiCallable, grpc.aio.UnaryStreamMultiCallable):
    def __call__(
        self,
        request: Any,
        *,
        timeout: float | None = None,
        metadata: Iterable[Metadatum] | None = None,
        credentials: grpc.CallCredentials | None = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> UnaryStreamCall:
        return self._start(UnaryStreamCall, timeout, metadata, wait_for_ready, (request,))


class StreamUnaryMultiCallable(_MultiCallable, grpc.aio.StreamUnaryMultiCallable):
    def __call__(
        self,
        request_iterator: RequestIterable | None = None,
        timeout: float | None = None,
        metadata: Iterable[Metadatum] | None = None,
        credentials: grpc.CallCredentials | None = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> StreamUnaryCall:
        return self._start(StreamUnaryCall, timeout, metadata, wait_for_ready, request_iterator)


class StreamStreamMultiCallable(_MultiCallable, grpc.aio.StreamStreamMultiCallable):
    def __call__(
        self,
        request_iterator: RequestIterable | None = None,
        timeout: float | None = None,
        metadata: Iterable[Metadatum] | None = None,
        credentials: grpc.CallCredentials | None = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> StreamStreamCall:
        return self._start(StreamStreamCall, timeout, metadata, wait_for_ready, request_iterator)


class Channel(grpc.aio.Channel):
    """A client channel to any target grpc names (`host:port`, `unix:path`, …) or `shm://NAME`,
    with TLS if `tls` is given (from `secure_channel`). Its calls complete through the Reactor of
    the event loop it is first used on, and it stays with that loop (as a grpc.aio channel
    does). It moves to shared memory as the blocking channel does (`isthmus.upgrade`). Of grpc's
    `options` it uses `grpc.ssl_target_name_override` and the message-size limits, as the
    blocking channel does; `compression` is accepted for grpc's sake."""

    def __init__(
        self,
        target: str,
        options: Any = None,
        compression: grpc.Compression | None = None,
        tls: tuple[bytes | None, bytes | None, bytes | None, str | None] | None = None,
    ):
        self._target = target
        self._tls = tls
        self._upgrade = upgrades(options)
        self._max_send, self._max_receive = limits(options)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._driver: Driver | None = None
        self._native: _native.AsyncChannel | None = None
        self._closed = False
        self._shutdown: asyncio.Future[None] | None = None
        self._calls: weakref.WeakSet[_Closable] = weakref.WeakSet()  # for `close`
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # made outside a loop: bound on first use
        self._bind()  # a bad target fails here, not at the first call

    def _bind(self) -> tuple[asyncio.AbstractEventLoop, Driver, _native.AsyncChannel]:
        loop = asyncio.get_running_loop()
        if self._closed:
            raise grpc.aio.UsageError("Channel is closed.")
        if loop is not self._loop:
            if self._loop is not None:
                raise grpc.aio.UsageError("The channel is used on an event loop other than its own.")
            self._driver = driver(loop)
            self._native = _native.AsyncChannel(
                self._target, self._driver.reactor, self._tls, self._upgrade, self._max_receive
            )
            self._loop = loop
        return loop, self._driver, self._native  # type: ignore[return-value]

    def alloc(self, size: int) -> _native.Block:
        """The raw tier: a writable buffer of `size` bytes to build a request in, for
        `raw_unary`. Heap memory here (the asyncio channel copies it into shared memory when the
        call sends it); the blocking channel's `alloc` gives shared memory itself."""
        self._bind()
        return self._native.alloc(size)  # type: ignore[union-attr]

    async def raw_unary(
        self,
        method: str,
        request: Any,
        timeout: float | None = None,
        metadata: Iterable[Metadatum] | None = None,
        wait_for_ready: bool | None = None,
    ) -> _native.Message:
        """The raw tier, as the blocking channel's `raw_unary`: `request` is any C-contiguous
        buffer (numpy arrays among them), read in place when the call sends it, so leave it
        unchanged until the call completes; the reply is a read-only `isthmus.Message`, a view of
        the server's shared memory when it came through it. Cancelling the awaiting task cancels
        the call."""
        loop, driver, native = self._bind()
        token, outcome = driver.begin(loop)
        try:
            native.unary_raw(token, method, request, outgoing(metadata), timeout, bool(wait_for_ready))
        except BaseException:
            driver.abandon(token)
            raise
        pending = self._track(_Pending(outcome, functools.partial(driver.abandon, token)))
        try:
            driver.settle(loop, outcome)
            value = await outcome
        except asyncio.CancelledError:
            driver.abandon(token)
            raise
        del pending  # tracked for `close` until here
        if isinstance(value, CallError):
            raise rpc_error(value, aio=True)
        return value  # type: ignore[no-any-return]

    def transport_counts(self) -> dict[str, int]:
        """As the blocking channel's: calls over shared memory and over HTTP/2."""
        if self._native is None:
            return {"shm": 0, "http2": 0}
        shm, http2 = self._native.transport_counts()
        return {"shm": shm, "http2": http2}

    def upgrade_status(self) -> str:
        """As the blocking channel's: `off`, `pending`, `http2` or the `shm://` target."""
        return "pending" if self._native is None else self._native.upgrade_status()

    async def __aenter__(self) -> Channel:
        return self

    async def __aexit__(self, exc_type: object, exc_val: object, exc_tb: object) -> None:
        await self.close()

    def _track(self, call: _T) -> _T:
        """Keeps `call` (weakly) for `close`."""
        self._calls.add(call)
        return call

    async def close(self, grace: float | None = None) -> None:
        """Closes the channel, as grpc.aio's: new calls raise `grpc.aio.UsageError`; calls in
        progress get up to `grace` seconds to end, then are cancelled (their awaiters see
        `asyncio.CancelledError`)."""
        if self._closed:
            return
        self._closed = True
        calls = [call for call in self._calls if not call.done()]
        try:
            if grace and calls:
                await asyncio.wait([call._finished() for call in calls], timeout=grace)
        finally:  # also when the task closing the channel is cancelled meanwhile
            self._end(calls)

    def _end(self, calls: list[_Closable]) -> None:
        for call in calls:
            call.cancel()
        if self._native is not None:
            self._native.close()
        if self._shutdown is not None and not self._shutdown.done():
            self._shutdown.set_result(None)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        # The engine connects on a call and reports no connectivity states: as far as a caller
        # can tell before its first call, an open channel is ready.
        return grpc.ChannelConnectivity.SHUTDOWN if self._closed else grpc.ChannelConnectivity.READY

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        if self.get_state() is not last_observed_state:
            return
        if self._shutdown is None:
            self._shutdown = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._shutdown)  # READY to SHUTDOWN is the only change

    async def channel_ready(self) -> None:
        pass

    # `_registered_method` and whatever private keywords later grpcio-tools pass mean nothing
    # here: every method is called by its path.
    def unary_unary(
        self,
        method: str,
        request_serializer: Serializer = None,
        response_deserializer: Deserializer = None,
        _registered_method: bool | None = False,
        **kwargs: Any,
    ) -> UnaryUnaryMultiCallable:
        return UnaryUnaryMultiCallable(
            self, method, limited(request_serializer, self._max_send), response_deserializer
        )

    def unary_stream(
        self,
        method: str,
        request_serializer: Serializer = None,
        response_deserializer: Deserializer = None,
        _registered_method: bool | None = False,
        **kwargs: Any,
    ) -> UnaryStreamMultiCallable:
        return UnaryStreamMultiCallable(
            self, method, limited(request_serializer, self._max_send), response_deserializer
        )

    def stream_unary(
        self,
        method: str,
        request_serializer: Serializer = None,
        response_deserializer: Deserializer = None,
        _registered_method: bool | None = False,
        **kwargs: Any,
    ) -> StreamUnaryMultiCallable:
        return StreamUnaryMultiCallable(
            self, method, limited(request_serializer, self._max_send), response_deserializer
        )

    def stream_stream(
        self,
        method: str,
        request_serializer: Serializer = None,
        response_deserializer: Deserializer = None,
        _registered_method: bool | None = False,
        **kwargs: Any,
    ) -> StreamStreamMultiCallable:
        return StreamStreamMultiCallable(
            self, method, limited(request_serializer, self._max_send), response_deserializer
        )
