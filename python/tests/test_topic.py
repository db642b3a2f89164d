"""isthmus.Topic: one publish reaches every subscriber of a Python server (blocking and asyncio)
in order, over shm, unix and http at once; a stalled subscriber meets the topic's policy while
the others keep up; a subscriber killed with SIGKILL leaves at once. The server and some
subscribers are processes of their own (`topic_server.py`, `topic_subscriber.py`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from peer import PATIENCE, Peer, Served, fresh

import isthmus
import isthmus.aio

TESTS = Path(__file__).resolve().parent


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), STUBS[0], e.get("PYTHONPATH")]))
    return e


STUBS: list[str] = [""]


@pytest.fixture(autouse=True)
def _stubs(stubs: Path) -> None:
    # echo_server, whose helpers topic_server uses, imports the conformance stubs.
    STUBS[0] = str(stubs)


def serve_topic(kind: str, capacity: int, slow: str) -> Served:
    transports = ["shm", "unix", "http"]
    targets = [fresh(t) for t in transports]
    flags = ["--aio"] if kind == "aio" else []
    argv = [sys.executable, "-m", "topic_server", *flags, str(capacity), slow, *targets]
    served = Served("topic", Peer(argv, env()))
    for transport, target in zip(transports, targets, strict=True):
        served.addresses[transport] = (
            target if transport == "shm" else served.peer.expect("LISTENING ").removeprefix("LISTENING ")
        )
    return served


@pytest.fixture(params=["sync", "aio"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class Feed:
    """The control side of a topic server."""

    def __init__(self, served: Served) -> None:
        self.channel = isthmus.insecure_channel(served.addresses["shm"])

    def publish(self, count: int, size: int, state: bool = False) -> int:
        request = b"".join(n.to_bytes(8, "little") for n in (count, size, int(state)))
        return int.from_bytes(self.channel.unary_unary("/topic.Feed/Publish")(request), "little")

    def stats(self) -> dict[str, int]:
        stats: dict[str, int] = json.loads(self.channel.unary_unary("/topic.Feed/Stats")(b""))
        return stats

    def wait_subscribers(self, n: int) -> None:
        """A watchdog, not a timer: until the topic counts `n` subscribers."""
        end = time.monotonic() + PATIENCE
        while self.stats()["subscribers"] != n:
            assert time.monotonic() < end, f"never {n} subscribers: {self.stats()}"
            time.sleep(0.01)

    def close(self) -> None:
        self.channel.unary_unary("/topic.Feed/Close")(b"")
        self.channel.close()


def check(message: bytes, seq: int) -> None:
    assert int.from_bytes(message[:8], "little") == seq
    assert message[8:] == bytes([seq % 251]) * (len(message) - 8)


def reader(address: str, into: list[bytes], done: threading.Event) -> Callable[[], None]:
    def run() -> None:
        with isthmus.insecure_channel(address) as channel:
            try:
                for m in channel.unary_stream("/topic.Feed/Watch")(b""):
                    into.append(m)
            finally:
                done.set()

    return run


def test_every_subscriber_gets_every_message_in_order_over_every_transport(kind: str) -> None:
    served = serve_topic(kind, 64, "drop_oldest")
    feed = Feed(served)
    others: list[Peer] = []
    try:
        # A late joiner's first message is the state.
        feed.publish(1, 100, state=True)
        received: dict[str, list[bytes]] = {t: [] for t in served.addresses}
        done = {t: threading.Event() for t in served.addresses}
        threads = [
            threading.Thread(target=reader(served.addresses[t], received[t], done[t])) for t in received
        ]
        for t in threads:
            t.start()
        others = [
            Peer([sys.executable, "-m", "topic_subscriber", served.addresses["shm"], "41"], env())
            for _ in range(2)
        ]
        feed.wait_subscribers(5)
        # Large ones through shared memory, small ones inline.
        for _ in range(10):
            assert feed.publish(3, 200_000) == 5
            assert feed.publish(1, 1000) == 5
        for p in others:
            for seq in range(1, 42):
                assert p.expect("GOT ") == f"GOT {seq}"
            p.expect("END OK")
        feed.close()
        for t in threads:
            t.join(PATIENCE)
        for transport, messages in received.items():
            assert len(messages) == 41, transport
            for seq, m in enumerate(messages, 1):
                check(m, seq)
        stats = Feed(served).stats()
        assert stats["published"] == 41 and stats["dropped"] == 0, stats
    finally:
        for p in others:
            p.close()
        served.close()


@pytest.mark.parametrize("slow", ["drop_oldest", "cancel"])
def test_a_stalled_subscriber_meets_the_policy_and_the_others_keep_up(kind: str, slow: str) -> None:
    served = serve_topic(kind, 4, slow)
    feed = Feed(served)
    try:
        with isthmus.insecure_channel(served.addresses["shm"]) as stalled_channel:
            stalled = stalled_channel.unary_stream("/topic.Feed/Watch")(b"")
            fast: list[bytes] = []
            done = threading.Event()
            threading.Thread(target=reader(served.addresses["unix"], fast, done)).start()
            feed.wait_subscribers(2)
            # 60 MB: far past the stalled call's flow-control window and its queue of 4.
            for _ in range(60):
                feed.publish(1, 1_000_000)
                while len(fast) < feed.stats()["published"]:  # the fast one keeps pace
                    assert not done.is_set(), "the fast subscriber ended"
                    time.sleep(0.001)
            stats = feed.stats()
            if slow == "drop_oldest":
                assert stats["dropped"] > 0 and stats["cancelled"] == 0, stats
                # What was sent before the stall (the flow-control window), then the gap, then
                # the newest messages that were kept.
                seqs: list[int] = []
                for m in stalled:
                    if m.startswith(b"GAP "):
                        break
                    seqs.append(int.from_bytes(m[:8], "little"))
                    check(m, seqs[-1])
                assert seqs == list(range(1, len(seqs) + 1))
                # The gap covers every message not delivered (the queue went with it: the
                # resync replaces it); the next one published comes after it.
                assert int(m.removeprefix(b"GAP ")) == 60 - len(seqs)
                feed.publish(1, 1000)
                check(next(stalled), 61)
            else:
                assert stats["cancelled"] == 1 and stats["subscribers"] == 1, stats
                with pytest.raises(grpc.RpcError) as e:
                    for _ in stalled:
                        pass
                assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
                assert "fell 4 messages behind" in str(e.value.details())
            stalled.cancel()
        feed.close()
        done.wait(PATIENCE)
        for seq, m in enumerate(fast, 1):
            check(m, seq)
        assert len(fast) == (61 if slow == "drop_oldest" else 60)
    finally:
        served.close()


def test_a_subscriber_killed_with_sigkill_leaves_at_once(kind: str) -> None:
    served = serve_topic(kind, 64, "drop_oldest")
    feed = Feed(served)
    victims = [
        Peer([sys.executable, "-m", "topic_subscriber", served.addresses[t], "1000"], env())
        for t in ("shm", "unix")
    ]
    try:
        feed.wait_subscribers(2)
        feed.publish(5, 100_000)
        for v in victims:
            v.expect("GOT 5")
            v.kill9()
        feed.wait_subscribers(0)
        assert feed.publish(1, 100_000) == 0
    finally:
        for v in victims:
            v.close()
        feed.close()
        served.close()


def test_topic_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="drop_oldest"):
        isthmus.Topic("t", slow="sometimes")
    with pytest.raises(ValueError, match="capacity"):
        isthmus.Topic("t", capacity=0)
    topic = isthmus.Topic("t")
    with pytest.raises(TypeError):
        topic.publish(object())
    with pytest.raises(TypeError, match="isthmus servers"):
        topic.subscribe(object())  # type: ignore[arg-type]
    assert topic.publish(b"nobody listens") == 0
    assert topic.stats().published == 1


def test_the_state_and_the_current_state_as_rust_c_and_go_give_them() -> None:
    """A Python `on_gap` can resync with the topic's own current state, as C and Go do: Python
    had no way to read it, and a state the user kept could be an old one."""
    topic = isthmus.Topic("t")
    assert (topic.state(), topic.current_state()) == (None, None)
    topic.publish_state(b"v1")
    assert (topic.state(), topic.current_state()) == (b"v1", b"v1")
    topic.publish(b"a delta after it")
    assert (topic.state(), topic.current_state()) == (b"v1", None), "v1 is no longer current"
    topic.publish_state(b"v2")
    assert topic.current_state() == b"v2"
    topic.clear_state()
    assert (topic.state(), topic.current_state()) == (None, None)


@contextlib.asynccontextmanager
async def _aio_feed(watch: Callable[..., Any], *server: Any) -> AsyncIterator[grpc.aio.Channel]:
    """An `isthmus.aio` server (made with `server`) of `watch` as `/t.Feed/Watch`, and a channel
    to it."""
    address = fresh("shm")
    serving = isthmus.aio.server(*server)
    watching = {"Watch": grpc.unary_stream_rpc_method_handler(watch)}
    serving.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Feed", watching),))
    serving.add_insecure_port(address)
    await serving.start()
    try:
        async with isthmus.aio.insecure_channel(address) as channel:
            yield channel
    finally:
        await serving.stop(None)


async def _subscribed(topic: isthmus.Topic) -> None:
    """Until `topic` has a subscriber (at most PATIENCE)."""
    end = time.monotonic() + PATIENCE
    while topic.stats().subscribers == 0 and time.monotonic() < end:
        await asyncio.sleep(0.01)


def test_an_asyncio_subscription_cancelled_by_its_handler_stops_sending() -> None:
    """A handler that gives up on one topic (`asyncio.wait_for` ran out) and serves another:
    the first's messages no longer reach its client. The cancelled subscription went on
    sending on the call, so the two topics' messages mixed on one stream."""
    first, second = isthmus.Topic("first"), isthmus.Topic("second")

    async def watch(request: bytes, context: grpc.aio.ServicerContext) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(first.subscribe_async(context), 0.2)
        await second.subscribe_async(context)

    async def run() -> list[bytes]:
        async with _aio_feed(watch) as channel:
            call = channel.unary_stream("/t.Feed/Watch")(b"", timeout=30)
            await _subscribed(second)
            assert first.stats().subscribers == 0, "the cancelled subscription left its topic"
            first.publish(b"from the first")
            second.publish(b"from the second")
            got = [await call.read()]
            call.cancel()
            return got

    assert asyncio.run(run()) == [b"from the second"]


