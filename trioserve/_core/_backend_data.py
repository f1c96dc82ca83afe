"""What crosses the backend seam as data: a model's :class:`ModelInfo`, a
:class:`PreparedPrompt` (and the :class:`ChoiceGroup` of an ``n`` > 1 request's
choices), what an embeddings request and a rerank may ask (:class:`EmbeddingOptions`,
:class:`RerankOptions`), a rerank's :class:`Ranking`, and what an ask to end a
generation's reasoning came to (:data:`ControlOutcome`). The interface itself:
:mod:`._backend`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypedDict

from ._types import GenerationRequest

__all__ = [
    "ChoiceGroup",
    "ControlOutcome",
    "EmbeddingOptions",
    "ModelInfo",
    "PreparedPrompt",
    "Ranking",
    "RerankOptions",
]


#: What an ask to end a running generation's reasoning came to
#: (``EventStream.end_reasoning``): ``forced`` — the end marker is written at its next
#: token (or was being written already); ``not_enabled`` — the request said
#: ``reasoning_control: false``; ``not_reasoning`` — the model does not reason here (no
#: markers, reasoning turned off, a constrained answer); ``already_ended`` — its
#: reasoning ended (the model wrote the marker, or an earlier ask did); ``finished`` —
#: its generation is over; ``unsupported`` — its backend cannot (the upstream relay).
ControlOutcome = Literal["forced", "not_enabled", "not_reasoning", "already_ended", "finished", "unsupported"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelInfo:
    id: str
    context_length: int
    #: A Jinja chat template from the model's metadata, if it has one.
    chat_template: str | None = None
    #: The model architecture (``general.architecture``), for the chat fallback.
    architecture: str | None = None
    bos_token: str = ""
    eos_token: str = ""
    #: the model can fill in the middle (its vocabulary names FIM tokens: ``/infill``);
    #: ``None``: not known (the upstream relay, until an upstream has answered one)
    infill: bool | None = False
    #: what reranking it does: ``"cross-encoder"``, ``"yes-no"``, ``"upstream"`` (the
    #: relay, once an upstream has reranked) or ``None`` (docs/rerank.md)
    rerank: str | None = None
    #: it generates text (an encoder embeds and ranks only)
    generates: bool = True
    #: it takes images (a vision projector is loaded with it: docs/vision.md)
    vision: bool = False
    #: it takes audio (an audio projector is loaded with it: docs/audio.md)
    audio: bool = False
    #: its LoRA adapters, ``(name, default scale, file)`` in their ``id`` order
    #: (docs/lora.md)
    adapters: tuple[tuple[str, float, str], ...] = ()
    #: its activated LoRAs' invocations, ``(name, tokens, text)`` (docs/lora.md)
    alora: tuple[tuple[str, tuple[int, ...], str], ...] = ()


class EmbeddingOptions(TypedDict, total=False):
    """What an embeddings request may ask besides its inputs (``Backend.embed_inputs``'s
    keywords); each one absent or ``None``: not asked."""

    #: the length of a vector the client asked for (``None``: the model's)
    dimensions: int | None
    #: the most tokens the inputs may hold together (``--max-embedding-tokens``)
    max_tokens: int | None


class RerankOptions(TypedDict, total=False):
    """What a rerank may ask besides its query and documents (``Backend.rerank``'s
    keywords, docs/rerank.md); each one absent or ``None``: not asked."""

    #: the task a yes-no reranker's template states (its ``{instruction}``)
    instruction: str | None
    #: each document cut to this many tokens
    max_tokens_per_doc: int | None
    #: the most tokens the query and documents may hold together
    #: (``--max-embedding-tokens``)
    max_tokens: int | None


@dataclass(frozen=True, kw_only=True, slots=True)
class Ranking:
    """A rerank's answer (``Backend.rerank``): a score per document, in the order given."""

    scores: list[float]
    #: tokens evaluated for it (the shared prefix counted once)
    prompt_tokens: int
    #: ``"cross-encoder"``, ``"yes-no"``, or ``"upstream"`` (the relay: an upstream's,
    #: which it does not name)
    kind: str
    #: what a score is: ``"logit"``, ``"probability"``, or ``"unknown"`` (the relay: the
    #: upstream's own, unnamed)
    score: str
    #: of ``prompt_tokens``, the shared prefix's (a ``yes-no`` reranker; 0: it was kept
    #: from the previous request)
    prefix_tokens: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class PreparedPrompt:
    """A request after tokenization and validation: ready to run, nothing left to refuse."""

    request: GenerationRequest
    tokens: Sequence[int]
    #: ``max_tokens`` resolved against the context: how many tokens may be generated.
    max_new_tokens: int
    #: the backend's compiled ``request.constraint`` (its own type), if any
    compiled: object | None = None
    #: the backend's own form of ``request.sampling.logit_bias`` (arrays, say), made once
    #: per request at prepare, so no per-token or per-choice work walks the mapping
    logit_bias: object | None = None
    #: ``n`` > 1: this prompt is choice ``choice`` of ``group``, whose choices may share
    #: one evaluation of the prompt (a backend that cannot share runs them apart)
    group: ChoiceGroup | None = None
    choice: int = 0
    #: the backend's own form of the prompt's images (where they sit, what encodes
    #: them: docs/vision.md), if it has any
    media: object | None = None
    #: ``request.reasoning``'s markers as the backend's tokens (``(start, end)``),
    #: tokenized at prepare where the reasoning may be ended on request
    reasoning_tokens: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    #: ``request.lora`` resolved: the adapter set, ``((name, scale), …)`` sorted by
    #: name, no zero scale (docs/lora.md); empty: the base model
    adapters: tuple[tuple[str, float], ...] = ()
    #: an activated LoRA of ``adapters`` and the prompt position it applies from: the
    #: positions before it run without it (docs/lora.md, "Activated LoRA")
    alora: tuple[str, int] | None = None


class ChoiceGroup:
    """The ``n`` choices of one request: a token their prompts share (``size``: how
    many are still to be served; a backend that shares the evaluation counts down the
    choices cancelled before they started)."""

    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size
