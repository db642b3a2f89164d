"""The asyncio client: `Channel` and its multi-callables, in grpc.aio's shapes.

A channel with client interceptors runs them as grpc.aio does, with grpc.aio's own intercepted
calls (a task runs the chain; the caller's call object waits for it), whose last continuation
starts an isthmus call. A channel without interceptors for a shape keeps the plain
multi-callable of that shape, whose calls start at once with no task."""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar

import grpc
import grpc.aio
from grpc.aio import _interceptor
from grpc.aio._channel import _BaseMultiCallable

from .. import _native
from .._call import Deserializer, Serializer, encode, serialize_failed
from .._channel import (
    LOOK_AGAIN_S,
    STATES,
    call_encoding,
    channel_compression,
    check_raw_size,
    connect_timeout_ms,
    default_authority,
    keepalive,
    limited,
    limits,
    upgrades,
    user_agent,
)
from .._credentials import Auth, Security, call_plugins, insecure, plugins_task_failed
from .._errors import rpc_error
from .._metadata import Metadatum, outgoing
from .._native import CallError
from .._stats import TransportStats
from ._call import (
    RequestIterable,
    StreamStreamCall,
    StreamUnaryCall,
    UnaryStreamCall,
    UnaryUnaryCall,
)
from ._reactor import Driver, driver

# Forks so far, as a child counts them: in a child, a channel bound before the fork finds its
# loop the long way (`get_running_loop`, which sees the fork), as it always did.
_forks = 0


def _count_fork() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_count_fork)
_get_ident = threading.get_ident


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

    def _encoding(self, compression: grpc.Compression | None) -> str | None:
        """The call's compression: its own if given, else the channel's."""
        return call_encoding(self._channel._compression, compression)

    def _asks(self, credentials: grpc.CallCredentials | None) -> bool:
        """Whether the call has call credentials to ask (its own, or its channel's); on a
        channel that is not secure, its own raise grpc.aio's UsageError, as grpc.aio raises it
        making the call."""
        auth = self._channel._auth
        if credentials is not None and not auth.secure:
            # grpc.aio's refusal (where grpcio's blocking API fails the call UNAUTHENTICATED).
            raise grpc.aio.UsageError("Call credentials are only valid on secure channels")
        # Credentials of a kind isthmus cannot read raise TypeError here, at the call, as grpc.aio
        # raises its own error there (they failed the plugins' task, and the call waited for ever).
        call_plugins(credentials)
        return credentials is not None or bool(auth.plugins)

    def _asking(
        self,
        loop: asyncio.AbstractEventLoop,
        metadata: Any,
        credentials: grpc.CallCredentials | None,
        timeout: float | None,
    ) -> asyncio.Future[Any]:
        """The call's metadata with what its call credentials give (`Auth.metadata_async`), or
        the CallError they fail the call with: each plugin asked on a thread of the loop's
        default executor, as grpc.aio asks them on a thread of its own (a plugin may block, or
        answer through the loop), its answer awaited on the loop. The caller's own metadata is
        checked here, at once."""
        outgoing(metadata)
        auth = self._channel._auth
        return loop.create_task(auth.metadata_async(metadata, credentials, self._path, timeout))

    def _start(
        self,
        shape: type[_S],
        timeout: float | None,
        metadata: Iterable[Metadatum] | None,
        wait_for_ready: bool | None,
        compression: grpc.Compression | None,
        requests: RequestIterable | None,
        credentials: grpc.CallCredentials | None = None,
    ) -> _S:
        """A streaming call of `shape`, kept by the channel for `close`."""
        loop, driver, native = self._channel._bind()
        asked = self._asking(loop, metadata, credentials, timeout) if self._asks(credentials) else None
        return self._channel._track(
            shape(
                loop,
                driver,
                native,
                self._path,
                None if asked is not None else outgoing(metadata),
                timeout,
                bool(wait_for_ready),
                self._encoding(compression),
                self._serialize,
                self._deserialize,
                requests,
                asked,
            )
        )


