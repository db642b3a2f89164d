"""One engine `Reactor` per running event loop: its fd wakes the loop, and each wake-up resolves
the futures of every operation finished since, by token."""

from __future__ import annotations

import asyncio
import itertools
import weakref
from typing import Any

from .. import _native

_drivers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Driver] = weakref.WeakKeyDictionary()


class Driver:
    """Holds no reference to its loop, so the loop (the dictionary's key) can be collected."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.reactor = _native.Reactor()
        self._tokens = itertools.count()
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        loop.add_reader(self.reactor.fileno(), self._drive)

    def begin(self, loop: asyncio.AbstractEventLoop) -> tuple[int, asyncio.Future[Any]]:
        """A token for one operation, and the future its outcome resolves: the operation's
        value, or the `CallError` it failed with (a value too, so that a failure nobody awaits
        is not logged as a lost exception)."""
        token = next(self._tokens)
        future = loop.create_future()
        self._waiting[token] = future
        return token, future

    def abandon(self, token: int) -> None:
        """Stops operation `token` in the engine (a call it makes is cancelled on both sides)."""
        self._waiting.pop(token, None)
        self.reactor.cancel(token)

    def _drive(self) -> None:
        waiting = self._waiting
        for token, _ok, value in self.reactor.drain():
            future = waiting.pop(token, None)
            if future is not None and not future.done():  # done: its waiter was cancelled
                future.set_result(value)


def driver(loop: asyncio.AbstractEventLoop) -> Driver:
    found = _drivers.get(loop)
    if found is None:
        found = _drivers[loop] = Driver(loop)
    return found
