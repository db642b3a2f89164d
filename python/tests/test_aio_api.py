"""What belongs to the asyncio API alone: call objects, read/write, EOF, cancel, async request
iterators, the channel's shapes and isthmus's errors there."""

from __future__ import annotations

import asyncio
import gc
import os
import random
import sys
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from types import ModuleType
from typing import Any

import grpc
import grpc.aio
import pytest
from clients import aio
from conftest import Endpoint
from peer import fresh

import isthmus
import isthmus.aio

ABORTED = grpc.StatusCode.ABORTED.value[0]


@pytest.fixture
def address(endpoint: Endpoint) -> str:
    return endpoint.address


@aio
async def test_errors_are_grpc_aios(address: str, pb_grpc: ModuleType, pb: ModuleType) -> None:
    async with isthmus.aio.insecure_channel(address) as channel:
        call = pb_grpc.EchoStub(channel).Unary(
            pb.EchoRequest(fail_with=ABORTED, fail_message="stop"), timeout=60
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        error = caught.value
        assert isinstance(error, isthmus.RpcError) and isinstance(error, isthmus.IsthmusError)
        assert (error.code(), error.details()) == (grpc.StatusCode.ABORTED, "stop")
        assert isinstance(error.trailing_metadata(), grpc.aio.Metadata)
        assert error.trailing_metadata()["x-failed"] == "yes"
        assert (await call.code(), await call.details()) == (grpc.StatusCode.ABORTED, "stop")


@aio
async def test_a_timeout_too_long_for_the_clock_is_no_deadline(
    address: str, pb_grpc: ModuleType, pb: ModuleType
) -> None:
    """As the blocking API's test of the name: a caller's "forever" is no deadline, and 1e12 s
    the longest the transport says; each raised a PanicException. grpc.aio fails such calls
    DEADLINE_EXCEEDED at once."""
    async with isthmus.aio.insecure_channel(address) as channel:
        stub = pb_grpc.EchoStub(channel)
        for timeout in (1e12, float(sys.maxsize), 1e20, 1e300):
            reply = await stub.Unary(pb.EchoRequest(seq=3, payload=b"x"), timeout=timeout)
            assert (reply.seq, reply.payload) == (3, b"x")
            assert reply.time_left_ms == -1 or reply.time_left_ms > 10**12, (timeout, reply.time_left_ms)
            replies = [r async for r in stub.ServerStream(pb.StreamRequest(count=2, size=8), timeout=timeout)]
            assert len(replies) == 2


@aio
async def test_unary_call_object(address: str, pb_grpc: ModuleType, pb: ModuleType) -> None:
    async with isthmus.aio.insecure_channel(address) as channel:
        ended = asyncio.Event()
        call = pb_grpc.EchoStub(channel).Unary(pb.EchoRequest(seq=2), metadata=[("x-echo", "a")], timeout=60)
        call.add_done_callback(lambda c: ended.set())
        assert 0 < call.time_remaining() <= 60
        assert (await call).seq == 2
        assert (await call).seq == 2  # as a grpc.aio call, awaited again it gives its reply again
        # Stepped by hand, its await's iterator raises StopIteration with the reply; `await`
        # takes the iterator's am_send slot, which returns it: the same object either way.
        with pytest.raises(StopIteration) as stopped:
            next(call.__await__())
        assert stopped.value.value is await call
        with pytest.raises(TypeError):
            iter(call)  # and, as one, it is no iterator (its await's iterator is another object)
        await asyncio.wait_for(ended.wait(), 60)
        assert call.done() and not call.cancelled()
        assert (await call.code(), await call.details()) == (grpc.StatusCode.OK, "")
        assert (await call.initial_metadata())["x-echo"] == "a"
        assert isinstance(await call.trailing_metadata(), grpc.aio.Metadata)


@aio
async def test_cancel_unary(address: str, pb_grpc: ModuleType, pb: ModuleType) -> None:
    async with isthmus.aio.insecure_channel(address) as channel:
        call = pb_grpc.EchoStub(channel).Unary(pb.EchoRequest(sleep_ms=30_000), timeout=60)
        # Driven by hand, not by a task, its await fails as a future's does.
        waiting = call.__await__()
        assert isinstance(next(waiting), asyncio.Future)
        with pytest.raises(RuntimeError, match="await wasn't used with future"):
            next(waiting)
        assert call.cancel() and call.cancelled()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert await call.code() == grpc.StatusCode.CANCELLED


@aio
async def test_wait_for_gives_up(address: str, pb_grpc: ModuleType, pb: ModuleType) -> None:
    async with isthmus.aio.insecure_channel(address) as channel:
        stub = pb_grpc.EchoStub(channel)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(stub.Unary(pb.EchoRequest(sleep_ms=30_000), timeout=60), 0.2)
        assert (await stub.Unary(pb.EchoRequest(seq=1), timeout=60)).seq == 1  # the channel goes on


@aio
async def test_read_to_eof(address: str, pb_grpc: ModuleType, pb: ModuleType) -> None:
    async with isthmus.aio.insecure_channel(address) as channel:
        call = pb_grpc.EchoStub(channel).ServerStream(pb.StreamRequest(count=3, size=5), timeout=60)
        seqs = []
        while (reply := await call.read()) is not grpc.aio.EOF:
            seqs.append(reply.seq)
        assert seqs == [0, 1, 2]
        assert await call.read() is grpc.aio.EOF
        assert call.done() and await call.code() == grpc.StatusCode.OK


@aio
async def test_write_then_await(address: str, pb_grpc: ModuleType, pb: ModuleType) -> None:
    async with isthmus.aio.insecure_channel(address) as channel:
        call = pb_grpc.EchoStub(channel).ClientStream(timeout=60)
        for seq in range(4):
            await call.write(pb.EchoRequest(seq=seq))
        await call.done_writing()
        await call.done_writing()  # idempotent
        assert (await call).count == 4


@aio
async def test_bidi_write_and_read(address: str, pb_grpc: ModuleType, pb: ModuleType) -> None:
    async with isthmus.aio.insecure_channel(address) as channel:
        call = pb_grpc.EchoStub(channel).Bidi(timeout=60)
        for seq in range(3):
            await call.write(pb.EchoRequest(seq=seq))
            assert (await call.read()).seq == seq
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK


@aio
async def test_request_iterators(address: str, pb_grpc: ModuleType, pb: ModuleType) -> None:
    async def paced() -> AsyncIterator[Any]:
        for seq in range(3):
            await asyncio.sleep(0)
            yield pb.EchoRequest(seq=seq)

    async with isthmus.aio.insecure_channel(address) as channel:
        stub = pb_grpc.EchoStub(channel)
        assert [r.seq async for r in stub.Bidi(paced(), timeout=60)] == [0, 1, 2]
        assert (await stub.ClientStream(paced(), timeout=60)).count == 3
        assert (await stub.ClientStream(iter([pb.EchoRequest()] * 2), timeout=60)).count == 2


@aio
async def test_cancel_reaches_the_server(endpoint: Endpoint, pb_grpc: ModuleType, pb: ModuleType) -> None:
    async with isthmus.aio.insecure_channel(endpoint.address) as channel:
        endpoint.served.peer.clear()
        call = pb_grpc.EchoStub(channel).Bidi(timeout=60)
        seq = random.randrange(1, 1 << 40)  # names this call in the server's output
        await call.write(pb.EchoRequest(seq=seq))
        assert (await call.read()).seq == seq
        assert call.cancel() and call.cancelled() and not call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call.read()
        assert await call.code() == grpc.StatusCode.CANCELLED
    await asyncio.to_thread(endpoint.served.expect_cancelled_bidi, seq)


@aio
async def test_cancelled_task_cancels_the_call(address: str, pb_grpc: ModuleType, pb: ModuleType) -> None:
    async with isthmus.aio.insecure_channel(address) as channel:
        call = pb_grpc.EchoStub(channel).Bidi(timeout=60)
        reader = asyncio.create_task(call.read())
        await asyncio.sleep(0.1)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert call.cancelled() and await call.code() == grpc.StatusCode.CANCELLED


@aio
async def test_failing_request_iterator_cancels(address: str, pb_grpc: ModuleType, pb: ModuleType) -> None:
    def requests() -> Iterator[Any]:
        yield pb.EchoRequest(seq=0)
        raise RuntimeError("no more requests")

    async with isthmus.aio.insecure_channel(address) as channel:
        call = pb_grpc.EchoStub(channel).ClientStream(requests(), timeout=60)
        with pytest.raises(asyncio.CancelledError):
            await call
        assert call.cancelled()


@aio
async def test_channel_shapes(address: str, pb_grpc: ModuleType, pb: ModuleType) -> None:
    channel = isthmus.aio.insecure_channel(address)
    assert isinstance(channel, grpc.aio.Channel)
    async with channel:
        await channel.channel_ready()
        assert channel.get_state() is grpc.ChannelConnectivity.READY
        raw = channel.unary_unary("/conformance.Echo/Unary")  # no serializers: bytes both ways
        assert (
            pb.EchoReply.FromString(await raw(pb.EchoRequest(seq=4).SerializeToString(), timeout=60)).seq == 4
        )
    assert channel.get_state() is grpc.ChannelConnectivity.SHUTDOWN


def test_channel_made_outside_a_loop(address: str, pb_grpc: ModuleType, pb: ModuleType) -> None:
    # As grpc.aio allows: the channel binds to the loop it is first used on.
    channel = isthmus.aio.insecure_channel(address)

    async def use() -> int:
        async with channel:
            return (await pb_grpc.EchoStub(channel).Unary(pb.EchoRequest(seq=8), timeout=60)).seq  # type: ignore[no-any-return]

    assert asyncio.run(use()) == 8


def test_a_channel_stays_on_its_loop(address: str, pb_grpc: ModuleType, pb: ModuleType) -> None:
    # As grpc.aio: a channel used on a loop other than its own fails UsageError, whether its own
    # loop still runs (on another thread) or has ended; on its own loop it goes on working.
    own = asyncio.new_event_loop()
    thread = threading.Thread(target=own.run_forever)
    thread.start()
    try:
        channel = asyncio.run_coroutine_threadsafe(_make(address), own).result(60)
        stub = pb_grpc.EchoStub(channel)

        async def call(seq: int) -> int:
            return (await stub.Unary(pb.EchoRequest(seq=seq), timeout=60)).seq  # type: ignore[no-any-return]

        assert asyncio.run_coroutine_threadsafe(call(1), own).result(60) == 1
        with pytest.raises(grpc.aio.UsageError):
            asyncio.run(call(2))
        assert asyncio.run_coroutine_threadsafe(call(3), own).result(60) == 3
    finally:
        own.call_soon_threadsafe(own.stop)
        thread.join()
    try:
        with pytest.raises(grpc.aio.UsageError):  # its own loop has ended; the channel is open
            asyncio.run(call(4))
    finally:
        own.run_until_complete(channel.close())
        own.close()


async def _make(address: str) -> isthmus.aio.Channel:
    return isthmus.aio.insecure_channel(address)


@pytest.mark.parametrize("transport", ["shm", "unix"])
@aio
async def test_nobody_there(transport: str, pb_grpc: ModuleType, pb: ModuleType) -> None:
    async with isthmus.aio.insecure_channel(fresh(transport)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await pb_grpc.EchoStub(channel).Unary(pb.EchoRequest(), timeout=60)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


@aio
async def test_a_response_deserializer_that_raises_fails_the_call_internal(address: str) -> None:
    """As grpcio's blocking call does (which isthmus.aio follows here: grpc.aio logs and returns
    None): INTERNAL, "Exception deserializing response!", for a call with metadata and without
    (the native path and the Python one), and the call's own `code()` and `details()` say the
    same, asked after its await or before it; a request that is no `bytes`, with no serializer,
    raises TypeError on both paths, and the channel goes on."""

    def boom(_: bytes) -> Any:
        raise ValueError("cannot deserialize this")

    internal = (grpc.StatusCode.INTERNAL, "Exception deserializing response!")
    async with isthmus.aio.insecure_channel(address) as channel:
        path = "/conformance.Echo/Unary"
        for metadata in (None, [("x-a", "1")]):
            call = channel.unary_unary(path, response_deserializer=boom)(b"", metadata=metadata, timeout=60)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call
            assert (caught.value.code(), caught.value.details()) == internal, metadata
            assert (await call.code(), await call.details()) == internal, metadata
            # Its status first: the same, and so is the await's.
            call = channel.unary_unary(path, response_deserializer=boom)(b"", metadata=metadata, timeout=60)
            assert (await call.code(), await call.details()) == internal, metadata
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call
            assert (caught.value.code(), caught.value.details()) == internal, metadata
            with pytest.raises(TypeError):
                await channel.unary_unary(path)("text", metadata=metadata, timeout=60)
        assert isinstance(await channel.unary_unary(path)(b"", timeout=60), bytes)


@aio
async def test_a_channel_bound_before_a_fork_is_not_used_in_the_child(
    address: str, pb_grpc: ModuleType, pb: ModuleType
) -> None:
    """The child of a fork does not call through its parent's channel (whose loop, reader and
    connections are the parent's): the call raises there, as asyncio's own objects do after a
    fork, instead of writing into the parent's connection or waiting for ever. The parent's
    channel goes on."""
    async with isthmus.aio.insecure_channel(address) as channel:
        stub = pb_grpc.EchoStub(channel)
        assert (await stub.Unary(pb.EchoRequest(seq=1), timeout=60)).seq == 1  # bound, connected
        pid = os.fork()
        if pid == 0:  # the child: no pytest, no output, only an exit code
            code = 3
            try:
                await stub.Unary(pb.EchoRequest(seq=2), timeout=5)
                code = 1
            except RuntimeError:
                code = 0
            except BaseException:
                code = 2
            finally:
                os._exit(code)
        end = time.monotonic() + 60
        while (done := os.waitpid(pid, os.WNOHANG)) == (0, 0) and time.monotonic() < end:
            await asyncio.sleep(0.01)
        if done == (0, 0):
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError("the child's call did not end")
        assert os.waitstatus_to_exitcode(done[1]) == 0, "the child's call did not raise RuntimeError"
        assert (await stub.Unary(pb.EchoRequest(seq=3), timeout=60)).seq == 3


def test_a_stub_held_by_its_own_serializers_owner_is_collected() -> None:
    """A multi-callable whose serializer is a bound method of the object that holds it is a
    cycle; the collector frees it, as it frees grpcio's (the native multi-callables show it
    their references), for the blocking channel and the asyncio one."""

    class Client:
        def __init__(self, channel: Any) -> None:
            self.rpc = channel.unary_unary(
                "/conformance.Echo/Unary", request_serializer=self.encode, response_deserializer=self.decode
            )

        def encode(self, message: bytes) -> bytes:
            return message

        def decode(self, message: bytes) -> bytes:
            return message

    def collected(channel: Any) -> bool:
        client = Client(channel)
        gone = weakref.ref(client)
        del client
        gc.collect()
        return gone() is None

    target = fresh("shm")  # never connected: a stub connects nothing
    with isthmus.insecure_channel(target) as channel:
        assert collected(channel)

    async def test() -> None:
        async with isthmus.aio.insecure_channel(target) as channel:
            assert collected(channel)

    asyncio.run(test())


@aio
async def test_a_read_racing_the_drain_of_code_loses_no_message(
    address: str, pb_grpc: ModuleType, pb: ModuleType
) -> None:
    """A reader in a loop of reads and a `code()` await (which drains the responses for the
    status) take turns at the receive: a read that started its receive while the lock was
    free but a woken waiter not yet run went beside that waiter's receive, and the message it
    took was lost (then the read waited for ever). Paced as a ping-pong: each request goes once
    the reader has the last reply, so each read finds its message still to come."""
    count = 12
    async with isthmus.aio.insecure_channel(address) as channel:
        call = pb_grpc.EchoStub(channel).Bidi(timeout=60)
        got: list[int] = []

        async def reader() -> None:
            async for reply in call:
                got.append(reply.seq)

        async def got_at_least(n: int) -> None:
            while len(got) < n:
                await asyncio.sleep(0.001)

        reading = asyncio.ensure_future(reader())
        await call.write(pb.EchoRequest(seq=0))
        await asyncio.wait_for(got_at_least(1), 30)
        status = asyncio.ensure_future(call.code())
        for seq in range(1, count):
            await asyncio.sleep(0.01)  # the drain and the reader take their turns meanwhile
            await call.write(pb.EchoRequest(seq=seq))
            await asyncio.wait_for(got_at_least(seq + 1), 30)
        await call.done_writing()
        assert await asyncio.wait_for(status, 30) == grpc.StatusCode.OK
        await asyncio.wait_for(reading, 30)
        assert got == list(range(count))


@aio
async def test_cancelling_a_call_still_starting_ends_its_waiters(pb_grpc: ModuleType, pb: ModuleType) -> None:
    """A streaming call waiting for a server (wait_for_ready) and cancelled: a read waiting for
    its start raises CancelledError at once, as grpc.aio's, and the start stops, instead of
    both waiting for a server until the deadline."""
    address = fresh("shm")
    async with isthmus.aio.insecure_channel(address) as channel:
        call = pb_grpc.EchoStub(channel).Bidi(timeout=120, wait_for_ready=True)
        read = asyncio.ensure_future(call.read())
        await asyncio.sleep(0.05)  # the read waits for the start
        assert not read.done()
        assert call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(read, 30)
        assert call.cancelled() and await call.code() == grpc.StatusCode.CANCELLED


def test_a_loop_closed_with_a_call_pending_is_freed(
    address: str, pb_grpc: ModuleType, pb: ModuleType
) -> None:
    """A loop closed while a call made on it was never awaited: its driver held the call's
    future, which holds the loop, so neither was ever freed. The next loop to use isthmus
    drops the closed loop's driver, which ends the call."""
    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []

    async def leave_a_call_pending() -> None:
        loops.append(weakref.ref(asyncio.get_running_loop()))
        channel = isthmus.aio.insecure_channel(address)
        pb_grpc.EchoStub(channel).Unary(pb.EchoRequest(sleep_ms=2000), timeout=60)  # never awaited
        await asyncio.sleep(0.05)

    async def another_loop() -> None:
        async with isthmus.aio.insecure_channel(address) as channel:
            assert (await pb_grpc.EchoStub(channel).Unary(pb.EchoRequest(seq=3), timeout=60)).seq == 3

    asyncio.run(leave_a_call_pending())
    asyncio.run(another_loop())
    gc.collect()
    assert loops[0]() is None, gc.get_referrers(loops[0]())
