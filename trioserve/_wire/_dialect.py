"""How a response is written in one API dialect, sans-IO: the interface the HTTP layer
drives (``_http/_generation.py`` knows no dialect), and OpenAI's chat and completions
dialect. The Anthropic Messages and OpenAI Responses dialects are ``_anthropic.py`` and
``_responses.py``; the design: ``docs/dialects.md``.

One :class:`Dialect` per response. A stream is ``opening()``, then text deltas — through
``plain_delta`` (the hot path: pre-encoded, one JSON string encode per delta) when the
response is one choice of plain text, else through the choice's ``writers`` — then each
choice's ``finish`` and one ``end``; or ``stream_error`` once it has failed. A
non-streamed response is one ``body``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, Protocol

from .._core._exceptions import TrioserveError
from .._core._types import EndCause, TokenLogprob, Usage
from ._choices import ChoiceReader, ChoiceStream, ToolMode
from ._openai_writer import ChoiceResult, ChunkEncoder, error_event, non_stream_response
from ._sse import HEARTBEAT
from ._truncation import Dropped

__all__ = ["ChoiceWriter", "Dialect", "OpenAIDialect"]


class ChoiceWriter(Protocol):
    """One choice of a streamed response: its text in, the dialect's bytes out."""

    def delta(self, text: str, logprobs: Sequence[TokenLogprob] | None) -> bytes: ...

    def finish(
        self, cause: EndCause, message: str | None = None, stop_sequence: str | None = None
    ) -> bytes: ...


class Dialect(Protocol):
    """One response, in one API dialect."""

    @property
    def heartbeat(self) -> bytes:
        """What a silent stream sends to stay alive (an SSE comment; Anthropic's ``ping``)."""
        ...

    @property
    def writers(self) -> Sequence[ChoiceWriter]:
        """One per choice."""
        ...

    def plain_delta(self, text: str) -> bytes:
        """A text delta of a one-choice, text-only response, as complete SSE bytes."""
        ...

    def opening(self, prompt_tokens: int) -> bytes:
        """The first bytes of the stream, right after the headers."""
        ...

    def end(self, usage: Usage) -> bytes:
        """The end of the stream, after every choice's ``finish`` (``usage``: final)."""
        ...

    def stream_error(self, error: TrioserveError) -> bytes:
        """The last bytes of a stream that failed after it started."""
        ...

    def body(self, choices: Sequence[ChoiceResult], usage: Usage) -> bytes:
        """The body of a non-streamed response."""
        ...

    #: the request's id (``X-Request-Id``): set by the HTTP layer before anything is
    #: written; every body carries it in trioserve's field (a non-streamed body; a
    #: stream's first or last event)
    request_id: str | None

    def limit_max_tokens(self, limit: int) -> None:
        """The server's ``--max-tokens-limit`` bounds this response below what it asked
        for (only a request whose ``max_tokens`` is an upper bound, Anthropic's, is held
        to it rather than refused): the dialect that reports why it stopped notes it."""
        ...


class OpenAIDialect:
    """``/v1/chat/completions`` (``kind="chat"``) and ``/v1/completions`` (``"text"``)."""

    heartbeat = HEARTBEAT

    def __init__(
        self,
        kind: Literal["text", "chat"],
        model: str,
        *,
        include_usage: bool = False,
        choices: int = 1,
        tool_mode: ToolMode = "none",
        tool_names: Sequence[str] = (),
        reasoning: tuple[str, str] | None = None,
        inside: bool = False,
        parallel_calls: bool = True,
    ) -> None:
        self.kind = kind
        self.model = model
        first = ChunkEncoder(kind, model, include_usage=include_usage)
        self.encoders = [first] + [
            ChunkEncoder(kind, model, include_usage=include_usage, index=i, first=first)
            for i in range(1, choices)
        ]
        self.writers: list[ChoiceStream] = [
            ChoiceStream(
                encoder,
                ChoiceReader(
                    tool_mode, tool_names, reasoning=reasoning, inside=inside, parallel_calls=parallel_calls
                ),
            )
            for encoder in self.encoders
        ]
        self.plain_delta: Callable[[str], bytes] = first.delta

    @property
    def request_id(self) -> str | None:
        return self.encoders[0].request_id

    @request_id.setter
    def request_id(self, value: str | None) -> None:
        for encoder in self.encoders:
            encoder.request_id = value

    def opening(self, prompt_tokens: int) -> bytes:
        if self.kind == "chat":
            return b"".join(encoder.role() for encoder in self.encoders)
        return b""

    def end(self, usage: Usage) -> bytes:
        return self.encoders[0].end(usage)

    def stream_error(self, error: TrioserveError) -> bytes:
        return error_event(error.to_dict())

    def note_truncation(self, dropped: Dropped) -> None:
        """``truncation: "auto"`` dropped turns: the finish chunks and the body say so."""
        for encoder in self.encoders:
            encoder.truncation = dropped.extension()

    def body(self, choices: Sequence[ChoiceResult], usage: Usage) -> bytes:
        return non_stream_response(
            self.kind,
            model=self.model,
            usage=usage,
            choices=choices,
            request_id=self.request_id,
            truncation=self.encoders[0].truncation,
        )

    def limit_max_tokens(self, limit: int) -> None:
        """(Its ``max_tokens`` is refused above the limit, never held to it.)"""
