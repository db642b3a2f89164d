"""The blocking API's calls in progress: one class is the response iterator of a streaming call
and the future of a call with one response, as grpcio's rendezvous is."""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from . import _native
from ._errors import LOCALLY_CANCELLED, Ended, RpcError, rpc_error, status_code, traceback_of
from ._metadata import Metadata, Metadatum, incoming
from ._native import CallError

_LOG = logging.getLogger("isthmus")

Serializer = Callable[[Any], bytes] | None
Deserializer = Callable[[bytes], Any] | None

_INTERNAL = 13


#: grpcio's details for a request that could not be serialized.
SERIALIZE_FAILED = "Exception serializing request!"


def encode(serialize: Serializer, request: Any) -> bytes:
    """A request as it goes out; a serializer's failure fails the call (INTERNAL) as grpc's does,
    and so does a request that serializes to None (grpcio reads None as its serializer's
    failure, and so sends no None)."""
    if serialize is None:
        message = request
    else:
        try:
            message = serialize(request)
        except CallError:
            raise  # a limit's (see `_channel.limited`)
        except Exception as e:
            raise serialize_failed(e) from e
    if message is None:
        raise CallError(_INTERNAL, SERIALIZE_FAILED)
    return message  # type: ignore[no-any-return]


def serialize_failed(error: BaseException) -> CallError:
    """What a serializer that raised `error` fails its call with, as grpc's: INTERNAL, logged."""
    _LOG.error(SERIALIZE_FAILED, exc_info=error)
    return CallError(_INTERNAL, SERIALIZE_FAILED)


def decode(deserialize: Deserializer, message: bytes) -> Any:
    """A response as the caller sees it; a deserializer's failure fails the call as grpc's does."""
    if deserialize is None:
        return message
    try:
        return deserialize(message)
    except Exception as e:
        raise deserialize_failed() from e


def deserialize_failed() -> CallError:
    """What a deserializer that raised fails its call with, as grpc's: INTERNAL."""
    return CallError(_INTERNAL, "Exception deserializing response!")


def buffer_size(message: Any) -> int | None:
    """The bytes a message sends: the length of `bytes`, a `Block` or a `Message`, the size of
    any other C-contiguous buffer; None for what is neither (the call refuses it itself)."""
    if isinstance(message, (bytes, _native.Block, _native.Message)):
        return len(message)
    try:
        with memoryview(message) as view:
            return view.nbytes if view.c_contiguous else None
    except TypeError:
        return None


class Succeeded(Ended, grpc.Call, grpc.Future):
    """A unary call that ended OK, as `with_call` returns it: a done `grpc.Future` of its
    response too, as grpcio's."""

    def __init__(
        self,
        initial: Sequence[Metadatum],
        trailing: Sequence[Metadatum] | None,
        details: str = "",
        response: Any = None,
    ) -> None:
        self._initial = incoming(initial)
        self._trailing = incoming(trailing)
        self._details = details
        self._response = response

    def result(self, timeout: float | None = None) -> Any:
        return self._response

    def exception(self, timeout: float | None = None) -> None:
        return None

    def traceback(self, timeout: float | None = None) -> None:
        return None

    def debug_error_string(self) -> str:
        return ""  # grpcio's for a call that succeeded

    def initial_metadata(self) -> Metadata:
        return self._initial

    def trailing_metadata(self) -> Metadata:
        return self._trailing

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.OK

    def details(self) -> str:
        return self._details


