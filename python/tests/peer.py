"""Peer processes for the tests: the Rust `tonic-peer`, the Go `go-peer` and the Python
`echo_server` (isthmus, isthmus.aio or grpcio), each serving the Echo service on fresh
addresses."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Coroutine
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import uvloop
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parent
PATIENCE = 60.0  # a watchdog for lines a peer should print, not a timing assertion

PROTO = ROOT / "tests" / "proto"

_fresh = itertools.count()


def generate_stubs() -> Path:
    """`conformance_pb2` and `conformance_pb2_grpc` for the Python peers and clients, made in a
    fresh directory that is put on sys.path."""
    out = Path(tempfile.mkdtemp(prefix="isthmus-stubs-"))
    atexit.register(shutil.rmtree, out, True)
    proto = PROTO / "conformance.proto"
    assert (
        protoc.main(["protoc", f"-I{PROTO}", f"--python_out={out}", f"--grpc_python_out={out}", str(proto)])
        == 0
    )
    sys.path.insert(0, str(out))
    return out


def tonic_peer() -> Path | None:
    """The Rust peer cargo built (`make unit`); ISTHMUS_TONIC_PEER may name it."""
    path = Path(os.environ.get("ISTHMUS_TONIC_PEER") or ROOT / "target" / "debug" / "tonic-peer")
    return path if path.is_file() else None


def go_peer() -> Path | None:
    """The Go peer (`go/cmd/go-peer`, built by `make go-bins`); ISTHMUS_GO_PEER may name it."""
    path = Path(os.environ.get("ISTHMUS_GO_PEER") or ROOT / "target" / "go-bin" / "go-peer")
    return path if path.is_file() else None


#: The environment variable that picks an asyncio server peer's event loop: `asyncio` (the
#: default) or `uvloop`.
LOOP_ENV = "PEER_LOOP"


def run_loop(main: Coroutine[Any, Any, None]) -> None:
    """Runs an asyncio server peer's `main` on the loop `PEER_LOOP` names."""
    loop = os.environ.get(LOOP_ENV, "asyncio")
    if loop == "uvloop":
        uvloop.run(main)
    elif loop == "asyncio":
        asyncio.run(main)
    else:
        raise ValueError(f"{LOOP_ENV}={loop}: asyncio or uvloop")


def runtime_dir() -> Path:
    """Where `shm://NAME` sockets live, as the engine chooses it (`isthmus_shm::runtime_dir`)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "isthmus" if xdg else Path(f"/tmp/isthmus-{os.getuid()}")


def bound_unix_paths() -> set[str]:
    """The paths of the Unix sockets bound in this network namespace (`/proc/net/unix`)."""
    try:
        lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return set()
    # Num RefCount Protocol Flags Type St Inode [Path]
    return {fields[7] for fields in (line.split() for line in lines) if len(fields) > 7}


def fresh(transport: str) -> str:
    """An address no other test (or test run) uses; `http://` gets its port from the system. A
    `unix://` or `shm://` one's socket is removed when the session ends (a server killed with
    SIGKILL leaves it)."""
    tag = f"py-{os.getpid()}-{next(_fresh)}"
    if transport == "shm":
        atexit.register((runtime_dir() / f"{tag}.sock").unlink, missing_ok=True)
        return f"shm://{tag}"
    if transport == "unix":
        path = Path(tempfile.gettempdir()) / f"isthmus-{tag}.sock"
        atexit.register(path.unlink, missing_ok=True)
        return f"unix://{path}"
    return "http://127.0.0.1:0"


def grpcio_target(address: str) -> str:
    """An isthmus `unix://` or `http://` address as grpcio spells it."""
    if address.startswith("shm://"):
        raise ValueError(f"grpcio cannot reach {address}")
    return address.removeprefix("http://")


def thread_stopped(task: Path) -> bool:
    """Whether the thread `/proc/PID/task/TID` is stopped (or gone, or exiting)."""
    try:
        stat = (task / "stat").read_text()
    except OSError:
        return True
    # The state follows the command's closing parenthesis (a command may hold spaces).
    return stat[stat.rindex(")") + 2] in "tTZX"


class Peer:
    """A peer process; its stdout lines arrive on a queue, so waiting for one can give up."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        # The sockets of the `shm://NAME` targets it is given: a peer killed with SIGKILL
        # leaves them, so `kill9` removes those nobody has bound since.
        self._shm_sockets = [
            runtime_dir() / f"{target.removeprefix('shm://')}.sock"
            for arg in argv
            for target in arg.split(",")
            if target.startswith("shm://") and not target.startswith("shm:///")
        ]
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.expect("READY")

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def expect(self, prefix: str, patience: float = PATIENCE) -> str:
        """The next line that starts with `prefix`; fails if the peer exits or prints none."""
        while True:
            try:
                line = self._lines.get(timeout=patience)
            except queue.Empty:
                raise AssertionError(f"the peer printed no {prefix!r} line within {patience} s") from None
            if line is None:
                self._lines.put(None)
                raise AssertionError(f"the peer exited before printing {prefix!r}")
            if line.startswith(prefix):
                return line

    def expect_bidi_ended(self, seq: int, reasons: tuple[str, ...]) -> None:
        """Waits for the server to report that the Bidi call whose first request had `seq`
        ended for one of `reasons` (lines of earlier tests' calls are passed over)."""
        while True:
            words = self.expect("BIDI-ENDED").split()
            if words[-1] == str(seq):
                assert words[1] in reasons, (words, reasons)
                return

    def clear(self) -> None:
        """Forgets the lines printed so far."""
        while True:
            try:
                if self._lines.get_nowait() is None:
                    self._lines.put(None)
                    return
            except queue.Empty:
                return

    def terminate(self) -> None:
        self.process.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        """SIGSTOP; returns once every thread of the process has stopped. (kill(2) returns at
        once, and a process stops only when one of its threads takes the signal: on a busy
        machine its other threads ran on for milliseconds, reading and answering.)"""
        self.process.send_signal(signal.SIGSTOP)
        tasks = Path(f"/proc/{self.process.pid}/task")
        end = time.monotonic() + PATIENCE
        while not all(thread_stopped(t) for t in tasks.iterdir()):
            assert time.monotonic() < end, f"the peer did not stop within {PATIENCE} s"
            time.sleep(0.001)

    def resume(self) -> None:
        """SIGCONT: a stopped peer goes on."""
        self.process.send_signal(signal.SIGCONT)

    def kill9(self) -> None:
        """SIGKILL, as a crash would; returns once the process is gone, and its servers'
        private loopback sockets with it (a killed server cannot remove them)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for loopback in runtime_dir().glob(f"isthmus-loopback-{self.process.pid}-*.sock"):
            loopback.unlink(missing_ok=True)
        bound = bound_unix_paths()
        for path in self._shm_sockets:
            if str(path) not in bound:  # else a successor serves the same address
                path.unlink(missing_ok=True)

    def close(self) -> None:
        self.kill9()
        self._reader.join()
        assert self.process.stdout is not None
        self.process.stdout.close()


@dataclass
class Served:
    """A server peer and its address for each transport, as isthmus channels take them."""

    kind: str
    peer: Peer
    addresses: dict[str, str] = field(default_factory=dict)

    def expect_cancelled_bidi(self, seq: int) -> None:
        """Waits until the server saw the Bidi call whose first request had `seq` cancelled, as
        far as the server can tell: tonic reads a client's cancel as a half-close of the request
        stream (and tonic-peer names no call), and grpcio's request iterator may end either way
        (its failed read and the cancellation race); isthmus's servers always tell."""
        if self.kind in ("rust", "go"):
            self.peer.expect("BIDI-ENDED")
        elif self.kind == "grpcio":
            self.peer.expect_bidi_ended(seq, ("cancelled", "half-close"))
        else:
            self.peer.expect_bidi_ended(seq, ("cancelled",))

    def close(self) -> None:
        """Kills the peer and removes its sockets, which a killed server leaves behind."""
        self.peer.close()
        for address in self.addresses.values():
            if address.startswith("unix://"):
                Path(address.removeprefix("unix://")).unlink(missing_ok=True)


