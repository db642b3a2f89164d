"""What a hostile HTTP/2 client costs an isthmus server: the measurements behind ADRs 0034,
0035 and 0036, rerunnable against any build (not part of ``make bench``; they time nothing the issues'
targets compare).

- ``hpack``: one header block of ~1 MB sent to a server binary's Unix socket (``tonic-peer`` by
  default), as empty Huffman-coded literals (``00 80 80``, three bytes a field) and as 38 long
  Huffman strings that stay within the 1 MiB bound; prints the server's CPU seconds for each
  (from ``/proc``, at the clock's tick). The decoder before ADR 0035 took 11.8 s and 0.10 s.
- ``gzip``: a grpcio client sends a Python isthmus server on a Unix socket one request of
  1 GiB of zeros compressed with gzip (about 1 MiB sent), once with the server's default
  limits and once with ``grpc.max_receive_message_length`` -1; prints the outcome and the
  server's peak memory (``VmHWM``). Before ADR 0034 the default took it: 35 -> 2,215 MB.
- ``loopback``: a grpcio client opens N ``/test.Echo/Flood`` calls to a server binary's TCP
  port (``rpc-peer`` by default, which answers HTTP/2 through its loopback) and reads none of
  their replies; 4 s later, prints the server's memory (``VmRSS``, ``VmHWM``) and how another
  client's 100 kB ``/test.Echo/Unary`` call with a 3 s deadline ended. Before ADR 0036, 24
  calls made it DEADLINE_EXCEEDED (the loopback's arena full), at 142 MB.

Usage::

    python bench/http2_abuse.py hpack [PEER_BINARY]     # default target/debug/tonic-peer
    python bench/http2_abuse.py gzip
    python bench/http2_abuse.py loopback [PEER_BINARY [N ...]]   # target/release/rpc-peer; 24 96 192
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    n = len(payload)
    return bytes([n >> 16 & 255, n >> 8 & 255, n & 255, kind, flags]) + struct.pack(">I", stream) + payload


def header_block(block: bytes) -> bytes:
    """The preface, SETTINGS, and `block` as HEADERS and CONTINUATIONs of 16 KiB on stream 1."""
    pieces = [block[i : i + 16384] for i in range(0, len(block), 16384)]
    out = PREFACE + frame(4, 0, 0, b"") + frame(1, 4 if len(pieces) == 1 else 0, 1, pieces[0])
    for i, piece in enumerate(pieces[1:], start=2):
        out += frame(9, 4 if i == len(pieces) else 0, 1, piece)
    return out


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_mb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM"):
            return int(line.split()[1]) // 1024
    return 0


def hpack(peer: str) -> None:
    empty = b"\x00\x80\x80" * (1_000_000 // 3)
    # Literal without indexing, name "x", a 16,000-byte Huffman value of '0's (25,600 decoded).
    long = (b"\x00\x01x" + bytes([0xFF, 0x81, 0x7C]) + bytes(16_000)) * 38
    with tempfile.TemporaryDirectory() as tmp:
        sock = f"{tmp}/peer.sock"
        server = subprocess.Popen([peer, f"unix://{sock}"], stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None
            while "LISTENING" not in server.stdout.readline():
                pass
            for name, block in (("empty Huffman literals", empty), ("long Huffman strings", long)):
                sent = header_block(block)
                before, began = cpu_seconds(server.pid), time.monotonic()
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(sock)
                    s.sendall(sent)
                    # The connection ends on a block past the bound; one within it stays open,
                    # its call waiting for a body, so the wait for its CPU is bounded.
                    s.settimeout(5)
                    try:
                        while s.recv(65536):
                            pass
                    except OSError:
                        pass
                print(
                    f"{name}: {len(sent)} bytes sent; server CPU {cpu_seconds(server.pid) - before:.2f} s "
                    f"over {time.monotonic() - began:.1f} s"
                )
        finally:
            server.kill()
            server.wait()


SERVER = """
import sys, grpc, isthmus
from concurrent import futures
options = None if sys.argv[1] == "default" else [("grpc.max_receive_message_length", -1)]
length = grpc.unary_unary_rpc_method_handler(lambda request, context: str(len(request)).encode())
server = isthmus.server(
    futures.ThreadPoolExecutor(2),
    handlers=[grpc.method_handlers_generic_handler("t.T", {"L": length})],
    options=options,
)
server.add_insecure_port(sys.argv[2])
server.start()
print("READY", flush=True)
server.wait_for_termination()
"""


def gzip() -> None:
    request = bytes(1 << 30)
    for mode in ("default", "unlimited"):
        with tempfile.TemporaryDirectory() as tmp:
            target = f"unix://{tmp}/server.sock"
            server = subprocess.Popen(
                [sys.executable, "-c", SERVER, mode, target], stdout=subprocess.PIPE, text=True, cwd=ROOT
            )
            try:
                assert server.stdout is not None
                server.stdout.readline()
                before = peak_mb(server.pid)
                with grpc.insecure_channel(target, compression=grpc.Compression.Gzip) as channel:
                    try:
                        taken = channel.unary_unary("/t.T/L")(request, timeout=120)
                        outcome = f"took {taken.decode()} bytes"
                    except grpc.RpcError as e:
                        outcome = f"{e.code().name} {e.details()}"
                print(f"{mode} limits: {outcome}; server peak {before} -> {peak_mb(server.pid)} MB")
            finally:
                server.kill()
                server.wait()


def rss_mb(pid: int) -> tuple[int, int]:
    """The process's resident memory now and at its peak, MB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]) // 1024, int(fields["VmHWM"].split()[0]) // 1024


def loopback(peer: str, counts: list[int]) -> None:
    for n in counts:
        tmp = tempfile.TemporaryDirectory()  # the shm:// socket a killed server leaves goes with it
        addresses = f"shm://{tmp.name}/peer.sock,http://127.0.0.1:0"
        server = subprocess.Popen([peer, addresses], stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None
            line = ""
            while not line.startswith("LISTENING "):
                line = server.stdout.readline()
            target = line.split()[1].removeprefix("http://")
            with grpc.insecure_channel(target) as hog, grpc.insecure_channel(target) as other:
                floods = [hog.unary_stream("/test.Echo/Flood")(b"go") for _ in range(n)]
                time.sleep(4)
                now, peak = rss_mb(server.pid)
                try:
                    other.unary_unary("/test.Echo/Unary")(bytes(100_000), timeout=3)
                    outcome = "answered"
                except grpc.RpcError as e:
                    outcome = e.code().name
                print(f"{n} unread calls: server RSS {now} MB (peak {peak}); another client's call {outcome}")
                for flood in floods:
                    flood.cancel()
        finally:
            server.kill()
            server.wait()
            tmp.cleanup()


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "hpack":
        hpack(sys.argv[2] if len(sys.argv) > 2 else str(ROOT / "target/debug/tonic-peer"))
    elif what == "gzip":
        gzip()
    elif what == "loopback":
        peer = sys.argv[2] if len(sys.argv) > 2 else str(ROOT / "target/release/rpc-peer")
        loopback(peer, [int(n) for n in sys.argv[3:]] or [24, 96, 192])
    else:
        sys.exit(__doc__)
