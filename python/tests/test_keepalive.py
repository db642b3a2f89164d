"""HTTP/2 keepalive from grpcio's channel options (`grpc.keepalive_time_ms`,
`grpc.keepalive_timeout_ms`): a connection that goes silent ends its calls UNAVAILABLE instead of
leaving them to their deadlines. The engine's own test is `tests/tests/suite/rpc_keepalive.rs`."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from concurrent import futures
from typing import Any

import grpc
import grpc.aio
import pytest
import uvloop
from clients import run_on
from peer import ServerBehindSilentProxy, SilentProxy

import isthmus
import isthmus.aio

# A PING after 200 ms of quiet, 500 ms for its answer.
_KEEPALIVE = [("grpc.keepalive_time_ms", 200), ("grpc.keepalive_timeout_ms", 500)]


@pytest.mark.parametrize("kind", ["isthmus", "asyncio", "uvloop"])
def test_keepalive_ends_a_call_on_a_connection_gone_silent_unavailable(kind: str) -> None:
    """grpcio's keepalive options over HTTP/2 (the blocking channel, and isthmus.aio's on
    asyncio's loop and on uvloop): a connection that goes silent (here a proxy that
    stops forwarding and keeps both sockets open, as a hung middlebox or a stopped peer whose
    kernel still acknowledges does) ends a call waiting on it UNAVAILABLE long before its
    deadline, and the channel's next call goes through a new connection. isthmus ignored the
    options: the call waited for its deadline. The server is grpcio's, behind the proxy; its
    handler would wait 30 s. (grpcio's own client, given the same options and also
    `grpc.http2.max_pings_without_data` 0, sent one PING into the silence and then waited for
    the deadline: it is not the reference here.)"""
    served = ServerBehindSilentProxy()
    target = f"127.0.0.1:{served.proxy.port}"

    def blocking() -> tuple[Any, str, bytes]:
        with isthmus.insecure_channel(target, options=_KEEPALIVE) as channel:
            assert channel.unary_unary("/keep.K/Echo")(b"before", timeout=30) == b"before"
            waiting = channel.unary_unary("/keep.K/Wait").future(b"", timeout=60)
            assert served.entered.wait(30)
            served.proxy.frozen = True
            with pytest.raises(grpc.RpcError) as caught:
                waiting.result(timeout=30)
            served.proxy.frozen = False
            after = channel.unary_unary("/keep.K/Echo")(b"after", timeout=30)
            return caught.value.code(), caught.value.details(), after

    async def on_a_loop() -> tuple[Any, str, bytes]:
        async with isthmus.aio.insecure_channel(target, options=_KEEPALIVE) as channel:
            assert await channel.unary_unary("/keep.K/Echo")(b"before", timeout=30) == b"before"
            waiting = asyncio.ensure_future(channel.unary_unary("/keep.K/Wait")(b"", timeout=60))
            assert await asyncio.to_thread(served.entered.wait, 30)
            served.proxy.frozen = True
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await asyncio.wait_for(waiting, 30)
            served.proxy.frozen = False
            after = await channel.unary_unary("/keep.K/Echo")(b"after", timeout=30)
            return caught.value.code(), caught.value.details(), after

    try:
        if kind == "isthmus":
            code, details, after = blocking()
        else:
            outcome: list[tuple[Any, str, bytes]] = []

            async def kept() -> None:
                outcome.append(await on_a_loop())

            run_on(kind, kept)
            code, details, after = outcome[0]
        assert (code, after) == (grpc.StatusCode.UNAVAILABLE, b"after")
        assert "keep-alive" in details, details
    finally:
        served.close()


@pytest.mark.parametrize("kind", ["isthmus", "asyncio", "uvloop"])
def test_a_servers_keepalive_cancels_the_calls_of_a_client_gone_silent(kind: str) -> None:
    """grpcio's keepalive options on an isthmus server (blocking, and isthmus.aio's on
    asyncio's loop and on uvloop): the server PINGs
    a quiet HTTP/2 client, and when the PING goes unanswered it closes the connection and
    cancels the client's calls, so the handler sees `is_active()` go false instead of waiting
    for ever. The client is grpcio's, with no keepalive of its own, behind a proxy that goes
    silent."""
    entered, cancelled = threading.Event(), threading.Event()

    def wait(request: bytes, context: Any) -> bytes:
        entered.set()
        end = time.monotonic() + 60
        while context.is_active() and time.monotonic() < end:
            time.sleep(0.01)
        if not context.is_active():
            cancelled.set()
        return b"not cancelled"

    generic = grpc.method_handlers_generic_handler(
        "keep.S", {"Wait": grpc.unary_unary_rpc_method_handler(wait)}
    )
    pool = futures.ThreadPoolExecutor(4)
    loop = uvloop.new_event_loop() if kind == "uvloop" else asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, daemon=True)
    loop_thread.start()

    async def start_aio() -> tuple[Any, int]:
        s = isthmus.aio.server(pool, options=_KEEPALIVE)
        s.add_generic_rpc_handlers((generic,))
        bound = s.add_insecure_port("127.0.0.1:0")
        await s.start()
        return s, bound

    if kind == "isthmus":
        server: Any = isthmus.server(pool, options=_KEEPALIVE)
        server.add_generic_rpc_handlers((generic,))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
    else:
        server, port = asyncio.run_coroutine_threadsafe(start_aio(), loop).result(30)
    proxy = SilentProxy(("127.0.0.1", port))
    channel = grpc.insecure_channel(f"127.0.0.1:{proxy.port}")
    try:
        waiting = channel.unary_unary("/keep.S/Wait").future(b"", timeout=60)
        assert entered.wait(30)
        proxy.frozen = True
        assert cancelled.wait(30), "the handler of the silent client's call still runs after 30 s"
        waiting.cancel()
    finally:
        channel.close()
        proxy.close()
        if kind == "isthmus":
            server.stop(None)
        else:
            asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(30)
        loop.close()
        pool.shutdown()


@pytest.mark.parametrize("kind", ["grpcio", "isthmus", "asyncio", "uvloop"])
def test_a_server_that_never_answers_fails_the_call_after_the_connect_timeout(kind: str) -> None:
    """`grpc.min_reconnect_backoff_ms`, which grpc-core takes as its minimum connect timeout: a
    server that accepts and never says a word (a listener nobody accepts on: the kernel
    completes the connect) fails a call UNAVAILABLE then, not at its deadline a minute away.
    The same code against grpcio's channel and isthmus's."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        target = f"127.0.0.1:{silent.getsockname()[1]}"
        options = [("grpc.min_reconnect_backoff_ms", 300), ("isthmus.upgrade", False)]
        began = time.monotonic()
        if kind in ("grpcio", "isthmus"):
            make = grpc.insecure_channel if kind == "grpcio" else isthmus.insecure_channel
            with make(target, options=options) as channel, pytest.raises(grpc.RpcError) as caught:
                channel.unary_unary("/any.S/M")(b"x", timeout=60)
            code = caught.value.code()
        else:
            codes: list[grpc.StatusCode] = []

            async def call() -> None:
                async with isthmus.aio.insecure_channel(target, options=options) as channel:
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await channel.unary_unary("/any.S/M")(b"x", timeout=60)
                    codes.append(caught.value.code())

            run_on(kind, call)
            code = codes[0]
        took = time.monotonic() - began
    assert code == grpc.StatusCode.UNAVAILABLE, code
    # Well before the deadline, and before the 20 s default.
    assert took < 10, f"failed after {took:.1f} s"


