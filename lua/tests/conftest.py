"""The Lua module's tests: a real nginx (Debian's, with its Lua module) started in a fresh
prefix on a free port, whose one worker runs `cases.lua` against real servers (the Rust, Go and
Python peers of python/tests) over shared memory and HTTP/2."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python" / "tests"))

from peer import Served, generate_stubs, go_peer, serve, tonic_peer  # noqa: E402

LUA = ROOT / "lua"
PATIENCE = 60.0  # a watchdog for a server to come up, not a timing assertion


def need(ready: bool, why: str) -> None:
    """Skips the test when something it needs is missing, or fails it under `make test`
    (ISTHMUS_REQUIRE_PEERS=1), where everything must be there."""
    if not ready:
        if os.environ.get("ISTHMUS_REQUIRE_PEERS") == "1":
            pytest.fail(why)
        pytest.skip(why)


def library() -> Path:
    """The C ABI's library the module loads (`make capi`); ISTHMUS_LIB may name it."""
    return Path(os.environ.get("ISTHMUS_LIB") or ROOT / "target" / "debug" / "libisthmus_capi.so")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


CONF = """
load_module /usr/lib/nginx/modules/ndk_http_module.so;
load_module /usr/lib/nginx/modules/ngx_http_lua_module.so;
{user}
worker_processes 1;
daemon off;
master_process on;
error_log {prefix}/logs/error.log info;
pid {prefix}/logs/nginx.pid;
env ISTHMUS_LIB;
env ISTHMUS_UPGRADE;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    lua_package_path "{lua}/lib/?.lua;{lua}/tests/?.lua;;";
    lua_shared_dict isthmus_tests 1m;
    {http_extra}
    init_worker_by_lua_block {{
        require("cases").init_worker("{proto}", "{init_target}")
    }}
    server {{
        listen 127.0.0.1:{port};
        location = /plain {{ content_by_lua_block {{ ngx.say("plain") }} }}
        location /case/ {{ content_by_lua_block {{ require("cases").serve() }} }}
        location /access/ {{
            access_by_lua_block {{ require("cases").access() }}
            content_by_lua_block {{ ngx.say(ngx.ctx.answer) }}
        }}
    }}
}}
"""


class Nginx:
    """nginx with the Lua module in a prefix of its own; stopped and removed by `close`. With
    `init_target`, its worker calls that server from init_worker_by_lua (cases.lua);
    `http_extra` goes into its `http` block."""

    def __init__(self, init_target: str = "", http_extra: str = "") -> None:
        module = Path("/usr/lib/nginx/modules/ngx_http_lua_module.so")
        need(
            shutil.which("nginx") is not None and module.is_file(),
            "nginx with its Lua module is missing (make lua-tools)",
        )
        need(library().is_file(), f"{library()} is not built (make capi)")
        self.prefix = Path(tempfile.mkdtemp(prefix="isthmus-nginx-"))
        (self.prefix / "logs").mkdir()
        self.port = free_port()
        conf = CONF.format(
            # Workers run as the test's own user, so that shm:// names and the peer check agree.
            user="user root;" if os.geteuid() == 0 else "",
            prefix=self.prefix,
            lua=LUA,
            port=self.port,
            proto=ROOT / "tests" / "proto" / "conformance.proto",
            init_target=init_target,
            http_extra=http_extra,
        )
        (self.prefix / "nginx.conf").write_text(conf)
        env = dict(os.environ, ISTHMUS_LIB=str(library()))
        self.process = subprocess.Popen(
            [
                "nginx",
                "-p",
                str(self.prefix),
                "-c",
                str(self.prefix / "nginx.conf"),
                "-e",
                str(self.prefix / "logs" / "stderr.log"),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        end = time.monotonic() + PATIENCE
        while True:
            try:
                self.get("/plain")
                break
            except OSError:
                if self.process.poll() is not None or time.monotonic() > end:
                    raise AssertionError(f"nginx did not start: {self.errors()}") from None
                time.sleep(0.05)

    def get(self, path: str, timeout: float = PATIENCE) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=timeout) as r:
            return str(r.read().decode())

    def case(self, name: str, target: str, **args: object) -> dict:
        """Runs case `name` of cases.lua against `target` in the worker; its JSON result."""
        query = urllib.parse.urlencode({"target": target, **{k: str(v) for k, v in args.items()}})
        return dict(json.loads(self.get(f"/case/{name}?{query}")))

    def logged_errors(self) -> list[str]:
        """The log's errors, and the module's warnings of a write to a global Lua variable
        (lua-resty convention: a library keeps its state in locals and its module table)."""
        return [
            line
            for line in self.errors().splitlines()
            if "[error]" in line
            or "[alert]" in line
            or "[crit]" in line
            or "writing a global Lua variable" in line
        ]

    def errors(self) -> str:
        log = self.prefix / "logs" / "error.log"
        return log.read_text() if log.exists() else ""

    def worker_pids(self) -> list[int]:
        out = subprocess.run(
            ["pgrep", "-P", str(self.process.pid)], check=False, capture_output=True, text=True
        )
        return [int(p) for p in out.stdout.split()]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGQUIT)  # graceful: the worker must be able to exit
            try:
                self.process.wait(timeout=PATIENCE)
            except subprocess.TimeoutExpired:
                workers = self.worker_pids()  # a stuck worker outlives a killed master
                self.process.kill()
                self.process.wait()
                for pid in workers:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                raise AssertionError("nginx did not shut down gracefully") from None
        shutil.rmtree(self.prefix, ignore_errors=True)


@pytest.fixture(scope="session")
def nginx() -> Iterator[Nginx]:
    n = Nginx()
    yield n
    errors = n.logged_errors()
    n.close()
    assert not errors, "nginx logged errors:\n" + "\n".join(errors)


@pytest.fixture(scope="session")
def stubs() -> Iterator[Path]:
    out = generate_stubs()
    yield out
    shutil.rmtree(out, ignore_errors=True)


@pytest.fixture(scope="session")
def servers(stubs: Path) -> Iterator[Callable[[str], Served]]:
    """Echo servers by kind (`rust`, `go`, `isthmus` for Python) on shm://, http:// and unix://
    (`grpcio`: http:// and unix:// only), started on first use and again if one died."""
    started: dict[str, Served] = {}

    def get(kind: str) -> Served:
        need(kind != "rust" or tonic_peer() is not None, "tonic-peer is not built (make unit)")
        need(kind != "go" or go_peer() is not None, "go-peer is not built (make go-bins)")
        if kind not in started or started[kind].peer.process.poll() is not None:
            transports = ["http", "unix"] if kind == "grpcio" else ["shm", "http", "unix"]
            started[kind] = serve(kind, transports, stubs)
        return started[kind]

    yield get
    for served in started.values():
        served.close()
