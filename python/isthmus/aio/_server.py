"""The asyncio server: grpc.aio.Server's shape. The engine puts each call into the server's
inbox without the GIL, and the loop's standing `listen_async` operation brings it to the loop,
where the handler runs as a task; a call that ends under its handler (the client cancelled, the
deadline passed, the client went away) cancels that task, as grpc.aio does."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import weakref
from collections.abc import AsyncIterable, Callable, Iterable, Sequence
from concurrent.futures import Executor
from typing import Any

import grpc
import grpc.aio

from .._native import ServerCall
from .._server import _WAIT_SLICE, ServerBase, StartError, refuse, unprintable
from ._context import ServicerContext
from ._reactor import Driver, driver
from ._sync import SyncServicerContext

_END = object()  # what `next` gives for a plain handler's responses once they are over


async def _stop_when_the_loop_ends(stop: Callable[[None], Any], stopped: asyncio.Future[None]) -> None:
    """Waits for `stop()` to resolve `stopped`. Cancelled first (`asyncio.run` and uvloop's
    `run` cancel every task before they close their loop), the loop is ending with the server
    still serving: it stops, so that calls are refused UNAVAILABLE at once instead of waiting
    for a loop that will never take them. Holds the native server's `stop`, not the server, so
    a server dropped without `stop` still goes (and stops, `_serve_news`)."""
    try:
        await stopped
    except asyncio.CancelledError:
        stop(None)
        raise


def _cancel_unfinished(task: asyncio.Task[None], ending: list[bool]) -> None:
    """Cancels a handler whose call ended under it, as grpc.aio does (not one that is sending
    its own outcome)."""
    if not ending[0] and not task.done():
        task.cancel()


class UsageError(StartError, grpc.aio.UsageError):
    """`start` of a server that cannot start: grpc.aio's `UsageError`, and the `ValueError` and
    `RuntimeError` of the blocking server's."""


