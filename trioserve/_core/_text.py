"""Text assembly, sans-IO: token bytes in, safe text deltas out.

:class:`Utf8Assembler` never lets an incomplete UTF-8 sequence through (it waits for the
bytes that complete it); :class:`StopMatcher` holds back any tail that could still
become a stop sequence and never lets the stop sequence itself through;
:class:`TextAssembler` chains both, and is the per-token hot path. What the client sees:
``docs/api.md``, "Streaming format".
"""

from __future__ import annotations

import codecs
import time
from collections.abc import Callable, Sequence

__all__ = ["LineRules", "StopMatcher", "TextAssembler", "Utf8Assembler"]


class Utf8Assembler:
    """Incremental UTF-8 decoding that never emits a broken character.

    Invalid bytes (which a random-weight model can produce) become U+FFFD. A character
    left incomplete when generation ends (the token limit can fall between the bytes of
    one character) is dropped: it is not a character, and a U+FFFD would only be noise.
    The streamed and the non-streamed text go through this same code, so they agree.
    """

    __slots__ = ("_decoder",)

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, piece: bytes) -> str:
        """Return the text completed by ``piece`` (possibly ``""``)."""
        return self._decoder.decode(piece)

    def flush(self) -> str:
        """End of stream: drop an incomplete trailing sequence (see the class doc)."""
        self._decoder.reset()
        return ""


class StopMatcher:
    """Finds the first stop sequence in a text stream fed in arbitrary pieces.

    ``feed`` returns the text that is safe to emit and whether a stop sequence was hit.
    After a hit, the text before the stop sequence has been returned, the stop sequence
    and everything after it are dropped, and the matcher must not be fed again.
    """

    __slots__ = ("_held", "_max_hold", "_stops", "matched")

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stop for stop in stops if stop)
        self._max_hold = max((len(stop) for stop in self._stops), default=1) - 1
        self._held = ""
        #: the stop sequence that was hit (``None``: none yet)
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        if not self._stops:
            return text, False
        buffer = self._held + text
        first = -1
        for stop in self._stops:
            index = buffer.find(stop)
            if index != -1 and (first == -1 or index < first):
                first = index
                self.matched = stop
        if first != -1:
            self._held = ""
            return buffer[:first], True
        hold = self._hold_length(buffer)
        if hold:
            self._held = buffer[-hold:]
            return buffer[:-hold], False
        self._held = ""
        return buffer, False

    def flush(self) -> str:
        """End of stream without a stop: the held tail was not a stop after all."""
        held, self._held = self._held, ""
        return held

    def _hold_length(self, buffer: str) -> int:
        # Longest suffix of buffer that is a proper prefix of some stop sequence. Per
        # stop, only where its first character occurs (found in C), and only for a
        # longer suffix than one found already: the work per token grows with the
        # stops' total length, not their longest × their number (the wire layer bounds
        # both: RequestLimits).
        end = len(buffer)
        best = 0
        for stop in self._stops:
            first = stop[0]
            position = buffer.find(first, max(end - len(stop) + 1, 0), end - best)
            while position != -1:
                if stop.startswith(buffer[position:]):
                    best = end - position
                    break
                position = buffer.find(first, position + 1, end - best)
        return best


class LineRules:
    """llama-server's line rules for code completion (its ``/infill``), applied to the
    text of each token as it comes, with its semantics exactly
    (``process_token``, tools/server/server-context.cpp):

    * ``n_indent``: once the text has a new line, a later line that starts with less
      indentation (spaces and tabs) than ``n_indent`` ends the generation, and that
      line is cut after its indentation — an editor's completion stays inside the
      block it was asked in (llama-server checks one line per token, a token late:
      so does this);
    * ``t_max_predict``: a token with a new line, generated more than this many
      seconds after the first token, ends the generation (whole lines only).

    A line that may still be cut is held back until it has passed its check (so a
    stream never sends what the body would not have). An end by either rule is the
    ``limit`` stop (:attr:`ended`)."""

    __slots__ = (
        "_clock",
        "_has_new_line",
        "_last_nl",
        "_passed",
        "_sent",
        "_started",
        "_text",
        "ended",
        "n_indent",
        "t_max",
    )

    def __init__(
        self,
        n_indent: int = 0,
        t_max_predict: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.n_indent = n_indent
        self.t_max = t_max_predict
        self._clock = clock
        self._text = ""
        self._sent = 0
        #: llama-server's ``last_nl_pos``: the start of the line checked next
        self._last_nl = 0
        #: the start of the last line that passed its check (-1: none)
        self._passed = -1
        self._has_new_line = False
        self._started: float | None = None
        #: a rule ended the generation
        self.ended = False

    def feed(self, text: str) -> str:
        """The text safe to send after this token's ``text`` (``ended`` says whether a
        rule stopped the generation with it)."""
        if self._started is None:
            self._started = self._clock()
        self._text += text
        if self._has_new_line and self.n_indent > 0:
            start = self._last_nl
            if start > 0:
                generated = self._text
                pos = start
                while pos < len(generated) and generated[pos] in " \t":
                    pos += 1
                if pos < len(generated):
                    if pos - start < self.n_indent:
                        self.ended = True
                        self._text = generated[:pos]
                    else:
                        self._passed = start
            found = self._text.find("\n", self._last_nl)
            if found != -1:
                self._last_nl = found + 1
        if "\n" in text:
            self._has_new_line = True
            if self.t_max is not None and self._clock() - self._started > self.t_max:
                self.ended = True
        return self._release()

    def _release(self) -> str:
        end = len(self._text)
        if not self.ended and self.n_indent > 0:
            # hold back from the first line that has not passed its check
            start = self._last_nl
            if start == 0 or start == self._passed:
                found = self._text.find("\n", start)
                start = found + 1 if found != -1 else end
            end = min(end, start)
        out = self._text[self._sent : end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return out

    def flush(self) -> str:
        """The end of the generation: whatever was held back."""
        out, self._sent = self._text[self._sent :], len(self._text)
        return out


class TextAssembler:
    """Token bytes → text deltas, UTF-8 safe and stop-sequence aware (and, for code
    completion, line-rule aware: :class:`LineRules`)."""

    __slots__ = ("_lines", "_stop", "_utf8", "limited", "stopped")

    def __init__(self, stops: Sequence[str] = (), lines: LineRules | None = None) -> None:
        self._utf8 = Utf8Assembler()
        self._stop = StopMatcher(stops)
        self._lines = lines
        #: True once a stop sequence has been seen — or a line rule ended the text
        #: (``limited`` then) —; feed nothing more after that.
        self.stopped = False
        self.limited = False

    def feed(self, piece: bytes) -> str:
        text = self._utf8.feed(piece)
        if not text:
            return ""
        text, self.stopped = self._stop.feed(text)
        lines = self._lines
        if lines is not None:
            text = lines.feed(text) + (lines.flush() if self.stopped else "")
            if lines.ended:
                self.stopped = self.limited = True
        return text

    def flush(self) -> str:
        """End of stream (length, EOS): release whatever was held back."""
        text = self._utf8.flush()
        if text:
            text, self.stopped = self._stop.feed(text)
            if self.stopped:
                return self._through_lines(text, end=True)
        return self._through_lines(text + self._stop.flush(), end=True)

    def _through_lines(self, text: str, *, end: bool) -> str:
        lines = self._lines
        if lines is None:
            return text
        out = lines.feed(text) if text else ""
        if lines.ended:
            self.limited = True
        return out + lines.flush() if end else out

    @property
    def stop_sequence(self) -> str | None:
        """The stop sequence that ended the text (``None``: none did)."""
        return self._stop.matched
