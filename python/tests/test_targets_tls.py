"""gRPC's target names and TLS from Python: grpcio's addresses on both sides, TLS and mutual
TLS between isthmus and grpcio in both directions with certificates made at test time, what a
handler's context says of its caller (compared with grpcio's own answer for the same caller),
and certificate problems that end calls UNAVAILABLE saying which. Servers run in their own
processes (`whoami_server.py`)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import ssl
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import certs
import grpc
import pytest
from peer import LOOP_ENV, Peer

import isthmus
import isthmus.aio

HERE = Path(__file__).parent
METHOD = "/whoami.Who/Am"


@pytest.fixture(scope="module")
def pems() -> certs.Certs:
    return certs.make()


@pytest.fixture(scope="module")
def cert_dir(pems: certs.Certs) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="isthmus-tls-") as d:
        pems.write(Path(d))
        yield Path(d)


class Server:
    """A whoami server process and the ports its add_*_port calls returned."""

    def __init__(self, kind: str, cert_dir: Path, mode: str, *targets: str) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
        argv = [sys.executable, str(HERE / "whoami_server.py"), kind, str(cert_dir), mode, *targets]
        self.peer = Peer(argv, env)
        self.ports = [int(p) for p in self.peer.expect("PORTS").split()[1:]]

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.peer.close()


def whoami(channel: grpc.Channel) -> dict[str, Any]:
    with channel:
        return json.loads(channel.unary_unary(METHOD)(b"", timeout=10))  # type: ignore[no-any-return]


def failure(channel: grpc.Channel) -> grpc.RpcError:
    with channel, pytest.raises(grpc.RpcError) as raised:
        channel.unary_unary(METHOD)(b"", timeout=10)
    return raised.value


def test_grpc_addresses_work_on_both_sides(cert_dir: Path) -> None:
    tag = f"isthmus-py-{os.getpid()}"
    sock = f"{tempfile.gettempdir()}/{tag}.sock"
    try:
        _grpc_addresses(cert_dir, tag, sock)
    finally:
        Path(sock).unlink(missing_ok=True)  # a server killed with SIGKILL leaves its socket


def _grpc_addresses(cert_dir: Path, tag: str, sock: str) -> None:
    for kind in ("isthmus", "grpcio"):
        targets = ("[::]:0", f"unix:{sock}", f"unix-abstract:{tag}-{kind}")
        with Server(kind, cert_dir, "none", *targets) as server:
            port = server.ports[0]
            # grpc's add_insecure_port gives the TCP port chosen for port 0, and 1 otherwise.
            assert port > 1 and server.ports[1:] == [1, 1], server.ports
            forms = [
                f"localhost:{port}",
                f"127.0.0.1:{port}",
                f"dns:///localhost:{port}",
                f"dns:localhost:{port}",
                f"ipv4:127.0.0.1:{port}",
                f"ipv6:[::1]:{port}",
                f"unix:{sock}",
                f"unix://{sock}",
                f"unix-abstract:{tag}-{kind}",
            ]
            for target in forms:
                seen = whoami(isthmus.insecure_channel(target))
                assert seen["auth"]["transport_security_type"] == ["aW5zZWN1cmU="], (kind, target, seen)
                if target.startswith(("unix", "unix-abstract")):
                    assert seen["peer"].startswith("unix:"), (kind, target, seen)
                else:
                    assert seen["peer"].startswith(("ipv4:127.0.0.1:", "ipv6:%5B::1%5D:")), (
                        kind,
                        target,
                        seen,
                    )
                if kind == "isthmus":
                    # And grpcio's own client reaches isthmus's server by the same names.
                    assert whoami(grpc.insecure_channel(target))["peer"], target


@pytest.mark.parametrize(
    ("kind", "loop"), [("isthmus", ""), ("isthmus-aio", "asyncio"), ("isthmus-aio", "uvloop")]
)
def test_a_handler_names_its_peer(
    cert_dir: Path, kind: str, loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`context.peer()` in a handler of an isthmus server, thread pool or asyncio, names the
    caller as grpc's servers do over TCP (`ipv4:`) and a Unix socket (`unix:`), and over shared
    memory by the calling process's own pid and uid (`shm:pid=PID,uid=UID`)."""
    if loop:
        monkeypatch.setenv(LOOP_ENV, loop)
    monkeypatch.setenv("ISTHMUS_NO_OFFER", "1")  # TCP stays TCP: no move to shared memory
    name = f"isthmus-py-whoami-{os.getpid()}-{kind}-{loop}"
    with Server(kind, cert_dir, "none", "127.0.0.1:0", f"unix-abstract:{name}", f"shm://{name}") as server:
        seen = [
            whoami(isthmus.insecure_channel(target))["peer"]
            for target in (f"127.0.0.1:{server.ports[0]}", f"unix-abstract:{name}", f"shm://{name}")
        ]
    assert seen[0].startswith("ipv4:127.0.0.1:"), seen
    assert seen[1].startswith("unix:"), seen
    assert seen[2] == f"shm:pid={os.getpid()},uid={os.getuid()}", seen


