"""What belongs to the blocking API alone: futures, response iterators that are calls, cancel,
request iterators, the channel's shapes and isthmus's errors."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import pickle
import queue
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from types import ModuleType
from typing import Any

import grpc
import grpc.aio
import pytest
from conftest import Endpoint
from peer import Peer, Served, fresh

import isthmus

ABORTED = grpc.StatusCode.ABORTED.value[0]


@pytest.fixture
def stub(endpoint: Endpoint, pb_grpc: ModuleType) -> Iterator[Any]:
    with isthmus.insecure_channel(endpoint.address) as channel:
        yield pb_grpc.EchoStub(channel)


def blocking(requests: queue.Queue[Any]) -> Iterator[Any]:
    """Yields what the test puts on `requests`, until None: a stream the test paces."""
    while (request := requests.get()) is not None:
        yield request


def test_errors_are_grpcs(stub: Any, pb: ModuleType) -> None:
    with pytest.raises(isthmus.RpcError) as caught:
        stub.Unary(pb.EchoRequest(fail_with=ABORTED, fail_message="stop"), timeout=60)
    error = caught.value
    for kind in (grpc.RpcError, grpc.Call, grpc.aio.AioRpcError, isthmus.IsthmusError):
        assert isinstance(error, kind)
    assert (error.code(), error.details(), error.is_active()) == (grpc.StatusCode.ABORTED, "stop", False)
    assert "StatusCode.ABORTED" in str(error) and '"stop"' in str(error)
    assert isinstance(error.trailing_metadata(), tuple)
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), copy.code(), copy.details()) == (isthmus.RpcError, grpc.StatusCode.ABORTED, "stop")


@pytest.mark.parametrize("timeout", [1e12, float(sys.maxsize), 1e20, 1e300])
def test_a_timeout_too_long_for_the_clock_is_no_deadline(stub: Any, pb: ModuleType, timeout: float) -> None:
    """A caller's "forever" (`sys.maxsize` seconds, 1e300) is no deadline, as `inf` is, and 1e12 s
    reaches the server as the longest `grpc-timeout` says (11,415 years) or shm:// does (584):
    each raised a PanicException (not an `Exception`) or failed INTERNAL. grpcio fails such calls
    DEADLINE_EXCEEDED at once (past ~285 years its deadline overflows), so this is isthmus's own."""
    for call in (stub.Unary, stub.Unary.future):
        reply = call(pb.EchoRequest(seq=3, payload=b"x"), timeout=timeout)
        reply = reply if isinstance(reply, pb.EchoReply) else reply.result(timeout=30)
        assert (reply.seq, reply.payload) == (3, b"x")
        assert reply.time_left_ms == -1 or reply.time_left_ms > 10**12, reply.time_left_ms
    replies = list(stub.ServerStream(pb.StreamRequest(count=2, size=8), timeout=timeout))
    assert len(replies) == 2


# A blocking server whose handlers take the process's way out: `sys.exit` and
# KeyboardInterrupt, raised in a handler and while a streaming handler's replies are read.
_EXITING_SERVER = """
import sys
from concurrent import futures
import grpc, isthmus

def exits(request, context):
    raise SystemExit(3)

def interrupted(request, context):
    raise KeyboardInterrupt

def exits_midway(request, context):
    yield b"a"
    sys.exit(4)

class ExitingInterceptor(grpc.ServerInterceptor):
    def intercept_service(self, continuation, details):
        if details.method == "/t.T/InterceptorExits":
            sys.exit(5)
        return continuation(details)

server = isthmus.server(futures.ThreadPoolExecutor(2), interceptors=[ExitingInterceptor()])
methods = {
    "Exit": grpc.unary_unary_rpc_method_handler(exits),
    "Interrupt": grpc.unary_unary_rpc_method_handler(interrupted),
    "ExitMidway": grpc.unary_stream_rpc_method_handler(exits_midway),
    "Echo": grpc.unary_unary_rpc_method_handler(lambda request, context: request),
}
server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.T", methods)])
server.add_insecure_port(sys.argv[1])
server.start()
print("READY", flush=True)
server.wait_for_termination()
"""


