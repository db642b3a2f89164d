"""The raw tier: buffers in and out with no copy into Python `bytes`, replies built in place, and
the lifetime rules of both (isthmus.Message, isthmus.Block, isthmus.raw), against a Python
server in another process (`raw_server.py`) over every transport."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import grpc.aio
import numpy as np
import pytest
from peer import Peer, Served, fresh

import isthmus
import isthmus.aio

DTYPES = [np.int8, np.uint8, np.int16, np.int32, np.int64, np.uint64, np.float16, np.float32, np.float64]


def serve_raw(stubs: Path, transports: list[str], *options: str) -> Served:
    """A `raw_server` process on fresh addresses of `transports`."""
    targets = [fresh(t) for t in transports]
    env = dict(os.environ)
    tests = str(Path(__file__).resolve().parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [tests, str(stubs), env.get("PYTHONPATH")]))
    served = Served("raw", Peer([sys.executable, "-m", "raw_server", *options, *targets], env))
    for transport, target in zip(transports, targets, strict=True):
        served.addresses[transport] = (
            target if transport == "shm" else served.peer.expect("LISTENING ").removeprefix("LISTENING ")
        )
    return served


@pytest.fixture(scope="module")
def raw_served(stubs: Path) -> Iterator[Served]:
    served = serve_raw(stubs, ["shm", "unix", "http"])
    yield served
    served.close()


@pytest.fixture(params=["shm", "unix", "http"])
def channel(request: pytest.FixtureRequest, raw_served: Served) -> Iterator[isthmus.Channel]:
    with isthmus.insecure_channel(raw_served.addresses[request.param]) as ch:
        yield ch


@pytest.fixture
def shm(raw_served: Served) -> Iterator[isthmus.Channel]:
    with isthmus.insecure_channel(raw_served.addresses["shm"]) as ch:
        yield ch


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_numpy_arrays_round_trip_as_they_are(channel: isthmus.Channel, dtype: type) -> None:
    for shape in [(0,), (7,), (3, 5), (1 << 17,)]:
        array = (np.arange(int(np.prod(shape))) % 100).astype(dtype).reshape(shape)
        reply = channel.raw_unary("/raw.Raw/Echo", array)
        assert isinstance(reply, isthmus.Message)
        assert len(reply) == array.nbytes
        assert np.array_equal(np.frombuffer(reply, dtype=dtype).reshape(shape), array)


def test_a_zero_dimensional_array_is_its_one_value(channel: isthmus.Channel) -> None:
    reply = channel.raw_unary("/raw.Raw/Echo", np.array(2.5))
    assert np.frombuffer(reply, dtype=np.float64).tolist() == [2.5]


def test_bytes_bytearray_and_memoryview_are_sent_as_they_are(channel: isthmus.Channel) -> None:
    for request in [b"abc", bytearray(b"defg"), memoryview(b"0123456789")[2:7], b""]:
        assert bytes(channel.raw_unary("/raw.Raw/Echo", request)) == bytes(request)


def test_a_non_contiguous_buffer_is_refused_before_anything_is_sent(channel: isthmus.Channel) -> None:
    strided = np.arange(20, dtype=np.int32)[::2]
    with pytest.raises(BufferError, match="C-contiguous"):
        channel.raw_unary("/raw.Raw/Echo", strided)
    with pytest.raises(BufferError, match="C-contiguous"):
        channel.raw_unary("/raw.Raw/Echo", np.asfortranarray(np.ones((3, 4))))
    # The documented way out, and the channel is unharmed.
    reply = channel.raw_unary("/raw.Raw/Echo", np.ascontiguousarray(strided))
    assert np.frombuffer(reply, dtype=np.int32).tolist() == list(range(0, 20, 2))


def test_a_reply_is_read_only(channel: isthmus.Channel) -> None:
    reply = channel.raw_unary("/raw.Raw/Echo", np.zeros(100_000, dtype=np.uint8))
    assert not np.frombuffer(reply, dtype=np.uint8).flags.writeable
    with pytest.raises(TypeError):
        memoryview(reply)[0] = 1
    with pytest.raises(ValueError):
        np.frombuffer(reply, dtype=np.uint8).setflags(write=True)


def test_an_in_place_reply_of_float64s(channel: isthmus.Channel) -> None:
    values = np.linspace(-1, 1, 300_001)
    doubled = np.frombuffer(channel.raw_unary("/raw.Raw/Double", values), dtype=np.float64)
    assert np.array_equal(doubled, values * 2)


def test_a_request_built_in_place_in_shared_memory(shm: isthmus.Channel) -> None:
    block = shm.alloc(8 * 100_000)
    assert block.shared and len(block) == 800_000
    view = np.frombuffer(block, dtype=np.float64)
    view[:] = np.arange(100_000)
    del view
    doubled = np.frombuffer(shm.raw_unary("/raw.Raw/Double", block), dtype=np.float64)
    assert np.array_equal(doubled, np.arange(100_000) * 2.0)
    # Sent once: after that it is empty and refuses to be used.
    assert len(block) == 0
    with pytest.raises(BufferError, match="already sent"):
        shm.raw_unary("/raw.Raw/Echo", block)
    with pytest.raises(BufferError):
        memoryview(block)


@pytest.mark.parametrize("size", [0, 1, 1000, 9 << 20])
def test_write_fills_a_block_with_any_buffer_at_an_offset(shm: isthmus.Channel, size: int) -> None:
    # 9 MiB is past the bound from which the copy streams on a host with a 32 MiB cache, and
    # ISTHMUS_STREAMING_COPY_MIN=0 streams every copy; either way the bytes must be the same.
    data = (np.arange(size, dtype=np.uint64) % 251).astype(np.uint8)
    block = shm.alloc(size + 3)
    block.write(b"abc")
    block.write(data, 3)
    assert bytes(shm.raw_unary("/raw.Raw/Echo", block)) == b"abc" + data.tobytes()


def test_write_refuses_what_does_not_fit_or_is_not_contiguous(shm: isthmus.Channel) -> None:
    block = shm.alloc(8)
    with pytest.raises(ValueError, match="9 bytes at offset 0 do not fit a block of 8 bytes"):
        block.write(b"x" * 9)
    with pytest.raises(ValueError, match="2 bytes at offset 7"):
        block.write(b"xy", 7)
    with pytest.raises(BufferError, match="C-contiguous"):
        block.write(np.arange(16, dtype=np.uint8)[::2])
    with pytest.raises(OverflowError):
        block.write(b"x", -1)
    block.write(b"12345678")
    # A view of the block itself may be written into it: the bytes move as memmove would.
    with memoryview(block) as view:
        block.write(view[0:6], 2)
    assert bytes(shm.raw_unary("/raw.Raw/Echo", block)) == b"12123456"
    with pytest.raises(BufferError, match="already sent"):
        block.write(b"x")


def test_a_block_off_shared_memory_works_the_same(raw_served: Served) -> None:
    with isthmus.insecure_channel(raw_served.addresses["unix"]) as ch:
        block = ch.alloc(5)
        assert not block.shared
        with memoryview(block) as view:
            view[:] = b"hello"
        assert bytes(ch.raw_unary("/raw.Raw/Echo", block)) == b"hello"


def test_a_block_still_viewed_is_not_sent(shm: isthmus.Channel) -> None:
    block = shm.alloc(4)
    view = memoryview(block)
    view[:] = b"abcd"
    with pytest.raises(BufferError, match="still exported"):
        shm.raw_unary("/raw.Raw/Echo", block)
    # Once the view is released, the same block goes.
    view.release()
    assert bytes(shm.raw_unary("/raw.Raw/Echo", block)) == b"abcd"


def test_truncate_sends_only_what_was_written(shm: isthmus.Channel) -> None:
    block = shm.alloc(1000)
    with memoryview(block) as view:
        view[:3] = b"xyz"
    with pytest.raises(ValueError, match="cannot lengthen a block of 1000 bytes to 1001"):
        block.truncate(1001)  # a block never grows, as in the C ABI and Go
    block.truncate(3)
    assert len(block) == 3
    with pytest.raises(ValueError):
        block.truncate(4)
    assert bytes(shm.raw_unary("/raw.Raw/Echo", block)) == b"xyz"


def test_a_server_handler_that_sends_a_block_it_still_views_fails_alone(channel: isthmus.Channel) -> None:
    with pytest.raises(grpc.RpcError) as failed:
        channel.raw_unary("/raw.Raw/KeepExported", b"")
    assert failed.value.code() is grpc.StatusCode.UNKNOWN
    assert "still exported" in (failed.value.details() or "")
    # The server goes on.
    assert bytes(channel.raw_unary("/raw.Raw/Echo", b"after")) == b"after"


def test_replies_held_after_the_call_stay_valid(shm: isthmus.Channel) -> None:
    size = 1 << 20
    replies = [shm.raw_unary("/raw.Raw/Fill", size.to_bytes(8, "little") + bytes([i])) for i in range(40)]
    # More traffic meanwhile: the held blocks are not reused under the views.
    for _ in range(20):
        shm.raw_unary("/raw.Raw/Echo", np.full(size, 0xEE, dtype=np.uint8))
    for i, reply in enumerate(replies):
        assert np.all(np.frombuffer(reply, dtype=np.uint8) == i)


def test_requests_held_by_the_server_stay_valid(shm: isthmus.Channel) -> None:
    # Request k is k in every byte; the Echo traffic after them would overwrite a block
    # reused under a held view with 0s.
    shm.raw_unary("/raw.Raw/CheckHeld", b"")  # nothing held from before
    for k in range(1, 30):
        count = shm.raw_unary("/raw.Raw/Hold", np.full(256 << 10, k, np.uint8))
        assert int.from_bytes(bytes(count), "little") == k
    for _ in range(10):
        shm.raw_unary("/raw.Raw/Echo", np.full(256 << 10, 0, dtype=np.uint8))
    assert bytes(shm.raw_unary("/raw.Raw/CheckHeld", b"")) == b"\x01"


def test_a_streamed_reply_of_blocks_and_a_streamed_request_of_buffers(channel: isthmus.Channel) -> None:
    # Raw methods are ordinary gRPC methods to any client: here the grpc-shaped callables, with
    # no (de)serializers.
    count = channel.unary_stream("/raw.Raw/Count")
    messages = list(count((50).to_bytes(8, "little")))
    assert [m[:1] for m in messages] == [bytes([i]) for i in range(50)]
    assert all(len(m) == 4096 for m in messages)
    total = channel.stream_unary("/raw.Raw/Sum")
    requests = [bytes([i]) * 1000 for i in range(10)]
    assert int.from_bytes(total(iter(requests)), "little") == sum(i * 1000 for i in range(10))


def test_many_in_place_handlers_at_once(shm: isthmus.Channel) -> None:
    failures: list[BaseException] = []

    def caller(seed: int) -> None:
        try:
            for k in range(30):
                values = np.full(10_000 + seed, float(seed * 100 + k))
                doubled = np.frombuffer(shm.raw_unary("/raw.Raw/Double", values), dtype=np.float64)
                assert np.array_equal(doubled, values * 2)
        except BaseException as e:  # reported below
            failures.append(e)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:3]


def test_a_gibibyte_each_way(shm: isthmus.Channel) -> None:
    size = 1 << 30
    request = np.empty(size, dtype=np.uint8)
    request[:: 1 << 20] = np.arange(size >> 20) % 251
    reply = shm.raw_unary("/raw.Raw/Echo", request)
    assert len(reply) == size
    got = np.frombuffer(reply, dtype=np.uint8)
    assert np.array_equal(got[:: 1 << 20], request[:: 1 << 20])
    del got, reply, request


def test_a_block_larger_than_the_arena_is_heap_memory_sent_as_a_copy(shm: isthmus.Channel) -> None:
    """A block the whole 64 MiB arena could not hold: the blocking channel's `alloc`, and a
    blocking server's `context.alloc` (`Fill`), give heap memory, as asyncio's do, where they
    failed RESOURCE_EXHAUSTED; the message goes as a copy, in pieces, and arrives whole."""
    size = 65 << 20
    filled = shm.raw_unary("/raw.Raw/Fill", size.to_bytes(8, "little") + b"\x07", timeout=60)
    assert len(filled) == size
    got = np.frombuffer(filled, dtype=np.uint8)
    assert got[0] == got[size // 2] == got[-1] == 7
    del got, filled
    block = shm.alloc(size)
    assert not block.shared
    with memoryview(block) as view:
        view[:: 1 << 20] = bytes(i % 251 for i in range(size >> 20))
    reply = shm.raw_unary("/raw.Raw/Echo", block, timeout=60)
    assert len(reply) == size
    with memoryview(reply) as view:
        assert view[:: 1 << 20] == bytes(i % 251 for i in range(size >> 20))
    del reply


def test_handlers_run_on_the_executor_no_more_at_once_than_its_size(stubs: Path) -> None:
    # The blocking server takes calls on its executor's threads (ADR 0015): with 6 calls at
    # once, a pool of 2 runs two handlers at once (a second loop starts while the first is
    # busy), never more.
    served = serve_raw(stubs, ["shm"], "--workers", "2")
    try:
        with isthmus.insecure_channel(served.addresses["shm"]) as ch:
            most: list[int] = []

            def caller() -> None:
                most.append(int.from_bytes(bytes(ch.raw_unary("/raw.Raw/Busy", b"")), "little"))

            threads = [threading.Thread(target=caller) for _ in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert len(most) == 6
            assert max(most) == 2
    finally:
        served.close()


@pytest.fixture(scope="module")
def raw_aio_served(stubs: Path) -> Iterator[Served]:
    served = serve_raw(stubs, ["shm", "unix"], "--aio")
    yield served
    served.close()


@pytest.mark.parametrize("transport", ["shm", "unix"])
def test_raw_handlers_on_the_asyncio_server(raw_aio_served: Served, transport: str) -> None:
    with isthmus.insecure_channel(raw_aio_served.addresses[transport]) as ch:
        array = np.arange(200_000, dtype=np.int32)
        assert np.array_equal(np.frombuffer(ch.raw_unary("/raw.Raw/Echo", array), dtype=np.int32), array)
        values = np.linspace(0, 1, 100_001)
        doubled = np.frombuffer(ch.raw_unary("/raw.Raw/Double", values), dtype=np.float64)
        assert np.array_equal(doubled, values * 2)
        messages = list(ch.unary_stream("/raw.Raw/Count")((20).to_bytes(8, "little")))
        assert [m[:1] for m in messages] == [bytes([i]) for i in range(20)]
        with pytest.raises(grpc.RpcError) as failed:
            ch.raw_unary("/raw.Raw/KeepExported", b"")
        assert "still exported" in (failed.value.details() or "")


@pytest.mark.parametrize("transport", ["shm", "unix", "http"])
def test_the_asyncio_client_sends_buffers_and_gets_messages(raw_served: Served, transport: str) -> None:
    async def run() -> None:
        async with isthmus.aio.insecure_channel(raw_served.addresses[transport]) as ch:
            for dtype in (np.uint8, np.float32, np.int64):
                array = (np.arange(70_000) % 120).astype(dtype)
                reply = await ch.raw_unary("/raw.Raw/Echo", array)
                assert isinstance(reply, isthmus.Message)
                assert np.array_equal(np.frombuffer(reply, dtype=dtype), array)
            block = ch.alloc(8 * 1000)
            filling = np.frombuffer(block, dtype=np.float64)
            filling[:] = np.arange(1000)
            del filling
            doubled = np.frombuffer(await ch.raw_unary("/raw.Raw/Double", block), dtype=np.float64)
            assert np.array_equal(doubled, np.arange(1000) * 2.0)
            with pytest.raises(BufferError, match="C-contiguous"):
                await ch.raw_unary("/raw.Raw/Echo", np.arange(10)[::2])
            # The channel is unharmed, and calls run concurrently.
            replies = await asyncio.gather(
                *(ch.raw_unary("/raw.Raw/Echo", np.full(50_000, i, np.uint8)) for i in range(16))
            )
            assert all(np.all(np.frombuffer(r, dtype=np.uint8) == i) for i, r in enumerate(replies))

    asyncio.run(run())


SEND_LIMIT = [("grpc.max_send_message_length", 1000)]


@pytest.mark.parametrize("transport", ["shm", "unix"])
def test_a_raw_request_over_the_send_limit_fails_as_a_serialized_one_does(
    raw_served: Served, transport: str
) -> None:
    """`grpc.max_send_message_length` bounds raw requests too, sync and asyncio: a buffer or a
    block over it fails RESOURCE_EXHAUSTED naming its size and the limit, as a request through
    a serializer does, and the channel goes on."""
    address = raw_served.addresses[transport]
    with isthmus.insecure_channel(address, options=SEND_LIMIT) as ch:
        with pytest.raises(grpc.RpcError) as serialized:
            ch.unary_unary("/raw.Raw/Echo")(b"x" * 2000, timeout=60)
        want = (grpc.StatusCode.RESOURCE_EXHAUSTED, "CLIENT: Sent message larger than max (2000 vs. 1000)")
        assert (serialized.value.code(), serialized.value.details()) == want
        block = ch.alloc(2000)
        for request in (b"x" * 2000, np.zeros(250, np.float64), block):
            with pytest.raises(grpc.RpcError) as raw:
                ch.raw_unary("/raw.Raw/Echo", request, timeout=60)
            assert (raw.value.code(), raw.value.details()) == want
        assert bytes(ch.raw_unary("/raw.Raw/Echo", b"y" * 1000, timeout=60)) == b"y" * 1000

    async def run() -> None:
        async with isthmus.aio.insecure_channel(address, options=SEND_LIMIT) as ch:
            block = ch.alloc(2000)
            for request in (b"x" * 2000, np.zeros(250, np.float64), block):
                with pytest.raises(grpc.aio.AioRpcError) as raw:
                    await ch.raw_unary("/raw.Raw/Echo", request, timeout=60)
                assert (raw.value.code(), raw.value.details()) == want
            assert bytes(await ch.raw_unary("/raw.Raw/Echo", b"y" * 1000, timeout=60)) == b"y" * 1000

    asyncio.run(run())


def settles(read: Callable[[], int], want: int = 0, within: float = 20.0) -> int:
    """`read()` once it equals `want`, or its last value after `within` seconds: releases cross
    processes, so a count may take a moment to come back."""
    end = time.monotonic() + within
    while (value := read()) != want and time.monotonic() < end:
        time.sleep(0.01)
    return value


def server_arena(ch: isthmus.Channel) -> int:
    return int.from_bytes(bytes(ch.raw_unary("/raw.Raw/ArenaInUse", b"", timeout=60)), "little")


@pytest.mark.parametrize("server", ["sync", "aio"])
def test_no_shared_memory_leaks_once_the_buffers_are_let_go(stubs: Path, server: str) -> None:
    """Every raw path, sync and asyncio client against a server in another process: blocks
    built in place, replies built in place and held past the call, streamed blocks, held
    requests, a cancelled call and a failed one. While buffers are held the arenas show it;
    once they are let go, both sides' arena in use is back to zero."""
    served = serve_raw(stubs, ["shm"], *(["--aio"] if server == "aio" else []))
    try:
        with isthmus.insecure_channel(served.addresses["shm"]) as ch:
            assert server_arena(ch) == 0
            every_blocking_path(ch)
            assert settles(lambda: server_arena(ch)) == 0
            assert settles(lambda: ch.stats().arena_in_use) == 0
            stats = ch.stats()
            assert stats.arena_high_water >= 1 << 20 and stats.calls_in_flight == 0
        asyncio.run(every_asyncio_path(served.addresses["shm"]))
        with isthmus.insecure_channel(served.addresses["shm"]) as ch:
            assert settles(lambda: server_arena(ch)) == 0
    finally:
        served.close()


