"""The base of a streamed choice's writer: the text read into parts
(:class:`~._choices.ChoiceReader`), each part encoded in the dialect's events, and what
closes the choice — the Anthropic, Ollama and Responses writers alike (OpenAI's
:class:`~._choices.ChoiceStream` writes chunks through its encoder)."""

from __future__ import annotations

from collections.abc import Sequence

from .._core._types import EndCause, TokenLogprob
from ._choices import ChoiceReader, Part

__all__ = ["PartsWriter"]


class PartsWriter:
    """A streamed choice written from its :class:`ChoiceReader`'s parts: each dialect's
    writer says how a part is encoded (``_encode``) and what closes the choice
    (``_close_choice``)."""

    __slots__ = ()

    _reader: ChoiceReader

    def _encode(self, parts: tuple[Part, ...]) -> bytes:  # pragma: no cover
        raise NotImplementedError

    def _close_choice(
        self, cause: EndCause, message: str | None, stop_sequence: str | None
    ) -> bytes:  # pragma: no cover
        raise NotImplementedError

    def delta(self, text: str, logprobs: Sequence[TokenLogprob] | None) -> bytes:
        return self._encode(self._reader.feed(text, logprobs))

    def finish(self, cause: EndCause, message: str | None = None, stop_sequence: str | None = None) -> bytes:
        """The rest of the choice (what the reader held back), and what closes it."""
        return self._encode(self._reader.finish(cause)) + self._close_choice(cause, message, stop_sequence)
