"""One choice of a response, sans-IO: its events in, its SSE chunks (or its finished
body) out — text, log-probabilities and tool calls.

The plain case (text only) never comes here: the HTTP layer calls
:meth:`~trioserve._wire._openai.ChunkEncoder.delta` directly, the per-token hot path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec

from .._core._types import EndCause, TokenLogprob
from ._openai_writer import ChoiceResult, ChunkEncoder
from ._tools import StreamedCallParser, new_call_id, parse_calls

__all__ = [
    "CallArguments",
    "CallStart",
    "ChoiceReader",
    "ChoiceStream",
    "Part",
    "TextPart",
    "ThinkingPart",
    "ToolMode",
    "finished_choice",
]

#: how the text is read: as content; as content or calls, one or several (``auto``; one when
#: parallel calls are off); as one call (``forced``: ``required`` or a named function — the
#: constraint makes it one)
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


@dataclass(frozen=True, slots=True)
class ThinkingPart:
    """The model's reasoning, before its answer (a reasoning template's ``<think>``)."""

    text: str


Part = TextPart | CallStart | CallArguments | ThinkingPart
_NOTHING: tuple[Part, ...] = ()


def _held_back(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that could begin ``marker``."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


class ChoiceReader:
    """Reads one streamed choice's text as parts — text, a tool call's start, its
    argument fragments — the same for every API dialect (``_dialect.py``).

    ``none``: every delta is text. ``forced``: the constraint makes the text one call,
    read as it streams. ``auto``: text is held while it may still be a call, and read
    as calls at the end if it is exactly calls (one or several; with
    ``parallel_calls=False`` only the first is read, the rest dropped).

    ``reasoning``: the markers around a reasoning model's thinking (``inside``: the
    prompt opened it). Thinking at the start of the text is read as
    :class:`ThinkingPart`; the rest as above."""

    __slots__ = (
        "_held",
        "_held_logprobs",
        "_mode",
        "_names",
        "_parallel_calls",
        "_parser",
        "_pending",
        "_plain",
        "_reasoning",
        "_state",
        "_strip",
        "called",
        "reasoned",
    )

    def __init__(
        self,
        mode: ToolMode,
        names: Sequence[str] = (),
        *,
        reasoning: tuple[str, str] | None = None,
        inside: bool = False,
        parallel_calls: bool = True,
    ) -> None:
        self._mode = mode
        #: ``False``: the request allows one call (``parallel_tool_calls: false``)
        self._parallel_calls = parallel_calls
        self._reasoning = reasoning
        #: ``answer``: past any reasoning; ``start``: reasoning may still open; ``inside``
        self._state = "answer" if reasoning is None else ("inside" if inside else "start")
        #: reasoning: text held while a marker may be forming
        self._pending = ""
        #: the reasoning has just closed: the whitespace after it is not the answer's
        self._strip = False
        #: some reasoning was read
        self.reasoned = False
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

    def _think(self, text: str) -> tuple[tuple[Part, ...], str]:
        """Reasoning: (the thinking read from ``text``, the answer text after it)."""
        assert self._reasoning is not None
        opening, closing = self._reasoning
        buffer = self._pending + text
        self._pending = ""
        if self._state == "start":
            stripped = buffer.lstrip()
            if stripped.startswith(opening):
                self._state, buffer = "inside", stripped[len(opening) :]
            elif opening.startswith(stripped):  # (also: only whitespace so far)
                self._pending = buffer
                return _NOTHING, ""
            else:
                self._state = "answer"
                return _NOTHING, buffer
        end = buffer.find(closing)
        if end != -1:
            self._state = "answer"
            thought, rest = buffer[:end], buffer[end + len(closing) :].lstrip()
            self._strip = not rest
        else:
            hold = _held_back(buffer, closing)
            thought, rest = buffer[: len(buffer) - hold], ""
            self._pending = buffer[len(buffer) - hold :]
        if not thought:
            return _NOTHING, rest
        self.reasoned = True
        return (ThinkingPart(thought),), rest

    def feed(self, text: str, logprobs: Sequence[TokenLogprob] | None = None) -> tuple[Part, ...]:
        if self._state != "answer":
            thought, text = self._think(text)
            if not text:
                return thought
            return thought + self._answer(text, None)
        if self._strip:
            text = text.lstrip()
            if not text:
                return _NOTHING
            self._strip = False
        return self._answer(text, logprobs)

    def _answer(self, text: str, logprobs: Sequence[TokenLogprob] | None) -> tuple[Part, ...]:
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
        if self._state != "answer":
            pending, self._pending = self._pending, ""
            if self._state == "inside":  # reasoning cut short
                self._state = "answer"
                if pending:
                    self.reasoned = True
                return (ThinkingPart(pending),) if pending else _NOTHING
            self._state = "answer"
            return self._answer(pending, None) + self.finish(cause) if pending else self.finish(cause)
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
        calls = (
            parse_calls(held, self._names, parallel_calls=self._parallel_calls) if cause == "stop" else None
        )
        if calls:
            self.called = True
            return tuple(CallStart(i, call.name, call.arguments) for i, call in enumerate(calls))
        return (TextPart(held, held_logprobs),)


class ChoiceStream:
    """Encodes one streamed OpenAI choice whose events need more than text deltas."""

    __slots__ = ("_call_ids", "_encoder", "_reader")

    def __init__(self, encoder: ChunkEncoder, reader: ChoiceReader) -> None:
        self._encoder = encoder
        self._reader = reader
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
            elif type(part) is ThinkingPart:
                out += encoder.reasoning_delta(part.text)
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
    *,
    reasoning: tuple[str, str] | None = None,
    inside: bool = False,
    parallel_calls: bool = True,
) -> ChoiceResult:
    """A non-streamed choice: its text read as content or as tool calls (after the
    reasoning, if the model reasons; ``parallel_calls=False``: one call at most)."""
    if reasoning is not None:
        reader = ChoiceReader("none", reasoning=reasoning, inside=inside)
        parts = reader.feed(text) + reader.finish(cause)
        thought = "".join(p.text for p in parts if type(p) is ThinkingPart)
        answer = "".join(p.text for p in parts if type(p) is TextPart)
        result = finished_choice(
            answer, cause, mode, names, None, stop_sequence, parallel_calls=parallel_calls
        )
        return msgspec.structs.replace(result, reasoning=thought if reader.reasoned else None)
    if mode == "forced":
        parser = StreamedCallParser()
        _, arguments = parser.feed(text)
        arguments += parser.finish(complete=cause == "stop")
        if parser.name is not None:
            return ChoiceResult(text="", cause=cause, tool_calls=[(new_call_id(), parser.name, arguments)])
    elif mode == "auto" and cause == "stop":
        calls = parse_calls(text, names, parallel_calls=parallel_calls)
        if calls:
            return ChoiceResult(
                text="", cause=cause, tool_calls=[(new_call_id(), c.name, c.arguments) for c in calls]
            )
    return ChoiceResult(text=text, cause=cause, logprobs=logprobs, stop_sequence=stop_sequence)
