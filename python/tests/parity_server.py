"""A server for the parity tests (`test_grpc_parity.py`): `parity_server.py API [--intercepted]
[--health-last] [--send-limit] [--receive-limit] TARGET…` with API `grpcio`, `grpc.aio`,
`isthmus` or `isthmus-aio` (`--send-limit`: the server's `grpc.max_send_message_length` is 100
bytes; `--receive-limit`: its `grpc.max_receive_message_length` is 1000 bytes). It prints READY, then
LISTENING <address> for each HTTP/2 target, and serves until killed. An asyncio server runs on
the loop `PEER_LOOP` names (`asyncio`, the default, or `uvloop`; see `peer.run_loop`). It serves:

- the application's own `grpc.health.v1.Health` servicer: Check answers SERVING for "" and
  NOT_SERVING for "custom", and fails NOT_FOUND "no such service: NAME" for any other name
  (grpcio-health-checking's servicer answers so); added before the ports are, or after them
  (before `start`) with `--health-last`;
- `/parity.Slow/Wait` (asyncio servers): prints HANDLER-STARTED <loop's module> as its handler
  starts, then waits a minute; when the call ends first and its task is cancelled, it prints
  HANDLER-CANCELLED;
- `/parity.Meta/…` (blocking servers), on bytes, for the client interceptor tests: every method
  sends the call's `x-…` metadata back in its initial metadata and its trailers, so that what an
  interceptor added shows on each shape. `Unary` echoes the request, `ServerStream` answers it
  three times (`REQUEST-0`, `-1`, `-2`), `ClientStream` joins the requests with `+`, `Bidi`
  echoes each; `TimeLeft` answers the seconds the deadline leaves (`none` without one); `Fail`
  fails PERMISSION_DENIED with the request as the details;
- `/parity.Plain/…` (asyncio servers), on bytes, plain (non-async) handlers: `Abort` aborts
  PERMISSION_DENIED "plain abort" (and would answer `after abort`); `Code` sets NOT_FOUND
  "plain code" and answers; `Info` sends `x-…` metadata back in its initial metadata and
  trailers and answers whether the deadline is within two minutes and whether it runs on the
  loop's thread; `Stream` yields `a`, `b`, then sets OUT_OF_RANGE "plain stream"; `Join` joins
  the requests of its (blocking) iterator with `+`; `Echo` streams each request back;
- `/parity.Duplex/Talk` (every server), on bytes: one thread (task) reads the requests while the
  handler sends `first-0`, `first-1`, `first-2` at once, before any request has come; then it
  sends the requests joined with `+`. A server whose reads hold up its writes never answers;
- with `--intercepted`, `/parity.Guarded/…` (every server), on bytes, behind two server
  interceptors (`grpc.ServerInterceptor`s, or `grpc.aio.ServerInterceptor`s for the asyncio
  servers): the first records each call's method and `x-who` metadata and passes it on; the
  second answers `Denied` with a handler of its own that aborts PERMISSION_DENIED "denied by the
  interceptor", hides `Hidden` (no handler), and wraps `Shout`'s handler so that its reply is
  upper-cased. The methods themselves: `Echo`, `Shout` and `Twice` (streamed twice) echo the
  request, `Denied` and `Hidden` answer `not denied` and `not hidden` (what a server that skips
  its interceptors would send), and `Seen` answers the recorded calls of /parity.Guarded, one a
  line, and forgets them. `RawShout` is a raw handler (`isthmus.raw`) wrapped as `Shout` is: it
  echoes the request, and names its type in the trailer `x-request` (`bytes` from grpc's
  servers, `Message` from isthmus's, whose wrapper is then raw too)."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from typing import Any

import grpc
import grpc.aio
from peer import run_loop

import isthmus
import isthmus.aio

SERVICE = "grpc.health.v1.Health"
# `grpc.max_send_message_length` with `--send-limit`.
SEND_LIMIT = 100
# `grpc.max_receive_message_length` with `--receive-limit`.
RECEIVE_LIMIT = 1000


def _name(request: bytes) -> str:
    """The `service` field (1) of a HealthCheckRequest, for the short names this test sends."""
    if not request:
        return ""
    assert request[0] == 0x0A and request[1] < 0x80, request
    return request[2 : 2 + request[1]].decode()


def check(request: bytes, context: Any) -> bytes:
    name = _name(request)
    statuses = {"": 1, "custom": 2}  # SERVING, NOT_SERVING
    if name not in statuses:
        context.abort(grpc.StatusCode.NOT_FOUND, f"no such service: {name}")
    return bytes([0x08, statuses[name]])


async def check_async(request: bytes, context: Any) -> bytes:
    name = _name(request)
    statuses = {"": 1, "custom": 2}
    if name not in statuses:
        await context.abort(grpc.StatusCode.NOT_FOUND, f"no such service: {name}")
    return bytes([0x08, statuses[name]])


async def wait(request: bytes, context: Any) -> bytes:
    print("HANDLER-STARTED", type(asyncio.get_running_loop()).__module__, flush=True)
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        print("HANDLER-CANCELLED", flush=True)
        raise
    return b""


def plain_abort(request: bytes, context: Any) -> bytes:
    context.abort(grpc.StatusCode.PERMISSION_DENIED, "plain abort")
    return b"after abort"


def plain_code(request: bytes, context: Any) -> bytes:
    context.set_code(grpc.StatusCode.NOT_FOUND)
    context.set_details("plain code")
    return b"answered"


def plain_info(request: bytes, context: Any) -> bytes:
    echoed = [(k, v) for k, v in context.invocation_metadata() if k.startswith("x-")]
    context.send_initial_metadata(echoed)
    context.set_trailing_metadata(echoed)
    left = context.time_remaining()
    on_loop = threading.current_thread() is threading.main_thread()
    # A 60 s timeout; grpc's reaches the server rounded up a little.
    return f"deadline={left is not None and 0 < left < 120} on_loop={on_loop}".encode()


def plain_stream(request: bytes, context: Any) -> Iterator[bytes]:
    yield b"a"
    yield b"b"
    context.set_code(grpc.StatusCode.OUT_OF_RANGE)
    context.set_details("plain stream")


def plain_join(requests: Iterator[bytes], context: Any) -> bytes:
    return b"+".join(requests)


def plain_echo(requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
    yield from requests


PLAIN = grpc.method_handlers_generic_handler(
    "parity.Plain",
    {
        "Abort": grpc.unary_unary_rpc_method_handler(plain_abort),
        "Code": grpc.unary_unary_rpc_method_handler(plain_code),
        "Info": grpc.unary_unary_rpc_method_handler(plain_info),
        "Stream": grpc.unary_stream_rpc_method_handler(plain_stream),
        "Join": grpc.stream_unary_rpc_method_handler(plain_join),
        "Echo": grpc.stream_stream_rpc_method_handler(plain_echo),
    },
)


def handlers(method: Any) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        SERVICE, {"Check": grpc.unary_unary_rpc_method_handler(method)}
    )


def _echoed(context: Any) -> list[tuple[str, Any]]:
    echoed = [(k, v) for k, v in context.invocation_metadata() if k.startswith("x-")]
    context.set_trailing_metadata(echoed)
    return echoed


def meta_unary(request: bytes, context: Any) -> bytes:
    context.send_initial_metadata(_echoed(context))
    return request


def meta_server_stream(request: bytes, context: Any) -> Iterator[bytes]:
    context.send_initial_metadata(_echoed(context))
    for i in range(3):
        yield request + f"-{i}".encode()


def meta_client_stream(requests: Iterator[bytes], context: Any) -> bytes:
    context.send_initial_metadata(_echoed(context))
    return b"+".join(requests)


def meta_bidi(requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
    context.send_initial_metadata(_echoed(context))
    yield from requests


def meta_time_left(request: bytes, context: Any) -> bytes:
    _echoed(context)
    left = context.time_remaining()
    # grpcio reports a call without a deadline as one very far away.
    return b"none" if left is None or left > 1e6 else f"{left:.3f}".encode()


def meta_fail(request: bytes, context: Any) -> bytes:
    _echoed(context)
    context.abort(grpc.StatusCode.PERMISSION_DENIED, request.decode())


def talk(requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.extend(requests))
    reader.start()  # blocked in the call's receive: no request comes before three replies
    for i in range(3):
        yield f"first-{i}".encode()
    reader.join()
    yield b"+".join(got)


async def talk_async(requests: Any, context: Any) -> AsyncIterator[bytes]:
    async def read_all() -> list[bytes]:
        got = []
        while (request := await context.read()) is not grpc.aio.EOF:
            got.append(request)
        return got

    reader = asyncio.ensure_future(read_all())
    await asyncio.sleep(0)  # the reader waits in the call's receive first
    for i in range(3):
        await context.write(f"first-{i}".encode())
    await context.write(b"+".join(await reader))


def duplex(method: Any) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        "parity.Duplex", {"Talk": grpc.stream_stream_rpc_method_handler(method)}
    )


META = grpc.method_handlers_generic_handler(
    "parity.Meta",
    {
        "Unary": grpc.unary_unary_rpc_method_handler(meta_unary),
        "ServerStream": grpc.unary_stream_rpc_method_handler(meta_server_stream),
        "ClientStream": grpc.stream_unary_rpc_method_handler(meta_client_stream),
        "Bidi": grpc.stream_stream_rpc_method_handler(meta_bidi),
        "TimeLeft": grpc.unary_unary_rpc_method_handler(meta_time_left),
        "Fail": grpc.unary_unary_rpc_method_handler(meta_fail),
    },
)


SLOW = grpc.method_handlers_generic_handler(
    "parity.Slow", {"Wait": grpc.unary_unary_rpc_method_handler(wait)}
)


GUARDED = "/parity.Guarded/"
SEEN: list[str] = []


def _record(details: grpc.HandlerCallDetails) -> None:
    if details.method.startswith(GUARDED):
        who = dict(details.invocation_metadata or ()).get("x-who", "-")
        SEEN.append(f"{details.method} {who}")


def denied(request: bytes, context: Any) -> bytes:
    context.abort(grpc.StatusCode.PERMISSION_DENIED, "denied by the interceptor")
    raise AssertionError("abort returned")


async def denied_async(request: bytes, context: Any) -> bytes:
    await context.abort(grpc.StatusCode.PERMISSION_DENIED, "denied by the interceptor")
    raise AssertionError("abort returned")


class Recorder(grpc.ServerInterceptor):
    def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        _record(details)
        return continuation(details)


SHOUTED = (GUARDED + "Shout", GUARDED + "RawShout")


class Guard(grpc.ServerInterceptor):
    def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        if details.method == GUARDED + "Denied":
            return grpc.unary_unary_rpc_method_handler(denied)
        if details.method == GUARDED + "Hidden":
            return None
        handler = continuation(details)
        if details.method in SHOUTED:
            inner = handler.unary_unary
            return grpc.unary_unary_rpc_method_handler(
                lambda request, context: bytes(inner(request, context)).upper()
            )
        return handler


class AioRecorder(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        _record(details)
        return await continuation(details)


class AioGuard(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        if details.method == GUARDED + "Denied":
            return grpc.unary_unary_rpc_method_handler(denied_async)
        if details.method == GUARDED + "Hidden":
            return None
        handler = await continuation(details)
        if details.method in SHOUTED:
            inner = handler.unary_unary

            async def shout(request: bytes, context: Any) -> bytes:
                return bytes(await inner(request, context)).upper()

            return grpc.unary_unary_rpc_method_handler(shout)
        return handler


def seen(request: bytes, context: Any) -> bytes:
    lines = "\n".join(SEEN)
    SEEN.clear()
    return lines.encode()


def guarded(aio: bool) -> grpc.GenericRpcHandler:
    def echo(request: bytes, context: Any) -> bytes:
        return request

    def twice(request: bytes, context: Any) -> Iterator[bytes]:
        yield from (request, request)

    async def echo_async(request: bytes, context: Any) -> bytes:
        return request

    async def twice_async(request: bytes, context: Any) -> AsyncIterator[bytes]:
        for _ in range(2):
            yield request

    @isthmus.raw
    def raw_echo(request: Any, context: Any) -> Any:
        context.set_trailing_metadata([("x-request", type(request).__name__)])
        return request

    @isthmus.raw
    async def raw_echo_async(request: Any, context: Any) -> Any:
        return raw_echo(request, context)

    unary = grpc.unary_unary_rpc_method_handler
    return grpc.method_handlers_generic_handler(
        GUARDED.strip("/"),
        {
            "Echo": unary(echo_async if aio else echo),
            "Shout": unary(echo_async if aio else echo),
            "RawShout": unary(raw_echo_async if aio else raw_echo),
            "Twice": grpc.unary_stream_rpc_method_handler(twice_async if aio else twice),
            "Denied": unary(lambda request, context: b"not denied"),
            "Hidden": unary(lambda request, context: b"not hidden"),
            "Seen": unary(seen),
        },
    )


def announce(addresses: list[str]) -> None:
    print("READY", flush=True)
    for address in addresses:
        print("LISTENING", address, flush=True)


def main() -> None:
    api, targets = sys.argv[1], sys.argv[2:]
    flags = {t for t in targets if t.startswith("--")}
    targets = [t for t in targets if not t.startswith("--")]
    intercepted, health_last = "--intercepted" in flags, "--health-last" in flags
    options = [("grpc.max_send_message_length", SEND_LIMIT)] if "--send-limit" in flags else []
    if "--receive-limit" in flags:
        options.append(("grpc.max_receive_message_length", RECEIVE_LIMIT))
    if api in ("isthmus-aio", "grpc.aio"):

        async def serve() -> None:
            interceptors = [AioRecorder(), AioGuard()] if intercepted else None
            make = isthmus.aio.server if api == "isthmus-aio" else grpc.aio.server
            server = make(interceptors=interceptors, options=options)
            if not health_last:
                server.add_generic_rpc_handlers((handlers(check_async),))
            server.add_generic_rpc_handlers((SLOW, PLAIN, duplex(talk_async)))
            if intercepted:
                server.add_generic_rpc_handlers((guarded(aio=True),))
            for target in targets:
                server.add_insecure_port(target)
            if health_last:
                server.add_generic_rpc_handlers((handlers(check_async),))
            await server.start()
            announce([t for t in targets if not t.startswith("shm://")])
            await server.wait_for_termination()

        run_loop(serve())
        return
    make = grpc.server if api == "grpcio" else isthmus.server
    interceptors = [Recorder(), Guard()] if intercepted else None
    server = make(futures.ThreadPoolExecutor(4), interceptors=interceptors, options=options)
    if not health_last:
        server.add_generic_rpc_handlers((handlers(check),))
    server.add_generic_rpc_handlers((META, duplex(talk)))
    if intercepted:
        server.add_generic_rpc_handlers((guarded(aio=False),))
    for target in targets:
        server.add_insecure_port(target)
    if health_last:
        server.add_generic_rpc_handlers((handlers(check),))
    server.start()
    announce([t for t in targets if not t.startswith("shm://")])
    server.wait_for_termination()


if __name__ == "__main__":
    main()
