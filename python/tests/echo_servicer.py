"""The conformance suite's `Echo` service (tests/proto/conformance.proto) in Python, blocking and
asyncio, with the semantics of the Rust peer (tests/src/bin/tonic-peer.rs): echo, reflect
`x-echo` / `x-echo-bin` into the initial metadata (sent before a failure too; tonic-peer's go
with a success only) and, as the proto says, the trailers, fail
with `fail_with` and `fail_message` (trailer `x-failed: yes`), and print `BIDI-ENDED ...` when a
Bidi call ends. Two additions: `fail_with = -1` raises in the handler (the Rust peer answers it
with UNKNOWN too), and a Unary call with a `sleep_ms` prints `UNARY-SLEEPING SEQ` as its handler
starts, for tests to wait on instead of guessing when it runs. Needs the generated
`conformance_pb2*` modules on sys.path."""

from __future__ import annotations

import asyncio
import functools
import struct
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import conformance_pb2 as pb
import conformance_pb2_grpc as pb_grpc
import grpc

_M = (1 << 64) - 1
_CODES = {code.value[0]: code for code in grpc.StatusCode}
RAISE = -1


def _mix(z: int) -> int:
    """splitmix64, as isthmus_tests::mix."""
    z = (z + 0x9E37_79B9_7F4A_7C15) & _M
    z = ((z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9) & _M
    z = ((z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB) & _M
    return z ^ (z >> 31)


@functools.lru_cache(maxsize=512)
def pattern(length: int, seed: int) -> bytes:
    """The payload both sides agree on, byte for byte as isthmus_tests::pattern."""
    n = length // 8
    words = struct.pack(f"<{n}Q", *(_mix(seed ^ ((i * 0x1000_0000_01B3) & _M)) for i in range(n)))
    return words + struct.pack("<Q", _mix(~seed & _M))[: length - 8 * n]


def _time_left_ms(context: Any) -> int:
    left = context.time_remaining()
    # grpcio reports a call without a deadline as one very far away.
    return -1 if left is None or left > 1e6 else int(left * 1000)


def _echoed(context: Any) -> list[tuple[str, str | bytes]]:
    return [(k, v) for k, v in context.invocation_metadata() if k in ("x-echo", "x-echo-bin")]


def _failure(request: pb.EchoRequest) -> tuple[grpc.StatusCode, str] | None:
    if request.fail_with == 0:
        return None
    if request.fail_with == RAISE:
        raise ValueError(request.fail_message)
    return _CODES.get(request.fail_with, grpc.StatusCode.UNKNOWN), request.fail_message


_printing = threading.Lock()


def say(line: str) -> None:
    """Prints `line` for the test reading this process's output. Whole: `print` writes the text
    and its newline apart, so two handler threads printing at once can run their lines together
    (and the test then misses one)."""
    with _printing:
        print(line, flush=True)


def _announce_sleep(request: pb.EchoRequest) -> None:
    """`UNARY-SLEEPING SEQ` for a call that will sleep: its handler is running (and, on a
    server with `maximum_concurrent_rpcs`, holds a slot)."""
    if request.sleep_ms > 0:
        say(f"UNARY-SLEEPING {request.seq}")


_FAILED = (("x-failed", "yes"),)


class Echo(pb_grpc.EchoServicer):
    def Unary(self, request: pb.EchoRequest, context: grpc.ServicerContext) -> pb.EchoReply:
        left, echo = _time_left_ms(context), _echoed(context)
        _announce_sleep(request)
        end = time.monotonic() + request.sleep_ms / 1000
        while time.monotonic() < end and context.is_active():
            time.sleep(0.01)
        if echo:  # ahead of a failure too: the client keeps them (RpcError.initial_metadata())
            context.send_initial_metadata(echo)
        self._fail(request, context)
        if echo:
            context.set_trailing_metadata(echo)
        return pb.EchoReply(payload=request.payload, seq=request.seq, time_left_ms=left)

    def ServerStream(
        self, request: pb.StreamRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.EchoReply]:
        for i in range(request.count):
            yield pb.EchoReply(payload=pattern(request.size, i), seq=i, time_left_ms=-1)

    def ClientStream(
        self, request_iterator: Iterator[pb.EchoRequest], context: grpc.ServicerContext
    ) -> pb.Summary:
        count = size = 0
        for request in request_iterator:
            self._fail(request, context)
            if request.payload != pattern(len(request.payload), request.seq):
                context.abort(grpc.StatusCode.DATA_LOSS, f"message {request.seq} corrupted")
            count, size = count + 1, size + len(request.payload)
        return pb.Summary(count=count, bytes=size)

    def Bidi(
        self, request_iterator: Iterator[pb.EchoRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.EchoReply]:
        ended: str | None = "cancelled"  # unless the loop ends or the handler fails
        first: int | None = None
        try:
            for request in request_iterator:
                first = request.seq if first is None else first
                ended = None
                self._fail(request, context)
                ended = "cancelled"
                yield pb.EchoReply(payload=request.payload, seq=request.seq, time_left_ms=-1)
            ended = "half-close"
        finally:
            if ended is not None:
                say(f"BIDI-ENDED {ended} {first}")

    @staticmethod
    def _fail(request: pb.EchoRequest, context: grpc.ServicerContext) -> None:
        failure = _failure(request)
        if failure is not None:
            context.set_trailing_metadata(_FAILED)
            context.abort(*failure)


class AsyncEcho(pb_grpc.EchoServicer):
    async def Unary(self, request: pb.EchoRequest, context: grpc.aio.ServicerContext) -> pb.EchoReply:
        left, echo = _time_left_ms(context), _echoed(context)
        _announce_sleep(request)
        end = time.monotonic() + request.sleep_ms / 1000
        while time.monotonic() < end and not context.done():
            await asyncio.sleep(0.01)
        if echo:
            await context.send_initial_metadata(echo)
        await self._fail(request, context)
        if echo:
            context.set_trailing_metadata(echo)
        return pb.EchoReply(payload=request.payload, seq=request.seq, time_left_ms=left)

    async def ServerStream(
        self, request: pb.StreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.EchoReply]:
        for i in range(request.count):
            yield pb.EchoReply(payload=pattern(request.size, i), seq=i, time_left_ms=-1)

    async def ClientStream(
        self, request_iterator: AsyncIterator[pb.EchoRequest], context: grpc.aio.ServicerContext
    ) -> pb.Summary:
        count = size = 0
        async for request in request_iterator:
            await self._fail(request, context)
            if request.payload != pattern(len(request.payload), request.seq):
                await context.abort(grpc.StatusCode.DATA_LOSS, f"message {request.seq} corrupted")
            count, size = count + 1, size + len(request.payload)
        return pb.Summary(count=count, bytes=size)

    async def Bidi(
        self, request_iterator: AsyncIterator[pb.EchoRequest], context: grpc.aio.ServicerContext
    ) -> None:
        # Reads and writes through the context, the other style grpc.aio offers.
        ended: str | None = "cancelled"
        first: int | None = None
        try:
            while (request := await context.read()) is not grpc.aio.EOF:
                first = request.seq if first is None else first
                ended = None
                await self._fail(request, context)
                ended = "cancelled"
                await context.write(pb.EchoReply(payload=request.payload, seq=request.seq, time_left_ms=-1))
            ended = "half-close"
        finally:
            if ended is not None:
                say(f"BIDI-ENDED {ended} {first}")

    @staticmethod
    async def _fail(request: pb.EchoRequest, context: grpc.aio.ServicerContext) -> None:
        failure = _failure(request)
        if failure is not None:
            await context.abort(*failure, trailing_metadata=_FAILED)