class Server(ServerBase, grpc.aio.Server):
    """Handlers may be coroutine functions, async generators (streaming responses) or plain
    functions and generators. Plain ones run as grpc.aio runs them: on `migration_thread_pool`
    (else the loop's default executor), with a blocking context (`context.abort` raises there,
    `send_initial_metadata` waits), a blocking request iterator, and each response of a
    generator taken on the executor."""

    def __init__(
        self,
        migration_thread_pool: Executor | None = None,
        handlers: Iterable[grpc.GenericRpcHandler] | None = None,
        interceptors: Sequence[Any] | None = None,
        options: Sequence[tuple[str, Any]] | None = None,
        maximum_concurrent_rpcs: int | None = None,
        compression: grpc.Compression | None = None,
    ) -> None:
        if maximum_concurrent_rpcs is not None and maximum_concurrent_rpcs < 1:
            # As grpc.aio (its blocking server takes 0, and refuses every call, as isthmus's).
            raise ValueError("maximum_concurrent_rpcs should be a positive integer")
        # As grpc.aio: a blocking server's interceptor here (its `intercept_service` returns a
        # handler, not an awaitable) failed only the calls it refused, UNKNOWN.
        invalid = [i for i in interceptors or () if not isinstance(i, grpc.aio.ServerInterceptor)]
        if invalid:
            raise ValueError(f"Interceptor must be ServerInterceptor, the following are invalid: {invalid}")
        super().__init__(True, handlers, interceptors, options, maximum_concurrent_rpcs, None, compression)
        self._pool = migration_thread_pool
        self._loop: asyncio.AbstractEventLoop | None = None
        self._native_started = False  # `start` has run
        self._stopped = False  # `stop` has run on a started server
        self._driver: Driver | None = None
        # Handlers running, by call id: (task, ending), for the news that a call was abandoned; it
        # also keeps the tasks (the loop keeps only weak references to them).
        self._running: dict[int, tuple[asyncio.Task[None], list[bool]]] = {}
        # `context.add_done_callback` callbacks, by call id, run when the news says it is done.
        self.done_callbacks: dict[int, list[Callable[[], None]]] = {}
        # Calls done while their handler's task still ran (a cancelled handler cleaning up):
        # their callbacks run when it ends, as grpc.aio runs them after the handler.
        self._done_after_task: set[int] = set()
        self._listening: int | None = None
        self._on_news: Callable[[Any], None] | None = None  # `_news`, weakly held (`start`)
        self._plain: dict[Callable[..., Any], bool] = {}  # whether a behaviour is a plain function
        self._context = contextvars.Context()
        # Resolved by `stop`; until then a task on the loop stops the server if the loop ends
        # (`_stop_when_the_loop_ends`), kept here: the loop holds its tasks only weakly.
        self._stopped_future: asyncio.Future[None] | None = None
        self._loop_watch: asyncio.Task[None] | None = None

    def _listen(self) -> None:
        driver, native, on_news = self._driver, self._native, self._on_news
        assert driver is not None and on_news is not None
        self._listening = driver.stand(lambda token: native.listen_async(driver.reactor, token), on_news)

    def _news(self, news: Any) -> None:
        """On the loop: calls that arrived, calls that ended under their handler, calls done."""
        if not isinstance(news, tuple):  # the server is gone
            return
        self._listen()
        calls, abandoned, done = news
        for call in calls:
            self._spawn(call)
        for id in abandoned:
            running = self._running.get(id)
            if running is not None:
                _cancel_unfinished(*running)
        for id in done:
            self._call_done(id)

    def _call_done(self, id: int) -> None:
        """Call `id` is over: its done-callbacks run now, or when its handler's task ends."""
        running = self._running.get(id)
        if running is not None and not running[0].done():
            self._done_after_task.add(id)
        else:
            self._run_done_callbacks(id)

    def _run_done_callbacks(self, id: int) -> None:
        # Each in a turn of its own, as grpc.aio runs them: one that raises is reported by the
        # loop and harms nothing else.
        loop = self._loop
        assert loop is not None
        for callback in self.done_callbacks.pop(id, ()):
            loop.call_soon(callback)

    def _linger(self) -> None:
        """The last handler finished: wait a moment for the next call before the loop sleeps."""
        loop, driver = self._loop, self._driver
        if self._running or self._listening is None or driver is None or loop is None:
            return
        driver.linger(loop, lambda spin_us: self._native.linger(driver.reactor, spin_us))

    def _spawn(self, call: ServerCall) -> None:
        loop = self._loop
        assert loop is not None
        ending = [False]  # the handler's outcome is being sent: its end is its own
        # Each handler in a copy of the server's context, as grpc.aio's: not of whatever task
        # or callback took the call in.
        # (`create_task(context=)` is 3.11's; made inside the context, a task copies it.)
        task = self._context.copy().run(loop.create_task, self._handle(call, ending))
        id = call.id
        self._running[id] = (task, ending)

        def finished(task: asyncio.Task[None]) -> None:
            self._running.pop(id, None)
            if id in self._done_after_task:
                self._done_after_task.remove(id)
                self._run_done_callbacks(id)
            if not self._running:
                self._linger()  # the last handler done: a moment for the next call

        task.add_done_callback(finished)
        if not call.is_active():  # over already (abandoned before the loop took it)
            task.cancel()

    async def _handle(self, call: ServerCall, ending: list[bool]) -> None:
        try:
            if self._handlers.intercepted:
                plan = await self._handlers.plan_async(call)
            else:
                plan = self._handlers.plan(call)
        except Exception as e:
            refuse(call, e)
            return
        if plan is None:
            refuse(call, None)
            return
        handler, method, raw = plan
        loop, driver = self._loop, self._driver
        assert loop is not None and driver is not None  # set by start, before any call
        try:
            context = ServicerContext(call, handler, loop, driver, raw, self.done_callbacks, self._max_send)
            try:
                await self._serve(handler, method, context)
            except asyncio.CancelledError:
                ending[0] = True
                # A task cancelled by the call's end or the server's stop finds its call over
                # already (this finish does nothing then): the call still open is one whose
                # handler raised CancelledError itself, or cancelled its own task. grpc.aio's
                # server leaves that call to its deadline.
                call.finish(grpc.StatusCode.CANCELLED.value[0], "the handler was cancelled", None)
                raise
            except Exception as e:
                ending[0] = True
                context._finish(e)
            else:
                ending[0] = True
                context._finish(None)
        except Exception:
            # What failed ending the call (an exception whose `str` raises, a method handler
            # without its parts): it ends all the same, in grpcio's words for it.
            unprintable(call)

    async def _serve(
        self, handler: grpc.RpcMethodHandler, method: Callable[..., Any], context: ServicerContext
    ) -> None:
        plain = self._plain.get(method)
        if plain is None:
            # Through decorators (functools.wraps): a plain wrapper of a coroutine function ran
            # on the executor with the blocking context, and the coroutine it gave then waited
            # on the loop for that context, which waits for the loop: the loop hung.
            try:
                target = inspect.unwrap(method)
            except ValueError:  # a __wrapped__ chain with no end (a mock's)
                target = method
            plain = not (inspect.iscoroutinefunction(target) or inspect.isasyncgenfunction(target))
            if not self._handlers.intercepted:  # an interceptor's handlers may be new every call
                self._plain[method] = plain
        if plain:
            await self._serve_plain(handler, method, context)
            return
        if handler.request_streaming:
            request: Any = context._requests()
        else:
            request = await context._unary_request()
        result = method(request, context)
        if inspect.isawaitable(result):
            result = await result
            if handler.response_streaming:
                # A coroutine streams with context.write; what it returns is not sent, as
                # grpc.aio's server sends none of it (isthmus sent a value's items).
                return
        if handler.response_streaming:
            async for message in result:  # an async generator's
                await context.write(message)
        elif context._responds():
            await context._reply(result)

    async def _serve_plain(
        self, handler: grpc.RpcMethodHandler, method: Callable[..., Any], context: ServicerContext
    ) -> None:
        """A plain handler, as grpc.aio serves one: on the executor, with a blocking context."""
        loop = self._loop
        assert loop is not None
        sync = SyncServicerContext(context, loop)
        if handler.request_streaming:
            request: Any = sync._requests()
        else:
            request = await context._unary_request()
        result = await loop.run_in_executor(self._pool, method, request, sync)
        if inspect.isawaitable(result):  # a plain function that gave a coroutine
            result = await result
            if handler.response_streaming:
                return  # a coroutine's return value is not sent (see `_serve`)
        if handler.response_streaming:
            if isinstance(result, AsyncIterable):
                async for message in result:
                    await context.write(message)
            elif result is not None:
                responses = iter(result)
                while (message := await loop.run_in_executor(self._pool, next, responses, _END)) is not _END:
                    await context.write(message)
        elif context._responds():
            await context._reply(result)

    async def start(self) -> None:
        if self._native_started:
            # Started before: a no-op while it serves, as grpc.aio's; refused once stopped.
            if self._stopped:
                raise UsageError("the server has stopped and cannot start again")
            return
        self._check_health()
        if not self._native.start():  # another thread's start came first
            raise UsageError("the server was started already")
        self._native_started = True
        try:
            self._serve_news()
        except BaseException:
            # Nothing would take its calls: it stops (and may not start again), as one stopped.
            self._native.stop(None)
            self._stopped = True
            raise

    def _serve_news(self) -> None:
        """Takes the engine's news of calls on this loop, from `start` on."""
        self._loop = asyncio.get_running_loop()
        self._driver = driver(self._loop)
        self._context = contextvars.copy_context()
        # The driver lives as long as its loop (a weak key) and must not hold the loop up: it
        # holds this server weakly, so a server dropped without `stop` stops: every call after
        # the first waited for its deadline, its news taken by nobody.
        self._stop_when_dropped()
        news = weakref.WeakMethod(self._news)

        def on_news(value: Any) -> None:
            method = news()
            if method is not None:
                method(value)

        self._on_news = on_news
        self._listen()
        # grpc.aio's server keeps a serving task on its loop too.
        self._stopped_future = self._loop.create_future()
        self._loop_watch = self._loop.create_task(
            _stop_when_the_loop_ends(self._native.stop, self._stopped_future)
        )

    async def stop(self, grace: float | None) -> None:
        if not self._native.stop(grace):
            return  # never started: nothing to stop, and `start` may still serve, as in grpc.aio
        self._stopped = True
        if self._stopped_future is not None and not self._stopped_future.done():
            self._stopped_future.set_result(None)  # its watch ends with nothing to do
        await asyncio.get_running_loop().run_in_executor(None, self._native.wait, None)
        if self._listening is not None and self._driver is not None:
            self._driver.abandon(self._listening)  # which closes the inbox
            self._listening = None
        # The engine has ended every call: their done-callbacks are due, whether or not their
        # news came before the inbox closed (those of handlers still running once they end).
        for id in list(self.done_callbacks):
            self._call_done(id)
        # Handlers still running have nothing left to do.
        for task, _ in list(self._running.values()):
            task.cancel()

    async def wait_for_termination(self, timeout: float | None = None) -> bool:
        """True if `timeout` passed first, as grpc has it. The wait runs on an executor thread
        in slices of _WAIT_SLICE: one whole wait outlived its cancellation (Ctrl-C under
        `asyncio.run`), and held the interpreter's exit for good when no stop came."""
        loop = asyncio.get_running_loop()
        end = None if timeout is None else loop.time() + timeout
        while True:
            left = _WAIT_SLICE if end is None else max(0.0, min(_WAIT_SLICE, end - loop.time()))
            if await loop.run_in_executor(None, self._native.wait, left):
                return False
            if end is not None and loop.time() >= end:
                return True
