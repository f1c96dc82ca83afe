"""llama.cpp llama-server's ``/tokenize`` and ``/detokenize`` bodies, sans-IO.

The shapes are llama-server's (``tools/server/server-context.cpp``, ``post_tokenize``
and ``post_detokenize``, in the llama.cpp that llama-cpp-python 0.3.36 vendors), so its
clients work unchanged. Where trioserve differs, it refuses what llama-server would
silently accept (a missing ``content`` or ``tokens``, an id out of the vocabulary): 400
with the field named, decoded like every other body (``_codec.decode``). The
choices: ``docs/api.md``, "Tokenizing".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import msgspec

from ._codec import decode as _decode
from ._codec import encode_json

__all__ = [
    "DetokenizeRequest",
    "TokenizeRequest",
    "decode_detokenize_request",
    "decode_tokenize_request",
    "detokenize_response",
    "tokenize_response",
]

TokenId = Annotated[int, msgspec.Meta(ge=0)]


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """``POST /tokenize``: llama-server's fields and defaults."""

    content: str
    #: which model's tokenizer (several models: docs/models.md); default: the default model
    model: str | None = None
    #: add the special tokens the model puts around a text (BOS)
    add_special: bool = False
    #: special tokens written in ``content`` are parsed as themselves, not as text
    parse_special: bool = True
    #: answer ``{"id", "piece"}`` objects instead of bare ids
    with_pieces: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """``POST /detokenize``."""

    tokens: list[TokenId]
    model: str | None = None


_tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
_detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)


def decode_tokenize_request(body: bytes) -> TokenizeRequest:
    """Raises :class:`~trioserve._core._exceptions.InvalidRequestError` naming the field."""
    return _decode(_tokenize_decoder, body)


def decode_detokenize_request(body: bytes) -> DetokenizeRequest:
    """Raises :class:`~trioserve._core._exceptions.InvalidRequestError` naming the field."""
    return _decode(_detokenize_decoder, body)


def _piece_json(piece: bytes) -> str | list[int]:
    """A piece as llama-server writes it: a string if it is valid UTF-8 on its own,
    otherwise its byte values (a token may hold part of a character)."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)


def tokenize_response(tokens: Sequence[int], pieces: Sequence[bytes] | None = None) -> bytes:
    """``{"tokens": [ids]}``; with ``pieces``, ``{"tokens": [{"id", "piece"}]}``."""
    if pieces is None:
        return encode_json({"tokens": list(tokens)})
    return encode_json(
        {
            "tokens": [
                {"id": token, "piece": _piece_json(piece)}
                for token, piece in zip(tokens, pieces, strict=True)
            ]
        }
    )


def detokenize_response(pieces: Sequence[bytes]) -> bytes:
    """``{"content": str}``: the pieces joined; bytes that are not UTF-8 (ids that end
    inside a character) become U+FFFD, as llama-server's JSON encoder replaces them."""
    return encode_json({"content": b"".join(pieces).decode("utf-8", errors="replace")})
