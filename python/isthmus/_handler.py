"""Finding the handler of a call, for the blocking and the asyncio servers alike: registered
methods by path first (as grpcio does), then the generic handlers in order, behind the
interceptors."""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import grpc

from ._metadata import Metadata, incoming
from ._native import ServerCall

try:  # what grpc.method_handlers_generic_handler makes, and generated code before grpcio 1.62
    from grpc._utilities import DictionaryGenericHandler
except ImportError:  # pragma: no cover - a grpcio without it: every generic handler is asked
    DictionaryGenericHandler = None

F = TypeVar("F", bound=Callable[..., Any])

# The attribute of an RpcMethodHandler that holds its behaviour, by (request_streaming,
# response_streaming).
_BEHAVIOUR = {
    (False, False): "unary_unary",
    (False, True): "unary_stream",
    (True, False): "stream_unary",
    (True, True): "stream_stream",
}


def raw(method: F) -> F:
    """Marks a handler (a servicer's method, or a function given to
    `grpc.unary_unary_rpc_method_handler` and the like) as raw: isthmus then calls it with
    each request as a read-only `isthmus.Message` buffer, a view of the client's shared memory
    for a large one (`numpy.frombuffer(request, ...)` reads it where it is), and sends what it
    returns or yields as it is: a `Block` from `context.alloc(size)`, filled in place, or any
    C-contiguous buffer. The method's serializers are not used. A view of a request is valid
    while the handler holds it; keep a copy (`bytes(request)`) to keep the data longer without
    holding the client's memory. A client that is hostile could change that memory while the
    handler reads it: a handler serving clients it does not trust checks a copy, and uses it.

    grpcio ignores the mark: with a grpcio server the method gets the deserialized request,
    as usual. Behind server interceptors (`interceptors=`), a handler an interceptor returns
    after its continuation gave it a raw one is raw too, whatever it is (a wrapper of the raw
    handler, or one of its own): it gets `Message` buffers and what it returns is sent as it
    is. A handler an interceptor makes without calling its continuation is raw only if its
    method is marked. On isthmus's asyncio server a raw handler's
    `context.alloc` never waits: with no room in the server's shared memory at once, it gives
    heap memory, sent as a copy."""
    method.__isthmus_raw__ = True  # type: ignore[attr-defined]
    return method


def behaviour(handler: grpc.RpcMethodHandler) -> Callable[..., Any]:
    kind = _BEHAVIOUR[(bool(handler.request_streaming), bool(handler.response_streaming))]
    method: Callable[..., Any] = getattr(handler, kind)
    return method


class HandlerCallDetails(
    collections.namedtuple("HandlerCallDetails", ("method", "invocation_metadata")),
    grpc.HandlerCallDetails,
):
    """A named tuple, as grpcio's: an interceptor may `_replace` a field or unpack it."""

    method: str
    invocation_metadata: Metadata


HEALTH_CHECK = "/grpc.health.v1.Health/Check"


Plan = tuple[grpc.RpcMethodHandler, Callable[..., Any], bool]
"""A method's handler, its behaviour and whether it is raw (`isthmus.raw`)."""


def plan_of(handler: grpc.RpcMethodHandler, raw: bool = False) -> Plan:
    """`handler`'s plan; raw if its behaviour is marked, or if `raw` (it came through an
    interceptor whose continuation found a raw handler)."""
    method = behaviour(handler)
    return handler, method, raw or getattr(method, "__isthmus_raw__", False)


def _marked(handler: grpc.RpcMethodHandler) -> bool:
    """Whether `handler`'s behaviour is marked raw; False for a handler of an odd shape (its
    calls fail when they are planned)."""
    try:
        return bool(getattr(behaviour(handler), "__isthmus_raw__", False))
    except Exception:
        return False


def validated(handlers: Iterable[grpc.GenericRpcHandler] | None) -> list[grpc.GenericRpcHandler]:
    """`handlers`, each checked as grpcio checks them: one with no `service` is refused now,
    in grpcio's words, rather than fail every call UNKNOWN "Error in service handler!"."""
    handlers = list(handlers or ())
    for handler in handlers:
        if getattr(handler, "service", None) is None:
            raise AttributeError(
                f'"{handler}" must conform togrpc.GenericRpcHandler type but does not have "service" method!'
            )
    return handlers