def serve(kind: str, transports: list[str], stubs: Path, targets: list[str] | None = None) -> Served:
    """Starts a server of `kind` (`rust`, `go`, `isthmus`, `isthmus-aio`, `grpcio`, or
    `isthmus-aio-uvloop`: `isthmus-aio` on uvloop) on `transports`, at fresh addresses unless
    `targets` names them (one per transport)."""
    targets = targets or [fresh(t) for t in transports]
    env = dict(os.environ)
    if kind == "isthmus-aio-uvloop":
        env[LOOP_ENV] = "uvloop"
    if kind == "rust":
        binary = tonic_peer()
        assert binary is not None, "tonic-peer is not built (cargo build -p isthmus-tests)"
        argv = [str(binary), *targets]
    elif kind == "go":
        binary = go_peer()
        assert binary is not None, "go-peer is not built (make go-bins)"
        argv = [str(binary), *targets]
    else:
        argv = [sys.executable, "-m", "echo_server", kind.removesuffix("-uvloop"), *targets]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), str(stubs), env.get("PYTHONPATH")]))
    served = Served(kind, Peer(argv, env))
    for transport, target in zip(transports, targets, strict=True):
        # Both peers announce their unix:// and http:// endpoints in the order given.
        served.addresses[transport] = (
            target if transport == "shm" else served.peer.expect("LISTENING ").removeprefix("LISTENING ")
        )
    return served


class SilentProxy:
    """A TCP proxy to `upstream` that forwards both ways until it is frozen; frozen, it drops
    what either side sends and keeps every socket open, so to both ends the connection is up
    and the other side silent, as a network that loses a flow makes it. Connections made while
    it is thawed forward again."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream, self.frozen = upstream, False
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            server = socket.create_connection(self.upstream)
            self.sockets += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if not self.frozen:
                    dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        # Shut down first: closing alone leaves the accept thread blocked on the old descriptor.
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for s in self.sockets:
            s.close()


class ServerBehindSilentProxy:
    """A grpcio server in this process of `/keep.K/Wait` (waits while its call is active, at
    most 30 s, having set `entered`) and `/keep.K/Echo`, behind a SilentProxy: `proxy.port` is
    where clients connect."""

    def __init__(self) -> None:
        self.entered = threading.Event()

        def wait(request: bytes, context: Any) -> bytes:
            self.entered.set()
            end = time.monotonic() + 30
            while context.is_active() and time.monotonic() < end:
                time.sleep(0.01)
            return b"not cancelled"

        handlers = {"Wait": wait, "Echo": lambda request, context: request}
        generic = grpc.method_handlers_generic_handler(
            "keep.K", {name: grpc.unary_unary_rpc_method_handler(h) for name, h in handlers.items()}
        )
        self.pool = futures.ThreadPoolExecutor(4)
        self.server = grpc.server(self.pool)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.add_generic_rpc_handlers((generic,))
        self.server.start()
        self.proxy = SilentProxy(("127.0.0.1", port))

    def close(self) -> None:
        self.proxy.close()
        self.server.stop(None)
        self.pool.shutdown()
