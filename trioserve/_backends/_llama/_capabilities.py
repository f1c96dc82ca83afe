"""What the serving context can do, measured at load before the scheduler thread
starts (:class:`Capabilities`): one warm-up decode (a llama.cpp build that cannot run
here fails at startup, not at a user's first request), the widths at which a decode
call's numerics stay exact (:mod:`.._decoding._invariance`: batch-invariant mode's calls,
speculation's verify calls) and whether the model can remove part of a sequence."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy

from ..._core._exceptions import BackendError
from .._decoding import (
    FAST_DRAFT,
    MAX_DRAFT,
    SHORTEST_DRAFT,
    SPLIT_KV_CONTEXT,
    ProbeCalls,
    probe_invariant_width,
    probe_shared_context_limit,
    probe_verify_width,
)
from ._context import Context

if TYPE_CHECKING:
    from ._model import LlamaModel

__all__ = ["Capabilities", "measure", "probe_invariance", "probe_speculation", "warm_up"]

logger = logging.getLogger("trioserve.llama")

_as_array = numpy.ctypeslib.as_array

#: texts the batch-invariance probes build their sequences from
_PROBE_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Once upon a time, in a land far away, there lived a",
    "Water boils at 100 degrees Celsius at sea level; at altitude",
    "1, 2, 3, 5, 8, 13, 21, 34,",
    "Bonjour, je m'appelle",
    "The three laws of robotics are",
    "In 1969, the first",
)


def warm_up(model: LlamaModel, context: Context) -> None:
    """One decode at load, as llama-server does: a llama.cpp that cannot run on this CPU
    (a bad build, kernels the CPU lacks) fails here, at startup, with a message, instead
    of at a user's first request. (A native crash cannot be caught: ``trioserve serve``
    turns on ``faulthandler``, and the log line before says what was running.)"""
    lib = model.lib
    batch = context.batch
    token = model.bos if model.bos >= 0 else 0
    batch.token[0] = token
    batch.pos[0] = 0
    batch.seq_id[0][0] = 0
    batch.logits[0] = 1
    batch.n_tokens = 1
    logger.info("warm-up: one llama_decode call")
    started = time.perf_counter()
    result = lib.llama_decode(context.ctx, batch)
    try:
        if result != 0:
            raise BackendError(
                f"the warm-up decode failed (llama_decode returned {result}): this llama.cpp build "
                f"cannot run this model on this machine (system info: {model.system_info})"
            )
        row = _as_array(lib.llama_get_logits_ith(context.ctx, 0), (model.n_vocab,))
        if not numpy.isfinite(row).all():
            raise BackendError(
                "the warm-up decode gave non-finite logits: this llama.cpp build computes wrong "
                f"results on this machine (system info: {model.system_info})"
            )
    finally:
        if not lib.llama_memory_seq_rm(context.memory, 0, -1, -1):  # pragma: no cover
            raise BackendError("llama.cpp could not clear the warm-up's KV cells")
    logger.info("warm-up done in %.1f ms", (time.perf_counter() - started) * 1000)


def probe_invariance(model: LlamaModel, context: Context) -> tuple[int, int]:
    """(widest invariant decode call, longest context that may share a call), measured
    on this machine's kernels at load (``_invariance.py``)."""
    settings = model.settings
    prompts = [model.tokenize(text) for text in _PROBE_TEXTS]
    calls = _probe_calls(model, context)
    width = probe_invariant_width(calls, prompts, min(settings.slots, settings.n_batch))
    limit = probe_shared_context_limit(calls, prompts) if settings.slots > 1 and width > 1 else 0
    return width, limit


def probe_speculation(model: LlamaModel, context: Context, widest: int) -> int:
    """The widest exact speculative verify call (rows), at most ``widest``, measured on
    this machine's kernels at load (``_invariance.probe_verify_width``); 1: none."""
    prompts = [model.tokenize(text) for text in _PROBE_TEXTS[:3]]
    return probe_verify_width(_probe_calls(model, context), prompts, min(widest, model.settings.n_batch))


def _probe_calls(model: LlamaModel, context: Context) -> ProbeCalls:
    """The serving context, as the load-time probes call it."""
    return ProbeCalls(model.lib, context.ctx, context.memory, context.batch, model.n_vocab)


