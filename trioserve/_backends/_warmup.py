"""Checks run on the serving context at load, before the scheduler thread starts: one
warm-up decode (a llama.cpp build that cannot run here fails at startup, not at a
user's first request), and the batch-invariance probes (:mod:`._invariance`) that size
the scheduler's decode calls in batch-invariant mode (``docs/batching.md``)."""

from __future__ import annotations

import logging
import time

import numpy

from .._core._exceptions import BackendError
from ._invariance import probe_invariant_width, probe_shared_context_limit, probe_verify_width
from ._llama import LlamaModel, _Context

__all__ = ["probe_invariance", "probe_speculation", "warm_up"]

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


def warm_up(model: LlamaModel, context: _Context) -> None:
    """One decode at load, as llama-server does: a llama.cpp that cannot run on this CPU
    (a bad build, kernels the CPU lacks) fails here, at startup, with a message, instead
    of at a user's first request. (A native crash cannot be caught: ``trioserve serve``
    turns on ``faulthandler``, and the log line before says what was running.)"""
    lib = model.lib
    batch = context.batch
    token = model._bos if model._bos >= 0 else 0
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


def probe_invariance(model: LlamaModel, context: _Context) -> tuple[int, int]:
    """(widest invariant decode call, longest context that may share a call), measured
    on this machine's kernels at load (``_invariance.py``)."""
    settings = model.settings
    prompts = [model.tokenize(text) for text in _PROBE_TEXTS]
    args = (model.lib, context.ctx, context.memory, context.batch, prompts, model.n_vocab)
    width = probe_invariant_width(*args, min(settings.slots, settings.n_batch))
    limit = probe_shared_context_limit(*args) if settings.slots > 1 and width > 1 else 0
    return width, limit


def probe_speculation(model: LlamaModel, context: _Context, widest: int) -> int:
    """The widest exact speculative verify call (rows), at most ``widest``, measured on
    this machine's kernels at load (``_invariance.probe_verify_width``); 1: none."""
    prompts = [model.tokenize(text) for text in _PROBE_TEXTS[:3]]
    args = (model.lib, context.ctx, context.memory, context.batch, prompts, model.n_vocab)
    return probe_verify_width(*args, min(widest, model.settings.n_batch))