def every_blocking_path(ch: isthmus.Channel) -> None:
    """The blocking client's raw calls, each buffer held until all are checked."""
    block = ch_block(ch, 1 << 20, 3)
    assert ch.stats().arena_in_use >= 1 << 20
    echoed = ch.raw_unary("/raw.Raw/Echo", block)
    kept = [ch.raw_unary("/raw.Raw/Fill", (1 << 20).to_bytes(8, "little") + bytes([i])) for i in range(8)]
    streamed = list(ch.unary_stream("/raw.Raw/Count")((16).to_bytes(8, "little")))
    assert server_arena(ch) >= 8 << 20, "replies held here hold the server's blocks"
    for i in range(1, 4):
        ch.raw_unary("/raw.Raw/Hold", ch_block(ch, 100_000, i))
    assert bytes(ch.raw_unary("/raw.Raw/CheckHeld", b"")) == b"\x01"
    with pytest.raises(grpc.RpcError) as late:
        ch.raw_unary("/raw.Raw/Busy", ch_block(ch, 50_000, 7), timeout=0.05)
    assert late.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    assert head(echoed, 4) == b"\x03" * 4
    assert [head(m, 1) for m in kept] == [bytes([i]) for i in range(8)]
    assert [head(m, 1) for m in streamed] == [bytes([i]) for i in range(16)]
    # Let go here: `late`'s traceback holds this frame, which only the cycle collector would free.
    del echoed, kept, streamed


