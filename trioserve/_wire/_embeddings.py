"""OpenAI's embeddings API, sans-IO: a ``POST /v1/embeddings`` body in, the inputs out;
the vectors in, the response body out (docs/embeddings.md)."""

from __future__ import annotations

import base64
import struct
from collections.abc import Sequence
from typing import Literal

import msgspec

from .._core._exceptions import InvalidRequestError
from ._codec import decode as _decode
from ._codec import encode_json

__all__ = [
    "MAX_INPUTS",
    "EmbeddingsRequest",
    "decode_embeddings_request",
    "embeddings_inputs",
    "embeddings_response",
]

#: inputs per request, at most (OpenAI's limit)
MAX_INPUTS = 2048


class EmbeddingsRequest(msgspec.Struct, kw_only=True):
    #: a text, token ids, or a list of either (checked by :func:`embeddings_inputs`)
    input: str | list[str | int | list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    #: an end-user identifier: accepted, not used
    user: str | None = None


_decoder = msgspec.json.Decoder(EmbeddingsRequest)


def decode_embeddings_request(body: bytes) -> EmbeddingsRequest:
    return _decode(_decoder, body)


def embeddings_inputs(request: EmbeddingsRequest) -> list[str | list[int]]:
    """The inputs, one per vector: texts or token-id lists."""
    raw = request.input
    if isinstance(raw, str):
        inputs: list[str | list[int]] = [raw]
    elif raw and all(isinstance(item, int) for item in raw):
        inputs = [[int(item) for item in raw]]  # type: ignore[arg-type]
    elif all(isinstance(item, str) for item in raw) or all(isinstance(item, list) for item in raw):
        inputs = list(raw)  # type: ignore[arg-type]
    else:
        raise InvalidRequestError(
            "input must be a text, a list of texts, a list of token ids or a list of token-id lists; "
            "not a mixture",
            param="input",
        )
    if not inputs:
        raise InvalidRequestError("input must hold at least one input", param="input")
    if len(inputs) > MAX_INPUTS:
        raise InvalidRequestError(
            f"at most {MAX_INPUTS} inputs per request; got {len(inputs)}", param="input"
        )
    for i, item in enumerate(inputs):
        if not item:
            raise InvalidRequestError(f"input[{i}] is empty", param="input")
    return inputs


def _base64(vector: Sequence[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


def embeddings_response(
    vectors: Sequence[Sequence[float]], *, model: str, prompt_tokens: int, encoding: str = "float"
) -> bytes:
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": _base64(vector) if encoding == "base64" else list(vector),
        }
        for i, vector in enumerate(vectors)
    ]
    return encode_json(
        {
            "object": "list",
            "data": data,
            "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }
    )