def test_a_handler_that_raises_systemexit_ends_its_call_not_the_server() -> None:
    """A handler that calls `sys.exit` (or raises KeyboardInterrupt), or an interceptor that
    does, has its call end UNKNOWN, as other exceptions do, and the server serves on: the
    `SystemExit` reached `PyErr::print` on its way out of the thread, which ended the whole
    process. (grpcio's server serves on too, but its call waits for its deadline.)"""
    target = fresh("unix")
    peer = Peer([sys.executable, "-c", _EXITING_SERVER, target])
    try:
        with grpc.insecure_channel(target.replace("unix://", "unix:")) as channel:
            echo = channel.unary_unary("/t.T/Echo")
            for method, details in [("Exit", "3"), ("Interrupt", "")]:
                with pytest.raises(grpc.RpcError) as ended:
                    channel.unary_unary(f"/t.T/{method}")(b"", timeout=30)
                got = (ended.value.code(), ended.value.details())
                assert got == (grpc.StatusCode.UNKNOWN, f"Exception calling application: {details}")
                assert echo(b"on", timeout=30) == b"on"
            replies = channel.unary_stream("/t.T/ExitMidway")(b"", timeout=30)
            assert next(replies) == b"a"
            with pytest.raises(grpc.RpcError) as ended:
                next(replies)
            got = (ended.value.code(), ended.value.details())
            assert got == (grpc.StatusCode.UNKNOWN, "Exception iterating responses: 4")
            assert echo(b"on", timeout=30) == b"on"
            # An interceptor's, as grpcio words a handler lookup that raised.
            with pytest.raises(grpc.RpcError) as ended:
                channel.unary_unary("/t.T/InterceptorExits")(b"", timeout=30)
            got = (ended.value.code(), ended.value.details())
            assert got == (grpc.StatusCode.UNKNOWN, "Error in service handler!")
            assert echo(b"on", timeout=30) == b"on"
        assert peer.process.poll() is None
    finally:
        peer.close()


def test_with_call(stub: Any, pb: ModuleType) -> None:
    reply, call = stub.Unary.with_call(pb.EchoRequest(seq=5), metadata=(("x-echo", "w"),), timeout=60)
    assert reply.seq == 5
    assert (call.code(), call.details(), call.is_active()) == (grpc.StatusCode.OK, "", False)
    assert ("x-echo", "w") in call.initial_metadata()


def test_future(stub: Any, pb: ModuleType) -> None:
    called = threading.Event()
    future = stub.Unary.future(pb.EchoRequest(seq=3), timeout=60)
    future.add_done_callback(lambda f: called.set())
    assert future.result(timeout=60).seq == 3
    assert called.wait(60)
    assert (future.done(), future.running(), future.cancelled()) == (True, False, False)
    assert (future.code(), future.exception(), future.traceback()) == (grpc.StatusCode.OK, None, None)


def test_future_failure(stub: Any, pb: ModuleType) -> None:
    future = stub.Unary.future(pb.EchoRequest(fail_with=ABORTED, fail_message="stop"), timeout=60)
    assert future.exception(timeout=60).code() == grpc.StatusCode.ABORTED
    with pytest.raises(grpc.RpcError):
        future.result()
    assert future.code() == grpc.StatusCode.ABORTED and future.details() == "stop"


def test_future_cancel(stub: Any, pb: ModuleType) -> None:
    future = stub.Unary.future(pb.EchoRequest(sleep_ms=30_000), timeout=60)
    assert future.cancel()
    assert future.cancelled() and future.done() and not future.cancel()
    with pytest.raises(grpc.FutureCancelledError):
        future.result(timeout=60)
    assert future.code() == grpc.StatusCode.CANCELLED


def test_stream_unary_future(stub: Any, pb: ModuleType) -> None:
    future = stub.ClientStream.future(iter([pb.EchoRequest(seq=i) for i in range(5)]), timeout=60)
    assert future.result(timeout=60).count == 5


def test_response_iterator_is_a_call(stub: Any, pb: ModuleType) -> None:
    call = stub.ServerStream(pb.StreamRequest(count=3, size=10), timeout=60)
    assert 0 < call.time_remaining() <= 60
    assert next(call).seq == 0
    assert call.next().seq == 1
    assert [r.seq for r in call] == [2]
    assert (call.code(), call.details(), call.is_active()) == (grpc.StatusCode.OK, "", False)
    assert call.time_remaining() >= 0


