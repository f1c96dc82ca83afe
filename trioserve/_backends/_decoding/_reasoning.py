"""Where a reasoning model's generated text is — before its reasoning, inside it, past
it — read from the bytes of its pieces as they are made, the way the wire's
``ChoiceReader`` reads the text (docs/dialects.md, "Ending the reasoning"). A backend that
ends a reasoning on request (``Backend.ends_reasoning``) keeps one per generation: it
says whether the end marker may still be written (once, never a second time after the
model's own), and which markers to write. Pure: no llama.cpp, no Trio; one thread
feeds it (the backend's), another may read :attr:`ReasoningTracker.state`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

__all__ = ["ReasoningTracker", "State", "marker_tokens"]

#: ``start``: the reasoning may still open (only whitespace so far, or part of the
#: opening marker); ``inside``; ``answer``: past it, or it never opened
State = Literal["start", "inside", "answer"]


class ReasoningTracker:
    """Follows one generation's text through its reasoning markers (bytes: a piece may
    split a character; the markers are matched as bytes)."""

    __slots__ = ("_end", "_start", "_tail", "state")

    def __init__(self, start: str, end: str, *, opened: bool) -> None:
        self._start = start.encode()
        self._end = end.encode()
        self.state: State = "inside" if opened else "start"
        #: the text held while a marker may be forming
        self._tail = b""

    def feed(self, piece: bytes) -> None:
        """The next piece of the text (the model's, or a forced marker)."""
        state = self.state
        if state == "answer":
            return
        tail = self._tail + piece
        if state == "start":
            stripped = tail.lstrip()
            if stripped.startswith(self._start):
                self.state, tail = "inside", stripped[len(self._start) :]
            elif self._start.startswith(stripped):  # (also: only whitespace so far)
                self._tail = tail
                return
            else:
                self.state, self._tail = "answer", b""  # it answers without reasoning
                return
        if self._end in tail:
            self.state, self._tail = "answer", b""
            return
        keep = len(self._end) - 1  # (the longest end of the text that may begin the marker)
        self._tail = tail[len(tail) - keep :] if len(tail) > keep else tail

    def to_force(self, start: tuple[int, ...], end: tuple[int, ...]) -> tuple[int, ...]:
        """The tokens that end the reasoning from here (``start``, ``end``: the markers'
        tokens): the end marker inside it; both markers before it opened (an empty
        reasoning, as a template that turns reasoning off writes); none past it (the
        model wrote its own marker first: never a second one)."""
        if self.state == "inside":
            return end
        if self.state == "start":
            return start + end
        return ()

    def text_to_force(self) -> str:
        """:meth:`to_force` as text (a backend whose pieces are text)."""
        if self.state == "inside":
            return self._end.decode()
        if self.state == "start":
            return (self._start + self._end).decode()
        return ""


def marker_tokens(
    tokenize: Callable[..., list[int]], detokenize: Callable[[Sequence[int]], bytes], start: str, end: str
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The markers' tokens as the model writes them (``PreparedPrompt.reasoning_tokens``):
    its special token where the vocabulary has one that reads as the marker (Qwen3's
    ``</think>``), else the marker's text tokenized as text — a control token renders as
    nothing in the generated text, so the wire would never see the reasoning end."""

    def tokens(marker: str) -> tuple[int, ...]:
        special = tokenize(marker, add_bos=False, parse_special=True)
        if detokenize(special) == marker.encode():
            return tuple(special)
        return tuple(tokenize(marker, add_bos=False, parse_special=False))

    return tokens(start), tokens(end)