def _tcp_timers(port: int) -> dict[str, str]:
    """The kernel's timer on each established loopback connection to or from `port`, by end
    (`/proc/net/tcp`'s `tr`): `2` is the keepalive timer, armed on an idle connection only
    where SO_KEEPALIVE is on; `0` is none."""
    timers = {}
    with open("/proc/net/tcp") as table:
        for line in table.read().splitlines()[1:]:
            fields = line.split()
            local, remote, state, timer = fields[1], fields[2], fields[3], fields[5].split(":")[0]
            if state != "01":  # ESTABLISHED
                continue
            if int(local.split(":")[1], 16) == port:
                timers["server"] = str(int(timer, 16))
            elif int(remote.split(":")[1], 16) == port:
                timers["client"] = str(int(timer, 16))
    return timers


def test_tcp_connections_probe_a_silent_peer() -> None:
    """Both ends of an HTTP/2 connection over TCP, the client's and the server's, have TCP
    keepalive on (Go's 15 s, as grpc-go's run with): a peer whose host went away is found out
    in minutes, and its calls end UNAVAILABLE, instead of never. Neither end had it: a call
    with no deadline to a host that lost power waited for ever."""
    server = isthmus.server(futures.ThreadPoolExecutor(2), options=[("isthmus.offer_shm", False)])
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "keep.K", {"Echo": grpc.unary_unary_rpc_method_handler(lambda r, c: r)}
            )
        ]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with isthmus.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert channel.unary_unary("/keep.K/Echo")(b"x", timeout=30) == b"x"
            end = time.monotonic() + 10
            while (timers := _tcp_timers(port)) != {"server": "2", "client": "2"}:
                assert time.monotonic() < end, f"no keepalive timer on an idle connection: {timers}"
                time.sleep(0.05)
    finally:
        server.stop(None)
