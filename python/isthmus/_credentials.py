"""TLS credentials in grpcio's shapes: `ssl_channel_credentials` and `ssl_server_credentials`
take the same PEM arguments as grpcio's and give objects that `secure_channel` and
`add_secure_port` take. They hold the PEM bytes; the engine (rustls) reads them when a channel
or port is made, and a PEM that does not decode raises ValueError there."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

# The target name a channel checks the server's certificate against, as grpc's option.
_NAME_OVERRIDE = "grpc.ssl_target_name_override"


class ChannelCredentials(grpc.ChannelCredentials):
    """TLS settings for a client channel: `isthmus.ssl_channel_credentials(...)`."""

    def __init__(
        self, root_certificates: bytes | None, private_key: bytes | None, certificate_chain: bytes | None
    ) -> None:
        super().__init__(None)
        if (private_key is None) != (certificate_chain is None):
            raise ValueError("a client certificate needs both private_key and certificate_chain")
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


def channel_tls(
    credentials: grpc.ChannelCredentials, options: Any
) -> tuple[bytes | None, bytes | None, bytes | None, str | None]:
    """What the native channel takes for `credentials` and the options' name override."""
    if not isinstance(credentials, ChannelCredentials):
        raise TypeError(
            "isthmus.secure_channel takes credentials from isthmus.ssl_channel_credentials "
            f"(grpcio's own cannot be read), not {type(credentials).__name__}"
        )
    override = dict(options or ()).get(_NAME_OVERRIDE)
    return (
        credentials.root_certificates,
        credentials.private_key,
        credentials.certificate_chain,
        None if override is None else str(override),
    )


def server_tls(credentials: grpc.ServerCredentials) -> tuple[bytes, bytes, bytes | None, bool]:
    """What the native server's `add_port` takes for `credentials`."""
    if not isinstance(credentials, ServerCredentials):
        raise TypeError(
            "add_secure_port takes credentials from isthmus.ssl_server_credentials "
            f"(grpcio's own cannot be read), not {type(credentials).__name__}"
        )
    return (
        credentials.private_key,
        credentials.certificate_chain,
        credentials.root_certificates,
        credentials.require_client_auth,
    )