class Completions:
    """The thread that completes every channel's unary `.future()` calls: each is an operation
    of one engine `Reactor`, finished by the engine's reader tasks, so no thread waits per
    call (as grpcio's futures all wait in its core), and the status watches of response
    streams (`Call._watch`). Started on first use. It runs no code of the application's: the
    done callbacks of the calls it ends go to `CALLBACK_THREADS`. (They ran on it: one that
    blocked held up every other future, and one that read a response stream whose status was
    watched waited for ever, since the watch's operation runs on this thread too.)"""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: int | None = None  # the completion thread's ident, once it runs
        self._reactor: _native.Reactor | None = None
        self._tokens = itertools.count()
        # token -> (done, whether a forked child ends it UNAVAILABLE)
        self._waiting: dict[int, tuple[Callable[[bool, Any], None], bool]] = {}
        # Reactors of the processes this one was forked from: kept, not dropped (their end
        # would reach for the parent's tasks, which do not run here).
        self._forsaken: list[_native.Reactor] = []

    def after_fork(self) -> None:
        """In a forked child: the parent's completion thread does not exist here, nor its
        operations; the next `begin` starts afresh. The unary calls the parent had in flight
        end UNAVAILABLE here (their replies go to the parent), each on a thread of its own:
        their done callbacks are the user's, which must not run inside `fork`, and a call whose
        lock a parent's thread held at the fork holds up only its own."""
        self._lock = threading.Lock()  # a parent's thread may have held it at the fork
        self._thread = None
        if self._reactor is not None:
            self._forsaken.append(self._reactor)
        orphans = [done for done, ends_in_child in self._waiting.values() if ends_in_child]
        self._reactor, self._waiting = None, {}
        for done in orphans:
            threading.Thread(target=_end_in_child, args=(done,), daemon=True).start()

    def begin(
        self, done: Callable[[bool, Any], None], ends_in_child: bool = False
    ) -> tuple[_native.Reactor, int]:
        """The reactor and a token for one operation; `done(ok, value)` runs on the completion
        thread when it finishes, or with a `CallError` (UNAVAILABLE) in a child forked before
        then if `ends_in_child` (a unary call's end; a stream's watch ends by its own reads)."""
        with self._lock:
            if self._reactor is None:
                self._reactor = _native.Reactor()
                threading.Thread(
                    target=self._run, args=(self._reactor,), name="isthmus-futures", daemon=True
                ).start()
            token = next(self._tokens)
            self._waiting[token] = (done, ends_in_child)
            return self._reactor, token

    def abandon(self, token: int) -> None:
        """Operation `token` will not complete; a call it was making is cancelled."""
        with self._lock:
            self._waiting.pop(token, None)
            reactor = self._reactor
        if reactor is not None:
            reactor.cancel(token)

    def on_thread(self) -> bool:
        """Whether this is the completion thread."""
        return threading.get_ident() == self._thread

    def _run(self, reactor: _native.Reactor) -> None:
        self._thread = threading.get_ident()
        while True:
            for token, ok, value in reactor.wait(None):
                with self._lock:
                    entry = self._waiting.pop(token, None)
                if entry is not None:
                    try:
                        entry[0](ok, value)
                    except Exception:  # the thread must go on: every other future waits on it
                        _LOG.exception("completing a .future() call failed")


def _end_in_child(done: Callable[[bool, Any], None]) -> None:
    """Ends, in a forked child, a call its parent had in flight (`Completions.after_fork`,
    `_after_fork_in_child`)."""
    try:
        done(False, CallError(grpc.StatusCode.UNAVAILABLE.value[0], FORKED_AWAY))
    except Exception:
        _LOG.exception("completing a .future() call failed")


#: Why a `.future()` in flight at a fork fails in the child.
FORKED_AWAY = "the call was made by the parent process before a fork: its reply goes there"


#: The process's one: every channel's `.future()` calls and response streams' status watches.
COMPLETIONS = Completions()


class CallbackThreads:
    """Runs the done callbacks of the calls that the completion thread ends, each call's in
    order, on threads of their own: grpcio runs a future's callbacks on its channel's thread,
    not on the one every future waits on. A callback that blocks (waiting for another
    future's result, or reading a response stream) then holds up no other call's end and no
    other call's callbacks: each batch goes to an idle thread, or to a new one, and a thread
    idle for `IDLE_S` ends."""

    IDLE_S = 10.0

    def __init__(self) -> None:
        self._ready = threading.Condition(threading.Lock())
        self._tasks: collections.deque[list[Callable[[], None]]] = collections.deque()
        self._idle = 0  # threads waiting for a batch

    def run(self, callbacks: list[Callable[[], None]]) -> None:
        with self._ready:
            self._tasks.append(callbacks)
            if len(self._tasks) <= self._idle:
                self._ready.notify()
                return
        threading.Thread(target=self._serve, name="isthmus-callbacks", daemon=True).start()

    def _serve(self) -> None:
        with self._ready:
            while True:
                while self._tasks:
                    callbacks = self._tasks.popleft()
                    self._ready.release()
                    try:
                        Call._run_callbacks(callbacks)
                    finally:
                        self._ready.acquire()
                self._idle += 1
                came = self._ready.wait_for(lambda: bool(self._tasks), self.IDLE_S)
                self._idle -= 1
                if not came:
                    return

    def after_fork(self) -> None:
        """In a forked child: no thread of the parent's runs here, and the batches it had not
        run yet are the parent's calls' (run there)."""
        self._ready = threading.Condition(threading.Lock())
        self._tasks = collections.deque()
        self._idle = 0


