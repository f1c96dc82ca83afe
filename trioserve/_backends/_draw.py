"""One token drawn from one output's logits, and its log-probabilities
(``docs/batching.md``). No scheduler state: the scheduler thread passes the context,
the output's batch index and the sequence's sampler, mask and options, and acts on
the result (a constraint that fails ends its sequence).

Two paths: :func:`draw` (plain: the argmax of the logits row for plain greedy, else
llama.cpp's sampler chain) and :func:`draw_special` (a constraint's mask applied to the
row in place first, and/or the log-probabilities computed from the same row)."""

from __future__ import annotations

from typing import Any

import numpy

from .._core._types import TokenLogprob
from ._grammar import TokenMask

__all__ = ["draw", "draw_special", "logits_row", "logprob_entry"]

_as_array = numpy.ctypeslib.as_array


def logits_row(lib: Any, ctx: Any, index: int, n_vocab: int) -> numpy.ndarray:
    """The logits of output ``index`` of the last ``llama_decode`` call: a view of
    llama.cpp's buffer (writing to it changes what the sampler chain reads)."""
    return _as_array(lib.llama_get_logits_ith(ctx, index), (n_vocab,))


def draw(lib: Any, ctx: Any, index: int, n_vocab: int, sampler: Any, greedy: bool) -> int:
    """The token of output ``index``, no mask and no log-probabilities. Plain greedy
    (temperature 0, no logit bias): the argmax of the logits — the token llama.cpp's
    greedy sampler picks (the first maximum), without building its 262,144-entry
    candidate array; otherwise ``sampler`` (the request's chain)."""
    if greedy:
        return int(_as_array(lib.llama_get_logits_ith(ctx, index), (n_vocab,)).argmax())
    return int(lib.llama_sampler_sample(sampler, ctx, index))


def draw_special(
    lib: Any,
    ctx: Any,
    index: int,
    n_vocab: int,
    sampler: Any,
    *,
    greedy: bool,
    mask: TokenMask | None,
    logprobs: int | None,
    bias: Any,
    piece: Any,
) -> tuple[int, TokenLogprob | None] | str:
    """Draw the token of output ``index`` with a constraint's ``mask`` and/or
    log-probabilities (``logprobs``: the alternatives to report): ``(token, entry)``, or
    the constraint's error when the mask cannot be applied (the sequence must end)."""
    logits = logits_row(lib, ctx, index, n_vocab)
    if mask is not None:
        error = mask.apply(logits)  # in place: the draw below sees it
        if error is not None:
            return error
    token = int(logits.argmax()) if greedy else lib.llama_sampler_sample(sampler, ctx, index)
    entry = None
    if logprobs is not None:
        entry = logprob_entry(logits, token, logprobs, bias, piece)
    return token, entry


def logprob_entry(logits: numpy.ndarray, token: int, top: int, bias: Any, piece: Any) -> TokenLogprob:
    """``token``'s log-probability, and the ``top`` most likely tokens', in the
    distribution the draw started from: the model's logits with the logit bias and the
    constraint's mask (before penalties, temperature and truncation)."""
    values = logits
    if bias:
        values = logits.copy()
        for biased, amount in bias.items():
            values[biased] = -numpy.inf if amount <= -100 else values[biased] + amount
    peak = values.max()
    log_total = peak + numpy.log(numpy.exp(values - peak).sum())
    alternatives: tuple[tuple[bytes, float], ...] = ()
    if top:
        best = numpy.argpartition(values, -top)[-top:]
        best = best[numpy.argsort(-values[best], kind="stable")]
        # a token the mask or a -100 bias forbids has no probability: not an alternative
        # (fewer than ``top`` may be left: OpenAI's logprob is a number, never -inf)
        best = best[numpy.isfinite(values[best])]
        alternatives = tuple((piece(int(i)), float(values[i] - log_total)) for i in best)
    return TokenLogprob(
        token=token, piece=piece(token), logprob=float(values[token] - log_total), top=alternatives
    )
