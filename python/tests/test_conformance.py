"""The conformance cases, over every client-server pair (conftest.PAIRS): isthmus's blocking and
asyncio clients against the Rust peer, isthmus's Python servers and a grpcio server, on
`shm://`, `unix://` and `http://`, and grpcio's clients against isthmus's Python servers."""

from __future__ import annotations

import os
from types import ModuleType

import grpc
import pytest
from clients import as_dict
from conftest import Pair, ids
from echo_servicer import RAISE, pattern

import isthmus

ECHO = [("x-echo", "hi"), ("x-echo-bin", b"\x00\x01\xff")]


def _raises(pair: Pair, code: grpc.StatusCode, call: object) -> grpc.RpcError:
    """Runs `call`; checks that it fails with `code` (as isthmus's RpcError from an isthmus
    client) and returns the error."""
    with pytest.raises(grpc.RpcError) as caught:
        call()  # type: ignore[operator]
    error = caught.value
    assert error.code() == code, (error.code(), error.details())
    assert isinstance(error, isthmus.RpcError) == pair.api.startswith("isthmus")
    return error


def test_unary_metadata_and_deadline(pair: Pair, pb: ModuleType) -> None:
    out = pair.client.unary(pb.EchoRequest(payload=b"hello", seq=7), metadata=ECHO, timeout=30)
    assert (out.response.payload, out.response.seq) == (b"hello", 7)
    # grpc-core rounds the timeout it sends up to a coarser unit (30 s can travel as 30100m).
    assert 0 < out.response.time_left_ms <= 31_000, out.response.time_left_ms
    assert (out.initial.get("x-echo"), out.initial.get("x-echo-bin")) == ("hi", b"\x00\x01\xff"), out.initial
    if pair.served.kind != "rust":  # the Rust peer reflects them into the headers only
        assert (out.trailing.get("x-echo"), out.trailing.get("x-echo-bin")) == ("hi", b"\x00\x01\xff")


def test_unary_without_deadline(pair: Pair, pb: ModuleType) -> None:
    assert pair.client.unary(pb.EchoRequest(seq=1)).response.time_left_ms == -1


def test_server_stream(pair: Pair, pb: ModuleType) -> None:
    out = pair.client.server_stream(pb.StreamRequest(count=50, size=10_000), timeout=60)
    assert [r.seq for r in out.response] == list(range(50))
    assert all(r.payload == pattern(10_000, r.seq) for r in out.response)


def test_client_stream(pair: Pair, pb: ModuleType) -> None:
    requests = [pb.EchoRequest(payload=pattern(100 * i, i), seq=i) for i in range(20)]
    out = pair.client.client_stream(requests, timeout=60)
    assert (out.response.count, out.response.bytes) == (20, sum(100 * i for i in range(20)))


def test_bidi(pair: Pair, pb: ModuleType) -> None:
    out = pair.client.bidi([pb.EchoRequest(payload=b"x" * i, seq=i) for i in range(20)], timeout=60)
    assert [(len(r.payload), r.seq) for r in out.response] == [(i, i) for i in range(20)]


def test_every_status_code(pair: Pair, pb: ModuleType) -> None:
    for code in grpc.StatusCode:
        if code is grpc.StatusCode.OK:
            continue
        request = pb.EchoRequest(fail_with=code.value[0], fail_message=f"failed: {code.name}")
        error = _raises(pair, code, lambda: pair.client.unary(request, timeout=60))  # noqa: B023
        assert error.details() == f"failed: {code.name}"
        assert as_dict(error.trailing_metadata()).get("x-failed") == "yes", error.trailing_metadata()


def test_streams_fail_midway(pair: Pair, pb: ModuleType) -> None:
    fail = pb.EchoRequest(seq=2, fail_with=grpc.StatusCode.ABORTED.value[0], fail_message="stop")
    requests = [pb.EchoRequest(payload=pattern(10, i), seq=i) for i in range(2)] + [fail]
    error = _raises(pair, grpc.StatusCode.ABORTED, lambda: pair.client.client_stream(requests, timeout=60))
    assert error.details() == "stop"
    error = _raises(pair, grpc.StatusCode.ABORTED, lambda: pair.client.bidi(requests, timeout=60))
    assert error.details() == "stop"


def test_handler_raises(pair: Pair, pb: ModuleType) -> None:
    request = pb.EchoRequest(fail_with=RAISE, fail_message="boom")
    error = _raises(pair, grpc.StatusCode.UNKNOWN, lambda: pair.client.unary(request, timeout=60))
    assert "boom" in error.details()


def test_unimplemented_method(pair: Pair) -> None:
    _raises(pair, grpc.StatusCode.UNIMPLEMENTED, lambda: pair.client.call("/conformance.Echo/Missing", b""))


def test_deadline_exceeded(pair: Pair, pb: ModuleType) -> None:
    request = pb.EchoRequest(sleep_ms=20_000)
    _raises(pair, grpc.StatusCode.DEADLINE_EXCEEDED, lambda: pair.client.unary(request, timeout=0.5))


def test_1000_concurrent_calls(pair: Pair, pb: ModuleType) -> None:
    replies = pair.client.unary_many(
        [pb.EchoRequest(payload=b"%d" % i, seq=i) for i in range(1000)], timeout=120
    )
    assert [(r.payload, r.seq) for r in replies] == [(b"%d" % i, i) for i in range(1000)]


# The largest message the peers take (64 MiB, their limit, less the few bytes of framing),
# both ways; over a sample of the pairs, as each costs a few seconds.
BIG = [
    *(
        (api, "rust", transport)
        for api in ("isthmus", "isthmus.aio")
        for transport in ("shm", "unix", "http")
    ),
    *(
        (api, server, "shm")
        for api in ("isthmus", "isthmus.aio")
        for server in ("isthmus", "isthmus-aio", "go")
    ),
    ("isthmus", "grpcio", "unix"),
    ("grpcio", "isthmus", "unix"),
    ("grpcio.aio", "isthmus-aio", "http"),
]


@pytest.mark.parametrize("pair", BIG, ids=ids, indirect=True)
def test_64_mib_message(pair: Pair, pb: ModuleType) -> None:
    payload = os.urandom((64 << 20) - 16)
    out = pair.client.unary(pb.EchoRequest(payload=payload, seq=1), timeout=120)
    assert out.response.payload == payload
