"""grpc.aio's client calls over the engine's `AsyncChannel`: a unary call is one engine operation
and one future; a streaming call is an `AsyncCall` whose operations complete through the loop's
`Reactor`. A call's end is a `CallError` (a local cancel is one too: CANCELLED) or OK."""

from __future__ import annotations

import abc
import asyncio
import collections
import logging
from collections.abc import AsyncIterable, AsyncIterator, Callable, Generator, Iterable
from typing import Any, Literal

import grpc
import grpc.aio

from .. import _native
from .._call import Deserializer, Serializer, decode, deserialize_failed, encode
from .._credentials import plugins_task_failed
from .._errors import LOCALLY_CANCELLED, rpc_error, status_code
from .._metadata import Metadatum, incoming_aio, outgoing
from .._native import CallError
from ._reactor import Driver

_LOG = logging.getLogger("isthmus")

_INTERNAL = 13
# grpc.aio's words for a call whose requests or responses are used both ways.
_API_STYLE_ERROR = "The iterator and read/write APIs may not be mixed on a single RPC."

RequestIterable = AsyncIterable[Any] | Iterable[Any]


def _local_cancel() -> CallError:
    return CallError(grpc.StatusCode.CANCELLED.value[0], LOCALLY_CANCELLED)


async def _aiter(requests: RequestIterable) -> AsyncIterator[Any]:
    if isinstance(requests, AsyncIterable):
        async for request in requests:
            yield request
    else:
        for request in requests:
            yield request


class _Call(abc.ABC):
    """What every call has: its deadline and its status, once over."""

    # Set by each shape: the native base's for a unary call, `_StreamCall.__init__`'s otherwise.
    _loop: asyncio.AbstractEventLoop
    _timeout: float | None
    _deadline: float | None
    _deserialize: Deserializer

    @abc.abstractmethod
    async def _end(self) -> CallError | None:
        """Waits for the call's end: the error it ended with, None for OK."""

    @abc.abstractmethod
    def _ok_trailers(self) -> list[Metadatum] | None:
        """The trailing metadata of a call that ended OK."""

    @abc.abstractmethod
    def _ok_details(self) -> str | None:
        """The message of the OK status a call ended with (nearly always empty)."""

    @abc.abstractmethod
    def _finished(self) -> asyncio.Future[Any]:
        """A future done when the call is over (for the channel's `close(grace)`)."""

    @abc.abstractmethod
    def cancel(self) -> bool:
        """Cancels the call, as grpc.aio's `cancel`."""

    @abc.abstractmethod
    def done(self) -> bool:
        """True once the call is over."""

    def time_remaining(self) -> float | None:
        if self._deadline is None or self._timeout is None:
            return None
        # Clamped to the timeout (`start + timeout - start` can round above it), and to 0 (a
        # negative timeout is a deadline passed already).
        return max(min(self._deadline - self._loop.time(), self._timeout), 0.0)

    async def trailing_metadata(self) -> grpc.aio.Metadata:
        error = await self._end()
        return incoming_aio(self._ok_trailers() if error is None else error.trailing_metadata)

    async def code(self) -> grpc.StatusCode:
        error = await self._end()
        return grpc.StatusCode.OK if error is None else status_code(error.code)

    async def details(self) -> str:
        error = await self._end()
        return (self._ok_details() or "") if error is None else error.details

    async def debug_error_string(self) -> str:
        error = await self._end()
        return "" if error is None else rpc_error(error, aio=True).debug_error_string()


