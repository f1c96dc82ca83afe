"""The llama.cpp backend's face (:class:`LlamaBackend`): many sequences, one context,
one ``llama_decode`` per step. It holds the loaded model (:class:`~._model.LlamaModel`:
vocabulary, tokenizer, ``prepare``, sampler chains) and owns what runs it: the serving
context and its scheduler thread, the embedding context; closing it frees those, then
the model.

Every admitted request runs as a sequence of one context (``n_seq_max = slots``,
non-unified KV cache: each sequence owns ``n_ctx`` cells), decoded by one scheduler
thread (:mod:`._loop`) that writes pieces straight into each request's
:class:`~trioserve._core._channel.PieceChannel` and never waits for Trio. Promises:

* **Cancellation.** A cancelled ``generate`` waits, shielded and bounded by one step,
  until its sequence is out of the batch with its KV cells cleared, then raises the
  request's ``Cancelled`` (never a :class:`BackendError`); the call in flight is aborted
  when the cancelled sequences own at least half of its tokens, and the other
  sequences' text does not change.
* **Backpressure.** A sequence whose channel is full is paused (left out of the steps)
  until its consumer makes room; the others go on. Nothing polls.
* **Batch invariance** (``batch_invariant=True``): every stream's text at temperature 0
  equals its text alone, whatever else runs.

Design, defaults and measurements: ``docs/batching.md``; the module map:
``docs/architecture.md``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from collections.abc import Sequence as Items
from typing import Literal, Self, Unpack

import trio

from ..._core._backend import GenerationProgress, PreparedPrompt, Ranking, RerankOptions
from ..._core._channel import PieceChannel
from ..._core._exceptions import InvalidRequestError
from ..._core._types import GenerationEnd
from .._cache import HostBudget, HostCache
from .._retrieval import Embedder, EmbeddingContext, Reranker
from ._facade import ModelFacade
from ._kv_memory import KvMemory
from ._loading import LoadControls, aload
from ._loop import Scheduler
from ._lora_loads import AdapterLoads
from ._model import LlamaModel
from ._settings import LlamaSettings
from ._stats import Snapshot, cache_stats, snapshot, speculation_stats
from ._submit import Submitter

__all__ = ["LlamaBackend"]

logger = logging.getLogger("trioserve.llama")


class _ModelsLoaded:
    """``LlamaBackend.loaded``: :attr:`LlamaModel.loaded`, the models loaded and not
    yet freed in this process (tests check that none leaks)."""

    def __get__(self, instance: object, owner: type | None = None) -> int:
        return LlamaModel.loaded


class LlamaBackend(ModelFacade):
    """llama.cpp inference: every running request is a sequence of one context, and
    one scheduler thread decodes them together (``docs/batching.md``).

    Create it with :meth:`load` / :meth:`aload` and :class:`LlamaSettings` (or from a
    loaded :class:`LlamaModel`, which it then owns). ``generations`` counts the
    generations inside the scheduler (submitted and not yet removed with their KV cells
    cleared): what a cancel must bring back to zero.

    Over 300 lines for one job, the face: it answers the :class:`Backend` interface's
    forty-odd members (loads, adapters, embeddings, reranking, ``/health``'s figures,
    the observables and test seams), each in a few lines handed to the part that does
    the work — the scheduler, the model, the embedder, the reranker, the adapter loads,
    a generation's :class:`~._submit.Submitter`.
    """

    #: models loaded and not yet freed, in this process (:attr:`LlamaModel.loaded`)
    loaded = _ModelsLoaded()
    #: a running sequence can be set aside (its state saved) and resumed
    pausable = True
    ends_reasoning = True

    def __init__(self, model: LlamaModel, *, host_cache: HostCache | None = None) -> None:
        """Create the contexts that run ``model`` (the warm-up and the measures of
        :mod:`._capabilities` included). Once created, the backend owns ``model``: its
        :meth:`close` frees it (if this raises, ``model`` is still the caller's to close,
        as :meth:`load` does). ``host_cache``: the prompt cache's host tier to start
        with (a registry entry's, which outlives an unload)."""
        #: the loaded model: vocabulary, tokenizer, prepare, sampler chains
        self.llama_model = model
        #: the prompt cache's host tier to use (a registry entry's, kept across loads)
        self._host_cache = host_cache
        self._closed = False
        # the embedding context: created on the first /v1/embeddings (docs/embeddings.md);
        # the scheduler takes its turns on the cores from it (CpuTurns)
        self._embedder: Embedder[EmbeddingContext] = Embedder(model, model.settings.pooling)
        self._scheduler = Scheduler(model, host_cache, self._embedder.turns)
        # reranking (docs/rerank.md): its context made on the first rerank, same turns
        self._reranker = Reranker(model, self._embedder.turns)
        # LoRA adapters loaded and unloaded at run time (docs/lora.md): llama.cpp's list
        # of a model's adapters changes under the cores' turn, between calls
        self._adapter_loads = AdapterLoads(model, self._embedder.turns.turn)
        # a request's generation: submitted to the scheduler thread and waited for
        self._submitter = Submitter(model, self._scheduler, self._adapter_loads, self.generations)

    # ----------------------------------------------------------------- loading

    @classmethod
    def load(
        cls, settings: LlamaSettings, *, host_cache: HostCache | None = None, **controls: Unpack[LoadControls]
    ) -> Self:
        """Load the model (:meth:`LlamaModel.load`) and create the contexts (blocking:
        seconds for big models).

        ``progress`` is called (in this thread) with llama.cpp's load progress, 0…1;
        once ``abort`` is set, llama.cpp stops reading and frees the partial model, and
        the phases after the weights (contexts, warm-up) are skipped:
        :class:`LoadAborted` is raised, nothing stays allocated. ``host_cache``: the
        prompt cache's host tier to start with (a registry entry's, which outlives an
        unload)."""
        model = LlamaModel.load(settings, **controls)
        try:
            model.check_abort()
            return cls(model, host_cache=host_cache)
        except BaseException:
            model.close()
            raise

    @classmethod
    async def aload(
        cls,
        settings: LlamaSettings,
        *,
        progress: Callable[[float], None] | None = None,
        host_cache: HostCache | None = None,
    ) -> Self:
        """:meth:`load` in a worker thread (:func:`._loading.aload`: a cancel aborts it,
        and nothing stays allocated)."""
        # (through the class: a subclass or a test may wrap its load)
        return await aload(
            lambda abort: cls.load(settings, progress=progress, abort=abort, host_cache=host_cache),
            settings.model_path,
        )

    async def aclose(self) -> None:
        await trio.to_thread.run_sync(self.close)

    def close(self) -> None:
        """Free the contexts, then the model (blocking; a second call does nothing)."""
        self._free()

    def _free(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._release_contexts()
        self.llama_model.close()

    # ---------------------------------------------------------- LoRA adapters

    @property
    def adapter_loads(self) -> AdapterLoads:
        """Run-time loads and unloads of its LoRA adapters (docs/lora.md)."""
        return self._adapter_loads

    async def load_adapter(
        self, name: str, path: str, *, scale: float = 1.0, check_room: Callable[[int], None] | None = None
    ) -> None:
        await self._adapter_loads.load(name, path, scale, check_room=check_room)

    async def unload_adapter(self, name: str) -> None:
        await self._adapter_loads.unload(name)

    def set_adapter_scales(self, scales: Items[tuple[int, float]]) -> None:
        self._adapter_loads.set_scales(scales)

    @property
    def adapter_bytes(self) -> int:
        return self.llama_model.adapters.hot_bytes

    # ---------------------------------------------------------- the contexts

    @property
    def embedding_size(self) -> int | None:
        return self.llama_model.n_embd

    @property
    def embedder(self) -> Embedder[EmbeddingContext]:
        return self._embedder

    async def embed(self, inputs: Items[Items[int]]) -> list[list[float]]:
        n_vocab = self.llama_model.n_vocab
        for i, item in enumerate(inputs):
            bad = [t for t in item if not 0 <= t < n_vocab]
            if bad:
                raise InvalidRequestError(
                    f"input[{i}] holds {bad[0]}, which is not a token id of this model: its ids are 0 to "
                    f"{n_vocab - 1}",
                    param="input",
                )
        return await self._embedder.embed(inputs)

    @property
    def reranker(self) -> Reranker:
        return self._reranker

    async def rerank(self, query: str, documents: Items[str], **options: Unpack[RerankOptions]) -> Ranking:
        return await self._reranker.rerank(query, documents, **options)

    @property
    def max_call_width(self) -> int:
        """The widest ``llama_decode`` call (sequences) the scheduler makes."""
        return self._scheduler.capabilities.max_call_width

    @property
    def steps(self) -> int:
        return self._scheduler.steps

    @property
    def aborted_calls(self) -> int:
        """Decode calls stopped by the abort flag (a cancel that owned most of a call)."""
        return self._scheduler.aborted_calls

    def in_flight(self, progress: GenerationProgress) -> Literal["prefill", "decode"] | None:
        """What the ``llama_decode`` call running right now does for the generation
        whose counters are ``progress``: evaluate a prompt chunk, decode a token, or
        nothing (between calls, paused, queued). An observable for tests and tools that
        must act while a request is inside llama.cpp."""
        return self._scheduler.inbox.in_flight_phase(progress)

    def rows_in_flight(self, progress: GenerationProgress) -> int:
        """Rows of the call in flight for this generation: more than one while decoding
        is a speculative verify call or a padded step (``--speculate exact``:
        docs/speculation.md). An observable for tests."""
        return self._scheduler.inbox.rows_in_flight(progress)

    @property
    def failure(self) -> BaseException | None:
        """Why the scheduler thread stopped serving, if it failed (then every request
        fails and ``/health`` says so)."""
        return self._scheduler.inbox.failure

    def cache_stats(self) -> dict[str, object]:
        """The prompt cache: the cut, and the prompt tokens each idle sequence keeps."""
        return cache_stats(self._scheduler).as_dict()

    @property
    def host_pool(self) -> HostBudget:
        """The host-memory budget its prompt cache's host tier is under (shared with the
        server's other models when a registry entry loaded it): ``/metrics`` reads it."""
        return self._scheduler.host.pool

    def platform(self) -> dict[str, object]:
        """For ``/health``: llama.cpp's system info, and whether weights are repacked."""
        return {
            "system_info": self.system_info,
            "repack": self.repack.to_dict() if self.repack is not None else None,
        }

    def stats(self) -> dict[str, object]:
        """For ``/health``: the batch's shape and counters, and the prompt cache."""
        return {
            "cache": self.cache_stats(),
            "kv_cache": self.kv_memory.as_dict() if self.kv_memory is not None else None,
            "sequences": self.generations.running,
            "max_call_width": self.max_call_width,
            "shared_context_limit": self._scheduler.capabilities.shared_context_limit,
            "batch_invariant": self.settings.batch_invariant,
            "steps": self.steps,
            "aborted_calls": self.aborted_calls,
            "speculation": self.speculation_stats(),
            "vision": self.vision_stats(),
        }

    @property
    def kv_memory(self) -> KvMemory | None:
        """The generation context's KV cache: its bytes, K and V types, slots and cells
        per slot (``None``: a model whose cache has another layout)."""
        return self._scheduler.context.kv_memory

    def kv_usage(self) -> tuple[int, int]:
        """``(cells the running sequences hold, cells of every slot)``: the KV pressure a
        gateway's load poll reads (docs/deployment.md). Cells a free id keeps for the
        prompt cache are not counted: a new request takes them over."""
        inbox = self._scheduler.inbox
        with inbox.condition:
            used = sum(max(s.pos, s.prefilled) for s in inbox.active)
        settings = self.settings
        return used, settings.slots * settings.n_ctx

    def vision_stats(self) -> dict[str, object] | None:
        """The projector (docs/vision.md): its file, images encoded, encodes a cancel
        stopped; ``None`` for a model that takes no images."""
        projector = self.llama_model.projector
        if projector is None:
            return None
        return {
            "projector": str(projector.path),
            "encodes": projector.encodes,
            "aborted_encodes": projector.aborted_encodes,
        }

    def speculation_stats(self) -> dict[str, object]:
        """Speculative decoding (docs/speculation.md): the mode, the verify call's measured
        width and context limit, and the guessed tokens verified and accepted."""
        return speculation_stats(self._scheduler)

    # ---------------------------------------------------------- observables

    def snapshot(self) -> Snapshot:
        """The scheduler's state now, as a frozen record (taken under its lock): what
        tests and tools read instead of private attributes."""
        return snapshot(self._scheduler)

    @property
    def host_tier(self) -> HostCache:
        """The prompt cache's host-memory tier (``--cache-ram``): its entries, counters
        and sliding window."""
        return self._scheduler.host

    @property
    def idle_recompute(self) -> bool:
        """Whether finished conversations are recomputed while idle (tests turn it off)."""
        return self._scheduler.policy.idle_recompute

    @idle_recompute.setter
    def idle_recompute(self, value: bool) -> None:
        self._scheduler.policy.idle_recompute = value

    def last_cell(self, seq_id: int) -> int:
        """The highest position sequence ``seq_id``'s KV cells hold (-1: none): whether
        a request left cells behind (``llama_memory_seq_pos_max``)."""
        return int(self.lib.llama_memory_seq_pos_max(self._scheduler.context.memory, seq_id))

    # ------------------------------------------------------------ test seams

    def clear_cache(self) -> None:
        """Test seam: drop what every free sequence id caches and empty the host tier,
        so the next request starts from nothing cached. (Not while requests run.)"""
        scheduler = self._scheduler
        for seq_id in scheduler.inbox.cells.free:
            scheduler.kv.forget(seq_id)
        scheduler.host.clear()

    def inject_fault(self, prepare: Callable[[], None] | None) -> None:
        """Test seam: ``prepare`` is called on the scheduler thread before each admitted
        sequence's cached prefix is prepared; what it raises fails that sequence alone
        (as a failed save or restore would). ``None`` removes it."""
        self._scheduler.membership.prepare_fault = prepare

    def simulate_failure(self, failure: BaseException | None) -> None:
        """Test seam: record ``failure`` as the scheduler thread's, as it does when it
        dies (``/health`` turns 503, requests are refused); ``None`` clears it."""
        with self._scheduler.inbox.condition:
            self._scheduler.inbox.failure = failure

    def _stop_scheduler(self) -> None:
        thread = self._scheduler.inbox.stop()
        if thread is not None:
            thread.join()

    def _release_contexts(self) -> None:
        self._stop_scheduler()
        host = self._scheduler.host
        kept = self._host_cache is not None and host is self._host_cache
        if kept or host.disk is not None:
            # every id's cached prefix: to host memory (a registry entry's tier, which
            # outlives the unload) and to the disk tier (which outlives the process)
            saved = self._scheduler.kv.spill()
            if kept:
                # its entries go first when another model's need the shared budget
                host.active = False
            if saved:
                logger.info("kept %d cached prefix(es) for the next load", saved)
        if host.disk is not None and not host.disk.store.flush(timeout=120):
            logger.warning("the disk cache's writes did not finish within 120 s; some prefixes are not kept")
        self._scheduler.context.free(self.llama_model.lib)
        self._embedder.free()
        self._reranker.free()

    async def generate(
        self, prompt: PreparedPrompt, channel: PieceChannel, progress: GenerationProgress
    ) -> GenerationEnd:
        return await self._submitter.generate(prompt, channel, progress)
