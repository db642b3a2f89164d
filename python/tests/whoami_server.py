"""A server whose one method, `/whoami.Who/Am`, answers what its handler's context says of the
caller: `peer()`, `auth_context()`, `peer_identities()`, `peer_identity_key()` and the
`user-agent` values in `invocation_metadata()`, as JSON.

    whoami_server.py isthmus|isthmus-aio|grpcio CERT_DIR none|tls|mtls|mtls-optional TARGET...

`isthmus-aio` serves with `isthmus.aio.server` on the loop `PEER_LOOP` names (`peer.run_loop`).
Serves every TARGET (`add_insecure_port`, or `add_secure_port` with CERT_DIR's `server.crt`,
`server.key` and, for mtls, `ca` as the required client CA; for mtls-optional, `ca` given
with `require_client_auth=False`), prints `READY`, then `PORTS` and
what grpc's add_*_port returned for each target. Runs until killed. With `ISTHMUS_NO_OFFER`
set, an isthmus server does not offer its `shm://` port to HTTP/2 clients."""

from __future__ import annotations

import base64
import json
import os
import sys
import threading
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from peer import run_loop

import isthmus
import isthmus.aio


def main() -> None:
    kind, cert_dir, mode, *targets = sys.argv[1:]
    if kind == "isthmus-aio":
        run_loop(serve_aio(cert_dir, mode, targets))
        return
    api: Any = isthmus if kind == "isthmus" else grpc
    server = api.server(futures.ThreadPoolExecutor(4), options=_options())
    server.add_generic_rpc_handlers([_handlers(_am)])
    ports = _add_ports(server, api, cert_dir, mode, targets)
    server.start()
    _ready(ports)
    threading.Event().wait()


async def serve_aio(cert_dir: str, mode: str, targets: list[str]) -> None:
    async def am(request: bytes, context: Any) -> bytes:
        return _am(request, context)

    server = isthmus.aio.server(options=_options())
    server.add_generic_rpc_handlers([_handlers(am)])
    ports = _add_ports(server, isthmus, cert_dir, mode, targets)
    await server.start()
    _ready(ports)
    await server.wait_for_termination()


def _options() -> list[tuple[str, Any]] | None:
    return [("isthmus.offer_shm", False)] if os.environ.get("ISTHMUS_NO_OFFER") else None


def _handlers(am: Any) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler("whoami.Who", {"Am": grpc.unary_unary_rpc_method_handler(am)})


def _ready(ports: list[str]) -> None:
    print("READY", flush=True)
    print("PORTS", *ports, flush=True)


def _am(request: bytes, context: Any) -> bytes:
    auth = {k: sorted(base64.b64encode(v).decode() for v in vs) for k, vs in context.auth_context().items()}
    ids = context.peer_identities()
    return json.dumps(
        {
            "peer": context.peer(),
            "auth": auth,
            "identities": None if ids is None else [i.decode() for i in ids],
            "key": context.peer_identity_key(),
            "agent": [v for k, v in context.invocation_metadata() if k == "user-agent"],
        }
    ).encode()


def _add_ports(server: Any, api: Any, cert_dir: str, mode: str, targets: list[str]) -> list[str]:
    ports = []
    for target in targets:
        if mode == "none" or target.startswith("shm://"):
            port = server.add_insecure_port(target)
        else:
            files = Path(cert_dir)
            credentials = api.ssl_server_credentials(
                [((files / "server.key").read_bytes(), (files / "server.crt").read_bytes())],
                root_certificates=(files / "ca").read_bytes() if mode.startswith("mtls") else None,
                require_client_auth=mode == "mtls",
            )
            port = server.add_secure_port(target, credentials)
        ports.append(str(port))
    return ports


if __name__ == "__main__":
    main()
