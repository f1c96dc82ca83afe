"""What the loop does with a call's logits: draw each sequence's token — or take the
token a reasoning's end forces — and send its piece (:meth:`Outputs.emit`), accept
the longest agreed prefix of a speculative draft (:meth:`Outputs.verify`), and before
the call, guess a lone stream's next tokens (:meth:`Outputs.plan_draft`). A sequence
that ends here is *reported* (an :data:`End`), never handed back: the loop does that."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import numpy

from ..._core._exceptions import BackendError
from ..._core._types import GenerationEnd, TokenLogprob
from .._decoding import (
    SHORTEST_DRAFT,
    Drafter,
    ReasoningTracker,
    SpeculationStats,
    draw,
    draw_special,
    logits_row,
    logprob_entry,
)
from ._capabilities import Capabilities
from ._sequence import Sequence

if TYPE_CHECKING:
    from ._model import LlamaModel

__all__ = ["End", "Outputs"]

logger = logging.getLogger("trioserve.llama")

#: why a sequence ended: its result
End = GenerationEnd | Literal["cancelled"] | BaseException


class Outputs:
    """Draws and drafts for the sequences of one context (the scheduler thread only)."""

    def __init__(self, model: LlamaModel, ctx: Any, memory: Any, capabilities: Capabilities) -> None:
        self.model = model
        self.ctx = ctx
        self.memory = memory
        self.capabilities = capabilities
        self.stats = SpeculationStats()
        #: remove a sequence's cells from a position on (``KvCells.trim``: with the window
        #: layers kept to their window, the ring laid out again); the cells kept
        self.rewind: Callable[[int, int], int] = self._rewind

    def _rewind(self, seq_id: int, pos: int) -> int:
        return pos if self.lib.llama_memory_seq_rm(self.memory, seq_id, pos, -1) else 0

    @property
    def lib(self) -> Any:
        """The model's bindings, read at each call (tests swap them to inject faults)."""
        return self.model.lib

    def emit(
        self, sequence: Sequence, index: int, row: numpy.ndarray | None = None
    ) -> tuple[int, End | None]:
        """Draw ``sequence``'s token from output ``index`` of the last call (or from
        ``row``: a full cache hit's kept logits, a copy) and send its piece:
        ``(token, None)``, or ``(-1, end)`` if the sequence ended there (end of text, its
        length, a constraint that failed). A token a reasoning's end forces
        (:meth:`_forced`) is taken instead of a draw and goes the same way."""
        model = self.model
        lib = self.lib
        asked = sequence.asked
        out = sequence.out
        entry = None
        token = -1
        tracker = sequence.reasoning
        if tracker is not None and (sequence.force_asked or sequence.forced):
            token, entry = self._forced(sequence, tracker, index, row)
        if token < 0:
            if asked.special:
                # a constraint's mask and/or log-probabilities (docs/batching.md)
                drawn = draw_special(
                    lib,
                    self.ctx,
                    index,
                    model.n_vocab,
                    sequence.sampler,
                    greedy=asked.greedy,
                    mask=asked.mask,
                    logprobs=asked.logprobs,
                    bias=asked.bias,
                    piece=model.piece,
                    row=row,
                )
                if isinstance(drawn, str):
                    return -1, BackendError(f"constrained decoding failed: {drawn}", should_retry=False)
                token, entry = drawn
            else:
                token = draw(lib, self.ctx, index, model.n_vocab, sequence.sampler, asked.greedy, row)
            if lib.llama_vocab_is_eog(model.vocab, token):
                return -1, "stop"
        if asked.mask is not None:
            refused = asked.mask.consume(token)
            if refused is not None:
                return -1, BackendError(f"constrained decoding failed: {refused}", should_retry=False)
        out.generated += 1
        out.generated_tokens.append(token)
        sequence.progress.completion_tokens += 1
        piece = model.piece(token)
        if tracker is not None and tracker.state != "answer":
            tracker.feed(piece)
        sequence.channel.put(piece if entry is None else (piece, entry))  # type: ignore[arg-type]
        if out.generated == asked.max_new:
            return -1, "length"  # after its last piece: order is kept
        out.next_token = token
        return token, None

    def _forced(
        self, sequence: Sequence, tracker: ReasoningTracker, index: int, row: numpy.ndarray | None
    ) -> tuple[int, TokenLogprob | None]:
        """The next token a reasoning's end forces (``(-1, None)``: none). An ask
        (``Inbox.force``) becomes the markers' tokens here, from the text so far
        (:meth:`ReasoningTracker.to_force`: none if the model wrote its own end marker
        since). The token goes where a drawn one goes: the sampler chain accepts it
        (penalties count it), its log-probability is read from output ``index``'s
        logits (the distribution it was not drawn from), its piece goes out."""
        forced = sequence.forced
        if sequence.force_asked:
            if not forced:
                start, end = sequence.reasoning_tokens
                forced.extend(tracker.to_force(start, end))
            sequence.force_asked = False
        if not forced:
            return -1, None
        token = forced.popleft()
        if sequence.sampler is not None:
            self.lib.llama_sampler_accept(sequence.sampler, token)
        entry = None
        asked = sequence.asked
        if asked.logprobs is not None:
            logits = logits_row(self.lib, self.ctx, index, self.model.n_vocab) if row is None else row
            entry = logprob_entry(logits, token, asked.logprobs, asked.bias, self.model.piece)
        return token, entry

    def verify(self, sequence: Sequence, index: int, token: int, draft: list[int]) -> End | None:
        """After the call that decoded ``sequence``'s ``token`` at output ``index`` and
        its ``draft`` in the rows after it: accept the longest prefix of the draft the
        model agrees with (each accepted row's draw is that of a one-token step), remove
        the cells of the rest. Returns the end, if the sequence ended inside the run."""
        # (counted before each piece is sent: the request may end with any of them, and
        # it reads its counters as soon as it is handed back)
        stats = self.stats
        progress = sequence.progress
        stats.verify_calls += 1
        stats.proposed += len(draft)
        progress.draft_proposed += len(draft)
        accepted = 0
        end: End | None = None
        for guess in draft:
            if token != guess:
                break
            accepted += 1
            stats.accepted += 1
            progress.draft_accepted += 1
            sequence.pos += 1  # the guess's cell is the sequence's now
            token, end = self.emit(sequence, index + accepted)
            if end is not None:
                break
        if sequence.spec.drafter is not None:
            sequence.spec.drafter.settle(len(draft), accepted)
        if end is not None:
            return end  # ended inside the run: the loop releases its cells
        if accepted < len(draft) and self.rewind(sequence.seq_id, sequence.pos) != sequence.pos:
            # pragma: no cover - (speculation needs partial removal: checked at load)
            return BackendError("the rejected guesses' cells could not be removed")
        return None

    def plan_draft_safely(self, sequence: Sequence) -> None:
        """:meth:`plan_draft`; if it fails, the stream decodes one token per call from
        now on (an optimisation is never a reason to fail anything)."""
        try:
            self.plan_draft(sequence)
        except Exception:
            logger.exception("drafting failed; the stream decodes one token per call from now on")
            sequence.spec.draft = []
            sequence.spec.speculate = False

    def plan_draft(self, sequence: Sequence) -> None:
        """Guess the tokens after ``sequence``'s next one (prompt lookup), as many as its
        verify call may hold: the exact width, the room in its channel, its token limit
        and (auto) the context where a lone step's attention changes path."""
        sequence.spec.draft = []
        if not sequence.spec.speculate or sequence.force_asked or sequence.forced:
            return  # (a forced token is no guess's: the next call decodes it alone)
        capabilities = self.capabilities
        verify_width = capabilities.verify_width
        channel = sequence.channel
        room = channel.room
        if capabilities.speculation == "fast" and room > 0:
            # fast: a stream with room in its channel may make a run longer than the
            # window (it then holds at most capacity − 1 + FAST_DRAFT + 1 pieces: still
            # bounded); a reader that is behind fills the window and pauses the stream
            # as before (a draft cut to the room left after a partial run cost a copy
            # its next long draft: docs/speculation.md, "The reader window")
            room = verify_width
        limit = min(
            verify_width - 1,
            room - 1,
            sequence.asked.max_new - sequence.out.generated - 1,
            capabilities.verify_context_limit - sequence.pos - 1,
        )
        if limit <= 0:
            return
        drafter = sequence.spec.drafter
        if drafter is None:
            drafter = sequence.spec.drafter = Drafter(sequence.asked.prompt, longest=verify_width - 1)
        # the drafter's context: every token in the KV cells (the last one drawn is not yet)
        generated = sequence.out.generated_tokens
        done = len(drafter.context) - len(sequence.asked.prompt)
        if done < len(generated) - 1:
            drafter.extend(generated[done:-1])
        draft = drafter.propose(sequence.out.next_token, limit)
        if draft and sequence.asked.media is not None:
            # (an image's placeholder ids are no tokens: a guess stops before one)
            n_vocab = self.model.n_vocab
            draft = draft[: next((i for i, t in enumerate(draft) if t >= n_vocab), len(draft))]
        if draft and sequence.asked.mask is not None:
            # a guess the constraint forbids is not proposed
            draft = draft[: sequence.asked.mask.valid_prefix(draft)]
            if len(draft) < SHORTEST_DRAFT:
                draft = []
        sequence.spec.draft = draft
