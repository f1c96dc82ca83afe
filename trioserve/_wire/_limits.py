"""What one request may ask for, sans-IO: :class:`RequestLimits`, the per-request counts
and sizes every dialect's decoder checks, and the nesting depth of a JSON body, checked
before any parser recurses into it.

Each limit bounds a cost one client would otherwise put on everyone: stop sequences are
matched against every token on the event loop, ``logit_bias`` entries are applied to
every draw, tool schemas are rendered into the prompt and compiled into a constraint, a
deep body makes every recursive reader (msgspec, ``json``, the schema walkers,
llguidance) recurse as deep. A refusal is a 400 that names the limit, the value sent and
the flag that raises it (``docs/bad-input.md``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy

from .._core._exceptions import InvalidRequestError

__all__ = ["MAX_JSON_DEPTH", "OPENAI_MAX_STOPS", "RequestLimits", "check_json_depth"]

#: the deepest nesting of arrays and objects a JSON body may have (JSON Schemas nest,
#: but never this deep); deeper is a 400 before anything parses it
MAX_JSON_DEPTH = 128

#: OpenAI's own limit on ``stop`` (its API refuses a fifth)
OPENAI_MAX_STOPS = 4


@dataclass(frozen=True, kw_only=True, slots=True)
class RequestLimits:
    """The per-request counts and sizes the decoders accept (``docs/api.md``, "Limits").

    Attributes:
        max_stop_sequences: stop sequences per request (Anthropic's ``stop_sequences``;
            OpenAI's ``stop`` keeps OpenAI's 4, or this if lower).
        max_stop_bytes: the UTF-8 bytes of all of a request's stop sequences together
            (the stop matcher's work per token grows with them).
        max_logit_bias: ``logit_bias`` entries.
        max_tools: tools per request.
        max_schema_bytes: the encoded size of one JSON Schema: a tool's parameters
            (``input_schema``) or the response format's schema.
        max_messages: messages (or Responses ``input`` items) per request.
        max_content_parts: content parts (blocks) of all messages together.
        max_batch_choices: on ``/v1/completions``, prompts × ``n``.
        max_images: images per request (docs/vision.md).
        max_image_bytes: the bytes of one image (a data URL's, decoded).
        max_audio_parts: audio parts per request (docs/audio.md).
        max_audio_bytes: the bytes of one audio clip (base64-decoded, or uploaded).
    """

    max_stop_sequences: int = 16
    max_stop_bytes: int = 2048
    max_logit_bias: int = 1024
    max_tools: int = 128
    max_schema_bytes: int = 64 * 1024
    max_messages: int = 4096
    max_content_parts: int = 16384
    max_batch_choices: int = 64
    max_images: int = 16
    max_image_bytes: int = 20 * 1024 * 1024
    max_audio_parts: int = 4
    max_audio_bytes: int = 25 * 1024 * 1024

    def check_stops(self, stops: Sequence[str], param: str, *, openai: bool = False) -> None:
        """Refuse too many stop sequences, or too many bytes of them (``openai``: OpenAI's
        ``stop``, which also keeps OpenAI's limit of 4)."""
        limit = self.max_stop_sequences
        if openai and len(stops) > OPENAI_MAX_STOPS and limit >= OPENAI_MAX_STOPS:
            raise InvalidRequestError(
                f"{param} holds {len(stops)} entries; at most {OPENAI_MAX_STOPS} stop sequences are "
                "allowed (OpenAI's limit)",
                param=param,
            )
        self.check_count(param, len(stops), limit, "--max-stop-sequences", param)
        size = sum(len(stop.encode()) for stop in stops)
        if size > self.max_stop_bytes:
            raise InvalidRequestError(
                f"{param} add up to {size} bytes; this server accepts at most {self.max_stop_bytes} "
                "(--max-stop-bytes)",
                param=param,
            )

    def check_count(self, what: str, count: int, limit: int, flag: str, param: str) -> None:
        """Refuse ``count`` entries of ``what`` above ``limit``."""
        if count > limit:
            raise InvalidRequestError(
                f"{what} holds {count} entries; this server accepts at most {limit} ({flag})", param=param
            )

    def check_schema(self, encoded: bytes | str, param: str) -> None:
        """Refuse a JSON Schema whose encoding is over ``max_schema_bytes``."""
        if len(encoded) > self.max_schema_bytes:
            raise InvalidRequestError(
                f"{param} is {len(encoded)} bytes of JSON Schema; this server accepts at most "
                f"{self.max_schema_bytes} (--max-schema-bytes)",
                param=param,
            )


#: the bytes that are not structure (kept: quotes and brackets)
_NOT_STRUCTURE = bytes(c for c in range(256) if c not in b'"[]{}')
_STEP = numpy.zeros(256, numpy.int32)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1


def json_depth(body: bytes, limit: int = MAX_JSON_DEPTH) -> int:
    """The deepest nesting of arrays and objects in the JSON text ``body`` (brackets in
    strings do not count); ``0`` when it cannot exceed ``limit`` (fewer openers than
    that). Linear, and in C: a body is never walked byte by byte in Python."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return 0
    # escapes first: an escaped backslash, then an escaped quote (in that order, so
    # \\" is a backslash and the string's end), then everything but quotes and brackets
    text = body.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    codes = numpy.frombuffer(text, numpy.uint8)
    outside = (numpy.cumsum(codes == ord('"'), dtype=numpy.int32) & 1) == 0
    steps = _STEP.take(codes[outside])
    return int(steps.cumsum().max(initial=0))


#: the bytes that are not an entry's separator (kept: quotes, brackets and commas)
_NOT_SEPARATOR = bytes(c for c in range(256) if c not in b'"[]{},')


def top_level_entries(raw: bytes) -> int:
    """The entries of the JSON array or object ``raw`` (its top-level commas + 1; 0 when
    empty), counted without decoding it: a field whose entries are limited is counted
    before msgspec builds an object per entry (200,000 ``logit_bias`` entries take 50 ms
    to decode, the GIL held throughout). Linear, and in C, as :func:`json_depth`."""
    inner = raw.strip()[1:-1]
    if not inner.strip():
        return 0
    if b"\\" not in inner and not any(bracket in inner for bracket in (b"[", b"{", b"]", b"}")):
        # flat and no escapes (a list of strings, token ids to numbers): the commas
        # outside strings, found by where each comma falls among the quotes
        codes = numpy.frombuffer(inner, numpy.uint8)
        quotes = numpy.flatnonzero(codes == ord('"'))
        commas = numpy.flatnonzero(codes == ord(","))
        inside = numpy.searchsorted(quotes, commas) & 1
        return int(commas.size - numpy.count_nonzero(inside)) + 1
    text = inner.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_SEPARATOR)
    codes = numpy.frombuffer(text, numpy.uint8)
    structure = codes[(numpy.cumsum(codes == ord('"'), dtype=numpy.int32) & 1) == 0]
    depth = _STEP.take(structure).cumsum()
    return int(numpy.count_nonzero((structure == ord(",")) & (depth == 0))) + 1


def check_json_depth(body: bytes) -> None:
    """Refuse a body nested deeper than :data:`MAX_JSON_DEPTH` (400), before any
    recursive parser sees it."""
    depth = json_depth(body)
    if depth > MAX_JSON_DEPTH:
        raise InvalidRequestError(
            f"the request body nests arrays and objects {depth} deep; this server accepts at most "
            f"{MAX_JSON_DEPTH}"
        )


def nested_too_deep(what: str = "the JSON", param: str | None = None) -> InvalidRequestError:
    """The 400 for JSON nested deeper than :data:`MAX_JSON_DEPTH` that a recursive
    reader could not follow, or that sits in a string the body's check cannot see into."""
    return InvalidRequestError(
        f"{what} nests arrays and objects too deeply; this server accepts at most {MAX_JSON_DEPTH} levels",
        param=param,
    )
