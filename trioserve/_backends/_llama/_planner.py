"""What one step of the scheduler does, decided from data: which sequences decode (in
which calls), which one evaluates a piece of its prompt, which lone stream drafts.

Pure: the loop describes each running sequence as a :class:`Candidate` and gets a
:class:`StepPlan` back (vLLM v1's ``Scheduler.schedule()`` → ``SchedulerOutput``); the
executor carries it out. No llama.cpp, numpy or Trio here (an import-linter contract),
so it is unit-tested without a model (``tests/unit/backends/test_planner.py``).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

__all__ = ["Candidate", "Limits", "StepPlan", "next_cut", "plan_step", "split"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """A running sequence as the planner sees it (``key``: the loop's handle on it)."""

    key: int
    seq_id: int
    #: its cells: the position of the token it decodes next
    pos: int
    #: its whole prompt is evaluated
    decoding: bool
    #: a later choice of ``n`` > 1 waiting for its leader's prompt
    waiting: bool
    #: pieces its channel has room for (0: paused, its client is not reading)
    room: int
    #: prompt tokens evaluated so far, the prompt's length and its canonical cuts
    prefilled: int = 0
    prompt_length: int = 0
    cuts: tuple[int, ...] | list[int] = ()
    #: its request's priority (lower first: docs/scheduling.md)
    priority: int = 0
    #: its LoRA adapter set, as a number (0: the base model): sequences of different
    #: sets never share a call (docs/lora.md)
    adapters: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """What the measurements at load allow (``Capabilities``)."""

    #: the widest decode call (sequences)
    max_call_width: int
    #: batch-invariant mode: a sequence with a longer context decodes alone (else: None)
    shared_context_limit: int | None
    #: speculative decoding is on (a verify call may hold more than one row)
    speculate: bool


@dataclass(frozen=True, slots=True)
class StepPlan:
    """The calls of one step, in order: each a list of ``(key, count)`` — ``count`` 0
    decodes one token, more evaluates that many prompt tokens; and the key of the lone
    stream that may draft (its guesses ride in its decode call), if any."""

    calls: list[list[tuple[int, int]]]
    draft: int | None = None


def next_cut(cuts: tuple[int, ...] | list[int], after: int, default: int) -> int:
    """The first of ``cuts`` (ascending) past ``after``, at most ``default`` when
    ``default`` is given (the prompt's end: its last call ends there, cut or not)."""
    i = bisect.bisect_right(cuts, after)
    if i < len(cuts) and (not default or cuts[i] <= default):
        return cuts[i]
    return default


def split[T](decoders: list[T], width: int) -> list[list[T]]:
    """``decoders`` in as few calls of at most ``width`` as possible, of near-equal
    sizes: 8 sequences with width 7 decode as 4 + 4 (measured: 62 ms per step) rather
    than 7 + 1 (67 ms)."""
    if not decoders:
        return []
    calls = -(-len(decoders) // width)
    size, extra = divmod(len(decoders), calls)
    groups = []
    start = 0
    for i in range(calls):
        end = start + size + (i < extra)
        groups.append(decoders[start:end])
        start = end
    return groups


def plan_step(candidates: list[Candidate], limits: Limits) -> StepPlan:
    """The calls of this step for the running (not cancelled) sequences, in the loop's
    order."""
    decoders: list[Candidate] = []
    prefillers: list[Candidate] = []
    for c in candidates:
        if not c.decoding:
            if not c.waiting:  # (a follower waits for its leader's prompt)
                prefillers.append(c)
        elif c.room > 0:
            decoders.append(c)
        # else paused: its client is not reading; the consumer wakes the loop when it
        # takes pieces from the full channel (on_room)
    # Decode calls list their sequences in seq-id order: llama.cpp splits a
    # multi-sequence batch into equal-length ubatches, and out-of-order ids cost a
    # second graph run (measured: 89 ms instead of 43 ms per step for 8 sequences).
    # A prompt chunk gets a call of its own: mixing it into the decode call buys
    # nothing here (the split separates them anyway), and alone its numerics never
    # depend on the load.
    decoders.sort(key=_seq_id)
    urgent = False
    if prefillers:
        # the best priority's prompt first (stable: arrival order within a priority);
        # while a prompt of a better priority than some running streams is evaluated,
        # those streams wait (their cells kept): its first token comes as on an idle
        # server, not after every lower-priority stream's decode call
        prefillers.sort(key=_priority)
        best = prefillers[0].priority
        if any(c.priority > best for c in decoders):
            urgent = True
            decoders = [c for c in decoders if c.priority <= best]
    alone: list[Candidate] = []
    limit = limits.shared_context_limit
    if limit is not None:
        # past the limit, a decode beside others differs from a lone one (flash
        # attention's split-KV path is taken only alone): decode it alone
        # and a LoRA adapter's sequence decodes alone too: the widths were measured
        # on the base weights; the adapters' own matmuls take other kernels by width
        alone = [c for c in decoders if c.pos + 1 > limit or c.adapters]
        if alone:
            decoders = [c for c in decoders if c.pos + 1 <= limit and not c.adapters]
    draft = None
    if limits.speculate and len(decoders) + len(alone) == 1:
        # a stream that decodes alone: guess its next tokens, verified in its call
        draft = decoders[0].key if decoders else alone[0].key
    # one call (or more, by the width) per adapter set: llama.cpp applies one set to a
    # whole call; the base model's first, then the sets in the order they are numbered
    calls = [
        [(c.key, 0) for c in group]
        for adapters in sorted({c.adapters for c in decoders})
        for group in split([c for c in decoders if c.adapters == adapters], limits.max_call_width)
    ]
    calls += [[(c.key, 0)] for c in alone]
    if prefillers:
        # one piece of the canonical cut, whatever the load: the calls a fresh
        # server makes, so cached pieces are exactly what it would compute
        first = prefillers[0]
        end = next_cut(first.cuts, first.prefilled, first.prompt_length)
        piece = [(first.key, end - first.prefilled)]
        if urgent or end == first.prompt_length:
            # a better priority's prompt, or a prompt's last piece (its first token is
            # drawn from it): before the decode calls, so the first token does not wait
            # for them (separate calls: the order changes no numerics)
            calls.insert(0, piece)
        else:
            calls.append(piece)
    return StepPlan(calls, draft)


def _seq_id(candidate: Candidate) -> int:
    return candidate.seq_id


def _priority(candidate: Candidate) -> int:
    return candidate.priority
