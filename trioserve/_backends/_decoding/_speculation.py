"""Prompt-lookup drafting: guess a sequence's next tokens from its own context.

A :class:`Drafter` belongs to one decoding sequence. It indexes every n-gram
(``MIN_NGRAM`` … ``MAX_NGRAM`` tokens) of the sequence's context — the prompt, then each
token as it is accepted — by where its most recent earlier occurrence ended, and
proposes the tokens that followed that occurrence of the longest n-gram that ends the
context now (a suffix match). Nothing matches: no proposal, and the step is an ordinary
one-token step.

How far it guesses is adaptive, per sequence: a proposal that was accepted whole means a
copy is running, and the next one asks for as much as the verify call holds; a rejection
brings the length back to what was accepted plus one (never below the start length),
and after a run of proposals that were all rejected the drafter asks for a longer match
before it proposes again — free text that merely echoes a word or two of its prompt
stops costing verify rows.

Pure Python, no llama.cpp: the scheduler verifies the proposal (``_scheduler.py``,
``docs/speculation.md``).
"""

from __future__ import annotations

__all__ = [
    "FAST_DRAFT",
    "MAX_DRAFT",
    "SHORTEST_DRAFT",
    "SPLIT_KV_CONTEXT",
    "START_DRAFT",
    "Drafter",
    "SpeculationStats",
]

#: the shortest and longest suffix matched
MIN_NGRAM = 2
MAX_NGRAM = 5
#: the most tokens proposed at once, exact mode (a verify call decodes ``1 + draft``
#: rows; the width actually used is measured at load: 7 rows is the widest whose rows a
#: one-row step computes alike on the CPU kernels measured, without repacked weights;
#: 3 with them — docs/speculation.md)
MAX_DRAFT = 6
#: the most tokens proposed at once, fast mode (llama-server's default ``--draft-max``)
FAST_DRAFT = 15
#: auto (exact) mode, more than one thread: the longest context (cells, the verify call's
#: last row included) a verify call may reach. Past it, a one-row decode's flash
#: attention covers 512 cells or more (llama.cpp pads the KV window to 256) and takes
#: the split-KV path, which divides the cells between the threads; a call of two rows
#: or more never takes it (docs/batching.md, "Batch invariance")
SPLIT_KV_CONTEXT = 256
#: draft length of a fresh sequence
START_DRAFT = 4
#: consecutive fully rejected proposals after which a longer match is required
PATIENCE = 3
#: the shortest draft worth proposing: on the CPU measured, a call of 2 rows costs what
#: two calls of one do (17.7 → 34.1 ms), 3 rows 39 ms, 4 rows 42 ms — a single guess
#: cannot pay for its row (docs/speculation.md, "What a row costs")
SHORTEST_DRAFT = 2


class SpeculationStats:
    """Counters of one scheduler (read by ``/health`` and ``/metrics``)."""

    __slots__ = ("accepted", "proposed", "verify_calls")

    def __init__(self) -> None:
        self.proposed = 0
        self.accepted = 0
        self.verify_calls = 0


class Drafter:
    """Prompt-lookup drafts for one sequence (used by the scheduler thread only)."""

    __slots__ = ("_index", "_longest", "_min_ngram", "_misses", "accepted", "context", "length", "proposed")

    def __init__(self, prompt: list[int], *, longest: int = MAX_DRAFT) -> None:
        #: the sequence's tokens so far: the prompt, then every accepted token
        self.context: list[int] = list(prompt)
        #: n-gram → the position right after its most recent occurrence that has a
        #: continuation (an occurrence that ends the context is indexed once the next
        #: token arrives)
        self._index: dict[tuple[int, ...], int] = {}
        #: the longest draft this sequence's verify calls hold
        self._longest = max(1, longest)
        self.length = min(START_DRAFT, self._longest)
        self._min_ngram = MIN_NGRAM
        self._misses = 0
        #: this sequence's totals
        self.proposed = 0
        self.accepted = 0
        context = self.context
        index = self._index
        for end in range(1, len(context)):
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                if end < n:
                    break
                index[tuple(context[end - n : end])] = end

    def extend(self, tokens: list[int]) -> None:
        """Append accepted ``tokens`` to the context and index the n-grams they close."""
        context = self.context
        index = self._index
        for token in tokens:
            end = len(context)  # the n-grams ending here now have a continuation: token
            for n in range(MIN_NGRAM, min(MAX_NGRAM, end) + 1):
                index[tuple(context[end - n : end])] = end
            context.append(token)

    def propose(self, current: int, limit: int) -> list[int]:
        """Up to ``min(limit, self.length)`` tokens that may follow ``current`` (the
        token about to be decoded, not yet in :attr:`context`); empty: no match."""
        limit = min(limit, self.length)
        if limit < SHORTEST_DRAFT:
            return []
        context = self.context
        index = self._index
        total = len(context) + 1
        for n in range(min(MAX_NGRAM, total), self._min_ngram - 1, -1):
            key = (*context[1 - n :], current)
            start = index.get(key)
            if start is None:
                continue
            # the tokens after that occurrence; where they reach the present, the
            # current token continues the copy
            draft = context[start : start + limit]
            if len(draft) < limit and start + len(draft) == len(context):
                draft.append(current)
            return draft if len(draft) >= SHORTEST_DRAFT else []
        return []

    def settle(self, proposed: int, accepted: int) -> None:
        """Adapt to a verified proposal of ``proposed`` tokens, ``accepted`` of them good."""
        self.proposed += proposed
        self.accepted += accepted
        if accepted == proposed:
            # a copy is running: guess as far as the call holds (a row past the fourth
            # costs about a third of a one-token step, fast mode: docs/speculation.md)
            self.length = self._longest
            self._misses = 0
            self._min_ngram = MIN_NGRAM
            return
        self.length = min(self._longest, max(START_DRAFT, accepted + 1))
        if accepted == 0:
            self._misses += 1
            if self._misses >= PATIENCE and self._min_ngram < MAX_NGRAM:
                self._min_ngram += 1
                self._misses = 0
        else:
            self._misses = 0
