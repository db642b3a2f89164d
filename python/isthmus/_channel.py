"""The blocking client: `Channel` and its multi-callables, in grpc's shapes."""

from __future__ import annotations

import collections
import functools
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import grpc

from . import _native
from ._call import (
    COMPLETIONS as _COMPLETIONS,
)
from ._call import (
    Call,
    Deserializer,
    Serializer,
    Succeeded,
    buffer_size,
    channel_closed,
    decode,
    deserialize_failed,
    encode,
    resolved,
    run_on_own_thread,
    serialize_failed,
)
from ._credentials import Auth, Security, call_plugins, insecure
from ._errors import rpc_error
from ._metadata import Metadatum, outgoing
from ._native import CallError
from ._stats import TransportStats

_LOG = logging.getLogger("isthmus")


class _MultiCallable:
    def __init__(
        self,
        channel: _native.Channel,
        path: str,
        serialize: Serializer,
        deserialize: Deserializer,
        compression: str | None = None,
    ):
        self._channel = channel
        self._path = path
        self._serialize = serialize
        self._deserialize = deserialize
        self._compression = compression  # the channel's, as a grpc-encoding name

    def _encoding(self, compression: grpc.Compression | None) -> str | None:
        """The call's compression: its own if given, else the channel's."""
        return call_encoding(self._compression, compression)

    # The channel's part in call credentials (set by `Channel._callable`).
    _auth: Auth

    def _with_credentials(
        self, metadata: Any, credentials: grpc.CallCredentials | None, timeout: float | None
    ) -> Any:
        """`_asked` for a blocking call: one that its call credentials fail raises grpc's
        error, as grpcio's does."""
        asked = self._asked(metadata, credentials, timeout)
        if isinstance(asked, CallError):
            raise rpc_error(asked) from None
        return asked

    def _asked(self, metadata: Any, credentials: grpc.CallCredentials | None, timeout: float | None) -> Any:
        """The call's metadata with what its call credentials give (`Auth.metadata`), or the
        CallError they fail the call with."""
        if credentials is None and not self._auth.plugins:
            return metadata
        return self._auth.metadata(metadata, credentials, self._path, timeout)

    def _when_asked(
        self,
        run: Callable[..., Call],
        request: bytes | Iterator[Any],
        timeout: float | None,
        metadata: Any,
        credentials: grpc.CallCredentials | None,
        wait_for_ready: bool | None,
        compression: str | None,
    ) -> Call:
        """`run` (`_future` or `_stream`) for the call, at once if it has no call credentials
        and need not wait for a server. Otherwise a call returned at once, whose credentials
        are asked, or whose server is waited for (`wait_for_ready` on a channel not READY), on a
        thread of its own, and which then runs, or ends with their failure, as a grpcio future
        or response stream does while its plugins answer or its channel connects off the
        caller's thread (a caller could not even cancel a call it did not have yet). A call
        cancelled meanwhile starts nothing."""
        asks = credentials is not None or bool(self._auth.plugins)
        ready = grpc.ChannelConnectivity.READY
        waits = bool(wait_for_ready) and STATES[self._channel.connectivity(False)] is not ready
        if not asks and not waits:
            return run(request, timeout, metadata, wait_for_ready, compression)
        if asks:
            call_plugins(credentials)  # credentials of a kind isthmus cannot read: TypeError here
        call = Call(self._deserialize, timeout)
        call._streaming = run == self._stream  # its status waits for its responses meanwhile too
        if not self._auth.hold(call):  # until it starts: the channel's close ends it meanwhile
            # As the native channel refuses a call after its close, without asking the plugins.
            raise ValueError("Cannot invoke RPC: Channel closed!")

        def ask() -> None:
            try:
                asked = self._asked(metadata, credentials, timeout) if asks else metadata
                if isinstance(asked, CallError):
                    call._end(asked)
                elif not call._ended:  # not `done()`, which would have its status watched
                    if asks:
                        call._restart_clock()  # the plugin's time is not the call's, as in grpcio
                    run(request, timeout, asked, wait_for_ready, compression, call)
            except Exception as e:
                # What would have raised in the caller's thread (metadata the engine refuses,
                # say) ends the call instead of the thread, so no one waits for it for ever.
                _LOG.exception("A call could not start once its call credentials answered")
                call._end(CallError(grpc.StatusCode.INTERNAL.value[0], f"the call could not start: {e!r}"))
            finally:
                self._auth.release(call)

        run_on_own_thread(call, ask, "isthmus-start")
        return call

    def _encode(self, request: Any) -> bytes:
        """The request serialised; a serializer's failure raises grpc's INTERNAL error."""
        try:
            return encode(self._serialize, request)
        except CallError as e:
            raise rpc_error(e) from None

    def _run(
        self,
        request: bytes | Iterator[Any],
        timeout: float | None,
        metadata: Iterable[Metadatum] | None,
        wait_for_ready: bool | None,
        compression: str | None,
    ) -> Call:
        """A call with one response, run to its end on this thread."""
        call = Call(self._deserialize, timeout)
        call._complete(
            self._channel,
            self._path,
            outgoing(metadata),
            timeout,
            bool(wait_for_ready),
            compression,
            request,
            self._serialize,
        )
        return call

    def _future(
        self,
        request: bytes | Iterator[Any],
        timeout: float | None,
        metadata: Iterable[Metadatum] | None,
        wait_for_ready: bool | None,
        compression: str | None,
        call: Call | None = None,
    ) -> Call:
        """A call with one response, running while the caller goes on: a unary one completes
        on the completion thread; one with a request iterator runs on a thread of its own,
        which that iterator needs anyway (grpcio consumes it on a thread of its own too).
        `call`: the one to run, returned already (`_when_asked`)."""
        returned = call is not None
        call = call or Call(self._deserialize, timeout)
        if isinstance(request, bytes):
            with call._lock:
                if call._ended:  # cancelled while its call credentials were asked
                    return call
                reactor, token = _COMPLETIONS.begin(
                    functools.partial(resolved, weakref.ref(call)), ends_in_child=True
                )
                call._abandon = functools.partial(_COMPLETIONS.abandon, token)
            try:
                self._channel.unary_future(
                    reactor,
                    token,
                    self._path,
                    request,
                    outgoing(metadata),
                    timeout,
                    bool(wait_for_ready),
                    compression,
                )
            except BaseException:
                _COMPLETIONS.abandon(token)
                raise
            if returned and call.done():
                # Cancelled between the look above and the start (from `_when_asked`'s thread):
                # the abandon then found no operation to cancel; now it does.
                _COMPLETIONS.abandon(token)
            return call
        args = (
            self._channel,
            self._path,
            outgoing(metadata),
            timeout,
            bool(wait_for_ready),
            compression,
            request,
            self._serialize,
        )
        if not returned and STATES[self._channel.connectivity(False)] is grpc.ChannelConnectivity.SHUTDOWN:
            raise ValueError("Cannot invoke RPC: Channel closed!")  # as grpcio, at once
        run_on_own_thread(call, functools.partial(call._complete, *args), "isthmus-future")
        return call

    def _stream(
        self,
        request: bytes | Iterator[Any],
        timeout: float | None,
        metadata: Iterable[Metadatum] | None,
        wait_for_ready: bool | None,
        compression: str | None,
        call: Call | None = None,
    ) -> Call:
        """A call with streaming responses, started; the caller reads them. `call`: the one to
        start, returned already (`_when_asked`)."""
        call = call or Call(self._deserialize, timeout)
        call._streaming = True
        native = call._start(
            self._channel, self._path, outgoing(metadata), timeout, bool(wait_for_ready), compression
        )
        if native is not None:
            if isinstance(request, bytes):
                call._send_one(native, request)
            else:
                call._send_all(native, request, self._serialize)
        return call


