"""Servers that go away: killed (SIGKILL, as a crash) with a call in progress, and stopped
gracefully (SIGTERM) with one that then finishes. Each test has a server of its own."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
import pytest
from clients import WATCHDOG
from peer import Served, go_peer, serve, tonic_peer
from test_sync_api import blocking

import isthmus
import isthmus.aio

KINDS = ["rust", "go", "isthmus", "isthmus-aio"]


@pytest.fixture
def start(stubs: Path) -> Iterator[Callable[[str, str], Served]]:
    started: list[Served] = []

    def run(kind: str, transport: str) -> Served:
        if kind == "rust" and tonic_peer() is None:
            pytest.skip("tonic-peer is not built (make unit, or set ISTHMUS_TONIC_PEER)")
        if kind == "go" and go_peer() is None:
            pytest.skip("go-peer is not built (make go-bins, or set ISTHMUS_GO_PEER)")
        started.append(serve(kind, [transport], stubs))
        return started[-1]

    yield run
    for served in started:
        served.close()


def sync_bidi(address: str, pb_grpc: ModuleType, pb: ModuleType, meanwhile: Callable[[], None]) -> None:
    """A Bidi call that exchanges one message, lets `meanwhile` happen, then one more and
    half-closes; raises the call's RpcError if it fails."""
    requests: queue.Queue[Any] = queue.Queue()
    with isthmus.insecure_channel(address) as channel:
        call = pb_grpc.EchoStub(channel).Bidi(blocking(requests), timeout=WATCHDOG)
        try:
            requests.put(pb.EchoRequest(seq=0))
            assert next(call).seq == 0
            meanwhile()
            requests.put(pb.EchoRequest(seq=1))
            assert next(call).seq == 1
            requests.put(None)
            assert list(call) == []
        finally:
            requests.put(None)


def aio_bidi(address: str, pb_grpc: ModuleType, pb: ModuleType, meanwhile: Callable[[], None]) -> None:
    async def run() -> None:
        async with isthmus.aio.insecure_channel(address) as channel:
            call = pb_grpc.EchoStub(channel).Bidi(timeout=WATCHDOG)
            await call.write(pb.EchoRequest(seq=0))
            assert (await call.read()).seq == 0
            await asyncio.to_thread(meanwhile)
            await call.write(pb.EchoRequest(seq=1))
            assert (await call.read()).seq == 1
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF

    asyncio.run(asyncio.wait_for(run(), WATCHDOG))


BIDI = {"sync": sync_bidi, "aio": aio_bidi}


@pytest.mark.parametrize("api", BIDI)
@pytest.mark.parametrize("transport", ["shm", "unix", "http"])
@pytest.mark.parametrize("kind", KINDS)
def test_killed_server_fails_the_call_unavailable(
    kind: str,
    transport: str,
    api: str,
    start: Callable[[str, str], Served],
    pb_grpc: ModuleType,
    pb: ModuleType,
) -> None:
    served = start(kind, transport)
    with pytest.raises(grpc.RpcError) as caught:
        BIDI[api](served.addresses[transport], pb_grpc, pb, served.peer.kill9)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value


@pytest.mark.parametrize("api", BIDI)
@pytest.mark.parametrize("kind", KINDS)
def test_graceful_stop_lets_a_call_finish(
    kind: str, api: str, start: Callable[[str, str], Served], pb_grpc: ModuleType, pb: ModuleType
) -> None:
    served = start(kind, "shm")
    BIDI[api](served.addresses["shm"], pb_grpc, pb, served.peer.terminate)
    served.peer.expect("SHUTDOWN-DONE")
