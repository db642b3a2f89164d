"""Push to many subscribers: `isthmus.Topic`, served from ordinary response-streaming handlers.

    catalog = isthmus.Topic("catalog")

    class Sidecar(sidecar_pb2_grpc.SidecarServicer):
        def WatchCatalog(self, request, context):
            return catalog.subscribe(context)  # blocks until the client leaves

    catalog.publish_state(sidecar_pb2.CatalogUpdate(version=2, tools=[...]))

`publish` serialises the message once; over `shm://` it is written once into shared memory and
every subscriber's call carries a reference to that block, sent without Python running per
message. Each subscriber has a bounded queue (`capacity`); one that falls behind loses its
oldest messages (`slow="drop_oldest"`, and `on_gap(n)` may return a message to send instead,
a full resync say) or is ended with RESOURCE_EXHAUSTED (`slow="cancel"`). `publish_state` also
keeps the message for subscribers that join later. A subscriber whose client cancels or goes
away leaves at once.

On `isthmus.server` each subscriber holds one of the executor's threads while it is subscribed
(asleep, GIL released), as a streaming handler does on grpcio: size the executor for the
subscribers you expect. On `isthmus.aio.server` a subscriber holds no thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from . import _native
from ._errors import status_code

OnGap = Callable[[int], Any]


@dataclass(frozen=True)
class TopicStats:
    """A topic's counters."""

    subscribers: int
    """Subscribers now."""
    published: int
    """Messages published."""
    bytes: int
    """Payload bytes published, each message counted once."""
    delivered: int
    """Messages sent to subscribers (one per subscriber reached)."""
    dropped: int
    """Messages dropped from full queues (`slow="drop_oldest"`)."""
    cancelled: int
    """Subscribers ended for falling behind (`slow="cancel"`)."""


def _payload(message: Any) -> Any:
    """A protobuf message serialised once; anything else must be a buffer (bytes, numpy...)."""
    serialize = getattr(message, "SerializeToString", None)
    return serialize() if serialize is not None else message


def _gap(on_gap: OnGap | None) -> Callable[[int], Any] | None:
    if on_gap is None:
        return None
    return lambda n: None if (resync := on_gap(n)) is None else _payload(resync)


class Topic:
    """A stream of messages that response-streaming handlers subscribe their calls to.

    `capacity` messages wait per subscriber before `slow` applies: `"drop_oldest"` (the
    default) or `"cancel"`. Thread-safe; publish from any thread.
    """

    def __init__(self, name: str, *, capacity: int = 64, slow: str = "drop_oldest") -> None:
        self._native = _native.Topic(name, capacity, slow)

    @property
    def name(self) -> str:
        return self._native.name

    def publish(self, message: Any) -> int:
        """Sends `message` (a protobuf message, or any bytes-like buffer) to every current
        subscriber; returns how many. Never waits for a subscriber."""
        return self._native.publish(_payload(message))

    def publish_state(self, message: Any) -> int:
        """`publish`, and keep `message` as the current state, sent first to every later
        subscriber."""
        return self._native.publish_state(_payload(message))

    def state(self) -> bytes | None:
        """The state `publish_state` kept (serialised), or None."""
        return self._native.state()

    def current_state(self) -> bytes | None:
        """The state, or None if a plain `publish` came after it: what an `on_gap` resync
        should send. An older state sent in place of later messages would take a subscriber
        back past what it may have had already."""
        return self._native.current_state()

    def clear_state(self) -> None:
        """Later subscribers start with the next message."""
        self._native.clear_state()

    def close(self) -> None:
        """Ends every subscription with OK once it has sent what it has queued."""
        self._native.close()

    def stats(self) -> TopicStats:
        return TopicStats(**self._native.stats())

    def subscribe(self, context: grpc.ServicerContext, on_gap: OnGap | None = None) -> Iterator[Any]:
        """Serves this topic on the call of `context` (an `isthmus.server` handler's) until the
        client leaves or the topic closes, and then returns an empty iterator, so a
        response-streaming handler can `return topic.subscribe(context)`. Without `on_gap`,
        messages dropped for a slow subscriber are only counted (`stats().dropped`). With it,
        `on_gap(n)` is asked after such a drop (`n` counts the dropped messages and those still
        queued) and may return a message to send in place of them all: a resync, best a full
        state with a version, since messages published meanwhile follow it; if it returns None
        the queued ones are still sent. A subscriber cancelled for falling behind ends
        RESOURCE_EXHAUSTED at once; a server's `stop(grace)` ends each subscription UNAVAILABLE
        once what was queued for it is sent, and does not wait for subscribers."""
        if getattr(context, "_driver", None) is not None:
            # It would block the handler's event loop, and every call on it, for the whole
            # subscription.
            raise TypeError("an isthmus.aio handler subscribes with `await topic.subscribe_async(context)`")
        inner = getattr(context, "_context", None)
        if getattr(inner, "_driver", None) is not None:
            # A plain handler on isthmus.aio.server: the subscription runs on the server's loop,
            # and this, the handler's thread, waits for its end, as on the blocking server.
            context._wait(self.subscribe_async(inner, on_gap))
            return iter(())
        call = _call_of(context)
        try:
            call.serve_topic(self._native, _gap(on_gap), _max_send(context))
        except _native.CallError as e:
            _end(context, e)
        return iter(())

    async def subscribe_async(self, context: grpc.aio.ServicerContext, on_gap: OnGap | None = None) -> None:
        """`subscribe` for an `isthmus.aio.server` handler: `await topic.subscribe_async(context)`."""
        call = _call_of(context)
        driver = getattr(context, "_driver", None)
        if driver is None:
            raise TypeError("subscribe_async needs the context of an isthmus.aio server's handler")
        token, future = driver.begin(context._loop)
        try:
            call.serve_topic_async(driver.reactor, token, self._native, _gap(on_gap), _max_send(context))
            outcome = await future
        except BaseException:
            # Cancelled (`asyncio.wait_for`, the handler's task): the subscription ends here,
            # as every other asyncio operation's; it went on sending on the call.
            driver.abandon(token)
            raise
        if isinstance(outcome, _native.CallError) and not context.done():
            await context.abort(status_code(outcome.code), outcome.details)

    def __repr__(self) -> str:
        return f"Topic({self.name!r}, {self.stats()})"


def _call_of(context: Any) -> _native.ServerCall:
    call = getattr(context, "_call", None)
    if not isinstance(call, _native.ServerCall):
        raise TypeError("a Topic serves the calls of isthmus servers; this context is not one")
    return call


def _max_send(context: Any) -> int | None:
    """The server's `grpc.max_send_message_length`, which its handler's context keeps (one
    `_call_of` took)."""
    limit: int | None = context._max_send
    return limit


def _end(context: grpc.ServicerContext, error: _native.CallError) -> None:
    # Still active: the topic ended this subscriber (it fell behind). Otherwise the call ended
    # under it (the client left), and there is nobody to tell.
    if context.is_active():
        context.abort(status_code(error.code), error.details)
