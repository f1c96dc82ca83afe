"""Embeddings on a loaded model: one llama context with ``embeddings = true``, its
batch and its abort flag (docs/embeddings.md).

The context returns every token's vector (llama.cpp's pooling off) and the pooling —
the mean, the first token (CLS), the last — is done here, in float64. An input's vector
must never depend on what it was sent with, yet one input per ``llama_decode`` call
leaves most of each call's cost (reading the weights) to one short input. llama.cpp's
CPU kernels change their arithmetic with a call's shape (its rows, where an input's
cells start), so batching naively moves vectors (a cosine of 6e-4 here). Two rules make
a call of several inputs give each the bits of its lone call: every input starts on a
*tile* of rows and is padded to whole tiles (padding rows belong to a sequence of their
own, which no input attends to), and the context runs without flash attention (whose
KV blocks split a long input differently at another offset). A lone input is evaluated
the same way (on its tiles), so "its lone evaluation" is one computation. At the
context's creation a probe embeds inputs of several lengths alone and then together,
at other offsets, for each candidate layout (:data:`LAYOUTS`), and keeps the first
that is exact bit for bit at the widest call (:attr:`EmbeddingContext.width`,
:attr:`EmbeddingContext.tile`); if none is, one input per call, unpadded. A
cross-encoder's rank context (``pooling="rank"``) keeps one pair per call, unpadded,
with the model's attention: llama-server's lone evaluation, bit for bit.

:class:`EmbeddingContext` is used by one thread at a time (:class:`Embedder` holds the
lock); :meth:`EmbeddingContext.embed` evaluates the inputs in as few ``llama_decode``
calls as fit — each input its own sequence — and returns each input's pooled,
L2-normalised vector. The abort flag stops a call within one graph node, as
generation's does; :class:`Embedder` raises it when the caller's scope is cancelled.

The cores are shared with generation through :class:`~._turns.CpuTurns` (its own
module): the context takes a turn for every ``llama_decode`` call, and a waiting call
leaves when its abort flag is raised.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy
import trio

from ..._core._channel import Aborted
from ..._core._exceptions import BackendError, InvalidRequestError
from .._aborting import make_abort_callback
from ._model_view import ModelView
from ._turns import CpuTurns

logger = logging.getLogger("trioserve.embeddings")


__all__ = ["POOLINGS", "Embedder", "EmbeddingContext", "OwnedContext", "Pooling"]

#: "rank": a cross-encoder's score (the classifier head in the graph: docs/rerank.md)
Pooling = Literal["mean", "cls", "last", "rank"]
#: llama.cpp's ``llama_pooling_type`` values
POOLINGS: dict[str, int] = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}
_NAMES = {value: name for name, value in POOLINGS.items()}
_UNSPECIFIED = -1
#: inputs (sequences) per ``llama_decode`` call, at most: the probe tries up to this
MAX_SEQUENCES = 16
#: the layouts the probe tries, cheapest first: ``(tile, floor)`` — each input starts
#: on a tile and is padded to whole ones, and every call holds at least ``floor`` rows
#: (where llama.cpp's CPU kernels take other paths below some number of rows). On the
#: development machine (x86-64, AVX2, 2 threads, flash attention off) 16-row tiles
#: and no floor are exact; with flash attention on, no layout short of 64-row tiles
#: is (its KV blocks split long inputs differently at other offsets)
LAYOUTS = ((16, 0), (32, 0), (16, 64), (32, 64))
#: batching pays for the padding only from this many inputs per call
MIN_WIDTH = 4
#: rows per batched call, at most: without flash attention a call's attention grows
#: with the square of its rows (8 inputs of 57 tokens in one call of 512 rows took
#: 2.6 s here, twice their lone calls); 256 rows keep a call near its weights' cost
MAX_BATCH_ROWS = 256
#: the probe's inputs: lengths from one token to a few dozen (the kernels a lone call
#: takes depend on its rows), in an order that mixes them within each call
PROBE_TEXTS = (
    "Hi",
    "The history of the city is long and varied, with rivers, bridges and old markets.",
    "ok",
    "Embeddings map texts to vectors.",
    "def area(radius): return 3.14159 * radius ** 2  # a circle",
    "A",
    "Structured concurrency: every task has a parent scope that outlives it, and a cancel reaches all.",
    "The quick brown fox jumps over the lazy dog.",
)


class OwnedContext:
    """A llama context a retrieval model made and frees: its memory, a batch of
    ``n_batch`` one-sequence rows, and the abort flag a cancel raises."""

    lib: Any
    n_batch: int

    def _adopt(self, ctx: Any, abort_flag: ctypes.c_ubyte | None) -> None:
        lib = self.lib
        self.ctx = ctx
        self.memory = lib.llama_get_memory(ctx)
        self.batch = lib.llama_batch_init(self.n_batch, 0, 1)
        for i in range(self.n_batch):
            self.batch.n_seq_id[i] = 1
        # the callback object and its flag must outlive the context: keep references
        # (the flag its Embedder raises on a cancel, the probe's calls included)
        self.abort_flag = abort_flag if abort_flag is not None else ctypes.c_ubyte(0)
        self._abort_callback, _ = make_abort_callback(lib)
        lib.llama_set_abort_callback(ctx, self._abort_callback, ctypes.addressof(self.abort_flag))

    def free(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)


class EmbeddingContext(OwnedContext):
    """A llama context for pooled embeddings: room for ``n_batch`` tokens of up to
    :data:`MAX_SEQUENCES` inputs per call (one ubatch: a pooled vector needs its whole
    input in one evaluation).

    With ``pooling="rank"`` it is a cross-encoder's context: llama.cpp pools each
    sequence through the model's classifier head, and :meth:`embed` returns each
    input's head outputs (``n_out`` numbers, the score first), not normalised."""

    def __init__(
        self,
        model: ModelView,
        *,
        pooling: Pooling | None = None,
        turns: CpuTurns | None = None,
        abort_flag: ctypes.c_ubyte | None = None,
    ) -> None:

        #: the cores' turns, shared with the model's generation scheduler
        self.turns = turns if turns is not None else CpuTurns()
        lib = model.lib
        settings = model.settings
        self.lib = lib
        self.n_batch = settings.n_batch
        self.n_embd: int = lib.llama_model_n_embd(model.model)
        self.has_encoder = bool(lib.llama_model_has_encoder(model.model))
        if pooling is not None:
            resolved, self.pooling_source = POOLINGS[pooling], "--pooling"
        else:
            probe = self._create(model, _UNSPECIFIED)  # what the GGUF says
            resolved = lib.llama_pooling_type(probe)
            lib.llama_free(probe)
            self.pooling_source = "the model's"
            if resolved == POOLINGS["none"]:
                # a generative model has no pooling of its own: mean, the usual default
                resolved, self.pooling_source = POOLINGS["mean"], "default (the model has none)"
        if resolved == POOLINGS["rank"] and pooling != "rank":
            # a cross-encoder's own pooling is its score; its embeddings: the mean
            resolved, self.pooling_source = POOLINGS["mean"], "default (the model's own pools a rank)"
        if resolved not in _NAMES or resolved == POOLINGS["none"]:
            raise BackendError(
                f"llama.cpp pools this model's embeddings as type {resolved}, which is not supported"
            )
        self.pooling: str = _NAMES[resolved]
        #: numbers per input: the embedding's dimensions, or the classifier's outputs
        self.n_out: int = self.n_embd
        if self.pooling == "rank":
            self.n_out = max(1, int(lib.llama_model_n_cls_out(model.model)))
        logger.info(
            "embeddings: %s pooling (%s), %d dimensions", self.pooling, self.pooling_source, self.n_out
        )
        # every token's vector, pooled by embed() — or, ranking, llama.cpp's rank pooling
        native = POOLINGS["rank"] if self.pooling == "rank" else POOLINGS["none"]
        # (one sequence more: the padding's)
        ctx = self._create(model, native, MAX_SEQUENCES + 1)
        #: the token of padding rows (any: no input attends to them)
        self.pad_token = max(0, int(lib.llama_vocab_bos(model.vocab)))
        self._adopt(ctx, abort_flag)
        #: ``llama_decode`` calls made, and aborted, and inputs evaluated (tests and /health)
        self.calls = 0
        self.aborted_calls = 0
        self.inputs = 0
        #: the layout, measured exact (the module's docstring): inputs per call, at
        #: most, and the tile (rows) each input starts on and the call is padded to
        #: (0: no padding — one input per call, as it comes)
        self.width = 1
        self.tile = 0
        self.floor = 0
        if self.pooling != "rank":
            # (a cross-encoder's pairs: one per call, unpadded, flash attention as the
            # model's default — llama-server's lone evaluation, bit for bit; batched
            # pairs moved a score by 8e-3 on the test reranker, in llama-server too)
            try:
                self.width, self.tile, self.floor = self._exact_layout(model)
            except BaseException:  # (aborted by a cancel, or failed: nothing kept)
                self.free()
                raise
        # (the counters count requests' work, not the probe's)
        self.calls = self.aborted_calls = self.inputs = 0
        logger.info(
            "embeddings: %d input(s) per call%s (measured exact)",
            self.width,
            f", each on {self.tile}-row tiles, calls of {self.floor} rows or more" if self.tile else "",
        )

    def _exact_layout(self, model: ModelView) -> tuple[int, int, int]:
        """``(width, tile, floor)``: the widest call (≤ :data:`MAX_SEQUENCES` inputs)
        whose every vector equals its lone evaluation's bit for bit, with the first of
        :data:`LAYOUTS` that reaches it; ``(1, 0, 0)`` — one input per call, unpadded —
        if none makes :data:`MIN_WIDTH` inputs in a call exact. About ten calls per
        layout tried, at creation (6 s here, on the first embeddings request)."""
        texts = [model.tokenize(text) for text in PROBE_TEXTS]
        # each text alone, then together, in calls of several, at other offsets too
        inputs = texts + texts[::-1]
        best = (1, 0, 0)
        for tile, floor in LAYOUTS:
            if floor > self.n_batch:
                continue
            self.tile, self.floor, self.width = tile, floor, 1
            try:
                alone = self.embed(texts)
                alone = alone + alone[::-1]
                # the widest first: on a CPU where it is exact, two calls settle it
                width = MAX_SEQUENCES
                while width > best[0] and width >= MIN_WIDTH:
                    self.width = width
                    if self.embed(inputs) == alone:
                        best = (width, tile, floor)
                        break
                    width //= 2
            finally:
                self.tile, self.floor, self.width = 0, 0, 1
            if best[0] == MAX_SEQUENCES:
                break
        return best if best[0] >= MIN_WIDTH else (1, 0, 0)

    def _rows(self, item: Sequence[int]) -> int:
        """The rows an input takes in a call: its tokens, up to a whole tile — unless
        the whole tiles would not fit one call: then its tokens (such an input is
        always alone in its call, and always evaluated so)."""
        tile = self.tile
        if not tile:
            return len(item)
        rows = -(-len(item) // tile) * tile
        return rows if rows <= self.n_batch else len(item)

    def _create(self, model: ModelView, pooling: int, sequences: int = 1) -> Any:
        lib = self.lib
        settings = model.settings
        params = lib.llama_context_default_params()
        params.n_ctx = self.n_batch
        params.n_batch = self.n_batch
        params.n_ubatch = self.n_batch
        params.n_seq_max = sequences
        params.n_threads = settings.n_threads
        params.n_threads_batch = settings.n_threads
        params.embeddings = True
        params.pooling_type = pooling
        params.kv_unified = True  # the inputs of one call share the n_batch cells
        if pooling != POOLINGS["rank"]:
            # flash attention off: its KV blocks split an input's cells differently
            # at another offset in the call, so no cheap layout is exact with it
            params.flash_attn_type = 0
        # (under the cores' turn: a context copies the model's LoRA adapter list, which
        # a run-time adapter load changes under the same turn — docs/lora.md)
        with self.turns.turn():
            ctx = lib.llama_init_from_model(model.model, params)
        if not ctx:
            raise BackendError(f"llama.cpp could not create an embedding context of {self.n_batch} tokens")
        return ctx

    def groups(self, inputs: Sequence[Sequence[int]]) -> list[range]:
        """The inputs of each call: consecutive, ≤ ``n_batch`` rows (tiles counted
        whole) — ≤ :data:`MAX_BATCH_ROWS` for more than one —, ≤ :attr:`width` inputs."""
        out: list[range] = []
        start, tokens = 0, 0
        limit = min(self.n_batch, MAX_BATCH_ROWS) if self.width > 1 else self.n_batch
        for i, item in enumerate(inputs):
            rows = self._rows(item)
            if i > start and (tokens + rows > limit or i - start >= self.width):
                out.append(range(start, i))
                start, tokens = i, 0
            tokens += rows
        if inputs:
            out.append(range(start, len(inputs)))
        return out

    def embed(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        """Each input's pooled, L2-normalised vector (blocking). Raises
        :class:`~trioserve._backends._threaded.Aborted` when the abort flag stops it."""
        lib = self.lib
        batch = self.batch
        out: list[list[float]] = []
        for group in self.groups(inputs):
            if self.abort_flag.value:
                raise Aborted
            lib.llama_memory_clear(self.memory, True)
            n = padding = 0
            starts: list[int] = []
            for seq, index in enumerate(group):
                starts.append(n)
                for pos, token in enumerate(inputs[index]):
                    batch.token[n] = token
                    batch.pos[n] = pos
                    batch.seq_id[n][0] = seq
                    batch.logits[n] = 1
                    n += 1
                # the rest of its last tile: rows of a sequence of their own, which no
                # input attends to (so every input starts on a tile, the call is whole tiles)
                n, padding = self._pad(n, n + self._rows(inputs[index]) - len(inputs[index]), padding)
            if self.tile:
                # and the call at least :attr:`floor` rows: the kernels a call takes
                # change with its rows below that (measured by the probe)
                n, padding = self._pad(n, max(n, self.floor), padding)
            batch.n_tokens = n
            if not self.turns.acquire(abort=lambda: self.abort_flag.value):
                raise Aborted
            try:
                self.calls += 1
                rc = (
                    lib.llama_encode(self.ctx, batch)
                    if self.has_encoder
                    else lib.llama_decode(self.ctx, batch)
                )
            finally:
                self.turns.release()
            if rc == 2 or (rc != 0 and self.abort_flag.value):
                self.aborted_calls += 1
                lib.llama_memory_clear(self.memory, True)
                raise Aborted
            if rc != 0:
                raise BackendError(
                    f"llama.cpp could not evaluate the embedding batch (llama_decode returned {rc})"
                )
            self.inputs += len(group)
            if self.pooling == "rank":
                for seq in range(len(group)):
                    scores = lib.llama_get_embeddings_seq(self.ctx, seq)
                    if not scores:
                        raise BackendError("llama.cpp returned no rank score")
                    out.append([float(scores[i]) for i in range(self.n_out)])
                continue
            pointer = lib.llama_get_embeddings(self.ctx)
            if not pointer:
                raise BackendError("llama.cpp returned no embeddings")
            rows = numpy.ctypeslib.as_array(pointer, shape=(n, self.n_embd)).astype(numpy.float64)
            for start, index in zip(starts, group, strict=True):
                end = start + len(inputs[index])
                if self.pooling == "mean":
                    vector = rows[start:end].mean(axis=0)
                elif self.pooling == "cls":
                    vector = rows[start]
                else:
                    vector = rows[end - 1]
                norm = float(numpy.linalg.norm(vector))
                out.append((vector / norm if norm > 0 else vector).tolist())
        lib.llama_memory_clear(self.memory, True)
        return out

    def _pad(self, n: int, end: int, position: int) -> tuple[int, int]:
        """Padding rows ``n`` … ``end`` − 1 in the batch (the padding sequence's, at
        positions from ``position`` on): ``(end, the next position)``."""
        batch = self.batch
        for row in range(n, end):
            batch.token[row] = self.pad_token
            batch.pos[row] = position
            batch.seq_id[row][0] = MAX_SEQUENCES
            batch.logits[row] = 1
            position += 1
        return end, position


class Embedder[C]:
    """A model's embedding context (or another context of the same kind: a rank or a
    yes/no reranking context), created on first use, one request at a time (the
    others wait in arrival order, each in its own cancel scope)."""

    def __init__(
        self,
        model: ModelView,
        pooling: Pooling | None = None,
        *,
        turns: CpuTurns | None = None,
        make: Callable[[ModelView, CpuTurns, ctypes.c_ubyte], C] | None = None,
    ) -> None:
        self._model = model
        self._pooling: Pooling | None = pooling
        if make is None:

            def make(model: ModelView, turns: CpuTurns, flag: ctypes.c_ubyte) -> C:
                return EmbeddingContext(  # type: ignore[return-value]
                    model, pooling=pooling, turns=turns, abort_flag=flag
                )

        self._make = make
        self._context: C | None = None
        self._lock = trio.Lock()
        self._closed = False
        #: the cores' turns: the model's generation scheduler takes one per decode call too
        self.turns = turns if turns is not None else CpuTurns()
        #: the context's abort flag (raised by a cancel: its creation's probe, a call)
        self.abort_flag = ctypes.c_ubyte(0)

    @property
    def context(self) -> C | None:
        return self._context

    @property
    def busy(self) -> bool:
        """A request holds the context (running, or leaving after a cancel)."""
        return self._lock.locked()

    def check(self, inputs: Sequence[Sequence[int]]) -> None:
        limit = self._model.settings.n_batch
        for i, item in enumerate(inputs):
            if not item:
                raise InvalidRequestError(f"input[{i}] is empty", param="input")
            if len(item) > limit:
                raise InvalidRequestError(
                    f"input[{i}] has {len(item)} tokens; an input may have at most {limit} (the batch size: "
                    "its pooled vector needs it evaluated at once; raise --batch-size)",
                    param="input",
                )

    async def embed(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        """The vectors of ``inputs`` (token ids). Cancellation: the call in flight is
        aborted inside llama.cpp; ``Cancelled`` propagates once the thread has
        returned (never abandoned)."""
        self.check(inputs)
        work = list(inputs)
        return await self.run(lambda context: context.embed(work))  # type: ignore[attr-defined]

    async def run[T](self, call: Callable[[C], T]) -> T:
        """``call(context)`` in a worker thread, holding the context (made on first
        use). Cancellation: the context's abort flag is raised, the call in flight
        returns from llama.cpp within a graph node (one waiting for its turn on the
        cores leaves at once), and ``Cancelled`` propagates once the thread has
        returned (never abandoned)."""
        async with self._lock:
            if self._closed:
                raise BackendError("the model is closed")
            flag = self.abort_flag
            flag.value = 0
            done = False

            async def abort_on_cancel() -> None:
                try:
                    await trio.sleep_forever()
                finally:
                    if not done:
                        flag.value = 1
                        self.turns.wake()  # a call waiting for its turn leaves at once

            async with trio.open_nursery() as nursery:
                nursery.start_soon(abort_on_cancel)
                try:
                    if self._context is None:
                        # (its probe's calls stop as a request's do: a client that
                        # leaves during the first request leaves nothing behind)
                        self._context = await trio.to_thread.run_sync(
                            self._make, self._model, self.turns, flag
                        )
                    result = await trio.to_thread.run_sync(call, self._context)
                except Aborted:
                    await trio.lowlevel.checkpoint()  # the cancel that raised the flag
                    raise BackendError("the evaluation was aborted") from None
                done = True
                nursery.cancel_scope.cancel()
            return result

    def free(self) -> None:
        """Free the context (blocking; the caller holds no call in flight)."""
        self._closed = True
        if self._context is not None:
            self._context.free()  # type: ignore[attr-defined]
            self._context = None
