"""The engine's vocabulary: what goes in (a request) and what comes out (events).

Small frozen keyword-only dataclasses, in the style of h11's events.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from ._media import Media

__all__ = [
    "SAMPLER_NAMES",
    "Constraint",
    "EndCause",
    "Finished",
    "GenerationEnd",
    "GenerationRequest",
    "Infill",
    "LineLimits",
    "ReasoningMarkers",
    "SamplingParams",
    "TextDelta",
    "TokenLogprob",
    "Usage",
]

#: Why a stream ended: the one type for it, from the backend to the log line and
#: ``trioserve_stream_ends_total``. A backend's generation ends ``stop`` (the model's end
#: token, a stop sequence) or ``length`` (``max_tokens``, the context: :data:`GenerationEnd`);
#: the request around it may end early: ``deadline``, ``disconnect``, ``stall`` (the client
#: stopped reading), ``shutdown``, ``error``, or ``overloaded`` (refused with 429 before it
#: started). On the wire ``finish_reason`` carries only OpenAI's values
#: (``_wire._openai.openai_finish_reason``); the cause goes in the ``trioserve`` field.
EndCause = Literal[
    "stop",
    "length",
    "deadline",
    "disconnect",
    "shutdown",
    "stall",
    "error",
    "overloaded",
    "unload",
    "cancelled",
    "superseded",
    "detach_timeout",
    "evicted",
]
#: How a backend's generation ends on its own (the rest of :data:`EndCause` is decided
#: around it).
GenerationEnd = Literal["stop", "length"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """How to pick each token. ``temperature == 0`` is greedy (deterministic)."""

    temperature: float = 1.0
    top_p: float = 1.0
    #: keep only the ``top_k`` most likely tokens (0: off)
    top_k: int = 0
    #: drop tokens less likely than ``min_p`` × the most likely one's probability (0: off)
    min_p: float = 0.0
    seed: int | None = None
    logit_bias: Mapping[int, float] = field(default_factory=dict[int, float])
    #: OpenAI's penalties, over every token generated so far (not the prompt)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    #: llama.cpp's repetition penalty over the last ``repeat_last_n`` generated tokens
    #: (1: off; -1: all of them)
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    #: llama-server's ``samplers``: the sampler chain in this order (names from
    #: :data:`SAMPLER_NAMES`), then the draw; ``None``: the default order. Only the
    #: listed samplers apply (no ``temperature`` in the list: none applied)
    samplers: tuple[str, ...] | None = None

    @property
    def plain_greedy(self) -> bool:
        """Temperature 0 with nothing that changes the logits: the argmax is the token."""
        return (
            self.temperature == 0
            and self.samplers is None
            and not self.logit_bias
            and self.frequency_penalty == 0
            and self.presence_penalty == 0
            and self.repeat_penalty == 1
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Constraint:
    """What every generated token must keep valid (constrained decoding): a JSON Schema
    (``kind="json_schema"``, ``source`` its JSON text), a Lark grammar (``"lark"``) or a
    GBNF grammar (``"gbnf"``, llama.cpp's format).
    The backend compiles it; a feature it cannot enforce is refused, never ignored."""

    kind: Literal["json_schema", "lark", "gbnf"]
    source: str


#: the sampler names ``SamplingParams.samplers`` may list (llama.cpp's, as llama-server
#: takes them; "infill": llama.cpp's fill-in-the-middle sampler)
SAMPLER_NAMES = frozenset({"top_k", "top_p", "min_p", "temperature", "infill", "penalties"})


@dataclass(frozen=True, kw_only=True, slots=True)
class Infill:
    """A fill-in-the-middle request (code completion): the text before and after the
    cursor (a string, or llama-server's list of strings and token ids), the start of
    the middle, extra context chunks ``(filename, text)``. The backend lays out the
    prompt with the model's FIM tokens (``_backends/_infill.py``)."""

    prefix: str | Sequence[str | int]
    suffix: str | Sequence[str | int]
    extra: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class LineLimits:
    """Code completion's line rules (llama-server's ``n_indent``, ``t_max_predict_ms``:
    ``_core/_text.py``'s :class:`~trioserve._core._text.LineRules`)."""

    n_indent: int = 0
    #: seconds from the first token after which a new line ends the text
    t_max_predict: float | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class ReasoningMarkers:
    """A reasoning model's markers around its reasoning (its chat template's: ``<think>``,
    ``</think>``), and whether the prompt opened it: what a backend needs to end the
    reasoning of a running generation on request (``EventStream.end_reasoning``) by
    writing ``end`` as if the model had (docs/dialects.md, "Ending the reasoning")."""

    start: str
    end: str
    #: the prompt ends inside the reasoning (the template opened it); otherwise it opens
    #: only if the model writes ``start`` first
    opened: bool = False


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
    #: Which prompt cache this request may reuse and fill: cached cells and host-memory
    #: states are shared only between requests of the same salt (vLLM's ``cache_salt``).
    #: The server sets one per API key (``"key:…"``, a hash of the key) or from the
    #: body's ``cache_salt`` (``"salt:…"``); empty: the one shared cache
    #: (docs/operations.md, "What one key can learn").
    cache_salt: str = ""
    #: Let the backend guess tokens from the context and verify them several per decode
    #: call (speculative decoding, where the server enables it). ``False``: one token per
    #: call. At temperature 0 the text is the same either way (docs/speculation.md).
    speculate: bool = True
    #: constrained decoding: the text must match this (docs/structured-output.md)
    constraint: Constraint | None = None
    #: report each token's log-probability and this many alternatives (``None``: none)
    logprobs: int | None = None
    #: ``max_tokens`` is only an upper bound: when fewer fit after the prompt, generate
    #: until the context is full (Anthropic's semantics) instead of refusing the request
    clamp_max_tokens: bool = False
    #: fill in the middle: ``prompt`` (a text) is the start of the middle, the backend
    #: lays out the whole prompt from these parts and the model's FIM tokens
    infill: Infill | None = None
    #: code completion's line rules (``None``: none)
    lines: LineLimits | None = None
    #: seconds the request may take to its first token (queue and prompt: an editor's
    #: ``t_max_prompt_ms``); past it, it ends as at its deadline (``None``: no limit)
    first_token_timeout: float | None = None
    #: the images the prompt's markers name (``_core/_media.py``: ``image_marker(k)`` in
    #: the text stands for ``images[k]``): encoded image files (PNG, JPEG, …), or a
    #: :class:`RemoteImage` the server fetches before preparing (docs/vision.md), or an
    #: :class:`AudioClip` (docs/audio.md)
    images: tuple[Media, ...] = ()
    #: the model reasons before it answers (``None``: it does not, or not here — a
    #: constrained answer never does): its markers, for ending the reasoning on request
    reasoning: ReasoningMarkers | None = None
    #: the reasoning may be ended on request (llama-server's ``reasoning_control``;
    #: ``False``: the control is refused, "reasoning control not enabled")
    reasoning_control: bool = True
    #: LoRA adapters to run it with (docs/lora.md): each by name or by llama-server's
    #: ``id`` (its index in ``GET /lora-adapters``), with a scale (``None``: the
    #: adapter's own); none: the base model
    lora: tuple[tuple[str | int, float | None], ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    #: prompt tokens whose evaluation was reused from the prompt cache
    cached_tokens: int = 0
    #: of those, restored from the host-memory tier and from the disk tier (the rest
    #: were still in the KV cells)
    cached_host_tokens: int = 0
    cached_disk_tokens: int = 0
    #: seconds evaluating the prompt, and from the first token to the end (for
    #: llama-server's ``timings`` on the endpoints that report them; not part of a
    #: usage's value: two usages of the same tokens are equal)
    prefill_seconds: float = field(default=0.0, compare=False)
    decode_seconds: float = field(default=0.0, compare=False)

    def cache_split(self) -> dict[str, int] | None:
        """Where the cached tokens came from — ``{"cells", "host", "disk"}`` — when a
        tier below the cells gave some (the ``trioserve`` extension of a usage)."""
        if not self.cached_host_tokens and not self.cached_disk_tokens:
            return None
        return {
            "cells": self.cached_tokens - self.cached_host_tokens - self.cached_disk_tokens,
            "host": self.cached_host_tokens,
            "disk": self.cached_disk_tokens,
        }

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenLogprob:
    """One generated token with its log-probability and the most likely alternatives
    (``top``: (token bytes, log-probability), most likely first)."""

    token: int
    piece: bytes
    logprob: float
    top: tuple[tuple[bytes, float], ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class TextDelta:
    """New text. Never splits a UTF-8 character and never contains a stop sequence."""

    text: str
    #: with ``GenerationRequest.logprobs``: the tokens this text came from
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Finished:
    """The last event of every stream that ends without raising."""

    reason: EndCause
    usage: Usage
    #: For ``reason == "error"``: what went wrong, for the client.
    message: str | None = None
    #: For ``reason == "stop"``: the stop sequence that ended the text (``None``: the
    #: model's end token)
    stop_sequence: str | None = None