class UnaryUnaryMultiCallable(_native.AioUnaryCallable, _MultiCallable, grpc.aio.UnaryUnaryMultiCallable):
    # `__call__` is the native base's: a call without metadata or a compression of its own,
    # made on its standard loop's thread, is a few native steps (the serializer, the engine
    # operation and its future, the call object, `_track`), where the same in Python, with the
    # call's await, cost the loop's thread ~1 µs more a call; the others come to `_call`, and a
    # serializer's failure to `_serialize_failed`. Both sides read the channel's `_fast`.

    _call_type = UnaryUnaryCall

    def _call(
        self,
        request: Any,
        timeout: float | None,
        metadata: Iterable[Metadatum] | None,
        credentials: grpc.CallCredentials | None,
        wait_for_ready: bool | None,
        compression: grpc.Compression | None,
    ) -> UnaryUnaryCall:
        channel = self._channel
        loop, driver, native = channel._bind()
        serialize = self._serialize
        # Encoded before the operation is registered: a failure here leaves nothing waiting.
        # (`encode` also fails a request that serializes to None, as the native path does.)
        try:
            message = encode(serialize, request)
        except CallError as error:  # as grpcio's: the call fails (INTERNAL for the serializer)
            return channel._track(_failed(loop, timeout, self._deserialize, error))
        if self._asks(credentials):
            asked = self._asking(loop, metadata, credentials, timeout)
            return channel._track(self._unary_when(asked, message, timeout, wait_for_ready, compression))
        spin = driver.idle(loop)
        token, outcome = driver.begin(loop)
        try:
            done = native.unary(
                token,
                self._path,
                message,
                None if metadata is None else outgoing(metadata),
                timeout,
                bool(wait_for_ready),
                self._encoding(compression),
                spin,
            )
        except BaseException:
            driver.abandon(token)
            raise
        if isinstance(done, tuple):  # (ok, value): it finished in the spin
            driver.finish(token, done[1])
        # After a spin that missed, the await does not spin again.
        return channel._track(
            UnaryUnaryCall(loop, timeout, self._deserialize, outcome, driver, token, done is not False)
        )

    def _unary_when(
        self,
        asked: asyncio.Future[Any],
        message: bytes,
        timeout: float | None,
        wait_for_ready: bool | None,
        compression: grpc.Compression | None,
    ) -> UnaryUnaryCall:
        """A unary call that starts once its call credentials have answered (`asked`: the
        metadata, or the CallError that fails the call); cancelled before then, it starts
        nothing."""
        loop, driver, native = self._channel._bind()
        outcome: asyncio.Future[Any] = loop.create_future()
        path, encoding = self._path, self._encoding(compression)

        def start(answer: asyncio.Future[Any]) -> None:
            if outcome.done():  # cancelled while the plugins answered
                return
            if answer.cancelled():  # the loop is ending its tasks: so the call ends
                outcome.cancel()
                return
            failed = answer.exception()
            if failed is not None:  # the plugins' task failed (the loop is closing): as a stream
                outcome.set_result(plugins_task_failed(failed))
                return
            metadata = answer.result()
            if isinstance(metadata, CallError):
                outcome.set_result(metadata)
                return
            token, engine = driver.begin(loop)
            try:
                done = native.unary(
                    token, path, message, outgoing(metadata), timeout, bool(wait_for_ready), encoding, False
                )
            except BaseException as error:
                driver.abandon(token)
                outcome.set_exception(error)
                return
            if isinstance(done, tuple):
                driver.finish(token, done[1])
            engine.add_done_callback(lambda e: None if outcome.done() else outcome.set_result(e.result()))
            outcome.add_done_callback(lambda o: driver.abandon(token) if o.cancelled() else None)

        asked.add_done_callback(start)
        return UnaryUnaryCall(loop, timeout, self._deserialize, outcome, None, 0, False)

    def _serialize_failed(self, error: Exception, timeout: float | None) -> UnaryUnaryCall:
        """The call of a request the serializer failed on (as grpcio's: INTERNAL, logged)."""
        failure = error if isinstance(error, CallError) else serialize_failed(error)
        return self._channel._track(_failed(self._channel._bind()[0], timeout, self._deserialize, failure))


def _failed(
    loop: asyncio.AbstractEventLoop, timeout: float | None, deserialize: Deserializer, error: CallError
) -> UnaryUnaryCall:
    """A unary call that failed before it started."""
    outcome: asyncio.Future[Any] = loop.create_future()
    outcome.set_result(error)
    return UnaryUnaryCall(loop, timeout, deserialize, outcome, None, 0, False)


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
        return self._start(
            UnaryStreamCall, timeout, metadata, wait_for_ready, compression, (request,), credentials
        )


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
        return self._start(
            StreamUnaryCall, timeout, metadata, wait_for_ready, compression, request_iterator, credentials
        )


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
        return self._start(
            StreamStreamCall, timeout, metadata, wait_for_ready, compression, request_iterator, credentials
        )


