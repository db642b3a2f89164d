"""Credentials in grpcio's shapes.

- TLS: `ssl_channel_credentials` and `ssl_server_credentials` take the same PEM arguments as
  grpcio's and give objects that `secure_channel` and `add_secure_port` take. They hold the
  PEM bytes; the engine (rustls) reads them when a channel or port is made, and a PEM that does
  not decode raises ValueError there.
- Local: grpc's own `local_channel_credentials()` and `local_server_credentials()`, for a
  target or port on this machine (`shm://`, a Unix socket, a loopback address).
- Call credentials: grpc's own `metadata_call_credentials(plugin)`,
  `access_token_call_credentials(token)` and their `composite_call_credentials`, given to a
  call (`credentials=`) or composed into a channel's (`composite_channel_credentials`): before
  each call, each plugin is asked for metadata, as grpcio asks it. As in grpcio, they need a
  channel that is secure: TLS, local credentials, or `shm://` (local by construction); on any
  other the call fails UNAUTHENTICATED.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import grpc

from ._native import CallError

_LOG = logging.getLogger(__name__)

# The target name a channel checks the server's certificate against, as grpc's option.
_NAME_OVERRIDE = "grpc.ssl_target_name_override"


class ChannelCredentials(grpc.ChannelCredentials):
    """TLS settings for a client channel: `isthmus.ssl_channel_credentials(...)`."""

    def __init__(
        self, root_certificates: bytes | None, private_key: bytes | None, certificate_chain: bytes | None
    ) -> None:
        if (private_key is None) != (certificate_chain is None):
            raise ValueError("a client certificate needs both private_key and certificate_chain")
        # grpc's own underneath, which grpc.composite_channel_credentials takes and
        # `channel_security` reads back, as it reads grpc's.
        super().__init__(
            grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)._credentials
        )
        self.root_certificates = root_certificates
        self.private_key = private_key
        self.certificate_chain = certificate_chain


class ServerCredentials(grpc.ServerCredentials):
    """TLS settings for a server port: `isthmus.ssl_server_credentials(...)`."""

    def __init__(
        self,
        private_key: bytes,
        certificate_chain: bytes,
        root_certificates: bytes | None,
        require_client_auth: bool,
    ):
        super().__init__(None)
        self.private_key = private_key
        self.certificate_chain = certificate_chain
        self.root_certificates = root_certificates
        self.require_client_auth = require_client_auth


def ssl_channel_credentials(
    root_certificates: bytes | None = None,
    private_key: bytes | None = None,
    certificate_chain: bytes | None = None,
) -> ChannelCredentials:
    """grpc.ssl_channel_credentials: trust `root_certificates` (PEM; the system's roots if
    None), and present `certificate_chain` with `private_key` to servers that ask (mutual TLS)."""
    return ChannelCredentials(root_certificates, private_key, certificate_chain)


def ssl_server_credentials(
    private_key_certificate_chain_pairs: Sequence[tuple[bytes, bytes]],
    root_certificates: bytes | None = None,
    require_client_auth: bool = False,
) -> ServerCredentials:
    """grpc.ssl_server_credentials: the server's key and certificate chain (PEM), and for
    mutual TLS the CA its clients' certificates must chain to; with `require_client_auth`
    a client without one is refused. isthmus serves one certificate per port: more than one
    pair (grpc picks among them by SNI) raises ValueError."""
    pairs = list(private_key_certificate_chain_pairs)
    if len(pairs) != 1:
        raise ValueError(f"isthmus serves one key and certificate chain per port; {len(pairs)} were given")
    if require_client_auth and root_certificates is None:
        raise ValueError("require_client_auth needs root_certificates to check clients with")
    key, chain = pairs[0]
    return ServerCredentials(key, chain, root_certificates, require_client_auth)


Tls = tuple[bytes | None, bytes | None, bytes | None, str | None]


class Security(NamedTuple):
    """What a channel's credentials make of it."""

    tls: Tls | None
    """What the native channel takes for TLS (None: none)."""
    plugins: tuple[grpc.AuthMetadataPlugin, ...]
    """The call credentials every call of the channel asks for metadata."""
    secure: bool
    """Whether call credentials may go over it (TLS, local, or `shm://`)."""


# The schemes of grpc's address forms that name a host (`dns:///localhost:1`, `dns:localhost:1`,
# `ipv4:127.0.0.1:1`, `ipv6:[::1]:1`, `http://[::1]:1`), with no DNS server of their own.
_SCHEME = re.compile(r"^(?:dns:(?:///)?|ipv4:|ipv6:|https?://)")
# Loopback hosts, with a port or not.
_LOOPBACK = re.compile(r"^\[?(localhost|127(?:\.\d{1,3}){3}|::1)\]?(?::\d+)?$")


