"""The asyncio server's inbox (ADR 0021): what reaches its loop as news, done-callbacks that
raise, a stop with handlers still running, and a loop that goes away without a stop; and a
handler's read that its waiter gave up on. Server and client in this process, over a real
`shm://` connection; the client shares the server's loop where that matters (its waits then
take the server's news too)."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import threading
import time
from typing import Any

import grpc
import grpc.aio
import pytest
import uvloop
from peer import PATIENCE, fresh

import isthmus
import isthmus.aio


def serve(handler: Any) -> tuple[grpc.aio.Server, str]:
    """An asyncio server of `/t.T/Call`, bound to a fresh `shm://` address (not started)."""
    methods = {"Call": grpc.unary_unary_rpc_method_handler(handler)}
    server = isthmus.aio.server(handlers=[grpc.method_handlers_generic_handler("t.T", methods)])
    target = fresh("shm")
    server.add_insecure_port(target)
    return server, target


def test_a_done_callback_that_raises_harms_no_other_call() -> None:
    async def handler(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        context.add_done_callback(lambda _: 1 / 0)
        return request

    async def run() -> None:
        reported: list[BaseException | None] = []
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: reported.append(ctx.get("exception")))
        server, target = serve(handler)
        await server.start()
        try:
            async with isthmus.aio.insecure_channel(target) as ch:
                call = ch.unary_unary("/t.T/Call")
                for _ in range(3):
                    requests = [i.to_bytes(4, "little") for i in range(200)]
                    replies = await asyncio.gather(*(call(r, timeout=30) for r in requests))
                    assert replies == requests
            end = time.monotonic() + 20
            while len(reported) < 600 and time.monotonic() < end:
                await asyncio.sleep(0.01)
            assert len(reported) == 600 and all(isinstance(e, ZeroDivisionError) for e in reported)
        finally:
            await server.stop(None)

    asyncio.run(run())


def test_stop_runs_the_done_callbacks_of_the_handlers_it_ends() -> None:
    """Each after its handler has ended (as grpc.aio runs them), which the test did not look
    at before."""
    started: list[int] = []
    done: list[bool] = []

    async def handler(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        ended = [False]
        context.add_done_callback(lambda c: done.append(ended[0]))
        started.append(1)
        try:
            await asyncio.sleep(60)
        finally:
            ended[0] = True
        return request

    async def run() -> None:
        server, target = serve(handler)
        await server.start()
        async with isthmus.aio.insecure_channel(target) as ch:
            call = ch.unary_unary("/t.T/Call")
            calls = [asyncio.ensure_future(call(b"x", timeout=60)) for _ in range(50)]
            while len(started) < 50:
                await asyncio.sleep(0.01)
            await server.stop(None)
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
            assert all(isinstance(o, grpc.aio.AioRpcError) for o in outcomes), outcomes[:3]
            for _ in range(10):
                await asyncio.sleep(0)  # the callbacks' turns
            assert done == [True] * 50, "each callback ran after its handler ended"

    asyncio.run(run())


@pytest.mark.parametrize("server", ["grpc.aio", "isthmus.aio"])
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_done_callbacks_run_after_a_cancelled_handlers_cleanup(server: str, loop: str) -> None:
    """A handler its client cancels cleans up (an await in its `except CancelledError`) before
    its done-callbacks run, as grpc.aio runs them once the handler's task has ended.
    isthmus.aio ran them as soon as the call was over, in the middle of that cleanup."""
    order: list[str] = []
    started = asyncio.Event()

    async def handler(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        context.add_done_callback(lambda _: order.append("done-callback"))
        started.set()
        try:
            await asyncio.sleep(PATIENCE)
        except asyncio.CancelledError:
            order.append("cancelled")
            await asyncio.sleep(0.05)  # a cleanup that takes the loop some turns
            order.append("cleaned up")
            raise
        return request

    async def run() -> None:
        generic = grpc.method_handlers_generic_handler(
            "t.T", {"Call": grpc.unary_unary_rpc_method_handler(handler)}
        )
        if server == "grpc.aio":
            target = f"unix:{fresh('unix').removeprefix('unix://')}"
            s: Any = grpc.aio.server()
            channel = grpc.aio.insecure_channel
        else:
            target = fresh("shm")
            s = isthmus.aio.server()
            channel = isthmus.aio.insecure_channel
        s.add_generic_rpc_handlers((generic,))
        s.add_insecure_port(target)
        await s.start()
        try:
            async with channel(target) as ch:
                call = ch.unary_unary("/t.T/Call")(b"x", timeout=PATIENCE)
                await started.wait()
                call.cancel()
                end = time.monotonic() + PATIENCE
                while len(order) < 3 and time.monotonic() < end:
                    await asyncio.sleep(0.01)
        finally:
            await s.stop(None)

    (uvloop.run if loop == "uvloop" else asyncio.run)(run())
    assert order == ["cancelled", "cleaned up", "done-callback"]


@pytest.mark.parametrize("held", [False, True], ids=["dropped", "held"])
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_server_whose_loop_went_away_refuses_calls_unavailable(loop: str, held: bool) -> None:
    """A server started on a loop that ended without `stop()` (an exception path), then
    dropped or still held by its program: calls are refused UNAVAILABLE at once, not left to
    their deadline. One still held left them to their deadline before: nothing took its calls."""

    async def handler(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    targets: list[str] = []
    kept: list[Any] = []

    async def start_and_leave() -> None:
        server, target = serve(handler)
        await server.start()
        async with isthmus.aio.insecure_channel(target) as ch:
            assert await ch.unary_unary("/t.T/Call")(b"served", timeout=30) == b"served"
        targets.append(target)
        if held:
            kept.append(server)

    thread = threading.Thread(
        target=lambda: (uvloop.run if loop == "uvloop" else asyncio.run)(start_and_leave())
    )
    thread.start()
    thread.join()
    gc.collect()
    with isthmus.insecure_channel(targets[0]) as ch:
        began = time.monotonic()
        try:
            ch.unary_unary("/t.T/Call")(b"nobody", timeout=30)
            raise AssertionError("a call to a server with no loop succeeded")
        except grpc.RpcError as e:
            assert e.code() is grpc.StatusCode.UNAVAILABLE, (e.code(), e.details())
            assert "no isthmus server is listening" in (e.details() or ""), e.details()
        assert time.monotonic() - began < 20


def test_a_server_dropped_without_a_stop_stops() -> None:
    """A started server its program drops (no `stop`, its loop running on): grpc.aio's shuts
    down. isthmus's served on: the first call after failed UNKNOWN, every later one waited for
    its deadline, its news taken by nobody. Now each is UNAVAILABLE at once."""

    async def handler(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    async def run() -> list[Any]:
        server, target = serve(handler)
        await server.start()
        async with isthmus.aio.insecure_channel(target) as channel:
            got: list[Any] = [await channel.unary_unary("/t.T/Call")(b"served", timeout=30)]
        del server
        gc.collect()
        for _ in range(2):
            async with isthmus.aio.insecure_channel(target) as channel:
                try:
                    got.append(await channel.unary_unary("/t.T/Call")(b"dropped", timeout=30))
                except grpc.RpcError as e:
                    got.append(e.code())
        return got

    assert asyncio.run(run()) == [b"served", grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_read_given_up_on_loses_no_message(loop: str) -> None:
    """`asyncio.wait_for(context.read(), t)` that times out leaves its receive under way; the
    next read must get the message that receive takes, not wait forever for another one. The
    client sends only after the handler has said its first read timed out, so the timeout
    cannot race the message."""

    async def handler(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            await asyncio.wait_for(context.read(), 0.05)
            yield b"a message came that was never sent"
            return
        except asyncio.TimeoutError:
            yield b"timed out"
        for _ in range(2):
            yield b"got " + await context.read()
        yield b"end" if await context.read() is grpc.aio.EOF else b"no end"

    async def run() -> None:
        methods = {"Talk": grpc.stream_stream_rpc_method_handler(handler)}
        server = isthmus.aio.server(handlers=[grpc.method_handlers_generic_handler("t.T", methods)])
        target = fresh("shm")
        server.add_insecure_port(target)
        await server.start()
        try:
            async with isthmus.aio.insecure_channel(target) as ch:
                call = ch.stream_stream("/t.T/Talk")(timeout=30)
                assert await call.read() == b"timed out"
                await call.write(b"one")
                assert await call.read() == b"got one"
                await call.write(b"two")
                assert await call.read() == b"got two"
                await call.done_writing()
                assert await call.read() == b"end"
                assert await call.code() is grpc.StatusCode.OK
        finally:
            await server.stop(None)

    if loop == "uvloop":
        uvloop.run(run())
    else:
        asyncio.run(run())


# A server whose handlers are a coroutine function behind a plain decorator (functools.wraps),
# and behind a plain function that gives its coroutine with nothing to say so, each sending
# initial metadata through its context; called from the same loop. In a process of its own: the
# loop hung for good before (the coroutine waited on the loop for the blocking context it had
# been given, which waits for the loop).
_WRAPPED_HANDLERS = """
import asyncio, functools, sys
import grpc, isthmus, isthmus.aio