def test_the_blocking_subscribe_refuses_an_asyncio_handlers_context() -> None:
    """`subscribe` (the blocking one) given an `isthmus.aio` handler's context took it, and
    blocked that server's event loop, and every call on it, for the whole subscription."""
    topic = isthmus.Topic("feed")
    refused: list[str] = []

    async def watch(request: bytes, context: grpc.aio.ServicerContext) -> None:
        try:
            topic.subscribe(context)
        except TypeError as e:
            refused.append(str(e))

    async def run() -> list[bytes]:
        async with _aio_feed(watch) as channel:
            return [m async for m in channel.unary_stream("/t.Feed/Watch")(b"", timeout=30)]

    assert asyncio.run(run()) == []
    assert len(refused) == 1 and "subscribe_async" in refused[0], refused
    assert topic.stats().subscribers == 0


def test_a_plain_handler_on_the_asyncio_server_subscribes() -> None:
    """A plain (def) handler on `isthmus.aio.server` serves a topic with `subscribe`, as on the
    blocking server: the subscription runs on the server's loop while the handler's thread
    waits. It raised "this context is not one" of an isthmus server's, which it is."""
    topic = isthmus.Topic("feed")

    def watch(request: bytes, context: grpc.ServicerContext) -> Any:
        return topic.subscribe(context)

    async def run() -> list[bytes]:
        async with _aio_feed(watch, futures.ThreadPoolExecutor(2)) as channel:
            call = channel.unary_stream("/t.Feed/Watch")(b"", timeout=30)
            await _subscribed(topic)
            topic.publish(b"one")
            topic.publish(b"two")
            got = [await call.read(), await call.read()]
            topic.close()
            assert await call.read() == grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK
            return got

    assert asyncio.run(run()) == [b"one", b"two"]
    assert topic.stats().subscribers == 0


