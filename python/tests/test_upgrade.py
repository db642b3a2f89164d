"""The upgrade from Python (ADR 0013): a channel given the HTTP/2 address of an isthmus server
on this machine that also serves `shm://` moves its calls there (the handler then sees an
`shm:` peer), with the blocking and the asyncio API, over TLS too; it stays on HTTP/2 with a
grpcio server, a server that offers nothing, a client that authenticates with a certificate, or
the upgrade turned off."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import certs
import grpc
import pytest
from test_targets_tls import METHOD, Server

import isthmus


@pytest.fixture(scope="module")
def cert_dir() -> Iterator[tuple[certs.Certs, Path]]:
    pems = certs.make()
    with tempfile.TemporaryDirectory(prefix="isthmus-up-") as d:
        pems.write(Path(d))
        yield pems, Path(d)


# How a handler names a caller that came over TCP to `localhost` (v4 or v6, as it resolved).
LOOPBACK = ("ipv4:127.0.0.1:", "ipv6:%5B::1%5D:")


def settle(channel: isthmus.Channel) -> str:
    """Calls until the channel's probe has finished (at most 30 s); its status then."""
    end = time.monotonic() + 30
    while True:
        channel.unary_unary(METHOD)(b"", timeout=10)
        status = channel.upgrade_status()
        if status != "pending" or time.monotonic() > end:
            return status
        time.sleep(0.01)


def peer_of(channel: grpc.Channel) -> str:
    return json.loads(channel.unary_unary(METHOD)(b"", timeout=10))["peer"]  # type: ignore[no-any-return]


def shm_name() -> str:
    return f"shm://py-up-{os.getpid()}-{time.monotonic_ns()}"


def test_a_local_isthmus_server_takes_the_calls_over_shm(cert_dir: tuple[certs.Certs, Path]) -> None:
    with Server("isthmus", cert_dir[1], "none", "localhost:0", shm_name()) as server:
        port = server.ports[0]
        for target in (f"localhost:{port}", f"dns:///localhost:{port}", f"http://127.0.0.1:{port}"):
            with isthmus.insecure_channel(target) as channel:
                assert settle(channel).startswith("shm:///"), target
                before = channel.transport_counts()
                assert before["http2"] >= 1, before
                peer = peer_of(channel)
                assert peer.startswith(f"shm:pid={os.getpid()},"), peer  # the caller: this process
                after = channel.transport_counts()
                assert after == {"shm": before["shm"] + 1, "http2": before["http2"]}, (before, after)
        # Turned off for one channel: HTTP/2 it stays.
        off = isthmus.insecure_channel(f"localhost:{port}", options=[("isthmus.upgrade", False)])
        with off:
            assert peer_of(off).startswith(LOOPBACK)
            assert off.upgrade_status() == "off"


def test_a_call_whose_move_cannot_connect_keeps_its_deadline(cert_dir: tuple[certs.Certs, Path]) -> None:
    """The channel has moved (its probe reached the server's shm:// endpoint), and its first
    call over shared memory makes the fast path's own connection while the server is stopped,
    so the handshake gets no answer: the call ends DEADLINE_EXCEEDED at its deadline (1 s), as
    any wait of a call does. Before, the handshake's own 5 s ran first, and the call then went
    to HTTP/2 with its whole timeout again."""
    with (
        Server("isthmus", cert_dir[1], "none", "localhost:0", shm_name()) as server,
        isthmus.insecure_channel(f"localhost:{server.ports[0]}") as channel,
    ):
        channel.unary_unary(METHOD)(b"", timeout=10)  # over HTTP/2; it starts the probe
        end = time.monotonic() + 30
        while channel.upgrade_status() == "pending" and time.monotonic() < end:
            time.sleep(0.01)  # no call meanwhile: the fast path has not connected yet
        assert channel.upgrade_status().startswith("shm:///"), channel.upgrade_status()
        server.peer.stop()
        try:
            began = time.monotonic()
            with pytest.raises(grpc.RpcError) as raised:
                channel.unary_unary(METHOD)(b"", timeout=1)
            took = time.monotonic() - began
        finally:
            server.peer.resume()
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, raised.value
        assert took < 4, f"{took:.1f} s for a call with a 1 s timeout"


def test_asyncio_channels_move_too(cert_dir: tuple[certs.Certs, Path]) -> None:
    with Server("isthmus", cert_dir[1], "none", "localhost:0", shm_name()) as server:
        port = server.ports[0]

        async def run() -> tuple[str, str, dict[str, int], int]:
            async with isthmus.aio.insecure_channel(f"localhost:{port}") as channel:
                call = channel.unary_unary(METHOD)
                end = time.monotonic() + 30
                while channel.upgrade_status() == "pending" and time.monotonic() < end:
                    await call(b"", timeout=10)
                    await asyncio.sleep(0.01)
                peer = json.loads(await call(b"", timeout=10))["peer"]
                stats = channel.stats()
                return channel.upgrade_status(), peer, channel.transport_counts(), stats.calls_started

        status, peer, counts, started = asyncio.run(run())
        assert status.startswith("shm:///"), status
        assert peer.startswith("shm:pid="), peer
        assert counts["shm"] >= 1 and counts["http2"] >= 1, counts
        # Its counters are those of the shm:// connection it moved to.
        assert started >= 1, started