def is_local(target: str) -> bool:
    """Whether `target` names this machine: `shm://`, a Unix socket, or a loopback address."""
    if target.startswith(("shm:", "unix:", "unix-abstract:")):
        return True
    return _LOOPBACK.match(_SCHEME.sub("", target.lower())) is not None


def insecure(target: str) -> Security:
    """An insecure channel's: call credentials go only over `shm://`, which is local."""
    return Security(None, (), target.startswith("shm:"))


def channel_security(credentials: grpc.ChannelCredentials, options: Any, target: str) -> Security:
    """What `secure_channel(target, credentials, options)` makes of its credentials: TLS from
    isthmus's or grpc's (both hold grpc's SSL credentials), grpc's local credentials, and call
    credentials composed into any of them."""
    plugins: tuple[grpc.AuthMetadataPlugin, ...] = ()
    inner = getattr(credentials, "_credentials", None)
    composed = getattr(inner, "_call_credentialses", None)
    while composed is not None:  # grpc.composite_channel_credentials(channel, *call), nested
        plugins = _plugins_of(composed) + plugins
        inner = getattr(inner, "_channel_credentials", None)
        composed = getattr(inner, "_call_credentialses", None)
    if type(inner).__name__ == "LocalChannelCredentials":
        return _local(target, plugins)
    if type(inner).__name__ == "SSLChannelCredentials":
        return Security(_tls(inner, options), plugins, True)
    raise TypeError(
        "isthmus.secure_channel takes credentials from isthmus.ssl_channel_credentials or grpc's "
        f"local, SSL or composite channel credentials, not {type(credentials).__name__}"
    )


def _local(target: str, plugins: tuple[grpc.AuthMetadataPlugin, ...]) -> Security:
    if not is_local(target):
        # grpcio's handshake refuses it (UNAVAILABLE at the first call); here at once.
        raise ValueError(f"local channel credentials need a target on this machine, not {target}")
    return Security(None, plugins, True)


_SSL_FIELDS = ("_pem_root_certificates", "_private_key", "_certificate_chain")


def _tls(inner: Any, options: Any) -> Tls:
    """What the native channel takes for grpc's SSL credentials (a cygrpc object, which keeps
    its PEM readable in the grpcio releases this package was tested with: one that hides it is
    refused, rather than trusting the system's roots and sending no client certificate) and
    the options' name override."""
    if not all(hasattr(inner, field) for field in _SSL_FIELDS):
        raise TypeError(
            "this grpcio's ssl_channel_credentials cannot be read: use isthmus.ssl_channel_credentials"
        )
    override = dict(options or ()).get(_NAME_OVERRIDE)
    root, key, chain = (getattr(inner, field) for field in _SSL_FIELDS)
    return (root, key, chain, None if override is None else str(override))


def _plugins_of(credentials: Iterable[Any]) -> tuple[grpc.AuthMetadataPlugin, ...]:
    """The metadata plugins of grpc's call credentials (cygrpc objects), composites opened."""
    out: list[grpc.AuthMetadataPlugin] = []
    for c in credentials:
        composed = getattr(c, "_call_credentialses", None)
        if composed is not None:
            out.extend(_plugins_of(composed))
            continue
        wrapped = getattr(c, "_metadata_plugin", None)  # grpc._plugin_wrapping._Plugin
        plugin = getattr(wrapped, "_metadata_plugin", None)
        if plugin is None:
            raise TypeError(f"isthmus cannot read call credentials of type {type(c).__name__}")
        out.append(plugin)
    return tuple(out)


def call_plugins(credentials: grpc.CallCredentials | None) -> tuple[grpc.AuthMetadataPlugin, ...]:
    """The metadata plugins of a call's `credentials=`."""
    if credentials is None:
        return ()
    if not isinstance(credentials, grpc.CallCredentials):
        raise TypeError(f"credentials must be grpc.CallCredentials, not {type(credentials).__name__}")
    return _plugins_of((credentials._credentials,))


