"""A channel's connectivity, as grpcio and grpc.aio report it: the same code on a grpc channel
and on isthmus channels (over a Unix socket and over shm://), against a server that is not there
yet, then comes up, then is killed. `grpc.channel_ready_future` and grpc.aio's `channel_ready`
stand on it; isthmus.aio's run under asyncio's own loop and under uvloop."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from clients import run_on
from peer import fresh, grpcio_target, serve

import isthmus
import isthmus.aio

State = grpc.ChannelConnectivity

# (client API, transport)
SYNC = [("grpcio", "unix"), ("isthmus", "unix"), ("isthmus", "shm")]
# (client API, transport, event loop)
AIO = [
    ("grpc.aio", "unix", "asyncio"),
    ("isthmus.aio", "unix", "asyncio"),
    ("isthmus.aio", "shm", "asyncio"),
    ("isthmus.aio", "shm", "uvloop"),
]

#: Generous bounds for what happens "eventually": a state change, a reconnection after backoff.
EVENTUALLY_S = 30.0


def _sync_channel(api: str, address: str) -> Any:
    return (
        grpc.insecure_channel(grpcio_target(address))
        if api == "grpcio"
        else isthmus.insecure_channel(address)
    )


class _Seen:
    """The states a subscription was called back with."""

    def __init__(self) -> None:
        self.states: list[State] = []
        self._changed = threading.Condition()

    def __call__(self, state: State) -> None:
        with self._changed:
            self.states.append(state)
            self._changed.notify_all()

    def wait_for(self, ok: Callable[[list[State]], bool]) -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: ok(self.states), EVENTUALLY_S), self.states


@pytest.mark.parametrize(("api", "transport"), SYNC, ids=["-".join(p) for p in SYNC])
def test_a_subscription_follows_the_server_as_it_comes_and_goes(
    api: str, transport: str, stubs: Path
) -> None:
    address = fresh(transport)
    channel = _sync_channel(api, address)
    seen = _Seen()
    channel.subscribe(seen, try_to_connect=True)
    try:
        seen.wait_for(lambda s: len(s) > 0)
        assert seen.states[0] is State.IDLE
        # Nobody serves the address yet.
        seen.wait_for(lambda s: State.TRANSIENT_FAILURE in s)
        with pytest.raises(grpc.FutureTimeoutError):
            grpc.channel_ready_future(channel).result(timeout=0.3)
        assert State.READY not in seen.states
        served = serve("isthmus", [transport], stubs, targets=[address])
        try:
            grpc.channel_ready_future(channel).result(timeout=EVENTUALLY_S)
            seen.wait_for(lambda s: s[-1] is State.READY)
        finally:
            served.peer.close()
        seen.wait_for(lambda s: s[-1] is not State.READY)
    finally:
        channel.unsubscribe(seen)
        channel.close()


def test_close_ends_calls_in_progress_and_subscriptions(
    servers: Callable[[str], Any], pb_grpc: Any, pb: Any
) -> None:
    """grpcio ends the calls in progress when its channel closes (CANCELLED, "Channel
    closed!") and drops its subscriptions without calling them back."""
    for channel in (
        grpc.insecure_channel(grpcio_target(servers("rust").addresses["unix"])),
        isthmus.insecure_channel(servers("rust").addresses["shm"]),
    ):
        seen = _Seen()
        channel.subscribe(seen)
        stub = pb_grpc.EchoStub(channel)
        assert stub.Unary(pb.EchoRequest(seq=1), timeout=30).seq == 1
        slow = stub.Unary.future(pb.EchoRequest(sleep_ms=20000), timeout=60)
        hold = threading.Event()

        def requests(hold: threading.Event = hold) -> Any:
            yield pb.EchoRequest(seq=2)
            hold.wait(60)

        replies = stub.Bidi(requests(), timeout=60)
        assert next(replies).seq == 2
        # grpcio calls a subscription back from a thread of its own, in its own time.
        seen.wait_for(lambda s: bool(s) and s[-1] is State.READY)
        try:
            channel.close()
            with pytest.raises(grpc.RpcError) as failed:
                slow.result(timeout=EVENTUALLY_S)
            assert failed.value.code() is grpc.StatusCode.CANCELLED, channel
            with pytest.raises(grpc.RpcError) as failed:
                next(replies)
            assert failed.value.code() is grpc.StatusCode.CANCELLED, channel
        finally:
            hold.set()
        assert seen.states[-1] is State.READY  # nothing after the close (SHUTDOWN, say) so far


@pytest.mark.parametrize(("api", "transport", "loop"), AIO, ids=["-".join(p) for p in AIO])
def test_aio_state_and_channel_ready_follow_the_server(
    api: str, transport: str, loop: str, stubs: Path
) -> None:
    address = fresh(transport)

    async def test() -> None:
        if api == "grpc.aio":
            channel: Any = grpc.aio.insecure_channel(grpcio_target(address))
        else:
            channel = isthmus.aio.insecure_channel(address)
        assert channel.get_state() is State.IDLE
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(channel.channel_ready(), 0.3)
        await _until(channel, lambda s: s is State.TRANSIENT_FAILURE)
        served = await asyncio.get_running_loop().run_in_executor(
            None, lambda: serve("isthmus", [transport], stubs, targets=[address])
        )
        try:
            await asyncio.wait_for(channel.channel_ready(), EVENTUALLY_S)
            assert channel.get_state() is State.READY
        finally:
            served.peer.close()
        await _until(channel, lambda s: s is not State.READY)
        await channel.close()
        assert channel.get_state() is State.SHUTDOWN

    run_on(loop, test)


async def _until(channel: Any, ok: Callable[[State], bool]) -> None:
    """Waits through state changes (asking the channel to connect) until `ok(state)`."""
    end = time.monotonic() + EVENTUALLY_S
    state = channel.get_state(try_to_connect=True)
    while not ok(state):
        assert time.monotonic() < end, state
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(channel.wait_for_state_change(state), 1.0)
        state = channel.get_state(try_to_connect=True)


@pytest.mark.parametrize("api", ["grpcio", "isthmus"])
def test_many_unary_futures_wait_together_with_no_thread_each(
    api: str, servers: Callable[[str], Any], pb_grpc: Any, pb: Any
) -> None:
    """grpcio's `.future()` calls all wait in its core at once; isthmus's wait on one completion
    thread, not on a pool of a few threads that would run them a handful at a time."""
    address = servers("rust").addresses["unix" if api == "grpcio" else "shm"]
    channel = _sync_channel(api, address)
    try:
        stub = pb_grpc.EchoStub(channel)
        threads_before = threading.active_count()
        start = time.monotonic()
        futures = [stub.Unary.future(pb.EchoRequest(seq=i, sleep_ms=500), timeout=60) for i in range(300)]
        # All 300 sleep in the server at once: no thread on this side per call.
        assert threading.active_count() <= threads_before + 4
        assert [f.result(timeout=60).seq for f in futures] == list(range(300))
        # Run six at a time (a default pool on two cores), they would take 25 s.
        assert time.monotonic() - start < 15
        assert futures[0].code() is grpc.StatusCode.OK
        cancelled = stub.Unary.future(pb.EchoRequest(sleep_ms=30000), timeout=60)
        assert cancelled.cancel() and cancelled.cancelled()
        with pytest.raises(grpc.FutureCancelledError):
            cancelled.result()
    finally:
        channel.close()


@pytest.mark.parametrize(("api", "transport"), SYNC, ids=["-".join(p) for p in SYNC])
def test_a_handshake_slower_than_the_first_calls_deadline_still_connects_the_channel(
    api: str, transport: str, stubs: Path
) -> None:
    """A stopped server answers a new connection's handshake only once it goes on, after the
    first call's deadline: that call fails DEADLINE_EXCEEDED, and the attempt it began goes on
    and connects the channel, as grpcio's does. isthmus's ended with the call, so a channel
    whose calls all had less time than a handshake never connected."""
    served = serve("rust", [transport], stubs)
    channel = _sync_channel(api, served.addresses[transport])
    seen = _Seen()
    try:
        served.peer.stop()
        echo = channel.unary_unary("/conformance.Echo/Unary")
        with pytest.raises(grpc.RpcError) as failed:
            echo(b"", timeout=0.3)
        assert failed.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED, failed.value
        channel.subscribe(seen)  # looks, without asking for a connection
        served.peer.resume()
        seen.wait_for(lambda s: bool(s) and s[-1] is State.READY)
        assert isinstance(echo(b"", timeout=EVENTUALLY_S), bytes)  # answered
    finally:
        channel.unsubscribe(seen)
        channel.close()
        served.peer.resume()
        served.close()
