"""The bodies of llama-server's router endpoints, ``POST /models/load`` and
``POST /models/unload`` (docs/models.md), sans-IO."""

from __future__ import annotations

import msgspec

from ._codec import decode as _decode

__all__ = ["RouterModelRequest", "decode_router_request"]


class RouterModelRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``{"model": NAME}``; ``grace_seconds`` (unload only): how long running streams
    get before they are ended (default: ``--unload-grace``)."""

    model: str | None = None
    grace_seconds: float | None = None


_decoder = msgspec.json.Decoder(RouterModelRequest)


def decode_router_request(body: bytes) -> RouterModelRequest:
    """Raises :class:`~trioserve._core._exceptions.InvalidRequestError` naming the field."""
    return _decode(_decoder, body)
