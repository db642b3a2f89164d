"""The Rust engine as Python sees it (`crates/isthmus-python`). Not API: use `isthmus` and
`isthmus.aio`, which give these grpc's shapes."""

import asyncio
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias, final

from typing_extensions import Buffer, Self, disjoint_base

__all__ = [
    "AioUnaryCall",
    "AioUnaryCallable",
    "AioUnaryWait",
    "AsyncCall",
    "AsyncChannel",
    "Block",
    "Call",
    "CallError",
    "Channel",
    "Message",
    "Reactor",
    "Server",
    "ServerCall",
    "Topic",
    "UnaryCallable",
    "UnaryResult",
    "forks",
]

# Metadata crosses as (key, value) pairs: `str` values, or `bytes` for keys ending in `-bin`.
_Metadata: TypeAlias = Sequence[tuple[str, str | bytes]]
# (root_certificates, private_key, certificate_chain, target_name_override), PEM.
_ClientTls: TypeAlias = tuple[bytes | None, bytes | None, bytes | None, str | None]
# (private_key, certificate_chain, root_certificates, require_client_auth), PEM.
_ServerTls: TypeAlias = tuple[bytes, bytes, bytes | None, bool]

# An asyncio operation that may finish when it starts: `(ok, value)` if it did, None if its
# outcome comes through the Reactor under its token.
_Now: TypeAlias = tuple[bool, Any] | None

@disjoint_base
class CallError(Exception):
    """A call ended with a status other than OK."""

    code: int
    """The gRPC status code as a number (grpc.StatusCode.X.value[0])."""
    details: str
    initial_metadata: list[tuple[str, str | bytes]]
    trailing_metadata: list[tuple[str, str | bytes]]
    def __new__(
        cls,
        code: int,
        details: str,
        initial_metadata: _Metadata | None = None,
        trailing_metadata: _Metadata | None = None,
    ) -> Self: ...

@final
class UnaryResult:
    """A unary call's outcome."""

    message: bytes
    initial_metadata: list[tuple[str, str | bytes]]
    trailing_metadata: list[tuple[str, str | bytes]]
    details: str

@final
class Message:
    """A received message as a read-only buffer; a view of the sender's shared memory when it
    came through its arena, kept valid while this object or any view of it lives."""

    if sys.version_info >= (3, 12):  # the buffer protocol in Python (PEP 688)
        def __buffer__(self, flags: int, /) -> memoryview: ...
        def __release_buffer__(self, buffer: memoryview, /) -> None: ...

    def __len__(self) -> int: ...
    def tobytes(self) -> bytes:
        """A copy as `bytes`."""

@final
class Block:
    """A writable buffer to send one message from: shared memory over `shm://`, heap memory
    elsewhere. Sending it while a view of it is exported raises `BufferError`; it is sent once."""

    if sys.version_info >= (3, 12):  # the buffer protocol in Python (PEP 688)
        def __buffer__(self, flags: int, /) -> memoryview: ...
        def __release_buffer__(self, buffer: memoryview, /) -> None: ...

    def __len__(self) -> int: ...
    def truncate(self, size: int) -> None:
        """Shortens the block before it is sent (not while a view of it is exported);
        ValueError for a size above its length (a block never grows)."""
    def write(self, data: Buffer, offset: int = 0) -> None:
        """Copies `data` (C-contiguous) in from `offset`, as the transport copies a message:
        streaming stores for a large one (ADR 0022). ValueError if it does not fit."""
    @property
    def shared(self) -> bool:
        """True while the block lives in shared memory (sending it copies nothing)."""

