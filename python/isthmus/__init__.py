"""isthmus: typed gRPC calls between processes over shared memory, in grpc's Python API.

Code that grpcio-tools generates (`*_pb2.py`, `*_pb2_grpc.py`) runs unchanged; only the line
that makes the channel or the server changes:

    channel = isthmus.insecure_channel("shm://sidecar")  # was grpc.insecure_channel(...)
    reply = echo_pb2_grpc.EchoStub(channel).Say(request)

    server = isthmus.server(futures.ThreadPoolExecutor(8))  # was grpc.server(...)
    echo_pb2_grpc.add_EchoServicer_to_server(Echo(), server)
    server.add_insecure_port("shm://sidecar")
    server.start()

Targets: `shm://NAME` (shared memory, between processes of one machine), and every form grpc
names (`localhost:50051`, `dns:///host:port`, `ipv4:…`, `ipv6:…`, `unix:PATH`,
`unix-abstract:NAME`) or `http://HOST:PORT`: standard gRPC over HTTP/2, which grpcio, tonic and
others speak too; with TLS through `secure_channel` and `add_secure_port`.
`isthmus.aio` is the asyncio API, in grpc.aio's shapes. Failed calls raise `isthmus.RpcError`,
which is a `grpc.RpcError` (and a `grpc.aio.AioRpcError`); a bad target or TLS setting raises
`ValueError`, and isthmus's other exceptions of its own are `isthmus.IsthmusError`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import Executor
from typing import Any

import grpc

from . import aio
from ._channel import Channel
from ._credentials import (
    ChannelCredentials,
    ServerCredentials,
    channel_security,
    local_channel_credentials,
    local_server_credentials,
    ssl_channel_credentials,
    ssl_server_credentials,
)
from ._errors import IsthmusError, RpcError
from ._handler import raw
from ._native import Block, Message
from ._server import Server
from ._stats import TransportStats
from ._topic import Topic, TopicStats

__all__ = [
    "Block",
    "Channel",
    "ChannelCredentials",
    "IsthmusError",
    "Message",
    "RpcError",
    "Server",
    "ServerCredentials",
    "Topic",
    "TopicStats",
    "TransportStats",
    "aio",
    "insecure_channel",
    "local_channel_credentials",
    "local_server_credentials",
    "raw",
    "secure_channel",
    "server",
    "ssl_channel_credentials",
    "ssl_server_credentials",
]


def insecure_channel(
    target: str, options: Any = None, compression: grpc.Compression | None = None
) -> Channel:
    """A channel to `shm://NAME`, or over HTTP/2 to any target grpc names (`localhost:50051`,
    `unix:PATH`, …), as `grpc.insecure_channel` makes one. Raises ValueError for a target that
    does not parse."""
    return Channel(target, options, compression)


def secure_channel(
    target: str,
    credentials: grpc.ChannelCredentials,
    options: Any = None,
    compression: grpc.Compression | None = None,
) -> Channel:
    """A secure channel, as `grpc.secure_channel` makes one: TLS to a TCP target (`host:port`,
    `https://host:port`, …) with `credentials` from `isthmus.ssl_channel_credentials` (or
    grpc's own), or grpc's `local_channel_credentials()` for a target on this machine; either
    may be composed with call credentials (`grpc.composite_channel_credentials`), which every
    call then sends. The option `grpc.ssl_target_name_override` names the host the server's
    certificate must cover."""
    return Channel(target, options, compression, channel_security(credentials, options, target))


def server(
    thread_pool: Executor,
    handlers: Iterable[grpc.GenericRpcHandler] | None = None,
    interceptors: Sequence[grpc.ServerInterceptor] | None = None,
    options: Sequence[tuple[str, Any]] | None = None,
    maximum_concurrent_rpcs: int | None = None,
    compression: grpc.Compression | None = None,
) -> Server:
    """A server whose handlers run on `thread_pool`, as `grpc.server` makes one; bind it with
    `add_insecure_port`. `options` it reads: `grpc.max_receive_message_length` and
    `grpc.max_send_message_length` (a larger request or reply fails its call
    RESOURCE_EXHAUSTED; unset, requests up to 4 MiB over HTTP/2, as grpcio's, and 4 GiB over
    shm://), `grpc.max_concurrent_streams` (calls one connection may have open at once: an
    HTTP/2 client waits for a place, as grpcio's do; over shm:// one more is refused
    RESOURCE_EXHAUSTED), `grpc.default_compression_algorithm`, `grpc.so_reuseport` (on by
    default, as grpcio's: servers of several processes can bind the same TCP port, the kernel
    spreading the connections among them; 0: a port in use fails the bind),
    `grpc.keepalive_time_ms` and `grpc.keepalive_timeout_ms` (a PING to an HTTP/2 client
    connection gone quiet that long; one left unanswered closes the connection and cancels its
    calls; none by default), `grpc.max_connection_age_ms` and `grpc.max_connection_age_grace_ms`
    (a GOAWAY to an HTTP/2 connection that old, so its client moves its next calls to a new
    one; the calls still on it are cancelled when the grace is over; none by default;
    `grpc.max_connection_idle_ms` is not supported), and `isthmus.offer_shm` (False: HTTP/2
    clients on this machine are not offered the move to shm://)."""
    return Server(thread_pool, handlers, interceptors, options, maximum_concurrent_rpcs, compression)