class Auth:
    """A channel's part in its calls' call credentials: its own plugins (composed into its
    credentials), whether they may go over it, what the plugins are told of it, and the calls
    of the blocking API that wait for their plugins' answers (which `close` ends)."""

    def __init__(self, security: Security, target: str, authority: str | None = None) -> None:
        self.plugins = security.plugins
        self.secure = security.secure
        self._lock = threading.Lock()
        self._waiting: set[Any] = set()
        self._closed = False
        tls = security.tls
        self.scheme = "https" if tls is not None else ""
        if authority is not None:
            # The channel's `grpc.default_authority`, which its calls send: grpc's filter
            # builds the URL from the call's authority.
            self.authority = authority.removesuffix(":443") if tls is not None else authority
        elif target.startswith(("unix:", "unix-abstract:", "shm:")):
            self.authority = "localhost"
        else:
            # As grpc's client auth filter: the target's host and port, the name override's
            # host if one is set, and no port 443 over TLS.
            self.authority = _SCHEME.sub("", target.lower()).rsplit("/", 1)[-1]
            if tls is not None and tls[3] is not None:
                port = self.authority.rpartition(":")[2] if ":" in self.authority else ""
                self.authority = tls[3] + (f":{port}" if port else "")
            if tls is not None and self.authority.endswith(":443"):
                self.authority = self.authority[: -len(":443")]

    def hold(self, call: Any) -> bool:
        """`call` waits for its plugins (until `release`); False if the channel is closed."""
        with self._lock:
            if self._closed:
                return False
            self._waiting.add(call)
            return True

    def release(self, call: Any) -> None:
        with self._lock:
            self._waiting.discard(call)

    def close(self) -> list[Any]:
        """The channel closes: the calls still waiting for their plugins, for it to end."""
        with self._lock:
            self._closed = True
            waiting, self._waiting = list(self._waiting), set()
        return waiting

    def metadata(
        self, metadata: Any, credentials: grpc.CallCredentials | None, path: str, timeout: float | None
    ) -> Any:
        """The call's metadata (an iterable of pairs, or None), then what the call credentials
        (the channel's, then the call's own) give for it; or the CallError that fails the call,
        as grpcio fails it, returned for the caller to raise or to end a call with. The call's
        timeout bounds the plugins' answers; as in grpcio, the call then has its whole timeout.
        (Its callers skip it when there are no credentials.)"""
        try:
            plugins, context, end = self._asking(credentials, path, timeout)
            extra = [pair for plugin in plugins for pair in _answered(_told(plugin, context, end))]
        except CallError as error:
            return error
        return (*(metadata or ()), *extra)

    async def metadata_async(
        self, metadata: Any, credentials: grpc.CallCredentials | None, path: str, timeout: float | None
    ) -> Any:
        """`metadata` for asyncio: each plugin is asked on a thread of the loop's default
        executor (it may block, or answer through the loop), and its answer awaited on the
        loop, so a plugin that returns without answering holds no thread until the deadline."""
        try:
            plugins, context, end = self._asking(credentials, path, timeout)
            extra = []
            for plugin in plugins:
                extra += _answered(await _told_async(plugin, context, end))
        except CallError as error:
            return error
        return (*(metadata or ()), *extra)

    def _asking(
        self, credentials: grpc.CallCredentials | None, path: str, timeout: float | None
    ) -> tuple[tuple[grpc.AuthMetadataPlugin, ...], _Context, float | None]:
        """The plugins to ask for a call of `path` (the channel's, then the call's own), what
        they are told, and when their answers are due (on `time.monotonic`'s clock)."""
        plugins = self.plugins + call_plugins(credentials)
        end = None if timeout is None else time.monotonic() + timeout
        return plugins, _context(self.secure, self.scheme, self.authority, path), end


def _told(plugin: grpc.AuthMetadataPlugin, context: _Context, end: float | None) -> _Answer:
    """`plugin`'s answer, asked on this thread, waited for until `end`."""
    answer = _Answer()
    _ask(plugin, context, answer)
    if not answer.done.wait(None if end is None else max(0.0, end - time.monotonic())):
        raise _deadline_exceeded()
    return answer


async def _told_async(plugin: grpc.AuthMetadataPlugin, context: _Context, end: float | None) -> _Answer:
    """`plugin`'s answer, asked on a thread of the loop's default executor, awaited until
    `end` on the loop."""
    loop = asyncio.get_running_loop()
    answered: asyncio.Future[None] = loop.create_future()
    answer = _Answer(functools.partial(_wake, loop, answered))
    await loop.run_in_executor(None, _ask, plugin, context, answer)
    if not answer.done.is_set():
        try:
            await asyncio.wait_for(answered, None if end is None else max(0.0, end - time.monotonic()))
        except asyncio.TimeoutError:
            raise _deadline_exceeded() from None
    return answer


def _wake(loop: asyncio.AbstractEventLoop, answered: asyncio.Future[None]) -> None:
    """Resolves `answered` on its loop, from any thread (a plugin answers from any)."""

    def resolve() -> None:
        if not answered.done():
            answered.set_result(None)

    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
        loop.call_soon_threadsafe(resolve)


class _Context(NamedTuple):
    """grpc.AuthMetadataContext."""

    service_url: str
    method_name: str


class _Answer:
    """A plugin's callback (grpc.AuthMetadataPluginCallback): the first answer counts."""

    def __init__(self, then: Callable[[], None] | None = None) -> None:
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.metadata: Any = None
        self.error: BaseException | str | None = None
        self.then = then  # told once the answer is in

    def __call__(self, metadata: Any, error: BaseException | str | None) -> None:
        with self.lock:
            if self.done.is_set():
                raise RuntimeError("AuthMetadataPluginCallback invoked more than once!")
            self.metadata, self.error = metadata, error
            self.done.set()
        if self.then is not None:
            self.then()