def plainly(fn):
    @functools.wraps(fn)
    def wrapper(request, context):
        return fn(request, context)
    return wrapper

async def greet(request, context):
    await context.send_initial_metadata((("x-a", "1"),))
    return request

def hidden(request, context):
    return greet(request, context)

async def main():
    handlers = {"Wrapped": grpc.unary_unary_rpc_method_handler(plainly(greet)),
                "Hidden": grpc.unary_unary_rpc_method_handler(hidden)}
    server = isthmus.aio.server(handlers=[grpc.method_handlers_generic_handler("t.T", handlers)])
    server.add_insecure_port(sys.argv[1])
    await server.start()
    async with isthmus.aio.insecure_channel(sys.argv[1]) as channel:
        call = channel.unary_unary("/t.T/Wrapped")(b"hi", timeout=30)
        print(await call, (await call.initial_metadata())["x-a"])
        try:
            await channel.unary_unary("/t.T/Hidden")(b"hi", timeout=30)
        except grpc.RpcError as e:
            print(e.code(), "event loop's thread" in e.details())
    await server.stop(None)

asyncio.run(main())
"""


def test_a_coroutine_handler_behind_a_plain_wrapper_does_not_hang_the_loop() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _WRAPPED_HANDLERS, fresh("shm")],
        capture_output=True,
        text=True,
        timeout=PATIENCE,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["b'hi' 1", "StatusCode.UNKNOWN True"], done.stdout