@final
class Channel:
    """A client channel for blocking calls (`shm://`, `unix://`, `http://`). Connects on the
    first call. Waits release the GIL."""

    def __new__(
        cls,
        target: str,
        tls: _ClientTls | None = None,
        upgrade: bool | None = None,
        max_receive: int | None = None,
        keepalive: tuple[int, int, bool] | None = None,
        user_agent: str | None = None,
        authority: str | None = None,
        connect_timeout_ms: int | None = None,
    ) -> Self:
        """Raises ValueError for a target that does not parse, or TLS settings, a user agent or
        an authority that do not. `keepalive`: HTTP/2 keepalive, (time in ms, timeout in ms,
        permit without calls). `user_agent`: what every call names as `user-agent`.
        `authority`: the `:authority` HTTP/2 calls send in place of the target's.
        `connect_timeout_ms`: how long an HTTP/2 connection may take to come up (None: 20 s)."""
    def stats(self) -> dict[str, int]:
        """The counters of the channel's shm connections (`isthmus.TransportStats`'s fields)."""
    def transport_counts(self) -> tuple[int, int]:
        """Calls started over shm and over HTTP/2 (a channel to an HTTP/2 address)."""
    def upgrade_status(self) -> str:
        """`off`, `pending`, `http2`, or the `shm://` target the channel moved to."""
    def unary(
        self,
        path: str,
        request: bytes,
        metadata: _Metadata | None,
        timeout: float | None,
        wait_for_ready: bool,
        compression: str | None = None,
    ) -> UnaryResult:
        """Raises CallError."""
    def unary_message(
        self,
        path: str,
        request: bytes,
        metadata: _Metadata | None,
        timeout: float | None,
        wait_for_ready: bool,
        compression: str | None = None,
    ) -> bytes:
        """`unary` for the response message alone; raises CallError."""
    def unary_future(
        self,
        reactor: Reactor,
        token: int,
        path: str,
        request: bytes,
        metadata: _Metadata | None,
        timeout: float | None,
        wait_for_ready: bool,
        compression: str | None = None,
    ) -> None:
        """A unary call as operation `token` of `reactor`: completes with a UnaryResult."""
    def alloc(self, size: int, timeout: float | None = None) -> Block:
        """A block to build a request in: shared memory over `shm://` (connecting first,
        waiting for room in slices that run the signal handlers), heap memory elsewhere and
        for a size the arena could never hold. Raises CallError; MemoryError when the heap
        cannot hold it, OverflowError for a negative size."""
    def unary_raw(
        self,
        path: str,
        request: Buffer,
        metadata: _Metadata | None = None,
        timeout: float | None = None,
        wait_for_ready: bool = False,
        compression: str | None = None,
    ) -> Message:
        """A unary call with a Block or any C-contiguous buffer as the request (BufferError
        otherwise); raises CallError."""
    def start(
        self,
        path: str,
        metadata: _Metadata | None,
        timeout: float | None,
        wait_for_ready: bool,
        compression: str | None = None,
    ) -> Call:
        """Starts a streaming call; raises CallError if it cannot start."""
    def connectivity(self, try_to_connect: bool) -> int:
        """gRPC's state in grpcio's numbering (0 IDLE, 1 CONNECTING, 2 READY,
        3 TRANSIENT_FAILURE, 4 SHUTDOWN); `try_to_connect` starts connecting in the
        background."""
    def wait_connectivity(self, timeout: float) -> int:
        """Waits up to `timeout` s for a change, the GIL released; the state then."""
    def close(self) -> None:
        """Calls in progress over shm:// end CANCELLED and the connections close; later calls
        fail with CallError(UNAVAILABLE)."""

@disjoint_base
class UnaryCallable:
    """A blocking unary stub call in one native step; the base of
    `isthmus._channel.UnaryUnaryMultiCallable`, which provides `_call` (a call with metadata or
    a compression of its own) and `_failed` (the exception for a failure)."""

    def __new__(
        cls,
        channel: Channel,
        path: str,
        serialize: Callable[[Any], bytes] | None,
        deserialize: Callable[[bytes], Any] | None,
        compression: str | None = None,
    ) -> Self: ...
    def __call__(
        self,
        request: Any,
        timeout: float | None = None,
        metadata: Any = None,
        credentials: Any = None,
        wait_for_ready: bool | None = None,
        compression: Any = None,
    ) -> Any: ...