class UnaryUnaryMultiCallable(_native.UnaryCallable, _MultiCallable, grpc.UnaryUnaryMultiCallable):
    # `__call__` is the native base's: a call without metadata or a compression of its own is
    # one native step (serializer, engine call, deserializer), ~0.5 µs less than the same in
    # Python; the others come to `_call`, and failures to `_failed`.

    def _call(
        self,
        request: Any,
        timeout: float | None = None,
        metadata: Iterable[Metadatum] | None = None,
        credentials: grpc.CallCredentials | None = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> Any:
        """`__call__` with metadata or a compression: one engine call, no thread, no call
        object."""
        metadata = self._with_credentials(metadata, credentials, timeout)
        try:
            message = self._channel.unary_message(
                self._path,
                encode(self._serialize, request),
                None if metadata is None else outgoing(metadata),
                timeout,
                bool(wait_for_ready),
                self._compression if compression is None else encoding(compression),
            )
            # A deserializer's failure fails the call (INTERNAL), as in grpcio.
            return decode(self._deserialize, message)
        except CallError as e:
            raise rpc_error(e) from None

    def _failed(self, stage: int, error: BaseException) -> BaseException:
        """What the native `__call__` raises for `error`, as `_call` would: from the serializer
        (stage 0; INTERNAL, logged, unless it is a size limit's `CallError`), the call (1, a
        `CallError`) or the deserializer (2; INTERNAL)."""
        if stage == 0 and not isinstance(error, CallError):
            error = serialize_failed(error)
        elif stage == 2:
            error = deserialize_failed()
        assert isinstance(error, CallError)
        return rpc_error(error)

    def with_call(
        self,
        request: Any,
        timeout: float | None = None,
        metadata: Iterable[Metadatum] | None = None,
        credentials: grpc.CallCredentials | None = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> tuple[Any, grpc.Call]:
        metadata = self._with_credentials(metadata, credentials, timeout)
        try:
            result = self._channel.unary(
                self._path,
                encode(self._serialize, request),
                outgoing(metadata),
                timeout,
                bool(wait_for_ready),
                self._encoding(compression),
            )
            response = decode(self._deserialize, result.message)
        except CallError as e:
            raise rpc_error(e) from None
        return response, Succeeded(
            result.initial_metadata, result.trailing_metadata, result.details, response
        )

    def future(
        self,
        request: Any,
        timeout: float | None = None,
        metadata: Iterable[Metadatum] | None = None,
        credentials: grpc.CallCredentials | None = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> Call:
        return self._when_asked(
            self._future,
            self._encode(request),
            timeout,
            metadata,
            credentials,
            wait_for_ready,
            self._encoding(compression),
        )


class _AuthUnaryUnaryMultiCallable(UnaryUnaryMultiCallable):
    """A channel's with call credentials of its own: every call asks them (`_call`), where the
    native `__call__` would go without."""

    __call__ = UnaryUnaryMultiCallable._call


class UnaryStreamMultiCallable(_MultiCallable, grpc.UnaryStreamMultiCallable):
    def __call__(
        self,
        request: Any,
        timeout: float | None = None,
        metadata: Iterable[Metadatum] | None = None,
        credentials: grpc.CallCredentials | None = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> Call:
        return self._when_asked(
            self._stream,
            self._encode(request),
            timeout,
            metadata,
            credentials,
            wait_for_ready,
            self._encoding(compression),
        )


class StreamUnaryMultiCallable(_MultiCallable, grpc.StreamUnaryMultiCallable):
    def __call__(
        self,
        request_iterator: Iterator[Any],
        timeout: float | None = None,
        metadata: Iterable[Metadatum] | None = None,
        credentials: grpc.CallCredentials | None = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> Any:
        metadata = self._with_credentials(metadata, credentials, timeout)
        return self._run(
            _requests(request_iterator), timeout, metadata, wait_for_ready, self._encoding(compression)
        )._outcome()

    def with_call(
        self,
        request_iterator: Iterator[Any],
        timeout: float | None = None,
        metadata: Iterable[Metadatum] | None = None,
        credentials: grpc.CallCredentials | None = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> tuple[Any, grpc.Call]:
        metadata = self._with_credentials(metadata, credentials, timeout)
        call = self._run(
            _requests(request_iterator), timeout, metadata, wait_for_ready, self._encoding(compression)
        )
        return call._outcome(), call

    def future(
        self,
        request_iterator: Iterator[Any],
        timeout: float | None = None,
        metadata: Iterable[Metadatum] | None = None,
        credentials: grpc.CallCredentials | None = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> Call:
        return self._when_asked(
            self._future,
            _requests(request_iterator),
            timeout,
            metadata,
            credentials,
            wait_for_ready,
            self._encoding(compression),
        )


class StreamStreamMultiCallable(_MultiCallable, grpc.StreamStreamMultiCallable):
    def __call__(
        self,
        request_iterator: Iterator[Any],
        timeout: float | None = None,
        metadata: Iterable[Metadatum] | None = None,
        credentials: grpc.CallCredentials | None = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> Call:
        return self._when_asked(
            self._stream,
            _requests(request_iterator),
            timeout,
            metadata,
            credentials,
            wait_for_ready,
            self._encoding(compression),
        )


def upgrades(options: Any) -> bool | None:
    """Whether a channel may move to shared memory: the option `isthmus.upgrade`, or None for
    the process's default (on, unless the environment's `ISTHMUS_UPGRADE` is 0, off or false,
    as for every binding)."""
    chosen = dict(options or ()).get("isthmus.upgrade")
    return None if chosen is None else bool(chosen)


# grpc's "none" for its millisecond options (INT_MAX), and its 20 s for a PING's answer.
_NO_LIMIT_MS = 2**31 - 1
_KEEPALIVE_TIMEOUT_MS = 20_000


def connect_timeout_ms(options: Any) -> int | None:
    """How long an HTTP/2 connection may take to come up, from grpc's options as grpc-core
    reads its minimum connect timeout: `grpc.min_reconnect_backoff_ms`, at least 100 ms. None
    for the engine's 20 s, grpc-core's default."""
    given = dict(options or ()).get("grpc.min_reconnect_backoff_ms")
    return None if given is None else max(int(given), 100)


def keepalive(options: Any) -> tuple[int, int, bool] | None:
    """HTTP/2 keepalive from grpc's options, as grpcio reads them: `grpc.keepalive_time_ms` (a
    PING after that long without a frame; unset, or grpc's INT_MAX, for none),
    `grpc.keepalive_timeout_ms` (how long its answer may take before the connection closes and
    its calls end UNAVAILABLE; 20 s) and `grpc.keepalive_permit_without_calls` (PINGs while no
    call is open too; off). None for no keepalive. `shm://` needs none: a dead peer is seen at
    once there."""
    given = dict(options or ())
    time_ms = int(given.get("grpc.keepalive_time_ms", _NO_LIMIT_MS))
    if time_ms <= 0 or time_ms >= _NO_LIMIT_MS:
        return None
    timeout_ms = max(int(given.get("grpc.keepalive_timeout_ms", _KEEPALIVE_TIMEOUT_MS)), 1)
    return time_ms, timeout_ms, bool(int(given.get("grpc.keepalive_permit_without_calls", 0)))


def user_agent(options: Any) -> str | None:
    """The user agent a channel's calls name, from grpc's options as grpcio reads them:
    `grpc.primary_user_agent`, then `grpc.secondary_user_agent` (grpcio puts its own agent
    between the two; isthmus puts tonic's after both, over HTTP/2 only). None if neither is
    given."""
    given = dict(options or ())
    parts = [
        _text(given[key])
        for key in ("grpc.primary_user_agent", "grpc.secondary_user_agent")
        if given.get(key)
    ]
    return " ".join(parts) or None


def _text(value: Any) -> str:
    """An option's text: `bytes` as their UTF-8, as grpcio takes them (`str()` made them
    "b'…'")."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def default_authority(options: Any) -> str | None:
    """The `:authority` a channel's HTTP/2 calls send in place of the target's, from grpc's
    option `grpc.default_authority` as grpcio reads it; TLS then checks the server's
    certificate against its host, unless `grpc.ssl_target_name_override` names another; call
    credentials' plugins are told it in their `service_url`. None if not given, or empty (as
    grpc-go's `WithAuthority("")`); bytes are read as ASCII, as grpcio reads string options."""
    given = dict(options or ()).get("grpc.default_authority")
    if isinstance(given, bytes):
        given = given.decode("ascii", "replace")
    return str(given) if given else None


def connection_age(options: Any) -> tuple[int, int | None] | None:
    """A server's maximum HTTP/2 connection age, from grpc's options as grpcio reads them:
    `grpc.max_connection_age_ms` (a GOAWAY at that age, so the client moves its next calls to a
    new connection; unset, or INT_MAX, for none) and `grpc.max_connection_age_grace_ms` (how
    long calls in progress may then go on before the connection closes and they end
    UNAVAILABLE; unset for ever). `grpc.max_connection_idle_ms` is not supported. `shm://`
    connections have no age limit."""
    given = dict(options or ())
    age_ms = int(given.get("grpc.max_connection_age_ms", _NO_LIMIT_MS))
    if age_ms < 0 or age_ms >= _NO_LIMIT_MS:
        return None
    grace_ms = int(given.get("grpc.max_connection_age_grace_ms", _NO_LIMIT_MS))
    return age_ms, (None if grace_ms < 0 or grace_ms >= _NO_LIMIT_MS else grace_ms)


_ENCODINGS = {grpc.Compression.Gzip: "gzip", grpc.Compression.Deflate: "deflate"}


def encoding(compression: grpc.Compression) -> str | None:
    """The `grpc-encoding` name of one of grpc's compressions; None for `NoCompression`."""
    if compression == grpc.Compression.NoCompression:
        return None
    try:
        return _ENCODINGS[grpc.Compression(compression)]
    except (KeyError, ValueError):
        raise ValueError(f"no compression {compression!r}: an element of grpc.Compression") from None


def call_encoding(channel: str | None, compression: grpc.Compression | None) -> str | None:
    """A call's `grpc-encoding` name: its own `compression=` if given, else its channel's."""
    return channel if compression is None else encoding(compression)


def channel_compression(compression: grpc.Compression | None, options: Any) -> str | None:
    """A channel's compression: the option `grpc.default_compression_algorithm` if given, else
    `compression`, else none. (grpcio turns `compression` into that option after the given ones,
    and the first of two wins.)"""
    chosen = dict(options or ()).get("grpc.default_compression_algorithm", compression)
    return None if chosen is None else encoding(chosen)


_RESOURCE_EXHAUSTED = 8


def limits(options: Any, no_receive_limit: int | None = None) -> tuple[int | None, int | None]:
    """grpc's `max_send_message_length` and `max_receive_message_length` (None for none: unset,
    or -1 as grpc spells it). Unlike grpcio, whose default receive limit is 4 MiB, an unset
    limit is the engine's own: a channel's 4 GiB; a server's 4 GiB over shm:// and 4 MiB over
    HTTP/2, so a server passes `no_receive_limit`, what a receive limit of -1 becomes."""
    given = dict(options or ())

    def size(key: str, none: int | None = None) -> int | None:
        value = given.get(key)
        if value is None:
            return None
        return none if int(value) < 0 else int(value)

    return size("grpc.max_send_message_length"), size("grpc.max_receive_message_length", no_receive_limit)


def max_streams(options: Any) -> int | None:
    """grpc's `grpc.max_concurrent_streams`, the calls one connection of a server may have
    open at once, if it is a positive count (grpc-core ignores others)."""
    value = dict(options or ()).get("grpc.max_concurrent_streams")
    return value if isinstance(value, int) and value > 0 else None


def limited(serialize: Serializer, limit: int | None) -> Serializer:
    """`serialize`, failing a request over `limit` bytes RESOURCE_EXHAUSTED as grpc does."""
    if limit is None:
        return serialize

    def checked(request: Any) -> bytes:
        message = request if serialize is None else serialize(request)
        if len(message) > limit:
            raise CallError(
                _RESOURCE_EXHAUSTED, f"CLIENT: Sent message larger than max ({len(message)} vs. {limit})"
            )
        return message

    return checked


def check_raw_size(request: Any, limit: int | None) -> None:
    """The raw tier's `limited`: a request (a `Block` or any buffer) over `limit` bytes fails
    its call RESOURCE_EXHAUSTED, in the words the serializers' check uses. What is no buffer, or
    no C-contiguous one, is left for the call to refuse."""
    if limit is None:
        return
    size = buffer_size(request)
    if size is not None and size > limit:
        raise CallError(_RESOURCE_EXHAUSTED, f"CLIENT: Sent message larger than max ({size} vs. {limit})")


#: grpcio's states by the engine's numbers.
STATES = (
    grpc.ChannelConnectivity.IDLE,
    grpc.ChannelConnectivity.CONNECTING,
    grpc.ChannelConnectivity.READY,
    grpc.ChannelConnectivity.TRANSIENT_FAILURE,
    grpc.ChannelConnectivity.SHUTDOWN,
)

#: How often the watcher looks again with nothing signalled: the fast path's connection has no
#: events (grpcio's own watcher looks every 0.2 s too).
LOOK_AGAIN_S = 0.2


class _Connectivity:
    """`subscribe`'s machinery, as grpcio's: one watcher thread per channel while it has
    subscribers, which calls each back with the state when it subscribes and at every change;
    a subscriber with `try_to_connect` keeps the channel connecting. Callbacks run on a
    delivery thread of their own, one at a time in the order the states came, as grpcio's:
    run on the subscriber's thread, a callback that takes a lock the subscriber holds
    deadlocked, and one a watcher told at the same time could hear the states out of order."""

    def __init__(self, native: _native.Channel) -> None:
        self._native = native
        self._lock = threading.Lock()
        # [callback, try_to_connect, the state it was last told]
        self._subscribers: list[list[Any]] = []
        self._watching = False
        self._state: grpc.ChannelConnectivity | None = None
        # (callback, state) to tell, in order, and whether a thread tells them.
        self._due: collections.deque[tuple[Callable[[grpc.ChannelConnectivity], None], Any]] = (
            collections.deque()
        )
        self._delivering = False

    def _tell(self, due: Iterable[tuple[Callable[[grpc.ChannelConnectivity], None], Any]]) -> None:
        """Queues callbacks for the delivery thread, starting it if none runs. Under the lock."""
        self._due.extend(due)
        if self._due and not self._delivering:
            self._delivering = True
            threading.Thread(
                target=self._deliver_all, name="isthmus-connectivity-delivery", daemon=True
            ).start()

    def _deliver_all(self) -> None:
        while True:
            with self._lock:
                if not self._due:
                    self._delivering = False
                    return
                callback, state = self._due.popleft()
            _deliver(callback, state)

    def subscribe(self, callback: Callable[[grpc.ChannelConnectivity], None], try_to_connect: bool) -> None:
        with self._lock:
            entry = [callback, try_to_connect, self._state]
            self._subscribers.append(entry)
            if not self._watching:
                self._watching = True
                self._state = entry[2] = None
                threading.Thread(target=self._watch, name="isthmus-connectivity", daemon=True).start()
            elif entry[2] is not None:  # marked told: the watcher leaves this one to us
                self._tell([(callback, entry[2])])

    def unsubscribe(self, callback: Callable[[grpc.ChannelConnectivity], None]) -> None:
        with self._lock:
            # Its first subscription only, as grpcio's: one subscribed twice is still told.
            for i, entry in enumerate(self._subscribers):
                if entry[0] == callback:
                    del self._subscribers[i]
                    break

    def unsubscribe_all(self) -> None:
        with self._lock:
            self._subscribers.clear()

    def _watch(self) -> None:
        native = self._native
        while True:
            with self._lock:
                if not self._subscribers:
                    self._watching = False
                    return
                try_to_connect = any(e[1] for e in self._subscribers)
            state = STATES[native.connectivity(try_to_connect)]
            with self._lock:
                self._state = state
                self._tell((e[0], state) for e in self._subscribers if e[2] is not state)
                for entry in self._subscribers:
                    entry[2] = state
            native.wait_connectivity(LOOK_AGAIN_S)


def _requests(given: Any) -> Iterator[Any]:
    """A streaming call's requests. What is not iterable fails the call as a request iterator
    that raises does (UNKNOWN, "Exception iterating requests!"), as grpcio's: its TypeError
    reached the caller, past `except grpc.RpcError`."""
    try:
        return iter(given)
    except TypeError as e:
        error = e

        def failing() -> Iterator[Any]:
            raise error
            yield  # a generator

        return failing()


def _deliver(callback: Callable[[grpc.ChannelConnectivity], None], state: grpc.ChannelConnectivity) -> None:
    try:
        callback(state)
    except Exception:  # grpcio logs a failing callback and goes on
        _LOG.exception("a connectivity callback raised")


_M = TypeVar("_M", bound=_MultiCallable)


class Channel(grpc.Channel):
    """A client channel to any target grpc names (`host:port`, `dns:///host:port`, `unix:path`,
    …) or `shm://NAME`, with TLS if `tls` is given (from `secure_channel`). It connects on the
    first call. A channel to an HTTP/2 address of an isthmus server on this machine that also
    serves `shm://` moves its calls to shared memory (`("isthmus.upgrade", False)` in `options`
    keeps them on HTTP/2). Of grpc's `options` it uses `grpc.ssl_target_name_override`,
    `grpc.max_send_message_length` and `grpc.max_receive_message_length` (a larger message
    fails its call RESOURCE_EXHAUSTED), and over HTTP/2 the keepalive options
    (`grpc.keepalive_time_ms`, `grpc.keepalive_timeout_ms`,
    `grpc.keepalive_permit_without_calls`: a connection whose PING goes unanswered closes, and
    its calls end UNAVAILABLE) and `grpc.min_reconnect_backoff_ms` (grpc-core's minimum connect
    timeout, 20 s by default: a connection not up by then fails the calls waiting on it
    UNAVAILABLE). Over every transport, `grpc.primary_user_agent` and
    `grpc.secondary_user_agent` name what the calls give as `user-agent`, which a server's
    handlers see in their `invocation_metadata()`. `grpc.default_authority` is the `:authority`
    HTTP/2 calls send in place of the target's (and the name TLS checks, as in grpcio). The option
    `grpc.default_compression_algorithm` (or else `compression`) compresses every call's
    requests over HTTP/2, as a call's own `compression=` does for it; over `shm://` messages
    cross no wire and go as they are."""

    def __init__(
        self,
        target: str,
        options: Any = None,
        compression: grpc.Compression | None = None,
        security: Security | None = None,
    ):
        self._max_send, max_receive = limits(options)
        self._compression = channel_compression(compression, options)
        security = security or insecure(target)
        authority = default_authority(options)
        self._auth = Auth(security, target, authority)
        self._native = _native.Channel(
            target,
            security.tls,
            upgrades(options),
            max_receive,
            keepalive(options),
            user_agent(options),
            authority,
            connect_timeout_ms(options),
        )
        self._connectivity = _Connectivity(self._native)

    def stats(self) -> TransportStats:
        """The counters of this channel's shared-memory connections (zeros before the first
        call, and for calls over HTTP/2): for a channel to an HTTP/2 address, of the one it
        moved to."""
        return TransportStats(**self._native.stats())

    def transport_counts(self) -> dict[str, int]:
        """For a channel to an HTTP/2 address: how many calls went over shared memory (the
        server offered it and runs on this machine) and how many over HTTP/2."""
        shm, http2 = self._native.transport_counts()
        return {"shm": shm, "http2": http2}

    def upgrade_status(self) -> str:
        """`off`, `pending` (no probe has finished), `http2` (nothing to move to), or the
        `shm://` target the channel's calls now go to."""
        return self._native.upgrade_status()

    def subscribe(
        self, callback: Callable[[grpc.ChannelConnectivity], None], try_to_connect: bool = False
    ) -> None:
        """As grpcio's: `callback` gets the channel's state now and at every change, on a
        thread of the channel's; with `try_to_connect` the channel connects (and keeps trying,
        with backoff) while this subscription lasts. `grpc.channel_ready_future` stands on it."""
        self._connectivity.subscribe(callback, try_to_connect)

    def unsubscribe(self, callback: Callable[[grpc.ChannelConnectivity], None]) -> None:
        self._connectivity.unsubscribe(callback)

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
        shape = _AuthUnaryUnaryMultiCallable if self._auth.plugins else UnaryUnaryMultiCallable
        return self._callable(shape, method, request_serializer, response_deserializer)

    def _callable(
        self,
        shape: type[_M],
        method: str,
        request_serializer: Serializer,
        response_deserializer: Deserializer,
    ) -> _M:
        """A multi-callable of `shape` for `method` on this channel."""
        made = shape(
            self._native,
            method,
            limited(request_serializer, self._max_send),
            response_deserializer,
            self._compression,
        )
        made._auth = self._auth
        return made

    def unary_stream(
        self,
        method: str,
        request_serializer: Serializer = None,
        response_deserializer: Deserializer = None,
        _registered_method: bool | None = False,
        **kwargs: Any,
    ) -> UnaryStreamMultiCallable:
        return self._callable(UnaryStreamMultiCallable, method, request_serializer, response_deserializer)

    def stream_unary(
        self,
        method: str,
        request_serializer: Serializer = None,
        response_deserializer: Deserializer = None,
        _registered_method: bool | None = False,
        **kwargs: Any,
    ) -> StreamUnaryMultiCallable:
        return self._callable(StreamUnaryMultiCallable, method, request_serializer, response_deserializer)

    def stream_stream(
        self,
        method: str,
        request_serializer: Serializer = None,
        response_deserializer: Deserializer = None,
        _registered_method: bool | None = False,
        **kwargs: Any,
    ) -> StreamStreamMultiCallable:
        return self._callable(StreamStreamMultiCallable, method, request_serializer, response_deserializer)

    def alloc(self, size: int, timeout: float | None = None) -> _native.Block:
        """The raw tier: a writable buffer of `size` bytes to build a request in place (fill it
        through `memoryview(block)` or `numpy.frombuffer(block, ...)`), then pass it to
        `raw_unary`. Over `shm://` it is this side's shared memory (waiting up to `timeout` for
        room), which the server reads where it is; elsewhere, and for a size larger than the
        whole arena, it is heap memory, copied when sent (`block.shared` says which). Release
        every view of it before sending it (`BufferError` otherwise); a block is sent once."""
        try:
            return self._native.alloc(size, timeout)
        except CallError as e:
            raise rpc_error(e) from None

    def raw_unary(
        self,
        method: str,
        request: Any,
        timeout: float | None = None,
        metadata: Iterable[Metadatum] | None = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> _native.Message:
        """The raw tier: calls `method` with `request` as it is, no serializer: a `Block` from
        `alloc` (sent with no copy) or any C-contiguous buffer (bytes, bytearray, memoryview,
        numpy arrays; read in place, never copied into a `bytes`). Returns the reply as a
        read-only `isthmus.Message`, a buffer (`memoryview(reply)`, `numpy.frombuffer(reply,
        ...)`) that views the server's shared memory when the reply came through it; that memory
        stays valid while the Message or any view of it lives. Errors raise `grpc.RpcError`
        as the other calls do; a request over `grpc.max_send_message_length` fails
        RESOURCE_EXHAUSTED before it is sent, as a serialized one does."""
        try:
            check_raw_size(request, self._max_send)
            return self._native.unary_raw(
                method,
                request,
                outgoing(metadata),
                timeout,
                bool(wait_for_ready),
                call_encoding(self._compression, compression),
            )
        except CallError as e:
            raise rpc_error(e) from None

    def close(self) -> None:
        """As grpcio's: calls in progress end CANCELLED ("Channel closed!"), over `shm://` and
        HTTP/2 alike, and the `shm://` connections close; later calls raise ValueError, in
        grpcio's words; subscriptions end, uncalled. The HTTP/2 connection closes with the channel."""
        self._connectivity.unsubscribe_all()
        for call in self._auth.close():  # not started yet: their plugins have not answered
            call._end(channel_closed())
        self._native.close()

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, exc_type: object, exc_val: object, exc_tb: object) -> None:
        self.close()