# Client interceptors: grpc.aio's intercepted calls, reused whole but for `_invoke`, so that
# cancelling, done callbacks, `write` through the chain and the caller's view of what an
# interceptor returned stay grpc.aio's. The last continuation starts the call through this
# module's multi-callables (so `close` knows it) where grpc's starts a cygrpc one.


def _path(method: bytes | str) -> str:
    """grpc.aio hands interceptors the method as bytes; one may give a str back."""
    return method.decode() if isinstance(method, bytes) else method


class _Intercepted:
    """The chain of `_invoke`, as grpc.aio's `_run_interceptor` runs it for each shape: the first
    interceptor is the outermost, each continuation runs the rest, and the last one starts the
    call with the shape's plain multi-callable."""

    _channel: Channel
    _intercept: str  # the interceptors' method for this shape
    _plain: type[_MultiCallable]

    def _terminal(self, details: Any, request: Any, serialize: Serializer, deserialize: Deserializer) -> Any:
        start = self._plain(self._channel, _path(details.method), serialize, deserialize)
        metadata, compression = _compression_of(details.metadata)
        return start(  # type: ignore[operator]
            request,
            timeout=details.timeout,
            metadata=metadata,
            credentials=details.credentials,
            wait_for_ready=details.wait_for_ready,
            compression=compression,
        )

    def _returned(self, value: Any) -> Any:
        """What an interceptor's return value becomes for the caller."""
        return value

    async def _invoke(
        self,
        interceptors: Sequence[Any],
        method: bytes,
        timeout: float | None,
        metadata: grpc.aio.Metadata | None,
        credentials: grpc.CallCredentials | None,
        wait_for_ready: bool | None,
        request: Any,
        request_serializer: Serializer,
        response_deserializer: Deserializer,
    ) -> Any:
        async def run(index: int, details: Any, request: Any) -> Any:
            if index == len(interceptors):
                return self._terminal(details, request, request_serializer, response_deserializer)
            intercept = getattr(interceptors[index], self._intercept)
            return self._returned(await intercept(functools.partial(run, index + 1), details, request))

        details = grpc.aio.ClientCallDetails(method, timeout, metadata, credentials, wait_for_ready)
        return await run(0, details, request)


class _InterceptedStreamResponse(_Intercepted):
    """grpc.aio's rule for streaming responses: an interceptor may give back a response iterator
    instead of a call; the caller iterates it, and asks the status of the last call given."""

    _call_type: type
    _response_iterator: type
    _last_returned_call_from_interceptors: Any  # grpc.aio's name: its base class reads it

    def _terminal(self, *args: Any) -> Any:
        self._last_returned_call_from_interceptors = call = super()._terminal(*args)
        return call

    def _returned(self, value: Any) -> Any:
        if not isinstance(value, self._call_type):
            value = self._response_iterator(self._last_returned_call_from_interceptors, value)
        self._last_returned_call_from_interceptors = value
        return value


class InterceptedUnaryUnaryCall(_Intercepted, _interceptor.InterceptedUnaryUnaryCall):
    _intercept = "intercept_unary_unary"
    _plain = UnaryUnaryMultiCallable

    def _returned(self, value: Any) -> Any:
        # grpc.aio's rule: an interceptor may answer with the response itself (one it made, or
        # the call's), which the caller sees as an OK call with no metadata.
        if isinstance(value, grpc.aio.UnaryUnaryCall):
            return value
        return _interceptor.UnaryUnaryCallResponse(value)


class InterceptedUnaryStreamCall(_InterceptedStreamResponse, _interceptor.InterceptedUnaryStreamCall):
    _intercept = "intercept_unary_stream"
    _plain = UnaryStreamMultiCallable
    _call_type = grpc.aio.UnaryStreamCall
    _response_iterator = _interceptor.UnaryStreamCallResponseIterator


class InterceptedStreamUnaryCall(_Intercepted, _interceptor.InterceptedStreamUnaryCall):
    _intercept = "intercept_stream_unary"
    _plain = StreamUnaryMultiCallable


class InterceptedStreamStreamCall(_InterceptedStreamResponse, _interceptor.InterceptedStreamStreamCall):
    _intercept = "intercept_stream_stream"
    _plain = StreamStreamMultiCallable
    _call_type = grpc.aio.StreamStreamCall
    _response_iterator = _interceptor.StreamStreamCallResponseIterator