def test_cancel_reaches_the_server(endpoint: Endpoint, stub: Any, pb: ModuleType) -> None:
    requests: queue.Queue[Any] = queue.Queue()
    endpoint.served.peer.clear()
    call = stub.Bidi(blocking(requests), timeout=60)
    seq = random.randrange(1, 1 << 40)  # names this call in the server's output
    requests.put(pb.EchoRequest(seq=seq))
    assert next(call).seq == seq
    assert call.cancel()
    with pytest.raises(grpc.RpcError) as caught:
        next(call)
    assert caught.value.code() == grpc.StatusCode.CANCELLED == call.code()
    assert call.cancelled() and not call.is_active()
    endpoint.served.expect_cancelled_bidi(seq)
    requests.put(None)


def test_callbacks_run_at_the_end(stub: Any, pb: ModuleType) -> None:
    ended = threading.Event()
    call = stub.ServerStream(pb.StreamRequest(count=2, size=1), timeout=60)
    assert call.add_callback(ended.set)
    assert len(list(call)) == 2
    assert ended.wait(60)
    assert not call.add_callback(ended.set)


def test_failing_request_iterator_ends_the_call_unknown(stub: Any, pb: ModuleType) -> None:
    # grpcio's blocking calls: UNKNOWN "Exception iterating requests!", and not cancelled().
    def requests() -> Iterator[Any]:
        yield pb.EchoRequest(seq=0)
        raise RuntimeError("no more requests")

    with pytest.raises(grpc.RpcError) as caught:
        stub.ClientStream(requests(), timeout=60)
    assert caught.value.code() == grpc.StatusCode.UNKNOWN
    assert caught.value.details() == "Exception iterating requests!"
    future = stub.ClientStream.future(requests(), timeout=60)
    assert future.exception(timeout=60).code() == grpc.StatusCode.UNKNOWN
    assert not future.cancelled()


def test_a_failing_serializer_fails_the_call_internal(endpoint: Endpoint, pb: ModuleType) -> None:
    # As grpcio: INTERNAL "Exception serializing request!", for every shape and way of calling.
    def bad(request: Any) -> bytes:
        raise ValueError("cannot serialize")

    def internal(error: grpc.RpcError) -> bool:
        return (
            error.code() == grpc.StatusCode.INTERNAL and error.details() == "Exception serializing request!"
        )

    with isthmus.insecure_channel(endpoint.address) as channel:
        unary = channel.unary_unary("/conformance.Echo/Unary", request_serializer=bad)
        for call in (unary, unary.with_call, unary.future):
            with pytest.raises(grpc.RpcError) as caught:
                call(pb.EchoRequest(seq=1), timeout=60)
            assert internal(caught.value)
        with pytest.raises(grpc.RpcError) as caught:
            channel.unary_stream("/conformance.Echo/ServerStream", request_serializer=bad)(
                pb.StreamRequest(count=1), timeout=60
            )
        assert internal(caught.value)
        stream = channel.stream_unary("/conformance.Echo/ClientStream", request_serializer=bad)
        with pytest.raises(grpc.RpcError) as caught:
            stream(iter([pb.EchoRequest(seq=1)]), timeout=60)
        assert internal(caught.value)
        # The channel is fine afterwards.
        ok = channel.unary_unary(
            "/conformance.Echo/Unary",
            request_serializer=pb.EchoRequest.SerializeToString,
            response_deserializer=pb.EchoReply.FromString,
        )
        assert ok(pb.EchoRequest(seq=3), timeout=60).seq == 3


def test_channel_shapes(endpoint: Endpoint, pb_grpc: ModuleType, pb: ModuleType) -> None:
    with isthmus.insecure_channel(endpoint.address) as channel:
        assert isinstance(channel, grpc.Channel)
        grpc.channel_ready_future(channel).result(timeout=60)
        assert pb_grpc.EchoStub(channel).Unary(pb.EchoRequest(seq=9), timeout=60).seq == 9
        raw = channel.unary_unary("/conformance.Echo/Unary")  # no serializers: bytes both ways
        assert pb.EchoReply.FromString(raw(pb.EchoRequest(seq=4).SerializeToString(), timeout=60)).seq == 4