#: The process's one (`CallbackThreads`).
CALLBACK_THREADS = CallbackThreads()

#: Calls that a thread of their own brings to their end, or starts, while it runs
#: (`run_on_own_thread`), by the thread's token: one call may have two such threads at once
#: (the one that asked its credentials starts the one that runs it).
_ON_OWN_THREAD: weakref.WeakValueDictionary[int, Call] = weakref.WeakValueDictionary()
_OWN_THREADS = itertools.count()


def channel_closed() -> CallError:
    """How a call ends that its channel's `close` ended (or that came too late to start), in
    grpcio's words."""
    return CallError(grpc.StatusCode.CANCELLED.value[0], "Channel closed!")


def run_on_own_thread(call: Call, target: Callable[[], None], name: str) -> None:
    """Runs `target`, which ends `call` or starts it, on a thread of its own: a `.future()` with
    a request iterator (the iterator's thread), or a call whose call credentials or server are
    waited for before it starts. A child forked meanwhile has no such thread; the call ends
    UNAVAILABLE there (`_after_fork_in_child`), as a unary `.future()` does."""
    token = next(_OWN_THREADS)
    _ON_OWN_THREAD[token] = call

    def run() -> None:
        try:
            target()
        except ValueError as e:
            # The channel was closed before the call could start here (the native channel's
            # refusal): it ends as the calls in progress at the close did. The error ended this
            # thread, and the call waited for ever.
            if str(e).startswith("Cannot invoke RPC"):
                call._end(channel_closed())
            else:
                call._end(CallError(grpc.StatusCode.UNKNOWN.value[0], f"the call could not start: {e}"))
        finally:
            _ON_OWN_THREAD.pop(token, None)

    threading.Thread(target=run, name=name, daemon=True).start()


def _after_fork_in_child() -> None:
    """In a forked child: the calls the parent had in flight on threads of their own
    (`run_on_own_thread`) end UNAVAILABLE, each on a thread of its own, as
    `Completions.after_fork` ends the unary ones (a call already over stays as it was). Both
    are taken before any such thread starts, since a done callback may start new calls."""
    global _ON_OWN_THREAD
    taken, _ON_OWN_THREAD = _ON_OWN_THREAD, weakref.WeakValueDictionary()
    calls = {id(call): call for call in taken.values()}.values()
    COMPLETIONS.after_fork()
    CALLBACK_THREADS.after_fork()
    for call in calls:
        threading.Thread(target=_end_in_child, args=(call._forked,), daemon=True).start()


os.register_at_fork(after_in_child=_after_fork_in_child)


