"""The asyncio server: grpc.aio.Server's shape. The engine hands each call over from its thread
to the loop, where the handler runs as a task; a call that ends under its handler (the client
cancelled, the deadline passed, the client went away) cancels that task, as grpc.aio does."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterable, Iterable, Sequence
from concurrent.futures import Executor
from typing import Any

import grpc
import grpc.aio

from .._handler import behaviour
from .._native import ServerCall
from .._server import ServerBase, refuse
from ._context import ServicerContext
from ._reactor import Driver, driver


def _cancel_unfinished(task: asyncio.Task[None], ending: list[bool]) -> None:
    """Cancels a handler whose call ended under it, as grpc.aio does (not one that is sending
    its own outcome)."""
    if not ending[0] and not task.done():
        task.cancel()


class Server(ServerBase, grpc.aio.Server):
    """Handlers may be coroutine functions, async generators (streaming responses) or plain
    functions and generators; plain ones run on `migration_thread_pool` if one is given (those
    with a unary request and response), else on the loop."""

    def __init__(
        self,
        migration_thread_pool: Executor | None = None,
        handlers: Iterable[grpc.GenericRpcHandler] | None = None,
        interceptors: Sequence[Any] | None = None,
        options: Sequence[tuple[str, Any]] | None = None,
        maximum_concurrent_rpcs: int | None = None,
        compression: grpc.Compression | None = None,
    ) -> None:
        super().__init__(self._dispatch, handlers, interceptors, options, maximum_concurrent_rpcs)
        self._pool = migration_thread_pool
        self._loop: asyncio.AbstractEventLoop | None = None
        self._driver: Driver | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def _dispatch(self, call: ServerCall) -> None:
        # On an engine thread, which must not block.
        try:
            self._loop.call_soon_threadsafe(self._spawn, call)  # type: ignore[union-attr]
        except RuntimeError:  # the loop is closed
            call.finish(grpc.StatusCode.UNAVAILABLE.value[0], "the server is shutting down", None)

    def _spawn(self, call: ServerCall) -> None:
        loop = self._loop
        assert loop is not None
        ending = [False]  # the handler's outcome is being sent: its end is its own
        task = loop.create_task(self._handle(call, ending))
        self._tasks.add(task)  # the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)

        def ended() -> None:
            # On an engine thread, with the GIL: the call ended before its handler finished it
            # (the client cancelled, the deadline passed, the connection ended). Calls that end
            # normally never come here, so they cost no trip through the GIL and the loop.
            with contextlib.suppress(RuntimeError):  # the loop is closed
                loop.call_soon_threadsafe(_cancel_unfinished, task, ending)

        if not call.add_abandon_callback(ended):  # over already (cancelled before the spawn)
            task.cancel()

    async def _handle(self, call: ServerCall, ending: list[bool]) -> None:
        try:
            handler = await self._handlers.find_async(call)
        except Exception as e:
            refuse(call, e)
            return
        if handler is None:
            refuse(call, None)
            return
        try:
            raw = getattr(behaviour(handler), "__isthmus_raw__", False)
        except Exception as e:
            refuse(call, e)
            return
        context = ServicerContext(call, handler, self._loop, self._driver, raw)  # type: ignore[arg-type]
        try:
            await self._serve(handler, context)
        except asyncio.CancelledError:
            ending[0] = True
            call.finish(grpc.StatusCode.CANCELLED.value[0], "the server stopped", None)
            raise
        except Exception as e:
            ending[0] = True
            context._finish(e)
        else:
            ending[0] = True
            context._finish(None)

    async def _serve(self, handler: grpc.RpcMethodHandler, context: ServicerContext) -> None:
        if handler.request_streaming:
            request: Any = context._requests()
        else:
            request = await context._unary_request()
        method = behaviour(handler)
        plain = not (inspect.iscoroutinefunction(method) or inspect.isasyncgenfunction(method))
        if (
            plain
            and self._pool is not None
            and not handler.request_streaming
            and not handler.response_streaming
        ):
            result = await self._loop.run_in_executor(self._pool, method, request, context)  # type: ignore[union-attr]
        else:
            result = method(request, context)
            if inspect.isawaitable(result):
                result = await result
        if handler.response_streaming:
            if isinstance(result, AsyncIterable):
                async for message in result:
                    await context.write(message)
            elif result is not None:  # None: the handler wrote with context.write
                for message in result:
                    await context.write(message)
        elif context._responds():
            await context.write(result)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._driver = driver(self._loop)
        self._check_health()
        self._native.start()

    async def stop(self, grace: float | None) -> None:
        self._native.stop(grace)
        await asyncio.get_running_loop().run_in_executor(None, self._native.wait, None)
        # The engine has ended every call; handlers still running have nothing left to do.
        for task in list(self._tasks):
            task.cancel()

    async def wait_for_termination(self, timeout: float | None = None) -> bool:
        """True if `timeout` passed first, as grpc has it."""
        stopped = await asyncio.get_running_loop().run_in_executor(None, self._native.wait, timeout)
        return not stopped