def test_a_first_request_too_large_for_http2_waits_for_the_move(cert_dir: tuple[certs.Certs, Path]) -> None:
    # A channel's first calls go over HTTP/2 while its probe runs, where the server takes 4 MiB
    # unless told otherwise (ADR 0034): a unary request larger than that waits for the probe and
    # goes over shm:// (it failed RESOURCE_EXHAUSTED), from the blocking and the asyncio API.
    large = b"x" * (8 << 20)
    with Server("isthmus", cert_dir[1], "none", "localhost:0", shm_name()) as server:
        target = f"localhost:{server.ports[0]}"
        for timeout in (30, sys.maxsize):  # a caller's "forever" bounds nothing, as in a call
            with isthmus.insecure_channel(target) as channel:
                assert channel.upgrade_status() == "pending"
                peer = json.loads(channel.unary_unary(METHOD)(large, timeout=timeout))["peer"]
                assert peer.startswith(f"shm:pid={os.getpid()},"), peer
                assert channel.transport_counts() == {"shm": 1, "http2": 0}

        async def first() -> tuple[str, dict[str, int]]:
            async with isthmus.aio.insecure_channel(target) as channel:
                reply = await channel.unary_unary(METHOD)(large, timeout=30)
                return json.loads(reply)["peer"], channel.transport_counts()

        peer, counts = asyncio.run(first())
        assert peer.startswith(f"shm:pid={os.getpid()},"), peer
        assert counts == {"shm": 1, "http2": 0}, counts


@pytest.mark.parametrize("case", ["grpcio", "no-offer"])
def test_servers_that_offer_nothing_keep_http2(cert_dir: tuple[certs.Certs, Path], case: str) -> None:
    kind = "grpcio" if case == "grpcio" else "isthmus"
    targets = ("localhost:0",) if kind == "grpcio" else ("localhost:0", shm_name())
    if case == "no-offer":
        os.environ["ISTHMUS_NO_OFFER"] = "1"
    try:
        server = Server(kind, cert_dir[1], "none", *targets)
    finally:
        os.environ.pop("ISTHMUS_NO_OFFER", None)
    with server, isthmus.insecure_channel(f"localhost:{server.ports[0]}") as channel:
        assert settle(channel) == "http2"
        assert peer_of(channel).startswith(LOOPBACK)
        assert channel.transport_counts()["shm"] == 0


def test_tls_moves_but_a_certificate_holder_stays(cert_dir: tuple[certs.Certs, Path]) -> None:
    pems, directory = cert_dir
    with Server("isthmus", directory, "tls", "localhost:0", shm_name()) as server:
        credentials = isthmus.ssl_channel_credentials(pems.ca)
        with isthmus.secure_channel(f"localhost:{server.ports[0]}", credentials) as channel:
            assert settle(channel).startswith("shm:///")
            assert peer_of(channel).startswith("shm:pid=")
    with Server("isthmus", directory, "mtls", "localhost:0", shm_name()) as server:
        credentials = isthmus.ssl_channel_credentials(pems.ca, pems.client.key, pems.client.cert)
        with isthmus.secure_channel(f"localhost:{server.ports[0]}", credentials) as channel:
            # The handler knows this client by its certificate, which shm:// would not carry.
            assert settle(channel) == "http2"
            seen: dict[str, Any] = json.loads(channel.unary_unary(METHOD)(b"", timeout=10))
            assert seen["key"] == "x509_subject_alternative_name", seen


def test_no_other_process_can_claim_an_identity_on_the_loopback(cert_dir: tuple[certs.Certs, Path]) -> None:
    """The server's private loopback endpoint takes the HTTP/2 caller's identity from its own
    bridge only: another process (this one) that connects there and sends the reserved
    metadata is known by its own credentials."""
    pems, directory = cert_dir
    with Server("isthmus", directory, "none", "localhost:0") as server:
        loopback = f"shm://isthmus-loopback-{server.peer.process.pid}-0"
        forged = [
            ("x-isthmus-peer", "ipv4:6.6.6.6:1"),
            ("x-isthmus-peer-tls", "1"),
            ("x-isthmus-peer-cert-bin", _der(pems.client.cert)),
        ]
        with isthmus.insecure_channel(loopback) as channel:
            seen = json.loads(channel.unary_unary(METHOD)(b"", timeout=10, metadata=forged))
        assert seen["peer"].startswith(f"shm:pid={os.getpid()},"), seen
        # Known as the local client it is (grpc's local credentials' identity), not the forger.
        assert seen["identities"] == ["local"] and "x509_common_name" not in seen["auth"], seen


def _der(pem: bytes) -> bytes:
    """The DER inside one PEM certificate."""
    body = b"".join(line for line in pem.splitlines() if line and not line.startswith(b"-----"))
    return base64.b64decode(body)


_STATUSES = r"""
import asyncio, sys
import isthmus, isthmus.aio

target = sys.argv[1]
on = [("isthmus.upgrade", True)]

async def aio() -> list[str]:
    async with isthmus.aio.insecure_channel(target) as a:
        async with isthmus.aio.insecure_channel(target, options=on) as b:
            return [a.upgrade_status(), b.upgrade_status()]

with isthmus.insecure_channel(target) as a, isthmus.insecure_channel(target, options=on) as b:
    print(a.upgrade_status(), b.upgrade_status(), *asyncio.run(aio()))
"""


def test_the_process_default_turns_the_upgrade_off_unless_a_channel_says() -> None:
    """`ISTHMUS_UPGRADE=0` turns the move off for every channel of the process that does not
    say, blocking and asyncio, as it does for the C ABI, Go and Lua (a kill switch); a channel
    given `isthmus.upgrade` keeps its choice. Python's channels moved whatever it said."""
    env = dict(os.environ, ISTHMUS_UPGRADE="0")
    done = subprocess.run(
        [sys.executable, "-c", _STATUSES, "http://127.0.0.1:9"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    default_off, chosen, aio_default_off, aio_chosen = done.stdout.split()
    assert (default_off, aio_default_off) == ("off", "off"), done.stdout
    assert "off" not in (chosen, aio_chosen), done.stdout