@pytest.mark.parametrize("kind", ["rust", "isthmus"])
def test_transport_counters(
    servers: Callable[[str], Served], kind: str, pb_grpc: ModuleType, pb: ModuleType
) -> None:
    # The transport's counters, as Go's TransportStats and C's isthmus_stats_t give them: a
    # unary call over shm:// is at least one frame each way; plain messages go inline, not as
    # shared blocks; every counter is there and none goes backwards.
    calls = 50
    with isthmus.insecure_channel(servers(kind).addresses["shm"]) as channel:
        stub = pb_grpc.EchoStub(channel)
        stub.Unary(pb.EchoRequest(), timeout=60)
        before = channel.stats()
        for seq in range(calls):
            assert stub.Unary(pb.EchoRequest(seq=seq), timeout=60).seq == seq
        after = channel.stats()
        # Every field comes from the engine (a field it does not give would read 0 for ever).
        reported = set(channel._native.stats())
    server_only = {"accept_errors", "handshakes_failed"}
    assert {f.name for f in dataclasses.fields(isthmus.TransportStats)} - server_only <= reported
    assert after.frames_sent - before.frames_sent >= calls
    assert after.frames_received - before.frames_received >= calls
    assert after.shared_sent == 0
    for name in ("doorbells_rung", "sleeps", "spin_hits", "ring_full_waits", "arena_full_waits"):
        assert getattr(after, name) >= getattr(before, name) >= 0, name


def test_bad_target() -> None:
    with pytest.raises(ValueError):
        isthmus.insecure_channel("carrier-pigeon://home")


@pytest.mark.parametrize("transport", ["shm", "unix"])
def test_nobody_there(transport: str, pb_grpc: ModuleType, pb: ModuleType) -> None:
    with isthmus.insecure_channel(fresh(transport)) as channel, pytest.raises(grpc.RpcError) as caught:
        pb_grpc.EchoStub(channel).Unary(pb.EchoRequest(), timeout=60)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


class _Faults(logging.Handler):
    """Collects the servers' records that start with `prefix` (grpcio's and ours): the
    exception of each, or its message with `messages`."""

    def __init__(self, prefix: str = "Exception calling application", messages: bool = False) -> None:
        super().__init__()
        self.prefix, self.messages = prefix, messages
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(self.prefix):
            error = repr(record.exc_info[1]) if record.exc_info else ""
            self.seen.append(message if self.messages else error)


@contextlib.contextmanager
def _serving(
    implementation: str, methods: dict[str, grpc.RpcMethodHandler], faults: _Faults
) -> Iterator[Any]:
    """A channel to a started server of `implementation` serving `methods` as service t.T
    (grpcio's over a Unix socket, isthmus's over shm://), with `faults` hearing the logs; all
    three go when the block ends."""
    if implementation == "grpcio":
        target = fresh("unix").replace("unix://", "unix:")
        server, channel = grpc.server(futures.ThreadPoolExecutor(4)), grpc.insecure_channel(target)
    else:
        target = fresh("shm")
        server, channel = isthmus.server(futures.ThreadPoolExecutor(4)), isthmus.insecure_channel(target)
    server.add_insecure_port(target)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.T", methods)])
    logging.getLogger().addHandler(faults)
    server.start()
    try:
        yield channel
    finally:
        logging.getLogger().removeHandler(faults)
        channel.close()
        server.stop(None)


@pytest.mark.parametrize("implementation", ["grpcio", "isthmus"])
def test_a_servers_codec_failure_is_internal_and_logged(implementation: str) -> None:
    """A request deserializer that raises or returns None, and a response serializer that
    raises, fail the call INTERNAL in grpcio's words, and the server logs why (isthmus logged
    nothing, and handed the handler a request of None)."""

    def fails(data: bytes) -> Any:
        raise ValueError("cannot")

    echo = lambda request, context: b"reply"  # noqa: E731
    methods = {
        "Raises": grpc.unary_unary_rpc_method_handler(echo, request_deserializer=fails),
        "Nothing": grpc.unary_unary_rpc_method_handler(echo, request_deserializer=lambda data: None),
        "Reply": grpc.unary_unary_rpc_method_handler(echo, response_serializer=fails),
    }
    faults = _Faults("Exception ", messages=True)
    with _serving(implementation, methods, faults) as channel:
        for method, details in [
            ("Raises", "Exception deserializing request!"),
            ("Nothing", "Exception deserializing request!"),
            ("Reply", "Failed to serialize response!"),
        ]:
            with pytest.raises(grpc.RpcError) as failed:
                channel.unary_unary(f"/t.T/{method}")(b"x", timeout=30)
            got = (failed.value.code(), failed.value.details())
            assert got == (grpc.StatusCode.INTERNAL, details), method
        want = ["Exception deserializing message!", "Exception serializing message!"]
        assert faults.seen == want, faults.seen


