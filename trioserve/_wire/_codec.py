"""The one JSON codec of the wire format: every request body is decoded by :func:`decode`
(so a bad body gets the same 400, naming the same field, on every endpoint) and every
response body is encoded by :func:`encode_json`."""

from __future__ import annotations

import re

import msgspec

from .._core._exceptions import InvalidRequestError
from ._limits import check_json_depth, nested_too_deep

__all__ = ["decode", "encode_json"]

encode_json = msgspec.json.Encoder().encode

_PATH = re.compile(r" - at `\$\.?([^`]*)`$")


def decode[T](decoder: msgspec.json.Decoder[T], body: bytes) -> T:
    """``body`` decoded by ``decoder``; any failure an :class:`InvalidRequestError` (400)
    naming the field msgspec names."""
    # (before msgspec: a deep body would make it, and every reader after it, recurse as deep)
    check_json_depth(body)
    try:
        return decoder.decode(body)
    except RecursionError:
        raise nested_too_deep() from None
    except msgspec.ValidationError as exc:
        message = str(exc)
        match = _PATH.search(message)
        param = match.group(1) if match else None
        if match:
            message = message[: match.start()] + (f" at `{param}`" if param else "")
        if message.startswith("Expected `object`, got") and param is None:
            message = "the request body must be a JSON object; " + message[0].lower() + message[1:]
        raise InvalidRequestError(message, param=param or None) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        # msgspec < 0.23 raises UnicodeDecodeError for bad UTF-8, 0.23 a DecodeError
        # ("Invalid UTF-8 encoded string"): find the offending byte ourselves (only on
        # this error path), so the message is the same with either.
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as bad:
            byte = bad.object[bad.start]
            raise InvalidRequestError(
                f"the request body is not valid UTF-8: byte 0x{byte:02x} at offset {bad.start}"
            ) from None
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from None
