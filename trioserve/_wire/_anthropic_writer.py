"""Anthropic's Messages API, sans-IO: the response, as Anthropic's events or ``Message``
body, and errors as Anthropic's error bodies. The requests: :mod:`._anthropic`; every
choice: ``docs/dialects.md``."""

from __future__ import annotations

import json
from collections.abc import Sequence

from .._core._exceptions import OverloadedError, TrioserveError
from .._core._types import EndCause, Usage
from ._choices import CallArguments, CallStart, ChoiceReader, Part, TextPart, ThinkingPart, ToolMode
from ._codec import encode_json
from ._conversation import new_id
from ._openai_writer import ChoiceResult, trioserve_extension
from ._parts_writer import PartsWriter
from ._truncation import Dropped

__all__ = ["AnthropicDialect", "anthropic_error"]


# -- errors ------------------------------------------------------------------------

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_error(exc: TrioserveError) -> tuple[int, dict[str, object]]:
    """Anthropic's status and error body for ``exc``: a full queue is 529
    ``overloaded_error`` (what Anthropic's clients retry on), the rest keep their status."""
    status = 529 if isinstance(exc, OverloadedError) else exc.status
    error_type = _ERROR_TYPES.get(status, "api_error")
    return status, {"type": "error", "error": {"type": error_type, "message": exc.message}}


# -- responses ------------------------------------------------------------------------


def _event(name: bytes, payload: dict[str, object]) -> bytes:
    return b"event: " + name + b"\ndata: " + encode_json(payload) + b"\n\n"


_PING = b'event: ping\ndata: {"type":"ping"}\n\n'
_STOP_BLOCK = b'event: content_block_stop\ndata: {"type":"content_block_stop","index":%d}\n\n'
_MESSAGE_STOP = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'