@pytest.mark.parametrize("implementation", ["grpcio", "isthmus"])
def test_a_handlers_exception_is_logged_unless_it_is_its_calls_end(implementation: str) -> None:
    """A handler that raises after its call ended (here, past the deadline) has failed, and the
    server logs it, as grpcio's does (isthmus logged only while the call was open, so a late
    bug went unseen); a handler that lets through the RpcError its request iterator raised
    when the client cancelled has not, and nothing is logged (isthmus logged it when the cancel
    reached the iterator before the call's end)."""
    started, ended = threading.Event(), threading.Event()

    def late(request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            for _ in range(3000):  # until the deadline has passed, 30 s at most
                if not context.is_active():
                    break
                time.sleep(0.01)
            raise KeyError("late")
        finally:
            ended.set()

    def reads(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        try:
            for _ in requests:
                started.set()
            return b""
        finally:
            ended.set()

    methods = {
        "Late": grpc.unary_unary_rpc_method_handler(late),
        "Reads": grpc.stream_unary_rpc_method_handler(reads),
    }
    faults = _Faults()
    with _serving(implementation, methods, faults) as channel:
        release = threading.Event()

        def requests() -> Iterator[bytes]:
            yield b"a"
            release.wait(30)

        call = channel.stream_unary("/t.T/Reads").future(requests(), timeout=30)
        assert started.wait(30), "the handler got no request"
        call.cancel()
        assert ended.wait(30), "the cancelled call's handler did not end"
        release.set()
        ended.clear()
        with pytest.raises(grpc.RpcError) as late_call:
            channel.unary_unary("/t.T/Late")(b"", timeout=0.3)
        assert late_call.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert ended.wait(30), "the late handler did not end"
        for _ in range(3000):  # its record comes as its call ends, after the handler's `finally`
            if faults.seen:
                break
            time.sleep(0.01)
        assert faults.seen == ["KeyError('late')"], faults.seen


@pytest.mark.parametrize("implementation", ["grpcio", "isthmus"])
def test_a_generic_handler_without_service_is_refused_at_once(implementation: str) -> None:
    """As grpcio: an AttributeError when the handler is added (or given to the server), not
    calls that each fail UNKNOWN later."""
    make = grpc.server if implementation == "grpcio" else isthmus.server
    with pytest.raises(AttributeError, match='does not have "service" method'):
        make(futures.ThreadPoolExecutor(1), handlers=[object()])
    server = make(futures.ThreadPoolExecutor(1))
    with pytest.raises(AttributeError, match='does not have "service" method'):
        server.add_generic_rpc_handlers([object()])
    server.stop(None)


# A process whose library's first loopback name is taken (as by another copy of the library
# loaded beside it, which counts its names from 0 as well) still serves HTTP/2 to handlers.
_LOOPBACK_TAKEN = """
import os
from concurrent import futures
import grpc, isthmus

squat = isthmus.server(futures.ThreadPoolExecutor(1))
squat.add_insecure_port(f"shm://isthmus-loopback-{os.getpid()}-0")
squat.start()
server = isthmus.server(futures.ThreadPoolExecutor(2))
methods = {"Echo": grpc.unary_unary_rpc_method_handler(lambda request, context: request)}
server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.T", methods)])
port = server.add_insecure_port("http://127.0.0.1:0")
server.start()
with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
    print(channel.unary_unary("/t.T/Echo")(b"served", timeout=30).decode(), flush=True)
server.stop(None)
squat.stop(None)
"""


def test_an_http2_server_passes_over_a_loopback_name_taken() -> None:
    """The second copy of the library in a process started no HTTP/2 server with handlers:
    its first private loopback name was the first copy's ("another server is listening")."""
    done = subprocess.run(
        [sys.executable, "-c", _LOOPBACK_TAKEN], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0 and done.stdout.split() == ["served"], done.stdout + done.stderr