async def every_asyncio_path(address: str) -> None:
    """The asyncio client's raw calls with blocks of its shared memory, and a cancelled one."""
    async with isthmus.aio.insecure_channel(address) as ch:
        await ch.channel_ready()
        replies = []
        for i in range(8):
            block = ch_block(ch, 1 << 20, i)
            assert block.shared, "built in the connection's shared memory"
            replies.append(await ch.raw_unary("/raw.Raw/Echo", block))
            assert len(block) == 0, "sent where it is"
        assert ch.stats().arena_high_water >= 1 << 20
        slow = asyncio.ensure_future(ch.raw_unary("/raw.Raw/Busy", ch.alloc(70_000)))
        await asyncio.sleep(0.05)
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        assert [head(r, 1) for r in replies] == [bytes([i]) for i in range(8)]
        del replies
        assert await asyncio.to_thread(settles, lambda: ch.stats().arena_in_use) == 0


def head(message: isthmus.Message, n: int) -> bytes:
    """The first `n` bytes of `message`, with no view of it left behind."""
    with memoryview(message) as view:
        return bytes(view[:n])


def ch_block(ch: isthmus.Channel | isthmus.aio.Channel, size: int, byte: int) -> isthmus.Block:
    """A block of `ch`'s shared memory, `size` bytes of `byte`."""
    block = ch.alloc(size)
    with memoryview(block) as view:
        view[:] = bytes([byte]) * size
    return block


