"""Overflow as a policy (docs/dialects.md, "Truncation"): a conversation whose prompt
does not fit the context is a 400 ``context_length_exceeded`` with the counts, or, with
``truncation: "auto"``, the same conversation with its oldest whole turns dropped — the
fewest that make it fit.

The cut is found by binary search over the turns that may be dropped: each measurement
renders the conversation once and counts its tokens once (a worker thread for a long
prompt, as every render and tokenization of a long prompt), so a conversation of ``t``
droppable turns costs at most ``2 + log2(t)`` renders however far it overflows.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable

from .._core._backend import Backend, PreparedPrompt
from .._core._exceptions import ContextLengthError
from .._core._types import GenerationRequest
from .._wire import Dropped, Truncation
from ._lifecycle import INLINE_PARSE_BYTES, off_the_loop_if

__all__ = ["prepare_fitting"]

logger = logging.getLogger("trioserve.truncation")


async def prepare_fitting(
    backend: Backend,
    prepare: Callable[[GenerationRequest], Awaitable[PreparedPrompt]],
    generation: GenerationRequest,
    truncation: Truncation | None,
    max_prompt_tokens: int | None,
    request_id: str = "-",
) -> tuple[PreparedPrompt, Dropped | None]:
    """``prepare(generation)`` (the backend's prepare and the server's limits); where it
    does not fit the context and ``truncation`` is ``auto``, the generation with the
    fewest oldest turns dropped that fits, prepared, and what was dropped (the
    dialect is told). Raises :class:`ContextLengthError`: the prompt does not fit and
    may not be cut, or cannot be cut enough (the message says what is left)."""
    try:
        return await prepare(generation), None
    except ContextLengthError as exc:
        if truncation is None:
            raise
        if truncation.mode != "auto":
            exc.message += '; or send truncation: "auto" to drop the oldest turns until it fits'
            raise
        budget = _prompt_budget(generation, backend.info.context_length, max_prompt_tokens)
        if budget < 1:
            raise  # (max_tokens alone fills the context: nothing to drop helps)
    fitted, dropped, tokens = await _fit(backend, generation, truncation, budget)
    prepared = await prepare(fitted)
    truncation.note(dropped)
    logger.info(
        "request %s: truncation auto dropped %d turn(s) (%d message(s)) to fit the context: the prompt "
        "has %d tokens (%d fit)",
        request_id,
        dropped.turns,
        dropped.messages,
        tokens,
        budget,
    )
    return prepared, dropped


def _prompt_budget(generation: GenerationRequest, n_ctx: int, max_prompt_tokens: int | None) -> int:
    """The most prompt tokens that fit: as ``fit_to_context`` counts (the prompt and a
    ``max_tokens`` that is not clamped; at least one token to generate), and the
    server's ``--max-prompt-tokens``."""
    asked = generation.max_tokens
    budget = n_ctx - (asked if asked is not None and not generation.clamp_max_tokens else 1)
    if max_prompt_tokens is not None:
        budget = min(budget, max_prompt_tokens)
    return budget


async def _fit(
    backend: Backend, generation: GenerationRequest, truncation: Truncation, budget: int
) -> tuple[GenerationRequest, Dropped, int]:
    """The fewest oldest turns to drop for the prompt to hold at most ``budget`` tokens:
    the generation, what it drops, its prompt's tokens."""
    large = isinstance(generation.prompt, str) and len(generation.prompt) > INLINE_PARSE_BYTES
    starts = await off_the_loop_if(large, truncation.starts)

    async def measure(turns: int) -> tuple[GenerationRequest, Dropped, int]:
        built, dropped = await off_the_loop_if(large, truncation.dropping, starts, turns)
        return built, dropped, await _count(backend, built)

    if not starts:
        raise await _cannot(backend, generation, truncation, budget, None)
    best = await measure(len(starts))
    if best[2] > budget:
        raise await _cannot(backend, best[0], truncation, budget, best)
    # dropping k turns fits for k = high, not for k = low - 1
    low, high = 1, len(starts)
    while low < high:
        middle = (low + high) // 2
        measured = await measure(middle)
        if measured[2] <= budget:
            high, best = middle, measured
        else:
            low = middle + 1
    return best


async def _count(backend: Backend, generation: GenerationRequest) -> int:
    """The prompt's tokens, as prepare lays it out (images: their tokens too, laid out
    by the model's projector; a prompt longer than the context counts as the context)."""
    if generation.images:
        asked = dataclasses.replace(generation, max_tokens=1, clamp_max_tokens=True, constraint=None)
        try:
            return len((await backend.prepare(asked)).tokens)
        except ContextLengthError:
            return backend.info.context_length
    assert isinstance(generation.prompt, str)  # (a conversation: rendered text)
    prompt = generation.prompt
    return await backend.count_text_tokens(prompt, add_special=generation.add_bos, parse_special=True)


async def _cannot(
    backend: Backend,
    generation: GenerationRequest,
    truncation: Truncation,
    budget: int,
    measured: tuple[GenerationRequest, Dropped, int] | None,
) -> ContextLengthError:
    """The 400 of a conversation that does not fit even with every turn that may be
    dropped dropped: the counts, and what was left (never dropped)."""
    last = await backend.count_text_tokens(truncation.last_turn_text())
    n_ctx = backend.info.context_length
    asked = generation.max_tokens
    limit = truncation.max_tokens_param
    room = f"{budget} fit" + (
        f" (the context holds {n_ctx}, and {limit} {asked} after the prompt)"
        if asked is not None and not generation.clamp_max_tokens
        else f" (the context holds {n_ctx})"
    )
    if measured is None:
        tokens = await _count(backend, generation)
        dropped = "there is no earlier turn to drop"
    else:
        tokens = measured[2]
        dropped = f"with all {measured[1].turns} earlier turn(s) dropped"
    return ContextLengthError(
        f"the prompt does not fit the context even with truncation auto: {dropped}, it has {tokens} tokens "
        f"and {room}. What is never dropped is left: the last user turn (about {last} tokens, with "
        f"what follows it), the system prompt and the tool definitions; shorten the last user turn"
        + (f" or lower {limit}" if asked is not None and not generation.clamp_max_tokens else ""),
        param=truncation.param,
    )