class UnaryUnaryCall(_native.AioUnaryCall, _Call, grpc.aio.UnaryUnaryCall):
    """A unary call: the engine runs it whole as one operation; cancelling the call, or the
    task awaiting it, abandons that operation, which cancels the call on both sides.

    Made as `UnaryUnaryCall(loop, timeout, deserialize, outcome, driver, token, settle)`: the
    future `outcome` resolves to a `UnaryResult` or a `CallError`; `driver` is None for a call
    that failed before it started (nothing to abandon); `settle` waits for the outcome on the
    loop's thread first (`Driver.settle`). Awaiting it is the native base's (`__await__`, no
    generator: the hottest path there is); it comes here for what it raises."""

    def _abandon(self) -> None:
        if self._driver is not None:
            self._driver.abandon(self._token)

    def _raise(self, error: CallError) -> None:
        raise rpc_error(error, aio=True)

    def _undecodable(self) -> None:
        raise rpc_error(deserialize_failed(), aio=True)

    async def _result(self) -> Any:
        try:
            return await asyncio.shield(self._outcome)
        except asyncio.CancelledError:
            if self._outcome.cancelled():
                return _local_cancel()
            raise

    async def _end(self) -> CallError | None:
        value = await self._result()
        if isinstance(value, CallError):
            return value
        # A reply that does not deserialize fails the call INTERNAL (its await raises it), so
        # its status says so too, asked before the await or after.
        return None if self._decodes(value) else deserialize_failed()

    def _ok_trailers(self) -> list[Metadatum]:
        return self._outcome.result().trailing_metadata  # type: ignore[no-any-return]

    def _ok_details(self) -> str:
        return self._outcome.result().details  # type: ignore[no-any-return]

    def _finished(self) -> asyncio.Future[Any]:
        return self._outcome

    async def initial_metadata(self) -> grpc.aio.Metadata:
        return incoming_aio((await self._result()).initial_metadata)

    async def wait_for_connection(self) -> None:
        # The call runs whole as one operation: this waits for its end, and then, as grpc.aio's
        # does for a call that is over, raises how it ended (CancelledError after a cancel).
        error = await self._end()
        if self._outcome.cancelled():
            raise asyncio.CancelledError()
        if error is not None:
            self._raise(error)

    def cancel(self) -> bool:
        if self._outcome.done():
            return False
        # Its done callbacks run now, as grpc.aio's do when a cancel ends the call, not on the
        # loop's next turn as the future's cancel would run them.
        runs = [r for r in self.__dict__.pop("_done_runs", ()) if self._outcome.remove_done_callback(r)]
        self._outcome.cancel()
        self._abandon()
        for run in runs:
            _run_done_callback(self._loop, run, self._outcome)
        return True

    def cancelled(self) -> bool:
        return self._outcome.cancelled()

    def done(self) -> bool:
        return self._outcome.done()

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        if self.done():
            callback(self)  # at once, as grpc.aio's, not on the loop's next turn
            return

        def run(_: Any) -> None:
            callback(self)

        self._outcome.add_done_callback(run)
        # Kept for `cancel` (rare: no list for the calls that add none).
        self.__dict__.setdefault("_done_runs", []).append(run)


def _run_done_callback(loop: asyncio.AbstractEventLoop, callback: Callable[[Any], None], arg: Any) -> None:
    """Runs a done callback now, as the loop would run a future's later: what it raises goes to
    the loop's exception handler, not to the code that ended the call."""
    try:
        callback(arg)
    except Exception as e:
        loop.call_exception_handler({"message": f"Exception in callback {callback!r}", "exception": e})


#: What a stream's read-ahead (`_end`: `code()`, `details()`, `trailing_metadata()` awaited
#: while responses are still coming) keeps for a caller who reads them, in bytes, before it
#: waits for the caller to take some: about an HTTP/2 stream's window.
READ_AHEAD_BYTES = 4 << 20


class _CountedLock(asyncio.Lock):
    """An asyncio lock that counts the coroutines holding it or waiting for it: `users` is 0
    only when an acquire takes it at once. `locked()` alone says free while a waiter was woken
    and has not run yet; a stream read that took its fast path then went beside that waiter's
    receive, and the message it took was lost (`_StreamCall._recv`)."""

    def __init__(self) -> None:
        super().__init__()
        self.users = 0

    async def acquire(self) -> Literal[True]:
        self.users += 1
        try:
            return await super().acquire()
        except BaseException:
            self.users -= 1
            raise

    def release(self) -> None:
        super().release()
        self.users -= 1