@pytest.mark.parametrize(
    ("kind", "loop"), [("isthmus", ""), ("isthmus-aio", "asyncio"), ("isthmus-aio", "uvloop")]
)
def test_a_handler_sees_its_callers_user_agent_as_grpcios_does(
    cert_dir: Path, kind: str, loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`invocation_metadata()` holds the caller's `user-agent` in an isthmus server's handler
    exactly as in a grpcio server's, for grpcio's client and isthmus's over HTTP/2, each with
    grpc's `grpc.primary_user_agent` and `grpc.secondary_user_agent` and without; over shared
    memory an isthmus client's agent is those options' alone (blocking and asyncio), and
    there is none without them."""
    if loop:
        monkeypatch.setenv(LOOP_ENV, loop)
    monkeypatch.setenv("ISTHMUS_NO_OFFER", "1")  # HTTP/2 stays HTTP/2: no move to shared memory
    name = f"isthmus-py-agent-{os.getpid()}-{kind}-{loop}"
    named = [("grpc.primary_user_agent", "py-test/1.0"), ("grpc.secondary_user_agent", "(extra)")]
    # As bytes, which grpcio reads as their text (isthmus sent "b'py-test/1.0'").
    named_bytes = [(key, value.encode()) for key, value in named]

    def agents(target: str) -> list[list[str]]:
        seen = []
        for options in (None, named, named_bytes):
            for channel in (
                grpc.insecure_channel(target, options),
                isthmus.insecure_channel(target, options),
            ):
                with channel:
                    reply = channel.unary_unary(METHOD)(b"", timeout=10)
                seen.append(json.loads(reply)["agent"])
        return seen

    async def over_aio(target: str) -> list[str]:
        async with isthmus.aio.insecure_channel(target, named) as channel:
            return list(json.loads(await channel.unary_unary(METHOD)(b"", timeout=10))["agent"])

    with Server("grpcio", cert_dir, "none", f"unix-abstract:{name}-grpcio"):
        theirs = agents(f"unix-abstract:{name}-grpcio")
    with Server(kind, cert_dir, "none", f"unix-abstract:{name}", f"shm://{name}"):
        ours = agents(f"unix-abstract:{name}")
        shm = f"shm://{name}"
        over_shm = []
        for options in (None, named, named_bytes):
            with isthmus.insecure_channel(shm, options) as channel:
                over_shm.append(json.loads(channel.unary_unary(METHOD)(b"", timeout=10))["agent"])
        over_shm.append(asyncio.run(over_aio(shm)))
    assert theirs[0][0].startswith("grpc-python/"), theirs
    assert theirs[2][0].startswith("py-test/1.0 grpc-python/") and theirs[2][0].endswith(" (extra)"), theirs
    assert theirs[3][0].startswith("py-test/1.0 (extra) "), theirs
    assert theirs[4:] == theirs[2:4], theirs
    assert ours == theirs, (ours, theirs)
    assert over_shm == [[], ["py-test/1.0 (extra)"], ["py-test/1.0 (extra)"], ["py-test/1.0 (extra)"]], (
        over_shm
    )


def test_a_channel_that_moved_to_shared_memory_names_its_user_agent_there(cert_dir: Path) -> None:
    """A channel to an HTTP/2 address that moves to the server's `shm://` endpoint (the
    upgrade) names its `grpc.primary_user_agent` there too: tonic's agent follows it while the
    calls go over HTTP/2, and it goes alone once they go over shared memory."""
    name = f"isthmus-py-agent-moves-{os.getpid()}"
    options = [("grpc.primary_user_agent", "py-test/2.0"), ("isthmus.upgrade", True)]
    with (
        Server("isthmus", cert_dir, "none", f"unix-abstract:{name}", f"shm://{name}"),
        isthmus.insecure_channel(f"unix-abstract:{name}", options) as channel,
    ):
        call = channel.unary_unary(METHOD)
        first = json.loads(call(b"", timeout=10))["agent"]
        end = time.monotonic() + 30
        while channel.upgrade_status() == "pending" and time.monotonic() < end:
            call(b"", timeout=10)
            time.sleep(0.01)
        assert channel.upgrade_status().startswith("shm://"), channel.upgrade_status()
        moved = json.loads(call(b"", timeout=10))["agent"]
        assert channel.transport_counts()["shm"] > 0
    assert first[0].startswith("py-test/2.0 tonic/"), first
    assert moved == ["py-test/2.0"], moved


def test_unknown_schemes_name_the_accepted_forms() -> None:
    for bad, words in (
        ("tcp://x:1", "shm://NAME"),
        ("localhost:http", "is not a port number"),
        ("ipv4:300.1.1.1:5", "is not an IPv4 address"),
    ):
        with pytest.raises(ValueError) as raised:
            isthmus.insecure_channel(bad)
        assert words in str(raised.value), (bad, str(raised.value))
    with pytest.raises(ValueError, match="unknown scheme"):
        isthmus.server(None).add_insecure_port("tcp://x:1")  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["tls", "mtls"])
def test_tls_between_isthmus_and_grpcio_both_ways(pems: certs.Certs, cert_dir: Path, mode: str) -> None:
    client_cert = (pems.client.key, pems.client.cert) if mode == "mtls" else (None, None)
    answers = {}
    for kind in ("grpcio", "isthmus"):
        with Server(kind, cert_dir, mode, "localhost:0") as server:
            (port,) = server.ports
            mine = isthmus.ssl_channel_credentials(pems.ca, *client_cert)
            theirs = grpc.ssl_channel_credentials(pems.ca, *client_cert)
            for target in (f"localhost:{port}", f"https://localhost:{port}", f"dns:///localhost:{port}"):
                answers[kind] = whoami(isthmus.secure_channel(target, mine))
            # The certificate covers localhost: an IP address is checked against the name given.
            by_ip = isthmus.secure_channel(
                f"127.0.0.1:{port}", mine, options=[("grpc.ssl_target_name_override", "localhost")]
            )
            assert whoami(by_ip)["auth"]["transport_security_type"] == ["c3Ns"]
            # grpc's own credentials, read by isthmus, make the same channel.
            with_theirs = whoami(isthmus.secure_channel(f"localhost:{port}", theirs))
            assert {**with_theirs, "peer": ""} == {**answers[kind], "peer": ""}, with_theirs
            if kind == "isthmus":
                # grpcio's client, with the same certificates, is told apart from nobody.
                grpcio_client = whoami(grpc.secure_channel(f"localhost:{port}", theirs))
                assert grpcio_client["auth"] == answers["isthmus"]["auth"], grpcio_client
    # What isthmus's handler is told of the caller is what grpcio's is told: the same keys and
    # values (the certificate's names, its PEM, the security level) and the same identities.
    for field in ("auth", "identities", "key"):
        assert answers["isthmus"][field] == answers["grpcio"][field], (field, answers)
    if mode == "mtls":
        assert answers["isthmus"]["identities"] == ["client.example", "spiffe://isthmus.test/client"]
        assert answers["isthmus"]["key"] == "x509_subject_alternative_name"


def test_client_roots_without_required_client_auth_ask_no_client_certificate(
    pems: certs.Certs, cert_dir: Path
) -> None:
    """As grpcio's: a server given client roots with `require_client_auth=False` asks clients
    for no certificate, so one another CA signed gets in, and a handler is told no client
    identity (isthmus's asked: it refused the first, and named the second's certificate)."""
    answers = {}
    for kind in ("grpcio", "isthmus"):
        with Server(kind, cert_dir, "mtls-optional", "localhost:0") as server:
            (port,) = server.ports
            seen = []
            for key, cert in (
                (None, None),
                (pems.client.key, pems.client.cert),
                (pems.other_client.key, pems.other_client.cert),
            ):
                credentials = grpc.ssl_channel_credentials(pems.ca, key, cert)
                seen.append(whoami(isthmus.secure_channel(f"localhost:{port}", credentials)))
            answers[kind] = [{**answer, "peer": ""} for answer in seen]
    assert answers["isthmus"] == answers["grpcio"], answers
    assert all(not answer["identities"] for answer in answers["isthmus"]), answers


def _refused_without_alpn(port: int, ca: Path) -> bool:
    """Whether a server closes on a TLS client that offers no ALPN, after its handshake,
    instead of answering its HTTP/2 preface with SETTINGS."""
    context = ssl.create_default_context(cafile=str(ca))
    with context.wrap_socket(
        socket.create_connection(("localhost", port), 10), server_hostname="localhost"
    ) as s:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))
        try:
            return s.recv(100) == b""
        except (ConnectionError, ssl.SSLError):
            return True


def test_tls_without_alpn_h2_is_refused_both_ways(pems: certs.Certs, cert_dir: Path) -> None:
    """gRPC requires ALPN "h2" of both sides, as grpc-core and grpc-go do: a server closes on
    a client that offered none (grpcio's does; isthmus's served it), and a channel refuses a
    server that picked none, UNAVAILABLE saying so (isthmus's sent it HTTP/2 regardless)."""
    for kind in ("grpcio", "isthmus"):
        with Server(kind, cert_dir, "tls", "localhost:0") as server:
            (port,) = server.ports
            assert _refused_without_alpn(port, cert_dir / "ca"), kind

    # A TLS server that picks no protocol, answering nothing.
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_dir / "server.crt", cert_dir / "server.key")
    listener = socket.create_server(("localhost", 0))
    held: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
                held.append(context.wrap_socket(conn, server_side=True))
            except OSError:  # the listener closed, or a client gave up on its handshake
                if listener.fileno() < 0:
                    return

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        port = listener.getsockname()[1]
        channel = isthmus.secure_channel(f"localhost:{port}", isthmus.ssl_channel_credentials(pems.ca))
        error = failure(channel)
        assert error.code() is grpc.StatusCode.UNAVAILABLE, error
        assert 'no ALPN "h2"' in (error.details() or ""), error
    finally:
        listener.shutdown(socket.SHUT_RDWR)  # wakes the accept
        listener.close()
        thread.join(10)
        for conn in held:
            conn.close()