def test_a_graceful_stop_ends_each_subscription_after_its_queue(kind: str) -> None:
    """A subscription never ends on its own: `stop(grace)` waited out its whole grace for every
    subscriber. Now the stop ends each subscription UNAVAILABLE (the code that sends a client
    elsewhere) once what was published before it is sent, and the server is done."""
    # Here, not at the top: it imports the conformance stubs, on the path once `_stubs` ran.
    import topic_server  # noqa: PLC0415

    topic = isthmus.Topic("feed")
    targets = [fresh("shm"), fresh("unix")]

    def subscribe() -> list[Peer]:
        subs = [Peer([sys.executable, "-m", "topic_subscriber", t, "1000"], env()) for t in targets]
        end = time.monotonic() + PATIENCE
        while topic.stats().subscribers != 2:
            assert time.monotonic() < end, f"never 2 subscribers: {topic.stats()}"
            time.sleep(0.01)
        for seq in (1, 2, 3):
            assert topic.publish(topic_server.message(seq, 100_000 if seq == 2 else 100)) == 2
        return subs

    if kind == "sync":
        handlers = [topic_server.handlers(topic, False)]
        server = isthmus.server(futures.ThreadPoolExecutor(max_workers=4), handlers=handlers)
        for t in targets:
            server.add_insecure_port(t)
        server.start()
        subs = subscribe()
        assert server.stop(600).wait(PATIENCE), "the stop is still waiting for its subscribers"
    else:

        async def run() -> list[Peer]:
            server = isthmus.aio.server()
            server.add_generic_rpc_handlers((topic_server.handlers(topic, True),))
            for t in targets:
                server.add_insecure_port(t)
            await server.start()
            subs = await asyncio.to_thread(subscribe)  # the loop serves meanwhile
            await asyncio.wait_for(server.stop(600), PATIENCE)
            return subs

        subs = asyncio.run(run())
    try:
        for sub in subs:
            for seq in (1, 2, 3):
                assert sub.expect("GOT") == f"GOT {seq}"
            assert sub.expect("END") == "END UNAVAILABLE"
        assert topic.stats().subscribers == 0
    finally:
        for sub in subs:
            sub.close()


