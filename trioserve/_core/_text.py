"""Text assembly, sans-IO: token bytes in, safe text deltas out.

:class:`Utf8Assembler` never lets an incomplete UTF-8 sequence through (it waits for the
bytes that complete it); :class:`StopMatcher` holds back any tail that could still
become a stop sequence and never lets the stop sequence itself through;
:class:`TextAssembler` chains both, and is the per-token hot path. What the client sees:
``docs/api.md``, "Streaming format".
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

__all__ = ["StopMatcher", "TextAssembler", "Utf8Assembler"]


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


class TextAssembler:
    """Token bytes → text deltas, UTF-8 safe and stop-sequence aware."""

    __slots__ = ("_stop", "_utf8", "stopped")

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self._utf8 = Utf8Assembler()
        self._stop = StopMatcher(stops)
        #: True once a stop sequence has been seen; feed nothing more after that.
        self.stopped = False

    def feed(self, piece: bytes) -> str:
        text = self._utf8.feed(piece)
        if not text:
            return ""
        text, self.stopped = self._stop.feed(text)
        return text

    def flush(self) -> str:
        """End of stream (length, EOS): release whatever was held back."""
        text = self._utf8.flush()
        if text:
            text, self.stopped = self._stop.feed(text)
            if self.stopped:
                return text
        return text + self._stop.flush()

    @property
    def stop_sequence(self) -> str | None:
        """The stop sequence that ended the text (``None``: none did)."""
        return self._stop.matched