# grpc.aio's own: the caller's metadata as the `grpc.aio.Metadata` interceptors are given, with
# a call's compression in it as grpc.aio carries it past them (a header of its own, which the
# last continuation takes back out: `_compression_of`).
_init_metadata = _BaseMultiCallable._init_metadata
_COMPRESSION_KEY = "grpc-internal-encoding-request"
_BY_ENCODING = {
    "gzip": grpc.Compression.Gzip,
    "deflate": grpc.Compression.Deflate,
    "identity": grpc.Compression.NoCompression,
}


def _compression_of(metadata: Any) -> tuple[Any, grpc.Compression | None]:
    """The metadata an interceptor chain ends with, without the compression grpc.aio put in
    it, and that compression."""
    if not metadata:
        return metadata, None
    compression = None
    kept = []
    for key, value in metadata:
        if key in (_COMPRESSION_KEY, _COMPRESSION_KEY.encode()):
            compression = _BY_ENCODING.get(value.decode() if isinstance(value, bytes) else value)
        else:
            kept.append((key, value))
    return (kept if compression is not None else metadata), compression


class _InterceptedMultiCallable(_MultiCallable):
    """The multi-callables of a channel with interceptors for their shape. Those without keep
    the plain ones, whose calls start at once with no task."""

    def __init__(
        self,
        channel: Channel,
        path: str,
        serialize: Serializer,
        deserialize: Deserializer,
        interceptors: Sequence[Any],
    ):
        super().__init__(channel, path, serialize, deserialize)
        self._interceptors = interceptors
        self._method = path.encode()

    def _intercepted(
        self,
        shape: type,
        request: Any,
        timeout: float | None,
        metadata: Iterable[Metadatum] | None,
        credentials: grpc.CallCredentials | None,
        wait_for_ready: bool | None,
        compression: grpc.Compression | None,
    ) -> Any:
        # The channel is not bound here: as in grpc.aio, a closed channel (or one of another
        # loop) fails the call at the last continuation, where the interceptors see it.
        initial = _init_metadata(metadata, compression)
        if compression == grpc.Compression.NoCompression:  # which grpc.aio drops (it is 0)
            # A copy: `_init_metadata` gives back the caller's own Metadata when it adds nothing.
            initial = grpc.aio.Metadata(*initial, (_COMPRESSION_KEY, "identity"))
        call = shape(
            self._interceptors,
            request,
            timeout,
            initial,
            credentials,
            wait_for_ready,
            self._channel,
            self._method,
            self._serialize,
            self._deserialize,
            asyncio.get_running_loop(),
        )
        self._channel._track_interceptors(call._interceptors_task)
        return call