@final
class Call:
    """One blocking call of any shape. Every method may raise CallError once the call failed."""

    def send(self, message: bytes, last: bool = False) -> bool:
        """Sends one request (`last` half-closes with it); False if the call is already over
        (its status comes from recv)."""
    def close_send(self) -> None: ...
    def recv(self) -> bytes | None:
        """The next response; None once the call ended OK. Raises CallError otherwise."""
    def initial_metadata(self) -> list[tuple[str, str | bytes]]:
        """Waits for the server's initial metadata."""
    def trailing_metadata(self) -> list[tuple[str, str | bytes]] | None:
        """The trailers once the call ended (OK or not); None before."""
    def details(self) -> str | None:
        """The OK status's message once the call ended (empty after a failure); None before."""
    def drained_end(self, left: float | None = None) -> bool:
        """Waits for the call's end once every response before it was read, reading on while
        no reader does and keeping a response for the next recv: True for OK, CallError for
        another status; False if `left` seconds pass with a response still unread."""
    def watch_end(self, reactor: Reactor, token: int, left: float | None = None) -> None:
        """`drained_end` as operation `token` of `reactor`, waiting on no thread: it completes
        with True, False or the status's CallError as that returns."""
    def cancel(self) -> None:
        """Ends the call with CANCELLED on both sides; idempotent."""

@final
class Reactor:
    """Completions for one asyncio loop: `fileno()` becomes readable when operations have
    finished; register it with `loop.add_reader` and call `resolve`. Each operation below takes a
    `token` (an int of the caller's choosing) and its outcome comes back under that token: on
    success the operation's result, otherwise a CallError value."""

    def __new__(cls) -> Self: ...
    def fileno(self) -> int: ...
    def wait(self, timeout: float | None = None) -> list[tuple[int, bool, object]]:
        """(token, ok, value) for each finished operation, after sleeping (the GIL released) up
        to `timeout` s, forever if None, until something finished; empty if nothing did."""
    def resolve(self, waiting: dict[int, Any], spin_us: int = 0) -> list[tuple[int, object]] | None:
        """Resolves each finished operation's future, found in `waiting` and removed from it,
        with its value (skipped if cancelled); `(token, value)` for each that has none there,
        None if no such. Never blocks, but with `spin_us` first waits on this thread (the GIL
        released, never asleep) up to that long for something to finish (None if nothing did)."""
    def cancel(self, token: int) -> bool:
        """Abandons operation `token`: it will not complete, and a call it was making is
        cancelled on both sides. False if it has already finished."""
    def close(self) -> None: ...

@final
class AsyncChannel:
    """A client channel whose operations complete through a Reactor."""

    def __new__(
        cls,
        target: str,
        reactor: Reactor,
        tls: _ClientTls | None = None,
        upgrade: bool | None = None,
        max_receive: int | None = None,
        keepalive: tuple[int, int, bool] | None = None,
        user_agent: str | None = None,
        authority: str | None = None,
        connect_timeout_ms: int | None = None,
    ) -> Self: ...
    def stats(self) -> dict[str, int]: ...
    def transport_counts(self) -> tuple[int, int]: ...
    def upgrade_status(self) -> str: ...
    def unary(
        self,
        token: int,
        path: str,
        request: bytes,
        metadata: _Metadata | None,
        timeout: float | None,
        wait_for_ready: bool,
        compression: str | None = None,
        spin: bool = False,
    ) -> tuple[bool, object] | bool | None:
        """Completes with a UnaryResult. With `spin` (over shm://) the loop's thread sends the
        call and waits up to the spin bound for its reply: `(ok, value)` if it came, then not
        delivered through the reactor; False if it did not come in time; None if the call took
        the reactor's path from the start."""
    def alloc(self, size: int) -> Block:
        """A Block in the shm connection's arena if it is up and has room now, else on the
        heap (copied when sent); MemoryError if too large. Never waits."""
    def shm_ready(self) -> bool:
        """True once `alloc` can give shared memory; starts connecting for it if not."""
    def unary_raw(
        self,
        token: int,
        path: str,
        request: Buffer,
        metadata: _Metadata | None,
        timeout: float | None,
        wait_for_ready: bool,
        compression: str | None = None,
    ) -> None:
        """Completes with a Message; BufferError at once for a non-contiguous buffer or a
        block still exported or sent; a shared-memory block of another connection fails the
        call (CallError, UNAVAILABLE)."""
    def start(
        self,
        token: int,
        path: str,
        metadata: _Metadata | None,
        timeout: float | None,
        wait_for_ready: bool,
        compression: str | None = None,
    ) -> _Now:
        """Completes with the started AsyncCall (or a CallError if it could not start)."""
    def connectivity(self, try_to_connect: bool) -> int:
        """As Channel.connectivity."""
    def watch_connectivity(self, token: int) -> None:
        """Completes (with None) once the state changes."""
    def close(self) -> None:
        """Calls still on its shm:// connections end CANCELLED; the connections close."""

