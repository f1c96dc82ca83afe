"""The per-token draw's logit bias (issue 33): arrays made once per request, applied to
a logits row with one numpy operation — the same distribution, to the bit, as the
per-entry loop it replaced."""

from __future__ import annotations

import ctypes
import math
import time

import numpy
import pytest

from trioserve._backends._decoding import LogitBias, logprob_entry
from trioserve._core._types import TokenLogprob

VOCAB = 262_144


def _piece(token: int) -> bytes:
    return f"<{token}>".encode()


def _loop_entry(logits: numpy.ndarray, token: int, top: int, bias: dict[int, float]) -> TokenLogprob:
    """The implementation before issue 33: a Python loop over the bias, per token."""
    values = logits.copy()
    for biased, amount in bias.items():
        values[biased] = -numpy.inf if amount <= -100 else values[biased] + amount
    peak = values.max()
    log_total = peak + numpy.log(numpy.exp(values - peak).sum())
    best = numpy.argpartition(values, -top)[-top:]
    best = best[numpy.argsort(-values[best], kind="stable")]
    best = best[numpy.isfinite(values[best])]
    alternatives = tuple((_piece(int(i)), float(values[i] - log_total)) for i in best)
    return TokenLogprob(
        token=token, piece=_piece(token), logprob=float(values[token] - log_total), top=alternatives
    )


def _row(seed: int) -> numpy.ndarray:
    return numpy.random.default_rng(seed).normal(0, 4, VOCAB).astype(numpy.float32)


@pytest.mark.parametrize(
    "bias",
    [
        {7: 3.5, 42: -100, 1000: 100, 5: -2.25, 262_143: 0.1},
        {i: (i % 201) - 100.0 for i in range(0, VOCAB, 3)},  # a third of the vocabulary
        {i: -100.0 for i in range(VOCAB) if i != 11},  # everything banned but one token
    ],
    ids=["few", "a-third", "all-but-one-banned"],
)
def test_the_vectorised_bias_gives_the_same_logprobs_as_the_loop(bias: dict[int, float]) -> None:
    logits = _row(len(bias))
    arrays = LogitBias(bias)
    for token in (7, 11, 1000):
        assert logprob_entry(logits, token, 5, arrays, _piece) == _loop_entry(logits, token, 5, bias)
    assert numpy.array_equal(arrays.apply(logits), _loop_values(logits, bias))
    assert logits.dtype == numpy.float32
    assert arrays.apply(logits).dtype == numpy.float32


def _loop_values(logits: numpy.ndarray, bias: dict[int, float]) -> numpy.ndarray:
    values = logits.copy()
    for biased, amount in bias.items():
        values[biased] = -numpy.inf if amount <= -100 else values[biased] + amount
    return values


def test_the_logits_row_itself_is_left_alone() -> None:
    logits = _row(1)
    before = logits.copy()
    LogitBias({3: 5.0, 4: -100}).apply(logits)
    assert numpy.array_equal(logits, before)


class _Entry(ctypes.Structure):
    """llama.cpp's ``llama_logit_bias``."""

    _fields_ = [("token", ctypes.c_int32), ("bias", ctypes.c_float)]


def test_the_sampler_chain_gets_the_same_entries_as_before() -> None:
    bias = {7: 3.5, 42: -100, 1000: 100, 5: -2.25, 9: -150}
    entries = LogitBias(bias).entries(_Entry)
    got = {entries[i].token: entries[i].bias for i in range(len(entries))}
    expected = {}
    for token, amount in bias.items():  # the loop it replaced, into a ctypes array
        entry = _Entry()
        entry.token, entry.bias = token, -math.inf if amount <= -100 else amount
        expected[entry.token] = entry.bias
    assert got == expected
    assert len(entries) == len(bias) == len(LogitBias(bias))


def test_a_whole_vocabulary_bias_costs_one_array_operation_per_token() -> None:
    # measured, not asserted against a clock (2 shared cores): the ratio to the loop is
    # printed; the guarantee is the shape — apply() has no Python loop over the entries
    bias = {i: 0.5 for i in range(200_000)}
    logits = _row(2)
    arrays = LogitBias(bias)
    started = time.perf_counter()
    for _ in range(10):
        logprob_entry(logits, 1, 2, arrays, _piece)
    vectorised = (time.perf_counter() - started) / 10
    started = time.perf_counter()
    _loop_entry(logits, 1, 2, bias)
    loop = time.perf_counter() - started
    print(f"200k-entry bias, one token's logprobs: {vectorised * 1e3:.2f} ms (loop: {loop * 1e3:.1f} ms)")
    assert LogitBias({}).bounds() == (0, 0)
    assert LogitBias({3: 1.0, 9: -100}).bounds() == (3, 9)
