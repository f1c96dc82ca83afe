"""Reranking on a loaded model (docs/rerank.md): a cross-encoder's pairs through a rank
context, or a generative model's "yes" probability with the query as one shared prefix.

The layouts are pure functions (unit-tested); :class:`YesNoContext` is the llama context
of a ``yes-no`` reranker, used by one thread at a time; :class:`Reranker` is a model's
reranking, held by its backend: it tokenizes, checks the limits before anything is
evaluated, and runs the context through an :class:`~._embeddings.Embedder` (one request
at a time, the abort flag raised by a cancel, the cores' turns shared with generation).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from typing import Any, Literal, Unpack

import trio

from ..._core._backend import Ranking, RerankOptions, check_options
from ..._core._channel import Aborted
from ..._core._exceptions import BackendError, InvalidRequestError
from ._embeddings import Embedder, EmbeddingContext, OwnedContext
from ._model_view import ModelView
from ._rerank_layout import (
    DEFAULT_INSTRUCTION,
    DEFAULT_TEMPLATE,
    SOFTMAX_ARCHITECTURES,
    RerankKind,
    YesNoTemplate,
    pair_tokens,
    templated_pair,
    yes_probability,
)
from ._turns import CpuTurns

logger = logging.getLogger("trioserve.rerank")

__all__ = ["Reranker", "YesNoContext", "reranker_kind"]


def reranker_kind(model: ModelView) -> RerankKind | None:
    """What reranking the model can do: a GGUF with rank pooling is a cross-encoder;
    a generative model its settings name ``yes-no``; otherwise none."""
    pooling = model.meta(f"{model.architecture}.pooling_type")
    if pooling is not None and pooling.strip() == "4":
        return "cross-encoder"
    if model.settings.rerank == "yes-no":
        return "yes-no"
    return None


class YesNoContext(OwnedContext):
    """A generative model's reranking context: sequence 0 holds the shared prefix, each
    document is evaluated after it in sequence 1 (the prefix's cells shared, not
    copied), its last row's logits read for "yes" and "no". One document per call: a
    score never depends on the other documents (docs/rerank.md, "Exactness")."""

    def __init__(self, model: ModelView, turns: CpuTurns, abort_flag: ctypes.c_ubyte | None = None) -> None:

        lib = model.lib
        self.lib = lib
        self.turns = turns
        self.n_batch = model.settings.n_batch
        self.yes, self.no = model.yes_no_tokens()
        params = lib.llama_context_default_params()
        params.n_ctx = self.n_batch
        params.n_batch = self.n_batch
        params.n_ubatch = self.n_batch
        params.n_seq_max = 2
        params.n_threads = model.settings.n_threads
        params.n_threads_batch = model.settings.n_threads
        params.kv_unified = True  # sequence 1 shares sequence 0's cells
        with turns.turn():  # (a LoRA load changes the model's adapter list under it)
            ctx = lib.llama_init_from_model(model.model, params)
        if not ctx:
            raise BackendError(f"llama.cpp could not create a reranking context of {self.n_batch} tokens")
        self._adopt(ctx, abort_flag)
        #: the prefix sequence 0 holds (``None``: nothing valid)
        self._prefix: list[int] | None = None
        #: ``llama_decode`` calls, aborted calls, tokens evaluated, prefixes evaluated
        self.calls = 0
        self.aborted_calls = 0
        self.evaluated = 0
        self.prefix_evaluations = 0

    def _decode(self, tokens: Sequence[int], start: int, seq: int, *, last_logits: bool) -> None:
        lib, batch = self.lib, self.batch
        for i, token in enumerate(tokens):
            batch.token[i] = token
            batch.pos[i] = start + i
            batch.seq_id[i][0] = seq
            batch.logits[i] = 0
        if last_logits:
            batch.logits[len(tokens) - 1] = 1
        batch.n_tokens = len(tokens)
        if self.abort_flag.value or not self.turns.acquire(abort=lambda: self.abort_flag.value):
            raise Aborted
        try:
            self.calls += 1
            rc = lib.llama_decode(self.ctx, batch)
        finally:
            self.turns.release()
        if rc == 2 or (rc != 0 and self.abort_flag.value):
            self.aborted_calls += 1
            raise Aborted
        if rc != 0:
            raise BackendError(
                f"llama.cpp could not evaluate the reranking batch (llama_decode returned {rc})"
            )
        self.evaluated += len(tokens)

    def rank(self, prefix: Sequence[int], documents: Sequence[Sequence[int]]) -> tuple[list[float], int]:
        """Each document's "yes" probability after ``prefix`` (blocking), and how many
        prefix tokens were evaluated (0: sequence 0 held it already)."""
        lib, memory = self.lib, self.memory
        prefix_evaluated = 0
        try:
            if self._prefix != list(prefix):
                self._prefix = None
                lib.llama_memory_clear(memory, True)
                self._decode(prefix, 0, 0, last_logits=False)
                self._prefix = list(prefix)
                self.prefix_evaluations += 1
                prefix_evaluated = len(prefix)
            scores: list[float] = []
            for document in documents:
                lib.llama_memory_seq_rm(memory, 1, -1, -1)
                lib.llama_memory_seq_cp(memory, 0, 1, -1, -1)
                self._decode(document, len(prefix), 1, last_logits=True)
                logits = lib.llama_get_logits_ith(self.ctx, len(document) - 1)
                if not logits:
                    raise BackendError("llama.cpp returned no logits for the reranking row")
                scores.append(yes_probability(logits[self.yes], logits[self.no]))
            lib.llama_memory_seq_rm(memory, 1, -1, -1)
        except BaseException:
            self._prefix = None
            lib.llama_memory_clear(memory, True)
            raise
        return scores, prefix_evaluated


class Reranker:
    """A model's reranking (``kind`` ``None``: it cannot rerank): the limits, the
    layout, and the context run through an :class:`Embedder`."""

    def __init__(self, model: ModelView, turns: CpuTurns) -> None:
        self._model = model
        self.kind: RerankKind | None = reranker_kind(model)
        self.score: Literal["logit", "probability"] = "probability"
        self._runner: Embedder[Any] | None = None
        self._template: YesNoTemplate | None = None
        self._pair_template: str | None = None
        if self.kind == "cross-encoder":
            self._runner = Embedder(model, "rank", turns=turns)
            self._pair_template = model.meta("tokenizer.chat_template.rerank")
            if model.architecture not in SOFTMAX_ARCHITECTURES:
                self.score = "logit"
        elif self.kind == "yes-no":
            self._template = YesNoTemplate.parse(model.settings.rerank_template or DEFAULT_TEMPLATE)
            self._runner = Embedder(model, turns=turns, make=YesNoContext)
        #: the tokens after each document (a yes/no reranker's template tail)
        self._tail: list[int] = (
            model.tokenize(self._template.tail, add_bos=False, parse_special=True) if self._template else []
        )
        self._flags = model.pair_flags()

    @property
    def context(self) -> EmbeddingContext | YesNoContext | None:
        return None if self._runner is None else self._runner.context

    @property
    def busy(self) -> bool:
        return self._runner is not None and self._runner.busy

    async def rerank(self, query: str, documents: Sequence[str], **options: Unpack[RerankOptions]) -> Ranking:
        check_options(options, RerankOptions)
        if self._runner is None:
            raise InvalidRequestError(
                f"the model {self._model.settings.model_id!r} cannot rerank: serve a cross-encoder GGUF "
                '(rank pooling: bge-reranker, jina-reranker, ms-marco MiniLM) or set rerank = "yes-no" '
                "in a generative model's preset (--rerank yes-no); GET /v1/models says which can "
                "(capabilities.rerank)",
                param="model",
                code="rerank_not_supported",
            )
        instruction = options.get("instruction")
        max_tokens_per_doc, max_tokens = options.get("max_tokens_per_doc"), options.get("max_tokens")
        if instruction is not None and (self._template is None or not self._template.has_instruction):
            raise InvalidRequestError(
                "instruction is only for a yes-no reranker whose template holds {instruction}; "
                f"this model is a {self.kind} without one: send the request without it",
                param="instruction",
            )
        instruction = DEFAULT_INSTRUCTION if instruction is None else instruction
        limit = self._model.settings.n_batch
        # the query's part first (a query too long on its own is the query's fault)
        head, query_tokens = await trio.to_thread.run_sync(self._head, query, instruction)
        fixed = (
            len(head) + len(self._tail) if self._template is not None else len(self._pair([], query_tokens))
        )
        if fixed >= limit:
            raise InvalidRequestError(
                f"the query makes {fixed} tokens of every pair with a document; a pair may "
                f"have at most {limit} (the batch size): shorten the query, or raise --batch-size",
                param="query",
                code="query_too_long",
            )
        # then the documents, a few at a time (each step a checkpoint: a cancel stops
        # it; the total is checked as it grows, so a too-large request stops early)
        items: list[list[int]] = []
        total = len(head)
        step = 32
        for start in range(0, len(documents), step):
            chunk = list(documents[start : start + step])
            made = await trio.to_thread.run_sync(self._items, chunk, query, query_tokens, max_tokens_per_doc)
            for i, item in enumerate(made, start):
                if len(head) + len(item) > limit:
                    raise InvalidRequestError(
                        f"documents[{i}] with the query makes {len(head) + len(item)} tokens; "
                        f"a pair may have at most {limit} (the batch size: it is scored in one "
                        "evaluation): shorten it, send max_tokens_per_doc, or raise --batch-size",
                        param=f"documents[{i}]",
                        code="document_too_long",
                    )
                if not item:
                    raise InvalidRequestError(
                        f"documents[{i}] holds no token", param=f"documents[{i}]", code="empty_document"
                    )
                total += len(item)
                if max_tokens is not None and total > max_tokens:
                    raise InvalidRequestError(
                        f"the query and documents hold more than {max_tokens} tokens together (past it at "
                        f"documents[{i}]; --max-embedding-tokens): send fewer or shorter documents "
                        "per request",
                        param="documents",
                        code="too_many_tokens",
                    )
            items.extend(made)
        if self.kind == "cross-encoder":
            outputs = await self._runner.run(lambda context: context.embed(items))
            return Ranking(
                scores=[row[0] for row in outputs],
                prompt_tokens=total,
                kind="cross-encoder",
                score=self.score,
            )
        scores, prefix_evaluated = await self._runner.run(lambda context: context.rank(head, items))
        return Ranking(
            scores=scores,
            prompt_tokens=total - len(head) + prefix_evaluated,
            kind="yes-no",
            score="probability",
            prefix_tokens=prefix_evaluated,
        )

    def _head(self, query: str, instruction: str) -> tuple[list[int], list[int]]:
        """``(the shared prefix's tokens — none for a cross-encoder —, the query's
        tokens as a pair holds them)``. Blocking: a worker thread."""
        model = self._model
        if self._template is None:
            return [], model.tokenize(query, add_bos=False, parse_special=False)
        head = [model.bos] if model.pair_flags()["add_bos"] and model.bos >= 0 else []
        for text, template in self._template.prefix_segments(query, instruction):
            head += model.tokenize(text, add_bos=False, parse_special=template)
        return head, []

    def _pair(self, document: list[int], query_tokens: list[int]) -> list[int]:
        return pair_tokens(query_tokens, document, **self._flags)

    def _items(
        self, documents: list[str], query: str, query_tokens: list[int], cut: int | None
    ) -> list[list[int]]:
        """Each document's tokens after the prefix (a yes/no reranker), or its whole
        pair (a cross-encoder). Blocking: a worker thread."""
        model = self._model

        def text(value: str) -> list[int]:  # user text: special tokens are text
            tokens = model.tokenize(value, add_bos=False, parse_special=False)
            return tokens[:cut] if cut is not None else tokens

        if self._template is not None:
            return [text(document) + self._tail for document in documents]
        if self._pair_template is not None:
            # (as llama-server: the filled template tokenized whole, specials read)
            if cut is not None:
                documents = [
                    model.detokenize(text(document)).decode(errors="replace") for document in documents
                ]
            return [
                model.tokenize(
                    templated_pair(self._pair_template, query, document), add_bos=False, parse_special=True
                )
                for document in documents
            ]
        return [self._pair(text(document), query_tokens) for document in documents]

    def free(self) -> None:
        if self._runner is not None:
            self._runner.free()
