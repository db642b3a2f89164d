"""A process forked after isthmus was used (a data loader's workers, a pre-forking server): the
child's calls work, on channels made before the fork and after it, blocking and asyncio, and
the parent's connection is left as it was, whatever the child does with what it inherited.
(Before, the child's calls shared the parent's connection, so the parent could be handed the
child's reply, and an asyncio call in the child waited for ever on the parent's runtime.)"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import grpc
from clients import WATCHDOG
from peer import Served

import isthmus
import isthmus.aio


def in_the_child(
    target: str, stub: Any, channel: Any, pb: ModuleType, pb_grpc: ModuleType, stream: Iterator[Any]
) -> dict:
    # A watchdog the kernel carries out: a child that hangs in native code dies all the same,
    # and the parent sees how it ended.
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(60)
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
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: reports through the pipe, and never returns into pytest
        os.close(read)
        try:
            report: dict = in_the_child(target, stub, channel, pb, pb_grpc, stream)
        except BaseException as e:  # anything the child meets is the parent's to report
            report = {"error": repr(e)}
        os.write(write, json.dumps(report).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as r:
        seen = json.loads(r.read() or b'{"error": "the child reported nothing"}')
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the child ended with {status:#x}: {seen}"
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
