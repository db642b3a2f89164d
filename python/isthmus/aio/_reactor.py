"""One engine `Reactor` per running event loop: its fd wakes the loop, and each wake-up resolves
the futures of every operation finished since, by token.

A loop that waits for no other isthmus operation and has no callback ready (`idle`; it may
still watch other sockets or timers, which then wait up to the spin bound) waits for the one
operation it starts on its own thread, with the GIL released, for up to the blocking client's
spin bound: a unary call over `shm://` is then sent and its reply read by the loop's thread
itself (the channel's blocking connection, as the sync API's), and any other operation is
waited for on the reactor (`settle`). A reply that comes within microseconds is then taken
with no sleep in the loop's selector and no wake-up through the eventfd, which cost tens of
microseconds each.

A standard loop (one with a selector) with operations pending that is about to sleep in its
selector first waits a shorter moment for their replies the same way (`BUSY_SPIN_US`): with
many calls in flight replies come microseconds apart, and each sleep and wake-up of the loop
costs more than that. Two such moments that find nothing stop them until a reply comes
through the selector, so a loop whose pending operations are slow (a long stream, a slow
server) spins at most twice between its replies. uvloop has no selector to wrap: it sleeps."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import weakref
from asyncio import selector_events
from collections.abc import Callable
from typing import Any

from .. import _native

#: How long `settle` waits on the loop's thread, in µs: the blocking client's spin bound.
SPIN_US = 50

#: How long a loop with operations pending waits for their replies on its own thread
#: before it sleeps in its selector, in µs (the module's doc).
BUSY_SPIN_US = 20

#: Spins in a row that found nothing, after which a loop sleeps until a reply wakes it.
BUSY_SPIN_MISSES = 2

_drivers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Driver] = weakref.WeakKeyDictionary()


class Driver:
    """Holds no reference to its loop, so the loop (the dictionary's key) can be collected."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.reactor = _native.Reactor()
        self._tokens = itertools.count()
        self._waiting: dict[int, asyncio.Future[Any]] = {}
        # Standing operations (a server's `listen_async`): their outcome goes to a callback, and
        # they never make the loop look busy to `idle`.
        self._standing: dict[int, Callable[[Any], None]] = {}
        #: Busy spins taken (the tests read it), and how many in a row found nothing.
        self.spins = 0
        self._missed = 0
        if isinstance(loop, selector_events.BaseSelectorEventLoop):
            self._wrap_select(loop, loop._selector)  # type: ignore[attr-defined]
        loop.add_reader(self.reactor.fileno(), self._drive)

    def begin(self, loop: asyncio.AbstractEventLoop) -> tuple[int, asyncio.Future[Any]]:
        """A token for one operation, and the future its outcome resolves: the operation's
        value, or the `CallError` it failed with (a value too, so that a failure nobody awaits
        is not logged as a lost exception)."""
        token = next(self._tokens)
        future = loop.create_future()
        self._waiting[token] = future
        return token, future

    def stand(self, start: Callable[[int], None], then: Callable[[Any], None]) -> int:
        """Starts a standing operation, `start(token)`, whose outcome is handed to `then` on the
        loop (which may start it again); its token, to abandon it."""
        token = next(self._tokens)
        self._standing[token] = then
        start(token)
        return token

    def token(self) -> int:
        """A token for an operation whose start may finish it at once (then nothing waits for
        it); `wait` makes the future of one that did not."""
        return next(self._tokens)

    def wait(self, loop: asyncio.AbstractEventLoop, token: int) -> asyncio.Future[Any]:
        """The future operation `token`'s outcome resolves, as `begin` gives."""
        future = loop.create_future()
        self._waiting[token] = future
        return future

    def abandon(self, token: int) -> None:
        """Stops operation `token` in the engine (a call it makes is cancelled on both sides)."""
        self._waiting.pop(token, None)
        self._standing.pop(token, None)
        self.reactor.cancel(token)

    def idle(self, loop: asyncio.AbstractEventLoop) -> bool:
        """No isthmus operation pending and no callback ready (the standard loop says so;
        uvloop does not, and is taken to have none): an operation started now may be waited
        for here."""
        return not self._waiting and not getattr(loop, "_ready", None)

    def finish(self, token: int, value: Any) -> None:
        """Resolves operation `token` with the value its start gave back at once."""
        future = self._waiting.pop(token, None)
        if future is not None and not future.done():
            future.set_result(value)

    def settle(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any]) -> None:
        """Waits a moment on this thread for `future`'s operation if it is the only one this
        loop waits for and the loop has no callback ready."""
        if future.done() or len(self._waiting) != 1 or getattr(loop, "_ready", None):
            return
        self._then(self.reactor.resolve(self._waiting, SPIN_US))

    def linger(self, loop: asyncio.AbstractEventLoop, wait: Callable[[int], bool] | None = None) -> None:
        """Waits a moment on this thread for news of a standing operation (a server's next
        call) if nothing else is pending and the loop has no callback ready: a call that comes
        within the spin bound then starts with no sleep in the selector and no wake-up.
        `wait(spin_us)`, if given, waits instead (GIL released), True if there is news. uvloop
        does not say whether callbacks are ready: there the loop always waits this moment."""
        if self._waiting or getattr(loop, "_ready", None):
            return
        if wait is None:
            self._then(self.reactor.resolve(self._waiting, SPIN_US))
        elif wait(SPIN_US):
            self._then(self.reactor.resolve(self._waiting))

    def forget(self) -> None:
        """Lets go of every operation's future and callback (its loop has closed: nothing will
        run them), so that they no longer hold the loop."""
        self._waiting.clear()
        self._standing.clear()

    def _drive(self) -> None:
        self._take()

    def _take(self, spin_us: int = 0) -> bool:
        """Resolves what has finished, after waiting up to `spin_us` for something to; whether
        anything did. A reply resets the waits' misses: the next ones may find more."""
        pending = len(self._waiting)
        standing = self.reactor.resolve(self._waiting, spin_us)
        if standing is None and len(self._waiting) == pending:
            return False
        self._missed = 0
        self._then(standing)
        return True

    def _wrap_select(self, loop: asyncio.AbstractEventLoop, selector: Any) -> None:
        """Makes the loop's selector wait `BUSY_SPIN_US` for the pending operations' replies
        before it would block (see the module's doc). The loop runs what they resolve in the
        same turn: its ready callbacks are counted after the select. A selector that takes no
        new `select` (a custom one with slots) is left as it is."""
        inner = selector.select
        waiting = self._waiting

        def select(timeout: float | None = None) -> Any:
            if not waiting or self._missed >= BUSY_SPIN_MISSES or timeout == 0:
                return inner(timeout)
            spin = BUSY_SPIN_US if timeout is None else min(BUSY_SPIN_US, int(timeout * 1e6))
            if spin <= 0:
                return inner(timeout)
            self.spins += 1
            try:
                if not self._take(spin):
                    self._missed += 1
                    return inner(timeout)
            except Exception as e:  # as `_drive`'s would be: reported, the loop goes on
                loop.call_exception_handler(
                    {"message": "isthmus could not resolve its operations", "exception": e}
                )
            return inner(0)

        with contextlib.suppress(AttributeError):
            selector.select = select

    def _then(self, standing: list[tuple[int, Any]] | None) -> None:
        """Hands the standing operations' outcomes to their callbacks; `Reactor.resolve` has
        resolved every waiting future of the batch first, so a callback that raises leaves
        none of it unresolved."""
        for token, value in standing or ():
            then = self._standing.pop(token, None)
            if then is None:
                continue  # abandoned
            try:
                then(value)
            except Exception as e:
                asyncio.get_running_loop().call_exception_handler(
                    {"message": "an isthmus server's news could not be handled", "exception": e}
                )


# Loops on several threads may make their drivers at once: the sweep iterates the dictionary.
_drivers_lock = threading.Lock()


def driver(loop: asyncio.AbstractEventLoop) -> Driver:
    found = _drivers.get(loop)
    if found is None:
        with _drivers_lock:
            found = _drivers.get(loop)
            if found is None:
                _forget_closed_loops()
                found = _drivers[loop] = Driver(loop)
    return found


def _forget_closed_loops() -> None:
    """Drops the drivers of loops that have closed. A driver holds the futures of what is
    pending on its loop, and each holds the loop: the weak key never went, and a loop closed
    with operations pending (a call never awaited) kept the loop, its driver and their engine
    operations for good. Dropped here (when another loop begins), the driver's reactor ends
    those operations."""
    for loop, found in list(_drivers.items()):
        if loop.is_closed():
            found.forget()
            del _drivers[loop]