def forks() -> int:
    """Forks so far, as this process counts them (the `_fast` tuple of an asyncio channel
    records it when the channel binds)."""

@disjoint_base
class AioUnaryCallable:
    """An asyncio stub's unary call in native steps; the base of
    `isthmus.aio._channel.UnaryUnaryMultiCallable`, which provides `_call_type` (the call's
    class), `_call` (every call the native path leaves: metadata, a compression of its own,
    another loop, uvloop) and `_serialize_failed`. It reads its channel's `_fast` tuple."""

    def __new__(
        cls,
        channel: Any,
        path: str,
        serialize: Callable[[Any], bytes] | None,
        deserialize: Callable[[bytes], Any] | None,
    ) -> Self: ...
    def __call__(
        self,
        request: Any,
        *,
        timeout: float | None = None,
        metadata: Any = None,
        credentials: Any = None,
        wait_for_ready: bool | None = None,
        compression: Any = None,
    ) -> Any: ...

@disjoint_base
class AioUnaryCall:
    """An asyncio unary call, awaited natively (`AioUnaryWait`); the base of
    `isthmus.aio._call.UnaryUnaryCall`, which provides `_raise(error)` and `_undecodable()`."""

    def __new__(
        cls,
        loop: asyncio.AbstractEventLoop,
        timeout: float | None,
        deserialize: Callable[[bytes], Any] | None,
        outcome: asyncio.Future[Any],
        driver: Any,
        token: Any,
        settle: bool,
    ) -> Self: ...
    # Read-only at run time (set by `__new__`).
    _loop: asyncio.AbstractEventLoop
    _timeout: float | None
    _deadline: float | None
    _deserialize: Callable[[bytes], Any] | None
    _outcome: asyncio.Future[Any]
    _driver: Any
    _token: Any
    # Whether the reply of `value` (the outcome's UnaryResult) deserializes. The reply is
    # made once: every await gives that one object, and this does not make it again.
    def _decodes(self, value: Any) -> bool: ...
    def __await__(self) -> AioUnaryWait: ...

@final
class AioUnaryWait:
    """One await of an AioUnaryCall: the iterator its `__await__` gives."""

    def __iter__(self) -> Self: ...
    def __next__(self) -> Any: ...
    def send(self, value: Any) -> Any: ...
    def throw(self, kind: Any, value: Any = None, _traceback: Any = None) -> None: ...

@final
class AsyncCall:
    """One call driven through the Reactor; at most one send-side and one receive-side
    operation in flight at a time."""

    def send(self, token: int, message: bytes, last: bool = False) -> _Now:
        """Completes with True, or False if the call is already over; `last` half-closes with
        the message."""
    def close_send(self, token: int) -> _Now:
        """Completes with None."""
    def recv(self, token: int) -> _Now:
        """Completes with bytes, or None at an OK end; a CallError otherwise."""
    def initial_metadata(self, token: int) -> _Now:
        """Completes with the initial metadata list."""
    def trailing_metadata(self) -> list[tuple[str, str | bytes]] | None: ...
    def details(self) -> str | None: ...
    def cancel(self) -> None: ...

