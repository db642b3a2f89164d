"""The blocking server, and `ServerBase`: what it shares with the asyncio server (ports,
handlers, the engine's server)."""

from __future__ import annotations

import contextvars
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor, Future
from typing import Any

import grpc

from . import _native
from ._channel import channel_compression, connection_age, keepalive, limits, max_streams
from ._context import ServicerContext
from ._credentials import is_local, server_tls
from ._handler import Handlers
from ._native import ServerCall
from ._stats import TransportStats

_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]

_LOG = logging.getLogger("isthmus")

#: grpcio's details for a handler whose exception could not be told.
UNPRINTABLE = "Calling application raised unprintable Exception!"


def unprintable(call: ServerCall) -> None:
    """Ends `call` UNKNOWN as grpcio ends a handler whose exception could not be told: for what
    failed ending the call itself. Logs what did."""
    _LOG.exception(UNPRINTABLE)
    call.finish(grpc.StatusCode.UNKNOWN.value[0], UNPRINTABLE, None)


# A receive limit of -1 (grpcio's "none"), for the engine.
_NO_LIMIT = 2**64 - 1


# How long a blocking wait lasts at most before Python gets a chance to run signal handlers
# (Ctrl-C): the engine's waits release the GIL and cannot be interrupted.
_WAIT_SLICE = 1.0


def _port(bound: str) -> int:
    """The port of a bound `http://` or `https://` address, else 1."""
    if bound.startswith(("http://", "https://")):
        return int(bound.rstrip("/").rsplit(":", 1)[1])
    return 1


def refuse(call: ServerCall, error: BaseException | None) -> None:
    """Ends a call that no handler takes (`error` None) or whose lookup raised, as grpcio does."""
    if error is None:
        call.finish(grpc.StatusCode.UNIMPLEMENTED.value[0], "Method not found!", None)
    else:
        _LOG.error("Exception servicing handler", exc_info=error)
        call.finish(grpc.StatusCode.UNKNOWN.value[0], "Error in service handler!", None)


class BindError(RuntimeError, OSError):
    """An address a server could not bind (in use, not allowed, a directory that is not
    there): a RuntimeError, as grpcio raises for it, and an OSError."""


class AddressError(RuntimeError, ValueError):
    """An address a server cannot read (`:0`, an unknown scheme): a RuntimeError, as grpcio
    raises for any address it fails to bind, and a ValueError."""


class StartError(RuntimeError, ValueError):
    """`start` of a server that has started before: a ValueError, as grpcio raises, and the
    RuntimeError this package raised."""