def test_the_asyncio_client_sends_a_block_of_another_channel_nowhere(raw_served: Served) -> None:
    async def run() -> None:
        address = raw_served.addresses["shm"]
        async with isthmus.aio.insecure_channel(address) as a, isthmus.aio.insecure_channel(address) as b:
            for ch in (a, b):
                await ch.channel_ready()
            block = a.alloc(100)
            assert block.shared
            with pytest.raises(grpc.aio.AioRpcError) as other:
                await b.raw_unary("/raw.Raw/Echo", block)
            assert other.value.code() is grpc.StatusCode.UNAVAILABLE
            assert "another channel" in (other.value.details() or "")
            # Refused before it was sent: a channel's own blocks still go, both channels work.
            assert bytes(await a.raw_unary("/raw.Raw/Echo", ch_block(a, 100, 5))) == b"\x05" * 100
            assert bytes(await b.raw_unary("/raw.Raw/Echo", b"ok")) == b"ok"

    asyncio.run(run())


def test_a_gibibyte_each_way_on_asyncio(raw_served: Served) -> None:
    size = 1 << 30

    async def run() -> None:
        async with isthmus.aio.insecure_channel(
            raw_served.addresses["shm"], options=[("grpc.max_receive_message_length", -1)]
        ) as ch:
            request = np.empty(size, dtype=np.uint8)
            request[:: 1 << 20] = np.arange(size >> 20) % 251
            reply = await ch.raw_unary("/raw.Raw/Echo", request)
            assert len(reply) == size
            got = np.frombuffer(reply, dtype=np.uint8)
            assert np.array_equal(got[:: 1 << 20], request[:: 1 << 20])

    asyncio.run(run())


