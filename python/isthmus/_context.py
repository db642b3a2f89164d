"""A handler's `ServicerContext`: what it knows of its call and the status it will end with.
`Context` is shared by the blocking server's `ServicerContext` (here) and the asyncio one
(`aio/_context.py`); `finish` is the one place a handler's call ends."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NoReturn

import grpc
import grpc.aio

from ._call import buffer_size
from ._channel import encoding
from ._errors import rpc_error
from ._metadata import Metadata, Metadatum, incoming, outgoing
from ._native import Block, CallError, Message, ServerCall

_LOG = logging.getLogger("isthmus")


def status_number(code: Any, numbers: bool = False) -> int:
    """The number a call ends with for the code its handler set (None: OK). Anything else not a
    `grpc.StatusCode` is UNKNOWN, as grpcio ends such a call, but for a plain int of a code
    where `numbers` says so (grpc.aio's server takes `abort(5, ...)` as NOT_FOUND). Taken as a
    `StatusCode`, such a code raised inside the call's end and the call never ended."""
    if code is None:
        return 0
    if isinstance(code, grpc.StatusCode):
        return int(code.value[0])
    if numbers and isinstance(code, int) and 0 <= code <= 16:
        return code
    return int(grpc.StatusCode.UNKNOWN.value[0])


def status_details(details: Any) -> str:
    """The text a call ends with for the details its handler set: `bytes` as grpcio sends them
    (their UTF-8), anything else not a `str` by its `str()`, and a `str` that has no UTF-8 (a
    lone surrogate) as grpcio's server words its failure to encode it. Refused as they were,
    they left the call unended."""
    if not details:
        return ""
    if isinstance(details, bytes):
        return details.decode("utf-8", "replace")
    text = details if isinstance(details, str) else str(details)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"Exception calling application: {e}"
    return text


class Context:
    # Whether a plain int is taken as the code of that number (`status_number`): grpc.aio's
    # server does, grpcio's ends the call UNKNOWN.
    _NUMBERS = False
    # A handler that set details and then raised: grpcio's server sends those details;
    # grpc.aio's sends its words for the exception, keeping only a failing code.
    _KEEPS_DETAILS_ON_FAULT = True

    def __init__(
        self, call: ServerCall, handler: grpc.RpcMethodHandler, raw: bool = False, max_send: int | None = None
    ) -> None:
        self._call = call
        # The server's `grpc.max_send_message_length`: a larger reply fails the call.
        self._max_send = max_send
        self._deserialize: Callable[[bytes], Any] | None = handler.request_deserializer
        self._serialize: Callable[[Any], bytes] | None = handler.response_serializer
        self._code: grpc.StatusCode | None = None
        self._details: str | None = None
        self._trailing: Iterable[Metadatum] | None = None
        self._aborted = False
        self._finished = False
        # The RpcErrors this context raised for the call's end (`_ended_by`): a handler that
        # lets one through has not failed, as grpcio's `rpc_errors`; any other exception it
        # raises is logged, the call still open or not.
        self._ends: list[grpc.RpcError] | tuple[()] = ()
        # A raw handler (`isthmus.raw`) gets requests as read-only `Message` buffers and sends
        # its replies as they are: no (de)serializer.
        self._raw = raw
        if raw:
            self._deserialize = self._serialize = None

    def invocation_metadata(self) -> Metadata:
        return incoming(self._call.invocation_metadata())

    def peer(self) -> str:
        return self._call.peer()

    def peer_identities(self) -> Iterable[bytes] | None:
        key = self.peer_identity_key()
        return None if key is None else list(self.auth_context()[key])

    def peer_identity_key(self) -> str | None:
        # As grpc: the alternative names when the client's certificate has any, else its CN;
        # a local client (over shm://, as grpc's local credentials) is known as "local".
        context = self.auth_context()
        for key in ("x509_subject_alternative_name", "x509_common_name"):
            if context.get(key):
                return key
        if list(context.get("transport_security_type", ())) == [b"local"]:
            return "transport_security_type"
        return None

    def auth_context(self) -> dict[str, Iterable[bytes]]:
        return dict(self._call.auth_context())

    # The call's own choice replaces the server's (its `compression`, or the option
    # `grpc.default_compression_algorithm`) for replies over HTTP/2, to clients that read it; as
    # grpcio's, it goes with the initial metadata, so it does nothing after them. Over shm://
    # replies cross no wire and go as they are.
    def set_compression(self, compression: grpc.Compression) -> None:
        self._call.set_compression(encoding(compression))

    # Accepted and unused: a call's replies are compressed all or none.
    def disable_next_message_compression(self) -> None:
        pass

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def set_details(self, details: str) -> None:
        self._details = details

    def details(self) -> str | None:
        return self._details

    def set_trailing_metadata(self, trailing_metadata: Iterable[Metadatum]) -> None:
        self._trailing = trailing_metadata

    def trailing_metadata(self) -> Iterable[Metadatum] | None:
        return self._trailing

    def time_remaining(self) -> float | None:
        return self._call.time_remaining()

    def alloc(self, size: int) -> Block:
        """For a raw handler (`isthmus.raw`): a writable reply buffer of `size` bytes in the
        server's shared memory, waiting for room. Fill it (through views, or `Block.write`,
        which copies a large buffer with streaming stores) and return it (or send it, for a
        streaming reply); the client reads it where it is. A size larger than the whole arena
        gets heap memory instead, sent as a copy (`block.shared` is False). Release every view
        of it before it is sent."""
        try:
            return self._call.alloc(size)
        except CallError as e:
            raise self._ended_by(e) from None

    def _ended_by(self, error: CallError, aio: bool = False) -> grpc.RpcError:
        """The RpcError that says the call ended under its handler (`error`, the engine's
        account of it), remembered: the handler's own failure it is not."""
        raised = rpc_error(error, aio)
        if not self._ends:
            self._ends = []
        self._ends.append(raised)
        return raised

    def _abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        # Recorded before raising: a handler that catches the exception still ends aborted.
        if status_number(code, self._NUMBERS) == 0:
            _LOG.error("abort() called with StatusCode.OK; ending the call with UNKNOWN")
            code, details = grpc.StatusCode.UNKNOWN, ""
        self._code, self._details, self._aborted = code, details, True
        raise grpc.aio.AbortError(details)

    def _request(self, message: bytes | Message | None) -> Any:
        """The one request of a unary-request call."""
        if message is None:
            # grpcio's code and words (it gives its method as bytes there).
            self._abort(
                grpc.StatusCode.UNIMPLEMENTED, f'"{self._call.path}" requires exactly one request message.'
            )
        return self._decode(message)

    def _decode(self, message: bytes | Message) -> Any:
        if self._deserialize is None:
            return message
        try:
            # Only a raw context receives Messages, and it has no deserializer.
            return self._deserialize(message)  # type: ignore[arg-type]
        except Exception as e:
            self._codec_failed(e, "Exception deserializing request!", "Exception deserializing message!")

    def _encode(self, response: Any) -> bytes:
        if self._serialize is None:
            message = response
        else:
            try:
                message = self._serialize(response)
            except Exception as e:
                self._codec_failed(e, "Failed to serialize response!", "Exception serializing message!")
        if message is None:
            message = self._no_message()
        if self._max_send is not None:
            size = buffer_size(message)
            if size is not None and size > self._max_send:
                # grpcio's words, and its code: the reply does not go.
                self._abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"SERVER: Sent message larger than max ({size} vs. {self._max_send})",
                )
        return message  # type: ignore[no-any-return]

    def _no_message(self) -> bytes:
        """What a reply of None (a handler that returned nothing) sends: grpcio's server ends
        the call INTERNAL; grpc.aio's sends an empty message (`aio/_context.py`)."""
        self._abort(grpc.StatusCode.INTERNAL, "Failed to serialize response!")

    def _fault(self, error: BaseException) -> str:
        """The details of a call whose handler raised `error`, in grpcio's words."""
        return f"Exception calling application: {error}"

    def _codec_failed(self, error: Exception, words: str, logged: str | None = None) -> NoReturn:
        """The method's deserializer or serializer raised `error` (or gave None): grpcio's
        server logs it as `logged` (for an exception) and ends the call INTERNAL with `words`."""
        if logged is not None:
            _LOG.error(logged, exc_info=error)
        self._abort(grpc.StatusCode.INTERNAL, words)

    def _responds(self) -> bool:
        """Whether a unary handler's return value is sent: not once it set a failing code."""
        return status_number(self._code, self._NUMBERS) == 0

    def _finish(self, error: BaseException | None, reply: Any = None, fault: str | None = None) -> None:
        """Ends the call: with the handler's code, details and trailers, or as grpcio ends a
        handler that raised (`fault`, if given, the details then). Does nothing if the call is
        already over. `reply` (the blocking server's unary response, encoded) is sent first, in
        the same step."""
        # Ended already: with its reply (`aio._reply`), or by `aio`'s abort, whose status went
        # then (the handler's exception after it would end the call a second time).
        if self._finished and (error is None or self._aborted):
            return
        code, details = self._code, self._details
        if error is not None and not self._aborted:
            # The call's end, as this context's own operations raised it (a receive, a send),
            # is no fault of the handler's; anything else is, whether the call is still open
            # or has ended meanwhile (its deadline passed, its client cancelled), as grpcio
            # logs it.
            if not isinstance(error, CallError) and not any(error is e for e in self._ends):
                _LOG.error("Exception calling application", exc_info=error)
            if status_number(code, self._NUMBERS) == 0:
                code = grpc.StatusCode.UNKNOWN
            if details is None or not self._KEEPS_DETAILS_ON_FAULT:
                details = self._fault(error) if fault is None else fault
        self._finished = True
        # What they held (their tracebacks, the handler's frames) goes now, not at the next
        # collection of cycles: on the raw tier, views of the peer's arena.
        self._ends = ()
        trailing = None if self._trailing is None else outgoing(self._trailing)
        status, details = status_number(code, self._NUMBERS), status_details(details)
        try:
            self._end(status, details, trailing, reply)
        except (TypeError, ValueError) as e:
            if trailing is None:
                raise
            # Trailing metadata the engine cannot send (a value that is not printable ASCII, a
            # pair that is not one). The call ends without it, rather than waiting for its
            # deadline as grpcio's does; but not OK, which would tell the client all went
            # through: an OK status becomes the handler's failure, UNKNOWN with the refusal in
            # the API's words for a handler's exception (grpc.aio's server fails the call so;
            # grpc-go's, INTERNAL). A failing status goes as it was, without the metadata.
            _LOG.error("the call's end was refused (its trailing metadata, or its reply)", exc_info=e)
            if status == 0:
                status, details, reply = grpc.StatusCode.UNKNOWN.value[0], self._fault(e), None
            self._end(status, details, None, reply)

    def _end(self, code: int, details: str, trailing: Any, reply: Any) -> None:
        if reply is None:
            self._call.finish(code, details, trailing)
            return
        # A send that fails raises here, as the handler's own send would have.
        self._call.reply(reply, code, details, trailing, self._raw)


