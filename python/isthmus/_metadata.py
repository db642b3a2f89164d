"""Metadata between grpc's shapes and the engine's: a sequence of `(key, value)` pairs, `str`
values, `bytes` for keys ending in `-bin`."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import grpc.aio

Metadatum = tuple[str, str | bytes]
Metadata = tuple[Metadatum, ...]


class _Metadatum(NamedTuple):
    """One entry as grpc gives it: a pair that also reads as `.key` and `.value`."""

    key: str
    value: str | bytes


def outgoing(metadata: Iterable[Metadatum] | None) -> Sequence[Metadatum] | None:
    """What the engine takes. grpc accepts any iterable of pairs, `grpc.aio.Metadata` too."""
    if metadata is None or isinstance(metadata, (tuple, list)):
        return metadata
    return tuple(metadata)


def incoming(pairs: Iterable[Metadatum] | None) -> Metadata:
    """What grpc gives a handler (`invocation_metadata()`) and its blocking API's callers: a
    tuple of pairs that read as `.key` and `.value` too."""
    return () if not pairs else tuple(map(_Metadatum._make, pairs))


def incoming_aio(pairs: Iterable[Metadatum] | None) -> grpc.aio.Metadata:
    """What grpc.aio gives."""
    return grpc.aio.Metadata() if pairs is None else grpc.aio.Metadata(*pairs)
