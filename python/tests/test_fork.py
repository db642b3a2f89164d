"""A process forked after isthmus was used (a data loader's workers, a pre-forking server): the
child's calls work, on channels made before the fork and after it, blocking and asyncio, over
shared memory and over HTTP/2, and the parent's connections are left as they were, whatever the
child does with what it inherited. (Before, the child's calls shared the parent's shm://
connection, so the parent could be handed the child's reply; an asyncio call in the child waited
for ever on the parent's runtime; and a call on an HTTP/2 channel made before the fork waited
for its deadline, its connection being a task of that runtime.)"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest
from clients import WATCHDOG
from peer import Served, serve

import isthmus
import isthmus.aio


def forked(child: Callable[[], dict]) -> dict:
    """Runs `child` in a forked child, which reports through a pipe and never returns into
    pytest; what it reported. A watchdog the kernel carries out ends a child that hangs, even
    in native code, and the parent sees how it ended."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(60)
            try:
                report = child()
            except BaseException as e:  # anything the child meets is the parent's to report
                report = {"error": repr(e)}
            os.write(write, json.dumps(report, default=repr).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as r:
        seen: dict = json.loads(r.read() or b'{"error": "the child reported nothing"}')
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the child ended with {status:#x}: {seen}"
    return seen


def in_the_child(
    target: str, stub: Any, channel: Any, pb: ModuleType, pb_grpc: ModuleType, stream: Iterator[Any]
) -> dict:
    seen: dict[str, Any] = {}
    # The stream the parent opened: nothing of it is this process's to read.
    try:
        seen["stream"] = next(stream).seq
    except grpc.RpcError as e:
        seen["stream"] = e.code().name
    seen["inherited"] = [stub.Unary(pb.EchoRequest(seq=s), timeout=WATCHDOG).seq for s in (2, 3, 4)]
    fresh = isthmus.insecure_channel(target)
    seen["fresh"] = pb_grpc.EchoStub(fresh).Unary(pb.EchoRequest(seq=5), timeout=WATCHDOG).seq

    async def aio() -> int:
        async with isthmus.aio.insecure_channel(target) as c:
            return int((await pb_grpc.EchoStub(c).Unary(pb.EchoRequest(seq=6), timeout=WATCHDOG)).seq)

    seen["aio"] = asyncio.run(aio())
    channel.close()  # the inherited channel: closing it must not end the parent's connection
    fresh.close()
    return seen


def test_a_forked_child_calls_and_the_parents_connection_is_untouched(
    servers: Callable[[str], Served], pb: ModuleType, pb_grpc: ModuleType
) -> None:
    target = servers("rust").addresses["shm"]
    channel = isthmus.insecure_channel(target)
    stub = pb_grpc.EchoStub(channel)
    assert stub.Unary(pb.EchoRequest(seq=1), timeout=WATCHDOG).seq == 1
    # A stream open across the fork, waiting for its next reply: the server answers each request.
    requests: queue.Queue = queue.Queue()
    stream = stub.Bidi(iter(requests.get, None), timeout=WATCHDOG)
    requests.put(pb.EchoRequest(seq=100))
    assert next(stream).seq == 100
    seen = forked(lambda: in_the_child(target, stub, channel, pb, pb_grpc, stream))
    assert seen == {"stream": "UNAVAILABLE", "inherited": [2, 3, 4], "fresh": 5, "aio": 6}
    try:
        requests.put(pb.EchoRequest(seq=101))
        assert next(stream).seq == 101, "the parent's stream goes on"
        requests.put(None)
        assert list(stream) == []
        for seq in range(10, 20):
            assert stub.Unary(pb.EchoRequest(seq=seq), timeout=WATCHDOG).seq == seq
    finally:
        channel.close()


def test_a_forked_child_calls_on_http2_channels_made_before_the_fork(
    servers: Callable[[str], Served], pb: ModuleType, pb_grpc: ModuleType
) -> None:
    """HTTP/2 channels made before the fork: the child's calls go on connections of its own, a
    stream open at the fork ends UNAVAILABLE there, and channels whose calls move to shm:// move
    in the child too, whether the parent's probe was still running at the fork ("moving") or
    had moved them ("moved"). Before, the child's calls waited for their deadline."""
    served = servers("rust")
    off = [("isthmus.upgrade", False)]
    channels = {t: isthmus.insecure_channel(served.addresses[t], options=off) for t in ("unix", "http")}
    channels["moving"] = isthmus.insecure_channel(served.addresses["http"])
    channels["moved"] = isthmus.insecure_channel(served.addresses["http"])
    stubs = {name: pb_grpc.EchoStub(c) for name, c in channels.items()}
    try:
        for name, stub in stubs.items():
            if name != "moving":
                assert stub.Unary(pb.EchoRequest(seq=1), timeout=WATCHDOG).seq == 1
        end = time.monotonic() + WATCHDOG
        while not channels["moved"].upgrade_status().startswith("shm://") and time.monotonic() < end:
            stubs["moved"].Unary(pb.EchoRequest(seq=1), timeout=WATCHDOG)
            time.sleep(0.01)
        assert channels["moved"].upgrade_status().startswith("shm://")
        requests: queue.Queue = queue.Queue()
        stream = stubs["unix"].Bidi(iter(requests.get, None), timeout=WATCHDOG)
        requests.put(pb.EchoRequest(seq=100))
        assert next(stream).seq == 100
        # Its first call starts its probe, which the fork then comes in the middle of.
        assert stubs["moving"].Unary(pb.EchoRequest(seq=1), timeout=WATCHDOG).seq == 1

        def child() -> dict:
            try:
                seen: dict[str, Any] = {"stream": next(stream).seq}
            except grpc.RpcError as e:
                seen = {"stream": e.code().name}
            for name, stub in stubs.items():
                seen[name] = [stub.Unary(pb.EchoRequest(seq=s), timeout=WATCHDOG).seq for s in (2, 3)]
            # Under the 5 s a lost move waits before it probes again (REPROBE), which is how
            # long the child's moves took before.
            for name in ("moving", "moved"):
                end = time.monotonic() + 4
                while not channels[name].upgrade_status().startswith("shm://") and time.monotonic() < end:
                    stubs[name].Unary(pb.EchoRequest(seq=4), timeout=WATCHDOG)
                    time.sleep(0.01)
                seen[f"{name} to"] = channels[name].upgrade_status()[:6]
            for c in channels.values():
                c.close()
            return seen

        seen = forked(child)
        assert seen == {
            "stream": "UNAVAILABLE",
            **{name: [2, 3] for name in stubs},
            "moving to": "shm://",
            "moved to": "shm://",
        }
        requests.put(pb.EchoRequest(seq=101))
        assert next(stream).seq == 101, "the parent's stream goes on"
        requests.put(None)
        assert list(stream) == []
        for seq, stub in enumerate(stubs.values(), start=10):
            assert stub.Unary(pb.EchoRequest(seq=seq), timeout=WATCHDOG).seq == seq, "the parent's go on"
    finally:
        for c in channels.values():
            c.close()


def test_a_stream_a_parent_thread_reads_at_the_fork_ends_in_the_child(
    servers: Callable[[str], Served], pb: ModuleType, pb_grpc: ModuleType
) -> None:
    """A parent's thread waits in a stream's read at the fork, holding the call's lock: the
    child's read of that stream ends UNAVAILABLE at once (before, it waited for ever on the
    lock), and the parent's read is answered afterwards."""
    channel = isthmus.insecure_channel(servers("rust").addresses["shm"])
    try:
        requests: queue.Queue = queue.Queue()
        stream = pb_grpc.EchoStub(channel).Bidi(iter(requests.get, None), timeout=WATCHDOG)
        read: list[Any] = []
        reader = threading.Thread(target=lambda: read.append(next(stream).seq))
        reader.start()
        # Time for the reader to reach its wait; without it the test passes without the case.
        time.sleep(0.5)

        def child() -> dict:
            try:
                return {"seq": next(stream).seq}
            except grpc.RpcError as e:
                return {"code": e.code().name}

        assert forked(child) == {"code": "UNAVAILABLE"}
        requests.put(pb.EchoRequest(seq=7))
        reader.join(WATCHDOG)
        assert read == [7]
        requests.put(None)
        assert list(stream) == []
    finally:
        channel.close()


def outcome_of(future: Any) -> dict:
    """How `future` ends within 20 s, and whether its done callback ran (in a forked child)."""
    called = threading.Event()
    future.add_done_callback(lambda _: called.set())
    try:
        return {"response": str(future.result(timeout=20))}
    except grpc.RpcError as e:
        return {"code": e.code().name, "callback": called.wait(10)}
    except grpc.FutureTimeoutError:
        return {"code": "still running after 20 s"}


def test_a_unary_future_in_flight_at_the_fork_ends_unavailable_in_the_child(
    servers: Callable[[str], Served], pb: ModuleType, pb_grpc: ModuleType
) -> None:
    """A unary `.future()` the parent has in flight at the fork: its reply goes to the parent,
    so in the child it ends UNAVAILABLE at once, as an inherited stream does (before, its
    `result()` waited for ever there), and its done callbacks run; the parent's ends as usual."""
    served = servers("rust")
    channel = isthmus.insecure_channel(served.addresses["shm"])
    try:
        request = pb.EchoRequest(seq=4242, sleep_ms=1500)
        future = pb_grpc.EchoStub(channel).Unary.future(request, timeout=WATCHDOG)
        served.peer.expect("UNARY-SLEEPING 4242")  # in flight at the fork

        assert forked(lambda: outcome_of(future)) == {"code": "UNAVAILABLE", "callback": True}
        assert future.result(timeout=WATCHDOG).seq == 4242
    finally:
        channel.close()


@pytest.mark.parametrize("wait_for_ready", [False, True])
def test_a_stream_unary_future_in_flight_at_the_fork_ends_unavailable_in_the_child(
    servers: Callable[[str], Served], pb: ModuleType, pb_grpc: ModuleType, wait_for_ready: bool
) -> None:
    """A `.future()` with a request iterator runs on a thread of its own, which a forked child
    does not have: in flight at the fork, it ends UNAVAILABLE in the child, as a unary one does
    (before, its `result()` waited for ever there), and its done callbacks run; the parent's
    ends as usual once its iterator does. With `wait_for_ready` on a channel not yet connected,
    a thread waits for the server and starts the one that runs the call."""
    served = servers("rust")
    channel = isthmus.insecure_channel(served.addresses["shm"])
    sent, finish = threading.Event(), threading.Event()

    def requests() -> Iterator[Any]:
        yield pb.EchoRequest(seq=1)
        sent.set()
        finish.wait(WATCHDOG)
        yield pb.EchoRequest(seq=2)

    try:
        stub = pb_grpc.EchoStub(channel)
        future = stub.ClientStream.future(requests(), timeout=WATCHDOG, wait_for_ready=wait_for_ready)
        assert sent.wait(WATCHDOG), "the first request did not go"

        assert forked(lambda: outcome_of(future)) == {"code": "UNAVAILABLE", "callback": True}
        finish.set()
        assert future.result(timeout=WATCHDOG).count == 2
    finally:
        finish.set()
        channel.close()


@pytest.mark.parametrize("shape", ["unary", "stream"])
def test_a_child_forked_while_a_call_waits_for_its_server_connects_for_itself(
    stubs: Path, pb: ModuleType, pb_grpc: ModuleType, shape: str
) -> None:
    """A call with `wait_for_ready` holds its channel's connecting lock while it waits for the
    server (a unary call the blocking channel's, a stream the engine's); a child forked
    meanwhile connects on its own (here: finds no server, UNAVAILABLE at once). Before, the
    child found the lock held for ever by a thread or task it does not have."""
    target = f"shm://py-fork-wait-{os.getpid()}-{time.monotonic_ns()}"
    channel = isthmus.insecure_channel(target)
    stub = pb_grpc.EchoStub(channel)

    def call(seq: int, **options: Any) -> list[int]:
        if shape == "unary":
            return [stub.Unary(pb.EchoRequest(seq=seq), **options).seq]
        return [r.seq for r in stub.ServerStream(pb.StreamRequest(count=2), **options)]

    waited: list[Any] = []

    def wait() -> None:
        try:
            waited.append(call(1, timeout=WATCHDOG, wait_for_ready=True))
        except grpc.RpcError as e:  # the test's failure is told below, not by this thread
            waited.append(e.code().name)

    waiter = threading.Thread(target=wait)
    waiter.start()
    # Time for the waiter to reach its backoff; without it the test passes without the case.
    time.sleep(0.5)

    def child() -> dict:
        try:
            return {"seqs": call(2, timeout=20)}
        except grpc.RpcError as e:
            return {"code": e.code().name}

    try:
        assert forked(child) == {"code": "UNAVAILABLE"}
        served = serve("rust", ["shm"], stubs, targets=[target])
        try:
            waiter.join(WATCHDOG)
            assert len(waited) == 1 and isinstance(waited[0], list) and waited[0], waited
        finally:
            served.close()
    finally:
        channel.close()
        waiter.join(WATCHDOG)