def test_an_asyncio_handler_that_finds_the_arena_full_does_not_stop_the_loop(raw_aio_served: Served) -> None:
    """A reply block the asyncio server cannot allocate at once (the client holds most of the
    connection's 64 MiB arena) is built on the heap and waits for room as a task: the loop
    goes on answering other calls, and the reply arrives once room comes."""
    fill = (8 << 20).to_bytes(8, "little") + b"\x09"
    with isthmus.insecure_channel(raw_aio_served.addresses["shm"]) as ch:
        hog = ch.raw_unary("/raw.Raw/Fill", (60 << 20).to_bytes(8, "little") + b"\x01", timeout=60)
        waiting: list[isthmus.Message] = []
        filler = threading.Thread(
            target=lambda: waiting.append(ch.raw_unary("/raw.Raw/Fill", fill, timeout=60))
        )
        filler.start()
        try:
            for i in range(20):
                assert bytes(ch.raw_unary("/raw.Raw/Echo", bytes([i]) * 100, timeout=20)) == bytes([i]) * 100
            assert not waiting, "the 8 MiB reply waits for the arena"
        finally:
            del hog
        filler.join(60)
        assert len(waiting) == 1 and len(waiting[0]) == 8 << 20 and head(waiting[0], 4) == b"\x09" * 4


