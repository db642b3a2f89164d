"""What an `isthmus.aio` server stream costs: 4 messages of 256 B over `shm://` from the engine's
echo server (`/bench.Echo/Stream`), one caller (µs per stream) and 32 tasks (streams/s). Not
part of `make bench`: a tool for work on the streaming path (ADR 0017's amendment measured
with it).

Usage: .venv/bin/python bench/py_aio_stream.py [SECONDS]
"""

from __future__ import annotations

import asyncio
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import isthmus.aio

ROOT = Path(__file__).resolve().parent.parent
COUNT, SIZE = 4, 256


async def main(target: str, seconds: float) -> None:
    async with isthmus.aio.insecure_channel(target) as channel:
        stream = channel.unary_stream("/bench.Echo/Stream")
        request = struct.pack("<II", COUNT, SIZE)

        async def one() -> None:
            got = [m async for m in stream(request, timeout=60)]
            assert len(got) == COUNT and all(len(m) == SIZE for m in got)

        for _ in range(500):  # warm-up: the connections, the fast path's too
            await one()
        for tasks in (1, 32):
            done = 0
            end = time.perf_counter() + seconds

            async def caller(end: float = end) -> None:
                nonlocal done
                while time.perf_counter() < end:
                    await one()
                    done += 1

            start = time.perf_counter()
            await asyncio.gather(*(caller() for _ in range(tasks)))
            rate = done / (time.perf_counter() - start)
            if tasks == 1:
                print(f"1 caller: {1e6 / rate:.1f} µs per stream")
            else:
                print(f"{tasks} tasks: {rate:.0f} streams/s")


if __name__ == "__main__":
    bench = ROOT / "target" / "release" / "isthmus-bench"
    assert bench.is_file(), f"{bench} is not built (cargo build --release -p isthmus-bench)"
    sock = Path(tempfile.gettempdir()) / f"py-aio-stream-{os.getpid()}.sock"
    address = f"shm://{sock}"
    server = subprocess.Popen([str(bench), "serve-isthmus", address], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "READY"
        asyncio.run(main(address, float(sys.argv[1]) if len(sys.argv) > 1 else 2.0))
    finally:
        server.kill()
        server.wait()
        sock.unlink(missing_ok=True)
