"""One token drawn from one output's logits, and its log-probabilities
(``docs/batching.md``). No scheduler state: the scheduler thread passes the context,
the output's batch index and the sequence's sampler, mask and options, and acts on
the result (a constraint that fails ends its sequence).

Two paths: :func:`draw` (plain: the argmax of the logits row for plain greedy, else
llama.cpp's sampler chain) and :func:`draw_special` (a constraint's mask applied to the
row in place first, and/or the log-probabilities computed from the same row).

A request's logit bias is :class:`LogitBias`: arrays made once per request (at
prepare), applied to a row with one numpy operation per token — a bias may name every
token of the vocabulary (262,144), and the scheduler thread decodes every sequence."""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from typing import Any

import numpy

from ..._core._types import TokenLogprob
from ._grammar import TokenMask

__all__ = ["LogitBias", "draw", "draw_special", "logits_row", "logprob_entry", "sample_row"]

_as_array = numpy.ctypeslib.as_array

#: llama.cpp's ``llama_logit_bias``: a token id and its bias
_ENTRY = numpy.dtype([("token", "<i4"), ("bias", "<f4")])
#: llama.cpp's ``llama_token_data``: a token id, its logit and probability
_TOKEN_DATA = numpy.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


class LogitBias:
    """A request's ``logit_bias`` as arrays: the ids whose logits are shifted and by how
    much (float32, as llama.cpp's sampler adds them), and the ids it bans (OpenAI: -100
    or less bans a token). Built once per request; :meth:`apply` costs one numpy
    operation per token however many entries it has."""

    __slots__ = ("amounts", "banned", "ids")

    def __init__(self, bias: Mapping[int, float]) -> None:
        count = len(bias)
        ids = numpy.fromiter(bias.keys(), dtype=numpy.int64, count=count)
        amounts = numpy.fromiter(bias.values(), dtype=numpy.float64, count=count)
        ban = amounts <= -100
        self.ids = ids[~ban]
        self.amounts = amounts[~ban].astype(numpy.float32)
        self.banned = ids[ban]

    def __len__(self) -> int:
        return len(self.ids) + len(self.banned)

    def bounds(self) -> tuple[int, int]:
        """The lowest and highest token id it names (``(0, 0)`` when empty)."""
        every = numpy.concatenate((self.ids, self.banned))
        return (int(every.min()), int(every.max())) if len(every) else (0, 0)

    def apply(self, logits: numpy.ndarray) -> numpy.ndarray:
        """A copy of ``logits`` with the bias added and the banned tokens at -inf (the
        row the draw started from: ``logit + bias`` in float32, as llama.cpp's sampler)."""
        values = logits.copy()
        values[self.ids] += self.amounts  # (ids are unique: a mapping's keys)
        values[self.banned] = -numpy.inf
        return values

    def entries(self, entry_type: Any) -> Any:
        """The bias as a ctypes array of ``entry_type`` (``llama_logit_bias``) for
        ``llama_sampler_init_logit_bias`` (which copies it), filled by numpy."""
        table = numpy.empty(len(self), dtype=_ENTRY)
        kept = len(self.ids)
        table["token"][:kept] = self.ids
        table["bias"][:kept] = self.amounts
        table["token"][kept:] = self.banned
        table["bias"][kept:] = -numpy.inf
        return (entry_type * len(table)).from_buffer_copy(table)


def logits_row(lib: Any, ctx: Any, index: int, n_vocab: int) -> numpy.ndarray:
    """The logits of output ``index`` of the last ``llama_decode`` call: a view of
    llama.cpp's buffer (writing to it changes what the sampler chain reads)."""
    return _as_array(lib.llama_get_logits_ith(ctx, index), (n_vocab,))


def sample_row(lib: Any, sampler: Any, logits: numpy.ndarray) -> int:
    """``sampler``'s draw from ``logits`` (a row kept from an earlier call: a full cache
    hit's, ``docs/prompt-cache.md``), then accepted: what ``llama_sampler_sample`` does
    with a row of the context's buffer — the candidates in token order with their
    logits, the chain applied, its choice accepted."""
    candidates = numpy.empty(len(logits), dtype=_TOKEN_DATA)
    candidates["id"] = numpy.arange(len(logits), dtype=numpy.int32)
    candidates["logit"] = logits
    candidates["p"] = 0.0
    data = candidates.ctypes.data_as(ctypes.POINTER(lib.llama_token_data))
    array = lib.llama_token_data_array(data, len(logits), -1, False)
    lib.llama_sampler_apply(sampler, ctypes.byref(array))
    if not 0 <= array.selected < array.size:  # pragma: no cover - a chain always selects
        raise RuntimeError("the sampler chain selected no token")
    token = int(array.data[array.selected].id)
    lib.llama_sampler_accept(sampler, token)
    return token


def draw(
    lib: Any, ctx: Any, index: int, n_vocab: int, sampler: Any, greedy: bool, row: numpy.ndarray | None = None
) -> int:
    """The token of output ``index`` (or of ``row``, logits kept from an earlier call),
    no mask and no log-probabilities. Plain greedy (temperature 0, no logit bias): the
    argmax of the logits — the token llama.cpp's greedy sampler picks (the first
    maximum), without building its 262,144-entry candidate array; otherwise
    ``sampler`` (the request's chain)."""
    if row is not None:
        return int(row.argmax()) if greedy else sample_row(lib, sampler, row)
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
    bias: LogitBias | None,
    piece: Any,
    row: numpy.ndarray | None = None,
) -> tuple[int, TokenLogprob | None] | str:
    """Draw the token of output ``index`` (or of ``row``, logits kept from an earlier
    call: a copy, which the mask changes) with a constraint's ``mask`` and/or
    log-probabilities (``logprobs``: the alternatives to report): ``(token, entry)``, or
    the constraint's error when the mask cannot be applied (the sequence must end)."""
    logits = logits_row(lib, ctx, index, n_vocab) if row is None else row
    if mask is not None:
        error = mask.apply(logits)  # in place: the draw below sees it
        if error is not None:
            return error
    if greedy:
        token = int(logits.argmax())
    elif row is not None:
        token = sample_row(lib, sampler, logits)
    else:
        token = lib.llama_sampler_sample(sampler, ctx, index)
    entry = None
    if logprobs is not None:
        entry = logprob_entry(logits, token, logprobs, bias, piece)
    return token, entry


def logprob_entry(
    logits: numpy.ndarray, token: int, top: int, bias: LogitBias | None, piece: Any
) -> TokenLogprob:
    """``token``'s log-probability, and the ``top`` most likely tokens', in the
    distribution the draw started from: the model's logits with the logit bias and the
    constraint's mask (before penalties, temperature and truncation)."""
    values = logits if bias is None or not len(bias) else bias.apply(logits)
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