class _InterceptedUnaryUnaryMultiCallable(_InterceptedMultiCallable, grpc.aio.UnaryUnaryMultiCallable):
    def __call__(
        self,
        request: Any,
        *,
        timeout: float | None = None,
        metadata: Iterable[Metadatum] | None = None,
        credentials: grpc.CallCredentials | None = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> InterceptedUnaryUnaryCall:
        return self._intercepted(  # type: ignore[no-any-return]
            InterceptedUnaryUnaryCall, request, timeout, metadata, credentials, wait_for_ready, compression
        )


class _InterceptedUnaryStreamMultiCallable(_InterceptedMultiCallable, grpc.aio.UnaryStreamMultiCallable):
    def __call__(
        self,
        request: Any,
        *,
        timeout: float | None = None,
        metadata: Iterable[Metadatum] | None = None,
        credentials: grpc.CallCredentials | None = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> InterceptedUnaryStreamCall:
        return self._intercepted(  # type: ignore[no-any-return]
            InterceptedUnaryStreamCall, request, timeout, metadata, credentials, wait_for_ready, compression
        )


class _InterceptedStreamUnaryMultiCallable(_InterceptedMultiCallable, grpc.aio.StreamUnaryMultiCallable):
    def __call__(
        self,
        request_iterator: RequestIterable | None = None,
        timeout: float | None = None,
        metadata: Iterable[Metadatum] | None = None,
        credentials: grpc.CallCredentials | None = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> InterceptedStreamUnaryCall:
        return self._intercepted(  # type: ignore[no-any-return]
            InterceptedStreamUnaryCall,
            request_iterator,
            timeout,
            metadata,
            credentials,
            wait_for_ready,
            compression,
        )


class _InterceptedStreamStreamMultiCallable(_InterceptedMultiCallable, grpc.aio.StreamStreamMultiCallable):
    def __call__(
        self,
        request_iterator: RequestIterable | None = None,
        timeout: float | None = None,
        metadata: Iterable[Metadatum] | None = None,
        credentials: grpc.CallCredentials | None = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> InterceptedStreamStreamCall:
        return self._intercepted(  # type: ignore[no-any-return]
            InterceptedStreamStreamCall,
            request_iterator,
            timeout,
            metadata,
            credentials,
            wait_for_ready,
            compression,
        )


_INTERCEPTORS = (
    grpc.aio.UnaryUnaryClientInterceptor,
    grpc.aio.UnaryStreamClientInterceptor,
    grpc.aio.StreamUnaryClientInterceptor,
    grpc.aio.StreamStreamClientInterceptor,
)


def _by_shape(interceptors: Sequence[Any] | None) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
    """`interceptors` sorted by the shape they intercept, in order, as grpc.aio's channel sorts
    them: each by the first of the four classes it is an instance of."""
    shapes: tuple[list[Any], list[Any], list[Any], list[Any]] = ([], [], [], [])
    for interceptor in interceptors or ():
        for kind, shape in zip(_INTERCEPTORS, shapes, strict=True):
            if isinstance(interceptor, kind):
                shape.append(interceptor)
                break
        else:
            raise ValueError(
                f"Interceptor {interceptor} must be "
                + " or ".join(kind.__name__ for kind in _INTERCEPTORS)
                + ". "
            )
    return shapes


class Channel(grpc.aio.Channel):
    """A client channel to any target grpc names (`host:port`, `unix:path`, …) or `shm://NAME`,
    with TLS if `tls` is given (from `secure_channel`). Its calls complete through the Reactor of
    the event loop it is first used on, and it stays with that loop (as a grpc.aio channel
    does). It moves to shared memory as the blocking channel does (`isthmus.upgrade`). Of grpc's
    `options` it uses `grpc.ssl_target_name_override`, the message-size limits, the keepalive,
    connect timeout and user agent options, as the blocking channel does, and compresses requests over
    HTTP/2 as it does (`compression`, `grpc.default_compression_algorithm`, or a call's own
    `compression=`).
    `interceptors` are grpc.aio's client interceptors, run as a grpc.aio channel runs them."""

    def __init__(
        self,
        target: str,
        options: Any = None,
        compression: grpc.Compression | None = None,
        security: Security | None = None,
        interceptors: Sequence[Any] | None = None,
    ):
        # Checked first, as grpc.aio does: a bad interceptor fails before anything is made.
        self._interceptors = _by_shape(interceptors)
        self._target = target
        security = security or insecure(target)
        self._tls = security.tls
        self._authority = default_authority(options)
        self._auth = Auth(security, target, self._authority)
        self._upgrade = upgrades(options)
        self._keepalive = keepalive(options)
        self._connect_timeout_ms = connect_timeout_ms(options)
        self._user_agent = user_agent(options)
        self._max_send, self._max_receive = limits(options)
        self._compression = channel_compression(compression, options)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._driver: Driver | None = None
        self._native: _native.AsyncChannel | None = None
        self._bound: tuple[asyncio.AbstractEventLoop, Driver, _native.AsyncChannel]  # set with _loop
        # `_forks` when _loop was set, -1 once closed: `_bind`'s one check for both.
        self._bound_forks = -1
        # What the native unary path needs of a bound channel (see `_bind`); None unbound or
        # closed.
        self._fast: tuple[Any, ...] | None = None
        self._closed = False
        self._shutdown: asyncio.Future[None] | None = None
        # The calls, for `close`, weakly: a set of references that remove themselves (a
        # WeakSet's bookkeeping is Python code, which each unary call would pay for twice).
        self._calls: set[weakref.ref[_Closable]] = set()
        self._forget = self._calls.discard
        # The tasks that run interceptors, also for `close`: one may be cancelled before it
        # starts a call (or while it waits for one).
        self._chains: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # made outside a loop: bound on first use
        self._bind()  # a bad target fails here, not at the first call

    def _bind(self) -> tuple[asyncio.AbstractEventLoop, Driver, _native.AsyncChannel]:
        # Python 3.11's get_running_loop makes a getpid system call on every call (to notice a
        # fork), 0.2 µs of the loop's time per unary call. An asyncio loop names the thread
        # that runs it, and a thread runs one loop at a time: that loop, running on this thread
        # and in this process, is the running loop. (uvloop's does not say: the long way.)
        # The native unary path makes the same test on `_fast` (None once closed).
        if self._bound_forks == _forks and getattr(self._loop, "_thread_id", None) == _get_ident():
            return self._bound
        loop = asyncio.get_running_loop()
        if loop is self._loop and not self._closed:
            return self._bound
        if self._closed:
            raise grpc.aio.UsageError("Channel is closed.")
        if loop is not self._loop:
            if self._loop is not None:
                raise grpc.aio.UsageError("The channel is used on an event loop other than its own.")
            self._driver = driver(loop)
            self._native = _native.AsyncChannel(
                self._target,
                self._driver.reactor,
                self._tls,
                self._upgrade,
                self._max_receive,
                self._keepalive,
                self._user_agent,
                self._authority,
                self._connect_timeout_ms,
            )
            self._loop = loop
            self._bound = (loop, self._driver, self._native)
            self._bound_forks = _forks
            # Read by `_native.AioUnaryCallable.__call__`, in this order; a channel with call
            # credentials of its own leaves its calls to `_call`, which asks them.
            self._fast = (
                None
                if self._auth.plugins
                else (
                    _native.forks(),
                    loop,
                    self._driver,
                    self._native,
                    self._driver._waiting,
                    self._driver._tokens,
                    self._calls,
                    self._forget,
                    self._compression,
                )
            )
        return self._bound

    def alloc(self, size: int) -> _native.Block:
        """The raw tier: a writable buffer of `size` bytes to build a request in, for
        `raw_unary` on this channel. It never waits: shared memory (sent where it is, no copy)
        when the channel's `shm://` connection is up and has room at once, else heap memory,
        which the call copies when it sends it (`block.shared` tells which). The first call
        connects the channel; so does `await channel.channel_ready()`."""
        self._bind()
        return self._native.alloc(size)  # type: ignore[union-attr]

    async def raw_unary(
        self,
        method: str,
        request: Any,
        timeout: float | None = None,
        metadata: Iterable[Metadatum] | None = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> _native.Message:
        """The raw tier, as the blocking channel's `raw_unary`: `request` is any C-contiguous
        buffer (numpy arrays among them), read in place when the call sends it, so leave it
        unchanged until the call completes; the reply is a read-only `isthmus.Message`, a view of
        the server's shared memory when it came through it. Cancelling the awaiting task cancels
        the call. A request over `grpc.max_send_message_length` fails RESOURCE_EXHAUSTED."""
        loop, driver, native = self._bind()
        try:
            check_raw_size(request, self._max_send)
        except CallError as e:
            raise rpc_error(e, aio=True) from None
        token, outcome = driver.begin(loop)
        try:
            native.unary_raw(
                token,
                method,
                request,
                outgoing(metadata),
                timeout,
                bool(wait_for_ready),
                call_encoding(self._compression, compression),
            )
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

    def stats(self) -> TransportStats:
        """As the blocking channel's: the counters of its shared-memory connections."""
        if self._native is None:
            return TransportStats(0, 0, 0, 0, 0, 0)
        return TransportStats(**self._native.stats())

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
        self._calls.add(weakref.ref(call, self._forget))
        return call

    def _track_interceptors(self, task: asyncio.Task[Any]) -> None:
        """Keeps `task`, which runs a call's interceptors, (weakly) for `close`; the call it
        starts is kept by `_track`. (Weakly: the intercepted call holds it, and cancels it when
        dropped.)"""
        self._chains.add(task)

    async def close(self, grace: float | None = None) -> None:
        """Closes the channel, as grpc.aio's: new calls raise `grpc.aio.UsageError`; calls in
        progress get up to `grace` seconds to end, then are cancelled (their awaiters see
        `asyncio.CancelledError`)."""
        if self._closed:
            return
        self._closed = True
        self._bound_forks = -1
        self._fast = None
        calls = [call for ref in list(self._calls) if (call := ref()) is not None and not call.done()]
        chains = [task for task in self._chains if not task.done()]
        try:
            if grace and (calls or chains):
                await asyncio.wait([*(call._finished() for call in calls), *chains], timeout=grace)
        finally:  # also when the task closing the channel is cancelled meanwhile
            self._end(calls, chains)

    def _end(self, calls: list[_Closable], chains: list[asyncio.Task[Any]]) -> None:
        for chain in chains:
            chain.cancel()
        for call in calls:
            call.cancel()
        if self._native is not None:
            self._native.close()
        if self._shutdown is not None and not self._shutdown.done():
            self._shutdown.set_result(None)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        """As grpc.aio's: the state of the channel's connection; `try_to_connect` starts
        connecting an idle channel (and keeps trying with backoff while it fails)."""
        if self._closed:
            return grpc.ChannelConnectivity.SHUTDOWN
        if self._native is None:
            if not try_to_connect:
                return grpc.ChannelConnectivity.IDLE
            self._bind()
        return STATES[self._native.connectivity(try_to_connect)]  # type: ignore[union-attr]

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        """Returns once the state is not `last_observed_state` (as grpc.aio's)."""
        while self.get_state() is last_observed_state:
            loop, driver, native = self._bind()
            if self._shutdown is None:
                self._shutdown = loop.create_future()
            token, changed = driver.begin(loop)
            native.watch_connectivity(token)
            try:
                # The fast path's connection signals nothing: look again after a while.
                await asyncio.wait([changed, self._shutdown], timeout=LOOK_AGAIN_S)
            finally:
                if not changed.done():
                    driver.abandon(token)

    async def channel_ready(self) -> None:
        """Returns once the channel is READY, connecting it (as grpc.aio's). For an `shm://`
        target, also once `alloc` can give shared memory (or after a second)."""
        state = self.get_state(try_to_connect=True)
        while state is not grpc.ChannelConnectivity.READY:
            await self.wait_for_state_change(state)
            state = self.get_state(try_to_connect=True)
        native = self._bind()[2]
        for _ in range(1000):
            if not self._target.startswith("shm:") or native.shm_ready():
                return
            await asyncio.sleep(0.001)

    # `_registered_method` and whatever private keywords later grpcio-tools pass mean nothing
    # here: every method is called by its path.
    def unary_unary(
        self,
        method: str,
        request_serializer: Serializer = None,
        response_deserializer: Deserializer = None,
        _registered_method: bool | None = False,
        **kwargs: Any,
    ) -> UnaryUnaryMultiCallable | _InterceptedUnaryUnaryMultiCallable:
        serialize = limited(request_serializer, self._max_send)
        if self._interceptors[0]:
            return _InterceptedUnaryUnaryMultiCallable(
                self, method, serialize, response_deserializer, self._interceptors[0]
            )
        return UnaryUnaryMultiCallable(self, method, serialize, response_deserializer)

    def unary_stream(
        self,
        method: str,
        request_serializer: Serializer = None,
        response_deserializer: Deserializer = None,
        _registered_method: bool | None = False,
        **kwargs: Any,
    ) -> UnaryStreamMultiCallable | _InterceptedUnaryStreamMultiCallable:
        serialize = limited(request_serializer, self._max_send)
        if self._interceptors[1]:
            return _InterceptedUnaryStreamMultiCallable(
                self, method, serialize, response_deserializer, self._interceptors[1]
            )
        return UnaryStreamMultiCallable(self, method, serialize, response_deserializer)

    def stream_unary(
        self,
        method: str,
        request_serializer: Serializer = None,
        response_deserializer: Deserializer = None,
        _registered_method: bool | None = False,
        **kwargs: Any,
    ) -> StreamUnaryMultiCallable | _InterceptedStreamUnaryMultiCallable:
        serialize = limited(request_serializer, self._max_send)
        if self._interceptors[2]:
            return _InterceptedStreamUnaryMultiCallable(
                self, method, serialize, response_deserializer, self._interceptors[2]
            )
        return StreamUnaryMultiCallable(self, method, serialize, response_deserializer)

    def stream_stream(
        self,
        method: str,
        request_serializer: Serializer = None,
        response_deserializer: Deserializer = None,
        _registered_method: bool | None = False,
        **kwargs: Any,
    ) -> StreamStreamMultiCallable | _InterceptedStreamStreamMultiCallable:
        serialize = limited(request_serializer, self._max_send)
        if self._interceptors[3]:
            return _InterceptedStreamStreamMultiCallable(
                self, method, serialize, response_deserializer, self._interceptors[3]
            )
        return StreamStreamMultiCallable(self, method, serialize, response_deserializer)