def test_asyncio_secure_channel(pems: certs.Certs, cert_dir: Path) -> None:
    with Server("isthmus", cert_dir, "mtls", "localhost:0") as server:
        (port,) = server.ports

        async def call() -> dict[str, Any]:
            credentials = isthmus.ssl_channel_credentials(pems.ca, pems.client.key, pems.client.cert)
            async with isthmus.aio.secure_channel(f"localhost:{port}", credentials) as channel:
                return json.loads(await channel.unary_unary(METHOD)(b"", timeout=10))  # type: ignore[no-any-return]

        assert asyncio.run(call())["identities"] == ["client.example", "spiffe://isthmus.test/client"]


def test_certificate_problems_end_calls_unavailable_saying_which(pems: certs.Certs, cert_dir: Path) -> None:
    with (
        Server("grpcio", cert_dir, "mtls", "localhost:0") as mtls,
        Server("isthmus", cert_dir, "mtls", "localhost:0") as ours,
    ):
        cases = [
            (
                isthmus.ssl_channel_credentials(pems.other_ca, pems.client.key, pems.client.cert),
                "unknown issuer",
            ),
            (isthmus.ssl_channel_credentials(pems.ca), "client certificate"),
            (
                isthmus.ssl_channel_credentials(pems.ca, pems.other_client.key, pems.other_client.cert),
                "client certificate",
            ),
        ]
        for port in (mtls.ports[0], ours.ports[0]):
            for credentials, words in cases:
                error = failure(isthmus.secure_channel(f"localhost:{port}", credentials))
                assert error.code() == grpc.StatusCode.UNAVAILABLE, error
                assert words in error.details(), (port, words, error.details())
        # grpcio's client is refused by isthmus's server without a client certificate too.
        error = failure(
            grpc.secure_channel(f"localhost:{ours.ports[0]}", grpc.ssl_channel_credentials(pems.ca))
        )
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error