def test_a_python_thread_holding_the_gil_does_not_stop_the_asyncio_servers_reader(
    raw_aio_served: Served,
) -> None:
    """The connection's reader hands a call to the asyncio server without the GIL: while a
    handler holds it for seconds, a call that arrives on the same connection waits for the loop,
    but the frames behind it are still read (the engine's health service answers at once)."""
    with isthmus.insecure_channel(raw_aio_served.addresses["shm"]) as ch:
        health = ch.unary_unary("/grpc.health.v1.Health/Check")
        assert health(b"", timeout=60) == b"\x08\x01"
        outcomes: dict[str, bytes] = {}
        hog = threading.Thread(
            target=lambda: outcomes.update(
                hog=bytes(ch.raw_unary("/raw.Raw/HogGil", (6000).to_bytes(8, "little")))
            )
        )
        hog.start()
        time.sleep(0.5)  # the hog has the GIL by now (if not, the calls below only pass sooner)
        queued = threading.Thread(
            target=lambda: outcomes.update(echo=bytes(ch.raw_unary("/raw.Raw/Echo", b"q")))
        )
        queued.start()
        time.sleep(0.1)
        assert health(b"", timeout=2.5) == b"\x08\x01", "the reader was stuck behind the GIL"
        hog.join(60)
        queued.join(60)
        assert outcomes == {"hog": b"done", "echo": b"q"}