class ServerBase:
    def __init__(
        self,
        to_loop: bool,
        handlers: Iterable[grpc.GenericRpcHandler] | None,
        interceptors: Sequence[Any] | None,
        options: Sequence[tuple[str, Any]] | None,
        maximum_concurrent_rpcs: int | None,
        max_threads: int | None = None,
        compression: grpc.Compression | None = None,
    ) -> None:
        self._handlers = Handlers(handlers, interceptors)
        # `isthmus.offer_shm` (default on): HTTP/2 clients on this machine move to shm://.
        offer_shm = bool(dict(options or ()).get("isthmus.offer_shm", True))
        # Replies over HTTP/2 to clients that read it, as grpcio's (see `channel_compression`).
        replies = channel_compression(compression, options)
        # Unset, the engine's receive limits: 4 MiB over HTTP/2 (grpcio's), 4 GiB over shm://.
        max_send, max_receive = limits(options, no_receive_limit=_NO_LIMIT)
        self._max_send = max_send
        # `grpc.so_reuseport` (default on, as grpcio's): servers of several processes share a
        # TCP port.
        reuse_port = bool(dict(options or ()).get("grpc.so_reuseport", 1))
        # `grpc.keepalive_time_ms`, `grpc.keepalive_timeout_ms`: PINGs to HTTP/2 clients gone
        # quiet; one left unanswered closes its connection and cancels its calls. And
        # `grpc.max_connection_age_ms`, `grpc.max_connection_age_grace_ms` (`connection_age`).
        self._native = _native.Server(
            to_loop,
            maximum_concurrent_rpcs,
            max_receive,
            offer_shm,
            max_threads,
            replies,
            reuse_port,
            keepalive(options),
            connection_age(options),
            max_streams(options),
        )

    def add_generic_rpc_handlers(self, generic_rpc_handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self._handlers.add_generic(generic_rpc_handlers)

    def stats(self) -> TransportStats:
        """The counters of the server's live shared-memory connections (calls over HTTP/2 are
        not counted)."""
        return TransportStats(**self._native.stats())

    def add_registered_method_handlers(
        self, service_name: str, method_handlers: Mapping[str, grpc.RpcMethodHandler]
    ) -> None:
        self._handlers.add_registered(service_name, method_handlers)

    def add_insecure_port(self, address: str) -> int:
        """Binds now: `[::]:PORT`, `0.0.0.0:PORT`, `localhost:PORT` and grpc's other TCP forms,
        `unix:PATH`, `unix-abstract:NAME`, or `shm://NAME`. Returns the TCP port (the one
        chosen for port 0), else 1, as grpc does: its callers treat 0 as failure. An address
        that cannot be bound raises RuntimeError, as grpcio does (`BindError`, also an
        OSError); so does one that does not parse (`AddressError`, also a ValueError)."""
        return _port(self._add_port(address, None))

    def add_secure_port(self, address: str, server_credentials: grpc.ServerCredentials) -> int:
        """Binds a TCP address with TLS, `server_credentials` from
        `isthmus.ssl_server_credentials`; or, with `isthmus.local_server_credentials()`, an
        address on this machine (a loopback one, a Unix socket, `shm://`) as an insecure
        port that clients with local credentials call. Returns the port, as
        `add_insecure_port` does."""
        tls = server_tls(server_credentials)
        if tls is None and not is_local(address):
            raise AddressError(
                f"Failed to bind to address {address}: local credentials serve this machine only"
            )
        return _port(self._add_port(address, tls))

    def _add_port(self, address: str, tls: Any) -> str:
        try:
            return self._native.add_port(address, tls)
        except OSError as e:
            raise BindError(f"Failed to bind to address {address}: {e}") from e
        except ValueError as e:
            raise AddressError(f"Failed to bind to address {address}: {e}") from e

    def _stop_when_dropped(self) -> None:
        """A started server dropped without `stop` stops, as grpcio's and grpc.aio's do (their
        `__del__`): its engine side served on, with its ports. Whatever serves its calls must
        hold it weakly for this to run."""
        weakref.finalize(self, self._native.stop, None).atexit = False

    def _check_health(self) -> None:
        """At start, once every servicer is known (added before or after the ports, as grpcio
        allows): the engine answers grpc.health.v1 on every port unless a servicer of the
        application does."""
        self._native.serve_health(not self._handlers.serves_health())


class Server(ServerBase, grpc.Server):
    """grpc.Server's shape: handlers run on `thread_pool`.

    Calls do not go through the pool's queue one by one: each of the pool's threads that
    serves runs a loop that takes calls straight from the engine (`_native.Server.serve_calls`)
    and spins briefly for the next one, so a call costs no wake-up of a sleeping thread. A
    dispatcher thread submits one more loop when calls wait and every loop is busy, up to the
    pool's `_max_workers`; a loop idle for 2 s gives its thread back to the pool, and so does
    an idle one that finds other work queued for the pool (a `ThreadPoolExecutor`'s; looked at
    every 10 ms): the application's own tasks, or another server's, on a shared pool."""

    def __init__(
        self,
        thread_pool: Executor,
        handlers: Iterable[grpc.GenericRpcHandler] | None = None,
        interceptors: Sequence[grpc.ServerInterceptor] | None = None,
        options: Sequence[tuple[str, Any]] | None = None,
        maximum_concurrent_rpcs: int | None = None,
        compression: grpc.Compression | None = None,
    ) -> None:
        max_threads = getattr(thread_pool, "_max_workers", None)
        super().__init__(
            False,
            handlers,
            interceptors,
            options,
            maximum_concurrent_rpcs,
            max_threads if isinstance(max_threads, int) else None,
            compression,
        )
        self._pool = thread_pool
        # A ThreadPoolExecutor's queue of work waiting for its threads, which idle loops yield to.
        self._others_waiting = getattr(getattr(thread_pool, "_work_queue", None), "qsize", None)

    @staticmethod
    def _dispatch(native: Any, pool: Executor, handle: Callable[[ServerCall], None], others: Any) -> None:
        """The dispatcher thread: one more loop on the pool whenever calls wait for one. It
        holds no reference to the server (`start`)."""

        def started(loop: Future[None]) -> None:
            # A loop cancelled before it ran (`pool.shutdown(cancel_futures=True)`): the pool
            # is going away, and no other loop would be started for the calls waiting.
            if loop.cancelled():
                native.refuse_calls("the server's thread pool was shut down")

        while native.wait_demand():
            try:
                loop = pool.submit(native.serve_calls, handle, others)
                loop.add_done_callback(started)
            except Exception:  # the pool was shut down (RuntimeError), or refuses work
                _LOG.exception("the server's thread pool refused a task; calls now fail UNAVAILABLE")
                native.refuse_calls("the server's thread pool refuses work")
                return

    def _handle(self, call: ServerCall) -> None:
        try:
            plan = self._handlers.plan(call)
        except BaseException as e:  # an interceptor's SystemExit too: the call ends all the same
            refuse(call, e)
            return
        if plan is None:
            refuse(call, None)
            return
        try:
            self._serve(call, *plan)
        except BaseException:
            # `_serve` ends its call however the handler ends: what comes here failed ending it
            # (an exception whose `str` raises, a method handler without its parts). grpcio's
            # words for it.
            unprintable(call)

    def _serve(self, call: ServerCall, handler: grpc.RpcMethodHandler, method: Any, raw: bool) -> None:
        context = ServicerContext(call, handler, raw, self._max_send)
        try:
            request = context._requests() if handler.request_streaming else context._request(context._recv())
            response = method(request, context)
            if handler.response_streaming:
                send, responses = context._send, None
                while True:
                    try:
                        if responses is None:
                            responses = iter(response)
                        message = next(responses, None)
                    except BaseException as e:  # the handler's own code, run by the iteration
                        context._finish(e, fault=f"Exception iterating responses: {e}")
                        return
                    if message is None:  # as grpcio's server: a None ends the stream too
                        break
                    send(context._encode(message))
            elif context._responds():
                # The response and the status in one step.
                context._finish(None, context._encode(response))
                return
        # A handler's SystemExit or KeyboardInterrupt too: its call ends UNKNOWN, and the thread
        # serves on, as threads ignore SystemExit (grpcio's call then waits for its deadline).
        except BaseException as e:
            context._finish(e)
        else:
            context._finish(None)

    def start(self) -> None:
        self._check_health()
        if not self._native.start():
            raise StartError("Cannot start already-started server!")  # grpcio's words
        # The dispatcher and the loops hold the server weakly (`_stop_when_dropped`): they held
        # it, and a server dropped served on for the rest of the process.
        weak = weakref.WeakMethod(self._handle)

        def handle(call: ServerCall) -> None:
            method = weak()
            if method is None:  # dropped: its stop is under way
                call.finish(_UNAVAILABLE, "the server was dropped")
                return
            # Each call in a context of its own, as grpcio runs it (a fresh
            # `contextvars.Context`, its interceptors too): a ContextVar a handler set and did
            # not reset (a request id, say) leaked into the next call served on the thread.
            contextvars.Context().run(method, call)

        args = (self._native, self._pool, handle, self._others_waiting)
        threading.Thread(target=self._dispatch, args=args, name="isthmus-dispatch", daemon=True).start()
        self._stop_when_dropped()
        # At exit, before the executor joins its threads (its hook was registered first, and
        # these run last first): the loops on them end now instead of after 2 s without calls.
        this = weakref.ref(self)

        def close() -> None:
            server = this()
            if server is not None:
                server._native.close_calls("the process is exiting")

        threading._register_atexit(close)  # type: ignore[attr-defined]

    def stop(self, grace: float | None) -> threading.Event:
        stopped = threading.Event()
        if not self._native.stop(grace):
            # Never started: nothing to stop, and `start` may still serve, as in grpcio.
            stopped.set()
            return stopped

        if grace is None:
            # grpcio's returns once its server has stopped (calls cancelled, ports closed): a
            # bind of the same address may follow at once. In slices, for Ctrl-C.
            while not self._native.wait(_WAIT_SLICE):
                pass
            stopped.set()
            return stopped

        def wait() -> None:
            self._native.wait(None)
            stopped.set()

        threading.Thread(target=wait, name="isthmus-stop", daemon=True).start()
        return stopped

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """True if `timeout` passed first, as grpc has it."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            left = _WAIT_SLICE if end is None else min(_WAIT_SLICE, end - time.monotonic())
            if self._native.wait(max(left, 0.0)):
                return False
            if end is not None and time.monotonic() >= end:
                return True