@pytest.mark.parametrize(
    ("which", "words"), [("expired", "expired"), ("wrong_host", "not valid for the host")]
)
def test_bad_server_certificates_say_which(pems: certs.Certs, which: str, words: str) -> None:
    pair = pems.expired_server if which == "expired" else pems.wrong_host_server
    with tempfile.TemporaryDirectory(prefix="isthmus-tls-") as d:
        Path(d, "server.crt").write_bytes(pair.cert)
        Path(d, "server.key").write_bytes(pair.key)
        with Server("grpcio", Path(d), "tls", "localhost:0") as server:
            credentials = isthmus.ssl_channel_credentials(pems.ca)
            error = failure(isthmus.secure_channel(f"localhost:{server.ports[0]}", credentials))
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error
            assert words in error.details(), error.details()


def test_credentials_are_checked() -> None:
    with pytest.raises(TypeError, match=r"isthmus\.ssl_channel_credentials"):
        isthmus.secure_channel("localhost:1", grpc.ChannelCredentials(None))
    with pytest.raises(ValueError, match="both"):
        isthmus.ssl_channel_credentials(None, b"key", None)
    with pytest.raises(ValueError, match=r"does not decode|no PEM"):
        isthmus.secure_channel("localhost:1", isthmus.ssl_channel_credentials(b"not a certificate"))
    with pytest.raises(ValueError, match="TCP"):
        isthmus.secure_channel("shm://x", isthmus.ssl_channel_credentials(None))
    with pytest.raises(ValueError, match="root_certificates"):
        isthmus.ssl_server_credentials([(b"k", b"c")], require_client_auth=True)