def test_a_message_over_the_servers_send_limit_ends_its_subscriber(kind: str) -> None:
    """The server's `grpc.max_send_message_length` reaches the messages the library sends a
    topic's subscribers, as it does a handler's own sends: a larger one ends the subscriber's
    call RESOURCE_EXHAUSTED with the size and the limit. The limited server sent it before."""
    topic = isthmus.Topic("limited")
    address, options = fresh("shm"), [("grpc.max_send_message_length", 64)]
    large = b"x" * 1000

    def watch_sync(request: bytes, context: grpc.ServicerContext) -> Any:
        return topic.subscribe(context)

    async def watch_aio(request: bytes, context: grpc.aio.ServicerContext) -> None:
        await topic.subscribe_async(context)

    def publish_when_subscribed() -> list[int]:
        end = time.monotonic() + PATIENCE
        while topic.stats().subscribers == 0:
            assert time.monotonic() < end, "never subscribed"
            time.sleep(0.01)
        return [topic.publish(b"small"), topic.publish(large)]

    def generic(watch: Any) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            "t.Feed", {"Watch": grpc.unary_stream_rpc_method_handler(watch)}
        )

    got: list[bytes] = []
    if kind == "sync":
        server = isthmus.server(
            futures.ThreadPoolExecutor(2), handlers=(generic(watch_sync),), options=options
        )
        server.add_insecure_port(address)
        server.start()
        try:
            with isthmus.insecure_channel(address) as channel:
                stream = channel.unary_stream("/t.Feed/Watch")(b"", timeout=PATIENCE)
                reached = publish_when_subscribed()
                with pytest.raises(grpc.RpcError) as failed:
                    got.extend(stream)
                error = failed.value
        finally:
            server.stop(None)
    else:

        async def run() -> tuple[list[int], grpc.aio.AioRpcError]:
            server = isthmus.aio.server(handlers=(generic(watch_aio),), options=options)
            server.add_insecure_port(address)
            await server.start()
            try:
                async with isthmus.aio.insecure_channel(address) as channel:
                    stream = channel.unary_stream("/t.Feed/Watch")(b"", timeout=PATIENCE)
                    reached = await asyncio.get_running_loop().run_in_executor(None, publish_when_subscribed)
                    with pytest.raises(grpc.aio.AioRpcError) as failed:
                        async for m in stream:
                            got.append(m)
                    return reached, failed.value
            finally:
                await server.stop(None)

        reached, error = asyncio.run(run())
    assert reached == [1, 0], "the large message reached nobody"
    assert got == [b"small"]
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    assert f"({len(large)} vs. 64)" in (error.details() or ""), error.details()
    assert topic.stats().subscribers == 0