class Call(grpc.Call, grpc.Future):
    """One call started with the engine's `Channel.start`. Thread-safe: one thread may read
    responses while another cancels it or waits for its status."""

    def __init__(self, deserialize: Deserializer, timeout: float | None) -> None:
        self._deserialize = deserialize
        self._timeout = timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._lock = threading.Condition()
        self._native: _native.Call | None = None
        self._ended = False
        self._cancelled = False
        self._error: RpcError | None = None
        self._response: Any = None
        self._callbacks: list[Callable[[], None]] = []
        # A unary `.future()`: no engine call object; its metadata and its OK status's
        # message come with its end.
        self._abandon: Callable[[], None] | None = None
        self._metadata: tuple[Metadata, Metadata] | None = None
        self._ok_details = ""
        # A call with streaming responses (`_stream`): its status comes once its responses
        # are read (`_wait_for_status`).
        self._streaming = False
        # Its status is watched for (`_watch`), by the process of this pid, or will be once
        # it starts.
        self._watch_asked = False
        self._watched_in: int | None = None

    def __del__(self) -> None:
        # A call its caller let go of before its end is cancelled, as grpcio's ("Cancelled upon
        # garbage collection!"): its server stops, and what the call holds there goes. A unary
        # `.future()` has no native call: its operation is abandoned, which cancels it.
        if getattr(self, "_ended", True):
            return
        native, abandon = getattr(self, "_native", None), getattr(self, "_abandon", None)
        if native is not None:
            native.cancel()
        elif abandon is not None:
            abandon()

    # Driving the call.

    def _start(
        self,
        channel: _native.Channel,
        path: str,
        metadata: Sequence[Metadatum] | None,
        timeout: float | None,
        wait_for_ready: bool,
        compression: str | None,
    ) -> _native.Call | None:
        """Starts the engine's call; None if it could not start or was cancelled meanwhile."""
        try:
            native = channel.start(path, metadata, timeout, wait_for_ready, compression)
        except CallError as e:
            self._end(e)
            return None
        with self._lock:
            self._native = native
            self._lock.notify_all()
            cancelled = self._cancelled
        if cancelled:
            native.cancel()
            return None
        if self._watch_asked:
            self._watch()
        return native

    def _restart_clock(self) -> None:
        """The timeout counts from now: a call that waited for its call credentials' plugins
        has its whole timeout after them, as grpcio's."""
        if self._timeout is not None:
            self._deadline = time.monotonic() + self._timeout

    def _send_one(self, native: _native.Call, request: bytes) -> None:
        try:
            native.send(request, True)  # the one request, and the half-close, in one frame
        except CallError as e:
            self._end(e)
        except BaseException:
            native.cancel()  # Ctrl-C in the send: what went of the request goes no further
            raise

    def _send_all(self, native: _native.Call, requests: Iterator[Any], serialize: Serializer) -> None:
        """Sends `requests` from a thread of its own, so that responses can be read meanwhile
        and a request iterator that blocks cannot hold up the call's status."""

        # The thread holds the call weakly: a call its caller drops while the iterator blocks
        # is collected, and cancelled then (`__del__`), as grpcio's.
        this = weakref.ref(self)

        def cancel(details: str, code: grpc.StatusCode) -> None:
            call = this()
            if call is not None:
                call._cancel(details, code)

        def run() -> None:
            try:
                for request in requests:
                    try:
                        message = encode(serialize, request)
                    except CallError as e:  # INTERNAL, or a size limit's RESOURCE_EXHAUSTED
                        cancel(e.details, status_code(e.code))
                        return
                    if not native.send(message):
                        return  # the call is over; the receiving side learns how
                native.close_send()
            except CallError:
                pass  # likewise
            except Exception:
                # As grpcio: the call ends UNKNOWN and the server sees it cancelled; the call
                # does not count as cancelled by the application.
                _LOG.exception("The request iterator raised; ending the call")
                cancel("Exception iterating requests!", grpc.StatusCode.UNKNOWN)

        threading.Thread(target=run, name="isthmus-requests", daemon=True).start()

    def _complete(
        self,
        channel: _native.Channel,
        path: str,
        metadata: Sequence[Metadatum] | None,
        timeout: float | None,
        wait_for_ready: bool,
        compression: str | None,
        request: bytes | Iterator[Any],
        serialize: Serializer,
    ) -> None:
        """Runs a call with one response to its end, on the caller's thread or the pool's."""
        # A `.future()` call may have waited for a pool thread: its deadline ran meanwhile.
        left = None if timeout is None else self.time_remaining()
        native = self._start(channel, path, metadata, left, wait_for_ready, compression)
        if native is None:
            return
        if isinstance(request, bytes):
            self._send_one(native, request)
        else:
            self._send_all(native, request, serialize)
        try:
            message = native.recv()
            if message is None or native.recv() is not None:
                native.cancel()
                raise CallError(_INTERNAL, "the server did not send exactly one response")
            response = decode(self._deserialize, message)
        except CallError as e:
            self._end(e)
        except BaseException:
            native.cancel()  # Ctrl-C in the wait: the server stops, as for a unary call
            raise
        else:
            self._end(None, response)

    def _forked(self, _ok: bool, error: CallError) -> None:
        """Its end in a child forked while a thread of the parent's ran it (`run_on_own_thread`)."""
        self._end(error)

    def _resolve(self, ok: bool, value: Any) -> None:
        """The end of a unary `.future()` call (a `UnaryResult`, or its `CallError`), on the
        completion thread."""
        if not ok:
            self._end(value)
            return
        self._metadata = (incoming(value.initial_metadata), incoming(value.trailing_metadata))
        self._ok_details = value.details
        try:
            response = decode(self._deserialize, value.message)
        except CallError as e:
            self._end(e)
        else:
            self._end(None, response)

    def _end(self, error: CallError | None, response: Any = None) -> None:
        with self._lock:
            callbacks = self._settle(error, response)
        if callbacks and COMPLETIONS.on_thread():
            CALLBACK_THREADS.run(callbacks)
        else:
            self._run_callbacks(callbacks)

    def _settle(self, error: CallError | None, response: Any) -> list[Callable[[], None]]:
        """Records the call's end (the first one counts); the lock is held. Returns the
        callbacks to run once it is released."""
        if self._ended:
            return []
        self._ended = True
        self._error = None if error is None else rpc_error(error)
        self._response = response
        callbacks, self._callbacks = self._callbacks, []
        _CALLED_BACK.discard(self)
        self._lock.notify_all()
        return callbacks

    @staticmethod
    def _run_callbacks(callbacks: list[Callable[[], None]]) -> None:
        for callback in callbacks:
            try:
                callback()
            except Exception:
                _LOG.exception("A call's callback raised")

    def _cancel(self, details: str, code: grpc.StatusCode = grpc.StatusCode.CANCELLED) -> bool:
        """Ends the call here with `code` and cancels it for the server. A CANCELLED end is the
        application's cancel (`cancelled()` then says so)."""
        with self._lock:
            if self._ended:
                return False
            self._cancelled = code is grpc.StatusCode.CANCELLED
            native, abandon = self._native, self._abandon
            callbacks = self._settle(CallError(code.value[0], details), None)
        if native is not None:
            native.cancel()
        if abandon is not None:
            abandon()
        if callbacks:
            # Not on the cancelling thread, as grpcio runs them later on a thread of its own:
            # one that cancels while holding a lock its callbacks take would wait for itself.
            CALLBACK_THREADS.run(callbacks)
        return True

    def _outcome(self) -> Any:
        """The response of a call that ran to its end on this thread; its RpcError (a cancel's
        too, as grpc's blocking calls raise it) if it failed."""
        if self._error is not None:
            raise self._error
        return self._response

    def _watched(self) -> bool:
        """Whether this process watches the call's status (a forked child does not see the
        parent's watch end)."""
        return self._watched_in == os.getpid()

    def _wait(self, timeout: float | None = None) -> None:
        if self._streaming and timeout is None and not self._watched():
            self._wait_for_status()
            return
        self._watch()
        with self._lock:
            if not self._lock.wait_for(lambda: self._ended, timeout):
                raise grpc.FutureTimeoutError()

    def _wait_for_status(self) -> None:
        """Waits for a response stream's status as grpcio gives it: once the server ended the
        call and every response before its end was read. The engine reads on while no reader
        does, and keeps a response it meets for the reader (`drained_end`); a response left
        unread holds the status until the deadline, which then ends the call, as grpcio's."""
        with self._lock:
            self._lock.wait_for(lambda: self._native is not None or self._ended)
            native = self._native
        if self._ended or native is None:
            return
        try:
            self._drained(native.drained_end(self._left()))
        except CallError as e:
            self._drained(e)

    def _left(self) -> float | None:
        """Seconds to the deadline (none past it), or None without one."""
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def _drained(self, outcome: bool | CallError) -> None:
        """Ends a response stream as its engine's `drained_end` says: True once it ended OK
        with its responses read, its status's `CallError`, or False if a response was still
        unread at the deadline (the call then ends DEADLINE_EXCEEDED, as grpcio's)."""
        if isinstance(outcome, CallError):
            self._end(outcome)
        elif outcome:
            self._end(None)
        else:
            self._cancel("Deadline Exceeded", grpc.StatusCode.DEADLINE_EXCEEDED)

    def _watch(self) -> None:
        """For a response stream: has the engine wait for its status as `_wait_for_status`
        does (a response it meets is kept for the reader), on the completion thread's reactor,
        so that `done()`, `is_active()`, the done callbacks and timed waits learn of it with
        no reader at its end, as grpcio's do. Once per call, from when it starts; the watch
        holds the call weakly, so that one its caller drops is still cancelled (`__del__`)."""
        with self._lock:
            if not self._streaming or self._ended or self._watched():
                return
            self._watch_asked = True
            native = self._native
            if native is None:
                return  # `_start` watches once its call credentials have answered
            self._watched_in = os.getpid()
        reactor, token = COMPLETIONS.begin(functools.partial(_status_came, weakref.ref(self)))
        native.watch_end(reactor, token, self._left())

    # The response iterator (streaming responses).

    def __iter__(self) -> Call:
        return self

    def __next__(self) -> Any:
        native = self._native
        if native is None:  # not started yet: its call credentials are being asked
            with self._lock:
                self._lock.wait_for(lambda: self._native is not None or self._ended)
                native = self._native
        if native is not None and not self._ended:
            try:
                message = native.recv()
            except CallError as e:
                self._end(e)
            else:
                if message is None:
                    self._end(None)
                else:
                    try:
                        return decode(self._deserialize, message)
                    except CallError as e:
                        # Settled before the cancel, whose end a status watch would give; the
                        # callbacks after it, so that none holds the server's handler up.
                        with self._lock:
                            callbacks = self._settle(e, None)
                        native.cancel()
                        self._run_callbacks(callbacks)
        if self._error is not None:
            raise self._error
        raise StopIteration

    def next(self) -> Any:
        return self.__next__()

    # grpc.Call

    def initial_metadata(self) -> Metadata:
        with self._lock:
            self._lock.wait_for(lambda: self._native is not None or self._ended)
            native, error = self._native, self._error
        if native is None:
            if self._metadata is not None:
                return self._metadata[0]
            return () if error is None else error.initial_metadata()
        try:
            return incoming(native.initial_metadata())
        except CallError as e:
            return incoming(e.initial_metadata)

    def trailing_metadata(self) -> Metadata:
        self._wait()
        if self._error is not None:
            return self._error.trailing_metadata()  # type: ignore[no-any-return]
        if self._metadata is not None:
            return self._metadata[1]
        return incoming(None if self._native is None else self._native.trailing_metadata())

    def code(self) -> grpc.StatusCode:
        self._wait()
        return grpc.StatusCode.OK if self._error is None else self._error.code()

    def details(self) -> str:
        self._wait()
        if self._error is not None:
            return self._error.details()  # type: ignore[no-any-return]
        return (self._ok_details if self._native is None else self._native.details()) or ""

    def debug_error_string(self) -> str:
        self._wait()
        return "" if self._error is None else self._error.debug_error_string()

    def is_active(self) -> bool:
        self._watch()
        return not self._ended

    def time_remaining(self) -> float | None:
        if self._deadline is None or self._timeout is None:
            return None
        # Clamped to the timeout (`start + timeout - start` can round above it), and to 0 (a
        # negative timeout is a deadline passed already).
        return max(min(self._deadline - time.monotonic(), self._timeout), 0.0)

    def cancel(self) -> bool:
        return self._cancel(LOCALLY_CANCELLED)

    def add_callback(self, callback: Callable[[], None]) -> bool:
        with self._lock:
            if self._ended:
                return False
            self._callbacks.append(callback)
            # Held until it ends, as grpcio's call state holds its callbacks: dropped by its
            # caller, a call with callbacks still runs them (one without is cancelled).
            _CALLED_BACK.add(self)
        self._watch()
        return True

    # grpc.Future

    def cancelled(self) -> bool:
        return self._cancelled

    def running(self) -> bool:
        self._watch()
        return not self._ended

    def done(self) -> bool:
        self._watch()
        return self._ended

    def result(self, timeout: float | None = None) -> Any:
        error = self.exception(timeout)
        if error is not None:
            raise error
        return self._response

    def exception(self, timeout: float | None = None) -> RpcError | None:
        self._wait(timeout)
        if self._cancelled:
            raise grpc.FutureCancelledError()
        return self._error

    def traceback(self, timeout: float | None = None) -> Any:
        error = self.exception(timeout)
        return None if error is None else traceback_of(error)

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        if not self.add_callback(functools.partial(fn, self)):
            fn(self)


# The calls with callbacks still to run (`Call.add_callback`).
_CALLED_BACK: set[Call] = set()


def resolved(this: weakref.ref[Call], ok: bool, value: Any) -> None:
    """The end of a unary `.future()` call, on the completion thread (`Call._resolve`). The
    completion holds the call weakly, so that one its caller drops is cancelled (`__del__`),
    as grpcio's: it held the call, and a dropped future ran to its end."""
    call = this()
    if call is not None:
        call._resolve(ok, value)


def _status_came(this: weakref.ref[Call], ok: bool, value: Any) -> None:
    """The end of a response stream's status watch (`Call._watch`), on the completion thread:
    `drained_end`'s outcome (`value` is its `CallError` if not `ok`)."""
    call = this()
    if call is not None:
        call._drained(value)