@dataclass(frozen=True, slots=True, kw_only=True)
class Capabilities:
    """What the scheduler may do on this machine, with this model."""

    #: recurrent and hybrid models (Mamba, RWKV, Granite-4-H, LFM2, Jamba…) refuse to
    #: remove part of a sequence's state (``llama_memory_seq_rm`` returns false): no
    #: partial reuse, no idle recompute, no shared prompt for n > 1, and a decode call
    #: is aborted only when every sequence in it is cancelled (docs/prompt-cache.md)
    partial_removal: bool
    #: widest decode call whose numerics equal a lone sequence's (batch-invariant mode)
    max_call_width: int
    #: batch-invariant mode: a sequence whose context (cells, the token being decoded
    #: included) is longer than this decodes in a call of its own
    shared_context_limit: int
    #: speculative decoding (docs/speculation.md): the mode, the widest verify call
    #: (rows: the token being decoded and its drafts; 1: no speculation), and the
    #: longest context (cells) a verify call may reach ("auto": past it, a lone one-row
    #: step takes flash attention's split-KV path, which no call of two rows takes)
    speculation: Literal["off", "auto", "exact", "fast"]
    verify_width: int
    verify_context_limit: int
    #: "exact": a decode call of one row (a lone stream's step with no guess) past this
    #: context carries a pad row (thrown away), so that it takes the attention path a
    #: verify call takes (``None``: never)
    pad_context: int | None = None


def measure(model: LlamaModel, context: Context) -> Capabilities:
    """Warm up and measure ``context`` (the serving one, still unused). Raises what a
    failed warm-up raises, and :class:`~._native.LoadAborted` if the load was aborted;
    the caller frees the context then."""
    settings = model.settings
    lib = model.lib
    partial_removal = not (
        lib.llama_model_is_recurrent(model.model) or lib.llama_model_is_hybrid(model.model)
    )
    if not partial_removal:
        logger.info(
            "a recurrent or hybrid model: the prompt cache, idle recompute and shared prompts "
            "for n > 1 are off (llama.cpp cannot remove part of its state)"
        )
    if settings.warm_up:
        model.check_abort()
        warm_up(model, context)
    speculation = settings.speculate if partial_removal else "off"
    verify_width = 1
    verify_context_limit = settings.n_ctx
    if speculation == "fast":
        verify_width = min(1 + FAST_DRAFT, settings.n_batch)
    pad_context = None
    if speculation in ("auto", "exact"):
        started = time.perf_counter()
        verify_width = probe_speculation(model, context, 1 + MAX_DRAFT)
        if verify_width < 1 + SHORTEST_DRAFT:
            verify_width = 1  # (a single guess per call cannot pay for its row)
        if settings.n_threads > 1:
            if speculation == "exact" and verify_width > 1 and settings.n_batch >= 2:
                # past it a lone one-row step would take the split-KV path: a pad row
                # keeps every step on the path verify rows take (docs/speculation.md)
                pad_context = min(settings.n_ctx, SPLIT_KV_CONTEXT)
            else:
                verify_context_limit = min(settings.n_ctx, SPLIT_KV_CONTEXT)
        logger.info(
            "speculative decoding (%s): verify calls of at most %d rows, while a context "
            "is at most %d tokens%s (measured in %.0f ms)",
            speculation,
            verify_width,
            verify_context_limit,
            f"; a one-row step past {pad_context} cells carries a pad row" if pad_context else "",
            (time.perf_counter() - started) * 1000,
        )
    max_call_width, shared_context_limit = settings.slots, settings.n_ctx
    if settings.batch_invariant:
        max_call_width, shared_context_limit = probe_invariance(model, context)
        logger.info(
            "batch-invariant mode: decode calls of at most %d sequences, shared while a "
            "context is at most %d tokens",
            max_call_width,
            shared_context_limit,
        )
    return Capabilities(
        partial_removal=partial_removal,
        max_call_width=max_call_width,
        shared_context_limit=shared_context_limit,
        speculation=speculation,
        verify_width=verify_width,
        verify_context_limit=verify_context_limit,
        pad_context=pad_context,
    )
