"""isthmus's exceptions: `IsthmusError` for its own failures, `RpcError` for a call that ended
with a status other than OK."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any, NoReturn

import grpc
import grpc.aio

from ._metadata import Metadata, incoming, incoming_aio
from ._native import CallError

_CODES = {code.value[0]: code for code in grpc.StatusCode}

LOCALLY_CANCELLED = "Locally cancelled by application!"


class IsthmusError(Exception):
    """The base of every exception isthmus raises."""


def status_code(number: int) -> grpc.StatusCode:
    """The grpc.StatusCode for a status number; UNKNOWN for one gRPC does not define."""
    return _CODES.get(number, grpc.StatusCode.UNKNOWN)


class Ended:
    """grpc.RpcContext, and a done grpc.Future's state, for a call that is over: no time
    left, nothing to cancel or wait for."""

    def cancelled(self) -> bool:
        return False

    def running(self) -> bool:
        return False

    def done(self) -> bool:
        return True

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        fn(self)

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float | None:
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return False


class RpcError(Ended, IsthmusError, grpc.aio.AioRpcError, grpc.Call, grpc.Future):
    """A call that ended with a status other than OK, as both of grpc's APIs raise it: a
    `grpc.RpcError`, `grpc.Call` and `grpc.Future` (blocking API) and a `grpc.aio.AioRpcError`.
    Its metadata is a tuple of pairs from the blocking API and a `grpc.aio.Metadata` from
    `isthmus.aio`.

    A done `grpc.Future` as grpcio's own errors are, because `grpc.intercept_channel` hands the
    error a continuation's call raised to the interceptor as that call's outcome, and then
    calls its `result()`."""

    # AioRpcError's signature, which its __reduce__ (pickling) relies on.
    def __init__(
        self,
        code: grpc.StatusCode,
        initial_metadata: Metadata | grpc.aio.Metadata,
        trailing_metadata: Metadata | grpc.aio.Metadata,
        details: str | None = None,
        debug_error_string: str | None = None,
    ) -> None:
        if debug_error_string is None:
            debug_error_string = f"isthmus: status {code.value[0]} ({code.name}): {details}"
        super().__init__(code, initial_metadata, trailing_metadata, details, debug_error_string)

    def __str__(self) -> str:
        return (
            f"<{type(self).__name__} of RPC that terminated with:\n"
            f"\tstatus = {self.code()}\n"
            f'\tdetails = "{self.details()}"\n'
            f'\tdebug_error_string = "{self.debug_error_string()}"\n>'
        )

    __repr__ = __str__

    # grpc.Future, for a call that is over (its state is Ended's).

    def result(self, timeout: float | None = None) -> NoReturn:
        raise self

    def exception(self, timeout: float | None = None) -> RpcError:
        return self

    def traceback(self, timeout: float | None = None) -> TracebackType | None:
        return traceback_of(self)


def traceback_of(error: BaseException) -> TracebackType | None:
    """The traceback a failed future gives, as grpcio's: the error's own if it was raised, else
    that of raising it here (grpcio's futures raise their error to take one), never None."""
    if error.__traceback__ is not None:
        return error.__traceback__
    try:
        raise error
    except BaseException:
        return sys.exc_info()[2]


# Shown as the public names (isthmus.RpcError) in tracebacks and reprs; pickling finds them there.
IsthmusError.__module__ = RpcError.__module__ = "isthmus"


def rpc_error(error: CallError, aio: bool = False) -> RpcError:
    """The RpcError for the engine's account of a failed call."""
    metadata = incoming_aio if aio else incoming
    return RpcError(
        status_code(error.code),
        metadata(error.initial_metadata),
        metadata(error.trailing_metadata),
        error.details,
    )
