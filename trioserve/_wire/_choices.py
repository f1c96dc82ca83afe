"""One choice of a response, sans-IO: its events in, its SSE chunks (or its finished
body) out — text, log-probabilities and tool calls.

The plain case (text only) never comes here: the HTTP layer calls
:meth:`~trioserve._wire._openai.ChunkEncoder.delta` directly, the per-token hot path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from .._core._types import EndCause, TokenLogprob
from ._openai import ChoiceResult, ChunkEncoder
from ._tools import StreamedCallParser, new_call_id, parse_calls

__all__ = ["ChoiceStream", "ToolMode", "finished_choice"]

#: how the text is read: as content; as content or one call (``auto``); as one call
#: (``forced``: ``required`` or a named function — the constraint makes it one)
ToolMode = Literal["none", "auto", "forced"]

_TAG = "<tool_call>"


def _could_be_call(text: str) -> bool:
    stripped = text.lstrip()
    return not stripped or stripped.startswith("{") or _TAG.startswith(stripped[: len(_TAG)])


class ChoiceStream:
    """Encodes one streamed choice whose events need more than text deltas."""

    __slots__ = ("_called", "_encoder", "_held", "_held_logprobs", "_mode", "_names", "_parser", "_plain")

    def __init__(self, encoder: ChunkEncoder, mode: ToolMode, names: Sequence[str] = ()) -> None:
        self._encoder = encoder
        self._mode = mode
        self._names = tuple(names)
        self._parser = StreamedCallParser() if mode == "forced" else None
        #: auto: text held while it may still be a call
        self._held = ""
        self._held_logprobs: list[TokenLogprob] | None = None
        self._plain = mode == "none"
        self._called = False

    def delta(self, text: str, logprobs: Sequence[TokenLogprob] | None) -> bytes:
        encoder = self._encoder
        if self._parser is not None:
            name, fragment = self._parser.feed(text)
            if name is not None:
                self._called = True
                return encoder.tool_call_start(0, new_call_id(), name, fragment)
            return encoder.tool_call_arguments(0, fragment) if fragment and self._called else b""
        if not self._plain:
            self._held += text
            if logprobs is not None:
                self._held_logprobs = (self._held_logprobs or []) + list(logprobs)
            if _could_be_call(self._held):
                return b""
            self._plain = True
            text, self._held = self._held, ""
            logprobs, self._held_logprobs = self._held_logprobs, None
        if logprobs is not None:
            return encoder.delta_logprobs(text, logprobs)
        return encoder.delta(text)

    def finish(self, cause: EndCause, message: str | None = None) -> bytes:
        """The rest of the choice, and its finish chunk."""
        encoder = self._encoder
        out = b""
        if self._parser is not None:
            rest = self._parser.finish(complete=cause == "stop")
            if rest and self._called:
                out += encoder.tool_call_arguments(0, rest)
            elif rest:  # cut before the name was complete: what there is, as content
                out += encoder.delta(rest)
        elif self._held:
            calls = parse_calls(self._held, self._names) if cause == "stop" else None
            if calls:
                self._called = True
                for i, call in enumerate(calls):
                    out += encoder.tool_call_start(i, new_call_id(), call.name, call.arguments)
            elif self._held_logprobs is not None:
                out += encoder.delta_logprobs(self._held, self._held_logprobs)
            else:
                out += encoder.delta(self._held)
            self._held = ""
            self._held_logprobs = None
        reason = "tool_calls" if self._called and cause == "stop" else None
        return out + encoder.finish(cause, message, finish_reason=reason)


def finished_choice(
    text: str,
    cause: EndCause,
    mode: ToolMode,
    names: Sequence[str] = (),
    logprobs: list[TokenLogprob] | None = None,
) -> ChoiceResult:
    """A non-streamed choice: its text read as content or as a tool call."""
    if mode == "forced":
        parser = StreamedCallParser()
        _, arguments = parser.feed(text)
        arguments += parser.finish(complete=cause == "stop")
        if parser.name is not None:
            return ChoiceResult(text="", cause=cause, tool_calls=[(new_call_id(), parser.name, arguments)])
    elif mode == "auto" and cause == "stop":
        calls = parse_calls(text, names)
        if calls:
            return ChoiceResult(
                text="", cause=cause, tool_calls=[(new_call_id(), c.name, c.arguments) for c in calls]
            )
    return ChoiceResult(text=text, cause=cause, logprobs=logprobs)
