"""The checks every backend shares, each refusing with the numbers or the field a user
can act on: what a backend cannot do (:func:`refuse_unsupported`), a prompt and its
``max_tokens`` against the context (:func:`fit_to_context`), token ids against the
vocabulary, embeddings' ``dimensions``; and, for a library caller, a keyword an
options dict does not know (:func:`check_options`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ._backend_data import PreparedPrompt
from ._exceptions import ContextLengthError, InvalidRequestError
from ._types import GenerationRequest

__all__ = ["check_dimensions", "check_options", "check_token_ids", "fit_to_context", "refuse_unsupported"]


def check_options(options: Mapping[str, object], kind: Any) -> None:
    """Refuse (``TypeError``, as Python does for a keyword a signature lacks) any key of
    ``options`` that the ``TypedDict`` ``kind`` does not name: the ``**options`` of an
    interface method take only its keywords, never a misspelled one silently."""
    unknown = options.keys() - kind.__optional_keys__ - kind.__required_keys__
    if unknown:
        raise TypeError(
            f"unexpected keyword argument(s) {', '.join(sorted(unknown))} ({kind.__name__} names "
            f"{', '.join(sorted(kind.__optional_keys__ | kind.__required_keys__))})"
        )


def refuse_unsupported(request: GenerationRequest, backend: str, *, infill: bool = False) -> None:
    """For backends that cannot constrain their text or report log-probabilities:
    refuse such requests (400 naming the field) rather than ignore the ask.
    ``infill``: the backend fills in the middle another way (the upstream relay
    forwards it, ``samplers`` included); ``samplers`` is still refused elsewhere."""
    if request.constraint is not None:
        raise InvalidRequestError(
            f"constrained decoding (response_format, json_schema, grammar, forced tool calls) "
            f"is not supported by the {backend} backend",
            param="response_format",
        )
    if request.logprobs is not None:
        raise InvalidRequestError(f"logprobs are not supported by the {backend} backend", param="logprobs")
    if request.lora:
        raise InvalidRequestError(f"LoRA adapters are not supported by the {backend} backend", param="lora")
    if request.images:
        raise InvalidRequestError(
            f"images are not supported by the {backend} backend",
            param="messages",
            code="images_not_supported",
        )
    if request.infill is not None and not infill:
        raise InvalidRequestError(
            f"fill in the middle (/infill, suffix) is not supported by the {backend} backend: it lays "
            "out the prompt with the model's own FIM tokens, which only a llama backend has",
            param="input_prefix",
            code="infill_not_supported",
        )
    if request.sampling.samplers is not None and not (infill and request.infill is not None):
        where = " outside /infill" if infill else ""
        raise InvalidRequestError(
            f"samplers (a sampler chain in a given order) is not supported{where} by the {backend} "
            "backend; send the request without it",
            param="samplers",
        )


def fit_to_context(request: GenerationRequest, tokens: Sequence[int], n_ctx: int) -> PreparedPrompt:
    """Check that the prompt and ``max_tokens`` fit a context of ``n_ctx`` tokens, and
    resolve ``max_tokens=None`` to the room left. Raises :class:`ContextLengthError`
    with the numbers a user needs to fix the request."""
    if not tokens:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    if len(tokens) >= n_ctx:
        raise ContextLengthError(
            f"the prompt has {len(tokens)} tokens but the context holds {n_ctx}; "
            f"shorten it to at most {n_ctx - 1} tokens",
            param="prompt",
        )
    room = n_ctx - len(tokens)
    max_new = room if request.max_tokens is None else request.max_tokens
    if max_new > room and request.clamp_max_tokens:
        max_new = room
    if max_new > room:
        raise ContextLengthError(
            f"max_tokens is {max_new} but only {room} tokens fit after the "
            f"{len(tokens)}-token prompt (context {n_ctx}); lower max_tokens or shorten the prompt",
            param="max_tokens",
        )
    return PreparedPrompt(request=request, tokens=tokens, max_new_tokens=max_new)


def check_token_ids(tokens: Sequence[int], n_vocab: int, param: str = "tokens") -> None:
    """Raise :class:`InvalidRequestError` naming the first id of ``tokens`` that is not
    in a vocabulary of ``n_vocab`` tokens (ids ``0`` to ``n_vocab - 1``)."""
    for i, token in enumerate(tokens):
        if not 0 <= token < n_vocab:
            raise InvalidRequestError(
                f"{param}[{i}] is {token}, which is not a token id of this model: "
                f"its ids are 0 to {n_vocab - 1}",
                param=f"{param}[{i}]",
            )


def check_dimensions(dimensions: int | None, n_embd: int) -> None:
    """Embeddings' ``dimensions``: refused by name unless it is the model's own size
    ``n_embd`` (a model cannot produce vectors of another length)."""
    if dimensions is not None and dimensions != n_embd:
        raise InvalidRequestError(
            f"dimensions is not supported: this model's embeddings have {n_embd} dimensions and it cannot "
            f"produce others (omit dimensions, or send it as {n_embd})",
            param="dimensions",
        )
