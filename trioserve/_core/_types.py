"""The engine's vocabulary: what goes in (a request) and what comes out (events).

Small frozen keyword-only dataclasses, in the style of h11's events.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "EndCause",
    "Finished",
    "GenerationRequest",
    "SamplingParams",
    "TextDelta",
    "Usage",
]

#: Why a stream ended. ``stop`` and ``length`` are OpenAI's; the others are trioserve's
#: own and reach clients as the ``finish_reason`` of the final chunk.
EndCause = Literal["stop", "length", "deadline", "disconnect", "shutdown", "stall", "error"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """How to pick each token. ``temperature == 0`` is greedy (deterministic)."""

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    logit_bias: Mapping[int, float] = field(default_factory=dict[int, float])


@dataclass(frozen=True, kw_only=True, slots=True)
class GenerationRequest:
    """One generation: a prompt (text, or token ids) and how to continue it."""

    prompt: str | Sequence[int]
    max_tokens: int | None = 16
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: Sequence[str] = ()
    #: Prepend the model's BOS token when tokenizing a text prompt.
    add_bos: bool = True
    #: Reuse cached prompt prefixes, and leave this prompt's for later requests
    #: (llama-server's ``cache_prompt``). Reuse never changes the text (docs/prompt-cache.md).
    cache_prompt: bool = True


@dataclass(frozen=True, kw_only=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    #: prompt tokens whose evaluation was reused from the prompt cache
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, kw_only=True, slots=True)
class TextDelta:
    """New text. Never splits a UTF-8 character and never contains a stop sequence."""

    text: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Finished:
    """The last event of every stream that ends without raising."""

    reason: EndCause
    usage: Usage
    #: For ``reason == "error"``: what went wrong, for the client.
    message: str | None = None