def shm_socket(address: str) -> Path:
    """Where an `shm://NAME` server's socket is: `$XDG_RUNTIME_DIR/isthmus`, else
    `/tmp/isthmus-UID` (protocol.md, section 2.1)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime, "isthmus") if runtime else Path(f"/tmp/isthmus-{os.getuid()}")
    return base / f"{address.removeprefix('shm://')}.sock"


def test_a_server_counts_each_client_whose_handshake_fails(raw_served: Served, shm: isthmus.Channel) -> None:
    def failed() -> int:
        return int.from_bytes(bytes(shm.raw_unary("/raw.Raw/HandshakesFailed", b"", timeout=60)), "little")

    before = failed()
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(shm_socket(raw_served.addresses["shm"])))
        s.sendall(b"not a hello" * 16)
    assert settles(failed, before + 1) == before + 1
    assert bytes(shm.raw_unary("/raw.Raw/Echo", b"still serving", timeout=60)) == b"still serving"


# A tool that takes a block's address and releases its view at once, keeping only the object
# (as `torch.frombuffer` does), then writes after the block was sent: here with ctypes.
_WRITE_AFTER_SEND = r"""
import ctypes, gc, sys
import isthmus

class Py_buffer(ctypes.Structure):
    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]

get, release = ctypes.pythonapi.PyObject_GetBuffer, ctypes.pythonapi.PyBuffer_Release
get.argtypes = [ctypes.py_object, ctypes.POINTER(Py_buffer), ctypes.c_int]
release.argtypes = [ctypes.POINTER(Py_buffer)]

