"""isthmus's asyncio API, in grpc.aio's shapes: `insecure_channel` and `server`.

    async with isthmus.aio.insecure_channel("shm://sidecar") as channel:
        reply = await echo_pb2_grpc.EchoStub(channel).Say(request)

Calls complete through one engine Reactor per running event loop, whose fd the loop watches: no
thread per call, and every completion since the last wake-up is taken in one batch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import Executor
from typing import Any

import grpc
import grpc.aio

from .._credentials import channel_security
from ._call import StreamStreamCall, StreamUnaryCall, UnaryStreamCall, UnaryUnaryCall
from ._channel import Channel
from ._context import ServicerContext
from ._server import Server

__all__ = [
    "Channel",
    "Server",
    "ServicerContext",
    "StreamStreamCall",
    "StreamUnaryCall",
    "UnaryStreamCall",
    "UnaryUnaryCall",
    "insecure_channel",
    "secure_channel",
    "server",
]


def insecure_channel(
    target: str,
    options: Any = None,
    compression: grpc.Compression | None = None,
    interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None,
) -> Channel:
    """A channel to `shm://NAME`, or over HTTP/2 to any target grpc names, as
    `grpc.aio.insecure_channel` makes one; its calls go through `interceptors` as there."""
    return Channel(target, options, compression, interceptors=interceptors)


def secure_channel(
    target: str,
    credentials: grpc.ChannelCredentials,
    options: Any = None,
    compression: grpc.Compression | None = None,
    interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None,
) -> Channel:
    """A secure channel, as `grpc.aio.secure_channel` makes one: the credentials
    `isthmus.secure_channel` takes (TLS, local, and call credentials composed into either)."""
    return Channel(target, options, compression, channel_security(credentials, options, target), interceptors)


def server(
    migration_thread_pool: Executor | None = None,
    handlers: Iterable[grpc.GenericRpcHandler] | None = None,
    interceptors: Sequence[Any] | None = None,
    options: Sequence[tuple[str, Any]] | None = None,
    maximum_concurrent_rpcs: int | None = None,
    compression: grpc.Compression | None = None,
) -> Server:
    """A server, as `grpc.aio.server` makes one; bind it with `add_insecure_port`. It reads the
    `options` that `isthmus.server` reads."""
    return Server(
        migration_thread_pool, handlers, interceptors, options, maximum_concurrent_rpcs, compression
    )