@final
class ServerCall:
    """The server's side of one call: from `serve_calls` (the blocking server) or
    `listen_async` (the asyncio server)."""

    path: str
    id: int
    """The asyncio server's number for the call, as `listen_async`'s news names it (else 0)."""
    def watch_done(self) -> bool:
        """The asyncio server's: `listen_async`'s news lists the call's id once it ends; False
        if it has ended already."""
    def invocation_metadata(self) -> list[tuple[str, str | bytes]]: ...
    def time_remaining(self) -> float | None:
        """Seconds before the client's deadline, or None without one."""
    def peer(self) -> str:
        """gRPC's form of the client's address (`ipv4:…`, `unix:`, `shm:pid=…,uid=…`)."""
    def auth_context(self) -> dict[str, list[bytes]]:
        """grpc's auth context: the transport's security, the client's certificate under mTLS."""
    def is_active(self) -> bool:
        """False once the call is over: finished, cancelled by the client, or past its deadline."""
    def reply(
        self,
        message: Buffer,
        code: int,
        details: str,
        trailing_metadata: _Metadata | None = None,
        raw: bool = False,
    ) -> None:
        """Sends a unary response (bytes; any buffer or Block with `raw`), then ends the call
        with this status; raises CallError if the send fails (the call is then not ended)."""
    def try_reply(
        self, message: bytes, code: int, details: str, trailing_metadata: _Metadata | None = None
    ) -> bool:
        """`reply` for an event loop's thread: only if it takes no wait (the ring has room, no
        other operation of the call is under way); False, with nothing sent, otherwise (a send
        then fails if the call ended meanwhile)."""
    def add_done_callback(self, callback: Callable[[], None]) -> bool:
        """Runs callback (on an engine thread, with the GIL) when the call ends; False, without
        registering, if it already has."""
    def set_compression(self, encoding: str | None = None) -> bool:
        """Compresses the replies with `encoding` ("gzip", "deflate"; None: uncompressed, even
        where the server compresses its replies) where they cross a wire: over HTTP/2, for a
        client that accepts it. False, and nothing changed, once initial metadata or a message
        has gone. ValueError for another name."""
    # Blocking (GIL released):
    def recv(self) -> bytes | None:
        """The next request; None once the client half-closed; raises CallError if the call
        ended (cancelled, deadline, connection lost). Sends no initial metadata."""
    def send(self, message: bytes) -> None:
        """Raises CallError if the call ended."""
    def recv_raw(self) -> Message | None:
        """`recv`, the request as a read-only Message."""
    def alloc(self, size: int, wait: bool = True) -> Block:
        """A block of the server's shared memory to build a reply in, waiting for arena room;
        without `wait`, a heap Block if there is no room at once. Raises CallError."""
    def send_raw(self, message: Buffer) -> None:
        """`send` of a Block (no copy) or any C-contiguous buffer; raises CallError, or
        BufferError for a block still exported or already sent."""
    def send_initial_metadata(self, metadata: _Metadata) -> None:
        """Raises CallError if the call ended or metadata was already sent (before the first
        send)."""
    # Through a Reactor (same outcomes as the blocking forms). Each gives back `(ok, value)` if it
    # finished as it started (nothing then comes through the reactor), else None:
    def recv_async(self, reactor: Reactor, token: int) -> _Now: ...
    def send_async(self, reactor: Reactor, token: int, message: bytes) -> _Now: ...
    def recv_raw_async(self, reactor: Reactor, token: int) -> _Now:
        """Completes with a Message, None, or a CallError."""
    def send_raw_async(self, reactor: Reactor, token: int, message: Buffer) -> _Now:
        """A Block or any C-contiguous buffer, read when sent; BufferError at once for a block
        still exported or already sent."""
    def send_initial_metadata_async(self, reactor: Reactor, token: int, metadata: _Metadata) -> _Now: ...
    def serve_topic(
        self, topic: Topic, on_gap: Callable[[int], Buffer | None] | None = None, max_send: int | None = None
    ) -> None:
        """Delivers the topic until the client leaves (raises CallError CANCELLED) or the topic
        closes (returns); CallError RESOURCE_EXHAUSTED for a subscriber that fell behind, or for
        a message over `max_send` bytes."""
    def serve_topic_async(
        self,
        reactor: Reactor,
        token: int,
        topic: Topic,
        on_gap: Callable[[int], Buffer | None] | None = None,
        max_send: int | None = None,
    ) -> None:
        """Completes with None, or a CallError, as serve_topic ends."""
    def finish(self, code: int, details: str, trailing_metadata: _Metadata | None = None) -> None:
        """Ends the call with this status (0 = OK) and trailers. Later calls do nothing."""

