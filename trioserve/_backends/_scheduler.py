"""The llama.cpp backend: many sequences, one context, one ``llama_decode`` per step.

:class:`LlamaBackend` runs every admitted request as a sequence of one context (``n_seq_max
= slots``, non-unified KV cache: each sequence owns ``n_ctx`` cells), decoded by one
scheduler thread that writes pieces straight into each request's
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

Design, defaults and measurements: ``docs/batching.md``.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Literal

import trio

from .._core._backend import ChoiceGroup, GenerationProgress, PreparedPrompt
from .._core._channel import PieceChannel
from .._core._exceptions import BackendError, InvalidRequestError
from .._core._types import GenerationEnd
from ._cache_policy import CachePolicy, CacheStats, next_cut
from ._draw import LogitBias, draw, draw_special
from ._embeddings import Embedder
from ._grammar import TokenMask
from ._llama import LlamaModel, _Context
from ._memory import StateBuffer, trim_heap
from ._pieces import PieceRule
from ._prompt_cache import HostBudget, HostCache
from ._speculation import FAST_DRAFT, MAX_DRAFT, SHORTEST_DRAFT, SPLIT_KV_CONTEXT, Drafter, SpeculationStats
from ._warmup import probe_invariance, probe_speculation, warm_up

__all__ = ["LlamaBackend"]

logger = logging.getLogger("trioserve.llama")

_DECODE_ABORTED = 2

#: the result of a sequence dropped because its request was cancelled
_CANCELLED: Literal["cancelled"] = "cancelled"


class _Sequence:
    """One request inside the batch. Fields are written by one side only:

    * Trio side: ``cancelled``;
    * scheduler thread: everything else until it hands the sequence back.
    """

    __slots__ = (
        "bias",
        "cache_prompt",
        "cancelled",
        "channel",
        "checkpoint",
        "choice",
        "cuts",
        "draft",
        "drafter",
        "first_chunk_at",
        "followers",
        "generated",
        "generated_tokens",
        "greedy",
        "group",
        "leader",
        "logprobs",
        "mask",
        "max_new",
        "next_token",
        "pos",
        "prefilled",
        "progress",
        "prompt",
        "removed",
        "restore",
        "result",
        "salt",
        "sampler",
        "save",
        "save_salt",
        "seq_id",
        "special",
        "speculate",
        "token",
    )

    def __init__(
        self,
        prompt: PreparedPrompt,
        progress: GenerationProgress,
        sampler: Any,
        channel: PieceChannel,
        bias: LogitBias | None = None,
    ) -> None:
        tokens = prompt.tokens
        self.prompt: list[int] = tokens if isinstance(tokens, list) else list(tokens)
        self.max_new = prompt.max_new_tokens
        self.cache_prompt = prompt.request.cache_prompt
        #: only cells of the same salt are reused (``GenerationRequest.cache_salt``)
        self.salt = prompt.request.cache_salt
        self.progress = progress
        progress.piece_per_token = True  # _emit: one piece per token drawn
        self.sampler = sampler
        #: plain greedy (temperature 0, no logit bias): the scheduler takes the argmax of
        #: the logits itself — the token llama.cpp's greedy sampler picks (the first
        #: maximum), without building its 262,144-entry candidate array per token
        sampling = prompt.request.sampling
        self.greedy = sampling.plain_greedy
        #: the logit bias as arrays (made once per request: ``LlamaModel.prepare``), for
        #: the log-probabilities' distribution (the sampler chain has its own copy)
        self.bias = bias
        #: constrained decoding: the mask applied to the logits before each draw
        self.mask: TokenMask | None = None
        compiled = prompt.compiled
        if isinstance(compiled, TokenMask):
            # a copy: the compiled mask stays fresh for the other choices (and for a
            # prepared prompt streamed again)
            self.mask = compiled.copy()
        #: report log-probabilities (and this many alternatives)
        self.logprobs = prompt.request.logprobs
        #: needs the slow path per token: a mask, or log-probabilities
        self.special = self.mask is not None or self.logprobs is not None
        #: ``n`` > 1: the request's choices; a follower waits for its leader's prompt
        #: evaluation and starts from a copy of its cells
        self.group: ChoiceGroup | None = prompt.group
        self.choice = prompt.choice
        self.leader: _Sequence | None = None
        self.followers: list[_Sequence] = []
        self.token = trio.lowlevel.current_trio_token()
        self.channel = channel
        self.removed = trio.Event()
        self.result: GenerationEnd | Literal["cancelled"] | BaseException | None = None
        self.cancelled = False
        self.seq_id = -1
        self.prefilled = 0
        #: where the canonical rule cuts the prompt (``_pieces.PieceRule``), set at admission
        self.cuts: list[int] = []
        self.pos = 0
        self.generated = 0
        #: the tokens generated so far (the reply, for the idle recompute of its chunks)
        self.generated_tokens: list[int] = []
        self.next_token = -1
        self.first_chunk_at = 0.0
        #: admission's plan, carried out by the scheduler thread before the first chunk:
        #: the cached prefix to save to host memory before it is overwritten, and the
        #: host-memory state to restore
        self.save: list[int] | None = None
        self.save_salt = ""
        self.checkpoint = 0
        self.restore: StateBuffer | bytes | None = None
        #: speculative decoding (docs/speculation.md): every draw, greedy or sampled. A
        #: guess is accepted when the row's own draw (argmax, or the request's sampler
        #: chain, advanced token by token) equals it: for a draft that is one token per
        #: position, this is the standard acceptance rule (accept with probability
        #: p(guess), else draw from p without the guess), and it consumes the sampler's
        #: random numbers as a one-token step does: a seeded text is unchanged
        self.speculate = prompt.request.speculate
        self.drafter: Drafter | None = None
        #: the tokens guessed for the decode call being planned or in flight
        self.draft: list[int] = []

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.prompt)


def _split(decoders: list[_Sequence], width: int) -> list[list[_Sequence]]:
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


def _hand_back(sequence: _Sequence) -> None:
    """Tell the request that the scheduler is done with ``sequence`` (after its last
    piece: the channel keeps their order)."""
    try:
        sequence.token.run_sync_soon(sequence.removed.set)
    except trio.RunFinishedError:  # pragma: no cover - its run ended without waiting
        logger.warning("a sequence outlived its Trio run")


def _seq_id(sequence: _Sequence) -> int:
    return sequence.seq_id


class _Scheduler:
    """The thread that owns the context: admits, batches, decodes, samples, removes.

    It makes every llama.cpp call and holds the lock; the prompt cache's decisions are
    :class:`~._cache_policy.CachePolicy`'s, a token's draw is :mod:`._draw`'s, and the
    checks at load are :mod:`._warmup`'s."""

    def __init__(self, backend: LlamaBackend) -> None:
        self._backend = backend
        settings = backend.settings
        self.context = _Context(backend, sequences=settings.slots)
        self.ctx = self.context.ctx
        self.memory = self.context.memory
        self.batch = self.context.batch
        self.abort_flag = self.context.abort_flag
        self._condition = threading.Condition()
        self._inbox: deque[_Sequence] = deque()
        #: a sequence ended since the heap was last trimmed (_memory.trim_heap, when idle)
        self._trim_due = False
        self.heap_trims = 0
        self._active: list[_Sequence] = []
        #: out of the inbox, not yet active: being given their ids and cached prefixes
        self._admitting: list[_Sequence] = []
        self._free_ids = list(range(settings.slots))
        self.chunk = settings.prefill_chunk  # (the longest piece of the canonical cut)
        self.rule: PieceRule = backend.piece_rule
        lib = backend.lib
        #: recurrent and hybrid models (Mamba, RWKV, Granite-4-H, LFM2, Jamba…) refuse to
        #: remove part of a sequence's state (``llama_memory_seq_rm`` returns false): no
        #: partial reuse, no idle recompute, no shared prompt for n > 1, and a decode call
        #: is aborted only when every sequence in it is cancelled (docs/prompt-cache.md)
        self.partial_removal = not (
            lib.llama_model_is_recurrent(backend.model) or lib.llama_model_is_hybrid(backend.model)
        )
        if not self.partial_removal:
            logger.info(
                "a recurrent or hybrid model: the prompt cache, idle recompute and shared prompts "
                "for n > 1 are off (llama.cpp cannot remove part of its state)"
            )
        self.cache_enabled = settings.prompt_cache and self.partial_removal
        #: ``fast`` mode: keep and reuse every computed cell (the reply too, any matching
        #: length), as llama-server does — not exact (docs/prompt-cache.md)
        self.fast = settings.cache_mode == "fast"
        #: what the host tier is indexed by: the rule's cuts, or (fast) every token
        host_rule = "token" if self.fast else self.rule.key
        #: measured on the first prefix kept (``llama_state_seq_get_size``), for the gauge
        self.kv_bytes_per_token = 0.0
        #: prefixes evicted from KV cells, in host memory (``--cache-ram``)
        given = backend._host_cache
        if given is not None and given.rule == host_rule and self.cache_enabled:
            given.budget = settings.cache_ram_bytes
            given.active = True  # (an unloaded model's entries are the first to go)
            given.shrink()
            # a registry entry's: what the model cached before an unload, under the
            # server's one budget (HostBudget)
            self.host = given
        else:
            budget = settings.cache_ram_bytes if self.cache_enabled else 0
            self.host = HostCache(budget, rule=host_rule)
        #: the sliding attention window: a saved state keeps only its last cells
        self.host.window = max(0, int(lib.llama_model_n_swa(backend.model)))
        self.restore_seconds = 0.0
        self.save_seconds = 0.0
        #: the prompt cache (docs/prompt-cache.md): what each sequence id keeps, and the
        #: decisions made on it, are the policy's; the cells and llama.cpp calls are here.
        #: Idle recompute: a finished conversation's pieces past its cached prompt are
        #: evaluated while nothing else runs (the policy remembers the conversations)
        self.policy = CachePolicy(
            settings.slots,
            rule=self.rule,
            host=self.host,
            enabled=self.cache_enabled,
            fast=self.fast,
            idle_recompute=self.cache_enabled and settings.idle_recompute and not self.fast,
        )
        self._idle_in_flight = False
        #: the tokens the idle recompute's call in flight completes (prefix included)
        self._idle_tokens: list[int] = []
        self._idle_salt = ""
        self.idle_chunks = 0
        self.idle_tokens = 0
        self.idle_aborted = 0
        #: the sequences of the llama_decode call in flight, with their token counts
        self._in_flight: dict[_Sequence, int] = {}
        self._in_flight_tokens = 0
        self._stopping = False
        self._thread: threading.Thread | None = None
        #: why the thread stopped serving, if it failed
        self.failure: BaseException | None = None
        self.steps = 0
        self.aborted_calls = 0
        #: widest decode call whose numerics equal a lone sequence's (batch-invariant mode)
        self.max_call_width = settings.slots
        #: batch-invariant mode: a sequence whose context (cells, the token being decoded
        #: included) is longer than this decodes in a call of its own
        self.shared_context_limit = settings.n_ctx
        if settings.warm_up:
            try:
                backend.check_abort()
                warm_up(backend, self.context)
            except BaseException:
                self.context.free(backend.lib)
                raise
        #: speculative decoding (docs/speculation.md): the widest verify call (rows: the
        #: token being decoded and its drafts; 1: no speculation), and the longest
        #: context (cells) a verify call may reach ("auto": past it, a lone one-row step
        #: takes flash attention's split-KV path, which no call of two rows takes)
        self.speculation = settings.speculate if self.partial_removal else "off"
        self.spec_stats = SpeculationStats()
        self.verify_width = 1
        self.verify_context_limit = settings.n_ctx
        if self.speculation == "fast":
            self.verify_width = min(1 + FAST_DRAFT, settings.n_batch)
        elif self.speculation == "auto":
            started = time.perf_counter()
            try:
                self.verify_width = probe_speculation(backend, self.context, 1 + MAX_DRAFT)
            except BaseException:
                self.context.free(backend.lib)
                raise
            if self.verify_width < 1 + SHORTEST_DRAFT:
                self.verify_width = 1  # (a single guess per call cannot pay for its row)
            if settings.n_threads > 1:
                self.verify_context_limit = min(settings.n_ctx, SPLIT_KV_CONTEXT)
            logger.info(
                "speculative decoding (auto, exact): verify calls of at most %d rows, while a context "
                "is at most %d tokens (measured in %.0f ms)",
                self.verify_width,
                self.verify_context_limit,
                (time.perf_counter() - started) * 1000,
            )
        if settings.batch_invariant:
            try:
                self.max_call_width, self.shared_context_limit = probe_invariance(backend, self.context)
            except BaseException:
                self.context.free(backend.lib)
                raise
            logger.info(
                "batch-invariant mode: decode calls of at most %d sequences, shared while a "
                "context is at most %d tokens",
                self.max_call_width,
                self.shared_context_limit,
            )

    @property
    def idle_recompute(self) -> bool:
        """Whether finished conversations are recomputed while idle (the policy's switch:
        tests turn it off)."""
        return self.policy.idle_recompute

    @idle_recompute.setter
    def idle_recompute(self, value: bool) -> None:
        self.policy.idle_recompute = value

    @property
    def _cached(self) -> list[list[int]]:
        """Per sequence id, the prompt tokens its cells keep (the policy's; tests read it)."""
        return self.policy._cached

    @property
    def _history(self) -> dict[int, tuple[list[int], list[int]]]:
        """The conversations the idle recompute has pieces left of (the policy's; tests
        read it)."""
        return self.policy._history

    # ------------------------------------------------------------ Trio side

    def submit(self, sequence: _Sequence) -> None:
        with self._condition:  # (the thread sets failure and _stopping under this lock)
            if self.failure is not None:
                raise BackendError(f"the batch scheduler has failed: {self.failure}")
            if self._stopping:
                raise BackendError("the backend is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="trioserve-batch", daemon=True)
                self._thread.start()
            self._inbox.append(sequence)
            if self._idle_in_flight and not self._continues_idle_work(sequence):
                self.abort_flag.value = 1  # idle work never delays a request
            self._condition.notify()

    def _continues_idle_work(self, sequence: _Sequence) -> bool:
        """Whether ``sequence``'s prompt starts with the piece being recomputed (the next
        turn of that conversation, sent at once): that call is the request's own first
        piece, so it goes on instead of being aborted and evaluated again. (Under the
        lock; only while nothing else is queued.)"""
        tokens = self._idle_tokens
        prompt = sequence.prompt
        return (
            len(self._inbox) == 1
            and sequence.cache_prompt
            and sequence.salt == self._idle_salt
            and len(prompt) > len(tokens)
            and prompt[: len(tokens)] == tokens
        )

    def cancel(self, sequence: _Sequence) -> None:
        """Ask the scheduler to drop ``sequence``; abort the call in flight if most of
        its work is for cancelled sequences."""
        with self._condition:
            sequence.cancelled = True
            if self._idle_in_flight:
                self.abort_flag.value = 1
            if sequence in self._in_flight:
                wasted = sum(n for s, n in self._in_flight.items() if s.cancelled)
                # (without partial removal, the survivors of an aborted call could not
                # be rolled back: abort only a call that is all waste)
                needed = (
                    self._in_flight_tokens if not self.partial_removal else (self._in_flight_tokens + 1) // 2
                )
                if wasted >= needed:
                    self.abort_flag.value = 1
            self._condition.notify()

    def wake(self) -> None:
        with self._condition:
            if self._idle_in_flight:
                self.abort_flag.value = 1  # a paused stream may run again
            self._condition.notify()

    def in_flight(self, progress: GenerationProgress) -> Literal["prefill", "decode"] | None:
        """What the ``llama_decode`` call running now does for the generation whose
        counters are ``progress`` (``LlamaBackend.in_flight``)."""
        for sequence in list(self._in_flight):
            if sequence.progress is progress:
                return "decode" if sequence.decoding else "prefill"
        return None

    def rows_in_flight(self, progress: GenerationProgress) -> int:
        """The rows of the ``llama_decode`` call running now that belong to the
        generation whose counters are ``progress`` (a speculative verify call: more than
        one while decoding); 0 if it has none in flight."""
        with self._condition:
            for sequence, rows in self._in_flight.items():
                if sequence.progress is progress:
                    return rows
        return 0

    def cache_stats(self) -> CacheStats:
        """The prompt cache now: what each idle id keeps (read under the lock), the host
        tier and the idle recompute."""
        with self._condition:
            held = self.policy.held(self._free_ids)
        host = self.host
        return CacheStats(
            enabled=self.cache_enabled,
            fast=self.fast,
            chunk=self.chunk,
            piece_rule=self.rule.kind,
            sequences=tuple(held),
            kv_bytes_per_token=self.kv_bytes_per_token,
            ram_budget_bytes=host.budget,
            ram_bytes=host.bytes,
            ram_prefixes=len(host),
            ram_saves=host.saves,
            ram_restores=host.restores,
            ram_evictions=host.evictions,
            ram_shared_bytes=host.pool.bytes,
            ram_shared_budget_bytes=host.pool.budget,
            ram_shared_models=host.pool.tiers,
            save_seconds=self.save_seconds,
            restore_seconds=self.restore_seconds,
            idle_recompute=self.idle_recompute,
            idle_chunks=self.idle_chunks,
            idle_tokens=self.idle_tokens,
            idle_aborted=self.idle_aborted,
            idle_pending=self.policy.pending,
        )

    def stop(self) -> threading.Thread | None:
        with self._condition:
            self._stopping = True
            self.abort_flag.value = 1
            self._condition.notify()
        return self._thread

    def free(self) -> None:
        self.context.free(self._backend.lib)

    def spill(self) -> int:
        """Before the context is freed (the thread has stopped): save every id's cached
        prefix to the host tier, so that a registry entry loaded again restores it
        (docs/models.md). Returns the prefixes saved."""
        if not self.host.budget:
            return 0
        policy = self.policy
        saved = 0
        # the most recently used last: the host tier keeps the newest when it is full
        for seq_id in policy.spill_order():
            tokens = policy.cached(seq_id)
            if not policy.savable(seq_id):
                continue
            checkpoint = policy.checkpoint(seq_id)
            salt = policy.salt(seq_id)
            try:
                if not policy.host_covers(tokens, salt) and self._save_state(seq_id, tokens, salt):
                    saved += 1
                # (the context is freed next: its cells may go)
                if checkpoint and self._trim(seq_id, checkpoint) == checkpoint:
                    saved += self._save_state(seq_id, tokens[:checkpoint], salt)
            except Exception:  # an optimisation: without it, the prompt is evaluated again
                logger.exception("could not save a cached prefix at unload; it is dropped")
        return saved

    # ------------------------------------------------------- scheduler thread

    def _next_admission(self, free: int | None = None) -> list[_Sequence] | None:
        """The sequences admissible now, in order: the inbox's head, or — for a group
        (``n`` > 1) — all its choices, once they have all arrived and as many ids are
        free (``free``: the ids not yet promised). (Called under the lock.)"""
        if free is None:
            free = len(self._free_ids)
        if not self._inbox or not free:
            return None
        head = self._inbox[0]
        group = head.group
        if group is None:
            return [head]
        members = sorted((s for s in self._inbox if s.group is group), key=_choice)
        if len(members) < group.size or len(members) > free:
            return None  # the others are being submitted, or ids are still busy
        return members

    def _runnable(self) -> bool:
        if any(s.cancelled for s in self._inbox) or self._next_admission() is not None:
            return True
        for sequence in self._active:
            if sequence.cancelled or (not sequence.decoding and sequence.leader is None):
                return True
            if sequence.decoding and sequence.channel.room > 0:
                return True
        return False

    def _run(self) -> None:
        try:
            while True:
                if self._trim_due and not self._active and not self._inbox:
                    # idle after sequences ended: the freed pages of every malloc arena
                    # go back to the system (_memory.py), never on the per-token path
                    self._trim_due = False
                    trim_heap()
                    self.heap_trims += 1
                with self._condition:
                    while not self._stopping and not self._runnable():
                        if self.policy.pending and not self._active and not self._inbox:
                            # no request at all (a paused stream counts: its client
                            # reads on): recompute a finished reply
                            break
                        self._condition.wait()
                    if self._stopping:
                        break
                    idle = not self._runnable()
                    # cancelled before it got a sequence id: nothing to clear
                    gone = [s for s in self._inbox if s.cancelled]
                    for sequence in gone:
                        self._inbox.remove(sequence)
                        if sequence.group is not None:
                            sequence.group.size -= 1  # the others need not wait for it
                    # Take the admissible sequences out of the inbox; their prefix
                    # matching runs after the lock is released (the Trio thread takes
                    # it in submit, cancel, wake and every /health or /metrics read).
                    groups: list[list[_Sequence]] = []
                    free = len(self._free_ids)
                    while (members := self._next_admission(free)) is not None:
                        for sequence in members:
                            self._inbox.remove(sequence)
                            self._admitting.append(sequence)  # (handed back at exit, if it comes to that)
                        free -= len(members)
                        groups.append(members)
                for sequence in gone:
                    self._remove(sequence, _CANCELLED)
                admitted = self._admit(groups)
                for sequence in admitted:
                    if sequence.result is None:  # (not failed at admission)
                        self._contained(self._prepare_cells, sequence, "preparing its cached prefix")
                if idle:
                    self._recompute_safely()
                else:
                    self._step()
        except BaseException as exc:  # pragma: no cover - a bug in the loop itself
            logger.exception("the batch scheduler failed")
            with self._condition:
                self.failure = exc
        finally:
            failure = self.failure or BackendError("the server is shutting down")
            with self._condition:
                self._stopping = True  # nothing submitted from now on is left unserved
                leaving = self._active + list(self._inbox)
                leaving += [s for s in self._admitting if s not in leaving and s.result is None]
                self._active = []
                self._inbox.clear()
                self._admitting = []
            for sequence in leaving:
                try:
                    self._remove(sequence, failure)
                except BaseException:  # pragma: no cover - _remove hands back in any case
                    logger.exception("could not release a sequence at shutdown")

    def _admit(self, groups: list[list[_Sequence]]) -> list[_Sequence]:
        """Give each admitted sequence its id and cached prefix (the plan is made outside
        the lock: only this thread writes the cache's bookkeeping; the commit is under
        it). A sequence whose admission fails fails alone."""
        admitted: list[_Sequence] = []
        for members in groups:
            leader = members[0]
            for sequence in members:
                shares = sequence is not leader and self.partial_removal and leader.result is None
                if shares:
                    ok = self._contained(self._assign_follower, sequence, "admission", leader)
                else:
                    ok = self._contained(self._assign, sequence, "admission")
                with self._condition:
                    if ok:
                        self._active.append(sequence)
                    self._admitting.remove(sequence)
                if ok:
                    admitted.append(sequence)
        return admitted

    def _contained(self, step: Any, sequence: _Sequence, what: str, *args: Any) -> bool:
        """Run ``step(sequence, *args)``; if it raises, only ``sequence`` fails (its
        cells cleared, its request told why) and the server goes on."""
        try:
            step(sequence, *args)
        except Exception as exc:
            logger.exception("a request failed in the scheduler (%s); the others go on", what)
            if sequence.result is None:
                self._remove(sequence, self._failed(sequence, f"inference failed while {what}: {exc!r}"))
            return False
        return True

    @staticmethod
    def _failed(sequence: _Sequence, message: str) -> BackendError | Literal["cancelled"]:
        """The result of a sequence that failed: a cancelled one (its client left, a stop
        sequence matched) is reported cancelled — a cancel is never an error."""
        return _CANCELLED if sequence.cancelled else BackendError(message)

    def _recompute_safely(self) -> None:
        try:
            self._recompute_chunk()
        except Exception:
            logger.exception("the idle recompute failed; its conversation is dropped from the cache")
            for seq_id in self.policy.drop_histories():
                if seq_id in self._free_ids:
                    self._forget(seq_id)

    def _forget(self, seq_id: int) -> None:
        """Drop what a free id caches: its cells and its bookkeeping."""
        self.policy.forget(seq_id)
        if not self._backend.lib.llama_memory_seq_rm(self.memory, seq_id, -1, -1):  # pragma: no cover
            logger.error("llama.cpp could not clear the cells of sequence %d", seq_id)

    def _trim(self, seq_id: int, keep: int) -> int:
        """Remove ``seq_id``'s cells from position ``keep`` on; the cells kept. Where
        llama.cpp refuses a partial removal (``llama_memory_seq_rm`` returns false:
        recurrent state), every cell goes and 0 is kept."""
        lib = self._backend.lib
        if keep > 0 and lib.llama_memory_seq_rm(self.memory, seq_id, keep, -1):
            return keep
        if keep > 0:
            logger.warning("llama.cpp refused to keep %d cells of sequence %d: clearing it", keep, seq_id)
        if not lib.llama_memory_seq_rm(self.memory, seq_id, -1, -1):
            raise BackendError(f"llama.cpp could not clear the cells of sequence {seq_id}")
        return 0

    def _assign(self, sequence: _Sequence) -> None:
        """Give ``sequence`` the free id whose cached prompt shares the longest prefix of
        whole chunks with its prompt (ties, and no prefix: the least recently used id),
        and start it after that prefix. The plan is computed without the lock; the
        commit takes it."""
        prompt = sequence.prompt
        sequence.cuts = cuts = self.rule.cuts(prompt)
        plan = self.policy.place(prompt, cuts, sequence.cache_prompt, list(self._free_ids), sequence.salt)
        with self._condition:
            self._free_ids.remove(plan.seq_id)
            # (the id's cells now belong to this sequence)
            self.policy.take(plan.seq_id, sequence.salt)
            sequence.seq_id = plan.seq_id
        sequence.save, sequence.restore = plan.save, plan.restore
        sequence.save_salt = plan.save_salt
        sequence.checkpoint = plan.checkpoint
        sequence.prefilled = sequence.pos = plan.reused
        sequence.progress.cached_tokens = sequence.progress.prefilled_tokens = plan.reused

    def _assign_follower(self, sequence: _Sequence, leader: _Sequence) -> None:
        """Give ``sequence`` (a later choice of ``leader``'s group) the least recently
        used free id; it gets a copy of the leader's cells once the prompt is evaluated."""
        plan = self.policy.place_follower(self._free_ids)
        with self._condition:
            self._free_ids.remove(plan.seq_id)
            self.policy.take(plan.seq_id, sequence.salt)
            sequence.seq_id = plan.seq_id
        if plan.save is not None:
            sequence.save, sequence.save_salt = plan.save, plan.save_salt
        sequence.cuts = leader.cuts if leader.cuts else self.rule.cuts(sequence.prompt)
        sequence.leader = leader
        leader.followers.append(sequence)

    def _prepare_cells(self, sequence: _Sequence) -> None:
        """Carry out admission's plan: save the prefix being overwritten to host memory,
        restore the one to reuse from it, drop the cells past the reused prefix."""
        lib = self._backend.lib
        seq_id = sequence.seq_id
        if sequence.save is not None:
            started = time.perf_counter()
            save, sequence.save = sequence.save, None
            checkpoint, sequence.checkpoint = sequence.checkpoint, 0
            try:
                self._save_state(seq_id, save, sequence.save_salt)
                if checkpoint:
                    # the prompt end too, which the longer state cannot give back
                    # (CachePolicy.checkpoint): its cells alone, then their state
                    if self._trim(seq_id, checkpoint) == checkpoint:
                        self._save_state(seq_id, save[:checkpoint], sequence.save_salt)
                    else:  # pragma: no cover - (partial removal is checked at load)
                        self._reuse(sequence, 0)
            except Exception:
                # the save is an optimisation: without it, a later turn evaluates again
                logger.exception("could not save a cached prefix to host memory; it is dropped")
            self.save_seconds += time.perf_counter() - started
        if sequence.restore is not None:
            started = time.perf_counter()
            state, sequence.restore = sequence.restore, None
            self._trim(seq_id, 0)
            buffer = (
                state.array
                if isinstance(state, StateBuffer)
                else (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
            )
            if not lib.llama_state_seq_set_data(self.ctx, buffer, len(state), seq_id):
                # pragma: no cover - llama.cpp refused the state: evaluate it all
                logger.warning("could not restore a cached prefix; evaluating the prompt")
                self._reuse(sequence, 0)
            elif lib.llama_memory_seq_pos_min(self.memory, seq_id) > self._window_floor(sequence.prefilled):
                # pragma: no cover - (planned against: HostCache.usable) the state lacks
                # window cells the rest of the prompt attends to
                logger.warning("a restored prefix lacks sliding-window cells; evaluating the prompt")
                self._reuse(sequence, 0)
            else:
                self.host.restores += 1
            self.restore_seconds += time.perf_counter() - started
        # the cells past the reused prefix go (the rest of the cached prompt)
        kept = self._trim(seq_id, sequence.prefilled)
        if kept != sequence.prefilled:
            self._reuse(sequence, kept)

    def _save_state(self, seq_id: int, tokens: list[int], salt: str) -> bool:
        """Keep the state of ``seq_id``'s cells (which hold ``tokens``, computed for
        requests of ``salt``) in host memory."""
        lib = self._backend.lib
        size = lib.llama_state_seq_get_size(self.ctx, seq_id)
        if size > self.host.budget:
            return False
        # in a mapping of its own, never the heap (_memory.py: given back when evicted)
        state = StateBuffer(size)
        state.used = written = lib.llama_state_seq_get_data(self.ctx, state.array, size, seq_id)
        if not written:
            return False
        floor = self._window_start(seq_id, len(tokens))
        return self.host.put(tokens, self.policy.host_cuts(tokens), state, floor=floor, salt=salt)

    def _window_start(self, seq_id: int, held: int) -> int:
        """The first position whose sliding-window cells ``seq_id`` holds, with ``held``
        cells (0 without a window). Cells set from a sequence state — a restore, a
        choice's copy of its leader's prompt — start where that state's window cells did."""
        if not self.host.window or not held:
            return 0
        start = int(self._backend.lib.llama_memory_seq_pos_min(self.memory, seq_id))
        return start if start >= 0 else held  # (no window cells at all: they serve nothing)

    def _window_floor(self, reused: int) -> int:
        """The lowest position the tokens after ``reused`` cached ones attend to."""
        window = self.host.window
        return max(0, reused - window + 1) if window else 0

    def _reuse(self, sequence: _Sequence, tokens: int) -> None:
        """Start ``sequence`` after ``tokens`` cached tokens (fewer than planned: a restore
        or a partial removal failed)."""
        if tokens == 0:
            self._trim(sequence.seq_id, 0)
        sequence.prefilled = sequence.pos = tokens
        sequence.progress.cached_tokens = sequence.progress.prefilled_tokens = tokens

    def _release(
        self, sequence: _Sequence, result: GenerationEnd | Literal["cancelled"] | BaseException
    ) -> None:
        """Take ``sequence`` out of the context: keep the cells of its whole prompt
        chunks for the cache and clear the rest (the reply, a partial chunk), free its
        id and sampler. The caller hands it back to Trio (``_hand_back``)."""
        lib = self._backend.lib
        self._trim_due = True
        if sequence in self._active:
            self._active.remove(sequence)
        for follower in sequence.followers:
            follower.leader = None  # its leader is gone before sharing: it evaluates the prompt itself
        sequence.followers = []
        if sequence.leader is not None and sequence in sequence.leader.followers:
            sequence.leader.followers.remove(sequence)
        if sequence.seq_id >= 0:
            seq_id = sequence.seq_id
            policy = self.policy
            # fast: every cell computed (the reply's too); exact: whole prompt pieces
            keep = policy.keep(
                cache_prompt=sequence.cache_prompt,
                failed=isinstance(result, BaseException),
                computed=sequence.pos,
                prefilled=sequence.prefilled,
                cuts=sequence.cuts,
            )
            policy.forget(seq_id)  # (until the cells below are known to be kept)
            keep = self._trim(seq_id, keep)
            if keep and not self.kv_bytes_per_token:
                self.kv_bytes_per_token = lib.llama_state_seq_get_size(self.ctx, seq_id) / keep
            policy.release(
                seq_id,
                sequence.prompt,
                sequence.generated_tokens,
                keep,
                finished=result == "stop" or result == "length",
                floor=self._window_start(seq_id, keep),
            )
            self._free_id(sequence)
        if sequence.sampler is not None:
            lib.llama_sampler_free(sequence.sampler)
            sequence.sampler = None
        sequence.result = result
        sequence.progress.inference_ended = time.perf_counter()

    def _free_id(self, sequence: _Sequence) -> None:
        if sequence.seq_id >= 0:
            with self._condition:
                if sequence.seq_id not in self._free_ids:
                    self._free_ids.append(sequence.seq_id)
                sequence.seq_id = -1

    def _remove(
        self, sequence: _Sequence, result: GenerationEnd | Literal["cancelled"] | BaseException
    ) -> None:
        try:
            self._release(sequence, result)
        except Exception:
            # the cache's bookkeeping failed (e.g. a MemoryError): this sequence's
            # cells are dropped and its id freed; the request still gets its result
            # (its text went out whole: only the cache lost it)
            logger.exception("could not keep a finished sequence's cells; they are dropped")
            if sequence in self._active:
                self._active.remove(sequence)
            if sequence.seq_id >= 0:
                try:
                    self._forget(sequence.seq_id)
                finally:
                    self._free_id(sequence)
            if sequence.sampler is not None:
                self._backend.lib.llama_sampler_free(sequence.sampler)
                sequence.sampler = None
            if sequence.result is None:
                sequence.result = result
            sequence.progress.inference_ended = time.perf_counter()
        finally:
            _hand_back(sequence)  # its request must never wait forever

    def _recompute_chunk(self) -> None:
        """While nothing else runs: evaluate the next piece of the most recently finished
        conversation (its reply, decoded a token at a time, is not reusable as it is).
        Aborted by any request or resumed stream (``submit``, ``wake``)."""
        lib = self._backend.lib
        job = self.policy.next_recompute()
        if job is None:  # (nothing left whole: done)
            return
        seq_id, history, start, end = job.seq_id, job.history, job.start, job.end
        chunk = end - start
        batch = self.batch
        for i in range(chunk):
            batch.token[i] = history[start + i]
            batch.pos[i] = start + i
            batch.seq_id[i][0] = seq_id
            batch.logits[i] = 0
        batch.n_tokens = chunk
        tokens = history[:end]
        with self._condition:
            if self._stopping or self._active or self._inbox:
                return
            self.abort_flag.value = 0
            self._idle_in_flight = True
            self._idle_tokens = tokens
            self._idle_salt = self.policy.salt(seq_id)
        with self._backend.embedder.turns.turn():  # the cores, shared with embeddings
            result = lib.llama_decode(self.ctx, batch)
        with self._condition:
            self._idle_in_flight = False
            self._idle_tokens = []
        if result != 0:
            if (
                self._trim(seq_id, start) != start
            ):  # pragma: no cover - (partial removal is always possible here)
                self._forget(seq_id)
            if result == _DECODE_ABORTED:
                self.idle_aborted += 1  # tried again when idle
            else:  # pragma: no cover - llama.cpp failed: leave this conversation
                self.policy.drop_history(seq_id)
            return
        self.idle_chunks += 1
        self.idle_tokens += chunk
        self.policy.recomputed(job)

    def _step(self) -> None:
        # 1. drop cancelled sequences
        active = self._active
        for sequence in [s for s in active if s.cancelled]:
            self._remove(sequence, _CANCELLED)
        # 2. plan the calls of this step
        decoders: list[_Sequence] = []
        prefillers: list[_Sequence] = []
        for s in active:
            if not s.decoding:
                if s.leader is None:  # (a follower waits for its leader's prompt)
                    prefillers.append(s)
            elif s.channel.room > 0:
                decoders.append(s)
            # else paused: its client is not reading; the consumer wakes us when it
            # takes pieces from the full channel (on_room)
        # Decode calls list their sequences in seq-id order: llama.cpp splits a
        # multi-sequence batch into equal-length ubatches, and out-of-order ids cost a
        # second graph run (measured: 89 ms instead of 43 ms per step for 8 sequences).
        # A prompt chunk gets a call of its own: mixing it into the decode call buys
        # nothing here (the split separates them anyway), and alone its numerics never
        # depend on the load.
        settings = self._backend.settings
        decoders.sort(key=_seq_id)
        alone: list[_Sequence] = []
        if settings.batch_invariant:
            # past the limit, a decode beside others differs from a lone one (flash
            # attention's split-KV path is taken only alone): decode it alone
            limit = self.shared_context_limit
            alone = [s for s in decoders if s.pos + 1 > limit]
            if alone:
                decoders = [s for s in decoders if s.pos + 1 <= limit]
        if self.verify_width > 1 and len(decoders) + len(alone) == 1:
            # a stream that decodes alone: guess its next tokens, verified in its call
            lone = decoders[0] if decoders else alone[0]
            try:
                self._plan_draft(lone)
            except Exception:  # (an optimisation: never a reason to fail anything)
                logger.exception("drafting failed; the stream decodes one token per call from now on")
                lone.draft = []
                lone.speculate = False
        calls: list[list[tuple[_Sequence, int]]] = [
            [(s, 0) for s in group] for group in _split(decoders, self.max_call_width)
        ]
        calls += [[(s, 0)] for s in alone]
        if prefillers:
            # one piece of the canonical cut, whatever the load: the calls a fresh
            # server makes, so cached pieces are exactly what it would compute
            first = prefillers[0]
            end = next_cut(first.cuts, first.prefilled, len(first.prompt))
            calls.append([(first, end - first.prefilled)])
        # 3. run them
        for call in calls:
            try:
                self._decode_call(call)
            except Exception as exc:
                # (a bookkeeping error around the call: its sequences fail, not the server)
                logger.exception("a decode call failed in the scheduler; its requests fail, the others go on")
                for sequence, _ in call:
                    if sequence.result is None:
                        self._remove(sequence, self._failed(sequence, f"inference failed: {exc!r}"))
        self.steps += 1

    def _decode_call(self, call: list[tuple[_Sequence, int]]) -> None:
        """One ``llama_decode`` call; its pieces go to their channels, and finished
        sequences back to their requests."""
        backend = self._backend
        lib = backend.lib
        batch = self.batch
        tokens = batch.token
        positions = batch.pos
        seq_ids = batch.seq_id
        logits = batch.logits
        n = 0
        outputs: list[tuple[_Sequence, int]] = []  # (sequence, batch index of its logits)
        #: speculative decoding: the guessed tokens a sequence's rows verify
        drafts: dict[_Sequence, list[int]] = {}
        for sequence, count in call:
            seq_id = sequence.seq_id
            if count == 0:  # decode one token
                tokens[n] = sequence.next_token
                positions[n] = sequence.pos
                seq_ids[n][0] = seq_id
                logits[n] = 1
                outputs.append((sequence, n))
                n += 1
                if sequence.draft:  # and verify the tokens guessed after it
                    draft = sequence.draft
                    sequence.draft = []
                    drafts[sequence] = draft
                    for j, guess in enumerate(draft, start=1):
                        tokens[n] = guess
                        positions[n] = sequence.pos + j
                        seq_ids[n][0] = seq_id
                        logits[n] = 1
                        n += 1
            else:
                if not sequence.first_chunk_at:
                    sequence.first_chunk_at = time.perf_counter()
                start = sequence.prefilled
                prompt = sequence.prompt
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
        with self._condition:
            if any(s.cancelled for s, _ in call) or self._stopping:
                return  # dropped at the next step
            self.abort_flag.value = 0
            self._in_flight = {s: (c or 1 + len(drafts.get(s, ()))) for s, c in call}
            self._in_flight_tokens = n
        # the cores, shared with embeddings: a cancel while waiting aborts the call at once
        with backend.embedder.turns.turn():
            result = lib.llama_decode(self.ctx, batch)
        with self._condition:
            self._in_flight = {}
        if result == _DECODE_ABORTED:
            # Survivors redo the call from the same state. llama.cpp rolls back the
            # ubatch it was computing (a mutation test removing the line below still
            # passed the shared-call abort test), but "processed ubatches remain in
            # the context's memory" (llama.h) when a call was split: remove every cell
            # this call may have written.
            self.aborted_calls += 1
            for sequence, count in call:
                start = sequence.pos if count == 0 else sequence.prefilled
                if self._trim(sequence.seq_id, start) != start and not sequence.cancelled:
                    # (a model without partial removal aborts only all-cancelled calls)
                    self._remove(sequence, BackendError("an aborted decode call could not be rolled back"))
            return
        if result != 0:
            for sequence, _ in call:
                self._remove(sequence, self._failed(sequence, f"llama_decode failed with code {result}"))
            return
        now = time.perf_counter()
        for sequence, count in call:
            if count:
                sequence.prefilled += count
                sequence.pos = sequence.prefilled
                sequence.progress.prefilled_tokens = sequence.prefilled
                if sequence.decoding:
                    sequence.progress.prefill_seconds = now - sequence.first_chunk_at
                    if sequence.followers:
                        outputs += self._share_prompt(sequence, outputs)
            else:
                sequence.pos += 1
        emit = self._emit
        for sequence, index in outputs:
            token = emit(sequence, index)
            if drafts and sequence in drafts:
                self._verify(sequence, index, token, drafts[sequence])

    def _emit(self, sequence: _Sequence, index: int) -> int:
        """Draw ``sequence``'s token from output ``index`` of the last call and send its
        piece; -1 if the sequence ended there (end of text, its length, a constraint
        that failed)."""
        backend = self._backend
        lib = backend.lib
        entry = None
        if sequence.special:
            # a constraint's mask and/or log-probabilities (docs/batching.md)
            drawn = draw_special(
                lib,
                self.ctx,
                index,
                backend.n_vocab,
                sequence.sampler,
                greedy=sequence.greedy,
                mask=sequence.mask,
                logprobs=sequence.logprobs,
                bias=sequence.bias,
                piece=backend.piece,
            )
            if isinstance(drawn, str):
                error = BackendError(f"constrained decoding failed: {drawn}", should_retry=False)
                self._remove(sequence, error)
                return -1
            token, entry = drawn
        else:
            token = draw(lib, self.ctx, index, backend.n_vocab, sequence.sampler, sequence.greedy)
        if lib.llama_vocab_is_eog(backend.vocab, token):
            self._remove(sequence, "stop")
            return -1
        if sequence.mask is not None:
            refused = sequence.mask.consume(token)
            if refused is not None:
                self._remove(
                    sequence, BackendError(f"constrained decoding failed: {refused}", should_retry=False)
                )
                return -1
        sequence.generated += 1
        sequence.generated_tokens.append(token)
        sequence.progress.completion_tokens += 1
        piece = backend.piece(token)
        sequence.channel.put(piece if entry is None else (piece, entry))  # type: ignore[arg-type]
        if sequence.generated == sequence.max_new:
            self._remove(sequence, "length")  # after its last piece: order is kept
            return -1
        sequence.next_token = token
        return token

    def _plan_draft(self, sequence: _Sequence) -> None:
        """Guess the tokens after ``sequence``'s next one (prompt lookup), as many as its
        verify call may hold: the exact width, the room in its channel, its token limit
        and (auto) the context where a lone step's attention changes path."""
        sequence.draft = []
        if not sequence.speculate:
            return
        channel = sequence.channel
        room = channel.room
        if self.speculation == "fast" and room == channel.capacity:
            # fast: a reader that has taken every piece may get a run longer than the
            # channel's window (at most FAST_DRAFT + 1 pieces at once: still bounded); a
            # reader that is behind keeps the window, and pauses the stream as before
            room = self.verify_width
        limit = min(
            self.verify_width - 1,
            room - 1,
            sequence.max_new - sequence.generated - 1,
            self.verify_context_limit - sequence.pos - 1,
        )
        if limit <= 0:
            return
        drafter = sequence.drafter
        if drafter is None:
            drafter = sequence.drafter = Drafter(sequence.prompt, longest=self.verify_width - 1)
        # the drafter's context: every token in the KV cells (the last one drawn is not yet)
        generated = sequence.generated_tokens
        done = len(drafter.context) - len(sequence.prompt)
        if done < len(generated) - 1:
            drafter.extend(generated[done:-1])
        draft = drafter.propose(sequence.next_token, limit)
        if draft and sequence.mask is not None:
            # a guess the constraint forbids is not proposed
            draft = draft[: sequence.mask.valid_prefix(draft)]
            if len(draft) < SHORTEST_DRAFT:
                draft = []
        sequence.draft = draft

    def _verify(self, sequence: _Sequence, index: int, token: int, draft: list[int]) -> None:
        """After the call that decoded ``sequence``'s token at output ``index`` and its
        ``draft`` in the rows after it: accept the longest prefix of the draft the model
        agrees with (each accepted row's draw is that of a one-token step), remove the
        cells of the rest."""
        if token < 0:
            return  # ended at the token itself: no guess was verified
        # (counted before each piece is sent: the request may end with any of them, and
        # it reads its counters as soon as it is handed back)
        stats = self.spec_stats
        progress = sequence.progress
        stats.verify_calls += 1
        stats.proposed += len(draft)
        progress.draft_proposed += len(draft)
        accepted = 0
        for guess in draft:
            if token != guess:
                break
            accepted += 1
            stats.accepted += 1
            progress.draft_accepted += 1
            sequence.pos += 1  # the guess's cell is the sequence's now
            token = self._emit(sequence, index + accepted)
            if token < 0:
                break
        if sequence.drafter is not None:
            sequence.drafter.settle(len(draft), accepted)
        if sequence.result is not None:
            return  # ended inside the run: its cells are released already
        if accepted < len(draft) and not self._backend.lib.llama_memory_seq_rm(
            self.memory, sequence.seq_id, sequence.pos, -1
        ):  # pragma: no cover - (speculation needs partial removal: checked at load)
            self._remove(sequence, BackendError("the rejected guesses' cells could not be removed"))

    def _share_prompt(
        self, leader: _Sequence, outputs: list[tuple[_Sequence, int]]
    ) -> list[tuple[_Sequence, int]]:
        """``leader``'s prompt is evaluated: copy its cells to each waiting choice of its
        group, which then draws its first token from the same logits.

        The copy is the leader's sequence state (``llama_state_seq_get_data``, then
        ``set_data`` into each follower: its prompt cells only, done when the call
        returns). Not ``llama_memory_seq_cp``: between sequences of a non-unified cache
        that copies the follower's whole stream, and only at the start of the next
        ``llama_decode`` — after a save to or restore from the host tier could already
        have read or written those cells (measured: logits off by up to 11.5)."""
        lib = self._backend.lib
        index = next(i for s, i in outputs if s is leader)
        waiting = [f for f in leader.followers if not f.cancelled]  # (the cancelled: dropped next step)
        leader.followers = []
        for follower in waiting:
            # detached first: if what follows fails, each evaluates the prompt itself
            # rather than waiting for a leader that has gone
            follower.leader = None
        if not waiting:
            return []
        size = lib.llama_state_seq_get_size(self.ctx, leader.seq_id)
        state = StateBuffer(size).array  # (unmapped when this returns)
        written = lib.llama_state_seq_get_data(self.ctx, state, size, leader.seq_id)
        shared = []
        for follower in waiting:
            self._trim(follower.seq_id, 0)
            if not written or not lib.llama_state_seq_set_data(self.ctx, state, written, follower.seq_id):
                # pragma: no cover - llama.cpp refused: this choice evaluates the prompt itself
                logger.warning("could not share a prompt's cells; a choice evaluates it again")
                self._trim(follower.seq_id, 0)
                continue
            follower.prefilled = follower.pos = leader.prefilled
            follower.progress.prefill_seconds = leader.progress.prefill_seconds
            shared.append((follower, index))
        return shared


def _choice(sequence: _Sequence) -> int:
    return sequence.choice


class LlamaBackend(LlamaModel):
    """llama.cpp inference: every running request is a sequence of one context, and
    one scheduler thread decodes them together (``docs/batching.md``).

    Create it with :meth:`load` / :meth:`aload` and :class:`LlamaSettings`.
    ``generations`` counts the generations inside the scheduler (submitted and not
    yet removed with their KV cells cleared): what a cancel must bring back to zero.
    """

    def _create_contexts(self) -> None:
        # the embedding context: created on the first /v1/embeddings (docs/embeddings.md);
        # the scheduler takes its turns on the cores from it (CpuTurns)
        self._embedder = Embedder(self, self.settings.pooling)
        self._scheduler = _Scheduler(self)

    @property
    def embedding_size(self) -> int | None:
        return int(self.lib.llama_model_n_embd(self.model))

    @property
    def embedder(self) -> Embedder:
        return self._embedder

    async def embed(self, inputs: Sequence[Sequence[int]]) -> list[list[float]]:
        for i, item in enumerate(inputs):
            bad = [t for t in item if not 0 <= t < self.n_vocab]
            if bad:
                raise InvalidRequestError(
                    f"input[{i}] holds {bad[0]}, which is not a token id of this model: its ids are 0 to "
                    f"{self.n_vocab - 1}",
                    param="input",
                )
        return await self._embedder.embed(inputs)

    @property
    def max_call_width(self) -> int:
        """The widest ``llama_decode`` call (sequences) the scheduler makes."""
        return self._scheduler.max_call_width

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
        return self._scheduler.in_flight(progress)

    def rows_in_flight(self, progress: GenerationProgress) -> int:
        """Rows of the call in flight for this generation: more than one while decoding
        is a speculative verify call (docs/speculation.md). An observable for tests."""
        return self._scheduler.rows_in_flight(progress)

    @property
    def failure(self) -> BaseException | None:
        """Why the scheduler thread stopped serving, if it failed (then every request
        fails and ``/health`` says so)."""
        return self._scheduler.failure

    def cache_stats(self) -> dict[str, object]:
        """The prompt cache: the cut, and the prompt tokens each idle sequence keeps."""
        return self._scheduler.cache_stats().as_dict()

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
            "sequences": self.generations.running,
            "max_call_width": self.max_call_width,
            "shared_context_limit": self._scheduler.shared_context_limit,
            "batch_invariant": self.settings.batch_invariant,
            "steps": self.steps,
            "aborted_calls": self.aborted_calls,
            "speculation": self.speculation_stats(),
        }

    def speculation_stats(self) -> dict[str, object]:
        """Speculative decoding (docs/speculation.md): the mode, the verify call's measured
        width and context limit, and the guessed tokens verified and accepted."""
        scheduler = self._scheduler
        stats = scheduler.spec_stats
        return {
            "mode": scheduler.speculation,
            "verify_width": scheduler.verify_width,
            "context_limit": scheduler.verify_context_limit,
            "verify_calls": stats.verify_calls,
            "proposed": stats.proposed,
            "accepted": stats.accepted,
        }

    def _stop_scheduler(self) -> None:
        thread = self._scheduler.stop()
        if thread is not None:
            thread.join()

    def _release_contexts(self) -> None:
        self._stop_scheduler()
        if self._host_cache is not None and self._scheduler.host is self._host_cache:
            saved = self._scheduler.spill()
            # its entries go first when another model's need the shared budget
            self._host_cache.active = False
            if saved:
                logger.info("kept %d cached prefix(es) in host memory for the next load", saved)
        self._scheduler.free()
        self._embedder.free()

    async def generate(
        self, prompt: PreparedPrompt, channel: PieceChannel, progress: GenerationProgress
    ) -> GenerationEnd:
        if prompt.max_new_tokens <= 0:
            await trio.lowlevel.checkpoint()
            return "length"  # nothing to generate
        scheduler = self._scheduler
        bias = prompt.logit_bias if isinstance(prompt.logit_bias, LogitBias) else None
        if bias is None and prompt.request.sampling.logit_bias:  # (a prompt not from prepare)
            bias = LogitBias(prompt.request.sampling.logit_bias)
        sampler = self._sampler(
            prompt.request.sampling,
            max_new_tokens=prompt.max_new_tokens,
            seed_offset=prompt.choice,
            bias=bias,
        )
        sequence = _Sequence(prompt, progress, sampler, channel, bias)
        channel.on_room = scheduler.wake
        with self.generations:
            try:
                scheduler.submit(sequence)
            except BaseException:
                self.lib.llama_sampler_free(sequence.sampler)
                raise
            try:
                await sequence.removed.wait()
            finally:
                if not sequence.removed.is_set():
                    scheduler.cancel(sequence)
                    with trio.CancelScope(shield=True):
                        await sequence.removed.wait()
        result = sequence.result
        if isinstance(result, BaseException):
            # one error object can end several sequences (a failed call, a dead
            # scheduler): give each request its own
            retry = result.should_retry if isinstance(result, BackendError) else None
            raise BackendError(str(result), should_retry=retry) from None
        if result == "stop" or result == "length":
            return result
        # removed as cancelled: the request's own Cancelled is raised here
        await trio.lowlevel.checkpoint_if_cancelled()
        raise BackendError("the sequence was dropped, but its request was not cancelled")
