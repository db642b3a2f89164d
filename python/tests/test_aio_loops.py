"""isthmus.aio under asyncio's own loop and under uvloop: the calls of every shape, and the
loop's waits. A loop that waits for one call and has nothing else to do takes a fast reply on
its own thread (no sleep in its selector, no wake-up through the reactor's eventfd); a slow
reply still arrives, and a loop waiting for it sleeps instead of spinning."""

from __future__ import annotations

import asyncio
import resource
import time
from collections.abc import AsyncIterator, Callable
from types import ModuleType
from typing import Any

import grpc
import pytest
from clients import run_on as run

import isthmus.aio
from isthmus.aio import _reactor

LOOPS = ["asyncio", "uvloop"]

# Where these run: the Rust server over shm:// (the fast path's transport) and over a Unix
# socket, and isthmus's asyncio server over shm://.
WHERE = [("rust", "shm"), ("rust", "unix"), ("isthmus-aio", "shm")]


@pytest.fixture(params=WHERE, ids="-".join)
def address(request: pytest.FixtureRequest, servers: Callable[[str], Any]) -> str:
    kind, transport = request.param
    return str(servers(kind).addresses[transport])


@pytest.mark.parametrize("loop", LOOPS)
def test_every_shape_on_both_loops(loop: str, address: str, pb_grpc: ModuleType, pb: ModuleType) -> None:
    async def test() -> None:
        async with isthmus.aio.insecure_channel(address) as channel:
            stub = pb_grpc.EchoStub(channel)
            for seq in range(50):  # one at a time: the loop's own waits
                assert (await stub.Unary(pb.EchoRequest(seq=seq, payload=b"x" * seq), timeout=60)).seq == seq
            replies = await asyncio.gather(
                *(stub.Unary(pb.EchoRequest(seq=i), timeout=60) for i in range(64))
            )
            assert [r.seq for r in replies] == list(range(64))
            streamed = [r async for r in stub.ServerStream(pb.StreamRequest(count=5, size=10), timeout=60)]
            assert len(streamed) == 5

            async def requests() -> AsyncIterator[Any]:
                for i in range(3):
                    yield pb.EchoRequest(seq=i)

            summary = await stub.ClientStream(requests(), timeout=60)
            assert summary is not None
            bidi = stub.Bidi(timeout=60)
            for i in range(3):
                await bidi.write(pb.EchoRequest(seq=i))
                assert (await bidi.read()).seq == i
            await bidi.done_writing()
            assert await bidi.read() is grpc.aio.EOF
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Unary(pb.EchoRequest(sleep_ms=2000), timeout=0.1)
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            # A call whose reply is slower than the loop's spin still arrives.
            assert (await stub.Unary(pb.EchoRequest(seq=7, sleep_ms=50), timeout=60)).seq == 7
            call = stub.Unary(pb.EchoRequest(sleep_ms=2000), timeout=60)
            await asyncio.sleep(0.01)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call

    run(loop, test)


@pytest.mark.parametrize("loop", LOOPS)
def test_fast_replies_skip_the_loops_wake_up(
    loop: str,
    servers: Callable[[str], Any],
    pb_grpc: ModuleType,
    pb: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sequential calls to a Rust server over shm://: most replies are taken on the loop's
    thread, so the reactor's eventfd wakes the loop for few of them."""
    wakes = 0
    drive = _reactor.Driver._drive

    def counting(self: _reactor.Driver) -> None:
        nonlocal wakes
        wakes += 1
        drive(self)

    monkeypatch.setattr(_reactor.Driver, "_drive", counting)
    address = servers("rust").addresses["shm"]

    async def test() -> None:
        async with isthmus.aio.insecure_channel(address) as channel:
            stub = pb_grpc.EchoStub(channel)
            await stub.Unary(pb.EchoRequest(), timeout=60)  # connects
            await asyncio.sleep(0.2)  # the fast path's own connection comes up meanwhile
            calls = 400
            for seq in range(calls):
                assert (await stub.Unary(pb.EchoRequest(seq=seq), timeout=60)).seq == seq
            # Generous: on a loaded machine a reply now and then misses the spin.
            assert wakes < calls // 2, f"the loop woke for {wakes} of {calls} replies"

    run(loop, test)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_loop_waiting_for_a_slow_reply_sleeps(
    loop: str, servers: Callable[[str], Any], pb_grpc: ModuleType, pb: ModuleType
) -> None:
    """One call pending whose reply takes a second: the process uses a small fraction of that
    second of CPU (it would use all of it if the loop spun)."""
    address = servers("rust").addresses["shm"]

    async def test() -> None:
        async with isthmus.aio.insecure_channel(address) as channel:
            stub = pb_grpc.EchoStub(channel)
            await stub.Unary(pb.EchoRequest(), timeout=60)
            await asyncio.sleep(0.2)
            before = resource.getrusage(resource.RUSAGE_SELF)
            start = time.monotonic()
            assert (await stub.Unary(pb.EchoRequest(seq=3, sleep_ms=1000), timeout=60)).seq == 3
            elapsed = time.monotonic() - start
            after = resource.getrusage(resource.RUSAGE_SELF)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            assert elapsed >= 0.9
            assert cpu < 0.3 * elapsed, f"{cpu:.3f} s of CPU over {elapsed:.3f} s of waiting"

    run(loop, test)
