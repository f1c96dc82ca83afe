"""One choice of a response, sans-IO: its events in, its SSE chunks (or its finished
body) out — text, log-probabilities and tool calls.

The plain case (text only) never comes here: the HTTP layer calls
:meth:`~trioserve._wire._openai.ChunkEncoder.delta` directly, the per-token hot path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from .._core._types import EndCause, TokenLogprob
from ._openai import ChoiceResult, ChunkEncoder
from ._tools import StreamedCallParser, new_call_id, parse_calls

__all__ = [
    "CallArguments",
    "CallStart",
    "ChoiceReader",
    "ChoiceStream",
    "Part",
    "TextPart",
    "ToolMode",
    "finished_choice",
]

#: how the text is read: as content; as content or one call (``auto``); as one call
#: (``forced``: ``required`` or a named function — the constraint makes it one)
ToolMode = Literal["none", "auto", "forced"]

_TAG = "<tool_call>"


def _could_be_call(text: str) -> bool:
    stripped = text.lstrip()
    return not stripped or stripped.startswith("{") or _TAG.startswith(stripped[: len(_TAG)])


@dataclass(frozen=True, slots=True)
class TextPart:
    """Text of the answer (with the log-probabilities of its tokens, if asked for)."""

    text: str
    logprobs: Sequence[TokenLogprob] | None = None


@dataclass(frozen=True, slots=True)
class CallStart:
    """A tool call begins: its name is complete (``arguments``: the first of them)."""

    index: int
    name: str
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class CallArguments:
    """More of the current tool call's arguments (JSON text)."""

    index: int
    fragment: str


Part = TextPart | CallStart | CallArguments
_NOTHING: tuple[Part, ...] = ()


class ChoiceReader:
    """Reads one streamed choice's text as parts — text, a tool call's start, its
    argument fragments — the same for every API dialect (``_dialect.py``).

    ``none``: every delta is text. ``forced``: the constraint makes the text one call,
    read as it streams. ``auto``: text is held while it may still be a call, and read
    as one at the end if it is exactly one."""

    __slots__ = ("_held", "_held_logprobs", "_mode", "_names", "_parser", "_plain", "called")

    def __init__(self, mode: ToolMode, names: Sequence[str] = ()) -> None:
        self._mode = mode
        self._names = tuple(names)
        self._parser = StreamedCallParser() if mode == "forced" else None
        #: auto: text held while it may still be a call
        self._held = ""
        self._held_logprobs: list[TokenLogprob] | None = None
        self._plain = mode == "none"
        #: a tool call was read
        self.called = False

    @property
    def mode(self) -> ToolMode:
        return self._mode

    def feed(self, text: str, logprobs: Sequence[TokenLogprob] | None = None) -> tuple[Part, ...]:
        if self._parser is not None:
            name, fragment = self._parser.feed(text)
            if name is not None:
                self.called = True
                return (CallStart(0, name, fragment),)
            return (CallArguments(0, fragment),) if fragment and self.called else _NOTHING
        if not self._plain:
            self._held += text
            if logprobs is not None:
                self._held_logprobs = (self._held_logprobs or []) + list(logprobs)
            if _could_be_call(self._held):
                return _NOTHING
            self._plain = True
            text, self._held = self._held, ""
            logprobs, self._held_logprobs = self._held_logprobs, None
        return (TextPart(text, logprobs),)

    def finish(self, cause: EndCause) -> tuple[Part, ...]:
        """The rest of the choice: what was held, read now that the text is complete
        (``cause``: a text cut short is never read as a call)."""
        if self._parser is not None:
            rest = self._parser.finish(complete=cause == "stop")
            if rest and self.called:
                return (CallArguments(0, rest),)
            if rest:  # cut before the name was complete: what there is, as content
                return (TextPart(rest),)
            return _NOTHING
        if not self._held:
            return _NOTHING
        held, self._held = self._held, ""
        held_logprobs, self._held_logprobs = self._held_logprobs, None
        calls = parse_calls(held, self._names) if cause == "stop" else None
        if calls:
            self.called = True
            return tuple(CallStart(i, call.name, call.arguments) for i, call in enumerate(calls))
        return (TextPart(held, held_logprobs),)


class ChoiceStream:
    """Encodes one streamed OpenAI choice whose events need more than text deltas."""

    __slots__ = ("_call_ids", "_encoder", "_reader")

    def __init__(self, encoder: ChunkEncoder, mode: ToolMode, names: Sequence[str] = ()) -> None:
        self._encoder = encoder
        self._reader = ChoiceReader(mode, names)
        self._call_ids: dict[int, str] = {}

    def _encode(self, parts: tuple[Part, ...]) -> bytes:
        encoder = self._encoder
        out = b""
        for part in parts:
            if type(part) is TextPart:
                if part.logprobs is not None:
                    out += encoder.delta_logprobs(part.text, part.logprobs)
                else:
                    out += encoder.delta(part.text)
            elif type(part) is CallStart:
                call_id = self._call_ids[part.index] = new_call_id()
                out += encoder.tool_call_start(part.index, call_id, part.name, part.arguments)
            else:
                assert isinstance(part, CallArguments)
                out += encoder.tool_call_arguments(part.index, part.fragment)
        return out

    def delta(self, text: str, logprobs: Sequence[TokenLogprob] | None) -> bytes:
        return self._encode(self._reader.feed(text, logprobs))

    def finish(self, cause: EndCause, message: str | None = None, stop_sequence: str | None = None) -> bytes:
        """The rest of the choice, and its finish chunk."""
        out = self._encode(self._reader.finish(cause))
        reason = "tool_calls" if self._reader.called and cause == "stop" else None
        return out + self._encoder.finish(cause, message, finish_reason=reason)


def finished_choice(
    text: str,
    cause: EndCause,
    mode: ToolMode,
    names: Sequence[str] = (),
    logprobs: list[TokenLogprob] | None = None,
    stop_sequence: str | None = None,
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
    return ChoiceResult(text=text, cause=cause, logprobs=logprobs, stop_sequence=stop_sequence)