target, size = sys.argv[1], int(sys.argv[2])
ch = isthmus.insecure_channel(target)
block = ch.alloc(size)
view = Py_buffer()
get(block, ctypes.byref(view), 1)  # PyBUF_WRITABLE
address = view.buf
release(ctypes.byref(view))
assert len(ch.raw_unary("/raw.Raw/Echo", block, timeout=60)) == size
ch.close()
gc.collect()
ctypes.memset(address, 7, size)  # into freed or unmapped memory, unless the block keeps it
print("WROTE", flush=True)
"""


@pytest.mark.parametrize(("transport", "size"), [("unix", 64 << 20), ("shm", 1 << 20)])
def test_a_sent_block_keeps_its_memory_for_a_tool_that_kept_its_address(
    raw_served: Served, transport: str, size: int
) -> None:
    """A block's memory lives as long as the block, sent or not: `torch.frombuffer` releases
    its view at once and keeps the object, and its tensor wrote, after the send, into heap
    memory freed with the send (64 MiB, given back to the system) or an arena unmapped with
    its channel: the process died of SIGSEGV. Now the writes land in memory still there."""
    done = subprocess.run(
        [sys.executable, "-c", _WRITE_AFTER_SEND, raw_served.addresses[transport], str(size)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0 and "WROTE" in done.stdout, (done.returncode, done.stderr[-2000:])


_ALLOC_WAITS = r"""
import sys
import isthmus

ch = isthmus.insecure_channel(sys.argv[1])
held = [ch.alloc(20 << 20) for _ in range(3)]  # 60 MiB of the 64 MiB arena, never sent
try:
    print("WAITING", flush=True)
    ch.alloc(20 << 20)  # room only these blocks' end would make
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def test_ctrl_c_ends_an_alloc_waiting_for_room(raw_served: Served) -> None:
    """A blocking `alloc` with no timeout waits for arena room in slices and runs the signal
    handlers between them, as every blocking wait of isthmus's does: here the room is held by
    the waiting thread's own unsent blocks, so nothing would ever end the wait but Ctrl-C,
    which did nothing."""
    child = subprocess.Popen(
        [sys.executable, "-c", _ALLOC_WAITS, raw_served.addresses["shm"]],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "WAITING"
        time.sleep(0.2)  # into the wait (one before it is caught all the same)
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=30)
        assert "interrupted" in out, err[-2000:]
    finally:
        child.kill()
        child.wait()


def test_a_block_refused_by_a_channel_is_not_used_up(raw_served: Served) -> None:
    """A block sent on a channel that did not allocate it fails INVALID_ARGUMENT before it is
    taken, and goes on the channel that did. It failed UNAVAILABLE after it was taken, and the
    retry raised "the block was already sent", though nothing was."""
    with (
        isthmus.insecure_channel(raw_served.addresses["shm"]) as mine,
        isthmus.insecure_channel(raw_served.addresses["shm"]) as other,
    ):
        block = mine.alloc(100_000)
        assert block.shared
        block.write(b"x" * 100_000)
        with pytest.raises(grpc.RpcError) as refused:
            other.raw_unary("/raw.Raw/Echo", block)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
        assert "another channel" in (refused.value.details() or "")
        assert bytes(mine.raw_unary("/raw.Raw/Echo", block)) == b"x" * 100_000


def _resident() -> int:
    """This process's resident memory, in bytes."""
    with open("/proc/self/status") as status:
        kib = next(line for line in status if line.startswith("VmRSS:")).split()[1]
    return int(kib) << 10


def test_a_heap_block_takes_its_memory_as_it_is_written(raw_served: Served) -> None:
    """A block off shared memory (here a unix:// channel's) of 1 GiB takes no memory until it
    is written: fresh pages are zero. It was cleared byte by byte when made, 1 GiB at once."""
    with isthmus.insecure_channel(raw_served.addresses["unix"]) as ch:
        before = _resident()
        block = ch.alloc(1 << 30)
        grown = _resident() - before
        assert len(block) == 1 << 30 and not block.shared
        with memoryview(block) as view:
            assert view[0] == view[(1 << 30) - 1] == 0
        del block
    assert grown < 64 << 20, f"a 1 GiB block took {grown >> 20} MiB before a byte was written"
