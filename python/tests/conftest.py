"""Fixtures: the stubs grpcio-tools generates from the conformance proto, server peers (started
once per session, each serving every transport it can), and the client-server pairs the
conformance cases run over."""

from __future__ import annotations

import importlib
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import grpc.aio
import pytest
from clients import AioClient, SyncClient, make_client
from peer import Served, generate_stubs, go_peer, serve, tonic_peer

STUBS = generate_stubs()

# grpc.aio shuts its poller thread down whenever its last channel or server closes, and that
# shutdown can hang for good when the poller is blocked writing to its wake-up socket
# (grpc/grpc#40989; seen once in CI, closing a grpc.aio client after 1000 concurrent calls).
# Initialised once here, from the main thread, one poller serves the whole session
# (grpc/grpc#22365).
grpc.aio.init_grpc_aio()

# What each server peer serves: grpcio has no shm://.
TRANSPORTS = {
    "rust": ["shm", "unix", "http"],
    "go": ["shm", "unix", "http"],
    "isthmus": ["shm", "unix", "http"],
    "isthmus-aio": ["shm", "unix", "http"],
    "grpcio": ["unix", "http"],
}


def _pairs() -> Iterator[tuple[str, str, str]]:
    """(client API, server, transport): isthmus's clients against every server on every
    transport, and grpcio's against isthmus's Python servers."""
    for server, transports in TRANSPORTS.items():
        for transport in transports:
            yield from (("isthmus", server, transport), ("isthmus.aio", server, transport))
            if server.startswith("isthmus") and transport != "shm":
                yield from (("grpcio", server, transport), ("grpcio.aio", server, transport))


PAIRS = list(_pairs())


def ids(param: tuple[str, ...]) -> str:
    return "-".join(param)


@pytest.fixture(scope="session")
def stubs() -> Iterator[Path]:
    """Where the generated modules are (the server peers import them too)."""
    yield STUBS
    shutil.rmtree(STUBS, ignore_errors=True)


@pytest.fixture(scope="session")
def pb(stubs: Path) -> ModuleType:
    return importlib.import_module("conformance_pb2")


@pytest.fixture(scope="session")
def pb_grpc(stubs: Path) -> ModuleType:
    return importlib.import_module("conformance_pb2_grpc")


@pytest.fixture(scope="session")
def servers(stubs: Path) -> Iterator[Callable[[str], Served]]:
    """Server peers by kind, started on first use; one that died is started anew, so that one
    test's crash does not fail the rest."""
    started: dict[str, Served] = {}

    def get(kind: str) -> Served:
        if kind == "rust" and tonic_peer() is None:
            pytest.skip("tonic-peer is not built (make unit, or set ISTHMUS_TONIC_PEER)")
        if kind == "go" and go_peer() is None:
            pytest.skip("go-peer is not built (make go-bins, or set ISTHMUS_GO_PEER)")
        if kind not in started or started[kind].peer.process.poll() is not None:
            started[kind] = serve(kind, TRANSPORTS[kind], stubs)
        return started[kind]

    yield get
    for served in started.values():
        served.close()


@dataclass
class Pair:
    api: str
    served: Served
    transport: str
    client: SyncClient | AioClient


@pytest.fixture(params=PAIRS, ids=ids)
def pair(
    request: pytest.FixtureRequest, servers: Callable[[str], Served], pb_grpc: ModuleType
) -> Iterator[Pair]:
    api, kind, transport = request.param
    served = servers(kind)
    client = make_client(api, served.addresses[transport], pb_grpc)
    yield Pair(api, served, transport, client)
    client.close()


@dataclass
class Endpoint:
    served: Served
    address: str


# Where the tests of one API's own shapes run: every transport, and every kind of server.
ENDPOINTS = [
    ("rust", "shm"),
    ("rust", "unix"),
    ("rust", "http"),
    ("go", "shm"),
    ("go", "unix"),
    ("go", "http"),
    ("isthmus", "shm"),
    ("isthmus-aio", "shm"),
    ("grpcio", "unix"),
]


@pytest.fixture(params=ENDPOINTS, ids=ids)
def endpoint(request: pytest.FixtureRequest, servers: Callable[[str], Served]) -> Endpoint:
    kind, transport = request.param
    served = servers(kind)
    return Endpoint(served, served.addresses[transport])