class Handlers:
    def __init__(self, generic: Iterable[grpc.GenericRpcHandler] | None, interceptors: Sequence[Any] | None):
        self._generic = validated(generic)
        self._registered: dict[str, grpc.RpcMethodHandler] = {}
        self._interceptors = tuple(interceptors or ())
        self._plans: dict[str, Plan] | None = None
        self._replan()

    def add_generic(self, handlers: Iterable[grpc.GenericRpcHandler]) -> None:
        self._generic.extend(validated(handlers))
        self._replan()

    def add_registered(self, service: str, methods: Mapping[str, grpc.RpcMethodHandler]) -> None:
        for name, handler in methods.items():
            self._registered[f"/{service}/{name}"] = handler
        self._replan()

    def _replan(self) -> None:
        """Every method's plan by path, when no interceptor and no generic handler decides per
        call (grpc's dictionary handlers answer by path alone): a call then costs one lookup,
        with no call details to build. The order is grpcio's: registered methods, then the
        generic handlers in turn."""
        self._plans = None
        if self._interceptors or any(type(g) is not DictionaryGenericHandler for g in self._generic):
            return
        plans: dict[str, Plan] = {}
        try:
            for generic in self._generic:
                for path, handler in generic._method_handlers.items():
                    plans.setdefault(path, plan_of(handler))
            plans.update((path, plan_of(handler)) for path, handler in self._registered.items())
        except Exception:  # a handler of an odd shape: it fails its calls, as grpcio's would
            return
        self._plans = plans

    @property
    def intercepted(self) -> bool:
        """Whether server interceptors were given."""
        return bool(self._interceptors)

    def plan(self, call: ServerCall) -> Plan | None:
        """The plan of `call`'s method; None if no handler serves it. Raises what a generic
        handler or interceptor raised."""
        plans = self._plans
        if plans is not None:
            return plans.get(call.path)
        if not self._interceptors:
            handler = self.find(call)
            return None if handler is None else plan_of(handler)
        found_raw = [False]
        handler = self._intercepted(call, found_raw)
        return None if handler is None else plan_of(handler, found_raw[0])

    async def plan_async(self, call: ServerCall) -> Plan | None:
        """`plan` through grpc.aio.ServerInterceptors (whose `intercept_service` and
        continuation are coroutines)."""
        if not self._interceptors:
            return self.plan(call)
        found_raw = [False]
        handler = await self._intercepted_async(call, found_raw)
        return None if handler is None else plan_of(handler, found_raw[0])

    def serves_health(self) -> bool:
        """Whether the application serves `grpc.health.v1.Health` itself (then the engine's
        built-in health service stays out of its way)."""
        try:
            return self._lookup(HandlerCallDetails(HEALTH_CHECK, ())) is not None
        except Exception:  # a generic handler that raises here serves it as far as we know
            return False

    def _lookup(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = self._registered.get(details.method)
        if handler is not None:
            return handler
        for generic in self._generic:
            handler = generic.service(details)
            if handler is not None:
                return handler
        return None

    def _details(self, call: ServerCall) -> HandlerCallDetails:
        return HandlerCallDetails(call.path, incoming(call.invocation_metadata()))

    def _found(self, details: grpc.HandlerCallDetails, found_raw: list[bool]) -> grpc.RpcMethodHandler | None:
        """The end of the interceptors' chain: the application's handler, noting in
        `found_raw` whether it is raw (the interceptors' handler is then raw too)."""
        handler = self._lookup(details)
        if handler is not None and _marked(handler):
            found_raw[0] = True
        return handler

    def find(self, call: ServerCall) -> grpc.RpcMethodHandler | None:
        """The handler for `call` through grpc.ServerInterceptors."""
        if not self._interceptors:
            # The common case: no metadata to fetch for a registered method.
            handler = self._registered.get(call.path)
            return handler if handler is not None else self._lookup(self._details(call))
        return self._intercepted(call, [False])

    def _intercepted(self, call: ServerCall, found_raw: list[bool]) -> grpc.RpcMethodHandler | None:
        def chain(index: int) -> Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None]:
            if index == len(self._interceptors):
                return lambda details: self._found(details, found_raw)
            return lambda details: self._interceptors[index].intercept_service(chain(index + 1), details)

        return chain(0)(self._details(call))

    async def find_async(self, call: ServerCall) -> grpc.RpcMethodHandler | None:
        """The handler for `call` through grpc.aio.ServerInterceptors (whose
        `intercept_service` and continuation are coroutines)."""
        if not self._interceptors:
            return self.find(call)
        return await self._intercepted_async(call, [False])

    async def _intercepted_async(
        self, call: ServerCall, found_raw: list[bool]
    ) -> grpc.RpcMethodHandler | None:
        def chain(index: int) -> Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]:
            if index == len(self._interceptors):

                async def lookup(details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
                    return self._found(details, found_raw)

                return lookup
            return lambda details: self._interceptors[index].intercept_service(chain(index + 1), details)

        return await chain(0)(self._details(call))
