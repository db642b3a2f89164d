"""The Python cost of `isthmus.aio`'s unary call, without its transport: the channel's native
call is replaced by one that completes on the loop's next turn, as `py-aio-floor` completes
its futures, and 32 tasks call in a loop. Prints µs per call beside the floor's (the loop's own
cost of one future per call). Not part of `make bench`: a tool for work on the fast path.

Usage: .venv/bin/python bench/py_aio_overhead.py [CALLS]
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from py_client import floor_echo  # bench/ is on the path: this runs as a script

import isthmus.aio

TASKS = 32


class _Reply:
    """What the engine gives for a unary call that ended OK."""

    def __init__(self, message: bytes) -> None:
        self.message = message
        self.initial_metadata: list[Any] = []
        self.trailing_metadata: list[Any] = []


async def _per_call(echo: Callable[[bytes], Awaitable[Any]], calls: int) -> float:
    done = 0

    async def worker() -> None:
        nonlocal done
        while done < calls:
            await echo(b"x" * 64)
            done += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(TASKS)))
    return (time.perf_counter() - start) / done * 1e6


async def main(calls: int) -> None:
    loop = asyncio.get_running_loop()
    channel = isthmus.aio.insecure_channel("shm://py-aio-overhead-nobody")
    bound_loop, driver, _ = channel._bind()

    class Stub:
        def unary(self, token: int, *_: Any) -> bool:
            loop.call_soon(driver.finish, token, _Reply(b"x" * 64))
            return True

    stub = Stub()
    channel._bound = (bound_loop, driver, stub)  # type: ignore[assignment]
    assert channel._fast is not None
    channel._fast = (*channel._fast[:3], stub, *channel._fast[4:])  # the native path's view
    echo = channel.unary_unary("/bench.Echo/Unary")
    floor_us = await _per_call(floor_echo(loop), calls)
    ours_us = await _per_call(echo, calls)
    print(f"floor {floor_us:.2f} µs/call, isthmus.aio {ours_us:.2f} µs/call ({ours_us - floor_us:.2f} above)")


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 200_000))