#: Where grpcio puts the deadline of a call without one: gpr_inf_future, in seconds.
_NO_DEADLINE = float(2**63 - 1)


class ServicerContext(Context, grpc.ServicerContext):
    """The blocking server's context."""

    def __init__(
        self, call: ServerCall, handler: grpc.RpcMethodHandler, raw: bool = False, max_send: int | None = None
    ) -> None:
        super().__init__(call, handler, raw, max_send)
        # How the blocking server reads requests and sends replies (raw ones as buffers).
        self._recv = call.recv_raw if raw else call.recv
        self._send = call.send_raw if raw else call.send

    def is_active(self) -> bool:
        return self._call.is_active()

    def _decode(self, message: bytes | Message) -> Any:
        request = super()._decode(message)
        if request is None and self._deserialize is not None:
            # grpcio's server takes a deserializer's None for its failure (grpc.aio's passes
            # it on).
            failure = ValueError("the deserializer returned None")
            self._codec_failed(failure, "Exception deserializing request!")
        return request

    def details(self) -> bytes | None:  # type: ignore[override]
        # `bytes`, as grpcio's (its `set_details` keeps their UTF-8); grpc.aio's is a `str`.
        details = self._details
        if details is None or isinstance(details, bytes):
            return details
        return str(details).encode("utf-8", "replace")

    def time_remaining(self) -> float:
        # grpcio's for a call without a deadline: a float, as if the deadline were its time's
        # end (2**63 s), never None, which a handler comparing it (`< 1`) would raise on.
        # grpc.aio's is None, as isthmus.aio's.
        left = self._call.time_remaining()
        return max(_NO_DEADLINE - time.time(), 0.0) if left is None else left

    def add_callback(self, callback: Callable[[], None]) -> bool:
        def guarded() -> None:
            try:
                callback()
            except Exception:
                _LOG.exception("A ServicerContext callback raised")

        return self._call.add_done_callback(guarded)

    def cancel(self) -> None:
        self._call.finish(grpc.StatusCode.CANCELLED.value[0], "Cancelled by the server", None)

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        self._abort(code, details)

    def abort_with_status(self, status: grpc.Status) -> NoReturn:
        self._trailing = status.trailing_metadata
        self._abort(status.code, status.details)

    def send_initial_metadata(self, initial_metadata: Iterable[Metadatum]) -> None:
        try:
            self._call.send_initial_metadata(outgoing(initial_metadata) or ())
        except CallError as e:
            if self._call.is_active():
                raise ValueError("Initial metadata no longer allowed!") from None
            raise self._ended_by(e) from None

    def _requests(self) -> Iterator[Any]:
        """A request-streaming handler's request iterator; raises an RpcError if the call ends
        before the client half-closes (it cancelled, its deadline passed, the connection went)."""
        while True:
            try:
                message = self._recv()
            except CallError as e:
                raise self._ended_by(e) from None
            if message is None:
                return
            yield self._decode(message)