@final
class Topic:
    """A topic that server-streaming calls subscribe to (`serve_topic`)."""

    def __new__(cls, name: str, capacity: int = 64, slow: str = "drop_oldest") -> Self:
        """ValueError for a slow policy other than "drop_oldest" or "cancel", or capacity 0."""
    @property
    def name(self) -> str: ...
    def publish(self, message: Buffer) -> int:
        """Queues the message for every subscriber, written once per shared arena; how many."""
    def publish_state(self, message: Buffer) -> int: ...
    def state(self) -> bytes | None: ...
    def current_state(self) -> bytes | None: ...
    def clear_state(self) -> None: ...
    def close(self) -> None: ...
    def stats(self) -> dict[str, int]: ...

@final
class Server:
    """The engine's server. With `to_loop`, calls wait in an inbox that an event loop takes
    them from (`listen_async`). Without it, calls wait in a queue that `serve_calls` loops take
    them from, on the executor's threads, and `wait_demand` tells a dispatcher thread when to
    start one more loop (at most `max_threads`). Neither takes the GIL on the engine's threads.
    Every call must eventually be finished (an unfinished call that is garbage-collected ends
    with UNKNOWN)."""

    def __new__(
        cls,
        to_loop: bool,
        max_concurrent_rpcs: int | None = None,
        max_message_size: int | None = None,
        offer_shm: bool = True,
        max_threads: int | None = None,
        compression: str | None = None,
        reuse_port: bool = False,
        keepalive: tuple[int, int, bool] | None = None,
        max_connection_age: tuple[int, int | None] | None = None,
        max_streams: int | None = None,
    ) -> Self:
        """`max_connection_age`: (age in ms, grace in ms or None) of every HTTP/2 connection;
        `max_streams`: calls one connection may have open at once."""
    def stats(self) -> dict[str, int]:
        """The counters of the live shm connections (`isthmus.TransportStats`'s fields)."""
    def linger(self, reactor: Reactor, spin_us: int) -> bool:
        """The idle loop: reads the last call's connection here (GIL released) for up to
        `spin_us` µs or until there is news; True if `reactor` has something to drain."""
    def listen_async(self, reactor: Reactor, token: int) -> None:
        """Completes operation `token` with `(calls, abandoned ids, done ids)` once the inbox
        has news (`to_loop` servers)."""
    def serve_calls(
        self, handle: Callable[[ServerCall], None], others_waiting: Callable[[], int] | None = None
    ) -> None:
        """Runs `handle(call)` for each queued call on this thread until none comes for 2 s or
        the server stops, or, while none comes, `others_waiting()` (looked at every 10 ms)
        says other work waits for the executor's threads."""
    def wait_demand(self) -> bool:
        """Waits (GIL released) until queued calls need one more `serve_calls` loop; False once
        the server has stopped."""
    def refuse_calls(self, why: str) -> None:
        """The loop `wait_demand` asked for cannot start: queued and later calls fail
        UNAVAILABLE with `why`."""
    def close_calls(self, why: str) -> None:
        """The process is exiting: `serve_calls` loops end now; queued and later calls fail
        UNAVAILABLE with `why`."""
    def add_port(self, target: str, tls: _ServerTls | None = None, health: bool = True) -> str:
        """Binds now, with TLS if given (TCP targets); returns the address as clients reach it
        (`http://` or `https://` with the port chosen for port 0). `health`: the engine answers
        grpc.health.v1 there. Raises ValueError (bad target or TLS settings) or OSError (cannot
        bind)."""
    def serve_health(self, on: bool) -> None:
        """Whether the engine answers grpc.health.v1 on every port bound so far (before
        `start`; overrides `add_port`'s `health`)."""
    def start(self) -> bool:
        """Starts serving what is bound; False if the server had started before."""
    def stop(self, grace: float | None = None) -> bool:
        """Starts a graceful shutdown (new calls refused, calls in progress get `grace` seconds,
        None = cancel them at once) and returns at once; False, having done nothing, if the
        server never started."""
    def wait(self, timeout: float | None = None) -> bool:
        """Waits (GIL released) until the server has stopped; False on timeout."""
