"""One ``llama_decode`` call and what came back.

The loop hands the executor a planned call (``(sequence, count)`` pairs: 0 decodes one
token and verifies its drafted guesses, more evaluates that many prompt tokens); the
executor writes the batch (:meth:`Executor.fill` → :class:`Filled`), runs the call on
the cores it shares with embeddings (:meth:`Executor.decode` → :class:`Outcome`). What
the outcome means for each sequence is the loop's to act on (vLLM v1's model runner
returns ``ModelRunnerOutput``; it never calls back into the scheduler)."""

from __future__ import annotations

import ctypes
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ._adapters import AdapterSet
from ._sequence import Sequence

if TYPE_CHECKING:
    from .._media import ImageSpan, VisionPrompt
    from ._context import Context
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
    #: an image call (docs/vision.md): the images to encode into the embeddings batch
    images: tuple[VisionPrompt, list[ImageSpan]] | None = None
    #: the sequence whose one-row step carries a pad row (its cell removed after the call)
    padded: Sequence | None = None


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
    """The cores' turns (``_retrieval._turns.CpuTurns``): generation and embeddings take
    turns on them."""

    def turn(self) -> AbstractContextManager[None]: ...


class Executor:
    """Writes the batch of one context and runs ``llama_decode`` on it (the scheduler
    thread only)."""

    def __init__(self, model: LlamaModel, context: Context, turns: Turns) -> None:
        self._model = model
        self.ctx = context.ctx
        self.batch = context.batch
        self.embd_batch = context.embd_batch
        self.abort_flag = context.abort_flag
        self.turns = turns
        #: a one-row decode call past this context carries a pad row (``--speculate
        #: exact``: docs/speculation.md, "Exact at any length"); ``None``: never
        self.pad_context: int | None = None
        #: decode calls that carried a pad row
        self.padded_steps = 0
        #: the call written last is an image call: its images and spans
        self._images: tuple[VisionPrompt, list[ImageSpan]] | None = None
        #: the adapter set of the call written last, by key (docs/lora.md)
        self._adapters: AdapterSet = ()
        if model.projector is not None:
            model.projector.watch(context.abort_flag)  # (an encode stops on a cancel)

    @property
    def n_vocab(self) -> int:
        return self._model.n_vocab

    @property
    def lib(self) -> Any:
        """The model's bindings, read at each call (tests swap them to inject faults)."""
        return self._model.lib

    def fill(self, call: list[tuple[Sequence, int]]) -> Filled:
        """Write ``call``'s rows into the batch (a decoding sequence's drafted guesses
        are taken from it: they ride in this call)."""
        self._images = None
        # (one set a call: the planner's; an aLoRA's prompt piece before its switch: the
        # set less the aLoRA)
        self._adapters = call[0][0].adapters
        if len(call) == 1 and call[0][1] and call[0][0].asked.media is not None:
            images = self._fill_images(*call[0])
            if images is not None:
                return images
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
        if n == 1 and self.pad_context is not None and not call[0][1]:
            sequence = call[0][0]
            if sequence.pos + 1 > self.pad_context:
                # a lone one-row step would take flash attention's split-KV path, which
                # no verify row takes: a second row (thrown away, no logits) keeps it
                # on the path of the rows that verify guesses
                tokens[1] = tokens[0]
                positions[1] = sequence.pos + 1
                seq_ids[1][0] = sequence.seq_id
                logits[1] = 0
                n = 2
                filled.padded = sequence
                self.padded_steps += 1
        batch.n_tokens = n
        filled.rows = n
        filled.per_sequence = {s: (c or 1 + len(drafts.get(s, ()))) for s, c in call}
        if filled.padded is not None:
            filled.per_sequence[filled.padded] = 2  # (its pad row is its own: a cancel owns the call)
        return filled

    def _fill_images(self, sequence: Sequence, count: int) -> Filled | None:
        """A prompt piece that is an image (the cut keeps images whole, each piece of
        its own): the embeddings batch's rows, to be filled by :meth:`decode`'s encode.
        ``None``: the piece is text."""
        media = sequence.asked.media
        assert media is not None
        start = sequence.prefilled
        end = start + count
        spans = [span for span in media.spans if start <= span.start < end]
        if not spans:
            return None
        if spans[0].start != start or spans[-1].end != end:  # pragma: no cover - the cut's promise
            raise RuntimeError(f"a prompt piece [{start}, {end}) holds an image and text")
        batch = self.embd_batch
        for i in range(count):
            batch.pos[i] = start + i
            batch.seq_id[i][0] = sequence.seq_id
            batch.logits[i] = 0
        filled = Filled(count)
        if not sequence.out.first_chunk_at:
            sequence.out.first_chunk_at = time.perf_counter()
        if end == len(sequence.asked.prompt):  # (a prompt that ends with an image)
            batch.logits[count - 1] = 1
            filled.outputs.append((sequence, count - 1))
        batch.n_tokens = count
        filled.per_sequence = {sequence: count}
        filled.images = (media, spans)
        self._images = filled.images
        return filled

    def fill_chunk(
        self, seq_id: int, history: list[int], start: int, end: int, adapters: AdapterSet = ()
    ) -> None:
        """Write the tokens ``history[start:end]`` of ``seq_id`` (no logits), to run
        with ``adapters``: the idle recompute's call."""
        self._adapters = adapters
        batch = self.batch
        chunk = end - start
        for i in range(chunk):
            batch.token[i] = history[start + i]
            batch.pos[i] = start + i
            batch.seq_id[i][0] = seq_id
            batch.logits[i] = 0
        batch.n_tokens = chunk

    def has_adapters(self, keyed: AdapterSet) -> bool:
        """Whether the files of ``keyed`` are all still loaded (listed)."""
        return self._model.adapters.listed_keys(keyed)

    def decode(self) -> Outcome:
        """Run the call written last. The cores are shared with embeddings: a cancel
        while waiting for them aborts the call at once (the abort flag)."""
        with self.turns.turn():
            # (always: an adapter unloaded from the list may still run its streams)
            self._model.adapters.apply(self.ctx, self._adapters)
            if self._images is not None:
                return self._decode_images(*self._images)
            return Outcome(self.lib.llama_decode(self.ctx, self.batch))

    def _decode_images(self, media: VisionPrompt, spans: list[ImageSpan]) -> Outcome:
        """Encode each image (the vision tower: stopped by the abort flag between graph
        nodes) into the embeddings batch, then evaluate it — with attention both ways
        inside the image where the projector asks for it (gemma3), as libmtmd's helper
        does."""
        self._images = None
        projector = self._model.projector
        assert projector is not None
        batch = self.embd_batch
        row = ctypes.sizeof(ctypes.c_float) * projector.n_embd
        base = ctypes.addressof(batch.embd.contents)
        first = spans[0].start

        def aborted() -> bool:
            return bool(self.abort_flag.value)

        for span in spans:
            if not projector.encode(media.chunks, span, base + (span.start - first) * row, aborted):
                return Outcome(DECODE_ABORTED)
        lib = self.lib
        # (an audio chunk's attention is causal: docs/audio.md)
        non_causal = projector.non_causal and not spans[0].audio
        if non_causal:
            lib.llama_set_causal_attn(self.ctx, False)
        try:
            return Outcome(lib.llama_decode(self.ctx, batch))
        finally:
            if non_causal:
                lib.llama_set_causal_attn(self.ctx, True)