class AnthropicDialect(PartsWriter):
    """One Messages response: its events (one content block open at a time) or its
    ``Message`` body. One choice: the dialect is its own writer."""

    heartbeat = _PING

    def __init__(
        self,
        model: str,
        *,
        tool_mode: ToolMode = "none",
        tool_names: Sequence[str] = (),
        stops: Sequence[str] = (),
        max_tokens: int | None = None,
        reasoning: tuple[str, str] | None = None,
        inside: bool = False,
        omit_thinking: bool = False,
        parallel_calls: bool = True,
    ) -> None:
        self.model = model
        self._omit_thinking = omit_thinking
        self._max_tokens = max_tokens
        self.id = new_id("msg_")
        #: the request's id (``X-Request-Id``), in trioserve's field of the message
        self.request_id: str | None = None
        #: what ``truncation: "auto"`` dropped (docs/dialects.md, "Truncation")
        self._dropped: Dropped | None = None
        self._reader = ChoiceReader(
            tool_mode, tool_names, reasoning=reasoning, inside=inside, parallel_calls=parallel_calls
        )
        self._reasoning = reasoning is not None
        self._stops = frozenset(stops)
        #: the index and type of the open block (``None``: none is open)
        self._index = -1
        self._open: str | None = None
        self._stop_reason = "end_turn"
        self._stop_sequence: str | None = None
        self._cause: EndCause = "stop"
        self._message: str | None = None
        self._prompt_tokens = 0
        self.writers = [self]
        self._text_prefix = b""
        self._text_suffix = b"}}\n\n"

    def _start(self, block: dict[str, object]) -> bytes:
        out = self._close()
        self._index += 1
        self._open = str(block["type"])
        if self._open == "text":
            self._text_prefix = (
                b'event: content_block_delta\ndata: {"type":"content_block_delta","index":'
                + str(self._index).encode()
                + b',"delta":{"type":"text_delta","text":'
            )
        return out + _event(
            b"content_block_start",
            {"type": "content_block_start", "index": self._index, "content_block": block},
        )

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        out = b""
        if self._open == "thinking":  # (no signature: nothing here verifies one)
            delta = {"type": "signature_delta", "signature": ""}
            out = _event(
                b"content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta}
            )
        self._open = None
        return out + _STOP_BLOCK % self._index

    def note_truncation(self, dropped: Dropped) -> None:
        """``truncation: "auto"`` dropped turns: the message says so."""
        self._dropped = dropped

    def plain_delta(self, text: str) -> bytes:
        return self._text_prefix + encode_json(text) + self._text_suffix

    def opening(self, prompt_tokens: int) -> bytes:
        self._prompt_tokens = prompt_tokens
        message: dict[str, object] = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": prompt_tokens,
                "output_tokens": 0,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
        }
        extension = trioserve_extension(self.request_id, truncation=self._dropped)
        if extension:
            message["trioserve"] = extension
        out = _event(b"message_start", {"type": "message_start", "message": message})
        if self._reader.mode == "none" and not self._reasoning:
            out += self._start({"type": "text", "text": ""})
        return out

    def _encode(self, parts: tuple[Part, ...]) -> bytes:
        out = b""
        for part in parts:
            if type(part) is TextPart:
                if self._open != "text":
                    out += self._start({"type": "text", "text": ""})
                out += self.plain_delta(part.text)
            elif type(part) is ThinkingPart:
                if self._open != "thinking":
                    out += self._start({"type": "thinking", "thinking": "", "signature": ""})
                if self._omit_thinking:
                    continue  # (display: omitted: the block, without its text)
                delta = {"type": "thinking_delta", "thinking": part.text}
                out += _event(
                    b"content_block_delta",
                    {"type": "content_block_delta", "index": self._index, "delta": delta},
                )
            elif type(part) is CallStart:
                out += self._start(
                    {"type": "tool_use", "id": new_id("toolu_"), "name": part.name, "input": {}}
                )
                if part.arguments:
                    out += self._json_delta(part.arguments)
            else:
                assert isinstance(part, CallArguments)
                out += self._json_delta(part.fragment)
        return out

    def _block_delta(self, delta: dict[str, object]) -> bytes:
        return _event(
            b"content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta}
        )

    def _json_delta(self, fragment: str) -> bytes:
        return self._block_delta({"type": "input_json_delta", "partial_json": fragment})

    def _decide(self, cause: EndCause, message: str | None, stop_sequence: str | None, called: bool) -> None:
        self._cause, self._message = cause, message
        if cause == "stop":
            if called:
                self._stop_reason = "tool_use"
            elif stop_sequence is not None and stop_sequence in self._stops:
                self._stop_reason, self._stop_sequence = "stop_sequence", stop_sequence
            else:
                self._stop_reason = "end_turn"
        else:  # length, or cut short by a deadline or shutdown: the text is not complete
            self._stop_reason = "max_tokens"

    def _close_choice(self, cause: EndCause, message: str | None, stop_sequence: str | None) -> bytes:
        self._decide(cause, message, stop_sequence, self._reader.called)
        return self._close()

    def limit_max_tokens(self, limit: int) -> None:
        """The server's ``--max-tokens-limit`` bounds this response below what it asked
        for: reaching it is ``max_tokens``, not the context's end."""
        if self._max_tokens is None or limit < self._max_tokens:
            self._max_tokens = limit

    def _stop_reason_for(self, usage: Usage) -> str:
        if (
            self._cause == "length"
            and self._max_tokens is not None
            and usage.completion_tokens < self._max_tokens
        ):
            return "model_context_window_exceeded"  # (max_tokens was more than the context had room for)
        return self._stop_reason

    def _usage(self, usage: Usage) -> dict[str, object]:
        body: dict[str, object] = {
            "input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "output_tokens": usage.completion_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": usage.cached_tokens,
        }
        split = usage.cache_split()
        if split is not None:
            body["trioserve"] = {"cached_tokens": split}
        return body

    def _extension(self, body: dict[str, object]) -> dict[str, object]:
        extension = trioserve_extension(
            self.request_id, truncation=self._dropped, cause=self._cause, message=self._message
        )
        if extension:
            body["trioserve"] = extension
        return body

    def end(self, usage: Usage) -> bytes:
        delta: dict[str, object] = {
            "type": "message_delta",
            "delta": {"stop_reason": self._stop_reason_for(usage), "stop_sequence": self._stop_sequence},
            "usage": self._usage(usage),
        }
        return _event(b"message_delta", self._extension(delta)) + _MESSAGE_STOP

    def stream_error(self, error: TrioserveError) -> bytes:
        _, body = anthropic_error(error)
        return _event(b"error", body)

    def body(self, choices: Sequence[ChoiceResult], usage: Usage) -> bytes:
        (result,) = choices
        content: list[dict[str, object]] = []
        called = False
        if result.reasoning is not None:
            thought = "" if self._omit_thinking else result.reasoning
            content.append({"type": "thinking", "thinking": thought, "signature": ""})
        if result.text:
            content.append({"type": "text", "text": result.text})
        for _call_id, name, arguments in result.tool_calls or ():
            try:
                value = json.loads(arguments)
            except (ValueError, RecursionError):  # cut short (max_tokens), or too deep: as text
                content.append({"type": "text", "text": arguments})
                continue
            called = True
            content.append({"type": "tool_use", "id": new_id("toolu_"), "name": name, "input": value})
        self._decide(result.cause, None, result.stop_sequence, called)
        message: dict[str, object] = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": content,
            "model": self.model,
            "stop_reason": self._stop_reason_for(usage),
            "stop_sequence": self._stop_sequence,
            "usage": self._usage(usage),
        }
        return encode_json(self._extension(message))
