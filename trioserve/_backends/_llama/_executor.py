"""One ``llama_decode`` call and what came back.

The loop hands the executor a planned call (``(sequence, count)`` pairs: 0 decodes one
token and verifies its drafted guesses, more evaluates that many prompt tokens); the
executor writes the batch (:meth:`Executor.fill` → :class:`Filled`), runs the call on
the cores it shares with embeddings (:meth:`Executor.decode` → :class:`Outcome`). What
the outcome means for each sequence is the loop's to act on (vLLM v1's model runner
returns ``ModelRunnerOutput``; it never calls back into the scheduler)."""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ._sequence import Sequence

if TYPE_CHECKING:
    from ._model import LlamaModel

__all__ = ["DECODE_ABORTED", "Executor", "Filled", "Outcome"]

#: ``llama_decode``'s return code when the abort callback stopped it
DECODE_ABORTED = 2


@dataclass(slots=True)
class Filled:
    """A batch written for one call."""

    #: rows in the batch
    rows: int
    #: (sequence, batch index of its logits), in the order the tokens are drawn
    outputs: list[tuple[Sequence, int]] = field(default_factory=list)
    #: speculative decoding: the guessed tokens a sequence's rows verify
    drafts: dict[Sequence, list[int]] = field(default_factory=dict)
    #: the rows of each sequence (what ``rows_in_flight`` reports)
    per_sequence: dict[Sequence, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Outcome:
    """What ``llama_decode`` returned."""

    code: int

    @property
    def ok(self) -> bool:
        return self.code == 0

    @property
    def aborted(self) -> bool:
        """Stopped by the abort flag (a cancel, idle work giving way): the survivors
        redo it from the same state."""
        return self.code == DECODE_ABORTED


class Turns(Protocol):
    """The cores' turns (``_embeddings.CpuTurns``): generation and embeddings take
    turns on them."""

    def turn(self) -> AbstractContextManager[None]: ...


class Executor:
    """Writes the batch of one context and runs ``llama_decode`` on it (the scheduler
    thread only)."""

    def __init__(self, model: LlamaModel, ctx: Any, batch: Any, turns: Turns) -> None:
        self._model = model
        self.ctx = ctx
        self.batch = batch
        self.turns = turns

    @property
    def lib(self) -> Any:
        """The model's bindings, read at each call (tests swap them to inject faults)."""
        return self._model.lib

    def fill(self, call: list[tuple[Sequence, int]]) -> Filled:
        """Write ``call``'s rows into the batch (a decoding sequence's drafted guesses
        are taken from it: they ride in this call)."""
        batch = self.batch
        tokens = batch.token
        positions = batch.pos
        seq_ids = batch.seq_id
        logits = batch.logits
        n = 0
        filled = Filled(0)
        outputs = filled.outputs
        drafts = filled.drafts
        for sequence, count in call:
            seq_id = sequence.seq_id
            if count == 0:  # decode one token
                tokens[n] = sequence.out.next_token
                positions[n] = sequence.pos
                seq_ids[n][0] = seq_id
                logits[n] = 1
                outputs.append((sequence, n))
                n += 1
                if sequence.spec.draft:  # and verify the tokens guessed after it
                    draft = sequence.spec.draft
                    sequence.spec.draft = []
                    drafts[sequence] = draft
                    for j, guess in enumerate(draft, start=1):
                        tokens[n] = guess
                        positions[n] = sequence.pos + j
                        seq_ids[n][0] = seq_id
                        logits[n] = 1
                        n += 1
            else:
                if not sequence.out.first_chunk_at:
                    sequence.out.first_chunk_at = time.perf_counter()
                start = sequence.prefilled
                prompt = sequence.asked.prompt
                for i in range(count):
                    tokens[n] = prompt[start + i]
                    positions[n] = start + i
                    seq_ids[n][0] = seq_id
                    logits[n] = 0
                    n += 1
                if start + count == len(prompt):
                    logits[n - 1] = 1
                    outputs.append((sequence, n - 1))
        batch.n_tokens = n
        filled.rows = n
        filled.per_sequence = {s: (c or 1 + len(drafts.get(s, ()))) for s, c in call}
        return filled

    def fill_chunk(self, seq_id: int, history: list[int], start: int, end: int) -> None:
        """Write the tokens ``history[start:end]`` of ``seq_id`` (no logits): the idle
        recompute's call."""
        batch = self.batch
        chunk = end - start
        for i in range(chunk):
            batch.token[i] = history[start + i]
            batch.pos[i] = start + i
            batch.seq_id[i][0] = seq_id
            batch.logits[i] = 0
        batch.n_tokens = chunk

    def decode(self) -> Outcome:
        """Run the call written last. The cores are shared with embeddings: a cancel
        while waiting for them aborts the call at once (the abort flag)."""
        with self.turns.turn():
            return Outcome(self.lib.llama_decode(self.ctx, self.batch))