def _plugin_failed(error: object) -> CallError:
    return CallError(
        grpc.StatusCode.UNAVAILABLE.value[0], f"Getting metadata from plugin failed with error: {error}"
    )


def plugins_task_failed(error: BaseException) -> CallError:
    """How an asyncio call ends whose plugins' task failed (an executor shut down with the
    loop, say): INTERNAL with the reason."""
    return CallError(grpc.StatusCode.INTERNAL.value[0], f"call credentials failed: {error!r}")


def _deadline_exceeded() -> CallError:
    return CallError(grpc.StatusCode.DEADLINE_EXCEEDED.value[0], "Deadline Exceeded")


def _context(secure: bool, scheme: str, authority: str, path: str) -> _Context:
    """What plugins are told of a call of `path`; raises grpcio's CallError on a channel that
    may not carry call credentials."""
    if not secure:
        raise CallError(
            grpc.StatusCode.UNAUTHENTICATED.value[0],
            "Established channel does not have a sufficient security level to transfer call credential.",
        )
    service, _, method = path.lstrip("/").rpartition("/")
    return _Context(f"{scheme}://{authority}/{service}", method)


def _ask(plugin: grpc.AuthMetadataPlugin, context: _Context, answer: _Answer) -> None:
    """Asks `plugin`, which may answer now or later, from any thread; one that raises before it
    answers fails the call, as in grpcio (an answer given before the raise counts)."""
    try:
        plugin(context, answer)
    except Exception as e:
        _LOG.exception('AuthMetadataPluginCallback "%s" raised exception!', plugin)
        if not answer.done.is_set():
            raise _plugin_failed(e) from None


def _answered(answer: _Answer) -> list[tuple[str, str | bytes]]:
    """A plugin's answer as metadata, or its failure as grpcio words it (raises CallError)."""
    if answer.error is not None:
        raise _plugin_failed(answer.error)
    return _pairs(answer.metadata)


def _pairs(metadata: Any) -> list[tuple[str, str | bytes]]:
    """A plugin's metadata, checked as grpcio checks it (UNAVAILABLE "Illegal metadata")."""
    try:
        pairs = [(k, v) for k, v in metadata or ()]
    except (TypeError, ValueError):
        pairs = None
    if pairs is None or not all(_legal(k, v) for k, v in pairs):
        raise CallError(grpc.StatusCode.UNAVAILABLE.value[0], "Illegal metadata")
    return pairs


_KEY = re.compile(r"^[0-9a-z_.-]+$")


def _legal(key: object, value: object) -> bool:
    if not isinstance(key, str) or not _KEY.match(key):
        return False
    if key.endswith("-bin"):
        return isinstance(value, (bytes, str))
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    return isinstance(value, str) and all(" " <= c <= "~" for c in value)


class LocalServerCredentials(grpc.ServerCredentials):
    """grpc's local server credentials: `isthmus.local_server_credentials()`."""

    def __init__(self) -> None:
        super().__init__(None)


def local_server_credentials(
    local_connect_type: grpc.LocalConnectionType = grpc.LocalConnectionType.LOCAL_TCP,
) -> LocalServerCredentials:
    """grpc.local_server_credentials: a port that serves this machine only (a Unix socket or a
    loopback address; `shm://` is local anyway), over which clients' call credentials may go.
    grpc's own object cannot be told from its SSL credentials, so `add_secure_port` takes this
    one. Either connection type serves both kinds of local address."""
    return LocalServerCredentials()


def local_channel_credentials(
    local_connect_type: grpc.LocalConnectionType = grpc.LocalConnectionType.LOCAL_TCP,
) -> grpc.ChannelCredentials:
    """grpc.local_channel_credentials (grpc's own, which `secure_channel` reads): for a target
    on this machine, over which call credentials may go."""
    return grpc.local_channel_credentials(local_connect_type)


def server_tls(credentials: grpc.ServerCredentials) -> tuple[bytes, bytes, bytes | None, bool] | None:
    """What the native server's `add_port` takes for `credentials`; None for local
    credentials (the port then serves as an insecure one, and must be local)."""
    if isinstance(credentials, LocalServerCredentials):
        return None
    if not isinstance(credentials, ServerCredentials):
        raise TypeError(
            "add_secure_port takes credentials from isthmus.ssl_server_credentials or "
            "isthmus.local_server_credentials (grpcio's own cannot be read), not "
            f"{type(credentials).__name__}"
        )
    return (
        credentials.private_key,
        credentials.certificate_chain,
        credentials.root_certificates,
        credentials.require_client_auth,
    )