class _StreamCall(_Call):
    """A call on an engine `AsyncCall`; the base of the three streaming shapes."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        driver: Driver,
        channel: _native.AsyncChannel,
        path: str,
        metadata: Any,
        timeout: float | None,
        wait_for_ready: bool,
        compression: str | None,
        serialize: Serializer,
        deserialize: Deserializer,
        requests: RequestIterable | None,
        asked: asyncio.Future[Any] | None = None,
    ) -> None:
        self._loop = loop
        self._timeout = timeout
        self._deadline = None if timeout is None else loop.time() + timeout
        self._deserialize = deserialize
        self._driver = driver
        self._serialize = serialize
        self._native: _native.AsyncCall | None = None
        self._done: asyncio.Future[None] = loop.create_future()
        self._status: CallError | None = None  # once `_done`; None for OK
        self._cancelled = False
        # Run when the call ends, from the code that ends it (as grpc.aio's run when its status
        # comes): by the time a reader sees the end, or `cancel()` returns, they have run.
        self._done_callbacks: list[Callable[[Any], None]] = []
        token = self._start_token = driver.token()
        # Resolves to the AsyncCall or a CallError; at once if the call started at once. A call
        # with call credentials starts once they have answered (`asked`, off the loop's
        # thread): `_start_when` resolves it then, unless a cancel comes first.
        started = (
            None
            if asked is not None
            else channel.start(token, path, metadata, timeout, wait_for_ready, compression)
        )
        if started is None:
            self._started = loop.create_future() if asked is not None else driver.wait(loop, token)
            self._started.add_done_callback(self._on_started)
        else:
            self._started = loop.create_future()
            self._started.set_result(started[1])
            self._on_started(self._started)
        self._done_writing = False
        # As grpc.aio: a call given its requests (an iterator, or the one request of a
        # unary-request call) takes no `write` or `done_writing`, and one read with `read`
        # is not iterated with `async for`, nor the other way round (`_style`).
        self._requests_given = requests is not None
        self._reading: str | None = None
        # One receive at a time (the initial metadata go beside it).
        self._receive_lock = _CountedLock()
        self._initial: list[Metadatum] | None = None
        self._early: collections.deque[bytes] = collections.deque()  # see `_read_ahead`
        self._early_bytes = 0
        self._taken: asyncio.Event | None = None  # set as a reader takes from `_early`
        self._tasks: list[asyncio.Task[Any]] = []
        self._drainer: asyncio.Task[None] | None = None  # see `_end`
        if asked is not None:
            start = self._start_when(asked, channel, path, timeout, wait_for_ready, compression)
            self._tasks.append(loop.create_task(start))
        if requests is not None and not self._send_now(requests):
            self._tasks.append(loop.create_task(self._write_all(requests)))

    async def _start_when(
        self,
        asked: asyncio.Future[Any],
        channel: _native.AsyncChannel,
        path: str,
        timeout: float | None,
        wait_for_ready: bool,
        compression: str | None,
    ) -> None:
        """Starts the call once its call credentials have answered (`asked`: the metadata,
        or the CallError that fails the call), unless it was cancelled meanwhile."""
        try:
            metadata = await asked
        except Exception as error:  # the plugins' task failed (the loop is closing): end the call
            metadata = plugins_task_failed(error)
        if self._started.done():
            return
        if isinstance(metadata, CallError):
            value = metadata
        else:
            token = self._start_token
            started = channel.start(token, path, outgoing(metadata), timeout, wait_for_ready, compression)
            value = started[1] if started is not None else await self._driver.wait(self._loop, token)
        if not self._started.done():
            self._started.set_result(value)

    def _send_now(self, requests: RequestIterable) -> bool:
        """Sends a unary request (the channel passes it as a 1-tuple) here, with the half-close
        in the same frame, if the call has started: no task per call, and the request goes
        before the caller's first read waits. False if a task must write the requests."""
        if self._native is None or not (isinstance(requests, tuple) and len(requests) == 1):
            return False
        self._done_writing = True
        try:
            message = encode(self._serialize, requests[0])
        except CallError as error:  # as grpcio's: the call fails INTERNAL
            self._fail(error)
            return True
        # Not sent at once (no room in the ring), it completes through the reactor, where its
        # outcome needs no waiter: a call that ended first is reported by the receiving side.
        self._begin(self._native, "send", message, True)
        return True

    def _on_started(self, started: asyncio.Future[Any]) -> None:
        # Also run by `_attempt`, which may take the call first: uvloop runs the reactor's
        # wake-up, which resolves the start, before handles already queued, so the call's own
        # tasks can find it started, and run it to its end, before this callback's turn (and
        # the call's OK trailers are read through `_native`).
        if self._native is not None:
            return
        value = started.result()
        if isinstance(value, CallError):
            self._close(value)
        else:
            self._native = value
            # Cancelled, or ended here (a request that did not encode), before the engine had
            # the call: it must not run on without its client.
            if self._cancelled or self._done.done():
                value.cancel()

    async def _attempt(self, operation: str, *args: Any) -> Any:
        """One engine operation (an AsyncCall method), once the call has started: its value
        or CallError. A cancelled waiter cancels the call, as in grpc.aio."""
        try:
            # Shielded: several coroutines may wait for the start, and one being cancelled
            # must not lose the AsyncCall for the others (and for `cancel`).
            call = self._started.result() if self._started.done() else await asyncio.shield(self._started)
        except asyncio.CancelledError:
            self.cancel()
            raise
        if isinstance(call, CallError):
            return call
        if self._native is None:
            self._on_started(self._started)
        token, done = self._begin(call, operation, *args)
        return done[1] if done is not None else await self._wait(token)

    def _begin(self, call: _native.AsyncCall, operation: str, *args: Any) -> tuple[int, Any]:
        """Starts `operation` on the started `call` under a new token: the token, and
        `(ok, value)` if it finished as it started (then nothing comes through the reactor:
        no trip through the loop's selector)."""
        token = self._driver.token()
        try:
            return token, getattr(call, operation)(token, *args)
        except BaseException:
            self._driver.abandon(token)
            raise

    async def _wait(self, token: int) -> Any:
        """The outcome of operation `token`, started and not finished at once. A cancelled
        waiter cancels the call, as in grpc.aio."""
        return await self._wait_for(token, self._driver.wait(self._loop, token))

    async def _wait_for(self, token: int, future: asyncio.Future[Any]) -> Any:
        """`_wait` for the `future` made for `token` already (`Driver.wait`)."""
        try:
            self._driver.settle(self._loop, future)
            return await future
        except BaseException as e:
            self._driver.abandon(token)  # nothing will wait for it any more
            if isinstance(e, asyncio.CancelledError):
                self.cancel()
            raise

    async def _op(self, operation: str, *args: Any) -> Any:
        """`_attempt`, where a CallError ends the call, and this raises its status."""
        return self._checked(await self._attempt(operation, *args))

    def _checked(self, value: Any) -> Any:
        """`value`, unless it is a CallError: that ends the call, and its status is raised."""
        if isinstance(value, CallError):
            self._close(value)
            self._raise_status()
        return value

    def _close(self, status: CallError | None) -> None:
        """Records how the call ended, and runs its done callbacks; the first end counts."""
        if not self._done.done():
            self._status = status
            self._done.set_result(None)
            callbacks, self._done_callbacks = self._done_callbacks, []
            for callback in callbacks:
                _run_done_callback(self._loop, callback, self)

    def _fail(self, error: CallError) -> None:
        """Ends the call with `error` found here (the server's data was wrong), even after the
        engine saw it end OK."""
        if self._native is not None:
            self._native.cancel()
        self._close(error)
        self._status = error

    def _raise_status(self) -> None:
        """Raises how the call ended, if not OK (it has ended): an RpcError, or CancelledError
        after a local cancel."""
        if self._cancelled:
            raise asyncio.CancelledError()
        if self._status is not None:
            raise rpc_error(self._status, aio=True)

    async def _end(self) -> CallError | None:
        # Shielded: a cancelled `code()` must not cancel the call.
        self._watch_end()
        await asyncio.shield(self._done)
        return self._status

    def _watch_end(self) -> None:
        """Has a task read on to the call's end, for whoever asked how it ends (`code()`,
        `done()`, a done callback): the engine gives the status after the responses, so with
        no reader at the end it would never come, and `done()` would stay False for a stream
        the server ended. The task keeps what it reads in `_early` for `read`, a message at a
        time, so that a reader still gets each as it comes; at most `READ_AHEAD_BYTES` of them
        (`_read_ahead`). Started on demand: a task per call costs the streams nobody asks."""
        if not self._done.done() and self._drainer is None and not self._loop.is_closed():
            self._drainer = self._loop.create_task(self._read_ahead())
            self._tasks.append(self._drainer)

    def _ok_trailers(self) -> list[Metadatum] | None:
        return None if self._native is None else self._native.trailing_metadata()

    def _ok_details(self) -> str | None:
        return None if self._native is None else self._native.details()

    def _finished(self) -> asyncio.Future[Any]:
        return self._done

    async def initial_metadata(self) -> grpc.aio.Metadata:
        # Not under the receive lock: the engine gives the headers while a receive waits for
        # a message (grpc.aio's are an operation of their own), and a client that waits for
        # them before it writes would wait for ever behind a read of the response.
        if self._initial is None:
            value = await self._attempt("initial_metadata")
            if self._initial is None:
                self._initial = value.initial_metadata if isinstance(value, CallError) else value
        return incoming_aio(self._initial)

    async def wait_for_connection(self) -> None:
        # As grpc.aio's: once the call has started, one that is over raises how it ended.
        if isinstance(await asyncio.shield(self._started), CallError) or self.done():
            self._raise_status()

    def cancel(self) -> bool:
        if self._done.done():
            return False
        self._cancelled = True
        if self._native is not None:
            self._native.cancel()
        elif not self._started.done():
            # Not started yet (connecting, or waiting for a server with wait_for_ready): the
            # start stops, and whoever waits for it hears of the cancel now.
            self._driver.abandon(self._start_token)
            self._started.set_result(_local_cancel())
        self._close(_local_cancel())
        for task in self._tasks:
            task.cancel()
        return True

    def cancelled(self) -> bool:
        return self._cancelled

    def done(self) -> bool:
        self._watch_end()
        return self._done.done()

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        if self.done():
            callback(self)  # at once, as grpc.aio's
            return
        self._done_callbacks.append(callback)

    @property
    def _done_writing_flag(self) -> bool:
        """grpc.aio's name for it: its intercepted calls read it off the call they wrap."""
        return self._done_writing

    # The sending side.

    async def _send(self, request: Any, last: bool = False) -> bool:
        try:
            message = encode(self._serialize, request)
        except CallError as error:  # as grpcio's: the call fails INTERNAL
            self._fail(error)
            self._raise_status()
        return await self._op("send", message, last)  # type: ignore[no-any-return]

    async def _write_all(self, requests: RequestIterable) -> None:
        try:
            if isinstance(requests, tuple) and len(requests) == 1:
                # A unary request (the channel passes it as a 1-tuple): it and the half-close
                # go in one frame.
                self._done_writing = True
                await self._send(requests[0], last=True)
                return
            async for request in _aiter(requests):
                if not await self._send(request):
                    return  # the call is over; the receiving side reports how
            await self._half_close()
        except grpc.RpcError:
            pass  # likewise
        except Exception:
            # At DEBUG, as grpc.aio logs it: the caller sees the call cancelled.
            _LOG.debug("The request iterator raised; cancelling the call", exc_info=True)
            self.cancel()

    async def write(self, request: Any) -> None:
        if self._requests_given:
            raise grpc.aio.UsageError(_API_STYLE_ERROR)
        if self._done.done():
            raise asyncio.InvalidStateError("RPC already finished.")
        if self._done_writing:
            raise asyncio.InvalidStateError('RPC is half closed after calling "done_writing".')
        if not await self._send(request):
            await self._read_ahead(unread_too=True)
            self._raise_status()

    async def done_writing(self) -> None:
        if self._requests_given:
            raise grpc.aio.UsageError(_API_STYLE_ERROR)
        await self._half_close()

    async def _half_close(self) -> None:
        if self._done.done() or self._done_writing:
            return
        self._done_writing = True
        await self._op("close_send")

    # The receiving side.

    async def _read_ahead(self, unread_too: bool = False) -> None:
        """Receives until the call's end, keeping the responses for `read`: the engine gives
        the status only after them. A message at a time, so that a reader waiting for the lock
        still gets each as it comes. What the caller has not taken yet is bounded
        (`READ_AHEAD_BYTES`): the stream's flow control then holds the server, as it would
        hold grpc.aio's, whose status waits for a reader too; with `unread_too`, only while
        the caller reads (a `write` that found the call over reads on to its status)."""
        while not self._done.done():
            # Past the deadline the bound goes: the engine tells a deadline to a receive that
            # finds nothing, and the status must come (the read-ahead read on before the bound).
            left = self.time_remaining()
            bounded = self._reading is not None or not unread_too
            if bounded and self._early_bytes >= READ_AHEAD_BYTES and left != 0.0:
                taken = self._taken = asyncio.Event()
                waiter = self._loop.create_task(taken.wait())
                try:
                    first = asyncio.FIRST_COMPLETED
                    await asyncio.wait((waiter, self._done), timeout=left, return_when=first)
                finally:
                    waiter.cancel()
                continue
            async with self._receive_lock:
                if self._done.done():
                    return
                value = await self._attempt("recv")
                if isinstance(value, bytes):
                    self._early.append(value)
                    self._early_bytes += len(value)
                else:  # None at an OK end, else the CallError it ended with
                    self._close(value)

    def _take_early(self) -> bytes:
        """The oldest response read ahead, for a reader."""
        message = self._early.popleft()
        self._early_bytes -= len(message)
        if self._taken is not None:
            self._taken.set()
        return message

    async def _recv(self) -> bytes | None:
        """The next response; None at an OK end. Raises the status otherwise."""
        native, lock = self._native, self._receive_lock
        if native is None or lock.users or self._early or self._done.done():
            async with lock:
                if self._early:
                    return self._take_early()
                if self._done.done():
                    self._raise_status()
                    return None
                return self._received(await self._attempt("recv"))
        # The usual case, one reader of a started call: a message already in is taken here,
        # with no coroutine of the lock's or of `_attempt`'s; one still to come is waited for
        # under the lock (free, and nobody waiting for it, so taken with no wait: nothing runs
        # in between, and no other receive goes beside this one). `_begin`, inline: a
        # function call less per message measured 6 % of a stream's throughput.
        token = self._driver.token()
        try:
            done = native.recv(token)
        except BaseException:
            self._driver.abandon(token)
            raise
        if done is not None:
            return self._received(done[1])
        future = self._driver.wait(self._loop, token)
        async with lock:
            return self._received(await self._wait_for(token, future))

    def _received(self, value: Any) -> bytes | None:
        """What a receive gave, for `_recv`: a message, or None at an OK end (the call is then
        over); a CallError ends the call and raises its status."""
        message = self._checked(value)
        if message is None:
            self._close(None)
        return message  # type: ignore[no-any-return]

    def _style(self, reading: str) -> None:
        """Reading the responses one way (`read`, or `async for`) after the other is grpc.aio's
        UsageError."""
        if self._reading is None:
            self._reading = reading
        elif self._reading != reading:
            raise grpc.aio.UsageError(_API_STYLE_ERROR)

    async def read(self) -> Any:
        # A call that is over, its responses all read, reads as over (EOF, or its error)
        # whichever way it was read, as with grpc.aio: the style counts while responses are
        # left (isthmus's may be over with responses read ahead, in `_early`).
        if not self._done.done() or self._early:
            self._style("read")
        return await self._read()

    async def _read(self) -> Any:
        message = await self._recv()
        if message is None:
            return grpc.aio.EOF
        try:
            return decode(self._deserialize, message)
        except CallError as e:
            self._fail(e)
            raise rpc_error(e, aio=True) from None

    async def _responses(self) -> AsyncIterator[Any]:
        while (response := await self._read()) is not grpc.aio.EOF:
            yield response

    def __aiter__(self) -> AsyncIterator[Any]:
        self._style("iterate")
        return self._responses()


class _UnaryResponse(_StreamCall):
    """A streaming call with one response, read by a task of its own from the start, so that
    its status comes whether or not the caller awaits it."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._response = self._loop.create_task(self._receive())
        self._tasks.append(self._response)
        self._drainer = self._response  # it reads to the end already

    async def _receive(self) -> Any:
        # Never raises an RpcError: the outcome is in `_status`, and a task's exception that
        # nobody retrieves would be logged.
        try:
            message = await self._recv()
            if message is None or await self._recv() is not None:
                raise CallError(_INTERNAL, "the server did not send exactly one response")
            return decode(self._deserialize, message)
        except CallError as e:
            self._fail(e)
        except grpc.RpcError:
            pass
        return None

    def __await__(self) -> Generator[Any, None, Any]:
        response = yield from self._response.__await__()
        self._raise_status()
        return response


class UnaryStreamCall(_StreamCall, grpc.aio.UnaryStreamCall):
    pass


class StreamUnaryCall(_UnaryResponse, grpc.aio.StreamUnaryCall):
    pass


class StreamStreamCall(_StreamCall, grpc.aio.StreamStreamCall):
    pass
