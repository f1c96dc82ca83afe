"""Measure, on this machine's kernels, which ``llama_decode`` calls are batch-invariant.

Both probes compare against the same sequence decoded *alone* from the same state, bit
for bit: :func:`probe_invariant_width` returns the widest decode call (in sequences)
that gives every sequence its lone logits, :func:`probe_shared_context_limit` the
longest context (cells) at which a sequence may share a call. Each is a measurement of
the inputs it tried, not a promise about others. The probes use the serving context and
leave its memory empty. Why llama.cpp's CPU path differs, how the probes are built, the
figures measured and what they do not cover: ``docs/batching.md``, "Batch invariance".
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import numpy

from ..._core._exceptions import BackendError

__all__ = ["ProbeCalls", "probe_invariant_width", "probe_shared_context_limit", "probe_verify_width"]

logger = logging.getLogger("trioserve.llama")

#: decode steps tried from each sequence state
_STEPS = 3
#: prompt lengths (tokens before the decoded ones) of the short sequences, spread between
_SHORTEST = 5
_LONGEST_SHORT = 60
#: contexts tried by probe_shared_context_limit: every multiple of this
_CONTEXT_STEP = 32


def probe_invariant_width(calls: ProbeCalls, prompts: list[list[int]], widest: int) -> int:
    """The widest decode call (in sequences, at most ``widest``) whose logits equal, bit
    for bit, each sequence's logits decoded alone (``docs/batching.md``, "How the probes
    are built").

    Args:
        calls: the context probed (:class:`ProbeCalls`), with room for ``widest``
            sequences (``n_seq_max``, a non-unified KV cache).
        prompts: token lists that the probe sequences are built from. Give several
            different ones, such as tokenized texts. Sequence ``i`` starts with
            ``prompts[i % len(prompts)]`` and continues with all the prompts' tokens,
            starting at an offset of its own, up to the length it needs.
        widest: the widest call to try: ``min(n_seq_max, n_batch)``.

    Raises:
        BackendError: a ``llama_decode`` call failed, or llama.cpp refused to remove
            KV cells or return logits.
    """
    if widest < 1:
        raise ValueError(f"widest must be at least 1, got {widest}")
    if not any(prompts):
        raise ValueError("probe_invariant_width needs at least one non-empty prompt")
    if widest == 1:
        return 1
    n_ctx_seq = calls.context_per_sequence()
    if n_ctx_seq <= _STEPS:
        raise ValueError(f"a context of {n_ctx_seq} tokens per sequence is too small to probe")
    n_batch = int(calls.lib.llama_n_batch(calls.ctx))
    sequences = _probe_sequences(prompts, widest, n_ctx_seq)
    #: first decoded position of each sequence (its prompt is the tokens before it)
    starts = [len(tokens) - _STEPS for tokens in sequences]
    decode, logits = calls.decode, calls.logits

    def rewind(seq_id: int) -> None:
        """Remove the cells the decode steps wrote: back to the prefilled state."""
        calls.rewind(seq_id, starts[seq_id])

    calls.clear()
    try:
        for seq_id, tokens in enumerate(sequences):
            for first in range(0, starts[seq_id], n_batch):
                last = min(starts[seq_id], first + n_batch)
                decode([(seq_id, tokens[p], p, False) for p in range(first, last)])
        # the lone references: one-sequence calls, as a request that runs alone gets
        reference: list[list[bytes]] = []
        for seq_id, tokens in enumerate(sequences):
            rows = []
            for pos in range(starts[seq_id], len(tokens)):
                decode([(seq_id, tokens[pos], pos, True)])
                rows.append(logits(0))
            reference.append(rows)
            rewind(seq_id)
        width = 1
        for w in range(2, widest + 1):
            differing: set[int] = set()
            for group in _windows(widest, w):
                for step in range(_STEPS):
                    decode([(s, sequences[s][starts[s] + step], starts[s] + step, True) for s in group])
                    differing.update(s for i, s in enumerate(group) if logits(i) != reference[s][step])
                for seq_id in group:
                    rewind(seq_id)
                if differing:
                    break
            if differing:
                logger.info(
                    "batch invariance probe: calls of %d sequences differ from lone calls for "
                    "sequences with %s tokens of context",
                    w,
                    ", ".join(str(len(sequences[s])) for s in sorted(differing)),
                )
                break
            width = w
        return width
    finally:
        calls.clear()


class ProbeCalls:
    """The serving context a probe runs on, and the probes' llama.cpp calls on it:
    decode a list of (seq id, token, position, wants logits) entries in one call, read
    a logits row, remove a sequence's cells from a position on, clear the memory. Every
    failure is a :class:`BackendError`.

    ``lib``: the ``llama_cpp`` module; ``ctx``: the ``llama_context`` that will serve
    (its memory must hold no sequence the caller still needs: a probe clears it
    before and after); ``memory``: ``llama_get_memory(ctx)``; ``batch``: a
    ``llama_batch`` of ``llama_n_batch(ctx)`` entries with ``n_seq_id[i] == 1`` (its
    tokens, positions, sequence ids and logit flags are overwritten); ``n_vocab``: the
    vocabulary size (the length of a logits row)."""

    def __init__(self, lib: Any, ctx: Any, memory: Any, batch: Any, n_vocab: int) -> None:
        self.lib, self.ctx, self.memory, self.batch = lib, ctx, memory, batch
        self.row_size = 4 * n_vocab

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        batch = self.batch
        for i, (seq_id, token, pos, want) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.seq_id[i][0] = seq_id
            batch.logits[i] = want
        batch.n_tokens = len(entries)
        result = self.lib.llama_decode(self.ctx, batch)
        if result != 0:
            raise BackendError(f"llama_decode failed with code {result} in a load-time probe")

    def logits(self, index: int) -> bytes:
        pointer = self.lib.llama_get_logits_ith(self.ctx, index)
        if not pointer:
            raise BackendError(f"llama.cpp returned no logits for batch index {index} while probing")
        return ctypes.string_at(pointer, self.row_size)

    def rewind(self, seq_id: int, start: int) -> None:
        if not self.lib.llama_memory_seq_rm(self.memory, seq_id, start, -1):
            raise BackendError(f"llama.cpp could not remove the probe's cells of sequence {seq_id}")

    def clear(self) -> None:
        """Empty the memory (every sequence's cells)."""
        self.lib.llama_memory_clear(self.memory, True)

    def context_per_sequence(self) -> int:
        """KV cells each sequence owns (non-unified cache: ``n_ctx / n_seq_max``)."""
        lib, ctx = self.lib, self.ctx
        n_ctx_seq = getattr(lib, "llama_n_ctx_seq", None)
        if n_ctx_seq is not None:
            return int(n_ctx_seq(ctx))
        return int(lib.llama_n_ctx(ctx)) // max(1, int(lib.llama_n_seq_max(ctx)))  # pragma: no cover


def _probe_sequences(prompts: list[list[int]], count: int, n_ctx_seq: int) -> list[list[int]]:
    """``count`` different token lists of different lengths (prompts of
    ``_SHORTEST``..``_LONGEST_SHORT`` tokens, not in id order), each ending in the
    ``_STEPS`` tokens that are decoded."""
    pool = [token for prompt in prompts for token in prompt]
    span = max(1, count - 1)
    short = [_SHORTEST + (_LONGEST_SHORT - _SHORTEST) * i // span for i in range(count)]
    short = short[0::2] + short[1::2][::-1]  # lengths rise, then fall, along the ids
    lengths = [min(n, n_ctx_seq - _STEPS) + _STEPS for n in short]
    sequences = []
    for i, length in enumerate(lengths):
        offset = (i * 7) % len(pool)
        tail = pool[offset:] + pool[:offset]
        tokens = list(prompts[i % len(prompts)]) or tail[:1]
        while len(tokens) < length:
            tokens += tail
        sequences.append(tokens[:length])
    return sequences


def _windows(count: int, width: int) -> list[range]:
    """Consecutive id ranges of ``width`` sequences that together cover ``0..count-1``
    (the last one ends at ``count - 1``, overlapping its predecessor if it must)."""
    windows = [range(start, start + width) for start in range(0, count - width + 1, width)]
    if windows[-1].stop < count:
        windows.append(range(count - width, count))
    return windows


def probe_shared_context_limit(calls: ProbeCalls, prompts: list[list[int]]) -> int:
    """The longest context (cells, the decoded token's included; a multiple of
    ``_CONTEXT_STEP``, 0 if even the first differs) at which a sequence decoded in one
    call beside another short sequence gets, bit for bit, the logits it gets alone —
    and so does the short one. Same arguments and errors as
    :func:`probe_invariant_width`; needs room for two sequences."""
    n_ctx_seq = calls.context_per_sequence()
    n_batch = int(calls.lib.llama_n_batch(calls.ctx))
    pool = [token for prompt in prompts for token in prompt]
    if len(pool) < 2:
        raise ValueError("probe_shared_context_limit needs prompts with at least two tokens")
    long_tokens = (pool * (n_ctx_seq // len(pool) + 2))[:n_ctx_seq]
    short_tokens = (pool[::-1] * (_SHORTEST // len(pool) + 2))[: _SHORTEST + _STEPS]
    decode, logits, rewind = calls.decode, calls.logits, calls.rewind

    calls.clear()
    try:
        decode([(1, t, p, False) for p, t in enumerate(short_tokens[:_SHORTEST])])
        prefilled = 0
        limit = 0
        for length in range(_CONTEXT_STEP, n_ctx_seq - _STEPS + 1, _CONTEXT_STEP):
            start = length - 1 - (_STEPS - 1)  # the decoded tokens end at context `length`
            while prefilled < start:
                last = min(start, prefilled + n_batch)
                decode([(0, long_tokens[p], p, False) for p in range(prefilled, last)])
                prefilled = last
            alone: list[tuple[bytes, bytes]] = []
            for step in range(_STEPS):
                pos, short_pos = start + step, _SHORTEST + step
                decode([(0, long_tokens[pos], pos, True)])
                row = logits(0)
                decode([(1, short_tokens[short_pos], short_pos, True)])
                alone.append((row, logits(0)))
            rewind(0, start)
            rewind(1, _SHORTEST)
            same = True
            for step in range(_STEPS):
                pos, short_pos = start + step, _SHORTEST + step
                decode([(0, long_tokens[pos], pos, True), (1, short_tokens[short_pos], short_pos, True)])
                same = same and (logits(0), logits(1)) == alone[step]
            rewind(0, start)
            rewind(1, _SHORTEST)
            if not same:
                logger.info(
                    "batch invariance probe: a decode beside another sequence differs from a lone "
                    "one at a context of %d cells",
                    length,
                )
                break
            limit = length
        return limit
    finally:
        calls.clear()


def probe_verify_width(calls: ProbeCalls, prompts: list[list[int]], widest: int) -> int:
    """The widest speculative verify call (rows of one sequence: the token being decoded
    and the drafts after it) whose every row's logits equal, bit for bit, the logits of
    the same token decoded in a one-row call from the same state (``docs/speculation.md``).
    1: no verify call is exact, do not speculate.

    For each prompt (sequence 0; short contexts only — past 256 cells a lone decode takes
    flash attention's split-KV path, which no call of two rows or more takes), the
    reference decodes ``widest`` tokens one per call (greedy), keeping each row; then for
    each width 2…``widest`` one call decodes the first ``width`` of those tokens at their
    positions, and one differing row ends the search. Arguments as for
    :func:`probe_invariant_width`; the memory is left empty."""
    rows_of, rewind = calls.logits, calls.rewind

    def decode(entries: list[tuple[int, int]]) -> None:
        """One call of sequence 0's (token, position) rows, each with its logits."""
        calls.decode([(0, token, pos, True) for token, pos in entries])

    exact = widest
    try:
        for prompt in prompts:
            rewind(0, 0)
            decode([(t, i) for i, t in enumerate(prompt)])
            start = len(prompt)
            token = prompt[-1]
            # the reference: one row per call
            tokens: list[int] = []
            reference: list[bytes] = []
            for i in range(exact):
                tokens.append(token)
                decode([(token, start + i)])
                row = rows_of(0)
                reference.append(row)
                token = int(numpy.frombuffer(row, dtype=numpy.float32).argmax())
            for width in range(2, exact + 1):
                rewind(0, start)
                decode([(tokens[j], start + j) for j in range(width)])
                if any(rows_of(j) != reference[j] for j in range(width)):
                    exact = width - 1
                    break
            if exact < 2:
                return 1
    finally:
        rewind(0, 0)
    return exact
