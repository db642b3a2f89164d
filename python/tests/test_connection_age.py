"""A server's maximum connection age from grpcio's options (`grpc.max_connection_age_ms`,
`grpc.max_connection_age_grace_ms`): an HTTP/2 connection that old gets a GOAWAY, its client
moves its next calls to a new connection without one failing, and once the grace is over the
calls still on it end UNAVAILABLE. The same code runs against grpcio's server and isthmus's
(blocking and asyncio), with grpcio's client and isthmus's. The engine's own test is
`tests/tests/suite/rpc_connection_age.rs`."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent import futures
from typing import Any

import grpc
import pytest

import isthmus
import isthmus.aio

SERVERS = ["grpcio", "isthmus", "isthmus.aio"]


class Served:
    """A server of kind `kind` on a fresh TCP port with `options`: `/age.A/Peer` answers the
    caller's address (`context.peer()`; over TCP its port names the connection) and
    `/age.A/Wait` waits up to 60 s for its call to be cancelled."""

    def __init__(self, kind: str, options: list[tuple[str, Any]]) -> None:
        self.kind = kind
        self.peers: set[str] = set()
        self.entered, self.cancelled = threading.Event(), threading.Event()

        def peer(request: bytes, context: Any) -> bytes:
            self.peers.add(context.peer())
            return context.peer().encode()

        def wait(request: bytes, context: Any) -> bytes:
            self.entered.set()
            end = time.monotonic() + 60
            while context.is_active() and time.monotonic() < end:
                time.sleep(0.01)
            if not context.is_active():
                self.cancelled.set()
            return b"not cancelled"

        generic = grpc.method_handlers_generic_handler(
            "age.A",
            {
                "Peer": grpc.unary_unary_rpc_method_handler(peer),
                "Wait": grpc.unary_unary_rpc_method_handler(wait),
            },
        )
        self.pool = futures.ThreadPoolExecutor(4)
        self.loop: asyncio.AbstractEventLoop | None = None
        if kind == "isthmus.aio":
            self.loop = asyncio.new_event_loop()
            self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
            self.thread.start()

            async def start() -> tuple[Any, int]:
                s = isthmus.aio.server(self.pool, options=options)
                s.add_generic_rpc_handlers((generic,))
                bound = s.add_insecure_port("127.0.0.1:0")
                await s.start()
                return s, bound

            self.server, self.port = asyncio.run_coroutine_threadsafe(start(), self.loop).result(30)
        else:
            make = grpc.server if kind == "grpcio" else isthmus.server
            self.server = make(self.pool, options=options)
            self.server.add_generic_rpc_handlers((generic,))
            self.port = self.server.add_insecure_port("127.0.0.1:0")
            self.server.start()

    def close(self) -> None:
        if self.loop is not None:
            asyncio.run_coroutine_threadsafe(self.server.stop(None), self.loop).result(30)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)
            self.loop.close()
        else:
            self.server.stop(None)
        self.pool.shutdown()


def _channel(client: str, port: int) -> Any:
    """grpcio's channel, or isthmus's kept on HTTP/2 (an isthmus server offers shm://)."""
    if client == "grpcio":
        return grpc.insecure_channel(f"127.0.0.1:{port}")
    return isthmus.insecure_channel(f"127.0.0.1:{port}", options=[("isthmus.upgrade", False)])


@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.parametrize("age_ms", [300, None])
def test_a_connection_past_its_maximum_age_is_replaced_and_no_call_fails(
    server: str, age_ms: int | None
) -> None:
    """At 300 ms a connection gets its GOAWAY: 1.5 s of calls come on several connections, and
    none fails. Without the option (the control) they all come on one."""
    options = [] if age_ms is None else [("grpc.max_connection_age_ms", age_ms)]
    served = Served(server, options)
    try:
        for client in ["grpcio", "isthmus"]:
            served.peers.clear()
            with _channel(client, served.port) as channel:
                call = channel.unary_unary("/age.A/Peer")
                end = time.monotonic() + 1.5
                while time.monotonic() < end:
                    call(b"", timeout=30)
                    time.sleep(0.005)
            if age_ms is None:
                assert len(served.peers) == 1, (client, served.peers)
            else:
                assert len(served.peers) >= 2, (client, served.peers)
    finally:
        served.close()


@pytest.mark.parametrize("server", SERVERS)
def test_the_grace_ends_a_call_still_on_an_aged_connection_unavailable(server: str) -> None:
    """Age 200 ms, grace 300 ms: a call whose handler would wait a minute ends UNAVAILABLE
    after about half a second, and the handler sees it cancelled."""
    options = [("grpc.max_connection_age_ms", 200), ("grpc.max_connection_age_grace_ms", 300)]
    served = Served(server, options)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{served.port}") as channel:
            with pytest.raises(grpc.RpcError) as caught:
                channel.unary_unary("/age.A/Wait")(b"", timeout=60)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE, caught.value
        assert served.cancelled.wait(30), "the handler still runs 30 s after its call was cut off"
    finally:
        served.close()


@pytest.mark.parametrize("server", ["grpcio", "isthmus"])
def test_calls_that_race_a_goaway_go_again_and_none_fails(server: str) -> None:
    """A GOAWAY every 50 ms for 3 s: some calls start just as their connection closes, before
    it sent them (grpcio's client retries such a call transparently, since the server never saw
    it). isthmus's client failed about one in ten of these moments UNAVAILABLE ("operation was
    canceled: connection closed"): this test failed in every run against grpcio's server, and
    in some against isthmus's. Now it sends them again, and no call fails."""
    served = Served(server, [("grpc.max_connection_age_ms", 50)])
    try:
        with _channel("isthmus", served.port) as channel:
            call = channel.unary_unary("/age.A/Peer")
            end = time.monotonic() + 3
            while time.monotonic() < end:
                call(b"", timeout=30)
        assert len(served.peers) >= 10, served.peers
    finally:
        served.close()
